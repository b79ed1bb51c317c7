"""The matmul microbenchmark on the tiny shape: every format and row count gets a figure."""

from __future__ import annotations

import json

import pytest

from jetserve_kernels import cpu_ops
from loadtest import linear_bench


def tiny_run(out) -> dict:
    assert linear_bench.main(["--shape", "tiny", "--rows", "1", "9", "--repeats", "1",
                              "--result-json", str(out)]) == 0
    return json.loads(out.read_text())


@pytest.mark.skipif(cpu_ops.load() is None, reason="the CPU kernels did not build")
def test_every_format_and_row_count_is_timed(tmp_path):
    result = tiny_run(tmp_path / "linear.json")
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
    if not peaks:
        return
    # A kernel at most about the registers' peak. The share divides two timings, and under
    # make test's other workers (containers among them) one of them can be taken at a fraction of
    # the cores' speed (a peak of 39 GFLOP/s on a core that gives 117): a share past the bound
    # is timed once more, in a second run, before it fails.
    shares = [row["fp32_of_peak"] for row in results]
    if not all(0 < share < 1.2 for share in shares):
        shares = [row["fp32_of_peak"] for row in tiny_run(tmp_path / "again.json")["results"]]
    assert all(0 < share < 1.2 for share in shares), shares
