"""Achieved memory bandwidth of the elementwise kernels (rms_norm, fused_add_rms_norm,
silu_and_mul) against a device-to-device copy measured in the same run.

Bandwidth = bytes read + bytes written once each, over the median time of many CUDA-event-timed
launches after a warm-up. Run on a GPU host:

    .venv/bin/python load_tests/bench_kernels_elementwise.py --out results/elementwise.json
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections.abc import Callable

import torch


def time_ms(fn: Callable[[], object], warmup: int, iters: int) -> float:
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True, help="JSON result path")
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--intermediate", type=int, default=14336)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--iters", type=int, default=100)
    args = ap.parse_args(argv)

    from voltserve.kernels.activation import silu_and_mul_cuda
    from voltserve.kernels.rmsnorm import fused_add_rms_norm_cuda, rms_norm_cuda

    dt, T, H, inter = torch.float16, args.tokens, args.hidden, args.intermediate
    es = torch.finfo(dt).bits // 8
    x = torch.randn(T, H, device="cuda", dtype=dt)
    res = torch.randn(T, H, device="cuda", dtype=dt)
    w = torch.randn(H, device="cuda", dtype=dt)
    out = torch.empty_like(x)
    gate_up = torch.randn(T, 2 * inter, device="cuda", dtype=dt)
    act = torch.empty(T, inter, device="cuda", dtype=dt)
    src = torch.empty(T * 2 * inter, device="cuda", dtype=dt)
    dst = torch.empty_like(src)

    cases = {
        "copy_d2d": (lambda: dst.copy_(src), 2 * src.numel() * es),
        "rms_norm": (lambda: rms_norm_cuda(x, w, 1e-6, out=out), 2 * T * H * es + H * es),
        # reads x and residual, writes residual and x
        "fused_add_rms_norm": (
            lambda: fused_add_rms_norm_cuda(x, res, w, 1e-6),
            4 * T * H * es + H * es,
        ),
        "silu_and_mul": (lambda: silu_and_mul_cuda(gate_up, out=act), 3 * T * inter * es),
    }
    results = {}
    for name, (fn, nbytes) in cases.items():
        ms = time_ms(fn, args.warmup, args.iters)
        results[name] = {"median_ms": ms, "bytes": nbytes, "gb_per_s": nbytes / ms / 1e6}
    copy_bw = results["copy_d2d"]["gb_per_s"]
    for r in results.values():
        r["fraction_of_copy"] = r["gb_per_s"] / copy_bw
    report = {
        "device": torch.cuda.get_device_name(),
        "dtype": "float16",
        "tokens": T,
        "hidden": H,
        "intermediate": inter,
        "iters": args.iters,
        "results": results,
    }
    with open(args.out, "w") as f:
        json.dump(report, f, indent=2)
    for name, r in results.items():
        print(
            f"{name:<20} {r['median_ms']:8.3f} ms {r['gb_per_s']:8.1f} GB/s "
            f"{100 * r['fraction_of_copy']:5.1f}% of copy"
        )


if __name__ == "__main__":
    main()
