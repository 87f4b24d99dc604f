"""Tiny random-weight checkpoints of each supported architecture, built with transformers' own
config classes and a locally trained byte-level BPE tokenizer. Built once per test session into a
temporary folder (removed at exit)."""

from __future__ import annotations

import atexit
import functools
import os
import shutil
import tempfile
from pathlib import Path

ARCHS = ("llama", "mistral", "qwen2", "qwen3")
# Mixture-of-experts families: several experts, top-k > 1, dense and MoE layers mixed.
MOE_ARCHS = ("qwen3_moe", "qwen2_moe", "mixtral")
# Hybrid linear-attention families (models/qwen3_next.py): Gated DeltaNet layers and a gated
# full attention every few layers; qwen3_5_vl is the vision-language layout of qwen3_5.
HYBRID_ARCHS = ("qwen3_5", "qwen3_5_moe", "qwen3_next", "qwen3_5_vl")

# Small on purpose: the whole model suite must run in well under a minute on 2 CPU cores.
TINY = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
)

# The hybrid families' Gated DeltaNet shapes, and their experts (with a shared expert).
GDN = dict(
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=16,
    linear_value_head_dim=16,
)
HYBRID_MOE = dict(
    num_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
    shared_expert_intermediate_size=48,
)

# What makes each checkpoint exercise its architecture's distinct feature.
ARCH_OVERRIDES: dict[str, dict] = {
    # llama3 rope scaling (Llama 3.1); original context below the test lengths' scale
    "llama": dict(
        tie_word_embeddings=False,
        rope_parameters={
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
    ),
    # a plain config (its sliding window is longer than any test sequence)
    "mistral": dict(tie_word_embeddings=False, sliding_window=256),
    # qkv bias (always on for qwen2) and tied embeddings
    "qwen2": dict(tie_word_embeddings=True),
    # q/k RMSNorm per head; head_dim different from hidden/heads, as in real Qwen3
    "qwen3": dict(tie_word_embeddings=False, head_dim=32),
    # top-3 of 8, renormalised (as the released models); layer 1 dense (mlp_only_layers)
    "qwen3_moe": dict(
        tie_word_embeddings=False,
        head_dim=32,
        num_hidden_layers=3,
        num_experts=8,
        num_experts_per_tok=3,
        moe_intermediate_size=32,
        norm_topk_prob=True,
        mlp_only_layers=[1],
        decoder_sparse_step=1,
    ),
    # top-2 of 6 without renormalisation, a shared expert behind its sigmoid gate; qkv bias;
    # decoder_sparse_step 2: layers 1 and 3 sparse, 0 and 2 dense
    "qwen2_moe": dict(
        tie_word_embeddings=False,
        num_hidden_layers=4,
        num_experts=6,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=48,
        norm_topk_prob=False,
        decoder_sparse_step=2,
        mlp_only_layers=[],
    ),
    # Gated DeltaNet with 2 key heads and 4 value heads (value head h reads key head h // 2),
    # full attention at layers 2 (layer_types) and 3; head_dim 32 with partial rotary 0.25
    "qwen3_5": dict(
        tie_word_embeddings=False,
        head_dim=32,
        num_hidden_layers=4,
        layer_types=["linear_attention", "linear_attention", "full_attention", "full_attention"],
        **GDN,
    ),
    # fused in_proj_qkvz / in_proj_ba; MoE with a shared expert (top-2 of 4, renormalised)
    # in every layer; tied embeddings; full_attention_interval 2
    "qwen3_next": dict(
        tie_word_embeddings=True,
        head_dim=32,
        num_hidden_layers=4,
        full_attention_interval=2,
        norm_topk_prob=True,
        decoder_sparse_step=1,
        **HYBRID_MOE,
        **GDN,
    ),
    # every layer MoE with a shared expert (top-2 of 4, always renormalised); no dense MLP
    "qwen3_5_moe": dict(
        tie_word_embeddings=False,
        head_dim=32,
        num_hidden_layers=4,
        **HYBRID_MOE,
        **GDN,
    ),
    # the vision-language layout (model.language_model., a vision tower that is skipped)
    "qwen3_5_vl": dict(tie_word_embeddings=False, head_dim=32, num_hidden_layers=4, **GDN),
    # top-2 of 4, softmax then top-k then renormalise; block_sparse_moe.experts.N.w1/w2/w3
    "mixtral": dict(
        tie_word_embeddings=False,
        num_local_experts=4,
        num_experts_per_tok=2,
        intermediate_size=64,
    ),
}


@functools.cache
def _root() -> Path:
    d = Path(tempfile.mkdtemp(prefix="voltserve-ckpt-"))
    owner = os.getpid()

    def remove() -> None:
        # Only the process that made it: a forked child that exits normally runs atexit too.
        if os.getpid() == owner:
            shutil.rmtree(d, ignore_errors=True)

    atexit.register(remove)
    return d


@functools.cache
def tokenizer():
    from voltserve.services.executor.demo_model import build_tokenizer

    return build_tokenizer(vocab_size=384)


@functools.cache
def checkpoint(arch: str, shard_size: str | None = None) -> Path:
    """Folder of a tiny `arch` checkpoint (cached per session; do not modify it)."""
    from voltserve.services.executor.demo_model import write_checkpoint

    name = arch + (f"-sharded-{shard_size}" if shard_size else "")
    overrides = dict(TINY)
    overrides.update(ARCH_OVERRIDES[arch])
    return write_checkpoint(
        _root() / name,
        arch=arch,
        size="tiny",
        seed=(ARCHS + MOE_ARCHS + HYBRID_ARCHS).index(arch) + 1,
        tokenizer=tokenizer(),
        shard_size=shard_size,
        **overrides,
    )


def limits(arch: str, max_model_len: int | None = None):
    """The ModelLimits an executor serving `arch`'s checkpoint publishes (for tests of the
    renderer and gateway without one): its context (capped at a sliding window), the loader's
    eos ids, its vocabulary."""
    import json

    from voltserve.services.executor.loader import read_eos_token_ids
    from voltserve.shared.model_limits import ModelLimits

    path = checkpoint(arch)
    cfg = json.loads((path / "config.json").read_text())
    n = max_model_len or cfg["max_position_embeddings"]
    n = min(n, cfg.get("sliding_window") or n)
    return ModelLimits(n, tuple(read_eos_token_ids(path)), cfg["vocab_size"])


def copy_checkpoint(arch: str, dest: Path) -> Path:
    """A private copy to break on purpose (loader error tests)."""
    shutil.copytree(checkpoint(arch), dest)
    return dest


def greedy_tokens(model, prompt: list[int], n: int) -> list[int]:
    """n greedy tokens of a loaded transformers model after prompt (eos ignored, as ignore_eos)."""
    import torch

    ids = torch.tensor([prompt], device=model.device)
    with torch.no_grad():
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=n,
            min_new_tokens=n,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )
    return out[0, len(prompt) :].tolist()


