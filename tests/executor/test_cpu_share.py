"""Torch's CPU threads follow the cores other processes leave free (cpu_share.py): the control
law on readings a test gives, then a real busy process beside the test, read from /proc/stat,
taking a thread from a CpuShare and from an engine."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time

import pytest

from services.executor.engine.cpu_share import CpuShare
from services.executor.engine.llm_engine import Engine
from tests.conftest import generate_all, tiny_config
from shared.protocol import Completion, GenerateRequest

CPUS = frozenset(os.sched_getaffinity(0))
needs_two = pytest.mark.skipif(len(CPUS) < 2 or not os.path.exists("/proc/stat"),
                               reason="a busy neighbour takes a thread away only from two "
                                      "cores up, measured on Linux")


def share_of(most: int, cpus: int, interval_s: float = 1.0) -> CpuShare:
    """A CpuShare whose readings a test gives (`decide`) as if over `cpus` CPUs."""
    share = CpuShare(most, interval_s=interval_s)
    share.cpus = frozenset(range(cpus))
    return share


def test_the_count_is_the_cores_left_rounded_within_one_and_the_most():
    two = share_of(2, 2)
    assert [two.pick(x) for x in (0.0, 0.3, 0.49, 0.5, 0.97, 1.6, 2.0)] == [2, 2, 2, 1, 1, 1, 1]
    many = share_of(8, 16)
    assert [many.pick(x) for x in (0.0, 7.9, 9.6, 15.0, 16.0)] == [8, 8, 6, 1, 1]
    more_than_cpus = share_of(8, 4)  # as configured while nothing else runs
    assert [more_than_cpus.pick(x) for x in (0.0, 0.4, 1.0)] == [8, 8, 3]


def test_down_at_once_up_after_the_hold_with_a_margin():
    """Readings given, a second apart (the counting of /proc/stat is the next tests')."""
    share = share_of(2, 2)
    assert share.decide(0, 1, 0.6) == 1  # at once
    assert share.decide(1, 2, 0.0) == 1  # free for one interval of the two
    assert share.decide(2, 3, 0.35) == 1  # not within the margin: starts again
    assert share.decide(3, 4, 0.1) == 1
    assert share.decide(4, 5, 0.25) == 2  # two seconds free (within the margin)
    # Down a second after that rise: the hold doubles. A pause: one reading over five seconds
    # is free long enough.
    assert share.decide(5, 6, 0.9) == 1 and share.hold_s == 4
    assert share.decide(40, 45, 0.05) == 2


def test_with_every_core_busy_the_others_share_is_scaled_by_this_ones_shortfall():
    """Three executors with two threads each on four cores: each gets 1.6 and reads 2.4
    cores of others, which would round to two and keep it oversubscribed."""
    share = share_of(2, 4)
    assert share.others_of(busy=4.0, mine=1.6) == pytest.approx(3.0)
    assert share.pick(share.others_of(busy=4.0, mine=1.6)) == 1
    assert share.others_of(busy=3.0, mine=1.6) == pytest.approx(1.4)  # a core idle: as read
    assert share.others_of(busy=4.0, mine=2.0) == pytest.approx(2.0)  # not short


def test_a_fall_soon_after_a_rise_doubles_the_hold():
    """Executors sharing a host, each counting the others as busy, or a neighbour busy in
    cycles: the count moves ever more rarely rather than in step with them."""
    share = share_of(2, 2)
    t, holds = 0.0, []
    for _ in range(7):
        share.decide(t, t + 1, 1.0)  # busy: down
        t += 1
        holds.append(share.hold_s)
        while share.decide(t, t + 1, 0.0) == 1:  # free: up after the hold
            t += 1
        t += 1
    assert holds == [2, 4, 8, 16, 32, 32, 32]
    share.decide(t + 100, t + 101, 1.0)  # long after the last rise: not a flap
    assert share.hold_s == 2
    t += 101
    assert share.decide(t, t + 1, 0.0) == 1 and share.decide(t + 1, t + 2, 0.0) == 2


def test_a_neighbour_busy_in_cycles_does_not_keep_the_count_down():
    """Busy 2 s in every 10: each fall comes long after the rise before it (no flap), so the
    count comes back after two free seconds every cycle."""
    share = share_of(2, 2)
    counts = []
    for t in range(100):
        counts.append(share.decide(t, t + 1, 1.0 if t % 10 < 2 else 0.0))
    assert share.hold_s == 2
    assert sum(c == 2 for c in counts) >= 50, counts


@contextlib.contextmanager
def busy_neighbour():
    """A process always runnable on one of this process's CPUs."""
    cpu = min(CPUS)
    process = subprocess.Popen([sys.executable, "-c", "while True: pass"],
                               preexec_fn=lambda: os.sched_setaffinity(0, {cpu}))
    try:
        time.sleep(0.3)
        yield
    finally:
        process.kill()
        process.wait(10)


@needs_two
def test_a_busy_neighbour_read_from_proc_stat_takes_a_thread():
    with busy_neighbour():
        share = CpuShare(len(CPUS), interval_s=0.3)
        assert share.threads() == len(CPUS)  # within the first interval: as it was
        time.sleep(0.4)
        assert share.threads() <= len(CPUS) - 1
        assert share.others >= 0.8, share.others
        assert share.cpus == CPUS


@needs_two
async def test_the_engine_steps_with_one_thread_fewer_beside_a_busy_neighbour():
    engine = Engine(tiny_config({"model.num_threads": len(CPUS)}))
    try:
        assert engine.cpu_share is not None and engine.cpu_share.most == len(CPUS)
        engine.cpu_share.interval_s = 0.2
        with busy_neighbour():
            deadline = time.monotonic() + 20
            while engine.torch_threads == len(CPUS) and time.monotonic() < deadline:
                outputs = await generate_all(engine, [GenerateRequest(
                    prompt_token_ids=[20, 21, 22], max_tokens=16, temperature=0.0,
                    ignore_eos=True)])
                assert isinstance(outputs[0], Completion)
            assert engine.torch_threads <= len(CPUS) - 1
            # The model thread runs its steps with that count.
            assert engine._threads_set == engine.torch_threads
    finally:
        await engine.stop()


async def test_off_by_setting_the_engine_keeps_its_threads():
    engine = Engine(tiny_config({"model.adaptive_threads": False}))
    try:
        await generate_all(engine, [GenerateRequest(prompt_token_ids=[20, 21], max_tokens=4)])
        assert engine.cpu_share is None and engine.torch_threads is None
    finally:
        await engine.stop()


async def test_the_thread_count_does_not_change_the_tokens():
    """Each output of the kernels' matmuls and attention is one thread's: a count moved
    mid-load changes no token (greedy, and seeded sampling)."""
    requests = [GenerateRequest(prompt_token_ids=[20 + i, 31, 7 * i + 40] * (1 + i % 5),
                                max_tokens=24, ignore_eos=True, **sampling)
                for i in range(6) for sampling in (dict(temperature=0.0),
                                                   dict(temperature=0.9, seed=11 + i))]
    tokens = {}
    for threads in (1, max(2, len(CPUS))):
        engine = Engine(tiny_config({"model.num_threads": threads,
                                     "model.adaptive_threads": False}))
        try:
            tokens[threads] = [c.token_ids for c in await generate_all(engine, requests)]
        finally:
            await engine.stop()
    one, many = tokens.values()
    assert one == many and all(len(t) == 24 for t in one)
