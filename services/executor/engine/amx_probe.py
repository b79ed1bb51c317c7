"""Whether AMX tiles can run a bf16 model's matmuls here, asked in a child process (`python -m
services.executor.engine.amx_probe`), so that the first run of the tiles' code on a CPU costs
only the child if that CPU or its kernel faults on it. The child multiplies a small matrix on the
tiles at every row count from 1 to 48. Exit status 0: each row came out with the same bits at
every row count (batch-invariant) and within fp32 summation error of the rounded operands; 1: not
so; 2: no AMX-BF16 tiles here. It prints which order of arithmetic the bits are: the Intel SDM's
pseudocode of tdpbf16ps (an even and an odd chain per instruction, the kernels' software model of
the tiles) or the Intrinsics Guide's (one chain, a pair's even product first), or neither. (With
the Guide's, tiles over swapped pairs could give vdpbf16ps's bits; with the SDM's they cannot.)"""

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
        child = subprocess.run([sys.executable or "python3", "-m", __name__],
                               capture_output=True, timeout=120)
    except Exception as exc:  # noqa: BLE001 (cannot start, timed out: no tiles, said)
        log.warning("the AMX probe did not run (%s); a bf16 model's matmuls stay on AVX-512", exc)
        return False
    said = (child.stdout + child.stderr).decode(errors="replace")[-1000:].strip()
    if child.returncode != 0:
        log.warning("the AMX probe exited with %d; a bf16 model's matmuls stay on AVX-512: %s",
                    child.returncode, said)
    else:
        log.info("AMX tiles for a bf16 model's matmuls: %s", said)
    return child.returncode == 0


def main() -> int:
    from jetserve_kernels import cpu_ops, reference
    from services.executor.engine.linear import pack_pairs

    kernels = cpu_ops.load()
    if kernels is None or not kernels.bf16_dot_products() or not kernels.amx_bf16():
        print("no AMX-BF16 tiles here")
        return 2
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(40, 256, generator=gen).bfloat16()  # a part panel: the spill path too
    pairs = pack_pairs(torch.nn.functional.pad(weight, (0, 0, 0, 24)))
    x = torch.randn(48, 256, generator=gen)
    whole = kernels.linear_bf16_pairs(x, pairs, 40, "amx")
    invariant = all(torch.equal(kernels.linear_bf16_pairs(x[:rows], pairs, 40, "amx"),
                                whole[:rows]) for rows in range(1, 48))
    rounded = (x.bfloat16().double() @ weight.double().t()).float()
    close = torch.allclose(whole, rounded, atol=1e-3, rtol=1e-4)
    orders = {"the SDM's": reference.amx_bf16_linear(x, weight),
              "the Intrinsics Guide's": reference.amx_one_chain_linear(x, weight)}
    same = [name for name, bits in orders.items() if torch.equal(whole, bits)]
    print(f"batch-invariant: {invariant}; within fp32 summation error: {close}; order of "
          f"arithmetic: {' and '.join(same) or 'neither the SDM nor the Intrinsics Guide'}")
    return 0 if invariant and close else 1


if __name__ == "__main__":
    raise SystemExit(main())
