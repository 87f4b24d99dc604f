"""Linears: the decode gemv kernels (plain, gate_up, fused qkv + rotary) and the group-quantized
ones (packing, gemv, tensor-core GEMM, dequantize, and the op that picks among them)."""

from voltserve.kernels.registry import KernelSpec, Op, both

OPS = (
    # Linears of up to 8 rows (decode); models/layers.py calls it only for such inputs.
    # VOLTSERVE_GEMV=0 keeps the decode linears on cuBLAS, to compare the two end to end.
    Op(
        "gemv",
        "linear.gemv.gemv_ref",
        ("linear.gemv",),
        env="VOLTSERVE_GEMV",
        capturable_ref=True,
    ),
    # The gate_up projection with silu_and_mul fused into its output (out = the activation).
    Op(
        "gemv_gate_up",
        "linear.gemv.gemv_gate_up_ref",
        ("linear.gemv",),
        env="VOLTSERVE_GEMV",
        capturable_ref=True,
    ),
    # The qkv projection with rotary and the KV-cache write fused into its output (decode).
    Op(
        "gemv_qkv_rope",
        "linear.gemv_qkv_rope.gemv_qkv_rope_ref",
        ("linear.gemv_qkv_rope",),
        env="VOLTSERVE_GEMV",
    ),
    # Linears with group-quantized weights (quant_linear.py picks the kernel by row count; the
    # weight formats call kernels/dispatch.quant_linear, which reads impl["quant_linear"]).
    Op(
        "quant_linear",
        "linear.quant_linear.quant_linear_ref",
        ("linear.quant_linear",),
        env="VOLTSERVE_QUANT_KERNELS",
        capturable_ref=True,
    ),
)

# gemv.py: skinny decode matrix products, one kernel per M (gemv_kernel(M)); representative
# instances. Arguments: x [M, K], w [N, K], bias [N] (unused without has_bias), out [M, N],
# has_bias. Rows may be strided views (e.g. logits rows), so 2-D arrays take any layout.
KERNELS = tuple(
    KernelSpec(
        "linear.gemv",
        name,
        both("void({t}[:, :], {t}[:, :], {t}[::1], {t}[:, :], boolean)"),
    )
    for name in ("gemv_kernel_m1", "gemv_kernel_m2", "gemv_kernel_m4", "gemv_kernel_m8")
)
# The gemv_gate_up variants (gemv_kernel(M, GATE_UP)): same arguments, w is the merged gate_up
# weight [2I, K] and out the activation [M, I]. fp16 only (what decode runs) at the sizes the
# rule sends to them and the largest.
KERNELS += tuple(
    KernelSpec(
        "linear.gemv",
        name,
        ("void(float16[:, :], float16[:, :], float16[::1], float16[:, :], boolean)",),
    )
    for name in ("gemv_gate_up_kernel_m1", "gemv_gate_up_kernel_m2", "gemv_gate_up_kernel_m8")
)
# gemv_qkv_rope.py (gemv_kernel(M, QKV_ROPE)): the gemv arguments, then positions [M] int64, the
# fp32 cos/sin cache, the K and V caches [blocks, kv_heads, 16, head_dim], slots [M] int64, and
# the q and kv head counts. fp16 at the row counts the rule sends to it.
KERNELS += tuple(
    KernelSpec(
        "linear.gemv",
        name,
        (
            "void(float16[:, :], float16[:, :], float16[::1], float16[:, :], boolean, int64[::1], "
            "float32[:, ::1], float16[:, :, :, ::1], float16[:, :, :, ::1], int64[::1], int64, "
            "int64)",
        ),
    )
    for name in ("gemv_qkv_rope_kernel_m1", "gemv_qkv_rope_kernel_m2")
)

