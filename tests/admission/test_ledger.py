"""Admission's ledger (who holds what), without NATS: each row of docs/operations.md's "What a
failure costs" table as the ledger decides it. Heartbeat 0.5 s, lease 3 s (the defaults)."""

from __future__ import annotations

from services.admission.ledger import Ledger
from shared.keys import RequestKey

LEASE_S, INTERVAL_S = 3.0, 0.5
KEY = RequestKey("acme", "req-1")


def _ledger() -> Ledger:
    return Ledger(LEASE_S, INTERVAL_S)


def _watch(ledger: Ledger, key: RequestKey, item: bytes, msg: object = None) -> bool:
    """Watched and handed to priority, which answered (as admission's submission does)."""
    taken = ledger.watch(key, item, msg)
    if taken:
        ledger.submitted(key, durable=msg is not None)
    return taken


def _pass(ledger: Ledger, seconds: float, reported=()) -> None:
    """Heartbeats go by; the holders name `reported` at each one."""
    for _ in range(round(seconds / INTERVAL_S)):
        ledger.tick(INTERVAL_S)
        ledger.reported(reported)


def test_an_executor_dies_its_request_is_handed_on_from_its_last_checkpoint():
    ledger = _ledger()
    message = object()
    assert _watch(ledger, KEY, b"item", message)
    _pass(ledger, 2.0, reported=[KEY])
    assert not ledger.checkpoint(KEY, attempt=0, index=0, token_ids=[5, 6, 7])
    assert not ledger.checkpoint(KEY, attempt=0, index=2, token_ids=[7, 8])  # restates one
    _pass(ledger, LEASE_S)  # the executor is gone: nobody names the request
    assert ledger.lost() == []  # exactly a lease of silence is not yet more than a lease
    _pass(ledger, INTERVAL_S)
    [(key, watched)] = ledger.lost()
    assert key == KEY and watched.item == b"item" and watched.tokens == [5, 6, 7, 8]
    ledger.handed_on(watched)
    assert watched.attempt == 1 and ledger.lost() == []  # not lost again at once
    # The old executor was only stalled and comes back: its attempt is revoked, its outputs
    # are not spliced into the new attempt's.
    assert ledger.checkpoint(KEY, attempt=0, index=4, token_ids=[99])
    assert watched.tokens == [5, 6, 7, 8]
    # The new attempt's executor restates the outputs from index 0 and goes on.
    assert not ledger.checkpoint(KEY, attempt=1, index=0, token_ids=[5, 6, 7, 8, 9])
    assert watched.tokens == [5, 6, 7, 8, 9]
    # A checkpoint that skips ahead of what is known is not taken (a gap would corrupt it).
    assert not ledger.checkpoint(KEY, attempt=1, index=7, token_ids=[1])
    assert watched.tokens == [5, 6, 7, 8, 9]
    held = ledger.done(KEY, durable=True)
    assert held is watched and held.msg is message and ledger.held == {}


def test_the_batcher_or_priority_dies_their_requests_are_handed_on_unstarted():
    ledger = _ledger()
    waiting, pulled = RequestKey("acme", "waiting"), RequestKey("beta", "pulled")
    assert _watch(ledger, waiting, b"w")  # a generate, at priority
    assert _watch(ledger, pulled, b"p", object())  # durable, at the batcher
    _pass(ledger, 1.0, reported=[waiting, pulled])
    _pass(ledger, LEASE_S + INTERVAL_S)
    lost = dict(ledger.lost())
    assert set(lost) == {waiting, pulled}
    assert lost[waiting].tokens == [] and lost[pulled].tokens == []  # they had not started
    # Priority is down too and does not take them: they are tried again a lease later, not at
    # every heartbeat.
    _pass(ledger, LEASE_S)
    assert ledger.lost() == []
    _pass(ledger, INTERVAL_S)
    assert set(dict(ledger.lost())) == {waiting, pulled}


def test_priority_answers_late_the_request_stays_watched_and_the_lease_decides():
    """Priority answered admission's submission after its timeout: whether it queued the request
    is unknown, so the watch stays (no answer to the client). Queued, it is reported and ends
    with its Done; not queued, nobody names it and it is handed on after the lease."""
    ledger = _ledger()
    queued, dropped = RequestKey("acme", "queued"), RequestKey("acme", "dropped")
    assert ledger.watch(queued, b"q") and ledger.watch(dropped, b"d")
    _pass(ledger, 2 * LEASE_S)  # no answer yet: a submission in flight is not lost
    assert ledger.lost() == []
    ledger.submitted(queued, durable=False)  # their answers time out: each lease starts now
    ledger.submitted(dropped, durable=False)
    _pass(ledger, LEASE_S, reported=[queued])
    assert ledger.lost() == []  # a whole lease from the timeout, not from the watch
    _pass(ledger, INTERVAL_S, reported=[queued])
    assert [key for key, _ in ledger.lost()] == [dropped]
    assert ledger.done(queued, durable=False) is not None and queued not in ledger.generates


