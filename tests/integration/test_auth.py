"""A stack run with `--auth` (services/auth.py): the server itself refuses a tenant everything of
another tenant's and everything internal, and lets it do all of its own."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import ssl
import subprocess
import sys

import nats
import nats.errors
import pytest
import pytest_asyncio

from shared.client import JetserveClient
from shared.protocol import Completion, Delta, GenerateRequest
from shared.subjects import RESULTS_STREAM
from tests.integration.conftest import running_stack

pytestmark = pytest.mark.asyncio(loop_scope="module")


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def stack(tmp_path_factory):
    async with running_stack(tmp_path_factory.mktemp("auth"), auth=True, http_port=0) as s:
        s.urls = {name: s.add_tenant(name) for name in ("alice", "bob")}
        yield s


@contextlib.asynccontextmanager
async def tenant(stack, name: str):
    """A client of tenant `name` logged in as it; `errors` is what the server told it."""
    errors: list[str] = []

    async def on_error(exc: Exception) -> None:
        errors.append(str(exc))

    for _ in range(50):  # the reload after add_tenant takes a moment
        try:
            client = await JetserveClient.connect(stack.urls[name], tenant=name,
                                                  error_cb=on_error, allow_reconnect=False)
            break
        except (nats.errors.Error, OSError):  # (a connection reset while it reloads)
            await asyncio.sleep(0.1)
    client.errors = errors
    try:
        yield client
    finally:
        await client.close()


async def refused(client, action) -> str:
    """The server's permission violation for what `action` tried (it fails or times out)."""
    with contextlib.suppress(Exception):
        await action()
    for _ in range(100):
        violations = [e for e in client.errors if "permissions violation" in e.lower()]
        if violations:
            return violations[0]
        await asyncio.sleep(0.02)
    raise AssertionError(f"the server refused nothing; it said {client.errors}")


@pytest.mark.parametrize("subject", ["llm.results.bob.r1", "llm.results.bob.>",
                                     "llm.stream.bob.r1", "llm.stream.>", "_INBOX.bob.>",
                                     "_INBOX.>", "llm.internal.>", "llm.requests.>", ">"])
async def test_a_tenant_cannot_subscribe_to_another_s_results_streams_or_inboxes(stack, subject):
    async with tenant(stack, "alice") as alice:
        said = await refused(alice, lambda: alice.nc.subscribe(subject))
    assert f'subscription to "{subject.lower()}"' in said


@pytest.mark.parametrize("api", [
    f"DIRECT.GET.{RESULTS_STREAM}.llm.results.bob.r1",  # a direct get of bob's result
    f"STREAM.MSG.GET.{RESULTS_STREAM}",  # a stored message by sequence or subject
    f"CONSUMER.CREATE.{RESULTS_STREAM}",  # a consumer reading the whole stream
    "STREAM.INFO.LLM_REQUESTS",
    "STREAM.DELETE.LLM_RESULTS",
])
async def test_a_tenant_cannot_read_another_s_results_through_the_jetstream_api(stack, api):
    async with tenant(stack, "alice") as alice:
        said = await refused(alice, lambda: alice.nc.request(f"$JS.API.{api}", b"{}",
                                                             timeout=0.5))
    assert f'publish to "$JS.API.{api}"'.lower() in said


@pytest.mark.parametrize("subject", [
    "llm.generate.bob", "llm.requests.bob.r1", "llm.cancel.bob", "llm.requests.alice",
    "llm.internal.priority.submit", "llm.internal.done", "llm.internal.holding",
    "llm.internal.revoke", "llm.internal.executor.executor-0.assign", "llm.results.alice.r1",
    "$SRV.STATS", "$SRV.PING.admission",
])
async def test_a_tenant_cannot_publish_on_another_s_or_internal_subjects(stack, subject):
    async with tenant(stack, "alice") as alice:
        said = await refused(alice, lambda: alice.nc.publish(subject, b"{}"))
    assert f'publish to "{subject.lower()}"' in said


