"""Request state in JetStream: what admission knows of each request in flight, where any
admission (a restarted one, another replica) can take it over.

Stream LLM_STATE (file storage, `nats.replicas` copies) keeps one message per subject:

- `<prefix>.internal.state.req.<tenant>.<id hash>`: a `RequestState`, the admitted WorkItem
  (prompt tokens, seed, arrival time, reply subject), its current attempt and which admission
  watches over it (its owner, also in the `Jetserve-Owner` header, so a scan reads headers only).
  Every write is a compare-and-set on the subject's last sequence: of two admissions that both
  take a request over, or both think it lost, one wins and the other lets it go.
- `<prefix>.internal.state.out.<tenant>.<id hash>`: a `Checkpoint`, the outputs its executor's
  checkpoints reported for an attempt, written by the owner without an ack (a lost one costs
  recomputation, not correctness) and with a TTL, so one left behind expires.

Whoever gives a request its final answer (`Outbox.final`) writes an empty message, a
tombstone with a short TTL, on both subjects as it says Done (the state's acked and retried,
`end_state`): a request whose Done is lost while no admission is alive is not taken for lost
and run again, and a late compare-and-set against an ended request fails. A handed-on attempt of a
generate reads its state before it answers (`claim_answer`), as does a first attempt whose
holder lapsed while holding it (cut off or stalled: shared/bus.py Lapses): one reaching its
end after another attempt answered finds that attempt's tombstone and sends nothing (a
durable request's result store is its once-only check).
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import hashlib
import math
import secrets

import msgspec
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy
from nats.errors import TimeoutError as NatsTimeoutError
from nats.js.errors import APIError, NotFoundError

from shared.keys import RequestKey
from shared.subjects import Subjects

STATE_STREAM = "LLM_STATE"
OWNER_HEADER = "Jetserve-Owner"
ARRIVAL_HEADER = "Jetserve-Arrival"  # on a tombstone: which request of the id ended
CLAIM_HEADER = "Jetserve-Claim"  # on a handed-on attempt's tombstone: which claim wrote it
TOMBSTONE_TTL = "60s"  # how long an ended request's empty message stays (JetStream's Nats-TTL)
CHECKPOINT_TTL = "1h"  # a checkpoint not renewed for this long expires (its request is gone)
WRONG_LAST_SEQUENCE = 10071  # JetStream's error code: the expected last sequence did not match
SCAN_BATCH = 256


class RequestState(msgspec.Struct, array_like=True):
    tenant: str
    request_id: str
    owner: str  # the admission that watches over it
    attempt: int
    durable: bool
    arrival_time: float  # the WorkItem's: which request of that id (ids may be reused)
    item: bytes  # the admitted WorkItem, msgpack-encoded (shared.messages.encode)

    @property
    def key(self) -> RequestKey:
        return RequestKey(self.tenant, self.request_id)


class Checkpoint(msgspec.Struct, array_like=True):
    attempt: int
    arrival_time: float  # its request's (a checkpoint of an earlier request of that id: not used)
    token_ids: list[int]


_state = msgspec.msgpack.Decoder(RequestState)
_checkpoint = msgspec.msgpack.Decoder(Checkpoint)
_encode = msgspec.msgpack.Encoder().encode


def key_token(key: RequestKey, durable: bool) -> str:
    """`<d|g>.<tenant>.<hash of the id>`: ids are any string, a subject token is not; a durable
    request and a generate may share an id."""
    digest = hashlib.blake2b(key.request_id.encode(), digest_size=16).hexdigest()
    return f"{'d' if durable else 'g'}.{key.tenant}.{digest}"


def state_subjects(subjects: Subjects) -> str:
    return f"{subjects.prefix}.internal.state.>"


def request_subject(subjects: Subjects, key: RequestKey, durable: bool) -> str:
    return f"{subjects.prefix}.internal.state.req.{key_token(key, durable)}"


def checkpoint_subject(subjects: Subjects, key: RequestKey, durable: bool) -> str:
    return f"{subjects.prefix}.internal.state.out.{key_token(key, durable)}"


def fairness_subject(subjects: Subjects) -> str:
    """Priority's tenant counters (services/priority/service.py saves and loads them)."""
    return f"{subjects.prefix}.internal.state.fairness"


