"""Tensor parallelism on the CPU (gloo, 2 ranks as separate processes, fp32): greedy outputs of a
TP=2 engine equal a TP=1 engine token for token, greedy under transformers (teacher-forced:
tests/greedy_reference.py), for Llama (untied lm_head, llama3 rope), Qwen2 (qkv bias, tied
embeddings, one KV head for two ranks: replicated) and Qwen3 (q/k norm, head_dim 32), each with a
vocabulary of 385 rows (not divisible by 2: the last rank's rows are padding), in batches, with
chunked prefill and with preemption.

One TP=2 engine per checkpoint serves the whole module (starting a rank costs seconds)."""

from __future__ import annotations

import functools
import random
import shutil

import pytest
import torch
from voltserve.services.executor.engine import LLMEngine
from voltserve.services.executor.engine_args import engine_config
from voltserve.services.executor.tp.sharding import TPSplitError
from voltserve.shared.sampling_params import SamplingParams

from tests.checkpoints import TINY, _root, tokenizer
from tests.greedy_reference import TOKEN_ATOL, check_greedy_tokens

VOCAB = 385  # one more row than the tokenizer: not divisible by the two ranks

CASES = {
    # untied lm_head (vocabulary-parallel Linear), llama3 rope scaling, 2 KV heads: one per rank
    "llama": dict(tie_word_embeddings=False, num_key_value_heads=2),
    # qkv bias, tied embeddings, 1 KV head: replicated on both ranks
    "qwen2": dict(tie_word_embeddings=True, num_key_value_heads=1),
    # q/k RMSNorm per head, head_dim != hidden / heads
    "qwen3": dict(tie_word_embeddings=False, head_dim=32, num_key_value_heads=2),
}


@functools.cache
def tp_checkpoint(arch: str) -> str:
    """A tiny checkpoint of `arch` with CASES[arch] and a 385-row vocabulary."""
    from transformers import AutoModelForCausalLM
    from voltserve.services.executor.demo_model import write_checkpoint

    out = _root() / f"tp-{arch}"
    if out.exists():
        shutil.rmtree(out)
    over = dict(TINY)
    over.update(CASES[arch])
    write_checkpoint(out, arch=arch, size="tiny", seed=7, tokenizer=tokenizer(), **over)
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    torch.manual_seed(11)
    model.resize_token_embeddings(VOCAB, mean_resizing=False)
    with torch.no_grad():  # the new row: random, so it can win an argmax
        model.get_input_embeddings().weight[-1].normal_(0, 0.08)
        if not model.config.tie_word_embeddings:
            model.get_output_embeddings().weight[-1].normal_(0, 0.08)
    for f in out.glob("*.safetensors"):
        f.unlink()
    model.save_pretrained(out)
    return str(out)


@functools.cache
def hf_model(arch: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tp_checkpoint(arch), dtype=torch.float32).eval()


def assert_greedy(arch: str, prompt: list[int], got: list[int], n: int) -> None:
    """got: n greedy tokens under transformers, teacher-forced (tests/greedy_reference.py: a
    tie may go either way)."""
    assert len(got) == n, (arch, prompt, got)
    check_greedy_tokens(hf_model(arch), prompt, got, TOKEN_ATOL)


def engine(arch: str, tp: int, **kw) -> LLMEngine:
    cfg = dict(max_num_batched_tokens=24, num_kv_blocks=12, max_num_seqs=8)
    cfg.update(kw)
    return LLMEngine(
        engine_config(
            model=tp_checkpoint(arch),
            device="cpu",
            dtype="float32",
            tensor_parallel_size=tp,
            **cfg,
        )
    )


@pytest.fixture(scope="module", params=sorted(CASES))
def engines(request):
    arch = request.param
    e1, e2 = engine(arch, 1), engine(arch, 2)
    yield arch, e1, e2
    e2.runner.shutdown()


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


def test_tp2_equals_tp1_and_transformers(engines, rng):
    """A batch with chunked prefill (24-token budget) and preemption: 12 blocks of 16 tokens.
    Six prompts of 26-32 tokens (2 blocks each) with 18-24 output tokens, at least 50 tokens in
    all: each request writes 49 or more positions, so it needs 4 blocks before it can finish.
    The fourth prompt's first chunk is admitted within four steps, while the first three hold
    at most 3 blocks each, so four requests run at once whose 16 blocks the 12 cannot hold:
    preemption is certain for every draw (each TP=2 step is collectives over gloo, slow on a
    loaded 2-core box)."""
    arch, e1, e2 = engines
    r = e2.runner
    assert r.tp is not None and r.tp.size == 2
    attn = r.model.model.layers[0].self_attn
    # The shards really are split (and the one KV head replicated for qwen2).
    a = r.model.arch
    assert attn.num_heads == a.num_heads // 2
    assert attn.num_kv_heads == max(1, a.num_kv_heads // 2)
    assert r.model.model.embed_tokens.weight.shape[0] == -(-VOCAB // 2)
    prompts = [[rng.randrange(VOCAB) for _ in range(rng.randrange(26, 33))] for _ in range(6)]
    n = [rng.randrange(50 - len(p), 25) for p in prompts]
    params = [greedy(k) for k in n]
    before = e2.stats().num_preemptions_total
    out2 = e2.generate(prompts, params)
    out1 = e1.generate(prompts, params)
    for p, k, o1, o2 in zip(prompts, n, out1, out2):
        assert o2 == o1, (arch, p)
        assert_greedy(arch, p, o1, k)
    assert e2.stats().num_preemptions_total > before  # 12 blocks cannot hold them all
    assert e2.check_all_free()


def test_tp2_single_request_and_logprobs(engines, rng):
    """One request alone (decode batch 1) and the sampled tokens' logprobs: the gathered logits
    equal TP=1's up to fp32 summation order."""
    arch, e1, e2 = engines
    prompt = [rng.randrange(VOCAB) for _ in range(rng.randrange(1, 30))]
    p = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=3)
    o1 = _run_with_logprobs(e1, prompt, p)
    o2 = _run_with_logprobs(e2, prompt, p)
    assert [t for t, _ in o2] == [t for t, _ in o1]
    assert_greedy(arch, prompt, [t for t, _ in o1], 6)
    for (_, lp1), (_, lp2) in zip(o1, o2):
        assert abs(lp1 - lp2) < 1e-4


def _run_with_logprobs(e: LLMEngine, prompt: list[int], p: SamplingParams):
    rid = f"lp-{random.random()}"
    e.add_request(rid, prompt, p)
    out = []
    done = False
    while not done:
        for o in e.step():
            if o.request_id == rid:
                assert o.new_logprobs is not None
                for tok, st in zip(o.new_token_ids, o.new_logprobs):
                    assert st.token_id == tok
                    out.append((tok, st.logprob))
                done = o.finished
    return out


def test_tp_larger_than_heads_refused():
    with pytest.raises(TPSplitError, match="larger than the model's 4 attention heads"):
        engine("llama", 8)


def test_tp_not_dividing_heads_refused():
    with pytest.raises(TPSplitError, match="num_attention_heads = 4 cannot be split"):
        engine("llama", 3)


def test_tp_with_speculative_decoding_refused_before_any_rank_starts():
    """The draft and verify steps run on rank 0 alone: the combination is refused by name."""
    with pytest.raises(TPSplitError, match="--speculative-config with --tensor-parallel-size 2"):
        engine("llama", 2, speculative_config={"method": "ngram", "num_speculative_tokens": 2})
