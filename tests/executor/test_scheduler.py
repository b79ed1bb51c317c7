import pytest

from services.executor.engine.block_manager import BlockManager
from services.executor.engine.scheduler import MIN_PREFILL, PACE_INCREASE, PACE_SAFETY, Scheduler
from services.executor.engine.sequence import SamplingParams, SeqStatus, Sequence

_count = iter(range(10**6))


def seq(prompt_len, priority=5, max_tokens=8, rid=None):
    i = next(_count)
    return Sequence(rid or f"s{i}", list(range(1000 + i * 1000, 1000 + i * 1000 + prompt_len)),
                    SamplingParams(max_tokens=max_tokens), priority=priority, arrival_index=i)


def resolve(batch):
    """Play the model: every sampling sequence gets its token."""
    for item in batch:
        if item.samples:
            item.seq.num_pending -= 1
            item.seq.token_ids.append(7)


def make(num_blocks=64, block_size=4, max_num_seqs=8, budget=32):
    bm = BlockManager(num_blocks, block_size, enable_prefix_caching=False)
    return Scheduler(bm, max_num_seqs, budget, admission_watermark=0.0)


def test_chunked_prefill_mixed_with_decodes():
    sched = make(budget=16)
    a = seq(4)
    sched.add(a)
    resolve(sched.schedule())  # a prefilled, sampled its first token
    b = seq(40)
    sched.add(b)
    batch = sched.schedule()
    sizes = {item.seq: item.num_new_tokens for item in batch}
    assert sizes == {a: 1, b: 15}  # a decodes; b's prefill is chunked to fill the budget
    assert [item.samples for item in batch] == [True, False]
    resolve(batch)
    batch = sched.schedule()
    assert {item.seq: item.num_new_tokens for item in batch} == {a: 1, b: 15}
    resolve(batch)
    batch = sched.schedule()
    assert {item.seq: item.num_new_tokens for item in batch} == {a: 1, b: 10}
    assert batch[1].samples and b.num_computed_tokens == 40


def test_max_num_seqs_limits_running():
    sched = make(max_num_seqs=2)
    seqs = [seq(4) for _ in range(3)]
    for s in seqs:
        sched.add(s)
    batch = sched.schedule()
    assert [item.seq for item in batch] == seqs[:2]
    assert sched.waiting == [seqs[2]]


def test_preemption_picks_lowest_priority_latest_and_keeps_place():
    sched = make(num_blocks=6, block_size=4, budget=64)
    high = seq(8, priority=7)
    low_early = seq(4, priority=1)
    low_late = seq(4, priority=1)
    for s in (high, low_early, low_late):
        sched.add(s)
    resolve(sched.schedule())  # 2 + 1 + 1 blocks used; 2 free
    # Grow until the pool is exhausted: the victim must be low_late.
    for _ in range(8):
        resolve(sched.schedule())
        if sched.num_preemptions:
            break
    assert low_late.status is SeqStatus.WAITING and low_late.preemptions == 1
    assert high.status is SeqStatus.RUNNING and low_early.status is SeqStatus.RUNNING
    assert low_late.num_computed_tokens == 0 and low_late.block_table == []
    # A later arrival of the same priority queues behind the preempted sequence.
    newcomer = seq(4, priority=1)
    sched.add(newcomer)
    assert sched.waiting == [low_late, newcomer]


def test_waiting_high_priority_preempts_running_low_priority():
    sched = make(max_num_seqs=1)
    low = seq(4, priority=1)
    sched.add(low)
    resolve(sched.schedule())
    high = seq(4, priority=9)
    sched.add(high)
    batch = sched.schedule()
    assert [item.seq for item in batch] == [high]
    assert low.status is SeqStatus.WAITING and low.preemptions == 1


def test_equal_priority_does_not_preempt():
    sched = make(max_num_seqs=1)
    first = seq(4, priority=5)
    sched.add(first)
    resolve(sched.schedule())
    second = seq(4, priority=5)
    sched.add(second)
    assert [item.seq for item in sched.schedule()] == [first]
    assert second.status is SeqStatus.WAITING


