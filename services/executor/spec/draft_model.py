"""Draft-model proposer: a smaller model with the target's tokenizer proposes k tokens
greedily, one batched forward per token, on its own paged KV cache.

The draft's cache has the target's block layout (the same number of blocks, its own layers and
heads), and a request's draft KV lives in the slots of the request's own target blocks, so the
block manager's allocation, prefix sharing, take-back and preemption cover it with no table of
its own. What is valid in it is tracked per request (`Request.spec_state`: the number of
positions the draft has computed, and the request's preemption count when it did): before
proposing, the draft catches up over every known token it has not computed (the whole prompt on
a request's first proposal, after a preemption or on a prefix-cache hit; afterwards the tokens
accepted since), then runs k - 1 single-token steps. Only positions below the request's known
length count as computed, so the KV of rejected drafts is rewritten on the next catch-up. A
stale draft KV could only make proposals worse, never the output different: acceptance
(acceptance.py) keeps the target's tokens whatever is proposed, and the greedy draft is a
point-mass proposal.

The proposer owns the draft: it loads it at the runner's start-up, sizes and allocates its KV
cache with the target's, and captures its graphs after the target's (the Proposer hooks).
Where it captured them (spec/graphs.py), both parts replay CUDA graphs: the catch-up of
every proposing request, when each has at most k + 1 tokens to catch up (after a verify step:
its accepted proposals and the target's own token), runs the draft's catch-up graphs (the verify
graphs' layout on the draft's model and cache), and its argmax feeds the single-token step
graphs on the device, so a proposal reads nothing back until all k tokens are known. A longer
catch-up (a request's first proposal, after a preemption or after steps without proposals)
runs eagerly: an eager forward launches every kernel of every draft layer from the host, which
on a 16-layer draft costs more than the draft's k graph steps together.
"""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import torch
from voltserve.kernels.sampling.sampling import chunked_argmax
from voltserve.services.executor.input_batch import attention_metadata
from voltserve.services.executor.models.layers import AttentionMetadata
from voltserve.services.executor.request import Request
from voltserve.services.executor.spec.graph_setup import build_step_graphs, graph_pool
from voltserve.services.executor.spec.graphs import (
    StepGraphs,
    VerifyGraphRunner,
    chained_drafts,
    count,
)
from voltserve.services.executor.spec.model_proposer import ModelProposer, alloc_proposer_kv
from voltserve.shared import startup

logger = logging.getLogger(__name__)


def load_draft(path: str, target_dir: str, target_arch, dtype, device):
    """The draft checkpoint, refused unless its vocabulary and tokenizer are the target's."""
    from voltserve.services.executor.loader import load_model

    if not Path(path).is_dir():
        raise startup.StartupError(f"speculative draft model: {path!r} is not a folder")
    loaded = load_model(path, dtype, device)
    if getattr(loaded.model, "state_specs", None) is not None and loaded.model.state_specs():
        # Its own linear-attention state would need a state cache and the rollback of its
        # catch-up steps (state_rollback.py does it for the target only).
        raise startup.StartupError(
            f"speculative draft model {path}: {loaded.arch.architecture} keeps linear-attention "
            "state, which a draft model does not support; use a draft model with attention only"
        )
    if loaded.arch.vocab_size != target_arch.vocab_size:
        raise startup.StartupError(
            f"speculative draft model {path}: vocab_size {loaded.arch.vocab_size} differs from "
            f"the target's {target_arch.vocab_size}; the draft needs the target's tokenizer"
        )
    draft_vocab, target_vocab = _vocab(path), _vocab(target_dir)
    if draft_vocab is None:
        raise startup.StartupError(
            f"speculative draft model {path}: no tokenizer files; the draft needs the target's "
            "tokenizer"
        )
    if target_vocab is not None and draft_vocab != target_vocab:
        diff = sorted(set(draft_vocab.items()) ^ set(target_vocab.items()))[:3]
        raise startup.StartupError(
            f"speculative draft model {path}: its tokenizer differs from the target's "
            f"(e.g. {diff}); the draft needs the target's tokenizer"
        )
    return loaded


def _vocab(path: str) -> dict[str, int] | None:
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path).get_vocab()
    except (OSError, ValueError):
        return None


