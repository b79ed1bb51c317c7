"""Two executors share the load the batcher routes."""

from __future__ import annotations

import asyncio
from collections import Counter

import pytest

from shared.client import JetserveClient
from shared.protocol import Completion, GenerateRequest
from tests.integration.conftest import running_stack


@pytest.mark.asyncio
async def test_two_executors_share_the_load(tmp_path):
    settings = {"scheduler.batch_level.max_num_seqs": 4,
                "scheduler.batch_level.executor_queue_depth": 0}
    async with running_stack(tmp_path, executors=2, settings=settings) as stack:
        async with await JetserveClient.connect(stack.url, tenant="shared") as client:
            requests = [GenerateRequest(prompt=f"request number {i}", max_tokens=200,
                                        ignore_eos=True) for i in range(16)]
            completions = await asyncio.gather(*(client.generate(r, timeout=120)
                                                 for r in requests))
    assert all(isinstance(c, Completion) and len(c.token_ids) == 200 for c in completions)
    per_executor = Counter(c.scheduling.executor for c in completions)
    assert set(per_executor) == {"executor-0", "executor-1"}
    # Least-loaded routing with 4 slots each: neither executor takes much more than half.
    assert min(per_executor.values()) >= 6, per_executor
