"""Past one machine: a three-node NATS cluster (`jetserve up --nats-cluster 3`, streams R3),
two replicas of each control-plane service (`--replicas 2`) and two simulated executors take
300 durable and 300 generate requests while one process of each kind is SIGKILLed in turn and
restarted: a NATS node (the one leading LLM_STATE, made one the client is not on: the
services on it fail over, and the streams it led elect new leaders), an admission, a
priority, a batcher, an executor.
Every durable request has exactly one result, every generate exactly one final answer (counted
at its reply subject, two leases past the last), none an Error. The throughput around each
kill is printed (`python -m loadtest.cluster_chaos` measures it; BENCHMARKS.md)."""

from __future__ import annotations

import random

import pytest

from loadtest.cluster_chaos import SETTINGS, VICTIMS, chaos, report
from shared.client import JetserveClient
from shared.request_state import STATE_STREAM
from shared.subjects import REQUESTS_STREAM, RESULTS_STREAM
from tests.integration.conftest import running_stack

pytestmark = [pytest.mark.slow, pytest.mark.asyncio]


async def test_every_request_is_answered_once_while_one_of_each_process_is_killed(tmp_path):
    # (64 sequences a step, not the benchmark's 32: the same load in less of make test's time)
    settings = {**SETTINGS, "scheduler.batch_level.max_num_seqs": 64}
    async with running_stack(tmp_path, executors=2, settings=settings, nats_cluster=3,
                             replicas=2) as stack:
        assert len(stack.url.split(",")) == 3
        assert {"admission-1", "priority-1", "batcher-1"} <= set(stack.processes)
        async with await JetserveClient.connect(stack.url, tenant="chaos") as client:
            for stream in (REQUESTS_STREAM, RESULTS_STREAM, STATE_STREAM):
                info = await client.js.stream_info(stream)
                assert info.config.num_replicas == 3, info.config
                assert len(info.cluster.replicas or []) == 2, info.cluster  # beside the leader
            result = await chaos(stack, client, 300, 300, VICTIMS, gap_s=3.0, pause_s=0.5,
                                 rng=random.Random(29))
    print("\n" + report(result))
    assert len(result["kills"]) == len(VICTIMS)
    assert (result["durable_answered"], result["results_stored"]) == (300, 300), result
    assert result["generate_answered"] == 300, result
    assert result["duplicates"] == 0, result["duplicated"]
    assert result["error_count"] == 0, result["errors"]
    assert result["requests_left_in_stream"] == 0 and result["processes_running"], result
