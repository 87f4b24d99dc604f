"""Where a serving run's time goes, step by step.

bench_serving.py says how long a burst takes; this says which steps take it and which kernels
inside them. It runs the same burst (N random prompts of --input-len tokens, --output-len tokens
each, all at once, greedy) through an in-process LLMEngine built from the same serve flags, and:

  (a) records every step: wall time (no synchronization: as a server runs), prefill tokens and
      decode rows in its plan;
  (b) runs a few steps under torch.profiler (CUDA: every kernel on the device, numba's included)
      and sums their kernel time by kind: cuBLAS GEMMs, the GEMV kernels, prefill attention,
      decode attention, norms, rotary + KV write, activation, sampling, copies, other. The
      heaviest kernels are kept by name, so a kernel filed under the wrong kind shows.

By default it profiles the third step (prompts being prefilled while the first requests decode)
and the eighth decode-only step after the last prompt is in. `--profile-steps 2,40` picks steps
by index instead. The profiled steps are synchronized at their end (their kernel sum is the
step's GPU time); the others are not.

    python load_tests/profile_serving_steps.py --preset llama3-8b --model-dir /tmp/voltserve-llama3-8b \
        --num-prompts 256 --input-len 1024 --output-len 256 --out profile_serving.json
"""

from __future__ import annotations

import argparse
import json
import logging
import shlex
import shutil
import statistics
import tempfile
import time
from collections import defaultdict
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

if not __package__:
    import _as_script  # noqa: F401  (load_tests.* importable; see _as_script.py)
from load_tests.bench_serving import engine_config_from_serve_args, random_ids  # noqa: E402
from load_tests.common import (  # noqa: E402
    PRESETS,
    checkpoint_matches,
    env_info,
    write_json,
    write_random_checkpoint,
)

logger = logging.getLogger("profile_serving_steps")

# Kernel kinds, first match wins (lower-case substrings of the kernel's name). numba names its
# kernels after the Python function (mangled), cuBLAS after the GEMM tile shape.
KINDS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("gemv", ("gemv",)),
    ("gemm", ("gemm", "cutlass", "xmma", "cublas", "sm90_", "sm80_", "sm70_", "ampere_", "volta_")),
    ("prefill_attention", ("prefill",)),
    ("decode_attention", ("decode",)),
    ("norm", ("rmsnorm", "norm")),
    ("rotary_kv", ("rotary", "rope", "cache")),
    ("activation", ("silu", "activation", "gelu")),
    ("sampling", ("argmax", "sampl", "softmax", "topk")),
    ("copy", ("memcpy", "memset", "copy", "elementwise", "index", "cat")),
)


def kind_of(name: str) -> str:
    low = name.lower()
    for kind, keys in KINDS:
        if any(k in low for k in keys):
            return kind
    return "other"


@dataclass
class StepRecord:
    index: int
    wall_ms: float
    prefill_tokens: int  # prompt tokens computed in this step
    prefill_rows: int  # requests with a prompt chunk in it
    decode_rows: int  # requests decoding one token
    profiled: bool = False


class PlanTap:
    """Reads each plan the engine hands its model runner (composition only; the call goes on
    unchanged)."""

    def __init__(self, runner: Any) -> None:
        self._execute = runner.execute
        runner.execute = self
        self.last: tuple[int, int, int] = (0, 0, 0)

    def __call__(self, plan: Any) -> Any:
        tokens = rows = decodes = 0
        for s in plan.scheduled:
            r = s.request
            if r.num_computed_tokens >= len(r.prompt_token_ids):
                decodes += 1
            else:
                rows += 1
                tokens += s.num_new_tokens
        self.last = (tokens, rows, decodes)
        return self._execute(plan)


