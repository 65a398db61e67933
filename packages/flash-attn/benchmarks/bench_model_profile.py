"""Suite 4 of docs/benchmarks.md: the attention seed's model profile ("Profile": sm / md /
lg).

A small decoder-only Transformer language model, a benchmark fixture written here (not part of
the package): token embedding, pre-norm blocks (RMSNorm, causal multi-head attention with
rotary position encoding on q and k, RMSNorm, SwiGLU MLP), a final RMSNorm and an untied output
head. Sizes as the seed: sm (d_model 768, 12 layers, 12 heads), md (1024, 24, 16),
lg (1280, 36, 20), head dim 64 in all three; d_ff = 4 * d_model is the SwiGLU hidden width
(w1, w3: d_model -> d_ff, w2: d_ff -> d_model; the course assignment's convention, 1.5x the
parameters of a non-gated 4 * d_model MLP); vocabulary 10 000, batch 4, context 512. Weights
and activations are bfloat16 (no autocast: RMSNorm and RoPE compute in float32 and round once;
the loss upcasts the logits).

Swapped per cell:
  attention  `torch` (eager: the package's reference, scores in memory), `sdpa`
             (F.scaled_dot_product_attention, the backend PyTorch picks; extra_info["kernel"]
             names it) or `triton` (kernelkit.flash_attn.flash_attn, (B, N, H, D) in place)
  rope       `torch` (plain PyTorch rotary, half-split pairing (j, j + D/2)) or `lrpe`
             (kernelkit-lrpe-rotate's fused kernel, same pairing and angles: the same model;
             test_rope_pairing checks it). kernelkit-lrpe-rotate is optional: without it these
             cells are skipped (flash-attn does not depend on it).

Per cell: `fwd` (inference: a no_grad forward to the logits) or `fwd_bwd` (a training step
without the optimizer: forward, cross-entropy, backward). Besides record()'s do_bench median and
peak memory (weights, gradients and activations of one step), STEPS further warm steps are timed
one by one (CUDA events, forward and backward separately): mean and total over those steps, as
the seed's table, with total = forward + backward of the same steps.

Rendered by `python ci/bench.py flash-attn -k model_profile --name model-profile`.
"""

import functools

import pytest
import torch
import torch.nn.functional as F
from bench_flash_attn import DEVICE, GPU
from flash_attn_tables import add_seed, measured
from torch import nn

from kernelkit.flash_attn import flash_attn
from kernelkit.flash_attn.reference import attention_reference
from kernelkit.shared.bench import record
from kernelkit.shared.testing import assert_close

try:
    from kernelkit.lrpe_rotate import lrpe_rotate
except ImportError as e:  # optional: the flash-attn package does not depend on it
    lrpe_rotate, LRPE_MISSING = None, f"kernelkit-lrpe-rotate is not installed ({e})"

# name: (d_model, layers, heads)
SIZES = (
    {"sm": (768, 12, 12), "md": (1024, 24, 16), "lg": (1280, 36, 20)} if GPU else {"sm": (32, 2, 2)}
)
VOCAB, BATCH, CONTEXT = (10000, 4, 512) if GPU else (64, 2, 33)
DTYPE = torch.bfloat16
STEPS = 10 if GPU else 0
ATTENTIONS = ["torch", "sdpa", "triton"]
ROPES = ["torch", "lrpe"]
ROPE_BASE = 10000.0


def rope_theta(head_dim: int) -> torch.Tensor:
    """RoPE frequencies base^(-2j / D), j < D/2, float32."""
    half = head_dim // 2
    return ROPE_BASE ** (-torch.arange(half, dtype=torch.float32, device=DEVICE) / half)


def rope_torch(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Plain PyTorch rotary encoding of x (B, N, H, D), half-split pairs (j, j + D/2): cos/sin
    (N, D/2) float32; computed in float32, rounded once to x's dtype."""
    half = x.shape[-1] // 2
    compute = torch.promote_types(x.dtype, torch.float32)
    x1, x2 = x[..., :half].to(compute), x[..., half:].to(compute)
    c, s = cos[:, None], sin[:, None]
    return torch.cat([x1 * c - x2 * s, x1 * s + x2 * c], dim=-1).to(x.dtype)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-5) -> torch.Tensor:
    xf = x.float()
    return (xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + eps) * weight.float()).to(x.dtype)


def linear(n_in: int, n_out: int) -> nn.Linear:
    layer = nn.Linear(n_in, n_out, bias=False, device=DEVICE, dtype=DTYPE)
    nn.init.normal_(layer.weight, std=0.02)
    return layer


