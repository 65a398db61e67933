"""kernelkit-lrpe-core: the shared device helpers against the reference side (through small test
kernels), the reference helpers against brute force, the d(theta) reduction and validation.

The LRPE ops' own tests cover these pieces end to end; these pin each piece down on its own.
"""

import itertools
import math
from decimal import Decimal, localcontext
from fractions import Fraction

import numpy as np
import pytest
import torch
import triton
import triton.language as tl

from kernelkit.act import MAX_PACKED_SEQUENCES
from kernelkit.lrpe_core.kernels import cos_sin, grid_positions, packed_starts, token_positions
from kernelkit.lrpe_core.op import (
    ONE_PASS_MAX_ELEMENTS,
    merge_chunk_stats,
    merge_chunk_sums,
    position_args,
    position_strides,
    reduce_dtheta,
    sequence_softmax_stats,
    shortcut_key,
    validate_act,
    validate_positions,
    validate_theta,
    validate_x,
)
from kernelkit.lrpe_core.reference import (
    grid_positions as grid_positions_ref,
)
from kernelkit.lrpe_core.reference import (
    packed_positions,
    sequence_positions,
    slot_frequencies,
    wrap_frequencies,
)
from kernelkit.shared import replay
from kernelkit.shared.packed import segment_ids
from kernelkit.shared.replay import DIRECT
from kernelkit.shared.runtime import launch
from kernelkit.shared.testing import assert_key_holds_the_checks


