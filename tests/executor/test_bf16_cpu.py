"""model.dtype bfloat16 on a CPU (the default where the CPU has native bf16): bf16 weights in
the kernels' panels and a bf16 KV cache, fp32 activations between the ops, served through the
same C++ kernels as fp32, batch-invariant where the CPU has AVX512-BF16."""

from __future__ import annotations

import asyncio
import subprocess
import sys

import pytest
import torch

from jetserve_kernels import cpu_ops, reference
from services.executor.engine.llm_engine import Engine
from services.executor.run_local import run_requests
from shared.config import engine_config
from shared.protocol import Completion


@pytest.mark.skipif(cpu_ops.load() is None, reason="the CPU kernels did not build")
def test_the_amx_probe_runs_the_tiles_in_a_child(monkeypatch):
    """Where the CPU has AMX, a child process finds the tiles batch-invariant and close to fp64
    (exit 0), and a bf16 model's matmuls take them with `model.amx: tiles`; elsewhere the child
    says there are none (exit 2) and the matmuls take vdpbf16ps. `auto` and `none` keep a bf16
    model on AVX-512 in either case, `none` quantized weights' prefills too."""
    from services.executor.engine import linear

    amx = cpu_ops.native_bf16() and cpu_ops.load().amx_bf16()
    child = subprocess.run([sys.executable, "-m", "services.executor.engine.amx_probe"],
                           capture_output=True, timeout=120)
    assert child.returncode == (0 if amx else 2), (child.stdout + child.stderr).decode()[-2000:]
    monkeypatch.setattr(linear, "_amx_tiles", None)
    assert linear.amx_tiles(cpu_ops.load()) == amx
    if cpu_ops.native_bf16():
        weight = torch.randn(64, 64).bfloat16()
        assert linear.DenseLinear(weight, cpu_ops.load(), amx="tiles").units == (
            "amx" if amx else "avx512")
        assert linear.DenseLinear(weight, cpu_ops.load()).units == "avx512"
        assert linear.DenseLinear(weight, cpu_ops.load(), amx="none").units == "avx512"
        # what the executor's start-up log says of it
        engine = Engine(engine_config({"model.name": "dummy:tiny", "model.dtype": "bfloat16",
                                       "kv_cache.num_blocks": 16}))
        try:
            assert engine.matmuls == "bf16 on avx512"
        finally:
            asyncio.run(engine.stop())
    assert linear.many_rows_precision(cpu_ops.load(), amx="none") != "amx"


@pytest.mark.skipif(cpu_ops.load() is None, reason="the CPU kernels did not build")
def test_the_amx_probe_runs_the_int8_tiles_in_a_child(monkeypatch):
    """Where the CPU has AMX-INT8, a child process finds W8A8 and W4A8 on the tiles with the VNNI
    kernel's bits at every row count (exit 0), and int8 activations take them from 16 rows with
    `model.amx: tiles`; elsewhere the child says there are none (exit 2) and they stay on the
    vector kernel. `auto` never takes them."""
    from services.executor.engine import linear

    kernels = cpu_ops.load()
    amx = kernels.amx_int8()
    child = subprocess.run([sys.executable, "-m", "services.executor.engine.amx_probe", "int8"],
                           capture_output=True, timeout=120)
    said = (child.stdout + child.stderr).decode()[-2000:]
    assert child.returncode == (0 if amx else 2), said
    assert ("every row count: True" if amx else "no AMX-INT8 tiles here") in said
    monkeypatch.setattr(linear, "_amx_int8_tiles", None)
    assert linear.amx_int8_tiles(kernels) == amx
    if kernels.int8_dot_products():
        weight = linear.quantize(torch.randn(64, 64), 8)
        tiles = linear.QuantizedLinear(weight, kernels, int8_activations=True, amx="tiles")
        assert (tiles.many_rows == "amx_int8") == amx
        assert linear.QuantizedLinear(weight, kernels, int8_activations=True).many_rows != (
            "amx_int8")
    for wrong in (["fp8"], ["int8", "bf16"]):
        bad = subprocess.run([sys.executable, "-m", "services.executor.engine.amx_probe", *wrong],
                             capture_output=True, timeout=120)
        assert bad.returncode == 3, bad
        assert b"usage: python -m services.executor.engine.amx_probe [bf16|int8]" in bad.stdout


