"""EAGLE proposer: a one-layer head (eagle_head.py) reads the target's last hidden states and
proposes k tokens greedily, one batched head forward per token.

Where the features come from: the proposer sets `needs_hidden_states`, and the runner then hands
out the target's final hidden state of every row it computes (per request: the first position
and the rows; `RunnerOutput.hidden_states`, which `observe` keeps until the next proposal).
They collect per request in `Request.spec_state`
(a `_Features`: the target's features from some position on), a later row at a position
replacing what an earlier one left there (the rows of rejected proposals are recomputed by the
next verify step), and only features below `num_computed_tokens` count.

Why the head keeps a paged KV cache instead of recomputing a short window: its attention covers
the whole context (that is how the EAGLE heads are trained), and the draft-model proposer has
already laid out a second cache in the target's block layout, in the slots of the request's own
blocks, so the block manager's allocation, take-back and preemption cover the head with no table
of its own. Every step the head catches up over the pairs (f_p, x_{p+1}) whose features came
in the last step (p < num_computed_tokens), for the requests that propose and for those that ran
a prefill chunk alike, so that no catch-up is longer than one step's tokens (a 32K prompt never
becomes one 32K-row head forward, nor 32K kept features). A proposing request's last catch-up
row gives its first proposal; k - 1 single-row steps on the head's own outputs give the rest.
The last pair is kept and recomputed by the next catch-up, so a request not scheduled in between
still has its first proposal.

Graphs (spec/graphs.py): the single-row steps replay decode-shaped step graphs, and a catch-up
of proposing requests only, each with at most k + 2 pairs (after a verify step: the kept last
pair, the accepted proposals and the target's own token), replays catch-up graphs of the
verify layout on the head (`_HeadAsModel`: each row's feature copied into the graph's buffer
before the replay); the first proposal and the head's output at each request's last row stay
on the device for the steps, so a proposal reads nothing back until all k tokens are known.
Longer catch-ups (a request's first, over its prompt) and those beside a prefill chunk run
eagerly.

KV the head wrote for a prefix-cache hit's blocks (by the request that computed them) or left
stale by a preemption only makes proposals worse, never the output different: acceptance keeps
the target's tokens whatever is proposed (acceptance.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from voltserve.kernels.sampling.sampling import chunked_argmax
from voltserve.services.executor.request import Request, RequestStatus
from voltserve.services.executor.spec.draft_model import block_tables, draft_metadata
from voltserve.services.executor.spec.eagle_head import load_eagle_head
from voltserve.services.executor.spec.graph_setup import build_step_graphs, graph_pool
from voltserve.services.executor.spec.graphs import (
    StepGraphs,
    VerifyGraphRunner,
    chained_drafts,
    count,
)
from voltserve.services.executor.spec.model_proposer import ModelProposer, alloc_proposer_kv
from voltserve.shared import startup


@dataclass
class _Features:
    start: int  # the position of feats[0]
    feats: torch.Tensor  # [n, hidden]: the target's hidden states at start .. start + n - 1


def _tokens(r: Request, start: int, n: int) -> list[int]:
    p = r.prompt_token_ids
    if start >= len(p):
        return r.output_token_ids[start - len(p) : start - len(p) + n]
    return (p[start:] + r.output_token_ids)[:n]


class _HeadAsModel:
    """The head as a VerifyGraphRunner drives a model (the catch-up graphs): token ids,
    positions and metadata from the runner's staging, each row's feature from `feats`, a static
    buffer the proposer fills before a replay; the target's lm_head."""

    def __init__(self, head, target, feats: torch.Tensor) -> None:
        self.head, self.target, self.feats = head, target, feats

    def hidden_states(self, ids, positions, meta, kv_caches) -> torch.Tensor:
        embeds = self.target.model.embed_tokens(ids)
        return self.head(embeds, self.feats[: ids.shape[0]], positions, meta, kv_caches)

    def compute_logits(self, h, logits_indices=None, fp32_logits: bool = True) -> torch.Tensor:
        return self.target.compute_logits(h, logits_indices, fp32_logits=fp32_logits)


