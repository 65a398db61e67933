"""The host path of flash-attn's ops: `forward` and `backward` describe the call (`Problem`),
take its config (chosen once by `choose.py`, or passed in and checked), allocate the outputs and
the backward's row vectors, and hand the launches to the backend modules (`triton/`, `gluon/`).

Launch sequences are recorded once per layout and replayed (`kernelkit.shared.replay`): the key
is the tensors' layout (a packed batch's cu_seqlens and seqused_k, or its absence, among them)
and the call's options (direction, causal, scale, softcap, window, a packed batch's max
lengths, deterministic) and whether the interpreter runs; everything the chooser reads is in
it."""

from __future__ import annotations

import math

import torch

from kernelkit.shared import replay
from kernelkit.shared.runtime import cdiv, interpreting

from .choose import check_bwd, check_fwd, choose_bwd, choose_fwd
from .config import (
    BWD_GLUON,
    DQ_KERNEL,
    FWD_GLUON,
    FWD_SPLIT,
    PREPROCESS_BLOCK_M,
    ROW_PAD,
    BwdConfig,
    FwdConfig,
    Problem,
    Scores,
    Target,
    Varlen,
    leave_sms,
)
from .gluon import bwd as gluon_bwd
from .gluon import fwd as gluon_fwd
from .strides import tma_allocator, unit_d
from .tables import INTERPRETER_FWD
from .triton import bwd as triton_bwd
from .triton import fwd as triton_fwd
from .triton import split_kv as triton_split_kv

__all__ = [
    "backward",
    "backward_problem",
    "backward_recorded",
    "forward",
    "forward_problem",
    "forward_recorded",
]


def forward_problem(q, k, v, causal, softcap=0.0, window=(-1, -1), varlen=None,
                    target: Target | None = None) -> Problem:  # fmt: skip
    """The `Problem` of a forward (q, k, v as the kernels read them: `unit_d`)."""
    return Problem.of(q, k, v, causal, window, softcap, varlen, target=target)


def backward_problem(do, q, k, v, causal, softcap=0.0, window=(-1, -1), varlen=None,
                     deterministic=True, target: Target | None = None) -> Problem:  # fmt: skip
    """The `Problem` of a backward (do, q, k, v as the kernels read them: `unit_d`)."""
    return Problem.of(q, k, v, causal, window, softcap, varlen, do, deterministic, target)


# ---------------------------------------------------------------------------------------------
# Forward
# ---------------------------------------------------------------------------------------------


def forward(q, k, v, causal: bool, scale: float, *, softcap: float = 0.0,
            window: tuple[int, int] = (-1, -1), varlen: Varlen | None = None,
            config: FwdConfig | None = None, sm_margin: int = 0):  # fmt: skip
    """(o, lse) for 4-D q (B, Nq, H, D), k (B, Nk, Hkv, D), v (B, Nk, Hkv, Dv) (Dv may differ
    from D; o has it); launches only (no autograd).
    softcap > 0 caps the scores (softcap * tanh(s / softcap)); window (left, right) as
    `validation.window_for` returns it. With `varlen`: packed q (total_q, H, D), k/v
    (total_k, Hkv, D / Dv), o (total_q, H, Dv) and lse (H, total_q). Without `config` the chooser decides and
    the launches are replayed per layout; a `config` runs as given (a ValueError if its kernel
    cannot run this call). sm_margin: multiprocessors the kernels leave free (`leave_sms`)."""
    target = leave_sms(None, q.device, sm_margin) if sm_margin else None  # None: q's device
    if config is None:
        inputs, sizes = (q, k, v), None
        if varlen is not None:
            inputs = (q, k, v, varlen.cu_q, varlen.cu_k, varlen.seqused_k)
            sizes = varlen.max_q, varlen.max_k
        options = ("fwd", causal, scale, softcap, window, sizes, sm_margin, interpreting())
        return replay.replayed(_forward, inputs, options, q, k, v, causal, scale, softcap,
                               window, varlen, None, target)  # fmt: skip
    return _forward(replay.DIRECT, q, k, v, causal, scale, softcap, window, varlen, config,
                    target)  # fmt: skip


