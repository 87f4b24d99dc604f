"""Quantized checkpoints through the model runner against transformers (fp32, CPU).

For every format and architecture, the checkpoint is written by tests/quant_checkpoints.py from
the format's published packing rules (compressed-tensors: by its own compressor; GGUF: with the
gguf package's writer), and the reference is independent of our loader: transformers on the
weights dequantized by the test helper's reference (compressed-tensors: the library's
decompressor), or transformers loading the .gguf file itself (`gguf_file=`). Greedy tokens are
checked teacher-forced (tests/greedy_reference.py): each the reference's argmax up to
LOGPROB_ATOL, its logprob within LOGPROB_ATOL (fp32 products of the same weights, summed in a
different order).
"""

from __future__ import annotations

import os
import random

import pytest
import torch
from voltserve.services.executor.model_runner import ModelRunner
from voltserve.services.executor.request import Request
from voltserve.shared.config import EngineConfig
from voltserve.shared.sampling_params import SamplingParams

from tests import quant_checkpoints as qc
from tests.checkpoints import drive, tokenizer
from tests.greedy_reference import check_greedy

LOGPROB_ATOL = 1e-4
ARCHS = ("llama", "qwen2", "qwen3")

# format id -> writer(arch) -> (checkpoint, reference spec)
FORMATS = {
    "awq-g128": lambda a: qc.awq_checkpoint(a, 128),
    "awq-g32": lambda a: qc.awq_checkpoint(a, 32),
    "gptq-4b-act-sym": lambda a: qc.gptq_checkpoint(a, 4, 64, desc_act=True, sym=True),
    "gptq-4b-noact-asym-v2": lambda a: qc.gptq_checkpoint(
        a, 4, 128, desc_act=False, sym=False, v1=False
    ),
    "gptq-4b-noact-asym-v1": lambda a: qc.gptq_checkpoint(a, 4, 32, desc_act=False, sym=False),
    "gptq-8b-act-sym": lambda a: qc.gptq_checkpoint(a, 8, 128, desc_act=True, sym=True),
    "ct-w4a16-g32": lambda a: qc.ct_checkpoint(a, 4, 32),
    "ct-w8a16-channel-asym": lambda a: qc.ct_checkpoint(a, 8, None, sym=False),
}
GGUF_TYPES = ("Q8_0", "Q4_0", "Q4_K", "Q5_K", "Q6_K")


def _gguf(arch: str, kind: str):
    if kind == "Q4_K_M":
        return qc.gguf_checkpoint(arch, qc.q4_k_m_types, kind)
    return qc.gguf_checkpoint(arch, lambda _name: kind, kind)


def hf_model(ref, gguf: bool, config=None):
    """config: a transformers config to load the GGUF tensors into, where its GGUF loader
    reads too little of the metadata (it takes no expert sizes from an MoE file)."""
    from transformers import AutoModelForCausalLM

    kw = {"gguf_file": "model.gguf"} if gguf else {}
    if config is not None:
        kw["config"] = config
    model = AutoModelForCausalLM.from_pretrained(ref, dtype=torch.float32, **kw)
    model.generation_config.eos_token_id = None
    return model


def check_against_reference(path, ref, gguf: bool, seed: int, config=None) -> ModelRunner:
    runner = ModelRunner(EngineConfig(model=str(path), num_kv_blocks=32))
    rng = random.Random(seed)
    V = len(tokenizer())
    prompts = [
        [rng.randrange(V) for _ in range(n)] for n in (rng.randint(3, 9), rng.randint(20, 40))
    ]
    max_new = 6
    params = SamplingParams(temperature=0.0, max_tokens=max_new, logprobs=1, ignore_eos=True)
    reqs = [Request(f"r{i}", p, params, seed=i, arrival_time=0.0) for i, p in enumerate(prompts)]
    drive(runner, reqs, max_new, chunk=rng.choice([7, 16]))
    model = hf_model(ref, gguf, config)
    for r, prompt in zip(reqs, prompts):
        served = [tok.token_id for tok in r.trace]
        assert r.output_token_ids == served and len(served) == max_new, f"seed {seed}"
        check_greedy(model, prompt, served, [tok.logprob for tok in r.trace], LOGPROB_ATOL)
    return runner