class EagleProposer(ModelProposer):
    # The seam: the target's forward also hands out its hidden states.
    needs_hidden_states = True
    what = "eagle"
    # What _load_head loads, for the start-up phase's name.
    head_name = "the EAGLE head"

    def __init__(self, num_speculative_tokens: int, path: str) -> None:
        super().__init__(num_speculative_tokens, path)
        self.step_graphs: StepGraphs | None = None
        self.catchup_graphs: VerifyGraphRunner | None = None
        self._hidden: list[tuple[Request, int, torch.Tensor]] = []

    # ---- start-up ----------------------------------------------------------------------------

    def load(self, runner) -> None:
        self.runner = runner
        self.device = runner.device
        self.target = runner.model
        with startup.phase(f"loading {self.head_name}", runner.startup_times):
            self.draft = self._load_head(runner)
        self.head = self.draft.model

    def _load_head(self, runner):
        """The head for the runner's target: its model (called as EagleHead.forward) and arch."""
        return load_eagle_head(self.path, runner.arch, runner.dtype, runner.device)

    @property
    def catch_up_rows(self) -> int:
        """Rows a request's catch-up takes after a verify step: the kept last pair, the
        accepted proposals and the target's own token (k + 2 when every proposal is kept)."""
        return self.k + 2

    def graph_logits_rows(self, verify_rows: int) -> int:
        return verify_rows // (self.k + 1) * self.catch_up_rows

    def make_graphs(self, runner, decode_sizes, verify_sizes, kv=None, capture=True) -> dict:
        """The head's single-row step graphs (the decode sizes): token and feature in, logits
        and the head's output feature out; and its catch-up graphs (the verify sizes, the verify
        layout of catch_up_rows rows a request: tokens staged, features from a buffer)."""
        if kv is None:
            kv = alloc_proposer_kv(runner, 1, self.draft.arch)
        target, head = self.target, self.head

        def fwd(ids, feats, pos, meta, kv):
            h = head(target.model.embed_tokens(ids), feats, pos, meta, kv)
            return target.compute_logits(h, None, fp32_logits=False), h

        feature = (runner.arch.hidden_size, runner.dtype)
        what = f"{self.head_name} CUDA graphs"
        graphs = {"step": build_step_graphs(runner, fwd, feature, kv, decode_sizes, what, capture)}
        if verify_sizes:
            q = self.catch_up_rows
            feats = torch.zeros(
                max(verify_sizes) * q, runner.arch.hidden_size, dtype=runner.dtype,
                device=runner.device,
            )  # fmt: skip
            graphs["catchup"] = VerifyGraphRunner(
                _HeadAsModel(head, target, feats),
                kv,
                runner.device,
                runner.max_blocks_per_seq,
                runner.block_size,
                q,
                list(verify_sizes),
                with_hidden=True,
                capture=capture,
                pool=graph_pool(runner),
                what=f"{self.head_name} catch-up CUDA graphs",
            )
        return graphs

    def capture_graphs(self, runner, decode_sizes, verify_sizes) -> None:
        graphs = self.make_graphs(runner, decode_sizes, verify_sizes, self.kv)
        self.step_graphs, self.catchup_graphs = graphs["step"], graphs.get("catchup")

    # ---- per step ----------------------------------------------------------------------------

    def observe(self, output) -> None:
        self._hidden.extend(output.hidden_states)

    def _collect(self) -> list[Request]:
        """Move the hidden states of the runner's last steps into their requests' state; the
        requests that got some, in step order."""
        fed: dict[str, Request] = {}
        hidden, self._hidden = self._hidden, []
        for r, s, h in hidden:
            st = r.spec_state
            if not isinstance(st, _Features) or not st.start <= s <= st.start + len(st.feats):
                # First rows, a recomputation from an earlier position, or a gap.
                r.spec_state = _Features(s, h.clone())
            else:
                st.feats = torch.cat([st.feats[: s - st.start], h])
            fed[r.request_id] = r
        return list(fed.values())

    @staticmethod
    def _ready(r: Request) -> bool:
        """Whether the features reach the last computed position (and the request still holds
        its blocks: a finished or preempted one has none to write)."""
        st, c = r.spec_state, r.num_computed_tokens
        return (
            r.status is RequestStatus.RUNNING
            and isinstance(st, _Features)
            and c >= 1
            and st.start <= c - 1 < st.start + len(st.feats)
        )

    @torch.inference_mode()
    def propose(self, requests: list[Request]) -> list[list[int]]:
        fed = self._collect()
        out: list[list[int]] = [[] for _ in requests]
        wanted: dict[str, tuple[int, int]] = {}  # request id -> (index in requests, k)
        for i, r in enumerate(requests):
            k = min(self.k, r.max_output_tokens - len(r.output_token_ids) - 1)
            if k <= 0 or not self._ready(r):
                continue
            # Slots for the head's own steps (positions c .. c + k - 2); as the draft model,
            # leaving a block per decoding request free so that the batcher preempts nobody.
            c = r.num_computed_tokens
            missing = self.bm.blocks_needed(c + k - 1) - len(r.block_ids)
            if missing > 0 and self.bm.num_free_blocks - missing < len(requests):
                continue
            if not self.bm.append_slots(r, k - 1):
                continue
            wanted[r.request_id] = (i, k)
        # Catch-up rows: the proposing requests, and every other request that computed tokens
        # in the last step (prefill chunks), so that the head never catches up over more than
        # one step's tokens at once (its activations and the kept features stay within the
        # target's own step budget).
        reqs = [r for r in requests if r.request_id in wanted]
        reqs += [
            r
            for r in fed
            if r.request_id not in wanted
            and self._ready(r)
            and r.num_computed_tokens - r.spec_state.start > 1
        ]
        if not reqs:
            return out
        nprop = len(wanted)
        ks = [wanted[r.request_id][1] for r in reqs[:nprop]]
        # The pairs (f_p, x_{p+1}) for p from the first new feature to c - 1, per request.
        pairs = []
        for r in reqs:
            st, c = r.spec_state, r.num_computed_tokens
            a = st.start
            pairs.append((a, _tokens(r, a + 1, c - a), st.feats[: c - a]))
            # Keep the last pair's feature: the next proposal starts from it.
            st.start, st.feats = c - 1, st.feats[c - 1 - a : c - a].clone()
        c = self.catchup_graphs
        if nprop == len(reqs) and c is not None and self._catch_up_fits(c, reqs, pairs):
            first, h = self._graph_catch_up(c, reqs, pairs)
            count(self.runner, "catchup_graph")
        else:
            h = self._eager_catch_up(reqs, pairs)
            if nprop:
                count(self.runner, "catchup_eager")
            if not nprop:
                return out
            last = torch.tensor([len(t) for _, t, _ in pairs[:nprop]]).cumsum(0) - 1
            h = h[last.to(h.device)]
            first = self._argmax(h)
        # k - 1 single-row steps: the head's own output is the next feature. As graph replays
        # when the runner captured them for this many requests (spec/graphs.py), else eagerly.
        g = self.step_graphs
        kmax = max(ks)
        if kmax > 1 and g is not None and g.can_run(nprop):
            drafts = self._graph_steps(g, reqs[:nprop], ks, first, h)
            kmax = 1
        else:
            if kmax > 1:
                count(self.runner, "draft_eager")
            if isinstance(first, torch.Tensor):
                first = first.tolist()
            drafts = [[t] for t in first]
        tables = block_tables(reqs[:nprop]) if kmax > 1 else None
        for j in range(1, kmax):
            live = [b for b in range(nprop) if ks[b] > j]
            p = [reqs[b].num_computed_tokens + j - 1 for b in live]
            idx = torch.tensor(live, device=h.device)
            hs = self._forward(
                [drafts[b][-1] for b in live],
                h[idx],
                p,
                tables[live],
                list(range(len(live) + 1)),
                [q + 1 for q in p],
                decode=True,
                step=j,
            )
            h = h.index_copy(0, idx, hs)  # h keeps one row per proposing request
            for b, t in zip(live, self._argmax(hs)):
                drafts[b].append(t)
        for r, d in zip(reqs, drafts):
            out[wanted[r.request_id][0]] = d
        return out

    def _eager_catch_up(self, reqs: list[Request], pairs) -> torch.Tensor:
        """The catch-up forward over every pair of every request, eagerly: the head's output
        per row."""
        toks: list[int] = []
        pos: list[int] = []
        feats: list[torch.Tensor] = []
        qsl = [0]
        seq_lens: list[int] = []
        for r, (a, t, f) in zip(reqs, pairs):
            c = r.num_computed_tokens
            toks += t
            pos += range(a, c)
            feats.append(f)
            qsl.append(qsl[-1] + c - a)
            seq_lens.append(c)
        tables = block_tables(reqs)
        return self._forward(toks, torch.cat(feats), pos, tables, qsl, seq_lens, decode=False)

    @staticmethod
    def _catch_up_fits(c: VerifyGraphRunner, reqs: list[Request], pairs) -> bool:
        """The catch-up graphs cover this step: a captured size for the requests, at most
        catch_up_rows pairs for each, and block lists within the table width."""
        return c.can_run(len(reqs)) and all(
            len(t) <= c.q and len(r.block_ids) <= c.width for r, (_, t, _) in zip(reqs, pairs)
        )

    def _graph_catch_up(
        self, c: VerifyGraphRunner, reqs: list[Request], pairs
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The catch-up forward as a replay of the catch-up graph (the verify layout: request
        b's pairs at rows b * q ..., their features copied into the graph's buffer first): the
        argmax of each request's last row and the head's output there, on the device."""
        B, q = len(reqs), c.q
        table = np.zeros((B, c.width), dtype=np.int32)
        first_ids, rest, starts, counts, rows, last, staged = [], [], [], [], [], [], []
        for b, (r, (a, t, _)) in enumerate(zip(reqs, pairs)):
            first_ids.append(t[0])
            rest.append(t[1:])
            starts.append(a)
            table[b, : len(r.block_ids)] = r.block_ids
            counts.append(len(r.block_ids))
            rows += range(b * q, b * q + len(t))
            last.append(b * q + len(t) - 1)  # in the graph's layout
            staged.append(len(rows) - 1)  # among the real rows, in stage order
        n = len(rows)
        idx = torch.tensor(rows + last + staged, dtype=torch.int64).to(self.device)
        feats = torch.cat([f for _, _, f in pairs]).to(c.model.feats.dtype)
        c.model.feats.index_copy_(0, idx[:n], feats)
        c.stage(first_ids, rest, starts, table, counts)
        logits, h = c.replay_staged()
        first = chunked_argmax(logits.index_select(0, idx[n + B :]))
        return first, h.index_select(0, idx[n : n + B])

    def _graph_steps(self, g, reqs: list[Request], ks: list[int], first, h: torch.Tensor):
        """Steps 1..max(ks)-1 as replays of the head's step graphs: each step's input token and
        feature are the previous step's argmax and output, on the device (the first step's
        token too, after a catch-up graph); one copy back of all their tokens at the end.
        Returns each request's proposal."""
        blocks = [r.block_ids for r in reqs]
        ids: list[int] | torch.Tensor = first
        feats = h
        outs = []
        for j in range(1, max(ks)):
            pos = [r.num_computed_tokens + j - 1 for r in reqs]
            ids, feats = g.run(pos, blocks, [k > j for k in ks], ids, feats)
            outs.append(ids.long().clone())
        count(self.runner, "draft_graph")
        return chained_drafts(first, outs, ks)

    def _argmax(self, h: torch.Tensor) -> list[int]:
        return self.target.compute_logits(h).argmax(dim=-1).tolist()

    def _forward(
        self, toks, feats, pos, tables, qsl, seq_lens, decode: bool, step: int = 0
    ) -> torch.Tensor:
        dev = self.device
        meta = draft_metadata(pos, tables, qsl, seq_lens, decode, self.bm.block_size, dev)
        ids = torch.tensor(toks, dtype=torch.int64, device=dev)
        embeds = self.target.model.embed_tokens(ids)
        positions = torch.tensor(pos, dtype=torch.int64, device=dev)
        return self.head(embeds, feats, positions, meta, self.kv, step)
