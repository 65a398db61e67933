"""Attention over a KV cache for serving: `flash_attn_with_kvcache`, FlashAttention's function
of that name, with a contiguous or paged cache and the new rows appended in place; its argument
checks, its op and its host path.

A call is at most two launches: the append (`triton/kv_append.py`, when k and v are given) and
the split-KV forward (`triton/split_kv.py`) reading each sequence's length and pages on the
device, so a decode step captured in a CUDA graph replays with new `cache_seqlens` and block
tables. The launches are recorded once per layout and replayed (`kernelkit.shared.replay`).
"""

from __future__ import annotations

import torch

from kernelkit.shared import replay, runtime
from kernelkit.shared.runtime import define_op, interpreting, traced, use_triton

from .choose import check_fwd, choose_fwd
from .config import FwdConfig, KVCache, Problem, Scores, Target
from .reference import attention_kvcache_reference, kvcache_append_reference
from .strides import tma_allocator, unit_d
from .triton import kv_append
from .triton import split_kv as triton_split_kv
from .validation import (
    FLOAT_DTYPES,
    MAX_HEAD_DIM,
    MIN_HEAD_DIM,
    NO_WINDOW,
    _check_heads,
    _check_scale,
    check_bool,
    check_softcap,
    plain_options,
    window_for,
)

# A paged cache's page size: a multiple of this many rows.
PAGE_MULTIPLE = 16

__all__ = [
    "attn_kvcache_fwd",
    "flash_attn_with_kvcache",
    "kvcache_forward",
    "kvcache_recorded",
    "validate_kvcache",
]


# ---------------------------------------------------------------------------------------------
# Argument checks
# ---------------------------------------------------------------------------------------------


def _tensor(name: str, t, dims: int, layout: str) -> None:
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if t.dim() != dims:
        raise ValueError(f"{name}: expected shape {layout}, got {tuple(t.shape)}")


def _like(name: str, t: torch.Tensor, q: torch.Tensor, dtype: torch.dtype) -> None:
    if t.dtype != dtype:
        raise ValueError(f"{name}: dtype {t.dtype}, expected {dtype}")
    if t.device != q.device:
        raise ValueError(f"{name}: on device {t.device}, but q is on {q.device}")


def _free_to_read(t: torch.Tensor) -> bool:
    """Whether reading t's values costs no device sync: a CPU tensor outside tracing."""
    return t.device.type == "cpu" and not traced(t) and not torch.compiler.is_compiling()


def _check_pages(table, seqlens, keys: int, page_size: int, pages: int) -> None:
    """The block table's entries for the pages in use (those holding keys < the sequence's
    length after the append) are page indices; entries past them are never read."""
    lengths = table.new_full((table.shape[0],), keys) if seqlens is None else seqlens + keys
    used = torch.arange(table.shape[1])[None, :] * page_size < lengths[:, None]
    ids = table[used]
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= pages):
        raise ValueError(f"block_table: the pages in use must be indices in 0..{pages - 1}, got "
                         f"{int(ids.min())}..{int(ids.max())}")  # fmt: skip


_T = torch.Tensor


