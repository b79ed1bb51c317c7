"""The request-level scheduler: the waiting queue with everything its order depends on — the
tenants' virtual token counters, the output-length predictor, the class weights and the
executors' load — fed by submissions, pulls and the executors' reports. Knows nothing of NATS."""

from __future__ import annotations

import dataclasses
import math
from collections import deque
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np

from services.priority import policy
from services.priority.fairness import ClassWeights, OutputPredictor, TenantCounters
from services.priority.queue import WaitingQueue
from shared.config import RequestLevel
from shared.keys import RequestKey
from shared.metrics import TENANT_LABELS_MAX
from shared.messages import DISPATCH_BYTES, Done, WorkItem, encode


MISSED_MS = 1e9  # the TTFT a request that never got a token counts as
MAX_PRIORITY = 10  # GenerateRequest.priority's upper bound
MAX_CHARGES = 1 << 18  # dispatched requests whose charges are kept until their Done
VICTIMS_S = 0.2  # how long a full queue's ranking of requests to push out is reused
RATE_WINDOW_S = 10.0  # the recent dispatch rate is counted over this long


@dataclass
class _Victims:
    """A full queue's requests ranked for push-out (RequestScheduler.push_out_for)."""

    at: float  # when ranked
    # RequestKeys, earliest deadline first: hopeless, or doomed by the queue ahead of them
    hopeless: deque = field(default_factory=deque)
    # tenant -> (priority, -arrival seq, (tenant, id)), the lowest class and latest first
    by_tenant: dict[str, deque] = field(default_factory=dict)

    def head(self, tenant: str, queue: WaitingQueue) -> tuple | None:
        """The tenant's next candidate still waiting (those gone since are dropped)."""
        line = self.by_tenant.get(tenant)
        while line and line[0][2] not in queue:
            line.popleft()
        return line[0] if line else None


@dataclass
class Dispatch:
    item: WorkItem
    score: float
    terms: dict[str, float] = field(default_factory=dict)


class Charge(NamedTuple):
    """What a dispatched request's tenant was charged in advance, until its Done."""

    tokens: float
    predicted_output_tokens: int
    # Which request of that key: a second generate may reuse the id of one that runs, and is
    # not the same request (admission stamps each its own arrival time).
    arrival_time: float


