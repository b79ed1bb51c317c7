"""How long each service takes to start: from spawning `python -m services.<name>` to its first
answer on `$SRV.PING.<name>`, against a nats-server of its own, a few times each.

    python -m loadtest.startup [--repeat 3] [--services admission priority batcher executor]
        [--model dummy:tiny] [--result-json results/startup.json]

Also reports whether the service imported torch (from the module's own import, in a separate
interpreter). Run it on a quiet machine: start-up is mostly imports and disk.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import nats

from loadtest.metrics import write_result
from services.stack import free_port, nats_server_binary
from shared.bus import discover
from shared.config import env_overrides

START_TIMEOUT_S = 300.0  # a first start may convert the model


async def time_to_ping(service: str, url: str, env: dict[str, str]) -> float:
    nc = await nats.connect(url)
    try:
        start = time.perf_counter()
        process = subprocess.Popen([sys.executable, "-m", f"services.{service}"], env=env,
                                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            while not await discover(nc, "PING", service, wait_s=0.02):
                if process.poll() is not None:
                    raise SystemExit(f"{service} exited with {process.returncode}")
                if time.perf_counter() - start > START_TIMEOUT_S:
                    raise SystemExit(f"{service} did not answer within {START_TIMEOUT_S:.0f} s")
            return time.perf_counter() - start
        finally:
            process.terminate()
            process.wait(timeout=30)
    finally:
        await nc.close()


def imports_torch(service: str) -> bool:
    probe = f"import sys, services.{service}.service; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    return out.stdout.strip() == "True"


async def main_async(args) -> dict:
    import os

    port = free_port()
    with tempfile.TemporaryDirectory() as state:
        server = subprocess.Popen([nats_server_binary(), "-a", "127.0.0.1", "-p", str(port),
                                   "-js", "-sd", state], stdout=subprocess.DEVNULL,
                                  stderr=subprocess.DEVNULL)
        try:
            await asyncio.sleep(0.5)
            url = f"nats://127.0.0.1:{port}"
            env = {**os.environ, **env_overrides({"nats.url": url, "model.name": args.model})}
            results = {}
            for service in args.services:
                times = [await time_to_ping(service, url, env) for _ in range(args.repeat)]
                results[service] = {"seconds": times, "median_s": statistics.median(times),
                                    "imports_torch": imports_torch(service)}
                print(f"{service:<10} median {results[service]['median_s']:.2f} s "
                      f"(runs: {', '.join(f'{t:.2f}' for t in times)}), "
                      f"torch imported: {results[service]['imports_torch']}")
            return results
        finally:
            server.terminate()
            server.wait(timeout=10)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m loadtest.startup")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--services", nargs="+",
                        default=["admission", "priority", "batcher", "executor"])
    parser.add_argument("--model", default="dummy:tiny", help="the executor's and admission's")
    parser.add_argument("--result-json", type=Path)
    args = parser.parse_args(argv)
    results = asyncio.run(main_async(args))
    if args.result_json:
        write_result(args.result_json, "startup", **results)


if __name__ == "__main__":
    main()
