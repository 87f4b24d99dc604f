"""Where the time of one decode step goes (CUDA only).

For each batch size (default 1 and 8) it prefills B requests of `--prompt-len` tokens, decodes a
few warm steps, then measures:

  (a) graph:    the captured decode graph of that batch size replayed alone (CUDA events, median)
  (b) step:     engine.step() wall time in steady decode (median); execute = the model runner's
                share of it. (b) - (a) is the CPU and the host<->device traffic outside the graph.
  (c) per op:   each op of the step at the model's decode shapes, timed in isolation as a CUDA
                graph of `--launches` launches (median replay / launches). Linears and the
                per-layer KV reads rotate over the model's own layers, so the L2 cache holds
                nothing a real step would not find there. Linears are timed on cuBLAS (torch) and
                on the gemv kernel; the step uses the one KernelDispatch picked (VOLTSERVE_GEMV).

It prints one table per batch size (op, count per step, us each, us per step) with the sum of the
ops against the measured graph time, and writes everything to --out as JSON.

    python load_tests/profile_decode_step.py --preset llama3-8b --model-dir /tmp/voltserve-llama3-8b \
        --out results/profile_decode.json
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

if not __package__:
    import _as_script  # noqa: F401  (load_tests.* importable; see _as_script.py)
from load_tests.common import (  # noqa: E402
    PRESETS,
    checkpoint_matches,
    dtype_name,
    env_info,
    make_hf_config,
    measure_copy_bandwidth,
    weight_bytes,
    write_json,
    write_random_checkpoint,
)

logger = logging.getLogger("profile_decode_step")


# ---------------------------------------------------------------------------------------------
# Timing


def time_replays(replay: Callable[[], None], reps: int) -> float:
    """Median seconds of replay() measured with CUDA events."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start.record()
        replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def time_op(fn: Callable[[int], Any], launches: int, reps: int) -> float:
    """Seconds per launch of fn(i), i = 0..launches-1, captured as one CUDA graph."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn(0)  # compiles numba kernels, lets cuBLAS pick its kernels, outside the capture
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for i in range(launches):
            fn(i)
    t = time_replays(g.replay, reps) / launches
    del g
    return t


# ---------------------------------------------------------------------------------------------
# The engine


def batched_tokens(args) -> int:
    return max(8192, args.prompt_len)


def output_budget(args, batch: int) -> int:
    """Tokens a request may generate: the timed steps, plus the steps the first requests decode
    while the batch's later prompts are still prefilling (chunked prefill runs them together),
    plus slack."""
    budget = batched_tokens(args) - batch  # what the decoding rows leave a step for prefill
    prefill_steps = -(-batch * args.prompt_len // budget) + 1
    return args.warm_steps + args.steps + prefill_steps + 8


def make_engine(model_dir: Path, args, max_batch: int):
    from voltserve.services.executor.engine import LLMEngine
    from voltserve.services.executor.engine_args import engine_config

    config = engine_config(
        model=str(model_dir),
        dtype="float16",
        device="cuda",
        max_model_len=args.prompt_len + output_budget(args, max_batch) + 64,
        max_num_seqs=max(8, max_batch),
        max_num_batched_tokens=batched_tokens(args),
        gpu_memory_utilization=args.gpu_memory_utilization,
        max_graph_batch_size=max(8, max_batch),
        # Only the profiled sizes: their steps are pure decode steps of exactly these sizes.
        cuda_graph_sizes=tuple(sorted(set(args.batch_sizes))),
        seed=0,
    )
    return LLMEngine(config)


class _Timed:
    """Wraps the runner's execute to record its wall time (instrumentation only)."""

    def __init__(self, fn: Callable) -> None:
        self.fn = fn
        self.times: list[float] = []

    def __call__(self, plan):
        t = time.perf_counter()
        out = self.fn(plan)
        self.times.append(time.perf_counter() - t)
        return out


