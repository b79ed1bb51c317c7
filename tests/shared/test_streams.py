"""The streams jetserve keeps, against a real nats-server: created when absent, brought to the
configuration when they differ where JetStream allows it, and a clear error where it does not
(or where JetStream is off)."""

from __future__ import annotations

import pytest
from nats.js.api import RetentionPolicy, StorageType, StreamConfig

from shared.bus import StreamMismatch, ensure_streams
from shared.config import load_config
from shared.subjects import REQUESTS_STREAM, RESULTS_STREAM
from tests.nats_server import nats_server


async def test_a_stream_that_differs_is_updated_to_the_configuration(tmp_path):
    """LLM_REQUESTS left by another setup: other subjects, another limit, another window."""
    config = load_config(None, {"JETSERVE_SCHEDULER__REQUEST_LEVEL__MAX_PENDING_REQUESTS": "777"})
    async with nats_server(tmp_path) as nc:
        js = nc.jetstream()
        await js.add_stream(StreamConfig(name=REQUESTS_STREAM, subjects=["elsewhere.>"],
                                         retention=RetentionPolicy.WORK_QUEUE, max_msgs=5,
                                         duplicate_window=10))
        await ensure_streams(js, config)
        await ensure_streams(js, config)  # a second service: nothing left to change
        requests = (await js.stream_info(REQUESTS_STREAM)).config
        results = (await js.stream_info(RESULTS_STREAM)).config
    assert requests.subjects == ["llm.requests.>"]
    assert (requests.max_msgs, requests.duplicate_window) == (777, 120.0)
    assert results.subjects == ["llm.results.>"]


async def test_a_setting_jetstream_cannot_change_is_named(tmp_path):
    async with nats_server(tmp_path) as nc:
        js = nc.jetstream()
        await js.add_stream(StreamConfig(name=RESULTS_STREAM, subjects=["llm.results.>"],
                                         storage=StorageType.MEMORY))
        with pytest.raises(StreamMismatch) as error:
            await ensure_streams(js, load_config(None, {}))
    assert "stream LLM_RESULTS exists with storage 'memory', and jetserve needs 'file'" \
        in str(error.value)


async def test_jetstream_off_is_named(tmp_path):
    async with nats_server(tmp_path, jetstream=False) as nc:
        with pytest.raises(StreamMismatch, match="JetStream is not enabled on the NATS server"):
            await ensure_streams(nc.jetstream(), load_config(None, {}))
