"""Sampling: penalties, the seeded sampling rule, and the structured-output token mask."""

from voltserve.kernels.registry import KernelSpec, Op

# Sampling works on fp32 logits whatever the model's dtype (cuda_dtypes=None); it stays outside
# the decode graphs.
OPS = (
    Op(
        "apply_penalties",
        "sampling.sampling.apply_penalties_ref",
        ("sampling.sampling",),
        cuda_dtypes=None,
    ),
    Op("sample", "sampling.sampling.sample_ref", ("sampling.sampling",), cuda_dtypes=None),
    # Structured outputs: -inf where the grammar's bitmask forbids a token (masked rows only).
    Op(
        "apply_token_bitmask",
        "sampling.grammar_mask.apply_token_bitmask_ref",
        ("sampling.grammar_mask",),
        cuda_dtypes=None,
    ),
)

KERNELS = (
    # sampling.py
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
    # grammar_mask.py
    KernelSpec(
        "sampling.grammar_mask",
        "apply_token_bitmask_kernel",
        ("void(float32[:, ::1], int32[:, ::1], int64[::1])",),
    ),
)
