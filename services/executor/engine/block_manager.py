"""The paged KV cache's bookkeeping: block ownership, an O(1) LRU free list, and prefix caching.

A full block is identified by a chained hash (shared/block_hash.py), so equal hashes mean equal
prefixes. Freed blocks keep their hash and content until they are reused: a later request whose
prompt starts with the same blocks takes them back instead of recomputing them. What the cache
gains and loses is recorded for the executor's KV events (the batcher's routing index).

With `kv_cache.compress_below_priority` the cache is two pools (KvPools): the model's dtype and
int8. A sequence takes every block from the pool of its `pool` index, block ids count from 0 in
each pool, and prefix hits stay within a pool.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from services.executor.engine.sequence import Sequence
from shared.block_hash import chain_hash


@dataclass(eq=False)
class Block:
    block_id: int
    ref_count: int = 0
    hash: bytes | None = None


class BlockManager:
    num_pools = 1

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        self.block_size = block_size
        self.prefix_queries = 0  # prompt tokens looked up in the prefix cache
        self.prefix_hits = 0  # of those, tokens found
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        # Free blocks in eviction order: the least recently freed is taken first.
        self.free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.hash_to_block: dict[bytes, int] = {}
        # Net changes to the cached hashes since the last drain: True stored, False removed.
        self._changes: dict[bytes, bool] = {}

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        return len(self.free)

    @property
    def pools(self) -> list[BlockManager]:
        return [self]

    def pool_size(self, pool: int) -> int:
        assert pool == 0
        return len(self.blocks)

    def blocks_needed(self, seq: Sequence, num_new_tokens: int) -> int:
        total = seq.num_computed_tokens + num_new_tokens
        return max(0, -(-total // self.block_size) - len(seq.block_table))

    def can_allocate(self, seq: Sequence, num_new_tokens: int, reserve: int = 0) -> bool:
        return self.blocks_needed(seq, num_new_tokens) + reserve <= len(self.free)

    def allocate(self, seq: Sequence, num_new_tokens: int) -> None:
        """Give `seq` the blocks to hold `num_new_tokens` more tokens past those computed."""
        for _ in range(self.blocks_needed(seq, num_new_tokens)):
            block_id, _ = self.free.popitem(last=False)
            block = self.blocks[block_id]
            if block.hash is not None:  # evict its cached content
                if self.hash_to_block.get(block.hash) == block_id:
                    del self.hash_to_block[block.hash]
                    self._record(block.hash, False)
                block.hash = None
            block.ref_count = 1
            seq.block_table.append(block_id)

    def take_cached_prefix(self, seq: Sequence) -> int:
        """Claim the cached blocks that start `seq`'s tokens; returns how many tokens they hold.

        At least one token is always left to compute, since the step must produce its logits.
        """
        assert not seq.block_table and seq.num_computed_tokens == 0
        if not self.enable_prefix_caching:
            return 0
        max_blocks = (seq.num_tokens - 1) // self.block_size
        self._extend_hashes(seq, max_blocks)
        for block_hash in seq.block_hashes[:max_blocks]:
            block_id = self.hash_to_block.get(block_hash)
            if block_id is None:
                break
            block = self.blocks[block_id]
            if block.ref_count == 0:
                del self.free[block_id]
            block.ref_count += 1
            seq.block_table.append(block_id)
        seq.num_hashed_blocks = len(seq.block_table)
        seq.num_computed_tokens = len(seq.block_table) * self.block_size
        self.prefix_queries += seq.num_tokens
        self.prefix_hits += seq.num_computed_tokens
        return seq.num_computed_tokens

    def give_back_prefix(self, seq: Sequence) -> None:
        """Release the prefix `take_cached_prefix` just claimed for `seq`, which is not admitted
        after all (it waits on): the lookup is not counted, it is counted when it is."""
        self.prefix_queries -= seq.num_tokens
        self.prefix_hits -= seq.num_computed_tokens
        self.free_seq(seq)

    def commit_full_blocks(self, seq: Sequence) -> None:
        """Register blocks whose tokens are all known and whose KV is written (or in flight)."""
        if not self.enable_prefix_caching:
            return
        num_full = min(seq.num_computed_tokens, len(seq.token_ids)) // self.block_size
        if num_full <= seq.num_hashed_blocks:
            return
        self._extend_hashes(seq, num_full)
        for i in range(seq.num_hashed_blocks, num_full):
            block = self.blocks[seq.block_table[i]]
            block_hash = seq.block_hashes[i]
            if block_hash not in self.hash_to_block:  # else an equal block is already cached
                block.hash = block_hash
                self.hash_to_block[block_hash] = block.block_id
                self._record(block_hash, True)
        seq.num_hashed_blocks = num_full

    def free_seq(self, seq: Sequence) -> None:
        """Release `seq`'s blocks. The tail goes to the free list first, so it is evicted first."""
        for block_id in reversed(seq.block_table):
            block = self.blocks[block_id]
            block.ref_count -= 1
            assert block.ref_count >= 0, f"block {block_id} freed twice"
            if block.ref_count == 0:
                self.free[block_id] = None
        seq.block_table = []
        seq.num_hashed_blocks = 0
        seq.num_computed_tokens = 0

    def reset_prefix_cache(self) -> None:
        """Forget every cached block, e.g. after a failed step left blocks registered unwritten."""
        for block in self.blocks:
            block.hash = None
        for block_hash in self.hash_to_block:
            self._record(block_hash, False)
        self.hash_to_block.clear()

    def drain_kv_changes(self) -> tuple[list[bytes], list[bytes]]:
        """The hashes the prefix cache gained and lost since the previous call (net: a block
        stored and evicted in between is in neither list)."""
        stored = [h for h, kept in self._changes.items() if kept]
        removed = [h for h, kept in self._changes.items() if not kept]
        self._changes.clear()
        return stored, removed

    def _record(self, block_hash: bytes, kept: bool) -> None:
        if not kept and self._changes.get(block_hash):
            del self._changes[block_hash]  # stored since the last drain: the receiver never saw it
        else:
            self._changes[block_hash] = kept

    def _extend_hashes(self, seq: Sequence, num_blocks: int) -> None:
        bs = self.block_size
        for i in range(len(seq.block_hashes), num_blocks):
            parent = seq.block_hashes[i - 1] if i else b""
            seq.block_hashes.append(chain_hash(parent, seq.token_ids[i * bs:(i + 1) * bs]))


