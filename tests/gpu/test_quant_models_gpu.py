"""On a CUDA GPU: quantized tiny checkpoints (AWQ, GPTQ act-order, compressed-tensors, NVFP4 and
MXFP4, GGUF Q4_K_M; AWQ Qwen3-MoE experts and a GGUF qwen3moe file) through the GPU runner. fp32: greedy
tokens equal transformers on the same GPU on the independent reference
(tests/quant_checkpoints.py), logprobs within 1e-3; fp16 (the SM70 default): decode steps
replayed as CUDA graphs give the eager runner's tokens, and the first token's logprobs stay
within 5e-2 of the fp32 reference. --max-gpu-memory shrinks the KV pool to the budget.
Skipped without CUDA."""

from __future__ import annotations

import random

import pytest
import torch
from voltserve.services.executor.kv_sizing import kv_bytes_per_block
from voltserve.services.executor.model_runner import ModelRunner
from voltserve.services.executor.request import Request
from voltserve.shared.config import EngineConfig
from voltserve.shared.sampling_params import SamplingParams

from tests import fp4_checkpoints as fc
from tests import quant_checkpoints as qc
from tests.checkpoints import drive, tokenizer

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

CASES = {
    "awq-g128-llama": lambda: (qc.awq_checkpoint("llama", 128), None),
    "gptq-4b-act-qwen3": lambda: (qc.gptq_checkpoint("qwen3", 4, 64, True, True), None),
    "gptq-8b-qwen2": lambda: (qc.gptq_checkpoint("qwen2", 8, 128, True, True), None),
    "ct-w4a16-qwen2": lambda: (qc.ct_checkpoint("qwen2", 4, 32), None),
    # FP4 weights: compressed-tensors NVFP4 / MXFP4, ModelOpt NVFP4 (tests/fp4_checkpoints.py)
    "ct-nvfp4-llama": lambda: (fc.ct_fp4_checkpoint("llama", "nvfp4"), None),
    "ct-mxfp4-qwen3": lambda: (fc.ct_fp4_checkpoint("qwen3", "mxfp4"), None),
    "modelopt-nvfp4-qwen2": lambda: (fc.modelopt_checkpoint("qwen2"), None),
    "gguf-q4_k_m-llama": lambda: (qc.gguf_checkpoint("llama", qc.q4_k_m_types, "Q4_K_M"), True),
    # MoE: AWQ experts (decode on the fused int4 expert kernels) and a GGUF qwen3moe K-quant mix
    "awq-g32-qwen3moe": lambda: (qc.awq_checkpoint("qwen3_moe", 32), None),
    "gguf-kmix-qwen3moe": lambda: (
        qc.gguf_checkpoint("qwen3_moe-gguf", _qwen3_k_mix, "qwen3moe-Kmix"),
        "qwen3_moe-gguf",
    ),
}


def _qwen3_k_mix(gname: str) -> str:
    from tests.engine.test_gguf_moe import qwen3_k_mix

    return qwen3_k_mix(gname)


def _paths(case: str):
    made, gguf = CASES[case]()
    if gguf:
        kw = {"gguf_file": "model.gguf"}
        if isinstance(gguf, str):
            # an MoE file: transformers' GGUF loader reads no expert sizes, so it loads the
            # tensors into the float checkpoint's config (tests/engine/test_gguf_moe.py)
            from transformers import AutoConfig

            kw["config"] = AutoConfig.from_pretrained(qc.float_checkpoint(gguf))
        return made / "model.gguf", made, kw
    return made[0], made[1], {}


def _requests(seed: int, n: int, params: SamplingParams) -> list[Request]:
    rng = random.Random(seed)
    V = len(tokenizer())
    return [
        Request(
            f"r{i}",
            [rng.randrange(V) for _ in range(rng.randint(1, 60))],
            params,
            seed=i,
            arrival_time=0.0,
        )
        for i in range(n)
    ]


def _runner(path, dtype: str, eager: bool, **kw) -> ModelRunner:
    cfg = EngineConfig(
        model=str(path),
        dtype=dtype,
        device="cuda",
        max_model_len=256,
        max_graph_batch_size=16,
        enforce_eager=eager,
        **({"num_kv_blocks": 128} | kw),
    )
    return ModelRunner(cfg)


