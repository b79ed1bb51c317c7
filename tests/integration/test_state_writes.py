"""A request's state is written to LLM_STATE even when the stream refuses writes for a while
when it arrives (in a cluster: a stream electing its leader, as when the cluster has just
started or a node died): admission tries again while it still watches the request. A run of
the cluster chaos benchmark lost 35 generates this way: their states were refused at the
start, and when their admission and then their holders died, nobody could hand them on."""

from __future__ import annotations

import asyncio

import msgspec
import pytest

from shared.client import JetserveClient
from shared.keys import RequestKey
from shared.protocol import GenerateRequest
from shared.request_state import STATE_STREAM, RequestStates
from tests.integration.conftest import running_stack

pytestmark = pytest.mark.asyncio


async def test_a_state_refused_at_first_is_written_once_the_stream_takes_it(tmp_path):
    settings = {"model.name": "sim:smollm2-cpu"}
    async with running_stack(tmp_path, settings=settings) as stack:
        async with await JetserveClient.connect(stack.url, tenant="acme") as client:
            js = client.js
            config = (await js.stream_info(STATE_STREAM)).config
            config.max_msg_size = 8  # every state write refused
            await js.update_stream(config)
            inbox = client.nc.new_inbox()
            answers = await client.nc.subscribe(inbox)
            await client.nc.publish(client.subjects.generate("acme"), msgspec.json.encode(
                GenerateRequest(request_id="kept", prompt="a long one", max_tokens=80,
                                ignore_eos=True, stream=True)), reply=inbox)
            await answers.next_msg(timeout=10)  # running
            await answers.unsubscribe()  # (the rest is not read: not to be drained)
            states = RequestStates(client.nc, js, client.subjects, "reader")
            assert await states.read(RequestKey("acme", "kept"), durable=False) is None
            await asyncio.sleep(1.0)
            config.max_msg_size = -1
            await js.update_stream(config)
            for _ in range(50):
                taken = await states.read(RequestKey("acme", "kept"), durable=False)
                if taken is not None:
                    break
                await asyncio.sleep(0.1)
    assert taken is not None and taken.state.request_id == "kept", taken
