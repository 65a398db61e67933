"""act: every activation x dtype x layout against a float64 reference, gradients included.

Runs the real Triton kernels: on the GPU when there is one, otherwise under the Triton
interpreter (the kernelkit pytest plugin switches it on before the kernels are imported).
"""

import pytest
import torch

from kernelkit.act import MAX_PACKED_SEQUENCES, act
from kernelkit.act.launchers import COLS_MAX_L
from kernelkit.act.reference import act_grad_reference, act_reference
from kernelkit.shared.testing import assert_close

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
ELEMENTWISE = ["relu", "sigmoid", "silu"]


def make(shape, dtype, device, scale=3.0, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g, dtype=torch.float64) * scale).to(dtype).to(device)


def check(x, a, dim=None, dy=None, cu_seqlens=None):
    """Forward and backward of act(x) vs float64 and vs PyTorch in x.dtype."""
    x = x.detach().requires_grad_()
    y = act(x, a, dim, cu_seqlens=cu_seqlens)
    x64 = x.detach().double().requires_grad_()
    y64 = act_reference(x64, a, dim, cu_seqlens)
    xl = x.detach().clone().requires_grad_()
    yl = act_reference(xl, a, dim, cu_seqlens)
    assert y.dtype == x.dtype and y.shape == x.shape
    assert_close(y, y64, ref_lowp=yl, name=f"{a} forward")
    if dy is None:
        dy = make(x.shape, x.dtype, x.device, scale=1.0, seed=1)
    y.backward(dy)
    y64.backward(dy.double())
    yl.backward(dy)
    assert_close(x.grad, x64.grad, ref_lowp=xl.grad, name=f"{a} backward")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("a", ELEMENTWISE)
@pytest.mark.parametrize("shape", [(1,), (1000,), (3, 33, 80), (2, 5, 7, 9, 3)])
def test_elementwise(a, dtype, shape, device):
    check(make(shape, dtype, device), a)


@pytest.mark.parametrize("a", ELEMENTWISE)
@pytest.mark.parametrize(
    "view",
    [
        lambda t: t.transpose(1, 2),  # dense, permuted: walked flat in storage order
        lambda t: t[:, 1:, ::2],  # strided: read in place
        lambda t: t.permute(2, 0, 1)[::3],
    ],
    ids=["transposed", "sliced", "permuted-stepped"],
)
def test_elementwise_strided(a, view, device):
    base = make((4, 17, 30), torch.bfloat16, device)
    check(view(base), a)


@pytest.mark.parametrize("a", ELEMENTWISE)
def test_elementwise_six_dims_not_collapsible(a, device):
    x = make((2, 3, 2, 3, 2, 6), torch.float32, device)[:, :, :, :, :, ::2]
    x = x.transpose(0, 3)
    check(x, a)


@pytest.mark.parametrize("a", ELEMENTWISE)
def test_expanded_grad_output(a, device):
    """y.sum().backward() hands the backward a stride-0 gradient."""
    x = make((5, 37), torch.float16, device).requires_grad_()
    act(x, a).sum().backward()
    x64 = x.detach().double().requires_grad_()
    act_reference(x64, a).sum().backward()
    assert_close(x.grad, x64.grad, name=f"{a} grad of sum")


def test_relu_gradient_at_zero_is_zero(device):
    x = torch.tensor([-1.0, 0.0, 0.0, 2.0], device=device, requires_grad=True)
    act(x, "relu").backward(torch.ones(4, device=device))
    assert x.grad.tolist() == [0.0, 0.0, 0.0, 1.0]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("dim", [-1, -2, 0, 1])
def test_softmax_dims(dtype, dim, device):
    check(make((2, 3, 37, 80), dtype, device), "softmax", dim)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_softmax_sequence_axis_multi_chunk(dtype, device):
    """(B, N, H, D) with dim=1, N past the single-pass columns kernel (COLS_MAX_L): the split
    kernels, many chunks per column combined."""
    assert COLS_MAX_L < 1100
    check(make((2, 1100, 3, 8), dtype, device), "softmax", 1)


