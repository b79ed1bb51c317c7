"""The scheduler study's own arithmetic: service curves (for the VTC gap) and the throughput
while arrivals last. The runs themselves are benchmarks (BENCHMARKS.md), not tests."""

import pytest

from loadtest.sched_study import SHAPES, service_curves, sustained


def record(tenant, send, deltas, prompt=10, end=None, error=None):
    return {"tenant": tenant, "send_time": send, "prompt_tokens": prompt,
            "delta_times": [t for t, _ in deltas], "delta_tokens": [n for _, n in deltas],
            "end_time": end if end is not None else (deltas[-1][0] if deltas else None),
            "error": error}


def test_service_curves_count_prompt_at_the_first_token_and_outputs_twice():
    run = {"requests": [record("a", 0.0, [(0.2, 1), (0.7, 3)]),
                        record("b", 0.0, [(1.2, 2)], prompt=4),
                        record("c", 0.0, [(0.1, 5)])]}  # a tenant not asked for
    times, curves = service_curves(run, ["a", "b"])
    assert times[:4] == [0.0, 0.5, 1.0, 1.5]
    assert curves["a"][:4] == [0, 10 + 2, 10 + 2 + 6, 18]
    assert curves["b"][:4] == [0, 0, 0, 4 + 4]


def test_sustained_counts_only_what_was_delivered_inside_the_window():
    run = {"requests": [record("a", 0.0, [(1.0, 4), (6.0, 4)], end=6.0),
                        record("a", 0.0, [(9.0, 2)], end=12.0),
                        record("a", 0.0, [], end=7.0, error="deadline_exceeded")]}
    figures = sustained(run, 5.0, 10.0)
    assert figures["output_tok_per_s"] == pytest.approx((4 + 2) / 5.0)
    assert figures["request_per_s"] == pytest.approx(1 / 5.0)


def test_every_shape_names_its_ranges_and_burst():
    for name, spec in SHAPES.items():
        assert spec["input"][0] <= spec["input"][1] and spec["output"][0] <= spec["output"][1]
        assert spec["burst"] > 0, name
    mixed = SHAPES["mixed"]
    assert mixed["output"][1] / mixed["output"][0] == 10  # the 10x spread of output lengths
