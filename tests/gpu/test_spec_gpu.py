"""On a CUDA GPU: speculative decoding's greedy output equals greedy without speculation and
transformers' greedy output (fp32, every tiny checkpoint), with an n-gram proposer and with an
oracle drafter (a perfect one and a corrupted one); the verify step's prefill attention over
k+1 query rows per sequence equals the reference at real shapes; the verify step and the
proposers' single-token steps replayed as CUDA graphs (spec/graphs.py) give what the eager
steps give. Skipped without CUDA."""

from __future__ import annotations

import os
import random

import pytest
import torch
from voltserve.kernels.attention.ref import paged_attention_ref
from voltserve.services.executor.engine import LLMEngine
from voltserve.services.executor.engine_args import engine_config
from voltserve.services.executor.spec.oracle import OracleProposer
from voltserve.shared.sampling_params import SamplingParams

from tests.checkpoints import ARCHS, checkpoint, hf_greedy, tokenizer

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def _engine(
    arch: str, dtype: str, spec: dict | None, eager: bool = False, graph_batch: int = 16
) -> LLMEngine:
    cfg = engine_config(
        model=str(checkpoint(arch)),
        dtype=dtype,
        device="cuda",
        num_kv_blocks=256,
        max_model_len=256,
        max_graph_batch_size=graph_batch,
        speculative_config=spec,
        enforce_eager=eager,
    )
    return LLMEngine(cfg)


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_spec_equals_spec_off_and_transformers(arch: str) -> None:
    seed = int(os.environ.get("VOLTSERVE_TEST_SEED") or random.SystemRandom().randrange(1 << 32))
    print(f"VOLTSERVE_TEST_SEED={seed}")
    rng = random.Random(seed)
    V = len(tokenizer())
    prompts = [[rng.randrange(V) for _ in range(rng.randint(3, 20))] * 3 for _ in range(6)]
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    base = _engine(arch, "float32", None)
    want = base.generate(prompts, params)
    for p, w in zip(prompts, want):
        assert hf_greedy(checkpoint(arch), p, 40, device="cuda")[0] == w
    del base
    eng = _engine(arch, "float32", {"method": "ngram", "num_speculative_tokens": 4})
    assert eng.generate(prompts, params) == want
    for corrupt in (0.0, 0.3):
        ids = [f"generate-{eng._generate_calls + 1}-{i}" for i in range(len(prompts))]
        eng.proposer = OracleProposer(4, dict(zip(ids, want)), corrupt, V, seed)
        assert eng.generate(prompts, params) == want
    st = eng.stats()
    assert st.spec_decode_num_accepted_tokens > 0
    assert eng.check_all_free()


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_draft_model_on_gpu(dtype: str) -> None:
    """A draft model on the GPU (its catch-up prefill and decode steps on the draft's own KV
    cache): output equals speculation off; with the target as its own draft in fp32 every
    proposal is accepted. fp16 with another draft (qwen3): equal to spec off in fp16 greedy
    only up to near-ties between the verify path (prefill attention) and the decode path, so
    only the prefix agreement and the counters are asserted there."""
    rng = random.Random(5)
    V = len(tokenizer())
    prompts = [[rng.randrange(V) for _ in range(rng.randint(3, 30))] for _ in range(5)]
    params = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
    want = _engine("llama", dtype, None).generate(prompts, params)
    draft = "llama" if dtype == "float32" else "qwen3"
    spec = {"method": "draft_model", "model": str(checkpoint(draft)), "num_speculative_tokens": 3}
    eng = _engine("llama", dtype, spec)
    got = eng.generate(prompts, params)
    st = eng.stats()
    assert st.spec_decode_num_drafts > 0
    assert eng.check_all_free()
    if dtype == "float32":
        assert got == want
        assert st.spec_decode_num_accepted_tokens == st.spec_decode_num_draft_tokens
    else:
        agree = [
            next((i for i, (a, b) in enumerate(zip(g, w)) if a != b), len(w))
            for g, w in zip(got, want)
        ]
        print("fp16 agreement lengths", agree)
        assert all(len(g) == 32 for g in got)
        assert sum(agree) >= len(want) * 8