def kernel_table(trace_path: Path) -> list[dict[str, Any]]:
    """Device kernels (and copies/memsets) of a chrome trace: name, count, total us."""
    events = json.loads(trace_path.read_text()).get("traceEvents", [])
    tot: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    for ev in events:
        if ev.get("ph") != "X" or ev.get("cat", "").lower() not in (
            "kernel",
            "gpu_memcpy",
            "gpu_memset",
        ):
            continue
        t = tot[ev.get("name", "?")]
        t[0] += 1
        t[1] += float(ev.get("dur", 0.0))
    rows = [
        {"name": n, "count": int(c), "us": us, "kind": kind_of(n)} for n, (c, us) in tot.items()
    ]
    return sorted(rows, key=lambda r: -r["us"])


def profile_step(engine: Any, device: str, workdir: Path, index: int) -> dict[str, Any]:
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU]
    if device == "cuda":
        acts.append(ProfilerActivity.CUDA)
    with profile(activities=acts) as prof:
        engine.step()
        if device == "cuda":
            torch.cuda.synchronize()
    trace = workdir / f"step{index}.json"
    prof.export_chrome_trace(str(trace))
    kernels = kernel_table(trace)
    by_kind: dict[str, float] = defaultdict(float)
    for k in kernels:
        by_kind[k["kind"]] += k["us"]
    return {
        "kernel_ms": sum(k["us"] for k in kernels) / 1e3,
        "by_kind_ms": {k: v / 1e3 for k, v in sorted(by_kind.items(), key=lambda kv: -kv[1])},
        "top_kernels": kernels[:25],
        "num_kernels": sum(k["count"] for k in kernels),
    }


def run(args: argparse.Namespace, model_dir: Path, workdir: Path) -> dict[str, Any]:
    from voltserve.services.executor.engine import LLMEngine
    from voltserve.shared.sampling_params import SamplingParams

    config = engine_config_from_serve_args(model_dir, shlex.split(args.serve_args))
    engine = LLMEngine(config)
    device = engine.runner.device.type
    vocab = engine.runner.vocab_size
    rng = np.random.default_rng(args.seed)

    def prompt() -> list[int]:
        return random_ids(rng, vocab, args.input_len)

    params = SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True)
    # Warm-up as bench_serving does: two short requests, so first-use costs stay out.
    engine.generate(
        [prompt() for _ in range(2)],
        SamplingParams(max_tokens=min(args.output_len, 4), temperature=0.0, ignore_eos=True),
    )
    tap = PlanTap(engine.runner)
    for i in range(args.num_prompts):
        engine.add_request(f"r{i}", prompt(), params)
    wanted = {int(x) for x in args.profile_steps.split(",")} if args.profile_steps else None
    steps: list[StepRecord] = []
    profiles: dict[str, Any] = {}
    decode_only_run = 0
    t0 = time.perf_counter()
    index = 0
    while engine.has_unfinished_requests():
        if wanted is None:
            do_profile = index == 2 or decode_only_run == 8
        else:
            do_profile = index in wanted
        t = time.perf_counter()
        if do_profile:
            prof = profile_step(engine, device, workdir, index)
        else:
            engine.step()
        wall = (time.perf_counter() - t) * 1e3
        tokens, rows, decodes = tap.last
        rec = StepRecord(index, wall, tokens, rows, decodes, do_profile)
        steps.append(rec)
        if do_profile:
            profiles[str(index)] = {**asdict(rec), **prof}
        decode_only_run = decode_only_run + 1 if tokens == 0 and decodes else 0
        index += 1
        if index > args.max_steps:
            raise RuntimeError(f"the burst did not finish in {args.max_steps} steps")
    duration = time.perf_counter() - t0
    # Phase figures leave the profiled steps out (the profiler slows the host side).
    prefill = [s for s in steps if s.prefill_tokens and not s.profiled]
    decode = [s for s in steps if not s.prefill_tokens and s.decode_rows and not s.profiled]
    return {
        "duration_s": duration,
        "output_tok_s": args.num_prompts * args.output_len / duration,
        "num_steps": len(steps),
        "prefill_steps": len(prefill),
        "prefill_phase_s": sum(s.wall_ms for s in prefill) / 1e3,
        "decode_only_steps": len(decode),
        "decode_only_s": sum(s.wall_ms for s in decode) / 1e3,
        "median_prefill_step_ms": statistics.median(s.wall_ms for s in prefill)
        if prefill
        else None,
        "median_decode_step_ms": statistics.median(s.wall_ms for s in decode) if decode else None,
        "total_prefill_tokens": sum(s.prefill_tokens for s in steps),
        "total_decode_rows": sum(s.decode_rows for s in steps),
        "steps": [asdict(s) for s in steps],
        "profiles": profiles,
    }


