"""Input-batch staging: a StepPlan's rows written into host buffers and copied to the device.

The eager step writes one flat batch into one pinned int64 host buffer (token ids, positions,
slots, block tables, sequence lengths, query starts, logits rows) and copies it to the device in
one transfer. Decode-only steps that a CUDA graph covers are written straight into the graph's
pinned staging buffer (already in the graph's dtypes and padded layout), and verify steps
(speculation) into the verify graph's. The block tables of recently staged requests are kept as
rows of one array across steps (BlockTableMirror). `attention_metadata` is where attention
metadata is built (the eager step, a tensor-parallel rank's copy of it, the KV sizing's profile
forward, a proposer's own forward, the decode and speculative CUDA graphs).
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import chain

import numpy as np
import torch
from voltserve.services.executor.models.layers import AttentionMetadata
from voltserve.services.executor.prompt_logprobs import prompt_logprob_rows
from voltserve.services.executor.request import Request, StepPlan
from voltserve.services.executor.sampler import SampleRow


def attention_metadata(
    slot_mapping: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    is_decode: bool,
    max_query_len: int | None = None,
    state_slots: torch.Tensor | None = None,
) -> AttentionMetadata:
    """The attention metadata of a forward over paged KV: block tables, lengths and query
    starts as the kernels take them (int32; a tensor that is already int32 is passed as it is,
    so a CUDA graph's static buffers stay the ones it reads), slots and state slots as given
    (int64)."""
    return AttentionMetadata(
        slot_mapping=slot_mapping,
        block_tables=block_tables.to(torch.int32),
        seq_lens=seq_lens.to(torch.int32),
        query_start_loc=query_start_loc.to(torch.int32),
        is_decode=is_decode,
        max_query_len=max_query_len,
        state_slots=state_slots,
    )


def flat_batch(
    d: list[torch.Tensor], num_seqs: int, width: int, is_decode: bool, max_query_len: int
) -> DeviceBatch:
    """The device batch over the flat buffer's parts (ids, positions, slots, block tables,
    sequence lengths, query starts, logits rows, state slots): the eager step's, on rank 0 and,
    from its broadcast, on the other tensor-parallel ranks."""
    meta = attention_metadata(
        d[2], d[3].view(num_seqs, width), d[4], d[5], is_decode, max_query_len, d[7]
    )
    return DeviceBatch(d[0], d[1], meta, d[6], num_seqs)


def _token_slice(r: Request, start: int, n: int) -> list[int]:
    """r.all_token_ids[start:start+n] without concatenating the whole history."""
    p = r.prompt_token_ids
    if start + n <= len(p):
        return p[start : start + n]
    if start >= len(p):
        o = start - len(p)
        return r.output_token_ids[o : o + n]
    return p[start:] + r.output_token_ids[: start + n - len(p)]


def verify_sample_rows(r: Request, spec, eos: tuple[int, ...]) -> list[SampleRow]:
    """A verify row group's sampling rows: the target's token after the last known token and
    after each proposed one (spec/acceptance.py)."""
    out_pos = len(r.output_token_ids)
    return [SampleRow(r, out_pos + j, eos, tuple(spec[:j])) for j in range(len(spec) + 1)]


def _row_tokens(r: Request, start: int, n: int, spec) -> list[int]:
    """The input tokens of one row: known tokens, then any proposed ones."""
    if not spec:
        return _token_slice(r, start, n)
    return _token_slice(r, start, n - len(spec)) + list(spec)


class BlockTableMirror:
    """Block tables of recently staged requests as rows of one int32 array, kept across steps so
    a decode step copies them with one gather instead of converting every request's block list.

    A request's row is written in full when it first shows up (or when its block list is a
    different list object: a preemption or a new request with the same id), and afterwards only
    the blocks appended since the last step. This relies on the block manager's rule that a
    request's block_ids list only ever grows by appending; any other change replaces the list.
    The mirror keeps a reference to the list it copied, so a new list can never be mistaken for
    it. Rows of requests not seen in a step are reclaimed (zeroed) when rows run out.
    Beyond a request's blocks, a row is all zeros.
    """

    def __init__(self, width: int, rows: int) -> None:
        self.width = width
        self.table = np.zeros((max(rows, 8), width), dtype=np.int32)
        # request_id -> [row, the block_ids list copied, blocks copied, last step seen]
        self.entries: dict[str, list] = {}
        self._free = list(range(len(self.table) - 1, -1, -1))
        self._step = 0

    def sync(self, reqs: list[Request]) -> tuple[list[int], list[int]]:
        """Bring the rows of reqs up to date; their row indices and block counts."""
        self._step = step = self._step + 1
        entries, table = self.entries, self.table
        rows: list[int] = []
        counts: list[int] = []
        for r in reqs:
            blk = r.block_ids
            e = entries.get(r.request_id)
            if e is None or e[1] is not blk or e[2] > len(blk):
                e = self._assign(r, e)
                table = self.table
            elif e[2] != len(blk):
                n = len(blk)
                if n > self.width:
                    table = self._widen(n)
                table[e[0], e[2] : n] = blk[e[2] : n]
                e[2] = n
            e[3] = step
            rows.append(e[0])
            counts.append(e[2])
        return rows, counts

    def _widen(self, n: int) -> np.ndarray:
        """Room for a request holding more blocks than a step can read (a caller that hands
        out blocks up front); the readers only look at the blocks a step needs."""
        wider = np.zeros((len(self.table), max(n, 2 * self.width)), dtype=np.int32)
        wider[:, : self.width] = self.table
        self.table, self.width = wider, wider.shape[1]
        return wider

    def _assign(self, r: Request, e: list | None) -> list:
        blk = r.block_ids
        if len(blk) > self.width:
            self._widen(len(blk))
        if e is None:
            if not self._free:
                self._reclaim()
            e = [self._free.pop(), None, 0, 0]
            self.entries[r.request_id] = e
        row = self.table[e[0]]
        row[: e[2]] = 0
        row[: len(blk)] = blk
        e[1], e[2] = blk, len(blk)
        return e

    def _reclaim(self) -> None:
        """Free the rows of requests not seen in the current step; grow if none."""
        for rid in [rid for rid, e in self.entries.items() if e[3] != self._step]:
            row, _, n, _ = self.entries.pop(rid)
            self.table[row, :n] = 0
            self._free.append(row)
        if not self._free:
            old = len(self.table)
            self.table = np.concatenate([self.table, np.zeros_like(self.table)])
            self._free = list(range(len(self.table) - 1, old - 1, -1))


@dataclass
class DeviceBatch:
    """A step's inputs on the device: the model's forward arguments and the logits rows."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    logits_indices: torch.Tensor
    num_seqs: int


