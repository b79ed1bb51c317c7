"""The request-level scheduler as the priority service drives it, without NATS."""

import pytest

from services.priority.request_level import Charge, RequestScheduler
from shared.config import RequestLevel
from shared.keys import RequestKey
from shared.messages import DISPATCH_BYTES, Done, WorkItem
from shared.protocol import GenerateRequest


def item(request_id, tenant="t", priority=5, arrival=0.0, prompt_len=100, max_tokens=100,
         deadline=None):
    request = GenerateRequest(request_id=request_id, prompt_token_ids=[1] * prompt_len,
                              max_tokens=max_tokens, priority=priority)
    return WorkItem(request=request, tenant=tenant, arrival_time=arrival, deadline=deadline)


def done(sched, request_id, tenant, output_tokens, priority=5, max_tokens=100, ttft_ms=50.0,
         reason="stop", now=0.0, arrival=0.0):
    """The Done of a request `sched` dispatched (one not dispatched by the test: as though
    charged for all of max_tokens)."""
    sched.charges.setdefault(RequestKey(tenant, request_id), Charge(0.0, max_tokens, arrival))
    sched.done(Done(tenant, request_id, False, arrival, priority, 100, output_tokens, max_tokens,
                    ttft_ms, reason), now)


def test_dispatch_records_score_wait_and_charges_the_tenant_in_advance():
    sched = RequestScheduler(RequestLevel())
    sched.push(item("a", arrival=10.0))
    [dispatch] = sched.pop(4, now=10.5)
    assert dispatch.item.priority_score == dispatch.score
    assert dispatch.item.queue_wait_ms == 500.0
    # The prior: all of max_tokens.
    assert sched.charges[RequestKey("t", "a")] == Charge(100 + 2 * 100, 100, 10.0)
    assert sched.counters.counters["t"] == 100 + 2 * 100
    assert set(dispatch.terms) == {"base", "urgency", "resource", "fairness", "aged", "over_share",
                                   "held", "hopeless"}


def test_completions_correct_the_charge_and_teach_the_predictor():
    sched = RequestScheduler(RequestLevel(predictor_alpha=1.0))
    sched.push(item("a"))
    sched.pop(1, now=0.0)
    done(sched, "a", "t", output_tokens=20, now=1.0)
    assert sched.counters.counters["t"] == 100 + 2 * 20 and not sched.charges
    sched.push(item("b"))
    assert sched.queue.predicted_output(0) == 20
    # One that ended while it waited teaches nothing.
    sched.done(Done("t", "expired", False, 0.0, 5, 100, 0, 100, None, "deadline_exceeded"),
               now=2.0)
    assert sched.counters.counters["t"] == 100 + 2 * 20 and not any(sched.class_weights.samples.values())
    # One another priority dispatched (a replica, or this one before a restart) charges its
    # tenant's counter its whole cost, and teaches nothing else.
    sched.done(Done("u", "elsewhere", False, 0.0, 5, 40, 30, 100, 12.0, "stop"), now=3.0)
    assert sched.counters.counters["u"] == 40 + 2 * 30 and not any(sched.class_weights.samples.values())


def test_light_tenant_goes_ahead_of_a_heavy_backlog():
    """VTC: once the heavy tenant has been served, a light tenant's new request is next even
    though many heavy requests arrived earlier."""
    sched = RequestScheduler(RequestLevel())
    for i in range(20):
        sched.push(item(f"h{i}", tenant="heavy", arrival=float(i) * 0.01))
    first = sched.pop(2, now=1.0)
    assert [d.item.tenant for d in first] == ["heavy", "heavy"]
    sched.push(item("l0", tenant="light", arrival=1.0))
    # Light starts level with heavy (no banked credit): one more heavy request, then light.
    assert [d.item.request_id for d in sched.pop(2, now=1.0)] == ["h2", "l0"]


def test_one_pull_alternates_between_equally_served_tenants():
    sched = RequestScheduler(RequestLevel())
    for i in range(4):
        sched.push(item(f"a{i}", tenant="a", arrival=0.0))
    for i in range(4):
        sched.push(item(f"b{i}", tenant="b", arrival=1.0))
    picked = [d.item.request_id for d in sched.pop(6, now=2.0)]
    assert picked == ["a0", "b0", "a1", "b1", "a2", "b2"]


