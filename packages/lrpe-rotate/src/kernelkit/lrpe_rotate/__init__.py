"""kernelkit-lrpe-rotate (work in progress)."""

__version__ = "0.1.0"
