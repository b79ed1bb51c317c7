"""What a NATS node's death costs the answers written to it, and what the echoes that catch
those losses cost (shared/bus.py Echoes).

    python -m loadtest.echoes --kills 10 --result-json results/echoes.json

Loss: two clustered nats-servers; a subscriber on the second; a publisher on the first (then
on the second, after its reconnect) sends one numbered message a millisecond, each in a task of
its own as an executor's answers go; the first node is SIGKILLed mid-stream. `plain` publishes
each message once, as core NATS does; `echoed` waits for each one's echo and publishes it
again when the connection that carried it was lost first, as `Outbox.final` does. Per kill:
messages published, lost (never received), received twice.

Cost: one nats-server, one process publishing messages at a fixed rate, each in a task (one
at a time, then `--burst` at a time, as an engine step's answers come); that process's CPU
time with and without an echo awaited for each message, and the echoes sent
(one out at a time, shared by the messages published meanwhile; `--every-s` spaces them,
ECHO_EVERY_S, 0 as shipped).
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import subprocess
import tempfile
import time

import nats

from loadtest.metrics import write_result
from services.stack import CLUSTER_PORT_OFFSET, free_port, nats_server_binary
import shared.bus
from shared.bus import Echoes, cut_off


def clustered_pair(port: int, name: str = "e") -> list[subprocess.Popen]:
    """Two clustered nats-servers, taking clients on `port` and `port` + 1 (`free_port(2)`)."""
    routes = ",".join(f"nats://127.0.0.1:{port + CLUSTER_PORT_OFFSET + i}" for i in range(2))
    return [subprocess.Popen(
        [nats_server_binary(), "-a", "127.0.0.1", "-p", str(port + i), "--cluster_name", name,
         "--cluster", f"nats://127.0.0.1:{port + CLUSTER_PORT_OFFSET + i}", "--routes", routes],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) for i in range(2)]


async def connect_to(ports: list[int]):
    """A connection to the first of `ports` that answers, failing over in their order (and
    telling Echoes when its old socket closed, as a service's connection does)."""
    for _ in range(100):
        nc = nats.NATS()

        async def closed(nc=nc) -> None:
            cut_off(nc)

        try:
            await nc.connect([f"nats://127.0.0.1:{p}" for p in ports], dont_randomize=True,
                             connect_timeout=1, reconnect_time_wait=0.05,
                             max_reconnect_attempts=-1, disconnected_cb=closed)
            return nc
        except Exception:
            await asyncio.sleep(0.1)
    raise RuntimeError(f"no nats-server at {ports}")


async def one_kill(echoed: bool, kill_after_s: float, run_s: float) -> dict:
    port = free_port(nats_cluster=2)
    nodes = clustered_pair(port)
    try:
        subscriber = await connect_to([port + 1])
        publisher = await connect_to([port, port + 1])
        seen: dict[int, int] = {}

        async def received(msg) -> None:
            if msg.subject != "e.probe":
                n = int(msg.data)
                seen[n] = seen.get(n, 0) + 1

        await subscriber.subscribe("e.*", cb=received)
        probe = await subscriber.subscribe("e.probe.x")
        for _ in range(100):  # the subscriber's interest has reached the first node
            await publisher.publish("e.probe.x", b"")
            try:
                await probe.next_msg(timeout=0.05)
                break
            except nats.errors.TimeoutError:
                pass
        echoes = Echoes(publisher)

        async def send(n: int) -> None:
            while True:
                carrier = echoes.mark()
                await publisher.publish("e.m", str(n).encode())
                if not echoed or await echoes.landed(carrier):
                    return
                again.append(n)

        again: list[int] = []
        tasks, start, n = [], time.monotonic(), 0
        killed = False
        while time.monotonic() - start < run_s:
            if not killed and time.monotonic() - start >= kill_after_s:
                nodes[0].send_signal(signal.SIGKILL)
                killed = True
            tasks.append(asyncio.create_task(send(n)))
            n += 1
            await asyncio.sleep(0.001)
        await asyncio.gather(*tasks, return_exceptions=True)
        await asyncio.sleep(1.0)
        lost = [i for i in range(n) if i not in seen]
        twice = [i for i, count in seen.items() if count > 1]
        await publisher.close()
        await subscriber.close()
        return {"published": n, "lost": len(lost), "lost_ids": lost[:20],
                "received_twice": len(twice), "published_again": len(again)}
    finally:
        for node in nodes:
            node.kill()
            node.wait(10)


async def cost(rate: int, seconds: float, echoed: bool, burst: int = 1) -> dict:
    """`burst` messages published together each `burst / rate` s (an engine step's answers)."""
    with tempfile.TemporaryDirectory() as directory:
        port = free_port()
        server = subprocess.Popen([nats_server_binary(), "-a", "127.0.0.1", "-p", str(port)],
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                  cwd=directory)
        try:
            nc = await connect_to([port])
            echoes = Echoes(nc)
            payload = b"x" * 300

            async def send(n: int) -> None:
                carrier = echoes.mark()
                await nc.publish(f"e.{n}", payload)
                if echoed:
                    assert await echoes.landed(carrier)

            total = int(rate * seconds)
            tasks = []
            start, cpu = time.perf_counter(), time.process_time()
            for n in range(total):
                tasks.append(asyncio.create_task(send(n)))
                if (n + 1) % burst:
                    continue
                if (delay := start + (n + 1) / rate - time.perf_counter()) > 0:
                    await asyncio.sleep(delay)
            await asyncio.gather(*tasks)
            cpu, wall = time.process_time() - cpu, time.perf_counter() - start
            await nc.close()
            return {"rate": rate, "burst": burst, "echoed": echoed, "messages": total,
                    "cpu_core_fraction": round(cpu / wall, 4),
                    "cpu_us_per_message": round(1e6 * cpu / total, 1),
                    "echoes": next(echoes.ids)}
        finally:
            server.kill()
            server.wait(10)


async def run(args) -> dict:
    kills = []
    for i in range(args.kills):
        for echoed in (False, True):
            # (the kill lands at a different point of the stream each time)
            result = await one_kill(echoed, 1.0 + 0.013 * i, 2.5)
            kills.append({"echoed": echoed, **result})
            print(f"kill {i + 1:2d} {'echoed' if echoed else 'plain ':6s}: published "
                  f"{result['published']}, lost {result['lost']} {result['lost_ids'][:8]}, "
                  f"received twice {result['received_twice']}, published again "
                  f"{result['published_again']}", flush=True)
    costs = []
    for rate, burst in [(rate, 1) for rate in args.rates] + \
            [(rate, args.burst) for rate in args.rates if args.burst > 1]:
        for echoed in (False, True):
            result = await cost(rate, args.seconds, echoed, burst)
            costs.append(result)
            print(f"{rate:5d} msg/s, {burst:3d} at a time, {'echoed' if echoed else 'plain ':6s}: "
                  f"{100 * result['cpu_core_fraction']:5.1f} % of a core, "
                  f"{result['cpu_us_per_message']:6.1f} us a message, {result['echoes']} echoes",
                  flush=True)
    return {"kills": kills, "costs": costs,
            "lost": {mode: sum(k["lost"] for k in kills if k["echoed"] == (mode == "echoed"))
                     for mode in ("plain", "echoed")},
            "received_twice": {mode: sum(k["received_twice"] for k in kills
                                         if k["echoed"] == (mode == "echoed"))
                               for mode in ("plain", "echoed")},
            "echo_every_s": shared.bus.ECHO_EVERY_S}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kills", type=int, default=10, help="node kills, each mode")
    parser.add_argument("--rates", type=int, nargs="+", default=[200, 1000, 3000])
    parser.add_argument("--seconds", type=float, default=3.0, help="each cost point")
    parser.add_argument("--burst", type=int, default=16,
                        help="the rates again, this many messages at a time (an engine step's "
                             "answers; 1: none)")
    parser.add_argument("--every-s", type=float, help="ECHO_EVERY_S (a sweep of the knob; "
                        f"default: as shipped, {shared.bus.ECHO_EVERY_S})")
    parser.add_argument("--result-json", default="results/echoes.json")
    args = parser.parse_args(argv)
    if args.every_s is not None:
        shared.bus.ECHO_EVERY_S = args.every_s
    result = asyncio.run(run(args))
    print(f"lost over {args.kills} kills: plain {result['lost']['plain']}, echoed "
          f"{result['lost']['echoed']}; received twice: plain "
          f"{result['received_twice']['plain']}, echoed {result['received_twice']['echoed']}")
    write_result(args.result_json, "echoes", params=vars(args), summary=result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