def test_one_pull_over_hundreds_of_tenants_serves_each_once_before_any_twice():
    """300 equally served tenants, two requests each, one pull of 450: every tenant's first
    request before any tenant's second (the pull follows each charge pick by pick)."""
    sched = RequestScheduler(RequestLevel())
    for i in range(300):
        for j in range(2):
            sched.push(item(f"r{i}-{j}", tenant=f"t{i}", arrival=float(j)))
    picked = [d.item.request_id for d in sched.pop(450, now=2.0)]
    assert len(picked) == 450
    assert {r.split("-")[0] for r in picked[:300]} == {f"r{i}" for i in range(300)}
    assert all(r.endswith("-0") for r in picked[:300])
    assert len(set(picked)) == 450


def test_scores_reported_are_those_at_the_pick_not_at_the_start_of_the_pull():
    sched = RequestScheduler(RequestLevel())
    sched.push(item("h0", tenant="heavy"))
    sched.push(item("h1", tenant="heavy"))
    sched.counters.charge("heavy", 2000.0)  # heavy is 2,000 tokens ahead ...
    sched.push(item("l0", tenant="light"))  # ... of light, which starts level with heavy
    sched.counters.counters["light"] = 0.0  # (as if light had been backlogged all along)
    light, heavy = sched.pop(2, now=0.0)
    assert light.item.request_id == "l0" and heavy.item.request_id == "h0"
    # Once light left the queue, heavy was the least-served backlogged tenant: no penalty.
    assert heavy.terms["fairness"] == 0.0 and heavy.score == light.score


def test_fcfs_ignores_tenants_and_priorities():
    sched = RequestScheduler(RequestLevel(policy="fcfs"))
    sched.push(item("h0", tenant="heavy", priority=1))
    sched.push(item("l0", tenant="light", priority=9))
    assert [d.item.request_id for d in sched.pop(2, now=0.0)] == ["h0", "l0"]


def test_expired_requests_count_as_class_misses():
    sched = RequestScheduler(RequestLevel(class_ttft_slo_ms={9: 100.0}))
    sched.push(item("late", priority=9, deadline=1.0))
    sched.push(item("fine", priority=9))
    assert [i.request_id for i in sched.expired(now=2.0)] == ["late"]
    assert sched.counters.backlog == {"t": 1}
    sched.class_weights.update(now=2.0)
    assert sched.class_weights.weights[9] > 1.0


def test_load_counts_executors_and_the_queue():
    sched = RequestScheduler(RequestLevel())
    assert sched.load == 0.0
    sched.executor_load = {"e0": (6, 8), "e1": (2, 8)}
    sched.push(item("a"))
    assert sched.load == (6 + 2 + 1) / 16


def test_aged_requests_go_first_without_an_inflated_score():
    sched = RequestScheduler(RequestLevel(max_wait_s=10.0))
    sched.push(item("old", priority=1, arrival=0.0))
    sched.push(item("new", priority=9, arrival=9.0))
    old, new = sched.pop(2, now=11.0)
    assert (old.item.request_id, old.terms["aged"]) == ("old", 1.0)
    assert (new.item.request_id, new.terms["aged"]) == ("new", 0.0)
    assert old.score < new.score and old.item.standing < new.item.standing


def test_the_executor_gets_the_score_without_the_clock_dependent_urgency():
    sched = RequestScheduler(RequestLevel())
    sched.push(item("soon", priority=5, deadline=1.2))
    [dispatch] = sched.pop(1, now=1.0)
    assert dispatch.terms["urgency"] > 0.5
    assert dispatch.item.standing == pytest.approx(dispatch.score - dispatch.terms["urgency"])


