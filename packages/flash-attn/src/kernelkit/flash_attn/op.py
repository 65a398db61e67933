"""torch.library registration, autograd and the public functions of flash-attn: `flash_attn`,
`flash_attn_varlen`, `explain` and their ops.

The fallback convention of every kernelkit op: the public function validates, then
`if not use_triton(q):` returns the PyTorch reference (traced inline by torch.compile; the packed
reference, whose shapes depend on cu_seqlens' values, runs as opaque ops that torch.compile
calls as they are), and otherwise calls the registered ops, which only launch kernels."""

from __future__ import annotations

import torch

from kernelkit.shared import replay, runtime
from kernelkit.shared.runtime import (
    define_op,
    define_opaque_op,
    function_apply,
    interpreting,
    plain_call,
    traced,
    use_triton,
)

from . import families
from .config import Target, Varlen, leave_sms
from .launch import backward, backward_recorded, forward, forward_recorded
from .reference import (
    attention_reference,
    attention_reference_grads,
    attention_varlen_reference,
    attention_varlen_reference_grads,
)
from .validation import (
    NO_WINDOW,
    check_bool,
    check_sm_margin,
    check_softcap,
    plain_options,
    validate,
    validate_stats,
    validate_varlen,
    window_for,
)

# ---------------------------------------------------------------------------------------------
# Registered ops
# ---------------------------------------------------------------------------------------------


# A traced call (torch.compile, export) whose config launches a Gluon kernel, which Inductor
# cannot compile (`families.opaque`), goes to the op's opaque twin (`define_op`'s `fake`),
# which torch.compile calls as it is and which runs the same body on real tensors: the same
# kernels as an eager call. Elsewhere Inductor sees the Triton kernels. The fakes record the
# launches instead of running them (`families.probe_*`).


def _fwd_probe(q, k, v, causal, scale, softcap=0.0, window_left=-1, window_right=-1,
               deterministic=True, sm_margin=0):  # fmt: skip
    window = (window_left, window_right)
    target = leave_sms(None, q.device, sm_margin)
    return families.probe_forward(q, k, v, causal, scale, softcap, window, target=target)


def _bwd_probe(do, q, k, v, o, lse, dlse, causal, scale, softcap=0.0, window_left=-1,
               window_right=-1, deterministic=True, sm_margin=0):  # fmt: skip
    window = (window_left, window_right)
    target = leave_sms(None, q.device, sm_margin)
    return families.probe_backward(do, q, k, v, o, lse, dlse, causal, scale, softcap, window,
                                   None, deterministic, target)  # fmt: skip


def _varlen_fwd_probe(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_k, max_seqlen_q,
                      max_seqlen_k, causal, scale, softcap=0.0, window_left=-1,
                      window_right=-1):  # fmt: skip
    varlen = Varlen(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_k)
    window = (window_left, window_right)
    return families.probe_forward(q, k, v, causal, scale, softcap, window, varlen)


def _varlen_bwd_probe(do, q, k, v, o, lse, dlse, cu_seqlens_q, cu_seqlens_k, seqused_k,
                      max_seqlen_q, max_seqlen_k, causal, scale, softcap=0.0, window_left=-1,
                      window_right=-1):  # fmt: skip
    varlen = Varlen(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_k)
    window = (window_left, window_right)
    return families.probe_backward(do, q, k, v, o, lse, dlse, causal, scale, softcap, window,
                                   varlen)  # fmt: skip


def _fake(probe):
    """The fake implementation of an op whose host path `probe` records."""

    def fake(*args):
        return probe(*args).outputs

    return fake


def _opaque(probe, *args) -> bool:
    """Whether a traced call (`probe` over its arguments) goes to the opaque twin."""
    return families.opaque(probe(*args))


