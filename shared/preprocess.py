"""From a GenerateRequest to prompt token ids, and the limits every request must meet.

Admission runs this once, at the edge, for every request that enters jetserve; the engine's
`admit` runs the same for a caller that has no admission in front of it (run-local, tests).
"""

from __future__ import annotations

import secrets
from typing import NamedTuple

import msgspec

from shared.config import ModelSection
from shared.model_files import load_model_config, tokenizer_dir
from shared.tokenizer import Tokenizer
from shared.protocol import GenerateRequest, ProtocolError


class ServedModel(NamedTuple):
    """What requests are checked and tokenized against: the model's tokenizer, vocabulary
    size and context limit (`model.max_model_len`, at most the model's own)."""

    tokenizer: Tokenizer
    vocab_size: int
    max_model_len: int


def served_model(model: ModelSection) -> ServedModel:
    """The model's tokenizer and limits, without its weights (admission; the gateway)."""
    config, directory = load_model_config(model.name, model.weights_cache_dir, weights=False)
    return ServedModel(Tokenizer(tokenizer_dir(directory, model.weights_cache_dir, model.tokenizer)),
                       config.vocab_size,
                       min(model.max_model_len or config.max_position, config.max_position))


def prompt_token_ids(tokenizer: Tokenizer, request: GenerateRequest, vocab_size: int) -> list[int]:
    """The prompt as token ids (chat template applied to `messages`); raises ProtocolError."""
    if request.prompt_token_ids is not None:
        _check_ids("prompt_token_ids", request.prompt_token_ids, vocab_size)
        prompt = list(request.prompt_token_ids)
    elif request.messages is not None:
        try:
            text = tokenizer.apply_chat_template(
                [{"role": m.role, "content": m.content} for m in request.messages])
        except ValueError as exc:
            raise ProtocolError("invalid_request", f"`messages`: {exc}") from None
        prompt = tokenizer.encode(text)
    else:
        prompt = tokenizer.encode(request.prompt)
    if not prompt:
        raise ProtocolError("invalid_request", "the prompt tokenizes to zero tokens")
    return prompt


def check_prompt_size(tokenizer: Tokenizer, request: GenerateRequest, max_model_len: int) -> None:
    """Refuse a text prompt that must be too long before spending any time encoding it: its
    characters over the longest token's are a lower bound on its tokens."""
    if request.prompt is not None:
        chars = len(request.prompt)
    elif request.messages is not None:
        chars = sum(len(m.content) for m in request.messages)
    else:
        return
    at_least = -(-chars // tokenizer.max_token_chars)
    if at_least + request.max_tokens > max_model_len:
        raise ProtocolError("prompt_too_long", f"the prompt's {chars} characters are at least "
                            f"{at_least} tokens (no token is longer than "
                            f"{tokenizer.max_token_chars} characters) and `max_tokens` is "
                            f"{request.max_tokens}: more than max_model_len {max_model_len}")


def _check_ids(field: str, token_ids: list[int], vocab_size: int) -> None:
    bad = [t for t in token_ids if t >= vocab_size]
    if bad:
        raise ProtocolError("invalid_request", f"`{field}` has id {bad[0]} >= vocab size "
                            f"{vocab_size}")


def check_model(request: GenerateRequest, served: str) -> None:
    if request.model is not None and request.model != served:
        raise ProtocolError("unknown_model", f"`model` {request.model!r} is not served; "
                            f"served: {served!r}")


def admitted(request: GenerateRequest, prompt: list[int], model: str, max_model_len: int,
             vocab_size: int, seed: int | None = None) -> GenerateRequest:
    """The request as every later hop takes it (and trusts): tokenized (its text dropped), within
    the model's limits, naming the model, with an id and a seed (the client's; else `seed`;
    else a random one). Raises ProtocolError."""
    total = len(prompt) + request.max_tokens
    if total > max_model_len:
        raise ProtocolError("prompt_too_long", f"prompt has {len(prompt)} tokens and "
                            f"`max_tokens` is {request.max_tokens}: {total} > max_model_len "
                            f"{max_model_len}")
    _check_ids("stop_token_ids", request.stop_token_ids, vocab_size)
    return msgspec.structs.replace(
        request, prompt=None, messages=None, prompt_token_ids=prompt, model=model,
        request_id=request.request_id or f"req-{secrets.token_hex(8)}",
        seed=request.seed if request.seed is not None else
        seed if seed is not None else secrets.randbits(63))

