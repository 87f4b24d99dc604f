"""MTP speculation (spec/mtp.py) on tiny hybrid checkpoints with MTP weights written by the tests
(tests/mtp_checkpoints.py): greedy with the MTP head proposing is transformers' greedy for the
target (fp32, CPU, teacher-forced: tests/greedy_reference.py; speculation off is too:
test_hybrid_models.py), with
chunked prefill, state slots reused, two MTP layers, several requests at once and preemption; a
head that proposes the last token again on a target forced into a chain of tokens, so that
proposals are rejected (the linear-attention state is rolled back) and accepted by
construction; and what is not supported is refused by name."""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import pytest
import torch
from voltserve.services.executor import state_rollback
from voltserve.services.executor.engine import LLMEngine
from voltserve.services.executor.engine_args import engine_config
from voltserve.services.executor.model_runner import ModelRunner
from voltserve.services.executor.spec.config import SpeculativeConfig
from voltserve.services.executor.state_cache import StateCache
from voltserve.shared.config import EngineConfig
from voltserve.shared.sampling_params import SamplingParams
from voltserve.shared.startup import StartupError

from tests import quant_checkpoints as qc
from tests.checkpoints import checkpoint, hf_model_class, tokenizer
from tests.engine.test_hybrid_models import hf_model
from tests.engine.test_hybrid_quant import AWQ_NOT_CONVERT, GROUP
from tests.engine.token_match import assert_streams_match
from tests.greedy_reference import check_greedy_outputs
from tests.mtp_checkpoints import A, B, C, chain_checkpoint, mtp_checkpoint

MAX_NEW = 12
K = 3
PARAMS = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
MTP = {"method": "mtp", "num_speculative_tokens": K}


def config(path: Path, spec=None, **kw) -> EngineConfig:
    # An 8-token budget chunks every prompt; 3 state slots: slots are reused.
    args = dict(max_num_batched_tokens=8, max_num_seqs=3) | kw
    return engine_config(
        model=str(path), device="cpu", dtype="float32", speculative_config=spec, **args
    )


def engine(path: Path, spec=None, **kw) -> LLMEngine:
    return LLMEngine(config(path, spec, **kw))


