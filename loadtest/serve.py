"""`jetserve bench serve`: load a running jetserve (or one it starts) through the public NATS
protocol, like a user's client, and measure what every request saw.

    jetserve bench serve --embedded --model dummy:tiny --num-requests 200 --request-rate 20 \\
        --priority-mix 9:0.2,5:0.5,1:0.3 --tenant-mix a:0.5,b:0.5 --goodput ttft:500 \\
        --result-json results/run.json --plot results/run.png
    jetserve bench serve --compare results/a.json results/b.json
    jetserve bench serve --embedded --model sim:llama3-8b-h100 --executors 4 \
        --sweep scheduler.request_level.policy=fcfs,priority,adaptive --result-json set.json

`--sweep KEY=V1,V2,...` is a run set: the same requests, at the same send times, once per value,
each against a fresh embedded stack with that setting; one table and one plot compare them.
Given again, further sweeps add their runs to the same set (a fixed batch size at four values,
then the adaptive one: `--sweep scheduler.batch_level.max_num_seqs=8,16,32,64 --sweep
scheduler.batch_level.batch_size=adaptive`).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import math
import platform
import random
import sys
import time
from dataclasses import asdict
from pathlib import Path

import msgspec

from loadtest.arrivals import arrival_offsets, draw, parse_mix, parse_phases, phased_offsets
from loadtest.datasets import (jsonl_dataset, random_dataset, sharegpt_dataset,
                               shared_prefix_dataset, with_ids)
from loadtest.metrics import RequestRecord, Slo, summarize
from loadtest.report import print_comparison, print_runset, print_summary
from shared.client import JetserveClient
from shared.messages import Heartbeat, decoder
from shared.protocol import Cancel, Completion, Delta, Error, GenerateRequest
from shared.subjects import Subjects

SAMPLE_EVERY_S = 0.25  # queue depth and progress
_heartbeat = decoder(Heartbeat)
_decode_output = msgspec.json.Decoder(Delta | Completion | Error).decode
_encode = msgspec.json.Encoder().encode


def add_arguments(parser: argparse.ArgumentParser) -> None:
    target = parser.add_argument_group("target")
    target.add_argument("--backend", choices=["jetserve", "openai"], default="jetserve",
                        help="jetserve: its NATS protocol; openai: any OpenAI-compatible HTTP "
                             "server at --base-url (with --embedded: jetserve's gateway)")
    target.add_argument("--base-url", help="openai: the API's base URL, e.g. "
                                           "http://127.0.0.1:8000/v1")
    target.add_argument("--api-key", help="openai: sent as Authorization: Bearer KEY")
    target.add_argument("--endpoint", choices=["completions", "chat"], default="completions",
                        help="openai: /v1/completions (token-id prompts as they are) or "
                             "/v1/chat/completions (prompts as text, one user message)")
    target.add_argument("--served-model-name", help="openai: the `model` sent (default --model)")
    target.add_argument("--nats-url", default="nats://127.0.0.1:4222")
    target.add_argument("--embedded", action="store_true",
                        help="start nats-server and the four services for this run")
    target.add_argument("--model", default="SmolLM2-135M-Instruct",
                        help="the model served (embedded) and whose vocabulary random prompts use")
    target.add_argument("--executors", type=int, default=1, help="with --embedded")
    target.add_argument("--config", help="jetserve.yaml for the embedded services")
    target.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="embedded config override, e.g. scheduler.batch_level.max_num_seqs=8")

    load = parser.add_argument_group("arrivals")
    load.add_argument("--request-rate", type=float, default=math.inf,
                      help="requests per second (default inf: all at t=0)")
    load.add_argument("--burstiness", type=float, default=1.0,
                      help="gamma shape of the gaps: 1 is Poisson, < 1 burstier")
    load.add_argument("--max-concurrency", type=int, default=None,
                      help="at most this many requests in flight")
    load.add_argument("--num-requests", type=int, default=None, help="default 100")
    load.add_argument("--duration", type=float, default=None, help="send for this many seconds")
    load.add_argument("--rate-phases", metavar="RATE:SECONDS,...",
                      help="a load that changes: these rates one after another, e.g. "
                           "2:60,8:60,2:60 (instead of --request-rate and --duration)")
    load.add_argument("--seed", type=int, default=0)
    load.add_argument("--drain-timeout", type=float, default=600.0,
                      help="after the last send, wait this long for outstanding requests")

    data = parser.add_argument_group("dataset")
    data.add_argument("--dataset", choices=["random", "shared-prefix", "jsonl", "sharegpt"],
                      default="random")
    data.add_argument("--dataset-path", type=Path, help="for jsonl and sharegpt")
    data.add_argument("--input-len-range", type=int, nargs=2, default=[32, 512], metavar=("A", "B"))
    data.add_argument("--output-len-range", type=int, nargs=2, default=[16, 256],
                      metavar=("C", "D"))
    data.add_argument("--prefix-groups", type=int, default=4, help="shared-prefix: groups")
    data.add_argument("--prefix-len", type=int, default=256, help="shared-prefix: prefix tokens")
    data.add_argument("--sharegpt-max-output", type=int, default=512)
    data.add_argument("--ignore-eos", action="store_true", help="sharegpt: run to max_tokens")
    data.add_argument("--temperature", type=float, default=0.0)

    mix = parser.add_argument_group("mixes")
    mix.add_argument("--priority-mix", help="e.g. 9:0.2,5:0.5,1:0.3 (default: all priority 5)")
    mix.add_argument("--tenant-mix", help="e.g. a:0.5,b:0.5 (default: one tenant, bench)")
    mix.add_argument("--deadline-ms", help="per priority class, e.g. 9:2000,5:10000")

    out = parser.add_argument_group("output")
    out.add_argument("--goodput", nargs="+", metavar="NAME:MS",
                     help="SLOs a request must all meet to count: ttft:MS tpot:MS e2e:MS")
    out.add_argument("--result-json", type=Path)
    out.add_argument("--plot", type=Path, help="PNG: latency CDFs per priority, throughput and "
                                               "queue depth over time")
    out.add_argument("--label", default="", help="a name for this run in tables and --compare")
    out.add_argument("--no-progress", action="store_true")
    out.add_argument("--sweep", metavar="KEY=V1,V2,...", action="append", default=[],
                     help="with --embedded: one run per value of a config key, e.g. "
                          "scheduler.request_level.policy=fcfs,priority,adaptive; again for "
                          "more runs in the same set")
    parser.add_argument("--compare", nargs=2, type=Path, metavar=("A.json", "B.json"),
                        help="print two earlier runs side by side, run nothing")


def build_requests(args, rng: random.Random) -> list[GenerateRequest]:
    n = args.num_requests or 100
    if args.duration is not None and not math.isinf(args.request_rate):
        n = max(n, int(args.request_rate * args.duration * 1.5) + 1)  # few repeats
    from shared.model_files import load_model_config, tokenizer_dir  # (not for every CLI command)

    if args.dataset in ("random", "shared-prefix"):
        vocab = load_model_config(args.model, weights=False)[0].vocab_size
        if args.dataset == "random":
            requests = random_dataset(n, tuple(args.input_len_range),
                                      tuple(args.output_len_range), vocab, rng)
        else:
            requests = shared_prefix_dataset(n, args.prefix_groups, args.prefix_len,
                                             tuple(args.input_len_range),
                                             tuple(args.output_len_range), vocab, rng)
    elif args.dataset_path is None:
        raise SystemExit(f"--dataset {args.dataset} needs --dataset-path")
    elif args.dataset == "jsonl":
        requests = jsonl_dataset(args.dataset_path)
    else:
        from shared.tokenizer import Tokenizer

        tokenizer = Tokenizer(tokenizer_dir(load_model_config(args.model, weights=False)[1]))
        requests = sharegpt_dataset(args.dataset_path, lambda t: len(tokenizer.encode(t)),
                                    args.sharegpt_max_output, args.ignore_eos)
    if not requests:
        raise SystemExit("the dataset has no requests")
    if args.dataset in ("random", "shared-prefix", "sharegpt"):
        requests = [msgspec.structs.replace(r, temperature=args.temperature) for r in requests]
    return requests


def plan(args, rng: random.Random) -> tuple[list[float], list[tuple[GenerateRequest, str]]]:
    """Send times and (request, tenant) for each; the dataset repeats if the run needs more."""
    if args.duration is not None and args.num_requests is not None:
        raise SystemExit("give --num-requests or --duration, not both")
    if args.rate_phases and (args.duration is not None or args.num_requests is not None
                             or not math.isinf(args.request_rate)):
        raise SystemExit("--rate-phases sets the rates and durations: leave out --request-rate, "
                         "--duration and --num-requests")
    dataset = build_requests(args, rng)
    if args.rate_phases:
        try:
            offsets = phased_offsets(parse_phases(args.rate_phases), args.burstiness, rng)
        except ValueError as exc:
            raise SystemExit(f"--rate-phases: {exc}") from None
    else:
        offsets = arrival_offsets(
            args.request_rate, args.burstiness, rng, duration_s=args.duration,
            num_requests=None if args.duration is not None else args.num_requests or len(dataset))
    priorities = parse_mix(args.priority_mix, int)
    tenants = parse_mix(args.tenant_mix)
    deadlines = per_class(args.deadline_ms)
    run_id = f"bench{args.seed}-{int(time.time())}"
    repeated = [dataset[i % len(dataset)] for i in range(len(offsets))]
    chosen = []
    for request in with_ids(repeated, run_id):
        priority = draw(priorities, rng) if priorities else request.priority
        request = msgspec.structs.replace(request, priority=priority,
                                          deadline_ms=deadlines.get(priority, request.deadline_ms))
        chosen.append((request, draw(tenants, rng) if tenants else "bench"))
    return offsets, chosen


def per_class(text: str | None) -> dict[int, float]:
    """`"9:2000,5:10000"` -> {9: 2000.0, 5: 10000.0}."""
    if not text:
        return {}
    try:
        return {int(k): float(v) for k, v in (part.split(":") for part in text.split(","))}
    except ValueError:
        raise SystemExit(f"--deadline-ms {text!r}: expected PRIORITY:MS,...") from None


class StreamReceiver:
    """Every request's stream on one subscription (`<inbox>.<n>`), each message handled by one
    callback: what a client needs at thousands of deltas a second, where a subscription, an
    async generator and a timed wait per request would make the load generator the bottleneck
    (docs/protocol.md, streaming generate: deltas, then the Completion or Error, then an empty
    sentinel). A stream that restarts (the request continued on another executor)
    counts each token once (docs/protocol.md)."""

    def __init__(self, nc, clock, cancel, idle_timeout_s: float = 120.0):
        """`cancel(record)`: what to publish when the client gives up on a request."""
        self.nc, self.clock, self.cancel, self.idle_timeout_s = nc, clock, cancel, idle_timeout_s
        self.prefix = nc.new_inbox()
        self.open: dict[str, tuple[RequestRecord, asyncio.Future, list[int]]] = {}
        self.ids = itertools.count()
        self.last_seen: dict[str, float] = {}

    async def start(self) -> None:
        self.sub = await self.nc.subscribe(f"{self.prefix}.*", cb=self.on_msg)
        self.watchdog = asyncio.create_task(self.watch())

    async def stop(self) -> None:
        self.watchdog.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self.watchdog
        await self.sub.unsubscribe()

    async def send(self, subject: str, request: GenerateRequest, record: RequestRecord) -> None:
        """Publish one streaming request; returns when its final output (or the idle timeout)
        ends it."""
        key = str(next(self.ids))
        done = asyncio.get_running_loop().create_future()
        self.open[key] = (record, done, [0])
        self.last_seen[key] = self.clock()
        try:
            await self.nc.publish(subject, _encode(msgspec.structs.replace(request, stream=True)),
                                  reply=f"{self.prefix}.{key}")
        except Exception as exc:  # not sent: this request's error, not a time-out later
            record.end_time, record.error = self.clock(), f"client:{type(exc).__name__}"
            self._close(key)
        await done

    async def on_msg(self, msg) -> None:
        key = msg.subject[len(self.prefix) + 1:]
        entry = self.open.get(key)
        if entry is None or not msg.data:  # the sentinel, after the final output
            return
        record, done, have = entry
        now = self.clock()
        self.last_seen[key] = now
        try:
            output = _decode_output(msg.data)
        except msgspec.DecodeError:
            output = Error(request_id=record.request_id, code="client:bad_message",
                           message=repr(msg.data[:80]))
        if isinstance(output, Delta):
            new = output.index + len(output.token_ids) - have[0]
            if new > 0:  # a restarted stream restates what is already here
                have[0] += new
                record.delta_times.append(now)
                record.delta_tokens.append(new)
            return
        record.end_time = now
        if isinstance(output, Error):
            record.error = output.code
        else:
            record.output_tokens = output.usage.completion_tokens
            record.prompt_tokens = output.usage.prompt_tokens
            record.finish_reason = output.finish_reason
            record.queue_wait_ms = output.scheduling.queue_wait_ms
            record.scheduled_ms = output.metrics.queue_ms
            record.server_ttft_ms = output.metrics.ttft_ms
            record.cached_tokens = output.usage.cached_tokens
            record.preemptions = output.scheduling.preemptions
            record.recomputed_tokens = output.scheduling.recomputed_tokens
        self._close(key)

    def _close(self, key: str, result: bool = True) -> RequestRecord | None:
        entry = self.open.pop(key, None)
        self.last_seen.pop(key, None)
        if entry is None:
            return None
        record, done, _ = entry
        if not done.done():
            done.set_result(None) if result else done.cancel()
        return record

    async def watch(self) -> None:
        """A request with no message for `idle_timeout_s` is this client's error, and is
        cancelled so that it does not hold a slot."""
        while True:
            await asyncio.sleep(1.0)
            limit = self.clock() - self.idle_timeout_s
            for key in [k for k, seen in self.last_seen.items() if seen < limit]:
                record = self._close(key)
                if record is not None:
                    record.end_time, record.error = self.clock(), "client:TimeoutError"
                    with contextlib.suppress(Exception):
                        await self.cancel(record)

    async def cancel_open(self) -> None:
        """The run is over: what is still open is reported outstanding and cancelled."""
        for key in list(self.open):
            record = self._close(key, result=False)
            if record is not None:
                with contextlib.suppress(Exception):
                    await self.cancel(record)


async def sample_queue(nc, clock, records, timeline: list[dict], stop: asyncio.Event,
                       progress: bool, total: int, executors: dict[str, dict],
                       receivers: list[StreamReceiver]) -> None:
    """Every SAMPLE_EVERY_S: priority's queue depth, requests outstanding, tokens received, each
    executor's batch, and the load generator's own backlog (stream messages received and not yet
    handled; this client's event loop lag): a client that falls behind inflates what it
    measures, and the timeline says when."""
    while not stop.is_set():
        depth = None
        asked = clock()
        await asyncio.sleep(0)
        loop_lag_ms = 1e3 * (clock() - asked)
        try:
            reply = await nc.request("$SRV.STATS.priority", b"", timeout=1.0)
            depth = next((ep["data"]["queue_depth"] for ep in json.loads(reply.data)["endpoints"]
                          if ep.get("data")), None)
        except Exception:  # a sample lost is a gap in the plot, not a failed run
            pass
        done = sum(1 for r in records if r.end_time is not None)
        timeline.append({"t": clock(), "queue_depth": depth, "outstanding": len(records) - done,
                         "output_tokens": sum(sum(r.delta_tokens) for r in records),
                         "executors": {name: dict(e) for name, e in executors.items()},
                         "client_backlog": sum(r.sub.pending_msgs for r in receivers),
                         "client_loop_lag_ms": loop_lag_ms})
        if progress:
            errors = sum(1 for r in records if r.error)
            bar = "#" * int(30 * done / max(1, total))
            print(f"\r[{bar:<30}] sent {len(records)}/{total} done {done} errors {errors} "
                  f"queue {depth if depth is not None else '?'}   ", end="", file=sys.stderr,
                  flush=True)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), SAMPLE_EVERY_S)
    if progress:
        print(file=sys.stderr)


async def run(args, url: str) -> dict:
    rng = random.Random(args.seed)
    offsets, planned = plan(args, rng)
    nc_client = await JetserveClient.connect(url)
    nc = nc_client.nc
    subjects = Subjects()
    records: list[RequestRecord] = []
    timeline: list[dict] = []
    start = time.perf_counter()
    clock = lambda: time.perf_counter() - start  # noqa: E731
    stop = asyncio.Event()
    # Each tenant is a client of its own, on its own connection, as tenants are: one tenant's
    # token streams do not queue in front of another's on one socket.
    tenant_clients = {}
    receivers: dict[str, StreamReceiver] = {}
    for tenant in dict.fromkeys(tenant for _, tenant in planned):
        tenant_clients[tenant] = await JetserveClient.connect(url)
        conn = tenant_clients[tenant].nc
        receivers[tenant] = StreamReceiver(
            conn, clock, lambda r, conn=conn: conn.publish(subjects.cancel(r.tenant),
                                                            _encode(Cancel(r.request_id))))
        await receivers[tenant].start()
    # Each executor's batch limit and batch, from its heartbeats (default subject prefix).
    executors: dict[str, dict] = {}

    async def on_heartbeat(msg) -> None:
        with contextlib.suppress(msgspec.DecodeError):
            beat = _heartbeat.decode(msg.data)
            executors[beat.executor] = {"limit": beat.max_num_seqs, "running": beat.running}

    beats = await nc.subscribe(subjects.heartbeat, cb=on_heartbeat)
    sampler = asyncio.create_task(sample_queue(nc, clock, records, timeline, stop,
                                               not args.no_progress, len(planned), executors,
                                               list(receivers.values())))
    limit = asyncio.Semaphore(args.max_concurrency) if args.max_concurrency else None

    async def send(request, record, tenant):
        try:
            await receivers[tenant].send(subjects.generate(tenant), request, record)
        finally:
            if limit:
                limit.release()

    tasks = await send_on_schedule(offsets, planned, clock, limit, send, records)
    if tasks:
        _, pending = await asyncio.wait(tasks, timeout=args.drain_timeout)
        # Reported as outstanding, not dropped; cancelled so they do not hold slots.
        for receiver in receivers.values():
            await receiver.cancel_open()
        await asyncio.gather(*pending, return_exceptions=True)
    stop.set()
    await sampler
    await beats.unsubscribe()
    for tenant, receiver in receivers.items():
        await receiver.stop()
        await tenant_clients[tenant].close()
    await nc_client.close()
    ends = [r.end_time for r in records if r.end_time is not None]
    duration = max(ends) if ends else clock()
    return {"label": args.label, "summary": summarize(records, duration, Slo.parse(args.goodput)),
            "parameters": _parameters(args, url), "timeline": timeline,
            "requests": [asdict(r) for r in records]}


async def send_on_schedule(offsets, planned, clock, limit: asyncio.Semaphore | None, send,
                           records: list[RequestRecord]) -> list[asyncio.Task]:
    """Each planned (request, tenant) at its offset, once `limit` (max concurrency) lets it, as a
    task of `send(request, record, tenant)`; each one's record appended to `records` as it goes
    (`send` releases `limit`)."""
    tasks = []
    for offset, (request, tenant) in zip(offsets, planned):
        delay = offset - clock()
        if delay > 0:
            await asyncio.sleep(delay)
        if limit:
            await limit.acquire()
        record = RequestRecord(request_id=request.request_id, tenant=tenant,
                               priority=request.priority, send_time=clock(),
                               prompt_tokens=len(request.prompt_token_ids or []),
                               deadline_ms=request.deadline_ms)
        records.append(record)
        tasks.append(asyncio.create_task(send(request, record, tenant)))
    return tasks


def _parameters(args, url: str) -> dict:
    params = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()
              if k not in ("compare", "func")}
    params["request_rate"] = "inf" if math.isinf(args.request_rate) else args.request_rate
    params.update(nats_url=url, machine=platform.platform(), python=platform.python_version(),
                  started_at=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))
    return params


async def run_with_target(args) -> dict:
    openai = args.backend == "openai"
    if openai:
        from loadtest.openai_client import run_openai
    if not args.embedded:
        if openai:
            if not args.base_url:
                raise SystemExit("--backend openai needs --base-url (or --embedded)")
            return await run_openai(args, args.base_url)
        return await run(args, args.nats_url)
    from services.stack import temporary_stack

    settings = {"model.name": args.model, **dict(item.partition("=")[::2] for item in args.set)}
    async with temporary_stack("jetserve-bench-", executors=args.executors,
                               config_path=args.config, settings=settings,
                               http_port=0 if openai else None) as stack:
        return await (run_openai(args, stack.http_url) if openai else run(args, stack.url))


def sweep(args) -> dict:
    settings = []
    for text in args.sweep:
        key, _, values = text.partition("=")
        if not args.embedded or not key or not values:
            raise SystemExit("--sweep KEY=V1,V2,... needs --embedded")
        settings += [(key, value) for value in values.split(",")]
    runs = []
    for key, value in settings:
        one = argparse.Namespace(**{**vars(args), "set": [*args.set, f"{key}={value}"],
                                    "label": f"{key.rsplit('.', 1)[-1]}={value}"})
        result = asyncio.run(run_with_target(one))
        print_summary(result)
        runs.append(result)
    print_runset(runs)
    return {"sweep": args.sweep, "label": args.label, "runs": runs}


def main(args) -> int:
    if args.compare:
        a, b = (json.loads(p.read_text()) for p in args.compare)
        print_comparison(a, b)
        return 0
    if args.sweep:
        result = sweep(args)
    else:
        result = asyncio.run(run_with_target(args))
        print_summary(result)
    if args.result_json:
        args.result_json.parent.mkdir(parents=True, exist_ok=True)
        args.result_json.write_text(json.dumps(result, indent=1))
    if args.plot:
        from loadtest import plot

        if args.sweep:
            plot.plot_runset(result["runs"], args.plot, args.label)
        else:
            plot.plot_run(result, args.plot)
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="python -m loadtest.serve", description=__doc__)
    add_arguments(parser)
    sys.exit(main(parser.parse_args()))
