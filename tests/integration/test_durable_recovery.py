"""Nothing durable is lost: an executor killed mid-request, the request still gets its result."""

from __future__ import annotations

import asyncio

import msgspec
import pytest

from shared.client import JetserveClient
from shared.protocol import Completion, GenerateRequest
from tests.integration.conftest import running_stack


@pytest.mark.asyncio
async def test_a_durable_request_survives_its_executor(tmp_path):
    settings = {"distributed.heartbeat_timeout_s": 1.0}
    async with running_stack(tmp_path, executors=2, settings=settings) as stack:
        async with await JetserveClient.connect(stack.url, tenant="durable") as client:
            request = GenerateRequest(request_id="survivor-1", prompt="long job", max_tokens=1500,
                                      ignore_eos=True, temperature=0.0)
            await client.submit(request)
            victim = None
            for _ in range(100):  # until one executor reports it running
                reply = await client.nc.request("llm.internal.batcher.executors", b"", timeout=2)
                busy = [n for n, e in msgspec.json.decode(reply.data).items() if e["running"]]
                if busy:
                    victim = busy[0]
                    break
                await asyncio.sleep(0.05)
            assert victim is not None
            stack.processes[victim].kill()  # SIGKILL: no drain, no goodbye
            result = await client.result("survivor-1", timeout=90)
    assert isinstance(result, Completion), result
    assert len(result.token_ids) == 1500 and result.finish_reason == "length"
    assert result.scheduling.executor != victim


async def service_stats(client, name: str) -> dict:
    reply = await client.nc.request(f"$SRV.STATS.{name}", b"", timeout=2)
    return next(ep["data"] for ep in msgspec.json.decode(reply.data)["endpoints"] if ep.get("data"))


@pytest.mark.asyncio
async def test_a_durable_request_waiting_longer_than_the_lease_runs_once(tmp_path):
    """Priority reports what waits there, so a long wait is not mistaken for a lost request."""
    settings = {"distributed.heartbeat_timeout_s": 1.0,
                "scheduler.batch_level.max_num_seqs": 1,
                "scheduler.batch_level.executor_queue_depth": 0}
    async with running_stack(tmp_path, settings=settings) as stack:
        async with await JetserveClient.connect(stack.url, tenant="patient") as client:
            busy = asyncio.create_task(client.generate(
                GenerateRequest(prompt="hog the only slot", max_tokens=1200, ignore_eos=True),
                timeout=60))
            await asyncio.sleep(0.3)
            await client.submit(GenerateRequest(request_id="waits-1", prompt="after you",
                                                max_tokens=4, ignore_eos=True))
            result = await client.result("waits-1", timeout=60)
            await busy
            for _ in range(50):  # the ack follows the stored result by a message
                admission = await service_stats(client, "admission")
                if admission["durable_acked"]:
                    break
                await asyncio.sleep(0.1)
            executor = await service_stats(client, "executor")
    assert isinstance(result, Completion) and result.metrics.queue_ms > 1000  # waited > lease
    assert admission["durable_redelivered"] == 0 and admission["durable_acked"] == 1
    assert executor["completed"] == 2 and executor["duplicates"] == 0


@pytest.mark.asyncio
async def test_two_tenants_may_use_the_same_request_id(tmp_path):
    async with running_stack(tmp_path) as stack:
        async with await JetserveClient.connect(stack.url, tenant="a") as a, \
                await JetserveClient.connect(stack.url, tenant="b") as b:
            same = GenerateRequest(request_id="shared-id", prompt="hi", max_tokens=300,
                                   ignore_eos=True)
            first, second = await asyncio.gather(a.generate(same, timeout=60),
                                                 b.generate(same, timeout=60))
    assert isinstance(first, Completion) and isinstance(second, Completion), (first, second)
    assert first.request_id == second.request_id == "shared-id"
