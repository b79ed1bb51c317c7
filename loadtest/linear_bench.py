"""The CPU matmul kernels on their own: every layer's matmuls of a model (distinct random weights,
so they stream from memory as in the engine) at a range of row counts, for packed fp32, int8 and
int4 weights (fp32, and bfloat16 for many rows where the CPU has it; with int8 activations, W8A8
and W4A8, where it has AVX512-VNNI or AVX2, and the same with x's remainder in a second byte, "a8x2",
and on AMX-INT8 tiles, "a8_amx", where it has them),
and bf16 weights (a bf16 model's: "bf16_pairs_avx512", bf16 dot products at every row count,
where the CPU has AVX512-BF16, and "bf16_pairs_amx", the same pairs on AMX tiles, where it has
AMX; "bf16_panels", widened to fp32 up to 8 rows, as without it), beside torch's own fp32 and
bf16 matmuls (BLAS: oneDNN's AMX kernels for bf16 where the CPU has AMX) on the same shapes,
and the share of the cores' peak (`dot_peak_flops`: fp32 FMAs, bf16 and int8 dot products from
registers) that the fp32, bf16-pairs and W8A8 kernels reach. Every weight, torch's included, is
in transparent huge pages where the host allows, as the engine's (`--no-huge-pages`: torch's
4 KiB pages). The best of `--repeats` runs, in ms for all the layers.

    python -m loadtest.linear_bench --rows 1 8 40 128 512 --result-json results/linear_bench.json
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from jetserve_kernels import cpu_ops
from loadtest.metrics import write_result
from services.executor.engine import huge_pages
from services.executor.engine.linear import (pack_for_int8_activations, pack_pairs,
                                             pack_panels, pack_quantized, quantize)
from shared.model_files import DUMMY_SHAPES


def layer_shapes(shape: dict) -> list[tuple[int, int]]:
    """(N, K) of one layer's fused QKV, output, fused gate/up and down projections."""
    h, hd = shape["hidden_size"], shape["head_dim"]
    qkv = (shape["num_heads"] + 2 * shape["num_kv_heads"]) * hd
    return [(qkv, h), (h, shape["num_heads"] * hd), (2 * shape["intermediate_size"], h),
            (h, shape["intermediate_size"])]


def drain(outputs) -> None:
    """Runs a generator of matmuls, each output dropped before the next is made, as the engine
    drops a layer's activations: holding all 120 at once (318 MB of fp32 at 512 rows) makes
    glibc hand the memory back and fault it in again every repetition, which measured up to
    1.45x a matmul's own time (and fp32 outputs twice bf16 ones)."""
    for out in outputs:
        del out


def times_ms(fn, repeats: int) -> list[float]:
    """ms of `repeats` calls of fn, after one to warm up."""
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return times