def _common_call(q, k_cache, v_cache, k, v, seqlens, table) -> tuple[int, int, int] | None:
    """(page_size, capacity, Nnew) of the common serving call where it passes every check of
    `_check_structure` (types, shapes, dtypes, devices, strides), tested in one expression:
    plain tensors, an int32 cache_seqlens tensor, a contiguous or paged cache, k and v both or
    neither. None for anything else (tensor subclasses and traced calls too), which takes the
    checks one by one: they raise the error that names the argument."""
    if not (q.__class__ is _T and k_cache.__class__ is _T and v_cache.__class__ is _T
            and seqlens.__class__ is _T):  # fmt: skip
        return None
    qs, ks, vs, ss = q.shape, k_cache.shape, v_cache.shape, seqlens.shape
    if not (len(qs) == 4 and len(ks) == 4 and len(vs) == 4 and len(ss) == 1):
        return None
    batch, nq, heads, d = qs
    hkv, dv, dtype, device = ks[2], vs[3], q.dtype, q.device
    if not (
        dtype in FLOAT_DTYPES
        and nq >= 1
        and MIN_HEAD_DIM <= d <= MAX_HEAD_DIM
        and MIN_HEAD_DIM <= dv <= MAX_HEAD_DIM
        and ks[3] == d
        and vs[0] == ks[0]
        and vs[1] == ks[1]
        and vs[2] == hkv
        and hkv >= 1
        and heads >= 1
        and heads % hkv == 0
        and k_cache.dtype == dtype
        and v_cache.dtype == dtype
        and k_cache.device == device
        and v_cache.device == device
        and k_cache.stride(3) == 1
        and v_cache.stride(3) == 1
        and seqlens.dtype == torch.int32
        and ss[0] == batch
        and seqlens.device == device
        and (batch <= 1 or seqlens.stride(0) == 1)
    ):
        return None
    if table is None:
        if ks[0] != batch:
            return None
        page_size, capacity = 0, ks[1]
    else:
        page_size = ks[1]
        if not (
            table.__class__ is _T
            and table.dim() == 2
            and table.dtype == torch.int32
            and table.device == device
            and table.shape[0] == batch
            and (table.shape[1] <= 1 or table.stride(1) == 1)
            and page_size % PAGE_MULTIPLE == 0
            and page_size > 0
        ):
            return None
        capacity = table.shape[1] * page_size
    if k is None and v is None:
        return page_size, capacity, 0
    if not (k.__class__ is _T and v.__class__ is _T):
        return None
    kn, vn = k.shape, v.shape
    if (
        len(kn) == 4
        and len(vn) == 4
        and kn[0] == batch
        and vn[0] == batch
        and vn[1] == kn[1]
        and kn[2] == hkv
        and vn[2] == hkv
        and kn[3] == d
        and vn[3] == dv
        and k.dtype == dtype
        and v.dtype == dtype
        and k.device == device
        and v.device == device
    ):
        return page_size, capacity, kn[1]
    return None


