"""Cancels that arrived before their request: remembered for a while so a request that turns up
later (in transit between services when the cancel was published) still ends cancelled.

A cancel applies only to a request admitted before the cancel arrived here: one of a finished
request is not carried over to a later request that reuses its id. Each tenant's cancels are
bounded on their own, so one tenant's flood of cancels evicts only its own; past the capacity
of all of them together (a flood on many tenant names), the oldest cancel goes. Every operation
is O(1) whatever the number of tenants, and a tenant whose cancels are all gone leaves no trace:
a flood of cancels on random tenant names costs a dictionary entry each, for at most `ttl_s`.
"""

from __future__ import annotations

import time
from collections import OrderedDict

from shared.keys import RequestKey


class RecentCancels:
    def __init__(self, ttl_s: float = 300.0, per_tenant: int = 10_000, capacity: int = 100_000):
        self.ttl_s = ttl_s
        self.per_tenant = per_tenant
        self.capacity = capacity
        # Every cancel, oldest first (so also in the order they expire): when it arrived.
        self._order: OrderedDict[RequestKey, float] = OrderedDict()
        # tenant -> its cancels' ids, oldest first (tenants with none are not kept)
        self._by_tenant: dict[str, OrderedDict[str, None]] = {}

    def __len__(self) -> int:
        return len(self._order)

    @property
    def tenants(self) -> int:
        """How many tenants have a cancel remembered."""
        return len(self._by_tenant)

    def add(self, tenant: str, request_id: str, now: float | None = None) -> None:
        now = time.time() if now is None else now
        key = RequestKey(tenant, request_id)
        if key in self._order:
            self._remove(key)
        while self._order and now - next(iter(self._order.values())) >= self.ttl_s:
            self._remove(next(iter(self._order)))
        entries = self._by_tenant.get(tenant)
        if entries is not None and len(entries) >= self.per_tenant:
            self._remove(RequestKey(tenant, next(iter(entries))))
        if len(self._order) >= self.capacity:
            self._remove(next(iter(self._order)))
        self._order[key] = now
        self._by_tenant.setdefault(tenant, OrderedDict())[request_id] = None

    def take(self, tenant: str, request_id: str, admitted_at: float,
             now: float | None = None) -> bool:
        """True (once) when this request, admitted at `admitted_at` (wall clock), was cancelled
        after that and before it arrived here."""
        key = RequestKey(tenant, request_id)
        cancelled_at = self._order.get(key)
        if cancelled_at is None:
            return False
        self._remove(key)
        now = time.time() if now is None else now
        return admitted_at <= cancelled_at and now - cancelled_at < self.ttl_s

    def _remove(self, key: RequestKey) -> None:
        del self._order[key]
        entries = self._by_tenant[key.tenant]
        del entries[key.request_id]
        if not entries:
            del self._by_tenant[key.tenant]
