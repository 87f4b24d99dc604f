"""load_tests/make_awq_checkpoint.py writes AutoAWQ GEMM tensors: the loader serves them as
the reference dequantization of its packed tensors (tests/quant_checkpoints.py) says."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file
from voltserve.services.executor.loader import load_model

from tests import quant_checkpoints as qc

ROOT = Path(__file__).resolve().parents[2]


def test_make_awq_checkpoint_packs_as_autoawq(tmp_path) -> None:
    src = qc.float_checkpoint("qwen2")
    out = tmp_path / "awq"
    cmd = [sys.executable, str(ROOT / "load_tests/make_awq_checkpoint.py"), "--src", str(src)]
    subprocess.run([*cmd, "--out", str(out), "--group", "64", "--device", "cpu"], check=True)
    sd = load_file(out / "model.safetensors")
    model = load_model(out, torch.float32, torch.device("cpu")).model
    prefix = "model.layers.1.mlp.down_proj"
    want = qc.awq_reference_dequant(
        sd[prefix + ".qweight"], sd[prefix + ".qzeros"], sd[prefix + ".scales"], 64
    )
    x = torch.randn(3, want.shape[1])
    torch.testing.assert_close(model.model.layers[1].mlp.down_proj(x), x @ want.t())
    # the quantization is close to the float weights it came from
    w = load_file(src / "model.safetensors")[prefix + ".weight"]
    assert (want - w).abs().max() < 0.2 * w.abs().max()
