"""The `jetserve` command line: serve the pipeline, talk to it, or run an engine in-process."""

from __future__ import annotations

import argparse
import asyncio
import os
import sys

from shared.config import DEFAULT_MODEL, ConfigError, EngineConfig, engine_config
from shared.model_files import resolve_model_path


def _engine_options(parser: argparse.ArgumentParser) -> None:
    defaults = EngineConfig()
    parser.add_argument("--model", default=DEFAULT_MODEL,
                        help="SmolLM2-135M-Instruct (default), dummy:tiny, dummy:llama-3-8b, "
                             "a GGUF file or an HF directory")
    parser.add_argument("--max-num-seqs", type=int, default=defaults.batch.max_num_seqs)
    parser.add_argument("--max-num-batched-tokens", type=int,
                        default=defaults.batch.max_num_batched_tokens)
    parser.add_argument("--num-kv-blocks", type=int, default=None,
                        help="KV pool size in blocks (default: what fits the memory budget)")
    parser.add_argument("--block-size", type=int, default=defaults.kv_cache.block_size)
    parser.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    _quantization_option(parser, defaults.model.quantization,
                         defaults.model.quantized_activations)
    parser.add_argument("--dtype", choices=["auto", "float32", "bfloat16", "float16"],
                        default=defaults.model.dtype,
                        help="model.dtype (default auto: bf16 on a GPU, and on a CPU with native "
                             "bf16 (AVX512-BF16) with quantization none; else fp32). bf16 on a "
                             "CPU: bf16 weights and KV, fp32 activations")
    parser.add_argument("--no-pipeline", action="store_true",
                        help="run scheduling and output processing between steps, not beside them")
    parser.add_argument("--amx", choices=["auto", "tiles", "none"], default=defaults.model.amx,
                        help="model.amx: on a CPU with AMX, auto takes it for quantized weights' "
                             "prefills, tiles for a bf16 model's matmuls too (the kernels' own "
                             "tiles, not yet measured), none not at all")


def _quantization_option(parser: argparse.ArgumentParser, default: str | None,
                         activations: str | None) -> None:
    parser.add_argument("--quantization", choices=["none", "int8", "int4", "auto"],
                        default=default,
                        help="weight-only quantization of the matmuls on a CPU; auto keeps a "
                             "GGUF's own blocks (default: " + (default or "the config's") + ")")
    parser.add_argument("--quantized-activations", choices=["auto", "float32", "int8"],
                        default=activations,
                        help="activations of quantized matmuls: float32 (weight-only) or "
                             "int8 (W8A8 / W4A8 on AVX512-VNNI or AVX2); auto: int8 where the CPU "
                             "has either (default: " + (activations or "the config's") + ")")


def engine_config_of(args: argparse.Namespace) -> EngineConfig:
    return engine_config({"model.name": args.model, "model.device": args.device,
                          "model.quantization": args.quantization, "model.dtype": args.dtype,
                          "model.quantized_activations": args.quantized_activations,
                          "model.amx": args.amx,
                          "scheduler.batch_level.max_num_seqs": args.max_num_seqs,
                          "scheduler.batch_level.max_num_batched_tokens":
                              args.max_num_batched_tokens,
                          "kv_cache.num_blocks": args.num_kv_blocks,
                          "kv_cache.block_size": args.block_size,
                          "scheduler.token_level.pipeline": not args.no_pipeline})


def _client_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--nats-url", help="default: nats.url of the config (NATS_URL), "
                                           "nats://127.0.0.1:4222")
    parser.add_argument("--config", help="jetserve.yaml")
    parser.add_argument("--tenant", default=None,
                        help="default: the URL's user (a tenant's URL), else `default`")


