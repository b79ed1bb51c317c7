"""Shared test helpers: engines on the tiny random model and the real SmolLM2."""

from __future__ import annotations

import asyncio
import os

import pytest
import torch

# Triton kernels run on a CPU only in its interpreter, chosen when triton is first imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from services.executor.engine.llm_engine import Engine  # noqa: E402
from shared.config import EngineConfig, engine_config  # noqa: E402
from shared.protocol import Completion, Delta, Error, GenerateRequest  # noqa: E402

TINY = "dummy:tiny"
TESTS = os.path.dirname(os.path.abspath(__file__))

# The files that take longest, longest first (`make test PYTEST_ADDOPTS=--durations=0` says which).
# `make test` hands whole files to its workers in collection order (--dist loadfile
# --no-loadscope-reorder): these start first and the short files fill in beside them. In
# xdist's own order (most tests first) the one-test file of minutes started last while the
# other worker idled.
LONGEST_FIRST = ["integration/test_podman_compose.py", "integration/test_durable_recovery.py",
                 "executor/test_smollm2.py", "integration/test_fuzz.py",
                 "integration/test_chaos.py", "integration/test_limits.py",
                 "loadtest/test_migration_bench.py", "integration/test_migration.py",
                 "integration/test_drain.py", "integration/test_scheduling.py"]


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(os.path.relpath(item.path, TESTS).replace(os.sep, "/"),
                                         len(rank)))  # stable: the rest keep their order


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
