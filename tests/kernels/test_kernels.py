"""Each Triton kernel against its torch reference (jetserve_kernels/reference.py).

On a CPU they run under TRITON_INTERPRET=1 (tests/conftest.py sets it), so shapes are tiny.
Tolerances: fp32 atol 1e-5; bf16 atol 2e-2 / rtol 1.6e-2, one or two bf16 ulps of values around 1
(bf16 keeps 8 significant bits). In the interpreter the attention dots on bf16 values run in fp32
(its tl.dot mishandles 16-bit operands); on a GPU they run on tensor cores.
"""

from __future__ import annotations

import pytest
import torch

from jetserve_kernels.attention import paged_attention
from jetserve_kernels.elementwise import reshape_and_cache, rms_norm, rotary_embedding, silu_and_mul
from jetserve_kernels import kv_int8, reference

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
TOLERANCE = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.bfloat16: dict(atol=2e-2, rtol=1.6e-2)}
DTYPES = [torch.float32, torch.bfloat16]


def close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    torch.testing.assert_close(actual.float(), expected.float(), **TOLERANCE[expected.dtype])


def paged_batch(q_lens: list[int], seq_lens: list[int], num_heads: int, num_kv_heads: int,
                head_dim: int, block_size: int, dtype: torch.dtype, seed: int = 0):
    """A cache filled with random K/V, each sequence's blocks scattered across it."""
    gen = torch.Generator().manual_seed(seed)
    blocks_per_seq = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(blocks_per_seq) + 3
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=gen).to(DEVICE, dtype)
    v_cache = torch.randn(shape, generator=gen).to(DEVICE, dtype)
    order = torch.randperm(num_blocks, generator=gen).tolist()
    block_tables = torch.zeros(len(seq_lens), max(blocks_per_seq), dtype=torch.int32)
    for s, count in enumerate(blocks_per_seq):
        block_tables[s, :count] = torch.tensor(order[:count])
        order = order[count:]
    cu_seqlens = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    q = torch.randn(sum(q_lens), num_heads, head_dim, generator=gen).to(DEVICE, dtype)
    return (q, k_cache, v_cache, block_tables.to(DEVICE), cu_seqlens.to(DEVICE),
            torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE))


# A chunked prefill over 21 cached tokens (context 28), a fresh 13-token prefill, and decodes at
# contexts 1, 17, 32, 33 and 40: all but 32 end mid-block, for blocks of 16 and of 32.
MIXED = dict(q_lens=[7, 13, 1, 1, 1, 1, 1], seq_lens=[28, 13, 1, 17, 32, 33, 40])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("gqa", [1, 4])
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_paged_attention_mixed_batch(head_dim, block_size, gqa, dtype):
    num_kv_heads = 2
    batch = paged_batch(**MIXED, num_heads=num_kv_heads * gqa, num_kv_heads=num_kv_heads,
                        head_dim=head_dim, block_size=block_size, dtype=dtype)
    scale = head_dim ** -0.5
    out = paged_attention(*batch, scale)
    close(out, reference.paged_attention(*batch, scale))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("num_splits", [None, 1, 3, 8])
def test_decode_only_batches_split_the_context(num_splits, dtype):
    batch = paged_batch(q_lens=[1, 1, 1], seq_lens=[130, 47, 5], num_heads=8, num_kv_heads=2,
                        head_dim=64, block_size=16, dtype=dtype)
    out = paged_attention(*batch, 0.125, num_splits=num_splits)
    close(out, reference.paged_attention(*batch, 0.125))


def test_a_group_of_three_heads_and_a_given_output_buffer():
    """SmolLM2's shape: 9 query heads over 3 KV heads (the group is padded to 4 rows)."""
    batch = paged_batch(q_lens=[5, 1], seq_lens=[20, 70], num_heads=9, num_kv_heads=3,
                        head_dim=64, block_size=16, dtype=torch.float32)
    out = torch.full_like(batch[0], float("nan"))
    assert paged_attention(*batch, 0.125, out=out) is out
    close(out, reference.paged_attention(*batch, 0.125))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("block_size", [16, 32])
