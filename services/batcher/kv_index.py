"""Which executor caches which prefix blocks, from the executors' KV events: what KV-aware routing
reads to send a prompt where its prefix already is.

An executor numbers its events from 1 per instance. The index applies them in order; on a gap, or
on an instance it did not see from its first event (a restart, or a batcher that joined late), it
asks for a dump. Events that arrive while the dump is on its way are kept and replayed on top of
it, so nothing between the dump's cut and its arrival is lost.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from shared.messages import KvDump, KvEvent


@dataclass
class _ExecutorBlocks:
    started_at: float
    seq: int = 0  # the last event applied
    blocks: set[bytes] = field(default_factory=set)
    awaiting_dump: bool = False
    held_back: list[KvEvent] = field(default_factory=list)  # events newer than the gap


class KvIndex:
    def __init__(self):
        self._executors: dict[str, _ExecutorBlocks] = {}
        # Blocks of prompts just routed to an executor, counted as cached there until their own
        # events can have arrived: requests of one prefix group that arrive together then meet
        # at one executor. executor -> hash -> until (monotonic).
        self._promised: dict[str, dict[bytes, float]] = {}
        # Per executor, (until, hash) in the order promised (`until` grows with the clock): the
        # expired ones are dropped from the front, not by a scan of every promise per pick.
        self._expiries: dict[str, deque[tuple[float, bytes]]] = {}

    def apply(self, event: KvEvent) -> bool:
        """Record an event; True when the executor's blocks are unknown from here on and a dump
        should be requested (once per gap: later events are held back until the dump comes)."""
        state = self._instance(event.executor, event.started_at)
        if state is None:
            return False  # from an instance older than the one known: late, and moot
        if state.awaiting_dump:
            state.held_back.append(event)
            return False
        if event.seq <= state.seq:
            return False  # a repeat
        if event.seq != state.seq + 1:
            state.awaiting_dump = True
            state.held_back.append(event)
            return True
        self._apply(state, event)
        return False

    def apply_dump(self, dump: KvDump) -> None:
        """Replace what is known of the executor by its dump, then replay the events held back
        that are newer than it."""
        state = self._instance(dump.executor, dump.started_at)
        if state is None:
            return
        held = sorted(state.held_back, key=lambda e: e.seq)
        state.blocks, state.seq = set(dump.blocks), dump.seq
        state.awaiting_dump, state.held_back = False, []
        for event in held:
            if event.seq <= state.seq:
                continue
            if event.seq != state.seq + 1:  # still a gap after the dump: ask again
                state.awaiting_dump = True
                state.held_back = [e for e in held if e.seq >= event.seq]
                return
            self._apply(state, event)

    def needs_dump(self, executor: str) -> bool:
        state = self._executors.get(executor)
        return state is not None and state.awaiting_dump

    def forget(self, executor: str) -> None:
        self._executors.pop(executor, None)
        self._promised.pop(executor, None)
        self._expiries.pop(executor, None)

    def promise(self, executor: str, block_hashes: list[bytes], until: float) -> None:
        """A prompt with these blocks was routed to `executor`: count them as cached there until
        `until`, by when its own KV events will say so."""
        promised = self._promised.setdefault(executor, {})
        expiries = self._expiries.setdefault(executor, deque())
        for block_hash in block_hashes:
            promised[block_hash] = max(until, promised.get(block_hash, until))
            expiries.append((until, block_hash))

    def cached_prefix(self, executor: str, block_hashes: list[bytes], now: float) -> int:
        """How many of the prompt's leading blocks `executor` caches or was promised. Hashes are
        chained, so the first block it lacks ends the shared prefix."""
        state = self._executors.get(executor)
        blocks = state.blocks if state is not None else set()
        promised = self._promised.get(executor)
        if promised:
            expiries = self._expiries[executor]
            while expiries and expiries[0][0] <= now:
                _, block_hash = expiries.popleft()
                if promised.get(block_hash, now + 1) <= now:  # not promised again since
                    del promised[block_hash]
        count = 0
        for block_hash in block_hashes:
            if block_hash not in blocks and not (promised and promised.get(block_hash, 0) > now):
                break
            count += 1
        return count

    def num_blocks(self, executor: str) -> int:
        state = self._executors.get(executor)
        return len(state.blocks) if state is not None else 0

    def _instance(self, executor: str, started_at: float) -> _ExecutorBlocks | None:
        """The state of this instance of `executor`: a newer instance (a restart) starts afresh;
        None for an older one."""
        state = self._executors.get(executor)
        if state is not None and started_at < state.started_at:
            return None
        if state is None or started_at != state.started_at:
            state = self._executors[executor] = _ExecutorBlocks(started_at)
        return state

    @staticmethod
    def _apply(state: _ExecutorBlocks, event: KvEvent) -> None:
        state.blocks.difference_update(event.removed)
        state.blocks.update(event.stored)
        state.seq = event.seq
