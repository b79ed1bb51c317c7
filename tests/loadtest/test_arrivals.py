import math
import random
import statistics

import pytest

from loadtest.arrivals import arrival_offsets, draw, parse_mix, parse_phases, phased_offsets


@pytest.mark.parametrize("rate, burstiness", [(4.0, 1.0), (10.0, 0.5), (2.0, 4.0)])
def test_mean_rate_over_many_draws(rate, burstiness):
    offsets = arrival_offsets(rate, burstiness, random.Random(1), num_requests=20_000)
    assert offsets == sorted(offsets)
    measured = len(offsets) / offsets[-1]
    assert measured == pytest.approx(rate, rel=0.03)
    gaps = [b - a for a, b in zip(offsets, offsets[1:])]
    # Gamma(k, 1/(rate k)): coefficient of variation 1/sqrt(k). Poisson is 1, bursty above.
    cv = statistics.pstdev(gaps) / statistics.fmean(gaps)
    assert cv == pytest.approx(1 / math.sqrt(burstiness), rel=0.05)


def test_duration_bounds_the_run_and_inf_sends_at_once():
    offsets = arrival_offsets(5.0, 1.0, random.Random(2), duration_s=100.0)
    assert max(offsets) <= 100.0 and 450 < len(offsets) < 550
    assert arrival_offsets(math.inf, 1.0, random.Random(0), num_requests=3) == [0.0, 0.0, 0.0]
    with pytest.raises(ValueError):
        arrival_offsets(1.0, 1.0, random.Random(0))


def test_rate_phases_follow_each_other_at_their_own_rates():
    phases = parse_phases("2:100,10:50,2:100")
    assert phases == [(2.0, 100.0), (10.0, 50.0), (2.0, 100.0)]
    offsets = phased_offsets(phases, 1.0, random.Random(3))
    assert offsets == sorted(offsets) and max(offsets) <= 250.0
    counts = [sum(lo < t <= hi for t in offsets) for lo, hi in ((0, 100), (100, 150), (150, 250))]
    assert 160 < counts[0] < 240 and 420 < counts[1] < 580 and 160 < counts[2] < 240
    for bad in ("2", "0:10", "inf:10", "2:-1", "x:10"):
        with pytest.raises(ValueError, match="RATE:SECONDS"):
            parse_phases(bad)


def test_mixes_are_normalized_and_drawn_in_proportion():
    mix = parse_mix("9:2,5:5,1:3", int)
    assert mix == [(9, 0.2), (5, 0.5), (1, 0.3)]
    rng = random.Random(3)
    draws = [draw(mix, rng) for _ in range(20_000)]
    assert draws.count(5) / len(draws) == pytest.approx(0.5, abs=0.02)
    assert parse_mix("a:1,b:1") == [("a", 0.5), ("b", 0.5)]
    with pytest.raises(ValueError):
        parse_mix("a")
