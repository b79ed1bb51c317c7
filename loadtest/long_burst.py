"""A burst of long prompts against the shipped configuration, at the nats-server's default
`max_payload` and at smaller ones: short requests first (so the batcher's pulls ask for many),
then every long prompt at once to simulated executors. Per `max_payload`: requests completed and
how long the burst took, requests handed on (admission's count: a holder taken for lost), and
the largest message a wildcard subscriber saw against the limit.

    python -m loadtest.long_burst --result-json results/long_burst.json
"""

from __future__ import annotations

import argparse
import asyncio
import random
import time

import msgspec

from loadtest.metrics import write_result
from services.stack import temporary_stack
from shared.client import JetserveClient
from shared.protocol import Completion, GenerateRequest


async def one_run(args, max_payload: int | None) -> dict:
    settings = {"model.name": args.model, **{f"monitoring.metrics_port.{k}": 0
                                             for k in ("admission", "priority", "batcher",
                                                       "executor")}}
    async with temporary_stack(executors=args.executors, settings=settings,
                               nats_settings={"max_payload": max_payload} if max_payload
                               else None) as stack:
        async with await JetserveClient.connect(stack.url, tenant="long") as client:
            largest = 0

            async def see(msg) -> None:
                nonlocal largest
                largest = max(largest, len(msg.data))

            await client.nc.subscribe(">", cb=see)
            rng = random.Random(args.seed)
            warm = [GenerateRequest(prompt_token_ids=[rng.randrange(1, 49000)
                                                      for _ in range(20)], max_tokens=4)
                    for _ in range(50)]
            await asyncio.gather(*(client.generate(r) for r in warm))
            burst = [GenerateRequest(
                max_tokens=args.max_tokens, ignore_eos=True,
                prompt_token_ids=[rng.randrange(1, 49000) for _ in range(args.prompt_tokens)])
                for _ in range(args.requests)]

            async def answer(request):
                try:
                    return await client.generate(request, timeout=args.timeout)
                except Exception as exc:  # no answer in time
                    return exc

            start = time.monotonic()
            outputs = await asyncio.gather(*(answer(r) for r in burst))
            took = time.monotonic() - start
            reply = await client.nc.request("$SRV.STATS.admission", b"", timeout=5)
            admission = next(ep["data"] for ep in msgspec.json.decode(reply.data)["endpoints"]
                             if ep.get("data"))
            limit = client.nc.max_payload
    completed = sum(isinstance(o, Completion) for o in outputs)
    return {"max_payload": limit, "requests": args.requests, "completed": completed,
            "unanswered": sum(isinstance(o, Exception) for o in outputs),
            "seconds": round(took, 1),
            "handed_on": admission["generates_handed_on"] + admission["durable_handed_on"],
            "largest_message_bytes": largest}


async def main(args) -> None:
    runs = []
    for max_payload in args.max_payload:
        run = await one_run(args, max_payload or None)
        runs.append(run)
        print(f"max_payload {run['max_payload']:>8}: {run['completed']}/{run['requests']} "
              f"completed in {run['seconds']} s, {run['unanswered']} unanswered, "
              f"{run['handed_on']} handed on, largest message {run['largest_message_bytes']} B",
              flush=True)
    if args.result_json:
        write_result(args.result_json, "long_burst", config=vars(args), runs=runs)


def parse(argv=None):
    parser = argparse.ArgumentParser(prog="python -m loadtest.long_burst")
    parser.add_argument("--model", default="sim:llama3-8b-h100")
    parser.add_argument("--executors", type=int, default=2)
    parser.add_argument("--requests", type=int, default=400)
    parser.add_argument("--prompt-tokens", type=int, default=7000)
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--max-payload", type=int, nargs="+", default=[0, 262144, 65536],
                        help="the nats-server's max_payload per run (0: its default, 1 MiB)")
    parser.add_argument("--timeout", type=float, default=240.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--result-json")
    return parser.parse_args(argv)


if __name__ == "__main__":
    asyncio.run(main(parse()))
