"""Triton kernels of flash-attn: FlashAttention-2 forward and backward, and a split-KV forward
for decoding (its own section below).

Layout: q is (B, Nq, H, D), k (B, Nk, Hkv, D), v (B, Nk, Hkv, Dv) and o (B, Nq, H, Dv), read
through runtime strides with a unit stride along the head dim (the host makes it contiguous);
the LSE and delta are (B, H, Nq) float32. The value head dim Dv (HEAD_DIM_V, padded BLOCK_DV)
may differ from D (HEAD_DIM, BLOCK_D): v, o, do, dv and the forward's accumulator are Dv wide,
q, k, dq, dk D wide; where they are equal the host passes the same values for both.
Query head h reads kv head h // GROUP. The backward kernels read the LSE (in log2 units) and
delta from the preprocess's padded copies by default (ROWVEC, `attn_bwd_preprocess_kernel`):
rows past the end hold values that make them add nothing, so those reads need no row checks.

Scores are kept in log2 units, s2 = (q . k) * scale * log2(e), so that exp2 replaces exp.
Causal masking is bottom-right aligned: query i sees key j iff j <= i + SHIFT, SHIFT = Nk - Nq.
Sliding windows generalise it: query i sees key j iff i + SHIFT - left <= j (LOCAL) and
j <= i + SHIFT + right (CAUSAL; right = 0 for causal attention), i.e. lo_shift <= j - i <=
hi_shift. `_ranges` turns these bounds into the blocks a program visits: blocks outside the
window are never loaded, blocks inside it run without a mask, and only the boundary blocks pay.
Softcap (SOFTCAP != 0, Gemma 2): the scores become softcap * tanh(scores / softcap) before the
softmax; the host then passes qk_scale = softcap * log2(e) and cap_scale = scale / softcap, and
the kernels replace q . k by tanh(q . k * cap_scale) right after the product, so the rest of the
softmax is unchanged. The backward recomputes tanh from the raw scores and multiplies dS by
1 - tanh^2. SOFTCAP = 0 compiles none of it.
Every kernel splits its key (or query) loop into blocks no mask can touch, walked without a
mask, and the few blocks on the causal diagonal, the window's edges or past the end of a
sequence, walked with one.

The tiles a loop streams are read through `_head_source` / `_load_block`: a TMA descriptor per
(program, head) when the TMA flag is set (the host checks that rows are 16-byte aligned), else
masked pointer loads. TMA keeps no per-element addresses in registers, which lets the larger
tiles run without spilling.

Packed variable-length batches (VARLEN): the batch axis becomes the sequence index. The host
passes zero batch strides and the longest sequence as Nq / Nk (the grid), and each program reads
its sequence's first row and length from the cu_seqlens prefix sums (`_sequence`), moves its base
pointers to that row and works on that sequence alone; a program whose block starts past its
sequence's end returns at once (those rows are another sequence's, or none). The LSE and delta
are read through (batch, head) strides: (H * Nq, Nq) for a dense batch, (0, total_q) packed; the
padded row vectors (H * Np, Np) with Np = Nq rounded up, or (0, Np) packed with each sequence
from a multiple of 16 (`_rowvec_start`).

Offsets: per-(batch, head) bases and block starts are 64-bit; offsets inside a block are 32-bit.
A program id enumerates (sequence block, batch * head) with the block index fastest, so the
programs that share one head's K/V (or Q/dO) run together and hit L2.
"""

import torch
import triton
import triton.language as tl

LOG2E = tl.constexpr(1.4426950408889634)
LN2 = tl.constexpr(0.6931471805599453)


@triton.jit
def _load_rows(ptrs, rows, n_rows, offs_d, CHECK_ROWS: tl.constexpr, HEAD_DIM: tl.constexpr):
    """Load a (rows x BLOCK_D) tile; masked only where rows can pass n_rows or D is padded."""
    if CHECK_ROWS:
        if offs_d.shape[0] != HEAD_DIM:
            x = tl.load(
                ptrs, mask=(rows[:, None] < n_rows) & (offs_d[None, :] < HEAD_DIM), other=0.0
            )
        else:
            x = tl.load(ptrs, mask=rows[:, None] < n_rows, other=0.0)
    else:
        if offs_d.shape[0] != HEAD_DIM:
            x = tl.load(ptrs, mask=offs_d[None, :] < HEAD_DIM, other=0.0)
        else:
            x = tl.load(ptrs)
    return x


