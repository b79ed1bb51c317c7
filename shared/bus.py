"""NATS plumbing every service shares: connecting, the JetStream streams, running until SIGTERM,
and delivering a request's outputs to wherever its client listens."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import importlib.util
import itertools
import math
import os
import re
import signal
import socket
import ssl
import threading
import time
import weakref
from collections.abc import Awaitable, Callable, Iterator, Sequence
from pathlib import Path
from typing import TypeVar

import msgspec
import nats
import structlog
from nats.aio.client import DEFAULT_MAX_PAYLOAD_SIZE, Client
from nats.errors import MaxPayloadError, NoRespondersError
from nats.js import JetStreamContext
from nats.js.api import DiscardPolicy, RetentionPolicy, StorageType, StreamConfig
from nats.js.errors import APIError, NotFoundError, ServiceUnavailableError
from nats import micro

from shared.config import ConfigError, JetserveConfig, NatsSection, nats_servers
from shared.keys import RequestKey
from shared.messages import (Done, Ended, Holding, WorkItem, encode, ended_bytes,
                             holding_entry_bytes)
from shared.request_state import (STATE_STREAM, Claim, claim_answer, end_state, state_subjects,
                                  tombstone)
from shared.protocol import (
    Completion,
    Delta,
    Error,
    Metrics,
    Scheduling,
    Usage,
    service_error_headers,
)
from shared.metrics import counter
from shared.subjects import (
    RESULT_HEADER,
    REQUESTS_STREAM,
    RESULTS_STREAM,
    Subjects,
    client_reply,
    final_result,
)

log = structlog.get_logger()

SECOND_ANSWERS = counter("second_answers_withheld", "Final answers not sent: another attempt "
                         "of the request had answered it (shared/request_state.py)")
LAPSES = counter("holder_lapses", "Times a holder of requests found it may have looked dead to "
                 "admission: cut off from NATS, or stalled (shared/bus.py Lapses)")
ANSWERS_AGAIN = counter("answers_published_again", "Final answers to a generate published again: "
                        "the NATS connection that carried one was lost before its server took "
                        "it (shared/bus.py Echoes)")
REPLIES_REFUSED = counter("replies_refused", "Requests given no answer: their reply subject was "
                          "not a client inbox (docs/protocol.md)", ("endpoint",))

json_encode = msgspec.json.Encoder().encode
WRONG_LAST_SEQUENCE = 10071  # JetStream's error code: the expected last sequence did not match
# Kept free of a message's payload limit for its headers (trace context, JetStream's) and
# framing: the server counts headers and payload together against max_payload.
ENVELOPE_BYTES = 1024
T = TypeVar("T")


def payload_budget(nc: Client | None) -> int:
    """The bytes one message's payload may use on this connection: the server's `max_payload`
    (told at connect; 1 MiB unless configured; with no connection, that default) less
    ENVELOPE_BYTES."""
    return (DEFAULT_MAX_PAYLOAD_SIZE if nc is None else nc.max_payload) - ENVELOPE_BYTES


def chunked(items: Sequence[T], size_of: Callable[[T], int], budget: int) -> Iterator[list[T]]:
    """`items` in order, in runs whose sizes add up to at most `budget` (a run holds at least
    one item: one item larger than the budget is a run of its own, for the caller to refuse)."""
    run: list[T] = []
    used = 0
    for item in items:
        size = size_of(item)
        if run and used + size > budget:
            yield run
            run, used = [], 0
        run.append(item)
        used += size
    if run:
        yield run


class NatsUnreachable(Exception):
    """No NATS server answered within `nats.connect_wait_s`."""


async def connect(section: NatsSection, name: str) -> Client:
    """A connection that keeps reconnecting once made (a restarting nats-server is not a
    reason to die); NatsUnreachable when none answers within `section.connect_wait_s`, or at
    once when the server refuses the credentials (waiting would not change them)."""
    connected = False
    url = redacted(section.url)
    last_error: list[Exception] = []  # while connecting: the latest reason it failed
    refused = asyncio.get_running_loop().create_future()

    async def on_error(exc: Exception) -> None:
        if connected:
            log.warning("nats error", error=repr(exc))
            return
        # While connecting: retried until connect_wait_s, then an error of its own.
        last_error[:] = [exc]
        if _refused_credentials(exc) and not refused.done():
            refused.set_result(exc)
        log.info("nats server not answering yet", url=url, error=repr(exc))

    async def on_disconnect() -> None:
        cut_off(nc)
        if nc.is_closed or nc.is_draining:  # this service is stopping: expected
            log.info("nats disconnected", closing=True)
        else:
            log.warning("nats disconnected")

    async def on_reconnect() -> None:
        log.info("nats reconnected")

    nc = Client()
    connecting = asyncio.ensure_future(nc.connect(
        nats_servers(section.url), name=name, max_reconnect_attempts=-1,
        reconnect_time_wait=0.5,
        # A node that stops answering without closing its connections (frozen, cut off) is
        # left for another after three unanswered pings, 4-6 s (nats-py's default: 4 minutes):
        # within about a lease, and before an answer's echo is given up on (Echoes).
        ping_interval=2, max_outstanding_pings=2,
        connect_timeout=min(5.0, section.connect_wait_s), allow_reconnect=True,
        inbox_prefix=section.client_inbox_prefix,  # services answer one another's inboxes too
        **connect_options(section),
        error_cb=on_error, disconnected_cb=on_disconnect, reconnected_cb=on_reconnect))
    try:
        await asyncio.wait([connecting, refused], timeout=section.connect_wait_s,
                           return_when=asyncio.FIRST_COMPLETED)
        if refused.done():
            raise NatsUnreachable(f"the NATS server at {url} refused this connection's "
                                  f"credentials ({refused.result()}): check nats.url's user and "
                                  f"password, or nats.user/password/token/nkey_seed/creds")
        if not connecting.done():
            reason = f": last error {last_error[0]!r}" if last_error else ""
            raise NatsUnreachable(f"no NATS server answered at {url} within "
                                  f"nats.connect_wait_s ({section.connect_wait_s:g} s){reason}")
        try:
            connecting.result()
        except (OSError, nats.errors.Error) as exc:
            raise NatsUnreachable(f"could not connect to NATS at {url}: {exc!r}") \
                from None
    except BaseException:
        connecting.cancel()
        refused.cancel()
        with contextlib.suppress(Exception):
            await nc.close()
        raise
    refused.cancel()
    connected = True
    return nc


def connect_options(section: NatsSection) -> dict:
    """nats-py's connect options for the section's credentials and TLS (the URL's own
    user:password@ needs none)."""
    options: dict = {}
    if section.user:
        password = section.password
        if section.password_file:
            try:
                password = Path(section.password_file).read_text().strip()
            except OSError as exc:
                raise ConfigError(f"nats.password_file: {exc}") from None
        options.update(user=section.user, password=password)
    if section.token:
        options["token"] = section.token
    if section.nkey_seed:
        options["nkeys_seed"] = section.nkey_seed
    if section.creds:
        options["user_credentials"] = section.creds
    if (section.nkey_seed or section.creds) and importlib.util.find_spec("nkeys") is None:
        raise ConfigError("nats.nkey_seed and nats.creds need the `nkeys` package (pip install "
                          "nkeys): nats-py signs the server's challenge with it")
    if section.tls:
        try:
            context = ssl.create_default_context(cafile=section.tls.ca)
            if section.tls.cert:
                context.load_cert_chain(section.tls.cert, section.tls.key)
        except (OSError, ssl.SSLError) as exc:
            raise ConfigError(f"nats.tls: {exc}") from None
        options["tls"] = context
    return options


def redacted(url: str) -> str:
    """The URL(s) without credentials, fit for a log line."""
    return re.sub(r"//[^/@,]*@", "//***@", url)


def _refused_credentials(exc: Exception) -> bool:
    return isinstance(exc, nats.errors.Error) and "authorization violation" in str(exc).lower()


class StreamMismatch(Exception):
    """An existing stream whose settings differ from the configuration where JetStream cannot
    change them; the message names the setting."""


# The stream settings jetserve sets; of them, JetStream cannot change these on a stream.
MANAGED_STREAM_FIELDS = ("subjects", "retention", "storage", "max_msgs", "discard",
                         "max_msgs_per_subject", "discard_new_per_subject", "duplicate_window",
                         "max_age", "allow_direct", "allow_msg_ttl", "num_replicas")
FIXED_STREAM_FIELDS = ("retention", "storage")


def ended_window_s(distributed) -> float:
    """How long a service's holding reports name each request it answered (Holding.ended):
    a lease and two reports, so that one of them reaches an admission that missed the Done and
    would otherwise take the request for lost; admission, having heard it once, remembers it
    for longer (ENDED_KEPT_LEASES)."""
    return max(3.0, distributed.heartbeat_timeout_s + 2 * distributed.heartbeat_interval_s)


ENDED_KEPT_LEASES = 12  # how long admission remembers a request reported answered, in leases
JETSTREAM_WAKE_S = 5.0  # how long no JetStream responder at all is taken for one starting


async def ensure_streams(js: JetStreamContext, config: JetserveConfig) -> None:
    """Create LLM_REQUESTS and LLM_RESULTS when absent; bring existing ones to the
    configuration (a changed limit, window or subject list is applied), or raise
    StreamMismatch naming a setting JetStream cannot change (retention, storage). JetStream
    not enabled on the server: StreamMismatch saying so."""
    subjects = Subjects(config.nats.prefix)
    window = config.nats.duplicate_window_s
    wanted = [
        # A durable request's subject is its key, llm.requests.<tenant>.<request_id>: one
        # message per subject, and JetStream refuses another while it waits or runs, so a
        # tenant's ids can only collide with its own (permissions confine a tenant's subjects;
        # Nats-Msg-Id would deduplicate across all tenants, so admission refuses it).
        StreamConfig(name=REQUESTS_STREAM, subjects=[subjects.all_requests],
                     retention=RetentionPolicy.WORK_QUEUE, storage=StorageType.FILE,
                     max_msgs=config.scheduler.request_level.max_pending_requests,
                     discard=DiscardPolicy.NEW, max_msgs_per_subject=1,
                     discard_new_per_subject=True, duplicate_window=window,
                     num_replicas=config.nats.replicas),
        StreamConfig(name=RESULTS_STREAM, subjects=[subjects.results(">", "").rstrip(".")],
                     retention=RetentionPolicy.LIMITS, storage=StorageType.FILE,
                     max_age=config.nats.results_max_age_s, duplicate_window=window,
                     allow_direct=True,  # a result read by its subject, which permissions scope
                     num_replicas=config.nats.replicas),
        # What admission knows of each request in flight, one message per subject
        # (shared/request_state.py); ended requests' tombstones and stale checkpoints expire.
        StreamConfig(name=STATE_STREAM, subjects=[state_subjects(subjects)],
                     retention=RetentionPolicy.LIMITS, storage=StorageType.FILE,
                     max_msgs_per_subject=1, allow_direct=True, allow_msg_ttl=True,
                     duplicate_window=window, num_replicas=config.nats.replicas),
    ]
    # A cluster's JetStream is unavailable (503, or no answer) until it has elected a leader:
    # waited for up to nats.connect_wait_s. No responders at all is a server without
    # JetStream, or one whose JetStream is still starting: a few seconds.
    loop = asyncio.get_running_loop()
    start = loop.time()
    for stream in wanted:
        while True:
            try:
                current = (await js.stream_info(stream.name)).config
                break
            except NotFoundError:
                current = None
                break
            except (NoRespondersError, ServiceUnavailableError, nats.errors.TimeoutError) as exc:
                waited = loop.time() - start
                if waited >= (JETSTREAM_WAKE_S if no_jetstream_responder(exc)
                              else config.nats.connect_wait_s):
                    raise StreamMismatch(
                        "JetStream is not enabled on the NATS server, or its cluster has no "
                        "JetStream leader (start nats-server with -js, or `jetstream {}` in its "
                        "configuration; a cluster needs most of its nodes up): jetserve keeps "
                        "durable requests and results in streams") from None
                await asyncio.sleep(0.5)
        if current is None:
            try:
                await js.add_stream(stream)
                continue
            except APIError as exc:  # another service created it first, or it cannot be made
                if "already in use" not in str(exc):
                    raise StreamMismatch(
                        f"stream {stream.name} could not be created: "
                        f"{exc.description or exc!r} (nats.replicas {stream.num_replicas} "
                        f"needs at least that many JetStream nodes)") from None
            current = (await js.stream_info(stream.name)).config
        await _reconcile(js, current, stream)
        if stream.allow_msg_ttl and not (await js.stream_info(stream.name)).config.allow_msg_ttl:
            raise StreamMismatch(
                f"stream {stream.name} needs per-message TTLs (its ended requests' tombstones "
                f"expire by them), which nats-server 2.11 and later keep: upgrade the server")


def no_jetstream_responder(exc: Exception) -> bool:
    """Whether nothing answered a JetStream API request: a server without JetStream, or one
    whose JetStream is still starting (nats-py turns the server's no-responders status into a
    ServiceUnavailableError without a code). A JetStream that answers 503 itself (a cluster
    electing its leader) carries the code."""
    return isinstance(exc, NoRespondersError) or (isinstance(exc, ServiceUnavailableError)
                                                  and exc.code is None)


async def while_electing(call: Callable[[], Awaitable], wait_s: float):
    """`call()`, tried again while a cluster's JetStream does not answer (503, or no answer:
    a stream or the cluster electing a leader, seconds after a node died) for up to `wait_s`;
    a service starting then would otherwise exit."""
    loop = asyncio.get_running_loop()
    start = loop.time()
    while True:
        try:
            return await call()
        except (NoRespondersError, ServiceUnavailableError, nats.errors.TimeoutError):
            if loop.time() - start >= wait_s:
                raise
            await asyncio.sleep(0.5)


async def _reconcile(js: JetStreamContext, current: StreamConfig, wanted: StreamConfig) -> None:
    def value(config: StreamConfig, name: str):
        v = getattr(config, name)
        if isinstance(v, list):
            return sorted(v)
        if name in ("max_age", "duplicate_window") and v is not None:
            v = round(v * 1e9)  # the server keeps nanoseconds
        return None if v in (-1, 0) else getattr(v, "value", v)  # unlimited, as the server says

    # Only what jetserve sets is compared: an operator's other limits stay as they are.
    differ = [f for f in MANAGED_STREAM_FIELDS
              if getattr(wanted, f) is not None and value(current, f) != value(wanted, f)]
    if not differ:
        return
    for name in differ:
        if name in FIXED_STREAM_FIELDS:
            raise StreamMismatch(
                f"stream {wanted.name} exists with {name} {value(current, name)!r}, and jetserve "
                f"needs {value(wanted, name)!r}; JetStream cannot change {name} on a stream: "
                f"remove it (`nats stream rm {wanted.name}`; what it holds is lost) or point "
                f"jetserve at another server")
    try:
        await js.update_stream(dataclasses.replace(
            current, **{name: getattr(wanted, name) for name in differ}))
    except APIError as exc:
        raise StreamMismatch(
            f"stream {wanted.name} could not be brought to the configuration ("
            f"{', '.join(differ)}): {exc.description or exc!r}") from None
    log.info("stream updated to the configuration", stream=wanted.name,
             changed={name: [value(current, name), value(wanted, name)] for name in differ})


async def every(interval_s: float, tick: Callable[[], Awaitable[None]]) -> None:
    """`await tick()` every `interval_s` seconds until cancelled; one that fails is logged and
    the next runs (a tick missed is survivable; a dead loop is not)."""
    while True:
        await asyncio.sleep(interval_s)
        try:
            await tick()
        except Exception:
            log.exception("periodic task failed", task=getattr(tick, "__name__", repr(tick)))


class Lapses:
    """When a holder of requests (priority, the batcher, an executor) may have looked dead to
    admission while it held them: cut off from NATS (disconnected, or reconnected since the
    last look: its holding reports, and any revoke sent to it meanwhile, were lost), or its
    event loop stalled (no holding report for `stall_s`, half a lease: a report is due every
    heartbeat interval, and a lease is at least three). Admission hands on a request nobody
    reported for a lease and revokes the earlier attempt; a holder that missed the revoke would
    run that attempt on to a second answer. On a lapse, `on_lapse` marks what the holder holds
    (`WorkItem.lapsed`), and such an attempt of a generate claims its answer first
    (Outbox.final), as a handed-on attempt does. The holder `check`s before it hands an item on
    or answers it (a caller holding an item outside what `on_lapse` marks compares `count`
    before and after), and `beat`s with each holding report it sends."""

    def __init__(self, nc: Client | None, lease_s: float, on_lapse: Callable[[], None]):
        self.nc, self.on_lapse = nc, on_lapse
        self.stall_s = lease_s / 2
        self.reconnects_seen = nc.stats["reconnects"] if nc is not None else 0
        self.connected_seen = True
        self.beat_at: float | None = None  # the latest holding report (None: none yet)
        self.count = 0  # lapses found

    def check(self) -> bool:
        """Whether this holder lapsed since the last check: it was disconnected, or reconnected,
        or stalled (each counted once; what it holds is marked, and `count` goes up)."""
        if self.nc is None:  # (a service built without a connection, in a unit test)
            return False
        reconnects, connected = self.nc.stats["reconnects"], self.nc.is_connected
        now = time.monotonic()
        stalled = self.beat_at is not None and now - self.beat_at > self.stall_s
        reconnected = reconnects != self.reconnects_seen
        cut_off = self.connected_seen and not connected
        self.reconnects_seen, self.connected_seen = reconnects, connected
        if stalled:
            self.beat_at = now  # (the gap is counted once)
        if not (stalled or reconnected or cut_off):
            return False
        self.count += 1
        LAPSES.inc()
        log.info("this holder may have looked dead to admission: the generates it holds "
                 "claim their answers", reconnected=reconnected, disconnected=not connected,
                 stalled=stalled)
        self.on_lapse()
        return True

    def since(self, count: int) -> bool:
        """Whether this holder lapsed since `count` was read (checked now)."""
        self.check()
        return self.count != count

    def beat(self) -> None:
        """A holding report went out: the gap since the previous one is checked, and restarts."""
        self.check()
        self.beat_at = time.monotonic()


# One echo out at a time (Echoes); the next no sooner than this after it went. Spacing them
# costs less and duplicates more: an answer whose node died after taking it, while it waited
# for its echo, is published twice (`python -m loadtest.echoes --every-s`).
ECHO_EVERY_S = 0.0
ECHO_LATE_S = 0.1  # an echo not back by then: the next goes out beside it, and it is looked at
ECHO_GIVE_UP_S = 7.5  # an echo not back by then on a connection that looks alive: given up
ECHO_AWAY_S = 60.0  # on a connection away (reconnecting) this long: given up
# The reconnect count at which each connection made by `connect` last had its old socket
# closed (nats-py's disconnected callback): until then, what is published while it is away
# may still be written to the old socket (Echoes.mark).
_CUT_OFF: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def cut_off(nc: Client) -> None:
    """Called by a connection's disconnected callback (`connect`'s does): its old socket is
    closed, so what is published now goes out on the next connection (Echoes.mark); on a
    connection whose callback does not call this, it is counted on the old one."""
    _CUT_OFF[nc] = nc.stats["reconnects"]


def _retrieved(future: asyncio.Future) -> None:
    if not future.cancelled():
        future.exception()


@dataclasses.dataclass
class _Echo:
    back: asyncio.Future  # the reconnect count it came back at; None: given up on
    sent_on: int  # the connection that carried it (`Echoes.mark`)
    sent_at: float
    live_since: float  # since when its connection looked alive (its 7.5 s count from here)
    late: asyncio.TimerHandle | None = None


class Echoes:
    """Whether a message this connection published reached its NATS server. Core NATS gives
    the publisher no receipt: bytes written to a node's socket just before the node dies are
    lost with it (a handful of milliseconds of a connection's messages), and nothing says so.
    A generate's final answer lost that way leaves its client waiting: the request ended where
    it was answered, and nothing runs it again.

    An echo is an empty message this connection publishes to an inbox of its own after the
    message in question. A server reads one connection's messages in order (nats-py writes
    them in order, and PING does not: `flush` is no receipt), so the echo coming back on the
    connection that carried the message says the server took the message. A connection lost
    before its echo came back may have lost the message: the caller publishes it again. What
    is left: a message the server took just before it died (routed to the client's node or
    not) and an echo that did not come back, or came back but was handled after nats-py had
    reconnected, published twice; and a message still in nats-py's buffer when the loss was
    seen, carried on the next connection and published again there (duplicates, in windows of
    a round trip, against the milliseconds of socket and queue a message could be lost in)."""

    def __init__(self, nc: Client):
        self.nc = nc
        self.inbox: str | None = None  # this connection's echo inbox, subscribed on first use
        self.subscribing = asyncio.Lock()
        self.waiting: dict[str, _Echo] = {}  # echoes out, by subject
        self.latest: str | None = None  # the echo out last, until it is back or late
        self.sent_at = -math.inf  # when it went out
        self.forming: asyncio.Future | None = None  # the next echo, which callers join
        self.timer: asyncio.TimerHandle | None = None  # when it goes out
        self.sending: set[asyncio.Task] = set()
        self.ids = itertools.count()

    def mark(self) -> int:
        """Taken just before a publish: the connection that will carry it (nats-py's reconnect
        count then). A message published while away goes out on the next connection, once the
        old socket is closed (`connect` records when); before that, nats-py's flusher may
        still write it to the old one, so it is counted on the old: at worst published twice."""
        reconnects = self.nc.stats["reconnects"]
        if self.nc.is_connected or _CUT_OFF.get(self.nc) != reconnects:
            return reconnects
        return reconnects + 1

    async def landed(self, carrier: int) -> bool:
        """After a publish at `carrier` (`mark`): True once an echo published after it came
        back on that connection; False when that connection was lost first (the message may
        be lost: the caller publishes it again). ConnectionError when no echo came back while
        the connection never moved: ECHO_GIVE_UP_S on one that looks alive (a node that stopped
        without closing its connections, until the pings of `connect` give up on it), or
        ECHO_AWAY_S reconnecting; ConnectionClosedError once it is closed or draining.

        Echoes go out one at a time, as a group commit's writes do: callers join the next one,
        which goes out once the one out is back (or ECHO_LATE_S after it went, when it is not:
        lost with its connection, or slow; one that comes back late still counts), after the
        callers of that turn of the event loop (an engine step's answers) joined it. However
        many answers, a connection has one echo out (a few on a slow one), and a caller waits
        on a future (no timer of its own)."""
        if self.inbox is None:
            async with self.subscribing:
                if self.inbox is None:
                    inbox = self.nc.new_inbox()
                    await self.nc.subscribe(f"{inbox}.*", cb=self._back)
                    self.inbox = inbox  # (the SUB goes out before any echo, in order)
        while True:
            if self.forming is None:
                self.forming = asyncio.get_running_loop().create_future()
                self.forming.add_done_callback(_retrieved)  # (its callers may all be gone)
                self._schedule()
            # (shielded: a caller cancelled must not cancel the echo its fellows wait on)
            back_on = await asyncio.shield(self.forming)  # (raises if given up on)
            if back_on is not None:
                return back_on <= carrier
            if self.nc.stats["reconnects"] > carrier:
                return False

    def _schedule(self) -> None:
        """The forming echo goes out when none is out (ECHO_EVERY_S after the last went)."""
        if self.forming is None or self.latest is not None or self.timer is not None:
            return
        delay = max(0.0, self.sent_at + ECHO_EVERY_S - time.monotonic())
        self.timer = asyncio.get_running_loop().call_later(delay, self._fire)

    def _fire(self) -> None:
        self.timer = None
        task = asyncio.ensure_future(self._send())
        self.sending.add(task)
        task.add_done_callback(self.sending.discard)

    async def _send(self) -> None:
        back, self.forming = self.forming, None
        if back is None:
            return
        subject = self.latest = f"{self.inbox}.{next(self.ids)}"
        self.sent_at = time.monotonic()
        echo = self.waiting[subject] = _Echo(back, self.mark(), self.sent_at, self.sent_at)
        echo.late = asyncio.get_running_loop().call_later(ECHO_LATE_S, self._late, subject)
        try:
            await self.nc.publish(subject, b"")
        except (nats.errors.ConnectionClosedError, nats.errors.ConnectionDrainingError) as exc:
            self._end(subject, exc)
        except Exception:  # (a full reconnect buffer: the connection is away, `_late` sees)
            pass

    def _late(self, subject: str) -> None:
        """An echo not back ECHO_LATE_S after it went (or since it was last looked at): the
        next goes out; it ends (None) once its connection was lost, or with an error when
        that never comes (`landed`), and is looked at again meanwhile."""
        echo = self.waiting.get(subject)
        if echo is None:
            return
        now = time.monotonic()
        if self.nc.is_closed or self.nc.is_draining:
            self._end(subject, nats.errors.ConnectionClosedError())
            return
        if self.nc.stats["reconnects"] > echo.sent_on:
            self._end(subject, None)
            return
        if not self.nc.is_connected:
            echo.live_since = now
        if now - echo.live_since >= ECHO_GIVE_UP_S or now - echo.sent_at >= ECHO_AWAY_S:
            self._end(subject, ConnectionError(
                f"no echo came back from the NATS server in {now - echo.sent_at:.1f} s"))
            return
        echo.late = asyncio.get_running_loop().call_later(ECHO_LATE_S, self._late, subject)
        if subject == self.latest:
            self.latest = None
            self._schedule()

    def _end(self, subject: str, result: int | Exception | None) -> None:
        echo = self.waiting.pop(subject, None)
        if echo is not None:
            if echo.late is not None:
                echo.late.cancel()
            if echo.back.done():
                pass
            elif isinstance(result, Exception):
                echo.back.set_exception(result)
            else:
                echo.back.set_result(result)
        if subject == self.latest:
            self.latest = None
            self._schedule()  # the callers that joined meanwhile

    async def _back(self, msg) -> None:
        self._end(msg.subject, self.nc.stats["reconnects"])


async def report_holding(nc: Client, subjects: Subjects, holder: str, interval_s: float,
                         held: Callable[[], list[RequestKey]],
                         ended: Callable[[], list[Ended]] = list,
                         lapses: Lapses | None = None) -> None:
    """Tell admission every `interval_s` which requests `holder` holds (it hands on those nobody
    reports), and which it answered lately (`ended`); a long list is several messages, each
    within the payload limit. Each report is a beat of `lapses`."""
    async def holding_report() -> None:
        budget = payload_budget(nc)
        for part in chunked(held(), holding_entry_bytes, budget):
            await nc.publish(subjects.holding, encode(Holding(holder=holder, requests=part)))
        for part in chunked(ended(), ended_bytes, budget):
            await nc.publish(subjects.holding, encode(Holding(holder=holder, requests=[],
                                                              ended=part)))
        if lapses is not None:
            lapses.beat()

    await every(interval_s, holding_report)


async def wait_event(event: asyncio.Event, timeout: float, fresh: bool = False) -> bool:
    """Wait up to `timeout` s for `event` (`fresh`: cleared first, so only a new set counts);
    whether it was set."""
    if fresh:
        event.clear()
    try:
        await asyncio.wait_for(event.wait(), timeout)
    except TimeoutError:
        return False
    return True


async def cancel_all(tasks, timeout: float = 5.0) -> None:
    """Cancel `tasks` and wait for them, for `timeout` s at most. A task still running after a
    cancel is cancelled again: on Python 3.11 a cancel that lands as a `wait_for` inside a loop
    completes can be lost, and the loop goes on (an executor SIGTERMed under load hung here)."""
    pending = {t for t in tasks if not t.done()}
    deadline = asyncio.get_running_loop().time() + timeout
    while pending:
        for task in pending:
            task.cancel()
        left = deadline - asyncio.get_running_loop().time()
        if left <= 0:
            log.warning("tasks did not stop", tasks=sorted(t.get_name() for t in pending))
            return
        _, pending = await asyncio.wait(pending, timeout=min(0.5, left))


SERVER_GONE_S = 1.0  # disconnected this long while stopping: the server is not coming back


async def while_connected(nc: Client, work: Awaitable, timeout: float) -> bool:
    """Await `work` (a drain, a micro service's stop) for at most `timeout` s, and no longer
    than the connection stays down for SERVER_GONE_S: draining subscriptions flushes, and a
    flush into a server that died meanwhile waits for a reconnect that never comes (a service
    SIGTERMed beside its nats-server hung there). Whether `work` finished."""
    task = asyncio.ensure_future(work)

    async def server_gone() -> None:
        down_since = None
        while True:
            if nc.is_connected:
                down_since = None
            elif down_since is None:
                down_since = time.monotonic()
            elif time.monotonic() - down_since >= SERVER_GONE_S:
                return
            await asyncio.sleep(0.1)

    watch = asyncio.create_task(server_gone())
    try:
        await asyncio.wait([task, watch], timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not task.done():  # given up on (or we were cancelled): stop it too
            task.cancel()
            # A cancelled drain may still flush once, for its own timeout: not past ours again.
            await asyncio.wait([task], timeout=timeout)
    return task.done() and not task.cancelled() and task.exception() is None


STOP_GRACE_S = 20.0  # past its drain: how long a service told to stop may take to exit


async def run_until_stopped(name: str, serve: Callable[[asyncio.Event], Awaitable[None]],
                            drain_s: float = 0.0) -> None:
    """Run `serve(stop)` until SIGTERM or SIGINT sets `stop`; the service then drains. A second
    signal stops it at once, and so does `drain_s` + STOP_GRACE_S passing after the first,
    whatever the event loop is doing (a thread's timer, not a task): a process told to stop,
    stops."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()

    def first(signum: int) -> None:
        stop.set()
        bound = drain_s + STOP_GRACE_S
        timer = threading.Timer(bound, _exit_now, (name, f"still stopping {bound:g} s after "
                                                         f"{signal.Signals(signum).name}"))
        timer.daemon = True
        timer.start()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, _exit_now, name, f"a second {signal.Signals(sig).name}")

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, first, sig)
    log.info("starting", service=name)
    await serve(stop)
    log.info("stopped", service=name)


def _exit_now(name: str, why: str) -> None:
    """Exit without draining (what is held here is handed on by admission's lease)."""
    log.error("stopping at once", service=name, reason=why)
    os._exit(1)


def cancelled_completion(item: WorkItem, executor: str = "") -> Completion:
    """The final output of a request cancelled before any executor ran it."""
    waited_ms = 1e3 * max(0.0, time.time() - item.arrival_time)
    return Completion(
        request_id=item.request_id, model=item.request.model or "", text="", token_ids=[],
        finish_reason="cancelled",
        usage=Usage(prompt_tokens=item.num_prompt_tokens, completion_tokens=0, cached_tokens=0),
        metrics=Metrics(queue_ms=waited_ms, ttft_ms=0.0, e2e_ms=waited_ms, tpot_ms=0.0),
        scheduling=Scheduling(priority_score=item.priority_score, executor=executor, preemptions=0,
                              queue_wait_ms=item.queue_wait_ms or waited_ms))


ANSWER_AGAIN_S = 7.5  # a claimed generate's answer is tried again this long
# A generate's answer lost with its connection is published again on the next ones this long
# (a claim is read against tombstones that live 60 s: TOMBSTONE_TTL).
ANSWERS_AGAIN_FOR_S = 50.0
STORE_AGAIN_S = 30.0  # a held durable result, this long (longer than a stream's election)
UNENDED_KEPT_S = 600.0  # an answered request's state end is tried again this long


class Outbox:
    """Sends a request's Deltas and its final Completion or Error where its client listens:
    the reply inbox (request/reply; Error headers; empty sentinel after a stream) or, for a
    durable request, llm.stream.* and the LLM_RESULTS stream, then tells admission to ack."""

    def __init__(self, nc: Client, js: JetStreamContext, subjects: Subjects, inbox_prefix: str,
                 tenant_inboxes: bool = False):
        self.nc, self.js, self.subjects = nc, js, subjects
        self.inbox_prefix, self.tenant_inboxes = inbox_prefix, tenant_inboxes
        # Requests answered here, and when (monotonic), oldest first.
        self.ended: dict[tuple[RequestKey, float], tuple[Ended, float]] = {}
        self.ending: set[asyncio.Task] = set()  # answered requests' states being ended
        # Answered requests whose state's end is not yet acked (JetStream electing a leader):
        # named answered in the holding reports until it is.
        self.unended: dict[tuple[RequestKey, float], Ended] = {}
        self.echoes = Echoes(nc)  # whether a generate's final answer reached its server
        self.replying: set[asyncio.Task] = set()  # refusals' echoes awaited (`reply`)

    def recently_ended(self, window_s: float) -> list[Ended]:
        """The requests this service answered within `window_s`, and those whose state's end
        JetStream has not taken yet (what its holding reports carry in `ended`: an admission
        that takes such a state over, finding no holder, would run the request again); older
        ones are forgotten."""
        horizon = time.monotonic() - window_s
        while self.ended:
            key, (_, at) = next(iter(self.ended.items()))
            if at >= horizon:
                break
            del self.ended[key]
        return [ended for ended, _ in self.ended.values()] + [
            ended for key, ended in self.unended.items() if key not in self.ended]

    def reply_to(self, item: WorkItem) -> str | None:
        """A generate's reply subject when it is a client inbox. Admission answers no other,
        but an item may reach a service by another way (a forged submission to priority)."""
        if item.reply_to and client_reply(item.reply_to, self.inbox_prefix,
                                          item.tenant if self.tenant_inboxes else None):
            return item.reply_to
        if item.reply_to:
            REPLIES_REFUSED.labels("outbox").inc()
        return None

    async def delta(self, item: WorkItem, delta: Delta, reply: str | None = None) -> None:
        """`reply`: where the server may answer "no responders" (the executor's check that a
        streaming client still listens); clients ignore it."""
        subject = (self.subjects.stream(item.tenant, item.request_id) if item.durable
                   else self.reply_to(item))
        if subject:
            await self.nc.publish(subject, json_encode(delta), reply=reply or "")

    async def reply(self, subject: str, output: Error, stream: bool) -> None:
        """A generate's Error where no request state was made (admission's refusals): sent, and
        sent again while the connection that carried it was lost before an echo came back
        (`Echoes`), beside the caller, for up to ANSWERS_AGAIN_FOR_S."""
        async def publish() -> int:
            return await self._answer(subject, output, None, stream)

        async def land(carrier: int) -> None:
            give_up = time.monotonic() + ANSWERS_AGAIN_FOR_S
            with contextlib.suppress(Exception):  # (nothing else to tell it by)
                again = False  # (once at least, however long the first wait)
                while not await self.echoes.landed(carrier) \
                        and not (again and time.monotonic() >= give_up):
                    ANSWERS_AGAIN.inc()
                    carrier, again = await publish(), True

        task = asyncio.create_task(land(await publish()))
        self.replying.add(task)
        task.add_done_callback(self.replying.discard)

    async def store_result(self, tenant: str, request_id: str, output: Completion | Error,
                           headers: dict[str, str] | None = None,
                           retryable: bool = False) -> None:
        """The durable request's one final output, into LLM_RESULTS, marked as its result
        (RESULT_HEADER; `retryable`: a refusal the same id may be sent again after). Stored only
        where the subject's last message is not a final result already: the expected last
        sequence is that message's (0 for none), so of two results at once the first stands, and
        a retryable refusal or a message that is no result (a reply a client aimed here) is
        superseded rather than taken for the request's result."""
        subject = self.subjects.results(tenant, request_id)
        mark = f"{tenant}/{request_id}" + (" retryable" if retryable else "")
        expected = 0
        for _ in range(4):
            try:
                await self.js.publish(subject, json_encode(output), headers={
                    **(headers or {}), RESULT_HEADER: mark,
                    "Nats-Expected-Last-Subject-Sequence": str(expected)})
                return
            except APIError as exc:
                if exc.err_code != WRONG_LAST_SEQUENCE:
                    raise
            last = await self.js.get_last_msg(RESULTS_STREAM, subject)
            if final_result(last.headers, tenant, request_id):
                log.info("a second result was not stored", tenant=tenant, request_id=request_id)
                return
            expected = last.seq
        raise RuntimeError(f"the result subject {subject} kept changing; not stored")

    async def final(self, item: WorkItem, output: Completion | Error,
                    headers: dict[str, str] | None = None, done: bool = True,
                    held: bool = False) -> None:
        """`done`: tell admission the request has its answer (False for an Error to a second
        request that reused a running one's id: admission watches over the first). `held`:
        the caller reports the request as held while this runs (an executor's answering
        task), so a durable result JetStream does not take is tried again for up to
        STORE_AGAIN_S rather than dropped for the request to run a second time (a caller in
        a message handler must not wait that long).

        An output that cannot be delivered (larger than the server's max_payload; a result
        store that refuses it: disk full, stream limits) is replaced by an `internal` Error
        saying why. Admission is told either way: a request whose answer cannot be delivered
        ends, rather than running again every lease. A server or JetStream that is only away
        (a timeout, no responders) raises instead, with no Done: the lease hands it on.

        A handed-on attempt of a generate claims its answer first (`claim_answer`, one
        JetStream round trip): if the request was answered already it sends nothing, and says
        Done only, so that whoever watches this attempt stops. So does a first attempt whose
        holder lapsed while holding it (`WorkItem.lapsed`): it may have been handed on, its
        revoke lost. A generate's answer is not done until an echo says its NATS server took
        it (`Echoes`): one that may have been lost with its connection (a NATS node died) is
        published again, claimed first, on the next connections for up to
        ANSWERS_AGAIN_FOR_S; one no echo confirms while its connection never moved is not
        done (no Done: the lease hands its request on)."""
        claim = None
        if done and not item.durable and (item.attempt > 0 or item.lapsed):
            claim = await claim_answer(self.js, self.subjects, item.key, item.arrival_time)
            if claim is Claim.SECOND:
                SECOND_ANSWERS.inc()
                log.warning("a second final answer was not sent: the request was answered",
                            tenant=item.tenant, request_id=item.request_id,
                            attempt=item.attempt)
                await self.nc.publish(self.subjects.done, encode(done_of(item, output)))
                return
        try:
            carrier = await self._deliver(item, output, headers)
            give_up, again = time.monotonic() + ANSWERS_AGAIN_FOR_S, False
            # (no echo back while the connection never moved raises: no Done, below)
            while carrier is not None and not await self.echoes.landed(carrier):
                # Lost with the connection that carried it, maybe (Echoes): published again,
                # claimed first as a lapsed holder's answer is (cut off, this holder may have
                # been taken for dead and the request handed on).
                if again and time.monotonic() >= give_up:  # (once at least)
                    raise ConnectionError(f"the answer's connections kept failing for "
                                          f"{ANSWERS_AGAIN_FOR_S:g} s; not confirmed")
                if done and claim is None:
                    claim = await claim_answer(self.js, self.subjects, item.key,
                                               item.arrival_time)
                    if claim is Claim.SECOND:
                        SECOND_ANSWERS.inc()
                        await self.nc.publish(self.subjects.done, encode(done_of(item, output)))
                        return
                ANSWERS_AGAIN.inc()
                log.info("a final answer published again: its NATS connection was lost before "
                         "the server took it", tenant=item.tenant, request_id=item.request_id)
                carrier, again = await self._deliver(item, output, headers), True
        except Exception as exc:
            refused = exc if _refused_for_good(exc) else None
            if refused is None:
                # Claimed: no later attempt would answer it. A durable result, held: stored
                # once whoever stores it, and in hand here, where a second run would take a
                # lease and the time to compute it again (LLM_RESULTS electing a leader after
                # a NATS node died takes seconds). Else: no Done, the lease hands it on.
                again_s = ANSWER_AGAIN_S if claim is Claim.FIRST \
                    else STORE_AGAIN_S if item.durable and held else 0.0
                if not again_s:
                    raise
                refused = await self._deliver_again(item, output, headers, again_s)
            if refused is not None:
                log.error("output not delivered; answering with an Error", tenant=item.tenant,
                          request_id=item.request_id, error=repr(refused))
                error = Error(request_id=item.request_id, code="internal",
                              message=f"the {type(output).__name__.lower()} could not be "
                                      f"delivered: {undeliverable(refused, self.nc)}")
                await self._deliver(item, error, headers)  # failing too: no Done, retried
        if done:
            # The request's state ends here too, acked and retried beside (a JetStream electing
            # a leader loses an unacked write): if no admission hears the Done, the state does
            # not outlive the request (shared/request_state.py).
            ended = Ended(item.tenant, item.request_id, item.arrival_time)
            self.ended[(item.key, item.arrival_time)] = (ended, time.monotonic())
            await tombstone(self.nc, self.subjects, item.key, item.durable, item.arrival_time,
                            state=False)  # (the checkpoint's; the state's, acked, beside)
            if claim is not Claim.FIRST:
                self.unended[(item.key, item.arrival_time)] = ended
                task = asyncio.create_task(self._end_state(item))
                self.ending.add(task)
                task.add_done_callback(self.ending.discard)
            await self.nc.publish(self.subjects.done, encode(done_of(item, output)))

    async def _end_state(self, item: WorkItem) -> None:
        """`end_state`, tried again until JetStream takes it (for up to UNENDED_KEPT_S, while
        the request is named answered in the holding reports)."""
        give_up = time.monotonic() + UNENDED_KEPT_S
        again = False
        try:
            while True:
                try:
                    return await end_state(self.js, self.subjects, item.key, item.durable,
                                           item.arrival_time, again=again)
                except Exception as exc:
                    if time.monotonic() >= give_up:  # (its owner's end may still land)
                        log.warning("request state not ended", tenant=item.tenant,
                                    request_id=item.request_id, error=repr(exc))
                        return
                    await asyncio.sleep(5.0)
                    again = True
        finally:
            self.unended.pop((item.key, item.arrival_time), None)

    async def _deliver_again(self, item: WorkItem, output: Completion | Error,
                             headers: dict[str, str] | None, for_s: float) -> Exception | None:
        """A claimed generate's answer whose publish failed (the connection's buffer full while
        it reconnects), or a durable result JetStream did not take (a stream electing its
        leader): tried again for up to `for_s`, then given up (raised: no Done, the lease hands
        the request on). None once delivered; the exception if it is now refused for good."""
        deadline = time.monotonic() + for_s
        for n in itertools.count():
            await asyncio.sleep(min(0.5 * (n + 1), 2.0))
            try:
                await self._deliver(item, output, headers)
                return None
            except Exception as exc:
                if _refused_for_good(exc):
                    return exc
                if time.monotonic() >= deadline:
                    raise

    async def _deliver(self, item: WorkItem, output: Completion | Error,
                       headers: dict[str, str] | None) -> int | None:
        """For a generate's answer, the connection that carried it (`Echoes.mark`)."""
        if item.durable:
            await self.store_result(item.tenant, item.request_id, output, headers)
        elif reply_to := self.reply_to(item):
            return await self._answer(reply_to, output, headers, item.request.stream)
        return None

    async def _answer(self, subject: str, output: Completion | Error,
                      headers: dict[str, str] | None, stream: bool) -> int:
        """A generate's final answer to its client's inbox (an Error's headers say so; a
        stream's empty sentinel ends it); the connection that carried it (`Echoes.mark`)."""
        if isinstance(output, Error):
            headers = {**(headers or {}), **service_error_headers(output)}
        carrier = self.echoes.mark()
        await self.nc.publish(subject, json_encode(output), headers=headers)
        if stream:
            await self.nc.publish(subject, b"")  # end of a request-many stream
        return carrier


def done_of(item: WorkItem, output: Completion | Error) -> Done:
    request = item.request
    if isinstance(output, Completion):
        generated = output.usage.completion_tokens
        return Done(item.tenant, item.request_id, item.durable, item.arrival_time,
                    request.priority, output.usage.prompt_tokens, generated, request.max_tokens,
                    output.metrics.ttft_ms if generated else None, output.finish_reason)
    return Done(item.tenant, item.request_id, item.durable, item.arrival_time, request.priority,
                item.num_prompt_tokens, 0, request.max_tokens, None, output.code)


def _refused_for_good(exc: Exception) -> bool:
    """Whether delivering again would fail the same way: too large for the server, or refused
    by the result store (a stream limit, no space); not a server or JetStream away for now."""
    return isinstance(exc, MaxPayloadError) or (
        isinstance(exc, APIError) and not isinstance(exc, ServiceUnavailableError))


def undeliverable(exc: Exception, nc: Client) -> str:
    """Why a message could not be delivered, in words a client can act on."""
    if isinstance(exc, MaxPayloadError):
        return f"it is larger than the NATS server's max_payload ({nc.max_payload} bytes)"
    if isinstance(exc, APIError):
        return f"the result store refused it ({exc.description or exc!r})"
    return repr(exc)


async def serve_forever(service_name: str, serve: Callable[..., Awaitable[None]],
                        argv: list[str] | None = None) -> None:
    """The common `main()` of a service: options, config, logging, tracing, connection, then
    `serve(config, nc, js, tracer, stop, args)` until SIGTERM; then drain and flush spans."""
    import argparse

    from shared.config import ConfigError, load_config
    from shared.logs import setup_logging
    from shared.metrics import serve_metrics
    from shared.telemetry import setup_tracing, shutdown_tracing

    parser = argparse.ArgumentParser(prog=f"python -m services.{service_name}")
    parser.add_argument("--config", help="jetserve.yaml (environment variables override it)")
    parser.add_argument("--name", help="instance name (executors: the name heartbeats carry)")
    parser.add_argument("--metrics-port", type=int,
                        help=f"serve /metrics here (0: off; default: monitoring.metrics_port."
                             f"{service_name})")
    args = parser.parse_args(argv)
    try:
        config = load_config(args.config)
    except ConfigError as exc:
        raise SystemExit(f"{service_name}: {exc}") from None
    setup_logging(service_name, config.monitoring)
    tracer = setup_tracing(service_name)
    port = args.metrics_port if args.metrics_port is not None else \
        getattr(config.monitoring.metrics_port, service_name, 0)  # (the gateway: its own)
    serve_metrics(port if config.monitoring.metrics else 0, service_name)
    try:
        nc = await connect(config.nats, service_name)
    except NatsUnreachable as exc:
        raise SystemExit(f"{service_name}: {exc}") from None
    js = nc.jetstream()
    try:
        await run_until_stopped(service_name,
                                lambda stop: serve(config, nc, js, tracer, stop, args),
                                config.distributed.drain_timeout_s)
    except StreamMismatch as exc:
        log.error("cannot start", error=str(exc))
        raise SystemExit(f"{service_name}: {exc}") from None
    finally:
        if not nc.is_closed and not await while_connected(nc, nc.drain(), 10):
            log.warning("drain did not finish: the server is gone or too slow")
        if not nc.is_closed:
            try:
                await asyncio.wait_for(nc.close(), 5)
            except Exception as exc:  # pending bytes flushed into a dead transport
                log.warning("close failed", error=repr(exc))
        shutdown_tracing()


def service_main(name: str, service_class) -> Callable[[list[str] | None], None]:
    """The `main()` of a service whose class takes (config, nc, js, tracer) and has `start` and
    `stop`: started, then stopped when told to (serve_forever)."""
    async def serve(config, nc, js, tracer, stop: asyncio.Event, args) -> None:
        service = service_class(config, nc, js, tracer)
        await service.start()
        log.info("serving", service=name)
        await stop.wait()
        await service.stop()

    return lambda argv=None: asyncio.run(serve_forever(name, serve, argv))


class MicroService(micro.Service):
    """A `nats.micro` service that answers only a client inbox (`client_reply`), on its
    endpoints and on $SRV.PING/INFO/STATS alike: a reply subject is the asker's word, and an
    answer published wherever it says (another tenant's `llm.results.…`, an internal subject,
    the JetStream API) would be the service speaking there. Any other request gets nothing,
    counted (`jetserve:replies_refused_total`) and logged once per endpoint; an endpoint may
    take the refusal over (`on_refused`: admission logs it per tenant)."""

    def __init__(self, nc: Client, config: micro.ServiceConfig, inbox_prefix: str,
                 tenant_inboxes: bool = False):
        super().__init__(nc, config)
        self.inbox_prefix, self.tenant_inboxes = inbox_prefix, tenant_inboxes
        self.refusals_logged: set[str] = set()

    def answers(self, msg, endpoint: str, on_refused: Callable[[object], None] | None = None,
                tenant_of: Callable[[str], str] | None = None) -> bool:
        """`tenant_of`: an endpoint of tenants' requests, the tenant of a request's subject
        (whose inbox, with `tenant_inboxes`, its reply must be under)."""
        tenant = tenant_of(msg.subject) if tenant_of is not None and self.tenant_inboxes else None
        if not msg.reply or client_reply(msg.reply, self.inbox_prefix, tenant):
            return True
        if on_refused is not None:
            on_refused(msg)
            return False
        REPLIES_REFUSED.labels(endpoint).inc()
        if endpoint not in self.refusals_logged:
            self.refusals_logged.add(endpoint)
            log.warning("reply subject refused", endpoint=endpoint, reply=msg.reply[:128],
                        inbox_prefix=self.inbox_prefix)
        return False

    async def add_endpoint(self, *, name: str, subject: str, handler,
                           on_refused: Callable[[object], None] | None = None,
                           tenant_of: Callable[[str], str] | None = None) -> None:
        async def guarded(request: micro.Request) -> None:
            # (nats-py's micro Request does not expose the reply subject)
            if self.answers(request._msg, name, on_refused, tenant_of):
                await handler(request)

        await super().add_endpoint(name=name, subject=subject, handler=guarded)

    async def _handle_ping_request(self, msg) -> None:
        if self.answers(msg, "PING"):
            await super()._handle_ping_request(msg)

    async def _handle_info_request(self, msg) -> None:
        if self.answers(msg, "INFO"):
            await super()._handle_info_request(msg)

    async def _handle_stats_request(self, msg) -> None:
        if self.answers(msg, "STATS"):
            await super()._handle_stats_request(msg)


async def add_micro_service(nc: Client, name: str, description: str,
                            stats: Callable[[], dict], inbox_prefix: str,
                            tenant_inboxes: bool = False) -> MicroService:
    """A started MicroService: $SRV.PING/INFO/STATS answer; `stats()` is each endpoint's data.
    Its metadata names the host and process, which is how a container's healthcheck
    (`python -m shared.health`) finds its own instance among the answers."""
    service = MicroService(nc, micro.ServiceConfig(
        name=name, version="0.1.0", description=description,
        metadata={"host": socket.gethostname(), "pid": str(os.getpid())},
        stats_handler=lambda _endpoint: stats()), inbox_prefix, tenant_inboxes)
    await service.start()
    return service


async def discover(nc: Client, verb: str = "PING", name: str | None = None,
                   wait_s: float = 0.3) -> list[dict]:
    """Every micro service's answer to `$SRV.<verb>[.<name>]`, gathered for `wait_s`."""
    inbox = nc.new_inbox()
    sub = await nc.subscribe(inbox)
    answers = []
    try:
        await nc.publish(f"$SRV.{verb}" + (f".{name}" if name else ""), b"", reply=inbox)
        deadline = asyncio.get_running_loop().time() + wait_s
        while (left := deadline - asyncio.get_running_loop().time()) > 0:
            try:
                msg = await sub.next_msg(timeout=left)
            except Exception:  # nats' TimeoutError: no more answers
                break
            if msg.data:  # an empty one is the server's "no responders" status
                answers.append(msgspec.json.decode(msg.data))
    finally:
        await sub.unsubscribe()
    return answers
