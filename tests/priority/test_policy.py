import math

import numpy as np
import pytest

from services.priority import policy
from shared.config import RequestLevel


def cfg(**overrides) -> RequestLevel:
    return RequestLevel(**overrides)


def waiting(priority, seq=None, arrival=None, deadline=None, demand=None, fairness=None,
            tenant=None):
    n = len(priority)
    return policy.Waiting(
        priority=np.array(priority), seq=np.array(seq if seq is not None else range(n), float),
        arrival=np.array(arrival if arrival is not None else [0.0] * n, float),
        deadline=np.array(deadline if deadline is not None else [math.inf] * n, float),
        demand=np.array(demand if demand is not None else [100.0] * n, float),
        fairness=np.array(fairness if fairness is not None else [0.0] * n, float),
        tenant=np.array(tenant if tenant is not None else [0] * n, np.int64))


def order(w, now=1.0, load=0.0, config=None, k=None):
    config = config or cfg()
    scored = policy.scores(w, now, load, np.ones(config.priority_levels), config)
    return list(policy.best(scored.key, w.seq, k or len(w.seq)))


def test_urgency_rises_as_the_deadline_nears_and_is_zero_without_one():
    # The seed's listing had the sign inverted; more time left must mean less urgency.
    far, near, at, past = policy.urgency(np.array([10.0, 1.0, 0.0, -1.0]), time_window=1.0)
    assert far < near < at < past
    assert at == pytest.approx(0.5)
    assert far == pytest.approx(1 / (1 + math.exp(10)))
    assert policy.urgency(math.inf, 1.0) == 0.0
    # Clamped: no overflow warning, still in [0, 1].
    assert policy.urgency(np.array([1e9, -1e9]), 1e-3).tolist() == pytest.approx([0.0, 1.0])


def test_time_window_sets_how_early_urgency_starts():
    assert policy.urgency(2.0, time_window=4.0) > policy.urgency(2.0, time_window=1.0)


def test_resource_term_favours_short_jobs_with_a_negative_weight():
    config = cfg(base_weight=0.0)
    w = waiting([5, 5], demand=[5000.0, 50.0])
    assert order(w, config=config) == [1, 0]
    assert policy.resource(math.e**8, 8.0) == pytest.approx(1.0)
    assert policy.resource(0, 8.0) == 0.0  # clamped at one token


def test_load_adjustment_is_linear_around_the_threshold_and_clamped():
    config = cfg(load_threshold=0.8, load_weight=1.0, load_adjustment_min=0.5,
                 load_adjustment_max=2.0)
    assert policy.load_adjustment(0.8, config) == 1.0
    assert policy.load_adjustment(1.3, config) == pytest.approx(1.5)
    assert policy.load_adjustment(5.0, config) == 2.0
    assert policy.load_adjustment(0.0, config) == pytest.approx(0.5)


def test_base_term_scales_priority_to_base_weight_and_by_class_weight():
    config = cfg(priority_levels=11, base_weight=10.0)
    assert policy.base(np.array([0, 5, 10]), 1.0, config).tolist() == [0.0, 5.0, 10.0]
    assert policy.base(7, 1.5, config) == pytest.approx(10.5)
    assert policy.base(10, 1.0, cfg(priority_levels=5, base_weight=4.0)) == 4.0  # capped


def test_adaptive_score_is_the_sum_of_its_terms():
    config = cfg()
    w = waiting([9, 5], deadline=[3.0, math.inf], demand=[200.0, 20.0], fairness=[-0.5, 0.0])
    scored = policy.scores(w, now=1.0, load=1.3, class_weights=np.ones(11), cfg=config)
    t = scored.terms
    adjust = policy.load_adjustment(1.3, config)
    assert t["urgency"][0] == pytest.approx(3.0 * policy.urgency(2.0, 1.0) * adjust)
    assert t["urgency"][1] == 0.0
    assert t["resource"][1] == pytest.approx(-math.log(20) / 8)
    for i in range(2):
        assert scored.score[i] == pytest.approx(t["base"][i] + t["urgency"][i] + t["resource"][i]
                                                + t["fairness"][i])


def test_a_near_deadline_overtakes_a_higher_base_priority_only_when_close():
    config = cfg()
    w = waiting([6, 5], deadline=[math.inf, 10.0])
    assert order(w, now=0.0, config=config) == [0, 1]  # 10 s of slack: no urgency yet
    assert order(w, now=9.9, load=1.0, config=config) == [1, 0]  # at its deadline it goes first


