"""GGUF checkpoints as a model source, the torch-free half: which files a `--model` path names,
the architecture and hyper-parameters from the metadata as a Hugging Face config dict, the eos
ids, and the tokenizer (transformers builds one from `tokenizer.ggml.*`). The renderer and the
gateway use this; the executor's tensor side is services/executor/gguf_source.py.

A path is a GGUF checkpoint when it is a `.gguf` file or a folder holding one. A split file
(`name-00001-of-00003.gguf`) brings its siblings; the metadata lives in the first.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

_SPLIT = re.compile(r"^(?P<stem>.*)-(?P<i>\d{5})-of-(?P<n>\d{5})\.gguf$")

# GGUF general.architecture -> Hugging Face architecture and model_type.
ARCHITECTURES = {
    "llama": ("LlamaForCausalLM", "llama"),
    "qwen2": ("Qwen2ForCausalLM", "qwen2"),
    "qwen3": ("Qwen3ForCausalLM", "qwen3"),
    # mixture of experts: every block is a MoE block (llama.cpp builds them so)
    "qwen2moe": ("Qwen2MoeForCausalLM", "qwen2_moe"),
    "qwen3moe": ("Qwen3MoeForCausalLM", "qwen3_moe"),
    # hybrid linear attention (Gated DeltaNet layers, a gated full attention every few layers)
    "qwen3next": ("Qwen3NextForCausalLM", "qwen3_next"),
    "qwen35": ("Qwen3_5ForCausalLM", "qwen3_5"),
    "qwen35moe": ("Qwen3_5MoeForCausalLM", "qwen3_5_moe"),
}
MOE_ARCHITECTURES = ("qwen2moe", "qwen3moe", "qwen3next", "qwen35moe")
HYBRID_ARCHITECTURES = ("qwen3next", "qwen35", "qwen35moe")
# MoE blocks with a shared expert behind a sigmoid gate (ffn_*_shexp, ffn_gate_inp_shexp)
SHARED_EXPERT_ARCHITECTURES = ("qwen2moe", "qwen3next", "qwen35moe")
# llama.cpp renormalises the top-k routing weights of qwen3moe and the hybrids and not of
# qwen2moe (fixed per architecture in its graph code, as the Hugging Face configs say).
_NORM_TOPK = {"qwen2moe": False, "qwen3moe": True, "qwen3next": True, "qwen35moe": True}
_SOFTMAX_GATING = 1  # llama_expert_gating_func_type LLAMA_EXPERT_GATING_FUNC_TYPE_SOFTMAX


class GGUFError(ValueError):
    """The GGUF checkpoint is unusable; the message names the file, key or tensor."""


def gguf_files(path: str | Path) -> list[Path] | None:
    """The GGUF files of a model path, first (metadata) file first; None: not a GGUF path."""
    p = Path(path)
    if p.is_file() and p.suffix == ".gguf":
        first = p
    elif p.is_dir():
        found = sorted(p.glob("*.gguf"))
        if not found:
            return None
        firsts = [
            f for f in found if not _SPLIT.match(f.name) or _SPLIT.match(f.name)["i"] == "00001"
        ]
        if len(firsts) != 1:
            raise GGUFError(
                f"{p} holds several GGUF models ({[f.name for f in firsts]}); "
                "pass the file itself as --model"
            )
        first = firsts[0]
    else:
        return None
    m = _SPLIT.match(first.name)
    if m is None:
        return [first]
    n = int(m["n"])
    files = [first.with_name(f"{m['stem']}-{i:05d}-of-{n:05d}.gguf") for i in range(1, n + 1)]
    missing = [f.name for f in files if not f.is_file()]
    if missing:
        raise GGUFError(f"split GGUF {first.name} lacks its parts {missing}")
    return files


def is_gguf(path: str | Path) -> bool:
    try:
        return gguf_files(path) is not None
    except GGUFError:
        return True


def _value(reader: Any, key: str) -> Any:
    field = reader.get_field(key)
    if field is None:
        return None
    v = field.contents()
    return v


def read_metadata(path: str | Path, keys: list[str] | None = None) -> dict[str, Any]:
    """The first file's metadata (every key, or the ones named), without tensor data."""
    import gguf

    files = gguf_files(path)
    if files is None:
        raise GGUFError(f"{path} is not a GGUF file or a folder holding one")
    reader = gguf.GGUFReader(str(files[0]))
    names = keys if keys is not None else list(reader.fields)
    out = {}
    for k in names:
        if (
            k.startswith("tokenizer.ggml.")
            and keys is None
            and k
            in (
                "tokenizer.ggml.tokens",
                "tokenizer.ggml.merges",
                "tokenizer.ggml.token_type",
                "tokenizer.ggml.scores",
            )
        ):
            continue  # large lists; read them where needed
        out[k] = _value(reader, k)
    return out


