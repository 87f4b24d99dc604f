"""The per-step host fast paths against their plain definitions, on fresh random inputs: the
block-table mirror of the decode staging, the sampler's decode entry point, SampledIds, and
the StepOutput encoding."""

from __future__ import annotations

from dataclasses import asdict

import msgpack
import torch
from voltserve.kernels.dispatch import KernelDispatch
from voltserve.services.executor.input_batch import BlockTableMirror
from voltserve.services.executor.request import Request, SampledIds, SampledToken
from voltserve.services.executor.sampler import Sampler, SampleRow
from voltserve.shared.protocol import RequestDelta, StepOutput, decode, encode
from voltserve.shared.sampling_params import SamplingParams

CPU = torch.device("cpu")


def test_block_table_mirror_rows_equal_block_lists(rng) -> None:
    """Random churn: blocks appended, lists replaced (preemption), ids reused by new requests,
    requests that vanish; every synced row is the block list followed by zeros."""
    width = rng.randint(3, 12)
    m = BlockTableMirror(width, rows=rng.randint(1, 6))
    live: dict[str, Request] = {}
    n = 0
    for _ in range(300):
        op = rng.random()
        if op < 0.25 or not live:
            rid = rng.choice(list(live)) if live and rng.random() < 0.3 else f"r{n}"
            n += 1
            r = Request(rid, [1], SamplingParams(), seed=0, arrival_time=0.0)
            r.block_ids = [rng.randrange(1000) for _ in range(rng.randint(0, width))]
            live[rid] = r  # a new request, or one that reuses the id of a live one
        elif op < 0.35:
            del live[rng.choice(list(live))]
        elif op < 0.5:
            r = live[rng.choice(list(live))]
            r.block_ids = [rng.randrange(1000) for _ in range(rng.randint(0, width))]
        else:
            for r in live.values():
                while len(r.block_ids) < width and rng.random() < 0.3:
                    r.block_ids.append(rng.randrange(1000))
        if not live:
            continue
        batch = rng.sample(list(live.values()), rng.randint(1, len(live)))
        rows, counts = m.sync(batch)
        assert len(set(rows)) == len(rows)
        for r, row, c in zip(batch, rows, counts):
            assert c == len(r.block_ids)
            assert m.table[row].tolist() == r.block_ids + [0] * (width - c)


def _request(rng, V: int, params: SamplingParams) -> Request:
    r = Request(
        "r",
        [rng.randrange(V) for _ in range(5)],
        params,
        seed=rng.randrange(1 << 40),
        arrival_time=0.0,
    )
    r.output_token_ids = [rng.randrange(V) for _ in range(rng.randint(0, 4))]
    return r


def test_sample_last_equals_rows_path(rng) -> None:
    V = 97
    s = Sampler(KernelDispatch(CPU), CPU)
    kinds = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=[5]),
        SamplingParams(temperature=0.0, min_tokens=3, eos_token_ids=[7]),
        SamplingParams(temperature=0.0, logprobs=2),
        SamplingParams(temperature=0.8, seed=3),
        SamplingParams(temperature=0.0, presence_penalty=0.5),
    ]
    for trial in range(12):
        plain_only = trial % 2 == 0
        reqs = [
            _request(rng, V, kinds[0] if plain_only else rng.choice(kinds))
            for _ in range(rng.randint(1, 9))
        ]
        logits = torch.randn(len(reqs), V) * 3
        eos = (rng.randrange(V),)
        got = s.sample_last(logits, reqs, eos)
        want = s(logits, [SampleRow(r, len(r.output_token_ids), eos) for r in reqs])
        assert [t.token_id for t in got] == [t.token_id for t in want]
        assert [(t.logprob, t.top_logprobs) for t in got] == [
            (t.logprob, t.top_logprobs) for t in want
        ]
        if plain_only:
            assert isinstance(got, SampledIds)
            assert got.token_ids == logits.argmax(dim=-1).tolist()


def test_sampled_ids_is_a_sequence_of_sampled_tokens() -> None:
    s = SampledIds([4, 9, 2])
    assert len(s) == 3 and s[1] == SampledToken(9) and s[-1].token_id == 2
    assert list(s) == [SampledToken(4), SampledToken(9), SampledToken(2)]
    assert s[1:] == [SampledToken(9), SampledToken(2)]
    assert s == [SampledToken(4), SampledToken(9), SampledToken(2)] and s != [SampledToken(4)]
    (a, b, c) = s
    assert (a.token_id, b.logprob, c.top_logprobs) == (4, None, None)


