"""A real nats-server on a free port and the four services as processes, on the tiny model."""

from __future__ import annotations

import contextlib
from pathlib import Path

from services.stack import Stack, free_port

TINY_STACK = {"model.name": "dummy:tiny", "kv_cache.num_blocks": 512,
              "distributed.heartbeat_interval_s": 0.2, "distributed.drain_timeout_s": 5}


@contextlib.asynccontextmanager
async def running_stack(directory: Path, executors: int = 1, settings: dict | None = None,
                        env: dict[str, str] | None = None, timeout: float = 180.0):
    stack = Stack(state_dir=directory, nats_port=free_port(), executors=executors,
                  settings={**TINY_STACK, **(settings or {})}, log_dir=directory / "logs", env=env)
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
