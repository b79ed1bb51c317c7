"""OpenAI's HTTP API in jetserve's terms, without I/O: a request body to a GenerateRequest (or an
`ApiError` naming the field), jetserve's outputs to OpenAI's response objects and stream
chunks, jetserve's Error codes to HTTP statuses. `services/gateway/service.py` serves them.

What is taken, and how (docs/openai.md has the table):

- `/v1/chat/completions`: `messages` (text content, or text parts), `/v1/completions`: `prompt`
  (a string, or one string or one token-id list in a list).
- `max_tokens` / `max_completion_tokens`, `temperature`, `top_p`, `seed`, `stop` (a string or a
  list), `stream`, `stream_options.include_usage` (and vLLM's `continuous_usage_stats`),
  `n` = 1; vLLM's `top_k`, `min_p`,
  `ignore_eos`, `stop_token_ids`, `priority`; jetserve's `deadline_ms`.
- `priority`: vLLM's (lower runs earlier, 0 by default, any integer) becomes jetserve's
  (0-10, higher runs earlier, 5 by default) as `5 - priority`, clamped: a client that sends
  none gets jetserve's default, one that sends -5 the most urgent class.
- Fields a client may send and that change nothing here (`user`, `metadata`, a zero penalty,
  `logprobs: false`, `echo: false`, `best_of: 1`, ...) are taken; anything else, and any of those
  with a value that would change the output, is a 400 naming the field.
"""

from __future__ import annotations

import math
import time
from typing import Any

from shared.protocol import (
    INT32_MAX,
    ChatMessage,
    Completion,
    Error,
    GenerateRequest,
)

DEFAULT_MAX_TOKENS = 256  # jetserve's own default, as vLLM's is "what the context leaves"

# Fields that change nothing when they hold these values (None: any value).
_HARMLESS = {
    "add_special_tokens": True,
    "user": None, "metadata": None, "store": None, "service_tier": None,
    "presence_penalty": 0, "frequency_penalty": 0, "repetition_penalty": 1,
    "logprobs": False, "top_logprobs": 0, "echo": False, "best_of": 1, "logit_bias": {},
    "parallel_tool_calls": None, "skip_special_tokens": True,
    "spaces_between_special_tokens": True, "include_stop_str_in_output": False,
}
_COMMON = {"model", "max_tokens", "temperature", "top_p", "seed", "stop", "stream",
           "stream_options", "n", "top_k", "min_p", "ignore_eos", "stop_token_ids", "priority",
           "deadline_ms", "min_tokens"}
CHAT_FIELDS = _COMMON | {"messages", "max_completion_tokens"}
COMPLETION_FIELDS = _COMMON | {"prompt"}
ROLES = ("system", "user", "assistant", "developer", "tool")


