"""EAGLE speculative decoding on the real model runner (fp32, CPU): a tiny EAGLE-1 head with random
weights, written in the published layout for the tiny llama checkpoint. Its proposals equal an
independent plain-torch restatement of the head over the whole context (with the target's
features from transformers); greedy and seeded output equal speculation off; bad heads and
configs are refused by name."""

from __future__ import annotations

import functools
import json
import os
import random
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from voltserve.services.executor.engine import LLMEngine
from voltserve.services.executor.engine_args import engine_config
from voltserve.services.executor.spec.config import SpeculativeConfig
from voltserve.shared.sampling_params import SamplingParams
from voltserve.shared.startup import StartupError

from tests.checkpoints import TINY, checkpoint
from tests.engine.token_match import assert_streams_match

VOCAB = 384
K = 3
HEADS, KV_HEADS = TINY["num_attention_heads"], TINY["num_key_value_heads"]
H, INTER = TINY["hidden_size"], TINY["intermediate_size"]
HD = H // HEADS
EPS = 1e-6
THETA = 10000.0


@pytest.fixture(scope="module")
def seed() -> int:
    s = int(os.environ.get("VOLTSERVE_TEST_SEED") or random.SystemRandom().randrange(1 << 32))
    print(f"VOLTSERVE_TEST_SEED={s}")
    return s


def head_tensors(seed: int, hidden: int = H) -> dict[str, torch.Tensor]:
    """EAGLE-1 layout: fc over [embedding, feature], one decoder layer without its input
    norm; an embed_tokens copy as some exports carry (ignored: the target's is shared)."""
    g = torch.Generator().manual_seed(seed)

    def w(*shape, scale=0.2):
        return torch.randn(*shape, generator=g) * scale

    p = "layers.0."
    return {
        "fc.weight": w(hidden, 2 * hidden),
        "fc.bias": w(hidden, scale=0.05),
        p + "self_attn.q_proj.weight": w(HEADS * HD, hidden),
        p + "self_attn.k_proj.weight": w(KV_HEADS * HD, hidden),
        p + "self_attn.v_proj.weight": w(KV_HEADS * HD, hidden),
        p + "self_attn.o_proj.weight": w(hidden, HEADS * HD),
        p + "mlp.gate_proj.weight": w(INTER, hidden),
        p + "mlp.up_proj.weight": w(INTER, hidden),
        p + "mlp.down_proj.weight": w(hidden, INTER),
        p + "post_attention_layernorm.weight": 1 + w(hidden, scale=0.1),
        "embed_tokens.weight": w(VOCAB, hidden),
    }


def write_head(d: Path, seed: int, hidden: int = H, drop: str | None = None, **cfg) -> Path:
    d.mkdir(parents=True, exist_ok=True)
    t = head_tensors(seed, hidden)
    if drop:
        del t[drop]
    save_file({k: v.contiguous() for k, v in t.items()}, str(d / "model.safetensors"))
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hidden,
        "intermediate_size": INTER,
        "num_hidden_layers": 1,
        "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS,
        "vocab_size": VOCAB,
        "rms_norm_eps": EPS,
        "rope_theta": THETA,
        "max_position_embeddings": TINY["max_position_embeddings"],
        "torch_dtype": "float32",
        **cfg,
    }
    (d / "config.json").write_text(json.dumps(config))
    return d


@pytest.fixture(scope="module")
def head_dir(tmp_path_factory, seed) -> Path:
    return write_head(tmp_path_factory.mktemp("eagle") / "head", seed)


def eagle(head: Path, k: int = K) -> dict:
    return {"method": "eagle", "model": str(head), "num_speculative_tokens": k}


def engine(spec=None, **kw) -> LLMEngine:
    cfg = engine_config(
        model=str(checkpoint("llama")),
        device="cpu",
        dtype="float32",
        speculative_config=spec,
        **kw,
    )
    return LLMEngine(cfg)


# ---- the reference: the published head architecture restated in plain torch ----------------


def _rms(x, w):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS) * w


