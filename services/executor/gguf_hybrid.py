"""The hybrid linear-attention GGUF files (qwen3next, qwen35, qwen35moe) back to the Hugging
Face layout models/qwen3_next.py loads: Qwen3.5's four Gated DeltaNet projections.

llama.cpp's converter writes these models so (undone here):
- names: in_proj_qkv -> attn_qkv, in_proj_z -> attn_gate, in_proj_b / in_proj_a -> ssm_beta /
  ssm_alpha, Qwen3-Next's in_proj_ba -> ssm_ba, A_log -> ssm_a, dt_bias -> ssm_dt.bias,
  conv1d -> ssm_conv1d, the gated RMSNorm -> ssm_norm, out_proj -> ssm_out,
  post_attention_layernorm -> post_attention_norm;
- Qwen3-Next's fused in_proj_qkvz (grouped per key head) split into attn_qkv (all q, all k,
  all v) and attn_gate (z); its in_proj_ba kept grouped per key head ([b, a] of each);
- ssm_a = -exp(A_log); the zero-centred RMSNorm weights stored as 1 + weight (not ssm_norm);
  the conv weight [C, 1, K] squeezed to [C, K];
- Qwen3.5 (qwen35, qwen35moe) with fewer key than value heads: every value-head axis (the v
  rows of attn_qkv and the v channels of ssm_conv1d, attn_gate's rows, ssm_beta / ssm_alpha,
  ssm_a, ssm_dt, ssm_out's columns) reordered from grouped by key head ([Hk, r]) to tiled
  ([r, Hk]).

Rows reorder the same in a quantized tensor (each row is its own blocks); ssm_out's columns
move in value-head chunks, whole blocks where the head dim is a multiple of the block, else
ssm_out is dequantized on load (a float linear).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from voltserve.kernels.linear.gguf_blocks import BLOCK_TYPES

# GGUF block leaf -> Hugging Face leaf (model.layers.N.<leaf>)
LAYER = {
    "attn_norm.weight": "input_layernorm.weight",
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "attn_qkv.weight": "linear_attn.in_proj_qkv.weight",
    "attn_gate.weight": "linear_attn.in_proj_z.weight",
    "ssm_beta.weight": "linear_attn.in_proj_b.weight",
    "ssm_alpha.weight": "linear_attn.in_proj_a.weight",
    "ssm_out.weight": "linear_attn.out_proj.weight",
    "ssm_norm.weight": "linear_attn.norm.weight",
    "ssm_conv1d.weight": "linear_attn.conv1d.weight",
    "ssm_a": "linear_attn.A_log",
    "ssm_dt.bias": "linear_attn.dt_bias",
}
# Qwen3-Next's [b, a] per key head: split into Qwen3.5's two projections
BA = "ssm_ba.weight"
_SPLIT_BA = ("linear_attn.in_proj_b.weight", "linear_attn.in_proj_a.weight")
# stored as 1 + weight (the zero-centred RMSNorms; ssm_norm is a plain one)
_OFFSET_NORMS = ("attn_norm.weight", "post_attention_norm.weight", "attn_q_norm.weight")
_OFFSET_NORMS += ("attn_k_norm.weight",)
# leaves whose rows (dim 0) are value-head major in Qwen3.5 files: head size of a row block
_TILED_ROWS = {"attn_gate.weight": "dv", "ssm_beta.weight": 1, "ssm_alpha.weight": 1}
_TILED_ROWS |= {"ssm_a": 1, "ssm_dt.bias": 1}


@dataclass
class HybridLayout:
    """The Gated DeltaNet shapes of a hybrid file and whether its value heads are tiled."""

    arch: str
    key_heads: int
    value_heads: int
    key_dim: int  # per head
    value_dim: int  # per head

    @classmethod
    def from_config(cls, arch: str, cfg: dict[str, Any]) -> HybridLayout:
        return cls(
            arch,
            cfg["linear_num_key_heads"],
            cfg["linear_num_value_heads"],
            cfg["linear_key_head_dim"],
            cfg["linear_value_head_dim"],
        )

    @property
    def tiled(self) -> bool:
        return self.arch in ("qwen35", "qwen35moe") and self.key_heads != self.value_heads

    @property
    def rep(self) -> int:
        return self.value_heads // self.key_heads

    def hf_leaves(self, leaf: str) -> list[str]:
        """The Hugging Face leaves a GGUF leaf becomes (none: not a hybrid leaf)."""
        if leaf == BA:
            return list(_SPLIT_BA) if self.arch == "qwen3next" else []
        return [LAYER[leaf]] if leaf in LAYER else []

    def out_needs_float(self, kind: str) -> bool:
        """ssm_out of this ggml type cannot move its columns as whole blocks."""
        return self.tiled and kind in BLOCK_TYPES and self.value_dim % BLOCK_TYPES[kind].block != 0

    def _untile_rows(self, x: torch.Tensor, size: int) -> torch.Tensor:
        """Rows [r, Hk, size] (tiled) -> [Hk, r, size] (grouped by key head)."""
        r, hk = self.rep, self.key_heads
        return x.reshape(r, hk, size, *x.shape[1:]).transpose(0, 1).reshape(x.shape)

    def convert(
        self, leaf: str, x: torch.Tensor, kind: str, dequant: Any
    ) -> list[tuple[str, torch.Tensor]]:
        """(Hugging Face leaf, tensor) for a hybrid GGUF leaf's tensor x (float, or the raw
        block rows [N, row bytes] of a quantized one); dequant(kind, raw, K) -> float."""
        if leaf == BA:
            rows = x.reshape(self.key_heads, 2 * self.rep, *x.shape[1:])
            b, a = rows[:, : self.rep], rows[:, self.rep :]
            shape = (self.value_heads, *x.shape[1:])
            return [(_SPLIT_BA[0], b.reshape(shape)), (_SPLIT_BA[1], a.reshape(shape))]
        out = LAYER[leaf]
        if leaf in _OFFSET_NORMS:
            return [(out, x.float() - 1.0)]
        if leaf == "ssm_a":
            x = torch.log(-x.float())
        if self.tiled:
            x = self._untile(leaf, x, kind, dequant)
        if leaf == "ssm_conv1d.weight":
            x = x.reshape(x.shape[0], 1, x.shape[-1])
        return [(out, x.contiguous())]

    def _untile(self, leaf: str, x: torch.Tensor, kind: str, dequant: Any) -> torch.Tensor:
        dv = self.value_dim
        if leaf in _TILED_ROWS:
            size = _TILED_ROWS[leaf]
            return self._untile_rows(x, dv if size == "dv" else size)
        if leaf in ("attn_qkv.weight", "ssm_conv1d.weight"):
            qk = 2 * self.key_heads * self.key_dim
            return torch.cat([x[:qk], self._untile_rows(x[qk:], dv)])
        if leaf == "ssm_out.weight":
            n, k = x.shape[0], self.value_heads * dv
            if kind in BLOCK_TYPES:
                if self.out_needs_float(kind):
                    x = dequant(kind, x, k)
                else:
                    bt = BLOCK_TYPES[kind]
                    dv = dv // bt.block * bt.nbytes  # a head's bytes in a row
            r, hk = self.rep, self.key_heads
            return x.reshape(n, r, hk, dv).transpose(1, 2).reshape(n, -1)
        return x
