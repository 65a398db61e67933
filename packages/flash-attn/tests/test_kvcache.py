"""flash-attn: attention over a KV cache (`flash_attn_with_kvcache`), contiguous or paged, with
the new rows appended in place.

Every call is checked three ways: the cache after the call equals the cache with the reference's
append (rows outside the append untouched, bit for bit), o and the LSE meet FlashAttention's
rule against the float64 reference, and every value is finite. Cache rows the call must not
read (past each sequence's length, spare pages) hold NaN, so a read of one shows. Paged and
contiguous caches holding the same keys give bitwise the same output.

The kernel families come from the chooser: `KV_FAMILIES` sweeps the options the host path reads
(cache form and page size, per-sequence or one length, causal, window, softcap) as on an H100
and keeps one call per family; on the GPU each runs eager, under torch.compile(fullgraph=True)
and captured in a CUDA graph replayed with new lengths and block tables.

Runs the real Triton kernels, on the GPU or under the Triton interpreter.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, replace

import pytest
import torch
from attn_cases import ATOL, RULE, assert_rule
from torch._subclasses.fake_tensor import FakeTensorMode

from kernelkit.flash_attn import families, flash_attn_with_kvcache
from kernelkit.flash_attn import kvcache as kv_checks
from kernelkit.flash_attn import tables as T
from kernelkit.flash_attn.choose import choose_fwd
from kernelkit.flash_attn.config import FWD_SPLIT, H100, KVCache, Problem
from kernelkit.flash_attn.kvcache import kvcache_forward
from kernelkit.flash_attn.reference import attention_kvcache_reference, kvcache_append_reference
from kernelkit.flash_attn.validation import window_for
from kernelkit.shared.runtime import use_triton
from kernelkit.shared.testing import run_without_interpreter


@dataclass(frozen=True)
class KVCall:
    """One decode step: q (b, nq, h, d) against a cache of `cap` rows per sequence (contiguous,
    or paged with `page` rows per page, pages shuffled among spares), `n_new` rows appended at
    `lengths` (per sequence: a tensor; `one_length`: the int lengths[0] for every sequence)."""

    b: int = 2
    nq: int = 1
    cap: int = 96
    h: int = 4
    hkv: int = 1
    d: int = 32
    page: int = 0
    lengths: tuple[int, ...] = (0, 40)
    one_length: bool = False
    n_new: int = 1
    causal: bool = False
    window: tuple[int, int] = (-1, -1)
    softcap: float = 0.0
    dtype: torch.dtype = torch.bfloat16
    scale_qk: float = 1.0  # q and keys x this (large scores)

    def inputs(self, device, seed=0):
        """(q, k_cache, v_cache, k, v, cache_seqlens, block_table) and the clean contiguous
        cache (B, cap, Hkv, D) (NaN rows zeroed) the reference reads."""
        g = torch.Generator().manual_seed(seed)

        def r(*shape, scale=1.0):
            return (torch.randn(shape, generator=g, dtype=torch.float64) * scale).to(self.dtype)

        sc = self.scale_qk
        q = r(self.b, self.nq, self.h, self.d, scale=sc)
        clean = (r(self.b, self.cap, self.hkv, self.d, scale=sc),
                 r(self.b, self.cap, self.hkv, self.d))  # fmt: skip
        for t in clean:  # rows past each sequence's length: never read
            for b, n in enumerate(self.seqlens()):
                t[b, n:] = 0.0
        k, v = (r(self.b, self.n_new, self.hkv, self.d, scale=s) if self.n_new else None
                for s in (sc, 1.0))  # fmt: skip
        caches = [t.clone() for t in clean]
        for t in caches:
            for b, n in enumerate(self.seqlens()):
                t[b, n:] = math.nan
        table = None
        if self.page:
            per = self.cap // self.page
            spare = 3
            perm = torch.randperm(self.b * per + spare, generator=g)
            table = perm[: self.b * per].view(self.b, per).to(torch.int32)
            paged = []
            for t in caches:
                pages = torch.full((self.b * per + spare, self.page, self.hkv, self.d), math.nan,
                                   dtype=self.dtype)  # fmt: skip
                pages[table.flatten().long()] = t.view(self.b * per, self.page, self.hkv, self.d)
                paged.append(pages)
            caches = paged
            table = table.to(device)
        seqlens = (
            self.lengths[0] if self.one_length else torch.tensor(self.lengths, dtype=torch.int32)
        )
        to = lambda t: None if t is None else t.to(device)  # noqa: E731
        seqlens = seqlens if self.one_length else to(seqlens)
        return (to(q), *map(to, caches), to(k), to(v), seqlens, table), [to(t) for t in clean]

    def seqlens(self):
        return [self.lengths[0]] * self.b if self.one_length else list(self.lengths)

    def call(self, q, k_cache, v_cache, k, v, seqlens, table):
        return flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=seqlens,
                                       block_table=table, causal=self.causal,
                                       window_size=self.window, softcap=self.softcap,
                                       return_lse=True)  # fmt: skip

    def __str__(self):
        form = f"paged{self.page}" if self.page else "contig"
        flags = [n for n in ("one_length", "causal") if getattr(self, n)]
        if self.window != (-1, -1):
            flags.append(f"window{self.window}")
        if self.softcap:
            flags.append("softcap")
        return f"{form}-nq{self.nq}-new{self.n_new}-{str(self.dtype)[6:]}-" + "-".join(flags)


def expected(call: KVCall, args, clean):
    """(cache after the append as (B, cap, Hkv, D) pair, o and LSE in float64, o in the input
    dtype) from the reference."""
    q, _, _, k, v, _, _ = args
    lengths = torch.tensor(call.seqlens(), dtype=torch.int32, device=q.device)
    kc, vc = (t.clone() for t in clean)
    if call.n_new:
        kvcache_append_reference(kc, vc, k, v, lengths)
    opts = dict(causal=call.causal, window_size=window_for(call.window, call.causal, call.nq,
                call.cap), softcap=call.softcap, return_lse=True)  # fmt: skip
    hi = attention_kvcache_reference(q.double(), kc.double(), vc.double(), lengths + call.n_new,
                                     **opts)  # fmt: skip
    low = attention_kvcache_reference(q, kc, vc, lengths + call.n_new, **opts)
    return (kc, vc), hi, low


def contiguous(call: KVCall, cache, table):
    """A paged cache's rows as (B, cap, Hkv, D)."""
    if not call.page:
        return cache
    return cache[table.long()].flatten(1, 2)


