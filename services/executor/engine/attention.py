"""Attention backends: the per-layer ops that touch the paged KV cache, behind one small interface.

A backend turns a step's sequences into metadata once (`prepare`), then every layer calls its ops.
The torch backend runs anywhere and is the CPU default; the triton backend (jetserve_kernels/)
plugs in with the same methods.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from jetserve_kernels import kv_int8, reference

DECODE_GROUP_SIZE = 16  # decodes batched per SDPA call, after sorting by context length


@dataclass
class SeqSlice:
    """One sequence's part of a step: its new tokens are q[q_start : q_start + q_len]."""

    q_start: int
    q_len: int
    context_len: int  # tokens in the cache after this step, the new ones included
    block_table: list[int]


@dataclass
class DecodeGroup:
    q_index: torch.Tensor  # [G] rows of q
    block_ids: torch.Tensor  # [G * max_blocks], padded with block 0 (masked out)
    key_mask: torch.Tensor  # [G, 1, 1, max_blocks * block_size]


@dataclass
class PagedDecodes:
    """All decodes of a step for the CPU kernel, which reads the cache in place."""

    block_tables: torch.Tensor  # int32 [num_decodes, max_blocks]
    seq_lens: torch.Tensor  # int32 [num_decodes]
    q_rows: torch.Tensor  # int64 [num_decodes]


@dataclass
class PrefillSlice:
    q_start: int
    q_len: int
    # int32 blocks of the whole context; None: no earlier context and no prefill kernel, attend
    # to the fresh K/V only (as SDPA does for any slice with first_pos 0)
    block_ids: torch.Tensor | None
    first_pos: int = 0  # position of the first new token (tokens before it are cached)
    _mask: torch.Tensor | None = None

    def mask(self, block_size: int) -> torch.Tensor:
        """[q_len, cached blocks' tokens]: causal with an offset. Made on first use, on the
        model thread (a long chunk's mask is large enough for torch's parallel ops)."""
        if self._mask is None:
            keys = self.block_ids.shape[0] * block_size
            self._mask = (torch.arange(keys, device=self.block_ids.device)[None, :]
                          <= (self.first_pos + torch.arange(self.q_len,
                                                            device=self.block_ids.device))[:, None])
        return self._mask


@dataclass
class TorchAttentionMetadata:
    slot_mapping: torch.Tensor  # [num_tokens] cache slot = block_id * block_size + offset
    decode_groups: list[DecodeGroup]
    paged_decodes: PagedDecodes | None
    prefills: list[PrefillSlice]


def split_qkv(qkv: torch.Tensor, num_heads: int, num_kv_heads: int, head_dim: int):
    """Views of a fused QKV output [T, (H + 2 * KVH) * D] as q [T, H, D], k and v [T, KVH, D]."""
    q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
    return (qkv[:, :q_size].unflatten(1, (num_heads, head_dim)),
            qkv[:, q_size:q_size + kv_size].unflatten(1, (num_kv_heads, head_dim)),
            qkv[:, q_size + kv_size:].unflatten(1, (num_kv_heads, head_dim)))


