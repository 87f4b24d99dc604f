"""Quantized linears against fp16 on the GPU: per shape and row count, the time of fp16 cuBLAS
(F.linear), the fp16 GEMV kernel (ops.gemv, rows <= 8) and the int4 / int8 paths of
kernels/linear/quant_linear.py (auto = the path quant_linear picks; gemv / tc / dequant each
forced), with the HBM copy bandwidth measured in the same run and each GEMV's fraction of its
weight-read floor (packed codes + scales + offsets over the copy bandwidth). The FP4 formats
(nvfp4: E4M3 scales per 16 and an fp32 global scale per row; mxfp4: E8M0 scales per 32) time
kernels/linear/fp4_linear.py's paths on the same shapes and rows against the same copy floor
(codes + scale bytes + global scales): auto (fp4_linear: the GEMV up to 8 rows, dequantize +
cuBLAS above) and, for gate_up at decode rows, the GEMV with SiLU fused; the summary puts the
batch-1 step of each format beside int4's, per byte (fraction of floor).

Shapes: Llama-3-8B (qkv 4096->6144, o 4096->4096, gate_up 4096->28672, down 14336->4096) and
Qwen2.5-7B (3584->4608, 3584->3584, 3584->37888, 18944->3584). gate_up is also timed fused with
its SiLU (quant_gate_up_silu vs ops.gemv_gate_up) at decode rows. The summary adds one Llama-3-8B
decoder step's linears (32 layers, gate_up fused where the path fuses, the fp16 lm_head via
cuBLAS or GEMV, whichever is faster) per row count: int4 vs fp16 time and the batch-1 ratio of
tokens/s of the linears alone (an upper bound on the end-to-end ratio, which adds attention,
norms and sampling).

Every point: CUDA-graph replays of the call over weight copies that together exceed L2 (so each
call streams from HBM), timed with events, median of 7.

    python load_tests/bench_quant_linear.py --out bench_quant_linear.json [--rows 1,8,64,256,8192]
        [--models llama,qwen] [--tiles]   (--tiles: GEMV tile sweep at 1 and 2 rows: (R, U) and
                        split-K (R, U, KS) for R in 2, 4, U in 1, 2, KS in 1, 2, 4,
                        quant_gemv.tiling: impl *_gemv_R{R}U{U}[KS{KS}]; gate_up also fused,
                        *_gate_up_R{R}U{U}[KS{KS}])
        [--forms half2,factored,weight]   (also each named GEMV dot-product form forced at
                        rows 1..8, quant_gemv.form_for: impl *_{form}_gemv and
                        *_{form}_gate_up; with --tiles its tile sweep at 1 row; half2 is the
                        int4 default at 1-2 fp16 rows and falls back to factored for int8)
        [--factored]   (the same as --forms factored)
        [--tc-configs]   (also quant_gemm_tc.CANDIDATES forced at rows above 8: impl
                        *_tc_<TileConfig.name>)
        [--formats int4_g128,int8_g32,nvfp4,mxfp4]   (the default; FP4 with --tiles: the
                        same tile sweep of fp4_kernels.tiling at 1 and 2 rows, impl
                        {fmt}_gemv_R{R}U{U}[KS{KS}] and {fmt}_gate_up_R{R}U{U}[KS{KS}])
        [--fp4-v1]   (also the one-row-a-warp FP4 GEMV, fp4_kernels.fp4_gemv_v1_kernel, at
                        rows <= 8: impl {fmt}_v1_gemv and {fmt}_v1_gate_up)
        [--fp4-forms half2,table]   (also each named FP4 GEMV dot-product form forced at rows
                        <= 8, fp4_kernels.form_for: impl {fmt}_{form}_gemv and
                        {fmt}_{form}_gate_up; the summary's batch-1 step per form, per byte
                        against int4; half2 is the default for fp16 x)
    python load_tests/bench_quant_linear.py --kquant --out F.json [--rows 1,8]
                        (GGUF Q4_K / Q6_K blocks read natively vs the widened path vs fp16:
                        load_tests/bench_kquant.py)
"""

# Every lambda below is timed (called) before its loop variables change:
# ruff: noqa: B023
from __future__ import annotations

