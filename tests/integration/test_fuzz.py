"""Fuzz: 1,200 generated hostile payloads on llm.generate.*, llm.requests.* and llm.cancel.*
(random bytes, invalid UTF-8, deep nesting, huge strings and numbers, unknown and mistyped
fields, random JSON, and some valid requests among them). Every generate gets exactly one final
answer, every durable request exactly one result, no `internal` Error, no service restarts
($SRV.INFO ids unchanged), and a valid request succeeds afterwards."""

from __future__ import annotations

import asyncio
import json
import random

import msgspec
import pytest

from shared.bus import STOP_GRACE_S, discover
from shared.client import JetserveClient
from shared.protocol import Completion, Delta, Error, GenerateRequest
from shared.subjects import RESULTS_STREAM
from tests.integration.conftest import TINY_STACK, running_stack, sigterm_services

pytestmark = [pytest.mark.slow, pytest.mark.asyncio]

decode_output = msgspec.json.Decoder(Delta | Completion | Error).decode
FIELDS = {"request_id": "r", "model": "dummy:tiny", "prompt": "hi", "messages": [],
          "prompt_token_ids": [1], "max_tokens": 4, "temperature": 0.5, "top_p": 0.9,
          "top_k": 5, "min_p": 0.1, "seed": 3, "stop": ["x"], "stop_token_ids": [2],
          "ignore_eos": True, "priority": 5, "deadline_ms": 1000.0, "stream": False}
WRONG = [None, True, -1, 0, 2**70, -2**70, 1e308, -1e308, 1.5, "", "x" * 300, [], [None],
         {}, {"a": 1}, [[[]]], "\u0000", "\ud800"]


def random_json(rng: random.Random, depth: int = 0):
    roll = rng.random()
    if depth > 4 or roll < 0.3:
        return rng.choice([None, True, False, rng.randint(-10**20, 10**20), rng.random() * 1e10,
                           "".join(chr(rng.randint(0, 0x10FFFF)) for _ in range(rng.randint(0, 8))
                                   if True).encode("utf-8", "surrogatepass").decode("utf-8",
                                                                                    "replace")])
    if roll < 0.6:
        return [random_json(rng, depth + 1) for _ in range(rng.randint(0, 4))]
    return {rng.choice(list(FIELDS) + ["type", "extra", ""]): random_json(rng, depth + 1)
            for _ in range(rng.randint(0, 4))}

# How long a service told to stop may take: its drain, then the grace every service has.
BOUND_S = TINY_STACK["distributed.drain_timeout_s"] + STOP_GRACE_S


