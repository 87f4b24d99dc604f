"""The Llama family in one class: Llama 2/3/3.1, Mistral, Qwen2/2.5, Qwen3.

They differ only in flags: bias on q/k/v (Qwen2), RMSNorm of q and k per head (Qwen3), tied
embeddings, rope scaling and partial rotary. The forward takes one flat batch of T tokens from any
mix of prefills and decodes, writes their K/V into the paged cache, and returns logits only for
the rows that sample.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from voltserve.kernels.attention import qk_norm_rope
from voltserve.kernels.dispatch import KernelDispatch
from voltserve.services.executor.models.layers import (
    AttentionMetadata,
    Linear,
    RMSNorm,
    VocabParallelEmbedding,
    gate_up_silu,
    linear,
    lm_head,
    paged_attend,
    rotary_and_ops,
)
from voltserve.services.executor.models.moe import SparseMoE
from voltserve.services.executor.quant.base import QuantConfig
from voltserve.services.executor.tp.group import TPGroup
from voltserve.services.executor.tp.layout import TPLayout
from voltserve.services.executor.tp.sharding import column_parallel, row_parallel

if TYPE_CHECKING:
    from voltserve.services.executor.kv_quant import KVQuant

KVCache = tuple[
    torch.Tensor, torch.Tensor
]  # K and V: [num_blocks, num_kv_heads, block_size, head_dim]


@dataclass
class ModelArch:
    """What the model needs from config.json, normalised across architectures and versions."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None  # None: plain rope
    partial_rotary_factor: float = 1.0
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    tie_word_embeddings: bool = False
    sliding_window: int | None = None  # not implemented: the runner caps max_model_len at it
    extra: dict[str, Any] = field(default_factory=dict)
    # Mixture of experts (models/moe.py); num_experts = 0: every layer is a dense MLP.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    shared_expert_intermediate_size: int = 0  # 0: no shared expert
    mlp_only_layers: tuple[int, ...] = ()
    decoder_sparse_step: int = 1
    moe_family: str = "qwen"  # "qwen" | "mixtral": expert names, routing-weight dtype

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def num_kv_layers(self) -> int:
        """Layers with a paged KV cache (a hybrid model's full-attention layers only)."""
        return self.num_layers

    def is_moe_layer(self, i: int) -> bool:
        """transformers' rule (Qwen2/3-MoE; Mixtral has every layer sparse)."""
        return (
            self.num_experts > 0
            and i not in self.mlp_only_layers
            and (i + 1) % self.decoder_sparse_step == 0
        )