def _seed() -> int:
    seed = int(os.environ.get("VOLTSERVE_TEST_SEED") or random.SystemRandom().randrange(1 << 32))
    print(f"VOLTSERVE_TEST_SEED={seed}")
    return seed


# Every format on at least one architecture and every architecture on each format family; the
# whole cross product with VOLTSERVE_QUANT_FULL=1 (about 40 cases, minutes on 2 cores).
FULL = os.environ.get("VOLTSERVE_QUANT_FULL") == "1"
INT_CASES = [
    ("awq-g128", "llama"),
    ("awq-g128", "qwen2"),
    ("awq-g128", "qwen3"),
    ("awq-g32", "qwen3"),
    ("gptq-4b-act-sym", "llama"),
    ("gptq-4b-act-sym", "qwen2"),
    ("gptq-4b-noact-asym-v2", "qwen3"),
    ("gptq-4b-noact-asym-v1", "qwen2"),
    ("gptq-8b-act-sym", "llama"),
    ("ct-w4a16-g32", "qwen3"),
    ("ct-w4a16-g32", "llama"),
    ("ct-w8a16-channel-asym", "qwen2"),
]
GGUF_CASES = [
    ("Q8_0", "llama"),
    ("Q4_0", "qwen2"),
    ("Q4_K", "qwen3"),
    ("Q5_K", "llama"),
    ("Q6_K", "qwen2"),
    ("Q4_K_M", "llama"),
    ("Q4_K_M", "qwen2"),
    ("Q4_K_M", "qwen3"),
]
if FULL:
    INT_CASES = [(f, a) for f in FORMATS for a in ARCHS]
    GGUF_CASES = [(k, a) for k in (*GGUF_TYPES, "Q4_K_M") for a in ARCHS]


@pytest.mark.parametrize(("fmt", "arch"), INT_CASES)
def test_int_formats_match_transformers(fmt: str, arch: str) -> None:
    path, ref = FORMATS[fmt](arch)
    runner = check_against_reference(path, ref, gguf=False, seed=_seed())
    # every decoder linear runs quantized; the lm_head stays float (the formats leave it)
    layer = runner.model.model.layers[0]
    for lin in (layer.self_attn.qkv_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj):
        assert lin.method.dense_weight(lin) is None and lin.qweight is not None
    assert runner.model.lm_head_weight() is not None


def test_gguf_llama3_rope_freqs_match_transformers() -> None:
    """A Llama 3.1 GGUF carries its rope scaling as rope_freqs (a divisor per frequency), which
    transformers' GGUF loader ignores: the reference is transformers with the float model's
    llama3 rope_parameters and the weights transformers dequantized from the file."""
    from transformers import AutoConfig, AutoModelForCausalLM

    d = qc.gguf_checkpoint("llama", lambda _n: "Q4_K", "Q4_K-llama3", llama3_rope=True)
    from_gguf = AutoModelForCausalLM.from_pretrained(d, gguf_file="model.gguf", dtype=torch.float32)
    cfg = AutoConfig.from_pretrained(qc.float_checkpoint("llama", rope_scaling=True))
    assert cfg.rope_parameters["rope_type"] == "llama3"
    ref = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    ref.load_state_dict(from_gguf.state_dict())
    ref_dir = d.parent / "llama-gguf-Q4_K-llama3-ref"
    if not ref_dir.is_dir():
        ref.save_pretrained(ref_dir)
    runner = check_against_reference(d / "model.gguf", ref_dir, gguf=False, seed=_seed())
    assert runner.arch.rope_scaling["rope_type"] == "freq_factors"


@pytest.mark.parametrize(("kind", "arch"), GGUF_CASES)
def test_gguf_matches_transformers(kind: str, arch: str) -> None:
    d = _gguf(arch, kind)
    runner = check_against_reference(d / "model.gguf", d, gguf=True, seed=_seed())
    assert runner.model.model.layers[0].mlp.down_proj.qweight is not None
