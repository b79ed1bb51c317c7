"""The step profiler on the tiny model: every part is measured, and the model is left as it was."""

from __future__ import annotations

from loadtest.step_profile import PARTS, labelled, run_case
from services.executor.engine.llm_engine import Engine
from tests.conftest import tiny_config


async def test_parts_cover_the_step_and_the_model_is_restored():
    engine = Engine(tiny_config())
    model = engine.runner.model
    linear = model.layers[0].qkv_proj
    try:
        for decodes, context, prefill, cached in ((3, 40, 0, 0), (2, 20, 24, 0), (0, 0, 16, 40)):
            row = run_case(engine, decodes, context, prefill, repeats=2, cached=cached)
            assert row["cached"] == cached
            parts = row["parts_ms"]
            assert set(parts) == set(PARTS.values()) | {"python and dispatch between ops"}
            assert all(ms > 0 for ms in parts.values()), parts
            # Each figure is rounded to 0.01 ms on its own.
            assert abs(sum(parts.values()) - row["profiled_step_ms"]) <= 0.005 * (len(parts) + 1)
        with labelled(model):
            assert model.layers[0].qkv_proj is not linear
        assert model.layers[0].qkv_proj is linear
        assert "attention" not in vars(model.backend) and "lm_head" in vars(model)
    finally:
        await engine.stop()
