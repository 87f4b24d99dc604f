"""The model runner: loads the model, owns the paged KV cache, and turns a StepPlan into a
RunnerOutput (request.py). It reads request state only; the engine updates requests after
`execute` returns.

Start-up: the tensor-parallel group (tp/worker.py), the weights, the kernel plan, the KV sizing
(kv_sizing.py), the CUDA graphs (cuda_graphs.py; speculation's, spec/graph_setup.py). Per step:
the inputs are staged by input_batch.py, then one of three paths runs: a verify graph replay
(speculation), a decode graph replay (decode_pipeline.py may have launched it a step ahead), or
the eager forward of the flat batch; then the sampler, and prompt logprobs
(prompt_logprobs.py) where asked for.
"""

from __future__ import annotations

import logging
import time

import torch
from voltserve.kernels.dispatch import KernelDispatch
from voltserve.kernels.runtime import compile_cache
from voltserve.services.executor import kernel_warmup, kv_quant, kv_sizing, layer_trace
from voltserve.services.executor.decode_pipeline import (
    DecodePipeline,
    pipeline_enabled,
    pipeline_max_batch,
)
from voltserve.services.executor.input_batch import DeviceBatch, InputBatch, verify_sample_rows
from voltserve.services.executor.linear_plan import plan_linears
from voltserve.services.executor.loader import load_model, resolve_dtype
from voltserve.services.executor.models.qwen3_next import HybridArch
from voltserve.services.executor.prompt_logprobs import compute_prompt_logprobs
from voltserve.services.executor.quant.group import reserve_quant_scratch
from voltserve.services.executor.request import RunnerOutput, StepPlan
from voltserve.services.executor.sampler import Sampler
from voltserve.services.executor.spec.graph_setup import (
    build_verify_graphs,
    spec_graph_sizes,
    spec_graphs_on,
)
from voltserve.services.executor.spec.graphs import VerifyGraphRunner, verify_row_counts
from voltserve.services.executor.spec.proposer import Proposer, make_proposer
from voltserve.services.executor.state_cache import StateCache
from voltserve.services.executor.state_rollback import (
    MAX_VERIFY_SEQS,
    VerifyStates,
    check_spec_supported,
)
from voltserve.services.executor.tp.group import TPGroup
from voltserve.services.executor.tp.worker import TPSession
from voltserve.shared import startup
from voltserve.shared.config import EngineConfig

logger = logging.getLogger(__name__)


def resolve_device(spec: str) -> torch.device:
    if spec == "auto":
        spec = "cuda" if torch.cuda.is_available() else "cpu"
    dev = torch.device(spec)
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device {spec!r} requested but CUDA is not available")
        if dev.index is None:
            # The executor owns one GPU (CUDA_VISIBLE_DEVICES picks it); name it explicitly so
            # set_device and graph capture agree on it.
            dev = torch.device("cuda", torch.cuda.current_device())
    return dev


