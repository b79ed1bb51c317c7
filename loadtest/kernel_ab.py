"""Two builds of the CPU kernels, timed in turn in one process: this checkout's and another's
(`--against`: a checkout, whose kernels are built if need be, or a built .so). Each point runs
both builds `--repeats` times, alternating which goes first, on the same inputs; it prints the
medians, new over old, and whether their outputs have the same bits.

    python -m loadtest.kernel_ab --against ../jetserve-before --decode 64:256 128:1000 \\
        --prefill 512:1536 --linear 8 512 --kv-dtype bf16

On a machine shared with others, memory bandwidth and clock drift from one process to the next
by more than a kernel change is worth (on the 2-core cloud VMs of BENCHMARKS.md, the same build's
decode time ran 56-79 ms from process to process); in one process, in turn, both builds see the
same drift. Points are SmolLM2-135M's thirty layers (`attention_bench`'s caches, blocks
scattered; `linear_bench`'s four matmuls of a layer): decode B:L is B sequences of L cached
tokens, in both of the decode kernel's orders; prefill T:P a chunk of T tokens after P cached
ones, in the batch-invariant order; linear R the matmuls at R rows, their weights in
`--linear-format`: a bf16 model's pairs (the default), fp32 panels, or int8 (int4) weights with
int8 activations, as the engine packs each (and called as below 49 rows, on the vector
kernels: many_rows fp32). To compare the paths of other CPUs, build both with
the same JETSERVE_CPU_ARCH (an AVX2 build: `x86-64-v3`).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from jetserve_kernels import cpu_ops
from loadtest.attention_bench import Caches, pair
from loadtest.linear_bench import layer_shapes
from loadtest.metrics import write_result
from services.executor.engine.linear import (pack_for_int8_activations, pack_pairs,
                                             pack_panels, pack_quantized, quantize)
from shared.model_files import DUMMY_SHAPES

SHAPE = DUMMY_SHAPES["smollm2-135m"]


def built(against: Path) -> Path:
    """The kernels' .so of a checkout (built there if need be), or `against` if it is one."""
    if against.is_file():
        if against.suffix != ".so":
            raise SystemExit(f"{against} is not a built .so")
        return against
    if not (against / "jetserve_kernels" / "cpu_ops.py").is_file():
        raise SystemExit(f"{against} is neither a built .so nor a checkout with jetserve_kernels")
    # That checkout's modules first, whatever this process found (an installed copy, or this
    # checkout on PYTHONPATH); and checked: the build must be made from its sources.
    probe = ("from jetserve_kernels import cpu_ops; print(cpu_ops.__file__); "
             "print(cpu_ops.load().__file__)")
    env = dict(os.environ, PYTHONPATH=str(against.resolve()))
    run = subprocess.run([sys.executable, "-c", probe], cwd=against, env=env,
                         capture_output=True, text=True)
    if run.returncode != 0:
        raise SystemExit(f"the kernels of {against} did not build:\n{run.stderr[-2000:]}")
    source, library = run.stdout.strip().splitlines()[-2:]
    if not Path(source).resolve().is_relative_to(against.resolve()):
        raise SystemExit(f"{against}'s kernels were not the ones imported ({source})")
    return Path(library)


def load(path: Path):
    """A kernels' .so as a module of its own (each build's module name carries its hash, and its
    file keeps that name: jetserve_cpu_<hash>.so)."""
    spec = importlib.util.spec_from_file_location(path.name.split(".")[0], path)
    try:
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    except ImportError as error:
        raise SystemExit(f"{path} does not load as a kernels build (its file must keep the "
                         f"name it was built with, jetserve_cpu_<hash>.so): {error}") from None
    return module


