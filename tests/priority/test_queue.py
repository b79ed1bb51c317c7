import numpy as np
import pytest

from services.priority import policy
from services.priority.queue import WaitingQueue
from shared.config import RequestLevel
from shared.messages import WorkItem
from shared.protocol import GenerateRequest


def item(request_id: str, priority: int = 5, tenant: str = "t", arrival: float = 0.0,
         deadline: float | None = None) -> WorkItem:
    request = GenerateRequest(request_id=request_id, prompt_token_ids=[1, 2], priority=priority)
    return WorkItem(request=request, tenant=tenant, arrival_time=arrival, deadline=deadline)


def pop(queue: WaitingQueue, k: int, config=RequestLevel(policy="priority"), now=0.0):
    fairness = np.zeros(max(1, len(queue.tenants)))
    scored = policy.scores(queue.waiting(fairness), now, 0.0, np.ones(11), config)
    rows = [int(r) for r in policy.best(scored.key, queue.waiting(fairness).seq, k)]
    return [i.request_id for i in queue.take(rows)]


def test_best_priority_first_then_arrival():
    queue = WaitingQueue(capacity=10)
    for request_id, priority in [("a", 1), ("b", 9), ("c", 5), ("d", 9), ("e", 1)]:
        queue.push(item(request_id, priority), 10)
    assert pop(queue, 3) == ["b", "d", "c"]
    assert pop(queue, 10) == ["a", "e"]
    assert len(queue) == 0 and pop(queue, 1) == []


def test_rows_stay_consistent_through_growth_and_removals():
    queue = WaitingQueue(capacity=1000, initial_rows=4)
    for i in range(300):
        queue.push(item(f"r{i}", priority=i % 11), 10)
    for i in range(0, 300, 3):
        assert queue.remove(f"r{i}", "t").request_id == f"r{i}"
    left = [f"r{i}" for i in range(300) if i % 3]
    expected = sorted(left, key=lambda r: (-(int(r[1:]) % 11), int(r[1:])))
    assert pop(queue, 50) == expected[:50]
    assert pop(queue, 1000) == expected[50:]


def test_remove_is_per_tenant_and_skipped_by_pop():
    queue = WaitingQueue(capacity=10)
    queue.push(item("a", tenant="x"), 10)
    queue.push(item("b", tenant="x"), 10)
    assert queue.remove("a", tenant="y") is None  # another tenant cannot cancel it
    assert queue.remove("a", tenant="x").request_id == "a"
    assert ("x", "a") not in queue and ("x", "b") in queue and len(queue) == 1
    assert pop(queue, 5) == ["b"]


def test_the_same_id_in_two_tenants_is_two_requests():
    queue = WaitingQueue(capacity=10)
    queue.push(item("same", tenant="x"), 10)
    queue.push(item("same", tenant="y"), 10)
    assert len(queue) == 2 and queue.remove("same", tenant="y").tenant == "y"
    assert queue.items()[0].tenant == "x" and pop(queue, 5) == ["same"]


def test_capacity_is_a_bound():
    queue = WaitingQueue(capacity=2)
    queue.push(item("a"), 10)
    queue.push(item("b"), 10)
    assert queue.full
    with pytest.raises(AssertionError):
        queue.push(item("c"), 10)
    assert queue.depth_by_priority() == {"5": 2}


def test_expired_takes_out_only_waiting_requests_past_their_deadline():
    queue = WaitingQueue(capacity=10)
    queue.push(item("soon", deadline=1.0), 10)
    queue.push(item("later", deadline=5.0), 10)
    queue.push(item("never"), 10)
    queue.push(item("gone", deadline=0.5), 10)
    queue.remove("gone", "t")  # cancelled: its heap entry must not resurface
    assert queue.expired(0.9) == []
    assert [i.request_id for i in queue.expired(1.0)] == ["soon"]
    assert pop(queue, 1) == ["later"]  # dispatched before its deadline
    assert queue.expired(10.0) == [] and len(queue) == 1


def test_submit_then_cancel_leaves_nothing_behind():
    """50,000 submit-then-cancel cycles of 2,000-token requests with deadlines: what the queue
    keeps (rows, the deadline heap) stays bounded by what waits, not by what passed through."""
    import tracemalloc

    from services.priority.request_level import RequestScheduler

    scheduler = RequestScheduler(RequestLevel(max_pending_requests=1000))
    prompt = list(range(2000))
    tracemalloc.start()
    try:
        for i in range(50_000):
            request = GenerateRequest(request_id=f"c{i}", prompt_token_ids=prompt)
            scheduler.push(WorkItem(request=request, tenant=f"t{i % 7}", arrival_time=0.0,
                                    deadline=1e9 + i))
            assert scheduler.remove(f"c{i}", f"t{i % 7}") is not None
        held, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert len(scheduler.queue) == 0
    assert len(scheduler.queue._deadlines) <= 1024 + 1
    assert held < 5e6, held  # one request's prompt alone is ~70 KB as Python ints