def hf_config(meta: dict[str, Any], n_vocab: int | None, has_output: bool) -> dict[str, Any]:
    """A Hugging Face config.json dict from GGUF metadata (llama, qwen2, qwen3, qwen2moe,
    qwen3moe, and the hybrids qwen3next, qwen35, qwen35moe)."""
    arch = meta.get("general.architecture")
    if arch not in ARCHITECTURES:
        raise GGUFError(
            f"GGUF general.architecture {arch!r} is not supported; supported: {sorted(ARCHITECTURES)}"
        )
    if arch == "llama" and int(meta.get("llama.expert_count") or 0) > 0:
        # Mixtral: llama.cpp writes it as a llama file with experts
        raise GGUFError(
            f"GGUF llama-architecture file with llama.expert_count {meta['llama.expert_count']} "
            f"(Mixtral) is not supported; supported MoE GGUF architectures: {list(MOE_ARCHITECTURES)} "
            "(Mixtral loads from its Hugging Face folder)"
        )
    hf_arch, model_type = ARCHITECTURES[arch]

    def get(key: str, default: Any = ...) -> Any:
        v = meta.get(f"{arch}.{key}")
        if v is None:
            if default is ...:
                raise GGUFError(f"GGUF metadata lacks {arch}.{key}")
            return default
        return v

    heads = int(get("attention.head_count"))
    hidden = int(get("embedding_length"))
    head_dim = get("attention.key_length", None)
    if arch not in HYBRID_ARCHITECTURES:
        # the hybrids' rope dimension count is the partial rotary part of a head
        head_dim = head_dim or get("rope.dimension_count", None)
    head_dim = int(head_dim) if head_dim else hidden // heads
    rope_dim = get("rope.dimension_count", None)
    cfg: dict[str, Any] = {
        "architectures": [hf_arch],
        "model_type": model_type,
        "vocab_size": int(get("vocab_size", None) or n_vocab or 0),
        "hidden_size": hidden,
        "intermediate_size": int(get("feed_forward_length", None) or 0),
        # MTP (nextn) blocks follow the model's own; they are not loaded from a GGUF file
        "num_hidden_layers": int(get("block_count")) - int(get("nextn_predict_layers", 0)),
        "num_attention_heads": heads,
        "num_key_value_heads": int(get("attention.head_count_kv", heads)),
        "head_dim": head_dim,
        "rms_norm_eps": float(get("attention.layer_norm_rms_epsilon", 1e-6)),
        "max_position_embeddings": int(get("context_length", 2048)),
        "rope_theta": float(get("rope.freq_base", 10000.0)),
        "tie_word_embeddings": not has_output,
        "hidden_act": "silu",
    }
    if not cfg["intermediate_size"] and arch not in MOE_ARCHITECTURES:
        raise GGUFError(f"GGUF metadata lacks {arch}.feed_forward_length")
    if arch in MOE_ARCHITECTURES:
        cfg.update(_moe_config(arch, get))
    if arch in HYBRID_ARCHITECTURES:
        cfg.update(_hybrid_config(arch, get, cfg["num_hidden_layers"]))
    if rope_dim and (int(rope_dim) != head_dim or arch in HYBRID_ARCHITECTURES):
        # (the hybrids' loader default is 0.25: say 1.0 where the file does)
        cfg["partial_rotary_factor"] = int(rope_dim) / head_dim
    kind = get("rope.scaling.type", None)
    if kind not in (None, "none"):
        factor = float(get("rope.scaling.factor", 1.0))
        if kind == "linear":
            cfg["rope_scaling"] = {"rope_type": "linear", "factor": factor}
        elif kind == "yarn":
            cfg["rope_scaling"] = {
                "rope_type": "yarn",
                "factor": factor,
                "original_max_position_embeddings": int(
                    get("rope.scaling.original_context_length")
                ),
            }
        else:
            raise GGUFError(f"GGUF {arch}.rope.scaling.type {kind!r} is not supported")
    for key, name in (("bos_token_id", "bos"), ("eos_token_id", "eos")):
        v = meta.get(f"tokenizer.ggml.{name}_token_id")
        if v is not None:
            cfg[key] = int(v)
    return cfg


