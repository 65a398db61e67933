"""md_lrpe_cosine: grids of 1 to 4 axes, extra tokens, every act, theta widths, dtypes, strided
input, the angle cache, gradients of x and theta against a float64 reference; errors, opcheck,
torch.compile.

Runs the real Triton kernels: on the GPU when there is one, otherwise under the Triton
interpreter (the kernelkit pytest plugin switches it on before the kernels are imported).
"""

import math

import pytest
import torch

from kernelkit.lrpe_cosine import lrpe_cosine
from kernelkit.md_lrpe_cosine import md_lrpe_cosine
from kernelkit.md_lrpe_cosine.op import bwd, fwd, fwd_plain
from kernelkit.md_lrpe_cosine.reference import md_lrpe_cosine_reference
from kernelkit.shared.testing import assert_close, compilations

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


def make_theta(rows, e, device, seed=1):
    g = torch.Generator().manual_seed(seed)
    base = 10000.0 ** (-torch.arange(e, dtype=torch.float64) / e)
    jitter = 1.0 + 0.5 * torch.rand((rows, e), generator=g, dtype=torch.float64)
    return (base * jitter).float().to(device)


def x_for(b, shape, l, h, d, dtype, device, seed=0):
    return make((b, l + math.prod(shape), h, d), dtype, device, seed=seed)


def check(x, theta, shape, l=0, a="none", dim=None, *, cache=False, x_grad=True, theta_grad=True):
    """Forward and gradients vs float64 and vs the reference in x.dtype."""
    x = x.detach().requires_grad_(x_grad)
    theta = theta.detach().requires_grad_(theta_grad)
    y = md_lrpe_cosine(x, theta, shape, l, a, dim, cache)
    x64 = x.detach().double().requires_grad_(x_grad)
    t64 = theta.detach().double().requires_grad_(theta_grad)
    y64 = md_lrpe_cosine_reference(x64, t64, shape, l, a, dim)
    xl = x.detach().clone().requires_grad_(x_grad)
    tl_ = theta.detach().clone().requires_grad_(theta_grad)
    yl = md_lrpe_cosine_reference(xl, tl_, shape, l, a, dim)
    assert y.dtype == x.dtype and y.shape == (*x.shape[:-1], 2 * x.shape[-1])
    assert_close(y, y64, ref_lowp=yl, name=f"{a}{dim} forward")
    dy = make(y.shape, y.dtype, y.device, scale=1.0, seed=2)
    y.backward(dy)
    y64.backward(dy.double())
    yl.backward(dy)
    if x_grad:
        assert_close(x.grad, x64.grad, ref_lowp=xl.grad, name=f"{a}{dim} dx")
    if theta_grad:
        assert theta.grad.shape == theta.shape
        assert_close(theta.grad, t64.grad, ref_lowp=tl_.grad, name=f"{a}{dim} dtheta")
    return y, x.grad, theta.grad


# Grids of 1 to 4 axes with odd sides, E = ceil(D / m) (D = 24) or wider.
GRIDS = [((7,), 24), ((3, 5), 12), ((3, 2, 5), 8), ((2, 3, 1, 3), 6), ((5, 3), 17)]


@pytest.mark.parametrize(("shape", "e"), GRIDS, ids=str)
@pytest.mark.parametrize("l", [0, 1, 10])
def test_grids_and_extra_tokens(shape, e, l, device):
    x = x_for(2, shape, l, 2, 24, torch.float32, device)
    check(x, make_theta(2, e, device), shape, l, "silu")


@pytest.mark.parametrize("case", ACT_CASES, ids=case_id)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_acts_and_dtypes(case, dtype, device):
    shape, l = (3, 4, 3), 2
    check(x_for(3, shape, l, 2, 20, dtype, device), make_theta(2, 7, device), shape, l, *case)


