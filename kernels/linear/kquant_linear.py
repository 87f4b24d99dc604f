"""Linear layers with GGUF K-quant weights kept in their block bytes (kquant_pack.py): what the
GGUF linear method calls (through kernels/dispatch.kquant_linear) when `native_enabled`.

A linear is a list of segments (kquant_pack.KQuantSegment): the output rows of one ggml type
each, so a merged qkv with Q4_K q/k and a Q6_K v is two segments, each read in its own type.

- CPU, VOLTSERVE_FORCE_REF=1 or VOLTSERVE_QUANT_KERNELS=0: the reference, F.linear with the
  weight dequantized in the run dtype (ggml's values computed in fp32, rounded once).
- CUDA, fp16 x of 1..8 rows: one GEMV launch a segment (kquant_gemv.py), each writing its
  columns of one output.
- Otherwise (more rows, fp32): every segment dequantized into its rows of the quantized formats'
  reused scratch (kquant_dequant.py), then cuBLAS. The weights stay at the file's size; the float
  copy exists for one linear at a time, in the scratch the other formats already reserve for the
  largest quantized linear.

No host syncs on any path (CUDA graphs hold them); the scratch is reserved at load.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from voltserve.kernels.elementwise.activation import silu_and_mul_ref
from voltserve.kernels.linear.kquant_pack import KQuantSegment, dequantize_kquant

# The switch: GGUF Q4_K / Q6_K linears kept in their blocks and served by the kernels here
# ("1"), or unpacked at load into codes and fp32 scales for the group-quantized kernels ("0").
# Unset: "0" (the K-quant kernels are opt-in until their GPU timing says they beat the unpacked
# path); "auto": on where the model runs on CUDA.
KQUANT_ENV = "VOLTSERVE_GGUF_KQUANT"


def native_enabled(device: torch.device) -> bool:
    """Whether GGUF K-quant linears load as blocks (see KQUANT_ENV) on `device`."""
    v = os.environ.get(KQUANT_ENV, "0").strip().lower()
    if v in ("1", "true", "yes", "on"):
        return True
    if v in ("0", "false", "no", "off"):
        return False
    if v != "auto":
        raise ValueError(f"{KQUANT_ENV}={v!r}: use 1, 0 or auto")
    return torch.device(device).type == "cuda"


def out_features(segs: list[KQuantSegment]) -> int:
    last = segs[-1]
    return last.start + last.weight.out_features


def dequantize_segments(segs: list[KQuantSegment], dtype: torch.dtype) -> torch.Tensor:
    return torch.cat([dequantize_kquant(s.weight, dtype) for s in segs])


def kquant_linear_ref(x: torch.Tensor, segs: list[KQuantSegment], bias=None) -> torch.Tensor:
    return F.linear(x, dequantize_segments(segs, x.dtype), bias)


def _cuda(ops, x: torch.Tensor) -> bool:
    return ops is not None and getattr(ops, "impl", {}).get("quant_linear") == "cuda" and x.is_cuda


def gemv_takes(x: torch.Tensor, segs: list[KQuantSegment]) -> bool:
    from voltserve.kernels.linear import kquant_gemv

    return all(kquant_gemv.supports(x, s.weight) for s in segs)


def kquant_gemv_cuda(x, segs: list[KQuantSegment], bias=None, tile=None) -> torch.Tensor:
    """x of 1..8 fp16 rows `gemv_takes`: one GEMV launch a segment into one [M, N] output."""
    from voltserve.kernels.linear.kquant_gemv import launch_kquant_gemv

    out = torch.empty((x.shape[0], out_features(segs)), dtype=x.dtype, device=x.device)
    for s in segs:
        end = s.start + s.weight.out_features
        b = None if bias is None else bias[s.start : end]
        launch_kquant_gemv(x, s.weight, b, out[:, s.start : end], tile)
    return out


def kquant_dequant_linear(x, segs: list[KQuantSegment], bias, ops) -> torch.Tensor:
    """Every segment dequantized into the shared scratch, then one cuBLAS product."""
    from voltserve.kernels.linear.kquant_dequant import dequantize_into
    from voltserve.kernels.linear.quant_linear import scratch_of

    K = segs[0].weight.in_features
    wd = scratch_of(ops).get(out_features(segs), K, x.dtype, x.device)
    for s in segs:
        dequantize_into(s.weight, wd[s.start : s.start + s.weight.out_features])
    return F.linear(x, wd, bias)


def kquant_linear(x: torch.Tensor, segs: list[KQuantSegment], bias=None, ops=None):
    """y = x @ W^T (+ bias) for 2-D x [T, K] -> [T, N] in x's dtype. ops: the KernelDispatch (its
    impl["quant_linear"] says cuda or ref, as for the other quantized formats); None: the
    reference."""
    K = segs[0].weight.in_features
    if x.dim() != 2 or x.shape[1] != K:
        raise ValueError(f"x must be [T, {K}], got {tuple(x.shape)}")
    if not _cuda(ops, x):
        return kquant_linear_ref(x, segs, bias)
    if gemv_takes(x, segs):
        return kquant_gemv_cuda(x, segs, bias)
    return kquant_dequant_linear(x, segs, bias, ops)


def kquant_gate_up_silu(x: torch.Tensor, segs: list[KQuantSegment], bias=None, ops=None):
    """silu_and_mul of a merged gate_up K-quant linear [2I, K]: [T, I]."""
    if not _cuda(ops, x):
        return silu_and_mul_ref(kquant_linear_ref(x, segs, bias))
    return ops.silu_and_mul(kquant_linear(x, segs, bias, ops))


__all__ = [
    "KQUANT_ENV",
    "dequantize_segments",
    "gemv_takes",
    "kquant_dequant_linear",
    "kquant_gate_up_silu",
    "kquant_gemv_cuda",
    "kquant_linear",
    "kquant_linear_ref",
    "native_enabled",
    "out_features",
]
