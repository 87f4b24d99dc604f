"""Paged decode attention: one query token per sequence, numba.cuda for SM70 and newer.

Meaning: `paged_decode_attention_ref` in attention/ref.py. Layout: kv_cache.py.

Work split. One thread block owns (sequence, KV head, context partition) and ALL the query heads
that share that KV head (grouped-query), so each K/V element is read from memory once. Long
contexts are cut into partitions so that even batch 1 fills the GPU: `choose_partition` takes
the longest of 1024/512/256/128/64 tokens that still gives ~4 thread blocks per SM (3 for 1024)
for this batch and context bound, or, when one block per sequence and KV head already fills the
GPU, a single partition of the whole bound, or of as much of it as the scores' shared memory
holds (2048 tokens at 4 heads per KV head: a longer bound's later partitions are empty at
contexts up to 2048 and exit at once). The
partials are merged by the last block of a (sequence, head group) to finish (in-kernel merge,
up to 32 partitions) or by a second kernel, each partial sum rescaled by exp(partial max -
global max). When the context bound fits one partition the first kernel normalises and writes
the output itself ("direct"); with the in-kernel merge, so does partition 0 of any sequence whose
own context fits one partition (a runtime branch: the grid still covers the bound).

Two cores compute a block's partition. The online core (`_emit_online_core`, for grids of at
most 2 blocks per SM, i.e. small batches, which are latency-bound) gives each warp whole KV
blocks and a running softmax in registers, with one barrier to combine the warps (12.7 us vs
17.5 us for the block core at batch 1, 1K context, Llama-3-8B shape, on an H200). The block core
(bandwidth-bound batches, 0.90 of copy bandwidth at batch 32) works as follows.

Inside a block: the partition's block-table entries are read once into shared memory. Lanes are
grouped per token, each lane owning one 16-byte chunk (8 dims) of the token's K/V row, so a warp
reads whole contiguous rows; a warp takes one 16-token KV block at a time and issues all of its
16-byte loads (up to 8 per lane) before using any. QK dot products are finished with a
reduce-scatter over the token's lanes (the partial scores of several tokens and heads are
halved at each shuffle step, ~1 shuffle per score instead of log2(lanes)); softmax runs over the
partition's scores in shared memory; PV accumulates in fp32 registers (G x 8 per lane) and is
reduced across lanes (shuffles) and warps (shared atomics) once per partition.

The kernel source is generated per shape (`_kernel_source`) with every compile-time loop written
out, so loaded words, q, scores and accumulators are named scalars in registers: no local memory
(check the PTX for ld.local/st.local).

CUDA graphs: the grid depends only on an upper bound of the context (`max_seq_len`, by default
the block table width x block size), never on the values of seq_lens. Partitions past a
sequence's length exit at once; the merge reads each sequence's own partition count; a
sequence of length 0 (graph padding) gets a zero output. No host sync anywhere.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass

from numba import cuda, float32, int32, int64, uint32
from voltserve.kernels.attention import kv_widen
from voltserve.kernels.attention.common import (
    check_paged_cache,
    half_hi,
    half_lo,
    ld_u32x4,
    next_pow2,
    shfl_xor,
)
from voltserve.kernels.runtime.compile_cache import cached, cached_factory
from voltserve.kernels.runtime.launch_geometry import sm_count
from voltserve.kernels.runtime.numba_common import SIM, current_stream, launch, named_kernel

BLOCK_SIZE = 16  # tokens per KV block (fixed by the block manager)
DEFAULT_PARTITION = 512
MAX_HEADS_PER_BLOCK = 8  # query heads per thread block; larger groups are split (registers)


@dataclass(frozen=True)
class DecodeConfig:
    head_dim: int
    group: int  # query heads handled by one thread block (all share one KV head)
    split: int  # thread blocks per KV head along the heads (num_heads // num_kv_heads // group)
    partition: int  # context tokens per thread block
    num_threads: int
    # Per-warp online softmax (see _emit_online_core) instead of the block-wide score/softmax/PV
    # phases: fewer barriers and no shared-memory score round trip, for latency-bound grids.
    online: bool = False
    # The cache's storage (kv_widen.KV_FORMATS): fp16, or one-byte codes (decode_fp8.py), whose
    # 16-byte loads hold 16 values, so a lane holds twice the q and PV values of fp16's.
    kv: str = kv_widen.FP16
    # Split mode only: spread each sequence's own KV blocks over the grid's partitions at run
    # time (dynamic_partitions), for grids that one partition per sequence leaves mostly idle.
    spread: bool = False
    # Online core only: software-pipelined, each warp's next KV block's loads issued before the
    # current block's math (see _emit_online_core). Off until timed on a GPU.
    prefetch: bool = False

    def __post_init__(self) -> None:
        if self.prefetch and not self.online:
            raise ValueError("prefetch is an option of the online core (online=True)")


def decode_config(
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    partition_size: int | None = None,
    num_threads: int = 128,
    online: bool = False,
    max_group: int = MAX_HEADS_PER_BLOCK,
    kv: str = kv_widen.FP16,
    prefetch: bool = False,
) -> DecodeConfig:
    """max_group: at most this many query heads per thread block (the rest of a KV head's
    heads go to further blocks: `split`); kv: the cache's storage (max_heads_per_block);
    prefetch: the online core's software pipelining (DecodeConfig.prefetch)."""
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}")
    vec = kv_widen.values_per_load(kv)
    if head_dim % vec or not vec <= head_dim <= 256:
        raise ValueError(f"head_dim {head_dim} must be a multiple of {vec} in [{vec}, 256] ({kv})")
    if num_threads % 32 or not 32 <= num_threads <= 1024:
        raise ValueError(f"num_threads {num_threads} must be a multiple of 32 in [32, 1024]")
    ratio = num_heads // num_kv_heads
    cap = max(1, min(ratio, max_heads_per_block(kv), max_group))
    group = max(g for g in range(1, cap + 1) if ratio % g == 0)
    partition = partition_size or DEFAULT_PARTITION
    if partition % BLOCK_SIZE:
        raise ValueError(f"partition_size {partition} must be a multiple of {BLOCK_SIZE}")
    return DecodeConfig(
        head_dim, group, ratio // group, partition, num_threads, online, kv, prefetch=prefetch
    )


def max_heads_per_block(kv: str) -> int:
    """MAX_HEADS_PER_BLOCK for fp16; halved for one-byte storage, whose lanes hold 16 values of
    q and of the PV sums per head instead of 8 (the same registers per head group)."""
    return MAX_HEADS_PER_BLOCK * 8 // kv_widen.values_per_load(kv)


