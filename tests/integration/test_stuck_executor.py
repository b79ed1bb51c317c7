"""An executor that stops answering (SIGSTOPped here; in a cluster, one whose answers were lost
with a NATS node) holds up no other executor's work: the batcher sends each assignment beside
its dispatch loop, so the assignments waiting on the stopped one (until their request timeout,
5 s) do not keep the other's free room empty. Every request still gets one answer."""

from __future__ import annotations

import asyncio
import signal
import time

import pytest

from shared.client import JetserveClient
from shared.protocol import Completion, GenerateRequest
from tests.integration.conftest import SMALL_EXECUTOR, running_stack

pytestmark = pytest.mark.asyncio


async def test_a_stopped_executor_holds_up_no_other_executors_assignments(tmp_path):
    settings = {**SMALL_EXECUTOR, "model.name": "sim:smollm2-cpu",
                # a lease long enough that the stopped executor stays in the batcher's registry
                "distributed.heartbeat_timeout_s": 10.0}
    async with running_stack(tmp_path, executors=2, settings=settings) as stack:
        async with await JetserveClient.connect(stack.url, tenant="acme") as client:
            stopped = stack.processes["executor-0"]
            stopped.send_signal(signal.SIGSTOP)
            try:
                started = time.monotonic()
                answered: list[tuple[float, Completion]] = []

                async def one(i: int) -> None:
                    answer = await client.generate(GenerateRequest(
                        prompt=f"request {i}", max_tokens=4, ignore_eos=True), timeout=60)
                    answered.append((time.monotonic() - started, answer))

                requests = [asyncio.create_task(one(i)) for i in range(10)]
                await asyncio.sleep(4.0)  # short of the stopped one's assignment timeout (5 s)
                early = sorted(at for at, _ in answered)
            finally:
                stopped.send_signal(signal.SIGCONT)
            await asyncio.gather(*requests)
    # Two go to the stopped executor (its room); the running one, two at a time, takes the
    # other eight as its room frees (about 0.3 s a pair here). Holding the loop until the
    # stopped one's two timed out, it finished one or two in those 4 s.
    assert len(early) >= 6, early
    assert len(answered) == 10
    assert all(isinstance(answer, Completion) and answer.finish_reason == "length"
               for _, answer in answered), answered
