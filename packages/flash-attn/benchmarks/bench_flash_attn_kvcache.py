"""flash-attn KV-cache cells: `flash_attn_with_kvcache` decoding steps against a long cache,
contiguous or paged, forward only, bf16, GQA 32/8, d = 128 (the Llama-style decode shape).

Tables (x = nk, the keys each query sees: cache length before the step plus the appended rows;
the names below are the pytest-benchmark groups, rendered as op "kvcache", direction "fwd" and
the name's rest as tag, e.g. kvcache-speed-fwd-decode-contig-b8-q1-head32-kv8-dim128-bf16):
  kvcache-decode-contig-b{B}       Nq = 1, nk in {4k, 16k, 64k, 128k}, B in {1, 8, 64}; cells
                                   whose cache (2 B nk Hkv d 2 bytes) passes 40 GB are skipped
                                   (none at these sizes: B = 64 at 128k holds 34 GB)
  kvcache-decode-paged-b{B}-p{P}   the same on a paged cache, page size P in {16, 64, 256}, the
                                   block table a seeded random permutation of the page ids
  kvcache-spec                     speculative decoding: x = Nq in {4, 16} drafted tokens
                                   appended and checked, nk = 32k, B = 8, causal (bottom-right),
                                   ours and ours_paged (P = 64) only
  kvcache-append                   B = 8, nk in {4k, 32k}, Nq = 1: the step with and without its
                                   in-place append (goal: the append adds < 3%)
Providers:
  ours           flash_attn_with_kvcache on a contiguous (B, S, Hkv, d) cache, cache_seqlens an
                 int32 tensor of nk - Nq and one new row per query appended through k=, v= (the
                 same slot rewritten every repetition: what a real step costs), so the step
                 reads nk keys; in the paged tables the same keys in a contiguous cache (the
                 "paged within 5% of contiguous" comparison)
  ours_noappend  the same without k, v: cache_seqlens = nk
  ours_paged     ours on the paged cache (pages, P, Hkv, d) through the block table
  sdpa_cudnn     PyTorch SDPA pinned to one backend on the contiguous cache as (B, H, N, d)
  sdpa_flash     transposed views, non-causal, `enable_gqa=True`; a backend that refuses GQA
                 gets K/V repeated to H heads beforehand, untimed (extra_info gqa=repeat_kv:
                 it reads 4x the bytes); extra_info["kernel"] names the node that ran
  gather_sdpa    the pages gathered into a contiguous cache (index_select, timed) and SDPA on
                 it: cuDNN, else flash (extra_info["sdpa"]; a refused GQA repeats K/V, timed)
  flex_paged     FlexAttention compiled with torch.compile, a block mask of the lengths built
                 outside the timing; through torch's PagedAttention helper (the same pages and
                 block table, the pool in its (1, Hkv, pages x P, d) layout) where the
                 installed torch has it, else on the gathered cache (gather timed);
                 extra_info["flex"] says which. Skipped with the reason when it fails to compile
Summaries (rendered first): `kvcache-paged-vs-contig` (µs of ours_paged and ours, their ratio:
the goal is <= 1.05x) and `kvcache-append` (an interleaved A/B of the step with and without
the append, in the `ours` cells of kvcache-append: extra_info append_ratio, append_pct).
GB/s and % of the copy bandwidth (`record`'s bytes_moved) count the KV bytes the step must
read, 2 B nk Hkv d 2 bytes, the same floor for every provider of a cell: a step can take no
less than those bytes / the copy bandwidth. q, o, the appended rows and the partials are < 1%.

`python ci/bench.py flash-attn -k kvcache --name kvcache` runs it on a GPU and writes
results/<GPU>-kvcache.{md,json,png} (FlexAttention compiles once per cell, so it runs at
B = 8, page 64 only: FLEX_CELLS; -k "kvcache and not flex" leaves it out). The largest cells
need about 70 GB (a 34 GB cache and its gathered copy). Without a GPU (CI smoke mode) every cell runs
once on a tiny shape under the Triton interpreter; the PyTorch providers that need CUDA are
skipped.
"""

import functools
import time

import pytest
import torch
import torch.nn.functional as F
from bench_flash_attn import SDPA
from torch.nn.attention import sdpa_kernel

from kernelkit.flash_attn import flash_attn_with_kvcache
from kernelkit.shared.bench import interleaved_ms, record, torch_compile

