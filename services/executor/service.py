"""The executor service: the engine behind NATS. Takes assignments from the batcher, streams
Deltas and the final output to the client, heartbeats its load, and obeys cancels."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

import msgspec
import structlog
from nats.micro import Request

from services.executor.engine import Engine, Output
from shared.bus import Outbox, add_micro_service, cancelled_completion, serve_forever
from shared.cancels import RecentCancels
from shared.config import JetserveConfig
from shared.messages import AssignReply, Heartbeat, Holding, WorkItem, decoder, encode
from shared.protocol import Completion, Delta, Error, ProtocolError, decode_cancel
from shared.subjects import Subjects
from shared.telemetry import Span, carrier_of, context_from, context_of

log = structlog.get_logger()

_item = decoder(WorkItem)
HEARTBEAT_MIN_GAP_S = 0.005  # load changes are reported at once, but not more often than this


@dataclass
class _Running:
    item: WorkItem
    span: Span


class ExecutorService:
    def __init__(self, config: JetserveConfig, nc, js, tracer, name: str):
        self.config, self.nc, self.tracer, self.name = config, nc, tracer, name
        self.subjects = Subjects(config.nats.prefix)
        self.outbox = Outbox(nc, js, self.subjects)
        self.engine = Engine(config.engine_config(name))
        self.running: dict[str, _Running] = {}
        self.outputs: asyncio.Queue[tuple[WorkItem, Output]] = asyncio.Queue()
        self.cancels = RecentCancels()
        self.load_changed = asyncio.Event()
        self.idle = asyncio.Event()  # set when the last running request ends
        self.assigned_total = 0
        self.started_at = time.time()
        self.counts = dict(completed=0, cancelled=0, errors=0)
        self.tasks: list[asyncio.Task] = []

    async def start(self) -> None:
        self.engine.start()
        self.service = await add_micro_service(self.nc, "executor", f"engine {self.name}",
                                               self.stats)
        await self.service.add_endpoint(name="assign", subject=self.subjects.executor_assign(
            self.name), handler=self.on_assign)
        await self.nc.subscribe(self.subjects.cancel(), cb=self.on_cancel)
        self.load_changed.set()  # the first heartbeat goes out at once
        self.tasks = [asyncio.create_task(self.publish_loop(), name="publish"),
                      asyncio.create_task(self.heartbeat_loop(), name="heartbeat")]

    async def stop(self, drain_timeout_s: float) -> None:
        """Take no new work, let running requests finish (up to the timeout), then stop."""
        await self.service.stop()
        if self.running:
            self.idle.clear()
            try:
                await asyncio.wait_for(self.idle.wait(), drain_timeout_s)
            except TimeoutError:
                log.warning("drain timed out; cancelling", running=len(self.running))
        for request_id in list(self.running):
            self.engine.abort(request_id)
        await asyncio.sleep(0.05)  # let the publisher send what the aborts produced
        for task in self.tasks:
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        await self.engine.stop()

    def stats(self) -> dict:
        scheduler, blocks = self.engine.scheduler, self.engine.block_manager
        engine = self.engine.stats
        return {"executor": self.name, "model": self.engine.model_name,
                "running": len(scheduler.running), "waiting": len(scheduler.waiting),
                "kv_blocks_free": blocks.num_free_blocks, "kv_blocks_total": blocks.num_blocks,
                "kv_usage": round(1 - blocks.num_free_blocks / blocks.num_blocks, 4),
                "steps": engine.steps, "prompt_tokens": engine.prompt_tokens,
                "decode_tokens": engine.decode_tokens, "preemptions": scheduler.num_preemptions,
                "assigned": self.assigned_total, **self.counts}

    # ------------------------------------------------------------------------- requests in

    async def on_assign(self, request: Request) -> None:
        item = _item.decode(request.data)
        self.assigned_total += 1
        self.load_changed.set()
        if self.cancels.take(item.tenant, item.request_id):
            await self.outbox.final(item, cancelled_completion(item, self.name))
            await request.respond(encode(AssignReply(accepted=True)))
            return
        span = self.tracer.start_span(
            "executor.generate", context=context_from(item.trace),
            attributes={"request_id": item.request_id, "executor": self.name,
                        "prompt_tokens": item.num_prompt_tokens})
        # The engine measures from arrival on its own clock: carry admission's stamp over.
        arrival = time.monotonic() - max(0.0, time.time() - item.arrival_time)
        try:
            self.engine.add_request(item.request, lambda out, item=item: self.outputs.put_nowait(
                (item, out)), arrival_time=arrival)
        except ProtocolError as exc:
            span.end()
            await self.outbox.final(item, exc.to_error(item.request_id))
        else:
            self.running[item.request_id] = _Running(item, span)
        await request.respond(encode(AssignReply(accepted=True)))

    async def on_cancel(self, msg) -> None:
        tenant = self.subjects.tenant_of(msg.subject)
        try:
            request_id = decode_cancel(msg.data).request_id
        except ProtocolError:
            return
        running = self.running.get(request_id)
        if running is None:
            self.cancels.add(tenant, request_id)  # it may still be on its way here
        elif running.item.tenant == tenant:
            self.engine.abort(request_id)

    # ------------------------------------------------------------------------ outputs out

    async def publish_loop(self) -> None:
        """Sends engine outputs in order; the engine's sink only enqueues, never blocks a step."""
        while True:
            item, output = await self.outputs.get()
            if isinstance(output, Delta):
                await self.outbox.delta(item, output)
                continue
            running = self.running.pop(item.request_id, None)
            if isinstance(output, Completion):
                output = msgspec.structs.replace(output, scheduling=msgspec.structs.replace(
                    output.scheduling, priority_score=item.priority_score))
                self.counts["cancelled" if output.finish_reason == "cancelled" else "completed"] += 1
            else:
                self.counts["errors"] += 1
            try:
                await self.outbox.final(item, output, carrier_of(running.span) if running else None)
            except Exception:  # the client's result must not take the executor down with it
                log.exception("could not deliver a final output", request_id=item.request_id)
            if running is not None:
                self._end_span(running.span, item, output)
            if not self.running:
                self.idle.set()
            self.load_changed.set()

    def _end_span(self, span: Span, item: WorkItem, output: Completion | Error) -> None:
        if isinstance(output, Completion):
            m = output.metrics
            span.set_attributes({"completion_tokens": output.usage.completion_tokens,
                                 "cached_tokens": output.usage.cached_tokens,
                                 "finish_reason": output.finish_reason})
            # Prefill and decode as child spans, placed on the wall clock from the metrics.
            arrival_ns = int(item.arrival_time * 1e9)
            at = lambda ms: arrival_ns + int(ms * 1e6)
            if output.usage.completion_tokens:
                for name, start, end in (("prefill", m.queue_ms, m.ttft_ms),
                                         ("decode", m.ttft_ms, m.e2e_ms)):
                    self.tracer.start_span(name, context=context_of(span),
                                           start_time=at(start)).end(end_time=at(end))
        else:
            span.set_attribute("error", output.code)
        span.end()

    async def heartbeat_loop(self) -> None:
        interval = self.config.distributed.heartbeat_interval_s
        last_busy, last_steps = 0.0, 0
        last_holding = 0.0
        while True:
            try:
                await asyncio.wait_for(self.load_changed.wait(), interval)
            except TimeoutError:
                pass
            self.load_changed.clear()
            stats = self.engine.stats
            steps = stats.steps - last_steps
            step_ms = 1e3 * (stats.model_busy_s - last_busy) / steps if steps else 0.0
            last_busy, last_steps = stats.model_busy_s, stats.steps
            await self.nc.publish(self.subjects.heartbeat, encode(self.heartbeat(step_ms)))
            if time.monotonic() - last_holding >= interval:
                last_holding = time.monotonic()
                durable = [(r.item.tenant, r.item.request_id) for r in self.running.values()
                           if r.item.durable]
                await self.nc.publish(self.subjects.holding,
                                      encode(Holding(holder=self.name, requests=durable)))
            await asyncio.sleep(HEARTBEAT_MIN_GAP_S)

    def heartbeat(self, step_ms: float) -> Heartbeat:
        scheduler, blocks = self.engine.scheduler, self.engine.block_manager
        batch = self.config.scheduler.batch_level
        return Heartbeat(
            executor=self.name, model=self.engine.model_name, max_num_seqs=batch.max_num_seqs,
            queue_depth=batch.executor_queue_depth, running=len(scheduler.running),
            # Assigned but not yet in the scheduler counts as waiting (outputs still queued).
            waiting=len(self.running) - len(scheduler.running),
            assigned_total=self.assigned_total, free_kv_blocks=blocks.num_free_blocks,
            total_kv_blocks=blocks.num_blocks, step_ms=step_ms, started_at=self.started_at)


async def serve(config, nc, js, tracer, stop: asyncio.Event, args) -> None:
    name = args.name or "executor-0"
    service = ExecutorService(config, nc, js, tracer, name)
    await service.start()
    log.info("serving", executor=name, model=service.engine.model_name,
             kv_blocks=service.engine.block_manager.num_blocks)
    await stop.wait()
    await service.stop(config.distributed.drain_timeout_s)


def main(argv: list[str] | None = None) -> None:
    asyncio.run(serve_forever("executor", serve, argv))
