"""flash-attn: the split-KV forward (decoding): keys split across programs, partials merged
through their LSEs. The chooser's split rule as on an H100, and o, LSE and gradients against
the float64 reference (forced split counts against the dense forward too), on cache slices,
deterministic, through opcheck and torch.compile.

Runs the real Triton kernels, on the GPU or under the Triton interpreter (see
test_flash_attn.py); the helpers are in fa_testing.py.
"""

import math

import pytest
import torch
from fa_testing import check, finite, make, meta_problem, problems, qkv, table_fwd

from kernelkit.flash_attn import families, flash_attn
from kernelkit.flash_attn import launch as fa_launch
from kernelkit.flash_attn import tables as T
from kernelkit.flash_attn.choose import choose_fwd, split_config
from kernelkit.flash_attn.config import FWD_GLUON, FWD_SPLIT, Target, Tile
from kernelkit.flash_attn.reference import attention_reference
from kernelkit.shared.testing import assert_close

# ------------------------------------------------------------------------------------------
# Split-KV forward (decoding): keys split across programs, partials merged through their LSEs.
# Under the interpreter the target has 4 stand-in SMs and the split rule is small
# (tables.INTERPRETER_SPLIT_RULE), so a few dozen keys already take several splits; the backward
# is the dense kernels' either way.
# ------------------------------------------------------------------------------------------


