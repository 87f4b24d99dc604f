"""Decode and prefill attention kernels against the torch reference, in numba's CUDA simulator.

The simulator runs every thread as a Python thread, so shapes are tiny and blocks are one warp
(32 threads; the simulated warp shuffle in attention_common needs that). Partitions are 32 tokens
so contexts of a few dozen tokens cross KV-block (16) and partition boundaries and exercise the
split/merge path. Kernels are called raw with numpy arrays (the simulator cannot take torch
tensors as device arrays); outputs are poisoned with NaN before each launch.
On a CUDA host the same tests run the compiled kernels.
"""

from __future__ import annotations

import dataclasses
import os
import threading

import numpy as np
import pytest
import torch

if not torch.cuda.is_available():  # the root conftest does this too; keep the file standalone
    os.environ.setdefault("NUMBA_ENABLE_CUDASIM", "1")

from voltserve.kernels.attention import decode  # noqa: E402
from voltserve.kernels.attention.decode import (  # noqa: E402
    BLOCK_SIZE,
    MERGE_MAX_PARTITIONS,
    decode_config,
    decode_kernel,
    decode_reduce_kernel,
    num_partitions,
    spread_min_blocks,
    spread_partitions,
)
from voltserve.kernels.attention.prefill import prefill_config, prefill_kernel  # noqa: E402
from voltserve.kernels.attention.ref import paged_attention_ref  # noqa: E402
from voltserve.kernels.runtime.launch_geometry import kernel_name  # noqa: E402
from voltserve.kernels.runtime.numba_common import SIM  # noqa: E402

THREADS = 32
PARTITION = 32


