"""The admission service: the edge of jetserve.

Request/reply generates (`llm.generate.<tenant>`) and durable submissions
(`llm.requests.<tenant>.<request_id>`, stream LLM_REQUESTS) are validated, tokenized, checked
against the model's limits and the tenant's rate limit, given an id, a seed and an arrival time,
and handed to priority. A durable request's message is held here (kept alive with in-progress acks)
and acknowledged only once its final result is stored in LLM_RESULTS; a redelivered one whose
result exists is only acknowledged. A held request that no service reports holding (priority's
queue, an executor) for longer than the heartbeat timeout was lost with a dead service: it goes
back to priority's queue, still held, with the outputs its executor's checkpoints reported, and the
next executor continues from there (a copy of the admitted request is kept for this). That silence
is timed on a clock a stalled event loop barely advances, so a stall is not taken for deaths; and a
redelivered request that a service still reports (this admission restarted) is held again, not
admitted a second time.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import math
import os
import secrets
import socket
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Annotated

import msgspec
import structlog
from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeoutError
from nats.js.api import AckPolicy, ConsumerConfig
from nats.js.errors import NotFoundError
from nats.micro import Request

from services.admission.intake import FairIntake
from services.admission.ledger import Ledger, Watched
from services.admission.rate_limit import TokenBuckets
from shared.block_hash import block_hashes
from shared.preprocess import (
    admitted,
    check_model,
    check_prompt_size,
    prompt_token_ids,
    served_model,
)
from shared.bus import (
    ENDED_KEPT_LEASES,
    ENVELOPE_BYTES,
    Outbox,
    add_micro_service,
    cancel_all,
    ensure_streams,
    payload_budget,
    service_main,
    while_connected,
    while_electing,
)
from shared.cancels import RecentCancels
from shared.request_state import RequestState, RequestStates, Taken
from shared.config import JetserveConfig, TenantQuota, share_limit
from shared.keys import RequestKey
from shared.messages import (
    DISPATCH_BYTES,
    Backpressure,
    CancelRequest,
    Done,
    Ended,
    Holding,
    Revoke,
    SubmitReply,
    WorkItem,
    decoder,
    encode,
)
from shared.metrics import Reading, StatsCollector, TenantLabels, counter
from shared.protocol import (
    QUOTA_RETRY_MS,
    Error,
    GenerateRequest,
    ProtocolError,
    check_nesting,
    decode_cancel,
    decode_generate_request,
)
from shared.subjects import (
    ADMISSION_CONSUMER,
    DURABLE_ID_PATTERN,
    REQUESTS_STREAM,
    RESULTS_STREAM,
    TENANT_PATTERN,
    Subjects,
    final_result,
)
from shared.telemetry import SpanKind, carrier_of, context_from

log = structlog.get_logger()

_submit_reply = decoder(SubmitReply)
_done = decoder(Done)
_holding = decoder(Holding)
_item = decoder(WorkItem)
_backpressure = decoder(Backpressure)
DURABLE_FETCH_BATCH = 64
ADMIT_WORKERS = 256  # generate requests being admitted at once
# A durable request put back for later counts toward its tenant's durable backlog this long at
# most (it comes back within seconds; past this it went to another admission).
DELAYED_FOR_S = 60.0
INTAKE_CAPACITY = 4096  # generate requests waiting to be admitted (services/admission/intake.py)
# and their bytes at most (4,096 requests of 1 MiB, the default max_payload, would be 4 GiB)
INTAKE_MAX_BYTES = 256 * 2**20
TOKENIZE_THREADS = 2  # prompts encoded at once (the encoder releases the GIL)
# A result's bytes besides its tokens' text and ids: ids, usage, metrics, scheduling, model.
RESULT_BYTES = 2048
STATE_WRITE_S = 2.0  # each LLM_STATE write's time limit
STATE_WRITE_TRIES = 10  # a new request's state: tries (about 15 s) before it is not kept
# Besides when another admission falls silent, LLM_STATE is scanned for requests nobody watches
# over this often (a take-over that failed, an owner that died unheard).
SCAN_EVERY_LEASES = 12
# A durable request that fails inside admission this many times gets an Error. Only failures
# count, not deliveries: a request put back for a rate limit or a full queue did not fail.
MAX_FAILURES = 5
ADMITTED = counter("admitted_requests", "Requests admitted and queued at priority, by tenant",
                   ("tenant", "durable"))
REJECTED = counter("rejected_requests", "Requests answered with an Error at admission, by tenant "
                   "and code", ("tenant", "code"))


class Admission:
    def __init__(self, config: JetserveConfig, nc, js, tracer):
        self.config, self.nc, self.js, self.tracer = config, nc, js, tracer
        self.subjects = Subjects(config.nats.prefix)
        self.outbox = Outbox(nc, js, self.subjects, config.nats.client_inbox_prefix,
                             config.nats.tenant_inboxes)
        model = config.model
        self.model_name = model.name
        self.tokenizer, self.vocab_size, self.max_model_len = served_model(model)
        self.tokenizer.max_token_json_bytes  # noqa: B018 (computed once here, off the hot path)
        self.quotas = config.quotas
        self.buckets = TokenBuckets()
        # The durable backlog LLM_REQUESTS holds, which tenants share (quotas durable_share).
        self.durable_backlog = config.scheduler.request_level.max_pending_requests
        # tenant -> ids of its durable requests put back for later by a quota (still in
        # LLM_REQUESTS, not held here), and when; tenants with none are not kept
        self.delayed: dict[str, dict[str, float]] = {}
        self.in_admission: dict[str, int] = {}  # tenant -> its requests being admitted now
        # Every request handed to priority and not yet ended, and who last reported holding it.
        self.ledger = Ledger(config.distributed.heartbeat_timeout_s,
                             config.distributed.heartbeat_interval_s)
        # What the ledger knows of each request is also kept in LLM_STATE, owned by this
        # instance's name (new at every start), so another admission can take it over.
        self.owner = f"{socket.gethostname()[:40]}-{os.getpid()}-{secrets.token_hex(4)}"
        self.states = RequestStates(nc, js, self.subjects, self.owner, STATE_WRITE_S)
        self.peers: dict[str, float] = {}  # other admissions' names -> when last heard (clock)
        self.scanned_at: float | None = None  # ledger clock of the last scan of LLM_STATE
        self.scan_task: asyncio.Task | None = None
        self.rescan = False  # a scan failed, or missed an admission that fell silent meanwhile
        self.state_writes: set[asyncio.Task] = set()  # writes to LLM_STATE under way
        # Requests a holder reported answered (Holding.ended): (key, arrival) -> ledger clock,
        # oldest first
        self.ended: dict[tuple[RequestKey, float], float] = {}
        self.counts = dict(admitted=0, durable_admitted=0, rejected=0, durable_acked=0,
                           redelivered_with_result=0, durable_redelivered=0,
                           durable_delayed=0, durable_adopted=0, durable_handed_on=0,
                           resumed_tokens=0, generates_handed_on=0, refused_at_once=0,
                           submits_timed_out=0, reply_refused=0, no_reply=0,
                           cancels_forwarded=0, cancels_remembered=0, cancels_malformed=0,
                           taken_over=0, let_go=0, state_errors=0, ended_by_report=0,
                           durable_not_requests=0)
        # Cancels of requests not (yet) in flight: one admitted after its cancel arrived is not
        # cancelled by it, but one being admitted when it arrived is (shared/cancels.py).
        self.cancels = RecentCancels()
        self.errors_by_code: dict[str, int] = {}
        self.failures: dict[RequestKey, int] = {}  # durable requests admission failed on
        self.tasks: list[asyncio.Task] = []
        self.intake: FairIntake = FairIntake(INTAKE_CAPACITY, INTAKE_MAX_BYTES,
                                             size_of=lambda entry: len(entry[1].data))
        self.admitting = 0  # generate requests taken from the intake and not yet answered
        self.tokenize_pool = ThreadPoolExecutor(TOKENIZE_THREADS, thread_name_prefix="tokenize")
        self.collector = StatsCollector(self.read_metrics)
        self.tenant_label = TenantLabels()
        # Priority's latest Backpressure: tenant -> the highest priority its full queue refuses.
        self.backpressure: dict[str, int] = {}
        self.backpressure_at = 0.0  # time.monotonic() of that report
        self.inbox_prefix = config.nats.client_inbox_prefix
        self.reply_refused_logged: set[str] = set()  # tenants told of in the log (bounded)

    async def start(self) -> None:
        await ensure_streams(self.js, self.config)
        # Heard before it admits anything: the others leave its requests alone.
        await self.nc.subscribe(self.subjects.admissions, cb=self.on_peer)
        await self.nc.publish(self.subjects.admissions, self.owner.encode())
        self.service = await add_micro_service(self.nc, "admission", "validates and tokenizes",
                                               self.stats, self.inbox_prefix,
                                               self.config.nats.tenant_inboxes)
        await self.service.add_endpoint(
            name="generate", subject=self.subjects.generate(), handler=self.on_generate,
            on_refused=lambda msg: self.refuse_reply(self.subjects.tenant_of(msg.subject),
                                                     msg.reply),
            tenant_of=self.subjects.tenant_of)
        await self.nc.subscribe(self.subjects.cancel(), cb=self.on_cancel)
        await self.nc.subscribe(self.subjects.done, cb=self.on_done)
        await self.nc.subscribe(self.subjects.holding, cb=self.on_holding)
        await self.nc.subscribe(self.subjects.backpressure, cb=self.on_backpressure)
        # Created, or brought up to this config (its limits are editable) if it exists; while
        # a cluster elects its leaders (a node just died), tried again.
        wait_s = self.config.nats.connect_wait_s
        consumer = await while_electing(lambda: self.js.add_consumer(
            REQUESTS_STREAM, ConsumerConfig(
                name=ADMISSION_CONSUMER, durable_name=ADMISSION_CONSUMER,
                filter_subject=self.subjects.all_requests, ack_policy=AckPolicy.EXPLICIT,
                ack_wait=self.config.nats.ack_wait_s, max_deliver=-1,
                max_ack_pending=self.config.nats.max_ack_pending)), wait_s)
        self.consumer = await while_electing(lambda: self.js.pull_subscribe_bind(
            durable=ADMISSION_CONSUMER, stream=REQUESTS_STREAM), wait_s)
        # Requests delivered to an earlier admission and not acked may still run: hear the
        # holding reports before they come again, so they are adopted, not run twice.
        hear_first = 2 * self.config.distributed.heartbeat_interval_s if consumer.num_ack_pending \
            else 0.0
        self.tasks = [asyncio.create_task(self.durable_loop(hear_first), name="durable"),
                      asyncio.create_task(self.keep_alive_loop(), name="keep-alive"),
                      asyncio.create_task(self.say_alive(), name="alive"),
                      *(asyncio.create_task(self.admit_loop(), name="admit")
                        for _ in range(ADMIT_WORKERS))]
        log.info("admitting", model=self.model_name, max_model_len=self.max_model_len)

    async def stop(self) -> None:
        # No new requests; those being admitted finish.
        await while_connected(self.nc, self.service.stop(), 5.0)
        wait_s = self.config.nats.request_timeout_s
        give_up = time.monotonic() + wait_s
        while len(self.intake) and time.monotonic() < give_up:
            await asyncio.sleep(0.02)
        for tenant, msg in self.intake.drain():  # still waiting: told, not dropped
            await self.refuse(msg, tenant, Error(
                request_id=None, code="overloaded",
                message="admission is stopping and did not reach this request; retry"))
        # Those being admitted finish: each hop has its own timeout, so one more is enough.
        give_up = time.monotonic() + wait_s
        while self.admitting and time.monotonic() < give_up:
            await asyncio.sleep(0.02)
        await cancel_all(self.tasks + ([self.scan_task] if self.scan_task else [])
                         + list(self.state_writes))
        await self.consumer.unsubscribe()  # a pull subscription would stall the drain
        self.collector.unregister()
        self.tokenize_pool.shutdown(wait=False, cancel_futures=True)

    def stats(self) -> dict:
        return {**self.counts, "durable_held": len(self.ledger.held),
                "generates_in_flight": len(self.ledger.generates),
                "cancels_kept": len(self.cancels), "first_lease": self.ledger.young,
                "intake_waiting": len(self.intake),
                "admitting": self.admitting, "errors": self.errors_by_code,
                "model": self.model_name, "owner": self.owner, "peers": len(self.peers)}

    # --------------------------------------------------------------------------- validation

    async def admit(self, tenant: str, payload: bytes, durable_id: str | None = None,
                    seed: int | None = None, attempt: int = 0, reply_to: str | None = None,
                    trace: dict[str, str] | None = None) -> WorkItem:
        """A valid, tokenized WorkItem, or a ProtocolError that names the field or limit;
        `durable_id` is a durable submission's id, from its subject; `seed` its seed unless
        the client gave one; `attempt` its first attempt's number; `reply_to` and `trace` its
        client's inbox and trace context (they travel with it, so they count in its size).

        Every check that needs no tokens comes first (a prompt that must be too long is refused
        by its length); text is tokenized on a small thread pool, never on the event loop."""
        quota = self.quotas.of(tenant)
        if quota.max_payload_bytes is not None and len(payload) > quota.max_payload_bytes:
            raise ProtocolError("invalid_request", f"the request is {len(payload)} bytes, over "
                                f"the quota of tenant {tenant!r} (max_payload_bytes "
                                f"{quota.max_payload_bytes})")
        request = self.check(tenant, payload, durable_id)
        check_quota(request, quota, tenant)
        # Its tenant's requests watched, and those being admitted besides this one.
        watched = self.ledger.watching(tenant)[0] + self.in_admission.get(tenant, 1) - 1
        if quota.max_concurrent_requests is not None and watched >= quota.max_concurrent_requests:
            raise ProtocolError("rate_limited", f"tenant {tenant!r} has {watched} requests "
                                f"running or waiting, its quota (max_concurrent_requests "
                                f"{quota.max_concurrent_requests})",
                                retry_after_s=QUOTA_RETRY_MS / 1e3)
        if request.prompt_token_ids is not None:
            prompt = prompt_token_ids(self.tokenizer, request, self.vocab_size)
        else:
            prompt = await asyncio.get_running_loop().run_in_executor(
                self.tokenize_pool, prompt_token_ids, self.tokenizer, request, self.vocab_size)
        request = admitted(request, prompt, self.model_name, self.max_model_len, self.vocab_size,
                           seed)
        now = time.time()
        item = WorkItem(request=request, tenant=tenant, arrival_time=now, attempt=attempt,
                        durable=durable_id is not None,
                        deadline=now + request.deadline_ms / 1e3 if request.deadline_ms else None,
                        block_hashes=block_hashes(prompt, self.config.kv_cache.block_size),
                        reply_to=reply_to, trace=trace or {})
        self.check_message_sizes(item)
        if quota.max_prompt_tokens is not None and len(prompt) > quota.max_prompt_tokens:
            raise ProtocolError("invalid_request", f"the prompt is {len(prompt)} tokens, over "
                                f"the quota of tenant {tenant!r} (max_prompt_tokens "
                                f"{quota.max_prompt_tokens})")
        # Last: a request refused for any other reason takes nothing from its tenant's tokens.
        if quota.tokens_per_s is not None:
            self.check_rate(tenant, len(prompt) + request.max_tokens, quota)
        return item

    def check_message_sizes(self, item: WorkItem) -> None:
        """A request travels between services as one message, and its result goes to its client
        as one: both must fit the server's max_payload, or they could never be delivered. The
        request is measured with room for the outputs a hand-on carries back; the result at the
        most bytes `max_tokens` tokens could take (the vocabulary's longest token each)."""
        budget = payload_budget(self.nc)
        request = item.request
        size = len(encode(item)) + DISPATCH_BYTES + 5 * request.max_tokens
        if size > budget:
            raise ProtocolError(
                "prompt_too_long", f"the prompt ({item.num_prompt_tokens} tokens) with "
                f"`max_tokens` {request.max_tokens} makes a {size}-byte message inside jetserve, "
                f"over the {budget} bytes one message may carry (the NATS server's max_payload "
                f"{budget + ENVELOPE_BYTES}, less {ENVELOPE_BYTES} for headers)")
        per_token = self.tokenizer.max_token_json_bytes
        if RESULT_BYTES + per_token * request.max_tokens > budget:
            most = max(0, (budget - RESULT_BYTES) // per_token)
            raise ProtocolError(
                "invalid_request", f"`max_tokens` {request.max_tokens} could make a result of up "
                f"to {RESULT_BYTES + per_token * request.max_tokens} bytes ({per_token} a token "
                f"at most), over the {budget} bytes one message may carry (the NATS server's "
                f"max_payload {budget + ENVELOPE_BYTES}); at most {most} fit: lower "
                f"`max_tokens` or raise the server's max_payload")

    def check(self, tenant: str, payload: bytes, durable_id: str | None = None) -> GenerateRequest:
        """The decoded request, if everything but its token count is valid (a durable one with
        its subject's id)."""
        if not TENANT_PATTERN.fullmatch(tenant):
            raise ProtocolError("invalid_request", f"tenant {tenant!r} (the subject's last token) "
                                f"must match [A-Za-z0-9_-]{{1,64}}")
        request = decode_generate_request(payload)
        check_model(request, self.model_name)
        if durable_id is not None and request.request_id != durable_id:
            if request.request_id is not None:
                raise ProtocolError("invalid_request", f"`request_id` {request.request_id!r} "
                                    f"must equal the subject's last token {durable_id!r} (or "
                                    f"be left out): the subject is a durable request's key")
            request = msgspec.structs.replace(request, request_id=durable_id)
        check_prompt_size(self.tokenizer, request, self.max_model_len)
        return request

    def check_rate(self, tenant: str, tokens: int, quota: TenantQuota) -> None:
        if tokens > quota.burst_tokens:  # it never would fit
            raise ProtocolError("invalid_request", f"the request may use {tokens} tokens "
                                f"(prompt + `max_tokens`), more than the burst "
                                f"{quota.burst_tokens} (quotas burst_tokens)")
        wait_s = self.buckets.take(tenant, tokens, quota.tokens_per_s, quota.burst_tokens)
        if wait_s:
            raise ProtocolError("rate_limited", f"tenant {tenant!r} is over "
                                f"{quota.tokens_per_s:g} tokens/s (quotas tokens_per_s); retry "
                                f"in {wait_s:.2f} s", retry_after_s=wait_s)

    async def to_priority(self, item: WorkItem) -> Error | None:
        """Queue the item at priority; an Error (`overloaded`, `internal`) when it was not taken.
        Raises NatsTimeoutError when priority did not answer in time: it may have taken it."""
        try:
            reply = await self.nc.request(self.subjects.priority_submit, encode(item),
                                          timeout=self.config.nats.request_timeout_s,
                                          headers=item.trace)
        except NoRespondersError:
            return Error(request_id=item.request_id, code="overloaded",
                         message="the priority service is not answering (no responders)")
        return _submit_reply.decode(reply.data).error

    async def submit_watched(self, item: WorkItem, msg=None, seat: list[str] | None = None,
                             received: float | None = None) -> Error | None:
        """`to_priority`, with the request in the ledger from before priority has it (its Done
        may come back before priority's reply does), and out of it again if priority did not
        take it (a durable one's redelivery is then admitted again). A generate without a reply
        subject has nobody to answer: not watched, so not handed on. `seat`: its seat of
        `being_admitted`, given up once it is watched (counted there from then on)."""
        encoded = encode(item)
        watched = (msg is not None or bool(item.reply_to)) and self.ledger.watch(
            item.key, encoded, msg, item.attempt, item.arrival_time)
        if watched:  # its state is written beside (a slow JetStream holds up nothing here)
            self.background(self.persist(item, encoded))
        return await self._submit_watched(item, msg, watched, seat, received)

    def background(self, coroutine) -> None:
        """Run a write to LLM_STATE beside the request path (cancelled at stop)."""
        task = asyncio.create_task(coroutine)
        self.state_writes.add(task)
        task.add_done_callback(self.state_writes.discard)

    async def persist(self, item: WorkItem, encoded: bytes) -> None:
        """Write a request's state to LLM_STATE and note its revision in the ledger; a request
        not watched any more by then (refused, or ended) has its state ended again. Tried
        again for STATE_WRITE_TRIES while JetStream does not answer (a stream electing a
        leader: a cluster starting, a node dead) and the request is still watched here. Not
        written: the request runs, but only this admission can hand it on."""
        for attempt in range(STATE_WRITE_TRIES):
            try:
                revision = await self.states.create(item.key, encoded, item.attempt,
                                                    item.durable, item.arrival_time)
                break
            except Exception as exc:
                kept = self.ledger.get(item.key, item.durable)
                if attempt == STATE_WRITE_TRIES - 1 or kept is None or kept.item is not encoded:
                    self.counts["state_errors"] += 1
                    log.warning("request state not written", tenant=item.tenant,
                                request_id=item.request_id, error=repr(exc))
                    return
                await asyncio.sleep(min(0.25 * (attempt + 1), 1.0))
        if revision is None:
            return
        kept = self.ledger.get(item.key, item.durable)
        if kept is not None and kept.item is encoded:
            kept.revision = revision
        else:  # refused by priority, or already answered: its state goes too
            await self.end_state(item.key, item.durable, revision, item.arrival_time)

    async def _submit_watched(self, item: WorkItem, msg, watched: bool, seat: list[str] | None,
                              received: float | None) -> Error | None:
        if watched and seat is not None:
            self.release(seat)
        if watched and self.cancels.take(item.tenant, item.request_id,
                                         item.arrival_time if received is None else received):
            await self.forward_cancel(item.key)  # cancelled since it arrived here
        try:
            error = await self.to_priority(item)
        except NatsTimeoutError:
            if watched:
                # Priority may have queued it and answered late (a starved event loop): an
                # Error now would be a second answer. The lease decides, counted from now: a
                # request nobody reports holding is handed on to priority again.
                log.warning("priority answered late; the request stays watched",
                            tenant=item.tenant, request_id=item.request_id)
                self.ledger.submitted(item.key, durable=item.durable)
                self.counts["submits_timed_out"] += 1
                return None
            error = Error(request_id=item.request_id, code="overloaded",
                          message="the priority service is not answering (TimeoutError)")
        except BaseException:
            if watched:
                self.unwatch(item.key, item.durable)
            raise
        if watched:
            if error is None:
                self.ledger.submitted(item.key, durable=item.durable)
            else:
                self.unwatch(item.key, item.durable)
        return error

    def unwatch(self, key: RequestKey, durable: bool) -> None:
        """Not watched after all (priority did not take it): its state, if written, ends too
        (if not written yet, `persist` ends it when it lands)."""
        held = self.ledger.unwatch(key, durable)
        if held is not None and held.revision is not None:
            self.background(self.end_state(key, durable, held.revision, held.arrival))

    def read_metrics(self) -> list[Reading]:
        counts = self.counts
        return [Reading("counter", "durable_redeliveries", "Durable requests handed back to "
                        "JetStream (to run from the start) after their holder went silent",
                        counts["durable_redelivered"]),
                Reading("counter", "handed_on", "Requests handed on to another executor (from "
                        "their checkpoints) after their holder went silent",
                        counts["durable_handed_on"] + counts["generates_handed_on"]),
                Reading("gauge", "durable_held", "Durable requests admitted and not yet finished",
                        len(self.ledger.held))]

    def count_error(self, code: str, tenant: str) -> None:
        self.counts["rejected"] += 1
        self.errors_by_code[code] = self.errors_by_code.get(code, 0) + 1
        # A tenant name that is not valid is not a label: clients could make any number.
        REJECTED.labels(self.tenant_label(tenant) if TENANT_PATTERN.fullmatch(tenant) else "",
                        code).inc()

    # ---------------------------------------------------------------------- request / reply

    async def on_backpressure(self, msg) -> None:
        try:
            self.backpressure = _backpressure.decode(msg.data).tenants
        except msgspec.DecodeError:
            log.warning("undecodable backpressure report ignored")
            return
        self.backpressure_at = time.monotonic()

    def over_concurrency(self, tenant: str, payload: bytes) -> Error | None:
        """The `rate_limited` Error for a request whose tenant is at its concurrency quota as it
        arrives (requests watched, and being admitted), or None. Decided before any other work,
        as `admit` would after decoding and tracing it: a tenant that keeps sending past its
        quota costs admission a lookup per request, and its refusals do not wait in the intake."""
        limit = self.quotas.of(tenant).max_concurrent_requests
        if limit is None:
            return None
        busy = self.ledger.watching(tenant)[0] + self.in_admission.get(tenant, 0)
        if busy < limit or _decode_head(payload) is None:  # not valid: the checks name why
            return None
        return Error(request_id=None, code="rate_limited", retry_after_ms=QUOTA_RETRY_MS,
                     message=f"tenant {tenant!r} has {busy} requests running or waiting, its "
                             f"quota (max_concurrent_requests {limit})")

    def refused_at_once(self, tenant: str, payload: bytes) -> Error | None:
        """The `overloaded` Error for a request priority's full queue would refuse (its tenant
        holds the most of the queue, and it is of no higher class than what it would displace),
        or None. Decided before any other work, so a tenant's flood costs admission little and
        what other tenants send is not held up behind it in admission's own backlog."""
        ceiling = self.backpressure.get(tenant)
        if ceiling is None:
            return None
        interval = self.config.distributed.heartbeat_interval_s
        if time.monotonic() - self.backpressure_at > 3 * interval:
            self.backpressure = {}  # not renewed: priority's queue has room, or priority is gone
            return None
        head = _decode_head(payload)
        if head is None:
            return None  # not valid: the full checks answer it, naming the field
        if head.priority > ceiling:
            return None
        return Error(request_id=head.request_id, code="overloaded",
                     message=f"the waiting queue is full and tenant {tenant!r} holds the most of "
                             f"it: a request of priority {head.priority} would only take the "
                             f"place of one of its own; retry later")

    async def on_generate(self, request: Request) -> None:
        """Only queued here, in its tenant's line of the intake (or refused at once): the
        subscription is read as fast as requests come, and the backlog, when admission cannot
        keep up, forms in the flooding tenant's line rather than in front of everyone."""
        # The message itself: its reply subject (a client inbox: MicroService refused any
        # other) is where every delta and the final answer go, from whichever service makes
        # them, and nats-py's micro Request does not expose it.
        msg = request._msg
        tenant = self.subjects.tenant_of(msg.subject)
        if not msg.reply:  # nobody to answer: not run (nor counted against any quota)
            self.counts["no_reply"] += 1
            return
        if not TENANT_PATTERN.fullmatch(tenant):  # not a line of its own in the intake
            await self.refuse(msg, tenant, Error(
                request_id=None, code="invalid_request",
                message=f"tenant {tenant!r} (the subject's last token) must match "
                        f"[A-Za-z0-9_-]{{1,64}}"))
            return
        if (error := self.over_concurrency(tenant, msg.data)) is not None:
            self.counts["refused_at_once"] += 1
            await self.refuse(msg, tenant, error)
            return
        if self.backpressure and (error := self.refused_at_once(tenant, msg.data)) is not None:
            self.counts["refused_at_once"] += 1
            await self.refuse(msg, tenant, error)
            return
        for _, refused in self.intake.put(tenant, (time.time(), msg)):
            self.counts["refused_at_once"] += 1
            await self.refuse(refused, self.subjects.tenant_of(refused.subject), Error(
                request_id=None, code="overloaded",
                message=f"admission's intake is full ({INTAKE_CAPACITY} requests or "
                        f"{INTAKE_MAX_BYTES >> 20} MiB waiting to be admitted) and this "
                        f"request's tenant has the most of them; retry later"))

    async def admit_loop(self) -> None:
        """One worker: the intake's next request (tenants in turn), admitted to its answer."""
        while True:
            _, (received, msg) = await self.intake.get()
            self.admitting += 1
            try:
                await self.generate(msg, received)
            except Exception as exc:  # generate answers its own errors; this is a bug
                log.error("generate failed", error=repr(exc))
            finally:
                self.admitting -= 1

    def refuse_reply(self, tenant: str, reply: str) -> None:
        """A request whose reply subject is not a client inbox gets nothing, not even an Error
        (that is what would reach the subject): counted, and logged once per tenant."""
        self.counts["reply_refused"] += 1
        if tenant not in self.reply_refused_logged and len(self.reply_refused_logged) < 1000:
            self.reply_refused_logged.add(tenant)
            log.warning("reply subject refused", tenant=tenant[:64], reply=reply[:128],
                        inbox_prefix=self.inbox_prefix)

    async def refuse(self, msg, tenant: str, error: Error) -> None:
        """Answer a request with `error` before any other work (and end its stream)."""
        head = _decode_head(msg.data)
        request_id, stream = (head.request_id, head.stream) if head else _peek(msg.data)
        self.count_error(error.code, tenant)
        await self.answer_error(msg, msgspec.structs.replace(error, request_id=request_id), stream)

    async def answer_error(self, msg, error: Error, stream: bool) -> None:
        """Send a generate request's Error to its reply subject (and end its stream)."""
        if not msg.reply:
            return
        try:
            await self.outbox.reply(msg.reply, error, stream)
        except Exception as exc:  # the connection is failing: nothing else to tell it by
            log.warning("could not answer a request's error", error=repr(exc))

    async def generate(self, msg, received: float) -> None:
        tenant = self.subjects.tenant_of(msg.subject)
        with self.tracer.start_as_current_span(
                "admission", context=context_from(msg.headers), kind=SpanKind.SERVER,
                attributes={"tenant": tenant}) as span:
            try:
                with self.being_admitted(tenant) as seat:
                    item = await self.admit(tenant, msg.data, reply_to=msg.reply,
                                            trace=carrier_of(span))
                    span.set_attributes({"request_id": item.request_id,
                                         "prompt_tokens": item.num_prompt_tokens})
                    error = await self.submit_watched(item, seat=seat, received=received)
            except ProtocolError as exc:
                error = exc.to_error(_peek(msg.data)[0])
            except Exception as exc:  # a bug, not bad input: still an answer, never a hang
                log.exception("admission failed")
                error = Error(request_id=_peek(msg.data)[0], code="internal",
                              message=f"admission failed: {exc!r}")
            if error is None:
                self.counts["admitted"] += 1
                ADMITTED.labels(self.tenant_label(tenant), "false").inc()
                return
            span.set_attribute("error", error.code)
            self.count_error(error.code, tenant)
            await self.answer_error(msg, error, stream=_peek(msg.data)[1])

    # ------------------------------------------------------------------------ durable path

    async def durable_loop(self, delay_s: float = 0.0) -> None:
        await asyncio.sleep(delay_s)
        while True:
            try:
                messages = await self.consumer.fetch(DURABLE_FETCH_BATCH, timeout=1.0)
            except (NatsTimeoutError, TimeoutError):  # nothing came: the normal idle case
                continue
            except Exception as exc:  # reconnecting: try again shortly
                log.warning("durable fetch failed", error=repr(exc))
                await asyncio.sleep(0.5)
                continue
            for msg in messages:
                try:
                    await self.on_durable(msg)
                except Exception as exc:
                    await self.durable_failed(msg, exc)

    async def durable_failed(self, msg, exc: Exception) -> None:
        """A bug, not bad input: retry a few times, then store an `internal` Error as its result."""
        key = self.subjects.durable_key(msg.subject) or RequestKey("", "")
        tenant, request_id = key
        failures = self.failures[key] = self.failures.get(key, 0) + 1
        log.exception("durable request failed", subject=msg.subject, failures=failures)
        try:
            if failures < MAX_FAILURES or not request_id:
                await msg.nak(delay=1.0)
                return
            error = Error(request_id=request_id, code="internal",
                          message=f"admission failed {failures} times: {exc!r}")
            await self.outbox.store_result(tenant, request_id, error)
            self.unwatch(key, durable=True)
            del self.failures[key]
            await msg.ack()
        except Exception:
            log.exception("could not settle a failed durable request")

    async def on_durable(self, msg) -> None:
        headers = msg.headers or {}
        key = self.subjects.durable_key(msg.subject)
        if key is None:
            await self.refuse_durable(msg)
            return
        tenant, claimed_id = key
        if _not_a_request(msg.data):
            # JetStream answers a publish on whatever reply subject its publisher names, and
            # this stream captures that answer on the subject, as any message: another
            # tenant's PubAck, with its reply on llm.requests.<tenant>.<id>, stored here. It
            # asked for nothing; stored as that id's result (an Error) it would take the id
            # from its tenant. Dropped, with no result.
            self.counts["durable_not_requests"] += 1
            await msg.term()
            return
        if self.ledger.redelivered(key, msg):  # still running: the new handle replaces the old
            return
        delayed = self.delay(key, False)  # it is here again: settled below, or put back
        if await self.has_result(tenant, claimed_id):
            self.counts["redelivered_with_result"] += 1
            await msg.ack()
            return
        # Its state is in LLM_STATE (an admission that died or stalled admitted it): taken
        # over with its admitted copy, attempt and checkpoint, to be handed on from there if
        # its holder is gone too.
        if msg.metadata.num_delivered > 1 and (taken := await self.take(key)) is not None:
            self.watch_taken(key, taken, msg)
            return
        if self.ledger.adopt(key, msg):  # a service still reports it: not run a second time
            self.counts["durable_adopted"] += 1
            return
        # The share is a newcomer's test: a request accepted before (delivered again after a
        # restart or a hand-back) is not refused now for what came after it.
        if (not delayed and msg.metadata.num_delivered == 1
                and (share := self.over_durable_share(tenant)) is not None):
            self.count_error("rate_limited", tenant)
            await self.outbox.store_result(tenant, claimed_id, Error(
                request_id=claimed_id, code="rate_limited", message=share,
                retry_after_ms=QUOTA_RETRY_MS), retryable=True)
            await msg.ack()  # its place in LLM_REQUESTS is free again
            return
        with self.tracer.start_as_current_span(
                "admission", context=context_from(headers), kind=SpanKind.SERVER,
                attributes={"tenant": tenant, "request_id": claimed_id, "durable": True}) as span, \
                self.being_admitted(tenant) as seat:
            try:
                if "Nats-Msg-Id" in headers:
                    raise ProtocolError("invalid_request", "header Nats-Msg-Id is refused on a "
                                        "durable submission: JetStream deduplicates it across "
                                        "all tenants, so another tenant could suppress the "
                                        "request; its subject is its key (docs/protocol.md)")
                # Admitted again after a redelivery (an admission restarted, or handed it back),
                # it keeps the seed of its JetStream message and takes attempts above every
                # earlier delivery's: a stalled holder of one of those is revoked when it
                # reports, and its checkpoints are never spliced into this run.
                item = await self.admit(
                    tenant, msg.data, durable_id=claimed_id,
                    seed=durable_seed(tenant, claimed_id, msg.metadata.sequence.stream),
                    attempt=(msg.metadata.num_delivered - 1) * ATTEMPTS_PER_DELIVERY,
                    trace=carrier_of(span))
            except ProtocolError as exc:
                span.set_attribute("error", exc.code)
                if exc.retry_after_s is not None:  # rate limited: a durable request waits its turn
                    self.counts["durable_delayed"] += 1
                    self.delay(key, True)
                    await msg.nak(delay=exc.retry_after_s)
                    return
                self.count_error(exc.code, tenant)
                error = exc.to_error(claimed_id)
                await self.outbox.store_result(tenant, claimed_id, error, carrier_of(span))
                self.failures.pop(key, None)
                await msg.ack()
                return
            # Submitted when JetStream stored it: a cancel since then applies.
            error = await self.submit_watched(item, msg, seat,
                                              received=msg.metadata.timestamp.timestamp())
        if error is not None:  # queue full or priority down: durable, so retry later
            self.delay(key, True)
            await msg.nak(delay=1.0)
            return
        self.counts["durable_admitted"] += 1
        self.failures.pop(key, None)
        ADMITTED.labels(self.tenant_label(tenant), "true").inc()

    @contextlib.contextmanager
    def being_admitted(self, tenant: str):
        """A request of `tenant` is being admitted: until it is watched (`submit_watched` then
        releases its seat) or refused, it counts toward its tenant's concurrency like the
        requests watched (many are admitted at once)."""
        self.in_admission[tenant] = self.in_admission.get(tenant, 0) + 1
        seat = [tenant]
        try:
            yield seat
        finally:
            self.release(seat)

    def release(self, seat: list[str]) -> None:
        """Give up a seat of `being_admitted` (once: later calls do nothing)."""
        if seat:
            tenant = seat.pop()
            left = self.in_admission[tenant] - 1
            if left:
                self.in_admission[tenant] = left
            else:
                del self.in_admission[tenant]

    def delay(self, key: RequestKey, put_back: bool) -> bool:
        """Note a durable request put back in LLM_REQUESTS for later (`put_back`), or taken up
        again; whether it had been put back. Such requests hold their place in the durable
        backlog as much as admitted ones do."""
        ids = self.delayed.get(key.tenant)
        was = ids is not None and ids.pop(key.request_id, None) is not None
        if put_back:
            self.delayed.setdefault(key.tenant, {})[key.request_id] = time.monotonic()
        elif ids is not None and not ids:
            del self.delayed[key.tenant]
        return was

    def over_durable_share(self, tenant: str) -> str | None:
        """Why a new durable request of `tenant` is refused by its share of the durable backlog
        (its durable requests held here or put back for later), if it is."""
        quota = self.quotas.of(tenant)
        most = share_limit(quota.durable_share, self.durable_backlog)
        if most is None:  # the whole backlog: JetStream's own limit
            return None
        ids = self.delayed.get(tenant, {})
        # One put back long ago went to another admission (or was removed): not counted.
        for request_id in [i for i, at in ids.items() if time.monotonic() - at > DELAYED_FOR_S]:
            del ids[request_id]
        backlog = self.ledger.watching(tenant)[1] + len(ids)
        if backlog < most:
            return None
        return (f"tenant {tenant!r} has {backlog} durable requests admitted or waiting their "
                f"turn, its share of the durable backlog (quotas durable_share "
                f"{quota.durable_share:g} of max_pending_requests {self.durable_backlog})")

    async def refuse_durable(self, msg) -> None:
        """A submission whose subject names no durable request: protocol v1's
        `llm.requests.<tenant>`, answered with an Error under the id it carries, or one with no
        valid tenant or id, which no result subject can name: dropped (and logged)."""
        tokens = msg.subject.split(".")
        tenant = tokens[2] if len(tokens) > 2 else ""
        request_id = (msg.headers or {}).get("Nats-Msg-Id") or _peek(msg.data)[0]
        self.count_error("invalid_request", tenant)
        if (len(tokens) == 3 and TENANT_PATTERN.fullmatch(tenant)
                and request_id and DURABLE_ID_PATTERN.fullmatch(request_id)):
            await self.outbox.store_result(tenant, request_id, Error(
                request_id=request_id, code="invalid_request", message=(
                    f"durable requests are published on "
                    f"{self.subjects.requests(tenant, request_id)} (protocol v2; "
                    f"{msg.subject} was v1's): the subject is the request's key, so one "
                    f"tenant's ids never collide with another's")), retryable=True)
            await msg.ack()
            return
        log.warning("durable request without a valid tenant or request id dropped",
                    subject=msg.subject[:256], request_id=request_id)
        await msg.term()

    async def has_result(self, tenant: str, request_id: str) -> bool:
        """Whether the request has its final result stored (a retryable refusal, or a message
        that is no result, does not count: shared.subjects.final_result)."""
        try:
            last = await self.js.get_last_msg(RESULTS_STREAM,
                                              self.subjects.results(tenant, request_id))
        except NotFoundError:
            return False
        return final_result(last.headers, tenant, request_id)

    # ------------------------------------------------------------------------------ cancels

    async def on_cancel(self, msg) -> None:
        """A client's cancel goes on to priority and the executors only for a request in
        flight; any other is remembered here for one being admitted meanwhile (passed on when
        it is watched: the cancel came after it arrived here). So a flood of
        cancels (on random ids or tenant names) costs admission a dictionary entry each, and
        costs nothing where the model runs."""
        tenant = self.subjects.tenant_of(msg.subject)
        try:
            if not TENANT_PATTERN.fullmatch(tenant):
                raise ProtocolError("invalid_request", "not a tenant name")
            request_id = decode_cancel(msg.data).request_id
        except ProtocolError:  # fire and forget: nobody to tell
            self.counts["cancels_malformed"] += 1
            return
        key = RequestKey(tenant, request_id)
        if self.ledger.watches(key):
            await self.forward_cancel(key)
            return
        # Perhaps being admitted here right now: passed on when it is handed to priority.
        self.counts["cancels_remembered"] += 1
        self.cancels.add(tenant, request_id)
        if self.ledger.knows(key):  # in flight, watched elsewhere (or this ledger is too young)
            await self.forward_cancel(key)

    async def forward_cancel(self, key: RequestKey) -> None:
        """To priority and every executor, stamped now on admission's clock (the one that
        stamped the request's arrival_time: they compare the two)."""
        self.counts["cancels_forwarded"] += 1
        cancel = CancelRequest(*key, time.time())
        await _quietly(self.nc.publish(self.subjects.cancels, encode(cancel)))

    async def on_done(self, msg) -> None:
        done = _done.decode(msg.data)
        watched = None if done.durable else self.ledger.get(done.key, False)
        if watched is not None and watched.arrival not in (None, done.arrival_time):
            return  # an earlier generate of the id (a late attempt of it): not this one's end
        held = self.ledger.done(done.key, done.durable)
        if held is not None:  # (else another admission watches it)
            await self.settle(done.key, done.durable, held, done.arrival_time)

    async def settle(self, key: RequestKey, durable: bool, held: Watched,
                     arrival_time: float) -> None:
        """A request watched here was answered: its state ends, and a durable one's message
        is acked (its result is stored)."""
        if held.revision is not None:
            self.background(self.end_state(key, durable, held.revision, arrival_time))
        if durable and held.msg is not None:
            await _quietly(held.msg.ack())
            self.counts["durable_acked"] += 1

    async def on_ended(self, ended: Ended) -> None:
        """A holder says it answered this request (lately): as its Done would, it ends the
        watch here if its Done was lost; and it is remembered, so a take-over does not run
        it again."""
        key = ended.key
        if (key, ended.arrival_time) in self.ended:
            return  # heard before (each is named in several reports)
        self.ended[(key, ended.arrival_time)] = self.ledger.clock
        for durable in (False, True):
            held = self.ledger.get(key, durable)
            if held is None or held.arrival != ended.arrival_time:
                continue
            self.ledger.done(key, durable)
            self.counts["ended_by_report"] += 1
            await self.settle(key, durable, held, ended.arrival_time)

    def forget_ended(self) -> None:
        """Forget requests reported answered more than ENDED_KEPT_LEASES leases ago."""
        horizon = self.ledger.clock - ENDED_KEPT_LEASES * self.ledger.lease_s
        while self.ended and next(iter(self.ended.values())) < horizon:
            del self.ended[next(iter(self.ended))]

    async def end_state(self, key: RequestKey, durable: bool, revision: int,
                        arrival_time: float) -> None:
        """Tombstone the state of a request that ended, acked and retried: the tombstone its
        answerer published (without an ack) may have been lost in a failover, and a state
        left behind would be taken for a lost request and run again. A tombstone there already,
        or another admission's write, ends the attempt."""
        for attempt in range(5):
            try:
                await self.states.end(key, durable, revision, arrival_time)
                return
            except Exception as exc:
                if attempt == 4:
                    self.counts["state_errors"] += 1
                    log.warning("request state not ended", tenant=key.tenant,
                                request_id=key.request_id, error=repr(exc))
                    return
                await asyncio.sleep(0.5 * (attempt + 1))

    # -------------------------------------------------------------- taking requests over

    async def take(self, key: RequestKey | None = None, leave: frozenset[str] = frozenset(),
                   subject: str | None = None) -> Taken | None:
        """The request's state (a durable one's by key, or any by its state's subject), now
        owned here; None when it has none (ended, never written), its owner is in `leave`, or
        LLM_STATE cannot be reached."""
        try:
            return await self.states.take(key, leave, subject)
        except Exception as exc:
            self.counts["state_errors"] += 1
            log.warning("request state not read", key=str(key or subject), error=repr(exc))
            return None

    def watch_taken(self, key: RequestKey, taken: Taken, msg=None) -> bool:
        """Watch a request taken over. Once this ledger has heard a lease of reports, one that
        no holder reported meanwhile is lost now (handed on at the next tick); a young ledger
        waits a lease for them."""
        state = taken.state
        arrival = state.arrival_time
        if (key, arrival) in self.ended:  # answered; its end was lost
            self.background(self.end_state(key, state.durable, taken.revision,
                                           state.arrival_time))
            return False
        since = self.ledger.clock if self.ledger.young else -math.inf
        watched = Watched(msg, since, state.item, list(taken.token_ids), state.attempt,
                          revision=taken.revision, checkpointed=len(taken.token_ids),
                          arrival=arrival)
        if not self.ledger.claim(key, watched, state.durable):
            return False
        self.counts["taken_over"] += 1
        log.info("request taken over", tenant=key.tenant, request_id=key.request_id,
                 attempt=state.attempt, outputs=len(taken.token_ids), durable=state.durable)
        return True

    async def on_peer(self, msg) -> None:
        owner = msg.data.decode(errors="replace")
        if owner != self.owner:
            self.peers[owner] = self.ledger.clock

    async def take_over_orphans(self) -> None:
        """Every request in LLM_STATE whose owner is neither this admission nor one heard
        within a lease is taken over (compare-and-set: of several admissions trying at once,
        one gets each)."""
        leave = frozenset((self.owner, *self.peers))
        try:
            owners = await self.states.owners()
            self.rescan |= not self.states.complete
        except Exception as exc:
            self.counts["state_errors"] += 1
            self.rescan = True  # at the next tick, not in 12 leases
            log.warning("request states not scanned", error=repr(exc))
            return
        for subject, owner in owners:
            # (Peers heard since the scan began are left alone too: one just started.)
            leave = frozenset((self.owner, *self.peers))
            if owner in leave:
                continue
            taken = await self.take(leave=leave, subject=subject)
            if taken is not None:
                self.watch_taken(RequestKey(taken.state.tenant, taken.state.request_id), taken)

    def look_after_peers(self) -> None:
        """Say this admission is alive; forget peers silent for a lease, and scan LLM_STATE
        for what they owned (also once this ledger is a lease old, and every few leases)."""
        clock, lease = self.ledger.clock, self.ledger.lease_s
        died = [p for p, heard in self.peers.items() if clock - heard > lease]
        for peer in died:
            del self.peers[peer]
            log.warning("another admission fell silent; taking over its requests", peer=peer)
        # (A death noticed while a scan runs is scanned for again: that scan left it alone.)
        self.rescan |= bool(died)
        due = not self.ledger.young and (
            self.rescan or self.scanned_at is None
            or clock - self.scanned_at >= SCAN_EVERY_LEASES * lease)
        if due and (self.scan_task is None or self.scan_task.done()):
            self.scanned_at, self.rescan = clock, False
            self.scan_task = asyncio.create_task(self.take_over_orphans(), name="take-over")

    async def say_alive(self) -> None:
        """Every heartbeat interval, on its own task: a tick held up by slow JetStream writes
        must not look like this admission's death to the others."""
        interval = self.config.distributed.heartbeat_interval_s
        while True:
            await _quietly(self.nc.publish(self.subjects.admissions, self.owner.encode()))
            await asyncio.sleep(interval)

    async def save_checkpoints(self) -> None:
        """Each watched request's outputs, when its checkpoints brought new ones."""
        for durable, table in ((True, self.ledger.held), (False, self.ledger.generates)):
            for key, watched in list(table.items()):
                if watched.revision is not None and len(watched.tokens) != watched.checkpointed:
                    watched.checkpointed = len(watched.tokens)
                    await _quietly(self.states.checkpoint(key, durable, watched.arrival,
                                                          watched.attempt, watched.tokens))

    async def write_over_stale(self, state: RequestState) -> int | None:
        """`RequestStates.write_over_stale`, or None when LLM_STATE cannot be reached."""
        try:
            return await self.states.write_over_stale(state)
        except Exception as exc:
            self.counts["state_errors"] += 1
            log.warning("request state not read", error=repr(exc))
            return None

    async def let_go(self, key: RequestKey, held: Watched, durable: bool) -> None:
        """Its state moved on: another admission took it over, or it ended (its Done was
        lost). Not watched here any more; a durable one that ended is acked."""
        self.counts["let_go"] += 1
        if self.ledger.get(key, durable) is held:
            self.ledger.unwatch(key, durable)
        try:
            stored = held.msg is not None and await self.has_result(*key)
        except Exception as exc:  # JetStream away: its redelivery settles it
            log.warning("could not look for a result", error=repr(exc))
            stored = False
        if stored:
            await _quietly(held.msg.ack())

    async def on_holding(self, msg) -> None:
        holding = _holding.decode(msg.data)
        self.ledger.reported(holding.requests)
        for ended in holding.ended:
            await self.on_ended(ended)
        for progress in holding.progress:
            if self.ledger.checkpoint(RequestKey(progress.tenant, progress.request_id),
                                      progress.attempt, progress.index, progress.token_ids):
                await self.revoke(RequestKey(progress.tenant, progress.request_id),
                                  progress.attempt)

    async def revoke(self, key: RequestKey, attempt: int) -> None:
        await _quietly(self.nc.publish(self.subjects.revoke, encode(Revoke(*key, attempt))))

    async def hand_on(self, key: RequestKey, held: Watched) -> bool:
        """A request whose holder is gone goes back to priority's queue with the outputs its
        checkpoints reported, as the next attempt (a durable one's JetStream message stays
        held). False when priority did not take it (tried again after another lease)."""
        tokens = held.tokens if self.config.distributed.resume_from_checkpoints else []
        item = msgspec.structs.replace(_item.decode(held.item), attempt=held.attempt + 1,
                                       resume_token_ids=list(tokens))
        if held.revision is not None:
            # Compare-and-set first: of two admissions that both took it for lost, one hands
            # it on; and one that ended meanwhile (its Done lost) is not run again.
            try:
                state = RequestState(key.tenant, key.request_id, self.owner, item.attempt,
                                     item.durable, item.arrival_time, held.item)
                revision = await self.states.write(state, held.revision)
            except Exception as exc:  # LLM_STATE away: handed on all the same, unkept
                self.counts["state_errors"] += 1
                log.warning("request state not written", tenant=key.tenant,
                            request_id=key.request_id, error=repr(exc))
                revision = None
            else:
                if revision is None:  # (or an earlier request of this id ended over it)
                    revision = await self.write_over_stale(state)
                if revision is None:
                    await self.let_go(key, held, item.durable)
                    return False
                if self.ledger.get(key, item.durable) is not held:  # it ended meanwhile
                    self.background(self.end_state(key, item.durable, revision,
                                                   item.arrival_time))
                    return False
            held.revision, held.checkpointed = revision, -1  # its checkpoint follows
        try:
            error = await self.to_priority(item)
        except Exception as exc:  # a timeout too: not taken (if priority did, it reports it)
            log.warning("could not hand a request on", tenant=key.tenant,
                        request_id=key.request_id, error=repr(exc))
            return False
        if error is not None:
            return False
        self.ledger.handed_on(held)
        self.counts["durable_handed_on" if item.durable else "generates_handed_on"] += 1
        self.counts["resumed_tokens"] += len(item.resume_token_ids)
        log.warning(f"{'durable request' if item.durable else 'generate'} handed on from a "
                    f"lost holder", tenant=key.tenant, request_id=key.request_id,
                    attempt=held.attempt, resume_from=len(tokens))
        await self.revoke(key, held.attempt - 1)
        return True

    async def keep_alive_loop(self) -> None:
        """In-progress acks for every held request, well inside ack_wait, and the ledger's lease
        kept (watch_over)."""
        interval = self.config.distributed.heartbeat_interval_s
        progress_every = self.config.nats.ack_wait_s / 3
        last_progress = last_tick = time.monotonic()
        while True:
            await asyncio.sleep(interval)
            tick = time.monotonic()
            self.ledger.tick(tick - last_tick)
            last_tick = tick
            try:
                await self.watch_over()
                await self.save_checkpoints()
                self.look_after_peers()
                self.forget_ended()
                if tick - last_progress >= progress_every:
                    last_progress = tick
                    for held in list(self.ledger.held.values()):
                        if held.msg is not None:  # (one taken over waits for its redelivery)
                            await _quietly(held.msg.in_progress())
            except Exception:  # a bug must not end failover and in-progress acks for good
                log.exception("keep-alive failed; continuing")

    async def watch_over(self) -> None:
        """Hand on every watched request no service has reported for a lease, or, when this
        admission has no copy of it (it adopted it after a restart), hand it back to JetStream
        to run from the start. Its Done may arrive while this awaits: then it is left alone."""
        lost = self.ledger.lost()
        await asyncio.gather(*(self.hand_on(key, held) for key, held in lost
                               if held.item is not None))
        for key, held in lost:
            if held.item is None and held.msg is not None and self.ledger.give_back(key, held):
                log.warning("durable request lost with its holder; redelivering",
                            tenant=key.tenant, request_id=key.request_id)
                self.counts["durable_redelivered"] += 1
                await _quietly(held.msg.nak())


# A durable request's attempts in one delivery (hand-ons by one admission) stay below this.
ATTEMPTS_PER_DELIVERY = 1 << 20


def durable_seed(tenant: str, request_id: str, stream_sequence: int) -> int:
    """The seed of a durable request whose client gave none: the same for every delivery of
    its JetStream message (so every admission that admits it draws the same tokens), another
    for a later submission under the same id."""
    digest = hashlib.blake2b(f"{tenant}\0{request_id}\0{stream_sequence}".encode(),
                             digest_size=8).digest()
    return int.from_bytes(digest, "big") >> 1  # 63 bits


async def _quietly(ack) -> None:
    try:
        await ack
    except Exception as exc:  # reconnecting: an ack is redelivered, a notice lost
        log.warning("ack or notice failed", error=repr(exc))


class _Head(msgspec.Struct):
    """What a refusal before validation needs of a request: its id, whether it streams, and
    its class (msgspec skips the rest without building it)."""

    request_id: Annotated[str, msgspec.Meta(max_length=128)] | None = None
    stream: bool = False
    priority: Annotated[int, msgspec.Meta(ge=0, le=10)] = 5


_head = msgspec.json.Decoder(_Head)


def _decode_head(payload: bytes) -> _Head | None:
    """The request's head, or None when it is not valid (the full checks then name why)."""
    try:
        check_nesting(payload)
        return _head.decode(payload)
    except (ProtocolError, msgspec.DecodeError):
        return None


def check_quota(request: GenerateRequest, quota: TenantQuota, tenant: str) -> None:
    """The limits of shape a tenant's quota sets (before any tokenizing): `invalid_request`
    naming the key, since the same request would never fit."""
    def refuse(what: str, key: str, limit: int) -> None:
        raise ProtocolError("invalid_request", f"{what}, over the quota of tenant {tenant!r} "
                            f"({key} {limit})")

    if quota.max_tokens is not None and request.max_tokens > quota.max_tokens:
        refuse(f"`max_tokens` is {request.max_tokens}", "max_tokens", quota.max_tokens)
    stops = len(request.stop) + len(request.stop_token_ids)
    if stops > quota.max_stop:
        refuse(f"`stop` and `stop_token_ids` hold {stops}", "max_stop", quota.max_stop)
    longest = max(map(len, request.stop), default=0)
    if longest > quota.max_stop_length:
        refuse(f"a `stop` string is {longest} characters", "max_stop_length",
               quota.max_stop_length)


def _not_a_request(payload: bytes) -> bool:
    """Empty, or a JetStream API answer: an object whose `stream` is a name (a PubAck's; a
    request's `stream` is true or false)."""
    if not payload.strip():
        return True
    if b'"stream"' not in payload:
        return False
    try:
        check_nesting(payload)
        value = msgspec.json.decode(payload)
    except (ProtocolError, msgspec.DecodeError):
        return False
    return isinstance(value, dict) and isinstance(value.get("stream"), str)


def _peek(payload: bytes) -> tuple[str | None, bool]:
    """`request_id` and `stream` of a payload that may not validate, so its Error can still
    name the request and end a stream with the sentinel."""
    try:
        check_nesting(payload)
        value = msgspec.json.decode(payload)
    except (ProtocolError, msgspec.DecodeError):
        return None, False
    if not isinstance(value, dict):
        return None, False
    request_id = value.get("request_id")
    if not (isinstance(request_id, str) and len(request_id) <= 128):
        request_id = None
    return request_id, value.get("stream") is True


main = service_main("admission", Admission)
