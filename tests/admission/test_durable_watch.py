"""Admission's watch over durable and held requests, against a real nats-server: a Done that
arrives while lost requests are being handed on does not break the watch; redeliveries that were
not failures do not count as failures."""

from __future__ import annotations

import asyncio

import msgspec
from nats.js.api import ConsumerConfig
from nats.js.errors import NotFoundError

from services.admission.service import MAX_FAILURES, Admission
from shared.bus import ensure_streams
from shared.config import load_config
from shared.keys import RequestKey
from shared.messages import Done, SubmitReply, WorkItem, encode
from shared.protocol import Error, GenerateRequest
from shared.subjects import REQUESTS_STREAM, RESULTS_STREAM, Subjects
from tests.nats_server import nats_server


async def test_a_done_during_a_hand_on_leaves_the_watch_running(tmp_path):
    """Two requests went unreported for a lease: a generate (handed on to priority) and a durable
    one adopted after a restart (no copy: handed back to JetStream). While priority takes the
    generate, the durable one's Done arrives (its result was stored). It is acked, not handed
    back, and the watch goes on (it used to end with a KeyError, and with it every failover and
    in-progress ack for the rest of the process's life)."""
    config = load_config(None, {"JETSERVE_MODEL__NAME": "dummy:tiny"})
    subjects = Subjects(config.nats.prefix)
    async with nats_server(tmp_path) as nc:
        js = nc.jetstream()
        await ensure_streams(js, config)
        await js.publish(subjects.requests("acme", "durable-1"), b"{}")
        pull = await js.pull_subscribe(subjects.all_requests, durable="test",
                                       stream=REQUESTS_STREAM,
                                       config=ConsumerConfig(ack_wait=30))
        [message] = await pull.fetch(1, timeout=5)
        admission = Admission(config, nc, js, tracer=None)
        await nc.subscribe(subjects.done, cb=admission.on_done)

        async def slow_priority(msg):  # priority takes the generate; meanwhile the Done comes
            await nc.publish(subjects.done, encode(Done("acme", "durable-1", True, 0.0, 5, 0, 1, 4, 1.0, "stop")))
            await asyncio.sleep(0.2)
            await msg.respond(encode(SubmitReply()))

        await nc.subscribe(subjects.priority_submit, cb=slow_priority)
        generate = WorkItem(request=GenerateRequest(request_id="gen-1", prompt_token_ids=[1, 2],
                                                    max_tokens=4, model="dummy:tiny"),
                            tenant="acme", arrival_time=0.0, reply_to="_INBOX.client")
        ledger, durable = admission.ledger, RequestKey("acme", "durable-1")
        ledger.watch(generate.key, encode(generate))
        ledger.watch(durable, None, message)  # adopted after a restart: no copy
        ledger.submitted(generate.key, durable=False)
        ledger.submitted(durable, durable=True)
        admission.ledger.clock = admission.ledger.lease_s + 1
        await admission.watch_over()
        info = await js.consumer_info(REQUESTS_STREAM, "test")
    assert admission.counts["generates_handed_on"] == 1
    assert admission.counts["durable_redelivered"] == 0 and admission.counts["durable_acked"] == 1
    assert ("acme", "durable-1") not in admission.ledger.held
    assert info.num_ack_pending == 0 and info.num_redelivered == 0


async def test_transient_refusals_are_not_counted_as_failures(tmp_path):
    """A durable request put back six times (rate limited, queue full: JetStream redelivers it)
    then failing inside admission once is retried, not answered `internal`: only admission's own
    failures count toward MAX_FAILURES (they used to count every delivery)."""
    config = load_config(None, {"JETSERVE_MODEL__NAME": "dummy:tiny"})
    subjects = Subjects(config.nats.prefix)
    async with nats_server(tmp_path) as nc:
        js = nc.jetstream()
        await ensure_streams(js, config)
        await js.publish(subjects.requests("acme", "durable-2"),
                         b'{"type": "generate", "prompt": "Hi"}')
        pull = await js.pull_subscribe(subjects.all_requests, durable="test",
                                       stream=REQUESTS_STREAM)
        for _ in range(6):  # what a rate limit or a full queue does: back for later
            [message] = await pull.fetch(1, timeout=5)
            await message.nak()
        admission = Admission(config, nc, js, tracer=None)
        outcomes = []
        for _ in range(MAX_FAILURES):
            [message] = await pull.fetch(1, timeout=5)
            await admission.durable_failed(message, RuntimeError("a bug"))
            outcomes.append(await stored_result(js, subjects.results("acme", "durable-2")))
    assert message.metadata.num_delivered == 6 + MAX_FAILURES
    assert outcomes[:-1] == [None] * (MAX_FAILURES - 1)  # retried
    assert outcomes[-1].code == "internal" and "failed 5 times" in outcomes[-1].message


async def stored_result(js, subject: str) -> Error | None:
    try:
        msg = await js.get_last_msg(RESULTS_STREAM, subject)
    except NotFoundError:
        return None
    return msgspec.json.decode(msg.data, type=Error)
