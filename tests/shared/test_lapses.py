"""A holder of requests notices when it may have looked dead to admission, against a real
nats-server: cut off (the server killed and started again: it reconnects) or stalled (no
holding report for `stall_s`), it marks what it holds, so that an attempt admission may have
handed on meanwhile claims its answer first (tests/shared/test_outbox.py)."""

from __future__ import annotations

import asyncio
import subprocess
import time

from shared.bus import Lapses, connect
from shared.config import NatsSection
from shared.messages import WorkItem
from shared.protocol import GenerateRequest
from services.stack import free_port, nats_server_binary


def start_server(port: int) -> subprocess.Popen:
    return subprocess.Popen([nats_server_binary(), "-a", "127.0.0.1", "-p", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


async def test_a_holder_cut_off_or_stalled_marks_what_it_holds():
    port = free_port()
    server = start_server(port)
    held = [WorkItem(request=GenerateRequest(request_id=f"r{i}", prompt_token_ids=[1]),
                     tenant="acme", arrival_time=1.0) for i in range(3)]

    def mark() -> None:
        for item in held:
            item.lapsed = True

    nc = await connect(NatsSection(url=f"nats://127.0.0.1:{port}"), "holder")
    try:
        lapses = Lapses(nc, lease_s=2.0, on_lapse=mark)
        assert lapses.stall_s == 1.0
        for _ in range(3):  # reports on time: no lapse
            lapses.beat()
            await asyncio.sleep(0.1)
        assert not lapses.check() and lapses.count == 0
        assert not any(item.lapsed for item in held)

        server.kill()
        server.wait(10)
        for _ in range(100):  # until the client sees it is cut off
            if not nc.is_connected:
                break
            await asyncio.sleep(0.05)
        assert lapses.check() and all(item.lapsed for item in held)  # disconnected now
        assert not lapses.check()  # (counted once)
        server = start_server(port)
        for _ in range(200):
            if nc.is_connected:
                break
            await asyncio.sleep(0.05)
        assert nc.is_connected
        held.append(WorkItem(request=GenerateRequest(request_id="new", prompt_token_ids=[1]),
                             tenant="acme", arrival_time=2.0))
        assert lapses.check() and held[-1].lapsed  # reconnected since the last check
        lapses.beat()  # (reports resume)
        assert not lapses.check()

        held.append(WorkItem(request=GenerateRequest(request_id="after", prompt_token_ids=[1]),
                             tenant="acme", arrival_time=3.0))
        lapses.beat()
        assert not held[-1].lapsed
        time.sleep(1.2)  # the event loop stalled past stall_s: no report went out
        assert lapses.check() and held[-1].lapsed
        count = lapses.count
        lapses.beat()  # the gap was counted once
        assert lapses.count == count
        time.sleep(1.2)
        lapses.beat()  # a beat checks the gap before it too
        assert lapses.count == count + 1
    finally:
        await nc.close()
        server.kill()
        server.wait(10)