class DraftModelProposer(ModelProposer):
    what = "draft_model"

    def __init__(self, num_speculative_tokens: int, path: str) -> None:
        super().__init__(num_speculative_tokens, path)
        self.step_graphs: StepGraphs | None = None
        self.catchup_graphs: VerifyGraphRunner | None = None

    # ---- start-up ----------------------------------------------------------------------------

    def load(self, runner) -> None:
        self.runner = runner
        self.device = runner.device
        with startup.phase("loading the draft model", runner.startup_times):
            self.draft = load_draft(
                self.path, runner.config.model, runner.arch, runner.dtype, runner.device
            )
        self.model = self.draft.model

    def graph_logits_rows(self, verify_rows: int) -> int:
        return verify_rows  # the catch-up graphs have the verify graphs' rows

    def make_graphs(self, runner, decode_sizes, verify_sizes, kv=None, capture=True) -> dict:
        """The single-token step graphs (the decode sizes) and the catch-up graphs (the verify
        layout on the draft's model and KV cache: the verify sizes, up to k + 1 rows each,
        logits only)."""
        if kv is None:
            kv = alloc_proposer_kv(runner, 1, self.draft.arch)
        head = self.model

        def fwd(ids, feats, pos, meta, kv):
            return head(ids, pos, meta, kv, None, fp32_logits=False), None

        graphs = {
            "step": build_step_graphs(
                runner, fwd, None, kv, decode_sizes, "draft model CUDA graphs", capture
            )
        }
        if verify_sizes:
            graphs["catchup"] = VerifyGraphRunner(
                self.model,
                kv,
                runner.device,
                runner.max_blocks_per_seq,
                runner.block_size,
                self.k + 1,
                list(verify_sizes),
                capture=capture,
                pool=graph_pool(runner),
                what="draft model catch-up CUDA graphs",
            )
        return graphs

    def capture_graphs(self, runner, decode_sizes, verify_sizes) -> None:
        graphs = self.make_graphs(runner, decode_sizes, verify_sizes, self.kv)
        self.step_graphs, self.catchup_graphs = graphs["step"], graphs.get("catchup")

    # ---- per step ----------------------------------------------------------------------------

    @torch.inference_mode()
    def propose(self, requests: list[Request]) -> list[list[int]]:
        out: list[list[int]] = [[] for _ in requests]
        bs = self.bm.block_size
        rows: list[tuple[int, Request, int, int]] = []  # (index, request, first pos, k)
        for i, r in enumerate(requests):
            k = min(self.k, r.max_output_tokens - len(r.output_token_ids) - 1)
            if k <= 0:
                continue
            # Slots for the draft's own tokens (positions num_tokens .. num_tokens + k - 2);
            # best effort, as the batcher's are, and leaving a block per decoding request free
            # so that speculation does not make the batcher preempt anyone.
            missing = self.bm.blocks_needed(r.num_computed_tokens + k) - len(r.block_ids)
            if missing > 0 and self.bm.num_free_blocks - missing < len(requests):
                continue
            if not self.bm.append_slots(r, k):
                continue
            st = r.spec_state
            done = st[1] if st is not None and st[0] == r.num_preemptions else 0
            rows.append((i, r, min(done, r.num_tokens - 1), k))
        if not rows:
            return out
        reqs = [r for _, r, _, _ in rows]
        tables = self._tables(reqs)
        # Catch-up forward: every known token the draft has not computed; its last row's
        # logits give the first proposal (on the device after a graph replay).
        c = self.catchup_graphs
        if c is not None and self._catch_up_fits(c, rows):
            first: list[int] | torch.Tensor = self._graph_catch_up(c, rows)
            count(self.runner, "catchup_graph")
        else:
            first = self._eager_catch_up(rows, reqs, tables)
            count(self.runner, "catchup_eager")
        for _, r, _, _ in rows:
            r.spec_state = (r.num_preemptions, r.num_tokens)
        # k - 1 single-token steps over the requests that still want more: as graph replays
        # when the runner captured them for this many requests (spec/graphs.py), else eagerly.
        g = self.step_graphs
        kmax = max(k for *_, k in rows)
        if kmax > 1 and g is not None and g.can_run(len(rows)):
            drafts = self._graph_steps(g, rows, reqs, first, kmax)
            kmax = 1
        else:
            if kmax > 1:
                count(self.runner, "draft_eager")
            if isinstance(first, torch.Tensor):
                first = first.tolist()
            drafts = [[t] for t in first]
        for j in range(1, kmax):
            live = [b for b, (*_, k) in enumerate(rows) if k > j]
            if not live:
                break
            sub = [reqs[b] for b in live]
            p = [reqs[b].num_tokens + j - 1 for b in live]
            assert all(q < len(r.block_ids) * bs for q, r in zip(p, sub))
            nxt = self._forward(
                [drafts[b][-1] for b in live],
                p,
                sub,
                tables[live],
                list(range(len(live) + 1)),
                [q + 1 for q in p],
                decode=True,
            )
            for b, t in zip(live, nxt):
                drafts[b].append(t)
        for (i, _, _, _), d in zip(rows, drafts):
            out[i] = d
        return out

    def _eager_catch_up(self, rows, reqs: list[Request], tables: torch.Tensor) -> list[int]:
        toks: list[int] = []
        pos: list[int] = []
        qsl = [0]
        seq_lens: list[int] = []
        for _, r, start, _ in rows:
            n = r.num_tokens
            toks += known_tokens(r, start, n)
            pos += range(start, n)
            qsl.append(qsl[-1] + n - start)
            seq_lens.append(n)
        return self._forward(toks, pos, reqs, tables, qsl, seq_lens, decode=False)

    @staticmethod
    def _catch_up_fits(c, rows) -> bool:
        """The catch-up graphs cover this step: a captured size for the requests, at most q
        tokens to catch up for each, and block lists within the table width."""
        return c.can_run(len(rows)) and all(
            r.num_tokens - start <= c.q and len(r.block_ids) <= c.width for _, r, start, _ in rows
        )

    def _graph_catch_up(self, c, rows) -> torch.Tensor:
        """The catch-up forward as a replay of the draft's catch-up graph (the verify layout:
        request b's first uncomputed token, then the rest of its catch-up after it); the argmax
        of each request's last row, on the device."""
        B = len(rows)
        table = np.zeros((B, c.width), dtype=np.int32)
        first_ids, rest, starts, counts, last = [], [], [], [], []
        for b, (_, r, start, _) in enumerate(rows):
            toks = known_tokens(r, start, r.num_tokens)
            first_ids.append(toks[0])
            rest.append(toks[1:])
            starts.append(start)
            blk = r.block_ids
            table[b, : len(blk)] = blk
            counts.append(len(blk))
            last.append((last[-1] if last else -1) + len(toks))
        c.stage(first_ids, rest, starts, table, counts)
        logits, _ = c.replay_staged()
        rows_t = torch.tensor(last, dtype=torch.int64, device=self.device)
        return chunked_argmax(logits.index_select(0, rows_t))

    def _graph_steps(
        self, g, rows, reqs: list[Request], first: list[int] | torch.Tensor, kmax: int
    ) -> list[list[int]]:
        """Steps 1..kmax-1 as replays of the draft's step graphs: each step's input ids are the
        previous step's argmax, on the device (the first step's too, after a catch-up graph);
        one copy back of all the tokens at the end. Returns each request's proposal."""
        ks = [k for *_, k in rows]
        blocks = [r.block_ids for r in reqs]
        ids: list[int] | torch.Tensor = first
        outs = []
        for j in range(1, kmax):
            pos = [r.num_tokens + j - 1 for r in reqs]
            (ids,) = g.run(pos, blocks, [k > j for k in ks], ids)
            outs.append(ids.long().clone())
        count(self.runner, "draft_graph")
        return chained_drafts(first, outs, ks)

    def _tables(self, reqs: list[Request]) -> torch.Tensor:
        return block_tables(reqs)

    def _forward(self, toks, pos, reqs, tables, qsl, seq_lens, decode: bool) -> list[int]:
        dev = self.device
        meta = draft_metadata(pos, tables, qsl, seq_lens, decode, self.bm.block_size, dev)
        logits_rows = torch.tensor(qsl[1:], dtype=torch.int64, device=dev) - 1
        logits = self.model(
            torch.tensor(toks, dtype=torch.int64, device=dev),
            torch.tensor(pos, dtype=torch.int64, device=dev),
            meta,
            self.kv,
            logits_rows,
        )
        return logits.argmax(dim=-1).tolist()


