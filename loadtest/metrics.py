"""Per-request records on the client's clock, and the figures a benchmark run reports.

TTFT: send to first Delta. E2E: send to the final message. TPOT: (E2E - TTFT) / (output tokens
- 1). ITL: every gap between consecutive Deltas. Percentiles interpolate linearly between the
closest ranks (numpy's default), so p50 of [1, 2, 3, 4] is 2.5.
"""

from __future__ import annotations

import json
import math
import subprocess
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class RequestRecord:
    request_id: str
    tenant: str
    priority: int
    send_time: float  # seconds from the start of the run
    prompt_tokens: int = 0
    deadline_ms: float | None = None
    delta_times: list[float] = field(default_factory=list)
    delta_tokens: list[int] = field(default_factory=list)
    end_time: float | None = None  # None: still outstanding when the run ended
    output_tokens: int = 0
    finish_reason: str | None = None
    error: str | None = None  # the Error's code
    queue_wait_ms: float | None = None  # the Completion's: waiting at priority, server clock
    scheduled_ms: float | None = None  # the Completion's: from admission to its first step
    server_ttft_ms: float | None = None  # the Completion's: from admission to its first token
    cached_tokens: int = 0  # the Completion's: prompt tokens found in the prefix cache
    preemptions: int = 0  # the Completion's: times the executor preempted it
    recomputed_tokens: int = 0  # the Completion's: KV computed again after preemptions

    @property
    def executor_queue_ms(self) -> float | None:
        """From dispatch at priority to the first step at the executor (server clock)."""
        if self.scheduled_ms is None or self.queue_wait_ms is None:
            return None
        return max(0.0, self.scheduled_ms - self.queue_wait_ms)

    @property
    def ok(self) -> bool:
        return self.end_time is not None and self.error is None

    @property
    def ttft(self) -> float | None:
        return self.delta_times[0] - self.send_time if self.ok and self.delta_times else None

    @property
    def e2e(self) -> float | None:
        return self.end_time - self.send_time if self.ok else None

    @property
    def tpot(self) -> float | None:
        if not self.ok or self.output_tokens < 2 or self.ttft is None:
            return None
        return (self.e2e - self.ttft) / (self.output_tokens - 1)

    @property
    def itls(self) -> list[float]:
        return [b - a for a, b in zip(self.delta_times, self.delta_times[1:])] if self.ok else []


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    position = (len(ordered) - 1) * q / 100
    low, high = math.floor(position), math.ceil(position)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def nearest_rank(values: list[float], q: float) -> float:
    """The `q`th percentile (0-100) as one of the values, the nearest rank (no interpolation)."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))]


def distribution(values_s: list[float]) -> dict[str, float | None]:
    """mean, p50, p90, p99 and max in milliseconds."""
    values = [1e3 * v for v in values_s]
    return {"mean": sum(values) / len(values) if values else None,
            "p50": percentile(values, 50), "p90": percentile(values, 90),
            "p99": percentile(values, 99), "max": max(values, default=None),
            "count": len(values)}


def jain_index(values: list[float]) -> float | None:
    """(Σx)² / (n·Σx²): 1 when all are equal, 1/n when one takes everything."""
    if not values or not any(values):
        return None
    return sum(values) ** 2 / (len(values) * sum(v * v for v in values))


@dataclass(frozen=True)
class Slo:
    """Goodput limits in ms; a request counts only if it meets every one given. `deadline`:
    a request with `deadline_ms` must also complete in full within it."""

    ttft_ms: float | None = None
    tpot_ms: float | None = None
    e2e_ms: float | None = None
    deadline: bool = False

    @classmethod
    def parse(cls, items: list[str] | None) -> Slo | None:
        """`["ttft:500", "tpot:50", "deadline"]` -> Slo(ttft_ms=500, tpot_ms=50, deadline=True)."""
        if not items:
            return None
        limits: dict = {}
        for item in items:
            if item == "deadline":
                limits["deadline"] = True
                continue
            name, _, value = item.partition(":")
            if name not in ("ttft", "tpot", "e2e") or not value:
                raise ValueError(f"--goodput {item!r}: expected ttft:MS, tpot:MS, e2e:MS or "
                                 f"deadline")
            limits[f"{name}_ms"] = float(value)
        return cls(**limits)

    def met(self, record: RequestRecord) -> bool:
        if not record.ok:
            return False
        if self.deadline and record.deadline_ms is not None and (
                record.finish_reason == "deadline" or 1e3 * record.e2e > record.deadline_ms):
            return False
        checks = [(self.ttft_ms, record.ttft), (self.e2e_ms, record.e2e)]
        if record.tpot is not None:  # a one-token request has no TPOT to hold to a limit
            checks.append((self.tpot_ms, record.tpot))
        return all(limit is None or (value is not None and 1e3 * value <= limit)
                   for limit, value in checks)


def latency_figures(records: list[RequestRecord], duration_s: float, slo: Slo | None) -> dict:
    """The figures of one group of requests (a run, a priority class, a tenant)."""
    done = [r for r in records if r.ok]
    output_tokens = sum(r.output_tokens for r in done)
    figures = {
        "requests": len(records), "completed": len(done),
        "failed": sum(1 for r in records if r.error is not None),
        "outstanding": sum(1 for r in records if r.end_time is None),
        "output_tokens": output_tokens,
        "request_throughput": len(done) / duration_s if duration_s else None,
        "output_throughput": output_tokens / duration_s if duration_s else None,
        "ttft_ms": distribution([r.ttft for r in done if r.ttft is not None]),
        "tpot_ms": distribution([r.tpot for r in done if r.tpot is not None]),
        "itl_ms": distribution([gap for r in done for gap in r.itls]),
        "e2e_ms": distribution([r.e2e for r in done]),
        # Where a request waited before its first step: priority's global queue, then the
        # executor (dispatch, transit and its local queue).
        "queue_wait_ms": distribution([r.queue_wait_ms / 1e3 for r in done
                                       if r.queue_wait_ms is not None]),
        "executor_queue_ms": distribution([r.executor_queue_ms / 1e3 for r in done
                                           if r.executor_queue_ms is not None]),
        # TTFT on the server's clock, from admission: the client's TTFT less its hop to
        # admission, the first token's way back, and the client's own delays.
        "server_ttft_ms": distribution([r.server_ttft_ms / 1e3 for r in done
                                        if r.server_ttft_ms is not None]),
        "preemptions": sum(r.preemptions for r in done),
        "recomputed_tokens": sum(r.recomputed_tokens for r in done),
    }
    prompt_tokens = sum(r.prompt_tokens for r in done)
    figures["prefix_cache_hit_rate"] = (sum(r.cached_tokens for r in done) / prompt_tokens
                                        if prompt_tokens else None)
    with_deadline = [r for r in records if r.deadline_ms is not None]
    if with_deadline:
        met = sum(1 for r in with_deadline if r.ok and 1e3 * r.e2e <= r.deadline_ms)
        figures["deadline_met_fraction"] = met / len(with_deadline)
        figures["deadline_exceeded"] = sum(1 for r in with_deadline
                                           if r.error == "deadline_exceeded"
                                           or r.finish_reason == "deadline")
    if slo is not None:
        good = sum(1 for r in done if slo.met(r))
        figures["goodput"] = good / duration_s if duration_s else None
        figures["goodput_fraction"] = good / len(records) if records else None
    return figures


def summarize(records: list[RequestRecord], duration_s: float, slo: Slo | None = None) -> dict:
    """Every figure of a run: overall, per priority class, per tenant; fairness; errors."""
    tenants = sorted({r.tenant for r in records})
    served = {t: sum(r.output_tokens for r in records if r.tenant == t and r.ok) for t in tenants}
    errors = dict(Counter(r.error for r in records if r.error is not None))
    summary = latency_figures(records, duration_s, slo)
    summary.update({
        "duration_s": duration_s,
        "total_token_throughput": (sum(r.prompt_tokens + r.output_tokens for r in records if r.ok)
                                   / duration_s if duration_s else None),
        "errors": errors,
        "outstanding_request_ids": [r.request_id for r in records if r.end_time is None],
        "per_priority": {str(p): latency_figures([r for r in records if r.priority == p],
                                                 duration_s, slo)
                         for p in sorted({r.priority for r in records}, reverse=True)},
        "per_tenant": {t: latency_figures([r for r in records if r.tenant == t], duration_s, slo)
                       for t in tenants},
        "tenant_served_tokens": served,
        "jain_fairness": jain_index(list(served.values())),
    })
    return summary


def write_result(path: str | Path, benchmark: str, **fields) -> Path:
    """A benchmark's full result as JSON (`benchmark`, today's `date`, then `fields`), its folder
    made if need be; says where it went."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"benchmark": benchmark, "date": time.strftime("%Y-%m-%d"),
                                **fields}, indent=2))
    print(f"wrote {path}")
    return path


def child_result(command: list[str], what: str, cwd: str | Path, timeout: float) -> dict:
    """The JSON a benchmark's child process printed last (each setting run in a process of its
    own); exits, with the end of its stderr, if it failed."""
    done = subprocess.run(command, cwd=cwd, capture_output=True, text=True, timeout=timeout)
    if done.returncode != 0:
        raise SystemExit(f"a run with {what} exited {done.returncode}:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])