def check(call: KVCall, device, got=None, args=None, clean=None):
    if args is None:
        args, clean = call.inputs(device)
    (kc, vc), (o64, lse64), (o_low, _) = expected(call, args, clean)
    o, lse = call.call(*args) if got is None else got
    _, k_cache, v_cache, _, _, _, table = args
    for name, cache, want in (("k_cache", k_cache, kc), ("v_cache", v_cache, vc)):
        have = contiguous(call, cache, table)
        for b, n in enumerate(call.seqlens()):  # the rows in use, appended ones included
            assert torch.equal(have[b, : n + call.n_new], want[b, : n + call.n_new]), name
            assert have[b, n + call.n_new :].isnan().all(), f"{name}: rows past the append"
    assert_rule(o, o64, o_low, RULE[0], "o", ATOL[call.dtype])
    torch.testing.assert_close(lse, lse64.float(), atol=1e-4, rtol=1e-4, equal_nan=True)
    assert torch.isfinite(o).all()
    return o, lse


# ------------------------------------------------------------------------------------------
# Against the reference
# ------------------------------------------------------------------------------------------

CASES = [
    KVCall(),
    KVCall(page=16),
    KVCall(n_new=0, lengths=(0, 96)),  # an empty sequence and a full cache
    KVCall(page=16, n_new=0, lengths=(96, 17), dtype=torch.float16),
    KVCall(nq=3, n_new=7, lengths=(89, 20), causal=True),  # the append fills the cache
    KVCall(page=32, nq=3, n_new=7, lengths=(0, 50), causal=True, dtype=torch.float16),
    KVCall(page=16, nq=2, n_new=1, lengths=(60, 7), causal=True, window=(24, -1), softcap=5.0),
    KVCall(h=2, hkv=2, d=64, nq=4, n_new=4, lengths=(30, 30), one_length=True, causal=True),
    KVCall(page=16, n_new=5, lengths=(33, 33), one_length=True, window=(10, 2)),
]