class Block(nn.Module):
    def __init__(self, d_model: int, heads: int, d_ff: int):
        super().__init__()
        self.heads = heads
        self.norm1 = nn.Parameter(torch.ones(d_model, device=DEVICE, dtype=DTYPE))
        self.qkv = linear(d_model, 3 * d_model)
        self.out = linear(d_model, d_model)
        self.norm2 = nn.Parameter(torch.ones(d_model, device=DEVICE, dtype=DTYPE))
        self.w1, self.w3, self.w2 = (
            linear(d_model, d_ff),
            linear(d_model, d_ff),
            linear(d_ff, d_model),
        )

    def forward(self, x: torch.Tensor, lm: "TransformerLM") -> torch.Tensor:
        b, n, d = x.shape
        q, k, v = self.qkv(rms_norm(x, self.norm1)).view(b, n, 3, self.heads, -1).unbind(2)
        o = lm.attend(lm.rotate(q), lm.rotate(k), v)  # (B, N, H, D)
        x = x + self.out(o.reshape(b, n, d))
        h = rms_norm(x, self.norm2)
        return x + self.w2(F.silu(self.w1(h)) * self.w3(h))


class TransformerLM(nn.Module):
    """Decoder-only LM; `attention` and `rope` select the implementations (same weights)."""

    def __init__(self, d_model: int, layers: int, heads: int, vocab: int, context: int):
        super().__init__()
        self.emb = nn.Embedding(vocab, d_model, device=DEVICE, dtype=DTYPE)
        nn.init.normal_(self.emb.weight, std=0.02)
        self.blocks = nn.ModuleList(Block(d_model, heads, 4 * d_model) for _ in range(layers))
        self.norm = nn.Parameter(torch.ones(d_model, device=DEVICE, dtype=DTYPE))
        self.head = linear(d_model, vocab)
        theta = rope_theta(d_model // heads)
        angles = theta[None] * torch.arange(context, device=DEVICE, dtype=torch.float32)[:, None]
        # float32 state (not buffers: it must not follow a dtype cast of the model)
        self.cos, self.sin = torch.cos(angles), torch.sin(angles)
        self.theta = theta.repeat(heads, 1).contiguous()  # (H, D/2) for lrpe_rotate
        self.attention, self.rope = "torch", "torch"

    def rotate(self, x: torch.Tensor) -> torch.Tensor:
        if self.rope == "lrpe":
            return lrpe_rotate(x, self.theta)
        n = x.shape[1]
        return rope_torch(x, self.cos[:n], self.sin[:n])

    def attend(self, q, k, v) -> torch.Tensor:
        if self.attention == "triton":
            return flash_attn(q, k, v, causal=True)
        if self.attention == "sdpa":
            o = F.scaled_dot_product_attention(
                q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
            )
            if o.grad_fn is not None:
                self.sdpa_kernel = type(o.grad_fn).__name__
            return o.transpose(1, 2)
        return attention_reference(q, k, v, causal=True)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.emb(tokens)
        for block in self.blocks:
            x = block(x, self)
        return self.head(rms_norm(x, self.norm))


@functools.lru_cache(maxsize=1)  # one size at a time (the suite runs sizes in order)
def model_for(size: str) -> TransformerLM:
    d_model, layers, heads = SIZES[size]
    return TransformerLM(d_model, layers, heads, VOCAB, CONTEXT)


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.float().view(-1, logits.shape[-1]), targets.view(-1))


def timed_steps(model, tokens, targets, train: bool, steps: int):
    """Per-step (forward ms, backward ms) of `steps` steps, each synchronised at its end."""
    params = list(model.parameters())
    out = []
    for _ in range(steps):
        for p in params:
            p.grad = None
        ev = [torch.cuda.Event(enable_timing=True) for _ in range(3)]
        ev[0].record()
        if train:
            loss = loss_fn(model(tokens), targets)
            ev[1].record()
            loss.backward()
        else:
            with torch.no_grad():
                model(tokens)
            ev[1].record()
        ev[2].record()
        torch.cuda.synchronize()
        out.append((ev[0].elapsed_time(ev[1]), ev[1].elapsed_time(ev[2])))
    return out


NAMES = list(SIZES)
FWD_SPEC = {
    "title": f"Model profile, forward (inference, no_grad): ms per step, mean and total over "
    f"{STEPS} warm steps; peak allocated MiB of a step (batch {BATCH}, context {CONTEXT}, bf16)",
    "columns": ["avg_forward_ms", "total_forward_ms", "peak_mib"],
    "digits": {"*": 2, "peak_mib": 0},
}
TRAIN_SPEC = {
    "title": f"Model profile, training step (forward + loss + backward, no optimizer): ms, mean "
    f"and total over {STEPS} warm steps; total = forward + backward of the same steps",
    "columns": [f"{a}_{m}_ms" for m in ("forward", "backward", "total") for a in ("avg", "total")]
    + ["peak_mib"],
    "digits": {"*": 2, "peak_mib": 0},
}
SPEEDUP_SPEC = {
    "title": "Model profile by attention: mean ms per step (fwd = inference forward, step = "
    "training step); x = that attention's time / ours",
    "columns": [f"{m}_{a}" for m in ("fwd", "step") for a in ATTENTIONS],
    "ratios": {
        f"{m}_x_{a}": [f"{m}_{a}", f"{m}_triton"]
        for m in ("fwd", "step")
        for a in ("torch", "sdpa")
    },
    "digits": {"*": 2},
}
ROPE_SPEC = {
    "title": "Model profile by position encoding: mean ms per step; x = plain PyTorch RoPE's "
    "time / kernelkit-lrpe-rotate's",
    "columns": [f"{m}_rope_{r}" for m in ("fwd", "step") for r in ROPES],
    "ratios": {f"{m}_x": [f"{m}_rope_torch", f"{m}_rope_lrpe"] for m in ("fwd", "step")},
    "digits": {"*": 2},
}


