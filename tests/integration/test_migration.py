"""A durable request continues where it stopped: its executor is SIGKILLed mid-generation and
the next one resumes from the last checkpoint, on the real SmolLM2 (greedy, and seeded
sampling). The final text equals an undisturbed run's, and a streaming client, keeping each
token index once (shared/client.StreamAssembler), sees the whole output without a gap. Both tests share one stack of two SmolLM2 executors
(each leaves two running) and the undisturbed runs, made first."""

from __future__ import annotations

import asyncio

import msgspec
import pytest
import pytest_asyncio

from shared.client import JetserveClient, StreamAssembler
from shared.protocol import Completion, Delta, GenerateRequest
from tests.integration.conftest import busy_executor, running_stack

pytestmark = [pytest.mark.slow, pytest.mark.asyncio(loop_scope="module")]

# Checkpoints ride on the holding report, once a heartbeat interval: at 0.25 s one is at most a
# few tokens behind. On the CPU: a GPU could finish the 96 tokens before the kill.
SMOLLM2 = {"model.name": "SmolLM2-135M-Instruct", "model.device": "cpu",
           "kv_cache.num_blocks": 1024,
           "distributed.heartbeat_interval_s": 0.25, "distributed.heartbeat_timeout_s": 1.5}
CHECKPOINT_WAIT_S = 2 * SMOLLM2["distributed.heartbeat_interval_s"]
decode_delta = msgspec.json.Decoder(Delta).decode


async def migrate(stack, client, request: GenerateRequest, kill_after: int):
    """Stream the durable request; SIGKILL its executor once `kill_after` tokens arrived and a
    checkpoint had time to report them; the result, what the stream assembled, and the executor
    killed."""
    stream = await client.stream_deltas(request.request_id)
    await client.submit(request)
    assembled, victim = StreamAssembler(), None
    result = asyncio.create_task(client.result(request.request_id, timeout=300))
    while not result.done():
        try:
            msg = await stream.next_msg(timeout=1)
        except Exception:
            continue
        assembled.add(decode_delta(msg.data))
        if victim is None and len(assembled.token_ids) >= kill_after:
            victim = await busy_executor(client)  # the one request running
            await asyncio.sleep(CHECKPOINT_WAIT_S)
            stack.processes[victim].kill()
            await stack.processes[victim].wait()
    # Deltas still in flight when the result was stored.
    while True:
        try:
            msg = await stream.next_msg(timeout=1)
        except Exception:
            break
        assembled.add(decode_delta(msg.data))
    await stream.unsubscribe()
    return await result, assembled, victim


PROMPT = "Write a long story about a lighthouse keeper who finds a message in a bottle."
BASES = {name: GenerateRequest(prompt=PROMPT, max_tokens=96, ignore_eos=True, **sampling)
         for name, sampling in (("greedy", dict(temperature=0.0)),
                                ("seeded", dict(temperature=0.8, seed=7)))}


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def story(tmp_path_factory):
    """The stack, and each base request's undisturbed result (made together: the engine is
    batch-invariant, a request's tokens do not depend on its batch)."""
    async with running_stack(tmp_path_factory.mktemp("migration"), executors=2,
                             settings=SMOLLM2) as stack, \
            await JetserveClient.connect(stack.url, tenant="calm") as client:
        for name, base in BASES.items():
            await client.submit(msgspec.structs.replace(base, request_id=f"undisturbed-{name}"))
        undisturbed = {name: await client.result(f"undisturbed-{name}", timeout=300)
                       for name in BASES}
        assert all(isinstance(c, Completion) for c in undisturbed.values()), undisturbed
        yield stack, undisturbed


