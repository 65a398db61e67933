"""act: every activation x dtype x layout against a float64 reference, gradients included.

Runs the real Triton kernels: on the GPU when there is one, otherwise under the Triton
interpreter (the kernelkit pytest plugin switches it on before the kernels are imported).
"""

import pytest
import torch

from kernelkit.act import act
from kernelkit.act.reference import act_reference
from kernelkit.shared.testing import assert_close

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
ELEMENTWISE = ["relu", "sigmoid", "silu"]


def make(shape, dtype, device, scale=3.0, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g, dtype=torch.float64) * scale).to(dtype).to(device)


def check(x, a, dim=None, dy=None):
    """Forward and backward of act(x) vs float64 and vs PyTorch in x.dtype."""
    x = x.detach().requires_grad_()
    y = act(x, a, dim)
    x64 = x.detach().double().requires_grad_()
    y64 = act_reference(x64, a, dim)
    xl = x.detach().clone().requires_grad_()
    yl = act_reference(xl, a, dim)
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
    """(B, N, H, D) with dim=1: many chunks per column combined."""
    check(make((2, 300, 3, 40), dtype, device), "softmax", 1)


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(3, 20000, 2, 64), (1, 70000, 3, 5), (2, 4096, 300)])
def test_softmax_long_sequence_gpu(shape, device):
    """Long axes at GPU scale: many chunks per column merged."""
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
# CUDA graphs: every op, forward and backward, captures and replays with new input data.
# ---------------------------------------------------------------------------------------------

GRAPH_CASES = [
    ("silu", None, (2, 300, 3, 40)),  # element-wise
    ("softmax", -1, (2, 300, 3, 40)),  # last dim: single-pass rows
    ("softmax", -1, (3, 20000)),  # a last dim longer than one program holds: split
    ("softmax", 1, (2, 4096, 4, 64)),  # over the sequence: split, chunk stats + apply
]


@pytest.mark.gpu
@pytest.mark.parametrize("direction", ["fwd", "bwd"])
@pytest.mark.parametrize(("a", "dim", "shape"), GRAPH_CASES, ids=lambda v: str(v))
def test_cuda_graph_replay(a, dim, shape, direction, device):
    from kernelkit.shared.testing import assert_graph_replays

    def data(seed, grad=False):
        return make(shape, torch.bfloat16, device, seed=seed).requires_grad_(grad)

    if direction == "fwd":
        assert_graph_replays(lambda x: act(x, a, dim), [data(0)], [[data(1)], [data(2)]])
        return

    def fwd_bwd(x, dy):
        return torch.autograd.grad(act(x, a, dim), x, dy)

    inputs = [data(0, True), data(10)]
    assert_graph_replays(fwd_bwd, inputs, [[data(1, True), data(11)], [data(2, True), data(12)]])
