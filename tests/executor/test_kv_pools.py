"""Two KV pools (kv_cache.compress_below_priority): requests under the priority bound keep their
KV in int8 blocks of a second pool, the others in the model's dtype. The pools' bookkeeping, the
scheduler across them, and engines whose tokens in each pool equal a one-pool engine's."""

from __future__ import annotations

import pytest

from jetserve_kernels import kv_int8

from services.executor.engine.block_manager import KvPools
from services.executor.engine.llm_engine import Engine
from services.executor.engine.scheduler import Scheduler
from services.executor.engine.sequence import SamplingParams, SeqStatus, Sequence
from services.executor.engine.triton_backend import TritonBackend
from shared.protocol import GenerateRequest
from tests.conftest import generate_all, tiny_config


def seq(tokens, pool, score=5.0, rid=None, index=0):
    return Sequence(rid or f"s{index}", list(tokens), SamplingParams(max_tokens=4), score=score,
                    pool=pool, arrival_index=index)


def test_each_sequence_takes_blocks_from_its_own_pool():
    pools = KvPools([4, 8], block_size=4)
    assert (pools.num_blocks, pools.num_free_blocks, pools.num_pools) == (12, 12, 2)
    a, b = seq(range(10), pool=0, index=0), seq(range(10), pool=1, index=1)
    pools.allocate(a, 10)
    pools.allocate(b, 10)
    assert a.block_table == [0, 1, 2] and b.block_table == [0, 1, 2]  # ids count in each pool
    assert (pools.pools[0].num_free_blocks, pools.pools[1].num_free_blocks) == (1, 5)
    assert not pools.can_allocate(seq(range(8), pool=0), 8)
    assert pools.can_allocate(seq(range(8), pool=1), 8)
    pools.free_seq(a)
    assert pools.num_free_blocks == 9


def test_prefix_hits_stay_in_a_pool_and_events_report_the_union():
    pools = KvPools([8, 8], block_size=4)
    first = seq(range(9), pool=0, index=0)
    pools.allocate(first, 9)
    first.num_computed_tokens = 9
    pools.commit_full_blocks(first)
    stored, removed = pools.drain_kv_changes()
    assert len(stored) == 2 and removed == []
    hashes = set(stored)

    other_pool = seq(range(9), pool=1, index=1)
    assert pools.take_cached_prefix(other_pool) == 0  # the int8 pool holds none of it
    same_pool = seq(range(9), pool=0, index=2)
    assert pools.take_cached_prefix(same_pool) == 8
    pools.free_seq(same_pool)

    pools.allocate(other_pool, 9)
    other_pool.num_computed_tokens = 9
    pools.commit_full_blocks(other_pool)
    pools.drain_kv_changes()
    pools.free_seq(first)
    pools.pools[0].reset_prefix_cache()  # pool 0 forgets them; pool 1 still holds them
    stored, removed = pools.drain_kv_changes()
    assert removed == [] and set(stored) == hashes
    assert set(pools.hash_to_block) == hashes
    pools.reset_prefix_cache()
    stored, removed = pools.drain_kv_changes()
    assert stored == [] and set(removed) == hashes and pools.hash_to_block == {}


def resolve(batch):
    """Play the model: every sampling sequence gets its token."""
    for item in batch:
        if item.samples:
            item.seq.num_pending -= 1
            item.seq.token_ids.append(7)


def test_a_full_pool_does_not_hold_back_the_other():
    pools = KvPools([8, 3], block_size=4, enable_prefix_caching=False)
    sched = Scheduler(pools, max_num_seqs=8, max_num_batched_tokens=64, admission_watermark=0.0)
    low = seq(range(7), pool=1, score=9.5, rid="low", index=0)
    sched.add(low)
    resolve(sched.schedule())  # two of the three int8 blocks
    # Next in the order is an int8 request that needs two blocks and may not preempt `low`.
    blocked = seq(range(100, 108), pool=1, score=9.0, rid="blocked", index=1)
    high = seq(range(200, 220), pool=0, score=8.0, rid="high", index=2)
    sched.add(blocked)
    sched.add(high)
    batch = sched.schedule()
    assert [item.seq.key for item in batch] == ["high", "low"]  # grouped by pool
    assert blocked.status is SeqStatus.WAITING and not blocked.block_table
    assert sched.num_preemptions == 0


def test_a_sequence_short_of_blocks_preempts_only_in_its_own_pool():
    pools = KvPools([3, 4], block_size=4, enable_prefix_caching=False)
    sched = Scheduler(pools, max_num_seqs=8, max_num_batched_tokens=64, admission_watermark=0.0)
    a = seq(range(8), pool=0, score=9.0, rid="a", index=0)
    b = seq(range(100, 104), pool=0, score=8.0, rid="b", index=1)
    c = seq(range(200, 204), pool=1, score=1.0, rid="c", index=2)
    for s in (a, b, c):
        sched.add(s)
    resolve(sched.schedule())
    assert pools.pools[0].num_free_blocks == 0
    # `a` needs a third block: preempting `c`, the lowest score, would free int8 blocks only.
    batch = sched.schedule()
    assert b.status is SeqStatus.WAITING and sched.num_preemptions == 1
    assert {item.seq.key for item in batch} == {"a", "c"}


