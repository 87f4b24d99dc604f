"""Host (Python) time of one engine step, measured on the CPU with the model's arithmetic taken out.

A decode step on a GPU is the graph replay plus host work that is not overlapped with it:
scheduling, filling the graph's staging buffer, the sampler's Python around the argmax, the copy
back, updating requests, building RequestOutputs and, in the executor service, turning them into
StepOutput messages (and msgpack bytes, on the I/O thread that shares the GIL). This script runs
a real LLMEngine (real batcher, block manager, model runner, sampler) on a tiny random checkpoint
with a *null forward*: the model (or the decode graph's replay) returns a fixed logits buffer, so
what is timed is the host work alone. The decode path is the CUDA-graph path
(`CudaGraphRunner.stage` / `replay_staged`, emulated on the CPU: the same staging buffers, a
no-op replay), as on a GPU; `--no-graphs` times the eager `prepare()` path instead.

Phases per step (perf_counter around the engine's own methods, nothing changed in the engine):
  schedule       Batcher.schedule
  prepare        InputBatch.stage_decode (graph) or InputBatch.prepare (eager)
  forward        the null forward (graph replay / model call): ~0, reported to show it is out
  sample         the sampler (argmax over the tiny vocab + the device->host copy + Python)
  execute_other  the rest of ModelRunner.execute
  update         the rest of LLMEngine.step: request state, stop checks, RequestOutputs
  publish        EngineLoop._publish: RequestDeltas and StepOutputs (services/executor/service.py)
  stats          LLMEngine.stats, which the executor loop calls after every step
  encode         protocol.encode of the step's StepOutputs (the Redis writer's serialization)
  host           everything above except forward: the engine thread's host time per step
                 plus the encode that competes with it for the GIL

Cases: decode-only steps at each --batch-sizes (prompts of --context tokens, prefilled first),
and a mixed step (--mixed-decodes decodes + one --mixed-prefill-token prompt, eager path).

    python load_tests/bench_step_overhead.py --out load_tests/results/step_overhead_cpu.json
"""

from __future__ import annotations

import argparse
import gc
import statistics
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import numpy as np
import torch

if not __package__:
    import _as_script  # noqa: F401  (load_tests.* importable; see _as_script.py)
from voltserve.services.executor.cuda_graphs import CudaGraphRunner  # noqa: E402
from voltserve.services.executor.engine import LLMEngine  # noqa: E402
from voltserve.services.executor.engine_args import engine_config  # noqa: E402
from voltserve.services.executor.service import EngineLoop  # noqa: E402
from voltserve.shared.protocol import EngineRequest, encode  # noqa: E402
from voltserve.shared.sampling_params import SamplingParams  # noqa: E402

from load_tests.common import env_info, write_json, write_random_checkpoint  # noqa: E402

PHASES = (
    "schedule",
    "prepare",
    "forward",
    "sample",
    "execute_other",
    "update",
    "publish",
    "stats",
    "encode",
)
HOST_PHASES = tuple(p for p in PHASES if p != "forward")


class _NoReplay:
    def replay(self) -> None:
        pass


class NullGraphs(CudaGraphRunner):
    """The decode graph runner with its real staging buffers and a replay that does nothing:
    every padded size's output is a fixed random logits buffer."""

    def _capture_all(self) -> None:
        n = self.sizes[-1]
        logits = torch.randn(n, self.model.vocab_size)
        for bs in self.sizes:
            self.outputs[bs] = logits[:bs]
            self.argmax[bs] = logits[:bs].argmax(dim=-1)  # the graph computes it on the device
            self.graphs[bs] = _NoReplay()


class NullModel:
    """Stands in for the model: the logits rows it is asked for, from a fixed random buffer."""

    def __init__(self, vocab_size: int, rows: int) -> None:
        self.vocab_size = vocab_size
        self.logits = torch.randn(rows, vocab_size)
        self.ops = None

    def __call__(self, input_ids, positions, meta, kv_caches, logits_indices):
        if logits_indices is None:
            return self.logits[: len(input_ids)]
        return self.logits[: len(logits_indices)]