def in_turn(run, builds: list, repeats: int) -> dict:
    """Times run(kernels) (which returns its outputs) for each build, `repeats` times each,
    alternating which goes first (after one call each to warm up); the medians and whether the
    outputs are the same."""
    outs = [None, None]
    for i, kernels in enumerate(builds):
        outs[i] = run(kernels)
    times: list[list[float]] = [[], []]
    for r in range(repeats):
        for i in ((0, 1) if r % 2 == 0 else (1, 0)):
            start = time.perf_counter()
            outs[i] = run(builds[i])
            times[i].append((time.perf_counter() - start) * 1e3)
    new, old = statistics.median(times[0]), statistics.median(times[1])
    same = all(torch.equal(a.view(torch.int32), b.view(torch.int32))
               for a, b in zip(outs[0], outs[1]))
    return {"new_ms": new, "old_ms": old, "ratio": new / old, "same_bits": same}


def decode_points(builds, points, kv_dtype: str, repeats: int) -> list[dict]:
    layers, heads, kv_heads, dim = (SHAPE["num_layers"], SHAPE["num_heads"],
                                    SHAPE["num_kv_heads"], SHAPE["head_dim"])
    rows = []
    for seqs, length in points:
        caches = Caches(layers, seqs, length, kv_heads, dim, kv_dtype)
        q = torch.randn(seqs, (heads + 2 * kv_heads) * dim)[:, :heads * dim].unflatten(
            1, (heads, dim))
        lens = torch.full((seqs,), length, dtype=torch.int32)
        for invariant in (False, True):
            def run(kernels):
                outs = []
                for layer in range(layers):
                    out = torch.empty(seqs, heads, dim)
                    kernels.paged_decode_attention(q, caches.k[layer], caches.v[layer],
                                                   caches.tables, lens, torch.arange(seqs), out,
                                                   dim ** -0.5, invariant)
                    outs.append(out)
                return outs
            rows.append({"point": f"decode {seqs}:{length}", "invariant": invariant,
                         **in_turn(run, builds, repeats)})
    return rows


def prefill_points(builds, points, kv_dtype: str, repeats: int) -> list[dict]:
    layers, heads, kv_heads, dim = (SHAPE["num_layers"], SHAPE["num_heads"],
                                    SHAPE["num_kv_heads"], SHAPE["head_dim"])
    rows = []
    for tokens, cached in points:
        caches = Caches(layers, 1, cached + tokens, kv_heads, dim, kv_dtype)
        q = torch.randn(tokens, (heads + 2 * kv_heads) * dim)[:, :heads * dim].unflatten(
            1, (heads, dim))
        table = caches.tables[0].contiguous()

        def run(kernels):
            outs = []
            for layer in range(layers):
                out = torch.empty(tokens, heads, dim)
                kernels.paged_prefill_attention(q, caches.k[layer], caches.v[layer], table, 0,
                                                tokens, cached, out, dim ** -0.5, True)
                outs.append(out)
            return outs
        rows.append({"point": f"prefill {tokens}:{cached}", "invariant": True,
                     **in_turn(run, builds, repeats)})
    return rows


# The weights of each --linear-format, packed as the engine packs them, and the call of one.
LINEAR_FORMATS = ("bf16_pairs", "fp32", "w8a8", "w8a8x2", "w4a8")


def linear_weights(fmt: str, n: int, k: int):
    w = torch.randn(n, k) * 0.02
    if fmt == "bf16_pairs":
        return pack_pairs(w.bfloat16())
    if fmt == "fp32":
        return pack_panels(w)
    return pack_for_int8_activations(pack_quantized(quantize(w, 4 if fmt == "w4a8" else 8)))


def linear_call(kernels, fmt: str, x: torch.Tensor, p, n: int) -> torch.Tensor:
    if fmt == "bf16_pairs":
        return kernels.linear_bf16_pairs(x, p, n, "avx512")
    if fmt == "fp32":
        return kernels.linear_f32(x, p)
    if fmt == "w4a8":
        return kernels.linear_w4a8(x, p.q, p.scale, p.min, p.sums, n, "fp32", False)
    return kernels.linear_w8a8(x, p.q, p.scale, p.sums, n, "fp32", fmt == "w8a8x2")


