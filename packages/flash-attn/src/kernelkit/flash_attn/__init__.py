"""kernelkit-flash-attn (work in progress)."""

__version__ = "0.1.0"
