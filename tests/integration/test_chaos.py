"""Chaos: 200 durable requests on two executors while a loop SIGKILLs, one at a time at random
moments, an executor, the batcher, the priority service and admission, restarting each after a
pause; then the nats-server itself, stopped and restarted on the same store. Every request ends
exactly once: one message per request_id in LLM_RESULTS, none an `internal` Error, and
LLM_REQUESTS empty. How many ran again from the start, and how many continued from a
checkpoint, is printed (the services' logs say)."""

from __future__ import annotations

import asyncio
import random
import signal

import pytest

from loadtest.migration_bench import log_events
from shared.client import JetserveClient
from shared.protocol import Completion, GenerateRequest
from shared.subjects import RESULTS_STREAM
from tests.integration.conftest import running_stack

pytestmark = [pytest.mark.slow, pytest.mark.asyncio]

# A simulated executor (~60 ms a step, as SmolLM2 on this CPU) keeps requests running for
# seconds, so every kill finds work in flight; short leases make the recovery quick.
CHAOS = {"model.name": "sim:smollm2-cpu", "kv_cache.num_blocks": 4096,
         "distributed.heartbeat_timeout_s": 1.5, "nats.ack_wait_s": 2.0,
         "scheduler.batch_level.max_num_seqs": 16}
VICTIMS = ["executor-0", "batcher", "priority", "admission", "executor-1"]


async def results_by_id(client, ids: list[str], timeout: float) -> dict[str, object]:
    async def one(request_id):
        return request_id, await client.result(request_id, timeout=timeout)
    return dict(await asyncio.gather(*(one(i) for i in ids)))


async def chaos_loop(stack, rng: random.Random, victims: list[str], done: asyncio.Event) -> list:
    killed = []
    for name in victims:
        await asyncio.sleep(rng.uniform(1.0, 3.0))
        if done.is_set():
            break
        stack.processes[name].send_signal(signal.SIGKILL)
        await stack.processes[name].wait()
        killed.append(name)
        await asyncio.sleep(rng.uniform(0.5, 1.5))
        await stack.restart(name)
    return killed


async def submit_all(client, prefix: str, count: int, rng: random.Random) -> list[str]:
    ids = [f"{prefix}-{i}" for i in range(count)]
    for request_id in ids:
        await client.submit(GenerateRequest(
            request_id=request_id, prompt=f"chaos {request_id}", max_tokens=rng.randint(20, 80),
            ignore_eos=True, temperature=0.0))
    return ids


def generate_all(client, prefix: str, count: int, rng: random.Random) -> list[asyncio.Task]:
    """`count` generates sent at once, each a task that ends with its one final answer."""
    return [asyncio.create_task(client.generate(GenerateRequest(
        request_id=f"{prefix}-{i}", prompt=f"{prefix} {i}", max_tokens=rng.randint(20, 60),
        ignore_eos=True, temperature=0.0), timeout=300)) for i in range(count)]


async def check_exactly_once(client, ids, results) -> None:
    assert all(isinstance(r, Completion) for r in results.values()), \
        [r for r in results.values() if not isinstance(r, Completion)]
    info = await client.js.stream_info(RESULTS_STREAM)
    assert info.state.messages == len(ids)  # one result each, no second one
    for request_id, result in results.items():
        assert len(result.token_ids) == result.usage.completion_tokens
    for _ in range(100):  # the last acks follow their results
        requests = await client.js.stream_info("LLM_REQUESTS")
        if requests.state.messages == 0:
            break
        await asyncio.sleep(0.1)
    assert requests.state.messages == 0


async def test_killing_every_service_in_turn_loses_and_duplicates_nothing(tmp_path):
    rng = random.Random(13)
    async with running_stack(tmp_path, executors=2, settings=CHAOS) as stack, \
            await JetserveClient.connect(stack.url, tenant="chaos") as client:
        ids = await submit_all(client, "chaos", 200, rng)
        done = asyncio.Event()
        chaos = asyncio.create_task(chaos_loop(stack, rng, VICTIMS, done))
        results = await results_by_id(client, ids, timeout=300)
        done.set()
        killed = await chaos
        await check_exactly_once(client, ids, results)
        redelivered = log_events(stack.log_dir, "admission",
                                 "durable request lost with its holder; redelivering")
        handed_on = log_events(stack.log_dir, "admission",
                               "durable request handed on from a lost holder")
    assert killed == VICTIMS, killed
    from_checkpoint = sum(1 for r in handed_on if r["resume_from"] > 0)
    print(f"\nchaos: 200 durable requests, killed {killed}: 0 lost, 0 duplicated; "
          f"{len(redelivered)} ran again from the start (redelivered), {len(handed_on)} handed on "
          f"({from_checkpoint} from a checkpoint, {len(handed_on) - from_checkpoint} had not "
          f"started)")


async def test_a_restarted_nats_server_loses_and_duplicates_nothing(tmp_path):
    rng = random.Random(5)
    async with running_stack(tmp_path, executors=2, settings=CHAOS) as stack, \
            await JetserveClient.connect(stack.url, tenant="restart") as client:
        ids = await submit_all(client, "nats", 60, rng)
        await asyncio.sleep(2.0)
        stack.processes["nats-server"].send_signal(signal.SIGTERM)
        await stack.processes["nats-server"].wait()
        await asyncio.sleep(1.0)
        await stack.restart("nats-server")
        results = await results_by_id(client, ids, timeout=300)
        await check_exactly_once(client, ids, results)
        assert all(p.returncode is None for p in stack.processes.values())
