"""Cluster chaos: a three-node NATS cluster (streams R3), two replicas of each control-plane
service and two simulated executors (`sim:smollm2-cpu`) take durable and generate requests,
all sent at once, while one process of each kind is SIGKILLed in turn (a NATS node, an
admission, a priority, a batcher, an executor), each restarted after a pause.

It counts what a user would: every durable request's results in LLM_RESULTS (exactly one
each), every generate's final answers at its own reply subject (exactly one each, watched for
two leases after the last), and `internal` Errors (none). And the throughput around each kill:
every request streams, and the output tokens reaching the client per second (each position
once: a stream that restarts on another executor restates what came before) over the 3 s
before the kill are set against each window (1 or 2 s) after it, up to the next kill (the last: four
leases on): how long until it is back to 80 % of before and stays there, and the lowest
window (a stall that starts a second or two after a kill, once the batches then running end,
counts).

    python -m loadtest.cluster_chaos --result-json results/cluster_chaos.json
    python -m loadtest.cluster_chaos --short-lease --result-json results/cluster_chaos_short.json

The first runs the shipped configuration (a 5 s lease, 128 sequences a step; 900 + 900
requests, kills 12 s apart, 2 s windows); the second a 1.5 s lease and 32 sequences a step
(300 + 300, 5 s apart, 1 s windows), as `tests/integration/test_cluster_chaos.py`
in make test does (3 s apart there), which asserts the counts; the throughput figures are
this script's (BENCHMARKS.md).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import random
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path

import msgspec

from loadtest.metrics import write_result
from services.stack import Stack, free_port, temporary_stack
from shared.client import JetserveClient, _decode_output, _encode
from shared.config import DistributedSection
from shared.protocol import Completion, Delta, Error, GenerateRequest
from shared.request_state import STATE_STREAM
from shared.subjects import REQUESTS_STREAM, RESULTS_STREAM

# One process of each kind. "nats-server-leader" is the node leading LLM_STATE (made one the
# client is not connected to: the services on it fail over, and every stream it led elects a
# new leader, seconds without JetStream); "nats-server-other" is any node the client is not
# on; "nats-server-client", the client's own, also tests the client's failover, where a
# generate's answer in flight to it is lost as any core NATS message to a subscriber whose
# server dies is (a durable request's is not: it is stored).
VICTIMS = ["nats-server-leader", "admission-1", "priority", "batcher-1", "executor-0"]
# As shipped, but for the simulated model and the metrics ports (two replicas share a host).
SHIPPED = {"model.name": "sim:smollm2-cpu",
           **{f"monitoring.metrics_port.{kind}": 0
              for kind in ("admission", "priority", "batcher", "executor")}}
# A lease of 1.5 s (shipped: 5 s), and fewer sequences a step: the same story in a third of the
# time (the test in make test runs these).
SETTINGS = {**SHIPPED, "kv_cache.num_blocks": 4096,
            "distributed.heartbeat_interval_s": 0.25, "distributed.heartbeat_timeout_s": 1.5,
            "nats.ack_wait_s": 2.0, "scheduler.batch_level.max_num_seqs": 32}


@dataclass
class Answers:
    """What came back, as it came: (monotonic time, new output tokens) of each delta, and
    every final answer per request."""

    tokens: list[tuple[float, int]] = field(default_factory=list)
    upto: dict[str, int] = field(default_factory=dict)  # output positions seen, per request
    finals: dict[str, list[Completion | Error]] = field(default_factory=dict)
    at: dict[str, list[float]] = field(default_factory=dict)  # when each final came

    def add(self, request_id: str, output) -> None:
        now = time.monotonic()
        if isinstance(output, Delta):
            end = output.index + len(output.token_ids)
            new = end - self.upto.get(request_id, 0)
            if new > 0:
                self.upto[request_id] = end
                self.tokens.append((now, new))
            return
        self.finals.setdefault(request_id, []).append(output)
        self.at.setdefault(request_id, []).append(now)


async def chaos(stack, client, durable: int, generate: int, victims: list[str],
                gap_s: float, pause_s: float, rng: random.Random, window_s: float = 1.0) -> dict:
    """The load, the kills, and what came back (see the module's docstring)."""
    lease_s = stack.settings.get("distributed.heartbeat_timeout_s",
                                 DistributedSection().heartbeat_timeout_s)
    durable_answers, generate_answers = Answers(), Answers()
    tenant = client.tenant

    async def on_result(msg) -> None:  # a durable request's result, or its delta
        durable_answers.add(msg.subject.rsplit(".", 1)[1], _decode_output(msg.data))

    async def on_answer(msg) -> None:
        if msg.data:  # (an empty message ends a stream)
            generate_answers.add(msg.subject.rsplit(".", 1)[1], _decode_output(msg.data))

    inbox = client.nc.new_inbox()
    subscriptions = [await client.nc.subscribe(client.subjects.results(tenant, "*"), cb=on_result),
                     await client.nc.subscribe(client.subjects.stream(tenant, "*"), cb=on_result),
                     await client.nc.subscribe(f"{inbox}.*", cb=on_answer)]
    durable_ids = [f"d{i}" for i in range(durable)]
    generate_ids = [f"g{i}" for i in range(generate)]
    started = time.monotonic()
    for request_id in durable_ids:
        await client.submit(GenerateRequest(
            request_id=request_id, prompt=f"chaos {request_id}", max_tokens=rng.randint(20, 80),
            ignore_eos=True, temperature=0.0, stream=True))
    for request_id in generate_ids:
        await client.nc.publish(client.subjects.generate(tenant), _encode(GenerateRequest(
            request_id=request_id, prompt=f"chaos {request_id}", max_tokens=rng.randint(20, 80),
            ignore_eos=True, temperature=0.0, stream=True)), reply=f"{inbox}.{request_id}")
    kills = []
    for name in victims:
        on = stack.client_ports.index(client.nc.connected_url.port)
        if name == "nats-server-client":
            name = f"nats-server-{on}"
        elif name == "nats-server-other":
            name = f"nats-server-{(on + 1) % len(stack.client_ports)}"
        elif name == "nats-server-leader":
            name = f"nats-server-{await state_leader(client, avoid=on)}"
        await asyncio.sleep(gap_s)
        stack.processes[name].send_signal(signal.SIGKILL)
        await stack.processes[name].wait()
        kills.append((name, time.monotonic()))
        await asyncio.sleep(pause_s)
        await stack.restart(name)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:  # (durable results counted where they are stored)
        stored = (await client.js.stream_info(RESULTS_STREAM)).state.messages
        if stored >= durable and len(generate_answers.finals) >= generate:
            break
        await asyncio.sleep(0.1)
    ended = time.monotonic()
    for request_id in durable_ids:  # one a disconnected subscription missed: read it
        if request_id not in durable_answers.finals:
            with contextlib.suppress(Exception):
                durable_answers.add(request_id, await client.result(request_id, timeout=5))
    await asyncio.sleep(2 * lease_s)  # a second answer would come within this
    for subscription in subscriptions:
        await subscription.unsubscribe()
    stored = (await client.js.stream_info(RESULTS_STREAM)).state.messages
    for _ in range(100):  # every durable request's message acked (after its result)
        unacked = (await client.js.stream_info(REQUESTS_STREAM)).state.messages
        if unacked == 0:
            break
        await asyncio.sleep(0.1)
    finals = {**durable_answers.finals, **generate_answers.finals}
    errors = [o for seen in finals.values() for o in seen if isinstance(o, Error)]
    tokens = sorted(durable_answers.tokens + generate_answers.tokens)
    return {
        "durable": durable, "generate": generate,
        "durable_answered": len(durable_answers.finals),
        "generate_answered": len(generate_answers.finals),
        "results_stored": stored, "requests_left_in_stream": unacked,
        # A durable request's second result would be refused by LLM_RESULTS (yet reach a
        # subscriber): counted from the stream; a generate's, at its reply subject.
        "duplicates": (stored - durable) + sum(len(seen) - 1
                                              for seen in generate_answers.finals.values()),
        "errors": [msgspec.to_builtins(e) for e in errors[:10]], "error_count": len(errors),
        "internal_errors": sum(e.code == "internal" for e in errors),
        "elapsed_s": round(ended - started, 2),
        "unanswered": [i for i in durable_ids if i not in durable_answers.finals]
        + [i for i in generate_ids if i not in generate_answers.finals],
        "duplicated": [{"request_id": request_id, "at_s": [round(t - started, 2) for t in
                                                           generate_answers.at[request_id]],
                        "executors": [getattr(getattr(o, "scheduling", None), "executor", None)
                                      for o in seen]}
                       for request_id, seen in generate_answers.finals.items() if len(seen) > 1],
        "output_tokens": sum(n for _, n in tokens),
        "window_s": window_s, "lease_s": lease_s,
        "kills": recovery(tokens, kills, started, lease_s, gap_s, window_s=window_s),
        "processes_running": all(p.returncode is None for p in stack.processes.values()),
    }


async def state_leader(client, avoid: int) -> int:
    """The node leading LLM_STATE, moved off node `avoid` (the client's) if it led there."""
    for _ in range(10):
        leader = (await client.js.stream_info(STATE_STREAM)).cluster.leader
        node = int(leader.rsplit("-", 1)[1])
        if node != avoid:
            return node
        with contextlib.suppress(Exception):
            await client.nc.request(f"$JS.API.STREAM.LEADER.STEPDOWN.{STATE_STREAM}", b"",
                                    timeout=5)
        await asyncio.sleep(1.0)
    raise RuntimeError(f"LLM_STATE's leader stayed on node {avoid}")


def recovery(tokens: list[tuple[float, int]], kills: list[tuple[str, float]], started: float,
             lease_s: float, gap_s: float, before_s: float = 3.0, window_s: float = 1.0,
             back: float = 0.8) -> list[dict]:
    """Per kill: output tokens/s reaching the client in the `before_s` before it; each
    `window_s` after it (sliding by a tenth of a second) up to the next kill (four leases, or
    `gap_s`, after the last one); how long after the kill the windows reached `back` of before and stayed
    there (the end of the first such window; None: not by the next kill), when a window first
    reached it, and the lowest."""
    def rate(start: float, end: float) -> float:
        return sum(n for at, n in tokens if start <= at < end) / (end - start)

    last = tokens[-1][0] if tokens else started
    out = []
    for i, (name, at) in enumerate(kills):
        horizon = min(kills[i + 1][1] if i + 1 < len(kills) else at + max(gap_s, 4 * lease_s),
                      last)
        before = rate(at - before_s, at)
        windows = [(t + window_s - at, rate(t, t + window_s))  # (its end after the kill, rate)
                   for t in (at + k / 10 for k in range(int((horizon - at - window_s) * 10) + 1))]
        first_back = next((end for end, seen in windows if seen >= back * before), None)
        back_after = None
        for end, seen in reversed(windows):
            if seen < back * before:
                break
            back_after = end
        lowest = min((seen for _, seen in windows), default=None)
        out.append({"victim": name, "at_s": round(at - started, 2),
                    "before_tok_s": round(before, 1),
                    "after_2_leases_tok_s": round(rate(at + 2 * lease_s - window_s,
                                                       at + 2 * lease_s), 1),
                    "lowest_tok_s": None if lowest is None else round(lowest, 1),
                    "first_back_after_s": None if first_back is None else round(first_back, 2),
                    "back_to_80pct_after_s": None if back_after is None else round(back_after, 2),
                    "leases": None if back_after is None else round(back_after / lease_s, 2)})
    return out


def report(result: dict) -> str:
    lines = [f"{result['durable']} durable + {result['generate']} generate requests, "
             f"{result['output_tokens']} output tokens streamed in {result['elapsed_s']} s: durable answered {result['durable_answered']} "
             f"(LLM_RESULTS holds {result['results_stored']}), generates answered "
             f"{result['generate_answered']}, duplicates {result['duplicates']}, errors "
             f"{result['error_count']} ({result['internal_errors']} internal)",
             f"{'killed':<16}{'at s':>8}{'before tok/s':>14}{'lowest':>9}{'2 leases on':>13}"
             f"  {'first >= 80 %':<22}>= 80 % from then on ({result['window_s']:g} s windows)"]
    lease_s = result["lease_s"]
    for kill in result["kills"]:
        first, back = kill["first_back_after_s"], kill["back_to_80pct_after_s"]
        first = "-" if first is None else f"{first} s ({round(first / lease_s, 2)} leases)"
        back = "-" if back is None else f"{back} s ({kill['leases']} leases)"
        lines.append(f"{kill['victim']:<16}{kill['at_s']:>8}{kill['before_tok_s']:>14}"
                     f"{kill['lowest_tok_s']!s:>9}{kill['after_2_leases_tok_s']:>13}  "
                     f"{first:<22}{back}")
    return "\n".join(lines)


async def run(args) -> dict:
    rng = random.Random(args.seed)
    options = dict(executors=2, settings=settings_of(args), nats_cluster=args.nodes,
                   replicas=args.replicas)
    if args.log_dir:  # kept, with the stack's state
        stack = Stack(state_dir=args.log_dir, nats_port=free_port(args.nodes),
                      log_dir=Path(args.log_dir) / "logs", **options)
        await stack.start()
        try:
            async with await JetserveClient.connect(stack.url, tenant="chaos") as client:
                return await chaos(stack, client, args.durable, args.generate, args.victims,
                                   args.gap_s, args.pause_s, rng, args.window_s)
        finally:
            await stack.stop()
    async with temporary_stack(**options) as stack:
        async with await JetserveClient.connect(stack.url, tenant="chaos") as client:
            return await chaos(stack, client, args.durable, args.generate, args.victims,
                               args.gap_s, args.pause_s, rng, args.window_s)


def settings_of(args) -> dict:
    return SETTINGS if args.short_lease else SHIPPED


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--short-lease", action="store_true",
                        help="a 1.5 s lease and 32 sequences a step (SETTINGS, as the test in "
                             "make test runs) instead of the shipped configuration; defaults to "
                             "300 + 300 requests, 5 s apart")
    parser.add_argument("--durable", type=int, help="default: 900 (300 with --short-lease)")
    parser.add_argument("--generate", type=int, help="default: 900 (300 with --short-lease)")
    parser.add_argument("--nodes", type=int, default=3)
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--victims", nargs="+", default=VICTIMS)
    parser.add_argument("--gap-s", type=float,
                        help="between kills (default: 12 s, more than two leases; 5 s with "
                             "--short-lease)")
    parser.add_argument("--pause-s", type=float, default=1.0, help="dead before its restart")
    parser.add_argument("--window-s", type=float,
                        help="the throughput windows (default: 2 s, seven or more of an "
                             "executor's steps of 128 sequences; 1 s with --short-lease)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--result-json", default="results/cluster_chaos.json")
    parser.add_argument("--log-dir", help="run the stack here and keep its logs (default: a "
                                          "temporary folder, removed)")
    args = parser.parse_args(argv)
    for name, shipped, short in (("durable", 900, 300), ("generate", 900, 300),
                                 ("gap_s", 12.0, 5.0), ("window_s", 2.0, 1.0)):
        if getattr(args, name) is None:
            setattr(args, name, short if args.short_lease else shipped)
    result = asyncio.run(run(args))
    print(report(result))
    write_result(args.result_json, "cluster_chaos", params=vars(args),
                 settings=settings_of(args), summary=result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
