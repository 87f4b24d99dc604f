"""KV cache sizing: how many blocks the cache gets (a profile forward at the step's token budget
measures the activation peak on CUDA; a byte budget on the CPU), and the caches themselves.

A block holds block_size tokens of every layer's keys and values (the target's KV heads of this
rank, and those of a draft model or EAGLE head that keeps its KV in the same block layout). On
CUDA every cache has one extra block past the block manager's: the scratch block that padded
CUDA-graph rows write. A one-byte cache adds its widening workspace (kv_workspace.py): one
layer's K and V per block in the run dtype, at the wider of the target's and the proposer's
rows.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import numpy as np
import torch
from voltserve.services.executor import kv_quant
from voltserve.services.executor.input_batch import attention_metadata
from voltserve.shared import startup

if TYPE_CHECKING:
    from voltserve.services.executor.model_runner import ModelRunner

logger = logging.getLogger(__name__)


def kv_bytes_per_block(runner: ModelRunner) -> int:
    """The target's KV bytes per block (this rank's KV heads under tensor parallelism), plus
    what the proposer's own KV cache adds (spec/proposer.py) and the widening workspace's."""
    elem = torch.empty((), dtype=runner.kv_cache_dtype).element_size()
    a = runner.arch
    target = a.num_kv_layers * 2 * runner.num_kv_heads * runner.block_size * a.head_dim * elem
    proposer = runner.proposer
    target += proposer.kv_bytes_per_block(runner) if proposer is not None else 0
    return target + workspace_bytes_per_block(runner)


def workspace_bytes_per_block(runner: ModelRunner) -> int:
    """The one-byte cache's widening workspace per block (0 without one): K and V of one layer
    in the run dtype, at the wider of the target's and the proposer's rows."""
    if getattr(runner, "kv_workspace", None) is None:
        return 0
    row = runner.num_kv_heads * runner.arch.head_dim
    if runner.proposer is not None:
        row = max(row, runner.proposer.kv_row_elements())
    elem = torch.empty((), dtype=runner.dtype).element_size()
    return 2 * row * runner.block_size * elem


def state_cache_bytes(runner: ModelRunner) -> int:
    """The bytes of the runner's linear-attention state pools (0 without them)."""
    cache = getattr(runner, "state_cache", None)
    return 0 if cache is None else cache.nbytes


def graph_workspace_bytes(runner: ModelRunner) -> int:
    """The split-KV decode attention's fp32 workspace that the largest decode graph holds in
    its pool: it grows with max_model_len (hundreds of MiB at 256 rows and 262,144 tokens)."""
    rows = getattr(runner, "_graph_decode_rows", 0)
    fmt = kv_quant.fp8_format(runner.config.kv_cache_dtype)
    op = "paged_decode_attention" if fmt is None else "paged_decode_attention_fp8"
    if rows < 1 or runner.ops.impl.get(op) != "cuda":
        return 0
    from voltserve.kernels.attention import decode, kv_widen
    from voltserve.kernels.runtime.launch_geometry import sm_count

    lay = runner.model.layout
    return decode.workspace_bytes(
        rows,
        lay.num_heads,
        lay.num_kv_heads,
        runner.arch.head_dim,
        runner.max_model_len,
        sm_count(runner.device),
        fmt or kv_widen.FP16,
    )


def decide_num_blocks(runner: ModelRunner) -> int:
    if runner.config.num_kv_blocks is not None:
        return runner.config.num_kv_blocks
    per_block = kv_bytes_per_block(runner)
    if runner.device.type != "cuda":
        # The linear-attention state (state_cache.py) comes out of the same byte budget; on
        # CUDA it is allocated before the profile, so it counts with the weights.
        n = (runner.config.cpu_kv_cache_bytes - state_cache_bytes(runner)) // per_block
    else:
        n = profile_gpu_blocks(runner, per_block)
    if n < 1:
        raise startup.StartupError(
            f"not enough memory for a single KV block ({per_block} bytes); "
            "lower --max-num-batched-tokens or raise --gpu-memory-utilization"
        )
    cuda = runner.device.type == "cuda"
    if n < runner.max_blocks_per_seq and (cuda or runner.config.max_model_len is not None):
        # A sequence of max_model_len tokens could never be held: refuse to start rather
        # than serve a context the cache cannot hold. On the CPU the model's own length (no
        # --max-model-len) is capped instead (engine.py): its budget is a fixed byte count.
        raise startup.StartupError(
            f"the KV cache fits {int(n)} blocks ({int(n) * runner.block_size} tokens, "
            f"{per_block} bytes a block), less than one sequence of max_model_len "
            f"{runner.max_model_len} tokens; {_fit_advice(runner)}"
        )
    return int(n)


def _fit_advice(runner: ModelRunner) -> str:
    """What makes a longer context fit, for the refusal above."""
    advice = "lower --max-model-len"
    if runner.device.type == "cuda":
        advice += (
            " or --max-num-batched-tokens, or raise --gpu-memory-utilization (or --max-gpu-memory)"
        )
    if runner.config.kv_cache_dtype in ("auto", "fp16"):
        advice += ", or store the KV cache in one byte a value (--kv-cache-dtype fp8_e5m2)"
    return advice