@triton.jit
def _cos_sin_kernel(angle, cos_out, sin_out, n, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = i < n
    c, s = cos_sin(tl.load(angle + i, mask=ok, other=0.0))
    tl.store(cos_out + i, c, mask=ok)
    tl.store(sin_out + i, s, mask=ok)


@triton.jit
def _positions_kernel(out, offset, positions, N, stride_pb, stride_pn, BLOCK: tl.constexpr):
    b = tl.program_id(0)
    t = tl.arange(0, BLOCK)
    p = token_positions(offset, positions, b, t, N, stride_pb, stride_pn)
    tl.store(out + b * N + t, p, mask=t < N)


# As in the ops' kernels, the sizes are never specialised (Triton would make num_seqs = 1 a
# constant, and its sm_90 pipeline then fails on the search loops: an LLVM assertion).
@triton.jit(do_not_specialize=["num_seqs", "N"])
def _packed_kernel(seq_out, pos_out, cu_seqlens, num_seqs, N, BLOCK: tl.constexpr):
    t0 = tl.program_id(0) * BLOCK
    t = t0 + tl.arange(0, BLOCK)
    seq, start = packed_starts(cu_seqlens, num_seqs, t, t0, tl.minimum(t0 + BLOCK, N) - 1)
    tl.store(seq_out + t, seq, mask=t < N)
    tl.store(pos_out + t, t - start, mask=t < N)


@triton.jit
def _grid_kernel(out, N, D, extra, E, size_a, size_b, size_c, AXES: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):  # fmt: skip
    t = tl.arange(0, BLOCK_N)
    k = tl.arange(0, BLOCK_D)
    p = grid_positions(t, k, extra, E, size_a, size_b, size_c, AXES)
    tl.store(out + t[:, None] * D + k[None, :], p, mask=(t < N)[:, None] & (k < D)[None, :])


def test_cos_sin_accuracy(device):
    """Within a few float32 ulps of float64 cos/sin of the same float32 angle, up to 1e8 rad."""
    g = torch.Generator().manual_seed(0)
    mags = 10.0 ** (torch.rand(4096, generator=g, dtype=torch.float64) * 16 - 8)
    signs = torch.where(torch.rand(4096, generator=g) < 0.5, -1.0, 1.0)
    angle = (mags * signs).float()
    angle[:8] = torch.tensor([0.0, math.pi / 4, math.pi / 2, math.pi, 1e5, -1e5, 3e7, 1e8])
    c, s = torch.empty_like(angle), torch.empty_like(angle)
    a = angle.to(device)
    c, s = torch.empty_like(a), torch.empty_like(a)
    launch(_cos_sin_kernel)[(triton.cdiv(4096, 1024),)](a, c, s, 4096, BLOCK=1024)
    exact = angle.double()
    assert (c.cpu().double() - torch.cos(exact)).abs().max() < 2.5e-7
    assert (s.cpu().double() - torch.sin(exact)).abs().max() < 2.5e-7


@pytest.mark.parametrize("form", ["int", "starts", "table", "shared_table"])
def test_token_positions_forms(form, device):
    b, n = 3, 13
    table = torch.randint(-50, 10**6, (1 if form == "shared_table" else b, n))
    offset = {"int": 123_456, "starts": torch.tensor([0, 7, -3]), "table": 0, "shared_table": 0}
    offset = offset[form]
    start, starts, tab = validate_positions(
        torch.empty(b, n, 1, 2, device=device),
        offset.to(device) if isinstance(offset, torch.Tensor) else offset,
        table.to(device) if "table" in form else None,
    )
    out = torch.empty(b, n, dtype=torch.int64, device=device)
    launch(_positions_kernel)[(b,)](
        out=out, N=n, BLOCK=16, **position_args(start, starts, tab), **position_strides(tab)
    )
    ref = sequence_positions(table if "table" in form else offset, n, "cpu").expand(b, n)
    assert torch.equal(out.cpu(), ref)


@pytest.mark.parametrize(("shape", "extra", "e"), [((9,), 0, 4), ((3, 4), 2, 3), ((2, 3, 4), 5, 2),
                                                   ((2, 1, 3, 2), 1, 2)])  # fmt: skip
def test_grid_positions_match_reference(shape, extra, e, device):
    m, n = len(shape), extra + math.prod(shape)
    d = e * m
    inner = [*reversed(shape[1:]), 1, 1, 1]
    out = torch.full((n, d), -1, dtype=torch.int32, device=device)
    launch(_grid_kernel)[(1,)](out, n, d, extra, e, *inner[:3], AXES=m, BLOCK_N=32, BLOCK_D=16)
    ref = grid_positions_ref(shape, extra, e, d, "cpu")
    brute = torch.zeros(n, d, dtype=torch.int64)
    for t in range(extra, n):
        coords = [int(c) for c in torch.unravel_index(torch.tensor(t - extra), shape)]
        for k in range(d):
            brute[t, k] = coords[k // e]
    assert torch.equal(ref, brute)
    assert torch.equal(out.cpu().long(), brute)


def test_packed_positions_restart_per_sequence():
    cu = torch.tensor([0, 3, 3, 4, 9], dtype=torch.int32)
    assert packed_positions(cu, 9).tolist() == [[0, 1, 2, 0, 0, 1, 2, 3, 4]]


@pytest.mark.parametrize(
    "lengths", [[9], [3, 0, 1, 5], [0, 0, 2, 0, 7, 0], [1] * 9, [2, 0, 0, 0, 0, 0, 0, 0, 0, 1, 6]]
)
def test_packed_starts_match_reference(lengths, device):
    """Sequence and position of every token from cu_seqlens on the device: tiles inside one
    sequence, across several, with empty sequences anywhere and counts not a power of two."""
    n = sum(lengths)
    cu = torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32)
    seq = torch.full((n,), -1, dtype=torch.int32, device=device)
    pos = torch.full((n,), -1, dtype=torch.int32, device=device)
    for block in (2, 4, 16):
        launch(_packed_kernel)[(triton.cdiv(n, block),)](
            seq, pos, cu.to(device), len(lengths), n, BLOCK=block
        )
        assert torch.equal(seq.cpu().long(), segment_ids(cu, n).long())
        assert torch.equal(pos.cpu().long()[None], packed_positions(cu, n))


def test_frequency_forms():
    theta = torch.arange(1.0, 7.0).view(2, 3)
    assert torch.equal(slot_frequencies(theta, 3), theta)
    assert slot_frequencies(theta[:, :1], 4).tolist() == [[1.0] * 4, [4.0] * 4]
    assert slot_frequencies(theta[:, :2], 4).tolist() == [[1, 2, 0, 0], [4, 5, 0, 0]]
    assert wrap_frequencies(theta, 7).tolist()[0] == [1, 2, 3, 1, 2, 3, 1]


# ---------------------------------------------------------------------------------------------
# Softmax over the sequence: merging per-chunk partials (float64 sums, rounded once)
# ---------------------------------------------------------------------------------------------


def _ulp32(v: float) -> float:
    """The spacing of float32 at the float32 nearest |v|."""
    return float(np.spacing(np.float32(abs(v))))


def _chunk_stats(rows, chunks, cols, seed):
    """float32 (2, rows, chunks, cols) chunk stats: maxima in a wide range, sums >= 1; chunk 1
    of row 0 and every chunk of row 1 empty (-inf, 0)."""
    g = torch.Generator().manual_seed(seed)
    m = torch.randn(rows, chunks, cols, generator=g) * 8
    s = 1 + torch.rand(rows, chunks, cols, generator=g) * 300
    m[0, 1], s[0, 1] = -math.inf, 0.0
    m[1], s[1] = -math.inf, 0.0
    return torch.stack((m, s))


def test_merge_chunk_stats_is_the_nearest_float32(device):
    """The merged sum is within half a float32 ulp of the exact merge of the float32 chunk
    stats (50 digits), and never further from it than the float32 torch merge it replaced
    (exp, products and sum in float32); the maxima are exact; empty rows merge to (-inf, 0)."""
    rows, chunks, cols = 6, 5, 40
    stats = _chunk_stats(rows, chunks, cols, 0)
    got = merge_chunk_stats(stats.to(device)).cpu()
    m, s = stats[0], stats[1]
    top = m.amax(1, keepdim=True)
    shift = torch.where(top == -math.inf, torch.zeros_like(top), top)
    before = (s * torch.exp(m - shift)).sum(1, keepdim=True)
    assert got.shape == (2, rows, 1, cols)
    assert torch.equal(got[0], top)
    with localcontext() as ctx:
        ctx.prec = 50
        for r, i in itertools.product(range(rows), range(cols)):
            base = Decimal(shift[r, 0, i].item())
            exact = sum(
                (Decimal(s[r, c, i].item()) * (Decimal(m[r, c, i].item()) - base).exp())
                for c in range(chunks)
                if m[r, c, i] != -math.inf
            )
            new, old = got[1, r, 0, i].item(), before[r, 0, i].item()
            err = abs(Decimal(new) - exact)
            assert err <= Decimal(_ulp32(float(exact))) / 2, (r, i, new, exact)
            assert err <= abs(Decimal(old) - exact), (r, i, new, old, exact)
    assert got[1, 1].eq(0).all() and got[0, 1].eq(-math.inf).all()


def test_merge_chunk_stats_nan_as_torch(device):
    """A NaN chunk maximum makes the row's maximum and sum NaN (torch's amax propagates it)."""
    stats = _chunk_stats(3, 4, 8, 1)
    stats[0, 2, 2, 5] = math.nan
    got = merge_chunk_stats(stats.to(device)).cpu()
    assert got[0, 2, 0, 5].isnan() and got[1, 2, 0, 5].isnan()
    assert not got[:, :2].isnan().any() and not got[:, 2, 0, :5].isnan().any()


def test_merge_chunk_sums_is_the_nearest_float32(device):
    """Sums over chunks of float32 partials of both signs: within half an ulp of the exact
    sum and never further from it than torch's float32 sum."""
    g = torch.Generator().manual_seed(2)
    rows, chunks, cols = 5, 7, 33
    sums = torch.randn(rows, chunks, cols, generator=g) * torch.logspace(-3, 3, chunks)[:, None]
    got = merge_chunk_sums(sums.to(device)).cpu()
    before = sums.sum(1, keepdim=True)
    assert got.shape == (rows, 1, cols)
    for r, i in itertools.product(range(rows), range(cols)):
        exact = sum(Fraction(sums[r, c, i].item()) for c in range(chunks))
        err = abs(Fraction(got[r, 0, i].item()) - exact)
        assert err <= Fraction(_ulp32(float(exact))) / 2, (r, i)
        assert err <= abs(Fraction(before[r, 0, i].item()) - exact), (r, i)
    one = sums[:, :1].to(device)
    assert merge_chunk_sums(one) is one  # one chunk: nothing to merge, no launch


class _Counted(replay.Probe):
    """`ops` that launch as `DIRECT` does and record each kernel launched."""

    def launch(self, kernel, grid, *args, vary=None, **kwargs):
        super().launch(kernel, grid, *args, **kwargs)
        DIRECT.launch(kernel, grid, *args, **kwargs)


@pytest.mark.parametrize("packed", [False, True], ids=["batched", "packed"])
@pytest.mark.parametrize("d", [128, 40])
@pytest.mark.parametrize("above", [False, True], ids=["at_bound", "above"])
def test_sequence_stats_one_pass_up_to_the_bound(above, d, packed, device):
    """Up to ONE_PASS_MAX_ELEMENTS elements per program (N x D rounded up to a power of 2) the
    stats are read in one chunk: one launch, no merge. Above, in chunks and their merge. Both
    are the softmax-over-N (max, sum) of x, as torch's."""
    n = ONE_PASS_MAX_ELEMENTS // (128 if d == 128 else 64) + above
    b, h = (1, 2) if packed else (2, 2)
    x = torch.randn(b, n, h, d, generator=torch.Generator().manual_seed(n)).mul(4).to(device)
    cu = torch.tensor([0, 3, n // 2, n], dtype=torch.int32, device=device) if packed else None
    ops = _Counted()
    stats = sequence_softmax_stats(x, cu, ops=ops).cpu()
    names = [k.fn.__name__ for k in ops.kernels]
    merged = ["softmax_chunk_stats_kernel", "merge_chunk_stats_kernel"]
    assert names == (merged if above else ["softmax_chunk_stats_kernel"])
    seqs = [(0, n)] if cu is None else list(itertools.pairwise(cu.tolist()))
    xs = x.cpu().double().permute(0, 2, 1, 3)  # (B, H, N, D)
    rows = [xs[r, :, s:e] for r in range(b) for s, e in seqs]  # (H, tokens, D) per stats row
    top = [t.amax(1, keepdim=True) for t in rows]
    want = torch.stack(
        (
            torch.cat([m[:, 0] for m in top]),
            torch.cat([(t - m).exp().sum(1) for t, m in zip(rows, top)]),
        )
    )
    assert stats.shape == (2, len(rows) * h, 1, d)
    torch.testing.assert_close(stats[:, :, 0].double(), want, rtol=2e-6, atol=0)


def test_reduce_dtheta_forms():
    p = torch.arange(2 * 3 * 4, dtype=torch.float32).view(2, 3, 4)  # (programs, H, slots)
    g = p.sum(0)
    assert torch.equal(reduce_dtheta(p, (3, 4)), g)
    assert torch.equal(reduce_dtheta(p, (3, 2)), g[:, :2])
    assert torch.equal(reduce_dtheta(p, (3, 1)), g.sum(1, keepdim=True))
    assert torch.equal(reduce_dtheta(p, (1, 4)), g.sum(0, keepdim=True))
    wrapped = reduce_dtheta(p, (3, 3), wrap=True)  # slot k -> column k mod 3
    assert torch.equal(wrapped[:, 0], g[:, 0] + g[:, 3])
    assert torch.equal(wrapped[:, 1:], g[:, 1:3])


@pytest.mark.parametrize("wrap", ["no", 1, None, torch.tensor(True)])
def test_reduce_dtheta_wrap_must_be_bool(wrap):
    with pytest.raises(ValueError, match="wrap: expected a bool"):
        reduce_dtheta(torch.zeros(2, 3, 4), (3, 3), wrap=wrap)


def test_theta_rows_of_packed_three_dim_input():
    """flash_attn_varlen's packed (total, H, D) layout given to an LRPE op reads as (B, N, D):
    the error names the layout the LRPE ops take for packed sequences."""
    x = torch.empty(10, 4, 8)  # (total, H, D)
    with pytest.raises(ValueError) as err:
        validate_theta(x, torch.ones(4, 4))
    msg = str(err.value)
    assert msg.startswith("theta: has 4 rows, but x (10, 4, 8) is read as (B, N, D)")
    assert "theta needs 1 row" in msg
    assert "(total, H, D)" in msg and "(1, total, H, D)" in msg and "cu_seqlens" in msg
    with pytest.raises(ValueError, match=r"theta: has 3 rows, expected 1 or H = 4$"):
        validate_theta(x.unsqueeze(0), torch.ones(3, 4))
    assert validate_theta(x.unsqueeze(0), torch.ones(4, 4)) == 4


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"offset": 3, "positions": torch.zeros(2, 5, dtype=torch.int64)}, "offset: must be 0"),
        ({"positions": torch.zeros(2, 5)}, "positions: expected an integer tensor"),
        ({"positions": torch.zeros(2, 4, dtype=torch.int64)}, r"positions: expected shape"),
        ({"cu_seqlens": torch.tensor([0, 5])}, "cu_seqlens: dtype must be torch.int32"),
        ({"cu_seqlens": torch.tensor([0, 4], dtype=torch.int32)}, "cu_seqlens: last entry 4"),
        ({"cu_seqlens": torch.tensor([0, 3, 2, 5], dtype=torch.int32)}, "non-decreasing"),
        ({"cu_seqlens": torch.tensor([5], dtype=torch.int32)}, r"cu_seqlens: expected shape"),
        (
            {
                "cu_seqlens": torch.tensor([0, 5], dtype=torch.int32),
                "positions": torch.zeros(1, 5, dtype=torch.int64),
            },
            "give positions or cu_seqlens",
        ),
    ],
)
def test_position_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        validate_positions(torch.empty(2, 5, 1, 4), kwargs.pop("offset", 0), **kwargs)


