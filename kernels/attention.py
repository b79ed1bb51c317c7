"""Paged attention over the block-table KV cache, for a mixed batch in one launch.

One program handles BLOCK_M new tokens of one sequence for all the query heads that share one KV
head (GQA): its rows are (token, head) pairs, so each key/value block is loaded once for the
whole group. Keys are visited block by block with an online softmax in fp32. A decode-only batch
with long contexts takes the split-KV path instead (flash decoding): each program covers a slice
of the context, and a second kernel merges the slices by their log-sum-exp.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

LOG2E = 1.4426950408889634
MIN_ROWS = 16  # tl.dot needs at least 16 rows
BLOCKS_PER_SPLIT_MIN = 4  # a split-KV program covers at least this many cache blocks


@triton.jit
def _attend_blocks(q, acc, m_i, l_i, k_cache_ptr, v_cache_ptr, block_table_ptr, kv_head,
                   positions, seq_len, first_block, end_block, stride_kb, stride_ko, stride_kh,
                   stride_vb, stride_vo, stride_vh, scale_log2, HEAD_DIM: tl.constexpr,
                   BLOCK_SIZE: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    """Online softmax of rows `q` over cache blocks [first_block, end_block)."""
    dims = tl.arange(0, HEAD_DIM)
    offsets = tl.arange(0, BLOCK_SIZE)
    for b in range(first_block, end_block):
        block = tl.load(block_table_ptr + b).to(tl.int64)
        key_pos = b * BLOCK_SIZE + offsets
        in_seq = (key_pos < seq_len)[:, None]
        k = tl.load(k_cache_ptr + block * stride_kb + offsets[:, None] * stride_ko
                    + kv_head * stride_kh + dims[None, :], mask=in_seq, other=0.0)
        if UPCAST:
            k = k.to(tl.float32)
        scores = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale_log2
        visible = key_pos[None, :] <= positions[:, None]
        scores = tl.where(visible, scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, 1))
        # A row that has seen no visible key yet keeps m = -inf; exp2 of (-inf) - (-inf) is NaN.
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(scores - m_safe[:, None])
        v = tl.load(v_cache_ptr + block * stride_vb + offsets[:, None] * stride_vo
                    + kv_head * stride_vh + dims[None, :], mask=in_seq, other=0.0)
        if UPCAST:
            v = v.to(tl.float32)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        l_i = l_i * alpha + tl.sum(p, 1)
        m_i = m_new
    return acc, m_i, l_i


@triton.jit
def _paged_attention_kernel(q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, block_tables_ptr,
                            cu_seqlens_q_ptr, seq_lens_ptr, scale_log2, stride_qt, stride_qh,
                            stride_ot, stride_oh, stride_kb, stride_ko, stride_kh, stride_vb,
                            stride_vo, stride_vh, stride_bt, GROUP: tl.constexpr,
                            GROUP_PAD: tl.constexpr, BLOCK_M: tl.constexpr,
                            HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                            PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    tile = tl.program_id(2)
    q_start = tl.load(cu_seqlens_q_ptr + seq)
    q_len = tl.load(cu_seqlens_q_ptr + seq + 1) - q_start
    if tile * BLOCK_M >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    rows = tl.arange(0, BLOCK_M * GROUP_PAD)
    token = tile * BLOCK_M + rows // GROUP_PAD
    head = kv_head * GROUP + rows % GROUP_PAD
    valid = (token < q_len) & (rows % GROUP_PAD < GROUP)
    positions = seq_len - q_len + token
    dims = tl.arange(0, HEAD_DIM)
    q_rows = (q_start + token).to(tl.int64)
    q = tl.load(q_ptr + q_rows[:, None] * stride_qt + head[:, None] * stride_qh + dims[None, :],
                mask=valid[:, None], other=0.0)
    if UPCAST:
        q = q.to(tl.float32)
    last_position = seq_len - q_len + tl.minimum((tile + 1) * BLOCK_M, q_len) - 1
    acc = tl.zeros([BLOCK_M * GROUP_PAD, HEAD_DIM], dtype=tl.float32)
    m_i = tl.full([BLOCK_M * GROUP_PAD], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M * GROUP_PAD], dtype=tl.float32)
    acc, m_i, l_i = _attend_blocks(
        q, acc, m_i, l_i, k_cache_ptr, v_cache_ptr, block_tables_ptr + seq.to(tl.int64) * stride_bt,
        kv_head, positions, seq_len, 0, last_position // BLOCK_SIZE + 1, stride_kb, stride_ko,
        stride_kh, stride_vb, stride_vo, stride_vh, scale_log2, HEAD_DIM, BLOCK_SIZE, PRECISION,
        UPCAST)
    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    tl.store(out_ptr + q_rows[:, None] * stride_ot + head[:, None] * stride_oh + dims[None, :],
             out.to(out_ptr.dtype.element_ty), mask=valid[:, None])


@triton.jit
def _decode_split_kernel(q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, cu_seqlens_q_ptr,
                         seq_lens_ptr, partial_out_ptr, partial_lse_ptr, scale_log2, stride_qt,
                         stride_qh, stride_kb, stride_ko, stride_kh, stride_vb, stride_vo,
                         stride_vh, stride_bt, num_heads, num_splits, blocks_per_split,
                         GROUP: tl.constexpr, ROWS: tl.constexpr, HEAD_DIM: tl.constexpr,
                         BLOCK_SIZE: tl.constexpr, PRECISION: tl.constexpr,
                         UPCAST: tl.constexpr):
    """One slice of one decode's context, for one KV head's query group: the slice's
    normalized output and its log2-sum-exp, merged later by _decode_merge_kernel."""
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq)
    q_row = tl.load(cu_seqlens_q_ptr + seq).to(tl.int64)
    rows = tl.arange(0, ROWS)
    valid = rows < GROUP
    head = kv_head * GROUP + rows
    dims = tl.arange(0, HEAD_DIM)
    q = tl.load(q_ptr + q_row * stride_qt + head[:, None] * stride_qh + dims[None, :],
                mask=valid[:, None], other=0.0)
    if UPCAST:
        q = q.to(tl.float32)
    positions = tl.zeros([ROWS], dtype=tl.int32) + seq_len - 1
    first_block = split * blocks_per_split
    end_block = tl.minimum(first_block + blocks_per_split, tl.cdiv(seq_len, BLOCK_SIZE))
    acc = tl.zeros([ROWS, HEAD_DIM], dtype=tl.float32)
    m_i = tl.full([ROWS], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([ROWS], dtype=tl.float32)
    acc, m_i, l_i = _attend_blocks(
        q, acc, m_i, l_i, k_cache_ptr, v_cache_ptr, block_tables_ptr + seq.to(tl.int64) * stride_bt,
        kv_head, positions, seq_len, first_block, end_block, stride_kb, stride_ko, stride_kh,
        stride_vb, stride_vo, stride_vh, scale_log2, HEAD_DIM, BLOCK_SIZE, PRECISION, UPCAST)
    empty = l_i == 0.0  # a slice past the end of this context
    out = acc / tl.where(empty, 1.0, l_i)[:, None]
    lse = tl.where(empty, float("-inf"), m_i + tl.log2(tl.where(empty, 1.0, l_i)))
    slot = (seq.to(tl.int64) * num_heads + head) * num_splits + split
    tl.store(partial_out_ptr + slot[:, None] * HEAD_DIM + dims[None, :], out, mask=valid[:, None])
    tl.store(partial_lse_ptr + slot, lse, mask=valid)


@triton.jit
def _decode_merge_kernel(partial_out_ptr, partial_lse_ptr, out_ptr, cu_seqlens_q_ptr, stride_ot,
                         stride_oh, num_heads, num_splits, HEAD_DIM: tl.constexpr,
                         SPLITS_PAD: tl.constexpr):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    splits = tl.arange(0, SPLITS_PAD)
    base = (seq.to(tl.int64) * num_heads + head) * num_splits
    lse = tl.load(partial_lse_ptr + base + splits, mask=splits < num_splits, other=float("-inf"))
    weights = tl.exp2(lse - tl.max(lse, 0))
    dims = tl.arange(0, HEAD_DIM)
    partial = tl.load(partial_out_ptr + (base + splits)[:, None] * HEAD_DIM + dims[None, :],
                      mask=(splits < num_splits)[:, None], other=0.0)
    out = tl.sum(partial * weights[:, None], 0) / tl.sum(weights, 0)
    q_row = tl.load(cu_seqlens_q_ptr + seq).to(tl.int64)
    tl.store(out_ptr + q_row * stride_ot + head * stride_oh + dims, out.to(out_ptr.dtype.element_ty))


def _num_splits(num_seqs: int, num_kv_heads: int, max_blocks: int, device: torch.device) -> int:
    """Enough programs to fill the GPU about four times over, each covering a few blocks."""
    if device.type == "cuda":
        units = torch.cuda.get_device_properties(device).multi_processor_count
    else:
        units = 4
    wanted = math.ceil(4 * units / (num_seqs * num_kv_heads))
    return max(1, min(wanted, max_blocks // BLOCKS_PER_SPLIT_MIN))


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    block_tables: torch.Tensor, cu_seqlens_q: torch.Tensor, seq_lens: torch.Tensor,
                    scale: float, out: torch.Tensor | None = None, *, max_q_len: int | None = None,
                    max_seq_len: int | None = None, num_splits: int | None = None) -> torch.Tensor:
    """Causal attention for a batch mixing prefill chunks and decodes; see kernels.reference.

    `max_q_len` and `max_seq_len` (when the caller knows them) avoid reading them back from the
    device; `num_splits` forces the split-KV decode path's slice count (decode-only batches)."""
    num_tokens, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    assert num_heads % num_kv_heads == 0 and q.stride(-1) == 1 and k_cache.stride(-1) == 1
    assert head_dim == triton.next_power_of_2(head_dim) and head_dim >= 16 and block_size >= 16
    out = torch.empty_like(q) if out is None else out
    num_seqs = block_tables.shape[0]
    if num_tokens == 0 or num_seqs == 0:
        return out
    group = num_heads // num_kv_heads
    group_pad = triton.next_power_of_2(group)
    # The interpreter (CPU tensors) mishandles tl.dot on bf16/fp16 operands (triton 3.9): there
    # the dots run in fp32 on the same 16-bit values; a GPU runs them on tensor cores.
    upcast = q.device.type != "cuda" and q.dtype != torch.float32
    precision = "ieee" if q.dtype == torch.float32 or upcast else "tf32"
    if max_q_len is None:
        max_q_len = int((cu_seqlens_q[1:] - cu_seqlens_q[:-1]).max())
    scale_log2 = scale * LOG2E
    common = (k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), v_cache.stride(0),
              v_cache.stride(1), v_cache.stride(2), block_tables.stride(0))
    if max_q_len == 1:
        if max_seq_len is None:
            max_seq_len = int(seq_lens.max())
        max_blocks = triton.cdiv(max_seq_len, block_size)
        splits = num_splits or _num_splits(num_seqs, num_kv_heads, max_blocks, q.device)
        if splits > 1:
            blocks_per_split = triton.cdiv(max_blocks, splits)
            splits = triton.cdiv(max_blocks, blocks_per_split)
            partial_out = torch.empty((num_seqs, num_heads, splits, head_dim), dtype=torch.float32,
                                      device=q.device)
            partial_lse = torch.empty((num_seqs, num_heads, splits), dtype=torch.float32,
                                      device=q.device)
            _decode_split_kernel[(num_seqs, num_kv_heads, splits)](
                q, k_cache, v_cache, block_tables, cu_seqlens_q, seq_lens, partial_out,
                partial_lse, scale_log2, q.stride(0), q.stride(1), *common, num_heads, splits,
                blocks_per_split, GROUP=group, ROWS=max(MIN_ROWS, group_pad), HEAD_DIM=head_dim,
                BLOCK_SIZE=block_size, PRECISION=precision, UPCAST=upcast)
            _decode_merge_kernel[(num_seqs, num_heads)](
                partial_out, partial_lse, out, cu_seqlens_q, out.stride(0), out.stride(1),
                num_heads, splits, HEAD_DIM=head_dim, SPLITS_PAD=triton.next_power_of_2(splits))
            return out
    # Rows are (token, head) pairs: at least 16 for tl.dot, 64 when prefill chunks are present.
    block_m = max(1, (64 if max_q_len > 1 else MIN_ROWS) // group_pad)
    grid = (num_seqs, num_kv_heads, triton.cdiv(max_q_len, block_m))
    _paged_attention_kernel[grid](
        q, k_cache, v_cache, out, block_tables, cu_seqlens_q, seq_lens, scale_log2, q.stride(0),
        q.stride(1), out.stride(0), out.stride(1), *common, GROUP=group, GROUP_PAD=group_pad,
        BLOCK_M=block_m, HEAD_DIM=head_dim, BLOCK_SIZE=block_size, PRECISION=precision,
        UPCAST=upcast)
    return out
