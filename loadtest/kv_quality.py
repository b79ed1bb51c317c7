"""What a compressed KV cache buys and costs on the real engine. Three configurations: the
model's own dtype (`auto`: fp32, or bf16 on a CPU with native bf16), `kv_cache.dtype: int8`, and `mixed`
(`kv_cache.compress_below_priority: 5`: half the KV memory an int8 pool for the requests under
priority 5, half the model's dtype for the others; the requests alternate priority 9 and 1).

- **Capacity**: the 1,024-token sequences a fixed KV budget (`--budget-gib`) holds; then that
  many plus a third again of such requests (800-token prompts, 224 tokens out) sent at once: the
  most that ran at the same time, sampled every 5 ms (the scheduler admits on the blocks a prompt
  needs now, so it overcommits), and the preemptions that followed.
- **Agreement**: greedy tokens on loadtest.quant_quality's 32 prompts, `--max-tokens` each,
  against the model's own cache's (fp32 or bf16; the share of each output before the first differing token, and the
  identical outputs); for `mixed`, per priority too.
- **Throughput**: output tokens/s of that agreement run (32 requests at once, short contexts),
  and of `--batch-requests` requests of `--batch-prompt` random tokens and `--batch-max-tokens`
  out, sent at once to an engine with a KV budget (`--batch-budget-gib`) that holds them all in
  every configuration, so the figure is the speed of the cache alone: over the whole run, and
  over its decode phase (from the last prompt prefilled to the first request finished, every
  request decoding; large-batch decode reads every sequence's KV each step).

    python -m loadtest.kv_quality --result-json results/kv_quality.json
"""

from __future__ import annotations

import argparse
import asyncio
import random
import time

import msgspec

from loadtest.metrics import write_result
from loadtest.quant_quality import agreement, agreement_cells, completions, prompts
from services.executor.engine.llm_engine import Engine
from shared.config import EngineConfig, engine_config
from shared.protocol import GenerateRequest

SEQUENCE_TOKENS = 1024
HIGH, LOW = 9, 1  # the mixed configuration's two priorities, either side of its bound (5)
CONFIGS = {"auto": {}, "int8": {"kv_cache.dtype": "int8"},
           "mixed": {"kv_cache.compress_below_priority": 5}}


async def _run(engine: Engine, requests: list[GenerateRequest]) -> tuple[list, float, int, float]:
    """Results in order, wall seconds, the most sequences running at once, and the decode
    tokens/s while every request ran and decoded: from when the last prompt was prefilled to
    when the first request finished (NaN if that never happened)."""
    most = 0
    done = asyncio.Event()
    window: list[tuple[float, int]] = []  # (time, decode tokens) at its start and end

    async def watch() -> None:
        nonlocal most
        scheduler = engine.scheduler
        while not done.is_set():
            most = max(most, len(scheduler.running))
            if not window and engine.num_unfinished == len(requests) and not scheduler.waiting \
                    and all(s.num_computed_tokens >= s.num_prompt_tokens for s in scheduler.running):
                window.append((time.perf_counter(), engine.stats.decode_tokens))
            elif len(window) == 1 and engine.num_unfinished < len(requests):
                window.append((time.perf_counter(), engine.stats.decode_tokens))
            await asyncio.sleep(0.005)

    watcher = asyncio.create_task(watch())
    start = time.perf_counter()
    try:
        results = await completions(engine, requests)
    finally:
        done.set()
        await watcher
    decode_tok_s = float("nan")
    if len(window) == 2 and window[1][0] > window[0][0]:
        decode_tok_s = (window[1][1] - window[0][1]) / (window[1][0] - window[0][0])
    return results, time.perf_counter() - start, most, decode_tok_s


def _random_requests(engine: Engine, rng: random.Random, count: int, prompt: int, out: int,
                     mixed: bool) -> list[GenerateRequest]:
    """Distinct random prompts (no prefix-cache sharing); priorities alternate when mixed."""
    vocab = engine.model_config.vocab_size
    return [GenerateRequest(prompt_token_ids=[rng.randrange(100, vocab) for _ in range(prompt)],
                            max_tokens=out, temperature=0.0, ignore_eos=True,
                            priority=(HIGH if i % 2 == 0 else LOW) if mixed else 5)
            for i in range(count)]


