"""Quantized checkpoint loading: the GGUF block unpacking against the gguf package's own
dequantize, detection and --quantization, split GGUF files, the tokenizer from GGUF metadata,
--max-gpu-memory sizes, and the refusals (each names the tensor and the variant)."""

from __future__ import annotations

import importlib.util
import json
import shutil

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file
from voltserve.kernels.linear.gguf_blocks import BLOCK_TYPES, unpack_blocks
from voltserve.services.executor.loader import ModelLoadError, load_model

from tests import quant_checkpoints as qc
from tests.checkpoints import tokenizer

CPU = torch.device("cpu")
# where each block type keeps its fp16 fields (d, dmin / m), byte offsets in the block
_F16_FIELDS = {
    "Q4_0": [0],
    "Q4_1": [0, 2],
    "Q5_0": [0],
    "Q5_1": [0, 2],
    "Q8_0": [0],
    "Q2_K": [80, 82],
    "Q3_K": [108],
    "Q4_K": [0, 2],
    "Q5_K": [0, 2],
    "Q6_K": [208],
}


@pytest.mark.parametrize("kind", list(BLOCK_TYPES))
def test_gguf_blocks_equal_gguf_dequantize(kind: str, rng) -> None:
    """Random block bytes (finite fp16 fields): codes * scales + offsets == gguf's dequantize,
    exactly, and codes fit the storage width the kernels are told."""
    import gguf

    bt = BLOCK_TYPES[kind]
    N, K = 3, 512
    g = np.random.default_rng(rng.randrange(1 << 32))
    raw = g.integers(0, 256, size=(N, K // bt.block, bt.nbytes), dtype=np.uint8)
    for p in _F16_FIELDS[kind]:
        f = g.uniform(-0.01, 0.01, size=raw.shape[:2]).astype(np.float16)
        raw[..., p : p + 2] = f.view(np.uint8).reshape(N, -1, 2)
    raw = raw.reshape(N, -1)
    want = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[kind])
    codes, scales, offsets = unpack_blocks(kind, torch.from_numpy(raw), K)
    assert scales.shape == (N, K // bt.group) and codes.dtype == torch.uint8
    assert int(codes.max()) < (1 << bt.bits)
    rep = bt.group
    got = codes.float() * scales.repeat_interleave(rep, 1) + offsets.repeat_interleave(rep, 1)
    assert np.array_equal(got.numpy(), want)


def _edit_config(d, **quant):
    cfg = json.loads((d / "config.json").read_text())
    cfg["quantization_config"].update(quant)
    (d / "config.json").write_text(json.dumps(cfg))


def _copy(src, tmp_path, name):
    return shutil.copytree(src, tmp_path / name)


def test_quantization_flag_must_match_the_checkpoint(tmp_path) -> None:
    awq, _ = qc.awq_checkpoint("qwen2", 32)
    load_model(awq, torch.float32, CPU, "awq")  # agrees: loads
    with pytest.raises(
        ModelLoadError, match="--quantization gptq was given, but the model is a awq"
    ):
        load_model(awq, torch.float32, CPU, "gptq")
    plain = qc.float_checkpoint("qwen2")
    with pytest.raises(ModelLoadError, match="an unquantized checkpoint"):
        load_model(plain, torch.float32, CPU, "compressed-tensors")
    d = qc.gguf_checkpoint("qwen2", lambda _n: "Q8_0", "Q8_0")
    with pytest.raises(ModelLoadError, match="--quantization awq .* GGUF"):
        load_model(d, torch.float32, CPU, "awq")
    bnb = _copy(awq, tmp_path, "bnb")
    _edit_config(bnb, quant_method="bitsandbytes")
    with pytest.raises(ModelLoadError, match="quant_method 'bitsandbytes' is not supported"):
        load_model(bnb, torch.float32, CPU)


def test_unsupported_variants_are_refused_naming_tensor_and_variant(tmp_path) -> None:
    awq, _ = qc.awq_checkpoint("qwen2", 32)
    d = _copy(awq, tmp_path, "gemv")
    _edit_config(d, version="gemv")
    with pytest.raises(ModelLoadError, match="AWQ version 'gemv' is not supported"):
        load_model(d, torch.float32, CPU)
    d = _copy(awq, tmp_path, "g96")
    _edit_config(d, group_size=96)
    with pytest.raises(ModelLoadError, match=r"q_proj\.qweight: AWQ GEMM 4-bit g96: group size 96"):
        load_model(d, torch.float32, CPU)

    gptq, _ = qc.gptq_checkpoint("llama", 4, 64, desc_act=True, sym=True)
    d = _copy(gptq, tmp_path, "3bit")
    _edit_config(d, bits=3)
    with pytest.raises(ModelLoadError, match=r"layers\.0\.self_attn\.q_proj\.qweight: GPTQ 3-bit"):
        load_model(d, torch.float32, CPU)
    d = _copy(gptq, tmp_path, "fmt")
    _edit_config(d, checkpoint_format="marlin")
    with pytest.raises(ModelLoadError, match="checkpoint_format 'marlin'"):
        load_model(d, torch.float32, CPU)

    # act-order with k_proj's own input order: q/k/v cannot share one permutation
    d = _copy(gptq, tmp_path, "gidx")
    sd = load_file(d / "model.safetensors")
    name = "model.layers.1.self_attn.k_proj.g_idx"
    sd[name] = sd[name].flip(0).contiguous()
    save_file(sd, d / "model.safetensors")
    with pytest.raises(ModelLoadError, match=r"layers\.1\.self_attn\..*act-order g_idx differs"):
        load_model(d, torch.float32, CPU)

    # a packed tensor of the wrong shape names itself and the variant
    d = _copy(gptq, tmp_path, "shape")
    sd = load_file(d / "model.safetensors")
    name = "model.layers.0.mlp.down_proj.scales"
    sd[name] = sd[name][:-1].contiguous()
    save_file(sd, d / "model.safetensors")
    with pytest.raises(ModelLoadError, match=r"down_proj\.scales: GPTQ 4-bit g64 expects shape"):
        load_model(d, torch.float32, CPU)

    d = _copy(gptq, tmp_path, "missing")
    sd = load_file(d / "model.safetensors")
    del sd["model.layers.1.mlp.up_proj.qzeros"]
    save_file(sd, d / "model.safetensors")
    with pytest.raises(ModelLoadError, match=r"lacks weight tensors.*up_proj\.qzeros"):
        load_model(d, torch.float32, CPU)

    ct, _ = qc.ct_checkpoint("qwen3", 4, 32)
    d = _copy(ct, tmp_path, "w4a8")
    cfg = json.loads((d / "config.json").read_text())
    cfg["quantization_config"]["config_groups"]["group_0"]["input_activations"] = {
        "num_bits": 8,
        "type": "int",
    }
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match="group 'group_0': activation quantization"):
        load_model(d, torch.float32, CPU)


def test_awq_router_entry_leaves_gate_proj_quantized(tmp_path) -> None:
    """modules_to_not_convert = ["mlp.gate"] (an MoE router, as AutoAWQ writes it) beside a
    dense MLP's packed gate_proj: gate_proj stays quantized (a substring rule would make the
    loader look for a float gate_proj.weight the checkpoint lacks)."""
    from voltserve.services.executor.quant.group import GroupQuantMethod

    awq, ref = qc.awq_checkpoint("qwen2", 32)
    d = _copy(awq, tmp_path, "router")
    _edit_config(d, modules_to_not_convert=["mlp.gate"])
    mlp = load_model(d, torch.float32, CPU).model.model.layers[1].mlp
    assert isinstance(mlp.gate_up_proj.method, GroupQuantMethod)
    want = load_file(ref / "model.safetensors")
    w = torch.cat([want[f"model.layers.1.mlp.{n}.weight"] for n in ("gate_proj", "up_proj")])
    x = torch.randn(3, w.shape[1])
    torch.testing.assert_close(mlp.gate_up_proj(x), x @ w.t())


def test_gguf_unknown_type_is_refused_naming_the_tensor(tmp_path) -> None:
    import gguf

    out = tmp_path / "iq.gguf"
    w = gguf.GGUFWriter(str(out), "qwen2")
    w.add_block_count(1)
    # IQ4_NL: 32 elements in 18 bytes
    w.add_tensor(
        "blk.0.ffn_up.weight",
        np.zeros((8, 256 // 32 * 18), dtype=np.uint8),
        raw_dtype=gguf.GGMLQuantizationType.IQ4_NL,
    )
    qc.write_gguf(w)
    with pytest.raises(ModelLoadError, match=r"'blk\.0\.ffn_up\.weight' has ggml type IQ4_NL"):
        load_model(out, torch.float32, CPU)


def test_split_gguf_loads_like_one_file() -> None:
    one = qc.gguf_checkpoint("llama", lambda _n: "Q4_0", "Q4_0")
    split = qc.gguf_checkpoint("llama", lambda _n: "Q4_0", "Q4_0-split", split=3)
    assert len(list(split.glob("*-of-00003.gguf"))) == 3
    a = load_model(one, torch.float32, CPU).model
    b = load_model(split / "model-00001-of-00003.gguf", torch.float32, CPU).model
    x = torch.randn(2, 256)
    for la, lb in zip(a.model.layers, b.model.layers):
        assert torch.equal(la.self_attn.qkv_proj(x), lb.self_attn.qkv_proj(x))
    assert torch.equal(a.model.embed_tokens.weight, b.model.embed_tokens.weight)
    assert torch.equal(a.lm_head(x), b.lm_head(x))


def test_renderer_reads_tokenizer_and_template_from_gguf(tmp_path) -> None:
    from voltserve.services.executor.gguf_source import GGUFSource
    from voltserve.services.renderer.render import Renderer

    d = qc.gguf_checkpoint("qwen2", qc.q4_k_m_types, "Q4_K_M")
    r = Renderer(str(d / "model.gguf"))
    tok = tokenizer()
    text = "the quick brown fox é"
    assert r.tokenizer.encode(text, add_special_tokens=False) == tok.encode(
        text, add_special_tokens=False
    )
    # The context and eos ids are the executor's (GGUFSource), published to the renderer.
    assert GGUFSource(d / "model.gguf").eos_token_ids() == [tok.convert_tokens_to_ids("<|im_end|>")]
    msgs = [{"role": "user", "content": "hi"}]
    assert r.chat_prompt(msgs) == tok.apply_chat_template(
        msgs, tokenize=False, add_generation_prompt=True
    )
    # --tokenizer overrides what the GGUF carries
    tok.save_pretrained(tmp_path / "tok")
    r2 = Renderer(str(d), tokenizer_path=str(tmp_path / "tok"))
    assert r2.tokenizer.encode(text) == tok.encode(text)


def test_max_gpu_memory_sizes() -> None:
    import argparse

    from voltserve.services.executor.engine_args import engine_config, memory_size
    from voltserve.services.executor.main import build_parser

    assert memory_size("16GiB") == 16 * 2**30
    assert memory_size("16GB") == 16 * 10**9
    assert memory_size("17179869184") == 2**34
    assert memory_size("1.5 gib") == 3 * 2**29
    for bad in ("16 parsecs", "", "-1GB", "0"):
        with pytest.raises(argparse.ArgumentTypeError):
            memory_size(bad)
    args = build_parser().parse_args(
        ["--model", "m", "--max-gpu-memory", "32GiB", "--quantization", "awq"]
    )
    cfg = engine_config(args)
    assert cfg.max_gpu_memory == 32 * 2**30 and cfg.quantization == "awq"


def test_serve_hands_the_quantization_flags_to_each_service() -> None:
    from voltserve.services.launcher import build_children, build_parser

    args = build_parser().parse_args(
        ["--model", "m.gguf", "--quantization", "gguf", "--max-gpu-memory", "16GiB"]
        + ["--tokenizer", "tok", "--device", "cpu", "--max-model-len", "128"]
    )
    kids = {c.name: c.argv for c in build_children(args, "redis://x")}

    def flag(argv: list[str], name: str) -> str | None:
        return argv[argv.index(name) + 1] if name in argv else None

    ex = kids["executor-0"]
    assert flag(ex, "--quantization") == "gguf" and flag(ex, "--max-gpu-memory") == str(16 * 2**30)
    assert flag(ex, "--max-model-len") == "128" and "--tokenizer" not in ex
    for name in ("renderer-0", "gateway"):
        assert flag(kids[name], "--tokenizer") == "tok"
        # The context is the executors' to decide: published in their status, not a flag.
        assert "--max-model-len" not in kids[name]
        assert "--quantization" not in kids[name]


def test_autogptq_quantize_config_json_beside_config(tmp_path) -> None:
    """Older AutoGPTQ exports keep the GPTQ settings in quantize_config.json."""
    gptq, _ = qc.gptq_checkpoint("llama", 4, 64, desc_act=True, sym=True)
    d = _copy(gptq, tmp_path, "legacy")
    cfg = json.loads((d / "config.json").read_text())
    q = cfg.pop("quantization_config")
    q.pop("quant_method")
    (d / "config.json").write_text(json.dumps(cfg))
    (d / "quantize_config.json").write_text(json.dumps(q))
    a = load_model(gptq, torch.float32, CPU).model
    b = load_model(d, torch.float32, CPU).model
    x, h = torch.randn(2, 256), torch.randn(2, 512)
    assert torch.equal(a.model.layers[0].mlp.down_proj(h), b.model.layers[0].mlp.down_proj(h))
    assert torch.equal(
        a.model.layers[1].self_attn.qkv_proj(x), b.model.layers[1].self_attn.qkv_proj(x)
    )


def test_linear_without_checkpoint_names_loads_by_module_path() -> None:
    """A Linear a model builds without prefixes is float and named by its module path (merged
    ones through stacked_params), as before the quantization seam."""
    from voltserve.services.executor.loader import _targets
    from voltserve.services.executor.models.layers import Linear
    from voltserve.services.executor.models.llama import LlamaForCausalLM
    from voltserve.services.executor.quant.base import UnquantizedMethod

    from tests.checkpoints import checkpoint

    loaded = load_model(checkpoint("llama"), torch.float32, CPU)
    model = loaded.model
    attn = model.model.layers[0].self_attn
    shards = {"q": attn.q_size, "k": attn.kv_size, "v": attn.kv_size}
    attn.qkv_proj = Linear(attn.qkv_proj.in_features, shards, False, torch.float32)
    assert isinstance(attn.qkv_proj.method, UnquantizedMethod)
    targets, _ = _targets(model)
    for leaf, shard in (("q_proj", "q"), ("k_proj", "k"), ("v_proj", "v")):
        t = targets[f"model.layers.0.self_attn.{leaf}.weight"]
        assert t.module is attn.qkv_proj and t.shard == shard
    assert isinstance(model, LlamaForCausalLM)


@pytest.mark.skipif(
    importlib.util.find_spec("xgrammar") is None, reason="structured outputs need xgrammar"
)
def test_structured_outputs_compile_against_a_gguf_models_own_tokenizer() -> None:
    """The executor's grammar compiler reads a GGUF model's tokenizer from its metadata (the
    path is a file, not a folder of tokenizer files)."""
    from voltserve.services.executor.grammar import GrammarCompilerPool
    from voltserve.shared.gguf_files import gguf_files, load_tokenizer

    d = qc.gguf_checkpoint("qwen2", lambda _n: "Q8_0", "Q8_0")
    path = gguf_files(d)[0]
    vocab = len(load_tokenizer(path))
    pool = GrammarCompilerPool(str(path), vocab, [0])
    try:
        assert pool.compile({"type": "regex", "value": "[ab]{1,3}"}) is not None
    finally:
        pool.shutdown()
