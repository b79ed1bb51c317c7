"""What an int8 KV cache buys and costs on the real engine: `kv_cache.dtype: int8` against the
model's own dtype (`auto`, fp32 on a CPU).

- **Capacity**: the blocks a fixed KV budget (`--budget-gib`) holds, as 1,024-token sequences;
  then that many plus a third again of such requests (800-token prompts, 224 tokens out) sent at
  once: the most that ran at the same time, sampled every 5 ms (the scheduler admits on the
  blocks a prompt needs now, so it overcommits), and the preemptions that followed.
- **Agreement**: greedy tokens on loadtest.quant_quality's 32 prompts, `--max-tokens` each,
  against the fp32 cache's (the share of each output before the first differing token, and the
  identical outputs).
- **Throughput**: output tokens/s of that agreement run (32 requests at once).

    python -m loadtest.kv_quality --result-json results/kv_quality.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import time
from pathlib import Path

import msgspec

from loadtest.quant_quality import agreement, prompts
from services.executor.engine import Engine
from services.executor.run_local import run_requests
from shared.config import EngineConfig
from shared.protocol import Completion, GenerateRequest

SEQUENCE_TOKENS = 1024


async def _run(engine: Engine, requests: list[GenerateRequest]) -> tuple[list, float, int]:
    """Results in order, wall seconds, and the most sequences running at once."""
    most = 0
    done = asyncio.Event()

    async def watch() -> None:
        nonlocal most
        while not done.is_set():
            most = max(most, len(engine.scheduler.running))
            await asyncio.sleep(0.005)

    watcher = asyncio.create_task(watch())
    start = time.perf_counter()
    try:
        results = await run_requests(engine, [msgspec.json.encode(r).decode() for r in requests])
    finally:
        done.set()
        await watcher
    return results, time.perf_counter() - start, most


def measure(config: EngineConfig, max_tokens: int, seed: int) -> dict:
    async def go() -> dict:
        engine = Engine(config)
        try:
            blocks = engine.block_manager.num_blocks
            fits = blocks * config.block_size // SEQUENCE_TOKENS
            greedy = [msgspec.structs.replace(p, max_tokens=max_tokens, temperature=0.0,
                                              ignore_eos=True) for p in prompts()]
            results, seconds, _ = await _run(engine, greedy)
            assert all(isinstance(r, Completion) for r in results), results
            tokens = [r.token_ids for r in results]
            # Long prompts, distinct (no prefix-cache sharing), more than the cache holds.
            rng = random.Random(seed)
            vocab = engine.model_config.vocab_size
            long = [GenerateRequest(prompt_token_ids=[rng.randrange(100, vocab) for _ in range(800)],
                                    max_tokens=SEQUENCE_TOKENS - 800, temperature=0.0,
                                    ignore_eos=True)
                    for _ in range(fits + fits // 3 + 1)]
            preempted = engine.scheduler.num_preemptions
            long_results, _, most = await _run(engine, long)
            assert all(isinstance(r, Completion) for r in long_results), long_results
            return {"kv_blocks": blocks, "sequences_of_1024_that_fit": fits,
                    "long_requests_sent": len(long), "most_running_at_once": most,
                    "preemptions": engine.scheduler.num_preemptions - preempted,
                    "greedy_output_tok_s": sum(map(len, tokens)) / seconds, "tokens": tokens}
        finally:
            await engine.stop()

    return asyncio.run(go())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="SmolLM2-135M-Instruct")
    parser.add_argument("--budget-gib", type=float, default=0.5, help="the KV cache's memory")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--result-json", default="results/kv_quality.json")
    args = parser.parse_args(argv)

    base = EngineConfig(model=args.model, max_num_seqs=256, cpu_kv_cache_gib=args.budget_gib,
                        max_model_len=2048, enable_prefix_caching=False)
    results = {dtype: measure(msgspec.structs.replace(base, kv_cache_dtype=dtype),
                              args.max_tokens, args.seed) for dtype in ("auto", "int8")}
    reference = results["auto"]["tokens"]
    for r in results.values():
        r["agreement_with_fp32_kv"] = agreement(r.pop("tokens"), reference)
    print(f"KV budget {args.budget_gib} GiB, {args.model}")
    print(f"{'kv dtype':<10}{'blocks':>8}{'1024-token seqs':>17}{'sent':>6}{'ran at once':>13}"
          f"{'preempted':>11}{'tok/s':>8}{'agreement':>11}{'identical':>11}")
    for name, r in results.items():
        a = r["agreement_with_fp32_kv"]
        print(f"{name:<10}{r['kv_blocks']:>8}{r['sequences_of_1024_that_fit']:>17}"
              f"{r['long_requests_sent']:>6}{r['most_running_at_once']:>13}{r['preemptions']:>11}"
              f"{r['greedy_output_tok_s']:>8.1f}"
              f"{100 * a['mean_prefix_share']:>10.1f}%{a['identical']:>6}/{a['prompts']}")
    path = Path(args.result_json)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"benchmark": "kv_quality", "date": time.strftime("%Y-%m-%d"),
                                "params": vars(args), "results": results}, indent=2))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
