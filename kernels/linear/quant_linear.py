"""Linear layers with group-quantized weights (quant_pack.py): y = x[:, perm] @ w^T (+ bias), and
the gated MLP's gate_up projection with silu_and_mul fused in.

Entry points (what a quantization method's linear calls):

    quant_linear(x, w, bias, ops)        -> y [T, N]
    quant_gate_up_silu(x, w, bias, ops)  -> silu_and_mul(quant_linear(x, w, bias)) [T, N // 2]
    quant_qkv_rope(x, w, bias, ops, positions, cos_sin_cache, k_cache, v_cache, slot_mapping,
                   n_q, n_kv)            -> qkv [T, N], q/k rotated (NeoX), k/v in the cache

x is [T, K] in the run dtype; w a GroupQuantWeight (gate rows then up rows for gate_up); ops the
KernelDispatch (None: the reference). On CPU, or with VOLTSERVE_FORCE_REF=1, they are the
references `quant_linear_ref` / `quant_gate_up_ref`: F.linear with the dequantized weight in the
run dtype, the same math a reference model holding dequantized weights does. On CUDA the row
count picks the kernel (`quant_path`):

- T <= gemv_max_rows() (decode, default 4; 8 where the tensor-core GEMM cannot serve): the fused
  dequantize-GEMV (quant_gemv.py), which reads each packed weight byte once, fp32
  accumulation; the gate_up variant applies silu_and_mul in its epilogue, the qkv_rope variant
  rotary and the KV-cache write (as the fp16 gemv kinds do).
- up to tc_max_rows() (batched decode, default 64): the dequantize-in-shared-memory GEMM on
  Volta tensor cores (quant_gemm_tc.py, wmma m16n16k16 inline through wmma_inline.py), fp16
  only. Faster than dequantize + cuBLAS at 16 and 64 rows and slower at 256, where the kernel
  dequantises each weight once per row tile (BENCHMARKS.md §12); so the cut-over sits at 64 (VOLTSERVE_QUANT_TC_MAX_ROWS moves
  it; 0 turns the kernel off).
- larger T (prefill) and fp32 runs: the layer dequantized into one reused scratch buffer
  (quant_dequant.py), then cuBLAS.

CUDA graphs: every path launches on torch's current stream without host syncs. The dequantize
path needs its scratch allocated outside capture: `reserve_scratch(ops, numel)` at load (the
largest N * K of the model), otherwise the first eager call sizes it, and a capture that would
need a larger one raises.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from voltserve.kernels.elementwise.activation import silu_and_mul_ref
from voltserve.kernels.linear.quant_pack import GroupQuantWeight, dequantize
from voltserve.kernels.runtime.launch_geometry import on_gpu

GEMV_MAX_ROWS = 8  # the GEMV kernels' limit
GEMV_ROWS_ENV = "VOLTSERVE_QUANT_GEMV_MAX_ROWS"  # the cut-over to the tensor-core GEMM (1..8)
# At 3-4 rows the GEMV beats the tensor-core GEMM on every int4 g128 Llama-3-8B linear; at 5-8
# rows, where the GEMV takes its 8-input variant, the tensor-core GEMM wins on every linear
# (BENCHMARKS.md §12).
DEFAULT_GEMV_ROWS = 4
TC_MAX_ROWS_ENV = "VOLTSERVE_QUANT_TC_MAX_ROWS"
DEFAULT_TC_MAX_ROWS = 64

GEMV, TC, DEQUANT = "gemv", "tc", "dequant"  # CUDA paths


def _permuted(x: torch.Tensor, w: GroupQuantWeight) -> torch.Tensor:
    return x if w.perm is None else x.index_select(1, w.perm)


def quant_linear_ref(
    x: torch.Tensor, w: GroupQuantWeight, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """x: [T, K] -> F.linear(x[:, perm], dequantize(w), bias) in x's dtype."""
    return F.linear(_permuted(x, w), dequantize(w, x.dtype), bias)


