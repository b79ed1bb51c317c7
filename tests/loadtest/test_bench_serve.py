"""`jetserve bench serve` against the embedded stack (dummy:tiny), as a user runs it."""

import json
import subprocess

from tests.integration.test_cli_smollm2 import jetserve_command


def bench(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([*jetserve_command(), "bench", "serve", *args], capture_output=True,
                          text=True, timeout=300)


def test_a_small_run_writes_every_figure_and_the_plot(tmp_path):
    result_json, plot = tmp_path / "run.json", tmp_path / "run.png"
    run = bench("--embedded", "--model", "dummy:tiny", "--set", "kv_cache.num_blocks=512",
                "--num-requests", "40", "--request-rate", "40", "--burstiness", "0.5",
                "--input-len-range", "8", "32", "--output-len-range", "4", "24",
                "--priority-mix", "9:0.3,1:0.7", "--tenant-mix", "a:0.5,b:0.5",
                "--deadline-ms", "9:5000", "--goodput", "ttft:5000", "e2e:20000",
                "--label", "small", "--result-json", str(result_json), "--plot", str(plot))
    assert run.returncode == 0, run.stderr[-3000:]
    assert "jetserve bench serve small" in run.stdout and "TTFT" in run.stdout
    result = json.loads(result_json.read_text())
    s = result["summary"]
    assert (s["requests"], s["completed"], s["failed"], s["outstanding"]) == (40, 40, 0, 0)
    assert s["errors"] == {} and s["outstanding_request_ids"] == []
    assert s["output_throughput"] > 0 and s["request_throughput"] > 0
    for metric in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
        assert set(s[metric]) == {"mean", "p50", "p90", "p99", "max", "count"}
        assert 0 < s[metric]["p50"] <= s[metric]["p99"]
    assert s["goodput_fraction"] == 1.0
    assert set(s["per_priority"]) == {"9", "1"} and set(s["per_tenant"]) == {"a", "b"}
    assert s["per_priority"]["9"]["deadline_met_fraction"] == 1.0
    assert 0.5 <= s["jain_fairness"] <= 1.0
    records = result["requests"]
    assert len(records) == 40 and all(r["output_tokens"] >= 4 for r in records)
    assert sum(r["output_tokens"] for r in records) == s["output_tokens"]
    assert result["parameters"]["request_rate"] == 40.0 and result["parameters"]["seed"] == 0
    assert result["timeline"] and "queue_depth" in result["timeline"][0]
    limits = {e["limit"] for t in result["timeline"] for e in t["executors"].values()}
    assert limits == {128}  # batch_size: fixed, at max_num_seqs
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    compare = bench("--compare", str(result_json), str(result_json))
    assert compare.returncode == 0
    line = next(line for line in compare.stdout.splitlines() if line.startswith("output tok/s"))
    assert line.split()[-1] == "1.000"


def test_bad_arguments_are_named():
    run = bench("--num-requests", "5", "--duration", "3")
    assert run.returncode != 0 and "--num-requests or --duration" in run.stderr
    run = bench("--rate-phases", "2:10", "--duration", "3")
    assert run.returncode != 0 and "leave out --request-rate, --duration" in run.stderr
    run = bench("--rate-phases", "2:10,fast:5")
    assert run.returncode != 0 and "rate phase 'fast:5'" in run.stderr


def test_adaptive_batch_size_grows_under_a_queue_and_holds_at_the_minimum_past_its_slo(tmp_path):
    """Two runs in one set (two --sweep flags): a TPOT SLO no step can meet keeps the limit at
    its minimum; a loose one lets it grow while requests queue. The timeline shows each
    executor's limit from its heartbeats."""
    result_json = tmp_path / "set.json"
    run = bench("--embedded", "--model", "dummy:tiny", "--set", "kv_cache.num_blocks=1024",
                "--set", "scheduler.batch_level.batch_size=adaptive",
                "--set", "scheduler.load_aware.min_batch_size=2",
                "--set", "scheduler.load_aware.initial_batch_size=2",
                "--set", "scheduler.load_aware.step_size=2",
                "--set", "scheduler.load_aware.interval_s=0.1",
                # (enough that the queue outlasts a few limit steps on a busy machine too)
                "--num-requests", "120", "--input-len-range", "8", "16",
                "--output-len-range", "24", "48", "--no-progress",
                "--sweep", "scheduler.load_aware.tpot_slo_ms=0.001",
                "--sweep", "scheduler.load_aware.tpot_slo_ms=100000",
                "--result-json", str(result_json))
    assert run.returncode == 0, run.stderr[-3000:]
    runs = json.loads(result_json.read_text())["runs"]
    assert [r["label"] for r in runs] == ["tpot_slo_ms=0.001", "tpot_slo_ms=100000"]
    for r in runs:
        assert r["summary"]["completed"] == 120
    strict, loose = ({e["limit"] for t in r["timeline"] for e in t["executors"].values()}
                     for r in runs)
    assert strict == {2}
    assert max(loose) >= 8


def test_the_openai_backend_measures_the_same_workload_through_the_gateway(tmp_path):
    """`--backend openai` (here against the embedded stack's gateway): the same requests, each
    with its exact output length, counted from the HTTP stream's usage; the same figures."""
    for endpoint in ("completions", "chat"):
        result_json = tmp_path / f"{endpoint}.json"
        run = bench("--embedded", "--model", "dummy:tiny", "--set", "kv_cache.num_blocks=512",
                    "--backend", "openai", "--endpoint", endpoint, "--num-requests", "20",
                    "--request-rate", "40", "--input-len-range", "8", "32",
                    "--output-len-range", "4", "24", "--priority-mix", "9:0.5,5:0.5",
                    "--result-json", str(result_json))
        assert run.returncode == 0, run.stderr[-3000:]
        result = json.loads(result_json.read_text())
        s = result["summary"]
        assert (s["requests"], s["completed"], s["failed"], s["outstanding"]) == (20, 20, 0, 0)
        assert result["parameters"]["backend"] == "openai"
        for metric in ("ttft_ms", "tpot_ms", "e2e_ms"):
            assert 0 < s[metric]["p50"] <= s[metric]["p99"]
        records = result["requests"]
        # Random token prompts (decoded to text for chat) run to their exact output lengths.
        assert all(r["finish_reason"] == "length" and 4 <= r["output_tokens"] <= 24
                   and r["prompt_tokens"] > 0 for r in records)
    missing = bench("--backend", "openai", "--num-requests", "1")
    assert missing.returncode != 0 and "--base-url" in missing.stderr
