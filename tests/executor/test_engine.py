"""The engine end to end on the tiny random model: batching must never change the tokens."""

from __future__ import annotations

import asyncio
import random
import time

import msgspec
import pytest

from services.executor.engine.llm_engine import Engine
from shared.protocol import Completion, Delta, Error, GenerateRequest
from tests.conftest import generate_all, tiny_config


def prompts(n, seed=0, low=5, high=80):
    rng = random.Random(seed)
    return [[rng.randrange(17, 49152) for _ in range(rng.randint(low, high))] for _ in range(n)]


def add(engine: Engine, request: GenerateRequest, sink, **options):
    """Admitted (as admission would) and queued."""
    return engine.add_request(engine.admit(request), sink, **options)


def greedy(ids, max_tokens=24, **kw):
    return GenerateRequest(prompt_token_ids=ids, max_tokens=max_tokens, temperature=0.0,
                           ignore_eos=True, **kw)


async def run(config, requests):
    engine = Engine(config)
    try:
        return await generate_all(engine, requests), engine
    finally:
        await engine.stop()


async def test_alone_equals_together():
    batch = prompts(8)
    together, _ = await run(tiny_config(), [greedy(p) for p in batch])
    for p, out in zip(batch, together):
        alone, _ = await run(tiny_config(), [greedy(p)])
        assert alone[0].token_ids == out.token_ids
        assert out.finish_reason == "length" and len(out.token_ids) == 24


async def test_pipelined_equals_unpipelined():
    requests = [greedy(p) for p in prompts(6, seed=1)]
    on, _ = await run(tiny_config({"scheduler.token_level.pipeline": True}), requests)
    off, _ = await run(tiny_config({"scheduler.token_level.pipeline": False}), requests)
    assert [c.token_ids for c in on] == [c.token_ids for c in off]


async def test_prefix_cache_hit_reports_cached_tokens_and_same_tokens():
    shared = prompts(1, seed=2, low=200, high=200)[0]
    first = shared + [101, 102, 103]
    second = shared + [201, 202]
    engine = Engine(tiny_config())
    try:
        [a] = await generate_all(engine, [greedy(first)])
        [b] = await generate_all(engine, [greedy(second)])
    finally:
        await engine.stop()
    assert a.usage.cached_tokens == 0
    assert b.usage.cached_tokens == 192  # 12 full blocks of 16 out of the 200 shared tokens
    cold, _ = await run(tiny_config({"kv_cache.enable_prefix_caching": False}), [greedy(second)])
    assert cold[0].usage.cached_tokens == 0
    assert b.token_ids == cold[0].token_ids


async def test_forced_preemption_gives_same_tokens():
    batch = prompts(8, seed=3, low=20, high=60)
    requests = [greedy(p, max_tokens=40) for p in batch]
    roomy, _ = await run(tiny_config(), requests)
    # 24 blocks of 16 cannot hold 8 sequences of up to 100 tokens: preemption is forced.
    tight, engine = await run(tiny_config({"kv_cache.num_blocks": 24}), requests)
    assert sum(c.scheduling.preemptions for c in tight) > 0
    assert [c.token_ids for c in tight] == [c.token_ids for c in roomy]


async def test_seeded_sampling_is_reproducible_and_batch_independent():
    batch = prompts(4, seed=4)
    sampled = [GenerateRequest(prompt_token_ids=p, max_tokens=16, temperature=1.0, top_k=50,
                               top_p=0.9, seed=1234 + i, ignore_eos=True)
               for i, p in enumerate(batch)]
    together, _ = await run(tiny_config(), sampled)
    alone, _ = await run(tiny_config(), [sampled[2]])
    assert alone[0].token_ids == together[2].token_ids
    other_seed = GenerateRequest(prompt_token_ids=batch[2], max_tokens=16, temperature=1.0,
                                 top_k=50, top_p=0.9, seed=99, ignore_eos=True)
    different, _ = await run(tiny_config(), [other_seed])
    assert different[0].token_ids != together[2].token_ids


async def test_stream_deltas_reassemble_to_completion(tiny_engine):
    request = GenerateRequest(prompt="Hello there", max_tokens=20, temperature=0.0,
                              ignore_eos=True, stream=True)
    tiny_engine.start()
    deltas, final = [], None
    async for output in tiny_engine.generate(request):
        if isinstance(output, Delta):
            deltas.append(output)
        else:
            final = output
    assert isinstance(final, Completion)
    assert "".join(d.text for d in deltas) == final.text
    assert [t for d in deltas for t in d.token_ids] == final.token_ids
    index = 0
    for d in deltas:
        assert d.index == index
        index += len(d.token_ids)


