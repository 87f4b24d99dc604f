"""The CUDA-graph decode path, emulated on the CPU: the same static buffers, padding rows
(slot -1, seq_len 1, zero block table) and graph-safe torch fallbacks, with "replay" running the
captured forward eagerly. Real rows must come out exactly as in eager decode, and padding rows
must not touch any KV block the block manager owns."""

from __future__ import annotations

import random

import pytest
import torch
from voltserve.kernels import dispatch
from voltserve.kernels.attention.kv_cache import reshape_and_cache_ref
from voltserve.kernels.attention.ref import paged_decode_attention_ref
from voltserve.services.executor.cuda_graphs import CudaGraphRunner, graph_batch_sizes
from voltserve.services.executor.kv_sizing import alloc_kv_caches
from voltserve.services.executor.model_runner import ModelRunner
from voltserve.services.executor.request import Request
from voltserve.shared.config import EngineConfig
from voltserve.shared.sampling_params import SamplingParams

from tests.checkpoints import checkpoint, drive, tokenizer
from tests.engine.token_match import assert_streams_match, requests_of


class _Replay:
    def __init__(self, fn):
        self.replay = fn


class EmulatedGraphs(CudaGraphRunner):
    def _capture_all(self) -> None:
        for bs in reversed(self.sizes):
            self.outputs[bs], self.argmax[bs] = self.graph_body(bs)

            def replay(bs=bs):
                # What the captured graph does (graph_body: the step's logits into the shared
                # buffer, then their argmax), with the argmax kept per size as a graph keeps it.
                out, ids = self.graph_body(bs)
                assert out.data_ptr() == self.outputs[bs].data_ptr()
                self.argmax[bs].copy_(ids)

            self.graphs[bs] = _Replay(replay)


def test_graph_batch_sizes() -> None:
    assert graph_batch_sizes(1) == [1]
    assert graph_batch_sizes(20) == [1, 2, 4, 8, 16, 20]
    assert graph_batch_sizes(32) == [1, 2, 4, 8, 16, 24, 32]
    assert graph_batch_sizes(32, (64, 8, 1, 8)) == [1, 8]  # sorted, deduplicated, capped
    with pytest.raises(ValueError, match="no size"):
        graph_batch_sizes(4, (8,))
    with pytest.raises(ValueError, match="positive"):
        graph_batch_sizes(4, (0, 2))


def test_capturable_fallbacks_equal_references() -> None:
    nb, kvh, bs, d, B, H = 9, 2, 16, 8, 5, 4
    k_cache, v_cache = torch.randn(nb + 1, kvh, bs, d), torch.randn(nb + 1, kvh, bs, d)
    seq_lens = torch.randint(1, 3 * bs, (B,), dtype=torch.int32)
    tables = torch.stack([torch.randperm(nb)[:3] for _ in range(B)]).to(torch.int32)
    q = torch.randn(B, H, d)
    got = dispatch._paged_decode_attention_capturable(q, k_cache, v_cache, tables, seq_lens, 0.3)
    want = paged_decode_attention_ref(q, k_cache, v_cache, tables, seq_lens, 0.3)
    torch.testing.assert_close(got, want)
    key, val = torch.randn(6, kvh, d), torch.randn(6, kvh, d)
    slots = torch.tensor([3, -1, 40, 77, -1, 100])
    k2, v2 = k_cache.clone(), v_cache.clone()
    dispatch._reshape_and_cache_capturable(key, val, k2, v2, slots)
    reshape_and_cache_ref(key, val, k_cache, v_cache, slots)
    # identical except the scratch block's last slot, where padding rows landed
    torch.testing.assert_close(k2[:nb], k_cache[:nb])
    torch.testing.assert_close(v2[:nb], v_cache[:nb])


