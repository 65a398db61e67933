"""flash-attn's interfaces: the course assignment's FlashAttentionFunction, `explain`, the
registered ops (opcheck, dynamic shapes, torch.compile), the CPU fallback without the
interpreter and the reference's closed-form gradients, argument errors, and replayed launches
against the full host path.

Runs the real Triton kernels, on the GPU or under the Triton interpreter (see
test_flash_attn.py); the helpers are in fa_testing.py.
"""

import math
from dataclasses import replace

import pytest
import torch
from fa_testing import NO_GLUON, check_with_configs, finite, make, packed, problems, qkv

from kernelkit.flash_attn import (
    FlashAttentionFunction,
    explain,
    families,
    flash_attn,
    flash_attn_backward,
)
from kernelkit.flash_attn import op as fa_op
from kernelkit.flash_attn.choose import choose_bwd, choose_fwd
from kernelkit.flash_attn.config import (
    BWD_GLUON,
    FWD_GLUON,
    FWD_SPLIT,
    FWD_TRITON,
    H100,
    BwdConfig,
    FwdConfig,
)
from kernelkit.flash_attn.reference import (
    attention_reference,
    attention_reference_grads,
    attention_varlen_reference,
    attention_varlen_reference_grads,
)
from kernelkit.shared.testing import assert_close, run_without_interpreter

# ------------------------------------------------------------------------------------------
# The course assignment's interface
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("is_causal", [False, True])
def test_flash_attention_function_adapter(is_causal, device):
    """What the assignment's tests check: one saved (B, Nq) tensor holding the LSE, the output,
    and the gradients of the plain attention."""
    q, k, v = (t.squeeze(2) for t in qkv(4, 64, 64, 1, 1, 32, torch.float32, device))
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    o = FlashAttentionFunction.apply(q, k, v, is_causal)
    saved = [t for t in o.grad_fn.saved_tensors if t.shape == (q.shape[0], q.shape[1])]
    assert len(saved) == 1
    ref = [t.detach().double().requires_grad_() for t in (q, k, v)]
    o64, lse64 = attention_reference(*ref, causal=is_causal, return_lse=True)
    assert_close(o, o64, name="o")
    assert_close(saved[0], lse64, name="L")
    do = make(o.shape, o.dtype, device, seed=11)
    o.backward(do)
    o64.backward(do.double())
    for a, r, name in zip((q, k, v), ref, ("dq", "dk", "dv")):
        assert_close(a.grad, r.grad, name=name)


# ------------------------------------------------------------------------------------------
# Registration, compile, fallback, errors
# ------------------------------------------------------------------------------------------


def test_explain_shows_the_configs(device):
    """explain() returns what each direction runs as the chooser's config (forward_config,
    backward_config), each with a non-empty `why`, and its text shows them: for this device's
    tensors (target None), and as an H100 or a GPU without the Gluon kernels would run them."""
    q, k, v = qkv(2, 300, 280, 4, 2, 128, torch.bfloat16, device)
    for target in (None, H100, NO_GLUON):
        e = explain(q, k, v, causal=True, target=target)
        pf, pb = problems(q, k, v, True, target=target)
        assert isinstance(e.forward_config, FwdConfig) and isinstance(e.backward_config, BwdConfig)
        assert e.forward_config == choose_fwd(pf) and e.backward_config == choose_bwd(pb)
        assert e.forward_config.why == choose_fwd(pf).why
        text = str(e)
        assert text.startswith(f"forward: {e.forward_config}\n  why: {e.forward_config.why}\n")
        assert f"\nbackward: {e.backward_config}\n  why: {e.backward_config.why}\n" in text
        for cfg, family in ((e.forward_config, e.forward), (e.backward_config, e.backward)):
            assert cfg.why and str(cfg) and f"  family: {family}\n" in text
    e = explain(q, k, v, causal=True, target=H100)
    assert (e.forward_config.kernel, e.backward_config.kernel) == (FWD_GLUON, BWD_GLUON)
    assert e.backward_config.why == "Gluon dk/dv at d128, dq kernel beside it"
    e = explain(q, k, v, causal=True, target=NO_GLUON)
    assert e.forward_config.why.startswith("the Gluon forward cannot run: not an sm_90 GPU")
    # Decoding, from meta tensors: the split-KV forward, its splits in the text.
    q = torch.empty(2, 1, 8, 64, dtype=torch.bfloat16, device="meta")
    k = torch.empty(2, 4096, 2, 64, dtype=torch.bfloat16, device="meta")
    e = explain(q, k, k, causal=True, target=H100)
    assert e.forward_config.kernel == FWD_SPLIT and e.forward_config.why.startswith("split-KV")
    assert f"splits={e.forward_config.split.splits}x" in str(e)