async def test_stop_token_ids_and_max_tokens(tiny_engine):
    [free] = await generate_all(tiny_engine, [greedy(prompts(1, seed=5)[0], max_tokens=12)])
    stop_at = free.token_ids[5]
    first = free.token_ids.index(stop_at)
    [stopped] = await generate_all(tiny_engine, [greedy(prompts(1, seed=5)[0], max_tokens=12,
                                                        stop_token_ids=[stop_at])])
    assert stopped.finish_reason == "stop"
    assert stopped.token_ids == free.token_ids[:first + 1]


async def test_stop_string_is_cut_from_text(tiny_engine):
    request = GenerateRequest(prompt="abc", max_tokens=30, temperature=0.0, ignore_eos=True)
    [free] = await generate_all(tiny_engine, [request])
    text = free.text
    assert len(text) > 12
    stop = text[8:11]
    cut = text.find(stop)
    [stopped] = await generate_all(tiny_engine, [GenerateRequest(
        prompt="abc", max_tokens=30, temperature=0.0, ignore_eos=True, stop=[stop])])
    assert stopped.finish_reason == "stop"
    assert stopped.text == text[:cut]


async def test_abort_running_request(tiny_engine):
    tiny_engine.start()
    request = greedy(prompts(1, seed=6)[0], max_tokens=1900, request_id="long")
    outputs = []

    async def consume():
        async for output in tiny_engine.generate(request):
            outputs.append(output)

    import asyncio

    task = asyncio.create_task(consume())
    for _ in range(1000):
        if tiny_engine.stats.steps > 3 or task.done():
            break
        await asyncio.sleep(0.01)
    assert tiny_engine.abort("long")
    await asyncio.wait_for(task, 10)
    assert outputs[-1].finish_reason == "cancelled"
    assert 0 < len(outputs[-1].token_ids) < 1900
    assert tiny_engine.block_manager.num_free_blocks == tiny_engine.block_manager.num_blocks


@pytest.mark.parametrize("request_kwargs, code, needle", [
    (dict(prompt_token_ids=[1] * 3000, max_tokens=10), "prompt_too_long", "max_model_len"),
    (dict(prompt="hi", model="other-model"), "unknown_model", "other-model"),
    (dict(prompt_token_ids=[10**6]), "invalid_request", "prompt_token_ids"),
    (dict(prompt="hi", stop_token_ids=[10**6]), "invalid_request", "stop_token_ids"),
    (dict(prompt="hi", prompt_token_ids=[1]), "invalid_request", "exactly one"),
])
async def test_bad_requests_raise_protocol_errors(tiny_engine, request_kwargs, code, needle):
    from shared.protocol import ProtocolError

    with pytest.raises(ProtocolError) as info:
        tiny_engine.admit(GenerateRequest(**request_kwargs))
    assert info.value.code == code and needle in info.value.message
    assert tiny_engine.num_unfinished == 0


async def test_errors_leave_other_requests_untouched(tiny_engine):
    good = greedy(prompts(1, seed=7)[0])
    [expected] = await generate_all(tiny_engine, [good])
    from shared.protocol import ProtocolError

    with pytest.raises(ProtocolError):
        tiny_engine.admit(GenerateRequest(prompt=""))
    [again] = await generate_all(tiny_engine, [good])
    assert again.token_ids == expected.token_ids and not isinstance(again, Error)


async def test_cancelled_stream_deltas_add_up_to_completion(tiny_engine):
    import asyncio

    tiny_engine.start()
    request = GenerateRequest(prompt="Tell me a story", max_tokens=1000, temperature=0.8, seed=3,
                              ignore_eos=True, stream=True, request_id="story",
                              stop=["a stop string far longer than any token"])
    outputs = []

    async def consume():
        async for output in tiny_engine.generate(request):
            outputs.append(output)
            if len(outputs) == 10:
                tiny_engine.abort("story")

    await asyncio.wait_for(consume(), 30)
    final = outputs[-1]
    assert isinstance(final, Completion) and final.finish_reason == "cancelled"
    assert "".join(o.text for o in outputs[:-1]) == final.text
    assert [t for o in outputs[:-1] for t in o.token_ids] == final.token_ids


