"""`jetserve generate` against the stack serving the real SmolLM2-135M-Instruct."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import pytest

from tests.integration.conftest import running_stack


def jetserve_command() -> list[str]:
    script = Path(sys.executable).parent / "jetserve"
    return [str(script)] if script.exists() else [sys.executable, "-m", "services.cli"]


@pytest.mark.slow
@pytest.mark.asyncio
async def test_generate_answers_the_capital_of_france(tmp_path):
    settings = {"model.name": "SmolLM2-135M-Instruct", "kv_cache.num_blocks": 1024}
    async with running_stack(tmp_path, settings=settings) as stack:
        for extra in ([], ["--stream"]):
            process = await asyncio.create_subprocess_exec(
                *jetserve_command(), "generate", "--nats-url", stack.url, "--temperature", "0",
                "--max-tokens", "48", *extra, "What is the capital of France?",
                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
            stdout, stderr = await asyncio.wait_for(process.communicate(), 120)
            assert process.returncode == 0, stderr.decode()
            assert "Paris" in stdout.decode(), stdout.decode()
