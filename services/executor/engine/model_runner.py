"""Runs one scheduled step: turns scheduled sequences into tensors, runs the model, samples.

`prepare` runs on the engine loop's thread (it overlaps the previous step's execution); `execute`
runs on the single model thread. A token sampled by the step in flight is not known when the next
step is prepared: its slot in `input_ids` is filled on the model thread from that step's output.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch

from jetserve_kernels import kv_int8
from services.executor.engine import huge_pages
from services.executor.engine.attention import SeqSlice, TorchBackend
from services.executor.engine.model import KvSegment, LlamaModel
from services.executor.engine.sampler import SamplingBatch, sample, token_seed
from services.executor.engine.scheduler import ScheduledSeq
from services.executor.engine.sequence import SamplingParams
from shared.model_files import ModelConfig


@dataclass
class StepInputs:
    input_ids: torch.Tensor
    positions: torch.Tensor
    segments: list[KvSegment]  # one per KV pool the step's sequences use
    logits_indices: torch.Tensor
    pending_dst: torch.Tensor | None  # rows of input_ids to take from the previous step's output
    pending_src: torch.Tensor | None
    sampling: SamplingBatch


def kv_cache_row(config: ModelConfig, dtype: torch.dtype) -> int:
    """Elements of one (token, KV head) row of the cache: an int8 row carries its scales and
    offsets (jetserve_kernels/kv_int8.py)."""
    return kv_int8.row_bytes(config.head_dim) if dtype == torch.int8 else config.head_dim


def kv_cache_bytes_per_block(config: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    """K and V of every layer, for `block_size` tokens in a cache of `dtype`."""
    per_token = 2 * config.num_layers * config.num_kv_heads * kv_cache_row(config, dtype)
    return per_token * block_size * (1 if dtype == torch.int8 else torch.finfo(dtype).bits // 8)


def calibrate_key_basis(model: LlamaModel, block_size: int, device: torch.device) -> None:
    """Sets model.key_basis, the int8 cache's key basis (jetserve_kernels/kv_int8.py): one
    prefill of kv_int8.CALIBRATION_TOKENS seeded random token ids (no text favoured; the same
    ids, so the same basis, on every start), measuring each layer's post-rotary queries and keys.
    It runs on the plain torch ops (SDPA over the fresh keys and values, a scratch fp32 cache
    written and not read) whatever the engine's backend: statistics need no particular kernel,
    and under the Triton interpreter the kernels would take seconds."""
    cfg = model.config
    count = min(kv_int8.CALIBRATION_TOKENS, model.cos_sin_cache.shape[0])
    draws = random.Random(kv_int8.CALIBRATION_SEED)
    ids = torch.tensor([draws.randrange(cfg.vocab_size) for _ in range(count)], device=device)
    blocks = -(-count // block_size)
    shape = (blocks, block_size, cfg.num_kv_heads, cfg.head_dim)
    caches = [(torch.zeros(shape, device=device), torch.zeros(shape, device=device))
              for _ in range(cfg.num_layers)]
    plain = TorchBackend(block_size, device, torch.float32, use_cpu_kernels=False)
    meta = plain.prepare([SeqSlice(0, count, count, list(range(blocks)))], list(range(count)))
    backend, model.backend = model.backend, plain
    try:
        squares = model.measure_key_squares(ids, torch.arange(count, device=device),
                                            KvSegment(meta, caches))
    finally:
        model.backend = backend
    model.key_basis = [tuple(m.to(device) for m in kv_int8.key_basis(kv_int8.key_balance(q, k)))
                       for q, k in squares]


class ModelRunner:
    def __init__(self, model: LlamaModel, backend: TorchBackend, num_blocks: int, block_size: int,
                 dtype: torch.dtype, device: torch.device, int8_blocks: int = 0,
                 huge_pages_on: bool = False):
        """`dtype`: the KV cache's, the model's or int8 (jetserve_kernels/kv_int8.py).
        `int8_blocks`: the size of a second, int8 pool (pool 1:
        kv_cache.compress_below_priority)."""
        cfg = model.config
        self.model = model
        self.backend = backend
        self.device = device

        # On a CPU, the cache in huge pages where kv_cache.huge_pages asks (huge_pages.py), zeroed
        # as torch.zeros would: the memory is taken at start, not when the pool fills.
        arena = huge_pages.arena_if(device.type == "cpu" and huge_pages_on)

        def zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
            if arena is None:
                return torch.zeros(shape, dtype=dtype, device=device)
            return arena.empty(shape, dtype).zero_()

        def pool(blocks: int, dtype: torch.dtype) -> list[tuple[torch.Tensor, torch.Tensor]]:
            shape = (blocks, block_size, cfg.num_kv_heads, kv_cache_row(cfg, dtype))
            return [(zeros(shape, dtype), zeros(shape, dtype)) for _ in range(cfg.num_layers)]

        self.kv_pools = [pool(num_blocks, dtype)]
        if int8_blocks:
            self.kv_pools.append(pool(int8_blocks, torch.int8))
        if dtype == torch.int8 or int8_blocks:
            calibrate_key_basis(model, block_size, device)
        self.kv_caches = self.kv_pools[0]
        self.block_size = block_size
        self._last_sampled: torch.Tensor | None = None

    def prepare(self, batch: list[ScheduledSeq]) -> StepInputs:
        bs = self.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        slices: list[SeqSlice] = []
        logits_indices: list[int] = []
        pending_dst: list[int] = []
        pending_src: list[int] = []
        params, seeds = [], []
        segments: list[KvSegment] = []
        segment_start = 0  # the current segment's first row (a pool's sequences are consecutive)
        for index, item in enumerate(batch):
            seq, start, n = item.seq, item.start_pos, item.num_new_tokens
            if index and seq.pool != batch[index - 1].seq.pool:
                segments.append(self._segment(batch[index - 1].seq.pool, slices, slots,
                                              segment_start, len(input_ids)))
                slices, slots, segment_start = [], [], len(input_ids)
            q_start = len(input_ids) - segment_start
            known = seq.token_ids[start:start + n]
            input_ids.extend(known)
            if len(known) < n:  # the last input is the token sampled by the step in flight
                assert len(known) == n - 1 and seq.sample_row >= 0
                pending_dst.append(len(input_ids))
                pending_src.append(seq.sample_row)
                input_ids.append(0)
            positions.extend(range(start, start + n))
            table = seq.block_table
            slots.extend(table[p // bs] * bs + p % bs for p in range(start, start + n))
            slices.append(SeqSlice(q_start, n, start + n, table))
            if item.samples:
                seq.sample_row = len(logits_indices)
                logits_indices.append(len(input_ids) - 1)
                params.append(seq.sampling)
                # The token this row samples is output number num_output_tokens - 1 (the
                # scheduler counted it as pending).
                seeds.append(None if seq.sampling.greedy
                             else token_seed(seq.sampling.seed, seq.num_output_tokens - 1))
        segments.append(self._segment(batch[-1].seq.pool, slices, slots, segment_start, None))
        device = self.device
        return StepInputs(
            input_ids=torch.tensor(input_ids, dtype=torch.long, device=device),
            positions=torch.tensor(positions, dtype=torch.long, device=device),
            segments=segments,
            logits_indices=torch.tensor(logits_indices, dtype=torch.long, device=device),
            pending_dst=torch.tensor(pending_dst, device=device) if pending_dst else None,
            pending_src=torch.tensor(pending_src, device=device) if pending_src else None,
            sampling=SamplingBatch(params, seeds))

    def _segment(self, pool: int, slices: list[SeqSlice], slots: list[int], start: int,
                 stop: int | None) -> KvSegment:
        return KvSegment(self.backend.prepare(slices, slots), self.kv_pools[pool], start, stop)

    def execute(self, inputs: StepInputs) -> list[int]:
        """Model thread: run the step and return the sampled token of each sampling row."""
        if inputs.pending_dst is not None:
            inputs.input_ids[inputs.pending_dst] = self._last_sampled[inputs.pending_src]
        logits = self.model.forward(inputs.input_ids, inputs.positions, inputs.segments,
                                    inputs.logits_indices)
        sampled = sample(logits, inputs.sampling).to(self.device)
        self._last_sampled = sampled
        return sampled.tolist()

    def warm_up(self, prompt_len: int = 32) -> None:
        """A prefill and a decode before serving, on the thread that will run the steps, so the
        first request does not pay for the thread pool's start, lazy initialization (kernel
        compilation on a GPU) and first-touch page faults. Uses the first blocks of each pool,
        which no request holds yet."""
        bs = self.block_size
        greedy = SamplingBatch([SamplingParams(max_tokens=1, temperature=0.0)], [None])
        for caches in self.kv_pools:
            # Positions 0..length: within the pool and the rotary table (max_model_len rows).
            length = max(1, min(prompt_len, caches[0][0].shape[0] * bs - 1,
                                self.model.cos_sin_cache.shape[0] - 1))
            table = list(range(-(-(length + 1) // bs)))
            for start, n in ((0, length), (length, 1)):
                positions = list(range(start, start + n))
                slots = [table[p // bs] * bs + p % bs for p in positions]
                meta = self.backend.prepare([SeqSlice(0, n, start + n, table)], slots)
                self.execute(StepInputs(
                    input_ids=torch.zeros(n, dtype=torch.long, device=self.device),
                    positions=torch.tensor(positions, dtype=torch.long, device=self.device),
                    segments=[KvSegment(meta, caches)],
                    logits_indices=torch.tensor([n - 1], dtype=torch.long, device=self.device),
                    pending_dst=None, pending_src=None, sampling=greedy))
        self._last_sampled = None

    def reset(self) -> None:
        """Forget the state of a failed step (every request has been ended)."""
        self._last_sampled = None