import argparse
import itertools
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

if not __package__:
    import _as_script  # noqa: F401  (load_tests.* importable; see _as_script.py)

from voltserve.kernels.linear.fp4_pack import E4M3, E8M0  # noqa: E402

from load_tests.bench_attention import time_graph  # noqa: E402
from load_tests.common import env_info, measure_copy_bandwidth, write_json  # noqa: E402

MODELS = {
    "llama": (
        ("qkv", 4096, 6144),
        ("o", 4096, 4096),
        ("gate_up", 4096, 28672),
        ("down", 14336, 4096),
    ),
    "qwen": (
        ("qkv", 3584, 4608),
        ("o", 3584, 3584),
        ("gate_up", 3584, 37888),
        ("down", 18944, 3584),
    ),
}
LLAMA_LAYERS, LLAMA_VOCAB = 32, 128256
L2_BYTES = 64 << 20
FORMATS = {"int4_g128": (4, 128), "int8_g32": (8, 32)}
FP4_FORMATS = {"nvfp4": (16, E4M3), "mxfp4": (32, E8M0)}  # (block, scale kind)
# --tiles at 1 and 2 rows (quant_gemv.tiling): (R, U) at KS = 1, then split-K, KS warps of a block on
# the same rows, each a 1/KS share of K (the int4 one-row default is (4, 1, 2): SPLIT_K_M1).
TILES = ((1, 2), (1, 4), (1, 8), (2, 4)) + tuple(
    (R, U, KS) for R in (2, 4) for U in (1, 2) for KS in (1, 2, 4)
)
GATE_UP_TILES = tuple((R, U, KS) for R, U in ((4, 1), (2, 2)) for KS in (1, 2, 4))


def tile_name(tile) -> str:
    """R4U2 for (4, 2) and (4, 2, 1) (the names of earlier records), R4U2KS4 for (4, 2, 4)."""
    ks = tile[2] if len(tile) > 2 else 1
    return f"R{tile[0]}U{tile[1]}" + (f"KS{ks}" if ks > 1 else "")


