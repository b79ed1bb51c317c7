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

**The key basis.** Keys are what int8 loses, and a key's error matters only along the queries
that read it. So an int8 cache stores each key in a basis of its own, and the queries that
attend to it move to the same basis: for each layer and KV head, per channel c, a balance b_c,
then (where head_dim is a power of two) a Hadamard rotation with fixed signs:

    k' = H S (b * k) / sqrt(head_dim),   q' = H S (q / b) / sqrt(head_dim),   q' . k' = q . k

(S the diagonal of signs, H the Sylvester Hadamard matrix, so H S / sqrt(head_dim) is
orthogonal). The balance, b_c = (rms q_c / rms k_c)^(1/2) over the head's queries, evens out what
the query weights and the key carries in each channel; the rotation then spreads each key's
outlying channels over all of them, so each group's 255 levels cover values of one size. The
rotary embedding comes first: the basis is of the keys as they are attended. The balances are
measured when the engine starts (`key_balance`, from a prefill of seeded random tokens, so no
text is favoured); `key_basis` makes the two multipliers, and `to_key_basis_` is the transform,
which the CPU kernels' `rotary_and_cache` computes to the same bits. Values keep their basis:
their error is not what int8 loses (BENCHMARKS.md, "int8 keys in a basis of their own").

**How the CPU kernels read a row.** An fp32 model's attention dequantizes keys and values to
fp32. A bf16 model's (batch-invariant, bf16 dot products where the CPU has AVX512-BF16) does not
dequantize the keys: each query is put in 16-bit codes and meets a key's int8 codes in exact
integer sums, one a group, which its scale and offset then weigh in fp32
(jetserve_kernels/cpu/attention_simd.h; `reference.int8_key_scores` states it in torch); the
values are dequantized and rounded to bf16.
"""

from __future__ import annotations

import random

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


# The key basis (the module's docstring).
BALANCE_POWER = 0.5  # b = (rms q / rms k) ** BALANCE_POWER
BALANCE_LIMIT = 64.0  # a channel's balance stays within [1/64, 64] of the head's geometric mean
CALIBRATION_TOKENS = 512  # random tokens prefilled once to measure the balances
CALIBRATION_SEED = 0


def rotates(head_dim: int) -> bool:
    """Whether the key basis includes the Hadamard rotation (head_dim a power of two)."""
    return head_dim > 1 and head_dim & (head_dim - 1) == 0


def _signs(head_dim: int) -> torch.Tensor:
    """The rotation's fixed signs: head_dim draws of Python's seeded Mersenne Twister (the same
    on every platform and version)."""
    draws = random.Random(f"jetserve key basis {head_dim}").getrandbits(head_dim)
    return torch.tensor([1.0 - 2.0 * (draws >> d & 1) for d in range(head_dim)])


def key_balance(q_squares: torch.Tensor, k_squares: torch.Tensor) -> torch.Tensor:
    """Per (KV head, channel) balances [KVH, D] from the mean squares of the queries (over the
    head's query heads) and keys [KVH, D]: (rms q / rms k)^(1/2), divided by their geometric mean
    over the head's channels and kept within BALANCE_LIMIT of it. A channel that is zero on
    either side (measured as under 1e-12 of its head's largest) or not finite (a NaN or inf in
    the measuring pass) gets the head's mean, so the multipliers are always finite."""
    q_sq, k_sq = q_squares.double(), k_squares.double()
    bad = ~(torch.isfinite(q_sq) & torch.isfinite(k_sq))
    q_sq, k_sq = q_sq.masked_fill(bad, 0.0), k_sq.masked_fill(bad, 0.0)
    floor = 1e-12
    dead = bad | (q_sq <= floor * q_sq.amax(-1, keepdim=True)) | (
        k_sq <= floor * k_sq.amax(-1, keepdim=True))
    log_b = torch.where(dead, torch.zeros_like(q_sq), BALANCE_POWER / 2 * (q_sq / k_sq).log())
    alive = (~dead).sum(-1, keepdim=True).clamp(min=1)
    log_b = torch.where(dead, 0.0, log_b - log_b.sum(-1, keepdim=True) / alive)
    limit = torch.log(torch.tensor(BALANCE_LIMIT, dtype=torch.float64))
    return log_b.clamp(-limit, limit).exp().float()


def key_basis(balance: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(q_mul, k_mul) [KVH, D] fp32 for `to_key_basis_`: S / (b sqrt(D)) and S b / sqrt(D) where
    the basis rotates, else 1 / b and b."""
    head_dim = balance.shape[-1]
    if not rotates(head_dim):
        return (1 / balance).contiguous(), balance.contiguous()
    signs = _signs(head_dim).double() / head_dim ** 0.5
    b = balance.double()
    return (signs / b).float().contiguous(), (signs * b).float().contiguous()


def to_key_basis_(x: torch.Tensor, mul: torch.Tensor) -> torch.Tensor:
    """In place: x [T, heads, D] fp32 (the query heads, or the KV heads) times `mul` [heads, D]
    (a KV head's multipliers repeated for its query heads), then, where the basis rotates, the
    unnormalized Walsh-Hadamard transform in its butterfly order: for h = 1, 2, 4, ..., D / 2,
    each pair (x[i], x[i + h]) of a block of 2h becomes (x[i] + x[i + h], x[i] - x[i + h]). Each
    step is one rounding of fp32, so the CPU kernel, in the same order, gets the same bits."""
    t, heads, d = x.shape
    y = x * mul
    if rotates(d) and x.device.type != "cpu":
        # On a GPU (the Triton backend) one matmul instead of 2 log2(D) small ops: the same
        # transform, its sums in another order (the CPU kernels' bits are not asked for there).
        y = y.float() @ _sylvester(d, x.device)
    elif rotates(d):
        h = 1
        while h < d:
            pairs = y.view(t, heads, d // (2 * h), 2, h)
            a, b = pairs[..., 0, :], pairs[..., 1, :]
            y = torch.stack((a + b, a - b), -2).view(t, heads, d)
            h *= 2
    x.copy_(y)
    return x


_SYLVESTER: dict[tuple[int, str], torch.Tensor] = {}


def _sylvester(d: int, device: torch.device) -> torch.Tensor:
    """The unnormalized Sylvester Hadamard matrix [d, d] (symmetric: x @ H is the transform)."""
    key = (d, str(device))
    if key not in _SYLVESTER:
        h = torch.ones(1, 1)
        while h.shape[0] < d:
            h = torch.cat((torch.cat((h, h), 1), torch.cat((h, -h), 1)), 0)
        _SYLVESTER[key] = h.to(device)
    return _SYLVESTER[key]


def to_key_basis_pair_(q: torch.Tensor, k: torch.Tensor, q_mul: torch.Tensor,
                       k_mul: torch.Tensor) -> None:
    """A step's queries [T, H, D] and keys [T, KVH, D] into the key basis, in place (query head
    h reads KV head h // (H / KVH))."""
    to_key_basis_(q, q_mul.repeat_interleave(q.shape[1] // k.shape[1], 0))
    to_key_basis_(k, k_mul)
