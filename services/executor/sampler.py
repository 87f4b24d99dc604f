"""The batch sampler: logits of the sampling rows -> token ids (+ logprobs).

Order per row, as vLLM applies them: logit_bias, the min_tokens mask, penalties
(repetition / presence / frequency), then temperature, min-p, top-k, top-p (each over what the
previous one kept, top-p over the renormalised mass) and the seeded Gumbel-max draw
(kernels/sampling/sampling.py). Greedy rows take the argmax of the processed logits, which
is the argmax of the raw logits when no bias, penalty or mask applies.

Logprobs are log_softmax of the RAW model logits (before bias, penalties, temperature and
truncation), which is what vLLM returns by default (logprobs_mode="raw_logprobs").

Structured outputs: a constrained row's grammar mask comes first, on the logits themselves
(tokens the grammar forbids become -inf), before bias, penalties and the sampling rule, as in
vLLM, where the grammar bitmask is applied to the logits before the sampler sees them. So its
logprobs are those of the masked distribution (renormalised over the allowed tokens; forbidden
tokens never appear among the top N), which is also what vLLM returns. The masks are filled on
the host (xgrammar) after the step's forward was launched and before anything here waits for
the device, so the fill overlaps the GPU's forward; one copy moves them to the device and one
kernel (kernels/sampling/grammar_mask.py) applies them to the constrained rows only. A constrained
row's draw still depends only on its seed and output position (the mask changes which tokens can
win, not the noise), so seeded structured requests are batch-invariant too.

Non-finite logits (a row holding NaN or infinity: activations that overflowed, most often fp16
on a checkpoint trained in bf16) never reach a kernel that indexes by them. Each row's finiteness
is found on the device (`finite_rows`), a non-finite row is zeroed before anything samples,
gathers or sorts it, and its token comes back as NONFINITE in the same transfer as the other
ids: no extra host sync. The engine ends that request with an error; the other rows go on.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from voltserve.kernels.dispatch import KernelDispatch
from voltserve.services.executor.grammar_state import restrict_utf8_rows
from voltserve.services.executor.request import NONFINITE, Request, SampledIds, SampledToken

_M64 = (1 << 64) - 1


def _as_int64(seed: int) -> int:
    """Any integer seed as the signed 64-bit value with the same low 64 bits."""
    s = seed & _M64
    return s - (1 << 64) if s >= 1 << 63 else s


def finite_rows(logits: torch.Tensor) -> torch.Tensor:
    """[N] bool on the device: row i of the [N, V] logits holds no NaN or infinity. One fp32
    reduction pass with no [N, V] intermediate (a CUDA graph captures it): a row's sum is finite
    exactly when every element is, as long as the finite values cannot add up past fp32's range
    (3.4e38), which fp16 values (at most 65504) over any vocabulary cannot, nor any fp32 logits
    short of 1e32."""
    return torch.isfinite(logits.sum(dim=-1, dtype=torch.float32))


def flag_nonfinite(ids: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    """ids [N] with NONFINITE in the rows whose logits are not all finite."""
    return torch.where(finite_rows(logits), ids, NONFINITE)


@dataclass
class SampleRow:
    """One row to sample: the request and the output index of the token being sampled."""

    request: Request
    output_pos: int
    # Model-level eos ids, masked with stop_token_ids while min_tokens is unmet.
    eos_token_ids: tuple[int, ...] = ()
    # Speculation: the proposed tokens between the request's outputs and this row (its
    # context is prompt + outputs + prefix; penalties count them as outputs).
    prefix: tuple[int, ...] = ()


def _has_penalties(r: Request) -> bool:
    p = r.params
    return p.repetition_penalty != 1.0 or p.presence_penalty != 0.0 or p.frequency_penalty != 0.0


def _plain_greedy(r: Request) -> bool:
    """Greedy with nothing that adjusts the logits and no logprobs: the token is the raw
    logits' argmax (unless min_tokens bans something at this position)."""
    p = r.params
    return (
        p.greedy
        and p.logprobs is None
        and not p.logit_bias
        and not _has_penalties(r)
        and p.structured is None
    )


