"""Whoever holds a request says so, and a holder that is merely slow is not taken for dead: a
request is answered once, whatever the timing."""

from __future__ import annotations

import asyncio
import os
import signal

import msgspec

from shared.client import JetserveClient, Output
from shared.protocol import Completion, GenerateRequest
from tests.integration.conftest import running_stack, service_stats

decode_output = msgspec.json.Decoder(Output).decode


async def test_an_assignment_answered_late_is_not_run_beside_its_requeue(tmp_path):
    """The only executor stalls (SIGSTOP) for 2.5 s while a request is assigned to it; the
    batcher waits 1 s for each answer (`nats.request_timeout_s`), gives up and queues the
    request again, again and again. When the executor wakes, the assignments the batcher gave
    up on are withdrawn: the request runs once and its client gets exactly one answer (it used
    to get an "already running" Error from a second, late assignment as well)."""
    settings = {"nats.request_timeout_s": 1.0}
    async with running_stack(tmp_path, settings=settings) as stack:
        executor = stack.processes["executor-0"]
        async with await JetserveClient.connect(stack.url, tenant="acme") as client:
            nc = client.nc
            inbox = nc.new_inbox()
            replies = await nc.subscribe(inbox)
            os.kill(executor.pid, signal.SIGSTOP)
            try:
                request = GenerateRequest(request_id="slow-assign", prompt="Hello", max_tokens=8,
                                          ignore_eos=True)
                await nc.publish("llm.generate.acme", msgspec.json.encode(request), reply=inbox)
                await asyncio.sleep(2.5)
            finally:
                os.kill(executor.pid, signal.SIGCONT)
            first = await replies.next_msg(timeout=30)
            await asyncio.sleep(2.0)  # any second answer would have come by now
            later = []
            while True:
                try:
                    later.append(await replies.next_msg(timeout=0.1))
                except Exception:  # nats' TimeoutError: nothing more
                    break
            batcher = await service_stats(client, "batcher")
            executor_stats = await service_stats(client, "executor")
    answer = decode_output(first.data)
    assert isinstance(answer, Completion) and answer.usage.completion_tokens == 8, answer
    assert [decode_output(m.data) for m in later] == []
    assert batcher["unassigned"] >= 1  # the batcher did give up on an assignment
    assert executor_stats["completed"] == 1 and executor_stats["id_in_use"] == 0

