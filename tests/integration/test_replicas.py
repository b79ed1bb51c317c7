"""Two processes of each control-plane service (`jetserve up --replicas 2`): durable and
generate requests all end exactly once while a replica of priority or of the batcher is
SIGKILLed in turn under the load (each restarted). Not admission
yet: a generate that admission is admitting or watching when it dies is lost (its state is in
that process's memory, docs/operations.md), so killing an admission replica is not yet
answer-once for generates; durable requests survive it (test_chaos.py)."""

from __future__ import annotations

import asyncio
import random
import signal

import pytest

from shared.client import JetserveClient
from shared.protocol import Completion
from tests.integration.conftest import running_stack
from tests.integration.test_chaos import (CHAOS, check_exactly_once, generate_all,
                                          results_by_id, submit_all)

pytestmark = [pytest.mark.slow, pytest.mark.asyncio]


async def test_two_replicas_of_each_service_answer_every_request_once(tmp_path):
    victims = ["priority", "batcher-1", "priority-1", "batcher"]
    rng = random.Random(31)
    async with running_stack(tmp_path, executors=2, settings=CHAOS, replicas=2) as stack:
        assert {"admission-1", "priority-1", "batcher-1"} <= set(stack.processes)
        async with await JetserveClient.connect(stack.url, tenant="replicas") as client:
            ids = await submit_all(client, "rep", 100, rng)
            generates = generate_all(client, "gen", 100, rng)
            for name in victims:
                await asyncio.sleep(rng.uniform(1.0, 2.0))
                stack.processes[name].send_signal(signal.SIGKILL)
                await stack.processes[name].wait()
                await asyncio.sleep(0.5)
                await stack.restart(name)
            results = await results_by_id(client, ids, timeout=300)
            answers = await asyncio.gather(*generates)
            await check_exactly_once(client, ids, results)
    errors = [a for a in answers if not isinstance(a, Completion)]
    assert not errors, errors[:5]
    print(f"\nreplicas: 2 of each service, killed {victims}: {len(results)} durable "
          f"results, {len(answers)} generate answers, none lost or duplicated")