@pytest.mark.parametrize("n", [1, 2, 300, 1024])
def test_softmax_sequence_axis_single_pass(n, device):
    """(B, N, H, D) with dim=1 and N up to COLS_MAX_L: whole columns in one program (one pass),
    the axis length 1 (decode) and a power of two at the limit included."""
    assert n <= COLS_MAX_L
    check(make((2, n, 3, 5), torch.bfloat16, device), "softmax", 1)


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(3, 20000, 2, 64), (1, 70000, 3, 5), (2, 4096, 300)])
def test_softmax_long_sequence_gpu(shape, device):
    """Long axes at GPU scale: many chunks per column merged."""
    check(make(shape, torch.bfloat16, device), "softmax", 1)


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(8, 1024, 32, 128), (8, 1, 32, 128), (1, 256, 32, 128)])
def test_softmax_short_sequence_gpu(shape, device):
    """Model shapes of a softmax over N up to COLS_MAX_L: the single-pass columns kernels."""
    check(make(shape, torch.bfloat16, device), "softmax", 1)


def test_softmax_long_row(device):
    """A last-dim row longer than one program holds (split-L with one column per program)."""
    check(make((2, 9000), torch.float32, device), "softmax", -1)


@pytest.mark.parametrize("dim", [-1, 1])
def test_softmax_strided(dim, device):
    qkv = make((2, 19, 3 * 4, 24), torch.bfloat16, device)
    q = qkv[:, :, :4]  # a q slice of a fused qkv tensor
    check(q, "softmax", dim)
    check(qkv.transpose(1, 2), "softmax", dim)


def test_softmax_collapse_fallback_layout(device):
    x = make((3, 4, 5, 6, 7), torch.float32, device).permute(0, 2, 4, 1, 3)[:, ::2, :, :, ::3]
    check(x, "softmax", 2)


def test_softmax_large_and_infinite_values(device):
    x = make((4, 3000, 2), torch.float32, device, scale=200.0)
    x[0, :, 0] = -float("inf")  # a whole row of -inf: NaN, as torch
    x[1, :2000, 1] = -float("inf")  # whole chunks of -inf before finite values
    y = act(x, "softmax", 1)
    ref = torch.softmax(x.double().cpu(), 1)
    assert torch.isnan(y[0, :, 0]).all() and torch.isnan(ref[0, :, 0]).all()
    assert_close(y[1:], ref[1:], name="softmax with -inf")
    assert_close(y[0, :, 1], ref[0, :, 1], name="softmax beside an -inf row")


def test_none_is_an_alias(device):
    x = make((3, 4), torch.float32, device)
    assert act(x, "none") is x


def test_empty_and_scalar(device):
    e = torch.empty((0, 5), device=device)
    assert act(e, "silu").shape == (0, 5)
    s = torch.tensor(0.5, device=device)
    assert_close(act(s, "sigmoid"), torch.sigmoid(s.double()))


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"act": "gelu"}, "act"),
        ({"act": "relu", "dim": -1}, "dim"),
        ({"act": "softmax"}, "dim"),
        ({"act": "softmax", "dim": 3}, "dim"),
        ({"act": "softmax", "dim": 1.0}, "dim"),
    ],
)
def test_errors(kwargs, match, device):
    with pytest.raises(ValueError, match=match):
        act(torch.ones(2, 3, device=device), **kwargs)


def test_error_messages_name_x(device):
    with pytest.raises(ValueError, match="x: dtype"):
        act(torch.ones(3, dtype=torch.int32, device=device), "relu")
    with pytest.raises(ValueError, match="x: expected a torch.Tensor"):
        act([1.0, 2.0], "relu")
    with pytest.raises(ValueError, match="dim: softmax over dimension 1 of size 0"):
        act(torch.ones(2, 0, device=device), "softmax", 1)


