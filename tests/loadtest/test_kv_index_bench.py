"""The KV index benchmark runs and writes its figures."""

import json

from loadtest import kv_index_bench


def test_a_small_run_writes_each_row(tmp_path):
    out = tmp_path / "kv.json"
    assert kv_index_bench.main(["--executors", "2", "--promised", "10", "100", "--picks", "5",
                                "--result-json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [(r["executors"], r["promised"]) for r in rows] == [(2, 10), (2, 100)]
    assert all(r["pick_ms"] > 0 for r in rows)
