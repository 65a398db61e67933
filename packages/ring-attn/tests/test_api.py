"""ring_attn in one process (a group of one rank: the ring is the local attention) and its
argument errors, each naming the argument."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from kernelkit.flash_attn import flash_attn
from kernelkit.ring_attn import check_shards, ring_attn


@pytest.fixture
def one_rank(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0,
                            world_size=1)  # fmt: skip
    yield dist.group.WORLD
    dist.destroy_process_group()


def qkv(n=16, h=4, hkv=2, d=32, dtype=torch.bfloat16, device="cpu"):
    g = torch.Generator().manual_seed(0)
    return tuple(torch.randn(shape, generator=g).to(dtype).to(device)
                 for shape in ((2, n, h, d), (2, n, hkv, d), (2, n, hkv, d)))  # fmt: skip


def test_not_initialized():
    assert not dist.is_initialized()
    with pytest.raises(ValueError, match="group: torch.distributed is not initialized"):
        ring_attn(*qkv())


@pytest.mark.parametrize("causal", [False, True])
def test_one_rank_is_flash_attn(one_rank, causal, device):
    """The kernels' path (the interpreter on CPU, or the GPU; gloo carries the one rank's
    check): the same kernels on the same data as flash_attn, bit for bit."""
    q, k, v = qkv(device=device)
    leaves = [t.requires_grad_() for t in (q, k, v)]
    o, lse = ring_attn(*leaves, causal=causal, return_lse=True)
    grads = torch.autograd.grad(o.float().square().sum(), leaves)
    ref = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    o_ref, lse_ref = flash_attn(*ref, causal, return_lse=True)
    grads_ref = torch.autograd.grad(o_ref.float().square().sum(), ref)
    assert torch.equal(o, o_ref) and torch.equal(lse, lse_ref)
    for g, r in zip(grads, grads_ref):
        assert torch.equal(g, r)


ERRORS = [
    (lambda q, k, v: (q[:, :, 0], k, v), {}, "q: expected a 4-D shard"),
    (lambda q, k, v: (q, k[:, :8], v[:, :8]), {}, "k: holds 8 tokens but q holds 16"),
    (
        lambda q, k, v: (q[:, :15], k[:, :15], v[:, :15]),
        {"causal": True},
        "q: zigzag sharding holds two equal chunks per rank, so N_local must be even, got 15",
    ),
    (lambda q, k, v: (q, k.half(), v), {}, "k: dtype"),
    (lambda q, k, v: (q, k, v), {"layout": "ring"}, "layout: expected one of"),
    (lambda q, k, v: (q, k, v), {"softcap": -1.0}, "softcap: must be finite and >= 0"),
    (lambda q, k, v: (q, k, v), {"return_lse": 1}, "return_lse: expected a bool"),
    (lambda q, k, v: (q, k, v), {"deterministic": "yes"}, "deterministic: expected a bool"),
    (lambda q, k, v: (q, k, v), {"causal": None}, "causal: expected a bool"),
    (lambda q, k, v: (q, k, v), {"sm_margin": -2}, "sm_margin: expected an int >= 0"),
]


@pytest.mark.parametrize("make, kw, message", ERRORS, ids=[e[2][:24] for e in ERRORS])
def test_errors(one_rank, make, kw, message):
    with pytest.raises(ValueError, match=message):
        ring_attn(*make(*qkv()), **kw)


def test_group_must_be_a_process_group(one_rank):
    with pytest.raises(ValueError, match="group: expected a torch.distributed ProcessGroup"):
        ring_attn(*qkv(), group=[0])


def test_check_shards_passes_alike_ranks(one_rank):
    check_shards(*qkv(), causal=True)  # one rank always agrees with itself
    with pytest.raises(ValueError, match="q: bad"):
        check_shards(*qkv(), local_error="q: bad")
