"""Mixture-of-experts: routing, the fused decode experts (fp16, group-quantized and FP4), the
grouped GEMMs on CUDA cores and on tensor cores, and the experts op that picks among them."""

from voltserve.kernels.registry import KernelSpec, Op, both

OPS = (
    # The router's top-k (torch on the device, capturable) and the routed experts (fused decode
    # kernels for <= 8 tokens, grouped GEMMs beyond).
    Op(
        "moe_topk",
        "moe.routing.moe_topk_ref",
        ("moe.routing",),
        env="VOLTSERVE_MOE_TOPK",
        capturable_ref=True,
    ),
    Op("moe_experts", "moe.experts.moe_experts_ref", ("moe.experts",)),
)

KERNELS = (
    # decode.py: fused MoE experts for <= 8 tokens. gate_up: x [T, H], w13 [E, 2I, H], topk_ids
    # [T, k] int32, h [T * k, I]; down: h, w2 [E, H, I], topk_ids, topk_weights [T, k] fp32, out
    # [T, H].
    KernelSpec(
        "moe.decode",
        "moe_decode_gate_up_kernel",
        both("void({t}[:, ::1], {t}[:, :, ::1], int32[:, ::1], {t}[:, ::1])"),
    ),
    KernelSpec(
        "moe.decode",
        "moe_decode_down_kernel",
        both("void({t}[:, ::1], {t}[:, :, ::1], int32[:, ::1], float32[:, ::1], {t}[:, ::1])"),
    ),
    # routing.py: the router's softmax + top-k + normalisation, one warp per token. Arguments:
    # logits [T, E], weights [T, k] fp32, ids [T, k] int32, renormalize, round_weights.
    KernelSpec(
        "moe.routing",
        "moe_topk_kernel",
        both("void({t}[:, ::1], float32[:, ::1], int32[:, ::1], boolean, boolean)"),
    ),
)

# grouped.py: grouped expert GEMMs over expert-sorted pairs (routing.moe_align_ref). gate_up: x,
# w13, order [P], expert_start [E + 1], tile_first [E], tile_expert [tiles] (int32), top_k,
# h_sorted [P, I]; down: h_sorted, w2, the same four, topk_weights flat [P] fp32, y_pairs [P, H]
# fp32.
_MOE_META = "int32[::1], int32[::1], int32[::1], int32[::1]"
KERNELS += (
    KernelSpec(
        "moe.grouped",
        "moe_grouped_gate_up_kernel",
        both(f"void({{t}}[:, ::1], {{t}}[:, :, ::1], {_MOE_META}, int64, {{t}}[:, ::1])"),
    ),
    KernelSpec(
        "moe.grouped",
        "moe_grouped_down_kernel",
        both(f"void({{t}}[:, ::1], {{t}}[:, :, ::1], {_MOE_META}, float32[::1], float32[:, ::1])"),
    ),
)

# wmma.py (the fp16 default; VOLTSERVE_MOE_WMMA=0 leaves it): the grouped expert GEMMs on tensor
# cores through vs_moe_tile16x64 (linked wmma_ptx.cu), fp16. gate_up: x_sorted and w13
# flattened, expert_start, tile_first, tile_expert, h_sorted [P + 16, I], hidden; down: h_sorted
# and w2 flattened, order, the same three, topk_weights flat, y_pairs [P, H] fp32, intermediate.
KERNELS += (
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
)

# quant_decode.py: fused MoE experts with group-quantized weights for <= 8 tokens
# (moe_qkernel(kind, bits, split)); representative instances, fp16. gate_up: x [T, H], qweight
# int32 [E * 2I, H * bits / 32] (the stacked experts flattened), scales, offsets
# [E * 2I, groups], topk_ids [T, k] int32, h [T * k, I], group_shift; down: h, qweight
# [E * H, I * bits / 32], scales, offsets, topk_ids, topk_weights [T, k] fp32, out [T, H],
# group_shift.
_MOEQ_GATE_UP_SIG = (
    "void({t}[:, :], int32[:, ::1], {t}[:, ::1], {t}[:, ::1], int32[:, ::1], {t}[:, ::1], int64)"
)
_MOEQ_DOWN_SIG = (
    "void({t}[:, ::1], int32[:, ::1], {t}[:, ::1], {t}[:, ::1], int32[:, ::1], float32[:, ::1], "
    "{t}[:, ::1], int64)"
)
KERNELS += tuple(
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
)

# fp4_decode.py: fused MoE experts with FP4 weights (NVFP4, MXFP4) for decode batches, fp16
# (what decode runs). gate_up: x [T, H], the stacked experts flattened as code words int32
# [E * 2I, H / 8], scale bytes uint8 [E * 2I, H / g], global scales fp32 [E * 2I], topk_ids [T, k]
# int32, h [T * k, I], group_shift, e8m0; down: h, code words [E * H, I / 8], scale bytes, global
# scales, topk_ids, topk_weights [T, k] fp32, out [T, H], group_shift, e8m0.
_FP4_W = "int32[:, ::1], uint8[:, ::1], float32[::1], int32[:, ::1]"
KERNELS += (
    KernelSpec(
        "moe.fp4_decode",
        "fp4_moe_gate_up_kernel",
        (f"void(float16[:, :], {_FP4_W}, float16[:, ::1], int64, boolean)",),
    ),
    KernelSpec(
        "moe.fp4_decode",
        "fp4_moe_down_kernel",
        (f"void(float16[:, ::1], {_FP4_W}, float32[:, ::1], float16[:, ::1], int64, boolean)",),
    ),
)
