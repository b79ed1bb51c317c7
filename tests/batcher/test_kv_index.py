"""The batcher's index of cached prefix blocks, and KV-aware routing over it."""

from __future__ import annotations

from services.batcher.kv_index import KvIndex
from services.batcher.registry import ExecutorRegistry, route_score
from shared.block_hash import chain_hash
from shared.messages import KvDump, KvEvent
from tests.batcher.test_registry import heartbeat


def hashes(*blocks: list[int]) -> list[bytes]:
    out, parent = [], b""
    for tokens in blocks:
        parent = chain_hash(parent, tokens)
        out.append(parent)
    return out


A, B, C, D = hashes([1] * 16, [2] * 16, [3] * 16, [4] * 16)
[E] = hashes([5] * 16)  # another prefix group


def event(seq, stored=(), removed=(), executor="e0", started_at=1.0):
    return KvEvent(executor=executor, started_at=started_at, seq=seq, stored=list(stored),
                   removed=list(removed))


def test_stored_and_removed_blocks_make_the_cached_prefix():
    index = KvIndex()
    assert not index.apply(event(1, stored=[A, B, C]))
    assert index.cached_prefix("e0", [A, B, C, D], now=0.0) == 3
    assert not index.apply(event(2, removed=[B]))
    # Chained hashes: without B, C cannot extend the prefix although it is still cached.
    assert index.cached_prefix("e0", [A, B, C], now=0.0) == 1
    assert index.cached_prefix("e0", [B, C], now=0.0) == 0
    assert index.cached_prefix("unknown", [A], now=0.0) == 0
    assert not index.apply(event(2, stored=[D]))  # a repeat is ignored
    assert index.num_blocks("e0") == 2


def test_a_gap_asks_for_one_dump_and_replays_what_came_after_it():
    index = KvIndex()
    index.apply(event(1, stored=[A]))
    assert index.apply(event(3, stored=[C]))  # event 2 was lost
    assert index.needs_dump("e0")
    assert not index.apply(event(4, stored=[D]))  # held back, no second request
    assert index.cached_prefix("e0", [A], now=0.0) == 1  # still the old view meanwhile
    index.apply_dump(KvDump(executor="e0", started_at=1.0, seq=2, blocks=[A, B]))
    assert not index.needs_dump("e0")
    assert index.cached_prefix("e0", [A, B, C, D], now=0.0) == 4
    assert not index.apply(event(5, removed=[A]))
    assert index.cached_prefix("e0", [A], now=0.0) == 0


def test_a_dump_older_than_the_gap_asks_again():
    index = KvIndex()
    index.apply(event(1, stored=[A]))
    assert index.apply(event(4, stored=[D]))
    index.apply_dump(KvDump(executor="e0", started_at=1.0, seq=2, blocks=[A, B]))
    assert index.needs_dump("e0")  # event 3 is still missing
    index.apply_dump(KvDump(executor="e0", started_at=1.0, seq=3, blocks=[A, B, C]))
    assert not index.needs_dump("e0")
    assert index.cached_prefix("e0", [A, B, C, D], now=0.0) == 4


def test_a_restarted_executor_starts_empty_or_asks_for_a_dump():
    index = KvIndex()
    index.apply(event(1, stored=[A, B]))
    # A new instance seen from its first event: its cache started empty, no dump needed.
    assert not index.apply(event(1, stored=[C], started_at=2.0))
    assert index.cached_prefix("e0", [A], now=0.0) == 0
    assert index.cached_prefix("e0", [C], now=0.0) == 1
    # One seen from the middle (the batcher joined late): ask.
    assert index.apply(event(7, stored=[D], started_at=3.0))
    index.apply_dump(KvDump(executor="e0", started_at=3.0, seq=6, blocks=[A]))
    assert index.cached_prefix("e0", [A], now=0.0) == 1
    assert index.cached_prefix("e0", [D], now=0.0) == 1
    # Late words from an older instance change nothing.
    assert not index.apply(event(8, stored=[B], started_at=2.0))
    index.apply_dump(KvDump(executor="e0", started_at=2.0, seq=9, blocks=[C]))
    assert index.cached_prefix("e0", [A], now=0.0) == 1
    assert index.cached_prefix("e0", [B], now=0.0) == index.cached_prefix("e0", [C], now=0.0) == 0


def test_route_score_weighs_cached_share_against_load():
    assert route_score(4, 4, 0.5, 1.0, 1.0) == 0.5
    assert route_score(0, 4, 0.0, 1.0, 1.0) == 0.0
    assert route_score(2, 4, 0.25, 2.0, 1.0) == 0.75
    assert route_score(0, 0, 0.0, 1.0, 1.0) == 0.0  # no full block: load alone


def test_kv_aware_routing_follows_the_prefix_and_spreads_when_full():
    registry = ExecutorRegistry(routing="kv_aware")
    for name in ("e0", "e1"):
        registry.update(heartbeat(name, max_num_seqs=4), 0.0)
    registry.kv_index.apply(event(1, stored=[A, B, C], executor="e1"))
    assert registry.pick("m", 0.0, [A, B, C, D]) == "e1"
    assert registry.last_route == {"e0": 0, "e1": 3}
    # A new prefix group: the first request goes to the least loaded, the next ones of the same
    # group follow it before any KV event could have told the batcher.
    assert registry.pick("m", 0.0, [E]) == "e0"
    assert registry.pick("m", 0.1, [E]) == "e0"
    assert registry.last_route == {"e0": 1, "e1": 0}
    # Promises expire: then load decides again.
    registry.update(heartbeat("e0", running=2, max_num_seqs=4, assigned=2), 0.2)
    registry.update(heartbeat("e1", running=1, max_num_seqs=4, assigned=1), 0.2)
    assert registry.pick("m", 10.0, [E]) == "e1"
    # The executor with the prefix is saturated: the prefix spreads to the other one.
    registry.update(heartbeat("e1", running=4, waiting=1, max_num_seqs=4, assigned=2), 11.0)
    assert registry.kv_index.cached_prefix("e1", [A, B, C], now=11.0) == 3
    assert registry.pick("m", 11.0, [A, B, C]) == "e0"


def test_expired_executors_leave_the_index():
    registry = ExecutorRegistry(routing="kv_aware")
    registry.update(heartbeat("e0"), 0.0)
    registry.kv_index.apply(event(1, stored=[A]))
    assert registry.expire(now=100.0, timeout=5.0) == ["e0"]
    assert registry.kv_index.cached_prefix("e0", [A], now=100.0) == 0


def test_promised_blocks_count_until_their_time_and_are_then_dropped():
    """A block promised again lives to its later time; expired promises leave the index (from
    the front of an expiry queue: a pick no longer scans every promise of the last seconds)."""
    index = KvIndex()
    index.promise("e", [b"a", b"b"], until=1.0)
    index.promise("e", [b"a"], until=3.0)
    assert index.cached_prefix("e", [b"a", b"b"], now=0.5) == 2
    assert index.cached_prefix("e", [b"a", b"b"], now=2.0) == 1  # b's promise is over
    assert set(index._promised["e"]) == {b"a"}
    assert index.cached_prefix("e", [b"a"], now=3.0) == 0
    assert index._promised["e"] == {} and not index._expiries["e"]
