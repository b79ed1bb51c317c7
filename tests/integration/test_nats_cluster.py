"""A three-node NATS cluster (`jetserve up --nats-cluster 3`): the streams are replicated three
ways, every connection knows every node, and SIGKILLing a node under load (then restarting it)
loses and duplicates nothing: every durable request has exactly one result, every generate
exactly one final answer, none an `internal` Error."""

from __future__ import annotations

import asyncio
import random
import signal

import pytest

from shared.client import JetserveClient
from shared.protocol import Completion
from shared.subjects import RESULTS_STREAM
from tests.integration.conftest import running_stack
from tests.integration.test_chaos import (CHAOS, check_exactly_once, generate_all,
                                          results_by_id, submit_all)

pytestmark = [pytest.mark.slow, pytest.mark.asyncio]


async def test_a_node_killed_under_load_loses_and_duplicates_nothing(tmp_path):
    rng = random.Random(29)
    async with running_stack(tmp_path, executors=2, settings=CHAOS, nats_cluster=3) as stack:
        assert len(stack.url.split(",")) == 3
        async with await JetserveClient.connect(stack.url, tenant="cluster") as client:
            for stream in (RESULTS_STREAM, "LLM_REQUESTS"):
                info = await client.js.stream_info(stream)
                assert info.config.num_replicas == 3, info.config
                assert len(info.cluster.replicas or []) == 2, info.cluster  # beside the leader
            ids = await submit_all(client, "cluster", 120, rng)
            generates = generate_all(client, "gen", 60, rng)
            await asyncio.sleep(2.0)
            # The node the client is on: the one whose loss disturbs it most.
            victim = f"nats-server-{stack.client_ports.index(client.nc.connected_url.port)}"
            stack.processes[victim].send_signal(signal.SIGKILL)
            await stack.processes[victim].wait()
            await asyncio.sleep(2.0)
            await stack.restart(victim)
            results = await results_by_id(client, ids, timeout=300)
            answers = await asyncio.gather(*generates)
            await check_exactly_once(client, ids, results)
            errors = [a for a in answers if not isinstance(a, Completion)]
            assert not errors, errors[:5]
            assert all(a.usage.completion_tokens == len(a.token_ids) for a in answers)
            assert all(p.returncode is None for p in stack.processes.values())
    print(f"\ncluster: killed {victim} under 120 durable and 60 generate requests: "
          f"{len(results)} results, {len(answers)} answers, 0 lost, 0 duplicated")