def make_weight(K, N, bits, g, gen):
    from voltserve.kernels.linear.quant_pack import pack_group_quant

    codes = torch.randint(0, 2**bits, (N, K), generator=gen, device="cuda", dtype=torch.uint8)
    s = (torch.rand(N, K // g, generator=gen, device="cuda") + 0.5) * (0.04 / 2**bits)
    return pack_group_quant(codes, s, -s * 2 ** (bits - 1), bits, g, torch.float16)


def make_fp4(K, N, fmt, gen):
    """A random FP4 weight of the format: block scales around 0.005 (weights ~ +-0.03), E4M3
    bytes 0x18..0x27 times a global 2**-6, or E8M0 2**-9 .. 2**-7."""
    from voltserve.kernels.linear.fp4_pack import make_fp4_weight

    group, kind = FP4_FORMATS[fmt]
    packed = torch.randint(0, 256, (N, K // 2), generator=gen, device="cuda", dtype=torch.uint8)
    lo, hi = (0x18, 0x28) if kind == E4M3 else (118, 121)
    scales = torch.randint(lo, hi, (N, K // group), generator=gen, device="cuda", dtype=torch.uint8)
    gscale = torch.full((N,), 2.0**-6 if kind == E4M3 else 1.0, device="cuda")
    return make_fp4_weight(packed, scales, gscale, group, kind)


def copies_for(nbytes: int) -> int:
    return max(1, min(8, -(-2 * L2_BYTES // nbytes)))


def timed(fn_of_weight, weights, reps: int = 4) -> float:
    """Median seconds per call, cycling over the weight copies inside one graph."""
    it = itertools.cycle(weights)
    return time_graph(lambda: fn_of_weight(next(it)), iters=len(weights) * reps, repeats=7)


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if "--kquant" in argv:  # GGUF K-quant blocks: native vs widened vs fp16 (bench_kquant.py)
        from load_tests.bench_kquant import main as kquant_main

        return kquant_main([a for a in argv if a != "--kquant"])
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--rows", default="1,2,4,8,16,32,64,128,256,2048,8192")
    ap.add_argument("--models", default="llama,qwen")
    ap.add_argument("--formats", default="int4_g128,int8_g32,nvfp4,mxfp4")
    ap.add_argument(
        "--fp4-v1",
        action="store_true",
        help="also time the one-row-a-warp FP4 GEMV (fp4_kernels.fp4_gemv_v1_kernel) at rows <= 8",
    )
    ap.add_argument(
        "--fp4-forms",
        default="",
        help="comma-separated FP4 GEMV dot-product forms (half2, table) to also time forced at "
        "rows <= 8 next to the default one",
    )
    ap.add_argument(
        "--tiles",
        action="store_true",
        help="sweep GEMV (R, U) and (R, U, KS) tiles at 1 and 2 rows",
    )
    ap.add_argument(
        "--forms",
        default="",
        help="comma-separated GEMV dot-product forms (half2, factored, weight) to also time "
        "forced at rows <= 8 next to the default one",
    )
    ap.add_argument("--factored", action="store_true", help="the same as --forms factored")
    ap.add_argument(
        "--tc-configs",
        action="store_true",
        help="also time quant_gemm_tc.CANDIDATES (wider tiles, two load stages) forced at rows "
        "above 8: impl *_tc_<TileConfig.name>",
    )
    ap.add_argument(
        "--no-tc",
        action="store_true",
        help="never time the tensor-core GEMM forced (with VOLTSERVE_QUANT_TC_MAX_ROWS=0: not at all)",
    )
    args = ap.parse_args(argv)
    forms = [f for f in args.forms.split(",") if f]
    if args.factored and "factored" not in forms:
        forms.append("factored")
    bad = [f for f in forms if f not in ("half2", "factored", "weight")]
    if bad:
        raise SystemExit(f"unknown --forms {bad}: half2, factored, weight")
    fp4_forms = [f for f in args.fp4_forms.split(",") if f]
    bad = [f for f in fp4_forms if f not in FP4_FORMS]
    if bad:
        raise SystemExit(f"unknown --fp4-forms {bad}: {', '.join(FP4_FORMS)}")
    formats = [f for f in args.formats.split(",") if f]
    bad = [f for f in formats if f not in FORMATS and f not in FP4_FORMATS]
    if bad:
        raise SystemExit(f"unknown --formats {bad}: {', '.join([*FORMATS, *FP4_FORMATS])}")
    if not torch.cuda.is_available():
        raise SystemExit("bench_quant_linear.py needs a CUDA device")
    from voltserve.kernels.dispatch import KernelDispatch
    from voltserve.kernels.linear.quant_gemm_tc import CANDIDATES, config_for, quant_gemm_tc_cuda
    from voltserve.kernels.linear.quant_gemv import quant_gemv_cuda, quant_gemv_gate_up_cuda
    from voltserve.kernels.linear.quant_linear import (
        quant_gate_up_silu,
        quant_linear,
        quant_path,
        reserve_scratch,
    )

    torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction = True  # torch's default
    ops = KernelDispatch("cuda", torch.float16, force_ref=False)
    rows_list = [int(r) for r in args.rows.split(",")]
    copy = measure_copy_bandwidth("cuda")
    bw = copy["bandwidth_GBps"] * 1e9
    print(f"copy bandwidth {bw / 1e9:.0f} GB/s", flush=True)
    gen = torch.Generator(device="cuda").manual_seed(0)
    results: list[dict] = []
    max_numel = max(k * n for m in MODELS.values() for _, k, n in m)
    reserve_scratch(ops, max_numel)

    def record(**row):
        results.append(row)
        frac = f" ({row['of_floor']:.2f} of floor)" if row.get("of_floor") is not None else ""
        print(
            f"{row['model']:>5} {row['op']:>8} rows {row['rows']:>5} {row['impl']:>22}: "
            f"{row['time_us']:9.1f} us{frac}",
            flush=True,
        )

    env = env_info("cuda")  # before any kernel runs: a fault would make it fail
    error = None
    try:
        for model in args.models.split(","):
            for op, K, N in MODELS[model]:
                w16 = [
                    torch.randn(N, K, generator=gen, device="cuda", dtype=torch.float16) * 0.02
                    for _ in range(copies_for(N * K * 2))
                ]
                qws = {
                    name: [
                        make_weight(K, N, *FORMATS[name], gen)
                        for _ in range(copies_for(N * K * FORMATS[name][0] // 8))
                    ]
                    for name in formats
                    if name in FORMATS
                }
                fws = {
                    name: [make_fp4(K, N, name, gen) for _ in range(copies_for(N * K // 2))]
                    for name in formats
                    if name in FP4_FORMATS
                }
                for rows in rows_list:
                    x = torch.randn(rows, K, generator=gen, device="cuda", dtype=torch.float16)
                    out = torch.empty(rows, N, device="cuda", dtype=torch.float16)
                    base = dict(model=model, op=op, in_features=K, out_features=N, rows=rows)
                    fp16_floor = N * K * 2 / bw
                    t = timed(lambda w: torch.matmul(x, w.t(), out=out), w16)
                    record(**base, impl="fp16_cublas", time_us=t * 1e6, of_floor=fp16_floor / t)
                    if rows <= 8:
                        t = timed(lambda w: ops.gemv(x, w, None, out), w16)
                        record(**base, impl="fp16_gemv", time_us=t * 1e6, of_floor=fp16_floor / t)
                        if op == "gate_up":
                            t = timed(lambda w: ops.gemv_gate_up(x, w), w16)
                            record(
                                **base,
                                impl="fp16_gemv_gate_up",
                                time_us=t * 1e6,
                                of_floor=fp16_floor / t,
                            )
                    for name, ws in qws.items():
                        q = ws[0]
                        floor = q.nbytes() / bw
                        auto = quant_path(rows, torch.float16, q)
                        t = timed(lambda w: quant_linear(x, w, None, ops, out=out), ws)
                        record(
                            **base,
                            impl=f"{name}_auto[{auto}]",
                            time_us=t * 1e6,
                            of_floor=floor / t,
                            floor_us=floor * 1e6,
                        )
                        if rows <= 8:
                            if auto != "gemv":
                                t = timed(lambda w: quant_gemv_cuda(x, w, None, out), ws)
                                record(
                                    **base, impl=f"{name}_gemv", time_us=t * 1e6, of_floor=floor / t
                                )
                            if op == "gate_up":
                                t = timed(lambda w: quant_gate_up_silu(x, w, None, ops), ws)
                                record(
                                    **base,
                                    impl=f"{name}_gemv_gate_up",
                                    time_us=t * 1e6,
                                    of_floor=floor / t,
                                )
                            for form in forms:
                                t = timed(lambda w: quant_gemv_cuda(x, w, None, out, form=form), ws)
                                record(
                                    **base,
                                    impl=f"{name}_{form}_gemv",
                                    time_us=t * 1e6,
                                    of_floor=floor / t,
                                )
                                if op == "gate_up":
                                    t = timed(
                                        lambda w: quant_gemv_gate_up_cuda(x, w, form=form), ws
                                    )
                                    record(
                                        **base,
                                        impl=f"{name}_{form}_gate_up",
                                        time_us=t * 1e6,
                                        of_floor=floor / t,
                                    )
                                if args.tiles and rows == 1:
                                    for tile in ((2, 2), (4, 1), (4, 2), (8, 1)):
                                        t = timed(
                                            lambda w, tile=tile: quant_gemv_cuda(
                                                x, w, None, out, tile=tile, form=form
                                            ),
                                            ws,
                                        )
                                        record(
                                            **base,
                                            impl=f"{name}_{form}_R{tile[0]}U{tile[1]}",
                                            time_us=t * 1e6,
                                            of_floor=floor / t,
                                        )
                            if args.tiles and rows <= 2:
                                for tile in TILES:
                                    t = timed(
                                        lambda w, tile=tile: quant_gemv_cuda(
                                            x, w, None, out, tile=tile
                                        ),
                                        ws,
                                    )
                                    record(
                                        **base,
                                        impl=f"{name}_gemv_{tile_name(tile)}",
                                        time_us=t * 1e6,
                                        of_floor=floor / t,
                                    )
                                for tile in GATE_UP_TILES if op == "gate_up" else ():
                                    t = timed(
                                        lambda w, tile=tile: quant_gemv_gate_up_cuda(
                                            x, w, tile=tile
                                        ),
                                        ws,
                                    )
                                    record(
                                        **base,
                                        impl=f"{name}_gate_up_{tile_name(tile)}",
                                        time_us=t * 1e6,
                                        of_floor=floor / t,
                                    )
                        if 2 < rows <= 2048 and auto != "tc" and not args.no_tc:
                            t = timed(lambda w: quant_gemm_tc_cuda(x, w, None, out), ws)
                            record(**base, impl=f"{name}_tc", time_us=t * 1e6, of_floor=floor / t)
                        if args.tc_configs and 8 < rows <= 2048 and not args.no_tc:
                            for cfg in CANDIDATES[config_for(rows).bm]:
                                t = timed(
                                    lambda w, cfg=cfg: quant_gemm_tc_cuda(x, w, None, out, cfg=cfg),
                                    ws,
                                )
                                record(
                                    **base,
                                    impl=f"{name}_tc_{cfg.name}",
                                    time_us=t * 1e6,
                                    of_floor=floor / t,
                                )
                        if rows > 8 and auto != "dequant":
                            from voltserve.kernels.linear.quant_linear import _dequant_linear

                            t = timed(lambda w: _dequant_linear(x, w, None, ops, out), ws)
                            record(
                                **base,
                                impl=f"{name}_dequant_cublas",
                                time_us=t * 1e6,
                                of_floor=floor / t,
                            )
                        if rows > 8 and op == "gate_up":
                            t = timed(lambda w: quant_gate_up_silu(x, w, None, ops), ws)
                            record(
                                **base, impl=f"{name}_gate_up_silu", time_us=t * 1e6, of_floor=None
                            )
                    for name, ws in fws.items():
                        time_fp4(
                            record, base, name, ws, x, ops, bw, args.tiles, args.fp4_v1, fp4_forms
                        )
                del w16, qws, fws
                torch.cuda.empty_cache()

    except Exception as e:  # a kernel fault poisons the CUDA context: keep what was measured
        error = f"{type(e).__name__}: {e}"
        print("FAILED:", error, flush=True)
    summary = {} if error else summarise(results, rows_list, bw, gen, ops, forms, fp4_forms)
    write_json(
        args.out,
        dict(
            benchmark="quant_linear",
            env=env,
            copy_bandwidth=copy,
            results=results,
            summary=summary,
            error=error,
        ),
    )
    if error:
        raise SystemExit(1)


def time_fp4(
    record, base: dict, name: str, ws: list, x, ops, bw: float, tiles: bool, v1: bool, forms=()
):
    """One FP4 format at one (op, rows) point: fp4_linear's path (auto: the GEMV up to 8 rows,
    dequantize + cuBLAS above), gate_up with SiLU at decode rows, and with `tiles` the tile
    sweep at 1 and 2 rows (TILES, GATE_UP_TILES), with `v1` the one-row-a-warp GEMV, and each
    GEMV dot-product form of `forms` forced (plain and gate_up)."""
    from voltserve.kernels.linear.fp4_kernels import V1
    from voltserve.kernels.linear.fp4_linear import fp4_gate_up_silu, fp4_gemv_cuda, fp4_linear

    rows, op = base["rows"], base["op"]
    floor = ws[0].nbytes() / bw
    auto = "gemv" if rows <= 8 else "dequant"

    def point(impl: str, fn) -> None:
        t = timed(fn, ws)
        record(**base, impl=impl, time_us=t * 1e6, of_floor=floor / t, floor_us=floor * 1e6)

    point(f"{name}_auto[{auto}]", lambda w: fp4_linear(x, w, None, ops))
    if rows > 8:
        return
    if op == "gate_up":
        point(f"{name}_gemv_gate_up", lambda w: fp4_gate_up_silu(x, w, None, ops))
    for form in forms:
        point(f"{name}_{form}_gemv", lambda w: fp4_gemv_cuda(x, w, form=form))
        if op == "gate_up":
            point(f"{name}_{form}_gate_up", lambda w: fp4_gemv_cuda(x, w, gate_up=True, form=form))
    if v1:
        point(f"{name}_v1_gemv", lambda w: fp4_gemv_cuda(x, w, tile=V1))
        if op == "gate_up":
            point(f"{name}_v1_gate_up", lambda w: fp4_gemv_cuda(x, w, gate_up=True, tile=V1))
    if tiles and rows <= 2:
        for tile in TILES:
            point(f"{name}_gemv_{tile_name(tile)}", lambda w: fp4_gemv_cuda(x, w, tile=tile))
        for tile in GATE_UP_TILES if op == "gate_up" else ():
            point(
                f"{name}_gate_up_{tile_name(tile)}",
                lambda w: fp4_gemv_cuda(x, w, gate_up=True, tile=tile),
            )


def best(results, model, op, rows, prefix) -> float | None:
    ts = [
        r["time_us"]
        for r in results
        if r["model"] == model
        and r["op"] == op
        and r["rows"] == rows
        and r["impl"].startswith(prefix)
    ]
    return min(ts) if ts else None


def summarise(results, rows_list, bw, gen, ops, forms=(), fp4_forms=()) -> dict:
    """Llama-3-8B: one decoder step's linears (32 layers + the fp16 lm_head of the step's rows,
    sampled rows only at decode: rows <= 256) per row count, fp16 (best of cuBLAS / GEMV) and
    int4 (quant_linear's choice), and the batch-1 tokens/s ratio of the linears alone."""
    if not any(r["model"] == "llama" for r in results):
        return {}
    head = torch.randn(LLAMA_VOCAB, 4096, generator=gen, device="cuda", dtype=torch.float16) * 0.02
    out: dict = {"lm_head_us": {}, "step_linears_us": {}}
    for rows in rows_list:
        hr = min(rows, 256)  # prefill samples only the last row of each sequence
        x = torch.randn(hr, 4096, generator=gen, device="cuda", dtype=torch.float16)
        t_head = time_graph(lambda: F.linear(x, head), iters=4, repeats=7) * 1e6
        if hr <= 8:
            t_head = min(t_head, time_graph(lambda: ops.gemv(x, head), iters=4, repeats=7) * 1e6)
        out["lm_head_us"][rows] = t_head
        fp16 = int4 = 0.0
        ok = True
        for op in ("qkv", "o", "gate_up", "down"):
            f = best(results, "llama", op, rows, "fp16")
            # int4 with the path quant_linear picks; gate_up fused with SiLU where timed.
            q = best(results, "llama", op, rows, "int4_g128_auto")
            if op == "gate_up":
                qf = best(results, "llama", op, rows, "int4_g128_gemv_gate_up") or best(
                    results, "llama", op, rows, "int4_g128_gate_up_silu"
                )
                q = qf if qf is not None else q
            if f is None or q is None:
                ok = False
                break
            fp16 += f
            int4 += q
        if not ok:
            continue
        fp16 = LLAMA_LAYERS * fp16 + t_head
        int4 = LLAMA_LAYERS * int4 + t_head
        out["step_linears_us"][rows] = dict(fp16=fp16, int4_g128=int4, int4_over_fp16=int4 / fp16)
    if 1 in out["step_linears_us"]:
        s = out["step_linears_us"][1]
        out["batch1_linears_tok_s_ratio"] = s["fp16"] / s["int4_g128"]
        qbytes = sum(
            r["floor_us"]
            for r in results
            if r["model"] == "llama" and r["rows"] == 1 and r["impl"].startswith("int4_g128_auto")
        )
        floor = LLAMA_LAYERS * qbytes + LLAMA_VOCAB * 4096 * 2 / bw * 1e6
        out["batch1_int4_floor_us"] = floor
        out["batch1_int4_of_floor"] = floor / s["int4_g128"]
        # The same step with each forced GEMV form (--forms): gate_up fused, the rest plain.
        for form in forms:
            ts = [
                best(results, "llama", op, 1, f"int4_g128_{form}_" + impl)
                for op, impl in (
                    ("qkv", "gemv"),
                    ("o", "gemv"),
                    ("gate_up", "gate_up"),
                    ("down", "gemv"),
                )
            ]
            if all(t is not None for t in ts):
                f_step = LLAMA_LAYERS * sum(ts) + out["lm_head_us"][1]
                out[f"batch1_{form}_linears_us"] = f_step
                out[f"batch1_{form}_of_floor"] = floor / f_step
    for fmt in FP4_FORMATS:
        step = fp4_batch1(results, fmt, out, bw, fp4_forms)
        if step:
            out[f"batch1_{fmt}"] = step
    print("summary:", out, flush=True)
    return out


FP4_FORMS = ("half2", "table")  # fp4_kernels.FORMS
# The batch-1 step's linears by path: (op, impl prefix) of the default path, of the
# one-row-a-warp kernel and of each forced GEMV form (--fp4-forms); gate_up fused with SiLU in
# all, as the model runs it.
FP4_STEP = {
    "default": (("qkv", "auto"), ("o", "auto"), ("gate_up", "gemv_gate_up"), ("down", "auto")),
    "v1": (("qkv", "v1_gemv"), ("o", "v1_gemv"), ("gate_up", "v1_gate_up"), ("down", "v1_gemv")),
} | {
    form: (
        ("qkv", f"{form}_gemv"),
        ("o", f"{form}_gemv"),
        ("gate_up", f"{form}_gate_up"),
        ("down", f"{form}_gemv"),
    )
    for form in FP4_FORMS
}


def batch1_floor_us(results, op: str, fmt: str) -> float | None:
    """The floor of one Llama-3-8B linear at one row in format fmt (its auto record's)."""
    return next(
        (
            r["floor_us"]
            for r in results
            if r["model"] == "llama"
            and r["op"] == op
            and r["rows"] == 1
            and r["impl"].startswith(f"{fmt}_auto")
        ),
        None,
    )


def fp4_batch1(results, fmt: str, summary: dict, bw: float, forms=()) -> dict:
    """An FP4 format's Llama-3-8B batch-1 step (32 layers of its linears + the fp16 lm_head)
    against its floor (the FP4 bytes read + the lm_head's), per path (FP4_STEP: those timed),
    each path's fraction of floor over int4 g128's (per_byte_vs_int4: both against their own
    bytes), and each linear's fraction of its floor beside int4's, for the default path and
    each of `forms`; {} when the format was not timed at one row."""
    floors = {op: batch1_floor_us(results, op, fmt) for op, _ in FP4_STEP["default"]}
    head = summary["lm_head_us"].get(1)
    if None in floors.values() or head is None:
        return {}
    floor = LLAMA_LAYERS * sum(floors.values()) + LLAMA_VOCAB * 4096 * 2 / bw * 1e6
    step: dict = {"floor_us": floor}
    int4_of_floor = summary.get("batch1_int4_of_floor")
    for path, impls in FP4_STEP.items():
        ts = [best(results, "llama", op, 1, f"{fmt}_{impl}") for op, impl in impls]
        if all(t is not None for t in ts):
            us = LLAMA_LAYERS * sum(ts) + head
            step[path] = dict(linears_us=us, of_floor=floor / us)
            if int4_of_floor:
                step[path]["per_byte_vs_int4"] = floor / us / int4_of_floor
    if "default" in step and int4_of_floor:
        step["per_byte_vs_int4"] = step["default"]["per_byte_vs_int4"]
    step["per_linear"] = {}
    for i, (op, impl) in enumerate(FP4_STEP["default"]):
        t = best(results, "llama", op, 1, f"{fmt}_{impl}")
        int4 = "int4_g128_gemv_gate_up" if op == "gate_up" else "int4_g128_auto"
        q, q_floor = best(results, "llama", op, 1, int4), batch1_floor_us(results, op, "int4_g128")
        step["per_linear"][op] = dict(
            time_us=t,
            of_floor=floors[op] / t if t else None,
            int4_of_floor=q_floor / q if q and q_floor else None,
        )
        for form in forms:
            tf = best(results, "llama", op, 1, f"{fmt}_{FP4_STEP[form][i][1]}")
            step["per_linear"][op][f"{form}_of_floor"] = floors[op] / tf if tf else None
    return step


if __name__ == "__main__":
    main()
