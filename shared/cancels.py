"""Cancels that arrived before their request: remembered for a while so a request that turns up
later (in transit between services when the cancel was published) still ends cancelled."""

from __future__ import annotations

import time


class RecentCancels:
    def __init__(self, ttl_s: float = 300.0):
        self.ttl_s = ttl_s
        self._expiry: dict[tuple[str, str], float] = {}  # (tenant, request_id) -> deadline

    def add(self, tenant: str, request_id: str) -> None:
        now = time.monotonic()
        if len(self._expiry) > 10_000:
            self._expiry = {k: t for k, t in self._expiry.items() if t > now}
        self._expiry[(tenant, request_id)] = now + self.ttl_s

    def take(self, tenant: str, request_id: str) -> bool:
        """True (once) when this request was cancelled before it arrived."""
        deadline = self._expiry.pop((tenant, request_id), None)
        return deadline is not None and deadline > time.monotonic()
