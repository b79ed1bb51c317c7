"""A real nats-server on a free port and the four services as processes, on the tiny model."""

from __future__ import annotations

import asyncio
import contextlib
import math
import signal
from collections.abc import Awaitable, Callable
from pathlib import Path

import msgspec

from services.stack import Stack, free_port
from shared.protocol import Completion, GenerateRequest

TINY_STACK = {"model.name": "dummy:tiny", "kv_cache.num_blocks": 512,
              "distributed.heartbeat_interval_s": 0.2, "distributed.drain_timeout_s": 5,
              # Several stacks may run at once: metrics only where a test asks for them.
              **{f"monitoring.metrics_port.{kind}": 0
                 for kind in ("admission", "priority", "batcher", "executor")}}
# One executor that runs two sequences at a time and holds no queue of its own, so requests
# beyond two wait at priority (where order and cancels are decided).
SMALL_EXECUTOR = {"scheduler.batch_level.max_num_seqs": 2,
                  "scheduler.batch_level.executor_queue_depth": 0}


async def service_stats(client, name: str) -> dict:
    """The data of the `name` service's $SRV.STATS: one request to the one instance of it, in
    milliseconds (discovery gathers answers for 0.3 s, long enough for the tiny model to run a
    few hundred tokens)."""
    msg = await client.nc.request(f"$SRV.STATS.{name}", b"", timeout=2)
    return next(ep["data"] for ep in msgspec.json.decode(msg.data)["endpoints"] if ep.get("data"))


async def busy_executor(client, tries: int = 200, besides: str | None = None) -> str:
    """The name of the first executor (other than `besides`) the batcher hears running
    something."""
    for _ in range(tries):
        reply = await client.nc.request("llm.internal.batcher.executors", b"", timeout=2)
        busy = [n for n, e in msgspec.json.decode(reply.data).items()
                if e["running"] and n != besides]
        if busy:
            return busy[0]
        await asyncio.sleep(0.05)
    raise AssertionError("no executor ran anything")


async def wait_for_stat(client, name: str, key: str, value: int, timeout_s: float = 5) -> None:
    """Poll until the `name` service reports `key` == `value` (the tiny model runs 1,000 tokens
    in about half a second here: a test that slept instead would race it)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while (await service_stats(client, name))[key] != value:
        assert loop.time() < deadline, f"{name} never reported {key} == {value}"
        await asyncio.sleep(0.01)


async def finish_order_with_a_late_urgent_request(
        client, make: Callable[..., GenerateRequest],
        before_urgent: Callable[[], Awaitable[None]] | None = None) -> list[str]:
    """On SMALL_EXECUTOR: two slots busy (one ends before the other), four priority-1 requests
    wait, then one priority-9 request arrives. The ids in the order they finished."""
    finished: list[str] = []

    async def run(request: GenerateRequest):
        completion = await client.generate(request, timeout=120)
        assert isinstance(completion, Completion), completion
        finished.append(request.request_id)

    tasks = [asyncio.create_task(run(make("busy-a", 1400, priority=1))),
             asyncio.create_task(run(make("busy-b", 2000, priority=1)))]
    await wait_for_stat(client, "executor", "running", 2)
    for i in range(4):
        tasks.append(asyncio.create_task(run(make(f"low-{i}", 60, priority=1))))
    await wait_for_stat(client, "priority", "queue_depth", 4)
    if before_urgent is not None:
        await before_urgent()
    tasks.append(asyncio.create_task(run(make("urgent", 60, priority=9))))
    await asyncio.gather(*tasks)
    return finished


async def sigterm_services(stack: Stack, bound_s: float) -> dict[str, tuple[int | None, float]]:
    """SIGTERM every service of `stack` (not its nats-server) at once: each one's exit code
    (None: still running after `bound_s`) and how long it took to exit."""
    services = {n: p for n, p in stack.processes.items() if n != "nats-server"}
    loop = asyncio.get_running_loop()
    start = loop.time()
    took: dict[str, float] = {}

    async def wait(name, process):
        await process.wait()
        took[name] = loop.time() - start

    for process in services.values():
        process.send_signal(signal.SIGTERM)
    await asyncio.wait([asyncio.ensure_future(wait(n, p)) for n, p in services.items()],
                       timeout=bound_s)
    return {n: (p.returncode, round(took.get(n, math.inf), 2)) for n, p in services.items()}


@contextlib.asynccontextmanager
async def running_stack(directory: Path, executors: int = 1, settings: dict | None = None,
                        env: dict[str, str] | None = None, timeout: float = 180.0,
                        nats_settings: dict | None = None, auth: bool = False,
                        tls: bool = False, http_port: int | None = None, nats_cluster: int = 1,
                        replicas: int = 1):
    stack = Stack(state_dir=directory, nats_port=free_port(nats_cluster), executors=executors,
                  settings={**TINY_STACK, **(settings or {})}, log_dir=directory / "logs", env=env,
                  nats_settings=nats_settings, auth=auth, tls=tls, http_port=http_port,
                  nats_cluster=nats_cluster, replicas=replicas)
    try:
        await stack.start(timeout=timeout)
    except BaseException:
        _print_logs(directory / "logs")
        raise
    try:
        yield stack
    finally:
        await stack.stop()


def _print_logs(log_dir: Path) -> None:
    for log in sorted(log_dir.glob("*.log")):
        print(f"==> {log.name}\n" + "\n".join(log.read_text(errors="replace").splitlines()[-30:]))
