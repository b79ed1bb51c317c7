"""The picture of a `jetserve bench serve` run: latency CDFs per priority class, and output
throughput with the waiting-queue depth over time."""

from __future__ import annotations

from pathlib import Path


def _cdf(axis, values: list[float], label: str) -> None:
    ordered = sorted(values)
    if ordered:
        axis.plot(ordered, [(i + 1) / len(ordered) for i in range(len(ordered))], label=label)


def plot_run(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = [r for r in result["requests"] if r["end_time"] is not None and r["error"] is None]
    classes = sorted({r["priority"] for r in records}, reverse=True)
    figure, axes = plt.subplots(2, 2, figsize=(12, 8))
    for axis, name in zip((axes[0][0], axes[0][1], axes[1][0]), ("ttft", "tpot", "e2e")):
        for priority in classes:
            mine = [r for r in records if r["priority"] == priority]
            if name == "ttft":
                values = [1e3 * (r["delta_times"][0] - r["send_time"]) for r in mine
                          if r["delta_times"]]
            elif name == "e2e":
                values = [1e3 * (r["end_time"] - r["send_time"]) for r in mine]
            else:
                values = [1e3 * (r["end_time"] - r["delta_times"][0]) / (r["output_tokens"] - 1)
                          for r in mine if r["output_tokens"] > 1 and r["delta_times"]]
            _cdf(axis, values, f"priority {priority}")
        axis.set_xlabel(f"{name.upper()} (ms)")
        axis.set_ylabel("fraction of requests")
        axis.grid(alpha=0.3)
        axis.legend()
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
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=100)
    plt.close(figure)
