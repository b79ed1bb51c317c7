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
import os
import re
import stat
import secrets
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
    detokenize_tokens,
    finish_reason,
    tokenize_request,
)
from shared.bus import ENVELOPE_BYTES, add_micro_service, every, service_main
from shared.client import Output, StreamAssembler
from shared.config import JetserveConfig
from shared.metrics import counter, histogram
from shared.preprocess import check_prompt_size, prompt_token_ids, served_model
from shared.protocol import (
    Cancel,
    Delta,
    Error,
    GenerateRequest,
    ProtocolError,
    check_nesting,
)
from shared.subjects import TENANT_PATTERN, Subjects
from shared.telemetry import SpanKind, carrier_of, context_from

log = structlog.get_logger()

_decode_output = msgspec.json.Decoder(Output).decode
_encode = msgspec.json.Encoder().encode
REQUESTS = counter("gateway_requests", "HTTP requests answered by the gateway, by endpoint and "
                   "status", ("endpoint", "status"))
FIRST_BYTE = histogram("gateway_time_to_first_token_seconds", "From a generation request's "
                       "arrival to its first token (or its answer) leaving the gateway",
                       ("endpoint",), (0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28,
                                       2.56, 5.12, 10.24, 20.48))
TRACEPARENT = re.compile(r"[0-9a-f]{2}-[0-9a-f]{32}-[0-9a-f]{16}-[0-9a-f]{2}")
TRACESTATE_MAX = 512  # characters (W3C: at most 32 entries of 256; more is dropped, not sent)
CLIENT_REQUEST_ID = re.compile(r"[\x21-\x7e]{1,128}")  # printable ASCII, no spaces
KEYS_FILE_MAX_BYTES = 16 << 20
KEYS_FILE_POLL_S = 1.0  # how soon a key `jetserve tenant add|remove` writes takes effect
WRITE_TIMEOUT_S = 60.0  # a client that reads nothing of its stream this long is gone
SHUTDOWN = object()  # put in a request's reply queue when the drain time is up


