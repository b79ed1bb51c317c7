"""`jetserve run-local`: a JSONL file of GenerateRequests through one in-process engine.

Writes one Completion or Error JSON object per input line to stdout, in input order.
"""

from __future__ import annotations

import asyncio
import sys
import time
from typing import IO

import msgspec

from services.executor.engine.llm_engine import Engine, Output
from shared.config import EngineConfig
from shared.protocol import (
    Completion,
    Delta,
    Error,
    ProtocolError,
    decode_generate_request,
)


def _request_id_of(line: str) -> str | None:
    """Best effort, for the Error of a line that did not parse as a GenerateRequest."""
    try:
        value = msgspec.json.decode(line)
    except msgspec.DecodeError:
        return None
    rid = value.get("request_id") if isinstance(value, dict) else None
    return rid if isinstance(rid, str) else None


class Progress:
    """A one-line progress bar on stderr."""

    def __init__(self, total: int, stream: IO[str]):
        self.total, self.stream = total, stream
        self.done = self.tokens = 0
        self.start = time.perf_counter()

    def update(self, completion: Completion | Error) -> None:
        self.done += 1
        if isinstance(completion, Completion):
            self.tokens += completion.usage.completion_tokens
        elapsed = time.perf_counter() - self.start
        width = 30
        filled = width * self.done // max(self.total, 1)
        self.stream.write(f"\r[{'#' * filled}{'.' * (width - filled)}] {self.done}/{self.total} "
                          f"requests  {self.tokens} tokens  {self.tokens / elapsed:.1f} tok/s")
        if self.done == self.total:
            self.stream.write("\n")
        self.stream.flush()


async def run_requests(engine: Engine, lines: list[str],
                       progress: Progress | None = None) -> list[Completion | Error]:
    """Run every line through `engine`; the results come back in input order."""
    results = [asyncio.get_running_loop().create_future() for _ in lines]

    def finish(index: int, output: Output) -> None:
        if not isinstance(output, Delta) and not results[index].done():  # a cancelled wait: no one
            results[index].set_result(output)
            if progress:
                progress.update(output)

    engine.start()
    for index, line in enumerate(lines):
        try:
            request = decode_generate_request(line)
            if request.request_id is None:
                request.request_id = f"line-{index + 1}"
            engine.add_request(engine.admit(request), lambda out, i=index: finish(i, out))
        except ProtocolError as exc:
            finish(index, exc.to_error(_request_id_of(line) or f"line-{index + 1}"))
    return list(await asyncio.gather(*results))


def main(path: str, config: EngineConfig, show_progress: bool) -> int:
    with open(path, encoding="utf-8") as file:
        lines = [line for line in file.read().splitlines() if line.strip()]

    async def run() -> list[Completion | Error]:
        async with Engine(config) as engine:
            progress = Progress(len(lines), sys.stderr) if show_progress else None
            return await run_requests(engine, lines, progress)

    encoder = msgspec.json.Encoder()
    for result in asyncio.run(run()):
        sys.stdout.write(encoder.encode(result).decode() + "\n")
    sys.stdout.flush()
    return 0
