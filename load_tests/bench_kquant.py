"""GGUF K-quant linears on the GPU at the Llama-3-8B shapes: the native kernels that read Q4_K /
Q6_K blocks as stored (kernels/linear/kquant_linear.py: impl `native`), the group-quantized path
the same blocks took before (unpacked into codes + scales, merged shards widened to the largest
code width: impl `widened`, quant_linear's own choice of kernel), and fp16 cuBLAS on the same
shape, each against its bytes floor (the bytes it must read over the copy bandwidth measured in
the same run). Also each native GEMV at every split-K (impl `native_ks{KS}`) and one and four
rows a warp (`native_r{R}`), and the dequantize + cuBLAS path forced (`native_dequant`).

Shapes (Q4_K_M's types): qkv as Q4_K q/k beside a Q6_K v (the layers llama.cpp gives more
bits) and all Q4_K, o Q4_K, gate_up Q4_K, down Q4_K and Q6_K, the lm_head Q6_K (vocabulary
128,256). Every point: CUDA-graph replays over weight copies that together exceed L2, median
of 7 (bench_quant_linear's timing).

    python load_tests/bench_kquant.py --out bench_kquant.json [--rows 1,8]
    (also: python load_tests/bench_quant_linear.py --kquant --out ...)
"""

# Every lambda below is timed (called) before its loop variables change:
# ruff: noqa: B023
from __future__ import annotations

import argparse
from pathlib import Path

import torch

if not __package__:
    import _as_script  # noqa: F401  (load_tests.* importable; see _as_script.py)

from load_tests.bench_quant_linear import copies_for, timed  # noqa: E402
from load_tests.common import env_info, measure_copy_bandwidth, write_json  # noqa: E402
from load_tests.gguf_pack import quantize_k  # noqa: E402

HIDDEN, INTER, VOCAB, HEADS, KV_HEADS, HEAD_DIM = 4096, 14336, 128256, 32, 8, 128
# (name, K, [(rows, ggml type) of each shard in output order])
SHAPES = (
    (
        "qkv_mixed",
        HIDDEN,
        [(HEADS * HEAD_DIM, "Q4_K"), (KV_HEADS * HEAD_DIM, "Q4_K"), (KV_HEADS * HEAD_DIM, "Q6_K")],
    ),
    ("qkv", HIDDEN, [(HEADS * HEAD_DIM, "Q4_K"), (2 * KV_HEADS * HEAD_DIM, "Q4_K")]),
    ("o", HIDDEN, [(HIDDEN, "Q4_K")]),
    ("gate_up", HIDDEN, [(2 * INTER, "Q4_K")]),
    ("down", INTER, [(HIDDEN, "Q4_K")]),
    ("down_q6k", INTER, [(HIDDEN, "Q6_K")]),
    ("lm_head", HIDDEN, [(VOCAB, "Q6_K")]),
)


def make_shards(K: int, shards, gen) -> list[tuple[str, torch.Tensor]]:
    """(type, raw blocks) of each shard, quantized from random weights of a model's scale."""
    out = []
    for n, kind in shards:
        w = torch.randn(n, K, generator=gen, device="cuda") * 0.02
        out.append((kind, quantize_k(w, kind)))
        del w
    return out


def native_weight(K: int, raws):
    from voltserve.kernels.linear.kquant_pack import make_kquant_weight, segments_of

    return segments_of([make_kquant_weight(kind, raw, K) for kind, raw in raws])


