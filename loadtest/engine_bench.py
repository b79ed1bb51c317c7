"""Engine throughput against Hugging Face static batching, on one workload, in one run.

The workload: N requests at t=0, prompt lengths uniform in [16, 512], output lengths uniform in
[16, 256] with `ignore_eos`, random token ids. The baseline runs the same requests through
transformers `generate` in fixed batches (arrival order, left-padded, each batch decoding to its
longest output). Also reports the engine's achieved FLOP/s against a matmul measured here, and the
engine with pipelining off, to show what overlapping CPU work with the model bought.

    python -m loadtest.engine_bench --result-json results/engine_bench.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import statistics
import time
from pathlib import Path

import torch

from services.executor.engine import Engine
from services.executor.run_local import run_requests
from shared.model_files import ModelConfig, default_gguf_path, load_model_config
from shared.config import EngineConfig
from shared.protocol import Completion, GenerateRequest
from loadtest.datasets import engine_workload

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


def matmul_flops_per_s(n: int = 2048, repeats: int = 10) -> float:
    """A dense matmul's FLOP/s on the engine's device and dtype (fp32 CPU, bf16 GPU)."""
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


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q / 100 * (len(ordered) - 1))))]


def run_engine(config: EngineConfig, requests: list[GenerateRequest]) -> dict:
    lines = [_encode(r) for r in requests]

    async def go():
        engine = Engine(config)
        try:
            start = time.perf_counter()
            results = await run_requests(engine, lines)
            return results, time.perf_counter() - start, engine
        finally:
            await engine.stop()

    results, elapsed, engine = asyncio.run(go())
    completions = [r for r in results if isinstance(r, Completion)]
    assert len(completions) == len(requests), [r for r in results if not isinstance(r, Completion)]
    output_tokens = sum(c.usage.completion_tokens for c in completions)
    prompt_tokens = sum(c.usage.prompt_tokens for c in completions)
    stats = engine.stats
    return {
        "elapsed_s": elapsed,
        "output_tokens": output_tokens,
        "output_tok_per_s": output_tokens / elapsed,
        "total_tok_per_s": (output_tokens + prompt_tokens) / elapsed,
        "ttft_ms_p50": percentile([c.metrics.ttft_ms for c in completions], 50),
        "ttft_ms_p99": percentile([c.metrics.ttft_ms for c in completions], 99),
        "tpot_ms_p50": percentile([c.metrics.tpot_ms for c in completions], 50),
        "preemptions": sum(c.scheduling.preemptions for c in completions),
        "steps": stats.steps,
        "model_busy_s": stats.model_busy_s,
        "model_idle_between_steps_s": stats.model_idle_s,
        "loop_cpu_s": stats.loop_cpu_s,
        "mean_tokens_per_step": (stats.prompt_tokens + stats.decode_tokens) / max(stats.steps, 1),
        "token_ids": [c.token_ids for c in completions],
    }


def _encode(request: GenerateRequest) -> str:
    import msgspec

    return msgspec.json.encode(request).decode()


def run_hf_static(requests: list[GenerateRequest], batch_size: int) -> dict:
    from transformers import AutoModelForCausalLM

    path = default_gguf_path()
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                 dtype=torch.float32)
    model.eval()
    pad = model.config.eos_token_id if model.config.pad_token_id is None else model.config.pad_token_id
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
    return {"elapsed_s": elapsed, "output_tokens": useful, "output_tok_per_s": useful / elapsed,
            "batch_size": batch_size, "token_ids": token_ids}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--num-requests", type=int, default=128)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--model", default="SmolLM2-135M-Instruct")
    defaults = EngineConfig()
    parser.add_argument("--max-num-seqs", type=int, default=defaults.max_num_seqs)
    parser.add_argument("--max-num-batched-tokens", type=int,
                        default=defaults.max_num_batched_tokens)
    parser.add_argument("--hf-batch-size", type=int, default=32)
    parser.add_argument("--skip-hf", action="store_true")
    parser.add_argument("--skip-no-pipeline", action="store_true")
    parser.add_argument("--attention-backend", choices=["auto", "torch", "triton"], default="auto")
    parser.add_argument("--also-backend", choices=["torch", "triton"],
                        help="run the engine again on this backend and compare (GPU: torch)")
    parser.add_argument("--result-json", default="results/engine_bench.json")
    args = parser.parse_args(argv)

    config = EngineConfig(model=args.model, max_num_seqs=args.max_num_seqs,
                          max_num_batched_tokens=args.max_num_batched_tokens,
                          attention_backend=args.attention_backend)
    model_config, _ = load_model_config(args.model)
    requests = engine_workload(args.num_requests, args.seed, model_config.vocab_size)
    flops = workload_flops(model_config, requests)
    matmul = matmul_flops_per_s()

    runs: dict[str, dict] = {}
    print(f"engine (pipelined) on {len(requests)} requests ...", flush=True)
    runs["engine"] = run_engine(config, requests)
    import msgspec

    if args.also_backend:
        print(f"engine on the {args.also_backend} backend ...", flush=True)
        runs[f"engine_{args.also_backend}"] = run_engine(
            msgspec.structs.replace(config, attention_backend=args.also_backend), requests)
    if not args.skip_no_pipeline:
        print("engine (pipelining off) ...", flush=True)

        runs["engine_no_pipeline"] = run_engine(msgspec.structs.replace(config, pipeline=False),
                                                requests)
    if not args.skip_hf:
        print(f"transformers static batching (batch {args.hf_batch_size}) ...", flush=True)
        runs["hf_static"] = run_hf_static(requests, args.hf_batch_size)

    engine = runs["engine"]
    engine["achieved_flop_per_s"] = flops / engine["elapsed_s"]
    engine["fraction_of_matmul"] = engine["achieved_flop_per_s"] / matmul
    print()
    print(f"{'run':<22}{'time s':>9}{'out tok/s':>11}{'TTFT p50 ms':>13}{'TPOT p50 ms':>13}")
    for name, run in runs.items():
        print(f"{name:<22}{run['elapsed_s']:>9.1f}{run['output_tok_per_s']:>11.1f}"
              f"{run.get('ttft_ms_p50', float('nan')):>13.0f}{run.get('tpot_ms_p50', float('nan')):>13.1f}")
    if "hf_static" in runs:
        speedup = engine["output_tok_per_s"] / runs["hf_static"]["output_tok_per_s"]
        same = sum(a == b for a, b in zip(engine["token_ids"], runs["hf_static"]["token_ids"]))
        print(f"engine / static batching: {speedup:.2f}x output tokens/s "
              f"(identical greedy outputs for {same}/{len(requests)} requests)")
    if args.also_backend:
        other = runs[f"engine_{args.also_backend}"]
        same = sum(a == b for a, b in zip(engine["token_ids"], other["token_ids"]))
        print(f"{args.attention_backend} backend / {args.also_backend} backend: "
              f"{engine['output_tok_per_s'] / other['output_tok_per_s']:.3f}x output tokens/s "
              f"(identical greedy outputs for {same}/{len(requests)} requests)")
    if "engine_no_pipeline" in runs:
        off = runs["engine_no_pipeline"]
        print(f"pipelining: {engine['output_tok_per_s'] / off['output_tok_per_s']:.3f}x throughput; "
              f"model idle between steps {engine['model_idle_between_steps_s']:.2f} s pipelined vs "
              f"{off['model_idle_between_steps_s']:.2f} s without")
    print(f"engine achieved {engine['achieved_flop_per_s'] / 1e9:.1f} GFLOP/s = "
          f"{100 * engine['fraction_of_matmul']:.0f}% of a {matmul / 1e9:.1f} GFLOP/s matmul")

    result = {
        "benchmark": "engine_bench",
        "date": time.strftime("%Y-%m-%d"),
        "machine": {"platform": platform.platform(), "processor": platform.processor(),
                    "torch_threads": torch.get_num_threads(),
                    "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"},
        "params": vars(args),
        "workload": {"num_requests": len(requests),
                     "prompt_tokens": sum(len(r.prompt_token_ids) for r in requests),
                     "output_tokens": sum(r.max_tokens for r in requests),
                     "mean_output": statistics.mean(r.max_tokens for r in requests),
                     "useful_flops": flops},
        "matmul_flop_per_s": matmul,
        "runs": {name: {k: v for k, v in run.items() if k != "token_ids"} for name, run in runs.items()},
    }
    if "hf_static" in runs:
        result["speedup_vs_hf_static"] = speedup
    path = Path(args.result_json)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