@pytest.mark.parametrize("name", ["act_fwd", "softmax_fwd"])
def test_opcheck(name, device):
    x = make((3, 37, 20), torch.float32, device).requires_grad_()
    op = getattr(torch.ops.kernelkit_act, name)
    args = (x, "silu") if name == "act_fwd" else (x, 1)
    torch.library.opcheck(op, args)
    y = op(*args).detach()
    dy = make(x.shape, x.dtype, device, seed=3)
    bwd_args = (x.detach(), dy, "silu") if name == "act_fwd" else (y, dy, 1)
    torch.library.opcheck(getattr(torch.ops.kernelkit_act, name.replace("fwd", "bwd")), bwd_args)


@pytest.mark.parametrize(("a", "dim"), [("silu", None), ("softmax", 1), ("softmax", -1)])
def test_torch_compile_fullgraph(a, dim, device):
    backend = "inductor" if device.type == "cuda" else "aot_eager"
    f = torch.compile(lambda t: act(t, a, dim) * 2.0, fullgraph=True, backend=backend)
    x = make((2, 33, 3, 16), torch.float32, device).requires_grad_()
    dy = make(x.shape, x.dtype, device, seed=5)
    y = f(x)
    y.backward(dy)
    x64 = x.detach().double().requires_grad_()
    y64 = act_reference(x64, a, dim) * 2.0
    y64.backward(dy.double())
    assert_close(y, y64, name="compiled forward")
    assert_close(x.grad, x64.grad, name="compiled backward")


# ---------------------------------------------------------------------------------------------
# Packed sequences: softmax over each sequence of a packed axis (cu_seqlens)
# ---------------------------------------------------------------------------------------------


def packing(lengths, device):
    """int32 prefix sums of `lengths` on `device`."""
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32).to(
        device
    )


