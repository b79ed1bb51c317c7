"""The request-level order (docs/scheduling.md): fcfs, strict priority, or the adaptive score.

Pure functions of the waiting requests (as parallel numpy arrays, so a pull scores 10,000
requests in one vectorised pass), the clock, the tenants' fairness terms, the class weights and
the executors' load. Each term works on scalars too, which is how the unit tests read them.

    score = base_weight * class_weight * priority / (priority_levels - 1)
          + urgency_weight * urgency * load_adjustment
          + resource_weight * resource
          + fairness
    urgency         = 1 / (1 + exp(margin / time_window))    margin = deadline - now - service
                      for margin >= 0; 0.5 * exp(margin / time_window) once late
    service         = (predicted output + prompt / prefill per step) * executor step time
    resource        = ln(prompt + predicted output) / resource_scale
    load_adjustment = clamp(1 + (load - load_threshold) * load_weight)
    fairness        = -min(fairness_max, fairness_factor * (counter - least active counter) / scale)

The aging bound sits above the score: a request that has waited `max_wait_s` goes ahead of every
request that has not, the longest waiting first — except requests whose deadline is at stake now
(`critical`: a margin within one time window of zero), which go first, in score order; and
unless its tenant is over its share (more than
`fairness_scale_tokens` ahead of the least-served active tenant, i.e. its fairness term is below
-fairness_factor). Then it goes to the head of its own tenant's line only: a tenant that sends more
than it is given cannot turn its backlog's age into the share of a tenant that sends less.

A request that would miss its deadline by more than `late_tolerance_s` even if it started now
(`hopeless`, by the same estimate of the time it needs) goes behind every other: it waits for
idle capacity or for its deadline, instead of taking a slot to be cut at the deadline.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from shared.config import RequestLevel

AGED = 1e9  # added to the key of a request past the aging bound: above any score
CRITICAL = 2e9  # while aged requests wait: above them, for requests whose deadline is at stake
HOPELESS = 1e6  # taken from the key of a request that can no longer make its deadline
HEAD_STEP = 1e-6  # per second waited: an aged request held to its own line sits just above its head
SEQ_SPAN = 2.0**32  # strict priority keys: priority * SEQ_SPAN - arrival sequence, exact in float64


def urgency(slack_s, time_window: float):
    """Rises from 0 (far from the deadline) through 0.5 (at it) toward 1 (past it); 0 without a
    deadline (slack = inf)."""
    slack = np.asarray(slack_s, dtype=float)
    return np.where(slack == np.inf, 0.0,
                    1.0 / (1.0 + np.exp(np.clip(slack / time_window, -50.0, 50.0))))


def deadline_urgency(slack_s, service_s, time_window: float, fade=True):
    """Urgency of a request that needs about `service_s` to complete and has `slack_s` left:
    the urgency of its margin (slack - service), rising to 0.5 as the margin reaches zero and
    fading once it is late by that estimate (by 1/e a time window late): a request that is
    already behind stops taking the place of one that can still make it. Only where `fade`
    (per request): an estimate from the prior, every request using all of its max_tokens,
    would fade a long max_tokens' deadline to nothing before it could tell. 0 without a
    deadline."""
    slack = np.asarray(slack_s, dtype=float)
    margin = slack - np.asarray(service_s, dtype=float)
    late = np.minimum(0.0, margin / time_window)  # < 0 once late
    rising = urgency(np.maximum(margin, 0.0), time_window)
    fading = np.where(fade, np.exp(np.maximum(late, -50.0)), 1.0)
    return np.where(slack == np.inf, 0.0, rising * fading)


def hopeless(slack_s, service_s, tolerance: float):
    """Whether a request would finish more than `tolerance` after its deadline even if it
    started now (by the estimate of the time it needs). These go behind every other request:
    run, they would be cut at their deadline, in the place of requests that can still finish."""
    slack = np.asarray(slack_s, dtype=float)
    return (slack != np.inf) & (slack - np.asarray(service_s, dtype=float) < -tolerance)


def critical(slack_s, service_s, time_window: float):
    """Whether a request's deadline is at stake now: its margin (slack - service) within one
    time window of zero. These go ahead of requests aged past the bound."""
    slack = np.asarray(slack_s, dtype=float)
    margin = slack - np.asarray(service_s, dtype=float)
    return (slack != np.inf) & (np.abs(margin) <= time_window)


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
    prompt: np.ndarray | None = None  # prompt tokens (None: all of the demand is output)
    known: np.ndarray | None = None  # whether the predicted output stands on history (bool)


@dataclass
class Scores:
    key: np.ndarray  # larger goes first
    score: np.ndarray  # the score (no aging offset): reported, and on the trace
    standing: np.ndarray  # what the executor orders by: the score without deadline urgency
    terms: dict[str, np.ndarray]  # each term, for the trace


def service_time(waiting: Waiting, step_s: float, prefill_per_step: int) -> np.ndarray:
    """How long each request would take to complete if it started now: its predicted output at
    one token a step, and its prompt at `prefill_per_step` tokens a step, at the executors'
    recent step time (0 before any executor reported one)."""
    prompt = waiting.prompt if waiting.prompt is not None else np.zeros_like(waiting.demand)
    return (waiting.demand - prompt + prompt / max(1, prefill_per_step)) * step_s


def scores(waiting: Waiting, now: float, load: float, class_weights: np.ndarray,
           cfg: RequestLevel, step_s: float = 0.0, prefill_per_step: int = 512) -> Scores:
    """Every waiting request's sort key under the configured policy. `step_s`: the executors'
    recent step time, which turns a request's predicted size into the time it needs (its
    deadline urgency counts the margin beyond that)."""
    if cfg.policy == "fcfs":
        zero = np.zeros_like(waiting.seq)
        return Scores(key=-waiting.seq, score=zero, standing=zero, terms={})
    if cfg.policy == "priority":
        priority = waiting.priority.astype(float)
        return Scores(key=priority * SEQ_SPAN - waiting.seq, score=priority, standing=priority,
                      terms={})
    adjust = load_adjustment(load, cfg)
    slack = waiting.deadline - now
    service = service_time(waiting, step_s, prefill_per_step)
    weights = class_weights[np.minimum(waiting.priority, len(class_weights) - 1)]
    # Late by a history-based estimate fades; by the prior alone, not (see deadline_urgency).
    fade = True if waiting.known is None else waiting.known
    terms = {"base": base(waiting.priority, weights, cfg),
             "urgency": cfg.urgency_weight * deadline_urgency(slack, service, cfg.time_window,
                                                              fade) * adjust,
             "resource": cfg.resource_weight * resource(waiting.demand, cfg.resource_scale),
             "fairness": waiting.fairness}
    score = terms["base"] + terms["urgency"] + terms["resource"] + terms["fairness"]
    standing = score - terms["urgency"]
    waited = now - waiting.arrival
    aged = waited >= cfg.max_wait_s
    over_share = over_share_of(waiting.fairness, cfg)
    # Hopeless by an estimate of its own class's history, never by the prior alone (which
    # assumes every request uses all of its max_tokens); hopeless goes last even when aged.
    late = hopeless(slack, service, cfg.late_tolerance_s)
    if waiting.known is not None:
        late &= waiting.known
    terms["hopeless"] = late.astype(float)
    first = aged & ~over_share & ~late
    terms["aged"] = first.astype(float)
    key = np.where(first, AGED + waited, np.where(late, score - HOPELESS, score))
    if first.any():  # deadlines at stake go ahead of the aged (classes' promises first)
        # At stake, and not already hopeless (those stay behind, aged ones included).
        at_stake = critical(slack, service, cfg.time_window) & ~late
        terms["critical"] = at_stake.astype(float)
        key = np.where(at_stake, CRITICAL + score, key)
    held = aged & over_share & ~late
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