@pytest.mark.parametrize("case", [("none", None), ("softmax", 1)], ids=case_id)
def test_cache_gives_identical_results(case, device):
    """cache=True reads the forward's float32 angle table: the same values, bit for bit."""
    shape, l = (5, 3), 3
    x = x_for(2, shape, l, 3, 16, torch.bfloat16, device)
    theta = make_theta(3, 8, device)
    y0, dx0, dt0 = check(x, theta, shape, l, *case, cache=False)
    y1, dx1, dt1 = check(x, theta, shape, l, *case, cache=True)
    assert torch.equal(y0, y1) and torch.equal(dx0, dx1) and torch.equal(dt0, dt1)


def test_extra_tokens_pass_through(device):
    """The l extra tokens have angle 0: output [act(x), 0] exactly."""
    shape, l = (2, 3), 4
    x = x_for(2, shape, l, 2, 8, torch.float32, device)
    y = md_lrpe_cosine(x, make_theta(2, 4, device), shape, l, "relu")
    assert torch.equal(y[:, :l, :, :8], torch.relu(x[:, :l]))
    assert torch.equal(y[:, :l, :, 8:], torch.zeros_like(x[:, :l]))


def test_one_axis_is_lrpe_cosine(device):
    """m = 1, l = 0, E = D: the 1-D package's result with offset 0."""
    x = make((2, 19, 3, 16), torch.bfloat16, device)
    theta = make_theta(3, 16, device)
    assert torch.equal(md_lrpe_cosine(x, theta, (19,)), lrpe_cosine(x, theta, 0))


def test_shared_theta_row_strided_input_and_3d(device):
    shape, l = (3, 5), 1
    base = make((2, 1 + 15, 3 * 2, 24), torch.float16, device)
    x = base[:, :, ::2, 4:20]  # strided heads and features: (2, 16, 3, 16)
    assert not x.is_contiguous()
    check(x, make_theta(1, 8, device), shape, l, "sigmoid")
    check(x_for(2, shape, l, 1, 16, torch.float32, device)[:, :, 0], make_theta(1, 8, device),
          shape, l, "softmax", -1)  # fmt: skip


def test_gradient_to_one_input_only(device):
    shape = (3, 3)
    x = x_for(2, shape, 2, 2, 12, torch.float32, device)
    theta = make_theta(2, 6, device)
    check(x, theta, shape, 2, "softmax", 1, x_grad=False)
    check(x, theta, shape, 2, "none", theta_grad=False)


def test_replayed_calls_follow_grid_theta_and_dtype(device):
    """The host path is recorded once per layout and options and replayed, its Grid cached
    per (shape, l, E): grids of one token count (x of one layout), l, dtypes, theta changed in
    place and calls with and without autograd each get their own result, called again too."""
    x32 = x_for(2, (3, 4), 2, 2, 8, torch.float32, device)
    theta = make_theta(2, 8, device)
    cases = [((3, 4), 2), ((4, 3), 2), ((2, 6), 2), ((12,), 2), ((2, 7), 0), ((14,), 0)]
    for _ in range(2):
        for shape, l in cases:
            for x in (x32, x32.to(torch.bfloat16)):
                y, _, _ = check(x, theta, shape, l, theta_grad=False)
                assert torch.equal(md_lrpe_cosine(x, theta, shape, l), y.detach())
    check(x32, theta, (4, 3), 2, theta_grad=False)
    theta.mul_(1.5)  # read at every launch: the replay takes the tensor, not its values
    check(x32, theta, (4, 3), 2, theta_grad=False)


def test_reference_fallback(monkeypatch):
    import kernelkit.md_lrpe_cosine.op as op

    monkeypatch.setattr(op, "use_triton", lambda t: False)
    check(x_for(2, (2, 3), 1, 2, 8, torch.float32, "cpu"), make_theta(2, 4, "cpu"), (2, 3), 1,
          "silu")  # fmt: skip


