"""Single-stream latency with the CPU engine's weights in huge pages and without
(`model.huge_pages`; with --kv-cache, its KV cache too: `kv_cache.huge_pages`), each run in a
process of its own, the two alternating (on first, then off first): on a cloud VM one process's memory can be a fifth slower than the next one's for its
whole life, so a comparison within one process, or of one process each, says little.

Each process loads the engine (its time reported: the weights packed and placed, the KV cache
allocated) and runs engine_bench's single stream (the three chat prompts alone, 256 tokens
each, greedy), with --long-prompts one prompt of each length alone (16 tokens out: decode
over a long context reads far more KV), and with --requests engine_bench's workload of that
many requests at once, reporting the medians of its TTFT and TPOT and its output tok/s; the
table gives each setting's median over its processes, and the range.

    python -m loadtest.huge_pages_ab --pairs 5 --variants bf16 fp32 int8
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

from loadtest.metrics import child_result, write_result

VARIANTS = {  # name -> settings over the shipped defaults
    "default": {},
    "bf16": {"model.dtype": "bfloat16"},
    "fp32": {"model.dtype": "float32"},
    "int8": {"model.dtype": "float32", "model.quantization": "int8"},
}

ONE_RUN = """
import json, statistics, sys
from loadtest.datasets import engine_workload
from loadtest.engine_bench import run_engine
from shared.config import engine_config
from shared.model_files import load_model_config
settings, long_lengths, counts = (json.loads(arg) for arg in sys.argv[1:4])
config = engine_config(settings)
vocab = load_model_config(config.model.name)[0].vocab_size
points = {n: engine_workload(n, 0, vocab) for n in counts}
result = run_engine(config, points, single_stream=True, long_lengths=long_lengths)
run = {"load_s": result["load_s"], "ttft_ms": result["single_stream"]["ttft_ms"],
       "tpot_ms": result["single_stream"]["tpot_ms"]}
if long_lengths:
    for metric in ("ttft_ms", "tpot_ms"):
        run["long_" + metric] = statistics.median(r[metric] for r in result["long_prompts"])
for n, point in result["points"].items():
    run[f"tok_s_{n}"] = point["output_tok_per_s"]
print(json.dumps(run))
"""
ROOT = Path(__file__).resolve().parents[1]


def one_run(settings: dict, long_lengths: list[int] = (), counts: list[int] = ()) -> dict:
    return child_result([sys.executable, "-c", ONE_RUN, json.dumps(settings),
                         json.dumps(list(long_lengths)), json.dumps(list(counts))],
                        str(settings), ROOT, 900)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pairs", type=int, default=5)
    parser.add_argument("--variants", nargs="+", default=["default"], choices=sorted(VARIANTS))
    parser.add_argument("--model", default=None, help="model.name (default: the shipped one)")
    parser.add_argument("--kv-cache", action="store_true",
                        help="a third setting: the weights and the KV cache in huge pages")
    parser.add_argument("--long-prompts", nargs="*", type=int, default=[],
                        help="also one prompt of each length alone (e.g. 4096 4096 4096)")
    parser.add_argument("--requests", nargs="*", type=int, default=[],
                        help="also engine_bench's workload of each many requests at once: "
                        "output tok/s (e.g. 64 128)")
    parser.add_argument("--result-json", default="results/huge_pages_ab.json")
    args = parser.parse_args(argv)
    arms = {"on": {"model.huge_pages": True}, "off": {"model.huge_pages": False}}
    if args.kv_cache:
        arms["on+kv"] = {"model.huge_pages": True, "kv_cache.huge_pages": True}
    metrics = ["load_s", "ttft_ms", "tpot_ms"] + (
        ["long_ttft_ms", "long_tpot_ms"] if args.long_prompts else []) + [
        f"tok_s_{n}" for n in args.requests]
    runs = {v: {arm: [] for arm in arms} for v in args.variants}
    for pair in range(args.pairs):
        for variant in args.variants:
            order = list(arms)[pair % len(arms):] + list(arms)[:pair % len(arms)]
            for arm in order:  # each setting first in turn
                settings = {**VARIANTS[variant], "kv_cache.enable_prefix_caching": False,
                            **arms[arm], **({"model.name": args.model} if args.model else {})}
                run = one_run(settings, args.long_prompts, args.requests)
                runs[variant][arm].append(run)
                print(f"  pair {pair + 1} {variant:<8} huge pages {arm:<6} "
                      + "  ".join(f"{m} {run[m]:.2f}" for m in metrics), flush=True)
    print(f"\nmedians over {args.pairs} processes each (range)")
    print(f"{'variant':<10}{'huge pages':<12}" + "".join(f"{m:>22}" for m in metrics))
    summary = {}
    for variant, by_setting in runs.items():
        for arm, results in by_setting.items():
            row = {}
            for metric in metrics:
                values = [r[metric] for r in results]
                row[metric] = {"median": statistics.median(values), "min": min(values),
                               "max": max(values)}
            summary[f"{variant}_{arm}"] = row
            print(f"{variant:<10}{arm:<12}"
                  + "".join(f"{row[m]['median']:>9.1f} ({row[m]['min']:.1f}-{row[m]['max']:.1f})"
                            .rjust(22) for m in metrics))
    write_result(args.result_json, "huge_pages_ab", pairs=args.pairs, summary=summary,
                 long_prompts=args.long_prompts, requests=args.requests, runs=runs)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
