"""Speculation's CUDA graphs as a runner builds them (spec/graphs.py holds the graph runners):
which batch sizes the verify graphs take, the verify graphs on the target, and a draft model's
or EAGLE head's single-token step graphs and catch-up graphs."""

from __future__ import annotations

from typing import TYPE_CHECKING

from voltserve.services.executor.spec.config import SpeculativeConfig
from voltserve.services.executor.spec.graphs import (
    StepGraphs,
    VerifyGraphRunner,
    spec_graphs_enabled,
    verify_batch_sizes,
)

if TYPE_CHECKING:
    from voltserve.services.executor.model_runner import ModelRunner


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
    and at large ones the step is compute-bound, where a graph saves little. [] when
    speculation's steps run eagerly (no speculation, VOLTSERVE_SPEC_GRAPHS=0)."""
    spec = runner.config.speculative_config
    if spec is None or not spec_graphs_enabled() or graph_batch < 1:
        return []
    from voltserve.services.executor.cuda_graphs import graph_batch_sizes

    q = SpeculativeConfig.from_dict(spec).num_speculative_tokens + 1
    sizes = graph_batch_sizes(graph_batch, runner.config.cuda_graph_sizes)
    limit = min(max(sizes[-1], 8 * q), runner.config.max_num_batched_tokens)
    return verify_batch_sizes(
        sizes, q, lambda rows: rows <= limit and runner.fallback_gather_bytes(rows) <= 2 * 2**30
    )


def build_spec_graphs(
    runner: ModelRunner, decode_sizes: list[int], kv_caches, draft_kv_caches, capture: bool = True
) -> tuple[VerifyGraphRunner, StepGraphs | None]:
    """The verify graphs (spec_graph_sizes) and, for a draft model or an EAGLE head with
    k > 1, the graphs of its single-token steps (the decode sizes); capture=False: the
    static buffers only (the start-up trace runs their forwards)."""
    sc = SpeculativeConfig.from_dict(runner.config.speculative_config)
    q = sc.num_speculative_tokens + 1
    pool = getattr(getattr(runner, "graphs", None), "pool", None)
    sizes = spec_graph_sizes(runner, decode_sizes[-1])
    sizes = [s for s in sizes if s in decode_sizes]
    eagle = sc.method == "eagle"
    verify = VerifyGraphRunner(
        runner.model,
        kv_caches,
        runner.device,
        runner.max_blocks_per_seq,
        runner.block_size,
        q,
        sizes,
        with_hidden=eagle,
        capture=capture,
        pool=pool,
    )
    if runner.draft is None or q <= 2:
        return verify, None
    target, head = runner.model, runner.draft.model
    if eagle:

        def fwd(ids, feats, pos, meta, kv):
            h = head(target.model.embed_tokens(ids), feats, pos, meta, kv)
            return target.compute_logits(h, None, fp32_logits=False), h

        feature = (runner.arch.hidden_size, runner.dtype)
    else:

        def fwd(ids, feats, pos, meta, kv):
            return head(ids, pos, meta, kv, None, fp32_logits=False), None

        feature = None
    draft = StepGraphs(
        fwd,
        draft_kv_caches,
        runner.device,
        runner.max_blocks_per_seq,
        runner.block_size,
        list(decode_sizes),
        feature,
        what="EAGLE head CUDA graphs" if eagle else "draft model CUDA graphs",
        capture=capture,
        pool=pool,
    )
    return verify, draft


def build_draft_catchup_graphs(
    runner: ModelRunner, sizes: list[int], draft_kv_caches, capture: bool = True
) -> VerifyGraphRunner | None:
    """The draft model's catch-up forward (spec/draft_model.py) as graphs of the verify
    layout on the draft's model and KV cache: `sizes` sequences (the verify sizes) of up to
    k + 1 rows, logits only. None unless the method is draft_model."""
    sc = SpeculativeConfig.from_dict(runner.config.speculative_config)
    if sc.method != "draft_model" or runner.draft is None or not sizes:
        return None
    return VerifyGraphRunner(
        runner.draft.model,
        draft_kv_caches,
        runner.device,
        runner.max_blocks_per_seq,
        runner.block_size,
        sc.num_speculative_tokens + 1,
        list(sizes),
        capture=capture,
        pool=getattr(getattr(runner, "graphs", None), "pool", None),
        what="draft model catch-up CUDA graphs",
    )
