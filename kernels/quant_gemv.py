"""Fused dequantize-GEMV for group-quantized weights (decode, 1..8 rows). Placeholder: the
kernel lands in the next commit; until then nothing is supported and quant_linear dequantizes."""

from __future__ import annotations


def supports_weight(w, dtype) -> bool:
    return False
