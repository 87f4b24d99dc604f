"""The stand-in for KernelDispatch that the quantized-linear GPU tests hand the launchers."""

from __future__ import annotations

import torch


class Ops:
    """The parts of the KernelDispatch the quantized linears (fp4_linear, kquant_linear) read:
    the switch, the scratch (set on the instance by the dequantize path), the device and dtype
    of the dequantize path's scratch, and silu_and_mul."""

    impl = {"quant_linear": "cuda"}
    device = torch.device("cuda")
    dtype = torch.float16
    quant_scratch = None

    @staticmethod
    def silu_and_mul(y):
        from voltserve.kernels.elementwise.activation import silu_and_mul_ref

        return silu_and_mul_ref(y)
