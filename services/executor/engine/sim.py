"""The simulated forward pass (`--model sim:<profile>`, docs/scheduling.md "Simulated executors"): the engine, its scheduler,
block manager and prefix cache run as they do for a real model, but a step is a sleep as long as
a cost model says that batch would take on the profile's hardware, and the sampled tokens are
synthetic. A sim executor uses almost no CPU, so many of them fit on one machine.

The profiles and their cost model are in `shared/sim_profiles`.

Synthetic tokens: the token at output index i of a request with seed s is a fixed function of
(s, i) in the tokenizer's ordinary range. Without `ignore_eos`, a request stops with EOS at
index floor(max_tokens * f), f drawn from (s) uniformly in the profile's `eos_fraction` range;
profiles without one run every request to `max_tokens`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from services.executor.engine.scheduler import ScheduledSeq
from shared.sim_profiles import SimProfile

FIRST_ORDINARY_TOKEN = 17  # ids below are the default tokenizer's special tokens
_MIX = 0x9E3779B97F4A7C15  # odd 64-bit constants for a cheap integer hash
_MASK = (1 << 64) - 1


def _hash(*values: int) -> int:
    h = 0
    for v in values:
        h = ((h ^ (v & _MASK)) * _MIX) & _MASK
        h ^= h >> 29
    return h


def synthetic_token(seed: int, index: int, vocab_size: int) -> int:
    return FIRST_ORDINARY_TOKEN + _hash(seed, index) % (vocab_size - FIRST_ORDINARY_TOKEN)


def synthetic_length(seed: int, max_tokens: int, eos_fraction: tuple[float, float]) -> int:
    """The output index at which a request (without ignore_eos) emits EOS."""
    low, high = eos_fraction
    fraction = low + (high - low) * (_hash(seed, -1) % 10_000) / 10_000
    return max(0, min(max_tokens - 1, int(max_tokens * fraction)))


def step_features(batch: list[ScheduledSeq]) -> tuple[int, int, int, int]:
    """(new tokens, sum of context lengths, query-key pairs, sequences): what a step costs."""
    new = kv = pairs = 0
    for item in batch:
        n, start = item.num_new_tokens, item.start_pos
        new += n
        kv += start + n
        pairs += n * start + n * (n + 1) // 2
    return new, kv, pairs, len(batch)


@dataclass
class SimStep:
    sleep_s: float
    tokens: list[int]


class SimRunner:
    """ModelRunner's interface, with the forward pass replaced by the cost model's wait."""

    def __init__(self, profile: SimProfile, vocab_size: int, eos_token_id: int | None):
        self.profile = profile
        self.vocab_size = vocab_size
        self.eos_token_id = eos_token_id

    def prepare(self, batch: list[ScheduledSeq]) -> SimStep:
        features = step_features(batch)
        tokens = [self._token(item.seq) for item in batch if item.samples]
        return SimStep(sleep_s=self.profile.cost.ms(*features) / 1e3, tokens=tokens)

    def _token(self, seq) -> int:
        index = seq.num_tokens - 1 - seq.num_prompt_tokens  # the one this step samples
        sampling = seq.sampling
        eos = self.profile.eos_fraction
        if (eos is not None and not sampling.ignore_eos and self.eos_token_id is not None
                and index == synthetic_length(sampling.seed, sampling.max_tokens, eos)):
            return self.eos_token_id
        return synthetic_token(sampling.seed, index, self.vocab_size)

    def execute(self, step: SimStep) -> list[int]:
        """Model thread: wait as long as the step would take."""
        time.sleep(step.sleep_s)
        return step.tokens

    def reset(self) -> None:
        pass
