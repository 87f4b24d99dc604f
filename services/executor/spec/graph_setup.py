"""Speculation's CUDA graphs as a runner builds them (spec/graphs.py holds the graph runners):
which batch sizes the verify graphs take, the verify graphs on the target, and a draft model's
or EAGLE head's single-token step graphs and catch-up graphs."""

from __future__ import annotations

from typing import TYPE_CHECKING

from voltserve.services.executor.spec.graphs import (
    StepGraphs,
    VerifyGraphRunner,
    spec_graphs_enabled,
    verify_batch_sizes,
)

if TYPE_CHECKING:
    from voltserve.services.executor.model_runner import ModelRunner


def spec_graphs_on(runner: ModelRunner, graph_batch: int) -> bool:
    """Whether speculation's steps may run as graphs at all: speculation on, decode graphs
    captured, VOLTSERVE_SPEC_GRAPHS not 0. A proposer's own graphs (its single-token steps)
    need nothing more; the verify graphs also need spec_graph_sizes."""
    spec = runner.config.speculative_config
    return spec is not None and spec_graphs_enabled() and graph_batch >= 1


def spec_graph_sizes(runner: ModelRunner, graph_batch: int) -> list[int]:
    """The verify graphs' batch sizes: the decode graphs' (graph_batch and
    --cuda-graph-sizes) whose size * (k + 1) rows are at most the largest decode graph's
    rows, or at most 8 * (k + 1) (a batch of up to 8 sequences always has one: its rows'
    activations are small). Beyond 8 sequences the verify graphs, captured into the decode
    graphs' pool, thus raise neither its peak nor the memory beyond what the decode graphs
    already hold (all of the decode ladder at k + 1 rows each would: at Llama-3-8B's
    vocabulary and 256 sequences, GBs of activations past the KV sizing). Also within the
    step's token budget (a step never schedules more) and what the decode attention can
    take. A verify step of more sequences runs eagerly: speculation pays at small batches,
    and at large ones the step is compute-bound, where a graph saves little. A target with
    linear-attention state also caps them at the requests its state cache snapshots
    (runner.max_verify_seqs, state_rollback.py). [] when speculation's steps run eagerly (no
    speculation, VOLTSERVE_SPEC_GRAPHS=0)."""
    if not spec_graphs_on(runner, graph_batch):
        return []
    spec = runner.config.speculative_config
    from voltserve.services.executor.cuda_graphs import graph_batch_sizes

    q = spec.num_speculative_tokens + 1
    sizes = graph_batch_sizes(graph_batch, runner.config.cuda_graph_sizes)
    limit = min(max(sizes[-1], 8 * q), runner.config.max_num_batched_tokens)
    cap = runner.max_verify_seqs
    if cap is not None:
        sizes = [s for s in sizes if s <= cap]
    return verify_batch_sizes(
        sizes, q, lambda rows: rows <= limit and runner.fallback_gather_bytes(rows) <= 2 * 2**30
    )


def graph_pool(runner: ModelRunner):
    """The decode graphs' memory pool, which speculation's graphs share (None before them)."""
    return getattr(getattr(runner, "graphs", None), "pool", None)


def build_verify_graphs(
    runner: ModelRunner, decode_sizes: list[int], kv_caches, capture: bool = True
) -> VerifyGraphRunner:
    """The target's verify graphs (spec_graph_sizes, among the decode sizes), returning the
    hidden states too when the proposer reads them; capture=False: the static buffers only
    (the start-up trace runs their forwards)."""
    q = runner.config.speculative_config.num_speculative_tokens + 1
    sizes = spec_graph_sizes(runner, decode_sizes[-1])
    sizes = [s for s in sizes if s in decode_sizes]
    return VerifyGraphRunner(
        runner.model,
        kv_caches,
        runner.device,
        runner.max_blocks_per_seq,
        runner.block_size,
        q,
        sizes,
        with_hidden=runner.keep_hidden_states,
        capture=capture,
        pool=graph_pool(runner),
        state_cache=runner.state_cache,
    )


def build_step_graphs(
    runner: ModelRunner,
    fwd,
    feature,
    kv_caches,
    decode_sizes: list[int],
    what: str,
    capture: bool = True,
) -> StepGraphs | None:
    """A proposer's single-token step graphs (the decode sizes) over fwd on its KV cache;
    None with k = 1 (no step after the catch-up)."""
    if runner.config.speculative_config.num_speculative_tokens + 1 <= 2:
        return None
    return StepGraphs(
        fwd,
        kv_caches,
        runner.device,
        runner.max_blocks_per_seq,
        runner.block_size,
        list(decode_sizes),
        feature,
        what=what,
        capture=capture,
        pool=graph_pool(runner),
    )
