"""kernelkit-lrpe-cosine (work in progress)."""

__version__ = "0.1.0"
