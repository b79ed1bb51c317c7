"""When requests are sent: an open-loop arrival process (arrivals never wait for completions).

Gaps are gamma-distributed with shape `burstiness` and mean 1/rate: burstiness 1 is a Poisson
process; below 1 arrivals come in bursts, above 1 they are more evenly spaced. An infinite rate
sends everything at t=0.
"""

from __future__ import annotations

import math
import random


def arrival_offsets(rate: float, burstiness: float, rng: random.Random,
                    num_requests: int | None = None, duration_s: float | None = None) -> list[float]:
    """Send times in seconds from the start, for `num_requests` or until `duration_s`."""
    if (num_requests is None) == (duration_s is None):
        raise ValueError("give exactly one of num_requests and duration_s")
    if rate <= 0 or burstiness <= 0:
        raise ValueError("rate and burstiness must be positive")
    if math.isinf(rate):
        if num_requests is None:
            raise ValueError("an infinite rate needs num_requests, not a duration")
        return [0.0] * num_requests
    scale = 1.0 / (rate * burstiness)  # gamma mean = shape * scale = 1 / rate
    offsets: list[float] = []
    now = 0.0
    while True:
        now += rng.gammavariate(burstiness, scale)
        if duration_s is not None and now > duration_s:
            return offsets
        offsets.append(now)
        if num_requests is not None and len(offsets) == num_requests:
            return offsets


def phased_offsets(phases: list[tuple[float, float]], burstiness: float,
                   rng: random.Random) -> list[float]:
    """Send times for rate phases run one after another: (requests per second, seconds) each."""
    offsets: list[float] = []
    start = 0.0
    for rate, seconds in phases:
        offsets += [start + t for t in arrival_offsets(rate, burstiness, rng, duration_s=seconds)]
        start += seconds
    return offsets


def parse_phases(text: str) -> list[tuple[float, float]]:
    """`"2:60,8:60,2:60"` -> [(2.0, 60.0), (8.0, 60.0), (2.0, 60.0)]: rate:seconds each."""
    phases = []
    for part in text.split(","):
        rate, sep, seconds = part.partition(":")
        try:
            phase = (float(rate), float(seconds))
        except ValueError:
            phase = None
        if not sep or phase is None or not (0 < phase[0] < math.inf and phase[1] > 0):
            raise ValueError(f"rate phase {part!r}: want RATE:SECONDS, both positive and finite")
        phases.append(phase)
    return phases


def parse_mix(text: str | None, cast=str) -> list[tuple[object, float]]:
    """`"9:0.2,5:0.5,1:0.3"` -> [(9, 0.2), (5, 0.5), (1, 0.3)], weights normalized to sum 1."""
    if not text:
        return []
    pairs = []
    for part in text.split(","):
        key, _, weight = part.strip().rpartition(":")
        if not key:
            raise ValueError(f"mix entry {part!r} is not KEY:WEIGHT")
        pairs.append((cast(key), float(weight)))
    total = sum(w for _, w in pairs)
    if total <= 0 or any(w < 0 for _, w in pairs):
        raise ValueError(f"mix {text!r}: weights must be >= 0 and not all 0")
    return [(k, w / total) for k, w in pairs]


def draw(mix: list[tuple[object, float]], rng: random.Random):
    return rng.choices([k for k, _ in mix], weights=[w for _, w in mix])[0]
