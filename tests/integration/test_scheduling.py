"""The request-level scheduler through the live stack: deadlines, policies, fairness counters."""

from __future__ import annotations

import asyncio

import pytest
import pytest_asyncio

from shared.client import JetserveClient
from shared.protocol import Completion, Error, GenerateRequest
from tests.integration.conftest import (
    SMALL_EXECUTOR,
    finish_order_with_a_late_urgent_request,
    running_stack,
    service_stats,
    wait_for_stat,
)

pytestmark = pytest.mark.asyncio(loop_scope="module")


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def stack(tmp_path_factory):
    async with running_stack(tmp_path_factory.mktemp("scheduling"),
                             settings=SMALL_EXECUTOR) as s:
        yield s


@pytest_asyncio.fixture(loop_scope="module")
async def client(stack):
    client = await JetserveClient.connect(stack.url, tenant="sched")
    yield client
    await client.close()


def request(request_id: str, max_tokens: int, priority: int = 5, **kw) -> GenerateRequest:
    return GenerateRequest(request_id=request_id, prompt_token_ids=[20, 21, 22, 23],
                           max_tokens=max_tokens, ignore_eos=True, temperature=0.0,
                           priority=priority, **kw)


async def priority_stats(client) -> dict:
    return await service_stats(client, "priority")


async def test_a_running_request_stops_at_its_deadline_with_its_tokens(client):
    """1,500 tokens take the tiny model most of a second; with deadline_ms 400 the request ends
    at 400 ms with finish_reason `deadline` and what it generated so far."""
    completion = await client.generate(request("deadline-run", 1500, deadline_ms=400), timeout=30)
    assert isinstance(completion, Completion), completion
    assert completion.finish_reason == "deadline"
    assert 0 < len(completion.token_ids) < 1500
    assert 380 <= completion.metrics.e2e_ms < 1500


async def test_a_waiting_request_past_its_deadline_gets_an_error_and_no_slot(client):
    # The busy requests are priority 9 as well, so the late one cannot overtake them.
    busy = [asyncio.create_task(client.generate(request(f"busy-{i}", 2000, priority=9),
                                                timeout=60))
            for i in range(2)]
    await wait_for_stat(client, "executor", "running", 2)
    before = (await priority_stats(client))["deadline_exceeded"]
    late = await client.generate(request("late", 8, priority=9, deadline_ms=300), timeout=10)
    assert isinstance(late, Error) and late.code == "deadline_exceeded"
    assert "`deadline_ms` 300" in late.message and "waiting queue" in late.message
    assert (await priority_stats(client))["deadline_exceeded"] == before + 1
    # A durable request's deadline Error is its stored result.
    await client.submit(request("late-durable", 8, deadline_ms=300))
    stored = await client.result("late-durable", timeout=10)
    assert isinstance(stored, Error) and stored.code == "deadline_exceeded"
    for i in range(2):
        await client.cancel(f"busy-{i}")
    await asyncio.gather(*busy)


async def batcher_stats(client) -> dict:
    return await service_stats(client, "batcher")


async def test_a_request_that_outranks_a_full_executor_overtakes_without_waiting_for_room(client):
    """Both slots run priority-1 requests of 2,000 tokens and the executor holds no queue. A
    priority-9 request still goes there at once (overtaking dispatch), preempts the later one,
    and finishes while they run; the preempted one resumes and reports the preemption."""
    before = (await batcher_stats(client))["overtaking"]
    busy = [asyncio.create_task(client.generate(request(f"low-{i}", 2000, priority=1),
                                                timeout=60))
            for i in range(2)]
    await wait_for_stat(client, "executor", "running", 2)
    await asyncio.sleep(0.4)  # two heartbeats: the batcher has heard what the executor runs
    urgent = await client.generate(request("overtaker", 8, priority=9), timeout=10)
    assert isinstance(urgent, Completion), urgent
    assert len(urgent.token_ids) == 8 and urgent.scheduling.queue_wait_ms < 300
    assert not any(task.done() for task in busy)
    assert (await batcher_stats(client))["overtaking"] == before + 1
    for i in range(2):
        await client.cancel(f"low-{i}")
    low = await asyncio.gather(*busy)
    assert sorted(c.scheduling.preemptions for c in low) == [0, 1], low


async def test_executors_report_what_each_tenant_was_served(stack):
    """The executors' reports (with their heartbeats) reach priority: what each tenant was
    served, which the fairness counters and the length predictor learn from."""
    async with await JetserveClient.connect(stack.url, tenant="fair-a") as a, \
            await JetserveClient.connect(stack.url, tenant="fair-b") as b:
        outputs = await asyncio.gather(
            a.generate(request("fa-1", 10), timeout=30), a.generate(request("fa-2", 6), timeout=30),
            b.generate(request("fb-1", 3), timeout=30))
        assert all(isinstance(o, Completion) for o in outputs), outputs
        assert all(o.scheduling.queue_wait_ms >= 0 for o in outputs)
        expected = {"fair-a": {"prompt_tokens": 8, "output_tokens": 16},
                    "fair-b": {"prompt_tokens": 4, "output_tokens": 3}}
        for _ in range(50):
            stats = await priority_stats(a)
            if all(stats["tenant_served"].get(t) == v for t, v in expected.items()):
                break
            await asyncio.sleep(0.1)
        assert {t: stats["tenant_served"].get(t) for t in expected} == expected
        assert stats["policy"] == "adaptive" and stats["backlogged_tenants"] == {}
        # Both counters were charged. An idle tenant no further ahead than the least-served
        # active one (or, with nobody active, any idle tenant) is forgotten once a feedback
        # interval, its counter kept as the highest forgotten: so either place holds it.
        counters, forgotten = stats["tenant_counters"], stats["tenant_counter_forgotten"]
        assert all(counters.get(t, forgotten) > 0 for t in expected), stats