@define_op("kernelkit_flash_attn::attn_fwd", fake=_fake(_fwd_probe))
def attn_fwd(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool,
    scale: float,
    softcap: float = 0.0,
    window_left: int = -1,
    window_right: int = -1,
    deterministic: bool = True,  # (the backward's: passed on to attn_bwd)
    sm_margin: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    if traced(q):
        args = (q, k, v, causal, scale, softcap, window_left, window_right, deterministic,
                sm_margin)  # fmt: skip
        if _opaque(_fwd_probe, *args):
            return attn_fwd.opaque(*args)
    window = (window_left, window_right)
    return forward(q, k, v, causal, scale, softcap=softcap, window=window, sm_margin=sm_margin)


@define_op("kernelkit_flash_attn::attn_bwd", fake=_fake(_bwd_probe))
def attn_bwd(
    do: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    o: torch.Tensor,
    lse: torch.Tensor,
    dlse: torch.Tensor | None,
    causal: bool,
    scale: float,
    softcap: float = 0.0,
    window_left: int = -1,
    window_right: int = -1,
    deterministic: bool = True,
    sm_margin: int = 0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    if traced(q):
        args = (do, q, k, v, o, lse, dlse, causal, scale, softcap, window_left, window_right,
                deterministic, sm_margin)  # fmt: skip
        if _opaque(_bwd_probe, *args):
            return attn_bwd.opaque(*args)
    window = (window_left, window_right)
    return backward(do, q, k, v, o, lse, dlse, causal, scale, softcap=softcap, window=window,
                    deterministic=deterministic, sm_margin=sm_margin)  # fmt: skip


def _autograd(bwd_op, n_tensors: int):
    """(backward, setup_context) of a forward op whose first n_tensors inputs are tensors (q, k,
    v, then cu_seqlens and seqused_k, maybe None, for the packed ops) and the rest options: the
    backward op gets (do, q, k, v, o, lse, dlse, *other tensors, *options)."""

    def setup(ctx, inputs, output):
        # The eager path passes only the arguments given (trailing defaults may be missing).
        ctx.options = tuple(inputs[n_tensors:])
        ctx.save_for_backward(*inputs[:3], *output, *inputs[3:n_tensors])
        # An unused output's gradient arrives as None instead of a tensor of zeros.
        ctx.set_materialize_grads(False)

    def backward(ctx, do, dlse):
        q, k, v, o, lse, *tensors = ctx.saved_tensors
        if do is None:
            do = torch.zeros_like(o)
        dq, dk, dv = bwd_op(do, q, k, v, o, lse, dlse, *tensors, *ctx.options)
        return dq, dk, dv, *(None,) * (len(tensors) + len(ctx.options))

    return backward, setup


_backward, _setup = _autograd(attn_bwd, 3)
attn_fwd.register_autograd(_backward, setup_context=_setup)


@define_op("kernelkit_flash_attn::attn_varlen_fwd", fake=_fake(_varlen_fwd_probe))
def attn_varlen_fwd(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    seqused_k: torch.Tensor | None,
    max_seqlen_q: int,
    max_seqlen_k: int,
    causal: bool,
    scale: float,
    softcap: float = 0.0,
    window_left: int = -1,
    window_right: int = -1,
) -> tuple[torch.Tensor, torch.Tensor]:
    if traced(q):
        args = (q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_k, max_seqlen_q, max_seqlen_k,
                causal, scale, softcap, window_left, window_right)  # fmt: skip
        if _opaque(_varlen_fwd_probe, *args):
            return attn_varlen_fwd.opaque(*args)
    window = (window_left, window_right)
    varlen = Varlen(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_k)
    return forward(q, k, v, causal, scale, softcap=softcap, window=window, varlen=varlen)


@define_op("kernelkit_flash_attn::attn_varlen_bwd", fake=_fake(_varlen_bwd_probe))
def attn_varlen_bwd(
    do: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    o: torch.Tensor,
    lse: torch.Tensor,
    dlse: torch.Tensor | None,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    seqused_k: torch.Tensor | None,
    max_seqlen_q: int,
    max_seqlen_k: int,
    causal: bool,
    scale: float,
    softcap: float = 0.0,
    window_left: int = -1,
    window_right: int = -1,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    if traced(q):
        args = (do, q, k, v, o, lse, dlse, cu_seqlens_q, cu_seqlens_k, seqused_k, max_seqlen_q,
                max_seqlen_k, causal, scale, softcap, window_left, window_right)  # fmt: skip
        if _opaque(_varlen_bwd_probe, *args):
            return attn_varlen_bwd.opaque(*args)
    window = (window_left, window_right)
    varlen = Varlen(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_k)
    return backward(do, q, k, v, o, lse, dlse, causal, scale, softcap=softcap, window=window,
                    varlen=varlen)  # fmt: skip


_varlen_backward, _varlen_setup = _autograd(attn_varlen_bwd, 6)
attn_varlen_fwd.register_autograd(_varlen_backward, setup_context=_varlen_setup)


# ---------------------------------------------------------------------------------------------
# The PyTorch reference of a packed batch (tensors `use_triton` turns down): it slices at
# cu_seqlens' values, shapes that depend on data, which torch.compile cannot trace. These ops
# (`define_opaque_op`) are called as they are by torch.compile; the dense reference is traced
# inline.
# ---------------------------------------------------------------------------------------------


def _varlen_reference_fake(q, k, v, cu_seqlens_q, cu_seqlens_k, *options):
    o = q.new_empty((*q.shape[:-1], v.shape[-1]))  # v's head dim
    return o, q.new_empty((q.shape[1], q.shape[0]), dtype=torch.float32)


@define_opaque_op("kernelkit_flash_attn::varlen_reference", fake=_varlen_reference_fake)
def varlen_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    seqused_k: torch.Tensor | None,
    causal: bool,
    scale: float,
    softcap: float,
    window_left: int,
    window_right: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    o, lse = attention_varlen_reference(
        q, k, v, cu_seqlens_q, cu_seqlens_k, causal=causal, softmax_scale=scale,
        window_size=(window_left, window_right), softcap=softcap, return_lse=True,
        seqused_k=seqused_k,
    )  # fmt: skip
    return o, lse.float()


def _varlen_reference_grads_fake(do, q, k, v, *rest):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


@define_opaque_op("kernelkit_flash_attn::varlen_reference_grads",
                  fake=_varlen_reference_grads_fake)  # fmt: skip
def varlen_reference_grads(
    do: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    o: torch.Tensor,
    lse: torch.Tensor,
    dlse: torch.Tensor | None,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    seqused_k: torch.Tensor | None,
    causal: bool,
    scale: float,
    softcap: float,
    window_left: int,
    window_right: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The packed reference's gradients in closed form (`attention_varlen_reference_grads`)."""
    window = (window_left, window_right)
    return attention_varlen_reference_grads(do, q, k, v, cu_seqlens_q, cu_seqlens_k, causal,
                                            scale, dlse, softcap, window,
                                            seqused_k=seqused_k)  # fmt: skip


_reference_backward, _reference_setup = _autograd(varlen_reference_grads, 6)
varlen_reference.register_autograd(_reference_backward, setup_context=_reference_setup)


_T = torch.Tensor
_grad_enabled = torch.is_grad_enabled
# flash_attn's calls that passed its checks, by `_call_key`: (the recorded sequence of the
# forward, attn_fwd's options)
_CALLS = replay.Shortcuts()
# the backwards of shortcut forwards, by `_backward_key`: the recorded sequence, or
# _NOT_RECORDED where the backward has none (a stride-0 do, which it copies, say)
_BACKWARDS = replay.Shortcuts()
_NOT_RECORDED = object()


def _call_key(q, k, v, causal, softmax_scale, return_lse, window_size, softcap, deterministic,
              sm_margin):  # fmt: skip
    """The key of a `flash_attn` call in `_CALLS`: everything its checks (`_prepare`) and the
    forward's replay key read, that is the layout of q, k and v (shapes, strides, dtypes,
    devices, 16-byte alignment, which are one tensor) and every option's value, plus the launch
    function, whether the interpreter runs and, last, whether autograd records the call. None
    (the checked path) for tensor subclasses, traced calls, functorch transforms, and options of
    other types than the plain ones (bool, float or None, a tuple of two ints), whose values
    could compare equal to a valid option's (1 == True) without passing the checks."""
    if (
        q.__class__ is _T
        and k.__class__ is _T
        and v.__class__ is _T
        and deterministic.__class__ is bool
        and sm_margin.__class__ is int
        and plain_options(causal, softmax_scale, window_size, softcap, return_lse)
    ):
        return (
            q.shape, q.stride(), q.dtype, q.device, q.data_ptr() & 15,
            k.shape, k.stride(), k.dtype, k.device, k.data_ptr() & 15,
            v.shape, v.stride(), v.dtype, v.device, v.data_ptr() & 15,
            k is q, v is q, v is k,
            causal, softmax_scale, return_lse, window_size, softcap, deterministic, sm_margin,
            interpreting(), runtime.launch,
            (q.requires_grad or k.requires_grad or v.requires_grad) and _grad_enabled(),
        )  # fmt: skip
    return None


def _backward_key(entry, do, dlse, q, k, v, o, lse):
    """The key of the backward of a shortcut forward in `_BACKWARDS`: the forward's `_CALLS`
    entry (its recorded sequence, which fixes the layouts of q, k, v and the forward's options,
    and attn_fwd's options; o and lse are that sequence's buffers), the layout of do and dlse
    and the alignment of o and lse; None (the checked path) for tensor subclasses, traced
    calls, and a do or dlse that is one of the other tensors."""
    if (
        do.__class__ is _T
        and do is not q
        and do is not k
        and do is not v
        and do is not o
        and do is not lse
        and plain_call()
    ):
        if dlse is None:
            stats = None
        elif dlse.__class__ is _T and all(dlse is not t for t in (do, q, k, v, o, lse)):
            stats = (dlse.shape, dlse.stride(), dlse.dtype, dlse.device, dlse.data_ptr() & 15)
        else:
            return None
        return (
            entry, do.shape, do.stride(), do.dtype, do.device, do.data_ptr() & 15,
            o.data_ptr() & 15, lse.data_ptr() & 15, stats, interpreting(), runtime.launch,
        )  # fmt: skip
    return None


class _ReplayedForward(torch.autograd.Function):
    """attn_fwd's autograd node around a shortcut's sequence: the same saved tensors as attn_fwd's
    own (`_setup`) and its backward, whose sequence is kept too (`_BACKWARDS`): a backward like
    an earlier one runs it at once."""

    @staticmethod
    def forward(ctx, q, k, v, entry):
        seq, options = entry
        output = seq((q, k, v))
        _setup(ctx, (q, k, v, *options), output)
        ctx.entry = entry
        return output

    @staticmethod
    def backward(ctx, do, dlse):
        q, k, v, o, lse = ctx.saved_tensors
        if do is None:
            do = torch.zeros_like(o)
        bkey = _backward_key(ctx.entry, do, dlse, q, k, v, o, lse)
        seq = None if bkey is None else _BACKWARDS._plans.get(bkey)
        if seq is not None and seq is not _NOT_RECORDED:
            return (*seq((do, q, k, v, o, lse, dlse)), None)
        options = ctx.options
        dq, dk, dv = attn_bwd(do, q, k, v, o, lse, dlse, *options)
        if bkey is not None and seq is None:
            causal, scale, softcap, left, right, deterministic, margin = options
            seq = backward_recorded(do, q, k, v, o, lse, dlse, causal, scale, softcap,
                                    (left, right), deterministic, margin)  # fmt: skip
            _BACKWARDS.remember(bkey, _NOT_RECORDED if seq is None else seq)
        return dq, dk, dv, None


# (functorch transforms take the checked path: `plain_options`)
_replayed_forward = function_apply(_ReplayedForward)


def flash_attn(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool = False,
    softmax_scale: float | None = None,
    return_lse: bool = False,
    *,
    window_size: tuple[int, int] = NO_WINDOW,
    softcap: float = 0.0,
    deterministic: bool = True,
    sm_margin: int = 0,
):
    """Exact softmax attention, FlashAttention-2 style (the N x N scores never reach memory).

    q (B, Nq, H, D), k/v (B, Nk, Hkv, D) with H % Hkv == 0 (query head h reads kv head
    h // (H / Hkv)), or 3-D (B, N, D) tensors (one head). float16/bfloat16 (float32 accepted).
    v may have a head dim of its own, Dv (16..256; MLA-style D = 192, Dv = 128): o then has Dv.
    causal: query i sees keys j <= i + Nk - Nq; a row that sees no key outputs zeros.
    Returns o like q (with v's head dim), and with return_lse=True also the natural-log LSE
    (B, H, Nq) float32 ((B, Nq) for 3-D inputs; -inf on rows that see no key).
    window_size=(left, right): sliding-window (local) attention, -1 = unbounded: query i sees
    keys j with i + Nk - Nq - left <= j <= i + Nk - Nq + right; causal=True means right = 0
    (a conflicting right > 0 is a ValueError). Key blocks outside the window are skipped.
    softcap > 0: the scores (q.k * scale) become softcap * tanh(scores / softcap) before the
    softmax (Gemma 2); 0 = off.
    deterministic=True (default): the gradients are bitwise the same from run to run. False:
    where it measured faster (on Hopper, d <= 64 from 16k query rows, 8k causal: 1.02-1.15x
    the backward; `choose.choose_bwd`) dq is summed in any order, so its last bits may vary
    between runs; elsewhere it changes nothing.
    Decoding shapes (few query rows, long key sequences) run a split-KV forward (`choose.split_config`).
    sm_margin: multiprocessors the kernels leave free, forward and backward, for communication
    kernels that run beside them (ring attention's transfers): a persistent kernel holds every
    multiprocessor until it ends, and a transfer launched after it would wait for it.
    """
    # A call like an earlier one that passed the checks replays its sequence at once: the
    # checks and the forward's host path read nothing the key does not hold.
    key = _call_key(q, k, v, causal, softmax_scale, return_lse, window_size, softcap,
                    deterministic, sm_margin)  # fmt: skip
    if key is not None:
        entry = _CALLS._plans.get(key)
        if entry is not None:
            o, lse = _replayed_forward(q, k, v, entry) if key[-1] else entry[0]((q, k, v))
            return (o, lse) if return_lse else o
    check_bool("return_lse", return_lse)
    q0 = q
    q, k, v, args, three_d = _prepare(q, k, v, causal, softmax_scale, window_size, softcap,
                                      deterministic, sm_margin)  # fmt: skip
    if use_triton(q):
        o, lse = attn_fwd(q, k, v, *args)
        if key is not None and q is q0:  # 4-D, q not negated: the call the sequence replays
            causal, scale, softcap, left, right, _, margin = args
            seq = forward_recorded(q, k, v, causal, scale, softcap, (left, right), margin)
            if seq is not None:
                _CALLS.remember(key, (seq, args))
    else:  # the PyTorch reference (CPU tensors without the interpreter)
        causal, scale, softcap, left, right, _, _ = args
        o, lse = attention_reference(q, k, v, causal, scale, return_lse=True, softcap=softcap,
                                     window_size=(left, right))  # fmt: skip
    if three_d:
        o, lse = o.squeeze(2), lse.squeeze(1)
    return (o, lse) if return_lse else o


def flash_attn_backward(
    do: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    o: torch.Tensor,
    lse: torch.Tensor,
    causal: bool = False,
    softmax_scale: float | None = None,
    *,
    dlse: torch.Tensor | None = None,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    deterministic: bool = True,
    sm_margin: int = 0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The gradients (dq, dk, dv) of `flash_attn(q, k, v, ...)` for 4-D q, k, v, given its output
    o and LSE (B, H, Nq) float32 and their gradients do (like o: q with v's head dim) and dlse
    (or None), without autograd: the kernels `flash_attn`'s backward runs.

    o and lse may come from a larger attention that k, v are one block of (ring attention,
    attention split over key blocks and merged by their LSEs): the probabilities are then
    exp(scores - lse) and rowsum(P * dP) = rowsum(do * o), so dq is this block's share of the
    whole dq and dk, dv are this block's gradients. Not differentiable itself. sm_margin: as in
    flash_attn.
    """
    if isinstance(q, torch.Tensor):
        validate_stats(q, do, o, lse, dlse, v)
    q, k, v, args, _ = _prepare(q, k, v, causal, softmax_scale, window_size, softcap,
                                deterministic, sm_margin)  # fmt: skip
    causal, scale, softcap, left, right, det, margin = args
    negated = softmax_scale is not None and softmax_scale < 0  # _prepare negated q
    if use_triton(q):
        dq, dk, dv = attn_bwd(do, q, k, v, o, lse, dlse, causal, scale, softcap, left, right, det,
                              margin)  # fmt: skip
    else:  # the PyTorch reference (CPU tensors without the interpreter)
        dq, dk, dv = attention_reference_grads(do, q, k, v, causal, scale, dlse, softcap,
                                               (left, right), o=o, lse=lse)  # fmt: skip
    return (-dq if negated else dq), dk, dv


def _prepare(q, k, v, causal, softmax_scale, window_size, softcap, deterministic, sm_margin=0):
    """`flash_attn`'s arguments checked and put as `attn_fwd` takes them: 4-D q, k, v,
    (causal, scale, softcap, window_left, window_right, deterministic, sm_margin), and whether q
    was 3-D."""
    scale = validate(q, k, v, causal, softmax_scale)
    softcap = check_softcap(softcap)
    left, right = window_for(window_size, causal, q.shape[1], k.shape[1])
    check_bool("deterministic", deterministic)
    check_sm_margin(sm_margin)
    three_d = q.dim() == 3
    if three_d:
        q, k, v = q.unsqueeze(2), k.unsqueeze(2), v.unsqueeze(2)
    if scale < 0:  # the kernels assume scale >= 0 (max of the raw scores); negate q instead
        q, scale = -q, -scale
    return q, k, v, (causal, scale, softcap, left, right, deterministic, sm_margin), three_d


def explain(q, k, v, causal=False, softmax_scale=None, *, window_size=(-1, -1), softcap=0.0,
            deterministic=True, target: Target | None = None) -> families.Explanation:  # fmt: skip
    """What `flash_attn(q, k, v, causal, softmax_scale, window_size=..., softcap=...,
    deterministic=...)` runs, forward and backward, without launching or reading anything
    (q, k, v may be meta or fake tensors): the config each direction takes with one line on
    why, their kernel families and each launch's grid, tile and schedule. target: the machine
    (None: q's device; `kernelkit.flash_attn.config.H100` for an H100 from anywhere). For bug
    reports and tuning; `print(explain(...))` reads as text."""
    q, k, v, (causal, scale, softcap, left, right, det, _), _ = _prepare(
        q, k, v, causal, softmax_scale, window_size, softcap, deterministic
    )
    window = (left, right)
    fwd = families.probe_forward(q, k, v, causal, scale, softcap, window, target=target)
    o, lse = fwd.outputs
    bwd = families.probe_backward(torch.empty_like(o), q, k, v, o, lse, None, causal, scale,
                                  softcap, window, deterministic=det, target=target)  # fmt: skip
    return families.explanation(fwd, bwd)


def flash_attn_varlen(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    causal: bool = False,
    softmax_scale: float | None = None,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    return_lse: bool = False,
    *,
    seqused_k: torch.Tensor | None = None,
):
    """`flash_attn` over a packed batch of variable-length sequences (no padding).

    q (total_q, H, D), k/v (total_k, Hkv, D) (v may have its own head dim Dv, as in
    `flash_attn`: o then has it); sequence b is rows cu_seqlens_q[b]:cu_seqlens_q[b+1]
    of q and cu_seqlens_k[b]:cu_seqlens_k[b+1] of k/v (int32 prefix sums (num_seqs + 1,) on q's
    device, starting at 0; sequences may be empty); max_seqlen_q/k >= the longest sequence (they
    size the launch). Sequences never see each other; causal and window_size apply per
    sequence, bottom-right aligned (shift = its Nk - Nq). Returns o (total_q, H, Dv) and with
    return_lse=True the LSE (H, total_q) float32. seqused_k (FlashAttention's): None, or int32
    (num_seqs,) on q's device: sequence b attends to only the first seqused_k[b] of its keys
    (<= its cu_seqlens_k length), causal and window_size aligned to that count (shift =
    seqused_k[b] - its Nq); the other keys get zero gradients, and seqused_k[b] = 0 gives zeros
    (LSE -inf). What is validated and what is the caller's contract (cu_seqlens and seqused_k
    values on the GPU): `validate_varlen`.
    """
    scale = validate_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                            causal, softmax_scale, seqused_k)  # fmt: skip
    softcap = check_softcap(softcap)
    check_bool("return_lse", return_lse)
    left, right = window_for(window_size, causal, max_seqlen_q, max_seqlen_k)
    if scale < 0:  # as in flash_attn
        q, scale = -q, -scale
    if use_triton(q):
        o, lse = attn_varlen_fwd(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_k, max_seqlen_q,
                                 max_seqlen_k, causal, scale, softcap, left, right)  # fmt: skip
    else:  # the PyTorch reference (CPU tensors without the interpreter)
        o, lse = varlen_reference(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_k, causal, scale,
                                  softcap, left, right)  # fmt: skip
    return (o, lse) if return_lse else o


__all__ = [
    "attn_bwd",
    "attn_fwd",
    "attn_varlen_bwd",
    "attn_varlen_fwd",
    "explain",
    "flash_attn",
    "flash_attn_backward",
    "flash_attn_varlen",
]