async def tombstone(nc, subjects: Subjects, key: RequestKey, durable: bool,
                    arrival_time: float, state: bool = True) -> None:
    """The request ended: its state (unless `state` is False: the caller ends it acked,
    `end_state`) and checkpoint are emptied (stored without an ack; each tombstone expires after TOMBSTONE_TTL,
    and says which request of the id it ends)."""
    headers = {"Nats-TTL": TOMBSTONE_TTL, ARRIVAL_HEADER: repr(arrival_time)}
    if state:
        await nc.publish(request_subject(subjects, key, durable), b"", headers=headers)
    await nc.publish(checkpoint_subject(subjects, key, durable), b"", headers=headers)


async def end_state(js, subjects: Subjects, key: RequestKey, durable: bool,
                    arrival_time: float, tries: int = 12, again: bool = False) -> None:
    """The request's state tombstone, acked, tried again (for about 30 s) while LLM_STATE
    elects a leader: an unacked one published then is lost, and the state left behind would be
    taken over, as a lost request, by an admission that starts after the holding reports
    naming it answered stopped (`Holding.ended`), and run a second time. A try after the first
    reads the subject first (from the stream's leader) and writes only over this request's
    own state: by then a later request of the id may have written its own; so does the first
    try when this is called `again` (after a call that gave up)."""
    subject = request_subject(subjects, key, durable)
    headers = {"Nats-TTL": TOMBSTONE_TTL, ARRIVAL_HEADER: repr(arrival_time)}
    for n in range(tries):
        try:
            if n > 0 or again:
                last = await _leaders_last(js, subject)
                if last is None or not last.data \
                        or _state.decode(last.data).arrival_time != arrival_time:
                    return  # ended already, or another request's now
                headers["Nats-Expected-Last-Subject-Sequence"] = str(last.seq)
            await js.publish(subject, b"", timeout=2.0, stream=STATE_STREAM, headers=headers)
            return
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            if n == tries - 1:
                raise
            if not (isinstance(exc, APIError) and exc.err_code == WRONG_LAST_SEQUENCE):
                await asyncio.sleep(min(0.5 * (n + 1), 3.0))


async def _leaders_last(js, subject: str, timeout_s: float = 2.0):
    """The subject's last message, read from the stream's leader (a replica answering a direct
    get may not have the latest write yet); None when it has none."""
    try:
        return await asyncio.wait_for(js.get_last_msg(STATE_STREAM, subject), timeout_s)
    except NotFoundError:
        return None


def _arrival(headers: dict) -> float:
    try:
        return float(headers.get(ARRIVAL_HEADER, "-inf"))
    except ValueError:
        return -math.inf


class Claim(enum.Enum):
    FIRST = "first"  # this attempt answers
    SECOND = "second"  # another attempt answered: this one sends nothing
    UNKNOWN = "unknown"  # LLM_STATE did not say: the answer goes out (a lost one is worse)


async def claim_answer(js, subjects: Subjects, key: RequestKey, arrival_time: float,
                       timeout_s: float = 1.0, tries: int = 2) -> Claim:
    """A handed-on attempt of a generate is about to answer. Two attempts can both reach their
    end: a holder cut off from NATS for a lease (its node died) is taken for dead and its
    request handed on while it runs on unheard, or its attempt waits in a queue a revoke
    missed. The request's state, read from the stream's leader, says whether the other
    answered: a tombstone of this request (its arrival time) is there, or the subject moved on
    to a later request of the id. If not, this attempt's own tombstone goes there first
    (marked as its own: a try whose ack was lost finds it on the next), a compare-and-set on
    what it read, so that of two claiming at once one answers. A first attempt claims too when
    a holder of it lapsed (`WorkItem.lapsed`: it was cut off or stalled, and may have missed
    its revoke); one never handed on and never lapsed does not: its tombstone after its answer
    is what a later one reads. Not covered: a first attempt whose holder was taken for dead
    without a lapse of its own (its reports lost on a broken route between NATS nodes while it
    stayed connected), or that was sent on just before its sender lapsed and arrived after its
    revoke, answering after a handed-on one; and an attempt answering after another's
    tombstone expired (TOMBSTONE_TTL)."""
    subject = request_subject(subjects, key, False)
    arrival, mine = repr(arrival_time), secrets.token_hex(8)  # (mine: this call's mark)
    for _ in range(tries):
        try:
            last = await _leaders_last(js, subject, timeout_s)
            if last is not None:
                headers = last.headers or {}
                if not last.data:  # a tombstone: which request's it ends says
                    if headers.get(CLAIM_HEADER) == mine:
                        return Claim.FIRST  # this call's own, its ack lost
                    if _arrival(headers) >= arrival_time:
                        return Claim.SECOND  # this request's end, or a later one's of the id
                elif _state.decode(last.data).arrival_time > arrival_time:
                    return Claim.SECOND  # a later request of the id: this one ended
            await js.publish(subject, b"", timeout=timeout_s, stream=STATE_STREAM, headers={
                "Nats-TTL": TOMBSTONE_TTL, ARRIVAL_HEADER: arrival, CLAIM_HEADER: mine,
                "Nats-Expected-Last-Subject-Sequence": str(0 if last is None else last.seq)})
            return Claim.FIRST
        except APIError as exc:
            if exc.err_code != WRONG_LAST_SEQUENCE:
                await asyncio.sleep(0.1)
        except asyncio.CancelledError:
            raise
        except Exception:  # a leader being elected, a node away: tried again
            await asyncio.sleep(0.1)
    return Claim.UNKNOWN