@pytest.mark.parametrize("call", CASES, ids=str)
def test_kvcache(call, device):
    check(call, device)


def test_kvcache_large_scores_fp16(device):
    """fp16 inputs x 30: scores in the thousands, whose exponentials overflow without the
    running max; every value finite."""
    check(KVCall(page=16, nq=2, n_new=3, lengths=(12, 70), causal=True, dtype=torch.float16,
                 scale_qk=30.0), device)  # fmt: skip


def test_paged_equals_contiguous_bitwise(device):
    """The same keys in a shuffled paged cache and a contiguous one give the same bits under one
    config: the chosen one (at this size the same for both forms) and one with pointer loads
    forced (the paged-rows path). Where the chooser gives a paged form its own tile or split
    count (pages of 16 or 64 at small batches on a GPU), the forms agree by the accuracy rule
    instead (`test_kvcache`)."""
    base = KVCall(nq=2, n_new=3, lengths=(70, 9), causal=True, softcap=4.0)
    outs = {}
    for page, tma in itertools.product((0, 16), (True, False)):
        call = replace(base, page=page)
        args, clean = call.inputs(device)
        q, kc, vc, k, v, seqlens, table = args
        cache = KVCache(seqlens, 0, call.n_new, table, page, call.cap)
        config = None
        if not tma:
            window = window_for(call.window, call.causal, call.nq, call.cap)
            p = Problem.of_cache(q, kc, vc, cache, call.causal, window, call.softcap)
            config = replace(choose_fwd(p), tma=False)
        got = kvcache_forward(q, kc, vc, k, v, cache, call.causal, call.d**-0.5,
                              softcap=call.softcap, config=config)  # fmt: skip
        check(call, device, got=got, args=args, clean=clean)
        outs[page, tma] = got
    first = outs[0, True]
    for key, (o, lse) in outs.items():
        assert torch.equal(o, first[0]) and torch.equal(lse, first[1]), key


def test_whole_cache_without_seqlens(device):
    """cache_seqlens=None: every sequence sees the whole cache (no append)."""
    call = KVCall(lengths=(96, 96), n_new=0, one_length=True)
    args, clean = call.inputs(device)
    q, kc, vc, *_ = args
    got = flash_attn_with_kvcache(q, kc, vc, return_lse=True)
    check(call, device, got=got, args=args, clean=clean)


def test_torch_compile_decode_step(device):
    """A decode step through torch.compile(fullgraph=True): the append is a mutation of the
    caches the graph declares (the op's mutates_args)."""
    call = KVCall(page=16, nq=2, n_new=2, lengths=(31, 64), causal=True)
    args, clean = call.inputs(device)
    backend = "inductor" if device.type == "cuda" else "aot_eager"
    compiled = torch.compile(call.call, fullgraph=True, backend=backend)
    check(call, device, got=compiled(*args), args=args, clean=clean)


_REFERENCE_WITHOUT_INTERPRETER = """
import math, torch
from kernelkit.flash_attn import flash_attn_with_kvcache
from kernelkit.flash_attn.reference import attention_reference
kc, vc = torch.randn(2, 32, 2, 16), torch.randn(2, 32, 2, 16)
q, k, v = torch.randn(2, 3, 4, 16), torch.randn(2, 2, 2, 16), torch.randn(2, 2, 2, 16)
lens = torch.tensor([5, 30], dtype=torch.int32)
o = torch.compile(lambda *a: flash_attn_with_kvcache(*a, cache_seqlens=lens, causal=True),
                  fullgraph=True, backend="aot_eager")(q, kc, vc, k, v)
for b, n in enumerate((7, 32)):
    assert torch.equal(kc[b, n - 2 : n], k[b]) and torch.equal(vc[b, n - 2 : n], v[b])
    ref = attention_reference(q[b : b + 1], kc[b : b + 1, :n], vc[b : b + 1, :n], causal=True)
    torch.testing.assert_close(o[b : b + 1], ref, rtol=1e-5, atol=1e-5)
print("ok")
"""


