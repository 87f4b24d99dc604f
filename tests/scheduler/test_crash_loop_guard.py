"""The crash-loop bookkeeping of services/scheduler/failover.py on its own: deaths in a row with
no token in between fail a request at the second; progress starts the count again; a suspect is
one until it streams a token; the counts survive the route record (a new leader)."""

from __future__ import annotations

from voltserve.services.scheduler.failover import CRASH_LOOP_DEATHS, RequestTracker, Tracked
from voltserve.shared.protocol import EngineRequest


def _tracked(tracker: RequestTracker, rid: str = "r") -> Tracked:
    req = EngineRequest(rid, "gw", [1, 2, 3], {"max_tokens": 100}, 0.0)
    t = tracker.add(req)
    t.executor_id, t.instance = "e0", "i0"
    return t


def test_two_deaths_without_output_fail_the_request() -> None:
    tracker = RequestTracker()
    t = _tracked(tracker)
    assert CRASH_LOOP_DEATHS == 2
    assert not t.suspect
    assert not tracker.on_death(t) and t.suspect
    assert tracker.on_death(t)


def test_output_between_deaths_starts_the_count_again(rng) -> None:
    tracker = RequestTracker()
    t = _tracked(tracker)
    n = 0
    for _ in range(rng.randint(2, 6)):
        assert not tracker.on_death(t) and t.suspect
        assert not tracker.take_suspect_cleared()
        k = rng.randint(1, 4)
        tracker.on_progress("r", n, list(range(k)), None)
        n += k
        assert not t.suspect and tracker.take_suspect_cleared()
        assert not tracker.take_suspect_cleared()  # reported once
    assert not tracker.on_death(t)
    assert tracker.on_death(t)  # the next death with no token in between


def test_a_repeated_delta_is_no_progress() -> None:
    """A resend's executor repeats the tokens already streamed (receivers drop them by offset):
    only a token past the ones known at the death counts."""
    tracker = RequestTracker()
    t = _tracked(tracker)
    tracker.on_progress("r", 0, [5, 6, 7], None)
    assert not tracker.on_death(t)
    tracker.on_progress("r", 1, [6, 7], None)
    assert t.suspect
    assert tracker.on_death(t)


def test_suspect_executors_and_the_route_record() -> None:
    tracker = RequestTracker()
    a, b, c = (_tracked(tracker, rid) for rid in "abc")
    tracker.on_death(a)
    tracker.on_death(b)
    a.executor_id, b.executor_id, c.executor_id = "e1", "", "e2"
    assert tracker.suspect_executors() == {"e1"}  # b is queued, c is no suspect
    back = Tracked.from_record(a.to_record())
    assert (back.deaths, back.resumed_at, back.suspect) == (1, 0, True)
