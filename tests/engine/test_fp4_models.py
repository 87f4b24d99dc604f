"""FP4 checkpoints through the model runner against transformers (fp32, CPU), as
test_quant_models.py does for the integer formats: compressed-tensors NVFP4 and MXFP4 written
with the library's own compressor, ModelOpt NVFP4 from its published layout (tests/
fp4_checkpoints.py); the references are transformers on the dense weights compressed-tensors'
own dequantization gives. Greedy tokens equal, logprobs of the chosen tokens within
LOGPROB_ATOL."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file
from voltserve.kernels.linear.fp4_pack import E4M3, E8M0, Fp4Weight
from voltserve.services.executor.engine import LLMEngine
from voltserve.services.executor.engine_args import EngineConfig
from voltserve.services.executor.models.moe import FusedExperts
from voltserve.services.executor.quant.fp4 import Fp4Method
from voltserve.services.executor.quant.fp4_experts import Fp4Experts
from voltserve.shared.sampling_params import SamplingParams

from tests import fp4_checkpoints as fc
from tests.checkpoints import checkpoint, hf_model_class, tokenizer
from tests.engine.test_quant_models import _seed, check_against_reference
from tests.greedy_reference import check_greedy_outputs

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


# MoE: every attention and expert projection FP4 (the routers stay float): Qwen3-MoE in each
# format and Mixtral's w1 / w3 / w2 experts.
MOE_CASES = {
    "ct-nvfp4-qwen3_moe": lambda: fc.ct_fp4_checkpoint("qwen3_moe", "nvfp4"),
    "ct-mxfp4-qwen3_moe": lambda: fc.ct_fp4_checkpoint("qwen3_moe", "mxfp4"),
    "modelopt-nvfp4-qwen3_moe": lambda: fc.modelopt_checkpoint("qwen3_moe"),
    "ct-mxfp4-mixtral": lambda: fc.ct_fp4_checkpoint("mixtral", "mxfp4", src=checkpoint("mixtral")),
}


def _check_stacked_experts(model, ref) -> None:
    """Every layer's experts kept packed (quant/fp4_experts.py: FP4 codes, scale bytes and a
    global scale per row; no float copy), each expert's dequantized stacked rows equal to the
    reference folder's weights (gate rows, then up; down), so no expert or part is swapped."""
    want = load_file(ref / "model.safetensors")
    layers = [m for m in model.modules() if isinstance(m, FusedExperts)]
    assert layers
    for fe in layers:
        assert isinstance(fe.method, Fp4Experts)
        E, H, inter = fe.num_experts, fe.hidden, fe.inter
        assert not list(fe.parameters())
        assert fe.w13_packed.shape == (E, 2 * inter, H // 2) and fe.w2_packed.dtype == torch.uint8
        g = fe.method.layout.group
        weights = E * 3 * H * inter  # codes: two a byte; scales: one byte a block of g
        assert fe.nbytes() == weights // 2 + weights // g + E * (2 * inter + H) * 4
        w13, w2 = fe.method.dense(fe, "w13"), fe.method.dense(fe, "w2")
        leaf = {pp: leaf for leaf, pp in fe.names.items()}
        for e in range(fe.num_experts):
            p = f"{fe.method.prefix}.{e}"
            gate, up = (want[f"{p}.{leaf['w13', i]}.weight"] for i in (0, 1))
            # compressed-tensors divides by its global scale, the loader multiplies by its fp32
            # reciprocal: within a rounding or two
            torch.testing.assert_close(w13[e], torch.cat([gate, up]), rtol=1e-6, atol=0)
            down = want[f"{p}.{leaf['w2', None]}.weight"]
            torch.testing.assert_close(w2[e], down, rtol=1e-6, atol=0)


@pytest.mark.parametrize("case", list(MOE_CASES))
def test_fp4_moe_experts_match_transformers(case: str) -> None:
    """Greedy tokens and logprobs against transformers on the dense folder."""
    path, ref = MOE_CASES[case]()
    runner = check_against_reference(path, ref, gguf=False, seed=_seed())
    _check_stacked_experts(runner.model, ref)


def test_fp4_hybrid_moe_matches_transformers(rng) -> None:
    """Qwen3.5-MoE: NVFP4 experts and shared expert beside the Gated DeltaNet layers (the b / a
    projections, the router and the shared expert's gate float, as llm-compressor recipes keep
    them; NVFP4: the shared expert's 48 inputs are no whole MXFP4 block). Greedy tokens equal
    to transformers', chunked prefill."""
    ignore = ["re:.*mlp.gate$", "re:.*shared_expert_gate$", "re:.*in_proj_[ab]$"]
    path, ref = fc.ct_fp4_checkpoint(
        "qwen3_5_moe", "nvfp4", src=checkpoint("qwen3_5_moe"), ignore=ignore
    )
    hf = hf_model_class(ref).from_pretrained(ref, dtype=torch.float32).eval()
    V = len(tokenizer())
    prompts = [[rng.randrange(V) for _ in range(rng.randint(1, 24))] for _ in range(3)]
    engine = LLMEngine(EngineConfig(model=str(path), num_kv_blocks=16, max_num_batched_tokens=16))
    params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    check_greedy_outputs(hf, prompts, engine.generate(prompts, params), 5)
    mlp = engine.runner.model.model.layers[0].mlp
    assert isinstance(mlp.shared_expert.gate_up_proj.method, Fp4Method)
    _check_stacked_experts(engine.runner.model, ref)


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_fp4_experts_cpu_path_is_the_float_experts_reference(rng, fmt: str) -> None:
    """On CPU the packed experts give exactly what the float experts did (moe_experts_ref on
    every expert dequantized, which dequantizing at load ran), bit for bit, with experts that
    receive no token and one that receives every token."""
    from voltserve.kernels.moe.experts import moe_experts_ref
    from voltserve.services.executor.loader import load_model

    path, _ = fc.ct_fp4_checkpoint("qwen3_moe", fmt)
    model = load_model(path, torch.float32, torch.device("cpu")).model
    fe = next(m for m in model.modules() if isinstance(m, FusedExperts))
    T, k, E = 5, 2, fe.num_experts
    gen = torch.Generator().manual_seed(rng.randrange(1 << 30))
    x = torch.randn(T, fe.hidden, generator=gen)
    # expert 0 in every token's set, the others drawn from 1 .. E - 2 (expert E - 1: none)
    others = torch.stack([torch.randperm(E - 2, generator=gen)[: k - 1] + 1 for _ in range(T)])
    ids = torch.cat([torch.zeros(T, 1, dtype=torch.int64), others], 1).to(torch.int32)
    wts = torch.rand(T, k, generator=gen)
    got = fe(None, x, wts, ids)
    d13, d2 = fe.method.dense(fe, "w13"), fe.method.dense(fe, "w2")
    assert d13.dtype == torch.float32 and d13.shape == (E, 2 * fe.inter, fe.hidden)
    assert torch.equal(got, moe_experts_ref(x, d13, d2, wts, ids))
