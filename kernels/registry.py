"""Every numba.cuda kernel in voltserve.kernels, with the signatures `voltserve check-kernels`
compiles it with (fp16 and fp32 variants where the kernel serves both).

To register a kernel, append one KernelSpec to KERNELS in this file (keep one block per kernel
family, in the order below):

    KERNELS += [
        KernelSpec("attention.decode", "paged_decode_kernel", (
            "void(float16[:, :, ::1], float16[:, :, :, ::1], ...)",
        )),
    ]

module is the file's dotted path inside voltserve.kernels (subpackage.file); attr is the @cuda.jit
dispatcher's name in it; signatures are numba signature strings. Array layouts matter: `[:, ::1]` is
C-contiguous, `[:, :]` is any layout (for strided views such as slices of the fused qkv projection).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class KernelSpec:
    module: str  # dotted path inside voltserve.kernels, e.g. "elementwise.rmsnorm"
    attr: str  # the @cuda.jit dispatcher in it
    signatures: tuple[str, ...]

    @property
    def name(self) -> str:
        return f"{self.module}.{self.attr}"


def _both(template: str) -> tuple[str, ...]:
    """The fp16 and fp32 variants of a signature written with {t} for the storage dtype."""
    return tuple(template.format(t=t) for t in ("float16", "float32"))


KERNELS: list[KernelSpec] = []

# elementwise/rmsnorm.py
KERNELS += [
    KernelSpec(
        "elementwise.rmsnorm",
        "rms_norm_kernel",
        _both("void({t}[:, ::1], {t}[::1], {t}[:, ::1], float32, boolean)"),
    ),
    KernelSpec(
        "elementwise.rmsnorm",
        "fused_add_rms_norm_kernel",
        _both("void({t}[:, ::1], {t}[:, ::1], {t}[::1], float32, boolean)"),
    ),
    KernelSpec(
        "elementwise.rmsnorm",
        "rms_norm_1c_kernel",
        _both("void({t}[:, ::1], {t}[::1], {t}[:, ::1], float32)"),
    ),
    KernelSpec(
        "elementwise.rmsnorm",
        "fused_add_rms_norm_1c_kernel",
        _both("void({t}[:, ::1], {t}[:, ::1], {t}[::1], float32)"),
    ),
]

# attention/rotary.py
KERNELS += [
    KernelSpec(
        "attention.rotary",
        "rotary_embedding_kernel",
        _both("void(int64[::1], {t}[:, :], {t}[:, :], int64, float32[:, ::1], boolean, boolean)"),
    ),
]

# elementwise/activation.py
KERNELS += [
    KernelSpec(
        "elementwise.activation",
        "silu_and_mul_kernel",
        _both("void({t}[:, ::1], {t}[:, ::1], boolean)"),
    ),
]

# attention/kv_cache.py
KERNELS += [
    KernelSpec(
        "attention.kv_cache",
        "reshape_and_cache_kernel",
        _both(
            "void({t}[:, :, :], {t}[:, :, :], {t}[:, :, :, ::1], {t}[:, :, :, ::1], int64[::1],"
            " boolean)"
        ),
    ),
]

# attention/rotary_cache.py: rotary + KV-cache write in one launch. Arguments: positions, q and k
# rows (strided views of the fused qkv), head_dim, cos/sin cache, is_neox, vec_rot, k and v as
# [T, kv_heads, head_dim] views, the k/v caches, slot_mapping, vec_cache. head_dim is a runtime
# argument, so one signature per dtype serves head_dim 128 and 64 alike.
KERNELS += [
    KernelSpec(
        "attention.rotary_cache",
        "rotary_and_cache_kernel",
        _both(
            "void(int64[::1], {t}[:, :], {t}[:, :], int64, float32[:, ::1], boolean, boolean,"
            " {t}[:, :, :], {t}[:, :, :], {t}[:, :, :, ::1], {t}[:, :, :, ::1], int64[::1],"
            " boolean)"
        ),
    ),
]

# attention/qk_norm_rope.py: per-head q/k RMSNorm + rotary + KV-cache write, one warp per (token,
# head). Arguments: positions, q/k/v rows (strided views of the fused qkv), the q and k norm
# weights, eps, head_dim, cos/sin cache, the k/v caches, slot_mapping.
KERNELS += [
    KernelSpec(
        "attention.qk_norm_rope",
        "qk_norm_rope_kernel",
        _both(
            "void(int64[::1], {t}[:, :], {t}[:, :], {t}[:, :], {t}[::1], {t}[::1], float32,"
            " int64, float32[:, ::1], {t}[:, :, :, ::1], {t}[:, :, :, ::1], int64[::1])"
        ),
    ),
]

# sampling/sampling.py
KERNELS += [
    KernelSpec(
        "sampling.sampling",
        "sample_kernel",
        (
            "void(float32[:, ::1], float32[::1], int32[::1], float32[::1], float32[::1],"
            " int64[::1], int64[::1], int64[::1])",
        ),
    ),
    KernelSpec("sampling.sampling", "argmax_kernel", ("void(float32[:, ::1], int64[::1])",)),
    KernelSpec(
        "sampling.sampling",
        "apply_penalties_kernel",
        (
            "void(float32[:, ::1], boolean[:, ::1], int32[:, ::1], float32[::1], float32[::1],"
            " float32[::1])",
        ),
    ),
]

# sampling/grammar_mask.py
KERNELS += [
    KernelSpec(
        "sampling.grammar_mask",
        "apply_token_bitmask_kernel",
        ("void(float32[:, ::1], int32[:, ::1], int64[::1])",),
    ),
]

# Attention kernels (attention/decode.py, attention/prefill.py): add their specs here.

# attention/decode.py: the kernels are built per shape by decode_kernel(); the module exposes a
# few representative instances. Arguments: out, q, flat k/v caches, block_tables, seq_lens,
# scale, num_kv_heads, max_logits, exp_sums, tmp_out, merge counters.
_DECODE_SIG = (
    "void(float16[:, :, ::1], float16[:, :, ::1], float16[::1], float16[::1], int32[:, ::1],"
    " int32[::1], float64, int64, float32[:, :, ::1], float32[:, :, ::1], float32[:, :, :, ::1],"
    " int32[::1])"
)
KERNELS += [
    KernelSpec("attention.decode", name, (_DECODE_SIG,))
    for name in (
        "decode_kernel_d128_g4",
        "decode_kernel_d128_g4_direct",
        "decode_kernel_d128_g4_merge",
        "decode_kernel_d64_g7",
        "decode_kernel_d64_g7_merge",
        "decode_kernel_d256_g1",
        "decode_kernel_d128_g4_online",
        "decode_kernel_d64_g7_online",
        "decode_kernel_d256_g1_online",
    )
]
KERNELS += [
    KernelSpec(
        "attention.decode",
        "decode_reduce_kernel",
        (
            "void(float16[:, :, ::1], float32[:, :, ::1], float32[:, :, ::1],"
            " float32[:, :, :, ::1], int32[::1], int64)",
        ),
    ),
]

# attention/prefill.py: per-shape kernels from prefill_kernel(); representative instances.
# Arguments: out, q, flat k/v caches, block_tables, seq_lens, query_start_loc, scale,
# num_kv_heads.
_PREFILL_SIG = (
    "void(float16[:, :, ::1], float16[:, :, ::1], float16[::1], float16[::1], int32[:, ::1],"
    " int32[::1], int32[::1], float64, int64)"
)
KERNELS += [
    KernelSpec("attention.prefill", name, (_PREFILL_SIG,))
    for name in ("prefill_kernel_d128_g4", "prefill_kernel_d64_g7", "prefill_kernel_d256_g1")
]

# attention/prefill_fa.py: the flash prefill (the whole key loop in linked attention/prefill_fa.cu,
# what the engine runs for head dims 64 and 128), one kernel per head dim. Arguments: flat out,
# flat q, flat k/v caches, block_tables, seq_lens, query_start_loc, scale, num_kv_heads, group
# (query heads per KV head). check-kernels links without LTO, so the C function is an ABI call
# there (see the module).
_PREFILL_FA_SIG = (
    "void(float16[::1], float16[::1], float16[::1], float16[::1], int32[:, ::1], int32[::1],"
    " int32[::1], float64, int64, int64)"
)
KERNELS += [
    KernelSpec("attention.prefill_fa", name, (_PREFILL_FA_SIG,))
    for name in ("prefill_fa_kernel_d128", "prefill_fa_kernel_d64")
]

# runtime/wmma_ptx.py: the single-tile building block of wmma_ptx.cu (one warp's 16 x 16 product
# through the linked vs_wmma_gemm16). Arguments: d [256] f32, a and b flat f16, k, b_col.
KERNELS += [
    KernelSpec(
        "runtime.wmma_ptx",
        "wmma_gemm16_kernel",
        ("void(float32[::1], float16[::1], float16[::1], int32, int32)",),
    ),
]

# linear/gemv.py: skinny decode matrix products, one kernel per M (gemv_kernel(M)); representative
# instances. Arguments: x [M, K], w [N, K], bias [N] (unused without has_bias), out [M, N],
# has_bias. Rows may be strided views (e.g. logits rows), so 2-D arrays take any layout.
KERNELS += [
    KernelSpec(
        "linear.gemv",
        name,
        _both("void({t}[:, :], {t}[:, :], {t}[::1], {t}[:, :], boolean)"),
    )
    for name in ("gemv_kernel_m1", "gemv_kernel_m2", "gemv_kernel_m4", "gemv_kernel_m8")
]
# The gemv_gate_up variants (gemv_kernel(M, GATE_UP)): same arguments, w is the merged
# gate_up weight [2I, K] and out the activation [M, I]. fp16 only (what decode runs) at the
# sizes the rule sends to them and the largest.
KERNELS += [
    KernelSpec(
        "linear.gemv",
        name,
        ("void(float16[:, :], float16[:, :], float16[::1], float16[:, :], boolean)",),
    )
    for name in ("gemv_gate_up_kernel_m1", "gemv_gate_up_kernel_m2", "gemv_gate_up_kernel_m8")
]

# linear/gemv_qkv_rope.py (gemv_kernel(M, QKV_ROPE)): the gemv arguments, then positions [M] int64,
# the fp32 cos/sin cache, the K and V caches [blocks, kv_heads, 16, head_dim], slots [M] int64, and
# the q and kv head counts. fp16 at the row counts the rule sends to it.
KERNELS += [
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
]

# moe/decode.py: fused MoE experts for <= 8 tokens. gate_up: x [T, H], w13 [E, 2I, H],
# topk_ids [T, k] int32, h [T * k, I]; down: h, w2 [E, H, I], topk_ids, topk_weights [T, k] fp32,
# out [T, H].
KERNELS += [
    KernelSpec(
        "moe.decode",
        "moe_decode_gate_up_kernel",
        _both("void({t}[:, ::1], {t}[:, :, ::1], int32[:, ::1], {t}[:, ::1])"),
    ),
    KernelSpec(
        "moe.decode",
        "moe_decode_down_kernel",
        _both("void({t}[:, ::1], {t}[:, :, ::1], int32[:, ::1], float32[:, ::1], {t}[:, ::1])"),
    ),
]

# moe/routing.py: the router's softmax + top-k + normalisation, one warp per token. Arguments:
# logits [T, E], weights [T, k] fp32, ids [T, k] int32, renormalize, round_weights.
KERNELS += [
    KernelSpec(
        "moe.routing",
        "moe_topk_kernel",
        _both("void({t}[:, ::1], float32[:, ::1], int32[:, ::1], boolean, boolean)"),
    ),
]

# moe/grouped.py: grouped expert GEMMs over expert-sorted pairs (moe_routing.moe_align_ref).
# gate_up: x, w13, order [P], expert_start [E + 1], tile_first [E], tile_expert [tiles] (int32),
# top_k, h_sorted [P, I]; down: h_sorted, w2, the same four, topk_weights flat [P] fp32,
# y_pairs [P, H] fp32.
_MOE_META = "int32[::1], int32[::1], int32[::1], int32[::1]"
KERNELS += [
    KernelSpec(
        "moe.grouped",
        "moe_grouped_gate_up_kernel",
        _both(f"void({{t}}[:, ::1], {{t}}[:, :, ::1], {_MOE_META}, int64, {{t}}[:, ::1])"),
    ),
    KernelSpec(
        "moe.grouped",
        "moe_grouped_down_kernel",
        _both(f"void({{t}}[:, ::1], {{t}}[:, :, ::1], {_MOE_META}, float32[::1], float32[:, ::1])"),
    ),
]

# moe/wmma.py (the fp16 default; VOLTSERVE_MOE_WMMA=0 leaves it): the grouped expert GEMMs on
# tensor cores through vs_moe_tile16x64 (linked wmma_ptx.cu), fp16. gate_up: x_sorted and w13
# flattened, expert_start, tile_first, tile_expert, h_sorted [P + 16, I], hidden; down: h_sorted
# and w2 flattened, order, the same three, topk_weights flat, y_pairs [P, H] fp32, intermediate.
KERNELS += [
    KernelSpec(
        "moe.wmma",
        "moe_wmma_gate_up_kernel",
        (
            "void(float16[::1], float16[::1], int32[::1], int32[::1], int32[::1], "
            "float16[:, ::1], int64)",
        ),
    ),
    KernelSpec(
        "moe.wmma",
        "moe_wmma_down_kernel",
        (
            "void(float16[::1], float16[::1], int32[::1], int32[::1], int32[::1], int32[::1], "
            "float32[::1], float32[:, ::1], int64)",
        ),
    ),
]

# linear/quant_gemv.py: fused dequantize-GEMV for group-quantized weights (qgemv_kernel(M, bits,
# split, kind)); representative instances (each is a large generated body, ~30 s to compile: the
# int4 M = 1 kernel in both dtypes, the others in fp16, what decode runs). Arguments: x [M, K],
# qweight int32 [N, K * bits / 32] (pair-interleaved codes, quant_pack.py), scales and offsets
# [N, groups], bias [N] (unused without has_bias), out [M, N] (gate_up: [M, N / 2]), has_bias,
# group_shift.
_QGEMV_SIG = (
    "void({t}[:, :], int32[:, ::1], {t}[:, ::1], {t}[:, ::1], {t}[::1], {t}[:, :], boolean, int64)"
)
KERNELS += [KernelSpec("linear.quant_gemv", "qgemv_int4_m1", _both(_QGEMV_SIG))]
KERNELS += [
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
]

# moe/quant_decode.py: fused MoE experts with group-quantized weights for <= 8 tokens
# (moe_qkernel(kind, bits, split)); representative instances, fp16 (the fp32 int4 pair compiled
# clean too, 126 / 102 registers, no spills). gate_up: x [T, H], qweight int32
# [E * 2I, H * bits / 32] (the stacked experts flattened), scales, offsets [E * 2I, groups],
# topk_ids [T, k] int32, h [T * k, I], group_shift; down: h, qweight [E * H, I * bits / 32],
# scales, offsets, topk_ids, topk_weights [T, k] fp32, out [T, H], group_shift.
_MOEQ_GATE_UP_SIG = (
    "void({t}[:, :], int32[:, ::1], {t}[:, ::1], {t}[:, ::1], int32[:, ::1], {t}[:, ::1], int64)"
)
_MOEQ_DOWN_SIG = (
    "void({t}[:, ::1], int32[:, ::1], {t}[:, ::1], {t}[:, ::1], int32[:, ::1], float32[:, ::1], "
    "{t}[:, ::1], int64)"
)
KERNELS += [
    KernelSpec("moe.quant_decode", name, (sig.format(t="float16"),))
    for name, sig in (
        ("moe_q_gate_up_int4", _MOEQ_GATE_UP_SIG),
        ("moe_q_down_int4", _MOEQ_DOWN_SIG),  # ~60 s to compile (a loop over the k experts)
        ("moe_q_gate_up_int8", _MOEQ_GATE_UP_SIG),
        ("moe_q_down_int8", _MOEQ_DOWN_SIG),
        # the half2 form (fp16 x, int4, groups >= 32: what fp16 AWQ / GPTQ experts run)
        ("moe_q_gate_up_int4_half2", _MOEQ_GATE_UP_SIG),
        ("moe_q_down_int4_half2", _MOEQ_DOWN_SIG),
    )
]

# linear/quant_dequant.py: a group-quantized weight into an [N, K] buffer (the prefill path's
# scratch). Arguments: qweight, scales, offsets, out [N, K], group_shift.
_DEQUANT_SIG = "void(int32[:, ::1], {t}[:, ::1], {t}[:, ::1], {t}[:, ::1], int64)"
KERNELS += [
    KernelSpec("linear.quant_dequant", "dequant_int4_kernel", _both(_DEQUANT_SIG)),
    KernelSpec("linear.quant_dequant", "dequant_int8_kernel", (_DEQUANT_SIG.format(t="float16"),)),
]

# linear/quant_gemm_tc.py: the dequantize-in-shared-memory tensor-core GEMM (wmma inline through
# runtime/wmma_inline.py), per tile config from qgemm_kernel(); representative instances (fp16
# only): the 16-, 32- (int8), 64- and 128-row tiles (4, 8, 8 and 16 warps). Arguments: flat x,
# qweight, scales, offsets, bias, out [T, N], flat fp32 split-K partials, has_bias, group_shift,
# T, K steps per split. Then the split-K reduction: partials, bias, out, has_bias, splits.
_QGEMM_SIG = (
    "void(float16[::1], int32[:, ::1], float16[:, ::1], float16[:, ::1], float16[::1],"
    " float16[:, :], float32[::1], boolean, int64, int64, int64)"
)
KERNELS += [
    KernelSpec("linear.quant_gemm_tc", name, (_QGEMM_SIG,))
    for name in (
        "qgemm_int4_m16",
        "qgemm_int4_m64",
        "qgemm_int8_m32",
        "qgemm_int4_m128",
        "qgemm_int8_m128",
    )
]
KERNELS += [
    KernelSpec(
        "linear.quant_gemm_tc",
        "qgemm_reduce_kernel",
        ("void(float32[::1], float16[::1], float16[:, :], boolean, int64)",),
    ),
]
# The quantized qkv_rope variant (qgemv_kernel(M, bits, kind=QKV_ROPE)): the quant_gemv
# arguments, then positions [M] int64, the fp32 cos/sin cache, the K and V caches, slots [M]
# int64, and the q and kv head counts.
_QKV_ROPE_SIG = (
    "void(float16[:, :], int32[:, ::1], float16[:, ::1], float16[:, ::1], float16[::1],"
    " float16[:, :], boolean, int64, int64[::1], float32[:, ::1], float16[:, :, :, ::1],"
    " float16[:, :, :, ::1], int64[::1], int64, int64)"
)
KERNELS += [
    KernelSpec("linear.quant_gemv", name, (_QKV_ROPE_SIG,))
    for name in (
        "qgemv_qkv_rope_int4_m1",
        "qgemv_qkv_rope_int4_m1_half2",
        "qgemv_qkv_rope_int4_m1_half2_ks4",
    )
]

# linear_attention/: the Gated DeltaNet layers (Qwen3-Next, Qwen3.5 / 3.6). q, k, v, a, b and the
# conv input are views of the fused projections (any layout); A_log and dt_bias fp32 [Hv]; the
# recurrent state pool fp32 [slots, Hv, Dk, Dv]; slots int64 (-1: padding); cu_seqlens int64.
_QKV = "{t}[:, :, :], {t}[:, :, :], {t}[:, :, :], {t}[:, :], {t}[:, :], float32[::1], float32[::1]"
KERNELS += [
    KernelSpec(
        "linear_attention.conv",
        "conv_prefill_kernel",
        _both(
            "void({t}[:, :], {t}[:, ::1], {t}[:, :, ::1], int64[::1], int64[::1], boolean[::1],"
            " {t}[:, ::1])"
        ),
    ),
    KernelSpec(
        "linear_attention.conv",
        "conv_state_kernel",
        _both("void({t}[:, :], {t}[:, :, ::1], int64[::1], int64[::1], boolean[::1])"),
    ),
    KernelSpec(
        "linear_attention.conv",
        "conv_decode_kernel",
        _both("void({t}[:, :], {t}[:, ::1], {t}[:, :, ::1], int64[::1], {t}[:, ::1])"),
    ),
    KernelSpec(
        "linear_attention.recurrent",
        "gdn_decode_kernel",
        _both("void(" + _QKV + ", float32[:, :, :, ::1], int64[::1], {t}[:, :, ::1], float32)"),
    ),
    KernelSpec(
        "linear_attention.chunk",
        "gdn_chunk_prep_kernel",
        _both(
            "void(" + _QKV + ", int64[::1], int64[::1], float32[:, :, ::1], float32[:, :, ::1],"
            " float32[:, :, ::1], float32[:, :, ::1], float32[:, :, ::1], float32[:, ::1],"
            " float32)"
        ),
    ),
    KernelSpec(
        "linear_attention.chunk",
        "gdn_chunk_scan_kernel",
        _both(
            "void(float32[:, :, ::1], float32[:, :, ::1], float32[:, :, ::1], float32[:, :, ::1],"
            " float32[:, :, ::1], float32[:, ::1], int64[::1], int64[::1], boolean[::1],"
            " float32[:, :, :, ::1], {t}[:, :, ::1])"
        ),
    ),
    KernelSpec(
        "linear_attention.gated_norm",
        "gated_rms_norm_kernel",
        _both("void({t}[:, :], {t}[:, :], {t}[::1], {t}[:, ::1], float32)"),
    ),
]
