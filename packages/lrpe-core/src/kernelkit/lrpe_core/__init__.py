"""kernelkit-lrpe-core: the positional code the kernelkit LRPE packages share.

`kernels` (device helpers), `op` (validation, launch arguments, plans, d(theta) reduction) and
`reference` (positions, frequencies, angles). No op of its own.
"""

__version__ = "0.2.2"
__all__ = ["__version__"]
