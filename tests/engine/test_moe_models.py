"""The mixture-of-experts families (Qwen3-MoE, Qwen2-MoE, Mixtral) against transformers on CPU
(fp32): tiny random checkpoints built with transformers (several experts, top-k > 1, a shared
expert for Qwen2-MoE, dense and sparse layers mixed), greedy tokens equal token for token
(teacher-forced: tests/greedy_reference.py) through chunked prefill, mixed steps, concurrent batches and preemption; logprobs agree within
LOGPROB_ATOL (absolute)."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from voltserve.services.executor.engine import LLMEngine
from voltserve.services.executor.loader import ModelLoadError, load_model
from voltserve.services.executor.model_runner import ModelRunner
from voltserve.services.executor.models.moe import FusedExperts, SparseMoE
from voltserve.services.executor.request import Request
from voltserve.shared.config import EngineConfig
from voltserve.shared.sampling_params import SamplingParams

from tests.checkpoints import MOE_ARCHS, checkpoint, copy_checkpoint, drive, tokenizer
from tests.greedy_reference import check_greedy, check_greedy_outputs, reference_model

LOGPROB_ATOL = 1e-4
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def runners() -> dict[str, ModelRunner]:
    return {
        a: ModelRunner(EngineConfig(model=str(checkpoint(a)), num_kv_blocks=64)) for a in MOE_ARCHS
    }


def test_layer_layout_follows_the_config(runners) -> None:
    kinds = {
        a: [type(layer.mlp).__name__ for layer in r.model.model.layers] for a, r in runners.items()
    }
    assert kinds["qwen3_moe"] == ["SparseMoE", "MLP", "SparseMoE"]  # mlp_only_layers=[1]
    assert kinds["qwen2_moe"] == ["MLP", "SparseMoE", "MLP", "SparseMoE"]  # decoder_sparse_step=2
    assert kinds["mixtral"] == ["SparseMoE", "SparseMoE"]
    q2 = runners["qwen2_moe"].model.model.layers[1].mlp
    assert q2.shared_expert is not None and not q2.renormalize and q2.top_k == 2
    q3 = runners["qwen3_moe"].model.model.layers[0].mlp
    assert q3.shared_expert is None and q3.renormalize and q3.top_k == 3
    mx = runners["mixtral"].model.model.layers[0].mlp
    assert mx.renormalize and mx.weights_dtype is None  # Mixtral keeps fp32 routing weights
    assert tuple(q3.experts.w13.shape) == (8, 64, 64) and tuple(q3.experts.w2.shape) == (8, 64, 32)


@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_greedy_and_logprobs_match_transformers(arch: str, runners, rng) -> None:
    runner = runners[arch]
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
        lp = check_greedy(model, prompt, served, [t.logprob for t in r.trace], LOGPROB_ATOL)
        for step, tok in enumerate(r.trace):
            got_v = torch.tensor([v for _, v in tok.top_logprobs])
            assert torch.allclose(got_v, lp[step].topk(3).values, atol=LOGPROB_ATOL, rtol=0)


@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_engine_batch_with_chunked_prefill_and_preemption(arch: str, rng) -> None:
    """Five concurrent requests through the real engine: a 24-token budget chunks every prompt
    (25-32 tokens), and 10 KV blocks of 16 cannot hold them: each prompt takes 2 blocks and
    grows to 4 (25 + 34 tokens > 48) before it can finish, and the first three are admitted at
    once (10 free blocks), so 3 x 4 > 10 forces a preemption whatever the draw (scheduling
    depends only on the lengths; a draw of 10-40 tokens once needed none)."""
    path = checkpoint(arch)
    engine = LLMEngine(
        EngineConfig(model=str(path), num_kv_blocks=10, max_num_batched_tokens=24, max_num_seqs=5)
    )
    V = len(tokenizer())
    prompts = [[rng.randrange(V) for _ in range(rng.randint(25, 32))] for _ in range(5)]
    params = SamplingParams(temperature=0.0, max_tokens=34, ignore_eos=True)
    outs = engine.generate(prompts, params)
    assert engine.stats().num_preemptions_total > 0
    check_greedy_outputs(reference_model(str(path)), prompts, outs, 34, LOGPROB_ATOL)
    assert engine.check_all_free()


def test_experts_matter(runners) -> None:
    """Zeroing one layer's experts changes the logits (the routed path is really taken)."""
    runner = runners["qwen3_moe"]
    model = runner.model
    ids = torch.tensor([3, 17, 99, 5])
    x = model.model.embed_tokens.weight[ids]
    layer = model.model.layers[0].mlp
    before = layer(model.ops, x)
    saved = layer.experts.w2.data.clone()
    layer.experts.w2.data.zero_()
    try:
        assert torch.count_nonzero(layer(model.ops, x)) == 0
    finally:
        layer.experts.w2.data.copy_(saved)
    assert torch.equal(layer(model.ops, x), before)


def test_fused_experts_load_and_errors() -> None:
    fe = FusedExperts(3, 16, 8, torch.float32, names="mixtral")
    names = fe.checkpoint_params()
    assert names["2.w1.weight"] == ("w13", (2, 0)) and names["0.w2.weight"] == ("w2", (0, None))
    up = torch.randn(8, 16)
    fe.load_weight("w13", (1, 1), up)
    assert torch.equal(fe.w13[1, 8:], up)
    with pytest.raises(ValueError, match="shape mismatch"):
        fe.load_weight("w2", (0, None), torch.randn(8, 16))
    with pytest.raises(ValueError, match="num_experts_per_tok"):
        SparseMoE(16, 3, 4, 8, True, torch.float32)


