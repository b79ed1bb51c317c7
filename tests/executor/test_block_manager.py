from services.executor.engine.block_manager import BlockManager
from services.executor.engine.sequence import SamplingParams, Sequence


def seq(tokens, rid="r"):
    return Sequence(rid, list(tokens), SamplingParams(max_tokens=8))


def test_allocate_and_free_counts():
    bm = BlockManager(num_blocks=8, block_size=4)
    s = seq(range(10))
    assert bm.blocks_needed(s, 10) == 3
    bm.allocate(s, 10)
    assert len(s.block_table) == 3 and bm.num_free_blocks == 5
    s.num_computed_tokens = 10
    assert bm.blocks_needed(s, 2) == 0 and bm.blocks_needed(s, 3) == 1
    bm.free_seq(s)
    assert bm.num_free_blocks == 8 and s.block_table == []


def test_prefix_hit_reuses_blocks_and_leaves_one_token():
    bm = BlockManager(num_blocks=16, block_size=4)
    a = seq(range(12), "a")
    bm.allocate(a, 12)
    a.num_computed_tokens = 12
    bm.commit_full_blocks(a)
    assert a.num_hashed_blocks == 3

    b = seq(list(range(8)) + [100, 101, 102], "b")  # shares two full blocks with a
    assert bm.take_cached_prefix(b) == 8
    assert b.block_table == a.block_table[:2]
    assert [bm.blocks[i].ref_count for i in b.block_table] == [2, 2]

    c = seq(range(12), "c")  # the whole prompt is cached: the last block is recomputed
    assert bm.take_cached_prefix(c) == 8


def test_freed_blocks_stay_cached_until_evicted_lru():
    bm = BlockManager(num_blocks=4, block_size=2)
    a = seq([1, 2, 3, 4, 5], "a")
    bm.allocate(a, 5)
    a.num_computed_tokens = 5
    bm.commit_full_blocks(a)
    first_blocks = list(a.block_table[:2])
    bm.free_seq(a)
    assert bm.num_free_blocks == 4
    # A request with the same prefix takes the cached blocks back out of the free list.
    b = seq([1, 2, 3, 4, 9], "b")
    assert bm.take_cached_prefix(b) == 4 and b.block_table == first_blocks
    assert bm.num_free_blocks == 2
    bm.free_seq(b)
    # Allocating everything evicts the cached blocks; their hashes are forgotten.
    c = seq(range(100, 108), "c")
    bm.allocate(c, 8)
    assert bm.hash_to_block == {}
    d = seq([1, 2, 3, 4, 9], "d")
    bm.free_seq(c)
    assert bm.take_cached_prefix(d) == 0


def test_tail_blocks_are_evicted_first():
    bm = BlockManager(num_blocks=3, block_size=2)
    a = seq([1, 2, 3, 4, 5, 6, 7], "a")
    bm.allocate(a, 6)
    a.num_computed_tokens = 6
    bm.commit_full_blocks(a)
    head, mid, tail = a.block_table
    bm.free_seq(a)
    b = seq([50, 51], "b")
    bm.allocate(b, 2)
    assert b.block_table == [tail]
    # The head blocks are still cached.
    c = seq([1, 2, 3, 4, 0], "c")
    assert bm.take_cached_prefix(c) == 4 and c.block_table == [head, mid]


def test_equal_blocks_computed_twice_register_once():
    bm = BlockManager(num_blocks=8, block_size=2)
    a, b = seq([1, 2, 3], "a"), seq([1, 2, 3], "b")
    for s in (a, b):
        bm.allocate(s, 3)
        s.num_computed_tokens = 3
        bm.commit_full_blocks(s)
    assert bm.hash_to_block[a.block_hashes[0]] == a.block_table[0]
    bm.free_seq(a)
    bm.free_seq(b)
    assert bm.num_free_blocks == 8


def test_kv_changes_report_cached_hashes_net_and_match_admission_hashing():
    from shared.block_hash import block_hashes

    bm = BlockManager(num_blocks=3, block_size=2)
    a = seq([1, 2, 3, 4, 5], "a")
    bm.allocate(a, 5)
    a.num_computed_tokens = 5
    bm.commit_full_blocks(a)
    stored, removed = bm.drain_kv_changes()
    # The hashes admission computes from the prompt alone are the ones the cache reports.
    assert stored == block_hashes([1, 2, 3, 4, 5], 2) and removed == []
    assert bm.drain_kv_changes() == ([], [])
    bm.free_seq(a)
    # A new sequence takes every block: the two cached ones are evicted.
    b = seq([7, 8, 9, 10, 11], "b")
    bm.allocate(b, 5)
    b.num_computed_tokens = 4
    bm.commit_full_blocks(b)
    stored, removed = bm.drain_kv_changes()
    assert stored == block_hashes([7, 8, 9, 10], 2) and sorted(removed) == sorted(
        block_hashes([1, 2, 3, 4], 2))
    bm.reset_prefix_cache()
    assert bm.drain_kv_changes() == ([], block_hashes([7, 8, 9, 10], 2))
    # Stored and dropped between two drains: the receiver never needs to hear of it.
    bm.free_seq(b)
    c = seq([5, 6, 7], "c")
    bm.allocate(c, 3)
    c.num_computed_tokens = 3
    bm.commit_full_blocks(c)
    bm.reset_prefix_cache()
    assert bm.drain_kv_changes() == ([], [])
