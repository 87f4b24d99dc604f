"""FP4 checkpoints through the model runner against transformers (fp32, CPU), as
test_quant_models.py does for the integer formats: compressed-tensors NVFP4 and MXFP4 written
with the library's own compressor, ModelOpt NVFP4 from its published layout (tests/
fp4_checkpoints.py); the references are transformers on the dense weights compressed-tensors'
own dequantization gives. Greedy tokens equal, logprobs of the chosen tokens within
LOGPROB_ATOL."""

from __future__ import annotations

import pytest
import torch
from voltserve.kernels.linear.fp4_pack import E4M3, E8M0, Fp4Weight

from tests import fp4_checkpoints as fc
from tests.engine.test_quant_models import _seed, check_against_reference

CASES = {
    "ct-nvfp4": (lambda a: fc.ct_fp4_checkpoint(a, "nvfp4"), "llama", E4M3, 16),
    "ct-mxfp4": (lambda a: fc.ct_fp4_checkpoint(a, "mxfp4"), "qwen3", E8M0, 32),
    "modelopt-nvfp4": (fc.modelopt_checkpoint, "qwen2", E4M3, 16),
}


@pytest.mark.parametrize("fmt", list(CASES))
def test_fp4_formats_match_transformers(fmt: str) -> None:
    write, arch, kind, group = CASES[fmt]
    path, ref = write(arch)
    runner = check_against_reference(path, ref, gguf=False, seed=_seed())
    # every decoder linear runs from its FP4 codes; the lm_head stays float
    layer = runner.model.model.layers[0]
    for lin in (layer.self_attn.qkv_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj):
        w = lin.fp4
        assert isinstance(w, Fp4Weight) and lin.method.dense_weight(lin) is None
        assert (w.scale_kind, w.group_size) == (kind, group)
        assert w.packed.shape == (lin.out_features, lin.in_features // 2)
    assert runner.model.lm_head_weight() is not None


# MoE: every attention and expert projection FP4 (the routers stay float), Qwen3-MoE's experts
MOE_CASES = {
    "ct-nvfp4": (lambda: fc.ct_fp4_checkpoint("qwen3_moe", "nvfp4"), "w13"),
    "ct-mxfp4": (lambda: fc.ct_fp4_checkpoint("qwen3_moe", "mxfp4"), "w2"),
    "modelopt-nvfp4": (lambda: fc.modelopt_checkpoint("qwen3_moe"), "w13"),
}


@pytest.mark.parametrize("fmt", list(MOE_CASES))
def test_fp4_moe_experts_match_transformers(fmt: str) -> None:
    """The experts are dequantized at load (quant/fp4_experts.py) into the float experts'
    stacked layout; greedy tokens and logprobs against transformers on the dense folder, and
    one expert's stacked rows equal to the reference folder's weights (gate rows, then up)."""
    from safetensors.torch import load_file
    from voltserve.services.executor.quant.fp4_experts import Fp4Experts

    write, param = MOE_CASES[fmt]
    path, ref = write()
    runner = check_against_reference(path, ref, gguf=False, seed=_seed())
    moe = runner.model.model.layers[1].mlp
    assert isinstance(moe.experts.method, Fp4Experts)
    assert type(moe.gate.method).__name__ == "UnquantizedMethod"
    want = load_file(ref / "model.safetensors")
    p = "model.layers.1.mlp.experts.5"
    if param == "w13":
        dense = torch.cat([want[f"{p}.gate_proj.weight"], want[f"{p}.up_proj.weight"]])
    else:
        dense = want[f"{p}.down_proj.weight"]
    torch.testing.assert_close(getattr(moe.experts, param)[5], dense, rtol=1e-6, atol=0)