class TorchBackend:
    """Paged attention in torch, or in the C++ kernels on a CPU with an fp32 or bf16 model
    (jetserve_kernels/cpu/): these read the cache in place, decodes all in one call and each
    prefill chunk in one (where the build has AVX-512, or AVX2 and FMA). Otherwise prefill
    chunks run one by one through SDPA over their gathered blocks, and decodes are gathered into
    groups of similar length for SDPA. With the kernels the element-wise ops and matmuls run on
    them too, and the activations between ops are fp32 whatever the weights' and the cache's
    dtype."""

    def __init__(self, block_size: int, device: torch.device, dtype: torch.dtype,
                 use_cpu_kernels: bool = True):
        self.block_size = block_size
        self.device = device
        self.cpu_kernels = None
        # bf16 weights and KV run on the kernels too, with fp32 activations between them.
        if use_cpu_kernels and device.type == "cpu" and dtype in (torch.float32, torch.bfloat16):
            from jetserve_kernels import cpu_ops

            self.cpu_kernels = cpu_ops.load()
        self.prefill_kernel = (self.cpu_kernels is not None
                               and self.cpu_kernels.prefill_attention_kernel())
        # A bf16 model on the kernels' bf16 dot products is batch-invariant: its matmuls give a
        # row the same bits at every row count (linear.py), and each prefill token's attention
        # gets the bits the decode kernel gives it (the decode kernel runs in the prefill
        # tiles' order of arithmetic, `invariant`; paged_prefill_as_decodes is those tiles, or
        # decode rows where they are not built or keep another order: AVX2 builds, which have
        # no bf16 products and so never run a model batch-invariant). A prefix recomputed after
        # a preemption, or resumed on another executor, then gets the very numbers its decodes
        # got: bf16 rounds the cache, so a difference in the last bit of fp32 could otherwise
        # grow into another token.
        self.batch_invariant = (self.cpu_kernels is not None and dtype == torch.bfloat16
                                and self.cpu_kernels.bf16_dot_products())

    def prepare(self, seqs: list[SeqSlice], slot_mapping: list[int]) -> TorchAttentionMetadata:
        device, bs = self.device, self.block_size
        decodes = [s for s in seqs if s.q_len == 1]
        paged = None
        if self.cpu_kernels is not None and decodes:
            width = max(len(s.block_table) for s in decodes)
            paged = PagedDecodes(
                block_tables=torch.tensor([s.block_table + [0] * (width - len(s.block_table))
                                           for s in decodes], dtype=torch.int32),
                seq_lens=torch.tensor([s.context_len for s in decodes], dtype=torch.int32),
                q_rows=torch.tensor([s.q_start for s in decodes], dtype=torch.long))
            decodes = []
        decodes.sort(key=lambda s: s.context_len)
        groups = []
        for start in range(0, len(decodes), DECODE_GROUP_SIZE):
            group = decodes[start:start + DECODE_GROUP_SIZE]
            max_blocks = -(-group[-1].context_len // bs)
            block_ids = [s.block_table[:max_blocks] + [0] * (max_blocks - len(s.block_table[:max_blocks]))
                         for s in group]
            lens = torch.tensor([s.context_len for s in group])
            key_mask = torch.arange(max_blocks * bs)[None, :] < lens[:, None]
            groups.append(DecodeGroup(
                q_index=torch.tensor([s.q_start for s in group], device=device),
                block_ids=torch.tensor(block_ids, device=device).view(-1),
                key_mask=key_mask[:, None, None, :].to(device)))
        prefills = []
        for s in seqs:
            if s.q_len == 1:
                continue
            if s.context_len == s.q_len and not self.prefill_kernel and not self.batch_invariant:
                prefills.append(PrefillSlice(s.q_start, s.q_len, None))
                continue
            num_blocks = -(-s.context_len // bs)
            prefills.append(PrefillSlice(
                s.q_start, s.q_len,
                torch.tensor(s.block_table[:num_blocks], dtype=torch.int32, device=device),
                first_pos=s.context_len - s.q_len))
        return TorchAttentionMetadata(
            slot_mapping=torch.tensor(slot_mapping, dtype=torch.long, device=device),
            decode_groups=groups, paged_decodes=paged, prefills=prefills)

    # --------------------------------------------------------------------------- per-layer ops

    # Without the C++ kernels the element-wise ops are the kernels' torch references.

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float,
                 residual: torch.Tensor | None = None):
        if self.cpu_kernels is None:
            return reference.rms_norm(x, weight, eps, residual)
        out = self.cpu_kernels.rms_norm(x, residual, weight, eps)  # adds x into residual in place
        return out if residual is None else (out, residual)

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        if self.cpu_kernels is None:
            return reference.silu_and_mul(x)
        return self.cpu_kernels.silu_and_mul(x)

    def rotary_and_cache(self, qkv: torch.Tensor, positions: torch.Tensor,
                         cos_sin_cache: torch.Tensor, k_cache: torch.Tensor,
                         v_cache: torch.Tensor, slot_mapping: torch.Tensor,
                         key_basis: tuple[torch.Tensor, torch.Tensor] | None = None):
        """Rotary on q and k in place in the fused QKV output, then with `key_basis` (an int8
        cache's (q_mul, k_mul), kv_int8.py) both moved into that basis, and k and v into their
        cache slots (quantized for an int8 cache); returns the q, k, v views."""
        num_kv_heads, head_dim = k_cache.shape[2], kv_int8.head_dim_of(k_cache)
        num_heads = qkv.shape[1] // head_dim - 2 * num_kv_heads
        if self.cpu_kernels is not None:
            q_mul, k_mul = key_basis or (None, None)
            self.cpu_kernels.rotary_and_cache(qkv, positions, cos_sin_cache, k_cache, v_cache,
                                              slot_mapping, num_heads, num_kv_heads, q_mul, k_mul)
            return split_qkv(qkv, num_heads, num_kv_heads, head_dim)
        q, k, v = split_qkv(qkv, num_heads, num_kv_heads, head_dim)
        reference.rotary_embedding(positions, q, k, cos_sin_cache)
        if key_basis is not None:
            kv_int8.to_key_basis_pair_(q, k, *key_basis)
        # The reference's write without its negative-slot filter: the engine never pads.
        if kv_int8.is_int8(k_cache):
            k, v = kv_int8.quantize(k), kv_int8.quantize(v)
        row = k_cache.shape[3]
        k_cache.view(-1, num_kv_heads, row).index_copy_(0, slot_mapping, k.to(k_cache.dtype))
        v_cache.view(-1, num_kv_heads, row).index_copy_(0, slot_mapping, v.to(v_cache.dtype))
        return split_qkv(qkv, num_heads, num_kv_heads, head_dim)

    def attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  k_cache: torch.Tensor, v_cache: torch.Tensor, scale: float,
                  meta: TorchAttentionMetadata) -> torch.Tensor:
        """q [T, H, D]; fresh k, v [T, KVH, D] (already in the cache); returns [T, H, D]."""
        out = torch.empty_like(q)
        if meta.paged_decodes is not None:
            d = meta.paged_decodes
            self.cpu_kernels.paged_decode_attention(q, k_cache, v_cache, d.block_tables, d.seq_lens,
                                                   d.q_rows, out, scale, self.batch_invariant)
        for group in meta.decode_groups:
            size = group.q_index.shape[0]
            keys = _gather_blocks(k_cache, group.block_ids, q.dtype)
            values = _gather_blocks(v_cache, group.block_ids, q.dtype)
            keys = keys.view(size, -1, *keys.shape[1:])
            values = values.view(size, -1, *values.shape[1:])
            query = q[group.q_index].unsqueeze(2)  # [G, H, 1, D]
            o = F.scaled_dot_product_attention(query, keys.transpose(1, 2), values.transpose(1, 2),
                                               attn_mask=group.key_mask, scale=scale,
                                               enable_gqa=True)
            out[group.q_index] = o.squeeze(2)
        prefills = meta.prefills
        if self.batch_invariant:
            # Each token as the decode kernel attends it, to the bits (at any head_dim: the
            # decode kernel's portable path too).
            for p in prefills:
                self.cpu_kernels.paged_prefill_as_decodes(q, k_cache, v_cache, p.block_ids,
                                                          p.q_start, p.q_len, p.first_pos, out,
                                                          scale)
            prefills = []
        if self.prefill_kernel and q.shape[2] in (64, 128):
            for p in prefills:
                self.cpu_kernels.paged_prefill_attention(q, k_cache, v_cache, p.block_ids,
                                                         p.q_start, p.q_len, p.first_pos, out,
                                                         scale, False)
            prefills = []
        for p in prefills:
            rows = slice(p.q_start, p.q_start + p.q_len)
            query = q[rows].transpose(0, 1).unsqueeze(0)
            mask = None
            if p.block_ids is None or p.first_pos == 0:
                # No earlier context: the fresh K/V as computed (unrounded by a bf16 or int8
                # cache), causal; e.g. a head_dim the prefill kernel does not take.
                keys, values = k[rows].unsqueeze(0), v[rows].unsqueeze(0)
            else:
                keys = _gather_blocks(k_cache, p.block_ids, q.dtype).unsqueeze(0)
                values = _gather_blocks(v_cache, p.block_ids, q.dtype).unsqueeze(0)
                mask = p.mask(self.block_size)
            o = F.scaled_dot_product_attention(query, keys.transpose(1, 2), values.transpose(1, 2),
                                               attn_mask=mask, is_causal=mask is None,
                                               scale=scale, enable_gqa=True)
            out[rows] = o.squeeze(0).transpose(0, 1)
        return out


def _gather_blocks(cache: torch.Tensor, block_ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The listed blocks' tokens, contiguous: [len(block_ids) * block_size, KVH, D], as `dtype`
    (an int8 cache dequantized, a bf16 one under an fp32 model widened).

    index_select over whole blocks is a row memcpy, several times faster than advanced indexing.
    """
    rows = cache.view(cache.shape[0], -1).index_select(0, block_ids).view(-1, *cache.shape[2:])
    return kv_int8.dequantize(rows, dtype) if kv_int8.is_int8(cache) else rows.to(dtype)
