"""Admission's intake: tenants in turn, and a full intake refuses from the longest line."""

import asyncio

from services.admission.intake import FairIntake


async def test_tenants_are_taken_in_turn_not_in_arrival_order():
    intake = FairIntake(capacity=100)
    for i in range(50):
        assert intake.put("heavy", f"h{i}") == []
    intake.put("light", "l0")
    intake.put("light", "l1")
    taken = [(await intake.get())[1] for _ in range(5)]
    assert taken == ["h0", "l0", "h1", "l1", "h2"]  # light waits one turn, not 50 requests
    assert len(intake) == 47


async def test_a_full_intake_refuses_the_latest_of_the_longest_line():
    intake = FairIntake(capacity=4)
    for i in range(4):
        intake.put("heavy", f"h{i}")
    assert intake.put("heavy", "h4") == ["h4"]  # its own line is the longest: the newcomer goes
    assert intake.put("light", "l0") == ["h3"]  # another tenant's newcomer takes h3's place
    assert len(intake) == 4
    assert [(await intake.get())[1] for _ in range(4)] == ["h0", "l0", "h1", "h2"]


async def test_each_request_wakes_one_waiting_worker():
    intake = FairIntake(capacity=10)
    got: list[str] = []

    async def worker():
        got.append((await intake.get())[1])

    workers = [asyncio.create_task(worker()) for _ in range(3)]
    await asyncio.sleep(0)
    intake.put("a", "x")
    intake.put("b", "y")
    await asyncio.sleep(0.01)
    assert sorted(got) == ["x", "y"] and sum(w.done() for w in workers) == 2
    intake.put("a", "z")  # a swap at capacity would not add a wake-up; this adds one
    await asyncio.wait(workers, timeout=1)
    assert sorted(got) == ["x", "y", "z"] and len(intake) == 0
    assert intake.drain() == []


async def test_the_longest_line_is_tracked_through_any_sequence():
    """O(1) puts: the longest line is kept track of, not searched for (a flood on many tenant
    names made every put at capacity walk every line). Checked against a search after each of
    5,000 random puts and takes."""
    import random

    rng = random.Random(7)
    intake = FairIntake(capacity=50)
    for step in range(5000):
        if rng.random() < 0.6:
            tenant = f"t{rng.randint(0, 20 if step % 1000 < 500 else 2000)}"
            before = {t: len(line) for t, line in intake.lines.items()}
            refused = intake.put(tenant, (tenant, step))
            if refused and refused != [(tenant, step)]:
                assert before[refused[0][0]] == max(before.values())  # from a longest line
        elif len(intake):
            await intake.get()
        lengths = [len(line) for line in intake.lines.values()]
        assert intake.longest == max(lengths, default=0)
        assert sum(lengths) == len(intake) <= 50


async def test_past_its_bytes_the_intake_refuses_from_the_tenant_holding_the_most():
    """4,096 requests of 1 MiB would be 4 GiB: past max_bytes the latest requests of the tenant
    holding the most bytes are refused, as many as the newcomer needs, or the newcomer when its
    own tenant would then hold the most. A tenant of many small requests does not pay for
    another's few large ones. Every request left is still taken, in turn."""
    intake = FairIntake(capacity=100, max_bytes=10_000, size_of=len)
    for i in range(40):
        assert intake.put("chatty", f"c{i:02d}".ljust(10, ".")) == []  # 400 bytes
    for i in range(4):
        assert intake.put("large", f"L{i}".ljust(2000, "l")) == []  # 8,000 bytes
    assert intake.bytes == 8_400
    assert intake.put("large", "L4".ljust(2000, "l")) == ["L4".ljust(2000, "l")]  # its own
    refused = intake.put("other", "o" * 4000)  # two of the large ones make room, none of chatty's
    assert [r[:2] for r in refused] == ["L3", "L2"]
    assert intake.bytes == 8_400 and len(intake) == 43
    assert intake.tenant_bytes == {"chatty": 400, "large": 4_000, "other": 4_000}
    taken = [(await intake.get())[1][:3] for _ in range(len(intake))]
    assert taken[:4] == ["c00", "L0l", "ooo", "c01"] and len(taken) == 43
    assert intake.bytes == 0 and intake.tenant_bytes == {} and len(intake) == 0
    # A line the heaviest's refusal empties leaves the turns too.
    intake.put("big", "b" * 9000)
    intake.put("small", "s" * 500)
    assert intake.put("new", "n" * 1000) == ["b" * 9000]
    assert "big" not in intake.lines and list(intake.turns) == ["small", "new"]
    assert [(await intake.get())[1][0] for _ in range(2)] == ["s", "n"]
    # The wake-ups left by those refused find nothing and wait again.
    waiter = asyncio.ensure_future(intake.get())
    await asyncio.sleep(0.01)
    assert not waiter.done()
    intake.put("light", "late")
    assert (await asyncio.wait_for(waiter, 1))[1] == "late"
