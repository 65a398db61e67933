"""lrpe_cosine: every act x theta form x dtype against a float64 reference, gradients of x and
theta included; offsets, odd sizes, strided layouts, 3-D input, errors, opcheck, torch.compile.

Runs the real Triton kernels: on the GPU when there is one, otherwise under the Triton
interpreter (the kernelkit pytest plugin switches it on before the kernels are imported).
"""

import pytest
import torch

from kernelkit.lrpe_core.reference import packed_positions
from kernelkit.lrpe_cosine import lrpe_cosine
from kernelkit.lrpe_cosine.kernels import PLAN, ROWS, batch_groups, sequence_chunks, tile_sizes
from kernelkit.lrpe_cosine.op import bwd, fwd, fwd_seq
from kernelkit.lrpe_cosine.reference import lrpe_cosine_reference
from kernelkit.shared.runtime import interpreting
from kernelkit.shared.testing import assert_close, compilations

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
ACT_CASES = [
    ("none", None),
    ("relu", None),
    ("sigmoid", None),
    ("silu", None),
    ("softmax", -1),
    ("softmax", 1),
]


def case_id(case):
    a, dim = case
    return a if dim is None else f"{a}{dim}"


def make(shape, dtype, device, scale=2.0, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g, dtype=torch.float64) * scale).to(dtype).to(device)


def make_theta(rows, e, device, seed=1, dtype=torch.float32):
    """LRPE-style frequencies 10000^(-k/E) per row, perturbed so that every row differs."""
    g = torch.Generator().manual_seed(seed)
    base = 10000.0 ** (-torch.arange(e, dtype=torch.float64) / max(e, 1))
    jitter = 1.0 + 0.5 * torch.rand((rows, e), generator=g, dtype=torch.float64)
    return (base * jitter).to(dtype).to(device)


