"""Decode steps as captured CUDA graphs.

A decode step launches a few kernels per layer, each costing tens of microseconds of CPU (numba
launches especially); replaying a captured graph costs one launch. Graphs are captured once, at
startup, for padded batch sizes 1, 2, 4, 8, 16, 24, 32, ... up to max_graph_batch_size, all
sharing one memory pool (captured largest first, so smaller ones reuse its memory).

Inputs live in static buffers that every graph reads; a step copies its batch into them and pads
rows B..padded-1 with token 0, position 0, slot -1 (no KV write; the torch fallback writes the
scratch block), seq_len 1 and an all-zero block table row (a real, readable block), so padded rows
compute finite garbage that nobody reads. Block tables are captured at the full width
(max_model_len / block_size), so any sequence up to max_model_len replays correctly.

Sampling stays outside the graph: the graph ends with the logits of every row, and the sampler's
greedy fast path is a single argmax on them.
"""

from __future__ import annotations

import bisect
import logging
from typing import TYPE_CHECKING

import torch
from voltserve.services.executor.models.layers import AttentionMetadata
from voltserve.shared import startup

if TYPE_CHECKING:
    from voltserve.services.executor.model_runner import DeviceBatch, ModelRunner

logger = logging.getLogger(__name__)


def graph_batch_sizes(max_batch: int) -> list[int]:
    sizes = [s for s in (1, 2, 4, 8) if s <= max_batch]
    sizes += list(range(16, max_batch + 1, 8))
    if max_batch > 0 and sizes[-1] != max_batch:
        sizes.append(max_batch)
    return sizes


class CudaGraphRunner:
    def __init__(self, runner: ModelRunner, max_batch: int) -> None:
        self.model = runner.model
        self.kv_caches = runner.kv_caches
        self.device = runner.device
        self.sizes = graph_batch_sizes(max_batch)
        n, width = self.sizes[-1], runner.max_blocks_per_seq
        dev = self.device
        self.input_ids = torch.zeros(n, dtype=torch.int64, device=dev)
        self.positions = torch.zeros(n, dtype=torch.int64, device=dev)
        self.slot_mapping = torch.full((n,), -1, dtype=torch.int64, device=dev)
        self.block_tables = torch.zeros((n, width), dtype=torch.int32, device=dev)
        self.seq_lens = torch.ones(n, dtype=torch.int32, device=dev)
        self.query_start_loc = torch.arange(n + 1, dtype=torch.int32, device=dev)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.num_replays = 0
        self._capture_all()

    def _meta(self, bs: int) -> AttentionMetadata:
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:bs],
            block_tables=self.block_tables[:bs],
            seq_lens=self.seq_lens[:bs],
            query_start_loc=self.query_start_loc[: bs + 1],
            is_decode=True,
        )

    def _forward(self, bs: int) -> torch.Tensor:
        return self.model(
            self.input_ids[:bs], self.positions[:bs], self._meta(bs), self.kv_caches, None
        )

    @torch.inference_mode()
    def _capture_all(self) -> None:
        pool = torch.cuda.graph_pool_handle()
        for bs in startup.progress(list(reversed(self.sizes)), "capturing CUDA graphs"):
            # Warm up eagerly first: numba compiles, cuBLAS picks its kernels and workspaces.
            self._forward(bs)
            torch.cuda.synchronize()
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, pool=pool):
                self.outputs[bs] = self._forward(bs)
            self.graphs[bs] = g
        torch.cuda.synchronize()
        logger.info("captured decode CUDA graphs for batch sizes %s", self.sizes)

    def can_run(self, num_seqs: int) -> bool:
        return 0 < num_seqs <= self.sizes[-1]

    def padded_size(self, num_seqs: int) -> int:
        return self.sizes[bisect.bisect_left(self.sizes, num_seqs)]

    def run(self, batch: DeviceBatch) -> torch.Tensor:
        """Logits [B, vocab] of a decode-only batch (row b = sequence b)."""
        B = batch.num_seqs
        bs = self.padded_size(B)
        meta = batch.meta
        w = meta.block_tables.shape[1]
        self.input_ids[:B].copy_(batch.input_ids)
        self.positions[:B].copy_(batch.positions)
        self.slot_mapping[:B].copy_(meta.slot_mapping)
        self.block_tables[:B, :w].copy_(meta.block_tables)
        self.block_tables[:B, w:].zero_()
        self.seq_lens[:B].copy_(meta.seq_lens)
        if bs > B:
            self.input_ids[B:bs].zero_()
            self.positions[B:bs].zero_()
            self.slot_mapping[B:bs].fill_(-1)
            self.block_tables[B:bs].zero_()
            self.seq_lens[B:bs].fill_(1)
        self.graphs[bs].replay()
        self.num_replays += 1
        return self.outputs[bs][:B]
