"""Which decode linears run the weight-streaming GEMV kernel and which run cuBLAS, per weight
shape and row count: by a rule (the default) or measured once at start-up.

Why it matters: at one input row the GEMV kernel beats cuBLAS on every Llama-3-8B linear, but at
eight rows it is up to twice as slow (it rereads x per weight row while cuBLAS uses tensor
cores), and where the cross-over lies depends on the shape and the card. So before the decode
graphs are captured the runner times both on the model's own weights, for every distinct weight
shape and every row bucket a decode graph uses (1, 2, 4, 8; other counts run the next larger
bucket's graph and kernel), and keeps the faster. The gate_up projection has three candidates:
gemv_gate_up (silu_and_mul fused into the GEMV's output), GEMV + silu_and_mul, cuBLAS +
silu_and_mul.

The plan is fixed before capture (graphs bake the choice in) and reaches `linear()` through
`KernelDispatch.linear_plan`. `VOLTSERVE_GEMV=0` keeps everything on cuBLAS, `VOLTSERVE_GEMV=1`
sends everything of <= 8 rows to the GEMV kernels without timing, `VOLTSERVE_GEMV=measure`
times every candidate (start-up pays a compile of each); unset, `LinearPlan.rule()`: GEMV up to
2 rows (gate_up fused with its activation), cuBLAS beyond, read off a measured plan on an H200
(see plan_linears).
On CPU there is no plan: ops.gemv is F.linear there, so the choice does not matter.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

logger = logging.getLogger(__name__)

GEMV_ENV = "VOLTSERVE_GEMV"
# Row buckets: the GEMV kernel variants (kernels/linear/gemv.py VARIANTS) and the smallest decode
# graph sizes (cuda_graphs.graph_batch_sizes), which agree: rows 3 and 5..7 run the next bucket.
ROW_BUCKETS = (1, 2, 4, 8)
MAX_ROWS = ROW_BUCKETS[-1]
DEFAULT_GEMV_ROWS = 2  # LinearPlan.rule(): the measured cross-over on an H200

# Implementations. A plain linear: "gemv" | "cublas". A gated MLP's gate_up projection (output:
# silu_and_mul of the product): "gemv_gate_up" (one kernel) | "gemv" (GEMV, then silu_and_mul) |
# "cublas" (cuBLAS, then silu_and_mul).
GEMV, CUBLAS, GEMV_GATE_UP = "gemv", "cublas", "gemv_gate_up"
LINEAR, GATE_UP = "linear", "gate_up"  # kinds of weight
_CHOICES = {LINEAR: (GEMV, CUBLAS), GATE_UP: (GEMV_GATE_UP, GEMV, CUBLAS)}


def row_bucket(rows: int) -> int | None:
    """The bucket that serves `rows` input rows, or None past the largest (always cuBLAS)."""
    for b in ROW_BUCKETS:
        if rows <= b:
            return b if rows > 0 else None
    return None


@dataclass
class LinearPlan:
    """Decisions per (kind, out_features N, in_features K, row bucket) -> implementation.

    Shapes the plan does not list use `default_linear` / `default_gate_up` (an explicit plan for
    tests, or the env switch, is just these two defaults). More than MAX_ROWS rows always run
    cuBLAS. `times_us` keeps what was measured (for the log and for tests)."""

    choices: dict[tuple[str, int, int, int], str] = field(default_factory=dict)
    default_linear: str = GEMV
    default_gate_up: str = GEMV_GATE_UP
    times_us: dict[tuple[str, int, int, int], dict[str, float]] = field(default_factory=dict)
    # Row buckets past this run cuBLAS unless `choices` says otherwise.
    max_gemv_rows: int = MAX_ROWS
    # Weights wider than wide_n with fewer than short_k inputs run cuBLAS unless `choices` says
    # otherwise (0 = no such exception): see rule().
    wide_n: int = 0
    short_k: int = 0

    def __post_init__(self) -> None:
        for key, impl in self.choices.items():
            if impl not in _CHOICES[key[0]]:
                raise ValueError(f"{key}: {impl!r} is not one of {_CHOICES[key[0]]}")
        if self.default_linear not in _CHOICES[LINEAR]:
            raise ValueError(f"default_linear {self.default_linear!r}")
        if self.default_gate_up not in _CHOICES[GATE_UP]:
            raise ValueError(f"default_gate_up {self.default_gate_up!r}")

    @classmethod
    def fixed(cls, gemv: bool) -> LinearPlan:
        """Every linear of <= 8 rows on the GEMV kernels (gemv=True), or all on cuBLAS."""
        if gemv:
            return cls(default_linear=GEMV, default_gate_up=GEMV_GATE_UP)
        return cls(default_linear=CUBLAS, default_gate_up=CUBLAS)

    @classmethod
    def rule(cls, max_gemv_rows: int = DEFAULT_GEMV_ROWS) -> LinearPlan:
        """The default without timing: GEMV up to max_gemv_rows rows (gate_up fused with its
        activation), cuBLAS beyond. Read off a measured plan on an H200 (BENCHMARKS.md §1): the
        GEMV kernel wins at 1 and 2 rows on every Llama-3-8B shape (gate_up at 2 rows within
        4%) and loses at 4 and 8. One exception, from the Qwen2.5-0.5B profile: its lm_head
        (151936 x 896) took 97.6 us on the GEMV kernel and 65.3 us on cuBLAS. Under one GEMV
        step of K (1024) each warp streams one short row, and a wide N makes that tens of
        thousands of blocks, whose scheduling the stream cannot hide."""
        return cls(
            default_linear=GEMV,
            default_gate_up=GEMV_GATE_UP,
            max_gemv_rows=max_gemv_rows,
            wide_n=32768,
            short_k=1024,
        )

    def linear_impl(self, rows: int, n: int, k: int) -> str:
        """Implementation ("gemv" or "cublas") for x [rows, k] @ W[n, k]^T."""
        return self._lookup(LINEAR, self.default_linear, rows, n, k)

    def gate_up_impl(self, rows: int, n: int, k: int) -> str:
        """Implementation ("gemv_gate_up", "gemv" or "cublas") for silu_and_mul(x [rows, k] @ W[n, k]^T)."""
        return self._lookup(GATE_UP, self.default_gate_up, rows, n, k)

    def _lookup(self, kind: str, default: str, rows: int, n: int, k: int) -> str:
        b = row_bucket(rows)
        if b is None:
            return CUBLAS
        if b > self.max_gemv_rows or (self.wide_n and n > self.wide_n and k < self.short_k):
            default = CUBLAS
        return self.choices.get((kind, n, k, b), default)

    def table(self) -> str:
        """One line: each measured shape and bucket, its times (us) and the choice (*)."""
        parts = []
        for key in sorted(self.times_us):
            kind, n, k, b = key
            ts = self.times_us[key]
            pick = self.choices.get(key)
            cells = " ".join(f"{i}{'*' if i == pick else ''}={t:.1f}" for i, t in ts.items())
            parts.append(f"{kind} {k}->{n} x{b}: {cells}")
        return "; ".join(parts)


# ---------------------------------------------------------------------------------------------
# Which weights a model has


def model_linear_weights(
    model: nn.Module,
) -> dict[tuple[str, int, int], list[tuple[torch.Tensor, torch.Tensor | None]]]:
    """(kind, N, K) -> the (weight, bias) of every layer with that shape, in model order.

    A gate_up weight is the `gate_up_proj` of a module that also has a `down_proj` (the MLP
    fuses silu_and_mul into it); every other module with a 2-D `weight` and a `load_weight`
    (the Linear class) is a plain linear; so is the lm_head weight (tied or not)."""
    from voltserve.services.executor.models.layers import Linear

    gate_up_ids = {
        id(m.gate_up_proj)
        for m in model.modules()
        if isinstance(getattr(m, "down_proj", None), Linear)
        and isinstance(getattr(m, "gate_up_proj", None), Linear)
    }
    out: dict[tuple[str, int, int], list[tuple[torch.Tensor, torch.Tensor | None]]] = {}
    seen: set[int] = set()

    def add(kind: str, w: torch.Tensor, b: torch.Tensor | None) -> None:
        if id(w) in seen or w.dim() != 2:
            return
        seen.add(id(w))
        out.setdefault((kind, w.shape[0], w.shape[1]), []).append((w, b))

    for m in model.modules():
        # Only linears with a float weight: a quantized method runs its own kernels.
        w = m.method.dense_weight(m) if isinstance(m, Linear) else None
        if w is not None:
            add(GATE_UP if id(m) in gate_up_ids else LINEAR, w, m.bias)
    head = getattr(model, "lm_head_weight", None)
    if callable(head) and head() is not None:
        add(LINEAR, head(), None)
    return out


# ---------------------------------------------------------------------------------------------
# Measuring

# Cycles per second assumed for torch.cuda._sleep (a spin on the SM clock): high on purpose, so
# the spin is at least as long as asked on every card (a longer spin costs only idle time).
_SPIN_HZ = 2.0e9


def _time_us(fns: dict[str, Callable[[int], object]], reps: int, spin_s: float) -> dict[str, float]:
    """GPU microseconds per call of each fn(i) (i = rep index, to rotate weights).

    All calls are queued behind one spin kernel, so the GPU runs them back to back whatever the
    CPU's launch cost (a numba launch costs tens of microseconds of CPU, which the decode graphs
    do not pay); CUDA events between the groups give each one's GPU time."""
    events = [torch.cuda.Event(enable_timing=True) for _ in range(len(fns) + 1)]
    torch.cuda._sleep(int(spin_s * _SPIN_HZ))
    events[0].record()
    for j, fn in enumerate(fns.values()):
        for i in range(reps):
            fn(i)
        events[j + 1].record()
    events[-1].synchronize()
    return {name: events[j].elapsed_time(events[j + 1]) * 1e3 / reps for j, name in enumerate(fns)}


