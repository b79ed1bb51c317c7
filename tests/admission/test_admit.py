"""Admission's validation at the edge, without a server: what becomes a WorkItem, what an Error."""

import time

import msgspec
import pytest

from services.admission.service import Admission
from shared.config import load_config
from shared.protocol import ProtocolError


@pytest.fixture(scope="module")
def admission():
    config = load_config(None, {"JETSERVE_MODEL__NAME": "dummy:tiny",
                                "JETSERVE_SCHEDULER__REQUEST_LEVEL__RATE_LIMIT_TOKENS_PER_S": "10",
                                "JETSERVE_SCHEDULER__REQUEST_LEVEL__RATE_LIMIT_BURST_TOKENS":
                                    "300"})
    return Admission(config, nc=None, js=None, tracer=None)


def payload(**fields) -> bytes:
    return msgspec.json.encode({"type": "generate", **fields})


async def test_a_request_becomes_a_tokenized_work_item(admission):
    item = await admission.admit("t1", payload(messages=[{"role": "user", "content": "Hi"}],
                                         max_tokens=4, deadline_ms=2000))
    request = item.request
    assert request.messages is None and request.prompt is None
    assert request.prompt_token_ids == admission.tokenizer.encode(
        admission.tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}]))
    assert request.model == "dummy:tiny"
    assert request.request_id.startswith("req-") and request.seed is not None
    assert item.tenant == "t1" and abs(item.arrival_time - time.time()) < 5
    assert item.deadline == pytest.approx(item.arrival_time + 2.0)


async def test_a_given_seed_and_id_are_kept(admission):
    item = await admission.admit("t1", payload(prompt="Hi", max_tokens=4, seed=11, request_id="r-1"),
                                 durable_id="r-1")
    assert (item.request.seed, item.request_id, item.durable) == (11, "r-1", True)
    # A durable request's id is its subject's; the payload may leave it out.
    item = await admission.admit("t1", payload(prompt="Hi", max_tokens=4), durable_id="r-2")
    assert (item.request_id, item.durable) == ("r-2", True)


@pytest.mark.parametrize("tenant, fields, durable_id, code, needle", [
    ("a.b", dict(prompt="x"), None, "invalid_request", "tenant 'a.b'"),
    ("t", dict(prompt="x", model="other"), None, "unknown_model", "'other' is not served"),
    ("t", dict(prompt="x", request_id="r-9"), "r-8", "invalid_request",
     "must equal the subject's last token 'r-8'"),
    ("t", dict(prompt="x", max_tokens=2048), None, "prompt_too_long", "max_model_len 2048"),
    # Refused by its length alone: 200,000 characters are more than 81 * 2048.
    ("t", dict(prompt="x" * 200_000), None, "prompt_too_long", "200000 characters are at least"),
    ("t", dict(messages=[{"role": "user", "content": "y" * 200_000}]), None, "prompt_too_long",
     "no token is longer than 81 characters"),
    ("t", dict(prompt_token_ids=[1, 10**6]), None, "invalid_request", "vocab size"),
    ("t", dict(prompt="x", max_tokens=500), None, "rate_limited", "more than the burst 300"),
])
async def test_rejections_name_the_cause(admission, tenant, fields, durable_id, code, needle):
    with pytest.raises(ProtocolError) as error:
        await admission.admit(tenant, payload(**fields), durable_id)
    assert error.value.code == code and needle in error.value.message


async def test_rate_limit_is_per_tenant(admission):
    await admission.admit("heavy", payload(prompt="x", max_tokens=290))
    with pytest.raises(ProtocolError) as error:
        await admission.admit("heavy", payload(prompt="x", max_tokens=100))
    assert error.value.code == "rate_limited" and "retry in" in error.value.message
    assert 0 < error.value.retry_after_s <= 10  # 90 tokens short at 10 tokens/s
    await admission.admit("light", payload(prompt="x", max_tokens=100))


async def test_a_request_refused_for_its_size_takes_none_of_the_rate(tmp_path):
    """The size check (a result of 200 tokens cannot fit a 16 KiB max_payload) comes before the
    rate limit: the refused request takes none of the tenant's 300-token burst."""
    from tests.nats_server import nats_server

    config = load_config(None, {"JETSERVE_MODEL__NAME": "dummy:tiny",
                                "JETSERVE_SCHEDULER__REQUEST_LEVEL__RATE_LIMIT_TOKENS_PER_S": "1",
                                "JETSERVE_SCHEDULER__REQUEST_LEVEL__RATE_LIMIT_BURST_TOKENS":
                                    "300"})
    async with nats_server(tmp_path, max_payload=16384) as nc:
        admission = Admission(config, nc=nc, js=None, tracer=None)
        with pytest.raises(ProtocolError) as error:
            await admission.admit("t", payload(prompt="x", max_tokens=200))
        assert error.value.code == "invalid_request" and "max_payload 16384" in error.value.message
        await admission.admit("t", payload(prompt="x", max_tokens=150))
