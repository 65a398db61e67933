"""flash-attn cells of issue 13: packed variable-length batches, sliding windows, softcap.

Varlen tables (`flash_attn_varlen-<direction>`): ROWS = 4 rows of 16384 tokens, d = 128, H = 16,
bf16, causal within each document. x ("lengths"):
  lognormal   document lengths log-normal (median 2048 tokens, sigma 1.0 in log space), clipped
              to 1024..16384, drawn with torch.Generator seed 0 until a row is full; the last
              document of a row is cut to fill it, as packing for pretraining does, so a row
              may end with a shorter piece (extra_info: documents, longest, padded_work).
  equal2048   8 documents of 2048 tokens per row: the padded batch is the dense (32, 2048)
              batch itself, with exactly the same tokens (the "within 10% of dense" goal).
Providers:
  triton         flash_attn_varlen on the packed rows (total, H, D)
  triton_padded  flash_attn on the padded batch (documents, longest, H, D), causal (documents
                 padded at their end: a causal row never sees its padding)
  torch_varlen   torch.nn.attention.varlen.varlen_attn (PyTorch's FlashAttention-2 varlen),
                 window (-1, 0) = causal
  sdpa_flash     SDPA on the padded batch, (B, H, N, D), is_causal=True, pinned to one backend
  sdpa_cudnn
  flex           FlexAttention on the packed rows (1, H, total, D) with a document-causal block
                 mask (built once, outside the timing), compiled
TFLOP/s count the useful work only, the same for every provider: per document 4 H d len^2 / 2
forward FLOPs (the sweep's causal convention), 2.5x backward, 3.5x forward+backward; so
padding shows as lower TFLOP/s. Goals: triton fwd+bwd >= 1.5x triton_padded on "lognormal",
and within 10% of triton_padded (the dense kernel) on "equal2048".

Window and softcap tables (`flash_attn_variants-<direction>`): causal, d = 128, H = 16,
N in {8k, 32k}, B = max(1, 16384 / N), bf16. Providers:
  triton                  plain causal (the baseline)
  triton_window4096       window_size=(4095, 0): each query sees its latest 4096 keys
  triton_softcap50        softcap=50 (Gemma 2), tanh.approx.f32
  torch_varlen            varlen_attn over the B sequences, causal
  torch_varlen_window4096 varlen_attn, window (4095, 0)
TFLOP/s count each cell's visible pairs (causal: N^2 / 2, the window: sum_i min(i + 1, 4096)).
Goals: softcap within 15% of triton; window at 32k: the issue asks <= 1/6 of triton's time,
below the FLOP floor (the window keeps 23% of the causal pairs; NOTES.md).

`python ci/bench.py flash-attn -k varlen` runs it on a GPU (about two minutes, most of it
FlexAttention's compilation); without one (CI smoke mode) the triton cells run once on tiny
shapes under the Triton interpreter and the PyTorch providers are skipped.
"""

import functools

import pytest
import torch
import torch.nn.functional as F
from bench_flash_attn import DIRECTIONS, FLOP_FACTOR, SDPA, direction_call
from torch.nn.attention import sdpa_kernel

from kernelkit.flash_attn import flash_attn, flash_attn_varlen
from kernelkit.shared.bench import cu_seqlens_of, document_lengths, record, torch_compile

