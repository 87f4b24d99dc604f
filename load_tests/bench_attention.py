"""Decode attention bandwidth: bytes of K+V read per second, as a fraction of a device-to-device
copy measured in the same run (copy bandwidth counts its read and its write bytes, so both sides
are DRAM traffic per second).

    python load_tests/bench_attention.py --out results/bench_attention.json

Shape: Llama-3-8B attention (32 query heads, 8 KV heads, head_dim 128), one layer's cache, fp16.
Calls are captured in a CUDA graph (ITERS launches per replay) so the GPU time is measured, not
the CPU launch rate; timing is torch CUDA events, median over repeats after a warmup.
Every launch reads the same KV, which at small batches stays in L2 (4 MB at batch 1 x 1K);
`--cold` times each launch after a 128 MB copy that evicts it, as a served step's weight stream
does, and reports that graph's time less the copies' alone.
Also times the (untuned) prefill kernel for reference.

`--kv fp16,fp8_e5m2,fp8_e4m3` times the decode over each KV storage in the same run (fp8: the
one-byte pages read directly, attention/decode_fp8.py), each against its own bytes floor (its
KV bytes / the copy bandwidth), and per point the fp8 speed-up over fp16 as a fraction of the
ratio of their floors (2 for attention alone):

    python load_tests/bench_attention.py --contexts 4096,32768,131072,262144 --batches 1 \
        --kv fp16,fp8_e5m2,fp8_e4m3 --skip-prefill --cold --out results/bench_attention_fp8.json

`--sweep 1x131072 --kv fp8_e5m2` times the launch variants over the one-byte pages too.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import multiprocessing as mp
import statistics
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass
from pathlib import Path

import torch

if not __package__:
    import _as_script  # noqa: F401  (load_tests.* importable; see _as_script.py)

BLOCK = 16


def time_graph(fn, iters: int, repeats: int) -> float:
    """Median seconds per fn() call, fn captured `iters` times in one CUDA graph."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(iters):
            fn()
    for _ in range(3):
        graph.replay()
    times = []
    for _ in range(repeats):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1e3 / iters)
    return statistics.median(times)


def copy_bandwidth() -> float:
    """Bytes/s of a 4 GiB device-to-device copy (read + write), from load_tests/common.py: a
    buffer far larger than L2, timed one copy at a time (a 1 GiB copy replayed from a graph
    reported ~2.7 TB/s on an H200 whose copy bandwidth is ~4.2 TB/s, flattering every ratio)."""
    from load_tests.common import measure_copy_bandwidth

    return measure_copy_bandwidth("cuda")["bandwidth_GBps"] * 1e9


KV_FORMATS = ("fp16", "fp8_e5m2", "fp8_e4m3")
E4M3_SCALES = (0.0625, 0.5)  # k_scale, v_scale of the e4m3 runs (any finite positive pair)