PACKINGS = {
    "ragged": [37, 1, 0, 200, 5, 0],  # length 1, empty sequences (first, middle, last)
    "one": [243],  # one sequence: the plain softmax over the axis
    "many-short": [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7, 9, 3, 2, 3, 8, 4, 6, 2, 6, 4, 3],
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("lengths", PACKINGS.values(), ids=PACKINGS.keys())
def test_packed_softmax_sequence_axis(lengths, dtype, device):
    """(1, total, H, D) over dim=1, as packed tokens: every sequence normalised on its own."""
    total = sum(lengths)
    check(make((1, total, 3, 40), dtype, device), "softmax", 1, cu_seqlens=packing(lengths, device))


@pytest.mark.parametrize(
    ("shape", "dim", "lengths"),
    [
        ((4, 300), -1, [100, 1, 199]),  # packed along the last dim (the split path, not rows)
        ((2, 3, 301), 2, [150, 0, 151]),
        ((120, 2, 5), 0, [60, 0, 1, 59]),  # the first dim: no outer dims
        ((2, 77, 3), 1, [7, 70]),  # B > 1: every row packed the same way
    ],
)
def test_packed_softmax_dims(shape, dim, lengths, device):
    check(make(shape, torch.float32, device), "softmax", dim, cu_seqlens=packing(lengths, device))


@pytest.mark.gpu
@pytest.mark.parametrize("dim", [1, -1])
def test_packed_softmax_gpu_scale(dim, device):
    """Documents of 1 to 16k tokens packed along N (and along the last dim), bf16."""
    lengths = [16384, 1, 0, 3000, 7, 9000, 2048]
    shape = (1, sum(lengths), 4, 64) if dim == 1 else (3, 2, sum(lengths))
    check(make(shape, torch.bfloat16, device), "softmax", dim, cu_seqlens=packing(lengths, device))


def test_packed_softmax_strided(device):
    """A q slice of a fused qkv tensor, and a transposed view: read in place, packed along N."""
    qkv = make((1, 90, 3 * 4, 24), torch.bfloat16, device)
    cu = packing([40, 11, 39], device)
    check(qkv[:, :, :4], "softmax", 1, cu_seqlens=cu)
    check(qkv.transpose(1, 2), "softmax", 2, cu_seqlens=cu)


def test_packed_softmax_sequences_are_independent(device):
    """Changing one sequence leaves every other sequence's output bit-identical."""
    cu = packing([50, 30, 70], device)
    x = make((1, 150, 2, 8), torch.float32, device)
    y = act(x, "softmax", 1, cu_seqlens=cu)
    x2 = x.clone()
    x2[:, 50:80] *= 100.0
    y2 = act(x2, "softmax", 1, cu_seqlens=cu)
    assert torch.equal(y[:, :50], y2[:, :50]) and torch.equal(y[:, 80:], y2[:, 80:])
    assert not torch.equal(y[:, 50:80], y2[:, 50:80])


def test_packed_softmax_infinite_sequence(device):
    """A sequence of -inf is NaN (as torch's softmax of it); its neighbours are unaffected."""
    cu = packing([40, 25, 35], device)
    x = make((1, 100, 2), torch.float32, device, scale=50.0)
    x[0, 40:65, 0] = -float("inf")
    y = act(x, "softmax", 1, cu_seqlens=cu)
    ref = act_reference(x.double(), "softmax", 1, cu)
    assert torch.isnan(y[0, 40:65, 0]).all() and torch.isnan(ref[0, 40:65, 0]).all()
    assert_close(y[0, :40], ref[0, :40], name="before the -inf sequence")
    assert_close(y[0, 65:], ref[0, 65:], name="after the -inf sequence")
    assert_close(y[0, 40:65, 1], ref[0, 40:65, 1], name="beside the -inf sequence")


@pytest.mark.parametrize(
    ("cu", "kwargs", "match"),
    [
        ([0, 3, 6], {"act": "relu"}, "cu_seqlens: only softmax takes packed sequences"),
        ([0, 3, 5], {}, "cu_seqlens: last entry 5 must equal the number of entries along dim 1 6"),
        ([1, 3, 6], {}, "cu_seqlens: must start at 0"),
        ([0, 4, 3, 6], {}, "cu_seqlens: must be non-decreasing, entry 2 is 3 < 4"),
        ([6], {}, r"cu_seqlens: expected shape \(num_seqs \+ 1,\)"),
    ],
)
def test_packed_errors(cu, kwargs, match, device):
    x = torch.ones(2, 6, device=device)
    kwargs = {"act": "softmax", "dim": 1, **kwargs}
    if kwargs["act"] != "softmax":
        kwargs.pop("dim")
    cu_t = torch.tensor(cu, dtype=torch.int32)  # values are checked on the CPU only
    with pytest.raises(ValueError, match=match):
        act(x.cpu(), cu_seqlens=cu_t, **kwargs)


def test_packed_errors_dtype_and_device(device):
    x = torch.ones(2, 6, device=device)
    strided = torch.tensor([0, 9, 3, 9, 6, 9], dtype=torch.int32, device=device)[::2]
    with pytest.raises(ValueError, match="cu_seqlens: must be contiguous, got stride 2"):
        act(x, "softmax", 1, cu_seqlens=strided)
    too_many = torch.tensor([0] * (MAX_PACKED_SEQUENCES + 1) + [6], dtype=torch.int32)
    with pytest.raises(ValueError, match=f"cu_seqlens: at most {MAX_PACKED_SEQUENCES} packed"):
        act(x.cpu(), "softmax", 1, cu_seqlens=too_many)
    with pytest.raises(ValueError, match="cu_seqlens: dtype must be torch.int32"):
        act(x, "softmax", 1, cu_seqlens=torch.tensor([0, 6], device=device))
    with pytest.raises(ValueError, match="cu_seqlens: expected a torch.Tensor"):
        act(x, "softmax", 1, cu_seqlens=[0, 6])
    if device.type == "cuda":
        with pytest.raises(ValueError, match="cu_seqlens: on device cpu"):
            act(x, "softmax", 1, cu_seqlens=torch.tensor([0, 6], dtype=torch.int32))


def test_packed_opcheck(device):
    x = make((1, 57, 3, 20), torch.float32, device).requires_grad_()
    cu = packing([20, 0, 36, 1], device)
    torch.library.opcheck(torch.ops.kernelkit_act.softmax_fwd, (x, 1, cu))
    y = torch.ops.kernelkit_act.softmax_fwd(x, 1, cu).detach()
    dy = make(x.shape, x.dtype, device, seed=3)
    torch.library.opcheck(torch.ops.kernelkit_act.softmax_bwd, (y, dy, 1, cu))


def test_packed_torch_compile_fullgraph(device):
    backend = "inductor" if device.type == "cuda" else "aot_eager"
    f = torch.compile(
        lambda t, cu: act(t, "softmax", 1, cu_seqlens=cu) * 2.0, fullgraph=True, backend=backend
    )
    cu = packing([10, 23, 0, 4], device)
    x = make((1, 37, 3, 16), torch.float32, device).requires_grad_()
    dy = make(x.shape, x.dtype, device, seed=5)
    f(x, cu).backward(dy)
    x64 = x.detach().double().requires_grad_()
    (act_reference(x64, "softmax", 1, cu) * 2.0).backward(dy.double())
    assert_close(x.grad, x64.grad, name="compiled packed backward")


# ---------------------------------------------------------------------------------------------
# CUDA graphs: every op, forward and backward, captures and replays with new input data.
# ---------------------------------------------------------------------------------------------

GRAPH_CASES = [
    ("silu", None, (2, 300, 3, 40)),  # element-wise
    ("softmax", -1, (2, 300, 3, 40)),  # last dim: single-pass rows
    ("softmax", -1, (3, 20000)),  # a last dim longer than one program holds: split
    ("softmax", 1, (2, 4096, 4, 64)),  # over the sequence: split, chunk stats + apply
    ("softmax", 1, (1, 8192, 4, 64)),  # over packed sequences (GRAPH_PACKING)
]
GRAPH_PACKING = [3000, 1, 0, 4000, 1191]


@pytest.mark.gpu
@pytest.mark.parametrize("direction", ["fwd", "bwd"])
@pytest.mark.parametrize(("a", "dim", "shape"), GRAPH_CASES, ids=lambda v: str(v))
def test_cuda_graph_replay(a, dim, shape, direction, device):
    from kernelkit.shared.testing import assert_graph_replays

    cu = packing(GRAPH_PACKING, device) if shape[:2] == (1, 8192) else None

    def data(seed, grad=False):
        return make(shape, torch.bfloat16, device, seed=seed).requires_grad_(grad)

    if direction == "fwd":
        assert_graph_replays(
            lambda x: act(x, a, dim, cu_seqlens=cu), [data(0)], [[data(1)], [data(2)]]
        )
        return

    def fwd_bwd(x, dy):
        return torch.autograd.grad(act(x, a, dim, cu_seqlens=cu), x, dy)

    inputs = [data(0, True), data(10)]
    assert_graph_replays(fwd_bwd, inputs, [[data(1, True), data(11)], [data(2, True), data(12)]])


@pytest.mark.parametrize("name", ["none", "relu", "sigmoid", "silu"])
def test_grad_reference_closed_form(name):
    """act_grad_reference (the closed-form backward, no autograd) against autograd through
    act_reference in float64, and its float32 result for bfloat16 inputs."""
    x = torch.randn(5, 37, dtype=torch.float64) * 3
    x[0, :3] = 0.0  # relu's kink: gradient 0 there, as torch's
    dy = torch.randn_like(x)
    xr = x.clone().requires_grad_()
    (expected,) = torch.autograd.grad(act_reference(xr, name), xr, dy)
    torch.testing.assert_close(act_grad_reference(x, dy, name), expected, rtol=1e-12, atol=1e-14)
    got = act_grad_reference(x.bfloat16(), dy.bfloat16(), name)
    assert got.dtype == torch.bfloat16
    assert_close(got, act_grad_reference(x.bfloat16().double(), dy.bfloat16().double(), name))
