"""The executor's engine loop logs one DEBUG line per step: how many requests reached the engine
before it, and how many run and wait after it (a burst's arrival through the services is read
from these lines)."""

from __future__ import annotations

import logging
import threading

from voltserve.services.executor.engine import LLMEngine
from voltserve.services.executor.service import EngineLoop
from voltserve.shared.config import EngineConfig
from voltserve.shared.protocol import EngineRequest
from voltserve.shared.sampling_params import SamplingParams

from tests.checkpoints import checkpoint


def test_step_log_counts_arrivals_and_queue(rng, caplog) -> None:
    engine = LLMEngine(
        EngineConfig(
            model=str(checkpoint("llama")),
            device="cpu",
            dtype="float32",
            max_num_seqs=2,  # the third request waits
            max_num_batched_tokens=64,
        )
    )
    loop = EngineLoop(engine, "e0")
    done = threading.Event()
    finished: set[str] = set()

    def emit(gateway_id, msg) -> None:
        for d in getattr(msg, "deltas", []):
            if d.finish_reason is not None:
                finished.add(d.request_id)
        if len(finished) == 3:
            done.set()

    loop.emit = emit
    max_tokens = rng.randint(2, 5)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, seed=1)
    for i in range(3):
        prompt = [rng.randrange(10, 200) for _ in range(rng.randint(3, 20))]
        loop.inbox.put(("add", EngineRequest(f"r{i}", "gw", prompt, params.to_dict())))
    caplog.set_level(logging.DEBUG, logger="voltserve.services.executor.service")
    t = threading.Thread(target=loop.run)
    t.start()
    try:
        assert done.wait(60), "the engine loop did not finish three requests"
    finally:
        loop.stop_event.set()
        t.join(10)
    assert loop.error is None
    steps = [r.kv for r in caplog.records if r.getMessage() == "step"]
    assert [s["step"] for s in steps] == list(range(1, len(steps) + 1))
    assert steps[0]["added"] == 3 and sum(s["added"] for s in steps) == 3
    assert steps[0]["running"] == 2 and steps[0]["waiting"] == 1
    assert steps[-1]["running"] == 0 and steps[-1]["waiting"] == 0
    assert sum(s["outputs"] for s in steps) == 3 * max_tokens  # one delta per token
    assert all(s["ms"] >= 0 for s in steps)
