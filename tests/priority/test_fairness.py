import pytest

from services.priority.fairness import ClassWeights, OutputPredictor, TenantCounters
from shared.config import RequestLevel


def test_counters_grow_by_prompt_plus_twice_output_over_the_weight():
    counters = TenantCounters({"gold": 2.0})
    assert counters.cost(100, 50) == 200.0
    counters.charge("gold", 200.0)
    counters.charge("free", 200.0)
    assert counters.counters == {"gold": 100.0, "free": 200.0}


def test_least_served_backlogged_tenant_has_no_lag():
    counters = TenantCounters()
    counters.enqueued("a")
    counters.enqueued("b")
    counters.charge("a", 3000.0)
    assert counters.lag("b") == 0.0 and counters.lag("a") == 3000.0
    counters.dequeued("b")  # b no longer waits: a is now the least served backlogged one
    assert counters.lag("a") == 0.0


def test_a_newly_backlogged_tenant_banks_no_credit():
    counters = TenantCounters()
    counters.enqueued("heavy")
    counters.charge("heavy", 50_000.0)  # served a lot while "light" was idle
    counters.enqueued("light")
    assert counters.counters["light"] == 50_000.0  # starts level, not 50,000 tokens behind
    assert counters.lag("light") == 0.0 and counters.lag("heavy") == 0.0
    counters.charge("heavy", 1000.0)
    assert counters.lag("heavy") == 1000.0


def test_a_tenant_returning_to_an_empty_queue_starts_level_with_the_most_served():
    counters = TenantCounters()
    counters.enqueued("a")
    counters.charge("a", 800.0)
    counters.dequeued("a")
    counters.enqueued("b")
    assert counters.counters["b"] == 800.0


def test_backlog_counts_requests_not_tenants():
    counters = TenantCounters()
    counters.enqueued("a")
    counters.enqueued("a")
    counters.dequeued("a")
    assert counters.backlog == {"a": 1}
    counters.dequeued("a")
    assert counters.backlog == {}


def feedback(**overrides):
    settings = dict(class_ttft_slo_ms={9: 500.0}, class_weight_step=0.25, class_weight_max=2.0,
                    class_feedback_window_s=10.0)
    settings.update(overrides)
    return ClassWeights(RequestLevel(**settings))


def test_class_weight_rises_while_p90_misses_the_target_bounded():
    weights = feedback()
    for i in range(10):
        weights.observe(9, 400.0 if i < 8 else 900.0, now=0.0)  # p90 900 > 500
    weights.update(now=1.0)
    assert weights.weights[9] == pytest.approx(1.25)
    for _ in range(10):
        weights.update(now=1.0)
    assert weights.weights[9] == 2.0  # bounded
    assert weights.weights[5] == 1.0  # a class without a target never moves


def test_class_weight_relaxes_toward_one_when_met_and_forgets_old_samples():
    weights = feedback()
    weights.observe(9, 900.0, now=0.0)
    weights.update(now=1.0)
    weights.update(now=1.0)
    assert weights.weights[9] == pytest.approx(1.25 * 1.25)
    weights.observe(9, 100.0, now=20.0)  # the miss left the 10 s window
    weights.update(now=20.0)
    assert weights.weights[9] == pytest.approx(1.25 * 1.25 * 0.75)
    weights.update(now=20.0)
    assert weights.weights[9] == 1.0  # never below 1
    assert weights.stats(20.0)["9"]["ttft_p90_ms"] == 100.0


def test_no_samples_leaves_the_weight_alone():
    weights = feedback()
    weights.weights[9] = 1.5
    weights.update(now=100.0)
    assert weights.weights[9] == 1.5


def test_predictor_learns_the_share_of_max_tokens_per_tenant_and_class():
    predictor = OutputPredictor(alpha=0.5, prior=1.0)
    assert predictor.predict("a", 5, 200) == 200
    predictor.observe("a", 5, 200, 50, "stop")  # used a quarter
    assert predictor.predict("a", 5, 200) == 125  # 1.0 -> 0.625
    predictor.observe("a", 5, 200, 50, "stop")
    assert predictor.predict("a", 5, 400) == 175  # 0.4375 of any max_tokens
    assert predictor.predict("b", 5, 200) == 200  # another tenant: the prior
    assert predictor.predict("a", 9, 200) == 200  # another class: the prior


def test_predictor_ignores_requests_cut_short_and_stays_in_range():
    predictor = OutputPredictor(alpha=1.0, prior=0.5)
    for reason in ("cancelled", "deadline", "internal"):
        predictor.observe("a", 5, 100, 1, reason)
    assert predictor.predict("a", 5, 100) == 50
    predictor.observe("a", 5, 100, 0, "stop")
    assert predictor.predict("a", 5, 100) == 1  # at least one token


def test_a_tenant_with_requests_running_is_active_though_nothing_of_it_waits():
    counters = TenantCounters()
    counters.enqueued("heavy")
    counters.charge("heavy", 5000.0)
    counters.running = {"light"}  # light's requests run; none wait
    counters.counters["light"] = 1000.0
    assert counters.active() == {"heavy", "light"}
    assert counters.lag("heavy") == 4000.0 and counters.lag("light") == 0.0
    counters.enqueued("light")  # already active: keeps its counter, no lift
    assert counters.counters["light"] == 1000.0
    counters.enqueued("new")  # lifted to the least-served active tenant, not the most served
    assert counters.counters["new"] == 1000.0


def test_a_tenant_running_here_without_a_counter_does_not_pull_the_floor_to_zero():
    """Another replica dispatched it: it runs at an executor (a heartbeat says so) and has no
    counter here until its Done. Counted as 0 it made every lag the whole counter (all
    fairness lost), and a newcomer started at 0, banking credit."""
    counters = TenantCounters()
    counters.counters.update(a=50_000.0, b=51_000.0)
    counters.backlog.update(a=1, b=1)
    assert counters.lags(["a", "b"]) == [0.0, 1_000.0]
    counters.running = {"elsewhere"}
    assert counters.lags(["a", "b"]) == [0.0, 1_000.0]
    counters.enqueued("new")
    assert counters.counters["new"] == 50_000.0
    counters.backlog.clear()  # only `elsewhere` is active, with no counter: nobody to forget
    assert counters.forget_idle() == 3 and counters.highest == 51_000.0


def test_a_stream_of_new_tenants_leaves_a_bounded_number_of_counters():
    """One tenant always waiting at the floor, and 5,000 new tenants each served once: each
    starts at the floor and ends above it, so none fell back to it and every counter stayed
    (20,000 such tenants left 20,001). Past max_idle, those with the least lead go."""
    counters = TenantCounters()
    counters.max_idle = 500
    counters.enqueued("steady")
    for i in range(5_000):
        tenant = f"new{i}"
        counters.enqueued(tenant)
        counters.dequeued(tenant)
        counters.charge(tenant, 10.0 + i % 7)
        if i % 100 == 99:
            counters.forget_idle()
    assert len(counters.counters) <= 501 and "steady" in counters.counters
    kept = [c for t, c in counters.counters.items() if t != "steady"]
    assert min(kept) >= 10.0 + 3  # the least leads went first
    # Forgiven, their leads are not kept as the highest counter forgotten (where a tenant
    # unknown here starts): none fell to the floor, so that is still 0.
    assert counters.highest == 0.0
