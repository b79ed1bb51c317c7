"""Real messages against real limits: every message between services fits the nats-server's
`max_payload` (the default 1 MiB and smaller ones an operator may set), and what could never fit
is refused at admission, naming the limit."""

from __future__ import annotations

import asyncio
import random

import pytest

from shared.client import JetserveClient
from shared.protocol import Completion, Error, GenerateRequest
from tests.integration.conftest import running_stack, service_stats

SIM = {"model.name": "sim:llama3-8b-h100", "kv_cache.num_blocks": None}
LONG_PROMPT = 7000  # tokens, of the simulated model's 8192


class Sizes:
    """Every message the server delivers to a wildcard subscriber: how many, and the largest."""

    def __init__(self):
        self.count = 0
        self.largest = 0
        self.largest_subject = ""

    async def see(self, msg) -> None:
        self.count += 1
        size = len(msg.data) + sum(len(k) + len(v) + 4 for k, v in (msg.headers or {}).items())
        if size > self.largest:
            self.largest, self.largest_subject = size, msg.subject


@pytest.mark.parametrize("max_payload", [None, 64 * 1024], ids=["default-1MiB", "64KiB"])
async def test_a_burst_of_long_prompts_is_served_within_max_payload(tmp_path, max_payload):
    """100 prompts of 7,000 tokens at once, to two simulated executors, after short requests
    taught the batcher a small mean request size (so its pulls ask for many): each request's
    message is ~30 KB, and a pull for every free slot would be megabytes (3 MB for these). Every request
    completes, none is handed on, and no message the services send exceeds max_payload."""
    nats_settings = {"max_payload": max_payload} if max_payload else None
    async with running_stack(tmp_path, executors=2, settings=SIM,
                             nats_settings=nats_settings) as stack:
        async with await JetserveClient.connect(stack.url, tenant="long") as client:
            limit = client.nc.max_payload
            sizes = Sizes()
            await client.nc.subscribe(">", cb=sizes.see)
            rng = random.Random(0)
            warm = [GenerateRequest(prompt_token_ids=[rng.randrange(1, 49000) for _ in range(20)],
                                    max_tokens=4) for _ in range(50)]
            assert all(isinstance(o, Completion)
                       for o in await asyncio.gather(*(client.generate(r) for r in warm)))
            burst = [GenerateRequest(
                request_id=f"long-{i}", max_tokens=8, ignore_eos=True,
                prompt_token_ids=[rng.randrange(1, 49000) for _ in range(LONG_PROMPT)])
                for i in range(100)]
            outputs = await asyncio.gather(*(client.generate(r, timeout=150) for r in burst))
            admission = await service_stats(client, "admission")
    failed = [o for o in outputs if not isinstance(o, Completion)]
    assert not failed, failed[:3]
    assert all(o.usage.completion_tokens == 8 for o in outputs)
    assert admission["generates_handed_on"] == 0 and admission["durable_handed_on"] == 0
    assert sizes.count > 2 * (len(warm) + len(burst))  # it saw the traffic (requests, results)
    assert sizes.largest <= limit, (sizes.largest, sizes.largest_subject)
    logs = "".join(p.read_text() for p in (tmp_path / "logs").glob("*.log"))
    assert "MaxPayload" not in logs and "pull failed" not in logs


async def test_what_cannot_fit_one_message_is_refused_at_admission(tmp_path):
    """On a server with max_payload 16 KiB: a prompt whose request message would not fit is
    `prompt_too_long`, a `max_tokens` whose result might not fit is `invalid_request`; each
    names the limit. A request that fits is served."""
    async with running_stack(tmp_path, settings=SIM,
                             nats_settings={"max_payload": 16 * 1024}) as stack:
        async with await JetserveClient.connect(stack.url, tenant="small") as client:
            # SmolLM2's tokenizer splits digits one by one: 8,000 tokens in an 8 KB request.
            big_prompt = await client.generate(GenerateRequest(prompt="7" * 8000, max_tokens=4))
            big_result = await client.generate(GenerateRequest(prompt="Hello", max_tokens=1000))
            fits = await client.generate(GenerateRequest(prompt="Hello", max_tokens=16,
                                                         ignore_eos=True))
    assert isinstance(big_prompt, Error) and big_prompt.code == "prompt_too_long", big_prompt
    assert "max_payload 16384" in big_prompt.message, big_prompt.message
    assert isinstance(big_result, Error) and big_result.code == "invalid_request", big_result
    assert "`max_tokens` 1000" in big_result.message and "max_payload 16384" in \
        big_result.message, big_result.message
    assert isinstance(fits, Completion) and fits.usage.completion_tokens == 16
