"""Priority told to stop while its NATS node is frozen: the queued request's answer (an
`overloaded` Error) waits on its echo, and priority goes on reporting the request as held until
the answer is confirmed on the next node, so admission's lease does not hand it on meanwhile. The
client gets the answer once. Real nats-servers, two clustered; priority the real service."""

from __future__ import annotations

import asyncio
import time

import msgspec
import nats.errors
import pytest
from opentelemetry.trace import NoOpTracer

from loadtest.echoes import clustered_pair, connect_to
from services.priority.service import PriorityService
from services.stack import free_port
from shared.config import DistributedSection, JetserveConfig, NatsSection
from shared.keys import RequestKey
from shared.messages import Holding, SubmitReply, WorkItem, decoder, encode
from shared.protocol import Completion, Error, GenerateRequest
from shared.subjects import Subjects
from tests.nats_server import freeze, services_connection

pytestmark = pytest.mark.asyncio
decode_output = msgspec.json.Decoder(Completion | Error).decode


async def test_a_stopping_priority_holds_an_answer_until_its_echo_is_back():
    port = free_port(nats_cluster=2)
    nodes = clustered_pair(port, name="stop")
    config = JetserveConfig(
        nats=NatsSection(url=f"nats://127.0.0.1:{port},nats://127.0.0.1:{port + 1}"),
        distributed=DistributedSection(heartbeat_interval_s=0.25, heartbeat_timeout_s=2.0))
    subjects = Subjects(config.nats.prefix)
    key = RequestKey("acme", "queued")
    connections, priority = [], None
    try:
        client = await connect_to([port + 1])
        services = await services_connection([port, port + 1])
        connections += [client, services]
        inbox = await client.subscribe("_INBOX.client.*")
        holding = await client.subscribe(subjects.holding)
        priority = PriorityService(config, services, services.jetstream(), NoOpTracer())
        await priority.start()
        item = WorkItem(request=GenerateRequest(request_id=key.request_id, prompt_token_ids=[1],
                                                max_tokens=4),
                        tenant=key.tenant, arrival_time=time.time(),
                        reply_to=f"_INBOX.client.{key.request_id}")
        for _ in range(100):  # until priority's interest reached the client's node
            try:
                reply = await client.request(subjects.priority_submit, encode(item), timeout=5)
                break
            except nats.errors.NoRespondersError:
                await asyncio.sleep(0.05)
        assert decoder(SubmitReply).decode(reply.data).error is None

        freeze(nodes[0])  # what priority writes from here stays unread there
        frozen_at = time.monotonic()
        stopping = asyncio.create_task(priority.stop())
        reports: list[tuple[float, Holding]] = []
        answers = []
        while not stopping.done() or not answers:
            try:
                msg = await holding.next_msg(timeout=0.2)
                reports.append((time.monotonic() - frozen_at, decoder(Holding).decode(msg.data)))
            except TimeoutError:
                pass
            while inbox.pending_msgs:
                answers.append(decode_output((await inbox.next_msg()).data))
            assert time.monotonic() - frozen_at < 30, "priority did not stop"
        await stopping
        await asyncio.sleep(0.5)
        while inbox.pending_msgs:
            answers.append(decode_output((await inbox.next_msg()).data))
        moved_to = services.connected_url.port
    finally:
        for nc in connections:
            await nc.close()
        for node in nodes:
            node.kill()
            node.wait(10)
    assert [(a.request_id, a.code) for a in answers] == [(key.request_id, "overloaded")]
    assert all(isinstance(a, Error) for a in answers)
    # Held through the seconds its connection took to move to the other node (a lease is
    # about 2 s here): reports of it reached the other node after the freeze.
    late = [at for at, report in reports if key in report.requests]
    assert late and max(late) > 2.0, reports
    assert moved_to == port + 1
