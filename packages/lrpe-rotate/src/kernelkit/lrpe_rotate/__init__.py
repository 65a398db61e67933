"""kernelkit-lrpe-rotate: LRPE rotation (RoPE-style, half-split pairing) of act(x) in Triton,
forward and backward (x and learnable theta), any strides, int or per-batch offsets."""

from .op import ACTS, lrpe_rotate

__version__ = "0.1.0"
__all__ = ["ACTS", "__version__", "lrpe_rotate"]
