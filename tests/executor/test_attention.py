"""The torch attention backend: the CPU kernel, the SDPA path and full recomputation agree."""

import random

import pytest
import torch

from services.executor.engine.attention import SeqSlice, TorchBackend

BLOCK = 16
HEADS, KV_HEADS, DIM = 8, 2, 32


def reference(q_rows, keys, values, scale):
    """Causal attention of the last len(q_rows) positions over `keys`, one sequence, in fp64."""
    n, ctx = q_rows.shape[0], keys.shape[0]
    group = HEADS // KV_HEADS
    k = keys.double().repeat_interleave(group, dim=1)
    v = values.double().repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q_rows.double(), k) * scale
    allowed = torch.arange(ctx)[None, :] <= (ctx - n + torch.arange(n))[:, None]
    scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).float()


def build_batch(seed, specs):
    """specs: (context_len, new_tokens) per sequence; returns cache, q, slices and per-seq K/V."""
    rng = random.Random(seed)
    torch.manual_seed(seed)
    num_blocks = 64
    k_cache = torch.zeros(num_blocks, BLOCK, KV_HEADS, DIM)
    v_cache = torch.zeros_like(k_cache)
    free = list(range(num_blocks))
    rng.shuffle(free)
    slices, kv, q_start = [], [], 0
    for ctx, new in specs:
        table = [free.pop() for _ in range(-(-ctx // BLOCK))]
        keys, values = torch.randn(ctx, KV_HEADS, DIM), torch.randn(ctx, KV_HEADS, DIM)
        for pos in range(ctx):
            k_cache[table[pos // BLOCK], pos % BLOCK] = keys[pos]
            v_cache[table[pos // BLOCK], pos % BLOCK] = values[pos]
        slices.append(SeqSlice(q_start, new, ctx, table))
        kv.append((keys, values))
        q_start += new
    q = torch.randn(q_start, HEADS, DIM)
    return k_cache, v_cache, q, slices, kv


@pytest.mark.parametrize("use_cpu_kernel", [False, True])
def test_mixed_batch_matches_reference(use_cpu_kernel):
    # Decodes ending mid-block and on a block edge, a fresh prefill, a chunk after cached context.
    specs = [(37, 1), (16, 1), (100, 1), (23, 23), (70, 30), (1, 1)]
    k_cache, v_cache, q, slices, kv = build_batch(0, specs)
    backend = TorchBackend(BLOCK, torch.device("cpu"), torch.float32, use_cpu_kernels=use_cpu_kernel)
    if use_cpu_kernel:
        assert backend.cpu_kernels is not None, "the C++ kernels did not build"
    meta = backend.prepare(slices, slot_mapping=[0] * q.shape[0])
    scale = DIM ** -0.5
    fresh_k = torch.cat([keys[ctx - new:] for (keys, _), (ctx, new) in zip(kv, specs)])
    fresh_v = torch.cat([values[ctx - new:] for (_, values), (ctx, new) in zip(kv, specs)])
    out = backend.attention(q, fresh_k, fresh_v, k_cache, v_cache, scale, meta)
    for s, (keys, values) in zip(slices, kv):
        rows = slice(s.q_start, s.q_start + s.q_len)
        expected = reference(q[rows], keys, values, scale)
        torch.testing.assert_close(out[rows], expected, atol=2e-5, rtol=1e-4)


def test_kernel_reads_strided_queries():
    k_cache, v_cache, _, slices, _ = build_batch(1, [(40, 1), (9, 1)])
    qkv = torch.randn(2, (HEADS + 2 * KV_HEADS) * DIM)
    q = qkv[:, :HEADS * DIM].view(2, HEADS, DIM)  # a view with a row stride, as in the model
    outs = []
    for use in (False, True):
        backend = TorchBackend(BLOCK, torch.device("cpu"), torch.float32, use_cpu_kernels=use)
        meta = backend.prepare(slices, slot_mapping=[0, 0])
        outs.append(backend.attention(q, None, None, k_cache, v_cache, 0.1, meta))
    torch.testing.assert_close(outs[0], outs[1], atol=1e-5, rtol=1e-5)
