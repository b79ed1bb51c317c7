"""A model's weights as HF-named tensors on the target device: from an HF directory (a GGUF file
is converted into one first, `shared/model_files.py`), or random for `dummy:<shape>`.
"""

from __future__ import annotations

from pathlib import Path

import torch

from shared.model_files import ModelConfig, load_model_config


def dummy_weights(config: ModelConfig, device: torch.device, dtype: torch.dtype,
                  seed: int = 0) -> dict[str, torch.Tensor]:
    """Random weights (std 0.02, norms at 1), made on `device` so an 8B shape never touches the host."""
    gen = torch.Generator(device=device).manual_seed(seed)
    h, hd = config.hidden_size, config.head_dim

    def rand(*shape: int) -> torch.Tensor:
        return torch.empty(shape, device=device, dtype=dtype).normal_(0.0, 0.02, generator=gen)

    weights = {"model.embed_tokens.weight": rand(config.vocab_size, h),
               "model.norm.weight": torch.ones(h, device=device, dtype=dtype)}
    if not config.tie_word_embeddings:
        weights["lm_head.weight"] = rand(config.vocab_size, h)
    for i in range(config.num_layers):
        p = f"model.layers.{i}."
        weights[p + "input_layernorm.weight"] = torch.ones(h, device=device, dtype=dtype)
        weights[p + "post_attention_layernorm.weight"] = torch.ones(h, device=device, dtype=dtype)
        weights[p + "self_attn.q_proj.weight"] = rand(config.num_heads * hd, h)
        weights[p + "self_attn.k_proj.weight"] = rand(config.num_kv_heads * hd, h)
        weights[p + "self_attn.v_proj.weight"] = rand(config.num_kv_heads * hd, h)
        weights[p + "self_attn.o_proj.weight"] = rand(h, config.num_heads * hd)
        weights[p + "mlp.gate_proj.weight"] = rand(config.intermediate_size, h)
        weights[p + "mlp.up_proj.weight"] = rand(config.intermediate_size, h)
        weights[p + "mlp.down_proj.weight"] = rand(h, config.intermediate_size)
    return weights


def hf_weights(directory: Path, device: torch.device, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{directory}: no *.safetensors files")
    weights: dict[str, torch.Tensor] = {}
    for file in files:
        for name, tensor in load_file(str(file), device="cpu").items():
            weights[name] = tensor.to(device=device, dtype=dtype)
    return weights


def load_model_files(model: str, device: torch.device, dtype: torch.dtype,
                     cache_dir: str | None = None
                     ) -> tuple[ModelConfig, dict[str, torch.Tensor], Path | None]:
    """Config, HF-named weights, and the directory holding the tokenizer (None: the default's)."""
    config, directory = load_model_config(model, cache_dir)
    if directory is None:
        return config, dummy_weights(config, device, dtype), None
    return config, hf_weights(directory, device, dtype), directory
