"""kernelkit-flash-attn: FlashAttention-2 style fused attention in Triton, forward and backward
(causal, sliding windows, softcap, GQA/MQA, any N, packed variable-length batches, head dim
16..256, deterministic gradients), and attention over a contiguous or paged KV cache with
in-place append for serving."""

from .adapter import FlashAttentionFunction
from .kvcache import flash_attn_with_kvcache
from .op import explain, flash_attn, flash_attn_backward, flash_attn_varlen

__version__ = "0.17.4"
__all__ = [
    "FlashAttentionFunction",
    "__version__",
    "explain",
    "flash_attn",
    "flash_attn_backward",
    "flash_attn_varlen",
    "flash_attn_with_kvcache",
]
