"""The request-level order (DESIGN §6): fcfs, strict priority, or the adaptive score.

Pure functions of the waiting requests (as parallel numpy arrays, so a pull scores 10,000
requests in one vectorised pass), the clock, the tenants' fairness terms, the class weights and
the executors' load. Each term works on scalars too, which is how the unit tests read them.

    score = base_weight * class_weight * priority / (priority_levels - 1)
          + urgency_weight * urgency * load_adjustment
          + resource_weight * resource
          + fairness
    urgency         = 1 / (1 + exp(slack / time_window))     slack = deadline - now
    resource        = ln(prompt + predicted output) / resource_scale
    load_adjustment = clamp(1 + (load - load_threshold) * load_weight)
    fairness        = -min(fairness_max, fairness_factor * (counter - least active counter) / scale)

The aging bound sits above the score: a request that has waited `max_wait_s` goes ahead of every
request that has not, the longest waiting first — unless its tenant is over its share (more than
`fairness_scale_tokens` ahead of the least-served active tenant, i.e. its fairness term is below
-fairness_factor). Then it goes to the head of its own tenant's line only: a tenant that sends more
than it is given cannot turn its backlog's age into the share of a tenant that sends less.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from shared.config import RequestLevel

AGED = 1e9  # added to the key of a request past the aging bound: above any score
HEAD_STEP = 1e-6  # per second waited: an aged request held to its own line sits just above its head
SEQ_SPAN = 2.0**32  # strict priority keys: priority * SEQ_SPAN - arrival sequence, exact in float64


def urgency(slack_s, time_window: float):
    """Rises from 0 (far from the deadline) through 0.5 (at it) toward 1 (past it); 0 without a
    deadline (slack = inf)."""
    slack = np.asarray(slack_s, dtype=float)
    return np.where(slack == np.inf, 0.0,
                    1.0 / (1.0 + np.exp(np.clip(slack / time_window, -50.0, 50.0))))


def resource(total_tokens, scale: float):
    """The job's size on a log scale: ln(prompt + predicted output tokens) / scale."""
    return np.log(np.maximum(np.asarray(total_tokens, dtype=float), 1.0)) / scale


def load_adjustment(load: float, cfg: RequestLevel) -> float:
    """Deadlines weigh more when the executors are busier than `load_threshold`."""
    return float(np.clip(1.0 + (load - cfg.load_threshold) * cfg.load_weight,
                         cfg.load_adjustment_min, cfg.load_adjustment_max))


def base(priority, class_weight, cfg: RequestLevel):
    top = cfg.priority_levels - 1
    return cfg.base_weight * class_weight * np.minimum(np.asarray(priority, dtype=float), top) / top


@dataclass
class Waiting:
    """The waiting requests as parallel arrays (one row each)."""

    priority: np.ndarray  # int
    seq: np.ndarray  # arrival sequence number (float, exact below 2**53)
    arrival: np.ndarray  # s, admission's wall clock
    deadline: np.ndarray  # s, wall clock; inf without one
    demand: np.ndarray  # prompt + predicted output tokens
    fairness: np.ndarray  # the tenant's fairness term
    tenant: np.ndarray  # the tenant's index (int)


@dataclass
class Scores:
    key: np.ndarray  # larger goes first
    score: np.ndarray  # the score (no aging offset): reported, and on the trace
    standing: np.ndarray  # what the executor orders by: the score without deadline urgency
    terms: dict[str, np.ndarray]  # each term, for the trace


def scores(waiting: Waiting, now: float, load: float, class_weights: np.ndarray,
           cfg: RequestLevel) -> Scores:
    """Every waiting request's sort key under the configured policy."""
    if cfg.policy == "fcfs":
        zero = np.zeros_like(waiting.seq)
        return Scores(key=-waiting.seq, score=zero, standing=zero, terms={})
    if cfg.policy == "priority":
        priority = waiting.priority.astype(float)
        return Scores(key=priority * SEQ_SPAN - waiting.seq, score=priority, standing=priority,
                      terms={})
    adjust = load_adjustment(load, cfg)
    terms = {
        "base": base(waiting.priority, class_weights[np.minimum(waiting.priority,
                                                                len(class_weights) - 1)], cfg),
        "urgency": cfg.urgency_weight * urgency(waiting.deadline - now, cfg.time_window) * adjust,
        "resource": cfg.resource_weight * resource(waiting.demand, cfg.resource_scale),
        "fairness": waiting.fairness,
    }
    score = terms["base"] + terms["urgency"] + terms["resource"] + terms["fairness"]
    standing = score - terms["urgency"]
    waited = now - waiting.arrival
    aged = waited >= cfg.max_wait_s
    over_share = over_share_of(waiting.fairness, cfg)
    first = aged & ~over_share
    terms["aged"] = first.astype(float)
    key = np.where(first, AGED + waited, score)
    held = aged & over_share
    if held.any():  # aged, but its tenant is over its share: the head of its own line only,
        # here and at the executor (there by standing, which leaves out every urgency)
        rows = waiting.tenant
        key = np.where(held, _tenant_max(score, rows)[rows] + HEAD_STEP * waited, key)
        standing = np.where(held, _tenant_max(standing, rows)[rows] + HEAD_STEP * waited,
                            standing)
    terms["over_share"] = over_share.astype(float)
    terms["held"] = held.astype(float)
    return Scores(key=key, score=score, standing=standing, terms=terms)


def _tenant_max(values: np.ndarray, tenant: np.ndarray) -> np.ndarray:
    """The largest of `values` per tenant index."""
    top = np.full(int(tenant.max()) + 1, -np.inf)
    np.maximum.at(top, tenant, values)
    return top


def over_share_of(fairness, cfg: RequestLevel):
    """Whether a tenant with this fairness term is over its share: more than
    `fairness_scale_tokens` ahead of the least-served active tenant (or, when `fairness_max` caps
    the term below `fairness_factor`, at that cap). Its requests' aging bound then orders them
    only within their own tenant. Never, with tenant fairness off."""
    bound = min(cfg.fairness_factor, cfg.fairness_max)
    fairness = np.asarray(fairness)
    if bound <= 0:
        return np.zeros(fairness.shape, dtype=bool)
    return fairness < -bound if cfg.fairness_max > cfg.fairness_factor else fairness <= -bound


def best(key: np.ndarray, seq: np.ndarray, k: int) -> np.ndarray:
    """Row indices of the `k` largest keys, best first; equal keys go to the earlier arrival.
    O(n) selection, then a sort of the k chosen (and of any ties at the boundary)."""
    n = len(key)
    if k <= 0 or n == 0:
        return np.empty(0, dtype=np.intp)
    if k < n:
        kth = np.partition(key, n - k)[n - k]
        rows = np.flatnonzero(key >= kth)
    else:
        rows = np.arange(n)
    ordered = rows[np.lexsort((seq[rows], -key[rows]))]
    return ordered[:k]