@pytest.mark.skipif(cpu_ops.load() is None, reason="the CPU kernels did not build")
def test_a_bf16_model_runs_on_the_cpu_kernels():
    async def run():
        engine = Engine(engine_config({"model.name": "dummy:tiny", "model.dtype": "bfloat16",
                                       "kv_cache.num_blocks": 64}))
        try:
            model = engine.runner.model
            assert model.backend.cpu_kernels is not None
            assert engine.kv_dtype_name == "bfloat16"
            assert engine.runner.kv_caches[0][0].dtype == torch.bfloat16
            for layer in model.layers:
                for linear in (layer.qkv_proj, layer.o_proj, layer.gate_up_proj, layer.down_proj):
                    assert linear.weight.dtype == torch.bfloat16
                    # bf16 dot products at every row count where the CPU has them (pairs).
                    assert linear.pairs == cpu_ops.native_bf16()
                    assert linear.pairs or linear.many_rows is not None
                assert layer.input_norm.dtype == torch.float32  # activations stay fp32
            return await run_requests(engine, [
                '{"prompt_token_ids": [5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, '
                '21, 22], "max_tokens": 12, "ignore_eos": true, "temperature": 0}'] * 3)
        finally:
            await engine.stop()

    results = asyncio.run(run())
    assert all(isinstance(r, Completion) and len(r.token_ids) == 12 for r in results)
    assert results[0].token_ids == results[1].token_ids == results[2].token_ids


@pytest.mark.skipif(cpu_ops.load() is None, reason="the CPU kernels did not build")
@pytest.mark.parametrize("shape", [dict(vocab_size=49153),  # an output projection past panels
                                   dict(hidden_size=48, tie_word_embeddings=False),  # K of 48
                                   dict(hidden_size=48)])  # and a tied table: widened to fp32
def test_a_bf16_model_of_odd_shapes_serves(monkeypatch, shape):
    from shared import model_files

    monkeypatch.setitem(model_files.DUMMY_SHAPES, "odd",
                        dict(model_files.DUMMY_SHAPES["tiny"], **shape))

    async def run(dtype: str):
        engine = Engine(engine_config({"model.name": "dummy:odd", "model.dtype": dtype,
                                       "kv_cache.num_blocks": 64}))
        try:
            return await run_requests(engine, [
                '{"prompt_token_ids": [5, 6, 7, 8, 9, 10, 11, 12, 13, 14], "max_tokens": 6, '
                '"ignore_eos": true, "temperature": 0}'])
        finally:
            await engine.stop()

    [result] = asyncio.run(run("bfloat16"))
    assert isinstance(result, Completion) and len(result.token_ids) == 6
    assert all(t < model_files.DUMMY_SHAPES["odd"]["vocab_size"] for t in result.token_ids)


@pytest.mark.skipif(cpu_ops.load() is None, reason="the CPU kernels did not build")
@pytest.mark.parametrize("head_dim", [32, 64, 96, 128])  # 64, 128: AVX-512 paths; else portable
def test_a_bf16_prefill_attends_as_its_decodes_would(head_dim):
    """A bf16 model's backend is batch-invariant: each prefill token's attention output has the
    bits a decode of that token gets (the prefix a preempted or migrated request recomputes in
    one prefill matches what it decoded a token at a time), and agrees with SDPA."""
    from services.executor.engine.attention import SeqSlice, TorchBackend

    backend = TorchBackend(16, torch.device("cpu"), torch.bfloat16)
    if not backend.batch_invariant:
        pytest.skip("the kernels built here have no AVX512-BF16 dot products: "
                    "a bf16 model is not its default")
    gen = torch.Generator().manual_seed(head_dim)
    heads, kv_heads, context, new = 9, 3, 70, 45
    k_cache = torch.randn(8, 16, kv_heads, head_dim, generator=gen).bfloat16()
    v_cache = torch.randn(8, 16, kv_heads, head_dim, generator=gen).bfloat16()
    table = [6, 2, 7, 0, 4]
    q = torch.randn(new, heads, head_dim, generator=gen)
    unused = torch.empty(new, kv_heads, head_dim)  # k, v: already in the cache
    first = context - new
    meta = backend.prepare([SeqSlice(0, new, context, table)], [0] * new)
    together = backend.attention(q, unused, unused, k_cache, v_cache, 0.125, meta)
    for t in range(new):
        meta = backend.prepare([SeqSlice(0, 1, first + t + 1, table)], [0])
        alone = backend.attention(q[t:t + 1], unused, unused, k_cache, v_cache, 0.125, meta)
        assert torch.equal(alone[0], together[t]), f"token {t}"
    # The vectorized kernels (head_dim 64, 128) over a bf16 cache take bf16 dot products
    # (AVX512-BF16, which a batch-invariant backend has): q * scale and the softmax's weights
    # rounded to bf16.
    products = head_dim in (64, 128)
    expected = reference.paged_attention(q, k_cache.float(), v_cache.float(), torch.tensor([table]),
                                         torch.tensor([0, new]), torch.tensor([context]), 0.125,
                                         bf16_products=products)
    if products:
        reference.assert_attention_close(together, expected, bf16_products=True)
    else:
        torch.testing.assert_close(together, expected, atol=1e-5, rtol=1e-4)


