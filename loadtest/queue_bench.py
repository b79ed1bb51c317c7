"""What a pull from priority's waiting queue costs, against rebuilding the order on every pull.

Scores move with time (urgency, aging), load and fairness, so a heap built at push time goes
stale. The queue rescores every waiting request in one vectorised pass and selects the best k in
O(n). The baselines rebuild the order per pull: the same vectorised scores with a full sort, and
the scores computed request by request in Python, then sorted.

    python -m loadtest.queue_bench --result-json results/queue_bench.json
"""

from __future__ import annotations

import argparse
import math
import platform
import random
import time
from pathlib import Path

import numpy as np

from loadtest.metrics import write_result
from services.priority import policy
from services.priority.request_level import RequestScheduler
from shared.config import RequestLevel
from shared.messages import WorkItem
from shared.protocol import GenerateRequest


def fill(sched: RequestScheduler, n: int, tenants: int, rng: random.Random, now: float) -> None:
    for i in range(n):
        request = GenerateRequest(request_id=f"r{i}", prompt_token_ids=[1] * rng.randint(16, 64),
                                  max_tokens=rng.randint(16, 512),
                                  priority=rng.choice([1, 5, 9]))
        deadline = now + rng.uniform(1, 30) if rng.random() < 0.5 else None
        sched.push(WorkItem(request=request, tenant=f"t{rng.randrange(tenants)}",
                            arrival_time=now - rng.uniform(0, 50), deadline=deadline))


def mean_s(fn, repeats: int) -> float:
    """Mean seconds per call of fn over `repeats` calls."""
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - start) / repeats


def time_pulls(sched: RequestScheduler, k: int, now: float, repeats: int) -> float:
    """Mean seconds per pull of k, each followed by pushing the k back (n stays constant)."""
    total = 0.0
    for _ in range(repeats):
        start = time.perf_counter()
        dispatches = sched.pop(k, now)
        total += time.perf_counter() - start
        for d in dispatches:
            sched.push(d.item)
    return total / repeats


def time_sorted_rebuild(sched: RequestScheduler, k: int, now: float, repeats: int) -> float:
    """The same vectorised scores, then a full sort: O(n log n) per pull."""
    return mean_s(lambda: np.argsort(-sched.scores(now).key, kind="stable")[:k], repeats)


def time_python_rebuild(sched: RequestScheduler, k: int, now: float, repeats: int) -> float:
    """Score each request in Python, then sort (what a per-pull heap rebuild costs)."""
    cfg = sched.cfg
    items = sched.queue.items()
    lags = {t: sched.counters.lag(t) for t in sched.queue.tenants}
    top = cfg.priority_levels - 1

    def key(item: WorkItem) -> float:
        if now - item.arrival_time >= cfg.max_wait_s:
            return policy.AGED + now - item.arrival_time
        slack = (item.deadline - now) if item.deadline is not None else math.inf
        urgency = 0.0 if slack == math.inf else 1 / (1 + math.exp(
            max(-50.0, min(50.0, slack / cfg.time_window))))
        demand = item.num_prompt_tokens + sched.predictor.predict(
            item.tenant, item.request.priority, item.request.max_tokens)
        return (cfg.base_weight * item.request.priority / top + cfg.urgency_weight * urgency
                + cfg.resource_weight * math.log(demand) / cfg.resource_scale
                - min(cfg.fairness_max,
                      cfg.fairness_factor * lags[item.tenant] / cfg.fairness_scale_tokens))

    return mean_s(lambda: sorted(items, key=key, reverse=True)[:k], repeats)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m loadtest.queue_bench", description=__doc__)
    parser.add_argument("--sizes", type=int, nargs="+", default=[1000, 10_000, 100_000])
    parser.add_argument("--pulls", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--tenants", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--result-json", type=Path)
    args = parser.parse_args(argv)

    rows = []
    print(f"{'waiting':>8}{'tenants':>8}{'k':>5}{'pull (ms)':>12}{'sort rebuild':>14}"
          f"{'python rebuild':>16}")
    for n in args.sizes:
        for tenants in args.tenants:
            now = time.time()
            sched = RequestScheduler(RequestLevel(max_pending_requests=n + max(args.pulls)))
            fill(sched, n, tenants, random.Random(0), now)
            for k in args.pulls:
                repeats = max(3, args.repeats * 1000 // max(n, 1000))
                row = {"waiting": n, "tenants": tenants, "k": k,
                       "pull_ms": 1e3 * time_pulls(sched, k, now, repeats),
                       "sorted_rebuild_ms": 1e3 * time_sorted_rebuild(sched, k, now, repeats),
                       "python_rebuild_ms": 1e3 * time_python_rebuild(sched, k, now,
                                                                        max(1, repeats // 4))}
                rows.append(row)
                print(f"{n:>8}{tenants:>8}{k:>5}{row['pull_ms']:>12.3f}"
                      f"{row['sorted_rebuild_ms']:>14.3f}{row['python_rebuild_ms']:>16.3f}")
    if args.result_json:
        write_result(args.result_json, "queue_bench", rows=rows,
                     machine=f"{platform.machine()}, python {platform.python_version()}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