def measure(config: EngineConfig, batch_config: EngineConfig, args) -> dict:
    mixed = config.kv_cache.compress_below_priority is not None

    async def capacity_and_agreement() -> dict:
        async with Engine(config) as engine:
            sizes = engine.pool_sizes
            fits = [n * config.kv_cache.block_size // SEQUENCE_TOKENS for n in sizes]
            greedy = [msgspec.structs.replace(p, max_tokens=args.max_tokens, temperature=0.0,
                                              ignore_eos=True,
                                              priority=(HIGH if i % 2 == 0 else LOW) if mixed else 5)
                      for i, p in enumerate(prompts())]
            results, seconds, _, _ = await _run(engine, greedy)
            tokens = [r.token_ids for r in results]
            long = _random_requests(engine, random.Random(args.seed), sum(fits) + sum(fits) // 3 + 1,
                                    800, SEQUENCE_TOKENS - 800, mixed)
            preempted = engine.scheduler.num_preemptions
            _, _, most, _ = await _run(engine, long)
            return {"kv_blocks_per_pool": sizes, "sequences_of_1024_that_fit": sum(fits),
                    "sequences_of_1024_per_pool": fits,
                    "long_requests_sent": len(long), "most_running_at_once": most,
                    "preemptions": engine.scheduler.num_preemptions - preempted,
                    "greedy_output_tok_s": sum(map(len, tokens)) / seconds, "tokens": tokens}

    async def large_batch() -> dict:
        async with Engine(batch_config) as engine:
            requests = _random_requests(engine, random.Random(args.seed + 1), args.batch_requests,
                                        args.batch_prompt, args.batch_max_tokens, mixed)
            results, seconds, most, decode_tok_s = await _run(engine, requests)
            return {"batch_output_tok_s": sum(len(r.token_ids) for r in results) / seconds,
                    "batch_decode_tok_s": decode_tok_s,
                    "batch_seconds": seconds, "batch_most_running": most,
                    "batch_preemptions": engine.scheduler.num_preemptions}

    result = asyncio.run(capacity_and_agreement())
    if args.batch_requests:
        result.update(asyncio.run(large_batch()))
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="SmolLM2-135M-Instruct")
    parser.add_argument("--budget-gib", type=float, default=0.25, help="the KV cache's memory")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--batch-requests", type=int, default=128, help="0: skip that run")
    parser.add_argument("--batch-prompt", type=int, default=512)
    parser.add_argument("--batch-max-tokens", type=int, default=64)
    parser.add_argument("--batch-budget-gib", type=float, default=4.0)
    parser.add_argument("--batch-tokens", type=int, default=2048,
                        help="max_num_batched_tokens of that run (prompts prefill fast)")
    parser.add_argument("--configs", nargs="+", choices=list(CONFIGS), default=list(CONFIGS))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--result-json", default="results/kv_quality.json")
    args = parser.parse_args(argv)

    base = {"model.name": args.model, "scheduler.batch_level.max_num_seqs": 256,
            "kv_cache.cpu_cache_gib": args.budget_gib, "model.max_model_len": 2048,
            "kv_cache.enable_prefix_caching": False}
    batch_base = {**base, "kv_cache.cpu_cache_gib": args.batch_budget_gib,
                  "scheduler.batch_level.max_num_batched_tokens": args.batch_tokens}
    names = ["auto"] + [n for n in args.configs if n != "auto"]  # auto is the reference
    results = {name: measure(engine_config({**base, **CONFIGS[name]}),
                             engine_config({**batch_base, **CONFIGS[name]}), args)
               for name in names}
    reference = results["auto"]["tokens"]
    for r in results.values():
        tokens = r.pop("tokens")
        r["agreement_with_fp32_kv"] = agreement(tokens, reference)
        r["agreement_by_priority"] = {  # the mixed run's even prompts ran at HIGH, odd at LOW
            str(HIGH): agreement(tokens[0::2], reference[0::2]),
            str(LOW): agreement(tokens[1::2], reference[1::2])}
    print(f"KV budget {args.budget_gib} GiB, {args.model}")
    print(f"{'kv dtype':<10}{'blocks':>12}{'1024-token seqs':>17}{'sent':>6}{'ran at once':>13}"
          f"{'preempted':>11}{'tok/s':>8}{'agreement':>11}{'identical':>11}"
          f"{'batch tok/s':>13}{'decode tok/s':>14}")
    for name, r in results.items():
        a = r["agreement_with_fp32_kv"]
        print(f"{name:<10}{'+'.join(map(str, r['kv_blocks_per_pool'])):>12}"
              f"{r['sequences_of_1024_that_fit']:>17}"
              f"{r['long_requests_sent']:>6}{r['most_running_at_once']:>13}{r['preemptions']:>11}"
              f"{r['greedy_output_tok_s']:>8.1f}" + agreement_cells(a)
              + f"{r.get('batch_output_tok_s', float('nan')):>13.1f}"
              f"{r.get('batch_decode_tok_s', float('nan')):>14.1f}")
    mixed = results.get("mixed")
    if mixed:
        for priority, a in mixed["agreement_by_priority"].items():
            print(f"mixed, priority {priority}: agreement {100 * a['mean_prefix_share']:.1f}%, "
                  f"identical {a['identical']}/{a['prompts']}")
    write_result(args.result_json, "kv_quality", params=vars(args), results=results)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