@pytest.mark.parametrize(
    ("over", "match"),
    [
        ({"x": torch.ones(2, 13, 3, 8)}, r"x: N = 13 tokens, expected l \+ prod\(shape\)"),
        ({"shape": (3, 0)}, "shape: every side must be positive"),
        ({"shape": (3, -4)}, "shape: every side must be positive"),
        ({"shape": 12}, "shape: expected a tuple of ints"),
        ({"shape": (3, 4.0)}, "shape: expected a tuple of ints"),
        ({"shape": [3, 4.0]}, "shape: expected a tuple of ints"),
        ({"shape": (True, 12)}, "shape: expected a tuple of ints"),
        ({"shape": ()}, "shape: expected 1 to 4 axes"),
        ({"l": True, "x": torch.ones(2, 13, 3, 8)}, "l: expected a non-negative int"),
        ({"l": 2.0}, "l: expected a non-negative int"),
        ({"shape": (1, 1, 1, 2, 6)}, "shape: expected 1 to 4 axes"),
        ({"l": -1}, "l: expected a non-negative int"),
        ({"theta": torch.ones(3, 3)}, r"theta: E = 3 frequencies per axis cover E \* m = 6 < D"),
        ({"theta": torch.ones(3, 4, 1)}, "theta: expected shape"),
        ({"theta": torch.ones(2, 4)}, "theta: has 2 rows"),
        ({"theta": torch.ones(3, 4, dtype=torch.int32)}, "theta: must be a floating-point"),
        ({"act": "gelu"}, "act: must be one of"),
        ({"act": "softmax", "dim": 2}, "dim: softmax runs over D"),
        ({"cache": 1}, "cache: expected a bool"),
        ({"cache": "no"}, "cache: expected a bool"),
        ({"cache": None}, "cache: expected a bool"),
    ],
)
def test_errors(over, match, device):
    args = {"x": torch.ones(2, 14, 3, 8), "theta": torch.ones(3, 4), "shape": (3, 4), "l": 2}
    args.update(over)
    args = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in args.items()}
    with pytest.raises(ValueError, match=match):
        md_lrpe_cosine(**args)


@pytest.mark.parametrize(("kind", "cache"), [("silu", True), ("softmax_seq", False)])
def test_opcheck(kind, cache, device):
    x = x_for(2, (3, 4), 2, 2, 8, torch.float32, device).requires_grad_()
    theta = make_theta(2, 4, device).requires_grad_()
    torch.library.opcheck(fwd.op, (x, theta, [3, 4], 2, kind, cache))
    y, stats, angles = fwd(x.detach(), theta.detach(), [3, 4], 2, kind, cache)
    dy = make(y.shape, y.dtype, device, seed=3)
    args = (dy, x.detach(), theta.detach(), [3, 4], 2, stats, angles, kind, True, True)
    torch.library.opcheck(bwd.op, args)


def test_opcheck_plain(device):
    """fwd_plain (y alone: element-wise acts and softmax over D without the cache) and bwd
    without fwd's stats and angles."""
    x = x_for(2, (3, 4), 2, 2, 8, torch.float32, device).requires_grad_()
    theta = make_theta(2, 4, device).requires_grad_()
    torch.library.opcheck(fwd_plain.op, (x, theta, [3, 4], 2, "silu"))
    y = fwd_plain(x.detach(), theta.detach(), [3, 4], 2, "silu")
    dy = make(y.shape, y.dtype, device, seed=3)
    args = (dy, x.detach(), theta.detach(), [3, 4], 2, None, None, "silu", True, True)
    torch.library.opcheck(bwd.op, args)


def test_torch_compile_fullgraph(device):
    backend = "inductor" if device.type == "cuda" else "aot_eager"
    shape, l = (3, 5), 2
    f = torch.compile(
        lambda t, th: md_lrpe_cosine(t, th, shape, l, "softmax", 1) * 2.0,
        fullgraph=True,
        backend=backend,
    )
    x = x_for(2, shape, l, 2, 16, torch.float32, device).requires_grad_()
    theta = make_theta(2, 8, device).requires_grad_()
    y = f(x, theta)
    dy = make(y.shape, y.dtype, device, seed=5)
    y.backward(dy)
    x64 = x.detach().double().requires_grad_()
    t64 = theta.detach().double().requires_grad_()
    y64 = md_lrpe_cosine_reference(x64, t64, shape, l, "softmax", 1) * 2.0
    y64.backward(dy.double())
    assert_close(y, y64, name="compiled forward")
    assert_close(x.grad, x64.grad, name="compiled dx")
    assert_close(theta.grad, t64.grad, name="compiled dtheta")


