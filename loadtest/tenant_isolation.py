"""One tenant's latency while another misbehaves, against the shipped configuration: a steady
tenant streams requests one after another (TTFT and TPOT measured from its deltas), alone and
then beside each disturbance, in one run set on one stack per disturbance:

- `cancel-flood`: 100,000 cancels on 100,000 distinct tenant names, spread over the steady
  tenant's run (admission reads each one, and passes on none: none is of a request in flight);
- `quota-flood`: a tenant keeping `--flood-concurrency` generates in flight, far past its
  concurrency quota (`--flood-quota`, set for that tenant only) and its share of the queue; its
  excess is refused `rate_limited`, which the run counts, with every other outcome;
- `at-quota`: the same tenant keeping exactly `--flood-quota` generates in flight, so nothing is
  refused: what sharing the engine with its quota's worth of requests costs, against which the
  flood's excess is measured.

Each disturbance runs in a process of its own (as another tenant's client would), so the steady
tenant's event loop measures only the service.

    python -m loadtest.tenant_isolation --result-json results/tenant_isolation.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import sys
import time

from loadtest.metrics import percentile, write_result
from services.stack import temporary_stack
from shared.client import JetserveClient
from shared.protocol import Completion, Delta, Error, GenerateRequest

PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."


async def steady(client: JetserveClient, args, count: int, samples: dict) -> None:
    """`count` of the steady tenant's requests, one at a time: TTFT and TPOT (ms) added to
    `samples`."""
    for _ in range(count):
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
        samples["ttft"].append(1e3 * (first - start))
        if tokens > 1:
            samples["tpot"].append(1e3 * (last - first) / (tokens - 1))


def summary(samples: dict) -> dict:
    return {"requests": len(samples["ttft"]),
            **{f"ttft_p{q}_ms": round(percentile(samples["ttft"], q), 1) for q in (50, 90)},
            **{f"tpot_p{q}_ms": round(percentile(samples["tpot"], q), 2) for q in (50, 90)}}


async def cancel_flood(url: str, count: int, over_s: float, stop: asyncio.Event) -> dict:
    """`count` cancels on as many tenant names, spread evenly over `over_s` seconds."""
    client = await JetserveClient.connect(url, tenant="flooder")
    sent, batch, run = 0, 500, os.getpid()  # tenant names distinct across rounds too
    start = time.monotonic()
    try:
        while sent < count and not stop.is_set():
            for _ in range(min(batch, count - sent)):
                await client.nc.publish(f"llm.cancel.flood-{run}-{sent}",
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


async def disturb(args) -> None:
    """The disturbance process: runs until its stdin closes, then prints its outcome (JSON)."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()

    def closed() -> None:  # nothing is written to stdin: readable means closed
        loop.remove_reader(sys.stdin.fileno())
        stop.set()

    loop.add_reader(sys.stdin.fileno(), closed)
    if args.disturb == "cancel-flood":
        outcome = await cancel_flood(args.url, args.cancels, args.over_s, stop)
    else:
        outcome = await quota_flood(args.url, args.flood_quota if args.disturb == "at-quota"
                                    else args.flood_concurrency, stop)
    print(json.dumps(outcome), flush=True)


async def one_set(args, disturbance: str) -> dict:
    settings = {**({"quotas.tenants": f"{{flood: {{max_concurrent_requests: {args.flood_quota}}}}}"}
                   if disturbance != "cancel-flood" else {}),
                **{f"monitoring.metrics_port.{k}": 0
                   for k in ("admission", "priority", "batcher", "executor")}}
    if args.model:
        settings["model.name"] = args.model
    alone, beside = {"ttft": [], "tpot": []}, {"ttft": [], "tpot": []}
    outcomes: dict[str, int] = {}
    per_round = -(-args.requests // args.rounds)
    async with temporary_stack(settings=settings) as stack:
        async with await JetserveClient.connect(stack.url, tenant="steady") as client:
            await steady(client, args, 3, {"ttft": [], "tpot": []})  # warm
            # Rounds of alone, then beside the disturbance: the two sample the same stretch of
            # the machine's time (a shared host's speed drifts).
            for _ in range(args.rounds):
                started = time.monotonic()
                await steady(client, args, per_round, alone)
                took = time.monotonic() - started
                flood = await asyncio.create_subprocess_exec(
                    sys.executable, "-m", "loadtest.tenant_isolation", "--disturb", disturbance,
                    "--url", stack.url, "--over-s", str(took),
                    "--cancels", str(-(-args.cancels // args.rounds)),
                    "--flood-concurrency", str(args.flood_concurrency),
                    "--flood-quota", str(args.flood_quota),
                    stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE)
                await asyncio.sleep(2.0)  # the disturbance under way first
                await steady(client, args, per_round, beside)
                flood.stdin.close()
                out, _ = await asyncio.wait_for(flood.communicate(), timeout=120)
                for kind, count in json.loads(out.decode().strip().splitlines()[-1]).items():
                    outcomes[kind] = outcomes.get(kind, 0) + count
    alone, beside, disturbed = summary(alone), summary(beside), outcomes
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
    by_name = {run["disturbance"]: run for run in runs}
    excess = None
    if "at-quota" in by_name and "quota-flood" in by_name:
        # The flood's excess alone: its ratio over that of the same tenant at its quota.
        excess = {f"{m}_p50_ratio": round(by_name["quota-flood"][f"{m}_p50_ratio"]
                                          / by_name["at-quota"][f"{m}_p50_ratio"], 3)
                  for m in ("ttft", "tpot")}
        print(f"quota-flood against at-quota: TTFT p50 x{excess['ttft_p50_ratio']}, "
              f"TPOT p50 x{excess['tpot_p50_ratio']}", flush=True)
    if args.result_json:
        write_result(args.result_json, "tenant_isolation", config=vars(args),
                     cpu=cpu_model(), cores=len(os.sched_getaffinity(0)), runs=runs,
                     flood_excess=excess)


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
    parser.add_argument("--disturbances", nargs="+", choices=DISTURBANCES,
                        default=list(DISTURBANCES))
    parser.add_argument("--requests", type=int, default=60,
                        help="the steady tenant's, alone and again beside each disturbance")
    parser.add_argument("--rounds", type=int, default=3,
                        help="alone and beside alternate, in this many rounds")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--cancels", type=int, default=100_000)
    parser.add_argument("--flood-concurrency", type=int, default=64,
                        help="generates the flooding tenant keeps in flight")
    parser.add_argument("--flood-quota", type=int, default=2,
                        help="its quotas max_concurrent_requests")
    parser.add_argument("--result-json")
    # The disturbance's own process (started by the run, not by hand):
    parser.add_argument("--disturb", choices=DISTURBANCES, help=argparse.SUPPRESS)
    parser.add_argument("--url", help=argparse.SUPPRESS)
    parser.add_argument("--over-s", type=float, default=30.0, help=argparse.SUPPRESS)
    return parser.parse_args(argv)


DISTURBANCES = ("cancel-flood", "at-quota", "quota-flood")

if __name__ == "__main__":
    parsed = parse()
    asyncio.run(disturb(parsed) if parsed.disturb else main(parsed))
