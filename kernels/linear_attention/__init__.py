"""Kernels of the Gated DeltaNet (linear attention) layers of Qwen3-Next and Qwen3.5 / 3.6.

One such layer, per token: a fused projection gives q and k (linear_num_key_heads x key dim),
v and z (linear_num_value_heads x value dim), and a, b (one each per value head). q, k and v go
through a causal depthwise conv1d (kernel 4) with SiLU; then, per value head with state S
[Dk, Dv] and decay g = -exp(A_log) * softplus(a + dt_bias), beta = sigmoid(b), and q, k
L2-normalised (q also scaled by 1/sqrt(Dk)):

    S <- exp(g) * S;  S <- S + k (beta * (v - S^T k))^T;  o = S^T q

Value heads outnumber key heads in the larger models (48 / 16, 32 / 16): value head h reads key
head h // (Hv // Hk). The output then goes through a gated RMSNorm, norm(o) * weight * silu(z).

Files: conv.py (the conv over a packed prefill batch and its one-token decode update),
recurrent.py (decode: one token a request), chunk.py (prefill, 64-token chunks), verify.py (a
speculative verify step's rows in order, with the state after each kept), gating.py (g and
beta, fused into the recurrences), gated_norm.py (the gated RMSNorm). Each op has a torch
reference `<op>_ref` and a launcher `<op>_cuda` of the same signature (kernels/dispatch.py).

State. A request's states live in two pools indexed by its slot (a state cache owns them):
the recurrent state pool [num_slots, Hv, Dk, Dv] and the conv state pool [num_slots, conv_dim,
kernel - 1] (the last kernel - 1 inputs of the conv, oldest first). The kernels read and write a
request's rows in place; slot -1 marks a padding row (CUDA-graph decode pads the batch), which
is skipped: its state is untouched and its output is zeros.

Why the recurrent state is fp32 while everything else is fp16: the state is a running sum over
the whole context. Each step multiplies it by exp(g) (close to 1 for slow-decaying heads) and
adds a rank-one correction that is often small against it; in fp16 (11-bit mantissa) such
updates are rounded away after a few hundred tokens and the error compounds over thousands, so
the state drifts from the one the model was trained with (the reference implementations keep
it in fp32 too). It is also what the delta rule subtracts from (v - S^T k): a rounding error in S
becomes an error in every later write. At decode the state is the dominant memory traffic
(64 KiB a head), so fp32 doubles the bytes of that step; the conv state is a copy of recent fp16
inputs and stays in the storage dtype, exactly.
"""

from voltserve.kernels.registry import KernelSpec, Op, both

# States in slot-indexed pools (above). Launchers take fp16 and fp32 storage (the default).
OPS = (
    Op(
        "causal_conv1d_prefill",
        "linear_attention.conv.causal_conv1d_prefill_ref",
        ("linear_attention.conv",),
    ),
    Op(
        "causal_conv1d_decode",
        "linear_attention.conv.causal_conv1d_decode_ref",
        ("linear_attention.conv",),
    ),
    Op(
        "gated_delta_rule_prefill",
        "linear_attention.chunk.gated_delta_rule_prefill_ref",
        ("linear_attention.chunk",),
    ),
    Op(
        "gated_delta_rule_decode",
        "linear_attention.recurrent.gated_delta_rule_decode_ref",
        ("linear_attention.recurrent",),
    ),
    Op(
        "causal_conv1d_verify",
        "linear_attention.verify.causal_conv1d_verify_ref",
        ("linear_attention.verify",),
    ),
    Op(
        "gated_delta_rule_verify",
        "linear_attention.verify.gated_delta_rule_verify_ref",
        ("linear_attention.verify",),
    ),
    Op(
        "gated_rms_norm",
        "linear_attention.gated_norm.gated_rms_norm_ref",
        ("linear_attention.gated_norm",),
    ),
)

# q, k, v, a, b and the conv input are views of the fused projections (any layout); A_log and
# dt_bias fp32 [Hv]; the recurrent state pool fp32 [slots, Hv, Dk, Dv]; slots int64 (-1:
# padding); cu_seqlens int64.
_QKV = "{t}[:, :, :], {t}[:, :, :], {t}[:, :, :], {t}[:, :], {t}[:, :], float32[::1], float32[::1]"
KERNELS = (
    KernelSpec(
        "linear_attention.conv",
        "conv_prefill_kernel",
        both(
            "void({t}[:, :], {t}[:, ::1], {t}[:, :, ::1], int64[::1], int64[::1], boolean[::1],"
            " {t}[:, ::1])"
        ),
    ),
    KernelSpec(
        "linear_attention.conv",
        "conv_state_kernel",
        both("void({t}[:, :], {t}[:, :, ::1], int64[::1], int64[::1], boolean[::1])"),
    ),
    KernelSpec(
        "linear_attention.conv",
        "conv_decode_kernel",
        both("void({t}[:, :], {t}[:, ::1], {t}[:, :, ::1], int64[::1], {t}[:, ::1])"),
    ),
    KernelSpec(
        "linear_attention.recurrent",
        "gdn_decode_kernel",
        both("void(" + _QKV + ", float32[:, :, :, ::1], int64[::1], {t}[:, :, ::1], float32)"),
    ),
    KernelSpec(
        "linear_attention.verify",
        "conv_verify_kernel",
        both(
            "void({t}[:, :], {t}[:, ::1], {t}[:, :, ::1], int64[:, ::1], int64[:, :], {t}[:, ::1])"
        ),
    ),
    KernelSpec(
        "linear_attention.verify",
        "gdn_verify_kernel",
        both(
            "void(" + _QKV + ", float32[:, ::1], int64[:, ::1], int64[:, :], {t}[:, :, ::1],"
            " float32)"
        ),
    ),
    KernelSpec(
        "linear_attention.chunk",
        "gdn_chunk_prep_kernel",
        both(
            "void(" + _QKV + ", int64[::1], int64[::1], float32[:, :, ::1], float32[:, :, ::1],"
            " float32[:, :, ::1], float32[:, :, ::1], float32[:, :, ::1], float32[:, ::1],"
            " float32)"
        ),
    ),
    KernelSpec(
        "linear_attention.chunk",
        "gdn_chunk_scan_kernel",
        both(
            "void(float32[:, :, ::1], float32[:, :, ::1], float32[:, :, ::1], float32[:, :, ::1],"
            " float32[:, :, ::1], float32[:, ::1], int64[::1], int64[::1], boolean[::1],"
            " float32[:, :, :, ::1], {t}[:, :, ::1])"
        ),
    ),
    KernelSpec(
        "linear_attention.gated_norm",
        "gated_rms_norm_kernel",
        both("void({t}[:, :], {t}[:, :], {t}[::1], {t}[:, ::1], float32)"),
    ),
)
