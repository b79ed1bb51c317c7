"""A request's final output, against a real nats-server: a durable result is stored once (a second
result for the same request is refused inside the duplicate window and past it), and an output
that cannot be delivered (over max_payload, refused by the result store) ends its request with an
Error saying why, and admission is told it is done, so it is not run again; and an answer goes
to a reply subject only when it is a client inbox."""

from __future__ import annotations

import asyncio

import msgspec
import nats.errors
import pytest

from shared.bus import ANSWERS_AGAIN, Outbox, ensure_streams
from shared.config import JetserveConfig, NatsSection
from shared.messages import Done, WorkItem, decoder
from shared.protocol import (
    Completion,
    Delta,
    Error,
    GenerateRequest,
    Metrics,
    Scheduling,
    Usage,
)
from shared.request_state import ARRIVAL_HEADER, STATE_STREAM, RequestStates, request_subject
from shared.subjects import RESULTS_STREAM, Subjects
from loadtest.echoes import clustered_pair, connect_to
from services.stack import free_port
from tests.nats_server import freeze, nats_server, services_connection

decode_output = msgspec.json.Decoder(Completion | Error).decode


@pytest.fixture
async def js(tmp_path):
    async with nats_server(tmp_path) as nc:
        yield nc.jetstream()


async def test_a_second_result_past_the_duplicate_window_is_not_stored(js):
    config = JetserveConfig(nats=NatsSection(duplicate_window_s=0.5))
    await ensure_streams(js, config)
    outbox = Outbox(js._nc, js, Subjects("llm"), "_INBOX")
    first = Error(request_id="once", code="internal", message="first")
    await outbox.store_result("acme", "once", first)
    await outbox.store_result("acme", "once", Error(request_id="once", code="internal",
                                                    message="within the window"))
    await asyncio.sleep(1.0)  # the duplicate window has passed
    await outbox.store_result("acme", "once", Error(request_id="once", code="internal",
                                                    message="a late second run"))
    info = await js.stream_info(RESULTS_STREAM, subjects_filter="llm.results.acme.once")
    assert info.state.subjects == {"llm.results.acme.once": 1}
    stored = await js.get_last_msg(RESULTS_STREAM, "llm.results.acme.once")
    assert b'"first"' in stored.data


def completion(request_id: str, text: str) -> Completion:
    return Completion(request_id=request_id, model="m", text=text, token_ids=[1] * 10,
                      finish_reason="length",
                      usage=Usage(prompt_tokens=1, completion_tokens=10, cached_tokens=0),
                      metrics=Metrics(queue_ms=0, ttft_ms=1, e2e_ms=2, tpot_ms=0.1),
                      scheduling=Scheduling(priority_score=0, executor="e", preemptions=0,
                                            queue_wait_ms=0))


def work_item(request_id: str, durable: bool, reply_to: str | None = None) -> WorkItem:
    request = GenerateRequest(request_id=request_id, prompt_token_ids=[1, 2], max_tokens=10)
    return WorkItem(request=request, tenant="acme", arrival_time=0.0, durable=durable,
                    reply_to=reply_to)


async def test_an_output_over_max_payload_is_answered_with_an_error(tmp_path):
    async with nats_server(tmp_path, max_payload=16384) as nc:
        outbox = Outbox(nc, nc.jetstream(), Subjects("llm"), "_INBOX")
        inbox = await nc.subscribe("_INBOX.client")
        done = await nc.subscribe("llm.internal.done")
        await outbox.final(work_item("huge", durable=False, reply_to="_INBOX.client"),
                           completion("huge", "x" * 20000))
        answer = decode_output((await inbox.next_msg(timeout=2)).data)
        told = decoder(Done).decode((await done.next_msg(timeout=2)).data)
    assert isinstance(answer, Error) and answer.code == "internal", answer
    assert "max_payload (16384 bytes)" in answer.message
    assert (told.request_id, told.durable) == ("huge", False)


