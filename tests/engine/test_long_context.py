"""262,144-token contexts on the CPU: the rotary tables our config reading builds equal
transformers' own rotary embedding modules at positions up to 262,143 (llama3, YaRN with
original_max_position_embeddings, transformers 5's `rope_parameters` as Qwen configs write it,
and the keys transformers reads around them), and `--max-model-len 262144` is accepted where the
config and the KV budget allow it and refused, naming the numbers, where either does not."""

from __future__ import annotations

import json

import pytest
import torch
from voltserve.kernels.attention.rotary import build_cos_sin_cache
from voltserve.services.executor.loader import parse_arch
from voltserve.services.executor.model_runner import ModelRunner
from voltserve.shared.config import EngineConfig
from voltserve.shared.startup import StartupError

from tests.checkpoints import copy_checkpoint

LONG = 262144
LLAMA31_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}
# config.json fields as checkpoints ship them (rope_scaling: transformers 4.x's key;
# rope_parameters with the theta inside: transformers 5's), each with 262,144 positions.
ROPE_CONFIGS = {
    "llama3": ("llama", dict(rope_theta=500000.0, rope_scaling=LLAMA31_ROPE)),
    "yarn": (
        "qwen3",
        dict(
            rope_theta=1e6,
            rope_scaling={
                "rope_type": "yarn",
                "factor": 8.0,
                "original_max_position_embeddings": 32768,
            },
        ),
    ),
    "qwen-rope-parameters": (
        "qwen3",
        dict(
            rope_parameters={
                "rope_type": "yarn",
                "rope_theta": 1e6,
                "factor": 4.0,
                "original_max_position_embeddings": 65536,
            }
        ),
    ),
    # transformers takes a top-level original_max_position_embeddings over the rope dict's
    "yarn-top-level-original": (
        "qwen3",
        dict(
            rope_theta=1e6,
            original_max_position_embeddings=32768,
            rope_scaling={"rope_type": "yarn", "factor": 8.0},
        ),
    ),
    "yarn-no-truncate-mscale": (
        "qwen3",
        dict(
            rope_parameters={
                "rope_type": "yarn",
                "rope_theta": 1e6,
                "factor": 8.0,
                "original_max_position_embeddings": 32768,
                "truncate": False,
                "mscale": 1.0,
                "mscale_all_dim": 0.5,
            }
        ),
    ),
    # no original_max_position_embeddings at all: transformers takes max_position_embeddings
    "llama3-no-original": (
        "llama",
        dict(
            rope_theta=500000.0,
            rope_scaling={k: v for k, v in LLAMA31_ROPE.items() if "original" not in k},
        ),
    ),
}
ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen3": "Qwen3ForCausalLM"}


def hf_rotary(model_type: str, config):
    if model_type == "llama":
        from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

        return LlamaRotaryEmbedding(config=config)
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding

    return Qwen3RotaryEmbedding(config=config)


@pytest.mark.parametrize("name", sorted(ROPE_CONFIGS))
def test_rotary_table_equals_transformers_up_to_262143(name: str, rng) -> None:
    from transformers import AutoConfig

    model_type, rope = ROPE_CONFIGS[name]
    hf = dict(
        architectures=[ARCHITECTURES[model_type]],
        vocab_size=256,
        hidden_size=128,
        head_dim=64,  # Qwen3's config would default to 128
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        intermediate_size=64,
        max_position_embeddings=LONG,
        **rope,
    )
    arch = parse_arch(json.loads(json.dumps(hf)))  # as read from config.json
    assert arch.max_position_embeddings == LONG
    ours = build_cos_sin_cache(
        arch.rotary_dim, arch.max_position_embeddings, arch.rope_theta, arch.rope_scaling
    )
    assert ours.shape == (LONG, arch.rotary_dim)
    # The ends of the scaled ranges, the last position, and random ones between.
    edges = [0, 1, 8191, 8192, 32767, 32768, 65535, 65536, 131071, 131072, LONG - 1]
    positions = sorted(set(edges + [rng.randrange(LONG) for _ in range(53)]))
    pos = torch.tensor([positions])
    rot = hf_rotary(model_type, AutoConfig.for_model(model_type, **hf))
    cos, sin = rot(torch.zeros(1, dtype=torch.float32), pos)
    half = arch.rotary_dim // 2
    # transformers repeats the half-width table over the head; ours keeps one half of each.
    assert torch.equal(cos[0, :, half:], cos[0, :, :half])
    # Bit for bit: at position 262,143 an angle off by one fp32 rounding of the frequency
    # moves by up to ~0.016 rad, so anything short of equality would hide a wrong formula.
    assert torch.equal(ours[pos[0], :half], cos[0, :, :half]), name
    assert torch.equal(ours[pos[0], half:], sin[0, :, :half]), name


def _long_llama(tmp_path, max_positions: int):
    """The tiny llama checkpoint (llama3 rope) with max_position_embeddings rewritten."""
    d = copy_checkpoint("llama", tmp_path / f"llama-{max_positions}")
    cfg = json.loads((d / "config.json").read_text())
    cfg["max_position_embeddings"] = max_positions
    (d / "config.json").write_text(json.dumps(cfg))
    return d


def test_max_model_len_262144_accepted_where_config_and_budget_allow(tmp_path) -> None:
    d = _long_llama(tmp_path, LONG)
    r = ModelRunner(EngineConfig(model=str(d), max_model_len=LONG))
    assert r.max_model_len == LONG
    assert r.num_kv_blocks * r.block_size >= LONG
    assert r.model.cos_sin_cache.shape[0] == LONG


def test_max_model_len_past_the_config_is_refused_with_the_numbers(tmp_path) -> None:
    d = _long_llama(tmp_path, 131072)
    with pytest.raises(ValueError, match="max_model_len 262144 exceeds .*131072"):
        ModelRunner(EngineConfig(model=str(d), max_model_len=LONG))


def test_max_model_len_past_the_kv_budget_is_refused_with_the_numbers(tmp_path) -> None:
    d = _long_llama(tmp_path, LONG)
    # A budget of 8,192 blocks (the tiny model's 8 KiB blocks: 2 layers x K, V x 2 heads x 16
    # tokens x 16 dims x 4 bytes), 131,072 tokens: half the context asked for.
    budget = 8192 * 8192
    with pytest.raises(StartupError) as e:
        ModelRunner(EngineConfig(model=str(d), max_model_len=LONG, cpu_kv_cache_bytes=budget))
    msg = str(e.value)
    assert "fits 8192 blocks (131072 tokens, 8192 bytes a block)" in msg
    assert "max_model_len 262144" in msg and "--kv-cache-dtype fp8_e5m2" in msg
    # Without --max-model-len the CPU engine takes the model's length capped at its cache.
    r = ModelRunner(EngineConfig(model=str(d), cpu_kv_cache_bytes=budget))
    assert r.max_model_len == LONG and r.num_kv_blocks == 8192
