"""The benchmark's arithmetic on synthetic timings with known answers."""

import pytest

from loadtest.metrics import RequestRecord, Slo, distribution, jain_index, percentile, summarize


def record(request_id, send, deltas, end, tokens, tenant="a", priority=5, error=None,
           deadline_ms=None):
    return RequestRecord(request_id=request_id, tenant=tenant, priority=priority, send_time=send,
                         prompt_tokens=10, deadline_ms=deadline_ms, delta_times=list(deltas),
                         delta_tokens=[1] * len(deltas), end_time=end, output_tokens=tokens,
                         finish_reason=None if error else "length", error=error)


def test_percentiles_interpolate_between_ranks():
    assert percentile([1, 2, 3, 4], 50) == 2.5
    assert percentile([4, 1, 3, 2], 0) == 1 and percentile([4, 1, 3, 2], 100) == 4
    assert percentile(list(range(1, 101)), 90) == pytest.approx(90.1)
    assert percentile(list(range(1, 101)), 99) == pytest.approx(99.01)
    assert percentile([7.0], 99) == 7.0 and percentile([], 50) is None


def test_distribution_is_in_milliseconds():
    d = distribution([0.001, 0.002, 0.003, 0.004])
    assert d == {"mean": pytest.approx(2.5), "p50": pytest.approx(2.5),
                 "p90": pytest.approx(3.7), "p99": pytest.approx(3.97), "max": pytest.approx(4.0),
                 "count": 4}


def test_per_request_ttft_tpot_itl_e2e():
    r = record("r", send=1.0, deltas=[1.2, 1.3, 1.5, 1.6], end=1.6, tokens=4)
    assert r.ttft == pytest.approx(0.2)
    assert r.e2e == pytest.approx(0.6)
    assert r.tpot == pytest.approx(0.4 / 3)  # (E2E - TTFT) / (tokens - 1)
    assert r.itls == pytest.approx([0.1, 0.2, 0.1])
    one = record("one", send=0.0, deltas=[0.5], end=0.5, tokens=1)
    assert one.tpot is None and one.itls == []


def test_jain_index():
    assert jain_index([10, 10, 10]) == pytest.approx(1.0)
    assert jain_index([30, 0, 0]) == pytest.approx(1 / 3)
    assert jain_index([1, 3]) == pytest.approx(16 / 20)
    assert jain_index([]) is None and jain_index([0, 0]) is None


def test_goodput_counts_only_requests_meeting_every_slo():
    slo = Slo.parse(["ttft:250", "tpot:100"])
    assert slo == Slo(ttft_ms=250.0, tpot_ms=100.0)
    fast = record("fast", 0.0, [0.1, 0.2, 0.3], 0.3, 3)  # TTFT 100, TPOT 100 ms: meets both
    slow_start = record("slow", 0.0, [0.3, 0.35], 0.35, 2)  # TTFT 300 ms
    slow_tokens = record("crawl", 0.0, [0.1, 0.5], 0.5, 2)  # TPOT 400 ms
    single = record("single", 0.0, [0.2], 0.2, 1)  # no TPOT: only TTFT applies
    failed = record("failed", 0.0, [], 0.1, 0, error="overloaded")
    for r in (fast, slow_start, slow_tokens, single):
        assert slo.met(r) == (r.request_id in ("fast", "single"))
    summary = summarize([fast, slow_start, slow_tokens, single, failed], duration_s=2.0, slo=slo)
    assert summary["goodput"] == pytest.approx(1.0)  # 2 good requests / 2 s
    assert summary["goodput_fraction"] == pytest.approx(2 / 5)
    with pytest.raises(ValueError, match="ttft:MS"):
        Slo.parse(["latency:5"])


