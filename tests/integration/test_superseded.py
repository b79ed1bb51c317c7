"""An attempt that admission revoked (it handed the request on, taking its holder for dead)
leaves priority's waiting queue: it does not run beside the attempt that replaced it. Here the
revoke reaches a request still waiting, whose holder is alive: priority drops it, admission
finds it unreported for a lease and hands it on, and the client gets its one answer."""

from __future__ import annotations

import asyncio

import msgspec
import pytest

from shared.bus import discover
from shared.client import JetserveClient
from shared.messages import Revoke, encode
from shared.protocol import GenerateRequest
from tests.integration.conftest import SMALL_EXECUTOR, running_stack

pytestmark = pytest.mark.asyncio


async def priority_stats(client) -> dict:
    [answer] = await discover(client.nc, "STATS", "priority", wait_s=0.5)
    return next(ep["data"] for ep in answer["endpoints"] if ep.get("data"))


async def test_a_revoked_waiting_attempt_leaves_the_queue_and_the_request_is_answered_once(
        tmp_path):
    settings = {**SMALL_EXECUTOR, "model.name": "sim:smollm2-cpu",
                "distributed.heartbeat_timeout_s": 1.0}
    async with running_stack(tmp_path, settings=settings) as stack:
        async with await JetserveClient.connect(stack.url, tenant="acme") as client:
            answers: list = []

            async def on_answer(msg) -> None:
                if msg.data:
                    answers.append(msg.data)

            inbox = client.nc.new_inbox()
            await client.nc.subscribe(inbox, cb=on_answer)
            busy = [asyncio.create_task(client.generate(GenerateRequest(
                prompt=f"busy {i}", max_tokens=60, ignore_eos=True), timeout=60))
                for i in range(2)]
            await asyncio.sleep(0.5)  # both run; the next waits at priority
            await client.nc.publish(client.subjects.generate("acme"), msgspec.json.encode(
                GenerateRequest(request_id="waiting", prompt="waits", max_tokens=5)),
                reply=inbox)
            for _ in range(50):
                if (await priority_stats(client))["queue_depth"] == 1:
                    break
                await asyncio.sleep(0.1)
            await client.nc.publish(client.subjects.revoke, encode(Revoke("acme", "waiting", 0)))
            await asyncio.sleep(0.3)
            stats = await priority_stats(client)
            assert stats["superseded"] == 1 and stats["queue_depth"] == 0, stats
            await asyncio.gather(*busy)
            for _ in range(100):  # handed on after a lease, then run
                if answers:
                    break
                await asyncio.sleep(0.1)
            await asyncio.sleep(1.0)  # a second answer would come within this
    assert len(answers) == 1, answers
    assert b'"request_id":"waiting"' in answers[0] and b'"finish_reason"' in answers[0]
