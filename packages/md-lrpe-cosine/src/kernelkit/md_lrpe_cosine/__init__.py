"""kernelkit-md-lrpe-cosine: LRPE cosine for tokens on 1-D/2-D/3-D grids with extra leading
tokens, in Triton (the kernels are kernelkit-lrpe-cosine's, launched with grid positions)."""

from kernelkit.act import ACTS

from .op import md_lrpe_cosine

__version__ = "0.1.5"
__all__ = ["ACTS", "__version__", "md_lrpe_cosine"]
