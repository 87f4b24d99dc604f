"""Output the broker lost (a gap in a choice's output offsets) ends that choice with a clear 503
instead of streaming text with a hole in it; nothing of the choice reaches the client after it,
and the other choice goes on."""

from __future__ import annotations

from voltserve.services.gateway.dispatcher import OutputDispatcher
from voltserve.shared.protocol import RequestDelta, StepOutput


def drain(q) -> list:
    out = []
    while not q.empty():
        out.append(q.get_nowait())
    return out


async def test_a_gap_ends_the_choice_with_an_error(rng) -> None:
    d = OutputDispatcher(redis=None, gateway_id="g")
    h = d.register("req", 2)
    tokens = [rng.randrange(500) for _ in range(30)]
    cut = rng.randrange(1, 20)  # tokens [cut, lost_end) never arrive
    lost_end = cut + rng.randrange(1, 10)
    sent = 0
    for start in range(0, 30, 2):
        end = min(30, start + 2)
        for i in (0, 1):
            if i == 0 and start < lost_end and end > cut:
                continue  # lost with the broker
            fin = "length" if end == 30 else None
            delta = RequestDelta(f"req.{i}", tokens[start:end], start, finish_reason=fin)
            d.dispatch(StepOutput("e0", start, [delta]))
            sent += 1
    evs = drain(h.queue)
    first = [e for e in evs if e.index == 0]
    got = [t for e in first if e.delta is not None for t in e.delta.token_ids]
    assert got == tokens[: (cut // 2) * 2]  # what came before the gap, nothing after it
    errors = [e.error for e in first if e.error is not None]
    assert len(errors) == 1 and first[-1].error is errors[0]
    assert errors[0].status == 503 and "lost" in errors[0].message
    assert errors[0].request_id == "req.0"
    other = [t for e in evs if e.index == 1 for t in e.delta.token_ids]
    assert other == tokens
    # Every delta of the request counts as an event (LostRequestWatch: is it still moving?).
    assert h.events == sent
