"""The public protocol end to end: four services as processes over a real nats-server."""

from __future__ import annotations

import asyncio
import contextlib
import time

import msgspec
import nats.js.errors
import pytest
import pytest_asyncio

from shared.bus import discover
from shared.client import JetserveClient
from shared.protocol import Completion, Delta, Error, GenerateRequest
from shared.subjects import RESULTS_STREAM
from tests.integration.conftest import (
    SMALL_EXECUTOR,
    finish_order_with_a_late_urgent_request,
    running_stack,
    service_stats,
    wait_for_stat,
)

pytestmark = pytest.mark.asyncio(loop_scope="module")

decode_output = msgspec.json.Decoder(Delta | Completion | Error).decode


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def stack(tmp_path_factory):
    # (A client gone for 0.1 s is gone: the tiny model would finish first at the default.)
    async with running_stack(tmp_path_factory.mktemp("pipeline"), settings={
            **SMALL_EXECUTOR, "distributed.client_gone_after_s": 0.1}) as s:
        yield s


@pytest_asyncio.fixture(loop_scope="module")
async def client(stack):
    client = await JetserveClient.connect(stack.url, tenant="acme")
    yield client
    await client.close()


def long_request(request_id: str, max_tokens: int, priority: int = 5) -> GenerateRequest:
    return GenerateRequest(request_id=request_id, prompt="Count with me: one two three",
                           max_tokens=max_tokens, ignore_eos=True, temperature=0.0,
                           priority=priority)


async def test_generate_returns_a_completion(client):
    completion = await client.generate(
        GenerateRequest(prompt="Hello there", max_tokens=8, ignore_eos=True), timeout=30)
    assert isinstance(completion, Completion), completion
    assert completion.finish_reason == "length"
    assert len(completion.token_ids) == completion.usage.completion_tokens == 8
    assert completion.usage.prompt_tokens == 2
    assert completion.model == "dummy:tiny"
    assert completion.scheduling.executor == "executor-0"
    assert completion.request_id.startswith("req-")
    assert 0 <= completion.metrics.queue_ms <= completion.metrics.ttft_ms <= completion.metrics.e2e_ms


async def test_stream_deltas_reassemble_and_the_sentinel_comes_last(client):
    request = GenerateRequest(request_id="stream-1", prompt="Tell me a story", max_tokens=24,
                              ignore_eos=True, stream=True, seed=7)
    inbox = client.nc.new_inbox()
    sub = await client.nc.subscribe(inbox)
    await client.nc.publish(client.subjects.generate("acme"), msgspec.json.encode(request),
                            reply=inbox)
    messages = []
    while True:
        msg = await sub.next_msg(timeout=30)
        messages.append(msg.data)
        if not msg.data:
            break
    await sub.unsubscribe()
    assert messages[-1] == b""
    outputs = [decode_output(data) for data in messages[:-1]]
    *deltas, completion = outputs
    assert isinstance(completion, Completion) and all(isinstance(d, Delta) for d in deltas)
    assert len(deltas) >= 2
    index = 0
    for delta in deltas:
        assert delta.request_id == "stream-1"
        assert delta.index == index  # contiguous: each delta starts where the last ended
        index += len(delta.token_ids)
    assert [t for d in deltas for t in d.token_ids] == completion.token_ids
    assert "".join(d.text for d in deltas) == completion.text
    # The same seed on the non-streaming path samples the same tokens.
    again = await client.generate(msgspec.structs.replace(request, request_id="stream-2",
                                                          temperature=1.0), timeout=30)
    first = await client.generate(msgspec.structs.replace(request, request_id="stream-3",
                                                          temperature=1.0), timeout=30)
    assert again.token_ids == first.token_ids


async def test_durable_submit_stores_one_result(client):
    request = GenerateRequest(request_id="durable-1", prompt="Remember this", max_tokens=6,
                              ignore_eos=True)
    ack = await client.submit(request)
    assert ack.stream == "LLM_REQUESTS" and not ack.duplicate
    result = await client.result("durable-1", timeout=30)
    assert isinstance(result, Completion), result
    assert result.request_id == "durable-1" and len(result.token_ids) == 6
    # A resubmission is answered by the stored result and never runs twice.
    again = await client.submit(request)
    assert again.duplicate and again.stream == RESULTS_STREAM
    stored = await client.js.get_last_msg(RESULTS_STREAM, "llm.results.acme.durable-1")
    assert decode_output(stored.data) == result
    info = await client.js.stream_info(RESULTS_STREAM, subjects_filter="llm.results.acme.durable-1")
    assert info.state.subjects == {"llm.results.acme.durable-1": 1}


