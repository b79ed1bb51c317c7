"""What the batcher knows of each executor, from heartbeats: load, room, liveness; and routing."""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

from services.batcher.kv_index import KvIndex
from shared.messages import Heartbeat

PROMISE_S = 2.0  # how long a routed prompt's blocks count as cached before its events confirm
CHARGE_ALPHA = 0.05  # weight of the newest assignment in the mean prompt size


@dataclass
class ExecutorState:
    heartbeat: Heartbeat
    last_seen: float  # monotonic
    sent_total: int  # assignments sent to this executor since it started
    suspended_until: float = 0.0  # monotonic; after a failed assignment, skip it for a moment
    # (sent_total when sent, prompt tokens to prefill) of assignments its heartbeat may not count
    sent_tokens: deque = field(default_factory=deque)

    @property
    def in_transit(self) -> int:
        """Assignments sent but not yet counted by the executor's latest heartbeat."""
        return max(0, self.sent_total - self.heartbeat.assigned_total)

    @property
    def free_tokens(self) -> float:
        """Prompt tokens it can still take on within its intake horizon: its heartbeat's room
        less what was sent since (inf from an executor that sets no such limit)."""
        if self.heartbeat.room_tokens is None:
            return float("inf")
        counted = self.heartbeat.assigned_total
        while self.sent_tokens and self.sent_tokens[0][0] <= counted:
            self.sent_tokens.popleft()
        return self.heartbeat.room_tokens - sum(tokens for _, tokens in self.sent_tokens)

    @property
    def load(self) -> int:
        return self.heartbeat.running + self.heartbeat.waiting + self.in_transit

    @property
    def room(self) -> int:
        """Requests it takes: running, waiting and in transit."""
        return self.heartbeat.max_num_seqs + self.heartbeat.queue_depth

    @property
    def utilization(self) -> float:
        """Load over max_num_seqs: comparable across executors of different sizes."""
        return self.load / max(1, self.heartbeat.max_num_seqs)

    @property
    def free_slots(self) -> int:
        """Requests it takes now: a slot (running, waiting or in transit under max_num_seqs +
        queue_depth) and prefill room within its intake horizon."""
        return self.free_seats if self.free_tokens > 0 else 0

    @property
    def free_seats(self) -> int:
        """Slots alone (running, waiting or in transit under max_num_seqs + queue_depth)."""
        return max(0, self.room - self.load)

    def send(self, tokens: int) -> None:
        self.sent_total += 1
        if self.heartbeat.room_tokens is not None:  # (an executor without a room: no charge)
            self.sent_tokens.append((self.sent_total, tokens))


def route_score(cached_blocks: int, prompt_blocks: int, load: float, overlap_weight: float,
                load_weight: float) -> float:
    """KV-aware routing: the share of the prompt's blocks an executor caches, against its load
    (running, waiting and in transit over max_num_seqs). Higher is better."""
    return overlap_weight * cached_blocks / max(1, prompt_blocks) - load_weight * load