def prompts(rng: random.Random, n: int, lo: int = 4, hi: int = 20) -> list[list[int]]:
    V = len(tokenizer())
    return [[rng.randrange(V) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


# qwen3_next with two MTP layers: proposal j runs layer j mod 2, each with its own KV cache.
@pytest.mark.parametrize("arch, layers", [("qwen3_5", 1), ("qwen3_5_moe", 1), ("qwen3_next", 2)])
def test_mtp_greedy_equals_transformers(arch: str, layers: int, rng) -> None:
    ps = prompts(rng, 4)
    eng = engine(mtp_checkpoint(arch, layers=layers), MTP)
    assert len(eng.runner.proposer.kv) == layers
    check_greedy_outputs(hf_model(arch), ps, eng.generate(ps, PARAMS), MAX_NEW)
    assert eng.check_all_free()
    st = eng.stats()
    assert st.spec_decode_num_drafts > 0
    assert len(st.spec_decode_num_accepted_tokens_per_pos) == K


def test_mtp_seeded_sampling_equals_spec_off(rng) -> None:
    """Acceptance reuses the target's seeded draw: sampled output with MTP proposing is the
    output without speculation, token for token (up to a near-tie between the verify step's
    and the plain decode's logits, which token_match checks against transformers)."""
    arch = "qwen3_next"
    ps = prompts(rng, 3)
    params = [
        SamplingParams(
            max_tokens=MAX_NEW, temperature=0.8, seed=rng.randrange(1 << 30), ignore_eos=True
        )
        for _ in ps
    ]
    want = engine(checkpoint(arch)).generate(ps, params)
    eng = engine(mtp_checkpoint(arch, layers=2), MTP)
    got = eng.generate(ps, params)
    ids = [str(i) for i in range(len(ps))]
    reqs = {i: (p, sp) for i, p, sp in zip(ids, ps, params)}
    assert_streams_match(dict(zip(ids, got)), dict(zip(ids, want)), reqs, checkpoint(arch))
    assert eng.stats().spec_decode_num_drafts > 0
    assert eng.check_all_free()


def test_mtp_proposals_accepted_and_rejected_by_construction(rng) -> None:
    """The repeat head proposes the last token k times. After a prompt ending in C the target
    emits B, then A for ever: the first decode step proposes B and gets A (rejected at the
    first position: the linear-attention state is rolled back to the row of the last known
    token), every later one proposes A and gets A (all accepted, at every position). Random
    prompts in the same verify steps, whose output depends on their state, stay exact."""
    path = chain_checkpoint()
    model = hf_model_class(path).from_pretrained(path, dtype=torch.float32).eval()
    ps = [prompts(rng, 1)[0] + [C], *prompts(rng, 2)]
    # Plenty of blocks: every decode step proposes.
    eng = engine(path, MTP, num_kv_blocks=64)
    outs = eng.generate(ps, PARAMS)
    assert outs[0] == [B] + [A] * (MAX_NEW - 1)
    check_greedy_outputs(model, ps, outs, MAX_NEW)
    st = eng.stats()
    assert 0 < st.spec_decode_num_accepted_tokens < st.spec_decode_num_draft_tokens
    assert all(n > 0 for n in st.spec_decode_num_accepted_tokens_per_pos)
    assert eng.check_all_free()


def test_mtp_many_requests_with_preemption(rng) -> None:
    """8 requests at once on a KV pool too small for them (preemption: a request's state and
    MTP features are rebuilt from position 0), MoE MTP layer."""
    arch = "qwen3_5_moe"
    ps = prompts(rng, 8, 16, 16)
    eng = engine(mtp_checkpoint(arch), MTP, num_kv_blocks=4, max_num_seqs=8)
    check_greedy_outputs(hf_model(arch), ps, eng.generate(ps, PARAMS), MAX_NEW)
    assert eng.batcher.num_preemptions > 0
    assert eng.stats().spec_decode_num_drafts > 0
    assert eng.check_all_free()


def test_mtp_verifies_at_most_max_verify_seqs_requests_a_step(rng) -> None:
    """The state cache holds k snapshots of max_verify_seqs requests (allocated with it and
    counted in its bytes); with more requests decoding, a step gives proposals to that many and
    the others decode plainly: greedy equals transformers all the same."""
    arch = "qwen3_5"
    eng = engine(
        mtp_checkpoint(arch), MTP, num_kv_blocks=64, max_num_seqs=8, max_num_batched_tokens=128
    )
    cap = eng.runner.max_verify_seqs
    assert cap == state_rollback.MAX_VERIFY_SEQS < 8
    cache = eng.runner.state_cache
    assert cache.snapshot_shape == (K, cap)
    assert cache.nbytes == StateCache.bytes_for(cache.specs, 8 + K * cap, cache.dtype)
    propose, proposing = eng._propose, []

    def counted() -> None:
        propose()
        proposing.append(sum(1 for r in eng.batcher.running if r.spec_token_ids))

    eng._propose = counted
    # One request more than the cap, all decoding at once (8 tokens each: one prefill step).
    ps = prompts(rng, cap + 1, 8, 8)
    check_greedy_outputs(hf_model(arch), ps, eng.generate(ps, PARAMS), MAX_NEW)
    assert max(proposing) == cap
    assert eng.check_all_free()


def test_mtp_on_an_awq_target(rng, tmp_path: Path) -> None:
    """An AWQ int4 target whose MTP layers stay float (modules_to_not_convert 'mtp', as the
    published checkpoints): greedy with MTP equals greedy without; quantized MTP layers are
    refused by name."""
    path, _ = qc.awq_checkpoint(
        "qwen3_5", GROUP, src=mtp_checkpoint("qwen3_5"), not_convert=AWQ_NOT_CONVERT
    )
    ps = prompts(rng, 3)
    want = engine(path).generate(ps, PARAMS)
    eng = engine(path, MTP)
    assert eng.generate(ps, PARAMS) == want
    assert eng.stats().spec_decode_num_drafts > 0
    src = shutil.copytree(mtp_checkpoint("qwen3_5"), tmp_path / "mtp")
    quantized, _ = qc.awq_checkpoint(
        "qwen3_5", GROUP, src=src, not_convert=[e for e in AWQ_NOT_CONVERT if e != "mtp"]
    )
    with pytest.raises(StartupError, match="MTP layers are quantized"):
        engine(quantized, MTP)


def test_mtp_config_spellings() -> None:
    for alias in ("mtp", "qwen3_next_mtp", "qwen3_5_mtp"):
        c = SpeculativeConfig.from_dict({"method": alias, "num_speculative_tokens": 2})
        assert c.method == "mtp"
    with pytest.raises(ValueError, match="'deepseek_mtp' is not supported"):
        SpeculativeConfig.from_dict({"method": "deepseek_mtp", "num_speculative_tokens": 2})
    with pytest.raises(ValueError, match="'mtp' takes no \"model\""):
        SpeculativeConfig.from_dict({"method": "mtp", "num_speculative_tokens": 2, "model": "x"})


def _with_config(arch: str, dest: Path, **changes) -> Path:
    shutil.copytree(mtp_checkpoint(arch), dest)
    cfg = json.loads((dest / "config.json").read_text())
    cfg.update(changes)
    (dest / "config.json").write_text(json.dumps(cfg))
    return dest


def test_mtp_refused_by_name(tmp_path: Path) -> None:
    def runner(path) -> ModelRunner:
        return ModelRunner(EngineConfig(model=str(path), num_kv_blocks=8, speculative_config=sc))

    sc = SpeculativeConfig.from_dict(MTP)
    # A checkpoint without MTP layers (the plain tiny one: no mtp_num_hidden_layers).
    with pytest.raises(StartupError, match="no mtp_num_hidden_layers"):
        runner(checkpoint("qwen3_5"))
    # The config names MTP layers but the weights are gone.
    no_weights = _with_config("qwen3_5", tmp_path / "no-weights")
    (no_weights / "mtp.safetensors").unlink()
    with pytest.raises(StartupError, match=r"no mtp\.\* weight tensors"):
        runner(no_weights)
    # DeepSeek-V3-style MTP.
    with pytest.raises(StartupError, match="num_nextn_predict_layers"):
        runner(_with_config("qwen3_5", tmp_path / "ds", num_nextn_predict_layers=1))
    # A family without MTP layers.
    with pytest.raises(StartupError, match="LlamaForCausalLM has no MTP layers"):
        runner(checkpoint("llama"))
