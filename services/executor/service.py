"""The executor service: the engine (services/executor/engine/) behind NATS. Takes assignments
from the batcher, streams Deltas and the final output to the client, heartbeats its load, and
obeys cancels, revokes and withdrawn assignments. Beside it: `recovery.py` (the holding reports
and checkpoints admission hands requests on from), `batch_size.py` (the adaptive batch size),
`observe.py` (metrics and spans)."""

from __future__ import annotations

import asyncio
import itertools
import os
import socket
import sys
import time
from collections import Counter, OrderedDict
from dataclasses import dataclass

import msgspec
import structlog
from nats.micro import Request

from services.executor.batch_size import BatchSizeController, Interval, p99
from services.executor.engine.llm_engine import Engine, Output
from services.executor.observe import Observer, kv_pools
from services.executor.recovery import holding_reports
from shared.bus import (
    ended_window_s,
    Lapses,
    Outbox,
    add_micro_service,
    cancel_all,
    cancelled_completion,
    chunked,
    payload_budget,
    serve_forever,
    wait_event,
    while_connected,
)
from shared.cancels import RecentCancels
from shared.config import JetserveConfig
from shared.keys import RequestKey
from shared.messages import (
    AssignReply,
    CancelRequest,
    Heartbeat,
    KvDump,
    KvEvent,
    Revoke,
    Unassign,
    WorkItem,
    decoder,
    encode,
    tenant_entry_bytes,
)
from shared.metrics import Reading, StatsCollector
from shared.protocol import Completion, Delta, Error, ProtocolError
from shared.subjects import Subjects, client_reply
from shared.telemetry import Span, carrier_of, context_from

log = structlog.get_logger()

_item = decoder(WorkItem)
_revoke = decoder(Revoke)
_cancel = decoder(CancelRequest)
_unassign = decoder(Unassign)
UNASSIGNED_KEPT = 10_000  # withdrawn assignments remembered in case theirs arrives later
CLIENT_BACK_S = 1.0  # "no responders" answers further apart than this: deltas reached it between
HEARTBEAT_MIN_GAP_S = 0.005  # load changes are reported at once, but not more often than this


def absent_since(unheard: tuple[float, float] | None, now: float, interval: float) -> float:
    """When a streaming client's absence began, given the (first, last) "no responders" of its
    deltas so far and one more now: anew when the last came longer ago than CLIENT_BACK_S, or
    than two and a half of its own delta intervals (`interval`), for deltas reached it in
    between. A request whose deltas come a second or more apart (slow steps) had each "no
    responders" taken for a new absence, and its client's going was never noticed."""
    if unheard is None:
        return now
    first, last = unheard
    return now if now - last > max(CLIENT_BACK_S, 2.5 * interval) else first


@dataclass
class _Running:
    item: WorkItem
    span: Span
    last_delta: float | None = None  # monotonic, for the inter-token latency
    # For the batch-size controller's TPOT: tokens delivered since `window_from` (the previous
    # take, or the first token: the wait for that one is TTFT, not TPOT).
    window_from: float | None = None
    window_tokens: int = 0
    # Streaming generates: the last token of the reply subject its deltas carry, where the
    # server answers "no responders" once the client's inbox is gone.
    probe: str | None = None
    reported: int = 0  # outputs a checkpoint has reported (durable requests)
    interval: float = 0.0  # seconds between its two latest deltas

    def delivered(self, now: float, tokens: int) -> None:
        if self.window_from is None:
            self.window_from = now
        else:
            self.window_tokens += tokens
        if self.last_delta is not None:
            self.interval = now - self.last_delta
        self.last_delta = now

    def take_tpot_ms(self) -> float | None:
        """Time per output token since the previous take; None if no token came after one."""
        if not self.window_tokens:
            return None
        ms = 1e3 * (self.last_delta - self.window_from) / self.window_tokens
        self.window_from, self.window_tokens = self.last_delta, 0
        return ms