def test_opcheck(device):
    q, k, v = (t.requires_grad_() for t in qkv(1, 19, 21, 2, 1, 32, torch.float32, device))
    torch.library.opcheck(torch.ops.kernelkit_flash_attn.attn_fwd, (q, k, v, True, 0.25))
    o, lse = fa_op.attn_fwd(q.detach(), k.detach(), v.detach(), True, 0.25)
    do = make(o.shape, o.dtype, device, seed=3)
    dlse = make(lse.shape, lse.dtype, device, seed=4)
    args = (do, q.detach(), k.detach(), v.detach(), o, lse)
    torch.library.opcheck(torch.ops.kernelkit_flash_attn.attn_bwd, (*args, dlse, True, 0.25))
    # The options after the scale (softcap, window left and right), passed explicitly.
    torch.library.opcheck(
        torch.ops.kernelkit_flash_attn.attn_bwd, (*args, None, False, 0.25, 2.0, 3, 5)
    )


def _concrete(cfg):
    """`cfg` with fields chosen from symbolic sizes (SymBool, SymInt) made concrete (guards)."""
    plain = {}
    for name in ("pad_rows", "pairs", "persistent", "tile_heads"):
        x = getattr(cfg, name, None)
        if isinstance(x, (torch.SymBool, torch.SymInt)):
            plain[name] = bool(x) if isinstance(x, torch.SymBool) else int(x)
    return replace(cfg, **plain)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_dynamic_shapes_with_gpu_configs(dtype, device):
    """Dynamic-shape tracing (symbolic sizes, as opcheck's aot_dispatch_dynamic and
    torch.compile(dynamic=True) trace the ops' fakes: `families.probe_*`) through the GPU tile
    tables and rules, which the interpreter's target bypasses: as on an H100 and on a GPU without
    the Gluon kernels, the probes take the configs of the concrete call (the head dim and the
    flags concrete) and allocate outputs like its. The portable configs run here too, against
    the reference."""
    from torch._dynamo.source import ConstantSource
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import (
        DimDynamic,
        ShapeEnv,
        StatelessSymbolicContext,
    )

    for d in (32, 128):
        q, k, v = qkv(1, 19, 21, 2, 1, d, dtype, device)
        mode = FakeTensorMode(shape_env=ShapeEnv())
        dynamic = StatelessSymbolicContext(dynamic_sizes=[DimDynamic.DYNAMIC] * 4)
        fake = [mode.from_tensor(t, symbolic_context=dynamic, source=ConstantSource(name))
                for t, name in zip((q, k, v), "qkv")]  # fmt: skip
        assert isinstance(fake[0].shape[1], torch.SymInt)
        for target in (H100, NO_GLUON):
            with mode:
                fwd, bwd = families.probe_call(*fake, True, target=target)
            real_fwd, real_bwd = families.probe_call(q, k, v, True, target=target)
            assert _concrete(fwd.config) == real_fwd.config and real_fwd.config.why
            assert _concrete(bwd.config) == real_bwd.config and real_bwd.config.why
            assert families.family(fwd) == families.family(real_fwd)
            assert families.family(bwd) == families.family(real_bwd)
            for a, b in zip((*fwd.outputs, *bwd.outputs), (*real_fwd.outputs, *real_bwd.outputs)):
                assert [int(n) for n in a.shape] == list(b.shape) and a.dtype == b.dtype
            if d == 32 and target is NO_GLUON:
                assert real_fwd.config.kernel == FWD_TRITON == real_bwd.config.kernel
                check_with_configs(q, k, v, True, real_fwd.config, real_bwd.config)