def _hf(ref, kw):
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(ref, dtype=torch.float32, **kw).to("cuda")
    m.generation_config.eos_token_id = None
    return m


def _hf_greedy(model, prompt: list[int], n: int):
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt], device="cuda"),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long, device="cuda"),
            max_new_tokens=n,
            do_sample=False,
            output_logits=True,
            return_dict_in_generate=True,
            pad_token_id=0,
        )
    return out.sequences[0, len(prompt) :].tolist(), torch.cat(out.logits).float().cpu()


@pytest.mark.parametrize("case", list(CASES))
def test_gpu_fp32_greedy_equals_transformers(case: str) -> None:
    path, ref, kw = _paths(case)
    runner = _runner(path, "float32", eager=False)
    params = SamplingParams(temperature=0.0, max_tokens=8, logprobs=1, ignore_eos=True)
    reqs = _requests(3, 4, params)
    drive(runner, reqs, 8, chunk=32)
    model = _hf(ref, kw)
    for r in reqs:
        want, logits = _hf_greedy(model, r.prompt_token_ids, 8)
        assert r.output_token_ids == want
        lp = torch.log_softmax(logits, -1)
        for step, tok in enumerate(r.trace):
            assert abs(tok.logprob - lp[step, tok.token_id].item()) < 1e-3


@pytest.mark.parametrize("case", list(CASES))
def test_gpu_fp16_graphs_equal_eager_and_track_fp32(case: str) -> None:
    path, ref, kw = _paths(case)
    graph = _runner(path, "float16", eager=False)
    eager = _runner(path, "float16", eager=True)
    assert graph.graphs is not None, f"no graphs captured: {graph.ops.impl}"
    params = SamplingParams(temperature=0.0, max_tokens=12, logprobs=2, ignore_eos=True)
    a, b = _requests(1, 5, params), _requests(1, 5, params)
    before = graph.graphs.num_replays
    drive(graph, a, 12, chunk=32)
    assert graph.graphs.num_replays > before
    drive(eager, b, 12, chunk=32)
    for ra, rb in zip(a, b):
        assert ra.output_token_ids == rb.output_token_ids
        for ta, tb in zip(ra.trace, rb.trace):
            assert abs(ta.logprob - tb.logprob) < 2e-2
    model = _hf(ref, kw)
    for r in a:
        _, logits = _hf_greedy(model, r.prompt_token_ids, 1)
        lp = torch.log_softmax(logits[0], -1)
        for t, v in r.trace[0].top_logprobs:
            assert abs(v - lp[t].item()) < 5e-2


def test_max_gpu_memory_caps_the_kv_pool() -> None:
    path, _, _ = _paths("awq-g128-llama")
    import gc

    full = _runner(path, "float16", eager=True, num_kv_blocks=None)
    full_blocks = full.num_kv_blocks
    del full  # its KV pool would count as this process's weights in the next sizing
    gc.collect()
    torch.cuda.empty_cache()
    total = torch.cuda.mem_get_info()[1]
    budget = 2 * 2**30
    assert budget < total
    capped = _runner(path, "float16", eager=True, num_kv_blocks=None, max_gpu_memory=budget)
    per = kv_bytes_per_block(capped)
    assert capped.num_kv_blocks < full_blocks
    # the KV pool fits in the budget's share (weights and activations of this model are small)
    assert capped.num_kv_blocks * per <= budget * capped.config.gpu_memory_utilization
    assert capped.num_kv_blocks * per > 0.5 * budget * capped.config.gpu_memory_utilization
    # The budget is this runner's own: tensors the process held before it started (another
    # engine, a reference model) do not count as its weights.
    blocks = capped.num_kv_blocks
    del capped
    gc.collect()
    torch.cuda.empty_cache()
    held = torch.empty(2**30, dtype=torch.uint8, device="cuda")
    again = _runner(path, "float16", eager=True, num_kv_blocks=None, max_gpu_memory=budget)
    assert abs(again.num_kv_blocks - blocks) <= 0.02 * blocks, (again.num_kv_blocks, blocks)
    del held