class ApiError(Exception):
    """An answer in OpenAI's error shape: `{"error": {"message", "type", "param", "code"}}`."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 code: str | None = None, retry_after_s: float | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.retry_after_s = retry_after_s

    @property
    def type(self) -> str:
        return {400: "invalid_request_error", 401: "authentication_error",
                404: "invalid_request_error", 413: "invalid_request_error",
                429: "rate_limit_error"}.get(self.status, "server_error")

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}

    def headers(self) -> dict[str, str]:
        if self.retry_after_s is None:
            return {}
        return {"Retry-After": str(max(1, math.ceil(self.retry_after_s)))}


# jetserve's Error codes: the HTTP status, and OpenAI's `code`.
STATUS = {"invalid_request": 400, "prompt_too_long": 400, "unknown_model": 404,
          "rate_limited": 429, "overloaded": 503, "deadline_exceeded": 504, "cancelled": 499,
          "internal": 500}


def api_error(error: Error) -> ApiError:
    return ApiError(STATUS.get(error.code, 500), error.message, code=error.code,
                    retry_after_s=None if error.retry_after_ms is None
                    else error.retry_after_ms / 1e3)


def bad(param: str, message: str) -> ApiError:
    return ApiError(400, message, param=param, code="invalid_request")


def _check_fields(body: dict, allowed: set[str]) -> None:
    for name, value in body.items():
        if name in allowed or value is None:
            continue
        if name in _HARMLESS:
            wanted = _HARMLESS[name]
            if wanted is None or _same(value, wanted):
                continue
            raise bad(name, f"`{name}` = {_short(value)} is not supported (only {wanted!r})")
        raise bad(name, f"`{name}` is not supported")


def _same(value: object, wanted: object) -> bool:
    """`value` is `wanted`: a number equal to a number (1.0 is 1; a bool is no number), or an
    equal value of the same type."""
    def number(x):
        return isinstance(x, (int, float)) and not isinstance(x, bool)
    if number(wanted):
        return number(value) and value == wanted
    return type(value) is type(wanted) and value == wanted


def _short(value: object) -> str:
    """A value as an error message quotes it: at most 80 characters of it."""
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _integer(body: dict, name: str, low: int, high: int = INT32_MAX) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise bad(name, f"`{name}` must be an integer from {low} to {high}")
    return value


def _number(body: dict, name: str, low: float, high: float) -> float | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) \
            or not low <= value <= high:
        raise bad(name, f"`{name}` must be a number from {low:g} to {high:g}")
    return float(value)


def _common(body: dict, served: list[str]) -> dict[str, Any]:
    """The fields both endpoints share, as GenerateRequest's keyword arguments."""
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise bad("model", "`model` is required: one of " + ", ".join(served))
    if model not in served:
        raise ApiError(404, f"the model `{model}` does not exist here; served: "
                            + ", ".join(served), param="model", code="model_not_found")
    n = _integer(body, "n", 1, 1024)
    if n not in (None, 1):
        raise bad("n", "`n` must be 1 (one choice per request)")
    if _integer(body, "min_tokens", 0) not in (None, 0):
        raise bad("min_tokens", "`min_tokens` is not supported (only 0)")
    stream = body.get("stream")
    if stream is None:
        stream = False
    if not isinstance(stream, bool):
        raise bad("stream", "`stream` must be true or false")
    options = body.get("stream_options")
    if options is not None:
        if not stream:
            raise bad("stream_options", "`stream_options` is only for `stream: true`")
        if not isinstance(options, dict) or set(options) - {"include_usage",
                                                             "continuous_usage_stats"} \
                or not all(isinstance(v, bool) or v is None for v in options.values()):
            raise bad("stream_options", "`stream_options` may hold only `include_usage` and "
                                        "`continuous_usage_stats` (true or false)")
    stop = body.get("stop")
    if isinstance(stop, str):
        stop = [stop]
    if stop is not None and (not isinstance(stop, list)
                             or not all(isinstance(s, str) and s for s in stop)):
        raise bad("stop", "`stop` must be a non-empty string or a list of them")
    stop_token_ids = body.get("stop_token_ids")
    if stop_token_ids is not None and (not isinstance(stop_token_ids, list) or not all(
            isinstance(t, int) and not isinstance(t, bool) and 0 <= t <= INT32_MAX
            for t in stop_token_ids)):
        raise bad("stop_token_ids", "`stop_token_ids` must be a list of token ids")
    ignore_eos = body.get("ignore_eos")
    if ignore_eos is not None and not isinstance(ignore_eos, bool):
        raise bad("ignore_eos", "`ignore_eos` must be true or false")
    priority = _integer(body, "priority", -INT32_MAX)
    fields = {
        "model": model, "stream": stream, "stop": stop or [], "stop_token_ids": stop_token_ids
        or [], "ignore_eos": bool(ignore_eos),
        "priority": 5 if priority is None else min(10, max(0, 5 - priority)),
        "max_tokens": _integer(body, "max_tokens", 1) or DEFAULT_MAX_TOKENS,
        "temperature": _number(body, "temperature", 0.0, 2.0),
        "top_p": _number(body, "top_p", 1e-9, 1.0),
        "top_k": _integer(body, "top_k", -1),
        "min_p": _number(body, "min_p", 0.0, 1.0),
        "seed": _integer(body, "seed", 0, 2**63 - 1),
        "deadline_ms": _number(body, "deadline_ms", 1e-3, 1e12),
    }
    if fields["top_k"] == 0:  # vLLM's "no top-k" is -1 (0 too, in older releases)
        fields["top_k"] = -1
    return {name: value for name, value in fields.items() if value is not None}


