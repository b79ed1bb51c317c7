"""Per-tenant token buckets over the tokens a request may use (prompt + max_tokens), each at
its tenant's quota (`quotas.*.tokens_per_s`, `burst_tokens`).

A bucket that has refilled to its burst is the same as no bucket, so such buckets are dropped
(swept every `sweep_every` takes): memory follows the tenants active lately, not every tenant
name ever seen, and a take is O(1) amortized."""

from __future__ import annotations

import time


class TokenBuckets:
    def __init__(self, sweep_every: int = 1024):
        self.sweep_every = sweep_every
        self._takes = 0
        # tenant -> (tokens, last refill, rate, burst)
        self._buckets: dict[str, tuple[float, float, float, float]] = {}

    def __len__(self) -> int:
        return len(self._buckets)

    def take(self, tenant: str, tokens: int, rate: float, burst: float,
             now: float | None = None) -> float:
        """Spend `tokens` if the tenant has them: 0.0; else the seconds until it would."""
        now = time.monotonic() if now is None else now
        self._takes += 1
        if self._takes % self.sweep_every == 0:
            self.sweep(now)
        level, last, _, _ = self._buckets.get(tenant, (burst, now, rate, burst))
        level = min(burst, level + (now - last) * rate)
        if tokens <= level:
            self._buckets[tenant] = (level - tokens, now, rate, burst)
            return 0.0
        self._buckets[tenant] = (level, now, rate, burst)
        return (min(tokens, burst) - level) / rate

    def sweep(self, now: float) -> None:
        """Forget the buckets that are full again."""
        full = [tenant for tenant, (level, last, rate, burst) in self._buckets.items()
                if level + (now - last) * rate >= burst]
        for tenant in full:
            del self._buckets[tenant]