GPU = torch.cuda.is_available()
DEVICE = "cuda" if GPU else "cpu"
DTYPE = torch.bfloat16
H, HKV, D = (32, 8, 128) if GPU else (4, 2, 16)
BATCHES = [1, 8, 64] if GPU else [1]
NKS = [4096, 16384, 65536, 131072] if GPU else [40]
PAGES = [16, 64, 256] if GPU else [16]
MAX_CACHE_BYTES = 40e9
SPEC_B, SPEC_NK, SPEC_PAGE = (8, 32768, 64) if GPU else (1, 40, 16)
SPEC_NQ = [4, 16] if GPU else [4]
APPEND_B = 8 if GPU else 1
APPEND_NKS = [4096, 32768] if GPU else [40]
CONTIG_PROVIDERS = ["ours", "ours_noappend", "sdpa_cudnn", "sdpa_flash"]
PAGED_PROVIDERS = ["ours_paged", "ours", "gather_sdpa", "flex_paged"]
SPEC_PROVIDERS = ["ours", "ours_paged"]
APPEND_PROVIDERS = ["ours", "ours_noappend"]
NEEDS_CUDA = {"sdpa_cudnn", "flex_paged"}  # sdpa_flash and gather_sdpa run on CPU too
GATHER_SDPA = ["sdpa_cudnn", "sdpa_flash"] if GPU else ["sdpa_flash"]
SHAPE = f"head{H}-kv{HKV}-dim{D}-bf16"
FLEX_CELLS = (8, 64)  # (B, page) of the flex_paged cells on a GPU (each compiles: minutes)


@pytest.fixture(scope="module", autouse=True)
def _clocks_up():
    """About a second of matmuls before the first cell: an idle GPU's clocks ramp up during its
    first cells otherwise (the first table measured 2-4x slow)."""
    if GPU:
        x = torch.randn(4096, 4096, device=DEVICE, dtype=DTYPE)
        start = time.perf_counter()
        while time.perf_counter() - start < 1.0:
            x @ x
        torch.cuda.synchronize()


def kv_bytes(b, nk):
    """The KV bytes a step reads: K and V rows of nk keys, B sequences."""
    return 2 * b * nk * HKV * D * DTYPE.itemsize


