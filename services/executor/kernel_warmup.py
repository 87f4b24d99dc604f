"""The start-up compile phase: every numba kernel the engine launches at start-up (and the
sampler's), loaded from the kernel cache or compiled, before KV sizing and CUDA-graph capture.

Which kernels, and for which argument types, is not written down anywhere: it is what the
forward passes launch. So the runner traces them (kernels/runtime/compile_cache.py
`traced_launches`: each launch is recorded, not run; the torch code around it runs as usual): the
KV-sizing profile forward (prefill at max_num_batched_tokens), the decode forward of every graph
batch size on the graphs' own static buffers, and one sampling call. The decode forwards are
graph-capturable, so no host code reads a kernel's (unwritten) output; the prefill profile
forward passes max_query_len, so its launchers do not either. Then `precompile` loads what the
cache holds and compiles the rest, in parallel worker processes when several are missing.

Kernels whose choice depends on the batch (decode attention's partition length, the GEMV row
variants) are built once per distinct configuration, not once per captured batch size: the
35 graph sizes of the Llama-3-8B shape need five decode-attention builds.

`voltserve warmup --model DIR [serve flags]` runs the weights and compile phases only and
exits, which fills the cache for a later `voltserve serve` with the same flags (see
services/executor/warmup.py).
"""

from __future__ import annotations

import logging
from types import SimpleNamespace
from typing import TYPE_CHECKING

import torch
from voltserve.kernels.runtime import compile_cache
from voltserve.kernels.sampling.sampling import chunked_argmax
from voltserve.services.executor import kv_sizing
from voltserve.services.executor.spec import graph_setup
from voltserve.shared import startup

if TYPE_CHECKING:
    from voltserve.services.executor.model_runner import ModelRunner

logger = logging.getLogger(__name__)


def needs_compile(runner: ModelRunner) -> bool:
    """Whether any op runs a numba kernel (never on the CPU)."""
    return runner.device.type == "cuda" and any(v == "cuda" for v in runner.ops.impl.values())


@torch.inference_mode()
def trace(runner: ModelRunner, graph_batch: int | None) -> list[tuple]:
    """(dispatcher, argument types) of every numba launch of the start-up forwards: the prefill
    profile, the decode graph forwards (graph_batch: the graph batch limit, None without graphs)
    and a sampling call."""
    with compile_cache.traced_launches() as launches:
        tmp = kv_sizing.alloc_kv_caches(runner, kv_sizing.profile_blocks(runner), scratch=False)
        kv_sizing.profile_forward(runner, tmp)
        del tmp
        if graph_batch is not None:
            _trace_decode_graphs(runner, graph_batch)
            _trace_spec_graphs(runner, graph_batch)
        _trace_sampler(runner)
    if runner.device.type == "cuda":
        torch.cuda.synchronize()
    if runner.kv_workspace is not None:
        runner.kv_workspace.release()  # sized for the trace's caches; the real ones reserve it
    return launches


def _trace_decode_graphs(runner: ModelRunner, graph_batch: int) -> None:
    from voltserve.services.executor.cuda_graphs import CudaGraphRunner

    # The graphs' own buffers and forward; a one-block cache (the padding rows read block 0 and
    # write the scratch block) at the real block table width, which sets the partitioning.
    probe = SimpleNamespace(
        model=runner.model,
        kv_caches=kv_sizing.alloc_kv_caches(runner, 1),
        device=runner.device,
        max_blocks_per_seq=runner.max_blocks_per_seq,
        # Padding rows carry state slot -1, so the trace writes no request's state.
        state_cache=runner.state_cache,
    )
    g = CudaGraphRunner(probe, graph_batch, runner.config.cuda_graph_sizes, capture=False)
    for bs in g.sizes:
        chunked_argmax(g._forward(bs))


def _trace_spec_graphs(runner: ModelRunner, graph_batch: int) -> None:
    """The forwards of speculation's graphs (spec/graphs.py), on their own static buffers and
    one-block caches, as for the decode graphs."""
    if not graph_setup.spec_graphs_on(runner, graph_batch):
        return
    from voltserve.services.executor.cuda_graphs import graph_batch_sizes

    sizes = graph_batch_sizes(graph_batch, runner.config.cuda_graph_sizes)
    verify = None
    if graph_setup.spec_graph_sizes(runner, graph_batch):
        verify = graph_setup.build_verify_graphs(
            runner, sizes, kv_sizing.alloc_kv_caches(runner, 1), capture=False
        )
    # The proposer's own graphs (a draft model's or EAGLE head's steps and catch-up).
    own = runner.proposer.make_graphs(
        runner, sizes, verify.sizes if verify is not None else [], capture=False
    )
    for g in (verify, *own.values()):
        for bs in g.sizes if g is not None else ():
            g._forward(bs)


def _trace_sampler(runner: ModelRunner) -> None:
    ops, dev = runner.ops, runner.device
    V = runner.vocab_size
    logits = torch.zeros(1, V, dtype=torch.float32, device=dev)
    f32 = torch.zeros(1, dtype=torch.float32, device=dev)
    i64 = torch.zeros(1, dtype=torch.int64, device=dev)
    if ops.impl.get("sample") == "cuda":
        ops.sample(logits, f32, torch.zeros(1, dtype=torch.int32, device=dev), f32, f32, i64, i64)
    if ops.impl.get("apply_penalties") == "cuda":
        mask = torch.zeros(1, V, dtype=torch.bool, device=dev)
        counts = torch.zeros(1, V, dtype=torch.int32, device=dev)
        ops.apply_penalties(logits, mask, counts, f32, f32, f32)


def compile_kernels(
    runner: ModelRunner, graph_batch: int | None, jobs: int | None = None
) -> compile_cache.CompileReport:
    """Trace, then make every traced kernel ready to launch (see the module docstring)."""
    launches = trace(runner, graph_batch)
    report = compile_cache.precompile(
        launches,
        jobs=jobs,
        progress=lambda it, n: startup.progress(it, "compiling kernels", total=n, unit="kernel"),
    )
    logger.debug("compiled kernels: %s", sorted({d.py_func.__qualname__ for d, _ in launches}))
    return report