def _request_options(parser: argparse.ArgumentParser) -> None:
    _client_options(parser)
    parser.add_argument("prompt")
    parser.add_argument("--priority", type=int, default=5, help="0-10, higher first")
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--temperature", type=float, default=None, help="0 is greedy")
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--model", default=None, help="default: what the stack serves")
    parser.add_argument("--raw", action="store_true",
                        help="send PROMPT as plain text to complete, not as a chat message")
    parser.add_argument("--timeout", type=float, default=600.0)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="jetserve", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)

    up = commands.add_parser("up", help="serve: nats-server (embedded unless --nats-url) and "
                                        "the four services as processes")
    up.add_argument("--nats-url", default=os.environ.get("NATS_URL"),
                    help="use this NATS server instead of starting one (default: $NATS_URL)")
    up.add_argument("--nats-port", type=int, default=4222)
    up.add_argument("--nats-cluster", type=int, default=1, metavar="N",
                    help="run the embedded server as a cluster of N nodes (1, or 3 and more) "
                         "on this host: node i on --nats-port + i, its routes on --nats-port + "
                         "2000 + i; the streams replicated (nats.replicas: N, 3 at most, unless "
                         "the config sets it)")
    up.add_argument("--state-dir", default=".jetserve", help="JetStream data and logs")
    up.add_argument("--executors", type=int, default=1)
    up.add_argument("--replicas", type=int, default=1, metavar="N",
                    help="processes of each of admission, priority and the batcher")
    up.add_argument("--model", default=None, help=f"default: the config's, else {DEFAULT_MODEL}")
    _quantization_option(up, None, None)
    up.add_argument("--config", help="jetserve.yaml (environment variables override it)")
    up.add_argument("--auth", action="store_true",
                    help="the embedded nats-server takes users: the services log in as theirs, "
                         "each tenant as its own, confined to its own subjects (jetserve tenant)")
    up.add_argument("--http-port", type=int, default=8000,
                    help="the OpenAI-compatible HTTP gateway's port (0: no gateway)")
    up.add_argument("--tls", action="store_true",
                    help="the embedded nats-server takes TLS connections only, with a certificate "
                         "of a local CA made in the state directory (clients need its ca.pem)")

    tenant = commands.add_parser("tenant", help="add or remove a tenant of a stack run with "
                                                "--auth (the server reloads)")
    tenant.add_argument("action", choices=["add", "remove"])
    tenant.add_argument("name")
    tenant.add_argument("--state-dir", default=".jetserve", help="the stack's --state-dir")

    generate = commands.add_parser("generate", help="one request over llm.generate.<tenant>")
    _request_options(generate)
    generate.add_argument("--stream", action="store_true", help="print text as it arrives")

    submit = commands.add_parser("submit", help="a durable request over "
                                                "llm.requests.<tenant>.<request_id>; "
                                                "waits for its result in LLM_RESULTS")
    _request_options(submit)
    submit.add_argument("--request-id", default=None, help="default: a random one")

    status = commands.add_parser("status", help="services, executors and queue depths")
    _client_options(status)

    bench = commands.add_parser("bench", help="benchmarks")
    bench_commands = bench.add_subparsers(dest="bench_command", required=True)
    from loadtest.serve import add_arguments

    add_arguments(bench_commands.add_parser(
        "serve", help="load a stack over the public protocol and measure it"))

    run_local = commands.add_parser(
        "run-local", help="run a JSONL file of GenerateRequests through an in-process engine")
    run_local.add_argument("requests", help="JSONL file, one GenerateRequest per line")
    run_local.add_argument("--progress", action="store_true", help="progress bar on stderr")
    _engine_options(run_local)

    args = parser.parse_args(argv)
    try:
        return _run(args)
    except ConfigError as exc:  # a bad setting, an unknown model or a missing file: said so
        parser.exit(2, f"jetserve {args.command}: {exc}\n")


def _run(args) -> int:
    if args.command == "bench":
        from loadtest import serve

        return serve.main(args)
    if args.command == "run-local":
        from services.executor import run_local as command

        config = engine_config_of(args)
        try:
            resolve_model_path(config.model.name)
        except (ValueError, FileNotFoundError) as exc:  # unknown dummy or sim model, no path
            raise ConfigError(str(exc)) from None
        try:
            return command.main(args.requests, config, args.progress)
        except FileNotFoundError as exc:
            if exc.filename != args.requests:
                raise
            raise ConfigError(f"{args.requests}: no such file") from None
    from services import commands as client_commands

    return asyncio.run(getattr(client_commands, args.command.replace("-", "_"))(args))


if __name__ == "__main__":
    sys.exit(main())