def decode_timings(engine, batch: int, args, rng) -> dict[str, Any]:
    """Prefill `batch` requests, then (a) graph replay alone and (b) engine.step() walls."""
    from voltserve.shared.sampling_params import SamplingParams

    vocab = engine.vocab_size
    n_steps = args.warm_steps + args.steps
    params = SamplingParams(max_tokens=output_budget(args, batch), temperature=0.0, ignore_eos=True)
    ids = [f"p{batch}-{i}" for i in range(batch)]
    for rid in ids:
        engine.add_request(rid, rng.integers(16, vocab, size=args.prompt_len).tolist(), params)
    have_first: set[str] = set()
    guard = 0
    while len(have_first) < batch:
        for o in engine.step():
            if o.new_token_ids:
                have_first.add(o.request_id)
        guard += 1
        if guard > 10_000:
            raise RuntimeError("prefill does not finish")
    runner = engine.runner
    timed = _Timed(runner.execute)
    runner.execute = timed
    step_s: list[float] = []
    try:
        # Warm steps settle the batch (with the pipelined decode, the rows whose prefill ended
        # last join one step later); every timed step must then be a whole-batch graph replay.
        for _ in range(args.warm_steps):
            engine.step()
        replays_before = runner.graphs.num_replays
        for _ in range(args.steps):
            t = time.perf_counter()
            outs = engine.step()
            dt = time.perf_counter() - t
            if len(outs) != batch:
                raise RuntimeError(f"decode step returned {len(outs)} outputs, expected {batch}")
            step_s.append(dt)
    finally:
        del runner.execute  # back to the class's method
    if runner.graphs.num_replays - replays_before != args.steps:
        raise RuntimeError("decode steps did not all run as CUDA graphs")
    bs = runner.graphs.padded_size(batch)
    graph_s = time_replays(runner.graphs.graphs[bs].replay, args.reps)
    exec_s = timed.times[args.warm_steps :]  # execute runs once per step
    return {
        "ids": ids,
        "padded_batch": bs,
        "graph_replay_us": graph_s * 1e6,
        "step_wall_us": statistics.median(step_s) * 1e6,
        "execute_wall_us": statistics.median(exec_s) * 1e6,
        "outside_graph_us": (statistics.median(step_s) - graph_s) * 1e6,
        "context": args.prompt_len + n_steps,
    }


# ---------------------------------------------------------------------------------------------
# Per-op timings