class Taken(msgspec.Struct):
    """A request's state as read (or just written), with the sequence a later
    compare-and-set must name, and its checkpoint for the current attempt (if any)."""

    state: RequestState
    revision: int
    token_ids: list[int] = []


class RequestStates:
    """One admission's reads and compare-and-set writes of LLM_STATE. Every write returns the
    new revision, or None when the subject moved on (another admission took the request, or
    it ended): the caller then lets it go."""

    def __init__(self, nc, js, subjects: Subjects, owner: str, timeout_s: float = 2.0):
        self.nc, self.js, self.subjects, self.owner = nc, js, subjects, owner
        self.timeout_s = timeout_s  # each JetStream call's
        self.complete = True  # the last scan (`owners`) read every state it counted

    async def _cas(self, subject: str, payload: bytes, last: int) -> int | None:
        try:
            ack = await self.js.publish(subject, payload, timeout=self.timeout_s,
                                        stream=STATE_STREAM, headers={
                OWNER_HEADER: self.owner, "Nats-Expected-Last-Subject-Sequence": str(last)})
        except APIError as exc:
            if exc.err_code == WRONG_LAST_SEQUENCE:
                return None
            raise
        return ack.seq

    async def create(self, key: RequestKey, item: bytes, attempt: int, durable: bool,
                     arrival_time: float) -> int | None:
        """The state of a request just admitted; None when one that has not ended is there
        (a generate reusing a running one's id: not this admission's to keep). Written once
        only: a try whose ack was lost left it there, and the next finds it."""
        state = RequestState(key.tenant, key.request_id, self.owner, attempt, durable,
                             arrival_time, item)
        payload = _encode(state)
        subject = request_subject(self.subjects, key, durable)
        revision = await self._cas(subject, payload, 0)
        if revision is None:  # an ended request's tombstone is in the way, or this one
            last = await self._last(subject)
            if last is not None and not last.data:
                revision = await self._cas(subject, payload, last.seq)
            elif last is not None and last.data == payload:
                revision = last.seq
        return revision

    async def write(self, state: RequestState, last: int) -> int | None:
        """`state` (owned by this admission) over revision `last`."""
        state.owner = self.owner
        return await self._cas(request_subject(self.subjects, state.key, state.durable),
                               _encode(state), last)

    async def write_over_stale(self, state: RequestState) -> int | None:
        """`state` again over a tombstone that ended another request of the same id (an
        earlier one's answerer, late): the new revision, or None when the subject holds
        anything else (this request's own end, another admission's write, or nothing)."""
        subject = request_subject(self.subjects, state.key, state.durable)
        last = await self._last(subject)
        if last is None or last.data or (last.headers or {}).get(ARRIVAL_HEADER) in (
                None, repr(state.arrival_time)):
            return None
        return await self.write(state, last.seq)

    async def _last(self, subject: str):
        try:
            return await self.js.get_last_msg(STATE_STREAM, subject, direct=True)
        except NotFoundError:
            return None

    async def read(self, key: RequestKey, durable: bool) -> Taken | None:
        """The request's state and its checkpoint, or None when it has none (ended, or never
        written)."""
        return await self._read(request_subject(self.subjects, key, durable))

    async def _read(self, subject: str) -> Taken | None:
        last = await self._last(subject)
        if last is None or not last.data:
            return None
        state = _state.decode(last.data)
        taken = Taken(state, last.seq)
        checkpoint = await self._last(checkpoint_subject(self.subjects, state.key, state.durable))
        if checkpoint is not None and checkpoint.data:
            checkpoint = _checkpoint.decode(checkpoint.data)
            # An earlier attempt's outputs are this one's too (the seed is the request's); an
            # earlier request's of the same id are not.
            if (checkpoint.arrival_time == state.arrival_time
                    and checkpoint.attempt <= state.attempt):
                taken.token_ids = checkpoint.token_ids
        return taken

    async def take(self, key: RequestKey | None = None, leave: frozenset[str] = frozenset(),
                   subject: str | None = None, durable: bool = True,
                   tries: int = 4) -> Taken | None:
        """Take the request (by key and kind, or by its state's subject) over: this admission
        becomes its owner, unless its owner is in `leave`. None when it has no state (ended),
        is left to its owner, or kept changing under each try."""
        subject = subject or request_subject(self.subjects, key, durable)
        for _ in range(tries):
            taken = await self._read(subject)
            if taken is None:
                return None
            owner = taken.state.owner
            if owner == self.owner:
                return taken
            if owner in leave:
                return None
            revision = await self.write(taken.state, taken.revision)
            if revision is not None:
                taken.revision = revision
                return taken
        return None

    async def end(self, key: RequestKey, durable: bool, last: int, arrival_time: float) -> None:
        """The ended request's tombstone, over revision `last` (acked); done already when the
        subject moved on (its answerer's tombstone, or another admission's write)."""
        try:
            await self.js.publish(request_subject(self.subjects, key, durable), b"",
                                  timeout=self.timeout_s, stream=STATE_STREAM,
                                  headers={"Nats-TTL": TOMBSTONE_TTL,
                                           ARRIVAL_HEADER: repr(arrival_time),
                                           "Nats-Expected-Last-Subject-Sequence": str(last)})
        except APIError as exc:
            if exc.err_code != WRONG_LAST_SEQUENCE:
                raise
        await self.nc.publish(checkpoint_subject(self.subjects, key, durable), b"",
                               headers={"Nats-TTL": TOMBSTONE_TTL})

    def checkpoint(self, key: RequestKey, durable: bool, arrival_time: float, attempt: int,
                   token_ids: list[int]):
        """Publish the outputs so far (a coroutine; no ack is waited for)."""
        return self.nc.publish(checkpoint_subject(self.subjects, key, durable),
                               _encode(Checkpoint(attempt, arrival_time, token_ids)),
                               headers={"Nats-TTL": CHECKPOINT_TTL})

    async def owners(self) -> list[tuple[str, str]]:
        """(subject, owner) of every request with state, from its headers alone (an ephemeral
        consumer over the latest message of each subject; it expires by itself)."""
        prefix = f"{self.subjects.prefix}.internal.state.req."
        sub = await self.js.pull_subscribe(
            prefix + ">", stream=STATE_STREAM, config=ConsumerConfig(
                ack_policy=AckPolicy.NONE, deliver_policy=DeliverPolicy.LAST_PER_SUBJECT,
                headers_only=True, inactive_threshold=10.0, mem_storage=True))
        found = []
        self.complete = True
        try:
            pending = (await sub.consumer_info()).num_pending
            while pending > 0:
                try:
                    messages = await sub.fetch(min(pending, SCAN_BATCH), timeout=5.0)
                except (NatsTimeoutError, TimeoutError):  # fewer came than counted
                    self.complete = False
                    break
                for msg in messages:
                    owner = (msg.headers or {}).get(OWNER_HEADER)
                    if owner:  # a tombstone has none
                        found.append((msg.subject, owner))
                    pending = msg.metadata.num_pending
        finally:
            with contextlib.suppress(Exception):  # the consumer expires by itself anyway
                await sub.unsubscribe()
        return found
