"""Whether AMX tiles give a bf16 model's matmuls the bits vdpbf16ps gives them, asked in a child
process (`python -m services.executor.engine.amx_probe`), so that the first run of the tiles' code
on a CPU costs only the child if that CPU or its kernel faults on it. Exit status 0: the same bits
on a small matmul, every row count from one to 48 (partial tiles, one and two tiles of rows);
1: other bits; 2: no AMX-BF16 tiles here."""

from __future__ import annotations

import subprocess
import sys

import torch


def agree() -> bool:
    """Whether a child process found the tiles giving vdpbf16ps's bits (False if it crashed,
    hung for two minutes or found other bits)."""
    try:
        child = subprocess.run([sys.executable, "-m", __name__], capture_output=True, timeout=120)
    except subprocess.TimeoutExpired:
        return False
    return child.returncode == 0


def main() -> int:
    from jetserve_kernels import cpu_ops
    from services.executor.engine.linear import pack_pairs

    kernels = cpu_ops.load()
    if kernels is None or not kernels.bf16_dot_products() or not kernels.amx_bf16():
        return 2
    gen = torch.Generator().manual_seed(0)
    pairs = pack_pairs(torch.randn(64, 256, generator=gen).bfloat16())
    x = torch.randn(48, 256, generator=gen)
    for rows in range(1, 49):
        tiles = kernels.linear_bf16_pairs(x[:rows], pairs, 64, "amx", 0)
        if not torch.equal(tiles, kernels.linear_bf16_pairs(x[:rows], pairs, 64, "avx512", 0)):
            return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