def _measure_group(
    fns: dict[str, Callable[[int], object]], reps: int, rounds: int = 2
) -> dict[str, float]:
    """Best of `rounds` timed passes (us per call) of each fn, after a warm-up pass."""
    for fn in fns.values():  # compiles the numba kernels, lets cuBLAS pick and allocate
        fn(0)
    torch.cuda.synchronize()
    # What queuing one call of each costs the CPU sizes the spin of the timed passes.
    t0 = time.perf_counter()
    for fn in fns.values():
        fn(1)
    enqueue_s = time.perf_counter() - t0
    torch.cuda.synchronize()
    best: dict[str, float] = {}
    for _ in range(rounds):
        for name, t in _time_us(fns, reps, spin_s=2.0 * enqueue_s * reps + 1e-4).items():
            best[name] = min(t, best.get(name, t))
    return best


def _candidates(
    ops, kind: str, x: torch.Tensor, layers: list[tuple[torch.Tensor, torch.Tensor | None]]
) -> dict[str, Callable[[int], object]]:
    """What to time for one input x: name -> fn(i) running on layer i's weight (rotated)."""
    L = len(layers)
    if kind == LINEAR:
        return {
            GEMV: lambda i: ops.gemv(x, *layers[i % L]),
            CUBLAS: lambda i: F.linear(x, *layers[i % L]),
        }
    return {
        GEMV_GATE_UP: lambda i: ops.gemv_gate_up(x, *layers[i % L]),
        GEMV: lambda i: ops.silu_and_mul(ops.gemv(x, *layers[i % L])),
        CUBLAS: lambda i: ops.silu_and_mul(F.linear(x, *layers[i % L])),
    }


