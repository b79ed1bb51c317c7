"""vLLM (CPU build) on the engine benchmark's workload, run inside the .peers/vllm virtualenv.

Needs only the standard library and vllm: `loadtest.peer_bench` writes the workload as JSONL (one
`{"request_id", "prompt_token_ids", "max_tokens"}` per line), runs this file with the peer's
python and the environment vLLM's CPU docs advise, and reads back the JSON it writes. One `LLM`
serves, after one short warm-up request, two modes:

- `batch`: the first N requests (for each N of `--batch-sizes`) handed to one `LLM.generate` call
  at t=0 (vLLM schedules them itself): wall-clock time.
- `single`: the first `--single-count` requests one at a time, as a lone user sees them.
- `long`: the last `--long-count` requests (long prompts) one at a time, after the others.

Each request's TTFT and TPOT come from its RequestOutput's `metrics` (vLLM's RequestStateStats,
kept because stats logging is on): TTFT is `first_token_latency` (arrival to first token,
frontend clock), TPOT `(last_token_ts - first_token_ts) / (tokens - 1)` (engine-core clock).
Greedy, `ignore_eos`, no detokenization (the prompts are random ids; jetserve's engine returns
token ids too), prefix caching off. Every request's token ids are written out for comparison.

    .peers/vllm/bin/python loadtest/peers/vllm_runner.py --workload w.jsonl --model DIR --out o.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time

# Variables that shape vLLM's CPU performance; recorded as they were for this run.
TUNING_ENV = ("VLLM_CPU_KVCACHE_SPACE", "VLLM_CPU_OMP_THREADS_BIND", "VLLM_CPU_NUM_OF_RESERVED_CPU",
              "LD_PRELOAD", "VLLM_USE_AOT_COMPILE", "OMP_NUM_THREADS",
              "VLLM_ENABLE_V1_MULTIPROCESSING")


def read_workload(path: str) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def generate(llm, requests: list[dict]):
    """`llm.generate` of the requests as token prompts: greedy, `ignore_eos`, not detokenized."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    return llm.generate([TokensPrompt(prompt_token_ids=r["prompt_token_ids"]) for r in requests],
                        [SamplingParams(temperature=0.0, max_tokens=r["max_tokens"],
                                        ignore_eos=True, detokenize=False) for r in requests],
                        use_tqdm=False)


def request_timing(output) -> dict:
    """TTFT and TPOT in ms from vLLM's per-request stats (None where it kept none)."""
    stats = output.metrics
    if stats is None or not getattr(stats, "first_token_ts", 0):
        return {"ttft_ms": None, "tpot_ms": None}
    tokens = len(output.outputs[0].token_ids)
    decode_s = stats.last_token_ts - stats.first_token_ts
    return {"ttft_ms": 1000 * stats.first_token_latency,
            "tpot_ms": 1000 * decode_s / (tokens - 1) if tokens > 1 else None}


def run_figures(requests: list[dict], outputs, elapsed_s: float) -> dict:
    """One run's wall-clock time and each request's tokens and timing (the caller summarizes)."""
    per_request = []
    for request, output in zip(requests, outputs):
        token_ids = list(output.outputs[0].token_ids)
        assert len(token_ids) == request["max_tokens"], (request["request_id"], len(token_ids))
        per_request.append({"request_id": request["request_id"], "token_ids": token_ids,
                            **request_timing(output)})
    return {"elapsed_s": elapsed_s, "requests": per_request}


def run_batch(llm, requests: list[dict]) -> dict:
    start = time.perf_counter()
    outputs = generate(llm, requests)
    return run_figures(requests, outputs, time.perf_counter() - start)


def run_single(llm, requests: list[dict]) -> dict:
    """One request at a time; elapsed_s is the sum of their wall-clock times."""
    runs = [run_batch(llm, [request]) for request in requests]
    return {"elapsed_s": sum(r["elapsed_s"] for r in runs),
            "requests": [q for r in runs for q in r["requests"]]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workload", required=True, help="JSONL, one request per line")
    parser.add_argument("--model", required=True,
                        help="HF directory: config, safetensors weights, tokenizer")
    parser.add_argument("--out", required=True)
    parser.add_argument("--batch-sizes", type=int, nargs="*", default=[],
                        help="a batch run on the first N requests, for each N")
    parser.add_argument("--single-count", type=int, default=0,
                        help="the first K requests one at a time (0: no single run)")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--max-num-seqs", type=int)
    parser.add_argument("--max-num-batched-tokens", type=int)
    parser.add_argument("--long-count", type=int, default=0,
                        help="the last K requests are long prompts, run one at a time")
    parser.add_argument("--max-model-len", type=int, default=2048)
    # vLLM's CPU default compiles the model with inductor: here ~20% more batch throughput than
    # eager for ~20 s more start-up once its compile cache is warm (the first start: ~90 s).
    parser.add_argument("--enforce-eager", action="store_true", help="skip torch.compile")
    args = parser.parse_args(argv)

    import torch
    import vllm
    from vllm import LLM

    requests = read_workload(args.workload)
    long = requests[len(requests) - args.long_count:] if args.long_count else []
    requests = requests[:len(requests) - len(long)]
    llm_args = {"model": args.model, "dtype": args.dtype, "max_model_len": args.max_model_len,
                "enforce_eager": args.enforce_eager, "seed": 0,
                # Off: the single run repeats prompts the batch runs cached, which would make
                # its TTFT a cache hit (the workload's prompts share no prefixes of their own).
                "enable_prefix_caching": False,
                # Stats on: RequestOutput.metrics carries the per-request timestamps read above.
                "disable_log_stats": False}
    llm_args.update({k: vars(args)[k] for k in ("max_num_seqs", "max_num_batched_tokens")
                     if vars(args)[k]})

    start = time.perf_counter()
    llm = LLM(**llm_args)
    startup_s = time.perf_counter() - start
    scheduler = llm.llm_engine.vllm_config.scheduler_config
    # One short request first, so neither mode pays for first-call work (lazy init, compiles).
    start = time.perf_counter()
    warmup = {"request_id": "warmup",
              "prompt_token_ids": (requests or long)[0]["prompt_token_ids"][:16],
              "max_tokens": 4}
    generate(llm, [warmup])
    warmup_s = time.perf_counter() - start

    modes = {}
    if args.batch_sizes:
        modes["batch"] = {str(n): run_batch(llm, requests[:n]) for n in args.batch_sizes}
    if args.single_count:
        modes["single"] = run_single(llm, requests[:args.single_count])
    if long:
        modes["long"] = run_single(llm, long)

    result = {
        "peer": "vllm",
        "vllm_version": vllm.__version__,
        "torch_version": torch.__version__,
        "platform": platform.platform(),
        "llm_args": llm_args,
        # What vLLM's scheduler settled on where the caller set nothing.
        "scheduler": {"max_num_seqs": scheduler.max_num_seqs,
                      "max_num_batched_tokens": scheduler.max_num_batched_tokens,
                      "enable_chunked_prefill": scheduler.enable_chunked_prefill},
        "compilation_mode": llm.llm_engine.vllm_config.compilation_config.mode.name,
        "env": {name: os.environ.get(name) for name in TUNING_ENV},
        "startup_s": startup_s,
        "warmup_s": warmup_s,
        "modes": modes,
    }
    with open(args.out, "w") as f:
        json.dump(result, f)
    return 0


if __name__ == "__main__":  # vLLM's engine core is a spawned process: it re-imports this file
    raise SystemExit(main())