class PhaseClock:
    """Per-phase seconds of the current step, filled by wrappers around engine methods."""

    def __init__(self) -> None:
        self.cur: dict[str, float] = defaultdict(float)

    def wrap(self, fn, phase: str):
        cur = self.cur
        perf = time.perf_counter

        def timed(*a, **k):
            t = perf()
            try:
                return fn(*a, **k)
            finally:
                cur[phase] += perf() - t

        return timed

    def reset(self) -> None:
        self.cur.clear()


class TimedSampler:
    """The runner's sampler with every entry point timed as the "sample" phase."""

    def __init__(self, inner, clock: PhaseClock) -> None:
        self._inner = inner
        self._call = clock.wrap(inner.__call__, "sample")
        if hasattr(inner, "sample_last"):
            self.sample_last = clock.wrap(inner.sample_last, "sample")

    def __call__(self, *a, **k):
        return self._call(*a, **k)

    def __getattr__(self, name: str):
        return getattr(self._inner, name)


def build_engine(model_dir: Path, args, num_blocks: int, max_seqs: int, graphs: bool):
    cfg = engine_config(
        model=str(model_dir),
        device="cpu",
        num_kv_blocks=num_blocks,
        max_num_seqs=max_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=min(args.max_model_len, num_blocks * 16),
        enable_prefix_caching=not args.no_prefix_caching,
    )
    engine = LLMEngine(cfg)
    runner = engine.runner
    runner.model = NullModel(runner.vocab_size, max(args.max_num_batched_tokens, max_seqs))
    runner.null_model = runner.model
    runner.kv_caches = []  # the null forward never reads it
    if graphs:
        runner.graphs = NullGraphs(runner, max_seqs)
    return engine


def instrument(engine: LLMEngine, clock: PhaseClock) -> None:
    runner = engine.runner
    engine.batcher.schedule = clock.wrap(engine.batcher.schedule, "schedule")
    staged = runner.input_batch
    staged.prepare = clock.wrap(staged.prepare, "prepare")
    staged.stage_decode = clock.wrap(staged.stage_decode, "prepare")
    runner.model = clock.wrap(runner.model, "forward")
    if runner.graphs is not None:
        runner.graphs.replay_staged = clock.wrap(runner.graphs.replay_staged, "forward")
    runner.sampler = TimedSampler(runner.sampler, clock)
    runner.execute = clock.wrap(runner.execute, "execute")


class Driver:
    """An EngineLoop driven step by step on this thread (no Redis): add through the service's
    own path, then step, publish, stats, encode, each timed."""

    def __init__(self, engine: LLMEngine, gateways: int) -> None:
        self.engine = engine
        self.clock = PhaseClock()
        instrument(engine, self.clock)
        self.emitted: list[Any] = []
        self.loop = EngineLoop(engine, "bench")
        self.loop.emit = lambda gw, msg: self.emitted.append(msg)
        self.gateways = gateways
        self.n = 0

    def add(self, prompt: list[int], max_tokens: int) -> None:
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, seed=1)
        req = EngineRequest(
            request_id=f"r{self.n}",
            gateway_id=f"gw{self.n % self.gateways}",
            prompt_token_ids=prompt,
            sampling=params.to_dict(),
            arrival_time=time.time(),
        )
        self.n += 1
        self.emitted.clear()
        self.loop._apply("add", req)
        if self.emitted:
            raise RuntimeError(f"the engine rejected a request: {self.emitted}")

    def step(self) -> tuple[dict[str, float], int]:
        """One step as the executor loop runs it; per-phase seconds and the outputs' count."""
        clock, perf = self.clock, time.perf_counter
        clock.reset()
        self.emitted.clear()
        t0 = perf()
        outputs = self.engine.step()
        t1 = perf()
        self.loop.step_count += 1
        if outputs:
            self.loop._publish(outputs, t0)
        t2 = perf()
        self.loop.latest_stats = self.engine.stats()
        t3 = perf()
        for msg in self.emitted:
            encode(msg)
        t4 = perf()
        c = clock.cur
        ph = {p: c.get(p, 0.0) for p in ("schedule", "prepare", "forward", "sample")}
        ph["execute_other"] = c.get("execute", 0.0) - ph["prepare"] - ph["forward"] - ph["sample"]
        ph["update"] = (t1 - t0) - c.get("schedule", 0.0) - c.get("execute", 0.0)
        ph["publish"] = t2 - t1
        ph["stats"] = t3 - t2
        ph["encode"] = t4 - t3
        return ph, len(outputs)