def best_ms(fn, repeats: int) -> float:
    return min(times_ms(fn, repeats))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", default="smollm2-135m", choices=sorted(DUMMY_SHAPES))
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8, 40, 128, 512])
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--no-huge-pages", action="store_true",
                        help="the weights on torch's pages, not in huge pages as the engine's")
    parser.add_argument("--result-json", default="results/linear_bench.json")
    args = parser.parse_args(argv)
    kernels = cpu_ops.load()
    if kernels is None:
        raise SystemExit("the CPU kernels did not build (see the warning above)")
    shape = DUMMY_SHAPES[args.shape]
    torch.manual_seed(0)
    dense = [torch.randn(n, k) * 0.02 for _ in range(shape["num_layers"])
             for n, k in layer_shapes(shape)]
    panels = [pack_panels(w) for w in dense]
    quantized = {bits: [pack_quantized(quantize(w, bits)) for w in dense] for bits in (8, 4)}
    precisions = ["fp32"] + (["bf16"] if kernels.bf16_dot_products() else [])
    int8_activations = kernels.int8_dot_products()
    quads = {bits: [pack_for_int8_activations(w) for w in quantized[bits]]
             for bits in (8, 4)} if int8_activations else {}
    dense16 = [w.bfloat16() for w in dense]
    bf16_panels = [pack_panels(w) for w in dense16]
    bf16_pairs = [pack_pairs(w.bfloat16()) for w in dense] if kernels.bf16_dot_products() else []
    placed = not args.no_huge_pages and huge_pages.available()
    if placed:  # as the engine places its packed weights (huge_pages.py)
        arena, copies = huge_pages.HugePageArena(), {}

        def take(t):  # once per tensor: quads share their scales with the int8/int4 panels
            if t is not None and id(t) not in copies:
                copies[id(t)] = (t, arena.take(t))  # (t kept: its id stays its own)
            return None if t is None else copies[id(t)][1]

        for tensors in (dense, panels, dense16, bf16_panels, bf16_pairs):
            for i, t in enumerate(tensors):
                tensors[i] = take(t)
        for w in [w for ws in (*quantized.values(), *quads.values()) for w in ws]:
            w.q, w.scale, w.min, w.sums = (take(t) for t in (w.q, w.scale, w.min, w.sums))
        copies.clear()

    def run_int8_activations(bits: int, xs: dict, second_byte: bool = False,
                             units: str = "fp32"):
        for w in quads[bits]:
            x = xs[w.q.shape[1] * 4]
            if bits == 8:
                kernels.linear_w8a8(x, w.q, w.scale, w.sums, w.n, units, second_byte)
            else:
                kernels.linear_w4a8(x, w.q, w.scale, w.min, w.sums, w.n, units, second_byte)

    def run_quantized(bits: int, xs: dict, precision: str):
        for w in quantized[bits]:
            x = xs[w.q.shape[1]]
            if bits == 8:
                kernels.linear_int8(x, w.q, w.scale, w.n, precision)
            else:
                kernels.linear_int4(x, w.q, w.scale, w.min, w.n, precision)

    # What the cores can multiply from registers (dot_peak_flops): each kernel's share of it.
    # (AVX-512 and AVX2 builds: elsewhere there is no peak to compare with.)
    kinds = ["fp32"] + (["bf16"] if bf16_pairs else []) + (["int8"] if int8_activations else [])
    try:
        peaks = {kind: max(kernels.dot_peak_flops(kind, 20_000_000) for _ in range(3)) / 1e9
                 for kind in kinds}
    except RuntimeError:
        peaks = {}
    if peaks:
        print(f"peak on {torch.get_num_threads()} threads, from registers: "
              + ", ".join(f"{kind} {peak:.0f}" for kind, peak in peaks.items())
              + " GFLOP/s (int8: GOP/s)")
    results = []
    print(f"{len(dense)} matmuls ({args.shape}), ms for all of them, best of {args.repeats}, "
          f"weights {'in huge pages' if placed else 'on 4 KiB pages'}")
    for m in args.rows:
        xs = {k: torch.randn(m, k) for k in {k for _, k in layer_shapes(shape)}}
        xs16 = {k: x.bfloat16() for k, x in xs.items()}
        row = {"rows": m,
               "fp32": best_ms(lambda: drain(kernels.linear_f32(xs[p.shape[1]], p)
                                             for p in panels), args.repeats),
               "blas_fp32": best_ms(lambda: drain(F.linear(xs[w.shape[1]], w) for w in dense),
                                    args.repeats),
               # torch's own bf16 matmul (oneDNN: what a peer's bf16 model runs; its outputs
               # rounded to bf16)
               "blas_bf16": best_ms(lambda: drain(F.linear(xs16[w.shape[1]], w)
                                                  for w in dense16), args.repeats)}
        for bits in (8, 4):
            for precision in precisions:
                row[f"int{bits}_{precision}"] = best_ms(
                    lambda: run_quantized(bits, xs, precision), args.repeats)
            if int8_activations:
                row[f"w{bits}a8"] = best_ms(lambda: run_int8_activations(bits, xs), args.repeats)
                row[f"w{bits}a8x2"] = best_ms(lambda: run_int8_activations(bits, xs, True),
                                              args.repeats)
                if kernels.amx_int8():  # the same bits on AMX-INT8 tiles (from 16 rows)
                    row[f"w{bits}a8_amx"] = best_ms(
                        lambda: run_int8_activations(bits, xs, units="amx_int8"), args.repeats)
        row["bf16_panels"] = best_ms(
            lambda: drain(kernels.linear_bf16(xs[p.shape[1]], p, p.shape[0] * 32,
                                              precisions[-1]) for p in bf16_panels),
            args.repeats)
        # a bf16 model's matmuls: vdpbf16ps, and AMX tiles where the CPU has them
        for units in ["avx512"] + (["amx"] if bf16_pairs and kernels.amx_bf16() else []):
            if bf16_pairs:
                row[f"bf16_pairs_{units}"] = best_ms(
                    lambda: drain(kernels.linear_bf16_pairs(xs[2 * p.shape[1]], p,
                                                            p.shape[0] * 32, units)
                                  for p in bf16_pairs), args.repeats)
        flops = 2 * m * sum(n * k for n, k in layer_shapes(shape)) * shape["num_layers"]
        row["fp32_gflop_per_s"] = flops / row["fp32"] / 1e6
        for column, kind in [("fp32", "fp32"), ("bf16_pairs_avx512", "bf16"), ("w8a8", "int8"),
                             ("w8a8_amx", "int8")]:
            if column in row and kind in peaks:  # its share of its instruction's peak
                row[f"{column}_of_peak"] = flops / row[column] / 1e6 / peaks[kind]
        results.append(row)
        print("  ".join(f"{k} {100 * v:.0f}%" if k.endswith("_of_peak")
                        else f"{k} {v:.1f}" if isinstance(v, float) else f"{k} {v}"
                        for k, v in row.items()), flush=True)
    write_result(args.result_json, "linear_bench", shape=args.shape,
                 threads=torch.get_num_threads(), huge_pages=placed, peak_gflop_per_s=peaks,
                 results=results)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
