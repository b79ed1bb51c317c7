"""The `jetserve` command line."""

from __future__ import annotations

import argparse
import sys

from shared.config import DEFAULT_MODEL, EngineConfig


def _engine_options(parser: argparse.ArgumentParser) -> None:
    defaults = EngineConfig()
    parser.add_argument("--model", default=DEFAULT_MODEL,
                        help="SmolLM2-135M-Instruct (default), dummy:tiny, dummy:llama-3-8b, "
                             "a GGUF file or an HF directory")
    parser.add_argument("--max-num-seqs", type=int, default=defaults.max_num_seqs)
    parser.add_argument("--max-num-batched-tokens", type=int,
                        default=defaults.max_num_batched_tokens)
    parser.add_argument("--num-kv-blocks", type=int, default=None,
                        help="KV pool size in blocks (default: what fits the memory budget)")
    parser.add_argument("--block-size", type=int, default=defaults.block_size)
    parser.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    parser.add_argument("--no-pipeline", action="store_true",
                        help="run scheduling and output processing between steps, not beside them")


def engine_config(args: argparse.Namespace) -> EngineConfig:
    return EngineConfig(model=args.model, max_num_seqs=args.max_num_seqs,
                        max_num_batched_tokens=args.max_num_batched_tokens,
                        num_kv_blocks=args.num_kv_blocks, block_size=args.block_size,
                        device=args.device, pipeline=not args.no_pipeline)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="jetserve", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)

    run_local = commands.add_parser(
        "run-local", help="run a JSONL file of GenerateRequests through an in-process engine")
    run_local.add_argument("requests", help="JSONL file, one GenerateRequest per line")
    run_local.add_argument("--progress", action="store_true", help="progress bar on stderr")
    _engine_options(run_local)

    args = parser.parse_args(argv)
    if args.command == "run-local":
        from services.executor import run_local as command

        return command.main(args.requests, engine_config(args), args.progress)
    return 2


if __name__ == "__main__":
    sys.exit(main())
