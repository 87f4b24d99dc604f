"""GGUF files of the hybrid linear-attention models (llama.cpp's qwen3next, qwen35, qwen35moe)
through the model runner against transformers on the Hugging Face folder they were written
from (fp32, CPU). transformers cannot load these GGUF files, so tests/hybrid_gguf_checkpoints.py
writes them as llama.cpp's converter does (attn_qkv / attn_gate split from Qwen3-Next's fused
projection, ssm_ba, ssm_a = -exp(A_log), 1 + weight norms, Qwen3.5's value heads tiled).

F32: against the source folder itself, so every layout change must be undone exactly.
Quantized: against the folder holding the file's dequantized values (gguf's own dequantizer),
as the other GGUF tests do. Two prompts run batched through the engine with chunked prefill (an
8-token budget: later chunks start from the state the earlier left); every greedy token is the
reference's, teacher-forced (tests/greedy_reference.py).
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from voltserve.services.executor.engine import LLMEngine
from voltserve.services.executor.loader import ModelLoadError, load_model
from voltserve.shared.config import EngineConfig
from voltserve.shared.sampling_params import SamplingParams

from tests import quant_checkpoints as qc
from tests.checkpoints import hf_model_class, tokenizer
from tests.greedy_reference import check_greedy_outputs
from tests.hybrid_gguf_checkpoints import float_source, hybrid_gguf

CPU = torch.device("cpu")
MAX_NEW = 5
PARAMS = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)


def check_against_reference(path, ref, rng) -> LLMEngine:
    V = len(tokenizer())
    prompts = [
        [rng.randrange(V) for _ in range(n)] for n in (rng.randint(3, 9), rng.randint(20, 40))
    ]
    model = hf_model_class(ref).from_pretrained(ref, dtype=torch.float32).eval()
    engine = LLMEngine(
        EngineConfig(model=str(path), num_kv_blocks=32, max_num_batched_tokens=8, max_num_seqs=8)
    )
    check_greedy_outputs(model, prompts, engine.generate(prompts, PARAMS), MAX_NEW)
    assert engine.check_all_free()
    return engine


def next_mix(gname: str) -> str:
    """Qwen3-Next: Q8_0 linears (ssm_ba too: one ggml type split into in_proj_b / in_proj_a),
    F32 routers as llama.cpp keeps them, the shared expert's down projection (K 48) F16."""
    if gname.endswith(("ffn_gate_inp.weight", "ffn_gate_inp_shexp.weight")):
        return "F32"
    if gname.endswith("ffn_down_shexp.weight"):
        return "F16"
    return "Q8_0"


def qwen35_moe_mix(gname: str) -> str:
    """Qwen3.5-MoE: attn_qkv Q8_0 beside a Q5_0 attn_gate, float ssm_beta / ssm_alpha (a
    second, float product for b and a), Q8_0 ssm_out whose tiled value heads (16 wide) cut
    its blocks (dequantized on load), Q4_0 experts, F16 full attention."""
    if gname.endswith("attn_gate.weight"):
        return "Q5_0"
    if gname.endswith(("ssm_beta.weight", "ssm_alpha.weight", "ffn_gate_inp.weight")):
        return "F32"
    if gname.endswith(("_exps.weight",)):
        return "Q4_0"
    if gname.endswith(("attn_q.weight", "attn_k.weight", "attn_v.weight", "attn_output.weight")):
        return "F16"
    if gname.endswith(("ffn_down_shexp.weight", "ffn_gate_inp_shexp.weight")):
        return "F32"
    return "Q8_0"


def k_mix(gname: str) -> str:
    """Qwen3.5 with K-quants: Q4_K, Q6_K ffn_down and output head, a Q8_0 ssm_out (the tiled
    value heads, 64 wide, moved as whole 32-element blocks)."""
    if gname.endswith(("ffn_down.weight", "output.weight")):
        return "Q6_K"
    if gname.endswith("ssm_out.weight"):
        return "Q8_0"
    return "Q4_K"


CASES = {
    "qwen3_5-F32": ("qwen3_5", lambda _n: "F32"),
    # an MTP block after the model's (nextn_predict_layers): not loaded
    "qwen3_5-F16-mtp": ("qwen3_5", lambda _n: "F16"),
    "qwen3_next-Q8_0": ("qwen3_next", next_mix),
    "qwen3_5_moe-mix": ("qwen3_5_moe", qwen35_moe_mix),
    "qwen3_5-Kmix": ("qwen3_5-wide", k_mix),
}


