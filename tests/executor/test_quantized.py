"""The engine on quantized SmolLM2 weights: what each mode costs in quality, against fp32."""

from __future__ import annotations

import pytest
import pytest_asyncio

from jetserve_kernels import cpu_ops
from loadtest.quant_quality import TEXT, agreement, perplexity
from services.executor.engine.llm_engine import Engine
from shared.config import engine_config
from shared.protocol import ChatMessage, GenerateRequest
from tests.conftest import generate_all

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def fp32_perplexity() -> float:
    return perplexity("SmolLM2-135M-Instruct", "none", TEXT.read_text())[0]


def vnni() -> bool:
    kernels = cpu_ops.load()
    return kernels is not None and kernels.int8_dot_products()


int8_activations = pytest.param("int8", marks=pytest.mark.skipif(
    not vnni(), reason="int8 activations need AVX512-VNNI or AVX2, which the kernels built here lack"))


# Measured (BENCHMARKS.md, "int8 activations"): fp32 34.17; weight-only auto 34.14, int8 34.28,
# int4 35.93; with int8 activations auto 34.24, int8 34.18, int4 36.01. int8 activations add each
# group's sum of w (fp32, as many as the scales).
@pytest.mark.parametrize("activations", ["float32", int8_activations])
@pytest.mark.parametrize("mode, bound, max_bytes", [("auto", 1.01, 120e6), ("int8", 1.02, 160e6),
                                                    ("int4", 1.10, 110e6)])
def test_perplexity_stays_close_to_fp32(fp32_perplexity, mode, bound, max_bytes, activations):
    ppl, size = perplexity("SmolLM2-135M-Instruct", mode, TEXT.read_text(),
                           quantized_activations=activations)
    assert ppl <= fp32_perplexity * bound, (mode, ppl, fp32_perplexity)
    sums = 17e6 if activations == "int8" else 0
    assert size <= max_bytes + sums  # fp32 matmuls take 538 MB


QUESTIONS = ["What is the capital of France?", "List three fruits.", "What is 2 + 2?"]


async def answers(mode: str, activations: str = "float32") -> tuple[list, Engine]:
    """The greedy answers to QUESTIONS of an engine with weights `mode` (fp32 around them,
    "none" included: model.dtype auto can be bf16 for it), and the engine, stopped."""
    requests = [GenerateRequest(messages=[ChatMessage("user", q)], max_tokens=24,
                                temperature=0.0) for q in QUESTIONS]
    engine = Engine(engine_config({"scheduler.batch_level.max_num_seqs": 8,
                                   "kv_cache.num_blocks": 64, "model.quantization": mode,
                                   "model.dtype": "float32",
                                   "model.quantized_activations": activations}))
    try:
        return await generate_all(engine, requests), engine
    finally:
        await engine.stop()


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def fp32_answers() -> list:
    return (await answers("none"))[0]


# int4 rounds the Q4_1 values a second time: it answers "L'Étoile (The City of Lights) is the
# capital of France." and is left out here; its cost shows in the perplexity test above.
@pytest.mark.asyncio(loop_scope="module")
@pytest.mark.parametrize("mode, activations", [
    ("auto", "float32"), ("int8", "float32"),
    pytest.param("auto", "int8", marks=int8_activations.marks)])
async def test_quantized_engine_answers_and_agrees_with_fp32(fp32_answers, mode, activations):
    outputs, engine = await answers(mode, activations)
    if activations == "int8":  # the engine really ran them
        assert engine.runner.model.layers[0].qkv_proj.int8_activations
    shared = agreement([c.token_ids for c in outputs], [c.token_ids for c in fp32_answers])
    if activations == "float32":
        # Measured: all three answers identical to fp32 for both; longer outputs drift more.
        assert "Paris" in outputs[0].text
        assert shared["mean_prefix_share"] >= 0.5, shared
    else:
        # int8 activations cost more: measured, 41.7 % of the tokens before the first
        # difference, 1 of 3 answers identical (2 + 2); the capital of France comes out as
        # "L'Étoile, la Marseillaise, ..." as weight-only int4's does (BENCHMARKS.md).
        assert all(c.token_ids for c in outputs)
        assert shared["mean_prefix_share"] >= 0.3, shared
