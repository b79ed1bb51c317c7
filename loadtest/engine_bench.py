"""Engine throughput against Hugging Face static batching, over a sweep of request counts, and
single-stream latency, for the default dtype (fp32, or bf16 on a CPU with native bf16) and each
weight quantization, in one run.

The workload at each sweep point: N requests at t=0, prompt lengths uniform in [16, 512], output
lengths uniform in [16, 256] with `ignore_eos`, random token ids (`datasets.engine_workload`). The
baseline runs the same requests through transformers `generate` in fixed batches (arrival order,
left-padded, each batch decoding to its longest output), in fp32. Each engine variant (one per
`--quantization`, plus optional ones) is one engine that runs every point in turn, prefix caching
off so no point reuses another's prompts. Also reports each run's achieved FLOP/s as a fraction of
a dense matmul measured here (the roofline), and single-stream TTFT and TPOT of short chat
prompts and of long prompts (`--long-prompts`, random token ids, 16 output tokens: a long prompt's
TTFT is its prefill) as the Completions' own metrics report them.

    python -m loadtest.engine_bench --sweep 8 32 64 128 256 --quantization none int8 int4 auto \
        --result-json results/engine_bench.json
"""

from __future__ import annotations

import argparse
import asyncio
import platform
import statistics
import time
from concurrent.futures import ThreadPoolExecutor

import msgspec
import torch

from jetserve_kernels import cpu_ops
from loadtest.datasets import LONG_PROMPT_OUTPUT, engine_workload, long_prompts
from loadtest.metrics import nearest_rank, write_result
from loadtest.quant_quality import completions
from services.executor.engine.llm_engine import Engine
from shared.config import EngineConfig, engine_config
from shared.model_files import ModelConfig, default_gguf_path, load_model_config
from shared.protocol import ChatMessage, GenerateRequest

# Single stream: short chat prompts, one at a time, as a local chat app sends them.
CHAT_PROMPTS = [
    "Write a short story about a robot who learns to paint.",
    "What are three good habits for staying healthy?",
    "Explain why the sky is blue in simple words.",
]
SINGLE_STREAM_TOKENS = 256


def workload_flops(config: ModelConfig, requests: list[GenerateRequest]) -> float:
    """Useful FLOPs of the workload: every token through every layer, attention by context."""
    h, hd = config.hidden_size, config.head_dim
    layer_params = (h * hd * (2 * config.num_heads + 2 * config.num_kv_heads)
                    + 3 * h * config.intermediate_size)
    total = 0.0
    for r in requests:
        positions = len(r.prompt_token_ids) + r.max_tokens - 1  # the last sampled token is not run
        total += positions * 2 * layer_params * config.num_layers
        # QK^T and PV: 2 matmuls of 2*D FLOPs per (head, attended key); token p attends p+1 keys.
        attended = positions * (positions + 1) / 2
        total += attended * 4 * config.num_heads * hd * config.num_layers
        total += r.max_tokens * 2 * config.vocab_size * h  # output projection per sampled token
    return total


def on_own_thread(fn, *args):
    """fn(*args) on a thread of its own that ends with it. torch's OpenMP keeps a thread team
    per calling thread; a team left on this (main) thread would share the two cores with the
    engine's model-thread team and slow every parallel op of both."""
    with ThreadPoolExecutor(max_workers=1) as pool:
        return pool.submit(fn, *args).result()


def matmul_flops_per_s(n: int = 2048, repeats: int = 10) -> float:
    """A dense fp32 matmul's FLOP/s on a CPU, bf16 on a GPU: the roofline every variant is set
    against (a bf16 engine on a CPU can pass 100 % of it)."""
    cuda = torch.cuda.is_available()
    n = 8192 if cuda else n
    dtype = torch.bfloat16 if cuda else torch.float32
    a = torch.randn(n, n, dtype=dtype, device="cuda" if cuda else "cpu")
    b = torch.randn_like(a)
    a @ b
    if cuda:
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(repeats):
        a @ b
    if cuda:
        torch.cuda.synchronize()
    return 2 * n**3 * repeats / (time.perf_counter() - start)


