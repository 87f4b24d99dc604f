"""The model side against transformers: for each architecture, our paged forward + greedy
sampling produce the same tokens as transformers (fp32, CPU) through chunked prefill, mixed
prefill/decode steps and decode-only steps; logprobs agree within 1e-4 (absolute). Random
prompts are checked teacher-forced (tests/greedy_reference.py: a tie may go either way), the
fixed ones against `generate`."""

from __future__ import annotations

import json
import random

import pytest
import torch
from safetensors.torch import load_file, save_file
from voltserve.services.executor.kv_sizing import kv_bytes_per_block
from voltserve.services.executor.loader import (
    ModelLoadError,
    load_model,
    read_eos_token_ids,
    resolve_dtype,
)
from voltserve.services.executor.model_runner import ModelRunner
from voltserve.services.executor.request import Request, ScheduledRequest, StepPlan
from voltserve.shared.config import EngineConfig
from voltserve.shared.sampling_params import SamplingParams

from tests.checkpoints import ARCHS, checkpoint, copy_checkpoint, drive, hf_greedy, tokenizer
from tests.greedy_reference import check_greedy, reference_model

LOGPROB_ATOL = 1e-4
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def runners() -> dict[str, ModelRunner]:
    return {a: ModelRunner(EngineConfig(model=str(checkpoint(a)), num_kv_blocks=64)) for a in ARCHS}


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_and_logprobs_match_transformers(arch: str, runners, rng) -> None:
    runner = runners[arch]
    assert runner.device.type == "cpu" and runner.model.lm_head_weight().dtype == torch.float32
    V = len(tokenizer())
    lengths = [rng.randint(1, 6), rng.randint(17, 40), rng.randint(41, 70)]
    prompts = [[rng.randrange(V) for _ in range(n)] for n in lengths]
    max_new = 10
    params = SamplingParams(temperature=0.0, max_tokens=max_new, logprobs=3, ignore_eos=True)
    reqs = [Request(f"r{i}", p, params, seed=i, arrival_time=0.0) for i, p in enumerate(prompts)]
    drive(runner, reqs, max_new, chunk=rng.choice([7, 16, 29]))
    model = reference_model(str(checkpoint(arch)))
    for r, prompt in zip(reqs, prompts):
        served = [tok.token_id for tok in r.trace]
        assert r.output_token_ids == served and len(served) == max_new, arch
        lps = [tok.logprob for tok in r.trace]
        lp = check_greedy(model, prompt, served, lps, LOGPROB_ATOL)
        for step, tok in enumerate(r.trace):
            got_i = [t for t, _ in tok.top_logprobs]
            got_v = torch.tensor([v for _, v in tok.top_logprobs])
            assert torch.allclose(got_v, lp[step].topk(3).values, atol=LOGPROB_ATOL, rtol=0)
            assert got_i[0] == tok.token_id


def test_prefix_reuse_reads_cached_kv(runners) -> None:
    """A second request that starts with the first's computed blocks (as a prefix cache hit
    hands them over) continues exactly like a full recompute."""
    runner = runners["qwen3"]
    rng = random.Random(7)
    V = len(tokenizer())
    shared = [rng.randrange(V) for _ in range(32)]
    tail = [rng.randrange(V) for _ in range(9)]
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    a = Request("a", shared + tail, params, seed=0, arrival_time=0.0)
    drive(runner, [a], 4, chunk=64)
    b = Request("b", shared + tail[:5], params, seed=0, arrival_time=0.0)
    b.block_ids = a.block_ids[:2] + list(range(40, 44))  # two full shared blocks, then fresh
    b.num_computed_tokens = 32
    for _ in range(4):
        n = b.num_tokens - b.num_computed_tokens
        (tok,) = runner.execute(StepPlan([ScheduledRequest(b, n)], n)).sampled
        b.num_computed_tokens += n
        b.output_token_ids.append(tok.token_id)
    want, _ = hf_greedy(checkpoint("qwen3"), shared + tail[:5], 4)
    assert b.output_token_ids == want


def test_engine_end_to_end_matches_transformers() -> None:
    """Through the real engine (batcher, block manager, prefix caching) with our runner."""
    from voltserve.services.executor.engine import LLMEngine

    path = checkpoint("llama")
    engine = LLMEngine(EngineConfig(model=str(path), num_kv_blocks=48, max_num_batched_tokens=48))
    rng = random.Random(3)
    V = len(tokenizer())
    base = [rng.randrange(V) for _ in range(40)]
    prompts = [base + [rng.randrange(V) for _ in range(k)] for k in (3, 11, 20)]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    outs = engine.generate(prompts, params)
    for prompt, got in zip(prompts, outs):
        assert got == hf_greedy(path, prompt, 6)[0]
    assert engine.check_all_free()


def test_prefill_only_step_samples_nothing(runners) -> None:
    runner = runners["mistral"]
    r = Request("p", list(range(1, 30)), SamplingParams(), seed=1, arrival_time=0.0)
    r.block_ids = [0, 1]
    assert list(runner.execute(StepPlan([ScheduledRequest(r, 20)], 20)).sampled) == []


