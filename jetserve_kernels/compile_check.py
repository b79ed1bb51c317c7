"""Compile every kernel ahead of time for a GPU with the real Triton compiler, down to a cubin,
on any machine (no GPU needed): it catches what the CPU interpreter lets through.

    python -m jetserve_kernels.compile_check            # sm_90 (H100/H200)
    python -m jetserve_kernels.compile_check --arch 80  # A100

Each kernel is compiled with the specializations the wrappers launch: Llama-3-8B (32/8 heads,
head dim 128) and SmolLM2 (9/3 heads, head dim 64) shapes, bf16 and fp32, with the alignment
hints the launcher gives (so the software-pipelined variant a GPU runs is the one checked).
"""

from __future__ import annotations

import argparse
import inspect
import os
import sys

PTR_DTYPES = {"bf16": "*bf16", "fp32": "*fp32"}
INDEX_PTRS = {"block_tables_ptr": "*i32", "cu_seqlens_q_ptr": "*i32", "seq_lens_ptr": "*i32",
              "positions_ptr": "*i64", "slot_ptr": "*i64", "partial_out_ptr": "*fp32",
              "partial_lse_ptr": "*fp32", "cos_sin_ptr": "*fp32"}
FLOATS = {"eps", "scale_log2"}


def _signature(fn, dtype: str, constexprs: dict) -> dict[str, str]:
    signature = {}
    for name in inspect.signature(fn.fn).parameters:
        if name in constexprs:
            signature[name] = "constexpr"
        elif name in INDEX_PTRS:
            signature[name] = INDEX_PTRS[name]
        elif name.endswith("_ptr"):
            signature[name] = PTR_DTYPES[dtype]
        else:
            signature[name] = "fp32" if name in FLOATS else "i32"
    return signature


def _alignment_hints(fn) -> dict:
    """What the JIT launcher would tell the compiler at run time: pointers 16-byte aligned and
    strides multiples of 16 (true of every cache and qkv stride here; not of block-table rows)."""
    return {(i,): [["tt.divisibility", 16]]
            for i, name in enumerate(inspect.signature(fn.fn).parameters)
            if name.endswith("_ptr") or (name.startswith("stride_") and name != "stride_bt")}


def specs() -> list[tuple[str, object, str, dict]]:
    from jetserve_kernels import attention, elementwise

    cases = []
    for dtype in ("bf16", "fp32"):
        precision = "tf32" if dtype == "bf16" else "ieee"
        for shape, group, group_pad, head_dim, heads, kv_heads, hidden in (
                ("llama-3-8b", 4, 4, 128, 32, 8, 4096), ("smollm2", 3, 4, 64, 9, 3, 576)):
            for block_m in (64 // group_pad, 16 // group_pad):
                cases.append((f"paged_attention {shape} BLOCK_M={block_m}",
                              attention._paged_attention_kernel, dtype,
                              dict(GROUP=group, GROUP_PAD=group_pad, BLOCK_M=block_m,
                                   HEAD_DIM=head_dim, BLOCK_SIZE=16, BLOCK_N=attention.KEY_TILE,
                                   PRECISION=precision, UPCAST=False)))
            cases.append((f"decode_split {shape}", attention._decode_split_kernel, dtype,
                          dict(GROUP=group, ROWS=16, HEAD_DIM=head_dim, BLOCK_SIZE=16,
                               BLOCK_N=attention.KEY_TILE, PRECISION=precision, UPCAST=False)))
            cases.append((f"decode_merge {shape}", attention._decode_merge_kernel, dtype,
                          dict(HEAD_DIM=head_dim, SPLITS_PAD=32)))
            block = 1 << (hidden - 1).bit_length()
            for residual in (False, True):
                cases.append((f"rms_norm {shape} residual={residual}", elementwise._rms_norm_kernel,
                              dtype, dict(HAS_RESIDUAL=residual, BLOCK=block)))
            cases.append((f"rotary {shape}", elementwise._rotary_kernel, dtype,
                          dict(HALF=head_dim // 2, BLOCK_HEADS=1 << (heads - 1).bit_length())))
            cases.append((f"reshape_and_cache {shape}", elementwise._reshape_and_cache_kernel,
                          dtype, dict(BLOCK_HEADS=1 << (kv_heads - 1).bit_length(),
                                      BLOCK_D=head_dim, GROUP=min(32, head_dim))))
        cases.append(("silu_and_mul", elementwise._silu_and_mul_kernel, dtype, dict(BLOCK=1024)))
    return cases


def compile_all(arch: int) -> list[dict]:
    """Compile every spec for `cuda:sm_<arch>`; one record per kernel (error text on failure)."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        raise RuntimeError("unset TRITON_INTERPRET: the interpreter replaces the compiler")
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    target = GPUTarget("cuda", arch, 32)
    results = []
    for name, fn, dtype, constexprs in specs():
        record = {"kernel": name, "dtype": dtype}
        try:
            compiled = triton.compile(
                ASTSource(fn=fn, signature=_signature(fn, dtype, constexprs), constexprs=constexprs,
                          attrs=_alignment_hints(fn)),
                target=target)
            record.update(ok=True, cubin_bytes=len(compiled.asm["cubin"]),
                          shared_bytes=compiled.metadata.shared,
                          registers=getattr(compiled, "n_regs", None))
        except Exception as exc:  # report every failure, not just the first
            record.update(ok=False, error=f"{type(exc).__name__}: {exc}"[:2000])
        results.append(record)
    return results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--arch", type=int, default=90, help="compute capability, e.g. 90, 80")
    args = parser.parse_args()
    results = compile_all(args.arch)
    for r in results:
        status = (f"ok  cubin {r['cubin_bytes']:>7} B  shared {r['shared_bytes']:>6} B" if r["ok"]
                  else f"FAILED {r['error']}")
        print(f"{r['kernel']:<45}{r['dtype']:<6}{status}")
    failed = sum(not r["ok"] for r in results)
    print(f"sm_{args.arch}: {len(results) - failed}/{len(results)} compiled")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
