"""Group-quantized MoE experts (services/executor/quant/experts.py) against transformers (fp32,
CPU): a tiny Qwen3-MoE checkpoint whose attention and expert linears are AWQ GEMM int4, GPTQ
int4 with act-order or compressed-tensors W4A16 (tests/quant_checkpoints.py, from each format's
packing rule; the routers stay float), and as the reference transformers on the float
checkpoint of the weights dequantized independently of the loader (AWQ, GPTQ: that file's
references; compressed-tensors: the library's decompressor). Greedy tokens equal; logprobs of the chosen tokens within
LOGPROB_ATOL."""

from __future__ import annotations

import pytest
import torch
from voltserve.kernels.linear.quant_pack import dequantize
from voltserve.services.executor.loader import load_model
from voltserve.services.executor.quant.experts import GroupQuantExperts

from tests import quant_checkpoints as qc
from tests.engine.test_quant_models import _seed, check_against_reference

CPU = torch.device("cpu")


# format id -> (writer, bits, group)
FORMATS = {
    "awq-g32": (lambda: qc.awq_checkpoint("qwen3_moe", 32), 4, 32),
    "awq-g64": (lambda: qc.awq_checkpoint("qwen3_moe", 64), 4, 64),
    # act-order: an input permutation per expert projection
    "gptq-4b-act-sym": (
        lambda: qc.gptq_checkpoint("qwen3_moe", 4, 32, desc_act=True, sym=True),
        4,
        32,
    ),
    "ct-w4a16-g32": (lambda: qc.ct_checkpoint("qwen3_moe", 4, 32), 4, 32),
}


@pytest.mark.parametrize("fmt", FORMATS)
def test_quantized_experts_match_transformers(fmt: str) -> None:
    seed = _seed()
    writer, bits, group = FORMATS[fmt]
    path, ref = writer()
    runner = check_against_reference(path, ref, False, seed)
    moe = runner.model.model.layers[0].mlp
    assert isinstance(moe.experts.method, GroupQuantExperts)
    assert tuple(moe.experts.w13_qweight.shape) == (8, 128, 256 * bits // 32)
    assert tuple(moe.experts.w2_scales.shape) == (8, 256, 64 // group)
    assert type(moe.gate.method).__name__ == "UnquantizedMethod"  # the router stays float


def test_awq_experts_dequantize_to_the_reference_weights() -> None:
    """Every expert's stacked packed weight dequantizes to the reference checkpoint's float
    weight (gate rows, then up rows; down), so no expert or part is swapped."""
    from safetensors.torch import load_file

    path, ref = qc.awq_checkpoint("qwen3_moe", 32)
    model = load_model(path, torch.float32, CPU).model
    want = load_file(ref / "model.safetensors")
    for i, layer in enumerate(model.model.layers):
        fe = layer.mlp.experts
        for e in range(fe.num_experts):
            p = f"model.layers.{i}.mlp.experts.{e}"
            w13 = dequantize(fe.quant_weights["w13"][e])
            gate_up = torch.cat([want[f"{p}.gate_proj.weight"], want[f"{p}.up_proj.weight"]])
            assert torch.equal(w13, gate_up), p
            assert torch.equal(dequantize(fe.quant_weights["w2"][e]), want[f"{p}.down_proj.weight"])


@pytest.mark.parametrize("fmt", ["awq-g32", "gptq-4b-act-sym"])
def test_all_experts_dequantize_as_each_one_does(fmt: str) -> None:
    """The CUDA path's one-shot dequantize of every expert (dense_all) equals the per-expert
    one that the CPU path and the reference test above use, act-order permutation included."""
    path, _ = FORMATS[fmt][0]()
    fe = load_model(path, torch.float32, CPU).model.model.layers[1].mlp.experts
    for param in ("w13", "w2"):
        each = torch.stack([fe.method.dense_expert(fe, param, e) for e in range(fe.num_experts)])
        assert torch.equal(fe.method.dense_all(fe, param), each), param


@pytest.mark.parametrize("fmt", ["awq-g32", "gptq-4b-act-sym"])
def test_pair_path_equals_the_reference(fmt: str) -> None:
    """The CUDA decode path (apply_pairs: one dequantized expert per (token, slot), batched
    matmuls) against the CPU reference path on the same routing (fp32; summation order only)."""
    from voltserve.kernels.moe.routing import moe_topk_ref

    path, _ = FORMATS[fmt][0]()
    moe = load_model(path, torch.float32, CPU).model.model.layers[0].mlp
    fe = moe.experts
    g = torch.Generator().manual_seed(3)
    x = torch.randn(2, fe.hidden, generator=g)
    w, ids = moe_topk_ref(moe.gate(x), moe.top_k, moe.renormalize)
    want = fe.method.apply(fe, None, x, w, ids)
    got = fe.method.apply_pairs(fe, x, w, ids)
    assert want.abs().max() > 0
    assert torch.allclose(got, want, atol=1e-5, rtol=1e-5), (got - want).abs().max()