def test_admission_dies_the_next_one_adopts_what_a_service_still_reports():
    restarted = _ledger()
    running, gone = RequestKey("acme", "running"), RequestKey("acme", "gone")
    _pass(restarted, 1.0, reported=[running])  # hearing the holders before redeliveries
    assert not restarted.redelivered(running, object())
    assert restarted.adopt(running, "msg-1")  # still running somewhere: held, not re-admitted
    assert not restarted.adopt(gone, "msg-2")  # nobody has it: admitted again
    assert restarted.redelivered(running, "msg-3")  # delivered again while held
    assert restarted.held[running].msg == "msg-3" and restarted.held[running].item is None
    # Its holder dies too: with no copy here it goes back to JetStream, to run from the start.
    _pass(restarted, LEASE_S + INTERVAL_S)
    [(key, watched)] = restarted.lost()
    assert key == running and watched.item is None
    assert restarted.give_back(key, watched)
    assert restarted.held == {} and restarted.last_reported == {}


def test_a_done_that_comes_while_lost_requests_are_handed_on_wins():
    ledger = _ledger()
    ledger.reported([KEY])
    assert ledger.adopt(KEY, "msg")
    _pass(ledger, LEASE_S + INTERVAL_S)
    [(key, watched)] = ledger.lost()
    assert ledger.done(KEY, durable=True) is watched  # its result was stored meanwhile: acked
    assert not ledger.give_back(key, watched)  # and not handed back to run again


def test_a_stalled_event_loop_or_a_server_outage():
    ledger = _ledger()
    _watch(ledger, KEY, b"item", object())
    ledger.reported([KEY])
    # The event loop stalls for a minute: its clock moves two heartbeats, so the reports that
    # queued up meanwhile are read before the request can look lost.
    ledger.tick(60.0)
    assert ledger.clock == 2 * INTERVAL_S and ledger.lost() == []
    ledger.reported([KEY])
    # The nats-server is down for longer than a lease: no reports arrive, so the request is
    # handed on; its first attempt, still alive, is dropped at its next checkpoint.
    _pass(ledger, LEASE_S + INTERVAL_S)
    [(_, watched)] = ledger.lost()
    ledger.handed_on(watched)
    assert ledger.checkpoint(KEY, attempt=0, index=0, token_ids=[1])


def test_generates_are_watched_once_and_forgotten_at_their_done():
    ledger = _ledger()
    assert _watch(ledger, KEY, b"first")
    assert not _watch(ledger, KEY, b"second")  # the same id again: refused downstream
    assert ledger.generates[KEY].item == b"first"
    assert ledger.done(KEY, durable=False).item == b"first" and ledger.generates == {}
    assert ledger.done(RequestKey("acme", "unknown"), durable=True) is None  # another admission's
    _watch(ledger, KEY, b"again")
    ledger.unwatch(KEY, durable=False)  # priority refused it
    assert ledger.generates == {}


def test_reports_of_requests_nobody_watches_are_forgotten_after_a_lease():
    ledger = _ledger()
    ledger.reported([RequestKey("acme", f"r{i}") for i in range(100)])
    _pass(ledger, LEASE_S + INTERVAL_S)
    assert ledger.lost() == [] and ledger.last_reported == {}


def test_requests_of_two_tenants_with_one_id_are_two_requests():
    ledger = _ledger()
    a, b = RequestKey("acme", "req-1"), RequestKey("beta", "req-1")
    assert _watch(ledger, a, b"a") and _watch(ledger, b, b"b")
    ledger.done(a, durable=False)
    assert list(ledger.generates) == [b]
    assert ("beta", "req-1") in ledger.generates  # a plain tuple from a Holding report matches


def test_what_the_ledger_knows_to_be_in_flight_for_cancels():
    """A cancel is passed on for a request watched here or reported by a holder within the
    lease; in its first lease the ledger cannot tell (holders have not all reported), so it
    knows every request."""
    ledger = _ledger()
    other, adopted = RequestKey("acme", "req-2"), RequestKey("acme", "elsewhere")
    assert ledger.knows(other)  # young
    _pass(ledger, LEASE_S + INTERVAL_S)
    assert not ledger.knows(other) and not ledger.knows(KEY)
    assert _watch(ledger, KEY, b"item")  # a generate watched here
    ledger.reported([adopted])  # one an earlier admission watched, still running
    assert ledger.knows(KEY) and ledger.knows(adopted) and not ledger.knows(other)
    assert ledger.watches(KEY) and not ledger.watches(adopted)
    ledger.done(KEY, durable=False)
    _pass(ledger, LEASE_S + INTERVAL_S)
    ledger.lost()  # forgets reports older than a lease of requests not watched
    assert not ledger.knows(KEY) and not ledger.knows(adopted)