@pytest.mark.parametrize("case", CASES)
def test_hybrid_gguf_matches_transformers(case: str, rng) -> None:
    arch, types = CASES[case]
    d, ref = hybrid_gguf(arch, types, case, mtp=case.endswith("mtp"))
    if case.endswith("F32"):
        ref = float_source(arch)  # the source itself: every layout change undone exactly
    runner = check_against_reference(d / "model.gguf", ref, rng).runner
    a = runner.arch
    want = json.loads((float_source(arch) / "config.json").read_text())
    assert list(a.layer_types) == want["layer_types"]  # the MTP block not counted
    assert a.partial_rotary_factor == 0.25
    assert not a.fused_gdn_proj
    if case == "qwen3_5_moe-mix":
        gdn = runner.model.model.layers[0].linear_attn
        assert gdn.in_proj is None  # q/k/v + z quantized, b + a float
        assert type(gdn.in_proj_ba.method).__name__ == "UnquantizedMethod"
        assert type(gdn.out_proj.method).__name__ == "UnquantizedMethod"  # dequantized on load
    if case == "qwen3_5-Kmix":
        gdn = runner.model.model.layers[0].linear_attn
        assert gdn.out_proj.qweight is not None  # Q8_0 blocks moved whole
        assert gdn.in_proj.qweight is not None
    if case == "qwen3_next-Q8_0":
        gdn = runner.model.model.layers[0].linear_attn
        assert gdn.in_proj is not None and gdn.in_proj.qweight is not None


@pytest.mark.parametrize("arch", ["qwen3_next", "qwen3_5", "qwen3_5_moe"])
def test_config_from_the_metadata_matches_the_source(arch: str) -> None:
    from voltserve.services.executor.gguf_source import GGUFSource

    d, _ = hybrid_gguf(arch, lambda _n: "F32", "F32")
    ours = GGUFSource(d).config
    want = json.loads((float_source(arch) / "config.json").read_text())
    keys = ["layer_types", "linear_num_key_heads", "linear_num_value_heads", "head_dim"]
    keys += ["linear_key_head_dim", "linear_value_head_dim", "linear_conv_kernel_dim"]
    keys += ["num_hidden_layers", "num_key_value_heads", "tie_word_embeddings"]
    if "num_experts" in want:
        keys += ["num_experts", "num_experts_per_tok", "moe_intermediate_size"]
        keys += ["shared_expert_intermediate_size"]
    for k in keys:
        assert ours[k] == want[k], k
    assert ours["partial_rotary_factor"] == want["rope_parameters"]["partial_rotary_factor"]


_META = {
    "block_count": 2,
    "embedding_length": 32,
    "feed_forward_length": 64,
    "attention.head_count": 2,
    "context_length": 64,
    "ssm.group_count": 2,
    "ssm.time_step_rank": 4,
    "ssm.state_size": 8,
    "ssm.inner_size": 32,
    "ssm.conv_kernel": 4,
    "full_attention_interval": 2,
}


def test_bad_hybrid_files_are_refused_by_name(tmp_path) -> None:
    qc.small_gguf(tmp_path / "a.gguf", "qwen35", {**_META, "ssm.time_step_rank": 3}, {})
    with pytest.raises(ModelLoadError, match=r"qwen35\.ssm\.time_step_rank 3 \(value heads\)"):
        load_model(tmp_path / "a.gguf", torch.float32, CPU)
    meta = {**_META, "expert_count": 4, "expert_used_count": 2}
    fused = {"blk.0.ffn_gate_up_exps.weight": np.zeros((4, 64, 32), np.float32)}
    qc.small_gguf(tmp_path / "b.gguf", "qwen35moe", meta, fused)
    with pytest.raises(ModelLoadError, match=r"'blk\.0\.ffn_gate_up_exps\.weight'"):
        load_model(tmp_path / "b.gguf", torch.float32, CPU)


@pytest.mark.parametrize("arch", ["kimi-linear", "lfm2", "mamba2", "nemotron_h"])
def test_other_linear_attention_architectures_stay_refused_by_name(tmp_path, arch: str) -> None:
    qc.small_gguf(tmp_path / "m.gguf", arch, _META, {})
    with pytest.raises(ModelLoadError, match=rf"architecture '{arch}' is not supported"):
        load_model(tmp_path / "m.gguf", torch.float32, CPU)


@pytest.mark.parametrize("arch", ["qwen3_next", "qwen3_5"])
def test_tokenizer_from_the_metadata(arch: str) -> None:
    """The renderer's tokenizer (transformers' AutoTokenizer cannot read these files)."""
    from voltserve.shared.gguf_files import load_tokenizer

    d, _ = hybrid_gguf(arch, lambda _n: "F32", "F32")
    ours, want = load_tokenizer(d), tokenizer()
    text = "Hello wörld <|im_end|> 12 345"
    assert ours.encode(text) == want.encode(text)
    assert ours.chat_template == want.chat_template
    assert ours.eos_token == "<|im_end|>"


def test_mtp_from_a_gguf_file_is_refused_by_name() -> None:
    from voltserve.services.executor.model_runner import ModelRunner
    from voltserve.services.executor.spec.config import SpeculativeConfig
    from voltserve.shared.startup import StartupError

    d, _ = hybrid_gguf("qwen3_5", lambda _n: "F16", "qwen3_5-F16-mtp", mtp=True)
    sc = SpeculativeConfig.from_dict({"method": "mtp", "num_speculative_tokens": 1})
    with pytest.raises(StartupError, match="MTP layers of a GGUF file"):
        ModelRunner(
            EngineConfig(model=str(d / "model.gguf"), num_kv_blocks=8, speculative_config=sc)
        )