def test_summary_groups_errors_outstanding_and_fairness():
    records = [
        record("a1", 0.0, [0.1, 0.2], 0.2, 2, tenant="a", priority=9, deadline_ms=150),
        record("a2", 0.0, [0.1, 0.2, 0.3, 0.4], 0.4, 4, tenant="a", priority=1),
        record("b1", 0.5, [0.6, 0.7], 0.7, 2, tenant="b", priority=9, deadline_ms=300),
        record("b2", 0.5, [], 0.6, 0, tenant="b", priority=1, error="rate_limited"),
        record("b3", 0.9, [1.0], None, 0, tenant="b", priority=1),  # never finished
    ]
    s = summarize(records, duration_s=1.0)
    assert (s["requests"], s["completed"], s["failed"], s["outstanding"]) == (5, 3, 1, 1)
    assert s["outstanding_request_ids"] == ["b3"]
    assert s["errors"] == {"rate_limited": 1}
    assert s["output_tokens"] == 8 and s["output_throughput"] == pytest.approx(8.0)
    assert s["total_token_throughput"] == pytest.approx(38.0)  # 3 x 10 prompt + 8 output
    assert s["tenant_served_tokens"] == {"a": 6, "b": 2}
    assert s["jain_fairness"] == pytest.approx(64 / (2 * 40))
    assert list(s["per_priority"]) == ["9", "1"]
    nine = s["per_priority"]["9"]
    assert nine["completed"] == 2 and nine["ttft_ms"]["p50"] == pytest.approx(100.0)
    assert nine["deadline_met_fraction"] == pytest.approx(0.5)  # a1 took 200 ms > 150
    assert s["per_tenant"]["b"]["failed"] == 1 and s["per_tenant"]["b"]["outstanding"] == 1
    assert s["itl_ms"]["count"] == 5 and s["itl_ms"]["p50"] == pytest.approx(100.0)


def test_deadline_goodput_needs_the_whole_output_within_the_deadline():
    slo = Slo.parse(["deadline", "ttft:1000"])
    assert slo == Slo(ttft_ms=1000.0, deadline=True)

    def record(deadline_ms, end, finish_reason="length"):
        return RequestRecord(request_id="r", tenant="t", priority=9, send_time=0.0,
                             deadline_ms=deadline_ms, delta_times=[0.1], delta_tokens=[1],
                             end_time=end, output_tokens=4, finish_reason=finish_reason)

    assert slo.met(record(2000.0, 1.5))
    assert not slo.met(record(2000.0, 2.5))  # late
    assert not slo.met(record(2000.0, 1.9, finish_reason="deadline"))  # cut short at it
    assert slo.met(record(None, 30.0))  # no deadline: only the other limits apply


def test_prefix_cache_hit_rate_is_cached_over_prompt_tokens_of_completed_requests():
    records = [record("a1", 0.0, [0.1], 0.1, 1, tenant="a"),
               record("a2", 0.0, [0.1], 0.1, 1, tenant="a"),
               record("b1", 0.0, [0.1], 0.1, 1, tenant="b"),
               record("b2", 0.0, [], 0.1, 0, tenant="b", error="overloaded")]
    records[1].cached_tokens = 8  # of its 10 prompt tokens
    records[3].cached_tokens = 10  # failed: not counted
    s = summarize(records, duration_s=1.0)
    assert s["prefix_cache_hit_rate"] == pytest.approx(8 / 30)
    assert s["per_tenant"]["a"]["prefix_cache_hit_rate"] == pytest.approx(8 / 20)
    assert s["per_tenant"]["b"]["prefix_cache_hit_rate"] == 0.0
    assert summarize([records[3]], duration_s=1.0)["prefix_cache_hit_rate"] is None


def test_where_requests_waited_and_what_preemption_cost():
    a = record("a", send=0.0, deltas=[0.5], end=0.6, tokens=1)
    a.queue_wait_ms, a.scheduled_ms, a.preemptions, a.recomputed_tokens = 300.0, 340.0, 1, 24
    b = record("b", send=0.0, deltas=[0.2], end=0.3, tokens=1)
    b.queue_wait_ms, b.scheduled_ms = 10.0, 8.0  # two clocks: never below zero
    assert a.executor_queue_ms == 40.0 and b.executor_queue_ms == 0.0
    s = summarize([a, b], duration_s=1.0)
    assert s["queue_wait_ms"]["max"] == pytest.approx(300.0)
    assert s["executor_queue_ms"]["max"] == pytest.approx(40.0)
    assert (s["preemptions"], s["recomputed_tokens"]) == (1, 24)
