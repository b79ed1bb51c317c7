"""Paged attention over the block-table KV cache, for a mixed batch in one launch.

A program handles BLOCK_M new tokens of one sequence for all the query heads that share one KV
head (GQA): its rows are (token, head) pairs, so each key/value tile is loaded once for the whole
group. Programs are laid out flat over every sequence's query tiles (a sequence's tiles start at
cu_seqlens[s] // BLOCK_M + s, so ranges never overlap and the grid wastes at most one program per
sequence); each finds its sequence by binary search. Keys are visited in tiles of BLOCK_N tokens
(one or several cache blocks, their ids gathered per key) with an online softmax in fp32.
A decode-only batch with too few programs to fill the GPU takes the split-KV path instead (flash
decoding): each program covers a slice of the context, and a second kernel merges the slices by
their log-sum-exp.
"""

from __future__ import annotations

import functools
import math

import torch
import triton
import triton.language as tl

from jetserve_kernels import kv_int8

LOG2E = 1.4426950408889634
MIN_ROWS = 16  # tl.dot needs at least 16 rows
KEY_TILE = 64  # keys per inner-loop step (at least one cache block)


@triton.jit
def _dequantize_rows(values, cache_ptr, rows, in_seq, HEAD_DIM: tl.constexpr, dtype: tl.constexpr):
    """int8 rows' codes times their group's fp16 scale plus its fp16 offset, stored after the
    row's codes, 4 bytes a group of 32 (jetserve_kernels/kv_int8.py), as `dtype`."""
    group = tl.arange(0, HEAD_DIM) // 32  # all 0 where head_dim is under 32: one group
    params = cache_ptr + rows[:, None] + HEAD_DIM + group[None, :] * 4
    scale = tl.load(params.to(tl.pointer_type(tl.float16)), mask=in_seq[:, None], other=0.0)
    offset = tl.load((params + 2).to(tl.pointer_type(tl.float16)), mask=in_seq[:, None],
                     other=0.0)
    return (values.to(tl.float32) * scale.to(tl.float32) + offset.to(tl.float32)).to(dtype)


@triton.jit
def _attend(q, acc, m_i, l_i, k_cache_ptr, v_cache_ptr, block_table_ptr, kv_head, positions,
            seq_len, first_tile, end_tile, stride_kb, stride_ko, stride_kh, stride_vb, stride_vo,
            stride_vh, scale_log2, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
            BLOCK_N: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr,
            INT8: tl.constexpr):
    """Online softmax of rows `q` (at absolute `positions`) over key tiles [first_tile, end_tile).
    An int8 cache's rows are dequantized as they load (their scales and offsets follow them)."""
    dims = tl.arange(0, HEAD_DIM)
    offsets = tl.arange(0, BLOCK_N)
    for tile in range(first_tile, end_tile):
        key_pos = tile * BLOCK_N + offsets
        in_seq = key_pos < seq_len
        block = tl.load(block_table_ptr + key_pos // BLOCK_SIZE, mask=in_seq, other=0).to(tl.int64)
        slot = key_pos % BLOCK_SIZE
        k_rows = block * stride_kb + slot * stride_ko + kv_head * stride_kh
        k = tl.load(k_cache_ptr + k_rows[:, None] + dims[None, :], mask=in_seq[:, None], other=0)
        if INT8:
            k = _dequantize_rows(k, k_cache_ptr, k_rows, in_seq, HEAD_DIM, q.dtype)
        elif UPCAST:
            k = k.to(tl.float32)
        scores = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale_log2
        scores = tl.where(key_pos[None, :] <= positions[:, None], scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, 1))
        # A row that has seen no visible key yet keeps m = -inf; exp2 of (-inf) - (-inf) is NaN.
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(scores - m_safe[:, None])
        v_rows = block * stride_vb + slot * stride_vo + kv_head * stride_vh
        v = tl.load(v_cache_ptr + v_rows[:, None] + dims[None, :], mask=in_seq[:, None], other=0)
        if INT8:
            v = _dequantize_rows(v, v_cache_ptr, v_rows, in_seq, HEAD_DIM, q.dtype)
        elif UPCAST:
            v = v.to(tl.float32)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        l_i = l_i * alpha + tl.sum(p, 1)
        m_i = m_new
    return acc, m_i, l_i


@triton.jit
def _find_sequence(cu_seqlens_q_ptr, tile_index, num_seqs, BLOCK_M: tl.constexpr):
    """The last sequence whose first query tile (cu_seqlens[s] // BLOCK_M + s) is <= tile_index."""
    low = 0
    high = num_seqs
    while low < high:
        middle = (low + high) // 2
        first_tile = tl.load(cu_seqlens_q_ptr + middle) // BLOCK_M + middle
        if first_tile <= tile_index:
            low = middle + 1
        else:
            high = middle
    return low - 1