async def test_durable_stream_deltas_add_up_to_the_stored_result(client):
    deltas = await client.stream_deltas("durable-stream-1")
    await client.submit(GenerateRequest(request_id="durable-stream-1", prompt="Stream and store",
                                        max_tokens=12, ignore_eos=True, stream=True))
    result = await client.result("durable-stream-1", timeout=30)
    received = []
    while sum(len(d.token_ids) for d in received) < 12:
        received.append(decode_output((await deltas.next_msg(timeout=10)).data))
    await deltas.unsubscribe()
    assert isinstance(result, Completion)
    assert [d.index for d in received] == sorted(d.index for d in received)
    assert [t for d in received for t in d.token_ids] == result.token_ids
    assert "".join(d.text for d in received) == result.text


async def test_durable_ids_are_per_tenant_and_the_server_refuses_a_repeat_while_it_runs(
        client, stack):
    """A durable request's subject is its key: another tenant taking bob's next id first does
    not stop bob's request, and bob's own repeat while it runs is refused by JetStream (one
    message per subject), reported as a duplicate, and never runs twice."""
    async with await JetserveClient.connect(stack.url, tenant="bob") as bob:
        await client.submit(long_request("next-7", 3))  # acme squats bob's next id
        # Long enough to be still running when its repeat comes (60 tokens could end first
        # on a slow moment: the repeat is then answered by the stored result instead).
        first = await bob.submit(long_request("next-7", 1000))
        repeat = await bob.submit(long_request("next-7", 1000))
        assert not first.duplicate and repeat.duplicate and repeat.stream == "LLM_REQUESTS"
        mine, theirs = await asyncio.gather(client.result("next-7", timeout=30),
                                            bob.result("next-7", timeout=60))
    assert isinstance(mine, Completion) and len(mine.token_ids) == 3
    assert isinstance(theirs, Completion) and len(theirs.token_ids) == 1000, theirs
    info = await client.js.stream_info(RESULTS_STREAM, subjects_filter="llm.results.*.next-7")
    assert info.state.subjects == {"llm.results.acme.next-7": 1, "llm.results.bob.next-7": 1}


@pytest.mark.parametrize("subject, payload, headers, names", [
    # protocol v1's subject had no id: an Error says where durable requests go now
    ("llm.requests.acme", {"request_id": "v1-form"}, None, "llm.requests.acme.v1-form"),
    ("llm.requests.acme", {}, {"Nats-Msg-Id": "v1-header"}, "llm.requests.acme.v1-header"),
    # Nats-Msg-Id deduplicates across tenants, so it is refused
    ("llm.requests.acme.with-msg-id", {}, {"Nats-Msg-Id": "with-msg-id"}, "Nats-Msg-Id"),
    ("llm.requests.acme.one-id", {"request_id": "other-id"}, None, "subject's last token"),
])
async def test_a_durable_submission_that_names_no_key_gets_a_clear_error(
        client, subject, payload, headers, names):
    request_id = (headers or {}).get("Nats-Msg-Id") or payload.get("request_id")
    request_id = subject.split(".")[3] if subject.count(".") == 3 else request_id
    body = msgspec.json.encode({"type": "generate", "prompt": "hi", "max_tokens": 2, **payload})
    for _ in range(100):  # v1's one subject per tenant holds one message at a time now
        try:
            await client.js.publish(subject, body, headers=headers)
            break
        except nats.js.errors.ServiceUnavailableError as exc:
            assert "per subject" in exc.description  # the previous case's, not yet acked
            await asyncio.sleep(0.05)
    result = await client.result(request_id, timeout=30)
    assert isinstance(result, Error) and result.code == "invalid_request", result
    assert names in result.message


async def test_a_durable_request_without_request_id_takes_its_subjects(client):
    body = msgspec.json.encode({"type": "generate", "prompt": "hi", "max_tokens": 2})
    await client.js.publish("llm.requests.acme.from-subject", body)
    result = await client.result("from-subject", timeout=30)
    assert isinstance(result, Completion) and result.request_id == "from-subject", result


