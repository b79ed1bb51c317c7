"""Simulated executors' profiles (`--model sim:<profile>`, docs/scheduling.md "Simulated executors"): one JSON file each, here.
A profile is the step-time cost model of one model on one machine, the layer sizes the engine
reports, and the sources it was built from; `services/executor/engine/sim.py` runs it.

Cost model (ms), over the step's sequences:

    base + max(weights, per_new_token * new tokens) + per_kv_token * sum(context lengths)
         + per_attn_pair * sum(new * context) + per_seq * sequences

`weights` is the floor of a memory-bound step (reading every weight once); `per_new_token` the
compute per token (matmuls); the context terms are attention's KV reads and its FLOPs.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

PROFILES_DIR = Path(__file__).parent


@dataclass(frozen=True)
class StepCost:
    base: float = 0.0
    weights: float = 0.0
    per_new_token: float = 0.0
    per_kv_token: float = 0.0
    per_attn_pair: float = 0.0
    per_seq: float = 0.0

    def ms(self, new_tokens: int, kv_tokens: int, attn_pairs: int, num_seqs: int) -> float:
        return (self.base + max(self.weights, self.per_new_token * new_tokens)
                + self.per_kv_token * kv_tokens + self.per_attn_pair * attn_pairs
                + self.per_seq * num_seqs)


@dataclass(frozen=True)
class SimProfile:
    name: str
    model_shape: str  # a DUMMY_SHAPES entry: the layer sizes the engine reports
    max_position: int
    kv_blocks: int | None  # the KV pool at block size 16 (None: the engine's CPU budget)
    cost: StepCost
    eos_fraction: tuple[float, float] | None

    @property
    def model_name(self) -> str:
        return f"sim:{self.name}"


def profile_names() -> list[str]:
    return sorted(p.stem for p in PROFILES_DIR.glob("*.json"))


def load_profile(name: str) -> SimProfile:
    path = PROFILES_DIR / f"{name}.json"
    if not path.exists():
        raise ValueError(f"unknown sim profile {name!r}; known: {', '.join(profile_names())}")
    raw = json.loads(path.read_text())
    eos = raw.get("eos_fraction")
    return SimProfile(name=name, model_shape=raw["model_shape"],
                      max_position=raw["max_position"], kv_blocks=raw.get("kv_blocks"),
                      cost=StepCost(**raw["step_ms"]),
                      eos_fraction=tuple(eos) if eos else None)
