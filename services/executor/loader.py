"""Loading a Hugging Face model folder: config.json, safetensors (single file or sharded with an
index), generation_config.json. Every malformed folder fails with an error that names what is
missing or wrong."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from voltserve.services.executor.architectures import (
    SUPPORTED_ARCHITECTURES,
    ModelLoadError,
    read_hf_config,
    read_json,
    supported_architecture,
)
from voltserve.services.executor.models.layers import Linear
from voltserve.services.executor.models.llama import LlamaForCausalLM, ModelArch
from voltserve.services.executor.models.qwen3_next import (
    FULL,
    LINEAR,
    HybridArch,
    Qwen3NextForCausalLM,
)
from voltserve.services.executor.quant.base import UNQUANTIZED, QuantFormatError
from voltserve.services.executor.quant.detect import quant_config
from voltserve.shared.gguf_files import GGUFError, is_gguf

logger = logging.getLogger(__name__)

# Families whose MoE block has a shared expert behind a sigmoid gate (its size is required).
_SHARED_EXPERT = (
    "Qwen2MoeForCausalLM",
    "Qwen3NextForCausalLM",
    "Qwen3_5MoeForCausalLM",
    "Qwen3_5MoeForConditionalGeneration",
)

_DTYPES = {
    "float16": torch.float16,
    "half": torch.float16,
    "fp16": torch.float16,
    "float32": torch.float32,
    "float": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
}


def text_config(hf: dict[str, Any]) -> dict[str, Any]:
    """A vision-language config's text model config (its own keys over the top level's,
    architectures and tie_word_embeddings from the top level); a text model's config as is."""
    text = hf.get("text_config")
    if not isinstance(text, dict):
        return hf
    out = dict(text)
    out["architectures"] = hf.get("architectures")
    if "tie_word_embeddings" in hf:
        out["tie_word_embeddings"] = hf["tie_word_embeddings"]
    for key in ("quantization_config", "dtype", "torch_dtype"):
        if key in hf and key not in out:
            out[key] = hf[key]
    return out


def parse_arch(hf: dict[str, Any]) -> ModelArch:
    name = supported_architecture(hf)
    if SUPPORTED_ARCHITECTURES[name].get("vl"):
        if not isinstance(hf.get("text_config"), dict):
            raise ModelLoadError(f"config.json lacks text_config (needed for {name})")
        hf = text_config(hf)
    flags = SUPPORTED_ARCHITECTURES[name]
    required = [
        "vocab_size",
        "hidden_size",
        "num_hidden_layers",
        "num_attention_heads",
    ] + ([] if flags.get("all_moe") else ["intermediate_size"])
    missing = [k for k in required if hf.get(k) is None]
    if missing:
        raise ModelLoadError(f"config.json lacks {missing} (needed for {name})")
    act = hf.get("hidden_act", "silu")
    if act not in ("silu", "swish"):
        raise ModelLoadError(f"unsupported hidden_act {act!r} (only silu)")
    heads = hf["num_attention_heads"]
    # transformers 5 writes rope_parameters (theta inside); 4.x wrote rope_theta + rope_scaling.
    rope = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
    theta = rope.pop("rope_theta", None) or hf.get("rope_theta") or 10000.0
    partial = rope.pop("partial_rotary_factor", None) or hf.get("partial_rotary_factor") or 1.0
    kind = rope.get("rope_type") or rope.get("type") or "default"
    if kind in ("llama3", "yarn"):
        # As transformers reads it: a top-level original_max_position_embeddings (Phi-3's
        # place) wins over the rope dict's; neither: max_position_embeddings.
        top = hf.get("original_max_position_embeddings")
        orig = top or rope.get("original_max_position_embeddings")
        rope["original_max_position_embeddings"] = int(
            orig or hf.get("max_position_embeddings", 2048)
        )
    sliding = hf.get("sliding_window")
    if name.startswith("Qwen") and not hf.get("use_sliding_window", False):
        sliding = None
    attn_bias = bool(hf.get("attention_bias", False))
    moe = _parse_moe(hf, name, flags.get("moe"))
    if flags.get("all_moe"):
        moe.update(norm_topk_prob=True, mlp_only_layers=(), decoder_sparse_step=1)
    cls, hybrid = ModelArch, {}
    if flags.get("hybrid"):
        # a Qwen3-Next GGUF file holds the fused projections split (shared/gguf_files.py)
        fused = flags["hybrid"] == "fused" and not hf.get("linear_attn_split_projections")
        cls, hybrid = HybridArch, _parse_hybrid(hf, name, fused)
        # transformers' default for these families when config.json says nothing
        partial = _partial_rotary(hf) or 0.25
    return cls(
        architecture=name,
        vocab_size=hf["vocab_size"],
        hidden_size=hf["hidden_size"],
        # 0 where every layer is sparse (no dense MLP is built)
        intermediate_size=int(hf.get("intermediate_size") or 0),
        num_layers=hf["num_hidden_layers"],
        num_heads=heads,
        num_kv_heads=hf.get("num_key_value_heads") or heads,
        head_dim=hf.get("head_dim") or hf["hidden_size"] // heads,
        rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        max_position_embeddings=int(hf.get("max_position_embeddings", 2048)),
        rope_theta=float(theta),
        rope_scaling=None if kind == "default" else rope,
        partial_rotary_factor=float(partial),
        qkv_bias=flags.get("qkv_bias", False) or attn_bias,
        # Llama's attention_bias also covers o_proj; Qwen2's fixed qkv bias does not.
        o_bias=attn_bias,
        mlp_bias=bool(hf.get("mlp_bias", False)),
        qk_norm=flags.get("qk_norm", False),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        sliding_window=sliding,
        **moe,
        **hybrid,
    )


