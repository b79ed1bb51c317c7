"""A real nats-server for tests that need one and no services."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import time

import nats

from services.stack import free_port, nats_server_binary
from shared.bus import connect
from shared.config import NatsSection


@contextlib.asynccontextmanager
async def nats_server(directory, jetstream: bool = True, **settings):
    """A nats-server (JetStream enabled unless `jetstream` is False; `settings` in its config
    file) and a connection to it."""
    port = free_port()
    conf = directory / "nats-server.conf"
    conf.write_text("".join(f"{key}: {value}\n" for key, value in settings.items()))
    server = subprocess.Popen([nats_server_binary(), "-a", "127.0.0.1", "-p", str(port),
                               *(["-js", "-sd", str(directory)] if jetstream else []),
                               "-c", str(conf)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    nc = None
    try:
        for _ in range(100):
            try:
                nc = await nats.connect(f"nats://127.0.0.1:{port}", connect_timeout=1,
                                        allow_reconnect=False)
                break
            except Exception:
                await asyncio.sleep(0.1)
        yield nc
    finally:
        if nc is not None:
            await nc.close()
        server.terminate()
        server.wait(10)


def freeze(server: subprocess.Popen) -> None:
    """SIGSTOP `server`, and wait until every thread of it has stopped: from then on it reads
    nothing (a frozen host), and what is written to it stays unread."""
    server.send_signal(signal.SIGSTOP)
    for _ in range(500):
        tasks = f"/proc/{server.pid}/task"
        states = []
        for task in os.listdir(tasks):
            with contextlib.suppress(OSError):
                with open(f"{tasks}/{task}/stat") as stat:
                    states.append(stat.read().rsplit(")", 1)[1].split()[0])
        if states and all(state in "Tt" for state in states):
            return
        time.sleep(0.01)
    raise RuntimeError(f"nats-server {server.pid} did not stop")


async def services_connection(ports: list[int]):
    """As a service connects (its pings), to the first of `ports`."""
    section = NatsSection(url=",".join(f"nats://127.0.0.1:{p}" for p in ports))
    for _ in range(50):
        nc = await connect(section, "test")
        if nc.connected_url.port == ports[0]:
            return nc
        await nc.close()
    raise RuntimeError(f"never connected to {ports[0]}")