@pytest.mark.skipif(cpu_ops.load() is None, reason="the CPU kernels did not build")
def test_the_cpu_default_dtype_is_bf16_where_the_cpu_has_native_bf16():
    from services.executor.engine.llm_engine import _pick_dtype

    cpu = torch.device("cpu")
    native = torch.bfloat16 if cpu_ops.native_bf16() else torch.float32
    assert _pick_dtype(engine_config({}), cpu) == native
    # Quantized weights keep fp32 around them; an explicit dtype is taken as it is; CUDA: bf16.
    assert _pick_dtype(engine_config({"model.quantization": "int8"}), cpu) == torch.float32
    assert _pick_dtype(engine_config({"model.dtype": "float32"}), cpu) == torch.float32
    assert _pick_dtype(engine_config({"model.dtype": "bfloat16"}), cpu) == torch.bfloat16
    assert _pick_dtype(engine_config({}), torch.device("cuda")) == torch.bfloat16


@pytest.mark.skipif(cpu_ops.load() is None, reason="the CPU kernels did not build")
@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, torch.int8])
def test_a_bf16_models_logits_do_not_depend_on_the_step(monkeypatch, kv_dtype):
    """The whole bf16 model, batch-invariant to the bit: a prompt's last logits are the same
    prefilled alone, beside another prompt, in two chunks, with its last token decoded (alone
    and beside another's decode), and decoded a token at a time from the start."""
    if not cpu_ops.native_bf16():
        pytest.skip("the kernels built here have no AVX512-BF16 dot products: "
                    "a bf16 model is not invariant")
    from services.executor.engine.attention import SeqSlice, TorchBackend
    from services.executor.engine.model import KvSegment, LlamaModel
    from services.executor.engine.model_runner import kv_cache_row
    from services.executor.engine.weights import load_model_files
    from shared import model_files

    monkeypatch.setitem(model_files.DUMMY_SHAPES, "mini", dict(
        hidden_size=256, intermediate_size=512, num_layers=3, num_heads=4, num_kv_heads=2,
        head_dim=64, vocab_size=1000, max_position=1024, tie_word_embeddings=True))
    cpu, block = torch.device("cpu"), 16
    torch.manual_seed(0)
    config, weights, _ = load_model_files("dummy:mini", cpu, torch.bfloat16)
    backend = TorchBackend(block, cpu, torch.bfloat16)
    model = LlamaModel(config, weights, backend, 1024)
    a = torch.randint(0, 1000, (40,)).tolist()
    b = torch.randint(0, 1000, (23,)).tolist()
    tables = {"a": [5, 0, 3], "b": [10, 11]}

    def caches():
        shape = (16, block, config.num_kv_heads, kv_cache_row(config, kv_dtype))
        return [(torch.zeros(shape, dtype=kv_dtype), torch.zeros(shape, dtype=kv_dtype))
                for _ in range(config.num_layers)]

    def step(kv, parts):
        """One step of (sequence, its tokens, their first position): each part's last logits."""
        ids, positions, slots, slices, last = [], [], [], [], []
        for name, tokens, start in parts:
            table = tables[name]
            slices.append(SeqSlice(len(ids), len(tokens), start + len(tokens), table))
            ids += tokens
            positions += range(start, start + len(tokens))
            slots += [table[p // block] * block + p % block
                      for p in range(start, start + len(tokens))]
            last.append(len(ids) - 1)
        meta = backend.prepare(slices, slots)
        return model.forward(torch.tensor(ids), torch.tensor(positions),
                             [KvSegment(meta, kv)], torch.tensor(last))

    alone = step(caches(), [("a", a, 0)])[0]
    kv = caches()
    assert torch.equal(step(kv, [("b", b, 0), ("a", a, 0)])[1], alone)
    kv = caches()
    step(kv, [("a", a[:16], 0)])
    assert torch.equal(step(kv, [("a", a[16:], 16)])[0], alone)  # two chunks
    kv = caches()
    step(kv, [("a", a[:39], 0), ("b", b, 0)])
    assert torch.equal(step(kv, [("b", b[:1], 23), ("a", a[39:], 39)])[1], alone)
    kv = caches()
    for i in range(40):
        last = step(kv, [("a", a[i:i + 1], i)])[0]
    assert torch.equal(last, alone)