@pytest.mark.parametrize("kernel", ["prefill", "prefill_fa"])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("group", [1, 4, 8])
@pytest.mark.parametrize("q", [2, 4, 8])
def test_verify_attention_matches_reference(q: int, group: int, head_dim: int, kernel: str):
    """The verify step runs the prefill attention path: q query rows per sequence at the end of
    a paged context, causal among themselves, plus a plain decode row and a padding-free batch.
    Contexts 1..32K, fp16 cache, against the fp32 reference; output poisoned with NaN first."""
    import importlib

    # prefill_fa's entry (the engine's) runs the flash kernel at these head dims.
    fn = importlib.import_module(f"voltserve.kernels.attention.{kernel}").paged_attention_cuda
    gen = torch.Generator(device="cuda").manual_seed(1234 + q * 100 + group * 10 + head_dim)
    dev = "cuda"
    kv_heads = 2
    heads = kv_heads * group
    bs = 16
    # (context before the verify rows, query rows): verify groups, and one plain decode row.
    cases = [(c, q) for c in (0, 1, 17, 1000, 4096, 32767)] + [(300, 1)]
    seq_lens = [c + n for c, n in cases]
    nblk = [-(-s // bs) for s in seq_lens]
    total = sum(nblk) + 1
    k_cache = torch.randn(total, kv_heads, bs, head_dim, generator=gen, device=dev).half()
    v_cache = torch.randn(total, kv_heads, bs, head_dim, generator=gen, device=dev).half()
    perm = torch.randperm(total - 1, generator=gen, device=dev).int() + 1
    tables = torch.zeros(len(cases), max(nblk), dtype=torch.int32, device=dev)
    o = 0
    for i, n in enumerate(nblk):
        tables[i, :n] = perm[o : o + n]
        o += n
    sl = torch.tensor(seq_lens, dtype=torch.int32, device=dev)
    q_lens = [n for _, n in cases]
    qsl = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32, device=dev)
    T = int(qsl[-1])
    query = torch.randn(T, heads, head_dim, generator=gen, device=dev).half()
    scale = head_dim**-0.5
    out = torch.full_like(query, float("nan"))
    fn(query, k_cache, v_cache, tables, sl, qsl, scale, out, max_query_len=q)
    torch.cuda.synchronize()
    ref = paged_attention_ref(
        query.float(), k_cache.float(), v_cache.float(), tables, sl, qsl, scale
    )
    assert not out.isnan().any()
    torch.testing.assert_close(out.float(), ref, atol=3e-3, rtol=3e-3)


def test_structured_spec_on_gpu() -> None:
    """Constrained requests (regex, choice; greedy and seeded) beside unconstrained ones under
    speculation on the GPU: verify rows masked on the device from GrammarState.fill_draft
    (kernels/sampling/grammar_mask.py), output equal to speculation off (fp32) and inside the
    constraint. Needs xgrammar."""
    pytest.importorskip("xgrammar")
    import re

    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(checkpoint("qwen2"))
    regex, choices = r"[a-z]{2,4}-[0-9]{1,2}( [A-Z])?", ["yes", "no", "maybe so"]
    rng = random.Random(11)
    words = ["ab-12 X", "yes", "no", "cd-3", "maybe so", "xyz-45"]
    prompts = [
        tok.encode(" ".join(rng.choice(words) for _ in range(rng.randrange(4, 10))) + " id:")
        for _ in range(8)
    ]
    params = []
    for i in range(8):
        s = {"type": "regex", "value": regex} if i % 4 < 2 else {"type": "choice", "value": choices}
        if i % 2 == 0:
            params.append(SamplingParams(max_tokens=24, temperature=0.0, structured=s))
        elif i % 4 == 1:
            params.append(SamplingParams(max_tokens=24, temperature=1.0, seed=i, structured=s))
        else:
            params.append(SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True))
    want = _engine("qwen2", "float32", None).generate(prompts, params)
    eng = _engine("qwen2", "float32", {"method": "ngram", "num_speculative_tokens": 3})
    assert eng.generate(prompts, params) == want
    ids = [f"generate-{eng._generate_calls + 1}-{i}" for i in range(len(prompts))]
    eng.proposer = OracleProposer(3, dict(zip(ids, want)), 0.3, eng.vocab_size, 11)
    assert eng.generate(prompts, params) == want
    assert eng.stats().spec_decode_num_accepted_tokens > 0
    assert eng.check_all_free()
    for p, w in zip(params, want):
        if p.structured is None:
            continue
        text = tok.decode(w, skip_special_tokens=True)
        if p.structured["type"] == "regex":
            assert re.fullmatch(regex, text), text
        else:
            assert text in choices, text


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_eagle_on_gpu(dtype: str, tmp_path) -> None:
    """An EAGLE head on the GPU (its catch-up through the prefill attention and its single-row
    steps through the decode kernels, on its own KV cache): in fp32 its proposals equal the
    plain-torch reference of tests/engine/test_spec_eagle.py (up to near-ties) and the output
    equals speculation off; in fp16 only the prefix agreement and the counters are asserted
    (see test_draft_model_on_gpu)."""
    from tests.engine.test_spec_eagle import ref_proposals, spy, write_head

    head = write_head(tmp_path / "head", 7)
    rng = random.Random(6)
    V = len(tokenizer())
    prompts = [[rng.randrange(V) for _ in range(rng.randint(3, 30))] for _ in range(5)]
    params = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
    want = _engine("llama", dtype, None).generate(prompts, params)
    eng = _engine(
        "llama", dtype, {"method": "eagle", "model": str(head), "num_speculative_tokens": 3}
    )
    calls = spy(eng)
    got = eng.generate(prompts, params)
    st = eng.stats()
    assert st.spec_decode_num_drafts > 0
    assert st.spec_decode_num_accepted_tokens <= st.spec_decode_num_draft_tokens
    assert eng.check_all_free()
    if dtype == "float32":
        from safetensors.torch import load_file

        from tests.engine.token_match import assert_streams_match

        ids = [str(i) for i in range(len(prompts))]
        reqs = {i: (p, params) for i, p in zip(ids, prompts)}
        assert_streams_match(dict(zip(ids, got)), dict(zip(ids, want)), reqs, checkpoint("llama"))

        t = load_file(str(head / "model.safetensors"))
        for context, p in calls[:40]:
            ref, logits = ref_proposals(t, context, len(p))
            j = next((i for i, (a, b) in enumerate(zip(p, ref)) if a != b), None)
            if j is not None:
                gap = (logits[j].max() - logits[j][p[j]]).item()
                assert gap <= 1e-3, f"context {context}: proposals {p} vs reference {ref}"
    else:
        agree = [
            next((i for i, (a, b) in enumerate(zip(g, w)) if a != b), len(w))
            for g, w in zip(got, want)
        ]
        print("fp16 agreement lengths", agree)
        assert all(len(g) == 32 for g in got)
        assert sum(agree) >= len(want) * 8