def chat_request(body: object, served: list[str], request_id: str) -> GenerateRequest:
    if not isinstance(body, dict):
        raise bad("body", "the body must be a JSON object")
    _check_fields(body, CHAT_FIELDS)
    fields = _common(body, served)
    if body.get("max_completion_tokens") is not None:
        fields["max_tokens"] = _integer(body, "max_completion_tokens", 1)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad("messages", "`messages` must be a non-empty list")
    taken = []
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, dict):
            raise bad(where, f"`{where}` must be an object")
        # A key set to null is absent (an SDK's reply passed back holds "refusal": null, ...).
        extra = {k for k, v in message.items() if v is not None} - {"role", "content", "name"}
        if extra:
            raise bad(f"{where}.{sorted(extra)[0]}",
                      f"`{where}.{sorted(extra)[0]}` is not supported (text messages only)")
        role = message.get("role")
        if role not in ROLES:
            raise bad(f"{where}.role", f"`{where}.role` must be one of {', '.join(ROLES)}")
        content = message.get("content")
        if isinstance(content, list):  # parts: text ones only
            texts = []
            for j, part in enumerate(content):
                if not isinstance(part, dict) or part.get("type") != "text" \
                        or not isinstance(part.get("text"), str):
                    raise bad(f"{where}.content[{j}]", f"`{where}.content[{j}]` must be a text "
                                                       f"part (images and audio: not supported)")
                texts.append(part["text"])
            content = "\n".join(texts)  # as vLLM joins them
        if not isinstance(content, str):
            raise bad(f"{where}.content", f"`{where}.content` must be a string")
        taken.append(ChatMessage(role="system" if role == "developer" else role,
                                 content=content))
    return GenerateRequest(request_id=request_id, messages=taken, **fields)


