"""Gated DeltaNet kernel speed (kernels/linear_attention/) at the Qwen3.5-27B shape (16 key
heads, 48 value heads, head dims 128), fp16 storage, fp32 states, each against its floor
measured in the same run.

    python load_tests/bench_gdn.py --out load_tests/results/h100/bench_gdn.json
    python load_tests/bench_gdn.py --decode-batches 1,64,256 --prefill 1x4096,8x1024 --out x.json

Decode (gated_delta_rule_decode_cuda, one token a request): a request reads and writes its
state [48, 128, 128] fp32 once (6 MiB together), plus q, k, v, a, b and the output. The floor is
those bytes over the device-to-device copy bandwidth measured here (load_tests/common.py: a
4 GiB copy, far beyond the L2). Timing: a CUDA graph of --calls launches cycling over enough
state pools that a call never finds its state in L2 (the decode kernel alone launches in less
time than numba's per-call CPU cost, so eager timing would time the CPU), median of --iters
replays.

Prefill (gated_delta_rule_prefill_cuda, packed sequences, chunks of 64): its FLOPs are counted
per chunk and value head as the algorithm needs them (C = 64, the k k^T and q k^T products 2 x
2 C^2 Dk, the forward substitution C^3 / 3, W and U 2 C^2 (Dk + Dv), V' = U - W S, Q' S and the
state update 3 x 2 C Dk Dv, the intra-chunk scores times V' 2 C^2 Dv); the kernels run them on
CUDA cores in fp32, so their roofline is those FLOPs over the fp32 CUDA-core rate, measured
here as torch's fp32 GEMM with TF32 off (cuBLAS on FFMA: what CUDA cores reach on a large
GEMM), and the bytes (inputs, output, states, and the fp32 scratch the two kernels pass
through global memory) over the copy bandwidth; roofline = the larger of the two times. The
fp16 tensor-core GEMM rate is measured too, as the ceiling a WMMA version would aim at. The
anchor is transformers' torch_chunk_gated_delta_rule (fp32 torch ops) on the same inputs, the
same run. Timing: CUDA events around each eager call, median of --iters; each of the two
kernels (state-independent prep, sequential scan) is also timed alone.
"""

from __future__ import annotations

import argparse
import datetime

import torch
import torch.nn.functional as F

if not __package__:
    import _as_script  # noqa: F401  (load_tests.* importable; see _as_script.py)
from load_tests.bench_kernels_elementwise import graph_time_ms  # noqa: E402
from load_tests.common import (  # noqa: E402
    env_info,
    event_time_ms,
    git_commit,
    measure_copy_bandwidth,
    write_json,
)

HK, HV, DK, DV = 16, 48, 128, 128  # Qwen3.5-27B
CHUNK = 64
ROTATE_BYTES = 512 << 20  # state bytes cycled over per graph: > 8x the H100/H200 L2


def gemm_tflops(dtype: torch.dtype, n: int = 8192, iters: int = 10) -> float:
    """A large square GEMM's rate: fp32 with TF32 off runs on CUDA cores, fp16 on tensor cores."""
    tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        a = torch.randn(n, n, device="cuda", dtype=dtype)
        b = torch.randn(n, n, device="cuda", dtype=dtype)
        ms = event_time_ms(lambda: a @ b, iters)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = tf32
    return 2 * n**3 / ms / 1e9


def gdn_inputs(T: int, gen: torch.Generator):
    r = dict(device="cuda", generator=gen)
    q = torch.randn(T, HK, DK, **r).half()
    k = torch.randn(T, HK, DK, **r).half()
    v = torch.randn(T, HV, DV, **r).half()
    a = torch.randn(T, HV, **r).half()
    b = torch.randn(T, HV, **r).half()
    A_log = (torch.rand(HV, **r) * 15 + 1).log()
    dt_bias = torch.randn(HV, **r)
    return q, k, v, a, b, A_log, dt_bias


def decode_bytes(B: int) -> int:
    state = 2 * B * HV * DK * DV * 4
    qk = 2 * B * HK * DK * 2
    vo = 2 * B * HV * DV * 2
    ab = 2 * B * HV * 2
    return state + qk + vo + ab + B * 8


