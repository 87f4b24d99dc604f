"""Decode steps as captured CUDA graphs.

A decode step launches a few kernels per layer, each costing tens of microseconds of CPU (numba
launches especially); replaying a captured graph costs one launch. Graphs are captured once, at
startup, for padded batch sizes 1, 2, 4, 8, 16, 24, 32, ... up to max_graph_batch_size (or the
configured cuda_graph_sizes), all
sharing one memory pool (captured largest first, so smaller ones reuse its memory).

Inputs live in static buffers that every graph reads; a step fills them and pads rows
B..padded-1 with token 0, position 0, slot -1 (no KV write; the torch fallback writes the scratch
block), seq_len 1, an all-zero block table row (a real, readable block) and, for a model with
linear-attention state, state slot -1 (the conv and recurrent decode kernels leave no state for
it), so padded rows compute finite garbage that nobody reads. Block tables are captured at the full width
(max_model_len / block_size), so any sequence up to max_model_len replays correctly; a step
moves only the columns its rows read (and those an earlier step left nonzero, which it zeroes).

The static buffers are typed views of ONE device byte buffer, laid out
[input_ids i64 | positions i64 | slot_mapping i64 | state_slots i64 | seq_lens i32 |
block_tables i32 row-major] (state_slots only for a model with linear-attention state),
with a pinned host twin of the same layout. The runner's decode path (`stage` + `replay_staged`)
writes a step straight into the host twin and moves it with one host-to-device copy of the bytes
the padded batch reads before the tables and one 2-D copy of the table columns in use: no
per-field copies, no dtype conversions, no fills on the device.
The buffers, the capture and the padding are graph_set.py's, shared with speculation's graphs.

Sampling stays outside the graph: the graph ends with the logits of every row (in the model's
dtype) and their argmax (captured with the step, so the sampler's greedy fast path launches
nothing: it copies the ids back); any other sampling runs on the logits, widened to fp32. The
argmax of a row whose logits are not all finite is NONFINITE (sampler.flag_nonfinite, inside the
graph): the same copy back tells the engine which requests to end with an error. A step fed
those ids on the device (the pipelined decode) reads them clamped to a valid id.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import numpy as np
import torch
from voltserve.kernels.sampling.sampling import chunked_argmax
from voltserve.services.executor.graph_set import GraphSet, Staging
from voltserve.services.executor.input_batch import attention_metadata
from voltserve.services.executor.models.layers import AttentionMetadata
from voltserve.services.executor.sampler import flag_nonfinite

if TYPE_CHECKING:
    from voltserve.services.executor.model_runner import ModelRunner

logger = logging.getLogger(__name__)


def graph_batch_sizes(max_batch: int, wanted: tuple[int, ...] = ()) -> list[int]:
    """The padded batch sizes to capture: `wanted` (EngineConfig.cuda_graph_sizes) up to
    max_batch, or the default ladder 1, 2, 4, 8, 16, 24, ... max_batch."""
    if wanted:
        if any(s < 1 for s in wanted):
            raise ValueError(f"cuda_graph_sizes must be positive, got {list(wanted)}")
        sizes = sorted({s for s in wanted if s <= max_batch})
        if not sizes:
            raise ValueError(
                f"cuda_graph_sizes {list(wanted)} has no size <= the graph batch limit {max_batch}"
            )
        return sizes
    sizes = [s for s in (1, 2, 4, 8) if s <= max_batch]
    sizes += list(range(16, max_batch + 1, 8))
    if max_batch > 0 and sizes[-1] != max_batch:
        sizes.append(max_batch)
    return sizes


class CudaGraphRunner(GraphSet):
    what = "decode CUDA graphs"

    def __init__(
        self,
        runner: ModelRunner,
        max_batch: int,
        sizes: tuple[int, ...] = (),
        capture: bool = True,
    ) -> None:
        """capture=False: the static buffers only (the start-up trace runs `_forward` on them,
        see kernel_warmup.py)."""
        self.model = runner.model
        self.kv_caches = runner.kv_caches
        self.device = runner.device
        graph_sizes = graph_batch_sizes(max_batch, sizes)
        n, width = graph_sizes[-1], runner.max_blocks_per_seq
        dev = self.device
        self.width = width
        # Each request's linear-attention state slot (state_cache.py), for models with one.
        self.has_state = runner.state_cache is not None
        state = [("state", torch.int64, (n,))] if self.has_state else []
        # 8-byte fields first, so every view is aligned.
        self.st = Staging(
            [
                ("ids", torch.int64, (n,)),
                ("pos", torch.int64, (n,)),
                ("slots", torch.int64, (n,)),
                *state,
                ("seq_lens", torch.int32, (n,)),
                ("tables", torch.int32, (n, width)),
            ],
            dev,
        )
        d, h = self.st.dev, self.st.host
        self.state_slots = d.get("state")
        self.host_state = h.get("state")
        if self.has_state:
            self.state_slots.fill_(-1)
            self.host_state.fill(-1)
        self.input_ids, self.positions, self.slot_mapping = d["ids"], d["pos"], d["slots"]
        self.seq_lens, self.block_tables = d["seq_lens"], d["tables"]
        self.host_ids, self.host_pos, self.host_slots = h["ids"], h["pos"], h["slots"]
        self.host_seq_lens, self.host_tables = h["seq_lens"], h["tables"]
        # Per table row: the columns [0, c) that may hold nonzero blocks, on the host twin and
        # (once uploaded) on the device alike; beyond them both are zero. A step writes and
        # moves the columns its sequences read plus those an earlier step left, not the full
        # width (max_model_len / block_size: 16 MB a step for 256 rows at 262,144 tokens).
        self.table_cols = np.zeros(n, np.int64)
        self._upload_cols = width
        self.slot_mapping.fill_(-1)
        self.seq_lens.fill_(1)
        self.host_slots.fill(-1)
        self.host_seq_lens.fill(1)
        self.query_start_loc = torch.arange(n + 1, dtype=torch.int32, device=dev)
        # Every size's logits are rows of one buffer (allocated by the largest size's eager
        # warm-up, before any capture): outputs kept per size would hold sum(sizes) logits rows
        # in the graph pool (~1 GB at Llama-3's vocabulary and the default ladder to 256),
        # memory the KV sizing does not see. Only one graph replays at a time, and a step's
        # logits are read before the next replay on the same stream.
        self._logits: torch.Tensor | None = None
        self.argmax: dict[int, torch.Tensor] = {}
        # Called with (padded size, staged device bytes) just before a replay (runner-set).
        self.before_replay = None
        # The capture makes the memory pool (self.pool) that speculation's graphs share.
        self._init_graphs(graph_sizes, capture, pool=None)

    def _meta(self, bs: int) -> AttentionMetadata:
        return attention_metadata(
            self.slot_mapping[:bs],
            self.block_tables[:bs],
            self.seq_lens[:bs],
            self.query_start_loc[: bs + 1],
            is_decode=True,
            state_slots=self.state_slots[:bs] if self.has_state else None,
        )

    def _forward(self, bs: int) -> torch.Tensor:
        """Logits in the model's dtype (see the model's fp32_logits): the sampler widens them."""
        return self.model(
            self.input_ids[:bs],
            self.positions[:bs],
            self._meta(bs),
            self.kv_caches,
            None,
            fp32_logits=False,
        )

    def _warm_up(self, bs: int) -> None:
        # cuBLAS picks its kernels and workspaces, the decode attention sizes its merge counters
        # (numba compiled everything in the start-up compile phase); the largest size, first,
        # allocates the shared logits buffer outside the capture.
        self._shared_logits(self._forward(bs))

    def _record(self, bs: int) -> None:
        self.outputs[bs], self.argmax[bs] = self.graph_body(bs)

    def _shared_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """The one logits buffer of every size, shaped on the first (the largest) forward."""
        if self._logits is None:
            n = self.sizes[-1]
            self._logits = torch.empty(
                (n, *logits.shape[1:]), dtype=logits.dtype, device=logits.device
            )
        return self._logits

    def graph_body(self, bs: int) -> tuple[torch.Tensor, torch.Tensor]:
        """What the bs graph records: the step's logits copied into rows [0, bs) of the shared
        buffer (the forward's own output is then dead, so the next capture reuses its memory),
        and their argmax, NONFINITE in rows that are not all finite."""
        logits = self._forward(bs)
        out = self._shared_logits(logits)[:bs]
        out.copy_(logits)
        return out, flag_nonfinite(chunked_argmax(out), out)

    # ---- the runner's decode path: fill the host twin, one copy, replay ----------------------

    def stage(self, num_seqs: int, zero_rows: bool = True, cols: int | None = None) -> int:
        """Prepare the host twin for a batch of num_seqs rows; returns the padded size. The caller
        then writes rows [0, num_seqs) of host_ids, host_pos, host_slots, host_seq_lens,
        host_state (a model with linear-attention state) and columns [0, cols) of host_tables
        (default: the full width), and calls replay_staged. On return every other table entry
        of rows [0, padded) is zero (with zero_rows, those columns too); the copy moves only
        the columns that may differ from the device's (table_cols)."""
        bs = self.padded_size(num_seqs)
        self.st.wait()  # the previous step's copy has left the host buffer
        w = self.width if cols is None else cols
        # Columns an earlier step may have left nonzero in these rows (on both sides).
        c = max(w, int(self.table_cols[:bs].max()))
        t = self.host_tables
        if zero_rows:
            t[:bs, :c] = 0
        else:
            t[num_seqs:bs, :c] = 0
            if c > w:
                t[:num_seqs, w:c] = 0
        self.table_cols[:num_seqs] = w
        self.table_cols[num_seqs:bs] = 0
        self._upload_cols = c
        if bs > num_seqs:
            self.host_ids[num_seqs:bs] = 0
            self.host_pos[num_seqs:bs] = 0
            self.host_slots[num_seqs:bs] = -1
            self.host_seq_lens[num_seqs:bs] = 1
            if self.has_state:
                self.host_state[num_seqs:bs] = -1
        return bs

    def argmax_of_last(self, num_seqs: int) -> torch.Tensor:
        """The argmax ids [B] of the logits the last replay_staged(num_seqs) returned (NONFINITE
        in rows that are not all finite)."""
        return self.argmax[self.padded_size(num_seqs)][:num_seqs]

    def replay_staged(
        self, num_seqs: int, ids_on_device: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Copy the staged batch to the device (one transfer) and replay; logits [B, vocab] in
        the model's dtype.
        ids_on_device: the rows' input ids, already on the device (they replace the staged ones:
        the pipelined decode feeds a step the previous step's argmax without a host round trip;
        a NONFINITE id there is read as 0, in the same copy: that row's request ends with an
        error and its step is dropped, but the embedding lookup must not index out of range)."""
        bs = self.padded_size(num_seqs)
        n = self.st.end_of("tables", bs)  # the bytes the bs graph reads
        self.st.upload_columns("tables", bs, self._upload_cols)
        if ids_on_device is not None:
            torch.clamp(ids_on_device, min=0, out=self.input_ids[:num_seqs])
        if self.before_replay is not None:
            # Tensor parallelism: the other ranks receive these inputs and replay their twin.
            self.before_replay(bs, self.st.device_bytes(n))
        self._replay(bs)
        return self.outputs[bs][:num_seqs]