def _partial_rotary(hf: dict[str, Any]) -> float | None:
    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    value = rope.get("partial_rotary_factor", hf.get("partial_rotary_factor"))
    return None if value is None else float(value)


def _parse_hybrid(hf: dict[str, Any], name: str, fused: bool) -> dict[str, Any]:
    """HybridArch's fields: which layer is which and the Gated DeltaNet shapes."""
    keys = (
        "linear_num_key_heads",
        "linear_num_value_heads",
        "linear_key_head_dim",
        "linear_value_head_dim",
    )
    missing = [k for k in keys if not hf.get(k)]
    if missing:
        raise ModelLoadError(f"config.json lacks {missing} (needed for {name})")
    n = hf["num_hidden_layers"]
    types = hf.get("layer_types")
    if types is None:
        interval = int(hf.get("full_attention_interval") or 4)
        types = [FULL if (i + 1) % interval == 0 else LINEAR for i in range(n)]
    types = tuple(types)
    bad = sorted({t for t in types if t not in (FULL, LINEAR)})
    if len(types) != n or bad:
        raise ModelLoadError(
            f"config.json: layer_types must list {n} entries of {FULL!r} / {LINEAR!r}"
            + (f" (got {bad})" if bad else f" (got {len(types)})")
        )
    if FULL not in types:
        # The engine's sequences live in the paged KV cache (blocks, slots, preemption): a
        # model with no layer that keeps one has nothing for them to live in.
        raise ModelLoadError(
            f"config.json: layer_types has no full-attention layer ({n} layers, all "
            f"{LINEAR!r}); voltserve serves hybrid models with at least one {FULL!r} layer"
        )
    if hf.get("hidden_act", "silu") not in ("silu", "swish"):
        raise ModelLoadError(f"unsupported hidden_act {hf['hidden_act']!r} (only silu)")
    return dict(
        layer_types=types,
        fused_gdn_proj=fused,
        attn_output_gate=bool(hf.get("attn_output_gate", True)),
        linear_conv_kernel_dim=int(hf.get("linear_conv_kernel_dim") or 4),
        **{k: int(hf[k]) for k in keys},
    )