async def _run_point(engine: Engine, requests: list[GenerateRequest]) -> dict:
    """One sweep point through a running engine: throughput, latency and the step counters."""
    before = dict(vars(engine.stats))
    start = time.perf_counter()
    done = await completions(engine, requests)
    elapsed = time.perf_counter() - start
    after = vars(engine.stats)
    delta = {k: after[k] - before[k] for k in ("steps", "prompt_tokens", "decode_tokens",
                                               "model_busy_s", "model_idle_s", "loop_cpu_s")}
    output_tokens = sum(c.usage.completion_tokens for c in done)
    return {
        "elapsed_s": elapsed,
        "output_tokens": output_tokens,
        "output_tok_per_s": output_tokens / elapsed,
        "ttft_ms_p50": nearest_rank([c.metrics.ttft_ms for c in done], 50),
        "ttft_ms_p99": nearest_rank([c.metrics.ttft_ms for c in done], 99),
        "tpot_ms_p50": nearest_rank([c.metrics.tpot_ms for c in done], 50),
        "preemptions": sum(c.scheduling.preemptions for c in done),
        "steps": delta["steps"],
        "model_busy_s": delta["model_busy_s"],
        "model_idle_between_steps_s": delta["model_idle_s"],
        "loop_cpu_s": delta["loop_cpu_s"],
        "mean_tokens_per_step": (delta["prompt_tokens"] + delta["decode_tokens"])
                                / max(delta["steps"], 1),
        "token_ids": [c.token_ids for c in done],
    }


async def _single_stream(engine: Engine) -> dict:
    """Each chat prompt alone: the Completion's own TTFT and TPOT (medians over the prompts)."""
    runs = []
    for prompt in CHAT_PROMPTS:
        request = GenerateRequest(messages=[ChatMessage("user", prompt)], temperature=0.0,
                                  max_tokens=SINGLE_STREAM_TOKENS, ignore_eos=True)
        [completion] = await completions(engine, [request])
        runs.append({"prompt_tokens": completion.usage.prompt_tokens,
                     "ttft_ms": completion.metrics.ttft_ms, "tpot_ms": completion.metrics.tpot_ms})
    return {"ttft_ms": statistics.median(r["ttft_ms"] for r in runs),
            "tpot_ms": statistics.median(r["tpot_ms"] for r in runs), "runs": runs}


async def _long_prompts(engine: Engine, lengths: list[int], seed: int) -> list[dict]:
    """One prompt of each length alone (`datasets.long_prompts`): its TTFT (the prefill) and
    TPOT. A prompt past the model's context (with the output) is cut to what fits, the others
    left as peer_bench has them."""
    fit = engine.max_model_len - LONG_PROMPT_OUTPUT
    runs = []
    for request in long_prompts(lengths, seed, engine.model_config.vocab_size):
        request = msgspec.structs.replace(request, prompt_token_ids=request.prompt_token_ids[:fit])
        [completion] = await completions(engine, [request])
        runs.append({"prompt_tokens": len(request.prompt_token_ids),
                     "ttft_ms": completion.metrics.ttft_ms, "tpot_ms": completion.metrics.tpot_ms})
    return runs


def run_engine(config: EngineConfig, points: dict[int, list[GenerateRequest]],
               single_stream: bool, long_lengths: list[int] = (), seed: int = 0) -> dict:
    """One engine through the single-stream prompts, then every sweep point in turn."""
    async def go():
        start = time.perf_counter()
        async with Engine(config) as engine:
            result = {"load_s": time.perf_counter() - start}
            if single_stream:
                result["single_stream"] = await _single_stream(engine)
                result["long_prompts"] = await _long_prompts(engine, long_lengths, seed)
            result["points"] = {}
            for n, requests in points.items():
                point = result["points"][n] = await _run_point(engine, requests)
                print(f"  {n} requests: {point['output_tok_per_s']:.1f} output tok/s, "
                      f"TTFT p50 {point['ttft_ms_p50']:.0f} ms, TPOT p50 "
                      f"{point['tpot_ms_p50']:.1f} ms, {point['preemptions']} preemptions",
                      flush=True)
        return result

    return asyncio.run(go())


def run_hf_static(points: dict[int, list[GenerateRequest]], batch_size: int) -> dict:
    from transformers import AutoModelForCausalLM

    path = default_gguf_path()
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                 dtype=torch.float32)
    model.eval()
    pad = model.config.eos_token_id if model.config.pad_token_id is None else model.config.pad_token_id
    result = {}
    for n, requests in points.items():
        useful = 0
        start = time.perf_counter()
        token_ids = []
        for b in range(0, len(requests), batch_size):
            batch = requests[b:b + batch_size]
            width = max(len(r.prompt_token_ids) for r in batch)
            ids = torch.full((len(batch), width), pad, dtype=torch.long)
            mask = torch.zeros((len(batch), width), dtype=torch.long)
            for i, r in enumerate(batch):  # left padding
                ids[i, width - len(r.prompt_token_ids):] = torch.tensor(r.prompt_token_ids)
                mask[i, width - len(r.prompt_token_ids):] = 1
            new = max(r.max_tokens for r in batch)
            with torch.inference_mode():
                # eos_token_id=None: every row runs to `new` tokens, EOS included, like ignore_eos.
                out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new,
                                     do_sample=False, eos_token_id=None, pad_token_id=pad)
            for i, r in enumerate(batch):
                token_ids.append(out[i, width:width + r.max_tokens].tolist())
            useful += sum(r.max_tokens for r in batch)
        elapsed = time.perf_counter() - start
        result[n] = {"elapsed_s": elapsed, "output_tokens": useful,
                     "output_tok_per_s": useful / elapsed, "batch_size": batch_size,
                     "token_ids": token_ids}
        print(f"  {n} requests: {useful / elapsed:.1f} output tok/s", flush=True)
    return {"points": result}


