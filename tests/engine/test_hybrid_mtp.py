"""MTP speculation (spec/mtp.py) on tiny hybrid checkpoints with MTP weights written by the test:
greedy with the MTP head proposing equals transformers' greedy for the target (fp32, CPU;
speculation off equals transformers too: test_hybrid_models.py), with chunked prefill, state
slots reused, several requests at once and preemption; a head built to propose the last token
again, so that proposals are accepted exactly where the target repeats a token and rejected
where it does not (the linear-attention rollback runs); and what is not supported is refused
by name."""

from __future__ import annotations

import functools
import json
import random
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from voltserve.services.executor.engine import LLMEngine
from voltserve.services.executor.engine_args import engine_config
from voltserve.services.executor.model_runner import ModelRunner
from voltserve.services.executor.spec.config import SpeculativeConfig
from voltserve.shared.config import EngineConfig
from voltserve.shared.sampling_params import SamplingParams
from voltserve.shared.startup import StartupError

from tests.checkpoints import _root, checkpoint, greedy_tokens, tokenizer
from tests.engine.test_hybrid_models import hf_model

MAX_NEW = 12
K = 3
PARAMS = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
MTP = {"method": "mtp", "num_speculative_tokens": K}


@functools.cache
def mtp_checkpoint(arch: str, repeat_head: bool = False) -> Path:
    """A copy of the tiny `arch` checkpoint with one MTP layer: the target's last layer (a full
    attention one) under mtp.layers.0, and fc / norms. repeat_head: fc passes the normed hidden
    state through and the layer adds nothing (o_proj and every down_proj zero), so each step's
    output is a positive multiple of the target's hidden h_p and proposes argmax lm_head(h_p),
    the token the target itself produced from h_p: the last token, k times."""
    src = checkpoint(arch)
    dest = _root() / f"{arch}-mtp{'-repeat' if repeat_head else ''}"
    shutil.copytree(src, dest)
    cfg = json.loads((src / "config.json").read_text())
    cfg["mtp_num_hidden_layers"] = 1
    (dest / "config.json").write_text(json.dumps(cfg))
    weights = load_file(str(src / "model.safetensors"))
    last = f"model.layers.{cfg['num_hidden_layers'] - 1}."
    layer = {k[len(last) :]: v for k, v in weights.items() if k.startswith(last)}
    assert any(k.startswith("self_attn.") for k in layer), "the last layer is full attention"
    H = cfg["hidden_size"]
    gen = torch.Generator().manual_seed(len(arch))
    mtp = {f"mtp.layers.0.{k}": v.clone() for k, v in layer.items()}
    if repeat_head:
        fc = torch.cat([torch.zeros(H, H), torch.eye(H)], dim=1)
        norms = {n: torch.zeros(H) for n in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm")}
        for k in mtp:
            if "o_proj" in k or "down_proj" in k:
                mtp[k] = torch.zeros_like(mtp[k])
    else:
        fc = torch.randn(H, 2 * H, generator=gen) * (2 * H) ** -0.5
        norms = {
            n: torch.randn(H, generator=gen) * 0.1
            for n in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm")
        }
    mtp["mtp.fc.weight"] = fc
    mtp.update({f"mtp.{n}.weight": w for n, w in norms.items()})
    save_file({k: v.contiguous() for k, v in mtp.items()}, str(dest / "mtp.safetensors"))
    return dest


def engine(path: Path, spec=None, **kw) -> LLMEngine:
    # An 8-token budget chunks every prompt; 3 state slots: slots are reused.
    args = dict(max_num_batched_tokens=8, max_num_seqs=3) | kw
    return LLMEngine(
        engine_config(
            model=str(path), device="cpu", dtype="float32", speculative_config=spec, **args
        )
    )


def prompts(rng: random.Random, n: int, lo: int = 4, hi: int = 20) -> list[list[int]]:
    V = len(tokenizer())
    return [[rng.randrange(V) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


@pytest.mark.parametrize("arch", ["qwen3_5", "qwen3_5_moe", "qwen3_next"])
def test_mtp_greedy_equals_transformers(arch: str, rng) -> None:
    ps = prompts(rng, 4)
    want = [greedy_tokens(hf_model(arch), p, MAX_NEW) for p in ps]
    eng = engine(mtp_checkpoint(arch), MTP)
    assert eng.generate(ps, PARAMS) == want
    assert eng.check_all_free()
    st = eng.stats()
    assert st.spec_decode_num_drafts > 0
    assert len(st.spec_decode_num_accepted_tokens_per_pos) == K


def _repeat_pattern(out: list[int]) -> bool:
    """The second token differs from the first (the first decode step's proposal, the first
    token again, is rejected) and some later token repeats its predecessor while the step that
    emits it still proposes (at least one proposal is accepted; the argument in the test)."""
    return out[1] != out[0] and any(out[i + 1] == out[i] for i in range(1, MAX_NEW - 2))


def test_mtp_proposals_accepted_and_rejected_by_construction(rng) -> None:
    """The repeat head proposes the last token k times. The step after the first token
    proposes it and the target's second token differs: rejected. The step that emits a token
    equal to its predecessor either starts from it (its first proposal equals it: accepted) or
    emitted the predecessor itself, which then was an accepted proposal."""
    arch = "qwen3_5"
    model = hf_model(arch)
    chosen: list[tuple[list[int], list[int]]] = []
    for p in prompts(rng, 40):
        out = greedy_tokens(model, p, MAX_NEW)
        if _repeat_pattern(out):
            chosen.append((p, out))
        if len(chosen) == 3:
            break
    assert chosen, "no prompt whose greedy output has the pattern (the tiny model repeats often)"
    ps, want = [c[0] for c in chosen], [c[1] for c in chosen]
    # Plenty of blocks: every decode step proposes.
    eng = engine(mtp_checkpoint(arch, repeat_head=True), MTP, num_kv_blocks=64)
    assert eng.generate(ps, PARAMS) == want
    st = eng.stats()
    assert 0 < st.spec_decode_num_accepted_tokens < st.spec_decode_num_draft_tokens
    assert st.spec_decode_num_accepted_tokens_per_pos[0] > 0
    assert eng.check_all_free()


def test_mtp_many_requests_with_preemption(rng) -> None:
    """8 requests at once on a KV pool too small for them (preemption: a request's state and
    MTP features are rebuilt from position 0), MoE MTP layer."""
    arch = "qwen3_5_moe"
    ps = prompts(rng, 8, 16, 16)
    want = [greedy_tokens(hf_model(arch), p, MAX_NEW) for p in ps]
    eng = engine(mtp_checkpoint(arch), MTP, num_kv_blocks=4, max_num_seqs=8)
    assert eng.generate(ps, PARAMS) == want
    assert eng.batcher.num_preemptions > 0
    assert eng.check_all_free()


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
