"""Generate requests waiting to be admitted: one line per tenant, taken in turn.

Admission reads requests off its subscription as fast as they come and puts them here; a fixed
set of workers admits them, taking one tenant's oldest request after another's. When admission
cannot keep up (a flood from one tenant), the backlog forms in the flooding tenant's line, and
a request of any other tenant is taken within one turn, not after the whole flood. Full, the
latest request of the tenant with the longest line is refused to make room (longest-queue drop:
one tenant's flood cannot lock the others out); past its bytes, the latest of the tenant holding
the most bytes. Every operation is O(1), however many tenants have lines (the longest is kept
track of, not searched for), but a put past the byte budget, which looks for the heaviest.
"""

from __future__ import annotations

import asyncio
import math
from collections import deque
from collections.abc import Callable
from typing import Generic, TypeVar

T = TypeVar("T")


class FairIntake(Generic[T]):
    """`capacity` requests at most, and `max_bytes` of them by `size_of` (each request's bytes;
    without it, requests are not counted in bytes): a flood of large messages is refused by
    the same rule before it fills the memory."""

    def __init__(self, capacity: int, max_bytes: float = math.inf,
                 size_of: Callable[[T], int] | None = None):
        self.capacity = capacity
        self.max_bytes = max_bytes
        self.size_of = size_of or (lambda item: 0)
        self.lines: dict[str, deque[T]] = {}  # tenant -> its requests, oldest first
        self.turns: deque[str] = deque()  # tenants with requests, in the order they are served
        self.by_length: dict[int, set[str]] = {}  # line length -> the tenants with such a line
        self.longest = 0
        self.size = 0
        self.bytes = 0
        self.tenant_bytes: dict[str, int] = {}  # tenant -> bytes of its requests here (> 0)
        self._waiting = asyncio.Semaphore(0)  # one release per request queued: wakes one worker

    def __len__(self) -> int:
        return self.size

    def put(self, tenant: str, item: T) -> list[T]:
        """Queue `item`; what had to be refused for it. Full by count: the latest of the
        longest line, or `item` itself when its own tenant's line is the longest. Full by bytes:
        the latest of the tenant holding the most bytes (as many as `item` needs), or `item`
        itself when its own tenant would then hold the most."""
        nbytes = self.size_of(item)
        refused: list[T] = []
        if self.size >= self.capacity:
            if self.longest <= len(self.lines.get(tenant, ())) + 1:
                return [item]
            refused.append(self._pop_latest(next(iter(self.by_length[self.longest]))))
        while self.size and self.bytes + nbytes > self.max_bytes:
            # O(lines), only past the byte budget (a flood of large messages)
            heaviest = max(self.tenant_bytes, key=self.tenant_bytes.__getitem__)
            if self.tenant_bytes.get(tenant, 0) + nbytes >= self.tenant_bytes[heaviest]:
                return [item, *refused]  # (those refused before it: their room goes unused)
            refused.append(self._pop_latest(heaviest))
        line = self.lines.get(tenant)
        if line is None:
            line = self.lines[tenant] = deque()
            self.turns.append(tenant)
        line.append(item)
        self._resized(tenant, len(line) - 1, +1)
        self.size += 1
        self._add_bytes(tenant, nbytes)
        if not refused:  # one request more: one wake-up more (a request refused leaves its own
            self._waiting.release()  # for this one, or a spare that `get` waits out)
        return refused

    def _pop_latest(self, tenant: str) -> T:
        """The latest request of `tenant` taken out (the longest line's, or the heaviest's: a
        line the heaviest may empty, the longest never does)."""
        line = self.lines[tenant]
        item = line.pop()
        self._resized(tenant, len(line) + 1, -1)
        self.size -= 1
        self._add_bytes(tenant, -self.size_of(item))
        if not line:  # O(lines), and only past the byte budget
            del self.lines[tenant]
            self.turns.remove(tenant)
        return item

    def _add_bytes(self, tenant: str, nbytes: int) -> None:
        self.bytes += nbytes
        held = self.tenant_bytes.get(tenant, 0) + nbytes
        if held > 0:
            self.tenant_bytes[tenant] = held
        else:
            self.tenant_bytes.pop(tenant, None)

    def _take(self) -> tuple[str, T]:
        """The next tenant's oldest request (one must wait)."""
        tenant = self.turns.popleft()
        line = self.lines[tenant]
        item = line.popleft()
        self._resized(tenant, len(line) + 1, -1)
        self.size -= 1
        self._add_bytes(tenant, -self.size_of(item))
        if line:
            self.turns.append(tenant)
        else:
            del self.lines[tenant]
        return tenant, item

    def _resized(self, tenant: str, length: int, change: int) -> None:
        """`tenant`'s line went from `length` by `change` (+1 or -1). A refused request leaves
        its line non-empty (it was the longest, and longer than the newcomer's)."""
        tenants = self.by_length[length] if length else None
        if tenants is not None:
            tenants.discard(tenant)
            if not tenants:
                del self.by_length[length]
                if self.longest == length and change < 0:
                    self.longest -= 1
        if length + change:
            self.by_length.setdefault(length + change, set()).add(tenant)
        self.longest = max(self.longest, length + change)

    async def get(self) -> tuple[str, T]:
        """The next request, waiting for one (each queued request wakes one waiter; one woken
        for a request refused since finds none and waits again)."""
        while True:
            await self._waiting.acquire()
            if self.size:
                return self._take()

    def drain(self) -> list[tuple[str, T]]:
        """Everything still waiting, taken out (once nobody calls `get` any more)."""
        return [self._take() for _ in range(self.size)]
