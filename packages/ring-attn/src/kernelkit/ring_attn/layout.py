"""How a sequence is sharded over the ranks of a ring, and what each ring step computes.

Layouts of a sequence of N tokens over W ranks:
* "contiguous": rank r holds chunk r of W equal chunks.
* "zigzag": the sequence is cut into 2W equal chunks and rank r holds chunks r and 2W-1-r, in
  that order. Under a causal mask every rank then has the same work at every ring step (a
  contiguous rank r would see r+1 of W key shards, so the last rank would set the pace).

`shard`, `unshard`, `positions` are pure functions of (rank, world size, layout); `step_blocks`
is the schedule the forward and backward loops follow: for the key shard of rank `src`, which
query rows attend to which key rows, and whether under a causal mask.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

LAYOUTS = ("zigzag", "contiguous")


def check_layout(layout) -> str:
    if layout not in LAYOUTS:
        raise ValueError(f"layout: expected one of {LAYOUTS}, got {layout!r}")
    return layout


def _check_rank(rank, world_size) -> None:
    for name, value in (("rank", rank), ("world_size", world_size)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"{name}: expected an int, got {type(value).__name__}")
    if world_size < 1:
        raise ValueError(f"world_size: must be >= 1, got {world_size}")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank: must be in 0..{world_size - 1}, got {rank}")


def chunk_ids(rank: int, world_size: int, layout: str = "zigzag") -> tuple[int, ...]:
    """The chunks rank `rank` holds, in order: chunks of N / W tokens ("contiguous") or of
    N / (2W) tokens ("zigzag")."""
    _check_rank(rank, world_size)
    if check_layout(layout) == "contiguous":
        return (rank,)
    return (rank, 2 * world_size - 1 - rank)


def _chunks(layout: str, world_size: int) -> int:
    return world_size if layout == "contiguous" else 2 * world_size


def _check_length(n: int, layout: str, world_size: int, what: str) -> int:
    parts = _chunks(layout, world_size)
    if n % parts:
        raise ValueError(
            f"{what}: {n} tokens do not split into {parts} equal chunks ({layout} layout over "
            f"{world_size} ranks needs a multiple of {parts})"
        )
    return n // parts


def shard(
    x: torch.Tensor, rank: int, world_size: int, layout: str = "zigzag", dim: int = 1
) -> torch.Tensor:
    """Rank `rank`'s shard of the full sequence `x` (the sequence along `dim`): a new tensor."""
    ids = chunk_ids(rank, world_size, layout)
    c = _check_length(x.shape[dim], layout, world_size, "x")
    return torch.cat([x.narrow(dim, i * c, c) for i in ids], dim=dim)


def unshard(shards: Sequence[torch.Tensor], layout: str = "zigzag", dim: int = 1) -> torch.Tensor:
    """The full sequence from every rank's shard, given in rank order (`shard`'s inverse)."""
    world_size = len(shards)
    if world_size < 1:
        raise ValueError("shards: expected one shard per rank, got none")
    n_local = shards[0].shape[dim]
    for r, s in enumerate(shards):
        if s.shape != shards[0].shape:
            raise ValueError(
                f"shards: rank {r}'s shard has shape {tuple(s.shape)}, rank 0's "
                f"{tuple(shards[0].shape)}"
            )
    per = len(chunk_ids(0, world_size, check_layout(layout)))
    if n_local % per:
        raise ValueError(f"shards: {n_local} tokens per shard do not split into {per} chunks")
    c = n_local // per
    pieces: list[torch.Tensor | None] = [None] * (per * world_size)
    for r, s in enumerate(shards):
        for j, i in enumerate(chunk_ids(r, world_size, layout)):
            pieces[i] = s.narrow(dim, j * c, c)
    return torch.cat(pieces, dim=dim)


def positions(
    n: int, rank: int, world_size: int, layout: str = "zigzag", device=None
) -> torch.Tensor:
    """The positions in the full sequence of rank `rank`'s tokens: (1, N / W) int64, for the
    `positions=` argument of the LRPE ops (kernelkit-lrpe-rotate, -cosine) on a shard."""
    ids = chunk_ids(rank, world_size, layout)
    c = _check_length(n, layout, world_size, "n")
    return torch.cat([torch.arange(i * c, (i + 1) * c, device=device) for i in ids])[None]


@dataclass(frozen=True)
class Block:
    """One attention call of a ring step: local query rows `q_rows` against rows `k_rows` of the
    key shard in hand, with a causal mask (aligned as in flash_attn: square here) or none."""

    q_rows: slice
    k_rows: slice
    causal: bool


def step_blocks(
    rank: int, src: int, world_size: int, n_local: int, causal: bool, layout: str
) -> tuple[Block, ...]:
    """What rank `rank` computes with rank `src`'s key shard (n_local tokens each).

    Not causal: every query sees every key. Causal, contiguous: the own shard under the mask,
    earlier shards whole, later ones not at all. Causal, zigzag (chunks r and 2W-1-r, each half
    a shard): the own shard under the mask; a shard of an earlier rank, its first half (chunk
    src < r) seen whole by every query and its second half by none; a later rank's shard,
    seen whole by the queries of chunk 2W-1-r only. Every step but the first is then half a
    shard squared on every rank.
    """
    _check_rank(rank, world_size)
    _check_rank(src, world_size)
    everything = slice(0, n_local)
    if not causal:
        return (Block(everything, everything, False),)
    if src == rank:
        return (Block(everything, everything, True),)
    if check_layout(layout) == "contiguous":
        return (Block(everything, everything, False),) if src < rank else ()
    if n_local % 2:
        raise ValueError(f"q: zigzag sharding needs an even N_local, got {n_local}")
    half = n_local // 2
    if src < rank:
        return (Block(everything, slice(0, half), False),)
    return (Block(slice(half, n_local), everything, False),)


__all__ = [
    "LAYOUTS",
    "Block",
    "check_layout",
    "chunk_ids",
    "positions",
    "shard",
    "step_blocks",
    "unshard",
]
