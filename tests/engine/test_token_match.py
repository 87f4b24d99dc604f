"""The tie-aware stream comparison (tests/engine/token_match.py) passes equal streams, lets a
stream part only at a near-tie, and fails a wrong token or a cut stream."""

from __future__ import annotations

import pytest
from voltserve.shared.sampling_params import SamplingParams

from tests.checkpoints import checkpoint, hf_greedy, tokenizer
from tests.engine import token_match


def test_streams_match_accepts_equal_and_near_ties_only(rng, monkeypatch) -> None:
    path = checkpoint("llama")
    V = len(tokenizer())
    prompt = [rng.randrange(V) for _ in range(rng.randint(1, 20))]
    want, logits = hf_greedy(path, prompt, 8)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    reqs = {"r": (prompt, params)}
    token_match.assert_streams_match({"r": want}, {"r": want}, reqs, path)
    k = rng.randrange(8)
    order = logits[k].argsort(descending=True).tolist()
    far = order[-1]  # the worst token: whole units behind the best
    wrong = want[:k] + [far] + want[k + 1 :]
    with pytest.raises(AssertionError, match="no near-tie"):
        token_match.assert_streams_match({"r": wrong}, {"r": want}, reqs, path)
    with pytest.raises(AssertionError, match="prefix"):
        token_match.assert_streams_match({"r": want[:k]}, {"r": want}, reqs, path)
    # Within the tolerance the runner-up is a tie and the rest of the stream is not compared.
    gap = (logits[k, order[0]] - logits[k, order[1]]).item()
    monkeypatch.setattr(token_match, "TIE_TOL", gap + 1e-3)
    runner_up = want[:k] + [order[1]] + [rng.randrange(V) for _ in range(7 - k)]
    token_match.assert_streams_match({"r": runner_up}, {"r": want}, reqs, path)