class InputBatch:
    """The staging buffers of one runner and what the last eager step staged."""

    def __init__(
        self,
        device: torch.device,
        block_size: int,
        max_blocks_per_seq: int,
        max_tokens: int,
        max_seqs: int,
        eos_token_ids: list[int],
    ) -> None:
        self.device = device
        self.block_size = block_size
        self.max_blocks_per_seq = max_blocks_per_seq
        self.eos_token_ids = eos_token_ids
        # The last prepare()'s prompt-logprob rows (prompt_logprobs.py) and, per request in
        # row order, (requests, first positions, query starts): what its outputs are read by.
        self.prompt_rows: list[tuple[Request, int, int, int]] = []
        self.staged: tuple[list[Request], list[int], np.ndarray] = ([], [], np.zeros(1))
        # The last flat batch's part lengths and total (a tensor-parallel step sends them).
        self.last_lengths: list[int] = []
        self.last_n_all = 0
        self._alloc_host_buffers(max_tokens, max_seqs)
        self.tables = BlockTableMirror(max_blocks_per_seq, 2 * max_seqs)

    def _alloc_host_buffers(self, max_tokens: int, max_seqs: int) -> None:
        self._cap_tokens, self._cap_seqs = max_tokens, max_seqs
        # ids, positions, slots, logits rows (up to one per token under speculation), then
        # the per-sequence block tables, lengths, query starts and state slots.
        size = 4 * max_tokens + max_seqs * (self.max_blocks_per_seq + 4) + 1
        pin = self.device.type == "cuda"
        self._host = torch.empty(size, dtype=torch.int64, pin_memory=pin)
        self._host_np = self._host.numpy()
        self.dev = torch.empty(size, dtype=torch.int64, device=self.device) if pin else self._host
        # Marks the end of the last host -> device copy: the host buffer is reused only after it.
        self._copy_done = torch.cuda.Event() if pin else None

    def device_buffer(self, n: int) -> torch.Tensor:
        """The first n elements of the device side of the flat buffer, grown to hold them (a
        tensor-parallel rank receives rank 0's flat batch into it)."""
        if n > self.dev.numel():
            self.dev = torch.empty(n, dtype=torch.int64, device=self.device)
        return self.dev[:n]

    def prepare(self, plan: StepPlan) -> tuple[DeviceBatch, list[SampleRow]]:
        """Write the flat batch into the host buffer and copy it to the device once. Per-row
        Python only gathers request fields; the arrays are built with whole-batch numpy."""
        sched = plan.scheduled
        B = len(sched)
        reqs = [s.request for s in sched]
        n_list = [s.num_new_tokens for s in sched]
        start_list = [r.num_computed_tokens for r in reqs]
        T = sum(n_list)
        if T > self._cap_tokens or B > self._cap_seqs:
            self._alloc_host_buffers(max(T, self._cap_tokens), max(B, self._cap_seqs))
        bs = self.block_size
        rows_idx, counts = self.tables.sync(reqs)
        n = np.array(n_list, dtype=np.int64)
        start = np.array(start_list, dtype=np.int64)
        seq_lens = start + n
        nblk = -(-seq_lens // bs)
        cnt = np.array(counts, dtype=np.int64)
        short = np.flatnonzero(cnt < nblk)
        if len(short):
            b = int(short[0])
            raise ValueError(
                f"request {reqs[b].request_id} needs {nblk[b]} KV blocks for {seq_lens[b]} "
                f"tokens but has {cnt[b]}"
            )
        width = max(1, int(nblk.max()))
        tables = self.tables.table[rows_idx, :width].astype(np.int64)
        if (cnt > nblk).any():  # blocks past the ones this step reads stay zero
            tables[np.arange(width) >= nblk[:, None]] = 0
        qsl = np.zeros(B + 1, dtype=np.int64)
        np.cumsum(n, out=qsl[1:])
        row_of = np.repeat(np.arange(B), n)
        pos = np.arange(T, dtype=np.int64) - np.repeat(qsl[:-1] - start, n)
        slots = tables[row_of, pos // bs] * bs + pos % bs
        specs = [s.spec_token_ids for s in sched]
        ids = np.fromiter(
            chain.from_iterable(map(_row_tokens, reqs, start_list, n_list, specs)), np.int64, T
        )
        eos = tuple(self.eos_token_ids)
        rows: list[SampleRow] = []
        logit_rows: list[int] = []
        for b, r in enumerate(reqs):
            sp = specs[b]
            # A row samples when it computes up to the last known token.
            if start_list[b] + n_list[b] - len(sp) != len(r.prompt_token_ids) + len(
                r.output_token_ids
            ):
                continue
            end = int(qsl[b + 1])
            out_pos = len(r.output_token_ids)
            if not sp:
                rows.append(SampleRow(r, out_pos, eos))
                logit_rows.append(end - 1)
                continue
            m = len(sp)
            rows += verify_sample_rows(r, sp, eos)
            logit_rows += range(end - 1 - m, end)
        self.prompt_rows = prompt_logprob_rows(reqs, start_list, n_list, qsl)
        self.staged = (reqs, start_list, qsl)
        for _, _, first_row, count in self.prompt_rows:
            logit_rows.extend(range(first_row, first_row + count))
        if self._copy_done is not None:
            self._copy_done.synchronize()
        parts = [
            ids,
            pos,
            slots,
            tables.reshape(-1),
            seq_lens,
            qsl,
            np.asarray(logit_rows, np.int64),
            np.fromiter((r.state_slot for r in reqs), np.int64, B),
        ]
        offs = np.cumsum([0] + [len(x) for x in parts])
        for x, o in zip(parts, offs[:-1]):
            self._host_np[o : o + len(x)] = x
        n_all = int(offs[-1])
        self.last_lengths = [len(x) for x in parts]
        self.last_n_all = n_all
        if self.dev is not self._host:
            self.dev[:n_all].copy_(self._host[:n_all], non_blocking=True)
            self._copy_done.record()
        d = [self.dev[offs[i] : offs[i + 1]] for i in range(len(parts))]
        return flat_batch(d, B, width, plan.is_decode_only, max(n_list)), rows

    # ---- prompt logprobs (params.prompt_logprobs) ------------------------------------------

    def stage_decode(self, g, plan: StepPlan) -> list[Request]:
        """Write a decode-only step (one new token per request, each sampling) into the CUDA
        graph's host staging buffer: the same values prepare() would compute, per row, written
        with a few whole-batch numpy operations. Returns the requests, in row order."""
        reqs = [s.request for s in plan.scheduled]
        # Decode-only: every row computes its last known token (position num_tokens - 1).
        ids = [r.last_token_id for r in reqs]
        self.stage_decode_rows(g, reqs, [r.num_computed_tokens for r in reqs], ids)
        return reqs

    def stage_decode_rows(
        self, g, reqs: list[Request], positions: list[int], ids: list[int] | None
    ) -> None:
        """Stage one decode row per request: row b computes token ids[b] at positions[b] (ids
        None: the caller puts them on the device, see decode_pipeline.py)."""
        B = len(reqs)
        bs = self.block_size
        rows, counts = self.tables.sync(reqs)
        pos = np.asarray(positions, dtype=np.int64)
        blk_idx = pos // bs
        w = int(blk_idx.max()) + 1  # the table columns the step reads
        g.stage(B, zero_rows=False, cols=w)  # rows [0, B) are written in columns [0, w) below
        g.host_pos[:B] = pos
        tables = g.host_tables[:B, :w]
        tables[:] = self.tables.table[rows, :w]
        if counts != (blk_idx + 1).tolist():
            self._fix_table_rows(reqs, tables, pos, counts)
        if ids is not None:
            g.host_ids[:B] = ids
        g.host_slots[:B] = tables[np.arange(B), blk_idx].astype(np.int64) * bs + pos % bs
        g.host_seq_lens[:B] = pos + 1
        if g.has_state:
            g.host_state[:B] = np.fromiter((r.state_slot for r in reqs), np.int64, B)

    def _fix_table_rows(self, reqs: list[Request], tables, pos, counts: list[int]) -> None:
        """Rows whose request holds more or fewer blocks than the step reads: too few is an
        error; blocks past the ones the step reads are zeroed (as prepare() leaves them)."""
        for b, r in enumerate(reqs):
            nblk = int(pos[b]) // self.block_size + 1
            if counts[b] < nblk:
                raise ValueError(
                    f"request {r.request_id} needs {nblk} KV blocks for {int(pos[b]) + 1} tokens "
                    f"but has {counts[b]}"
                )
            tables[b, nblk:] = 0

    def stage_verify(self, vg, reqs: list[Request], specs: list, starts: list[int]) -> None:
        """Write a verify step (each request's last known token, then its proposals) into the
        verify graph's staging buffer (spec/graphs.py)."""
        rows_idx, blocks = self.tables.sync(reqs)
        vg.stage(
            [r.last_token_id for r in reqs],
            specs,
            starts,
            self.tables.table[rows_idx],
            blocks,
            [r.state_slot for r in reqs] if vg.state_cache is not None else None,
        )
