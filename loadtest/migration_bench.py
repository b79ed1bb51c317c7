"""What an executor's death costs a durable request: the same load three times on two simulated
executors (`sim:smollm2-cpu`, ~60 ms a step, as SmolLM2 on this CPU): undisturbed; with one
executor SIGKILLed mid-load and restarted after a pause, its requests continuing from their
checkpoints; and the same with `distributed.resume_from_checkpoints: false`, the baseline where
they run again from the start. Per request handed on from the dead executor (admission's log
names them, with the checkpoint it resumed from): the added latency, its end-to-end time minus
the undisturbed run's. Also: requests lost and duplicated (one result each in LLM_RESULTS
expected), and outputs equal to the undisturbed run's.

    python -m loadtest.migration_bench --result-json results/migration.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import signal
import statistics
import time
from pathlib import Path

from loadtest.metrics import nearest_rank, write_result
from services.stack import temporary_stack
from shared.client import JetserveClient
from shared.protocol import Completion, GenerateRequest
from shared.subjects import RESULTS_STREAM


def settings(args, checkpoints: bool = True) -> dict:
    return {"model.name": args.model, "kv_cache.num_blocks": 4096,
            "distributed.resume_from_checkpoints": checkpoints,
            "distributed.heartbeat_interval_s": args.heartbeat_interval_s,
            "distributed.heartbeat_timeout_s": args.heartbeat_timeout_s,
            "scheduler.batch_level.max_num_seqs": args.max_num_seqs,
            **{f"monitoring.metrics_port.{k}": 0
               for k in ("admission", "priority", "batcher", "executor")}}


def log_events(log_dir: Path, service: str, event: str) -> list[dict]:
    """The JSON log records of `event` in a service's log (every instance: restarts append)."""
    records = []
    for line in (log_dir / f"{service}.log").read_text(errors="replace").splitlines():
        if line.startswith("{") and (record := json.loads(line)).get("event") == event:
            records.append(record)
    return records


async def one_run(args, kill: bool, checkpoints: bool = True) -> dict:
    rng = random.Random(args.seed)
    requests = [GenerateRequest(request_id=f"m-{i}", prompt=f"migration {i}",
                                max_tokens=rng.randint(*args.output_len_range), ignore_eos=True,
                                temperature=0.0, seed=i) for i in range(args.num_requests)]
    async with temporary_stack(executors=2, settings=settings(args, checkpoints)) as stack:
        async with await JetserveClient.connect(stack.url, tenant="bench") as client:
            started = time.monotonic()
            for request in requests:
                await client.submit(request)
            if kill:
                await asyncio.sleep(args.kill_after_s)
                stack.processes["executor-0"].send_signal(signal.SIGKILL)
                await stack.processes["executor-0"].wait()
                await asyncio.sleep(args.pause_s)
                await stack.restart("executor-0")
            results = await asyncio.gather(*(client.result(r.request_id, timeout=600)
                                             for r in requests))
            wall_s = time.monotonic() - started
            info = await client.js.stream_info(RESULTS_STREAM)
            handed_on = log_events(stack.log_dir, "admission",
                                   "durable request handed on from a lost holder")
            redelivered = log_events(stack.log_dir, "admission",
                                     "durable request lost with its holder; redelivering")
    assert all(isinstance(r, Completion) for r in results), results
    return {"e2e_ms": {r.request_id: r.metrics.e2e_ms for r in results},
            "tokens": {r.request_id: r.token_ids for r in results},
            "results_stored": info.state.messages, "wall_s": wall_s,
            "handed_on": {h["request_id"]: h["resume_from"] for h in handed_on},
            "redelivered": [h["request_id"] for h in redelivered]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="sim:smollm2-cpu")
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--output-len-range", type=int, nargs=2, default=(60, 120))
    parser.add_argument("--max-num-seqs", type=int, default=16)
    parser.add_argument("--kill-after-s", type=float, default=3.0)
    parser.add_argument("--pause-s", type=float, default=1.0)
    parser.add_argument("--heartbeat-interval-s", type=float, default=0.2)
    parser.add_argument("--heartbeat-timeout-s", type=float, default=1.5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--result-json", default="results/migration.json")
    args = parser.parse_args(argv)

    calm = asyncio.run(one_run(args, kill=False))
    runs = {"from checkpoints": asyncio.run(one_run(args, kill=True)),
            "from the start": asyncio.run(one_run(args, kill=True, checkpoints=False))}
    summaries, added_by_run = {}, {}
    for name, hit in runs.items():
        migrated = sorted(hit["handed_on"])
        added = [hit["e2e_ms"][i] - calm["e2e_ms"][i] for i in migrated]
        added_by_run[name] = dict(zip(migrated, added))
        summaries[name] = {
            "requests": args.num_requests,
            "lost": args.num_requests - len(hit["e2e_ms"]),
            "duplicated": hit["results_stored"] - args.num_requests,
            "handed_on": len(migrated),
            "resumed_from_a_checkpoint": sum(1 for i in migrated if hit["handed_on"][i] > 0),
            "resumed_tokens_mean": (statistics.fmean(hit["handed_on"].values())
                                    if migrated else 0.0),
            "redelivered_by_jetstream": len(hit["redelivered"]),
            "outputs_equal_to_the_undisturbed_run": sum(
                hit["tokens"][i] == calm["tokens"][i] for i in calm["tokens"]),
            "added_latency_ms_p50": nearest_rank(added, 50) if added else None,
            "added_latency_ms_p99": nearest_rank(added, 99) if added else None,
            "wall_s": hit["wall_s"],
        }
    print(f"{args.num_requests} durable requests on 2 simulated executors ({args.model}); "
          f"executor-0 SIGKILLed at {args.kill_after_s:g} s, restarted {args.pause_s:g} s later; "
          f"undisturbed: e2e p50 {nearest_rank(list(calm['e2e_ms'].values()), 50):.0f} ms, "
          f"{calm['wall_s']:.1f} s")
    print(f"{'':<38}" + "".join(f"{name:>20}" for name in summaries))
    for key in next(iter(summaries.values())):
        cells = [summaries[name][key] for name in summaries]
        print(f"  {key:<36}" + "".join(
            f"{(round(c, 1) if isinstance(c, float) else c)!s:>20}" for c in cells))
    write_result(args.result_json, "migration", params=vars(args), summary=summaries,
                 undisturbed={"wall_s": calm["wall_s"], "e2e_ms": calm["e2e_ms"]},
                 added_latency_ms=added_by_run)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
