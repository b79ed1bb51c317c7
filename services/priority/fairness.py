"""Fairness between tenants (virtual token counters) and between priority classes (TTFT SLO
feedback on the class weights)."""

from __future__ import annotations

import math
from collections import OrderedDict, deque

import numpy as np

from shared.config import RequestLevel


# Idle tenants whose counters are kept while ahead of the least-served active tenant's (they
# are still paying off a lead): past this many, those with the least lead are forgotten.
MAX_IDLE_COUNTERS = 10_000


class TenantCounters:
    """Virtual token counters (VTC): each tenant's counter grows by the tokens it is served
    (prompt + 2 x output), divided by its weight. The least-served active tenant is favoured;
    a tenant that becomes active starts no lower than the least-served active one, so time spent
    idle is not banked as credit. Active: requests waiting here (backlogged) or running at an
    executor — a tenant whose requests never wait, because it asks for less than its share, is
    still competing for the executors its requests run on."""

    def __init__(self, weights: dict[str, float] | None = None):
        self.weights = dict(weights or {})
        self.counters: dict[str, float] = {}
        self.highest = 0.0  # the highest counter forgotten (see forget_idle)
        self.backlog: dict[str, int] = {}  # tenant -> requests waiting
        self.running: set[str] = set()  # tenants with requests at executors (kept by the caller)
        self.max_idle = MAX_IDLE_COUNTERS  # idle tenants ahead of the floor kept (forget_idle)

    def active(self) -> set[str]:
        return self.running.union(self.backlog)

    def forget_idle(self, busy: set[str] = frozenset()) -> int:
        """Drop the counters of idle tenants that are no further ahead than the least-served
        active one (with nobody active: all of them), and return how many went. Nothing about
        the order changes: such a tenant, active again, would start at that floor anyway (with
        nobody active, at the highest counter, which is kept). So the counters follow the
        tenants active lately and those still paying off a lead, not every tenant ever seen.
        `busy`: tenants whose dispatched requests have not ended, though no executor has
        reported them yet (a Done will correct their counter: it must still be there)."""
        active = self.active() | busy
        floor = self.floor(active)
        floor = math.inf if floor is None else floor
        idle = [t for t, c in self.counters.items() if c <= floor and t not in active]
        for tenant in idle:
            self.highest = max(self.highest, self.counters.pop(tenant))
        # Past max_idle idle tenants still ahead of the floor (a stream of new tenants each
        # served once keeps the floor where they start: none falls back to it), those with the
        # least lead go too, their lead forgiven: the counters, and the snapshot priority saves,
        # stay bounded.
        ahead = len(self.counters) - sum(1 for t in active if t in self.counters)
        if ahead > self.max_idle:  # forgiven, not kept as `highest` (where unknown ones start)
            leads = sorted((c, t) for t, c in self.counters.items() if t not in active)
            for _, tenant in leads[:ahead - self.max_idle]:
                del self.counters[tenant]
            return len(idle) + ahead - self.max_idle
        return len(idle)

    def cost(self, prompt_tokens: int, output_tokens: int) -> float:
        return float(prompt_tokens + 2 * output_tokens)

    def in_floor(self, tenant: str | None) -> bool:
        """Whether `tenant`'s counter counts toward the floor: active here, with a counter."""
        return tenant in self.counters and (tenant in self.backlog or tenant in self.running)

    def floor(self, active: set[str] | None = None) -> float | None:
        """The least counter of the active tenants (or of `active`) that have one; None when
        none has. A tenant active without a counter here, one another replica dispatched that
        runs at an executor and has not ended yet, is left out: counted as 0 it would pull the
        floor to 0, and every lag with it."""
        counters = self.counters
        return min((counters[t] for t in (self.active() if active is None else active)
                    if t in counters), default=None)

    def enqueued(self, tenant: str) -> None:
        active = self.active()
        if tenant not in active:
            floor = self.floor(active)
            if floor is None:  # nobody is active: start level with the most served so far
                floor = max(self.highest, max(self.counters.values(), default=0.0))
            self.counters[tenant] = max(self.counters.get(tenant, 0.0), floor)
        self.backlog[tenant] = self.backlog.get(tenant, 0) + 1

    def dequeued(self, tenant: str) -> None:
        left = self.backlog.get(tenant, 0) - 1
        if left > 0:
            self.backlog[tenant] = left
        else:
            self.backlog.pop(tenant, None)

    def charge(self, tenant: str, tokens: float) -> None:
        """`tokens` served (negative: a correction of an advance charge). A tenant with no
        counter (never seen here, or forgotten) is charged from the highest counter forgotten,
        not from zero: a Done this replica hears for a tenant it forgot (another replica
        dispatched the request) must not leave it below where it was."""
        weight = self.weights.get(tenant, 1.0)
        self.counters[tenant] = self.counters.get(tenant, self.highest) + tokens / weight

    def lag(self, tenant: str) -> float:
        """How far (in weighted tokens) the tenant is ahead of the least-served active one."""
        return self.lags([tenant])[0]

    def lags(self, tenants: list[str]) -> list[float]:
        floor = self.floor()
        floor = 0.0 if floor is None else floor
        return [max(0.0, self.counters.get(t, 0.0) - floor) for t in tenants]