def print_summary(r: dict[str, Any]) -> None:
    print(
        f"{r['num_steps']} steps in {r['duration_s']:.2f} s ({r['output_tok_s']:.0f} output tok/s); "
        f"unprofiled: {r['prefill_steps']} with prefill ({r['prefill_phase_s']:.2f} s, median "
        f"{r['median_prefill_step_ms'] or 0:.1f} ms), {r['decode_only_steps']} decode-only "
        f"({r['decode_only_s']:.2f} s, median {r['median_decode_step_ms'] or 0:.2f} ms)"
    )
    for idx, p in r["profiles"].items():
        print(
            f"step {idx}: {p['prefill_tokens']} prefill tokens in {p['prefill_rows']} rows, "
            f"{p['decode_rows']} decode rows; wall {p['wall_ms']:.1f} ms (profiled), kernels "
            f"{p['kernel_ms']:.1f} ms ({p['num_kernels']} launches)"
        )
        for kind, ms in p["by_kind_ms"].items():
            print(f"  {kind:<18}{ms:>10.2f} ms")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument(
        "--preset",
        choices=sorted(PRESETS),
        help="random-weight checkpoint of this shape, written once into --model-dir (or a temp)",
    )
    p.add_argument("--model-dir", help="the checkpoint folder (with --preset: reused or written)")
    p.add_argument("--num-prompts", type=int, default=256)
    p.add_argument("--input-len", type=int, default=1024)
    p.add_argument("--output-len", type=int, default=256)
    p.add_argument("--serve-args", default="", help="`voltserve serve` flags for the engine")
    p.add_argument("--profile-steps", default=None, help="step indices (default: see above)")
    p.add_argument("--max-steps", type=int, default=100_000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--workdir", default=None, help="keep the chrome traces here")
    p.add_argument("--out", help="JSON results file")
    args = p.parse_args(argv)
    if not args.preset and not args.model_dir:
        p.error("give --preset (a random-weight checkpoint) or --model-dir (an existing one)")
    for name in ("num_prompts", "input_len", "output_len"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    logging.getLogger("numba").setLevel(logging.WARNING)  # a line per CUDA module unload
    tmp = []
    model_dir = Path(args.model_dir) if args.model_dir else None
    if model_dir is None:
        tmp.append(tempfile.mkdtemp(prefix=f"voltserve-{args.preset}-"))  # --preset given
        model_dir = Path(tmp[-1])
    workdir = Path(args.workdir) if args.workdir else None
    if workdir is None:
        tmp.append(tempfile.mkdtemp(prefix="voltserve-traces-"))
        workdir = Path(tmp[-1])
    workdir.mkdir(parents=True, exist_ok=True)
    try:
        if args.preset is None:
            if not (model_dir / "config.json").exists():
                raise SystemExit(f"{model_dir} holds no config.json")
        elif not checkpoint_matches(model_dir, args.preset):
            logger.info("writing a random %s checkpoint to %s", args.preset, model_dir)
            device = "cuda" if torch.cuda.is_available() else "cpu"
            dtype = torch.float16 if device == "cuda" else torch.float32
            write_random_checkpoint(model_dir, args.preset, device, dtype, seed=args.seed)
        result = {
            "benchmark": "profile_serving_steps",
            "preset": args.preset,
            "args": vars(args),
            "env": env_info("cuda" if torch.cuda.is_available() else "cpu"),
            **run(args, model_dir, workdir),
        }
    finally:
        for t in tmp:
            shutil.rmtree(t, ignore_errors=True)
    print_summary(result)
    write_json(args.out, result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
