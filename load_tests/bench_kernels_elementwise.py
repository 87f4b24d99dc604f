"""Achieved memory bandwidth of the elementwise kernels (rms_norm, fused_add_rms_norm,
silu_and_mul) against a device-to-device copy measured in the same run, plus their per-call
latency at decode batch sizes.

How it measures, and why:
- Copy bandwidth comes from load_tests/common.py's measure_copy_bandwidth (a 4 GiB buffer: far
  beyond the L2, so it is HBM that is measured).
- A numba launch costs ~34-78 us of CPU, more than these kernels take on the GPU. Events around
  one eager call would time the CPU, so each kernel is captured N times into a CUDA graph (as the
  engine runs it at decode) and the graph is replayed: time per call = replay time / N.
- Consecutive calls rotate over several input/output sets whose total is at least ROTATE_BYTES
  (several times the L2), so a call never finds its inputs left in L2 by the previous one.
- Bandwidth = bytes read + bytes written once each, over the median time per call.

Run on a GPU host:

    .venv/bin/python load_tests/bench_kernels_elementwise.py --out results/elementwise.json
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections.abc import Callable
from pathlib import Path

import torch

if not __package__:
    import _as_script  # noqa: F401  (load_tests.* importable; see _as_script.py)
from load_tests.common import event_time_ms, measure_copy_bandwidth  # noqa: E402

ROTATE_BYTES = 512 << 20  # per rotation: > 8x the H100/H200 L2 (50-60 MB)


def graph_time_ms(fns: list[Callable[[], object]], calls: int, replays: int) -> float:
    """Median GPU time of one call, from a CUDA graph of `calls` launches cycling over fns."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for fn in fns:  # compile and warm up outside the capture
            fn()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(calls):
            fns[i % len(fns)]()
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / calls)
    del graph
    return statistics.median(times)


def make_cases(T: int, H: int, inter: int, dt: torch.dtype, rotate: bool):
    """name -> (list of closures over distinct buffer sets, bytes moved by one call)."""
    from voltserve.kernels.elementwise.activation import silu_and_mul_cuda
    from voltserve.kernels.elementwise.rmsnorm import fused_add_rms_norm_cuda, rms_norm_cuda

    es = torch.finfo(dt).bits // 8
    dev = "cuda"
    w = (1 + 0.1 * torch.randn(H, device=dev)).to(dt)

    def copies(nbytes: int) -> int:
        return max(1, -(-ROTATE_BYTES // nbytes)) if rotate else 1

    cases = {}
    nb = 2 * T * H * es + H * es
    fns = []
    for _ in range(copies(nb)):
        x = torch.randn(T, H, device=dev, dtype=dt)
        out = torch.empty_like(x)
        fns.append(lambda x=x, out=out: rms_norm_cuda(x, w, 1e-6, out=out))
    cases["rms_norm"] = (fns, nb)

    nb = 4 * T * H * es + H * es  # reads x and residual, writes residual and x
    fns = []
    for _ in range(copies(nb)):
        x = torch.randn(T, H, device=dev, dtype=dt)
        res = torch.randn(T, H, device=dev, dtype=dt)
        fns.append(lambda x=x, res=res: fused_add_rms_norm_cuda(x, res, w, 1e-6))
    cases["fused_add_rms_norm"] = (fns, nb)

    nb = 3 * T * inter * es
    fns = []
    for _ in range(copies(nb)):
        gate_up = torch.randn(T, 2 * inter, device=dev, dtype=dt)
        act = torch.empty(T, inter, device=dev, dtype=dt)
        fns.append(lambda g=gate_up, a=act: silu_and_mul_cuda(g, out=a))
    cases["silu_and_mul"] = (fns, nb)
    return cases


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True, help="JSON result path")
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--intermediate", type=int, default=14336)
    ap.add_argument("--calls", type=int, default=64, help="launches captured per graph")
    ap.add_argument("--iters", type=int, default=50, help="graph replays timed (median)")
    ap.add_argument(
        "--decode-rows", default="1,16,256", help="row counts for the latency table (comma list)"
    )
    args = ap.parse_args(argv)

    dt, T, H, inter = torch.float16, args.tokens, args.hidden, args.intermediate
    copy = measure_copy_bandwidth("cuda")
    copy_bw = copy["bandwidth_GBps"]

    results = {}
    for name, (fns, nbytes) in make_cases(T, H, inter, dt, rotate=True).items():
        ms = graph_time_ms(fns, args.calls, args.iters)
        gbps = nbytes / ms / 1e6
        results[name] = {
            "median_ms": ms,
            "bytes": nbytes,
            "buffer_sets": len(fns),
            "gb_per_s": gbps,
            "fraction_of_copy": gbps / copy_bw,
            "eager_single_call_ms": event_time_ms(fns[0], warmup=1),
        }
        del fns
        torch.cuda.empty_cache()

    decode = {}
    for rows in (int(r) for r in args.decode_rows.split(",") if r):
        for name, (fns, _) in make_cases(rows, H, inter, dt, rotate=False).items():
            decode.setdefault(name, {})[str(rows)] = {
                "us_per_call": 1e3 * graph_time_ms(fns, 4 * args.calls, args.iters)
            }

    report = {
        "device": torch.cuda.get_device_name(),
        "dtype": "float16",
        "tokens": T,
        "hidden": H,
        "intermediate": inter,
        "method": f"CUDA graph of {args.calls} launches, median of {args.iters} replays",
        "copy": copy,
        "results": results,
        "decode_latency": decode,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=2)
    print(f"copy_d2d  {copy_bw:8.1f} GB/s ({copy['buffer_bytes'] >> 20} MiB buffer)")
    for name, r in results.items():
        print(
            f"{name:<20} {r['median_ms']:8.3f} ms {r['gb_per_s']:8.1f} GB/s "
            f"{100 * r['fraction_of_copy']:5.1f}% of copy  (eager single call "
            f"{r['eager_single_call_ms']:.3f} ms)"
        )
    for name, per in decode.items():
        cells = "  ".join(f"{rows} rows {v['us_per_call']:6.2f} us" for rows, v in per.items())
        print(f"{name:<20} {cells}")


if __name__ == "__main__":
    main()