def forward_recorded(q, k, v, causal: bool, scale: float, softcap: float,
                     window: tuple[int, int], sm_margin: int):  # fmt: skip
    """The sequence `forward(q, k, v, ...)` (dense, no config) replays for this call: run it
    as `seq((q, k, v))`, which returns (o, lse); None where there is none (not called yet, or
    not replayable)."""
    options = ("fwd", causal, scale, softcap, window, None, sm_margin, interpreting())
    return replay.recorded(_forward, (q, k, v), options)


def _forward(ops, q, k, v, causal, scale, softcap, window, varlen, config, target=None):
    """`forward` with its allocations and launches through `ops` (`replay`); config None: the
    chooser's, for `target` (None: q's device)."""
    q, k, v = unit_d(q), unit_d(k), unit_d(v)
    p = forward_problem(q, k, v, causal, softcap, window, varlen, target)
    cfg = choose_fwd(p) if config is None else check_fwd(p, config)
    d = p.head_dim_v  # o has v's head dim
    if varlen is None:
        o = ops.empty((p.batch, p.nq, p.heads, d), q.dtype, q.device)
        lse = ops.empty((p.batch, p.heads, p.nq), torch.float32, q.device)
    else:
        o = ops.empty((q.shape[0], p.heads, d), q.dtype, q.device)
        lse = ops.empty((p.heads, q.shape[0]), torch.float32, q.device)
    if p.empty:
        if varlen is not None:  # no rows, or rows that see no key
            ops.unplannable()
            o.zero_(), lse.fill_(-math.inf)
        return o, lse
    tma_allocator(ops, q.device)
    s = Scores.of(scale, softcap, cfg.fast_tanh)
    if cfg.kernel == FWD_SPLIT:
        triton_split_kv.launch(ops, p, cfg, s, q, k, v, o, lse)
    elif cfg.kernel == FWD_GLUON:
        gluon_fwd.launch(ops, p, cfg, s, q, k, v, o, lse)
    else:
        triton_fwd.launch(ops, p, cfg, s, q, k, v, o, lse, varlen)
    return o, lse


# ---------------------------------------------------------------------------------------------
# Backward
# ---------------------------------------------------------------------------------------------


def backward(do, q, k, v, o, lse, dlse, causal: bool, scale: float, *, softcap: float = 0.0,
             window: tuple[int, int] = (-1, -1), varlen: Varlen | None = None,
             deterministic: bool = True, config: BwdConfig | None = None,
             sm_margin: int = 0):  # fmt: skip
    """(dq, dk, dv) from the saved q, k, v, o, lse; dlse (or None) is the LSE's gradient.
    Layouts as in `forward`; without a `config` the launches are replayed per layout.
    deterministic=False lets the chooser sum dq in any order where that measured faster; every
    other path is deterministic either way. sm_margin: as in `forward`."""
    target = leave_sms(None, q.device, sm_margin) if sm_margin else None  # None: q's device
    if config is None:
        inputs, sizes = (do, q, k, v, o, lse, dlse), None
        if varlen is not None:
            inputs = (*inputs, varlen.cu_q, varlen.cu_k, varlen.seqused_k)
            sizes = varlen.max_q, varlen.max_k
        options = ("bwd", causal, scale, softcap, window, sizes, deterministic, sm_margin,
                   interpreting())  # fmt: skip
        return replay.replayed(_backward, inputs, options, do, q, k, v, o, lse, dlse, causal,
                               scale, softcap, window, varlen, deterministic, None,
                               target)  # fmt: skip
    return _backward(replay.DIRECT, do, q, k, v, o, lse, dlse, causal, scale, softcap, window,
                     varlen, deterministic, config, target)  # fmt: skip