async def test_a_tenant_does_all_of_its_own_and_hears_nothing_refused(stack):
    async with tenant(stack, "alice") as alice, tenant(stack, "bob") as bob:
        completion = await alice.generate(GenerateRequest(prompt="hi", max_tokens=3), timeout=30)
        outputs = [out async for out in alice.stream(GenerateRequest(prompt="hi", max_tokens=3))]
        assert not (await alice.submit(GenerateRequest(request_id="r1", prompt="hi",
                                                       max_tokens=2))).duplicate
        stored = await alice.result("r1", timeout=30)
        repeat = await alice.submit(GenerateRequest(request_id="r1", prompt="hi", max_tokens=2))
        # bob's id r1 is bob's own: alice's does not stand in its way
        bobs = await bob.submit(GenerateRequest(request_id="r1", prompt="hey", max_tokens=2))
        deltas = await alice.stream_deltas("s1")
        await alice.submit(GenerateRequest(request_id="s1", prompt="hi", max_tokens=400,
                                           ignore_eos=True, stream=True))
        await deltas.next_msg(timeout=30)  # it runs
        await alice.cancel("s1")
        cancelled = await alice.result("s1", timeout=30)
        bob_result = await bob.result("r1", timeout=30)
        errors = alice.errors + bob.errors
    assert isinstance(completion, Completion) and len(completion.token_ids) == 3
    assert isinstance(outputs[0], Delta) and isinstance(outputs[-1], Completion)
    assert isinstance(stored, Completion) and stored.request_id == "r1"
    assert repeat.duplicate and not bobs.duplicate and isinstance(bob_result, Completion)
    assert isinstance(cancelled, Completion) and cancelled.finish_reason == "cancelled"
    assert errors == []


async def test_a_tenant_cannot_aim_its_answers_at_another_s_inbox(stack):
    """alice's generate with one of bob's inboxes as its reply subject (which bob's client may be
    reading) gets no answer at all: nothing reaches bob, and admission counts the refusal."""
    async with tenant(stack, "alice") as alice, tenant(stack, "bob") as bob:
        inbox = bob.nc.new_inbox()
        assert inbox.startswith("_INBOX.bob.")
        heard = await bob.nc.subscribe(inbox)
        await bob.nc.flush()
        service = await nats.connect(stack.url, **stack.service_login())
        try:
            async def refusals() -> int:
                reply = await service.request("$SRV.STATS.admission", b"", timeout=2)
                return next(e["data"] for e in json.loads(reply.data)["endpoints"]
                            if e.get("data"))["reply_refused"]

            before = await refusals()
            await alice.nc.publish("llm.generate.alice", b'{"type": "generate", "prompt": "hi", '
                                   b'"max_tokens": 2}', reply=inbox)
            answered = await alice.generate(GenerateRequest(prompt="hi", max_tokens=2), timeout=30)
            with pytest.raises(nats.errors.TimeoutError):
                await heard.next_msg(timeout=1)
            after = await refusals()
        finally:
            await service.close()
    assert isinstance(answered, Completion) and after == before + 1


def jetserve(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "services.cli", *args], capture_output=True,
                          text=True, timeout=60, env={**os.environ, "PYTHONUNBUFFERED": "1"})


async def completion_over_http(stack, api_key: str | None) -> tuple[int, dict]:
    """A two-token completion through the stack's OpenAI-compatible gateway."""
    import aiohttp

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    async with aiohttp.ClientSession() as session:
        async with session.post(stack.http_url + "/completions", headers=headers, json={
                "model": "dummy:tiny", "prompt": "hi", "max_tokens": 2}) as reply:
            return reply.status, await reply.json()


async def http_status_becomes(stack, api_key: str, status: int, within_s: float = 3.0) -> bool:
    for _ in range(int(within_s / 0.1)):
        if (await completion_over_http(stack, api_key))[0] == status:
            return True
        await asyncio.sleep(0.1)
    return False