def known_tokens(r: Request, start: int, end: int) -> list[int]:
    """The request's known tokens (prompt, then output) at positions [start, end)."""
    p = r.prompt_token_ids
    n = len(p)
    if start >= n:
        return r.output_token_ids[start - n : end - n]
    return p[start:end] + r.output_token_ids[: max(0, end - n)]


def block_tables(reqs: list[Request]) -> torch.Tensor:
    """The requests' block tables, [B, widest] int32 on the host (zeros past a short one)."""
    width = max(len(r.block_ids) for r in reqs)
    t = torch.zeros(len(reqs), width, dtype=torch.int32)
    for b, r in enumerate(reqs):
        t[b, : len(r.block_ids)] = torch.tensor(r.block_ids, dtype=torch.int32)
    return t


def draft_metadata(
    pos: list[int],
    tables: torch.Tensor,
    qsl: list[int],
    seq_lens: list[int],
    decode: bool,
    block_size: int,
    device,
) -> AttentionMetadata:
    """Attention metadata of a proposer's own forward over the requests' target blocks: row
    group b (query rows qsl[b]..qsl[b+1]) writes the slots of positions pos in table row b."""
    pos_t = torch.tensor(pos, dtype=torch.int64)
    row_of = torch.repeat_interleave(
        torch.arange(len(seq_lens)), torch.tensor(qsl[1:]) - torch.tensor(qsl[:-1])
    )
    slots = tables.long()[row_of, pos_t // block_size] * block_size + pos_t % block_size
    qsl_t = torch.tensor(qsl, dtype=torch.int32)
    return attention_metadata(
        slots.to(device),
        tables.to(device),
        torch.tensor(seq_lens, dtype=torch.int32, device=device),
        qsl_t.to(device),
        decode,
        int((qsl_t[1:] - qsl_t[:-1]).max()),
    )