def _parse_moe(hf: dict[str, Any], name: str, family: str | None) -> dict[str, Any]:
    """ModelArch's expert fields from config.json (empty for a dense family)."""
    if family is None:
        return {}
    # Qwen configs say num_experts (transformers 5 also writes num_local_experts); Mixtral's
    # say num_local_experts.
    experts = hf.get("num_experts") or hf.get("num_local_experts")
    top_k = hf.get("num_experts_per_tok")
    inter = hf.get("intermediate_size") if family == "mixtral" else hf.get("moe_intermediate_size")
    missing = [
        k
        for k, v in (
            ("num_experts", experts),
            ("num_experts_per_tok", top_k),
            ("moe_intermediate_size", inter),
        )
        if not v
    ]
    shared = hf.get("shared_expert_intermediate_size")
    if name in _SHARED_EXPERT and shared is None:
        # transformers would fall back to its class default and load a shared expert of that
        # size; guessing it here could silently skip the checkpoint's shared expert.
        missing.append("shared_expert_intermediate_size")
    if missing:
        raise ModelLoadError(f"config.json lacks {missing} (needed for {name})")
    if not 1 <= top_k <= experts:
        raise ModelLoadError(
            f"config.json: num_experts_per_tok {top_k} must be in 1..num_experts {experts}"
        )
    step = int(hf.get("decoder_sparse_step") or 1)
    if step < 1:
        raise ModelLoadError(f"config.json: decoder_sparse_step {step} must be >= 1")
    return dict(
        num_experts=int(experts),
        num_experts_per_tok=int(top_k),
        moe_intermediate_size=int(inter),
        norm_topk_prob=bool(hf.get("norm_topk_prob", family == "mixtral")),
        shared_expert_intermediate_size=int(shared or 0) if name in _SHARED_EXPERT else 0,
        mlp_only_layers=tuple(int(i) for i in hf.get("mlp_only_layers") or ()),
        decoder_sparse_step=1 if family == "mixtral" else step,
        moe_family=family,
    )


def checkpoint_dtype(hf: dict[str, Any]) -> torch.dtype | None:
    name = hf.get("dtype") or hf.get("torch_dtype")
    return _DTYPES.get(str(name)) if name else None


def resolve_dtype(spec: str, device: torch.device) -> torch.dtype:
    """'auto' -> fp16 on CUDA (SM70 has no bf16; bf16 checkpoints are converted), fp32 on CPU."""
    if spec == "auto":
        return torch.float16 if device.type == "cuda" else torch.float32
    if spec not in _DTYPES:
        raise ValueError(f"unknown dtype {spec!r}; use auto, float16, float32 or bfloat16")
    dtype = _DTYPES[spec]
    if dtype == torch.bfloat16 and device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        if major < 8:
            raise ValueError(
                f"bfloat16 needs compute capability 8.0 or newer; this GPU is {major}.{minor}. "
                "Use --dtype float16 (bf16 checkpoints are converted on load)."
            )
    return dtype


def read_eos_token_ids(model_dir: str | Path, hf: dict[str, Any] | None = None) -> list[int]:
    """generation_config.json's eos_token_id (int or list), else config.json's."""
    d = Path(model_dir)
    gen = d / "generation_config.json"
    value = read_json(gen).get("eos_token_id") if gen.is_file() else None
    if value is None:
        value = (hf if hf is not None else read_hf_config(d)).get("eos_token_id")
    ids = [value] if isinstance(value, int) else list(value or [])
    return list(dict.fromkeys(int(i) for i in ids))


def weight_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map = read_json(index).get("weight_map")
        if not weight_map:
            raise ModelLoadError(f"{index} has no weight_map")
        files = sorted(set(weight_map.values()))
        missing = [f for f in files if not (model_dir / f).is_file()]
        if missing:
            raise ModelLoadError(f"{model_dir} lacks weight shards named in the index: {missing}")
        return [model_dir / f for f in files]
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        other = [p.name for p in model_dir.glob("*.bin")] + [p.name for p in model_dir.glob("*.pt")]
        hint = f" (found {other}: only safetensors are supported)" if other else ""
        raise ModelLoadError(f"{model_dir} has no *.safetensors weight files{hint}")
    return files


def iter_tensors(files: list[Path]) -> Iterator[tuple[str, torch.Tensor]]:
    for f in files:
        with safe_open(str(f), framework="pt", device="cpu") as st:
            for name in st.keys():  # noqa: SIM118 (safe_open is not a dict)
                yield name, st.get_tensor(name)


def rename_checkpoint_name(name: str, renames: dict[str, str]) -> str:
    """A checkpoint tensor name in our module paths' spelling (model.checkpoint_renames)."""
    for theirs, ours in renames.items():
        name = name.replace(theirs, ours)
    return name


@dataclass
class _Target:
    # A Linear, a VocabParallelEmbedding or a module naming its own tensors (FusedExperts;
    # all have load_weight); None: a plain parameter, copied whole.
    module: Any
    param: torch.nn.Parameter | None  # None: a linear's tensor (its method loads it)
    param_name: str
    shard: str | int | None


