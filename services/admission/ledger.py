"""Who holds what: admission's ledger of the requests it watches over until they end.

Every admitted request is watched from the moment admission hands it to priority until its
`Done` comes back: a durable request with its JetStream message (acked only then), a generate
with nothing to ack. Each holder (priority's queue, the batcher, an executor) names the requests
it holds in a `Holding` report every heartbeat; an executor adds checkpoints (the outputs so
far). A watched request that no holder has named for a lease was lost with its holder:

- with a copy of its admitted WorkItem (admitted here): handed on to priority as the next
  attempt, with its checkpointed outputs, and the earlier attempt revoked (a stalled holder that
  comes back drops it);
- without one (adopted after admission restarted): handed back to JetStream, which redelivers it
  to run from the start.

The lease is timed on `clock`, which the service advances by at most two heartbeat intervals
per tick: reports queued behind a stalled event loop are read before the stall can make anything
they vouch for look lost.

This module decides; it does no I/O. `services/admission/service.py` acks, naks, publishes and
asks priority, as these decisions say. docs/operations.md's failure table is what it implements;
tests/admission/test_ledger.py walks that table case by case.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from shared.keys import RequestKey


@dataclass
class Watched:
    """One watched request."""

    msg: object  # the LLM_REQUESTS message, acked once its result is stored (None: a generate)
    since: float  # when it was handed to priority or last handed on (Ledger.clock)
    # The admitted WorkItem, msgpack-encoded (compact: admission may hold many), to hand the
    # request on if its holder dies; None for one adopted after a restart (redelivered then).
    item: bytes | None = None
    tokens: list[int] = field(default_factory=list)  # outputs its checkpoints reported
    attempt: int = 0
    # Its submission to priority has had no answer yet (nor timed out): not lost meanwhile.
    submitting: bool = False
    # The revision of its state in LLM_STATE (shared/request_state.py) that this admission
    # wrote or took over: every later write names it. None: not kept there.
    revision: int | None = None
    checkpointed: int = 0  # how many of `tokens` were last written to LLM_STATE
    arrival: float | None = None  # the WorkItem's arrival_time (ids may be reused)


class Ledger:
    def __init__(self, lease_s: float, heartbeat_interval_s: float):
        self.lease_s = lease_s
        self.max_tick_s = 2 * heartbeat_interval_s
        self.clock = 0.0
        self.held: dict[RequestKey, Watched] = {}  # durable requests, by key
        self.generates: dict[RequestKey, Watched] = {}  # generates not yet answered
        self.last_reported: dict[RequestKey, float] = {}  # clock of a holder's last report
        # tenant -> [requests watched, durable ones among them] (tenants with none: not kept)
        self.by_tenant: dict[str, list[int]] = {}

    def watches(self, key: RequestKey) -> bool:
        return key in self.generates or key in self.held

    def knows(self, key: RequestKey) -> bool:
        """The request is in flight as far as this ledger can tell: watched here, or reported by
        a holder within the lease (a request watched by another admission, or by this one before
        it restarted), or the ledger is younger than a lease (its holders have not all reported
        yet: it cannot tell)."""
        return (key in self.generates or key in self.held or key in self.last_reported
                or self.young)

    @property
    def young(self) -> bool:
        """Within its first lease: not every holder has reported yet."""
        return self.clock <= self.lease_s

    def watching(self, tenant: str) -> tuple[int, int]:
        """The tenant's requests watched here, and how many of them are durable."""
        counts = self.by_tenant.get(tenant)
        return (counts[0], counts[1]) if counts else (0, 0)

    def _put(self, table: dict[RequestKey, Watched], key: RequestKey, watched: Watched) -> None:
        if key not in table:
            counts = self.by_tenant.setdefault(key.tenant, [0, 0])
            counts[0] += 1
            counts[1] += table is self.held
        table[key] = watched

    def _pop(self, table: dict[RequestKey, Watched], key: RequestKey) -> Watched | None:
        watched = table.pop(key, None)
        if watched is not None:
            counts = self.by_tenant[key.tenant]
            counts[0] -= 1
            counts[1] -= table is self.held
            if counts[0] == 0:
                del self.by_tenant[key.tenant]
        return watched

    def tick(self, elapsed_s: float) -> None:
        """Time passes: by at most two heartbeat intervals, however long the loop stalled."""
        self.clock += min(elapsed_s, self.max_tick_s)

    # ------------------------------------------------------------------ taking on requests

    def watch(self, key: RequestKey, item: bytes, msg: object = None, attempt: int = 0,
              arrival: float | None = None) -> bool:
        """Watch a request about to be handed to priority (from before priority has it: its
        Done may come back before priority's reply does). False for a generate whose id is
        already watched: priority or the executor refuses that one, and the first keeps its
        watch."""
        table = self.held if msg is not None else self.generates
        if msg is None and key in table:
            return False
        self._put(table, key, Watched(msg, self.clock, item, attempt=attempt, submitting=True,
                                      arrival=arrival))
        return True

    def claim(self, key: RequestKey, watched: Watched, durable: bool) -> bool:
        """Watch a request taken over from another admission (its state read from LLM_STATE):
        False when it is watched here already."""
        table = self.held if durable else self.generates
        if key in table:
            return False
        self._put(table, key, watched)
        return True

    def get(self, key: RequestKey, durable: bool) -> Watched | None:
        return (self.held if durable else self.generates).get(key)

    def submitted(self, key: RequestKey, durable: bool) -> None:
        """Priority answered the submission, or did not in time (it may have queued it late):
        the lease starts now, so a late answer costs no early hand-on."""
        watched = (self.held if durable else self.generates).get(key)
        if watched is not None:
            watched.since, watched.submitting = self.clock, False

    def unwatch(self, key: RequestKey, durable: bool) -> Watched | None:
        """Priority did not take it (or handing it over failed): not watched after all."""
        return self._pop(self.held if durable else self.generates, key)

    def redelivered(self, key: RequestKey, msg: object) -> bool:
        """JetStream delivers a durable request again. True when it is already held (still
        running here): the new handle replaces the old and nothing else happens."""
        held = self.held.get(key)
        if held is None:
            return False
        held.msg = msg
        return True

    def adopt(self, key: RequestKey, msg: object) -> bool:
        """A durable request this ledger does not hold, delivered again (admission restarted, or
        handed it back while stalled): True, and held again without a copy, if a service
        reported it within the lease (it is still running: not to be run a second time)."""
        if self.clock - self.last_reported.get(key, -math.inf) > self.lease_s:
            return False
        self._put(self.held, key, Watched(msg, self.clock))
        return True

    # -------------------------------------------------------------------------- reports

    def reported(self, keys) -> None:
        """A holder named these requests in its heartbeat."""
        now = self.clock
        for key in keys:
            self.last_reported[key] = now

    def checkpoint(self, key: RequestKey, attempt: int, index: int, token_ids: list[int]) -> bool:
        """An executor's outputs from `index` on for the request's `attempt`. True when that
        attempt was already handed on (its holder was taken for dead and is still at it): the
        caller revokes it. A checkpoint of the current attempt replaces what it restates."""
        watched = self.held.get(key) or self.generates.get(key)
        if watched is None:
            return False
        if attempt < watched.attempt:
            return True
        if attempt == watched.attempt and index <= len(watched.tokens):
            del watched.tokens[index:]
            watched.tokens.extend(token_ids)
        return False

    def done(self, key: RequestKey, durable: bool) -> Watched | None:
        """The request ended (its final answer was sent, or its result stored): what this
        ledger watched (None: another admission watches it); the caller acks a durable one's
        message and ends its state."""
        if not durable:
            return self._pop(self.generates, key)
        self.last_reported.pop(key, None)
        return self._pop(self.held, key)

    # ------------------------------------------------------------------------ the lease

    def lost(self) -> list[tuple[RequestKey, Watched]]:
        """Every watched request no holder has named for a lease, each marked so that it is not
        lost again before another lease has passed. Those with a copy are to be handed on
        (`next_attempt`), the others handed back to JetStream (`give_back`). Forgets reports of
        requests no longer watched."""
        now = self.clock
        lost = [(key, watched) for table in (self.held, self.generates)
                for key, watched in table.items() if not watched.submitting
                and now - max(watched.since, self.last_reported.get(key, -math.inf)) > self.lease_s]
        for _, watched in lost:
            watched.since = now
        for key in [k for k, seen in self.last_reported.items()
                    if k not in self.held and k not in self.generates and now - seen > self.lease_s]:
            del self.last_reported[key]
        return lost

    def handed_on(self, watched: Watched) -> None:
        """Priority took the request's next attempt."""
        watched.attempt += 1

    def give_back(self, key: RequestKey, watched: Watched) -> bool:
        """A lost request without a copy goes back to JetStream: True, and no longer held, unless
        it ended (or was taken on again) since `lost` named it."""
        if self.held.get(key) is not watched:
            return False
        self._pop(self.held, key)
        self.last_reported.pop(key, None)
        return True
