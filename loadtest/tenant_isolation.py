"""One tenant's latency while another misbehaves, against the shipped configuration: a steady
tenant streams requests one after another (TTFT and TPOT measured from its deltas), alone and
then beside each disturbance, in one run set on one stack per disturbance:

- `cancel-flood`: 100,000 cancels on 100,000 distinct tenant names, spread over the steady
  tenant's run (priority and every executor read each one);
- `quota-flood`: a tenant keeping `--flood-concurrency` generates in flight, far past its
  concurrency quota (`--flood-quota`, set for that tenant only) and its share of the queue; its
  excess is refused `rate_limited`, which the run counts, with every other outcome.

    python -m loadtest.tenant_isolation --result-json results/tenant_isolation.json
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import time

from loadtest.metrics import percentile, write_result
from services.stack import temporary_stack
from shared.client import JetserveClient
from shared.protocol import Completion, Delta, Error, GenerateRequest

PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."


async def steady(client: JetserveClient, args) -> dict:
    """The steady tenant's requests, one at a time: TTFT and TPOT p50/p90 (ms)."""
    ttfts, tpots = [], []
    for i in range(args.requests):
        request = GenerateRequest(prompt=PROMPT, max_tokens=args.max_tokens, temperature=0.0,
                                  ignore_eos=True, request_id=f"steady-{time.monotonic_ns()}")
        start = time.perf_counter()
        first = last = None
        tokens = 0
        async for out in client.stream(request, timeout=120):
            now = time.perf_counter()
            if isinstance(out, Delta):
                first = first or now
                last = now
                tokens += len(out.token_ids)
            elif not isinstance(out, Completion):
                raise RuntimeError(f"the steady tenant's request failed: {out}")
        ttfts.append(1e3 * (first - start))
        if tokens > 1:
            tpots.append(1e3 * (last - first) / (tokens - 1))
    return {"requests": len(ttfts),
            **{f"ttft_p{q}_ms": round(percentile(ttfts, q), 1) for q in (50, 90)},
            **{f"tpot_p{q}_ms": round(percentile(tpots, q), 2) for q in (50, 90)}}


async def cancel_flood(url: str, count: int, over_s: float, stop: asyncio.Event) -> dict:
    """`count` cancels on as many tenant names, spread evenly over `over_s` seconds."""
    client = await JetserveClient.connect(url, tenant="flooder")
    sent, batch = 0, 500
    start = time.monotonic()
    try:
        while sent < count and not stop.is_set():
            for _ in range(min(batch, count - sent)):
                await client.nc.publish(f"llm.cancel.flood-{sent}",
                                        b'{"type":"cancel","request_id":"x"}')
                sent += 1
            await client.nc.flush()
            ahead = start + over_s * sent / count - time.monotonic()
            if ahead > 0:
                await asyncio.sleep(ahead)
    finally:
        await client.close()
    return {"cancels_sent": sent, "seconds": round(time.monotonic() - start, 1)}


async def quota_flood(url: str, concurrency: int, stop: asyncio.Event) -> dict:
    """Keep `concurrency` generates in flight until told to stop; count the outcomes."""
    outcomes: dict[str, int] = {}
    client = await JetserveClient.connect(url, tenant="flood")

    async def one_at_a_time() -> None:
        while not stop.is_set():
            out = await client.generate(GenerateRequest(
                prompt=PROMPT, max_tokens=64, ignore_eos=True), timeout=300)
            kind = "completed" if isinstance(out, Completion) else out.code
            outcomes[kind] = outcomes.get(kind, 0) + 1
            if isinstance(out, Error) and out.retry_after_ms:
                await asyncio.sleep(0.05)  # a client that ignores most of the hint

    try:
        await asyncio.gather(*(one_at_a_time() for _ in range(concurrency)))
    finally:
        await client.close()
    return outcomes


async def one_set(args, disturbance: str) -> dict:
    settings = {**({"quotas.tenants": f"{{flood: {{max_concurrent_requests: {args.flood_quota}}}}}"}
                   if disturbance == "quota-flood" else {}),
                **{f"monitoring.metrics_port.{k}": 0
                   for k in ("admission", "priority", "batcher", "executor")}}
    if args.model:
        settings["model.name"] = args.model
    async with temporary_stack(settings=settings) as stack:
        async with await JetserveClient.connect(stack.url, tenant="steady") as client:
            await steady(client, argparse.Namespace(**{**vars(args), "requests": 3}))  # warm
            started = time.monotonic()
            alone = await steady(client, args)
            took = time.monotonic() - started
            stop = asyncio.Event()
            flood = asyncio.create_task(
                cancel_flood(stack.url, args.cancels, took, stop) if disturbance ==
                "cancel-flood" else quota_flood(stack.url, args.flood_concurrency, stop))
            await asyncio.sleep(1.0)  # the disturbance under way first
            beside = await steady(client, args)
            stop.set()
            disturbed = await flood
    return {"disturbance": disturbance, "alone": alone, "beside": beside,
            "ttft_p50_ratio": round(beside["ttft_p50_ms"] / alone["ttft_p50_ms"], 3),
            "tpot_p50_ratio": round(beside["tpot_p50_ms"] / alone["tpot_p50_ms"], 3),
            "disturbance_outcome": disturbed}


async def main(args) -> None:
    runs = []
    for disturbance in args.disturbances:
        run = await one_set(args, disturbance)
        runs.append(run)
        a, b = run["alone"], run["beside"]
        print(f"{disturbance:>12}: TTFT p50 {a['ttft_p50_ms']} -> {b['ttft_p50_ms']} ms "
              f"(x{run['ttft_p50_ratio']}), TPOT p50 {a['tpot_p50_ms']} -> {b['tpot_p50_ms']} ms "
              f"(x{run['tpot_p50_ratio']}); {run['disturbance_outcome']}", flush=True)
    if args.result_json:
        write_result(args.result_json, "tenant_isolation", config=vars(args),
                     cpu=cpu_model(), cores=len(os.sched_getaffinity(0)), runs=runs)


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as info:
            return next(line.split(":", 1)[1].strip() for line in info
                        if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.machine()


def parse(argv=None):
    parser = argparse.ArgumentParser(prog="python -m loadtest.tenant_isolation")
    parser.add_argument("--model", default=None, help="default: the shipped one")
    parser.add_argument("--disturbances", nargs="+", default=["cancel-flood", "quota-flood"],
                        choices=["cancel-flood", "quota-flood"])
    parser.add_argument("--requests", type=int, default=30, help="the steady tenant's, per phase")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--cancels", type=int, default=100_000)
    parser.add_argument("--flood-concurrency", type=int, default=64,
                        help="generates the flooding tenant keeps in flight")
    parser.add_argument("--flood-quota", type=int, default=2,
                        help="its quotas max_concurrent_requests")
    parser.add_argument("--result-json")
    return parser.parse_args(argv)


if __name__ == "__main__":
    asyncio.run(main(parse()))