@triton.jit
def _store_rows(ptrs, x, rows, n_rows, offs_d, CHECK_ROWS: tl.constexpr, HEAD_DIM: tl.constexpr):
    if CHECK_ROWS:
        if offs_d.shape[0] != HEAD_DIM:
            tl.store(ptrs, x, mask=(rows[:, None] < n_rows) & (offs_d[None, :] < HEAD_DIM))
        else:
            tl.store(ptrs, x, mask=rows[:, None] < n_rows)
    else:
        if offs_d.shape[0] != HEAD_DIM:
            tl.store(ptrs, x, mask=offs_d[None, :] < HEAD_DIM)
        else:
            tl.store(ptrs, x)


@triton.jit
def _head_source(base, n_rows, stride, BLOCK_ROWS: tl.constexpr, HEAD_DIM: tl.constexpr,
                 BLOCK_D: tl.constexpr, TMA: tl.constexpr):  # fmt: skip
    """What the loops read one head's (n_rows x HEAD_DIM) rows from: a TMA descriptor of
    (BLOCK_ROWS x BLOCK_D) boxes when TMA (out-of-bounds rows and columns read as zeros), else the
    base pointer itself."""
    src = base
    if TMA:
        src = tl.make_tensor_descriptor(
            base, [n_rows, HEAD_DIM], [stride, 1], [BLOCK_ROWS, BLOCK_D]
        )
    return src


@triton.jit
def _load_block(src, start, stride, offs_rows, n_rows, offs_d, CHECK_ROWS: tl.constexpr,
                HEAD_DIM: tl.constexpr, TMA: tl.constexpr):  # fmt: skip
    """Rows [start, start + BLOCK_ROWS) of a `_head_source`. The TMA path moves the tile with the
    copy engine: no per-element address registers, which otherwise make the loops spill."""
    if TMA:
        x = src.load([start, 0])
    else:
        ptrs = (
            src + tl.cast(start, tl.int64) * stride + offs_rows[:, None] * stride + offs_d[None, :]
        )
        x = _load_rows(ptrs, start + offs_rows, n_rows, offs_d, CHECK_ROWS, HEAD_DIM)
    return x