def test_emulated_graph_decode_equals_eager() -> None:
    cfg = EngineConfig(model=str(checkpoint("qwen2")), num_kv_blocks=40, max_model_len=128)
    eager, graph = ModelRunner(cfg), ModelRunner(cfg)
    graph.kv_caches = alloc_kv_caches(graph, 40, scratch=True)
    graph.ops.reshape_and_cache = dispatch._reshape_and_cache_capturable
    graph.ops.rotary_and_cache = dispatch._rotary_and_cache_capturable
    graph.ops.paged_decode_attention = dispatch._paged_decode_attention_capturable
    graph.graphs = EmulatedGraphs(graph, 8)
    guard = [kc[:40].clone() for kc, _ in graph.kv_caches]
    rng = random.Random(5)
    V = len(tokenizer())
    params = SamplingParams(temperature=0.8, max_tokens=9, logprobs=1, ignore_eos=True)
    prompts = [[rng.randrange(V) for _ in range(rng.randint(1, 40))] for _ in range(5)]
    a = [Request(f"a{i}", p, params, seed=i, arrival_time=0.0) for i, p in enumerate(prompts)]
    b = [Request(f"b{i}", p, params, seed=i, arrival_time=0.0) for i, p in enumerate(prompts)]
    drive(graph, a, 9, chunk=16)
    assert graph.graphs.num_replays >= 5  # decode-only steps of 5 rows, padded to 8
    # Every size's logits are rows of the one shared buffer (no per-size copies held).
    shared = graph.graphs.outputs[graph.graphs.sizes[-1]]
    assert shared.shape[0] == graph.graphs.sizes[-1]
    assert {o.data_ptr() for o in graph.graphs.outputs.values()} == {shared.data_ptr()}
    drive(eager, b, 9, chunk=16)
    for ra, rb in zip(a, b):
        assert ra.output_token_ids == rb.output_token_ids
        for ta, tb in zip(ra.trace, rb.trace):
            assert abs(ta.logprob - tb.logprob) < 1e-5
    # Blocks no request was given stayed untouched by padding rows.
    used = {blk for r in a for blk in r.block_ids}
    for (kc, _), before in zip(graph.kv_caches, guard):
        for blk in set(range(40)) - used:
            assert torch.equal(kc[blk], before[blk])


