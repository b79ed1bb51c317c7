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
                                "JETSERVE_QUOTAS__DEFAULT__TOKENS_PER_S": "10",
                                "JETSERVE_QUOTAS__DEFAULT__BURST_TOKENS": "300",
                                "JETSERVE_QUOTAS__TENANTS": "{capped: {max_tokens: 8, max_stop: 2, "
                                "max_stop_length: 5, max_prompt_tokens: 3, max_payload_bytes: "
                                "200, max_concurrent_requests: 1}}"})
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
    ("t", dict(prompt="x", max_tokens=500), None, "invalid_request", "more than the burst 300"),
    # A tenant's quota of shape (here `capped`'s); the default allows 64 stop strings.
    ("t", dict(prompt="x", stop=["s"] * 10_000), None, "invalid_request", "(max_stop 64)"),
    ("capped", dict(prompt="x", max_tokens=9), None, "invalid_request", "(max_tokens 8)"),
    ("capped", dict(prompt="x", max_tokens=2, stop=["a"], stop_token_ids=[1, 2]), None,
     "invalid_request", "`stop` and `stop_token_ids` hold 3, over the quota of tenant 'capped' "
     "(max_stop 2)"),
    ("capped", dict(prompt="x", max_tokens=2, stop=["longer"]), None, "invalid_request",
     "(max_stop_length 5)"),
    ("capped", dict(prompt_token_ids=[1, 2, 3, 4], max_tokens=2), None, "invalid_request",
     "the prompt is 4 tokens, over the quota of tenant 'capped' (max_prompt_tokens 3)"),
    ("capped", dict(prompt="x" * 300), None, "invalid_request", "(max_payload_bytes 200)"),
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
                                "JETSERVE_QUOTAS__DEFAULT__TOKENS_PER_S": "1",
                                "JETSERVE_QUOTAS__DEFAULT__BURST_TOKENS": "300"})
    async with nats_server(tmp_path, max_payload=16384) as nc:
        admission = Admission(config, nc=nc, js=None, tracer=None)
        with pytest.raises(ProtocolError) as error:
            await admission.admit("t", payload(prompt="x", max_tokens=200))
        assert error.value.code == "invalid_request" and "max_payload 16384" in error.value.message
        await admission.admit("t", payload(prompt="x", max_tokens=150))


async def test_a_tenant_at_its_concurrency_quota_is_rate_limited_until_one_ends(admission):
    from shared.keys import RequestKey

    admission.ledger.watch(RequestKey("capped", "running"), b"")  # one request of its one
    with pytest.raises(ProtocolError) as error:
        await admission.admit("capped", payload(prompt="x", max_tokens=2))
    assert error.value.code == "rate_limited" and "(max_concurrent_requests 1)" in \
        error.value.message and error.value.retry_after_s == 1.0
    assert error.value.to_error("r").retry_after_ms == 1000.0
    await admission.admit("other", payload(prompt="x", max_tokens=2))  # others are not held up
    admission.ledger.done(RequestKey("capped", "running"), durable=False)
    await admission.admit("capped", payload(prompt="x", max_tokens=2))