async def test_a_killed_executors_request_resumes_from_its_checkpoint(story):
    """Greedy, then seeded sampling; the executor killed for each is started again after it."""
    stack, undisturbed = story
    migrated = {}
    async with await JetserveClient.connect(stack.url, tenant="story") as client:
        before = await admission_stats(client)
        for name, base in BASES.items():
            resumed, assembled, victim = await migrate(
                stack, client, msgspec.structs.replace(base, request_id=f"migrated-{name}",
                                                       stream=True), kill_after=24)
            after = await admission_stats(client)
            migrated[name] = resumed, assembled, victim, {
                k: after[k] - before[k] for k in ("durable_handed_on", "resumed_tokens")}
            before = after
            if victim is not None:
                await stack.restart(victim)  # two executors again
    for name, (resumed, assembled, victim, handed_on) in migrated.items():
        assert isinstance(resumed, Completion), (name, resumed)
        assert victim is not None and resumed.scheduling.executor != victim, name
        assert resumed.token_ids == undisturbed[name].token_ids, name
        assert resumed.text == undisturbed[name].text, name
        # Every index once: the restated part was dropped, nothing is missing.
        assert assembled.token_ids == resumed.token_ids and assembled.text == resumed.text, name
        assert assembled.restarts == 1, name
        assert handed_on["durable_handed_on"] == 1 and handed_on["resumed_tokens"] >= 24, \
            (name, handed_on)


async def admission_stats(client) -> dict:
    admission = msgspec.json.decode((await client.nc.request(
        "$SRV.STATS.admission", b"", timeout=2)).data)
    return next(ep["data"] for ep in admission["endpoints"] if ep.get("data"))


async def kill_with_admission(stack, client) -> str:
    """SIGKILL admission and the executor running the one request (once a checkpoint had time
    to report its outputs), restart admission; the executor killed."""
    victim = await busy_executor(client)
    await asyncio.sleep(CHECKPOINT_WAIT_S)
    for name in ("admission", victim):
        stack.processes[name].kill()
        await stack.processes[name].wait()
    await stack.restart("admission")
    return victim


async def test_admission_and_the_executor_dying_together_continue_from_the_checkpoint(story):
    """Admission and the executor running a request are SIGKILLed together mid-generation.
    The restarted admission finds the request in LLM_STATE (its admitted copy, attempt and the
    checkpoint of its outputs) and hands it on: it continues on the other executor from the
    checkpoint, durable and generate alike, with the text of an undisturbed run. Before, a
    generate was lost with admission, and a durable request ran again from the start."""
    stack, undisturbed = story
    base, undisturbed = BASES["greedy"], undisturbed["greedy"]
    async with await JetserveClient.connect(stack.url, tenant="both") as client:
        # A durable request: its deltas watched, to kill once 24 tokens arrived.
        deltas = await client.stream_deltas("durable-both")
        await client.submit(msgspec.structs.replace(base, request_id="durable-both",
                                                    stream=True))
        seen = StreamAssembler()
        while len(seen.token_ids) < 24:
            seen.add(decode_delta((await deltas.next_msg(timeout=60)).data))
        durable_victim = await kill_with_admission(stack, client)
        durable = await client.result("durable-both", timeout=300)
        after_durable = await admission_stats(client)
        await deltas.unsubscribe()
        await stack.restart(durable_victim)  # two executors again
        # A streaming generate: nobody but admission (and LLM_STATE) knows it.
        streamed = client.stream(msgspec.structs.replace(base, request_id="generate-both",
                                                         stream=True), timeout=300)
        outputs = [await anext(streamed)]
        while sum(len(o.token_ids) for o in outputs) < 24:
            outputs.append(await anext(streamed))
        generate_victim = await kill_with_admission(stack, client)
        outputs += [o async for o in streamed]
        after_generate = await admission_stats(client)
    assert isinstance(undisturbed, Completion) and isinstance(durable, Completion), durable
    generated = outputs[-1]
    assert isinstance(generated, Completion), generated
    assert durable.scheduling.executor != durable_victim
    assert generated.scheduling.executor != generate_victim
    assert durable.token_ids == undisturbed.token_ids and durable.text == undisturbed.text
    assert generated.token_ids == undisturbed.token_ids and generated.text == undisturbed.text
    streamed_tokens = [t for o in outputs[:-1] for t in o.token_ids]
    assert streamed_tokens == generated.token_ids  # each index once, no gap
    # Each continued from its checkpoint (at least the 24 tokens seen before the kill).
    assert after_durable["taken_over"] == 1 and after_durable["durable_handed_on"] == 1
    assert after_durable["resumed_tokens"] >= 24, after_durable
    assert after_generate["taken_over"] == 1 and after_generate["generates_handed_on"] == 1
    assert after_generate["resumed_tokens"] >= 24, after_generate