async def test_a_deeply_nested_durable_request_stores_an_error_and_a_cancel_breaks_nothing(
        client, stack):
    payload = b'{"type": "generate", "request_id": "deep-2", "prompt": "hi", "stop": ' + \
        b"[" * 4000 + b"]" * 4000 + b"}"
    await client.js.publish("llm.requests.acme.deep-2", payload)
    result = await client.result("deep-2", timeout=30)
    assert isinstance(result, Error) and result.code == "invalid_request"
    assert "32 levels" in result.message
    await client.nc.publish("llm.cancel.acme", b"[" * 5000 + b"]" * 5000)
    await client.nc.publish("llm.cancel.acme", b'{"a":' * 5000 + b"1" + b"}" * 5000)
    completion = await client.generate(GenerateRequest(prompt="still here?", max_tokens=3),
                                       timeout=30)
    assert isinstance(completion, Completion) and len(completion.token_ids) == 3
    assert all(p.returncode is None for p in stack.processes.values())


async def test_a_generate_reusing_a_running_request_id_is_answered_at_once(client):
    first = client.stream(long_request("reused-id", 1500), timeout=60)
    assert isinstance(await anext(first), Delta)  # running at the executor
    started = time.monotonic()
    second = await client.generate(long_request("reused-id", 4), timeout=20)
    assert isinstance(second, Error) and second.code == "invalid_request", second
    assert "already" in second.message and time.monotonic() - started < 10
    await client.cancel("reused-id")
    outputs = [output async for output in first]
    assert isinstance(outputs[-1], Completion) and outputs[-1].finish_reason == "cancelled"


async def test_a_streaming_client_that_goes_away_gets_its_request_cancelled(client, stack):
    """A raw client streams a long request, reads two deltas and closes its connection without a
    cancel: the server's "no responders" to the deltas after it tells the executor (once they
    have found nobody for `distributed.client_gone_after_s`)."""
    import nats

    before = await service_stats(client, "executor")
    gone = await nats.connect(stack.url)
    inbox = gone.new_inbox()
    sub = await gone.subscribe(inbox)
    await gone.publish("llm.generate.acme", msgspec.json.encode(
        {"type": "generate", "request_id": "walks-away", "prompt": "talk to me",
         "max_tokens": 1900, "ignore_eos": True, "stream": True}), reply=inbox)
    for _ in range(2):
        assert decode_output((await sub.next_msg(timeout=10)).data).request_id == "walks-away"
    await gone.close()
    for _ in range(100):  # the engine lets go at once; the count follows with the final output
        after = await service_stats(client, "executor")
        if after["running"] == 0 and after["cancelled"] > before["cancelled"]:
            break
        await asyncio.sleep(0.02)
    assert after["client_gone"] == before["client_gone"] + 1
    assert after["cancelled"] == before["cancelled"] + 1
    assert after["completed"] == before["completed"]


async def test_cancel_a_running_request(client):
    final = None
    count = 0
    async for output in client.stream(long_request("cancel-running", 1500), timeout=60):
        if isinstance(output, Delta):
            count += 1
            if count == 1:
                await client.cancel("cancel-running")
        else:
            final = output
    assert isinstance(final, Completion) and final.finish_reason == "cancelled"
    assert 0 < final.usage.completion_tokens < 1500


async def test_cancels_of_requests_not_in_flight_go_no_further_than_admission(client):
    """2,000 cancels on as many tenant names: admission remembers each (for a request being
    admitted meanwhile) and passes none on to priority or the executors; a cancel of a running
    request still ends it, passed on once."""
    async def admission() -> dict:
        return await service_stats(client, "admission")

    for _ in range(150):  # past admission's first lease (until then it passes every cancel on)
        if not (await admission())["first_lease"]:
            break
        await asyncio.sleep(0.2)
    before, executor_before = await admission(), await executor_stats(client)
    for i in range(2000):
        await client.nc.publish(f"llm.cancel.flood-{i}", b'{"type":"cancel","request_id":"x"}')
    final = None
    async for output in client.stream(long_request("cancel-past-a-flood", 1500), timeout=60):
        if isinstance(output, Delta) and final is None:
            final = False
            await client.cancel("cancel-past-a-flood")
        elif isinstance(output, Completion):
            final = output
    assert final.finish_reason == "cancelled"
    after = await admission()
    assert after["cancels_remembered"] == before["cancels_remembered"] + 2000
    assert after["cancels_forwarded"] == before["cancels_forwarded"] + 1
    assert (await executor_stats(client))["cancelled"] == executor_before["cancelled"] + 1


