"""A model-free runner with a real paged token cache, for fast scheduling tests.

It stores each computed token id in its KV slot (block_ids[p // bs] * bs + p % bs), and before
every step checks that the slots of all earlier positions still hold the request's tokens: a
wrong prefix-cache hit, a block shared while written, or a block freed too early shows up as a
mismatch. The next token is a pure function of the context read back through the block table
(and of seed and output position when sampling), so outputs are reproducible across batching,
chunking, preemption and failover exactly when the cache is right.
"""

from __future__ import annotations

from voltserve.services.executor.request import RunnerOutput, SampledToken, StepPlan


class KVEchoRunner:
    def __init__(
        self,
        num_kv_blocks: int,
        block_size: int = 16,
        vocab_size: int = 97,
        max_model_len: int = 4096,
        eos_token_ids: tuple[int, ...] = (),
    ):
        self.num_kv_blocks = num_kv_blocks
        self.block_size = block_size
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.eos_token_ids = list(eos_token_ids)
        self.proposer = None  # no model: the engine makes a model-free proposer itself
        self.kv = [-1] * (num_kv_blocks * block_size)
        self.num_steps = 0
        # Per step: (request id, num_new_tokens, num_computed_tokens before, samples).
        self.plans: list[list[tuple[str, int, int, bool]]] = []

    def _slot(self, block_ids: list[int], pos: int) -> int:
        return block_ids[pos // self.block_size] * self.block_size + pos % self.block_size

    def execute(self, plan: StepPlan) -> RunnerOutput:
        self.num_steps += 1
        self.plans.append(
            [
                (s.request.request_id, s.num_new_tokens, s.request.num_computed_tokens, s.samples)
                for s in plan.scheduled
            ]
        )
        assert plan.num_batched_tokens == sum(s.num_new_tokens for s in plan.scheduled)
        out = []
        for s in plan.scheduled:
            r = s.request
            # A verify row group computes the proposals after the known tokens.
            tokens = r.all_token_ids + list(s.spec_token_ids)
            start, end = r.num_computed_tokens, r.num_computed_tokens + s.num_new_tokens
            assert 0 < s.num_new_tokens and end <= len(tokens)
            assert len(r.block_ids) * self.block_size >= end, "not enough blocks for the step"
            for p in range(start):
                got = self.kv[self._slot(r.block_ids, p)]
                assert got == tokens[p], f"{r.request_id}: slot of position {p} holds {got}"
            for p in range(start, end):
                self.kv[self._slot(r.block_ids, p)] = tokens[p]
            if s.samples:
                # One row per proposal plus one: the token after each known prefix.
                m = len(s.spec_token_ids)
                for j in range(m + 1):
                    ctx = [self.kv[self._slot(r.block_ids, p)] for p in range(end - m + j)]
                    tok = self.next_token(ctx, r.seed, r.num_output_tokens + j, r.params)
                    out.append(SampledToken(tok))
        return RunnerOutput(out)

    def next_token(self, ctx: list[int], seed: int, out_pos: int, params) -> int:
        h = 1469598103934665603
        for t in ctx[-8:]:
            h = ((h ^ (t + 1)) * 1099511628211) & 0xFFFFFFFFFFFF
        h ^= len(ctx) * 7919
        if not params.greedy:
            h ^= (seed * 2654435761 + out_pos * 40503) & 0xFFFFFFFFFFFF
        tok = h % self.vocab_size
        # min_tokens: like the real sampler, never emit a stop token before min_tokens.
        if out_pos < params.min_tokens and (
            tok in params.eos_token_ids or tok in params.stop_token_ids
        ):
            tok = next(
                t
                for t in range(self.vocab_size)
                if t not in params.eos_token_ids and t not in params.stop_token_ids
            )
        return tok


def echo_reference(
    runner: KVEchoRunner, prompt: list[int], params, seed: int, max_model_len: int
) -> list[int]:
    """What one request alone must produce under KVEchoRunner, with the engine's stop rules."""
    tokens = list(prompt)
    out: list[int] = []
    eos = params.eos_token_ids or runner.eos_token_ids
    while True:
        tok = runner.next_token(tokens, seed, len(out), params)
        out.append(tok)
        tokens.append(tok)
        if len(out) >= params.min_tokens and (
            tok in params.stop_token_ids or (not params.ignore_eos and tok in eos)
        ):
            return out
        if len(out) >= params.max_tokens or len(tokens) >= max_model_len:
            return out
