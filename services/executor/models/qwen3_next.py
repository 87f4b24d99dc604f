"""The hybrid linear-attention family: Qwen3-Next and Qwen3.5 / 3.6 (dense and MoE).

Most layers are Gated DeltaNet (linear attention with a fixed-size state per request, kept in
the state cache beside the KV cache: services/executor/state_cache.py); every few layers
(`layer_types`, or `full_attention_interval`) is a gated full attention over the paged KV
cache. transformers' modeling code (qwen3_next, qwen3_5, qwen3_5_moe) is the reference:

- Gated DeltaNet: projections to q, k (linear_num_key_heads x key dim), v, z (value heads x
  value dim) and b, a (one per value head): Qwen3.5's separate in_proj_qkv / in_proj_z /
  in_proj_b / in_proj_a (merged here into one linear; two, q/k/v + z and b + a, where a
  quantized checkpoint keeps b and a float), Qwen3-Next's fused in_proj_qkvz /
  in_proj_ba (grouped per key head, regrouped after the product as transformers does); the
  causal conv1d with SiLU over q, k, v with its conv state; the gated delta rule (q and k
  L2-normalised inside it, beta = sigmoid(b), g = -exp(A_log) * softplus(a + dt_bias)); the
  gated RMSNorm with z; out_proj. Only dispatch ops (kernels/linear_attention), so the CPU runs
  the torch references and CUDA the kernels.
- Gated full attention: q_proj doubled (per head: the query, then its gate), q/k RMSNorm per
  head, partial rotary (0.25), output times sigmoid(gate), o_proj.
- RMSNorms zero-centred: x_norm * (1 + weight) (the gated RMSNorm is not).
- Dense MLP, or MoE with a shared expert behind a sigmoid gate (models/moe.py).

Qwen3.5's rotary is multimodal (mrope); for text every section reads the same position, which
is plain rotary. The forward has the Llama class's interface (models/llama.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from voltserve.kernels.attention.rotary import build_cos_sin_cache
from voltserve.kernels.dispatch import KernelDispatch
from voltserve.services.executor.models.layers import (
    AttentionMetadata,
    Linear,
    VocabParallelEmbedding,
    linear,
    paged_attend,
)
from voltserve.services.executor.models.llama import MLP, KVCache, ModelArch
from voltserve.services.executor.models.moe import SparseMoE
from voltserve.services.executor.quant.base import UNQUANTIZED, QuantConfig
from voltserve.services.executor.state_cache import LayerStateSpec, StateCache
from voltserve.services.executor.tp.layout import TPLayout

LINEAR = "linear_attention"
FULL = "full_attention"


@dataclass
class HybridArch(ModelArch):
    """ModelArch plus the linear-attention layers' shapes and which layer is which."""

    layer_types: tuple[str, ...] = ()
    linear_num_key_heads: int = 0
    linear_num_value_heads: int = 0
    linear_key_head_dim: int = 0
    linear_value_head_dim: int = 0
    linear_conv_kernel_dim: int = 4
    # Qwen3-Next's fused in_proj_qkvz / in_proj_ba (else Qwen3.5's four projections).
    fused_gdn_proj: bool = False
    attn_output_gate: bool = True

    @property
    def num_kv_layers(self) -> int:
        return sum(t == FULL for t in self.layer_types)

    @property
    def conv_dim(self) -> int:
        return (
            2 * self.linear_num_key_heads * self.linear_key_head_dim
            + self.linear_num_value_heads * self.linear_value_head_dim
        )


