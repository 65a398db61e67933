"""Load balance of the persistent Gluon forward (issue 32): a model, no GPU. Each tile of 128
query rows costs its key blocks (causal, optionally a window of W blocks before the diagonal);
the kernel's time is the busiest program's sum. Prints max / mean work per program for the
shipped static walk (unit u to program u mod P, longest rows of each head first, causal pairs
or not) and for a dynamic walk (each program takes the next unit in the same order when it is
free: FlashAttention-3's tile scheduler, an atomic counter).

    python lab/flash-attn/ab/persistent_balance.py

Check against the H200 suite (d128, B 1, H 16, N 16k, forward ms): the static model's
busiest program predicts window 4k 0.908 (measured 0.908), window 8k 1.789 (1.742) from plain
causal's 1.775 with pairs; the 1k window measures 0.312 against 0.248 predicted (per-tile
costs the model leaves out).
"""

from __future__ import annotations

import heapq

SMS = 132  # H100 SXM / H200 programs of the persistent kernel


def blocks(m: int, window_blocks: int | None) -> int:
    """Key blocks of query tile m (causal; a window reaching window_blocks blocks back)."""
    return m + 1 - (0 if window_blocks is None else max(0, m - window_blocks))


def units(num_m: int, heads: int, window_blocks: int | None, pairs: bool) -> list[int]:
    """Work of each unit in launch order: heads one after another, longest rows first; with
    pairs, tiles num_m - 1 - j and j together."""
    if pairs:
        one = [blocks(num_m - 1 - j, window_blocks) + blocks(j, window_blocks)
               for j in range(num_m // 2)]  # fmt: skip
    else:
        one = [blocks(num_m - 1 - i, window_blocks) for i in range(num_m)]
    return one * heads


def static_imbalance(work: list[int], programs: int = SMS) -> float:
    per = [sum(work[p::programs]) for p in range(programs)]
    return max(per) / (sum(per) / programs)


def dynamic_imbalance(work: list[int], programs: int = SMS) -> float:
    free = [(0, p) for p in range(programs)]
    for w in work:
        t, p = heapq.heappop(free)
        heapq.heappush(free, (t + w, p))
    return max(t for t, _ in free) / (sum(work) / programs)


def main() -> None:
    print("N      window  static  static+pairs  dynamic  (max / mean work per program)")
    for n in (4096, 8192, 16384, 65536):
        num_m, heads = n // 128, max(1, 16384 // n) * 16
        for window in (None, 1024, 4096, 8192):
            wb = None if window is None else window // 128
            flat, paired = units(num_m, heads, wb, False), units(num_m, heads, wb, True)
            print(f"{n:<6} {window or '-':>6}  {static_imbalance(flat):.3f}  "
                  f"{static_imbalance(paired):.3f}         {dynamic_imbalance(flat):.3f}")  # fmt: skip


if __name__ == "__main__":
    main()
