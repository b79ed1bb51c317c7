"""The waiting queue: best score first, then arrival; bounded; O(log n) push and pop, O(1) cancel."""

from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass, field

from shared.messages import WorkItem


def score(item: WorkItem) -> float:
    """For now the base priority alone (ties go to the earlier arrival); the adaptive policy of
    DESIGN §6 replaces this."""
    return float(item.request.priority)


@dataclass(order=True)
class _Entry:
    sort_key: tuple[float, int]
    item: WorkItem = field(compare=False)
    removed: bool = field(default=False, compare=False)


class WaitingQueue:
    def __init__(self, capacity: int):
        self.capacity = capacity
        self._heap: list[_Entry] = []
        self._by_id: dict[tuple[str, str], _Entry] = {}  # by (tenant, request_id)
        self._arrivals = itertools.count()

    def __len__(self) -> int:
        return len(self._by_id)

    def __contains__(self, key: tuple[str, str]) -> bool:
        return key in self._by_id

    @property
    def full(self) -> bool:
        return len(self) >= self.capacity

    def push(self, item: WorkItem) -> None:
        key = (item.tenant, item.request_id)
        assert not self.full and key not in self._by_id
        item.priority_score = score(item)
        entry = _Entry((-item.priority_score, next(self._arrivals)), item)
        heapq.heappush(self._heap, entry)
        self._by_id[key] = entry

    def pop(self, max_items: int) -> list[WorkItem]:
        items = []
        while self._heap and len(items) < max_items:
            entry = heapq.heappop(self._heap)
            if not entry.removed:
                del self._by_id[(entry.item.tenant, entry.item.request_id)]
                items.append(entry.item)
        return items

    def remove(self, request_id: str, tenant: str) -> WorkItem | None:
        """Take a request out (a cancel); only its own tenant may."""
        entry = self._by_id.pop((tenant, request_id), None)
        if entry is None:
            return None
        entry.removed = True  # dropped lazily when it reaches the top of the heap
        return entry.item

    def items(self) -> list[WorkItem]:
        return [entry.item for entry in self._by_id.values()]

    def depth_by_priority(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for entry in self._by_id.values():
            key = str(entry.item.request.priority)
            counts[key] = counts.get(key, 0) + 1
        return counts
