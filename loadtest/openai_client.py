"""`jetserve bench serve --backend openai`: the same arrivals, datasets and figures as over NATS,
against any OpenAI-compatible server over HTTP (jetserve's gateway, `vllm serve`, ...), so one
load generator measures both on one workload.

Each request is one streaming POST (`stream_options.include_usage`): TTFT and inter-token gaps
from the server-sent chunks that carry text (as `vllm bench serve` counts them), token counts
from the final `usage`. A token-id prompt goes as is to `/v1/completions`; to
`/v1/chat/completions` it goes as its text (the model's tokenizer decodes it), in one user
message. jetserve's priority classes go as vLLM's `priority` (`5 - class`, docs/openai.md)."""

from __future__ import annotations

import asyncio
import json
import random
import time
from dataclasses import asdict

import aiohttp

from loadtest.metrics import RequestRecord, Slo, summarize
from shared.protocol import GenerateRequest

IDLE_TIMEOUT_S = 120.0  # no chunk for this long: the request is this client's error


class OpenAIBackend:
    def __init__(self, args, base_url: str):
        self.base_url = base_url.rstrip("/")
        self.endpoint = args.endpoint
        self.model = args.served_model_name or args.model
        self.headers = {"Content-Type": "application/json",
                        **({"Authorization": f"Bearer {args.api_key}"} if args.api_key else {})}
        self.decode = None
        if self.endpoint == "chat":
            from shared.model_files import load_model_config, tokenizer_dir
            from shared.tokenizer import Tokenizer

            tokenizer = Tokenizer(tokenizer_dir(load_model_config(args.model, weights=False)[1]))
            self.decode = tokenizer.decode

    def body(self, request: GenerateRequest) -> dict:
        body = {"model": self.model, "stream": True, "stream_options": {"include_usage": True},
                "max_tokens": request.max_tokens, "temperature": request.temperature}
        if request.ignore_eos:
            body["ignore_eos"] = True
        if request.priority != 5:
            body["priority"] = 5 - request.priority
        if request.deadline_ms is not None:
            body["deadline_ms"] = request.deadline_ms
        if request.seed is not None:
            body["seed"] = request.seed
        if request.stop:
            body["stop"] = request.stop
        if self.endpoint == "completions":
            body["prompt"] = request.prompt_token_ids or request.prompt
            if request.messages:
                raise SystemExit("a chat dataset needs --endpoint chat")
        elif request.messages:
            body["messages"] = [{"role": m.role, "content": m.content} for m in request.messages]
        else:
            text = request.prompt if request.prompt is not None else self.decode(
                request.prompt_token_ids)
            body["messages"] = [{"role": "user", "content": text}]
        return body

    async def send(self, session: aiohttp.ClientSession, request: GenerateRequest,
                   record: RequestRecord, clock) -> None:
        path = "/chat/completions" if self.endpoint == "chat" else "/completions"
        try:
            async with session.post(self.base_url + path, json=self.body(request),
                                    headers=self.headers) as response:
                if response.status != 200:
                    text = await response.text()
                    try:
                        code = json.loads(text)["error"].get("code") or response.status
                    except (ValueError, KeyError, TypeError, AttributeError):
                        code = response.status
                    record.end_time, record.error = clock(), f"http_{response.status}:{code}"
                    return
                chunks = 0
                async for line in response.content:
                    if not line.startswith(b"data: "):
                        continue
                    data = line[6:].strip()
                    if data == b"[DONE]":
                        break
                    now = clock()
                    chunk = json.loads(data)
                    if "error" in chunk:
                        record.error = str(chunk["error"].get("code") or "error")
                        continue
                    if chunk.get("usage"):
                        record.output_tokens = chunk["usage"]["completion_tokens"]
                        record.prompt_tokens = chunk["usage"]["prompt_tokens"]
                    for choice in chunk.get("choices") or []:
                        text = choice.get("text") or (choice.get("delta") or {}).get("content")
                        if text:
                            chunks += 1
                            record.delta_times.append(now)
                            record.delta_tokens.append(1)
                        if choice.get("finish_reason"):
                            record.finish_reason = choice["finish_reason"]
                record.end_time = clock()
                if not record.output_tokens:  # no usage chunk: the chunks are the count
                    record.output_tokens = chunks
        except (aiohttp.ClientError, TimeoutError) as exc:
            record.end_time, record.error = clock(), f"client:{type(exc).__name__}"


async def run_openai(args, base_url: str) -> dict:
    from loadtest.serve import _parameters, plan, send_on_schedule

    rng = random.Random(args.seed)
    offsets, planned = plan(args, rng)
    backend = OpenAIBackend(args, base_url)
    records: list[RequestRecord] = []
    start = time.perf_counter()
    clock = lambda: time.perf_counter() - start  # noqa: E731
    limit = asyncio.Semaphore(args.max_concurrency) if args.max_concurrency else None
    session = aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=0),  # as many connections as requests in flight
        timeout=aiohttp.ClientTimeout(total=None, sock_read=IDLE_TIMEOUT_S))

    async def send(request, record, _tenant):  # (the API key is the tenant here)
        try:
            await backend.send(session, request, record, clock)
        finally:
            if limit:
                limit.release()

    try:
        tasks = await send_on_schedule(offsets, planned, clock, limit, send, records)
        if tasks:
            _, pending = await asyncio.wait(tasks, timeout=args.drain_timeout)
            for task in pending:  # outstanding: reported, and their connections closed
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
    finally:
        await session.close()
    ends = [r.end_time for r in records if r.end_time is not None]
    duration = max(ends) if ends else clock()
    return {"label": args.label, "summary": summarize(records, duration, Slo.parse(args.goodput)),
            "parameters": {**_parameters(args, base_url), "backend": "openai"},
            "timeline": [], "requests": [asdict(r) for r in records]}
