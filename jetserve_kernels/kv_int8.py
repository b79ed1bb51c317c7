"""The int8 KV cache (`kv_cache.dtype: int8`): every (token, KV head) row of the cache is that
head's head_dim values as int8 followed by their fp32 scale in 4 bytes, so a cache tensor is int8
[num_blocks, block_size, num_kv_heads, head_dim + 4] and value = scale * q.

A scale per row, rather than per block: a row is written once, when its token is computed, and
never rescaled, so no block has to be requantized as later tokens arrive. It costs 4 bytes per
head_dim (6 % at 64), and each row's values use the full int8 range. Symmetric, round to nearest:
scale = max |x| / 127. The CPU kernels (jetserve_kernels/cpu/) read and write the same layout.
"""

from __future__ import annotations

import torch

SCALE_BYTES = 4


def is_int8(cache: torch.Tensor) -> bool:
    return cache.dtype == torch.int8


def head_dim_of(cache: torch.Tensor) -> int:
    return cache.shape[-1] - SCALE_BYTES if is_int8(cache) else cache.shape[-1]


def quantize(x: torch.Tensor) -> torch.Tensor:
    """x [..., D] -> int8 rows [..., D + 4]."""
    x32 = x.float()
    scale = x32.abs().amax(-1, keepdim=True) / 127
    q = torch.round(x32 / torch.where(scale > 0, scale, torch.ones_like(scale)))
    out = torch.empty(*x.shape[:-1], x.shape[-1] + SCALE_BYTES, dtype=torch.int8, device=x.device)
    out[..., :x.shape[-1]] = q.to(torch.int8)
    out[..., x.shape[-1]:] = scale.view(torch.int8)
    return out


def dequantize(rows: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """int8 rows [..., D + 4] -> values [..., D]."""
    d = rows.shape[-1] - SCALE_BYTES
    scale = rows[..., d:].contiguous().view(torch.float32)  # [..., 1]
    return (rows[..., :d].float() * scale).to(dtype)