def cdiv(a, b):
    return -(-a // b)


def _raise_oom():
    raise torch.OutOfMemoryError("the provider's inputs did not fit on the GPU")


def make_cache(b, capacity, page, seed=0):
    """K and V caches of `capacity` rows per sequence and the block table (None when
    contiguous): contiguous (B, capacity, Hkv, D), or paged (B x capacity / page, page, Hkv, D)
    with sequence b's pages placed by a seeded random permutation. Row by row the same values
    for every layout (drawn sequence by sequence from one generator), so a paged cell and its
    contiguous equivalent read the same keys; no layout is ever held twice."""
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    table = None
    if page:
        blocks = capacity // page
        perm = torch.randperm(b * blocks, generator=torch.Generator().manual_seed(seed + 1))
        table = perm.view(b, blocks).to(DEVICE, torch.int32)
        shape = (b * blocks, page, HKV, D)
    else:
        shape = (b, capacity, HKV, D)
    caches = [torch.empty(shape, dtype=DTYPE, device=DEVICE) for _ in range(2)]
    for i in range(b):
        for c in caches:
            rows = torch.randn((capacity, HKV, D), dtype=DTYPE, device=DEVICE, generator=g)
            if page:
                c[table[i].long()] = rows.view(-1, page, HKV, D)
            else:
                c[i] = rows
    return caches[0], caches[1], table


def new_rows(b, nq, seed=1):
    """q (B, Nq, H, D) and the new k, v rows (B, Nq, Hkv, D) of one step."""
    g = torch.Generator(device=DEVICE).manual_seed(seed)

    def r(*shape):
        return torch.randn(shape, dtype=DTYPE, device=DEVICE, generator=g)

    return r(b, nq, H, D), r(b, nq, HKV, D), r(b, nq, HKV, D)


def ours(q, k_cache, v_cache, table, nk, k=None, v=None, causal=False):
    """The timed step: append k, v (when given) at nk - Nnew, then attend over nk keys."""
    n_new = 0 if k is None else k.shape[1]
    seqlens = torch.full((q.shape[0],), nk - n_new, dtype=torch.int32, device=DEVICE)
    return functools.partial(flash_attn_with_kvcache, q, k_cache, v_cache, k, v,
                             cache_seqlens=seqlens, block_table=table, causal=causal)  # fmt: skip


def repeat_kv(t):
    """(B, Hkv, N, D) -> (B, H, N, D): each KV head repeated for its query heads."""
    return t.repeat_interleave(H // HKV, 1)


def attend(provider, gqa):
    """SDPA pinned to `provider`'s backend, non-causal, on (B, H, N, D) tensors."""

    def f(qt, kt, vt):
        with sdpa_kernel(SDPA[provider]):
            return F.scaled_dot_product_attention(qt, kt, vt, enable_gqa=gqa)

    return f


def pick_sdpa(providers, qt, kt, vt, info):
    """(attend function, repeat) of the first of the SDPA `providers` that runs q against these
    k, v (B, Hkv, N, D): with enable_gqa, else K/V repeated to H heads (repeat True). Records
    the backend, the GQA mode and the autograd node that ran in `info`; skips the cell when
    none runs, or raises OutOfMemoryError when one ran out of memory (the repeated K/V)."""
    errors, oom = [], None
    for provider in providers:
        for repeat in (False, True):
            fn = attend(provider, not repeat)
            how = "repeat_kv" if repeat else "enable_gqa"
            try:  # once with a gradient, to name the kernel that ran
                kk, vv = (repeat_kv(kt), repeat_kv(vt)) if repeat else (kt, vt)
                kernel = type(fn(qt.detach().requires_grad_(), kk, vv).grad_fn).__name__
            except torch.OutOfMemoryError as e:
                oom = e
                break  # the next backend
            except RuntimeError as e:
                errors.append(f"{provider} ({how}): {str(e).splitlines()[0]}")
                continue
            finally:
                kk = vv = None
            info.update(sdpa=provider, gqa=how, kernel=kernel)
            return fn, repeat
    if oom is not None:
        raise oom
    pytest.skip(f"SDPA unavailable: {'; '.join(errors)}")


def sdpa_contig(provider, q, k_cache, v_cache, info):
    """SDPA on the contiguous cache's (B, H, N, D) views; repeated K/V made outside the timing."""
    qt, kt, vt = (t.transpose(1, 2) for t in (q, k_cache, v_cache))
    fn, repeat = pick_sdpa([provider], qt, kt, vt, info)
    if repeat:
        kt, vt = repeat_kv(kt), repeat_kv(vt)
    return functools.partial(fn, qt, kt, vt)


def gather(cache, table, nk):
    """The pages of `table` gathered into a contiguous (B, nk, Hkv, D) cache."""
    b, blocks = table.shape
    page = cache.shape[1]
    return cache.index_select(0, table.view(-1)).view(b, blocks * page, HKV, D)[:, :nk]


def gather_sdpa(q, k_cache, v_cache, table, nk, info):
    """The timed gather of both caches, then SDPA (cuDNN, else flash) on the gathered cache."""
    qt = q.transpose(1, 2)
    kt, vt = (gather(c, table, nk).transpose(1, 2) for c in (k_cache, v_cache))
    fn, repeat = pick_sdpa(GATHER_SDPA, qt, kt, vt, info)
    del kt, vt

    def call():
        kt, vt = (gather(c, table, nk).transpose(1, 2) for c in (k_cache, v_cache))
        if repeat:
            kt, vt = repeat_kv(kt), repeat_kv(vt)
        return fn(qt, kt, vt)

    return call


@functools.cache
def compiled_flex():
    from torch.nn.attention.flex_attention import flex_attention

    return torch_compile(flex_attention)


def paged_attention_class():
    """torch's PagedAttention helper for FlexAttention, or None where this torch lacks it."""
    try:
        from torch.nn.attention.experimental._paged_attention import PagedAttention
    except ImportError:
        return None
    return PagedAttention


def flex_paged(q, caches, table, nk, info):
    """Compiled FlexAttention over the pages (see the module docstring). `caches` is the list
    [k_cache, v_cache]; with the PagedAttention helper it is emptied, the pool converted to the
    helper's layout (untimed) in its place."""
    from torch.nn.attention.flex_attention import create_block_mask

    b, blocks = table.shape
    pages, page = caches[0].shape[:2]
    capacity = blocks * page
    lengths = torch.full((b,), nk, dtype=torch.int32, device=DEVICE)

    def in_length(bi, h, q_idx, kv_idx):
        return kv_idx < lengths[bi]

    mask = create_block_mask(in_length, b, None, q.shape[1], capacity, device=DEVICE,
                             BLOCK_SIZE=(128, page))  # fmt: skip
    qt, flex = q.transpose(1, 2), compiled_flex()
    paged = paged_attention_class()
    if paged is not None:
        helper = paged(pages, page, b, device=DEVICE)
        ids = table.long()
        helper.page_table[:, :blocks] = ids
        logical = torch.arange(blocks, device=DEVICE).expand(b, blocks)
        helper.physical_to_logical.scatter_(1, ids, logical)
        helper.capacity.fill_(capacity)
        helper.empty_pages = []
        mask = helper.convert_logical_block_mask(mask)
        kt, vt = (caches.pop(0).view(1, pages * page, HKV, D).transpose(1, 2).contiguous()
                  for _ in range(2))  # fmt: skip
        info.update(flex="PagedAttention", flex_layout="(1, Hkv, pages x P, D)")

        def call():
            return flex(qt, kt, vt, block_mask=mask, enable_gqa=True)

    else:
        k_cache, v_cache = caches
        info.update(flex="gathered")

        def call():
            kt, vt = (gather(c, table, capacity).transpose(1, 2) for c in (k_cache, v_cache))
            return flex(qt, kt, vt, block_mask=mask, enable_gqa=True)

    try:
        with torch.no_grad():
            call()  # compile here: a failure skips the cell with its reason
    except torch.OutOfMemoryError:
        raise
    except Exception as e:
        pytest.skip(
            f"flex_paged failed to compile or run: {type(e).__name__}: {str(e).splitlines()[0]}"
        )
    return call


def provider_call(provider, b, nq, nk, page, causal, info):
    """The timed callable of one provider, nk visible keys per sequence: the paged providers
    on a paged cache of page size `page`, the others on a contiguous cache of the same keys
    (capacity nk rounded up to whole pages, when `page`)."""
    if not GPU and provider in NEEDS_CUDA:
        pytest.skip(f"{provider}: needs a CUDA GPU")
    capacity = cdiv(nk, page) * page if page else nk
    paged = provider in ("ours_paged", "gather_sdpa", "flex_paged")
    info["cache"] = f"paged p{page}" if paged else "contiguous"
    q, k, v = new_rows(b, nq)
    k_cache, v_cache, table = make_cache(b, capacity, page if paged else 0)
    if provider in ("ours", "ours_paged"):
        return ours(q, k_cache, v_cache, table, nk, k, v, causal=causal)
    if provider == "ours_noappend":
        return ours(q, k_cache, v_cache, table, nk)
    if provider in SDPA:
        return sdpa_contig(provider, q, k_cache, v_cache, info)
    if provider == "gather_sdpa":
        return gather_sdpa(q, k_cache, v_cache, table, nk, info)
    caches = [k_cache, v_cache]
    del k_cache, v_cache  # flex_paged may replace the pool by its own layout
    return flex_paged(q, caches, table, nk, info)


def summarize(benchmark, table, title, row, values, columns, ratios):
    """Add this cell's values (µs) to the summary table `table` (a seed table of
    kernelkit.shared.report: rows merged across cells, ratio columns computed when rendered)."""
    if not values:
        return
    benchmark.extra_info.setdefault("seed", []).append({
        "table": table, "title": title, "row": row, "values": values, "columns": columns,
        "ratios": ratios, "digits": {"*": 1}, "style": "pipe",
    })  # fmt: skip


def run_cell(benchmark, table, tag, x, xname, provider, *, b, nq, nk, page=0, causal=False):
    """Build, time and record one cell of table `table` (the pytest-benchmark group)."""
    if kv_bytes(b, nk) > MAX_CACHE_BYTES:  # K and V of nk rows: the cache itself
        pytest.skip(
            f"the cache ({kv_bytes(b, nk) / 1e9:.0f} GB) passes {MAX_CACHE_BYTES / 1e9:.0f} GB"
        )
    info = {"b": b, "nq": nq, "nk": nk, "causal": causal, "kv_bytes": kv_bytes(b, nk)}
    try:
        fn = provider_call(provider, b, nq, nk, page, causal, info)
    except torch.OutOfMemoryError:
        torch.cuda.empty_cache()
        fn = _raise_oom  # recorded as OOM by `record`

    def call():
        with torch.no_grad():
            return fn()

    benchmark.group = table
    record(benchmark, call, op="kvcache", direction="fwd", tag=tag, x=x, xname=xname,
           provider=provider, bytes_moved=kv_bytes(b, nk), info=info)  # fmt: skip
    return fn


@pytest.mark.parametrize("provider", CONTIG_PROVIDERS)
@pytest.mark.parametrize("nk", NKS)
@pytest.mark.parametrize("b", BATCHES, ids=lambda b: f"b{b}")
def test_contig(benchmark, b, nk, provider):
    table = f"kvcache-decode-contig-b{b}"
    run_cell(benchmark, table, f"decode-contig-b{b}-q1-{SHAPE}", nk, "nk", provider, b=b, nq=1,
             nk=nk)  # fmt: skip


@pytest.mark.parametrize("provider", PAGED_PROVIDERS)
@pytest.mark.parametrize("nk", NKS)
@pytest.mark.parametrize("page", PAGES, ids=lambda p: f"p{p}")
@pytest.mark.parametrize("b", BATCHES, ids=lambda b: f"b{b}")
def test_paged(benchmark, b, page, nk, provider):
    if provider == "flex_paged" and GPU and (b, page) != FLEX_CELLS:
        pytest.skip(f"flex_paged runs at (B, page) = {FLEX_CELLS} only: it compiles per cell")
    table = f"kvcache-decode-paged-b{b}-p{page}"
    run_cell(benchmark, table, f"decode-paged-b{b}-p{page}-q1-{SHAPE}", nk, "nk", provider, b=b,
             nq=1, nk=nk, page=page)  # fmt: skip
    if provider in ("ours", "ours_paged") and "ms" in benchmark.extra_info:
        summarize(benchmark, "kvcache-paged-vs-contig",
                  "kvcache-paged-vs-contig: one decode step, paged vs contiguous cache "
                  f"(µs; Nq = 1, {SHAPE}; goal paged / contig <= 1.05x)",
                  [["B", b], ["page", page], ["nk", nk]],
                  {provider: 1000 * benchmark.extra_info["ms"]}, ["ours_paged", "ours"],
                  {"paged / contig": ["ours_paged", "ours"]})  # fmt: skip


@pytest.mark.parametrize("provider", SPEC_PROVIDERS)
@pytest.mark.parametrize("nq", SPEC_NQ)
def test_spec(benchmark, nq, provider):
    tag = f"spec-b{SPEC_B}-nk{SPEC_NK}-p{SPEC_PAGE}-causal1-{SHAPE}"
    run_cell(benchmark, "kvcache-spec", tag, nq, "nq", provider, b=SPEC_B, nq=nq, nk=SPEC_NK,
             page=SPEC_PAGE, causal=True)  # fmt: skip


@pytest.mark.parametrize("provider", APPEND_PROVIDERS)
@pytest.mark.parametrize("nk", APPEND_NKS)
def test_append(benchmark, nk, provider):
    tag = f"append-b{APPEND_B}-q1-{SHAPE}"
    fn = run_cell(benchmark, "kvcache-append", tag, nk, "nk", provider, b=APPEND_B, nq=1, nk=nk)
    extra = benchmark.extra_info
    if provider != "ours" or "ms" not in extra:  # the A/B needs a GPU and a measured cell
        return
    # The same cache, without the append: interleaved with the step itself, so clock drift
    # hits both alike (the separate ours_noappend cell is timed minutes apart).
    q, k_cache, v_cache = fn.args[:3]
    noappend = ours(q, k_cache, v_cache, None, nk)
    with torch.no_grad():
        t = interleaved_ms({"append": fn, "noappend": noappend})
    (a, spread_a), (n, spread_n) = t["append"], t["noappend"]
    extra.update(append_ms=a, noappend_ms=n, append_ratio=a / n, append_pct=100 * (a / n - 1),
                 append_spread=max(spread_a, spread_n))  # fmt: skip
    summarize(benchmark, "kvcache-append",
              f"kvcache-append: one decode step with and without its in-place append (µs, "
              f"interleaved A/B; B = {APPEND_B}, Nq = 1, {SHAPE}; goal < 1.03x)",
              [["nk", nk]], {"ours": 1000 * a, "ours_noappend": 1000 * n},
              ["ours", "ours_noappend"],
              {"append / no append": ["ours", "ours_noappend"]})  # fmt: skip
