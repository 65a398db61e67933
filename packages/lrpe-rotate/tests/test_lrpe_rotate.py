"""lrpe_rotate: every act x theta form x dtype x offset x layout against a float64 reference,
gradients of x and theta included.

Runs the real Triton kernels: on the GPU when there is one, otherwise under the Triton
interpreter (the kernelkit pytest plugin switches it on before the kernels are imported).
"""

import pytest
import torch

from kernelkit.lrpe_core.reference import packed_positions
from kernelkit.lrpe_rotate import lrpe_rotate
from kernelkit.lrpe_rotate.kernels import PLAN
from kernelkit.lrpe_rotate.op import bwd, fwd, fwd_seq
from kernelkit.lrpe_rotate.reference import lrpe_rotate_reference
from kernelkit.shared.testing import assert_close, compilations

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# (act, dim): every activation; softmax over D (dim=-1) and over the sequence (dim=1).
ACT_CASES = [
    ("none", None),
    ("relu", None),
    ("sigmoid", None),
    ("silu", None),
    ("softmax", -1),
    ("softmax", 1),
]
THETA_FORMS = ["full", "single", "partial", "shared"]


def case_id(c):
    return c[0] if c[1] is None else f"{c[0]}{c[1]}"


def make(shape, dtype, device, scale=2.0, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g, dtype=torch.float64) * scale).to(dtype).to(device)


