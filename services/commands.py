"""What `jetserve up | generate | submit | status` do (the argument parsing is in cli.py)."""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import signal
import ssl
import sys
import urllib.parse
from pathlib import Path

import msgspec

from services.auth import AuthError, Users, tenant_url, wait_login
from services.stack import Stack
from shared.bus import connect_options, discover, wait_event
from shared.client import JetserveClient
from shared.config import ConfigError, load_config
from shared.model_files import resolve_model_path
from shared.protocol import ChatMessage, Completion, Delta, Error, GenerateRequest
from shared.subjects import RESULTS_STREAM, Subjects


def _config(args):
    try:
        return load_config(args.config)
    except ConfigError as exc:
        raise SystemExit(str(exc)) from None


async def up(args) -> int:
    config = _config(args)
    model = args.model or config.model.name
    try:  # before anything starts: an executor that cannot find its model would die later
        resolve_model_path(model)
    except (ValueError, FileNotFoundError) as exc:
        print(f"jetserve up: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
    try:
        stack = Stack(state_dir=args.state_dir, nats_url=args.nats_url, nats_port=args.nats_port,
                      executors=args.executors, config_path=args.config, auth=args.auth,
                      tls=args.tls, http_port=args.http_port or None,
                      nats_cluster=args.nats_cluster, replicas=args.replicas,
                      settings={"model.name": model} | (
                          {"model.quantization": args.quantization} if args.quantization else {})
                      | ({"model.quantized_activations": args.quantized_activations}
                         if args.quantized_activations else {}))
    except (ValueError, AuthError) as exc:
        raise SystemExit(f"jetserve: {exc}") from None
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    servers = (f"{len(stack.nats_nodes)} embedded nats-servers (a cluster), "
               if len(stack.nats_nodes) > 1 else "embedded nats-server, ")
    print(f"jetserve: starting {servers if stack.embedded else ''}"
          f"{', '.join(stack.services)}"
          f"{f' ({stack.replicas} of each but the gateway)' if stack.replicas > 1 else ''}"
          f" and {args.executors} executor(s) with {model}",
          flush=True)
    starting = asyncio.create_task(stack.start())
    await asyncio.wait([starting, asyncio.create_task(stop.wait())],
                       return_when=asyncio.FIRST_COMPLETED)
    if not starting.done():
        starting.cancel()  # start() stops what it started when cancelled
        await asyncio.gather(starting, return_exceptions=True)
        return 130
    if starting.exception() is not None:
        print(f"jetserve: failed to start: {starting.exception()}", file=sys.stderr)
        return 1
    if stack.http_url:
        print(f"jetserve: OpenAI-compatible API at {stack.http_url} (model {model})", flush=True)
    if stack.tls:
        print(f"jetserve: TLS only; clients trust the server by its CA, {stack.tls['ca']} "
              f"(nats.tls.ca, or JETSERVE_NATS__TLS__CA)", flush=True)
    if args.auth:
        print(f"jetserve ready on {stack.url} (model {model}), with authentication: add a "
              f"tenant with `jetserve tenant add NAME --state-dir {args.state_dir}` and use the "
              f"URL it prints.   Ctrl-C stops.", flush=True)
    else:
        print(f"jetserve ready on {stack.url} (model {model}); try: jetserve generate "
              f"\"What is the capital of France?\"   Ctrl-C stops.", flush=True)
    while not await wait_event(stop, 1.0):
        dead = [n for n, p in stack.processes.items() if p.returncode is not None]
        if dead:
            print(f"jetserve: {', '.join(dead)} exited; stopping", file=sys.stderr)
            break
    print("jetserve: stopping", flush=True)
    await stack.stop()
    print("jetserve: stopped", flush=True)
    return 0


async def tenant(args) -> int:
    """`jetserve tenant add|remove NAME`: the running stack's server takes the change (a reload)
    before this returns; `add` prints the URL the tenant's clients use as its last line."""
    users = Users(args.state_dir)
    ca = Path(args.state_dir) / "tls" / "ca.pem"  # a stack run with --tls
    tls = ssl.create_default_context(cafile=ca) if ca.exists() else None
    try:
        if args.action == "add":
            url = users.add_tenant(args.name)
            await wait_login(url, accepted=True, tls=tls)
            print(f"tenant {args.name} added; its clients use (keep them secret) this API key "
                  f"at the OpenAI-compatible gateway (Authorization: Bearer KEY), and this URL "
                  f"over NATS:", file=sys.stderr)
            print(users.api_key(args.name))
            print(url)
        else:
            url = tenant_url(users.load()["url"], args.name,
                             users.load()["tenants"].get(args.name, ""))
            users.remove_tenant(args.name)
            await wait_login(url, accepted=False, tls=tls)
            print(f"tenant {args.name} removed: its credentials are refused and its "
                  f"connections closed", file=sys.stderr)
    except AuthError as exc:
        print(f"jetserve: {exc}", file=sys.stderr)
        return 1
    return 0


def _request(args, request_id: str | None = None) -> GenerateRequest:
    fields = dict(max_tokens=args.max_tokens, priority=args.priority, model=args.model,
                  request_id=request_id, seed=args.seed)
    if args.temperature is not None:
        fields["temperature"] = args.temperature
    if args.raw:
        return GenerateRequest(prompt=args.prompt, **fields)
    return GenerateRequest(messages=[ChatMessage(role="user", content=args.prompt)], **fields)


async def _connect(args) -> JetserveClient:
    """A client of `--tenant`, by default the URL's user (a tenant's URL names it), else
    `default`."""
    config = _config(args)
    url = args.nats_url or config.nats.url
    user = urllib.parse.urlsplit(url.split(",")[0]).username
    return await JetserveClient.connect(
        url, tenant=args.tenant or user or "default", prefix=config.nats.prefix,
        inbox_prefix=config.nats.client_inbox_prefix, **connect_options(config.nats))


def _report(final: Completion | Error, printed_text: bool) -> int:
    if isinstance(final, Error):
        print(f"error ({final.code}): {final.message}", file=sys.stderr)
        return 1
    if not printed_text:
        print(final.text, end="")
    print(flush=True)
    return 0


async def generate(args) -> int:
    async with await _connect(args) as client:
        request = _request(args)
        if not args.stream:
            return _report(await client.generate(request, timeout=args.timeout), False)
        async with contextlib.aclosing(client.stream(request, timeout=args.timeout)) as outputs:
            async for output in outputs:
                if isinstance(output, Delta):
                    print(output.text, end="", flush=True)
                else:
                    return _report(output, True)
        return 1


async def submit(args) -> int:
    async with await _connect(args) as client:
        request = _request(args, args.request_id or f"cli-{secrets.token_hex(8)}")
        ack = await client.submit(request)
        if not ack.duplicate:
            print(f"accepted: {request.request_id} (stream {ack.stream}, seq {ack.seq})",
                  file=sys.stderr)
        elif ack.stream == RESULTS_STREAM:
            print(f"duplicate: {request.request_id} has its result already", file=sys.stderr)
        else:
            print(f"duplicate: {request.request_id} is waiting or running; its result follows",
                  file=sys.stderr)
        return _report(await client.result(request.request_id, timeout=args.timeout), False)


async def status(args) -> int:
    async with await _connect(args) as client:
        stats = await discover(client.nc, "STATS", wait_s=0.5)
        if not stats:
            print("no jetserve services answer on this NATS server", file=sys.stderr)
            return 1
        print(f"{'service':<10} {'id':<24} {'started':<28} details")
        for entry in sorted(stats, key=lambda e: e["name"]):
            data = next((ep.get("data") for ep in entry.get("endpoints") or []
                         if ep.get("data")), {}) or {}
            print(f"{entry['name']:<10} {entry['id']:<24} {entry['started']:<28} "
                  f"{_summary(entry['name'], data)}")
        reply = await client.nc.request(Subjects(client.subjects.prefix).batcher_executors, b"",
                                        timeout=2)
        executors = msgspec.json.decode(reply.data)
        print(f"\n{'executor':<14} {'model':<24} {'running':>7} {'waiting':>7} {'kv usage':>9}")
        for name, e in sorted(executors.items()):
            usage = 1 - e["free_kv_blocks"] / max(1, e["total_kv_blocks"])
            print(f"{name:<14} {e['model']:<24} {e['running']:>7} {e['waiting']:>7} "
                  f"{usage:>8.1%}")
        return 0


def _summary(name: str, data: dict) -> str:
    keys = {"admission": ("admitted", "durable_admitted", "durable_held", "rejected"),
            "priority": ("queue_depth", "submitted", "dispatched", "cancelled"),
            "batcher": ("free_slots", "pulled", "assigned", "requeued"),
            "executor": ("executor", "running", "waiting", "kv_usage", "completed"),
            "gateway": ("port", "requests", "in_flight", "errors")}.get(name, ())
    return " ".join(f"{key}={data[key]}" for key in keys if key in data)
