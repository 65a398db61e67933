"""kernelkit-lrpe-rotate: LRPE rotation (RoPE-style) with a fused activation, in Triton."""

from kernelkit.act import ACTS

from .op import lrpe_rotate

__version__ = "0.2.10"
__all__ = ["ACTS", "__version__", "lrpe_rotate"]