def make_cache(rng, seq_lens, num_kv_heads, head_dim, extra_blocks=3):
    """Random fp16 caches with shuffled block tables; unused slots hold NaN so a kernel that
    reads past a sequence's end (or trusts a 0 weight on stale data) fails."""
    n_blocks = [(s + BLOCK_SIZE - 1) // BLOCK_SIZE for s in seq_lens]
    total = sum(n_blocks) + extra_blocks
    shape = (total, num_kv_heads, BLOCK_SIZE, head_dim)
    k = rng.standard_normal(shape).astype(np.float16)
    v = rng.standard_normal(shape).astype(np.float16)
    perm = rng.permutation(total).astype(np.int32)
    width = max(max(n_blocks), 1) + 1
    tables = np.full((len(seq_lens), width), -1, dtype=np.int32)
    pos = 0
    for b, n in enumerate(n_blocks):
        tables[b, :n] = perm[pos : pos + n]
        pos += n
        tail = seq_lens[b] % BLOCK_SIZE
        if tail:  # poison the unwritten slots of the last block
            k[tables[b, n - 1], :, tail:] = np.nan
            v[tables[b, n - 1], :, tail:] = np.nan
    return k, v, tables


def run_decode(
    q,
    k,
    v,
    tables,
    seq_lens,
    scale,
    max_seq_len,
    merge=False,
    counters=None,
    online=False,
    workspace=None,
    max_group=8,
    spread=False,
    prefetch=False,
    threads=THREADS,
    partition=PARTITION,
):
    """merge=True: the in-kernel merge (partials padded to MERGE_MAX_PARTITIONS, arrival
    counters that must be zero before and are zero again after the launch). online: the
    per-warp online-softmax core instead of the block-wide phases. max_group: query heads per
    block (a KV head's heads split over blocks below its group). spread: split mode spreads each
    context over the grid's partitions (DecodeConfig.spread). prefetch: the online core
    software-pipelined (DecodeConfig.prefetch). threads: more than one warp needs
    `warp_shuffles` in the simulator."""
    B, H, D = q.shape
    cfg = decode_config(
        H, k.shape[1], D, partition, threads, online=online, max_group=max_group, prefetch=prefetch
    )
    cfg = dataclasses.replace(cfg, spread=spread)
    n_part = num_partitions(max_seq_len, cfg.partition)
    mode = "direct" if n_part == 1 else ("merge" if merge else "split")
    p_ws = MERGE_MAX_PARTITIONS if mode == "merge" else n_part
    out = np.full_like(q, np.nan)
    ml = np.full((B, H, p_ws), np.nan, np.float32)
    es = np.full((B, H, p_ws), np.nan, np.float32)
    tmp = np.full((B, H, p_ws, D), np.nan, np.float32)
    if workspace is not None:  # the caller inspects the partials after the launch
        workspace.update(max_logits=ml, exp_sums=es, tmp_out=tmp)
    sl = np.asarray(seq_lens, np.int32)
    n_y = k.shape[1] * cfg.split
    grid = (n_part, n_y, B)
    if counters is None:
        counters = np.zeros(n_y * B, np.int32)
    decode_kernel(cfg, mode)[grid, threads](
        out,
        q,
        k.reshape(-1),
        v.reshape(-1),
        tables,
        sl,
        scale,
        k.shape[1],
        ml,
        es,
        tmp,
        counters,
    )
    if mode == "split":
        min_blocks = spread_min_blocks(cfg) if spread else 0
        decode_reduce_kernel[(H, B), THREADS](
            out, ml, es, tmp, sl, cfg.partition, n_part, min_blocks
        )
    return out


def reference(q, k, v, tables, seq_lens, qsl, scale):
    kt, vt = torch.from_numpy(k).float(), torch.from_numpy(v).float()
    out = paged_attention_ref(
        torch.from_numpy(q).float(),
        kt,
        vt,
        torch.from_numpy(tables).clamp(min=0),
        torch.tensor(seq_lens, dtype=torch.int32),
        torch.tensor(qsl, dtype=torch.int32),
        scale,
    )
    return out.numpy()


# Each simulated thread block costs seconds (dozens of simulated shuffles), so the cases hold as
# few (sequence, KV head, partition) blocks as still reach every path: 2 KV heads where the KV
# head offset is checked (every core), one where it is not.
DECODE_CASES = [
    (32, 2, 2, [16, 17]),  # MHA, a full KV block and a 1-token tail, one partition (direct path)
    (64, 2, 1, [50, 5]),  # 2 heads per KV head, 2 partitions with a partial last one (full+tail)
    (32, 4, 1, [33, 0]),  # 4 heads per KV head, a padding row (seq_len 0), a 1-token partition
    (32, 4, 2, [48]),  # 2 partitions, plus an empty one from a larger bound
]


# The online core (per-warp softmax) on the direct and in-kernel-merge cases (the simulator
# takes seconds for each; the GPU tests run every case).
@pytest.mark.parametrize(
    "head_dim,num_heads,num_kv_heads,seq_lens,core",
    [(*c, "block") for c in DECODE_CASES]
    + [(*c, "online") for c in (DECODE_CASES[0], DECODE_CASES[3])]
    # 4 query heads of one KV head split over two blocks of 2 (the launcher's narrowed online
    # grid for 8-head groups): each block must take its own heads of q and out.
    + [(32, 4, 1, [40], "online-split")],
)
def test_decode_matches_reference(seed, head_dim, num_heads, num_kv_heads, seq_lens, core):
    rng = np.random.default_rng(seed)
    # The single-sequence case runs the in-kernel merge (partial and empty partitions), the
    # others the merge kernel: the simulated shuffles of the in-kernel merge are slow. The GPU
    # tests run both on every case, zero rows included.
    merge = len(seq_lens) == 1
    k, v, tables = make_cache(rng, seq_lens, num_kv_heads, head_dim)
    q = rng.standard_normal((len(seq_lens), num_heads, head_dim)).astype(np.float16)
    scale = head_dim**-0.5
    # The grid bound is larger than the longest context for the last case: empty partitions.
    max_seq_len = max(seq_lens) + (20 if len(seq_lens) == 1 else 0)
    out = run_decode(
        q,
        k,
        v,
        tables,
        seq_lens,
        scale,
        max_seq_len,
        merge,
        online=core.startswith("online"),
        max_group=2 if core == "online-split" else 8,
    )
    ref = reference(q, k, v, tables, seq_lens, list(range(len(seq_lens) + 1)), scale)
    for b, s in enumerate(seq_lens):
        if s == 0:
            assert np.all(out[b] == 0), "padding row must be zero"
            ref[b] = 0
    assert not np.isnan(out).any()
    np.testing.assert_allclose(out.astype(np.float32), ref, atol=2e-3, rtol=2e-3)


def test_decode_in_kernel_merge_resets_counters(seed):
    """The merging block zeroes its counter, so a second launch (a graph replay) with other
    lengths merges again; a counter left non-zero would skip or misplace the merge."""
    rng = np.random.default_rng(seed)
    H, kvh, D = 1, 1, 32
    counters = np.zeros(kvh, np.int32)
    for seq_lens in ([40], [64]):
        k, v, tables = make_cache(rng, seq_lens, kvh, D)
        q = rng.standard_normal((1, H, D)).astype(np.float16)
        out = run_decode(q, k, v, tables, seq_lens, 0.2, 64, True, counters)
        ref = reference(q, k, v, tables, seq_lens, [0, 1], 0.2)
        assert not counters.any(), "counters must be zero after the launch"
        np.testing.assert_allclose(out.astype(np.float32), ref, atol=2e-3, rtol=2e-3)


def test_decode_merge_mode_one_partition_context_writes_directly(seed):
    """In merge mode, a sequence whose context fits one partition (under a bound of several) is
    finished by partition 0 alone: the right output, no partials written, no counter touched."""
    rng = np.random.default_rng(seed)
    H, kvh, D = 2, 1, 32
    seq_lens = [int(rng.integers(1, PARTITION + 1))]
    k, v, tables = make_cache(rng, seq_lens, kvh, D)
    q = rng.standard_normal((1, H, D)).astype(np.float16)
    counters = np.zeros(kvh, np.int32)
    ws = {}
    out = run_decode(q, k, v, tables, seq_lens, 0.3, 3 * PARTITION, True, counters, workspace=ws)
    ref = reference(q, k, v, tables, seq_lens, [0, 1], 0.3)
    np.testing.assert_allclose(out.astype(np.float32), ref, atol=2e-3, rtol=2e-3)
    assert not counters.any()
    assert all(np.isnan(a).all() for a in ws.values()), "no partials for a one-partition context"


@pytest.mark.parametrize(
    "seq_len,want_parts,bound",
    [(70, 3, 256), (40, 3, 256), (20, 2, 256), (8, 1, 256), (160, 10, 640)],
)
def test_decode_online_merge_spreads_the_context_over_the_grid(seed, seq_len, want_parts, bound):
    """The online core with the in-kernel merge spreads a sequence's own KV blocks over the
    grid's partitions (dynamic_partitions): 64-token partitions under a 256-token bound (4 of
    them). 70 tokens = 5 KV blocks -> 2 + 2 + 1 (static partitions: 64 + 6 tokens); 40 -> 3
    partitions of one block; 8 -> one partition, written directly. The partials written show
    the split; the output matches. (One warp: the simulator's shuffles are per block; the GPU
    tests run 4 warps, where each partition takes at least one KV block per warp.) 160 tokens
    under a 640-token bound: 10 partitions, more than the merge loads in one chunk."""
    threads, part = 32, 64
    rng = np.random.default_rng(seed)
    H, kvh, D = 2, 1, 32
    k, v, tables = make_cache(rng, [seq_len], kvh, D)
    q = rng.standard_normal((1, H, D)).astype(np.float16)
    cfg = decode_config(H, kvh, D, part, threads, online=True)
    n_part = num_partitions(bound, cfg.partition)
    ws = [np.full((1, H, MERGE_MAX_PARTITIONS), np.nan, np.float32) for _ in range(2)]
    tmp = np.full((1, H, MERGE_MAX_PARTITIONS, D), np.nan, np.float32)
    out = np.full_like(q, np.nan)
    counters = np.zeros(kvh * cfg.split, np.int32)
    sl = np.asarray([seq_len], np.int32)
    decode_kernel(cfg, "merge")[(n_part, kvh * cfg.split, 1), threads](
        out, q, k.reshape(-1), v.reshape(-1), tables, sl, 0.2, kvh, ws[0], ws[1], tmp, counters
    )
    ref = reference(q, k, v, tables, [seq_len], [0, 1], 0.2)
    np.testing.assert_allclose(out.astype(np.float32), ref, atol=2e-3, rtol=2e-3)
    assert not counters.any()
    written = int((~np.isnan(ws[0][0, 0])).sum())
    assert written == (want_parts if want_parts > 1 else 0)


@pytest.mark.parametrize("core", ["block", "online"])
def test_decode_split_spreads_the_context_over_the_grid(seed, core):
    """Split mode with DecodeConfig.spread (a small batch under a bound of more partitions than
    the in-kernel merge holds): each sequence's own KV blocks spread over the grid's 8
    partitions of 32 tokens (one warp: at least one KV block each), the merge kernel told the
    same split. 70 tokens = 5 KV blocks -> 5 partitions of one block, 130 = 9 blocks -> 5 of
    two (the last of one), 8 -> one, 0 (graph padding) -> none and a zero output. Static
    partitions would run 3, 5, 1 and 0 of them."""
    rng = np.random.default_rng(seed)
    H, kvh, D = 2, 1, 32
    seq_lens = [70, 130, 8, 0]
    bound = 8 * PARTITION
    k, v, tables = make_cache(rng, seq_lens, kvh, D)
    width = bound // BLOCK_SIZE  # the grid covers the bound: the table is as wide
    tables = np.pad(tables, ((0, 0), (0, width - tables.shape[1])), constant_values=-1)
    q = rng.standard_normal((len(seq_lens), H, D)).astype(np.float16)
    ws = {}
    out = run_decode(
        q, k, v, tables, seq_lens, 0.25, bound, online=core == "online", workspace=ws, spread=True
    )
    ref = reference(q, k, v, tables, seq_lens, list(range(len(seq_lens) + 1)), 0.25)
    ref[3] = 0
    assert not np.isnan(out).any()
    assert np.all(out[3] == 0), "padding row must be zero"
    np.testing.assert_allclose(out.astype(np.float32), ref, atol=2e-3, rtol=2e-3)
    cfg = decode_config(H, kvh, D, PARTITION, THREADS)
    want = [spread_partitions(s, 8, spread_min_blocks(cfg)) if s else 0 for s in seq_lens]
    assert want == [5, 5, 1, 0]
    written = [int((~np.isnan(ws["max_logits"][b, 0])).sum()) for b in range(len(seq_lens))]
    assert written == want


_warp_lock = threading.Lock()


def warp_shfl_xor(value, lane_mask):
    """The simulator's warp shuffle (attention/common.py) met at a barrier of the caller's warp
    instead of the block's syncthreads, as on a GPU: the warps of a block may shuffle different
    numbers of times (a warp of the online core with fewer KV blocks than another)."""
    thread = threading.current_thread()
    tid = thread.thread_id
    with _warp_lock:
        slots, barriers = thread._manager.__dict__.setdefault("_warp_shfl", ({}, {}))
        barrier = barriers.get(tid // 32)
        if barrier is None:  # a failing warp breaks the others' wait instead of hanging them
            barrier = barriers[tid // 32] = threading.Barrier(32, timeout=120)
    slots[tid] = value
    barrier.wait()
    other = slots[tid ^ lane_mask]
    barrier.wait()
    return other


@pytest.fixture
def warp_shuffles(monkeypatch):
    """decode.py's kernels built under this fixture shuffle per warp (`warp_shfl_xor`), so their
    blocks may hold several warps in the simulator. Only the multi-warp tests build such
    kernels (decode_kernel caches each config's kernel; per-warp shuffles are right for one warp
    too). On a GPU the shuffles are per warp already."""
    if SIM:
        monkeypatch.setattr(decode, "shfl_xor", warp_shfl_xor)


def test_decode_online_prefetch_matches_reference(seed, warp_shuffles):
    """The online core's prefetch (DecodeConfig.prefetch) in blocks of 2 warps, static partitions
    of 5 KV blocks merged by the merge kernel: 87 tokens -> 5 blocks, warp 0 taking 3 (the loop's
    prologue, steady state and last block), then a 7-token block for warp 0 alone (warp 1 has
    none). The in-kernel merge's spread partitions, a partial block at the end of a warp's
    loop of several: test_decode_fp8_sim.py (the core is the same for each storage)."""
    rng = np.random.default_rng(seed)
    seq_lens, H, kvh, D = [87], 1, 1, 32
    k, v, tables = make_cache(rng, seq_lens, kvh, D)
    q = rng.standard_normal((len(seq_lens), H, D)).astype(np.float16)
    out = run_decode(
        q, k, v, tables, seq_lens, 0.3, 160, online=True, prefetch=True, threads=64, partition=80
    )
    ref = reference(q, k, v, tables, seq_lens, list(range(len(seq_lens) + 1)), 0.3)
    assert not np.isnan(out).any()
    np.testing.assert_allclose(out.astype(np.float32), ref, atol=2e-3, rtol=2e-3)


def test_decode_prefetch_is_an_online_option_with_its_own_kernel():
    """Prefetch (off by default) is asked of the launcher and kept where the online core runs,
    dropped where the block core does; its kernel is another config (cache key) and name."""
    sms = 132
    cfg, _ = decode.launch_with_threads(32, 8, 128, 1, 1056, sms, None, None, None, None)
    assert cfg.online and not cfg.prefetch
    args = (32, 8, 128, 1, 1056, sms, None, None, None, None, "fp16", True)
    pf, _ = decode.launch_with_threads(*args)
    assert pf == dataclasses.replace(cfg, prefetch=True)
    block, _ = decode.launch_with_threads(*args[:9], False, "fp16", True)
    assert not block.online and not block.prefetch
    names = [kernel_name(decode_kernel(c, "merge")) for c in (cfg, pf)]
    assert "online_prefetch" not in names[0] and "online_prefetch" in names[1], names
    with pytest.raises(ValueError, match="online core"):
        decode_config(32, 8, 128, 64, prefetch=True)


def run_prefill(q, k, v, tables, seq_lens, qsl, scale):
    T, H, D = q.shape
    cfg = prefill_config(H, k.shape[1], D, THREADS)
    q_lens = np.diff(qsl)
    max_q = int(q_lens.max())
    out = np.full_like(q, np.nan)
    grid = ((max_q + cfg.tile_q - 1) // cfg.tile_q, k.shape[1], len(seq_lens))
    prefill_kernel(cfg)[grid, THREADS](
        out,
        q,
        k.reshape(-1),
        v.reshape(-1),
        tables,
        np.asarray(seq_lens, np.int32),
        np.asarray(qsl, np.int32),
        scale,
        k.shape[1],
    )
    return out


@pytest.mark.parametrize(
    "head_dim,num_heads,num_kv_heads,seq_lens,q_lens",
    [
        (32, 2, 2, [5, 17], [5, 17]),  # whole prompts, MHA
        (64, 4, 2, [40, 23], [9, 23]),  # chunked prefill (q_len < seq_len) next to a prompt
        (32, 8, 2, [35, 20, 3], [12, 1, 3]),  # 4 heads per KV head, a decode row in the batch
    ],
)
def test_prefill_matches_reference(seed, head_dim, num_heads, num_kv_heads, seq_lens, q_lens):
    rng = np.random.default_rng(seed)
    k, v, tables = make_cache(rng, seq_lens, num_kv_heads, head_dim)
    qsl = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    q = rng.standard_normal((int(qsl[-1]), num_heads, head_dim)).astype(np.float16)
    scale = head_dim**-0.5
    out = run_prefill(q, k, v, tables, seq_lens, qsl, scale)
    ref = reference(q, k, v, tables, seq_lens, qsl.tolist(), scale)
    assert not np.isnan(out).any()
    np.testing.assert_allclose(out.astype(np.float32), ref, atol=2e-3, rtol=2e-3)


def test_choose_partition():
    from voltserve.kernels.attention.decode import (
        choose_partition,
        default_partition,
        direct_partition_limit,
    )

    sms = 132  # an H200; 8 KV heads and 4 query heads per KV head (Llama-3-8B)
    assert direct_partition_limit(4) == 2048 and direct_partition_limit(7) == 1168
    # Batch 64: one block per (sequence, KV head) fills a wave: one partition of the bound.
    assert choose_partition(64, 8, 1024, sms, None, 4) == 1024
    assert choose_partition(256, 8, 1100, sms, None, 4) == 1104  # rounded up to a KV block
    # A bound past the scores' shared memory (a server's max_model_len): the longest partition
    # whose scores fit it, 4 partitions of 2048 (later ones empty at short contexts) ...
    assert choose_partition(64, 8, 8192, sms, None, 4) == 2048
    assert choose_partition(64, 8, 8192, sms, 4, 4) == 2048  # a 4-partition workspace holds it
    assert choose_partition(64, 8, 8192, sms, None, 8) == 1024  # 8 heads: 1024-token limit
    assert choose_partition(48, 8, 4096, sms, None, 4) == 1024  # 384 blocks: not a full wave
    assert choose_partition(64, 8, 1100, sms, None, 8) == 1024  # 8 heads: 1024-token limit
    assert choose_partition(32, 8, 1024, sms, None, 4) == 256  # too few long blocks
    assert choose_partition(1, 8, 784, sms, None, 4) == 64  # batch 1: the shortest
    # A workspace of 32 partitions under a 16K bound: the shortest partition that fits it.
    assert choose_partition(1, 8, 16384, sms, 32, 4) == 512
    # The launcher's own grouping (32 query heads on 8 KV heads: 4 per block).
    assert default_partition(32, 8, 128, 64, 1024, sms) == 1024
    assert default_partition(32, 8, 128, 1, 784, sms) == 64


def test_launch_config_narrows_wide_groups_for_the_online_core():
    from voltserve.kernels.attention.decode import launch_config

    sms = 132
    # Llama-3-8B (4 query heads per KV head), batch 1: the online core, one block per KV head.
    cfg, n = launch_config(32, 8, 128, 1, 784, sms)
    assert (cfg.online, cfg.group, cfg.split, cfg.partition, n) == (True, 4, 1, 64, 13)
    # Qwen3-30B-A3B (8 per KV head of 128 dims: too wide for the online core's registers),
    # batch 1: the group split in two so the online core takes it.
    cfg, n = launch_config(32, 4, 128, 1, 592, sms)
    assert (cfg.online, cfg.group, cfg.split) == (True, 4, 2)
    assert 4 * cfg.split * n <= 2 * sms
    # ... but a full grid (batch 64, 1K) keeps the block core and its 8-head blocks.
    cfg, _ = launch_config(32, 4, 128, 64, 1024, sms)
    assert (cfg.online, cfg.group, cfg.split) == (False, 8, 1)
    # 8 heads of 64 dims fit the online core unsplit.
    cfg, _ = launch_config(16, 2, 64, 1, 592, sms)
    assert (cfg.online, cfg.group, cfg.split) == (True, 8, 1)
    # An explicit choice is kept.
    cfg, _ = launch_config(32, 4, 128, 1, 592, sms, online=False)
    assert (cfg.online, cfg.group) == (False, 8)


def test_launch_config_caps_long_bounds_for_the_online_core():
    """A server's bound (max_model_len 8K, 32K) at batch 1: capped at the in-kernel merge's 32
    partitions or fewer (at most one block per SM), which the online core takes (dynamic
    partitions spread the context); uncapped it was 128 partitions of 64 tokens on the block core
    plus the merge kernel. Where even 32
    partitions are too many blocks (batch 8, Llama-3-8B), the block core's choice stands."""
    from voltserve.kernels.attention.decode import MERGE_MAX_PARTITIONS, launch_config

    sms = 132
    for bound in (4352, 8192, 32768):
        cfg, n = launch_config(32, 8, 128, 1, bound, sms)  # Llama-3-8B
        assert cfg.online and 1 < n <= MERGE_MAX_PARTITIONS, (bound, cfg, n)
        cfg, n = launch_config(32, 4, 128, 1, bound, sms)  # Qwen3-30B-A3B: narrowed group
        assert cfg.online and cfg.split == 2 and n <= MERGE_MAX_PARTITIONS, (bound, cfg, n)
        cfg, n = launch_config(14, 2, 64, 4, bound, sms)  # Qwen2.5-0.5B, batch 4
        assert cfg.online and n <= MERGE_MAX_PARTITIONS, (bound, cfg, n)
    # At most one block per SM (8 KV heads: 16 partitions of 512 under an 8K bound).
    cfg, n = launch_config(32, 8, 128, 1, 8192, sms)
    assert (cfg.partition, n) == (512, 16)
    assert launch_config(14, 2, 64, 1, 8192, sms)[1] == 32  # 64 blocks
    # A short bound whose uncapped grid is online with the in-kernel merge keeps it.
    assert launch_config(32, 8, 128, 2, 544, sms)[1] == 9
    cfg, n = launch_config(32, 8, 128, 8, 8192, sms)
    assert not cfg.online and n == 8
    # A short bound is unchanged (the uncapped choice already fits the online core).
    assert launch_config(32, 8, 128, 1, 784, sms)[1] == 13
    # An explicit partition or core is kept.
    assert launch_config(32, 8, 128, 1, 8192, sms, partition_size=64)[1] == 128
    assert not launch_config(32, 8, 128, 1, 8192, sms, online=False)[0].online


def test_online_core_takes_8_warps_under_long_bounds():
    """launch_with_threads: the online core runs 256 threads where its partitions give each of 8
    warps a KV block and the grid stays one wave (batch 1 under a server's 8K bound), else 128
    (short bounds: 64-token partitions; Llama-3-8B under 32K: 256 blocks, two waves at one
    block per SM). An explicit thread count is kept."""
    from voltserve.kernels.attention.decode import launch_with_threads

    sms = 132

    def threads(H, kvh, D, B, bound, nt=None):
        cfg, n = launch_with_threads(H, kvh, D, B, bound, sms, None, nt, None, None)
        return cfg.num_threads, n, cfg.online

    assert threads(32, 8, 128, 1, 8192) == (256, 16, True)  # Llama-3-8B
    assert threads(14, 2, 64, 1, 8192) == (256, 32, True)  # Qwen2.5-0.5B
    assert threads(32, 4, 128, 1, 8192) == (256, 16, True)  # Qwen3-30B-A3B (group split in 2)
    assert threads(32, 8, 128, 1, 1056) == (128, 17, True)  # 64-token partitions
    assert threads(32, 8, 128, 1, 32768) == (128, 32, True)  # 256 blocks
    assert threads(32, 8, 128, 1, 8192, 128) == (128, 16, True)
