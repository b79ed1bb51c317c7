"""The engine benchmark's workload through a peer: vLLM's CPU build or llama.cpp, side by side.

Each peer lives in its own virtualenv under .peers/ (made by loadtest/peers/setup_*.sh), never in
jetserve's: this module writes the workload (`datasets.engine_workload`, the same requests
engine_bench feeds jetserve's engine) to JSONL, runs the peer's runner script with that venv's
python and the environment its docs advise, and summarizes what the runner wrote back.

- vllm: for each `--num-requests` N, all N requests at t=0 in one `LLM.generate` (throughput),
  then the first `--single-count` requests alone (TTFT, TPOT), then `--long-prompts` alone (the
  long prompts engine_bench times: `datasets.long_prompts`). fp32 weights (`--dtype bfloat16`:
  bf16, its results kept beside fp32's as `vllm_bfloat16`), the HF directory the default GGUF
  converts to: the weights jetserve's engine runs.
- llamacpp: the first `--single-count` requests one after another, as a local chat app serves
  them, from the GGUF itself (its Q4_1 weights, so greedy outputs differ from the fp32 peers').

    python -m loadtest.peer_bench --peer vllm --num-requests 8 32 64 128 256 --single-count 4
    python -m loadtest.peer_bench --peer llamacpp --single-count 4

Results go into `results/peer_bench.json` under the peer's name (a run of the other peer keeps
its entry), every request's token ids into `results/peer_bench_<peer>_outputs.json`.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import tempfile
import time
from pathlib import Path

from loadtest.datasets import LONG_PROMPT_OUTPUT, engine_workload, long_prompts
from loadtest.metrics import percentile
from shared.model_files import default_gguf_path, load_model_config

ROOT = Path(__file__).resolve().parent.parent
PEERS = ROOT / ".peers"
RUNNERS = Path(__file__).resolve().parent / "peers"
# Debian's libtcmalloc-minimal4, which setup_vllm_cpu.sh installs.
TCMALLOC = Path("/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4")


def vllm_env(kv_cache_gib: int) -> dict[str, str]:
    """vLLM's CPU tuning, as its docs advise: a fixed KV cache, OpenMP bound to every core (auto
    binding with none kept back for the scheduler: on 2 cores, reserving one cost 40% of batch
    throughput here), TCMalloc and Intel OpenMP preloaded (libgomp instead: ~5% slower)."""
    env = dict(os.environ)
    preload = [str(p) for p in (TCMALLOC, PEERS / "vllm" / "lib" / "libiomp5.so") if p.exists()]
    if env.get("LD_PRELOAD"):
        preload.append(env["LD_PRELOAD"])
    env.update(VLLM_CPU_KVCACHE_SPACE=str(kv_cache_gib), VLLM_CPU_OMP_THREADS_BIND="auto",
               VLLM_CPU_NUM_OF_RESERVED_CPU="0", LD_PRELOAD=":".join(preload),
               # vLLM 0.32's AOT compile cache fails to load under torch 2.13 ("'function' object
               # has no attribute 'finalize_loading'") and recompiles every start (~75 s); its
               # older compile cache loads (~35 s once warm).
               VLLM_USE_AOT_COMPILE="0")
    return env


def run_peer(args, workload: Path, out: Path) -> None:
    python = PEERS / args.peer / "bin" / "python"
    if not python.exists():
        setup = "setup_vllm_cpu.sh" if args.peer == "vllm" else "setup_llama_cpp.sh"
        raise SystemExit(f"{python} not found: run bash loadtest/peers/{setup} first")
    if args.peer == "vllm":
        _, model_dir = load_model_config(args.model)
        command = [str(python), str(RUNNERS / "vllm_runner.py"), "--model", str(model_dir),
                   "--batch-sizes", *map(str, args.num_requests),
                   "--single-count", str(args.single_count), "--dtype", args.dtype]
        if args.long_prompts:
            command += ["--long-count", str(len(args.long_prompts)),
                        "--max-model-len", str(max(2048, max(args.long_prompts)
                                                   + LONG_PROMPT_OUTPUT))]
        if args.max_num_seqs:
            command += ["--max-num-seqs", str(args.max_num_seqs)]
        if args.max_num_batched_tokens:
            command += ["--max-num-batched-tokens", str(args.max_num_batched_tokens)]
        if args.enforce_eager:
            command.append("--enforce-eager")
        env = vllm_env(args.kv_cache_gib)
    else:
        command = [str(python), str(RUNNERS / "llama_cpp_runner.py"), "--model",
                   str(default_gguf_path()), "--single-count", str(args.single_count),
                   "--n-threads", str(os.cpu_count())]
        env = dict(os.environ)
    command += ["--workload", str(workload), "--out", str(out)]
    print(" ".join(command), flush=True)
    subprocess.run(command, env=env, check=True, timeout=args.timeout_s)


def summarize(run: dict, requests_by_id: dict) -> dict:
    """Throughput and latency of one runner run; `run` holds each request's tokens and timing."""
    done = run["requests"]
    output_tokens = sum(len(r["token_ids"]) for r in done)
    prompt_tokens = sum(len(requests_by_id[r["request_id"]].prompt_token_ids) for r in done)
    for r in done:  # every peer must honour ignore_eos and max_tokens exactly
        assert len(r["token_ids"]) == requests_by_id[r["request_id"]].max_tokens, r["request_id"]
    ttfts = [r["ttft_ms"] for r in done if r["ttft_ms"] is not None]
    tpots = [r["tpot_ms"] for r in done if r["tpot_ms"] is not None]
    return {
        "num_requests": len(done),
        "elapsed_s": run["elapsed_s"],
        "output_tokens": output_tokens,
        "output_tok_per_s": output_tokens / run["elapsed_s"],
        "total_tok_per_s": (output_tokens + prompt_tokens) / run["elapsed_s"],
        "ttft_ms_p50": percentile(ttfts, 50),
        "ttft_ms_p99": percentile(ttfts, 99),
        "tpot_ms_p50": percentile(tpots, 50),
        "tpot_ms_mean": sum(tpots) / len(tpots) if tpots else None,
    }