def profile_blocks(runner: ModelRunner) -> int:
    """KV blocks the profile forward's batch uses (its sequences' blocks + 1)."""
    T = runner.config.max_num_batched_tokens
    seq = min(T, runner.max_model_len)
    return -(-T // seq) * -(-seq // runner.block_size) + 1


def profile_forward(
    runner: ModelRunner, kv: list[tuple[torch.Tensor, torch.Tensor]]
) -> torch.Tensor:
    """A prefill forward of max_num_batched_tokens tokens (sequences of up to max_model_len)
    on kv (_profile_blocks() blocks), with up to max_num_seqs logits rows: the activation
    peak KV sizing measures (and the prefill kernels the start-up trace records)."""
    T = runner.config.max_num_batched_tokens
    seq = min(T, runner.max_model_len)
    n_seqs = -(-T // seq)
    blocks_per = -(-seq // runner.block_size)
    lens = [min(seq, T - i * seq) for i in range(n_seqs)]
    ids = torch.randint(0, runner.vocab_size, (T,), device=runner.device)
    pos = torch.cat([torch.arange(n, device=runner.device) for n in lens])
    slots = torch.arange(T, device=runner.device)  # distinct slots; content does not matter
    bt = torch.arange(n_seqs * blocks_per, device=runner.device, dtype=torch.int32).view(
        n_seqs, blocks_per
    )
    qsl = torch.tensor([0] + list(np.cumsum(lens)), dtype=torch.int32, device=runner.device)
    # Linear-attention layers write their state slots (any; the contents do not matter: a
    # request's prefill starts from zeros).
    cache = getattr(runner, "state_cache", None)
    state_slots = None
    if cache is not None:
        state_slots = torch.arange(n_seqs, device=runner.device) % cache.num_slots
    meta = attention_metadata(
        slots,
        bt,
        torch.tensor(lens, dtype=torch.int32, device=runner.device),
        qsl,
        False,
        seq,
        state_slots,
    )
    # Sampling rows: up to max_num_seqs logits rows.
    rows = torch.arange(min(runner.config.max_num_seqs, T), device=runner.device) % T
    return runner.model(ids, pos, meta, kv, rows)


def profile_gpu_blocks(runner: ModelRunner, per_block: int) -> int:
    """KV blocks that fit in gpu_memory_utilization of the card after weights and the
    activation peak of a forward at max_num_batched_tokens."""
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    weights = torch.cuda.memory_allocated()
    tmp_blocks = profile_blocks(runner)
    tmp = alloc_kv_caches(runner, tmp_blocks, scratch=False)
    tmp_bytes = sum(t.numel() * t.element_size() for kv in tmp for t in kv)
    ws = getattr(runner, "kv_workspace", None)
    tmp_bytes += ws.nbytes if ws is not None else 0
    torch.cuda.reset_peak_memory_stats()
    logits = profile_forward(runner, tmp)
    torch.log_softmax(logits, dim=-1).sort(dim=-1)  # the sampler's peak (sort + softmax)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated()
    del tmp, logits
    if ws is not None:
        ws.release()  # the real caches reserve theirs
    torch.cuda.empty_cache()
    activation = max(0, peak - weights - tmp_bytes)
    # The graphs' logits buffers and the largest decode graph's attention workspace, allocated
    # after this sizing and held for good.
    elem = torch.empty((), dtype=runner.dtype).element_size()
    graphs = runner._graph_logits_rows * runner.vocab_size * elem + graph_workspace_bytes(runner)
    free, total = torch.cuda.mem_get_info()
    non_torch = total - free - torch.cuda.memory_reserved()
    card = total
    if runner.config.max_gpu_memory is not None:
        total = min(total, runner.config.max_gpu_memory)
        non_torch = max(0, non_torch - runner._non_torch_at_start)
        weights = max(0, weights - runner._allocated_at_start)
    budget = (
        total * runner.config.gpu_memory_utilization - non_torch - weights - activation - graphs
    )
    logger.info(
        "memory: total %.2f GiB (card %.2f GiB), weights %.2f GiB, activation peak %.2f GiB, "
        "graph buffers %.2f GiB, other %.2f GiB -> KV budget %.2f GiB",
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


def alloc_kv_caches(
    runner: ModelRunner, num_blocks: int, scratch: bool | None = None, arch=None
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    # On CUDA one extra block past those the block manager owns receives padded graph rows. A
    # one-byte cache's widening workspace is reserved for the shape here (kv_workspace.py).
    if scratch is None:
        scratch = runner.device.type == "cuda"
    a = arch or runner.arch
    heads = runner.num_kv_heads if arch is None else a.num_kv_heads
    shape = (num_blocks + int(scratch), heads, runner.block_size, a.head_dim)
    ws = getattr(runner, "kv_workspace", None)
    if ws is not None and a.num_kv_layers:
        ws.reserve(int(np.prod(shape)))
    return [
        (
            torch.zeros(shape, dtype=runner.kv_cache_dtype, device=runner.device),
            torch.zeros(shape, dtype=runner.kv_cache_dtype, device=runner.device),
        )
        for _ in range(a.num_kv_layers)
    ]