def _graph_spec(method: str, head) -> dict:
    if method == "ngram":
        return {"method": "ngram", "num_speculative_tokens": 4}
    if method == "draft_model":
        # The target as its own draft (fp32): a right draft step has every proposal accepted.
        return {
            "method": "draft_model",
            "model": str(checkpoint("llama")),
            "num_speculative_tokens": 4,
        }
    return {"method": "eagle", "model": str(head), "num_speculative_tokens": 4}


def _generate(eng: LLMEngine, method: str, prompts, params, want, seed: int):
    if method == "ngram":
        # An oracle (30% of its tokens wrong) makes every step verify; request 0's continuation
        # ends early, so its rows come short before full ones.
        ids = [f"generate-{eng._generate_calls + 1}-{i}" for i in range(len(prompts))]
        cont = {rid: w[: 10 if i == 0 else None] for i, (rid, w) in enumerate(zip(ids, want))}
        eng.proposer = OracleProposer(4, cont, 0.3, eng.vocab_size, seed)
    return eng.generate(prompts, params)


@pytest.mark.parametrize("method", ["ngram", "draft_model", "eagle"])
def test_spec_graphs_equal_spec_eager_and_spec_off(method: str, tmp_path) -> None:
    """fp32 greedy, decode graphs up to 40 (verify graphs of 5 rows per sequence: sizes 1, 2,
    4, 8), batches of 1, 5 (padded to 8), 8 (unpadded) and 12 (more than the largest verify
    size: eager until requests finish): speculation with CUDA graphs equals speculation under
    --enforce-eager and speculation off; the verify steps (and, for a draft model or an EAGLE
    head, the runs of its single-token steps) replayed graphs, at the padded sizes too, and only
    the batch of 12 fell back; the self-draft has every proposal accepted and the EAGLE head's
    proposals equal the plain-torch reference (up to near-ties)."""
    from tests.engine.test_spec_eagle import _check_against_reference, spy, write_head
    from tests.engine.token_match import assert_streams_match

    seed = int(os.environ.get("VOLTSERVE_TEST_SEED") or random.SystemRandom().randrange(1 << 32))
    print(f"VOLTSERVE_TEST_SEED={seed}")
    rng = random.Random(seed)
    head = write_head(tmp_path / "head", 7) if method == "eagle" else None
    V = len(tokenizer())
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    spec = _graph_spec(method, head)
    base = _engine("llama", "float32", None, graph_batch=40)
    eager = _engine("llama", "float32", spec, eager=True, graph_batch=40)
    graph = _engine("llama", "float32", spec, graph_batch=40)
    step_graphs = getattr(eager.proposer, "step_graphs", None)
    assert eager.runner.verify_graphs is None and step_graphs is None
    vg = graph.runner.verify_graphs
    assert vg is not None and vg.sizes == [1, 2, 4, 8] and vg.q == 5
    dg = getattr(graph.proposer, "step_graphs", None)
    assert (dg is not None) == (method != "ngram")
    calls = spy(graph) if method == "eagle" else None
    counts = graph.runner.spec_graph_counts
    for n in (1, 5, 8, 12):
        prompts = [[rng.randrange(V) for _ in range(rng.randint(3, 20))] * 2 for _ in range(n)]
        want = base.generate(prompts, params)
        ids = [str(i) for i in range(n)]
        reqs = {i: (p, params) for i, p in zip(ids, prompts)}
        for eng in (eager, graph):
            got = _generate(eng, method, prompts, params, want, seed)
            assert_streams_match(
                dict(zip(ids, got)), dict(zip(ids, want)), reqs, checkpoint("llama")
            )
            assert eng.check_all_free()
        if n == 8:
            assert counts["verify_graph"] > 0 and counts["verify_eager"] == 0, counts
            assert {1, 8} <= set(vg.replays_by_size), vg.replays_by_size
    print("spec graph counts", counts, "verify replays", vg.replays_by_size)
    assert counts["verify_eager"] > 0, counts  # the batch of 12
    assert eager.runner.spec_graph_counts["verify_graph"] == 0
    st = graph.stats()
    assert st.spec_decode_num_drafts > 0
    if dg is not None:
        # Draft steps: decode sizes up to 40, so the batch of 12 replays the size-16 graph.
        assert counts["draft_graph"] > 0 and counts["draft_eager"] == 0, counts
        assert {1, 8, 16} <= set(dg.replays_by_size), dg.replays_by_size
    if method == "draft_model":
        assert st.spec_decode_num_accepted_tokens == st.spec_decode_num_draft_tokens
    if dg is not None:
        # Catch-ups of up to 8 requests after their first replay the catch-up graphs (a
        # draft model's or the EAGLE head's).
        assert counts["catchup_graph"] > 0 and counts["catchup_eager"] > 0, counts
        assert graph.proposer.catchup_graphs.sizes == vg.sizes
    if method == "eagle":
        _check_against_reference(head, calls[:60])


