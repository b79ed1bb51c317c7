"""The small per-layer kernels: RMSNorm (optionally fused with the residual add), NeoX rotary
embedding in place, SiLU-and-multiply, and writing new keys and values into the paged cache."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from jetserve_kernels import kv_int8


@triton.jit
def _rms_norm_kernel(x_ptr, weight_ptr, out_ptr, residual_ptr, residual_out_ptr, n_cols,
                     stride_x, stride_residual, stride_out, stride_residual_out, eps,
                     HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        x += tl.load(residual_ptr + row * stride_residual + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(residual_out_ptr + row * stride_residual_out + cols,
                 x.to(residual_out_ptr.dtype.element_ty), mask=mask)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / n_cols + eps)
    weight = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_out + cols, (x * rstd * weight).to(out_ptr.dtype.element_ty),
             mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None):
    """norm(x) * weight; with `residual`, (norm(x + residual) * weight, x + residual)."""
    assert x.stride(-1) == 1 and x.dim() == 2
    rows, cols = x.shape
    out = torch.empty_like(x)
    residual_out = torch.empty_like(x) if residual is not None else out
    block = triton.next_power_of_2(cols)
    _rms_norm_kernel[(rows,)](
        x, weight, out, residual if residual is not None else x, residual_out, cols, x.stride(0),
        residual.stride(0) if residual is not None else 0, out.stride(0), residual_out.stride(0),
        eps, HAS_RESIDUAL=residual is not None, BLOCK=block)
    return out if residual is None else (out, residual_out)


@triton.jit
def _rotate_heads(x_ptr, token, stride_t, stride_h, num_heads, cos, sin, HALF: tl.constexpr,
                  BLOCK_HEADS: tl.constexpr):
    heads = tl.arange(0, BLOCK_HEADS)[:, None]
    mask = heads < num_heads
    first = x_ptr + token * stride_t + heads * stride_h + tl.arange(0, HALF)[None, :]
    x1 = tl.load(first, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(first + HALF, mask=mask, other=0.0).to(tl.float32)
    tl.store(first, (x1 * cos - x2 * sin).to(x_ptr.dtype.element_ty), mask=mask)
    tl.store(first + HALF, (x2 * cos + x1 * sin).to(x_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rotary_kernel(positions_ptr, q_ptr, k_ptr, cos_sin_ptr, stride_qt, stride_qh, stride_kt,
                   stride_kh, stride_cos_sin, num_q_heads, num_k_heads, HALF: tl.constexpr,
                   BLOCK_HEADS: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    position = tl.load(positions_ptr + token).to(tl.int64)
    offs = tl.arange(0, HALF)
    cos = tl.load(cos_sin_ptr + position * stride_cos_sin + offs).to(tl.float32)[None, :]
    sin = tl.load(cos_sin_ptr + position * stride_cos_sin + HALF + offs).to(tl.float32)[None, :]
    _rotate_heads(q_ptr, token, stride_qt, stride_qh, num_q_heads, cos, sin, HALF, BLOCK_HEADS)
    _rotate_heads(k_ptr, token, stride_kt, stride_kh, num_k_heads, cos, sin, HALF, BLOCK_HEADS)


def rotary_embedding(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                     cos_sin_cache: torch.Tensor) -> None:
    """In place, NeoX style; cos_sin_cache [max_position, head_dim] = [cos | sin]."""
    head_dim = q.shape[-1]
    half = head_dim // 2
    assert q.stride(-1) == 1 and k.stride(-1) == 1 and half == triton.next_power_of_2(half)
    assert cos_sin_cache.shape[-1] == head_dim and cos_sin_cache.stride(-1) == 1
    _rotary_kernel[(q.shape[0],)](
        positions, q, k, cos_sin_cache, q.stride(0), q.stride(1), k.stride(0), k.stride(1),
        cos_sin_cache.stride(0), q.shape[1], k.shape[1], HALF=half,
        BLOCK_HEADS=triton.next_power_of_2(max(q.shape[1], k.shape[1])))


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, d, stride_x, stride_out, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < d
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + d + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_out + cols,
             (gate / (1.0 + tl.exp(-gate)) * up).to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x [n, 2d] -> silu(x[:, :d]) * x[:, d:]."""
    assert x.dim() == 2 and x.stride(-1) == 1
    d = x.shape[1] // 2
    out = torch.empty((x.shape[0], d), dtype=x.dtype, device=x.device)
    block = min(1024, triton.next_power_of_2(d))
    _silu_and_mul_kernel[(x.shape[0], triton.cdiv(d, block))](
        x, out, d, x.stride(0), out.stride(0), BLOCK=block)
    return out