def make_theta(form, heads, d, device, seed=1):
    """Frequencies of each form: full (H, D/2), single (H, 1), partial (H, E < D/2) and one row
    shared by all heads (1, D/2). LRPE-style decay 10000^(-j/E) with a random scale per head."""
    half = d // 2
    rows = 1 if form == "shared" else heads
    e = {"full": half, "shared": half, "single": 1, "partial": max(1, half // 2)}[form]
    g = torch.Generator().manual_seed(seed)
    base = 10000.0 ** (-torch.arange(e, dtype=torch.float64) / e)
    scale = 0.5 + torch.rand(rows, 1, generator=g, dtype=torch.float64)
    return (scale * base).float().to(device)


def positions_offset(kind, batch, device):
    if kind == "per_batch":
        return torch.tensor([3, 100_000, 0, 77][:batch], device=device)
    return kind


def check(
    x, theta, offset=0, act="none", dim=None, theta_grad=True, dy=None, positions=None, cu=None
):
    """Forward, dx and dtheta vs float64 and vs PyTorch in x.dtype. `positions` or `cu`
    (cu_seqlens of sequences packed along N) are passed through to lrpe_rotate."""
    x = x.detach().requires_grad_()
    theta = theta.detach().requires_grad_(theta_grad)
    y = lrpe_rotate(x, theta, offset, act, dim, positions=positions, cu_seqlens=cu)
    if positions is not None:
        offset = positions
    elif cu is not None:
        offset = packed_positions(cu, x.shape[1])
    x64 = x.detach().double().requires_grad_()
    th64 = theta.detach().double().requires_grad_(theta_grad)
    y64 = lrpe_rotate_reference(x64, th64, offset, act, dim, cu)
    xl = x.detach().clone().requires_grad_()
    thl = theta.detach().clone().requires_grad_(theta_grad)
    yl = lrpe_rotate_reference(xl, thl, offset, act, dim, cu)
    assert y.dtype == x.dtype and y.shape == x.shape
    assert_close(y, y64, ref_lowp=yl, name=f"{act} forward")
    if dy is None:
        dy = make(x.shape, x.dtype, x.device, scale=1.0, seed=7)
    y.backward(dy)
    y64.backward(dy.double())
    yl.backward(dy)
    assert_close(x.grad, x64.grad, ref_lowp=xl.grad, name=f"{act} dx")
    if theta_grad:
        assert theta.grad.dtype == theta.dtype and theta.grad.shape == theta.shape
        assert_close(theta.grad, th64.grad, ref_lowp=thl.grad, name=f"{act} dtheta")
    else:
        assert theta.grad is None


# ---------------------------------------------------------------------------------------------
# Options: act x theta form x dtype, offsets, sizes
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("form", THETA_FORMS)
@pytest.mark.parametrize("case", ACT_CASES, ids=case_id)
def test_act_theta_forms_fp32(case, form, device):
    """The full matrix on float32; D/2 = 9 is odd (masked pair lanes)."""
    x = make((2, 33, 3, 18), torch.float32, device)
    check(x, make_theta(form, 3, 18, device), 7, *case)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("case", ACT_CASES, ids=case_id)
def test_act_low_precision(case, dtype, device):
    x = make((2, 33, 2, 16), dtype, device)
    check(x, make_theta("full", 2, 16, device), 5, *case)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("form", ["single", "partial"])
def test_theta_forms_low_precision(form, dtype, device):
    x = make((2, 17, 2, 16), dtype, device)
    check(x, make_theta(form, 2, 16, device), 0, "silu")


@pytest.mark.parametrize("offset", [0, 7, "per_batch", 100_000], ids=str)
@pytest.mark.parametrize("case", [("silu", None), ("softmax", -1), ("softmax", 1)], ids=case_id)
def test_offsets(case, offset, device):
    """Large positions stay exact: angles are float32(theta) * float32(position)."""
    x = make((3, 20, 2, 16), torch.float32, device)
    check(x, make_theta("full", 2, 16, device), positions_offset(offset, 3, device), *case)


def packing(lengths, device):
    """int32 prefix sums of `lengths` on `device`."""
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32).to(
        device
    )


@pytest.mark.parametrize("case", ACT_CASES, ids=case_id)
def test_positions_table(case, device):
    """Per-token positions (B, N) up to 3e5: exact (float32 products of integers)."""
    x = make((2, 29, 2, 16), torch.float32, device)
    g = torch.Generator().manual_seed(4)
    positions = torch.randint(0, 300_000, (2, 29), generator=g).to(device)
    check(x, make_theta("full", 2, 16, device), 0, *case, positions=positions)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", ACT_CASES, ids=case_id)
def test_packed_sequences(case, dtype, device):
    """(1, total, H, D) with cu_seqlens: positions restart per sequence, softmax over N runs
    per sequence; lengths 0 and 1 included."""
    lengths = [5, 1, 0, 40, 17, 0]
    x = make((1, sum(lengths), 2, 16), dtype, device)
    check(x, make_theta("full", 2, 16, device), 0, *case, cu=packing(lengths, device))


@pytest.mark.gpu
@pytest.mark.parametrize("theta_grad", [False, True])
def test_packed_softmax_gpu_scale(theta_grad, device):
    """Softmax over packed documents of 1 to 16k tokens at GPU scale, bf16."""
    lengths = [16384, 1, 0, 3000, 7, 9000, 2048]
    x = make((1, sum(lengths), 4, 128), torch.bfloat16, device)
    theta = make_theta("full", 4, 128, device)
    check(x, theta, 0, "softmax", 1, theta_grad=theta_grad, cu=packing(lengths, device))


@pytest.mark.parametrize("case", [("silu", None), ("softmax", 1)], ids=case_id)
def test_packed_long_sequences_many_chunks(case, device):
    """Sequences split into several chunks, some of them empty."""
    lengths = [300, 1, 0, 450]
    x = make((1, sum(lengths), 1, 16), torch.float32, device)
    check(x, make_theta("single", 1, 16, device), 0, *case, cu=packing(lengths, device))


@pytest.mark.parametrize("dtype", DTYPES)
def test_large_offset_every_dtype(dtype, device):
    x = make((2, 9, 2, 32), dtype, device)
    check(x, make_theta("full", 2, 32, device), 123_457, "none")


def test_positions_beyond_float32_integers(device):
    """Positions past 2**24 round to float32 before the product, as the reference defines."""
    x = make((1, 5, 1, 8), torch.float32, device)
    check(x, make_theta("full", 1, 8, device, seed=3) * 1e-3, 2**25 + 3, "none")


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_per_batch_offset_dtypes(dtype, device):
    x = make((4, 11, 2, 8), torch.float32, device)
    offsets = torch.tensor([0, 5, 1000, 99_999], dtype=dtype, device=device)
    check(x, make_theta("full", 2, 8, device), offsets, "sigmoid")


def test_per_batch_offset_matches_int_offset(device):
    """Row b of a per-batch call equals an int-offset call at offset_b (same kernel math)."""
    x = make((3, 13, 2, 16), torch.float32, device)
    theta = make_theta("full", 2, 16, device)
    offsets = [4, 0, 50_000]
    y = lrpe_rotate(x, theta, torch.tensor(offsets, device=device), "silu")
    for b, off in enumerate(offsets):
        torch.testing.assert_close(y[b : b + 1], lrpe_rotate(x[b : b + 1], theta, off, "silu"))


@pytest.mark.parametrize("n", [1, 33])
@pytest.mark.parametrize("case", ACT_CASES, ids=case_id)
def test_odd_sequence_lengths(case, n, device):
    x = make((2, n, 2, 16), torch.float32, device)
    check(x, make_theta("full", 2, 16, device), 3, *case)


@pytest.mark.parametrize("case", [("silu", None), ("softmax", 1)], ids=case_id)
def test_long_sequence_many_chunks(case, device):
    """N = 1100: softmax over N combines many chunks (stats, sums) in both directions (above
    the stats' one-pass bound: chunks and their merge)."""
    x = make((1, 1100, 2, 32), torch.float32, device)
    assert PLAN.stats_one_pass < 1100 * 32
    check(x, make_theta("full", 2, 32, device), 11, *case)


@pytest.mark.parametrize("d", [2, 80])
@pytest.mark.parametrize("case", [("none", None), ("softmax", -1), ("softmax", 1)], ids=case_id)
def test_head_dims(case, d, device):
    x = make((2, 9, 2, d), torch.bfloat16, device)
    check(x, make_theta("full", 2, d, device), 1, *case)


def test_partial_pairs_pass_through(device):
    """Pairs j >= E are not rotated: y equals act(x) there, bit for bit."""
    x = make((2, 7, 3, 16), torch.bfloat16, device)
    theta = make_theta("partial", 3, 16, device)  # E = 4 of 8 pairs
    y = lrpe_rotate(x, theta, 9, "relu")
    rest = torch.cat([x[..., 4:8], x[..., 12:16]], -1).relu()
    assert torch.equal(torch.cat([y[..., 4:8], y[..., 12:16]], -1), rest)


# ---------------------------------------------------------------------------------------------
# Layouts
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("case", [("none", None), ("silu", None), ("softmax", -1), ("softmax", 1)])
def test_qkv_slice_read_in_place(case, device):
    """The q slice of a fused qkv tensor (B, N, 3H, D) is read through its strides."""
    qkv = make((2, 19, 3 * 2, 16), torch.bfloat16, device)
    q = qkv[:, :, :2]
    assert not q.is_contiguous()
    check(q, make_theta("full", 2, 16, device), 4, *case)


@pytest.mark.parametrize("case", [("sigmoid", None), ("softmax", -1), ("softmax", 1)])
def test_transposed_input(case, device):
    """(B, H, N, D) storage viewed as (B, N, H, D)."""
    x = make((2, 3, 21, 16), torch.float16, device).transpose(1, 2)
    check(x, make_theta("full", 3, 16, device), 2, *case)


def test_strided_head_dim_and_theta(device):
    """Elements of D not adjacent in memory; theta a transposed view."""
    base = make((2, 9, 2, 32), torch.float32, device)
    x = base[..., ::2]
    theta = make_theta("full", 2, 16, device).t().contiguous().t()
    assert x.stride(-1) == 2 and theta.stride(0) == 1
    check(x, theta, 6, "silu")
    check(x, theta, 6, "softmax", 1)


@pytest.mark.parametrize("case", [("none", None), ("softmax", -1), ("softmax", 2), ("softmax", 1)])
def test_three_dim_input(case, device):
    """(B, N, D) without a head axis, theta (1, E); dim=2 is D for a 3-D x."""
    x = make((3, 15, 16), torch.float32, device)
    check(x, make_theta("shared", 1, 16, device), torch.tensor([1, 2, 3], device=device), *case)


@pytest.mark.parametrize("case", [("silu", None), ("softmax", 1)], ids=case_id)
def test_expanded_grad_output(case, device):
    """y.sum().backward() hands the backward a stride-0 gradient."""
    x = make((2, 9, 2, 8), torch.float32, device).requires_grad_()
    theta = make_theta("full", 2, 8, device).requires_grad_()
    lrpe_rotate(x, theta, 3, *case).sum().backward()
    x64 = x.detach().double().requires_grad_()
    th64 = theta.detach().double().requires_grad_()
    lrpe_rotate_reference(x64, th64, 3, *case).sum().backward()
    assert_close(x.grad, x64.grad, name="dx of sum")
    assert_close(theta.grad, th64.grad, name="dtheta of sum")


@pytest.mark.parametrize("theta_dtype", [torch.bfloat16, torch.float64])
def test_theta_dtypes(theta_dtype, device):
    """Lower (and higher) precision frequencies are read and upcast; dtheta keeps their dtype."""
    x = make((2, 9, 2, 8), torch.float32, device)
    theta = make_theta("full", 2, 8, device).to(theta_dtype).requires_grad_()
    y = lrpe_rotate(x, theta, 3, "silu")
    y.backward(torch.ones_like(y))
    assert theta.grad.dtype == theta_dtype
    ref = lrpe_rotate_reference(x.double(), theta.detach().float().double(), 3, "silu")
    assert_close(y, ref, name="forward with theta in " + str(theta_dtype))


def test_parameter_theta_takes_the_cached_path(device):
    """A learnable theta is an nn.Parameter: it must hit the replayed launch sequences (a
    Parameter once counted as a traced tensor: a plan was rebuilt on every call) and give the
    same results and gradients as a plain tensor."""
    from kernelkit.shared import replay

    x = make((2, 19, 2, 16), torch.float32, device)  # a layout no other test uses
    theta = torch.nn.Parameter(make_theta("full", 2, 16, device))
    plans = len(replay._SEQUENCES._plans)
    lrpe_rotate(x, theta, 3, "silu").sum().backward()
    cached = len(replay._SEQUENCES._plans)
    assert cached == plans + 2  # the forward's and the backward's launch sequences
    for offset in (3, 4, 2**40 + 1):  # new offsets (and, last, a new int width: recorded anew)
        lrpe_rotate(x, theta, offset, "silu").sum().backward()
    assert len(replay._SEQUENCES._plans) == cached + 2
    check(x, theta, 3, "silu")


def test_theta_gradient_only(device):
    """A learnable theta with a frozen x (e.g. rotating cached keys)."""
    x = make((2, 9, 2, 8), torch.bfloat16, device)
    theta = make_theta("single", 2, 8, device).requires_grad_()
    lrpe_rotate(x, theta, 40, "softmax", -1).backward(make(x.shape, x.dtype, device, seed=2))
    th64 = theta.detach().double().requires_grad_()
    y64 = lrpe_rotate_reference(x.double(), th64, 40, "softmax", -1)
    y64.backward(make(x.shape, x.dtype, device, seed=2).double())
    assert x.grad is None
    assert_close(theta.grad, th64.grad, name="dtheta with a frozen x")


@pytest.mark.parametrize(
    ("act", "dim", "theta_grad"),
    [("none", None, False), ("silu", None, True), ("softmax", 1, True)],
)
def test_pytorch_reference_fallback(act, dim, theta_grad, device, monkeypatch):
    """Tensors the kernels do not take (CPU without the interpreter) run the reference, through
    the same ops and autograd (act none with a fixed theta saves no x there either)."""
    import kernelkit.lrpe_rotate.op as rot_op

    monkeypatch.setattr(rot_op, "use_triton", lambda t: False)
    x = make((2, 11, 2, 8), torch.float16, device)
    check(x, make_theta("full", 2, 8, device), 3, act, dim, theta_grad=theta_grad)


def test_empty_inputs(device):
    theta = make_theta("full", 2, 8, device).requires_grad_()
    for shape in [(0, 5, 2, 8), (2, 0, 2, 8)]:
        x = torch.zeros(shape, device=device, requires_grad=True)
        for case in [("silu", None), ("softmax", 1)]:
            y = lrpe_rotate(x, theta, 0, *case)
            assert y.shape == shape
            y.sum().backward()
            assert x.grad.shape == shape
            assert torch.equal(theta.grad, torch.zeros_like(theta))


# ---------------------------------------------------------------------------------------------
# Memory: what the backward keeps
# ---------------------------------------------------------------------------------------------


def saved_numels(fn):
    sizes = []

    def pack(t):
        sizes.append(t.numel())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return sizes


@pytest.mark.parametrize(
    ("act", "dim", "theta_grad", "keeps_x"),
    [
        ("none", None, False, False),
        ("none", None, True, True),
        ("silu", None, False, True),
        ("softmax", 1, False, True),
    ],
)
def test_backward_keeps_only_x(act, dim, theta_grad, keeps_x, device):
    x = make((2, 16, 2, 8), torch.float32, device).requires_grad_()
    theta = make_theta("full", 2, 8, device).requires_grad_(theta_grad)
    big = [n for n in saved_numels(lambda: lrpe_rotate(x, theta, 0, act, dim)) if n >= x.numel()]
    assert big == ([x.numel()] if keeps_x else [])


# ---------------------------------------------------------------------------------------------
# Errors
# ---------------------------------------------------------------------------------------------


def _args(device, **over):
    args = {
        "x": torch.ones(2, 4, 3, 8, device=device),
        "theta": torch.ones(3, 4, device=device),
        "offset": 0,
        "act": "none",
        "dim": None,
    }
    args.update(over)
    return args


@pytest.mark.parametrize(
    ("over", "match"),
    [
        ({"x": [1.0]}, "x: expected a torch.Tensor"),
        ({"x": torch.ones(2, 4, 3, 8, dtype=torch.int32)}, "x: dtype"),
        ({"x": torch.ones(2, 4, 3, 8, dtype=torch.float64)}, "x: dtype"),
        ({"x": torch.ones(4, 8)}, "x: expected shape"),
        ({"x": torch.ones(2, 4, 3, 7)}, "x: the head dim D must be even"),
        ({"theta": torch.ones(3, 5)}, "theta: E = 5"),
        ({"theta": torch.ones(2, 4)}, "theta: has 2 rows"),
        ({"theta": torch.ones(12)}, "theta: expected shape"),
        ({"theta": torch.ones(3, 4, dtype=torch.int64)}, "theta: must be a floating-point"),
        ({"offset": 1.5}, "offset: expected an int"),
        ({"offset": True}, "offset: expected an int"),
        ({"offset": torch.zeros(2)}, "offset: a tensor offset must have an integer dtype"),
        ({"offset": torch.zeros(3, dtype=torch.int64)}, r"offset: a tensor offset must have shape"),
        (
            {"offset": torch.zeros((), dtype=torch.int64)},
            r"offset: a tensor offset must have shape",
        ),
        ({"act": "gelu"}, "act: must be one of"),
        ({"act": "relu", "dim": -1}, "dim: only softmax"),
        ({"act": "softmax"}, "dim: softmax needs"),
        ({"act": "softmax", "dim": 2}, "dim: softmax runs over D"),
        ({"act": "softmax", "dim": 4}, "dim: 4 is out of range"),
        ({"act": "softmax", "dim": 1.0}, "dim: expected an int"),
    ],
)
def test_errors(over, match, device):
    args = _args(device)
    for k, v in over.items():
        args[k] = v.to(device) if isinstance(v, torch.Tensor) else v
    with pytest.raises(ValueError, match=match):
        lrpe_rotate(**args)


def test_error_three_dim_needs_one_theta_row(device):
    with pytest.raises(
        ValueError, match=r"theta: has 3 rows, but x \(2, \d+, 8\) is read as \(B, N, D\)"
    ):
        lrpe_rotate(torch.ones(2, 4, 8, device=device), torch.ones(3, 4, device=device))


def test_error_mismatched_devices():
    meta = torch.ones(3, 4, device="meta")
    with pytest.raises(ValueError, match="theta: is on meta"):
        lrpe_rotate(torch.ones(2, 4, 3, 8), meta)
    with pytest.raises(ValueError, match="offset: is on meta"):
        lrpe_rotate(
            torch.ones(2, 4, 3, 8),
            torch.ones(3, 4),
            torch.zeros(2, dtype=torch.int64, device="meta"),
        )


# ---------------------------------------------------------------------------------------------
# torch.library and torch.compile
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kind", "where"), [("silu", "starts"), ("softmax", "int"), ("softmax_seq", "table")]
)
def test_opcheck(kind, where, device):
    x = make((2, 37, 2, 12), torch.float32, device)
    theta = make_theta("full", 2, 12, device)
    starts = torch.tensor([5, 70_000], device=device) if where == "starts" else None
    table = torch.randint(0, 99, (2, 37), device=device) if where == "table" else None
    start = 9 if where == "int" else 0
    args = (x.requires_grad_(), theta.requires_grad_(), start, starts, table, None)
    if kind == "softmax_seq":  # its own op: y and the stats the backward reuses
        torch.library.opcheck(fwd_seq.op, args)
        _, stats = fwd_seq(x.detach(), theta.detach(), start, starts, table, None)
    else:
        torch.library.opcheck(fwd.op, (*args, kind))
        stats = None
    dy = make(x.shape, x.dtype, device, seed=3)
    torch.library.opcheck(
        bwd.op, (dy, x.detach(), theta.detach(), start, starts, table, None, stats, kind, True)
    )