def completion_request(body: object, served: list[str], request_id: str) -> GenerateRequest:
    if not isinstance(body, dict):
        raise bad("body", "the body must be a JSON object")
    _check_fields(body, COMPLETION_FIELDS)
    fields = _common(body, served)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str) and prompt:
        return GenerateRequest(request_id=request_id, prompt=prompt, **fields)
    if isinstance(prompt, list) and prompt and all(
            isinstance(t, int) and not isinstance(t, bool) and 0 <= t <= INT32_MAX
            for t in prompt):
        return GenerateRequest(request_id=request_id, prompt_token_ids=prompt, **fields)
    if isinstance(prompt, list) and prompt and all(
            isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        raise bad("prompt", f"`prompt` token ids must be from 0 to {INT32_MAX}")
    if isinstance(prompt, list) and len(prompt) > 1:
        raise bad("prompt", "`prompt` must be one prompt (a batch of several: send each alone)")
    raise bad("prompt", "`prompt` must be a non-empty string or a list of token ids")


def tokenize_request(body: object, served: list[str]) -> GenerateRequest:
    """vLLM's `/tokenize` body: `prompt` or `messages` (as the generation endpoints take them)."""
    if not isinstance(body, dict):
        raise bad("body", "the body must be a JSON object")
    _check_fields(body, {"model", "prompt", "messages", "add_generation_prompt",
                         "add_special_tokens"})
    if body.get("add_special_tokens") is not None \
            and not isinstance(body["add_special_tokens"], bool):  # (null: absent)
        raise bad("add_special_tokens", "`add_special_tokens` must be true or false")
    extra = {name: body[name] for name in ("model",) if name in body}
    if body.get("add_generation_prompt") is False:
        raise bad("add_generation_prompt", "only the chat template's generation prompt, as "
                                           "the generation endpoints use it, is supported")
    if "messages" in body:
        return chat_request({**extra, "messages": body["messages"]}, served, "tokenize")
    return completion_request({**extra, "prompt": body.get("prompt")}, served, "tokenize")


def detokenize_tokens(body: object, served: list[str], vocab_size: int) -> list[int]:
    if not isinstance(body, dict):
        raise bad("body", "the body must be a JSON object")
    _check_fields(body, {"model", "tokens"})
    _common({"model": body.get("model")}, served)
    tokens = body.get("tokens")
    if not isinstance(tokens, list) or not all(
            isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab_size
            for t in tokens):
        raise bad("tokens", f"`tokens` must be a list of token ids below {vocab_size}")
    return tokens


# --------------------------------------------------------------------------------- responses

# jetserve's finish reasons beyond OpenAI's `stop` and `length`, as vLLM names them.
FINISH_REASON = {"cancelled": "abort", "deadline": "length"}


def finish_reason(completion: Completion) -> str:
    return FINISH_REASON.get(completion.finish_reason, completion.finish_reason)


def usage(completion: Completion) -> dict:
    u = completion.usage
    return {"prompt_tokens": u.prompt_tokens, "completion_tokens": u.completion_tokens,
            "total_tokens": u.prompt_tokens + u.completion_tokens}


def chat_response(completion: Completion, model: str, created: int) -> dict:
    return {"id": f"chatcmpl-{completion.request_id}", "object": "chat.completion",
            "created": created, "model": model,
            "choices": [{"index": 0, "message": {"role": "assistant",
                                                 "content": completion.text},
                         "logprobs": None, "finish_reason": finish_reason(completion)}],
            "usage": usage(completion)}


def completion_response(completion: Completion, model: str, created: int) -> dict:
    return {"id": f"cmpl-{completion.request_id}", "object": "text_completion",
            "created": created, "model": model,
            "choices": [{"index": 0, "text": completion.text, "logprobs": None,
                         "finish_reason": finish_reason(completion)}],
            "usage": usage(completion)}


class Chunks:
    """The stream chunks of one request (chat or completion), each a JSON-ready dict."""

    def __init__(self, chat: bool, request_id: str, model: str):
        self.chat, self.model = chat, model
        self.id = f"{'chatcmpl' if chat else 'cmpl'}-{request_id}"
        self.created = int(time.time())
        self.role_sent = False
        # vLLM's `continuous_usage_stats`: the usage so far on every chunk (prompt tokens known)
        self.prompt_tokens: int | None = None
        self.completion_tokens = 0

    def _chunk(self, choices: list, **extra) -> dict:
        if self.prompt_tokens is not None and "usage" not in extra:
            extra["usage"] = {"prompt_tokens": self.prompt_tokens,
                              "completion_tokens": self.completion_tokens,
                              "total_tokens": self.prompt_tokens + self.completion_tokens}
        return {"id": self.id, "object": "chat.completion.chunk" if self.chat
                else "text_completion", "created": self.created, "model": self.model,
                "choices": choices, **extra}

    def text(self, text: str, finish_reason: str | None = None) -> dict:
        if not self.chat:
            return self._chunk([{"index": 0, "text": text, "logprobs": None,
                                 "finish_reason": finish_reason}])
        delta: dict = {"content": text} if text or finish_reason is None else {}
        if not self.role_sent:  # with the first token, not before (an honest TTFT)
            delta = {"role": "assistant", "content": text}
            self.role_sent = True
        return self._chunk([{"index": 0, "delta": delta, "logprobs": None,
                             "finish_reason": finish_reason}])

    def usage(self, completion: Completion) -> dict:
        return self._chunk([], usage=usage(completion))
