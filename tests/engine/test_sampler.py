"""The batch sampler on fresh random logits: truncation masks, penalties, logit bias,
min_tokens, logprobs, and seeded draws that do not depend on the batch around them."""

from __future__ import annotations

import random

import torch
from voltserve.kernels.dispatch import KernelDispatch
from voltserve.services.executor.request import Request
from voltserve.services.executor.sampler import Sampler, SampleRow
from voltserve.shared.sampling_params import SamplingParams

V = 257
CPU = torch.device("cpu")


def sampler() -> Sampler:
    return Sampler(KernelDispatch(CPU), CPU)


def row(params: SamplingParams, seed: int = 0, prompt=(1, 2, 3), output=(), pos=None, eos=()):
    r = Request("r", list(prompt), params, seed=seed, arrival_time=0.0)
    r.output_token_ids = list(output)
    return SampleRow(r, r.num_output_tokens if pos is None else pos, tuple(eos))


def logits(n: int, scale: float = 3.0) -> torch.Tensor:
    return torch.randn(n, V) * scale


def test_greedy_is_argmax_of_raw_logits_on_both_paths() -> None:
    x = logits(8)
    fast = sampler()(x, [row(SamplingParams(temperature=0.0)) for _ in range(8)])
    full = sampler()(x, [row(SamplingParams(temperature=0.0, logprobs=0)) for _ in range(8)])
    want = x.argmax(-1).tolist()
    assert [t.token_id for t in fast] == want == [t.token_id for t in full]
    assert all(t.logprob is None for t in fast)


def _draws(x: torch.Tensor, params: SamplingParams, n: int) -> list[int]:
    rows = [row(params, seed=random.randrange(1 << 62)) for _ in range(n)]
    return [t.token_id for t in sampler()(x.expand(n, V).contiguous(), rows)]


def test_top_k_top_p_min_p_masks() -> None:
    x = logits(1, scale=2.0)
    # Top logit at most 2 above the runner-up: a lead of ~6 made 400 top-5 draws all the top one.
    top2 = x[0].topk(2).values
    x[0, x[0].argmax()] = torch.minimum(top2[0], top2[1] + 2.0)
    probs = torch.softmax(x[0], -1)
    order = probs.argsort(descending=True).tolist()
    got = set(_draws(x, SamplingParams(temperature=1.0, top_k=5), 400))
    assert got <= set(order[:5]) and len(got) > 1
    # top-p: the smallest prefix of sorted probs whose mass reaches top_p
    cum = probs[order].cumsum(0)
    n_keep = int((cum < 0.6).sum()) + 1
    got = set(_draws(x, SamplingParams(temperature=1.0, top_p=0.6), 400))
    assert got <= set(order[:n_keep])
    got = set(_draws(x, SamplingParams(temperature=1.0, min_p=0.3), 400))
    allowed = set((probs >= 0.3 * probs.max()).nonzero().flatten().tolist())
    assert got <= allowed
    # temperature sampling over everything does reach beyond the top handful
    assert len(set(_draws(x, SamplingParams(temperature=1.5), 400))) > 5


def test_combined_filters_apply_in_vllm_order() -> None:
    """top-p measures mass over what min-p and top-k keep (renormalised), as vLLM does; the
    old intersection with top-p over the full distribution kept more tokens."""
    x = logits(1, scale=0.4)  # flat: top-p over the full distribution would keep many tokens
    probs = torch.softmax(x[0], -1)
    order = probs.argsort(descending=True).tolist()
    k, p = 12, 0.4
    top = probs[order[:k]] / probs[order[:k]].sum()
    n_keep = int((top.cumsum(0) - top < p).sum())
    assert n_keep < k  # the full-distribution top-p at 0.4 keeps far more than 12 here
    got = set(_draws(x, SamplingParams(temperature=1.0, top_k=k, top_p=p), 400))
    assert got == set(order[:n_keep])
    # min-p first, then top-p over its survivors
    mp = 0.5
    surv = [i for i in order if probs[i] >= mp * probs.max()]
    q = probs[surv] / probs[surv].sum()
    n_keep = int((q.cumsum(0) - q < p).sum())
    got = set(_draws(x, SamplingParams(temperature=1.0, min_p=mp, top_p=p), 400))
    assert got <= set(surv[:n_keep]) and len(got) >= min(n_keep, 2)


def test_penalties_follow_reference_semantics() -> None:
    x = logits(1, scale=0.5)  # everything else stays far below 4
    top, second = random.sample(range(8, V), 2)
    x[0, top], x[0, second] = 5.0, 4.0
    # repetition: the top token in the prompt, penalised below the runner-up
    p = SamplingParams(temperature=0.0, repetition_penalty=2.0)
    (t,) = sampler()(x, [row(p, prompt=[top, 7])])
    assert t.token_id == second
    # presence/frequency: over output tokens only; the frequency term scales with the count
    p = SamplingParams(temperature=0.0, frequency_penalty=0.6)
    (t,) = sampler()(x, [row(p, prompt=[1], output=[top])])
    assert t.token_id == top  # 5.0 - 0.6 > 4.0
    (t,) = sampler()(x, [row(p, prompt=[1], output=[top, top])])
    assert t.token_id == second  # 5.0 - 1.2 < 4.0
    p = SamplingParams(temperature=0.0, presence_penalty=1.5)
    (t,) = sampler()(x, [row(p, prompt=[top], output=[])])
    assert t.token_id == top  # presence ignores the prompt


