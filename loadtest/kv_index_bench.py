"""What one KV-aware pick costs the batcher: a prompt's cached prefix looked up on every
executor, while each holds many blocks promised (prompts routed to it in the last seconds whose
own KV events have not come in yet).

    python -m loadtest.kv_index_bench --result-json results/kv_index_bench.json
"""

from __future__ import annotations

import argparse
import os
import platform
import time

from loadtest.metrics import write_result
from services.batcher.kv_index import KvIndex


def pick_ms(executors: int, promised: int, prompt_blocks: int, picks: int) -> float:
    """The mean time of one pick: the prompt's cached prefix on each executor."""
    index = KvIndex()
    for e in range(executors):
        index.promise(f"e{e}", [os.urandom(16) for _ in range(promised)], until=10.0)
    prompt = [os.urandom(16) for _ in range(prompt_blocks)]
    started = time.perf_counter()
    for _ in range(picks):
        for e in range(executors):
            index.cached_prefix(f"e{e}", prompt, now=5.0)
    return 1e3 * (time.perf_counter() - started) / picks


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--executors", type=int, nargs="+", default=[8])
    parser.add_argument("--promised", type=int, nargs="+", default=[640, 6400],
                        help="blocks promised on each executor")
    parser.add_argument("--prompt-blocks", type=int, default=8)
    parser.add_argument("--picks", type=int, default=200)
    parser.add_argument("--result-json", default="results/kv_index_bench.json")
    args = parser.parse_args(argv)
    rows = []
    print(f"{'executors':>10}{'promised':>10}{'pick (ms)':>12}")
    for executors in args.executors:
        for promised in args.promised:
            ms = pick_ms(executors, promised, args.prompt_blocks, args.picks)
            rows.append({"executors": executors, "promised": promised, "pick_ms": ms})
            print(f"{executors:>10}{promised:>10}{ms:>12.4f}")
    write_result(args.result_json, "kv_index_bench", params=vars(args), rows=rows,
                 machine=platform.processor() or platform.machine())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