class ZeroCenteredRMSNorm(nn.Module):
    """RMSNorm scaled by (1 + weight): the checkpoint stores the offset from one."""

    def __init__(self, size: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(size, dtype=dtype), requires_grad=False)
        self._scale: torch.Tensor | None = None

    def scale(self) -> torch.Tensor:
        # Formed once, after loading (weights do not change while serving).
        if self._scale is None or self._scale.device != self.weight.device:
            self._scale = (1.0 + self.weight.float()).to(self.weight.dtype)
        return self._scale

    def forward(
        self, ops: KernelDispatch, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor:
        if residual is None:
            return ops.rms_norm(x, self.scale(), self.eps)
        ops.fused_add_rms_norm(x, residual, self.scale(), self.eps)
        return x


class GatedAttention(nn.Module):
    """Full attention with an output gate: q_proj gives each head's query and gate side by
    side; q/k RMSNorm (zero-centred) per head; partial rotary; o * sigmoid(gate)."""

    def __init__(
        self, arch: HybridArch, dtype: torch.dtype, quant: QuantConfig | None, prefix: str
    ) -> None:
        super().__init__()
        hd = arch.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = arch.num_heads, arch.num_kv_heads, hd
        self.gated = arch.attn_output_gate
        self.q_size = arch.num_heads * hd
        self.kv_size = arch.num_kv_heads * hd
        self.scale = hd**-0.5
        q_out = self.q_size * (2 if self.gated else 1)
        self.qkv_proj = Linear(
            arch.hidden_size,
            {"q": q_out, "k": self.kv_size, "v": self.kv_size},
            arch.qkv_bias,
            dtype,
            quant,
            [f"{prefix}.q_proj", f"{prefix}.k_proj", f"{prefix}.v_proj"],
        )
        self.o_proj = Linear(
            self.q_size, {None: arch.hidden_size}, arch.o_bias, dtype, quant, [f"{prefix}.o_proj"]
        )
        self.q_norm = ZeroCenteredRMSNorm(hd, arch.rms_norm_eps, dtype)
        self.k_norm = ZeroCenteredRMSNorm(hd, arch.rms_norm_eps, dtype)

    def forward(
        self,
        ops: KernelDispatch,
        positions: torch.Tensor,
        x: torch.Tensor,
        kv_cache: KVCache,
        meta: AttentionMetadata,
        cos_sin_cache: torch.Tensor,
    ) -> torch.Tensor:
        T, hd = x.shape[0], self.head_dim
        k_cache, v_cache = kv_cache
        qkv = self.qkv_proj(x, ops)
        q_all, k, v = qkv.split([qkv.shape[1] - 2 * self.kv_size, self.kv_size, self.kv_size], -1)
        gate = None
        if self.gated:
            qg = q_all.reshape(T, self.num_heads, 2 * hd)
            q_all, gate = qg[..., :hd], qg[..., hd:].reshape(T, self.q_size)
        q = self.q_norm(ops, q_all.reshape(-1, hd)).view(T, self.q_size)
        k = self.k_norm(ops, k.reshape(-1, hd)).view(T, self.kv_size)
        v = v.contiguous()
        ops.rotary_and_cache(
            positions, q, k, v, hd, cos_sin_cache, True, k_cache, v_cache, meta.slot_mapping
        )
        q = q.view(T, self.num_heads, hd)
        o = paged_attend(ops, q, k_cache, v_cache, meta, self.scale)
        o = o.reshape(T, self.q_size)
        if gate is not None:
            o = o * torch.sigmoid(gate)
        return self.o_proj(o, ops)


class _Conv1dWeight(nn.Module):
    """Holds the depthwise conv's weight under the checkpoint's name (conv1d.weight)."""

    def __init__(self, channels: int, kernel: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = nn.Parameter(
            torch.empty(channels, 1, kernel, dtype=dtype), requires_grad=False
        )


class GatedDeltaNet(nn.Module):
    """The linear-attention token mixer; its state lives in the state cache's pools of this
    layer, indexed by meta.state_slots."""

    def __init__(
        self, arch: HybridArch, dtype: torch.dtype, quant: QuantConfig | None, prefix: str
    ) -> None:
        super().__init__()
        self.hk, self.hv = arch.linear_num_key_heads, arch.linear_num_value_heads
        self.dk, self.dv = arch.linear_key_head_dim, arch.linear_value_head_dim
        if self.hv % self.hk:
            raise ValueError(
                f"linear_num_value_heads {self.hv} is not a multiple of linear_num_key_heads "
                f"{self.hk}"
            )
        self.key_dim, self.value_dim = self.hk * self.dk, self.hv * self.dv
        self.conv_dim = arch.conv_dim
        self.fused = arch.fused_gdn_proj
        H = arch.hidden_size
        if self.fused:
            self.in_proj_qkvz = Linear(
                H,
                {None: 2 * self.key_dim + 2 * self.value_dim},
                False,
                dtype,
                quant,
                [f"{prefix}.in_proj_qkvz"],
            )
            self.in_proj_ba = Linear(
                H, {None: 2 * self.hv}, False, dtype, quant, [f"{prefix}.in_proj_ba"]
            )
        else:
            sizes = {"qkv": self.conv_dim, "z": self.value_dim, "b": self.hv, "a": self.hv}
            prefixes = [f"{prefix}.in_proj_{n}" for n in sizes]
            if (quant or UNQUANTIZED).one_method(prefixes):
                # One product for the four projections (their shards side by side).
                self.in_proj = Linear(H, sizes, False, dtype, quant, prefixes)
            else:
                # Quantized checkpoints keep the narrow b / a projections float: two products,
                # q/k/v + z in the checkpoint's format and b + a in theirs.
                self.in_proj = None
                self.in_proj_qkvz = Linear(
                    H, {"qkv": sizes["qkv"], "z": sizes["z"]}, False, dtype, quant, prefixes[:2]
                )
                self.in_proj_ba = Linear(
                    H, {"b": self.hv, "a": self.hv}, False, dtype, quant, prefixes[2:]
                )
        self.conv1d = _Conv1dWeight(self.conv_dim, arch.linear_conv_kernel_dim, dtype)
        # fp32 whatever the run dtype: the gates are computed in fp32 (kernel contract).
        self.A_log = nn.Parameter(torch.empty(self.hv, dtype=torch.float32), requires_grad=False)
        self.dt_bias = nn.Parameter(torch.empty(self.hv, dtype=torch.float32), requires_grad=False)
        self.norm = _PlainWeight(self.dv, dtype)
        self.eps = arch.rms_norm_eps
        self.out_proj = Linear(
            self.value_dim, {None: H}, False, dtype, quant, [f"{prefix}.out_proj"]
        )

    def _project(
        self, ops: KernelDispatch, x: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(mixed qkv [T, conv_dim], z [T, value_dim], b [T, Hv], a [T, Hv])."""
        T = x.shape[0]
        if not self.fused:
            if self.in_proj is not None:
                y = self.in_proj(x, ops)
                return y.split([self.conv_dim, self.value_dim, self.hv, self.hv], dim=-1)
            mixed, z = self.in_proj_qkvz(x, ops).split([self.conv_dim, self.value_dim], dim=-1)
            b, a = self.in_proj_ba(x, ops).split([self.hv, self.hv], dim=-1)
            return mixed, z, b, a
        # Qwen3-Next groups the outputs per key head: [q, k, v of its value heads, z of them],
        # and [b of its value heads, a of them].
        rep = self.hv // self.hk
        qkvz = self.in_proj_qkvz(x, ops).view(T, self.hk, 2 * self.dk + 2 * rep * self.dv)
        q, k, v, z = qkvz.split([self.dk, self.dk, rep * self.dv, rep * self.dv], dim=-1)
        ba = self.in_proj_ba(x, ops).view(T, self.hk, 2 * rep)
        b, a = ba.split([rep, rep], dim=-1)
        mixed = torch.cat([q.reshape(T, -1), k.reshape(T, -1), v.reshape(T, -1)], dim=-1)
        return mixed, z.reshape(T, -1), b.reshape(T, -1), a.reshape(T, -1)

    def forward(
        self,
        ops: KernelDispatch,
        x: torch.Tensor,
        state: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        T = x.shape[0]
        conv_pool, state_pool = state
        slots = meta.state_slots
        mixed, z, b, a = self._project(ops, x)
        mixed = mixed.contiguous()
        w = self.conv1d.weight.view(self.conv_dim, -1)
        if meta.is_decode:
            mixed = ops.causal_conv1d_decode(mixed, w, conv_pool, slots)
        else:
            cu, has_initial = _varlen(meta)
            mixed = ops.causal_conv1d_prefill(mixed, w, conv_pool, cu, slots, has_initial)
        q, k, v = mixed.split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
        q = q.reshape(T, self.hk, self.dk)
        k = k.reshape(T, self.hk, self.dk)
        v = v.reshape(T, self.hv, self.dv)
        b, a = b.contiguous(), a.contiguous()
        if meta.is_decode:
            o = ops.gated_delta_rule_decode(
                q, k, v, a, b, self.A_log, self.dt_bias, state_pool, slots
            )
        else:
            o = ops.gated_delta_rule_prefill(
                q, k, v, a, b, self.A_log, self.dt_bias, state_pool, cu, slots, has_initial
            )
        o = ops.gated_rms_norm(
            o.reshape(T * self.hv, self.dv),
            z.reshape(T * self.hv, self.dv),
            self.norm.weight,
            self.eps,
        )
        return self.out_proj(o.view(T, self.value_dim), ops)


class _PlainWeight(nn.Module):
    """The gated RMSNorm's weight (multiplied as stored, not zero-centred)."""

    def __init__(self, size: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(size, dtype=dtype), requires_grad=False)


def _varlen(meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
    """The step's sequences as the prefill ops take them: query starts (int64) and whether each
    continues from its slot's state (its chunk starts past position 0: a later chunk of a
    prompt, or a decode row inside a mixed step)."""
    cu = meta.query_start_loc.long()
    query_lens = cu[1:] - cu[:-1]
    return cu, meta.seq_lens.long() > query_lens


class HybridDecoderLayer(nn.Module):
    def __init__(
        self,
        arch: HybridArch,
        dtype: torch.dtype,
        quant: QuantConfig | None,
        prefix: str,
        index: int,
        lay: TPLayout,
    ) -> None:
        super().__init__()
        self.kind = arch.layer_types[index]
        if self.kind == LINEAR:
            self.linear_attn = GatedDeltaNet(arch, dtype, quant, f"{prefix}.linear_attn")
        else:
            self.self_attn = GatedAttention(arch, dtype, quant, f"{prefix}.self_attn")
        if arch.is_moe_layer(index):
            self.mlp = SparseMoE.from_arch(arch, dtype, quant, f"{prefix}.mlp", None, lay)
        else:
            self.mlp = MLP(arch, dtype, quant, f"{prefix}.mlp", None, lay)
        self.input_layernorm = ZeroCenteredRMSNorm(arch.hidden_size, arch.rms_norm_eps, dtype)
        self.post_attention_layernorm = ZeroCenteredRMSNorm(
            arch.hidden_size, arch.rms_norm_eps, dtype
        )

    def forward(
        self,
        ops: KernelDispatch,
        positions: torch.Tensor,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        cache: KVCache,
        meta: AttentionMetadata,
        cos_sin_cache: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """cache: the layer's KV cache (full attention) or its state pools (linear)."""
        if residual is None:
            residual = x
            x = self.input_layernorm(ops, x)
        else:
            x = self.input_layernorm(ops, x, residual)
        if self.kind == LINEAR:
            x = self.linear_attn(ops, x, cache, meta)
        else:
            x = self.self_attn(ops, positions, x, cache, meta, cos_sin_cache)
        x = self.post_attention_layernorm(ops, x, residual)
        return self.mlp(ops, x), residual


class HybridModel(nn.Module):
    def __init__(
        self,
        arch: HybridArch,
        dtype: torch.dtype,
        quant: QuantConfig | None,
        lay: TPLayout,
        prefix: str = "model",
    ) -> None:
        """prefix: the layers' checkpoint names (the quantization config's module lists name
        them so)."""
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(arch.vocab_size, arch.hidden_size, dtype)
        self.layers = nn.ModuleList(
            HybridDecoderLayer(arch, dtype, quant, f"{prefix}.layers.{i}", i, lay)
            for i in range(arch.num_layers)
        )
        self.norm = ZeroCenteredRMSNorm(arch.hidden_size, arch.rms_norm_eps, dtype)


class Qwen3NextForCausalLM(nn.Module):
    """Qwen3-Next and Qwen3.5 / 3.6 (their CausalLM and vision-language layouts: the latter's
    weights sit under model.language_model., renamed on load; vision and MTP weights are not
    loaded). kv_caches holds the full-attention layers' caches, in layer order; the linear
    layers read their pools from `state_cache` (set by the runner)."""

    def __init__(
        self,
        arch: HybridArch,
        dtype: torch.dtype,
        quant: QuantConfig | None = None,
        tp=None,
        language_model_prefix: bool = False,
    ) -> None:
        super().__init__()
        if tp is not None:
            raise ValueError(f"{arch.architecture}: tensor parallelism is not supported yet")
        self.arch = arch
        self.tp = None
        self.layout = lay = TPLayout.build(arch)
        # The linears carry their checkpoint names (model.language_model.layers.N... in the
        # vision-language layout); the loader renames both sides to our module paths.
        text = "model.language_model" if language_model_prefix else "model"
        self.model = HybridModel(arch, dtype, quant, lay, text)
        self.checkpoint_renames = {f"{text}.": "model."} if language_model_prefix else {}
        self.graph_ops = (
            "causal_conv1d_decode",
            "gated_delta_rule_decode",
            "gated_rms_norm",
        ) + (("moe_topk", "moe_experts") if arch.num_experts else ())
        if arch.tie_word_embeddings:
            self.lm_head = None
        else:
            self.lm_head = Linear(
                arch.hidden_size, {None: arch.vocab_size}, False, dtype, quant, ["lm_head"]
            )
        cache = build_cos_sin_cache(
            arch.rotary_dim, arch.max_position_embeddings, arch.rope_theta, arch.rope_scaling
        )
        self.register_buffer("cos_sin_cache", cache, persistent=False)
        self.ops: KernelDispatch | None = None  # set by the runner
        self.state_cache: StateCache | None = None  # set by the runner

    def state_specs(self) -> list[LayerStateSpec]:
        """One per linear-attention layer, in layer order (state_cache.py)."""
        a = self.arch
        conv = (a.conv_dim, a.linear_conv_kernel_dim - 1)
        rec = (a.linear_num_value_heads, a.linear_key_head_dim, a.linear_value_head_dim)
        return [LayerStateSpec(conv, rec) for t in a.layer_types if t == LINEAR]

    def lm_head_weight(self) -> torch.Tensor | None:
        if self.lm_head is None:
            return self.model.embed_tokens.weight
        return self.lm_head.method.dense_weight(self.lm_head)

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        kv_caches: list[KVCache],
        logits_indices: torch.Tensor | None = None,
        fp32_logits: bool = True,
    ) -> torch.Tensor:
        x = self.hidden_states(input_ids, positions, meta, kv_caches)
        return self.compute_logits(x, logits_indices, fp32_logits)

    def hidden_states(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        kv_caches: list[KVCache],
    ) -> torch.Tensor:
        ops = self.ops
        assert ops is not None, "set model.ops (a KernelDispatch) before running the model"
        if self.state_cache is None or meta.state_slots is None:
            raise RuntimeError(
                f"{self.arch.architecture} needs its state cache and the step's state slots"
            )
        kv = iter(kv_caches)
        states = iter(self.state_cache.layers)
        x = self.model.embed_tokens(input_ids)
        residual = None
        for layer in self.model.layers:
            cache = next(states) if layer.kind == LINEAR else next(kv)
            x, residual = layer(ops, positions, x, residual, cache, meta, self.cos_sin_cache)
        return self.model.norm(ops, x, residual)

    def compute_logits(
        self,
        x: torch.Tensor,
        logits_indices: torch.Tensor | None = None,
        fp32_logits: bool = True,
    ) -> torch.Tensor:
        if logits_indices is not None:
            x = x[logits_indices]
        if self.lm_head is None:
            logits = linear(x, self.model.embed_tokens.weight, None, self.ops)
        else:
            logits = self.lm_head(x, self.ops)
        return logits.float() if fp32_logits else logits