async def test_failed_step_ends_requests_and_keeps_serving(tiny_engine):
    model = tiny_engine.runner.model
    real_forward = model.forward
    calls = 0

    def failing_once(*args, **kwargs):
        nonlocal calls
        calls += 1
        if calls == 1:
            raise RuntimeError("injected failure")
        return real_forward(*args, **kwargs)

    model.forward = failing_once
    ids = prompts(1, seed=8, low=65, high=65)[0]
    [failed] = await generate_all(tiny_engine, [greedy(ids)])
    assert isinstance(failed, Error) and failed.code == "internal"
    assert "injected failure" in failed.message
    # The failed step's blocks were registered in the prefix cache but never written.
    assert tiny_engine.block_manager.hash_to_block == {}
    [ok] = await generate_all(tiny_engine, [greedy(ids)])
    assert isinstance(ok, Completion) and ok.usage.cached_tokens == 0 and len(ok.token_ids) == 24


async def test_a_bug_past_the_model_step_ends_requests_and_keeps_serving(tiny_engine):
    """Processing a step's outputs, or the step loop itself, raising (a bug): every request
    is answered `internal` and the next is served. Before, the loop task died unnoticed and
    its requests were reported as running for good."""
    ids = prompts(1, seed=8, low=65, high=65)[0]
    for name in ("_process", "_until_nearly_done"):
        real = getattr(tiny_engine, name)
        calls = 0

        def failing_once(*args, real=real, **kwargs):
            nonlocal calls
            calls += 1
            if calls == 1:
                raise RuntimeError(f"injected into {real.__name__}")
            return real(*args, **kwargs)

        setattr(tiny_engine, name, failing_once)
        [failed, other] = await generate_all(tiny_engine, [greedy(ids), greedy(ids[:10])])
        assert isinstance(failed, Error) and failed.code == "internal", failed
        assert f"injected into {name}" in failed.message and isinstance(other, Error)
        assert calls >= 1 and tiny_engine.num_unfinished == 0
        [ok] = await generate_all(tiny_engine, [greedy(ids)])
        assert isinstance(ok, Completion) and len(ok.token_ids) == 24
        delattr(tiny_engine, name)


async def test_deadline_ends_a_running_request_with_what_it_has(tiny_engine):
    """A request past its deadline stops at once: finish_reason `deadline`, its partial output
    kept; one that got no token by then ends with a `deadline_exceeded` Error."""
    long = GenerateRequest(request_id="long", prompt_token_ids=[20, 21, 22], max_tokens=1500,
                           ignore_eos=True, deadline_ms=300, stream=True)
    tiny_engine.start()
    outputs = [o async for o in tiny_engine.generate(long)]
    final = outputs[-1]
    assert isinstance(final, Completion) and final.finish_reason == "deadline"
    assert 0 < len(final.token_ids) < 1500
    assert 250 <= final.metrics.e2e_ms < 1000
    streamed = [t for d in outputs if isinstance(d, Delta) for t in d.token_ids]
    assert streamed == final.token_ids
    assert tiny_engine.num_unfinished == 0 and tiny_engine.block_manager.num_free_blocks == 256


async def test_deadline_passed_on_arrival_is_an_error(tiny_engine):
    import time

    stale = GenerateRequest(request_id="stale", prompt_token_ids=[20, 21], max_tokens=8,
                            deadline_ms=50)
    queue = []
    tiny_engine.start()
    add(tiny_engine, stale, queue.append, arrival_time=time.monotonic() - 1.0)
    await asyncio.sleep(0.05)
    [error] = queue
    assert isinstance(error, Error) and error.code == "deadline_exceeded"
    assert "`deadline_ms` 50" in error.message and tiny_engine.num_unfinished == 0


async def test_score_orders_requests_and_reaches_the_completion(tiny_engine):
    queue = []
    for name, score in [("low", 1.0), ("high", 7.5)]:
        add(tiny_engine, greedy([20, 21, 22], max_tokens=4, request_id=name), queue.append,
            score=score)
    assert [s.key for s in tiny_engine.scheduler.waiting] == ["high", "low"]
    tiny_engine.start()
    while len(queue) < 2:
        await asyncio.sleep(0.01)
    assert {c.request_id: c.scheduling.priority_score for c in queue} == {"high": 7.5, "low": 1.0}