def theta_for(form, rows, d, device):
    e = {"full": d, "single": 1, "partial": max(2, d // 3)}[form]
    return make_theta(rows, e, device)


def check(
    x, theta, offset=0, a="none", dim=None, *, x_grad=True, theta_grad=True, dy=None, cu=None
):
    """Forward and backward of lrpe_cosine vs float64 and vs the reference in x.dtype; `cu`:
    cu_seqlens of sequences packed along N."""
    x = x.detach().requires_grad_(x_grad)
    theta = theta.detach().requires_grad_(theta_grad)
    y = lrpe_cosine(x, theta, offset, a, dim, cu_seqlens=cu)
    if cu is not None:
        offset = packed_positions(cu, x.shape[1])
    x64 = x.detach().double().requires_grad_(x_grad)
    t64 = theta.detach().double().requires_grad_(theta_grad)
    y64 = lrpe_cosine_reference(x64, t64, offset, a, dim, cu)
    xl = x.detach().clone().requires_grad_(x_grad)
    tl_ = theta.detach().clone().requires_grad_(theta_grad)
    yl = lrpe_cosine_reference(xl, tl_, offset, a, dim, cu)
    assert y.dtype == x.dtype and y.shape == (*x.shape[:-1], 2 * x.shape[-1])
    assert_close(y, y64, ref_lowp=yl, name=f"{a}{dim} forward")
    if not (x_grad or theta_grad):
        return y
    if dy is None:
        dy = make(y.shape, y.dtype, y.device, scale=1.0, seed=2)
    y.backward(dy)
    y64.backward(dy.double())
    yl.backward(dy)
    if x_grad:
        assert_close(x.grad, x64.grad, ref_lowp=xl.grad, name=f"{a}{dim} dx")
    if theta_grad:
        assert theta.grad.dtype == theta.dtype and theta.grad.shape == theta.shape
        assert_close(theta.grad, t64.grad, ref_lowp=tl_.grad, name=f"{a}{dim} dtheta")
    return y


# ---------------------------------------------------------------------------------------------
# Every act x theta form x dtype
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("form", ["full", "single", "partial"])
@pytest.mark.parametrize("case", ACT_CASES, ids=case_id)
def test_act_form_dtype(case, form, dtype, device):
    a, dim = case
    x = make((2, 33, 2, 24), dtype, device)
    check(x, theta_for(form, 2, 24, device), 3, a, dim)


def test_partial_form_passes_features_through(device):
    """1 < E < D: features k >= E get angle 0: cos part = act(x), sin part = 0 exactly."""
    x = make((2, 9, 2, 16), torch.float32, device)
    theta = make_theta(2, 5, device)
    y = lrpe_cosine(x, theta, 11, "relu")
    assert torch.equal(y[..., 5:16], torch.relu(x[..., 5:]))
    assert torch.equal(y[..., 16 + 5 :], torch.zeros_like(y[..., 16 + 5 :]))


# ---------------------------------------------------------------------------------------------
# Packed sequences (cu_seqlens) and per-token positions
# ---------------------------------------------------------------------------------------------


def packing(lengths, device):
    """int32 prefix sums of `lengths` on `device`."""
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32).to(
        device
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", ACT_CASES, ids=case_id)
def test_packed_sequences(case, dtype, device):
    """(1, total, H, D) with cu_seqlens: positions restart per sequence, softmax over N runs
    per sequence; lengths 0 and 1 included."""
    lengths = [5, 1, 0, 40, 17, 0]
    x = make((1, sum(lengths), 2, 12), dtype, device)
    check(x, theta_for("full", 2, 12, device), 0, *case, cu=packing(lengths, device))


@pytest.mark.parametrize("case", [("silu", None), ("softmax", 1)], ids=case_id)
def test_packed_long_sequences_many_chunks(case, device):
    """Sequences split into several chunks (some empty) in the softmax-over-N sums pass."""
    lengths = [300, 1, 0, 450]
    x = make((1, sum(lengths), 1, 8), torch.float32, device)
    check(x, theta_for("single", 1, 8, device), 0, *case, cu=packing(lengths, device))


@pytest.mark.gpu
@pytest.mark.parametrize("theta_grad", [False, True])
def test_packed_softmax_gpu_scale(theta_grad, device):
    """Softmax over packed documents of 1 to 16k tokens at GPU scale, bf16."""
    lengths = [16384, 1, 0, 3000, 7, 9000, 2048]
    x = make((1, sum(lengths), 4, 128), torch.bfloat16, device)
    check(x, theta_for("full", 4, 128, device), 0, "softmax", 1, theta_grad=theta_grad,
          cu=packing(lengths, device))  # fmt: skip


def test_packed_softmax_dx_only_and_dtheta_only(device):
    """The backward's two kernels for softmax over packed sequences, each on its own."""
    cu = packing([20, 0, 31], device)
    x = make((1, 51, 2, 8), torch.float32, device)
    check(x, theta_for("full", 2, 8, device), 0, "softmax", 1, theta_grad=False, cu=cu)
    check(x, theta_for("full", 2, 8, device), 0, "softmax", 1, x_grad=False, cu=cu)


def test_packed_opcheck(device):
    x = make((1, 23, 2, 8), torch.float32, device).requires_grad_()
    theta = make_theta(2, 8, device).requires_grad_()
    cu = packing([9, 0, 14], device)  # positions from cu_seqlens on the device: no table
    torch.library.opcheck(fwd_seq.op, (x, theta, 0, None, None, cu))
    y, stats = fwd_seq(x.detach(), theta.detach(), 0, None, None, cu)
    dy = make(y.shape, y.dtype, device, seed=3)
    args = (dy, x.detach(), theta.detach(), 0, None, None, cu, stats, "softmax_seq", True, True)
    torch.library.opcheck(bwd.op, args)


# ---------------------------------------------------------------------------------------------
# Offsets
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("offset", [0, 7, 100_000, "tensor"])
@pytest.mark.parametrize("case", [("silu", None), ("softmax", 1)], ids=case_id)
def test_offsets(case, offset, dtype, device):
    a, dim = case
    if offset == "tensor":
        offset = torch.tensor([5, 100_000, 0], device=device)
    x = make((3, 33, 3, 40), dtype, device)
    check(x, make_theta(3, 40, device), offset, a, dim)


def test_offset_tensor_int32_and_equivalence(device):
    """A per-batch offset tensor gives, row by row, the int-offset result."""
    x = make((3, 20, 2, 16), torch.float32, device)
    theta = make_theta(2, 16, device)
    offs = [0, 7, 123_456]
    y = lrpe_cosine(x, theta, torch.tensor(offs, dtype=torch.int32, device=device), "relu")
    for b, off in enumerate(offs):
        assert torch.equal(y[b : b + 1], lrpe_cosine(x[b : b + 1], theta, off, "relu"))


@pytest.mark.parametrize("offset", [100_000, 2**24 + 3, 3_000_000_000])
def test_large_offsets_are_exact_float32_angles(offset, device):
    """Angles are float32(theta) * float32(integer position), as the reference: the kernel and
    the float64 oracle agree to float32 precision even where the positions are huge."""
    x = make((2, 17, 2, 16), torch.float32, device)
    theta = make_theta(2, 16, device)
    y = check(x, theta, offset, "none", theta_grad=False)
    pos = torch.arange(17, dtype=torch.int64) + offset
    ang = theta.float().cpu()[None] * pos.float()[:, None, None]  # (N, H, D)
    assert_close(y[0, :, :, 16:], (x[0].double().cpu() * torch.sin(ang.double())), name="sin part")


# ---------------------------------------------------------------------------------------------
# Sizes and layouts
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("case", ACT_CASES, ids=case_id)
@pytest.mark.parametrize(("n", "d"), [(1, 80), (33, 33)])
def test_odd_sizes(n, d, case, device):
    a, dim = case
    check(make((2, n, 2, d), torch.bfloat16, device), make_theta(2, d, device), 7, a, dim)


@pytest.mark.parametrize("case", [("none", None), ("softmax", -1), ("softmax", 1)], ids=case_id)
def test_batch_rows_grouped(case, device):
    """A program loops over several ROWS-row tiles of batch rows (shared cos/sin), the last one
    partly masked."""
    a, dim = case
    b, n, h, d = 6, 33, 4, 80
    block_n, _ = tile_sizes(d, PLAN.tile)
    rows, groups = batch_groups(PLAN, b, triton_cdiv(n, block_n) * h, torch.device(device))
    if interpreting():
        assert (rows, groups) == (8, 1) and ROWS == 4
    check(make((b, n, h, d), torch.float16, device), make_theta(h, d, device), 5, a, dim)


def test_softmax_sequence_chunks(device):
    """Softmax over a sequence split into several chunks of several token blocks."""
    b, n, h, d = 2, 200, 8, 24
    block_n, _ = tile_sizes(d, PLAN.small_tile)
    chunk, num_chunks = sequence_chunks(PLAN, h, n, block_n, torch.device(device))
    if interpreting():
        assert num_chunks > 1 and chunk > block_n
    x = make((b, n, h, d), torch.bfloat16, device)
    check(x, make_theta(h, d, device), 90_000, "softmax", 1)


def triton_cdiv(a, b):
    return -(-a // b)


LAYOUTS = {
    # q slice of a fused qkv tensor (B, N, 3H, D)
    "qkv_slice": lambda make_: make_((2, 19, 3 * 3, 24))[:, :, :3],
    # (B, H, N, D) memory seen as (B, N, H, D): (H, D) do not collapse
    "transposed": lambda make_: make_((2, 3, 19, 24)).transpose(1, 2),
    # every other feature of a wider tensor
    "stepped": lambda make_: make_((2, 19, 3, 48))[..., ::2],
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("case", [("silu", None), ("softmax", -1), ("softmax", 1)], ids=case_id)
def test_strided_inputs(layout, case, device):
    a, dim = case
    x = LAYOUTS[layout](lambda shape: make(shape, torch.bfloat16, device))
    assert x.shape == (2, 19, 3, 24) and not x.is_contiguous()
    check(x, make_theta(3, 24, device), 4, a, dim)


def test_theta_strided_and_shared_rows(device):
    """theta (1, E) shared by all heads, read through a non-contiguous view."""
    theta = make_theta(8, 2, device).t()[:1]  # (1, 8) with column stride 2
    assert not theta.is_contiguous()
    check(make((2, 21, 3, 8), torch.float32, device), theta, 2, "sigmoid")


def test_expanded_grad_output(device):
    """y.sum().backward() hands the backward a stride-0 gradient."""
    x = make((2, 17, 2, 16), torch.float16, device).requires_grad_()
    theta = make_theta(2, 16, device).requires_grad_()
    lrpe_cosine(x, theta, 3, "silu").float().sum().backward()
    x64 = x.detach().double().requires_grad_()
    t64 = theta.detach().double().requires_grad_()
    lrpe_cosine_reference(x64, t64, 3, "silu").sum().backward()
    assert_close(x.grad, x64.grad, name="dx of sum")
    assert_close(theta.grad, t64.grad, name="dtheta of sum")


@pytest.mark.parametrize("case", [("none", None), ("softmax", -1), ("softmax", 1)], ids=case_id)
def test_three_dim_input(case, device):
    a, dim = case
    x = make((2, 25, 24), torch.bfloat16, device)
    y = check(x, make_theta(1, 24, device), 6, a, dim)
    assert y.shape == (2, 25, 48)


def test_three_dim_softmax_dim_aliases(device):
    x = make((2, 9, 8), torch.float32, device)
    theta = make_theta(1, 8, device)
    assert torch.equal(
        lrpe_cosine(x, theta, 0, "softmax", 2), lrpe_cosine(x, theta, 0, "softmax", -1)
    )
    assert torch.equal(
        lrpe_cosine(x, theta, 0, "softmax", -2), lrpe_cosine(x, theta, 0, "softmax", 1)
    )


def test_gradient_to_one_input_only(device):
    x = make((2, 17, 2, 16), torch.float32, device)
    theta = make_theta(2, 16, device)
    check(x, theta, 1, "softmax", 1, x_grad=False, theta_grad=True)
    check(x, theta, 1, "silu", x_grad=True, theta_grad=False)
    check(x, theta, 1, "none", x_grad=True, theta_grad=False)


def test_low_precision_theta_is_upcast(device):
    x = make((2, 11, 2, 8), torch.float32, device)
    theta = make_theta(2, 8, device, dtype=torch.bfloat16).requires_grad_()
    y = lrpe_cosine(x, theta, 5)
    ref = lrpe_cosine_reference(x.double(), theta.detach().float().double(), 5)
    assert_close(y, ref, name="bf16 theta")
    y.sum().backward()
    assert theta.grad.dtype == torch.bfloat16


def test_empty_sequence(device):
    x = torch.empty((2, 0, 3, 8), device=device, requires_grad=True)
    theta = make_theta(3, 8, device).requires_grad_()
    y = lrpe_cosine(x, theta, 0, "softmax", 1)
    assert y.shape == (2, 0, 3, 16)
    y.sum().backward()
    assert x.grad.shape == x.shape
    assert torch.equal(theta.grad, torch.zeros_like(theta))


def test_softmax_sequence_with_infinite_values(device):
    x = make((2, 40, 2, 8), torch.float32, device, scale=100.0)
    x[0, :30, 1, 3] = -float("inf")  # masked positions: probability 0
    y = lrpe_cosine(x, make_theta(2, 8, device), 0, "softmax", 1)
    ref = lrpe_cosine_reference(x.double(), make_theta(2, 8, device).double(), 0, "softmax", 1)
    assert torch.equal(y[0, :30, 1, 3], torch.zeros(30, device=device))
    assert_close(y, ref, name="softmax over the sequence with -inf")


@pytest.mark.parametrize(
    ("case", "theta_grad"),
    [
        (("none", None), False),
        (("none", None), True),
        (("sigmoid", None), True),
        (("softmax", 1), True),
    ],
    ids=["none-dx-only", "none", "sigmoid", "softmax1"],
)
def test_reference_fallback_path(case, theta_grad, monkeypatch):
    """CPU tensors without the interpreter run the PyTorch reference inside the same ops."""
    import kernelkit.lrpe_cosine.op as op

    monkeypatch.setattr(op, "use_triton", lambda t: False)
    a, dim = case
    x = make((2, 9, 2, 8), torch.float32, "cpu")
    check(x, make_theta(2, 8, "cpu"), torch.tensor([1, 50]), a, dim, theta_grad=theta_grad)


# ---------------------------------------------------------------------------------------------
# Errors
# ---------------------------------------------------------------------------------------------


def _args(device, **over):
    args = {
        "x": torch.ones(2, 5, 3, 8, device=device),
        "theta": torch.ones(3, 8, device=device),
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
        ({"x": torch.ones(2, 5, 3, 8, dtype=torch.int32)}, "x: dtype"),
        ({"x": torch.ones(2, 5, 3, 8, dtype=torch.float64)}, "x: dtype"),
        ({"x": torch.ones(5, 8)}, "x: expected shape"),
        ({"theta": 1.0}, "theta: expected a torch.Tensor"),
        ({"theta": torch.ones(3, 8, dtype=torch.int64)}, "theta: must be a floating-point"),
        ({"theta": torch.ones(8)}, "theta: expected shape"),
        ({"theta": torch.ones(2, 8)}, "theta: has 2 rows"),
        ({"theta": torch.ones(3, 9)}, "theta: E = 9"),
        ({"theta": torch.ones(3, 0)}, "theta: E = 0"),
        ({"offset": 1.5}, "offset: expected an int"),
        ({"offset": True}, "offset: expected an int"),
        ({"offset": torch.ones(2)}, "offset: a tensor offset must have an integer dtype"),
        ({"offset": torch.ones(3, dtype=torch.int64)}, "offset: a tensor offset must have shape"),
        ({"act": "gelu"}, "act: must be one of"),
        ({"act": "relu", "dim": -1}, "dim: only softmax"),
        ({"act": "softmax"}, "dim: softmax needs"),
        ({"act": "softmax", "dim": 2}, "dim: softmax runs over D"),
        ({"act": "softmax", "dim": 0}, "dim: softmax runs over D"),
        ({"act": "softmax", "dim": 4}, "dim: 4 is out of range"),
        ({"act": "softmax", "dim": 1.0}, "dim: expected an int"),
    ],
)
def test_errors(over, match, device):
    args = _args(device, **over)
    for k in ("x", "theta", "offset"):
        if isinstance(args[k], torch.Tensor):
            args[k] = args[k].to(device)
    with pytest.raises(ValueError, match=match):
        lrpe_cosine(**args)


def test_three_dim_input_needs_one_theta_row(device):
    with pytest.raises(
        ValueError, match=r"theta: has 2 rows, but x \(2, \d+, 8\) is read as \(B, N, D\)"
    ):
        lrpe_cosine(torch.ones(2, 5, 8, device=device), torch.ones(2, 8, device=device))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a second device type")
def test_device_mismatch_errors():
    x = torch.ones(2, 5, 3, 8, device="cuda")
    with pytest.raises(ValueError, match="theta: is on cpu"):
        lrpe_cosine(x, torch.ones(3, 8))
    with pytest.raises(ValueError, match="offset: is on cpu"):
        lrpe_cosine(x, torch.ones(3, 8, device="cuda"), torch.zeros(2, dtype=torch.int64))


# ---------------------------------------------------------------------------------------------
# torch.library and torch.compile
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("act", "where"),
    [("none", "int"), ("silu", "starts"), ("softmax", "int"), ("softmax_seq", "table")],
)
def test_opcheck(act, where, device):
    x = make((2, 19, 2, 8), torch.float32, device).requires_grad_()
    theta = make_theta(2, 8, device).requires_grad_()
    starts = torch.tensor([3, 40], device=device) if where == "starts" else None
    g = torch.Generator().manual_seed(7)  # a fixed table: the test must be reproducible
    table = torch.randint(0, 999, (1, 19), generator=g).to(device) if where == "table" else None
    start = 5 if where == "int" else 0
    if act == "softmax_seq":  # its own op: y and the stats the backward reuses
        torch.library.opcheck(fwd_seq.op, (x, theta, start, starts, table, None))
        y, stats = fwd_seq(x.detach(), theta.detach(), start, starts, table, None)
    else:
        torch.library.opcheck(fwd.op, (x, theta, start, starts, table, None, act))
        y, stats = fwd(x.detach(), theta.detach(), start, starts, table, None, act), None
    dy = make(y.shape, y.dtype, device, seed=3)
    args = (dy, x.detach(), theta.detach(), start, starts, table, None, stats, act, True, True)
    torch.library.opcheck(bwd.op, args)


@pytest.mark.parametrize("case", [("silu", None), ("softmax", 1), ("softmax", -1)], ids=case_id)
def test_torch_compile_fullgraph(case, device):
    a, dim = case
    backend = "inductor" if device.type == "cuda" else "aot_eager"
    f = torch.compile(
        lambda t, th: lrpe_cosine(t, th, 4, a, dim) * 2.0, fullgraph=True, backend=backend
    )
    x = make((2, 33, 3, 16), torch.float32, device).requires_grad_()
    theta = make_theta(3, 16, device).requires_grad_()
    dy = make((2, 33, 3, 32), torch.float32, device, seed=5)
    y = f(x, theta)
    y.backward(dy)
    x64 = x.detach().double().requires_grad_()
    t64 = theta.detach().double().requires_grad_()
    y64 = lrpe_cosine_reference(x64, t64, 4, a, dim) * 2.0
    y64.backward(dy.double())
    assert_close(y, y64, name="compiled forward")
    assert_close(x.grad, x64.grad, name="compiled dx")
    assert_close(theta.grad, t64.grad, name="compiled dtheta")


# ---------------------------------------------------------------------------------------------
# GPU only: benchmark-like shapes and recompilation
# ---------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("case", ACT_CASES, ids=case_id)
@pytest.mark.parametrize("n", [1000, 4096])
def test_large_shapes(n, case, device):
    a, dim = case
    x = make((4, n, 12, 128), torch.bfloat16, device)
    check(x, make_theta(12, 128, device), 17, a, dim)


@pytest.mark.gpu
def test_large_batch_and_heads(device):
    x = make((40, 100, 20, 64), torch.bfloat16, device)
    offs = torch.randint(0, 200_000, (40,), device=device)
    check(x, make_theta(20, 64, device), offs, "softmax", 1)


@pytest.mark.gpu
@pytest.mark.parametrize("case", [("silu", None), ("softmax", 1)], ids=case_id)
def test_no_recompile_on_new_n_b_offset(case, device):
    """New N, B or offset values reuse the compiled kernels (one set for B > 1, one for B = 1:
    a single row loads no row axis, kernels.load_rows)."""
    a, dim = case
    theta = make_theta(4, 64, device)
    # (N = 4097 splits the softmax's sequence into chunks: its merge kernel compiles once here)
    for b, n in ((2, 100), (1, 100), (2, 4097)):
        x = make((b, n, 4, 64), torch.bfloat16, device).requires_grad_()
        lrpe_cosine(x, theta, 0, a, dim).sum().backward()
    with compilations() as compiled:
        for b, n, off in [(3, 37, 1), (5, 1000, 16), (1, 4097, 123_457), (7, 1, 99), (1, 3, 5)]:
            x = make((b, n, 4, 64), torch.bfloat16, device).requires_grad_()
            lrpe_cosine(x, theta, off, a, dim).sum().backward()
    assert not compiled, dict(compiled)


@pytest.mark.gpu
@pytest.mark.parametrize(
    ("case", "layout", "theta_grad"),
    [(("silu", None), "batched", True), (("softmax", 1), "batched", True),
     (("softmax", 1), "long", True), (("softmax", -1), "batched", True),
     (("softmax", 1), "packed", True), (("softmax", 1), "batched", False),
     (("none", None), "batched", False)],
    ids=str,
)  # fmt: skip
def test_cuda_graph_replay(case, layout, theta_grad, device):
    """Forward and backward (x, and theta where learnable) captured into a CUDA graph replay new
    inputs bit-exactly: no host sync, allocation outside the pool or compile in the path (the
    host path replays its recorded launch sequence, merges of chunk statistics included:
    softmax over N reads N = 300 in one pass, N = 700 in chunks it merges)."""
    from kernelkit.shared.testing import assert_graph_replays

    a, dim = case
    packed = layout == "packed"
    b, n, h, d = {"batched": (3, 300, 4, 64), "long": (2, 700, 4, 64)}.get(layout, (1, 900, 4, 64))
    offset, cu = (0, packing([300, 1, 0, 599], device)) if packed else (11, None)

    def fwd_bwd(x, theta, dy):
        y = lrpe_cosine(x, theta, offset, a, dim, cu_seqlens=cu)
        return (y, *torch.autograd.grad(y, (x, theta) if theta_grad else (x,), dy))

    def data(seed):
        x = make((b, n, h, d), torch.bfloat16, device, seed=seed).requires_grad_()
        theta = make_theta(h, d, device, seed=seed + 1).requires_grad_(theta_grad)
        return [x, theta, make((b, n, h, 2 * d), torch.bfloat16, device, seed=seed + 2)]

    assert_graph_replays(fwd_bwd, data(0), [data(10), data(20)])


def test_repeated_calls_take_the_shortcut(device):
    """A call like an earlier one that passed the checks replays its recorded sequence
    (`op._CALLS`): bitwise the checked call (`lrpe_shortcut_pairs`: every kind, a decode
    shape, other offsets and values; calls of other layouts after a kept shortcut)."""
    from kernelkit.lrpe_cosine import op
    from kernelkit.shared.testing import assert_shortcuts_replay, lrpe_shortcut_pairs

    assert_shortcuts_replay(lrpe_cosine, lrpe_shortcut_pairs(32, device), op._CALLS)


def test_repeated_calls_with_gradients_take_the_shortcut(device):
    """With x, theta or both requiring grad, a call like an earlier checked one replays its
    sequence through the op's autograd node (`lrpe_core.op.register_lrpe_autograd`'s
    `LrpeReplayedForward`): output and gradients bitwise the checked call's. Pairs of another
    layout (an offset of another width, theta float64, x of other strides) stay checked."""
    from kernelkit.lrpe_cosine import op
    from kernelkit.shared.testing import assert_lrpe_shortcut_gradients

    assert_lrpe_shortcut_gradients(lrpe_cosine, op._CALLS, 32, device)