def test_aging_bound_puts_every_old_request_first_longest_waiting_first():
    config = cfg(max_wait_s=10.0)
    w = waiting([1, 9, 1, 5], arrival=[0.0, 5.0, 2.0, 5.0])
    assert order(w, now=11.0, config=config) == [0, 1, 3, 2]  # only #0 waited >= 10 s
    assert order(w, now=13.0, config=config) == [0, 2, 1, 3]  # now #2 too; it waited less
    scored = policy.scores(w, 13.0, 0.0, np.ones(11), config)
    assert scored.terms["aged"].tolist() == [1.0, 0.0, 1.0, 0.0]
    assert scored.score[0] < scored.score[1]  # the executor sees the score, not the bound


def test_fcfs_is_arrival_order_and_priority_is_strict_then_arrival():
    w = waiting([1, 9, 5, 9], seq=[0, 1, 2, 3], deadline=[1.0, math.inf, math.inf, math.inf])
    assert order(w, config=cfg(policy="fcfs")) == [0, 1, 2, 3]
    assert order(w, config=cfg(policy="priority")) == [1, 3, 2, 0]
    scored = policy.scores(w, 0.0, 0.0, np.ones(11), cfg(policy="priority"))
    assert scored.score.tolist() == [1.0, 9.0, 5.0, 9.0]


def test_best_selects_top_k_with_ties_to_the_earlier_arrival():
    key = np.array([1.0, 3.0, 3.0, 2.0, 3.0])
    seq = np.array([0.0, 4.0, 1.0, 2.0, 3.0])
    assert list(policy.best(key, seq, 2)) == [2, 4]
    assert list(policy.best(key, seq, 10)) == [2, 4, 1, 3, 0]
    assert list(policy.best(key, seq, 0)) == []


def test_aging_holds_an_over_share_tenant_to_the_head_of_its_own_line():
    """Tenant 1 is over its share (fairness -3 < -fairness_factor): its aged requests go ahead
    of its own others, longest waiting first, but not ahead of tenant 0's."""
    config = cfg(max_wait_s=10.0)
    w = waiting([5, 5, 5, 5], arrival=[0.0, 1.0, 9.0, 9.0], fairness=[-3.0, -3.0, -3.0, 0.0],
                tenant=[1, 1, 1, 0], demand=[100.0, 100.0, 10.0, 100.0])
    assert order(w, now=12.0, config=config) == [3, 0, 1, 2]
    scored = policy.scores(w, 12.0, 0.0, np.ones(11), config)
    assert scored.terms["aged"].tolist() == [0.0, 0.0, 0.0, 0.0]
    assert scored.terms["over_share"].tolist() == [1.0, 1.0, 1.0, 0.0]
    # Within its share the same requests go before everything.
    w.fairness[:] = 0.0
    assert order(w, now=12.0, config=config) == [0, 1, 2, 3]


def test_deadline_urgency_counts_the_time_a_request_needs_and_fades_once_it_is_late():
    # 10 s of slack; the request needs 9 s (service): its margin is 1 s, as urgent as a request
    # with 1 s of slack that needs nothing.
    assert policy.deadline_urgency(10.0, 9.0, 1.0) == pytest.approx(policy.urgency(1.0, 1.0))
    early, on_time, half_late, one_late = policy.deadline_urgency(
        np.array([5.0, 5.0, 5.0, 5.0]), np.array([4.5, 5.0, 5.5, 6.0]), 1.0)
    # The peak is a margin of zero: a request already late by the estimate ranks below one
    # that can still make it (under overload, serving the latest first fills the executors
    # with work cut at its deadline).
    assert early < on_time == pytest.approx(0.5)
    assert on_time > half_late > one_late
    assert one_late == pytest.approx(0.5 * math.exp(-1.0))
    assert half_late < early
    assert policy.deadline_urgency(math.inf, 3.0, 1.0) == 0.0


def test_service_time_is_output_steps_plus_prompt_chunks_at_the_step_time():
    w = waiting([5, 5], demand=[1100.0, 300.0])
    w.prompt = np.array([1024.0, 100.0])
    assert policy.service_time(w, 0.02, 512).tolist() == pytest.approx([(76 + 2) * 0.02,
                                                                         (200 + 100 / 512) * 0.02])