def test_sequence_with_token_in_flight_is_not_readmitted_until_known():
    sched = make(max_num_seqs=1)
    low = seq(4, priority=1)
    sched.add(low)
    sched.schedule()  # low samples; its token is still "in flight"
    assert low.num_pending == 1
    high = seq(4, priority=9)
    sched.add(high)
    sched.schedule()  # high preempts low
    assert low.status is SeqStatus.WAITING and low.num_pending == 1
    sched.finish(high)
    assert sched.schedule() == []  # low waits for its in-flight token
    low.num_pending -= 1
    low.token_ids.append(7)
    batch = sched.schedule()
    assert batch[0].seq is low and batch[0].num_new_tokens == 5  # recomputes prompt + output


def test_finished_by_length_is_not_scheduled_again():
    sched = make()
    s = seq(4, max_tokens=1)
    sched.add(s)
    sched.schedule()
    assert s.num_output_tokens == 1
    assert sched.schedule() == []


def scored(prompt_len, score, priority=5):
    s = seq(prompt_len, priority=priority)
    s.score = score
    return s


def test_the_score_from_priority_orders_the_waiting_queue():
    sched = make(max_num_seqs=8)
    low_priority_urgent = scored(4, score=9.5, priority=1)
    high_priority = scored(4, score=9.0, priority=9)
    sched.add(high_priority)
    sched.add(low_priority_urgent)
    assert sched.waiting == [low_priority_urgent, high_priority]


def test_preemption_needs_the_score_margin():
    sched = make(max_num_seqs=1)
    sched.preemption_margin = 1.0
    running = scored(4, score=5.0)
    sched.add(running)
    resolve(sched.schedule())
    slightly_better = scored(4, score=5.6)
    sched.add(slightly_better)
    assert [item.seq for item in sched.schedule()] == [running]  # 0.6 < margin: no churn
    much_better = scored(4, score=6.2)
    sched.add(much_better)
    batch = sched.schedule()
    assert [item.seq for item in batch] == [much_better]
    assert running.status is SeqStatus.WAITING and running.preemptions == 1


def test_an_aged_request_goes_first_and_is_not_preempted_by_a_higher_score():
    """Priority's aging bound holds at the executor too: ahead in the waiting queue, and safe
    from preemption by requests that are not aged, whatever their score."""
    sched = make(max_num_seqs=1)
    aged = scored(4, score=1.0, priority=1)
    aged.aged = True
    fresh = scored(4, score=9.0, priority=9)
    sched.add(fresh)
    sched.add(aged)
    assert sched.waiting == [aged, fresh]
    resolve(sched.schedule())
    assert sched.running == [aged]
    urgent = scored(4, score=12.0, priority=9)
    sched.add(urgent)
    assert [item.seq for item in sched.schedule()] == [aged]
    assert aged.preemptions == 0 and urgent.status is SeqStatus.WAITING


def test_a_high_score_prefill_never_stalls_the_decodes_beside_it():
    sched = make(budget=16)
    low = scored(4, score=1.0, priority=1)
    sched.add(low)
    resolve(sched.schedule())  # low is decoding
    high = scored(64, score=9.0, priority=9)
    sched.add(high)
    for _ in range(3):  # high's prefill spans several steps; low decodes in every one
        batch = sched.schedule()
        assert {item.seq: item.num_new_tokens for item in batch} == {low: 1, high: 15}
        resolve(batch)


def test_age_moves_a_waiting_sequence_to_the_front():
    sched = make(max_num_seqs=8)
    high, low = scored(4, score=9.0), scored(4, score=1.0)
    sched.add(high)
    sched.add(low)
    sched.age(low)
    assert sched.waiting == [low, high] and low.aged