async def test_tenant_add_prints_a_url_and_an_api_key_that_work_and_remove_revokes_them(stack):
    added = await asyncio.to_thread(jetserve, "tenant", "add", "carol",
                                    "--state-dir", str(stack.state_dir))
    assert added.returncode == 0, added.stderr
    api_key, url = added.stdout.strip().splitlines()[-2:]
    assert url.startswith("nats://carol:") and url.endswith(f"@127.0.0.1:{stack.nats_port}")
    # The API key works at the gateway within a second (it reads the keys file again when it
    # changes); no key, or another, is a 401: the gateway is no way around the server's logins.
    assert await http_status_becomes(stack, api_key, 200)
    assert (await completion_over_http(stack, None))[0] == 401
    assert (await completion_over_http(stack, api_key + "x"))[0] == 401
    closed = asyncio.Event()

    async def on_closed() -> None:
        closed.set()

    async with await JetserveClient.connect(url, tenant="carol", allow_reconnect=False,
                                            closed_cb=on_closed) as carol:
        completion = await carol.generate(GenerateRequest(prompt="hi", max_tokens=2), timeout=30)
        again = await asyncio.to_thread(jetserve, "tenant", "add", "carol",
                                        "--state-dir", str(stack.state_dir))
        removed = await asyncio.to_thread(jetserve, "tenant", "remove", "carol",
                                          "--state-dir", str(stack.state_dir))
        await asyncio.wait_for(closed.wait(), 10)  # the server closed carol's connection
    assert isinstance(completion, Completion)
    assert again.returncode == 1 and "exists" in again.stderr
    assert removed.returncode == 0, removed.stderr
    with pytest.raises(nats.errors.Error):
        await nats.connect(url, allow_reconnect=False, max_reconnect_attempts=0)
    assert await http_status_becomes(stack, api_key, 401)
    status, body = await completion_over_http(stack, api_key)
    assert status == 401 and body["error"]["code"] == "invalid_api_key", body
    unknown = await asyncio.to_thread(jetserve, "tenant", "remove", "nobody",
                                      "--state-dir", str(stack.state_dir))
    assert unknown.returncode == 1 and "no tenant 'nobody'" in unknown.stderr


async def test_with_tls_a_client_without_the_ca_cannot_connect_and_one_with_it_is_served(
        tmp_path):
    async with running_stack(tmp_path, auth=True, tls=True) as tls_stack:
        url = tls_stack.add_tenant("dora")
        with pytest.raises(Exception) as refused:
            await nats.connect(url, allow_reconnect=False, max_reconnect_attempts=0)
        trusted = ssl.create_default_context(cafile=tls_stack.tls["ca"])
        for _ in range(50):  # the reload after add_tenant takes a moment
            with contextlib.suppress(nats.errors.Error):
                client = await JetserveClient.connect(url, tenant="dora", tls=trusted)
                break
            await asyncio.sleep(0.1)
        async with client:
            completion = await client.generate(GenerateRequest(prompt="hi", max_tokens=2),
                                               timeout=30)
    assert isinstance(refused.value, ssl.SSLCertVerificationError), refused.value
    assert isinstance(completion, Completion) and len(completion.token_ids) == 2


async def test_a_state_from_before_api_keys_gets_one_per_tenant(tmp_path):
    """users.json written before tenants had API keys: the next start (`create`) gives each
    tenant one, and api_keys.json (key -> tenant, owner-only) is what the gateway reads."""
    import json
    import stat

    from services.auth import Users

    (tmp_path / "auth").mkdir()
    (tmp_path / "auth" / "users.json").write_text(json.dumps({
        "service_password": "s", "tenants": {"acme": "p1", "beta": "p2"}}))
    users = Users(tmp_path)
    users.create("nats://127.0.0.1:4222", "llm", "_INBOX")
    keys = json.loads(users.api_keys_path.read_text())
    assert sorted(keys.values()) == ["acme", "beta"]
    assert keys[users.api_key("acme")] == "acme" and users.api_key("acme") != users.api_key("beta")
    assert stat.S_IMODE(users.api_keys_path.stat().st_mode) == 0o600
    before = users.api_key("acme")
    users.create("nats://127.0.0.1:4222", "llm", "_INBOX")  # kept across starts
    assert users.api_key("acme") == before