# quant_gemv.py: fused dequantize-GEMV for group-quantized weights (qgemv_kernel(M, bits, split,
# kind)); representative instances (each is a large generated body, ~30 s to compile: the int4
# M = 1 kernel in both dtypes, the others in fp16, what decode runs). Arguments: x [M, K],
# qweight int32 [N, K * bits / 32] (pair-interleaved codes, quant_pack.py), scales and offsets
# [N, groups], bias [N] (unused without has_bias), out [M, N] (gate_up: [M, N / 2]), has_bias,
# group_shift.
_QGEMV_SIG = (
    "void({t}[:, :], int32[:, ::1], {t}[:, ::1], {t}[:, ::1], {t}[::1], {t}[:, :], boolean, int64)"
)
KERNELS += (KernelSpec("linear.quant_gemv", "qgemv_int4_m1", both(_QGEMV_SIG)),)
KERNELS += tuple(
    KernelSpec("linear.quant_gemv", name, (_QGEMV_SIG.format(t="float16"),))
    for name in (
        "qgemv_int4_m8",
        "qgemv_int4_split_m1",
        "qgemv_int8_m1",
        "qgemv_gate_up_int4_m1",
        "qgemv_gate_up_int4_m8",
        # The dot-product forms of fp16 x (quant_gemv.form_for): half2 for int4 with one group
        # per chunk at every row count (plain at 1, 2 and 8 rows, gate_up), factored (int8 and
        # split groups at 1-2 rows; int4 forced for comparison). The entries above keep the
        # per-weight form (fp32 x; int8 and split groups at 3-8 rows).
        "qgemv_int4_m1_factored",
        "qgemv_int4_m1_half2",
        "qgemv_int4_m2_half2",
        "qgemv_int4_m8_half2",
        "qgemv_gate_up_int4_m1_half2",
        # Split-K over all 4 warps of a block (KS = 4; the one-row default above is KS = 2).
        "qgemv_int4_m1_half2_ks4",
        "qgemv_gate_up_int4_m1_half2_ks4",
    )
)

# quant_dequant.py: a group-quantized weight into an [N, K] buffer (the prefill path's scratch).
# Arguments: qweight, scales, offsets, out [N, K], group_shift.
_DEQUANT_SIG = "void(int32[:, ::1], {t}[:, ::1], {t}[:, ::1], {t}[:, ::1], int64)"
KERNELS += (
    KernelSpec("linear.quant_dequant", "dequant_int4_kernel", both(_DEQUANT_SIG)),
    KernelSpec("linear.quant_dequant", "dequant_int8_kernel", (_DEQUANT_SIG.format(t="float16"),)),
)

# quant_gemm_tc.py: the dequantize-in-shared-memory tensor-core GEMM (wmma inline through
# runtime/wmma_inline.py), per tile config from qgemm_kernel(); representative instances (fp16
# only): the 16-, 32- (int8), 64- and 128-row tiles (4, 8, 8 and 16 warps). Arguments: flat x,
# qweight, scales, offsets, bias, out [T, N], flat fp32 split-K partials, has_bias, group_shift,
# T, K steps per split. Then the split-K reduction: partials, bias, out, has_bias, splits.
_QGEMM_SIG = (
    "void(float16[::1], int32[:, ::1], float16[:, ::1], float16[:, ::1], float16[::1],"
    " float16[:, :], float32[::1], boolean, int64, int64, int64)"
)
KERNELS += tuple(
    KernelSpec("linear.quant_gemm_tc", name, (_QGEMM_SIG,))
    for name in (
        "qgemm_int4_m16",
        "qgemm_int4_m64",
        "qgemm_int8_m32",
        "qgemm_int4_m128",
        "qgemm_int8_m128",
    )
)
KERNELS += (
    KernelSpec(
        "linear.quant_gemm_tc",
        "qgemm_reduce_kernel",
        ("void(float32[::1], float16[::1], float16[:, :], boolean, int64)",),
    ),
)
# The quantized qkv_rope variant (quant_gemv.qgemv_kernel(M, bits, kind=QKV_ROPE)): the
# quant_gemv arguments, then positions [M] int64, the fp32 cos/sin cache, the K and V caches,
# slots [M] int64, and the q and kv head counts.
_QKV_ROPE_SIG = (
    "void(float16[:, :], int32[:, ::1], float16[:, ::1], float16[:, ::1], float16[::1],"
    " float16[:, :], boolean, int64, int64[::1], float32[:, ::1], float16[:, :, :, ::1],"
    " float16[:, :, :, ::1], int64[::1], int64, int64)"
)
KERNELS += tuple(
    KernelSpec("linear.quant_gemv", name, (_QKV_ROPE_SIG,))
    for name in (
        "qgemv_qkv_rope_int4_m1",
        "qgemv_qkv_rope_int4_m1_half2",
        "qgemv_qkv_rope_int4_m1_half2_ks4",
    )
)

