"""Echoes against a real nats-server: answers published together share an echo, a caller
cancelled while it waits leaves the others' echo alone, and a publish while the connection is
away is called landed only once an echo comes back on the connection that carried it."""

from __future__ import annotations

import asyncio
import subprocess

import pytest

import shared.bus
from services.stack import free_port, nats_server_binary
from shared.bus import Echoes, connect
from shared.config import NatsSection
from tests.nats_server import freeze, nats_server


@pytest.fixture
async def nc(tmp_path):
    async with nats_server(tmp_path, jetstream=False) as nc:
        yield nc


async def test_answers_published_together_share_one_echo(nc):
    echoes = Echoes(nc)
    inbox = await nc.subscribe("_INBOX.client.*")

    async def answer(i: int) -> bool:
        carrier = echoes.mark()
        await nc.publish(f"_INBOX.client.{i}", b"answer")
        return await echoes.landed(carrier)

    assert await asyncio.gather(*(answer(i) for i in range(200))) == [True] * 200
    received = 0
    while received < 200:
        await inbox.next_msg(timeout=2)
        received += 1
    # (published in one turn of the event loop, the 200 answers are out before the first
    # echo goes: one echo, or a few where the publishes yield to nats-py's flusher)
    assert 1 <= next(echoes.ids) <= 20
    assert not echoes.waiting and echoes.latest is None and echoes.forming is None


async def test_a_cancelled_caller_leaves_the_shared_echo_to_the_others(nc):
    echoes = Echoes(nc)
    carrier = echoes.mark()
    await nc.publish("_INBOX.client.a", b"answer")
    first = asyncio.create_task(echoes.landed(carrier))
    second = asyncio.create_task(echoes.landed(carrier))
    await asyncio.sleep(0)  # (both joined the echo forming)
    first.cancel()
    assert await asyncio.wait_for(second, 5) is True
    with pytest.raises(asyncio.CancelledError):
        await first


async def test_a_publish_while_away_lands_on_the_next_connection(tmp_path, monkeypatch):
    """The server restarts on its port: what was published while the connection was away goes
    out on the next one, and its echo after it; a publish before the loss, with its echo
    lost, is not called landed. Away longer than a live connection's give-up (here 0.2 s), the
    echo sent meanwhile is still waited for: that count starts once the connection is back."""
    port = free_port()

    def start():
        return subprocess.Popen([nats_server_binary(), "-a", "127.0.0.1", "-p", str(port)],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    server = start()
    nc = None
    try:
        nc = await connect(NatsSection(url=f"nats://127.0.0.1:{port}"), "test")  # (as a
        # service's: it records when the old socket closed, Echoes.mark)
        echoes = Echoes(nc)
        assert await echoes.landed(echoes.mark())  # (subscribed)
        freeze(server)  # nothing is read, no echo comes back
        before = echoes.mark()
        await nc.publish("_INBOX.client.before", b"answer")
        landing = asyncio.create_task(echoes.landed(before))
        await asyncio.sleep(0.3)
        server.kill()
        server.wait(10)
        for _ in range(100):  # the client has seen the loss, and closed the old socket
            if echoes.mark() == before + 1:
                break
            await asyncio.sleep(0.05)
        away = echoes.mark()
        assert not nc.is_connected and away == before + 1  # (goes out on the next connection)
        monkeypatch.setattr(shared.bus, "ECHO_GIVE_UP_S", 0.2)
        await nc.publish("_INBOX.client.away", b"answer")
        landing_away = asyncio.create_task(echoes.landed(away))
        await asyncio.sleep(0.5)  # (away past the give-up)
        server = start()
        assert await asyncio.wait_for(landing, 12) is False
        assert await asyncio.wait_for(landing_away, 12) is True
    finally:
        if nc is not None:
            await nc.close()
        server.kill()
        server.wait(10)