@pytest.mark.parametrize(("act", "dim"), [("silu", None), ("softmax", -1), ("softmax", 1)])
def test_torch_compile_fullgraph(act, dim, device):
    backend = "inductor" if device.type == "cuda" else "aot_eager"
    f = torch.compile(
        lambda t, th: lrpe_rotate(t, th, 5, act, dim) * 2.0, fullgraph=True, backend=backend
    )
    x = make((2, 33, 3, 16), torch.float32, device).requires_grad_()
    theta = make_theta("full", 3, 16, device).requires_grad_()
    dy = make(x.shape, x.dtype, device, seed=5)
    y = f(x, theta)
    y.backward(dy)
    x64 = x.detach().double().requires_grad_()
    th64 = theta.detach().double().requires_grad_()
    y64 = lrpe_rotate_reference(x64, th64, 5, act, dim) * 2.0
    y64.backward(dy.double())
    assert_close(y, y64, name="compiled forward")
    assert_close(x.grad, x64.grad, name="compiled dx")
    assert_close(theta.grad, th64.grad, name="compiled dtheta")


@pytest.mark.gpu
def test_no_recompilation_when_sizes_or_offset_change(device):
    theta = make_theta("full", 4, 128, device).requires_grad_()

    def run(b, n, offset):
        for case in [("silu", None), ("softmax", 1)]:
            x = make((b, n, 4, 128), torch.bfloat16, device).requires_grad_()
            lrpe_rotate(x, theta, offset, *case).sum().backward()

    run(2, 64, 0)
    run(12, 9000, 0)  # several chunks: the softmax's merge kernel compiles once here
    with compilations() as compiled:
        for b, n, offset in [
            (3, 100, 7),
            (1, 1, 1),
            (5, 4097, 100_000),
            (2, 33, 16),
            (12, 9000, 3),
        ]:
            run(b, n, offset)
    assert not compiled, dict(compiled)


