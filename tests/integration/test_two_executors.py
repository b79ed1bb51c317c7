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


@pytest.mark.asyncio
async def test_kv_aware_routing_keeps_each_prefix_group_on_one_executor(tmp_path):
    """Requests of one prefix group go where the group's blocks are (promised at routing, then
    reported by the executor's KV events), so later ones find their prefix cached."""
    settings = {"scheduler.batch_level.max_num_seqs": 4,
                "scheduler.batch_level.routing": "kv_aware"}
    prefixes = {group: [(977 * i + 31 * group) % 30000 + 17 for i in range(200)]
                for group in (1, 2)}

    def request(group: int, n: int) -> GenerateRequest:
        return GenerateRequest(prompt_token_ids=prefixes[group] + [50 + n, 60 + n],
                               max_tokens=8, ignore_eos=True)

    async with running_stack(tmp_path, executors=2, settings=settings) as stack:
        async with await JetserveClient.connect(stack.url, tenant="groups") as client:
            # Group 1's three, then group 2's: round robin or least-loaded would split each.
            first = await asyncio.gather(*(client.generate(request(g, n), timeout=120)
                                           for g in (1, 2) for n in range(3)))
            await asyncio.sleep(3.0)  # past the routing promise: the KV events decide now
            later = await asyncio.gather(*(client.generate(request(g, 10), timeout=120)
                                           for g in (1, 2)))
    assert all(isinstance(c, Completion) for c in first + later)
    where = {g: {c.scheduling.executor for c in first[3 * (g - 1):3 * g]} for g in (1, 2)}
    assert all(len(executors) == 1 for executors in where.values()), where
    assert where[1] != where[2], where  # the second group went to the less loaded executor
    for g, completion in zip((1, 2), later):
        assert {completion.scheduling.executor} == where[g]
        assert completion.usage.cached_tokens >= 192  # the prefix's 12 full blocks of 16
