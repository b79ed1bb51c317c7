"""The engine on the real SmolLM2-135M-Instruct: parity with transformers and batch invariance."""

from __future__ import annotations

import pytest
import pytest_asyncio
import torch

from services.executor.engine.llm_engine import Engine
from shared.model_files import default_gguf_path
from shared.config import engine_config
from shared.protocol import ChatMessage, GenerateRequest
from tests.conftest import generate_all

pytestmark = [pytest.mark.slow, pytest.mark.asyncio(loop_scope="module")]

QUESTIONS = [
    "What is the capital of France?",
    "Write a short poem about autumn leaves falling in a quiet park.",
    "Explain, step by step and in some detail, how a bicycle stays upright while it moves, and "
    "why it falls over when it stops. Mention gyroscopic effects, trail and steering.",
    "2+2=",
    "List three fruits.",
]
RAW = [
    "The quick brown fox",
    "def fibonacci(n):\n    ",
    "In 1492, Columbus sailed across the Atlantic Ocean. " * 6 + "Historians now believe that",
    "Once upon a time",
    "Water boils at a temperature of",
]


@pytest.fixture(scope="module")
def prompts(engine) -> list[list[int]]:
    chats = [engine.tokenize(GenerateRequest(messages=[ChatMessage("user", q)])) for q in QUESTIONS]
    return chats + [engine.tokenize(GenerateRequest(prompt=p)) for p in RAW]


SETTINGS = {"scheduler.batch_level.max_num_seqs": 16,
            "scheduler.batch_level.max_num_batched_tokens": 256, "kv_cache.num_blocks": 512}


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def engine():
    """The default engine: fp32, or bf16 where the CPU has native bf16."""
    engine = Engine(engine_config(SETTINGS))
    yield engine
    await engine.stop()


# How far below fp32's top logit a bf16 greedy token may be (teacher-forced).
GAP = 0.25  # 0.058 measured on the ten prompts (Zen 4)


def greedy(ids, max_tokens=32):
    return GenerateRequest(prompt_token_ids=ids, max_tokens=max_tokens, temperature=0.0,
                           ignore_eos=True)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def together(engine, prompts) -> list[list[int]]:
    """The engine's greedy tokens for every prompt, all submitted at once."""
    return [c.token_ids for c in await generate_all(engine, [greedy(p) for p in prompts])]


@pytest.fixture(scope="module")
def transformers_model():
    from transformers import AutoModelForCausalLM

    path = default_gguf_path()
    return AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                dtype=torch.float32)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def fp32_together(engine, prompts, together) -> list[list[int]]:
    """An fp32 engine's greedy tokens (the default engine's where that is fp32)."""
    if engine.dtype == torch.float32:
        return together
    fp32 = Engine(engine_config({**SETTINGS, "model.dtype": "float32"}))
    try:
        return [c.token_ids for c in await generate_all(fp32, [greedy(p) for p in prompts])]
    finally:
        await fp32.stop()


async def test_greedy_parity_with_transformers(prompts, fp32_together, transformers_model):
    """transformers (fp32) on the same GGUF, teacher-forced: given each prompt and the fp32
    engine's tokens so far, its most likely next token is the engine's next token, at every one
    of the 32 positions. That is greedy decoding's definition, so it holds exactly when
    transformers' own `generate` would produce the same tokens; one forward pass a prompt
    instead of 32 decode steps."""
    assert len({len(p) for p in prompts}) >= 8  # prompts of different lengths
    with torch.inference_mode():
        for ids, tokens in zip(prompts, fp32_together):
            assert len(tokens) == 32
            logits = transformers_model(torch.tensor([ids + tokens])).logits[0]
            expected = logits[len(ids) - 1:-1].argmax(-1).tolist()
            assert tokens == expected, f"prompt of {len(ids)} tokens diverged"


async def test_a_bf16_default_stays_close_to_fp32(engine, prompts, together, fp32_together,
                                                 transformers_model):
    """Where the default is bf16: under teacher forcing on its own tokens, transformers' fp32
    logits rank each bf16 greedy token first or within GAP of the first (a near-tie that bf16's
    rounding can tip), and most continuations equal fp32's."""
    if engine.dtype != torch.bfloat16:
        pytest.skip("the default model here is fp32 (no native bf16)")
    gaps = []
    with torch.inference_mode():
        for ids, tokens in zip(prompts, together):
            logits = transformers_model(torch.tensor([ids + tokens])).logits[0][len(ids) - 1:-1]
            gaps += (logits.max(-1).values - logits[torch.arange(32), tokens]).tolist()
    print(f"bf16 tokens ranked first by fp32: {sum(g == 0 for g in gaps)}/{len(gaps)}, "
          f"largest gap {max(gaps):.3f}; continuations equal to fp32's: "
          f"{sum(a == b for a, b in zip(together, fp32_together))}/{len(prompts)}")
    assert max(gaps) <= GAP
    assert sum(a == b for a, b in zip(together, fp32_together)) >= len(prompts) // 2


async def test_capital_of_france(engine):
    [answer] = await generate_all(engine, [GenerateRequest(
        messages=[ChatMessage("user", "What is the capital of France?")], temperature=0.0,
        max_tokens=32)])
    assert "Paris" in answer.text and answer.finish_reason == "stop"


async def test_alone_equals_together(engine, prompts, together):
    for ids, expected in zip(prompts[:3], together[:3]):
        [alone] = await generate_all(engine, [greedy(ids)])
        assert alone.token_ids == expected


async def test_prefix_cache_hit_same_tokens(engine, prompts):
    system = ("You are a meticulous assistant. Answer briefly, cite no sources, and never "
              "apologise. ") * 12
    first = GenerateRequest(messages=[ChatMessage("system", system), ChatMessage("user", "Hi!")],
                            max_tokens=24, temperature=0.0)
    second = GenerateRequest(messages=[ChatMessage("system", system),
                                       ChatMessage("user", "Name a colour.")],
                             max_tokens=24, temperature=0.0)
    [a] = await generate_all(engine, [first])
    [b] = await generate_all(engine, [second])
    assert a.usage.prompt_tokens > 200 and b.usage.cached_tokens >= 200
    cold = Engine(engine_config({"scheduler.batch_level.max_num_seqs": 4,
                                 "kv_cache.num_blocks": 128,
                                 "kv_cache.enable_prefix_caching": False}))
    try:
        [b_cold] = await generate_all(cold, [second])
    finally:
        await cold.stop()
    assert b_cold.usage.cached_tokens == 0
    assert b.token_ids == b_cold.token_ids


async def test_forced_preemption_same_tokens(prompts, together):
    tight = Engine(engine_config({"scheduler.batch_level.max_num_seqs": 16,
                                  "scheduler.batch_level.max_num_batched_tokens": 256,
                                  "kv_cache.num_blocks": 24}))
    try:
        completions = await generate_all(tight, [greedy(p) for p in prompts])
    finally:
        await tight.stop()
    assert sum(c.scheduling.preemptions for c in completions) > 0
    assert [c.token_ids for c in completions] == together
