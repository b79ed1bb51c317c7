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
        expected += [("linear 13 rows", True), ("linear 100 rows", True)]
    assert points == expected
    for row in result["points"]:
        assert row["same_bits"] and row["new_ms"] > 0 and row["old_ms"] > 0, row


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
