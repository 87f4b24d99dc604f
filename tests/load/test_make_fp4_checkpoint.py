"""load_tests/make_fp4_checkpoint.py writes compressed-tensors NVFP4 / MXFP4 folders that the
loader serves as the library's own decompressor reads them."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file
from voltserve.services.executor.loader import load_model

from load_tests import make_fp4_checkpoint
from tests import quant_checkpoints as qc


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_make_fp4_checkpoint_decompresses_as_the_library_does(tmp_path, fmt) -> None:
    from compressed_tensors.compressors.mxfp4.base import MXFP4PackedCompressor
    from compressed_tensors.compressors.nvfp4.base import NVFP4PackedCompressor
    from compressed_tensors.quantization import preset_name_to_scheme

    src = qc.float_checkpoint("qwen2")
    out = tmp_path / fmt
    # its command line, in this process
    make_fp4_checkpoint.main(
        ["--src", str(src), "--out", str(out), "--format", fmt, "--device", "cpu"]
    )
    sd = load_file(out / "model.safetensors")
    prefix = "model.layers.1.mlp.down_proj"
    assert sd[prefix + ".weight_packed"].dtype == torch.uint8
    assert (prefix + ".weight_global_scale" in sd) == (fmt == "nvfp4")
    # the embedding (tied to the lm_head in this model) stays float
    assert sd["model.embed_tokens.weight"].is_floating_point()
    assert not any(k.startswith(("lm_head.", "model.embed_tokens.weight_")) for k in sd)
    # the library's own decompression of the written tensors
    comp_cls = NVFP4PackedCompressor if fmt == "nvfp4" else MXFP4PackedCompressor
    scheme = preset_name_to_scheme({"nvfp4": "NVFP4A16", "mxfp4": "MXFP4A16"}[fmt], ["Linear"])
    comp = {k.removeprefix(prefix + "."): v for k, v in sd.items() if k.startswith(prefix + ".")}
    want = comp_cls.decompress(comp, scheme)["weight"].float()
    model = load_model(out, torch.float32, torch.device("cpu")).model
    x = torch.randn(3, want.shape[1])
    got = model.model.layers[1].mlp.down_proj(x)
    torch.testing.assert_close(got, x @ want.t(), atol=1e-2, rtol=1e-2)
    # the quantization is close to the float weights it came from (E2M1: 1 part in ~6 a block)
    w = load_file(src / "model.safetensors")[prefix + ".weight"].float()
    assert (want - w).abs().max() < 0.3 * w.abs().max()