def test_runner_exposes_engine_interface(runners) -> None:
    r = runners["mistral"]
    assert r.block_size == 16 and r.num_kv_blocks == 64
    assert r.max_model_len == 256  # capped at mistral's sliding window (512 positions)
    assert r.vocab_size >= len(tokenizer())
    tok = tokenizer()
    assert r.eos_token_ids == [
        tok.convert_tokens_to_ids("<|im_end|>"),
        tok.convert_tokens_to_ids("<|endoftext|>"),
    ]


def test_cpu_kv_cache_sized_from_bytes() -> None:
    path = checkpoint("qwen2")
    r = ModelRunner(EngineConfig(model=str(path), cpu_kv_cache_bytes=1 << 20))
    # 2 layers * K,V * 2 kv heads * 16 tokens * 16 dims * 4 bytes = 8 KiB per block
    assert kv_bytes_per_block(r) == 8192 and r.num_kv_blocks == 128
    assert r.kv_caches[0][0].shape == (128, 2, 16, 16)


def test_max_model_len_above_positions_is_refused() -> None:
    with pytest.raises(ValueError, match="max_position_embeddings"):
        ModelRunner(EngineConfig(model=str(checkpoint("qwen2")), max_model_len=10_000))


# ---- loader ----------------------------------------------------------------------------------


def test_sharded_checkpoint_loads_like_single_file() -> None:
    one = load_model(checkpoint("qwen3"), torch.float32, CPU).model
    sharded = checkpoint("qwen3", shard_size="40KB")
    assert (sharded / "model.safetensors.index.json").is_file()
    two = load_model(sharded, torch.float32, CPU).model
    for (n1, p1), (n2, p2) in zip(one.state_dict().items(), two.state_dict().items()):
        assert n1 == n2 and torch.equal(p1, p2)


def test_loader_errors_name_what_is_missing(tmp_path) -> None:
    with pytest.raises(ModelLoadError, match="does not exist"):
        load_model(tmp_path / "nope", torch.float32, CPU)
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ModelLoadError, match="no config.json"):
        load_model(empty, torch.float32, CPU)

    d = copy_checkpoint("llama", tmp_path / "arch")
    cfg = json.loads((d / "config.json").read_text())
    cfg["architectures"] = ["GPT2LMHeadModel"]
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match="unsupported architecture.*GPT2LMHeadModel"):
        load_model(d, torch.float32, CPU)

    d = copy_checkpoint("llama", tmp_path / "noweights")
    (d / "model.safetensors").unlink()
    with pytest.raises(ModelLoadError, match="no \\*.safetensors"):
        load_model(d, torch.float32, CPU)

    d = copy_checkpoint("llama", tmp_path / "missing")
    tensors = load_file(d / "model.safetensors")
    del tensors["model.layers.1.self_attn.k_proj.weight"]
    save_file(tensors, d / "model.safetensors")
    with pytest.raises(ModelLoadError, match="model.layers.1.self_attn.k_proj.weight"):
        load_model(d, torch.float32, CPU)

    d = copy_checkpoint("llama", tmp_path / "shape")
    cfg = json.loads((d / "config.json").read_text())
    cfg["intermediate_size"] = 96
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match="mlp.*shape mismatch"):
        load_model(d, torch.float32, CPU)

    d = copy_checkpoint("llama", tmp_path / "cfgkey")
    cfg = json.loads((d / "config.json").read_text())
    del cfg["hidden_size"]
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match="hidden_size"):
        load_model(d, torch.float32, CPU)

    d = copy_checkpoint("qwen2", tmp_path / "shard")
    (d / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"lm_head.weight": "model-00002-of-00002.safetensors"}})
    )
    with pytest.raises(ModelLoadError, match="model-00002-of-00002"):
        load_model(d, torch.float32, CPU)


def test_dtype_policy_and_eos(tmp_path) -> None:
    assert resolve_dtype("auto", CPU) == torch.float32
    assert resolve_dtype("bfloat16", CPU) == torch.bfloat16
    assert resolve_dtype("float16", CPU) == torch.float16
    with pytest.raises(ValueError, match="unknown dtype"):
        resolve_dtype("int3", CPU)
    # bf16 weights on load: converted to the run dtype
    m = load_model(checkpoint("qwen2"), torch.bfloat16, CPU).model
    assert m.lm_head_weight().dtype == torch.bfloat16
    d = copy_checkpoint("qwen2", tmp_path / "eos")
    (d / "generation_config.json").unlink()
    cfg = json.loads((d / "config.json").read_text())
    cfg["eos_token_id"] = 5
    (d / "config.json").write_text(json.dumps(cfg))
    assert read_eos_token_ids(d) == [5]


def test_demo_model_command(tmp_path) -> None:
    from transformers import AutoTokenizer
    from voltserve.services.executor.demo_model import main

    out = tmp_path / "demo"
    main([str(out), "--arch", "llama", "--size", "tiny"])
    tok = AutoTokenizer.from_pretrained(out)
    assert 1000 <= len(tok) <= 4096
    text = "Hello world, the quick brown fox!"
    assert tok.decode(tok(text)["input_ids"]) == text
    chat = tok.apply_chat_template(
        [{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False
    )
    assert chat == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    loaded = load_model(out, torch.float32, CPU)
    assert loaded.arch.architecture == "LlamaForCausalLM"
    assert tok.convert_tokens_to_ids("<|im_end|>") in loaded.eos_token_ids