@pytest.mark.gpu
@pytest.mark.parametrize("case", ACT_CASES, ids=case_id)
def test_benchmark_shape(case, device):
    """The benchmark's (12, N, 12, 128) bf16 with theta (12, 64), big enough for many groups."""
    x = make((12, 2048, 12, 128), torch.bfloat16, device)
    check(x, make_theta("full", 12, 128, device), 0, *case)


@pytest.mark.gpu
@pytest.mark.parametrize(
    ("act", "dim", "where"),
    [
        ("silu", None, "int"),
        ("softmax", 1, "int"),
        ("softmax", 1, "int-long"),
        ("none", None, "starts"),
        ("none", None, "table"),
        ("softmax", 1, "packed"),
    ],
)
@pytest.mark.parametrize("theta_grad", [True, False], ids=["theta", "frozen_theta"])
def test_cuda_graph_replay(act, dim, where, theta_grad, device):
    """Forward and backward (x, and theta where learnable) captured into a CUDA graph replay new
    inputs bit-exactly: no host sync, allocation outside the pool or compile in the path (the
    host path replays its recorded launch sequence, the chunk-stats merge included: softmax
    over N reads N = 300 in one pass, N = 700 ("int-long") in chunks it merges)."""
    from kernelkit.shared.testing import assert_graph_replays

    b, n, h, d = {"packed": (1, 900, 4, 64), "int-long": (2, 700, 4, 64)}.get(
        where, (3, 300, 4, 64)
    )
    offset = {"starts": torch.tensor([0, 5, 99], device=device), "int": 7, "int-long": 7}.get(
        where, 0
    )
    positions = torch.randint(0, 10**5, (b, n), device=device) if where == "table" else None
    cu = packing([300, 1, 0, 599], device) if where == "packed" else None

    def fwd_bwd(x, theta, dy):
        y = lrpe_rotate(x, theta, offset, act, dim, positions=positions, cu_seqlens=cu)
        return (y, *torch.autograd.grad(y, (x, theta) if theta_grad else (x,), dy))

    def data(seed):
        x = make((b, n, h, d), torch.bfloat16, device, seed=seed).requires_grad_()
        theta = make_theta("full", h, d, device, seed=seed + 1).requires_grad_(theta_grad)
        return [x, theta, make((b, n, h, d), torch.bfloat16, device, seed=seed + 2)]

    assert_graph_replays(fwd_bwd, data(0), [data(10), data(20)])


