"""The int8 KV cache: its rows round-trip within half a step of each group, the torch backend
attends over it as over the dequantized values (with and without the C++ kernels), and an engine
sized by memory holds about 3.6x the blocks of fp32 (3.2x at the tiny model's head_dim of 16)
and still serves."""

from __future__ import annotations

import asyncio

import pytest
import torch

from jetserve_kernels import cpu_ops, kv_int8, reference
from services.executor.engine.attention import SeqSlice, TorchBackend


def test_round_trip_is_within_half_a_step_of_each_group():
    gen = torch.Generator().manual_seed(0)
    # Rows of different sizes, off zero by different amounts in different channels (as keys are).
    x = (torch.randn(50, 3, 64, generator=gen) * torch.rand(50, 3, 1, generator=gen) * 10
         + torch.randn(64, generator=gen) * 5)
    rows = kv_int8.quantize(x)
    assert rows.dtype == torch.int8 and rows.shape == (50, 3, 72)
    assert kv_int8.head_dim_of(rows) == 64 and kv_int8.head_dim_of(x) == 64
    params = rows[..., 64:].contiguous().view(torch.float16).float().unflatten(-1, (2, 2))
    scale, offset = params[..., 0], params[..., 1]  # [50, 3, 2]: two groups of 32
    groups = x.unflatten(-1, (2, 32))
    lo, hi = groups.amin(-1), groups.amax(-1)
    torch.testing.assert_close(offset, (lo + hi) / 2, rtol=2 ** -10, atol=0)
    torch.testing.assert_close(scale, (hi - lo) / 254, rtol=2 ** -9, atol=1e-6)
    error = (kv_int8.dequantize(rows) - x).unflatten(-1, (2, 32)).abs().amax(-1)
    assert (error <= scale / 2 * 1.01 + 1e-6).all()
    codes = rows[..., :64].unflatten(-1, (2, 32))
    assert codes.abs().amax(-1).eq(127).all()  # every group uses the full range
    assert torch.equal(kv_int8.dequantize(kv_int8.quantize(torch.zeros(2, 8))), torch.zeros(2, 8))


def test_a_row_with_offset_channels_keeps_its_small_ones():
    """The case one symmetric scale a row loses: a channel far off zero beside small ones."""
    x = torch.full((1, 64), 0.01)
    x[0, :32] = torch.linspace(-0.05, 0.05, 32)
    x[0, 3] = 40.0
    err = (kv_int8.dequantize(kv_int8.quantize(x)) - x).abs()
    assert err[0, 32:].max() < 1e-4  # the second group, far from the outlier's
    assert err[0, :32].max() <= 40.05 / 254 / 2 * 1.01


def test_values_past_fp16s_range_stay_finite():
    x = torch.tensor([[7e4] * 32 + [-1e6] + [0.5] * 31])
    back = kv_int8.dequantize(kv_int8.quantize(x))
    assert back.isfinite().all()  # the offsets clamp at 65,504; the scales reach the rest
    error = (back - x).abs()[0]
    assert error[:32].max() < 1 and error[32:].max() < 1e6 / 127


@pytest.mark.parametrize("head_dim", [16, 24, 96])
def test_other_head_dims(head_dim):
    x = torch.randn(4, 2, head_dim)
    rows = kv_int8.quantize(x)
    assert rows.shape[-1] == kv_int8.row_bytes(head_dim) and kv_int8.head_dim_of(rows) == head_dim
    assert (kv_int8.dequantize(rows) - x).abs().max() < x.abs().max() / 100
    with pytest.raises(ValueError, match="head_dim under 32 or a multiple of 32; the model's is 48"):
        kv_int8.row_bytes(48)


def test_reference_cache_write_and_attention_read_int8():
    gen = torch.Generator().manual_seed(1)
    key, value = torch.randn(3, 2, 16, generator=gen), torch.randn(3, 2, 16, generator=gen)
    k_cache, v_cache = (torch.zeros(2, 4, 2, 20, dtype=torch.int8) for _ in range(2))
    reference.reshape_and_cache(key, value, k_cache, v_cache, torch.tensor([5, -1, 0]))
    assert torch.equal(k_cache.view(-1, 2, 20)[5], kv_int8.quantize(key[0]))
    assert torch.equal(v_cache.view(-1, 2, 20)[0], kv_int8.quantize(value[2]))
    assert not k_cache.view(-1, 2, 20)[1].any()  # slot -1 skipped