def summarize(steps: list[dict[str, float]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for p in PHASES:
        xs = [s[p] * 1e3 for s in steps]
        out[p] = {"median_ms": statistics.median(xs), "mean_ms": statistics.fmean(xs)}
    host = [sum(s[p] for p in HOST_PHASES) * 1e3 for s in steps]
    engine = [
        sum(s[p] for p in HOST_PHASES if p not in ("publish", "stats", "encode")) * 1e3
        for s in steps
    ]
    out["host"] = {"median_ms": statistics.median(host), "mean_ms": statistics.fmean(host)}
    out["engine_host"] = {
        "median_ms": statistics.median(engine),
        "mean_ms": statistics.fmean(engine),
    }
    out["host_ms_all"] = host
    return out


def run_decode(model_dir: Path, args, batch: int, rng: np.random.Generator) -> dict[str, Any]:
    bs = 16
    # Requests that finish prefill early decode while the rest prefill: room for those steps too.
    prefill_steps = -(-batch * args.context // args.max_num_batched_tokens) + 1
    budget = prefill_steps + args.warmup + args.steps + 2
    blocks = batch * -(-(args.context + budget) // bs) + 8
    engine = build_engine(model_dir, args, blocks, batch, graphs=not args.no_graphs)
    d = Driver(engine, args.gateways)
    V = engine.vocab_size
    for _ in range(batch):
        d.add(rng.integers(0, V, args.context).tolist(), budget)
    prefill_steps = 0
    while any(r.num_computed_tokens < r.num_prompt_tokens for r in engine.requests.values()):
        d.step()
        prefill_steps += 1
    for _ in range(args.warmup):
        d.step()
    replays0 = engine.runner.graphs.num_replays if engine.runner.graphs else 0
    steps, not_full = [], 0
    gc.collect()
    for _ in range(args.steps):
        ph, n = d.step()
        not_full += n != batch
        steps.append(ph)
    graph_steps = (engine.runner.graphs.num_replays if engine.runner.graphs else 0) - replays0
    res = {
        "argmax_ms": argmax_ms(engine.runner.null_model.logits[:batch]),
        "batch_size": batch,
        "context": args.context,
        "prefill_steps": prefill_steps,
        "steps": args.steps,
        "graph_steps": graph_steps,
        "steps_not_full_batch": not_full,
        **summarize(steps),
    }
    if not_full:
        raise RuntimeError(f"batch {batch}: {not_full} timed steps were not full decode steps")
    return res


def argmax_ms(logits: torch.Tensor, reps: int = 50) -> float:
    """The sampler's argmax + copy back alone on this step's logits shape: on the CPU it is
    arithmetic inside the "sample" phase (on a GPU it runs on the device), so sample minus this
    is the sampler's Python."""
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        logits.argmax(dim=-1).tolist()
        ts.append(time.perf_counter() - t)
    return statistics.median(ts) * 1e3


def run_mixed(model_dir: Path, args, rng: np.random.Generator) -> dict[str, Any]:
    """--mixed-decodes running decodes plus one new prompt prefilled in the same step."""
    B, P, R = args.mixed_decodes, args.mixed_prefill_tokens, args.mixed_reps
    bs = 16
    total = args.context + R * 2 + 4
    blocks = (B + R) * -(-max(total, P + 4) // bs) + 8
    engine = build_engine(model_dir, args, blocks, B + R, graphs=not args.no_graphs)
    d = Driver(engine, args.gateways)
    V = engine.vocab_size
    for _ in range(B):
        d.add(rng.integers(0, V, args.context).tolist(), 2 * R + 4)
    while any(r.num_computed_tokens < r.num_prompt_tokens for r in engine.requests.values()):
        d.step()
    d.step()
    steps = []
    gc.collect()
    for _ in range(R):
        d.add(rng.integers(0, V, P).tolist(), R + 2)
        ph, n = d.step()  # the running decodes + the whole new prompt
        steps.append(ph)
        d.step()  # a decode-only step, so every timed step starts from the same shape
    return {
        "decodes": B,
        "prefill_tokens": P,
        "context": args.context,
        "reps": R,
        **summarize(steps),
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--batch-sizes", default="1,64,256")
    p.add_argument("--context", type=int, default=1024, help="prompt tokens per request")
    p.add_argument("--steps", type=int, default=50, help="timed decode steps per batch size")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--mixed-decodes", type=int, default=64)
    p.add_argument("--mixed-prefill-tokens", type=int, default=512)
    p.add_argument("--mixed-reps", type=int, default=10)
    p.add_argument("--gateways", type=int, default=1, help="gateways the requests spread over")
    p.add_argument("--max-num-batched-tokens", type=int, default=8192)
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--no-graphs", action="store_true", help="time the eager prepare() path")
    p.add_argument("--no-prefix-caching", action="store_true")
    p.add_argument("--model-dir", help="a checkpoint to use (default: a tiny random one)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out")
    return p.parse_args(argv)


def print_table(data: dict[str, Any]) -> None:
    cols = ("schedule", "prepare", "forward", "sample", "execute_other", "update", "publish")
    cols += ("stats", "encode", "engine_host", "host")
    head = "case".ljust(14) + "".join(c[:9].rjust(10) for c in cols)
    print("median ms per step (null forward)")
    print(head)
    rows = [(f"decode B={r['batch_size']}", r) for r in data["decode"]]
    if data.get("mixed"):
        m = data["mixed"]
        rows.append((f"mixed {m['decodes']}+{m['prefill_tokens']}", m))
    for name, r in rows:
        print(name.ljust(14) + "".join(f"{r[c]['median_ms']:10.3f}" for c in cols))
    print("of which argmax + copy back (CPU arithmetic inside 'sample'): ", end="")
    print(", ".join(f"B={r['batch_size']} {r['argmax_ms']:.3f}" for r in data["decode"]))


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    torch.manual_seed(args.seed)
    rng = np.random.default_rng(args.seed)
    tmp = None
    if args.model_dir:
        model_dir = Path(args.model_dir)
    else:
        tmp = tempfile.TemporaryDirectory(prefix="voltserve-step-overhead-")
        model_dir = Path(tmp.name) / "tiny"
        write_random_checkpoint(model_dir, "tiny", "cpu", torch.float32)
    torch.set_num_threads(1)  # host work is one thread; keep the tiny argmax off other cores
    data: dict[str, Any] = {
        "what": "host time per engine step, null forward, CPU",
        "path": "eager prepare" if args.no_graphs else "cuda-graph staging (emulated replay)",
        "config": {k: v for k, v in vars(args).items() if k != "out"},
        "env": env_info("cpu"),
        "decode": [],
    }
    for b in [int(x) for x in args.batch_sizes.split(",") if x]:
        data["decode"].append(run_decode(model_dir, args, b, rng))
    data["mixed"] = run_mixed(model_dir, args, rng) if args.mixed_reps > 0 else None
    print_table(data)
    write_json(args.out, data)
    if tmp is not None:
        tmp.cleanup()
    return data


if __name__ == "__main__":
    main()
