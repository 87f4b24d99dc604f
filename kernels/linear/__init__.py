"""Linears: the decode gemv kernels (plain, gate_up, fused qkv + rotary) and the group-quantized
ones (packing, gemv, tensor-core GEMM, dequantize, and the op that picks among them)."""