def test_reshape_and_cache_writes_slots_and_skips_negative_ones(block_size, dtype):
    gen = torch.Generator().manual_seed(1)
    key = torch.randn(6, 2, 64, generator=gen).to(DEVICE, dtype)
    value = torch.randn(6, 2, 64, generator=gen).to(DEVICE, dtype)
    slots = torch.tensor([0, block_size + 3, -1, 3 * block_size - 1, 5, -1], device=DEVICE)
    caches = [torch.zeros(4, block_size, 2, 64, dtype=dtype, device=DEVICE) for _ in range(4)]
    reshape_and_cache(key, value, caches[0], caches[1], slots)
    reference.reshape_and_cache(key, value, caches[2], caches[3], slots)
    assert torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])
    assert caches[0].abs().sum(-1).count_nonzero() == 4 * 2  # four tokens, two heads each


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_reshape_and_cache_quantizes_into_an_int8_cache(dtype):
    """Rows as jetserve_kernels/kv_int8.py writes them: head_dim int8 codes, then each group of
    32's fp16 scale and offset."""
    gen = torch.Generator().manual_seed(3)
    key = torch.randn(5, 3, 64, generator=gen).to(DEVICE, dtype)
    value = torch.randn(5, 3, 64, generator=gen).to(DEVICE, dtype)
    slots = torch.tensor([0, 19, -1, 47, 5], device=DEVICE)
    caches = [torch.zeros(4, 16, 3, 72, dtype=torch.int8, device=DEVICE) for _ in range(4)]
    reshape_and_cache(key, value, caches[0], caches[1], slots)
    reference.reshape_and_cache(key, value, caches[2], caches[3], slots)
    for ours, theirs in ((caches[0], caches[2]), (caches[1], caches[3])):
        params = theirs[..., 64:].contiguous().view(torch.float16).float()
        torch.testing.assert_close(ours[..., 64:].contiguous().view(torch.float16).float(), params,
                                   rtol=2 ** -10, atol=0)
        # A GPU's division may round a value sitting on .5 the other way: one step at most.
        step = params[..., 0::2].repeat_interleave(32, -1)
        assert (kv_int8.dequantize(ours) - kv_int8.dequantize(theirs)).abs().le(step + 1e-6).all()
    written = caches[0].view(-1, 72).abs().sum(-1).nonzero().flatten() // 3  # slots with data
    assert sorted(set(written.tolist())) == [0, 5, 19, 47]  # the -1 slot wrote nothing


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("num_splits", [None, 3])
def test_attention_over_an_int8_cache(num_splits, dtype):
    """Mixed prefill and decodes, and decode-only batches split over the context, read int8
    rows dequantized: the same values the reference reads."""
    mixed = paged_batch(**MIXED, num_heads=9, num_kv_heads=3, head_dim=64, block_size=16,
                        dtype=dtype)
    decodes = paged_batch(q_lens=[1, 1, 1], seq_lens=[130, 47, 5], num_heads=9, num_kv_heads=3,
                          head_dim=64, block_size=16, dtype=dtype)
    for q, k_cache, v_cache, *rest in (mixed, decodes):
        batch = (q, kv_int8.quantize(k_cache), kv_int8.quantize(v_cache), *rest)
        out = paged_attention(*batch, 0.125, num_splits=num_splits)
        close(out, reference.paged_attention(*batch, 0.125))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm(with_residual, dtype):
    gen = torch.Generator().manual_seed(2)
    x, residual = (torch.randn(5, 576, generator=gen).to(DEVICE, dtype) for _ in range(2))
    weight = torch.randn(576, generator=gen).to(DEVICE, dtype)
    if with_residual:
        out, new_residual = rms_norm(x, weight, 1e-5, residual)
        expected, expected_residual = reference.rms_norm(x, weight, 1e-5, residual)
        close(new_residual, expected_residual)
    else:
        out, expected = rms_norm(x, weight, 1e-5), reference.rms_norm(x, weight, 1e-5)
    close(out, expected)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("head_dim", [64, 128])
def test_rotary_embedding_in_place_on_strided_views(head_dim, dtype):
    """q and k are views into one fused qkv projection, as in the model."""
    gen = torch.Generator().manual_seed(3)
    num_heads, num_kv_heads, tokens = 8, 2, 5
    qkv = torch.randn(tokens, (num_heads + 2 * num_kv_heads) * head_dim, generator=gen)
    qkv = qkv.to(DEVICE, dtype)
    q = qkv[:, :num_heads * head_dim].view(tokens, num_heads, head_dim)
    k = qkv[:, num_heads * head_dim:(num_heads + num_kv_heads) * head_dim].view(
        tokens, num_kv_heads, head_dim)
    angles = torch.arange(64)[:, None] * (10000 ** (-torch.arange(0, head_dim, 2) / head_dim))
    cos_sin = torch.cat([angles.cos(), angles.sin()], dim=-1).to(DEVICE, torch.float32)
    positions = torch.tensor([0, 7, 63, 8, 1], device=DEVICE)
    q_ref, k_ref = q.clone(), k.clone()
    untouched = qkv[:, (num_heads + num_kv_heads) * head_dim:].clone()
    rotary_embedding(positions, q, k, cos_sin)
    reference.rotary_embedding(positions, q_ref, k_ref, cos_sin)
    close(q, q_ref)
    close(k, k_ref)
    assert torch.equal(qkv[:, (num_heads + num_kv_heads) * head_dim:], untouched)  # v is not


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_silu_and_mul(dtype):
    x = torch.randn(7, 2 * 1536, generator=torch.Generator().manual_seed(4)).to(DEVICE, dtype)
    close(silu_and_mul(x), reference.silu_and_mul(x))


@pytest.mark.parametrize("num_splits", [1, 4])
def test_sequences_without_new_tokens_are_left_alone(num_splits):
    """A sequence with no new token in the step writes nothing (its neighbours' rows are kept)."""
    batch = paged_batch(q_lens=[1, 0, 1, 0], seq_lens=[70, 20, 33, 5], num_heads=8,
                        num_kv_heads=2, head_dim=64, block_size=16, dtype=torch.float32)
    out = paged_attention(*batch, 0.125, num_splits=num_splits)
    close(out, reference.paged_attention(*batch, 0.125))
    mixed = paged_batch(q_lens=[0, 9, 0, 1], seq_lens=[20, 40, 7, 12], num_heads=8,
                        num_kv_heads=2, head_dim=64, block_size=16, dtype=torch.float32)
    close(paged_attention(*mixed, 0.125), reference.paged_attention(*mixed, 0.125))