def _targets(model: LlamaForCausalLM) -> tuple[dict[str, _Target], set[str]]:
    """Checkpoint tensor name -> where it goes, and the names that may be absent. A linear's
    tensors are the ones its method reads, per shard (weight [, bias]; qweight, scales, ...)."""
    out: dict[str, _Target] = {}
    optional: set[str] = set()
    linears = {n: m for n, m in model.named_modules() if isinstance(m, Linear)}
    renames = getattr(model, "checkpoint_renames", {})
    reverse: dict[str, list[str]] = {}
    for ckpt, (ours, _) in LlamaForCausalLM.stacked_params.items():
        reverse.setdefault(ours, []).append(ckpt)
    for mod_name, lin in linears.items():
        required, maybe = lin.method.checkpoint_tensors(lin)
        prefixes = lin.prefixes
        if not prefixes:
            # a Linear built without checkpoint names: its module path (merged ones through
            # stacked_params, in shard order)
            parent, _, leaf = mod_name.rpartition(".")
            prefixes = [f"{parent}.{c}" for c in reverse[leaf]] if leaf in reverse else [mod_name]
        pairs = lin.checkpoint_shards() if lin.prefixes else zip(prefixes, lin.shard_offsets)
        for prefix, shard in pairs:
            # the loader renames checkpoint names before looking them up; so are the targets
            prefix = rename_checkpoint_name(prefix, renames)
            for pname in required + maybe:
                out[f"{prefix}.{pname}"] = _Target(lin, None, pname, shard)
            optional.update(f"{prefix}.{p}" for p in maybe)
    # Modules that name their own checkpoint tensors (the stacked MoE experts), by module path.
    own = {n: m for n, m in model.named_modules() if hasattr(m, "checkpoint_params")}
    for mod_name, m in own.items():
        for rel, (pname, shard) in m.checkpoint_params().items():
            # a float parameter (converted to its dtype on load), or a quantized method's tensor
            out[f"{mod_name}.{rel}"] = _Target(m, getattr(m, pname, None), pname, shard)
        maybe = getattr(m.method, "optional_checkpoint_params", None)
        if maybe is not None:
            optional.update(f"{mod_name}.{rel}" for rel in maybe(m))
    for name, param in model.named_parameters():
        mod_name, _, pname = name.rpartition(".")
        if mod_name in linears or mod_name in own:
            continue
        mod = model.get_submodule(mod_name) if mod_name else None
        # The (vocabulary-parallel) embedding narrows its checkpoint tensor to its rows; a
        # module with load_weight (a Gated DeltaNet's conv and per-head gates) takes its
        # parameters' tensors and narrows them to this rank's heads.
        owner = mod if hasattr(mod, "load_weight") else None
        out[name] = _Target(owner, param, pname, None)
    return out, optional


def load_weights(
    model: LlamaForCausalLM,
    model_dir: str | Path,
    tensors: Iterator[tuple[str, torch.Tensor]] | None = None,
) -> None:
    """Fill every parameter of `model` from the folder's safetensors (or from `tensors`, named as
    in a Hugging Face checkpoint); raise on anything missing. Then each linear's method converts
    what it loaded into its kernels' form."""
    d = Path(model_dir)
    targets, optional = _targets(model)
    loaded: set[str] = set()
    ignored: list[str] = []
    renames = getattr(model, "checkpoint_renames", {})
    for ckpt_name, tensor in tensors if tensors is not None else iter_tensors(weight_files(d)):
        name = rename_checkpoint_name(ckpt_name, renames)
        t = targets.get(name)
        if t is None:
            # rotary_emb.inv_freq (old exports), lm_head.weight of a tied model: derived, not loaded.
            ignored.append(ckpt_name)
            continue
        if tensor.is_floating_point() and t.param is not None:
            # bf16/fp32 checkpoints are converted to the run dtype; a linear's method converts
            # its own tensors (packed codes stay integers, scales are widened to fp32).
            tensor = tensor.to(t.param.dtype)
        try:
            if t.module is not None:
                t.module.load_weight(t.param_name, t.shard, tensor)
            elif tuple(tensor.shape) != tuple(t.param.shape):
                raise ValueError(
                    f"shape mismatch: checkpoint has {tuple(tensor.shape)}, "
                    f"model expects {tuple(t.param.shape)}"
                )
            else:
                t.param.data.copy_(tensor)
        except ValueError as e:
            raise ModelLoadError(f"tensor {ckpt_name!r} in {d}: {e}") from e
        except KeyError as e:
            raise ModelLoadError(f"tensor {ckpt_name!r} in {d}: {e.args[0]}") from e
        loaded.add(name)
    missing = sorted(set(targets) - loaded - optional)
    if missing:
        shown = missing[:8] + ([f"... {len(missing) - 8} more"] if len(missing) > 8 else [])
        raise ModelLoadError(f"{d} lacks weight tensors: {shown}")
    if ignored:
        logger.info("ignored %d checkpoint tensors, e.g. %s", len(ignored), ignored[:3])
    for name, m in model.named_modules():
        if isinstance(m, Linear):
            try:
                m.method.process_after_loading(m)
            except ValueError as e:
                raise ModelLoadError(f"linear {name!r} ({', '.join(m.prefixes)}): {e}") from e
        elif hasattr(m, "checkpoint_params"):
            try:
                m.method.process_after_loading(m)
            except ValueError as e:
                raise ModelLoadError(f"experts {name!r}: {e}") from e