def _rope(x, pos):  # x [T, heads, hd]; NeoX halves, as Llama
    inv = 1.0 / THETA ** (torch.arange(0, HD, 2, dtype=torch.float64) / HD)
    ang = pos[:, None].double() * inv[None]
    cos, sin = ang.cos().float()[:, None], ang.sin().float()[:, None]
    a, b = x[..., : HD // 2], x[..., HD // 2 :]
    return torch.cat([a * cos - b * sin, b * cos + a * sin], dim=-1)


def ref_head(t: dict, embeds: torch.Tensor, feats: torch.Tensor) -> torch.Tensor:
    """The head over a whole window of pairs at positions 0..T-1 (causal), no cache."""
    T = embeds.shape[0]
    x = torch.cat([embeds, feats], -1) @ t["fc.weight"].T + t["fc.bias"]
    p = "layers.0."
    pos = torch.arange(T)
    q = _rope((x @ t[p + "self_attn.q_proj.weight"].T).view(T, HEADS, HD), pos)
    k = _rope((x @ t[p + "self_attn.k_proj.weight"].T).view(T, KV_HEADS, HD), pos)
    v = (x @ t[p + "self_attn.v_proj.weight"].T).view(T, KV_HEADS, HD)
    k = k.repeat_interleave(HEADS // KV_HEADS, dim=1)
    v = v.repeat_interleave(HEADS // KV_HEADS, dim=1)
    s = torch.einsum("qhd,khd->hqk", q, k) * HD**-0.5
    s = s.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
    o = torch.einsum("hqk,khd->qhd", s.softmax(-1), v).reshape(T, H)
    r = x + o @ t[p + "self_attn.o_proj.weight"].T
    m = _rms(r, t[p + "post_attention_layernorm.weight"])
    g = torch.nn.functional.silu(m @ t[p + "mlp.gate_proj.weight"].T)
    return r + (g * (m @ t[p + "mlp.up_proj.weight"].T)) @ t[p + "mlp.down_proj.weight"].T


@functools.cache
def _hf():
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(checkpoint("llama")), dtype=torch.float32)


def ref_proposals(t: dict, context: list[int], k: int) -> tuple[list[int], list[torch.Tensor]]:
    """k greedy proposals after context (its last token not yet computed by the target), and
    each step's logits. Features: transformers' last hidden state (after the final norm)."""
    hf = _hf()
    with torch.no_grad():
        f = hf.model(torch.tensor([context])).last_hidden_state[0]
        emb, lm = hf.model.embed_tokens.weight, hf.lm_head.weight
        c = len(context) - 1
        feats, toks = f[:c], list(context[1 : c + 1])  # pairs (f_p, x_{p+1}), p < c
        out, logits = [], []
        for _ in range(k):
            h = ref_head(t, emb[toks], feats)[-1]
            lg = h @ lm.T
            out.append(int(lg.argmax()))
            logits.append(lg)
            feats, toks = torch.cat([feats, h[None]]), toks + [out[-1]]
    return out, logits


def spy(eng: LLMEngine) -> list[tuple[list[int], list[int]]]:
    calls: list[tuple[list[int], list[int]]] = []
    orig = eng.proposer.propose

    def propose(reqs):
        props = orig(reqs)
        for r, p in zip(reqs, props):
            if p:
                calls.append((r.prompt_token_ids + r.output_token_ids, list(p)))
        return props

    eng.proposer.propose = propose
    return calls


def prompts_of(seed: int, n: int = 4, lengths: tuple[int, int] = (3, 30)) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(VOCAB) for _ in range(rng.randrange(*lengths))] for _ in range(n)]


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


# ---- (a) proposals equal the reference ------------------------------------------------------


def _check_against_reference(head_dir: Path, calls) -> None:
    from safetensors.torch import load_file

    t = load_file(str(head_dir / "model.safetensors"))
    ties = 0
    for context, got in calls:
        want, logits = ref_proposals(t, context, len(got))
        j = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), None)
        if j is None:
            continue
        # Only a near-tie of the reference's own scores may part them (CPU matmul order).
        gap = (logits[j].max() - logits[j][got[j]]).item()
        assert gap <= 1e-3, f"context {context}: proposals {got} vs reference {want}"
        ties += 1
    assert ties <= len(calls) // 4


def test_proposals_equal_torch_reference(head_dir, seed):
    # Chunked prefill: the head catches up chunk by chunk, as the target computes them.
    eng = engine(eagle(head_dir), max_num_batched_tokens=11)
    calls = spy(eng)
    eng.generate(prompts_of(seed, 2), greedy(10))
    assert eng.check_all_free()
    assert len(calls) >= 2 * 3
    _check_against_reference(head_dir, calls)


def test_prefix_cache_hit_keeps_the_heads_kv(head_dir, seed):
    """A second request with the same prompt starts from the first one's cached blocks: the
    head's KV in them (written by the first request's catch-up) is the one the reference
    computes, so its proposals still equal the reference; the output equals spec off."""
    rng = random.Random(seed + 3)
    prompt = [rng.randrange(VOCAB) for _ in range(37)]
    want = engine().generate([prompt], greedy(6))
    reqs = {"0": (prompt, greedy(6))}

    def check(got):
        assert_streams_match({"0": got[0]}, {"0": want[0]}, reqs, checkpoint("llama"))

    eng = engine(eagle(head_dir))
    check(eng.generate([prompt], greedy(6)))
    cached: list[int] = []
    orig = eng.proposer.propose

    def propose(reqs):
        cached.extend(r.num_cached_tokens for r in reqs)
        return orig(reqs)

    eng.proposer.propose = propose
    calls = spy(eng)
    check(eng.generate([prompt], greedy(6)))
    assert cached and cached[0] == 32 and calls
    _check_against_reference(head_dir, calls)
    assert eng.check_all_free()


# ---- (b) output equals speculation off ------------------------------------------------------


@functools.cache
def _spec_off(seed: int, n: int, lengths: tuple[int, int] = (3, 30)):
    prompts = prompts_of(seed + 1, 5, lengths)
    return prompts, engine().generate(prompts, greedy(n))


