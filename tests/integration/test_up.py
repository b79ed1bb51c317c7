"""`jetserve up` as a user runs it: ready line, requests, status, and a clean stop on SIGTERM."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import urllib.request
from pathlib import Path

import pytest

from services.stack import free_port
from tests.integration.test_cli_smollm2 import jetserve_command


def processes_using(nats_url: str) -> list[int]:
    """Live processes started for this stack (their environment names its NATS URL)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                environ = (entry / "environ").read_bytes()
            except OSError:
                continue
            if f"JETSERVE_NATS__URL={nats_url}".encode() in environ.split(b"\0"):
                found.append(int(entry.name))
    return found


async def run(*args: str) -> tuple[int, str, str]:
    process = await asyncio.create_subprocess_exec(
        *jetserve_command(), *args, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    stdout, stderr = await asyncio.wait_for(process.communicate(), 60)
    return process.returncode, stdout.decode(), stderr.decode()


def post(url: str, body: dict) -> dict:
    request = urllib.request.Request(url, data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=30) as response:
        return json.loads(response.read())


@pytest.mark.asyncio
async def test_up_serves_until_sigterm(tmp_path):
    port, http_port = free_port(), free_port()
    url = f"nats://127.0.0.1:{port}"
    env = {**{k: v for k, v in os.environ.items()
              if k not in ("JETSERVE_MODEL__NUM_THREADS", "OMP_NUM_THREADS")},
           "JETSERVE_KV_CACHE__NUM_BLOCKS": "256"}
    up = await asyncio.create_subprocess_exec(
        *jetserve_command(), "up", "--nats-port", str(port), "--state-dir", str(tmp_path),
        "--model", "dummy:tiny", "--executors", "2", "--http-port", str(http_port), env=env,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT)
    lines = []
    try:
        while True:
            line = (await asyncio.wait_for(up.stdout.readline(), 120)).decode()
            assert line, "jetserve up exited:\n" + "".join(lines)
            lines.append(line)
            if line.startswith("jetserve ready"):
                break
        assert url in line
        assert f"OpenAI-compatible API at http://127.0.0.1:{http_port}/v1" in "".join(lines)
        code, out, err = await run("generate", "--nats-url", url, "--raw", "--max-tokens", "5",
                                   "Hello")
        assert code == 0 and out.strip(), err
        answer = await asyncio.to_thread(post, f"http://127.0.0.1:{http_port}/v1/completions",
                                         {"model": "dummy:tiny", "prompt": "Hello",
                                          "max_tokens": 5})
        assert answer["usage"]["completion_tokens"] == 5, answer
        code, out, err = await run("status", "--nats-url", url)
        assert code == 0, err
        for name in ("admission", "priority", "batcher", "gateway", "executor-0", "executor-1",
                     "queue_depth=0", "kv usage"):
            assert name in out, out
        # nats-server, four services, two executors
        assert len(processes_using(url)) == 7
        # Two executors on one host split its cores rather than each spinning on all of them.
        share = f"JETSERVE_MODEL__NUM_THREADS={max(1, len(os.sched_getaffinity(0)) // 2)}"
        threads = [share.encode() in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
                   for pid in processes_using(url)
                   if b"services.executor" in Path(f"/proc/{pid}/cmdline").read_bytes()]
        assert threads == [True, True], threads
        await asyncio.sleep(3.0)  # idle, as a newcomer's `make up` mostly is
    finally:
        if up.returncode is None:
            up.send_signal(signal.SIGTERM)
        rest = await asyncio.wait_for(up.stdout.read(), 60)
        await asyncio.wait_for(up.wait(), 60)
    assert up.returncode == 0, rest.decode()[-2000:]
    assert "jetserve: stopped" in rest.decode()
    assert processes_using(url) == []
    # Serving, idling and stopping are normal: none of it is a warning or an error.
    logged = "".join(lines) + rest.decode()
    unusual = [line for line in logged.splitlines()
               if any(level in line.lower() for level in ('"level": "warning"', '"level": "error"',
                                                           "[wrn]", "[err]"))]
    assert unusual == [], unusual


@pytest.mark.asyncio
async def test_up_sigkilled_leaves_no_process_behind(tmp_path):
    """`jetserve up` killed outright (SIGKILL: no handler runs) still leaves nothing running:
    its services and its nats-server are told to stop when it dies, and do."""
    port = free_port()
    url = f"nats://127.0.0.1:{port}"
    env = {**os.environ, "JETSERVE_KV_CACHE__NUM_BLOCKS": "256"}
    up = await asyncio.create_subprocess_exec(
        *jetserve_command(), "up", "--nats-port", str(port), "--state-dir", str(tmp_path),
        "--model", "dummy:tiny", "--http-port", str(free_port()), env=env,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT)
    try:
        while True:
            line = (await asyncio.wait_for(up.stdout.readline(), 120)).decode()
            assert line, "jetserve up exited"
            if line.startswith("jetserve ready"):
                break
        assert len(processes_using(url)) == 6  # nats-server, four services, an executor
    finally:
        up.kill()
        for _ in range(300):
            if not processes_using(url):
                break
            await asyncio.sleep(0.1)
        left = processes_using(url)
        for pid in left:  # (only when the test fails: not to leave them running either)
            os.kill(pid, signal.SIGKILL)
        # Its children held its stdout: the pipe closes once they are gone. Read it to its end,
        # not only wait for the exit (on Python 3.11 that returns with the pipe still open), and
        # also when the test fails: a pipe left open when the test's loop closes raises from its
        # finalizer later, in whichever test the garbage collector happens to run (once inside
        # ast.parse, which it broke).
        await asyncio.wait_for(up.communicate(), 30)
    assert left == []