def test_packed_softmax_sequence_limit():
    """Softmax over the sequence of packed rows: at most kernelkit-act's MAX_PACKED_SEQUENCES
    (its stats grid); the other acts take any number (they only need the positions table)."""
    n = MAX_PACKED_SEQUENCES + 1
    cu = torch.tensor([0] * n + [5], dtype=torch.int32)
    x = torch.empty(1, 5, 1, 4)
    with pytest.raises(ValueError, match=f"at most {MAX_PACKED_SEQUENCES} packed sequences"):
        validate_act(x, "softmax", 1, cu)
    assert validate_act(x, "softmax", -1, cu) == "softmax"
    assert validate_act(x, "silu", None, cu) == "silu"


def test_cu_seqlens_must_be_contiguous():
    cu = torch.tensor([0, 9, 2, 9, 5], dtype=torch.int32)[::2]
    with pytest.raises(ValueError, match="cu_seqlens: must be contiguous"):
        validate_positions(torch.empty(1, 5, 1, 4), 0, None, cu)


def test_packed_needs_one_row():
    with pytest.raises(ValueError, match="x: packed sequences"):
        validate_positions(
            torch.empty(2, 5, 1, 4), 0, None, torch.tensor([0, 5], dtype=torch.int32)
        )


def _checked(x, theta, offset, act, dim, positions=None, cu_seqlens=None):
    """What the shared checks make of an LRPE call, the per-call offset value left out: (E, the
    kernel kind, the positions' form), or the error."""
    try:
        validate_x(x)
        e = validate_theta(x, theta)
        start, starts, table = validate_positions(x, offset, positions, cu_seqlens)
        kind = validate_act(x, act, dim, cu_seqlens)
    except ValueError as err:
        return ("error", str(err))
    return e, kind, type(start), starts is None, table is None