def test_a_waiting_high_score_prompt_takes_the_budget_before_lower_score_chunks():
    """A high-score arrival starts its prefill at once; the chunks of a lower-score prompt that
    is already running wait for the budget it leaves (no preemption needed)."""
    sched = make(budget=16, max_num_seqs=8)
    low = scored(64, score=1.0)
    sched.add(low)
    resolve(sched.schedule())  # low's prefill has started
    high = scored(40, score=9.0)
    sched.add(high)
    batch = sched.schedule()
    assert {item.seq: item.num_new_tokens for item in batch} == {high: 16}
    assert low.preemptions == 0 and low.status is SeqStatus.RUNNING
    resolve(batch)
    batch = sched.schedule()  # still high's prefill first; low gets what is left
    assert {item.seq: item.num_new_tokens for item in batch} == {high: 16}
    resolve(batch)
    batch = sched.schedule()
    assert {item.seq: item.num_new_tokens for item in batch} == {high: 8, low: 8}


def test_equal_scores_keep_running_chunks_first():
    sched = make(budget=16, max_num_seqs=8)
    first = scored(64, score=5.0)
    sched.add(first)
    resolve(sched.schedule())
    second = scored(40, score=5.0)
    sched.add(second)
    assert {item.seq: item.num_new_tokens for item in sched.schedule()} == {first: 16}


def test_overtake_threshold_covers_what_would_go_before_a_newcomer():
    """What a request must outrank (by the margin) to start here at once: the best waiting
    sequence, every running prefill, and with every slot taken the weakest running one."""
    sched = make(budget=16, max_num_seqs=2)
    sched.preemption_margin = 1.0
    assert sched.overtake_above() is None  # idle: nothing in the way
    decoding = scored(4, score=3.0)
    sched.add(decoding)
    resolve(sched.schedule())
    assert sched.overtake_above() is None  # a free slot and nothing waiting or prefilling
    prefilling = scored(64, score=5.0)
    sched.add(prefilling)
    resolve(sched.schedule())
    assert sched.overtake_above() == 6.0  # its chunks go before anything it outranks
    waiting = scored(4, score=7.0)
    sched.add(waiting)
    assert sched.overtake_above() == 8.0
    sched.finish(waiting)
    sched.finish(prefilling)
    low = scored(4, score=2.0)
    sched.add(low)
    resolve(sched.schedule())
    assert sched.overtake_above() == 3.0  # full: preempting the weakest running (2.0)
    low.aged = True
    decoding.aged = True
    assert sched.overtake_above() is None  # aged runners may not be preempted


def test_intake_room_is_the_prefill_a_horizon_of_steps_does_less_the_backlog():
    sched = make(num_blocks=64, block_size=4, budget=32)
    assert sched.intake_room(2) == 64  # idle: two steps of 32 prompt tokens
    decoding = seq(4)
    sched.add(decoding)
    resolve(sched.schedule())  # now one token a step goes to its decode
    assert sched.intake_room(2) == 2 * 31
    long = seq(80)
    sched.add(long)
    assert sched.intake_room(2) == 62 - 80  # its prompt keeps the executor busy past two steps
    resolve(sched.schedule())  # 31 of its 80 prompt tokens run
    assert sched.intake_room(2) == 62 - 49
    assert sched.intake_room(4) == 124 - 49


def test_intake_room_stops_at_the_kv_blocks_left():
    sched = make(num_blocks=8, block_size=4, budget=64)
    big = seq(20)  # 5 blocks of the 8
    sched.add(big)
    assert sched.intake_room(2) == (8 - 5) * 4  # the prefill budget would take 128
    resolve(sched.schedule())
    assert sched.intake_room(2) == (8 - 5) * 4  # decoding now: its blocks are its own
    sched.add(seq(6))  # waiting: its 2 blocks are spoken for
    assert sched.intake_room(2) == (8 - 5 - 2) * 4


def preempted_and_back(prefix_caching: bool) -> tuple[Sequence, Scheduler]:
    """`low` (8 prompt tokens, 2 full blocks) is preempted by `high`, which needs 4 of the 6
    blocks, and comes back once `high` is done."""
    bm = BlockManager(num_blocks=6, block_size=4, enable_prefix_caching=prefix_caching)
    sched = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=64, admission_watermark=0.0)
    low, high = seq(8, priority=1, max_tokens=4), seq(14, priority=9, max_tokens=2)
    sched.add(low)
    resolve(sched.schedule())
    sched.add(high)
    resolve(sched.schedule())
    assert low.status is SeqStatus.WAITING and low.preemptions == 1
    while low.status is not SeqStatus.RUNNING:
        for item in sched.schedule():
            resolve([item])
            if item.seq is high and high.num_output_tokens >= 2:
                sched.finish(high)
    return low, sched


