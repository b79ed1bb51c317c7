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
