"""Priority's tenant counters (virtual token counters, services/priority/fairness.py) are not
one replica's memory: every replica charges every Done it hears (the one that dispatched the
request corrects its advance charge, the others charge the whole cost), and the counters are
saved in LLM_STATE every feedback step, so a priority that restarts while tenants are active
starts from them instead of from zero (a tenant that was served a lot is not even with the
others again after a failover)."""

from __future__ import annotations

import asyncio

import pytest

from shared.bus import discover
from shared.client import JetserveClient
from shared.protocol import GenerateRequest
from tests.integration.conftest import running_stack

pytestmark = pytest.mark.asyncio


async def counters(client) -> dict[int, dict[str, float]]:
    """Each priority replica's tenant counters, by its pid. A replica where no tenant is active
    forgets the counters at its next feedback step (the highest of them kept: a tenant not listed
    starts from it), so a tenant it does not list is at that highest counter."""
    answers = await discover(client.nc, "STATS", "priority", wait_s=0.5)
    stats = {int(a["metadata"]["pid"]): next(ep["data"] for ep in a["endpoints"] if ep.get("data"))
             for a in answers}
    return {pid: {"heavy": s["tenant_counter_forgotten"]} | s["tenant_counters"]
            for pid, s in stats.items()}


async def test_tenant_counters_are_shared_by_replicas_and_survive_a_restart(tmp_path):
    settings = {"model.name": "sim:smollm2-cpu", "scheduler.batch_level.max_num_seqs": 4,
                "scheduler.batch_level.executor_queue_depth": 0,
                "scheduler.request_level.class_feedback_interval_s": 0.5}
    async with running_stack(tmp_path, settings=settings, replicas=2) as stack:
        async with await JetserveClient.connect(stack.url, tenant="heavy") as heavy:
            backlog = [asyncio.create_task(heavy.generate(GenerateRequest(
                prompt=f"heavy {i}", max_tokens=40, ignore_eos=True), timeout=120))
                for i in range(28)]
            while sum(task.done() for task in backlog) < 8:  # served, and still backlogged
                await asyncio.sleep(0.1)
            await asyncio.sleep(1.0)  # a feedback step or two saved them
            before = await counters(heavy)
            answered = sum(task.done() for task in backlog)
            victim = stack.processes["priority-1"]
            victim.kill()
            await victim.wait()
            await stack.restart("priority-1")
            restarted = stack.processes["priority-1"].pid
            for _ in range(100):
                after = await counters(heavy)
                if restarted in after and len(after) == 2:  # both, in the same breath
                    break
                await asyncio.sleep(0.1)
            for task in backlog:
                task.cancel()
    assert len(before) == 2 and restarted in after, (before, after)
    served = 8 * 2 * 40  # at least: 8 answered, 40 output tokens (counted twice) each
    assert all(replica["heavy"] >= served for replica in before.values()), before
    # The restarted replica starts from the saved counters (what was served, less the advance
    # charges of requests still running, which their Done charges), not from zero. Nor from
    # more than was served: the replica that stayed has heard every Done too, and holds its
    # advance charges besides. Requests keep ending while the replica restarts, so the bound is
    # the one that stayed, read in the same breath, not what it had before the kill; its two
    # replies are milliseconds apart, but one executor step can end a batch of requests between
    # them (max_num_seqs of them).
    assert len(after) == 2, (before, after)
    batch = 4 * (2 * 40 + 10)  # 4 requests: 40 output tokens counted twice, a short prompt
    stayed = next(r["heavy"] for pid, r in after.items() if pid != restarted)
    assert 0.9 * answered * 2 * 40 <= after[restarted]["heavy"] <= stayed + batch, \
        (answered, before, after)
