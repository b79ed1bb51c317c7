"""The int8 KV cache under teacher forcing, on the real SmolLM2: against an fp32 cache under an
fp32 model, and against a bf16 model's own bf16 cache; 2,048 tokens of the held-out text, every
scored position decoded through the int8 cache."""

from __future__ import annotations

import json

import pytest

from loadtest import kv_teacher_forced


def test_int8_kv_keeps_top1_and_perplexity(tmp_path):
    out = tmp_path / "forced.json"
    assert kv_teacher_forced.main(["--windows", "8", "--window", "272", "--prefix", "16",
                                   "--result-json", str(out)]) == 0
    r = json.loads(out.read_text())["results"]
    assert r["tokens"] == 8 * 256
    assert 5 < r["perplexity_reference_kv"] < 40  # the model reads the text (a broken one: ~50,000)
    assert r["top1_agreement"] >= 0.99
    assert abs(r["perplexity_relative"]) < 0.01
    # Rounded, not a copy; and well under the layouts this replaced, which measured on these
    # tokens 9.4e-4 (one scale a row) and 2.25e-4 (a scale and offset per 32 channels, keys as
    # they are); in the key basis (kv_int8.py) 9.0e-5.
    assert 0 < r["mean_kl"] < 1.5e-4


def test_int8_kv_under_a_bf16_model_stays_near_its_bf16_cache(tmp_path):
    """The shipped default on a CPU with AVX512-BF16: a bf16 model, whose attention over an int8
    cache scores the keys' codes in integer products and takes the values dequantized and
    rounded to bf16 in bf16 products, against its own bf16 cache. Measured on these tokens:
    KL 3.0e-4, perplexity -0.09 % (on 20,160 tokens 99.02 % top-1, 3.2e-4: BENCHMARKS.md); with
    the keys dequantized and rounded to bf16 too 3.2e-4; with keys as they are (before the key
    basis) 98.83 %, +0.11 % and 5.0e-4. The KL is the steady measure (a top-1 share of
    2,048 tokens moves by a few near-ties with any change of arithmetic)."""
    from jetserve_kernels import cpu_ops

    kernels = cpu_ops.load()
    if kernels is None or not kernels.bf16_dot_products():
        pytest.skip("a bf16 model's attention takes bf16 products only with AVX512-BF16")
    out = tmp_path / "forced.json"
    assert kv_teacher_forced.main(["--windows", "8", "--window", "272", "--prefix", "16",
                                   "--model-dtype", "bfloat16", "--reference-kv", "bfloat16",
                                   "--result-json", str(out)]) == 0
    r = json.loads(out.read_text())["results"]
    assert r["tokens"] == 8 * 256
    assert 5 < r["perplexity_reference_kv"] < 40
    assert r["top1_agreement"] >= 0.985
    assert abs(r["perplexity_relative"]) < 0.01
    assert 0 < r["mean_kl"] < 4e-4