# ---------------------------------------------------------------------------------------------
# GPU only: benchmark-like shapes and recompilation
# ---------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("case", ACT_CASES, ids=case_id)
@pytest.mark.parametrize(("shape", "e"), [((1024,), 128), ((32, 32), 64), ((8, 12, 11), 43)])
def test_benchmark_like_shapes(shape, e, case, device):
    x = x_for(3, shape, 10, 12, 128, torch.bfloat16, device)
    check(x, make_theta(12, e, device), shape, 10, *case)


@pytest.mark.gpu
def test_no_recompile_on_new_shape_extra_or_n(device):
    theta = make_theta(4, 22, device)

    def run(shape, l, cache):
        x = x_for(2, shape, l, 4, 64, torch.bfloat16, device).requires_grad_()
        md_lrpe_cosine(x, theta, shape, l, "silu", None, cache).sum().backward()

    run((4, 5, 6), 0, False)
    run((4, 5, 6), 0, True)
    with compilations() as compiled:
        for shape, l in [((7, 1, 16), 1), ((16, 16, 16), 10), ((1, 1, 1), 0), ((3, 9, 2), 33)]:
            run(shape, l, False)
            run(shape, l, True)
    assert not compiled, dict(compiled)


@pytest.mark.gpu
@pytest.mark.parametrize("cache", [False, True])
@pytest.mark.parametrize("case", [("none", None), ("softmax", 1)], ids=case_id)
def test_cuda_graph_replay(case, cache, device):
    """Forward and backward (x and a learnable theta) captured into a CUDA graph replay new
    inputs bit-exactly, with and without the angle cache."""
    from kernelkit.shared.testing import assert_graph_replays

    a, dim = case
    shape, l = (6, 7, 5), 3

    def fwd_bwd(x, theta, dy):
        y = md_lrpe_cosine(x, theta, shape, l, a, dim, cache)
        return (y, *torch.autograd.grad(y, (x, theta), dy))

    def data(seed):
        x = x_for(2, shape, l, 4, 64, torch.bfloat16, device, seed=seed).requires_grad_()
        dy = make((*x.shape[:-1], 128), torch.bfloat16, device, seed=seed + 2)
        return [x, make_theta(4, 22, device, seed=seed + 1).requires_grad_(), dy]

    assert_graph_replays(fwd_bwd, data(0), [data(10), data(20)])


def test_prepared_launches_match_tritons_path():
    """lrpe-cosine's and md-lrpe-cosine's launches planned once per layout (prepared, with the
    int offset varying per call) pass the same compiled kernels the same arguments as Triton's
    own launch path."""
    from pathlib import Path

    from kernelkit.shared.testing import assert_launch_paths_agree

    assert_launch_paths_agree(Path(__file__).with_name("launch_calls.py"))


# ---------------------------------------------------------------------------------------------
# The shortcut for repeated calls (`op._call_key`, `op._CALLS`)
# ---------------------------------------------------------------------------------------------


def _checked(x, theta, shape, l, act, dim, cache):
    """What `validate` makes of a call: (kernel kind, grid), or the error."""
    from kernelkit.md_lrpe_cosine.op import validate

    try:
        return validate(x, theta, shape, l, act, dim, cache)
    except ValueError as err:
        return ("error", str(err))