def backward_recorded(do, q, k, v, o, lse, dlse, causal: bool, scale: float, softcap: float,
                      window: tuple[int, int], deterministic: bool, sm_margin: int):  # fmt: skip
    """The sequence `backward(do, q, ...)` (dense, no config) replays for this call: run it as
    `seq((do, q, k, v, o, lse, dlse))`, which returns (dq, dk, dv); None where there is none
    (not called yet, or not replayable)."""
    options = ("bwd", causal, scale, softcap, window, None, deterministic, sm_margin,
               interpreting())  # fmt: skip
    return replay.recorded(_backward, (do, q, k, v, o, lse, dlse), options)


def _backward(ops, do, q, k, v, o, lse, dlse, causal, scale, softcap, window, varlen,
              deterministic, config, target=None):  # fmt: skip
    """`backward` with its allocations and launches through `ops` (`replay`)."""
    do, q, k, v, o = (unit_d(t) for t in (do, q, k, v, o))
    p = backward_problem(do, q, k, v, causal, softcap, window, varlen, deterministic, target)
    cfg = choose_bwd(p) if config is None else check_bwd(p, config)
    dq = ops.empty(q.shape, q.dtype, q.device)
    dk = ops.empty(k.shape, k.dtype, k.device)
    dv = ops.empty(v.shape, v.dtype, v.device)
    if p.empty:
        if varlen is not None:
            ops.unplannable()
            dq.zero_(), dk.zero_(), dv.zero_()
        return dq, dk, dv
    tma_allocator(ops, q.device)
    s = Scores.of(scale, softcap, cfg.fast_tanh)
    lse = lse.contiguous()
    # The row vectors the dk/dv and dq kernels read: with `pad_rows`, lse2 (the LSE in log2
    # units) and delta, each (B, H, Nq rounded up to ROW_PAD) or (1, H, total_q + (ROW_PAD + 16)
    # * B rounded up to 16) for a packed batch (triton/bwd.py, _rowvec_start); else the LSE
    # itself and a delta like it, (1, H, total_q) packed.
    rows = q.shape[0] if varlen is not None else p.nq
    if not cfg.pad_rows:
        width = rows
    elif varlen is None:
        width = cdiv(p.nq, ROW_PAD) * ROW_PAD
    else:
        width = cdiv(rows + (ROW_PAD + 16) * p.batch, 16) * 16
    rows_b = 1 if varlen is not None else p.batch
    delta = ops.empty((rows_b, p.heads, width), torch.float32, q.device)
    lse2 = ops.empty((rows_b, p.heads, width), torch.float32, q.device) if cfg.pad_rows else lse
    dq_acc = sem = None
    if cfg.dq_mode != DQ_KERNEL:  # the float32 dq sums and their semaphores (zeroed)
        dq_acc = ops.empty((p.batch * p.heads, width, p.block_d), torch.float32, q.device)
        sem_rows = triton_bwd.SEM_ROWS.value
        sem = ops.empty((p.batch * p.heads, width // sem_rows), torch.int32, q.device)
    pre_m = INTERPRETER_FWD.block_m if p.target.interpreter else PREPROCESS_BLOCK_M
    # Softcap on the Gluon kernel: P's 2^15 folded into its row vectors (gluon/bwd.py).
    scaled = gluon_bwd.scaled_rows(cfg, s) if cfg.kernel == BWD_GLUON else None
    triton_bwd.launch_preprocess(ops, p, cfg, o, do, lse, None if dlse is None else dlse.contiguous(),
                                 lse2, delta, dq_acc, sem, varlen, pre_m, scaled)  # fmt: skip
    if cfg.kernel == BWD_GLUON:
        gluon_bwd.launch(ops, p, cfg, s, q, k, v, do, lse2, delta, dk, dv, dq_acc, sem, width,
                         triton_bwd.SEM_ROWS.value, scaled is not None)  # fmt: skip
    else:
        triton_bwd.launch_dkdv(ops, p, cfg, s, q, k, v, do, lse2, delta, dk, dv, varlen)
    if cfg.dq_mode == DQ_KERNEL:
        triton_bwd.launch_dq(ops, p, cfg, s, q, k, v, do, lse2, delta, dq, varlen)
    else:
        triton_bwd.launch_dq_convert(ops, p, dq_acc, dq, width, PREPROCESS_BLOCK_M)
    return dq, dk, dv