async def test_a_cancel_sent_right_behind_its_request_ends_it(client):
    """Ten requests (a long prompt: admission takes a while over each), each cancelled the
    moment it is sent: every one ends cancelled, whether its cancel found it being admitted
    (remembered, and passed on as it was handed to priority) or already in flight."""
    before = await service_stats(client, "admission")
    prompt = "one two three four five six seven eight nine ten " * 100
    finals = []
    for i in range(10):
        inbox = client.nc.new_inbox()
        sub = await client.nc.subscribe(inbox)
        await client.nc.publish("llm.generate.acme", msgspec.json.encode(
            {"type": "generate", "request_id": f"cancel-behind-{i}", "prompt": prompt,
             "max_tokens": 900, "ignore_eos": True}), reply=inbox)
        await client.cancel(f"cancel-behind-{i}")
        finals.append(decode_output((await sub.next_msg(timeout=60)).data))
        await sub.unsubscribe()
    assert [getattr(f, "finish_reason", f) for f in finals] == ["cancelled"] * 10
    assert all(f.usage.completion_tokens < 900 for f in finals)
    after = await service_stats(client, "admission")
    # Some (here: every one) found its request being admitted, and was passed on from there.
    assert after["cancels_remembered"] > before["cancels_remembered"]
    assert after["cancels_forwarded"] - before["cancels_forwarded"] >= 10


async def executor_stats(client) -> dict:
    return await service_stats(client, "executor")


async def test_abandoning_a_stream_cancels_the_request(client):
    before = (await executor_stats(client))["cancelled"]
    outputs = client.stream(long_request("abandoned", 1500), timeout=60)
    async for output in outputs:
        assert isinstance(output, Delta)
        break
    await outputs.aclose()  # the client sends a cancel for what it no longer reads
    for _ in range(50):
        if (await executor_stats(client))["cancelled"] == before + 1:
            break
        await asyncio.sleep(0.1)
    assert (await executor_stats(client))["cancelled"] == before + 1


async def priority_queue_depth(client) -> int:
    return (await service_stats(client, "priority"))["queue_depth"]


async def test_cancel_a_queued_request(client):
    # Fill the executor's two slots, then queue a third request at priority and cancel it there.
    running = [asyncio.create_task(client.generate(long_request(f"fill-{i}", 2000), timeout=60))
               for i in range(2)]
    await wait_for_stat(client, "executor", "running", 2)
    queued = asyncio.create_task(client.generate(long_request("cancel-queued", 1500), timeout=60))
    await wait_for_stat(client, "priority", "queue_depth", 1)
    await client.cancel("cancel-queued")
    final = await queued
    assert isinstance(final, Completion) and final.finish_reason == "cancelled"
    assert final.token_ids == [] and final.scheduling.executor == ""
    for i in range(2):
        await client.cancel(f"fill-{i}")
    assert [r.finish_reason for r in await asyncio.gather(*running)] == ["cancelled"] * 2


async def test_a_later_urgent_request_overtakes_queued_ones(client):
    """Two slots busy (one ends before the other); four priority-1 requests wait, then one
    priority-9 request arrives: it runs in the first slot that frees, before all four."""
    async def four_waiting():
        assert await priority_queue_depth(client) == 4

    finished = await finish_order_with_a_late_urgent_request(client, long_request, four_waiting)
    assert finished.index("urgent") < min(finished.index(f"low-{i}") for i in range(4)), finished


BAD_PAYLOADS = {
    "malformed JSON": (b'{"type": "generate", "prompt": "hi"', "invalid_request", "malformed JSON"),
    "a JSON array": (b'[1, 2, 3]', "invalid_request", "Expected `object`"),
    "an unknown field": (b'{"type": "generate", "prompt": "hi", "temprature": 0.5}',
                         "invalid_request", "temprature"),
    "a wrong type": (b'{"type": "generate", "prompt": "hi", "max_tokens": "ten"}',
                     "invalid_request", "$.max_tokens"),
    "an out-of-range value": (b'{"type": "generate", "prompt": "hi", "top_p": 1.5}',
                              "invalid_request", "$.top_p"),
    "an unknown model": (b'{"type": "generate", "prompt": "hi", "model": "gpt-9"}',
                         "unknown_model", "gpt-9"),
    "an over-long prompt": (msgspec.json.encode({"type": "generate", "prompt": "hello " * 3000}),
                            "prompt_too_long", "max_model_len 2048"),
    "no prompt": (b'{"type": "generate", "max_tokens": 4}', "invalid_request", "exactly one of"),
    # Deeper than the decoders' recursion limit: refused before decoding, naming the limit.
    "arrays nested 5,000 deep": (b"[" * 5000 + b"]" * 5000, "invalid_request", "32 levels"),
    "objects nested 5,000 deep": (b'{"a":' * 5000 + b"1" + b"}" * 5000, "invalid_request",
                                  "32 levels"),
    "a deep field": (b'{"type": "generate", "prompt": "hi", "request_id": "deep-1", "stop": '
                     + b"[" * 3000 + b"]" * 3000 + b"}", "invalid_request", "32 levels"),
}


