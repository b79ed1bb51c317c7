"""LLM_STATE against a real nats-server: a request's state is taken over by compare-and-set
(one admission of two wins), a tombstone ends it (a late write against it fails), a checkpoint
comes back with it (not one of an earlier request of the same id), and a scan names each
state's owner from headers alone."""

from __future__ import annotations

import asyncio

from shared.bus import ensure_streams
from shared.config import load_config
from shared.keys import RequestKey
from shared.request_state import (STATE_STREAM, Claim, RequestState, RequestStates, claim_answer,
                                  tombstone)
from shared.subjects import Subjects
from tests.nats_server import nats_server

KEY = RequestKey("acme", "a request id: with spaces/and.dots")


async def test_a_state_is_taken_over_once_and_ends_with_its_tombstone(tmp_path):
    subjects = Subjects()
    async with nats_server(tmp_path) as nc:
        js = nc.jetstream()
        await ensure_streams(js, load_config(None, {}))
        first = RequestStates(nc, js, subjects, "admission-a")
        second = RequestStates(nc, js, subjects, "admission-b")
        third = RequestStates(nc, js, subjects, "admission-c")

        revision = await first.create(KEY, b"item", 0, False, arrival_time=1.0)
        assert revision is not None
        assert await second.create(KEY, b"other", 0, False, 2.0) is None  # not ended
        # A durable request may have the same id: a state of its own.
        assert await second.create(KEY, b"durable", 0, True, 3.0) is not None

        await first.checkpoint(KEY, False, 1.0, 0, [5, 6, 7])
        await nc.flush()
        assert await second.take(KEY, frozenset({"admission-a"}), durable=False) is None  # alive
        # Two take it over at once, each leaving the other's alone: one wins.
        alive = frozenset({"admission-b", "admission-c"})
        taken = await asyncio.gather(second.take(KEY, alive, durable=False),
                                     third.take(KEY, alive, durable=False))
        owners = {t.state.owner for t in taken if t is not None}
        assert len(owners) == 1 and owners <= {"admission-b", "admission-c"}
        winner = next(t for t in taken if t is not None)
        assert (winner.state.item, winner.state.attempt, winner.token_ids) == (b"item", 0,
                                                                               [5, 6, 7])
        # The first owner's write against its old revision fails: it lets the request go.
        assert await first.write(RequestState(KEY.tenant, KEY.request_id, "admission-a", 1,
                                              False, 1.0, b"item"), revision) is None

        assert sorted(owner for _, owner in await first.owners()) == sorted(
            [winner.state.owner, "admission-b"])  # the generate's, and the durable's

        await tombstone(nc, subjects, KEY, False, arrival_time=1.0)
        await nc.flush()
        # Stored without an ack: the stream holds it soon after the server has it, not at once
        # (seen on a loaded machine).
        for _ in range(100):
            if await first.read(KEY, durable=False) is None:
                break
            await asyncio.sleep(0.02)
        assert await first.read(KEY, durable=False) is None
        assert await first.take(KEY, durable=False) is None
        assert await first.write(winner.state, winner.revision) is None  # ended: no resurrection
        assert [owner for _, owner in await first.owners()] == ["admission-b"]
        # The same id again (a generate's ids may be reused once it ended): a new state, and
        # the checkpoint left by the earlier request is not taken for this one's.
        await first.checkpoint(KEY, False, 1.0, 0, [5, 6, 7])
        await nc.flush()
        assert await first.create(KEY, b"again", 0, False, 9.0) is not None
        again = await first.read(KEY, durable=False)
        assert (again.state.item, again.token_ids) == (b"again", [])
        # The earlier request's tombstone, late, ends the new one's state: it is written again
        # over it (the next compare-and-set fails, and names that tombstone) ...
        await tombstone(nc, subjects, KEY, False, arrival_time=1.0)
        await nc.flush()
        assert await first.write(again.state, again.revision) is None
        assert await first.write_over_stale(again.state) is not None
        assert (await first.read(KEY, durable=False)).state.item == b"again"
        # ... but not over its own end.
        await tombstone(nc, subjects, KEY, False, arrival_time=9.0)
        await nc.flush()
        assert await first.write_over_stale(again.state) is None
        info = await js.stream_info(STATE_STREAM)
    assert info.config.allow_msg_ttl and info.config.max_msgs_per_subject == 1


async def test_a_handed_on_attempt_answers_only_if_no_other_did(tmp_path):
    """`claim_answer`: a handed-on attempt of a generate finds its request's state live (it
    answers, and ends it first), or an earlier attempt's tombstone (it does not), or a later
    request of the id there (this one ended: it does not); a state left by an earlier request
    of the id is no answer of this one's."""
    async with nats_server(tmp_path) as nc:
        js = nc.jetstream()
        await ensure_streams(js, load_config(None, {}))
        subjects = Subjects("llm")
        states = RequestStates(nc, js, subjects, "admission-a")
        assert await states.create(KEY, b"item", 1, False, 5.0) is not None
        assert await claim_answer(js, subjects, KEY, 5.0) is Claim.FIRST
        assert await claim_answer(js, subjects, KEY, 5.0) is Claim.SECOND  # answered above
        assert await claim_answer(js, subjects, KEY, 1.0) is Claim.SECOND  # a later one there
        other = RequestKey("acme", "other")
        await tombstone(nc, subjects, other, False, arrival_time=5.0)  # attempt 0 answered
        await nc.flush()
        assert await claim_answer(js, subjects, other, 5.0) is Claim.SECOND
        left = RequestKey("acme", "left")  # an earlier request's state, never ended
        assert await states.create(left, b"old", 0, False, 1.0) is not None
        assert await claim_answer(js, subjects, left, 7.0) is Claim.FIRST
        assert await states.read(left, durable=False) is None  # ended by the claim