def test_reference_on_cpu_without_interpreter():
    """CPU tensors without the interpreter run the PyTorch reference (append included), also
    under torch.compile(fullgraph=True); it agrees with `attention_reference` on each
    sequence's slice of the cache."""
    assert run_without_interpreter(_REFERENCE_WITHOUT_INTERPRETER).strip().endswith("ok")


# ------------------------------------------------------------------------------------------
# Errors
# ------------------------------------------------------------------------------------------


def _error_cases(device):
    def t(*shape, dtype=torch.float16):
        return torch.zeros(shape, dtype=dtype, device=device)

    q, kc, new = t(2, 1, 4, 32), t(2, 64, 2, 32), t(2, 3, 2, 32)
    pages, table = t(8, 16, 2, 32), torch.zeros(2, 4, dtype=torch.int32, device=device)
    lens = torch.zeros(2, dtype=torch.int32, device=device)
    return [
        ((q.tolist(), kc, kc), {}, "q: expected a torch.Tensor"),
        ((t(2, 1, 4, 32, dtype=torch.int32), kc, kc), {}, "q: dtype"),
        ((q, t(2, 64, 2, 32, dtype=torch.bfloat16), kc), {}, "k_cache: dtype"),
        ((q, kc, t(2, 64, 2, 8)), {}, "v_cache: value head dim Dv=8"),
        ((q, kc, t(2, 32, 2, 32)), {}, "v_cache: shape"),
        ((q, t(3, 64, 2, 32), t(3, 64, 2, 32)), {}, "k_cache: batch size 3"),
        ((q, t(2, 64, 3, 32), t(2, 64, 3, 32)), {}, "not a multiple"),
        ((q, kc.transpose(1, 3), kc), {}, "k_cache: head dim"),
        ((q, kc, kc, new), {"cache_seqlens": lens}, "k, v: give both"),
        ((q, kc, kc, new, new), {}, "cache_seqlens: required"),
        ((q, kc, kc, new, t(2, 3, 2, 32, dtype=torch.bfloat16)), {"cache_seqlens": 0}, "v: dtype"),
        ((q, kc, kc, t(2, 3, 1, 32), t(2, 3, 1, 32)), {"cache_seqlens": 0}, "k: shape"),
        ((q, kc, kc, new, new), {"cache_seqlens": 62}, "exceeds the cache's 64 rows"),
        ((q, kc, kc), {"cache_seqlens": -1}, "cache_seqlens: -1"),
        ((q, kc, kc), {"cache_seqlens": 1.5}, "cache_seqlens: expected an int"),
        ((q, kc, kc), {"cache_seqlens": lens.long()}, "cache_seqlens: expected an int32"),
        ((q, kc, kc), {"cache_seqlens": lens[:1]}, r"cache_seqlens: expected an int32 tensor of shape \(2,\)"),
        ((q, pages, pages), {"block_table": table.long()}, "block_table: dtype"),
        ((q, pages, pages), {"block_table": table[:1]}, "block_table: 1 rows"),
        ((q, t(8, 24, 2, 32), t(8, 24, 2, 32)), {"block_table": table}, "page_size 24"),
        ((q, pages, pages), {"block_table": table, "causal": 1}, "causal: expected a bool"),
        ((q, pages, pages), {"block_table": table.t().contiguous().t()}, "block_table: each row"),
        ((q, kc, kc), {"cache_seqlens": torch.zeros(4, dtype=torch.int32, device=device)[::2]},
         "cache_seqlens: must be contiguous"),
        ((q, kc, kc), {"window_size": (3,)}, "window_size"),
        ((q, kc, kc), {"softcap": -1.0}, "softcap"),
    ]  # fmt: skip


def test_errors(device):
    for args, kw, match in _error_cases(device):
        with pytest.raises(ValueError, match=match):
            flash_attn_with_kvcache(*args, **kw)