async def test_aging_bound_at_the_executor():
    """With max_wait_s, a request that has waited that long goes ahead of fresher, higher-score
    ones, and a running request past it is not preempted by them. The waits are given as
    arrival times (10 s ago), not slept: on a loaded host a slept wait also aged the fresh one."""
    engine = Engine(tiny_config({"scheduler.batch_level.max_num_seqs": 1}, max_wait_s=5.0))
    finished: list[str] = []
    engine.start()
    try:
        def sink(output):
            if not isinstance(output, Delta):
                finished.append(output.request_id)

        long_ago = time.monotonic() - 10.0
        add(engine, greedy([20, 21], max_tokens=1500, request_id="busy"), sink, score=5.0,
            arrival_time=long_ago)
        await asyncio.sleep(0.05)
        add(engine, greedy([22, 23], max_tokens=8, request_id="low"), sink, score=1.0,
            arrival_time=long_ago)
        add(engine, greedy([24, 25], max_tokens=8, request_id="high"), sink, score=9.0)
        await asyncio.sleep(0.1)  # high is fresh: it may neither preempt busy nor pass low
        assert [s.key for s in engine.scheduler.running] == ["busy"]
        assert [s.key for s in engine.scheduler.waiting] == ["low", "high"]
        assert engine.scheduler.num_preemptions == 0
        engine.abort("busy")
        while len(finished) < 3:
            await asyncio.sleep(0.01)
    finally:
        await engine.stop()
    assert finished == ["busy", "low", "high"]


async def test_the_aging_bound_can_count_from_dispatch():
    """A request of a tenant over its share arrives long after admission: its bound counts from
    `aging_start`, so it is not aged on arrival and a higher score still goes first."""
    engine = Engine(tiny_config({"scheduler.batch_level.max_num_seqs": 1}, max_wait_s=1.0))
    old = time.monotonic() - 10.0
    add(engine, greedy([20, 21], max_tokens=8, request_id="held"), lambda out: None,
        arrival_time=old, score=1.0, aging_start=time.monotonic())
    add(engine, greedy([22, 23], max_tokens=8, request_id="aged"), lambda out: None,
        arrival_time=old, score=1.0)
    await asyncio.sleep(0.5)
    add(engine, greedy([24, 25], max_tokens=8, request_id="high"), lambda out: None,
        score=9.0)
    assert [s.key for s in engine.scheduler.waiting] == ["aged", "high", "held"]
    await asyncio.sleep(0.75)  # held has waited 1.25 s since its start (aged); high 0.75 s
    waiting = [s.key for s in engine.scheduler.waiting]
    assert sorted(waiting[:2]) == ["aged", "held"] and waiting[2] == "high"
    for request_id in ("held", "aged", "high"):
        engine.abort(request_id)


def test_max_wait_s_reaches_the_engine_only_under_the_adaptive_policy():
    from shared.config import load_config

    adaptive = load_config(None, {})
    assert adaptive.engine_config("e").max_wait_s == 60.0
    fcfs = load_config(None, {"JETSERVE_SCHEDULER__REQUEST_LEVEL__POLICY": "fcfs"})
    assert fcfs.engine_config("e").max_wait_s is None


async def test_warm_up_leaves_no_trace():
    """The start-up warm-up writes the pool's first blocks and nothing else: a pool of two blocks
    still serves, no block stays held, and the tokens equal those over a freshly zeroed cache."""
    request = greedy(prompts(1)[0][:8])
    warmed = Engine(tiny_config({"kv_cache.num_blocks": 2, "kv_cache.block_size": 16}))
    zeroed = Engine(tiny_config({"kv_cache.num_blocks": 2, "kv_cache.block_size": 16}))
    for k, v in zeroed.runner.kv_caches:
        k.zero_()
        v.zero_()
    try:
        assert warmed.block_manager.num_free_blocks == 2
        [a] = await generate_all(warmed, [request])
        [b] = await generate_all(zeroed, [request])
    finally:
        await warmed.stop()
        await zeroed.stop()
    assert a.token_ids == b.token_ids and len(a.token_ids) == 24


