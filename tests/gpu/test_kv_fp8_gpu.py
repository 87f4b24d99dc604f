"""On a CUDA GPU: the one-byte KV cache (--kv-cache-dtype fp8_e4m3 / fp8_e5m2) through the real
runner, fp16 weights and run dtype, decode in CUDA graphs: the numba cache write, the page
widening into the fp16 workspace and the fp16 attention kernels over it, at 1K, 8K and 32K
tokens of context (prefill in 2,048-token chunks over the cached pages, then decode).

The checkpoint: Llama-shaped, 2 layers, hidden 2048, 16 heads over 8 KV heads of head_dim 128,
the tests' 384-token tokenizer, weights N(0, 0.02) (embedding and lm_head N(0, 0.1)) stored in
fp16, so the fp32 reference runs on the very weights the engine serves.

Teacher-forced (tests/greedy_reference.py's scheme): transformers in fp32 on the GPU runs once
over each prompt and the served tokens, and at every generated position
- against transformers with K and V rounded the same way (the reference of the path: what is
  left is the fp16 compute, and elements that fp16 rounds to the neighbouring one-byte code):
  the served token within ROUNDED_TOL of the best, its logprob within ROUNDED_TOL;
- against plain fp32 transformers (the format's own rounding included): the served logprob
  within PLAIN_TOL[format].
Each context's largest deviation from both is printed (run with -s) for BENCHMARKS.md.

The tolerances, from the same checkpoint on the CPU at 1K tokens (64 positions; fp32 and fp16
transformers, K / V rounded by tests/kv_rounding.py): fp16 against fp32 moved the chosen
token's logprob by 0.045 with an fp16 cache, 0.069 (e4m3) and 0.095 (e5m2) with the one-byte
ones against the same rounding, and 0.20 (e4m3) / 0.36 (e5m2) against plain fp32. ROUNDED_TOL
and PLAIN_TOL leave about 2.5x of that for longer contexts.

Also: prefix caching and chunked prefill under fp8 give the tokens a whole-prompt prefill
without the cache gives (up to a near-tie of the rounded reference). Skipped without CUDA.
"""

from __future__ import annotations

import functools
import random

import pytest
import torch
from safetensors.torch import load_file, save_file
from voltserve.services.executor.engine import LLMEngine
from voltserve.services.executor.model_runner import ModelRunner
from voltserve.services.executor.request import Request
from voltserve.shared.config import EngineConfig
from voltserve.shared.sampling_params import SamplingParams

from tests.checkpoints import _root, drive, tokenizer
from tests.engine.test_kv_cache_dtype import rounded_reference

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

FORMATS = ("fp8_e4m3", "fp8_e5m2")
CONTEXTS = (1024, 8192, 32768)
MAX_NEW = 8
CHUNK = 2048  # prefill chunk (and step budget): a long prompt's later chunks read cached pages
ROUNDED_TOL = 0.25
PLAIN_TOL = {"fp8_e4m3": 0.5, "fp8_e5m2": 0.9}
BLOCK = 16


@functools.cache
def fp8_checkpoint() -> str:
    """The Llama-shaped checkpoint of the module docstring (built once per session)."""
    from voltserve.services.executor.demo_model import write_checkpoint

    out = _root() / "kv-fp8-llama-hd128"
    write_checkpoint(
        out,
        arch="llama",
        size="tiny",
        seed=3,
        tokenizer=tokenizer(),
        hidden_size=2048,
        intermediate_size=2048,
        num_hidden_layers=2,
        num_attention_heads=16,
        num_key_value_heads=8,
        max_position_embeddings=max(CONTEXTS) + 1024,
        rope_theta=500000.0,
    )
    g = torch.Generator().manual_seed(0)
    for f in out.glob("*.safetensors"):
        tensors = load_file(str(f))
        for name, t in tensors.items():
            if t.dim() >= 2:
                std = 0.1 if "embed" in name or "lm_head" in name else 0.02
                tensors[name] = torch.randn(t.shape, generator=g) * std
            tensors[name] = tensors[name].to(torch.float16).contiguous()
        save_file(tensors, str(f), metadata={"format": "pt"})
    return str(out)


@functools.cache
def reference(kv_dtype: str | None):
    """fp32 transformers on the GPU, K and V rounded to kv_dtype (None: plain)."""
    return rounded_reference(fp8_checkpoint(), kv_dtype, causal=True).to("cuda").eval()


