"""What the NATS pipeline costs: one workload through the engine in-process and through the full
pipeline (admission, priority, batcher, one executor, embedded nats-server), in one run.

Two measurements per path, with the same model and engine settings:
- throughput: N requests at t=0 (mixed prompt and output lengths, `ignore_eos`), output tokens
  per second over the makespan, and TTFT p50 under that load;
- low load: requests one at a time (a short prompt, a few tokens), TTFT p50 — the added latency
  of the hops themselves.

TTFT is measured by the caller: from submitting the request to its first Delta.

    python -m loadtest.pipeline_overhead --result-json results/pipeline_overhead.json
"""

from __future__ import annotations

import argparse
import asyncio
import platform
import statistics
import time
from pathlib import Path

import msgspec

from loadtest.datasets import engine_workload
from loadtest.metrics import nearest_rank, write_result
from services.executor.engine.llm_engine import Engine
from shared.model_files import load_model_config
from services.stack import temporary_stack
from shared.client import JetserveClient
from shared.config import engine_config
from shared.protocol import Completion, Delta, GenerateRequest


async def timed(submit, request: GenerateRequest) -> dict:
    """Submit one request and drain its outputs; its TTFT, E2E (s) and output token count."""
    started, first, final = time.perf_counter(), None, None
    async for output in submit(request):
        if isinstance(output, Delta):
            first = first or time.perf_counter()
        else:
            final = output
    end = time.perf_counter()
    assert isinstance(final, Completion), final
    return {"ttft": (first or end) - started, "e2e": end - started,
            "tokens": final.usage.completion_tokens}


async def throughput(submit, requests: list[GenerateRequest]) -> dict:
    started = time.perf_counter()
    records = await asyncio.gather(*(timed(submit, r) for r in requests))
    makespan = time.perf_counter() - started
    tokens = sum(r["tokens"] for r in records)
    return {"requests": len(records), "output_tokens": tokens, "makespan_s": makespan,
            "output_tok_per_s": tokens / makespan,
            "ttft_p50_ms": 1e3 * statistics.median(r["ttft"] for r in records),
            "ttft_p99_ms": 1e3 * nearest_rank([r["ttft"] for r in records], 99)}


async def low_load(submit, requests: list[GenerateRequest]) -> dict:
    ttfts = [(await timed(submit, request))["ttft"] for request in requests]
    return {"requests": len(ttfts), "ttft_p50_ms": 1e3 * statistics.median(ttfts),
            "ttft_mean_ms": 1e3 * statistics.fmean(ttfts), "ttft_min_ms": 1e3 * min(ttfts)}


def streaming(requests: list[GenerateRequest], prefix: str) -> list[GenerateRequest]:
    return [msgspec.structs.replace(r, stream=True, request_id=f"{prefix}-{r.request_id}")
            for r in requests]


async def run_in_process(settings: dict, load, probes) -> dict:
    async with Engine(engine_config(settings)) as engine:
        engine.start()
        await low_load(engine.generate, streaming(probes[:2], "warm"))  # first-call costs
        return {"throughput": await throughput(engine.generate, streaming(load, "in")),
                "low_load": await low_load(engine.generate, streaming(probes, "in-probe"))}


async def run_pipeline(settings: dict, load, probes) -> dict:
    async with temporary_stack("jetserve-overhead-", settings=settings) as stack:
        async with await JetserveClient.connect(stack.url, tenant="bench") as client:
            await low_load(client.stream, streaming(probes[:2], "warm"))
            return {"throughput": await throughput(client.stream, streaming(load, "nats")),
                    "low_load": await low_load(client.stream, streaming(probes, "nats-probe"))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="SmolLM2-135M-Instruct")
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--num-probes", type=int, default=20, help="low-load requests")
    parser.add_argument("--num-kv-blocks", type=int, default=4096)
    parser.add_argument("--max-num-seqs", type=int, default=128)
    parser.add_argument("--max-num-batched-tokens", type=int, default=512)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--result-json", type=Path)
    args = parser.parse_args()

    settings = {"model.name": args.model, "kv_cache.num_blocks": args.num_kv_blocks,
                "scheduler.batch_level.max_num_seqs": args.max_num_seqs,
                "scheduler.batch_level.max_num_batched_tokens": args.max_num_batched_tokens}
    vocab = load_model_config(args.model, weights=False)[0].vocab_size
    load = engine_workload(args.num_requests, args.seed, vocab, prompt_range=(16, 256),
                         output_range=(16, 128))
    probes = [msgspec.structs.replace(r, max_tokens=4)
              for r in engine_workload(args.num_probes, args.seed + 1, vocab, prompt_range=(32, 32))]

    results = {"in_process": asyncio.run(run_in_process(settings, load, probes)),
               "pipeline": asyncio.run(run_pipeline(settings, load, probes))}
    a, b = results["in_process"], results["pipeline"]
    results["throughput_ratio"] = (b["throughput"]["output_tok_per_s"]
                                   / a["throughput"]["output_tok_per_s"])
    results["added_low_load_ttft_p50_ms"] = b["low_load"]["ttft_p50_ms"] - a["low_load"]["ttft_p50_ms"]
    results["parameters"] = {**vars(args), "result_json": str(args.result_json),
                             "machine": platform.platform(), "python": platform.python_version()}

    print(f"{'':<22}{'in-process':>14}{'NATS pipeline':>16}")
    for label, key, section in [("output tok/s", "output_tok_per_s", "throughput"),
                                ("TTFT p50 (loaded) ms", "ttft_p50_ms", "throughput"),
                                ("TTFT p99 (loaded) ms", "ttft_p99_ms", "throughput"),
                                ("TTFT p50 (low) ms", "ttft_p50_ms", "low_load"),
                                ("TTFT min (low) ms", "ttft_min_ms", "low_load")]:
        print(f"{label:<22}{a[section][key]:>14.1f}{b[section][key]:>16.1f}")
    print(f"throughput pipeline / in-process: {results['throughput_ratio']:.3f} "
          f"(target >= 0.90); added low-load TTFT p50: "
          f"{results['added_low_load_ttft_p50_ms']:.2f} ms (target <= 5)")
    if args.result_json:
        write_result(args.result_json, "pipeline_overhead", **results)


if __name__ == "__main__":
    main()