def test_a_sequence_its_pool_cannot_hold_preempts_nobody_for_a_slot():
    """Slots full, and the waiting `h` outranks `v` (in the other pool) but not `a`, whose
    blocks its own pool would need: nothing is preempted for it. Before, `v` was preempted for
    the slot, `h` still did not fit, and `v` came back, recomputed, every step."""
    pools = KvPools([4, 4], block_size=4, enable_prefix_caching=False)
    sched = Scheduler(pools, max_num_seqs=2, max_num_batched_tokens=64, admission_watermark=0.0)
    a = seq(range(12), pool=0, score=9.0, rid="a", index=0)
    v = seq(range(100, 104), pool=1, score=1.0, rid="v", index=1)
    for s in (a, v):
        sched.add(s)
    resolve(sched.schedule())
    h = seq(range(200, 220), pool=0, score=5.0, rid="h", index=2)  # 5 blocks: never fits
    sched.add(h)
    for _ in range(3):
        batch = sched.schedule()
        resolve(batch)
        assert {item.seq.key for item in batch} == {"a", "v"}
    assert h.status is SeqStatus.WAITING and not h.block_table
    assert sched.num_preemptions == 0 and sched.num_recomputed_tokens == 0


def test_each_pool_keeps_its_own_share_as_the_watermark():
    """The admission watermark is a share of each pool, not of both: a small int8 pool is not
    left with fewer usable blocks than none."""
    pools = KvPools([1000, 8], block_size=4)
    sched = Scheduler(pools, max_num_seqs=8, max_num_batched_tokens=64, admission_watermark=0.01)
    assert sched.pool_watermarks == [10, 0] and sched.watermark_blocks == 10
    low = seq(range(30), pool=1, score=1.0, rid="low", index=0)
    sched.add(low)
    assert [item.seq.key for item in sched.schedule()] == ["low"]


def test_the_engine_splits_the_memory_and_picks_the_pool_by_priority():
    one = Engine(tiny_config({"kv_cache.num_blocks": 200}))
    two = Engine(tiny_config({"kv_cache.num_blocks": 200, "kv_cache.compress_below_priority": 5,
                              "kv_cache.compressed_fraction": 0.25}))
    try:
        # The model's dtype: fp32, or bf16 where the CPU has native bf16 (model.dtype auto).
        head_dim = one.model_config.head_dim
        int8_per_model_row = one.dtype.itemsize * head_dim / kv_int8.row_bytes(head_dim)
        assert two.pool_sizes == [150, int(50 * int8_per_model_row)]
        assert [two.kv_pool_of(p) for p in (0, 4, 5, 10)] == [1, 1, 0, 0]
        assert [one.kv_pool_of(p) for p in (0, 10)] == [0, 0]
        assert len(two.runner.kv_pools) == 2 and two.runner.kv_pools[1][0][0].dtype.is_signed
    finally:
        for engine in (one, two):
            engine._worker.shutdown()


def prompts() -> list[list[int]]:
    return [[(97 * i + 13 * n) % 40000 + 17 for i in range(n)] for n in (3, 20, 45)]


async def run(backend: str, priorities: list[int], kv: dict | None = None) -> list[list[int]]:
    """Every prompt at every priority, greedy, batched together (prompts past the 32-token
    budget are prefilled in chunks beside the decodes)."""
    engine = Engine(tiny_config({"model.attention_backend": backend,
                                 "scheduler.batch_level.max_num_batched_tokens": 32,
                                 "kv_cache.num_blocks": 64, **(kv or {})}))
    try:
        assert backend != "triton" or isinstance(engine.runner.backend, TritonBackend)
        requests = [GenerateRequest(prompt_token_ids=p, max_tokens=6, temperature=0.0,
                                    ignore_eos=True, priority=priority)
                    for priority in priorities for p in prompts()]
        return [c.token_ids for c in await generate_all(engine, requests, timeout=300)]
    finally:
        await engine.stop()


@pytest.mark.parametrize("backend", ["torch", "triton"])
async def test_each_pool_gives_the_tokens_of_an_engine_with_that_cache_alone(backend):
    # Each engine alone runs only the requests it is compared on (greedy tokens do not depend
    # on what else is in the batch: test_engine's alone-equals-together).
    full = await run(backend, [9])
    int8 = await run(backend, [1], {"kv_cache.dtype": "int8"})
    mixed = await run(backend, [9, 1], {"kv_cache.compress_below_priority": 5})
    assert all(len(t) == 6 for t in mixed)
    n = len(prompts())
    assert mixed[:n] == full  # priority 9: the model's dtype
    assert mixed[n:] == int8  # priority 1: int8