def prompt_of(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    V = len(tokenizer())
    return [rng.randrange(V) for _ in range(n)]


def gpu_logprobs(model, prompt: list[int], served: list[int]) -> torch.Tensor:
    """[len(served), V] log-softmax of the reference before each served token (one forward)."""
    ids = torch.tensor([prompt + served], device="cuda")
    with torch.no_grad():
        # Only the rows before each served token: all 32K rows' logits would take 16 GiB.
        logits = model(ids, logits_to_keep=len(served) + 1).logits[0]
    return torch.log_softmax(logits[:-1].float(), -1).cpu()


@pytest.mark.parametrize("fmt", FORMATS)
def test_teacher_forced_against_fp32_at_long_contexts(fmt: str) -> None:
    runner = ModelRunner(
        EngineConfig(
            model=fp8_checkpoint(),
            device="cuda",
            dtype="float16",
            kv_cache_dtype=fmt,
            max_model_len=max(CONTEXTS) + MAX_NEW,
            max_num_batched_tokens=CHUNK,
            num_kv_blocks=-(-(max(CONTEXTS) + MAX_NEW) // BLOCK) + 1,
            max_num_seqs=4,
            max_graph_batch_size=4,
        )
    )
    assert runner.graphs is not None, f"no decode graphs: {runner.ops.impl}"
    for op in ("reshape_and_cache_fp8", "expand_kv_pages"):
        assert runner.ops.impl[op] == "cuda", runner.ops.impl
    assert all(k.dtype == torch.uint8 for k, _ in runner.kv_caches)
    report = []
    for n in CONTEXTS:
        prompt = prompt_of(n, seed=n)
        params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, logprobs=1, ignore_eos=True)
        req = Request(f"ctx{n}", prompt, params, seed=0, arrival_time=0.0)
        before = runner.graphs.num_replays
        drive(runner, [req], MAX_NEW, chunk=CHUNK)
        assert runner.graphs.num_replays > before  # the decode steps ran in graphs
        served = req.output_token_ids
        got = torch.tensor([t.logprob for t in req.trace])
        rounded = gpu_logprobs(reference(fmt), prompt, served)
        plain = gpu_logprobs(reference(None), prompt, served)
        idx = torch.tensor(served)[:, None]
        dev_rounded = (got - rounded.gather(1, idx)[:, 0]).abs().max().item()
        dev_plain = (got - plain.gather(1, idx)[:, 0]).abs().max().item()
        behind = (rounded.max(-1).values - rounded.gather(1, idx)[:, 0]).max().item()
        report.append((n, dev_rounded, dev_plain, behind))
        print(
            f"{fmt} context {n}: max |logprob - fp32 with the same K/V rounding| {dev_rounded:.4f}"
            f", max |logprob - plain fp32| {dev_plain:.4f}, served token behind the rounded "
            f"reference's best by at most {behind:.4f}"
        )
    for _n, dev_rounded, dev_plain, behind in report:
        assert dev_rounded <= ROUNDED_TOL and behind <= ROUNDED_TOL, (fmt, report)
        assert dev_plain <= PLAIN_TOL[fmt], (fmt, report)


def _engine(fmt: str, prefix_caching: bool, budget: int) -> LLMEngine:
    return LLMEngine(
        EngineConfig(
            model=fp8_checkpoint(),
            device="cuda",
            dtype="float16",
            kv_cache_dtype=fmt,
            max_model_len=8192,
            max_num_batched_tokens=budget,
            enable_prefix_caching=prefix_caching,
            max_graph_batch_size=8,
        )
    )


@pytest.mark.parametrize("fmt", FORMATS)
def test_prefix_caching_and_chunked_prefill_give_the_same_tokens(fmt: str) -> None:
    """Four prompts sharing a 3,000-token prefix (distinct tails of 50-500 tokens): served with
    prefix caching and a 512-token step budget (the first request's prefill fills the cache
    in chunks; the others start from its cached blocks, their tails in chunks over one-byte
    pages written by another request), and with neither (each prompt prefilled in one step).
    Token for token, except that two runs may part at a near-tie of the rounded reference
    (fp16 sums in another order can round an element to the neighbouring code)."""
    rng = random.Random(11)
    V = len(tokenizer())
    shared = [rng.randrange(V) for _ in range(3000)]
    prompts = [shared + [rng.randrange(V) for _ in range(rng.randint(50, 500))] for _ in range(4)]
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    cached = _engine(fmt, True, 512)
    first = cached.generate(prompts[:1], params)  # the shared prefix's blocks enter the cache
    got = first + cached.generate(prompts[1:], params)
    assert cached.stats().prefix_cache_hits >= 3 * (3000 // BLOCK) * BLOCK
    want = _engine(fmt, False, 8192).generate(prompts, params)
    model = reference(fmt)
    for p, a, b in zip(prompts, got, want, strict=True):
        k = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
        if k is None:
            assert len(a) == len(b) == 16
            continue
        lp = gpu_logprobs(model, p, b[: k + 1])[k]
        gaps = (lp.max() - lp[a[k]]).item(), (lp.max() - lp[b[k]]).item()
        assert max(gaps) <= ROUNDED_TOL, (fmt, k, a, b, gaps)
        print(f"{fmt}: near-tie at output {k} ({a[k]} vs {b[k]}, gaps {gaps})")
