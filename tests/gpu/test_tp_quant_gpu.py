"""Tensor parallelism of quantized, GGUF and MoE checkpoints on two GPUs (NCCL, fp16, decode
CUDA graphs holding the all-reduces): TP=2 tracks TP=1 on the same GPU for the checkpoints of
tests/engine/test_tp_quant_moe.py (AWQ, GPTQ act-order with its fp16 row-parallel fallback,
a Q4_K_M GGUF, Qwen3-MoE with one all-reduce per MoE block, AWQ experts), through the int4
kernels on each rank's shard shapes. Skipped with fewer than two GPUs.

fp16 tolerance as tests/gpu/test_tp_gpu.py: every prompt's first token equals TP=1's and its
logprob is within 0.05; at least 75% of all tokens lie in the common prefixes (a near-tie may
split one sequence, a wrong shard splits all of them at once)."""

from __future__ import annotations

import os
import random

import pytest
import torch
from voltserve.services.executor.engine import LLMEngine
from voltserve.shared.config import EngineConfig
from voltserve.shared.sampling_params import SamplingParams

from tests.checkpoints import tokenizer
from tests.engine.test_tp_quant_moe import case

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 GPUs"
    ),
]

GPU_CASES = (
    "awq-g128-llama",
    "gptq-4b-act-qwen2",
    "gguf-q4_k_m-qwen3",
    "qwen3_moe",
    "awq-g32-qwen3_moe",
)


def _engine(name: str, tp: int) -> LLMEngine:
    path, _, _ = case(name)
    return LLMEngine(
        EngineConfig(
            model=str(path),
            device="cuda",
            dtype="float16",
            tensor_parallel_size=tp,
            num_kv_blocks=256,
            max_model_len=256,
            max_num_batched_tokens=64,
            max_num_seqs=16,
            max_graph_batch_size=16,
        )
    )


def _run(e: LLMEngine, prompts: list[list[int]], n: int):
    """Greedy outputs and each prompt's first-token logprob."""
    p = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, logprobs=1)
    ids = [f"q{i}-{random.random()}" for i in range(len(prompts))]
    for rid, pr in zip(ids, prompts):
        e.add_request(rid, pr, p)
    toks: dict[str, list[int]] = {rid: [] for rid in ids}
    first: dict[str, float] = {}
    while e.has_unfinished_requests():
        for o in e.step():
            if o.request_id in toks:
                if o.new_logprobs and o.request_id not in first:
                    first[o.request_id] = o.new_logprobs[0].logprob
                toks[o.request_id].extend(o.new_token_ids)
    return [toks[r] for r in ids], [first[r] for r in ids]


@pytest.mark.parametrize("name", GPU_CASES)
def test_tp2_fp16_tracks_tp1_with_graphs(name: str) -> None:
    rng = random.Random(3)
    V = len(tokenizer())
    prompts = [[rng.randrange(V) for _ in range(rng.randint(1, 60))] for _ in range(8)]
    n = 24
    e1 = _engine(name, 1)
    out1, lp1 = _run(e1, prompts, n)
    del e1
    torch.cuda.empty_cache()
    e2 = _engine(name, 2)
    g = e2.runner.graphs
    assert g is not None, "TP=2 captured no decode graphs"
    before = g.num_replays
    out2, lp2 = _run(e2, prompts, n)
    assert g.num_replays > before  # decode replayed graphs holding the all-reduces
    e2.runner.shutdown()
    common = 0
    for a, b, x, y in zip(out1, out2, lp1, lp2):
        assert a[0] == b[0], (name, a, b)
        assert abs(x - y) < 0.05, (name, x, y)
        k = 0
        while k < n and a[k] == b[k]:
            k += 1
        common += k
    assert common >= 0.75 * n * len(prompts), (name, common, out1, out2)
