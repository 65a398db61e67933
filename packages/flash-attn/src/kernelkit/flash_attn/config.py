"""The values that decide what a flash-attn call runs.

A call is described once, as a `Problem` (shapes, dtype, masks, alignment, and the `Target`
machine); `choose.choose_fwd` / `choose.choose_bwd` turn it into a frozen `FwdConfig` /
`BwdConfig` holding every decision: the kernel of each step, its tile, TMA loads, and the
schedule flags of the Gluon kernels. The launch code only carries a config out; it never
changes one. Tools and tests that want another choice pass a config of their own
(`dataclasses.replace` on the chosen one), which `choose.check_fwd` / `check_bwd` accept only
where its kernels can run it (`can_implement` of the backend modules).
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass, field

import torch

from kernelkit.shared.runtime import interpreting, next_power_of_2, num_sms

LOG2E = 1.4426950408889634  # scores run in log2 units (exp2)
# Rows each backward row vector (LSE in log2 units, delta) is padded to when `pad_rows` is set:
# at least every backward tile's BLOCK_M (powers of two).
ROW_PAD = 128
# Rows of the backward's preprocess and dq conversion per program.
PREPROCESS_BLOCK_M = 64


def block_d_for(d: int) -> int:
    """The head dim the kernels compute with: d padded to a power of two, at least 16."""
    return max(16, next_power_of_2(d))


# ---------------------------------------------------------------------------------------------
# The machine and the call
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Target:
    """The machine as the chooser sees it. interpreter: TRITON_INTERPRET (small tiles, no Gluon);
    tma: TMA descriptors (Hopper or newer, or the interpreter, which runs the same code); gluon:
    the Gluon kernels can run (an sm_90 GPU); sms: multiprocessors (4 under the interpreter)."""

    interpreter: bool
    tma: bool
    gluon: bool
    sms: int

    @staticmethod
    def of(device: torch.device) -> Target:
        """The target of tensors on `device`."""
        if device.type != "cuda":
            return Target(interpreting(), interpreting(), False, num_sms(device))
        return _cuda_target(device.index or 0, interpreting())


@functools.cache
def _cuda_target(index: int, interpreter: bool) -> Target:
    major = torch.cuda.get_device_capability(index)[0]
    sms = torch.cuda.get_device_properties(index).multi_processor_count
    return Target(interpreter, major >= 9, major == 9 and not interpreter, sms)


def leave_sms(target: Target | None, device: torch.device, sm_margin: int) -> Target | None:
    """The target whose kernels leave `sm_margin` multiprocessors free (for communication
    kernels that run beside them: ring attention's transfers); None (q's device) when 0."""
    if sm_margin == 0:
        return target
    base = Target.of(device) if target is None else target
    return dataclasses.replace(base, sms=max(1, base.sms - sm_margin))


# An H100 SXM as a target, for tools and tests that ask what a call would run there from a
# machine without one (`explain(..., target=H100)`).
H100 = Target(interpreter=False, tma=True, gluon=True, sms=132)


def use_tma(target: Target, *tensors: torch.Tensor) -> bool:
    """Whether the kernels can read these (B, N, H, D) tensors through TMA descriptors: the
    target has TMA and every row starts 16-byte aligned, as the copy engine requires, and rows
    do not overlap (an expanded gradient with stride 0 takes the pointer path). Storages from
    torch's allocators are aligned, so the storage offset and the strides decide (also for fake
    tensors while tracing)."""
    if not target.tma:
        return False
    for t in tensors:
        size, d = t.element_size(), t.shape[-1]
        if (t.storage_offset() * size) % 16:
            return False
        for st, n in zip(t.stride()[:-1], t.shape[:-1]):
            if n > 1 and (st < d or (st * size) % 16):
                return False
    return True


@dataclass(frozen=True)
class Problem:
    """One call as the chooser sees it. batch: sequences (of a packed batch too); nq, nk: query
    and key rows per sequence (the longest, packed); causal: a right edge (the causal diagonal
    or a window's right edge, `right`); left >= 0: a window's left edge; softcap: the cap of the
    scores (0.0: none);
    packed: `flash_attn_varlen`; empty: nothing to compute (no sequence, or no rows);
    head_dim: q's and k's head dim; head_dim_v: v's (and o's, do's), which may differ;
    tma_q / tma_kv / tma_do: TMA can read q, k and v, do (the backward's); deterministic: the
    backward must sum in a fixed order. A KV cache (`flash_attn_with_kvcache`, `KVCache`):
    cache; nk its capacity; var_k: each sequence's length is read on the device; page_size:
    the cache's page size (0: contiguous)."""

    batch: int
    nq: int
    nk: int
    heads: int
    kv_heads: int
    head_dim: int
    head_dim_v: int
    dtype: torch.dtype
    causal: bool
    left: int
    right: int
    softcap: float
    packed: bool
    empty: bool
    tma_q: bool
    tma_kv: bool
    tma_do: bool
    deterministic: bool
    target: Target
    cache: bool = False
    var_k: bool = False
    page_size: int = 0

    @property
    def block_d(self) -> int:
        return block_d_for(self.head_dim)

    @property
    def block_dv(self) -> int:
        """The value head dim the kernels compute with (v, o, do, dv)."""
        return block_d_for(self.head_dim_v)

    @property
    def block_d_max(self) -> int:
        """The larger of BLOCK_D and BLOCK_DV: what the tile tables are read by (shared memory
        and registers grow with both)."""
        return max(self.block_d, self.block_dv)

    @property
    def local(self) -> bool:
        """A window's left edge."""
        return self.left >= 0

    @property
    def masked(self) -> bool:
        """More masked code in the forward: a window's left edge, or per-sequence lengths."""
        return self.local or self.packed

    @property
    def half(self) -> bool:
        return self.dtype != torch.float32

    @staticmethod
    def of(q, k, v, causal: bool, window=(-1, -1), softcap: float = 0.0,
           varlen: Varlen | None = None, do=None, deterministic: bool = True,
           target: Target | None = None) -> Problem:  # fmt: skip
        """The problem of a call on q, k, v (4-D dense, or 3-D packed with `varlen`), window
        (left, right) as `validation.window_for` returns it; `do` for a backward."""
        target = target or Target.of(q.device)
        left, right = window
        if varlen is None:
            batch, nq, heads = q.shape[:3]
            nk, kv_heads = k.shape[1], k.shape[2]
            empty = batch == 0
        else:
            (batch, nq, nk), heads, kv_heads = varlen.sizes, q.shape[1], k.shape[1]
            empty = q.shape[0] == 0 or k.shape[0] == 0
        return Problem(
            batch=batch, nq=nq, nk=nk, heads=heads, kv_heads=kv_heads,
            head_dim=int(q.shape[-1]), head_dim_v=int(v.shape[-1]), dtype=q.dtype,
            causal=causal or right >= 0, left=left, right=0 if causal else max(right, 0),
            softcap=max(float(softcap), 0.0), packed=varlen is not None, empty=bool(empty),
            tma_q=use_tma(target, q), tma_kv=use_tma(target, k, v),
            tma_do=do is not None and use_tma(target, do), deterministic=deterministic,
            target=target,
        )  # fmt: skip

    @staticmethod
    def of_cache(q, k_cache, v_cache, cache: KVCache, causal: bool, window=(-1, -1),
                 softcap: float = 0.0, target: Target | None = None) -> Problem:  # fmt: skip
        """The problem of a `flash_attn_with_kvcache` forward: q (B, Nq, H, D) against `cache`
        held in k_cache, v_cache (as `KVCache` describes them), window as `window_for` returns
        it for (Nq, the capacity). TMA reads a paged cache only where its pages are whole
        rows of one (pages x page_size) matrix (page stride = page_size x row stride)."""
        target = target or Target.of(q.device)
        left, right = window
        batch, nq, heads = q.shape[:3]
        tma_kv = use_tma(target, k_cache, v_cache)
        if cache.table is not None:
            tma_kv = tma_kv and all(
                t.stride(0) == cache.page_size * t.stride(1) for t in (k_cache, v_cache)
            )
        return Problem(
            batch=batch, nq=nq, nk=cache.capacity if cache.seqlens is not None else cache.keys,
            heads=heads, kv_heads=k_cache.shape[2], head_dim=int(q.shape[-1]),
            head_dim_v=int(v_cache.shape[-1]), dtype=q.dtype,
            causal=causal or right >= 0, left=left, right=0 if causal else max(right, 0),
            softcap=max(float(softcap), 0.0), packed=False, empty=batch == 0, tma_q=use_tma(target, q),
            tma_kv=tma_kv, tma_do=False, deterministic=True, target=target, cache=True,
            var_k=cache.seqlens is not None, page_size=cache.page_size,
        )  # fmt: skip


@dataclass(frozen=True)
class KVCache:
    """A KV cache as `flash_attn_with_kvcache` reads it. Contiguous: K/V (B, S, Hkv, D),
    table None, page_size 0; paged: K/V (pages, page_size, Hkv, D) and table, the (B,
    max_blocks) int32 block table (key j of sequence b is row j % page_size of page
    table[b, j // page_size]). seqlens: each sequence's cache length (B,) int32 on the device,
    before the append, or None: every sequence holds `length` keys. n_new: the rows appended
    by this call (written at each sequence's length first). capacity: S, or max_blocks x
    page_size."""

    seqlens: torch.Tensor | None
    length: int
    n_new: int
    table: torch.Tensor | None
    page_size: int
    capacity: int

    @property
    def keys(self) -> int:
        """The kernels' key count: n_new on top of each sequence's length (seqlens), or the
        length every sequence has after the append."""
        return self.n_new if self.seqlens is not None else self.length + self.n_new


@dataclass(frozen=True)
class Varlen:
    """A packed batch (`flash_attn_varlen`): q (total_q, H, D), k/v (total_k, Hkv, D), sequence
    b being rows cu_q[b]:cu_q[b + 1] of q and cu_k[b]:cu_k[b + 1] of k/v (int32 prefix sums, on
    q's device); max_q, max_k bound the sequence lengths (they size the grid). seqused_k: None,
    or int32 (sequences,) on q's device: sequence b attends to only the first seqused_k[b] of
    its keys (the kernels' SEQUSED), the rest get zero gradients."""

    cu_q: torch.Tensor
    cu_k: torch.Tensor
    max_q: int
    max_k: int
    seqused_k: torch.Tensor | None = None

    @property
    def sizes(self) -> tuple[int, int, int]:
        """(sequences, max_q, max_k): `Problem.of`'s `packed`."""
        return self.cu_q.shape[0] - 1, self.max_q, self.max_k


@dataclass(frozen=True)
class Scores:
    """How the kernels form scores in log2 units: q.k * qk_scale, or with a cap
    tanh(q.k * cap_scale) * qk_scale; softcap (the SOFTCAP constexpr): 0 off, 1 exact tanh,
    2 tanh.approx; sm_scale: the softmax scale itself (the backward's dq and dk); row_shift:
    with a cap, the value a forward with `FwdConfig.fixed_shift` subtracts from every score
    (`fixed_row_shift`)."""

    qk_scale: float
    cap_scale: float
    softcap: int
    sm_scale: float
    row_shift: float = 0.0

    @staticmethod
    def of(scale: float, softcap: float, fast_tanh: bool) -> Scores:
        if not softcap:
            return Scores(scale * LOG2E, 0.0, 0, scale)
        qk_scale = softcap * LOG2E
        return Scores(qk_scale, scale / softcap, 2 if fast_tanh else 1, scale,
                      fixed_row_shift(qk_scale))  # fmt: skip


# A capped score lies in [-qk_scale, qk_scale] (log2 units), so a forward may subtract one fixed
# value from every score instead of each row's running maximum (`FwdConfig.fixed_shift`): no
# row maxima, no rescaling of the accumulator. Its weights p = exp2(score - shift) then stay in
# [2^SHIFT_P_MIN_LOG2, 2^SHIFT_P_MAX_LOG2]: far from float32's (and bfloat16's) underflow, so
# that p and the products p * v stay normal numbers for |v| >= 2^-26, and far from overflow,
# so that the row sums and the accumulator stay finite for keys * |v| < 2^68. float16 holds p
# in the P.V product and spans too few powers of two for that: it keeps the running maximum.
SHIFT_P_MIN_LOG2 = -100.0
SHIFT_P_MAX_LOG2 = 60.0
# The largest cap (log2 units) whose scores fit that range: 80, a softcap of 55.4.
SHIFT_MAX_QK_SCALE = (SHIFT_P_MAX_LOG2 - SHIFT_P_MIN_LOG2) / 2


def fixed_shift_unfit(p: Problem) -> str | None:
    """Why a forward of `p` cannot shift its scores by `fixed_row_shift`, or None."""
    if not p.softcap:
        return "fixed_shift needs capped scores (softcap)"
    if p.dtype == torch.float16:
        return "fixed_shift: float16 weights span too few powers of two"
    if p.softcap * LOG2E > SHIFT_MAX_QK_SCALE:
        return f"fixed_shift: softcap {p.softcap} above {SHIFT_MAX_QK_SCALE / LOG2E:.2f}"
    return None


def fixed_row_shift(qk_scale: float) -> float:
    """The fixed shift for scores in [-qk_scale, qk_scale] (qk_scale <= SHIFT_MAX_QK_SCALE):
    the largest score itself (its weight 1), lowered where the smallest weight would fall
    below 2^SHIFT_P_MIN_LOG2."""
    return min(qk_scale, -SHIFT_P_MIN_LOG2 - qk_scale)


# ---------------------------------------------------------------------------------------------
# Configs
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Tile:
    """One kernel's tile: BLOCK_M query rows x BLOCK_N keys, warps, pipeline stages; tma: the
    loop's tiles through TMA descriptors where the inputs allow it (a table's wish: the config's
    own `tma` fields say what runs)."""

    block_m: int
    block_n: int
    warps: int
    stages: int
    tma: bool = False

    def __str__(self) -> str:
        return f"{self.block_m}x{self.block_n} w{self.warps} s{self.stages}"


@dataclass(frozen=True)
class Split:
    """Split-KV: `splits` runs of `split_len` keys (a multiple of BLOCK_N; the last may be
    shorter), the first from key `start` (a block boundary: keys before it are outside every
    window); the merge takes `combine_rows` packed rows per program. One split (`direct`)
    writes o and the LSE itself: no partials, no merge launch."""

    splits: int
    split_len: int
    start: int = 0
    combine_rows: int = 16

    @property
    def direct(self) -> bool:
        return self.splits == 1


# The forward's kernels.
FWD_TRITON = "triton"  # triton/fwd.py: FlashAttention-2, any mask, packed batches
FWD_SPLIT = "split-kv"  # triton/split_kv.py: keys split across programs (decoding)
FWD_GLUON = "gluon"  # gluon/fwd.py: FlashAttention-3's schedule, Hopper
# The backward's dk/dv kernel and where dq is summed.
BWD_TRITON = "triton"  # triton/bwd.py: dk/dv kernel
BWD_GLUON = "gluon"  # gluon/bwd.py: dk/dv kernel, Hopper
DQ_KERNEL = 0  # the dq kernel (triton/bwd.py) beside the dk/dv one
DQ_ANY_ORDER = 1  # summed in the Gluon dk/dv kernel, in any order
DQ_ORDERED = 2  # summed in the Gluon dk/dv kernel, key block after key block


@dataclass(frozen=True)
class FwdConfig:
    """Every decision of a forward. kernel: FWD_TRITON, FWD_SPLIT or FWD_GLUON; tile; tma: K/V
    (and, Gluon, q) through TMA descriptors; fast_tanh: softcap through tanh.approx.f32 (else
    an exact float32 tanh); fixed_shift: capped scores shifted by `Scores.row_shift` instead of
    each row's running maximum (FWD_TRITON, FWD_GLUON); split: the split-KV runs (FWD_SPLIT).
    Gluon schedule: persistent (one program per SM walking its share of the tiles), pairs
    (causal tiles in pairs of a long and a short query block), q_regs (the q tile in registers
    as the wgmma's A operand), dynamic (persistent programs take their next unit from an
    atomic counter instead of a fixed stride). why: one line on why this was chosen (not
    compared)."""

    kernel: str
    tile: Tile
    tma: bool
    fast_tanh: bool = False
    split: Split | None = None
    persistent: bool = False
    pairs: bool = False
    q_regs: bool = False
    dynamic: bool = False
    fixed_shift: bool = False
    why: str = field(default="", compare=False)

    def __str__(self) -> str:
        flags = [
            n
            for n in ("tma", "fast_tanh", "fixed_shift", "persistent", "pairs", "q_regs", "dynamic")
            if getattr(self, n)
        ]
        if self.split is not None:
            flags.append(f"splits={self.split.splits}x{self.split.split_len}")
            if self.split.direct:
                flags.append("direct")
        return f"{self.kernel} {self.tile}" + "".join(f" {f}" for f in flags)


@dataclass(frozen=True)
class BwdConfig:
    """Every decision of a backward. kernel: the dk/dv kernel, BWD_TRITON or BWD_GLUON, with
    tile `dkdv` (BLOCK_N keys held, BLOCK_M query rows per step) and `dkdv_tma` (q, do through
    TMA); dq_mode: DQ_KERNEL (the dq kernel with tile `dq` and `dq_tma`, K/V through TMA),
    DQ_ANY_ORDER or DQ_ORDERED (summed in the Gluon kernel; `dq` None); pad_rows: the row
    vectors padded to ROW_PAD (no row checks); peel_tail: a ragged loop's last block checked
    on its own; fast_tanh as in FwdConfig. Gluon schedule: kv_regs (K and V in registers),
    persistent (one program per SM), dynamic (persistent programs take their next tile from an
    atomic counter instead of by program id), tile_heads ((batch, kv head)s per tile group; negative:
    each group from its last key block down), dq_halves (dq summed in the kernel by the two
    consumer warpgroups, each computing half of its columns from both halves of dS, instead of
    by a dq warpgroup)."""

    kernel: str
    dkdv: Tile
    dkdv_tma: bool
    dq_mode: int
    dq: Tile | None
    dq_tma: bool
    pad_rows: bool
    peel_tail: bool = True
    fast_tanh: bool = False
    kv_regs: bool = False
    persistent: bool = False
    tile_heads: int = 0
    dq_halves: bool = False
    dynamic: bool = False
    why: str = field(default="", compare=False)

    def __str__(self) -> str:
        dq = {DQ_KERNEL: f"dq {self.dq}" + (" tma" if self.dq_tma else ""),
              DQ_ANY_ORDER: "dq summed in any order", DQ_ORDERED: "dq summed in order"}  # fmt: skip
        flags = [n for n in ("pad_rows", "peel_tail", "fast_tanh", "kv_regs", "persistent",
                             "dynamic", "dq_halves") if getattr(self, n)]  # fmt: skip
        if self.kernel == BWD_GLUON:
            flags.append(f"tile_heads={self.tile_heads}")
        tma = " tma" if self.dkdv_tma else ""
        return f"{self.kernel} {self.dkdv}{tma}, {dq[self.dq_mode]}; " + " ".join(flags)
