"""Quantization methods per linear (see base.py for the seam)."""

from voltserve.services.executor.quant.base import (
    UNQUANTIZED,
    LinearMethod,
    QuantConfig,
    QuantFormatError,
    UnquantizedMethod,
)

__all__ = ["UNQUANTIZED", "LinearMethod", "QuantConfig", "QuantFormatError", "UnquantizedMethod"]
