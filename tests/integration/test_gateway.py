"""The OpenAI-compatible gateway against a live stack, through the official `openai` SDK: what a
client of vLLM or OpenAI does works, and agrees with the same request over NATS."""

from __future__ import annotations

import asyncio
import signal

import aiohttp
import msgspec
import openai
import pytest
import pytest_asyncio

from shared.client import JetserveClient
from shared.protocol import ChatMessage, Completion, GenerateRequest
from tests.integration.conftest import SMALL_EXECUTOR, running_stack, service_stats

pytestmark = pytest.mark.asyncio(loop_scope="module")

MODEL = "dummy:tiny"
MESSAGES = [{"role": "system", "content": "You are terse."},
            {"role": "user", "content": "Name three colours."}]


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def stack(tmp_path_factory):
    settings = {**SMALL_EXECUTOR, "distributed.drain_timeout_s": 0.5,
                "gateway.api_keys": "{key-acme: acme, key-limited: limited}",
                "quotas.tenants": "{limited: {max_concurrent_requests: 1}}"}
    async with running_stack(tmp_path_factory.mktemp("gateway"), settings=settings,
                             http_port=0) as s:
        yield s


def api(stack, key: str = "key-acme") -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=stack.http_url, api_key=key, max_retries=0, timeout=60)


async def raw_post(stack, path: str, body: bytes) -> tuple[int, dict]:
    """POST `body` to `path` (from the server's root) as tenant acme."""
    async with aiohttp.ClientSession() as session:
        async with session.post(stack.http_url.removesuffix("/v1") + path, data=body, headers={
                "Content-Type": "application/json", "Authorization": "Bearer key-acme"}) as reply:
            return reply.status, await reply.json()


async def over_nats(stack, request: GenerateRequest) -> Completion:
    async with await JetserveClient.connect(stack.url, tenant="acme") as client:
        completion = await client.generate(request, timeout=60)
    assert isinstance(completion, Completion), completion
    return completion


async def test_chat_completion_agrees_with_the_same_request_over_nats(stack):
    answer = await api(stack).chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=12, temperature=0, seed=7)
    native = await over_nats(stack, GenerateRequest(
        messages=[ChatMessage(**m) for m in MESSAGES], max_tokens=12, temperature=0.0, seed=7))
    [choice] = answer.choices
    assert choice.message.role == "assistant" and choice.message.content == native.text
    assert choice.finish_reason == native.finish_reason == "length"
    assert answer.usage.prompt_tokens == native.usage.prompt_tokens
    assert answer.usage.completion_tokens == native.usage.completion_tokens == 12
    assert answer.usage.total_tokens == native.usage.prompt_tokens + 12
    assert answer.model == MODEL and answer.id.startswith("chatcmpl-")


async def test_a_streamed_chat_is_the_same_text_with_the_role_first_and_usage_last(stack):
    chunks = [chunk async for chunk in await api(stack).chat.completions.create(
        model=MODEL, messages=MESSAGES, max_completion_tokens=12, temperature=0, seed=7,
        stream=True, stream_options={"include_usage": True})]
    whole = await api(stack).chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=12, temperature=0, seed=7)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.choices[0].delta.role is None for c in chunks[1:] if c.choices)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12
    assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens
    assert len({c.id for c in chunks}) == 1


async def test_completions_streamed_and_not_with_a_stop_string(stack):
    client = api(stack)
    plain = await client.completions.create(model=MODEL, prompt="Once upon a time",
                                            max_tokens=16, temperature=0)
    native = await over_nats(stack, GenerateRequest(prompt="Once upon a time", max_tokens=16,
                                                    temperature=0.0))
    assert plain.choices[0].text == native.text and plain.usage.completion_tokens == 16
    stop = native.text[len(native.text) // 2:][:3]  # three characters from its middle
    assert stop.strip(), native.text
    stopped = await client.completions.create(model=MODEL, prompt="Once upon a time",
                                              max_tokens=16, temperature=0, stop=stop)
    assert stopped.choices[0].finish_reason == "stop"
    assert stopped.choices[0].text == native.text[:native.text.index(stop)]
    streamed = [chunk async for chunk in await client.completions.create(
        model=MODEL, prompt="Once upon a time", max_tokens=16, temperature=0, stream=True)]
    assert "".join(c.choices[0].text for c in streamed) == native.text
    assert streamed[-1].choices[0].finish_reason == "length"


@pytest.mark.parametrize("field, value", [("n", 2), ("logprobs", True), ("tools", [
    {"type": "function", "function": {"name": "f", "parameters": {}}}]),
    ("response_format", {"type": "json_object"}), ("presence_penalty", 0.5)])
async def test_an_unsupported_parameter_is_a_400_naming_it(stack, field, value):
    with pytest.raises(openai.BadRequestError) as caught:
        await api(stack).chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=4,
                                                 **{field: value})
    assert caught.value.status_code == 400 and f"`{field}`" in caught.value.message
    assert caught.value.body["param"] == field


