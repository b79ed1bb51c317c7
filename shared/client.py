"""A small asyncio client of the public protocol: generate, stream, durable submit, cancel.

    async with await JetserveClient.connect("nats://127.0.0.1:4222", tenant="acme") as client:
        completion = await client.generate(GenerateRequest(prompt="Hello", max_tokens=16))
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import msgspec
import nats
from nats.aio.client import Client
from nats.errors import Error as NatsError
from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeoutError
from nats.js.api import PubAck
from nats.js.errors import (
    APIError,
    NoStreamResponseError,
    NotFoundError,
    ServiceUnavailableError,
)

from shared.config import nats_servers
from shared.protocol import Cancel, Completion, Delta, Error, GenerateRequest
from shared.subjects import (
    DURABLE_ID_PATTERN,
    REQUESTS_STREAM,
    RESULTS_STREAM,
    Subjects,
    final_result,
    retryable_result,
)

Output = Delta | Completion | Error
SUBMITTED_KEPT = 100_000  # durable ids whose earlier result a client keeps (see `result`)
# JetStream away for now: a stream electing its leader (a NATS node died: seconds), or the
# connection reconnecting. A durable submission is tried again this long.
AWAY = (NoStreamResponseError, NoRespondersError, NatsTimeoutError, asyncio.TimeoutError,
        ServiceUnavailableError)
SUBMIT_AGAIN_S = 15.0
_decode_output = msgspec.json.Decoder(Output).decode
_encode = msgspec.json.Encoder().encode


class StreamAssembler:
    """A request's output rebuilt from its deltas, each token once (docs/protocol.md).

    Deltas follow on from each other: a delta's tokens start at its `index`, its text where the
    previous delta's text ended. A stream that restarts (a durable request resumed on another
    executor) restates the output from index 0, text and all; of a delta, only what lies beyond
    what is already here is new."""

    def __init__(self):
        self.token_ids: list[int] = []
        self.text = ""
        self._text_at = 0  # where the incoming stream's next text starts
        self.restarts = 0

    def add(self, delta: Delta) -> Delta | None:
        """The new part of `delta` (index = tokens already here), or None if it had none."""
        if delta.index == 0 and self.token_ids:
            self._text_at = 0
            self.restarts += 1
        skip = len(self.token_ids) - delta.index
        if skip < 0:
            raise ValueError(f"delta at index {delta.index}, after {len(self.token_ids)} tokens: "
                             f"a gap")
        tokens = delta.token_ids[skip:]
        text = delta.text[max(0, len(self.text) - self._text_at):]
        self._text_at += len(delta.text)
        if not tokens and not text:
            return None
        new = Delta(request_id=delta.request_id, index=len(self.token_ids), token_ids=tokens,
                    text=text)
        self.token_ids += tokens
        self.text += text
        return new


class JetserveClient:
    def __init__(self, nc: Client, tenant: str = "default", prefix: str = "llm"):
        self.nc = nc
        self.js = nc.jetstream()
        self.tenant = tenant
        self.subjects = Subjects(prefix)
        # Durable ids submitted here -> the LLM_RESULTS sequence of the result their subject
        # held then (0: none): a retryable refusal at or below it answered an earlier try.
        self.submitted: dict[str, int] = {}

    @classmethod
    async def connect(cls, url: str, tenant: str = "default", prefix: str = "llm",
                      inbox_prefix: str = "_INBOX", **options) -> JetserveClient:
        """`url` may hold the tenant's credentials (`jetserve tenant add` prints such a URL),
        and may be a comma-separated list of a cluster's servers;
        `options` are nats-py's (`tls`, `user_credentials`, ...). Inboxes are made under
        `<inbox_prefix>.<tenant>.`, the only inboxes a tenant's NATS permissions let it read
        (docs/operations.md)."""
        nc = await nats.connect(nats_servers(url), name="jetserve-client",
                                inbox_prefix=f"{inbox_prefix}.{tenant}", **options)
        return cls(nc, tenant, prefix)

    async def close(self) -> None:
        if not self.nc.is_closed:  # (the server may have closed it: a tenant removed)
            await self.nc.drain()

    async def __aenter__(self) -> JetserveClient:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def generate(self, request: GenerateRequest, timeout: float = 600.0) -> Completion | Error:
        """One request, one reply (`stream` is turned off)."""
        request = msgspec.structs.replace(request, stream=False)
        reply = await self.nc.request(self.subjects.generate(self.tenant), _encode(request),
                                      timeout=timeout)
        if not reply.data:  # a service error reply without a body: its headers say why
            headers = reply.headers or {}
            return Error(request_id=request.request_id, code="internal",
                         message=headers.get("Nats-Service-Error", "empty reply"))
        return _decode_output(reply.data)

    async def stream(self, request: GenerateRequest, timeout: float = 600.0,
                     idle_timeout: float = 120.0) -> AsyncIterator[Output]:
        """Deltas as they come, then the Completion or Error (the sentinel after it is not
        awaited). `idle_timeout` bounds the wait for each message, `timeout` the whole request.
        A stream that restarts (the request continued on another executor) is assembled: each
        delta yielded holds only tokens and text not yielded before."""
        request = msgspec.structs.replace(request, stream=True)
        inbox = self.nc.new_inbox()
        sub = await self.nc.subscribe(inbox)
        request_id, finished = request.request_id, False
        assembled = StreamAssembler()
        try:
            await self.nc.publish(self.subjects.generate(self.tenant), _encode(request), reply=inbox)
            loop = asyncio.get_running_loop()
            deadline = loop.time() + timeout
            while True:
                wait = min(idle_timeout, deadline - loop.time())
                msg = await sub.next_msg(timeout=max(wait, 0.001))
                if not msg.data:  # the sentinel: the stream is over
                    return
                output = _decode_output(msg.data)
                request_id = request_id or output.request_id
                finished = not isinstance(output, Delta)
                if not finished:
                    output = assembled.add(output)
                    if output is None:
                        continue
                yield output
                if finished:
                    return
        finally:
            with contextlib.suppress(NatsError):  # the connection may already be draining
                await sub.unsubscribe()
                if not finished and request_id:
                    await self.cancel(request_id)  # the caller stopped listening: free the slot

    async def submit(self, request: GenerateRequest) -> PubAck:
        """Durable submission into LLM_REQUESTS, on `llm.requests.<tenant>.<request_id>`; the
        PubAck says it is durably accepted. A repeat is reported, `duplicate` set and nothing
        stored: when the request has its result (`stream` LLM_RESULTS, `seq` the result's), or
        is still waiting or running (`stream` LLM_REQUESTS, `seq` 0: JetStream keeps one message
        per subject and refused this one). A repeat that races its request's end is accepted,
        and admission answers it with the stored result instead of running it again.

        While JetStream does not answer (a stream electing its leader after a NATS node died,
        the connection reconnecting) it is tried again for up to SUBMIT_AGAIN_S; a try whose
        ack was lost makes the next one a repeat (`duplicate`, `seq` 0: it is stored)."""
        if not request.request_id or not DURABLE_ID_PATTERN.fullmatch(request.request_id):
            raise ValueError("a durable submission needs a request_id matching "
                             "[A-Za-z0-9_-]{1,128} (it is a subject token)")
        deadline = asyncio.get_running_loop().time() + SUBMIT_AGAIN_S
        tries = 0
        while True:
            try:
                return await self._submit(request)
            except AWAY:
                if asyncio.get_running_loop().time() >= deadline:
                    raise
                tries += 1
                await asyncio.sleep(min(0.25 * tries, 2.0))

    async def _submit(self, request: GenerateRequest) -> PubAck:
        earlier = 0  # the sequence of a retryable refusal of an earlier try, if one is stored
        try:
            stored = await self.js.get_last_msg(
                RESULTS_STREAM, self.subjects.results(self.tenant, request.request_id),
                direct=True)
            if final_result(stored.headers, self.tenant, request.request_id):
                return PubAck(stream=RESULTS_STREAM, seq=stored.seq, duplicate=True)
            earlier = stored.seq
        except NotFoundError:
            pass
        subject = self.subjects.requests(self.tenant, request.request_id)
        self.submitted.pop(request.request_id, None)  # (kept in submission order)
        self.submitted[request.request_id] = earlier
        if len(self.submitted) > SUBMITTED_KEPT:  # ids never asked for their result: the oldest
            del self.submitted[next(iter(self.submitted))]
        try:
            return await self.js.publish(subject, _encode(request))
        except APIError as exc:  # the server's words for the per-subject limit
            if "per subject" not in (exc.description or ""):
                raise
            return PubAck(stream=REQUESTS_STREAM, seq=0, duplicate=True)

    async def result(self, request_id: str, timeout: float = 600.0) -> Completion | Error:
        """The final output of a durable request, from LLM_RESULTS (waits until it is stored):
        looked up by subject (a direct get), again whenever something is published on the
        subject and at least each second. Both are scoped to the subject, which is what a
        tenant's permissions allow (no JetStream consumer is made)."""
        subject = self.subjects.results(self.tenant, request_id)
        sub = await self.nc.subscribe(subject)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        try:
            while True:
                # Only what the stream stored: a subscriber can see a result before it is
                # stored (or one the stream refused), and one published just before the
                # subscription, before it was stored, is found by the next look (each second).
                with contextlib.suppress(NotFoundError, *AWAY):  # (away: looked again)
                    stored = await self.js.get_last_msg(RESULTS_STREAM, subject, direct=True)
                    # A retryable refusal answers this try only if stored after its submission
                    # (a later sequence than the one its subject held then), however soon.
                    if final_result(stored.headers, self.tenant, request_id) or (
                            retryable_result(stored.headers, self.tenant, request_id)
                            and stored.seq > self.submitted.get(request_id, 0)):
                        self.submitted.pop(request_id, None)
                        return _decode_output(stored.data)
                left = deadline - loop.time()
                if left <= 0:
                    raise NatsTimeoutError
                with contextlib.suppress(NatsTimeoutError):
                    await sub.next_msg(timeout=min(1.0, left))  # something came: look again
        finally:
            with contextlib.suppress(NatsError):
                await sub.unsubscribe()

    async def stream_deltas(self, request_id: str):
        """A subscription to a durable streaming request's deltas (subscribe before submitting)."""
        return await self.nc.subscribe(self.subjects.stream(self.tenant, request_id))

    async def cancel(self, request_id: str) -> None:
        await self.nc.publish(self.subjects.cancel(self.tenant), _encode(Cancel(request_id)))
        await self.nc.flush()