@triton.jit
def _reshape_and_cache_kernel(key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
                              stride_kt, stride_kh, stride_vt, stride_vh, stride_block,
                              stride_offset, stride_head, block_size, num_kv_heads, head_dim,
                              BLOCK_HEADS: tl.constexpr, BLOCK_D: tl.constexpr,
                              INT8: tl.constexpr, GROUP: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    if slot < 0:  # a padding token: nothing to write
        return
    head_ids = tl.arange(0, BLOCK_HEADS)
    heads = head_ids[:, None]
    dims = tl.arange(0, BLOCK_D)[None, :]
    mask = (heads < num_kv_heads) & (dims < head_dim)
    rows = (slot // block_size) * stride_block + (slot % block_size) * stride_offset \
        + head_ids * stride_head
    key = tl.load(key_ptr + token * stride_kt + heads * stride_kh + dims, mask=mask, other=0.0)
    value = tl.load(value_ptr + token * stride_vt + heads * stride_vh + dims, mask=mask, other=0.0)
    if INT8:
        _store_int8_rows(k_cache_ptr, rows, dims, key, mask, head_ids < num_kv_heads, head_dim,
                         BLOCK_HEADS, BLOCK_D, GROUP)
        _store_int8_rows(v_cache_ptr, rows, dims, value, mask, head_ids < num_kv_heads, head_dim,
                         BLOCK_HEADS, BLOCK_D, GROUP)
    else:
        tl.store(k_cache_ptr + rows[:, None] + dims, key, mask=mask)
        tl.store(v_cache_ptr + rows[:, None] + dims, value, mask=mask)


@triton.jit
def _store_int8_rows(cache_ptr, rows, dims, x, mask, head_mask, head_dim,
                     BLOCK_HEADS: tl.constexpr, BLOCK_D: tl.constexpr, GROUP: tl.constexpr):
    """Each head's values as an int8 row (jetserve_kernels/kv_int8.py): per group of GROUP, an
    fp16 offset (the range's midpoint) and scale (reach / 127), both clamped to fp16's range;
    the codes rounded to nearest (kv_int8.py rounds ties to even, this away from zero: the
    interpreter has no rint), then the groups' scales and offsets after the codes."""
    groups: tl.constexpr = BLOCK_D // GROUP
    x = x.to(tl.float32)
    lo = tl.min(tl.reshape(tl.where(mask, x, float("inf")), (BLOCK_HEADS, groups, GROUP)), 2)
    hi = tl.max(tl.reshape(tl.where(mask, x, float("-inf")), (BLOCK_HEADS, groups, GROUP)), 2)
    live = (tl.arange(0, groups) * GROUP < head_dim)[None, :] & head_mask[:, None]
    lo, hi = tl.where(live, lo, 0.0), tl.where(live, hi, 0.0)
    offset = tl.minimum(tl.maximum((lo + hi) / 2, -65504.0), 65504.0).to(tl.float16)
    mid = offset.to(tl.float32)
    scale = tl.minimum(tl.maximum(hi - mid, mid - lo) / 127, 65504.0).to(tl.float16)
    step = scale.to(tl.float32)
    inv = tl.where(step > 0, 1 / tl.where(step > 0, step, 1.0), 0.0)
    scaled = (tl.reshape(x, (BLOCK_HEADS, groups, GROUP)) - mid[:, :, None]) * inv[:, :, None]
    q = tl.where(scaled >= 0, tl.floor(scaled + 0.5), -tl.floor(0.5 - scaled))
    q = tl.reshape(tl.minimum(tl.maximum(q, -127.0), 127.0), (BLOCK_HEADS, BLOCK_D))
    tl.store(cache_ptr + rows[:, None] + dims, q.to(tl.int8), mask=mask)
    params = cache_ptr + rows[:, None] + head_dim + tl.arange(0, groups)[None, :] * 4
    tl.store(params.to(tl.pointer_type(tl.float16)), scale, mask=live)
    tl.store((params + 2).to(tl.pointer_type(tl.float16)), offset, mask=live)


def reshape_and_cache(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
                      v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """key/value [num_tokens, num_kv_heads, head_dim] into slots block * block_size + offset;
    an int8 cache gets them quantized (jetserve_kernels/kv_int8.py)."""
    assert k_cache.stride() == v_cache.stride() and key.stride(-1) == 1 and value.stride(-1) == 1
    num_tokens, num_kv_heads, head_dim = key.shape
    int8 = kv_int8.is_int8(k_cache)
    assert k_cache.shape[3] == (kv_int8.row_bytes(head_dim) if int8 else head_dim)
    if num_tokens == 0:
        return
    _reshape_and_cache_kernel[(num_tokens,)](
        key, value, k_cache, v_cache, slot_mapping, key.stride(0), key.stride(1), value.stride(0),
        value.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        k_cache.shape[1], num_kv_heads, head_dim,
        BLOCK_HEADS=triton.next_power_of_2(num_kv_heads), BLOCK_D=triton.next_power_of_2(head_dim),
        INT8=int8, GROUP=min(kv_int8.GROUP, triton.next_power_of_2(head_dim)))
