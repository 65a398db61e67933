"""The KV cache's in-place append (`flash_attn_with_kvcache` with new k, v) and its launch.

One launch writes the new rows of k and v together: program (row block, batch * kv head) copies
BLOCK_R rows of one head of each into the cache at the sequence's length onwards, through the
block table when the cache is paged. It runs before the split-KV forward on the same stream,
which then reads the appended rows as cache rows. Cache rows outside the append are never
touched; nothing else reads or writes the cache.
"""

import triton
import triton.language as tl

from kernelkit.shared.runtime import cdiv

from ..config import KVCache, Problem
from ..strides import strides
from .common import _load_rows, _store_rows


@triton.jit
def _append_rows(C, N, b, h, i, pos, page, stride_cb, stride_cn, stride_ch, stride_nb,
                 stride_nn, stride_nh, n_new, page_size, offs_d, HEAD_DIM: tl.constexpr,
                 PAGED: tl.constexpr):  # fmt: skip
    """Rows i of head h of sequence b of the new tensor N into cache C at positions pos."""
    src = N + b * stride_nb + h * stride_nh + (i.to(tl.int64) * stride_nn)[:, None]
    x = _load_rows(src + offs_d[None, :], i, n_new, offs_d, True, HEAD_DIM)
    if PAGED:
        row = page * stride_cb + (pos % page_size).to(tl.int64) * stride_cn
    else:
        row = b * stride_cb + pos.to(tl.int64) * stride_cn
    dst = C + h * stride_ch + row[:, None] + offs_d[None, :]
    _store_rows(dst, x, i, n_new, offs_d, True, HEAD_DIM)


@triton.jit(do_not_specialize=["n_new", "length", "page_size"])
def kv_append_kernel(
    KC,
    VC,
    KN,
    VN,
    SEQLENS,
    TABLE,
    stride_kcb,
    stride_kcn,
    stride_kch,
    stride_vcb,
    stride_vcn,
    stride_vch,
    stride_knb,
    stride_knn,
    stride_knh,
    stride_vnb,
    stride_vnn,
    stride_vnh,
    stride_tb,
    Hkv,
    n_new,
    length,
    page_size,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    HEAD_DIM_V: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    BLOCK_R: tl.constexpr,
    VAR_K: tl.constexpr,
    PAGED: tl.constexpr,
):
    """New rows [pid0 * BLOCK_R, +BLOCK_R) of kv head (pid1 % Hkv) of sequence (pid1 // Hkv)
    written at the sequence's length (SEQLENS[b] with VAR_K, else `length`) onwards; K rows
    HEAD_DIM wide, V rows HEAD_DIM_V."""
    bh = tl.program_id(1)
    b = (bh // Hkv).to(tl.int64)
    h = (bh % Hkv).to(tl.int64)
    i = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    if VAR_K:
        length = tl.load(SEQLENS + b)
    pos = length + i
    page = pos
    if PAGED:
        page = tl.load(TABLE + b * stride_tb + pos // page_size, mask=i < n_new, other=0)
        page = page.to(tl.int64)
    _append_rows(KC, KN, b, h, i, pos, page, stride_kcb, stride_kcn, stride_kch, stride_knb,
                 stride_knn, stride_knh, n_new, page_size, offs_d, HEAD_DIM, PAGED)  # fmt: skip
    _append_rows(VC, VN, b, h, i, pos, page, stride_vcb, stride_vcn, stride_vch, stride_vnb,
                 stride_vnn, stride_vnh, n_new, page_size, offs_dv, HEAD_DIM_V, PAGED)  # fmt: skip


APPEND_BLOCK_R = 16  # new rows per program


def launch(ops, p: Problem, cache: KVCache, k_cache, v_cache, k, v) -> None:
    """Write k (B, n_new, Hkv, D), v (B, n_new, Hkv, Dv) into the cache at each sequence's
    length."""
    ops.launch(
        kv_append_kernel, (cdiv(cache.n_new, APPEND_BLOCK_R), p.batch * p.kv_heads),
        KC=k_cache, VC=v_cache, KN=k, VN=v, SEQLENS=cache.seqlens, TABLE=cache.table,
        **strides("kc", k_cache), **strides("vc", v_cache), **strides("kn", k),
        **strides("vn", v), stride_tb=0 if cache.table is None else cache.table.stride(0),
        Hkv=p.kv_heads, n_new=cache.n_new, length=cache.length,
        page_size=max(cache.page_size, 1), HEAD_DIM=p.head_dim, BLOCK_D=p.block_d,
        HEAD_DIM_V=p.head_dim_v, BLOCK_DV=p.block_dv, BLOCK_R=APPEND_BLOCK_R,
        VAR_K=cache.seqlens is not None, PAGED=cache.table is not None, num_warps=4,
    )  # fmt: skip
