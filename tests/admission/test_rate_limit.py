import pytest

from services.admission.rate_limit import TokenBuckets


def test_bucket_spends_refills_and_says_how_long_to_wait():
    buckets = TokenBuckets(tokens_per_s=100.0, burst_tokens=200)
    assert buckets.take("a", 150, now=0.0) == 0.0
    assert buckets.take("a", 100, now=0.0) == pytest.approx(0.5)  # 50 left, 50 short at 100/s
    assert buckets.take("b", 200, now=0.0) == 0.0  # tenants are separate
    assert buckets.take("a", 100, now=0.5) == 0.0  # refilled to 100


def test_refill_is_capped_at_the_burst():
    buckets = TokenBuckets(tokens_per_s=10.0, burst_tokens=50)
    assert buckets.take("a", 50, now=0.0) == 0.0
    assert buckets.take("a", 50, now=1000.0) == 0.0
    assert buckets.take("a", 1, now=1000.0) == pytest.approx(0.1)


def test_buckets_of_tenants_gone_quiet_are_forgotten():
    buckets = TokenBuckets(tokens_per_s=10.0, burst_tokens=50, sweep_every=100)
    for i in range(99):  # a tenant name per request, as a hostile client may send
        buckets.take(f"t{i}", 50, now=0.0)
    assert len(buckets) == 99
    buckets.take("busy", 40, now=4.0)  # the 100th take sweeps: nobody has refilled yet
    assert len(buckets) == 100
    for i in range(100):
        buckets.take("busy", 0, now=5.0 + i * 1e-3)  # the others refilled to the burst
    assert len(buckets) == 1
    assert buckets.take("busy", 50, now=5.1) > 0  # what it spent is not forgotten