def _check_structure(q, k_cache, v_cache, k, v, cache_seqlens, block_table) -> tuple[int, int, int]:
    """`validate_kvcache`'s checks on types, shapes, dtypes, devices and strides, one by one
    (each error names its argument); returns (page_size, capacity, Nnew)."""
    _tensor("q", q, 4, "(B, Nq, H, D)")
    if q.dtype not in FLOAT_DTYPES:
        raise ValueError(f"q: dtype must be float16, bfloat16 or float32, got {q.dtype}")
    batch, nq, heads, d = q.shape
    if nq < 1:
        raise ValueError("q: the query sequence is empty (Nq must be >= 1)")
    if not MIN_HEAD_DIM <= d <= MAX_HEAD_DIM:
        raise ValueError(f"q: head dim D={d} outside {MIN_HEAD_DIM}..{MAX_HEAD_DIM}")
    paged = block_table is not None
    layout = "(num_blocks, page_size, Hkv, D)" if paged else "(B, S, Hkv, D)"
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        _tensor(name, t, 4, layout)
        _like(name, t, q, q.dtype)
        if name == "k_cache" and t.shape[-1] != d:  # (v_cache's may differ)
            raise ValueError(f"k_cache: head dim {t.shape[-1]} differs from q's {d}")
        if t.stride(-1) != 1:
            raise ValueError(f"{name}: the head dim must have stride 1 (appends write in place)")
    if v_cache.shape[:-1] != k_cache.shape[:-1]:
        raise ValueError(f"v_cache: shape {tuple(v_cache.shape)} differs from k_cache's "
                         f"{tuple(k_cache.shape)} other than in the last dim (the value head "
                         "dim)")  # fmt: skip
    dv = v_cache.shape[-1]
    if not MIN_HEAD_DIM <= dv <= MAX_HEAD_DIM:
        raise ValueError(f"v_cache: value head dim Dv={dv} outside {MIN_HEAD_DIM}..{MAX_HEAD_DIM}")
    kv_heads = k_cache.shape[2]
    _check_heads(heads, kv_heads)
    if paged:
        _tensor("block_table", block_table, 2, "(B, max_blocks)")
        if block_table.dtype != torch.int32:
            raise ValueError(f"block_table: dtype must be torch.int32, got {block_table.dtype}")
        if block_table.device != q.device:
            raise ValueError(f"block_table: on device {block_table.device}, but q is on "
                             f"{q.device}")  # fmt: skip
        if block_table.shape[1] > 1 and block_table.stride(1) != 1:
            raise ValueError("block_table: each row must be contiguous (stride 1)")
        if block_table.shape[0] != batch:
            raise ValueError(f"block_table: {block_table.shape[0]} rows, q's batch is {batch}")
        page_size = k_cache.shape[1]
        if page_size % PAGE_MULTIPLE or page_size == 0:
            raise ValueError(f"k_cache: page_size {page_size} must be a multiple of "
                             f"{PAGE_MULTIPLE}")  # fmt: skip
        capacity = block_table.shape[1] * page_size
    else:
        if k_cache.shape[0] != batch:
            raise ValueError(f"k_cache: batch size {k_cache.shape[0]} differs from q's {batch}")
        page_size, capacity = 0, k_cache.shape[1]
    if (k is None) != (v is None):
        raise ValueError("k, v: give both new tensors or neither")
    n_new = 0
    if k is not None:
        for name, t, c in (("k", k, k_cache), ("v", v, v_cache)):
            _tensor(name, t, 4, "(B, Nnew, Hkv, D)")
            _like(name, t, q, q.dtype)
            if t.shape[0] != batch or t.shape[2:] != c.shape[2:]:
                raise ValueError(f"{name}: shape {tuple(t.shape)}, expected ({batch}, Nnew, "
                                 f"{kv_heads}, {c.shape[-1]})")  # fmt: skip
        if v.shape[1] != k.shape[1]:
            raise ValueError(f"v: shape {tuple(v.shape)} has {v.shape[1]} new rows, k has "
                             f"{k.shape[1]}")  # fmt: skip
        n_new = k.shape[1]
        if cache_seqlens is None:
            raise ValueError("cache_seqlens: required when appending k, v (where they go)")
    if isinstance(cache_seqlens, torch.Tensor):
        if cache_seqlens.dtype != torch.int32 or tuple(cache_seqlens.shape) != (batch,):
            raise ValueError(f"cache_seqlens: expected an int32 tensor of shape ({batch},), got "
                             f"{cache_seqlens.dtype} {tuple(cache_seqlens.shape)}")  # fmt: skip
        if cache_seqlens.device != q.device:
            raise ValueError(f"cache_seqlens: on device {cache_seqlens.device}, but q is on "
                             f"{q.device}")  # fmt: skip
        if batch > 1 and cache_seqlens.stride(0) != 1:
            raise ValueError("cache_seqlens: must be contiguous (stride 1)")
    elif cache_seqlens is not None and (
        isinstance(cache_seqlens, bool) or not isinstance(cache_seqlens, (int, torch.SymInt))
    ):
        raise ValueError(f"cache_seqlens: expected an int or an int32 tensor, got "
                         f"{type(cache_seqlens).__name__}")  # fmt: skip
    return page_size, capacity, n_new


def validate_kvcache(q, k_cache, v_cache, k, v, cache_seqlens, block_table, causal,
                     softmax_scale) -> tuple[float, KVCache]:  # fmt: skip
    """Check `flash_attn_with_kvcache`'s arguments; returns (softmax scale, the `KVCache`).

    Checked on the host: types, shapes, dtypes, devices, page_size a multiple of
    PAGE_MULTIPLE, an int cache_seqlens with its append inside the capacity, and no gradient
    asked for. The values of cache_seqlens and block_table tensors are checked where reading
    them is free (CPU tensors outside tracing); on a GPU they are the caller's contract:
    0 <= cache_seqlens[b], cache_seqlens[b] + Nnew <= capacity, block indices of the pages in
    use in range."""
    common = _common_call(q, k_cache, v_cache, k, v, cache_seqlens, block_table)
    if common is None:
        common = _check_structure(q, k_cache, v_cache, k, v, cache_seqlens, block_table)
    page_size, capacity, n_new = common
    seqlens, length = _check_values(q, k_cache, cache_seqlens, block_table, page_size, capacity,
                                    n_new)  # fmt: skip
    if torch.is_grad_enabled():
        for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache), ("k", k), ("v", v)):
            if t is not None and t.requires_grad:
                raise ValueError(f"{name}: requires grad, but flash_attn_with_kvcache is "
                                 "forward only (not differentiable); call it under "
                                 "torch.no_grad() or detach the inputs")  # fmt: skip
    scale = _check_scale(causal, softmax_scale, q.shape[-1])
    return scale, KVCache(seqlens, length, n_new, block_table, page_size, capacity)


