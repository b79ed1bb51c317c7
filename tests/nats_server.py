"""A real nats-server for tests that need one and no services."""

from __future__ import annotations

import asyncio
import contextlib
import subprocess

import nats

from services.stack import free_port, nats_server_binary


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
