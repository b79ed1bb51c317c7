"""The int8 KV cache (`kv_cache.dtype: int8`): every (token, KV head) row of the cache is that
head's head_dim values as int8 codes, then for each group of 32 of them (the whole row where
head_dim is under 32) an fp16 scale and an fp16 offset, value = scale * code + offset. A cache
tensor is int8 [num_blocks, block_size, num_kv_heads, head_dim + head_dim / 8] (72 bytes a row at
head_dim 64).

Why this shape, measured (BENCHMARKS.md, "int8 KV that keeps quality"): keys are what int8
loses. One symmetric scale a row (max |x| / 127) agreed with an fp32 cache on 98.4 % of greedy
next tokens under teacher forcing; post-rotary keys sit off zero by different amounts in
different channels, so an offset (the midpoint of each group's range) and a range per 32
channels put the 255 levels where each group's values are: 99.4 %. Scales per channel across
tokens (as KIVI does) would need a block's rows rescaled as tokens arrive; a row here is written
once, when its token is computed, and never touched again. Values use the same layout, so every
kernel reads one kind of row.

Quantizing a group: offset = fp16((min + max) / 2); reach = max(max - offset, offset - min) (with
the rounded offset); scale = fp16(reach / 127); code = (x - offset) * (1 / scale) rounded to
nearest, clamped to [-127, 127] (0 where scale is 0). The offset and scale are clamped to fp16's
range (65,504), so a group far past it comes back rounded coarsely or clamped, never inf or NaN.
The CPU kernels (jetserve_kernels/cpu/) and the Triton ones read and write the same layout.
"""

from __future__ import annotations

import torch

GROUP = 32  # codes per (scale, offset) pair
PARAM_BYTES = 4  # an fp16 scale and an fp16 offset
FP16_MAX = 65504.0


def is_int8(cache: torch.Tensor) -> bool:
    return cache.dtype == torch.int8


def group_size(head_dim: int) -> int:
    return min(GROUP, head_dim)


def row_bytes(head_dim: int) -> int:
    """Bytes of one (token, KV head) row of an int8 cache."""
    if head_dim % group_size(head_dim):
        raise ValueError(f"kv_cache.dtype int8 needs head_dim under {GROUP} or a multiple of "
                         f"{GROUP}; the model's is {head_dim}")
    return head_dim + head_dim // group_size(head_dim) * PARAM_BYTES


def head_dim_of(cache: torch.Tensor) -> int:
    if not is_int8(cache):
        return cache.shape[-1]
    row = cache.shape[-1]
    return row - PARAM_BYTES if row < GROUP + PARAM_BYTES else row * GROUP // (GROUP + PARAM_BYTES)


def quantize(x: torch.Tensor) -> torch.Tensor:
    """x [..., D] -> int8 rows [..., D + D / 8]."""
    d, g = x.shape[-1], group_size(x.shape[-1])
    out = torch.empty(*x.shape[:-1], row_bytes(d), dtype=torch.int8, device=x.device)
    groups = x.float().unflatten(-1, (d // g, g))
    lo, hi = groups.amin(-1, keepdim=True), groups.amax(-1, keepdim=True)
    offset = ((lo + hi) / 2).clamp(-FP16_MAX, FP16_MAX).half()
    reach = torch.maximum(hi - offset.float(), offset.float() - lo)
    scale = (reach / 127).clamp(max=FP16_MAX).half()
    inv = torch.where(scale > 0, 1 / scale.float(), torch.zeros_like(reach))
    codes = torch.round((groups - offset.float()) * inv).clamp_(-127, 127)
    out[..., :d] = codes.flatten(-2).to(torch.int8)
    out[..., d:] = torch.cat((scale, offset), -1).flatten(-2).view(torch.int8)
    return out


def dequantize(rows: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """int8 rows [..., D + D / 8] -> values [..., D]. In float64, code * scale + offset is exact:
    rounded to fp32 it has the bits of the kernels' one fused multiply-add."""
    d = head_dim_of(rows)
    compute = torch.float64 if dtype == torch.float64 else torch.float32
    params = rows[..., d:].contiguous().view(torch.float16).to(compute)  # [..., 2 * groups]
    scale, offset = params[..., 0::2, None], params[..., 1::2, None]
    codes = rows[..., :d].to(compute).unflatten(-1, (scale.shape[-2], -1))
    return (codes * scale + offset).flatten(-2).to(dtype)