def test_executors_report_running_tenants_and_the_fairness_term_is_bounded():
    sched = RequestScheduler(RequestLevel(fairness_max=3.0))
    sched.executor_report("e0", busy=2, slots=4, tenants={"light": 2})
    sched.counters.counters["light"] = 0.0
    sched.push(item("h0", tenant="heavy"))
    sched.counters.charge("heavy", 50_000.0)  # far ahead of light, which only runs
    [dispatch] = sched.pop(1, now=0.0)
    assert dispatch.terms["fairness"] == -3.0  # bounded: priority classes still count
    assert dispatch.item.standing < 5.0 - 2.0
    sched.executor_gone("e0")
    assert sched.counters.running == set() and sched.load == 0.0


def test_a_tenant_over_its_share_ages_only_within_its_own_line():
    """The heavy tenant is far ahead of the light one: its aged request jumps its own backlog,
    not the light tenant's request, and the executor's bound for it counts from dispatch."""
    sched = RequestScheduler(RequestLevel(max_wait_s=10.0))
    sched.executor_report("e0", busy=1, slots=4, tenants={"light": 1})
    sched.counters.counters["light"] = 0.0
    sched.push(item("heavy-old", tenant="heavy", arrival=0.0, prompt_len=4000))
    sched.push(item("heavy-new", tenant="heavy", arrival=9.0, prompt_len=100))
    sched.counters.charge("heavy", 50_000.0)
    sched.push(item("light", tenant="light", arrival=10.5))
    picks = sched.pop(3, now=11.0)
    assert [d.item.request_id for d in picks] == ["light", "heavy-old", "heavy-new"]
    old = picks[1]
    assert (old.terms["aged"], old.terms["over_share"], old.item.age_from_dispatch) == \
        (0.0, 1.0, True)
    assert not picks[0].item.age_from_dispatch and picks[0].terms["over_share"] == 0.0
    # At the executor it keeps its place at the head of its tenant's line: above the later,
    # shorter request of its tenant (which scores higher), below the light tenant's.
    assert old.terms["held"] == 1.0 and old.score < picks[2].score
    assert picks[2].item.standing < old.item.standing < picks[0].item.standing


def test_an_overtaking_pull_takes_only_requests_that_reach_the_standing():
    sched = RequestScheduler(RequestLevel())
    sched.push(item("p1", priority=1))
    sched.push(item("p5", priority=5))
    sched.push(item("p9", priority=9))
    standing_of_p5 = sched.pop(3, now=0.0)[1].item.standing
    for name, priority in (("p1", 1), ("p5", 5), ("p9", 9)):
        sched.push(item(name, priority=priority))
    threshold = standing_of_p5 + 0.5
    assert sched.can_overtake(threshold, now=0.0)
    [only] = sched.pop(3, now=0.0, min_standing=threshold)
    assert only.item.request_id == "p9"
    assert not sched.can_overtake(threshold, now=0.0)
    assert sched.pop(3, now=0.0, min_standing=threshold) == []
    assert len(sched) == 2


def test_nothing_overtakes_while_an_aged_request_waits():
    sched = RequestScheduler(RequestLevel(max_wait_s=10.0))
    sched.push(item("old", priority=1, arrival=0.0))
    sched.push(item("p9", priority=9, arrival=10.5))
    assert sched.can_overtake(0.0, now=5.0)
    assert not sched.can_overtake(0.0, now=11.0)  # "old" is past the bound: it goes first
    assert sched.pop(2, now=11.0, min_standing=0.0) == []
    assert [d.item.request_id for d in sched.pop(2, now=11.0)] == ["old", "p9"]


def test_a_held_request_takes_its_tenants_best_standing_without_anyones_urgency():
    """Held at the head of its over-share tenant's line, a request's standing at the executor is
    that line's best standing (urgency left out, as for every standing), never a deadline
    urgency borrowed from another request."""
    sched = RequestScheduler(RequestLevel(max_wait_s=10.0))
    sched.executor_report("e0", busy=1, slots=4, tenants={"light": 1})
    sched.counters.counters["light"] = 0.0
    sched.push(item("old", tenant="heavy", priority=1, arrival=0.0))
    sched.push(item("urgent", tenant="heavy", priority=5, arrival=10.5, deadline=11.2))
    sched.counters.charge("heavy", 50_000.0)
    [old, urgent] = sched.pop(2, now=11.0)
    assert old.item.request_id == "old" and old.terms["held"] == 1.0
    assert urgent.terms["urgency"] > 1.0
    assert urgent.item.standing == pytest.approx(urgent.score - urgent.terms["urgency"])
    assert old.item.standing == pytest.approx(urgent.item.standing, abs=1e-3)
    assert old.item.standing < urgent.score - 1.0


