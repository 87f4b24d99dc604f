"""Small helpers shared by the benchmarks: model presets, random-weight checkpoints, the HBM copy
bandwidth that anchors every roofline number, environment info and JSON output.

Run as a script to write a checkpoint once and reuse it across benchmarks:
    python load_tests/common.py make-checkpoint --preset llama3-8b --out /tmp/llama3-8b --device cuda
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import re
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

logger = logging.getLogger(__name__)

REPO_ROOT = Path(__file__).resolve().parent.parent

# Shapes of the benchmarked models (random weights: speed depends on shape, not on values).
PRESETS: dict[str, dict[str, Any]] = {
    "llama3-8b": dict(
        model_type="llama",
        architectures=["LlamaForCausalLM"],
        hidden_size=4096,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        intermediate_size=14336,
        vocab_size=128256,
        rope_theta=500000.0,
        max_position_embeddings=8192,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        bos_token_id=128000,
        eos_token_id=128001,
    ),
    # A speculative draft for llama3-8b: Llama-3.2-1B's shape, the same vocabulary and ids (so
    # write_random_checkpoint gives it the same synthetic tokenizer).
    "llama3.2-1b": dict(
        model_type="llama",
        architectures=["LlamaForCausalLM"],
        hidden_size=2048,
        num_hidden_layers=16,
        num_attention_heads=32,
        num_key_value_heads=8,
        intermediate_size=8192,
        vocab_size=128256,
        rope_theta=500000.0,
        max_position_embeddings=8192,
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
        bos_token_id=128000,
        eos_token_id=128001,
    ),
    "qwen2.5-0.5b": dict(
        model_type="qwen2",  # Qwen2 always has q/k/v bias
        architectures=["Qwen2ForCausalLM"],
        hidden_size=896,
        num_hidden_layers=24,
        num_attention_heads=14,
        num_key_value_heads=2,
        intermediate_size=4864,
        vocab_size=151936,
        rope_theta=1000000.0,
        max_position_embeddings=32768,
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
        bos_token_id=151643,
        eos_token_id=151643,
    ),
    # Qwen3-0.6B's shape: per-head q/k RMSNorm (the fused qk_norm_rope kernel's path), head_dim
    # 128 over a 1024-wide hidden state, tied embeddings; launch-bound like the 0.5B.
    "qwen3-0.6b": dict(
        model_type="qwen3",
        architectures=["Qwen3ForCausalLM"],
        hidden_size=1024,
        head_dim=128,
        num_hidden_layers=28,
        num_attention_heads=16,
        num_key_value_heads=8,
        intermediate_size=3072,
        vocab_size=151936,
        rope_theta=1000000.0,
        max_position_embeddings=40960,
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
        bos_token_id=151643,
        eos_token_id=151645,
    ),
    # Qwen2.5-7B's shape: a 152,064-token vocabulary (padded past the tokenizer's 151,665),
    # intermediate 18,944 (148 groups of 128), 28 heads over 4 KV heads of 128, qkv bias.
    "qwen2.5-7b": dict(
        model_type="qwen2",
        architectures=["Qwen2ForCausalLM"],
        hidden_size=3584,
        num_hidden_layers=28,
        num_attention_heads=28,
        num_key_value_heads=4,
        intermediate_size=18944,
        vocab_size=152064,
        rope_theta=1000000.0,
        max_position_embeddings=32768,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        bos_token_id=151643,
        eos_token_id=151645,
    ),
    # Qwen3.5-27B's shape (hybrid: three Gated DeltaNet layers to one gated full-attention
    # layer; 16 key / 48 value heads of 128 with a 128 x 128 fp32 state each; 24 query heads
    # over 4 KV heads of 256 with partial rotary; a 248,320-token vocabulary). bos / eos are
    # in-vocabulary ids for the synthetic tokenizer (random weights: their values do not matter).
    # At 64 layers it is 54 GB in fp16: benchmarks write fewer (--layers, e.g. 16, which keeps
    # the 3:1 pattern) and say so.
    "qwen3.5-27b": dict(
        model_type="qwen3_5_text",
        architectures=["Qwen3_5ForCausalLM"],
        hidden_size=5120,
        num_hidden_layers=64,
        num_attention_heads=24,
        num_key_value_heads=4,
        head_dim=256,
        intermediate_size=17408,
        vocab_size=248320,
        linear_num_key_heads=16,
        linear_num_value_heads=48,
        linear_key_head_dim=128,
        linear_value_head_dim=128,
        linear_conv_kernel_dim=4,
        rope_parameters=dict(
            rope_type="default", rope_theta=10000000.0, partial_rotary_factor=0.25
        ),
        max_position_embeddings=262144,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        bos_token_id=248044,
        eos_token_id=248046,
    ),
    # Qwen3.5-35B-A3B's shape: the text_config of the published config.json
    # (huggingface.co/Qwen/Qwen3.5-35B-A3B/blob/main/config.json), read from copies of it:
    # transformers' Qwen3_5MoeTextConfig, whose defaults are documented as that checkpoint's,
    # gives every width; third-party transcriptions of the file (snapshot ec2d4ece) agree and
    # add what the defaults lack: rope theta 1e7, max_position_embeddings 262,144 (the class
    # says 32,768), mtp_num_hidden_layers 1; the model card's table agrees (40 layers as
    # 10 x (3 Gated DeltaNet + 1 gated attention), 256 experts of 512, 8 routed + 1 shared).
    # So: 16 key / 32 value heads of 128; 16 query heads over 2 KV heads of 256, partial rotary
    # 0.25 (the published mrope_section matters for images only); every layer sparse, a shared
    # expert of 512 behind a sigmoid gate; a 248,320-token vocabulary, untied lm_head. bos / eos
    # as for qwen3.5-27b; the MTP layer is write_random_mtp's, where a benchmark asks for it.
    # 34.7B parameters, 69 GB in fp16: benchmarks write fewer layers (--layers 8 keeps the 3:1
    # pattern: 6 GDN, 2 full attention) and say so. Its checkpoints hold the experts one by one
    # (mlp.experts.E.gate_proj / up_proj / down_proj), as transformers saves them and as the
    # published int4 checkpoints quantize them.
    "qwen3.5-35b-a3b": dict(
        model_type="qwen3_5_moe_text",
        architectures=["Qwen3_5MoeForCausalLM"],
        hidden_size=2048,
        num_hidden_layers=40,
        num_attention_heads=16,
        num_key_value_heads=2,
        head_dim=256,
        vocab_size=248320,
        linear_num_key_heads=16,
        linear_num_value_heads=32,
        linear_key_head_dim=128,
        linear_value_head_dim=128,
        linear_conv_kernel_dim=4,
        num_experts=256,
        num_experts_per_tok=8,
        moe_intermediate_size=512,
        shared_expert_intermediate_size=512,
        rope_parameters=dict(
            rope_type="default", rope_theta=10000000.0, partial_rotary_factor=0.25
        ),
        max_position_embeddings=262144,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        bos_token_id=248044,
        eos_token_id=248046,
    ),
    # A hybrid of the Qwen3.5 kind at CPU-test size (the benchmarks' hybrid paths end to end).
    "tiny-hybrid": dict(
        model_type="qwen3_5_text",
        architectures=["Qwen3_5ForCausalLM"],
        hidden_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        intermediate_size=128,
        vocab_size=512,
        linear_num_key_heads=4,
        linear_num_value_heads=8,  # in_proj_b / in_proj_a: 8 outputs, one AWQ word
        linear_key_head_dim=16,
        linear_value_head_dim=16,
        linear_conv_kernel_dim=4,
        max_position_embeddings=2048,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
    ),
    # The Qwen3.5-MoE hybrid at CPU-test size: tiny-hybrid's widths with every layer sparse
    # (8 experts of 32, 2 a token, a shared expert of 32; each width one AWQ group of 32).
    "tiny-hybrid-moe": dict(
        model_type="qwen3_5_moe_text",
        architectures=["Qwen3_5MoeForCausalLM"],
        hidden_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        vocab_size=512,
        linear_num_key_heads=4,
        linear_num_value_heads=8,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
        linear_conv_kernel_dim=4,
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=32,
        max_position_embeddings=2048,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
    ),
    "tiny": dict(
        model_type="llama",
        architectures=["LlamaForCausalLM"],
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=128,
        vocab_size=512,
        rope_theta=10000.0,
        max_position_embeddings=2048,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
    ),
}


def make_hf_config(preset: str, dtype: torch.dtype = torch.float16, **overrides: Any):
    """The transformers config of a preset; overrides replace its fields (e.g.
    num_hidden_layers=2: the preset's widths with fewer layers)."""
    from transformers import AutoConfig

    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose from {sorted(PRESETS)}")
    kw = dict(PRESETS[preset]) | overrides
    model_type = kw.pop("model_type")
    config = AutoConfig.for_model(model_type, **kw)
    config.dtype = dtype
    return config


# ---------------------------------------------------------------------------------------------
# Devices and dtypes


def resolve_device(device: str) -> str:
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise RuntimeError(f"--device {device} asked for, but torch sees no CUDA device")
    return device


def resolve_dtype(dtype: str, device: str) -> torch.dtype:
    if dtype == "auto":
        return torch.float16 if device.startswith("cuda") else torch.float32
    table = {"float16": torch.float16, "fp16": torch.float16, "half": torch.float16}
    table |= {"float32": torch.float32, "fp32": torch.float32, "float": torch.float32}
    table |= {"bfloat16": torch.bfloat16, "bf16": torch.bfloat16}
    if dtype not in table:
        raise ValueError(f"unknown dtype {dtype!r}")
    return table[dtype]


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def synchronize(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


# ---------------------------------------------------------------------------------------------
# Memory bandwidth


def measure_copy_bandwidth(
    device: str, nbytes: int | None = None, warmup: int = 5, iters: int = 30
) -> dict[str, Any]:
    """Device-to-device copy bandwidth: (bytes read + bytes written) / time, median of `iters`.

    This is what a memory-bound kernel can hope for on this card, measured in the same run as
    the numbers it anchors (a spec-sheet figure would flatter every ratio)."""
    if nbytes is None:
        nbytes = 4 << 30 if device.startswith("cuda") else 64 << 20
    n = nbytes // 2
    src = torch.empty(n, dtype=torch.float16, device=device).normal_()
    dst = torch.empty_like(src)
    times: list[float] = []
    if device.startswith("cuda"):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        for i in range(warmup + iters):
            start.record()
            dst.copy_(src)
            end.record()
            end.synchronize()
            if i >= warmup:
                times.append(start.elapsed_time(end) / 1e3)
    else:
        for i in range(warmup + iters):
            t0 = time.perf_counter()
            dst.copy_(src)
            if i >= warmup:
                times.append(time.perf_counter() - t0)
    if not torch.equal(dst[:1024], src[:1024]):
        raise RuntimeError("copy bandwidth probe: destination differs from source")
    moved = 2 * src.numel() * src.element_size()
    t = statistics.median(times)
    del src, dst
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
    return {
        "buffer_bytes": n * 2,
        "iters": iters,
        "median_s": t,
        "min_s": min(times),
        "bandwidth_GBps": moved / t / 1e9,
        "peak_bandwidth_GBps": moved / min(times) / 1e9,
    }


# ---------------------------------------------------------------------------------------------
# Weight and KV byte counts (the roofline floors)


# A routed expert's tensor in a checkpoint (model.layers.N.mlp.experts.E.up_proj.weight, or its
# qweight / scales / qzeros; the MTP layers' experts too), or a fused stack of them.
ROUTED_EXPERT = re.compile(r"\.mlp\.experts\.(\d+\.|gate_up_proj$|down_proj$)")


def weight_bytes(config, dtype: torch.dtype) -> dict[str, int]:
    """Bytes of the weights one decode step reads: every layer, the final norm and the lm_head.
    The input embedding is a gather of a few rows, so it is left out unless it is tied to the
    lm_head (then the lm_head reads it in full). An MoE model's step at batch 1 reads k of the
    E routed experts of a layer (moe_read_bytes)."""
    with torch.device("meta"):
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    size = torch.tensor([], dtype=dtype).element_size()
    total = embed = experts = 0
    for name, shape in checkpoint_tensors(model):  # tied parameters appear once
        nbytes = shape.numel() * size
        total += nbytes
        if name.endswith("embed_tokens.weight"):
            embed = nbytes
        elif ROUTED_EXPERT.search(name):
            experts += nbytes
    tied = bool(getattr(config, "tie_word_embeddings", False))
    read = total if tied else total - embed
    out = {"total_bytes": total, "embedding_bytes": embed, "read_per_token_bytes": read}
    return out | moe_read_bytes(read, experts, config.to_dict())


def moe_read_bytes(read: int, expert_bytes: int, cfg: dict[str, Any]) -> dict[str, int]:
    """The batch-1 figures of weight_bytes and checkpoint_read_bytes for an MoE model: `read`
    counts every tensor a step reads, `expert_bytes` of routed experts among them, but a token
    is routed to k of each layer's E experts, so a step at batch 1 reads k/E of those. `cfg`:
    the config dict (a vision-language layout's text_config is looked into). A model without
    routed experts keeps `read`; an MoE model's dict also holds routed_expert_bytes, num_experts
    and experts_per_token, from which step_weight_bytes counts a batch's step."""
    cfg = cfg.get("text_config") or cfg
    E = cfg.get("num_experts") or cfg.get("num_local_experts") or 0
    k = cfg.get("num_experts_per_tok") or 0
    if not expert_bytes or not E:
        return {"read_per_token_bytes": read}
    return {
        "read_per_token_bytes": read - expert_bytes * (E - k) // E,
        "routed_expert_bytes": expert_bytes,
        "num_experts": E,
        "experts_per_token": k,
    }


def step_weight_bytes(wbytes: dict[str, int], batch: int) -> float:
    """The weight bytes one decode step of `batch` sequences reads, from weight_bytes' (or
    checkpoint_read_bytes') dict: read_per_token_bytes, and for an MoE model the routed experts
    that `batch` tokens touch beyond batch 1's k a layer, E * (1 - (1 - k/E)^B) distinct ones
    under uniform routing."""
    E = wbytes.get("num_experts")
    if not E:
        return wbytes["read_per_token_bytes"]
    k = wbytes["experts_per_token"]
    distinct = E * (1.0 - (1.0 - k / E) ** batch)
    return wbytes["read_per_token_bytes"] + wbytes["routed_expert_bytes"] * (distinct - k) / E


def attention_layers(config) -> int:
    """Layers that keep a KV cache: all of them, or a hybrid model's full-attention ones."""
    types = getattr(config, "layer_types", None)
    if not types:
        return config.num_hidden_layers
    return sum(t == "full_attention" for t in types)


def kv_bytes_per_element(kv: str, run_dtype: torch.dtype) -> int:
    """Bytes of one cached K or V element under --kv-cache-dtype `kv`: one for the fp8 formats,
    two for fp16, the run dtype's for auto."""
    from voltserve.shared.config import KV_CACHE_DTYPES

    if kv not in KV_CACHE_DTYPES:
        raise ValueError(f"kv cache dtype {kv!r}: not one of {KV_CACHE_DTYPES}")
    if kv.startswith("fp8"):
        return 1
    return 2 if kv == "fp16" else torch.empty((), dtype=run_dtype).element_size()


def kv_bytes_per_token(config, dtype: torch.dtype) -> int:
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    size = torch.tensor([], dtype=dtype).element_size()
    return 2 * attention_layers(config) * config.num_key_value_heads * head_dim * size


def state_bytes_per_sequence(config, dtype: torch.dtype) -> int:
    """A hybrid model's recurrent state per sequence (0 for others): per Gated DeltaNet layer the
    fp32 state (value heads x key dim x value dim) and the conv state (the q, k and v channels x
    kernel - 1 positions, in the run dtype). A decode step reads and writes it once."""
    types = getattr(config, "layer_types", None) or []
    n = sum(t == "linear_attention" for t in types)
    if not n:
        return 0
    hk, hv = config.linear_num_key_heads, config.linear_num_value_heads
    dk, dv = config.linear_key_head_dim, config.linear_value_head_dim
    size = torch.tensor([], dtype=dtype).element_size()
    conv = (2 * hk * dk + hv * dv) * (config.linear_conv_kernel_dim - 1) * size
    return n * (hv * dk * dv * 4 + conv)


# ---------------------------------------------------------------------------------------------
# Random-weight checkpoints


def write_synthetic_tokenizer(out: Path, vocab_size: int, bos_id: int, eos_id: int) -> None:
    """A word-level tokenizer covering every id, so a random-weight checkpoint can be served
    (the gateway detokenizes) and fed text prompts. Token i is spelled `t{i}`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {f"t{i}": i for i in range(vocab_size)}
    names = {bos_id: "<s>", eos_id: "</s>"}
    for i, name in names.items():
        del vocab[f"t{i}"]
        vocab[name] = i
    unk = names[eos_id]
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=unk))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)  # joins words with spaces
    tok.save(str(out / "tokenizer.json"))
    cfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": names[bos_id],
        "eos_token": names[eos_id],
        "unk_token": unk,
        "model_max_length": 1 << 20,
        "add_bos_token": False,
        "clean_up_tokenization_spaces": False,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2))


def write_text_tokenizer(
    out: Path, vocab_size: int, bos_id: int, eos_id: int, seed: int = 0
) -> None:
    """A word-level tokenizer whose tokens spell pieces of text, for grammar-constrained runs of a
    random-weight checkpoint: a grammar engine (xgrammar) builds JSON, regexes and choices from
    the tokens' strings, which `write_synthetic_tokenizer`'s `t{i}` names cannot spell. Tokens:
    every printable ASCII character and whitespace, runs of JSON punctuation, digit groups,
    whitespace runs, then random lowercase words (with and without a leading space, quote or
    colon) up to vocab_size, like a subword vocabulary's mix. Prompts are token ids; the
    word-level decoder joins tokens with spaces, so decoded text is not meant to be read."""
    import random

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    rng = random.Random(seed)
    pieces: list[str] = [chr(c) for c in range(32, 127)] + ["\n", "\t", "\r"]
    pieces += [
        '{"',
        '":',
        '",',
        '"}',
        '":"',
        '","',
        "},",
        "[{",
        "}]",
        "],",
        '": ',
        ', "',
        "true",
        "false",
        "null",
    ]
    pieces += [str(i) for i in range(10, 1000)]
    pieces += [" " * n for n in range(2, 17)] + ["\n" + " " * n for n in range(1, 17)]
    seen = set(pieces)
    assert len(seen) == len(pieces), "duplicate base pieces"
    letters = "abcdefghijklmnopqrstuvwxyz"
    prefixes = ["", " ", '"', ' "']
    while len(pieces) < vocab_size:
        w = rng.choice(prefixes) + "".join(rng.choice(letters) for _ in range(rng.randint(2, 9)))
        if w not in seen:
            seen.add(w)
            pieces.append(w)
    vocab = {w: i for i, w in enumerate(pieces[:vocab_size])}
    names = {bos_id: "<s>", eos_id: "</s>"}
    inv = {i: w for w, i in vocab.items()}
    for i, name in names.items():
        del vocab[inv[i]]
        vocab[name] = i
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=names[eos_id]))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)
    tok.save(str(out / "tokenizer.json"))
    cfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": names[bos_id],
        "eos_token": names[eos_id],
        "unk_token": names[eos_id],
        "model_max_length": 1 << 20,
        "add_bos_token": False,
        "clean_up_tokenization_spaces": False,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2))


def with_text_tokenizer(model_dir: Path) -> Path:
    """A sibling folder `<model_dir>-texttok`: the same weights and configs (symlinks) with
    `write_text_tokenizer`'s tokenizer, for structured-output runs of a random checkpoint."""
    model_dir = Path(model_dir)
    out = model_dir.with_name(model_dir.name + "-texttok")
    out.mkdir(parents=True, exist_ok=True)
    for f in model_dir.iterdir():
        if f.name.startswith("tokenizer") or f.name == "special_tokens_map.json":
            continue
        link = out / f.name
        if link.is_symlink() or link.exists():
            link.unlink()
        link.symlink_to(f.resolve())
    cfg = json.loads((model_dir / "config.json").read_text())
    eos = cfg.get("eos_token_id")
    eos = eos[0] if isinstance(eos, list) else eos
    bos = cfg.get("bos_token_id")
    bos = 0 if bos is None or bos == eos else bos
    write_text_tokenizer(out, cfg["vocab_size"], bos, eos)
    return out


def checkpoint_tensors(model) -> list[tuple[str, torch.Size]]:
    """(name, shape) of every tensor a checkpoint of the transformers `model` holds, in the
    published layout: transformers keeps an MoE layer's routed experts stacked
    (mlp.experts.gate_up_proj [E, 2I, H], mlp.experts.down_proj [E, H, I]) and saves them one by
    one (mlp.experts.E.gate_proj.weight [I, H], up_proj [I, H], down_proj [H, I]), the layout
    the loader stacks again and make_awq_checkpoint.py quantizes. Tied parameters appear once."""
    out: list[tuple[str, torch.Size]] = []
    for name, p in model.named_parameters():
        stem, _, leaf = name.rpartition(".")
        if not (stem.endswith(".experts") and p.dim() == 3 and leaf.endswith("_proj")):
            out.append((name, p.shape))
            continue
        E, n, k = p.shape
        if leaf == "gate_up_proj" and n % 2 == 0:
            parts = [("gate_proj", n // 2), ("up_proj", n // 2)]
        elif leaf == "down_proj":
            parts = [("down_proj", n)]
        else:
            raise ValueError(f"{name} {tuple(p.shape)}: not a stacked expert layout this knows")
        for e in range(E):
            out += [(f"{stem}.{e}.{part}.weight", torch.Size((rows, k))) for part, rows in parts]
    return out


def write_random_checkpoint(
    out: str | Path,
    preset: str,
    device: str = "auto",
    dtype: torch.dtype = torch.float16,
    seed: int = 0,
    shard_bytes: int = 4 << 30,
    overrides: dict[str, Any] | None = None,
) -> Path:
    """Write a Hugging Face folder (config, generation config, safetensors shards, tokenizer) with
    random weights of a preset's shape. Tensors are drawn on `device` (fast on a GPU) and saved
    shard by shard, so host memory holds one shard at a time. Llama-3-8B: ~16 GB on disk.
    overrides: config fields that replace the preset's (make_hf_config), recorded in the marker
    so that checkpoint_matches tells the two apart."""
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, GenerationConfig

    device = resolve_device(device)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    overrides = dict(overrides or {})
    config = make_hf_config(preset, dtype, **overrides)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    gen = torch.Generator(device=device).manual_seed(seed)

    def draw(name: str, shape: torch.Size) -> torch.Tensor:
        t = torch.empty(shape, dtype=dtype, device=device)
        if name.endswith("norm.weight"):
            # Norm scales near 1 keep activations of a deep random model finite in fp16.
            return t.uniform_(0.9, 1.1, generator=gen).cpu()
        return t.normal_(0.0, 0.02, generator=gen).cpu()

    shards: list[dict[str, torch.Size]] = [{}]
    size = 0
    element = torch.tensor([], dtype=dtype).element_size()
    # tied lm_head is not saved (as in real checkpoints); MoE experts one by one
    for name, shape in checkpoint_tensors(model):
        nbytes = shape.numel() * element
        if size and size + nbytes > shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = shape  # drawn when its shard is written
        size += nbytes
    weight_map: dict[str, str] = {}
    total = 0
    for i, shard in enumerate(shards):
        fname = (
            "model.safetensors"
            if len(shards) == 1
            else f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        )
        tensors = {name: draw(name, shape).contiguous() for name, shape in shard.items()}
        save_file(tensors, str(out / fname), metadata={"format": "pt"})
        for name, t in tensors.items():
            weight_map[name] = fname
            total += t.numel() * t.element_size()
        del tensors
    if len(shards) > 1:
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    config.save_pretrained(out)
    GenerationConfig(
        bos_token_id=config.bos_token_id, eos_token_id=config.eos_token_id
    ).save_pretrained(out)
    write_synthetic_tokenizer(out, config.vocab_size, config.bos_token_id, config.eos_token_id)
    marker = {"preset": preset, "seed": seed}
    if overrides:
        marker["overrides"] = overrides
    (out / "voltserve_preset.json").write_text(json.dumps(marker))
    return out


def write_random_mtp(
    model_dir: str | Path,
    config,
    device: str = "auto",
    dtype: torch.dtype = torch.float16,
    seed: int = 0,
    layers: int = 1,
) -> bool:
    """Add `layers` random multi-token-prediction layers to a hybrid checkpoint folder, in the
    published Qwen3.5 / Qwen3-Next layout (services/executor/spec/mtp_head.py): mtp.fc over
    [normed embedding; normed hidden], its norms, mtp.layers.i.* (a gated full-attention decoder
    layer of the target's widths, an MoE target's experts one by one) and mtp.norm, in a shard
    of their own (listed in the index of a sharded folder), float also in a quantized folder
    (the published AWQ checkpoints keep them so: modules_to_not_convert names "mtp"), and
    mtp_num_hidden_layers in config.json.
    `config`: the folder's transformers config. False when the folder already holds them."""
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    device = resolve_device(device)
    out = Path(model_dir)
    marker = out / "voltserve_mtp.json"
    want = {"layers": layers, "seed": seed}
    if marker.is_file() and json.loads(marker.read_text()) == want:
        return False
    types = list(getattr(config, "layer_types", None) or [])
    if "full_attention" not in types:
        raise ValueError("write_random_mtp needs a hybrid config with full-attention layers")
    # A decoder layer of the target's full-attention kind: names and shapes from a meta model of
    # the same widths, up to its first full-attention layer.
    first = types.index("full_attention")
    small = type(config).from_dict(
        {**config.to_dict(), "num_hidden_layers": first + 1, "layer_types": types[: first + 1]}
    )
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(small, dtype=dtype)
    stem = f"model.layers.{first}."
    layer = {n[len(stem) :]: shape for n, shape in checkpoint_tensors(model) if n.startswith(stem)}
    H = config.hidden_size
    gen = torch.Generator(device=device).manual_seed(seed)

    def draw(shape, std: float) -> torch.Tensor:
        return torch.empty(shape, dtype=dtype, device=device).normal_(0, std, generator=gen).cpu()

    tensors = {"mtp.fc.weight": draw((H, 2 * H), (2 * H) ** -0.5)}
    for norm in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
        tensors[f"mtp.{norm}.weight"] = draw((H,), 0.1)  # zero-centred: a scale near 1
    for i in range(layers):
        for name, shape in layer.items():
            std = 0.1 if name.endswith("norm.weight") else 0.02
            tensors[f"mtp.layers.{i}.{name}"] = draw(shape, std)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(out / "mtp.safetensors"))
    index = out / "model.safetensors.index.json"
    if index.is_file():
        data = json.loads(index.read_text())
        data["weight_map"].update(dict.fromkeys(tensors, "mtp.safetensors"))
        index.write_text(json.dumps(data, indent=1))
    cfg = json.loads((out / "config.json").read_text())
    cfg["mtp_num_hidden_layers"] = layers
    quant = cfg.get("quantization_config")
    if quant is not None:
        skip = list(quant.get("modules_to_not_convert") or [])
        quant["modules_to_not_convert"] = skip + ["mtp"] if "mtp" not in skip else skip
    (out / "config.json").write_text(json.dumps(cfg, indent=1))
    marker.write_text(json.dumps(want))
    return True


def gguf_checkpoint_files(path: Path) -> list[Path] | None:
    """The GGUF files of `path` (a .gguf file, or a folder holding one or a split set), else
    None."""
    from voltserve.shared.gguf_files import gguf_files

    return gguf_files(path)


def gguf_config(path: Path):
    """The transformers config of a GGUF checkpoint's shape, from its metadata (as the executor
    reads it): layers, heads, vocabulary."""
    from transformers import AutoConfig
    from voltserve.services.executor.gguf_source import GGUFSource

    cfg = dict(GGUFSource(path).config)
    return AutoConfig.for_model(cfg.pop("model_type"), **cfg)


def quantized_checkpoint(path: Path) -> bool:
    """True when `path` holds a checkpoint whose config.json names a quantization method (an
    AWQ folder from make_awq_checkpoint.py, say) or a GGUF file (make_gguf_checkpoint.py):
    benchmarks serve it as it is."""
    if gguf_checkpoint_files(path) is not None:
        return True
    cfg = path / "config.json"
    return cfg.exists() and "quantization_config" in json.loads(cfg.read_text())


def gguf_read_bytes(path: Path) -> dict[str, int]:
    """weight_bytes' figures counted from a GGUF checkpoint's tensor table: every tensor at the
    bytes the file stores (Q4_K / Q6_K blocks, F32 norms, the output head in its type), less
    token_embd unless the file has no output.weight (then the head reads the embedding)."""
    import gguf

    total = embed = 0
    names: set[str] = set()
    for f in gguf_checkpoint_files(path) or []:
        for t in gguf.GGUFReader(str(f)).tensors:
            total += int(t.n_bytes)
            names.add(t.name)
            if t.name == "token_embd.weight":
                embed = int(t.n_bytes)
    if not names:
        raise ValueError(f"{path}: no GGUF tensors")
    read = total if "output.weight" not in names else total - embed
    return {"total_bytes": total, "embedding_bytes": embed, "read_per_token_bytes": read}


def checkpoint_read_bytes(path: Path) -> dict[str, int]:
    """weight_bytes' figures counted from a checkpoint folder's safetensors headers (so packed
    codes, scales and zero points count at their stored size): every tensor, less the input
    embedding unless the config ties it to the lm_head, less the MTP layers (mtp.*, which a
    decode step without speculation does not run; write_random_mtp adds them to a folder), and
    for an MoE model only k of each layer's E routed experts (moe_read_bytes). A GGUF
    checkpoint: gguf_read_bytes."""
    import struct

    if gguf_checkpoint_files(path) is not None:
        return gguf_read_bytes(path)

    total = embed = experts = mtp = 0
    for f in sorted(path.glob("*.safetensors")):
        with f.open("rb") as fh:
            (n,) = struct.unpack("<Q", fh.read(8))
            header = json.loads(fh.read(n))
        for name, meta in header.items():
            if name == "__metadata__":
                continue
            nbytes = meta["data_offsets"][1] - meta["data_offsets"][0]
            total += nbytes
            if name.startswith("mtp."):
                mtp += nbytes
            elif name.endswith("embed_tokens.weight"):
                embed = nbytes
            elif ROUTED_EXPERT.search(name):
                experts += nbytes
    cfg = json.loads((path / "config.json").read_text())
    read = (total if cfg.get("tie_word_embeddings") else total - embed) - mtp
    out = {"total_bytes": total, "embedding_bytes": embed, "read_per_token_bytes": read}
    if mtp:
        out["mtp_bytes"] = mtp
    return out | moe_read_bytes(read, experts, cfg)


def checkpoint_matches(path: Path, preset: str, overrides: dict[str, Any] | None = None) -> bool:
    """True when `path` holds a checkpoint written by write_random_checkpoint for `preset` with
    exactly these config overrides (none: the preset as it is)."""
    marker = path / "voltserve_preset.json"
    if not (path / "config.json").exists() or not marker.exists():
        return False
    m = json.loads(marker.read_text())
    return m.get("preset") == preset and m.get("overrides", {}) == (overrides or {})


# ---------------------------------------------------------------------------------------------
# Environment and output


def git_commit() -> str | None:
    if os.environ.get("VOLTSERVE_COMMIT"):
        return os.environ["VOLTSERVE_COMMIT"]
    try:
        r = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=REPO_ROOT, capture_output=True, text=True, timeout=10
        )
        if r.returncode != 0:
            return None
        return r.stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def git_dirty() -> bool | None:
    """Whether the working tree differs from the commit (None when git is unavailable)."""
    try:
        r = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=REPO_ROOT,
            capture_output=True,
            text=True,
            timeout=10,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return bool(r.stdout.strip()) if r.returncode == 0 else None


def env_info(device: str | None = None) -> dict[str, Any]:
    import transformers

    info: dict[str, Any] = {
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "host": platform.node(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "cuda_runtime": torch.version.cuda,
        "git_commit": git_commit(),
        "git_dirty": git_dirty(),
        "argv": sys.argv,
        "cpu_count": os.cpu_count(),
    }
    if device and device.startswith("cuda"):
        idx = torch.device(device).index or 0
        prop = torch.cuda.get_device_properties(idx)
        info["device_name"] = prop.name
        info["device_capability"] = f"{prop.major}.{prop.minor}"
        info["device_memory_bytes"] = prop.total_memory
    else:
        info["device_name"] = platform.processor() or platform.machine()
    return info


def write_json(path: str | Path | None, data: dict[str, Any]) -> None:
    if not path:
        return
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2, default=str) + "\n")


def event_time_ms(fn: Callable[[], object], iters: int = 20, warmup: int = 2) -> float:
    """Median CUDA-event time of one eager call of fn, in ms (launch cost included)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def cell(x: Any, spec: str = ".2f") -> str:
    """A table cell: `x` formatted by `spec`, or "-" when it was not measured."""
    return "-" if x is None else format(x, spec)


def median(xs: list[float]) -> float | None:
    return statistics.median(xs) if xs else None


def add_layers_argument(p: argparse.ArgumentParser) -> None:
    """--layers N: a preset's widths with fewer layers (see layer_overrides)."""
    p.add_argument(
        "--layers", type=int, default=None, help="fewer layers than the preset's, same widths"
    )


def sequence_read_bytes(mean_context: float, kv_tok: int, state_seq: int) -> float:
    """What one sequence adds to a decode step's reads: its KV at that mean context and a hybrid
    model's recurrent state, read and written once."""
    return mean_context * kv_tok + 2 * state_seq


def layer_overrides(layers: int | None) -> dict[str, Any]:
    """The config overrides of a `--layers N` option (none without one)."""
    if layers is None:
        return {}
    if layers < 1:
        raise SystemExit(f"--layers {layers}: need at least one layer")
    return {"num_hidden_layers": layers}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    mk = sub.add_parser("make-checkpoint", help="write a random-weight checkpoint of a preset")
    mk.add_argument("--preset", required=True, choices=sorted(PRESETS))
    mk.add_argument("--out", required=True)
    mk.add_argument("--device", default="auto")
    mk.add_argument("--dtype", default="float16")
    mk.add_argument("--seed", type=int, default=0)
    add_layers_argument(mk)
    bw = sub.add_parser("bandwidth", help="print the device copy bandwidth")
    bw.add_argument("--device", default="auto")
    args = p.parse_args(argv)
    if args.cmd == "make-checkpoint":
        device = resolve_device(args.device)
        t0 = time.perf_counter()
        overrides = layer_overrides(args.layers)
        if checkpoint_matches(Path(args.out), args.preset, overrides):
            print(f"{args.out}: already holds a {args.preset} checkpoint")
            return
        write_random_checkpoint(
            args.out,
            args.preset,
            device,
            resolve_dtype(args.dtype, device),
            args.seed,
            overrides=overrides,
        )
        print(f"wrote {args.preset} to {args.out} in {time.perf_counter() - t0:.1f} s")
    else:
        device = resolve_device(args.device)
        print(json.dumps(measure_copy_bandwidth(device), indent=2))


if __name__ == "__main__":
    main()