def same_tokens(a: dict, b: dict) -> tuple[int, int]:
    """Of the requests both runs served, how many got the same greedy tokens; and how many."""
    theirs = {r["request_id"]: r["token_ids"] for r in b["requests"]}
    both = [r for r in a["requests"] if r["request_id"] in theirs]
    return sum(theirs[r["request_id"]] == r["token_ids"] for r in both), len(both)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--peer", choices=["vllm", "llamacpp"], required=True)
    parser.add_argument("--num-requests", type=int, nargs="*", default=[128],
                        help="workload sizes; vllm runs a batch of each (llamacpp: none)")
    parser.add_argument("--single-count", type=int, default=4,
                        help="requests served one at a time (0: none)")
    parser.add_argument("--long-prompts", type=int, nargs="*", default=[],
                        help="vllm: also these prompt lengths alone, after the rest (results "
                        "kept as <peer>_long_prompts: vLLM's max_model_len grows to fit them)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--model", default="SmolLM2-135M-Instruct")
    parser.add_argument("--max-num-seqs", type=int, help="vllm: its scheduler's default if unset")
    parser.add_argument("--max-num-batched-tokens", type=int)
    parser.add_argument("--enforce-eager", action="store_true",
                        help="vllm: no torch.compile (faster start-up, slower steps)")
    parser.add_argument("--kv-cache-gib", type=int, default=4, help="vllm: VLLM_CPU_KVCACHE_SPACE")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32",
                        help="vllm: its model dtype (its results kept as vllm_bfloat16)")
    parser.add_argument("--timeout-s", type=float, default=3600)
    parser.add_argument("--result-json", default="results/peer_bench.json")
    args = parser.parse_args(argv)
    if args.peer == "llamacpp":
        if args.single_count < 1:
            parser.error("llamacpp serves requests one at a time: --single-count must be >= 1")
        if args.long_prompts:
            parser.error("--long-prompts: vllm only")
        args.num_requests = []  # no batch runs

    model_config, _ = load_model_config(args.model, weights=False)
    # engine_workload draws request i after requests 0..i-1 from one generator, so the first N
    # requests of the largest workload are exactly the N-request workload: one file serves all.
    size = max(args.num_requests + [args.single_count, 1])
    requests = engine_workload(size, args.seed, model_config.vocab_size)
    if args.long_prompts and args.peer == "vllm":  # after the rest: the runner takes the last
        requests += long_prompts(args.long_prompts, args.seed, model_config.vocab_size)
    requests_by_id = {r.request_id: r for r in requests}

    with tempfile.TemporaryDirectory(prefix="peer_bench-") as tmp:
        workload, out = Path(tmp) / "workload.jsonl", Path(tmp) / "out.json"
        workload.write_text("".join(
            json.dumps({"request_id": r.request_id, "prompt_token_ids": r.prompt_token_ids,
                        "max_tokens": r.max_tokens}) + "\n" for r in requests))
        run_peer(args, workload, out)
        raw = json.loads(out.read_text())

    modes = raw.pop("modes")
    batches = {n: summarize(run, requests_by_id) for n, run in modes.get("batch", {}).items()}
    single = summarize(modes["single"], requests_by_id) if "single" in modes else None
    long = [{"prompt_tokens": len(requests_by_id[r["request_id"]].prompt_token_ids),
             "ttft_ms": r["ttft_ms"], "tpot_ms": r["tpot_ms"]}
            for r in modes.get("long", {}).get("requests", [])]
    if single and batches:
        # Batch invariance: the same request alone and in the largest batch (which holds the
        # most of the single run's requests: every batch starts at the workload's first request).
        largest = modes["batch"][max(modes["batch"], key=int)]
        single["same_tokens_as_batch"], single["compared_with_batch"] = same_tokens(
            modes["single"], largest)

    print()
    print(f"{args.peer}: start-up {raw['startup_s']:.1f} s")
    print(f"{'run':<14}{'time s':>9}{'out tok/s':>11}{'TTFT p50 ms':>13}{'TPOT p50 ms':>13}")
    rows = [(f"batch {n}", run) for n, run in batches.items()]
    rows += [("single", single)] if single else []
    for name, run in rows:
        ttft, tpot = run["ttft_ms_p50"], run["tpot_ms_p50"]
        print(f"{name:<14}{run['elapsed_s']:>9.1f}{run['output_tok_per_s']:>11.1f}"
              f"{ttft if ttft is not None else float('nan'):>13.0f}"
              f"{tpot if tpot is not None else float('nan'):>13.1f}")
    for run in long:
        print(f"{run['prompt_tokens']:>6}-token prompt alone: TTFT {run['ttft_ms']:7.1f} ms   "
              f"TPOT {run['tpot_ms']:5.1f} ms")
    if single and "same_tokens_as_batch" in single:
        print(f"single vs batch: identical greedy outputs for "
              f"{single['same_tokens_as_batch']}/{single['compared_with_batch']} requests")

    path = Path(args.result_json)
    path.parent.mkdir(parents=True, exist_ok=True)
    result = {"benchmark": "peer_bench", "peers": {}}
    if path.exists():  # the other peer's entry stays
        result = json.loads(path.read_text())
    name = args.peer if args.dtype == "float32" else f"{args.peer}_{args.dtype}"
    if args.long_prompts:  # another context length: kept beside the sweep's entry, not over it
        name += "_long_prompts"
    result["peers"][name] = {
        "date": time.strftime("%Y-%m-%d"),
        "machine": {"platform": platform.platform(), "processor": platform.processor(),
                    "cpus": os.cpu_count(),
                    # oneDNN's instruction sets capped (e.g. AVX512_CORE_VNNI: no bf16), if set
                    "onednn_max_cpu_isa": os.environ.get("ONEDNN_MAX_CPU_ISA")},
        "params": vars(args),
        "peer": raw,  # versions, engine arguments, tuning environment, start-up time
        "batch": batches,
        "single": single,
        "long_prompts": long,
    }
    path.write_text(json.dumps(result, indent=2))
    outputs = path.with_name(f"{path.stem}_{name}_outputs.json")
    outputs.write_text(json.dumps(modes))
    print(f"wrote {path} and {outputs}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
