"""A GGUF file (or split set) as a checkpoint source: a Hugging Face config dict, the GGUF
QuantConfig (one ggml type per tensor), and the tensors under Hugging Face names.

Quantized linear weights travel as their raw block bytes (uint8 [N, row bytes]) to the GGUF
linear method, which unpacks them once at load; float tensors (F32/F16/BF16) and the token
embedding (a gather, dequantized here) travel as float tensors. llama.cpp's converter permutes
the rows of q and k of llama-arch files (its rotary pairs interleaved dimensions); that is undone
here, on rows, before anything is unpacked.
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
from voltserve.services.executor.quant.base import (
    LinearMethod,
    QuantConfig,
    QuantFormatError,
    Shard,
    UnquantizedMethod,
)
from voltserve.services.executor.quant.gguf_blocks import BLOCK_TYPES, unpack_blocks
from voltserve.services.executor.quant.group import GroupQuantMethod, ShardCodes
from voltserve.services.executor.tp.sharding import Cut, TensorSplit
from voltserve.shared.gguf_files import GGUFError, gguf_files, hf_config

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
}
_GLOBAL = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_BLK = re.compile(r"^blk\.(\d+)\.(.+)$")


def hf_name(name: str) -> str | None:
    if name in _GLOBAL:
        return _GLOBAL[name]
    m = _BLK.match(name)
    if m and m[2] in _LAYER:
        return f"model.layers.{m[1]}.{_LAYER[m[2]]}"
    return None


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

    def method_for(self, prefixes: list[str], layer_kind: str = "linear") -> LinearMethod:
        kinds = [self.types.get(p, ("F32", p))[0] for p in prefixes]
        if all(k in FLOAT_TYPES for k in kinds):
            return UnquantizedMethod()
        if any(k in FLOAT_TYPES for k in kinds):
            # A float shard beside quantized ones: one float weight for the whole linear.
            return _DequantizedMethod(dict(zip(prefixes, kinds)))
        variant = "GGUF " + "/".join(dict.fromkeys(kinds))

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

        return GroupQuantMethod(variant, ["weight"], [], unpack, self.split)

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
        types: dict[str, tuple[str, str]] = {}
        for name, t in self.tensors.items():
            hf = hf_name(name)
            if hf is not None and hf.endswith(".weight") and len(t.shape) == 2:
                types[hf[: -len(".weight")]] = (t.kind, name)
        self.quant = GGUFQuantConfig(types)

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

    def iter_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        for name, t in self.tensors.items():
            hf = hf_name(name)
            if hf is None:
                yield name, torch.empty(0)  # reported as ignored by the loader
                continue
            arr = np.asarray(t.data)
            if t.kind == "BF16":
                x = torch.from_numpy(arr.copy().view(np.int16)).view(torch.bfloat16)
            elif t.kind in FLOAT_TYPES:
                x = torch.from_numpy(arr.copy())
            else:
                x = torch.from_numpy(arr.copy().view(np.uint8))
            rows = t.shape[0]
            x = x.reshape(rows, -1) if len(t.shape) == 2 else x.reshape(t.shape)
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