async def bad_reply(client, payload: bytes, tenant: str = "acme"):
    reply = await client.nc.request(f"llm.generate.{tenant}", payload, timeout=10)
    return decode_output(reply.data), reply.headers or {}


@pytest.mark.parametrize("case", sorted(BAD_PAYLOADS))
async def test_bad_input_gets_a_clear_error(client, case):
    payload, code, needle = BAD_PAYLOADS[case]
    error, headers = await bad_reply(client, payload)
    assert isinstance(error, Error) and error.code == code, error
    assert needle in error.message, error.message
    assert headers["Nats-Service-Error-Code"] in ("400", "404", "413")
    assert headers["Nats-Service-Error"].startswith(code)


async def test_huge_prompts_are_refused_without_holding_up_other_requests(stack):
    """Eight 1 MB prompts are refused by their length, never encoded; a small request of
    another tenant sent beside them is served as if they were not there."""
    async with await JetserveClient.connect(stack.url, tenant="huge") as huge, \
            await JetserveClient.connect(stack.url, tenant="small") as small:
        started = time.monotonic()
        outputs = await asyncio.gather(
            *(huge.generate(GenerateRequest(prompt="word " * 200_000, max_tokens=2), timeout=30)
              for _ in range(8)),
            small.generate(GenerateRequest(prompt="hi", max_tokens=2), timeout=30))
        elapsed = time.monotonic() - started
    *refused, served = outputs
    assert all(isinstance(e, Error) and e.code == "prompt_too_long"
               and "1000000 characters are at least" in e.message for e in refused), refused
    assert isinstance(served, Completion) and len(served.token_ids) == 2
    assert elapsed < 5  # encoding them on the event loop took ~1 s each


async def test_an_invalid_tenant_is_rejected(client):
    error, headers = await bad_reply(client, b'{"type": "generate", "prompt": "hi"}', "bad!tenant")
    assert isinstance(error, Error) and error.code == "invalid_request"
    assert "tenant 'bad!tenant'" in error.message and headers["Nats-Service-Error-Code"] == "400"


async def test_a_flood_of_bad_input_breaks_nothing(client, stack):
    infos_before = {i["id"]: i["name"] for i in await discover(client.nc, "INFO", wait_s=0.5)}
    payloads = [BAD_PAYLOADS[k][0] for k in sorted(BAD_PAYLOADS)]
    fuzz = [payloads[i % len(payloads)] for i in range(450)] + [
        msgspec.json.encode({"type": "generate", "prompt": "hi", "max_tokens": -i}) for i in range(25)
    ] + [bytes([i % 256]) * (i + 1) for i in range(25)]
    assert len(fuzz) == 500
    started = time.monotonic()
    replies = await asyncio.gather(*(bad_reply(client, p) for p in fuzz))
    assert all(isinstance(error, Error) for error, _ in replies)
    assert {error.code for error, _ in replies} == {"invalid_request", "unknown_model",
                                                    "prompt_too_long"}
    assert time.monotonic() - started < 60
    completion = await client.generate(GenerateRequest(prompt="still fine?", max_tokens=4),
                                       timeout=30)
    assert isinstance(completion, Completion) and len(completion.token_ids) == 4
    infos_after = {i["id"]: i["name"] for i in await discover(client.nc, "INFO", wait_s=0.5)}
    assert infos_after == infos_before  # same service instances: nothing restarted
    assert all(p.returncode is None for p in stack.processes.values())