class KvPools:
    """Two or more block pools behind BlockManager's interface: each call about a sequence goes
    to the pool its `pool` index names; counts add up over the pools; the prefix cache's hashes,
    as the KV events report them, are those that any pool holds."""

    def __init__(self, sizes: list[int], block_size: int, enable_prefix_caching: bool = True):
        self.pools = [BlockManager(n, block_size, enable_prefix_caching) for n in sizes]
        self.block_size = block_size

    @property
    def num_pools(self) -> int:
        return len(self.pools)

    def pool_size(self, pool: int) -> int:
        return self.pools[pool].num_blocks

    # The pools' totals.
    num_blocks = property(lambda self: sum(p.num_blocks for p in self.pools))
    num_free_blocks = property(lambda self: sum(p.num_free_blocks for p in self.pools))
    prefix_queries = property(lambda self: sum(p.prefix_queries for p in self.pools))
    prefix_hits = property(lambda self: sum(p.prefix_hits for p in self.pools))

    @property
    def hash_to_block(self) -> dict[bytes, int]:
        """Every cached hash (a block id of one pool holding it)."""
        held: dict[bytes, int] = {}
        for pool in reversed(self.pools):
            held.update(pool.hash_to_block)
        return held

    def can_allocate(self, seq: Sequence, num_new_tokens: int, reserve: int = 0) -> bool:
        return self.pools[seq.pool].can_allocate(seq, num_new_tokens, reserve)

    def allocate(self, seq: Sequence, num_new_tokens: int) -> None:
        self.pools[seq.pool].allocate(seq, num_new_tokens)

    def take_cached_prefix(self, seq: Sequence) -> int:
        return self.pools[seq.pool].take_cached_prefix(seq)

    def give_back_prefix(self, seq: Sequence) -> None:
        self.pools[seq.pool].give_back_prefix(seq)

    def commit_full_blocks(self, seq: Sequence) -> None:
        self.pools[seq.pool].commit_full_blocks(seq)

    def free_seq(self, seq: Sequence) -> None:
        self.pools[seq.pool].free_seq(seq)

    def reset_prefix_cache(self) -> None:
        for pool in self.pools:
            pool.reset_prefix_cache()

    def drain_kv_changes(self) -> tuple[list[bytes], list[bytes]]:
        """Net changes to the union of the pools' hashes: a hash one pool lost is removed only
        when no other pool holds it. A hash both pools gained may be reported stored again;
        the receiver's index is a set."""
        touched: dict[bytes, None] = {}
        for pool in self.pools:
            stored, removed = pool.drain_kv_changes()
            touched.update(dict.fromkeys(stored + removed))
        held = [h for h in touched if any(h in p.hash_to_block for p in self.pools)]
        held_set = set(held)
        return held, [h for h in touched if h not in held_set]
