"""The chained hash of a prompt's KV blocks: h_i = H(h_{i-1}, tokens of block i), so equal hashes
mean equal prefixes. The executor's block manager keys its prefix cache by it; admission hashes a
prompt once with it, so the batcher can route by cached prefix without tokenizing."""

from __future__ import annotations

import hashlib
from array import array


def chain_hash(parent: bytes, tokens: list[int]) -> bytes:
    return hashlib.blake2b(parent + array("q", tokens).tobytes(), digest_size=16).digest()


def block_hashes(token_ids: list[int], block_size: int) -> list[bytes]:
    """The hashes of every full block of `token_ids`."""
    hashes, parent = [], b""
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = chain_hash(parent, token_ids[start:start + block_size])
        hashes.append(parent)
    return hashes
