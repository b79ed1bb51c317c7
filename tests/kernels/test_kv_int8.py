"""The int8 KV cache: its rows round-trip within half a step of each group, the torch backend
attends over it as over the dequantized values (with and without the C++ kernels), an engine
sized by memory holds about 3.6x the blocks of fp32 (3.2x at the tiny model's head_dim of 16)
and still serves, and the key basis keeps every score and is computed by the CPU kernel to the
reference's bits."""

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

    async def start_and_serve(dtype: str):
        # An fp32 model (model.dtype auto is bf16 on a CPU with native bf16).
        engine = Engine(engine_config({"model.name": "dummy:tiny", "kv_cache.cpu_cache_gib": 0.001,
                                       "model.dtype": "float32", "kv_cache.dtype": dtype}))
        try:
            results = await run_requests(engine, [
                '{"prompt_token_ids": [5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, '
                '21, 22], "max_tokens": 12, "ignore_eos": true}'])
            assert isinstance(results[0], Completion) and len(results[0].token_ids) == 12
            return engine.block_manager.num_blocks, engine.runner.model
        finally:
            await engine.stop()

    fp32_blocks, model = asyncio.run(start_and_serve("auto"))
    head_dim = model.config.head_dim
    assert model.key_basis is None  # measured only for an int8 pool
    int8_blocks, model = asyncio.run(start_and_serve("int8"))
    assert int8_blocks / fp32_blocks == pytest.approx(4 * head_dim / kv_int8.row_bytes(head_dim),
                                                      rel=0.05)
    # The key basis, measured at start, is the same on every start (seeded random tokens).
    assert len(model.key_basis) == model.config.num_layers
    _, again = asyncio.run(start_and_serve("int8"))
    for (q_mul, k_mul), (q_again, k_again) in zip(model.key_basis, again.key_basis):
        assert torch.isfinite(q_mul).all() and not torch.equal(q_mul, k_mul)
        assert torch.equal(q_mul, q_again) and torch.equal(k_mul, k_again)
    # A bf16 cache under the fp32 model: twice the blocks, read through the same kernels.
    bf16_blocks, _ = asyncio.run(start_and_serve("bfloat16"))
    assert bf16_blocks / fp32_blocks == pytest.approx(2, rel=0.05)


# The key basis (kv_int8.py): q' . k' = q . k, computed by the CPU kernel to the reference's bits.

@pytest.mark.parametrize("head_dim", [64, 128, 80])
def test_the_key_basis_keeps_every_score(head_dim):
    gen = torch.Generator().manual_seed(head_dim)
    kv_heads, group = 3, 3
    balance = kv_int8.key_balance(torch.rand(kv_heads, head_dim, generator=gen) * 50,
                                  torch.rand(kv_heads, head_dim, generator=gen) + 0.01)
    q_mul, k_mul = kv_int8.key_basis(balance)
    q = torch.randn(7, kv_heads * group, head_dim, generator=gen)
    k = torch.randn(7, kv_heads, head_dim, generator=gen) * torch.linspace(0.1, 20, head_dim)
    qb, kb = q.clone(), k.clone()
    kv_int8.to_key_basis_pair_(qb, kb, q_mul, k_mul)
    scores = torch.einsum("thd,skd->tshk", q.double(), k.double())
    moved = torch.einsum("thd,skd->tshk", qb.double(), kb.double())
    for h in range(kv_heads * group):  # query head h reads KV head h // group
        torch.testing.assert_close(moved[:, :, h, h // group], scores[:, :, h, h // group],
                                   rtol=1e-5, atol=1e-4)
    # The GPU's form (one matmul by the Sylvester matrix) is the same transform.
    if kv_int8.rotates(head_dim):
        as_matmul = (k * k_mul) @ kv_int8._sylvester(head_dim, k.device)
        torch.testing.assert_close(as_matmul, kb, rtol=1e-5, atol=1e-4)
    # Rotated where head_dim is a power of two: an outlying channel's size spread over all.
    spread = kb.abs().amax(-1) / kb.square().mean(-1).sqrt()
    assert (spread < 4).all() if kv_int8.rotates(head_dim) else True
    assert not kv_int8.rotates(80) and kv_int8.rotates(64)


def test_key_balance_is_bounded_and_finite_on_dead_and_extreme_channels():
    q_sq = torch.ones(2, 64, dtype=torch.float64)
    k_sq = torch.ones(2, 64, dtype=torch.float64)
    q_sq[0, 3] = 0.0  # a channel no query reads
    k_sq[0, 5] = 0.0  # a channel every key leaves at zero
    q_sq[1, 7], k_sq[1, 9] = 1e30, 1e-30
    q_sq[0, 11], k_sq[0, 12], q_sq[1, 13] = float("nan"), float("inf"), float("-inf")
    b = kv_int8.key_balance(q_sq, k_sq)
    assert b.dtype == torch.float32 and torch.isfinite(b).all() and (b > 0).all()
    # Dead or unmeasurable channels get the head's mean, and leave the others' balance alone.
    assert b[0, 3] == b[0, 5] == b[0, 11] == b[0, 12] == b[0, 0]
    assert b[1, 13] == b[1, 0]
    assert b.max() <= kv_int8.BALANCE_LIMIT * 1.0001 and b.min() >= 1 / kv_int8.BALANCE_LIMIT / 1.0001
    torch.testing.assert_close(b[0], torch.ones(64))  # a flat head stays flat
    q_mul, k_mul = kv_int8.key_basis(b)
    assert torch.isfinite(q_mul).all() and torch.isfinite(k_mul).all()


@pytest.mark.parametrize("head_dim", [64, 128, 16, 96])
def test_rotary_and_cache_moves_q_and_k_into_the_key_basis_to_the_reference_bits(head_dim):
    kernels = cpu_ops.load()
    if kernels is None:
        pytest.skip("the CPU kernels did not build")
    heads, kv_heads, block, tokens = 6, 2, 8, 9
    gen = torch.Generator().manual_seed(head_dim)
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, generator=gen) * 3
    positions = torch.randint(0, 64, (tokens,), generator=gen)
    slots = torch.randperm(4 * block, generator=gen)[:tokens]
    cos_sin = torch.randn(64, head_dim, generator=gen)
    balance = kv_int8.key_balance(torch.rand(kv_heads, head_dim, generator=gen) * 9 + 0.1,
                                  torch.rand(kv_heads, head_dim, generator=gen) + 0.1)
    q_mul, k_mul = kv_int8.key_basis(balance)
    shape = (4, block, kv_heads, kv_int8.row_bytes(head_dim))
    caches = [torch.zeros(shape, dtype=torch.int8) for _ in range(4)]
    expected = qkv.clone()
    kernels.rotary_and_cache(expected, positions, cos_sin, caches[0], caches[1], slots, heads,
                             kv_heads, None, None)
    q = expected[:, :heads * head_dim].view(tokens, heads, head_dim)
    k = expected[:, heads * head_dim:(heads + kv_heads) * head_dim].view(tokens, kv_heads, head_dim)
    kv_int8.to_key_basis_pair_(q, k, q_mul, k_mul)
    kernels.rotary_and_cache(qkv, positions, cos_sin, caches[2], caches[3], slots, heads,
                             kv_heads, q_mul, k_mul)
    assert torch.equal(qkv, expected)  # the same bits: q and k moved, v untouched
    row = kv_int8.row_bytes(head_dim)
    written = caches[2].view(-1, kv_heads, row)[slots]
    torch.testing.assert_close(kv_int8.dequantize(written), k, rtol=0, atol=k.abs().max() / 200)
    assert torch.equal(caches[3], caches[1])  # values as without the basis
    with pytest.raises(RuntimeError, match="together"):
        kernels.rotary_and_cache(qkv, positions, cos_sin, caches[2], caches[3], slots, heads,
                                 kv_heads, q_mul, None)
    with pytest.raises(RuntimeError, match="multipliers"):
        kernels.rotary_and_cache(qkv, positions, cos_sin, caches[2], caches[3], slots, heads,
                                 kv_heads, q_mul[:1], k_mul[:1])