def quant_gate_up_ref(
    x: torch.Tensor, w: GroupQuantWeight, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """x: [T, K], w: [2I, K] (gate rows then up rows) -> silu_and_mul(x w^T (+ b)): [T, I]."""
    return silu_and_mul_ref(quant_linear_ref(x, w, bias))


def tc_max_rows() -> int:
    """Row counts above gemv_max_rows() up to this run the tensor-core kernel (env-tunable: the
    cut-over against dequantize + cuBLAS depends on the card)."""
    return max(0, int(os.environ.get(TC_MAX_ROWS_ENV, DEFAULT_TC_MAX_ROWS)))


def gemv_max_rows() -> int:
    """Row counts up to this run the GEMV (env-tunable up to GEMV_MAX_ROWS; bench_quant_linear
    measures both kernels at every row count). Where the tensor-core GEMM cannot serve (fp32,
    an unsupported weight), quant_path keeps the GEMV to GEMV_MAX_ROWS."""
    return max(0, min(GEMV_MAX_ROWS, int(os.environ.get(GEMV_ROWS_ENV, DEFAULT_GEMV_ROWS))))


def quant_path(rows: int, dtype: torch.dtype, w: GroupQuantWeight) -> str:
    """Which CUDA path serves `rows` input rows (see the module docstring)."""
    from voltserve.kernels.linear import quant_gemm_tc, quant_gemv

    gemv_ok = quant_gemv.supports_weight(w, dtype)
    if 0 < rows <= gemv_max_rows() and gemv_ok:
        return GEMV
    if 0 < rows <= tc_max_rows() and quant_gemm_tc.supports_weight(w, dtype):
        return TC
    if 0 < rows <= GEMV_MAX_ROWS and gemv_ok:
        return GEMV  # fp32 or a weight the tensor-core GEMM does not take: still one pass
    return DEQUANT


class QuantScratch:
    """One fp16/fp32 buffer the dequantize path writes a layer's weight into, reused by every
    layer (so it costs the largest layer's N * K, once)."""

    def __init__(self) -> None:
        self.buf: torch.Tensor | None = None

    def reserve(self, numel: int, dtype: torch.dtype, device: torch.device) -> None:
        if self.buf is None or self.buf.numel() < numel or self.buf.dtype != dtype:
            if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
                raise RuntimeError(
                    f"quantized linear scratch of {numel} elements is not reserved; call "
                    "quant_linear.reserve_scratch(ops, numel) before CUDA graph capture"
                )
            self.buf = torch.empty(numel, dtype=dtype, device=device)

    def get(self, n: int, k: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        self.reserve(n * k, dtype, device)
        assert self.buf is not None
        return self.buf[: n * k].view(n, k)


def scratch_of(ops) -> QuantScratch:
    """The dequantize path's scratch kept on the KernelDispatch (every quantized format's)."""
    s = getattr(ops, "quant_scratch", None)
    if s is None:
        s = QuantScratch()
        ops.quant_scratch = s
    return s


def reserve_scratch(ops, numel: int) -> None:
    """Allocate the dequantize path's scratch for weights of up to numel elements (call at load,
    with the model's largest quantized N * K, before graphs are captured)."""
    if ops is not None and ops.device.type == "cuda":
        scratch_of(ops).reserve(numel, ops.dtype, ops.device)


def _cuda_enabled(ops) -> bool:
    return ops is not None and getattr(ops, "impl", {}).get("quant_linear") == "cuda"


def _dequant_linear(x, w, bias, ops, out=None):
    from voltserve.kernels.linear import quant_dequant

    scratch = QuantScratch() if ops is None else scratch_of(ops)
    wd = scratch.get(w.out_features, w.in_features, x.dtype, x.device)
    quant_dequant.dequantize_into(w, wd)
    y = F.linear(_permuted(x, w), wd, bias)
    if out is not None:
        out.copy_(y)
        return out
    return y


def quant_linear_cuda(
    x: torch.Tensor,
    w: GroupQuantWeight,
    bias: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    ops=None,
) -> torch.Tensor:
    """quant_linear_ref's meaning on CUDA tensors, the kernel picked by the row count
    (`quant_path`). ops: where the dequantize path keeps its scratch (None: a fresh one)."""
    if not on_gpu(x):
        y = quant_linear_ref(x, w, bias)
        return y if out is None else out.copy_(y)
    path = quant_path(x.shape[0], x.dtype, w)
    if path == GEMV:
        from voltserve.kernels.linear.quant_gemv import quant_gemv_cuda

        return quant_gemv_cuda(_permuted(x, w), w, bias, out)
    if path == TC:
        from voltserve.kernels.linear.quant_gemm_tc import quant_gemm_tc_cuda

        return quant_gemm_tc_cuda(_permuted(x, w), w, bias, out)
    return _dequant_linear(x, w, bias, ops, out)


def quant_linear(
    x: torch.Tensor,
    w: GroupQuantWeight,
    bias: torch.Tensor | None = None,
    ops=None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """y = x[:, perm] @ dequantize(w)^T (+ bias): [T, N] in x's dtype (into out when given).
    ops: the KernelDispatch (its impl["quant_linear"] says cuda or ref); None: the reference."""
    if x.dim() != 2 or x.shape[1] != w.in_features:
        raise ValueError(f"x must be [T, {w.in_features}], got {tuple(x.shape)}")
    if not _cuda_enabled(ops) or not x.is_cuda:
        y = quant_linear_ref(x, w, bias)
        return y if out is None else out.copy_(y)
    return quant_linear_cuda(x, w, bias, out, ops)


def quant_gate_up_silu(
    x: torch.Tensor,
    w: GroupQuantWeight,
    bias: torch.Tensor | None = None,
    ops=None,
) -> torch.Tensor:
    """silu_and_mul(x[:, perm] @ dequantize(w)^T (+ bias)) for a merged gate_up weight [2I, K]:
    [T, I]. Decode rows on CUDA run one fused GEMV launch."""
    if w.out_features % 2:
        raise ValueError(f"gate_up weight needs an even number of rows, got {w.out_features}")
    if x.dim() != 2 or x.shape[1] != w.in_features:
        raise ValueError(f"x must be [T, {w.in_features}], got {tuple(x.shape)}")
    if not _cuda_enabled(ops) or not x.is_cuda:
        return quant_gate_up_ref(x, w, bias)
    if quant_path(x.shape[0], x.dtype, w) == GEMV:
        from voltserve.kernels.linear.quant_gemv import quant_gemv_gate_up_cuda

        return quant_gemv_gate_up_cuda(_permuted(x, w), w, bias)
    return ops.silu_and_mul(quant_linear(x, w, bias, ops))


def quant_qkv_rope(
    x: torch.Tensor,
    w: GroupQuantWeight,
    bias: torch.Tensor | None,
    ops,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    n_q: int,
    n_kv: int,
) -> torch.Tensor:
    """The qkv projection with NeoX rotary on q and k and the KV-cache write: qkv [T, N] (q and k
    rotated), k and v written at slot_mapping (negative: skipped). Decode rows on CUDA run one
    fused GEMV launch (quant_gemv.quant_qkv_rope_cuda, which falls back to its reference for
    shapes it does not cover); otherwise quant_linear, then ops.rotary_and_cache."""
    D = k_cache.shape[3]
    if _cuda_enabled(ops) and x.is_cuda and quant_path(x.shape[0], x.dtype, w) == GEMV:
        from voltserve.kernels.linear.quant_gemv import quant_qkv_rope_cuda

        args = (positions, cos_sin_cache, k_cache, v_cache, slot_mapping, n_q, n_kv)
        return quant_qkv_rope_cuda(_permuted(x, w), w, bias, *args)
    y = quant_linear(x, w, bias, ops)
    q, k, v = y.split([n_q * D, n_kv * D, n_kv * D], dim=-1)
    if ops is None:
        from voltserve.kernels.attention.rotary_cache import rotary_and_cache_ref as rc
    else:
        rc = ops.rotary_and_cache
    rc(positions, q, k, v, D, cos_sin_cache, True, k_cache, v_cache, slot_mapping)
    return y


__all__ = [
    "GroupQuantWeight",
    "quant_qkv_rope",
    "quant_linear",
    "quant_gate_up_silu",
    "quant_linear_ref",
    "quant_linear_cuda",
    "quant_gate_up_ref",
    "quant_path",
    "reserve_scratch",
    "QuantScratch",
]