def _split(b, nq, nk, h, hkv, d, dtype=torch.bfloat16, num_splits=None, tile=None, left=-1):
    """split_config of a dense call on meta tensors as an H100 sees it: None (the dense
    forward), or (tile, splits, split_len, start)."""
    p = meta_problem(b, nq, nk, h, hkv, d, dtype, window_size=(left, -1))
    cfg = split_config(p, num_splits, tile)
    if cfg is None:
        return None
    assert cfg.kernel == FWD_SPLIT and cfg.why.startswith("split-KV")
    # TMA as the tile asks, but pointer loads for launches of more than SPLIT_TMA_MAX_WAVES
    programs = cfg.split.splits * b * hkv * -(-(h // hkv * nq) // cfg.tile.block_m)
    many = num_splits is None and programs > T.SPLIT_TMA_MAX_WAVES * 132
    assert cfg.tma == (cfg.tile.tma and not many)
    if num_splits is None and tile is None:  # the chooser takes it
        assert choose_fwd(p) == cfg
    return cfg.tile, cfg.split.splits, cfg.split.split_len, cfg.split.start


def test_split_config_rule():
    """The GPU rule, for an H100's 132 SMs."""
    decode = Tile(16, *T.SPLIT_TILES[128])
    # Decode, GQA 32/8: 64 query tiles; one wave: 132 // 64 = 2 splits of 128-key blocks.
    assert _split(8, 1, 4096, 32, 8, 128) == (decode, 2, 2048, 0)
    assert _split(8, 1, 32768, 32, 8, 128) == (decode, 2, 16384, 0)
    # Speculative decoding: 4 query heads x 16 queries = 64 packed rows, one tile.
    tile, splits, *_ = _split(8, 16, 8192, 32, 8, 128)
    assert tile.block_m == 64 and splits == 2
    # Training shapes fill the GPU: the dense forward.
    assert _split(8, 4096, 4096, 32, 8, 128) is None
    assert _split(1, 4096, 4096, 32, 32, 128) is None
    assert choose_fwd(meta_problem(8, 4096, 4096, 32, 8, 128)).kernel == FWD_GLUON
    # Few query rows but many batches: the split kernel, unsplit (GQA packing still pays), with
    # pointer loads (1024 programs: many waves).
    assert _split(128, 1, 4096, 32, 8, 128)[1] == 1
    assert not split_config(meta_problem(128, 1, 4096, 32, 8, 128)).tma
    # Larger Nq that still underfills: 64 rows need 16 * 64 keys per split.
    assert _split(1, 64, 65536, 1, 1, 128)[1] == 64
    # 128 packed rows take the dense forward's tile.
    tile, splits, *_ = _split(8, 32, 4096, 32, 8, 128)
    assert tile == T.FWD_TILES[128] and splits == 2
    assert _split(8, 1, 4096, 32, 8, 128, torch.float32)[0] == Tile(16, *T.SPLIT_FP32_TILES[128])
    # A forced count: runs of whole key blocks of one length (5 blocks in 4 splits: 2, 2, 1).
    assert _split(1, 1, 600, 4, 1, 64, num_splits=4)[1:3] == (3, 256)
    assert _split(1, 1, 600, 4, 1, 64, num_splits=99)[1] == 5
    # A sliding window: only the keys from the first query's window on are split.
    assert _split(8, 1, 32768, 32, 8, 128, left=4095) == (decode, 2, 2048, 28672)


def takes_split_path(q, k, v, causal=False) -> bool:
    """The chooser takes the split-KV forward. Under the interpreter (a 4-SM stand-in) these
    small shapes split the keys several ways; a real GPU gives them one split (several splits
    are forced in test_split_counts_agree_with_dense and run at large shapes on the GPU)."""
    cfg = families.probe_forward(q, k, v, causal, q.shape[-1] ** -0.5).config
    interpreted = Target.of(q.device).interpreter
    return cfg.kernel == FWD_SPLIT and (cfg.split.splits >= 2 or not interpreted)


# (B, Nq, Nk, H, Hkv, D, dtype, causal)
SPLIT_CASES = [
    (2, 1, 100, 4, 1, 128, torch.bfloat16, True),  # decode, MQA; Nk no multiple of tile/split
    (1, 3, 77, 4, 2, 80, torch.float16, True),  # GQA, D = 80 (padded), causal Nq = 3
    (1, 16, 130, 4, 1, 64, torch.float32, True),  # Nq = 16: 64 packed rows, two row blocks
    (2, 1, 67, 2, 2, 32, torch.bfloat16, False),  # no grouping, not causal
]


@pytest.mark.parametrize(
    "case", SPLIT_CASES, ids=lambda c: "b{}-q{}-k{}-h{}-hkv{}-d{}-{}-causal{}".format(*c)
)
def test_split_kv(case, device):
    """The chooser takes the split path; o, LSE and gradients (through the dense
    backward, from the split forward's o and LSE) against the reference."""
    *shape, dtype, causal = case
    q, k, v = qkv(*shape, dtype, device)
    assert takes_split_path(q, k, v, causal)
    check(q, k, v, causal=causal)


@pytest.mark.parametrize(
    "shape",
    [(1, 40, 45, 2, 1, 32), (1, 40, 21, 1, 1, 32)],
    ids=["masked-splits", "rows-that-see-no-key"],
)
def test_split_counts_agree_with_dense(shape, device):
    """Forced split counts (and pointer loads) against the dense forward and the reference.
    Causal with several row blocks: the first blocks' queries see none of the later splits'
    keys (neutral partials, LSE -inf); with Nq > Nk the first rows see no key at all."""
    q, k, v = qkv(*shape, torch.float32, device)
    scale = 1 / math.sqrt(q.shape[-1])
    p = problems(q, k, v, True)[0]
    o_d, lse_d = fa_launch.forward(q, k, v, True, scale, config=table_fwd(p))
    o64, lse64 = attention_reference(q.double(), k.double(), v.double(), True, return_lse=True)
    pointer = Tile(32, 16, 4, 1, tma=False)
    for n, tile in ((1, None), (2, None), (3, pointer), (5, None)):
        split = split_config(p, num_splits=n, tile=tile)
        assert split.kernel == FWD_SPLIT and (tile is None or not split.tma)
        o, lse = fa_launch.forward(q, k, v, True, scale, config=split)
        assert torch.equal(torch.isneginf(lse), torch.isneginf(lse64)), f"{n} splits"
        assert_close(o, o64, name=f"o, {n} splits")
        assert_close(o, o_d, name=f"o vs dense, {n} splits")
        assert_close(finite(lse), finite(lse64), bound=2e-5, name=f"lse, {n} splits")
        assert_close(finite(lse), finite(lse_d), bound=2e-5, name=f"lse vs dense, {n} splits")
    assert (o[:, : max(0, shape[1] - shape[2])] == 0).all()


@pytest.mark.parametrize("layout", ["sequence-major", "heads-major"])
def test_split_kv_cache_slices(layout, device):
    """Decoders pass k/v as the filled prefix of a preallocated cache (and q from a (B, H, N, D)
    projection): strided views, read in place."""
    b, nq, nk, h, hkv, d, cap = 2, 2, 70, 4, 2, 64, 96
    if layout == "sequence-major":  # (2, B, cap, Hkv, D): k and v caches in one buffer
        cache = make((2, b, cap, hkv, d), torch.bfloat16, device, seed=3)
        k, v = cache[0, :, :nk], cache[1, :, :nk]
    else:  # (B, Hkv, cap, D) per cache, viewed as (B, N, Hkv, D)
        k, v = (
            make((b, hkv, cap, d), torch.bfloat16, device, s)[:, :, :nk].transpose(1, 2)
            for s in (4, 5)
        )
    q = make((b, h, nq, d), torch.bfloat16, device, seed=6).transpose(1, 2)
    assert not k.is_contiguous() and takes_split_path(q, k, v, causal=True)
    check(q, k, v, causal=True)


def test_split_kv_deterministic(device):
    q, k, v = qkv(2, 1, 90, 4, 2, 32, torch.bfloat16, device)
    assert takes_split_path(q, k, v, causal=True)
    first = flash_attn(q, k, v, causal=True, return_lse=True)
    second = flash_attn(q, k, v, causal=True, return_lse=True)
    assert torch.equal(first[0], second[0]) and torch.equal(first[1], second[1])


def test_split_kv_opcheck(device):
    """The registered forward on a split-path shape (fake tensors, dynamic shapes)."""
    q, k, v = (t.requires_grad_() for t in qkv(1, 1, 70, 4, 2, 32, torch.float32, device))
    assert takes_split_path(q, k, v, causal=True)
    torch.library.opcheck(torch.ops.kernelkit_flash_attn.attn_fwd, (q, k, v, True, 0.25))


def test_split_kv_torch_compile_fullgraph(device):
    backend = "inductor" if device.type == "cuda" else "aot_eager"
    compiled = torch.compile(
        lambda q, k, v: flash_attn(q, k, v, causal=True, return_lse=True),
        fullgraph=True,
        backend=backend,
    )
    q, k, v = qkv(1, 2, 70, 4, 2, 32, torch.float32, device)
    assert takes_split_path(q, k, v, causal=True)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    o, lse = compiled(*leaves)
    o.sum().backward()
    ref = [t.double().requires_grad_() for t in (q, k, v)]
    o64, lse64 = attention_reference(*ref, causal=True, return_lse=True)
    o64.sum().backward()
    assert_close(o, o64, name="compiled o")
    assert_close(lse, lse64, name="compiled lse")
    for a, r, name in zip(leaves, ref, ("dq", "dk", "dv")):
        assert_close(a.grad, r.grad, name=f"compiled {name}")
