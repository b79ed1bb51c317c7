"""Shared test helpers: engines on the tiny random model and the real SmolLM2."""

from __future__ import annotations

import asyncio
import os
from collections import Counter

import pytest
import torch

# Triton kernels run on a CPU only in its interpreter, chosen when triton is first imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from services.executor.engine.llm_engine import Engine  # noqa: E402
from shared.config import EngineConfig, engine_config  # noqa: E402
from shared.protocol import Completion, Delta, Error, GenerateRequest  # noqa: E402

TINY = "dummy:tiny"


def pytest_configure(config):
    """Each pytest-xdist worker takes its share of the cores (make test runs TEST_JOBS of them):
    torch's OpenMP threads from processes that each took every core spin against each other,
    and a tiny model's step then takes tens of milliseconds, not one. Where the share is one
    thread, so is the executors' that its stacks start (services/stack.py leaves a set
    OMP_NUM_THREADS alone); a larger share the stack splits among its executors itself."""
    workers = os.environ.get("PYTEST_XDIST_WORKER_COUNT")  # set in the workers only
    if workers and "OMP_NUM_THREADS" not in os.environ:
        threads = max(1, len(os.sched_getaffinity(0)) // int(workers))
        torch.set_num_threads(threads)
        if threads == 1:
            os.environ["OMP_NUM_THREADS"] = "1"


# pytest-xdist hands out whole files, those with the most tests first (the Makefile keeps this
# order with --no-loadscope-reorder). Only in the workers: a run in one process keeps pytest's
# order (and --stepwise with it).
def pytest_collection_modifyitems(items):
    if "PYTEST_XDIST_WORKER" not in os.environ:
        return

    def file(item) -> str:
        return item.nodeid.split("::")[0]

    tests_in = Counter(file(item) for item in items)
    items.sort(key=lambda item: -tests_in[file(item)])


def tiny_config(settings: dict | None = None, **fields) -> EngineConfig:
    """The tiny model's engine: `settings` as `--set` takes them, over these."""
    return engine_config({"model.name": TINY, "scheduler.batch_level.max_num_seqs": 16,
                          "scheduler.batch_level.max_num_batched_tokens": 128,
                          "kv_cache.num_blocks": 256, **(settings or {})}, **fields)


async def generate_all(engine: Engine, requests: list[GenerateRequest],
                       timeout: float = 120.0) -> list[Completion | Error]:
    """Submit all requests at once; their final outputs, in order."""
    engine.start()

    async def one(request: GenerateRequest):
        final = None
        async for output in engine.generate(request):
            if not isinstance(output, Delta):
                final = output
        return final

    return await asyncio.wait_for(asyncio.gather(*(one(r) for r in requests)), timeout)


@pytest.fixture
async def tiny_engine():
    engine = Engine(tiny_config())
    yield engine
    await engine.stop()