def linear_usable(kernels, fmt: str) -> bool:
    if fmt == "bf16_pairs":
        return kernels.bf16_dot_products()
    return fmt == "fp32" or kernels.int8_dot_products()


def linear_points(builds, row_counts: list[int], fmt: str, repeats: int) -> list[dict]:
    torch.manual_seed(0)
    weights = [(linear_weights(fmt, n, k), n, k)
               for _ in range(SHAPE["num_layers"]) for n, k in layer_shapes(SHAPE)]
    rows = []
    for m in row_counts:
        xs = {k: torch.randn(m, k) for k in {k for _, _, k in weights}}

        def run(kernels):
            # Only the last layer's outputs are kept for the comparison: holding all 120 would
            # make glibc fault them in again every repetition (linear_bench.drain).
            outs = []
            for i, (p, n, k) in enumerate(weights):
                y = linear_call(kernels, fmt, xs[k], p, n)
                if i >= len(weights) - 4:
                    outs.append(y)
            return outs
        rows.append({"point": f"linear {fmt} {m} rows", "invariant": True,
                     **in_turn(run, builds, repeats)})
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--against", type=Path, required=True,
                        help="the other build: a checkout of the repository, or a built .so "
                             "under the name it was built with (jetserve_cpu_<hash>.so)")
    parser.add_argument("--decode", type=pair, nargs="*", default=[])
    parser.add_argument("--prefill", type=pair, nargs="*", default=[])
    parser.add_argument("--linear", type=int, nargs="*", default=[])
    parser.add_argument("--linear-format", choices=LINEAR_FORMATS, default="bf16_pairs",
                        help="the weights --linear multiplies: a bf16 model's pairs (default; "
                             "AVX512-BF16), fp32 panels, or int8/int4 weights with int8 "
                             "activations (w8a8x2: x's second bytes too; AVX512-VNNI or AVX2)")
    parser.add_argument("--kv-dtype", choices=["fp32", "bf16", "int8"], default="bf16")
    parser.add_argument("--repeats", type=int, default=12)
    parser.add_argument("--result-json", default="results/kernel_ab.json")
    args = parser.parse_args(argv)
    if not (args.decode or args.prefill or args.linear):
        parser.error("nothing to time: give --decode, --prefill or --linear points")
    if args.repeats < 2:
        parser.error("--repeats must be at least 2 (each build goes first in turn)")
    new = cpu_ops.load()
    if new is None:
        raise SystemExit("this checkout's CPU kernels did not build")
    if args.linear and not linear_usable(new, args.linear_format):
        raise SystemExit(f"--linear-format {args.linear_format}: this build cannot run it "
                         "(bf16 pairs need AVX512-BF16; int8 activations AVX512-VNNI or AVX2)")
    old_path = built(args.against)
    builds = [new, load(old_path)]
    if args.linear and not linear_usable(builds[1], args.linear_format):
        raise SystemExit(f"--linear-format {args.linear_format}: {old_path} cannot run it")
    print(f"new: {new.__file__}\nold: {old_path}")
    rows = (decode_points(builds, args.decode, args.kv_dtype, args.repeats)
            + prefill_points(builds, args.prefill, args.kv_dtype, args.repeats)
            + linear_points(builds, args.linear, args.linear_format, args.repeats))
    for row in rows:
        order = "invariant" if row["invariant"] else "own order"
        print(f"  {row['point']:<28} {order:<10} new {row['new_ms']:8.1f} ms   old "
              f"{row['old_ms']:8.1f} ms   new/old {row['ratio']:.3f}   same bits "
              f"{'yes' if row['same_bits'] else 'no'}")
    write_result(args.result_json, "kernel_ab", new=str(new.__file__), old=str(old_path),
                 kv_dtype=args.kv_dtype, linear_format=args.linear_format, repeats=args.repeats, points=rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
