"""Small layers shared by the model files: linears that know how to load their checkpoint shards,
RMSNorm, the attention metadata of a flat batch.

Quantization seam: a Linear delegates its parameters, loading and products to a LinearMethod
(services/executor/quant/) that its checkpoint's QuantConfig picks from the linear's checkpoint
names: the plain float weight (UnquantizedMethod), AWQ/GPTQ/compressed-tensors/GGUF codes, ...
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn
from voltserve.kernels.attention.rotary import build_cos_sin_cache
from voltserve.kernels.dispatch import KernelDispatch
from voltserve.services.executor.linear_plan import GEMV, MAX_ROWS, linear_impl
from voltserve.services.executor.quant.base import UNQUANTIZED, QuantConfig, UnquantizedMethod
from voltserve.services.executor.tp.group import TPGroup
from voltserve.services.executor.tp.sharding import (
    ColumnParallel,
    Cut,
    Parallel,
    RowParallel,
    column_parallel,
    narrow,
)

if TYPE_CHECKING:
    from voltserve.services.executor.models.llama import ModelArch
    from voltserve.services.executor.state_rollback import VerifyLayout, VerifyStates
    from voltserve.services.executor.tp.layout import TPLayout

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


# A step whose every sequence has at most this many query rows (speculative verify groups, a
# proposer's catch-up, short prompts) attends each row as a decode row of its own: the query at
# position p over keys 0..p of its sequence (the step's KV is written before attention), which is
# the prefill kernel's causal mask. The prefill kernel walks a sequence's whole context in one
# block per (query tile, head), so a few rows over a long context run on a few SMs, one KV block
# after another; the decode kernel splits the context over the grid and rereads it once per row,
# which short queries keep cheap. The speculative verify graphs attend their rows this way too.
# On CUDA only: the reference ops (CPU) loop over a batch's sequences in Python, so there the
# prefill form, a few sequences, is the cheap one.
ROW_DECODE_MAX_QUERY = 16


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
    # [B] int64: each sequence's slot in the linear-attention state cache (state_cache.py;
    # -1 = none: a padding row, or a model without such state). None: not staged.
    state_slots: torch.Tensor | None = None
    # An eager verify step of a model with linear-attention state: its verify groups and
    # their per-row state snapshots (state_rollback.py). None: no proposals in the step.
    verify_states: VerifyStates | None = None
    # A verify graph's step (spec/graphs.py) of a model with linear-attention state: its fixed
    # row layout, per-position state slots and snapshot area. None: not such a step.
    verify_layout: VerifyLayout | None = None
    _decode_rows: AttentionMetadata | None = field(default=None, repr=False, compare=False)

    def decode_rows(self) -> AttentionMetadata | None:
        """The step's query rows each as a decode row (ROW_DECODE_MAX_QUERY says when): per
        row its sequence's block-table row and seq_len = its position + 1, built once per step
        on the device without a host sync. None for a decode step, or where the longest query
        is unknown or longer."""
        if (
            self.is_decode
            or self.max_query_len is None
            or self.max_query_len > ROW_DECODE_MAX_QUERY
        ):
            return None
        if self._decode_rows is None:
            T = self.slot_mapping.shape[0]
            dev = self.seq_lens.device
            qsl = self.query_start_loc.long()
            row_of = torch.repeat_interleave(
                torch.arange(qsl.shape[0] - 1, device=dev), qsl[1:] - qsl[:-1], output_size=T
            )
            # row i of a sequence whose rows end before row `end` sits at seq_len - (end - i)
            ends = qsl[1:].index_select(0, row_of)
            pos = self.seq_lens.long().index_select(0, row_of) - ends + torch.arange(T, device=dev)
            self._decode_rows = attention_rows(
                self.slot_mapping, self.block_tables.index_select(0, row_of), pos + 1
            )
        return self._decode_rows


def attention_rows(
    slot_mapping: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor
) -> AttentionMetadata:
    """Decode metadata of T rows, each a sequence of its own (block_tables [T, W])."""
    T = slot_mapping.shape[0]
    return AttentionMetadata(
        slot_mapping=slot_mapping,
        block_tables=block_tables,
        seq_lens=seq_lens.to(torch.int32),
        query_start_loc=torch.arange(T + 1, dtype=torch.int32, device=seq_lens.device),
        is_decode=True,
        max_query_len=1,
    )


def paged_attend(
    ops: KernelDispatch,
    q: torch.Tensor,  # [T, num_heads, head_dim]
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """Attention of a step's query rows over the paged KV cache (written already): the decode
    kernel when every sequence has one query row or each row is attended as one
    (ROW_DECODE_MAX_QUERY), else the prefill kernel, which takes the longest query from the host
    so that it never syncs."""
    if ops.impl["paged_decode_attention"] == "cuda":
        meta = meta.decode_rows() or meta
    if meta.is_decode:
        return ops.paged_decode_attention(
            q, k_cache, v_cache, meta.block_tables, meta.seq_lens, scale
        )
    kw = {}
    if ops.impl["paged_attention"] == "cuda" and meta.max_query_len is not None:
        kw["max_query_len"] = meta.max_query_len
    return ops.paged_attention(
        q,
        k_cache,
        v_cache,
        meta.block_tables,
        meta.seq_lens,
        meta.query_start_loc,
        scale,
        **kw,
    )


class Linear(nn.Module):
    """y = x W^T (+ b). Output shards (q/k/v, gate/up) live side by side in one weight.

    `prefixes` are the checkpoint names of the shards, in shard order (q_proj, k_proj, v_proj
    of a merged qkv_proj); `quant` picks the method from them (none: the plain float weight).

    Tensor parallelism: with `parallel` a ColumnParallel, the linear holds only its rank's slice
    of each output shard (shard_sizes stay the logical sizes, checked against the checkpoint);
    with a RowParallel, only its slice of the input columns, and forward sums the ranks' partial
    products with one all-reduce (rank 0 holds the bias, the others zeros). The method narrows
    each checkpoint tensor (`local_tensor`: whole packed words and quantization groups for the
    integer formats), creates and packs the local shard only; its kernels run on its shapes.

    `sources`: a checkpoint tensor that holds several of the linear's shards stacked along the
    outputs (Qwen3.5's in_proj_qkv: q, k, v), by its shard name -> those shards in order; its
    prefix is repeated for each of them. Loading cuts it into them first, so a column-parallel
    rank takes its own heads of each (a contiguous slice of the stack would not be)."""

    def __init__(
        self,
        in_features: int,
        shard_sizes: dict[str | int | None, int],
        bias: bool,
        dtype: torch.dtype,
        quant: QuantConfig | None = None,
        prefixes: list[str] | None = None,
        parallel: Parallel | None = None,
        sources: dict[str, tuple[str | int | None, ...]] | None = None,
    ) -> None:
        super().__init__()
        self.parallel = parallel
        self.sources = dict(sources or {})
        self.logical_in_features = in_features
        self.logical_shard_sizes = dict(shard_sizes)
        if isinstance(parallel, ColumnParallel):
            shard_sizes = {k: parallel.slices[k][1] for k in shard_sizes}
        elif isinstance(parallel, RowParallel):
            in_features = parallel.length
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

    def checkpoint_shards(self) -> list[tuple[str, str | int | None]]:
        """(checkpoint prefix, shard it loads as) per checkpoint tensor group: a source stands
        for the shards it holds."""
        inner = {sub: src for src, subs in self.sources.items() for sub in subs}
        out: list[tuple[str, str | int | None]] = []
        for prefix, shard in zip(self.prefixes, self.shard_offsets, strict=True):
            shard = inner.get(shard, shard)
            if (prefix, shard) not in out:
                out.append((prefix, shard))
        return out

    def cut(self, shard: str | int | None) -> Cut | None:
        """This rank's part of one shard (None: the whole linear lives here)."""
        p = self.parallel
        if p is None:
            return None
        if isinstance(p, ColumnParallel):
            start, length = p.slices[shard]
            return Cut(True, start, length, self.logical_shard_sizes[shard], p.group.rank == 0)
        return Cut(False, p.start, p.length, self.logical_in_features, p.group.rank == 0)

    def local_slice(self, param_name: str, shard: str | int | None, tensor: torch.Tensor):
        """The part of one checkpoint tensor (of logical shape) that this rank holds: the
        method's shard rule (packed formats narrow on whole packed words and groups)."""
        cut = self.cut(shard)
        if cut is None:
            return tensor
        return self.method.local_tensor(self, param_name, shard, tensor, cut)

    def load_weight(self, param_name: str, shard: str | int | None, tensor: torch.Tensor) -> None:
        """Hand one checkpoint tensor of one shard (this rank's part of it) to the method; it
        raises naming the shape on a mismatch."""
        subs = self.sources.get(shard)
        if subs is not None:
            # Cut the stacked tensor into its shards (the method's shard rule: whole packed
            # words), then load each as its own (this rank's part of it).
            full = sum(self.logical_shard_sizes[s] for s in subs)
            off = 0
            for sub in subs:
                n = self.logical_shard_sizes[sub]
                part = Cut(True, off, n, full, True)
                self.load_weight(
                    param_name, sub, self.method.local_tensor(self, param_name, sub, tensor, part)
                )
                off += n
            return
        self.method.load(self, param_name, shard, self.local_slice(param_name, shard, tensor))

    def forward(self, x: torch.Tensor, ops: KernelDispatch | None = None) -> torch.Tensor:
        """Without ops (tests, tools): plain torch. The model passes its ops, so decode-sized
        inputs run the GEMV kernel on CUDA (captured in the decode graphs)."""
        y = self.method.apply(self, x, ops)
        p = self.parallel
        if isinstance(p, RowParallel) and p.reduce:
            # The partial products (rank 0's with the bias) summed: one all-reduce.
            y = p.group.all_reduce(y)
        return y


def lm_head(
    arch: ModelArch,
    dtype: torch.dtype,
    quant: QuantConfig | None,
    tp: TPGroup | None,
    lay: TPLayout,
) -> Linear | None:
    """The output projection, vocabulary-parallel: this rank's rows of the padded vocabulary
    (zeros past it). None when the embedding is tied (the model reads the embedding's rows)."""
    if arch.tie_word_embeddings:
        return None
    cut = column_parallel(tp, {None: (lay.vocab_start, lay.vocab_per_rank)})
    return Linear(arch.hidden_size, {None: arch.vocab_size}, False, dtype, quant, ["lm_head"], cut)


def rotary_and_ops(module: nn.Module, arch: ModelArch) -> None:
    """Give a model (or draft head) its rotary table, the non-persistent buffer `cos_sin_cache`
    (built on the current default device, so it moves with the module), and an empty `ops` slot
    that the runner fills once the device is known."""
    cache = build_cos_sin_cache(
        arch.rotary_dim, arch.max_position_embeddings, arch.rope_theta, arch.rope_scaling
    )
    module.register_buffer("cos_sin_cache", cache, persistent=False)
    module.ops = None


class VocabParallelEmbedding(nn.Module):
    """The embedding table, or with a TP group only rows [vocab_start, vocab_start + rows) of the
    padded vocabulary: a rank looks up the ids it holds, zeros the others, and one all-reduce
    sums the ranks' rows. The tied lm_head reads the same local rows."""

    def __init__(
        self,
        vocab_size: int,
        hidden: int,
        dtype: torch.dtype,
        group: TPGroup | None = None,
        vocab_start: int = 0,
        rows: int | None = None,
    ) -> None:
        super().__init__()
        self.vocab_size, self.group, self.vocab_start = vocab_size, group, vocab_start
        self.rows = vocab_size if rows is None else rows
        self.weight = nn.Parameter(torch.empty(self.rows, hidden, dtype=dtype), requires_grad=False)

    def load_weight(self, param_name: str, shard: str | int | None, tensor: torch.Tensor) -> None:
        if tensor.dim() != 2 or tuple(tensor.shape) != (self.vocab_size, self.weight.shape[1]):
            raise ValueError(
                f"shape mismatch: checkpoint has {tuple(tensor.shape)}, model expects "
                f"{(self.vocab_size, self.weight.shape[1])}"
            )
        self.weight.data.copy_(narrow(tensor, 0, self.vocab_start, self.rows, param_name))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.group is None:
            return F.embedding(ids, self.weight)
        local = ids - self.vocab_start
        outside = (local < 0) | (local >= self.rows)
        x = F.embedding(local.masked_fill(outside, 0), self.weight)
        x.masked_fill_(outside[:, None], 0)
        return self.group.all_reduce(x)


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
