"""Quantized hybrid linear-attention checkpoints (Qwen3.5 / 3.6 dense and MoE, Qwen3-Next, the
vision-language layout's text part) through the real engine against transformers, token for
token (fp32, CPU).

Each checkpoint is the tiny model of tests/checkpoints.py quantized by tests/quant_checkpoints.py
from the format's published packing rule, leaving float what the published quantized Qwen3.5 /
3.6 checkpoints leave float and listing it as they do (AWQ modules_to_not_convert,
compressed-tensors `ignore`, GPTQ modules_in_block_to_quantize): the narrow Gated DeltaNet
in_proj_b / in_proj_a, the MoE router and shared-expert gate, lm_head, the vision tower, the MTP
head. The reference is transformers on the float checkpoint of the dequantized weights
(independent of the loader)."""

from __future__ import annotations

import json

import pytest
import torch
from voltserve.services.executor.engine import LLMEngine
from voltserve.services.executor.loader import ModelLoadError, load_model
from voltserve.services.executor.quant.base import UnquantizedMethod
from voltserve.services.executor.quant.experts import GroupQuantExperts
from voltserve.services.executor.quant.group import GroupQuantMethod
from voltserve.shared.config import EngineConfig
from voltserve.shared.sampling_params import SamplingParams

from tests import quant_checkpoints as qc
from tests.checkpoints import checkpoint, hf_model_class, tokenizer
from tests.greedy_reference import check_greedy_outputs

MAX_NEW = 5
PARAMS = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
# Group 16 divides every input width of the tiny models (hidden 64, expert 32, shared 48).
GROUP = 16
# As the published AWQ Qwen3.5 / 3.6 checkpoints list them.
AWQ_NOT_CONVERT = [
    "lm_head",
    "visual",
    "mtp",
    "mlp.gate",
    "mlp.shared_expert_gate",
    "linear_attn.in_proj_b",
    "linear_attn.in_proj_a",
]
# As llm-compressor recipes for them write it (regexes, and full module names).
CT_IGNORE = [
    "re:.*visual.*",
    "re:.*mlp.gate$",
    "re:.*shared_expert_gate$",
    "re:.*linear_attn.in_proj_b$",
] + [f"model.language_model.layers.{i}.linear_attn.in_proj_a" for i in range(4)]

CPU = torch.device("cpu")


def _awq(arch: str):
    return qc.awq_checkpoint(arch, GROUP, src=checkpoint(arch), not_convert=AWQ_NOT_CONVERT)


CASES = {
    "awq-qwen3_5": lambda: _awq("qwen3_5"),
    "awq-qwen3_5_moe": lambda: _awq("qwen3_5_moe"),
    "awq-qwen3_next": lambda: _awq("qwen3_next"),
    "ct-qwen3_5_vl": lambda: qc.ct_checkpoint(
        "qwen3_5_vl", 4, GROUP, src=checkpoint("qwen3_5_vl"), ignore=CT_IGNORE
    ),
    # the shared experts float beside the quantized routed experts, as some published
    # checkpoints keep them
    "ct-qwen3_5_moe-shared-float": lambda: qc.ct_checkpoint(
        "qwen3_5_moe",
        4,
        GROUP,
        src=checkpoint("qwen3_5_moe"),
        ignore=[*CT_IGNORE, "re:.*in_proj_a$", r"re:.*shared_expert\."],
    ),
    # the linear attention all float, as some published GPTQ checkpoints keep it
    "gptq-qwen3_5": lambda: qc.gptq_checkpoint(
        "qwen3_5",
        4,
        GROUP,
        desc_act=False,
        sym=True,
        src=checkpoint("qwen3_5"),
        in_block=[
            ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"],
            ["self_attn.o_proj"],
            ["mlp.gate_proj", "mlp.up_proj"],
            ["mlp.down_proj"],
        ],
    ),
}


def _prompts(rng, n: int, lo: int, hi: int) -> list[list[int]]:
    V = len(tokenizer())
    return [[rng.randrange(V) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


@pytest.mark.parametrize("case", CASES)
def test_greedy_matches_transformers(case: str, rng) -> None:
    path, ref = CASES[case]()
    hf = hf_model_class(ref).from_pretrained(ref, dtype=torch.float32).eval()
    prompts = _prompts(rng, 4, 1, 24)
    # chunked prefill: later chunks start from the state the earlier left
    engine = LLMEngine(EngineConfig(model=str(path), num_kv_blocks=16, max_num_batched_tokens=16))
    check_greedy_outputs(hf, prompts, engine.generate(prompts, PARAMS), MAX_NEW)
    assert engine.check_all_free()

    model = engine.runner.model
    linear = model.model.layers[0].linear_attn
    full = next(la.self_attn for la in model.model.layers if hasattr(la, "self_attn"))
    assert isinstance(full.qkv_proj.method, GroupQuantMethod)
    if case.startswith("gptq"):
        # every Gated DeltaNet projection float: one merged product as in fp16
        assert isinstance(linear.in_proj.method, UnquantizedMethod)
        assert isinstance(linear.out_proj.method, UnquantizedMethod)
    elif "next" in case:
        assert isinstance(linear.in_proj_qkvz.method, GroupQuantMethod)
        assert isinstance(linear.in_proj_ba.method, GroupQuantMethod)
    else:
        # q/k/v + z quantized, the float b + a beside them
        assert linear.in_proj is None
        assert isinstance(linear.in_proj_qkvz.method, GroupQuantMethod)
        assert isinstance(linear.in_proj_ba.method, UnquantizedMethod)
        assert isinstance(linear.out_proj.method, GroupQuantMethod)
    assert model.lm_head is None or isinstance(model.lm_head.method, UnquantizedMethod)
    mlp = model.model.layers[0].mlp
    if hasattr(mlp, "experts"):
        assert isinstance(mlp.experts.method, GroupQuantExperts)
        shared = UnquantizedMethod if "shared-float" in case else GroupQuantMethod
        assert isinstance(mlp.shared_expert.down_proj.method, shared)
        assert isinstance(mlp.shared_expert.gate_up_proj.method, shared)
        assert isinstance(mlp.gate.method, UnquantizedMethod)


def test_unservable_group_size_is_refused_by_name(tmp_path) -> None:
    """A group size the kernels cannot hold (48 does not divide the 64 input columns) is
    refused at start-up, naming the module."""
    import shutil

    path, _ = _awq("qwen3_5")
    d = tmp_path / "g48"
    shutil.copytree(path, d)
    cfg = json.loads((d / "config.json").read_text())
    cfg["quantization_config"]["group_size"] = 48
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(
        ModelLoadError, match=r"model\.layers\.0\.linear_attn\.in_proj_qkv.*group size 48"
    ):
        load_model(d, torch.float32, CPU)


def test_partly_listed_merged_projection_is_refused(tmp_path) -> None:
    """A list that leaves in_proj_z float but quantizes in_proj_qkv (one merged product) is
    refused by name, not loaded wrong."""
    import shutil

    path, _ = _awq("qwen3_5")
    d = tmp_path / "z-float"
    shutil.copytree(path, d)
    cfg = json.loads((d / "config.json").read_text())
    cfg["quantization_config"]["modules_to_not_convert"].append("linear_attn.in_proj_z")
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match=r"in_proj_qkv, .*in_proj_z.*modules_to_not_convert"):
        load_model(d, torch.float32, CPU)
