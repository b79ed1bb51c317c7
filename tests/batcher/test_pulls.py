"""The batcher's pulls against a real nats-server, priority and one executor played by scripted
subscribers (the batcher itself is the real service): a pull priority answers after the
batcher gave it up (1 s past its wait) still has its requests sent on, while admission cannot
have handed them on yet; one answered later than that leaves them to admission's hand-on
rather than running them beside it."""

from __future__ import annotations

import asyncio
import time

import pytest
from opentelemetry.trace import NoOpTracer

from services.batcher.service import PULL_LATE_S, PULL_WAIT_MS, BatcherService
from shared.config import DistributedSection, JetserveConfig
from shared.messages import (
    AssignReply,
    Heartbeat,
    NextReply,
    NextRequest,
    WorkItem,
    decoder,
    encode,
)
from shared.protocol import GenerateRequest
from shared.subjects import Subjects
from tests.nats_server import nats_server

pytestmark = pytest.mark.asyncio

GIVEN_UP_S = PULL_WAIT_MS / 1e3 + PULL_LATE_S


async def late_pull(tmp_path, lease_s: float, answer_after_s: float) -> tuple[list[str], dict]:
    """The first pull answered `answer_after_s` after it came with one request; the others
    empty. What the executor was sent, and the batcher's counts."""
    config = JetserveConfig(distributed=DistributedSection(
        heartbeat_interval_s=0.25, heartbeat_timeout_s=lease_s))
    subjects = Subjects(config.nats.prefix)
    async with nats_server(tmp_path) as nc:
        assigned: list[str] = []
        pulls = 0

        async def on_next(msg) -> None:
            nonlocal pulls
            pulls += 1
            if pulls == 1:
                await asyncio.sleep(answer_after_s)
                item = WorkItem(request=GenerateRequest(request_id="late", prompt_token_ids=[1],
                                                        max_tokens=4),
                                tenant="acme", arrival_time=0.0, durable=True)
                await nc.publish(msg.reply, encode(NextReply([item])))
            else:
                await asyncio.sleep(decoder(NextRequest).decode(msg.data).wait_ms / 1e3)
                await nc.publish(msg.reply, encode(NextReply([])))

        async def on_assign(msg) -> None:
            assigned.append(decoder(WorkItem).decode(msg.data).request_id)
            await msg.respond(encode(AssignReply(accepted=True)))

        async def each_in_a_task(msg) -> None:  # a slow first answer holds up no other
            tasks.add(asyncio.create_task(on_next(msg)))

        tasks: set[asyncio.Task] = set()
        await nc.subscribe(subjects.priority_next, cb=each_in_a_task)
        await nc.subscribe(subjects.executor_assign("e0"), cb=on_assign)
        batcher = BatcherService(config, nc, nc.jetstream(), NoOpTracer())
        await batcher.start()
        try:
            for _ in range(int((answer_after_s + 1.5) / 0.25)):
                await nc.publish(subjects.heartbeat, encode(Heartbeat(
                    executor="e0", model="m", max_num_seqs=4, queue_depth=0, running=0,
                    waiting=0, assigned_total=len(assigned), free_kv_blocks=100,
                    total_kv_blocks=100, step_ms=10.0, started_at=1.0)))
                await asyncio.sleep(0.25)
        finally:
            await batcher.stop()
        return assigned, batcher.counts


async def test_a_pull_answered_after_it_was_given_up_still_has_its_requests_sent(tmp_path):
    # lease 5 s, heartbeats every 0.25 s: sent on until 4.15 s after the pull
    assigned, counts = await late_pull(tmp_path, lease_s=5.0, answer_after_s=GIVEN_UP_S + 1.0)
    assert assigned == ["late"], (assigned, counts)
    assert (counts["pulled_late"], counts["pulled_too_late"]) == (1, 0), counts


async def test_a_pull_answered_past_the_hand_on_leaves_its_requests_to_admission(tmp_path):
    # lease 2 s: admission may hand the request on from 1.5 s after priority's last report
    assigned, counts = await late_pull(tmp_path, lease_s=2.0, answer_after_s=GIVEN_UP_S + 1.0)
    assert assigned == [], (assigned, counts)
    assert (counts["pulled_late"], counts["pulled_too_late"]) == (0, 1), counts


async def test_requests_pulled_across_a_stall_of_the_batcher_are_marked_lapsed(tmp_path):
    """The batcher's event loop stalls (for more than half a lease) while a pull's reply is
    on its way: its requests were in nobody's holding reports meanwhile, and may have been
    handed on, so they reach the executor marked lapsed (their answers are claimed,
    shared/bus.py Lapses). Requests pulled before the stall, and after it, are not."""
    config = JetserveConfig(distributed=DistributedSection(
        heartbeat_interval_s=0.25, heartbeat_timeout_s=1.6))  # (a stall: 0.8 s)
    subjects = Subjects(config.nats.prefix)
    async with nats_server(tmp_path) as nc:
        assigned: dict[str, bool] = {}
        pulls = 0

        async def on_next(msg) -> None:
            nonlocal pulls
            pulls += 1
            name = {1: "before", 6: "across", 9: "after"}.get(pulls)
            if name == "across":
                time.sleep(1.1)  # the whole loop stalls, the batcher's with it (the pull
                # is given up at 1.5 s)
            items = [] if name is None else [WorkItem(
                request=GenerateRequest(request_id=name, prompt_token_ids=[1], max_tokens=4),
                tenant="acme", arrival_time=0.0)]
            if name is None:
                await asyncio.sleep(0.2)
            await nc.publish(msg.reply, encode(NextReply(items)))

        async def on_assign(msg) -> None:
            item = decoder(WorkItem).decode(msg.data)
            assigned[item.request_id] = item.lapsed
            await msg.respond(encode(AssignReply(accepted=True)))

        await nc.subscribe(subjects.priority_next, cb=on_next)
        await nc.subscribe(subjects.executor_assign("e0"), cb=on_assign)
        batcher = BatcherService(config, nc, nc.jetstream(), NoOpTracer())
        await batcher.start()
        try:
            for _ in range(60):
                await nc.publish(subjects.heartbeat, encode(Heartbeat(
                    executor="e0", model="m", max_num_seqs=4, queue_depth=0, running=0,
                    waiting=0, assigned_total=len(assigned), free_kv_blocks=100,
                    total_kv_blocks=100, step_ms=10.0, started_at=1.0)))
                await asyncio.sleep(0.1)
                if len(assigned) == 3:
                    break
        finally:
            await batcher.stop()
    assert assigned == {"before": False, "across": True, "after": False}, assigned
    assert batcher.lapses.count >= 1
