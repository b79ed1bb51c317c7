"""Single-stream latency with the CPU engine's weights and KV cache in huge pages and without
(`model.huge_pages`), each run in a process of its own, the two alternating (on first, then off
first): on a cloud VM one process's memory can be a fifth slower than the next one's for its
whole life, so a comparison within one process, or of one process each, says little.

Each process loads the engine (its time reported: the weights packed and placed, the KV cache
allocated) and runs engine_bench's single stream (the three chat prompts alone, 256 tokens
each, greedy), reporting the medians of its TTFT and TPOT; the table gives each setting's median
over its processes, and the range.

    python -m loadtest.huge_pages_ab --pairs 5 --variants bf16 fp32 int8
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

from loadtest.metrics import write_result

VARIANTS = {  # name -> settings over the shipped defaults
    "default": {},
    "bf16": {"model.dtype": "bfloat16"},
    "fp32": {"model.dtype": "float32"},
    "int8": {"model.dtype": "float32", "model.quantization": "int8"},
}

ONE_RUN = """
import json, sys
from loadtest.engine_bench import run_engine
from shared.config import engine_config
settings = json.loads(sys.argv[1])
result = run_engine(engine_config(settings), {}, single_stream=True)
print(json.dumps({"load_s": result["load_s"], "ttft_ms": result["single_stream"]["ttft_ms"],
                  "tpot_ms": result["single_stream"]["tpot_ms"]}))
"""
ROOT = Path(__file__).resolve().parents[1]


def one_run(settings: dict) -> dict:
    done = subprocess.run([sys.executable, "-c", ONE_RUN, json.dumps(settings)], cwd=ROOT,
                          capture_output=True, text=True, timeout=900)
    if done.returncode != 0:
        raise SystemExit(f"a run with {settings} exited {done.returncode}:\n"
                         f"{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pairs", type=int, default=5)
    parser.add_argument("--variants", nargs="+", default=["default"], choices=sorted(VARIANTS))
    parser.add_argument("--model", default=None, help="model.name (default: the shipped one)")
    parser.add_argument("--result-json", default="results/huge_pages_ab.json")
    args = parser.parse_args(argv)
    runs: dict[str, dict[bool, list[dict]]] = {v: {True: [], False: []} for v in args.variants}
    for pair in range(args.pairs):
        for variant in args.variants:
            for on in ((True, False) if pair % 2 == 0 else (False, True)):
                settings = {**VARIANTS[variant], "kv_cache.enable_prefix_caching": False,
                            "model.huge_pages": on,
                            **({"model.name": args.model} if args.model else {})}
                run = one_run(settings)
                runs[variant][on].append(run)
                print(f"  pair {pair + 1} {variant:<8} huge pages {'on ' if on else 'off'} "
                      f"load {run['load_s']:5.2f} s  TTFT {run['ttft_ms']:6.1f} ms  "
                      f"TPOT {run['tpot_ms']:5.2f} ms", flush=True)
    print(f"\nsingle stream, medians over {args.pairs} processes each (range)")
    print(f"{'variant':<10}{'huge pages':<12}{'load s':>22}{'TTFT ms':>22}{'TPOT ms':>22}")
    summary = {}
    for variant, by_setting in runs.items():
        for on, results in by_setting.items():
            row = {}
            for metric in ("load_s", "ttft_ms", "tpot_ms"):
                values = [r[metric] for r in results]
                row[metric] = {"median": statistics.median(values), "min": min(values),
                               "max": max(values)}
            summary[f"{variant}_{'on' if on else 'off'}"] = row
            print(f"{variant:<10}{'on' if on else 'off':<12}"
                  + "".join(f"{row[m]['median']:>9.1f} ({row[m]['min']:.1f}-{row[m]['max']:.1f})"
                            .rjust(22) for m in ("load_s", "ttft_ms", "tpot_ms")))
    write_result(args.result_json, "huge_pages_ab", pairs=args.pairs, summary=summary,
                 runs={v: {("on" if on else "off"): r for on, r in by.items()}
                       for v, by in runs.items()})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
