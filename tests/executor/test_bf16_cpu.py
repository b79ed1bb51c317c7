"""model.dtype bfloat16 on a CPU: bf16 weights in the kernels' panels and a bf16 KV cache, fp32
activations between the ops, served through the same C++ kernels as fp32."""

from __future__ import annotations

import asyncio

import pytest
import torch

from jetserve_kernels import cpu_ops
from services.executor.engine.llm_engine import Engine
from services.executor.run_local import run_requests
from shared.config import engine_config
from shared.protocol import Completion


@pytest.mark.skipif(cpu_ops.load() is None, reason="the CPU kernels did not build")
def test_a_bf16_model_runs_on_the_cpu_kernels():
    async def run():
        engine = Engine(engine_config({"model.name": "dummy:tiny", "model.dtype": "bfloat16",
                                       "kv_cache.num_blocks": 64}))
        try:
            model = engine.runner.model
            assert model.backend.cpu_kernels is not None
            assert engine.kv_dtype_name == "bfloat16"
            assert engine.runner.kv_caches[0][0].dtype == torch.bfloat16
            for layer in model.layers:
                for linear in (layer.qkv_proj, layer.o_proj, layer.gate_up_proj, layer.down_proj):
                    assert linear.weight.dtype == torch.bfloat16 and linear.many_rows is not None
                assert layer.input_norm.dtype == torch.float32  # activations stay fp32
            return await run_requests(engine, [
                '{"prompt_token_ids": [5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, '
                '21, 22], "max_tokens": 12, "ignore_eos": true, "temperature": 0}'] * 3)
        finally:
            await engine.stop()

    results = asyncio.run(run())
    assert all(isinstance(r, Completion) and len(r.token_ids) == 12 for r in results)
    assert results[0].token_ids == results[1].token_ids == results[2].token_ids


@pytest.mark.skipif(cpu_ops.load() is None, reason="the CPU kernels did not build")
@pytest.mark.parametrize("shape", [dict(vocab_size=49153),  # an output projection past panels
                                   dict(hidden_size=48, tie_word_embeddings=False),  # K of 48
                                   dict(hidden_size=48)])  # and a tied table: widened to fp32
def test_a_bf16_model_of_odd_shapes_serves(monkeypatch, shape):
    from shared import model_files

    monkeypatch.setitem(model_files.DUMMY_SHAPES, "odd",
                        dict(model_files.DUMMY_SHAPES["tiny"], **shape))

    async def run(dtype: str):
        engine = Engine(engine_config({"model.name": "dummy:odd", "model.dtype": dtype,
                                       "kv_cache.num_blocks": 64}))
        try:
            return await run_requests(engine, [
                '{"prompt_token_ids": [5, 6, 7, 8, 9, 10, 11, 12, 13, 14], "max_tokens": 6, '
                '"ignore_eos": true, "temperature": 0}'])
        finally:
            await engine.stop()

    [result] = asyncio.run(run("bfloat16"))
    assert isinstance(result, Completion) and len(result.token_ids) == 6
    assert all(t < model_files.DUMMY_SHAPES["odd"]["vocab_size"] for t in result.token_ids)
