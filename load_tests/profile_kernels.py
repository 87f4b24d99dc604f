"""Which kernels a decode step of any checkpoint spends its time in (CUDA only).

profile_decode_step.py times the ops of a dense Llama-shaped step one by one; this script works
for every model the engine loads (MoE, quantized, GGUF) because it does not rebuild the step:
it runs the engine's own decode steps (CUDA graphs as served) under torch.profiler and sums the
GPU kernels it records, by kernel name. Per batch size it prefills B requests of `--prompt-len`
random tokens, decodes `--warm-steps`, then profiles `--steps` steps and reports:

- wall:   the profiled steps' wall time per step (host included);
- busy:   the union of the intervals in which some kernel ran, per step (what the GPU did);
- gaps:   wall - busy: launch gaps inside the graphs and the host's share between them;
- kernels: every kernel name with its launches and time per step, largest first.

--prefill profiles prefill steps instead: each step is one new request of `--prompt-len`
random tokens (max_tokens 1, so the step prefills it, samples and finishes it), as a lone
prompt reaches an idle server. Such steps run eagerly (no CUDA graph), so their gaps are the
host's launch work; --host-profile adds cProfile's view of the same steps (the functions with
the most host time, per step), to see what the host spends it on.

    python load_tests/profile_kernels.py --model-dir /tmp/voltserve-moe-bench --batch-sizes 1 \
        --out results/profile_kernels_moe.json
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

if not __package__:
    import _as_script  # noqa: F401  (load_tests.* importable; see _as_script.py)
from load_tests.common import env_info, write_json  # noqa: E402


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model-dir", required=True, help="a checkpoint folder or .gguf file")
    p.add_argument("--dtype", default="float16")
    p.add_argument("--device", default="cuda", help="cuda (cpu: --prefill's smoke test only)")
    p.add_argument("--batch-sizes", default="1")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--warm-steps", type=int, default=8)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--top", type=int, default=30, help="kernels listed per batch size")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.85)
    p.add_argument(
        "--serve-args", default="", help="EngineConfig fields as k=v,k=v (e.g. quantization=awq)"
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--prefill", action="store_true", help="profile lone prefill steps, not decode steps"
    )
    p.add_argument(
        "--host-profile",
        action="store_true",
        help="with --prefill: also cProfile the steps (host functions by time per step)",
    )
    p.add_argument("--out", help="JSON results file")
    args = p.parse_args(argv)
    args.batch_sizes = [int(b) for b in args.batch_sizes.split(",") if b]
    return args


def _config(args: argparse.Namespace):
    from voltserve.services.executor.engine_args import engine_config

    max_batch = max(args.batch_sizes)
    extra: dict[str, Any] = {}
    for item in filter(None, args.serve_args.split(",")):
        key, _, value = item.partition("=")
        value = value.strip()
        extra[key.strip()] = int(value) if value.isdigit() else value
    total = args.prompt_len + args.warm_steps + args.steps + 16
    # max_model_len=N in --serve-args overrides the short bound: a server's bound (8K) sets
    # the decode graphs' attention grid, so it profiles the step as served.
    max_model_len = extra.pop("max_model_len", total + 16)
    return engine_config(
        model=args.model_dir,
        dtype=args.dtype,
        device=args.device,
        max_model_len=max_model_len,
        max_num_seqs=max(max_batch, 8),
        max_num_batched_tokens=max(8192, args.prompt_len),
        gpu_memory_utilization=args.gpu_memory_utilization,
        max_graph_batch_size=max_batch,
        cuda_graph_sizes=tuple(sorted({1, *args.batch_sizes})),
        seed=args.seed,
        **extra,
    )


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def busy_us(intervals: list[tuple[float, float]]) -> float:
    """Length of the union of [start, end) intervals."""
    total, end = 0.0, float("-inf")
    for s, e in sorted(intervals):
        if s > end:
            total += e - s
            end = e
        elif e > end:
            total += e - end
            end = e
    return total


def summarize(prof, steps: int, wall_ms: float) -> dict[str, Any]:
    """The profiled steps' GPU kernels by name, and wall / busy / gap time per step."""
    kernels: dict[str, list[float]] = {}
    intervals: list[tuple[float, float]] = []
    for ev in prof.events():
        if ev.device_type != torch.autograd.DeviceType.CUDA:
            continue
        if "memcpy" in ev.name.lower() or "memset" in ev.name.lower():
            name = ev.name
        else:
            name = ev.name.split("(")[0][:160]
        r = ev.time_range
        intervals.append((r.start, r.end))
        kernels.setdefault(name, []).append(r.end - r.start)
    rows = sorted(
        (
            {
                "kernel": k,
                "launches_per_step": len(v) / steps,
                "us_per_step": sum(v) / steps,
                "us_each": sum(v) / len(v),
            }
            for k, v in kernels.items()
        ),
        key=lambda r: -r["us_per_step"],
    )
    busy = busy_us(intervals) / steps / 1000.0
    return {
        "steps": steps,
        "wall_ms_per_step": wall_ms,
        "busy_ms_per_step": busy,
        "gap_ms_per_step": wall_ms - busy,
        "kernel_ms_per_step": sum(r["us_per_step"] for r in rows) / 1000.0,
        "launches_per_step": sum(r["launches_per_step"] for r in rows),
        "kernels": rows,
    }


