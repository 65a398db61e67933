"""The ring's communication on torch.distributed: each rank sends to rank + 1 and receives
from rank - 1 with `batch_isend_irecv`, and checks once that the ranks' shards agree.

Overlap: the sends and receives are posted before the step's attention and waited for after
it. With NCCL they run on the process group's own communication stream and `wait()` only
makes the current stream wait for them (the host never blocks); with gloo (CPU) `wait()`
blocks the host until the transfer is done.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist


def group_name(group) -> str:
    """The registered name of `group` (None: the default group), which the ops take instead of
    the group object (an op's schema holds strings, not process groups)."""
    if not dist.is_available() or not dist.is_initialized():
        raise ValueError(
            "group: torch.distributed is not initialized (call "
            "torch.distributed.init_process_group first)"
        )
    if group is None:
        group = dist.group.WORLD
    if not isinstance(group, dist.ProcessGroup):
        raise ValueError(f"group: expected a torch.distributed ProcessGroup or None, got {group!r}")
    return group.group_name


def resolve(name: str) -> dist.ProcessGroup:
    return dist.distributed_c10d._resolve_process_group(name)


@dataclass(frozen=True)
class Ring:
    """This rank's place in the ring of `group`: sends go to `next`, receives come from `prev`
    (global ranks, as torch.distributed's point-to-point calls take them)."""

    group: dist.ProcessGroup
    rank: int
    world_size: int
    next: int
    prev: int

    @classmethod
    def of(cls, group: dist.ProcessGroup) -> Ring:
        rank, world = dist.get_rank(group), dist.get_world_size(group)
        ranks = dist.get_process_group_ranks(group)
        return cls(group, rank, world, ranks[(rank + 1) % world], ranks[(rank - 1) % world])

    def exchange(self, tensors: tuple[torch.Tensor, ...]) -> Exchange:
        """Post: send `tensors` to the next rank, receive tensors shaped like them from the
        previous one. Returns at once; `.wait()` gives the received tensors."""
        sent = tuple(t.contiguous() for t in tensors)
        received = tuple(torch.empty_like(t) for t in sent)
        ops = [dist.P2POp(dist.isend, t, self.next, self.group) for t in sent]
        ops += [dist.P2POp(dist.irecv, t, self.prev, self.group) for t in received]
        return Exchange(dist.batch_isend_irecv(ops), sent, received)


@dataclass
class Exchange:
    works: list
    sent: tuple[torch.Tensor, ...]  # kept alive until the transfer is waited for
    received: tuple[torch.Tensor, ...]

    def wait(self) -> tuple[torch.Tensor, ...]:
        for w in self.works:
            w.wait()
        return self.received


# The groups whose ranks were checked against each other (`check_shards` on a ring_attn call).
_checked: set[str] = set()


def _signature(q, k, v, causal, layout, scale, softcap) -> dict:
    return {
        "q": (tuple(q.shape), str(q.dtype), q.device.type),
        "k": (tuple(k.shape), str(k.dtype), k.device.type),
        "v": (tuple(v.shape), str(v.dtype), v.device.type),
        "causal": causal,
        "layout": layout,
        "softmax_scale": scale,
        "softcap": softcap,
    }


def check_shards(q, k, v, group=None, *, causal=False, layout="zigzag", softmax_scale=None,
                 softcap=0.0, local_error: str | None = None) -> None:  # fmt: skip
    """Check that every rank of `group` calls ring attention alike: the same shard shapes,
    dtypes and device types, the same causal, layout, softmax_scale and softcap. Collective:
    every rank of the group must call it; it syncs the host once (`all_gather_object`).
    Raises the same ValueError on every rank, naming the argument and the ranks that differ.

    `ring_attn` runs it on its first call for each group; call it yourself when shapes change
    (otherwise ranks with shards of different lengths fail inside the transfers or hang).
    local_error: this rank's own argument error, raised on every rank instead of leaving the
    others waiting in a transfer."""
    name = group_name(group)
    pg = resolve(name)
    mine = _signature(q, k, v, causal, layout, softmax_scale, softcap)
    everyone: list = [None] * dist.get_world_size(pg)
    dist.all_gather_object(everyone, (local_error, mine), group=pg)
    for r, (error, _) in enumerate(everyone):
        if error is not None:
            raise ValueError(f"{error} (on rank {r} of {len(everyone)})")
    first = everyone[0][1]
    for key in first:
        differ = [r for r, (_, sig) in enumerate(everyone) if sig[key] != first[key]]
        if differ:
            seen = {r: everyone[r][1][key] for r in (0, *differ)}
            raise ValueError(
                f"{key}: differs across the ranks of the ring (rank: value) {seen}; every rank "
                f"must pass shards of the same shape, dtype and device type, and the same options"
            )
    _checked.add(name)


def checked(name: str) -> bool:
    return name in _checked


__all__ = ["Exchange", "Ring", "check_shards", "checked", "group_name", "resolve"]
