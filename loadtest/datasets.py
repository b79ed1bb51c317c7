"""Workloads for `jetserve bench serve`: random token prompts, shared prefixes, a JSONL file of
GenerateRequests, or a ShareGPT-format JSON file."""

from __future__ import annotations

import json
import random
from pathlib import Path

import msgspec

from shared.protocol import ChatMessage, GenerateRequest, decode_generate_request

FIRST_ORDINARY_TOKEN = 17  # SmolLM2's ids below this are special tokens


def random_dataset(n: int, input_range: tuple[int, int], output_range: tuple[int, int],
                   vocab_size: int, rng: random.Random) -> list[GenerateRequest]:
    """Random token ids; output lengths are exact (`ignore_eos`)."""
    return [GenerateRequest(
        prompt_token_ids=[rng.randrange(FIRST_ORDINARY_TOKEN, vocab_size)
                          for _ in range(rng.randint(*input_range))],
        max_tokens=rng.randint(*output_range), ignore_eos=True) for _ in range(n)]


def engine_workload(num_requests: int, seed: int, vocab_size: int,
                    prompt_range=(16, 512), output_range=(16, 256)) -> list[GenerateRequest]:
    """The engine benchmark's requests, all at t=0: random token prompts, greedy, exact output
    lengths (`ignore_eos`), ids `bench-<i>`. Peers are fed the same list (loadtest/peers/)."""
    requests = random_dataset(num_requests, prompt_range, output_range, vocab_size,
                              random.Random(seed))
    return [msgspec.structs.replace(r, request_id=f"bench-{i}", temperature=0.0)
            for i, r in enumerate(requests)]


LONG_PROMPT_OUTPUT = 16


def long_prompts(lengths: list[int], seed: int, vocab_size: int) -> list[GenerateRequest]:
    """One random-token prompt of each length, LONG_PROMPT_OUTPUT tokens out (`ignore_eos`),
    greedy, ids `long-<i>`: a prompt near the context limit, alone, whose TTFT is its prefill.
    engine_bench and peer_bench draw the same ones."""
    rng = random.Random(seed)
    return [GenerateRequest(
        prompt_token_ids=[rng.randrange(FIRST_ORDINARY_TOKEN, vocab_size) for _ in range(n)],
        max_tokens=LONG_PROMPT_OUTPUT, ignore_eos=True, temperature=0.0, request_id=f"long-{i}")
        for i, n in enumerate(lengths)]


def shared_prefix_dataset(n: int, groups: int, prefix_len: int, suffix_range: tuple[int, int],
                          output_range: tuple[int, int], vocab_size: int,
                          rng: random.Random) -> list[GenerateRequest]:
    """`groups` common prefixes of `prefix_len` tokens; request i uses prefix i % groups plus a
    unique suffix (what prefix caching and prefix-aware routing feed on)."""
    prefixes = [[rng.randrange(FIRST_ORDINARY_TOKEN, vocab_size) for _ in range(prefix_len)]
                for _ in range(groups)]
    return [GenerateRequest(
        prompt_token_ids=prefixes[i % groups] + [
            rng.randrange(FIRST_ORDINARY_TOKEN, vocab_size) for _ in range(rng.randint(*suffix_range))],
        max_tokens=rng.randint(*output_range), ignore_eos=True) for i in range(n)]


def jsonl_dataset(path: Path) -> list[GenerateRequest]:
    """One GenerateRequest per line, validated like admission would."""
    requests = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if line.strip():
            try:
                requests.append(decode_generate_request(line))
            except Exception as exc:
                raise ValueError(f"{path}:{number}: {exc}") from None
    return requests


def sharegpt_dataset(path: Path, count_tokens, max_output: int,
                     ignore_eos: bool) -> list[GenerateRequest]:
    """Conversations `[{"conversations": [{"from": "human", "value": ...}, {"from": "gpt", ...}]}]`:
    the first human turn is the prompt (as a chat message), the reply's token count sets
    `max_tokens` (capped at `max_output`). Conversations without a reply are skipped."""
    requests = []
    for entry in json.loads(path.read_text()):
        turns = entry.get("conversations") or []
        if len(turns) < 2 or not turns[0].get("value") or not turns[1].get("value"):
            continue
        reply_tokens = max(1, min(max_output, count_tokens(turns[1]["value"])))
        requests.append(GenerateRequest(
            messages=[ChatMessage(role="user", content=turns[0]["value"])],
            max_tokens=reply_tokens, ignore_eos=ignore_eos))
    return requests


def with_ids(requests: list[GenerateRequest], run_id: str) -> list[GenerateRequest]:
    return [msgspec.structs.replace(r, request_id=f"{run_id}-{i}", stream=True)
            for i, r in enumerate(requests)]
