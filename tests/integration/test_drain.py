"""SIGTERM drains: an executor asked to stop finishes what it runs, takes nothing new, exits 0."""

from __future__ import annotations

import asyncio
import signal

import pytest

from shared.client import JetserveClient
from shared.protocol import Completion, GenerateRequest
from tests.integration.conftest import running_stack


@pytest.mark.asyncio
async def test_sigterm_lets_running_requests_finish(tmp_path):
    async with running_stack(tmp_path, settings={"distributed.drain_timeout_s": 60}) as stack:
        async with await JetserveClient.connect(stack.url, tenant="drain") as client:
            running = asyncio.create_task(client.generate(
                GenerateRequest(prompt="keep going", max_tokens=1500, ignore_eos=True),
                timeout=60))
            await asyncio.sleep(0.5)
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
