"""Whether AMX tiles can run a bf16 model's matmuls here, asked in a child process (`python -m
services.executor.engine.amx_probe`), so that the first run of the tiles' code on a CPU costs
only the child if that CPU or its kernel faults on it. The child multiplies a small matrix on the
tiles at every row count from 1 to 48. Exit status 0: each row came out with the same bits at
every row count (batch-invariant) and within fp32 summation error of the rounded operands; 1: not
so; 2: no AMX-BF16 tiles here. It prints whether the bits are those of the Intel SDM's pseudocode
(the kernels' software model of the tiles)."""

from __future__ import annotations

import logging
import subprocess
import sys

import torch

log = logging.getLogger(__name__)


def usable() -> bool:
    """Whether a child process found the tiles working (False, said once, if it found them
    not, or crashed, or hung for two minutes, or could not start)."""
    try:
        child = subprocess.run([sys.executable, "-m", __name__], capture_output=True, timeout=120)
    except (subprocess.SubprocessError, OSError) as exc:
        log.warning("the AMX probe did not run (%s); a bf16 model's matmuls stay on AVX-512", exc)
        return False
    if child.returncode != 0:
        log.warning("the AMX probe exited with %d; a bf16 model's matmuls stay on AVX-512: %s",
                    child.returncode, (child.stdout + child.stderr).decode()[-1000:])
    return child.returncode == 0


def main() -> int:
    from jetserve_kernels import cpu_ops
    from services.executor.engine.linear import pack_pairs

    kernels = cpu_ops.load()
    if kernels is None or not kernels.bf16_dot_products() or not kernels.amx_bf16():
        print("no AMX-BF16 tiles here")
        return 2
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(64, 256, generator=gen).bfloat16()
    pairs = pack_pairs(weight)
    x = torch.randn(48, 256, generator=gen)
    whole = kernels.linear_bf16_pairs(x, pairs, 64, "amx")
    invariant = all(torch.equal(kernels.linear_bf16_pairs(x[:rows], pairs, 64, "amx"),
                                whole[:rows]) for rows in range(1, 48))
    rounded = (x.bfloat16().double() @ weight.double().t()).float()
    close = torch.allclose(whole, rounded, atol=1e-3, rtol=1e-4)
    sdm = torch.equal(whole, kernels.linear_bf16_pairs(x, pairs, 64, "amx_model"))
    print(f"batch-invariant: {invariant}; within fp32 summation error: {close}; "
          f"the SDM's order of arithmetic, bit for bit: {sdm}")
    return 0 if invariant and close else 1


if __name__ == "__main__":
    raise SystemExit(main())
