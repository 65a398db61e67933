"""kernelkit-act: relu / sigmoid / silu / softmax (any dim) in Triton, forward and backward.

Host API for other kernelkit packages (stable within 0.2.x):
  ACTS, ELEMENTWISE_ACTS, FLOAT_DTYPES   the act names and the float dtypes the kernels take;
  softmax_chunk_stats(x, dim, *, cu_seqlens=None, ops=None, view=None, max_chunks=None)
                                         per-chunk (max, sum) of a softmax over a long axis,
                                         shape (2, O, C, I) (packed: (2, S * O, C, I)), read
                                         once from x (through kernelkit.shared.replay's `ops`,
                                         x read as `view`, when given; in at most
                                         `max_chunks` chunks, when given);
  MAX_PACKED_SEQUENCES                   the most sequences `cu_seqlens` may describe there.
Device-level building blocks (element-wise acts and their gradients, online-softmax stats,
merging, normalising, combining chunk stats) live in `kernelkit.act.kernels`.
"""

from .kernels import ELEMENTWISE_ACTS
from .launchers import MAX_PACKED_SEQUENCES, softmax_chunk_stats
from .op import ACTS, FLOAT_DTYPES, act

__version__ = "0.2.9"
__all__ = [
    "ACTS",
    "ELEMENTWISE_ACTS",
    "FLOAT_DTYPES",
    "MAX_PACKED_SEQUENCES",
    "__version__",
    "act",
    "softmax_chunk_stats",
]