class Attention(nn.Module):
    """With tensor parallelism: this rank's query heads and KV heads (TPLayout); q/k/v is
    column-parallel, o_proj row-parallel (one all-reduce)."""

    def __init__(
        self,
        arch: ModelArch,
        dtype: torch.dtype,
        quant: QuantConfig | None = None,
        prefix: str = "",
        tp: TPGroup | None = None,
        lay: TPLayout | None = None,
    ) -> None:
        super().__init__()
        lay = lay or TPLayout.build(arch)
        hd = arch.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = lay.num_heads, lay.num_kv_heads, hd
        self.q_size = lay.num_heads * hd
        self.kv_size = lay.num_kv_heads * hd
        self.scale = arch.head_dim**-0.5
        q_full, kv_full = arch.num_heads * hd, arch.num_kv_heads * hd
        kv_slice = (lay.kv_head_start * hd, self.kv_size)
        self.qkv_proj = Linear(
            arch.hidden_size,
            {"q": q_full, "k": kv_full, "v": kv_full},
            arch.qkv_bias,
            dtype,
            quant,
            [f"{prefix}.q_proj", f"{prefix}.k_proj", f"{prefix}.v_proj"],
            column_parallel(
                tp, {"q": (lay.head_start * hd, self.q_size), "k": kv_slice, "v": kv_slice}
            ),
        )
        self.o_proj = Linear(
            q_full,
            {None: arch.hidden_size},
            arch.o_bias,
            dtype,
            quant,
            [f"{prefix}.o_proj"],
            row_parallel(tp, lay.head_start * hd, self.q_size),
        )
        self.q_norm = RMSNorm(arch.head_dim, arch.rms_norm_eps, dtype) if arch.qk_norm else None
        self.k_norm = RMSNorm(arch.head_dim, arch.rms_norm_eps, dtype) if arch.qk_norm else None
        # A one-byte KV cache's format and scales (kv_quant.install); None: the cache holds the
        # run dtype (or fp16) and the kernels write and read it as is.
        self.kv_quant: KVQuant | None = None

    def forward(
        self,
        ops: KernelDispatch,
        positions: torch.Tensor,
        x: torch.Tensor,
        kv_cache: KVCache,
        meta: AttentionMetadata,
        cos_sin_cache: torch.Tensor,
    ) -> torch.Tensor:
        T = x.shape[0]
        k_cache, v_cache = kv_cache
        fused = self._qkv_rope_fused(ops, x, meta, cos_sin_cache)
        if fused:
            # One launch: the projection, rotary on q and k, and the KV-cache write.
            qkv = self.qkv_proj.method.apply_qkv_rope(
                self.qkv_proj,
                x,
                ops,
                positions,
                cos_sin_cache,
                k_cache,
                v_cache,
                meta.slot_mapping,
                self.num_heads,
                self.num_kv_heads,
            )
        else:
            qkv = self.qkv_proj(x, ops)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        if self.q_norm is not None:
            norm_args = (
                positions,
                q,
                k,
                v,
                self.q_norm.weight,
                self.k_norm.weight,
                self.q_norm.eps,
                self.head_dim,
                cos_sin_cache,
                True,
                k_cache,
                v_cache,
                meta.slot_mapping,
            )
            if self.kv_quant is None and qk_norm_rope.covers(ops.impl, *norm_args):
                # One launch: q/k RMSNorm per head and rotary (q in place, in qkv), and the
                # normalised, rotated k with v written into the paged cache.
                ops.qk_norm_rope_and_cache(*norm_args)
                fused = True
            else:
                q = self.q_norm(ops, q.reshape(-1, self.head_dim)).view(T, self.q_size)
                k = self.k_norm(ops, k.reshape(-1, self.head_dim)).view(T, self.kv_size)
        # Otherwise q and k stay row views of qkv: rotary works on them in place, and the same
        # launch writes the rotated k and v into the paged cache.
        if self.kv_quant is not None:
            ops.rotary_embedding(positions, q, k, self.head_dim, cos_sin_cache, True)
            self.kv_quant.write(ops, k, v, k_cache, v_cache, meta.slot_mapping)
        elif not fused:
            ops.rotary_and_cache(
                positions,
                q,
                k,
                v,
                self.head_dim,
                cos_sin_cache,
                True,
                k_cache,
                v_cache,
                meta.slot_mapping,
            )
        q = q.view(T, self.num_heads, self.head_dim)
        if self.kv_quant is not None:
            o = self.kv_quant.attend(ops, q, k_cache, v_cache, meta, self.scale)
        else:
            o = paged_attend(ops, q, k_cache, v_cache, meta, self.scale)
        return self.o_proj(o.view(T, self.q_size), ops)

    def _qkv_rope_fused(
        self,
        ops: KernelDispatch,
        x: torch.Tensor,
        meta: AttentionMetadata,
        cos_sin_cache: torch.Tensor,
    ) -> bool:
        """Decode rows with plain full NeoX rotary (no q/k norm, rotary_dim = head_dim), where
        the qkv linear's method fuses the projection, rotary and the KV write (the plain weight
        does for the rows the plan sends to the GEMV kernel)."""
        return (
            meta.is_decode
            and self.q_norm is None
            and self.kv_quant is None
            and cos_sin_cache.shape[1] == self.head_dim
            and self.qkv_proj.method.can_fuse_qkv_rope(self.qkv_proj, x, ops)
        )


