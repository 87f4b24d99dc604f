"""The model runner: loads the model, owns the paged KV cache, and turns a StepPlan into sampled
tokens. It reads request state only; the engine updates requests after `execute` returns.

Per step: one flat batch is written into one pinned int64 host buffer (token ids, positions,
slots, block tables, sequence lengths, query starts, logits rows), copied to the device in one
transfer, run through the model, sampled, and the sampled ids come back in one transfer.
Decode-only steps that a CUDA graph covers skip the flat batch: they are written straight into the
graph's pinned staging buffer (already in the graph's dtypes and padded layout), so the step is one
host-to-device copy, one graph replay, the sampler and one copy back. Verify steps (speculation)
that a verify graph covers do the same through spec/graphs.py.
"""

from __future__ import annotations

import atexit
import logging
import threading
import time
from dataclasses import dataclass
from itertools import chain

import numpy as np
import torch
from voltserve.kernels.dispatch import KernelDispatch
from voltserve.kernels.runtime import compile_cache
from voltserve.services.executor import kernel_warmup, layer_trace
from voltserve.services.executor.decode_pipeline import (
    DecodePipeline,
    pipeline_enabled,
    pipeline_max_batch,
)
from voltserve.services.executor.linear_plan import plan_linears
from voltserve.services.executor.loader import (
    load_model,
    parse_arch,
    read_hf_config,
    resolve_dtype,
)
from voltserve.services.executor.models.layers import AttentionMetadata
from voltserve.services.executor.quant.group import reserve_quant_scratch
from voltserve.services.executor.request import Request, RunnerOutput, StepPlan
from voltserve.services.executor.sampler import Sampler, SampleRow, finite_rows
from voltserve.services.executor.spec.config import SpeculativeConfig
from voltserve.services.executor.spec.draft_model import load_draft
from voltserve.services.executor.spec.eagle_head import load_eagle_head
from voltserve.services.executor.spec.graphs import (
    StepGraphs,
    VerifyGraphRunner,
    spec_graphs_enabled,
    verify_batch_sizes,
    verify_row_counts,
)
from voltserve.services.executor.tp import launch as tp_launch
from voltserve.services.executor.tp.group import TPGroup
from voltserve.services.executor.tp.layout import TPLayout
from voltserve.services.executor.tp.sharding import TPSplitError
from voltserve.services.executor.tp.step_sync import EAGER, GRAPH, NUM_PARTS, STOP, StepSync
from voltserve.shared import startup
from voltserve.shared.config import EngineConfig
from voltserve.shared.gguf_files import is_gguf

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


def check_tp_model(config: EngineConfig) -> None:
    """Refuse, before any rank starts, a model that --tensor-parallel-size cannot split: heads,
    KV heads, MLP or expert widths not divisible. A quantized linear whose shard would cut a
    packed word, a quantization group or a GGUF block is refused by its method's shard rule
    while loading (naming the tensor and the sizes)."""
    size = config.tensor_parallel_size
    if config.speculative_config is not None:
        # The draft model and the verify step run on rank 0 alone; the other ranks would need
        # to follow both.
        method = config.speculative_config.get("method") or "draft_model"
        raise TPSplitError(
            f"--speculative-config with --tensor-parallel-size {size} is not supported yet "
            f"(method {method!r}); use one of them"
        )
    if is_gguf(config.model):
        from voltserve.services.executor.gguf_source import GGUFSource

        hf = GGUFSource(config.model).config
    else:
        hf = read_hf_config(config.model)
    TPLayout.build(parse_arch(hf), 0, size)


def _token_slice(r: Request, start: int, n: int) -> list[int]:
    """r.all_token_ids[start:start+n] without concatenating the whole history."""
    p = r.prompt_token_ids
    if start + n <= len(p):
        return p[start : start + n]
    if start >= len(p):
        o = start - len(p)
        return r.output_token_ids[o : o + n]
    return p[start:] + r.output_token_ids[: start + n - len(p)]


def verify_sample_rows(r: Request, spec, eos: tuple[int, ...]) -> list[SampleRow]:
    """A verify row group's sampling rows: the target's token after the last known token and
    after each proposed one (spec/acceptance.py)."""
    out_pos = len(r.output_token_ids)
    return [SampleRow(r, out_pos + j, eos, tuple(spec[:j])) for j in range(len(spec) + 1)]


def _row_tokens(r: Request, start: int, n: int, spec) -> list[int]:
    """The input tokens of one row: known tokens, then any proposed ones."""
    if not spec:
        return _token_slice(r, start, n)
    return _token_slice(r, start, n - len(spec)) + list(spec)


