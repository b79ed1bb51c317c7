"""What bounds two CPU kernels, probed outside them: small C++ programs (loadtest/probes/), built
with the kernels' compiler and flags (`CXX`, `JETSERVE_CPU_ARCH`: jetserve_kernels/cpu_ops.py)
and run on every intra-op thread.

- `kv_reads`: plain reads of a paged KV cache (SmolLM2's shape: 3 KV heads, bf16 rows of 64,
  blocks of 16 shuffled over the pool, 30 layers, K then V), no arithmetic, in four orders: the
  decode kernel's (`head`: a task per sequence and KV head, a head's rows at a token's stride),
  whole tokens (`token`), a block's positions one KV head after another (`block`), and a cache
  laid out head-major within each block (`head_major`); on 4 KiB pages and in huge pages (where
  transparent huge pages are not `never`): what
  the memory gives in each order, to set beside `attention_bench --decode` at the same points
  (the kernel's arithmetic overlaps its reads, so a faster order of plain reads is a lead to
  measure in the kernel, not a promise).
- `w8a8_group_end`: the W8A8 tile (AVX512-VNNI) with each group's end as the kernel has it
  (`full`), with its two scales folded into one FMA (`folded`), and without it (`products`):
  the share of the tile's time the per-32 scales take.

    python -m loadtest.kernel_probes --result-json results/kernel_probes.json

Each probe needs AVX-512 (and AVX512-VNNI for the W8A8 tile) and a C++ compiler; elsewhere it is
skipped, with the reason printed.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

from jetserve_kernels.cpu_ops import FLAGS
from loadtest.attention_bench import pair
from loadtest.metrics import write_result

PROBES = Path(__file__).parent / "probes"
COMPILER = os.environ.get("CXX", "c++")
THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")
# SmolLM2-135M: a KV row is 64 bf16 values (128 bytes); matmuls (N, K) of one layer.
KV_HEADS, KV_ROW_BYTES, LAYERS, BLOCK_SIZE = 3, 128, 30, 16
MATMULS = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536)}


def cpu_flags() -> set[str]:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


def huge_pages_possible() -> bool:
    """Whether madvise'd memory can get transparent huge pages here (the mode is not `never`)."""
    return THP.exists() and "[never]" not in THP.read_text()


def build(name: str, out_dir: Path) -> Path | None:
    """The probe built, or None (with the compiler's complaint printed) where the flags lack
    what it needs (JETSERVE_CPU_ARCH naming a set without AVX-512, say)."""
    binary = out_dir / name
    run = subprocess.run([COMPILER, *FLAGS, str(PROBES / f"{name}.cpp"), "-o", str(binary)],
                         capture_output=True, text=True)
    if run.returncode != 0:
        print(f"{name} skipped: it did not build with {' '.join(FLAGS)}:\n{run.stderr[-1000:]}")
        return None
    return binary


def run(binary: Path, args: list, threads: int) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS=str(threads))
    out = subprocess.run([str(binary), *map(str, args)], check=True, capture_output=True,
                         text=True, env=env).stdout
    return json.loads(out)


def kv_reads(binary: Path, points: list[tuple[int, int]], repeats: int, threads: int) -> list[dict]:
    rows = []
    print("\nplain reads of a paged KV cache, K and V of 30 layers (ms, GB/s of rows read)")
    for seqs, length in points:
        for huge in (0, 1) if huge_pages_possible() else (0,):
            line = []
            for order in ("head", "token", "block", "head_major"):
                result = run(binary, [order, seqs, length, BLOCK_SIZE, KV_HEADS, KV_ROW_BYTES,
                                      LAYERS, huge, repeats], threads)
                rows.append(result)
                line.append(f"{order} {result['ms']:6.1f} ({result['gb_s']:4.1f})")
            pages = "huge pages" if huge else "4 KiB pages"
            print(f"  {seqs:4d} x {length:5d}, {pages:<11}  " + "   ".join(line))
    return rows


def w8a8_group_end(binary: Path, rows: int, repeats: int, threads: int) -> list[dict]:
    results = []
    print(f"\nthe W8A8 tile at {rows} rows, 30 layers of each matmul (ms, GOP/s)")
    for name, (n, k) in MATMULS.items():
        line = []
        for mode in ("full", "folded", "products"):
            result = run(binary, [mode, n, k, rows, repeats], threads)
            results.append({"matmul": name, **result})
            line.append(f"{mode} {result['ms']:6.1f} ({result['gop_s']:5.0f})")
        print(f"  {name:<8}" + "   ".join(line))
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--decode", type=pair, nargs="*", default=[(128, 300), (128, 1000)],
                        help="KV reads at B sequences of L tokens each, as B:L")
    parser.add_argument("--rows", type=int, default=510,
                        help="rows of x for the W8A8 tile (a multiple of its 6)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--result-json", default="results/kernel_probes.json")
    args = parser.parse_args(argv)
    if args.rows <= 0 or args.rows % 6:
        parser.error("--rows must be a positive multiple of 6, the W8A8 tile's rows")
    if args.repeats <= 0 or any(b <= 0 or n <= 0 for b, n in args.decode):
        parser.error("--repeats and every --decode count must be positive")
    flags = cpu_flags()
    threads = torch.get_num_threads()
    result: dict = {"threads": threads, "compiler": COMPILER, "flags": FLAGS,
                    "huge_pages_possible": huge_pages_possible()}
    if shutil.which(COMPILER) is None:
        print(f"kernel probes skipped: no C++ compiler ({COMPILER!r}; CXX names another)")
        write_result(args.result_json, "kernel_probes", **result)
        return 0
    print(f"{threads} threads; {COMPILER} {' '.join(FLAGS)}")
    if not huge_pages_possible():
        print("transparent huge pages are off here (`never`): 4 KiB pages only")
    with tempfile.TemporaryDirectory() as tmp:
        if "avx512f" not in flags:
            print("kv_reads skipped: this CPU has no AVX-512")
        elif binary := build("kv_reads", Path(tmp)):
            result["kv_reads"] = kv_reads(binary, args.decode, args.repeats, threads)
        if not {"avx512_vnni", "avx512bw"} <= flags:
            print("w8a8_group_end skipped: this CPU has no AVX512-VNNI")
        elif binary := build("w8a8_group_end", Path(tmp)):
            result["w8a8_group_end"] = w8a8_group_end(binary, args.rows, args.repeats, threads)
    write_result(args.result_json, "kernel_probes", **result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