def _layout(cfg: DecodeConfig) -> dict[str, int]:
    """Compile-time constants of the lane layout (see the module docstring)."""
    vec = kv_widen.values_per_load(cfg.kv)  # values per 16-byte load
    nchunk = cfg.head_dim // vec  # 16-byte chunks per token row
    tpt = max(2, next_pow2(nchunk))  # lanes per token (power of two: shuffles stay in the group)
    tpp = 32 // tpt  # tokens per warp pass
    npass = BLOCK_SIZE // tpp  # passes per KV block
    # Loads in flight per lane: the whole KV block when the registers allow it (q or the
    # accumulators take G x 8 registers, each in-flight load 4).
    batch = min(npass, 8 if cfg.group <= 4 else 4)
    # Passes whose G scores are reduced together: reduce-scatter G x sc values over the tpt
    # lanes of a token costs ~G x sc shuffles instead of G x sc x log2(tpt).
    sc = max(1, min(batch, tpt // next_pow2(cfg.group)))
    return dict(nchunk=nchunk, tpt=tpt, tpp=tpp, npass=npass, batch=batch, sc=sc, vec=vec)


def _kernel_source(cfg: DecodeConfig, mode: str) -> str:
    """Source of the partition kernel for one shape, with every loop over a compile-time count
    written out: loaded words, q, scores and accumulators are named scalars, so they live in
    registers (a numba local array indexed in a loop the compiler did not unroll lives in local
    memory, which is what held the first version of this kernel to under half the bandwidth)."""
    if mode not in MODES:
        raise ValueError(f"mode {mode!r} is not one of {MODES}")
    direct, merge = mode == "direct", mode == "merge"
    D, G, PART, NT = cfg.head_dim, cfg.group, cfg.partition, cfg.num_threads
    lay = _layout(cfg)
    NCHUNK, TPT, SC, V = lay["nchunk"], lay["tpt"], lay["sc"], lay["vec"]
    GD = G * D
    NVAL = SC * G
    NPAD = next_pow2(NVAL)
    masks = [TPT >> (k + 1) for k in range(TPT.bit_length() - 1)]  # TPT/2 .. 1
    out: list[str] = []

    def emit(indent: int, line: str) -> None:
        out.append("    " * indent + line)

    # Reduce-scatter plan: at a step whose list has >= 2 values, lanes split it (the lane with
    # the mask bit set keeps the upper half) and add what the partner sends; once one value is
    # left, the remaining steps are plain butterflies and only the lane with those bits clear
    # writes. Lane-constant results: rs (first kept index), writer.
    steps: list[tuple[int, int]] = []  # (mask, half length or 0 for a plain butterfly)
    n = NPAD
    for m in masks:
        if n >= 2:
            steps.append((m, n // 2))
            n //= 2
        else:
            steps.append((m, 0))
    n_final = n
    plain_mask = sum(m for m, h in steps if h == 0)

    def reduce_scatter(indent: int, names: list[str]) -> list[str]:
        cur = list(names)
        for k, (m, h) in enumerate(steps):
            if h:
                nxt = []
                for a in range(h):
                    lo, hi = cur[a], cur[a + h]
                    emit(indent, f"x = {hi} if bit{m} else {lo}")
                    emit(indent, f"z = {lo} if bit{m} else {hi}")
                    emit(indent, f"u{k}_{a} = x + shfl_xor(z, {m})")
                    nxt.append(f"u{k}_{a}")
                cur = nxt
            else:
                emit(indent, f"u{k}_0 = {cur[0]} + shfl_xor({cur[0]}, {m})")
                cur = [f"u{k}_0"]
        return cur

    def widen(indent: int, regs: str, name: str) -> None:
        kv_widen.emit_widen(emit, indent, regs, name, cfg.kv)

    # One-byte storage takes the V side's factor (kv_widen.scale_factor times the layer's
    # v_scale) as one more argument; K's is in `scale` (the launcher's product).
    one_byte = cfg.kv in kv_widen.ONE_BYTE
    emit(0, "def kernel(out, q, k_cache, v_cache, block_tables, seq_lens, scale, num_kv_heads,")
    emit(
        0, f"           max_logits, exp_sums, tmp_out, counters{', v_scale' if one_byte else ''}):"
    )
    emit(1, "part = cuda.blockIdx.x")
    emit(1, "y = cuda.blockIdx.y")
    emit(1, "b = cuda.blockIdx.z")
    emit(1, f"kvh = y // {cfg.split}")
    emit(1, f"h0 = y * {G}")
    emit(1, "tid = cuda.threadIdx.x")
    emit(1, "lane = tid % 32")
    emit(1, "warp = tid // 32")
    # q does not depend on the context: its loads (and, for the online core, the first KV
    # block's table entry) are issued before seq_len arrives, so they overlap that round trip.
    emit(1, f"sub = lane // {TPT}")
    emit(1, f"c = lane % {TPT}")
    emit(1, "fscale = float32(scale)")
    if one_byte:
        emit(1, "vmul = float32(v_scale)")
    if NCHUNK < TPT:  # lanes past the row load a valid chunk and weigh it by q = 0
        emit(1, f"active = c < {NCHUNK}")
        emit(1, f"ce = min(c, {NCHUNK - 1})")
        emit(1, "qs = fscale if active else float32(0.0)")
    else:
        emit(1, "active = True")
        emit(1, "ce = c")
        emit(1, "qs = fscale")
    emit(1, f"lane_off = sub * {D} + ce * {V}")
    for g in range(G):
        for j in range(V):
            emit(1, f"q{g}_{j} = float32(q[b, h0 + {g}, ce * {V} + {j}]) * qs")
    if cfg.online:
        _emit_first_entry(emit, cfg, mode)
    emit(1, "seq_len = seq_lens[b]")
    if dynamic_partitions(cfg, mode):
        # The sequence's own KV blocks spread over the grid's partitions at run time (see
        # dynamic_partitions): pb blocks each, at least one per warp, at most PART / 16.
        emit(1, f"pb, n_done = spread_split(seq_len, cuda.gridDim.x, {spread_min_blocks(cfg)})")
        emit(1, f"start = part * pb * {BLOCK_SIZE}")
        span = f"pb * {BLOCK_SIZE}"
    else:
        emit(1, f"start = part * {PART}")
        span = str(PART)
    emit(1, "if start >= seq_len:")
    if direct or merge:  # seq_len == 0 (graph padding): partition 0 writes a zero output
        emit(2, "if part == 0:")
        emit(3, f"for i in range(tid, {GD}, {NT}):")
        emit(4, f"out[b, h0 + i // {D}, i % {D}] = 0.0")
    emit(2, "return")
    emit(1, f"n_tok = min({span}, seq_len - start)")
    emit(1, f"n_blk = (n_tok + {BLOCK_SIZE - 1}) // {BLOCK_SIZE}")
    emit(1, f"blk0 = start // {BLOCK_SIZE}")
    if not cfg.online:
        emit(1, f"logits = cuda.shared.array(({G}, {PART}), float32)")
    emit(1, f"acc_s = cuda.shared.array({GD}, float32)")
    emit(1, f"m_s = cuda.shared.array({G}, float32)")
    emit(1, f"l_s = cuda.shared.array({G}, float32)")
    if not cfg.online:
        # The block core's warps share the partition's table entries through shared memory;
        # the online core reads each warp's entries itself (no barrier before the KV loads).
        emit(1, f"tbl = cuda.shared.array({PART // BLOCK_SIZE}, int32)")
        emit(1, f"for i in range(tid, {GD}, {NT}):")
        emit(2, "acc_s[i] = 0.0")
        emit(1, f"for i in range(tid, n_blk, {NT}):")
        emit(2, "tbl[i] = block_tables[b, blk0 + i]")
    if cfg.online:
        _emit_online_core(emit, cfg, lay, widen)
    else:
        _emit_block_core(emit, cfg, lay, steps, plain_mask, n_final, reduce_scatter, widen)
    _emit_epilogue(emit, cfg, mode)
    return "\n".join(out) + "\n"


def _emit_pv(emit, indent, G: int, V: int, widen, regs: str, vname: str, probs: list[str]) -> None:
    """a{g}_{j} += probs[g] * v_j for the V values of one lane's V chunk held in regs."""
    widen(indent, regs, vname)
    for g in range(G):
        for j in range(V):
            emit(indent, f"a{g}_{j} += {probs[g]} * {vname}{j}")


def _acc_out(cfg: DecodeConfig, g: int, j: int) -> str:
    """A lane's PV sum as it leaves the core: times the V side's factor for one-byte storage
    (once per partition instead of once per value)."""
    return f"a{g}_{j} * vmul" if cfg.kv in kv_widen.ONE_BYTE else f"a{g}_{j}"


def _emit_block_core(emit, cfg, lay, steps, plain_mask, n_final, reduce_scatter, widen) -> None:
    """Scores of the partition into shared memory, then one softmax over them, then PV; the
    block's sums land in acc_s / m_s / l_s (the epilogue's inputs)."""
    D, G, NT = cfg.head_dim, cfg.group, cfg.num_threads
    NCHUNK, TPT, TPP, NPASS, BATCH, SC, V = (
        lay[k] for k in ("nchunk", "tpt", "tpp", "npass", "batch", "sc", "vec")
    )
    NW = NT // 32
    ROW = BLOCK_SIZE * D
    NVAL = SC * G
    NPAD = next_pow2(NVAL)
    log_tpp = TPP.bit_length() - 1
    for m, _ in steps:
        emit(1, f"bit{m} = (lane & {m}) != 0")
    emit(1, "rs = 0")
    for m, h in steps:
        if h:
            emit(1, f"if bit{m}:")
            emit(2, f"rs += {h}")
    emit(1, f"writer = (lane & {plain_mask}) == 0")
    for j in range(n_final):
        emit(1, f"w_ok{j} = writer and rs + {j} < {NVAL}")
        emit(1, f"w_ps{j} = ((rs + {j}) // {G}) * {TPP}")
        emit(1, f"w_g{j} = (rs + {j}) % {G}")
    emit(1, "cuda.syncthreads()")

    # When one batch of loads covers a KV block, the V rows of the warp's first block are loaded
    # now, so their memory latency overlaps the score and softmax phases instead of following
    # them (short partitions give each warp one block: that is the whole PV phase).
    prefetch = NPASS == BATCH
    if prefetch:
        emit(1, "ip = min(warp, n_blk - 1)")
        _emit_block_loads(emit, 1, "vp", "v_cache", "ip", ROW, BATCH, TPP, D)

    def scores(indent: int, bt: int) -> None:
        """logits of load batch bt of block i (its words in r*) for this lane's tokens."""
        for sc0 in range(0, BATCH, SC):
            names = []
            for psl in range(SC):
                ps = sc0 + psl
                widen(indent, f"r{ps}", "k")
                for g in range(G):
                    terms = " + ".join(f"q{g}_{j} * k{j}" for j in range(V))
                    emit(indent, f"s{psl * G + g} = {terms}")
                    names.append(f"s{psl * G + g}")
            names += ["float32(0.0)"] * (NPAD - NVAL)
            final = reduce_scatter(indent, names)
            for j, name in enumerate(final):
                emit(indent, f"tpos = t0 + {(bt * BATCH + sc0) * TPP} + w_ps{j}")
                emit(indent, f"if w_ok{j} and tpos < n_tok:")
                emit(indent + 1, f"logits[w_g{j}, tpos] = {name}")

    # Scores: logits[g, t] = q_g . k_t (scale folded into q).
    emit(1, f"for i in range(warp, n_blk, {NW}):")
    emit(2, f"base = (int64(tbl[i]) * num_kv_heads + kvh) * {ROW} + lane_off")
    emit(2, f"t0 = i * {BLOCK_SIZE} + sub")
    for bt in range(NPASS // BATCH):
        for ps in range(BATCH):
            off = (bt * BATCH + ps) * TPP * D
            emit(2, f"r{ps}_0, r{ps}_1, r{ps}_2, r{ps}_3 = ld_u32x4(k_cache, base + {off})")
        scores(2, bt)
    emit(1, "cuda.syncthreads()")

    # Softmax numerators in place, with each head's max and sum.
    emit(1, f"for g in range(warp, {G}, {NW}):")
    emit(2, "m = float32(-math.inf)")
    emit(2, "for t in range(lane, n_tok, 32):")
    emit(3, "m = max(m, logits[g, t])")
    for k in range(5):
        emit(2, f"m = max(m, shfl_xor(m, {16 >> k}))")
    emit(2, "total = float32(0.0)")
    emit(2, "for t in range(lane, n_tok, 32):")
    emit(3, "e = math.exp(logits[g, t] - m)")
    emit(3, "logits[g, t] = e")
    emit(3, "total += e")
    for k in range(5):
        emit(2, f"total += shfl_xor(total, {16 >> k})")
    emit(2, "if lane == 0:")
    emit(3, "m_s[g] = m")
    emit(3, "l_s[g] = total")
    emit(1, "cuda.syncthreads()")

    # PV: each lane accumulates its V dims of every head over its tokens.
    for g in range(G):
        for j in range(V):
            emit(1, f"a{g}_{j} = float32(0.0)")

    def pv(indent: int, bt: int) -> None:
        """a += p * v over load batch bt of block i (its words in r*)."""
        for ps in range(BATCH):
            emit(indent, f"tpos = t0 + {(bt * BATCH + ps) * TPP}")
            # Rows past the context hold stale data (maybe NaN): skip, never multiply by 0.
            emit(indent, "if tpos < n_tok:")
            for g in range(G):
                emit(indent + 1, f"p{g} = logits[{g}, tpos]")
            _emit_pv(emit, indent + 1, G, V, widen, f"r{ps}", "v", [f"p{g}" for g in range(G)])

    emit(1, f"for i in range(warp, n_blk, {NW}):")
    emit(2, f"base = (int64(tbl[i]) * num_kv_heads + kvh) * {ROW} + lane_off")
    emit(2, f"t0 = i * {BLOCK_SIZE} + sub")
    for bt in range(NPASS // BATCH):
        ind = 2
        if prefetch:
            emit(2, "if i == warp:")
            for ps in range(BATCH):
                emit(
                    3,
                    f"r{ps}_0, r{ps}_1, r{ps}_2, r{ps}_3 = vp{ps}_0, vp{ps}_1, vp{ps}_2, vp{ps}_3",
                )
            emit(2, "else:")
            ind = 3
        for ps in range(BATCH):
            off = (bt * BATCH + ps) * TPP * D
            emit(ind, f"r{ps}_0, r{ps}_1, r{ps}_2, r{ps}_3 = ld_u32x4(v_cache, base + {off})")
        pv(2, bt)
    for g in range(G):
        for j in range(V):
            for k in range(log_tpp):
                emit(1, f"a{g}_{j} += shfl_xor(a{g}_{j}, {TPT << k})")
    emit(1, "if sub == 0 and active:")
    for g in range(G):
        for j in range(V):
            emit(2, f"cuda.atomic.add(acc_s, {g * D} + ce * {V} + {j}, {_acc_out(cfg, g, j)})")
    emit(1, "cuda.syncthreads()")


def _emit_block_loads(emit, indent, regs, cache, blk, ROW, BATCH, TPP, D) -> None:
    """regs{ps}_0..3 = this lane's words of KV block `blk` of the partition (BATCH loads of 16
    bytes: the whole block)."""
    emit(indent, f"lbase = (int64(tbl[{blk}]) * num_kv_heads + kvh) * {ROW} + lane_off")
    for ps in range(BATCH):
        names = ", ".join(f"{regs}{ps}_{w}" for w in range(4))
        emit(indent, f"{names} = ld_u32x4({cache}, lbase + {ps * TPP * D})")


def _emit_epilogue(emit, cfg: DecodeConfig, mode: str) -> None:
    """From the block's acc_s (unnormalised PV sums), m_s (score max) and l_s (exp sums):
    direct: the output; split/merge: the partials (and, merge, the last block's merge)."""
    direct, merge = mode == "direct", mode == "merge"
    D, G, PART, NT = cfg.head_dim, cfg.group, cfg.partition, cfg.num_threads
    NW = NT // 32
    GD = G * D
    dyn = dynamic_partitions(cfg, mode)
    if merge:
        # A context that fits one partition (every context up to 2048 tokens under the full-grid
        # choice, whatever the bound) is finished by partition 0 as in direct mode: no partials,
        # no fence, no arrival ticket, no merge read. The counter of a group with one partition
        # is never touched, so it stays zero.
        emit(1, "if n_done == 1:" if dyn else f"if seq_len <= {PART}:")
        emit(2, f"for i in range(tid, {GD}, {NT}):")
        emit(3, f"g = i // {D}")
        emit(3, f"out[b, h0 + g, i % {D}] = acc_s[i] / l_s[g]")
        emit(2, "return")
    if direct:
        emit(1, f"for i in range(tid, {GD}, {NT}):")
        emit(2, f"g = i // {D}")
        emit(2, f"out[b, h0 + g, i % {D}] = acc_s[i] / l_s[g]")
    else:
        emit(1, f"for i in range(tid, {GD}, {NT}):")
        emit(2, f"tmp_out[b, h0 + i // {D}, part, i % {D}] = acc_s[i]")
        emit(1, f"if tid < {G}:")
        emit(2, "max_logits[b, h0 + tid, part] = m_s[tid]")
        emit(2, "exp_sums[b, h0 + tid, part] = l_s[tid]")
    if merge:
        _emit_merge(emit, G, D, NT, NW, PART, dyn)


def _emit_first_entry(emit, cfg: DecodeConfig, mode: str) -> None:
    """spec_ent: the block-table entry of this warp's first KV block, loaded before seq_len is
    known, so the K/V loads wait on one round trip fewer. The partition's first block is
    guessed: part * PART / 16 for static partitions; for dynamic ones (dynamic_partitions)
    part * pb with pb at its least, min(warps, PART / 16), which is what every context of up to
    partitions x pb blocks gets (all short contexts, the latency-bound case). The guess's index
    is always inside the table (the grid covers at most the table's width) and is clamped
    anyway; the core uses the entry only where the guess was right (spec_blk0 == blk0)."""
    pb0 = spread_min_blocks(cfg) if dynamic_partitions(cfg, mode) else None
    first = f"part * {pb0}" if pb0 else f"part * {cfg.partition // BLOCK_SIZE}"
    emit(1, f"spec_blk0 = {first}")
    emit(1, "spec_ent = block_tables[b, min(spec_blk0 + warp, block_tables.shape[1] - 1)]")


def _emit_online_core(emit, cfg: DecodeConfig, lay: dict[str, int], widen) -> None:
    """Each warp takes whole KV blocks (16 tokens) and keeps its own running softmax in
    registers: K and V rows of a block loaded together (one memory round trip), scores summed
    over the token's lanes by butterflies (every lane of a token holds its score), the block's
    max per head by one or two more shuffles, then the running max, sum and PV accumulators
    rescaled and updated. One barrier at the end, where the warps' (max, sum, PV) are combined
    into acc_s / m_s / l_s. Against the block-wide phases (scores to shared memory, a barrier,
    a softmax pass, a barrier, PV, shared atomics, a barrier) this shortens a block's critical
    path, which is what a batch-1 decode step waits on (one wave of blocks, ~1-2 KV blocks per
    warp). Costs more registers (K and V in flight together): used for small grids only.

    cfg.prefetch: software-pipelined. Otherwise each iteration uses its loads at once, so a warp
    has one KV block in flight and waits a whole memory round trip per block (one-byte storage,
    whose lanes bring 16 values a load, has half of fp16's bytes in flight per block). With it,
    the warp's first block is loaded before the loop, and each iteration issues the next block's
    table entry and K/V loads (into nr* / nv*) before its own block's math, which then overlaps
    them: two blocks in flight, at twice the load registers. ptxas may still place them later
    where registers run short: for sm_90, e5m2 at 128 dims and 4 heads, after the scores, into
    K's freed registers (255 registers either way, against 225 without prefetch)."""
    D, G, NT = cfg.head_dim, cfg.group, cfg.num_threads
    TPT, TPP, NPASS, V = lay["tpt"], lay["tpp"], lay["npass"], lay["vec"]
    NW = NT // 32
    GD = G * D
    ROW = BLOCK_SIZE * D
    tok_masks = [TPT >> (k + 1) for k in range(TPT.bit_length() - 1)]  # lanes of one token
    sub_masks = [TPT << k for k in range(TPP.bit_length() - 1)]  # the tokens of one pass

    def words(reg: str, ps: int) -> str:
        return ", ".join(f"{reg}{ps}_{w}" for w in range(4))

    def kv_loads(indent: int, k_reg: str, v_reg: str, base: str) -> None:
        """The lane's K and V words of the KV block whose row starts at `base`."""
        for reg, cache in ((k_reg, "k_cache"), (v_reg, "v_cache")):
            for ps in range(NPASS):
                emit(indent, f"{words(reg, ps)} = ld_u32x4({cache}, {base} + {ps * TPP * D})")

    def kv_copy(indent: int, dst: tuple[str, str], src: tuple[str, str]) -> None:
        for d, s in zip(dst, src, strict=True):
            for ps in range(NPASS):
                emit(indent, f"{words(d, ps)} = {words(s, ps)}")

    if cfg.prefetch:
        # The warp's first KV block, its entry as below (spec_ent where the guess was right).
        emit(1, "if warp < n_blk:")
        emit(2, "ent = spec_ent")
        emit(2, "if blk0 != spec_blk0:")
        emit(3, "ent = block_tables[b, blk0 + warp]")
        emit(2, f"base = (int64(ent) * num_kv_heads + kvh) * {ROW} + lane_off")
        kv_loads(2, "r", "v", "base")
        emit(1, "else:")  # no KV block: the loop does not run, but numba types r* / v* here too
        for reg in ("r", "v"):
            for ps in range(NPASS):
                emit(2, f"{words(reg, ps)} = {', '.join(['uint32(0)'] * 4)}")
    for g in range(G):
        emit(1, f"m{g} = float32(-math.inf)")
        emit(1, f"l{g} = float32(0.0)")
        for j in range(V):
            emit(1, f"a{g}_{j} = float32(0.0)")
    emit(1, f"for i in range(warp, n_blk, {NW}):")
    if cfg.prefetch:
        emit(2, f"if i + {NW} < n_blk:")
        emit(3, f"nent = block_tables[b, blk0 + i + {NW}]")
        emit(3, f"nbase = (int64(nent) * num_kv_heads + kvh) * {ROW} + lane_off")
        kv_loads(3, "nr", "nv", "nbase")
        emit(2, "else:")  # the last block: nothing to load; the names need a value
        kv_copy(3, ("nr", "nv"), ("r", "v"))
        emit(2, f"t0 = i * {BLOCK_SIZE} + sub")
    else:
        # The warp's first KV block's entry was loaded before seq_len (_emit_first_entry); it
        # is the right one when the partition starts where that load guessed.
        emit(2, "ent = spec_ent")
        emit(2, "if i != warp or blk0 != spec_blk0:")
        emit(3, "ent = block_tables[b, blk0 + i]")
        emit(2, f"base = (int64(ent) * num_kv_heads + kvh) * {ROW} + lane_off")
        emit(2, f"t0 = i * {BLOCK_SIZE} + sub")
        kv_loads(2, "r", "v", "base")
    for ps in range(NPASS):
        widen(2, f"r{ps}", "k")
        for g in range(G):
            terms = " + ".join(f"q{g}_{j} * k{j}" for j in range(V))
            emit(2, f"s{ps}_{g} = {terms}")
    # Butterflies over a token's lanes, all scores of the step interleaved (independent chains).
    for m in tok_masks:
        for ps in range(NPASS):
            for g in range(G):
                emit(2, f"s{ps}_{g} += shfl_xor(s{ps}_{g}, {m})")
    for ps in range(NPASS):
        emit(2, f"ok{ps} = t0 + {ps * TPP} < n_tok")
        for g in range(G):
            emit(2, f"s{ps}_{g} = s{ps}_{g} if ok{ps} else float32(-math.inf)")
    for g in range(G):
        emit(
            2,
            f"mx = {'max(' * (NPASS - 1)}s0_{g}"
            + "".join(f", s{ps}_{g})" for ps in range(1, NPASS)),
        )
        for m in sub_masks:
            emit(2, f"mx = max(mx, shfl_xor(mx, {m}))")
        # The block's first token is < n_tok, so mx is finite; exp(-inf) = 0 on the first step.
        emit(2, f"mn = max(m{g}, mx)")
        emit(2, f"f = math.exp(m{g} - mn)")
        emit(2, f"m{g} = mn")
        emit(2, f"l{g} *= f")
        for j in range(V):
            emit(2, f"a{g}_{j} *= f")
        for ps in range(NPASS):
            emit(2, f"p{ps}_{g} = math.exp(s{ps}_{g} - mn)")
            emit(2, f"l{g} += p{ps}_{g}")
    for ps in range(NPASS):
        # Rows past the context hold stale data (maybe NaN): skipped, never multiplied by 0.
        emit(2, f"if ok{ps}:")
        _emit_pv(emit, 3, G, V, widen, f"v{ps}", "w", [f"p{ps}_{g}" for g in range(G)])
    if cfg.prefetch:
        kv_copy(2, ("r", "v"), ("nr", "nv"))
    # Sums over the tokens of a pass (lanes with the same chunk c), then the warps' partials.
    for g in range(G):
        for m in sub_masks:
            emit(1, f"l{g} += shfl_xor(l{g}, {m})")
            for j in range(V):
                emit(1, f"a{g}_{j} += shfl_xor(a{g}_{j}, {m})")
    emit(1, f"wm = cuda.shared.array(({NW}, {G}), float32)")
    emit(1, f"wl = cuda.shared.array(({NW}, {G}), float32)")
    emit(1, f"wa = cuda.shared.array(({NW}, {GD}), float32)")
    emit(1, "if lane == 0:")
    for g in range(G):
        emit(2, f"wm[warp, {g}] = m{g}")
        emit(2, f"wl[warp, {g}] = l{g}")
    emit(1, "if sub == 0 and active:")
    for g in range(G):
        for j in range(V):
            emit(2, f"wa[warp, {g * D} + ce * {V} + {j}] = {_acc_out(cfg, g, j)}")
    emit(1, "cuda.syncthreads()")
    # A warp that had no KV block has max -inf and zero sums: weighed by 0, not exp(nan).
    emit(1, f"for i in range(tid, {GD + G}, {NT}):")
    emit(2, f"g = i // {D} if i < {GD} else i - {GD}")
    emit(2, "mg = float32(-math.inf)")
    emit(2, f"for w in range({NW}):")
    emit(3, "mg = max(mg, wm[w, g])")
    emit(2, "acc = float32(0.0)")
    emit(2, f"for w in range({NW}):")
    emit(3, "mw = wm[w, g]")
    emit(3, "if mw > float32(-math.inf):")
    emit(4, f"acc += (wa[w, i] if i < {GD} else wl[w, g]) * math.exp(mw - mg)")
    emit(2, f"if i < {GD}:")
    emit(3, "acc_s[i] = acc")
    emit(2, "else:")
    emit(3, "m_s[g] = mg")
    emit(3, "l_s[g] = acc")
    emit(1, "cuda.syncthreads()")


def _emit_merge(emit, G: int, D: int, NT: int, NW: int, PART: int, dyn: bool = False) -> None:
    """The last partition block of a (sequence, head group) to finish merges the group's
    partitions (at most MERGE_MAX_PARTITIONS), saving the merge kernel's launch.

    Each block publishes its partials (fence, then a counter ticket); the block that takes the
    last ticket resets the counter for the next launch and reads the others' partials. Those
    reads may hit this SM's L1, which is not coherent with other SMs: they are safe because no
    block reads a group's partials before they are complete, and every group's partials sit on
    cache lines of their own (the launcher pads the partition axis to MERGE_MAX_PARTITIONS
    floats = 128 bytes), so no earlier merge on this SM can have cached a line of them."""
    emit(1, "cuda.threadfence()")
    emit(1, "cuda.syncthreads()")
    emit(1, "flag = cuda.shared.array(1, int32)")
    if not dyn:  # dynamic partitions computed n_done at the top
        emit(1, f"n_done = (seq_len + {PART - 1}) // {PART}")
    emit(1, "cidx = b * cuda.gridDim.y + y")
    emit(1, "if tid == 0:")
    emit(2, "ticket = cuda.atomic.add(counters, cidx, 1)")
    emit(2, "flag[0] = 0")
    emit(2, "if ticket == n_done - 1:")
    emit(3, "flag[0] = 1")
    emit(3, "counters[cidx] = 0")
    emit(1, "cuda.syncthreads()")
    emit(1, "if flag[0] == 0:")
    emit(2, "return")
    emit(1, "cuda.threadfence()")
    # Each thread owns E outputs and reads MERGE_CHUNK partitions of all of them before the first
    # multiply: E x MERGE_CHUNK independent loads in flight, so the tail costs ~n_done / 8 L2
    # round trips instead of one per partition (a `for p` loop waits on each load in turn). The
    # first chunk's loads are issued before the weights' max/sum loads, so both round trips
    # overlap (every context of up to MERGE_CHUNK partitions merges in one).
    E = -(-G * D // NT)
    for e in range(E):
        emit(1, f"i{e} = tid + {e * NT}")
        emit(1, f"ok{e} = i{e} < {G * D}")
        emit(1, f"g{e} = min(i{e}, {G * D - 1}) // {D}")
        emit(1, f"d{e} = i{e} % {D}")
        emit(1, f"acc{e} = float32(0.0)")

    def load_chunk(indent: int, p0: str) -> None:
        for e in range(E):
            for j in range(MERGE_CHUNK):
                # Partitions past n_done hold stale words (maybe NaN): not loaded, never times 0.
                emit(indent, f"x{e}_{j} = float32(0.0)")
                emit(indent, f"if {p0} + {j} < n_done:")
                emit(indent + 1, f"x{e}_{j} = tmp_out[b, h0 + g{e}, {p0} + {j}, d{e}]")

    load_chunk(1, "0")
    # Per head (one warp each, lane = partition): global max, then weight = exp(m_p - m) / sum.
    emit(1, f"w_s = cuda.shared.array(({G}, {MERGE_MAX_PARTITIONS}), float32)")
    emit(1, f"for g in range(warp, {G}, {NW}):")
    emit(2, "ml = float32(-math.inf)")
    emit(2, "es = float32(0.0)")
    emit(2, "if lane < n_done:")
    emit(3, "ml = max_logits[b, h0 + g, lane]")
    emit(3, "es = exp_sums[b, h0 + g, lane]")
    emit(2, "m = ml")
    for k in range(5):
        emit(2, f"m = max(m, shfl_xor(m, {16 >> k}))")
    emit(2, "e = float32(0.0)")
    emit(2, "if lane < n_done:")
    emit(3, "e = math.exp(ml - m)")
    emit(2, "tot = es * e")
    for k in range(5):
        emit(2, f"tot += shfl_xor(tot, {16 >> k})")
    # Every partition that ran holds >= 1 token, so its sum is >= 1 and tot > 0.
    emit(2, "w_s[g, lane] = e / tot")
    emit(1, "cuda.syncthreads()")
    emit(1, f"for p0 in range(0, n_done, {MERGE_CHUNK}):")
    emit(2, "if p0 > 0:")
    load_chunk(3, "p0")
    for e in range(E):
        for j in range(MERGE_CHUNK):
            # w_s is 0 past n_done; p0 + j < MERGE_MAX_PARTITIONS (a multiple of MERGE_CHUNK).
            emit(2, f"acc{e} += x{e}_{j} * w_s[g{e}, p0 + {j}]")
    for e in range(E):
        emit(1, f"if ok{e}:")
        emit(2, f"out[b, h0 + g{e}, d{e}] = acc{e}")


def dynamic_partitions(cfg: DecodeConfig, mode: str) -> bool:
    """Whether the kernel spreads each sequence's own context over the grid's partitions at run
    time: the online core with the in-kernel merge (small, latency-bound grids), and split mode
    where the launcher asks (DecodeConfig.spread: bounds past MERGE_MAX_PARTITIONS partitions,
    where at batch 1 and 4K tokens under a 131,200-token bound 4 of 129 partitions of 1024
    tokens ran, each warp walking 16 KV blocks one round trip after another: ~37 us a layer of
    a 4.27 ms AWQ step on an H100, BENCHMARKS.md §17). The grid's
    partition count is fixed by the bound (a graph's max_model_len, 8K for Llama-3), so static
    PART-token partitions leave a short context few of them: at batch 1 and 540 tokens under an
    8K bound, 3 of 32 partitions of 256 tokens ran, each warp walking 4 KV blocks one memory
    round trip after another (13.4 us a layer, Llama-3-8B shape, H200). Spread, partition p
    takes KV blocks [p * pb, (p + 1) * pb) with pb = max(ceil(blocks / partitions), warps):
    every warp one KV block up to partitions x warps blocks (2048 tokens at 32 x 4), never more
    than PART / 16 blocks (pb <= ceil(bound / 16 / partitions)). A context that fills the bound
    gets the static split (pb = PART / 16)."""
    return (cfg.online and mode == "merge") or (cfg.spread and mode == "split")


def spread_min_blocks(cfg: DecodeConfig) -> int:
    """The fewest KV blocks a spread partition takes: one a warp, at most a whole partition."""
    return min(cfg.num_threads // 32, cfg.partition // BLOCK_SIZE)


def spread_split(seq_len, grid_partitions, min_blocks):
    """(KV blocks a partition takes, partitions that run) of a spread sequence of seq_len
    tokens: its blocks over the grid's partitions, at least min_blocks each. The one rule of
    the partition kernel, the merge and the host (spread_partitions)."""
    n_kvb = (seq_len + BLOCK_SIZE - 1) // BLOCK_SIZE
    pb = max((n_kvb + grid_partitions - 1) // grid_partitions, min_blocks)
    return pb, (n_kvb + pb - 1) // pb


_spread_split = cuda.jit(device=True, inline="always")(spread_split)


@functools.lru_cache(maxsize=256)
def _spread_config(cfg: DecodeConfig) -> DecodeConfig:
    """cfg with spread on, one object per config (an eager launch asks on every call)."""
    return dataclasses.replace(cfg, spread=True)


def spread_partitions(seq_len: int, grid_partitions: int, min_blocks: int) -> int:
    """Partitions a spread sequence of seq_len tokens runs (the kernel's n_done)."""
    return spread_split(seq_len, grid_partitions, min_blocks)[1]


# direct: one partition covers the context: normalise and write `out`.
# split: write the partials (max, sum, unnormalised out); decode_reduce_kernel merges them.
# merge: write the partials; the group's last block to finish merges them (<= 32 partitions).
MODES = ("direct", "split", "merge")
MERGE_MAX_PARTITIONS = 32  # one warp lane per partition in the in-kernel merge
MERGE_CHUNK = 8  # partitions whose partial outputs the merge loads before using any
assert MERGE_MAX_PARTITIONS % MERGE_CHUNK == 0
MAX_REGISTERS = 128  # split/merge kernels: 4 blocks of 128 threads per SM (64K registers)


@cached_factory
@functools.cache
def decode_kernel(cfg: DecodeConfig, mode: str, max_registers: int | None = -1):
    """The partition kernel for one shape and mode (see MODES). max_registers: -1 = the default
    below, None = no cap, or a cap (load_tests/bench_attention.py --sweep compares them)."""
    src = _kernel_source(cfg, mode)
    namespace = dict(
        cuda=cuda,
        math=math,
        float32=float32,
        int32=int32,
        int64=int64,
        uint32=uint32,
        ld_u32x4=ld_u32x4,
        half_lo=half_lo,
        half_hi=half_hi,
        shfl_xor=shfl_xor,
        spread_split=_spread_split,
    )
    core = " online" if cfg.online else ""
    core += " prefetch" if cfg.prefetch else ""
    core += " spread" if cfg.spread and mode == "split" else ""
    kv = "" if cfg.kv == kv_widen.FP16 else f" {cfg.kv}"
    name = f"<decode_attention d{cfg.head_dim} g{cfg.group} p{cfg.partition} {mode}{core}{kv}>"
    exec(compile(src, name, "exec"), namespace)
    # Large batches are bandwidth-bound on bytes in flight: capping registers at 128 (from
    # ~142, a few bytes of spill outside the loops) fits 4 blocks of 128 threads per SM instead
    # of 3, a third more loads in flight. Direct mode (short contexts, small grids) is left free.
    # The online core holds K and V in flight together and runs on small grids: left free too.
    if max_registers == -1:
        max_registers = MAX_REGISTERS if mode != "direct" and not cfg.online else None
    opts = {"max_registers": max_registers} if max_registers is not None and not SIM else {}
    label = f"decode_attention_{mode}{core.replace(' ', '_')}_d{cfg.head_dim}_g{cfg.group}"
    label += f"x{cfg.split}_p{cfg.partition}{kv.replace(' ', '_')}"
    return cuda.jit(fastmath=False, **opts)(named_kernel(namespace["kernel"], __name__, label))


REDUCE_THREADS = 128  # also the largest block size decode_reduce_kernel may be launched with


@cached
@cuda.jit
def decode_reduce_kernel(
    out, max_logits, exp_sums, tmp_out, seq_lens, partition, grid_partitions, min_blocks
):
    """Merge the partitions of one (sequence, head): grid (H, B), a power-of-two block size up to
    REDUCE_THREADS. The per-partition weights exp(max_p - max) / sum are computed once into
    shared memory, a chunk of blockDim partitions at a time, so the loop over partitions is only
    coalesced loads of tmp_out and FMAs (four independent sums keep several loads in flight).
    min_blocks > 0: the partition kernel spread the context (spread_partitions, its formula);
    0: static partitions of `partition` tokens."""
    h = cuda.blockIdx.x
    b = cuda.blockIdx.y
    tid = cuda.threadIdx.x
    nt = cuda.blockDim.x
    if min_blocks > 0:
        n_part = _spread_split(seq_lens[b], grid_partitions, min_blocks)[1]
    else:
        n_part = (seq_lens[b] + partition - 1) // partition
    red = cuda.shared.array(REDUCE_THREADS, float32)
    w = cuda.shared.array(REDUCE_THREADS, float32)

    m = float32(-math.inf)
    for p in range(tid, n_part, nt):
        m = max(m, max_logits[b, h, p])
    red[tid] = m
    cuda.syncthreads()
    s = nt // 2
    while s > 0:
        if tid < s:
            red[tid] = max(red[tid], red[tid + s])
        cuda.syncthreads()
        s //= 2
    m = red[0]
    cuda.syncthreads()
    total = float32(0.0)
    for p in range(tid, n_part, nt):
        total += exp_sums[b, h, p] * math.exp(max_logits[b, h, p] - m)
    red[tid] = total
    cuda.syncthreads()
    s = nt // 2
    while s > 0:
        if tid < s:
            red[tid] += red[tid + s]
        cuda.syncthreads()
        s //= 2
    total = red[0]
    inv = float32(0.0)
    if total > 0.0:
        inv = float32(1.0) / total

    D = out.shape[2]
    for d0 in range(0, D, nt):  # every thread runs the same rounds: barriers inside
        d = d0 + tid
        a0 = float32(0.0)
        a1 = float32(0.0)
        a2 = float32(0.0)
        a3 = float32(0.0)
        for p0 in range(0, n_part, nt):
            cuda.syncthreads()
            if p0 + tid < n_part:
                w[tid] = math.exp(max_logits[b, h, p0 + tid] - m) * inv
            cuda.syncthreads()
            n = min(nt, n_part - p0)
            if d < D:
                p = 0
                while p + 4 <= n:
                    a0 += tmp_out[b, h, p0 + p, d] * w[p]
                    a1 += tmp_out[b, h, p0 + p + 1, d] * w[p + 1]
                    a2 += tmp_out[b, h, p0 + p + 2, d] * w[p + 2]
                    a3 += tmp_out[b, h, p0 + p + 3, d] * w[p + 3]
                    p += 4
                while p < n:
                    a0 += tmp_out[b, h, p0 + p, d] * w[p]
                    p += 1
        if d < D:
            out[b, h, d] = (a0 + a1) + (a2 + a3)


def num_partitions(max_seq_len: int, partition: int) -> int:
    return max(1, (max_seq_len + partition - 1) // partition)


PARTITION_CHOICES = (1024, 512, 256, 128, 64)  # largest first
BLOCKS_PER_SM = 4  # thread blocks wanted per SM before partitions get shorter
# ... except for the longest partition, which one wave of the uncapped direct kernel (3 blocks
# per SM) is enough for: at batch 64, 1K contexts, Llama-3-8B shape on an H200, 512 blocks of
# 1024 tokens took 78.8 us where 1024 blocks of 512 took 98.2 (batch 256: 290 vs 348 us).
LONGEST_BLOCKS_PER_SM = 3
# A grid that one block per (sequence, head group) already fills takes one partition of the whole
# bound (direct mode: no partials, no merge), or the longest one the scores' shared memory holds:
# a 1024-token partition under a 1056 bound left a 32-token tail partition per sequence and took
# 126 us at batch 64 against 81 us for one 1056-token partition (and 144 vs 163 us at 2048
# contexts with 2048 vs 1024-token partitions; H200, Llama-3-8B shape). A server's bound (its
# max_model_len, 8K for Llama-3) is far above most contexts: partitions past a context exit at
# once, so 2048-token partitions give short contexts one working block each. The block core
# keeps group x partition fp32 scores in shared memory: 32 KB of them leaves room under the
# 48 KB static limit of sm_70.
DIRECT_SCORES_BYTES = 32 * 1024
# Grids up to this many blocks per SM run the online core: one wave at its register count
# (~170 per thread uncapped, so 2-3 blocks of 128 threads per SM), latency-bound.
ONLINE_MAX_BLOCKS_PER_SM = 2
# Its q and PV accumulators take 2 x group x 8 registers per lane: on sm_70 ptxas fits 7 heads
# of 128 dims in 255 registers without spilling, 8 spill (244 B): those stay on the block core.
ONLINE_MAX_GROUP_DIMS = 7 * 128
# One-byte storage: lanes hold 16 values of q and of the PV sums per head (2 x 16 x group
# registers) and half the in-flight load words of fp16; with at most 4 heads a block
# (max_heads_per_block) that is 4 heads of 64 or 128 dims and 3 of 256.
ONLINE_MAX_GROUP_DIMS_ONE_BYTE = 3 * 256


def online_max_group_dims(kv: str) -> int:
    """The widest head group (heads x head_dim) the online core takes for this storage."""
    return ONLINE_MAX_GROUP_DIMS_ONE_BYTE if kv in kv_widen.ONE_BYTE else ONLINE_MAX_GROUP_DIMS


def spreads(batch: int, kv_blocks: int, num_sms: int) -> bool:
    """Whether a split-mode launch spreads contexts over its partitions (DecodeConfig.spread):
    where one partition per (sequence, head group) is less than a wave (choose_partition's test
    for short partitions), a context shorter than the bound would leave SMs idle. Larger batches
    keep the static split: spreading their many blocks only adds partial writes."""
    return batch * kv_blocks < LONGEST_BLOCKS_PER_SM * num_sms


def direct_partition_limit(group: int) -> int:
    """The longest single partition the block core takes for `group` query heads per block."""
    return DIRECT_SCORES_BYTES // (4 * group) // BLOCK_SIZE * BLOCK_SIZE


def choose_partition(
    batch: int,
    kv_blocks: int,
    max_seq_len: int,
    num_sms: int,
    max_partitions: int | None = None,
    group: int = MAX_HEADS_PER_BLOCK,
) -> int:
    """Context tokens per thread block (kv_blocks = thread blocks per sequence and partition;
    group = query heads per block). When batch x kv_blocks blocks fill one wave, one partition
    of the whole bound (rounded up to a KV block), or the longest whose scores fit shared memory;
    otherwise the longest of PARTITION_CHOICES that still gives BLOCKS_PER_SM thread blocks per
    SM. Short partitions only where the grid would otherwise leave SMs idle (small batches): each
    costs a partial write and a merge read. Depends only on bounds fixed at capture, so a CUDA
    graph's grid stays valid. max_partitions: a caller's workspace bound; longer partitions are
    taken to fit it."""
    whole = -(-max_seq_len // BLOCK_SIZE) * BLOCK_SIZE
    if batch * kv_blocks >= LONGEST_BLOCKS_PER_SM * num_sms:
        p = min(whole, direct_partition_limit(group))
        if max_partitions is None or num_partitions(max_seq_len, p) <= max_partitions:
            return p
    fits = [
        p
        for p in PARTITION_CHOICES
        if max_partitions is None or num_partitions(max_seq_len, p) <= max_partitions
    ] or [PARTITION_CHOICES[0]]
    for p in fits:
        per_sm = LONGEST_BLOCKS_PER_SM if p == PARTITION_CHOICES[0] else BLOCKS_PER_SM
        if batch * kv_blocks * num_partitions(max_seq_len, p) >= per_sm * num_sms:
            return p
    return fits[-1]


def default_partition(
    H: int,
    kvh: int,
    D: int,
    B: int,
    max_seq_len: int,
    num_sms: int,
    max_partitions: int | None = None,
    num_threads: int = 128,
    max_group: int = MAX_HEADS_PER_BLOCK,
    kv: str = kv_widen.FP16,
) -> int:
    """The partition the launcher takes for this shape, batch and bound (choose_partition with
    the head grouping decode_config gives)."""
    group = decode_config(H, kvh, D, None, num_threads, max_group=max_group, kv=kv).group
    split = H // kvh // group
    return choose_partition(B, kvh * split, max_seq_len, num_sms, max_partitions, group)


def launch_config(
    H: int,
    kvh: int,
    D: int,
    B: int,
    max_seq_len: int,
    num_sms: int,
    max_partitions: int | None = None,
    num_threads: int = 128,
    partition_size: int | None = None,
    online: bool | None = None,
    kv: str = kv_widen.FP16,
    prefetch: bool = False,
) -> tuple[DecodeConfig, int]:
    """(config, partitions) of a launch: the partition from default_partition unless given,
    the online core for latency-bound grids unless `online` says (see _narrow_online for head
    groups too wide for it), software-pipelined where `prefetch` asks and the online core runs
    (DecodeConfig.prefetch). Depends only on bounds fixed at capture.

    Under a long bound (a server's max_model_len: 8K for Llama-3) the uncapped choice is many
    short partitions: at batch 1 the Llama-3-8B shape took 128 partitions of 64 tokens, too many
    blocks for the online core, so the block core ran plus the merge kernel's launch: 18.4 /
    21.7 us a layer at 544 / 1056-token contexts under an 8x bound, against 12.5 / 15.4 us for
    the online core with its in-kernel merge under the exact bound (H200, 9433669). So where
    capping the grid at MERGE_MAX_PARTITIONS gives the online core a grid (latency-bound), the
    cap is taken, and the online core spreads each sequence's own KV blocks over those
    partitions at run time (dynamic_partitions), at most one block per SM: in a served step
    under an 8K bound, 32 partitions (256 blocks, 2 per SM at the online core's ~240 registers)
    took 21.1 us a layer against 12.4 us for 17 (136 blocks) in bench_attention at the same
    contexts (H200, BENCHMARKS.md §6). Bounds whose uncapped grid already runs the online core with the
    in-kernel merge keep it."""
    auto = partition_size is None and max_partitions is None and online is None
    part = partition_size
    if part is None:
        part = default_partition(
            H, kvh, D, B, max_seq_len, num_sms, max_partitions, num_threads, kv=kv
        )
    cfg = decode_config(H, kvh, D, part, num_threads, kv=kv)
    n_part = num_partitions(max_seq_len, cfg.partition)
    if online is None:
        wide = cfg.group * D > online_max_group_dims(kv)
        online = latency_bound(B * kvh * cfg.split * n_part, num_sms) and not wide
        if not online and wide:
            cfg, n_part, online = _narrow_online(
                H, kvh, D, B, max_seq_len, num_sms, max_partitions, num_threads,
                partition_size, cfg, n_part, kv,
            )  # fmt: skip
    if auto and (not online or n_part > MERGE_MAX_PARTITIONS):
        capped = _capped_online(H, kvh, D, B, max_seq_len, num_sms, num_threads, kv, prefetch)
        if capped is not None:
            return capped
    return dataclasses.replace(cfg, online=online, prefetch=prefetch and online), n_part


def _capped_online(
    H, kvh, D, B, max_seq_len, num_sms, num_threads, kv=kv_widen.FP16, prefetch=False
):
    """The online core's launch for a grid that, uncapped, is too large for it: the partitions
    capped at MERGE_MAX_PARTITIONS (the in-kernel merge), and further to at most one block per
    SM; None where even that is not an online grid of more than one partition."""
    capped = launch_config(
        H, kvh, D, B, max_seq_len, num_sms, MERGE_MAX_PARTITIONS, num_threads, None, None, kv,
        prefetch,
    )  # fmt: skip
    per_part = B * kvh * capped[0].split
    if capped[0].online and per_part * capped[1] > num_sms:
        capped = launch_config(
            H, kvh, D, B, max_seq_len, num_sms, max(2, num_sms // per_part), num_threads, None,
            None, kv, prefetch,
        )  # fmt: skip
    return capped if capped[0].online and capped[1] > 1 else None


# Threads per block of the online core where its partitions are long enough to give each of
# 8 warps a KV block (partitions of >= 128 tokens: a server's bound at batch 1). One layer at
# batch 1 under an 8K bound on an H200 (BENCHMARKS.md §6), 256 against 128 threads: Llama-3-8B shape 10.5 / 11.1 / 12.0 / 12.4 / 15.3 us against 10.7 / 12.6 / 14.6
# / 14.7 / 18.1 at 140 / 544 / 1056 / 2048 / 4096 tokens; Qwen2.5-0.5B 10.4 / 10.8 / 11.6 /
# 11.8 / 12.9 against 11.3 / 12.9 / 13.5 / 13.7 / 15.1. Twice the warps of a partition each
# walk one KV block where the 4 walked two one after another (1056 tokens: 66 blocks over 16
# partitions).
ONLINE_THREADS = 256


def online_threads(cfg: DecodeConfig) -> int:
    """ONLINE_THREADS for an online-core launch whose partitions hold at least one KV block per
    warp of ONLINE_THREADS (the dynamic spread gives each warp one block up to partitions x
    warps blocks), else the config's own count. At ~250 registers a thread, 256 threads is one
    block per SM, as the capped online grid already is."""
    if cfg.online and cfg.partition >= BLOCK_SIZE * ONLINE_THREADS // 32:
        return ONLINE_THREADS
    return cfg.num_threads


@functools.lru_cache(maxsize=1024)
def launch_with_threads(
    H,
    kvh,
    D,
    B,
    max_seq_len,
    num_sms,
    cap,
    num_threads,
    partition_size,
    online,
    kv=kv_widen.FP16,
    prefetch=False,
) -> tuple[DecodeConfig, int]:
    """launch_config at num_threads, or, when None, at 128 unless the online core's launch at
    ONLINE_THREADS (online_threads) stays online and one wave (one block per SM at ~250
    registers a thread: a grid of more blocks than SMs would run in two). Cached: an eager
    decode step asks again for the same shapes and bounds."""
    nt = num_threads or 128
    cfg, n_part = launch_config(
        H, kvh, D, B, max_seq_len, num_sms, cap, nt, partition_size, online, kv, prefetch
    )
    if num_threads is None and online_threads(cfg) != nt:
        wide = launch_config(
            H, kvh, D, B, max_seq_len, num_sms, cap, ONLINE_THREADS, partition_size, online, kv,
            prefetch,
        )  # fmt: skip
        if wide[0].online and B * kvh * wide[0].split * wide[1] <= num_sms:
            return wide
    return cfg, n_part


def latency_bound(blocks: int, num_sms: int) -> bool:
    """A grid this small runs one latency-bound wave: the online core's case."""
    return blocks <= ONLINE_MAX_BLOCKS_PER_SM * num_sms


def _narrow_online(
    H, kvh, D, B, max_seq_len, sms, cap, num_threads, fixed_partition, cfg, n_part, kv
):
    """(cfg, partitions, online) for a small grid whose head group is too wide for the online
    core's registers (8 query heads of 128 dims per KV head: Qwen3-30B-A3B, Llama-3-70B): the
    group is split over more blocks that the online core takes, each reading its KV head again.
    At these grid sizes the step is a chain of dependent loads, not a byte stream: on an H200
    the block core took 45 us a layer for one Qwen3-30B-A3B sequence of ~150 tokens, the online
    core ~13 us for a Llama-3-8B one of ~560. Falls back to (cfg, n_part, False) when the
    narrower grid would not be latency-bound."""
    limit = online_max_group_dims(kv)
    g = max(1, limit // D)
    part = fixed_partition
    if part is None:
        part = default_partition(H, kvh, D, B, max_seq_len, sms, cap, num_threads, g, kv)
    narrow = decode_config(H, kvh, D, part, num_threads, max_group=g, kv=kv)
    n = num_partitions(max_seq_len, narrow.partition)
    if narrow.group * D <= limit and latency_bound(B * kvh * narrow.split * n, sms):
        return narrow, n, True
    return cfg, n_part, False


# The partitions a workspace allocated by the launcher holds, per mode: the in-kernel merge
# needs the partition axis padded to MERGE_MAX_PARTITIONS (see _emit_merge).
_WS_PARTITIONS = {
    "direct": lambda n: 1,
    "split": lambda n: n,
    "merge": lambda n: MERGE_MAX_PARTITIONS,
}


def _mode(n_part: int, merge_ok: bool) -> str:
    """direct (one partition), merge (in-kernel, up to MERGE_MAX_PARTITIONS partitions, when the
    workspace is padded for it) or split (the separate merge kernel)."""
    if n_part == 1:
        return "direct"
    return "merge" if n_part <= MERGE_MAX_PARTITIONS and merge_ok else "split"


def workspace_bytes(
    B: int, H: int, kvh: int, D: int, max_seq_len: int, sms: int, kv: str = kv_widen.FP16
) -> int:
    """The fp32 workspace a default launch allocates for a batch of B under max_seq_len (what
    a decode CUDA graph of B rows holds in its pool per attention call)."""
    _, n_part = launch_with_threads(H, kvh, D, B, max_seq_len, sms, None, None, None, None, kv)
    p = _WS_PARTITIONS[_mode(n_part, True)](n_part)
    return B * H * p * (D + 2) * 4


def decode_workspace(B: int, H: int, partitions: int, D: int, device):
    """(max_logits [B, H, P], exp_sums [B, H, P], tmp_out [B, H, P, D]) fp32 for P partitions
    (P = MERGE_MAX_PARTITIONS selects the in-kernel merge, see paged_decode_attention_cuda)."""
    import torch

    return (
        torch.empty((B, H, partitions), dtype=torch.float32, device=device),
        torch.empty((B, H, partitions), dtype=torch.float32, device=device),
        torch.empty((B, H, partitions, D), dtype=torch.float32, device=device),
    )


def paged_decode_attention_cuda(
    q,  # [B, H, D] fp16
    k_cache,  # [num_blocks, num_kv_heads, 16, D] fp16
    v_cache,
    block_tables,  # [B, W] int32
    seq_lens,  # [B] int32
    scale: float,
    out=None,
    *,
    max_seq_len: int | None = None,
    partition_size: int | None = None,
    workspace=None,
    num_threads: int | None = None,
    max_registers: int | None = -1,
    online: bool | None = None,
    prefetch: bool = False,
):
    """Decode attention on torch's current stream; returns out [B, H, D].

    max_seq_len: an upper bound on every seq_len; it fixes the grid, so a CUDA graph captured
    with it replays correctly for any seq_lens up to it. Default: block_tables width x 16.
    partition_size: context tokens per thread block; default from choose_partition (the batch,
    the bound and the SM count, so fixed per captured graph).
    workspace: optional (max_logits [B, H, P], exp_sums [B, H, P], tmp_out [B, H, P, D]) fp32
    with P >= the partition count; allocated from torch's allocator when absent (inside a graph
    capture that memory belongs to the graph's pool). A workspace with P != MERGE_MAX_PARTITIONS
    selects the separate merge kernel ("split" mode) instead of the in-kernel merge.
    num_threads: threads per block; default 128, or ONLINE_THREADS for the online core under
    long partitions (`online_threads`).
    max_registers: see decode_kernel (a benchmarking knob; the default is what decode runs).
    online: the per-warp online-softmax core (see _emit_online_core); default: for grids of at
    most ONLINE_MAX_BLOCKS_PER_SM blocks per SM (latency-bound: small batches and contexts).
    prefetch: software-pipeline the online core (DecodeConfig.prefetch) where it runs; the
    block core ignores it (a benchmarking knob until timed)."""
    check_paged_cache(q, k_cache, v_cache, BLOCK_SIZE, block_tables=block_tables, seq_lens=seq_lens)
    return launch_decode(
        q, k_cache, v_cache, block_tables, seq_lens, scale, out, max_seq_len, partition_size,
        workspace, num_threads, max_registers, online, prefetch=prefetch,
    )  # fmt: skip


def launch_decode(
    q,
    k_cache,
    v_cache,
    block_tables,
    seq_lens,
    scale: float,
    out,
    max_seq_len: int | None,
    partition_size: int | None,
    workspace,
    num_threads: int | None,
    max_registers: int | None,
    online: bool | None,
    kv: str = kv_widen.FP16,
    v_scale: float = 1.0,
    prefetch: bool = False,
):
    """The launches of paged_decode_attention_cuda (its arguments, checked by its caller) for a
    cache stored as `kv`: `scale` multiplies q (for one-byte storage the launcher folds K's
    factors into it), `v_scale` the PV sums (one-byte storage only, see kv_widen)."""
    import torch

    B, H, D = q.shape
    kvh = k_cache.shape[1]
    if max_seq_len is None:
        max_seq_len = block_tables.shape[1] * BLOCK_SIZE
    cap = None if workspace is None else workspace[2].shape[2]
    sms = sm_count(q.device)
    cfg, n_part = launch_with_threads(
        H, kvh, D, B, max_seq_len, sms, cap, num_threads, partition_size, online, kv, prefetch
    )
    mode = _mode(n_part, workspace is None or workspace[2].shape[2] == MERGE_MAX_PARTITIONS)
    if mode == "split" and spreads(B, kvh * cfg.split, sms):
        cfg = _spread_config(cfg)
    q = q.contiguous()
    block_tables = block_tables.contiguous()
    if out is None:
        out = torch.empty_like(q)
    if workspace is None:
        workspace = decode_workspace(B, H, _WS_PARTITIONS[mode](n_part), D, q.device)
    elif mode != "direct" and workspace[2].shape[2] < n_part:
        raise ValueError(f"workspace holds {workspace[2].shape[2]} partitions, need {n_part}")
    if B == 0:
        return out
    stream = current_stream()
    ml, es, tmp = workspace
    grid = (n_part, kvh * cfg.split, B)
    # Only the merge mode reads the counters; the others get any int32 array of the right type.
    counters = _COUNTERS.get(q.device, grid[1] * B) if mode == "merge" else seq_lens
    args = (
        out,
        q,
        k_cache.view(-1),
        v_cache.view(-1),
        block_tables,
        seq_lens,
        float(scale),
        kvh,
        ml,
        es,
        tmp,
        counters,
    )
    if kv in kv_widen.ONE_BYTE:
        args += (float(v_scale),)
    launch(decode_kernel(cfg, mode, max_registers), grid, cfg.num_threads, args, stream)
    if mode == "split":
        min_blocks = spread_min_blocks(cfg) if cfg.spread else 0
        args = (out, ml, es, tmp, seq_lens, cfg.partition, n_part, min_blocks)
        launch(decode_reduce_kernel, (H, B), REDUCE_THREADS, args, stream)
    return out


class MergeCounters:
    """Per device, one int32 array of arrival counters for the in-kernel merge, zero between
    launches (the merging block resets its own counter). One array serves every launch on a
    device because launches on one stream run one after another; the executor runs all its
    kernels on one stream. Grown only outside CUDA-graph capture (a capture must not allocate
    and zero new memory that outlives it): the runner's eager warm-up step sizes it first."""

    def __init__(self) -> None:
        self._arrays: dict = {}

    def get(self, device, n: int):
        import torch

        arr = self._arrays.get(device)
        if arr is None or arr.numel() < n:
            if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
                raise RuntimeError(
                    "decode attention: merge counters must be allocated before CUDA-graph "
                    "capture; run the same batch size once eagerly first"
                )
            arr = torch.zeros(max(n, 4096), dtype=torch.int32, device=device)
            self._arrays[device] = arr
        return arr


_COUNTERS = MergeCounters()


# Representative instances that `voltserve check-kernels` compiles (see kernels/registry.py),
# few because each is a long compile: Llama-3-8B (128 dims, 4 heads per KV head) in the split,
# single-partition and in-kernel-merge forms of the block core and the online core; MHA with
# 256 dims on the online core (direct). Other shapes are the same generated code with other
# constants.
decode_kernel_d128_g4 = decode_kernel(decode_config(32, 8, 128), "split")
decode_kernel_d128_g4_direct = decode_kernel(decode_config(32, 8, 128), "direct")
decode_kernel_d128_g4_spread = decode_kernel(
    dataclasses.replace(decode_config(32, 8, 128, 1024), spread=True), "split"
)
decode_kernel_d128_g4_merge = decode_kernel(decode_config(32, 8, 128, 64), "merge")
decode_kernel_d128_g4_online = decode_kernel(decode_config(32, 8, 128, 64, online=True), "merge")
decode_kernel_d256_g1_online = decode_kernel(decode_config(8, 8, 256, 512, online=True), "direct")
