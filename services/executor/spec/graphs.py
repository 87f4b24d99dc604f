"""Speculative decoding's steps as captured CUDA graphs: the target's verify step, the draft
model's single-token steps and the EAGLE head's single-row steps.

The verify step. With k proposed tokens per request (k fixed per server by
--speculative-config), a verify step computes 1 + m rows per decoding request (m <= k: the last
known token and the proposals the batcher kept), every row sampling. Its graph is captured for
B sequences of q = k + 1 rows each, for the decode graphs' batch sizes whose B * q rows fit in
the largest decode graph's, or B <= 8 (spec/graph_setup.py spec_graph_sizes says why; a step of B
requests replays the graph of the next captured size), with a fixed row
layout: row j of sequence b is flat row b * q + j. Rows past a request's 1 + m, and every row of
the padding sequences B..padded-1, are padding rows (token 0, position 0, slot -1: no KV write,
the capturable fallback writes the scratch block; they read the first block of their
sequence's table, block 0 for a padding sequence, and compute finite garbage nobody reads).

Attention: each row is attended as a decode row of its own (query at position p over the keys
0..p of its sequence, seq_len p + 1), with its sequence's block table: the rows' KV is written
before attention in every layer, so row j sees the last known token's and proposals 0..j-1's
keys, which is the causal mask of the eager verify step (the prefill attention over 1 + m query
rows). So the graph runs the decode graphs' ops (DECODE_GRAPH_OPS) and no new kernel. Inside the
graph, the row seq_lens are positions + 1 and the per-row block tables are the per-sequence ones
repeated q times; the host stages one table row per sequence.

A target with linear-attention state (Gated DeltaNet layers): its layers walk each sequence's
rows in order (one launch per state kind and layer) and keep each sequence's state after each
position in the state cache's snapshot area, committed at the next step (state_rollback.py,
VerifyLayout); the graphs then stop at the requests that area holds (max_verify_seqs).

Outputs: one logits buffer and one hidden-state buffer of the largest size's rows, which every
size's graph copies its outputs into (per-size outputs, as the decode graphs keep, would hold
sum(sizes) * (k + 1) rows of logits, about 10 MB per 40 rows at Llama-3-8B's vocabulary; the copy
costs one pass over the rows' logits).

Static buffers: one device byte buffer [input_ids i64 | positions i64 | slot_mapping i64 |
logits rows i64 | block tables i32, one row per sequence], with a pinned host twin; a step
writes the twin and moves it with one copy of the bytes the padded graph reads. The logits rows
(the flat rows of the real rows, in the eager step's sampling order) are read after the replay
to gather the sampled rows' logits. For the EAGLE method the graph also returns the target's
last hidden states (the proposer's features).

The draft model's catch-up. Before its k single-token proposals the draft computes the tokens
the last verify step made known (its accepted proposals and the target's own token: 1..k + 1 per
request). That forward replays graphs of the verify layout (this class, on the draft's model and
KV cache, logits only) when every proposing request has at most k + 1 such tokens; the argmax of
each request's last row feeds the first single-token step on the device.

The draft steps. The draft model's k - 1 single-token steps and the EAGLE head's k - 1
single-row steps after their (eager, variable-length) catch-up forward are decode batches of
the proposing requests: one graph per captured batch size, the rows' positions, slots, seq_lens
and block tables staged on the host before each replay, and the previous step's argmax (and, for
EAGLE, its output features) copied on the device into the next step's inputs, so the k - 1
steps read nothing back until the last: one copy of all their tokens.

What runs eagerly (the runner counts it, `ModelRunner.spec_graph_counts`): a verify step with a
prefill chunk in it, or with more requests than the largest captured verify size (or, never
with the engine's own proposers, more than k proposals for a request); the draft steps of more
requests than the largest decode size; a draft model's catch-up longer than k + 1 tokens for
some request (its first proposal, after a preemption) or of more requests than the largest
verify size; every EAGLE catch-up forward; everything under --enforce-eager, on CPU, and with
VOLTSERVE_SPEC_GRAPHS=0 (the decode graphs stay on).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Sequence

import numpy as np
import torch
from voltserve.kernels.sampling.sampling import chunked_argmax
from voltserve.services.executor.graph_set import GraphSet, Staging
from voltserve.services.executor.input_batch import attention_metadata
from voltserve.services.executor.state_cache import StateCache
from voltserve.services.executor.state_rollback import VerifyLayout

logger = logging.getLogger(__name__)

SPEC_GRAPHS_ENV = "VOLTSERVE_SPEC_GRAPHS"


def spec_graphs_enabled() -> bool:
    """VOLTSERVE_SPEC_GRAPHS=0 runs the speculative steps eagerly (decode graphs stay on)."""
    return os.environ.get(SPEC_GRAPHS_ENV, "1").strip().lower() not in ("0", "false", "no", "off")


def count(runner, key: str) -> None:
    """One more step of kind key in the runner's spec_graph_counts (if it keeps them)."""
    counts = getattr(runner, "spec_graph_counts", None)
    if counts is not None:
        counts[key] = counts.get(key, 0) + 1