# kquant_gemv.py: the GEMV over GGUF K-quant blocks as stored (kquant_pack.py), per type, row
# variant, rows a warp and split-K (kquant_kernel); representative instances, fp16 only: Q4_K
# and Q6_K at one row, Q6_K at two rows with split-K over two warps. Arguments: x [M, K], the
# blocks as int32 words [N, K / 256 * bytes / 4], (Q6_K: int8 scales [N, K / 16], fp16 d
# [N, K / 256]), bias [N] (unused without has_bias), out [M, N] (a column slice of a merged
# output), has_bias. kquant_dequant.py: the blocks into an [N, K] buffer (the path above 8 rows).
_KQ4 = "void(float16[:, :], int32[:, ::1], float16[::1], float16[:, :], boolean)"
_KQ6 = (
    "void(float16[:, :], int32[:, ::1], int8[:, ::1], float16[:, ::1], float16[::1],"
    " float16[:, :], boolean)"
)
KERNELS += (
    KernelSpec("linear.kquant_gemv", "kquant_gemv_q4_k_m1", (_KQ4,)),
    KernelSpec("linear.kquant_gemv", "kquant_gemv_q6_k_m1", (_KQ6,)),
    KernelSpec("linear.kquant_gemv", "kquant_gemv_q6_k_m2_ks2", (_KQ6,)),
    KernelSpec(
        "linear.kquant_dequant", "dequant_q4_k_kernel", ("void(int32[:, ::1], float16[:, ::1])",)
    ),
    KernelSpec(
        "linear.kquant_dequant",
        "dequant_q6_k_kernel",
        ("void(int32[:, ::1], int8[:, ::1], float16[:, ::1], float16[:, ::1])",),
    ),
)

# fp4_kernels.py: FP4 (E2M1) weights with E4M3 / E8M0 block scales, decoded in software. The
# tiled GEMV (fp4_gemv_kernel(M, gate_up, group, e8m0, tile, form)); representative instances:
# NVFP4 at 1 row in the table form (split-K over two warps, both dtypes), and in the half2 form
# (fp16 x, the default there) NVFP4 at 8 rows (two rows a warp, two chunks a lane), MXFP4 at
# one row, gate_up at one row. Arguments: x [M, K], codes as int32 words
# [N, K / 8], scale bytes uint8 [N, K / g], global scales fp32 [N], bias [N] (unused without
# has_bias), out [M, N] (gate_up: the merged weight [2I, K] and out [M, I]), has_bias. The
# dequantize kernel: code words, scale bytes, global scales, out [N, K], group_shift, e8m0
# (fp16 only: what prefill runs).
_FP4_GEMV_SIG = (
    "void({t}[:, :], int32[:, ::1], uint8[:, ::1], float32[::1], {t}[::1], {t}[:, :], boolean)"
)
KERNELS += (KernelSpec("linear.fp4_kernels", "fp4_gemv_kernel_m1", both(_FP4_GEMV_SIG)),)
KERNELS += tuple(
    KernelSpec("linear.fp4_kernels", name, (_FP4_GEMV_SIG.format(t="float16"),))
    for name in (
        "fp4_gemv_kernel_m8",
        "fp4_gemv_mxfp4_kernel_m1",
        "fp4_gemv_gate_up_kernel_m1",
    )
)
KERNELS += (
    KernelSpec(
        "linear.fp4_kernels",
        "fp4_dequant_kernel",
        ("void(int32[:, ::1], uint8[:, ::1], float32[::1], float16[:, ::1], int64, boolean)",),
    ),
)