class ExecutorService:
    def __init__(self, config: JetserveConfig, nc, js, tracer, name: str,
                 engine: Engine | None = None):
        self.config, self.nc, self.tracer, self.name = config, nc, tracer, name
        self.subjects = Subjects(config.nats.prefix)
        self.outbox = Outbox(nc, js, self.subjects, config.nats.client_inbox_prefix,
                             config.nats.tenant_inboxes)
        # Cut off or stalled while holding requests: their attempts are marked (answers claimed).
        self.lapses = Lapses(nc, config.distributed.heartbeat_timeout_s, self.mark_lapsed)
        self.engine = engine or Engine(config.engine_config(name))
        self.running: dict[RequestKey, _Running] = {}
        self.outputs: asyncio.Queue[tuple[WorkItem, Output]] = asyncio.Queue()
        self.cancels = RecentCancels()
        # Assignments the batcher gave up on before they arrived here (their tokens, oldest first).
        self.unassigned: OrderedDict[str, None] = OrderedDict()
        self.load_changed = asyncio.Event()
        self.idle = asyncio.Event()  # set when the last running request ends
        self.draining = False  # stopping: heartbeats advertise no room
        self.assigned_total = 0
        self.kv_seq = 0  # the last KvEvent published
        self.started_at = time.time()
        self.counts = dict(completed=0, cancelled=0, errors=0, duplicates=0, id_in_use=0,
                           client_gone=0, resumed=0, revoked=0, unassigned=0)
        self.probes: dict[str, RequestKey] = {}  # _Running.probe -> the request's key
        # Final answers being sent (Outbox.final), with their requests' keys: still held.
        self.answering: dict[asyncio.Task, RequestKey] = {}
        # Streaming requests whose client's inbox had no subscriber: (first, last) such answer
        self.unheard: dict[RequestKey, tuple[float, float]] = {}
        # Requests stop() cancelled (not their clients): a durable one stores no result
        self.shutdown_aborts: set[RequestKey] = set()
        self.probe_ids = itertools.count()
        self.tasks: list[asyncio.Task] = []
        self.batch_size = None  # the load-aware controller, with batch_size: adaptive
        if config.scheduler.batch_level.batch_size == "adaptive":
            self.batch_size = BatchSizeController(config.scheduler.load_aware)
            self.engine.scheduler.max_num_seqs = self.batch_size.limit
        self.finished_tpot_ms: list[float] = []  # last windows of requests ended this interval
        self.intake_horizon = config.scheduler.batch_level.intake_horizon_steps
        self.advertised_room = 0  # room_tokens of the latest heartbeat
        self.engine.after_step = self.after_step
        self.observer = Observer(tracer, self.engine.model_name, name, config.monitoring.metrics)
        self.collector = StatsCollector(self.read_metrics)

    async def start(self) -> None:
        self.engine.start()
        self.service = await add_micro_service(self.nc, "executor", f"engine {self.name}",
                                               self.stats, self.outbox.inbox_prefix)
        await self.service.add_endpoint(name="assign", subject=self.subjects.executor_assign(
            self.name), handler=self.on_assign)
        await self.nc.subscribe(self.subjects.cancels, cb=self.on_cancel)
        self.gone_inbox = self.nc.new_inbox()
        await self.nc.subscribe(f"{self.gone_inbox}.*", cb=self.on_client_gone)
        await self.nc.subscribe(self.subjects.kv_dump(self.name), cb=self.on_kv_dump)
        await self.nc.subscribe(self.subjects.revoke, cb=self.on_revoke)
        await self.nc.subscribe(self.subjects.executor_unassign(self.name), cb=self.on_unassign)
        self.load_changed.set()  # the first heartbeat goes out at once
        self.tasks = [asyncio.create_task(self.publish_loop(), name="publish"),
                      asyncio.create_task(self.heartbeat_loop(), name="heartbeat")]
        if self.batch_size is not None:
            self.tasks.append(asyncio.create_task(self.batch_size_loop(), name="batch-size"))

    async def stop(self, drain_timeout_s: float) -> None:
        """Take no new work, let running requests finish (up to the timeout), then stop. A
        durable request still running then is dropped without a result: admission sees nobody
        holding it and has it run again; the others end `cancelled`."""
        self.draining = True
        self.load_changed.set()
        await while_connected(self.nc, self.service.stop(), 5.0)
        if self.running:
            if not await wait_event(self.idle, drain_timeout_s, fresh=True):
                log.warning("drain timed out; cancelling", running=len(self.running))
        for key in list(self.running):
            if self.engine.abort(key):  # (one already ending, a client's cancel, is its own)
                self.shutdown_aborts.add(key)
        try:
            await asyncio.wait_for(self.outputs.join(), 10)  # what the aborts produced
            if self.answering:  # final answers being sent (Outbox.final)
                await asyncio.wait_for(asyncio.gather(*self.answering), 10)
            if self.outbox.ending:  # answered requests' states being ended
                await asyncio.wait_for(asyncio.gather(*self.outbox.ending), 5)
        except TimeoutError:
            log.warning("outputs still unsent at shutdown", pending=self.outputs.qsize(),
                        answering=len(self.answering))
        await cancel_all([*self.tasks, *self.answering])
        await self.engine.stop()
        self.collector.unregister()

    def stats(self) -> dict:
        scheduler, blocks = self.engine.scheduler, self.engine.block_manager
        engine = self.engine.stats
        return {"executor": self.name, "model": self.engine.model_name,
                "running": len(scheduler.running), "waiting": len(scheduler.waiting),
                "kv_blocks_free": blocks.num_free_blocks, "kv_blocks_total": blocks.num_blocks,
                "kv_usage": round(1 - blocks.num_free_blocks / blocks.num_blocks, 4),
                "kv_pools": [{"dtype": dtype, "blocks": total, "free": free}
                             for dtype, total, free in kv_pools(self.engine)],
                "steps": engine.steps, "prompt_tokens": engine.prompt_tokens,
                "decode_tokens": engine.decode_tokens, "preemptions": scheduler.num_preemptions,
                "recomputed_tokens": scheduler.num_recomputed_tokens,
                "paced_steps": scheduler.paced_steps, "pace_tokens": scheduler.pace_tokens,
                "paused_decodes": scheduler.paused_decodes,
                "assigned": self.assigned_total, **self.counts,
                "batch_size": (self.batch_size.stats() if self.batch_size is not None
                               else {"mode": "fixed", "limit": scheduler.max_num_seqs})}

    @property
    def num_waiting(self) -> int:
        """Requests here not running: waiting in the scheduler, or assigned but not yet in it
        (their outputs still queued)."""
        return len(self.running) - len(self.engine.scheduler.running)

    def read_metrics(self) -> list[Reading]:
        return self.observer.readings(self.engine, self.num_waiting)

    # ------------------------------------------------------------------------- requests in

    async def on_assign(self, request: Request) -> None:
        try:
            await request.respond(encode(await self.take(_item.decode(request.data))))
        except Exception as exc:  # the batcher then requeues it elsewhere
            log.exception("assignment failed")
            await request.respond(encode(AssignReply(accepted=False, reason=repr(exc))))

    async def take(self, item: WorkItem) -> AssignReply:
        key = item.key
        if self.draining:
            return AssignReply(accepted=False, reason="draining")
        if item.assignment in self.unassigned:  # it arrived after the batcher gave it up
            del self.unassigned[item.assignment]
            return AssignReply(accepted=False, reason="the batcher gave this assignment up")
        self.assigned_total += 1
        self.load_changed.set()
        running = self.running.get(key)
        if running is not None and item.attempt > running.item.attempt:
            self.drop(key)  # handed on while this executor ran an earlier attempt: run this one
            running = None
        if running is not None and (item.durable or _same_request(item, running.item)):
            # Delivered again while it runs here: a durable request (were the id a generate's,
            # admission hands it back to JetStream once nothing reports it, after that one
            # ends), or an assignment the batcher gave up on and sent again. It runs under the
            # latest assignment now: withdrawing an earlier one leaves it running.
            self.counts["duplicates"] += 1
            running.item.assignment = item.assignment
            running.item.lapsed |= item.lapsed
            return AssignReply(accepted=True)
        if running is not None:  # a generate reusing the id of one that runs: answer at once
            self.counts["id_in_use"] += 1
            self.answer_beside(item, Error(
                request_id=item.request_id, code="invalid_request",
                message=f"`request_id` {item.request_id!r} is already running"), done=False)
            return AssignReply(accepted=True)
        if self.cancels.take(item.tenant, item.request_id, item.arrival_time):
            self.answer_beside(item, cancelled_completion(item, self.name))
            return AssignReply(accepted=True)
        span = self.tracer.start_span(
            "executor.generate", context=context_from(item.trace),
            attributes={"request_id": item.request_id, "executor": self.name,
                        "prompt_tokens": item.num_prompt_tokens})
        # The engine measures from arrival on its own clock: carry admission's stamp over.
        arrival = time.monotonic() - max(0.0, time.time() - item.arrival_time)
        if item.resume_token_ids and not self.engine.valid_checkpoint(item.resume_token_ids):
            # Not this model's tokens (a bug, or a forged report): run from the prompt, and
            # report from the first output on, as a run that was never resumed.
            log.warning("a checkpoint outside the vocabulary dropped", request_id=item.request_id)
            item.resume_token_ids = []
        try:
            self.engine.add_request(item.request, lambda out, item=item: self.outputs.put_nowait(
                (item, out)), key=key, arrival_time=arrival, score=item.standing,
                aging_start=time.monotonic() if item.age_from_dispatch else None,
                resume_token_ids=item.resume_token_ids)
        except ProtocolError as exc:
            span.end()
            self.answer_beside(item, exc.to_error(item.request_id))
        else:
            running = self.running[key] = _Running(item, span,
                                                   reported=len(item.resume_token_ids))
            if item.resume_token_ids:
                self.counts["resumed"] += 1
                span.set_attribute("resumed_from_token", len(item.resume_token_ids))
            if item.request.stream and not item.durable and item.reply_to:
                running.probe = str(next(self.probe_ids))
                self.probes[running.probe] = key
        return AssignReply(accepted=True)

    async def on_cancel(self, msg) -> None:
        """A client's cancel, through admission (which passes on only those of requests in
        flight)."""
        cancel = _cancel.decode(msg.data)
        key = RequestKey(cancel.tenant, cancel.request_id)
        if key in self.running:
            self.engine.abort(key)
        else:
            self.cancels.add(*key, cancel.cancelled_at)  # it may still be on its way here

    async def on_revoke(self, msg) -> None:
        """Admission handed a durable request on after taking this executor for dead (it was
        stalled or cut off): drop the attempt it still runs, without a result."""
        revoke = _revoke.decode(msg.data)
        key = RequestKey(revoke.tenant, revoke.request_id)
        running = self.running.get(key)
        if running is not None and running.item.attempt <= revoke.attempt:
            self.drop(key)
            log.warning("dropped a request handed on to another executor", request=str(key),
                        attempt=running.item.attempt)

    async def on_unassign(self, msg) -> None:
        """The batcher gave up waiting for this executor's answer to an assignment and queued the
        request again: drop it if it runs here under that assignment, else refuse the
        assignment when (if) it arrives."""
        unassign = _unassign.decode(msg.data)
        key = RequestKey(unassign.tenant, unassign.request_id)
        running = self.running.get(key)
        self.counts["unassigned"] += 1
        if running is not None and running.item.assignment == unassign.assignment:
            self.drop(key)
            log.warning("dropped an assignment the batcher gave up on", request=str(key))
            return
        self.unassigned[unassign.assignment] = None
        while len(self.unassigned) > UNASSIGNED_KEPT:
            self.unassigned.popitem(last=False)

    def mark_lapsed(self) -> None:
        for running in self.running.values():
            running.item.lapsed = True

    def drop(self, key: RequestKey) -> None:
        """End a running request here without any output: another attempt owns it now. What the
        engine still sends for it finds no running entry and is discarded (`publish`)."""
        running = self.running.pop(key)
        self.unheard.pop(key, None)
        if running.probe is not None:
            del self.probes[running.probe]
        running.span.set_attribute("revoked", True)
        running.span.end()
        self.engine.abort(key)
        self.counts["revoked"] += 1
        if not self.running:
            self.idle.set()
        self.load_changed.set()

    async def on_client_gone(self, msg) -> None:
        """The server's "no responders" to a delta: the streaming client's inbox has no
        subscriber (it closed, or the server cut it off as a slow consumer). Nobody will read
        the rest, so the request ends `cancelled` and its slot goes to others."""
        if (msg.headers or {}).get("Status") != "503":
            return
        key = self.probes.get(msg.subject.rsplit(".", 1)[-1])
        if key is None:
            return
        # Gone only when every delta for `client_gone_after_s` found nobody: a client that
        # reconnects (its NATS node died) misses a few deltas, and keeps its request.
        now = time.monotonic()
        running = self.running.get(key)
        first = absent_since(self.unheard.get(key), now, running.interval if running else 0.0)
        self.unheard[key] = (first, now)
        if now - first < self.config.distributed.client_gone_after_s:
            return
        del self.unheard[key]
        if self.engine.abort(key):
            self.counts["client_gone"] += 1
            log.info("streaming client gone; request cancelled", request=str(key))

    # ------------------------------------------------------------------------ outputs out

    async def publish_loop(self) -> None:
        """Sends engine outputs in order; the engine's sink only enqueues, never blocks a step."""
        while True:
            item, output = await self.outputs.get()
            try:
                await self.publish(item, output)
            except Exception:  # one client's output must not stop everyone else's
                log.exception("could not deliver an output", request_id=item.request_id)
            finally:
                self.outputs.task_done()

    async def publish(self, item: WorkItem, output: Output) -> None:
        running = self.running.get(item.key)
        if running is None or running.item is not item:
            return  # an attempt dropped for another (drop): its outputs go nowhere
        if isinstance(output, Delta):
            now = time.monotonic()
            if running.last_delta is not None:
                self.observer.inter_token(now - running.last_delta)
            running.delivered(now, len(output.token_ids))
            probe = running.probe
            await self.outbox.delta(item, output,
                                    reply=f"{self.gone_inbox}.{probe}" if probe else None)
            return
        self.lapses.check()  # (marks this item too, while it is still in self.running)
        lapses = self.lapses.count
        del self.running[item.key]
        self.unheard.pop(item.key, None)
        if running.probe is not None:
            del self.probes[running.probe]
        if self.batch_size is not None and (tpot := running.take_tpot_ms()) is not None:
            self.finished_tpot_ms.append(tpot)
        if isinstance(output, Completion):
            output = msgspec.structs.replace(output, scheduling=msgspec.structs.replace(
                output.scheduling, priority_score=item.priority_score,
                queue_wait_ms=item.queue_wait_ms))
            self.counts["cancelled" if output.finish_reason == "cancelled" else "completed"] += 1
        else:
            self.counts["errors"] += 1
        if not self.running:
            self.idle.set()
        self.load_changed.set()
        self.observer.ended(running.span, item, output)
        if item.key in self.shutdown_aborts and item.durable and isinstance(output, Completion) \
                and output.finish_reason == "cancelled":
            return  # cut short by shutdown, not by its client: it will run again elsewhere
        # A durable result is stored in JetStream, and a generate's answer claimed there
        # first (Outbox.final), which may be electing a stream leader (a NATS node died):
        # beside the publish loop, not in front of every other request's deltas.
        self.answer_beside(item, output, carrier_of(running.span), lapses)

    def answer_beside(self, item: WorkItem, output, headers: dict[str, str] | None = None,
                      lapses: int | None = None, done: bool = True) -> None:
        """`answer` in a task of its own, reported as held while it runs (self.answering).
        `done`: as Outbox.final's."""
        lapses = self.lapses.count if lapses is None else lapses
        task = asyncio.create_task(self.answer(item, output, headers or {}, lapses, done))
        self.answering[task] = item.key
        task.add_done_callback(self.answering.pop)

    async def answer(self, item: WorkItem, output, headers: dict[str, str],
                     lapses: int, done: bool = True) -> None:
        """`lapses`: `Lapses.count` when the output came; one found since (before this task
        ran, or now) marks the item, no longer in self.running."""
        if self.lapses.since(lapses):
            item.lapsed = True
        try:
            await self.outbox.final(item, output, headers, done=done,
                                    held=True)  # (in self.answering)
        except Exception:  # no Done: admission's lease hands it on, and LLM_RESULTS keeps one
            log.exception("could not deliver a final answer", request_id=item.request_id,
                          durable=item.durable)

    async def heartbeat_loop(self) -> None:
        interval = self.config.distributed.heartbeat_interval_s
        spent_s, steps, holding_at = 0.0, 0, 0.0  # at the previous beat
        while True:
            # (woken when the next holding report is due, at the latest: they go out once an
            # interval, and a gap of half a lease counts as a stall, Lapses)
            await wait_event(self.load_changed,
                             min(interval, max(0.0, holding_at + interval - time.monotonic())))
            self.load_changed.clear()
            stats = self.engine.stats
            # A step's time as a request sees it: the model's time and the gaps between steps
            # while work remained (scheduling, publishing, a busy host), not the model's alone:
            # priority turns it into the time a request needs, and an estimate short of what
            # tokens really take started requests that were then cut at their deadlines.
            new_steps = stats.steps - steps
            spent = stats.model_busy_s + stats.model_idle_s
            step_ms = 1e3 * (spent - spent_s) / new_steps if new_steps else 0.0
            spent_s, steps = spent, stats.steps
            # (due or not, set before anything can fail: a heartbeat that keeps failing waits
            # an interval for the next try, not HEARTBEAT_MIN_GAP_S)
            holding_due = time.monotonic() - holding_at >= interval
            if holding_due:
                holding_at = time.monotonic()
            try:
                await self.nc.publish(self.subjects.heartbeat, encode(self.heartbeat(step_ms)))
                await self.publish_kv_changes()
                if holding_due:
                    ended = self.outbox.recently_ended(
                        ended_window_s(self.config.distributed))
                    for report in holding_reports(self.name, self.running, self.engine,
                                                  payload_budget(self.nc), ended,
                                                  self.answering.values()):
                        await self.nc.publish(self.subjects.holding, encode(report))
                    self.lapses.beat()
            except Exception:  # a missed beat is survivable; a dead loop looks like a dead executor
                log.exception("heartbeat failed")
            await asyncio.sleep(HEARTBEAT_MIN_GAP_S)

    async def batch_size_loop(self) -> None:
        """Every interval: what the last one looked like to the controller, and its new limit
        (if any) to the scheduler, the log, the heartbeat and $SRV.STATS."""
        controller = self.batch_size
        scheduler, blocks = self.engine.scheduler, self.engine.block_manager
        preemptions = scheduler.num_preemptions
        while True:
            await asyncio.sleep(self.config.scheduler.load_aware.interval_s)
            samples, self.finished_tpot_ms = self.finished_tpot_ms, []
            samples += [ms for r in self.running.values() if (ms := r.take_tpot_ms()) is not None]
            seen = Interval(waiting=self.num_waiting, running=len(scheduler.running),
                            tpot_p99_ms=p99(samples),
                            free_kv_fraction=blocks.num_free_blocks / blocks.num_blocks,
                            preemptions=scheduler.num_preemptions - preemptions)
            preemptions = scheduler.num_preemptions
            decision = controller.update(seen)
            if decision is not None:
                scheduler.max_num_seqs = decision.new  # read by the next step's schedule()
                log.info("batch size", old=decision.old, new=decision.new,
                         reason=decision.reason)
                self.load_changed.set()

    async def publish_kv_changes(self) -> None:
        """What the prefix cache gained and lost since the last event, as the next KvEvent."""
        stored, removed = self.engine.block_manager.drain_kv_changes()
        # Net changes: no hash is in both lists, so they may go as several events in any
        # order, each within the payload limit.
        changes = [(h, True) for h in stored] + [(h, False) for h in removed]
        for part in chunked(changes, lambda c: len(c[0]) + 4, payload_budget(self.nc)):
            self.kv_seq += 1
            await self.nc.publish(self.subjects.kv_events, encode(KvEvent(
                executor=self.name, started_at=self.started_at, seq=self.kv_seq,
                stored=[h for h, kept in part if kept],
                removed=[h for h, kept in part if not kept])))

    async def on_kv_dump(self, msg) -> None:
        """Every cached block, as of an event published just before: the two stay in order."""
        if not (msg.reply and client_reply(msg.reply, self.outbox.inbox_prefix)):
            return  # an answer only to an inbox (shared.bus.MicroService says why)
        try:
            await self.publish_kv_changes()
            blocks = list(self.engine.block_manager.hash_to_block)
            parts = list(chunked(blocks, lambda h: len(h) + 2, payload_budget(self.nc))) or [[]]
            for i, part in enumerate(parts):
                await self.nc.publish(msg.reply, encode(KvDump(
                    executor=self.name, started_at=self.started_at, seq=self.kv_seq, blocks=part,
                    part=i, last=i == len(parts) - 1)))
        except Exception:
            log.exception("kv dump failed")

    def after_step(self) -> None:
        """Each step, once scheduled: when the latest heartbeat said there was no room and now
        there is (prefill got under way), say so at once — the next requests then arrive
        while this executor still has work, not after it ran dry."""
        if self.advertised_room <= 0 and not self.draining \
                and self.engine.scheduler.intake_room(self.intake_horizon) > 0:
            self.advertised_room = 1  # until the heartbeat says how much
            self.load_changed.set()

    def heartbeat(self, step_ms: float) -> Heartbeat:
        scheduler, blocks = self.engine.scheduler, self.engine.block_manager
        batch = self.config.scheduler.batch_level
        self.advertised_room = 0 if self.draining else scheduler.intake_room(self.intake_horizon)
        return Heartbeat(
            executor=self.name, model=self.engine.model_name,
            max_num_seqs=0 if self.draining else scheduler.max_num_seqs,  # adaptive: the limit
            queue_depth=0 if self.draining else batch.executor_queue_depth,
            running=len(scheduler.running),
            waiting=self.num_waiting,
            assigned_total=self.assigned_total, free_kv_blocks=blocks.num_free_blocks,
            total_kv_blocks=blocks.num_blocks, step_ms=step_ms, started_at=self.started_at,
            tenants=self.tenants_report(),
            overtake_above=None if self.draining else scheduler.overtake_above(),
            room_tokens=self.advertised_room)

    def tenants_report(self) -> dict[str, int]:
        """The requests each tenant has here, the busiest tenants first, as many as fit a quarter
        of a heartbeat's payload (tenant names are up to 64 bytes; a small max_payload and
        hundreds of tenants would not fit whole)."""
        busiest = Counter(running.item.tenant for running in self.running.values()).most_common()
        fits = next(chunked(busiest, tenant_entry_bytes, payload_budget(self.nc) // 4), [])
        return dict(fits)


def _same_request(a: WorkItem, b: WorkItem) -> bool:
    """Whether two assignments carry the same admitted request (not one reusing its id)."""
    return (a.arrival_time, a.reply_to, a.attempt) == (b.arrival_time, b.reply_to, b.attempt)


async def serve(config, nc, js, tracer, stop: asyncio.Event, args) -> None:
    name = args.name or f"executor-{socket.gethostname()}-{os.getpid()}"
    # The model loads on a thread, so a SIGTERM meanwhile is heard: nothing is held yet, and
    # the executor stops at once rather than after a load that may take minutes.
    loading = asyncio.ensure_future(asyncio.to_thread(Engine, config.engine_config(name)))
    told_to_stop = asyncio.ensure_future(stop.wait())
    await asyncio.wait([loading, told_to_stop], return_when=asyncio.FIRST_COMPLETED)
    if stop.is_set():
        log.info("stopped while loading the model", executor=name)
        await nc.close()
        sys.stdout.flush()
        os._exit(0)  # the loading thread cannot be interrupted, and nothing waits on it
    told_to_stop.cancel()
    service = ExecutorService(config, nc, js, tracer, name, engine=loading.result())
    await service.start()
    log.info("serving", executor=name, model=service.engine.model_name,
             kv_blocks=service.engine.block_manager.num_blocks, matmuls=service.engine.matmuls)
    await stop.wait()
    await service.stop(config.distributed.drain_timeout_s)


def main(argv: list[str] | None = None) -> None:
    asyncio.run(serve_forever("executor", serve, argv))