async def test_a_result_the_store_refuses_ends_the_request_with_an_error(tmp_path):
    """LLM_RESULTS refuses messages over 1 KiB (a stream limit): the 5 KB result is replaced by
    an Error that fits, and admission is told the request is done (it acks it, no rerun)."""
    async with nats_server(tmp_path) as nc:
        js = nc.jetstream()
        await ensure_streams(js, JetserveConfig())
        config = (await js.stream_info(RESULTS_STREAM)).config
        config.max_msg_size = 1024
        await js.update_stream(config)
        done = await nc.subscribe("llm.internal.done")
        await Outbox(nc, js, Subjects("llm"), "_INBOX").final(work_item("big", durable=True),
                                                    completion("big", "y" * 5000))
        stored = decode_output((await js.get_last_msg(RESULTS_STREAM, "llm.results.acme.big")).data)
        told = decoder(Done).decode((await done.next_msg(timeout=2)).data)
    assert isinstance(stored, Error) and stored.code == "internal", stored
    assert "the result store refused it" in stored.message, stored.message
    assert (told.request_id, told.tenant, told.durable) == ("big", "acme", True)


async def test_an_item_whose_reply_subject_is_no_client_inbox_gets_nothing_there(tmp_path):
    """An item can reach a service without admission (a forged submission to priority): its
    deltas and answer go to its reply subject only when that is a client inbox."""
    async with nats_server(tmp_path) as nc:
        outbox = Outbox(nc, nc.jetstream(), Subjects("llm"), "_INBOX")
        heard = await nc.subscribe("llm.results.>")
        done = await nc.subscribe("llm.internal.done")
        item = work_item("forged", durable=False, reply_to="llm.results.bob.forged")
        await outbox.delta(item, Delta(request_id="forged", index=0, token_ids=[1], text="x"))
        await outbox.final(item, completion("forged", "x"))
        told = decoder(Done).decode((await done.next_msg(timeout=2)).data)
        with pytest.raises(nats.errors.TimeoutError):
            await heard.next_msg(timeout=0.3)
    assert told.request_id == "forged"  # it ended all the same


async def test_a_generate_is_answered_once_whichever_attempts_reach_their_end(tmp_path):
    """Two attempts of one generate both finish (the first ran on, unheard, while the request
    was handed on): the first answers, the second sends nothing and says Done only. The same
    id sent again later (another arrival) is another request, and is answered."""
    async with nats_server(tmp_path) as nc:
        js = nc.jetstream()
        await ensure_streams(js, JetserveConfig())
        outbox = Outbox(nc, js, Subjects("llm"), "_INBOX")
        inbox = await nc.subscribe("_INBOX.client")
        done = await nc.subscribe("llm.internal.done")
        first = work_item("twice", durable=False, reply_to="_INBOX.client")
        second = msgspec.structs.replace(first, attempt=1)
        await outbox.final(first, completion("twice", "first"))
        await asyncio.gather(*outbox.ending)  # its state ended (acked, beside its answer)
        await outbox.final(second, completion("twice", "second"))
        answers = [decode_output(msg.data) for msg in await _drain(inbox)]
        dones = [decoder(Done).decode(msg.data) for msg in await _drain(done)]
        assert [a.text for a in answers] == ["first"]
        assert [d.request_id for d in dones] == ["twice", "twice"]  # (its watcher stops)
        again = msgspec.structs.replace(first, arrival_time=5.0)
        await outbox.final(again, completion("twice", "again"))
        assert [decode_output(m.data).text for m in await _drain(inbox)] == ["again"]