def test_a_request_that_cannot_make_its_deadline_stops_outranking_one_that_can():
    """Both priority 5 with 3 s left; #0 needs 20 s at the executors' step time, #1 needs 2.5 s.
    With no step time known (0) their urgencies are equal and arrival decides (the size term
    is off here)."""
    config = cfg(resource_weight=0.0)
    w = waiting([5, 5], deadline=[4.0, 4.0], demand=[1000.0, 125.0])
    w.prompt = np.zeros(2)
    assert order(w, now=1.0, load=1.0, config=config) == [0, 1]
    scored = policy.scores(w, 1.0, 1.0, np.ones(11), config, step_s=0.02)
    assert scored.terms["urgency"][1] > 1.0 > 0.1 > scored.terms["urgency"][0]
    assert list(policy.best(scored.key, w.seq, 2)) == [1, 0]


def test_a_deadline_at_stake_goes_ahead_of_aged_requests_the_rest_behind_them():
    config = cfg(max_wait_s=10.0)
    # #0 aged priority 1; #1 priority 9 with 1.5 s left that needs 1 s (a margin of 0.5 s, within
    # a window of zero: at stake); #2 priority 9 with a far deadline; #3 none.
    w = waiting([1, 9, 9, 7], arrival=[0.0, 10.0, 10.0, 10.0],
                deadline=[math.inf, 12.5, 60.0, math.inf], demand=[50.0] * 4)
    w.prompt = np.zeros(4)
    scored = policy.scores(w, 11.0, 0.0, np.ones(11), config, step_s=0.02)
    assert scored.terms["critical"].tolist() == [0.0, 1.0, 0.0, 0.0]
    assert list(policy.best(scored.key, w.seq, 4)) == [1, 0, 2, 3]


def test_a_request_late_past_the_tolerance_is_not_at_stake_even_beside_aged_ones():
    config = cfg(max_wait_s=10.0)
    # #0 aged priority 1; #1 priority 9 with 0.5 s left that needs 1 s: half a second late by
    # the estimate, past late_tolerance_s (0.25 s) but within a time window (1 s).
    w = waiting([1, 9], arrival=[0.0, 10.0], deadline=[math.inf, 11.5], demand=[50.0, 50.0])
    w.prompt = np.zeros(2)
    scored = policy.scores(w, 11.0, 0.0, np.ones(11), config, step_s=0.02)
    assert scored.terms["hopeless"].tolist() == [0.0, 1.0]
    assert scored.terms["critical"].tolist() == [0.0, 0.0]
    assert list(policy.best(scored.key, w.seq, 2)) == [0, 1]


def test_a_request_that_would_miss_its_deadline_even_now_goes_behind_every_other():
    # #0 priority 9 with 2 s left that needs 4 s (200 tokens at 20 ms): more than a window late.
    w = waiting([9, 1], deadline=[3.0, math.inf], demand=[200.0, 200.0])
    w.prompt = np.zeros(2)
    scored = policy.scores(w, 1.0, 0.0, np.ones(11), cfg(), step_s=0.02)
    assert scored.terms["hopeless"].tolist() == [1.0, 0.0]
    assert list(policy.best(scored.key, w.seq, 2)) == [1, 0]
    # With time enough (or no step time reported yet) it goes first again.
    assert order(w, now=1.0) == [0, 1]
    scored = policy.scores(w, 1.0, 0.0, np.ones(11), cfg(), step_s=0.01)
    assert scored.terms["hopeless"].tolist() == [0.0, 0.0]


def test_a_deadline_keeps_its_urgency_while_its_length_is_only_the_prior():
    """max_tokens 4096 and 10 s left at 20 ms a step: by the prior (all 4096 tokens, 82 s) it
    is 72 s late, and its urgency faded to 1e-22 until five of its tenant's requests had ended.
    Without history it keeps the urgency of a deadline reached (0.5); with history saying it is
    that long, it fades as before."""
    w = waiting([5, 5], deadline=[11.0, 11.0], demand=[4096.0, 4096.0])
    w.prompt = np.zeros(2)
    w.known = np.array([False, True])
    scored = policy.scores(w, 1.0, 0.0, np.ones(11), cfg(), step_s=0.02)
    weight = cfg().urgency_weight * policy.load_adjustment(0.0, cfg())
    assert scored.terms["urgency"][0] == pytest.approx(0.5 * weight)
    assert scored.terms["urgency"][1] < 1e-20