def hostile(rng: random.Random, i: int) -> bytes:
    kind = i % 11
    if kind == 0:
        return rng.randbytes(rng.randint(0, 300))
    if kind == 1:  # invalid UTF-8 inside a string
        return b'{"type": "generate", "prompt": "' + rng.randbytes(40) + b'"}'
    if kind == 2:
        depth = rng.choice([33, 200, 2000, 20000])
        return b"[" * depth + b"]" * depth
    if kind == 3:
        depth = rng.choice([33, 500, 5000])
        return b'{"type": "generate", "prompt": ' * depth + b'"x"' + b"}" * depth
    if kind == 4:  # huge strings: most refused by their length, a few encoded
        size = rng.choice([10_000, 150_000, 900_000]) if i % 44 == 4 else rng.randint(1, 2000)
        return json.dumps({"type": "generate", "prompt": "w " * (size // 2),
                           "max_tokens": 2}).encode()
    if kind == 5:  # huge and odd numbers
        field = rng.choice(["max_tokens", "temperature", "top_p", "top_k", "seed", "priority",
                            "deadline_ms", "min_p"])
        value = rng.choice([b"1e400", b"-1e400", b"1" * 400, b"-0", b"NaN", b"Infinity",
                            b"0.0000000000000000000000001", str(2**64).encode()])
        return b'{"type": "generate", "prompt": "hi", "' + field.encode() + b'": ' + value + b"}"
    if kind == 6:  # unknown fields
        return json.dumps({"type": "generate", "prompt": "hi",
                           rng.choice(["temprature", "max_token", "Prompt", "__proto__", ""]):
                               1}).encode()
    if kind == 7:  # a known field of the wrong type
        payload = {"type": "generate", "prompt": "hi", "max_tokens": 2}
        payload[rng.choice(list(FIELDS))] = rng.choice(WRONG)
        return json.dumps(payload).encode()
    if kind == 8:  # random JSON
        return json.dumps(random_json(rng)).encode()
    if kind == 9:  # a tag of another message, or none
        return json.dumps({"type": rng.choice(["delta", "completion", "cancel", "error", 5]),
                           "prompt": "hi"}).encode()
    # Valid requests with random parameters: some run, some are refused by a limit.
    payload = {"type": "generate", "prompt": "fuzz " * rng.randint(1, 30),
               "max_tokens": rng.choice([1, 2, 3, 2047, 5000]),
               "temperature": rng.choice([0.0, 0.7, 2.0]), "top_k": rng.choice([-1, 1, 50]),
               "stream": rng.random() < 0.3, "priority": rng.randint(0, 10)}
    return json.dumps(payload).encode()


async def test_hostile_payloads_get_exactly_one_answer_each_and_break_nothing(tmp_path):
    rng = random.Random(2026)
    # The durable ones are another tenant's, held to a quota of 16 tokens: those that ask for
    # more are refused by it (its own kind of answer), and the run is not spent generating.
    async with running_stack(tmp_path, settings={
                "quotas.tenants": "{fuzzd: {max_tokens: 16}}"}) as stack, \
            await JetserveClient.connect(stack.url, tenant="fuzz") as client:
        nc = client.nc
        infos_before = {i["id"] for i in await discover(nc, "INFO", wait_s=0.5)}
        finals: dict[int, list] = {}
        inbox = nc.new_inbox()

        async def on_reply(msg) -> None:
            index = int(msg.subject.rsplit(".", 1)[-1])
            if msg.data:  # the empty sentinel ends a stream
                output = decode_output(msg.data)
                if not isinstance(output, Delta):
                    finals.setdefault(index, []).append(output)

        await nc.subscribe(f"{inbox}.*", cb=on_reply)
        generates, durables, cancels = 700, 300, 200
        for i in range(generates):
            await nc.publish("llm.generate.fuzz", hostile(rng, i), reply=f"{inbox}.{i}")
            if i % 100 == 99:
                await nc.flush()
        for i in range(durables):
            await client.js.publish(f"llm.requests.fuzzd.fz-{i}", hostile(rng, i))
        for i in range(cancels):
            await nc.publish("llm.cancel.fuzz", hostile(rng, i) if i % 2 else json.dumps(
                {"type": "cancel", "request_id": f"fz-{i}"}).encode())
        await nc.flush()

        async def settled() -> int:
            info = await client.js.stream_info(RESULTS_STREAM,
                                               subjects_filter="llm.results.fuzzd.>")
            return info.state.messages

        for _ in range(600):
            if len(finals) == generates and await settled() >= durables:
                break
            await asyncio.sleep(0.2)
        await asyncio.sleep(1.0)  # a second answer, were there one, would have come by now
        info = await client.js.stream_info(RESULTS_STREAM, subjects_filter="llm.results.fuzzd.>")
        stored = [decode_output((await client.js.get_last_msg(
            RESULTS_STREAM, f"llm.results.fuzzd.fz-{i}")).data) for i in range(durables)]
        completion = await client.generate(GenerateRequest(prompt="still fine?", max_tokens=4),
                                           timeout=30)
        infos_after = {i["id"] for i in await discover(nc, "INFO", wait_s=0.5)}
        alive = all(p.returncode is None for p in stack.processes.values())
        # Told to stop after all that, every service stops, within its bound (the batcher once
        # never did, and only SIGKILL ended it).
        stopped = await sigterm_services(stack, BOUND_S)
    missing = [i for i in range(generates) if i not in finals]
    assert not missing, f"{len(missing)} generates unanswered, e.g. {missing[:5]}"
    twice = {i: f for i, f in finals.items() if len(f) != 1}
    assert not twice, f"answered more than once: {list(twice.items())[:3]}"
    assert info.state.subjects == {f"llm.results.fuzzd.fz-{i}": 1 for i in range(durables)}
    assert any(isinstance(o, Error) and "(max_tokens 16)" in o.message for o in stored)
    assert any(isinstance(o, Completion) for o in stored)
    outputs = [f[0] for f in finals.values()] + stored
    internal = [o for o in outputs if isinstance(o, Error) and o.code == "internal"]
    assert not internal, internal[:3]
    codes = {o.code for o in outputs if isinstance(o, Error)}
    assert {"invalid_request", "prompt_too_long"} <= codes
    assert any(isinstance(o, Completion) for o in outputs)  # the valid ones among them ran
    assert isinstance(completion, Completion) and len(completion.token_ids) == 4
    assert infos_after == infos_before and alive
    assert all(code == 0 and took <= BOUND_S for code, took in stopped.values()), stopped