@pytest.mark.parametrize("direction", ["fwd", "fwd_bwd"])
@pytest.mark.parametrize("rope", ROPES)
@pytest.mark.parametrize("attention", ATTENTIONS)
@pytest.mark.parametrize("size", NAMES)
def test_model_profile(benchmark, size, attention, rope, direction):
    if rope == "lrpe" and lrpe_rotate is None:
        pytest.skip(LRPE_MISSING)
    model = model_for(size)
    model.attention, model.rope = attention, rope
    g = torch.Generator(device=DEVICE).manual_seed(0)
    tokens, targets = (
        torch.randint(VOCAB, (BATCH, CONTEXT), device=DEVICE, generator=g) for _ in range(2)
    )
    train = direction == "fwd_bwd"
    benchmark.group = f"model_profile-{direction}-rope_{rope}"

    def call():
        if train:
            loss_fn(model(tokens), targets).backward()
        else:
            with torch.no_grad():
                return model(tokens)

    d_model, layers, heads = SIZES[size]
    info = {"model": size, "layers": layers, "heads": heads, "d_ff": 4 * d_model, "vocab": VOCAB,
            "params": sum(p.numel() for p in model.parameters())}  # fmt: skip
    record(benchmark, call, op="model_profile", direction=direction,
           tag=f"batch{BATCH}-ctx{CONTEXT}-bf16-rope_{rope}", x=d_model, xname="d_model",
           provider=attention, grad_to_none=list(model.parameters()), info=info)  # fmt: skip
    if attention == "sdpa" and hasattr(model, "sdpa_kernel"):
        benchmark.extra_info["kernel"] = model.sdpa_kernel
    row = [["model_name", size], ["attention", attention], ["rope", rope]]
    sort = [NAMES.index(size), ATTENTIONS.index(attention), ROPES.index(rope)]
    peak = measured(benchmark, "peak_mb")
    steps = []
    if peak not in ("OOM", None):
        steps = timed_steps(model, tokens, targets, train, STEPS)
        benchmark.extra_info["steps_ms"] = steps

    def mean_total(xs):  # "OOM" cells read OOM; smoke runs (nothing measured) add nothing
        return (sum(xs) / len(xs), sum(xs)) if xs else (peak, peak)

    fwd = mean_total([f for f, _ in steps])
    if train:
        bwd, tot = mean_total([b for _, b in steps]), mean_total([f + b for f, b in steps])
        values = {"avg_forward_ms": fwd[0], "total_forward_ms": fwd[1],
                  "avg_backward_ms": bwd[0], "total_backward_ms": bwd[1],
                  "avg_total_ms": tot[0], "total_total_ms": tot[1], "peak_mib": peak}  # fmt: skip
        add_seed(benchmark, "model_profile_train", row, values, sort=sort, **TRAIN_SPEC)
        step = tot[0]
    else:
        values = {"avg_forward_ms": fwd[0], "total_forward_ms": fwd[1], "peak_mib": peak}
        add_seed(benchmark, "model_profile_forward", row, values, sort=sort, **FWD_SPEC)
        step = fwd[0]
    m = "step" if train else "fwd"
    add_seed(benchmark, "model_profile_speedup", [["model_name", size], ["rope", rope]],
             {f"{m}_{attention}": step}, sort=sort[::2], **SPEEDUP_SPEC)  # fmt: skip
    add_seed(benchmark, "model_profile_rope", [["model_name", size], ["attention", attention]],
             {f"{m}_rope_{rope}": step}, sort=sort[:2], **ROPE_SPEC)  # fmt: skip


@pytest.mark.skipif(lrpe_rotate is None, reason="kernelkit-lrpe-rotate is not installed")
def test_rope_pairing():
    """The plain PyTorch RoPE and lrpe_rotate encode the same model: same pairing and angles."""
    b, n, h, d = 2, 33, 3, 16
    x = torch.randn(b, n, h, d, device=DEVICE, dtype=torch.float32)
    theta = rope_theta(d)
    angles = theta[None] * torch.arange(n, device=DEVICE, dtype=torch.float32)[:, None]
    ref = rope_torch(x.double(), torch.cos(angles.double()), torch.sin(angles.double()))
    assert_close(rope_torch(x, torch.cos(angles), torch.sin(angles)), ref, name="torch rope")
    assert_close(lrpe_rotate(x, theta.repeat(h, 1)), ref, name="lrpe_rotate")
