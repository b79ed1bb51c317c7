"""Nothing durable is lost: an executor killed mid-request, the request still gets its result."""

from __future__ import annotations

import asyncio
import contextlib
import signal

import msgspec
import nats.errors
import pytest

from shared.bus import Outbox, cancelled_completion, discover
from shared.client import JetserveClient, _decode_output
from shared.keys import RequestKey
from shared.messages import SubmitReply, WorkItem, encode
from shared.protocol import Completion, Error, GenerateRequest
from shared.request_state import Claim, RequestStates, claim_answer
from shared.subjects import Subjects
from tests.integration.conftest import SMALL_EXECUTOR, busy_executor, running_stack


@pytest.mark.asyncio
async def test_a_durable_request_survives_its_executor(tmp_path):
    settings = {"distributed.heartbeat_timeout_s": 1.0}
    async with running_stack(tmp_path, executors=2, settings=settings) as stack:
        async with await JetserveClient.connect(stack.url, tenant="durable") as client:
            request = GenerateRequest(request_id="survivor-1", prompt="long job", max_tokens=1500,
                                      ignore_eos=True, temperature=0.0)
            await client.submit(request)
            victim = await busy_executor(client)
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
    """Priority reports what waits there, so a long wait is not mistaken for a lost request.
    (A simulated executor: its steps take their time however loaded the host is, so the slot is
    held for ~2.4 s, not for as long as 1,200 tiny-model steps happen to take.)"""
    settings = {"distributed.heartbeat_timeout_s": 1.0, "model.name": "sim:smollm2-cpu",
                "scheduler.batch_level.max_num_seqs": 1,
                "scheduler.batch_level.executor_queue_depth": 0}
    async with running_stack(tmp_path, settings=settings) as stack:
        async with await JetserveClient.connect(stack.url, tenant="patient") as client:
            busy = asyncio.create_task(client.generate(
                GenerateRequest(prompt="hog the only slot", max_tokens=40, ignore_eos=True),
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


@pytest.mark.asyncio
async def test_a_durable_request_that_keeps_failing_in_admission_gets_an_internal_error(tmp_path):
    """Priority is replaced by a peer that answers every submission with bytes that are not a
    SubmitReply: admission fails after marking the request held. Each failure must un-hold it,
    so the redeliveries are admitted again and the fifth stores an `internal` Error (long before
    the keep-alive's timeout would hand it back)."""
    settings = {"distributed.heartbeat_timeout_s": 120.0}
    async with running_stack(tmp_path, settings=settings) as stack:
        async with await JetserveClient.connect(stack.url, tenant="unlucky") as client:
            stack.processes["priority"].kill()
            await stack.processes["priority"].wait()
            async def garble(msg) -> None:
                await msg.respond(b"\xff not a reply")

            garbled = await client.nc.subscribe("llm.internal.priority.submit", cb=garble)
            await client.submit(GenerateRequest(request_id="fails-1", prompt="hi", max_tokens=2))
            result = await client.result("fails-1", timeout=30)
            await garbled.unsubscribe()
            stats = await service_stats(client, "admission")
    assert isinstance(result, Error) and result.code == "internal", result
    assert "5 times" in result.message
    assert stats["durable_held"] == 0


@pytest.mark.asyncio
async def test_a_late_answer_from_priority_is_not_a_second_answer(tmp_path):
    """Priority queues a generate but answers admission after its request timeout (a starved
    event loop: seen with three test workers on two cores). Admission must not also answer the
    client `overloaded`: the request stays watched (were it lost, the lease would hand it on),
    and the client gets exactly the one answer the request's run sends. Priority is played by
    a subscriber that answers late and then sends the request's final output itself."""
    settings = {"nats.request_timeout_s": 0.5, "distributed.heartbeat_timeout_s": 2.0}
    async with running_stack(tmp_path, settings=settings) as stack:
        async with await JetserveClient.connect(stack.url, tenant="late") as client:
            stack.processes["priority"].kill()
            await stack.processes["priority"].wait()
            outbox, attempts = Outbox(client.nc, client.js, Subjects(), "_INBOX"), []

            async def late_priority(msg) -> None:
                item = msgspec.msgpack.decode(msg.data, type=WorkItem)
                attempts.append(item.attempt)
                await asyncio.sleep(1.0)  # past admission's 0.5 s, inside the 2 s lease
                await msg.respond(encode(SubmitReply()))
                await outbox.final(item, cancelled_completion(item))  # as its run would

            await client.nc.subscribe("llm.internal.priority.submit", cb=late_priority)
            inbox = client.nc.new_inbox()
            answers = await client.nc.subscribe(inbox)
            await client.nc.publish("llm.generate.late", msgspec.json.encode(
                GenerateRequest(request_id="late-1", prompt="hi", max_tokens=2)), reply=inbox)
            received = []
            with contextlib.suppress(nats.errors.TimeoutError):
                while True:
                    received.append(_decode_output((await answers.next_msg(timeout=4.0)).data))
            stats = await service_stats(client, "admission")
    assert [type(r) for r in received] == [Completion], received
    assert attempts == [0] and stats["submits_timed_out"] == 1
    assert stats["generates_in_flight"] == 0  # its Done ended the watch


@pytest.mark.asyncio
async def test_the_durable_consumer_takes_max_ack_pending_from_config_and_updates_it(tmp_path):
    """The server's default (1,000) would cap durable requests in flight; an admission started
    with another value brings the existing consumer up to it."""
    async with running_stack(tmp_path, settings={"nats.max_ack_pending": 1234}) as stack:
        async with await JetserveClient.connect(stack.url, tenant="acks") as client:
            info = await client.js.consumer_info("LLM_REQUESTS", "admission")
            assert info.config.max_ack_pending == 1234
            stack.processes["admission"].kill()
            await stack.processes["admission"].wait()
            stack.settings["nats.max_ack_pending"] = 4321
            await stack.restart("admission")
            for _ in range(200):
                info = await client.js.consumer_info("LLM_REQUESTS", "admission")
                if info.config.max_ack_pending == 4321:
                    break
                await asyncio.sleep(0.1)
            assert info.config.max_ack_pending == 4321
            await client.submit(GenerateRequest(request_id="after-update", prompt="hi",
                                                max_tokens=2))
            assert isinstance(await client.result("after-update", timeout=60), Completion)


async def executor_stats(client) -> list[dict]:
    """Every executor's $SRV.STATS data."""
    answers = await discover(client.nc, "STATS", "executor", wait_s=0.3)
    return [next(ep["data"] for ep in a["endpoints"] if ep.get("data")) for a in answers]


async def run_durable_batch(client, prefix: str, count: int, max_tokens: int) -> list[str]:
    ids = [f"{prefix}-{i}" for i in range(count)]
    for request_id in ids:
        await client.submit(GenerateRequest(request_id=request_id, prompt="keep going",
                                            max_tokens=max_tokens, ignore_eos=True))
    for _ in range(200):  # until every one runs at an executor
        running = sum(e["running"] for e in await executor_stats(client))
        if running == count:
            return ids
        await asyncio.sleep(0.05)
    raise AssertionError(f"{running} of {count} running")


async def runs_and_duplicates(client) -> tuple[int, int]:
    """Requests the executors completed, and assignments they refused as already running."""
    stats = await executor_stats(client)
    return sum(e["completed"] for e in stats), sum(e["duplicates"] for e in stats)


@pytest.mark.asyncio
async def test_a_stalled_admission_does_not_run_healthy_requests_twice(tmp_path):
    """SIGSTOP admission for longer than the heartbeat timeout while 16 durable requests run
    on two (simulated, ~60 ms a step) executors: the holding reports queued meanwhile vouch for
    them."""
    settings = {"distributed.heartbeat_timeout_s": 1.5, "model.name": "sim:smollm2-cpu"}
    async with running_stack(tmp_path, executors=2, settings=settings) as stack:
        async with await JetserveClient.connect(stack.url, tenant="stall") as client:
            ids = await run_durable_batch(client, "stall", 16, 120)
            admission = stack.processes["admission"]
            admission.send_signal(signal.SIGSTOP)
            await asyncio.sleep(4.0)
            admission.send_signal(signal.SIGCONT)
            results = [await client.result(i, timeout=120) for i in ids]
            stats = await service_stats(client, "admission")
            runs = await runs_and_duplicates(client)
    assert all(isinstance(r, Completion) and len(r.token_ids) == 120 for r in results)
    assert stats["durable_redelivered"] == 0, stats
    assert runs == (16, 0)


@pytest.mark.asyncio
async def test_a_restarted_admission_adopts_the_requests_that_still_run(tmp_path):
    """SIGKILL admission while 8 durable requests run on two (simulated) executors; its
    successor takes them over (from LLM_STATE, or as JetStream redelivers them) and must hold
    them, not run them a second time."""
    settings = {"distributed.heartbeat_timeout_s": 1.5, "nats.ack_wait_s": 1.0,
                "model.name": "sim:smollm2-cpu"}
    async with running_stack(tmp_path, executors=2, settings=settings) as stack:
        async with await JetserveClient.connect(stack.url, tenant="restart") as client:
            ids = await run_durable_batch(client, "restart", 8, 200)
            stack.processes["admission"].kill()
            await stack.processes["admission"].wait()
            await stack.restart("admission")
            results = [await client.result(i, timeout=120) for i in ids]
            for _ in range(100):  # the acks follow the stored results
                stats = await service_stats(client, "admission")
                if stats["durable_held"] == 0:
                    break
                await asyncio.sleep(0.1)
            runs = await runs_and_duplicates(client)
            info = await client.js.stream_info("LLM_REQUESTS")
    assert all(isinstance(r, Completion) and len(r.token_ids) == 200 for r in results)
    assert runs == (8, 0), runs  # none admitted a second time (to run again, or be refused)
    # Taken over from LLM_STATE (with their admitted copies), not admitted or run again.
    assert stats["taken_over"] == 8 and stats["durable_handed_on"] == 0, stats
    assert stats["durable_held"] == 0 and info.state.messages == 0


@pytest.mark.asyncio
async def test_generates_survive_their_executor_and_the_priority_service(tmp_path):
    """Not durable, yet not lost: admission watches over every generate until its answer. A
    streaming generate whose executor is SIGKILLed continues on the other from its checkpoint
    (the client's stream restarts and is assembled); generates waiting at a SIGKILLed priority
    are handed on to its successor."""
    settings = {"distributed.heartbeat_timeout_s": 1.5, "model.name": "sim:smollm2-cpu",
                "scheduler.batch_level.max_num_seqs": 2,
                "scheduler.batch_level.executor_queue_depth": 0}
    async with running_stack(tmp_path, executors=2, settings=settings) as stack:
        async with await JetserveClient.connect(stack.url, tenant="gen") as client:
            def request(i: int, stream: bool = False) -> GenerateRequest:
                return GenerateRequest(request_id=f"gen-{i}", prompt=f"go on {i}", seed=i,
                                       max_tokens=60, ignore_eos=True, stream=stream)

            streamed = client.stream(request(0, stream=True), timeout=120)
            deltas = [await anext(streamed)]
            victim = await busy_executor(client)  # the only request running so far
            # Three more fill the slots; four wait at priority.
            others = [asyncio.create_task(client.generate(request(i), timeout=120))
                      for i in range(1, 8)]
            while sum(len(d.token_ids) for d in deltas) < 10:
                deltas.append(await anext(streamed))
            stack.processes[victim].kill()
            stack.processes["priority"].kill()
            await stack.processes[victim].wait()
            await stack.processes["priority"].wait()
            await stack.restart("priority")
            outputs = [o async for o in streamed]
            results = await asyncio.gather(*others)
            stats = await service_stats(client, "admission")
    final = outputs[-1]
    assert isinstance(final, Completion) and len(final.token_ids) == 60, final
    streamed_tokens = [t for d in deltas + outputs[:-1] for t in d.token_ids]
    assert streamed_tokens == final.token_ids  # each index once, no gap
    assert all(isinstance(r, Completion) and len(r.token_ids) == 60 for r in results), results
    assert stats["generates_handed_on"] >= 2, stats


async def revoked_there_one_result(client, victim: str, result) -> None:
    """`victim` (back from its stall) dropped its attempt, told to; the one result is the
    other executor's."""
    for _ in range(100):
        stats = {s["executor"]: s for s in await executor_stats(client)}
        if stats[victim]["revoked"]:
            break
        await asyncio.sleep(0.1)
    info = await client.js.stream_info("LLM_RESULTS")
    assert isinstance(result, Completion) and len(result.token_ids) == 150
    assert result.scheduling.executor != victim
    assert stats[victim]["revoked"] == 1 and stats[victim]["completed"] == 0
    assert info.state.messages == 1


@pytest.mark.asyncio
async def test_an_executor_back_from_a_stall_drops_the_requests_handed_on(tmp_path):
    """SIGSTOP the executor running a durable request past the lease: the request is handed on
    to the other executor; when the first wakes up it is told to drop its attempt, and does
    (no second result, its count of revoked requests says so)."""
    settings = {"distributed.heartbeat_timeout_s": 1.5, "model.name": "sim:smollm2-cpu"}
    async with running_stack(tmp_path, executors=2, settings=settings) as stack:
        async with await JetserveClient.connect(stack.url, tenant="stall") as client:
            await client.submit(GenerateRequest(request_id="napper", prompt="wake me",
                                                max_tokens=150, ignore_eos=True, seed=1))
            victim = await busy_executor(client)
            await asyncio.sleep(1.0)  # a checkpoint or two
            stack.processes[victim].send_signal(signal.SIGSTOP)
            await busy_executor(client, tries=1200, besides=victim)  # past the lease: handed on
            stack.processes[victim].send_signal(signal.SIGCONT)
            result = await client.result("napper", timeout=120)
            await revoked_there_one_result(client, victim, result)


@pytest.mark.asyncio
async def test_a_thousand_long_durable_requests_of_one_tenant_do_not_starve_another(tmp_path):
    """With the server's default max_ack_pending (1,000) the 1,001st durable request was not
    even fetched while the first thousand ran; now all are held and priority orders them, so
    another tenant's priority-10 request goes ahead of the backlog."""
    async with running_stack(tmp_path, settings=SMALL_EXECUTOR) as stack:
        async with await JetserveClient.connect(stack.url, tenant="heavy") as heavy, \
                await JetserveClient.connect(stack.url, tenant="light") as light:
            for i in range(1100):
                await heavy.js.publish(f"llm.requests.heavy.h-{i}", msgspec.json.encode(
                    {"type": "generate", "prompt_token_ids": [5, 6], "max_tokens": 1000,
                     "ignore_eos": True}))
            await light.submit(GenerateRequest(request_id="urgent", prompt="me first",
                                               max_tokens=4, priority=10))
            result = await light.result("urgent", timeout=60)
            done = (await heavy.js.stream_info(
                "LLM_RESULTS", subjects_filter="llm.results.heavy.>")).state.messages
    assert isinstance(result, Completion) and len(result.token_ids) == 4
    assert done < 100, done  # it did not wait for the backlog


@pytest.mark.asyncio
async def test_admission_and_the_executor_dying_together_keep_the_request_s_seed(tmp_path):
    """A sampled durable request (no seed given) whose admission and executor are SIGKILLed
    together continues with the seed its message was first admitted with (derived from the
    message, and kept in its LLM_STATE copy): the same text as a generate given that seed.
    Before, each admission drew a fresh seed."""
    from services.admission.service import durable_seed

    settings = {"distributed.heartbeat_timeout_s": 1.0, "nats.ack_wait_s": 2.0}
    async with running_stack(tmp_path, executors=1, settings=settings) as stack:
        async with await JetserveClient.connect(stack.url, tenant="seeded") as client:
            request = GenerateRequest(request_id="seeded-1", prompt="a tale", max_tokens=1500,
                                      ignore_eos=True, temperature=1.0)
            ack = await client.submit(request)
            victim = await busy_executor(client)
            stack.processes["admission"].kill()
            stack.processes[victim].kill()
            await stack.processes["admission"].wait()
            await stack.processes[victim].wait()
            await stack.restart("admission")
            await stack.restart(victim)
            result = await client.result("seeded-1", timeout=120)
            reference = await client.generate(msgspec.structs.replace(
                request, request_id="seeded-reference",
                seed=durable_seed("seeded", "seeded-1", ack.seq)), timeout=120)
    assert isinstance(result, Completion) and isinstance(reference, Completion), (result, reference)
    assert len(result.token_ids) == 1500
    assert result.token_ids == reference.token_ids


@pytest.mark.asyncio
async def test_a_stalled_holder_of_an_earlier_delivery_is_revoked_after_admission_restarts(
        tmp_path):
    """SIGSTOP the executor running a durable request and SIGKILL admission: the restarted
    admission gets the request again from JetStream and admits it as an attempt above every
    attempt of the earlier delivery, so when the stalled executor wakes and reports its
    (earlier) attempt it is told to drop it: one result, from the other executor. Before,
    the re-admitted request started again at attempt 0, and the stalled one's checkpoints
    were taken as this run's."""
    settings = {"distributed.heartbeat_timeout_s": 1.5, "nats.ack_wait_s": 1.0,
                "model.name": "sim:smollm2-cpu"}
    async with running_stack(tmp_path, executors=2, settings=settings) as stack:
        async with await JetserveClient.connect(stack.url, tenant="stall2") as client:
            await client.submit(GenerateRequest(request_id="napper-2", prompt="wake me",
                                                max_tokens=150, ignore_eos=True, seed=1))
            victim = await busy_executor(client)
            await asyncio.sleep(1.0)  # a checkpoint or two
            stack.processes[victim].send_signal(signal.SIGSTOP)
            stack.processes["admission"].kill()
            await stack.processes["admission"].wait()
            await stack.restart("admission")
            # Redelivered, not reported: admitted again, and running elsewhere (however long
            # the new admission takes to start on a loaded host) before the victim wakes.
            await busy_executor(client, tries=1200, besides=victim)
            stack.processes[victim].send_signal(signal.SIGCONT)
            result = await client.result("napper-2", timeout=120)
            await revoked_there_one_result(client, victim, result)


@pytest.mark.asyncio
async def test_an_executor_back_from_a_stall_claims_a_generate_s_answer(tmp_path):
    """SIGSTOP the executor running a generate (attempt 0) for more than half a lease: it may
    have been taken for dead meanwhile (here it was not; the test claims the answer in
    LLM_STATE as a handed-on attempt that answered would have). Back, it finds the gap in its
    holding reports, marks the attempt lapsed and claims its answer before sending it, finds it
    claimed, and sends nothing. (Before, a first attempt answered without a claim.)"""
    settings = {"model.name": "sim:smollm2-cpu", "distributed.heartbeat_interval_s": 0.25,
                "distributed.heartbeat_timeout_s": 3.0}
    async with running_stack(tmp_path, settings=settings) as stack:
        async with await JetserveClient.connect(stack.url, tenant="napper") as client:
            inbox = client.nc.new_inbox()
            answers = await client.nc.subscribe(inbox)
            await client.nc.publish(client.subjects.generate("napper"), msgspec.json.encode(
                GenerateRequest(request_id="napper-3", prompt="wake me", max_tokens=100,
                                ignore_eos=True)), reply=inbox)
            victim = await busy_executor(client)
            key = RequestKey("napper", "napper-3")
            states = RequestStates(client.nc, client.js, client.subjects, "test")
            taken = await states.read(key, durable=False)
            stack.processes[victim].send_signal(signal.SIGSTOP)
            assert await claim_answer(client.js, client.subjects, key,
                                      taken.state.arrival_time) is Claim.FIRST
            await asyncio.sleep(2.0)  # past half the lease (1.5 s), short of the lease
            stack.processes[victim].send_signal(signal.SIGCONT)
            for _ in range(200):  # until it ended the request
                stats = await service_stats(client, "executor")
                if stats["completed"]:
                    break
                await asyncio.sleep(0.1)
            with pytest.raises(nats.errors.TimeoutError):
                await answers.next_msg(timeout=1.0)
    assert stats["completed"] == 1 and stats["revoked"] == 0