@pytest.mark.parametrize("causal", [True], ids=["causal"])  # the flag is a constant to the graph
def test_torch_compile_fullgraph(causal, device):
    backend = "inductor" if device.type == "cuda" else "aot_eager"

    def f(q, k, v):
        o, lse = flash_attn(q, k, v, causal=causal, return_lse=True)
        return o * 2.0, lse

    compiled = torch.compile(f, fullgraph=True, backend=backend)
    q, k, v = qkv(1, 33, 33, 2, 1, 32, torch.float32, device)
    do = make(q.shape, q.dtype, device, seed=5)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    o, lse = compiled(*leaves)
    (o * do).sum().backward()
    ref = [t.double().requires_grad_() for t in (q, k, v)]
    o64, lse64 = attention_reference(*ref, causal=causal, return_lse=True)
    (o64 * 2.0 * do.double()).sum().backward()
    assert_close(o, o64 * 2.0, name="compiled o")
    assert_close(lse, lse64, name="compiled lse")
    for a, r, name in zip(leaves, ref, ("dq", "dk", "dv")):
        assert_close(a.grad, r.grad, name=f"compiled {name}")


def test_torch_compile_window_softcap(device):
    backend = "inductor" if device.type == "cuda" else "aot_eager"
    compiled = torch.compile(
        lambda q, k, v: flash_attn(q, k, v, True, window_size=(12, -1), softcap=3.0),
        fullgraph=True,
        backend=backend,
    )
    q, k, v = qkv(1, 40, 40, 2, 1, 32, torch.float32, device)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    compiled(*leaves).sum().backward()
    ref = [t.double().requires_grad_() for t in (q, k, v)]
    o64 = attention_reference(*ref, causal=True, window_size=(12, -1), softcap=3.0)
    o64.sum().backward()
    for a, r, name in zip(leaves, ref, ("dq", "dk", "dv")):
        assert_close(a.grad, r.grad, name=f"compiled {name}")