def test_recomputed_tokens_count_what_the_prefix_cache_did_not_give_back():
    low, sched = preempted_and_back(prefix_caching=False)
    assert low.recomputed_tokens == sched.num_recomputed_tokens == 8  # its whole prompt again
    low, sched = preempted_and_back(prefix_caching=True)
    # Its two full prompt blocks were freed tail first and outlived high's allocation.
    assert low.num_computed_tokens > 8 and low.recomputed_tokens == 0
    assert sched.num_recomputed_tokens == 0


def test_deadline_pacing_shrinks_prefill_while_a_deadline_needs_faster_steps():
    sched = make(num_blocks=256, block_size=4, max_num_seqs=8, budget=64)
    urgent = seq(4, max_tokens=11)
    sched.add(urgent)
    resolve(sched.schedule())  # prefilled; 10 outputs to go
    assert sched.pace_target(now=0.0) is None  # no deadline
    urgent.deadline = 1.0
    # 1 s over its 10 steps and the one in flight, with a margin
    assert sched.pace_target(now=0.0) == pytest.approx(PACE_SAFETY * 1.0 / 11)
    long = seq(200)
    sched.add(long)
    batch = sched.schedule(target=0.1)  # the controller has not slowed anything yet
    assert {i.seq: i.num_new_tokens for i in batch} == {urgent: 1, long: 63}
    resolve(batch)
    sched.step_done(0.2, target=0.1)  # twice too slow: the budget shrinks
    assert sched.pace_tokens == int(64 * 0.8)
    batch = sched.schedule(target=0.1)
    assert {i.seq: i.num_new_tokens for i in batch} == {urgent: 1, long: 50}
    resolve(batch)
    for _ in range(20):
        sched.step_done(0.2, target=0.1)
    batch = sched.schedule(target=0.1)  # never below every decode plus MIN_PREFILL
    assert {i.seq: i.num_new_tokens for i in batch} == {urgent: 1, long: MIN_PREFILL}
    resolve(batch)
    assert sched.paced_steps == 2
    sched.step_done(0.05, target=0.1)  # fast enough: it grows back, and unpaced steps are full
    assert sched.pace_tokens == MIN_PREFILL + PACE_INCREASE
    assert {i.seq: i.num_new_tokens for i in sched.schedule()} == {urgent: 1, long: 63}


def test_past_the_prefill_pacing_pauses_decodes_a_margin_below_the_paced_request():
    for pause in (True, False):
        bm = BlockManager(512, 4, enable_prefix_caching=False)
        sched = Scheduler(bm, 32, 64, admission_watermark=0.0, pause_decodes=pause)
        urgent, peer = seq(4, priority=9, max_tokens=40), seq(4, priority=9, max_tokens=40)
        low = [seq(2, priority=1, max_tokens=40) for _ in range(20)]
        for s in (urgent, peer, *low):
            sched.add(s)
        resolve(sched.schedule())  # all prefilled (48 tokens); every one decodes from here
        urgent.deadline = 1.0
        target = sched.pace_target(now=0.0)
        assert sched.pace_for is urgent
        for _ in range(30):  # steps far too slow: the controller's budget falls to its floor
            sched.step_done(1.0, target=target)
        blocks = {s: list(s.block_table) for s in low}
        batch = sched.schedule(target=target)
        ran = {i.seq for i in batch}
        if not pause:  # never below every decode plus MIN_PREFILL: all 22 run
            assert ran == {urgent, peer, *low} and sched.paused_decodes == 0
            continue
        # The paced request and its own class run; the lower class gets what is left of
        # MIN_PREFILL (no prompt waits): the 16 earliest, and the last 4 sit the step out.
        assert sched.step_budget == 2 + MIN_PREFILL
        assert ran == {urgent, peer, *low[:MIN_PREFILL]} and sched.paused_decodes == 4
        resolve(batch)
        # Paused, they kept their blocks: nothing to recompute when they run again.
        assert all(s.status is SeqStatus.RUNNING and s.block_table == blocks[s] for s in low[16:])
        batch = sched.schedule()  # unpaced: everyone decodes again
        assert {i.seq for i in batch} == {urgent, peer, *low}
        assert sched.num_recomputed_tokens == 0 and sched.num_preemptions == 0


