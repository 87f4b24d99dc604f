"""FP4 checkpoint loading: W4A4 configs served weights-only (the activation scales dropped, said
once in the log), --quantization modelopt, and the refusals, each naming the tensor or config
group and the variant: group sizes the kernels do not take, unknown scale dtypes (config and
tensor), non-FP4 activation quantization, asymmetric weights, NaN scales, ModelOpt algorithms
other than NVFP4 and KV-cache quantization, MoE experts of mixed formats; FP4 experts' tensor
parallel shards."""

from __future__ import annotations

import json
import logging
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from voltserve.services.executor.loader import ModelLoadError, load_model
from voltserve.services.executor.models.moe import experts_method
from voltserve.services.executor.quant.base import QuantFormatError
from voltserve.services.executor.quant.compressed_tensors import CompressedTensorsConfig
from voltserve.shared import logging as vlog

from tests import fp4_checkpoints as fc

CPU = torch.device("cpu")


def _copy(src, tmp_path, name):
    return shutil.copytree(src, tmp_path / name)


def _edit_group(d, **weights) -> None:
    cfg = json.loads((d / "config.json").read_text())
    group = cfg["quantization_config"]["config_groups"]["group_0"]
    for k, v in weights.items():
        if k == "input_activations":
            group[k] = v
        else:
            group["weights"][k] = v
    (d / "config.json").write_text(json.dumps(cfg))


def _edit_tensor(d, name: str, fn) -> None:
    sd = load_file(d / "model.safetensors")
    sd[name] = fn(sd[name]).contiguous()
    save_file(sd, d / "model.safetensors")


def _layer0(loaded):
    return loaded.model.model.layers[0]


def test_w4a4_checkpoints_serve_the_weights_and_say_so_once(monkeypatch, caplog) -> None:
    monkeypatch.setattr(vlog, "_warned", set())
    a16, _ = fc.ct_fp4_checkpoint("llama", "nvfp4")
    w4a4, _ = fc.ct_fp4_checkpoint("llama", "nvfp4", w4a4=True)
    assert "input_global_scale" in str(load_file(w4a4 / "model.safetensors").keys())
    with caplog.at_level(logging.WARNING):
        got = load_model(w4a4, torch.float32, CPU)
    said = [r for r in caplog.records if "activation quantization" in r.getMessage()]
    assert len(said) == 1 and "ignored" in said[0].getMessage()
    want = load_model(a16, torch.float32, CPU)
    for a, b in zip(got.model.modules(), want.model.modules()):
        if getattr(a, "fp4", None) is not None:
            assert torch.equal(a.fp4.packed, b.fp4.packed)
            assert torch.equal(a.fp4.scales, b.fp4.scales)
            assert torch.equal(a.fp4.gscale, b.fp4.gscale)


def test_w4a4_moe_experts_serve_the_weights_and_say_so_once(monkeypatch, caplog) -> None:
    """The experts' input scales are dropped as the dense linears' are; the log says once that
    FP4 experts stay packed, with their size and the float size they would take."""
    monkeypatch.setattr(vlog, "_warned", set())
    a16, _ = fc.ct_fp4_checkpoint("qwen3_moe", "nvfp4")
    w4a4, _ = fc.ct_fp4_checkpoint("qwen3_moe", "nvfp4", w4a4=True)
    with caplog.at_level(logging.INFO):
        got = _layer0(load_model(w4a4, torch.float32, CPU)).mlp.experts
    messages = [r.getMessage() for r in caplog.records]
    said = [m for m in messages if "MoE experts stay packed" in m]
    assert len(said) == 1 and "compressed-tensors NVFP4 g16" in said[0]
    mib = 2**20
    floats = got.num_experts * 3 * got.hidden * got.inter * 4 / mib
    assert f"{got.nbytes() / mib:.1f} MiB a layer ({floats:.1f} MiB as float32)" in said[0]
    assert sum("activation quantization" in m for m in messages) == 1
    want = _layer0(load_model(a16, torch.float32, CPU)).mlp.experts
    for b in ("w13_packed", "w13_scales", "w13_gscale", "w2_packed", "w2_scales", "w2_gscale"):
        assert torch.equal(getattr(got, b), getattr(want, b)), b