def _structure_tensors(device):
    """(t, q, k_cache, k, pages, block_table, cache_seqlens, a fake q) of the structure tests'
    small calls; t(*shape, dtype=float16) makes more."""

    def t(*shape, dtype=torch.float16):
        return torch.zeros(shape, dtype=dtype, device=device)

    with FakeTensorMode():
        fake = torch.empty(2, 1, 4, 32, dtype=torch.float16, device=device)
    table = torch.zeros(2, 4, dtype=torch.int32, device=device)
    lens = torch.zeros(2, dtype=torch.int32, device=device)
    return t, t(2, 1, 4, 32), t(2, 64, 2, 32), t(2, 3, 2, 32), t(8, 16, 2, 32), table, lens, fake


def test_common_call_accepts_only_what_the_checks_accept(device):
    """`validate_kvcache`'s one-expression check of the common serving call (an int32
    cache_seqlens tensor) against its checks one by one: for a valid call and every change of
    one argument, either both accept with the same (page_size, capacity, Nnew), or the
    one-expression check declines (None) and the checks raise."""
    t, q, kc, new, pages, table, lens, fake = _structure_tensors(device)
    vc = t(2, 64, 2, 48)
    bases = {  # (q, k_cache, v_cache, k, v, cache_seqlens, block_table)
        "contiguous": (q, kc, kc, None, None, lens, None),
        "append, Dv": (q, kc, vc, new, t(2, 3, 2, 48), lens, None),
        "paged": (q, pages, pages, new, new, lens, table),
    }
    changes = [
        (0, t(2, 1, 4, 32, dtype=torch.int32)), (0, t(2, 0, 4, 32)), (0, t(2, 1, 4, 8)),
        (0, t(1, 2, 1, 4, 32)), (0, t(2, 1, 3, 32)), (0, q.bfloat16()), (0, fake),
        (0, torch.nn.Parameter(q)), (1, t(2, 64, 2, 32, dtype=torch.bfloat16)),
        (1, t(3, 64, 2, 32)), (1, t(2, 64, 3, 32)), (1, kc.transpose(1, 3)), (1, t(2, 32, 2, 32)),
        (1, t(2, 64, 2, 16)), (1, t(8, 24, 2, 32)), (2, t(2, 64, 2, 8)), (2, t(2, 32, 2, 32)),
        (2, t(2, 64, 2, 64)[..., ::2]), (3, None), (3, new.bfloat16()), (3, t(2, 3, 1, 32)),
        (3, t(1, 3, 2, 32)), (3, t(2, 4, 2, 32)), (3, t(2, 3, 2, 16)), (4, None),
        (4, t(2, 3, 2, 32, dtype=torch.bfloat16)), (4, t(2, 3, 2, 16)), (4, t(2, 2, 2, 32)),
        (5, lens.long()), (5, lens[:1]), (5, torch.zeros(4, dtype=torch.int32, device=device)[::2]),
        (5, lens[None]), (5, 3), (5, None), (5, 1.5), (6, table.long()), (6, table[:1]),
        (6, table.t().contiguous().t()), (6, table[0]), (6, None),
    ]  # fmt: skip
    for name, base in bases.items():
        for i, value in [(None, None), *changes]:
            args = list(base)
            if i is not None:
                args[i] = value
            try:
                expected = kv_checks._check_structure(*args)
            except ValueError:
                expected = None
            got = kv_checks._common_call(*args)
            if i is None:  # the valid call: both accept
                assert got is not None and got == expected, (name, got, expected)
            assert got is None or got == expected, (name, i, got, expected)


def _kv_outcome(args, kw):
    """What `flash_attn_with_kvcache`'s checks make of a call: (scale, the cache's length,
    Nnew, page size and capacity, softcap, return_lse, window), or the error."""
    q, kc, vc, k, v, lens, table = args
    try:
        scale, cache = kv_checks.validate_kvcache(q, kc, vc, k, v, lens, table, kw["causal"],
                                                  kw["softmax_scale"])  # fmt: skip
        softcap = kv_checks.check_softcap(kw["softcap"])
        lse = kv_checks.check_bool("return_lse", kw["return_lse"])
        window = window_for(kw["window_size"], kw["causal"], q.shape[1], cache.capacity)
    except ValueError as e:
        return ("error", str(e))
    return (scale, cache.length, cache.n_new, cache.page_size, cache.capacity, softcap, lse,
            window)  # fmt: skip