def test_a_request_sent_back_by_the_batcher_is_not_charged_twice():
    sched = RequestScheduler(RequestLevel())
    sched.push(item("a"))
    [dispatch] = sched.pop(1, now=0.0)
    assert sched.counters.counters["t"] == 100 + 2 * 100
    sched.push(dispatch.item)  # the assignment failed: back to the queue, refunded
    assert sched.counters.counters["t"] == 0.0 and not sched.charges
    sched.pop(1, now=0.0)
    assert sched.counters.counters["t"] == 100 + 2 * 100


def test_an_overtaking_long_poll_can_look_at_new_arrivals_only():
    sched = RequestScheduler(RequestLevel())
    sched.push(item("p9-old", priority=9))
    seen = sched.queue.last_seq
    assert sched.can_overtake(5.0, now=0.0)  # the whole queue: p9-old qualifies
    assert not sched.can_overtake(5.0, now=0.0, after_seq=seen)  # nothing new
    sched.push(item("p1", priority=1))
    assert not sched.can_overtake(5.0, now=0.0, after_seq=seen)  # the newcomer does not
    sched.push(item("p9-new", priority=9))
    assert sched.can_overtake(5.0, now=0.0, after_seq=seen)


def test_a_full_queue_pushes_out_the_largest_tenants_lowest_latest_or_a_lower_class():
    sched = RequestScheduler(RequestLevel(max_pending_requests=5))
    for i, priority in enumerate((1, 1, 9, 1)):
        sched.push(item(f"h{i}", tenant="heavy", priority=priority))
    durable = item("h4", tenant="heavy", priority=0)
    durable.durable = True
    sched.push(durable)
    assert sched.queue.full
    light = item("l0", tenant="light", priority=5)
    pushed = sched.push_out_for(light, 1.0)[0]  # heavy's lowest, latest; durable ones stay
    assert pushed.request_id == "h3" and len(sched.queue) == 4
    assert sched.counters.backlog == {"heavy": 4}
    sched.push(light)
    assert sched.push_out_for(item("l1", tenant="light"), 2.0)[0].request_id == "h1"
    sched.push(item("l1", tenant="light"))
    # heavy holds 3, light would hold 3: only a lower class than the newcomer's of a tenant
    # holding at least as much.
    assert sched.push_out_for(item("l2", tenant="light", priority=1), 3.0)[0] is None
    assert sched.push_out_for(item("l2", tenant="light", priority=9), 3.0)[0].request_id == "h0"
    sched.push(item("l2", tenant="light", priority=9))
    assert sched.push_out_for(item("h5", tenant="heavy", priority=9), 4.0)[0].request_id == "l1"


def test_a_full_queue_first_sheds_a_request_that_can_no_longer_make_its_deadline():
    sched = RequestScheduler(RequestLevel(max_pending_requests=4))
    sched.executor_report("e0", busy=1, slots=1, tenants={}, step_ms=20.0)
    sched.push(item("unknown", tenant="new", priority=9, deadline=3.0))  # no history yet
    for i in range(5):  # tenant t's priority-9 requests use all of their max_tokens
        done(sched, f"done{i}", "t", 100, priority=9)
    sched.push(item("low", priority=1))
    sched.push(item("late", priority=9, deadline=3.0))  # 100 tokens at 20 ms: needs ~2 s
    sched.push(item("fine", priority=5, deadline=10.0))
    assert sched.push_out_for(item("new", priority=1), now=0.0) == (None, "")  # all can make it
    pushed, why = sched.push_out_for(item("new2", priority=1), now=2.5)
    # Only by its class's own history: "unknown" is judged by the prior alone, never hopeless.
    assert (pushed.request_id, why) == ("late", "hopeless")
    assert sched.scores(2.5).terms["hopeless"].sum() == 0


