"""kernels/runtime/fast_launch.py on a real GPU: a kernel launched through numba_common.launch gives
the same result on its first launch (through numba) and on later ones (from the plan), for C and
non-contiguous ('A') tensors and every scalar kind the kernels pass (int, float, bool, numpy
float32 / int32), inside a CUDA graph too. Outputs are poisoned before every launch; the
reference is torch."""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def _kernel():
    from numba import cuda

    @cuda.jit
    def axpy_rows(out, x, y, a, b, flip, c, n):
        # out[i, j] = a * x[i, j] + b * y[i, j] (+ c where flip), for j < n
        i = cuda.blockIdx.x
        for j in range(cuda.threadIdx.x, n, cuda.blockDim.x):
            v = a * x[i, j] + b * float(y[i, j])
            if flip:
                v += c
            out[i, j] = v

    return axpy_rows


def _reference(x, y, a, b, flip, c, n):
    v = a * x[:, :n].float() + b * y[:, :n].float()
    return v + c if flip else v


@pytest.mark.parametrize("strided", [False, True])
def test_plan_launch_equals_numba_launch(strided):
    from voltserve.kernels.runtime.fast_launch import LAUNCHER
    from voltserve.kernels.runtime.numba_common import current_stream, launch

    seed = torch.seed() % 2**31
    print(f"seed {seed}")
    gen = torch.Generator(device="cuda").manual_seed(seed)
    kernel = _kernel()
    rows, cols = 37, 300
    x = torch.randn(rows, cols, generator=gen, device="cuda")
    y_full = torch.randn(rows, 2 * cols, generator=gen, device="cuda").half()
    y = y_full[:, ::2] if strided else y_full[:, :cols].contiguous()  # 'A' or 'C' layout
    out = torch.empty(rows, cols, device="cuda")
    n = 291
    cases = [
        (1.5, 0.25, True, np.float32(3.0)),
        (-2.0, 4.0, False, np.float32(-1.0)),
        (0.5, -1.0, True, np.float32(0.125)),
    ]
    before = len(LAUNCHER.plans)
    for a, b, flip, c in cases:
        out.fill_(float("nan"))
        launch(kernel, rows, 128, (out, x, y, a, b, flip, c, np.int32(n)), current_stream())
        torch.cuda.synchronize()
        ref = _reference(x, y, a, b, flip, float(c), n)
        torch.testing.assert_close(out[:, :n], ref, rtol=1e-5, atol=1e-5)
        assert out[:, n:].isnan().all()  # columns past n untouched
    assert len(LAUNCHER.plans) == before + 1  # one signature, one plan, used twice
    assert list(LAUNCHER.plans.values())[-1] is not None


def test_plan_launch_in_cuda_graph():
    from voltserve.kernels.runtime.numba_common import current_stream, launch

    kernel = _kernel()
    rows, cols = 8, 64
    x = torch.randn(rows, cols, device="cuda")
    y = torch.randn(rows, cols, device="cuda").half()
    out = torch.empty(rows, cols, device="cuda")
    args = (out, x, y, 2.0, 1.0, True, np.float32(1.0), np.int32(cols))
    launch(kernel, rows, 64, args, current_stream())  # numba's launch, then the plan
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        with torch.cuda.graph(graph, stream=stream):
            launch(kernel, rows, 64, args, current_stream())
    torch.cuda.current_stream().wait_stream(stream)
    for _ in range(2):
        x.copy_(torch.randn_like(x))
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        torch.testing.assert_close(out, _reference(x, y, 2.0, 1.0, True, 1.0, cols))
