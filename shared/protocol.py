"""The public protocol (v2): every message a client in any language sends or receives.

Payloads are JSON objects tagged by `"type"`. Decoding is strict: unknown fields, wrong types and
out-of-range values are rejected with a message that names the field (msgspec's `at $.field`).
"""

from __future__ import annotations

import re
from typing import Annotated, Literal

import msgspec

RequestId = Annotated[str, msgspec.Meta(min_length=1, max_length=128)]
# Integers are bounded so every accepted value fits the internal (msgpack) messages.
INT32_MAX = 2**31 - 1
TokenId = Annotated[int, msgspec.Meta(ge=0, le=INT32_MAX)]

FinishReason = Literal["stop", "length", "cancelled", "deadline"]
ErrorCode = Literal["invalid_request", "prompt_too_long", "unknown_model", "overloaded",
                    "rate_limited", "cancelled", "deadline_exceeded", "internal"]


class ChatMessage(msgspec.Struct, forbid_unknown_fields=True):
    role: Annotated[str, msgspec.Meta(min_length=1, max_length=64)]
    content: str


class GenerateRequest(msgspec.Struct, tag="generate", tag_field="type", forbid_unknown_fields=True):
    """One generation request, on `llm.generate.<tenant>` (request/reply) or durably on
    `llm.requests.<tenant>.<request_id>` (a JetStream publish). Exactly one of `prompt`,
    `messages`, `prompt_token_ids` is given."""

    request_id: Annotated[RequestId | None, msgspec.Meta(description=(
        "Assigned when left out of a generate. A durable request's id is its subject's last "
        "token ([A-Za-z0-9_-]{1,128}); here it may be left out or must equal it."))] = None
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    prompt_token_ids: list[TokenId] | None = None
    max_tokens: Annotated[int, msgspec.Meta(ge=1, le=INT32_MAX)] = 256
    temperature: Annotated[float, msgspec.Meta(ge=0.0)] = 1.0
    top_p: Annotated[float, msgspec.Meta(gt=0.0, le=1.0)] = 1.0
    top_k: Annotated[int, msgspec.Meta(ge=-1, le=INT32_MAX)] = -1
    min_p: Annotated[float, msgspec.Meta(ge=0.0, le=1.0)] = 0.0
    seed: Annotated[int, msgspec.Meta(ge=0, le=2**63 - 1)] | None = None
    stop: list[Annotated[str, msgspec.Meta(min_length=1)]] = []
    stop_token_ids: list[TokenId] = []
    ignore_eos: bool = False
    priority: Annotated[int, msgspec.Meta(ge=0, le=10)] = 5
    deadline_ms: Annotated[float, msgspec.Meta(gt=0.0)] | None = None
    stream: bool = False

    def check(self) -> None:
        """Cross-field rules msgspec cannot express; raises ProtocolError naming the field."""
        given = [name for name in ("prompt", "messages", "prompt_token_ids")
                 if getattr(self, name) is not None]
        if len(given) != 1:
            raise ProtocolError("invalid_request", "exactly one of `prompt`, `messages`, "
                                "`prompt_token_ids` must be given"
                                + (f" (got {', '.join(given)})" if given else ""))
        if not getattr(self, given[0]):  # the one given is empty
            raise ProtocolError("invalid_request", f"`{given[0]}` is empty")


class Delta(msgspec.Struct, tag="delta", tag_field="type"):
    request_id: str
    index: int  # position in the output of the first token in this delta
    token_ids: list[int]
    text: str


class Usage(msgspec.Struct):
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int


class Metrics(msgspec.Struct):
    queue_ms: float
    ttft_ms: float
    e2e_ms: float
    tpot_ms: float


class Scheduling(msgspec.Struct):
    priority_score: float  # the score priority gave the request when it dispatched it
    executor: str
    preemptions: int
    queue_wait_ms: float = 0.0  # waiting in priority's queue, from admission to dispatch
    # Tokens whose KV a preemption discarded and the model had to compute again (what the
    # prefix cache still held when the request came back is not counted).
    recomputed_tokens: int = 0


class Completion(msgspec.Struct, tag="completion", tag_field="type"):
    request_id: str
    model: str
    text: str
    token_ids: list[int]
    finish_reason: FinishReason
    usage: Usage
    metrics: Metrics
    scheduling: Scheduling


class Error(msgspec.Struct, tag="error", tag_field="type", omit_defaults=True):
    request_id: str | None
    code: ErrorCode
    message: str
    # `rate_limited`: when the same request may be sent again (a hint, in milliseconds)
    retry_after_ms: float | None = None


