"""Greedy output (served over HTTP, or an engine's) checked against transformers, teacher-forced:
the reference runs once over the prompt and the served tokens, and every served token must be the
reference's argmax up to `atol` (an exact or near tie may go either way: the engine breaks ties
by the lower id, torch's argmax need not), with its served logprob, where there is one, within
`atol` of the reference's. A greedy run compared free-running with transformers' generate would
fail at a tie and compare nothing after it."""

from __future__ import annotations

import functools

import torch

from tests.checkpoints import hf_model_class

# An engine's fp32 CPU logits and transformers' differ by ~1e-5 (sums in another order); a wrong
# token of the tiny checkpoints is whole units behind the best.
TOKEN_ATOL = 1e-4


def token_ids(logprob_tokens: list[str]) -> list[int]:
    """The ids of a choice served with return_tokens_as_token_ids ("token_id:N" labels)."""
    assert all(t.startswith("token_id:") for t in logprob_tokens), logprob_tokens
    return [int(t.split(":", 1)[1]) for t in logprob_tokens]


def reference_logprobs(model, prompt: list[int], served: list[int]) -> torch.Tensor:
    """[len(served), V] log-softmax of the reference's logits before each served token, from one
    forward over the prompt and the served tokens."""
    ids = torch.tensor([list(prompt) + list(served)], device=model.device)
    with torch.no_grad():
        logits = model(ids, attention_mask=torch.ones_like(ids)).logits[0]
    return torch.log_softmax(logits[len(prompt) - 1 : -1].float(), -1)


def check_greedy_tokens(model, prompt: list[int], served: list[int], atol: float) -> torch.Tensor:
    """Every served token the reference's argmax up to `atol` (tokens only: an engine run's
    output); returns the reference's log-softmax per served step (reference_logprobs)."""
    assert served, served
    lp = reference_logprobs(model, prompt, served)
    _check_tokens(lp, prompt, served, atol)
    return lp


def _check_tokens(lp: torch.Tensor, prompt: list[int], served: list[int], atol: float) -> None:
    for step, t in enumerate(served):
        best = lp[step].max().item()
        want = lp[step, t].item()
        assert best - want <= atol, (
            f"step {step}: served {t} ({want:.6f}) is not greedy: the reference's best is "
            f"{int(lp[step].argmax())} ({best:.6f}); prompt {prompt}, served {served}"
        )


def check_greedy_outputs(
    model, prompts: list[list[int]], outs: list[list[int]], n: int, atol: float = TOKEN_ATOL
) -> None:
    """An engine's greedy outputs of prompts: n tokens each, check_greedy_tokens."""
    assert len(outs) == len(prompts), (len(outs), len(prompts))
    for prompt, got in zip(prompts, outs):
        assert len(got) == n, (prompt, got)
        check_greedy_tokens(model, prompt, got, atol)


def check_greedy(
    model, prompt: list[int], served: list[int], served_lps: list[float], atol: float
) -> torch.Tensor:
    """check_greedy_tokens, and each served logprob within `atol` of the reference's; returns
    the reference's log-softmax per served step."""
    lp = reference_logprobs(model, prompt, served)
    check_greedy_against(lp, prompt, served, served_lps, atol)
    return lp


def check_greedy_against(
    lp: torch.Tensor, prompt: list[int], served: list[int], served_lps: list[float], atol: float
) -> None:
    """check_greedy against a reference forward the caller already ran: lp is
    reference_logprobs(model, prompt, served) (for a caller whose tolerance depends on what
    that forward saw)."""
    assert len(served) == len(served_lps) and served, (served, served_lps)
    assert lp.shape[0] == len(served), (lp.shape, len(served))
    _check_tokens(lp, prompt, served, atol)
    for step, (t, got) in enumerate(zip(served, served_lps, strict=True)):
        want = lp[step, t].item()
        assert abs(got - want) < atol, (step, t, got, want, prompt, served)


@functools.cache
def reference_model(path: str):
    """The fp32 transformers model of a checkpoint folder, loaded once per process."""
    return hf_model_class(path).from_pretrained(path, dtype=torch.float32).eval()
