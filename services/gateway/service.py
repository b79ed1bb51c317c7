"""The OpenAI-compatible HTTP gateway: OpenAI's API over HTTP on one side, jetserve's public NATS
protocol on the other, like any client (docs/openai.md). Stateless: run as many as you like.

aiohttp serves HTTP: asyncio-native (one event loop with the NATS client, no thread hop), with a
C HTTP parser, streaming responses, and a handler cancelled when its client disconnects, which
is what turns a closed stream into a cancel in the pipeline.

Each request is published on `llm.generate.<tenant>` with a reply subject of this gateway's
(`<inbox prefix>.<tenant>.<gateway id>.<n>`, under the tenant's own inboxes as `--auth`
requires); one wildcard subscription takes every reply and hands it to its request's queue.
"""

from __future__ import annotations

import asyncio
import itertools
import time

import msgspec
import structlog
from aiohttp import web
from nats.nuid import NUID
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from services.gateway.openai_api import (
    ApiError,
    Chunks,
    api_error,
    bad,
    chat_request,
    chat_response,
    completion_request,
    completion_response,
)
from shared.bus import add_micro_service, service_main
from shared.client import Output, StreamAssembler
from shared.config import JetserveConfig
from shared.metrics import counter, histogram
from shared.protocol import Cancel, Delta, Error, GenerateRequest
from shared.subjects import Subjects

log = structlog.get_logger()

_decode_output = msgspec.json.Decoder(Output).decode
_encode = msgspec.json.Encoder().encode
REQUESTS = counter("gateway_requests", "HTTP requests answered by the gateway, by endpoint and "
                   "status", ("endpoint", "status"))
FIRST_BYTE = histogram("gateway_time_to_first_token_seconds", "From a generation request's "
                       "arrival to its first token (or its answer) leaving the gateway",
                       ("endpoint",), (0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28,
                                       2.56, 5.12, 10.24, 20.48))
TRACE_HEADERS = ("traceparent", "tracestate")