def widened_weight(K: int, raws):
    """What the group-quantized path loads the same shards as (quant/group.py)."""
    from voltserve.kernels.linear.gguf_blocks import BLOCK_TYPES, unpack_blocks
    from voltserve.kernels.linear.quant_pack import pack_group_quant
    from voltserve.services.executor.quant.group import ShardCodes, merge_shards

    parts = []
    for kind, raw in raws:
        codes, scales, offsets = unpack_blocks(kind, raw, K)
        bt = BLOCK_TYPES[kind]
        parts.append(ShardCodes(codes, scales, offsets, bt.bits, bt.group))
    m = merge_shards(parts, [k for k, _ in raws])
    return pack_group_quant(m.codes, m.scales, m.offsets, m.bits, m.group_size, torch.float16)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--rows", default="1,8")
    ap.add_argument("--shapes", default=",".join(s[0] for s in SHAPES))
    ap.add_argument("--no-sweep", action="store_true", help="skip the split-K and R variants")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench_kquant.py needs a CUDA device")
    from voltserve.kernels.dispatch import KernelDispatch
    from voltserve.kernels.linear import kquant_gemv
    from voltserve.kernels.linear.kquant_linear import (
        gemv_takes,
        kquant_dequant_linear,
        kquant_gemv_cuda,
    )
    from voltserve.kernels.linear.quant_linear import quant_linear_cuda, reserve_scratch

    ops = KernelDispatch("cuda", torch.float16, force_ref=False)
    reserve_scratch(ops, VOCAB * HIDDEN)
    copy = measure_copy_bandwidth("cuda")
    bw = copy["bandwidth_GBps"] * 1e9
    print(f"copy bandwidth {bw / 1e9:.0f} GB/s", flush=True)
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows_list = [int(r) for r in args.rows.split(",")]
    wanted = set(args.shapes.split(","))
    results: list[dict] = []
    env = env_info("cuda")
    error = None

    def record(**row):
        results.append(row)
        print(
            f"{row['op']:>10} rows {row['rows']:>3} {row['impl']:>16}: {row['time_us']:9.1f} us "
            f"({row['of_floor']:.2f} of its floor, {row['bytes'] / 1e6:.1f} MB)",
            flush=True,
        )

    try:
        for op, K, shards in SHAPES:
            if op not in wanted:
                continue
            N = sum(n for n, _ in shards)
            raws = make_shards(K, shards, gen)
            native_bytes = sum(raw.numel() for _, raw in raws)
            widened = widened_weight(K, raws)
            widened_bytes = widened.nbytes()
            n_native = copies_for(native_bytes)
            natives = [native_weight(K, [(k, r.clone()) for k, r in raws]) for _ in range(n_native)]
            wideneds = [widened] + [
                widened_weight(K, raws) for _ in range(copies_for(widened_bytes) - 1)
            ]
            del raws
            w16 = [
                torch.randn(N, K, generator=gen, device="cuda", dtype=torch.float16) * 0.02
                for _ in range(copies_for(N * K * 2))
            ]
            for rows in rows_list:
                x = torch.randn(rows, K, generator=gen, device="cuda", dtype=torch.float16)
                out = torch.empty(rows, N, device="cuda", dtype=torch.float16)
                base = dict(
                    op=op, in_features=K, out_features=N, rows=rows, types=[k for _, k in shards]
                )

                def rec(impl, t, nbytes):
                    record(
                        **base, impl=impl, time_us=t * 1e6, bytes=nbytes, of_floor=nbytes / bw / t
                    )

                rec("fp16_cublas", timed(lambda w: torch.matmul(x, w.t(), out=out), w16), N * K * 2)
                rec(
                    "widened",
                    timed(lambda w: quant_linear_cuda(x, w, None, None, ops), wideneds),
                    widened_bytes,
                )
                if gemv_takes(x, natives[0]):
                    rec("native", timed(lambda s: kquant_gemv_cuda(x, s), natives), native_bytes)
                    if not args.no_sweep:
                        for R, KS in [(2, ks) for ks in kquant_gemv.KS_CHOICES] + [(1, 1), (4, 1)]:
                            name = f"native_r{R}_ks{KS}"
                            rec(
                                name,
                                timed(lambda s: kquant_gemv_cuda(x, s, tile=(R, KS)), natives),
                                native_bytes,
                            )
                times = {
                    r["impl"]: r["time_us"] for r in results if r["op"] == op and r["rows"] == rows
                }
                if "native" in times:
                    print(
                        f"{op:>10} rows {rows:>3}: native {times['widened'] / times['native']:.2f}x widened, {times['fp16_cublas'] / times['native']:.2f}x fp16",
                        flush=True,
                    )
                rec(
                    "native_dequant",
                    timed(lambda s: kquant_dequant_linear(x, s, None, ops), natives),
                    native_bytes,
                )
            del natives, wideneds, w16, widened
            torch.cuda.empty_cache()
    except Exception as e:  # keep what was measured
        error = f"{type(e).__name__}: {e}"
        print(f"error: {error}", flush=True)
    write_json(args.out, {"env": env, "copy": copy, "results": results, "error": error})
    if error:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