@triton.jit
def _load_kv(src, pages, page_size, stride_page, start, stride, offs_rows, n_rows, offs_d,
             CHECK_ROWS: tl.constexpr, HEAD_DIM: tl.constexpr, TMA: tl.constexpr,
             PAGED: tl.constexpr):  # fmt: skip
    """Keys (or values) [start, start + BLOCK_ROWS) of one kv head, contiguous (PAGED = 0:
    `_load_block`) or in a paged cache, where key j is row j % page_size of page
    pages[j // page_size] (pages: the sequence's block-table row; stride_page: the cache's page
    stride). PAGED = 1: a page per row, pointer loads (any page size); PAGED = 2: the block lies
    in one page (page_size a multiple of BLOCK_ROWS) and `src` is a TMA descriptor over all the
    cache's rows. Rows past n_rows read as zeros (CHECK_ROWS), as the contiguous path's do."""
    if PAGED == 0:
        x = _load_block(src, start, stride, offs_rows, n_rows, offs_d, CHECK_ROWS, HEAD_DIM, TMA)
    elif PAGED == 1:
        rows = start + offs_rows
        if CHECK_ROWS:
            page = tl.load(pages + rows // page_size, mask=rows < n_rows, other=0)
        else:
            page = tl.load(pages + rows // page_size)
        off = page.to(tl.int64) * stride_page + (rows % page_size).to(tl.int64) * stride
        x = _load_rows(src + off[:, None] + offs_d[None, :], rows, n_rows, offs_d, CHECK_ROWS,
                       HEAD_DIM)  # fmt: skip
    else:
        page = tl.load(pages + start // page_size)
        x = src.load([page * page_size + start % page_size, 0])
        if CHECK_ROWS:  # the page's rows past the sequence hold whatever the cache holds
            x = tl.where((start + offs_rows < n_rows)[:, None], x, 0.0)
    return x


@triton.jit
def _tanh(x, FAST: tl.constexpr):
    """tanh in float32. FAST: the tanh.approx.f32 instruction (one MUFU op; relative error
    below 2^-10.9, what FlashAttention's softcap uses), for half-precision inputs on the GPU.
    Else 1 - 2 / (e^2x + 1): float32-accurate to ~1e-7 absolute, +-1 at the ends, and what the
    interpreter runs (no inline assembly there)."""
    if FAST:
        t = tl.inline_asm_elementwise(
            "tanh.approx.f32 $0, $1;", "=f,f", [x], dtype=tl.float32, is_pure=True, pack=1
        )
    else:
        t = 1.0 - 2.0 / (tl.math.exp2(x * (2.0 * LOG2E)) + 1.0)
    return t


@triton.jit
def _sequence(CU, b):
    """(first row (64-bit), number of rows) of sequence b of a packed batch."""
    start = tl.load(CU + b)
    return start.to(tl.int64), tl.load(CU + b + 1) - start


@triton.jit
def _visible(rows, cols, n_cols, lo_shift, hi_shift, LOWER: tl.constexpr, UPPER: tl.constexpr,
             CHECK_COLS: tl.constexpr):  # fmt: skip
    """Mask of the (row, col) pairs (broadcast) where col is visible to row:
    row + lo_shift <= col (LOWER), col <= row + hi_shift (UPPER), col < n_cols (CHECK_COLS)."""
    if UPPER:
        keep = cols <= rows + hi_shift
        if LOWER:
            keep = keep & (cols >= rows + lo_shift)
        if CHECK_COLS:
            keep = keep & (cols < n_cols)
    elif LOWER:
        keep = cols >= rows + lo_shift
        if CHECK_COLS:
            keep = keep & (cols < n_cols)
    else:
        keep = cols < n_cols
    return keep


@triton.jit
def _ranges(first, last, start, end, lo_shift, hi_shift, BLOCK: tl.constexpr,
            LOWER: tl.constexpr, UPPER: tl.constexpr, ALIGN_END: tl.constexpr):  # fmt: skip
    """The blocks of [start, end) (BLOCK wide, counted from `start`) that rows first..last visit
    when row x sees y iff x + lo_shift <= y (LOWER) and y <= x + hi_shift (UPPER).

    Returns (lo, mid_lo, mid_hi, hi): [lo, mid_lo) and [mid_hi, hi) need the mask, every row
    sees all of [mid_lo, mid_hi), and no row sees anything outside [lo, hi) (so those blocks are
    skipped). Each range is empty or starts on a block boundary. ALIGN_END: [mid_lo, mid_hi)
    stops at a block boundary, so a ragged last block (positions past `end`) is masked too."""
    lo = start
    hi = end
    full_lo = start
    full_hi = end
    if LOWER:
        lo = start + tl.maximum(first + lo_shift - start, 0) // BLOCK * BLOCK
        full_lo = start + tl.cdiv(tl.maximum(last + lo_shift - start, 0), BLOCK) * BLOCK
    if UPPER:
        hi = tl.minimum(end, last + hi_shift + 1)
        # (the last full block ends at the first row's edge, or at the last whole block)
        full_hi = tl.minimum(start + tl.maximum(first + hi_shift + 1 - start, 0) // BLOCK * BLOCK,
                             start + (end - start) // BLOCK * BLOCK)  # fmt: skip
    elif ALIGN_END:
        full_hi = start + (end - start) // BLOCK * BLOCK
    # Without a lower bound the full range starts at `start` and ends at full_hi (<= hi, or
    # both at `start`); the clamps below are only needed with one (and keep the plain causal
    # kernels' bounds as they were).
    mid_lo = start
    mid_hi = full_hi
    if LOWER:
        mid_lo = tl.maximum(tl.minimum(full_lo, hi), lo)
        if UPPER or ALIGN_END:
            mid_hi = tl.maximum(tl.minimum(full_hi, hi), mid_lo)
    return lo, mid_lo, mid_hi, hi


@triton.jit
def _program_ids(num_blocks, REVERSE: tl.constexpr):
    """(block index, batch * head index) of this program; REVERSE starts with the last blocks
    (the longest causal rows), which balances the tail of the launch."""
    pid = tl.program_id(0)
    blk = pid % num_blocks
    if REVERSE:
        blk = num_blocks - 1 - blk
    return blk, pid // num_blocks


def dot_precision(dtype: torch.dtype) -> str:
    """The DOT_PREC constexpr: float32 inputs take three tf32 products per dot (about float32
    accuracy, at a third of the tf32 rate); half precision ignores the setting."""
    return "tf32x3" if dtype == torch.float32 else "tf32"