def test_a_full_queue_sheds_a_request_the_queue_ahead_of_it_would_make_miss_its_deadline():
    """Each request would make its deadline if it started now; but at the rate requests have
    been leaving the queue (2 a second), the priority-5 one ranked behind 8 others cannot start
    before its deadline: it goes before a priority-1 request that can wait for the aging bound."""
    sched = RequestScheduler(RequestLevel(max_pending_requests=12))
    sched.executor_report("e0", busy=1, slots=1, tenants={}, step_ms=10.0)
    for i in range(5):  # priority 5 uses all of its max_tokens: its predictions are known
        done(sched, f"done{i}", "t", 100, priority=5)
    for i in range(10):  # two dispatched a second for 5 s
        sched.push(item(f"early{i}", priority=5))
        sched.pop(1, now=i * 0.5)
    assert sched.dispatch_rate(5.0) == pytest.approx(10 / 5.0)
    for i in range(8):
        sched.push(item(f"ahead{i}", priority=9, deadline=60.0))
    sched.push(item("low", priority=1))
    sched.push(item("doomed", priority=5, deadline=7.0))  # ~1 s of service, 8 ahead: ~5 s
    sched.push(item("fine", priority=5, deadline=30.0))
    sched.push(item("also_low", priority=1))
    assert sched.scores(5.0).terms["hopeless"].sum() == 0  # none hopeless if started now
    pushed, why = sched.push_out_for(item("new", priority=5), now=5.0)
    assert (pushed.request_id, why) == ("doomed", "hopeless")
    # Without a measured rate (nothing dispatched lately) nothing is judged doomed.
    assert sched.dispatch_rate(60.0) == 0.0


def test_a_request_back_from_the_batcher_is_taken_past_the_bound():
    sched = RequestScheduler(RequestLevel(max_pending_requests=2))
    sched.push(item("a"))
    sched.push(item("b"))
    [dispatch] = sched.pop(1, now=0.0)
    sched.push(item("c"))
    assert sched.queue.full and dispatch.item.key in sched.charges
    sched.push(dispatch.item)
    assert len(sched.queue) == 3


def test_push_outs_under_a_flood_reuse_one_ranking_and_skip_what_left_since():
    sched = RequestScheduler(RequestLevel(max_pending_requests=4))
    for i in range(4):
        sched.push(item(f"h{i}", tenant="heavy", priority=1))
    assert sched.push_out_for(item("l0", tenant="light"), 0.0)[0].request_id == "h3"
    sched.push(item("l0", tenant="light"), past_bound=True)
    sched.remove("h2", "heavy")  # cancelled meanwhile: the ranking skips it
    sched.push(item("h9", tenant="heavy", priority=1))  # after the ranking: not yet a candidate
    assert sched.push_out_for(item("l1", tenant="light"), 0.1)[0].request_id == "h1"
    assert sched.push_out_for(item("l2", tenant="light"), 0.5)[0].request_id == "h9"  # re-ranked


@pytest.mark.parametrize("policy, tenants", [("priority", ["t"]), ("adaptive", ["a", "b"])])
def test_a_pull_stops_at_its_byte_budget_and_always_takes_the_best(policy, tenants):
    """A pull's reply is one message: requests stop being added where their encoded sizes
    reach `max_bytes` (here four and a half requests' worth), in the order the pull would take
    them, by one selection or pick by pick (fairness between backlogged tenants); the best
    request goes even when it alone is over the budget. Those left stay queued, uncharged."""
    sched = RequestScheduler(RequestLevel(policy=policy))
    for i in range(10):
        sched.push(item(f"r{i}", tenant=tenants[i % len(tenants)], arrival=i * 0.01,
                        prompt_len=1000))
    size = int(sched.queue.sizes()[0])
    assert size >= 1000 + DISPATCH_BYTES  # 1,000 token ids, and room for what dispatch adds
    taken = sched.pop(10, now=1.0, max_bytes=4.5 * size)
    assert [d.item.request_id for d in taken] == ["r0", "r1", "r2", "r3"]
    assert len(sched.queue) == 6
    assert sum(sched.counters.counters.values()) == 4 * (1000 + 2 * 100)
    [alone] = sched.pop(10, now=1.0, max_bytes=10)
    assert alone.item.request_id == "r4"


