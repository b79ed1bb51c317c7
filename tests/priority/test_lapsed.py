"""Priority, the real service against a real nats-server: a request that waited in its queue
while its event loop stalled for more than half a lease (its holding reports stopped, so
admission may have handed the request on) leaves marked lapsed, so its answer is claimed
(shared/bus.py Lapses); one that came after the stall does not."""

from __future__ import annotations

import asyncio
import time

import pytest
from opentelemetry.trace import NoOpTracer

from services.priority.service import PriorityService
from shared.config import DistributedSection, JetserveConfig
from shared.messages import NextReply, NextRequest, SubmitReply, WorkItem, decoder, encode
from shared.protocol import GenerateRequest
from shared.subjects import Subjects
from tests.nats_server import nats_server

pytestmark = pytest.mark.asyncio


async def test_requests_that_waited_across_a_stall_leave_marked_lapsed(tmp_path):
    config = JetserveConfig(distributed=DistributedSection(
        heartbeat_interval_s=0.25, heartbeat_timeout_s=2.0))
    subjects = Subjects(config.nats.prefix)
    async with nats_server(tmp_path) as nc:
        priority = PriorityService(config, nc, nc.jetstream(), NoOpTracer())
        await priority.start()
        try:
            async def submit(request_id: str) -> None:
                item = WorkItem(request=GenerateRequest(request_id=request_id,
                                                        prompt_token_ids=[1], max_tokens=4),
                                tenant="acme", arrival_time=time.time())
                reply = await nc.request(subjects.priority_submit, encode(item), timeout=5)
                assert decoder(SubmitReply).decode(reply.data).error is None

            await submit("early")
            await asyncio.sleep(0.6)  # reported on time
            time.sleep(1.4)  # the loop stalls: no holding report for 1.4 s (half a lease: 1 s)
            await asyncio.sleep(0.6)  # the next report finds the gap
            await submit("late")
            reply = await nc.request(subjects.priority_next, encode(
                NextRequest(max_items=10, wait_ms=0)), timeout=5)
            items = decoder(NextReply).decode(reply.data).items
        finally:
            await priority.stop()
    assert {item.request_id: item.lapsed for item in items} == {"early": True, "late": False}
    assert priority.lapses.count >= 1
