"""Per-tenant quotas in a running stack: a tenant past its concurrency quota, its share of the
waiting queue or its share of the durable backlog gets `rate_limited` with `retry_after_ms`,
and another tenant's requests go on; a request past a quota of shape is refused, not run."""

from __future__ import annotations

import asyncio

import pytest
import pytest_asyncio

from shared.client import JetserveClient
from shared.protocol import Completion, Error, GenerateRequest
from tests.integration.conftest import (SMALL_EXECUTOR, running_stack, service_stats,
                                        wait_for_stat)

pytestmark = pytest.mark.asyncio(loop_scope="module")

QUEUE = 8  # max_pending_requests: each tenant may have 4 waiting (queue_share 0.5 by default)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def stack(tmp_path_factory):
    settings = {**SMALL_EXECUTOR, "scheduler.request_level.max_pending_requests": QUEUE,
                "quotas.tenants": "{flood: {max_concurrent_requests: 3}}"}
    async with running_stack(tmp_path_factory.mktemp("quotas"), settings=settings) as s:
        yield s


def long(request_id: str, max_tokens: int = 400) -> GenerateRequest:
    return GenerateRequest(request_id=request_id, prompt_token_ids=[5, 6], max_tokens=max_tokens,
                           ignore_eos=True)


async def test_past_its_concurrency_quota_or_queue_share_a_tenant_is_rate_limited(stack):
    async with await JetserveClient.connect(stack.url, tenant="flood") as flood, \
            await JetserveClient.connect(stack.url, tenant="calm") as calm:
        # 2,000 tokens (about 3 s on the tiny model): the first two still run while the rest
        # of the flood, then calm's requests, are judged, on a loaded host too.
        floods = [asyncio.create_task(flood.generate(long(f"f{i}", 2000), timeout=120))
                  for i in range(10)]
        await wait_for_stat(flood, "executor", "running", 2)
        calms = [asyncio.create_task(calm.generate(long(f"c{i}", 50), timeout=120))
                 for i in range(6)]
        flooded, calmed = await asyncio.gather(*floods), await asyncio.gather(*calms)
    limited = [o for o in flooded if isinstance(o, Error)]
    assert sum(isinstance(o, Completion) for o in flooded) == 3  # its quota: 3 at a time
    assert len(limited) == 7 and all(e.code == "rate_limited" for e in limited), limited
    assert all(e.retry_after_ms == 1000.0 and "(max_concurrent_requests 3)" in e.message
               for e in limited)
    # calm waits behind the flood's running requests: 4 of its own may wait (its queue share),
    # the others are told to come back, and none of it fails otherwise.
    waited = [o for o in calmed if isinstance(o, Completion)]
    refused = [o for o in calmed if isinstance(o, Error)]
    assert len(waited) == 4 and len(refused) == 2, calmed
    assert all(e.code == "rate_limited" and "queue_share 0.5" in e.message for e in refused)


async def test_past_its_share_of_the_durable_backlog_a_tenant_is_rate_limited(stack):
    async with await JetserveClient.connect(stack.url, tenant="heavy") as heavy, \
            await JetserveClient.connect(stack.url, tenant="light") as light, \
            await JetserveClient.connect(stack.url, tenant="busy") as busy:
        # Both executor slots are taken until cancelled (2,000 tokens, ~3 s on the tiny model),
        # so heavy's first four wait at priority, held and counted toward its share, while the
        # excess is judged: a 400-token request ends in half a second, which a loaded host can
        # outlast.
        blockers = [asyncio.create_task(busy.generate(long(f"b{i}", 2000), timeout=120))
                    for i in range(2)]
        await wait_for_stat(busy, "executor", "running", 2)
        for i in range(QUEUE):  # the whole of LLM_REQUESTS
            await heavy.submit(long(f"h{i}"))
        results = await asyncio.gather(*(heavy.result(f"h{i}", timeout=120)
                                          for i in range(QUEUE // 2, QUEUE)))
        held = (await service_stats(heavy, "admission"))["durable_held"]
        for i in range(2):
            await busy.cancel(f"b{i}")
        blocked = await asyncio.gather(*blockers)
        # The excess was answered and its places freed: another tenant's request goes in.
        assert not (await light.submit(long("mine", 20))).duplicate
        mine = await light.result("mine", timeout=120)
        kept = await asyncio.gather(*(heavy.result(f"h{i}", timeout=120)
                                      for i in range(QUEUE // 2)))
        # A refusal by the share is retryable: the same id, sent again once admission has
        # settled the requests that ended (a result is stored before admission hears the
        # request is done; until then it still counts toward the share), runs.
        await wait_for_stat(heavy, "admission", "durable_held", 0)
        again = await heavy.submit(long(f"h{QUEUE - 1}", 10))
        retried = await heavy.result(f"h{QUEUE - 1}", timeout=120)
    # First the premise: the blockers ran until cancelled (a host too slow for 2,000 tokens to
    # outlast the judging fails here, not below).
    assert all(isinstance(b, Completion) and b.finish_reason == "cancelled" for b in blocked), \
        blocked
    assert held == QUEUE // 2
    assert all(isinstance(r, Error) and r.code == "rate_limited" and r.retry_after_ms == 1000.0
               and "durable_share 0.5" in r.message for r in results), results
    assert all(isinstance(r, Completion) for r in kept), kept
    assert isinstance(mine, Completion) and len(mine.token_ids) == 20
    assert not again.duplicate and isinstance(retried, Completion), retried


async def test_a_request_with_ten_thousand_stop_strings_is_refused_not_run(stack):
    async with await JetserveClient.connect(stack.url, tenant="stops") as client:
        error = await client.generate(GenerateRequest(
            prompt="hi", max_tokens=4, stop=[f"s{i}" for i in range(10_000)]), timeout=30)
        await wait_for_stat(client, "executor", "running", 0)
    assert isinstance(error, Error) and error.code == "invalid_request"
    assert "hold 10000, over the quota of tenant 'stops' (max_stop 64)" in error.message