def test_shortcut_key_holds_what_the_checks_read(device):
    """`op._call_key` (a call like an earlier checked one replays its recorded sequence without
    the checks) is sound: calls with one key get one outcome from `validate`. A valid call,
    then every change of one argument: other valid and invalid values, values of other types
    that compare equal (a list for a tuple, 8.0 or True for an int, 1 for True), tensors of
    other layouts, dtypes or classes, gradients."""
    from kernelkit.md_lrpe_cosine.op import _call_key
    from kernelkit.shared.testing import assert_key_holds_the_checks

    x = torch.zeros(2, 65, 4, 32, dtype=torch.bfloat16, device=device)
    theta = torch.zeros(4, 16, device=device)
    base = (x, theta, (8, 8), 1, "softmax", -1, False)
    changes = [
        (2, [8, 8]), (2, (4, 16)), (2, (8, 8.0)), (2, (True, 64)), (2, (64,)), (2, (2, 4, 8)),
        (2, (2, 2, 2, 2, 4)), (2, (0, 8)), (2, (-8, -8)), (2, 64), (3, 0), (3, True), (3, 1.0),
        (3, -1), (3, 2), (4, "relu"), (4, "none"), (4, "bogus"), (5, None), (5, 1), (5, 2),
        (5, True), (5, 1.0), (6, True), (6, 1), (6, 0), (6, "yes"), (1, theta.double()),
        (1, theta[:1]), (1, torch.zeros(4, 15, device=device)),
        (1, torch.zeros(4, 8, device=device)), (1, theta.clone().requires_grad_()),
        (0, x.float()), (0, x[..., :16]), (0, x.clone().requires_grad_()),
        (0, torch.nn.Parameter(x)), (0, x[:, :64]), (0, x.transpose(1, 2).contiguous().transpose(1, 2)),
    ]  # fmt: skip
    assert_key_holds_the_checks(_call_key, _checked, base, changes)


def _shortcut_pairs(device):
    """(record, call) pairs: calls like the recorded one (every kind, the angle cache) with
    other x and theta values, then calls of another grid and of a float64 theta."""
    shape, l = (4, 5), 2
    x, x2 = (x_for(2, shape, l, 3, 16, torch.bfloat16, device, seed=s) for s in (0, 5))
    theta, theta2 = make_theta(3, 8, device), make_theta(3, 8, device, seed=7)
    return [
        ((x, theta, shape, l), (x2, theta, shape, l)),
        ((x, theta, shape, l, "silu"), (x2, theta2, shape, l, "silu")),
        ((x, theta, shape, l, "softmax", -1), (x2, theta, shape, l, "softmax", -1)),
        ((x, theta, shape, l, "softmax", 1), (x2, theta2, shape, l, "softmax", 1)),
        ((x, theta, shape, l, "none", None, True), (x2, theta, shape, l, "none", None, True)),
        ((x, theta, shape, l), (x2, theta, (5, 4), l)),
        ((x, theta, shape, l), (x2, theta.double(), shape, l)),
    ]


def test_repeated_calls_take_the_shortcut(device, monkeypatch):
    """A call like an earlier checked one replays its recorded sequence (`op._CALLS`), bitwise
    the checked call, without the checks (a failing `validate` is not reached); calls of another
    grid or theta dtype take the checked path."""
    from kernelkit.md_lrpe_cosine import op
    from kernelkit.shared.testing import assert_shortcuts_replay

    pairs = _shortcut_pairs(device)
    assert_shortcuts_replay(md_lrpe_cosine, pairs, op._CALLS)
    checks = op.validate

    def refuse(*args):
        raise AssertionError("the checks ran")

    for record, call in pairs[:5]:
        op._CALLS.clear()
        md_lrpe_cosine(*record)
        monkeypatch.setattr(op, "validate", refuse)
        md_lrpe_cosine(*call)
        monkeypatch.setattr(op, "validate", checks)


def test_repeated_calls_with_gradients_take_the_shortcut(device):
    """With x, theta or both requiring grad, a call like an earlier checked one replays its
    sequence through `op._ReplayedForward` (the ops' saved tensors and backward): output and
    gradients bitwise the checked call's, the angle cache and softmax over N included."""
    from kernelkit.md_lrpe_cosine import op
    from kernelkit.shared.testing import assert_shortcut_gradients

    taken = assert_shortcut_gradients(
        md_lrpe_cosine, _shortcut_pairs(device), op._CALLS, "_ReplayedForward"
    )
    expected = [True, True, True, True, True, False, False]  # per pair
    assert taken == [t for t in expected for _ in range(3)]