def test_logit_bias_and_raw_logprobs() -> None:
    x = logits(2)
    target = random.randrange(V)
    p = SamplingParams(temperature=0.7, logit_bias={target: 100.0}, logprobs=4)
    out = sampler()(x, [row(p, seed=1), row(SamplingParams(temperature=0.0), seed=2)])
    assert out[0].token_id == target
    raw = torch.log_softmax(x[0], -1)
    # logprobs are of the raw logits: neither bias nor temperature shows in them
    assert abs(out[0].logprob - raw[target].item()) < 1e-5
    top_v, top_i = raw.topk(4)
    assert [i for i, _ in out[0].top_logprobs] == top_i.tolist()
    assert torch.allclose(torch.tensor([v for _, v in out[0].top_logprobs]), top_v)
    assert out[1].token_id == int(x[1].argmax()) and out[1].logprob is None


def test_min_tokens_masks_eos_and_stop_ids() -> None:
    x = logits(1)
    eos, stop = 11, 12
    x[0, eos], x[0, stop] = 50.0, 49.0
    p = SamplingParams(temperature=0.0, min_tokens=3, eos_token_ids=[eos], stop_token_ids=[stop])
    (t,) = sampler()(x, [row(p, output=[5, 6])])  # position 2 < 3: both masked
    assert t.token_id not in (eos, stop)
    (t,) = sampler()(x, [row(p, output=[5, 6, 7])])  # position 3: allowed again
    assert t.token_id == eos
    # ignore_eos: eos never finishes the request, so min_tokens does not hold it back
    p2 = SamplingParams(temperature=0.0, min_tokens=3, ignore_eos=True, stop_token_ids=[stop])
    (t,) = sampler()(x, [row(p2, output=[5], eos=(eos,))])
    assert t.token_id == eos
    # the model's eos ids (from the runner) are masked too when params carry none
    p3 = SamplingParams(temperature=0.0, min_tokens=2)
    x[0, stop] = 0.0
    (t,) = sampler()(x, [row(p3, output=[], eos=(eos,))])
    assert t.token_id != eos


def test_seeded_sampling_is_batch_invariant() -> None:
    # Flat logits: top_p 0.95 keeps many tokens whatever the draw, so 12 positions cannot all
    # draw the same one (a peaked random row, one token over 0.95, made them all equal).
    x = logits(1, scale=0.5)
    p = SamplingParams(temperature=0.9, top_p=0.95, seed=1234)
    alone = [sampler()(x, [row(p, seed=1234, pos=i)])[0].token_id for i in range(12)]
    assert len(set(alone)) > 1  # the output position moves the draw
    for i in range(12):
        n = random.randint(1, 6)
        others = [
            row(
                SamplingParams(
                    temperature=random.choice([0.0, 0.5, 1.3]),
                    top_k=random.choice([0, 3]),
                    repetition_penalty=random.choice([1.0, 1.3]),
                    logprobs=random.choice([None, 2]),
                ),
                seed=random.randrange(1 << 40),
                pos=random.randrange(20),
            )
            for _ in range(n)
        ]
        at = random.randint(0, n)
        rows = others[:at] + [row(p, seed=1234, pos=i)] + others[at:]
        batch = torch.cat([logits(at), x, logits(n - at)])
        assert sampler()(batch, rows)[at].token_id == alone[i]


def test_huge_seeds_are_accepted() -> None:
    x = logits(2)
    p = SamplingParams(temperature=1.0)
    out = sampler()(x, [row(p, seed=(1 << 64) - 1), row(p, seed=1 << 70)])
    assert all(0 <= t.token_id < V for t in out)


def test_fp16_logits_sample_as_their_fp32_widening() -> None:
    # The decode graphs hand the sampler logits in the model's dtype; every path must give what
    # the same values widened to fp32 give: tokens, seeded draws and logprobs.
    x16 = logits(6).half()
    x32 = x16.float()
    for params in (
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.0, logprobs=3),
        SamplingParams(temperature=0.8, top_k=20, top_p=0.9, logprobs=2),
        SamplingParams(temperature=1.0, presence_penalty=0.5, logit_bias={3: 2.0}),
    ):
        seeds = [random.randrange(1 << 62) for _ in range(6)]
        a = sampler()(x16, [row(params, seed=s, output=(3, 4)) for s in seeds])
        b = sampler()(x32, [row(params, seed=s, output=(3, 4)) for s in seeds])
        assert [t.token_id for t in a] == [t.token_id for t in b]
        assert [t.logprob for t in a] == [t.logprob for t in b]
        assert [t.top_logprobs for t in a] == [t.top_logprobs for t in b]