_PACKED_CACHED_PATH = """
import torch
from kernelkit.shared import runtime
from kernelkit.shared.fake_driver import fake_cuda
import kernelkit.lrpe_rotate.op as op
from kernelkit.lrpe_rotate import lrpe_rotate

op.use_triton = lambda t: True
bound = []
run = runtime._Launcher._run
runtime._Launcher._run = lambda self, grid, *a, **k: bound.append(grid) or run(self, grid, *a, **k)
x = torch.randn(1, 20, 2, 16)
cu = torch.tensor([0, 7, 7, 20], dtype=torch.int32)
with fake_cuda() as log:
    for i in range(3):
        leaf = x.clone().requires_grad_()
        theta = torch.rand(2, 8).requires_grad_()
        lrpe_rotate(leaf, theta, act="silu", cu_seqlens=cu).backward(torch.ones_like(x))
        if i == 0:  # recorded (kernelkit.shared.replay) through launcher[grid]
            bound.clear()
print(len(log.launches), len(bound))
"""


def test_packed_tokens_launches_take_the_prepared_path():
    """Packed sequences through the per-token kernels (POSITIONS_TILING "ahead"): their int
    offset (unused, not in TOKENS_RUNTIME) is fixed in the prepared launch, so no call after
    the recorded first one goes through launcher[grid] (`runtime._Replay`, which binds every
    argument per call). Runs against the fake CUDA driver, without the interpreter (which
    replays every launch)."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    cmd = [sys.executable, "-c", _PACKED_CACHED_PATH]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split() == ["6", "0"]  # 3 forward + 3 backward launches, no replay bound


def test_prepared_launches_match_tritons_path():
    """The launches planned once per layout (prepared, with the int offset varying per call)
    pass the same compiled kernels the same arguments as Triton's own launch path."""
    from pathlib import Path

    from kernelkit.shared.testing import assert_launch_paths_agree

    assert_launch_paths_agree(Path(__file__).with_name("launch_calls.py"))