def op_table(engine, bs: int, args) -> list[dict[str, Any]]:
    """One row per op of the decode step at padded batch size bs."""
    from voltserve.kernels.linear.gemv import gemv_cuda, gemv_gate_up_cuda, supports
    from voltserve.kernels.sampling.sampling import chunked_argmax
    from voltserve.services.executor.linear_plan import gate_up_impl, linear_impl

    runner = engine.runner
    model, ops, arch, g = runner.model, runner.ops, runner.arch, runner.graphs
    layers = list(model.model.layers)
    L = len(layers)
    dev, dt = runner.device, runner.dtype
    H, D = arch.hidden_size, arch.head_dim
    q_size, kv_size = arch.num_heads * D, arch.num_kv_heads * D
    launches = max(args.launches, L)  # every layer's weights at least once
    rows: list[dict[str, Any]] = []
    uses_gemv = ops.impl["gemv"] == "cuda"

    def add(name: str, count: int, seconds: float, **extra: Any) -> None:
        rows.append(
            {
                "op": name,
                "count": count,
                "us_each": seconds * 1e6,
                "us_per_step": seconds * 1e6 * count,
                **extra,
            }
        )

    def linear_row(
        name: str, weights: list[torch.Tensor], biases: list, count: int, gate_up: bool = False
    ) -> str:
        """cuBLAS and the gemv kernel on the layer weights; `impl` is what the step runs (the
        runner's linear plan). For the gate_up projection the fused gemv_gate_up (GEMV and
        silu_and_mul in one kernel) is timed too and `impl` may be "gemv_gate_up"."""
        N, K = weights[0].shape
        x = torch.randn(bs, K, device=dev, dtype=dt)
        n_w = len(weights)
        t_blas = time_op(
            lambda i: F.linear(x, weights[i % n_w], biases[i % n_w]), launches, args.reps
        )
        t_gemv = t_fused = None
        if supports(x, weights[0]):
            out = torch.empty(bs, N, device=dev, dtype=dt)
            t_gemv = time_op(
                lambda i: gemv_cuda(x, weights[i % n_w], biases[i % n_w], out=out),
                launches,
                args.reps,
            )
            if gate_up:
                act = torch.empty(bs, N // 2, device=dev, dtype=dt)
                t_fused = time_op(
                    lambda i: gemv_gate_up_cuda(x, weights[i % n_w], biases[i % n_w], out=act),
                    launches,
                    args.reps,
                )
        lookup = gate_up_impl if gate_up else linear_impl
        impl = lookup(ops, bs, N, K) if uses_gemv else "cublas"
        used = {"gemv": t_gemv, "gemv_gate_up": t_fused}.get(impl) or t_blas
        nbytes = N * K * weights[0].element_size()
        add(
            name,
            count,
            used,
            shape=[bs, K, N],
            cublas_us=t_blas * 1e6,
            gemv_us=None if t_gemv is None else t_gemv * 1e6,
            gemv_gate_up_us=None if t_fused is None else t_fused * 1e6,
            weight_bytes=nbytes,
            cublas_GBps=nbytes / t_blas / 1e9,
            gemv_GBps=None if t_gemv is None else nbytes / t_gemv / 1e9,
            impl=impl,
        )
        return impl

    att = [ly.self_attn for ly in layers]
    mlp = [ly.mlp for ly in layers]
    linear_row("qkv_proj", [a.qkv_proj.weight for a in att], [a.qkv_proj.bias for a in att], L)
    caches = runner.kv_caches
    positions = g.positions[:bs]
    slots = g.slot_mapping[:bs]  # the last step's slots: rewritten, then the requests end
    # Where the model fuses rotary and the KV write into the qkv GEMV (asked of the model
    # itself), the step runs that kernel instead of qkv_proj + rotary_and_cache.
    from voltserve.services.executor.models.layers import AttentionMetadata

    xq = torch.randn(bs, H, device=dev, dtype=dt)
    decode_meta = AttentionMetadata(
        slots,
        g.block_tables[:bs],
        g.seq_lens[:bs],
        torch.arange(bs + 1, dtype=torch.int32, device=dev),
        is_decode=True,
    )
    qkv_fused = att[0]._qkv_rope_fused(ops, xq, decode_meta, model.cos_sin_cache)
    if qkv_fused:
        from voltserve.kernels.linear.gemv_qkv_rope import gemv_qkv_rope_cuda

        qkv_out = torch.empty(bs, q_size + 2 * kv_size, device=dev, dtype=dt)
        t_fused = time_op(
            lambda i: gemv_qkv_rope_cuda(
                xq,
                att[i % L].qkv_proj.weight,
                att[i % L].qkv_proj.bias,
                positions,
                model.cos_sin_cache,
                *caches[i % L],
                slots,
                arch.num_heads,
                arch.num_kv_heads,
                out=qkv_out,
            ),
            launches,
            args.reps,
        )
        rows[-1].update(
            impl="gemv_qkv_rope",
            us_each=t_fused * 1e6,
            us_per_step=t_fused * 1e6 * L,
            gemv_qkv_rope_us=t_fused * 1e6,
        )
    linear_row("o_proj", [a.o_proj.weight for a in att], [a.o_proj.bias for a in att], L)
    gate_up = linear_row(
        "gate_up_proj",
        [m.gate_up_proj.weight for m in mlp],
        [m.gate_up_proj.bias for m in mlp],
        L,
        True,
    )
    linear_row("down_proj", [m.down_proj.weight for m in mlp], [m.down_proj.bias for m in mlp], L)
    linear_row("lm_head", [model.lm_head_weight()], [None], 1)

    x = torch.randn(bs, H, device=dev, dtype=dt)
    res = torch.randn(bs, H, device=dev, dtype=dt)
    norm_w = [ly.input_layernorm.weight for ly in layers]
    eps = arch.rms_norm_eps
    add("rms_norm", 1, time_op(lambda i: ops.rms_norm(x, norm_w[i % L], eps), launches, args.reps))
    add(
        "fused_add_rms_norm",
        2 * L,
        time_op(lambda i: ops.fused_add_rms_norm(x, res, norm_w[i % L], eps), launches, args.reps),
    )
    if arch.qk_norm:
        qh = torch.randn(bs * arch.num_heads, D, device=dev, dtype=dt)
        qn = [a.q_norm.weight for a in att]
        add(
            "qk_rms_norm",
            2 * L,
            time_op(lambda i: ops.rms_norm(qh, qn[i % L], eps), launches, args.reps),
        )
    qkv = torch.randn(bs, q_size + 2 * kv_size, device=dev, dtype=dt)
    q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
    add(
        "rotary_and_cache",
        0 if qkv_fused else L,
        time_op(
            lambda i: ops.rotary_and_cache(
                positions, q, k, v, D, model.cos_sin_cache, True, *caches[i % L], slots
            ),
            launches,
            args.reps,
        ),
    )
    inter = arch.intermediate_size
    gu = torch.randn(bs, 2 * inter, device=dev, dtype=dt)
    # Fused into the gate_up projection when the plan runs gemv_gate_up there.
    add(
        "silu_and_mul",
        0 if gate_up == "gemv_gate_up" else L,
        time_op(lambda i: ops.silu_and_mul(gu), launches, args.reps),
    )
    q3 = torch.randn(bs, arch.num_heads, D, device=dev, dtype=dt)
    tables, lens = g.block_tables[:bs], g.seq_lens[:bs]
    scale = D**-0.5
    add(
        "paged_decode_attention",
        L,
        time_op(
            lambda i: ops.paged_decode_attention(
                q3, caches[i % L][0], caches[i % L][1], tables, lens, scale
            ),
            launches,
            args.reps,
        ),
        context=int(lens[0].item()),
    )
    ids = g.input_ids[:bs]
    emb = model.model.embed_tokens.weight
    add("embedding", 1, time_op(lambda i: F.embedding(ids, emb), launches, args.reps))
    logits = torch.randn(bs, arch.vocab_size, device=dev, dtype=dt)
    # The graph ends with the logits in the model's dtype and their (chunked) argmax, which the
    # sampler's greedy path copies back (other sampling widens the logits outside the graph).
    add("argmax", 1, time_op(lambda i: chunked_argmax(logits), launches, args.reps))
    return rows


# ---------------------------------------------------------------------------------------------


def print_table(title: str, rows: list[dict[str, Any]], timings: dict[str, Any]) -> None:
    print(f"\n=== {title}")
    print(f"{'op':34s} {'count':>6s} {'us each':>9s} {'us/step':>9s}   cublas/gemv us (GB/s)")
    for r in rows:
        extra = ""
        if "cublas_us" in r:
            g = r["gemv_us"]
            gb = r["gemv_GBps"]
            extra = f"   {r['cublas_us']:.1f} ({r['cublas_GBps']:.0f}) / " + (
                f"{g:.1f} ({gb:.0f}) [{r['impl']}]" if g is not None else "n/a"
            )
        print(f"{r['op']:34s} {r['count']:6d} {r['us_each']:9.2f} {r['us_per_step']:9.1f}{extra}")
    in_graph = sum(r["us_per_step"] for r in rows if r.get("in_graph", True))
    print(f"{'sum of in-graph ops':34s} {'':6s} {'':9s} {in_graph:9.1f}")
    print(f"{'(a) graph replay, measured':34s} {'':6s} {'':9s} {timings['graph_replay_us']:9.1f}")
    print(f"{'(b) engine.step() wall':34s} {'':6s} {'':9s} {timings['step_wall_us']:9.1f}")
    print(f"{'    of which runner.execute':34s} {'':6s} {'':9s} {timings['execute_wall_us']:9.1f}")
    print(
        f"{'(b) - (a): outside the graph':34s} {'':6s} {'':9s} {timings['outside_graph_us']:9.1f}"
    )


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--preset", choices=sorted(PRESETS), default="llama3-8b")
    p.add_argument("--model-dir", help="reuse (or write once into) this checkpoint folder")
    p.add_argument("--batch-sizes", default="1,8")
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--warm-steps", type=int, default=8)
    p.add_argument("--steps", type=int, default=50, help="timed engine steps (median)")
    p.add_argument("--reps", type=int, default=50, help="graph replays per timing (median)")
    p.add_argument("--launches", type=int, default=100, help="launches per op graph")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", help="JSON results file")
    args = p.parse_args(argv)
    args.batch_sizes = [int(x) for x in args.batch_sizes.split(",") if x.strip()]
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    logging.getLogger("numba").setLevel(logging.WARNING)  # a line per CUDA module unload
    if not torch.cuda.is_available():
        raise SystemExit("profile_decode_step needs a CUDA GPU")
    device, dtype = "cuda", torch.float16
    # One graph replay per engine step, so (b) - (a) is the host's share of a step: the
    # pipelined decode (on by default) hides that share by launching steps ahead.
    os.environ["VOLTSERVE_PIPELINE_DECODE"] = "0"
    hf_config = make_hf_config(args.preset, dtype)
    wbytes = weight_bytes(hf_config, dtype)
    bw = measure_copy_bandwidth(device)
    floor_us = wbytes["read_per_token_bytes"] / (bw["bandwidth_GBps"] * 1e9) * 1e6
    result: dict[str, Any] = {
        "benchmark": "profile_decode_step",
        "preset": args.preset,
        "dtype": dtype_name(dtype),
        "env": env_info(device),
        "args": vars(args),
        "copy_bandwidth": bw,
        "weight_read_bytes": wbytes["read_per_token_bytes"],
        "floor_us": floor_us,
        "batches": {},
    }
    tmp = None
    model_dir = Path(args.model_dir) if args.model_dir else None
    if model_dir is None:
        tmp = tempfile.mkdtemp(prefix=f"voltserve-{args.preset}-")
        model_dir = Path(tmp)
    try:
        if not checkpoint_matches(model_dir, args.preset):
            logger.info("writing a random %s checkpoint to %s", args.preset, model_dir)
            write_random_checkpoint(model_dir, args.preset, device, dtype, seed=args.seed)
        engine = make_engine(model_dir, args, max(args.batch_sizes))
        if engine.runner.graphs is None:
            raise SystemExit("the engine captured no CUDA graphs: nothing to profile")
        result["kernel_impl"] = dict(engine.runner.ops.impl)
        rng = np.random.default_rng(args.seed)
        for b in args.batch_sizes:
            logger.info("batch %d: decode timings", b)
            timings = decode_timings(engine, b, args, rng)
            ids = timings.pop("ids")
            logger.info("batch %d: per-op timings", b)
            rows = op_table(engine, timings["padded_batch"], args)
            engine.abort_request(ids)
            while engine.has_unfinished_requests():
                engine.step()
            in_graph = sum(r["us_per_step"] for r in rows if r.get("in_graph", True))
            result["batches"][str(b)] = {
                **timings,
                "ops": rows,
                "sum_in_graph_ops_us": in_graph,
                "floor_fraction_graph": floor_us / timings["graph_replay_us"],
                "floor_fraction_step": floor_us / timings["step_wall_us"],
            }
            print_table(f"{args.preset} batch {b} (floor {floor_us:.0f} us)", rows, timings)
    finally:
        if tmp:
            shutil.rmtree(tmp, ignore_errors=True)
    write_json(args.out, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