class ClassWeights:
    """Per priority class with a TTFT target: while the class's p90 TTFT over the recent window
    misses the target, its weight rises by a step (bounded); when met, it relaxes toward 1."""

    def __init__(self, cfg: RequestLevel):
        self.cfg = cfg
        # (a class past the configured levels has no weight to move)
        self.targets = {p: t for p, t in cfg.class_ttft_slo_ms.items() if p < cfg.priority_levels}
        self.weights = np.ones(cfg.priority_levels)
        self.samples: dict[int, deque[tuple[float, float]]] = {p: deque() for p in self.targets}

    def observe(self, priority: int, ttft_ms: float, now: float) -> None:
        window = self.samples.get(priority)
        if window is not None:
            window.append((now, ttft_ms))

    def p90(self, priority: int, now: float) -> float | None:
        window = self.samples[priority]
        while window and window[0][0] < now - self.cfg.class_feedback_window_s:
            window.popleft()
        if not window:
            return None
        return float(np.percentile([ttft for _, ttft in window], 90))

    def update(self, now: float) -> None:
        """One feedback step (every `class_feedback_interval_s`)."""
        step, top = self.cfg.class_weight_step, self.cfg.class_weight_max
        for priority, target in self.targets.items():
            p90 = self.p90(priority, now)
            if p90 is None:
                continue  # nothing finished lately: leave the weight where it is
            current = self.weights[priority]
            self.weights[priority] = (min(top, current * (1 + step)) if p90 > target
                                      else max(1.0, current * (1 - step)))

    def stats(self, now: float) -> dict[str, dict]:
        return {str(p): {"weight": round(float(self.weights[p]), 4), "ttft_slo_ms": target,
                         "ttft_p90_ms": self.p90(p, now)}
                for p, target in self.targets.items()}


class OutputPredictor:
    """How many tokens a request will really generate: max_tokens times a moving average, per
    (tenant, priority), of the share of max_tokens that finished requests used."""

    KNOWN_AFTER = 5  # completions of a (tenant, priority) before its prediction is trusted

    def __init__(self, alpha: float, prior: float, capacity: int = 10_000):
        self.alpha, self.prior = alpha, prior
        # (tenant, priority) -> (ratio, completions seen), least recently finished first; past
        # `capacity` the least recent is forgotten (it starts again from the prior).
        self.capacity = capacity
        self.history: OrderedDict[tuple[str, int], tuple[float, int]] = OrderedDict()

    def knows(self, tenant: str, priority: int) -> bool:
        """Whether the prediction stands on that tenant's class's own completions (not the
        prior alone, which assumes the whole max_tokens)."""
        return self.history.get((tenant, priority), (0.0, 0))[1] >= self.KNOWN_AFTER

    def predict(self, tenant: str, priority: int, max_tokens: int) -> int:
        ratio = self.history.get((tenant, priority), (self.prior, 0))[0]
        return max(1, min(max_tokens, round(max_tokens * ratio)))

    def observe(self, tenant: str, priority: int, max_tokens: int, output_tokens: int,
                finish_reason: str) -> None:
        if finish_reason not in ("stop", "length") or max_tokens <= 0:
            return  # cut short (cancelled, deadline, an error): says nothing of its length
        key = (tenant, priority)
        used = min(1.0, output_tokens / max_tokens)
        old, seen = self.history.pop(key, (self.prior, 0))
        self.history[key] = (old + self.alpha * (used - old), seen + 1)
        if len(self.history) > self.capacity:
            self.history.popitem(last=False)
