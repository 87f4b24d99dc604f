"""Output dispatch: deltas reach the right choice, repeats (redelivery, failover) are dropped by
output offset, errors reach the whole request or one choice."""

from __future__ import annotations

from voltserve.services.gateway.dispatcher import OutputDispatcher
from voltserve.shared.protocol import RequestDelta, RequestError, StepOutput


def drain(q) -> list:
    out = []
    while not q.empty():
        out.append(q.get_nowait())
    return out


async def test_repeats_are_dropped_and_choices_routed(rng) -> None:
    d = OutputDispatcher(redis=None, gateway_id="g")
    h = d.register("req", 2)
    tokens = [[rng.randrange(500) for _ in range(20)] for _ in range(2)]
    # Deltas of random sizes, each sent once or twice, some re-sent overlapping (a failover
    # executor re-sending from an earlier offset).
    for i in range(2):
        pos = 0
        while pos < 20:
            k = rng.randint(1, 4)
            start = max(0, pos - rng.randint(0, 2))
            end = min(20, pos + k)
            fin = "length" if end == 20 else None
            for _ in range(rng.randint(1, 2)):
                delta = RequestDelta(f"req.{i}", tokens[i][start:end], start, finish_reason=fin)
                d.dispatch(StepOutput("e0", 1, [delta]))
            pos = end
    d.dispatch(StepOutput("e0", 2, [RequestDelta("other.0", [1], 0)]))  # not ours
    got = {0: [], 1: []}
    finishes = {0: 0, 1: 0}
    for ev in drain(h.queue):
        got[ev.index] += ev.delta.token_ids
        finishes[ev.index] += ev.delta.finish_reason is not None
    assert got[0] == tokens[0] and got[1] == tokens[1]
    assert finishes[0] >= 1 and finishes[1] >= 1


async def test_errors() -> None:
    d = OutputDispatcher(redis=None, gateway_id="g")
    h = d.register("req", 2)
    d.dispatch(RequestError("req.1", 503, "full"))
    d.dispatch(RequestError("req", 400, "too long"))
    d.dispatch(RequestError("nobody", 400, "x"))
    evs = drain(h.queue)
    assert [(e.index, e.error.status) for e in evs] == [(1, 503), (-1, 400)]
    d.unregister("req")
    d.dispatch(RequestError("req", 400, "late"))
    assert h.queue.empty()
