"""The renderer service's batch path against a real valkey server: one read's requests are
rendered in stream order, a redelivered request already handed on is skipped, a request that
cannot render becomes an error for its gateway, and nothing reaches a stream before
after_batch."""

from __future__ import annotations

import random

from voltserve.services.renderer.main import RendererService, done_key
from voltserve.services.renderer.render import Renderer
from voltserve.shared import streams
from voltserve.shared.protocol import EngineRequest, RenderRequest, RequestError

from tests.checkpoints import checkpoint, limits


async def test_handle_batch_renders_in_order_skips_done_and_reports_bad(redis_url):
    print("seed", seed := random.randrange(2**31))
    rng = random.Random(seed)
    r = streams.connect(redis_url)
    renderer = Renderer(str(checkpoint("qwen2")), limits("qwen2"))
    svc = RendererService(r, renderer)
    n = rng.randrange(4, 40)
    reqs = [
        RenderRequest(
            request_id=f"req{i}",
            gateway_id="gw1",
            kind="completion",
            prompt=[rng.randrange(renderer.vocab_size) for _ in range(rng.randrange(1, 50))],
            sampling={"max_tokens": 4, "seed": i},
        )
        for i in range(n)
    ]
    done, bad = rng.sample(range(n), 2)
    reqs[bad].prompt = [renderer.vocab_size + 3]  # out of the vocabulary
    await r.set(done_key(reqs[done].request_id), b"1")
    sched0 = await r.xlen(streams.sched_stream())

    await svc.handle_batch([(f"{i}-0".encode(), m) for i, m in enumerate(reqs)])
    assert await r.xlen(streams.sched_stream()) == sched0  # deferred to after_batch
    await svc.after_batch()

    entries = await r.xrange(streams.sched_stream())
    handed = [streams.decode_fields(f) for _, f in entries[sched0:]]
    want = [m for i, m in enumerate(reqs) if i not in (done, bad)]
    assert [e.request_id for e in handed] == [f"{m.request_id}.0" for m in want]
    assert all(isinstance(e, EngineRequest) for e in handed)
    assert [e.prompt_token_ids for e in handed] == [m.prompt for m in want]
    errors = [streams.decode_fields(f) for _, f in await r.xrange(streams.gw_stream("gw1"))]
    assert len(errors) == 1 and isinstance(errors[0], RequestError)
    assert errors[0].request_id == reqs[bad].request_id
    for i, m in enumerate(reqs):
        assert await r.exists(done_key(m.request_id)) == 1, i
    await r.aclose()


async def test_large_queue_entries_leave_the_stream_once_handed_on(redis_url, rng):
    """The large queue's payloads (long prompts) are deleted from the stream in the round trip
    that hands them on, not kept until the stream is trimmed."""
    r = streams.connect(redis_url)
    renderer = Renderer(str(checkpoint("qwen2")), limits("qwen2"))
    large = streams.render_large_stream()
    svc = RendererService(r, renderer, large, delete_handled=True)
    reqs = [
        RenderRequest(
            request_id=f"big{i}",
            gateway_id="gw2",
            kind="completion",
            prompt=" ".join(rng.choice(["sun", "dog", "sea"]) for _ in range(rng.randint(1, 90))),
            sampling={"max_tokens": 2},
        )
        for i in range(rng.randint(1, 6))
    ]
    ids = [await streams.xadd(r, large, m) for m in reqs]
    await svc.handle_batch(list(zip(ids, reqs, strict=True)))
    assert await r.xlen(large) == len(reqs)  # until after_batch
    await svc.after_batch()
    assert await r.xlen(large) == 0
    handed = [streams.decode_fields(f) for _, f in await r.xrange(streams.sched_stream())]
    assert [e.request_id for e in handed][-len(reqs) :] == [f"{m.request_id}.0" for m in reqs]
    await r.aclose()
