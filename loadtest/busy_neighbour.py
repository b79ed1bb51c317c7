"""The CPU engine beside a busy neighbour: a process that is always runnable (a Python busy
loop, as a benchmark client that paces in a busy loop, a build or another tenant's job would
be), with `model.adaptive_threads` on (the default: one torch thread fewer for each core other
processes keep busy) and off (every thread, whatever else runs).

Each setting runs in a process of its own, the two alternating (on first, then off first). Each
process loads the engine, runs the three chat prompts alone (`--tokens` each, greedy) and
`--requests` of them at once, then starts the neighbour, waits `--settle-s`, and runs the same
again. It reports the single stream's median TTFT and TPOT, the batch's output tok/s, and the
thread count the engine ended with beside the neighbour.

    python -m loadtest.busy_neighbour --pairs 2
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import yaml

from loadtest.metrics import child_result, write_result

ROOT = Path(__file__).resolve().parents[1]
SETTINGS = {"on": {"model.adaptive_threads": True}, "off": {"model.adaptive_threads": False}}
METRICS = [("ttft_ms", "TTFT ms"), ("tpot_ms", "TPOT ms"), ("tok_s", "tok/s")]


async def _phase(engine, tokens: int, requests: int) -> dict:
    from loadtest.engine_bench import CHAT_PROMPTS
    from loadtest.quant_quality import completions
    from shared.protocol import ChatMessage, GenerateRequest

    def request(prompt: str) -> GenerateRequest:
        return GenerateRequest(messages=[ChatMessage("user", prompt)], temperature=0.0,
                               max_tokens=tokens, ignore_eos=True)

    alone = [(await completions(engine, [request(p)]))[0] for p in CHAT_PROMPTS]
    start = time.perf_counter()
    batch = await completions(engine, [request(CHAT_PROMPTS[i % len(CHAT_PROMPTS)])
                                       for i in range(requests)])
    elapsed = time.perf_counter() - start
    return {"ttft_ms": statistics.median(c.metrics.ttft_ms for c in alone),
            "tpot_ms": statistics.median(c.metrics.tpot_ms for c in alone),
            "tok_s": sum(len(c.token_ids) for c in batch) / elapsed}


async def measure(settings: dict, tokens: int, requests: int, settle_s: float) -> dict:
    """One process's run: alone, then beside the neighbour."""
    from services.executor.engine.llm_engine import Engine
    from shared.config import engine_config

    async with Engine(engine_config(settings)) as engine:
        run = {"alone": await _phase(engine, tokens, requests)}
        neighbour = subprocess.Popen([sys.executable, "-c", "while True: pass"])
        try:
            await asyncio.sleep(settle_s)
            run["neighbour"] = await _phase(engine, tokens, requests)
            run["threads_beside_neighbour"] = engine.torch_threads
        finally:
            neighbour.kill()
            neighbour.wait(10)
    return run


def one_run(settings: dict, tokens: int, requests: int, settle_s: float) -> dict:
    return child_result([sys.executable, "-m", "loadtest.busy_neighbour", "--one",
                         json.dumps(settings), "--tokens", str(tokens), "--requests",
                         str(requests), "--settle-s", str(settle_s)], str(settings), ROOT, 1800)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pairs", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=32, help="output tokens a request")
    parser.add_argument("--requests", type=int, default=8, help="requests at once")
    parser.add_argument("--settle-s", type=float, default=3.0,
                        help="seconds between starting the neighbour and measuring")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="a setting over the shipped defaults for both (e.g. "
                        "model.dtype=float32)")
    parser.add_argument("--one", help=argparse.SUPPRESS)  # a child process's settings
    parser.add_argument("--result-json", default="results/busy_neighbour.json")
    args = parser.parse_args(argv)
    if args.one is not None:
        print(json.dumps(asyncio.run(measure(json.loads(args.one), args.tokens, args.requests,
                                             args.settle_s))))
        return 0
    base = {key: yaml.safe_load(value)  # typed as YAML types them, as the config file's are
            for key, value in (item.split("=", 1) for item in args.set)}
    runs = {arm: [] for arm in SETTINGS}
    for pair in range(args.pairs):
        order = list(SETTINGS)[pair % 2:] + list(SETTINGS)[:pair % 2]
        for arm in order:
            run = one_run({**base, **SETTINGS[arm]}, args.tokens, args.requests, args.settle_s)
            runs[arm].append(run)
            print(f"  pair {pair + 1} adaptive threads {arm:<4}"
                  + "".join(f"  {phase}: " + " ".join(f"{label} {run[phase][m]:.1f}"
                                                      for m, label in METRICS)
                            for phase in ("alone", "neighbour"))
                  + f"  threads beside it {run['threads_beside_neighbour']}", flush=True)
    print(f"\nmedians over {args.pairs} processes each (range); {args.tokens} tokens a request, "
          f"{args.requests} at once for tok/s")
    summary = {}
    for arm, results in runs.items():
        row = {}
        for phase in ("alone", "neighbour"):
            for m, label in METRICS:
                values = [r[phase][m] for r in results]
                row[f"{phase}_{m}"] = {"median": statistics.median(values),
                                       "min": min(values), "max": max(values)}
        summary[arm] = row
        print(f"adaptive threads {arm:<4}" + "".join(
            f"  {key} {v['median']:.1f} ({v['min']:.1f}-{v['max']:.1f})"
            for key, v in row.items()))
    write_result(args.result_json, "busy_neighbour", pairs=args.pairs, tokens=args.tokens,
                 requests=args.requests, settle_s=args.settle_s, settings=base,
                 summary=summary, runs=runs)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
