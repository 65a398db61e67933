"""kernelkit-lrpe-cosine: the LRPE cosine feature map with a fused activation, in Triton.

Device-level building blocks (the position -> angle mapping among them) live in
`kernelkit.lrpe_cosine.kernels`.
"""

from .op import ACTS, lrpe_cosine

__version__ = "0.1.0"
__all__ = ["ACTS", "__version__", "lrpe_cosine"]
