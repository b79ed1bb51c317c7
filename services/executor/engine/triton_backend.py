"""The triton attention backend: every per-layer op as a Triton kernel from jetserve_kernels/.

The default on CUDA. On a CPU it runs only under TRITON_INTERPRET=1 (tests), very slowly.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from jetserve_kernels.attention import paged_attention
from jetserve_kernels.elementwise import reshape_and_cache, rms_norm, rotary_embedding, silu_and_mul
from jetserve_kernels import kv_int8
from services.executor.engine.attention import SeqSlice, split_qkv


@dataclass
class TritonAttentionMetadata:
    slot_mapping: torch.Tensor  # int64 [num_tokens]
    block_tables: torch.Tensor  # int32 [num_seqs, max_blocks], padded with 0
    cu_seqlens_q: torch.Tensor  # int32 [num_seqs + 1]
    seq_lens: torch.Tensor  # int32 [num_seqs], context after this step
    max_q_len: int  # known on the host, so no layer reads them back from the device
    max_seq_len: int


class TritonBackend:
    def __init__(self, block_size: int, device: torch.device, dtype: torch.dtype):
        self.block_size = block_size
        self.device = device

    def prepare(self, seqs: list[SeqSlice], slot_mapping: list[int]) -> TritonAttentionMetadata:
        width = max(len(s.block_table) for s in seqs)
        cu_seqlens = [0]
        for s in seqs:
            assert s.q_start == cu_seqlens[-1], "sequences must be laid out back to back"
            cu_seqlens.append(s.q_start + s.q_len)
        pinned = self.device.type == "cuda"

        def tensor(values, dtype):
            return torch.tensor(values, dtype=dtype, pin_memory=pinned).to(self.device,
                                                                            non_blocking=True)

        return TritonAttentionMetadata(
            slot_mapping=tensor(slot_mapping, torch.long),
            block_tables=tensor([s.block_table + [0] * (width - len(s.block_table)) for s in seqs],
                                torch.int32),
            cu_seqlens_q=tensor(cu_seqlens, torch.int32),
            seq_lens=tensor([s.context_len for s in seqs], torch.int32),
            max_q_len=max(s.q_len for s in seqs), max_seq_len=max(s.context_len for s in seqs))

    cpu_kernels = None  # matmuls run on torch's (cuBLAS) kernels
    rms_norm = staticmethod(rms_norm)
    silu_and_mul = staticmethod(silu_and_mul)

    @staticmethod
    def rotary_and_cache(qkv: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor,
                         k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
                         key_basis: tuple[torch.Tensor, torch.Tensor] | None = None):
        """Rotary on q and k in place (then with `key_basis`, an int8 cache's, both into that
        basis: kv_int8.py), k and v into their cache slots (quantized for an int8 cache); the
        q, k, v views."""
        num_kv_heads, head_dim = k_cache.shape[2], kv_int8.head_dim_of(k_cache)
        q, k, v = split_qkv(qkv, qkv.shape[1] // head_dim - 2 * num_kv_heads, num_kv_heads, head_dim)
        rotary_embedding(positions, q, k, cos_sin_cache)
        if key_basis is not None:
            kv_int8.to_key_basis_pair_(q, k, *key_basis)
        reshape_and_cache(k, v, k_cache, v_cache, slot_mapping)
        return q, k, v

    def attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  k_cache: torch.Tensor, v_cache: torch.Tensor, scale: float,
                  meta: TritonAttentionMetadata) -> torch.Tensor:
        """The new tokens' K/V are already in the cache: attend through it alone."""
        return paged_attention(q, k_cache, v_cache, meta.block_tables, meta.cu_seqlens_q,
                                       meta.seq_lens, scale, max_q_len=meta.max_q_len,
                                       max_seq_len=meta.max_seq_len)
