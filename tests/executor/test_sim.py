"""The simulated forward pass: the real engine around a cost model's wait."""

from __future__ import annotations

import time

import pytest

from services.executor.engine import Engine
from services.executor.sim import synthetic_length, synthetic_token
from shared.sim_profiles import StepCost, load_profile
from shared.model_files import load_model_config
from shared.protocol import GenerateRequest
from tests.conftest import generate_all, tiny_config


def test_cost_model_terms():
    cost = StepCost(base=1.0, weights=6.0, per_new_token=0.01, per_kv_token=0.001,
                    per_attn_pair=1e-6, per_seq=0.1)
    assert cost.ms(1, 0, 0, 1) == pytest.approx(1.0 + 6.0 + 0.1)  # memory bound: the weights
    assert cost.ms(1000, 0, 0, 1) == pytest.approx(1.0 + 10.0 + 0.1)  # compute bound
    assert cost.ms(10, 5000, 2_000_000, 10) == pytest.approx(1.0 + 6.0 + 5.0 + 2.0 + 1.0)


def test_profiles_load_and_name_their_sources():
    h100 = load_profile("llama3-8b-h100")
    assert h100.model_name == "sim:llama3-8b-h100" and h100.kv_blocks == 25000
    # Published: ~7.2 ms decode steps at small batch, ~12.5-13 ms at batch ~256 (see profile).
    assert 6.5 < h100.cost.ms(1, 300, 300, 1) < 8.0
    assert 11.5 < h100.cost.ms(256, 256 * 300, 256 * 300, 256) < 14.0
    cpu = load_profile("smollm2-cpu")
    assert cpu.cost.per_new_token > 0 and cpu.model_shape == "smollm2-135m"
    with pytest.raises(ValueError, match="unknown sim profile 'nope'"):
        load_profile("nope")
    config, directory = load_model_config("sim:llama3-8b-h100")
    assert directory is None and config.num_layers == 32 and config.vocab_size == 49152


def test_synthetic_tokens_are_a_fixed_function_of_seed_and_index():
    a = [synthetic_token(7, i, 49152) for i in range(50)]
    assert a == [synthetic_token(7, i, 49152) for i in range(50)]
    assert a != [synthetic_token(8, i, 49152) for i in range(50)]
    assert all(17 <= t < 49152 for t in a) and len(set(a)) > 40
    lengths = {synthetic_length(seed, 100, (0.2, 0.6)) for seed in range(200)}
    assert min(lengths) >= 20 and max(lengths) < 60 and len(lengths) > 20


async def test_sim_engine_runs_requests_in_model_time():
    engine = Engine(tiny_config(model="sim:llama3-8b-h100", num_kv_blocks=None))
    requests = [GenerateRequest(prompt_token_ids=list(range(100, 400)), max_tokens=40,
                                ignore_eos=True, seed=s) for s in range(4)]
    start = time.perf_counter()
    try:
        outputs = await generate_all(engine, requests)
    finally:
        await engine.stop()
    elapsed = time.perf_counter() - start
    assert [len(o.token_ids) for o in outputs] == [40] * 4
    assert outputs[0].token_ids == [synthetic_token(0, i, 49152) for i in range(40)]
    assert outputs[0].model == "sim:llama3-8b-h100"
    assert engine.block_manager.num_blocks == 25000
    # 40 steps of ~7 ms (one prefill step, then decodes): the model's time, not the CPU's.
    assert 40 * 0.007 < engine.stats.model_busy_s < 40 * 0.012
    assert elapsed < 3.0


async def test_sim_engine_stops_at_a_seeded_eos_without_ignore_eos(monkeypatch):
    engine = Engine(tiny_config(model="sim:llama3-8b-h100", num_kv_blocks=512))
    profile = engine.runner.profile
    monkeypatch.setattr(engine.runner, "profile", type(profile)(
        **{**profile.__dict__, "eos_fraction": (0.25, 0.5)}))
    try:
        [out] = await generate_all(engine, [GenerateRequest(prompt_token_ids=[100, 101],
                                                            max_tokens=64, seed=3)])
    finally:
        await engine.stop()
    assert out.finish_reason == "stop"
    assert len(out.token_ids) == synthetic_length(3, 64, (0.25, 0.5)) + 1  # EOS included