async def test_an_engine_with_the_shortest_context_warms_up_and_serves():
    """model.max_model_len at its least (16): the warm-up's positions stay in the rotary table
    (it ran a 32-token prompt whatever the context, past the table's 16 rows), and a request
    that fills the context is served."""
    engine = Engine(tiny_config({"model.max_model_len": 16}))
    try:
        assert engine.max_model_len == engine.runner.model.cos_sin_cache.shape[0] == 16
        runner, positions = engine.runner, []

        def execute(inputs, run=runner.execute):
            positions.append(int(inputs.positions.max()))
            return run(inputs)

        runner.execute = execute
        engine.on_model_thread(runner.warm_up)
        assert positions and max(positions) < 16, positions  # (the kernels check no bounds)
        del runner.execute
        [done] = await generate_all(engine, [greedy(prompts(1)[0][:8], max_tokens=8)])
    finally:
        await engine.stop()
    assert isinstance(done, Completion) and len(done.token_ids) == 8


@pytest.mark.parametrize("temperature", [0.0, 1.0])
async def test_a_request_resumed_from_a_checkpoint_ends_as_an_undisturbed_run(temperature):
    """Greedy and seeded sampling alike: given the first 15 outputs of a run, the engine
    computes them as context and draws every later token as the undisturbed run did."""
    engine = Engine(tiny_config())
    try:
        request = GenerateRequest(prompt_token_ids=list(range(30, 70)), max_tokens=40,
                                  temperature=temperature, seed=1234, ignore_eos=True, stream=True)
        [undisturbed] = await generate_all(engine, [request])
        outputs: list = []
        add(engine, msgspec.structs.replace(request, request_id="resumed"), outputs.append,
            resume_token_ids=undisturbed.token_ids[:15])
        while not outputs or isinstance(outputs[-1], Delta):
            await asyncio.sleep(0.01)
        *deltas, resumed = outputs
        # Ended at once when the checkpoint already holds every output.
        done: list = []
        add(engine, msgspec.structs.replace(request, request_id="finished"), done.append,
            resume_token_ids=undisturbed.token_ids)
        # A checkpoint with ids outside the vocabulary (a forged report; a negative id made the
        # key a zombie, one past the vocabulary failed the step for every request): dropped,
        # the request runs from its prompt to the same tokens.
        forged = []
        for i, bad in enumerate((-1, engine.model_config.vocab_size)):
            forged.append([])
            add(engine, msgspec.structs.replace(request, request_id=f"forged-{i}"),
                forged[-1].append, resume_token_ids=undisturbed.token_ids[:5] + [bad])
        while not all(f and not isinstance(f[-1], Delta) for f in forged):
            await asyncio.sleep(0.01)
    finally:
        await engine.stop()
    assert all(f[-1].token_ids == undisturbed.token_ids for f in forged), forged
    assert resumed.token_ids == undisturbed.token_ids and resumed.text == undisturbed.text
    assert resumed.finish_reason == "length"
    # The first delta restates the checkpoint from index 0; the rest follow on without a gap.
    assert deltas[0].index == 0 and len(deltas[0].token_ids) >= 15
    assert [t for d in deltas for t in d.token_ids] == undisturbed.token_ids
    assert "".join(d.text for d in deltas) == undisturbed.text
    assert isinstance(done[-1], Completion) and done[-1].token_ids == undisturbed.token_ids


async def test_the_engine_refuses_what_it_cannot_run_without_stopping(tiny_engine):
    """add_request trusts admission's checks but not blindly: a request that never went through
    admission (no seed, another model, ids past the vocabulary, longer than the context) is
    refused with a clear Error, and the step loop keeps serving."""
    from shared.protocol import ProtocolError

    good = tiny_engine.admit(greedy([20, 21, 22], max_tokens=4, request_id="good"))
    bad = [(msgspec.structs.replace(good, seed=None), "invalid_request", "Engine.admit"),
           (msgspec.structs.replace(good, model="other"), "unknown_model", "other"),
           (msgspec.structs.replace(good, prompt_token_ids=[10**6]), "invalid_request",
            "vocabulary"),
           (msgspec.structs.replace(good, max_tokens=10**5), "prompt_too_long", "max_model_len")]
    for request, code, needle in bad:
        with pytest.raises(ProtocolError) as info:
            tiny_engine.add_request(request, lambda _: None)
        assert info.value.code == code and needle in info.value.message
    [completion] = await generate_all(tiny_engine, [greedy([20, 21, 22], max_tokens=4)])
    assert isinstance(completion, Completion) and len(completion.token_ids) == 4
