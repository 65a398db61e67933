"""kernelkit-ring-attn: context-parallel attention across GPUs on torch.distributed. Each rank
holds a shard of the sequence; key/value shards travel around a ring of point-to-point
transfers, overlapped with kernelkit-flash-attn's kernels, and partial results merge by their
log-sum-exp. Zigzag sharding balances the causal mask; forward and backward, GQA, softcap,
deterministic gradients."""

from .comm import check_shards
from .layout import LAYOUTS, chunk_ids, positions, shard, step_blocks, unshard
from .op import ring_attn

__version__ = "0.1.0"
__all__ = [
    "LAYOUTS",
    "__version__",
    "check_shards",
    "chunk_ids",
    "positions",
    "ring_attn",
    "shard",
    "step_blocks",
    "unshard",
]