GPU = torch.cuda.is_available()
DEVICE = "cuda" if GPU else "cpu"
DTYPE = torch.bfloat16
H, D = (16, 128) if GPU else (1, 16)
ROWS, ROW_TOKENS = (4, 16384) if GPU else (1, 40)
# Log-normal document lengths: median, sigma (log space), clipped to [shortest, longest].
LENGTHS = (2048, 1.0, 1024, 16384) if GPU else (10, 1.0, 4, 40)
EQUAL = 2048 if GPU else 10
VARLEN_PROVIDERS = ["triton", "triton_padded", "torch_varlen", *SDPA, "flex"]
VARLEN_PROVIDERS.remove("sdpa_efficient")  # 4-6x slower than flash here; not a peer
VARIANT_NS = [8192, 32768] if GPU else [40]
VARIANT_TOKENS = 16384 if GPU else 40
WINDOW = 4096 if GPU else 8
SOFTCAP = 50.0
VARIANTS = {  # provider: (flash_attn keyword arguments, or varlen_attn's window)
    "triton": {},
    f"triton_window{WINDOW}": {"window_size": (WINDOW - 1, 0)},
    "triton_softcap50": {"softcap": SOFTCAP},
    "torch_varlen": (-1, 0),
    f"torch_varlen_window{WINDOW}": (WINDOW - 1, 0),
}