@pytest.mark.parametrize(
    "kw",
    [{}, {"max_num_batched_tokens": 9}, {"num_kv_blocks": 9}],
    ids=["batch", "chunked", "preempt"],
)
def test_greedy_equals_spec_off(head_dir, seed, kw):
    # preempt: 12-16-token prompts need 2 blocks each (10 > 9) by decode step 5, before any ends
    prompts, want = _spec_off(seed, 24, (12, 17) if "num_kv_blocks" in kw else (3, 30))
    eng = engine(eagle(head_dir), **kw)
    calls = spy(eng)
    got = eng.generate(prompts, greedy(24))
    ids = [str(i) for i in range(len(prompts))]
    reqs = {i: (p, greedy(24)) for i, p in zip(ids, prompts)}
    assert_streams_match(dict(zip(ids, got)), dict(zip(ids, want)), reqs, checkpoint("llama"))
    assert eng.check_all_free()
    eng.block_manager.check_invariants()
    st = eng.stats()
    assert st.generation_tokens_total == 5 * 24
    per_pos = st.spec_decode_num_accepted_tokens_per_pos
    assert len(per_pos) == K and all(a >= b for a, b in zip(per_pos, per_pos[1:]))
    assert 0 < st.spec_decode_num_drafts <= len(calls)
    assert st.spec_decode_num_accepted_tokens <= st.spec_decode_num_draft_tokens
    assert st.spec_decode_num_draft_tokens <= K * st.spec_decode_num_drafts
    if "num_kv_blocks" in kw:
        assert st.num_preemptions_total > 0
    if not kw and got == want:
        # Every proposal is verified in full here (no budget or block limit): the counters
        # equal what the recorded output says each proposal should have kept.
        assert st.spec_decode_num_drafts == len(calls)
        assert st.spec_decode_num_draft_tokens == sum(len(p) for _, p in calls)
        expect = 0
        for context, p in calls:
            out = want[next(i for i, q in enumerate(prompts) if context[: len(q)] == q)]
            n = len(context) - len(next(q for q in prompts if context[: len(q)] == q))
            truth = out[n : n + len(p)]
            expect += next((i for i, (a, b) in enumerate(zip(p, truth)) if a != b), len(p))
        assert st.spec_decode_num_accepted_tokens == expect


def test_seeded_sampling_equals_spec_off(head_dir, seed):
    prompts = prompts_of(seed + 2, 3)
    params = [
        SamplingParams(max_tokens=12, temperature=0.8, seed=seed + i, ignore_eos=True)
        for i in range(len(prompts))
    ]
    want = engine().generate(prompts, params)
    eng = engine(eagle(head_dir), max_num_batched_tokens=9)
    got = eng.generate(prompts, params)
    ids = [str(i) for i in range(len(prompts))]
    reqs = {i: (p, sp) for i, p, sp in zip(ids, prompts, params)}
    assert_streams_match(dict(zip(ids, got)), dict(zip(ids, want)), reqs, checkpoint("llama"))
    assert eng.check_all_free()
    assert eng.stats().spec_decode_num_drafts > 0


# ---- (c) refused by name --------------------------------------------------------------------


def test_bad_configs_refused(tmp_path, seed):
    with pytest.raises(ValueError, match="method 'eagle' needs \"model\""):
        SpeculativeConfig.from_dict({"method": "eagle", "num_speculative_tokens": 2})
    with pytest.raises(ValueError, match="'eagle3' is not supported yet"):
        SpeculativeConfig.from_dict({"method": "eagle3", "model": "x", "num_speculative_tokens": 2})
    with pytest.raises(StartupError, match="not a folder"):
        engine(eagle(tmp_path / "absent"))
    wide = write_head(tmp_path / "wide", seed, hidden=2 * H)
    with pytest.raises(StartupError, match=f"hidden_size {2 * H} differs from the target's {H}"):
        engine(eagle(wide))
    vocab = write_head(tmp_path / "vocab", seed, vocab_size=2 * VOCAB)
    with pytest.raises(StartupError, match=f"vocab_size {2 * VOCAB} differs"):
        engine(eagle(vocab))
    e3 = write_head(tmp_path / "e3", seed, architectures=["LlamaForCausalLMEagle3"])
    with pytest.raises(StartupError, match="EAGLE-3 head"):
        engine(eagle(e3))
    lacking = write_head(tmp_path / "lacking", seed, drop="layers.0.mlp.down_proj.weight")
    with pytest.raises(StartupError, match="layers.0.mlp.down_proj.weight"):
        engine(eagle(lacking))


def test_refused_under_tensor_parallelism(head_dir):
    from voltserve.services.executor.tp.sharding import TPSplitError
    from voltserve.services.executor.tp.worker import check_tp_model

    cfg = engine_config(
        model=str(checkpoint("llama")),
        device="cpu",
        speculative_config=eagle(head_dir),
        tensor_parallel_size=2,
    )
    with pytest.raises(
        TPSplitError, match="--tensor-parallel-size 2 is not supported yet \\(method 'eagle'\\)"
    ):
        check_tp_model(cfg)