@pytest.mark.parametrize("use_cpu_kernels", [False, True])
def test_torch_backend_over_int8_equals_fp32_over_the_dequantized_cache(use_cpu_kernels):
    if use_cpu_kernels and cpu_ops.load() is None:
        pytest.skip("the CPU kernels did not build")
    heads, kv_heads, dim, block = 6, 2, 64, 16
    gen = torch.Generator().manual_seed(2)
    k_cache = kv_int8.quantize(torch.randn(12, block, kv_heads, dim, generator=gen))
    v_cache = kv_int8.quantize(torch.randn(12, block, kv_heads, dim, generator=gen))
    backend = TorchBackend(block, torch.device("cpu"), torch.float32, use_cpu_kernels)
    # A decode at 40 tokens, a chunk of 5 after 20 cached, a fresh 7-token prompt.
    seqs = [SeqSlice(0, 1, 40, [3, 7, 1]), SeqSlice(1, 5, 25, [2, 9]), SeqSlice(6, 7, 7, [10])]
    slots = [block + 7] + [9 * block + i for i in range(4, 9)] + [10 * block + i for i in range(7)]
    positions = torch.tensor([39] + list(range(20, 25)) + list(range(7)))
    meta = backend.prepare(seqs, slots)
    qkv = torch.randn(13, (heads + 2 * kv_heads) * dim, generator=gen)
    q, k, v = backend.rotary_and_cache(qkv, positions, torch.randn(64, dim, generator=gen),
                                       k_cache, v_cache, meta.slot_mapping)
    row = kv_int8.row_bytes(dim)
    written = k_cache.view(-1, kv_heads, row)[block + 7][:, dim:].view(torch.float16).float()
    torch.testing.assert_close(written, kv_int8.quantize(k[0])[:, dim:].view(torch.float16).float(),
                               rtol=2 ** -10, atol=0)  # the new token, written quantized
    out = backend.attention(q, k, v, k_cache, v_cache, 0.125, meta)
    expected = backend.attention(q, k, v, kv_int8.dequantize(k_cache),
                                 kv_int8.dequantize(v_cache), 0.125, meta)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-4)


def test_engine_with_an_int8_or_bf16_cache_holds_more_blocks_and_serves():
    from services.executor.engine.llm_engine import Engine
    from services.executor.run_local import run_requests
    from shared.config import engine_config
    from shared.protocol import Completion

    async def blocks_and_tokens(dtype: str):
        # An fp32 model (model.dtype auto is bf16 on a CPU with native bf16).
        engine = Engine(engine_config({"model.name": "dummy:tiny", "kv_cache.cpu_cache_gib": 0.001,
                                       "model.dtype": "float32", "kv_cache.dtype": dtype}))
        try:
            results = await run_requests(engine, [
                '{"prompt_token_ids": [5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, '
                '21, 22], "max_tokens": 12, "ignore_eos": true}'])
            return engine.block_manager.num_blocks, engine.model_config.head_dim, results
        finally:
            await engine.stop()

    fp32_blocks, head_dim, fp32_results = asyncio.run(blocks_and_tokens("auto"))
    int8_blocks, _, results = asyncio.run(blocks_and_tokens("int8"))
    expected = 4 * head_dim / kv_int8.row_bytes(head_dim)
    assert int8_blocks / fp32_blocks == pytest.approx(expected, rel=0.05)
    assert isinstance(results[0], Completion) and len(results[0].token_ids) == 12
    # A bf16 cache under the fp32 model: twice the blocks, read through the same kernels.
    bf16_blocks, _, results = asyncio.run(blocks_and_tokens("bfloat16"))
    assert bf16_blocks / fp32_blocks == pytest.approx(2, rel=0.05)
    assert isinstance(results[0], Completion) and len(results[0].token_ids) == 12