def chained_drafts(
    first: Sequence[int] | torch.Tensor, outs: list[torch.Tensor], ks: Sequence[int]
) -> list[list[int]]:
    """Each request's proposal from a proposer's chained step graphs: its first token (host
    ids, or the catch-up's argmax on the device), then step j's argmax (outs[j - 1]) while
    j < its k; one copy back of all the device tokens."""
    dev = [first.long()] if isinstance(first, torch.Tensor) else []
    steps = torch.stack(dev + outs).tolist()
    if not isinstance(first, torch.Tensor):
        steps = [list(first), *steps]
    drafts: list[list[int]] = [[t] for t in steps[0]]
    for j, toks in enumerate(steps[1:], start=1):
        for b, t in enumerate(toks):
            if ks[b] > j:
                drafts[b].append(t)
    return drafts


def verify_row_counts(scheduled, q: int) -> list[int] | None:
    """Rows per request (1 + its proposals) when a verify graph of q rows per sequence covers
    the step: every scheduled request decodes (it computes its last known token, then its
    proposals) and has at most q - 1 proposals. None: the step runs eagerly."""
    counts = []
    for s in scheduled:
        m = len(s.spec_token_ids)
        r = s.request
        if m > q - 1 or s.num_new_tokens != 1 + m or r.num_computed_tokens + 1 != r.num_tokens:
            return None
        counts.append(1 + m)
    return counts or None


def verify_batch_sizes(sizes: Sequence[int], q: int, fits: Callable[[int], bool]) -> list[int]:
    """The decode sizes whose verify graph (size * q rows) `fits` (the torch decode-attention
    fallback's gather bounds the rows a graph may have)."""
    return [s for s in sizes if fits(s * q)]


