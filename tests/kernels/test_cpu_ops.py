"""The C++ CPU kernels against torch: matmuls over packed fp32, int8 and int4 weights on each of
their paths (one row; register tiles of 2 to 12 rows; many rows over a dequantized scratch
panel; bfloat16 BLAS; int8 activations), paged decode and prefill attention, the fused
element-wise ops, and the build's handling of a killed build and of a missing compiler."""

from __future__ import annotations

import os
import subprocess
import threading
from fractions import Fraction

import pytest
import torch

from jetserve_kernels import cpu_ops, kv_int8, reference
from services.executor.engine.linear import (int8_activations, pack_for_int8_activations,
                                             pack_panels, pack_quantized, quantize)

pytestmark = pytest.mark.skipif(cpu_ops.load() is None, reason="the CPU kernels did not build")


@pytest.fixture(scope="module")
def k():
    return cpu_ops.load()


def quantized_linear(k, weight, x, many_rows="fp32"):
    """x W^T through the kernel for W's packed panels (a QuantizedWeight)."""
    w = pack_quantized(weight)
    if w.bits == 8:
        return k.linear_int8(x, w.q, w.scale, w.n, many_rows)
    return k.linear_int4(x, w.q, w.scale, w.min, w.n, many_rows)


# Rows: one (its own loop), 2 (on AVX2 the most that dequantize in registers), 3 and 8
# (registers on AVX-512; AVX2's tiles over a scratch panel), 9 and 70 (tiles over a scratch
# panel; "amx" is BLAS at 70), 200 (blocks of 72, 72 and 56 rows on AVX-512; 67, 67, 66 on AVX2). Shapes: N short of a panel (7), last panels
# of 13 and 27 columns (45, 59: on AVX2, a vector and a part one; a half panel and a part one),
# past whole panels (261), SmolLM2's down projection.
@pytest.mark.parametrize("rows", [1, 2, 3, 8, 9, 70, 200])
@pytest.mark.parametrize("shape", [(7, 64), (45, 64), (59, 32), (261, 96), (576, 1536)])
def test_linear_matches_torch_on_every_format(k, rows, shape):
    gen = torch.Generator().manual_seed(rows)
    weight = torch.randn(shape, generator=gen)
    x = torch.randn(rows, shape[1], generator=gen)
    q8, q4 = quantize(weight, 8), quantize(weight, 4)
    expected8, expected4 = x @ q8.dequantize().t(), x @ q4.dequantize().t()
    torch.testing.assert_close(quantized_linear(k, q8, x), expected8, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(quantized_linear(k, q4, x), expected4, atol=1e-4, rtol=1e-4)
    # In bfloat16: inputs rounded to 8 bits of mantissa, fp32 sums; exact where the rows are few.
    bf16 = dict(atol=0.05 * shape[1] ** 0.5, rtol=0.02) if rows > 8 else dict(atol=1e-4, rtol=1e-4)
    for many_rows in ["amx"] + (["bf16"] if k.bf16_dot_products() else []):
        torch.testing.assert_close(quantized_linear(k, q8, x, many_rows), expected8, **bf16)
        torch.testing.assert_close(quantized_linear(k, q4, x, many_rows), expected4, **bf16)


@pytest.mark.parametrize("rows", [1, 2, 3, 8, 9, 70, 200])
@pytest.mark.parametrize("shape", [(7, 64), (261, 96), (576, 1536)])
def test_linear_over_bf16_panels(k, rows, shape):
    """bf16 weights (model.dtype bfloat16), fp32 x: up to 8 rows the weights are widened and the
    products fp32 (exact to summation order); past that, x too is rounded where many_rows says."""
    gen = torch.Generator().manual_seed(rows + shape[0])
    weight = torch.randn(shape, generator=gen).bfloat16()
    x = torch.randn(rows, shape[1], generator=gen)
    n = shape[0]  # padded to whole panels, as DenseLinear packs it; n the real columns
    panels = pack_panels(torch.nn.functional.pad(weight, (0, 0, 0, -n % 32)))
    expected = x @ weight.float().t()
    exact = dict(atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(k.linear_bf16(x, panels, n, "fp32"), expected, **exact)
    rounded = dict(atol=0.05 * shape[1] ** 0.5, rtol=0.02) if rows > 8 else exact
    for many_rows in ["amx"] + (["bf16"] if k.bf16_dot_products() else []):
        torch.testing.assert_close(k.linear_bf16(x, panels, n, many_rows), expected, **rounded)
    with pytest.raises(RuntimeError, match="K must be a multiple of 32"):
        k.linear_bf16(torch.randn(2, 48), pack_panels(torch.randn(32, 48).bfloat16()), 32, "fp32")


def test_bf16_dot_products_in_blocks_equal_one_block(k):
    """Past 4 MB of x as bf16 pairs (here 1,100 rows of K = 4096: three blocks), the rows are
    taken a block at a time; every row sums in the same order whatever its block, so the result
    is bit-identical to the rows taken 100 at a time (one block each)."""
    if not k.bf16_dot_products():
        pytest.skip("the kernels built here have no AVX512-BF16 dot products")
    gen = torch.Generator().manual_seed(1)
    weight = torch.randn(40, 4096, generator=gen).bfloat16()
    panels = pack_panels(torch.nn.functional.pad(weight, (0, 0, 0, -40 % 32)))
    x = torch.randn(1100, 4096, generator=gen)
    whole = k.linear_bf16(x, panels, 40, "bf16")
    assert torch.equal(whole, torch.cat([k.linear_bf16(x[i:i + 100], panels, 40, "bf16")
                                         for i in range(0, 1100, 100)]))
    rounded = (x.bfloat16().double() @ weight.double().t()).float()
    torch.testing.assert_close(whole, rounded, atol=1e-3, rtol=1e-4)


def test_bf16_dot_products_round_only_the_inputs(k):
    """The bf16 path's error is the rounding of x and w to bfloat16, nothing more: its result
    equals an fp64 product of the rounded operands to fp32 summation error."""
    if not k.bf16_dot_products():
        pytest.skip("the kernels built here have no AVX512-BF16 dot products")
    gen = torch.Generator().manual_seed(0)
    # int8: w = scale * q rounds once in both (int4's scale * q + min is one FMA in the kernel,
    # two roundings in torch, and then a weight can round to a neighbouring bfloat16).
    weight = quantize(torch.randn(64, 256, generator=gen), 8)
    x = torch.randn(20, 256, generator=gen)
    rounded = (x.bfloat16().double() @ weight.dequantize().bfloat16().double().t()).float()
    torch.testing.assert_close(quantized_linear(k, weight, x, "bf16"), rounded, atol=1e-4, rtol=1e-4)
    with pytest.raises(RuntimeError, match="many_rows must be"):
        quantized_linear(k, weight, x, "fp16")


@pytest.mark.parametrize("shape", [(576, 1536), (40, 96), (49153, 64)])
def test_bf16_pairs_give_a_row_the_same_bits_at_every_row_count(k, shape):
    """A bf16 model's weights as pairs (DenseLinear on a CPU with AVX512-BF16): every row count,
    one decode or a 300-row prefill, takes the same dot products, so each row's outputs are
    bit-identical however the rows are split; and the error is the rounding of x and w to bf16."""
    if not k.bf16_dot_products():
        pytest.skip("the kernels built here have no AVX512-BF16 dot products")
    from services.executor.engine.linear import DenseLinear

    gen = torch.Generator().manual_seed(shape[0])
    weight = (0.05 * torch.randn(shape, generator=gen)).bfloat16()
    linear = DenseLinear(weight, k)
    assert linear.pairs
    x = torch.randn(300, shape[1], generator=gen)
    whole = linear(x)
    assert torch.equal(whole[:20], torch.cat([linear(x[i:i + 1]) for i in range(20)]))
    assert torch.equal(whole, torch.cat([linear(x[:3]), linear(x[3:11]), linear(x[11:])]))
    rounded = (x.bfloat16().double() @ weight.double().t()).float()
    torch.testing.assert_close(whole, rounded, atol=1e-4, rtol=1e-4)
    ids = torch.tensor([0, 1, 31, 32, shape[0] - 1])
    assert torch.equal(linear.rows(ids), weight[ids])  # a tied embedding's lookup
    with pytest.raises(RuntimeError, match="x has 8 columns"):
        linear(torch.randn(2, 8))


def test_bf16_dot_products_give_the_same_bits_in_either_layout_of_x(k):
    """From 96 rows the kernels lay x out tile by tile for bf16 dot products, below it row by
    row: a row's outputs are the same bits either way, for a bf16 model's pairs and for quantized
    weights multiplied in bf16, with x contiguous or a view of a wider tensor, at row counts on
    either side of the switch and splits of uneven tiles."""
    if not k.bf16_dot_products():
        pytest.skip("the kernels built here have no AVX512-BF16 dot products")
    from services.executor.engine.linear import DenseLinear

    gen = torch.Generator().manual_seed(96)
    weight = (0.05 * torch.randn(72, 320, generator=gen)).bfloat16()  # a part panel: 72 = 2*32 + 8
    linear = DenseLinear(weight, k)
    assert linear.pairs
    quantized = quantize(torch.randn(72, 320, generator=gen), 8)
    wide = torch.randn(131, 400, generator=gen)
    for x in (wide[:, :320].contiguous(), wide[:, 40:360]):  # contiguous, and strided rows
        for rows in (95, 96, 97, 131):
            whole = linear(x[:rows])
            # In pieces of fewer than 96 rows (row by row), one row alone, and the rest.
            pieces = torch.cat([linear(x[:1]), linear(x[1:rows // 2]), linear(x[rows // 2:rows])])
            assert torch.equal(whole, pieces), rows
            # Quantized weights in bf16 (past 8 rows): the same bits as pieces of 9 to 95 rows.
            many = quantized_linear(k, quantized, x[:rows], "bf16")
            split = torch.cat([quantized_linear(k, quantized, x[:rows // 2], "bf16"),
                               quantized_linear(k, quantized, x[rows // 2:rows], "bf16")])
            assert torch.equal(many, split), rows


# Rows: within one 16-row tile, exactly one, two tiles, a pair and a half; N: a part panel.
@pytest.mark.parametrize("shape", [(40, 96), (64, 576)])
def test_bf16_pairs_on_vectors_and_on_amx_tiles(k, shape):
    """A bf16 model's matmuls (linear_bf16_pairs) give, at every row count, the bits of their
    instruction's order of arithmetic as the Intel SDM writes it: vdpbf16ps's on AVX-512
    (reference.bf16_pairs_linear), and tdpbf16ps's on AMX tiles, whose tiling runs here on a
    software model of the instructions (amx_tiles.h; reference.amx_bf16_linear), partial tiles
    and a part panel included. Where the CPU has AMX, the instructions give a row the same bits
    at every row count, within fp32 summation error of the rounded operands."""
    if not k.bf16_dot_products():
        pytest.skip("the kernels built here have no AVX512-BF16 dot products")
    from services.executor.engine.linear import pack_pairs

    gen = torch.Generator().manual_seed(shape[0])
    weight = (0.05 * torch.randn(shape, generator=gen)).bfloat16()
    pairs = pack_pairs(torch.nn.functional.pad(weight, (0, 0, 0, -shape[0] % 32)))
    x = torch.randn(50, shape[1], generator=gen)
    for rows in [1, 7, 16, 17, 32, 50]:
        assert torch.equal(k.linear_bf16_pairs(x[:rows], pairs, shape[0], "avx512"),
                           reference.bf16_pairs_linear(x[:rows], weight)), rows
        assert torch.equal(k.linear_bf16_pairs(x[:rows], pairs, shape[0], "amx_model"),
                           reference.amx_bf16_linear(x[:rows], weight)), rows
    if k.amx_bf16():
        tiles = k.linear_bf16_pairs(x, pairs, shape[0], "amx")
        assert torch.equal(tiles[:20], torch.cat([k.linear_bf16_pairs(x[i:i + 1], pairs,
                                                                      shape[0], "amx")
                                                  for i in range(20)]))
        rounded = (x.bfloat16().double() @ weight.double().t()).float()
        torch.testing.assert_close(tiles, rounded, atol=1e-4, rtol=1e-4)
    else:
        with pytest.raises(RuntimeError, match="no AMX-BF16 tiles"):
            k.linear_bf16_pairs(x, pairs, shape[0], "amx")
    with pytest.raises(RuntimeError, match="units must be avx512, amx or amx_model"):
        k.linear_bf16_pairs(x, pairs, shape[0], "tiles")


def int8_activation_linear(k, weight, x, many_rows="fp32", second_byte=False):
    """x W^T through the int8-activation kernel (W8A8 or W4A8) for W (a QuantizedWeight)."""
    w = pack_for_int8_activations(pack_quantized(weight))
    if w.bits == 8:
        return k.linear_w8a8(x, w.q, w.scale, w.sums, w.n, many_rows, second_byte)
    return k.linear_w4a8(x, w.q, w.scale, w.min, w.sums, w.n, many_rows, second_byte)


def eight_bits_per_group(x):
    """x quantized per row and group of 32 as the kernel does (the group's range in 255 steps
    from its min, round to nearest), and back: what the int8 dot products multiply."""
    groups = x.view(x.shape[0], -1, 32)
    low, high = groups.amin(-1, keepdim=True), groups.amax(-1, keepdim=True)
    u = torch.round((groups - low) * (255 / (high - low).clamp(min=1e-30))).clamp(0, 255)
    return (u * (high - low) / 255 + low).view_as(x)


int8_dots = pytest.mark.skipif(not (cpu_ops.load() and cpu_ops.load().int8_dot_products()),
                               reason="the kernels built here have no int8 dot products "
                                      "(AVX512-VNNI or AVX2)")


# Rows: one, tiles of up to 6 (7 = 3 + 4, 13 = 4 + 4 + 5; with the second byte up to 4: 6 = 3 +
# 3, 13 = 3 + 3 + 3 + 4; AVX2: tiles of 2 or 1, int4 panels widened first past 8 rows), 70
# ("amx" is BLAS there), 200 (row blocks 72 + 72 + 56). Shapes as above, and 53 columns: a last
# panel of 21, so AVX2's second half-panel tile has 5.
@int8_dots
@pytest.mark.parametrize("rows", [1, 2, 6, 7, 13, 70, 200])
@pytest.mark.parametrize("shape", [(7, 64), (53, 64), (261, 96), (576, 1536)])
def test_int8_activations_multiply_the_quantized_rows(k, rows, shape):
    """W8A8 / W4A8 equal the product of x quantized per group of 32 and the dequantized weight:
    to fp32 rounding where every x is within 0.3 of a step of one of its group's levels (so it
    rounds to that level), and within a level of x per element for random x, where a value at a
    half step may round either way."""
    gen = torch.Generator().manual_seed(rows + shape[0])
    weight = torch.randn(shape, generator=gen)
    groups = (rows, shape[1] // 32)
    levels = torch.randint(0, 256, (*groups, 32), generator=gen).float()
    levels[..., 0], levels[..., 1] = 0, 255  # each group's range 255 steps of a power of two
    step = 2.0 ** torch.randint(-8, 3, (*groups, 1), generator=gen)
    offset = torch.randint(-300, 100, (*groups, 1), generator=gen).float()
    exact_x = ((levels + offset) * step).view(rows, shape[1])
    exact_x[0, :32] = 0.75  # a constant group: scale 0, exact
    # Off the levels by 0.3 of a step either way (not the min and max that set the range):
    # rounding, not truncation, takes each back to its level.
    jitter = 0.3 * torch.randint(0, 2, (*groups, 32), generator=gen).float().mul(2).sub(1)
    jitter = torch.where(levels == 0, 0.3, torch.where(levels == 255, -0.3, jitter))  # inside
    jitter[..., :2] = 0
    jittered_x = ((levels + offset + jitter) * step).view(rows, shape[1])
    jittered_x[0, :32] = 0.75
    x = torch.randn(rows, shape[1], generator=gen)
    x[-1, 32:64] = -2.5
    for bits in (8, 4):
        q = quantize(weight, bits)
        if bits == 8:  # -128, which a GGUF's Q8_0 blocks may hold (quantize() stops at -127)
            q.q.view(-1)[::37] = -128
        w = q.dequantize()
        exact = exact_x @ w.t()
        torch.testing.assert_close(int8_activation_linear(k, q, exact_x), exact,
                                   atol=1e-5 * exact.abs().max(), rtol=1e-4)
        torch.testing.assert_close(int8_activation_linear(k, q, jittered_x), exact,
                                   atol=1e-5 * exact.abs().max(), rtol=1e-4)
        # Rows with a stride, as the model's views have.
        wide = torch.nn.functional.pad(jittered_x, (0, 40))
        torch.testing.assert_close(int8_activation_linear(k, q, wide[:, :shape[1]]), exact,
                                   atol=1e-5 * exact.abs().max(), rtol=1e-4)
        level = x.view(rows, -1, 32)
        level = ((level.amax(-1) - level.amin(-1)) / 255).amax()  # the largest step of x
        torch.testing.assert_close(int8_activation_linear(k, q, x), eight_bits_per_group(x) @ w.t(),
                                   atol=3 * level * w.abs().max() + 1e-4, rtol=1e-4)
        # With the remainder in a second byte: exact where x is a level and a sub-level (x = low +
        # (254 level + sub) 2^e, |sub| <= 120: u = level, v = sub + 128, both exact), and within
        # 1/254 of a step of x per element for random x.
        sub = torch.randint(-120, 121, (*groups, 32), generator=gen).float()
        sub[..., :2] = 0
        two_byte_x = ((254 * levels + sub + offset) * step).view(rows, shape[1])
        two_byte = two_byte_x @ w.t()
        torch.testing.assert_close(int8_activation_linear(k, q, two_byte_x, second_byte=True),
                                   two_byte, atol=1e-5 * two_byte.abs().max(), rtol=1e-4)
        fine = level / 254
        for exact_or_not, expected, atol in ((exact_x, exact, 1e-5 * exact.abs().max()),
                                             (x, x @ w.t(), fine * w.abs().sum(1).max() + 1e-4)):
            torch.testing.assert_close(int8_activation_linear(k, q, exact_or_not, second_byte=True),
                                       expected, atol=atol, rtol=1e-4)
        # "amx" from 49 rows: torch's bf16 matmul on the weights dequantized from their quads.
        if rows >= 49:
            torch.testing.assert_close(int8_activation_linear(k, q, x, "amx"), x @ w.t(),
                                       atol=0.05 * shape[1] ** 0.5, rtol=0.02)


@int8_dots
def test_int8_activations_name_what_they_refuse(k):
    q = pack_for_int8_activations(pack_quantized(quantize(torch.randn(32, 64), 8)))
    with pytest.raises(RuntimeError, match="int8 quads"):
        k.linear_w8a8(torch.randn(2, 64), q.q.view(torch.uint8), q.scale, q.sums, 32, "fp32",
                      False)
    with pytest.raises(RuntimeError, match="x has 32 columns, the weight 64"):
        k.linear_w8a8(torch.randn(2, 32), q.q, q.scale, q.sums, 32, "fp32", False)
    with pytest.raises(RuntimeError, match="linear_w8a8 sums: one fp32 value per 32 weights"):
        k.linear_w8a8(torch.randn(2, 64), q.q, q.scale, q.sums[:, :1], 32, "fp32", False)
    with pytest.raises(RuntimeError, match="uint8 quads"):
        k.linear_w4a8(torch.randn(2, 64), q.q, q.scale, q.scale, q.sums, 32, "fp32", False)
    # A NaN in x comes out as NaN (min and max would pass it over), only in its own row: for
    # a decode's rows and a prefill's (12: AVX2 widens int4 panels first), both formats.
    q4 = pack_for_int8_activations(pack_quantized(quantize(torch.randn(32, 64), 4)))
    for rows in (3, 12):
        x = torch.randn(rows, 64)
        x[1, 5] = float("nan")
        others = [r for r in range(rows) if r != 1]
        for second_byte in (False, True):
            y8 = k.linear_w8a8(x, q.q, q.scale, q.sums, 32, "fp32", second_byte)
            y4 = k.linear_w4a8(x, q4.q, q4.scale, q4.min, q4.sums, 32, "fp32", second_byte)
            for y in (y8, y4):
                assert y[1].isnan().all() and not y[others].isnan().any()


# Rows: one, within a 16-row tile, one and two whole ones, past 32 (a second step of tiles), row
# blocks (200 = 72 + 72 + 56). Shapes: a part panel of 21 columns; SmolLM2's K of 576.
@int8_dots
@pytest.mark.parametrize("shape", [(53, 64), (96, 576)])
def test_int8_activations_on_amx_int8_tiles_give_the_vector_bits(k, shape):
    """W8A8 and W4A8 on AMX-INT8 tiles (tdpbusd: exact int32 sums, each group then ended as the
    VNNI tile ends it) give the AVX512-VNNI kernel's bits at every row count, with and without
    x's second bytes, a NaN's row included: their tiling runs here on the software model of the
    instructions (amx_tiles.h), and where the CPU has AMX-INT8 on the tiles themselves. A build
    without VNNI (AVX2, or AVX-512 without it) refuses both by name."""
    gen = torch.Generator().manual_seed(shape[0])
    x = torch.randn(200, shape[1], generator=gen)
    x[3, 7] = float("nan")
    x[5, :32] = 0.75  # a constant group
    for bits in (8, 4):
        w = pack_for_int8_activations(pack_quantized(quantize(
            0.05 * torch.randn(shape, generator=gen), bits)))
        for second_byte in (False, True):
            def linear(x, many_rows):
                if bits == 8:
                    return k.linear_w8a8(x, w.q, w.scale, w.sums, w.n, many_rows, second_byte)
                return k.linear_w4a8(x, w.q, w.scale, w.min, w.sums, w.n, many_rows, second_byte)
            try:
                linear(x[:1], "amx_int8_model")
            except RuntimeError as error:  # no VNNI here: refused by name, both
                assert "or amx on this build, not amx_int8_model" in str(error)
                with pytest.raises(RuntimeError, match="or amx on this build, not amx_int8"):
                    linear(x[:1], "amx_int8")
                return
            for rows in (1, 7, 16, 17, 32, 33, 50, 200):
                vector = linear(x[:rows], "fp32").view(torch.int32)
                assert torch.equal(linear(x[:rows], "amx_int8_model").view(torch.int32),
                                   vector), (bits, second_byte, rows)
                if k.amx_int8():
                    assert torch.equal(linear(x[:rows], "amx_int8").view(torch.int32),
                                       vector), (bits, second_byte, rows)
            if not k.amx_int8():
                with pytest.raises(RuntimeError, match="no AMX-INT8 tiles"):
                    linear(x[:20], "amx_int8")
    plain = pack_quantized(quantize(torch.randn(32, shape[1]), 8))  # fp32 activations: not there
    with pytest.raises(RuntimeError, match="many_rows must be fp32(, bf16)? or amx on this build"):
        k.linear_int8(x[:2], plain.q, plain.scale, plain.n, "amx_int8_model")


def test_int8_activations_are_chosen_where_they_can_run(k):
    assert int8_activations("auto", k) == k.int8_dot_products()
    assert not int8_activations("float32", k) and not int8_activations("auto", None)
    with pytest.raises(ValueError, match="model.quantized_activations: int8 runs on the CPU kern"):
        int8_activations("int8", None)  # no kernels (or no VNNI): refused by name, at load


# Every register-tile height (1 .. 12), uneven splits past 12 (13 = 6 + 7), prefill sizes, and
# row blocks (200 = 72 + 72 + 56; an AVX2 build: 67 + 67 + 66). Shapes: fp32 panels are whole
# (DenseLinear leaves other N to torch); an odd K; SmolLM2's down projection. (Part panels are
# the quantized formats', above.)
@pytest.mark.parametrize("rows", list(range(1, 14)) + [25, 70, 200])
@pytest.mark.parametrize("shape", [(32, 64), (96, 40), (64, 33), (32, 7), (576, 1536)])
def test_packed_fp32_linear_matches_torch(k, rows, shape):
    gen = torch.Generator().manual_seed(rows)
    weight = torch.randn(shape, generator=gen)
    x = torch.randn(rows, shape[1], generator=gen)
    torch.testing.assert_close(k.linear_f32(x, pack_panels(weight)), x @ weight.t(),
                               atol=1e-4, rtol=1e-4)


def test_linear_on_one_thread(k):
    """One thread owns every panel, so each panel's tiles ask for shares of the next one (on
    two threads a weight of a few panels may never get there): fp32 with K even and odd, int8
    and int4 past a panel's 32 columns, at the row counts of each kind of tile."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        gen = torch.Generator().manual_seed(7)
        for shape in [(96, 40), (64, 33)]:
            weight = torch.randn(shape, generator=gen)
            for rows in (1, 2, 3, 13, 25):
                x = torch.randn(rows, shape[1], generator=gen)
                torch.testing.assert_close(k.linear_f32(x, pack_panels(weight)), x @ weight.t(),
                                           atol=1e-4, rtol=1e-4)
        weight = torch.randn(261, 96, generator=gen)
        for rows in (1, 2, 3, 9, 13):
            x = torch.randn(rows, 96, generator=gen)
            for bits in (8, 4):
                q = quantize(weight, bits)
                torch.testing.assert_close(quantized_linear(k, q, x), x @ q.dequantize().t(),
                                           atol=1e-4, rtol=1e-4)
    finally:
        torch.set_num_threads(threads)


def test_linear_reads_strided_rows_and_rejects_bad_shapes(k):
    weight = torch.randn(32, 64)
    q8 = quantize(weight, 8)
    for rows in (20, 3, 2):  # the prefill tiles and the decode ones (AVX2: 2 in registers)
        x = torch.randn(rows, 200)[:, :64]  # rows with a stride, as the model's views have
        torch.testing.assert_close(k.linear_f32(x, pack_panels(weight)), x @ weight.t(),
                                   atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(quantized_linear(k, q8, x), x @ q8.dequantize().t(),
                                   atol=1e-5, rtol=1e-5)
    with pytest.raises(RuntimeError, match="x has 64 columns, the weight 32"):
        k.linear_f32(x, pack_panels(torch.randn(32, 32)))
    with pytest.raises(RuntimeError, match="fp32 panels"):
        k.linear_f32(x, torch.randn(10, 64))
    with pytest.raises(RuntimeError, match="multiple of 32"):
        k.linear_int8(torch.randn(2, 48), torch.zeros(1, 48, 32, dtype=torch.int8),
                      torch.ones(1, 1, 32), 32, "fp32")


def test_quantization_error_is_bounded_per_group():
    weight = torch.randn(64, 256)
    groups = weight.view(64, -1, 32)
    for bits, levels in ((8, 254), (4, 15)):
        error = (quantize(weight, bits).dequantize() - weight).abs().view(64, -1, 32)
        span = groups.abs().amax(-1) * 2 if bits == 8 else groups.amax(-1) - groups.amin(-1)
        # Round to nearest: at most half a step, a step being the group's span over its levels.
        assert (error.amax(-1) <= span / levels / 2 * 1.001 + 1e-6).all()


def test_rms_norm_with_and_without_residual(k):
    x, residual, weight = torch.randn(5, 96), torch.randn(5, 96), torch.randn(96)
    expected, expected_residual = reference.rms_norm(x, weight, 1e-5, residual.clone())
    out = k.rms_norm(x, residual, weight, 1e-5)  # adds x into residual in place
    torch.testing.assert_close(out, expected)
    torch.testing.assert_close(residual, expected_residual)
    torch.testing.assert_close(k.rms_norm(x, None, weight, 1e-5), reference.rms_norm(x, weight, 1e-5))


def test_silu_and_mul(k):
    x = torch.randn(6, 2 * 80)
    torch.testing.assert_close(k.silu_and_mul(x), reference.silu_and_mul(x))


@pytest.mark.parametrize("kv", ["fp32", "bf16", "int8"])
def test_rotary_and_cache_matches_rotary_then_cache_write(k, kv):
    heads, kv_heads, dim, block = 4, 2, 16, 8
    tokens = 5
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * dim)
    positions = torch.tensor([0, 3, 9, 10, 31])
    slots = torch.tensor([5, 17, 2, 30, 8])
    cos_sin = torch.randn(64, dim)
    int8 = kv == "int8"
    shape, dtype = ((4, block, kv_heads, kv_int8.row_bytes(dim)), torch.int8) if int8 else \
        ((4, block, kv_heads, dim), torch.bfloat16 if kv == "bf16" else torch.float32)
    caches = [torch.zeros(shape, dtype=dtype) for _ in range(4)]
    expected = qkv.clone()
    q = expected[:, :heads * dim].view(tokens, heads, dim)
    key = expected[:, heads * dim:(heads + kv_heads) * dim].view(tokens, kv_heads, dim)
    value = expected[:, (heads + kv_heads) * dim:].view(tokens, kv_heads, dim)
    reference.rotary_embedding(positions, q, key, cos_sin)
    reference.reshape_and_cache(key, value, caches[0], caches[1], slots)
    k.rotary_and_cache(qkv, positions, cos_sin, caches[2], caches[3], slots, heads, kv_heads,
                       None, None)
    torch.testing.assert_close(qkv, expected)
    if not int8:  # bf16: both round to nearest, from fp32 that may differ in the last bit
        torch.testing.assert_close(caches[2], caches[0])
        torch.testing.assert_close(caches[3], caches[1])
        return
    # Compiled with -ffast-math, the kernel's arithmetic may differ in the last bit: a scale may
    # round to the neighbouring fp16, and a value on a rounding boundary land one step apart.
    for ours, theirs in ((caches[2], caches[0]), (caches[3], caches[1])):
        torch.testing.assert_close(ours[..., dim:].contiguous().view(torch.float16).float(),
                                   theirs[..., dim:].contiguous().view(torch.float16).float(),
                                   rtol=2 ** -10, atol=0)
        steps = (ours[..., :dim].int() - theirs[..., :dim].int()).abs()
        assert steps.max() <= 1 and (steps > 0).float().mean() < 0.02
        assert ours[..., :dim].abs().max() == 127


# pybind11 alone (torch ships it): the build logic is what is tested, and torch/extension.h
# would take half a minute to compile.
TINY_SOURCE = """
#include <cstdint>
#include <pybind11/pybind11.h>
int64_t answer() { return 42; }
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("answer", &answer); }
"""


@pytest.mark.slow
def test_build_survives_the_lock_of_a_killed_build_and_is_reused(tmp_path, monkeypatch):
    source = tmp_path / "tiny.cpp"
    source.write_text(TINY_SOURCE)
    root = tmp_path / "cache"
    # What a build killed mid-way leaves: torch's lock file in the build directory.
    stale = root / cpu_ops.build_key([source]) / "lock"
    stale.parent.mkdir(parents=True)
    stale.write_text("")
    result: list = []
    builder = threading.Thread(target=lambda: result.append(cpu_ops.build("tiny", [source], root)),
                               daemon=True)
    builder.start()
    builder.join(timeout=300)
    assert result, "the build waited on the stale lock"
    assert result[0].answer() == 42
    # Another checkout with the same source reuses the build: no compiler is needed now.
    copy = tmp_path / "other-checkout" / "tiny.cpp"
    copy.parent.mkdir()
    copy.write_text(TINY_SOURCE)
    monkeypatch.setenv("CXX", "no-such-compiler")
    assert cpu_ops.build("tiny", [copy], root).answer() == 42


def test_missing_compiler_is_named(tmp_path, monkeypatch):
    source = tmp_path / "tiny.cpp"
    source.write_text(TINY_SOURCE)
    monkeypatch.setenv("CXX", "no-such-compiler")
    with pytest.raises(RuntimeError, match="no C\\+\\+ compiler \\('no-such-compiler'"):
        cpu_ops.build("tiny", [source], tmp_path / "cache")


def test_an_arch_that_is_not_a_march_name_is_refused(tmp_path, monkeypatch):
    """JETSERVE_CPU_ARCH reaches the compiler's command line through a shell: a name only."""
    source = tmp_path / "tiny.cpp"
    source.write_text(TINY_SOURCE)
    monkeypatch.setattr(cpu_ops, "FLAGS", ["-O3", "-march=native; touch pwned"])
    monkeypatch.setattr(cpu_ops, "ARCH", "native; touch pwned")
    with pytest.raises(ValueError, match="JETSERVE_CPU_ARCH='native; touch pwned' is not a "
                                         "-march name"):
        cpu_ops.build("tiny", [source], tmp_path / "cache")
    assert not (tmp_path / "cache").exists()


def scattered_cache(lens: list[int], block: int, kv_heads: int, head_dim: int, kv: str, gen):
    """Random K and V caches (`kv`: fp32, bf16 or int8) holding sequences of `lens` tokens in
    scattered blocks (none is block 0, the padding), and their block tables padded with 0."""
    num_blocks = sum(-(-n // block) for n in lens) + 1
    k_cache = torch.randn(num_blocks, block, kv_heads, head_dim, generator=gen)
    v_cache = torch.randn(num_blocks, block, kv_heads, head_dim, generator=gen)
    if kv == "int8":  # the reference reads it dequantized: the same values, so the same tolerance
        k_cache, v_cache = kv_int8.quantize(k_cache), kv_int8.quantize(v_cache)
    if kv == "bf16":
        k_cache, v_cache = k_cache.bfloat16(), v_cache.bfloat16()
    order = torch.randperm(num_blocks - 1, generator=gen) + 1
    width = max(-(-n // block) for n in lens)
    tables, used = [], 0
    for n in lens:
        count = -(-n // block)
        tables.append(order[used:used + count].tolist() + [0] * (width - count))
        used += count
    return k_cache, v_cache, tables


def reference_cache(k_cache, v_cache, bf16_products: bool):
    """The caches as the reference reads them: a bf16 cache widened; an int8 one as it is (the
    reference dequantizes it, or with bf16 products scores its keys' codes as the kernels do)."""
    if k_cache.dtype == torch.bfloat16:
        return k_cache.float(), v_cache.float()
    return k_cache, v_cache


# 64 and 128 take the vectorized path, which scores a KV head's query heads together and sums
# values for up to 16 / (head_dim / 16) of them at a time: groups of 1, 3, 5 and 7 cover every case.
@pytest.mark.parametrize("head_dim,group,block", [
    (32, 3, 16), (64, 1, 16), (64, 3, 16), (64, 5, 8), (128, 3, 16), (128, 7, 32)])
@pytest.mark.parametrize("kv", ["fp32", "bf16", "int8"])
@pytest.mark.parametrize("invariant", [False, True])
def test_paged_decode_attention_matches_reference(k, head_dim, group, block, kv, invariant):
    kv_heads = 2
    heads = group * kv_heads
    lens = [1, 15, 16, 17, 33, 200]
    gen = torch.Generator().manual_seed(head_dim)
    k_cache, v_cache, tables = scattered_cache(lens, block, kv_heads, head_dim, kv, gen)
    q = torch.randn(len(lens), heads, head_dim, generator=gen)
    out = torch.empty_like(q)
    k.paged_decode_attention(q, k_cache, v_cache, torch.tensor(tables, dtype=torch.int32),
                             torch.tensor(lens, dtype=torch.int32), torch.arange(len(lens)), out, 0.1,
                             invariant)
    cu_seqlens = torch.arange(len(lens) + 1)
    # The invariant order over a bf16 or int8 cache takes bf16 products where the CPU has them
    # (the vectorized path).
    products = (kv != "fp32" and invariant and k.bf16_dot_products() and head_dim in (64, 128))
    k_cache, v_cache = reference_cache(k_cache, v_cache, products)
    expected = reference.paged_attention(q, k_cache, v_cache, torch.tensor(tables), cu_seqlens,
                                         torch.tensor(lens), 0.1, bf16_products=products)
    reference.assert_attention_close(out, expected, products)


# A batch of decodes (at least 4 sequences a thread, of lengths that end mid-block and on a
# block's edge) against each sequence alone: the same bits, whatever the batch, in both orders,
# every cache type, for KV heads of 1 to 5 query heads (the value sums' blocks of heads) and 2
# to 8 KV heads; and close to the reference.
@pytest.mark.parametrize("head_dim,group,block,kv_heads", [
    (64, 3, 16, 3), (64, 1, 8, 2), (64, 5, 32, 2), (128, 4, 16, 8), (128, 3, 8, 2)])
@pytest.mark.parametrize("kv", ["fp32", "bf16", "int8"])
@pytest.mark.parametrize("invariant", [False, True])
def test_a_batch_of_decodes_gives_each_sequence_its_bits_alone(k, head_dim, group, block,
                                                               kv_heads, kv, invariant):
    heads = group * kv_heads
    threads = torch.get_num_threads()
    lens = [1, 2, 15, 16, 17, 31, 33, 64, 65, 100, 129, 200] * max(1, -(-4 * threads // 12))
    gen = torch.Generator().manual_seed(head_dim + group + block)
    k_cache, v_cache, tables = scattered_cache(lens, block, kv_heads, head_dim, kv, gen)
    q = torch.randn(len(lens), heads, head_dim, generator=gen)
    tables = torch.tensor(tables, dtype=torch.int32)
    together = torch.full_like(q, float("nan"))
    k.paged_decode_attention(q, k_cache, v_cache, tables, torch.tensor(lens, dtype=torch.int32),
                             torch.arange(len(lens)), together, 0.1, invariant)
    alone = torch.full_like(q, float("nan"))
    for i, n in enumerate(lens):
        k.paged_decode_attention(q, k_cache, v_cache, tables[i:i + 1],
                                 torch.tensor([n], dtype=torch.int32), torch.tensor([i]), alone,
                                 0.1, invariant)
    same = (together.view(torch.int32) == alone.view(torch.int32)).all(-1).all(-1)
    assert same.all(), f"sequences {(~same).nonzero().flatten().tolist()} differ"
    products = kv != "fp32" and invariant and k.bf16_dot_products()
    k_cache, v_cache = reference_cache(k_cache, v_cache, products)
    expected = reference.paged_attention(q, k_cache, v_cache, tables.long(),
                                         torch.arange(len(lens) + 1), torch.tensor(lens), 0.1,
                                         bf16_products=products)
    reference.assert_attention_close(together, expected, products)


# Slices as (cached tokens, new tokens): a fresh prompt, a chunk after cached context, one that
# ends mid-tile and mid-block, a single token, one longer than a few tiles.
PREFILL_SLICES = [(0, 40), (37, 20), (5, 13), (64, 1), (0, 150), (100, 77)]


# Groups 1 to 8 (8: two tokens a tile of 16 rows); a scale of 4 spreads the scores far enough
# for weights at the exponential's floor, and for keys a lane does not see to score far above
# its maximum (their exponentials overflow before the mask drops them).
@pytest.mark.skipif(not cpu_ops.load() or not cpu_ops.load().prefill_attention_kernel(),
                    reason="the prefill kernel needs AVX-512 or AVX2")
@pytest.mark.parametrize("head_dim,group,block,scale", [
    (64, 1, 16, 0.1), (64, 3, 16, 0.1), (64, 5, 8, 0.1), (64, 8, 16, 4.0), (128, 3, 32, 0.1),
    (128, 7, 16, 4.0)])
@pytest.mark.parametrize("kv", ["fp32", "bf16", "int8"])
@pytest.mark.parametrize("invariant", [False, True])
def test_paged_prefill_attention_matches_reference(k, head_dim, group, block, scale, kv,
                                                   invariant):
    kv_heads = 2
    heads = group * kv_heads
    gen = torch.Generator().manual_seed(head_dim + group)
    lens = [cached + new for cached, new in PREFILL_SLICES]
    k_cache, v_cache, tables = scattered_cache(lens, block, kv_heads, head_dim, kv, gen)
    new_tokens = [new for _, new in PREFILL_SLICES]
    total = sum(new_tokens)
    pad = 3  # rows before and after the slices', which must stay as they are
    # q as the engine has it: a view into the fused QKV output, its rows strided.
    qkv = torch.randn(total + 2 * pad, (heads + 2 * kv_heads) * head_dim, generator=gen)
    q = qkv[:, :heads * head_dim].unflatten(1, (heads, head_dim))
    out = torch.full((total + 2 * pad, heads, head_dim), float("nan"))
    q_start = pad
    for (cached, new), table in zip(PREFILL_SLICES, tables):
        blocks = torch.tensor(table[:-(-(cached + new) // block)], dtype=torch.int32)
        k.paged_prefill_attention(q, k_cache, v_cache, blocks, q_start, new, cached, out, scale,
                                  invariant)
        q_start += new
    assert out[:pad].isnan().all() and out[-pad:].isnan().all()
    cu_seqlens = torch.tensor([0] + new_tokens).cumsum(0)
    products = kv != "fp32" and invariant and k.bf16_dot_products()  # the tiles' bf16 products
    k_cache, v_cache = reference_cache(k_cache, v_cache, products)
    rows = slice(pad, pad + total)
    expected = reference.paged_attention(q[rows], k_cache, v_cache, torch.tensor(tables),
                                         cu_seqlens, torch.tensor(lens), scale,
                                         bf16_products=products)
    reference.assert_attention_close(out[rows], expected, products)


# head_dim 64 and 128 take the prefill kernel's tiles where AVX-512 is built in (groups 1 to 7:
# the invariant decode's blocks of 1 to 4 heads, alone and after a block of 4); 32 and 96, and
# any head_dim elsewhere, a row of the decode kernel per token. A scale of 4 spreads the scores
# far enough for weights at e^-87 (the exponential's floor) and products of them below fp32's
# normal range.
@pytest.mark.parametrize("head_dim,group,block,scale", [
    (32, 3, 16, 0.1), (64, 1, 16, 0.1), (64, 2, 16, 0.1), (64, 3, 16, 0.1), (64, 3, 16, 4.0),
    (64, 4, 16, 0.1), (64, 5, 8, 0.1), (64, 6, 16, 4.0), (96, 3, 16, 0.1), (128, 3, 32, 0.1),
    (128, 7, 16, 4.0)])
@pytest.mark.parametrize("kv", ["fp32", "bf16", "int8"])
def test_a_prefill_as_decodes_gives_each_token_its_decode_bits(k, head_dim, group, block, scale,
                                                               kv):
    """What a batch-invariant model's prefill runs: each token's output has the bits the decode
    kernel (in the invariant order) gives that token alone, whatever the slice's length, its
    cached context, the tiles it falls in, or how many threads share it; and no row outside the
    slice is written."""
    kv_heads = 2
    heads = group * kv_heads
    gen = torch.Generator().manual_seed(head_dim + group + block)
    slices = PREFILL_SLICES + [(3, 300)]
    lens = [cached + new for cached, new in slices]
    k_cache, v_cache, tables = scattered_cache(lens, block, kv_heads, head_dim, kv, gen)
    total = sum(new for _, new in slices)
    pad = 3  # rows before and after the slices', which must stay as they are
    qkv = torch.randn(total + 2 * pad, (heads + 2 * kv_heads) * head_dim, generator=gen)
    q = qkv[:, :heads * head_dim].unflatten(1, (heads, head_dim))
    threads = torch.get_num_threads()
    for num_threads in sorted({1, threads, 3}):
        torch.set_num_threads(num_threads)
        try:
            out = torch.full((total + 2 * pad, heads, head_dim), float("nan"))
            alone = torch.full_like(out, float("nan"))
            q_start = pad
            for (cached, new), table in zip(slices, tables):
                blocks = torch.tensor(table[:-(-(cached + new) // block)], dtype=torch.int32)
                k.paged_prefill_as_decodes(q, k_cache, v_cache, blocks, q_start, new, cached, out,
                                           scale)
                for t in range(new):
                    k.paged_decode_attention(q, k_cache, v_cache, blocks[None], torch.tensor(
                        [cached + t + 1], dtype=torch.int32), torch.tensor([q_start + t]), alone,
                        scale, True)
                q_start += new
        finally:
            torch.set_num_threads(threads)
        assert out[:pad].isnan().all() and out[-pad:].isnan().all()
        rows = slice(pad, pad + total)
        same = (out[rows].view(torch.int32) == alone[rows].view(torch.int32)).all(-1).all(-1)
        assert same.all(), f"{num_threads} threads: rows {(~same).nonzero().flatten()[:10]} differ"
    with pytest.raises(RuntimeError, match=rf"block table must cover positions \[0, {2 * block}\)"):
        k.paged_prefill_as_decodes(q, k_cache, v_cache, torch.tensor([1], dtype=torch.int32), 0,
                                   block, block, out, 0.1)
    with pytest.raises(RuntimeError, match="rows of q and out"):
        k.paged_prefill_as_decodes(q, k_cache, v_cache, blocks, -1, 2, 0, out, 0.1)
    with pytest.raises(RuntimeError, match="rows of q and out"):
        k.paged_prefill_as_decodes(q, k_cache, v_cache, blocks, 0, 2, 0, out[:1], 0.1)


# Each int8 row as random codes with fp16 scales and offsets, some groups extreme: scale 0, the
# largest fp16 scale and offset, subnormal ones.
def extreme_int8_rows(cache: torch.Tensor, gen) -> torch.Tensor:
    d = kv_int8.head_dim_of(cache)
    params = cache[..., d:].contiguous().view(torch.float16)  # [..., 2 * groups]
    pick = torch.randint(0, 8, params.shape, generator=gen)
    special = torch.tensor([0.0, 60000.0, -60000.0, 6e-8, -6e-8], dtype=torch.float16)
    params = torch.where(pick < len(special), special[pick.clamp(max=len(special) - 1)], params)
    out = cache.clone()
    out[..., d:] = params.view(torch.int8)
    return out


@pytest.mark.parametrize("head_dim,group,block", [(64, 3, 16), (64, 8, 8), (128, 5, 32)])
def test_an_int8_cache_under_bf16_products_gives_every_path_the_same_bits(k, head_dim, group,
                                                                          block):
    """A bf16 model's attention over an int8 cache (attention_simd.h): each query in 16-bit codes
    against the keys' codes in integer sums, the values dequantized and rounded to bf16. Prefill
    tiles, prefills as decodes and (batched) decodes give every token the same bits, from 1 to 40
    new tokens, over rows with extreme scales and offsets (0, +-60,000, subnormal) and
    codes of -128, with no NaN; and each is the reference's attention for those codes."""
    if not k.bf16_dot_products():
        pytest.skip("bf16 products need AVX512-BF16")
    kv_heads = 2
    heads = group * kv_heads
    gen = torch.Generator().manual_seed(head_dim * group + block)
    slices = [(0, 1), (0, 17), (5, 3), (37, 20), (64, 40), (250, 7), (1, 2)]
    lens = [cached + new for cached, new in slices]
    k8, v8, tables = scattered_cache(lens, block, kv_heads, head_dim, "int8", gen)
    k8, v8 = extreme_int8_rows(k8, gen), extreme_int8_rows(v8, gen)
    codes = k8[..., :head_dim]
    codes[(torch.rand(codes.shape, generator=gen) < 0.01)] = -128  # past the quantizer's range
    total = sum(new for _, new in slices)
    q = torch.randn(total, heads, head_dim, generator=gen)
    q[::5, 0] *= 1000.0  # some rows' codes far coarser than others'
    q[1, 1] = 0.0  # a row of zeros: codes and unit 0
    q[2, 2] *= 1e-36  # 32767 / its largest would overflow: codes 0, scores 0

    prefill = torch.full_like(q, float("nan"))
    as_decodes = torch.full_like(q, float("nan"))
    q_start = 0
    for (cached, new), table in zip(slices, tables):
        blocks = torch.tensor(table[:-(-(cached + new) // block)], dtype=torch.int32)
        k.paged_prefill_attention(q, k8, v8, blocks, q_start, new, cached, prefill, 0.125, True)
        k.paged_prefill_as_decodes(q, k8, v8, blocks, q_start, new, cached, as_decodes, 0.125)
        q_start += new
    decodes = torch.full_like(q, float("nan"))
    tables_t = torch.tensor(tables, dtype=torch.int32)
    for t in range(max(new for _, new in slices)):  # every token of every slice, in 40 batches
        rows, seq_lens, seqs = [], [], []
        for i, (cached, new) in enumerate(slices):
            if t < new:
                rows.append(sum(n for _, n in slices[:i]) + t)
                seq_lens.append(cached + t + 1)
                seqs.append(i)
        k.paged_decode_attention(q, k8, v8, tables_t[seqs], torch.tensor(seq_lens,
                                 dtype=torch.int32), torch.tensor(rows), decodes, 0.125, True)
    assert not decodes.isnan().any()
    for name, a in [("prefill", prefill), ("as decodes", as_decodes)]:
        same = (a.view(torch.int32) == decodes.view(torch.int32)).all(-1)
        assert same.all(), f"{name}: rows {(~same).nonzero()[:5].tolist()} differ from decodes"
    expected = reference.paged_attention(q, k8, v8, torch.tensor(tables),
                                         torch.tensor([0] + [n for _, n in slices]).cumsum(0),
                                         torch.tensor(lens), 0.125, bf16_products=True)
    size = expected.abs().amax(-1, keepdim=True).clamp(min=1.0)  # values up to +-60,000 and more
    reference.assert_attention_close(decodes / size, expected / size, True)


def to_fp32_once(x: Fraction) -> float:
    """x rounded once to the nearest fp32 (ties to even), for normal results."""
    if x == 0:
        return 0.0
    sign, x = (-1, -x) if x < 0 else (1, x)
    e = x.numerator.bit_length() - x.denominator.bit_length()
    if Fraction(2) ** e > x:
        e -= 1
    m = x / Fraction(2) ** (e - 23)  # in [2^23, 2^24)
    whole, rest = divmod(m.numerator, m.denominator)
    if 2 * rest > m.denominator or (2 * rest == m.denominator and whole % 2):
        whole += 1
    return sign * float(whole * Fraction(2) ** (e - 23))


def test_the_references_fused_add_rounds_once():
    """reference.fused_add (the int8 keys' chain in int8_key_scores) is a fused multiply-add's
    one rounding of product + s, also where the float64 sum is itself inexact (a large s and a
    small product with many bits), which rounding the float64 sum to fp32 gets wrong."""
    gen = torch.Generator().manual_seed(5)
    n = 4000
    a = (torch.randint(-2**24, 2**24, (n,), generator=gen).float().double()
         * torch.randn(n, generator=gen).half().double())
    s = (torch.randn(n, generator=gen) * 2.0 ** torch.randint(-20, 40, (n,), generator=gen)).float()
    # The case two roundings get wrong: 2^40 + (2^16 + 2^-18 k), which sits just over half an
    # fp32 step (2^17) above 2^40 and so rounds up once, but to the tie, then down, twice.
    a[0], s[0] = 2.0 ** 16 + 5 * 2.0 ** -18, 2.0 ** 40
    got = reference.fused_add(a, s)
    want = [to_fp32_once(Fraction(x) + Fraction(y)) for x, y in zip(a.tolist(), s.tolist())]
    assert got[0].item() == 2.0 ** 40 + 2.0 ** 17
    assert got.tolist() == want


def test_the_prefill_kernel_is_built_where_avx512_or_avx2_is(k):
    """The prefill tests above run only where the kernel is built: on this machine it is, if it
    has AVX-512 or AVX2 and FMA (or, built for another instruction set with JETSERVE_CPU_ARCH,
    if that set has them). Only the AVX-512 tiles keep the batch-invariant order; the test of
    prefills as decodes covers both kinds of build."""
    if cpu_ops.ARCH != "native":
        macros = subprocess.run([os.environ.get("CXX", "c++"), f"-march={cpu_ops.ARCH}", "-dM",
                                 "-E", "-x", "c++", "/dev/null"], capture_output=True, text=True,
                                check=True).stdout.splitlines()
        has = {name: f"#define __{name}__ 1" in macros for name in ("AVX512F", "AVX2", "FMA")}
    else:
        flags = [line for line in open("/proc/cpuinfo") if line.startswith("flags")]
        if not flags:
            pytest.skip("/proc/cpuinfo names no x86 flags here")
        names = flags[0].split(":")[1].split()
        has = {"AVX512F": "avx512f" in names, "AVX2": "avx2" in names, "FMA": "fma" in names}
    assert k.prefill_attention_kernel() == (has["AVX512F"] or (has["AVX2"] and has["FMA"]))


def test_paged_prefill_attention_names_what_it_refuses(k):
    if not k.prefill_attention_kernel():
        pytest.skip("the prefill kernel needs AVX-512 or AVX2")
    q = torch.randn(4, 2, 32)
    cache = torch.randn(2, 16, 1, 32)
    with pytest.raises(RuntimeError, match="head_dim 64 or 128, not 32"):
        k.paged_prefill_attention(q, cache, cache, torch.tensor([1], dtype=torch.int32), 0, 4, 0,
                                  torch.empty_like(q), 0.1, False)
    q = torch.randn(20, 2, 64)
    cache = torch.randn(2, 16, 1, 64)
    with pytest.raises(RuntimeError, match=r"block table must cover positions \[0, 20\)"):
        k.paged_prefill_attention(q, cache, cache, torch.tensor([1], dtype=torch.int32), 0, 20, 0,
                                  torch.empty_like(q), 0.1, False)


def test_paged_decode_attention_names_what_it_refuses(k):
    q = torch.randn(2, 2, 64)
    cache = torch.randn(2, 16, 1, 64)
    out = torch.empty_like(q)

    def call(lens, rows, cache=cache):
        k.paged_decode_attention(q, cache, cache, torch.ones(len(lens), 1, dtype=torch.int32),
                                 torch.tensor(lens, dtype=torch.int32), torch.tensor(rows), out,
                                 0.1, False)

    call([16, 3], [0, 1])
    with pytest.raises(RuntimeError, match="sequence 1's row 2 or length 1 is past"):
        call([1, 1], [0, 2])
    with pytest.raises(RuntimeError, match="sequence 0's row -1"):
        call([1, 1], [-1, 0])
    with pytest.raises(RuntimeError, match="sequence 0's row 0 or length 17 is past"):
        call([17, 1], [0, 1])
    with pytest.raises(RuntimeError, match="sequence 1's row 1 or length 0 is past"):
        call([1, 0], [0, 1])  # a decode attends at least to its own key
    with pytest.raises(RuntimeError, match="heads a multiple of kv_heads"):
        call([1, 1], [0, 1], cache=torch.randn(2, 16, 3, 64))  # 2 query heads, 3 KV heads


def test_dense_linear_packs_what_the_kernel_takes_and_leaves_the_rest_to_torch(k):
    from services.executor.engine.linear import DenseLinear

    ids = torch.tensor([0, 9, 3, 9])
    odd = torch.randn(10, 48)  # 10 output rows: not whole panels of 32
    x = torch.randn(3, 48)
    linear = DenseLinear(odd, k)
    assert linear.kernels is None and linear.weight is odd
    torch.testing.assert_close(linear(x), x @ odd.t())
    assert torch.equal(linear.rows(ids), odd[ids])
    table = torch.randn(64, 48)  # an embedding table tied to the output projection
    packed = DenseLinear(table, k)
    assert packed.kernels is k and packed.weight.shape == (2, 48, 32)
    torch.testing.assert_close(packed(x), x @ table.t(), atol=1e-5, rtol=1e-5)
    assert torch.equal(packed.rows(torch.tensor([0, 33, 63, 33])), table[[0, 33, 63, 33]])
