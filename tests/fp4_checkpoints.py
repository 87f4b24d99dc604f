"""FP4 checkpoints for the tests (the tiny random models of tests/quant_checkpoints.py), each with a
float reference folder for transformers, independently of the loader (services/executor/quant/):

- compressed-tensors NVFP4 / MXFP4 (`nvfp4-pack-quantized`, `mxfp4-pack-quantized`), written
  with the library's own pieces as llm-compressor uses them: its scale and global-scale rules
  (calculate_qparams, generate_gparam) and its compressor (NVFP4PackedCompressor /
  MXFP4PackedCompressor). The reference is the library's own dequantization (its FP4 unpacker
  and `dequantize`) computed in fp32 rather than its bf16 default, checked against its
  decompressor's bf16 output.
- ModelOpt NVFP4 (hf_quant_config.json; weight / weight_scale / weight_scale_2 / input_scale),
  quantized here from the published rules: weight_scale_2 = amax / (6 * 448), block scales
  amax_block / 6 / weight_scale_2 as E4M3, codes the nearest E2M1 value. The reference is
  w = e2m1 * (weight_scale * weight_scale_2), checked against compressed-tensors' own ModelOpt
  converter followed by its dequantization.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file

from load_tests import make_fp4_checkpoint as make_fp4
from tests.quant_checkpoints import (
    _copy_meta,
    _ct_keeps,
    _linear_names,
    _load_float,
    _source,
    _write,
)

E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
CT_PRESETS_W4A4 = {"nvfp4": "NVFP4", "mxfp4": "MXFP4"}


def _ct_fp4_quantize(w: torch.Tensor, scheme, fmt: str):
    """(compressed tensors, fp32 reference weight) of one linear, with the library's rules
    (load_tests/make_fp4_checkpoint.py)."""
    from compressed_tensors.compressors.mxfp4.base import MXFP4PackedCompressor
    from compressed_tensors.compressors.nvfp4.base import NVFP4PackedCompressor
    from compressed_tensors.compressors.nvfp4.helpers import unpack_fp4_from_uint8
    from compressed_tensors.quantization.lifecycle.forward import dequantize

    comp_cls = NVFP4PackedCompressor if fmt == "nvfp4" else MXFP4PackedCompressor
    N, K = w.shape
    comp = make_fp4.quantize(w, scheme, fmt)
    codes = unpack_fp4_from_uint8(comp["weight_packed"], N, K, dtype=torch.float32)
    s = comp_cls._decompress_scale(comp["weight_scale"], torch.float32)
    ref = dequantize(
        x_q=codes,
        scale=s,
        args=scheme.weights,
        global_scale=comp.get("weight_global_scale"),
        dtype=torch.float32,
    )
    lib = comp_cls.decompress(comp, scheme)["weight"]  # the library's bf16 result
    assert torch.equal(lib, ref.to(lib.dtype)), "fp32 reference disagrees with the decompressor"
    return comp, ref


def ct_fp4_checkpoint(
    arch: str,
    fmt: str,
    w4a4: bool = False,
    src: Path | None = None,
    ignore: list[str] | None = None,
):
    """compressed-tensors NVFP4 (fmt "nvfp4") or MXFP4 ("mxfp4"), weights only (the NVFP4A16 /
    MXFP4A16 presets). w4a4: the same weights under the W4A4 preset (NVFP4 / MXFP4: FP4 input
    activations, NVFP4 with an input_global_scale per linear), as llm-compressor writes it.
    src: a float folder to quantize instead of the tiny `arch` model; ignore: the config's
    `ignore` list beside lm_head (the modules it names stay float)."""
    given = src
    src, root, prefix = _source(arch, src)
    tag = f"{prefix}-ct-{fmt}" + ("-ignore" if ignore else "")
    if w4a4:
        # the weights-only folder's weights and reference, FP4 activations in the config
        a16, ref = ct_fp4_checkpoint(arch, fmt, src=given, ignore=ignore)
        dst = root / (tag + "-w4a4")
        if not (dst / "model.safetensors").is_file():
            _with_fp4_activations(a16, dst, fmt, ignore)
        return dst, ref
    dst, ref = root / tag, root / (tag + "-ref")
    if (dst / "model.safetensors").is_file():
        return dst, ref
    scheme = make_fp4.scheme_of(fmt)
    sd = _load_float(src)
    out, refsd = dict(sd), dict(sd)
    for name in _linear_names(sd, _ct_keeps(ignore or [])):
        w = sd[name + ".weight"].float()
        del out[name + ".weight"]
        comp, deq = _ct_fp4_quantize(w, scheme, fmt)
        for k, v in comp.items():
            out[f"{name}.{k}"] = v
        refsd[name + ".weight"] = deq
    _copy_meta(src, dst)
    _write(dst, out, make_fp4.quantization_config(scheme, fmt, ignore))
    _copy_meta(src, ref)
    _write(ref, refsd, None)
    return dst, ref


def _with_fp4_activations(a16: Path, dst: Path, fmt: str, ignore: list[str] | None) -> None:
    from compressed_tensors.quantization import preset_name_to_scheme

    shutil.copytree(a16, dst)
    sd = load_file(dst / "model.safetensors")
    if fmt == "nvfp4":
        for name in [n[: -len(".weight_packed")] for n in sd if n.endswith(".weight_packed")]:
            sd[f"{name}.input_global_scale"] = torch.tensor([448.0 * 6.0 / 3.0])
    scheme = preset_name_to_scheme(CT_PRESETS_W4A4[fmt], ["Linear"])
    _write(dst, sd, make_fp4.quantization_config(scheme, fmt, ignore))


def e2m1_codes(x: torch.Tensor) -> torch.Tensor:
    """Nearest E2M1 code (sign in bit 3) of each value of x (already divided by its scale)."""
    mag = (x.abs().clamp(max=6.0)[..., None] - E2M1).abs().argmin(-1)
    return (mag | ((x < 0).long() << 3)).to(torch.uint8)


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """[N, K] codes -> [N, K / 2] bytes, input 2j in the low nibble."""
    return codes[:, 0::2] | (codes[:, 1::2] << 4)


def modelopt_checkpoint(arch: str, kv_cache_algo: str | None = None):
    """ModelOpt NVFP4 (hf_quant_config.json beside config.json)."""
    src, root, prefix = _source(arch, None)
    tag = f"{prefix}-modelopt-nvfp4" + (f"-kv{kv_cache_algo}" if kv_cache_algo else "")
    dst, ref = root / tag, root / (tag + "-ref")
    if (dst / "model.safetensors").is_file():
        return dst, ref
    sd = _load_float(src)
    out, refsd = dict(sd), dict(sd)
    for name in _linear_names(sd):
        w = sd[name + ".weight"].float()
        N, K = w.shape
        ws2 = (w.abs().max() / (6.0 * 448.0)).reshape(())
        blocks = w.view(N, K // 16, 16)
        scale = (blocks.abs().amax(-1) / 6.0 / ws2).to(torch.float8_e4m3fn)
        s = scale.float() * ws2  # the block's dequantization step
        codes = e2m1_codes(blocks / s.clamp(min=1e-30)[..., None]).view(N, K)
        out[name + ".weight"] = pack_nibbles(codes)
        out[name + ".weight_scale"] = scale
        out[name + ".weight_scale_2"] = ws2.to(torch.float32)
        out[name + ".input_scale"] = torch.tensor(0.01, dtype=torch.float32)
        vals = E2M1[(codes & 7).long()] * torch.where((codes & 8) != 0, -1.0, 1.0)
        deq = (vals.view(N, K // 16, 16) * s[..., None]).view(N, K)
        _check_with_ct_converter(out, name, deq)
        refsd[name + ".weight"] = deq
    _copy_meta(src, dst)
    _write(dst, out, None)
    settings = {
        "quant_algo": "NVFP4",
        "kv_cache_quant_algo": kv_cache_algo,
        "group_size": 16,
        "exclude_modules": ["lm_head"],
    }
    hf_quant = {"producer": {"name": "modelopt", "version": "0.29.0"}, "quantization": settings}
    (dst / "hf_quant_config.json").write_text(json.dumps(hf_quant, indent=1))
    _copy_meta(src, ref)
    _write(ref, refsd, None)
    return dst, ref


def _check_with_ct_converter(out: dict, name: str, deq: torch.Tensor) -> None:
    """compressed-tensors' ModelOpt converter and its FP4 dequantization give the same weight
    (within one fp32 rounding of the global scale's reciprocal)."""
    from compressed_tensors.compressors.nvfp4.helpers import unpack_fp4_from_uint8
    from compressed_tensors.entrypoints.convert.converters.modelopt_nvfp4 import (
        ModelOptNvfp4Converter,
    )
    from compressed_tensors.quantization import preset_name_to_scheme
    from compressed_tensors.quantization.lifecycle.forward import dequantize

    keys = ("weight", "weight_scale", "weight_scale_2", "input_scale")
    ct = ModelOptNvfp4Converter(targets=["re:.*"]).process(
        {f"{name}.{k}": out[f"{name}.{k}"].clone() for k in keys}
    )
    N, K = deq.shape
    codes = unpack_fp4_from_uint8(ct[f"{name}.weight_packed"], N, K, dtype=torch.float32)
    args = preset_name_to_scheme("NVFP4A16", ["Linear"]).weights
    got = dequantize(
        x_q=codes,
        scale=ct[f"{name}.weight_scale"].float(),
        args=args,
        global_scale=ct[f"{name}.weight_global_scale"].reshape(1),
        dtype=torch.float32,
    )
    torch.testing.assert_close(got, deq, rtol=1e-6, atol=0)