async def test_a_reply_subject_outside_the_client_inbox_gets_nothing(client, stack):
    """A reply subject is the client's word: aimed at another tenant's result subject, at
    jetserve's own subjects or at the JetStream API, a request, well-formed or not, gets nothing
    there (an Error stored as bob's result would refuse bob's real one), only a count."""
    targets = ["llm.results.bob.stolen-1", "llm.internal.reply-test", "$JS.API.INFO",
               "_INBOXX.near-miss", "_INBOX"]
    published: list[str] = []

    async def on(msg):
        published.append(msg.subject)

    subs = [await client.nc.subscribe(target, cb=on) for target in targets]
    before = (await service_stats(client, "admission"))["reply_refused"]
    good = msgspec.json.encode(GenerateRequest(request_id="stolen-1", prompt="hi", max_tokens=2))
    for target in targets:
        for payload in (good, b"{not json"):
            await client.nc.publish(client.subjects.generate("acme"), payload, reply=target)
        # Every service's NATS micro endpoints and internal endpoints answer no such subject.
        for subject in ("$SRV.PING", "$SRV.INFO.priority", "$SRV.STATS", "llm.internal.batcher"
                        ".executors", "llm.internal.priority.next", "llm.internal.kv.dump"
                        ".executor-0", "llm.internal.priority.submit"):
            await client.nc.publish(subject, b"{}", reply=target)
    await wait_for_stat(client, "admission", "reply_refused", before + 2 * len(targets))
    completion = await client.generate(GenerateRequest(prompt="after them", max_tokens=2),
                                       timeout=30)  # answered: behind the refused ones
    assert len(await discover(client.nc, "PING", wait_s=0.5)) == 4  # the services still answer
    for sub in subs:
        await sub.unsubscribe()
    assert isinstance(completion, Completion)
    assert published == []
    await assert_bob_s_id_is_free(client, stack, "stolen-1")


async def assert_bob_s_id_is_free(client, stack, request_id: str) -> None:
    """No result is stored for bob's `request_id`, and bob's own request of that id runs."""
    with pytest.raises(nats.js.errors.NotFoundError):
        await client.js.get_last_msg(RESULTS_STREAM, client.subjects.results("bob", request_id))
    async with await JetserveClient.connect(stack.url, tenant="bob") as bob:
        await bob.submit(GenerateRequest(request_id=request_id, prompt="mine", max_tokens=2))
        result = await bob.result(request_id, timeout=30)
    assert isinstance(result, Completion) and len(result.token_ids) == 2, result


async def test_an_answer_jetstream_stores_on_a_request_subject_takes_no_id(client, stack):
    """The same capture on LLM_REQUESTS: acme's submission with reply llm.requests.bob.<id>
    stores its PubAck as though bob had submitted it. Admission read it as a malformed request
    and stored an Error as that id's result, so bob's own request of that id was taken for done
    (for the results' 24 hours). It is no request: dropped with no result, bob's runs."""
    target = "llm.requests.bob.inject-2"
    body = msgspec.json.encode({"type": "generate", "prompt": "hi", "max_tokens": 2})
    before = (await service_stats(client, "admission"))["durable_not_requests"]
    await client.nc.publish("llm.requests.acme.inject-src-2", body, reply=target)
    await wait_for_stat(client, "admission", "durable_not_requests", before + 1)
    await assert_bob_s_id_is_free(client, stack, "inject-2")


async def test_an_answer_jetstream_stores_on_a_result_subject_is_not_taken_for_that_result(
        client, stack):
    """JetStream answers a publish on whatever reply subject the publisher names, and a stream
    captures that answer like any message: acme's durable submission with reply
    llm.results.bob.<id> stores its PubAck there (permissions do not stop it). It is no result
    (services mark theirs): bob's request of that id is not a duplicate, it runs, and its
    Completion is stored after the PubAck and is what bob reads."""
    target = "llm.results.bob.inject-1"
    body = msgspec.json.encode({"type": "generate", "prompt": "hi", "max_tokens": 2})
    await client.nc.publish("llm.requests.acme.inject-src", body, reply=target)
    for _ in range(100):
        with contextlib.suppress(nats.js.errors.NotFoundError):
            await client.js.get_last_msg(RESULTS_STREAM, target)
            break
        await asyncio.sleep(0.05)
    else:
        raise AssertionError("the PubAck was not stored: the premise no longer holds")
    async with await JetserveClient.connect(stack.url, tenant="bob") as bob:
        ack = await bob.submit(GenerateRequest(request_id="inject-1", prompt="mine",
                                               max_tokens=3))
        result = await bob.result("inject-1", timeout=30)
    assert not ack.duplicate
    assert isinstance(result, Completion) and len(result.token_ids) == 3, result
    info = await client.js.stream_info(RESULTS_STREAM, subjects_filter=target)
    assert info.state.subjects == {target: 2}  # the PubAck, then bob's result