class ModelRunner:
    def __init__(
        self,
        config: EngineConfig,
        compile_only: bool = False,
        tp_rank: int = 0,
        tp_port: int | None = None,
    ) -> None:
        """compile_only: stop after the compile phase (`voltserve warmup`: fills the kernel
        cache; the runner cannot run steps). tp_rank / tp_port: set in the processes of ranks
        1..N-1 of a tensor-parallel group (tp/launch.py); rank 0 is built without them and
        starts the others itself."""
        self.config = config
        self.device = resolve_device(config.device)
        self.dtype = resolve_dtype(config.dtype, self.device)
        self.startup_times: dict[str, float] = {}  # phase -> seconds
        # Refused before the weights load where the choice of KV storage rules the run out.
        kv_quant.check_supported(config, self.dtype, self.device)
        self.compile_report: compile_cache.CompileReport | None = None
        t_start = time.perf_counter()
        # Tensor parallelism (tp/worker.py): this rank's session and its group.
        self.tp_session: TPSession | None = None
        self.tp: TPGroup | None = None
        if config.tensor_parallel_size > 1:
            self.tp_session = TPSession(config, self.device, tp_rank, tp_port, compile_only)
            self.device, self.tp = self.tp_session.device, self.tp_session.group
        # What the card holds before this runner loads anything (other processes, this one's
        # CUDA context, tensors this process already holds): --max-gpu-memory budgets only what
        # this runner adds, so neighbours on a shared card do not eat the budget.
        self._non_torch_at_start = 0
        self._allocated_at_start = 0
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
            free, total = torch.cuda.mem_get_info()
            self._non_torch_at_start = total - free - torch.cuda.memory_reserved()
            self._allocated_at_start = torch.cuda.memory_allocated()
        try:
            with startup.phase("loading weights", self.startup_times):
                loaded = load_model(
                    config.model, self.dtype, self.device, config.quantization, self.tp
                )
        except Exception:
            # A checkpoint this rank cannot load (a shard that cuts a quantization group...):
            # the other ranks fail the same way; stop them before the watchdog sees them exit.
            if self.tp_session is not None:
                self.tp_session.abort()
            raise
        self.model = loaded.model
        self.arch = loaded.arch
        hybrid = isinstance(self.arch, HybridArch)
        # A one-byte KV cache: every attention layer's format and scales, and the workspace its
        # pages are widened into before attention (kv_quant.py, kv_workspace.py).
        self.kv_workspace = kv_quant.workspace(config.kv_cache_dtype, self.dtype, self.device)
        kv_quant.install(self.model, config.kv_cache_dtype, config.model, self.kv_workspace)
        if layer_trace.enabled():
            layer_trace.install(self.model)
        # Speculation (spec/proposer.py): the proposer loads what it runs (a draft model, an
        # EAGLE head) beside the target, before KV sizing, so its weights and its KV cache (the
        # target's block layout) count against the memory.
        spec = config.speculative_config
        self.proposer: Proposer | None = None
        if spec is not None and hybrid:
            check_spec_supported(self.arch.architecture, spec.method, self.tp)
        if spec is not None:
            self.proposer = make_proposer(spec)
            self.proposer.load(self)
            kv_quant.install_proposer(self.proposer, config.kv_cache_dtype, self.kv_workspace)
        # The hidden-state seam: for a proposer that reads the target's last hidden states
        # (EAGLE), each eager forward, and each verify graph replay, puts (request, first
        # position, rows) in the step's RunnerOutput.hidden_states. Decode-only steps then
        # replay the verify graphs (the decode graphs return logits only), or run eagerly
        # without them.
        self.keep_hidden_states = self.proposer is not None and self.proposer.needs_hidden_states
        self.eos_token_ids: list[int] = loaded.eos_token_ids
        self.vocab_size: int = loaded.arch.vocab_size
        # This rank's KV heads (all of them without tensor parallelism).
        self.num_kv_heads: int = self.model.layout.num_kv_heads
        self.block_size: int = config.block_size
        self.max_model_len: int = self._resolve_max_model_len()
        self.max_blocks_per_seq = -(-self.max_model_len // self.block_size)
        # Linear-attention state (state_cache.py): a slot per running request, allocated
        # before the KV sizing so that its bytes come off the KV cache's budget.
        self.state_cache = self._alloc_state_cache()
        # An eager verify step's snapshots, committed at the next step (state_rollback.py).
        self._verify_states: VerifyStates | None = None
        # Graph replays run no hooks: the layer trace needs every step eager.
        use_graphs = (
            self.device.type == "cuda" and not config.enforce_eager and not layer_trace.enabled()
        )
        self.ops = KernelDispatch(
            self.device, self.dtype, self.block_size, graph_torch_fallback=use_graphs
        )
        self.model.ops = self.ops
        # GEMV or cuBLAS per decode linear shape, timed on CUDA; before any capture (graphs bake
        # the choice in) and before KV sizing (its buffers are freed by then).
        linear_plan = plan_linears(self.model, self.ops)
        self.ops.linear_plan = linear_plan
        reserve_quant_scratch(self.model, self.ops)
        graph_batch = min(config.max_graph_batch_size, config.max_num_seqs)
        why_not = self._why_no_graphs(graph_batch) if use_graphs else "enforce_eager or CPU"
        if use_graphs and why_not is not None:
            logger.info("decode runs eagerly: %s", why_not)
            self.ops = KernelDispatch(self.device, self.dtype, self.block_size)
            self.ops.linear_plan = linear_plan
            self.model.ops = self.ops
        use_graphs = use_graphs and why_not is None
        self.sampler = Sampler(self.ops, self.device)
        if self.proposer is not None:
            self.proposer.use_ops(self.ops)
        # The cache tensors' dtype: torch.uint8 for the one-byte formats (kv_quant.py).
        self.kv_cache_dtype = kv_quant.storage_dtype(config.kv_cache_dtype, self.dtype)
        self.input_batch = InputBatch(
            self.device,
            self.block_size,
            self.max_blocks_per_seq,
            config.max_num_batched_tokens,
            config.max_num_seqs,
            self.eos_token_ids,
        )
        if kernel_warmup.needs_compile(self):
            # Every kernel the next phases launch, loaded or compiled now, so that KV sizing
            # measures no compiler and graph capture compiles nothing.
            with startup.phase("compiling kernels", self.startup_times) as ph:
                self.compile_report = kernel_warmup.compile_kernels(
                    self, graph_batch if use_graphs else None
                )
                ph.detail = self.compile_report.summary()
        if compile_only:
            return
        # Logits rows the graphs' shared output buffers take after the sizing: the decode
        # graphs' largest size, the verify graphs' largest size times its rows per sequence,
        # and the proposer's graphs' (a draft model's catch-up graphs have the verify rows).
        self._graph_logits_rows = 0
        # Rows of the largest decode graph, whose attention workspace its pool holds.
        self._graph_decode_rows = graph_batch if use_graphs else 0
        if use_graphs:
            verify = spec_graph_sizes(self, graph_batch)
            if verify:
                k = config.speculative_config.num_speculative_tokens
                verify_rows = max(verify) * (k + 1)
                verify_rows += self.proposer.graph_logits_rows(verify_rows)
            else:
                verify_rows = 0
            self._graph_logits_rows = graph_batch + verify_rows
        with startup.phase("sizing the KV cache", self.startup_times) as ph:
            self.num_kv_blocks: int = kv_sizing.decide_num_blocks(self)
            if self.tp is not None:
                # The block manager on rank 0 hands out blocks that every rank must hold.
                self.num_kv_blocks = self.tp.min_int(self.num_kv_blocks)
            ph.detail = f"{self.num_kv_blocks} blocks of {self.block_size} tokens"
        self.kv_caches = kv_sizing.alloc_kv_caches(self, self.num_kv_blocks)
        if self.proposer is not None:
            self.proposer.alloc_kv(self, self.num_kv_blocks)
        self.graphs = None
        self.pipeline: DecodePipeline | None = None
        self.compiled_in_capture: list[str] = []
        # Speculation's graphs (spec/graphs.py): the target's verify step here, the proposer's
        # own in the proposer; how many steps ran in graphs and how many eagerly.
        self.verify_graphs: VerifyGraphRunner | None = None
        self.spec_graph_counts = dict.fromkeys(
            ("verify_graph", "verify_eager", "draft_graph", "draft_eager"), 0
        )
        if use_graphs:
            from voltserve.services.executor.cuda_graphs import CudaGraphRunner

            missed = len(compile_cache.stats.compiled)
            with startup.phase("capturing CUDA graphs", self.startup_times) as ph:
                self.graphs = CudaGraphRunner(self, graph_batch, config.cuda_graph_sizes)
                ph.detail = f"{len(self.graphs.sizes)} batch sizes"
            self.compiled_in_capture = compile_cache.stats.compiled[missed:]
            if self.compiled_in_capture:
                logger.warning(
                    "%d kernels were compiled during graph capture (the start-up trace missed "
                    "them): %s",
                    len(self.compiled_in_capture),
                    self.compiled_in_capture,
                )
            if spec_graphs_on(self, graph_batch):
                with startup.phase("capturing speculative CUDA graphs", self.startup_times) as ph:
                    verify_sizes = []
                    if spec_graph_sizes(self, graph_batch):
                        self.verify_graphs = build_verify_graphs(
                            self, self.graphs.sizes, self.kv_caches
                        )
                        verify_sizes = self.verify_graphs.sizes
                    self.proposer.capture_graphs(self, self.graphs.sizes, verify_sizes)
                    ph.detail = f"verify sizes {verify_sizes}"
            if self.tp_session is not None:
                self.graphs.before_replay = (
                    self.tp_session.send_graph_step if tp_rank == 0 else None
                )
            elif (
                pipeline_enabled()
                and config.speculative_config is None
                and self.state_cache is None
            ):
                # Not under tensor parallelism (a step launched ahead would need the other
                # ranks to launch it too), nor with speculation (it changes the tokens
                # between steps), nor with linear-attention state (a step launched ahead and
                # then dropped would have advanced the recurrent state: not idempotent as a
                # KV write is).
                self.pipeline = DecodePipeline(self, pipeline_max_batch())
        logger.info(
            "model %s (%s) on %s, %d KV blocks of %d tokens (%.2f GiB), max_model_len %d",
            self.arch.architecture,
            self.dtype,
            self.device,
            self.num_kv_blocks,
            self.block_size,
            self.num_kv_blocks * kv_sizing.kv_bytes_per_block(self) / 2**30,
            self.max_model_len,
        )
        startup.logger.info(
            "start-up: engine ready in %.1f s (%s)",
            time.perf_counter() - t_start,
            ", ".join(f"{k} {v:.1f} s" for k, v in self.startup_times.items()),
        )

    # ---- setup -------------------------------------------------------------------------------

    def _resolve_max_model_len(self) -> int:
        limit = self.arch.max_position_embeddings
        want = self.config.max_model_len
        if want is not None and want > limit:
            raise ValueError(
                f"max_model_len {want} exceeds the model's max_position_embeddings {limit}"
            )
        n = want or limit
        sw = self.arch.sliding_window
        if sw is not None and n > sw:
            # Sliding-window attention is not implemented; full attention equals it up to the window.
            logger.warning("capping max_model_len %d at the sliding window %d", n, sw)
            n = sw
        return n

    @property
    def max_verify_seqs(self) -> int | None:
        """Requests a verify step may verify: a speculating model with linear-attention state
        snapshots that many (state_rollback.py); None: any number."""
        if self.state_cache is None or self.config.speculative_config is None:
            return None
        return self.state_cache.snapshot_shape[1]

    def _alloc_state_cache(self) -> StateCache | None:
        specs = self.model.state_specs() if hasattr(self.model, "state_specs") else []
        if not specs:
            return None
        spec = self.config.speculative_config
        snapshots = (0, 0)
        if spec is not None:
            # A group of 1 + m rows keeps the state after rows 0 .. m - 1 (the state after its
            # last row is the slot's own: state_rollback.py), so k positions.
            snapshots = (
                spec.num_speculative_tokens,
                min(self.config.max_num_seqs, MAX_VERIFY_SEQS),
            )
        cache = StateCache(specs, self.config.max_num_seqs, self.dtype, self.device, snapshots)
        self.model.state_cache = cache
        logger.info(
            "linear-attention state: %d layers x %d slots, + %d x %d verify snapshots (%.2f MiB)",
            len(specs),
            cache.num_slots,
            *snapshots,
            cache.nbytes / 2**20,
        )
        return cache

    def _why_no_graphs(self, graph_batch: int) -> str | None:
        if graph_batch < 1:
            return "max_graph_batch_size < 1"
        extra = getattr(self.model, "graph_ops", ())
        if self.kv_workspace is not None:
            extra += kv_quant.GRAPH_OPS
        if not (self.ops.capturable() and self.ops.capturable(extra)):
            return f"some decode ops cannot be captured ({self.ops.impl})"
        need = self.fallback_gather_bytes(graph_batch)
        if need > 2 * 2**30:
            return f"the torch decode-attention fallback would gather {need / 2**30:.1f} GiB"
        return None

    def fallback_gather_bytes(self, rows: int) -> int:
        """What the torch decode-attention fallback gathers for a graph of `rows` rows (the
        whole block table width of every row in fp32); 0 with the numba kernel."""
        if self.ops.impl["paged_decode_attention"] != "torch-capturable":
            return 0
        a = self.arch
        need = rows * self.max_blocks_per_seq * self.block_size * self.num_kv_heads
        return need * a.head_dim * 4 * 2

    # ---- per step ----------------------------------------------------------------------------

    def execute(self, plan: StepPlan) -> RunnerOutput:
        """The step's results (request.py, RunnerOutput); reads request state only."""
        if self.tp_session is None:
            return self._execute(plan)
        return self.tp_session.run(lambda: self._execute(plan))

    @torch.inference_mode()
    def _execute(self, plan: StepPlan) -> RunnerOutput:
        if self._verify_states is not None:
            # The last verify step's state after each request's last kept token, before any
            # forward reads it (state_rollback.py).
            self._verify_states.commit(self.state_cache)
            self._verify_states = None
        out = RunnerOutput()
        if self.state_cache is not None:
            # A row without a slot would read and write slot -1 (another request's state):
            # silently wrong tokens. The block manager gives every admitted request one.
            for s in plan.scheduled:
                if s.request.state_slot < 0:
                    raise RuntimeError(
                        f"request {s.request.request_id} has no linear-attention state slot "
                        "(a hybrid model's requests are admitted by the block manager)"
                    )
        if plan.scheduled:
            out.sampled = self._run(plan, out)
        return out

    def _run(self, plan: StepPlan, out: RunnerOutput):
        """The sampled tokens of a non-empty step (prompt logprobs and hidden states go to out)."""
        if self.keep_hidden_states or any(s.spec_token_ids for s in plan.scheduled):
            sampled = self._execute_verify(plan, out)
            if sampled is not None:
                return sampled
        if (
            self.graphs is not None
            and self.graphs.can_run(len(plan.scheduled))
            and plan.is_decode_only
            and not self.keep_hidden_states
        ):
            if self.pipeline is not None:
                ids = self.pipeline.execute(plan)
                if ids is not None:
                    return ids
            reqs = self.input_batch.stage_decode(self.graphs, plan)
            logits = self.graphs.replay_staged(len(reqs))
            return self.sampler.sample_last(
                logits, reqs, tuple(self.eos_token_ids), self.graphs.argmax_of_last(len(reqs))
            )
        if self.pipeline is not None:
            self.pipeline.discard()  # a step launched ahead is not this one
        staged = self.input_batch
        batch, rows = staged.prepare(plan)
        if self.state_cache is not None and self.proposer is not None:
            reqs, starts, qsl = staged.staged
            self._verify_states = batch.meta.verify_states = VerifyStates.build(
                self.state_cache,
                reqs,
                [len(s.spec_token_ids) for s in plan.scheduled],
                [int(x) for x in qsl],
                starts,
            )
        if self.tp_session is not None:
            self.tp_session.send_eager(staged, batch)
        if staged.prompt_rows:
            logits = self._forward(batch, batch.logits_indices, out)
            compute_prompt_logprobs(staged.prompt_rows, logits[len(rows) :], out)
            if not rows:
                return []
            logits = logits[: len(rows)]
        elif rows:
            logits = self._forward(batch, batch.logits_indices, out)
        else:
            # A step of prefill chunks only: write their KV, sample nothing.
            self._forward(batch, batch.logits_indices[:0], out)
            return []
        return self.sampler(logits, rows)

    def _execute_verify(self, plan: StepPlan, out: RunnerOutput):
        """A step with proposals to verify (or, for EAGLE, any decode-only step: the verify
        graph also returns the hidden states) as a verify graph replay; None when no verify
        graph covers it (it then runs eagerly, counted when it has proposals)."""
        vg = self.verify_graphs
        sched = plan.scheduled
        counts = verify_row_counts(sched, vg.q) if vg is not None else None
        if counts is None or not vg.can_run(len(sched)):
            if any(s.spec_token_ids for s in sched):
                self.spec_graph_counts["verify_eager"] += 1
            return None
        reqs = [s.request for s in sched]
        specs = [s.spec_token_ids for s in sched]
        starts = [r.num_computed_tokens for r in reqs]
        self.input_batch.stage_verify(vg, reqs, specs, starts)
        self.input_batch.prompt_rows = []
        logits, h = vg.replay_staged()
        if self.state_cache is not None:
            # Its rows' states wait in the snapshot area until the next step's commit.
            self._verify_states = VerifyStates.for_graph(
                self.state_cache, reqs, counts, starts, vg.q
            )
        if any(specs):
            self.spec_graph_counts["verify_graph"] += 1
        if self.keep_hidden_states:
            q = vg.q
            for b, r in enumerate(reqs):
                # Views of the graph's output: the proposer takes them before the next step.
                out.hidden_states.append((r, starts[b], h[b * q : b * q + counts[b]]))
        eos = tuple(self.eos_token_ids)
        rows = [row for r, sp in zip(reqs, specs) for row in verify_sample_rows(r, sp, eos)]
        return self.sampler(logits, rows)

    def _forward(
        self, batch: DeviceBatch, logits_indices: torch.Tensor, out: RunnerOutput
    ) -> torch.Tensor:
        """The target's forward over the prepared batch; with keep_hidden_states, its last
        hidden states per request go to out.hidden_states."""
        if not self.keep_hidden_states:
            return self.model(
                batch.input_ids, batch.positions, batch.meta, self.kv_caches, logits_indices
            )
        h = self.model.hidden_states(batch.input_ids, batch.positions, batch.meta, self.kv_caches)
        reqs, starts, qsl = self.input_batch.staged
        for b, r in enumerate(reqs):
            out.hidden_states.append((r, starts[b], h[int(qsl[b]) : int(qsl[b + 1])]))
        return self.model.compute_logits(h, logits_indices)

    def scrub_kv_blocks(self, blocks: list[int]) -> None:
        """Zero these KV blocks in every layer (the target's and the proposer's own): they held
        a request whose activations went non-finite. Attention reads only a sequence's own
        positions, but a kernel that weights a masked slot by zero still turns a stale NaN there
        into NaN (0 * NaN), so NaN must not wait in a free block for the next request. Queued
        on the step stream: a step launched ahead that still writes them runs first. Rank 0's
        cache only under tensor parallelism."""
        idx = torch.tensor(blocks, dtype=torch.int64, device=self.device)
        for k, v in self.kv_caches:
            k.index_fill_(0, idx, 0)
            v.index_fill_(0, idx, 0)
        if self.proposer is not None:
            self.proposer.scrub_kv_blocks(idx)
        if self.kv_workspace is not None:
            # Widened pages of those blocks (any layer's): zeroed whole, a rare event.
            self.kv_workspace.scrub()

    def shutdown(self) -> None:
        """Rank 0: tell the other ranks of a tensor-parallel group to exit and wait for them
        (idempotent; nothing without tensor parallelism)."""
        if self.tp_session is not None:
            self.tp_session.shutdown()