async def test_fcfs_policy_by_environment_keeps_arrival_order(tmp_path):
    """The same workload as the priority-overtaking test, with policy fcfs set by environment
    variable: the priority-9 request no longer jumps the queue."""
    env = {"JETSERVE_SCHEDULER__REQUEST_LEVEL__POLICY": "fcfs"}
    async with running_stack(tmp_path, settings=SMALL_EXECUTOR, env=env) as stack:
        async with await JetserveClient.connect(stack.url, tenant="fifo") as client:
            assert (await priority_stats(client))["policy"] == "fcfs"
            finished = await finish_order_with_a_late_urgent_request(client, request)
    assert finished.index("urgent") > max(finished.index(f"low-{i}") for i in range(4)), finished


async def test_a_full_queue_makes_room_for_a_lighter_tenant_and_a_higher_class(tmp_path):
    """Two slots busy, room for two at priority: a tenant that fills the queue cannot lock
    another tenant out, nor a flood of priority-1 work a priority-9 request. The request pushed
    out gets `overloaded` at once; every request gets exactly one answer."""
    # The 135M shape (random weights) runs a token per few tens of milliseconds here, so the
    # busy slots stay busy for the whole test (the tiny model would finish them in a second).
    # They are priority 9, so no newcomer preempts them and the queue stays full.
    # (Each tenant may hold the whole queue here: what is tested is the full queue's push-out,
    # not the queue share that would otherwise refuse heavy's second request, test_quotas.py.)
    settings = {**SMALL_EXECUTOR, "scheduler.request_level.max_pending_requests": 2,
                "model.name": "dummy:smollm2-135m", "quotas.default.queue_share": 1.0}
    async with running_stack(tmp_path, settings=settings) as stack:
        async with await JetserveClient.connect(stack.url, tenant="heavy") as heavy, \
                await JetserveClient.connect(stack.url, tenant="light") as light:
            busy = [asyncio.create_task(heavy.generate(request(f"busy-{i}", 2000, priority=9),
                                                       timeout=60)) for i in range(2)]
            await wait_for_stat(heavy, "executor", "running", 2)
            queued = [asyncio.create_task(heavy.generate(request(f"q-{i}", 8, priority=1),
                                                         timeout=60)) for i in range(2)]
            await wait_for_stat(heavy, "priority", "queue_depth", 2)
            refused = await heavy.generate(request("q-2", 8, priority=1), timeout=10)
            assert isinstance(refused, Error) and refused.code == "overloaded"
            # Priority tells admission that its queue is full and heavy holds it: heavy's
            # priority-1 requests are then refused by admission, before any other work.
            for attempt in range(100):
                again = await heavy.generate(request(f"again-{attempt}", 8, priority=1),
                                             timeout=10)
                assert isinstance(again, Error) and again.code == "overloaded"
                if "holds the most of it" in again.message:
                    break
                await asyncio.sleep(0.05)
            else:
                raise AssertionError("admission never refused heavy's flood at once")
            assert (await service_stats(heavy, "admission"))["refused_at_once"] >= 1
            # A hostile payload from the refused tenant still gets one answer, naming the limit.
            nested = b'{"prompt": "x", "n": ' + b"[" * 2000 + b"]" * 2000 + b"}"
            reply = await heavy.nc.request("llm.generate.heavy", nested, timeout=10)
            assert b"invalid_request" in reply.data and b"nest" in reply.data, reply.data
            newcomer = asyncio.create_task(light.generate(request("l-0", 8), timeout=60))
            pushed = await asyncio.wait_for(queued[1], 10)  # heavy's latest made room
            assert isinstance(pushed, Error) and pushed.code == "overloaded"
            assert "made room" in pushed.message
            urgent = asyncio.create_task(heavy.generate(request("u-0", 8, priority=9),
                                                        timeout=60))
            pushed = await asyncio.wait_for(queued[0], 10)  # a lower class made room
            assert isinstance(pushed, Error) and pushed.code == "overloaded"
            assert (await priority_stats(heavy))["queue_depth"] == 2
            for i in range(2):
                await heavy.cancel(f"busy-{i}")
            done = await asyncio.gather(newcomer, urgent, *busy)
            assert all(isinstance(c, Completion) for c in done), done
            assert [len(c.token_ids) for c in done[:2]] == [8, 8]