def _same(a: list[list[int]], b: list[list[int]]) -> int:
    return sum(x == y for x, y in zip(a, b))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sweep", type=int, nargs="+", default=[128],
                        help="request counts, one workload each (default: 128)")
    parser.add_argument("--quantization", nargs="+", default=["none"],
                        choices=["none", "int8", "int4", "auto"],
                        help="one engine variant per value (default: none, the model's dtype)")
    parser.add_argument("--quantized-activations", nargs="+",
                        default=[EngineConfig().model.quantized_activations],
                        choices=["auto", "float32", "int8"],
                        help="each quantized variant with each model.quantized_activations "
                        "(with more than one: engine_int8_a32, engine_int8_a8, ...; default: "
                        "the shipped setting alone)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--model", default="SmolLM2-135M-Instruct")
    parser.add_argument("--tokenizer", help="a directory of tokenizer files (model.tokenizer): "
                        "a dummy:<shape> model on a machine without the default model's GGUF")
    defaults = EngineConfig().batch
    parser.add_argument("--max-num-seqs", type=int, default=defaults.max_num_seqs)
    parser.add_argument("--max-num-batched-tokens", type=int,
                        default=defaults.max_num_batched_tokens)
    parser.add_argument("--hf-batch-size", type=int, default=32)
    parser.add_argument("--skip-hf", action="store_true")
    parser.add_argument("--skip-single-stream", action="store_true")
    parser.add_argument("--long-prompts", type=int, nargs="*", default=[2048],
                        help="prompt lengths for single-stream long prompts (default: 2048)")
    parser.add_argument("--no-pipeline", action="store_true",
                        help="also run the first variant with pipelining off")
    parser.add_argument("--attention-backend", choices=["auto", "torch", "triton"], default="auto")
    parser.add_argument("--also-backend", choices=["torch", "triton"],
                        help="also run the first variant on this backend and compare (GPU: torch)")
    parser.add_argument("--dtype", choices=["auto", "float32", "bfloat16", "float16"],
                        default="auto", help="model.dtype of every variant (default auto: "
                        "bf16 on CUDA and on a CPU with native bf16 for unquantized weights, "
                        "else fp32)")
    parser.add_argument("--also-dtype", choices=["float32", "bfloat16", "float16"],
                        help="also run the first variant in this model dtype (model.dtype)")
    parser.add_argument("--also-amx", choices=["tiles", "none"],
                        help="also run the first variant with this model.amx (on a CPU with "
                        "AMX: tiles, a bf16 model's matmuls on the kernels' own AMX tiles; "
                        "none, no AMX at all)")
    parser.add_argument("--also-no-huge-pages", action="store_true",
                        help="also run the first variant with model.huge_pages off (the packed "
                        "weights on torch's 4 KiB pages)")
    parser.add_argument("--also-kv-huge-pages", action="store_true",
                        help="also run the first variant with kv_cache.huge_pages on (the KV "
                        "cache in huge pages too)")
    parser.add_argument("--also-kv-dtype", choices=["int8", "bfloat16"],
                        help="also run the first variant with this kv_cache.dtype (int8: the "
                        "KV cache as int8 codes with a scale and offset per 32 channels)")
    parser.add_argument("--result-json", default="results/engine_bench.json")
    args = parser.parse_args(argv)

    base = {"model.name": args.model, "model.attention_backend": args.attention_backend,
            "model.dtype": args.dtype,
            "scheduler.batch_level.max_num_seqs": args.max_num_seqs,
            "scheduler.batch_level.max_num_batched_tokens": args.max_num_batched_tokens,
            "kv_cache.enable_prefix_caching": False,
            **({"model.tokenizer": args.tokenizer} if args.tokenizer else {})}
    model_config, _ = load_model_config(args.model)
    points = {n: engine_workload(n, args.seed, model_config.vocab_size) for n in args.sweep}
    matmul = on_own_thread(matmul_flops_per_s)
    suffix = ({"auto": "_aauto", "float32": "_a32", "int8": "_a8"}
              if len(args.quantized_activations) > 1 else {})
    variants = {("engine" if q == "none" else f"engine_{q}{suffix.get(a, '')}"):
                {**base, "model.quantization": q, "model.quantized_activations": a}
                for q in args.quantization
                for a in (args.quantized_activations if q != "none" else ["float32"])}
    first = next(iter(variants.values()))
    if args.also_backend:
        variants[f"engine_{args.also_backend}"] = {**first,
                                                   "model.attention_backend": args.also_backend}
    if args.also_dtype:
        variants[f"engine_{args.also_dtype}"] = {**first, "model.dtype": args.also_dtype}
    if args.also_amx:
        variants[f"engine_amx_{args.also_amx}"] = {**first, "model.amx": args.also_amx}
    if args.also_no_huge_pages:
        variants["engine_no_huge_pages"] = {**first, "model.huge_pages": False}
    if args.also_kv_huge_pages:
        variants["engine_kv_huge_pages"] = {**first, "kv_cache.huge_pages": True}
    if args.also_kv_dtype:
        variants[f"engine_kv_{args.also_kv_dtype}"] = {**first,
                                                      "kv_cache.dtype": args.also_kv_dtype}
    if args.no_pipeline:
        variants["engine_no_pipeline"] = {**first, "scheduler.token_level.pipeline": False}
    variants = {name: engine_config(settings) for name, settings in variants.items()}

    runs: dict[str, dict] = {}
    for name, config in variants.items():
        print(f"{name} ...", flush=True)
        runs[name] = run_engine(config, points, single_stream=not args.skip_single_stream,
                                long_lengths=args.long_prompts, seed=args.seed)
    if not args.skip_hf:
        print(f"transformers static batching (batch {args.hf_batch_size}, fp32) ...", flush=True)
        runs["hf_static"] = on_own_thread(run_hf_static, points, args.hf_batch_size)

    reference = next(iter(runs.values()))["points"]
    for n, requests in points.items():
        flops = workload_flops(model_config, requests)
        print(f"\n{n} requests ({sum(r.max_tokens for r in requests)} output tokens)")
        print(f"{'run':<22}{'time s':>9}{'out tok/s':>11}{'x HF':>7}{'roofline':>10}"
              f"{'TTFT p50 ms':>13}{'TPOT p50 ms':>13}{'same tokens':>13}")
        hf = runs.get("hf_static", {}).get("points", {}).get(n)
        for name, run in runs.items():
            point = run["points"][n]
            point["fraction_of_matmul"] = flops / point["elapsed_s"] / matmul
            if hf is not None:
                point["x_hf_static"] = point["output_tok_per_s"] / hf["output_tok_per_s"]
            same = _same(point["token_ids"], reference[n]["token_ids"])
            print(f"{name:<22}{point['elapsed_s']:>9.1f}{point['output_tok_per_s']:>11.1f}"
                  f"{point.get('x_hf_static', float('nan')):>7.2f}"
                  f"{100 * point['fraction_of_matmul']:>9.0f}%"
                  f"{point.get('ttft_ms_p50', float('nan')):>13.0f}"
                  f"{point.get('tpot_ms_p50', float('nan')):>13.1f}{same:>8}/{len(requests)}")
    if not args.skip_single_stream:
        print(f"\nsingle stream ({len(CHAT_PROMPTS)} chat prompts alone, {SINGLE_STREAM_TOKENS} "
              f"tokens each; medians of the Completions' metrics)")
        for name, run in runs.items():
            if "single_stream" in run:
                single = run["single_stream"]
                print(f"{name:<22}TTFT {single['ttft_ms']:6.1f} ms   TPOT {single['tpot_ms']:5.1f} ms")
        if args.long_prompts:
            print(f"\nsingle stream, long prompts alone ({LONG_PROMPT_OUTPUT} tokens each)")
        for name, run in runs.items():
            for long in run.get("long_prompts", []):
                print(f"{name:<22}{long['prompt_tokens']:>6}-token prompt: TTFT "
                      f"{long['ttft_ms']:7.1f} ms   TPOT {long['tpot_ms']:5.1f} ms")
    print(f"\nroofline: a {matmul / 1e9:.1f} GFLOP/s dense matmul (fp32 on a CPU, bf16 on a GPU)")

    write_result(
        args.result_json, "engine_bench",
        machine={"platform": platform.platform(), "processor": platform.processor(),
                 "torch_threads": torch.get_num_threads(),
                 "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
                 "cpu_kernels_arch": cpu_ops.ARCH},
        params=vars(args),
        workloads={n: {"num_requests": n,
                       "prompt_tokens": sum(len(r.prompt_token_ids) for r in requests),
                       "output_tokens": sum(r.max_tokens for r in requests),
                       "useful_flops": workload_flops(model_config, requests)}
                   for n, requests in points.items()},
        matmul_flop_per_s=matmul,
        runs={name: {**{k: v for k, v in run.items() if k != "points"},
                     "points": {n: {k: v for k, v in point.items() if k != "token_ids"}
                                for n, point in run["points"].items()}}
              for name, run in runs.items()},
        same_tokens_as_first={name: {n: _same(run["points"][n]["token_ids"],
                                              reference[n]["token_ids"]) for n in points}
                              for name, run in runs.items()})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
