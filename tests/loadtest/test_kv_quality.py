"""The compressed-KV benchmark on the tiny model: every configuration gets its capacity,
agreement and throughput figures, and the pools are sized as configured."""

from __future__ import annotations

import json

from loadtest import kv_quality


def test_every_configuration_is_measured(tmp_path):
    out = tmp_path / "kv.json"
    # A budget of ~2.5 sequences of 1,024 tokens in fp32 on dummy:tiny (512 bytes a token; 5 in
    # bf16, the default where the CPU has native bf16).
    assert kv_quality.main(["--model", "dummy:tiny", "--budget-gib", "0.0012", "--max-tokens", "4",
                            "--batch-requests", "8", "--batch-prompt", "32",
                            "--batch-max-tokens", "200", "--batch-budget-gib", "0.01",
                            "--result-json", str(out)]) == 0
    results = json.loads(out.read_text())["results"]
    assert list(results) == ["auto", "int8", "mixed"]
    auto, int8, mixed = results["auto"], results["int8"], results["mixed"]
    assert len(auto["kv_blocks_per_pool"]) == len(int8["kv_blocks_per_pool"]) == 1
    fp32_blocks, int8_blocks = mixed["kv_blocks_per_pool"]
    assert fp32_blocks == auto["kv_blocks_per_pool"][0] // 2
    assert int8_blocks == int8["kv_blocks_per_pool"][0] // 2
    assert (auto["sequences_of_1024_that_fit"] < mixed["sequences_of_1024_that_fit"]
            < int8["sequences_of_1024_that_fit"])
    assert auto["agreement_with_fp32_kv"]["identical"] == 32
    for r in results.values():
        assert r["most_running_at_once"] >= 1 and r["greedy_output_tok_s"] > 0
        assert r["batch_output_tok_s"] > 0 and r["batch_most_running"] >= 1
    assert mixed["agreement_by_priority"]["9"]["prompts"] == 16
