"""llama.cpp (llama-cpp-python) on the engine benchmark's workload, run inside .peers/llamacpp.

The "local chat app" peer: one GGUF, one context, requests served one after another. Needs only
the standard library and llama_cpp. `loadtest.peer_bench` writes the workload as JSONL (one
`{"request_id", "prompt_token_ids", "max_tokens"}` per line) and reads back the JSON this writes.

Each request starts from an empty KV cache (`reset()`, so no prefix is reused from the previous
one), feeds its token ids as they are (no BOS added) and takes exactly `max_tokens` greedy tokens
from `Llama.generate` (temp 0 is llama.cpp's greedy sampler; `generate` never stops at EOS, so
`ignore_eos` holds). Timing is wall-clock around the generator: TTFT is prompt eval plus the first
token, TPOT the mean gap between later tokens.

    .peers/llamacpp/bin/python loadtest/peers/llama_cpp_runner.py --workload w.jsonl \
        --model model.gguf --out o.json
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time


def read_workload(path: str) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def run_request(llm, request: dict) -> dict:
    llm.reset()
    token_ids, stamps = [], []
    start = time.perf_counter()
    for token in llm.generate(request["prompt_token_ids"], temp=0.0, repeat_penalty=1.0):
        stamps.append(time.perf_counter())
        token_ids.append(token)
        if len(token_ids) == request["max_tokens"]:
            break
    gaps = [b - a for a, b in zip(stamps, stamps[1:])]
    return {"request_id": request["request_id"], "token_ids": token_ids,
            "elapsed_s": stamps[-1] - start,
            "ttft_ms": 1000 * (stamps[0] - start),
            "tpot_ms": 1000 * statistics.mean(gaps) if gaps else None}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workload", required=True, help="JSONL, one request per line")
    parser.add_argument("--model", required=True, help="GGUF file")
    parser.add_argument("--out", required=True)
    parser.add_argument("--single-count", type=int, help="serve only the first N requests")
    parser.add_argument("--n-ctx", type=int, default=2048)
    parser.add_argument("--n-threads", type=int, default=2)
    args = parser.parse_args(argv)

    import llama_cpp

    requests = read_workload(args.workload)[:args.single_count]
    start = time.perf_counter()
    llm = llama_cpp.Llama(model_path=args.model, n_ctx=args.n_ctx, n_threads=args.n_threads,
                          n_threads_batch=args.n_threads, logits_all=False, verbose=False)
    startup_s = time.perf_counter() - start

    per_request = [run_request(llm, r) for r in requests]
    result = {
        "peer": "llamacpp",
        "llama_cpp_version": llama_cpp.__version__,
        "platform": platform.platform(),
        "llama_args": {"model_path": args.model, "n_ctx": args.n_ctx, "n_threads": args.n_threads,
                       "n_threads_batch": args.n_threads, "logits_all": False},
        "system_info": llama_cpp.llama_print_system_info().decode(),
        "startup_s": startup_s,
        # Sequential: the run takes the sum of its requests' times.
        "modes": {"single": {"elapsed_s": sum(r.pop("elapsed_s") for r in per_request),
                             "requests": per_request}},
    }
    with open(args.out, "w") as f:
        json.dump(result, f)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
