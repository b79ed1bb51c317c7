"""The attention microbenchmark at small points: every decode and prefill point gets figures."""

from __future__ import annotations

import json

import pytest

from jetserve_kernels import cpu_ops
from loadtest import attention_bench


@pytest.mark.skipif(cpu_ops.load() is None or not cpu_ops.load().prefill_attention_kernel(),
                    reason="the CPU attention kernels need a build with AVX-512 or AVX2")
def test_every_point_is_timed(tmp_path):
    out = tmp_path / "attention.json"
    # SmolLM2 shapes (head_dim 64, which the prefill kernel needs), small points.
    assert attention_bench.main(["--shape", "smollm2-135m", "--decode", "2:40", "--prefill", "24:0",
                                 "17:30", "--repeats", "1", "--result-json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert [(r["seqs"], r["context"]) for r in result["decode"]] == [(2, 40)]
    assert [(r["tokens"], r["cached"]) for r in result["prefill"]] == [(24, 0), (17, 30)]
    for row in result["decode"] + result["prefill"]:
        assert row["kernel_ms"] > 0 and row["sdpa_ms"] > 0, row
    assert all(row["invariant_ms"] > 0 for row in result["decode"] + result["prefill"])
    assert all(row["as_decode_rows_ms"] > 0 for row in result["prefill"])


@pytest.mark.skipif(cpu_ops.load() is None or not cpu_ops.load().prefill_attention_kernel(),
                    reason="the CPU attention kernels need a build with AVX-512 or AVX2")
def test_decodes_in_cache_read_one_sequences_blocks(tmp_path):
    out = tmp_path / "attention.json"
    assert attention_bench.main(["--shape", "smollm2-135m", "--decode", "3:40", "--prefill",
                                 "--in-cache", "--repeats", "1", "--result-json", str(out)]) == 0
    [row] = json.loads(out.read_text())["decode"]
    assert row["in_cache"] and (row["seqs"], row["context"]) == (3, 40)
    # As if each of the 3 sequences read its own 40 tokens: 2 caches x 30 layers x 3 KV heads
    # x 64 fp32 values a token.
    read = 3 * 40 * 2 * 30 * 3 * 64 * 4
    assert row["kernel_gb_per_s"] == pytest.approx(read / row["kernel_ms"] / 1e6)
    assert row["invariant_gb_per_s"] == pytest.approx(read / row["invariant_ms"] / 1e6)