# ---------------------------------------------------------------------------------------------
# Per-token kernels (kernels.POSITIONS_TILING "ahead", the default) and the "old" tiling
# ---------------------------------------------------------------------------------------------


@pytest.fixture(params=["ahead", "old"])
def tiling(request, monkeypatch):
    """Per-token positions through the *_tokens_kernel pair, several work items per program
    (programs_target 1: as many items as the plan allows, so every loop runs and reloads), and
    through the old kernels (a program per tile and row), which the switch still selects."""
    from kernelkit.lrpe_rotate import kernels as K
    from kernelkit.shared import replay

    monkeypatch.setattr(K, "POSITIONS_TILING", request.param)
    monkeypatch.setattr(K, "programs_target", lambda device, per_sm: 1)
    replay.clear()  # the plans read programs_target
    yield request.param
    replay.clear()


@pytest.mark.parametrize(
    "where", ["table", "table_row", "starts", "packed", "packed_d128", "table_d128"]
)
@pytest.mark.parametrize("case", [("none", None), ("silu", None), ("softmax", -1)], ids=case_id)
def test_positions_tilings(case, where, tiling, device):
    """Every per-token form, N not a multiple of the tile, items crossing batch rows, d(theta)."""
    g = torch.Generator().manual_seed(5)
    if where == "packed":
        lengths = [5, 1, 0, 40, 17, 0, 33]
        x = make((1, sum(lengths), 2, 16), torch.float32, device)
        check(x, make_theta("full", 2, 16, device), 0, *case, cu=packing(lengths, device))
        return
    if where == "packed_d128":  # 32-token tiles: items inside and across sequences
        lengths = [40, 1, 0, 70, 39]
        x = make((1, sum(lengths), 1, 128), torch.float32, device)
        check(x, make_theta("full", 1, 128, device), 0, *case, cu=packing(lengths, device))
        return
    x = make((3, 45, 2, 16), torch.float32, device)
    theta = make_theta("partial", 2, 16, device)
    if where == "table_d128":
        x = make((2, 70, 1, 128), torch.float32, device)
        theta = make_theta("full", 1, 128, device)
    if where == "starts":
        check(x, theta, torch.tensor([3, 100_000, 0], device=device), *case)
        return
    rows = 1 if where == "table_row" else x.shape[0]
    positions = torch.randint(0, 300_000, (rows, x.shape[1]), generator=g).to(device)
    check(x, theta, 0, *case, positions=positions)


