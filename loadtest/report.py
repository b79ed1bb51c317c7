"""The summary table of a `jetserve bench serve` run, and two runs side by side."""

from __future__ import annotations


def _fmt(value, digits: int = 1) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:,.{digits}f}"
    return f"{value:,}"


def print_summary(result: dict) -> None:
    s, p = result["summary"], result["parameters"]
    title = f" jetserve bench serve {result.get('label') or ''}".rstrip() + " "
    print(f"{title:=^72}")
    print(f"dataset {p['dataset']}, rate {p['request_rate']}/s, burstiness {p['burstiness']}, "
          f"max concurrency {p['max_concurrency'] or '-'}, seed {p['seed']}")
    rows = [("requests completed / sent", f"{s['completed']} / {s['requests']}"),
            ("failed", s["failed"]), ("outstanding at the end", s["outstanding"]),
            ("duration (s)", _fmt(s["duration_s"], 2)),
            ("request throughput (req/s)", _fmt(s["request_throughput"], 2)),
            ("output token throughput (tok/s)", _fmt(s["output_throughput"])),
            ("total token throughput (tok/s)", _fmt(s["total_token_throughput"])),
            ("prefix-cache hit rate (cached / prompt)", _fmt(s["prefix_cache_hit_rate"], 3))]
    if "goodput" in s:
        rows.append(("goodput (req/s)", f"{_fmt(s['goodput'], 2)}  "
                                        f"({_fmt(100 * s['goodput_fraction'])} % of requests)"))
    if len(s["per_tenant"]) > 1:
        rows.append(("Jain fairness, tenants' served tokens", _fmt(s["jain_fairness"], 3)))
    rows.append(("preemptions / tokens recomputed",
                 f"{s.get('preemptions', 0):,} / {s.get('recomputed_tokens', 0):,}"))
    for label, value in rows:
        print(f"{label:<40}{value!s:>32}")
    print(f"{'latency (ms)':<16}{'mean':>12}{'p50':>12}{'p90':>12}{'p99':>12}{'n':>8}")
    for name, title in (("ttft", "TTFT"), ("tpot", "TPOT"), ("itl", "ITL"), ("e2e", "E2E"),
                        ("queue_wait", "queue: global"), ("executor_queue", "queue: executor")):
        d = s.get(f"{name}_ms")
        if not d or not d["count"]:
            continue
        print(f"{title:<16}" + "".join(f"{_fmt(d[k]):>12}" for k in ("mean", "p50", "p90",
                                                                      "p99"))
              + f"{d['count']:>8}")
    for group, title in (("per_priority", "priority"), ("per_tenant", "tenant")):
        if len(s[group]) < 2:
            continue
        print(f"{title:<10}{'done':>8}{'tok/s':>10}{'TTFT p50':>10}{'TTFT p99':>10}"
              f"{'TPOT p50':>10}{'TPOT p99':>10}{'E2E p50':>10}{'deadline':>9}")
        for key, g in s[group].items():
            deadline = g.get("deadline_met_fraction")
            print(f"{key:<10}{g['completed']:>8}{_fmt(g['output_throughput']):>10}"
                  f"{_fmt(g['ttft_ms']['p50']):>10}{_fmt(g['ttft_ms']['p99']):>10}"
                  f"{_fmt(g['tpot_ms']['p50']):>10}{_fmt(g['tpot_ms']['p99']):>10}"
                  f"{_fmt(g['e2e_ms']['p50']):>10}"
                  f"{'-' if deadline is None else f'{100 * deadline:.0f} %':>9}")
    if s["errors"]:
        print("errors: " + ", ".join(f"{code} {n}" for code, n in sorted(s["errors"].items())))
    if s["outstanding_request_ids"]:
        ids = s["outstanding_request_ids"]
        print(f"outstanding: {', '.join(ids[:10])}{' ...' if len(ids) > 10 else ''}")
    print("=" * 72)


COMPARED = [("output tok/s", ("output_throughput",)), ("request/s", ("request_throughput",)),
            ("goodput req/s", ("goodput",)), ("goodput fraction", ("goodput_fraction",)),
            ("TTFT p50 ms", ("ttft_ms", "p50")),
            ("TTFT p99 ms", ("ttft_ms", "p99")), ("TPOT p50 ms", ("tpot_ms", "p50")),
            ("TPOT p99 ms", ("tpot_ms", "p99")), ("ITL p99 ms", ("itl_ms", "p99")),
            ("E2E p50 ms", ("e2e_ms", "p50")), ("E2E p99 ms", ("e2e_ms", "p99")),
            ("prefix-cache hit rate", ("prefix_cache_hit_rate",)),
            ("failed", ("failed",)), ("outstanding", ("outstanding",)),
            ("Jain fairness", ("jain_fairness",))]


def print_runset(runs: list[dict]) -> None:
    """Every run of a sweep side by side: overall figures, then each priority class and tenant."""
    labels = [r.get("label") or str(i) for i, r in enumerate(runs)]
    width = max(14, *(len(label) + 2 for label in labels))
    print(f"{'run set':<24}" + "".join(f"{label:>{width}}" for label in labels))
    for label, path in COMPARED + [("queue wait max ms", ("queue_wait_ms", "max")),
                                   ("global queue p50 ms", ("queue_wait_ms", "p50")),
                                   ("global queue p99 ms", ("queue_wait_ms", "p99")),
                                   ("executor queue p50 ms", ("executor_queue_ms", "p50")),
                                   ("executor queue p99 ms", ("executor_queue_ms", "p99")),
                                   ("preemptions", ("preemptions",)),
                                   ("recomputed tokens", ("recomputed_tokens",))]:
        print(f"{label:<24}" + "".join(f"{_fmt(_get(r['summary'], path), 2):>{width}}"
                                       for r in runs))
    for group in ("per_priority", "per_tenant"):
        keys = sorted({k for r in runs for k in r["summary"][group]},
                      key=lambda k: (-int(k), k) if k.isdigit() else (0, k))
        if len(keys) < 2:
            continue
        for key in keys:
            for label, path in (("TTFT p50 ms", ("ttft_ms", "p50")),
                                ("TTFT p99 ms", ("ttft_ms", "p99")),
                                ("deadline met", ("deadline_met_fraction",)),
                                ("goodput fraction", ("goodput_fraction",)),
                                ("completed", ("completed",)),
                                ("queue wait max ms", ("queue_wait_ms", "max"))):
                values = [_get(r["summary"][group].get(key, {}), path) for r in runs]
                if all(v is None for v in values):
                    continue
                name = f"{group.split('_')[1]} {key} {label}"
                print(f"{name:<24}" + "".join(f"{_fmt(v, 2):>{width}}" for v in values))
    print("=" * (24 + width * len(runs)))


def _get(summary: dict, path: tuple[str, ...]):
    value = summary
    for key in path:
        value = value.get(key) if isinstance(value, dict) else None
    return value


def print_comparison(a: dict, b: dict) -> None:
    name_a = a.get("label") or "A"
    name_b = b.get("label") or "B"
    print(f"{'':<16}{name_a:>16}{name_b:>16}{'B / A':>10}")
    for label, path in COMPARED:
        va, vb = _get(a["summary"], path), _get(b["summary"], path)
        ratio = f"{vb / va:.3f}" if isinstance(va, int | float) and isinstance(
            vb, int | float) and va else "-"
        print(f"{label:<16}{_fmt(va, 2):>16}{_fmt(vb, 2):>16}{ratio:>10}")
