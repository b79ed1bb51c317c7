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
        code, output, took = await run_service("admission",
                                               {"nats.url": f"nats://127.0.0.1:{port}"})
    finally:
        server.terminate()
        server.wait(10)
    assert code != 0 and took < 20, (code, took)  # not after nats.connect_wait_s (30 s)
    assert "admission: JetStream is not enabled on the NATS server" in output, output[-2000:]
    assert "Traceback" not in output


async def test_refused_credentials_are_a_clear_error_at_once():
    port = free_port()
    server = subprocess.Popen([nats_server_binary(), "-a", "127.0.0.1", "-p", str(port),
                               "--auth", "the-right-token"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        time.sleep(0.3)
        code, output, took = await run_service(
            "batcher", {"nats.url": f"nats://wrong-token@127.0.0.1:{port}",
                        "nats.connect_wait_s": 30})
    finally:
        server.terminate()
        server.wait(10)
    assert code != 0 and took < 20, (code, took)  # not after the 30 s connect wait
    assert "refused this connection's credentials" in output, output[-2000:]
    assert "Authorization Violation" in output
    assert "wrong-token" not in output  # credentials stay out of the logs
    assert "Traceback" not in output


async def test_sigterm_while_the_model_loads_stops_at_once(tmp_path):
    """The model loads on a thread: a SIGTERM meanwhile is heard, and the executor (holding
    nothing yet) exits at once instead of loading, starting, then draining."""
    port = free_port()
    server = subprocess.Popen([nats_server_binary(), "-a", "127.0.0.1", "-p", str(port), "-js",
                               "-sd", str(tmp_path)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    env = {**os.environ, **env_overrides({"monitoring.metrics_port.executor": 0,
                                          "nats.url": f"nats://127.0.0.1:{port}"})}
    try:
        process = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "services.executor", env=env, stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT)
        output = b""
        while b'"starting"' not in output:  # connected; the model (SmolLM2) loads next
            line = await asyncio.wait_for(process.stdout.readline(), 60)
            assert line, output.decode()[-2000:]
            output += line
        process.terminate()
        told = time.monotonic()
        rest, _ = await asyncio.wait_for(process.communicate(), 60)
        took = time.monotonic() - told
    finally:
        server.terminate()
        server.wait(10)
    output = (output + rest).decode()
    assert process.returncode == 0 and took < 5, (process.returncode, took, output[-2000:])
    assert "stopped while loading the model" in output and '"serving"' not in output
