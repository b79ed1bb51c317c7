"""The batcher service: pulls the best waiting requests from priority when executors have room
and assigns each to one; with no room anywhere, sends those that outrank what is at an executor
there at once (overtaking dispatch)."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import secrets
import time

import msgspec
import structlog
from nats.errors import NoRespondersError

from services.batcher.registry import ExecutorRegistry
from shared.keys import RequestKey
from shared.bus import (
    ended_window_s,
    Lapses,
    Outbox,
    add_micro_service,
    cancel_all,
    every,
    json_encode,
    payload_budget,
    report_holding,
    service_main,
    wait_event,
    while_connected,
)
from shared.config import JetserveConfig
from shared.messages import (
    AssignReply,
    Heartbeat,
    KvDump,
    KvEvent,
    NextReply,
    NextRequest,
    SubmitReply,
    Unassign,
    WorkItem,
    decoder,
    encode,
)
from shared.metrics import Reading, StatsCollector
from shared.protocol import Error
from shared.subjects import Subjects
from shared.telemetry import carrier_of, context_from

log = structlog.get_logger()

_heartbeat = decoder(Heartbeat)
_next_reply = decoder(NextReply)
_assign_reply = decoder(AssignReply)
_submit_reply = decoder(SubmitReply)
_kv_event = decoder(KvEvent)
_kv_dump = decoder(KvDump)

PULL_WAIT_MS = 500  # how long one pull waits at priority for a request to arrive
# A pull's reply this long past its wait is taken for lost (a NATS node died with it, or the
# priority replica that took it is stuck): the next pull goes out. The late reply's requests,
# should it come while nobody can have handed them on yet, are still sent on (`late_limit_s`).
PULL_LATE_S = 1.0
SUSPEND_S = 1.0  # an executor that failed an assignment gets none for this long


class BatcherService:
    def __init__(self, config: JetserveConfig, nc, js, tracer):
        self.config, self.nc, self.tracer = config, nc, tracer
        self.subjects = Subjects(config.nats.prefix)
        self.outbox = Outbox(nc, js, self.subjects, config.nats.client_inbox_prefix,
                             config.nats.tenant_inboxes)
        # Cut off or stalled while requests are on their way here: their attempts are marked
        # (each one's answer claimed, shared/bus.py Lapses).
        self.lapses = Lapses(nc, config.distributed.heartbeat_timeout_s, self.mark_lapsed)
        self.timeout = config.nats.request_timeout_s
        self.block_size = config.kv_cache.block_size
        batch = config.scheduler.batch_level
        self.registry = ExecutorRegistry(batch.overtake_extra, batch.routing,
                                         overlap_weight=batch.kv_overlap_weight,
                                         load_weight=batch.kv_load_weight)
        self.dumps: set[asyncio.Task] = set()  # KvDump requests in flight
        self.room = asyncio.Event()  # set when an executor may have free slots
        self.beat = asyncio.Event()  # set on every heartbeat
        self.counts = dict(pulled=0, pulled_late=0, pulled_too_late=0, assigned=0,
                           overtaking=0, requeued=0, executors_lost=0, unassigned=0)
        # Requests pulled from priority and not yet taken by an executor or back in the queue:
        # reported as held, so admission never takes a slow assignment for a lost request.
        self.holding: dict[RequestKey, WorkItem] = {}
        self.sending: set[asyncio.Task] = set()  # assignments awaiting an executor's answer
        self.assignments = itertools.count()
        # Pulls awaiting priority's reply: id -> (its future, when sent, overtaking); the
        # future of one given up on is cancelled, and a reply to it is late.
        # (and the lapses counted when it went: one found before its requests are held here,
        # where on_lapse marks them, marks them as they come, `arrived`)
        self.pulls: dict[str, tuple[asyncio.Future, float, bool, int]] = {}
        self.pull_ids = itertools.count()
        self.pull_inbox, self.pull_replies = "", None
        # A late reply's requests are sent on only this soon after the pull: priority last
        # reported them at most a heartbeat interval before it popped them, admission (whose
        # clock moves once an interval) may hand them on from a lease less an interval after
        # that report, and this batcher's next report naming them as held goes out within an
        # interval of their arrival. Later, they are left to that hand-on.
        distributed = config.distributed
        self.late_limit_s = distributed.heartbeat_timeout_s \
            - 3 * distributed.heartbeat_interval_s - 0.1
        self.instance = secrets.token_hex(4)
        self.tasks: list[asyncio.Task] = []
        self.stopping = False
        self.collector = StatsCollector(self.read_metrics)

    async def start(self) -> None:
        self.service = await add_micro_service(self.nc, "batcher", "routes requests to executors",
                                               self.stats, self.outbox.inbox_prefix)
        await self.service.add_endpoint(name="executors", subject=self.subjects.batcher_executors,
                                        handler=self.on_executors)
        await self.nc.subscribe(self.subjects.heartbeat, cb=self.on_heartbeat)
        self.pull_inbox = self.nc.new_inbox()
        self.pull_replies = await self.nc.subscribe(f"{self.pull_inbox}.*", cb=self.on_pulled)
        await self.nc.subscribe(self.subjects.kv_events, cb=self.on_kv_event)
        self.tasks = [asyncio.create_task(self._until_stopped(self.dispatch_once), name="dispatch"),
                      asyncio.create_task(every(self.config.distributed.heartbeat_interval_s,
                                                self.forget_silent_executors), name="liveness"),
                      # The requests on their way to an executor.
                      asyncio.create_task(report_holding(
                          self.nc, self.subjects, "batcher",
                          self.config.distributed.heartbeat_interval_s,
                          lambda: list(self.holding),
                          lambda: self.outbox.recently_ended(
                              ended_window_s(self.config.distributed)), self.lapses),
                          name="holding")]
        if self.config.scheduler.batch_level.overtaking_dispatch:
            self.tasks.append(asyncio.create_task(self._until_stopped(self.overtake_once),
                                                  name="overtake"))

    async def stop(self) -> None:
        # The flag as well as the cancel: on Python 3.11 a cancel that lands as a wait_for()
        # inside a loop times out can be lost, and the loop would go on (a SIGTERMed batcher
        # hung here).
        self.stopping = True
        if self.pull_replies is not None:  # a late reply's requests are left to the lease
            with contextlib.suppress(Exception):
                await self.pull_replies.unsubscribe()
        await cancel_all([*self.tasks, *self.dumps, *self.sending])
        await while_connected(self.nc, self.service.stop(), 5.0)
        self.collector.unregister()

    def stats(self) -> dict:
        return {**self.counts, "free_slots": self.registry.free_slots(), "executors": {
            name: {"model": s.heartbeat.model, "running": s.heartbeat.running,
                   "waiting": s.heartbeat.waiting, "in_transit": s.in_transit,
                   "free_kv_blocks": s.heartbeat.free_kv_blocks,
                   "total_kv_blocks": s.heartbeat.total_kv_blocks,
                   "step_ms": round(s.heartbeat.step_ms, 3)}
            for name, s in self.registry.executors.items()}}

    def read_metrics(self) -> list[Reading]:
        docs = {"pulled": "Requests pulled from priority",
                "assigned": "Assignments an executor accepted",
                "overtaking": "Requests sent beyond an executor's room to overtake",
                "requeued": "Requests sent back to priority (assignment failed)",
                "pulled_late": "Requests of a pull answered after the batcher gave it up, "
                               "sent on",
                "pulled_too_late": "Requests of a pull answered too late to send on (admission "
                                   "hands them on)",
                "unassigned": "Assignments withdrawn after their executor did not answer in time",
                "executors_lost": "Executors forgotten after their heartbeats stopped"}
        return [Reading("gauge", "executors_alive", "Executors heard from within the heartbeat "
                        "timeout", len(self.registry.executors)),
                Reading("gauge", "executor_free_slots", "Requests the executors can take now",
                        self.registry.free_slots()),
                *(Reading("counter", f"batcher_{name}", docs[name], value)
                  for name, value in self.counts.items())]

    async def on_executors(self, request) -> None:
        """The live executors and their load (what `jetserve status` shows)."""
        await request.respond(json_encode(self.stats()["executors"]))

    async def on_heartbeat(self, msg) -> None:
        heartbeat = _heartbeat.decode(msg.data)
        if self.registry.update(heartbeat, time.monotonic()):
            log.info("executor joined", executor=heartbeat.executor, model=heartbeat.model,
                     max_num_seqs=heartbeat.max_num_seqs)
        if self.registry.free_slots():
            self.room.set()
        self.beat.set()

    async def on_kv_event(self, msg) -> None:
        event = _kv_event.decode(msg.data)
        if self.registry.kv_index.apply(event) and not self.stopping:  # a gap, or seen midway
            task = asyncio.create_task(self.request_dump(event.executor), name="kv-dump")
            self.dumps.add(task)
            task.add_done_callback(self.dumps.discard)

    async def request_dump(self, executor: str) -> None:
        """Ask `executor` for every block it caches; retried while the index still lacks it."""
        while self.registry.kv_index.needs_dump(executor) and not self.stopping:
            try:
                self.registry.kv_index.apply_dump(await self.fetch_dump(executor))
                log.info("kv index refreshed", executor=executor,
                         blocks=self.registry.kv_index.num_blocks(executor))
            except Exception as exc:  # gone, or slow: try again after a beat unless forgotten
                if executor not in self.registry.executors:
                    self.registry.kv_index.forget(executor)
                    return
                log.warning("kv dump failed", executor=executor, error=repr(exc))
                await asyncio.sleep(SUSPEND_S)

    async def fetch_dump(self, executor: str) -> KvDump:
        """`executor`'s KvDump, gathered from its parts (one reply each, in order)."""
        inbox = self.nc.new_inbox()
        sub = await self.nc.subscribe(inbox)
        try:
            await self.nc.publish(self.subjects.kv_dump(executor), b"", reply=inbox)
            blocks: list[bytes] = []
            for expected in itertools.count():
                msg = await sub.next_msg(timeout=self.timeout)
                if not msg.data:  # the server's "no responders"
                    raise NoRespondersError
                part = _kv_dump.decode(msg.data)
                if part.part != expected:
                    raise ValueError(f"kv dump part {part.part} came where {expected} was due")
                blocks += part.blocks
                if part.last:
                    return msgspec.structs.replace(part, blocks=blocks, part=0)
        finally:
            await sub.unsubscribe()

    async def forget_silent_executors(self) -> None:
        timeout_s = self.config.distributed.heartbeat_timeout_s
        # One whose last heartbeat said it was stopping (no room: it drains) left on purpose.
        stopping = {name for name, s in self.registry.executors.items()
                    if s.heartbeat.max_num_seqs == 0}
        for name in self.registry.expire(time.monotonic(), timeout_s):
            self.counts["executors_lost"] += 1
            if name in stopping:
                log.info("executor left: it stopped", executor=name)
            else:
                log.warning("executor lost: no heartbeat", executor=name, timeout_s=timeout_s)

    async def _until_stopped(self, once) -> None:
        while not self.stopping:
            try:
                await once()
            except Exception:  # a bug must not stop dispatching for good
                log.exception("dispatch failed; continuing", loop=once.__name__)
                await asyncio.sleep(0.2)

    async def pull(self, max_items: int, min_standing: float | None = None) -> list[WorkItem]:
        """Up to `max_items` requests from priority's queue (only those whose standing reaches
        `min_standing`, if given); none when priority does not answer within PULL_LATE_S past
        the pull's wait. A reply that comes later has its requests sent on if it is not too
        late (`on_pulled`): they left priority's queue for this batcher."""
        now = time.monotonic()
        for pull_id, (future, sent, *_) in list(self.pulls.items()):  # (ordered by when sent)
            if now - sent <= max(self.late_limit_s, PULL_WAIT_MS / 1e3 + PULL_LATE_S):
                break
            if future.done():  # (given up; one still awaited is not forgotten under it)
                del self.pulls[pull_id]
        pull_id = str(next(self.pull_ids))
        reply = asyncio.get_running_loop().create_future()
        lapses = self.lapses.count
        self.pulls[pull_id] = (reply, now, min_standing is not None, lapses)
        try:
            await self.nc.publish(
                self.subjects.priority_next,
                encode(NextRequest(max_items=max_items, wait_ms=PULL_WAIT_MS,
                                   min_standing=min_standing, max_bytes=payload_budget(self.nc))),
                reply=f"{self.pull_inbox}.{pull_id}")
            items = await asyncio.wait_for(asyncio.shield(reply), PULL_WAIT_MS / 1e3 + PULL_LATE_S)
        except (asyncio.TimeoutError, NoRespondersError, OSError) as exc:
            if reply.done() and not reply.cancelled() and reply.exception() is None:
                items = reply.result()  # (it came as the wait ended)
            else:
                reply.cancel()  # given up (before the pause below): a reply now is late
                log.warning("priority did not answer a pull", overtaking=min_standing is not None,
                            error=repr(exc))
                await asyncio.sleep(0.2)
                return []
        finally:
            reply.cancel()  # (given up, or the batcher stopping: a reply now is late)
        self.counts["pulled"] += len(items)
        return self.arrived(items, lapses)

    def arrived(self, items: list[WorkItem], lapses: int) -> list[WorkItem]:
        """A pull's requests, marked lapsed if this batcher lapsed since it sent the pull
        (`lapses`: the count then)."""
        if self.lapses.since(lapses):
            for item in items:
                item.lapsed = True
        return items

    async def on_pulled(self, msg) -> None:
        """Priority's reply to a pull: to the pull still waiting for it; or, late, sent on
        while nobody can have handed its requests on yet, else left to admission's hand-on."""
        pulled = self.pulls.pop(msg.subject.rsplit(".", 1)[-1], None)
        if not msg.data:  # the server's "no responders"
            if pulled is not None and not pulled[0].done():
                pulled[0].set_exception(NoRespondersError())
            return
        items = _next_reply.decode(msg.data).items
        if pulled is not None and not pulled[0].done():
            pulled[0].set_result(items)
            return
        if not items:
            return
        if pulled is None or self.stopping \
                or time.monotonic() - pulled[1] > self.late_limit_s:
            self.counts["pulled_too_late"] += len(items)
            log.warning("a pull's reply came too late; its requests are left to admission's "
                        "hand-on", requests=len(items))
            return
        self.counts["pulled_late"] += len(items)
        log.info("a late pull's requests sent on", requests=len(items))
        for item in self.arrived(items, pulled[3]):
            self.send_beside(item, overtaking=pulled[2])

    async def dispatch_once(self) -> None:
        """Pull only as many requests as executors have room for: the rest keep waiting at
        priority, where a later, more urgent request can still overtake them."""
        free = self.registry.pull_size(time.monotonic())
        if free == 0:
            await wait_event(self.room, SUSPEND_S, fresh=True)
            return
        for item in await self.pull(free):
            self.send_beside(item)

    def send_beside(self, item: WorkItem, overtaking: bool = False) -> str | None:
        """Route `item` now (charged against its executor's room before the next pull) and
        send it beside the dispatch loop: an executor that does not answer (stopped, or its
        answer lost with a NATS node: a request's timeout) holds up no other assignment. The
        executor it goes to (None: back to priority's queue)."""
        try:
            routed = self.route(item, overtaking)
        except Exception:  # a bug: this request goes back to the queue, the others on
            log.exception("routing failed", request_id=item.request_id)
            routed = (None, False, {})
        self.holding[item.key] = item
        task = asyncio.create_task(self.send_held(item, *routed))
        self.sending.add(task)
        task.add_done_callback(self.sending.discard)
        return routed[0]

    async def overtake_once(self) -> None:
        """With no room anywhere, pull one request at a time that would start at once at some
        executor, ahead of what waits there."""
        now = time.monotonic()
        threshold = None if self.registry.free_slots(now) else \
            self.registry.overtake_threshold(now)
        if threshold is None:
            await wait_event(self.beat, SUSPEND_S, fresh=True)  # until the next heartbeat
            return
        for item in await self.pull(1, threshold):
            # Sent beside, like every assignment; its executor, with it in transit, is no
            # candidate to overtake at again until its next heartbeat counts it.
            if self.send_beside(item, overtaking=True) is None:
                # Its executor's threshold moved, or it serves another model: until the next
                # heartbeat, pulling again would hand out the same request again.
                await wait_event(self.beat, SUSPEND_S, fresh=True)

    async def send_held(self, item: WorkItem, executor: str | None, overtakes: bool,
                        route: dict) -> bool:
        try:
            return await self.send(item, executor, overtakes, route)
        except Exception:  # a bug must not leave the request held here for good
            log.exception("assignment failed", request_id=item.request_id)
            return False
        finally:
            if self.holding.get(item.key) is item:
                del self.holding[item.key]

    def route(self, item: WorkItem, overtaking: bool = False) -> tuple[str | None, bool, dict]:
        """The executor for `item`, charged against its room at once (None: none has room);
        whether it goes beyond that room to overtake; each candidate's cached prefix."""
        now = time.monotonic()
        executor = self.registry.pick(item.request.model, now, item.block_hashes,
                                      prompt_tokens=item.num_prompt_tokens
                                      + len(item.resume_token_ids),
                                      block_size=self.block_size, overshoot=not overtaking)
        route = dict(self.registry.last_route) if item.block_hashes else {}
        overtakes = False  # sent beyond an executor's room, to go ahead of what is there
        if executor is None and overtaking:
            executor = self.registry.pick_overtake(item.request.model, item.standing, now)
            overtakes = executor is not None
            self.counts["overtaking"] += overtakes
        return executor, overtakes, route

    async def send(self, item: WorkItem, executor: str | None, overtakes: bool,
                   route: dict) -> bool:
        """`item` to `executor`; back to priority's queue if it does not take it, or if there
        is no executor. Whether it took it."""
        if executor is None:  # room vanished (an executor died): back to the queue
            await self.requeue(item)
            return False
        with self.tracer.start_as_current_span(
                "batcher.route", context=context_from(item.trace),
                attributes={"request_id": item.request_id, "executor": executor,
                            "overtaking": overtakes, "routing": self.registry.routing,
                            "prompt_blocks": len(item.block_hashes),
                            "candidates": list(route), "cached_blocks": list(route.values()),
                            }) as span:
            item.trace = carrier_of(span)
            item.assignment = f"{self.instance}-{next(self.assignments)}"
            self.lapses.check()
            try:
                reply = await self.nc.request(self.subjects.executor_assign(executor), encode(item),
                                              timeout=self.timeout, headers=item.trace)
                answer = _assign_reply.decode(reply.data)
            except Exception as exc:  # no answer, or an error reply without an AssignReply
                answer = AssignReply(accepted=False, reason=repr(exc))
                # It may still take it, late: withdrawn, so it cannot run beside its requeue.
                # The withdrawal may not reach it either (cut off): the requeued copy claims
                # its answer, as the executor's copy does once it lapsed.
                await self.unassign(executor, item)
                item.lapsed = True
            if answer.accepted:
                self.counts["assigned"] += 1
                return True
            span.set_attribute("rejected", answer.reason)
        log.warning("assignment failed", executor=executor, request_id=item.request_id,
                    reason=answer.reason)
        self.registry.unsend(executor, suspend_until=time.monotonic() + SUSPEND_S)
        await self.requeue(item)
        return False

    async def unassign(self, executor: str, item: WorkItem) -> None:
        self.counts["unassigned"] += 1
        try:
            await self.nc.publish(self.subjects.executor_unassign(executor), encode(
                Unassign(item.tenant, item.request_id, item.assignment)))
        except Exception as exc:  # disconnected: the executor is likely cut off as well
            log.warning("could not withdraw an assignment", executor=executor,
                        request_id=item.request_id, error=repr(exc))

    def mark_lapsed(self) -> None:
        for item in self.holding.values():
            item.lapsed = True

    async def requeue(self, item: WorkItem) -> None:
        """Back to priority's queue. A generate priority refuses gets an `internal` Error; one
        it did not answer for (it may have queued it: a second answer would follow) is left,
        as a durable request is, to admission, which hands it on once nobody reports it."""
        self.counts["requeued"] += 1
        self.lapses.check()
        try:
            reply = await self.nc.request(self.subjects.priority_submit, encode(item),
                                          timeout=self.timeout, headers=item.trace)
        except Exception as exc:
            log.error("could not requeue; left to admission's hand-on",
                      request_id=item.request_id, durable=item.durable, error=repr(exc))
            return
        if _submit_reply.decode(reply.data).error is None:
            return
        log.error("could not requeue", request_id=item.request_id, durable=item.durable)
        if item.durable:
            return  # admission hands it to JetStream again once nobody reports holding it
        self.lapses.check()
        await self.outbox.final(item, Error(request_id=item.request_id, code="internal",
                                            message="the waiting queue refused the request back"))


main = service_main("batcher", BatcherService)
