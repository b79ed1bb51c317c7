"""Token sampling for a batch: greedy, temperature, top-k, top-p and min-p, seeded per request.

Each request owns a torch.Generator seeded from its `seed`, and draws exactly one number stream per
sampled token, so its tokens do not depend on what else is in the batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from services.executor.sequence import SamplingParams


@dataclass
class SamplingBatch:
    """Per-row parameters of the rows that sample, built on the scheduler's thread."""

    params: list[SamplingParams]
    generators: list[torch.Generator | None]  # None for greedy rows

    @property
    def all_greedy(self) -> bool:
        return all(p.greedy for p in self.params)


def make_generator(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def sample(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """logits [rows, vocab] float32 -> token ids [rows] (int64, on the CPU)."""
    greedy_tokens = logits.argmax(dim=-1)
    if batch.all_greedy:
        return greedy_tokens.cpu()
    rows = [i for i, p in enumerate(batch.params) if not p.greedy]
    params = [batch.params[i] for i in rows]
    index = torch.tensor(rows, device=logits.device)
    temperature = torch.tensor([p.temperature for p in params], device=logits.device)
    probs = _filtered_probs(logits[index] / temperature[:, None], params)
    probs = probs.cpu()
    tokens = greedy_tokens.cpu()
    for row, generator, p in zip(rows, (batch.generators[i] for i in rows), probs):
        # Exponential race: argmax(p / E) with E ~ Exp(1) draws from p, with one stream per row.
        noise = torch.empty_like(p).exponential_(generator=generator)
        tokens[row] = torch.argmax(p / noise)
    return tokens


def _filtered_probs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    device = logits.device
    top_k = [p.top_k if p.top_k > 0 else logits.shape[-1] for p in params]
    top_p = [p.top_p for p in params]
    min_p = [p.min_p for p in params]
    if any(k < logits.shape[-1] for k in top_k) or any(p < 1.0 for p in top_p):
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        rank = torch.arange(logits.shape[-1], device=device)[None, :]
        drop = rank >= torch.tensor(top_k, device=device)[:, None]
        sorted_probs = sorted_logits.masked_fill(drop, float("-inf")).softmax(dim=-1)
        # Keep the smallest head whose mass reaches top_p (the first token always stays).
        mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
        drop |= mass_before >= torch.tensor(top_p, device=device)[:, None]
        drop[:, 0] = False
        logits = torch.full_like(logits, float("-inf")).scatter(
            1, order, sorted_logits.masked_fill(drop, float("-inf")))
    probs = logits.softmax(dim=-1)
    if any(p > 0.0 for p in min_p):
        threshold = probs.max(dim=-1, keepdim=True).values * torch.tensor(min_p, device=device)[:, None]
        probs = probs.masked_fill(probs < threshold, 0.0)
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return probs