def test_shortcut_key_holds_what_the_checks_read(device):
    """`shortcut_key` (an LRPE op's common call replays its recorded sequence without the
    checks) is sound: calls with one key get one outcome from the checks, the offset's value
    aside (each replay passes its own). A valid call, then every change of one argument: other
    valid and invalid values, values of other types that compare equal (True for 1, 1.0 for 1),
    tensors of other layouts, dtypes, classes, devices or alignment, gradients."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    x = torch.zeros(2, 8, 4, 32, dtype=torch.bfloat16, device=device)
    theta = torch.zeros(4, 16, device=device)
    with FakeTensorMode():
        fake = torch.empty(2, 8, 4, 32, dtype=torch.bfloat16, device=device)
    base = (x, theta, 3, "softmax", -1)
    changes = [
        (2, 0), (2, -5), (2, 2**40), (2, 2**62), (2, 2**62 + 1), (2, True), (2, 3.0),
        (2, torch.zeros(2, dtype=torch.int64, device=device)), (3, "relu"), (3, "none"),
        (3, "bogus"), (4, None), (4, 1), (4, 2), (4, 3), (4, True), (4, 1.0), (4, -1.0),
        (1, theta.double()), (1, theta[:1]), (1, torch.zeros(3, 16, device=device)),
        (1, torch.zeros(16, device=device)), (1, theta.clone().requires_grad_()),
        (1, torch.zeros(4, 16, dtype=torch.int32, device=device)), (1, theta.t().contiguous().t()),
        (0, x[..., 0]), (0, x.float()), (0, x.to(torch.int32)), (0, x.clone().requires_grad_()),
        (0, torch.nn.Parameter(x)), (0, fake), (0, x.transpose(1, 2).contiguous().transpose(1, 2)),
        (0, torch.zeros(x.numel() + 1, dtype=x.dtype, device=device)[1:].view(x.shape)),
        (0, torch.zeros(2, 8, 4, 8, dtype=torch.bfloat16, device=device)),
    ]  # fmt: skip
    if device.type == "cuda":
        changes += [(1, theta.cpu()), (0, x.cpu())]
    extra = [
        (x, theta, 3, "softmax", -1, torch.zeros(1, 8, dtype=torch.int64), None),
        (x, theta, 0, "softmax", 1, None, torch.tensor([0, 8], dtype=torch.int32)),
    ]
    assert_key_holds_the_checks(shortcut_key, _checked, base, changes, extra)