def _reference_staging(plan, bs: int, width: int, padded: int):
    """The decode staging rebuilt from scratch, row by row (the original per-row formula):
    real rows [0, B), then padding rows (token 0, position 0, slot -1, seq_len 1, zero table)."""
    ids, pos, slots = [0] * padded, [0] * padded, [-1] * padded
    lens, tables = [1] * padded, [[0] * width for _ in range(padded)]
    for b, s in enumerate(plan.scheduled):
        r = s.request
        p = r.num_computed_tokens
        nblk = p // bs + 1
        ids[b] = r.all_token_ids[p]
        pos[b] = p
        slots[b] = r.block_ids[p // bs] * bs + p % bs
        lens[b] = p + 1
        tables[b][:nblk] = r.block_ids[:nblk]
    return ids, pos, slots, lens, tables


class _NoEvent:
    def record(self) -> None:
        pass

    def synchronize(self) -> None:
        pass


def _separate_device_buffers(monkeypatch) -> list[tuple[int, int]]:
    """Staging buffers built from now on get a device buffer of their own (a second CPU
    buffer) instead of sharing the host twin, so each step's copies (the contiguous one and
    the 2-D one of the table columns, by memmove row by row) decide what the emulated graphs
    read, as on a GPU; returns the (rows, bytes a row) of each 2-D copy."""
    import ctypes

    from voltserve.services.executor import graph_set

    copies: list[tuple[int, int]] = []

    def memcpy_2d(dst: int, src: int, pitch: int, width: int, rows: int) -> None:
        copies.append((rows, width))
        for r in range(rows):
            ctypes.memmove(dst + r * pitch, src + r * pitch, width)

    init = graph_set.Staging.__init__

    def separate(self, fields, device) -> None:
        init(self, fields, device)
        self._dev = self._host.clone()
        self._copy_done = _NoEvent()
        self.dev = self.views(self._dev)

    monkeypatch.setattr(graph_set.Staging, "__init__", separate)
    monkeypatch.setattr(graph_set, "_cuda_memcpy_2d", lambda: memcpy_2d)
    return copies


def _emulated_graph_runner(cfg: EngineConfig, max_batch: int) -> ModelRunner:
    runner = ModelRunner(cfg)
    runner.kv_caches = alloc_kv_caches(runner, cfg.num_kv_blocks, scratch=True)
    runner.ops.reshape_and_cache = dispatch._reshape_and_cache_capturable
    runner.ops.rotary_and_cache = dispatch._rotary_and_cache_capturable
    runner.ops.paged_decode_attention = dispatch._paged_decode_attention_capturable
    runner.graphs = EmulatedGraphs(runner, max_batch)
    return runner


def run_arrivals(engine, arrivals, min_steps: int) -> dict[str, list[int]]:
    """Step the engine at least min_steps times and until it is idle, adding each (step, id,
    prompt, params) of `arrivals` at its step; every request's tokens. All blocks end free."""
    got: dict[str, list[int]] = {}
    step = 0
    while step < min_steps or engine.has_unfinished_requests():
        for at, rid, prompt, params in arrivals:
            if at == step:
                engine.add_request(rid, prompt, params)
        for out in engine.step():
            got.setdefault(out.request_id, []).extend(out.new_token_ids)
        step += 1
    assert engine.check_all_free()
    return got


def test_engine_graph_staging_under_churn_equals_rebuild_and_eager(rng, monkeypatch) -> None:
    """The decode staging is written incrementally (block tables kept across steps in a mirror,
    whole-batch numpy writes, only the table columns a step reads or an earlier one left
    nonzero written and copied). Under churn (requests arriving and finishing, so rows change
    hands; preemption, so block lists are replaced; prefix-cache hits; blocks appended at
    boundaries; more requests than mirror rows) every staged buffer, and the device's copy of
    it, must equal the from-scratch per-row rebuild, and the engine's tokens must equal the
    eager engine's."""
    from voltserve.services.executor.engine import LLMEngine

    blocks, seqs = 14, 5  # 224 tokens for 5 sequences of up to 128: preemption
    cfg = EngineConfig(
        model=str(checkpoint("qwen2")),
        num_kv_blocks=blocks,
        max_model_len=128,
        max_num_seqs=seqs,
        max_num_batched_tokens=48,
    )
    copies = _separate_device_buffers(monkeypatch)
    runner = _emulated_graph_runner(cfg, seqs)
    g = runner.graphs
    assert g.st._dev is not g.st._host
    staged = 0
    inner = runner.input_batch.stage_decode
    replay = g.replay_staged
    want: list = []

    def checked(graphs, plan):
        nonlocal staged
        out = inner(graphs, plan)
        n = g.padded_size(len(plan.scheduled))
        ids, pos, slots, lens, tables = _reference_staging(plan, 16, g.width, n)
        assert g.host_ids[:n].tolist() == ids
        assert g.host_pos[:n].tolist() == pos
        assert g.host_slots[:n].tolist() == slots
        assert g.host_seq_lens[:n].tolist() == lens
        assert g.host_tables[:n].tolist() == tables
        want[:] = [ids, pos, slots, lens, tables]
        staged += 1
        return out

    def replay_checked(num_seqs, ids_on_device=None):
        out = replay(num_seqs, ids_on_device)
        n = g.padded_size(num_seqs)
        # What the graph read: the device buffers after the step's copies.
        got = [g.positions, g.slot_mapping, g.seq_lens, g.block_tables]
        assert [t[:n].tolist() for t in got] == want[1:], (num_seqs, copies[-1:])
        return out

    runner.input_batch.stage_decode = checked
    g.replay_staged = replay_checked
    graph_engine, eager_engine = LLMEngine(cfg, runner), LLMEngine(cfg)
    V = len(tokenizer())
    shared = [rng.randrange(V) for _ in range(32)]
    # The forced core: five requests of 40 + 40 tokens at step 0 need 5 blocks each, 25 > 14,
    # so the newest is preempted whatever else arrives; the random rest (arriving at steps
    # 0-19, some behind a shared prefix) is the churn around them.
    arrivals = []
    for i in range(16):
        core = i < 5
        n = 40 if core else rng.randint(1, 60)
        prompt = [rng.randrange(V) for _ in range(n)]
        if not core and rng.random() < 0.4:
            prompt = shared[: rng.choice((16, 32))] + prompt  # prefix-cache hits
        params = SamplingParams(
            temperature=rng.choice((0.0, 0.0, 0.9)),
            max_tokens=40 if core else rng.randint(1, 40),
            ignore_eos=True,
            seed=rng.randrange(1 << 30),
        )
        arrivals.append((0 if core else rng.randrange(0, 20), f"r{i}", prompt[:100], params))
    results = [run_arrivals(e, arrivals, 21) for e in (graph_engine, eager_engine)]
    assert_streams_match(*results, requests_of(arrivals), cfg.model)
    assert g.num_replays == staged > 20
    # Most steps read fewer table columns than the width and moved only those.
    assert sum(w < g.width * 4 for _, w in copies) > staged // 2, (copies, staged)
    assert graph_engine.batcher.num_preemptions > 0
    # More requests than mirror rows went through: rows were reclaimed and reused.
    assert len(arrivals) > len(runner.input_batch.tables.table)


@pytest.mark.parametrize("arch", ["qwen3_5", "qwen3_next"])
def test_hybrid_graph_decode_stages_state_slots_and_equals_eager(arch: str, rng) -> None:
    """A model with linear-attention state in the decode graphs: each row's state slot staged
    beside its KV slots, padding rows at state slot -1 (their conv and recurrent updates touch no
    request's state), slots changing hands as requests finish and arrive. Tokens equal the eager
    engine's and every staged state slot is its request's."""
    from voltserve.services.executor.engine import LLMEngine

    cfg = EngineConfig(
        model=str(checkpoint(arch)), num_kv_blocks=24, max_model_len=96, max_num_seqs=5
    )
    runner = _emulated_graph_runner(cfg, 8)
    g = runner.graphs
    assert g.has_state and runner.pipeline is None
    inner = runner.input_batch.stage_decode
    staged = 0

    def checked(graphs, plan):
        nonlocal staged
        out = inner(graphs, plan)
        B, n = len(plan.scheduled), g.padded_size(len(plan.scheduled))
        assert g.host_state[:B].tolist() == [s.request.state_slot for s in plan.scheduled]
        assert (g.host_state[B:n] == -1).all()
        assert g._meta(n).state_slots.data_ptr() == g.state_slots.data_ptr()
        staged += 1
        return out

    runner.input_batch.stage_decode = checked
    graph_engine, eager_engine = LLMEngine(cfg, runner), LLMEngine(cfg)
    V = len(tokenizer())
    # Three long requests from step 0 (3 rows: a padding row at the graph size 4) outlive six
    # short ones arriving at random (at most 3 waves of 2 through the other 2 rows, each done
    # within 9 steps by step 37): the last steps are decode-only, whatever the draw.
    arrivals = []
    for i in range(9):
        core = i < 3
        params = SamplingParams(
            temperature=rng.choice((0.0, 0.9)),
            max_tokens=60 if core else rng.randint(2, 8),
            ignore_eos=True,
            seed=rng.randrange(1 << 30),
        )
        prompt = [rng.randrange(V) for _ in range(rng.randint(1, 30))]
        arrivals.append((0 if core else rng.randrange(0, 10), f"h{i}", prompt, params))
    results = [run_arrivals(e, arrivals, 11) for e in (graph_engine, eager_engine)]
    assert_streams_match(*results, requests_of(arrivals), cfg.model)
    assert g.num_replays == staged > 5
    assert 4 in g.replays_by_size


STARTUP_CASES = {
    "llama": ("llama", None, "auto"),
    "hybrid": ("qwen3_5", None, "auto"),
    "ngram": ("llama", {"method": "ngram", "num_speculative_tokens": 3}, "auto"),
    "draft": ("llama", {"method": "draft_model", "num_speculative_tokens": 2}, "auto"),
    "mtp": ("mtp", {"method": "mtp", "num_speculative_tokens": 2}, "auto"),
    "fp8-kv": ("llama", None, "fp8"),
}


@pytest.mark.parametrize("case", sorted(STARTUP_CASES))
def test_startup_trace_runs_every_forward_and_leaves_state_alone(case: str, monkeypatch) -> None:
    """The start-up kernel trace (kernel_warmup.trace: the profile forward, the decode graphs'
    forwards on a probe of the runner, speculation's graphs, the sampler) runs for each kind of
    runner. With a model holding linear-attention state the decode graphs' probe must carry the
    state cache, and its padding rows (state slot -1) must leave every slot's conv and recurrent
    state as it was. On the CPU no numba kernel is traced (the simulator's dispatcher is not the
    one the trace records), but every forward the CUDA start-up traces runs."""
    import contextlib

    from voltserve.services.executor import kernel_warmup
    from voltserve.services.executor.engine_args import engine_config

    from tests.mtp_checkpoints import mtp_checkpoint

    arch, spec, kv = STARTUP_CASES[case]
    model = str(mtp_checkpoint("qwen3_5") if arch == "mtp" else checkpoint(arch))
    if spec is not None and spec["method"] == "draft_model":
        spec = {**spec, "model": str(checkpoint("llama"))}
    cfg = engine_config(
        model=model,
        device="cpu",
        num_kv_blocks=8,
        max_model_len=64,
        speculative_config=spec,
        kv_cache_dtype=kv,
    )
    runner = ModelRunner(cfg)
    monkeypatch.setattr(
        kernel_warmup.compile_cache,
        "traced_launches",
        contextlib.contextmanager(lambda: iter([[]])),
    )
    assert kernel_warmup.trace(runner, 4) == []
    cache = runner.state_cache
    assert (cache is not None) == (arch in ("qwen3_5", "mtp"))
    if cache is None:
        return
    # The profile forward above prefilled into some slots (harmless at start-up: a request's
    # prefill starts from zeros); the decode graphs' padding rows must write no slot.
    g = torch.Generator().manual_seed(0)
    for conv, rec in cache.layers:
        conv.copy_(torch.randn(conv.shape, generator=g))
        rec.copy_(torch.randn(rec.shape, generator=g))
    before = [(c.clone(), r.clone()) for c, r in cache.layers]
    kernel_warmup._trace_decode_graphs(runner, 4)
    for (c0, r0), (c1, r1) in zip(before, cache.layers, strict=True):
        assert torch.equal(c0, c1) and torch.equal(r0, r1)