class Gateway:
    def __init__(self, config: JetserveConfig, nc, js, tracer):
        self.config, self.nc = config, nc
        self.subjects = Subjects(config.nats.prefix)
        self.gateway = config.gateway
        self.models = self.gateway.served_model_names or [config.model.name]
        self.inbox_prefix = config.nats.client_inbox_prefix
        self.id = NUID().next().decode()
        self.replies: dict[str, asyncio.Queue] = {}  # reply token -> its request's outputs
        self.tokens = itertools.count()
        self.started = int(time.time())
        self.counts = dict(requests=0, streamed=0, errors=0, client_gone=0)
        self.runner: web.AppRunner | None = None
        self.port = 0

    async def start(self) -> None:
        self.subscription = await self.nc.subscribe(
            f"{self.inbox_prefix}.*.{self.id}.*", cb=self.on_reply)
        app = web.Application(client_max_size=self.gateway.max_body_bytes)
        app.add_routes([web.post("/v1/chat/completions", self.chat_completions),
                        web.post("/v1/completions", self.completions),
                        web.get("/v1/models", self.list_models),
                        web.get("/health", self.health),
                        web.get("/metrics", self.metrics)])
        self.runner = web.AppRunner(app, handler_cancellation=True, access_log=None,
                                    shutdown_timeout=self.config.distributed.drain_timeout_s)
        await self.runner.setup()
        site = web.TCPSite(self.runner, self.gateway.host, self.gateway.port)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]
        self.service = await add_micro_service(
            self.nc, "gateway", f"OpenAI HTTP API on port {self.port}", self.stats,
            self.inbox_prefix)
        # An endpoint of its own, so $SRV.STATS (and `jetserve status`) carry its stats.
        await self.service.add_endpoint(name="stats", subject=f"{self.subjects.prefix}."
                                        f"internal.gateway.{self.id}.stats",
                                        handler=self.on_stats)
        log.info("serving HTTP", host=self.gateway.host, port=self.port, models=self.models,
                 api_keys=len(self.gateway.api_keys))

    async def stop(self) -> None:
        """No new connections; requests under way finish (up to the drain timeout)."""
        if self.runner is not None:
            await self.runner.cleanup()
        await self.service.stop()
        await self.subscription.unsubscribe()

    def stats(self) -> dict:
        return {**self.counts, "in_flight": len(self.replies), "port": self.port,
                "models": self.models}

    async def on_stats(self, request) -> None:
        await request.respond(_encode(self.stats()))

    async def on_reply(self, msg) -> None:
        queue = self.replies.get(msg.subject.rsplit(".", 1)[1])
        if queue is not None:  # (a reply after its request ended is dropped)
            queue.put_nowait(msg)

    # ----------------------------------------------------------------------------- endpoints

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self.generation(request, chat=True)

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self.generation(request, chat=False)

    async def list_models(self, request: web.Request) -> web.Response:
        try:
            self.tenant(request)
        except ApiError as exc:
            return self.error("models", exc, {})
        REQUESTS.labels("models", "200").inc()
        return web.json_response({"object": "list", "data": [
            {"id": name, "object": "model", "created": self.started, "owned_by": "jetserve",
             "root": self.config.model.name} for name in self.models]})

    async def health(self, request: web.Request) -> web.Response:
        """200 while connected to NATS (the pipeline's own health: `jetserve health`)."""
        return web.Response(status=200 if self.nc.is_connected else 503)

    async def metrics(self, request: web.Request) -> web.Response:
        return web.Response(body=generate_latest(),
                            headers={"Content-Type": CONTENT_TYPE_LATEST})

    # --------------------------------------------------------------------------- generation

    def tenant(self, request: web.Request) -> str:
        """The tenant of the request's API key; `default` when no keys are configured."""
        keys = self.gateway.api_keys
        if not keys:
            return "default"
        scheme, _, key = request.headers.get("Authorization", "").partition(" ")
        tenant = keys.get(key.strip()) if scheme.lower() == "bearer" else None
        if tenant is None:
            raise ApiError(401, "a valid API key is required (Authorization: Bearer KEY)",
                           code="invalid_api_key")
        return tenant

    async def generation(self, request: web.Request, chat: bool) -> web.StreamResponse:
        endpoint = "chat" if chat else "completions"
        arrived = time.perf_counter()
        request_id = request.headers.get("X-Request-Id") or self.id + str(next(self.tokens))
        headers = {"X-Request-Id": request_id}
        self.counts["requests"] += 1
        try:
            if len(request_id) > 128:
                raise bad("X-Request-Id", "the X-Request-Id header must be 1 to 128 characters")
            tenant = self.tenant(request)
            try:
                body = msgspec.json.decode(await request.read())
            except msgspec.DecodeError as exc:
                raise bad("body", f"the body is not valid JSON: {exc}") from None
            generate = (chat_request if chat else completion_request)(
                body, self.models, request_id)
        except web.HTTPRequestEntityTooLarge:
            return self.error(endpoint, ApiError(
                413, f"the body is over {self.gateway.max_body_bytes} bytes "
                     f"(gateway.max_body_bytes)", code="payload_too_large"), headers)
        except ApiError as exc:
            return self.error(endpoint, exc, headers)
        include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
        token = str(next(self.tokens))
        queue: asyncio.Queue = asyncio.Queue()
        self.replies[token] = queue
        ended = [False]  # its final answer came (else, on the way out: cancelled)
        try:
            await self.nc.publish(
                self.subjects.generate(tenant), _encode(generate),
                reply=f"{self.inbox_prefix}.{tenant}.{self.id}.{token}",
                headers={name: request.headers[name] for name in TRACE_HEADERS
                         if name in request.headers} or None)
            deadline = asyncio.get_running_loop().time() + self.gateway.request_timeout_s
            if generate.stream:
                self.counts["streamed"] += 1
                return await self.stream(request, endpoint, generate, queue, deadline, chat,
                                         include_usage, headers, ended, arrived)
            output = await self.next_output(queue, deadline)
            ended[0] = True
            FIRST_BYTE.labels(endpoint).observe(time.perf_counter() - arrived)
            if isinstance(output, Error):
                return self.error(endpoint, api_error(output), headers)
            answer = (chat_response if chat else completion_response)(
                output, generate.model, int(time.time()))
            REQUESTS.labels(endpoint, "200").inc()
            return web.json_response(answer, headers=headers, dumps=_dumps)
        except (asyncio.CancelledError, ConnectionResetError):
            self.counts["client_gone"] += 1
            raise
        finally:
            del self.replies[token]
            if not ended[0]:  # the client went away, or time ran out: free its executor slot
                try:
                    await self.nc.publish(self.subjects.cancel(tenant),
                                          _encode(Cancel(request_id=request_id)))
                except Exception as exc:  # reconnecting: the request runs to its end
                    log.warning("could not cancel", request_id=request_id, error=repr(exc))

    async def stream(self, request: web.Request, endpoint: str, generate: GenerateRequest,
                     queue: asyncio.Queue, deadline: float, chat: bool, include_usage: bool,
                     headers: dict, ended: list, arrived: float) -> web.StreamResponse:
        """Server-sent events: a chunk per delta (the first carries the assistant role), the
        finish reason, the usage when asked for, then `data: [DONE]`. An Error before any
        chunk is an HTTP error; one after is an `error` event, then `[DONE]`."""
        chunks = Chunks(chat, generate.request_id, generate.model)
        assembled = StreamAssembler()
        response: web.StreamResponse | None = None

        async def send(obj: dict) -> None:
            nonlocal response
            if response is None:
                FIRST_BYTE.labels(endpoint).observe(time.perf_counter() - arrived)
                response = web.StreamResponse(headers={
                    **headers, "Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
                await response.prepare(request)
            await response.write(b"data: " + _encode(obj) + b"\n\n")

        while True:
            output = await self.next_output(queue, deadline)
            if isinstance(output, Delta):
                new = assembled.add(output)
                if new is not None:
                    await send(chunks.text(new.text))
                continue
            ended[0] = True
            if isinstance(output, Error):
                error = api_error(output)
                if response is None:
                    return self.error(endpoint, error, headers)
                await send(error.body())
            else:
                if output.text.startswith(assembled.text) and len(output.text) > len(
                        assembled.text):  # text held back until the end (a stop string's)
                    await send(chunks.text(output.text[len(assembled.text):]))
                elif chat and not chunks.role_sent:
                    await send(chunks.text(""))
                await send(chunks.text("", output.finish_reason))
                if include_usage:
                    await send(chunks.usage(output))
            await response.write(b"data: [DONE]\n\n")
            await response.write_eof()
            REQUESTS.labels(endpoint, "200").inc()
            return response

    async def next_output(self, queue: asyncio.Queue, deadline: float) -> Output:
        """The request's next Delta, Completion or Error (its stream's end sentinel skipped);
        an Error when no admission answers or time runs out (`gateway.request_timeout_s`)."""
        while True:
            left = deadline - asyncio.get_running_loop().time()
            try:
                msg = await asyncio.wait_for(queue.get(), max(left, 0.0))
            except TimeoutError:
                return Error(request_id=None, code="deadline_exceeded",
                             message=f"no answer within {self.gateway.request_timeout_s:g} s "
                                     f"(gateway.request_timeout_s)")
            if msg.headers and msg.headers.get("Status") == "503":  # no responders
                return Error(request_id=None, code="overloaded",
                             message="no admission service is running (no responders)")
            if msg.data:
                return _decode_output(msg.data)

    def error(self, endpoint: str, error: ApiError, headers: dict) -> web.Response:
        self.counts["errors"] += 1
        REQUESTS.labels(endpoint, str(error.status)).inc()
        return web.json_response(error.body(), status=error.status,
                                 headers={**headers, **error.headers()}, dumps=_dumps)


def _dumps(obj) -> str:
    return _encode(obj).decode()


main = service_main("gateway", Gateway)
