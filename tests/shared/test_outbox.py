"""A durable request's result is stored once, against a real nats-server: a second result for
the same request is refused inside the duplicate window and past it."""

from __future__ import annotations

import asyncio
import subprocess

import nats
import pytest

from services.stack import free_port, nats_server_binary
from shared.bus import Outbox, ensure_streams
from shared.config import JetserveConfig, NatsSection
from shared.protocol import Error
from shared.subjects import RESULTS_STREAM, Subjects


@pytest.fixture
async def js(tmp_path):
    port = free_port()
    server = subprocess.Popen([nats_server_binary(), "-a", "127.0.0.1", "-p", str(port), "-js",
                               "-sd", str(tmp_path)], stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL)
    nc = None
    try:
        for _ in range(100):
            try:
                nc = await nats.connect(f"nats://127.0.0.1:{port}", connect_timeout=1,
                                        allow_reconnect=False)
                break
            except Exception:
                await asyncio.sleep(0.1)
        yield nc.jetstream()
    finally:
        if nc is not None:
            await nc.close()
        server.terminate()
        server.wait(10)


async def test_a_second_result_past_the_duplicate_window_is_not_stored(js):
    config = JetserveConfig(nats=NatsSection(duplicate_window_s=0.5))
    await ensure_streams(js, config)
    outbox = Outbox(js._nc, js, Subjects("llm"))
    first = Error(request_id="once", code="internal", message="first")
    await outbox.store_result("acme", "once", first)
    await outbox.store_result("acme", "once", Error(request_id="once", code="internal",
                                                    message="within the window"))
    await asyncio.sleep(1.0)  # the duplicate window has passed
    await outbox.store_result("acme", "once", Error(request_id="once", code="internal",
                                                    message="a late second run"))
    info = await js.stream_info(RESULTS_STREAM, subjects_filter="llm.results.acme.once")
    assert info.state.subjects == {"llm.results.acme.once": 1}
    stored = await js.get_last_msg(RESULTS_STREAM, "llm.results.acme.once")
    assert b'"first"' in stored.data