def test_positions_tiling_none_without_dtheta(tiling, device):
    """Act none without d(theta): the per-token backward reads no x."""
    x = make((2, 70, 2, 16), torch.bfloat16, device)
    positions = torch.randint(0, 9_000, (2, 70), generator=torch.Generator().manual_seed(6))
    check(x, make_theta("full", 2, 16, device), 0, theta_grad=False, positions=positions.to(device))


def test_positions_tiling_switch_is_read_per_call(device, monkeypatch):
    """Flipping POSITIONS_TILING between calls takes effect (the plan cache keys on it), and
    the tilings agree; an unknown value is an error."""
    from kernelkit.lrpe_rotate import kernels as K

    x = make((1, 50, 2, 16), torch.float32, device)
    theta = make_theta("full", 2, 16, device)
    positions = torch.randint(0, 5_000, (1, 50), generator=torch.Generator().manual_seed(8))
    positions = positions.to(device)
    ys = {}
    for t in K.TILINGS:
        monkeypatch.setattr(K, "POSITIONS_TILING", t)
        ys[t] = lrpe_rotate(x, theta, act="silu", positions=positions)
    torch.testing.assert_close(ys["ahead"], ys["old"])  # FMA contraction may differ on a GPU
    monkeypatch.setattr(K, "POSITIONS_TILING", "bogus")
    with pytest.raises(ValueError, match="POSITIONS_TILING"):
        lrpe_rotate(x, theta, positions=positions)


def test_repeated_calls_take_the_shortcut(device):
    """A call like an earlier one that passed the checks replays its recorded sequence
    (`op._CALLS`): bitwise the checked call (`lrpe_shortcut_pairs`: every kind, a decode
    shape, other offsets and values; calls of other layouts after a kept shortcut)."""
    from kernelkit.lrpe_rotate import op
    from kernelkit.shared.testing import assert_shortcuts_replay, lrpe_shortcut_pairs

    assert_shortcuts_replay(lrpe_rotate, lrpe_shortcut_pairs(16, device), op._CALLS)


def test_repeated_calls_with_gradients_take_the_shortcut(device):
    """With x, theta or both requiring grad, a call like an earlier checked one replays its
    sequence through the op's autograd node (`lrpe_core.op.register_lrpe_autograd`'s
    `LrpeReplayedForward`): output and gradients bitwise the checked call's. Pairs of another
    layout (an offset of another width, theta float64, x of other strides) stay checked."""
    from kernelkit.lrpe_rotate import op
    from kernelkit.shared.testing import assert_lrpe_shortcut_gradients

    assert_lrpe_shortcut_gradients(lrpe_rotate, op._CALLS, 16, device)
