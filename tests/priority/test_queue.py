import pytest

from services.priority.queue import WaitingQueue
from shared.messages import WorkItem
from shared.protocol import GenerateRequest


def item(request_id: str, priority: int = 5, tenant: str = "t") -> WorkItem:
    request = GenerateRequest(request_id=request_id, prompt_token_ids=[1, 2], priority=priority)
    return WorkItem(request=request, tenant=tenant, arrival_time=0.0)


def test_best_priority_first_then_arrival():
    queue = WaitingQueue(capacity=10)
    for request_id, priority in [("a", 1), ("b", 9), ("c", 5), ("d", 9), ("e", 1)]:
        queue.push(item(request_id, priority))
    assert [i.request_id for i in queue.pop(3)] == ["b", "d", "c"]
    assert [i.request_id for i in queue.pop(10)] == ["a", "e"]
    assert len(queue) == 0 and queue.pop(1) == []


def test_score_is_recorded_on_the_item():
    queue = WaitingQueue(capacity=1)
    queue.push(item("a", 7))
    assert queue.pop(1)[0].priority_score == 7.0


def test_remove_is_per_tenant_and_skipped_by_pop():
    queue = WaitingQueue(capacity=10)
    queue.push(item("a", tenant="x"))
    queue.push(item("b", tenant="x"))
    assert queue.remove("a", tenant="y") is None  # another tenant cannot cancel it
    assert queue.remove("a", tenant="x").request_id == "a"
    assert ("x", "a") not in queue and ("x", "b") in queue and len(queue) == 1
    assert [i.request_id for i in queue.pop(5)] == ["b"]


def test_the_same_id_in_two_tenants_is_two_requests():
    queue = WaitingQueue(capacity=10)
    queue.push(item("same", tenant="x"))
    queue.push(item("same", tenant="y"))
    assert len(queue) == 2 and queue.remove("same", tenant="y").tenant == "y"
    assert [i.tenant for i in queue.pop(5)] == ["x"]


def test_capacity_is_a_bound():
    queue = WaitingQueue(capacity=2)
    queue.push(item("a"))
    queue.push(item("b"))
    assert queue.full
    with pytest.raises(AssertionError):
        queue.push(item("c"))
    assert queue.depth_by_priority() == {"5": 2}
