"""The load-aware batch size (docs/scheduling.md): each executor's limit on concurrent sequences, moved
by a controller that looks back over one interval at a time.

Every `interval_s` the executor hands the controller what it saw (`Interval`): requests waiting
here for a slot, the batch's size, TPOT p99 over the requests that decoded during the interval,
free KV blocks and preemptions. The controller answers with a new limit or none. In order:

- **memory tight** (a preemption, or free blocks under `kv_free_threshold` of the pool): shrink;
- **SLO broken** (TPOT p99 over `tpot_slo_ms`): shrink;
- **demand with headroom** (requests wait, the batch fills `high_load_threshold` of the limit,
  TPOT p99 at most `GROW_HEADROOM` of the SLO, or no TPOT samples in the interval and the latest
  ones within the SLO; never before any interval had samples): grow;
- **low load** (the batch under `low_load_threshold` of the limit, nothing waiting): shrink, so a
  burst starts at a latency-safe size and grows while TPOT allows;
- otherwise hold.

Each move is `step_size`, within [min_batch_size, max_batch_size]. The executor applies a new
limit at its next step (running sequences above a lowered limit finish; none is preempted for
it) and advertises it in its heartbeat, so the batcher's room follows.
"""

from __future__ import annotations

import math
import time
from collections import deque
from dataclasses import asdict, dataclass

from shared.config import LoadAware

# Grow only while TPOT p99 is at most this share of the SLO: one more step of sequences adds
# to every step's time, and growing into a breach only to shrink again helps nobody.
GROW_HEADROOM = 0.9


@dataclass
class Interval:
    """What one executor saw over the last interval."""

    waiting: int  # requests here that a larger limit would start
    running: int
    tpot_p99_ms: float | None  # None: no request decoded two tokens in the interval
    free_kv_fraction: float
    preemptions: int


@dataclass
class Decision:
    at: float  # wall clock
    old: int
    new: int
    reason: str
    running: int
    waiting: int
    tpot_p99_ms: float | None


class BatchSizeController:
    def __init__(self, config: LoadAware):
        self.config = config
        self.limit = config.initial_batch_size
        self.decisions: deque[Decision] = deque(maxlen=20)  # the latest, for $SRV.STATS
        # Whether the latest interval with TPOT samples met the SLO (None: none had samples
        # yet). Steps longer than the interval leave some intervals without samples: those
        # grow only on the evidence of the latest one that had them, never on none.
        self.met: bool | None = None

    def update(self, seen: Interval, now: float | None = None) -> Decision | None:
        """The limit for the next interval; a Decision when it changed."""
        c = self.config
        full = seen.running >= c.high_load_threshold * self.limit
        p99 = seen.tpot_p99_ms
        if p99 is not None:
            self.met = p99 <= c.tpot_slo_ms
        if seen.preemptions or seen.free_kv_fraction < c.kv_free_threshold:
            new, reason = self.limit - c.step_size, (
                f"kv memory tight: {seen.preemptions} preemptions, "
                f"{seen.free_kv_fraction:.0%} of blocks free")
        elif p99 is not None and p99 > c.tpot_slo_ms:
            new, reason = self.limit - c.step_size, f"tpot p99 {p99:.1f} ms > slo {c.tpot_slo_ms:g}"
        elif seen.waiting and full and (p99 <= GROW_HEADROOM * c.tpot_slo_ms if p99 is not None
                                        else self.met is True):
            new, reason = self.limit + c.step_size, (
                f"{seen.waiting} waiting, tpot p99 "
                f"{'-' if p99 is None else f'{p99:.1f}'} ms within slo {c.tpot_slo_ms:g}")
        elif not seen.waiting and seen.running < c.low_load_threshold * self.limit:
            new, reason = self.limit - c.step_size, f"low load: {seen.running} running"
        else:
            return None
        new = min(c.max_batch_size, max(c.min_batch_size, new))
        if new == self.limit:
            return None
        decision = Decision(time.time() if now is None else now, self.limit, new, reason,
                            seen.running, seen.waiting, p99)
        self.limit = new
        self.decisions.append(decision)
        return decision

    def stats(self) -> dict:
        return {"mode": "adaptive", "limit": self.limit, "tpot_slo_ms": self.config.tpot_slo_ms,
                "decisions": [asdict(d) for d in self.decisions]}


def p99(samples: list[float]) -> float | None:
    """The 99th percentile (nearest rank), None for no samples."""
    if not samples:
        return None
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, math.ceil(0.99 * len(ordered)) - 1)]
