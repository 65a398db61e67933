"""The sharding layouts and the ring's schedule, without processes: shard / unshard invert each
other, positions are each shard's place in the sequence, and over the W steps of a ring every
(query, key) pair the mask lets through is computed exactly once and no other."""

from __future__ import annotations

import pytest
import torch

from kernelkit.ring_attn import chunk_ids, positions, shard, step_blocks, unshard

LAYOUTS = ("zigzag", "contiguous")


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("world", [1, 2, 3, 4, 8])
def test_shard_unshard_positions(world, layout):
    n = 4 * world * 3
    x = torch.arange(2 * n * 3).view(2, n, 3)
    shards = [shard(x, r, world, layout) for r in range(world)]
    assert torch.equal(unshard(shards, layout), x)
    for r, s in enumerate(shards):
        pos = positions(n, r, world, layout)
        assert pos.shape == (1, n // world) and pos.dtype == torch.int64
        assert torch.equal(s, x[:, pos[0]])  # the shard's rows are these positions' rows
    every = torch.cat([positions(n, r, world, layout)[0] for r in range(world)])
    assert torch.equal(every.sort().values, torch.arange(n))
    lse = torch.randn(2, 3, n)  # the LSE's sequence axis is dim 2
    assert torch.equal(unshard([shard(lse, r, world, layout, dim=2) for r in range(world)],
                               layout, dim=2), lse)  # fmt: skip


def test_zigzag_chunks():
    assert [chunk_ids(r, 4) for r in range(4)] == [(0, 7), (1, 6), (2, 5), (3, 4)]
    assert [chunk_ids(r, 4, "contiguous") for r in range(4)] == [(0,), (1,), (2,), (3,)]


def _covered(world, n_local, causal, layout):
    """(rank, global query, global key) -> how many ring steps compute that pair."""
    n = n_local * world
    count = torch.zeros(n, n, dtype=torch.int64)
    work = torch.zeros(world, world, dtype=torch.int64)  # pairs per (rank, step)
    for rank in range(world):
        qpos = positions(n, rank, world, layout)[0]
        for step in range(world):
            src = (rank - step) % world
            kpos = positions(n, src, world, layout)[0]
            for blk in step_blocks(rank, src, world, n_local, causal, layout):
                qi, kj = qpos[blk.q_rows], kpos[blk.k_rows]
                seen = torch.ones(len(qi), len(kj), dtype=torch.bool)
                if blk.causal:  # flash_attn's mask on the block, in block coordinates
                    seen = torch.ones_like(seen).tril(len(kj) - len(qi))
                # the block's mask must be the full sequence's mask there
                full = kj[None, :] <= qi[:, None] if causal else torch.ones_like(seen)
                assert torch.equal(seen, full)
                count[qi[:, None].expand_as(seen)[seen], kj[None, :].expand_as(seen)[seen]] += 1
                work[rank, step] += int(seen.sum())
    return count, work


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("world", [1, 2, 3, 4, 8])
def test_every_visible_pair_once(world, causal, layout):
    n_local = 8
    count, work = _covered(world, n_local, causal, layout)
    n = n_local * world
    visible = torch.ones(n, n, dtype=torch.int64)
    if causal:
        visible = visible.tril()
    assert torch.equal(count, visible)
    if causal and layout == "zigzag":  # balanced: every rank the same work at every step
        assert (work == work[:1]).all(), work  # each step: the same on every rank
        assert (work[:, 1:] == (n_local // 2) * n_local).all(), work


def test_errors():
    with pytest.raises(ValueError, match="layout: expected one of"):
        shard(torch.zeros(1, 8), 0, 2, "striped")
    with pytest.raises(ValueError, match="x: 6 tokens do not split into 4 equal chunks"):
        shard(torch.zeros(1, 6), 0, 2)
    with pytest.raises(ValueError, match="rank: must be in 0..1, got 2"):
        shard(torch.zeros(1, 8), 2, 2)
    with pytest.raises(ValueError, match="world_size: must be >= 1"):
        positions(8, 0, 0)
    with pytest.raises(ValueError, match="shards: rank 1's shard has shape"):
        unshard([torch.zeros(1, 4), torch.zeros(1, 2)])
    with pytest.raises(ValueError, match="shards: expected one shard per rank"):
        unshard([])
    with pytest.raises(ValueError, match="q: zigzag sharding needs an even N_local"):
        step_blocks(0, 1, 2, 7, True, "zigzag")


@pytest.mark.parametrize("layout", LAYOUTS)
def test_positions_feed_the_lrpe_ops(layout, device):
    """A rank's LRPE rotation of its shard with `positions` is its shard of the rotation of the
    whole sequence (the kernels of kernelkit-lrpe-rotate, any act)."""
    from kernelkit.lrpe_rotate import lrpe_rotate

    world, n, h, d = 4, 32, 2, 32
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, n, h, d, generator=g).to(device)
    theta = (10000 ** (-torch.arange(d // 2) / (d // 2))).repeat(h, 1).to(device)
    whole = lrpe_rotate(x, theta, act="silu")
    for r in range(world):
        pos = positions(n, r, world, layout, device=device)
        mine = lrpe_rotate(shard(x, r, world, layout), theta, act="silu", positions=pos)
        assert torch.equal(mine, shard(whole, r, world, layout))
