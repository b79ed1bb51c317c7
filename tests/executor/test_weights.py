import numpy as np
import torch

from services.executor.weights import load_model_files
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