def decode_inputs(batch: int, context: int, kvh: int, group: int, head_dim: int, kv: str = "fp16"):
    """q [B, H, D], one layer's K and V caches with every sequence at `context` tokens in
    shuffled blocks, their block tables and seq_lens (random; fp16, or the one-byte codes of
    random values for an fp8 `kv`)."""
    n_blocks = batch * context // BLOCK
    k = torch.randn((n_blocks, kvh, BLOCK, head_dim), device="cuda", dtype=torch.float16)
    v = torch.randn_like(k)
    if kv != "fp16":
        from voltserve.kernels.attention import fp8

        k_scale, v_scale = E4M3_SCALES if kv == fp8.E4M3 else (1.0, 1.0)
        k, v = fp8.quantize(k, kv, k_scale), fp8.quantize(v, kv, v_scale)
    tables = torch.randperm(n_blocks, device="cuda").int().view(batch, context // BLOCK)
    sl = torch.full((batch,), context, dtype=torch.int32, device="cuda")
    q = torch.randn((batch, kvh * group, head_dim), device="cuda").half()
    return q, k, v, tables, sl


EVICT_BYTES = 128 << 20  # more than twice the H200's 60 MB L2 (a V100's is 6 MB)


def bench_decode(
    batch: int,
    context: int,
    kvh: int,
    group: int,
    head_dim: int,
    iters: int,
    cold: bool = False,
    kv: str = "fp16",
):
    """Seconds per launch and the KV bytes it reads (fp16 or, for an fp8 `kv`, the one-byte
    pages read directly). cold: each launch after a copy of EVICT_BYTES (evicting the KV from
    L2), timed as that graph less a graph of the copies."""
    from voltserve.kernels.attention.decode import paged_decode_attention_cuda
    from voltserve.kernels.attention.decode_fp8 import paged_decode_attention_fp8_cuda

    q, k, v, tables, sl = decode_inputs(batch, context, kvh, group, head_dim, kv)
    out = torch.empty_like(q)
    scale = head_dim**-0.5

    def attend():
        if kv == "fp16":
            paged_decode_attention_cuda(q, k, v, tables, sl, scale, out, max_seq_len=context)
            return
        k_scale, v_scale = E4M3_SCALES if kv == "fp8_e4m3" else (1.0, 1.0)
        paged_decode_attention_fp8_cuda(
            q, k, v, tables, sl, scale, out, fmt=kv, k_scale=k_scale, v_scale=v_scale,
            max_seq_len=context,
        )  # fmt: skip

    nbytes = 2 * batch * context * kvh * head_dim * k.element_size()
    return time_launch(attend, iters, cold), nbytes


def time_launch(fn, iters: int, cold: bool, repeats: int = 10) -> float:
    """Seconds per fn() in a graph of `iters` calls (time_graph); cold: each call after a copy
    of EVICT_BYTES that evicts its inputs from L2, less a graph of the copies alone."""
    if not cold:
        return time_graph(fn, iters=iters, repeats=repeats)
    src = torch.empty(EVICT_BYTES // 2, dtype=torch.float16, device="cuda")
    dst = torch.empty_like(src)

    def evict_then_call():
        dst.copy_(src)
        fn()

    both = time_graph(evict_then_call, iters=iters, repeats=repeats)
    return both - time_graph(lambda: dst.copy_(src), iters=iters, repeats=repeats)


SWEEP_PARTITIONS = (32, 64, 128)  # small batches: parallel work comes from partitions
SWEEP_SMALL_BATCH = 8


@dataclass(frozen=True)
class Variant:
    """One launch of the decode kernel to time. partition 0 = the launcher's choice (the
    default launch), -1 = one partition of the whole context; bound = max_seq_len / context (a
    graph captured for a larger max_model_len launches the larger grid; its extra blocks find
    no tokens)."""

    partition: int = 0
    threads: int = 128
    regs: int | None = -1  # -1 the default, None no cap, else a cap
    online: bool | None = None  # None: the launcher's choice
    bound: int = 1
    # The online core software-pipelined (DecodeConfig.prefetch), where the online core runs.
    prefetch: bool = False


WHOLE = -1
# The bound cut into MERGE_MAX_PARTITIONS partitions (rounded up to a KV block): the online core
# with the in-kernel merge spreading each context over them, at any bound (its partitions keep
# no scores in shared memory, so their length is free).
MERGE_SPAN = -2


def sweep_variants(batch: int, partitions: tuple[int, ...] = ()) -> list[Variant]:
    """What to time at one point: the default launch at 1x, 8x and 32x bounds (32x: a 4K
    context under a 131K-token server bound, past the in-kernel merge's partitions), then at
    small batches
    every short partition with the online and the block core (and 64 threads for partition 64:
    it lost 6 us at 1K context on an H200 with the block core; 256 threads, online, for 128;
    and the bound cut into MERGE_MAX_PARTITIONS online partitions at 1x and 32x: the in-kernel
    merge at bounds whose 1024-token partitions it cannot hold; each of these last two and the
    default launch at 1x and 32x also with the online core's prefetch);
    at larger ones (a full grid with
    one block per sequence and KV head) the whole context as one partition with the default
    registers, capped at 128 (4 blocks per SM instead of 3) and with 256 threads at 128, and,
    under an 8x bound (a server's max_model_len), the 1024- and 2048-token partitions. Each is a
    numba compile (~25 s on the device for these unrolled kernels): --jobs spreads the compiles
    over processes."""
    out = [Variant(bound=b) for b in (1, 8, 32)]
    if partitions:  # --partitions: just these, block core
        return out + [Variant(partition=p, online=False) for p in partitions]
    if batch <= SWEEP_SMALL_BATCH:
        for online in (True, False):
            out += [Variant(partition=p, online=online) for p in SWEEP_PARTITIONS]
        online = [
            # 8 warps: one KV block each in a 128-token partition (ONLINE_THREADS' form)
            Variant(partition=128, threads=256, online=True),
            *(Variant(partition=MERGE_SPAN, threads=256, online=True, bound=b) for b in (1, 32)),
        ]
        out += [Variant(partition=64, threads=64, online=True), *online]
        # The same with the online core's prefetch, and the default launch (prefetched where
        # the launcher picks the online core).
        twins = [*online, *(Variant(bound=b) for b in (1, 32))]
        return out + [dataclasses.replace(v, prefetch=True) for v in twins]
    return out + [
        Variant(partition=WHOLE, regs=128, online=False),
        Variant(partition=WHOLE, threads=256, regs=128, online=False),
        Variant(partition=1024, online=False, bound=8),
        Variant(partition=2048, online=False, bound=8, regs=None),
    ]


def sweep_job(
    batch: int,
    context: int,
    kvh: int,
    group: int,
    head_dim: int,
    v: Variant,
    cold: bool = False,
    kv: str = "fp16",
) -> dict:
    """Build (compile and warm) one variant, then time it while holding the sweep's GPU lock
    (only one process times at a time; the others compile on the CPU meanwhile). The row has
    its time and its largest difference from the torch reference (a broken variant shows)."""
    from voltserve.kernels.attention.decode import (
        MERGE_MAX_PARTITIONS,
        decode_workspace,
        launch_with_threads,
        num_partitions,
        paged_decode_attention_cuda,
    )
    from voltserve.kernels.attention.decode_fp8 import (
        paged_decode_attention_fp8_cuda,
        paged_decode_attention_fp8_ref,
    )
    from voltserve.kernels.attention.ref import paged_decode_attention_ref
    from voltserve.kernels.runtime.launch_geometry import device_sms

    torch.manual_seed(batch * 7919 + context)
    q, k, v_cache, tables, sl = decode_inputs(batch, context, kvh, group, head_dim, kv)
    scale = head_dim**-0.5
    k_scale, v_scale = E4M3_SCALES if kv == "fp8_e4m3" else (1.0, 1.0)
    if kv == "fp16":
        want = paged_decode_attention_ref(q, k, v_cache, tables, sl, scale)
    else:
        want = paged_decode_attention_fp8_ref(
            q, k, v_cache, tables, sl, scale, kv, k_scale, v_scale
        )
    out = torch.full_like(q, float("nan"))
    # As the runner's tables: bound x the context's columns, zero beyond a sequence's blocks.
    wide = torch.zeros((batch, v.bound * tables.shape[1]), dtype=tables.dtype, device="cuda")
    wide[:, : tables.shape[1]] = tables
    bound = v.bound * context
    kw: dict = dict(max_seq_len=bound, prefetch=v.prefetch)
    mode = "dflt"
    if v.partition:
        part = v.partition
        if v.partition == WHOLE:
            part = -(-context // 16) * 16
        elif v.partition == MERGE_SPAN:
            part = -(-bound // (MERGE_MAX_PARTITIONS * 16)) * 16
        n_part = num_partitions(bound, part)
        mode = "merge" if n_part <= MERGE_MAX_PARTITIONS else "split"
        p_ws = MERGE_MAX_PARTITIONS if mode == "merge" else n_part
        kw.update(
            partition_size=part,
            workspace=decode_workspace(batch, kvh * group, p_ws, head_dim, "cuda"),
            num_threads=v.threads,
            max_registers=v.regs,
            online=v.online,
        )
        if n_part == 1:
            mode = "direct"
    mode += f"{v.bound}x"
    threads = v.threads
    prefetch = v.prefetch and v.online is True
    if not v.partition:  # the default launch: the launcher's thread count and core
        sms = device_sms(torch.cuda.current_device())
        cfg, _ = launch_with_threads(
            kvh * group, kvh, head_dim, batch, bound, sms, None, None, None, None, kv, v.prefetch
        )
        threads, prefetch = cfg.num_threads, cfg.prefetch

    def call():
        if kv == "fp16":
            paged_decode_attention_cuda(q, k, v_cache, wide, sl, scale, out, **kw)
            return
        paged_decode_attention_fp8_cuda(
            q, k, v_cache, wide, sl, scale, out, fmt=kv, k_scale=k_scale, v_scale=v_scale, **kw
        )

    call()  # the compile, outside the lock
    torch.cuda.synchronize()
    with _GPU_LOCK:
        t = time_launch(call, 20, cold)
    return dict(
        kv=kv,
        batch=batch,
        context=context,
        partition=kw.get("partition_size", 0),
        threads=threads,
        kv_cold=cold,
        mode=mode,
        max_registers={-1: "default", None: "none"}.get(v.regs, str(v.regs)),
        core={None: "auto", True: "online", False: "block"}[v.online],
        prefetch=prefetch,
        time_us=t * 1e6,
        max_abs_diff=(out.float() - want.float()).abs().max().item(),
    )


_GPU_LOCK = contextlib.nullcontext()  # a worker's: the lock its pool's initializer hands it


def _init_worker(lock) -> None:
    global _GPU_LOCK
    _GPU_LOCK = lock


def sweep_decode(
    points: list[tuple[int, int]],
    kvh: int,
    group: int,
    head_dim: int,
    jobs: int,
    partitions: tuple[int, ...] = (),
    cold: bool = False,
    kv_formats: tuple[str, ...] = ("fp16",),
):
    """Every sweep variant at every (batch, context) point and KV storage, over `jobs` worker
    processes (each builds its variants while another times; timing holds one lock). Rows print
    as measured. cold: each launch timed with its KV evicted from L2 (time_launch)."""
    work = [
        (b, c, kvh, group, head_dim, v, cold, kv)
        for kv in kv_formats
        for b, c in points
        for v in sweep_variants(b, partitions)
    ]
    rows = []
    if jobs <= 1:
        for w in work:
            rows.append(sweep_job(*w))
            print(sweep_line(rows[-1]), flush=True)
        return rows
    ctx = mp.get_context("spawn")
    lock = ctx.Lock()
    with ProcessPoolExecutor(
        jobs, mp_context=ctx, initializer=_init_worker, initargs=(lock,)
    ) as ex:
        for fut in as_completed([ex.submit(sweep_job, *w) for w in work]):
            rows.append(fut.result())
            print(sweep_line(rows[-1]), flush=True)
    return rows


def sweep_line(r: dict) -> str:
    return (
        f"sweep {r['kv']} b{r['batch']} ctx {r['context']}: {r['time_us']:6.1f} us  partition "
        f"{r['partition']:>4} threads {r['threads']:>3} {r['mode']:>8} {r['core']:>6} "
        f"{'prefetch' if r['prefetch'] else '':>8} regs {r['max_registers']:>7}  max diff "
        f"{r['max_abs_diff']:.1e}"
    )


def partition_for(
    batch: int, context: int, kvh: int, group: int, head_dim: int, kv: str = "fp16"
) -> int:
    """The partition size the launcher picks for this point (reported next to its time)."""
    from voltserve.kernels.attention.decode import default_partition
    from voltserve.kernels.runtime.launch_geometry import device_sms

    sms = device_sms(torch.cuda.current_device())
    return default_partition(kvh * group, kvh, head_dim, batch, context, sms, kv=kv)


def fp8_speedups(rows: list[dict]) -> list[dict]:
    """Per point timed with fp16 and an fp8 storage: fp8's speed-up over fp16, the ratio of
    their bytes floors, and the speed-up as a fraction of that ratio (the issue's target: at
    least 0.9 at 128K)."""
    fp16 = {(r["batch"], r["context"]): r for r in rows if r["kv"] == "fp16"}
    out = []
    for r in rows:
        base = fp16.get((r["batch"], r["context"]))
        if r["kv"] == "fp16" or base is None:
            continue
        speedup = base["time_us"] / r["time_us"]
        floors = base["floor_us"] / r["floor_us"]
        out.append(
            dict(
                kv=r["kv"],
                batch=r["batch"],
                context=r["context"],
                speedup=speedup,
                floor_ratio=floors,
                of_floor_ratio=speedup / floors,
            )
        )
    return out


def bench_prefill(q_len: int, kvh: int, group: int, head_dim: int) -> float:
    from voltserve.kernels.attention.prefill import paged_attention_cuda

    H = kvh * group
    n_blocks = q_len // BLOCK
    k = torch.randn((n_blocks, kvh, BLOCK, head_dim), device="cuda", dtype=torch.float16)
    v = torch.randn_like(k)
    tables = torch.arange(n_blocks, device="cuda", dtype=torch.int32).view(1, -1)
    sl = torch.tensor([q_len], dtype=torch.int32, device="cuda")
    qsl = torch.tensor([0, q_len], dtype=torch.int32, device="cuda")
    q = torch.randn((q_len, H, head_dim), device="cuda").half()
    out = torch.empty_like(q)
    return time_graph(
        lambda: paged_attention_cuda(
            q, k, v, tables, sl, qsl, head_dim**-0.5, out, max_query_len=q_len
        ),
        iters=2,
        repeats=5,
    )


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--contexts", default="4096,32768")
    ap.add_argument("--batches", default="1,32")
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--group", type=int, default=4)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument(
        "--sweep",
        default="",
        help="BATCHxCONTEXT,... e.g. 1x512,1x1024: also time the decode kernel's launch variants "
        "there (partition, threads, merge mode, register cap), over each --kv storage",
    )
    ap.add_argument(
        "--partitions", default="", help="sweep only these partition sizes (block core), e.g. 528"
    )
    ap.add_argument(
        "--jobs", type=int, default=1, help="sweep worker processes (compiles run in parallel)"
    )
    ap.add_argument(
        "--kv",
        default="fp16",
        help=f"KV storages to time the decode over, comma-separated, of {','.join(KV_FORMATS)}",
    )
    ap.add_argument(
        "--skip-prefill", action="store_true", help="leave out the prefill kernel's timing"
    )
    ap.add_argument(
        "--cold",
        action="store_true",
        help="time each decode launch (the sweep's too) after a 128 MB copy that evicts its KV "
        "from L2 (as in a served step), less the copies' own time",
    )
    args = ap.parse_args(argv)
    kv_formats = [x.strip() for x in args.kv.split(",") if x.strip()]
    for kv in kv_formats:
        if kv not in KV_FORMATS:
            raise SystemExit(f"--kv: unknown KV storage {kv!r}; expected some of {KV_FORMATS}")
    if not torch.cuda.is_available():
        raise SystemExit("bench_attention needs a CUDA GPU")

    copy_bw = copy_bandwidth()
    rows = []
    for context in (int(x) for x in args.contexts.split(",")):
        for batch in (int(x) for x in args.batches.split(",")):
            iters = 20 if batch * context <= 1 << 17 else 5
            for kv in kv_formats:
                t, nbytes = bench_decode(
                    batch, context, args.kv_heads, args.group, args.head_dim, iters, args.cold, kv
                )
                rows.append(
                    dict(
                        kv=kv,
                        batch=batch,
                        context=context,
                        time_us=t * 1e6,
                        kv_bytes=nbytes,
                        floor_us=nbytes / copy_bw * 1e6,
                        bandwidth_GBps=nbytes / t / 1e9,
                        fraction_of_copy=nbytes / t / copy_bw,
                        partition=partition_for(
                            batch, context, args.kv_heads, args.group, args.head_dim, kv
                        ),
                    )
                )
    fp8_vs_fp16 = fp8_speedups(rows)
    prefill = []
    for q_len in () if args.skip_prefill else (1024, 4096):
        t = bench_prefill(q_len, args.kv_heads, args.group, args.head_dim)
        H = args.kv_heads * args.group
        flops = 4 * H * args.head_dim * q_len * q_len / 2  # causal: half the score matrix
        prefill.append(dict(q_len=q_len, time_ms=t * 1e3, tflops=flops / t / 1e12))

    points = [
        tuple(int(x) for x in p.lower().split("x")) for p in filter(None, args.sweep.split(","))
    ]
    parts = tuple(int(x) for x in args.partitions.split(",") if x.strip())
    sweep = sweep_decode(
        points,
        args.kv_heads,
        args.group,
        args.head_dim,
        args.jobs,
        parts,
        args.cold,
        tuple(kv_formats),
    )

    result = dict(
        device=torch.cuda.get_device_name(),
        shape=dict(
            q_heads=args.kv_heads * args.group, kv_heads=args.kv_heads, head_dim=args.head_dim
        ),
        copy_bandwidth_GBps=copy_bw / 1e9,
        kv_cold=args.cold,
        decode=rows,
        fp8_vs_fp16=fp8_vs_fp16,
        partitions={
            f"{'' if r['kv'] == 'fp16' else r['kv'] + ' '}{r['batch']}x{r['context']}": r[
                "partition"
            ]
            for r in rows
        },
        prefill=prefill,
        sweep=sweep,
    )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    print(f"{result['device']}: device-to-device copy {copy_bw / 1e9:.0f} GB/s")
    print(
        f"{'kv':>9} {'batch':>6} {'context':>8} {'time us':>10} {'floor us':>9} {'GB/s':>8} "
        f"{'of copy':>8}"
    )
    for r in rows:
        print(
            f"{r['kv']:>9} {r['batch']:>6} {r['context']:>8} {r['time_us']:>10.1f} "
            f"{r['floor_us']:>9.1f} {r['bandwidth_GBps']:>8.0f} {r['fraction_of_copy']:>8.1%}"
        )
    for r in fp8_vs_fp16:
        print(
            f"{r['kv']} vs fp16, batch {r['batch']} context {r['context']}: "
            f"{r['speedup']:.2f}x of a {r['floor_ratio']:.2f}x floor ratio "
            f"({r['of_floor_ratio']:.0%})"
        )
    for p in prefill:
        print(f"prefill q_len {p['q_len']}: {p['time_ms']:.2f} ms, {p['tflops']:.1f} TFLOP/s")
    for r in sorted(sweep, key=lambda r: (r["batch"], r["context"], r["time_us"])):
        print(sweep_line(r))


if __name__ == "__main__":
    main()