def test_shortcut_key_holds_what_the_checks_read(device):
    """`flash_attn_with_kvcache`'s shortcut (`kvcache._call_key`: a call like an earlier checked
    one replays its sequence after the checks of values only) is sound: calls with one key pass
    the other checks alike. Valid calls (contiguous, paged, an int cache_seqlens), then every
    change of one argument: another valid value, an invalid one, a value of another type that
    compares equal, tensors of other layouts, dtypes, classes or devices, inputs requiring
    grad, one tensor passed twice."""
    t, q, kc, new, pages, table, lens, fake = _structure_tensors(device)
    vc = kc.clone()
    bases = {  # (q, k_cache, v_cache, k, v, cache_seqlens, block_table)
        "contiguous": (q, kc, vc, new, new.clone(), lens, None),
        "paged": (q, pages, pages.clone(), None, None, lens, table),
        "int length": (q, kc, vc, None, None, 5, None),
    }
    base_kw = {"causal": False, "softmax_scale": None, "window_size": (-1, -1), "softcap": 0.0,
               "return_lse": False}  # fmt: skip
    options = [
        ("causal", True), ("causal", 1), ("softmax_scale", 0.5), ("softmax_scale", 1),
        ("softmax_scale", True), ("softmax_scale", -0.5), ("softmax_scale", math.nan),
        ("window_size", (8, 0)), ("window_size", (8.0, 0)), ("window_size", [8, 0]),
        ("window_size", (-2, 0)), ("window_size", (8,)), ("softcap", 5.0), ("softcap", 5),
        ("softcap", True), ("softcap", -1.0), ("return_lse", True), ("return_lse", 1),
    ]  # fmt: skip
    tensors = [
        (0, t(2, 1, 4, 32, dtype=torch.bfloat16)), (0, t(2, 2, 4, 32)), (0, t(2, 1, 3, 32)),
        (0, fake), (0, torch.nn.Parameter(q)), (0, q.clone().requires_grad_()),
        (1, kc.transpose(1, 2).contiguous().transpose(1, 2)), (1, t(2, 64, 2, 32)[:, :48]),
        (2, None), (2, t(2, 64, 2, 48)), (3, None), (3, t(2, 4, 2, 32)), (4, None),
        (5, 4), (5, 70), (5, True), (5, 4.0), (5, None), (5, lens.long()), (6, None),
        (6, table[:, :2]), (6, table.long()),
    ]  # fmt: skip
    if device.type == "cuda":
        tensors += [(0, q.cpu()), (5, lens.cpu())]
    outcomes: dict = {}
    for base in bases.values():
        calls = [(base, base_kw)]
        calls += [(base, {**base_kw, name: value}) for name, value in options]
        for i, value in tensors:
            args = list(base)
            args[i] = value
            calls.append((tuple(args), base_kw))
        calls.append(((q, kc, kc, new, new, lens, None), base_kw))  # one cache as both
        for args, kw in calls:
            key = kv_checks._call_key(*args, **kw)
            if key is not None:
                outcomes.setdefault(key, set()).add(_kv_outcome(args, kw))
        assert kv_checks._call_key(*base, **base_kw) is not None  # a valid call has a key
    for seen in outcomes.values():
        assert len(seen) == 1, seen  # one key, one outcome


@pytest.mark.parametrize("call", [CASES[1], CASES[4], CASES[8]], ids=str)
def test_repeated_calls_take_the_shortcut(call, device):
    """A call like an earlier one that passed the checks replays its sequence (`_CALLS`): the
    same cache after the append and the same outputs, bitwise, as the checked call."""
    kv_checks._CALLS.clear()
    results = []
    for _ in range(2):
        args, _ = call.inputs(device)
        o, lse = call.call(*args)
        results.append((o, lse, args[1], args[2]))
        assert len(kv_checks._CALLS._plans) == 1
    for a, b in zip(*results):  # (unread cache rows hold NaN)
        torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)