def _moe_config(arch: str, get: Any) -> dict[str, Any]:
    """The expert fields of a qwen2moe / qwen3moe config. An expert size the metadata lacks is
    left out here: the executor's GGUF source reads it from the expert tensors' shapes."""
    experts = int(get("expert_count"))
    used = int(get("expert_used_count"))
    if not 1 <= used <= experts:
        raise GGUFError(
            f"GGUF {arch}.expert_used_count {used} must be in 1..{arch}.expert_count {experts}"
        )
    gating = get("expert_gating_func", None)
    if gating is not None and int(gating) != _SOFTMAX_GATING:
        raise GGUFError(
            f"GGUF {arch}.expert_gating_func {gating} is not supported (only softmax, "
            f"{_SOFTMAX_GATING})"
        )
    cfg: dict[str, Any] = {
        "num_experts": experts,
        "num_experts_per_tok": used,
        "norm_topk_prob": _NORM_TOPK[arch],
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
    }
    inter = get("expert_feed_forward_length", None)
    if inter:
        cfg["moe_intermediate_size"] = int(inter)
    shared = get("expert_shared_feed_forward_length", None)
    if arch in SHARED_EXPERT_ARCHITECTURES and shared:
        cfg["shared_expert_intermediate_size"] = int(shared)
    return cfg


def _hybrid_config(arch: str, get: Any, layers: int) -> dict[str, Any]:
    """The Gated DeltaNet fields of a qwen3next / qwen35 / qwen35moe config, from llama.cpp's
    ssm.* keys: group_count the key heads, state_size the key head dim, time_step_rank the
    value heads, inner_size value heads x value head dim, conv_kernel the conv width; a full
    attention layer where (i + 1) % full_attention_interval == 0."""
    key_heads = int(get("ssm.group_count"))
    value_heads = int(get("ssm.time_step_rank"))
    inner = int(get("ssm.inner_size"))
    if key_heads < 1 or value_heads % key_heads or inner % value_heads:
        raise GGUFError(
            f"GGUF {arch}.ssm.time_step_rank {value_heads} (value heads) must be a multiple of "
            f"{arch}.ssm.group_count {key_heads} (key heads) and divide {arch}.ssm.inner_size "
            f"{inner}"
        )
    interval = int(get("full_attention_interval", 4))
    if interval < 1:
        raise GGUFError(f"GGUF {arch}.full_attention_interval {interval} must be >= 1")
    return {
        "linear_num_key_heads": key_heads,
        "linear_num_value_heads": value_heads,
        "linear_key_head_dim": int(get("ssm.state_size")),
        "linear_value_head_dim": inner // value_heads,
        "linear_conv_kernel_dim": int(get("ssm.conv_kernel")),
        "layer_types": [
            "full_attention" if (i + 1) % interval == 0 else "linear_attention"
            for i in range(layers)
        ],
        # llama.cpp's converter splits Qwen3-Next's fused in_proj_qkvz into attn_qkv and
        # attn_gate (and its in_proj_ba is split on load): the Qwen3.5 projections
        "linear_attn_split_projections": True,
    }


def context_length(path: str | Path) -> int:
    arch = read_metadata(path, ["general.architecture"]).get("general.architecture")
    v = read_metadata(path, [f"{arch}.context_length"]).get(f"{arch}.context_length")
    if v is None:
        raise GGUFError(
            f"GGUF metadata of {path} lacks {arch}.context_length; pass --max-model-len"
        )
    return int(v)


def load_tokenizer(path: str | Path) -> Any:
    """transformers' tokenizer built from the GGUF metadata (vocabulary, merges, special ids,
    chat template)."""
    import transformers

    first = gguf_files(path)[0]
    arch = read_metadata(path, ["general.architecture"]).get("general.architecture")
    if arch in HYBRID_ARCHITECTURES:
        # AutoTokenizer reads the file's model config first, which transformers cannot for
        # these architectures; their tokenizer is Qwen2's (pre-tokenizer from tokenizer.ggml.pre)
        cls = transformers.Qwen2Tokenizer
    else:
        cls = transformers.AutoTokenizer
    return cls.from_pretrained(str(first.parent), gguf_file=first.name)