@pytest.mark.parametrize("method", ["ngram", "eagle"])
def test_spec_graphs_fp16(method: str, tmp_path) -> None:
    """fp16 (the numba decode-attention kernel over the verify rows, the V100 path): the graph
    path ran for batch 1 and a padded batch of 5, and its output agrees with speculation eager
    (prefill attention over the verify rows) up to fp16 near-ties, as the other fp16 tests
    assert (a long common prefix, every request complete)."""
    from tests.engine.test_spec_eagle import write_head

    rng = random.Random(9)
    head = write_head(tmp_path / "head", 7) if method == "eagle" else None
    V = len(tokenizer())
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    spec = _graph_spec(method, head)
    eager = _engine("llama", "float16", spec, eager=True, graph_batch=40)
    graph = _engine("llama", "float16", spec, graph_batch=40)
    base = _engine("llama", "float16", None, graph_batch=40)
    for n in (1, 5):
        prompts = [[rng.randrange(V) for _ in range(rng.randint(3, 20))] * 2 for _ in range(n)]
        want = base.generate(prompts, params)
        a = _generate(eager, method, prompts, params, want, 9)
        b = _generate(graph, method, prompts, params, want, 9)
        agree = [
            next((i for i, (x, y) in enumerate(zip(g, w)) if x != y), len(w)) for g, w in zip(b, a)
        ]
        print("fp16 agreement lengths", agree)
        assert all(len(g) == 24 for g in b)
        assert sum(agree) >= n * 8
    counts = graph.runner.spec_graph_counts
    assert counts["verify_graph"] > 0 and counts["verify_eager"] == 0, counts
    assert {1, 8} <= set(graph.runner.verify_graphs.replays_by_size)
    if method == "eagle":
        assert counts["draft_graph"] > 0
