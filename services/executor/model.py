"""A Llama-family decoder over a flattened token batch: no padding, sequences side by side.

RMSNorm, rotary embeddings (rotate-half), grouped-query attention through a backend that reads and
writes the paged KV cache, SwiGLU MLP, tied or untied output embeddings. Q/K/V and gate/up are
fused into one matmul each.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from shared.model_files import ModelConfig


@dataclass
class LayerWeights:
    input_norm: torch.Tensor
    qkv_proj: torch.Tensor  # [(H + 2 * KVH) * D, hidden]
    o_proj: torch.Tensor
    post_norm: torch.Tensor
    gate_up_proj: torch.Tensor  # [2 * intermediate, hidden]
    down_proj: torch.Tensor


def rotary_cos_sin(config: ModelConfig, max_position: int, device: torch.device) -> torch.Tensor:
    """[max_position, head_dim]: cos of each rotary frequency in the first half, sin in the second."""
    dim = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    freqs = torch.outer(torch.arange(max_position, dtype=torch.float32), inv_freq)
    return torch.cat((freqs.cos(), freqs.sin()), dim=-1).to(device)


class LlamaModel:
    def __init__(self, config: ModelConfig, weights: dict[str, torch.Tensor], backend,
                 max_position: int):
        self.config = config
        self.backend = backend
        self.scale = config.head_dim ** -0.5
        self.embed_tokens = weights.pop("model.embed_tokens.weight")
        self.lm_head = weights.pop("lm_head.weight", self.embed_tokens)
        self.norm = weights.pop("model.norm.weight")
        self.layers = []
        for i in range(config.num_layers):
            def take(name: str, prefix: str = f"model.layers.{i}.") -> torch.Tensor:
                return weights.pop(prefix + name)

            self.layers.append(LayerWeights(
                input_norm=take("input_layernorm.weight"),
                qkv_proj=torch.cat([take("self_attn.q_proj.weight"), take("self_attn.k_proj.weight"),
                                    take("self_attn.v_proj.weight")]),
                o_proj=take("self_attn.o_proj.weight"),
                post_norm=take("post_attention_layernorm.weight"),
                gate_up_proj=torch.cat([take("mlp.gate_proj.weight"), take("mlp.up_proj.weight")]),
                down_proj=take("mlp.down_proj.weight"),
            ))
        self.cos_sin_cache = rotary_cos_sin(config, max_position, self.embed_tokens.device)
        self.q_size = config.num_heads * config.head_dim
        self.kv_size = config.num_kv_heads * config.head_dim

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn_meta,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                logits_indices: torch.Tensor) -> torch.Tensor:
        """Logits [len(logits_indices), vocab] for the chosen rows of the flattened batch."""
        cfg, ops = self.config, self.backend
        num_tokens = input_ids.shape[0]
        hidden = F.embedding(input_ids, self.embed_tokens)
        residual = None
        for layer, (k_cache, v_cache) in zip(self.layers, kv_caches):
            if residual is None:
                residual = hidden
                hidden = ops.rms_norm(hidden, layer.input_norm, cfg.rms_norm_eps)
            else:
                hidden, residual = ops.rms_norm(hidden, layer.input_norm, cfg.rms_norm_eps, residual)
            qkv = F.linear(hidden, layer.qkv_proj)
            q = qkv[:, :self.q_size].view(num_tokens, cfg.num_heads, cfg.head_dim)
            k = qkv[:, self.q_size:self.q_size + self.kv_size].view(
                num_tokens, cfg.num_kv_heads, cfg.head_dim)
            v = qkv[:, self.q_size + self.kv_size:].view(num_tokens, cfg.num_kv_heads, cfg.head_dim)
            ops.rotary_embedding(positions, q, k, self.cos_sin_cache)
            ops.reshape_and_cache(k, v, k_cache, v_cache, attn_meta.slot_mapping)
            attn = ops.attention(q, k, v, k_cache, v_cache, self.scale, attn_meta)
            hidden = F.linear(attn.view(num_tokens, self.q_size), layer.o_proj)
            hidden, residual = ops.rms_norm(hidden, layer.post_norm, cfg.rms_norm_eps, residual)
            hidden = F.linear(ops.silu_and_mul(F.linear(hidden, layer.gate_up_proj)), layer.down_proj)
        # Only the rows that sample need the final norm and the (large) output projection.
        hidden = hidden[logits_indices]
        residual = residual[logits_indices]
        hidden, _ = ops.rms_norm(hidden, self.norm, cfg.rms_norm_eps, residual)
        return F.linear(hidden, self.lm_head).float()
