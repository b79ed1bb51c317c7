"""The OpenAI-compatible gateway's own cost: one workload sent through HTTP (the gateway, with
`bench serve --backend openai`'s client) and straight over NATS (`bench serve`'s own), on one
stack with the shipped configuration, alternating in rounds so both sample the same stretch of
the machine's time. Per load: TTFT and TPOT p50 and output throughput of each, and the
gateway's difference; and the gateway process's own CPU time per request it served (read from
/proc), which says how many requests a second one gateway sustains on a core of its own.

    python -m loadtest.gateway_overhead --result-json results/gateway_overhead.json
"""

from __future__ import annotations

import argparse
import asyncio
import os

from loadtest.control_plane import cpu_seconds
from loadtest.metrics import percentile, write_result
from loadtest.openai_client import run_openai
from loadtest.serve import add_arguments, run
from loadtest.tenant_isolation import cpu_model
from services.stack import temporary_stack

BACKENDS = ("nats", "http")


def bench_args(args, rate: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args([
        "--model", args.model, "--request-rate", rate, "--num-requests", str(args.requests),
        "--input-len-range", *map(str, args.input_len_range),
        "--output-len-range", *map(str, args.output_len_range), "--no-progress",
        "--seed", "1"])


async def main(args) -> None:
    runs: dict[str, dict[str, list[dict]]] = {rate: {b: [] for b in BACKENDS}
                                              for rate in args.rates}
    gateway_cpu: dict[str, list[float]] = {rate: [] for rate in args.rates}  # s per request
    settings = {"model.name": args.model} if args.model != "SmolLM2-135M-Instruct" else {}
    if args.model.startswith("dummy:"):  # the gateway's own rate: room for every request
        settings["kv_cache.num_blocks"] = 4096
    async with temporary_stack(settings=settings, http_port=0) as stack:
        warm = argparse.Namespace(**{**vars(bench_args(args, "inf")), "num_requests": 8})
        await run(warm, stack.url)  # first requests pay for cold paths: not measured
        await run_openai(warm, stack.http_url)
        for round_ in range(args.rounds):
            for rate in args.rates:
                for backend in BACKENDS if round_ % 2 == 0 else BACKENDS[::-1]:
                    bench = bench_args(args, rate)
                    gateway_pid = stack.processes["gateway"].pid
                    used = cpu_seconds(gateway_pid)
                    result = await (run(bench, stack.url) if backend == "nats"
                                    else run_openai(bench, stack.http_url))
                    if backend == "http":
                        gateway_cpu[rate].append((cpu_seconds(gateway_pid) - used)
                                                 / args.requests)
                    s = result["summary"]
                    assert s["completed"] == args.requests, s["errors"]
                    runs[rate][backend].append(result)
                    print(f"round {round_} rate {rate:>4} {backend:>4}: TTFT p50 "
                          f"{s['ttft_ms']['p50']:.1f} ms, TPOT p50 {s['tpot_ms']['p50']:.2f} ms, "
                          f"{s['output_throughput']:.1f} tok/s", flush=True)
    table = []
    for rate in args.rates:
        row = {"rate": rate}
        for backend in BACKENDS:
            ttfts = [t for r in runs[rate][backend] for t in
                     (1e3 * (q["delta_times"][0] - q["send_time"]) for q in r["requests"]
                      if q["delta_times"])]
            tpots = [r["summary"]["tpot_ms"]["p50"] for r in runs[rate][backend]]
            row[backend] = {
                "ttft_p50_ms": round(percentile(ttfts, 50), 2),
                "tpot_p50_ms": round(sorted(tpots)[len(tpots) // 2], 2),
                "output_throughput": round(sum(r["summary"]["output_throughput"]
                                               for r in runs[rate][backend]) / args.rounds, 1),
                "request_throughput": round(sum(r["summary"]["request_throughput"]
                                                for r in runs[rate][backend]) / args.rounds, 1)}
        row["http_minus_nats_ttft_p50_ms"] = round(row["http"]["ttft_p50_ms"]
                                                   - row["nats"]["ttft_p50_ms"], 2)
        row["http_throughput_ratio"] = round(row["http"]["output_throughput"]
                                             / row["nats"]["output_throughput"], 3)
        per_request = sum(gateway_cpu[rate]) / len(gateway_cpu[rate])
        row["gateway_cpu_us_per_request"] = round(1e6 * per_request, 1)
        row["gateway_requests_per_core_s"] = round(1 / per_request) if per_request else None
        table.append(row)
        print(f"rate {rate:>4}: TTFT p50 NATS {row['nats']['ttft_p50_ms']} ms, HTTP "
              f"{row['http']['ttft_p50_ms']} ms ({row['http_minus_nats_ttft_p50_ms']:+} ms); "
              f"TPOT p50 {row['nats']['tpot_p50_ms']} / {row['http']['tpot_p50_ms']} ms; "
              f"output {row['nats']['output_throughput']} / {row['http']['output_throughput']} "
              f"tok/s (x{row['http_throughput_ratio']}); {row['nats']['request_throughput']} / "
              f"{row['http']['request_throughput']} req/s; the gateway's CPU "
              f"{row['gateway_cpu_us_per_request']} us a request (one core: "
              f"{row['gateway_requests_per_core_s']} req/s)", flush=True)
    if args.result_json:
        write_result(args.result_json, "gateway_overhead", config=vars(args), cpu=cpu_model(),
                     cores=len(os.sched_getaffinity(0)), table=table)


def parse(argv=None):
    parser = argparse.ArgumentParser(prog="python -m loadtest.gateway_overhead")
    parser.add_argument("--model", default="SmolLM2-135M-Instruct")
    parser.add_argument("--rates", nargs="+", default=["1", "inf"],
                        help="request rates (req/s; inf: all at once)")
    parser.add_argument("--requests", type=int, default=32, help="per run")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--input-len-range", type=int, nargs=2, default=[64, 256])
    parser.add_argument("--output-len-range", type=int, nargs=2, default=[32, 64])
    parser.add_argument("--result-json")
    return parser.parse_args(argv)


if __name__ == "__main__":
    asyncio.run(main(parse()))