class MLP(nn.Module):
    """gate/up column-parallel, down row-parallel (one all-reduce)."""

    def __init__(
        self,
        arch: ModelArch,
        dtype: torch.dtype,
        quant: QuantConfig | None = None,
        prefix: str = "",
        tp: TPGroup | None = None,
        lay: TPLayout | None = None,
    ) -> None:
        super().__init__()
        lay = lay or TPLayout.build(arch)
        inter = arch.intermediate_size
        part = (lay.inter_start, lay.inter_size)
        self.gate_up_proj = Linear(
            arch.hidden_size,
            {0: inter, 1: inter},
            arch.mlp_bias,
            dtype,
            quant,
            [f"{prefix}.gate_proj", f"{prefix}.up_proj"],
            column_parallel(tp, {0: part, 1: part}),
        )
        self.down_proj = Linear(
            inter,
            {None: arch.hidden_size},
            arch.mlp_bias,
            dtype,
            quant,
            [f"{prefix}.down_proj"],
            row_parallel(tp, *part),
        )

    def forward(self, ops: KernelDispatch, x: torch.Tensor) -> torch.Tensor:
        # At decode sizes the plan may fuse silu_and_mul into the gate_up projection's GEMV.
        h = gate_up_silu(x, self.gate_up_proj, ops)
        return self.down_proj(h, ops)


class DecoderLayer(nn.Module):
    def __init__(
        self,
        arch: ModelArch,
        dtype: torch.dtype,
        quant: QuantConfig | None = None,
        prefix: str = "",
        tp: TPGroup | None = None,
        lay: TPLayout | None = None,
        index: int = 0,
    ) -> None:
        super().__init__()
        self.self_attn = Attention(arch, dtype, quant, f"{prefix}.self_attn", tp, lay)
        # Same call either way: MLP and SparseMoE both map [T, H] -> [T, H] given ops. Their
        # linears are named as in the checkpoint (Mixtral's MoE block is block_sparse_moe).
        if arch.is_moe_layer(index):
            block = "block_sparse_moe" if arch.moe_family == "mixtral" else "mlp"
            self.mlp = SparseMoE.from_arch(arch, dtype, quant, f"{prefix}.{block}", tp, lay)
        else:
            self.mlp = MLP(arch, dtype, quant, f"{prefix}.mlp", tp, lay)
        self.input_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps, dtype)
        self.post_attention_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps, dtype)

    def forward(
        self,
        ops: KernelDispatch,
        positions: torch.Tensor,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        kv_cache: KVCache,
        meta: AttentionMetadata,
        cos_sin_cache: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual = x
            x = self.input_layernorm(ops, x)
        else:
            x = self.input_layernorm(ops, x, residual)
        x = self.self_attn(ops, positions, x, kv_cache, meta, cos_sin_cache)
        x = self.post_attention_layernorm(ops, x, residual)
        return self.mlp(ops, x), residual


class LlamaModel(nn.Module):
    def __init__(
        self,
        arch: ModelArch,
        dtype: torch.dtype,
        quant: QuantConfig | None = None,
        prefix: str = "",
        tp: TPGroup | None = None,
        lay: TPLayout | None = None,
    ) -> None:
        super().__init__()
        lay = lay or TPLayout.build(arch)
        self.embed_tokens = (
            VocabParallelEmbedding(arch.vocab_size, arch.hidden_size, dtype)
            if tp is None
            else VocabParallelEmbedding(
                arch.vocab_size, arch.hidden_size, dtype, tp, lay.vocab_start, lay.vocab_per_rank
            )
        )
        self.layers = nn.ModuleList(
            DecoderLayer(arch, dtype, quant, f"{prefix}.layers.{i}", tp, lay, i)
            for i in range(arch.num_layers)
        )
        self.norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps, dtype)


