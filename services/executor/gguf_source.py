"""A GGUF file (or split set) as a checkpoint source: a Hugging Face config dict, the GGUF
QuantConfig (one ggml type per tensor), and the tensors under Hugging Face names.

Quantized linear weights travel as their raw block bytes (uint8 [N, row bytes]) to the GGUF
linear method: Q4_K / Q6_K linears keep them for the K-quant kernels (quant/kquant.py, the
VOLTSERVE_GGUF_KQUANT switch), every other linear unpacks them once at load; float tensors
(F32/F16/BF16) and the token embedding (a gather, dequantized here) travel as float tensors.
llama.cpp's converter permutes the rows of q and k of llama-arch files (its rotary pairs
interleaved dimensions); that is undone here, on rows, before anything is unpacked.

MoE files (qwen2moe, qwen3moe) store each layer's routed experts stacked, one tensor per
projection (`blk.N.ffn_gate_exps` / `ffn_up_exps` / `ffn_down_exps`, [E, rows, K] in torch
order); they are handed on as each expert's projection under its Hugging Face name
(model.layers.N.mlp.experts.E.gate_proj.weight), a view of the stacked rows, so the experts'
quantization method (models/moe.py experts_method) sees them as it sees any checkpoint's. The
routers (`ffn_gate_inp`, the shared expert's `ffn_gate_inp_shexp`) stay float, dequantized here
if a file quantized them.

The hybrid linear-attention files (qwen3next, qwen35, qwen35moe) are mapped back by
gguf_hybrid.py; their MTP blocks (past block_count - nextn_predict_layers) are not loaded.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from voltserve.kernels.linear.gguf_blocks import BLOCK_TYPES, unpack_blocks
from voltserve.services.executor.gguf_hybrid import HybridLayout
from voltserve.services.executor.quant.base import (
    LinearMethod,
    QuantConfig,
    QuantFormatError,
    Shard,
    UnquantizedMethod,
)
from voltserve.services.executor.quant.group import GroupQuantMethod, ShardCodes
from voltserve.services.executor.tp.sharding import Cut, TensorSplit
from voltserve.shared.gguf_files import (
    HYBRID_ARCHITECTURES,
    MOE_ARCHITECTURES,
    SHARED_EXPERT_ARCHITECTURES,
    GGUFError,
    gguf_files,
    hf_config,
)

logger = logging.getLogger(__name__)

FLOAT_TYPES = {"F32", "F16", "BF16"}

_LAYER = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_output.bias": "self_attn.o_proj.bias",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
    # mixture of experts (the routed experts: _EXPERTS)
    "ffn_gate_inp.weight": "mlp.gate.weight",
    "ffn_gate_shexp.weight": "mlp.shared_expert.gate_proj.weight",
    "ffn_up_shexp.weight": "mlp.shared_expert.up_proj.weight",
    "ffn_down_shexp.weight": "mlp.shared_expert.down_proj.weight",
    "ffn_gate_inp_shexp.weight": "mlp.shared_expert_gate.weight",
}
# stacked routed experts [E, rows, K] -> each expert's projection leaf
_EXPERTS = {
    "ffn_gate_exps.weight": "gate_proj",
    "ffn_up_exps.weight": "up_proj",
    "ffn_down_exps.weight": "down_proj",
}
# the routers: float linears whatever the file stores (models/moe.py builds them unquantized)
_ROUTERS = ("mlp.gate.weight", "mlp.shared_expert_gate.weight")
_GLOBAL = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_BLK = re.compile(r"^blk\.(\d+)\.(.+)$")
_ROUTED_EXPERT = re.compile(r"\.mlp\.experts\.\d+\.")


def hf_name(name: str, hybrid: HybridLayout | None = None) -> str | None:
    """The Hugging Face name of a GGUF tensor (the first, for ssm_ba's two); None: not loaded."""
    if name in _GLOBAL:
        return _GLOBAL[name]
    m = _BLK.match(name)
    if m is None:
        return None
    if hybrid is not None and hybrid.hf_leaves(m[2]):
        return f"model.layers.{m[1]}.{hybrid.hf_leaves(m[2])[0]}"
    if m[2] in _LAYER:
        return f"model.layers.{m[1]}.{_LAYER[m[2]]}"
    return None


def expert_names(name: str, num_experts: int) -> list[str] | None:
    """The Hugging Face names of a stacked expert tensor's experts, in order (else None)."""
    m = _BLK.match(name)
    if m is None or m[2] not in _EXPERTS:
        return None
    return [
        f"model.layers.{m[1]}.mlp.experts.{e}.{_EXPERTS[m[2]]}.weight" for e in range(num_experts)
    ]


def dequantize_raw(kind: str, raw: torch.Tensor, k: int) -> torch.Tensor:
    codes, scales, offsets = unpack_blocks(kind, raw, k)
    g = k // scales.shape[1]
    return codes.float() * scales.repeat_interleave(g, 1) + offsets.repeat_interleave(g, 1)


@dataclass
class _Tensor:
    gguf_name: str
    kind: str  # ggml type name
    shape: tuple[int, ...]  # torch order: [N, K]
    data: np.ndarray


class GGUFQuantConfig(QuantConfig):
    """Each linear's method from its tensors' ggml types."""

    name = "gguf"

    def __init__(self, types: dict[str, tuple[str, str]]) -> None:
        self.types = types  # HF linear prefix -> (ggml type, GGUF tensor name)

    def describe(self) -> str:
        counts: dict[str, int] = {}
        for kind, _ in self.types.values():
            counts[kind] = counts.get(kind, 0) + 1
        return "gguf " + " ".join(f"{k}x{n}" for k, n in sorted(counts.items()))

    def method_for(self, prefixes: list[str]) -> LinearMethod:
        kinds = [self.types.get(p, ("F32", p))[0] for p in prefixes]
        if all(k in FLOAT_TYPES for k in kinds):
            return UnquantizedMethod()
        if any(k in FLOAT_TYPES for k in kinds):
            # A float shard beside quantized ones: one float weight for the whole linear.
            return _DequantizedMethod(dict(zip(prefixes, kinds)))
        variant = "GGUF " + "/".join(dict.fromkeys(kinds))
        if self.native(prefixes, kinds):
            from voltserve.services.executor.quant.kquant import KQuantMethod

            return KQuantMethod(variant, {p: self.types[p] for p in prefixes}, self.split)

        def unpack(t: dict[str, torch.Tensor], prefix: str, n: int, k: int) -> ShardCodes:
            kind, gname = self.types[prefix]
            bt = BLOCK_TYPES[kind]
            raw = t["weight"]
            if tuple(raw.shape) != (n, k // bt.block * bt.nbytes) or raw.dtype != torch.uint8:
                raise ValueError(
                    f"{gname}: {kind} data of shape {tuple(raw.shape)} does not hold [{n}, {k}]"
                )
            codes, scales, offsets = unpack_blocks(kind, raw, k)
            return ShardCodes(codes, scales, offsets, bt.bits, bt.group)

        return GroupQuantMethod(variant, ["weight"], [], unpack, family="GGUF", splits=self.split)

    @staticmethod
    def native(prefixes: list[str], kinds: list[str]) -> bool:
        """Whether the linear keeps its blocks for the K-quant kernels: every shard a type their
        GEMV reads, the switch on for the device the model is built on (kquant_linear.
        native_enabled), and not a routed expert (stacked experts run the fused group-quantized
        MoE kernels, quant/experts.py)."""
        from voltserve.kernels.linear.kquant_gemv import NATIVE
        from voltserve.kernels.linear.kquant_linear import native_enabled

        return (
            all(k in NATIVE for k in kinds)
            and not any(_ROUTED_EXPERT.search(p) for p in prefixes)
            and native_enabled(torch.empty(0).device)  # the model is built under its device
        )

    def split(self, name: str, prefix: str) -> TensorSplit | None:
        """Tensor parallelism: a block-quantized [N, K] weight is N rows of whole blocks, so a
        column-parallel rank takes whole rows and a row-parallel one whole blocks of each row
        (a cut inside a block is refused, naming the tensor)."""
        if name != "weight":
            return None
        bt = BLOCK_TYPES[self.types[prefix][0]]
        return TensorSplit(out_dim=0, in_dim=1, in_pack=bt.block, in_nbytes=bt.nbytes)


class _DequantizedMethod(UnquantizedMethod):
    """Quantized shards dequantized into the float weight on load (a linear mixing float and
    quantized shards)."""

    def __init__(self, kinds: dict[str, str]) -> None:
        self.kinds = kinds

    def local_tensor(self, layer, name: str, shard: Shard, tensor: torch.Tensor, cut: Cut):
        if name == "weight" and tensor.dtype == torch.uint8:
            prefix = layer.prefixes[list(layer.shard_offsets).index(shard)]
            bt = BLOCK_TYPES[self.kinds[prefix]]
            split = TensorSplit(out_dim=0, in_dim=1, in_pack=bt.block, in_nbytes=bt.nbytes)
            return split.narrow(tensor, cut, f"{prefix}.weight")
        return super().local_tensor(layer, name, shard, tensor, cut)

    def load(self, layer, name: str, shard: Shard, tensor: torch.Tensor) -> None:
        if name == "weight" and tensor.dtype == torch.uint8:
            prefix = layer.prefixes[list(layer.shard_offsets).index(shard)]
            tensor = dequantize_raw(self.kinds[prefix], tensor, layer.in_features)
        super().load(layer, name, shard, tensor)


class GGUFSource:
    """The tensors and metadata of one GGUF checkpoint (a file, a folder holding one, or the
    first file of a split set)."""

    def __init__(self, path: str | Path) -> None:
        import gguf

        files = gguf_files(path)
        if files is None:
            raise GGUFError(f"{path} is not a GGUF file or a folder holding one")
        self.files = files
        readers = [gguf.GGUFReader(str(f)) for f in files]
        first = readers[0]
        self.meta: dict[str, Any] = {}
        for k, field in first.fields.items():
            if k in (
                "tokenizer.ggml.tokens",
                "tokenizer.ggml.merges",
                "tokenizer.ggml.scores",
                "tokenizer.ggml.token_type",
            ):
                continue
            self.meta[k] = field.contents()
        tok = first.get_field("tokenizer.ggml.tokens")
        n_vocab = len(tok.data) if tok is not None else None
        self.tensors: dict[str, _Tensor] = {}
        for f, r in zip(files, readers):
            for t in r.tensors:
                kind = t.tensor_type.name
                shape = tuple(int(x) for x in reversed(t.shape.tolist()))
                if kind not in FLOAT_TYPES and kind not in BLOCK_TYPES:
                    raise QuantFormatError(
                        f"{f.name}: tensor {t.name!r} has ggml type {kind}, which is not "
                        f"supported (supported: {sorted(FLOAT_TYPES | set(BLOCK_TYPES))})"
                    )
                if kind in BLOCK_TYPES and shape[-1] % BLOCK_TYPES[kind].block:
                    raise QuantFormatError(
                        f"{f.name}: tensor {t.name!r} ({kind}): row length {shape[-1]} is not a "
                        f"multiple of the block size {BLOCK_TYPES[kind].block}"
                    )
                self.tensors[t.name] = _Tensor(t.name, kind, shape, t.data)
        self.arch = self.meta.get("general.architecture")
        self.config = hf_config(self.meta, n_vocab, "output.weight" in self.tensors)
        freqs = self.tensors.get("rope_freqs.weight")
        if freqs is not None:
            # Llama 3.1's rope scaling as llama.cpp stores it: a divisor per rotary frequency.
            rot = int(self.config["head_dim"] * self.config.get("partial_rotary_factor", 1.0))
            if freqs.kind != "F32" or freqs.shape != (rot // 2,):
                raise QuantFormatError(
                    f"tensor 'rope_freqs.weight': {freqs.kind} {list(freqs.shape)}, expected "
                    f"F32 [{rot // 2}] (one factor per rotary frequency)"
                )
            if self.config.get("rope_scaling"):
                raise QuantFormatError(
                    "tensor 'rope_freqs.weight' together with rope.scaling.type "
                    f"{self.config['rope_scaling']['rope_type']!r} is not supported"
                )
            factors = np.asarray(freqs.data, dtype=np.float32).tolist()
            self.config["rope_scaling"] = {"rope_type": "freq_factors", "factors": factors}
        if not self.config["vocab_size"] and "token_embd.weight" in self.tensors:
            self.config["vocab_size"] = self.tensors["token_embd.weight"].shape[0]
        self.num_experts = int(self.config.get("num_experts") or 0)
        self.hybrid = (
            HybridLayout.from_config(self.arch, self.config)
            if self.arch in HYBRID_ARCHITECTURES
            else None
        )
        self._check_experts()
        types: dict[str, tuple[str, str]] = {}
        for name, t in self.tensors.items():
            if self._past_layers(name):
                continue
            m = _BLK.match(name)
            hy = self.hybrid.hf_leaves(m[2]) if self.hybrid is not None and m else []
            if hy:
                kind = t.kind
                if m[2] == "ssm_out.weight" and self.hybrid.out_needs_float(kind):
                    kind = "F32"  # dequantized on load (gguf_hybrid.py)
                for leaf in hy:
                    if leaf.endswith(".weight") and len(t.shape) == 2:
                        types[f"model.layers.{m[1]}.{leaf[: -len('.weight')]}"] = (kind, name)
                continue
            hf = hf_name(name)
            if hf is not None and hf.endswith(".weight") and len(t.shape) == 2:
                types[hf[: -len(".weight")]] = (t.kind, name)
            for hf in expert_names(name, self.num_experts) or ():
                types[hf[: -len(".weight")]] = (t.kind, name)
        self.quant = GGUFQuantConfig(types)
        widened = [
            n
            for n, t in self.tensors.items()
            if n.endswith("ssm_out.weight") and self.hybrid and self.hybrid.out_needs_float(t.kind)
        ]
        if widened:
            logger.info(
                "%d ssm_out tensors (%s) dequantized at load: their tiled value heads (%d wide) "
                "cut the %s blocks",
                len(widened),
                widened[0],
                self.hybrid.value_dim,
                self.tensors[widened[0]].kind,
            )

    def _past_layers(self, name: str) -> bool:
        """A block past the model's layers (MTP / nextn blocks): not loaded."""
        m = _BLK.match(name)
        return m is not None and int(m[1]) >= self.config["num_hidden_layers"]

    def _check_experts(self) -> None:
        """An MoE file: every block holds E stacked experts of one shape (the config's expert
        sizes, read from the shapes where the metadata lacks them). A dense architecture
        holding expert tensors (Mixtral is a llama file with experts) is refused by name."""
        exps = [n for n in self.tensors if _BLK.match(n) and _BLK.match(n)[2] in _EXPERTS]
        fused = [n for n in self.tensors if n.endswith(".ffn_gate_up_exps.weight")]
        if fused:
            raise GGUFError(
                f"GGUF {self.arch!r} file holds fused expert tensors ({fused[0]!r}), which are "
                "not supported (supported: ffn_gate_exps / ffn_up_exps / ffn_down_exps)"
            )
        if self.arch not in MOE_ARCHITECTURES:
            routed = exps or [n for n in self.tensors if ".ffn_gate_inp" in n]
            if routed:
                raise GGUFError(
                    f"GGUF {self.arch!r} file holds expert tensors ({routed[0]!r}: Mixtral is "
                    f"written so); supported MoE GGUF architectures: {list(MOE_ARCHITECTURES)}"
                )
            return
        cfg, E = self.config, self.num_experts
        hidden = cfg["hidden_size"]
        sizes = {"moe_intermediate_size": None, "shared_expert_intermediate_size": None}
        for i in range(cfg["num_hidden_layers"]):
            for leaf in ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps", "ffn_gate_inp"):
                name = f"blk.{i}.{leaf}.weight"
                t = self.tensors.get(name)
                if t is None:
                    raise QuantFormatError(
                        f"GGUF {self.arch} file lacks tensor {name!r} (every {self.arch} block "
                        "is a mixture-of-experts block)"
                    )
                if leaf == "ffn_gate_inp":
                    if t.shape != (E, hidden):
                        raise QuantFormatError(
                            f"tensor {name!r}: shape {list(t.shape)}, expected [{E}, {hidden}] "
                            f"({self.arch}.expert_count {E} experts)"
                        )
                    continue
                if len(t.shape) != 3 or t.shape[0] != E:
                    raise QuantFormatError(
                        f"tensor {name!r}: shape {list(t.shape)}, expected [{E}, rows, K] "
                        f"(stacked experts; {self.arch}.expert_count {E})"
                    )
                inter = t.shape[2] if leaf == "ffn_down_exps" else t.shape[1]
                sizes["moe_intermediate_size"] = sizes["moe_intermediate_size"] or inter
            shexp = self.tensors.get(f"blk.{i}.ffn_gate_shexp.weight")
            if shexp is not None and self.arch in SHARED_EXPERT_ARCHITECTURES:
                sizes["shared_expert_intermediate_size"] = (
                    sizes["shared_expert_intermediate_size"] or shexp.shape[0]
                )
        for key, size in sizes.items():
            if size is not None:
                # a size the metadata gives wins; a tensor that disagrees with it fails to load
                # naming itself (the linear methods check every shape)
                cfg.setdefault(key, int(size))
        if (
            self.arch in SHARED_EXPERT_ARCHITECTURES
            and "shared_expert_intermediate_size" not in cfg
        ):
            raise QuantFormatError(
                f"GGUF {self.arch} file has no shared expert (tensor "
                f"'blk.0.ffn_gate_shexp.weight' and {self.arch}.expert_shared_feed_forward_length "
                "are absent)"
            )
        if not cfg["intermediate_size"]:
            cfg["intermediate_size"] = cfg["moe_intermediate_size"]  # no dense MLP is built

    def eos_token_ids(self) -> list[int]:
        ids = [
            self.meta.get("tokenizer.ggml.eos_token_id"),
            self.meta.get("tokenizer.ggml.eot_token_id"),
        ]
        return list(dict.fromkeys(int(i) for i in ids if i is not None))

    def _permute_rows(self, name: str) -> int | None:
        """Heads of the q / k rows llama.cpp's converter permuted (llama arch), else None."""
        if self.arch != "llama":
            return None
        if name.endswith(("attn_q.weight", "attn_q.bias")):
            return self.config["num_attention_heads"]
        if name.endswith(("attn_k.weight", "attn_k.bias")):
            return self.config["num_key_value_heads"]
        return None

    @staticmethod
    def _torch(t: _Tensor) -> torch.Tensor:
        arr = np.asarray(t.data)
        if t.kind == "BF16":
            return torch.from_numpy(arr.copy().view(np.int16)).view(torch.bfloat16)
        if t.kind in FLOAT_TYPES:
            return torch.from_numpy(arr.copy())
        return torch.from_numpy(arr.copy().view(np.uint8))

    def iter_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        for name, t in self.tensors.items():
            if self._past_layers(name):
                yield name, torch.empty(0)  # reported as ignored by the loader
                continue
            experts = expert_names(name, self.num_experts)
            if experts is not None and len(t.shape) == 3:
                # [E, rows, K] (float) or [E, rows, row bytes] (blocks): one view per expert
                x = self._torch(t).reshape(t.shape[0], t.shape[1], -1)
                for e, hf in enumerate(experts):
                    yield hf, x[e]
                continue
            hf = hf_name(name, self.hybrid)
            if hf is None:
                yield name, torch.empty(0)  # reported as ignored by the loader
                continue
            x = self._torch(t)
            rows = t.shape[0]
            x = x.reshape(rows, -1) if len(t.shape) == 2 else x.reshape(t.shape)
            if self.hybrid is not None:
                m = _BLK.match(name)
                if m and self.hybrid.hf_leaves(m[2]):
                    for leaf, y in self.hybrid.convert(m[2], x, t.kind, dequantize_raw):
                        yield f"model.layers.{m[1]}.{leaf}", y
                    continue
                if name == "output_norm.weight":
                    x = x.float() - 1.0  # stored as 1 + weight
            if hf.endswith(_ROUTERS):
                if t.kind in BLOCK_TYPES:
                    x = dequantize_raw(t.kind, x, t.shape[-1])
                # llama.cpp's shared-expert gate is a vector [H]; the linear's weight is [1, H]
                yield hf, x.reshape(-1, t.shape[-1])
                continue
            heads = self._permute_rows(name)
            if heads is not None:
                # converter: rows (h, j, i) <- HF rows (h, i, j) with j in {0, 1}; undo it
                n = x.shape[0]
                x = x.reshape(heads, n // heads // 2, 2, *x.shape[1:]).transpose(1, 2)
                x = x.reshape(n, *x.shape[3:]).contiguous()
            if (
                t.kind in BLOCK_TYPES
                and not hf.startswith("model.layers")
                and hf != "lm_head.weight"
            ):
                # the embedding is a gather: keep it in float
                x = dequantize_raw(t.kind, x, t.shape[-1])
            yield hf, x