@torch.inference_mode()
def measure_linear_plan(model: nn.Module, ops, reps: int = 8) -> LinearPlan:
    """Times GEMV against cuBLAS for every distinct linear weight shape of `model` and every row
    bucket, on the model's own weights (rotated over the layers, so a weight is not in L2 from
    the previous call), and returns the plan keeping the faster of each. CUDA only; must not run
    while a CUDA graph is being captured."""
    if torch.cuda.is_current_stream_capturing():
        raise RuntimeError("measure_linear_plan must run before CUDA graph capture, not in it")
    gemv_ok = ops.impl.get("gemv") == "cuda"
    plan = LinearPlan(default_linear=GEMV if gemv_ok else CUBLAS, default_gate_up=CUBLAS)
    if not gemv_ok:
        return plan
    t_start = time.perf_counter()
    for (kind, n, k), layers in model_linear_weights(model).items():
        dtype, device = layers[0][0].dtype, layers[0][0].device
        gen = torch.Generator(device=device).manual_seed(n * 7919 + k)  # leaves torch's RNG be
        for b in ROW_BUCKETS:
            x = torch.randn(b, k, generator=gen, device=device, dtype=torch.float32)
            x = x.to(dtype)
            ts = _measure_group(_candidates(ops, kind, x, layers), reps)
            key = (kind, n, k, b)
            plan.times_us[key] = ts
            plan.choices[key] = min(ts, key=ts.__getitem__)
    logger.info(
        "decode linear plan (us per call, * = kept; %.2f s): %s",
        time.perf_counter() - t_start,
        plan.table(),
    )
    return plan


def plan_linears(model: nn.Module, ops) -> LinearPlan | None:
    """The plan the runner hands to `ops.linear_plan` before capturing graphs: None on CPU (the
    fixed rule; ops.gemv is F.linear there); VOLTSERVE_GEMV=0: all cuBLAS, =1: all GEMV (fused
    gate_up), =measure: timed per shape at start-up; unset: `LinearPlan.rule()`. Measuring is not
    the default: it compiles every GEMV variant to time it, which took 53 s of start-up on an
    H200 for Llama-3-8B, and there it chose what the rule chooses."""
    if ops.device.type != "cuda":
        return None
    env = os.environ.get(GEMV_ENV, "").strip().lower()
    if env in ("0", "false", "no", "off"):
        return LinearPlan.fixed(gemv=False)
    if env in ("1", "true", "yes", "on"):
        return LinearPlan.fixed(gemv=True)
    if env == "measure":
        return measure_linear_plan(model, ops)
    return LinearPlan.rule()


def linear_impl(ops, rows: int, n: int, k: int) -> str:
    """The lookup `linear()` uses: the plan's choice, or without a plan the fixed rule (GEMV for
    <= 8 rows)."""
    plan = getattr(ops, "linear_plan", None)
    if plan is None:
        return GEMV if 0 < rows <= MAX_ROWS else CUBLAS
    return plan.linear_impl(rows, n, k)


def gate_up_impl(ops, rows: int, n: int, k: int) -> str:
    """The lookup the MLP uses for its gate_up projection. Without a plan: the fixed rule of
    `linear_impl`, then silu_and_mul (the unfused path, as before plans existed)."""
    plan = getattr(ops, "linear_plan", None)
    if plan is None:
        return linear_impl(ops, rows, n, k)
    return plan.gate_up_impl(rows, n, k)