async def test_a_bad_value_is_a_400_naming_its_field(stack):
    with pytest.raises(openai.BadRequestError) as caught:
        await api(stack).chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=4,
                                                 temperature=-1)
    assert caught.value.body["param"] == "temperature"
    with pytest.raises(openai.BadRequestError) as caught:  # admission's own check
        await api(stack).completions.create(model=MODEL, prompt="hi", max_tokens=10**6)
    assert "max_model_len" in caught.value.message


async def test_an_unknown_model_is_a_404_and_a_wrong_key_a_401(stack):
    with pytest.raises(openai.NotFoundError) as caught:
        await api(stack).chat.completions.create(model="gpt-9", messages=MESSAGES)
    assert caught.value.body["code"] == "model_not_found" and MODEL in caught.value.message
    with pytest.raises(openai.AuthenticationError):
        await api(stack, key="not-a-key").chat.completions.create(model=MODEL,
                                                                  messages=MESSAGES)
    with pytest.raises(openai.AuthenticationError):
        await api(stack, key="not-a-key").models.list()
    models = await api(stack).models.list()
    assert [m.id for m in models.data] == [MODEL]


async def test_a_rate_limited_tenant_gets_a_429_with_retry_after(stack):
    client = api(stack, key="key-limited")
    running = await client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=2000, stream=True,
        extra_body={"ignore_eos": True})
    first = await anext(aiter(running))  # it runs: the tenant's one request in flight
    assert first.choices[0].delta.role == "assistant"
    with pytest.raises(openai.RateLimitError) as caught:
        await client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=4)
    assert caught.value.response.headers["retry-after"] == "1"
    assert "max_concurrent_requests 1" in caught.value.message
    await running.close()
    await ended_in_the_pipeline(stack, cancelled=1)


async def ended_in_the_pipeline(stack, cancelled: int) -> None:
    """Until the executor has counted `cancelled` requests cancelled, and runs none."""
    async with await JetserveClient.connect(stack.url, tenant="acme") as nats_client:
        for _ in range(200):
            stats = await service_stats(nats_client, "executor")
            if stats["running"] == 0 and stats["cancelled"] >= cancelled:
                return
            await asyncio.sleep(0.05)
    raise AssertionError(f"the executor still runs or has not counted the cancel: {stats}")


async def one_more_cancelled(nats_client, before: dict) -> None:
    """The executor counts one more request cancelled (its slot freed), none completed."""
    for _ in range(100):
        after = await service_stats(nats_client, "executor")
        if after["running"] == 0 and after["cancelled"] > before["cancelled"]:
            break
        await asyncio.sleep(0.05)
    assert after["cancelled"] == before["cancelled"] + 1 and after["running"] == 0
    assert after["completed"] == before["completed"]


async def test_a_stream_closed_early_cancels_its_request_in_the_pipeline(stack):
    async with await JetserveClient.connect(stack.url, tenant="acme") as nats_client:
        for _ in range(100):  # what earlier tests left running has ended
            before = await service_stats(nats_client, "executor")
            if before["running"] == 0:
                break
            await asyncio.sleep(0.05)
        stream = await api(stack).chat.completions.create(
            model=MODEL, messages=MESSAGES, max_tokens=1900, stream=True,
            extra_body={"ignore_eos": True})
        seen = 0
        async for _ in stream:
            seen += 1
            if seen == 3:
                break
        await stream.close()  # the HTTP connection goes: the gateway cancels the request
        await one_more_cancelled(nats_client, before)


async def test_x_request_id_comes_back_and_the_pipeline_s_id_is_the_gateway_s(stack):
    """A client's X-Request-Id is echoed, not used as the pipeline's id: cancels match by
    tenant and id, and one client could name another's request."""
    raw = await api(stack).chat.completions.with_raw_response.create(
        model=MODEL, messages=MESSAGES, max_tokens=3, extra_headers={"X-Request-Id": "mine-42"})
    assert raw.headers["x-request-id"] == "mine-42"
    assert raw.parse().id.startswith("chatcmpl-") and raw.parse().id != "chatcmpl-mine-42"
    plain = await api(stack).completions.with_raw_response.create(model=MODEL, prompt="hi",
                                                                 max_tokens=2)
    assert plain.parse().id == f"cmpl-{plain.headers['x-request-id']}"


async def test_hostile_bodies_and_routes_get_openai_shaped_4xx(stack):
    for body, param in ((b"[" * 100_000, "body"), (b'{"model": "dummy:tiny", "prompt": "hi", '
                                                   b'"stream": 0}', "stream"),
                        (b'{"model": "dummy:tiny", "prompt": "hi", "logprobs": 0}', "logprobs")):
        status, answer = await raw_post(stack, "/v1/completions", body)
        assert status == 400 and answer["error"]["param"] == param, answer
        if body.startswith(b"[["):  # said as what it is
            assert "nests arrays and objects more than 32 levels" in answer["error"]["message"]
    # Brackets, then a string left open full of escaped quotes (1 MiB): refused at once, and
    # the gateway answers the next request (the nesting scan once took days on such a body).
    status, answer = await raw_post(stack, "/v1/completions",
                                    b'"' + b"[" * 40 + b'""' + b'\\"' * (512 * 1024))
    assert status == 400 and answer["error"]["param"] == "body", answer
    status, answer = await raw_post(stack, "/nowhere", b"{}")
    assert status == 404 and answer["error"]["type"] == "invalid_request_error"