class VerifyGraphRunner(GraphSet):
    """The target's verify step over B sequences x q rows (see the module docstring)."""

    what = "verify CUDA graphs"

    def __init__(
        self,
        model,
        kv_caches,
        device,
        width: int,
        block_size: int,
        q: int,
        sizes: list[int],
        with_hidden: bool = False,
        capture: bool = True,
        pool=None,
        what: str | None = None,
        state_cache: StateCache | None = None,
    ) -> None:
        """what: the graphs' name in the log (the draft model's catch-up graphs use this
        class on the draft's model and KV cache); state_cache: the target's linear-attention
        state, whose rows the graph walks position by position into its snapshot area
        (state_rollback.VerifyLayout; every size at most its snapshot requests)."""
        if what is not None:
            self.what = what
        self.model, self.kv_caches, self.device = model, kv_caches, device
        self.width, self.block_size, self.q = width, block_size, q
        self.with_hidden = with_hidden
        n = sizes[-1] if sizes else 1
        N = n * q
        self.state_cache = state_cache
        if state_cache is not None and n > state_cache.snapshot_shape[1]:
            raise ValueError(
                f"verify graphs of up to {n} sequences; the state cache snapshots "
                f"{state_cache.snapshot_shape[1]}"
            )
        fields = [
            ("ids", torch.int64, (N,)),
            ("pos", torch.int64, (N,)),
            ("slots", torch.int64, (N,)),
            ("rows", torch.int64, (N,)),
        ]
        if state_cache is not None:
            fields += [("state", torch.int64, (N,))]
        # The tables last: a step uploads the buffer up to its sequences' rows of them.
        self.st = Staging([*fields, ("tables", torch.int32, (n, width))], device)
        if state_cache is not None:
            self.st.host["state"].fill(-1)
            self.st.dev["state"].fill_(-1)
            self.snap_rows = state_cache.snapshot_rows(n, q - 1)
        h = self.st.host
        self.host_ids, self.host_pos, self.host_slots = h["ids"], h["pos"], h["slots"]
        self.host_rows, self.host_tables = h["rows"], h["tables"]
        self.host_slots.fill(-1)
        self.st.dev["slots"].fill_(-1)
        self.query_start_loc = torch.arange(N + 1, dtype=torch.int32, device=device)
        self._last = (0, 0, 0)  # (B, padded size, real rows) of the last stage()
        self._out: list[torch.Tensor] | None = None  # logits and hidden states, all rows
        self._init_graphs(list(sizes), capture, pool)

    def _forward(self, bs: int) -> tuple[torch.Tensor, ...]:
        d, R = self.st.dev, bs * self.q
        pos = d["pos"][:R]
        meta = attention_metadata(
            d["slots"][:R],
            # Each sequence's table row repeated for its q rows (expand: no host sync).
            d["tables"][:bs, None].expand(bs, self.q, self.width).reshape(R, -1),
            pos + 1,
            self.query_start_loc[: R + 1],
            is_decode=True,
        )
        if self.state_cache is not None:
            meta.state_slots = d["state"][:R]
            meta.verify_layout = VerifyLayout(
                d["state"][:R].view(bs, self.q), self.snap_rows[:bs], self.state_cache.rows
            )
        h = self.model.hidden_states(d["ids"][:R], pos, meta, self.kv_caches)
        logits = self.model.compute_logits(h, None, fp32_logits=False)
        if self._out is None:
            # Outputs shared by every size (the largest, warmed up first, allocates them
            # outside the capture): per-size outputs would keep sum(sizes) * q logits rows.
            N = self.st.dev["ids"].shape[0]
            keep = (logits, h) if self.with_hidden else (logits,)
            self._out = [torch.empty(N, *t.shape[1:], dtype=t.dtype, device=t.device) for t in keep]
        return tuple(o[:R].copy_(t) for o, t in zip(self._out, (logits, h)))

    def stage(
        self,
        first_ids: Sequence[int],
        specs: Sequence[Sequence[int]],
        starts: Sequence[int],
        tables: np.ndarray,
        counts: Sequence[int],
        state_slots: Sequence[int] | None = None,
    ) -> tuple[int, int]:
        """Write a verify step into the host twin: sequence b computes first_ids[b] at position
        starts[b], then specs[b] after it; tables[b] is its block table row (counts[b] blocks
        valid, at least the table's width wide or as wide as its blocks); state_slots[b] its
        linear-attention state slot (graphs with a state cache). Returns (padded size, real
        rows). Blocks past the ones a sequence reads are zeroed, as the eager step leaves
        them."""
        B, q, bsz = len(starts), self.q, self.block_size
        bs = self.padded_size(B)
        m = np.fromiter(map(len, specs), np.int64, B)
        if (m > q - 1).any():
            raise ValueError(
                f"a verify graph of {q} rows per sequence got {int(m.max())} proposals"
            )
        n = m + 1
        R = int(n.sum())
        start = np.asarray(starts, dtype=np.int64)
        last = start + m  # the last position each sequence computes
        nblk = last // bsz + 1
        cnt = np.asarray(counts, dtype=np.int64)
        short = np.flatnonzero(cnt < nblk)
        if len(short):
            b = int(short[0])
            raise ValueError(
                f"sequence {b} needs {int(nblk[b])} KV blocks for {int(last[b]) + 1} tokens but "
                f"has {int(cnt[b])}"
            )
        self.st.wait()
        ht, W = self.host_tables, self.width
        ht[:B] = tables[:B, :W]
        ht[:B][np.arange(W)[None, :] >= nblk[:, None]] = 0
        ht[B:bs] = 0
        first = np.cumsum(n) - n
        b_of = np.repeat(np.arange(B), n)
        j = np.arange(R) - np.repeat(first, n)
        row = b_of * q + j
        pos = start[b_of] + j
        ids = np.empty(R, dtype=np.int64)
        ids[first] = first_ids
        if R > B:
            rest = np.ones(R, dtype=bool)
            rest[first] = False
            ids[rest] = np.fromiter((t for s in specs for t in s), np.int64, R - B)
        N = bs * q
        self.host_ids[:N] = 0
        self.host_pos[:N] = 0
        self.host_slots[:N] = -1
        self.host_ids[row] = ids
        self.host_pos[row] = pos
        self.host_slots[row] = ht[b_of, pos // bsz].astype(np.int64) * bsz + pos % bsz
        self.host_rows[:R] = row
        if self.state_cache is not None:
            if state_slots is None or len(state_slots) != B:
                raise ValueError("verify graphs over linear-attention state need the slots")
            h = self.st.host
            h["state"][:N] = -1
            h["state"][row] = np.asarray(state_slots, dtype=np.int64)[b_of]
        self._last = (B, bs, R)
        return bs, R

    def replay_staged(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Copy the staged step to the device and replay: (logits of the real rows in their
        stage order, in the model's dtype; the hidden states of all bs * q rows or None)."""
        B, bs, R = self._last
        self.st.upload(self.st.end_of("tables", bs))
        self._replay(bs)
        out = self.outputs[bs]
        logits = out[0] if R == bs * self.q else out[0].index_select(0, self.st.dev["rows"][:R])
        return logits, (out[1] if self.with_hidden else None)


def stage_step_rows(
    host: dict[str, np.ndarray],
    positions: Sequence[int],
    block_lists: Sequence[Sequence[int]],
    live: Sequence[bool],
    block_size: int,
    padded: int,
) -> None:
    """One single-token step of a proposer's batch into host arrays (pos, slots, seq_lens,
    tables): row b computes position positions[b] over block_lists[b] when live[b]; the other
    rows, and rows [len(positions), padded), are padding rows (position 0, slot -1, seq_len 1,
    zero table)."""
    B = len(positions)
    pos, slots, lens, tables = host["pos"], host["slots"], host["seq_lens"], host["tables"]
    tables[:padded] = 0
    pos[:padded] = 0
    slots[:padded] = -1
    lens[:padded] = 1
    for b in range(B):
        if not live[b]:
            continue
        p = positions[b]
        nblk = p // block_size + 1
        blk = block_lists[b]
        if len(blk) < nblk:
            raise ValueError(f"row {b} needs {nblk} KV blocks for {p + 1} tokens, has {len(blk)}")
        tables[b, :nblk] = blk[:nblk]
        pos[b] = p
        slots[b] = blk[p // block_size] * block_size + p % block_size
        lens[b] = p + 1


class StepGraphs(GraphSet):
    """A proposer's single-token steps (draft model: token -> logits; EAGLE head: token and
    feature -> the head's output feature), decode batches of the proposing requests."""

    def __init__(
        self,
        forward: Callable,
        kv_caches,
        device,
        width: int,
        block_size: int,
        sizes: list[int],
        feature: tuple[int, torch.dtype] | None = None,
        what: str = "draft CUDA graphs",
        capture: bool = True,
        pool=None,
    ) -> None:
        """forward(ids, features or None, positions, meta, kv_caches) -> (logits or None,
        features or None); feature: (hidden size, dtype) of the feature input (EAGLE)."""
        self.fwd, self.kv_caches, self.device = forward, kv_caches, device
        self.width, self.block_size, self.what = width, block_size, what
        n = sizes[-1] if sizes else 1
        self.st = Staging(
            [
                ("ids", torch.int64, (n,)),
                ("pos", torch.int64, (n,)),
                ("slots", torch.int64, (n,)),
                ("seq_lens", torch.int32, (n,)),
                ("tables", torch.int32, (n, width)),
            ],
            device,
        )
        self.host = self.st.host
        self.host["slots"].fill(-1)
        self.host["seq_lens"].fill(1)
        self.st.dev["slots"].fill_(-1)
        self.st.dev["seq_lens"].fill_(1)
        self.features = None
        if feature is not None:
            self.features = torch.zeros(n, feature[0], dtype=feature[1], device=device)
        self.query_start_loc = torch.arange(n + 1, dtype=torch.int32, device=device)
        self._init_graphs(list(sizes), capture, pool)

    def _forward(self, bs: int) -> tuple[torch.Tensor, ...]:
        d = self.st.dev
        meta = attention_metadata(
            d["slots"][:bs],
            d["tables"][:bs],
            d["seq_lens"][:bs],
            self.query_start_loc[: bs + 1],
            is_decode=True,
        )
        feats = self.features[:bs] if self.features is not None else None
        logits, h = self.fwd(d["ids"][:bs], feats, d["pos"][:bs], meta, self.kv_caches)
        out = (chunked_argmax(logits),)
        return out + (h,) if h is not None else out

    def run(
        self,
        positions: Sequence[int],
        block_lists: Sequence[Sequence[int]],
        live: Sequence[bool],
        ids: Sequence[int] | torch.Tensor,
        features: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, ...]:
        """Stage one step and replay it: (argmax [B], features [B, hidden] for EAGLE), views of
        the graph's outputs (the next replay overwrites them). ids: host ids, or the previous
        step's argmax on the device; features: the previous step's features on the device."""
        B = len(positions)
        bs = self.padded_size(B)
        self.st.wait()
        stage_step_rows(self.host, positions, block_lists, live, self.block_size, bs)
        on_device = isinstance(ids, torch.Tensor)
        self.host["ids"][:bs] = 0
        if not on_device:
            self.host["ids"][:B] = ids
        self.st.upload(self.st.end_of("tables", bs))
        if on_device:
            self.st.dev["ids"][:B].copy_(ids[:B])
        if features is not None:
            self.features[:B].copy_(features[:B])
        self._replay(bs)
        return tuple(o[:B] for o in self.outputs[bs])