def test_moe_loader_errors_name_the_tensor_or_field(tmp_path) -> None:
    d = copy_checkpoint("mixtral", tmp_path / "missing")
    tensors = load_file(d / "model.safetensors")
    del tensors["model.layers.1.block_sparse_moe.experts.3.w3.weight"]
    save_file(tensors, d / "model.safetensors")
    with pytest.raises(ModelLoadError, match=r"layers\.1\..*experts\.3\.w3\.weight"):
        load_model(d, torch.float32, CPU)

    d = copy_checkpoint("qwen3_moe", tmp_path / "shape")
    cfg = json.loads((d / "config.json").read_text())
    cfg["moe_intermediate_size"] = 24
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match="experts.*shape mismatch"):
        load_model(d, torch.float32, CPU)

    d = copy_checkpoint("qwen2_moe", tmp_path / "cfg")
    cfg = json.loads((d / "config.json").read_text())
    del cfg["num_experts_per_tok"]
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match="num_experts_per_tok"):
        load_model(d, torch.float32, CPU)
    cfg["num_experts_per_tok"] = 2
    del cfg["shared_expert_intermediate_size"]
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match="shared_expert_intermediate_size"):
        load_model(d, torch.float32, CPU)
    cfg["shared_expert_intermediate_size"] = 48
    cfg["num_experts_per_tok"] = 7  # more than the 6 experts
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match="num_experts_per_tok 7 must be in 1..num_experts 6"):
        load_model(d, torch.float32, CPU)


def test_moe_linears_carry_checkpoint_names_and_the_experts_method_follows_the_config() -> None:
    """The router, shared expert and its gate are Linears named as in the checkpoint (so a
    quantization config picks their methods; Mixtral's block is block_sparse_moe); the experts
    get the group-quantized experts method when the config quantizes all of them."""
    from voltserve.services.executor.loader import parse_arch, read_hf_config
    from voltserve.services.executor.quant.awq import AWQConfig
    from voltserve.services.executor.quant.base import QuantFormatError
    from voltserve.services.executor.quant.experts import GroupQuantExperts
    from voltserve.services.executor.quant.group import GroupQuantMethod

    mx = load_model(checkpoint("mixtral"), torch.float32, CPU).model.model.layers[1].mlp
    assert mx.gate.prefixes == ["model.layers.1.block_sparse_moe.gate"]
    q2 = load_model(checkpoint("qwen2_moe"), torch.float32, CPU).model.model.layers[1].mlp
    assert q2.shared_expert.gate_up_proj.prefixes == [
        "model.layers.1.mlp.shared_expert.gate_proj",
        "model.layers.1.mlp.shared_expert.up_proj",
    ]
    assert q2.shared_expert_gate.prefixes == ["model.layers.1.mlp.shared_expert_gate"]
    arch = parse_arch(read_hf_config(checkpoint("qwen2_moe")))
    awq = AWQConfig({"quant_method": "awq", "bits": 4, "group_size": 32, "version": "gemm"})
    moe = SparseMoE.from_arch(arch, torch.float32, awq, "model.layers.1.mlp")
    assert isinstance(moe.experts.method, GroupQuantExperts)
    assert isinstance(moe.shared_expert.down_proj.method, GroupQuantMethod)
    # one expert left float while the others are quantized: refused, naming it (stacked)
    awq.skip = ["experts.4"]
    with pytest.raises(QuantFormatError, match=r"model\.layers\.1\.mlp\.experts\.4\.gate_proj"):
        SparseMoE.from_arch(arch, torch.float32, awq, "model.layers.1.mlp")
    # every expert left float (modules_to_not_convert): float experts, quantized shared expert
    awq.skip = ["experts", "gate"]
    moe = SparseMoE.from_arch(arch, torch.float32, awq, "model.layers.1.mlp")
    assert type(moe.experts.method).__name__ == "UnquantizedExperts"


def test_start_up_log_states_expert_memory(caplog) -> None:
    with caplog.at_level("INFO", logger="voltserve.services.executor.loader"):
        load_model(checkpoint("qwen2_moe"), torch.float32, CPU)
    line = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("experts:"))
    # 2 MoE layers x 6 experts x 3 x 64 x 32 fp32 = 0.28 MiB
    assert "2 MoE layers of 6 experts" in line and "0.3 MiB" in line, line


def test_routing_ties_follow_torch_topk() -> None:
    """Equal router logits: the chosen experts are torch.topk's, as in transformers."""
    from voltserve.kernels.moe.routing import moe_topk_ref

    logits = torch.zeros(2, 8)
    logits[1, 5] = 1.0
    w, ids = moe_topk_ref(logits, 3, renormalize=True)
    want = torch.topk(torch.softmax(logits, -1), 3, -1).indices
    assert torch.equal(ids, want.int())
    assert torch.allclose(w[0], torch.full((3,), 1 / 3))


def test_moe_expert_width_not_divisible_refused_under_tensor_parallelism(tmp_path) -> None:
    """Each expert's intermediate dim is split across the ranks (tests/engine/
    test_tp_quant_moe.py runs the families at -tp 2): a width the size does not divide is
    refused by name before any rank starts."""
    from voltserve.services.executor.tp.sharding import TPSplitError

    d = copy_checkpoint("qwen3_moe", tmp_path / "m")
    cfg = json.loads((d / "config.json").read_text())
    cfg["moe_intermediate_size"] = 31
    (d / "config.json").write_text(json.dumps(cfg))
    ec = EngineConfig(model=str(d), device="cpu", dtype="float32", tensor_parallel_size=2)
    with pytest.raises(TPSplitError, match="moe_intermediate_size = 31 cannot be split evenly"):
        LLMEngine(ec)
