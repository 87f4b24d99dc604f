"""Row-wise kernels: RMSNorm (plain and fused with the residual add) and silu_and_mul."""