def host_profile(run, steps: int, top: int) -> list[dict[str, Any]]:
    """cProfile over `steps` calls of run(): the `top` functions by own time, per step."""
    import cProfile
    import pstats

    pr = cProfile.Profile()
    pr.enable()
    for _ in range(steps):
        run()
    sync()
    pr.disable()
    st = pstats.Stats(pr)
    rows = []
    for (file, line, fn), (_, ncalls, tottime, cumtime, _) in st.stats.items():  # type: ignore[attr-defined]
        rows.append(
            {
                "function": f"{Path(file).name}:{line}({fn})",
                "calls_per_step": ncalls / steps,
                "own_ms_per_step": 1e3 * tottime / steps,
                "cum_ms_per_step": 1e3 * cumtime / steps,
            }
        )
    rows.sort(key=lambda r: -r["own_ms_per_step"])
    return rows[:top]


def profile_prefill(engine, args: argparse.Namespace, vocab: int) -> dict[str, Any]:
    """Lone prefill steps: one request of --prompt-len tokens each, max_tokens 1."""
    from torch.profiler import ProfilerActivity, profile
    from voltserve.shared.sampling_params import SamplingParams

    rng = np.random.default_rng(args.seed)
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    count = [0]

    def run_one() -> None:
        prompt = rng.integers(0, vocab, size=args.prompt_len).tolist()
        engine.add_request(f"prefill-{count[0]}", prompt, params)
        count[0] += 1
        while engine.has_unfinished_requests():
            engine.step()

    cuda = args.device.startswith("cuda")
    for _ in range(args.warm_steps):
        run_one()
    sync()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        t0 = time.perf_counter()
        for _ in range(args.steps):
            run_one()
        sync()  # the steps end with the sampled token on the host: wall time is host time
        wall_ms = 1e3 * (time.perf_counter() - t0) / args.steps
    out = {"prompt_len": args.prompt_len} | summarize(prof, args.steps, wall_ms)
    if args.host_profile:
        out["host_functions"] = host_profile(run_one, args.steps, args.top)
    return out


def profile_batch(engine, batch: int, args: argparse.Namespace, vocab: int) -> dict[str, Any]:
    from torch.profiler import ProfilerActivity, profile
    from voltserve.shared.sampling_params import SamplingParams

    rng = np.random.default_rng(args.seed + batch)
    n = args.warm_steps + args.steps + 8
    params = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
    for i in range(batch):
        prompt = rng.integers(0, vocab, size=args.prompt_len).tolist()
        engine.add_request(f"p{batch}-{i}", prompt, params)
    # The prefill steps (chunks of max_num_batched_tokens), then warm decode steps.
    budget = engine.config.max_num_batched_tokens
    for _ in range(-(-batch * args.prompt_len // budget) + 1 + args.warm_steps):
        engine.step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        start = torch.cuda.Event(enable_timing=True)
        stop = torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(args.steps):
            engine.step()
        stop.record()
        torch.cuda.synchronize()
    out = {"batch_size": batch} | summarize(prof, args.steps, start.elapsed_time(stop) / args.steps)
    while engine.has_unfinished_requests():
        engine.step()
    return out


def print_summary(what: str, r: dict[str, Any], top: int) -> None:
    print(
        f"{what}: wall {r['wall_ms_per_step']:.3f} ms/step, GPU busy {r['busy_ms_per_step']:.3f}, "
        f"gaps {r['gap_ms_per_step']:.3f}, {r['launches_per_step']:.0f} kernels"
    )
    for row in r["kernels"][:top]:
        print(
            f"  {row['us_per_step']:9.1f} us  {row['launches_per_step']:6.1f} x {row['us_each']:7.2f} us  "
            f"{row['kernel'][:110]}"
        )


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available() and not (args.prefill and args.device == "cpu"):
        print("profile_kernels.py needs a CUDA GPU", file=sys.stderr)
        return 2
    from voltserve.services.executor.engine import LLMEngine

    engine = LLMEngine(_config(args))
    vocab = engine.vocab_size
    result: dict[str, Any] = {"benchmark": "profile_kernels", "env": env_info(), "args": vars(args)}
    if args.prefill:
        r = result["prefill"] = profile_prefill(engine, args, vocab)
        print_summary(f"prefill of {args.prompt_len} tokens", r, args.top)
        for row in r.get("host_functions", []):
            print(
                f"  host {row['own_ms_per_step']:8.3f} ms own {row['cum_ms_per_step']:8.3f} cum "
                f"{row['calls_per_step']:7.1f} calls  {row['function'][:100]}"
            )
    else:
        result["batches"] = []
        for b in args.batch_sizes:
            r = profile_batch(engine, b, args, vocab)
            r["max_num_batched_tokens"] = engine.config.max_num_batched_tokens
            result["batches"].append(r)
            print_summary(f"batch {b}", r, args.top)
    if args.out:
        write_json(args.out, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
