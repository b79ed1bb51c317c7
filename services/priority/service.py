"""The priority service: keeps the global waiting queue; the batcher pulls the best requests
(`llm.internal.priority.next`) when executors have room, so order is decided at the last moment."""

from __future__ import annotations

import asyncio
import time

import structlog
from nats.micro import Request

from services.priority.queue import WaitingQueue
from shared.bus import Outbox, add_micro_service, cancelled_completion, serve_forever
from shared.cancels import RecentCancels
from shared.config import JetserveConfig
from shared.messages import (
    Holding,
    NextReply,
    NextRequest,
    SubmitReply,
    WorkItem,
    decoder,
    encode,
)
from shared.protocol import Error, ProtocolError, decode_cancel
from shared.subjects import Subjects
from shared.telemetry import Span, carrier_of, context_from

log = structlog.get_logger()

_item = decoder(WorkItem)
_next = decoder(NextRequest)


class PriorityService:
    def __init__(self, config: JetserveConfig, nc, js, tracer):
        self.subjects = Subjects(config.nats.prefix)
        self.nc, self.tracer = nc, tracer
        self.outbox = Outbox(nc, js, self.subjects)
        self.queue = WaitingQueue(config.scheduler.request_level.max_pending_requests)
        self.cancels = RecentCancels()
        self.arrived = asyncio.Event()
        self.wait_spans: dict[str, Span] = {}  # the queue wait of each waiting request
        self.counts = dict(submitted=0, dispatched=0, cancelled=0, overloaded=0)
        self.heartbeat_interval_s = config.distributed.heartbeat_interval_s

    async def start(self) -> None:
        service = await add_micro_service(self.nc, "priority", "global waiting queue", self.stats)
        await service.add_endpoint(name="submit", subject=self.subjects.priority_submit,
                                   handler=self.on_submit)
        await service.add_endpoint(name="next", subject=self.subjects.priority_next,
                                   handler=self.on_next)
        await self.nc.subscribe(self.subjects.cancel(), cb=self.on_cancel)
        self.service = service
        self.reporter = asyncio.create_task(self.report_holding(), name="holding")

    async def stop(self) -> None:
        """Stop taking work; whoever waits here is told now rather than left to time out
        (durable requests are not: admission has them run again)."""
        await self.service.stop()
        self.reporter.cancel()
        await asyncio.gather(self.reporter, return_exceptions=True)
        for item in self.queue.pop(len(self.queue)):
            if not item.durable:
                await self.outbox.final(item, Error(
                    request_id=item.request_id, code="overloaded",
                    message="the priority service is shutting down; retry"))

    async def report_holding(self) -> None:
        """Tell admission which durable requests wait here (it redelivers ones nobody holds)."""
        while True:
            await asyncio.sleep(self.heartbeat_interval_s)
            durable = [(i.tenant, i.request_id) for i in self.queue.items() if i.durable]
            try:
                await self.nc.publish(self.subjects.holding,
                                      encode(Holding(holder="priority", requests=durable)))
            except Exception:  # missing one report is survivable; a dead loop is not
                log.exception("holding report failed")

    def stats(self) -> dict:
        return {"queue_depth": len(self.queue), "queue_by_priority": self.queue.depth_by_priority(),
                **self.counts}

    async def on_submit(self, request: Request) -> None:
        item = _item.decode(request.data)
        if self.cancels.take(item.tenant, item.request_id):
            await self.outbox.final(item, cancelled_completion(item))
            await request.respond(encode(SubmitReply()))
            return
        error = None
        if (item.tenant, item.request_id) in self.queue:
            if item.durable:  # delivered again while it waits here: it is already queued
                await request.respond(encode(SubmitReply()))
                return
            error = Error(request_id=item.request_id, code="invalid_request",
                          message=f"`request_id` {item.request_id!r} is already waiting")
        elif self.queue.full:
            self.counts["overloaded"] += 1
            error = Error(request_id=item.request_id, code="overloaded",
                          message=f"the waiting queue is full (max_pending_requests "
                                  f"{self.queue.capacity})")
        if error is not None:
            await request.respond(encode(SubmitReply(error=error)))
            return
        self.queue.push(item)
        self.counts["submitted"] += 1
        self.wait_spans[(item.tenant, item.request_id)] = self.tracer.start_span(
            "priority.queue", context=context_from(item.trace),
            attributes={"request_id": item.request_id, "tenant": item.tenant,
                        "priority": item.request.priority})
        self.arrived.set()
        await request.respond(encode(SubmitReply()))

    async def on_next(self, request: Request) -> None:
        """Long poll: answer at once when requests wait, else when one arrives or `wait_ms` ends."""
        ask = _next.decode(request.data)
        deadline = time.monotonic() + ask.wait_ms / 1e3
        while not self.queue and (left := deadline - time.monotonic()) > 0:
            self.arrived.clear()
            try:
                await asyncio.wait_for(self.arrived.wait(), left)
            except TimeoutError:
                break
        items = self.queue.pop(ask.max_items)
        for item in items:
            span = self.wait_spans.pop((item.tenant, item.request_id))
            span.set_attribute("priority_score", item.priority_score)
            span.end()
            item.trace = carrier_of(span)
        self.counts["dispatched"] += len(items)
        await request.respond(encode(NextReply(items=items)))

    async def on_cancel(self, msg) -> None:
        tenant = self.subjects.tenant_of(msg.subject)
        try:
            cancel = decode_cancel(msg.data)
        except ProtocolError:
            return  # admission answers malformed cancels; nothing to do here
        item = self.queue.remove(cancel.request_id, tenant)
        if item is None:
            self.cancels.add(tenant, cancel.request_id)  # it may still be on its way here
            return
        self.counts["cancelled"] += 1
        span = self.wait_spans.pop((item.tenant, item.request_id))
        span.set_attribute("cancelled", True)
        span.end()
        await self.outbox.final(item, cancelled_completion(item))


async def serve(config, nc, js, tracer, stop: asyncio.Event, args) -> None:
    service = PriorityService(config, nc, js, tracer)
    await service.start()
    log.info("serving", subjects=[service.subjects.priority_submit, service.subjects.priority_next])
    await stop.wait()
    await service.stop()


def main(argv: list[str] | None = None) -> None:
    asyncio.run(serve_forever("priority", serve, argv))
