"""A Llama-family decoder over a flattened token batch: no padding, sequences side by side.

RMSNorm, rotary embeddings (rotate-half), grouped-query attention through a backend that reads and
writes the paged KV cache, SwiGLU MLP, tied or untied output embeddings. Q/K/V and gate/up are
fused into one matmul each; matmuls run on dense or quantized weights (linear.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from jetserve_kernels import kv_int8
from services.executor.engine import huge_pages
from services.executor.engine.linear import (DenseLinear, QuantizedLinear, QuantizedWeight,
                                             concat, int8_activations, make_linear)
from shared.model_files import ModelConfig

Linear = DenseLinear | QuantizedLinear


@dataclass
class LayerWeights:
    input_norm: torch.Tensor
    qkv_proj: Linear  # [(H + 2 * KVH) * D, hidden]
    o_proj: Linear
    post_norm: torch.Tensor
    gate_up_proj: Linear  # [2 * intermediate, hidden]
    down_proj: Linear


@dataclass
class KvSegment:
    """Consecutive rows of a step whose sequences keep their KV in one pool: the backend's
    metadata for them (rows counted from `start`) and that pool's (K, V) caches, one per layer.
    A step has one segment, or one per KV pool (kv_cache.compress_below_priority)."""

    meta: object
    caches: list[tuple[torch.Tensor, torch.Tensor]]
    start: int = 0
    stop: int | None = None  # None: to the end of the step


def rotary_cos_sin(config: ModelConfig, max_position: int, device: torch.device) -> torch.Tensor:
    """[max_position, head_dim]: cos of each rotary frequency in the first half, sin in the second."""
    dim = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    freqs = torch.outer(torch.arange(max_position, dtype=torch.float32), inv_freq)
    return torch.cat((freqs.cos(), freqs.sin()), dim=-1).to(device)


class LlamaModel:
    def __init__(self, config: ModelConfig, weights: dict, backend, max_position: int,
                 quantized_activations: str = "float32", amx: str = "auto",
                 huge_pages_on: bool = True):
        self.config = config
        self.backend = backend
        self.scale = config.head_dim ** -0.5
        kernels = backend.cpu_kernels
        int8_acts = any(isinstance(w, QuantizedWeight) for w in weights.values()) and \
            int8_activations(quantized_activations, kernels)
        embed_tokens = weights.pop("model.embed_tokens.weight")
        lm_head = weights.pop("lm_head.weight", embed_tokens)
        arena = huge_pages.arena_if(kernels is not None and huge_pages_on)

        def linear(weight: torch.Tensor | QuantizedWeight) -> Linear:
            """The matmul for a weight, its packed copy moved into huge pages at once, so the
            next one's packing reuses what the move freed (placed at the end, the load's peak
            held every packed weight twice)."""
            made = make_linear(weight, kernels, int8_acts, amx)
            if arena is not None:
                made.place(arena)
            return made

        self.lm_head = linear(lm_head)
        # A tied table is looked up in the output projection's own (maybe packed) copy.
        tied = lm_head is embed_tokens and isinstance(self.lm_head, DenseLinear)
        # Activations are fp32 where the CPU kernels run (bf16 weights included), else the
        # weights' dtype; norm weights (a vector a layer) are kept in the activations' dtype.
        act = torch.float32 if kernels is not None else embed_tokens.dtype
        if tied:
            rows = self.lm_head.rows  # bound now: profilers may wrap lm_head later
            self.embed = lambda ids: rows(ids).to(act)
        else:
            self.embed = lambda ids: F.embedding(ids, embed_tokens).to(act)
        self.norm = weights.pop("model.norm.weight").to(act)
        self.layers = []
        for i in range(config.num_layers):
            def take(*names: str, prefix: str = f"model.layers.{i}.") -> Linear:
                return linear(concat([weights.pop(prefix + n + ".weight") for n in names]))

            self.layers.append(LayerWeights(
                input_norm=weights.pop(f"model.layers.{i}.input_layernorm.weight").to(act),
                qkv_proj=take("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
                o_proj=take("self_attn.o_proj"),
                post_norm=weights.pop(f"model.layers.{i}.post_attention_layernorm.weight").to(act),
                gate_up_proj=take("mlp.gate_proj", "mlp.up_proj"),
                down_proj=take("mlp.down_proj"),
            ))
        if arena is not None:
            huge_pages.release_freed()
        self.cos_sin_cache = rotary_cos_sin(config, max_position, embed_tokens.device)
        self.q_size = config.num_heads * config.head_dim
        # An int8 cache's key basis, (q_mul, k_mul) a layer (kv_int8.py): set where the engine
        # has an int8 pool, from measure_key_squares. Other caches keep q and k as they are.
        self.key_basis: list[tuple[torch.Tensor, torch.Tensor]] | None = None
        self._key_squares: list[list[torch.Tensor]] | None = None

    def matmuls(self) -> str:
        """Where the layers' matmuls run, for the executor's start-up log: "bf16 on avx512" or
        "bf16 on amx" (a bf16 model's pairs), "int8 weights, int8 activations, many rows on
        amx" and the like, "fp32 on the kernels", or "torch"."""
        first = self.layers[0].qkv_proj if self.layers else self.lm_head
        if getattr(first, "pairs", False):
            return f"bf16 on {first.units}"
        if isinstance(first, QuantizedLinear):
            acts = ", int8 activations" if first.int8_activations else ""
            return f"int{first.weight.bits} weights{acts}, many rows on {first.many_rows}"
        if getattr(first, "many_rows", None) is not None:
            return f"bf16 weights, many rows on {first.many_rows}"
        return "fp32 on the kernels" if first.kernels is not None else "torch"

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                segments: list[KvSegment], logits_indices: torch.Tensor) -> torch.Tensor:
        """Logits [len(logits_indices), vocab] for the chosen rows of the flattened batch."""
        cfg, ops = self.config, self.backend
        num_tokens = input_ids.shape[0]
        hidden = self.embed(input_ids)
        residual = None
        for i, layer in enumerate(self.layers):
            if residual is None:
                residual = hidden
                hidden = ops.rms_norm(hidden, layer.input_norm, cfg.rms_norm_eps)
            else:
                hidden, residual = ops.rms_norm(hidden, layer.input_norm, cfg.rms_norm_eps, residual)
            qkv = layer.qkv_proj(hidden)
            if len(segments) == 1:
                attn = self._attend(qkv, positions, segments[0], i)
            else:  # the matmuls run on the whole step; attention pool by pool
                attn = torch.cat([self._attend(qkv[s.start:s.stop], positions[s.start:s.stop], s, i)
                                  for s in segments])
            hidden = layer.o_proj(attn.view(num_tokens, self.q_size))
            hidden, residual = ops.rms_norm(hidden, layer.post_norm, cfg.rms_norm_eps, residual)
            hidden = layer.down_proj(ops.silu_and_mul(layer.gate_up_proj(hidden)))
        # Only the rows that sample need the final norm and the (large) output projection.
        hidden = hidden[logits_indices]
        residual = residual[logits_indices]
        hidden, _ = ops.rms_norm(hidden, self.norm, cfg.rms_norm_eps, residual)
        return self.lm_head(hidden).float()

    def _attend(self, qkv: torch.Tensor, positions: torch.Tensor, segment: KvSegment,
                layer: int) -> torch.Tensor:
        """Rotary, the cache write and attention for one segment's rows of a layer."""
        ops, (k_cache, v_cache) = self.backend, segment.caches[layer]
        basis = None
        if self.key_basis is not None and kv_int8.is_int8(k_cache):
            basis = self.key_basis[layer]
        q, k, v = ops.rotary_and_cache(qkv, positions, self.cos_sin_cache, k_cache, v_cache,
                                       segment.meta.slot_mapping, basis)
        if self._key_squares is not None:
            q_sq, k_sq = self._key_squares[layer]
            group = self.config.num_heads // self.config.num_kv_heads
            q_sq += q.double().unflatten(1, (-1, group)).square().sum((0, 2)).cpu()
            k_sq += k.double().square().sum(0).cpu()
        return ops.attention(q, k, v, k_cache, v_cache, self.scale, segment.meta)

    def measure_key_squares(self, input_ids: torch.Tensor, positions: torch.Tensor,
                            segment: KvSegment) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """One forward pass over a cache that is not int8, measuring each layer's post-rotary
        queries and keys: per layer (q, k) [KVH, D] float64, the mean square of each channel
        (a KV head's query heads pooled), for kv_int8.key_balance."""
        cfg = self.config
        self._key_squares = [[torch.zeros(cfg.num_kv_heads, cfg.head_dim, dtype=torch.float64)
                              for _ in range(2)] for _ in range(cfg.num_layers)]
        try:
            self.forward(input_ids, positions, [segment], positions.new_zeros(1))
            group = cfg.num_heads // cfg.num_kv_heads
            rows = input_ids.shape[0]
            return [(q / (rows * group), k / rows) for q, k in self._key_squares]
        finally:
            self._key_squares = None
