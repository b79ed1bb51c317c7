from services.batcher.registry import ExecutorRegistry
from shared.messages import Heartbeat


def heartbeat(name: str, running: int = 0, waiting: int = 0, assigned: int = 0,
              max_num_seqs: int = 4, free_kv: int = 100, started_at: float = 1.0,
              model: str = "m", overtake_above: float | None = None) -> Heartbeat:
    return Heartbeat(executor=name, model=model, max_num_seqs=max_num_seqs, queue_depth=1,
                     running=running, waiting=waiting, assigned_total=assigned,
                     free_kv_blocks=free_kv, total_kv_blocks=100, step_ms=1.0,
                     started_at=started_at, overtake_above=overtake_above)


def test_room_counts_assignments_in_transit():
    registry = ExecutorRegistry()
    assert registry.update(heartbeat("e0", running=2), now=0.0)
    assert registry.free_slots() == 3  # 4 seqs + 1 queued - 2 running
    assert registry.pick("m", 0.0) == "e0"
    assert registry.free_slots() == 2  # sent, not yet in a heartbeat
    registry.update(heartbeat("e0", running=3, assigned=1), now=0.1)
    assert registry.executors["e0"].in_transit == 0 and registry.free_slots() == 2


def test_pick_prefers_the_least_loaded_then_free_kv():
    registry = ExecutorRegistry()
    registry.update(heartbeat("busy", running=3), 0.0)
    registry.update(heartbeat("idle", running=0, free_kv=10), 0.0)
    registry.update(heartbeat("idle-more-kv", running=0, free_kv=90), 0.0)
    registry.update(heartbeat("other-model", running=0, model="x"), 0.0)
    picks = [registry.pick("m", 0.0) for _ in range(4)]
    assert picks[:2] == ["idle-more-kv", "idle"]
    assert "other-model" not in picks


def test_full_executors_get_nothing():
    registry = ExecutorRegistry()
    registry.update(heartbeat("e0", running=4, waiting=1), 0.0)
    assert registry.free_slots() == 0 and registry.pick("m", 0.0) is None


def test_silent_executors_expire_and_a_restart_resets_counts():
    registry = ExecutorRegistry()
    registry.update(heartbeat("e0"), 0.0)
    registry.update(heartbeat("e1"), 4.0)
    assert registry.expire(now=5.5, timeout=5.0) == ["e0"]
    registry.pick("m", 0.0)
    assert registry.executors["e1"].in_transit == 1
    assert registry.update(heartbeat("e1", started_at=2.0), 6.0)  # a new process
    assert registry.executors["e1"].in_transit == 0
    registry.unsend("e1")
    assert registry.executors["e1"].in_transit == 0


def test_a_failed_assignment_suspends_and_a_late_arrival_is_recounted():
    registry = ExecutorRegistry()
    registry.update(heartbeat("e0"), 0.0)
    registry.update(heartbeat("e1"), 0.0)
    first = registry.pick("m", 0.0)
    registry.unsend(first, suspend_until=1.0)  # timed out: maybe it never got there
    assert registry.free_slots(now=0.5) == 5 and registry.pick("m", 0.5) != first
    assert registry.executors[first].suspended_until == 1.0
    # ... but it did arrive: the executor's count wins, so its room is not overstated.
    registry.update(heartbeat(first, running=1, assigned=1), 0.6)
    assert registry.executors[first].sent_total == 1 and registry.executors[first].free_slots == 4


def test_overtaking_goes_to_the_easiest_full_executor_one_at_a_time():
    registry = ExecutorRegistry(overtake_extra=1)
    registry.update(heartbeat("hard", running=4, waiting=1, overtake_above=8.0), 0.0)
    registry.update(heartbeat("easy", running=4, waiting=1, overtake_above=3.0), 0.0)
    registry.update(heartbeat("roomy", running=1, overtake_above=2.0), 0.0)
    registry.update(heartbeat("other", running=4, waiting=1, model="x", overtake_above=0.0), 0.0)
    # An executor with room is the plain loop's business; the lowest threshold without room:
    assert registry.overtake_threshold(0.0) == 0.0
    assert registry.pick_overtake("m", 2.5, 0.0) is None  # outranks nothing anywhere
    assert registry.pick_overtake("m", 9.0, 0.0) == "easy"
    # Its threshold is stale until its heartbeat counts the assignment: none more meanwhile.
    assert registry.pick_overtake("m", 9.0, 0.0) == "hard"
    assert registry.pick_overtake("m", 9.0, 0.0) is None
    # Counted, but now one beyond its room (overtake_extra 1): no more.
    registry.update(heartbeat("easy", running=4, waiting=2, assigned=1, overtake_above=3.0), 0.1)
    assert registry.pick_overtake("m", 9.0, 0.1) is None
    registry.update(heartbeat("easy", running=4, waiting=1, assigned=1, overtake_above=3.0), 0.2)
    assert registry.pick_overtake("m", 9.0, 0.2) == "easy"
    assert registry.free_slots() == 4  # only "roomy"; overtaking never counts as room


def test_round_robin_takes_each_executor_with_room_in_turn():
    registry = ExecutorRegistry(routing="round_robin")
    registry.update(heartbeat("e1", running=3), 0.0)  # busier: least_loaded would avoid it
    registry.update(heartbeat("e0"), 0.0)
    registry.update(heartbeat("e2", running=4, waiting=1), 0.0)  # full: skipped
    registry.update(heartbeat("x", model="other"), 0.0)
    # e1 has room for 2 (4 slots + 1 queued - 3 running), e0 for 5; then e0 alone.
    assert [registry.pick("m", 0.0) for _ in range(7)] == \
        ["e0", "e1", "e0", "e1", "e0", "e0", "e0"]
    assert registry.pick("m", 0.0) is None


def test_intake_room_in_tokens_limits_the_pull_and_counts_what_is_in_transit():
    registry = ExecutorRegistry()
    beat = heartbeat("e0", running=0, max_num_seqs=8)
    beat.room_tokens = 1000
    registry.update(beat, 0.0)
    assert registry.free_slots() == 9 and registry.pull_size(0.0) == 1  # no sizes seen yet
    assert registry.pick("m", 0.0, prompt_tokens=600) == "e0"
    assert registry.executors["e0"].free_tokens == 400
    assert registry.pull_size(0.0) == 1  # 400 tokens of room: one more request of ~600
    assert registry.pick("m", 0.0, prompt_tokens=600) == "e0"  # the room is a target
    assert registry.free_slots() == 0 and registry.pick("m", 0.0) is None
    registry.unsend("e0")  # that one did not arrive
    assert registry.executors["e0"].free_tokens == 400
    beat = heartbeat("e0", running=1, max_num_seqs=8, assigned=1)
    beat.room_tokens = 50  # the first is counted: its prompt is in the executor's own room
    registry.update(beat, 0.1)
    assert registry.executors["e0"].free_tokens == 50 and registry.free_slots() == 8
    beat.room_tokens = 0
    registry.update(beat, 0.2)
    assert registry.free_slots() == 0 and registry.pull_size(0.2) == 0
