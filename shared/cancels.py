"""Cancels that arrived before their request: remembered for a while so a request that turns up
later (in transit between services when the cancel was published) still ends cancelled."""

from __future__ import annotations

import time
from collections import OrderedDict


class RecentCancels:
    def __init__(self, ttl_s: float = 300.0, capacity: int = 100_000):
        self.ttl_s = ttl_s
        self.capacity = capacity
        # (tenant, request_id) -> deadline, oldest first: expiry and the bound cost O(1) each.
        self._expiry: OrderedDict[tuple[str, str], float] = OrderedDict()

    def add(self, tenant: str, request_id: str) -> None:
        now = time.monotonic()
        while self._expiry and (len(self._expiry) >= self.capacity
                                or next(iter(self._expiry.values())) <= now):
            self._expiry.popitem(last=False)
        self._expiry[(tenant, request_id)] = now + self.ttl_s
        self._expiry.move_to_end((tenant, request_id))

    def take(self, tenant: str, request_id: str) -> bool:
        """True (once) when this request was cancelled before it arrived."""
        deadline = self._expiry.pop((tenant, request_id), None)
        return deadline is not None and deadline > time.monotonic()
