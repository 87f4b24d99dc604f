"""Decode and prefill attention kernels on a real GPU at realistic shapes, against the fp32
reference (attention/ref.py) run on the same fp16 inputs.

Error bound: |out - ref| <= 2e-3 + 5e-3 * |ref| elementwise. The kernels accumulate in fp32 (sum
order differs from torch: ~1e-6 relative) and round the output to fp16 (half an ulp is 4.9e-4
relative), so the bound leaves room only for rounding, not for a wrong mask or a lost partition.
Inputs are N(0, 1); the cache slots past each context are NaN, outputs are NaN before launch.
"""

from __future__ import annotations

import pytest
import torch
from voltserve.kernels.attention.ref import paged_attention_ref, paged_decode_attention_ref

from tests.gpu.paged_cache import BLOCK, pages_for, shuffled_tables

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

ATOL, RTOL = 2e-3, 5e-3
CONTEXTS = [1, 15, 16, 17, 100, 1000, 4096, 32768]


def make_cache(seq_lens, num_kv_heads, head_dim, gen, width=None):
    shape = (pages_for(seq_lens), num_kv_heads, BLOCK, head_dim)
    k = torch.randn(shape, generator=gen, device="cuda").half()
    v = torch.randn(shape, generator=gen, device="cuda").half()
    tables = shuffled_tables(seq_lens, k, v, float("nan"), gen, width)
    return k, v, tables


# The decode kernel's cores: block (bandwidth-bound grids), online (small grids).
CORES = {
    "block": dict(online=False),
    "online": dict(online=True),
}