class ExecutorRegistry:
    def __init__(self, overtake_extra: int = 0, routing: str = "least_loaded",
                 overlap_weight: float = 1.0, load_weight: float = 1.0):
        self.executors: dict[str, ExecutorState] = {}
        self.overtake_extra = overtake_extra  # how far beyond its room an executor may be sent
        self.routing = routing  # "least_loaded", "round_robin" or "kv_aware"
        self.last_picked = ""  # round robin: the name picked last
        self.kv_index = KvIndex()
        self.overlap_weight, self.load_weight = overlap_weight, load_weight
        self.last_route: dict[str, int] = {}  # kv_aware: each candidate's cached blocks, last pick
        self.mean_charge = 0.0  # moving average of the prompt tokens an assignment brings

    def update(self, heartbeat: Heartbeat, now: float) -> bool:
        """Record a heartbeat; True when the executor is new (or restarted)."""
        state = self.executors.get(heartbeat.executor)
        if state is None or state.heartbeat.started_at != heartbeat.started_at:
            self.executors[heartbeat.executor] = ExecutorState(heartbeat, now,
                                                               heartbeat.assigned_total)
            return True
        state.heartbeat, state.last_seen = heartbeat, now
        # An assignment counted as failed may have arrived after all: trust the executor's count.
        state.sent_total = max(state.sent_total, heartbeat.assigned_total)
        return False

    def expire(self, now: float, timeout: float) -> list[str]:
        """Forget executors whose heartbeats stopped; their names."""
        dead = [name for name, s in self.executors.items() if now - s.last_seen > timeout]
        for name in dead:
            del self.executors[name]
            self.kv_index.forget(name)
        return dead

    def free_slots(self, now: float | None = None) -> int:
        return sum(state.free_slots for state in self.executors.values()
                   if now is None or state.suspended_until <= now)

    def pull_size(self, now: float) -> int:
        """How many requests to pull from priority now: each executor's free slots, as far as
        its intake room holds requests of the recent mean size (at least one where it has
        room: the room is a target, not a wall). Before any size is known, one each."""
        size = self.mean_charge or math.inf
        return sum(s.free_slots if s.free_tokens == math.inf
                   else min(s.free_slots, max(1, math.ceil(s.free_tokens / size)))
                   for s in self.executors.values()
                   if s.suspended_until <= now and s.free_slots > 0)

    def pick(self, model: str | None, now: float, block_hashes: list[bytes] = (),
             prompt_tokens: int = 0, block_size: int = 16, overshoot: bool = False) -> str | None:
        """An executor of `model` with room: the least loaded (relative to its size), then the
        one with the most free KV blocks; or, routing round robin, the next by name after the
        one picked last; or, routing kv_aware, the best `route_score` of the prompt's cached
        blocks against load (ties: the least loaded). A saturated executor is no candidate, so
        a hot prefix spreads to a second one. The pick is charged `prompt_tokens` (less what it
        caches) against its intake room. A request already pulled for the room that then ran
        out (requests larger than the mean) still goes to one with a free slot: `overshoot`."""
        self.last_route = {}
        usable = [s for s in self.executors.values() if s.suspended_until <= now
                  and (model is None or s.heartbeat.model == model)]
        candidates = [s for s in usable if s.free_slots > 0]
        if not candidates and overshoot:
            candidates = [s for s in usable if s.free_seats > 0]
        if not candidates:
            return None
        if self.routing == "round_robin":
            ordered = sorted(candidates, key=lambda s: s.heartbeat.executor)
            best = next((s for s in ordered if s.heartbeat.executor > self.last_picked),
                        ordered[0])
            self.last_picked = best.heartbeat.executor
        elif self.routing == "kv_aware" and block_hashes:
            cached = {s.heartbeat.executor: self.kv_index.cached_prefix(
                s.heartbeat.executor, block_hashes, now) for s in candidates}
            best = max(candidates, key=lambda s: (
                route_score(cached[s.heartbeat.executor], len(block_hashes), s.utilization,
                            self.overlap_weight, self.load_weight),
                -s.utilization, s.heartbeat.free_kv_blocks))
            self.last_route = cached
            self.kv_index.promise(best.heartbeat.executor, block_hashes, now + PROMISE_S)
            prompt_tokens -= cached[best.heartbeat.executor] * block_size
        else:
            best = min(candidates, key=lambda s: (s.utilization, -s.heartbeat.free_kv_blocks))
        charge = max(1, prompt_tokens)
        self.mean_charge += CHARGE_ALPHA * (charge - self.mean_charge) if self.mean_charge \
            else charge
        best.send(charge)
        return best.heartbeat.executor

    def overtake_threshold(self, now: float) -> float | None:
        """The lowest standing that would start at once at some executor without room (ahead
        of what waits there, or preempting its weakest running request); None: nowhere."""
        thresholds = [s.heartbeat.overtake_above for s in self._overtakable(None, now)]
        return min(thresholds) if thresholds else None

    def pick_overtake(self, model: str | None, standing: float, now: float) -> str | None:
        """An executor of `model` without room where a request of `standing` starts at once:
        the one with the lowest threshold, then the least loaded; None if there is none."""
        candidates = [s for s in self._overtakable(model, now)
                      if s.heartbeat.overtake_above <= standing]
        if not candidates:
            return None
        best = min(candidates, key=lambda s: (s.heartbeat.overtake_above, s.load))
        best.send(0)  # beyond its room by design: charged nothing against the room it has not
        return best.heartbeat.executor

    def _overtakable(self, model: str | None, now: float) -> list[ExecutorState]:
        # Nothing in transit (the threshold would be stale once that arrives), and no more than
        # `overtake_extra` beyond the executor's room.
        return [s for s in self.executors.values()
                if s.heartbeat.overtake_above is not None and s.free_slots == 0
                and s.in_transit == 0 and s.suspended_until <= now
                and s.load < s.room + self.overtake_extra
                and (model is None or s.heartbeat.model == model)]

    def unsend(self, name: str, suspend_until: float = 0.0) -> None:
        """An assignment that did not reach the executor (which is then skipped for a while)."""
        state = self.executors.get(name)
        if state is not None:
            if state.sent_tokens and state.sent_tokens[-1][0] == state.sent_total:
                state.sent_tokens.pop()
            state.sent_total -= 1
            state.suspended_until = max(state.suspended_until, suspend_until)
