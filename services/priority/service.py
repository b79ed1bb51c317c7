"""The priority service: keeps the global waiting queue; the batcher pulls the best requests
(`llm.internal.priority.next`) when executors have room, so order is decided at the last moment,
with current scores. Executors' heartbeats bring their load, and every request's Done its
served tokens and TTFT (for fairness, the length predictor and class SLO feedback); a request whose deadline passes while it
waits ends here with `deadline_exceeded` instead of taking a slot."""

from __future__ import annotations

import asyncio
import time

import msgspec
import structlog
from nats.js.errors import NotFoundError
from nats.micro import Request

from services.priority.request_level import MISSED_MS, RequestScheduler
from shared.keys import RequestKey
from shared.bus import (
    ended_window_s,
    Lapses,
    Outbox,
    add_micro_service,
    cancel_all,
    cancelled_completion,
    chunked,
    every,
    payload_budget,
    report_holding,
    service_main,
    wait_event,
    while_connected,
)
from shared.cancels import RecentCancels
from shared.config import JetserveConfig, share_limit
from shared.messages import (
    Backpressure,
    CancelRequest,
    Done,
    Heartbeat,
    NextReply,
    NextRequest,
    Revoke,
    SubmitReply,
    WorkItem,
    decoder,
    encode,
    tenant_entry_bytes,
)
from shared.metrics import (
    Reading,
    TTFT_BUCKETS,
    StatsCollector,
    TenantLabels,
    histogram,
)
from shared.protocol import QUOTA_RETRY_MS, Completion, Error
from shared.request_state import STATE_STREAM, fairness_subject
from shared.subjects import Subjects
from shared.telemetry import Span, carrier_of, context_from

log = structlog.get_logger()

_item = decoder(WorkItem)
_next = decoder(NextRequest)
_heartbeat = decoder(Heartbeat)
_done = decoder(Done)
_cancel = decoder(CancelRequest)
_revoke = decoder(Revoke)
EXPIRY_CHECK_S = 0.05  # how late a waiting request may learn that its deadline passed
BACKPRESSURE_CHECK_S = 0.1  # how often a full queue's refused tenants are looked at
# The tenant counters saved in LLM_STATE are loaded at start if no older than this (beyond, the
# tenants active then are not those active now).
FAIRNESS_SNAPSHOT_MAX_AGE_S = 600.0


class FairnessSnapshot(msgspec.Struct, array_like=True):
    saved_at: float  # wall clock
    counters: dict[str, float]
    highest: float


QUEUE_WAIT = histogram("priority_queue_wait_seconds",
                       "Time in priority's waiting queue, from admission to dispatch",
                       ("priority",), TTFT_BUCKETS)


