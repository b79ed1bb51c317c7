"""The waiting queue: bounded, O(1) push and cancel, and pulls that see current scores.

Scores change with time (urgency, aging) and with load and fairness, so no fixed heap order
holds. Rows live in parallel numpy arrays kept dense (a removal moves the last row into the
hole); a pull scores every row in one vectorised pass and selects the best k in O(n), with no
sort of the whole queue. Deadlines sit in a heap of their own so expired requests leave in
O(log n) each.
"""

from __future__ import annotations

import heapq
import itertools
import math

import numpy as np

from services.priority import policy
from shared.keys import RequestKey
from shared.messages import WorkItem

_COLUMNS = {"priority": np.int64, "seq": np.float64, "arrival": np.float64,
            "deadline": np.float64, "demand": np.float64, "prompt": np.float64,
            "known": np.bool_, "tenant": np.int64, "size": np.int64}


class WaitingQueue:
    def __init__(self, capacity: int, initial_rows: int = 256):
        self.capacity = capacity
        self._rows = max(1, min(capacity, initial_rows))
        self._cols = {name: np.zeros(self._rows, dtype=dtype) for name, dtype in _COLUMNS.items()}
        self._items: list[WorkItem] = []  # row -> item
        self._row_of: dict[RequestKey, int] = {}  # -> row
        self._seq_of: dict[RequestKey, int] = {}
        self._deadlines: list[tuple[float, int, RequestKey]] = []  # heap
        # Tenants with requests here, each by an index (a column value); the index of a tenant
        # whose last request leaves is free for the next newcomer, so these stay as large as the
        # most tenants ever waiting at once, not every tenant ever seen.
        self._tenant_ids: dict[str, int] = {}
        self.tenants: list[str | None] = []  # index -> name (None: free)
        self._tenant_rows: list[int] = []  # index -> its requests here
        self._free_indices: list[int] = []
        self._arrivals = itertools.count()
        self.last_seq = -1  # the arrival sequence number of the latest push

    def __len__(self) -> int:
        return len(self._items)

    @property
    def tenant_ids(self) -> dict[str, int]:
        """Each tenant with requests here, by name: its index."""
        return self._tenant_ids

    def __contains__(self, key: RequestKey) -> bool:
        return key in self._row_of

    @property
    def full(self) -> bool:
        return len(self) >= self.capacity

    def tenant_index(self, tenant: str) -> int:
        """The tenant's index, given it for one more request here."""
        index = self._tenant_ids.get(tenant)
        if index is None:
            if self._free_indices:
                index = self._free_indices.pop()
                self.tenants[index] = tenant
            else:
                index = len(self.tenants)
                self.tenants.append(tenant)
                self._tenant_rows.append(0)
            self._tenant_ids[tenant] = index
        self._tenant_rows[index] += 1
        return index

    def _release_tenant(self, index: int) -> None:
        self._tenant_rows[index] -= 1
        if self._tenant_rows[index] == 0:
            del self._tenant_ids[self.tenants[index]]
            self.tenants[index] = None
            self._free_indices.append(index)

    def push(self, item: WorkItem, demand_tokens: float, past_bound: bool = False,
             known: bool = False, size: int = 0) -> None:
        """`past_bound`: taken even when the queue is full (a request that was here before, or
        one that another made room for). `known`: its demand stands on the tenant's own history,
        not the predictor's prior. `size`: its encoded bytes (what a pull's reply carries)."""
        key = item.key
        assert (past_bound or not self.full) and key not in self._row_of
        row = len(self._items)
        if row == self._rows:
            self._grow()
        seq = self.last_seq = next(self._arrivals)
        deadline = item.deadline if item.deadline is not None else math.inf
        values = dict(priority=item.request.priority, seq=seq, arrival=item.arrival_time,
                      deadline=deadline, demand=demand_tokens, prompt=item.num_prompt_tokens,
                      known=known, tenant=self.tenant_index(item.tenant), size=size)
        for name, value in values.items():
            self._cols[name][row] = value
        self._items.append(item)
        self._row_of[key] = row
        self._seq_of[key] = seq
        if item.deadline is not None:
            heapq.heappush(self._deadlines, (deadline, seq, key))
            if len(self._deadlines) > 2 * len(self._items) + 1024:  # mostly dispatched ones
                self._deadlines = [e for e in self._deadlines if self._seq_of.get(e[2]) == e[1]]
                heapq.heapify(self._deadlines)

    def _grow(self) -> None:
        self._rows = 2 * self._rows if self._rows >= self.capacity else min(self.capacity,
                                                                             2 * self._rows)
        for name, column in self._cols.items():
            wider = np.zeros(self._rows, dtype=column.dtype)
            wider[:len(column)] = column
            self._cols[name] = wider

    def _take(self, row: int) -> WorkItem:
        """Remove one row: the last row moves into its place."""
        item = self._items[row]
        key = item.key
        del self._row_of[key], self._seq_of[key]
        self._release_tenant(int(self._cols["tenant"][row]))
        last = len(self._items) - 1
        if row != last:
            moved = self._items[last]
            self._items[row] = moved
            for column in self._cols.values():
                column[row] = column[last]
            self._row_of[(moved.tenant, moved.request_id)] = row
        self._items.pop()
        return item

    def waiting(self, fairness_by_tenant: np.ndarray) -> policy.Waiting:
        n = len(self._items)
        rows = {name: column[:n] for name, column in self._cols.items() if name != "size"}
        return policy.Waiting(**rows, fairness=fairness_by_tenant[rows["tenant"]])

    def item(self, row: int) -> WorkItem:
        return self._items[row]

    def predicted_output(self, row: int) -> int:
        """The output tokens its demand counts on (the demand less the prompt)."""
        return int(self._cols["demand"][row] - self._cols["prompt"][row])

    def sizes(self) -> np.ndarray:
        """Each row's encoded bytes."""
        return self._cols["size"][:len(self._items)]

    def tenant_rows(self) -> np.ndarray:
        return self._cols["tenant"][:len(self._items)]

    def take(self, rows: list[int]) -> list[WorkItem]:
        """Remove the given rows (as numbered by `waiting()`); their items in the same order."""
        items = {}
        for row in sorted(rows, reverse=True):  # later rows first: a move never hits one left
            items[row] = self._take(row)
        return [items[row] for row in rows]

    def get(self, key: RequestKey) -> WorkItem | None:
        row = self._row_of.get(key)
        return None if row is None else self._items[row]

    def replace(self, item: WorkItem, size: int) -> None:
        """A later attempt of a waiting request (same arrival, so same deadline and order)
        takes its place, with its encoded size (it may carry resumed outputs)."""
        row = self._row_of.get(item.key)
        if row is not None and self._items[row].arrival_time == item.arrival_time:
            self._items[row] = item
            self._cols["size"][row] = size

    def remove(self, request_id: str, tenant: str) -> WorkItem | None:
        """Take a request out (a cancel); only its own tenant may."""
        row = self._row_of.get(RequestKey(tenant, request_id))
        return None if row is None else self._take(row)

    def expired(self, now: float) -> list[WorkItem]:
        """Take out every request whose deadline has passed."""
        gone = []
        while self._deadlines and self._deadlines[0][0] <= now:
            _, seq, key = heapq.heappop(self._deadlines)
            if self._seq_of.get(key) == seq:  # not dispatched or cancelled since
                gone.append(self._take(self._row_of[key]))
        return gone

    def items(self) -> list[WorkItem]:
        return list(self._items)

    def depth_by_priority(self) -> dict[str, int]:
        values, counts = np.unique(self._cols["priority"][:len(self._items)], return_counts=True)
        return {str(v): int(c) for v, c in zip(values, counts)}
