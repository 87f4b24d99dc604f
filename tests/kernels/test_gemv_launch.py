"""What gemv.launch_gemv (the one launch body of every GEMV launcher) hands the kernel, checked
on the CPU by recording the launch instead of running it: the kernel variant, the grid (one warp
per row, or per row pair), the argument order each kernel's signature expects, and the output
it allocates. The kernels themselves are checked in the simulator and on the GPU."""

from __future__ import annotations

import pytest
import torch
from voltserve.kernels.linear import gemv


@pytest.fixture
def recorded(monkeypatch):
    calls = []
    monkeypatch.setattr(gemv, "current_stream", lambda: "stream")
    monkeypatch.setattr(gemv, "launch", lambda *a: calls.append(a))
    return calls


def test_launch_arguments_per_kind(recorded):
    M, K = 2, 64
    x = torch.randn(M, K)
    w = torch.randn(48, K)
    cases = [
        # (kind, out, extra) -> (out shape, grid rows)
        (gemv.PLAIN, None, (), (M, 48), 48),
        (gemv.GATE_UP, None, (), (M, 24), 24),
        (gemv.QKV_ROPE, None, ("r0", "r1"), (M, 48), 24),
        (gemv.PLAIN, torch.zeros(M, 48), (), (M, 48), 48),
    ]
    for kind, out, extra, shape, units in cases:
        recorded.clear()
        got = gemv.launch_gemv(x, w, None, out, kind, extra)
        assert got.shape == shape and (out is None or got is out)
        ((kernel, grid, block, args, stream),) = recorded
        assert kernel is gemv.gemv_kernel(M, kind)
        assert grid == gemv.grid_for(M, units, kind) and block == gemv.THREADS
        assert args[0] is x and args[1] is w and args[3] is got and args[4] is False
        assert args[2] is not None  # a stand-in row for the missing bias
        assert args[5:] == extra and stream == "stream"
