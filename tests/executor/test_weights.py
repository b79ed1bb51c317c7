import numpy as np
import pytest
import torch

from services.executor.engine.weights import load_model_files
from shared.model_files import (
    ModelConfig,
    converted_gguf_dir,
    default_gguf_path,
    dummy_config,
    unpermute_rotary,
)


def llama_cpp_permute(weight, num_heads):
    """The Q/K row order llama.cpp's converter writes, restated here as the thing to undo."""
    rows, cols = weight.shape
    return weight.reshape(num_heads, 2, rows // num_heads // 2, cols).swapaxes(1, 2).reshape(rows, cols)


def test_unpermute_rotary_inverts_llama_cpp_order():
    w = np.arange(6 * 8 * 5, dtype=np.float32).reshape(6 * 8, 5)
    assert np.array_equal(unpermute_rotary(llama_cpp_permute(w, 6), 6), w)


def test_gguf_conversion_is_cached():
    first = converted_gguf_dir(default_gguf_path(), None)
    stamp = (first / "model.safetensors").stat().st_mtime_ns
    again = converted_gguf_dir(default_gguf_path(), None)
    assert again == first and (again / "model.safetensors").stat().st_mtime_ns == stamp


def test_smollm2_config_from_gguf():
    config, weights, _ = load_model_files("SmolLM2-135M-Instruct", torch.device("cpu"), torch.float32)
    assert (config.num_layers, config.hidden_size, config.num_heads, config.num_kv_heads) == (30, 576, 9, 3)
    assert config.tie_word_embeddings and "lm_head.weight" not in weights
    assert weights["model.layers.0.self_attn.k_proj.weight"].shape == (192, 576)


def test_dummy_weights_are_deterministic_and_shaped():
    config = dummy_config("tiny")
    assert isinstance(config, ModelConfig)
    _, a, _ = load_model_files("dummy:tiny", torch.device("cpu"), torch.float32)
    _, b, _ = load_model_files("dummy:tiny", torch.device("cpu"), torch.float32)
    assert torch.equal(a["model.layers.1.mlp.up_proj.weight"], b["model.layers.1.mlp.up_proj.weight"])
    assert a["model.embed_tokens.weight"].shape == (49152, 64)


def test_conversion_is_light_for_the_control_plane_and_safe_to_race(tmp_path):
    """Without weights only config and tokenizer are written (the control plane's needs); several
    converters at once (replicas sharing a cache volume) leave one whole cache and no debris."""
    import threading

    from safetensors.numpy import load_file

    from shared.model_files import WEIGHTS_FILE, hf_config

    light = converted_gguf_dir(default_gguf_path(), str(tmp_path), weights=False)
    assert (light / "tokenizer.json").exists() and hf_config(light).num_layers == 30
    assert not (light / WEIGHTS_FILE).exists()
    found = []
    racers = [threading.Thread(target=lambda: found.append(
        converted_gguf_dir(default_gguf_path(), str(tmp_path)))) for _ in range(3)]
    for racer in racers:
        racer.start()
    for racer in racers:
        racer.join()
    assert found == [light] * 3
    assert len(load_file(str(light / WEIGHTS_FILE))) == 3 + 9 * 30 - 1  # tied lm_head
    assert not [p.name for p in light.iterdir() if ".tmp-" in p.name]


def test_auto_quantization_keeps_the_gguf_blocks_exactly():
    """Q4_1 matrices become int4 and the Q8_0 embedding the int8 output projection, holding
    exactly the values the GGUF dequantizes to (Q/K rows in HF order)."""
    device = torch.device("cpu")
    _, dense, _ = load_model_files("SmolLM2-135M-Instruct", device, torch.float32)
    _, quantized, _ = load_model_files("SmolLM2-135M-Instruct", device, torch.float32,
                                       quantization="auto")
    for name in ("model.layers.0.self_attn.q_proj.weight", "model.layers.3.self_attn.k_proj.weight",
                 "model.layers.29.mlp.down_proj.weight"):
        assert quantized[name].bits == 4
        torch.testing.assert_close(quantized[name].dequantize(), dense[name], atol=1e-6, rtol=0)
    head = quantized["lm_head.weight"]
    assert head.bits == 8 and head.shape == (49152, 576)
    torch.testing.assert_close(head.dequantize(), dense["model.embed_tokens.weight"], atol=1e-6, rtol=0)
    # The lookup table stays dense; norms are untouched.
    assert quantized["model.embed_tokens.weight"].dtype == torch.float32
    assert torch.equal(quantized["model.norm.weight"], dense["model.norm.weight"])


def test_int8_and_int4_quantize_every_matmul_and_refuse_a_gpu():
    device = torch.device("cpu")
    for mode, bits in (("int8", 8), ("int4", 4)):
        config, weights, _ = load_model_files("dummy:tiny", device, torch.float32, quantization=mode)
        matmuls = [n for n in weights if n.endswith("proj.weight")] + ["lm_head.weight"]
        assert len(matmuls) == 7 * config.num_layers + 1
        assert all(weights[n].bits == bits for n in matmuls)
    with pytest.raises(ValueError, match="'int8' runs on the CPU engine only; on cuda use none"):
        load_model_files("dummy:tiny", torch.device("cuda"), torch.bfloat16, quantization="int8")