def test_cpu_tensors_without_interpreter_use_the_reference(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    q, k, v = (t.requires_grad_() for t in qkv(1, 9, 12, 2, 1, 16, torch.float32, "cpu"))
    o, lse = flash_attn(q, k, v, causal=True, return_lse=True)
    o.sum().backward()
    ref = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    o_r, lse_r = attention_reference(*ref, causal=True, return_lse=True)
    assert torch.equal(o, o_r) and torch.equal(lse, lse_r)
    # The backward is the closed form (attention_reference_grads), checked against float64.
    ref = [t.detach().double().requires_grad_() for t in (q, k, v)]
    attention_reference(*ref, causal=True).sum().backward()
    for a, r, name in zip((q, k, v), ref, ("dq", "dk", "dv")):
        assert_close(a.grad, r.grad, name=name)


# The CPU fallback's backward in closed form (reference.attention_reference_grads) against
# autograd through the reference, in float64: GQA, softcap, windows, rows that see no key and
# an LSE gradient. (B, Nq, Nk, H, Hkv, D), causal, window_size, softcap.
REFERENCE_GRAD_CASES = [
    ((2, 9, 12, 4, 2, 16), True, (-1, -1), 0.0),
    ((1, 14, 6, 2, 1, 24), True, (-1, -1), 2.5),  # Nq > Nk: rows that see no key
    ((1, 11, 11, 3, 1, 16), False, (3, 2), 0.0),
    ((2, 7, 13, 2, 2, 8), False, (-1, -1), 1.5),
]


@pytest.mark.parametrize("case", REFERENCE_GRAD_CASES, ids=lambda c: str(c[0]))
def test_reference_grads_closed_form(case):
    (b, nq, nk, h, hkv, d), causal, window, softcap = case
    q, k, v = qkv(b, nq, nk, h, hkv, d, torch.float64, "cpu")
    do = make((b, nq, h, d), torch.float64, "cpu", seed=5)
    dlse = make((b, h, nq), torch.float64, "cpu", seed=6)
    kw = dict(causal=causal, softmax_scale=0.3, softcap=softcap, window_size=window)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    o, lse = attention_reference(*leaves, return_lse=True, **kw)
    expected = torch.autograd.grad([o, finite(lse)], leaves, [do, dlse])
    got = attention_reference_grads(do, q, k, v, dlse=dlse, **kw)
    for g, e, name in zip(got, expected, ("dq", "dk", "dv")):
        torch.testing.assert_close(g, e, rtol=1e-10, atol=1e-12, msg=name)
    # float32 inputs: computed in float32, returned as float32.
    got32 = attention_reference_grads(do.float(), q.float(), k.float(), v.float(), dlse=dlse, **kw)
    for g, e, name in zip(got32, expected, ("dq", "dk", "dv")):
        assert g.dtype == torch.float32
        torch.testing.assert_close(g.double(), e, rtol=1e-4, atol=1e-5, msg=name)


def test_varlen_reference_grads_closed_form():
    q, k, v, kw = packed([4, 0, 9, 5], [6, 2, 9, 0], 4, 2, 16, torch.float64, "cpu")
    do = make(q.shape, torch.float64, "cpu", seed=5)
    dlse = make((q.shape[1], q.shape[0]), torch.float64, "cpu", seed=6)
    opts = dict(causal=True, softcap=2.0)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    o, lse = attention_varlen_reference(*leaves, return_lse=True, **opts, **kw)
    expected = torch.autograd.grad([o, finite(lse)], leaves, [do, dlse])
    cu = (kw["cu_seqlens_q"], kw["cu_seqlens_k"])
    got = attention_varlen_reference_grads(do, q, k, v, *cu, dlse=dlse, **opts)
    for g, e, name in zip(got, expected, ("dq", "dk", "dv")):
        torch.testing.assert_close(g, e, rtol=1e-10, atol=1e-12, msg=name)


_COMPILE_WITHOUT_INTERPRETER = """
import torch
from kernelkit.flash_attn import flash_attn
from kernelkit.flash_attn.reference import attention_reference
q, k, v = (torch.randn(2, 9, h, 16) for h in (4, 2, 2))
leaves = [t.clone().requires_grad_() for t in (q, k, v)]
f = torch.compile(lambda *a: flash_attn(*a, causal=True, softcap=3.0), fullgraph=True,
                  backend="aot_eager")
f(*leaves).sum().backward()
ref = [t.double().requires_grad_() for t in (q, k, v)]
attention_reference(*ref, causal=True, softcap=3.0).sum().backward()
for a, r in zip(leaves, ref):
    torch.testing.assert_close(a.grad.double(), r.grad, rtol=1e-4, atol=1e-5)
print("ok")
"""


def test_torch_compile_backward_on_cpu_without_interpreter():
    """On CPU without the interpreter the ops run the PyTorch reference, and torch.compile
    traces their bodies (torch.library.triton_op): the backward must trace too. A fresh process,
    since the interpreter setting is read when the ops are registered."""
    assert run_without_interpreter(_COMPILE_WITHOUT_INTERPRETER).strip().endswith("ok")


def _errors(device):
    def t(*shape, dtype=torch.float32, dev=device):
        return torch.zeros(shape, dtype=dtype, device=dev)

    q = t(2, 8, 4, 32)
    kv = t(2, 8, 2, 32)
    return [
        ((q.tolist(), kv, kv), "q: expected a torch.Tensor"),
        ((t(2, 8, 4, 32, dtype=torch.int32), kv, kv), "q: dtype"),
        ((q, t(2, 8, 2, 32, dtype=torch.float16), kv), "k: dtype"),
        ((q, kv, t(2, 8, 2, 32, dtype=torch.bfloat16)), "v: dtype"),
        ((t(8, 32), t(8, 32), t(8, 32)), r"q: expected shape \(B, Nq, H, D\)"),
        ((q, t(2, 8, 32), kv), "k: expected"),
        ((q, kv, t(2, 9, 2, 32)), "v: shape"),
        ((q, t(3, 8, 2, 32), t(3, 8, 2, 32)), "k: batch size 3"),
        ((q, t(2, 8, 2, 64), t(2, 8, 2, 64)), "k: head dim 64"),
        ((q, t(2, 8, 3, 32), t(2, 8, 3, 32)), "not a multiple"),
        ((t(2, 8, 4, 8), t(2, 8, 2, 8), t(2, 8, 2, 8)), "D=8 outside 16..256"),
        ((t(2, 8, 4, 272), t(2, 8, 2, 272), t(2, 8, 2, 272)), "D=272 outside"),
        ((t(2, 0, 4, 32), kv, kv), "Nq must be >= 1"),
        ((q, t(2, 0, 2, 32), t(2, 0, 2, 32)), "Nk must be >= 1"),
        ((q, t(2, 8, 0, 32), t(2, 8, 0, 32)), "at least one head"),
    ]


@pytest.mark.parametrize("case", range(15))
def test_errors(case, device):
    args, match = _errors(device)[case]
    with pytest.raises(ValueError, match=match):
        flash_attn(*args)


def test_argument_errors(device):
    q = torch.zeros(1, 4, 1, 16, device=device)
    with pytest.raises(ValueError, match="causal: expected a bool"):
        flash_attn(q, q, q, causal=1)
    with pytest.raises(ValueError, match="softmax_scale: must be finite"):
        flash_attn(q, q, q, softmax_scale=math.inf)
    with pytest.raises(ValueError, match="softmax_scale: expected a float"):
        flash_attn(q, q, q, softmax_scale="0.1")
    with pytest.raises(ValueError, match="q: expected"):
        FlashAttentionFunction.apply(q, q, q, False)
    for bad, match in ((-1.0, "softcap: must be finite and >= 0"), (math.nan, "softcap: must"),
                       (math.inf, "softcap: must"), ("50", "softcap: expected a float"),
                       (True, "softcap: expected a float")):  # fmt: skip
        with pytest.raises(ValueError, match=match):
            flash_attn(q, q, q, softcap=bad)
    for bad, match in ((4, "window_size: expected a pair"), ((1, 2, 3), "window_size: expected"),
                       ((1.0, 2), "window_size: expected"), ((True, 0), "window_size: expected"),
                       ((-2, 0), "window_size: sizes must be >= 0, or -1"),
                       ((0, -5), "window_size: sizes must")):  # fmt: skip
        with pytest.raises(ValueError, match=match):
            flash_attn(q, q, q, window_size=bad)
    with pytest.raises(ValueError, match="window_size: right=2 conflicts with causal=True"):
        flash_attn(q, q, q, causal=True, window_size=(4, 2))


@pytest.mark.gpu
def test_device_mismatch():
    q = torch.zeros(1, 4, 1, 16, device="cuda")
    with pytest.raises(ValueError, match="k: on device cpu"):
        flash_attn(q, q.cpu(), q)


def _prepared(q, k, v, kw):
    """What `flash_attn`'s checks make of a call: the prepared arguments, whether q is
    unchanged (4-D, not negated: the call a shortcut replays) and the LSE flag; or the error."""
    try:
        fa_op.check_bool("return_lse", kw["return_lse"])
        args = dict(kw)
        del args["return_lse"]
        q4, _, _, options, three_d = fa_op._prepare(q, k, v, **args)
    except ValueError as e:
        return ("error", str(e))
    return options, three_d, q4 is q, kw["return_lse"]


def test_shortcut_key_holds_what_the_checks_read(device):
    """`flash_attn`'s shortcut (`op._call_key`: a call like an earlier checked one replays its
    sequence without the checks) is sound: calls with one key pass the checks alike, to the same
    prepared arguments. A valid call, then every change of one argument: to another valid value,
    to an invalid one, to a value of another type that compares equal (1 for True, 4.0 for 4),
    and tensors of other layouts, dtypes, classes, devices or alignment."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    def t(*shape, dtype=torch.float16):
        return torch.zeros(shape, dtype=dtype, device=device)

    q, kv = t(2, 8, 4, 32), t(2, 8, 2, 32)
    with FakeTensorMode():
        fake = torch.empty(2, 8, 4, 32, dtype=torch.float16, device=device)
    base = {"causal": True, "softmax_scale": None, "return_lse": False, "window_size": (-1, -1),
            "softcap": 0.0, "deterministic": True, "sm_margin": 0}  # fmt: skip
    options = [
        ("causal", False), ("causal", 1), ("causal", 1.0), ("softmax_scale", 0.5),
        ("softmax_scale", 1), ("softmax_scale", True), ("softmax_scale", -0.5),
        ("softmax_scale", math.inf), ("softmax_scale", math.nan), ("return_lse", True),
        ("return_lse", 1), ("window_size", (4, 0)), ("window_size", (4.0, 0)),
        ("window_size", [4, 0]), ("window_size", (True, 0)), ("window_size", (-2, 0)),
        ("window_size", (4, 2)), ("window_size", (7, 0)), ("window_size", (100, 0)),
        ("window_size", (4,)), ("softcap", 30.0), ("softcap", 30), ("softcap", True),
        ("softcap", -1.0), ("softcap", math.nan), ("deterministic", False),
        ("deterministic", 1), ("sm_margin", 1), ("sm_margin", True), ("sm_margin", -1),
        ("sm_margin", 1.0),
    ]  # fmt: skip
    tensors = [
        (0, t(2, 8, 4, 32, dtype=torch.int32)), (0, t(2, 8, 4, 32, dtype=torch.bfloat16)),
        (0, t(2, 8, 32)), (0, t(2, 8, 4, 16)), (0, t(1, 8, 4, 32)), (0, t(2, 8, 3, 32)),
        (0, t(2, 0, 4, 32)), (0, t(2, 8, 4, 33)[..., 1:]), (0, t(2, 4, 8, 32).transpose(1, 2)),
        (0, fake), (0, torch.nn.Parameter(q)), (0, q.clone().requires_grad_()),
        (1, t(2, 8, 2, 16)), (1, t(2, 5, 2, 32)), (1, t(2, 8, 2, 32, dtype=torch.float32)),
        (1, q), (2, t(2, 8, 2, 48)), (2, kv), (2, t(2, 8, 2, 64)[..., ::2]),
    ]  # fmt: skip
    if device.type == "cuda":
        tensors += [(1, kv.cpu()), (2, kv.cpu())]
    calls = [((q, kv, kv.clone()), dict(base))]
    for name, value in options:
        calls.append(((q, kv, kv.clone()), {**base, name: value}))
    for i, value in tensors:
        qkv_ = [q, kv, kv.clone()]
        qkv_[i] = value
        calls.append((tuple(qkv_), dict(base)))
    outcomes: dict = {}
    for (a, b, c), kw in calls:
        key = fa_op._call_key(a, b, c, **kw)
        if key is not None:
            outcomes.setdefault(key, set()).add(_prepared(a, b, c, kw))
    assert fa_op._call_key(q, kv, kv.clone(), **base) is not None  # the valid call has a key
    for seen in outcomes.values():
        assert len(seen) == 1, seen  # one key, one outcome


def test_repeated_calls_take_the_shortcut(device):
    """A call like an earlier one that passed the checks replays its sequence at once
    (`op._CALLS`), with the same outputs bitwise: causal, non-causal with Nq != Nk, split-KV
    decoding, a window, softcap, an explicit scale, one tensor as q, k and v, and inputs
    requiring grad (the same gradients, bitwise, through the shortcut's autograd node, whose
    backward keeps its own sequence, `op._BACKWARDS`). Calls that take the checked path each
    time: 3-D inputs, a negative scale, an int softcap."""
    shortcut = [
        ((2, 40, 4, 64), (2, 40, 2, 64), {"causal": True}),
        ((1, 33, 2, 32), (1, 50, 2, 32), {}),
        ((2, 1, 4, 64), (2, 600, 1, 64), {"causal": True}),
        ((1, 48, 2, 32), (1, 48, 2, 32), {"causal": True, "window_size": (8, 0)}),
        ((1, 48, 2, 32), (1, 48, 2, 32), {"softcap": 5.0, "softmax_scale": 0.3}),
        ((1, 24, 2, 32), None, {"causal": True}),  # one tensor as q, k and v
        ((1, 40, 4, 32), (1, 40, 2, 32), {"causal": True, "grad": True}),
        ((1, 24, 2, 32), None, {"grad": True}),
    ]
    checked = [
        ((1, 24, 32), (1, 24, 32), {"causal": True}),
        ((1, 24, 2, 32), (1, 24, 2, 32), {"softmax_scale": -0.2}),
        ((1, 24, 2, 32), (1, 24, 2, 32), {"softcap": 5}),
    ]
    for cases, takes in ((shortcut, True), (checked, False)):
        for n, (q_shape, kv_shape, kw) in enumerate(cases):
            kw = dict(kw)
            grad = kw.pop("grad", False)
            fa_op._CALLS.clear()
            fa_op._BACKWARDS.clear()
            outs, grads = [], []
            # recorded, shortcut (its backward recorded), shortcuts on other and on the same
            # values (their backwards too)
            for seed in (0, 0, 1, 0):
                q = make(q_shape, torch.bfloat16, device, seed).requires_grad_(grad)
                k, v = (q, q) if kv_shape is None else (
                    make(kv_shape, torch.bfloat16, device, seed + 1).requires_grad_(grad),
                    make(kv_shape, torch.bfloat16, device, seed + 2).requires_grad_(grad),
                )  # fmt: skip
                o, lse = flash_attn(q, k, v, return_lse=True, **kw)
                assert len(fa_op._CALLS._plans) == int(takes), (n, kw)
                outs.append((o.detach(), lse.detach(), (q, k, v)))
                if grad:
                    do = make(o.shape, o.dtype, device, 7)
                    inputs = (q,) if kv_shape is None else (q, k, v)
                    grads.append(torch.autograd.grad(o, inputs, do))
            for i in (1, 3):
                assert torch.equal(outs[0][0], outs[i][0]) and torch.equal(outs[0][1], outs[i][1])
            if grad:
                assert len(fa_op._BACKWARDS._plans) == 1
                for i in (1, 3):
                    assert all(torch.equal(a, b) for a, b in zip(grads[0], grads[i]))
            # the third call against the full host path (chooser, no replay), bitwise
            o, lse = _direct_forward(*(x.detach() for x in outs[2][2]), kw)
            assert torch.equal(outs[2][0], o) and torch.equal(outs[2][1], lse), (n, kw)


def test_shortcut_backward_keys_the_output_gradient(device):
    """The backward of a shortcut forward keeps its sequence per layout of do and dlse
    (`op._BACKWARDS`): do contiguous, with other strides, not 16-byte aligned, the output
    itself, with stride 0 (which the backward copies: no sequence) and with an LSE gradient,
    each twice and in an order where each could take the
    sequence kept for the one before; every time bitwise the checked backward's gradients
    (`flash_attn_backward`)."""
    q, k, v = (x.requires_grad_() for x in qkv(1, 24, 24, 4, 2, 32, torch.bfloat16, device))
    fa_op._CALLS.clear()
    fa_op._BACKWARDS.clear()
    flash_attn(q, k, v, causal=True, return_lse=True)  # checked: the shortcut is recorded
    shape = (1, 24, 4, 32)
    variants = [
        lambda o: make(shape, o.dtype, device, 3),
        lambda o: make((1, 4, 24, 32), o.dtype, device, 4).transpose(1, 2),
        lambda o: make((o.numel() + 1,), o.dtype, device, 5)[1:].view(shape),
        lambda o: o,
        lambda o: make((1, 1, 1, 1), o.dtype, device, 8).expand(shape),  # stride 0: copied
        lambda o: make(shape, o.dtype, device, 6),
    ]
    for n, do_of in enumerate(variants):
        for _ in range(2):
            o, lse = flash_attn(q, k, v, causal=True, return_lse=True)
            do = do_of(o)
            dlse = make(lse.shape, torch.float32, device, 7) if n == 5 else None
            outputs, grads = ((o, lse), (do, dlse)) if dlse is not None else ((o,), (do,))
            got = torch.autograd.grad(outputs, (q, k, v), grads)
            want = flash_attn_backward(do.detach(), q.detach(), k.detach(), v.detach(),
                                       o.detach(), lse.detach(), causal=True,
                                       dlse=dlse)  # fmt: skip
            assert all(torch.equal(a, b) for a, b in zip(got, want)), n
    # contiguous, strided, misaligned, with dlse, and stride 0 (kept as not recorded)
    assert len(fa_op._BACKWARDS._plans) == 5


def _direct_forward(q, k, v, kw):
    """`flash_attn(q, k, v, return_lse=True, **kw)` through the full host path: the checks,
    the chooser's config, launches without replay."""
    from kernelkit.flash_attn import launch

    opts = {"causal": False, "softmax_scale": None, "window_size": (-1, -1), "softcap": 0.0,
            "deterministic": True, **kw}  # fmt: skip
    q4, k4, v4, (causal, scale, softcap, left, right, _, _), three_d = fa_op._prepare(
        q, k, v, **opts
    )
    window = (left, right)
    cfg = choose_fwd(launch.forward_problem(q4, k4, v4, causal, softcap, window))
    o, lse = launch.forward(q4, k4, v4, causal, scale, softcap=softcap, window=window, config=cfg)
    return (o.squeeze(2), lse.squeeze(1)) if three_d else (o, lse)


def test_replayed_launches_match_the_full_host_path():
    """Launch sequences recorded per layout and replayed (`replay`, through prepared launches)
    pass the same compiled kernels the same arguments, tensor for tensor, as the full host path
    through Triton's own launcher."""
    from pathlib import Path

    from kernelkit.shared.testing import assert_launch_paths_agree

    assert_launch_paths_agree(Path(__file__).with_name("launch_calls.py"))
