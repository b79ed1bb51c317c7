"""Torch's CPU threads follow the cores other processes leave free (cpu_share.py): a process
that is always runnable on one of the engine's cores takes a thread away, measured from
/proc/stat with a real busy process beside the test."""

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


def test_the_count_is_the_cores_left_rounded_within_one_and_the_most():
    two = CpuShare(2, cpus=frozenset({0, 1}))
    assert [two.pick(x) for x in (0.0, 0.3, 0.49, 0.5, 0.97, 1.6, 2.0)] == [2, 2, 2, 1, 1, 1, 1]
    many = CpuShare(8, cpus=frozenset(range(16)))
    assert [many.pick(x) for x in (0.0, 7.9, 9.6, 15.0, 16.0)] == [8, 8, 6, 1, 1]


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
def test_a_busy_neighbour_takes_a_thread_after_two_intervals_in_a_row():
    with busy_neighbour():
        share = CpuShare(len(CPUS), interval_s=0.5)
        time.sleep(0.6)
        assert share.threads() == len(CPUS)  # one interval: not yet
        assert share.others >= 0.8, share.others
        deadline = time.monotonic() + 5
        while share.threads() == len(CPUS) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert share.threads() <= len(CPUS) - 1
        assert share.others >= 0.8, share.others


@needs_two
def test_after_a_pause_as_long_as_two_intervals_one_reading_moves_the_count():
    """No step ran for a while (an idle engine): the count of before the pause is stale."""
    with busy_neighbour():
        share = CpuShare(len(CPUS), interval_s=0.2)
        time.sleep(0.6)
        assert share.threads() <= len(CPUS) - 1
        assert share.others >= 0.8, share.others


@needs_two
async def test_the_engine_steps_with_one_thread_fewer_beside_a_busy_neighbour():
    engine = Engine(tiny_config({"model.num_threads": 2}))
    try:
        assert engine.cpu_share is not None and engine.cpu_share.most == 2
        engine.cpu_share.interval_s = 0.2
        with busy_neighbour():
            deadline = time.monotonic() + 20
            while engine.torch_threads != 1 and time.monotonic() < deadline:
                outputs = await generate_all(engine, [GenerateRequest(
                    prompt_token_ids=[20, 21, 22], max_tokens=16, temperature=0.0,
                    ignore_eos=True)])
                assert isinstance(outputs[0], Completion)
            assert engine.torch_threads == 1
    finally:
        await engine.stop()


async def test_off_by_setting_the_engine_keeps_its_threads():
    engine = Engine(tiny_config({"model.adaptive_threads": False}))
    try:
        await generate_all(engine, [GenerateRequest(prompt_token_ids=[20, 21], max_tokens=4)])
        assert engine.cpu_share is None and engine.torch_threads is None
    finally:
        await engine.stop()
