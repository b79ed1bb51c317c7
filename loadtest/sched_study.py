"""`python -m loadtest.sched_study`: the scheduler's promises measured as a user would meet them,
on workload shapes nobody tuned for, with the configuration jetserve ships.

    python -m loadtest.sched_study --out results/sched_study
    python -m loadtest.sched_study --shapes chat --experiments capacity,priority --duration 30 \\
        --out results/sched_quick

For each shape (prompt and output lengths drawn uniformly from its ranges), every run a
`jetserve bench serve` against a fresh embedded stack of `--executors` executors:

1. **capacity**: a burst (every request at t=0): the requests per second the cluster completes.
2. **calm**: a quarter of that rate with the priority mix; its E2E p99 sets each class's
   deadline (`DEADLINE_FACTORS` times it): derived, not hand-picked.
3. **priority**: 1.5x and 3x capacity, classes 9 / 5 / 1 at 20 / 50 / 30 %, classes 9 and 5 with
   those deadlines, under `fcfs` and `adaptive` (the same requests at the same times).
4. **fairness**: a light tenant at a quarter of capacity alone, then beside a heavy tenant
   sending 4x and 20x its rate, under `fcfs` and `adaptive`.
5. **vtc**: two backlogged tenants (2x and 1x capacity): the gap between the service each got
   (prompt + 2 x output tokens, the counters' weights) over the run, against VTC's bound.
6. **prefix** (shape `prefix`, kv_aware routing): the light tenant's fairness and the prefix-cache
   hit rate, with and without a heavy tenant.

Nothing is set but the policy under test and the workload, unless `--set` is given (a tuned run
set, to stand beside the shipped one). Every run set is written as JSON under `--out`, with a
TTFT plot; `summary.json` and the printed table hold the figures.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path

from loadtest.metrics import percentile
from loadtest.report import print_runset

SHAPES = {
    "chat": {"input": (64, 512), "output": (32, 256), "burst": 2000},
    "long": {"input": (1024, 4096), "output": (16, 64), "burst": 600},
    "mixed": {"input": (128, 1024), "output": (25, 250), "burst": 1500},  # a 10x output spread
    # 8 system prompts of 512 tokens, each request one of them plus 32-128 tokens of its own
    "prefix": {"input": (32, 128), "output": (32, 256), "burst": 2000, "dataset": "shared-prefix",
               "prefix_len": 512},
    # for the real SmolLM2 engine on a CPU: a few requests a second
    "small": {"input": (32, 256), "output": (16, 128), "burst": 120},
}
PRIORITY_MIX = "9:0.2,5:0.5,1:0.3"
DEADLINE_FACTORS = {9: 2.0, 5: 5.0}  # x the calm run's E2E p99
OVERLOADS = (1.5, 3.0)
HEAVY_RATIOS = (4, 20)
LIGHT_SHARE = 0.25  # of capacity
POLICIES = ("fcfs", "adaptive")
W_PROMPT, W_OUTPUT = 1, 2  # the tenants' counters' weights (services/priority/fairness.py)


def bench_args(options, shape: str, *extra: str):
    from loadtest.serve import add_arguments

    spec = SHAPES[shape]
    argv = ["--embedded", "--model", options.model, "--executors", str(options.executors),
            "--input-len-range", *map(str, spec["input"]),
            "--output-len-range", *map(str, spec["output"]), "--no-progress",
            "--seed", str(options.seed), *extra]
    if "dataset" in spec:
        argv += ["--dataset", spec["dataset"], "--prefix-groups", "8", "--prefix-len",
                 str(spec["prefix_len"])]
    for item in options.set:
        argv += ["--set", item]
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(argv)


def run_set(options, shape: str, name: str, extra: list[str], sweep: list[tuple[str, str]],
            labels: list[str] | None = None) -> list[dict]:
    """One run per (key, value) of `sweep` (or one run), the same requests each time; written to
    <out>/<shape>/<name>.json with a TTFT plot."""
    from loadtest.plot import plot_runset
    from loadtest.serve import run_with_target

    runs = []
    for i, setting in enumerate(sweep or [None]):
        args = bench_args(options, shape, *extra)
        if setting is not None:
            args.set = [*args.set, f"{setting[0]}={setting[1]}"]
        args.label = labels[i] if labels else (setting[1] if setting else name)
        result = asyncio.run(run_with_target(args))
        result["label"] = args.label
        runs.append(result)
        print(f"  {shape}/{name} {args.label}: done", file=sys.stderr, flush=True)
    path = options.out / shape / f"{name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"shape": shape, "experiment": name, "settings": options.set,
                                "runs": runs}))
    if len(runs) > 1 or runs[0]["summary"]["requests"] > 0:
        plot_runset(runs, path.with_suffix(".png"), f"{shape}: {name}")
    if len(runs) > 1:
        print_runset(runs)
    return runs


def policies() -> list[tuple[str, str]]:
    return [("scheduler.request_level.policy", p) for p in POLICIES]


def capacity(options, shape: str) -> dict:
    runs = run_set(options, shape, "capacity",
                   ["--request-rate", "inf", "--num-requests", str(SHAPES[shape]["burst"])], [])
    s = runs[0]["summary"]
    return {"request_per_s": s["request_throughput"], "output_tok_per_s": s["output_throughput"],
            "failed": s["failed"], "requests": s["requests"]}


def calm(options, shape: str, cap: float) -> dict:
    runs = run_set(options, shape, "calm",
                   ["--request-rate", f"{LIGHT_SHARE * cap:.2f}", "--duration",
                    str(options.duration), "--priority-mix", PRIORITY_MIX], [])
    e2e_p99 = runs[0]["summary"]["e2e_ms"]["p99"]
    if e2e_p99 is None:
        raise SystemExit(f"{shape}: the calm run completed nothing; no deadlines to derive")
    return {"rate": LIGHT_SHARE * cap, "e2e_p99_ms": e2e_p99,
            "deadlines_ms": {p: round(f * e2e_p99) for p, f in DEADLINE_FACTORS.items()}}


def sustained(run: dict, start: float, end: float) -> dict:
    """What the cluster delivered while the arrivals lasted (after `start` s of warm-up): output
    tokens a second, and requests completed a second (a run's overall request rate also counts
    its drain, which differs between policies that shed and policies that serve)."""
    tokens = sum(n for r in run["requests"] for t, n in zip(r["delta_times"], r["delta_tokens"])
                 if start <= t < end)
    done = sum(1 for r in run["requests"] if r["end_time"] is not None and r["error"] is None
               and start <= r["end_time"] < end)
    return {"output_tok_per_s": tokens / (end - start), "request_per_s": done / (end - start)}


def class_figures(run: dict, duration: float) -> dict:
    summary = run["summary"]
    out = {"request_per_s": summary["request_throughput"], "goodput": summary.get("goodput"),
           "sustained": sustained(run, min(5.0, duration / 4), duration),
           "global_queue_ms": _dist(summary["queue_wait_ms"]),
           "executor_queue_ms": _dist(summary.get("executor_queue_ms")),
           "preemptions": summary.get("preemptions"),
           "recomputed_tokens": summary.get("recomputed_tokens"),
           "errors": summary["errors"], "classes": {}}
    for p, g in summary["per_priority"].items():
        out["classes"][p] = {"deadline_met": g.get("deadline_met_fraction"),
                             "completed": g["completed"], "sent": g["requests"],
                             "ttft_p50_ms": g["ttft_ms"]["p50"], "ttft_p99_ms": g["ttft_ms"]["p99"],
                             "queue_wait_max_ms": g["queue_wait_ms"]["max"]}
    return out


def _dist(d: dict | None) -> dict | None:
    return None if not d else {k: d.get(k) for k in ("p50", "p99", "max")}


def priority(options, shape: str, cap: float, deadlines: dict[int, int]) -> dict:
    figures = {}
    deadline_arg = ",".join(f"{p}:{ms}" for p, ms in deadlines.items())
    for factor in OVERLOADS:
        runs = run_set(options, shape, f"priority-{factor:g}x",
                       ["--request-rate", f"{factor * cap:.2f}", "--duration",
                        str(options.duration), "--priority-mix", PRIORITY_MIX,
                        "--deadline-ms", deadline_arg, "--goodput", "deadline"], policies())
        figures[f"{factor:g}x"] = {r["label"]: class_figures(r, options.duration) for r in runs}
    return figures


def tenant_figures(summary: dict, tenant: str) -> dict:
    g = summary["per_tenant"].get(tenant)
    if g is None:
        return {}
    return {"ttft_p50_ms": g["ttft_ms"]["p50"], "ttft_p99_ms": g["ttft_ms"]["p99"],
            "completed": g["completed"], "sent": g["requests"], "failed": g["failed"],
            "global_queue_p50_ms": g["queue_wait_ms"]["p50"],
            "server_ttft_p50_ms": (g.get("server_ttft_ms") or {}).get("p50"),
            "server_ttft_p99_ms": (g.get("server_ttft_ms") or {}).get("p99"),
            "executor_queue_p50_ms": (g.get("executor_queue_ms") or {}).get("p50")}


def fairness(options, shape: str, cap: float) -> dict:
    light_rate = LIGHT_SHARE * cap
    solo = run_set(options, shape, "fairness-solo",
                   ["--request-rate", f"{light_rate:.2f}", "--duration", str(options.duration),
                    "--tenant-mix", "light:1"], [])[0]["summary"]
    alone = tenant_figures(solo, "light")
    figures: dict = {"light_alone": alone}
    for ratio in HEAVY_RATIOS:
        runs = run_set(options, shape, f"fairness-{ratio}x",
                       ["--request-rate", f"{light_rate * (1 + ratio):.2f}", "--duration",
                        str(options.duration), "--tenant-mix",
                        f"light:{1 / (1 + ratio):.4f},heavy:{ratio / (1 + ratio):.4f}"],
                       policies())
        figures[f"{ratio}x"] = {}
        for r in runs:
            light = tenant_figures(r["summary"], "light")
            light["p50_vs_alone"] = _ratio(light.get("ttft_p50_ms"), alone.get("ttft_p50_ms"))
            light["p99_vs_alone"] = _ratio(light.get("ttft_p99_ms"), alone.get("ttft_p99_ms"))
            figures[f"{ratio}x"][r["label"]] = {
                "light": light, "heavy": tenant_figures(r["summary"], "heavy"),
                "request_per_s": r["summary"]["request_throughput"],
                "sustained": sustained(r, min(5.0, options.duration / 4), options.duration),
                "errors": r["summary"]["errors"]}
    return figures


def _ratio(a, b):
    return None if a is None or not b else a / b


def service_curves(run: dict, tenants: list[str]) -> tuple[list[float], dict[str, list[float]]]:
    """Each tenant's cumulative service (W_PROMPT x prompt tokens at its first token + W_OUTPUT x
    each delta's tokens) on the client's clock, sampled every 0.5 s."""
    events: dict[str, list[tuple[float, float]]] = {t: [] for t in tenants}
    for r in run["requests"]:
        if r["tenant"] not in events or not r["delta_times"]:
            continue
        mine = events[r["tenant"]]
        mine.append((r["delta_times"][0], W_PROMPT * r["prompt_tokens"]))
        mine += [(t, W_OUTPUT * n) for t, n in zip(r["delta_times"], r["delta_tokens"])]
    end = max((t for e in events.values() for t, _ in e), default=0.0)
    times = [0.5 * i for i in range(int(end / 0.5) + 2)]
    curves = {}
    for tenant, mine in events.items():
        mine.sort()
        total, i, curve = 0.0, 0, []
        for t in times:
            while i < len(mine) and mine[i][0] <= t:
                total += mine[i][1]
                i += 1
            curve.append(total)
        curves[tenant] = curve
    return times, curves


def vtc(options, shape: str, cap: float) -> dict:
    """Two tenants both backlogged for the whole sending window: the service gap, and VTC's bound
    2 x max(w_p x L_input, w_q x M), M the running batch's token capacity over the cluster
    (max_num_seqs x the longest request at every executor: the KV pool holds more)."""
    runs = run_set(options, shape, "vtc",
                   ["--request-rate", f"{3 * cap:.2f}", "--duration", str(options.duration),
                    "--tenant-mix", "a:0.6667,b:0.3333"], [("scheduler.request_level.policy",
                                                            "adaptive")])
    spec = SHAPES[shape]
    longest = spec["input"][1] + spec.get("prefix_len", 0) + spec["output"][1]
    batch_tokens = options.executors * 128 * longest
    bound = 2 * max(W_PROMPT * spec["input"][1], W_OUTPUT * batch_tokens)
    times, curves = service_curves(runs[0], ["a", "b"])
    window = [i for i, t in enumerate(times) if 2.0 <= t <= options.duration]
    gaps = [abs(curves["a"][i] - curves["b"][i]) for i in window]
    figures = {"max_gap_tokens": max(gaps, default=None), "bound_tokens": bound,
               "gap_p50_tokens": percentile(gaps, 50), "served_a": curves["a"][-1],
               "served_b": curves["b"][-1], "batch_tokens_M": batch_tokens}
    _plot_gap(options.out / shape / "vtc-gap.png", times, curves, bound, options.duration)
    return figures


def _plot_gap(path: Path, times, curves, bound: float, duration: float) -> None:
    from loadtest.plot import plt, save, style

    figure, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    for tenant, curve in curves.items():
        left.plot(times, curve, label=f"tenant {tenant}")
    left.axvline(duration, color="grey", linestyle=":", label="sending stops")
    style(left, "time (s)", "service (prompt + 2 x output tokens)")
    gap = [a - b for a, b in zip(curves["a"], curves["b"])]
    right.plot(times, gap, label="a - b")
    right.axhline(bound, color="red", linestyle="--", label="VTC bound")
    right.axhline(-bound, color="red", linestyle="--")
    right.axvline(duration, color="grey", linestyle=":")
    right.set_yscale("symlog", linthresh=max(1.0, bound / 1000))
    style(right, "time (s)", "service gap (tokens)")
    save(figure, path, dpi=110)


def prefix(options, cap: float) -> dict:
    """kv_aware routing (the default) on a shared-prefix workload: the light tenant alone, then
    beside a heavy one at 4x its rate; hit rates side by side."""
    shape = "prefix"
    light_rate = LIGHT_SHARE * cap
    solo = run_set(options, shape, "prefix-solo",
                   ["--request-rate", f"{light_rate:.2f}", "--duration", str(options.duration),
                    "--tenant-mix", "light:1"], [])[0]["summary"]
    both = run_set(options, shape, "prefix-4x",
                   ["--request-rate", f"{5 * light_rate:.2f}", "--duration",
                    str(options.duration), "--tenant-mix", "light:0.2,heavy:0.8"],
                   [])[0]["summary"]
    alone = tenant_figures(solo, "light")
    light = tenant_figures(both, "light")
    return {"light_alone": alone, "with_heavy": light,
            "p50_vs_alone": _ratio(light.get("ttft_p50_ms"), alone.get("ttft_p50_ms")),
            "p99_vs_alone": _ratio(light.get("ttft_p99_ms"), alone.get("ttft_p99_ms")),
            "hit_rate_alone": solo["prefix_cache_hit_rate"],
            "hit_rate_with_heavy": both["prefix_cache_hit_rate"],
            "light_hit_rate_with_heavy": both["per_tenant"]["light"]["prefix_cache_hit_rate"]}


def print_summary(summary: dict) -> None:
    print("=" * 100)
    for shape, s in summary["shapes"].items():
        cap = s.get("capacity", {})
        print(f"[{shape}] capacity {cap.get('request_per_s', 0):.1f} req/s"
              + (f"; calm E2E p99 {s['calm']['e2e_p99_ms']:.0f} ms -> deadlines "
                 f"{s['calm']['deadlines_ms']}" if "calm" in s else ""))
        for load, by_policy in s.get("priority", {}).items():
            for policy, f in by_policy.items():
                c = f["classes"]
                met = {p: c[p]["deadline_met"] for p in ("9", "5") if p in c}
                p1 = c.get("1", {})
                print(f"  priority {load:>4} {policy:<9} p9 met {_pct(met.get('9'))} p5 met "
                      f"{_pct(met.get('5'))} p1 done {p1.get('completed')}/{p1.get('sent')}  "
                      f"sustained {f['sustained']['output_tok_per_s']:,.0f} tok/s "
                      f"{f['sustained']['request_per_s']:.1f} req/s, goodput "
                      f"{f['goodput'] or 0:.1f}  queue global p50/p99 "
                      f"{_ms(f['global_queue_ms'])} executor {_ms(f['executor_queue_ms'])}  "
                      f"recomputed {f['recomputed_tokens']}  errors {f['errors']}")
        fair = s.get("fairness")
        if fair:
            alone = fair["light_alone"]
            print(f"  fairness light alone TTFT p50/p99 {alone.get('ttft_p50_ms', 0):.0f}/"
                  f"{alone.get('ttft_p99_ms', 0):.0f} ms")
            for ratio, by_policy in fair.items():
                if ratio == "light_alone":
                    continue
                for policy, f in by_policy.items():
                    light = f["light"]
                    print(f"  fairness {ratio:>4} {policy:<9} light TTFT p50 "
                          f"{light.get('ttft_p50_ms') or 0:.0f} ms ({light['p50_vs_alone'] or 0:.2f}x)"
                          f" p99 {light.get('ttft_p99_ms') or 0:.0f} ms "
                          f"({light['p99_vs_alone'] or 0:.2f}x), failed {light.get('failed')}; "
                          f"{f['request_per_s']:.1f} req/s")
        if "vtc" in s:
            v = s["vtc"]
            print(f"  vtc max gap {v['max_gap_tokens'] or 0:,.0f} tokens "
                  f"(bound {v['bound_tokens']:,})")
        if "prefix" in s:
            p = s["prefix"]
            print(f"  prefix light p50 {p['p50_vs_alone'] or 0:.2f}x p99 {p['p99_vs_alone'] or 0:.2f}x"
                  f" hit rate {p['hit_rate_with_heavy']:.3f} vs alone {p['hit_rate_alone']:.3f}")
    print("=" * 100)


def _pct(value) -> str:
    return "   -" if value is None else f"{100 * value:3.0f}%"


def _ms(d: dict | None) -> str:
    if not d or d.get("p50") is None:
        return "-"
    return f"{d['p50']:.0f}/{d['p99']:.0f}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m loadtest.sched_study", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default="chat,long,mixed")
    parser.add_argument("--experiments", default="capacity,priority,fairness,vtc")
    parser.add_argument("--duration", type=float, default=60.0, help="seconds of arrivals a run")
    parser.add_argument("--executors", type=int, default=4)
    parser.add_argument("--model", default="sim:llama3-8b-h100")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="a setting for every run (a tuned run set; the default is none)")
    parser.add_argument("--capacity", action="append", default=[], metavar="SHAPE=REQ_PER_S",
                        help="skip the burst for that shape and use this capacity")
    parser.add_argument("--out", type=Path, default=Path("results/sched_study"))
    options = parser.parse_args(argv)
    experiments = set(options.experiments.split(","))
    given = {k: float(v) for k, v in (c.split("=") for c in options.capacity)}
    summary_path = options.out / "summary.json"
    summary = json.loads(summary_path.read_text()) if summary_path.exists() else {"shapes": {}}
    summary.update(model=options.model, executors=options.executors, settings=options.set,
                   duration_s=options.duration)
    for shape in options.shapes.split(","):
        if shape not in SHAPES:
            raise SystemExit(f"unknown shape {shape!r}; known: {', '.join(SHAPES)}")
        s = summary["shapes"].setdefault(shape, {})
        s["workload"] = {k: v for k, v in SHAPES[shape].items() if k != "burst"}
        if shape in given:
            s["capacity"] = {"request_per_s": given[shape], "given": True}
        elif "capacity" in experiments or "capacity" not in s:
            s["capacity"] = capacity(options, shape)
        cap = s["capacity"]["request_per_s"]
        if "priority" in experiments:
            s["calm"] = calm(options, shape, cap)
            s["priority"] = priority(options, shape, cap,
                                     {int(k): v for k, v in s["calm"]["deadlines_ms"].items()})
        if "fairness" in experiments:
            s["fairness"] = fairness(options, shape, cap)
        if "vtc" in experiments:
            s["vtc"] = vtc(options, shape, cap)
        if shape == "prefix" and "prefix" in experiments:
            s["prefix"] = prefix(options, cap)
        options.out.mkdir(parents=True, exist_ok=True)
        summary_path.write_text(json.dumps(summary, indent=1))
    print_summary(summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())
