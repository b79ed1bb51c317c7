"""How many requests per second the control plane (admission, priority, batcher, nats-server)
sustains on this machine, and which process saturates first.

One embedded stack with many simulated executors whose steps are short, so no executor is the
limit; `jetserve bench serve` runs at rising request rates against it, and each process's CPU use
over each run is read from /proc.

    python -m loadtest.control_plane --executors 8 --rates 50 100 200 400 \\
        --result-json results/control_plane.json

`--replicas 1 2` runs the sweep once with one process of each control-plane service and once
with two of each (`jetserve up --replicas 2`), one after the other in the same run set.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import time
from pathlib import Path

from loadtest import serve
from loadtest.metrics import write_result
from services.stack import temporary_stack

TICKS = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICKS  # utime + stime


def cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return "unknown"


def bench_args(rate: float, duration: float, model: str, executors: int) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    serve.add_arguments(parser)
    return parser.parse_args([
        "--model", model, "--executors", str(executors), "--request-rate", str(rate),
        "--duration", str(duration), "--input-len-range", "16", "32",
        "--output-len-range", "2", "4", "--no-progress", "--label", f"rate-{rate:g}"])


async def sweep(args, replicas: int = 1) -> list[dict]:
    rows = []
    async with temporary_stack("jetserve-cp-", executors=args.executors, replicas=replicas,
                               settings={"model.name": args.model}) as stack:
        pids = {name: p.pid for name, p in stack.processes.items()}
        pids["load generator (this process)"] = os.getpid()
        for rate in args.rates:
            before = {name: cpu_seconds(pid) for name, pid in pids.items()}
            start = time.perf_counter()
            result = await serve.run(bench_args(rate, args.duration, args.model,
                                                args.executors), stack.url)
            wall = time.perf_counter() - start
            used = {name: (cpu_seconds(pid) - before[name]) / wall for name, pid in pids.items()}
            executors = sum(v for k, v in used.items() if k.startswith("executor"))
            cpu = {k: round(v, 3) for k, v in used.items() if not k.startswith("executor")}
            cpu["executors (all)"] = round(executors, 3)
            s = result["summary"]
            rows.append({"replicas": replicas, "offered_rate": rate,
                         "completed_rate": s["request_throughput"],
                         "completed": s["completed"], "requests": s["requests"],
                         "failed": s["failed"], "ttft_p50_ms": s["ttft_ms"]["p50"],
                         "ttft_p99_ms": s["ttft_ms"]["p99"], "cpu_cores": cpu})
            print(f"replicas {replicas}, rate {rate:>6g}/s: completed {s['request_throughput']:.1f}/s, "
                  f"TTFT p50 {s['ttft_ms']['p50'] or 0:.0f} ms p99 "
                  f"{s['ttft_ms']['p99'] or 0:.0f} ms, cores "
                  + ", ".join(f"{k} {v:.2f}" for k, v in cpu.items()), flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m loadtest.control_plane", description=__doc__)
    parser.add_argument("--executors", type=int, default=8)
    parser.add_argument("--model", default="sim:llama3-8b-h100")
    parser.add_argument("--rates", type=float, nargs="+", default=[50, 100, 200, 400])
    parser.add_argument("--duration", type=float, default=20.0)
    parser.add_argument("--replicas", type=int, nargs="+", default=[1],
                        help="processes of each control-plane service, one sweep each")
    parser.add_argument("--result-json", type=Path)
    args = parser.parse_args(argv)
    rows = [row for replicas in args.replicas for row in asyncio.run(sweep(args, replicas))]
    if args.result_json:
        write_result(args.result_json, "control_plane", executors=args.executors,
                     model=args.model, cpu=cpu_model(), rows=rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