def test_modelopt_is_detected_and_forced() -> None:
    d, _ = fc.modelopt_checkpoint("qwen2")
    loaded = load_model(d, torch.float32, CPU, "modelopt")
    assert _layer0(loaded).mlp.down_proj.method.describe() == "ModelOpt NVFP4 g16"
    with pytest.raises(
        ModelLoadError, match="--quantization awq was given, but the model is a modelopt"
    ):
        load_model(d, torch.float32, CPU, "awq")


def test_compressed_tensors_fp4_refusals(tmp_path) -> None:
    nv, _ = fc.ct_fp4_checkpoint("llama", "nvfp4")
    d = _copy(nv, tmp_path, "g32")
    _edit_group(d, group_size=32)
    with pytest.raises(ModelLoadError, match=r"'group_0' \(nvfp4-pack-quantized\): group size 32"):
        load_model(d, torch.float32, CPU)
    d = _copy(nv, tmp_path, "sdtype")
    _edit_group(d, scale_dtype="torch.float16")
    with pytest.raises(ModelLoadError, match="scale_dtype 'torch.float16' is not supported"):
        load_model(d, torch.float32, CPU)
    d = _copy(nv, tmp_path, "asym")
    _edit_group(d, symmetric=False)
    with pytest.raises(ModelLoadError, match="asymmetric FP4 weights are not supported"):
        load_model(d, torch.float32, CPU)
    d = _copy(nv, tmp_path, "a8")
    _edit_group(d, input_activations={"num_bits": 8, "type": "int", "strategy": "token"})
    with pytest.raises(ModelLoadError, match="input activations int 8-bit are not supported"):
        load_model(d, torch.float32, CPU)

    # tensors: a scale of another dtype, a NaN scale byte, a packed tensor of the wrong shape
    name = "model.layers.1.mlp.up_proj.weight_scale"
    d = _copy(nv, tmp_path, "tdtype")
    _edit_tensor(d, name, lambda t: t.to(torch.float16))
    with pytest.raises(
        ModelLoadError, match=r"up_proj\.weight_scale: compressed-tensors NVFP4 g16 scale dtype"
    ):
        load_model(d, torch.float32, CPU)
    d = _copy(nv, tmp_path, "nan")
    _edit_tensor(
        d, name, lambda t: t.view(torch.uint8).index_fill(1, torch.tensor([0]), 0x7F).view(t.dtype)
    )
    with pytest.raises(ModelLoadError, match=r"up_proj\.weight_scale: \d+ E4M3 scales are NaN"):
        load_model(d, torch.float32, CPU)
    d = _copy(nv, tmp_path, "shape")
    _edit_tensor(d, "model.layers.0.self_attn.k_proj.weight_packed", lambda t: t[:, :-1])
    with pytest.raises(ModelLoadError, match=r"k_proj\.weight_packed: compressed-tensors NVFP4"):
        load_model(d, torch.float32, CPU)

    mx, _ = fc.ct_fp4_checkpoint("qwen3", "mxfp4")
    d = _copy(mx, tmp_path, "mx16")
    _edit_group(d, group_size=16)
    with pytest.raises(ModelLoadError, match="group size 16 is not supported"):
        load_model(d, torch.float32, CPU)


def test_modelopt_refusals(tmp_path) -> None:
    mo, _ = fc.modelopt_checkpoint("qwen2")

    def edit(name: str, **settings):
        d = _copy(mo, tmp_path, name)
        f = d / "hf_quant_config.json"
        cfg = json.loads(f.read_text())
        cfg["quantization"].update(settings)
        f.write_text(json.dumps(cfg))
        return d

    with pytest.raises(ModelLoadError, match="ModelOpt quant_algo 'FP8' is not supported"):
        load_model(edit("fp8", quant_algo="FP8"), torch.float32, CPU)
    with pytest.raises(ModelLoadError, match="kv_cache_quant_algo 'FP8' is not supported"):
        load_model(edit("kv", kv_cache_quant_algo="FP8"), torch.float32, CPU)
    with pytest.raises(ModelLoadError, match="NVFP4 group_size 32 is not supported"):
        load_model(edit("g32", group_size=32), torch.float32, CPU)