def hf_model_class(path):
    """The transformers class that loads a checkpoint folder: its vision-language class for
    that layout (AutoModelForCausalLM would build the text model alone and drop the
    model.language_model. weights), else AutoModelForCausalLM."""
    import json

    import transformers

    archs = json.loads((Path(path) / "config.json").read_text()).get("architectures") or []
    if archs and archs[0].endswith("ForConditionalGeneration"):
        return getattr(transformers, archs[0])
    return transformers.AutoModelForCausalLM


def hf_greedy(path, prompt: list[int], n: int, device: str = "cpu", dtype=None):
    """transformers greedy: the n tokens and the raw logits [n, V] (fp32) of each step."""
    import torch

    dtype = dtype or torch.float32
    model = hf_model_class(path).from_pretrained(path, dtype=dtype).to(device)
    model.generation_config.eos_token_id = None  # run the full length, as ignore_eos does
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt], device=device),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long, device=device),
            max_new_tokens=n,
            do_sample=False,
            output_logits=True,
            return_dict_in_generate=True,
            pad_token_id=0,
        )
    return out.sequences[0, len(prompt) :].tolist(), torch.cat(out.logits).float().cpu()


def drive(runner, reqs, max_new: int, chunk: int) -> None:
    """A minimal engine loop over a ModelRunner: fixed disjoint blocks, chunked prefill, decodes
    first. Each request collects its SampledTokens in `.trace`."""
    from voltserve.services.executor.request import ScheduledRequest, StepPlan

    per = -(-(max(r.num_tokens for r in reqs) + max_new) // runner.block_size)
    for i, r in enumerate(reqs):
        r.block_ids = list(range(i * per, (i + 1) * per))
        if runner.state_cache is not None:
            assert len(reqs) <= runner.state_cache.num_slots
            r.state_slot = i
        r.trace = []
        # As the engine sets it: the pipelined decode launches no step for rows that all end.
        r.max_output_tokens = max_new
    assert len(reqs) * per <= runner.num_kv_blocks
    while any(r.num_output_tokens < max_new for r in reqs):
        live = [r for r in reqs if r.num_output_tokens < max_new]
        live.sort(key=lambda r: r.num_tokens - r.num_computed_tokens)  # decodes first
        sched = [
            ScheduledRequest(r, min(chunk, r.num_tokens - r.num_computed_tokens)) for r in live
        ]
        plan = StepPlan(sched, sum(s.num_new_tokens for s in sched))
        sampled = iter(runner.execute(plan).sampled)
        for s in sched:
            samples = s.samples
            s.request.num_computed_tokens += s.num_new_tokens
            if samples:
                tok = next(sampled)
                s.request.output_token_ids.append(tok.token_id)
                s.request.trace.append(tok)
        assert next(sampled, None) is None
