"""kernelkit-flash-attn: FlashAttention-2 style fused attention in Triton, forward and backward
(causal, GQA/MQA, any N, head dim 16..256, deterministic gradients)."""

from .adapter import FlashAttentionFunction
from .op import flash_attn

__version__ = "0.2.0"
__all__ = ["FlashAttentionFunction", "__version__", "flash_attn"]
