"""Two kernel builds in one process: a copy of this checkout's build against it gives every point
figures and the same bits; a folder that is no checkout, or whose kernels do not build, is
named."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from jetserve_kernels import cpu_ops
from loadtest import kernel_ab

KERNELS = cpu_ops.load()


@pytest.mark.skipif(KERNELS is None or not KERNELS.prefill_attention_kernel(),
                    reason="the CPU attention kernels need a build with AVX-512 or AVX2")
def test_a_copy_of_the_build_gives_the_same_bits(tmp_path):
    built = Path(KERNELS.__file__)
    copy = tmp_path / built.name  # another file: loaded as a module of its own
    shutil.copy(built, copy)
    out = tmp_path / "ab.json"
    linear = ["--linear", "13", "100"] if KERNELS.bf16_dot_products() else []
    assert kernel_ab.main(["--against", str(copy), "--decode", "3:40", "--prefill", "24:8",
                           *linear, "--repeats", "2", "--result-json", str(out)]) == 0
    result = json.loads(out.read_text())
    points = [(row["point"], row["invariant"]) for row in result["points"]]
    expected = [("decode 3:40", False), ("decode 3:40", True), ("prefill 24:8", True)]
    if linear:
        expected += [("linear bf16_pairs 13 rows", True), ("linear bf16_pairs 100 rows", True)]
    assert points == expected
    for row in result["points"]:
        assert row["same_bits"] and row["new_ms"] > 0 and row["old_ms"] > 0, row


@pytest.mark.skipif(KERNELS is None, reason="the CPU kernels did not build here")
def test_each_linear_format_this_build_runs_gives_the_same_bits_against_a_copy(tmp_path):
    built = Path(KERNELS.__file__)
    copy = tmp_path / built.name
    shutil.copy(built, copy)
    formats = [f for f in kernel_ab.LINEAR_FORMATS if kernel_ab.linear_usable(KERNELS, f)]
    assert "fp32" in formats
    for fmt in formats:
        out = tmp_path / f"{fmt}.json"
        assert kernel_ab.main(["--against", str(copy), "--linear", "1", "13",
                               "--linear-format", fmt, "--repeats", "2",
                               "--result-json", str(out)]) == 0
        result = json.loads(out.read_text())
        assert result["linear_format"] == fmt
        assert [row["point"] for row in result["points"]] == [f"linear {fmt} 1 rows",
                                                             f"linear {fmt} 13 rows"]
        for row in result["points"]:
            assert row["same_bits"] and row["new_ms"] > 0 and row["old_ms"] > 0, (fmt, row)
    for fmt in set(kernel_ab.LINEAR_FORMATS) - set(formats):  # named, not run
        with pytest.raises(SystemExit, match=f"--linear-format {fmt}"):
            kernel_ab.main(["--against", str(copy), "--linear", "8", "--linear-format", fmt])


def test_a_checkout_that_does_not_build_is_named(tmp_path):
    with pytest.raises(SystemExit, match="neither a built .so nor a checkout"):
        kernel_ab.built(tmp_path)
    (tmp_path / "notes.txt").write_text("not a build")
    with pytest.raises(SystemExit, match="is not a built .so"):
        kernel_ab.built(tmp_path / "notes.txt")
    renamed = tmp_path / "renamed.so"
    if KERNELS is not None:
        shutil.copy(KERNELS.__file__, renamed)
        with pytest.raises(SystemExit, match="must keep the name it was built with"):
            kernel_ab.load(renamed)
    with pytest.raises(SystemExit):  # nothing to time; one repeat cannot alternate
        kernel_ab.main(["--against", str(tmp_path)])
    with pytest.raises(SystemExit):
        kernel_ab.main(["--against", str(tmp_path), "--decode", "2:8", "--repeats", "1"])
    (tmp_path / "jetserve_kernels").mkdir()
    (tmp_path / "jetserve_kernels" / "cpu_ops.py").write_text("raise ImportError('broken')\n")
    with pytest.raises(SystemExit, match=f"the kernels of {tmp_path} did not build"):
        kernel_ab.built(tmp_path)
