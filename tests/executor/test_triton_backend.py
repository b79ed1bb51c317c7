"""The engine on the triton backend gives the torch backend's tokens (on a CPU, under the
Triton interpreter: tiny model, few tokens)."""

from __future__ import annotations

import pytest

from services.executor.engine.llm_engine import Engine
from services.executor.engine.triton_backend import TritonBackend
from shared.protocol import GenerateRequest
from tests.conftest import generate_all, tiny_config


def requests() -> list[GenerateRequest]:
    # Prompts longer than the 32-token budget are prefilled in chunks beside the decodes.
    lengths = [3, 20, 45, 70]
    greedy = [GenerateRequest(prompt_token_ids=[(97 * i + 13 * n) % 40000 + 17 for i in range(n)],
                              max_tokens=6, temperature=0.0, ignore_eos=True) for n in lengths]
    # Seeded sampling depends on the whole distribution, not only its top token.
    sampled = [GenerateRequest(prompt_token_ids=r.prompt_token_ids, max_tokens=6, temperature=1.0,
                               seed=n, ignore_eos=True) for n, r in zip(lengths, greedy)]
    return greedy + sampled


async def run(backend: str, kv_cache_dtype: str = "auto",
              greedy_only: bool = False) -> list[list[int]]:
    engine = Engine(tiny_config({"model.attention_backend": backend,
                                 "scheduler.batch_level.max_num_batched_tokens": 32,
                                 "kv_cache.num_blocks": 64, "kv_cache.dtype": kv_cache_dtype}))
    try:
        if backend == "triton":
            assert isinstance(engine.runner.backend, TritonBackend)
        batch = requests()[:4] if greedy_only else requests()
        return [c.token_ids for c in await generate_all(engine, batch, timeout=300)]
    finally:
        await engine.stop()


async def test_triton_backend_matches_torch_backend():
    torch_tokens = await run("torch")
    triton_tokens = await run("triton")
    assert all(len(t) == 6 for t in torch_tokens)
    assert triton_tokens == torch_tokens
    assert len({tuple(t) for t in torch_tokens[4:]}) == 4  # the sampled outputs differ


async def test_an_int8_kv_cache_on_the_triton_backend_gives_the_torch_backends_tokens():
    """Both quantize each row as it is written and read it dequantized (greedy requests only:
    a tie in rounding may differ, jetserve_kernels/elementwise.py; only those run: the
    interpreter's time goes with the sequences a step)."""
    torch_tokens = await run("torch", "int8", greedy_only=True)
    triton_tokens = await run("triton", "int8", greedy_only=True)
    assert all(len(t) == 6 for t in torch_tokens)
    assert triton_tokens == torch_tokens


def test_a_block_size_the_triton_kernels_cannot_tile_is_refused_naming_it():
    for block in (8, 24):
        with pytest.raises(ValueError, match=f"kv_cache.block_size {block}: the triton"):
            Engine(tiny_config({"model.attention_backend": "triton",
                                "kv_cache.block_size": block}))