@pytest.mark.parametrize("use_cpu_kernels", [False, True])
def test_attention_over_int8_keys_in_their_basis_is_closer_to_fp32_kv(use_cpu_kernels):
    """Keys whose channels differ in size by 50x and queries that read the small ones (as a
    model's do): the same steps through an fp32 cache, an int8 cache and an int8 cache with the
    key basis measured from these queries and keys. The basis changes no score (above), so what
    differs is only the int8 error, which it must cut."""
    if use_cpu_kernels and cpu_ops.load() is None:
        pytest.skip("the CPU kernels did not build")
    heads, kv_heads, dim, block = 6, 2, 64, 16
    gen = torch.Generator().manual_seed(5)
    backend = TorchBackend(block, torch.device("cpu"), torch.float32, use_cpu_kernels)
    key_size = torch.ones(dim)
    key_size[torch.randperm(dim, generator=gen)[:6]] = 50.0
    qkv = torch.randn(45, (heads + 2 * kv_heads) * dim, generator=gen)
    qkv[:, heads * dim:(heads + kv_heads) * dim] *= key_size.repeat(kv_heads)
    qkv[:, :heads * dim] /= key_size.repeat(heads)
    cos_sin = torch.cat((torch.ones(64, dim // 2), torch.zeros(64, dim // 2)), 1)  # rotary: none
    q = qkv[:, :heads * dim].view(45, kv_heads, heads // kv_heads, dim)
    k = qkv[:, heads * dim:(heads + kv_heads) * dim].view(45, kv_heads, dim)
    basis = kv_int8.key_basis(kv_int8.key_balance(q.square().mean((0, 2)), k.square().mean(0)))

    def run(dtype: torch.dtype, key_basis) -> torch.Tensor:
        row = kv_int8.row_bytes(dim) if dtype == torch.int8 else dim
        caches = [torch.zeros(4, block, kv_heads, row, dtype=dtype) for _ in range(2)]
        outs = []
        for start, count in ((0, 40), (40, 5)):  # 40 cached, then a chunk of 5 reading them
            meta = backend.prepare([SeqSlice(0, count, start + count, [0, 1, 2])],
                                   list(range(start, start + count)))
            step = qkv[start:start + count].clone()
            q_, k_, v_ = backend.rotary_and_cache(step, torch.arange(start, start + count),
                                                  cos_sin, *caches, meta.slot_mapping, key_basis)
            outs.append(backend.attention(q_, k_, v_, *caches, 0.125, meta))
        return outs[1]

    exact = run(torch.float32, None)
    plain = (run(torch.int8, None) - exact).norm()
    moved = (run(torch.int8, basis) - exact).norm()
    assert moved < 0.5 * plain, (moved, plain)
