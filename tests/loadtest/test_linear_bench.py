"""The matmul microbenchmark on the tiny shape: every format and row count gets a figure."""

from __future__ import annotations

import json

import pytest

from jetserve_kernels import cpu_ops
from loadtest import linear_bench


@pytest.mark.skipif(cpu_ops.load() is None, reason="the CPU kernels did not build")
def test_every_format_and_row_count_is_timed(tmp_path):
    out = tmp_path / "linear.json"
    assert linear_bench.main(["--shape", "tiny", "--rows", "1", "9", "--repeats", "1",
                              "--result-json", str(out)]) == 0
    result = json.loads(out.read_text())
    peaks = result["peak_gflop_per_s"]  # on AVX-512 and AVX2 builds
    assert not peaks or peaks["fp32"] > 0
    results = result["results"]
    assert [r["rows"] for r in results] == [1, 9]
    for row in results:
        columns = {"fp32", "blas_fp32", "blas_bf16", "int8_fp32", "int4_fp32", "bf16_panels",
                   "fp32_gflop_per_s"}
        if cpu_ops.native_bf16():  # a bf16 model's pairs, on AMX tiles too where there are any
            columns |= {"bf16_pairs_avx512"} | ({"bf16_pairs_amx"} if cpu_ops.load().amx_bf16()
                                                else set())
        assert columns <= set(row)
        assert all(row[c] > 0 for c in columns), row
        if peaks:  # a kernel at most about the registers' peak
            assert 0 < row["fp32_of_peak"] < 1.2, row