async def test_tokenize_and_detokenize_as_vllm_s(stack):
    """The prompt's token ids (the chat template applied to messages), as the generation
    endpoints count them in `usage`, and back to text."""
    status, tokens = await raw_post(stack, "/tokenize", msgspec.json.encode(
        {"model": MODEL, "messages": MESSAGES}))
    assert status == 200, tokens
    answer = await api(stack).chat.completions.create(model=MODEL, messages=MESSAGES,
                                                      max_tokens=2)
    assert tokens["count"] == len(tokens["tokens"]) == answer.usage.prompt_tokens
    assert tokens["max_model_len"] > 0
    status, plain = await raw_post(stack, "/tokenize", b'{"model": "dummy:tiny", '
                                                          b'"prompt": "Hello there"}')
    status, text = await raw_post(stack, "/detokenize", msgspec.json.encode(
        {"model": MODEL, "tokens": plain["tokens"]}))
    assert status == 200 and text["prompt"] == "Hello there"
    status, refused = await raw_post(stack, "/detokenize", b'{"model": "dummy:tiny", '
                                                              b'"tokens": [-1]}')
    assert status == 400 and refused["error"]["param"] == "tokens"


async def test_continuous_usage_stats_put_the_usage_so_far_on_every_chunk(stack):
    """vLLM's `stream_options.continuous_usage_stats` (GuideLLM asks for it): every chunk's
    usage counts the tokens so far, with the prompt's tokens as the final usage has them."""
    chunks = [chunk async for chunk in await api(stack).chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=12, temperature=0, stream=True,
        stream_options={"include_usage": True, "continuous_usage_stats": True},
        extra_body={"ignore_eos": True})]
    final = chunks[-1].usage
    assert chunks[-1].choices == [] and final.completion_tokens == 12
    counts = [c.usage.completion_tokens for c in chunks]
    assert all(c.usage.prompt_tokens == final.prompt_tokens for c in chunks)
    assert counts == sorted(counts) and counts[0] >= 1 and counts[-2] == 12
    # A prompt that must be over max_model_len is refused before the gateway tokenizes it.
    status, answer = await raw_post(stack, "/v1/completions", msgspec.json.encode({
        "model": MODEL, "prompt": "word " * 180_000, "stream": True,
        "stream_options": {"continuous_usage_stats": True}}))
    assert status == 400 and "max_model_len" in answer["error"]["message"], answer
    assert answer["error"]["code"] == "prompt_too_long" and answer["error"]["param"] == "prompt"


async def test_sigterm_ends_an_open_stream_with_an_error_event_and_cancels_it(stack):
    """A gateway told to stop lets streams run for its drain time (0.5 s here), then ends each
    still open with an `error` event and `data: [DONE]` (not a cut connection) and cancels its
    request in the pipeline; then it exits. (Restarted after, for the tests that follow.)"""
    gateway = stack.processes["gateway"]
    try:
        async with await JetserveClient.connect(stack.url, tenant="acme") as nats_client:
            for _ in range(100):
                before = await service_stats(nats_client, "executor")
                if before["running"] == 0:
                    break
                await asyncio.sleep(0.05)
            events: list[bytes] = []
            async with aiohttp.ClientSession() as session:
                async with session.post(stack.http_url + "/chat/completions", json={
                        "model": MODEL, "messages": MESSAGES, "max_tokens": 1900,
                        "stream": True, "ignore_eos": True},
                        headers={"Authorization": "Bearer key-acme"}) as reply:
                    assert reply.status == 200
                    async for line in reply.content:
                        if line.startswith(b"data: "):
                            events.append(line.removeprefix(b"data: ").strip())
                            if len(events) == 3:
                                gateway.send_signal(signal.SIGTERM)
            assert await asyncio.wait_for(gateway.wait(), 30) == 0
            assert events[-1] == b"[DONE]", events[-3:]
            error = msgspec.json.decode(events[-2])["error"]
            assert error["code"] == "overloaded" and "shutting down" in error["message"], error
            assert all(b'"error"' not in e for e in events[:-2]), [  # tokens until then
                e for e in events if b'"error"' in e]
            assert len(events) < 1900
            await one_more_cancelled(nats_client, before)
    finally:
        if gateway.returncode is None:
            gateway.kill()
            await gateway.wait()
        await stack.restart("gateway")
        for _ in range(300):
            try:
                async with aiohttp.ClientSession() as session:
                    async with session.get(stack.http_url.removesuffix("/v1") + "/health") as r:
                        if r.status == 200:
                            break
            except aiohttp.ClientError:
                pass
            await asyncio.sleep(0.1)
