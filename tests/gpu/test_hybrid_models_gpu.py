"""On a CUDA GPU: the hybrid linear-attention families (Qwen3.5 dense and MoE, Qwen3-Next; tiny
checkpoints from tests/checkpoints.py) through the real engine with the Gated DeltaNet kernels.
fp32: 6 requests at once with chunked prefill and forced preemption, greedy equal to
transformers fp32 on the same GPU, token for token. fp16 (the SM70 default) at the default
flags: each served token is, teacher-forced, the argmax up to 0.1 in log-probability of fp32
transformers or of fp16 transformers, except at steps where those two disagree by more than 0.1
(an fp16 near tie, mostly an expert router's in these tiny random-weight models, which moves
later layers' hidden states by tens of percent), at most one step in eight; in the MoE
families a router near tie that only our fp16 sums tip counts against the same allowance. Skipped without CUDA."""

from __future__ import annotations

import functools
import random

import pytest
import torch
from voltserve.services.executor.engine import LLMEngine
from voltserve.services.executor.engine_args import engine_config
from voltserve.shared.sampling_params import SamplingParams

from tests.checkpoints import checkpoint, greedy_tokens, hf_model_class, tokenizer
from tests.greedy_reference import reference_logprobs

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

ARCHS = ["qwen3_5", "qwen3_5_moe", "qwen3_next"]
ROUTED = {"qwen3_5_moe", "qwen3_next"}  # MoE layers: an expert router decides each token's path
MAX_NEW = 8


@functools.cache
def _hf(arch: str, dtype: torch.dtype = torch.float32):
    path = checkpoint(arch)
    return hf_model_class(path).from_pretrained(path, dtype=dtype).to("cuda").eval()


def _prompts(seed: int, n: int, lo: int, hi: int) -> list[list[int]]:
    rng = random.Random(seed)
    V = len(tokenizer())
    return [[rng.randrange(V) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


@pytest.mark.parametrize("arch", ARCHS)
def test_fp32_chunked_preempted_equals_transformers(arch: str) -> None:
    prompts = _prompts(5, 6, 16, 16)
    engine = LLMEngine(
        engine_config(
            model=str(checkpoint(arch)),
            device="cuda",
            dtype="float32",
            num_kv_blocks=3,
            max_num_batched_tokens=8,
            max_num_seqs=8,
            max_model_len=64,
        )
    )
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    want = [greedy_tokens(_hf(arch), p, MAX_NEW) for p in prompts]
    assert engine.generate(prompts, params) == want
    assert engine.batcher.num_preemptions > 0
    assert engine.check_all_free()


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("eager", [False, True], ids=["graphs", "eager"])
def test_fp16_default_flags_track_fp32(arch: str, eager: bool) -> None:
    prompts = _prompts(7, 8, 1, 300)
    engine = LLMEngine(
        engine_config(
            model=str(checkpoint(arch)), device="cuda", max_model_len=512, enforce_eager=eager
        )
    )
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    served = engine.generate(prompts, params)
    sensitive, off = [], []
    for i, (prompt, out) in enumerate(zip(prompts, served, strict=True)):
        lp32 = reference_logprobs(_hf(arch), prompt, out)
        lp16 = reference_logprobs(_hf(arch, torch.float16), prompt, out)
        for step, t in enumerate(out):
            gap32 = lp32[step].max().item() - lp32[step, t].item()
            gap16 = lp16[step].max().item() - lp16[step, t].item()
            # transformers' own fp16 and fp32 disagree here: a near tie of this model in fp16
            # (an expert router's, in the MoE checkpoints), which any fp16 summation order may
            # tip either way.
            a32, a16 = int(lp32[step].argmax()), int(lp16[step].argmax())
            split = max(lp32[step, a32] - lp32[step, a16], lp16[step, a16] - lp16[step, a32])
            if split > 0.1:
                sensitive.append((i, step, round(float(split), 3)))
            elif min(gap32, gap16) > 0.1:
                off.append((i, step, t, round(gap32, 3), round(gap16, 3)))
    print(f"{arch}: fp16/fp32 transformers split at {sensitive}; served token off both at {off}")
    if arch in ROUTED:
        # A router near tie that transformers' fp16 on this device tips the fp32 way while our
        # fp16 sums tip it the other (the served token then sits tenths of a nat under both)
        # looks like an fp16 error to the check above: both kinds count against the same
        # allowance of one step in eight.
        assert len(sensitive) + len(off) <= len(prompts) * MAX_NEW // 8, (sensitive, off)
    else:
        assert not off and len(sensitive) <= len(prompts) * MAX_NEW // 8, (sensitive, off)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("repeat_head", [False, True], ids=["random-head", "repeat-head"])
@pytest.mark.parametrize("n", [3, 6], ids=["graphs", "eager"])
def test_fp32_mtp_equals_transformers(arch: str, repeat_head: bool, n: int) -> None:
    """MTP speculation on CUDA (decode graphs captured, verify steps with the state rollback):
    greedy equals transformers fp32 with a random MTP head (mostly rejected) and one that
    proposes the last token k times (accepted where the target repeats a token); 3 requests
    at once verify in CUDA graphs (at most 4 sequences: state_rollback.py), their MTP
    catch-ups in graphs too; 6 eagerly."""
    from tests.mtp_checkpoints import mtp_checkpoint

    prompts = _prompts(11, n, 4, 40)
    engine = LLMEngine(
        engine_config(
            model=str(mtp_checkpoint(arch, repeat_head=repeat_head)),
            device="cuda",
            dtype="float32",
            max_model_len=128,
            num_kv_blocks=128,
            speculative_config={"method": "mtp", "num_speculative_tokens": 3},
        )
    )
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    want = [greedy_tokens(_hf(arch), p, MAX_NEW) for p in prompts]
    assert engine.generate(prompts, params) == want
    st = engine.stats()
    assert st.spec_decode_num_drafts > 0
    assert st.spec_decode_num_accepted_tokens <= st.spec_decode_num_draft_tokens
    counts = engine.runner.spec_graph_counts
    assert counts["verify_graph" if n == 3 else "verify_eager"] > 0, counts
    if n == 3:
        # The MTP layers' catch-up after each verify graph replays graphs too.
        assert counts["verify_eager"] == 0 and counts["catchup_graph"] > 0, counts
    assert engine.check_all_free()