class LlamaForCausalLM(nn.Module):
    """Parameter names follow the Hugging Face checkpoints except the merged projections
    (qkv_proj <- q/k/v_proj, gate_up_proj <- gate/up_proj); `stacked_params` maps them."""

    ops: KernelDispatch | None  # set by the runner once the device is known
    cos_sin_cache: torch.Tensor

    # checkpoint name fragment -> (our fragment, shard)
    stacked_params = {
        "q_proj": ("qkv_proj", "q"),
        "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }

    def __init__(
        self,
        arch: ModelArch,
        dtype: torch.dtype,
        quant: QuantConfig | None = None,
        tp: TPGroup | None = None,
    ) -> None:
        """tp: this rank's tensor-parallel group (None: the whole model on one device)."""
        super().__init__()
        self.arch = arch
        self.tp = tp
        self.layout = lay = (
            TPLayout.build(arch) if tp is None else TPLayout.build(arch, tp.rank, tp.size)
        )
        self.model = LlamaModel(arch, dtype, quant, "model", tp, lay)
        # Checkpoint name fragments spelled differently from our module paths (Mixtral's MoE
        # block); the loader applies them to checkpoint names and to the linears' prefixes.
        self.checkpoint_renames = (
            {".block_sparse_moe.": ".mlp."} if arch.moe_family == "mixtral" else {}
        )
        # Ops a decode graph holds beyond the dense ones (the runner checks they capture).
        self.graph_ops = ("moe_topk", "moe_experts") if arch.num_experts else ()
        self.lm_head = lm_head(arch, dtype, quant, tp, lay)
        rotary_and_ops(self, arch)

    def lm_head_weight(self) -> torch.Tensor | None:
        """The float [vocab, hidden] weight of the lm_head (None: it is quantized)."""
        if self.lm_head is None:
            return self.model.embed_tokens.weight
        return self.lm_head.method.dense_weight(self.lm_head)

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,  # [T] int64
        positions: torch.Tensor,  # [T] int64
        meta: AttentionMetadata,
        kv_caches: list[KVCache],
        logits_indices: torch.Tensor | None = None,  # [N] rows to compute logits for
        fp32_logits: bool = True,
    ) -> torch.Tensor:
        """Returns logits [N, vocab] (N = T when logits_indices is None), in fp32, or in the
        model's dtype with fp32_logits=False (the decode graphs: their argmax is the same on
        either, as the widening is exact and monotonic, and the sampler widens the rows it
        needs outside the graph; at batch 256 the fp32 copy and its argmax took 0.19 ms)."""
        x = self.hidden_states(input_ids, positions, meta, kv_caches)
        return self.compute_logits(x, logits_indices, fp32_logits)

    def hidden_states(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        kv_caches: list[KVCache],
    ) -> torch.Tensor:
        """The last layer's output after the final norm, [T, hidden]: what the lm_head reads,
        and the feature an EAGLE head reads (spec/eagle.py)."""
        ops = self.ops
        assert ops is not None, "set model.ops (a KernelDispatch) before running the model"
        x = self.model.embed_tokens(input_ids)
        layers = zip(self.model.layers, kv_caches, strict=True)
        residual = None
        for layer, kv_cache in layers:
            x, residual = layer(ops, positions, x, residual, kv_cache, meta, self.cos_sin_cache)
        return self.model.norm(ops, x, residual)

    def compute_logits(
        self,
        x: torch.Tensor,
        logits_indices: torch.Tensor | None = None,
        fp32_logits: bool = True,
    ) -> torch.Tensor:
        """Logits of the rows logits_indices of hidden states x (see forward)."""
        ops = self.ops
        if logits_indices is not None:
            x = x[logits_indices]
        # The lm_head reads the whole vocabulary matrix per step: the GEMV path at decode.
        if self.lm_head is None:
            logits = linear(x, self.model.embed_tokens.weight, None, ops)
        else:
            logits = self.lm_head(x, ops)
        if self.tp is not None:
            # Every rank gets the whole row (rank 0 samples; the others drop it), padding cut.
            logits = self.tp.all_gather_cols(logits)[:, : self.arch.vocab_size]
            return logits.float() if fp32_logits else logits.contiguous()
        return logits.float() if fp32_logits else logits
