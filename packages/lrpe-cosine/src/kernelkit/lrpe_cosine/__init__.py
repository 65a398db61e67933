"""kernelkit-lrpe-cosine: the LRPE cosine feature map with a fused activation, in Triton.

The kernels (`kernelkit.lrpe_cosine.kernels`) also take tokens on a grid and an angle cache:
kernelkit-md-lrpe-cosine launches them that way.
"""

from kernelkit.act import ACTS

from .op import lrpe_cosine

__version__ = "0.2.9"
__all__ = ["ACTS", "__version__", "lrpe_cosine"]