class Cancel(msgspec.Struct, tag="cancel", tag_field="type", forbid_unknown_fields=True):
    request_id: RequestId


# The retry_after_ms of a request refused by a quota that frees as requests end (concurrency,
# a share of a queue): a hint, since when that happens is not known.
QUOTA_RETRY_MS = 1000.0


# The most characters of an error message: one may quote the client's input (an unknown field,
# a model name), which must not come back at the size it was sent (an answer's body and its
# Nats-Service-Error header together over max_payload close the sender's connection).
MAX_MESSAGE_CHARS = 1000


def shorten(message: str, limit: int = MAX_MESSAGE_CHARS) -> str:
    return message if len(message) <= limit else f"{message[:limit - 24]}... ({len(message)} chars)"


class ProtocolError(Exception):
    """A request that cannot be served, with the protocol error code and a message naming the cause."""

    def __init__(self, code: ErrorCode, message: str, retry_after_s: float | None = None):
        message = shorten(message)
        super().__init__(message)
        self.code: ErrorCode = code
        self.message = message
        self.retry_after_s = retry_after_s  # set when the same request may succeed later

    def to_error(self, request_id: str | None) -> Error:
        retry_ms = None if self.retry_after_s is None else round(1e3 * self.retry_after_s, 1)
        return Error(request_id=request_id, code=self.code, message=self.message,
                     retry_after_ms=retry_ms)


# Arrays and objects inside one another that a payload may have: a GenerateRequest needs three
# (the request, `messages`, a message). Deeper payloads are refused before any decoder sees them;
# a decoder's own limit is the interpreter's recursion limit, which it reports as a RecursionError
# rather than a decoding error.
MAX_NESTING = 32
# A JSON string (skipped whole, escapes included) or one bracket. A string left open runs to
# the end of the payload: were its closing quote required, a failed match would be tried again
# from each escaped quote after it, each time to the end (quadratic: 32 KB of `\"` took 5 s).
_STRING_OR_BRACKET = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"?|[\[\]{}]')


def check_nesting(payload: bytes | str) -> None:
    """Raise ProtocolError (`invalid_request`, naming the limit) when arrays and objects nest
    deeper than MAX_NESTING. Linear in the payload; a payload with few brackets is not scanned."""
    data = payload.encode() if isinstance(payload, str) else bytes(payload)
    if data.count(b"[") + data.count(b"{") <= MAX_NESTING:
        return
    depth = 0
    for match in _STRING_OR_BRACKET.finditer(data):
        bracket = match.group()
        if bracket in (b"[", b"{"):
            depth += 1
            if depth > MAX_NESTING:
                raise ProtocolError("invalid_request", f"the payload nests arrays and objects "
                                    f"more than {MAX_NESTING} levels deep (the limit)")
        elif bracket in (b"]", b"}"):
            depth -= 1


_request_decoder = msgspec.json.Decoder(GenerateRequest)
_cancel_decoder = msgspec.json.Decoder(Cancel)


def _decode(decoder: msgspec.json.Decoder, payload: bytes | str):
    check_nesting(payload)
    try:
        return decoder.decode(payload)
    except msgspec.ValidationError as exc:
        raise ProtocolError("invalid_request", str(exc)) from None
    except msgspec.DecodeError as exc:
        raise ProtocolError("invalid_request", f"malformed JSON: {exc}") from None


def decode_generate_request(payload: bytes | str) -> GenerateRequest:
    """Parse and check a JSON GenerateRequest; every failure is a ProtocolError naming the field."""
    request = _decode(_request_decoder, payload)
    request.check()
    return request


def decode_cancel(payload: bytes | str) -> Cancel:
    return _decode(_cancel_decoder, payload)


# The `Nats-Service-Error-Code` of each error code on request/reply (the micro convention is
# numeric, HTTP-like).
SERVICE_ERROR_CODES: dict[str, str] = {
    "invalid_request": "400", "unknown_model": "404", "prompt_too_long": "413",
    "rate_limited": "429", "cancelled": "499", "internal": "500", "deadline_exceeded": "504",
    "overloaded": "503"}


def service_error_headers(error: Error) -> dict[str, str]:
    description = shorten(" ".join(f"{error.code}: {error.message}".split()))  # one line
    return {"Nats-Service-Error": description,
            "Nats-Service-Error-Code": SERVICE_ERROR_CODES[error.code]}
