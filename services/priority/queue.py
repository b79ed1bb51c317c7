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
        self._by_id: dict[str, _Entry] = {}
        self._arrivals = itertools.count()

    def __len__(self) -> int:
        return len(self._by_id)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._by_id

    @property
    def full(self) -> bool:
        return len(self) >= self.capacity

    def push(self, item: WorkItem) -> None:
        assert not self.full and item.request_id not in self._by_id
        item.priority_score = score(item)
        entry = _Entry((-item.priority_score, next(self._arrivals)), item)
        heapq.heappush(self._heap, entry)
        self._by_id[item.request_id] = entry

    def pop(self, max_items: int) -> list[WorkItem]:
        items = []
        while self._heap and len(items) < max_items:
            entry = heapq.heappop(self._heap)
            if not entry.removed:
                del self._by_id[entry.item.request_id]
                items.append(entry.item)
        return items

    def remove(self, request_id: str, tenant: str) -> WorkItem | None:
        """Take a request out (a cancel); only its own tenant may."""
        entry = self._by_id.get(request_id)
        if entry is None or entry.item.tenant != tenant:
            return None
        entry.removed = True  # dropped lazily when it reaches the top of the heap
        del self._by_id[request_id]
        return entry.item

    def items(self) -> list[WorkItem]:
        return [entry.item for entry in self._by_id.values()]

    def depth_by_priority(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for entry in self._by_id.values():
            key = str(entry.item.request.priority)
            counts[key] = counts.get(key, 0) + 1
        return counts
