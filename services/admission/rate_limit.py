"""Per-tenant token buckets over the tokens a request may use (prompt + max_tokens)."""

from __future__ import annotations

import time


class TokenBuckets:
    def __init__(self, tokens_per_s: float, burst_tokens: int):
        self.rate = tokens_per_s
        self.burst = float(burst_tokens)
        self._buckets: dict[str, tuple[float, float]] = {}  # tenant -> (tokens, last refill)

    def take(self, tenant: str, tokens: int, now: float | None = None) -> float:
        """Spend `tokens` if the tenant has them: 0.0; else the seconds until it would."""
        now = time.monotonic() if now is None else now
        level, last = self._buckets.get(tenant, (self.burst, now))
        level = min(self.burst, level + (now - last) * self.rate)
        if tokens <= level:
            self._buckets[tenant] = (level - tokens, now)
            return 0.0
        self._buckets[tenant] = (level, now)
        return (min(tokens, self.burst) - level) / self.rate