def test_errors_read_on_the_host_only_where_free():
    """CPU tensors' values are checked: lengths past the capacity, page indices in use out of
    range (entries past the pages in use are never read, and may hold anything); also where
    the call takes the shortcut of an earlier one (under the interpreter)."""
    q, pages = torch.zeros(2, 1, 4, 32), torch.zeros(8, 16, 2, 32)
    table = torch.tensor([[0, 1, 2, -1], [3, 4, 5, 99]], dtype=torch.int32)
    lens = torch.tensor([40, 48], dtype=torch.int32)
    kv_checks._CALLS.clear()
    flash_attn_with_kvcache(q, pages, pages, cache_seqlens=lens, block_table=table)
    assert len(kv_checks._CALLS._plans) == int(use_triton(q))
    with pytest.raises(ValueError, match="block_table: the pages in use"):
        flash_attn_with_kvcache(q, pages, pages, cache_seqlens=lens + 1, block_table=table)
    too_long = torch.tensor([40, 65], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"cache_seqlens: lengths 40..65 plus 0 new rows"):
        flash_attn_with_kvcache(q, pages, pages, cache_seqlens=too_long, block_table=table)


def test_not_differentiable(device):
    q = torch.zeros(1, 1, 2, 32, device=device, requires_grad=True)
    kc = torch.zeros(1, 16, 2, 32, device=device)
    with pytest.raises(ValueError, match="q: requires grad, but flash_attn_with_kvcache is forward only"):  # fmt: skip
        flash_attn_with_kvcache(q, kc, kc)
    with torch.no_grad():
        flash_attn_with_kvcache(q, kc, kc)


# ------------------------------------------------------------------------------------------
# Kernel families: from the chooser, each run eager, compiled and graphed on the GPU
# ------------------------------------------------------------------------------------------


def _probe_family(call: KVCall, target=H100) -> str:
    """The family of `call` on CUDA tensors as `target` runs it, from fake tensors."""
    with FakeTensorMode():

        def e(*shape, dtype=call.dtype):
            return torch.empty(shape, dtype=dtype, device="cuda")

        q = e(call.b, call.nq, call.h, call.d)
        if call.page:
            per = call.cap // call.page
            kc = e(call.b * per + 3, call.page, call.hkv, call.d)
            table = e(call.b, per, dtype=torch.int32)
        else:
            kc, table = e(call.b, call.cap, call.hkv, call.d), None
        new = e(call.b, call.n_new, call.hkv, call.d) if call.n_new else None
        seqlens = None if call.one_length else e(call.b, dtype=torch.int32)
        length = call.lengths[0] if call.one_length else 0
        cache = KVCache(seqlens, length, call.n_new, table, call.page, call.cap)
        window = window_for(call.window, call.causal, call.nq, call.cap)
        probe = families.probe_kvcache(q, kc, kc, new, new, cache, call.causal, 0.1,
                                       call.softcap, window, target)  # fmt: skip
    assert probe.config.kernel == FWD_SPLIT
    return families.family(probe)


def _h100_config(call: KVCall):
    """The forward config an H100 takes for `call` (fake tensors)."""
    with FakeTensorMode():
        q = torch.empty(call.b, call.nq, call.h, call.d, dtype=call.dtype, device="cuda")
        per = call.cap // max(call.page, 1)
        shape = (call.b * per, call.page, call.hkv, call.d) if call.page else (
            call.b, call.cap, call.hkv, call.d)  # fmt: skip
        kc = torch.empty(shape, dtype=call.dtype, device="cuda")
        table = torch.empty(call.b, per, dtype=torch.int32, device="cuda") if call.page else None
        seqlens = torch.empty(call.b, dtype=torch.int32, device="cuda")
        cache = KVCache(seqlens, 0, call.n_new, table, call.page, call.cap)
        return choose_fwd(Problem.of_cache(q, kc, kc, cache, False, target=H100))


