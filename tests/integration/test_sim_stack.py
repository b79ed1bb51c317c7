"""Eight simulated executors with the four services on this machine, as `jetserve up --model
sim:llama3-8b-h100 --executors 8` runs them."""

from __future__ import annotations

import asyncio

import pytest

from services.executor.engine.sim import synthetic_token
from shared.bus import discover
from shared.client import JetserveClient
from shared.protocol import Completion, GenerateRequest
from tests.integration.conftest import running_stack


@pytest.mark.asyncio
async def test_eight_sim_executors_serve_and_say_they_are_simulated(tmp_path):
    settings = {"model.name": "sim:llama3-8b-h100", "kv_cache.num_blocks": None}
    async with running_stack(tmp_path, executors=8, settings=settings) as stack:
        async with await JetserveClient.connect(stack.url, tenant="sim") as client:
            requests = [GenerateRequest(request_id=f"sim-{i}", prompt="Simulate me, please",
                                        max_tokens=32, ignore_eos=True, seed=i)
                        for i in range(32)]
            outputs = await asyncio.gather(*(client.generate(r, timeout=60) for r in requests))
            stats = await discover(client.nc, "STATS", "executor", wait_s=0.3)
    assert all(isinstance(o, Completion) for o in outputs), outputs
    assert {o.model for o in outputs} == {"sim:llama3-8b-h100"}
    assert outputs[3].token_ids == [synthetic_token(3, i, 49152) for i in range(32)]
    # Published H100 step times: 32 decode steps of ~7 ms, so well under a second each.
    assert max(o.metrics.e2e_ms for o in outputs) < 5000
    executors = {o.scheduling.executor for o in outputs}
    assert len(stats) == 8 and len(executors) >= 4
    data = [next(ep["data"] for ep in s["endpoints"] if ep.get("data")) for s in stats]
    assert {d["kv_blocks_total"] for d in data} == {25000}
