"""flash-attn variants: sliding windows and softcap against plain causal attention and
FlexAttention (what a PyTorch user picks for these variants), bf16, causal, B = 1, H = 2048 / d,
d in {64, 128}, forward and backward.

Tables (op "flash_attn_variants", direction fwd / bwd; the names below are the pytest-benchmark
groups, rendered with the tag, e.g. flash_attn_variants-speed-bwd-window-n16384-head16-dim128):
  window-n{N}   x = the keys before the diagonal each row sees (window_size=(x, 0)): 1024,
                4096, 8192, and N (no window: plain causal, the reference rate)
  softcap-n{N}  x = the same windows with softcap 30 (Gemma-2 style), N: plain causal + softcap
N in {16k, 64k}. TFLOP/s count only the visible (query, key) pairs: forward 4 d x pairs x B H,
backward 2.5x that; the goal (issue 32) is >= 90% of the plain causal rate and >= 1.3x
FlexAttention in every cell.
Providers:
  triton  this package (`flash_attn`, causal=True, window_size=(x, 0), softcap)
  flex    torch.compile(flex_attention) with a block mask of the window (built outside the
          timing) and, with softcap, a score_mod softcap * tanh(s / softcap); on (B, H, N, D)
          views of the same tensors. It compiles per cell (about 20 s each), so it runs at
          N = 16k, d = 128 only (FLEX_CELL), softcap without a window; CUDA only.

`python ci/bench.py flash-attn -k variants --name variants` runs it on a GPU and writes
results/<GPU>-variants.{md,json,png}. Without a GPU (CI smoke mode) every `triton` cell runs
once on a tiny shape under the Triton interpreter.
"""

import functools

import pytest
import torch
import torch._functorch.config

from kernelkit.flash_attn import flash_attn
from kernelkit.shared.bench import record, torch_compile

GPU = torch.cuda.is_available()
DEVICE = "cuda" if GPU else "cpu"
DS = [64, 128] if GPU else [16]
NS = [16384, 65536] if GPU else [40]
WINDOWS = [1024, 4096, 8192] if GPU else [8]
FLEX_CELL = (16384, 128)
HIDDEN = 2048 if GPU else 32
CAPS = {"window": 0.0, "softcap": 30.0}
DIRECTIONS = ["fwd", "bwd"]
FLOP_FACTOR = {"fwd": 1.0, "bwd": 2.5}
PROVIDERS = ["triton", "flex"]


def visible_pairs(n: int, left: int) -> int:
    """(query, key) pairs causal attention over n rows sees with a window of `left` keys
    before the diagonal (left >= n - 1: no window)."""
    if left >= n - 1:
        return n * (n + 1) // 2
    return (left + 1) * (left + 2) // 2 + (n - left - 1) * (left + 1)


@functools.cache
def compiled_flex():
    from torch.nn.attention.flex_attention import flex_attention

    return torch_compile(flex_attention)


def flex_fn(n: int, left: int, softcap: float):
    """FlexAttention of one cell on (B, N, H, D) tensors (through (B, H, N, D) views)."""
    from torch.nn.attention.flex_attention import create_block_mask

    def mask_mod(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) & (q_idx - kv_idx <= left)

    torch._dynamo.reset()  # a new mask and score_mod: a fresh compile, not a recompile
    block_mask = create_block_mask(mask_mod, None, None, n, n, device=DEVICE)
    score_mod = None
    if softcap:

        def score_mod(score, b, h, q_idx, kv_idx):
            return softcap * torch.tanh(score / softcap)

    flex = compiled_flex()

    def fn(q, k, v):
        o = flex(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), block_mask=block_mask,
                 score_mod=score_mod)  # fmt: skip
        return o.transpose(1, 2)

    return fn


def variant_fn(provider: str, n: int, left: int, softcap: float):
    if provider == "triton":
        return functools.partial(flash_attn, causal=True, window_size=(left, 0), softcap=softcap)
    return flex_fn(n, left, softcap)


@pytest.mark.parametrize("provider", PROVIDERS)
@pytest.mark.parametrize("direction", DIRECTIONS)
@pytest.mark.parametrize("window", [*WINDOWS, None], ids=lambda w: f"w{w or 'N'}")
@pytest.mark.parametrize("variant", list(CAPS))
@pytest.mark.parametrize("n", NS)
@pytest.mark.parametrize("d", DS, ids=lambda d: f"d{d}")
def test_variants(benchmark, d, n, variant, window, direction, provider):
    if provider == "flex" and not GPU:
        pytest.skip("FlexAttention cells need CUDA")
    if provider == "flex" and ((n, d) != FLEX_CELL or (variant == "softcap" and window)):
        pytest.skip(f"flex runs at (N, d) = {FLEX_CELL}, softcap without a window: it compiles "
                    "per cell (minutes in all)")  # fmt: skip
    left = n if window is None else window
    h, softcap = HIDDEN // d, CAPS[variant]
    g = torch.Generator(device=DEVICE).manual_seed(0)
    q, k, v = (torch.randn(1, n, h, d, device=DEVICE, dtype=torch.bfloat16, generator=g)
               .requires_grad_() for _ in range(3))  # fmt: skip
    do = torch.randn(1, n, h, d, device=DEVICE, dtype=torch.bfloat16, generator=g)
    flops = FLOP_FACTOR[direction] * 4.0 * d * visible_pairs(n, left) * h
    benchmark.group = f"flash_attn_variants-{direction}-{variant}-n{n}-dim{d}"
    tag = f"{variant}-n{n}-head{h}-dim{d}-causal1-bf16"
    # A compiled FlexAttention backward frees the graph's buffers unless told not to (it would
    # not run twice on one forward, as the timed backward does).
    with torch._functorch.config.patch(donated_buffer=False):
        fn = variant_fn(provider, n, left, softcap)
        if direction == "fwd":

            def call():
                with torch.no_grad():
                    return fn(q, k, v)

        else:
            o = fn(q, k, v)

            def call():
                o.backward(do, retain_graph=True)

        record(benchmark, call, op="flash_attn_variants", direction=direction, tag=tag,
               x=left, xname="window", provider=provider, flops=flops,
               grad_to_none=[q, k, v], info={"softcap": softcap})  # fmt: skip


def test_visible_pairs():
    """The pair count: every pair of plain causal attention, fewer with a window."""
    assert visible_pairs(8, 7) == visible_pairs(8, 100) == 36
    assert visible_pairs(8, 0) == 8
    assert visible_pairs(8, 2) == sum(min(i, 2) + 1 for i in range(8))
