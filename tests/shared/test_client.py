"""The Python client while JetStream is away for a moment (a stream electing its leader after a
NATS node died; here the stream is deleted and made again a second later, against a real
nats-server): a durable submission is stored once it is back, and a wait for a result goes on
and finds it, rather than either raising at the first try."""

from __future__ import annotations

import asyncio
import contextlib

import pytest

from shared.bus import Outbox, ensure_streams
from shared.client import JetserveClient
from shared.config import JetserveConfig
from shared.protocol import Error, GenerateRequest
from shared.subjects import REQUESTS_STREAM, RESULTS_STREAM, Subjects
from tests.nats_server import nats_server

pytestmark = pytest.mark.asyncio


@contextlib.asynccontextmanager
async def stream_away(tmp_path, stream: str):
    """A server with jetserve's streams but `stream` (made again by `back()`), and a client."""
    async with nats_server(tmp_path) as nc:
        js = nc.jetstream()
        await ensure_streams(js, JetserveConfig())
        await js.delete_stream(stream)
        async with await JetserveClient.connect(nc.connected_url.geturl(),
                                                tenant="acme") as client:
            yield nc, client, lambda: ensure_streams(js, JetserveConfig())


async def test_a_durable_submission_is_stored_once_jetstream_is_back(tmp_path):
    async with stream_away(tmp_path, REQUESTS_STREAM) as (nc, client, back):
        submitting = asyncio.create_task(client.submit(GenerateRequest(
            request_id="kept", prompt="hello", max_tokens=4)))
        await asyncio.sleep(1.0)
        assert not submitting.done()
        await back()
        ack = await asyncio.wait_for(submitting, 10)
        stored = await nc.jetstream().get_last_msg(REQUESTS_STREAM, "llm.requests.acme.kept")
    assert ack.stream == REQUESTS_STREAM and not ack.duplicate and ack.seq == 1, ack
    assert b'"request_id":"kept"' in stored.data


async def test_a_wait_for_a_result_outlasts_jetstream_away(tmp_path):
    async with stream_away(tmp_path, RESULTS_STREAM) as (nc, client, back):
        waiting = asyncio.create_task(client.result("later", timeout=20))
        await asyncio.sleep(1.5)
        assert not waiting.done()
        await back()
        await Outbox(nc, nc.jetstream(), Subjects("llm"), "_INBOX").store_result(
            "acme", "later", Error(request_id="later", code="internal", message="stored"))
        answer = await asyncio.wait_for(waiting, 10)
    assert isinstance(answer, Error) and answer.message == "stored", answer
