"""The migration benchmark at a small point: every run reports, nothing is lost or duplicated."""

from __future__ import annotations

import json

import pytest

from loadtest import migration_bench

pytestmark = pytest.mark.slow


def test_three_runs_report_lost_duplicated_and_added_latency(tmp_path):
    out = tmp_path / "migration.json"
    assert migration_bench.main(["--num-requests", "12", "--output-len-range", "40", "60",
                                 "--kill-after-s", "1.5", "--pause-s", "0.5",
                                 "--result-json", str(out)]) == 0
    summary = json.loads(out.read_text())["summary"]
    assert list(summary) == ["from checkpoints", "from the start"]
    for run in summary.values():
        assert run["lost"] == 0 and run["duplicated"] == 0
        assert run["outputs_equal_to_the_undisturbed_run"] == 12
        assert run["handed_on"] >= 1 and run["added_latency_ms_p50"] is not None
    assert summary["from the start"]["resumed_from_a_checkpoint"] == 0
