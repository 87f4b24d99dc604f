"""A synthetic executor for load tests of the HTTP/stream path: the real ExecutorService (heartbeat,
status hash, vs:exec consumer group, one StepOutput per gateway per step on vs:gw:{id}) around an
engine that has no model. Every step it gives each running request one token, at a fixed step
rate, so the gateway and the scheduler see the message shape and rate a GPU engine produces.

Tokens are reproducible: request with sampling seed s draws position p from
numpy default_rng(s) over the token pool (ids given in --token-pool, or [16, vocab)). A client
that knows the seed knows every token it must receive, exactly once and in order.

    python load_tests/synthetic_executor.py --redis-url URL --executor-id synth-0 --step-ms 20
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path

import numpy as np

if not __package__:
    import _as_script  # noqa: F401  (load_tests.* importable; see _as_script.py)
from voltserve.services.executor.main import run_until_signalled, service_config  # noqa: E402
from voltserve.services.executor.request import RequestOutput  # noqa: E402
from voltserve.services.executor.service import ExecutorService  # noqa: E402
from voltserve.shared import broker  # noqa: E402
from voltserve.shared.logging import add_log_level_flag, setup_logging  # noqa: E402
from voltserve.shared.model_limits import ModelLimits  # noqa: E402

logger = logging.getLogger("synthetic_executor")


def expected_tokens(pool: list[int], seed: int, n: int) -> list[int]:
    """The n output tokens of a request with this sampling seed (shared with the bench client)."""
    idx = np.random.default_rng(seed).integers(0, len(pool), size=n)
    return [pool[i] for i in idx.tolist()]


@dataclass
class SyntheticStats:
    num_running: int
    num_waiting: int
    num_free_blocks: int
    num_total_blocks: int
    kv_cache_usage: float
    num_preemptions_total: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    prompt_tokens_total: int
    generation_tokens_total: int


@dataclass
class _Req:
    request_id: str
    tokens: list[int]  # the whole output, drawn up front
    pos: int  # next output position
    num_prompt_tokens: int


class SyntheticEngine:
    """Implements the Engine protocol of services/executor/service.py without a model."""

    def __init__(
        self,
        pool: list[int],
        step_s: float,
        max_num_seqs: int,
        max_model_len: int,
        vocab_size: int,
    ) -> None:
        self.pool = pool
        self.step_s = step_s
        self.max_num_seqs = max_num_seqs
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self.running: dict[str, _Req] = {}
        self.waiting: deque[_Req] = deque()
        self.next_step = 0.0
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0
        self.steps = 0
        self.late_steps = 0  # steps that started more than one interval late

    def limits(self) -> ModelLimits:
        """No eos: a synthetic request always runs to its max_tokens."""
        return ModelLimits(self.max_model_len, (), self.vocab_size)

    def add_request(
        self,
        request_id,
        prompt_token_ids,
        params,
        output_token_ids=None,
        arrival_time=None,
        validated=False,
    ) -> None:
        if params.seed is None:
            raise ValueError("the synthetic engine needs a seed (the renderer always sets one)")
        done = list(output_token_ids or [])
        tokens = expected_tokens(self.pool, params.seed, params.max_tokens)
        self.waiting.append(_Req(request_id, tokens, len(done), len(prompt_token_ids)))

    def abort_request(self, ids: list[str]) -> list[RequestOutput]:
        out = []
        for rid in ids:
            r = self.running.pop(rid, None)
            if r is None:
                for w in self.waiting:
                    if w.request_id == rid:
                        self.waiting.remove(w)
                        r = w
                        break
            if r is not None:
                out.append(RequestOutput(rid, [], finish_reason="abort"))
        return out

    def has_unfinished_requests(self) -> bool:
        return bool(self.running or self.waiting)

    def step(self) -> list[RequestOutput]:
        now = time.perf_counter()
        if now < self.next_step:
            time.sleep(self.next_step - now)
        elif self.next_step and now - self.next_step > self.step_s:
            self.late_steps += 1
        # A fixed cadence; a late step does not make the following ones burst.
        self.next_step = max(self.next_step + self.step_s, time.perf_counter())
        while self.waiting and len(self.running) < self.max_num_seqs:
            r = self.waiting.popleft()
            self.running[r.request_id] = r
        out = []
        for r in list(self.running.values()):
            first = r.pos == 0
            tok = r.tokens[r.pos]
            r.pos += 1
            finish = "length" if r.pos >= len(r.tokens) else None
            out.append(
                RequestOutput(
                    r.request_id,
                    [tok],
                    finish_reason=finish,
                    num_prompt_tokens=r.num_prompt_tokens if first else 0,
                )
            )
            if first:
                self.prompt_tokens_total += r.num_prompt_tokens
            if finish is not None:
                del self.running[r.request_id]
        self.generation_tokens_total += len(out)
        self.steps += 1
        return out

    def stats(self) -> SyntheticStats:
        return SyntheticStats(
            num_running=len(self.running),
            num_waiting=len(self.waiting),
            num_free_blocks=1024,
            num_total_blocks=1024,
            kv_cache_usage=0.0,
            num_preemptions_total=0,
            prefix_cache_queries=0,
            prefix_cache_hits=0,
            prompt_tokens_total=self.prompt_tokens_total,
            generation_tokens_total=self.generation_tokens_total,
        )


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__)
    broker.add_broker_flags(p)
    p.add_argument("--executor-id", default="synth-0")
    p.add_argument("--model", default="synthetic", help="name shown in the status hash")
    p.add_argument("--step-ms", type=float, default=20.0, help="one token per request per step")
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-model-len", type=int, default=1 << 20)
    p.add_argument("--token-pool", default=None, help="JSON list of token ids to draw from")
    p.add_argument(
        "--vocab-size",
        type=int,
        default=None,
        help="token ids requests may name, and without --token-pool the pool's end (default: "
        "any id; 2048 for the pool)",
    )
    p.add_argument("--heartbeat-interval", type=float, default=0.3)
    p.add_argument("--heartbeat-ttl", type=float, default=2.0)
    add_log_level_flag(p)
    return p.parse_args(argv)


def main(argv: list[str]) -> None:
    args = parse_args(argv)
    setup_logging("executor", args.log_level, args.log_json)
    if args.token_pool:
        pool = [int(t) for t in json.loads(Path(args.token_pool).read_text())]
    else:
        pool = list(range(16, args.vocab_size or 2048))
    vocab = args.vocab_size or 2**31 - 1
    engine = SyntheticEngine(
        pool, args.step_ms / 1000, args.max_num_seqs, args.max_model_len, vocab
    )
    svc = ExecutorService(engine, service_config(args))
    run_until_signalled(svc)
    logger.info("synthetic executor: %d steps, %d late", engine.steps, engine.late_steps)


if __name__ == "__main__":
    main(sys.argv[1:])
