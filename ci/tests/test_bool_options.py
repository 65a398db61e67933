"""Boolean options of the public functions of act, lrpe-core, lrpe-rotate, lrpe-cosine and
md-lrpe-cosine reject anything but a bool with an error naming the option (issue 27: a string
such as "no" is truthy and would silently switch an option on). flash-attn's are checked by its
own tests.

The scan finds every parameter with a bool default or a `bool` annotation in the public
functions; each must have a call in CALLS, so a new boolean option fails here until it is
validated and listed.
"""

from __future__ import annotations

import importlib
import inspect

import pytest
import torch

MODULES = [
    "kernelkit.act",
    "kernelkit.act.reference",
    "kernelkit.lrpe_core.op",
    "kernelkit.lrpe_core.reference",
    "kernelkit.lrpe_rotate",
    "kernelkit.lrpe_rotate.reference",
    "kernelkit.lrpe_cosine",
    "kernelkit.lrpe_cosine.reference",
    "kernelkit.md_lrpe_cosine",
    "kernelkit.md_lrpe_cosine.reference",
]


def _md_lrpe_cosine(cache):
    from kernelkit.md_lrpe_cosine import md_lrpe_cosine

    return md_lrpe_cosine(torch.ones(1, 13, 2, 8), torch.ones(2, 4), (3, 4), 1, cache=cache)


def _reduce_dtheta(wrap):
    from kernelkit.lrpe_core.op import reduce_dtheta

    return reduce_dtheta(torch.zeros(2, 3, 4), (3, 3), wrap=wrap)


CALLS = {
    ("kernelkit.md_lrpe_cosine", "md_lrpe_cosine", "cache"): _md_lrpe_cosine,
    ("kernelkit.lrpe_core.op", "reduce_dtheta", "wrap"): _reduce_dtheta,
}


def bool_options() -> set[tuple[str, str, str]]:
    found = set()
    for name in MODULES:
        mod = importlib.import_module(name)
        public = getattr(mod, "__all__", [n for n in vars(mod) if not n.startswith("_")])
        for fname in public:
            f = getattr(mod, fname)
            if not inspect.isfunction(f) or not f.__module__.startswith(name.rsplit(".", 1)[0]):
                continue
            for p in inspect.signature(f).parameters.values():
                if isinstance(p.default, bool) or p.annotation in (bool, "bool"):
                    found.add((name, fname, p.name))
    return found


def test_every_bool_option_is_checked_here():
    assert bool_options() == set(CALLS)


@pytest.mark.parametrize("key", sorted(CALLS), ids=lambda k: f"{k[1]}-{k[2]}")
@pytest.mark.parametrize("value", ["no", "", 1, 0, None, 1.0, torch.tensor(True)], ids=repr)
def test_bool_option_rejects_non_bool(key, value):
    with pytest.raises((ValueError, TypeError), match=rf"\b{key[2]}\b"):
        CALLS[key](value)


@pytest.mark.parametrize("key", sorted(CALLS), ids=lambda k: f"{k[1]}-{k[2]}")
def test_bool_option_takes_bools(key):
    for value in (True, False):
        CALLS[key](value)
