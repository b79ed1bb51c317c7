"""A request's state inside the engine: its tokens, its KV blocks, and where it stands."""

from __future__ import annotations

import enum
from collections.abc import Hashable
from dataclasses import dataclass, field


class SeqStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


GREEDY_BELOW = 1e-5  # a temperature under this samples greedily


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    seed: int = 0
    stop: tuple[str, ...] = ()
    stop_token_ids: frozenset[int] = frozenset()
    ignore_eos: bool = False

    @property
    def greedy(self) -> bool:
        """Temperature 0, or so close to it (< 1e-5, as vLLM's) that dividing the logits by it
        would overflow: argmax either way."""
        return self.temperature < GREEDY_BELOW


@dataclass(eq=False)
class Sequence:
    key: Hashable  # the request's key in its engine (add_request's `key`)
    prompt_token_ids: list[int]
    sampling: SamplingParams
    priority: int = 5
    score: float | None = None  # the order: priority's score at dispatch (default: priority)
    aged: bool = False  # waited past the aging bound: ahead of every request that has not
    arrival_index: int = 0  # admission order; ties in score go to the earlier one
    arrival_time: float = 0.0
    pool: int = 0  # the KV pool its blocks come from (block_manager.KvPools; 1: int8)
    deadline: float | None = None  # monotonic: when it must be complete (deadline_ms)

    token_ids: list[int] = field(default_factory=list)  # prompt + the outputs known so far
    num_pending: int = 0  # tokens sampled by a step still in flight, not yet known here
    num_computed_tokens: int = 0  # tokens whose KV is written (or being written by a step in flight)
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache at first admission
    block_table: list[int] = field(default_factory=list)
    block_hashes: list[bytes] = field(default_factory=list)  # chained hashes of the full blocks
    num_hashed_blocks: int = 0  # how many of block_table are registered in the prefix cache
    status: SeqStatus = SeqStatus.WAITING
    preemptions: int = 0
    discarded_tokens: int = 0  # KV computed, then freed by the latest preemption
    recomputed_tokens: int = 0  # of all discarded, what the prefix cache did not give back
    sample_row: int = -1  # this sequence's row in the sampled tokens of the step in flight
    admitted_once: bool = False

    def __post_init__(self):
        if self.score is None:
            self.score = float(self.priority)
        if not self.token_ids:
            self.token_ids = list(self.prompt_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids) + self.num_pending

    @property
    def num_output_tokens(self) -> int:
        """Outputs sampled so far, the ones still in flight included."""
        return self.num_tokens - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    def sort_key(self) -> tuple[bool, float, int]:
        """Scheduling order: aged first, then higher score, then earlier arrival."""
        return (not self.aged, -self.score, self.arrival_index)
