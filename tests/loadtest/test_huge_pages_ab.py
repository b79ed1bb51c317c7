"""loadtest.huge_pages_ab on the tiny model: each setting's processes run and are summarized."""

import json

import pytest

from loadtest import huge_pages_ab
from services.executor.engine import huge_pages


@pytest.mark.skipif(not huge_pages.available(), reason="no huge pages to ask for here")
def test_each_setting_runs_in_its_own_processes_and_is_summarized(tmp_path):
    out = tmp_path / "ab.json"
    assert huge_pages_ab.main(["--pairs", "1", "--variants", "fp32", "--model", "dummy:tiny",
                               "--kv-cache", "--long-prompts", "100", "--requests", "3",
                               "--result-json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert set(result["summary"]) == {"fp32_on", "fp32_off", "fp32_on+kv"}
    for setting in ("on", "off", "on+kv"):
        [run] = result["runs"]["fp32"][setting]
        for metric in ("load_s", "ttft_ms", "tpot_ms", "long_ttft_ms", "long_tpot_ms",
                       "tok_s_3"):
            assert run[metric] > 0, (setting, metric)
            assert result["summary"][f"fp32_{setting}"][metric]["median"] == run[metric]