class BlockTableMirror:
    """Block tables of recently staged requests as rows of one int32 array, kept across steps so
    a decode step copies them with one gather instead of converting every request's block list.

    A request's row is written in full when it first shows up (or when its block list is a
    different list object: a preemption or a new request with the same id), and afterwards only
    the blocks appended since the last step. This relies on the block manager's rule that a
    request's block_ids list only ever grows by appending; any other change replaces the list.
    The mirror keeps a reference to the list it copied, so a new list can never be mistaken for
    it. Rows of requests not seen in a step are reclaimed (zeroed) when rows run out.
    Beyond a request's blocks, a row is all zeros.
    """

    def __init__(self, width: int, rows: int) -> None:
        self.width = width
        self.table = np.zeros((max(rows, 8), width), dtype=np.int32)
        # request_id -> [row, the block_ids list copied, blocks copied, last step seen]
        self.entries: dict[str, list] = {}
        self._free = list(range(len(self.table) - 1, -1, -1))
        self._step = 0

    def sync(self, reqs: list[Request]) -> tuple[list[int], list[int]]:
        """Bring the rows of reqs up to date; their row indices and block counts."""
        self._step = step = self._step + 1
        entries, table = self.entries, self.table
        rows: list[int] = []
        counts: list[int] = []
        for r in reqs:
            blk = r.block_ids
            e = entries.get(r.request_id)
            if e is None or e[1] is not blk or e[2] > len(blk):
                e = self._assign(r, e)
                table = self.table
            elif e[2] != len(blk):
                n = len(blk)
                if n > self.width:
                    table = self._widen(n)
                table[e[0], e[2] : n] = blk[e[2] : n]
                e[2] = n
            e[3] = step
            rows.append(e[0])
            counts.append(e[2])
        return rows, counts

    def _widen(self, n: int) -> np.ndarray:
        """Room for a request holding more blocks than a step can read (a caller that hands
        out blocks up front); the readers only look at the blocks a step needs."""
        wider = np.zeros((len(self.table), max(n, 2 * self.width)), dtype=np.int32)
        wider[:, : self.width] = self.table
        self.table, self.width = wider, wider.shape[1]
        return wider

    def _assign(self, r: Request, e: list | None) -> list:
        blk = r.block_ids
        if len(blk) > self.width:
            self._widen(len(blk))
        if e is None:
            if not self._free:
                self._reclaim()
            e = [self._free.pop(), None, 0, 0]
            self.entries[r.request_id] = e
        row = self.table[e[0]]
        row[: e[2]] = 0
        row[: len(blk)] = blk
        e[1], e[2] = blk, len(blk)
        return e

    def _reclaim(self) -> None:
        """Free the rows of requests not seen in the current step; grow if none."""
        for rid in [rid for rid, e in self.entries.items() if e[3] != self._step]:
            row, _, n, _ = self.entries.pop(rid)
            self.table[row, :n] = 0
            self._free.append(row)
        if not self._free:
            old = len(self.table)
            self.table = np.concatenate([self.table, np.zeros_like(self.table)])
            self._free = list(range(len(self.table) - 1, old - 1, -1))


