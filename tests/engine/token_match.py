"""Two engine runs' token streams compared by what holds for every draw.

Runs that batch differently (a pipelined engine against the eager one, graph batches padded to
a capture size, a request preempted at another step) compute the same logits through matmuls of
different shapes, and CPU BLAS sums those in a shape-dependent order: a logit can differ in its
last bits. Where a row's two best scores are that close the runs may pick different tokens and
both be right. So a stream must equal the reference's, except that at the first token where they
part both tokens must score within `TIE_TOL` of the best under transformers' own logits for
that prefix (greedy: the raw logits; seeded sampling: logits / T plus the seeded Gumbel noise of
that output position, with min_tokens' ban). Past such a tie the streams continue from different
prefixes and are not compared. A wrong id, position or row gives a token that is no near-tie
and fails.
"""

from __future__ import annotations

import functools
from pathlib import Path

import torch

# fp32 CPU logits of one prefix differ by ~1e-5 between matmul shapes; a wrong token of the
# tiny checkpoints is typically whole units behind the best.
TIE_TOL = 1e-3


@functools.cache
def _hf_model(path: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


@functools.cache
def _eos_ids(path: str) -> tuple[int, ...]:
    from transformers import AutoConfig, GenerationConfig

    ids: set[int] = set()
    sources = [AutoConfig.from_pretrained(path)]
    if (Path(path) / "generation_config.json").exists():
        sources.append(GenerationConfig.from_pretrained(path))
    for src in sources:
        eos = getattr(src, "eos_token_id", None)
        ids.update([eos] if isinstance(eos, int) else (eos or []))
    return tuple(sorted(ids))


def _scores(path: str, context: list[int], params, pos: int) -> torch.Tensor:
    """The sampler's decision scores of output position `pos` after `context`, under
    transformers' logits (the sampling rule restated from its documented semantics)."""
    from voltserve.kernels.sampling.sampling import seeded_uniform_ref

    with torch.no_grad():
        logits = _hf_model(path)(torch.tensor([context])).logits[0, -1].float()
    if pos < params.min_tokens:
        ban = set(params.stop_token_ids or ())
        if not params.ignore_eos:
            ban |= set(params.eos_token_ids or ()) | set(_eos_ids(path))
        logits[sorted(ban)] = float("-inf")
    if params.temperature <= 1e-5:
        return logits
    seed = params.seed & ((1 << 64) - 1)
    seed = seed - (1 << 64) if seed >= 1 << 63 else seed
    u = seeded_uniform_ref(torch.tensor([seed]), torch.tensor([pos]), logits.numel())[0]
    return logits / params.temperature - torch.log(-torch.log(u))


def assert_streams_match(got: dict, want: dict, requests: dict, model: str | Path) -> None:
    """got/want: request id -> tokens; requests: id -> (prompt, SamplingParams)."""
    assert got.keys() == want.keys(), (sorted(got), sorted(want))
    for rid, (prompt, params) in requests.items():
        a, b = got.get(rid, []), want.get(rid, [])
        if a == b:
            continue
        k = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
        assert k is not None, f"{rid}: one stream is a prefix of the other: {a} vs {b}"
        assert params.temperature <= 1e-5 or params.seed is not None, f"{rid}: unseeded"
        assert params.top_k in (0, -1) and params.top_p == 1.0 and not params.min_p, (
            f"{rid}: tie check does not restate top-k/top-p/min-p; keep such requests equal"
        )
        s = _scores(str(model), list(prompt) + b[:k], params, k)
        best = s.max().item()
        gaps = best - s[a[k]].item(), best - s[b[k]].item()
        assert max(gaps) <= TIE_TOL, (
            f"{rid} parts at output {k}: {a[k]} vs {b[k]}, behind the best by {gaps} "
            f"(no near-tie)\n got  {a}\n want {b}"
        )
        print(f"{rid}: near-tie at output {k} ({a[k]} vs {b[k]}, gaps {gaps}); rest not compared")


def requests_of(arrivals) -> dict:
    """run_arrivals' (step, id, prompt, params) list as assert_streams_match's requests."""
    return {rid: (prompt, params) for _, rid, prompt, params in arrivals}