def _check_values(q, k_cache, cache_seqlens, block_table, page_size: int, capacity: int,
                  n_new: int) -> tuple[torch.Tensor | None, int]:  # fmt: skip
    """`validate_kvcache`'s checks of values, of arguments whose structure passed: an int
    cache_seqlens, and the cache_seqlens and block_table tensors where reading them is free.
    Returns (the lengths tensor or None, the length of an int or no cache_seqlens)."""
    seqlens, length = None, capacity
    if isinstance(cache_seqlens, torch.Tensor):
        seqlens, length = cache_seqlens, 0
        if _free_to_read(cache_seqlens) and q.shape[0]:
            lo, hi = int(cache_seqlens.min()), int(cache_seqlens.max())
            if lo < 0 or hi + n_new > capacity:
                raise ValueError(f"cache_seqlens: lengths {lo}..{hi} plus {n_new} new rows must "
                                 f"fit in 0..{capacity}")  # fmt: skip
    elif cache_seqlens is not None:  # an int (checked)
        if cache_seqlens < 0 or cache_seqlens + n_new > capacity:
            raise ValueError(f"cache_seqlens: {cache_seqlens} plus {n_new} new rows exceeds the "
                             f"cache's {capacity} rows")  # fmt: skip
        length = cache_seqlens
    paged = block_table is not None
    if paged and _free_to_read(block_table) and (seqlens is None or _free_to_read(seqlens)):
        _check_pages(block_table, seqlens, length + n_new, page_size, k_cache.shape[0])
    return seqlens, length


# ---------------------------------------------------------------------------------------------
# Host path and op
# ---------------------------------------------------------------------------------------------


def kvcache_forward(q, k_cache, v_cache, k, v, cache: KVCache, causal: bool, scale: float, *,
                    softcap: float = 0.0, window: tuple[int, int] = (-1, -1),
                    config: FwdConfig | None = None, target: Target | None = None):  # fmt: skip
    """(o, lse) of q over the cache after appending k, v (launches only). Without `config` the
    chooser decides and the launches are replayed per layout."""
    if config is None and target is None:
        inputs = (q, k_cache, v_cache, k, v, cache.seqlens, cache.table)
        options = ("kvcache", causal, scale, softcap, window, cache.length, interpreting())
        return replay.replayed(_kvcache_forward, inputs, options, q, k_cache, v_cache, k, v,
                               cache, causal, scale, softcap, window, None, None)  # fmt: skip
    return _kvcache_forward(replay.DIRECT, q, k_cache, v_cache, k, v, cache, causal, scale,
                            softcap, window, config, target)  # fmt: skip


def kvcache_recorded(q, k_cache, v_cache, k, v, cache: KVCache, causal: bool, scale: float,
                     softcap: float, window: tuple[int, int]):  # fmt: skip
    """The sequence `kvcache_forward(...)` (no config, no target) replays for this call: run
    it as `seq((q, k_cache, v_cache, k, v, cache.seqlens, cache.table))`, which returns (o,
    lse); None where there is none (not called yet, or not replayable)."""
    inputs = (q, k_cache, v_cache, k, v, cache.seqlens, cache.table)
    options = ("kvcache", causal, scale, softcap, window, cache.length, interpreting())
    return replay.recorded(_kvcache_forward, inputs, options)