class PriorityService:
    def __init__(self, config: JetserveConfig, nc, js, tracer):
        self.subjects = Subjects(config.nats.prefix)
        self.nc, self.js, self.tracer = nc, js, tracer
        self.outbox = Outbox(nc, js, self.subjects, config.nats.client_inbox_prefix,
                             config.nats.tenant_inboxes)
        # Cut off or stalled while requests wait here: their attempts are marked (each one's
        # answer claimed, shared/bus.py Lapses).
        self.lapses = Lapses(nc, config.distributed.heartbeat_timeout_s, self.mark_lapsed)
        self.quotas = config.quotas
        self.scheduler = RequestScheduler(config.scheduler.request_level,
                                          config.scheduler.batch_level.max_num_batched_tokens)
        self.queue = self.scheduler.queue
        self.cancels = RecentCancels()
        self.arrived = asyncio.Event()
        self.wait_spans: dict[RequestKey, Span] = {}  # each waiting request's queue wait
        self.counts = dict(submitted=0, dispatched=0, cancelled=0, overloaded=0,
                           deadline_exceeded=0, superseded=0)
        self.distributed = config.distributed
        self.heartbeat_interval_s = config.distributed.heartbeat_interval_s
        self.executor_seen: dict[str, float] = {}  # monotonic time of each one's last heartbeat
        # The latest Backpressure sent (None: none yet, so the first look reports) and when.
        self.refused_sent: dict[str, int] | None = None
        self.refused_sent_at = 0.0
        self.tasks: list[asyncio.Task] = []
        self.pulls: set[asyncio.Task] = set()  # long polls being answered
        # Final answers claimed beside (answer), with their requests' keys: still held here.
        self.answering: dict[asyncio.Task, RequestKey] = {}
        self.measuring = config.monitoring.metrics
        self.collector = StatsCollector(self.read_metrics)
        self.tenant_label = TenantLabels()

    async def start(self) -> None:
        await self.load_fairness()
        service = await add_micro_service(self.nc, "priority", "global waiting queue", self.stats,
                                          self.outbox.inbox_prefix)
        await service.add_endpoint(name="submit", subject=self.subjects.priority_submit,
                                   handler=self.on_submit)
        await service.add_endpoint(name="next", subject=self.subjects.priority_next,
                                   handler=self.on_next)
        await self.nc.subscribe(self.subjects.cancels, cb=self.on_cancel)
        await self.nc.subscribe(self.subjects.heartbeat, cb=self.on_heartbeat)
        await self.nc.subscribe(self.subjects.done, cb=self.on_done)
        await self.nc.subscribe(self.subjects.revoke, cb=self.on_revoke)
        self.service = service
        self.tasks = [asyncio.create_task(report_holding(  # the requests waiting here
                          self.nc, self.subjects, "priority", self.heartbeat_interval_s,
                          lambda: [item.key for item in self.queue.items()]
                          + list(self.answering.values()),
                          lambda: self.outbox.recently_ended(
                              ended_window_s(self.distributed)), self.lapses),
                          name="holding"),
                      asyncio.create_task(every(EXPIRY_CHECK_S, self.expire_and_forget),
                                          name="expiry"),
                      asyncio.create_task(every(
                          self.scheduler.cfg.class_feedback_interval_s, self.class_feedback),
                          name="class-feedback"),
                      asyncio.create_task(every(BACKPRESSURE_CHECK_S, self.report_backpressure),
                                          name="backpressure")]

    async def stop(self) -> None:
        """Stop taking work; whoever waits here is told now rather than left to time out
        (durable requests are not: admission has them run again)."""
        await while_connected(self.nc, self.service.stop(), 5.0)
        # The holding reports go on until the last answer is sent: a request whose answer
        # waits on its echo is still held here, and a lease that lapsed meanwhile would hand
        # it on.
        holding = [task for task in self.tasks if task.get_name() == "holding"]
        try:
            await cancel_all([*(task for task in self.tasks if task not in holding),
                              *self.pulls])
            try:  # admission stops refusing on this queue's account at once
                await self.nc.publish(self.subjects.backpressure, encode(Backpressure()))
            except Exception as exc:
                log.info("could not withdraw backpressure", error=repr(exc))
            self.collector.unregister()
            self.lapses.check()
            for item in self.queue.take(list(range(len(self.queue)))):
                if not item.durable:
                    await self.answer(item, Error(
                        request_id=item.request_id, code="overloaded",
                        message="the priority service is shutting down; retry"))
            if self.answering:
                await asyncio.wait(list(self.answering), timeout=10)
                await cancel_all(list(self.answering))
        finally:
            await cancel_all(holding)

    async def report_backpressure(self) -> None:
        """Tell admission which tenants' new requests the full queue refuses (Backpressure), on
        every change and each interval while it lasts, so it refuses them before any work."""
        refused = self.scheduler.refused_tenants(time.time())
        renew = bool(refused) and time.monotonic() - self.refused_sent_at >= \
            self.heartbeat_interval_s
        if refused == self.refused_sent and not renew:
            return
        # Within one message: the tenants holding the most first (hundreds of tenants with a
        # full queue's share each could outgrow a small max_payload).
        order = sorted(refused.items(), key=lambda e: -self.scheduler.counters.backlog
                       .get(e[0], 0))
        fits = next(chunked(order, tenant_entry_bytes, payload_budget(self.nc) // 2), [])
        await self.nc.publish(self.subjects.backpressure, encode(Backpressure(tenants=dict(fits))))
        self.refused_sent, self.refused_sent_at = refused, time.monotonic()

    def stats(self) -> dict:
        return {"queue_depth": len(self.queue), "queue_by_priority": self.queue.depth_by_priority(),
                **self.counts, **self.scheduler.stats(time.time())}

    def read_metrics(self) -> list[Reading]:
        out = [Reading("gauge", "priority_queue_depth", "Requests waiting at priority, by "
                       "priority", n, {"priority": p})
               for p, n in self.queue.depth_by_priority().items()]
        out += [Reading("counter", f"priority_{name}", f"Requests {name.replace('_', ' ')} at "
                        "priority", value) for name, value in self.counts.items()]
        out.append(Reading("gauge", "executor_load", "Demand over executor slots, from "
                           "heartbeats", self.scheduler.load))
        served: dict[tuple[str, str], int] = {}
        for tenant, tokens in self.scheduler.served.items():
            for kind, n in tokens.items():
                key = (self.tenant_label(tenant), kind.removesuffix("_tokens"))
                served[key] = served.get(key, 0) + n
        out += [Reading("counter", "tenant_served_tokens", "Tokens executors reported serving "
                        "each tenant", n, {"tenant": tenant, "kind": kind})
                for (tenant, kind), n in served.items()]
        return out

    async def on_heartbeat(self, msg) -> None:
        """An executor's load."""
        heartbeat = _heartbeat.decode(msg.data)
        self.scheduler.executor_report(heartbeat.executor, heartbeat.running + heartbeat.waiting,
                                       heartbeat.max_num_seqs + heartbeat.queue_depth,
                                       heartbeat.tenants, heartbeat.step_ms)
        self.executor_seen[heartbeat.executor] = time.monotonic()

    async def on_done(self, msg) -> None:
        done = _done.decode(msg.data)
        self.scheduler.done(done, time.time())
        self.superseded(done.key, lambda item: item.arrival_time == done.arrival_time)

    async def on_revoke(self, msg) -> None:
        revoke = _revoke.decode(msg.data)
        self.superseded(RequestKey(revoke.tenant, revoke.request_id),
                        lambda item: item.attempt <= revoke.attempt)

    def mark_lapsed(self) -> None:
        for item in self.queue.items():
            item.lapsed = True

    async def answer(self, item: WorkItem, output: Completion | Error) -> None:
        """A request that waited here gets its final answer. A generate's is sent beside, and
        no handler waits on it (a pull answered late is dropped, a submission not answered is
        refused): it is done once its echo is back (Outbox.final), and one whose attempt lapsed
        here, or whose NATS node died under it, claims it first, a JetStream round trip,
        seconds while LLM_STATE elects a leader. A durable request's is stored at once."""
        if item.durable:
            await self.outbox.final(item, output)
            return
        task = asyncio.create_task(self._answer(item, output))
        self.answering[task] = item.key
        task.add_done_callback(self.answering.pop)

    async def _answer(self, item: WorkItem, output: Completion | Error) -> None:
        try:
            await self.outbox.final(item, output)
        except Exception:  # no Done: admission's lease hands it on
            log.exception("could not deliver a final answer", request_id=item.request_id)

    def superseded(self, key: RequestKey, which) -> None:
        """A waiting request another attempt answered (its Done), or whose attempt admission
        revoked (it handed the request on, to this priority's replica perhaps, while this one
        was taken for lost): dropped without an answer, so that it does not run a second time
        (the answer it would give, Outbox.final withholds; this saves the work)."""
        item = self.scheduler.queue.get(key)
        if item is None or not which(item):
            return
        self.scheduler.remove(key.request_id, key.tenant)
        self.counts["superseded"] += 1
        span = self.wait_spans.pop(key, None)
        if span is not None:
            span.set_attribute("superseded", True)
            span.end()

    async def expire_and_forget(self) -> None:
        """End waiting requests whose deadline passed; forget executors that stopped beating."""
        await self.expire(time.time())
        limit = time.monotonic() - self.distributed.heartbeat_timeout_s
        for name in [n for n, seen in self.executor_seen.items() if seen < limit]:
            del self.executor_seen[name]
            self.scheduler.executor_gone(name)

    async def expire(self, now: float) -> None:
        self.lapses.check()
        for item in self.scheduler.expired(now):
            self.counts["deadline_exceeded"] += 1
            waited_ms = 1e3 * (now - item.arrival_time)
            span = self.wait_spans.pop(item.key)
            span.set_attribute("deadline_exceeded", True)
            span.end()
            await self.answer(item, Error(
                request_id=item.request_id, code="deadline_exceeded",
                message=f"`deadline_ms` {item.request.deadline_ms:g} passed after {waited_ms:.0f} "
                        f"ms in the waiting queue, before an executor could take the request"))

    async def class_feedback(self) -> None:
        """Class SLO feedback: one step of the class weights; and idle tenants' fairness
        counters forgotten (an O(tenants) sweep, so once a feedback interval, not a request)."""
        self.scheduler.class_weights.update(time.time())
        self.scheduler.counters.forget_idle(busy={key.tenant for key in self.scheduler.charges})
        await self.save_fairness()

    async def save_fairness(self) -> None:
        """The tenant counters, to LLM_STATE (no ack: the next feedback step writes again), so
        a priority that restarts, or another replica, does not start fairness from zero."""
        counters = self.scheduler.counters
        # Less what requests still running were charged in advance: their Done, when it comes,
        # charges a priority that loaded these counters their whole cost.
        saved = dict(counters.counters)
        for key, charge in self.scheduler.charges.items():
            if key.tenant in saved:
                saved[key.tenant] -= charge.tokens / counters.weights.get(key.tenant, 1.0)
        snapshot = FairnessSnapshot(time.time(), saved, counters.highest)
        try:
            await self.nc.publish(fairness_subject(self.subjects), msgspec.msgpack.encode(snapshot),
                                  headers={"Nats-TTL": f"{FAIRNESS_SNAPSHOT_MAX_AGE_S:.0f}s"})
        except Exception as exc:  # reconnecting
            log.info("tenant counters not saved", error=repr(exc))

    async def load_fairness(self) -> None:
        """The tenant counters the last priority saved, if recent (each replica's counters
        follow every Done, so any replica's are good)."""
        try:
            last = await self.js.get_last_msg(STATE_STREAM, fairness_subject(self.subjects),
                                              direct=True)
            snapshot = msgspec.msgpack.decode(last.data, type=FairnessSnapshot)
        except NotFoundError:
            return
        except Exception as exc:  # no LLM_STATE yet (admission makes it), or unreadable
            log.info("no tenant counters loaded", error=repr(exc))
            return
        if time.time() - snapshot.saved_at > FAIRNESS_SNAPSHOT_MAX_AGE_S:
            return
        counters = self.scheduler.counters
        counters.counters.update(snapshot.counters)
        counters.highest = max(counters.highest, snapshot.highest)
        log.info("tenant counters loaded", tenants=len(snapshot.counters),
                 age_s=round(time.time() - snapshot.saved_at, 1))

    async def on_submit(self, request: Request) -> None:
        item = _item.decode(request.data)
        if self.cancels.take(item.tenant, item.request_id, item.arrival_time):
            await self.answer(item, cancelled_completion(item))
            await request.respond(encode(SubmitReply()))
            return
        error = None
        if item.key in self.queue:
            if item.durable:  # delivered again while it waits here: it is already queued
                waiting = self.queue.get(item.key)
                if waiting is not None and item.attempt > waiting.attempt:
                    # (the revoke of the earlier one follows)
                    self.queue.replace(item, len(request.data))
                await request.respond(encode(SubmitReply()))
                return
            error = Error(request_id=item.request_id, code="invalid_request",
                          message=f"`request_id` {item.request_id!r} is already waiting")
        elif self.scheduler.dispatched(item) is not None:
            pass  # back from the batcher or handed on: it had its place, and keeps it
        elif (share := self.over_share(item.tenant)) is not None:
            error = Error(request_id=item.request_id, code="rate_limited", message=share,
                          retry_after_ms=QUOTA_RETRY_MS)
        elif self.queue.full:
            error = await self.make_room(item)
        if error is not None:
            await request.respond(encode(SubmitReply(error=error)))
            return
        # Room was made, or it is back from the batcher.
        self.scheduler.push(item, past_bound=True, size=len(request.data))
        self.counts["submitted"] += 1
        self.wait_spans[item.key] = self.tracer.start_span(
            "priority.queue", context=context_from(item.trace),
            attributes={"request_id": item.request_id, "tenant": item.tenant,
                        "priority": item.request.priority})
        self.arrived.set()
        await request.respond(encode(SubmitReply()))

    def over_share(self, tenant: str) -> str | None:
        """Why a new request of `tenant` is refused by its queue share, if it is (a share of
        the whole queue is none: a full queue's push-out decides)."""
        quota = self.quotas.of(tenant)
        most = share_limit(quota.queue_share, self.queue.capacity)
        if most is None or self.scheduler.counters.backlog.get(tenant, 0) < most:
            return None
        return (f"tenant {tenant!r} has {most} requests waiting, its share of the waiting queue "
                f"(quotas queue_share {quota.queue_share:g} of max_pending_requests "
                f"{self.queue.capacity})")

    async def make_room(self, newcomer: WorkItem) -> Error | None:
        """The queue is full: push a waiting request out for `newcomer` (it gets its answer
        now), or the Error that refuses `newcomer`."""
        full = f"the waiting queue is full (max_pending_requests {self.queue.capacity})"
        now = time.time()
        self.lapses.check()
        pushed, why = self.scheduler.push_out_for(newcomer, now)
        if pushed is None:
            self.counts["overloaded"] += 1
            return Error(request_id=newcomer.request_id, code="overloaded", message=full)
        span = self.wait_spans.pop(pushed.key)
        span.set_attribute("pushed_out", why)
        span.end()
        if why == "hopeless":
            self.counts["deadline_exceeded"] += 1
            self.scheduler.class_weights.observe(pushed.request.priority, MISSED_MS, now)
            answer = Error(request_id=pushed.request_id, code="deadline_exceeded",
                           message=f"{full} and `deadline_ms` {pushed.request.deadline_ms:g} "
                                   f"can no longer be met (it needs more time than is left): "
                                   f"it made room for another request")
        else:
            self.counts["overloaded"] += 1
            answer = Error(request_id=pushed.request_id, code="overloaded",
                           message=f"{full}: this request made room for one of a tenant "
                                   f"holding less of the queue, or of a higher priority")
        await self.answer(pushed, answer)
        return None

    async def on_next(self, request: Request) -> None:
        """Each pull is answered in its own task: an endpoint's handler runs one message at a
        time, and one long poll must not hold up the next pull."""
        task = asyncio.create_task(self.answer_next(request))
        self.pulls.add(task)
        task.add_done_callback(self.pull_done)

    def pull_done(self, task: asyncio.Task) -> None:
        self.pulls.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("pull failed", exc_info=task.exception())

    async def answer_next(self, request: Request) -> None:
        """Long poll: answer at once when requests wait, else when one arrives or `wait_ms` ends.
        An overtaking pull (`min_standing`) waits for a request whose standing reaches it. It
        looks at each arrival as it comes (O(1) a request) and, since scores move with the
        clock, at the whole queue every EXPIRY_CHECK_S (O(n))."""
        ask = _next.decode(request.data)
        deadline = time.monotonic() + ask.wait_ms / 1e3
        if ask.min_standing is None:
            while not self.queue and (left := deadline - time.monotonic()) > 0:
                await wait_event(self.arrived, left, fresh=True)
        else:
            seen = -1  # the first look covers the whole queue
            while (left := deadline - time.monotonic()) > 0:
                latest = self.queue.last_seq
                if self.scheduler.can_overtake(ask.min_standing, time.time(), seen):
                    break
                arrived = await wait_event(self.arrived, min(left, EXPIRY_CHECK_S), fresh=True)
                seen = latest if arrived else -1
        now = time.time()
        await self.expire(now)
        budget = payload_budget(self.nc)
        self.lapses.check()
        dispatches = self.scheduler.pop(ask.max_items, now, ask.min_standing,
                                        max_bytes=min(budget, ask.max_bytes or budget))
        for dispatch in dispatches:
            item = dispatch.item
            span = self.wait_spans.pop(item.key)
            span.set_attributes({"priority_score": dispatch.score,
                                 "queue_wait_ms": item.queue_wait_ms,
                                 "overtaking_pull": ask.min_standing is not None,
                                 "predicted_output_tokens":
                                     self.scheduler.charges[item.key].predicted_output_tokens,
                                 **{f"score.{name}": value
                                    for name, value in dispatch.terms.items()}})
            span.end()
            item.trace = carrier_of(span)
            if self.measuring:
                QUEUE_WAIT.labels(item.request.priority).observe(item.queue_wait_ms / 1e3)
        self.counts["dispatched"] += len(dispatches)
        await request.respond(encode(NextReply(items=[d.item for d in dispatches])))

    async def on_cancel(self, msg) -> None:
        """A client's cancel, through admission (which passes on only those of requests in
        flight)."""
        cancel = _cancel.decode(msg.data)
        item = self.scheduler.remove(cancel.request_id, cancel.tenant)
        if item is None:
            # It may still be on its way here.
            self.cancels.add(cancel.tenant, cancel.request_id, cancel.cancelled_at)
            return
        self.counts["cancelled"] += 1
        span = self.wait_spans.pop(item.key)
        span.set_attribute("cancelled", True)
        span.end()
        if self.lapses.check():
            item.lapsed = True
        await self.answer(item, cancelled_completion(item))


main = service_main("priority", PriorityService)