@triton.jit
def _paged_attention_kernel(q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, block_tables_ptr,
                            cu_seqlens_q_ptr, seq_lens_ptr, num_seqs, scale_log2, stride_qt,
                            stride_qh, stride_ot, stride_oh, stride_kb, stride_ko, stride_kh,
                            stride_vb, stride_vo, stride_vh, stride_bt, GROUP: tl.constexpr,
                            GROUP_PAD: tl.constexpr, BLOCK_M: tl.constexpr,
                            HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                            BLOCK_N: tl.constexpr, PRECISION: tl.constexpr,
                            UPCAST: tl.constexpr, INT8: tl.constexpr):
    tile_index = tl.program_id(0)
    kv_head = tl.program_id(1)
    seq = _find_sequence(cu_seqlens_q_ptr, tile_index, num_seqs, BLOCK_M)
    q_start = tl.load(cu_seqlens_q_ptr + seq)
    q_len = tl.load(cu_seqlens_q_ptr + seq + 1) - q_start
    tile = tile_index - (q_start // BLOCK_M + seq)
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
    acc, m_i, l_i = _attend(
        q, acc, m_i, l_i, k_cache_ptr, v_cache_ptr, block_tables_ptr + seq.to(tl.int64) * stride_bt,
        kv_head, positions, seq_len, 0, last_position // BLOCK_N + 1, stride_kb, stride_ko,
        stride_kh, stride_vb, stride_vo, stride_vh, scale_log2, HEAD_DIM, BLOCK_SIZE, BLOCK_N,
        PRECISION, UPCAST, INT8)
    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    tl.store(out_ptr + q_rows[:, None] * stride_ot + head[:, None] * stride_oh + dims[None, :],
             out.to(out_ptr.dtype.element_ty), mask=valid[:, None])


@triton.jit
def _decode_split_kernel(q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, cu_seqlens_q_ptr,
                         seq_lens_ptr, partial_out_ptr, partial_lse_ptr, scale_log2, stride_qt,
                         stride_qh, stride_kb, stride_ko, stride_kh, stride_vb, stride_vo,
                         stride_vh, stride_bt, num_heads, num_splits, tiles_per_split,
                         GROUP: tl.constexpr, ROWS: tl.constexpr, HEAD_DIM: tl.constexpr,
                         BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
                         PRECISION: tl.constexpr, UPCAST: tl.constexpr, INT8: tl.constexpr):
    """One slice of one decode's context, for one KV head's query group: the slice's
    normalized output and its log2-sum-exp, merged later by _decode_merge_kernel."""
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    q_row = tl.load(cu_seqlens_q_ptr + seq)
    if tl.load(cu_seqlens_q_ptr + seq + 1) == q_row:  # no new token: nothing to attend
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    rows = tl.arange(0, ROWS)
    valid = rows < GROUP
    head = kv_head * GROUP + rows
    dims = tl.arange(0, HEAD_DIM)
    q = tl.load(q_ptr + q_row.to(tl.int64) * stride_qt + head[:, None] * stride_qh + dims[None, :],
                mask=valid[:, None], other=0.0)
    if UPCAST:
        q = q.to(tl.float32)
    positions = tl.zeros([ROWS], dtype=tl.int32) + seq_len - 1
    first_tile = split * tiles_per_split
    end_tile = tl.minimum(first_tile + tiles_per_split, tl.cdiv(seq_len, BLOCK_N))
    acc = tl.zeros([ROWS, HEAD_DIM], dtype=tl.float32)
    m_i = tl.full([ROWS], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([ROWS], dtype=tl.float32)
    acc, m_i, l_i = _attend(
        q, acc, m_i, l_i, k_cache_ptr, v_cache_ptr, block_tables_ptr + seq.to(tl.int64) * stride_bt,
        kv_head, positions, seq_len, first_tile, end_tile, stride_kb, stride_ko, stride_kh,
        stride_vb, stride_vo, stride_vh, scale_log2, HEAD_DIM, BLOCK_SIZE, BLOCK_N, PRECISION,
        UPCAST, INT8)
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
    q_row = tl.load(cu_seqlens_q_ptr + seq)
    if tl.load(cu_seqlens_q_ptr + seq + 1) == q_row:
        return
    splits = tl.arange(0, SPLITS_PAD)
    base = (seq.to(tl.int64) * num_heads + head) * num_splits
    lse = tl.load(partial_lse_ptr + base + splits, mask=splits < num_splits, other=float("-inf"))
    weights = tl.exp2(lse - tl.max(lse, 0))
    dims = tl.arange(0, HEAD_DIM)
    partial = tl.load(partial_out_ptr + (base + splits)[:, None] * HEAD_DIM + dims[None, :],
                      mask=(splits < num_splits)[:, None], other=0.0)
    out = tl.sum(partial * weights[:, None], 0) / tl.sum(weights, 0)
    tl.store(out_ptr + q_row.to(tl.int64) * stride_ot + head * stride_oh + dims,
             out.to(out_ptr.dtype.element_ty))


@functools.cache
def _compute_units(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4  # the CPU interpreter: a few splits, to exercise the path


def _num_splits(num_seqs: int, num_kv_heads: int, num_tiles: int, device: torch.device) -> int:
    """Enough programs to fill the GPU about four times over, each covering a key tile or more."""
    wanted = math.ceil(4 * _compute_units(device) / (num_seqs * num_kv_heads))
    return max(1, min(wanted, num_tiles))


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    block_tables: torch.Tensor, cu_seqlens_q: torch.Tensor, seq_lens: torch.Tensor,
                    scale: float, out: torch.Tensor | None = None, *, max_q_len: int | None = None,
                    max_seq_len: int | None = None, num_splits: int | None = None) -> torch.Tensor:
    """Causal attention for a batch mixing prefill chunks and decodes; see
    jetserve_kernels.reference. The cache may be int8 (jetserve_kernels/kv_int8.py): its rows are
    dequantized as they load.

    `max_q_len` and `max_seq_len` (when the caller knows them) avoid reading them back from the
    device; `num_splits` forces the split-KV decode path's slice count (decode-only batches)."""
    num_tokens, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, row = k_cache.shape
    int8 = kv_int8.is_int8(k_cache)
    assert row == (kv_int8.row_bytes(head_dim) if int8 else head_dim)
    assert num_heads % num_kv_heads == 0 and k_cache.shape == v_cache.shape
    assert q.stride(-1) == 1 and k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1
    assert head_dim == triton.next_power_of_2(head_dim) and head_dim >= 16
    assert block_size == triton.next_power_of_2(block_size) and block_size >= 16
    out = torch.empty_like(q) if out is None else out
    assert out.shape == q.shape and out.stride(-1) == 1
    num_seqs = block_tables.shape[0]
    if num_tokens == 0 or num_seqs == 0:
        return out
    group = num_heads // num_kv_heads
    group_pad = triton.next_power_of_2(group)
    key_tile = max(KEY_TILE, block_size)
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
        num_tiles = triton.cdiv(max_seq_len, key_tile)
        splits = num_splits or _num_splits(num_seqs, num_kv_heads, num_tiles, q.device)
        if splits > 1:
            tiles_per_split = triton.cdiv(num_tiles, splits)
            splits = triton.cdiv(num_tiles, tiles_per_split)
            partial_out = torch.empty((num_seqs, num_heads, splits, head_dim), dtype=torch.float32,
                                      device=q.device)
            partial_lse = torch.empty((num_seqs, num_heads, splits), dtype=torch.float32,
                                      device=q.device)
            _decode_split_kernel[(num_seqs, num_kv_heads, splits)](
                q, k_cache, v_cache, block_tables, cu_seqlens_q, seq_lens, partial_out,
                partial_lse, scale_log2, q.stride(0), q.stride(1), *common, num_heads, splits,
                tiles_per_split, GROUP=group, ROWS=max(MIN_ROWS, group_pad), HEAD_DIM=head_dim,
                BLOCK_SIZE=block_size, BLOCK_N=key_tile, PRECISION=precision, UPCAST=upcast,
                INT8=int8)
            _decode_merge_kernel[(num_seqs, num_heads)](
                partial_out, partial_lse, out, cu_seqlens_q, out.stride(0), out.stride(1),
                num_heads, splits, HEAD_DIM=head_dim, SPLITS_PAD=triton.next_power_of_2(splits))
            return out
    # Rows are (token, head) pairs: at least 16 for tl.dot, 64 when prefill chunks are present.
    block_m = max(1, (64 if max_q_len > 1 else MIN_ROWS) // group_pad)
    grid = (num_tokens // block_m + num_seqs, num_kv_heads)
    _paged_attention_kernel[grid](
        q, k_cache, v_cache, out, block_tables, cu_seqlens_q, seq_lens, num_seqs, scale_log2,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), *common, GROUP=group,
        GROUP_PAD=group_pad, BLOCK_M=block_m, HEAD_DIM=head_dim, BLOCK_SIZE=block_size,
        BLOCK_N=key_tile, PRECISION=precision, UPCAST=upcast, INT8=int8)
    return out
