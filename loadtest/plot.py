"""The picture of a `jetserve bench serve` run: latency CDFs per priority class, and output
throughput with the waiting-queue depth over time. Imported only when a picture is asked for
(matplotlib takes a while to import)."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402 (after choosing the backend)


def _cdf(axis, values: list[float], label: str) -> None:
    ordered = sorted(values)
    if ordered:
        axis.plot(ordered, [(i + 1) / len(ordered) for i in range(len(ordered))], label=label)


def style(axis, xlabel: str, ylabel: str, title: str | None = None) -> None:
    """Label an axis, grid it and give it a legend."""
    axis.set_xlabel(xlabel)
    axis.set_ylabel(ylabel)
    if title:
        axis.set_title(title)
    axis.grid(alpha=0.3)
    axis.legend()


def _ttft_ms(records: list[dict]) -> list[float]:
    return [1e3 * (r["delta_times"][0] - r["send_time"]) for r in records if r["delta_times"]]


def plot_runset(runs: list[dict], path: Path, title: str = "") -> None:
    """A run set: the TTFT CDF of each run, overall and per priority class, or per tenant when
    all requests share one class (one panel each)."""
    done = [[r for r in run["requests"] if r["end_time"] is not None and r["error"] is None]
            for run in runs]
    field, name = "priority", "priority"
    groups = sorted({r[field] for records in done for r in records}, reverse=True)
    if len(groups) < 2:
        field, name = "tenant", "tenant"
        groups = sorted({r[field] for records in done for r in records})
    panels = [None] + (groups if len(groups) > 1 else [])
    # With an adaptive batch size somewhere in the set, a panel of every run's batch limit (the
    # executors' summed) over time.
    limits = [[(t["t"], sum(e["limit"] for e in t["executors"].values()))
               for t in run["timeline"] if t.get("executors")] for run in runs]
    varying = any(len({v for _, v in series}) > 1 for series in limits)
    figure, axes = plt.subplots(1, len(panels) + varying,
                                figsize=(max(8, 5 * (len(panels) + varying)), 4.2), squeeze=False)
    if varying:
        axis = axes[0][-1]
        for run, series in zip(runs, limits):
            axis.step([t for t, _ in series], [v for _, v in series], where="post",
                      label=run.get("label") or "")
        style(axis, "time (s)", "concurrent-sequence limit", "batch limit (from heartbeats)")
    for axis, group in zip(axes[0], panels):
        for run, records in zip(runs, done):
            mine = [r for r in records if group is None or r[field] == group]
            sent = sum(1 for r in run["requests"] if group is None or r[field] == group)
            values = sorted(_ttft_ms(mine))
            # Normalised by requests sent: a curve that stops short of 1 lost requests.
            axis.plot(values, [(i + 1) / max(1, sent) for i in range(len(values))],
                      label=run.get("label") or "")
        axis.set_xscale("log")
        axis.set_ylim(0, 1.02)
        style(axis, "TTFT (ms, log scale)", "fraction of requests sent",
              "all requests" if group is None else f"{name} {group}")
    params = runs[0]["parameters"]
    rate = (f"rate phases {params['rate_phases']} (req/s:s)" if params.get("rate_phases")
            else f"rate {params['request_rate']}/s")
    figure.suptitle(f"{title or 'run set'} — model {params['model']}, {params['executors']} "
                    f"executor(s), {rate}")
    save(figure, path)


def save(figure, path: Path, dpi: int = 100) -> None:
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=dpi)
    plt.close(figure)


def plot_run(result: dict, path: Path) -> None:
    records = [r for r in result["requests"] if r["end_time"] is not None and r["error"] is None]
    classes = sorted({r["priority"] for r in records}, reverse=True)
    figure, axes = plt.subplots(2, 2, figsize=(12, 8))
    for axis, name in zip((axes[0][0], axes[0][1], axes[1][0]), ("ttft", "tpot", "e2e")):
        for priority in classes:
            mine = [r for r in records if r["priority"] == priority]
            if name == "ttft":
                values = _ttft_ms(mine)
            elif name == "e2e":
                values = [1e3 * (r["end_time"] - r["send_time"]) for r in mine]
            else:
                values = [1e3 * (r["end_time"] - r["delta_times"][0]) / (r["output_tokens"] - 1)
                          for r in mine if r["output_tokens"] > 1 and r["delta_times"]]
            _cdf(axis, values, f"priority {priority}")
        style(axis, f"{name.upper()} (ms)", "fraction of requests")
    timeline = result["timeline"]
    axis = axes[1][1]
    duration = result["summary"]["duration_s"] or 1.0
    width = max(duration / 60, 0.1)  # seconds per throughput bin
    bins = [0] * (int(duration / width) + 1)
    for r in records:
        for t, n in zip(r["delta_times"], r["delta_tokens"]):
            bins[min(int(t / width), len(bins) - 1)] += n
    axis.plot([(i + 0.5) * width for i in range(len(bins))], [n / width for n in bins],
              color="tab:blue")
    axis.set_ylabel("output tokens/s", color="tab:blue")
    if timeline:
        times = [t["t"] for t in timeline]
        depth_axis = axis.twinx()
        depth_axis.plot(times, [t["queue_depth"] or 0 for t in timeline], color="tab:red",
                        label="waiting at priority")
        depth_axis.plot(times, [t["outstanding"] for t in timeline], color="tab:orange",
                        linestyle="--", label="outstanding (client)")
        depth_axis.set_ylabel("requests")
        depth_axis.legend(loc="upper right")
    axis.set_xlabel("time (s)")
    axis.grid(alpha=0.3)
    label = result.get("label") or ""
    params = result["parameters"]
    figure.suptitle(f"jetserve bench serve {label} — {params['dataset']}, rate "
                    f"{params['request_rate']}/s, model {params['model']}")
    save(figure, path)
