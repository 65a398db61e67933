"""kernelkit-act: relu / sigmoid / silu / softmax (any dim) in Triton, forward and backward.

Device-level building blocks for other packages live in `kernelkit.act.kernels`.
"""

from .op import ACTS, act, softmax_chunk_stats

__version__ = "0.1.0"
__all__ = ["ACTS", "__version__", "act", "softmax_chunk_stats"]
