"""The model's matmuls, y = x W^T, over weights kept in the precision they are stored in: dense
(fp32, bf16, fp16), or weight-only int8 / int4 in groups of 32 along the input dimension (the
layout of GGUF's Q8_0, Q4_0 and Q4_1 blocks), run by the CPU kernels in
jetserve_kernels/cpu/linear.cpp. Weights on a CPU are packed once at load into panels of 32 output
columns, the layout the kernel streams (one copy: a tied fp32 embedding table is looked up in the
panels too).

`model.quantization`: `none` keeps dense weights; `int8` / `int4` quantize every matmul at load;
`auto` keeps a GGUF's own blocks (Q4_x stays int4, Q8_0 int8, float stays dense) and is `none`
for other sources. Embedding lookups keep a dense table: they read a few rows per step.

`model.amx`: where the CPU has AMX, `auto` takes it for quantized weights' prefills (torch's
matmul), `tiles` for a bf16 model's matmuls too (the kernels' own AMX-BF16 tiles) and for int8
activations' (AMX-INT8 tiles, from 16 rows, with the VNNI kernel's bits), `none` not at all.

`model.quantized_activations`: quantized weights multiply either fp32 activations (the weights
widened in registers) or 8-bit ones (each row quantized per group of 32 over the group's range as
it enters, then int8 dot products: W8A8 / W4A8, on AVX512-VNNI or, without it, AVX2's 16-bit
multiplies); `auto` takes int8 wherever the kernels have them (AVX512-VNNI or AVX2).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

GROUP = 32
PANEL = 32  # output columns per panel of a packed weight


def many_rows_precision(kernels, amx: str = "auto") -> str:
    """How prefill-sized batches (more than 8 rows) multiply quantized weights: in bfloat16 with
    fp32 sums, on weights that are rounded already, where the CPU makes that fast: "amx" (AMX
    tiles, from 49 rows: several times the fp32 FMAs; not with `model.amx` none), "bf16"
    (AVX512-BF16 dot products: twice them), else "fp32". Decode-sized batches run in fp32 (with
    fp32 activations: int8 activations take the int8 dot products at every size below
    "amx"'s)."""
    if amx != "none" and getattr(torch.cpu, "_is_amx_tile_supported", lambda: False)():
        return "amx"
    return "bf16" if kernels.bf16_dot_products() else "fp32"


_amx_tiles: bool | None = None
_amx_int8_tiles: bool | None = None


def amx_int8_tiles(kernels) -> bool:
    """Whether int8 activations can run on AMX-INT8 tiles here (with `model.amx: tiles`; they
    give the VNNI kernel's bits, so they take only the prefill-sized steps). First run in a child
    process, once a process (amx_probe int8): where it fails, they stay on AVX512-VNNI (said
    once)."""
    global _amx_int8_tiles
    if _amx_int8_tiles is None:
        from services.executor.engine import amx_probe

        _amx_int8_tiles = kernels.amx_int8() and amx_probe.usable("int8")
    return _amx_int8_tiles


def amx_tiles(kernels) -> bool:
    """Whether a bf16 model's matmuls can run on AMX tiles here (where the CPU and its kernel
    give them; they do with `model.amx: tiles`), at every row count: a tile and a vector kernel
    sum in different orders (jetserve_kernels/cpu/amx_tiles.h), so a batch-invariant model
    takes one of them for every step. The tiles' code is run first in a child process, once a
    process (amx_probe): where it fails, the matmuls stay on AVX-512 (said once)."""
    global _amx_tiles
    if _amx_tiles is None:
        from services.executor.engine import amx_probe

        _amx_tiles = kernels.amx_bf16() and amx_probe.usable()
    return _amx_tiles


def int8_activations(setting: str, kernels) -> bool:
    """Whether quantized matmuls take int8 activations, for `model.quantized_activations` (asked
    only where there are quantized weights)."""
    if setting == "int8" and kernels is None:
        raise ValueError("model.quantized_activations: int8 runs on the CPU kernels, which are "
                         "not available here; use auto or float32")
    built = kernels is not None and kernels.int8_dot_products()
    if setting == "int8" and not built:
        raise ValueError("model.quantized_activations: int8 needs AVX512-VNNI or AVX2, which "
                         "this CPU does not have; use auto or float32")
    return built and setting != "float32"


@dataclass
class QuantizedWeight:
    """W [rows, cols] as `bits`-bit integers with an fp32 scale (and for int4 a min) per group:
    w = scale * q (+ min). int8: q int8 [rows, cols]; int4: q uint8 [rows, cols / 2], byte j of
    a group holding weight j in its low nibble and weight j + 16 in its high one."""

    bits: int
    q: torch.Tensor
    scale: torch.Tensor  # [rows, cols / GROUP]
    min: torch.Tensor | None = None  # int4 only

    @property
    def shape(self) -> tuple[int, int]:
        return self.q.shape[0], self.q.shape[1] * (8 // self.bits)

    def dequantize(self) -> torch.Tensor:
        rows, cols = self.shape
        if self.bits == 8:
            q = self.q.float().view(rows, -1, GROUP)
            return (q * self.scale[..., None]).view(rows, cols)
        low, high = (self.q & 0xF).view(rows, -1, GROUP // 2), (self.q >> 4).view(rows, -1, GROUP // 2)
        q = torch.cat((low, high), dim=-1).float()
        return (q * self.scale[..., None] + self.min[..., None]).view(rows, cols)


def quantize(weight: torch.Tensor, bits: int) -> QuantizedWeight:
    """Round-to-nearest per group of 32: int8 symmetric (absmax / 127), int4 asymmetric (the
    group's min and max span 0..15)."""
    rows, cols = weight.shape
    if cols % GROUP:
        raise ValueError(f"cannot quantize a weight of {cols} columns: not a multiple of {GROUP}")
    groups = weight.float().view(rows, cols // GROUP, GROUP)
    if bits == 8:
        scale = groups.abs().amax(-1) / 127
        q = torch.round(groups / scale.clamp(min=1e-12)[..., None]).clamp(-127, 127)
        return QuantizedWeight(8, q.to(torch.int8).view(rows, cols).contiguous(), scale.contiguous())
    if bits != 4:
        raise ValueError(f"quantization to {bits} bits is not supported (8 or 4)")
    low, high = groups.amin(-1), groups.amax(-1)
    scale = (high - low) / 15
    q = torch.round((groups - low[..., None]) / scale.clamp(min=1e-12)[..., None]).clamp(0, 15)
    q = q.to(torch.uint8)
    packed = q[..., :GROUP // 2] | (q[..., GROUP // 2:] << 4)
    return QuantizedWeight(4, packed.view(rows, cols // 2).contiguous(), scale.contiguous(),
                           low.contiguous())


def concat(parts: list[torch.Tensor | QuantizedWeight]) -> torch.Tensor | QuantizedWeight:
    """Weights stacked along their output rows (the fused QKV and gate/up matmuls)."""
    if all(isinstance(p, torch.Tensor) for p in parts):
        return torch.cat(parts)
    if not all(isinstance(p, QuantizedWeight) and p.bits == parts[0].bits for p in parts):
        parts = [p.dequantize() if isinstance(p, QuantizedWeight) else p for p in parts]
        return torch.cat(parts)  # mixed formats (rare in a GGUF): run the fused matmul dense
    return QuantizedWeight(
        parts[0].bits, torch.cat([p.q for p in parts]), torch.cat([p.scale for p in parts]),
        None if parts[0].min is None else torch.cat([p.min for p in parts]))


def pack_panels(weight: torch.Tensor) -> torch.Tensor:
    """W [N, K] as panels [N / PANEL, K, PANEL]: panel j holds output columns j*32 .. j*32+31,
    input by input, so the kernel reads each panel as one stream."""
    n, k = weight.shape
    return weight.reshape(n // PANEL, PANEL, k).transpose(1, 2).contiguous()


def pack_pairs(weight: torch.Tensor) -> torch.Tensor:
    """bf16 W [N, K] as panels of pairs [N / PANEL, K / 2, PANEL, 2]: (w[c, 2t], w[c, 2t + 1])
    side by side, the two halves of one 32-bit lane of a bf16 dot product."""
    n, k = weight.shape
    return weight.reshape(n // PANEL, PANEL, k // 2, 2).transpose(1, 2).contiguous()


@dataclass
class QuantizedPanels:
    """A QuantizedWeight packed for the kernel: q in panels of 32 output columns (int8 [P, K,
    32]; int4 [P, K, 16], byte c holding column c low and c + 16 high), scales and mins [P,
    K / 32, 32]. N is padded to whole panels with zero weights; `n` is the real N."""

    bits: int
    n: int
    q: torch.Tensor
    scale: torch.Tensor
    min: torch.Tensor | None
    sums: torch.Tensor | None = None  # each group's sum of w: int8 activations only

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.q, self.scale, self.min, self.sums)
                   if t is not None)


def pack_quantized(weight: QuantizedWeight) -> QuantizedPanels:
    rows, cols = weight.shape
    panels = -(-rows // PANEL)
    pad = panels * PANEL - rows

    def sideways(t: torch.Tensor) -> torch.Tensor:  # [rows, C] -> [panels, C, PANEL]
        t = F.pad(t, (0, 0, 0, pad))
        return t.view(panels, PANEL, -1).transpose(1, 2).contiguous()

    scale = sideways(weight.scale)
    if weight.bits == 8:
        return QuantizedPanels(8, rows, sideways(weight.q), scale, None)
    half = GROUP // 2  # row-major bytes: weight j of a group low, weight j + 16 high
    low, high = (weight.q & 0xF).view(rows, -1, half), (weight.q >> 4).view(rows, -1, half)
    levels = sideways(torch.cat((low, high), dim=-1).view(rows, cols))  # [panels, K, 32]
    packed = levels[..., :PANEL // 2] | (levels[..., PANEL // 2:] << 4)
    return QuantizedPanels(4, rows, packed.contiguous(), scale, sideways(weight.min))


def pack_for_int8_activations(panels: QuantizedPanels) -> QuantizedPanels:
    """Panels for the int8-activation kernels (linear_w8a8, linear_w4a8, linear.cpp): each
    panel's q in quads of four consecutive k per column, [P, K / 4, C, 4] (C = 32 int8 weights,
    or 16 bytes of int4 nibble pairs), and each group's sum of w in `sums`. An int4 weight's
    levels are read as q - 8 (signed bytes), so its min becomes min + 8 * scale."""
    p, k, c = panels.q.shape
    quads = panels.q.view(p, k // 4, 4, c).transpose(2, 3).contiguous()
    level_sums = torch.empty(p, k // GROUP, PANEL)
    for j in range(0, p, 64):  # a slice of panels at a time: no fp32 copy of a whole weight
        q = panels.q[j:j + 64]
        levels = q.float() if panels.bits == 8 else torch.cat((q & 0xF, q >> 4), dim=-1).float()
        level_sums[j:j + 64] = levels.view(-1, k // GROUP, GROUP, PANEL).sum(2)  # exact integers
    minimum = None if panels.bits == 8 else panels.min + 8 * panels.scale
    sums = panels.scale * level_sums + (0 if panels.min is None else GROUP * panels.min)
    return QuantizedPanels(panels.bits, panels.n, quads, panels.scale, minimum, sums.contiguous())


class DenseLinear:
    def __init__(self, weight: torch.Tensor, kernels, amx: str = "auto"):
        # On a CPU with the kernels the activations are fp32: fp32 weights run on fp32 panels
        # (whole panels of output columns; else torch's matmul), bf16 ones on bf16 panels padded
        # to whole panels (K a multiple of 32; else widened to fp32 here). Elsewhere (CUDA, no
        # kernels) torch's matmul runs on W as it is.
        self.n = weight.shape[0]
        self.many_rows = None
        self.pairs = False
        if kernels is not None and weight.device.type == "cpu" and weight.dtype == torch.bfloat16:
            if weight.shape[1] % GROUP == 0 and kernels.bf16_dot_products():
                # bf16 dot products at every row count (AVX512-BF16, or with `model.amx: tiles`
                # AMX tiles where the CPU has them: amx_tiles), x rounded to bf16: the same bits
                # for a row whether it is decoded alone or recomputed in a prefill, so
                # preemption and migration keep a bf16 model's outputs. (Not AMX through torch's
                # matmul: that rounds its outputs to bf16 and sums in another order.)
                self.pairs = True
                self.kernels = kernels
                self.units = "amx" if amx == "tiles" and amx_tiles(kernels) else "avx512"
                self.weight = pack_pairs(F.pad(weight, (0, 0, 0, -self.n % PANEL)))
                return
            if weight.shape[1] % GROUP == 0:
                # Without AVX512-BF16 (an explicit model.dtype bfloat16): up to 8 rows multiply
                # fp32 x by the widened weights, more as quantized weights do (many_rows: AMX
                # from 49 rows, else fp32). Not batch-invariant.
                self.many_rows = many_rows_precision(kernels, amx)
                self.kernels = kernels
                self.weight = pack_panels(F.pad(weight, (0, 0, 0, -self.n % PANEL)))
                return
            weight = weight.float()
        fits = (kernels is not None and weight.device.type == "cpu"
                and weight.dtype == torch.float32 and self.n % PANEL == 0)
        self.kernels = kernels if fits else None
        self.weight = pack_panels(weight) if fits else weight

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.pairs:
            return self.kernels.linear_bf16_pairs(x, self.weight, self.n, self.units)
        if self.many_rows is not None:
            return self.kernels.linear_bf16(x, self.weight, self.n, self.many_rows)
        if self.kernels is not None:
            return self.kernels.linear_f32(x, self.weight)
        return F.linear(x, self.weight)

    def place(self, arena) -> None:
        """The packed weight moved into `arena` (huge_pages.py); torch's matmul's stays."""
        if self.kernels is not None:
            self.weight = arena.take(self.weight)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` of W (an embedding lookup, for a table tied to the output projection)."""
        if self.pairs:
            return self.weight[ids // PANEL, :, ids % PANEL].flatten(1)
        if self.kernels is not None:
            return self.weight[ids // PANEL, :, ids % PANEL]
        return F.embedding(ids, self.weight)


class QuantizedLinear:
    def __init__(self, weight: QuantizedWeight, kernels, int8_activations: bool = False,
                 amx: str = "auto"):
        if kernels is None:
            raise RuntimeError("int8 and int4 weights run on the CPU kernels, which are not "
                               "available here (see the warning above); set "
                               "model.quantization: none")
        self.weight = pack_quantized(weight)
        self.int8_activations = int8_activations
        if int8_activations:
            self.weight = pack_for_int8_activations(self.weight)
        self.kernels = kernels
        self.many_rows = many_rows_precision(kernels, amx)
        if int8_activations and amx == "tiles" and amx_int8_tiles(kernels):
            self.many_rows = "amx_int8"

    def place(self, arena) -> None:
        """The packed weight moved into `arena` (huge_pages.py)."""
        w = self.weight
        w.q, w.scale, w.min, w.sums = (arena.take(t) for t in (w.q, w.scale, w.min, w.sums))

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        w, k = self.weight, self.kernels
        if self.int8_activations:  # one byte of x (the kernels' second_byte: no setting yet)
            if w.bits == 8:
                return k.linear_w8a8(x, w.q, w.scale, w.sums, w.n, self.many_rows, False)
            return k.linear_w4a8(x, w.q, w.scale, w.min, w.sums, w.n, self.many_rows, False)
        if w.bits == 8:
            return k.linear_int8(x, w.q, w.scale, w.n, self.many_rows)
        return k.linear_int4(x, w.q, w.scale, w.min, w.n, self.many_rows)


def make_linear(weight: torch.Tensor | QuantizedWeight, kernels, int8_activations: bool = False,
                amx: str = "auto") -> DenseLinear | QuantizedLinear:
    """The matmul for a weight; amx is `model.amx` (auto, tiles or none)."""
    if isinstance(weight, QuantizedWeight):
        return QuantizedLinear(weight, kernels, int8_activations, amx)
    return DenseLinear(weight, kernels, amx)
