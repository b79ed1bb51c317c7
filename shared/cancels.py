"""Cancels that arrived before their request: remembered for a while so a request that turns up
later (in transit between services when the cancel was published) still ends cancelled.

A cancel applies only to a request admitted before the cancel arrived here: one of a finished
request is not carried over to a later request that reuses its id. Each tenant's cancels are
bounded on their own, so one tenant's flood of cancels evicts only its own."""

from __future__ import annotations

import time
from collections import OrderedDict


class RecentCancels:
    def __init__(self, ttl_s: float = 300.0, per_tenant: int = 10_000, capacity: int = 100_000):
        self.ttl_s = ttl_s
        self.per_tenant = per_tenant
        self.capacity = capacity
        self._size = 0
        # tenant -> request_id -> when the cancel arrived (wall clock), oldest first
        self._by_tenant: dict[str, OrderedDict[str, float]] = {}

    def __len__(self) -> int:
        return self._size

    def add(self, tenant: str, request_id: str, now: float | None = None) -> None:
        now = time.time() if now is None else now
        entries = self._by_tenant.setdefault(tenant, OrderedDict())
        if request_id in entries:
            del entries[request_id]
            self._size -= 1
        self._expire(entries, now)
        if len(entries) >= self.per_tenant:
            self._evict(entries)
        if self._size >= self.capacity:  # many tenants: the one holding the most gives way
            most = max(self._by_tenant, key=lambda t: len(self._by_tenant[t]))
            self._evict(self._by_tenant[most])
            if not self._by_tenant[most] and most != tenant:
                del self._by_tenant[most]
        entries[request_id] = now
        self._size += 1

    def take(self, tenant: str, request_id: str, admitted_at: float,
             now: float | None = None) -> bool:
        """True (once) when this request, admitted at `admitted_at` (wall clock), was cancelled
        after that and before it arrived here."""
        entries = self._by_tenant.get(tenant)
        if entries is None or request_id not in entries:
            return False
        cancelled_at = entries.pop(request_id)
        self._size -= 1
        if not entries:
            del self._by_tenant[tenant]
        now = time.time() if now is None else now
        return admitted_at <= cancelled_at and now - cancelled_at < self.ttl_s

    def _expire(self, entries: OrderedDict[str, float], now: float) -> None:
        while entries and now - next(iter(entries.values())) >= self.ttl_s:
            self._evict(entries)

    def _evict(self, entries: OrderedDict[str, float]) -> None:
        entries.popitem(last=False)
        self._size -= 1
