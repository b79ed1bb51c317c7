"""A service that cannot start says why and exits: no NATS server within `nats.connect_wait_s`,
or a server without JetStream."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time

from services.stack import free_port, nats_server_binary
from shared.config import env_overrides


async def run_service(name: str, settings: dict, timeout: float = 60) -> tuple[int, str, float]:
    env = {**os.environ, **env_overrides({"model.name": "dummy:tiny",
                                          f"monitoring.metrics_port.{name}": 0, **settings})}
    start = time.monotonic()
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", f"services.{name}", env=env, stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT)
    output, _ = await asyncio.wait_for(process.communicate(), timeout)
    return process.returncode, output.decode(), time.monotonic() - start


async def test_no_nats_server_is_a_clear_error_after_the_connect_wait():
    url = f"nats://127.0.0.1:{free_port()}"  # nothing listens there
    code, output, took = await run_service("priority", {"nats.url": url,
                                                        "nats.connect_wait_s": 2})
    assert code != 0 and took < 30, (code, took)
    assert f"priority: no NATS server answered at {url} within nats.connect_wait_s (2 s)" \
        in output, output[-2000:]
    assert '"warning"' not in output  # the retries while waiting are not warnings


async def test_jetstream_off_is_a_clear_error(tmp_path):
    port = free_port()
    server = subprocess.Popen([nats_server_binary(), "-a", "127.0.0.1", "-p", str(port)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        code, output, _ = await run_service("admission", {"nats.url": f"nats://127.0.0.1:{port}"})
    finally:
        server.terminate()
        server.wait(10)
    assert code != 0
    assert "admission: JetStream is not enabled on the NATS server" in output, output[-2000:]
    assert "Traceback" not in output
