"""Kernel benchmark on a CUDA GPU: each Triton kernel against a torch baseline, on Llama-3-8B
shapes (32 query heads, 8 KV heads, head dim 128, block 16, bf16).

- decode attention: batches 1-256 at contexts 512-8192, against SDPA over K/V gathered from the
  blocks (what attention costs without a paged kernel); achieved GB/s (K/V and q/out bytes)
  as a fraction of the device-to-device copy bandwidth measured in the same run;
- prefill attention: one chunk of 512-4096 new tokens over as much cached context, against SDPA
  (causal) on contiguous tensors; TFLOP/s;
- rms_norm, rotary_embedding, silu_and_mul, reshape_and_cache over 4096 tokens against the torch
  references; GB/s.

    python -m jetserve_kernels.bench --result-json results/kernels_bench.json

On a machine without a GPU it says so and exits 0.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
from pathlib import Path

import torch

HEADS, KV_HEADS, HEAD_DIM, BLOCK, HIDDEN, INTERMEDIATE = 32, 8, 128, 16, 4096, 14336
DTYPE = torch.bfloat16
TOKENS = 4096  # for the element-wise kernels
DEVICE = "cuda"  # tests run the cases on a CPU, under the interpreter, with tiny shapes
DECODE_BATCHES = [1, 8, 32, 64, 128, 256]
DECODE_CONTEXTS = [512, 1024, 2048, 4096, 8192]
PREFILL_CHUNKS = [512, 1024, 2048, 4096]


def bench_ms(fn, graph: bool = False) -> float:
    """Milliseconds per call; `graph` replays a CUDA graph, so launch overhead does not hide a
    microsecond kernel (small decode batches)."""
    import triton.testing

    if graph:
        try:
            return triton.testing.do_bench_cudagraph(fn, rep=100)
        except Exception as exc:  # not capturable: time it plainly, and say so
            print(f"  (CUDA graph capture failed: {exc!r}; timing without)", flush=True)
    return triton.testing.do_bench(fn, warmup=25, rep=100)


def copy_bandwidth() -> float:
    """Bytes moved per second by a 1 GiB device-to-device copy (read + write)."""
    src = torch.empty(2**30, dtype=torch.uint8, device=DEVICE)
    dst = torch.empty_like(src)
    return 2 * src.numel() / (bench_ms(lambda: dst.copy_(src)) / 1e3)


def paged_cache(batch: int, context: int):
    blocks_per_seq = context // BLOCK
    num_blocks = batch * blocks_per_seq
    k_cache = torch.randn(num_blocks, BLOCK, KV_HEADS, HEAD_DIM, dtype=DTYPE, device=DEVICE)
    v_cache = torch.randn_like(k_cache)
    block_tables = torch.randperm(num_blocks, device=DEVICE, dtype=torch.int32).view(
        batch, blocks_per_seq)
    return k_cache, v_cache, block_tables


def decode_case(batch: int, context: int, bandwidth: float) -> dict:
    from jetserve_kernels.attention import paged_attention

    k_cache, v_cache, block_tables = paged_cache(batch, context)
    q = torch.randn(batch, HEADS, HEAD_DIM, dtype=DTYPE, device=DEVICE)
    cu_seqlens = torch.arange(batch + 1, dtype=torch.int32, device=DEVICE)
    seq_lens = torch.full((batch,), context, dtype=torch.int32, device=DEVICE)
    scale = HEAD_DIM ** -0.5
    triton_ms = bench_ms(lambda: paged_attention(
        q, k_cache, v_cache, block_tables, cu_seqlens, seq_lens, scale, max_q_len=1,
        max_seq_len=context), graph=True)

    def torch_baseline():
        keys = k_cache[block_tables.long()].view(batch, context, KV_HEADS, HEAD_DIM)
        values = v_cache[block_tables.long()].view(batch, context, KV_HEADS, HEAD_DIM)
        return torch.nn.functional.scaled_dot_product_attention(
            q[:, :, None], keys.transpose(1, 2), values.transpose(1, 2), scale=scale,
            enable_gqa=True)

    torch_ms = bench_ms(torch_baseline, graph=True)
    moved = 2 * batch * context * KV_HEADS * HEAD_DIM * 2 + 2 * q.numel() * 2
    achieved = moved / (triton_ms / 1e3)
    return {"batch": batch, "context": context, "triton_ms": triton_ms, "torch_ms": torch_ms,
            "speedup": torch_ms / triton_ms, "gb_per_s": achieved / 1e9,
            "fraction_of_copy_bandwidth": achieved / bandwidth}


def prefill_case(chunk: int) -> dict:
    from jetserve_kernels.attention import paged_attention

    context = 2 * chunk  # the chunk comes after as much cached context as it has new tokens
    k_cache, v_cache, block_tables = paged_cache(1, context)
    q = torch.randn(chunk, HEADS, HEAD_DIM, dtype=DTYPE, device=DEVICE)
    cu_seqlens = torch.tensor([0, chunk], dtype=torch.int32, device=DEVICE)
    seq_lens = torch.tensor([context], dtype=torch.int32, device=DEVICE)
    scale = HEAD_DIM ** -0.5
    triton_ms = bench_ms(lambda: paged_attention(
        q, k_cache, v_cache, block_tables, cu_seqlens, seq_lens, scale, max_q_len=chunk,
        max_seq_len=context))
    # The baseline gets contiguous K/V with the heads already repeated (outside the timing), so
    # SDPA can take its memory-efficient kernel with the causal-with-context mask; with
    # enable_gqa and a mask it would fall back to the math path and flatter the kernel.
    group = HEADS // KV_HEADS
    keys = k_cache[block_tables.long()].view(1, context, KV_HEADS, HEAD_DIM).transpose(1, 2)
    values = v_cache[block_tables.long()].view(1, context, KV_HEADS, HEAD_DIM).transpose(1, 2)
    keys = keys.repeat_interleave(group, dim=1).contiguous()
    values = values.repeat_interleave(group, dim=1).contiguous()
    mask = (torch.arange(context, device=DEVICE)[None, :]
            <= (context - chunk + torch.arange(chunk, device=DEVICE))[:, None])
    query = q.transpose(0, 1)[None]
    torch_ms = bench_ms(lambda: torch.nn.functional.scaled_dot_product_attention(
        query, keys, values, attn_mask=mask, scale=scale))
    # Token i attends to context - chunk + i + 1 keys; 2 matmuls of 2 * head_dim FLOPs each.
    attended = chunk * (context - chunk) + chunk * (chunk + 1) / 2
    flops = 4 * HEADS * HEAD_DIM * attended
    return {"chunk": chunk, "context": context, "triton_ms": triton_ms, "torch_ms": torch_ms,
            "speedup": torch_ms / triton_ms, "triton_tflops": flops / (triton_ms / 1e3) / 1e12,
            "torch_tflops": flops / (torch_ms / 1e3) / 1e12}


def small_kernel_cases() -> list[dict]:
    from jetserve_kernels import elementwise, reference

    tokens = TOKENS
    x = torch.randn(tokens, HIDDEN, dtype=DTYPE, device=DEVICE)
    residual = torch.randn_like(x)
    weight = torch.randn(HIDDEN, dtype=DTYPE, device=DEVICE)
    gate_up = torch.randn(tokens, 2 * INTERMEDIATE, dtype=DTYPE, device=DEVICE)
    q = torch.randn(tokens, HEADS, HEAD_DIM, dtype=DTYPE, device=DEVICE)
    k = torch.randn(tokens, KV_HEADS, HEAD_DIM, dtype=DTYPE, device=DEVICE)
    v = torch.randn_like(k)
    positions = torch.arange(tokens, device=DEVICE)
    angles = positions[:, None].float() * (500000.0 ** (
        -torch.arange(0, HEAD_DIM, 2, device=DEVICE) / HEAD_DIM))
    cos_sin = torch.cat([angles.cos(), angles.sin()], -1)
    k_cache = torch.zeros(tokens // BLOCK + 1, BLOCK, KV_HEADS, HEAD_DIM, dtype=DTYPE,
                          device=DEVICE)
    v_cache = torch.zeros_like(k_cache)
    slots = torch.randperm(tokens, device=DEVICE)
    size = 2  # bytes per element
    cases = [
        # reads x and residual, writes the output and the new residual
        ("rms_norm+residual", lambda m: m.rms_norm(x, weight, 1e-5, residual), 4 * x.numel()),
        ("rotary_embedding", lambda m: m.rotary_embedding(positions, q, k, cos_sin),
         2 * (q.numel() + k.numel())),
        ("silu_and_mul", lambda m: m.silu_and_mul(gate_up), 1.5 * gate_up.numel()),
        ("reshape_and_cache", lambda m: m.reshape_and_cache(k, v, k_cache, v_cache, slots),
         4 * k.numel()),
    ]
    results = []
    for name, call, elements in cases:
        triton_ms = bench_ms(lambda call=call: call(elementwise))
        torch_ms = bench_ms(lambda call=call: call(reference))
        results.append({"kernel": name, "tokens": tokens, "triton_ms": triton_ms,
                        "torch_ms": torch_ms, "speedup": torch_ms / triton_ms,
                        "triton_gb_per_s": elements * size / (triton_ms / 1e3) / 1e9})
    return results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--result-json", type=Path, default=Path("results/kernels_bench.json"))
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("jetserve_kernels/bench.py: no CUDA GPU on this machine; the kernel benchmark needs "
              "one (the kernels' correctness tests run on a CPU under TRITON_INTERPRET=1).")
        return 0
    torch.manual_seed(0)
    bandwidth = copy_bandwidth()
    print(f"{torch.cuda.get_device_name()}: device-to-device copy {bandwidth / 1e9:,.0f} GB/s")
    decode = []
    print(f"{'decode':<8}{'batch':>6}{'context':>8}{'triton ms':>11}{'torch ms':>10}"
          f"{'speedup':>9}{'GB/s':>8}{'of copy':>9}")
    for batch in DECODE_BATCHES:
        for context in DECODE_CONTEXTS:
            row = decode_case(batch, context, bandwidth)
            decode.append(row)
            print(f"{'':<8}{batch:>6}{context:>8}{row['triton_ms']:>11.3f}{row['torch_ms']:>10.3f}"
                  f"{row['speedup']:>9.2f}{row['gb_per_s']:>8.0f}"
                  f"{row['fraction_of_copy_bandwidth']:>9.1%}", flush=True)
            torch.cuda.empty_cache()
    prefill = []
    print(f"{'prefill':<8}{'chunk':>6}{'context':>8}{'triton ms':>11}{'torch ms':>10}"
          f"{'speedup':>9}{'TFLOP/s':>9}{'torch':>8}")
    for chunk in PREFILL_CHUNKS:
        row = prefill_case(chunk)
        prefill.append(row)
        print(f"{'':<8}{chunk:>6}{row['context']:>8}{row['triton_ms']:>11.3f}"
              f"{row['torch_ms']:>10.3f}{row['speedup']:>9.2f}{row['triton_tflops']:>9.1f}"
              f"{row['torch_tflops']:>8.1f}", flush=True)
    small = small_kernel_cases()
    for row in small:
        print(f"{row['kernel']:<20}{row['triton_ms']:>10.3f} ms (torch {row['torch_ms']:.3f}, "
              f"{row['speedup']:.2f}x) {row['triton_gb_per_s']:,.0f} GB/s")
    target = next(r for r in decode if r["batch"] == 64 and r["context"] == 4096)
    print(f"decode attention at batch 64, context 4096: "
          f"{target['fraction_of_copy_bandwidth']:.1%} of copy bandwidth (target >= 70%)")
    args.result_json.parent.mkdir(parents=True, exist_ok=True)
    args.result_json.write_text(json.dumps({
        "device": torch.cuda.get_device_name(), "copy_bandwidth_gb_per_s": bandwidth / 1e9,
        "shapes": {"heads": HEADS, "kv_heads": KV_HEADS, "head_dim": HEAD_DIM, "block": BLOCK,
                   "dtype": str(DTYPE)},
        "decode": decode, "prefill": prefill, "elementwise": small,
        "torch": torch.__version__, "python": platform.python_version()}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