@dataclass
class DeviceBatch:
    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    logits_indices: torch.Tensor
    num_seqs: int


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
        self.compile_report: compile_cache.CompileReport | None = None
        t_start = time.perf_counter()
        self.tp: TPGroup | None = None
        self.tp_procs: tp_launch.RankProcesses | None = None
        self.step_sync: StepSync | None = None
        self.tp_rank = tp_rank
        self._compile_only = compile_only
        self._tp_lock = threading.Lock()
        tp_size = config.tensor_parallel_size
        if tp_size > 1:
            if self.device.type == "cuda":
                self.device = tp_launch.rank_device(self.device, tp_rank)
            if tp_rank == 0:
                # Refuse a size the model or the host cannot take before starting any rank.
                check_tp_model(config)
                self.tp, self.tp_procs, _ = tp_launch.start_group(config, self.device, compile_only)
                # Before multiprocessing's own exit hook, which would wait forever for ranks
                # still waiting for a step.
                atexit.register(self.shutdown)
            else:
                self.tp = TPGroup.init(tp_rank, tp_size, tp_port, self.device)
            self.step_sync = StepSync(self.tp)
        # What the card holds outside this process's torch allocator before it loads anything
        # (other processes, this one's CUDA context): --max-gpu-memory budgets only what this
        # process adds to it, so neighbours on a shared card do not eat the budget.
        self._non_torch_at_start = 0
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
            free, total = torch.cuda.mem_get_info()
            self._non_torch_at_start = total - free - torch.cuda.memory_reserved()
        try:
            with startup.phase("loading weights", self.startup_times):
                loaded = load_model(
                    config.model, self.dtype, self.device, config.quantization, self.tp
                )
        except Exception:
            # A checkpoint this rank cannot load (a shard that cuts a quantization group...):
            # the other ranks fail the same way; stop them before the watchdog sees them exit.
            self._abort_group()
            raise
        self.model = loaded.model
        self.arch = loaded.arch
        if layer_trace.enabled():
            layer_trace.install(self.model)
        # Speculation with a draft model or an EAGLE head: loaded beside the target, before KV
        # sizing, so its weights and its KV cache (the target's block layout) count against the
        # memory. Either has .model and .arch.
        self.draft = None
        self.draft_kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        spec = config.speculative_config
        method = SpeculativeConfig.from_dict(spec).method if spec is not None else None
        if method == "draft_model":
            with startup.phase("loading the draft model", self.startup_times):
                self.draft = load_draft(
                    spec["model"], config.model, self.arch, self.dtype, self.device
                )
        elif method == "eagle":
            with startup.phase("loading the EAGLE head", self.startup_times):
                self.draft = load_eagle_head(spec["model"], self.arch, self.dtype, self.device)
        # The hidden-state seam: a proposer that reads the target's last hidden states (EAGLE)
        # sets keep_hidden_states; each eager forward, and each verify graph replay, then
        # puts (request, first position, rows) in the step's RunnerOutput.hidden_states.
        # Decode-only steps then replay the verify graphs (the decode graphs return logits
        # only), or run eagerly without them.
        self.keep_hidden_states = False
        self._staged: tuple[list[Request], list[int], np.ndarray] = ([], [], np.zeros(1))
        self.eos_token_ids: list[int] = loaded.eos_token_ids
        self.vocab_size: int = loaded.arch.vocab_size
        # This rank's KV heads (all of them without tensor parallelism).
        self.num_kv_heads: int = self.model.layout.num_kv_heads
        self.block_size: int = config.block_size
        self.max_model_len: int = self._resolve_max_model_len()
        self.max_blocks_per_seq = -(-self.max_model_len // self.block_size)
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
        if self.draft is not None:
            self.draft.model.ops = self.ops
        self.kv_cache_dtype = self.dtype  # seam for an FP8 KV cache
        self._prompt_rows: list[tuple[Request, int, int, int]] = []
        self._alloc_host_buffers(config.max_num_batched_tokens, config.max_num_seqs)
        self._tables = BlockTableMirror(self.max_blocks_per_seq, 2 * config.max_num_seqs)
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
        # graphs' largest size, the verify graphs' largest size times its rows per sequence
        # (twice with a draft model: its catch-up graphs have the verify graphs' rows).
        self._graph_logits_rows = 0
        if use_graphs:
            verify = self.spec_graph_sizes(graph_batch)
            if verify:
                spec = SpeculativeConfig.from_dict(config.speculative_config)
                verify_rows = max(verify) * (spec.num_speculative_tokens + 1)
                if method == "draft_model":
                    verify_rows *= 2
            else:
                verify_rows = 0
            self._graph_logits_rows = graph_batch + verify_rows
        with startup.phase("sizing the KV cache", self.startup_times) as ph:
            self.num_kv_blocks: int = self._decide_num_blocks()
            if self.tp is not None:
                # The block manager on rank 0 hands out blocks that every rank must hold.
                self.num_kv_blocks = self.tp.min_int(self.num_kv_blocks)
            ph.detail = f"{self.num_kv_blocks} blocks of {self.block_size} tokens"
        self.kv_caches = self._alloc_kv_caches(self.num_kv_blocks)
        if self.draft is not None:
            self.draft_kv_caches = self._alloc_kv_caches(self.num_kv_blocks, arch=self.draft.arch)
        self.graphs = None
        self.pipeline: DecodePipeline | None = None
        self.compiled_in_capture: list[str] = []
        # Speculation's graphs (spec/graphs.py): the verify step and the proposer's
        # single-token steps; how many steps ran in graphs and how many eagerly.
        self.verify_graphs: VerifyGraphRunner | None = None
        self.draft_graphs: StepGraphs | None = None
        self.draft_catchup_graphs: VerifyGraphRunner | None = None
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
            if spec is not None and self.spec_graph_sizes(graph_batch):
                with startup.phase("capturing speculative CUDA graphs", self.startup_times) as ph:
                    self.verify_graphs, self.draft_graphs = self.build_spec_graphs(
                        self.graphs.sizes, self.kv_caches, self.draft_kv_caches
                    )
                    self.draft_catchup_graphs = self.build_draft_catchup_graphs(
                        self.verify_graphs.sizes, self.draft_kv_caches
                    )
                    ph.detail = f"verify sizes {self.verify_graphs.sizes}"
            if self.tp is not None:
                self.graphs.before_replay = self._send_graph_step if tp_rank == 0 else None
            elif pipeline_enabled() and config.speculative_config is None:
                # Not under tensor parallelism (a step launched ahead would need the other
                # ranks to launch it too), nor with speculation (it changes the tokens
                # between steps).
                self.pipeline = DecodePipeline(self, pipeline_max_batch())
        logger.info(
            "model %s (%s) on %s, %d KV blocks of %d tokens (%.2f GiB), max_model_len %d",
            self.arch.architecture,
            self.dtype,
            self.device,
            self.num_kv_blocks,
            self.block_size,
            self.num_kv_blocks * self.kv_bytes_per_block() / 2**30,
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

    def _why_no_graphs(self, graph_batch: int) -> str | None:
        if graph_batch < 1:
            return "max_graph_batch_size < 1"
        if not (
            self.ops.capturable() and self.ops.capturable(getattr(self.model, "graph_ops", ()))
        ):
            return f"some decode ops cannot be captured ({self.ops.impl})"
        need = self._fallback_gather_bytes(graph_batch)
        if need > 2 * 2**30:
            return f"the torch decode-attention fallback would gather {need / 2**30:.1f} GiB"
        return None

    def _fallback_gather_bytes(self, rows: int) -> int:
        """What the torch decode-attention fallback gathers for a graph of `rows` rows (the
        whole block table width of every row in fp32); 0 with the numba kernel."""
        if self.ops.impl["paged_decode_attention"] != "torch-capturable":
            return 0
        a = self.arch
        need = rows * self.max_blocks_per_seq * self.block_size * self.num_kv_heads
        return need * a.head_dim * 4 * 2

    def spec_graph_sizes(self, graph_batch: int) -> list[int]:
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
        spec = self.config.speculative_config
        if spec is None or not spec_graphs_enabled() or graph_batch < 1:
            return []
        from voltserve.services.executor.cuda_graphs import graph_batch_sizes

        q = SpeculativeConfig.from_dict(spec).num_speculative_tokens + 1
        sizes = graph_batch_sizes(graph_batch, self.config.cuda_graph_sizes)
        limit = min(max(sizes[-1], 8 * q), self.config.max_num_batched_tokens)
        return verify_batch_sizes(
            sizes, q, lambda rows: rows <= limit and self._fallback_gather_bytes(rows) <= 2 * 2**30
        )

    def build_spec_graphs(
        self, decode_sizes: list[int], kv_caches, draft_kv_caches, capture: bool = True
    ) -> tuple[VerifyGraphRunner, StepGraphs | None]:
        """The verify graphs (spec_graph_sizes) and, for a draft model or an EAGLE head with
        k > 1, the graphs of its single-token steps (the decode sizes); capture=False: the
        static buffers only (the start-up trace runs their forwards)."""
        sc = SpeculativeConfig.from_dict(self.config.speculative_config)
        q = sc.num_speculative_tokens + 1
        pool = getattr(getattr(self, "graphs", None), "pool", None)
        sizes = self.spec_graph_sizes(decode_sizes[-1])
        sizes = [s for s in sizes if s in decode_sizes]
        eagle = sc.method == "eagle"
        verify = VerifyGraphRunner(
            self.model,
            kv_caches,
            self.device,
            self.max_blocks_per_seq,
            self.block_size,
            q,
            sizes,
            with_hidden=eagle,
            capture=capture,
            pool=pool,
        )
        if self.draft is None or q <= 2:
            return verify, None
        target, head = self.model, self.draft.model
        if eagle:

            def fwd(ids, feats, pos, meta, kv):
                h = head(target.model.embed_tokens(ids), feats, pos, meta, kv)
                return target.compute_logits(h, None, fp32_logits=False), h

            feature = (self.arch.hidden_size, self.dtype)
        else:

            def fwd(ids, feats, pos, meta, kv):
                return head(ids, pos, meta, kv, None, fp32_logits=False), None

            feature = None
        draft = StepGraphs(
            fwd,
            draft_kv_caches,
            self.device,
            self.max_blocks_per_seq,
            self.block_size,
            list(decode_sizes),
            feature,
            what="EAGLE head CUDA graphs" if eagle else "draft model CUDA graphs",
            capture=capture,
            pool=pool,
        )
        return verify, draft

    def build_draft_catchup_graphs(
        self, sizes: list[int], draft_kv_caches, capture: bool = True
    ) -> VerifyGraphRunner | None:
        """The draft model's catch-up forward (spec/draft_model.py) as graphs of the verify
        layout on the draft's model and KV cache: `sizes` sequences (the verify sizes) of up to
        k + 1 rows, logits only. None unless the method is draft_model."""
        sc = SpeculativeConfig.from_dict(self.config.speculative_config)
        if sc.method != "draft_model" or self.draft is None or not sizes:
            return None
        return VerifyGraphRunner(
            self.draft.model,
            draft_kv_caches,
            self.device,
            self.max_blocks_per_seq,
            self.block_size,
            sc.num_speculative_tokens + 1,
            list(sizes),
            capture=capture,
            pool=getattr(getattr(self, "graphs", None), "pool", None),
            what="draft model catch-up CUDA graphs",
        )

    def kv_bytes_per_block(self) -> int:
        elem = torch.empty((), dtype=self.kv_cache_dtype).element_size()
        # The target's KV heads are this rank's (tensor parallelism); a draft model is whole.
        heads = [(self.arch, self.num_kv_heads)]
        if self.draft is not None:
            heads.append((self.draft.arch, self.draft.arch.num_kv_heads))
        return sum(a.num_layers * 2 * h * self.block_size * a.head_dim * elem for a, h in heads)

    def _decide_num_blocks(self) -> int:
        if self.config.num_kv_blocks is not None:
            return self.config.num_kv_blocks
        per_block = self.kv_bytes_per_block()
        if self.device.type != "cuda":
            n = self.config.cpu_kv_cache_bytes // per_block
        else:
            n = self._profile_gpu_blocks(per_block)
        if n < 1:
            raise startup.StartupError(
                f"not enough memory for a single KV block ({per_block} bytes); "
                "lower --max-num-batched-tokens or raise --gpu-memory-utilization"
            )
        if self.device.type == "cuda" and n < self.max_blocks_per_seq:
            # A sequence of max_model_len tokens could never be held: refuse to start rather
            # than serve a context the cache cannot hold.
            raise startup.StartupError(
                f"the KV cache fits {int(n)} blocks ({int(n) * self.block_size} tokens), less "
                f"than one sequence of max_model_len {self.max_model_len} tokens; lower "
                "--max-model-len or --max-num-batched-tokens, or raise --gpu-memory-utilization"
            )
        return int(n)

    def _profile_blocks(self) -> int:
        """KV blocks the profile forward's batch uses (its sequences' blocks + 1)."""
        T = self.config.max_num_batched_tokens
        seq = min(T, self.max_model_len)
        return -(-T // seq) * -(-seq // self.block_size) + 1

    def _profile_forward(self, kv: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        """A prefill forward of max_num_batched_tokens tokens (sequences of up to max_model_len)
        on kv (_profile_blocks() blocks), with up to max_num_seqs logits rows: the activation
        peak KV sizing measures (and the prefill kernels the start-up trace records)."""
        T = self.config.max_num_batched_tokens
        seq = min(T, self.max_model_len)
        n_seqs = -(-T // seq)
        blocks_per = -(-seq // self.block_size)
        lens = [min(seq, T - i * seq) for i in range(n_seqs)]
        ids = torch.randint(0, self.vocab_size, (T,), device=self.device)
        pos = torch.cat([torch.arange(n, device=self.device) for n in lens])
        slots = torch.arange(T, device=self.device)  # distinct slots; content does not matter
        bt = torch.arange(n_seqs * blocks_per, device=self.device, dtype=torch.int32).view(
            n_seqs, blocks_per
        )
        qsl = torch.tensor([0] + list(np.cumsum(lens)), dtype=torch.int32, device=self.device)
        meta = AttentionMetadata(
            slots, bt, torch.tensor(lens, dtype=torch.int32, device=self.device), qsl, False, seq
        )
        # Sampling rows: up to max_num_seqs logits rows.
        rows = torch.arange(min(self.config.max_num_seqs, T), device=self.device) % T
        return self.model(ids, pos, meta, kv, rows)

    def _profile_gpu_blocks(self, per_block: int) -> int:
        """KV blocks that fit in gpu_memory_utilization of the card after weights and the
        activation peak of a forward at max_num_batched_tokens."""
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        weights = torch.cuda.memory_allocated()
        tmp_blocks = self._profile_blocks()
        tmp = self._alloc_kv_caches(tmp_blocks, scratch=False)
        tmp_bytes = sum(t.numel() * t.element_size() for kv in tmp for t in kv)
        torch.cuda.reset_peak_memory_stats()
        logits = self._profile_forward(tmp)
        torch.log_softmax(logits, dim=-1).sort(dim=-1)  # the sampler's peak (sort + softmax)
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated()
        del tmp, logits
        torch.cuda.empty_cache()
        activation = max(0, peak - weights - tmp_bytes)
        # The graphs' logits buffers, allocated after this sizing and held for good.
        elem = torch.empty((), dtype=self.dtype).element_size()
        graphs = self._graph_logits_rows * self.vocab_size * elem
        free, total = torch.cuda.mem_get_info()
        non_torch = total - free - torch.cuda.memory_reserved()
        card = total
        if self.config.max_gpu_memory is not None:
            total = min(total, self.config.max_gpu_memory)
            non_torch = max(0, non_torch - self._non_torch_at_start)
        budget = (
            total * self.config.gpu_memory_utilization - non_torch - weights - activation - graphs
        )
        logger.info(
            "memory: total %.2f GiB (card %.2f GiB), weights %.2f GiB, activation peak %.2f GiB, "
            "graph logits %.2f GiB, other %.2f GiB -> KV budget %.2f GiB",
            total / 2**30,
            card / 2**30,
            weights / 2**30,
            activation / 2**30,
            graphs / 2**30,
            non_torch / 2**30,
            budget / 2**30,
        )
        # One block is kept back as the scratch block for padded graph rows.
        return int(budget // per_block) - 1

    def _alloc_kv_caches(
        self, num_blocks: int, scratch: bool | None = None, arch=None
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        # On CUDA one extra block past those the block manager owns receives padded graph rows.
        if scratch is None:
            scratch = self.device.type == "cuda"
        a = arch or self.arch
        heads = self.num_kv_heads if arch is None else a.num_kv_heads
        shape = (num_blocks + int(scratch), heads, self.block_size, a.head_dim)
        return [
            (
                torch.zeros(shape, dtype=self.kv_cache_dtype, device=self.device),
                torch.zeros(shape, dtype=self.kv_cache_dtype, device=self.device),
            )
            for _ in range(a.num_layers)
        ]

    def _alloc_host_buffers(self, max_tokens: int, max_seqs: int) -> None:
        self._cap_tokens, self._cap_seqs = max_tokens, max_seqs
        # ids, positions, slots, logits rows (up to one per token under speculation), then
        # the per-sequence block tables, lengths and query starts.
        size = 4 * max_tokens + max_seqs * (self.max_blocks_per_seq + 3) + 1
        pin = self.device.type == "cuda"
        self._host = torch.empty(size, dtype=torch.int64, pin_memory=pin)
        self._host_np = self._host.numpy()
        self._dev = torch.empty(size, dtype=torch.int64, device=self.device) if pin else self._host
        # Marks the end of the last host -> device copy: the host buffer is reused only after it.
        self._copy_done = torch.cuda.Event() if pin else None

    # ---- per step ----------------------------------------------------------------------------

    def prepare(self, plan: StepPlan) -> tuple[DeviceBatch, list[SampleRow]]:
        """Write the flat batch into the host buffer and copy it to the device once. Per-row
        Python only gathers request fields; the arrays are built with whole-batch numpy."""
        sched = plan.scheduled
        B = len(sched)
        reqs = [s.request for s in sched]
        n_list = [s.num_new_tokens for s in sched]
        start_list = [r.num_computed_tokens for r in reqs]
        T = sum(n_list)
        if T > self._cap_tokens or B > self._cap_seqs:
            self._alloc_host_buffers(max(T, self._cap_tokens), max(B, self._cap_seqs))
        bs = self.block_size
        rows_idx, counts = self._tables.sync(reqs)
        n = np.array(n_list, dtype=np.int64)
        start = np.array(start_list, dtype=np.int64)
        seq_lens = start + n
        nblk = -(-seq_lens // bs)
        cnt = np.array(counts, dtype=np.int64)
        short = np.flatnonzero(cnt < nblk)
        if len(short):
            b = int(short[0])
            raise ValueError(
                f"request {reqs[b].request_id} needs {nblk[b]} KV blocks for {seq_lens[b]} "
                f"tokens but has {cnt[b]}"
            )
        width = max(1, int(nblk.max()))
        tables = self._tables.table[rows_idx, :width].astype(np.int64)
        if (cnt > nblk).any():  # blocks past the ones this step reads stay zero
            tables[np.arange(width) >= nblk[:, None]] = 0
        qsl = np.zeros(B + 1, dtype=np.int64)
        np.cumsum(n, out=qsl[1:])
        row_of = np.repeat(np.arange(B), n)
        pos = np.arange(T, dtype=np.int64) - np.repeat(qsl[:-1] - start, n)
        slots = tables[row_of, pos // bs] * bs + pos % bs
        specs = [s.spec_token_ids for s in sched]
        ids = np.fromiter(
            chain.from_iterable(map(_row_tokens, reqs, start_list, n_list, specs)), np.int64, T
        )
        eos = tuple(self.eos_token_ids)
        rows: list[SampleRow] = []
        logit_rows: list[int] = []
        for b, r in enumerate(reqs):
            sp = specs[b]
            # A row samples when it computes up to the last known token.
            if start_list[b] + n_list[b] - len(sp) != len(r.prompt_token_ids) + len(
                r.output_token_ids
            ):
                continue
            end = int(qsl[b + 1])
            out_pos = len(r.output_token_ids)
            if not sp:
                rows.append(SampleRow(r, out_pos, eos))
                logit_rows.append(end - 1)
                continue
            m = len(sp)
            rows += verify_sample_rows(r, sp, eos)
            logit_rows += range(end - 1 - m, end)
        self._prompt_rows = self._prompt_logprob_rows(reqs, start_list, n_list, qsl)
        self._staged = (reqs, start_list, qsl)
        for _, _, first_row, count in self._prompt_rows:
            logit_rows.extend(range(first_row, first_row + count))
        if self._copy_done is not None:
            self._copy_done.synchronize()
        parts = [
            ids,
            pos,
            slots,
            tables.reshape(-1),
            seq_lens,
            qsl,
            np.asarray(logit_rows, np.int64),
        ]
        offs = np.cumsum([0] + [len(x) for x in parts])
        for x, o in zip(parts, offs[:-1]):
            self._host_np[o : o + len(x)] = x
        n_all = int(offs[-1])
        self._last_lengths = [len(x) for x in parts]
        self._last_n_all = n_all
        if self._dev is not self._host:
            self._dev[:n_all].copy_(self._host[:n_all], non_blocking=True)
            self._copy_done.record()
        d = [self._dev[offs[i] : offs[i + 1]] for i in range(len(parts))]
        meta = AttentionMetadata(
            slot_mapping=d[2],
            block_tables=d[3].view(B, width).to(torch.int32),
            seq_lens=d[4].to(torch.int32),
            query_start_loc=d[5].to(torch.int32),
            is_decode=plan.is_decode_only,
            max_query_len=max(n_list),
        )
        return DeviceBatch(d[0], d[1], meta, d[6], B), rows

    # ---- prompt logprobs (params.prompt_logprobs) ------------------------------------------

    @staticmethod
    def _prompt_logprob_rows(
        reqs: list[Request], start_list: list[int], n_list: list[int], qsl: np.ndarray
    ) -> list[tuple[Request, int, int, int]]:
        """(request, first position, first flat row, count) of the rows whose logits give prompt
        logprobs: the row at position p predicts prompt token p + 1."""
        out = []
        for b, r in enumerate(reqs):
            if r.params.prompt_logprobs is None or r.output_token_ids:
                continue
            start = start_list[b]
            end = min(start + n_list[b], len(r.prompt_token_ids) - 1)
            if end > start:
                out.append((r, start, int(qsl[b]), end - start))
        return out

    def _compute_prompt_logprobs(self, logits: torch.Tensor, out: RunnerOutput) -> None:
        """logits: one row per prompt-logprob row of this step, in _prompt_rows order; the
        entries go to out.prompt_logprobs, requests with a non-finite row to
        out.nonfinite_prompts."""
        rows = self._prompt_rows
        targets: list[int] = []
        for r, start, _, count in rows:
            targets.extend(r.prompt_token_ids[start + 1 : start + 1 + count])
        lp = torch.log_softmax(logits.float(), dim=-1)
        t = torch.tensor(targets, dtype=torch.int64, device=lp.device)
        chosen = lp.gather(1, t[:, None])[:, 0]
        # Rank as vLLM counts it: 1 + the number of tokens more likely than this one.
        rank = (lp > chosen[:, None]).sum(dim=1) + 1
        k = max(r.params.prompt_logprobs or 0 for r, *_ in rows)
        top_v = top_i = None
        if k:
            tv, ti = lp.topk(k, dim=-1)
            top_v, top_i = tv.cpu().tolist(), ti.cpu().tolist()
        chosen_l, rank_l = chosen.cpu().tolist(), rank.cpu().tolist()
        finite_l = finite_rows(logits).cpu().tolist()
        i = 0
        for r, start, _, count in rows:
            if not all(finite_l[i : i + count]):
                # NaN logprobs must never be sent: the request ends with an error instead.
                out.nonfinite_prompts.add(r.request_id)
            n_top = r.params.prompt_logprobs or 0
            entries = out.prompt_logprobs.setdefault(r.request_id, [])
            for j in range(count):
                top = []
                if n_top:
                    top = [[int(a), float(v)] for a, v in zip(top_i[i][:n_top], top_v[i][:n_top])]
                entries.append(
                    (start + 1 + j, {"logprob": chosen_l[i], "rank": int(rank_l[i]), "top": top})
                )
                i += 1

    def _stage_decode(self, plan: StepPlan) -> list[Request]:
        """Write a decode-only step (one new token per request, each sampling) into the CUDA
        graph's host staging buffer: the same values prepare() would compute, per row, written
        with a few whole-batch numpy operations. Returns the requests, in row order."""
        reqs = [s.request for s in plan.scheduled]
        # Decode-only: every row computes its last known token (position num_tokens - 1).
        ids = [r.last_token_id for r in reqs]
        self.stage_decode_rows(reqs, [r.num_computed_tokens for r in reqs], ids)
        return reqs

    def stage_decode_rows(
        self, reqs: list[Request], positions: list[int], ids: list[int] | None
    ) -> None:
        """Stage one decode row per request: row b computes token ids[b] at positions[b] (ids
        None: the caller puts them on the device, see decode_pipeline.py)."""
        g = self.graphs
        B = len(reqs)
        bs = self.block_size
        rows, counts = self._tables.sync(reqs)
        g.stage(B, zero_rows=False)  # rows [0, B) are written in full below
        g.host_pos[:B] = positions
        pos = g.host_pos[:B]
        blk_idx = pos // bs
        tables = g.host_tables[:B]
        np.take(self._tables.table[:, : g.width], rows, axis=0, out=tables)
        if counts != (blk_idx + 1).tolist():
            self._fix_table_rows(reqs, tables, pos, counts)
        if ids is not None:
            g.host_ids[:B] = ids
        g.host_slots[:B] = tables[np.arange(B), blk_idx].astype(np.int64) * bs + pos % bs
        g.host_seq_lens[:B] = pos + 1

    def _fix_table_rows(self, reqs: list[Request], tables, pos, counts: list[int]) -> None:
        """Rows whose request holds more or fewer blocks than the step reads: too few is an
        error; blocks past the ones the step reads are zeroed (as prepare() leaves them)."""
        for b, r in enumerate(reqs):
            nblk = int(pos[b]) // self.block_size + 1
            if counts[b] < nblk:
                raise ValueError(
                    f"request {r.request_id} needs {nblk} KV blocks for {int(pos[b]) + 1} tokens "
                    f"but has {counts[b]}"
                )
            tables[b, nblk:] = 0

    def execute(self, plan: StepPlan) -> RunnerOutput:
        """The step's results (request.py, RunnerOutput); reads request state only."""
        if self.tp is None:
            return self._execute(plan)
        # One thread at a time talks to the group: a step's broadcasts and collectives never
        # interleave with the stop broadcast of `shutdown` (called from another thread).
        with self._tp_lock:
            if self.tp_procs is None:
                raise RuntimeError("the tensor-parallel group has been shut down")
            try:
                return self._execute(plan)
            except Exception:
                # A collective fails as soon as a peer's connection closes, often before the
                # watchdog's next poll sees the rank's exit: name the dead rank if there is one
                # (this exits the process), else let the error end the executor as it is.
                self.tp_procs.exit_if_a_rank_died(wait_s=2.0)
                raise

    @torch.inference_mode()
    def _execute(self, plan: StepPlan) -> RunnerOutput:
        out = RunnerOutput()
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
            reqs = self._stage_decode(plan)
            logits = self.graphs.replay_staged(len(reqs))
            return self.sampler.sample_last(
                logits, reqs, tuple(self.eos_token_ids), self.graphs.argmax_of_last(len(reqs))
            )
        if self.pipeline is not None:
            self.pipeline.discard()  # a step launched ahead is not this one
        batch, rows = self.prepare(plan)
        if self.step_sync is not None:
            self.step_sync.send_eager(
                self._dev[: self._last_n_all],
                self._last_lengths,
                batch.num_seqs,
                batch.meta.block_tables.shape[1],
                batch.meta.is_decode,
                batch.meta.max_query_len or 0,
            )
        if self._prompt_rows:
            logits = self._forward(batch, batch.logits_indices, out)
            self._compute_prompt_logprobs(logits[len(rows) :], out)
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
        rows_idx, blocks = self._tables.sync(reqs)
        vg.stage(
            [r.last_token_id for r in reqs],
            specs,
            starts,
            self._tables.table[rows_idx],
            blocks,
        )
        self._prompt_rows = []
        logits, h = vg.replay_staged()
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
        reqs, starts, qsl = self._staged
        for b, r in enumerate(reqs):
            out.hidden_states.append((r, starts[b], h[int(qsl[b]) : int(qsl[b + 1])]))
        return self.model.compute_logits(h, logits_indices)

    def scrub_kv_blocks(self, blocks: list[int]) -> None:
        """Zero these KV blocks in every layer (target and draft): they held a request whose
        activations went non-finite. Attention reads only a sequence's own positions, but a
        kernel that weights a masked slot by zero still turns a stale NaN there into NaN
        (0 * NaN), so NaN must not wait in a free block for the next request. Queued on the
        step stream: a step launched ahead that still writes them runs first. Rank 0's cache
        only under tensor parallelism."""
        idx = torch.tensor(blocks, dtype=torch.int64, device=self.device)
        for k, v in chain(self.kv_caches, self.draft_kv_caches):
            k.index_fill_(0, idx, 0)
            v.index_fill_(0, idx, 0)

    # ---- tensor parallelism ------------------------------------------------------------------

    def _send_graph_step(self, bs: int, staged: torch.Tensor) -> None:
        """Rank 0, before replaying the bs graph: the other ranks get its staged inputs."""
        self.step_sync.send_graph(bs, staged)

    @torch.inference_mode()
    def worker_loop(self) -> None:
        """Ranks 1..N-1: run each step rank 0 broadcasts until it says stop. The forward is the
        one rank 0 runs (same flat batch, same graph), so every collective pairs up."""
        sync = self.step_sync
        while True:
            hdr = sync.recv_header()
            kind = hdr[0]
            if kind == STOP:
                return
            if kind == GRAPH:
                bs, nbytes = hdr[1], hdr[2]
                g = self.graphs
                self.tp.broadcast(g._dev[:nbytes])
                g.graphs[bs].replay()
                continue
            if kind != EAGER:
                raise RuntimeError(f"tensor-parallel rank {self.tp_rank}: bad step header {hdr}")
            B, width, decode, mql = hdr[1:5]
            lengths = hdr[5 : 5 + NUM_PARTS]
            n_all = sum(lengths)
            if n_all > self._dev.numel():
                self._dev = torch.empty(n_all, dtype=torch.int64, device=self.device)
            flat = self._dev[:n_all]
            self.tp.broadcast(flat)
            d = list(flat.split(lengths))
            meta = AttentionMetadata(
                slot_mapping=d[2],
                block_tables=d[3].view(B, width).to(torch.int32),
                seq_lens=d[4].to(torch.int32),
                query_start_loc=d[5].to(torch.int32),
                is_decode=bool(decode),
                max_query_len=mql,
            )
            self.model(d[0], d[1], meta, self.kv_caches, d[6])

    def _abort_group(self) -> None:
        """Rank 0, during start-up: end the other ranks without a stop broadcast (they are
        not serving steps yet)."""
        procs, self.tp_procs = self.tp_procs, None
        if procs is not None:
            procs.stopping = True
            procs.stop(timeout=5.0)
        if self.tp is not None:
            self.tp.destroy()

    def shutdown(self) -> None:
        """Rank 0: tell the other ranks to exit and wait for them (idempotent)."""
        if self.tp_procs is None:
            return
        # A step in flight finishes first (the engine thread is not joined on the way out).
        locked = self._tp_lock.acquire(timeout=30)
        procs, self.tp_procs = self.tp_procs, None
        if procs is None:
            return
        procs.stopping = True
        try:
            if not self._compile_only:  # compile-only ranks exit after the compile phase
                self.step_sync.send_stop()
        except Exception:  # noqa: BLE001 (a rank already gone: stop kills the rest)
            logger.warning("tensor-parallel stop broadcast failed", exc_info=True)
        procs.stop()
        self.tp.destroy()
        if locked:
            self._tp_lock.release()