def _kvcache_forward(ops, q, k_cache, v_cache, k, v, cache, causal, scale, softcap, window,
                     config, target):  # fmt: skip
    q = unit_d(q)
    if k is not None:
        k, v = unit_d(k), unit_d(v)
    p = Problem.of_cache(q, k_cache, v_cache, cache, causal, window, softcap, target)
    cfg = choose_fwd(p) if config is None else check_fwd(p, config)
    o = ops.empty((*q.shape[:-1], p.head_dim_v), q.dtype, q.device)  # v's head dim
    lse = ops.empty((p.batch, p.heads, p.nq), torch.float32, q.device)
    if p.empty:
        return o, lse
    tma_allocator(ops, q.device)
    if cache.n_new:
        kv_append.launch(ops, p, cache, k_cache, v_cache, k, v)
    s = Scores.of(scale, softcap, cfg.fast_tanh)
    triton_split_kv.launch(ops, p, cfg, s, q, k_cache, v_cache, o, lse, cache)
    return o, lse


def _cache_of(k_cache, k, cache_seqlens, block_table, length) -> KVCache:
    """The `KVCache` of an op call's arguments."""
    paged = block_table is not None
    page_size = k_cache.shape[1] if paged else 0
    capacity = block_table.shape[1] * page_size if paged else k_cache.shape[1]
    n_new = 0 if k is None else k.shape[1]
    return KVCache(cache_seqlens, length, n_new, block_table, page_size, capacity)


@define_op("kernelkit_flash_attn::attn_kvcache_fwd", mutates_args=("k_cache", "v_cache"))
def attn_kvcache_fwd(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k: torch.Tensor | None,
    v: torch.Tensor | None,
    cache_seqlens: torch.Tensor | None,
    block_table: torch.Tensor | None,
    length: int,
    causal: bool,
    scale: float,
    softcap: float = 0.0,
    window_left: int = -1,
    window_right: int = -1,
) -> tuple[torch.Tensor, torch.Tensor]:
    cache = _cache_of(k_cache, k, cache_seqlens, block_table, length)
    return kvcache_forward(q, k_cache, v_cache, k, v, cache, causal, scale, softcap=softcap,
                           window=(window_left, window_right))  # fmt: skip


# ---------------------------------------------------------------------------------------------
# The public function
# ---------------------------------------------------------------------------------------------

_grad_enabled = torch.is_grad_enabled
# flash_attn_with_kvcache's calls that passed its checks, by `_call_key`: (the recorded
# sequence, page size, capacity, Nnew: what the checks of values read besides the values)
_CALLS = replay.Shortcuts()


def _call_key(q, k_cache, v_cache, k, v, cache_seqlens, block_table, causal, softmax_scale,
              window_size, softcap, return_lse):  # fmt: skip
    """The key of a `flash_attn_with_kvcache` call in `_CALLS`: everything its checks of
    structure and the replay key read (`replay.call_layout` of the tensors and an int
    cache_seqlens: shapes, strides, dtypes, devices, alignment, which are one tensor, the int's
    value), every option's value, the launch function, whether the interpreter runs and whether
    a gradient is asked for. The checks of values (`_check_values`) run at every call. None
    (the checked path) for traced calls, functorch transforms and options of other types than
    the plain ones (bool, float or None, a tuple of two ints)."""
    if plain_options(causal, softmax_scale, window_size, softcap, return_lse):
        layout = replay.call_layout((q, k_cache, v_cache, k, v, cache_seqlens, block_table))
        if layout is not None:
            grad = False
            if _grad_enabled():  # (any input may be None or an int here: the checks decide)
                for t in (q, k_cache, v_cache, k, v):
                    if t is not None and t.__class__ is not int and t.requires_grad:
                        grad = True
            return (layout, causal, softmax_scale, window_size, softcap, return_lse,
                    interpreting(), runtime.launch, grad)  # fmt: skip
    return None


