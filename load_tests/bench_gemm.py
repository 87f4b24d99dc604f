"""cuBLAS on the model's linear layers: time per call, TFLOP/s and GB/s of weights read.

The decode step at batch 64-256 and every prefill chunk spend most of their time in the five
linear layers (torch matrix products, cuBLAS). This times each Llama-3-8B shape at the batch
sizes the engine runs (decode rows; a prefill chunk's tokens) with each BLAS back end torch
offers, so a step profile's linear time can be read against what the library does alone, and
the serving bound in BENCHMARKS.md against a measured tensor-core rate rather than the data
sheet's. Weights rotate over copies larger than L2 together; each point is CUDA-graph replays
timed with events (median).

    python load_tests/bench_gemm.py --out bench_gemm.json [--rows 64,256,8192]
"""

from __future__ import annotations

import argparse
import itertools
from pathlib import Path

import torch

if not __package__:
    import _as_script  # noqa: F401  (load_tests.* importable; see _as_script.py)

from load_tests.bench_attention import time_graph  # noqa: E402
from load_tests.common import env_info, measure_copy_bandwidth, write_json  # noqa: E402

# (name, out_features, in_features) of Llama-3-8B (qkv and gate_up fused as the engine runs them).
SHAPES = (
    ("qkv_proj", 6144, 4096),
    ("o_proj", 4096, 4096),
    ("gate_up_proj", 28672, 4096),
    ("down_proj", 4096, 14336),
    ("lm_head", 128256, 4096),
)
L2_BYTES = 64 << 20


def time_linear(rows: int, n: int, k: int, swapped: bool = False) -> float:
    """Median seconds of one x [rows, k] @ w.T (w [n, k], as the model's linears) in fp16.
    swapped: the same product as w @ x.T into a [n, rows] output (y transposed), which hands
    cuBLAS the problem with M and N exchanged: its kernel choice for a short M (decode rows)
    and a long N may differ from the one for a long M and a short N."""
    copies = max(1, min(8, -(-2 * L2_BYTES // (n * k * 2))))
    weights = itertools.cycle(
        [torch.randn(n, k, device="cuda", dtype=torch.float16) for _ in range(copies)]
    )
    x = torch.randn(rows, k, device="cuda", dtype=torch.float16)
    out = torch.empty((n, rows) if swapped else (rows, n), device="cuda", dtype=torch.float16)

    def call():
        if swapped:
            torch.matmul(next(weights), x.t(), out=out)
        else:
            torch.matmul(x, next(weights).t(), out=out)

    # Four rounds of the copies per replay, one for the largest products (tens of ms each).
    iters = copies * (4 if rows * n * k < 2**34 else 1)
    return time_graph(call, iters=iters, repeats=7)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--rows", default="64,256,8192")
    ap.add_argument("--backends", default="cublas,cublaslt")
    ap.add_argument(
        "--swapped-rows",
        default="256",
        help="row counts also timed as w @ x.T (M and N exchanged); empty: none",
    )
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench_gemm.py needs a CUDA device")
    rows_list = [int(r) for r in args.rows.split(",")]
    swapped_rows = {int(r) for r in args.swapped_rows.split(",") if r.strip()}
    copy = measure_copy_bandwidth("cuda")
    bw = copy["bandwidth_GBps"]
    results = []
    for backend in args.backends.split(","):
        torch.backends.cuda.preferred_blas_library(backend)
        for rows, swapped in [(r, False) for r in rows_list] + [
            (r, True) for r in sorted(swapped_rows)
        ]:
            for name, n, k in SHAPES:
                t = time_linear(rows, n, k, swapped)
                flops = 2 * rows * n * k
                row = dict(
                    backend=backend,
                    swapped=swapped,
                    op=name,
                    rows=rows,
                    out_features=n,
                    in_features=k,
                    time_us=t * 1e6,
                    tflops=flops / t / 1e12,
                    weight_GBps=n * k * 2 / t / 1e9,
                    weight_read_of_copy=n * k * 2 / t / 1e9 / bw,
                )
                results.append(row)
                print(
                    f"{backend:>8} rows {rows:>5}{' swapped' if swapped else ''} "
                    f"{name:>13}: {row['time_us']:8.1f} us "
                    f"{row['tflops']:6.1f} TFLOP/s {row['weight_GBps']:7.0f} GB/s "
                    f"({row['weight_read_of_copy']:.2f} of copy)",
                    flush=True,
                )
    torch.backends.cuda.preferred_blas_library("cublas")
    per_layer = {}
    for r in results:
        key = f"{r['backend']} rows {r['rows']}{' swapped' if r['swapped'] else ''}"
        if r["op"] != "lm_head":
            per_layer[key] = per_layer.get(key, 0.0) + r["time_us"]
    write_json(
        args.out,
        dict(
            benchmark="gemm",
            env=env_info("cuda"),
            copy_bandwidth=copy,
            results=results,
            layer_linears_us=per_layer,
        ),
    )


if __name__ == "__main__":
    main()
