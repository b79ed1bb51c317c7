"""A model's weights as HF-named tensors on the target device: from an HF directory (a GGUF file
is converted into one first, `shared/model_files.py`), or random for `dummy:<shape>`.
"""

from __future__ import annotations

from pathlib import Path

import torch

from services.executor.engine.linear import QuantizedWeight, quantize
from shared.model_files import (
    ModelConfig,
    gguf_hf_name,
    hf_row_order,
    load_model_config,
    resolve_model_path,
)

MATMULS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
           "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")


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
                     cache_dir: str | None = None, quantization: str = "none"
                     ) -> tuple[ModelConfig, dict[str, torch.Tensor | QuantizedWeight], Path | None]:
    """Config, HF-named weights (the matmuls' quantized when `quantization` asks for it), and
    the directory holding the tokenizer (None: the default's)."""
    if quantization != "none" and device.type != "cpu":
        raise ValueError(f"model.quantization {quantization!r} runs on the CPU engine only; "
                         f"on {device.type} use none")
    config, directory = load_model_config(model, cache_dir)
    weights = (dummy_weights(config, device, dtype) if directory is None
               else hf_weights(directory, device, dtype))
    if quantization == "none":
        return config, weights, directory
    if "lm_head.weight" not in weights:  # tied: the lookup keeps the dense table
        weights["lm_head.weight"] = weights["model.embed_tokens.weight"]
    names = ["lm_head.weight"] + [f"model.layers.{i}.{m}.weight"
                                  for i in range(config.num_layers) for m in MATMULS]
    if quantization == "auto":
        source = resolve_model_path(model)
        if isinstance(source, Path) and source.is_file():
            weights.update(gguf_blocks(source, config, set(names)))
        return config, weights, directory
    bits = {"int8": 8, "int4": 4}[quantization]
    for name in names:
        weights[name] = quantize(weights[name], bits)
    return config, weights, directory


# GGUF blocks of 32 weights kept as they are, by their size in bytes
_Q_BLOCK_BYTES = {"Q8_0": 34, "Q4_0": 18, "Q4_1": 20}


def gguf_blocks(path: Path, config: ModelConfig, names: set[str]) -> dict[str, QuantizedWeight]:
    """The GGUF's Q8_0, Q4_0 and Q4_1 matrices among `names`, in their own blocks (no rounding
    twice): Q8_0 becomes int8, Q4_x int4. Other K-quants are quantized again from their
    dequantized values, to int8 above 4.5 bits a weight and int4 below; float ones stay dense."""
    import numpy as np
    from gguf import GGUFReader
    from gguf.constants import GGML_QUANT_SIZES
    from gguf.quants import dequantize

    reader = GGUFReader(str(path))
    out: dict[str, QuantizedWeight] = {}
    for tensor in reader.tensors:
        named = gguf_hf_name(tensor.name)
        if named is None:
            continue
        name, gguf_kind = named
        if gguf_kind == "token_embd" and config.tie_word_embeddings:
            name = "lm_head.weight"  # the output projection reads the embedding's blocks
        if name not in names:
            continue
        kind = tensor.tensor_type.name
        raw = hf_row_order(np.asarray(tensor.data), gguf_kind, config)
        rows = raw.shape[0]
        if kind in _Q_BLOCK_BYTES:
            blocks = np.ascontiguousarray(raw).reshape(rows, -1, _Q_BLOCK_BYTES[kind])
            scale = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
            if kind == "Q8_0":
                q = blocks[..., 2:].copy().view(np.int8).reshape(rows, -1)
                out[name] = QuantizedWeight(8, torch.from_numpy(q), torch.from_numpy(scale))
                continue
            if kind == "Q4_1":
                low = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
                q = blocks[..., 4:]
            else:  # Q4_0: w = d * (q - 8)
                low, q = -8 * scale, blocks[..., 2:]
            out[name] = QuantizedWeight(4, torch.from_numpy(np.ascontiguousarray(q).reshape(rows, -1)),
                                        torch.from_numpy(scale), torch.from_numpy(low))
        elif kind not in ("F32", "F16", "BF16"):
            block, size = GGML_QUANT_SIZES[tensor.tensor_type]
            bits = 8 if size * 8 / block > 4.5 else 4
            dense = np.asarray(dequantize(tensor.data, tensor.tensor_type), dtype=np.float32)
            out[name] = quantize(torch.from_numpy(np.ascontiguousarray(
                hf_row_order(dense, gguf_kind, config))), bits)
    return out