async def test_a_first_attempt_whose_holder_lapsed_claims_its_answer(tmp_path):
    """The other order: the handed-on attempt answers first, and the first attempt, whose
    holder was cut off (it missed its revoke), reaches its end after. Marked lapsed by its
    holder, it claims its answer as a handed-on attempt does, finds the answer given, and
    sends nothing but its Done."""
    async with nats_server(tmp_path) as nc:
        js = nc.jetstream()
        await ensure_streams(js, JetserveConfig())
        subjects = Subjects("llm")
        outbox = Outbox(nc, js, subjects, "_INBOX")
        inbox = await nc.subscribe("_INBOX.client")
        done = await nc.subscribe("llm.internal.done")
        first = work_item("cut-off", durable=False, reply_to="_INBOX.client")
        states = RequestStates(nc, js, subjects, "admission-a")
        assert await states.create(first.key, b"item", 0, False, first.arrival_time) is not None
        handed_on = msgspec.structs.replace(first, attempt=1)
        await outbox.final(handed_on, completion("cut-off", "handed on"))
        await outbox.final(msgspec.structs.replace(first, lapsed=True),
                           completion("cut-off", "first"))
        answers = [decode_output(msg.data).text for msg in await _drain(inbox)]
        dones = [decoder(Done).decode(msg.data) for msg in await _drain(done)]
    assert answers == ["handed on"]
    assert [d.request_id for d in dones] == ["cut-off", "cut-off"]


async def _drain(sub, wait_s: float = 0.3) -> list:
    out = []
    with pytest.raises(nats.errors.TimeoutError):
        while True:
            out.append(await sub.next_msg(timeout=wait_s))
    return out


async def test_an_answered_requests_state_is_ended_once_jetstream_takes_it(tmp_path):
    """The answer goes out at once; the state's tombstone, acked, is tried again while
    LLM_STATE refuses it (here: a message size limit, lifted a second later; in a cluster: a
    stream electing a leader after a node died), so the state does not outlive its request (an
    admission starting later would take it over and run it again)."""
    async with nats_server(tmp_path) as nc:
        js = nc.jetstream()
        await ensure_streams(js, JetserveConfig())
        subjects = Subjects("llm")
        item = work_item("late", durable=False, reply_to="_INBOX.client")
        states = RequestStates(nc, js, subjects, "admission-a")
        assert await states.create(item.key, b"item", 0, False, item.arrival_time) is not None
        config = (await js.stream_info(STATE_STREAM)).config
        config.max_msg_size = 8
        await js.update_stream(config)
        outbox = Outbox(nc, js, subjects, "_INBOX")
        inbox = await nc.subscribe("_INBOX.client")
        await outbox.final(item, completion("late", "answered"))
        assert decode_output((await inbox.next_msg(timeout=2)).data).text == "answered"
        await asyncio.sleep(1.0)
        assert outbox.ending and await states.read(item.key, durable=False) is not None
        # Named answered in the holding reports until then, past their window.
        assert [e.request_id for e in outbox.recently_ended(window_s=0.0)] == ["late"]
        config.max_msg_size = -1
        await js.update_stream(config)
        await asyncio.wait_for(asyncio.gather(*outbox.ending), 10)
        last = await js.get_last_msg(STATE_STREAM, request_subject(subjects, item.key, False))
        assert outbox.recently_ended(window_s=0.0) == []
    assert not last.data and last.headers[ARRIVAL_HEADER] == repr(item.arrival_time)


async def test_a_durable_result_is_stored_once_jetstream_takes_it(tmp_path):
    """LLM_RESULTS is away for a second (here deleted and made again; in a cluster, electing a
    leader after a node died): the result in hand is stored when it is back, not dropped for
    the request to run a second time, and admission is told once it is stored."""
    async with nats_server(tmp_path) as nc:
        js = nc.jetstream()
        config = JetserveConfig()
        await ensure_streams(js, config)
        await js.delete_stream(RESULTS_STREAM)
        done = await nc.subscribe("llm.internal.done")
        outbox = Outbox(nc, js, Subjects("llm"), "_INBOX")
        answering = asyncio.create_task(outbox.final(work_item("kept", durable=True),
                                                     completion("kept", "stored late"),
                                                     held=True))
        await asyncio.sleep(1.0)
        assert not answering.done()
        assert await _drain(done, wait_s=0.1) == []  # not Done while it is not stored
        await ensure_streams(js, config)
        await asyncio.wait_for(answering, 10)
        stored = decode_output((await js.get_last_msg(RESULTS_STREAM,
                                                      "llm.results.acme.kept")).data)
        told = [decoder(Done).decode(msg.data) for msg in await _drain(done)]
    assert isinstance(stored, Completion) and stored.text == "stored late", stored
    assert [(d.request_id, d.durable) for d in told] == [("kept", True)]


