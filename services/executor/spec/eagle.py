"""EAGLE proposer: a one-layer head (eagle_head.py) reads the target's last hidden states and
proposes k tokens greedily, one batched head forward per token.

Where the features come from: the proposer sets `needs_hidden_states`, and the runner then hands
out the target's final hidden state of every row it computes (per request: the first position
and the rows; `RunnerOutput.hidden_states`, which `observe` keeps until the next proposal). They collect per request in `Request.spec_state`
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
KV the head wrote for a prefix-cache hit's blocks (by the request that computed them) or left
stale by a preemption only makes proposals worse, never the output different: acceptance keeps
the target's tokens whatever is proposed (acceptance.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from voltserve.services.executor.request import Request, RequestStatus
from voltserve.services.executor.spec.draft_model import block_tables, draft_metadata
from voltserve.services.executor.spec.eagle_head import load_eagle_head
from voltserve.services.executor.spec.graph_setup import build_step_graphs
from voltserve.services.executor.spec.graphs import StepGraphs, count
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


class EagleProposer(ModelProposer):
    # The seam: the target's forward also hands out its hidden states.
    needs_hidden_states = True
    what = "eagle"
    # What _load_head loads, for the start-up phase's name.
    head_name = "the EAGLE head"

    def __init__(self, num_speculative_tokens: int, path: str) -> None:
        super().__init__(num_speculative_tokens, path)
        self.step_graphs: StepGraphs | None = None
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

    def make_graphs(self, runner, decode_sizes, verify_sizes, kv=None, capture=True) -> dict:
        """The head's single-row step graphs (the decode sizes): token and feature in, logits
        and the head's output feature out."""
        if kv is None:
            kv = alloc_proposer_kv(runner, 1, self.draft.arch)
        target, head = self.target, self.head

        def fwd(ids, feats, pos, meta, kv):
            h = head(target.model.embed_tokens(ids), feats, pos, meta, kv)
            return target.compute_logits(h, None, fp32_logits=False), h

        feature = (runner.arch.hidden_size, runner.dtype)
        what = "EAGLE head CUDA graphs"
        return {"step": build_step_graphs(runner, fwd, feature, kv, decode_sizes, what, capture)}

    def capture_graphs(self, runner, decode_sizes, verify_sizes) -> None:
        self.step_graphs = self.make_graphs(runner, decode_sizes, verify_sizes, self.kv)["step"]

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
        tables = block_tables(reqs)
        # The pairs (f_p, x_{p+1}) for p from the first new feature to c - 1.
        toks: list[int] = []
        pos: list[int] = []
        feats: list[torch.Tensor] = []
        qsl = [0]
        seq_lens: list[int] = []
        for r in reqs:
            st, c = r.spec_state, r.num_computed_tokens
            a = st.start
            toks += _tokens(r, a + 1, c - a)
            pos += range(a, c)
            feats.append(st.feats[: c - a])
            qsl.append(qsl[-1] + c - a)
            seq_lens.append(c)
            # Keep the last pair's feature: the next proposal starts from it.
            st.start, st.feats = c - 1, st.feats[c - 1 - a : c - a].clone()
        nprop = len(wanted)
        if not nprop:
            self._forward(toks, torch.cat(feats), pos, tables, qsl, seq_lens, decode=False)
            return out
        h = self._forward(toks, torch.cat(feats), pos, tables, qsl, seq_lens, decode=False)
        h = h[torch.tensor(qsl[1 : nprop + 1], device=h.device) - 1]
        ks = [wanted[r.request_id][1] for r in reqs[:nprop]]
        drafts = [[t] for t in self._argmax(h)]
        # k - 1 single-row steps: the head's own output is the next feature. As graph replays
        # when the runner captured them for this many requests (spec/graphs.py), else eagerly.
        g = self.step_graphs
        kmax = max(ks)
        if kmax > 1 and g is not None and g.can_run(nprop):
            self._graph_steps(g, reqs[:nprop], ks, drafts, h)
            kmax = 1
        elif kmax > 1:
            count(self.runner, "draft_eager")
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

    def _graph_steps(self, g, reqs: list[Request], ks: list[int], drafts, h: torch.Tensor):
        """Steps 1..max(ks)-1 as replays of the head's step graphs: each step's input token and
        feature are the previous step's argmax and output, on the device; one copy back of all
        their tokens at the end."""
        blocks = [r.block_ids for r in reqs]
        ids: list[int] | torch.Tensor = [d[-1] for d in drafts]
        feats = h
        outs = []
        for j in range(1, max(ks)):
            pos = [r.num_computed_tokens + j - 1 for r in reqs]
            ids, feats = g.run(pos, blocks, [k > j for k in ks], ids, feats)
            outs.append(ids.clone())
        for j, toks in enumerate(torch.stack(outs).tolist(), start=1):
            for b, t in enumerate(toks):
                if ks[b] > j:
                    drafts[b].append(t)
        count(self.runner, "draft_graph")

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
