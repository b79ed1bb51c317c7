"""The CPU attention kernels on their own: decode batches and prefill chunks over a paged KV
cache (fp32, or `--kv-dtype` bf16 or int8: jetserve_kernels/kv_int8.py) for every layer of a
model (a cache per layer, blocks scattered, so it streams from memory as in the engine), against
SDPA over the gathered blocks, as the torch backend runs without the kernels. A decode runs in
both of the decode kernel's orders: its own (an fp32 model's) and the batch-invariant one a bf16
model's decodes share with the prefill kernel ("invariant"). A prefill runs on the prefill
kernel, called as an fp32 model calls it and as a batch-invariant one does ("invariant": over a
bf16 cache, bf16 dot products where the CPU has them; the same tiles over fp32 and int8 caches;
on an AVX2 build, whose tiles keep no such order, the same call as the first), and as each
token a row of the invariant decode kernel ("as decode rows": what a batch-invariant model's
prefill costs without the prefill kernel's tiles). The median of
`--repeats` runs, in ms for all the layers.

    python -m loadtest.attention_bench --decode 1:300 8:256 64:256 128:300 \
        --prefill 40:0 384:0 200:300 --result-json results/attention_bench.json

`--in-cache` has every decode read one sequence's blocks, which stay in the CPU's caches: the
decode kernels' arithmetic alone, beside what memory costs them.

A decode point B:L is B sequences at L cached tokens each; a prefill point T:P is one chunk of T
new tokens after P cached ones.
"""

from __future__ import annotations

import argparse
import statistics

import torch
import torch.nn.functional as F

from jetserve_kernels import cpu_ops, kv_int8
from loadtest.linear_bench import times_ms
from loadtest.metrics import write_result
from shared.model_files import DUMMY_SHAPES

BLOCK_SIZE = 16


def median_ms(fn, repeats: int) -> float:
    return statistics.median(times_ms(fn, repeats))


def pair(text: str) -> tuple[int, int]:
    a, _, b = text.partition(":")
    return int(a), int(b)


