"""Per-tenant token buckets over the tokens a request may use (prompt + max_tokens).

A bucket that has refilled to the burst is the same as no bucket, so such buckets are dropped
(swept every `sweep_every` takes): memory follows the tenants active lately, not every tenant
name ever seen."""

from __future__ import annotations

import time


class TokenBuckets:
    def __init__(self, tokens_per_s: float, burst_tokens: int, sweep_every: int = 1024):
        self.rate = tokens_per_s
        self.burst = float(burst_tokens)
        self.sweep_every = sweep_every
        self._takes = 0
        self._buckets: dict[str, tuple[float, float]] = {}  # tenant -> (tokens, last refill)

    def __len__(self) -> int:
        return len(self._buckets)

    def take(self, tenant: str, tokens: int, now: float | None = None) -> float:
        """Spend `tokens` if the tenant has them: 0.0; else the seconds until it would."""
        now = time.monotonic() if now is None else now
        self._takes += 1
        if self._takes % self.sweep_every == 0:
            self.sweep(now)
        level, last = self._buckets.get(tenant, (self.burst, now))
        level = min(self.burst, level + (now - last) * self.rate)
        if tokens <= level:
            self._buckets[tenant] = (level - tokens, now)
            return 0.0
        self._buckets[tenant] = (level, now)
        return (min(tokens, self.burst) - level) / self.rate

    def sweep(self, now: float) -> None:
        """Forget the buckets that are full again."""
        full = [tenant for tenant, (level, last) in self._buckets.items()
                if level + (now - last) * self.rate >= self.burst]
        for tenant in full:
            del self._buckets[tenant]
