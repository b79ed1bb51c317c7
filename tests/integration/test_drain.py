"""SIGTERM drains: an executor asked to stop finishes what it runs, takes nothing new, exits 0;
every service told to stop, stops, within a bound."""

from __future__ import annotations

import asyncio
import signal

import pytest

from shared.bus import STOP_GRACE_S
from shared.client import JetserveClient
from shared.protocol import Completion, Error, GenerateRequest
from tests.integration.conftest import TINY_STACK, running_stack, sigterm_services, wait_for_stat


@pytest.mark.asyncio
async def test_sigterm_lets_running_requests_finish(tmp_path):
    async with running_stack(tmp_path, settings={"distributed.drain_timeout_s": 60}) as stack:
        async with await JetserveClient.connect(stack.url, tenant="drain") as client:
            running = asyncio.create_task(client.generate(
                GenerateRequest(prompt="keep going", max_tokens=1500, ignore_eos=True),
                timeout=60))
            # Told to stop once it runs the request (a sleep raced a loaded host's dispatch).
            await wait_for_stat(client, "executor", "running", 1, timeout_s=30)
            executor = stack.processes["executor-0"]
            executor.send_signal(signal.SIGTERM)
            completion = await running
            assert await asyncio.wait_for(executor.wait(), 30) == 0
    assert isinstance(completion, Completion), completion
    assert completion.finish_reason == "length" and len(completion.token_ids) == 1500


@pytest.mark.asyncio
async def test_services_told_to_stop_stop_even_with_the_nats_server_gone(tmp_path):
    """The nats-server dies first (a node lost, or `kill` of the whole group): each service,
    then SIGTERMed, has nothing left to drain and must still exit, promptly, instead of
    draining subscriptions into a connection that is not coming back."""
    async with running_stack(tmp_path) as stack:
        services = {n: p for n, p in stack.processes.items() if n != "nats-server"}
        for process in services.values():
            process.send_signal(signal.SIGTERM)
        await asyncio.sleep(0.05)  # they are draining when the server goes
        stack.processes["nats-server"].kill()
        await asyncio.wait([asyncio.ensure_future(p.wait()) for p in services.values()],
                           timeout=15)
        codes = {n: p.returncode for n, p in services.items()}
        assert codes == {n: 0 for n in services}, codes


async def test_every_service_sigtermed_under_load_stops_within_its_bound(tmp_path):
    """Forty requests of 1,500 tokens run when every service is told to stop at once: each
    exits 0 within its drain plus STOP_GRACE_S, and every request gets an answer (those still
    running when the executor's drain times out end `cancelled`, with their tokens so far)."""
    bound = TINY_STACK["distributed.drain_timeout_s"] + STOP_GRACE_S
    async with running_stack(tmp_path) as stack:
        async with await JetserveClient.connect(stack.url, tenant="load") as client:
            requests = [client.generate(GenerateRequest(prompt=f"load {i}", max_tokens=1500,
                                                        ignore_eos=True), timeout=60)
                        for i in range(40)]
            answers = asyncio.gather(*requests, return_exceptions=True)
            await asyncio.sleep(1.0)
            stopped = await sigterm_services(stack, bound)
            outputs = await answers
    assert all(code == 0 and took <= bound for code, took in stopped.values()), stopped
    assert all(isinstance(o, (Completion, Error)) for o in outputs), outputs
    assert all(isinstance(o, Completion) and o.finish_reason == "cancelled" and o.token_ids
               for o in outputs), outputs


async def test_a_client_s_cancel_during_the_drain_ends_its_durable_request(tmp_path):
    """An executor draining (SIGTERMed) runs its durable request on; the client cancels it
    meanwhile. That cancel's `cancelled` Completion is the request's result. Before, every
    durable `cancelled` during a drain was taken for shutdown's own abort and dropped: the
    client got nothing until a hand-on, and no executor was left to run it."""
    settings = {"model.name": "dummy:smollm2-135m", "distributed.drain_timeout_s": 60}
    async with running_stack(tmp_path, settings=settings) as stack:
        async with await JetserveClient.connect(stack.url, tenant="drain") as client:
            await client.submit(GenerateRequest(request_id="durable-long", prompt="go on",
                                                max_tokens=1500, ignore_eos=True))
            await wait_for_stat(client, "executor", "running", 1, timeout_s=60)
            executor = stack.processes["executor-0"]
            executor.send_signal(signal.SIGTERM)
            await asyncio.sleep(0.5)
            await client.cancel("durable-long")
            result = await client.result("durable-long", timeout=30)
            assert await asyncio.wait_for(executor.wait(), 60) == 0
    assert isinstance(result, Completion) and result.finish_reason == "cancelled", result
    assert 0 < len(result.token_ids) < 1500