class Caches:
    """Per-layer K and V caches with `seqs` sequences of `length` tokens, blocks scattered."""

    def __init__(self, layers: int, seqs: int, length: int, kv_heads: int, head_dim: int,
                 kv_dtype: str = "fp32"):
        per_seq = -(-length // BLOCK_SIZE)
        blocks = seqs * per_seq + 1
        shape = (blocks, BLOCK_SIZE, kv_heads, head_dim)
        store = {"int8": kv_int8.quantize, "bf16": torch.Tensor.bfloat16}.get(kv_dtype, lambda x: x)
        self.k = [store(torch.randn(shape)) for _ in range(layers)]
        self.v = [store(torch.randn(shape)) for _ in range(layers)]
        order = torch.randperm(blocks - 1) + 1
        self.tables = order[:seqs * per_seq].view(seqs, per_seq).to(torch.int32).contiguous()
        row_bytes = self.k[0].shape[-1] * self.k[0].element_size()
        self.bytes = 2 * layers * seqs * length * kv_heads * row_bytes

    def gathered(self, layer: int, seq: int, length: int):
        """One sequence's keys and values, contiguous: [length, KVH, D] each."""
        ids = self.tables[seq]
        k, v = self.k[layer], self.v[layer]
        keys = k.view(k.shape[0], -1).index_select(0, ids).view(-1, *k.shape[2:])[:length]
        values = v.view(v.shape[0], -1).index_select(0, ids).view(-1, *v.shape[2:])[:length]
        if kv_int8.is_int8(keys):  # as the torch backend gathers an int8 cache
            keys, values = kv_int8.dequantize(keys), kv_int8.dequantize(values)
        return keys.float(), values.float()


def decode_point(kernels, shape: dict, seqs: int, length: int, repeats: int,
                 kv_dtype: str = "fp32", in_cache: bool = False) -> dict:
    """in_cache: every sequence reads the first one's blocks, which then stay in the CPU's
    caches: the kernel's arithmetic without the memory (GB/s as if each had its own)."""
    layers, heads, kv_heads, dim = (shape["num_layers"], shape["num_heads"],
                                    shape["num_kv_heads"], shape["head_dim"])
    caches = Caches(layers, 1 if in_cache else seqs, length, kv_heads, dim, kv_dtype)
    tables = caches.tables.expand(seqs, -1) if in_cache else caches.tables
    # q as the engine has it: a view into the fused QKV output.
    q = torch.randn(seqs, (heads + 2 * kv_heads) * dim)[:, :heads * dim].unflatten(1, (heads, dim))
    out = torch.empty(seqs, heads, dim)
    lens = torch.full((seqs,), length, dtype=torch.int32)
    rows = torch.arange(seqs)
    scale = dim ** -0.5

    def kernel(invariant: bool = False):
        for layer in range(layers):
            kernels.paged_decode_attention(q, caches.k[layer], caches.v[layer], tables,
                                           lens, rows, out, scale, invariant)

    def sdpa():  # every sequence at the same length: one batched call a layer
        for layer in range(layers):
            kv = [caches.gathered(layer, 0 if in_cache else s, length) for s in range(seqs)]
            keys = torch.stack([k for k, _ in kv]).transpose(1, 2)
            values = torch.stack([v for _, v in kv]).transpose(1, 2)
            F.scaled_dot_product_attention(q.unsqueeze(2), keys, values, scale=scale,
                                           enable_gqa=True)

    row = {"seqs": seqs, "context": length, "in_cache": in_cache,
           "kernel_ms": median_ms(kernel, repeats),
           "invariant_ms": median_ms(lambda: kernel(True), repeats),
           "sdpa_ms": median_ms(sdpa, repeats)}
    read = caches.bytes * (seqs if in_cache else 1)
    row["kernel_gb_per_s"] = read / row["kernel_ms"] / 1e6
    row["invariant_gb_per_s"] = read / row["invariant_ms"] / 1e6
    return row


def prefill_point(kernels, shape: dict, tokens: int, cached: int, repeats: int,
                  kv_dtype: str = "fp32") -> dict:
    layers, heads, kv_heads, dim = (shape["num_layers"], shape["num_heads"],
                                    shape["num_kv_heads"], shape["head_dim"])
    length = cached + tokens
    caches = Caches(layers, 1, length, kv_heads, dim, kv_dtype)
    q = torch.randn(tokens, (heads + 2 * kv_heads) * dim)[:, :heads * dim].unflatten(1, (heads, dim))
    out = torch.empty(tokens, heads, dim)
    table = caches.tables[0].contiguous()
    scale = dim ** -0.5
    mask = torch.arange(length)[None, :] <= (cached + torch.arange(tokens))[:, None]

    def kernel(invariant: bool = False):
        for layer in range(layers):
            kernels.paged_prefill_attention(q, caches.k[layer], caches.v[layer], table, 0, tokens,
                                            cached, out, scale, invariant)

    def sdpa():
        query = q.transpose(0, 1).unsqueeze(0)
        for layer in range(layers):
            keys, values = caches.gathered(layer, 0, length)
            F.scaled_dot_product_attention(query, keys.unsqueeze(0).transpose(1, 2),
                                           values.unsqueeze(0).transpose(1, 2), attn_mask=mask,
                                           scale=scale, enable_gqa=True)

    # Each token a row of the invariant decode kernel (every token reading its whole context).
    # (short and long rows alternating, as the engine ran them: each thread's contiguous share
    # of the rows then carries equal work)
    order = torch.arange(tokens)
    order = torch.where(order % 2 == 0, order // 2, tokens - 1 - order // 2)
    lens, rows = (cached + 1 + order).int(), order

    def as_decode_rows():
        for layer in range(layers):
            kernels.paged_decode_attention(q, caches.k[layer], caches.v[layer],
                                           table.expand(tokens, -1), lens, rows, out, scale, True)

    row = {"tokens": tokens, "cached": cached, "kernel_ms": median_ms(kernel, repeats),
           "invariant_ms": median_ms(lambda: kernel(True), repeats),
           "as_decode_rows_ms": median_ms(as_decode_rows, repeats),
           "sdpa_ms": median_ms(sdpa, repeats)}
    flops = 4 * heads * dim * (tokens * cached + tokens * (tokens + 1) / 2) * layers
    row["kernel_gflop_per_s"] = flops / row["kernel_ms"] / 1e6
    row["invariant_gflop_per_s"] = flops / row["invariant_ms"] / 1e6
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", default="smollm2-135m", choices=sorted(DUMMY_SHAPES))
    parser.add_argument("--decode", type=pair, nargs="*",
                        default=[(1, 300), (8, 256), (64, 256), (128, 300)])
    parser.add_argument("--prefill", type=pair, nargs="*", default=[(40, 0), (384, 0), (200, 300)])
    parser.add_argument("--kv-dtype", choices=["fp32", "bf16", "int8"], default="fp32")
    parser.add_argument("--in-cache", action="store_true",
                        help="decodes: every sequence reads the first one's blocks, which stay "
                        "in the CPU's caches (the kernels' arithmetic alone)")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--result-json", default="results/attention_bench.json")
    args = parser.parse_args(argv)
    kernels = cpu_ops.load()
    if kernels is None:
        raise SystemExit("the CPU kernels did not build (see the warning above)")
    if args.prefill and not kernels.prefill_attention_kernel():
        print("prefill: skipped, its kernel needs a build with AVX-512 or AVX2 and FMA (decodes "
              "run on every build)")
        args.prefill = []
    shape = DUMMY_SHAPES[args.shape]
    torch.manual_seed(0)
    print(f"{args.shape}, {args.kv_dtype} KV: {shape['num_layers']} layers, ms for all of them, "
          f"median of {args.repeats}")
    decodes, prefills = [], []
    for seqs, length in args.decode:
        row = decode_point(kernels, shape, seqs, length, args.repeats, args.kv_dtype,
                           args.in_cache)
        decodes.append(row)
        print(f"  decode {seqs:4d} x {length:5d}{' in cache' if args.in_cache else ''}: "
              f"kernel {row['kernel_ms']:8.1f} ({row['kernel_gb_per_s']:.1f} GB/s)  "
              f"invariant {row['invariant_ms']:8.1f} ({row['invariant_gb_per_s']:.1f} GB/s)  "
              f"SDPA {row['sdpa_ms']:8.1f}", flush=True)
    for tokens, cached in args.prefill:
        row = prefill_point(kernels, shape, tokens, cached, args.repeats, args.kv_dtype)
        prefills.append(row)
        print(f"  prefill {tokens:4d} after {cached:5d}: kernel {row['kernel_ms']:8.1f} "
              f"({row['kernel_gflop_per_s']:.0f} GFLOP/s)  invariant {row['invariant_ms']:8.1f} "
              f"({row['invariant_gflop_per_s']:.0f} GFLOP/s)  as decode rows "
              f"{row['as_decode_rows_ms']:8.1f}  SDPA {row['sdpa_ms']:8.1f}", flush=True)
    write_result(args.result_json, "attention_bench", shape=args.shape, kv_dtype=args.kv_dtype,
                 threads=torch.get_num_threads(), decode=decodes, prefill=prefills)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