class RequestScheduler:
    def __init__(self, cfg: RequestLevel, prefill_per_step: int = 512):
        self.cfg = cfg
        self.prefill_per_step = prefill_per_step  # an executor step's token budget
        self.queue = WaitingQueue(cfg.max_pending_requests)
        self.counters = TenantCounters(cfg.tenant_weights)
        self.predictor = OutputPredictor(cfg.predictor_alpha, cfg.predictor_prior)
        self.class_weights = ClassWeights(cfg)
        self.executor_load: dict[str, tuple[int, int]] = {}  # name -> (busy, slots)
        self.executor_tenants: dict[str, dict[str, int]] = {}  # name -> requests per tenant
        self.executor_step_s: dict[str, float] = {}  # name -> its recent mean step time
        self.served: dict[str, dict[str, int]] = {}  # tenant -> prompt and output tokens
        self._victim_cache: _Victims | None = None  # push_out_for's ranking, while it holds
        self._dispatched: deque[tuple[float, int]] = deque()  # (when, how many), recent pulls
        # Requests dispatched and not yet Done (oldest first; bounded: a request lost with its
        # admission never sends one).
        self.charges: dict[RequestKey, Charge] = {}

    def __len__(self) -> int:
        return len(self.queue)

    @property
    def load(self) -> float:
        """Demand over executor slots: running and waiting at executors plus this queue."""
        busy = sum(b for b, _ in self.executor_load.values()) + len(self.queue)
        slots = sum(s for _, s in self.executor_load.values())
        return busy / slots if slots else 0.0

    def push(self, item: WorkItem, past_bound: bool = False, size: int | None = None) -> None:
        """Queue `item`; `past_bound`: even when full (another request made room for it).
        `size`: its encoded bytes, if known (the submission's length); else encoded here."""
        # Dispatched before (an assignment failed, or a lost holder's hand-on): it had its place
        # here, and its advance is refunded.
        back = self.dispatched(item)
        if back is not None:
            del self.charges[item.key]
            self.counters.charge(item.tenant, -back.tokens)
        request = item.request
        predicted = self.predictor.predict(item.tenant, request.priority, request.max_tokens)
        self.queue.push(item, item.num_prompt_tokens + predicted,
                        past_bound=back is not None or past_bound,
                        known=self.predictor.knows(item.tenant, request.priority),
                        size=(len(encode(item)) if size is None else size) + DISPATCH_BYTES)
        self.counters.enqueued(item.tenant)

    def push_out_for(self, newcomer: WorkItem, now: float) -> tuple[WorkItem | None, str]:
        """The queue is full and `newcomer` arrives: a waiting request taken out to make room
        for it, and why ("hopeless" or "share"), or None (the newcomer is the one refused).
        First a request that can no longer make its deadline: the policy's `hopeless` (even if
        it started now), or doomed by the queue ahead of it — the requests that outrank it now,
        at the recent dispatch rate, would take it past its deadline by more than late_tolerance_s
        (requests that arrive meanwhile and outrank it only make that later). Either would only
        wait for its deadline to pass, holding a place a request without one could use (under
        a sustained overload, priority-1 requests waiting for the aging bound were pushed out
        while doomed priority-5 ones stayed). Then longest-queue drop: when a tenant
        holds more of the queue than the newcomer's would, its lowest-priority, latest request
        goes (one tenant's flood cannot lock the others out); else a request of a lower class
        than the newcomer's, of a tenant holding at least as much as the newcomer's (a flood of
        low-priority work cannot lock out high-priority work). Durable requests never go:
        admission holds them and would only submit them again.

        A full queue under a flood sees a push-out on every submission, so the candidates are
        ranked once (O(n log n)) and reused for VICTIMS_S; each push-out then costs O(tenants).
        Candidates taken out meanwhile are skipped; requests that arrived since are not yet
        candidates."""
        backlog = self.counters.backlog
        if not backlog:
            return None, ""
        victims = self._victims(now)
        while victims.hopeless:
            key = victims.hopeless.popleft()
            if key in self.queue:
                return self.remove(key.request_id, key.tenant), "hopeless"
        mine = backlog.get(newcomer.tenant, 0)
        largest = max(backlog, key=backlog.get)
        if backlog[largest] > mine + 1:
            head = victims.head(largest, self.queue)
            if head is not None:
                victims.by_tenant[largest].popleft()
                return self.remove(head[2][1], largest), "share"
        heads = [(head, tenant) for tenant, n in backlog.items() if n >= mine
                 if (head := victims.head(tenant, self.queue)) is not None
                 and head[0] < newcomer.request.priority]
        if not heads:
            return None, ""
        head, tenant = min(heads)
        victims.by_tenant[tenant].popleft()
        return self.remove(head[2][1], tenant), "share"

    def refused_tenants(self, now: float) -> dict[str, int]:
        """While the queue is full: the tenants whose newcomers `push_out_for` refuses, each
        with the highest priority it refuses (a newcomer above it takes the place of a request
        of a lower class). Those are the tenants holding the most of the queue (within one
        request of the largest: nobody holds enough more to give way to them); the rest push
        a request of the largest out. Empty when any waiting request is hopeless (a newcomer
        of any tenant would take its place), or when the queue has room."""
        backlog = self.counters.backlog
        if not self.queue.full or not backlog:
            return {}
        victims = self._victims(now)
        if any(key in self.queue for key in victims.hopeless):
            return {}
        largest = max(backlog.values())
        # Only tenants within one of the largest; each refuses up to the lowest class waiting
        # of any tenant holding at least as much (those are within one of the largest too).
        held = sorted(((n, tenant) for tenant, n in backlog.items() if n >= largest - 1),
                      reverse=True)
        floors: dict[int, int] = {}  # backlog -> the lowest class waiting of those holding it
        for n, tenant in held:
            head = victims.head(tenant, self.queue)
            floors[n] = min(floors.get(n, MAX_PRIORITY), MAX_PRIORITY if head is None else head[0])
        floors[largest - 1] = min(floors.get(largest - 1, MAX_PRIORITY), floors[largest])
        return {tenant: floors[n] for n, tenant in held}

    def _victims(self, now: float) -> _Victims:
        if self._victim_cache is not None and now - self._victim_cache.at < VICTIMS_S:
            return self._victim_cache
        waiting = self.queue.waiting(self.fairness_terms())
        items = [self.queue.item(row) for row in range(len(self.queue))]
        victims = _Victims(at=now)
        if self.cfg.policy == "adaptive":
            scored = self.scores(now, waiting)
            late = scored.terms["hopeless"] == 1
            rate = self.dispatch_rate(now)
            if rate > 0 and waiting.known is not None:
                rank = np.empty(len(items))
                rank[np.lexsort((waiting.seq, -scored.key))] = np.arange(len(items))
                service = policy.service_time(waiting, self.step_s, self.prefill_per_step)
                start = now + rank / rate
                late |= waiting.known & (start + service > waiting.deadline
                                         + self.cfg.late_tolerance_s)
            late = np.flatnonzero(late)
            victims.hopeless.extend(items[r].key
                                    for r in late[np.argsort(waiting.deadline[late])]
                                    if not items[r].durable)
        for row in np.lexsort((-waiting.seq, waiting.priority)):  # lowest class, latest first
            item = items[row]
            if not item.durable:
                victims.by_tenant.setdefault(item.tenant, deque()).append(
                    (item.request.priority, -waiting.seq[row], item.key))
        self._victim_cache = victims
        return victims

    def remove(self, request_id: str, tenant: str) -> WorkItem | None:
        item = self.queue.remove(request_id, tenant)
        if item is not None:
            self.counters.dequeued(tenant)
        return item

    def expired(self, now: float) -> list[WorkItem]:
        """Requests whose deadline passed while they waited; each counts as a class SLO miss."""
        items = self.queue.expired(now)
        for item in items:
            self.counters.dequeued(item.tenant)
            self.class_weights.observe(item.request.priority, MISSED_MS, now)
        return items

    @property
    def step_s(self) -> float:
        """The executors' recent step time (the mean of those that ran steps; 0: none did)."""
        steps = [s for s in self.executor_step_s.values() if s > 0]
        return sum(steps) / len(steps) if steps else 0.0

    def scores(self, now: float, waiting: policy.Waiting | None = None) -> policy.Scores:
        waiting = waiting or self.queue.waiting(self.fairness_terms())
        return policy.scores(waiting, now, self.load, self.class_weights.weights, self.cfg,
                             self.step_s, self.prefill_per_step)

    def fairness_terms(self) -> np.ndarray:
        """The fairness term of every tenant waiting in the queue, by tenant index (0 at a free
        index)."""
        return self._fairness(*self._fairness_state())

    def _fairness_state(self) -> tuple[np.ndarray, np.ndarray, float]:
        """By the queue's tenant index: each one's counter (0 at a free index or without one),
        and whether it is active with a counter; and the least counter of the active tenants
        that wait nowhere here (inf: none). What `_fairness` needs, built once a pull and kept
        up to date pick by pick in `_pick_fairly` (the charged tenant's entries only; the
        terms are then one numpy pass, not a Python loop over every tenant)."""
        c = self.counters
        names = self.queue.tenants or [None]
        count = np.array([c.counters.get(t, 0.0) for t in names], dtype=np.float64)
        live = np.array([c.in_floor(t) for t in names])
        queued = self.queue.tenant_ids
        outside = min((c.counters[t] for t in c.running if t not in queued and t in c.counters),
                      default=math.inf)
        return count, live, outside

    def _fairness(self, count: np.ndarray, live: np.ndarray, outside: float) -> np.ndarray:
        """-min(fairness_max, factor x lag), each lag measured from the least counter of the
        active tenants (TenantCounters.floor)."""
        cfg = self.cfg
        floor = min(outside, float(count[live].min()) if live.any() else math.inf)
        floor = 0.0 if floor == math.inf else floor
        factor = cfg.fairness_factor / cfg.fairness_scale_tokens
        return -np.minimum(cfg.fairness_max, factor * np.maximum(0.0, count - floor))

    def can_overtake(self, min_standing: float, now: float, after_seq: int = -1) -> bool:
        """Whether some waiting request that arrived after `after_seq` (an arrival sequence
        number; -1: any) has a standing that reaches `min_standing`, and none of them is aged
        (those go first, and they wait for room). Scores only those rows: a long poll looks at
        each arrival as it comes, and at the whole queue only now and then."""
        if not self.queue:
            return False
        waiting = self.queue.waiting(self.fairness_terms())
        new = waiting.seq > after_seq
        if not new.all():
            if not new.any():
                return False
            waiting = policy.Waiting(**{f.name: getattr(waiting, f.name)[new]
                                        for f in dataclasses.fields(waiting)})
        return bool(_overtakers(self.scores(now, waiting), min_standing).any())

    def pop(self, max_items: int, now: float, min_standing: float | None = None,
            max_bytes: float = math.inf) -> list[Dispatch]:
        """The best `max_items` now (of those whose standing reaches `min_standing`, if given),
        as far as their encoded sizes add up to `max_bytes` (the pull's reply is one message;
        the best one goes whatever its size). Each dispatch charges its tenant in advance for
        what it will be served (prompt + 2 x predicted output; corrected by the request's Done),
        and the next pick within the same pull already sees the new fairness terms."""
        n = len(self.queue)
        if n == 0 or max_items <= 0:
            return []
        waiting = self.queue.waiting(self.fairness_terms())
        scored, seq = self.scores(now, waiting), waiting.seq
        sizes = self.queue.sizes()
        fair_pull = (self.cfg.policy == "adaptive" and self.cfg.fairness_factor > 0
                     and len(self.counters.backlog) > 1)  # only then can the order change
        if min_standing is not None or not fair_pull:
            if min_standing is not None:  # an overtaking pull: the best of those that may
                eligible = _overtakers(scored, min_standing)
                key = np.where(eligible, scored.key, -np.inf)
                k = min(max_items, int(eligible.sum()))
            else:  # fairness cannot change the order within this pull: one selection
                key, k = scored.key, max_items
            rows = [int(r) for r in policy.best(key, seq, k)]
            rows = rows[:_fitting(sizes[rows], max_bytes)]
            shifts = [0.0] * len(rows)
            for row in rows:
                self._charge(row)
        else:
            rows, shifts = self._pick_fairly(scored, seq, min(max_items, n), sizes, max_bytes)
        dispatches = []
        for row, shift, item in zip(rows, shifts, self.queue.take(rows)):
            terms = {name: float(t[row]) for name, t in scored.terms.items()}
            if "fairness" in terms:
                terms["fairness"] += shift
            item.priority_score = float(scored.score[row]) + shift
            item.standing = float(scored.standing[row]) + shift
            item.age_from_dispatch = bool(terms.get("over_share", 0.0))
            item.queue_wait_ms = max(0.0, 1e3 * (now - item.arrival_time))
            dispatches.append(Dispatch(item, item.priority_score, terms))
        if dispatches:
            self._dispatched.append((now, len(dispatches)))
            self._forget_dispatches(now)
        return dispatches

    def _forget_dispatches(self, now: float) -> None:
        while self._dispatched and self._dispatched[0][0] < now - RATE_WINDOW_S:
            self._dispatched.popleft()

    def dispatch_rate(self, now: float) -> float:
        """Requests dispatched a second over the last RATE_WINDOW_S (0 until dispatches span a
        second: too few to tell a rate)."""
        self._forget_dispatches(now)
        if not self._dispatched or now - self._dispatched[0][0] < 1.0:
            return 0.0
        return sum(n for _, n in self._dispatched) / (now - self._dispatched[0][0])

    def _pick_fairly(self, scored: policy.Scores, seq: np.ndarray, k: int,
                     sizes: np.ndarray, max_bytes: float) -> tuple[list[int], list[float]]:
        """One pick at a time; after each charge every row's fairness term moves by its tenant's
        change. A charge shifts all of a tenant's (not aged) rows alike, so only each tenant's
        best k can ever be picked: O(n) per backlogged tenant to find those, then O(k) a pick.
        Returns the rows and how far each one's fairness term had moved when it was picked."""
        tenants = self.queue.tenant_rows()
        by_tenant = np.argsort(tenants, kind="stable")  # each tenant's rows together: O(n log n)
        bounds = np.flatnonzero(np.diff(tenants[by_tenant])) + 1
        candidates = []
        for mine in np.split(by_tenant, bounds):
            candidates.append(mine[policy.best(scored.key[mine], seq[mine], k)])
        rows_of = np.concatenate(candidates)
        key, tenant = scored.key[rows_of].copy(), tenants[rows_of]
        # Rows ordered by their score move with it; aged ones (not at stake) by their wait.
        not_aged = (scored.terms["aged"][rows_of] == 0) | (
            scored.terms.get("critical", scored.terms["aged"])[rows_of] == 1)
        count, live, outside = self._fairness_state()
        fairness = start = self._fairness(count, live, outside)
        counters, names = self.counters, self.queue.tenants
        picked: list[int] = []
        shifts: list[float] = []
        used = 0
        for _ in range(k):
            top = np.flatnonzero(key == key.max())
            best = int(top[np.argmin(seq[rows_of[top]])]) if len(top) > 1 else int(top[0])
            row = int(rows_of[best])
            used += int(sizes[row])
            if picked and used > max_bytes:
                break
            picked.append(row)
            shifts.append(float(fairness[tenant[best]] - start[tenant[best]]))
            key[best] = -np.inf
            self._charge(row)
            t = tenant[best]  # only its counter, and whether it is active, moved
            name = names[t]
            count[t] = counters.counters.get(name, 0.0)
            live[t] = counters.in_floor(name)
            moved = self._fairness(count, live, outside)
            change = moved - fairness
            fairness = moved
            if change.any():
                key += np.where(not_aged, change[tenant], 0.0)
        return picked, shifts

    def dispatched(self, item: WorkItem) -> Charge | None:
        """Its charge, if this instance dispatched `item` and it has not ended since."""
        charge = self.charges.get(item.key)
        return charge if charge is not None and charge.arrival_time == item.arrival_time else None

    def _charge(self, row: int) -> None:
        item, predicted = self.queue.item(row), self.queue.predicted_output(row)
        self.counters.dequeued(item.tenant)
        charge = Charge(self.counters.cost(item.num_prompt_tokens, predicted), predicted,
                        item.arrival_time)
        self.counters.charge(item.tenant, charge.tokens)
        self.charges[item.key] = charge
        while len(self.charges) > MAX_CHARGES:
            del self.charges[next(iter(self.charges))]

    def executor_report(self, name: str, busy: int, slots: int,
                        tenants: dict[str, int], step_ms: float = 0.0) -> None:
        """An executor's heartbeat: its load, how many requests each tenant has there, and its
        mean step time since its previous beat (0: it ran none; the last one stands)."""
        self.executor_load[name] = (busy, slots)
        if step_ms > 0 or name not in self.executor_step_s:
            self.executor_step_s[name] = step_ms / 1e3
        self.executor_tenants[name] = tenants
        self._update_running()

    def executor_gone(self, name: str) -> None:
        self.executor_load.pop(name, None)
        self.executor_tenants.pop(name, None)
        self.executor_step_s.pop(name, None)
        self._update_running()

    def _update_running(self) -> None:
        self.counters.running = {t for tenants in self.executor_tenants.values()
                                 for t, n in tenants.items() if n > 0}

    def done(self, report: Done, now: float) -> None:
        """A request this instance dispatched ended: correct the advance charge, learn its
        length, and count its TTFT against its class's target. One another priority (a
        replica, or this one before a restart) dispatched is charged whole to its tenant's
        counter, so every replica's counters follow what every tenant was served; one that
        ended unserved (while it waited) teaches nothing."""
        charge = self.charges.get(report.key)
        if charge is None or charge.arrival_time != report.arrival_time:
            if report.output_tokens:
                self.counters.charge(report.tenant, self.counters.cost(report.prompt_tokens,
                                                                       report.output_tokens))
            return
        del self.charges[report.key]
        self.counters.charge(report.tenant, 2 * (report.output_tokens
                                                 - charge.predicted_output_tokens))
        # Past TENANT_LABELS_MAX tenants, the rest as "other" (as the metrics label them).
        tenant = report.tenant if (report.tenant in self.served
                                   or len(self.served) < TENANT_LABELS_MAX) else "other"
        served = self.served.setdefault(tenant, {"prompt_tokens": 0, "output_tokens": 0})
        served["prompt_tokens"] += report.prompt_tokens
        served["output_tokens"] += report.output_tokens
        self.predictor.observe(report.tenant, report.priority, report.max_tokens,
                               report.output_tokens, report.finish_reason)
        if report.ttft_ms is not None:
            self.class_weights.observe(report.priority, report.ttft_ms, now)
        elif report.finish_reason == "deadline_exceeded":
            self.class_weights.observe(report.priority, MISSED_MS, now)

    def stats(self, now: float) -> dict:
        """What $SRV.STATS shows; per-tenant tables as their TENANT_LABELS_MAX largest entries
        (one reply must stay small whatever the number of tenants)."""
        return {"policy": self.cfg.policy, "load": round(self.load, 4),
                "class_weights": self.class_weights.stats(now),
                "tenants_counted": len(self.counters.counters),
                "tenant_counters": _largest({t: round(c, 1)
                                             for t, c in self.counters.counters.items()}),
                "tenant_counter_forgotten": round(self.counters.highest, 1),
                "backlogged_tenants": _largest(self.counters.backlog),
                "running_tenants": sorted(self.counters.running)[:TENANT_LABELS_MAX],
                "tenant_served": self.served}


def _largest(values: dict[str, float]) -> dict[str, float]:
    if len(values) <= TENANT_LABELS_MAX:
        return dict(values)
    return dict(sorted(values.items(), key=lambda kv: -kv[1])[:TENANT_LABELS_MAX])


def _fitting(sizes: np.ndarray, max_bytes: float) -> int:
    """How many of `sizes`, from the first, add up to at most `max_bytes` (at least one)."""
    return max(1, int(np.searchsorted(np.cumsum(sizes), max_bytes, side="right")))


def _overtakers(scored: policy.Scores, min_standing: float) -> np.ndarray:
    """Which requests may overtake at an executor whose threshold is `min_standing`: those whose
    standing (the score without deadline urgency, what executors order by) reaches it — none
    while a request aged past the bound waits, since that one goes ahead of them all."""
    aged = scored.terms.get("aged")
    if aged is not None and aged.any():
        return np.zeros(len(scored.score), dtype=bool)
    hopeless = scored.terms.get("hopeless")
    reaches = scored.standing >= min_standing
    return reaches if hopeless is None else reaches & (hopeless == 0)
