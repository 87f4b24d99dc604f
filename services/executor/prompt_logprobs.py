"""Prompt logprobs (params.prompt_logprobs): which rows of a step's logits give them, and the
entries computed from those rows. The row at position p predicts prompt token p + 1; entries are
{"logprob", "rank", "top"} as the OpenAI API returns them."""

from __future__ import annotations

import numpy as np
import torch
from voltserve.services.executor.request import Request, RunnerOutput
from voltserve.services.executor.sampler import finite_rows


def prompt_logprob_rows(
    reqs: list[Request], start_list: list[int], n_list: list[int], qsl: np.ndarray
) -> list[tuple[Request, int, int, int]]:
    """(request, first position, first flat row, count) of the rows whose logits give prompt
    logprobs: the row at position p predicts prompt token p + 1."""
    out = []
    for b, r in enumerate(reqs):
        if r.params.prompt_logprobs is None or r.output_token_ids:
            continue
        start = start_list[b]
        end = min(start + n_list[b], len(r.prompt_token_ids) - 1)
        if end > start:
            out.append((r, start, int(qsl[b]), end - start))
    return out


def compute_prompt_logprobs(
    rows: list[tuple[Request, int, int, int]], logits: torch.Tensor, out: RunnerOutput
) -> None:
    """logits: one row per prompt-logprob row of this step, in `rows` order (as
    prompt_logprob_rows gives them); the entries go to out.prompt_logprobs, requests with a
    non-finite row to out.nonfinite_prompts."""
    targets: list[int] = []
    for r, start, _, count in rows:
        targets.extend(r.prompt_token_ids[start + 1 : start + 1 + count])
    lp = torch.log_softmax(logits.float(), dim=-1)
    t = torch.tensor(targets, dtype=torch.int64, device=lp.device)
    chosen = lp.gather(1, t[:, None])[:, 0]
    # Rank as vLLM counts it: 1 + the number of tokens more likely than this one.
    rank = (lp > chosen[:, None]).sum(dim=1) + 1
    k = max(r.params.prompt_logprobs or 0 for r, *_ in rows)
    top_v = top_i = None
    if k:
        tv, ti = lp.topk(k, dim=-1)
        top_v, top_i = tv.cpu().tolist(), ti.cpu().tolist()
    chosen_l, rank_l = chosen.cpu().tolist(), rank.cpu().tolist()
    finite_l = finite_rows(logits).cpu().tolist()
    i = 0
    for r, start, _, count in rows:
        if not all(finite_l[i : i + count]):
            # NaN logprobs must never be sent: the request ends with an error instead.
            out.nonfinite_prompts.add(r.request_id)
        n_top = r.params.prompt_logprobs or 0
        entries = out.prompt_logprobs.setdefault(r.request_id, [])
        for j in range(count):
            top = []
            if n_top:
                top = [[int(a), float(v)] for a, v in zip(top_i[i][:n_top], top_v[i][:n_top])]
            entries.append(
                (start + 1 + j, {"logprob": chosen_l[i], "rank": int(rank_l[i]), "top": top})
            )
            i += 1
