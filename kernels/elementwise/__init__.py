"""Row-wise kernels: RMSNorm (plain and fused with the residual add) and silu_and_mul."""

from voltserve.kernels.registry import KernelSpec, Op, both

OPS = (
    Op(
        "rms_norm",
        "elementwise.rmsnorm.rms_norm_ref",
        ("elementwise.rmsnorm",),
        capturable_ref=True,
        decode_graph=True,
    ),
    Op(
        "fused_add_rms_norm",
        "elementwise.rmsnorm.fused_add_rms_norm_ref",
        ("elementwise.rmsnorm",),
        capturable_ref=True,
        decode_graph=True,
    ),
    Op(
        "silu_and_mul",
        "elementwise.activation.silu_and_mul_ref",
        ("elementwise.activation",),
        capturable_ref=True,
        decode_graph=True,
    ),
)

KERNELS = (
    # rmsnorm.py
    KernelSpec(
        "elementwise.rmsnorm",
        "rms_norm_kernel",
        both("void({t}[:, ::1], {t}[::1], {t}[:, ::1], float32, boolean)"),
    ),
    KernelSpec(
        "elementwise.rmsnorm",
        "fused_add_rms_norm_kernel",
        both("void({t}[:, ::1], {t}[:, ::1], {t}[::1], float32, boolean)"),
    ),
    KernelSpec(
        "elementwise.rmsnorm",
        "rms_norm_1c_kernel",
        both("void({t}[:, ::1], {t}[::1], {t}[:, ::1], float32)"),
    ),
    KernelSpec(
        "elementwise.rmsnorm",
        "fused_add_rms_norm_1c_kernel",
        both("void({t}[:, ::1], {t}[:, ::1], {t}[::1], float32)"),
    ),
    # activation.py
    KernelSpec(
        "elementwise.activation",
        "silu_and_mul_kernel",
        both("void({t}[:, ::1], {t}[:, ::1], boolean)"),
    ),
)
