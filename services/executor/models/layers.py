"""Small layers shared by the model files: linears that know how to load their checkpoint shards,
RMSNorm, the attention metadata of a flat batch.

Quantization seam: a Linear delegates its parameters, loading and products to a LinearMethod
(services/executor/quant/) that its checkpoint's QuantConfig picks from the linear's checkpoint
names: the plain float weight (UnquantizedMethod), AWQ/GPTQ/compressed-tensors/GGUF codes, ...
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from voltserve.kernels.dispatch import KernelDispatch
from voltserve.services.executor.linear_plan import GEMV, MAX_ROWS, linear_impl
from voltserve.services.executor.quant.base import UNQUANTIZED, QuantConfig, UnquantizedMethod

# Linears with at most this many input rows (decode steps of small batches, the sampled rows of
# the lm_head) may go to ops.gemv, a weight-streaming kernel; more rows go to cuBLAS, which wins
# once the product has enough rows to use tensor cores. Which of the two serves each weight shape
# and row count is ops.linear_plan's choice (measured at start-up on CUDA, see linear_plan.py);
# without a plan (CPU, tests) every such linear goes to ops.gemv, which is F.linear on CPU.
GEMV_MAX_ROWS = MAX_ROWS


def linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    ops: KernelDispatch | None = None,
) -> torch.Tensor:
    """y = x W^T (+ b) for x [T, K]: ops.gemv when T <= GEMV_MAX_ROWS and the plan says so,
    else torch."""
    if (
        ops is not None
        and x.dim() == 2
        and 0 < x.shape[0] <= GEMV_MAX_ROWS
        and linear_impl(ops, x.shape[0], weight.shape[0], weight.shape[1]) == GEMV
    ):
        return ops.gemv(x, weight, bias)
    return F.linear(x, weight, bias)


def gate_up_silu(x: torch.Tensor, gate_up: Linear, ops: KernelDispatch) -> torch.Tensor:
    """silu_and_mul(gate_up(x)): the gated MLP's first half. Decode-sized inputs may run it as
    one gemv_gate_up launch (silu_and_mul fused into the GEMV's output), as the plan says; a
    quantized method runs its own (fused or not) variant."""
    return gate_up.method.apply_gate_up_silu(gate_up, x, ops)


@dataclass
class AttentionMetadata:
    """How the T query rows of one step map onto sequences and the paged KV cache."""

    slot_mapping: torch.Tensor  # [T] int64; -1 = padding row (skipped by reshape_and_cache)
    block_tables: torch.Tensor  # [B, max_blocks] int32
    seq_lens: torch.Tensor  # [B] int32, KV length after this step's tokens are written
    query_start_loc: torch.Tensor  # [B + 1] int32
    # Every sequence has exactly one query row (row b is sequence b): use the decode kernel.
    is_decode: bool
    # Longest query of the step, known on the host (the prefill kernel sizes its grid with it).
    max_query_len: int | None = None


class Linear(nn.Module):
    """y = x W^T (+ b). Output shards (q/k/v, gate/up) live side by side in one weight.

    `prefixes` are the checkpoint names of the shards, in shard order (q_proj, k_proj, v_proj
    of a merged qkv_proj); `quant` picks the method from them (none: the plain float weight)."""

    def __init__(
        self,
        in_features: int,
        shard_sizes: dict[str | int | None, int],
        bias: bool,
        dtype: torch.dtype,
        quant: QuantConfig | None = None,
        prefixes: list[str] | None = None,
    ) -> None:
        super().__init__()
        self.in_features = in_features
        self.shard_offsets: dict[str | int | None, tuple[int, int]] = {}
        off = 0
        for shard, size in shard_sizes.items():
            self.shard_offsets[shard] = (off, size)
            off += size
        self.out_features = off
        self.prefixes = list(prefixes or [])
        # Without checkpoint names the linear is a plain float one (loaded by its module path).
        quant = quant or UNQUANTIZED
        self.method = quant.method_for(self.prefixes) if self.prefixes else UnquantizedMethod()
        self.method.create_weights(self, bias, dtype)

    def load_weight(self, param_name: str, shard: str | int | None, tensor: torch.Tensor) -> None:
        """Hand one checkpoint tensor of one shard to the method; it raises naming the shape on
        a mismatch."""
        self.method.load(self, param_name, shard, tensor)

    def forward(self, x: torch.Tensor, ops: KernelDispatch | None = None) -> torch.Tensor:
        """Without ops (tests, tools): plain torch. The model passes its ops, so decode-sized
        inputs run the GEMV kernel on CUDA (captured in the decode graphs)."""
        return self.method.apply(self, x, ops)


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(size, dtype=dtype), requires_grad=False)

    def forward(
        self, ops: KernelDispatch, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor:
        if residual is None:
            return ops.rms_norm(x, self.weight, self.eps)
        # In place: residual += x; x = norm(residual). Saves a [T, H] round trip per layer.
        ops.fused_add_rms_norm(x, residual, self.weight, self.eps)
        return x
