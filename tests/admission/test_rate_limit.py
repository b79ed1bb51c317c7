import pytest

from services.admission.rate_limit import TokenBuckets


def test_bucket_spends_refills_and_says_how_long_to_wait():
    buckets, quota = TokenBuckets(), dict(rate=100.0, burst=200)
    assert buckets.take("a", 150, now=0.0, **quota) == 0.0
    assert buckets.take("a", 100, now=0.0, **quota) == pytest.approx(0.5)  # 50 short at 100/s
    assert buckets.take("b", 200, now=0.0, **quota) == 0.0  # tenants are separate
    assert buckets.take("a", 100, now=0.5, **quota) == 0.0  # refilled to 100
    # Each tenant at its own quota.
    assert buckets.take("vip", 1000, now=0.0, rate=1000.0, burst=2000) == 0.0


def test_refill_is_capped_at_the_burst():
    buckets, quota = TokenBuckets(), dict(rate=10.0, burst=50)
    assert buckets.take("a", 50, now=0.0, **quota) == 0.0
    assert buckets.take("a", 50, now=1000.0, **quota) == 0.0
    assert buckets.take("a", 1, now=1000.0, **quota) == pytest.approx(0.1)


def test_buckets_of_tenants_gone_quiet_are_forgotten():
    buckets, quota = TokenBuckets(sweep_every=100), dict(rate=10.0, burst=50)
    for i in range(99):  # a tenant name per request, as a hostile client may send
        buckets.take(f"t{i}", 50, now=0.0, **quota)
    assert len(buckets) == 99
    buckets.take("busy", 40, now=4.0, **quota)  # the 100th take sweeps: none has refilled yet
    assert len(buckets) == 100
    for i in range(100):
        buckets.take("busy", 0, now=5.0 + i * 1e-3, **quota)  # the others refilled to the burst
    assert len(buckets) == 1
    assert buckets.take("busy", 50, now=5.1, **quota) > 0  # what it spent is not forgotten
