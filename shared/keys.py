"""The one key of a request inside jetserve: its tenant and its id.

A `request_id` is unique only within its tenant (two tenants may both send `req-1`), so every
table that tracks requests (admission's ledger, priority's queue, an executor's running
requests and its engine) is keyed by the pair, and logs name it by `str(key)`.
"""

from __future__ import annotations

from typing import NamedTuple


class RequestKey(NamedTuple):
    tenant: str
    request_id: str

    def __str__(self) -> str:
        return f"{self.tenant}/{self.request_id}"