def bench_decode(B: int, copy_gbps: float, calls: int, iters: int) -> dict:
    from transformers.models.qwen3_next.modeling_qwen3_next import (
        torch_recurrent_gated_delta_rule,
    )
    from voltserve.kernels.linear_attention.recurrent import gated_delta_rule_decode_cuda

    gen = torch.Generator(device="cuda").manual_seed(B)
    q, k, v, a, b, A_log, dt_bias = gdn_inputs(B, gen)
    pool_bytes = B * HV * DK * DV * 4
    sets = max(1, -(-ROTATE_BYTES // pool_bytes))
    pools = [0.1 * torch.randn(B, HV, DK, DV, device="cuda", generator=gen) for _ in range(sets)]
    slots = torch.arange(B, device="cuda", dtype=torch.int64)
    fns = [
        lambda p=p: gated_delta_rule_decode_cuda(q, k, v, a, b, A_log, dt_bias, p, slots)
        for p in pools
    ]
    ms = graph_time_ms(fns, calls, iters)
    nbytes = decode_bytes(B)
    floor_ms = nbytes / copy_gbps / 1e6
    g = -A_log.exp() * F.softplus(a.float() + dt_bias)
    init = pools[0].clone()
    qh, kh = (x.repeat_interleave(HV // HK, dim=1) for x in (q, k))  # per value head
    hf_ms = event_time_ms(
        lambda: torch_recurrent_gated_delta_rule(
            qh[:, None], kh[:, None], v[:, None], g[:, None], b.sigmoid()[:, None],
            initial_state=init, output_final_state=True, use_qk_l2norm_in_kernel=True,
        ),
        iters,
    )  # fmt: skip
    del pools
    torch.cuda.empty_cache()
    return {
        "batch": B,
        "us_per_call": 1e3 * ms,
        "bytes": nbytes,
        "floor_us": 1e3 * floor_ms,
        "fraction_of_floor": floor_ms / ms,
        "gb_per_s": nbytes / ms / 1e6,
        "state_pools_cycled": sets,
        "transformers_torch_us": 1e3 * hf_ms,
        "speedup_over_transformers": hf_ms / ms,
    }


def prefill_flops(lens: list[int]) -> int:
    total = 0
    for n in lens:
        for c0 in range(0, n, CHUNK):
            C = min(CHUNK, n - c0)
            per_head = (
                4 * C * C * DK  # k k^T, q k^T
                + C**3 // 3  # forward substitution
                + 2 * C * C * (DK + DV)  # W, U
                + 3 * 2 * C * DK * DV  # V' = U - W S, Q' S, state update
                + 2 * C * C * DV  # scores V'
            )
            total += HV * per_head
    return total


def prefill_bytes(lens: list[int]) -> tuple[int, int]:
    """(essential bytes, scratch bytes): inputs, output and states; the fp32 scratch written
    by the first kernel and read by the second (each once; the second reads W, Q', K' once per
    32-column tile, mostly from L2)."""
    T, N = sum(lens), len(lens)
    essential = T * (2 * HK * DK * 2 + HV * DV * 2 * 2 + 2 * HV * 2) + 2 * N * HV * DK * DV * 4
    scratch = 2 * T * HV * (3 * DK + DV + CHUNK + 1) * 4
    return essential, scratch


def bench_prefill(lens: list[int], copy_gbps: float, fp32_tflops: float, iters: int) -> dict:
    from transformers.models.qwen3_next.modeling_qwen3_next import torch_chunk_gated_delta_rule
    from voltserve.kernels.linear_attention.chunk import (
        gated_delta_rule_prefill_cuda,
        prefill_launches,
        prefill_scratch,
    )
    from voltserve.kernels.runtime.numba_common import current_stream, launch

    gen = torch.Generator(device="cuda").manual_seed(len(lens))
    T, N = sum(lens), len(lens)
    q, k, v, a, b, A_log, dt_bias = gdn_inputs(T, gen)
    cu = torch.tensor([0] + lens, device="cuda").cumsum(0)
    slots = torch.arange(N, device="cuda", dtype=torch.int64)
    has_initial = torch.ones(N, device="cuda", dtype=torch.bool)
    pool = 0.1 * torch.randn(N, HV, DK, DV, device="cuda", generator=gen)
    ms = event_time_ms(
        lambda: gated_delta_rule_prefill_cuda(
            q, k, v, a, b, A_log, dt_bias, pool, cu, slots, has_initial
        ),
        iters,
    )
    # Each of the two kernels alone (the same launches as the call, scratch allocated once):
    # where the time goes before either is rewritten.
    out = torch.empty_like(v)
    launches = prefill_launches(
        q, k, v, a, b, A_log, dt_bias, pool, cu, slots, has_initial, out, prefill_scratch(q, v)
    )
    kernel_ms = {}
    for name, (kernel, grid, block, kargs) in zip(("prep", "scan"), launches, strict=True):
        kernel_ms[name] = event_time_ms(
            lambda kernel=kernel, grid=grid, block=block, kargs=kargs: launch(
                kernel, grid, block, kargs, current_stream()
            ),
            iters,
        )
        kernel_ms[f"{name}_grid"] = list(grid)
    flops = prefill_flops(lens)
    essential, scratch = prefill_bytes(lens)
    compute_ms = flops / fp32_tflops / 1e9
    memory_ms = (essential + scratch) / copy_gbps / 1e6
    roofline_ms = max(compute_ms, memory_ms)

    g = -A_log.exp() * F.softplus(a.float() + dt_bias)
    beta = b.sigmoid()
    q, k = (x.repeat_interleave(HV // HK, dim=1) for x in (q, k))  # per value head, as the model
    equal = len(set(lens)) == 1  # equal lengths: one batched call, else one call a sequence

    def hf():
        if equal:
            B, n = N, lens[0]
            return torch_chunk_gated_delta_rule(
                q.view(B, n, HV, DK), k.view(B, n, HV, DK), v.view(B, n, HV, DV),
                g.view(B, n, HV), beta.view(B, n, HV), initial_state=pool,
                output_final_state=True, use_qk_l2norm_in_kernel=True,
            )  # fmt: skip
        for i in range(N):
            s = slice(int(cu[i]), int(cu[i + 1]))
            torch_chunk_gated_delta_rule(
                q[None, s], k[None, s], v[None, s], g[None, s], beta[None, s],
                initial_state=pool[i : i + 1], output_final_state=True,
                use_qk_l2norm_in_kernel=True,
            )  # fmt: skip
        return None

    hf_ms = event_time_ms(hf, max(3, iters // 4), warmup=1)
    return {
        "sequences": N,
        "tokens": T,
        "ms": ms,
        "prep_kernel_ms": kernel_ms["prep"],
        "scan_kernel_ms": kernel_ms["scan"],
        "grids": {"prep": kernel_ms["prep_grid"], "scan": kernel_ms["scan_grid"]},
        "tokens_per_s": T / ms * 1e3,
        "flops": flops,
        "tflop_per_s": flops / ms / 1e9,
        "essential_bytes": essential,
        "scratch_bytes": scratch,
        "compute_floor_ms": compute_ms,
        "memory_floor_ms": memory_ms,
        "roofline_ms": roofline_ms,
        "fraction_of_roofline": roofline_ms / ms,
        "transformers_torch_ms": hf_ms,
        "speedup_over_transformers": hf_ms / ms,
    }


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True, help="JSON result path")
    ap.add_argument("--decode-batches", default="1,64,256")
    ap.add_argument("--prefill", default="1x4096,8x1024", help="SEQSxLEN, comma separated")
    ap.add_argument("--calls", type=int, default=32, help="decode launches captured per graph")
    ap.add_argument("--iters", type=int, default=20, help="timed repeats (median)")
    args = ap.parse_args(argv)

    copy = measure_copy_bandwidth("cuda")
    copy_gbps = copy["bandwidth_GBps"]
    fp32_tflops = gemm_tflops(torch.float32)
    fp16_tflops = gemm_tflops(torch.float16)

    decode = [
        bench_decode(int(bs), copy_gbps, args.calls, args.iters)
        for bs in args.decode_batches.split(",")
        if bs
    ]
    prefill = []
    for spec in (s for s in args.prefill.split(",") if s):
        seqs, length = (int(x) for x in spec.lower().split("x"))
        prefill.append(bench_prefill([length] * seqs, copy_gbps, fp32_tflops, args.iters))
        torch.cuda.empty_cache()

    report = {
        "device": torch.cuda.get_device_name(),
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "commit": git_commit(),
        "env": env_info("cuda"),
        "shape": {"key_heads": HK, "value_heads": HV, "key_dim": DK, "value_dim": DV},
        "dtype": "float16 storage, float32 state",
        "copy": copy,
        "fp32_cuda_core_gemm_tflops": fp32_tflops,
        "fp16_tensor_core_gemm_tflops": fp16_tflops,
        "decode": decode,
        "prefill": prefill,
    }
    write_json(args.out, report)
    print(f"copy {copy_gbps:.0f} GB/s  fp32 GEMM {fp32_tflops:.1f} TFLOP/s  fp16 GEMM "
          f"{fp16_tflops:.1f} TFLOP/s")  # fmt: skip
    for r in decode:
        print(
            f"decode B={r['batch']:<4} {r['us_per_call']:8.1f} us  floor {r['floor_us']:7.1f} us "
            f"({100 * r['fraction_of_floor']:5.1f}%)  transformers {r['transformers_torch_us']:8.1f}"
            " us"
        )
    for r in prefill:
        print(
            f"prefill {r['sequences']}x{r['tokens'] // r['sequences']:<5} {r['ms']:8.2f} ms "
            f"{r['tflop_per_s']:6.2f} TFLOP/s  roofline {r['roofline_ms']:.2f} ms "
            f"({100 * r['fraction_of_roofline']:5.1f}%)  transformers "
            f"{r['transformers_torch_ms']:8.2f} ms  (prep {r['prep_kernel_ms']:.2f} ms, scan "
            f"{r['scan_kernel_ms']:.2f} ms alone)"
        )


if __name__ == "__main__":
    main()
