"""The memory of cancels that arrived before their request."""

from shared.cancels import RecentCancels


def test_a_cancel_applies_to_a_request_admitted_before_it_once():
    cancels = RecentCancels(ttl_s=60)
    cancels.add("t", "r1", now=100.0)
    assert not cancels.take("other", "r1", admitted_at=99.0, now=101.0)  # tenants are separate
    assert cancels.take("t", "r1", admitted_at=99.0, now=101.0)
    assert not cancels.take("t", "r1", admitted_at=99.0, now=101.0)  # once
    assert len(cancels) == 0


def test_a_cancel_of_a_finished_request_does_not_cancel_a_later_one_with_its_id():
    cancels = RecentCancels(ttl_s=60)
    cancels.add("t", "reused", now=100.0)  # the first request had ended: nothing took it
    assert not cancels.take("t", "reused", admitted_at=130.0, now=130.5)


def test_cancels_expire():
    cancels = RecentCancels(ttl_s=10)
    cancels.add("t", "old", now=0.0)
    assert not cancels.take("t", "old", admitted_at=-1.0, now=11.0)


def test_a_flood_of_one_tenant_evicts_only_its_own_cancels():
    cancels = RecentCancels(ttl_s=600, per_tenant=100, capacity=1000)
    cancels.add("calm", "keep-me", now=0.0)
    for i in range(5000):
        cancels.add("noisy", f"n{i}", now=1.0)
    assert len(cancels) == 101
    assert cancels.take("calm", "keep-me", admitted_at=-1.0, now=2.0)
    assert cancels.take("noisy", "n4999", admitted_at=0.0, now=2.0)
    assert not cancels.take("noisy", "n0", admitted_at=0.0, now=2.0)  # evicted


def test_many_tenants_stay_within_the_capacity():
    cancels = RecentCancels(ttl_s=600, per_tenant=100, capacity=50)
    for i in range(500):
        cancels.add(f"t{i}", "x", now=float(i))
    assert len(cancels) <= 50


def test_a_flood_on_distinct_tenant_names_is_bounded_and_leaves_no_trace():
    """Each cancel of a flood on 100,000 tenant names costs one entry, evicting the oldest past
    the capacity (the store once scanned every tenant to find one to evict, on each cancel); the
    tenants leave with their cancels."""
    cancels = RecentCancels(ttl_s=10, per_tenant=100, capacity=1000)
    cancels.add("calm", "late", now=0.0)
    for i in range(100_000):
        cancels.add(f"flood-{i}", "x", now=1.0)
    assert len(cancels) == 1000 and cancels.tenants == 1000
    assert not cancels.take("calm", "late", admitted_at=-1.0, now=2.0)  # the oldest went
    assert cancels.take("flood-99999", "x", admitted_at=0.0, now=2.0)
    cancels.add("calm", "new", now=20.0)  # the flood's cancels have expired by now
    assert len(cancels) == 1 and cancels.tenants == 1
