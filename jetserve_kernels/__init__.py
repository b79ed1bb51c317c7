"""Triton kernels for the executor's hot paths; `jetserve_kernels.reference` holds a torch
implementation of each with the same signature. On a CPU they run only under TRITON_INTERPRET=1
(set before triton is imported)."""

from jetserve_kernels.attention import paged_attention
from jetserve_kernels.elementwise import reshape_and_cache, rms_norm, rotary_embedding, silu_and_mul

__all__ = ["paged_attention", "reshape_and_cache", "rms_norm", "rotary_embedding", "silu_and_mul"]