def test_refused_tenants_are_those_push_out_for_would_refuse():
    """What priority tells admission to refuse at once agrees with `push_out_for`: for every
    tenant and class, a newcomer is refused by one exactly when the other refuses it."""
    sched = RequestScheduler(RequestLevel(max_pending_requests=8))
    assert sched.refused_tenants(0.0) == {}  # room: nobody
    for i in range(5):
        sched.push(item(f"h{i}", tenant="heavy", priority=3 if i else 1))
    for i in range(2):
        sched.push(item(f"m{i}", tenant="mid", priority=5))
    assert sched.refused_tenants(0.0) == {}
    sched.push(item("l0", tenant="light", priority=7))
    refused = sched.refused_tenants(0.0)
    assert refused == {"heavy": 1}  # heavy holds the most; above its lowest class it displaces
    probes = [(tenant, priority) for tenant in ("heavy", "mid", "light", "new")
              for priority in (0, 1, 2, 5, 10)]
    for now, (tenant, priority) in enumerate(probes, start=1):  # each ranks the queue afresh
        assert sched.refused_tenants(float(now)) == refused
        pushed, _ = sched.push_out_for(item("x", tenant=tenant, priority=priority), float(now))
        assert (pushed is None) == (priority <= refused.get(tenant, -1)), (tenant, priority)
        if pushed is not None:  # put back: each probe sees the same queue
            sched.push(pushed, past_bound=True)


def test_a_second_request_reusing_a_running_id_is_not_taken_for_the_first():
    """A generate that reuses the id of one that runs is another request: it neither refunds
    the first's charge nor passes the queue bound, and its end (here: it expired waiting) does
    not correct the first's charge."""
    sched = RequestScheduler(RequestLevel(max_pending_requests=1))
    sched.push(item("x", arrival=1.0))
    [first] = sched.pop(1, now=1.0)
    charged = sched.counters.counters["t"]
    twin = item("x", arrival=2.0)
    assert sched.dispatched(twin) is None and sched.dispatched(first.item) is not None
    sched.push(twin)
    assert sched.counters.counters["t"] == charged and sched.queue.full
    sched.done(Done("t", "x", False, 2.0, 5, 100, 0, 100, None, "deadline_exceeded"), now=3.0)
    assert sched.counters.counters["t"] == charged and RequestKey("t", "x") in sched.charges
    done(sched, "x", "t", output_tokens=100, arrival=1.0)  # the first ends: corrected, gone
    assert sched.counters.counters["t"] == charged and not sched.charges


def test_per_tenant_state_follows_the_tenants_active_lately_not_every_tenant_seen():
    """20,000 tenants, each one request, a few waiting at a time: the queue's tenant table,
    the fairness counters (once idle ones are forgotten), the length predictor and the served
    table stay bounded, and a tenant's fairness counter forgotten at or below the floor is
    where it would start again anyway."""
    sched = RequestScheduler(RequestLevel())
    sched.predictor.capacity = 1000
    for i in range(20_000):
        tenant = f"t{i}"
        sched.push(item(f"r{i}", tenant=tenant))
        if i % 4 == 3:
            for dispatch in sched.pop(4, now=float(i)):
                done(sched, dispatch.item.request_id, dispatch.item.tenant, output_tokens=10)
    assert len(sched.queue) == 0 and len(sched.queue.tenants) <= 4
    floor = max(sched.counters.counters.values())
    sched.counters.running = {"t19999"}  # one tenant still runs something, the most served
    sched.counters.counters["t19999"] = floor
    sched.counters.counters["lead"] = floor + 900.0  # idle, ahead of it: still paying that off
    assert sched.counters.forget_idle() == 19_999
    assert set(sched.counters.counters) == {"t19999", "lead"}
    sched.push(item("back", tenant="t7"))  # forgotten: it starts at the floor, as it would have
    assert sched.counters.counters["t7"] == floor
    assert len(sched.predictor.history) == 1000
    assert len(sched.served) == 101 and sched.served["other"]["output_tokens"] > 0
    assert len(sched.stats(0.0)["tenant_counters"]) <= 100
