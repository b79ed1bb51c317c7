"""Whether AMX tiles can run the kernels' matmuls here, asked in a child process (`python -m
services.executor.engine.amx_probe [bf16|int8]`), so that the first run of the tiles' code on a
CPU costs only the child if that CPU or its kernel faults on it.

bf16 (the default): the child multiplies a small matrix on the AMX-BF16 tiles at every row count
from 1 to 48. Exit status 0: each row came out with the same bits at every row count
(batch-invariant) and within fp32 summation error of the rounded operands; 1: not so; 2: no
AMX-BF16 tiles here. It prints which order of arithmetic the bits are: the Intel SDM's pseudocode
of tdpbf16ps (an even and an odd chain per instruction, the kernels' software model of the tiles)
or the Intrinsics Guide's (one chain, a pair's even product first), or neither. (With the Guide's,
tiles over swapped pairs could give vdpbf16ps's bits; with the SDM's they cannot.)

int8: int8 and int4 weights with int8 activations (W8A8, W4A8, with and without x's second
bytes) on the AMX-INT8 tiles at every row count from 1 to 48, against the AVX512-VNNI kernel:
exit 0 where every output has the VNNI kernel's bits (integer sums are exact in any order, and
the two end each group alike), 1 where one does not, 2 without AMX-INT8 tiles.

Any other argument: exit 3, with the usage."""

from __future__ import annotations

import logging
import subprocess
import sys

import torch

log = logging.getLogger(__name__)


# What each kind of tiles runs, and where its matmuls stay without them.
KINDS = {"bf16": ("a bf16 model's matmuls", "AVX-512"),
         "int8": ("int8 activations' matmuls", "AVX512-VNNI")}


def usable(kind: str = "bf16") -> bool:
    """Whether a child process found the tiles of `kind` (bf16, int8) working (False, said once,
    if it found them not, or crashed, or hung for two minutes, or could not start)."""
    what, instead = KINDS[kind]
    try:
        child = subprocess.run([sys.executable or "python3", "-m", __name__, kind],
                               capture_output=True, timeout=120)
    except Exception as exc:  # noqa: BLE001 (cannot start, timed out: no tiles, said)
        log.warning("the AMX probe did not run (%s); %s stay on %s", exc, what, instead)
        return False
    said = (child.stdout + child.stderr).decode(errors="replace")[-1000:].strip()
    if child.returncode != 0:
        log.warning("the AMX probe exited with %d; %s stay on %s: %s", child.returncode, what,
                    instead, said)
    else:
        log.info("AMX tiles for %s: %s", what, said)
    return child.returncode == 0


def int8_tiles(kernels) -> int:
    """The int8 probe: W8A8 and W4A8 on the tiles against the VNNI kernel, every row count."""
    from services.executor.engine.linear import (pack_for_int8_activations, pack_quantized,
                                                 quantize)

    if kernels is None or not kernels.amx_int8():
        print("no AMX-INT8 tiles here")
        return 2
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(48, 256, generator=gen)
    differ = []
    for bits in (8, 4):
        w = pack_for_int8_activations(pack_quantized(quantize(
            torch.randn(40, 256, generator=gen), bits)))  # 40 columns: a part panel too
        for second_byte in (False, True):
            def linear(x, many_rows):
                if bits == 8:
                    return kernels.linear_w8a8(x, w.q, w.scale, w.sums, w.n, many_rows,
                                               second_byte)
                return kernels.linear_w4a8(x, w.q, w.scale, w.min, w.sums, w.n, many_rows,
                                           second_byte)
            vnni = linear(x, "fp32")
            for rows in range(1, 49):
                if not torch.equal(linear(x[:rows], "amx_int8").view(torch.int32),
                                   vnni[:rows].view(torch.int32)):
                    differ.append(f"w{bits}a8{'x2' if second_byte else ''} at {rows} rows")
    print(f"the VNNI kernel's bits at every row count: {not differ}"
          + (f" (not: {', '.join(differ[:6])})" if differ else ""))
    return 1 if differ else 0


def main(argv: list[str] | None = None) -> int:
    from jetserve_kernels import cpu_ops, reference
    from services.executor.engine.linear import pack_pairs

    kind = (sys.argv[1:] if argv is None else argv) or ["bf16"]
    if len(kind) != 1 or kind[0] not in KINDS:
        print("usage: python -m services.executor.engine.amx_probe [bf16|int8]")
        return 3
    kernels = cpu_ops.load()
    if kind[0] == "int8":
        return int8_tiles(kernels)
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
