"""The streams jetserve keeps, against a real nats-server: created when absent, brought to the
configuration when they differ where JetStream allows it, and a clear error where it does not
(or where JetStream is off)."""

from __future__ import annotations

import time

import nats.errors
import pytest
from nats.js.api import RetentionPolicy, StorageType, StreamConfig
from nats.js.errors import ServiceUnavailableError

from shared.bus import (JETSTREAM_WAKE_S, StreamMismatch, ensure_streams,
                        no_jetstream_responder, while_electing)
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
    """Said after the few seconds a starting JetStream may take, not after nats.connect_wait_s
    (what a cluster electing its leader is given: its JetStream answers 503 itself)."""
    config = load_config(None, {})
    async with nats_server(tmp_path, jetstream=False) as nc:
        started = time.monotonic()
        with pytest.raises(StreamMismatch, match="JetStream is not enabled on the NATS server"):
            await ensure_streams(nc.jetstream(), config)
    took = time.monotonic() - started
    assert JETSTREAM_WAKE_S <= took < config.nats.connect_wait_s, took


def test_no_responders_is_told_from_a_jetstream_that_answers_503():
    assert no_jetstream_responder(nats.errors.NoRespondersError())
    assert no_jetstream_responder(ServiceUnavailableError())  # nats-py's no-responders
    assert not no_jetstream_responder(ServiceUnavailableError(
        code=503, err_code=10008, description="JetStream system temporarily unavailable"))
    assert not no_jetstream_responder(nats.errors.TimeoutError())


async def test_a_call_jetstream_does_not_answer_is_tried_again_for_its_wait(tmp_path):
    """`while_electing` (a service starting while a cluster elects its leaders): a call that
    finds no JetStream is tried again until its wait has passed, then its error is raised."""
    async with nats_server(tmp_path, jetstream=False) as nc:
        js = nc.jetstream()
        tries = 0

        async def call():
            nonlocal tries
            tries += 1
            return await js.stream_info(REQUESTS_STREAM)

        started = time.monotonic()
        with pytest.raises((nats.errors.NoRespondersError, ServiceUnavailableError)):
            await while_electing(call, wait_s=1.2)
    assert time.monotonic() - started >= 1.2 and tries >= 3, tries
