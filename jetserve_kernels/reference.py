"""Plain torch implementations of every kernel, with the same signatures: the ground truth the
Triton kernels are tested against (and readable statements of what each one computes)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from jetserve_kernels import kv_int8


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    block_tables: torch.Tensor, cu_seqlens_q: torch.Tensor, seq_lens: torch.Tensor,
                    scale: float, out: torch.Tensor | None = None,
                    bf16_products: bool = False) -> torch.Tensor:
    """Causal attention of each sequence's new tokens over its cached context (new tokens
    included). New token i of a sequence with q_len new tokens and context seq_len sits at
    position seq_len - q_len + i and attends to positions <= its own. An int8 cache
    (jetserve_kernels/kv_int8.py) is read dequantized. bf16_products: what the CPU kernels
    compute over a bf16 cache with bf16 dot products (q * scale and the softmax's unnormalized
    weights rounded to bf16, the total summing the rounded weights); over an int8 cache, the
    keys' scores in integers (int8_key_scores) and the values dequantized and rounded to bf16."""
    out = torch.empty_like(q) if out is None else out
    integer_keys = kv_int8.is_int8(k_cache) and bf16_products
    if integer_keys:  # dequantized in one rounding, as the kernels' fused multiply-add does
        v_cache = kv_int8.dequantize(v_cache, torch.float64).float().bfloat16().float()
    elif kv_int8.is_int8(k_cache):
        k_cache, v_cache = kv_int8.dequantize(k_cache), kv_int8.dequantize(v_cache)
    block_size = k_cache.shape[1]
    num_heads, num_kv_heads = q.shape[1], k_cache.shape[2]
    for s in range(block_tables.shape[0]):
        start, end = int(cu_seqlens_q[s]), int(cu_seqlens_q[s + 1])
        seq_len, q_len = int(seq_lens[s]), end - start
        if q_len == 0:
            continue
        blocks = block_tables[s, :(seq_len + block_size - 1) // block_size].long()
        keys = k_cache[blocks].reshape(-1, num_kv_heads, k_cache.shape[3])[:seq_len]
        values = v_cache[blocks].reshape(-1, num_kv_heads, v_cache.shape[3])[:seq_len].float()
        keys = keys.repeat_interleave(num_heads // num_kv_heads, dim=1)
        values = values.repeat_interleave(num_heads // num_kv_heads, dim=1)
        if integer_keys:
            scores = int8_key_scores(q[start:end].float() * scale, keys)
        elif bf16_products:
            scaled = (q[start:end].float() * scale).bfloat16().float()
            scores = torch.einsum("qhd,khd->hqk", scaled, keys.float())
        else:
            scores = torch.einsum("qhd,khd->hqk", q[start:end].float(), keys.float()) * scale
        positions = seq_len - q_len + torch.arange(q_len, device=q.device)
        visible = torch.arange(seq_len, device=q.device)[None, :] <= positions[:, None]
        scores = scores.masked_fill(~visible, float("-inf"))
        if bf16_products:
            weights = (scores - scores.amax(-1, keepdim=True)).exp().bfloat16().float()
            weights = weights / weights.sum(-1, keepdim=True)
        else:
            weights = scores.softmax(-1)
        out[start:end] = torch.einsum("hqk,khd->qhd", weights, values).to(out.dtype)
    return out


def int8_key_scores(scaled: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """Scores [heads, queries, keys] of q * scale ([queries, heads, head_dim], fp32) against int8
    key rows ([keys, heads, row]) as the attention kernels compute them with bf16 products
    (attention_simd.h): each query row in 16-bit codes, code = q' / unit rounded to nearest
    even, unit = max |q'| / 32767 (codes of 0 where max |q'| < 1e-30); per group g of 32
    channels the exact integer sums I[g] (codes times the keys' codes) and Q[g] (the query's
    codes); then one fp32 chain over the groups, s = fma(I[g], scale[g], s),
    s = fma(Q[g], offset[g], s) (fused_add), times the unit."""
    d = scaled.shape[-1]
    groups = d // kv_int8.group_size(d)
    top = scaled.abs().amax(-1, keepdim=True)
    # (a tensor over a tensor: `32767.0 / top` would multiply by a rounded reciprocal)
    per_unit = torch.where(top >= 1e-30, torch.full_like(top, 32767.0) / top,
                           torch.zeros_like(top))
    codes = torch.round(scaled * per_unit).clamp(-32768, 32767).double()
    unit = (top / 32767.0).squeeze(-1)  # [queries, heads]
    key_codes = rows[..., :d].double()
    params = rows[..., d:].contiguous().view(torch.float16).double().unflatten(-1, (groups, 2))
    sums = torch.einsum("qhgc,khgc->hqkg", codes.unflatten(-1, (groups, -1)),
                        key_codes.unflatten(-1, (groups, -1)))  # exact: under 2^31
    query_sums = codes.unflatten(-1, (groups, -1)).sum(-1).permute(1, 0, 2)  # [heads, q, g]
    scale, offset = (params[..., i].permute(1, 0, 2) for i in (0, 1))  # [heads, keys, g]
    s = torch.zeros(sums.shape[:3], dtype=torch.float32)
    for g in range(groups):
        s = fused_add(sums[..., g].float().double() * scale[:, None, :, g], s)
        s = fused_add(query_sums[:, :, None, g] * offset[:, None, :, g], s)
    return s * unit.t()[:, :, None]


def fused_add(product: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """product + s rounded once to fp32, as a fused multiply-add makes it: product (float64) is an
    exact product of an fp32 and an fp16 value (at most 35 bits), s fp32. Their float64 sum is
    rounded to odd (where it was inexact, its last bit set by the sign of what it dropped), which
    then rounds to the nearest fp32 as the exact sum would."""
    a, b = product, s.double()
    total = a + b
    b_part = total - a
    dropped = (a - (total - b_part)) + (b - b_part)  # the exact sum is total + dropped
    even = (total.view(torch.int64) & 1) == 0
    toward = torch.where(dropped > 0, torch.full_like(total, float("inf")),
                         torch.full_like(total, float("-inf")))
    total = torch.where(even & (dropped != 0), torch.nextafter(total, toward), total)
    return total.float()


def bf16_pairs_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x W^T as a bf16 model's matmuls make it on AVX512-BF16 (linear_bf16_pairs "avx512":
    vdpbf16ps, in the Intel SDM's pseudocode): x and W rounded to bf16, each output one chain of
    fp32 sums over the pairs of k in order, a pair's odd product before its even one (k = 1, 0,
    3, 2, ...), each product of two bf16 exact in fp32 and each sum rounded to nearest even."""
    xr, wr = x.bfloat16().float(), weight.bfloat16().float().t()
    out = torch.zeros(x.shape[0], weight.shape[0])
    for t in range(0, x.shape[1], 2):
        out = out + xr[:, t + 1:t + 2] * wr[t + 1]
        out = out + xr[:, t:t + 1] * wr[t]
    return out


def amx_bf16_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x W^T as AMX tiles make it (linear_bf16_pairs "amx": tdpbf16ps, in the Intel SDM's
    pseudocode): x and W rounded to bf16; for each block of 32 values of k, in order, its 16 even
    products summed in one fp32 chain from zero and its 16 odd ones in another, the two added,
    and that added to the output. (Normal numbers: the tiles' flushing of denormals is not
    modelled here; the kernels' software model of the tiles, amx_tiles.h, has it.)"""
    xr, wr = x.bfloat16().float(), weight.bfloat16().float().t()
    out = torch.zeros(x.shape[0], weight.shape[0])
    for t0 in range(0, x.shape[1], 32):
        even = torch.zeros_like(out)
        odd = torch.zeros_like(out)
        for t in range(t0, t0 + 32, 2):
            even = even + xr[:, t:t + 1] * wr[t]
            odd = odd + xr[:, t + 1:t + 2] * wr[t + 1]
        out = out + (even + odd)
    return out


def amx_one_chain_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x W^T as the Intel Intrinsics Guide writes tdpbf16ps (`_tile_dpbf16ps`), which the SDM
    does not: one fp32 chain over k in order from the output, a pair's even product first. The
    AMX probe tells which of the two the hardware follows."""
    xr, wr = x.bfloat16().float(), weight.bfloat16().float().t()
    out = torch.zeros(x.shape[0], weight.shape[0])
    for t in range(x.shape[1]):
        out = out + xr[:, t:t + 1] * wr[t]
    return out


def reshape_and_cache(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
                      v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Token t's K/V go to slot slot_mapping[t] = block * block_size + offset; -1 skips it. An
    int8 cache gets them quantized (jetserve_kernels/kv_int8.py), another in its own dtype."""
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    key, value = key[keep], value[keep]
    if kv_int8.is_int8(k_cache):
        key, value = kv_int8.quantize(key), kv_int8.quantize(value)
    else:  # a bf16 cache under an fp32 model: rounded to nearest
        key, value = key.to(k_cache.dtype), value.to(v_cache.dtype)
    num_kv_heads, row = k_cache.shape[2], k_cache.shape[3]
    k_cache.view(-1, num_kv_heads, row)[slots] = key
    v_cache.view(-1, num_kv_heads, row)[slots] = value


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None):
    """norm(x) * weight, in fp32; with `residual`, (norm(x + residual) * weight, x + residual)."""
    if residual is not None:
        x = x + residual
        residual = x
    x32 = x.float()
    normed = (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps) * weight.float()).to(x.dtype)
    return normed if residual is None else (normed, residual)


def rotary_embedding(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                     cos_sin_cache: torch.Tensor) -> None:
    """In place, NeoX style: x = [x1, x2] -> [x1 cos - x2 sin, x2 cos + x1 sin]; cache row p
    holds cos(p θ) in its first half and sin(p θ) in its second."""
    half = cos_sin_cache.shape[-1] // 2
    cos_sin = cos_sin_cache[positions.long()].float()
    cos, sin = cos_sin[:, None, :half], cos_sin[:, None, half:]
    for x in (q, k):
        x1, x2 = x[..., :half].float(), x[..., half:].float()
        x.copy_(torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype))


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x [n, 2d] -> silu(x[:, :d]) * x[:, d:]."""
    d = x.shape[-1] // 2
    return (F.silu(x[..., :d].float()) * x[..., d:].float()).to(x.dtype)


def assert_attention_close(out: torch.Tensor, expected: torch.Tensor, bf16_products: bool):
    """A kernel's attention [tokens, heads, head_dim] against paged_attention's. With bf16
    products the weights are rounded to bf16 after scores and an exponential that differ from
    torch's in the last bits of fp32, so now and then a weight rounds to the neighbouring bf16
    value (2^-8 of itself away), which moves its (token, head) row by up to 2^-8 of that weight's
    share of the values: at most 1% of the rows off the usual tolerance (one, of fewer than a
    hundred), none by more than that. (A wrong element, pair or sequence moves most of its
    rows.)"""
    if not bf16_products:
        torch.testing.assert_close(out, expected, atol=2e-5, rtol=1e-4)
        return
    rows_close = torch.isclose(out, expected, atol=2e-5, rtol=1e-4).all(-1)
    off = int((~rows_close).sum())
    assert off <= max(1, rows_close.numel() // 100), f"{off} of {rows_close.numel()} rows differ"
    torch.testing.assert_close(out, expected, atol=2e-3, rtol=0)