def test_step_output_encoding_equals_asdict(rng) -> None:
    deltas = []
    for i in range(rng.randint(0, 20)):
        lp = None
        if rng.random() < 0.5:
            lp = [{"logprob": -rng.random(), "top": [[rng.randrange(500), -rng.random()]]}]
        deltas.append(
            RequestDelta(
                f"req-{i}",
                [rng.randrange(1 << 17) for _ in range(rng.randint(0, 3))],
                rng.randrange(1000),
                lp,
                rng.choice((None, "stop", "length")),
                rng.randrange(4000),
                rng.randrange(4000),
            )
        )
    msg = StepOutput("exec-1", rng.randrange(1 << 30), deltas)
    plain = asdict(msg)
    plain["t"] = "StepOutput"
    assert encode(msg) == msgpack.packb(plain, use_bin_type=True)
    assert decode(encode(msg)) == msg


def test_other_messages_encode_as_asdict(rng) -> None:
    """encode() copies the fields of the other messages shallowly: same bytes as asdict."""
    from voltserve.shared.protocol import AbortRequest, EngineRequest, RenderRequest, RequestError

    ids = [rng.randrange(1 << 17) for _ in range(rng.randint(1, 2000))]
    msgs = [
        EngineRequest("r.0", "gw", ids, {"max_tokens": 7, "seed": rng.randrange(1 << 62)}, 1.5),
        EngineRequest("r.1", "gw", ids[:3], {}, 0.0, [rng.randrange(100) for _ in range(5)]),
        RenderRequest("r", "gw", "chat", messages=[{"role": "user", "content": "hi"}], n=3),
        RenderRequest("r", "gw", "completion", prompt=ids, sampling={"top_p": 0.5}),
        AbortRequest([f"r{i}" for i in range(rng.randint(0, 5))], "failover"),
        RequestError("r", 400, "bad", param="prompt"),
    ]
    for msg in msgs:
        plain = asdict(msg)
        plain["t"] = type(msg).__name__
        assert encode(msg) == msgpack.packb(plain, use_bin_type=True)
        assert decode(encode(msg)) == msg


def test_prepare_equals_per_row_rebuild(rng) -> None:
    """The eager flat batch (mixed prefill chunks and decodes, requests holding extra blocks,
    prompt/output boundaries inside a chunk) against the per-row definition."""
    from voltserve.services.executor.model_runner import ModelRunner
    from voltserve.services.executor.request import ScheduledRequest, StepPlan
    from voltserve.shared.config import EngineConfig

    from tests.checkpoints import checkpoint

    runner = ModelRunner(EngineConfig(model=str(checkpoint("qwen2")), num_kv_blocks=200))
    bs = runner.block_size
    for _ in range(6):
        sched = []
        for i in range(rng.randint(1, 7)):
            prompt = [rng.randrange(300) for _ in range(rng.randint(1, 70))]
            r = Request(f"q{i}", prompt, SamplingParams(), seed=0, arrival_time=0.0)
            r.output_token_ids = [rng.randrange(300) for _ in range(rng.randint(0, 20))]
            r.num_computed_tokens = rng.randrange(r.num_tokens)
            n = rng.randint(1, r.num_tokens - r.num_computed_tokens)
            extra = rng.randint(0, 2)
            r.block_ids = rng.sample(range(200), -(-(r.num_computed_tokens + n) // bs) + extra)
            sched.append(ScheduledRequest(r, n))
        plan = StepPlan(sched, sum(s.num_new_tokens for s in sched))
        batch, rows = runner.input_batch.prepare(plan)
        ids, pos, slots, lens, qsl, logit_rows = [], [], [], [], [0], []
        width = max(-(-(s.request.num_computed_tokens + s.num_new_tokens) // bs) for s in sched)
        tables = []
        for s in sched:
            r, start = s.request, s.request.num_computed_tokens
            end = start + s.num_new_tokens
            for p in range(start, end):
                ids.append(r.all_token_ids[p])
                pos.append(p)
                slots.append(r.block_ids[p // bs] * bs + p % bs)
            nblk = -(-end // bs)
            tables.append(r.block_ids[:nblk] + [0] * (width - nblk))
            lens.append(end)
            qsl.append(qsl[-1] + s.num_new_tokens)
            if s.samples:
                logit_rows.append(qsl[-1] - 1)
        assert batch.input_ids.tolist() == ids
        assert batch.positions.tolist() == pos
        assert batch.meta.slot_mapping.tolist() == slots
        assert batch.meta.block_tables.tolist() == tables
        assert batch.meta.seq_lens.tolist() == lens
        assert batch.meta.query_start_loc.tolist() == qsl
        assert batch.logits_indices.tolist() == logit_rows
        assert [(row.request, row.output_pos) for row in rows] == [
            (s.request, s.request.num_output_tokens) for s in sched if s.samples
        ]
        assert batch.meta.max_query_len == max(s.num_new_tokens for s in sched)
