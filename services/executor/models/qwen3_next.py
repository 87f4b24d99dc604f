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

Tensor parallelism (TPLayout): a Gated DeltaNet is split by heads, each rank holding
Hk / tp key heads and the Hv / tp value heads that read them. Its projections are
column-parallel (each rank takes its heads' rows of q, k, v, z, b and a; Qwen3-Next's fused
projections are grouped per key head, so a rank's rows are one contiguous slice); the conv
weights, A_log and dt_bias are narrowed to the same channels and value heads; the gated RMSNorm
is per head; out_proj is row-parallel (one all-reduce). The state cache holds this rank's
channels and value heads only (state_specs). The gated full attention splits as Llama's
(a head's query and gate rows together), the MLP / MoE as theirs, the vocabulary as Llama's.

Qwen3.5's rotary is multimodal (mrope); for text every section reads the same position, which
is plain rotary. The forward has the Llama class's interface (models/llama.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn
from voltserve.kernels.dispatch import KernelDispatch
from voltserve.services.executor.models.layers import (
    AttentionMetadata,
    Linear,
    VocabParallelEmbedding,
    linear,
    lm_head,
    paged_attend,
    rotary_and_ops,
)
from voltserve.services.executor.models.llama import MLP, KVCache, ModelArch
from voltserve.services.executor.models.moe import SparseMoE
from voltserve.services.executor.quant.base import UNQUANTIZED, QuantConfig
from voltserve.services.executor.state_cache import LayerStateSpec, StateCache
from voltserve.services.executor.tp.group import TPGroup
from voltserve.services.executor.tp.layout import TPLayout
from voltserve.services.executor.tp.sharding import column_parallel, narrow, row_parallel

if TYPE_CHECKING:
    from voltserve.services.executor.kv_quant import KVQuant
    from voltserve.services.executor.state_rollback import VerifyLayout

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
        self,
        arch: HybridArch,
        dtype: torch.dtype,
        quant: QuantConfig | None,
        prefix: str,
        tp: TPGroup | None,
        lay: TPLayout,
    ) -> None:
        """tp / lay: this rank's query heads (each with its gate rows) and KV heads."""
        super().__init__()
        hd = arch.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = lay.num_heads, lay.num_kv_heads, hd
        self.gated = arch.attn_output_gate
        self.q_size = lay.num_heads * hd
        self.kv_size = lay.num_kv_heads * hd
        self.scale = hd**-0.5
        per_head = hd * (2 if self.gated else 1)
        kv_slice = (lay.kv_head_start * hd, self.kv_size)
        self.qkv_proj = Linear(
            arch.hidden_size,
            {
                "q": arch.num_heads * per_head,
                "k": arch.num_kv_heads * hd,
                "v": arch.num_kv_heads * hd,
            },
            arch.qkv_bias,
            dtype,
            quant,
            [f"{prefix}.q_proj", f"{prefix}.k_proj", f"{prefix}.v_proj"],
            column_parallel(
                tp,
                {
                    "q": (lay.head_start * per_head, lay.num_heads * per_head),
                    "k": kv_slice,
                    "v": kv_slice,
                },
            ),
        )
        self.o_proj = Linear(
            arch.num_heads * hd,
            {None: arch.hidden_size},
            arch.o_bias,
            dtype,
            quant,
            [f"{prefix}.o_proj"],
            row_parallel(tp, lay.head_start * hd, self.q_size),
        )
        self.q_norm = ZeroCenteredRMSNorm(hd, arch.rms_norm_eps, dtype)
        self.k_norm = ZeroCenteredRMSNorm(hd, arch.rms_norm_eps, dtype)
        # A one-byte KV cache's format and scales (kv_quant.install); None: the run dtype's.
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
        if self.kv_quant is not None:
            ops.rotary_embedding(positions, q, k, hd, cos_sin_cache, True)
            self.kv_quant.write(ops, k, v, k_cache, v_cache, meta.slot_mapping)
            o = self.kv_quant.attend(
                ops, q.view(T, self.num_heads, hd), k_cache, v_cache, meta, self.scale
            )
        else:
            ops.rotary_and_cache(
                positions, q, k, v, hd, cos_sin_cache, True, k_cache, v_cache, meta.slot_mapping
            )
            o = paged_attend(ops, q.view(T, self.num_heads, hd), k_cache, v_cache, meta, self.scale)
        o = o.reshape(T, self.q_size)
        if gate is not None:
            o = o * torch.sigmoid(gate)
        return self.o_proj(o, ops)


class _Conv1dWeight(nn.Module):
    """Holds the depthwise conv's weight under the checkpoint's name (conv1d.weight): this
    rank's channels, the checkpoint's (start, length) ranges `parts` of its `full` channels
    (its q, k and v heads' channels)."""

    def __init__(
        self, full: int, parts: list[tuple[int, int]], kernel: int, dtype: torch.dtype
    ) -> None:
        super().__init__()
        self.full, self.parts = full, parts
        channels = sum(n for _, n in parts)
        self.weight = nn.Parameter(
            torch.empty(channels, 1, kernel, dtype=dtype), requires_grad=False
        )

    def load_weight(self, param_name: str, shard: str | int | None, tensor: torch.Tensor) -> None:
        want = (self.full, *self.weight.shape[1:])
        if tuple(tensor.shape) != want:
            raise ValueError(
                f"shape mismatch: checkpoint has {tuple(tensor.shape)}, model expects {want}"
            )
        local = [narrow(tensor, 0, s, n, param_name) for s, n in self.parts]
        self.weight.data.copy_(torch.cat(local))


class GatedDeltaNet(nn.Module):
    """The linear-attention token mixer; its state lives in the state cache's pools of this
    layer, indexed by meta.state_slots."""

    def __init__(
        self,
        arch: HybridArch,
        dtype: torch.dtype,
        quant: QuantConfig | None,
        prefix: str,
        tp: TPGroup | None,
        lay: TPLayout,
    ) -> None:
        """tp / lay: this rank's key heads and value heads (all of them without tp)."""
        super().__init__()
        full_hk, full_hv = arch.linear_num_key_heads, arch.linear_num_value_heads
        if full_hv % full_hk:
            raise ValueError(
                f"linear_num_value_heads {full_hv} is not a multiple of linear_num_key_heads "
                f"{full_hk}"
            )
        self.hk, self.hv = lay.lin_key_heads, lay.lin_value_heads  # this rank's
        self.dk, self.dv = arch.linear_key_head_dim, arch.linear_value_head_dim
        dk, dv, k0, v0 = self.dk, self.dv, lay.lin_key_start, lay.lin_value_start
        self.key_dim, self.value_dim = self.hk * dk, self.hv * dv
        self.conv_dim = 2 * self.key_dim + self.value_dim
        full_key_dim, full_value_dim = full_hk * dk, full_hv * dv
        self.fused = arch.fused_gdn_proj
        H = arch.hidden_size
        if self.fused:
            # Grouped per key head: a rank's key heads are one contiguous block of rows.
            per_k = 2 * dk + 2 * (full_hv // full_hk) * dv
            self.in_proj_qkvz = Linear(
                H,
                {None: full_hk * per_k},
                False,
                dtype,
                quant,
                [f"{prefix}.in_proj_qkvz"],
                column_parallel(tp, {None: (k0 * per_k, self.hk * per_k)}),
            )
            per_ba = 2 * (full_hv // full_hk)
            self.in_proj_ba = Linear(
                H,
                {None: full_hk * per_ba},
                False,
                dtype,
                quant,
                [f"{prefix}.in_proj_ba"],
                column_parallel(tp, {None: (k0 * per_ba, self.hk * per_ba)}),
            )
        else:
            # in_proj_qkv stacks q, k and v: loaded as three shards (Linear.sources), so a
            # rank takes its own heads of each.
            sizes = {
                "q": full_key_dim,
                "k": full_key_dim,
                "v": full_value_dim,
                "z": full_value_dim,
                "b": full_hv,
                "a": full_hv,
            }
            kd, vd = (k0 * dk, self.key_dim), (v0 * dv, self.value_dim)
            slices = {"q": kd, "k": kd, "v": vd, "z": vd, "b": (v0, self.hv), "a": (v0, self.hv)}
            names = {n: f"{prefix}.in_proj_{'qkv' if n in ('q', 'k', 'v') else n}" for n in sizes}
            sources = {"qkv": ("q", "k", "v")}
            distinct = [f"{prefix}.in_proj_{n}" for n in ("qkv", "z", "b", "a")]

            def part(keys: tuple[str, ...]) -> Linear:
                return Linear(
                    H,
                    {n: sizes[n] for n in keys},
                    False,
                    dtype,
                    quant,
                    [names[n] for n in keys],
                    column_parallel(tp, {n: slices[n] for n in keys}),
                    sources,
                )

            if (quant or UNQUANTIZED).one_method(distinct):
                # One product for the four projections (their shards side by side).
                self.in_proj = part(("q", "k", "v", "z", "b", "a"))
            else:
                # Quantized checkpoints keep the narrow b / a projections float: two products,
                # q/k/v + z in the checkpoint's format and b + a in theirs.
                self.in_proj = None
                self.in_proj_qkvz = part(("q", "k", "v", "z"))
                self.in_proj_ba = part(("b", "a"))
        conv_parts = [
            (k0 * dk, self.key_dim),
            (full_key_dim + k0 * dk, self.key_dim),
            (2 * full_key_dim + v0 * dv, self.value_dim),
        ]
        self.conv1d = _Conv1dWeight(arch.conv_dim, conv_parts, arch.linear_conv_kernel_dim, dtype)
        # fp32 whatever the run dtype: the gates are computed in fp32 (kernel contract).
        self.A_log = nn.Parameter(torch.empty(self.hv, dtype=torch.float32), requires_grad=False)
        self.dt_bias = nn.Parameter(torch.empty(self.hv, dtype=torch.float32), requires_grad=False)
        self.full_hv, self.v0 = full_hv, v0
        self.norm = _PlainWeight(self.dv, dtype)
        self.eps = arch.rms_norm_eps
        self.out_proj = Linear(
            full_value_dim,
            {None: H},
            False,
            dtype,
            quant,
            [f"{prefix}.out_proj"],
            row_parallel(tp, v0 * dv, self.value_dim),
        )

    def load_weight(self, param_name: str, shard: str | int | None, tensor: torch.Tensor) -> None:
        """A_log / dt_bias (one per value head): this rank's value heads."""
        if param_name not in ("A_log", "dt_bias"):
            raise KeyError(f"Gated DeltaNet has no parameter {param_name!r}")
        if tuple(tensor.shape) != (self.full_hv,):
            raise ValueError(
                f"shape mismatch: checkpoint has {tuple(tensor.shape)}, model expects "
                f"{(self.full_hv,)}"
            )
        getattr(self, param_name).data.copy_(tensor[self.v0 : self.v0 + self.hv])

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
        snap: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """snap: in a verify step, this layer's whole pools (request slots and snapshot area,
        state_rollback.py)."""
        T = x.shape[0]
        mixed, z, b, a = self._project(ops, x)
        mixed, b, a = mixed.contiguous(), b.contiguous(), a.contiguous()
        if meta.verify_layout is not None:
            assert snap is not None
            o = self._mix_layout(ops, mixed, b, a, meta.verify_layout, snap)
        elif meta.verify_states is not None:
            assert snap is not None
            o = self._mix_verify(ops, mixed, b, a, state, meta, snap)
        else:
            o = self._mix(ops, mixed, b, a, state, meta)
        o = ops.gated_rms_norm(
            o.reshape(T * self.hv, self.dv),
            z.reshape(T * self.hv, self.dv),
            self.norm.weight,
            self.eps,
        )
        return self.out_proj(o.view(T, self.value_dim), ops)

    def _qkv(self, mixed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        T = mixed.shape[0]
        q, k, v = mixed.split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
        return (
            q.reshape(T, self.hk, self.dk),
            k.reshape(T, self.hk, self.dk),
            v.reshape(T, self.hv, self.dv),
        )

    def _mix(
        self,
        ops: KernelDispatch,
        mixed: torch.Tensor,
        b: torch.Tensor,
        a: torch.Tensor,
        state: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """The conv and the gated delta rule over the step's rows: o [T, Hv, Dv]."""
        slots = meta.state_slots
        if meta.is_decode:
            return self._decode(ops, mixed, b, a, state, slots)
        cu, has_initial = _varlen(meta)
        return self._mix_varlen(ops, mixed, b, a, state, cu, slots, has_initial)

    def _decode(
        self,
        ops: KernelDispatch,
        mixed: torch.Tensor,
        b: torch.Tensor,
        a: torch.Tensor,
        state: tuple[torch.Tensor, torch.Tensor],
        slots: torch.Tensor,
    ) -> torch.Tensor:
        """The decode ops over rows of one position each (slot -1: skipped): o [R, Hv, Dv]."""
        conv_pool, state_pool = state
        w = self.conv1d.weight.view(self.conv_dim, -1)
        mixed = ops.causal_conv1d_decode(mixed, w, conv_pool, slots)
        q, k, v = self._qkv(mixed)
        return ops.gated_delta_rule_decode(
            q, k, v, a, b, self.A_log, self.dt_bias, state_pool, slots
        )

    def _mix_varlen(
        self,
        ops: KernelDispatch,
        mixed: torch.Tensor,
        b: torch.Tensor,
        a: torch.Tensor,
        state: tuple[torch.Tensor, torch.Tensor],
        cu: torch.Tensor,
        slots: torch.Tensor,
        has_initial: torch.Tensor,
    ) -> torch.Tensor:
        """The varlen ops over sequences given by their query starts cu (int64)."""
        conv_pool, state_pool = state
        w = self.conv1d.weight.view(self.conv_dim, -1)
        mixed = ops.causal_conv1d_prefill(mixed, w, conv_pool, cu, slots, has_initial)
        q, k, v = self._qkv(mixed)
        return ops.gated_delta_rule_prefill(
            q, k, v, a, b, self.A_log, self.dt_bias, state_pool, cu, slots, has_initial
        )

    def _mix_verify(
        self,
        ops: KernelDispatch,
        mixed: torch.Tensor,
        b: torch.Tensor,
        a: torch.Tensor,
        state: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
        pools: tuple[torch.Tensor, torch.Tensor],
    ) -> torch.Tensor:
        """_mix for an eager verify step: the verify groups gathered into the verify ops'
        layout (state_rollback.VerifyIndex) and walked as a graph's (_mix_layout); the other
        sequences (prefill chunks, plain decodes) through the varlen ops."""
        ix = meta.verify_states.index(mixed.device)
        o = mixed.new_zeros((mixed.shape[0], self.hv, self.dv))
        if ix.others is not None:
            rows, idx = ix.other_rows, ix.others
            o[rows] = self._mix_varlen(
                ops,
                mixed[rows].contiguous(),
                b[rows].contiguous(),
                a[rows].contiguous(),
                state,
                ix.other_cu,
                meta.state_slots[idx],
                meta.seq_lens[idx].long() > ix.other_lens,
            )
        g = ix.gather
        og = self._walk(ops, mixed[g], b[g], a[g], ix.row_slots, ix.snap_rows, pools)
        o[ix.live_rows] = og[ix.live]
        return o

    def _mix_layout(
        self,
        ops: KernelDispatch,
        mixed: torch.Tensor,
        b: torch.Tensor,
        a: torch.Tensor,
        lay: VerifyLayout,
        pools: tuple[torch.Tensor, torch.Tensor],
    ) -> torch.Tensor:
        """_mix for a verify graph's step (fixed layout, no host reads)."""
        return self._walk(ops, mixed, b, a, lay.row_slots, lay.snap_rows, pools)

    def _walk(
        self,
        ops: KernelDispatch,
        mixed: torch.Tensor,
        b: torch.Tensor,
        a: torch.Tensor,
        row_slots: torch.Tensor,
        snap_rows: torch.Tensor,
        pools: tuple[torch.Tensor, torch.Tensor],
    ) -> torch.Tensor:
        """Every verify sequence's rows in order through the verify ops, one launch per state
        kind, the state after each row that a later live row follows into its snapshot row
        (kernels/linear_attention/verify.py)."""
        conv_rows, state_rows = pools
        w = self.conv1d.weight.view(self.conv_dim, -1)
        mixed = ops.causal_conv1d_verify(mixed, w, conv_rows, row_slots, snap_rows)
        q, k, v = self._qkv(mixed)
        return ops.gated_delta_rule_verify(
            q, k, v, a, b, self.A_log, self.dt_bias, state_rows, row_slots, snap_rows
        )


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
        tp: TPGroup | None,
        lay: TPLayout,
    ) -> None:
        super().__init__()
        self.kind = arch.layer_types[index]
        if self.kind == LINEAR:
            self.linear_attn = GatedDeltaNet(arch, dtype, quant, f"{prefix}.linear_attn", tp, lay)
        else:
            self.self_attn = GatedAttention(arch, dtype, quant, f"{prefix}.self_attn", tp, lay)
        if arch.is_moe_layer(index):
            self.mlp = SparseMoE.from_arch(arch, dtype, quant, f"{prefix}.mlp", tp, lay)
        else:
            self.mlp = MLP(arch, dtype, quant, f"{prefix}.mlp", tp, lay)
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
        snap: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """cache: the layer's KV cache (full attention) or its state pools (linear); snap: in a
        verify step, a linear layer's whole pools (state_rollback.py)."""
        if residual is None:
            residual = x
            x = self.input_layernorm(ops, x)
        else:
            x = self.input_layernorm(ops, x, residual)
        if self.kind == LINEAR:
            x = self.linear_attn(ops, x, cache, meta, snap)
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
        tp: TPGroup | None,
        lay: TPLayout,
        prefix: str = "model",
    ) -> None:
        """prefix: the layers' checkpoint names (the quantization config's module lists name
        them so)."""
        super().__init__()
        self.embed_tokens = (
            VocabParallelEmbedding(arch.vocab_size, arch.hidden_size, dtype)
            if tp is None
            else VocabParallelEmbedding(
                arch.vocab_size, arch.hidden_size, dtype, tp, lay.vocab_start, lay.vocab_per_rank
            )
        )
        self.layers = nn.ModuleList(
            HybridDecoderLayer(arch, dtype, quant, f"{prefix}.layers.{i}", i, tp, lay)
            for i in range(arch.num_layers)
        )
        self.norm = ZeroCenteredRMSNorm(arch.hidden_size, arch.rms_norm_eps, dtype)


class Qwen3NextForCausalLM(nn.Module):
    """Qwen3-Next and Qwen3.5 / 3.6 (their CausalLM and vision-language layouts: the latter's
    weights sit under model.language_model., renamed on load; vision and MTP weights are not
    loaded). kv_caches holds the full-attention layers' caches, in layer order; the linear
    layers read their pools from `state_cache` (set by the runner)."""

    ops: KernelDispatch | None  # set by the runner
    cos_sin_cache: torch.Tensor

    def __init__(
        self,
        arch: HybridArch,
        dtype: torch.dtype,
        quant: QuantConfig | None = None,
        tp: TPGroup | None = None,
        language_model_prefix: bool = False,
    ) -> None:
        """tp: this rank's tensor-parallel group (None: the whole model on one device)."""
        super().__init__()
        self.arch = arch
        self.tp = tp
        self.layout = lay = (
            TPLayout.build(arch) if tp is None else TPLayout.build(arch, tp.rank, tp.size)
        )
        # The linears carry their checkpoint names (model.language_model.layers.N... in the
        # vision-language layout); the loader renames both sides to our module paths.
        text = "model.language_model" if language_model_prefix else "model"
        self.model = HybridModel(arch, dtype, quant, tp, lay, text)
        self.checkpoint_renames = {f"{text}.": "model."} if language_model_prefix else {}
        self.graph_ops = (
            "causal_conv1d_decode",
            "gated_delta_rule_decode",
            "causal_conv1d_verify",
            "gated_delta_rule_verify",
            "gated_rms_norm",
        ) + (("moe_topk", "moe_experts") if arch.num_experts else ())
        self.lm_head = lm_head(arch, dtype, quant, tp, lay)
        rotary_and_ops(self, arch)
        self.state_cache: StateCache | None = None  # set by the runner

    def state_specs(self) -> list[LayerStateSpec]:
        """One per linear-attention layer, in layer order (state_cache.py): this rank's conv
        channels and value heads."""
        a, lay = self.arch, self.layout
        channels = 2 * lay.lin_key_heads * a.linear_key_head_dim
        channels += lay.lin_value_heads * a.linear_value_head_dim
        conv = (channels, a.linear_conv_kernel_dim - 1)
        rec = (lay.lin_value_heads, a.linear_key_head_dim, a.linear_value_head_dim)
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
        vs = meta.verify_layout or meta.verify_states
        snaps = iter(vs.pools) if vs is not None else None
        x = self.model.embed_tokens(input_ids)
        residual = None
        for layer in self.model.layers:
            snap = None
            if layer.kind == LINEAR:
                cache = next(states)
                snap = next(snaps) if snaps is not None else None
            else:
                cache = next(kv)
            x, residual = layer(ops, positions, x, residual, cache, meta, self.cos_sin_cache, snap)
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
        if self.tp is not None:
            # Every rank gets the whole row (rank 0 samples; the others drop it), padding cut.
            logits = self.tp.all_gather_cols(logits)[:, : self.arch.vocab_size]
            return logits.float() if fp32_logits else logits.contiguous()
        return logits.float() if fp32_logits else logits