def flash_attn_with_kvcache(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k: torch.Tensor | None = None,
    v: torch.Tensor | None = None,
    *,
    cache_seqlens: torch.Tensor | int | None = None,
    block_table: torch.Tensor | None = None,
    causal: bool = False,
    softmax_scale: float | None = None,
    window_size: tuple[int, int] = NO_WINDOW,
    softcap: float = 0.0,
    return_lse: bool = False,
):
    """Attention of q over a KV cache, after appending the new rows k, v to it in place
    (FlashAttention's `flash_attn_with_kvcache`): one decode (or speculative, or chunked
    prefill) step of a server.

    q (B, Nq, H, D). The cache: contiguous k_cache, v_cache (B, S, Hkv, D), or paged
    (num_blocks, page_size, Hkv, D) with block_table (B, max_blocks) int32, where key j of
    sequence b is row j % page_size of page block_table[b, j // page_size] (page_size a
    multiple of 16; pages in any order). cache_seqlens: each sequence's cache length before the
    append, an int32 (B,) tensor on q's device or an int (None: the whole cache, S or
    max_blocks x page_size, without an append). v_cache (and v) may have a head dim of their
    own, Dv (16..256): o then has it. k, v (B, Nnew, Hkv, D), optional: written into
    the cache at positions cache_seqlens[b] .. + Nnew (through the block table when paged);
    no other cache entry is touched. Row b of q then attends to cache positions
    [0, cache_seqlens[b] + Nnew). causal and window_size are bottom-right aligned as in
    `flash_attn` (query i of Nq sits at position cache_seqlens[b] + Nnew - Nq + i); GQA (H a
    multiple of Hkv), softcap and return_lse (the LSE (B, H, Nq) float32, -inf where a row sees
    no key, whose output is 0) as in `flash_attn`. Returns o (B, Nq, H, Dv), and the LSE with
    return_lse=True.

    Forward only: not differentiable (a ValueError if an input requires grad). Host checks:
    `validate_kvcache`; on a GPU the caller guarantees, as in FlashAttention, that
    cache_seqlens[b] + Nnew <= the capacity and that the block indices in use are in range
    (reading them would synchronise with the device and break CUDA-graph capture). A decode
    step captured in a CUDA graph replays with new values in cache_seqlens and block_table.
    CPU tensors without the Triton interpreter run the PyTorch reference.
    """
    # A call like an earlier one that passed the checks replays its sequence after the checks
    # of values: the other checks and the host path read nothing the key does not hold.
    key = _call_key(q, k_cache, v_cache, k, v, cache_seqlens, block_table, causal,
                    softmax_scale, window_size, softcap, return_lse)  # fmt: skip
    if key is not None:
        entry = _CALLS._plans.get(key)
        if entry is not None:
            seq, page_size, capacity, n_new = entry
            seqlens, _ = _check_values(q, k_cache, cache_seqlens, block_table, page_size,
                                       capacity, n_new)  # fmt: skip
            o, lse = seq((q, k_cache, v_cache, k, v, seqlens, block_table))
            return (o, lse) if return_lse else o
    scale, cache = validate_kvcache(q, k_cache, v_cache, k, v, cache_seqlens, block_table,
                                    causal, softmax_scale)  # fmt: skip
    softcap = check_softcap(softcap)
    check_bool("return_lse", return_lse)
    left, right = window_for(window_size, causal, q.shape[1], cache.capacity)
    q0 = q
    if scale < 0:  # as in flash_attn: the kernels assume scale >= 0
        q, scale = -q, -scale
    if use_triton(q):
        o, lse = attn_kvcache_fwd(q, k_cache, v_cache, k, v, cache.seqlens, block_table,
                                  cache.length, causal, scale, softcap, left, right)  # fmt: skip
        if key is not None and q is q0:  # q not negated: the call the sequence replays
            seq = kvcache_recorded(q, k_cache, v_cache, k, v, cache, causal, scale, softcap,
                                   (left, right))  # fmt: skip
            if seq is not None:
                _CALLS.remember(key, (seq, cache.page_size, cache.capacity, cache.n_new))
    else:  # the PyTorch reference (CPU tensors without the interpreter)
        seqlens = cache.seqlens
        if seqlens is None:
            seqlens = torch.full((q.shape[0],), cache.length, dtype=torch.int32)
        if cache.n_new:
            kvcache_append_reference(k_cache, v_cache, k, v, seqlens, block_table)
        o, lse = attention_kvcache_reference(q, k_cache, v_cache, seqlens + cache.n_new,
                                             block_table, causal, scale, (left, right),
                                             softcap, return_lse=True)  # fmt: skip
    return (o, lse) if return_lse else o
