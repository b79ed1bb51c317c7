"""A Node.js client (npm package `nats`) streams a generate request from the running stack and
submits a durable one."""

from __future__ import annotations

import asyncio
import json
import shutil
from pathlib import Path

import pytest

from tests.integration.conftest import running_stack

NODE_DIR = Path(__file__).parent / "node"


def install_node_client() -> None:
    """`npm ci` from the committed lock file, once per checkout."""
    import subprocess

    if (NODE_DIR / "node_modules" / "nats").exists():
        return
    subprocess.run(["npm", "ci", "--no-audit", "--no-fund"], cwd=NODE_DIR, check=True,
                   timeout=300, capture_output=True)


async def node(script: str, *args: str) -> dict:
    """The one JSON line a Node.js client script prints."""
    process = await asyncio.create_subprocess_exec(
        "node", script, *args, cwd=NODE_DIR, stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE)
    stdout, stderr = await asyncio.wait_for(process.communicate(), 120)
    assert process.returncode == 0, stderr.decode()
    return json.loads(stdout)


@pytest.mark.asyncio
async def test_node_client_streams_a_generate_request_and_submits_a_durable_one(tmp_path):
    assert shutil.which("node") and shutil.which("npm"), "Node.js 20 and npm are required"
    await asyncio.to_thread(install_node_client)
    async with running_stack(tmp_path) as stack:
        result = await node("stream.mjs", stack.url, "nodejs", "Hello from JavaScript")
        durable = await node("durable.mjs", stack.url, "nodejs", "js-1", "Hello, durably")
    completion = result["completion"]
    assert completion["type"] == "completion" and completion["finish_reason"] == "length"
    assert result["deltas"] >= 2 and result["contiguous"] and result["sentinelLast"]
    assert result["token_ids"] == completion["token_ids"] and len(completion["token_ids"]) == 32
    assert result["text"] == completion["text"]
    assert durable["stream"] == "LLM_REQUESTS" and "per subject" in durable["repeat"]
    stored = durable["result"]
    assert stored["type"] == "completion" and stored["request_id"] == "js-1", stored
    assert len(stored["token_ids"]) == 128