@pytest.mark.parametrize("by, node", [("final", "killed"), ("reply", "killed"),
                                      ("final", "frozen")])
async def test_an_answer_lost_with_its_nats_node_is_published_again(by, node):
    """Core NATS gives no receipt: bytes written to a node that dies before it reads them are
    lost, and the publisher is not told. Here the outbox's node (of two, clustered) is stopped,
    the answer written to it, and the node killed: the outbox, on the other node now, finds
    its echo never came back and publishes the answer again. The client, on the other node,
    gets it once. An answer over a live connection is published once. `final`: an executor's
    (or priority's) answer; `reply`: admission's refusal, confirmed beside it. `frozen`: the
    node is never killed and its connections never close (a frozen host); the services'
    connection (shared.bus.connect) leaves it after unanswered pings, and the answer is
    published again then."""
    port = free_port(nats_cluster=2)
    nodes = clustered_pair(port)
    outbox, connections = None, []
    try:
        client = await connect_to([port + 1])
        if node == "killed":
            services = await connect_to([port, port + 1])  # on the first node while it lives
        else:
            services = await services_connection([port, port + 1])
        connections += [client, services]
        inbox = await client.subscribe("_INBOX.client.*")
        probe = await client.subscribe("_INBOX.probe")  # (its interest travels after the inbox's)
        for _ in range(100):  # the client's interest has reached the first node
            await services.publish("_INBOX.probe", b"")
            if await _drain(probe, wait_s=0.05):
                break
        outbox = Outbox(services, services.jetstream(), Subjects("llm"), "_INBOX")

        async def answer(request_id: str) -> None:
            if by == "final":
                await outbox.final(work_item(request_id, durable=False,
                                             reply_to=f"_INBOX.client.{request_id}"),
                                   completion(request_id, "answered"))
            else:
                await outbox.reply(f"_INBOX.client.{request_id}", Error(
                    request_id=request_id, code="rate_limited", message="answered"), False)

        again = ANSWERS_AGAIN._value.get()
        await answer("live")
        await asyncio.gather(*outbox.replying)
        assert [decode_output(m.data).request_id for m in await _drain(inbox)] == ["live"]
        assert ANSWERS_AGAIN._value.get() == again

        freeze(nodes[0])  # reads nothing more: what is written stays unread
        answering = asyncio.create_task(answer("lost"))
        await asyncio.sleep(0.5)
        waited = not (answering.done() and not outbox.replying)  # for its echo
        if node == "killed":
            nodes[0].kill()  # the unread answer is gone with it
            nodes[0].wait(10)
        await asyncio.wait_for(answering, 20)
        await asyncio.wait_for(asyncio.gather(*outbox.replying), 20)
        answers = [decode_output(m.data) for m in await _drain(inbox, wait_s=1.0)]
        assert [(a.request_id, a.message if by == "reply" else a.text) for a in answers] \
            == [("lost", "answered")]
        assert waited and ANSWERS_AGAIN._value.get() == again + 1
        assert services.connected_url.port == port + 1
    finally:
        if outbox is not None:
            for task in outbox.ending:  # (the states' ends: no JetStream here)
                task.cancel()
        for nc in connections:
            await nc.close()
        for node in nodes:
            node.kill()
            node.wait(10)