def test_kvcache_configs_on_h100():
    """The tables' rules for a KV cache (decode, GQA 32/8, d128, bf16, 64k keys): a page per
    key block through TMA where pages hold whole blocks (256: the table's tile; 64:
    PAGED_TILE's), a page per row with twice the splits for pages of 16, pointer loads for
    launches of many waves."""
    base = KVCall(b=8, cap=65536, h=32, hkv=8, d=128)
    contig = _h100_config(base)
    assert contig.kernel == FWD_SPLIT and contig.tma and contig.split.splits == 2
    p256 = _h100_config(replace(base, page=256))
    assert p256.tile == contig.tile and p256.tma and p256.split == contig.split
    p64 = _h100_config(replace(base, page=64))
    assert p64.tma and (p64.tile.block_n, p64.tile.warps, p64.tile.stages) == T.PAGED_TILE
    p16 = _h100_config(replace(base, page=16))
    assert not p16.tma and p16.tile == contig.tile
    assert p16.split.splits == T.PAGED_ROWS_SPLIT_WAVES * contig.split.splits
    assert "a page per row" in p16.why and "a page per key block" in p64.why
    many = _h100_config(replace(base, b=64))
    assert many.split.splits == 1 and not many.tma
    many64 = _h100_config(replace(base, b=64, page=64))  # many waves: the table's tile, rows
    assert many64.tile == contig.tile and not many64.tma


def _sweep():
    """One call per option the host path reads: the cache form (contiguous; pages of 16, 64
    and 256 rows: a page per row or per key block), one length or per-sequence lengths,
    causal, a window's left edge, softcap."""
    base = KVCall(b=2, nq=2, cap=1024, h=8, hkv=2, d=128, lengths=(700, 300), n_new=2)
    for page, one, causal, window, softcap in itertools.product(
        (0, 16, 64, 256), (False, True), (False, True), ((-1, -1), (200, -1)), (0.0, 5.0)
    ):
        yield replace(base, page=page, one_length=one, causal=causal, window=window,
                      softcap=softcap, lengths=(700, 700) if one else base.lengths)  # fmt: skip


def _kv_families():
    found: dict[str, KVCall] = {}
    for call in _sweep():
        found.setdefault(_probe_family(call), call)
    return found


KV_FAMILIES = _kv_families()


def test_kv_families():
    """The sweep reaches the paged kinds and the per-sequence lengths, in every mask."""
    names = set(KV_FAMILIES)
    for tag, count in (("paged-rows", 16), ("paged-tma", 16), ("var_k", 24)):
        assert sum(tag in n for n in names) == count, (tag, sorted(names))
    assert len(names) == 2 * 3 * 8  # (var_k or not) x (contiguous, rows, tma) x masks


def _sm90_gpu(device) -> bool:
    return device.type == "cuda" and torch.cuda.get_device_capability(device) == (9, 0)


def _graphed(call: KVCall, device):
    """A decode step captured in a CUDA graph, replayed after new lengths, block table, q and
    new rows were copied into the captured inputs; checked against an eager call on the same
    state (bitwise: outputs and caches). Returns (outputs, args, clean) of the replay."""
    args, _ = call.inputs(device)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            call.call(*args)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = call.call(*args)
    # (one length for every sequence is an int: a constant of the graph)
    fresh = call if call.one_length else replace(call, lengths=tuple(n // 2 for n in call.lengths))
    new_args, clean = fresh.inputs(device, seed=7)
    for mine, theirs in zip(args, new_args):
        if isinstance(mine, torch.Tensor):
            mine.copy_(theirs)
    graph.replay()
    torch.cuda.synchronize()
    got = [t.clone() for t in captured]
    eager = fresh.call(*new_args)
    for a, b in zip(got, eager):
        assert torch.equal(a, b), "graph replay differs from the eager call"
    for a, b in zip(args[1:3], new_args[1:3]):
        assert torch.equal(a.nan_to_num(), b.nan_to_num()), "caches differ"
    return fresh, got, args, clean


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["eager", "compile", "graph"])
@pytest.mark.parametrize("family", sorted(KV_FAMILIES))
def test_gpu_kv_family(family, mode, device):
    if not _sm90_gpu(device):
        pytest.skip("the families are sm_90's")
    call = KV_FAMILIES[family]
    assert _probe_family(call, target=None) == family
    if mode == "eager":
        check(call, device)
    elif mode == "compile":
        torch._dynamo.reset()
        args, clean = call.inputs(device)
        compiled = torch.compile(call.call, fullgraph=True, backend="inductor")
        check(call, device, got=compiled(*args), args=args, clean=clean)
    else:
        fresh, got, args, clean = _graphed(call, device)
        check(fresh, device, got=got, args=args, clean=clean)