def _log_expert_memory(model: LlamaForCausalLM, arch: ModelArch) -> None:
    if not arch.num_experts:
        return
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    experts = [m for m in model.modules() if hasattr(m, "checkpoint_params")]
    nbytes = sum(m.nbytes() for m in experts)
    logger.info(
        "experts: %d MoE layers of %d experts (top-%d, intermediate %d), stacked: %.1f MiB of "
        "%.1f MiB weights",
        len(experts),
        arch.num_experts,
        arch.num_experts_per_tok,
        arch.moe_intermediate_size,
        nbytes / 2**20,
        total / 2**20,
    )


@dataclass
class LoadedModel:
    model: LlamaForCausalLM
    arch: ModelArch
    dtype: torch.dtype
    eos_token_ids: list[int]
    hf_config: dict[str, Any]


def load_model(
    model_dir: str | Path,
    dtype: torch.dtype,
    device: torch.device,
    quantization: str | None = None,
    tp=None,
) -> LoadedModel:
    """A Hugging Face folder or a GGUF checkpoint; `quantization` forces (and checks) the
    method that config.json or the GGUF path implies. tp: this rank's TPGroup (each rank loads
    only its shards)."""
    tensors = None
    try:
        if is_gguf(model_dir):
            from voltserve.services.executor.gguf_source import GGUFSource

            if quantization not in (None, "gguf"):
                raise QuantFormatError(
                    f"--quantization {quantization} was given, but the model is a GGUF file"
                )
            source = GGUFSource(model_dir)
            hf, quant, eos = source.config, source.quant, source.eos_token_ids()
            tensors = source.iter_tensors()
        else:
            hf = read_hf_config(model_dir)
            legacy = Path(model_dir) / "quantize_config.json"
            if "quantization_config" not in hf and legacy.is_file():
                # AutoGPTQ's older exports keep the GPTQ settings beside config.json
                hf["quantization_config"] = {"quant_method": "gptq", **read_json(legacy)}
            modelopt = Path(model_dir) / "hf_quant_config.json"
            if "quantization_config" not in hf and modelopt.is_file():
                # ModelOpt's export keeps its settings beside config.json
                settings = read_json(modelopt).get("quantization") or {}
                hf["quantization_config"] = {"quant_method": "modelopt", **settings}
            quant = quant_config(hf, quantization)
            eos = read_eos_token_ids(model_dir, hf)
            src = checkpoint_dtype(hf)
            if src is not None and src != dtype and quant is UNQUANTIZED:
                logger.info("converting %s weights to %s on load", src, dtype)
        arch = parse_arch(hf)
        with torch.device(device):
            if isinstance(arch, HybridArch):
                vl = bool(SUPPORTED_ARCHITECTURES[arch.architecture].get("vl"))
                model = Qwen3NextForCausalLM(arch, dtype, quant, tp, language_model_prefix=vl)
            else:
                model = LlamaForCausalLM(arch, dtype, quant, tp)
    except (QuantFormatError, GGUFError) as e:
        raise ModelLoadError(f"{model_dir}: {e}") from e
    if quant is not UNQUANTIZED:
        logger.info("quantization: %s", quant.describe())
    load_weights(model, model_dir, tensors)
    model.eval()
    _log_expert_memory(model, arch)
    return LoadedModel(model, arch, dtype, eos, hf)