class Gateway:
    def __init__(self, config: JetserveConfig, nc, js, tracer):
        self.config, self.nc, self.tracer = config, nc, tracer
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
        self.draining = False
        self.handling = 0  # generation requests being handled, sent to the pipeline or not
        self.file_keys: dict[str, str] = {}  # from gateway.api_keys_file, as last read
        self.file_stamp: tuple | None = ()  # (none read yet)
        self.keys_poll: asyncio.Task | None = None
        # The model's tokenizer and limits, as admission's: /tokenize, /detokenize, and the
        # prompt count of `continuous_usage_stats`.
        self.tokenizer, self.vocab_size, self.max_model_len = served_model(config.model)

    async def start(self) -> None:
        if self.gateway.api_keys_file is not None:
            await self.read_keys()
            self.keys_poll = asyncio.create_task(every(KEYS_FILE_POLL_S, self.read_keys))
        self.subscription = await self.nc.subscribe(
            f"{self.inbox_prefix}.*.{self.id}.*", cb=self.on_reply)
        app = web.Application(client_max_size=self.gateway.max_body_bytes,
                              middlewares=[openai_errors])
        app.add_routes([web.post("/v1/chat/completions", self.chat_completions),
                        web.post("/v1/completions", self.completions),
                        web.get("/v1/models", self.list_models),
                        web.post("/tokenize", self.tokenize),
                        web.post("/detokenize", self.detokenize),
                        web.get("/health", self.health),
                        web.get("/metrics", self.metrics)])
        # The drain is stop()'s own; by the runner's cleanup every handler is ending (aiohttp
        # may wait this twice; with the NATS drain the whole stop stays inside the drain time
        # plus shared.bus.STOP_GRACE_S).
        self.runner = web.AppRunner(app, handler_cancellation=True, access_log=None,
                                    shutdown_timeout=2.0)
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
                 api_keys=len(self.gateway.api_keys), api_keys_file=self.gateway.api_keys_file)

    async def stop(self) -> None:
        """No new connections or requests (503); requests under way finish, up to
        `distributed.drain_timeout_s`. Then each one still open ends as a client would want:
        a stream with an `error` event and `data: [DONE]`, any other with a 503, and its
        request is cancelled in the pipeline (never a stream cut without its end)."""
        if self.runner is not None:
            self.draining = True
            for site in list(self.runner.sites):
                await site.stop()
            loop = asyncio.get_running_loop()
            deadline = loop.time() + self.config.distributed.drain_timeout_s
            while self.handling and loop.time() < deadline:
                await asyncio.sleep(0.05)
            if self.replies:
                log.info("drain time is up: ending open requests", open=len(self.replies))
            for queue in self.replies.values():
                queue.put_nowait(SHUTDOWN)
            await self.runner.cleanup()
        if self.keys_poll is not None:
            self.keys_poll.cancel()
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

    async def tokenize(self, request: web.Request) -> web.Response:
        """vLLM's: the prompt's token ids (the chat template applied to `messages`)."""
        generate = None
        try:
            self.tenant(request)
            body = await self.json_body(request)
            generate = tokenize_request(body, self.models)
            tokens = await asyncio.to_thread(prompt_token_ids, self.tokenizer, generate,
                                             self.vocab_size)
            if body.get("add_special_tokens") is False and generate.prompt is not None \
                    and self.tokenizer.add_bos and tokens[:1] == [self.tokenizer.bos_token_id]:
                tokens = tokens[1:]  # the text's own tokens, without the BOS generation adds
        except ApiError as exc:
            return self.error("tokenize", exc, {})
        except ProtocolError as exc:
            return self.error("tokenize", bad("messages" if generate and generate.messages
                                              else "prompt", exc.message), {})
        REQUESTS.labels("tokenize", "200").inc()
        return web.json_response({"count": len(tokens), "max_model_len": self.max_model_len,
                                  "tokens": tokens, "token_strs": None}, dumps=_dumps)

    async def detokenize(self, request: web.Request) -> web.Response:
        try:
            self.tenant(request)
            tokens = detokenize_tokens(await self.json_body(request), self.models,
                                       self.vocab_size)
        except ApiError as exc:
            return self.error("detokenize", exc, {})
        text = await asyncio.to_thread(self.tokenizer.decode, tokens)
        REQUESTS.labels("detokenize", "200").inc()
        return web.json_response({"prompt": text}, dumps=_dumps)

    async def json_body(self, request: web.Request) -> object:
        """The request's JSON body, or an ApiError naming what is wrong with it."""
        try:
            raw = await request.read()
        except web.HTTPRequestEntityTooLarge:
            raise ApiError(413, f"the body is over {self.gateway.max_body_bytes} bytes "
                                f"(gateway.max_body_bytes)", code="payload_too_large") from None
        try:
            check_nesting(raw)
        except ProtocolError as exc:
            raise bad("body", f"the body {exc.message.removeprefix('the payload ')}") from None
        try:
            return msgspec.json.decode(raw)
        except msgspec.DecodeError as exc:
            raise bad("body", f"the body is not valid JSON: {exc}") from None

    async def health(self, request: web.Request) -> web.Response:
        """200 while connected to NATS and not draining (the pipeline's own health: `jetserve
        health`)."""
        return web.Response(status=200 if self.nc.is_connected and not self.draining else 503)

    async def metrics(self, request: web.Request) -> web.Response:
        return web.Response(body=generate_latest(),
                            headers={"Content-Type": CONTENT_TYPE_LATEST})

    # --------------------------------------------------------------------------- generation

    async def read_keys(self) -> None:
        """`gateway.api_keys_file` again when it changed (its mtime, size or inode), off the
        event loop: a JSON object of API key -> tenant. A missing file means no keys (every
        request a 401); one that is unreadable, not a regular file, too large or not such an
        object leaves the keys read before; entries with an empty key, whitespace in it or an
        invalid tenant name are dropped, said in the log."""
        path = os.path.expanduser(self.gateway.api_keys_file)

        def load() -> tuple[tuple | None, dict | str | None]:
            try:
                info = os.stat(path)
            except OSError:
                return None, None
            stamp = (info.st_mtime_ns, info.st_size, info.st_ino)
            if stamp == self.file_stamp:
                return stamp, None
            if not stat.S_ISREG(info.st_mode) or info.st_size > KEYS_FILE_MAX_BYTES:
                return stamp, f"not a regular file of at most {KEYS_FILE_MAX_BYTES} bytes"
            try:
                with open(path, "rb") as file:
                    return stamp, msgspec.json.decode(file.read(KEYS_FILE_MAX_BYTES + 1),
                                                      type=dict[str, str])
            except (OSError, msgspec.DecodeError) as exc:
                return stamp, repr(exc)

        stamp, read = await asyncio.to_thread(load)
        if stamp == self.file_stamp:
            return
        self.file_stamp = stamp
        if stamp is None:
            self.file_keys = {}
            log.warning("API keys file missing: every request is refused (401) until it "
                        "exists", file=path)
        elif isinstance(read, str):
            log.warning("API keys file unreadable; the keys read before stay", file=path,
                        error=read)
        elif read is not None:
            self.file_keys = {key: tenant for key, tenant in read.items()
                              if key and not any(c.isspace() for c in key)
                              and TENANT_PATTERN.fullmatch(tenant)}
            dropped = len(read) - len(self.file_keys)
            (log.warning if dropped else log.info)(
                "API keys read", file=path, keys=len(self.file_keys), dropped=dropped)

    def api_keys(self) -> dict[str, str]:
        """`gateway.api_keys` and those of `gateway.api_keys_file` as last read."""
        return {**self.file_keys, **self.gateway.api_keys}

    def tenant(self, request: web.Request) -> str:
        """The tenant of the request's API key; `default` when no keys are configured (no
        `api_keys`, no `api_keys_file`)."""
        keys = self.api_keys()
        if not keys and self.gateway.api_keys_file is None:
            return "default"
        scheme, _, key = request.headers.get("Authorization", "").partition(" ")
        tenant = keys.get(key) if scheme.lower() == "bearer" else None
        if tenant is None:
            raise ApiError(401, "a valid API key is required (Authorization: Bearer KEY)",
                           code="invalid_api_key")
        return tenant

    def trace_headers(self, request: web.Request) -> dict[str, str] | None:
        """The client's W3C trace context, passed on to the pipeline when well formed."""
        parent = request.headers.get("traceparent", "")
        if not TRACEPARENT.fullmatch(parent):
            return None
        state = request.headers.get("tracestate", "")
        return {"traceparent": parent, **({"tracestate": state}
                                          if state and len(state) <= TRACESTATE_MAX else {})}

    async def generation(self, request: web.Request, chat: bool) -> web.StreamResponse:
        self.handling += 1  # (the drain waits for these, from their first byte on)
        try:
            return await self._generation(request, chat)
        finally:
            self.handling -= 1

    async def _generation(self, request: web.Request, chat: bool) -> web.StreamResponse:
        endpoint = "chat" if chat else "completions"
        arrived = time.perf_counter()
        # The pipeline's id is always a fresh one: a client's could be another's (cancels
        # match by tenant and id). X-Request-Id, when sent, is only echoed back.
        request_id = secrets.token_urlsafe(16)
        headers = {"X-Request-Id": request_id}
        self.counts["requests"] += 1
        try:
            if "X-Request-Id" in request.headers:
                if not CLIENT_REQUEST_ID.fullmatch(request.headers["X-Request-Id"]):
                    raise bad("X-Request-Id", "the X-Request-Id header must be 1 to 128 "
                                              "printable ASCII characters")
                headers["X-Request-Id"] = request.headers["X-Request-Id"]
            tenant = self.tenant(request)
            if self.draining:
                raise ApiError(503, "the gateway is shutting down; retry on another",
                               code="overloaded")
            body = await self.json_body(request)
            generate = (chat_request if chat else completion_request)(
                body, self.models, request_id)
            payload = _encode(generate)
            budget = self.nc.max_payload - ENVELOPE_BYTES
            if len(payload) > budget:
                raise ApiError(413, f"the request is {len(payload)} bytes as jetserve sends it, "
                                    f"over the NATS server's max_payload ({budget} bytes here)",
                               code="payload_too_large")
        except ApiError as exc:
            return self.error(endpoint, exc, headers)
        options = body.get("stream_options") or {}
        include_usage = bool(options.get("include_usage"))
        prompt_tokens = None
        if options.get("continuous_usage_stats"):  # the prompt's tokens, as admission counts them
            try:  # (one that must be too long is refused unread, as admission would)
                check_prompt_size(self.tokenizer, generate, self.max_model_len)
                prompt_tokens = len(await asyncio.to_thread(
                    prompt_token_ids, self.tokenizer, generate, self.vocab_size))
            except ProtocolError as exc:  # (invalid_request, or prompt_too_long: as admission)
                return self.error(endpoint, ApiError(400, exc.message, code=exc.code,
                                                     param="messages" if chat else "prompt"),
                                  headers)
        if self.draining:  # (it read its body while the drain began: not sent yet)
            return self.error(endpoint, ApiError(503, "the gateway is shutting down; retry on "
                                                      "another", code="overloaded"), headers)
        token = str(next(self.tokens))
        queue: asyncio.Queue = asyncio.Queue()
        self.replies[token] = queue
        ended = [False]  # its final answer came (else, on the way out: cancelled)
        # The request's trace begins here (or continues the client's): admission's span and
        # every later one are this one's children.
        span = self.tracer.start_span(
            "gateway", context=context_from(self.trace_headers(request)), kind=SpanKind.SERVER,
            attributes={"tenant": tenant, "request_id": request_id, "endpoint": endpoint,
                        "stream": generate.stream})
        try:
            try:
                await self.nc.publish(self.subjects.generate(tenant), payload,
                                      headers=carrier_of(span),
                                      reply=f"{self.inbox_prefix}.{tenant}.{self.id}.{token}")
            except Exception as exc:  # reconnecting, or closed: it was not sent
                ended[0] = True
                return self.error(endpoint, ApiError(503, f"the gateway cannot reach NATS now "
                                                          f"({exc!r}); retry", code="overloaded"),
                                  headers)
            deadline = asyncio.get_running_loop().time() + self.gateway.request_timeout_s
            if generate.stream:
                self.counts["streamed"] += 1
                return await self.stream(request, endpoint, generate, queue, deadline, chat,
                                         include_usage, headers, ended, arrived, prompt_tokens)
            output, ended[0] = await self.next_output(queue, deadline)
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
            span.set_attribute("ended", ended[0])
            span.end()
            del self.replies[token]
            if not ended[0]:  # the client went away, or time ran out: free its executor slot
                try:
                    await self.nc.publish(self.subjects.cancel(tenant),
                                          _encode(Cancel(request_id=request_id)))
                except Exception as exc:  # reconnecting: the request runs to its end
                    log.warning("could not cancel", request_id=request_id, error=repr(exc))

    async def stream(self, request: web.Request, endpoint: str, generate: GenerateRequest,
                     queue: asyncio.Queue, deadline: float, chat: bool, include_usage: bool,
                     headers: dict, ended: list, arrived: float,
                     prompt_tokens: int | None = None) -> web.StreamResponse:
        """Server-sent events: a chunk per delta (the first carries the assistant role), the
        finish reason, the usage when asked for (with `prompt_tokens`: on every chunk too),
        then `data: [DONE]`. An Error before any chunk is an HTTP error; one after is an
        `error` event, then `[DONE]`."""
        chunks = Chunks(chat, generate.request_id, generate.model)
        chunks.prompt_tokens = prompt_tokens
        assembled = StreamAssembler()
        response: web.StreamResponse | None = None

        async def send(obj: dict | bytes) -> None:
            nonlocal response
            if response is None:
                FIRST_BYTE.labels(endpoint).observe(time.perf_counter() - arrived)
                response = web.StreamResponse(headers={
                    **headers, "Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
                await response.prepare(request)
            data = obj if isinstance(obj, bytes) else b"data: " + _encode(obj) + b"\n\n"
            try:  # a client that reads nothing for this long is taken for gone
                await asyncio.wait_for(response.write(data), WRITE_TIMEOUT_S)
            except TimeoutError:
                raise ConnectionResetError("the client stopped reading its stream") from None

        while True:
            output, ended[0] = await self.next_output(queue, deadline)
            if isinstance(output, Delta):
                try:
                    new = assembled.add(output)
                except ValueError as exc:  # a delta lost (NATS reconnected): cannot go on
                    output = Error(request_id=generate.request_id, code="internal",
                                   message=f"the stream lost a part: {exc}")
                else:
                    if new is not None:
                        chunks.completion_tokens = len(assembled.token_ids)
                        await send(chunks.text(new.text))
                    continue
            if isinstance(output, Error):
                error = api_error(output)
                if response is None:
                    return self.error(endpoint, error, headers)
                await send(error.body())
            else:
                chunks.completion_tokens = output.usage.completion_tokens
                if output.text.startswith(assembled.text) and len(output.text) > len(
                        assembled.text):  # text held back until the end (a stop string's)
                    await send(chunks.text(output.text[len(assembled.text):]))
                elif chat and not chunks.role_sent:
                    await send(chunks.text(""))
                await send(chunks.text("", finish_reason(output)))
                if include_usage:
                    await send(chunks.usage(output))
            await send(b"data: [DONE]\n\n")
            await response.write_eof()
            REQUESTS.labels(endpoint, "200").inc()
            return response

    async def next_output(self, queue: asyncio.Queue, deadline: float) -> tuple[Output, bool]:
        """The request's next Delta, Completion or Error (its stream's end sentinel skipped),
        and whether the request has ended in the pipeline: a Completion or Error it sent, or
        nobody took it (no responders). Time running out (`gateway.request_timeout_s`), or
        what is no output, is an Error here while the request may still run."""
        while True:
            left = deadline - asyncio.get_running_loop().time()
            try:
                msg = await asyncio.wait_for(queue.get(), max(left, 0.0))
                if msg is SHUTDOWN:
                    return Error(request_id=None, code="overloaded", message="the gateway is "
                                 "shutting down (its drain time is up); the request is "
                                 "cancelled"), False
            except TimeoutError:
                return Error(request_id=None, code="deadline_exceeded",
                             message=f"no answer within {self.gateway.request_timeout_s:g} s "
                                     f"(gateway.request_timeout_s)"), False
            if msg.headers and msg.headers.get("Status") == "503":  # no responders
                return Error(request_id=None, code="overloaded",
                             message="no admission service is running (no responders)"), True
            if not msg.data:
                continue
            try:
                output = _decode_output(msg.data)
            except msgspec.DecodeError:
                return Error(request_id=None, code="internal", message="the pipeline's answer "
                             "could not be read"), False
            return output, not isinstance(output, Delta)

    def error(self, endpoint: str, error: ApiError, headers: dict) -> web.Response:
        self.counts["errors"] += 1
        REQUESTS.labels(endpoint, str(error.status)).inc()
        extra = {"WWW-Authenticate": "Bearer"} if error.status == 401 else {}
        return web.json_response(error.body(), status=error.status,
                                 headers={**headers, **error.headers(), **extra}, dumps=_dumps)


def _dumps(obj) -> str:
    return _encode(obj).decode()


@web.middleware
async def openai_errors(request: web.Request, handler):
    """aiohttp's own errors (no such route, a method not allowed) in OpenAI's shape too."""
    try:
        return await handler(request)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        REQUESTS.labels("other", str(exc.status)).inc()
        return web.json_response(ApiError(exc.status, f"{exc.reason}: {request.method} "
                                                      f"{request.path[:200]}").body(),
                                 status=exc.status, dumps=_dumps)


main = service_main("gateway", Gateway)