def test_a_request_that_cannot_keep_up_even_with_the_smallest_paced_steps_is_not_paced_for():
    sched = make(budget=64)
    hopeless = seq(4, max_tokens=101)
    sched.add(hopeless)
    resolve(sched.schedule())
    hopeless.deadline = 1.0
    sched.step_done(0.005, target=None)  # fast, but at a full budget: says nothing of a floor
    assert sched.pace_target(now=0.0) is not None
    sched.step_done(0.02, target=0.009, at_floor=True)
    assert sched.floor_step_s == 0.02
    assert sched.pace_target(now=0.0) is None  # it needs ~9 ms steps; paced ones took 20
    assert sched.pace_target(now=-2.0) == pytest.approx(PACE_SAFETY * 3.0 / 101)


def shared(tokens, score, rid):
    return Sequence(rid, list(tokens), SamplingParams(max_tokens=8), score=score,
                    arrival_index=next(_count))


def test_no_preemption_for_a_sequence_the_victim_s_blocks_would_not_make_room_for():
    """R holds 5 blocks once it decodes, 2 of them a prefix P that the waiting S shares.
    Preempting R frees only its other 3 (S holds P too): 2 free + 3 is short of the 6 S needs,
    so R keeps running and S waits (counting all 5 of R's, R was preempted for nothing)."""
    bm = BlockManager(12, 4, enable_prefix_caching=True)
    sched = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=64, admission_watermark=0.0)
    prefix = list(range(500, 508))
    high = shared(range(100, 116), 9.0, "H")  # 4 blocks
    low = shared(prefix + list(range(600, 608)), 1.0, "R")  # 4 blocks, P the first 2
    for s in (high, low):
        sched.add(s)
    resolve(sched.schedule())
    assert bm.num_free_blocks == 4  # 2 once both decode into a fifth block
    waiting = shared(prefix + list(range(700, 721)), 5.0, "S")  # 29 tokens: 8 blocks
    sched.add(waiting)
    for _ in range(3):
        batch = sched.schedule()
        resolve(batch)
        assert {item.seq.key for item in batch} == {"H", "R"}
    assert sched.num_preemptions == 0 and waiting.status is SeqStatus.WAITING
    assert not waiting.block_table and bm.blocks[low.block_table[0]].ref_count == 1


def test_a_saturated_executor_counts_each_prefix_lookup_once():
    """Every slot taken and nothing to preempt: the waiting sequence does not claim (and give
    back) its cached prefix step after step, and when it is admitted its lookup counts once."""
    bm = BlockManager(64, 4, enable_prefix_caching=True)
    sched = Scheduler(bm, max_num_seqs=1, max_num_batched_tokens=64, admission_watermark=0.0)
    prefix = list(range(500, 520))
    first = Sequence("A", prefix + [1], SamplingParams(max_tokens=12), score=5.0,
                     arrival_index=next(_count))
    sched.add(first)
    resolve(sched.schedule())
    queries = bm.prefix_queries
    second = shared(prefix + list(range(900, 920)), 5.0, "B")
    sched.add(second)
    for _ in range(10):
        resolve(sched.schedule())
    assert second.status is SeqStatus.WAITING and bm.prefix_queries == queries
    sched.finish(first)
    batch = sched.schedule()
    assert [item.seq.key for item in batch] == ["B"]
    assert bm.prefix_queries - queries == 40 and second.num_cached_tokens == 20
