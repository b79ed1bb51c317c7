"""The kernel probes at small points: each probe builds, runs every order and mode, and a bad
argument is refused."""

from __future__ import annotations

import json
import subprocess

import pytest

from jetserve_kernels import cpu_ops
from loadtest import kernel_probes

FLAGS = kernel_probes.cpu_flags()


NATIVE = cpu_ops.ARCH == "native"


@pytest.mark.skipif("avx512f" not in FLAGS or not NATIVE,
                    reason="the probes need AVX-512 (and a build for this CPU)")
def test_every_order_and_mode_is_timed(tmp_path):
    out = tmp_path / "probes.json"
    assert kernel_probes.main(["--decode", "2:40", "--rows", "6", "--repeats", "1",
                               "--result-json", str(out)]) == 0
    result = json.loads(out.read_text())
    reads = result["kv_reads"]
    pages = (False, True) if kernel_probes.huge_pages_possible() else (False,)
    assert sorted({(r["order"], r["huge_pages"]) for r in reads}) == sorted(
        (order, huge) for order in ("head", "token", "block", "head_major") for huge in pages)
    assert all(r["seqs"] == 2 and r["len"] == 40 and r["ms"] > 0 and r["gb_s"] > 0 for r in reads)
    if {"avx512_vnni", "avx512bw"} <= FLAGS:
        tiles = result["w8a8_group_end"]
        assert {(t["matmul"], t["mode"]) for t in tiles} == {
            (name, mode) for name in kernel_probes.MATMULS for mode in ("full", "folded", "products")}
        assert all(t["m"] == 6 and t["gop_s"] > 0 for t in tiles)


@pytest.mark.skipif("avx512f" not in FLAGS or not NATIVE,
                    reason="the probes need AVX-512 (and a build for this CPU)")
def test_a_bad_argument_is_refused(tmp_path):
    binary = kernel_probes.build("kv_reads", tmp_path)
    for args in (["sideways", "2", "40", "16", "3", "128", "1", "0", "1"],
                 ["head", "2", "40", "0", "3", "128", "1", "0", "1"],   # blocks of 0 positions
                 ["head", "2", "40", "16", "3", "0", "1", "0", "1"],    # rows of 0 bytes
                 ["head", "2", "40", "16", "3", "128", "1", "0", "0"]):  # no repeat
        run = subprocess.run([str(binary), *args], capture_output=True, text=True)
        assert run.returncode == 2 and "order is head, token, block or head_major" in run.stderr
    for args in (["--rows", "7"], ["--rows", "0"], ["--repeats", "0"], ["--decode", "128"]):
        with pytest.raises(SystemExit):
            kernel_probes.main(args)
