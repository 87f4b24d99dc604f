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
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch
from voltserve.services.executor.models.layers import AttentionMetadata
from voltserve.services.executor.request import Request
from voltserve.services.executor.spec.graphs import count
from voltserve.services.executor.spec.proposer import Proposer
from voltserve.shared import startup

logger = logging.getLogger(__name__)


def load_draft(path: str, target_dir: str, target_arch, dtype, device):
    """The draft checkpoint, refused unless its vocabulary and tokenizer are the target's."""
    from voltserve.services.executor.loader import load_model

    if not Path(path).is_dir():
        raise startup.StartupError(f"speculative draft model: {path!r} is not a folder")
    loaded = load_model(path, dtype, device)
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


class DraftModelProposer(Proposer):
    def __init__(self, num_speculative_tokens: int, runner, block_manager) -> None:
        super().__init__(num_speculative_tokens)
        if getattr(runner, "draft", None) is None:
            raise ValueError("the draft_model method needs a runner that loaded the draft")
        self.runner = runner
        self.bm = block_manager
        self.model = runner.draft.model
        self.kv = runner.draft_kv_caches
        self.device = runner.device

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
        # Catch-up forward: every known token the draft has not computed; its last row's
        # logits give the first proposal.
        toks: list[int] = []
        pos: list[int] = []
        qsl = [0]
        seq_lens: list[int] = []
        for _, r, start, _ in rows:
            n = r.num_tokens
            allt = r.prompt_token_ids + r.output_token_ids
            toks += allt[start:n]
            pos += range(start, n)
            qsl.append(qsl[-1] + n - start)
            seq_lens.append(n)
        reqs = [r for _, r, _, _ in rows]
        tables = self._tables(reqs)
        last = self._forward(toks, pos, reqs, tables, qsl, seq_lens, decode=False)
        drafts = [[t] for t in last]
        for _, r, _, _ in rows:
            r.spec_state = (r.num_preemptions, r.num_tokens)
        # k - 1 single-token steps over the requests that still want more: as graph replays
        # when the runner captured them for this many requests (spec/graphs.py), else eagerly.
        g = getattr(self.runner, "draft_graphs", None)
        kmax = max(k for *_, k in rows)
        if kmax > 1 and g is not None and g.can_run(len(rows)):
            self._graph_steps(g, rows, reqs, drafts, kmax)
            kmax = 1
        elif kmax > 1:
            count(self.runner, "draft_eager")
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

    def _graph_steps(self, g, rows, reqs: list[Request], drafts: list[list[int]], kmax: int):
        """Steps 1..kmax-1 as replays of the draft's step graphs: each step's input ids are the
        previous step's argmax, on the device; one copy back of all their tokens at the end."""
        ks = [k for *_, k in rows]
        blocks = [r.block_ids for r in reqs]
        ids: list[int] | torch.Tensor = [d[-1] for d in drafts]
        outs = []
        for j in range(1, kmax):
            pos = [r.num_tokens + j - 1 for r in reqs]
            (ids,) = g.run(pos, blocks, [k > j for k in ks], ids)
            outs.append(ids.clone())
        for j, toks in enumerate(torch.stack(outs).tolist(), start=1):
            for b, t in enumerate(toks):
                if ks[b] > j:
                    drafts[b].append(t)
        count(self.runner, "draft_graph")

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
    return AttentionMetadata(
        slot_mapping=slots.to(device),
        block_tables=tables.to(device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        query_start_loc=qsl_t.to(device),
        is_decode=decode,
        max_query_len=int((qsl_t[1:] - qsl_t[:-1]).max()),
    )