@functools.cache
def case_lengths(case: str) -> tuple[int, ...]:
    if case.startswith("equal"):
        return (EQUAL,) * (ROWS * ROW_TOKENS // EQUAL)
    return document_lengths(ROWS, ROW_TOKENS, *LENGTHS)


def causal_pairs(n: int, window: int | None = None) -> float:
    """Visible (query, key) pairs of one causal sequence of n: n^2 / 2 (the suite's convention),
    or with a window of `window` latest keys sum_i min(i + 1, window)."""
    if window is None or window >= n:
        return n * n / 2
    return window * (window + 1) / 2 + (n - window) * window


def _randn(shape, seed):
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    return torch.randn(shape, dtype=DTYPE, device=DEVICE, generator=g)


def _needs_gpu(provider):
    if not GPU and not provider.startswith("triton"):
        pytest.skip(f"{provider}: needs a CUDA GPU")


def _run_cell(benchmark, fn, inputs, provider, direction, **where):
    """Time one direction of fn(*inputs) (leaves requiring grad) and record it."""
    try:
        o = fn(*inputs)
    except RuntimeError as e:  # a PyTorch provider this GPU or these inputs lack
        if provider.startswith("triton"):
            raise
        pytest.skip(f"{provider} unavailable: {str(e).splitlines()[0]}")
    do = _randn(o.shape, 7)
    call = direction_call(fn, inputs, o, do, direction)
    del o
    record(benchmark, call, direction=direction, provider=provider, grad_to_none=list(inputs),
           **where)  # fmt: skip


# ---------------------------------------------------------------------------------------------
# Packed documents vs padding
# ---------------------------------------------------------------------------------------------


@functools.cache
def _flex_document_causal(lengths):
    """Compiled FlexAttention with the block mask of these documents (one per case)."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    total = sum(lengths)
    doc = torch.repeat_interleave(
        torch.arange(len(lengths), device=DEVICE), torch.tensor(lengths, device=DEVICE)
    )

    def document_causal(b, h, q_idx, kv_idx):
        return (doc[q_idx] == doc[kv_idx]) & (q_idx >= kv_idx)

    mask = create_block_mask(document_causal, None, None, total, total, device=DEVICE)
    return functools.partial(torch_compile(flex_attention), block_mask=mask)


def varlen_provider(provider, lengths):
    """(fn, inputs) of one provider over the documents `lengths` (the same random tokens)."""
    total, longest, n = sum(lengths), max(lengths), len(lengths)
    cu = cu_seqlens_of(lengths, DEVICE)
    packed = [_randn((total, H, D), seed) for seed in range(3)]
    if provider in ("triton", "torch_varlen"):
        inputs = packed
        if provider == "triton":
            fn = functools.partial(flash_attn_varlen, cu_seqlens_q=cu, cu_seqlens_k=cu,
                                   max_seqlen_q=longest, max_seqlen_k=longest, causal=True)  # fmt: skip
        else:
            from torch.nn.attention.varlen import varlen_attn

            def fn(q, k, v):
                return varlen_attn(q, k, v, cu, cu, longest, longest, window_size=(-1, 0))

    elif provider == "flex":
        inputs = [t.transpose(0, 1).unsqueeze(0).contiguous() for t in packed]
        fn = _flex_document_causal(lengths)
    else:  # padded: documents at the start of their rows, zeros after
        rows = (
            torch.arange(longest, device=DEVICE)[None, :]
            < torch.tensor(lengths, device=DEVICE)[:, None]
        )
        inputs = []
        for t in packed:
            pad = t.new_zeros(n, longest, H, D)
            pad[rows] = t
            inputs.append(pad.transpose(1, 2).contiguous() if provider in SDPA else pad)
        if provider == "triton_padded":
            fn = functools.partial(flash_attn, causal=True)
        else:

            def fn(q, k, v, backend=SDPA[provider]):
                with sdpa_kernel(backend):
                    return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    return fn, [t.requires_grad_() for t in inputs]


@pytest.mark.parametrize("provider", VARLEN_PROVIDERS)
@pytest.mark.parametrize("direction", DIRECTIONS)
@pytest.mark.parametrize("case", ["lognormal", f"equal{EQUAL}"])
def test_varlen(benchmark, case, direction, provider):
    _needs_gpu(provider)
    lengths = case_lengths(case)
    fn, inputs = varlen_provider(provider, lengths)
    useful = sum(causal_pairs(n) for n in lengths)
    info = {"documents": len(lengths), "longest": max(lengths),
            "padded_work": len(lengths) * causal_pairs(max(lengths)) / useful}  # fmt: skip
    benchmark.group = f"flash_attn_varlen-{direction}"
    _run_cell(benchmark, fn, inputs, provider, direction, op="flash_attn_varlen",
              tag=f"rows{ROWS}x{ROW_TOKENS}-head{H}-dim{D}-causal1-bf16", x=case, xname="lengths",
              flops=FLOP_FACTOR[direction] * 4.0 * H * D * useful, info=info)  # fmt: skip


# ---------------------------------------------------------------------------------------------
# Sliding window and softcap next to plain causal attention
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("provider", list(VARIANTS))
@pytest.mark.parametrize("direction", DIRECTIONS)
@pytest.mark.parametrize("n", VARIANT_NS)
def test_variants(benchmark, n, direction, provider):
    _needs_gpu(provider)
    b = max(1, VARIANT_TOKENS // n)
    option = VARIANTS[provider]
    inputs = [_randn((b, n, H, D), seed).requires_grad_() for seed in range(3)]
    if provider.startswith("triton"):
        fn = functools.partial(flash_attn, causal=True, **option)
        left = option.get("window_size", (-1, 0))[0]
    else:
        from torch.nn.attention.varlen import varlen_attn

        cu = torch.arange(0, (b + 1) * n, n, dtype=torch.int32, device=DEVICE)

        def fn(q, k, v):
            o = varlen_attn(*(t.flatten(0, 1) for t in (q, k, v)), cu, cu, n, n,
                            window_size=option)  # fmt: skip
            return o.unflatten(0, (b, n))

        left = option[0]
    window = None if left < 0 else left + 1  # keys each query sees, itself included
    benchmark.group = f"flash_attn_variants-{direction}"
    _run_cell(benchmark, fn, inputs, provider, direction, op="flash_attn_variants",
              tag=f"tokens{VARIANT_TOKENS}-head{H}-dim{D}-causal1-bf16", x=n,
              flops=FLOP_FACTOR[direction] * 4.0 * b * H * D * causal_pairs(n, window),
              info={"window": window})  # fmt: skip


def test_conventions():
    """Visible-pair counts and the packing rule."""
    assert causal_pairs(10) == 50 and causal_pairs(10, 3) == 1 + 2 + 3 * 8
    assert causal_pairs(4, 8) == causal_pairs(4)
    for case in ("lognormal", f"equal{EQUAL}"):
        lengths = case_lengths(case)
        assert sum(lengths) == ROWS * ROW_TOKENS and min(lengths) >= 1
        assert max(lengths) <= LENGTHS[3]