def test_fp4_moe_experts_of_mixed_formats_are_refused_by_name() -> None:
    """The experts of a layer are stored stacked: one FP4 format for all of them, or none."""
    from compressed_tensors.quantization import preset_name_to_scheme

    def group(preset: str, targets: list[str]) -> dict:
        g = json.loads(preset_name_to_scheme(preset, targets).model_dump_json())
        return {**g, "format": f"{preset[:5].lower()}-pack-quantized"}

    e1 = r"re:.*experts\.1\..*"
    mixed = CompressedTensorsConfig(
        {
            "format": "mixed-precision",
            "config_groups": {
                "group_0": group("MXFP4A16", [e1]),
                "group_1": group("NVFP4A16", ["Linear"]),
            },
        }
    )
    with pytest.raises(
        QuantFormatError,
        match=r"experts\.1\.gate_proj: compressed-tensors MXFP4 g32 differs from "
        r"model\.layers\.0\.mlp\.experts\.0\.gate_proj: compressed-tensors NVFP4 g16",
    ):
        experts_method(mixed, "model.layers.0.mlp.experts", "qwen", 4)
    half_float = CompressedTensorsConfig(
        {
            "format": "nvfp4-pack-quantized",
            "config_groups": {"group_0": group("NVFP4A16", ["Linear"])},
            "ignore": [e1],
        }
    )
    with pytest.raises(QuantFormatError, match=r"experts\.1\.gate_proj: UnquantizedMethod"):
        experts_method(half_float, "model.layers.0.mlp.experts", "qwen", 4)


def test_fp4_experts_load_on_every_rank() -> None:
    """Tensor parallelism at 2 ranks (loading only): each rank holds its rows of every expert's
    gate and up and its columns of down; together they dequantize to the whole experts."""
    from voltserve.services.executor.tp.group import TPGroup

    path, _ = fc.ct_fp4_checkpoint("qwen3_moe", "nvfp4")
    full = _layer0(load_model(path, torch.float32, CPU)).mlp.experts
    ranks = [
        _layer0(load_model(path, torch.float32, CPU, tp=TPGroup(r, 2, CPU))).mlp.experts
        for r in range(2)
    ]
    E, H, inter = full.num_experts, full.hidden, full.inter
    assert all(r.inter == inter // 2 for r in ranks)
    w13 = torch.cat([r.method.dense(r, "w13").view(E, 2, inter // 2, H) for r in ranks], 2)
    assert torch.equal(w13.view(E, 2 * inter, H), full.method.dense(full, "w13"))
    w2 = torch.cat([r.method.dense(r, "w2") for r in ranks], 2)
    assert torch.equal(w2, full.method.dense(full, "w2"))


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_fp4_shards_load_on_every_rank(fmt: str) -> None:
    """Tensor parallelism at 2 ranks (loading only: no collective runs): a row-parallel rank
    holds its columns' codes and blocks (whole bytes and blocks), a column-parallel one its rows
    with each shard's global scale; together they dequantize to the whole weight."""
    from voltserve.kernels.linear.fp4_pack import dequantize_fp4
    from voltserve.services.executor.tp.group import TPGroup

    path, _ = fc.ct_fp4_checkpoint("llama", fmt)
    full = _layer0(load_model(path, torch.float32, CPU))
    ranks = [_layer0(load_model(path, torch.float32, CPU, tp=TPGroup(r, 2, CPU))) for r in range(2)]
    for name, dim in (("self_attn.o_proj", 1), ("mlp.down_proj", 1), ("self_attn.qkv_proj", 0)):
        whole = dequantize_fp4(full.get_submodule(name).fp4)
        parts = [dequantize_fp4(r.get_submodule(name).fp4) for r in ranks]
        assert parts[0].shape[dim] == whole.shape[dim] // 2, name
        if dim == 1:
            assert torch.equal(torch.cat(parts, 1), whole), name
        else:  # q, k, v rows of each rank, in shard order
            lin = full.get_submodule(name)
            sizes = [size for _, size in lin.shard_offsets.values()]
            halves = [p.split([s // 2 for s in sizes]) for p in parts]
            want = whole.split(sizes)
            for i, w in enumerate(want):
                assert torch.equal(torch.cat([halves[0][i], halves[1][i]]), w), (name, i)