def plain_argmax_step(reqs: list[Request]) -> bool:
    """True when each request's next token is the raw logits' argmax: plain greedy (cached on
    the request) and past min_tokens. The condition of `Sampler.sample_last`'s fast path."""
    for r in reqs:
        plain = r.plain_greedy
        if plain is None:
            plain = r.plain_greedy = _plain_greedy(r)
        if not plain or len(r.output_token_ids) < r.params.min_tokens:
            return False
    return True


def _min_tokens_ban(row: SampleRow) -> list[int]:
    """Token ids banned at this position by min_tokens: stop_token_ids, and eos unless ignore_eos
    (with ignore_eos an eos does not finish the request, so there is nothing to hold back)."""
    p = row.request.params
    if row.output_pos >= p.min_tokens:
        return []
    ban = list(p.stop_token_ids)
    if not p.ignore_eos:
        ban += list(p.eos_token_ids) + list(row.eos_token_ids)
    return sorted(set(ban))


# From this many constrained rows on, xgrammar fills the masks with its own thread pool.
BATCH_FILL_MIN = 8


class Sampler:
    def __init__(self, ops: KernelDispatch, device: torch.device) -> None:
        self.ops = ops
        self.device = device
        # Host bitmask rows of the constrained requests ([rows, ceil(V / 32)] int32; pinned on
        # CUDA so the copy to the device is asynchronous). Grown on demand.
        self._mask_host: torch.Tensor | None = None
        self._batch_matcher = None

    def _tensor(self, values: list, dtype: torch.dtype) -> torch.Tensor:
        # Small per-step tensors: pinning them would cost more (cudaHostAlloc) than it saves.
        return torch.tensor(values, dtype=dtype, device=self.device)

    def needs_full_path(self, rows: list[SampleRow]) -> bool:
        for row in rows:
            if not _plain_greedy(row.request) or _min_tokens_ban(row):
                return True
        return False

    def sample_last(
        self,
        logits: torch.Tensor,
        reqs: list[Request],
        eos_token_ids: tuple[int, ...],
        argmax: torch.Tensor | None = None,
    ) -> SampledIds | list[SampledToken]:
        """A decode step's tokens: row i samples reqs[i]'s next output token (output position
        len(output_token_ids)). Same result as __call__ with those SampleRows; when every row is
        plain greedy past its min_tokens, no per-row object is built at all.
        argmax: logits.argmax(-1) already computed on the device, NONFINITE in non-finite rows
        (the decode graph does it)."""
        if not plain_argmax_step(reqs):
            rows = [SampleRow(q, len(q.output_token_ids), eos_token_ids) for q in reqs]
            return self(logits, rows)
        if argmax is None:
            argmax = flag_nonfinite(logits.argmax(dim=-1), logits)
        return SampledIds(argmax.tolist())

    @torch.inference_mode()
    def __call__(self, logits: torch.Tensor, rows: list[SampleRow]) -> list[SampledToken]:
        """logits: [N, V] on the device (fp32, or the model's dtype from a decode graph: the
        adjustments, sampling and logprobs run on an fp32 copy), row i for rows[i]. fp32 logits
        are changed in place (grammar masks, non-finite rows zeroed). A row whose logits are
        not all finite samples NONFINITE."""
        if not rows:
            return []
        if not self.needs_full_path(rows):
            # Fast path: all greedy, nothing to adjust, no logprobs.
            return SampledIds(flag_nonfinite(logits.argmax(dim=-1), logits).tolist())
        N, V = logits.shape
        logits = logits.float()  # a no-op for fp32 logits (then work's clone is the one copy)
        # Before the grammar mask and the bans, which put -inf in on purpose. A zeroed row
        # samples some valid id (never an index out of range); the id is replaced below.
        finite = finite_rows(logits)
        logits.masked_fill_(~finite[:, None], 0.0)
        self._apply_grammar(logits, rows, V)
        work = logits.clone()
        self._apply_bias_and_bans(work, rows, V)
        self._apply_penalties(work, rows, V)
        ps = [row.request.params for row in rows]
        ids = self.ops.sample(
            work,
            self._tensor([0.0 if p.greedy else p.temperature for p in ps], torch.float32),
            self._tensor([max(p.top_k, 0) for p in ps], torch.int32),
            self._tensor([p.top_p for p in ps], torch.float32),
            self._tensor([p.min_p for p in ps], torch.float32),
            self._tensor([_as_int64(row.request.seed) for row in rows], torch.int64),
            self._tensor([row.output_pos for row in rows], torch.int64),
        )
        want = [i for i, p in enumerate(ps) if p.logprobs is not None]
        if not want:
            return [SampledToken(int(t)) for t in torch.where(finite, ids, NONFINITE).tolist()]
        return self._with_logprobs(logits, ids, finite, rows, want)

    def _apply_grammar(self, logits: torch.Tensor, rows: list[SampleRow], V: int) -> None:
        """-inf on the tokens each active grammar forbids (in place, constrained rows only).
        A request's verify rows (speculation: rows whose prefix holds 1..k proposed tokens,
        right after its own row) take their masks from GrammarState.fill_draft: the grammar's
        state after each proposed prefix, the matcher itself left where it was."""
        # (grammar, first logits row, proposed tokens): one mask row per position.
        groups: list[tuple[object, int, tuple[int, ...]]] = []
        n_rows = len(rows)
        i = 0
        while i < n_rows:
            row = rows[i]
            g = row.request.grammar
            j = i + 1
            while j < n_rows and rows[j].request is row.request and rows[j].prefix:
                j += 1
            if g is not None and (j > i + 1 or g.active):
                if g.position != row.output_pos:
                    raise RuntimeError(
                        f"request {row.request.request_id}: its grammar has seen {g.position} "
                        f"output tokens but the sampler is at output position {row.output_pos}"
                    )
                groups.append((g, i, rows[j - 1].prefix))
            i = j
        if not groups:
            return
        M = sum(len(d) + 1 for _, _, d in groups)
        W = (V + 31) // 32
        host = self._mask_host
        if host is None or host.shape[0] < M or host.shape[1] != W:
            cap = max(M, 2 * host.shape[0] if host is not None else 16)
            pin = self.device.type == "cuda"
            host = self._mask_host = torch.empty(cap, W, dtype=torch.int32, pin_memory=pin)
        idx: list[int] = []
        if M == len(groups) and M >= BATCH_FILL_MIN:  # no proposals: one row per request
            if self._batch_matcher is None:
                import xgrammar as xgr

                self._batch_matcher = xgr.BatchGrammarMatcher()
            self._batch_matcher.batch_fill_next_token_bitmask(
                [g.matcher for g, _, _ in groups], host, list(range(M))
            )
            restrict_utf8_rows(host, [g for g, _, _ in groups])
            idx = [i for _, i, _ in groups]
        else:
            m = 0
            for g, i, draft in groups:
                if draft:
                    m += g.fill_draft(draft, host, m)
                else:
                    g.fill(host, m)
                    m += 1
                idx.extend(range(i, i + len(draft) + 1))
        mask = host[:M]
        if self.device.type != "cpu":
            mask = mask.to(self.device, non_blocking=True)
        self.ops.apply_token_bitmask(logits, mask, self._tensor(idx, torch.int64))

    def _apply_bias_and_bans(self, work: torch.Tensor, rows: list[SampleRow], V: int) -> None:
        r_idx: list[int] = []
        t_idx: list[int] = []
        vals: list[float] = []
        for i, row in enumerate(rows):
            for tok, b in (row.request.params.logit_bias or {}).items():
                if 0 <= tok < V:
                    r_idx.append(i)
                    t_idx.append(tok)
                    vals.append(b)
        if r_idx:
            idx = self._tensor([r_idx, t_idx], torch.int64)
            work.index_put_((idx[0], idx[1]), self._tensor(vals, torch.float32), accumulate=True)
        r_idx, t_idx = [], []
        for i, row in enumerate(rows):
            for tok in _min_tokens_ban(row):
                if 0 <= tok < V:
                    r_idx.append(i)
                    t_idx.append(tok)
        if r_idx:
            idx = self._tensor([r_idx, t_idx], torch.int64)
            work[idx[0], idx[1]] = float("-inf")

    def _apply_penalties(self, work: torch.Tensor, rows: list[SampleRow], V: int) -> None:
        pen = [i for i, row in enumerate(rows) if _has_penalties(row.request)]
        if not pen:
            return
        n = len(pen)
        pr, pt, orr, ot = [], [], [], []
        for j, i in enumerate(pen):
            r = rows[i].request
            toks = [t for t in set(r.prompt_token_ids) if 0 <= t < V]
            pr += [j] * len(toks)
            pt += toks
            # Output tokens so far: the first output_pos of the request's outputs (the last of
            # them proposed ones, on a verify row).
            prefix = rows[i].prefix
            outs = r.output_token_ids[: rows[i].output_pos - len(prefix)] + list(prefix)
            outs = [t for t in outs if 0 <= t < V]
            orr += [j] * len(outs)
            ot += outs
        dev = self.device
        prompt_mask = torch.zeros(n, V, dtype=torch.bool, device=dev)
        counts = torch.zeros(n, V, dtype=torch.int32, device=dev)
        if pr:
            idx = self._tensor([pr, pt], torch.int64)
            prompt_mask[idx[0], idx[1]] = True
        if orr:
            idx = self._tensor([orr, ot], torch.int64)
            counts.index_put_(
                (idx[0], idx[1]),
                torch.ones(len(orr), dtype=torch.int32, device=dev),
                accumulate=True,
            )
        ps = [rows[i].request.params for i in pen]
        sub = work[pen]
        self.ops.apply_penalties(
            sub,
            prompt_mask,
            counts,
            self._tensor([p.repetition_penalty for p in ps], torch.float32),
            self._tensor([p.presence_penalty for p in ps], torch.float32),
            self._tensor([p.frequency_penalty for p in ps], torch.float32),
        )
        work[pen] = sub

    def _with_logprobs(
        self,
        logits: torch.Tensor,
        ids: torch.Tensor,
        finite: torch.Tensor,
        rows: list[SampleRow],
        want: list[int],
    ) -> list[SampledToken]:
        """ids: valid in every row (a non-finite row was zeroed before sampling); `finite`
        says which rows' tokens are NONFINITE instead."""
        sel = torch.tensor(want, dtype=torch.int64, device=logits.device)
        lp = torch.log_softmax(logits[sel], dim=-1)
        chosen = lp.gather(1, ids[sel].view(-1, 1)).squeeze(1)
        k = max(rows[i].request.params.logprobs or 0 for i in want)
        top_v, top_i = lp.topk(k, dim=-1) if k > 0 else (lp[:, :0], lp[:, :0].long())
        # One device -> host transfer for everything.
        ids_l = torch.where(finite, ids, NONFINITE).tolist()
        chosen_l, top_v_l, top_i_l = chosen.tolist(), top_v.tolist(), top_i.tolist()
        out = [SampledToken(int(t)) for t in ids_l]
        for j, i in enumerate(want):
            if ids_l[i] == NONFINITE:
                continue  # the request ends with an error: no logprobs to send
            n = rows[i].request.params.logprobs or 0
            out[i].logprob = float(chosen_l[j])
            out[i].top_logprobs = [
                (int(t), float(v)) for t, v in zip(top_i_l[j][:n], top_v_l[j][:n])
            ]
        return out
