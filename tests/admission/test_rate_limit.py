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