def captured(step) -> torch.cuda.CUDAGraph:
    """step() run once on a side stream (the compile, and the merge counters sized outside
    capture), then captured in a graph."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        step()
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    return graph


def check(out, ref):
    assert not out.isnan().any()
    torch.testing.assert_close(out.float(), ref.float(), atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("core", sorted(CORES))
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("group", [1, 4, 8])
def test_decode(head_dim, group, core):
    from voltserve.kernels.attention.decode import paged_decode_attention_cuda

    gen = torch.Generator(device="cuda").manual_seed(torch.seed() % 2**31)
    num_kv_heads = 2
    seq_lens = CONTEXTS
    k, v, tables = make_cache(seq_lens, num_kv_heads, head_dim, gen)
    q = torch.randn((len(seq_lens), num_kv_heads * group, head_dim), generator=gen, device="cuda")
    q = q.half()
    sl = torch.tensor(seq_lens, dtype=torch.int32, device="cuda")
    scale = head_dim**-0.5
    ref = paged_decode_attention_ref(q.float(), k.float(), v.float(), tables, sl, scale)
    for max_seq_len in (None, max(seq_lens)):  # table-width bound, exact bound
        out = torch.full_like(q, float("nan"))
        paged_decode_attention_cuda(
            q, k, v, tables, sl, scale, out, max_seq_len=max_seq_len, **CORES[core]
        )
        torch.cuda.synchronize()
        check(out, ref)


@pytest.mark.parametrize("core", sorted(CORES))
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("group", [1, 4, 8])
def test_decode_short_single_partition(head_dim, group, core):
    """Contexts within one partition take the direct path (no merge kernel); a 0 row is zero."""
    from voltserve.kernels.attention.decode import paged_decode_attention_cuda

    gen = torch.Generator(device="cuda").manual_seed(torch.seed() % 2**31)
    seq_lens = [1, 15, 16, 17, 100, 0, 511]
    k, v, tables = make_cache(seq_lens, 4, head_dim, gen)
    q = torch.randn((len(seq_lens), 4 * group, head_dim), generator=gen, device="cuda").half()
    sl = torch.tensor(seq_lens, dtype=torch.int32, device="cuda")
    out = torch.full_like(q, float("nan"))
    paged_decode_attention_cuda(
        q, k, v, tables, sl, 0.1, out, max_seq_len=512, partition_size=512, **CORES[core]
    )
    ref = paged_decode_attention_ref(q.float(), k.float(), v.float(), tables, sl, 0.1)
    ref[5] = 0
    check(out, ref)


@pytest.mark.parametrize("partition_size", [None, 64, 256, 1024, 2048, 4096])
@pytest.mark.parametrize("head_dim,group", [(128, 4), (64, 7)])
def test_decode_large_batch_and_bound(head_dim, group, partition_size):
    """Batch 48 under a 4096 bound: split (64), in-kernel merge (256, 1024, and 2048: the
    full-grid choice under a long bound, its longest partition), direct (4096) and the
    launcher's choice (1024-token partitions here), with contexts of every length, empty
    partitions and a padding row."""
    from voltserve.kernels.attention.decode import paged_decode_attention_cuda

    gen = torch.Generator(device="cuda").manual_seed(torch.seed() % 2**31)
    seq_lens = torch.randint(1, 4097, (48,), generator=gen, device="cuda").tolist()
    seq_lens[:4] = [0, 1, 16, 4096]
    num_kv_heads = 8
    k, v, tables = make_cache(seq_lens, num_kv_heads, head_dim, gen)
    q = torch.randn((48, num_kv_heads * group, head_dim), generator=gen, device="cuda").half()
    sl = torch.tensor(seq_lens, dtype=torch.int32, device="cuda")
    scale = head_dim**-0.5
    ref = paged_decode_attention_ref(q.float(), k.float(), v.float(), tables, sl, scale)
    ref[0] = 0
    for _ in range(2):  # twice: the merge counters must be back at zero after a launch
        out = torch.full_like(q, float("nan"))
        paged_decode_attention_cuda(
            q,
            k,
            v,
            tables,
            sl,
            scale,
            out,
            max_seq_len=4096,
            partition_size=partition_size,
        )
        torch.cuda.synchronize()
        check(out, ref)


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("group", [1, 4, 8])
def test_prefill_chunked(head_dim, group):
    from voltserve.kernels.attention.prefill import paged_attention_cuda

    gen = torch.Generator(device="cuda").manual_seed(torch.seed() % 2**31)
    # (seq_len, q_len): whole prompts, chunks after a cached prefix, decode rows in the batch.
    cases = [(1, 1), (17, 17), (100, 37), (1000, 1000), (4096, 512), (4096, 1), (300, 16)]
    seq_lens = [s for s, _ in cases]
    q_lens = [n for _, n in cases]
    num_kv_heads = 2
    k, v, tables = make_cache(seq_lens, num_kv_heads, head_dim, gen)
    qsl = torch.tensor([0] + list(torch.tensor(q_lens).cumsum(0)), dtype=torch.int32).cuda()
    T = int(qsl[-1])
    q = torch.randn((T, num_kv_heads * group, head_dim), generator=gen, device="cuda").half()
    sl = torch.tensor(seq_lens, dtype=torch.int32, device="cuda")
    scale = head_dim**-0.5
    out = torch.full_like(q, float("nan"))
    paged_attention_cuda(q, k, v, tables, sl, qsl, scale, out, max_query_len=max(q_lens))
    ref = paged_attention_ref(q.float(), k.float(), v.float(), tables, sl, qsl, scale)
    check(out, ref)
    out2 = paged_attention_cuda(q, k, v, tables, sl, qsl, scale)  # max_query_len from the device
    check(out2, ref)


def test_decode_cuda_graph_replay_with_new_seq_lens():
    """Capture once with a context bound; replay after changing seq_lens (including 0 rows and
    lengths that span different partition counts) and compare every replay to the reference."""
    from voltserve.kernels.attention.decode import (
        decode_config,
        num_partitions,
        paged_decode_attention_cuda,
    )

    gen = torch.Generator(device="cuda").manual_seed(torch.seed() % 2**31)
    B, kvh, group, D, max_len = 8, 8, 4, 128, 8192
    H = kvh * group
    k, v, tables = make_cache([max_len] * B, kvh, D, gen)
    q = torch.randn((B, H, D), generator=gen, device="cuda").half()
    sl = torch.full((B,), 1, dtype=torch.int32, device="cuda")
    out = torch.full_like(q, float("nan"))
    P = num_partitions(max_len, decode_config(H, kvh, D).partition)
    ws = (
        torch.empty((B, H, P), device="cuda"),
        torch.empty((B, H, P), device="cuda"),
        torch.empty((B, H, P, D), device="cuda"),
    )

    def step():
        paged_decode_attention_cuda(
            q, k, v, tables, sl, D**-0.5, out, max_seq_len=max_len, workspace=ws
        )

    graph = captured(step)

    for lens in ([1] * B, [5, 0, 513, 8192, 16, 17, 1024, 3000], [8192] * B, [0] * B):
        sl.copy_(torch.tensor(lens, dtype=torch.int32))
        q.copy_(torch.randn((B, H, D), generator=gen, device="cuda").half())
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        ref = paged_decode_attention_ref(q.float(), k.float(), v.float(), tables, sl, D**-0.5)
        for b, n in enumerate(lens):
            if n == 0:
                ref[b] = 0
        check(out, ref)


@pytest.mark.parametrize("core", [*sorted(CORES), "default"])
@pytest.mark.parametrize("head_dim,group", [(64, 7), (128, 4), (128, 8)])
def test_decode_small_batch_in_kernel_merge_graph(head_dim, group, core):
    """Small batches with short partitions (the batch-1 decode shape): the group's last block
    merges the partitions in the same kernel. core "default": the launcher's choice (for 8
    heads of 128 dims, the online core on the group split over two blocks). Captured in a graph with the default workspace and
    replayed with new lengths: every replay must merge again (the arrival counters reset), and
    the counters must be zero after each replay."""
    from voltserve.kernels.attention.decode import _COUNTERS, paged_decode_attention_cuda

    gen = torch.Generator(device="cuda").manual_seed(torch.seed() % 2**31)
    B, kvh, max_len = 2, 2, 1120  # 18 partitions of 64: the in-kernel merge path
    H = kvh * group
    k, v, tables = make_cache([max_len] * B, kvh, head_dim, gen)
    q = torch.randn((B, H, head_dim), generator=gen, device="cuda").half()
    sl = torch.full((B,), 1, dtype=torch.int32, device="cuda")
    out = torch.full_like(q, float("nan"))
    scale = head_dim**-0.5

    def step():
        paged_decode_attention_cuda(
            q, k, v, tables, sl, scale, out, max_seq_len=max_len, partition_size=64,
            **CORES.get(core, {}),
        )  # fmt: skip

    graph = captured(step)

    for lens in ([1, 1], [640, 65], [1120, 0], [64, 1119], [17, 1024], [1120, 1120]):
        sl.copy_(torch.tensor(lens, dtype=torch.int32))
        q.copy_(torch.randn((B, H, head_dim), generator=gen, device="cuda").half())
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        ref = paged_decode_attention_ref(q.float(), k.float(), v.float(), tables, sl, scale)
        for b, n in enumerate(lens):
            if n == 0:
                ref[b] = 0
        check(out, ref)
        assert not _COUNTERS.get(q.device, 1).any(), "merge counters must be zero after a launch"
    # Eager launches with the default partitioning at batch 1 (what a batch-1 decode step runs).
    for n in (1, 100, 640, 1000):
        sl1 = torch.tensor([n], dtype=torch.int32, device="cuda")
        o1 = torch.full_like(q[:1], float("nan"))
        paged_decode_attention_cuda(
            q[:1], k, v, tables[:1], sl1, scale, o1, max_seq_len=max_len, **CORES.get(core, {})
        )
        torch.cuda.synchronize()
        check(
            o1,
            paged_decode_attention_ref(q[:1].float(), k.float(), v.float(), tables[:1], sl1, scale),
        )


@pytest.mark.parametrize("bound", [8192, 131072])
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(32, 8, 128), (14, 2, 64), (32, 4, 128)])
def test_decode_batch1_server_bound_graph(heads, kv_heads, head_dim, bound):
    """Batch 1 under a server's bound with the launcher's defaults, captured once and replayed
    with contexts from 1 to the bound. 8K: the online core at ONLINE_THREADS (8 warps a block,
    launch_with_threads), the dynamic spread over the partitions, the in-kernel merge and its
    counters at every length. 128K (more partitions than the in-kernel merge holds): split mode
    with the context spread over the grid (DecodeConfig.spread) and the merge kernel told the
    same split. Llama-3-8B, Qwen2.5-0.5B and Qwen3-30B-A3B heads."""
    from voltserve.kernels.attention.decode import (
        _COUNTERS,
        MERGE_MAX_PARTITIONS,
        ONLINE_THREADS,
        launch_with_threads,
        paged_decode_attention_cuda,
        spreads,
    )
    from voltserve.kernels.runtime.launch_geometry import device_sms

    sms = device_sms(torch.cuda.current_device())
    cfg, n_part = launch_with_threads(
        heads, kv_heads, head_dim, 1, bound, sms, None, None, None, None
    )
    if bound == 8192 and sms >= kv_heads * cfg.split * 16:  # an H100/H200-sized grid
        assert cfg.online and cfg.num_threads == ONLINE_THREADS
    if bound > 8192:
        assert n_part > MERGE_MAX_PARTITIONS and spreads(1, kv_heads * cfg.split, sms)
    gen = torch.Generator(device="cuda").manual_seed(torch.seed() % 2**31)
    k, v, tables = make_cache([bound], kv_heads, head_dim, gen)
    q = torch.randn((1, heads, head_dim), generator=gen, device="cuda").half()
    sl = torch.ones(1, dtype=torch.int32, device="cuda")
    out = torch.full_like(q, float("nan"))
    scale = head_dim**-0.5

    def step():
        paged_decode_attention_cuda(q, k, v, tables, sl, scale, out, max_seq_len=bound)

    graph = captured(step)
    lengths = [1, 17, 140, 544, 1056, 2048, 4097, 8192]
    if bound > 8192:
        lengths += [32768, 100003, bound]
    for n in lengths:
        sl.fill_(n)
        q.copy_(torch.randn((1, heads, head_dim), generator=gen, device="cuda").half())
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        check(out, paged_decode_attention_ref(q.float(), k.float(), v.float(), tables, sl, scale))
        assert not _COUNTERS.get(q.device, 1).any(), "merge counters must be zero after a launch"
