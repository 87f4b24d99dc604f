"""Decode attention over a one-byte (fp8) KV cache (attention/decode_fp8.py) in numba's CUDA
simulator, through its production launcher: paged_decode_attention_fp8_cuda runs on CPU torch
tensors with its launches handed to the simulator as numpy views of the same memory (the
simulator takes no torch tensors; `sim_launcher`), so the launcher's own choices (core, form,
workspace, the scales folded into its arguments) are what runs. Each output is checked against
attention (attention/ref.py) over pages dequantized here from torch's float8 types, not by the
code under test. Outputs are NaN before every launch; the cache slots past each context hold
codes that would show if read (e5m2: NaN; e4m3: 448, its largest value).

Blocks are one warp (the simulator's shuffles need that) and partitions 32 tokens, so contexts of
a few dozen tokens cross KV-block and partition boundaries.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

if not torch.cuda.is_available():  # as test_attention_sim.py: standalone under the simulator
    os.environ.setdefault("NUMBA_ENABLE_CUDASIM", "1")

from voltserve.kernels.attention import decode, decode_fp8  # noqa: E402
from voltserve.kernels.attention.ref import paged_decode_attention_ref  # noqa: E402
from voltserve.kernels.runtime import launch_geometry, numba_common  # noqa: E402

from tests.kernels.test_attention_sim import make_cache, warp_shfl_xor  # noqa: E402
from tests.kv_rounding import codes  # noqa: E402

pytestmark = pytest.mark.skipif(
    torch.cuda.is_available(), reason="simulator test (tests/gpu/test_decode_fp8_gpu.py on a GPU)"
)

THREADS, PARTITION, SMS = 32, 32, 4
TORCH_FP8 = {"fp8_e5m2": torch.float8_e5m2, "fp8_e4m3": torch.float8_e4m3fn}
PAST_END = {"fp8_e5m2": 0x7F, "fp8_e4m3": 0x7E}  # NaN; 448


@pytest.fixture
def sim_launcher(monkeypatch):
    """decode.py's launches go to the simulator with numpy views of their tensors (the launch's
    geometry checked as on a GPU: numba_common.launch); its SM count is SMS. Yields the
    launched kernels' names."""
    names: list[str] = []

    def sim_launch(kernel, grid, block, args, stream=None):
        names.append(launch_geometry.kernel_name(kernel))
        arrays = tuple(a.numpy() if isinstance(a, torch.Tensor) else a for a in args)
        numba_common.launch(kernel, grid, block, arrays, stream)

    monkeypatch.setattr(decode, "launch", sim_launch)
    monkeypatch.setattr(decode, "sm_count", lambda device: SMS)
    monkeypatch.setattr(decode, "current_stream", lambda: None)
    return names


def fp8_case(rng, seq_lens, H, KVH, D, fmt, k_scale, v_scale):
    """(q, uint8 K / V caches, tables, seq_lens, reference output)."""
    k16, v16, tables = make_cache(rng, seq_lens, KVH, D)
    k16, v16 = np.nan_to_num(k16) * np.float16(3), np.nan_to_num(v16) * np.float16(3)
    kc = codes(torch.from_numpy(k16), fmt, k_scale)
    vc = codes(torch.from_numpy(v16), fmt, v_scale)
    for b, n in enumerate(seq_lens):  # the slots past each context
        blocks = -(-n // 16)
        if n % 16:
            kc[tables[b, blocks - 1], :, n % 16 :] = PAST_END[fmt]
            vc[tables[b, blocks - 1], :, n % 16 :] = PAST_END[fmt]
    tables_t = torch.from_numpy(tables).clamp(min=0)
    sl = torch.tensor(seq_lens, dtype=torch.int32)
    q = torch.from_numpy(rng.standard_normal((len(seq_lens), H, D)).astype(np.float16))
    k_ref = kc.view(TORCH_FP8[fmt]).float() * k_scale
    v_ref = vc.view(TORCH_FP8[fmt]).float() * v_scale
    ref = paged_decode_attention_ref(q.float(), k_ref, v_ref, tables_t, sl, D**-0.5)
    ref[sl == 0] = 0
    return q, kc, vc, tables_t, sl, ref


# (fmt, k_scale, v_scale, H, KV heads, D, seq_lens, bound, core, want kernels). Each simulated
# thread block costs about a second: the cases hold few (sequence, KV head, partition) blocks.
CASES = [
    # e4m3 with scales, 2 heads per KV head, ragged batch of 3 with a padding row, 2 partitions
    # (the second partial) merged by the separate merge kernel (a workspace of 2 partitions),
    # block core.
    ("fp8_e4m3", 0.375, 2.5, 2, 1, 64, [50, 7, 0], 64, "block", "split"),
    # e5m2, 4 heads per KV head, one sequence of 3 KV blocks over 2 partitions, online core
    # with the in-kernel merge.
    ("fp8_e5m2", 1.0, 1.0, 4, 1, 64, [40], 64, "online", "merge"),
    # e4m3, MHA over 2 KV heads (the KV head offset), batch 2 of one partition each (unsplit:
    # direct), a full block and a 1-token tail.
    ("fp8_e4m3", 1.75, 0.5, 2, 2, 64, [16, 17], 32, "block", "direct"),
]


@pytest.mark.parametrize(
    "fmt,k_scale,v_scale,H,KVH,D,seq_lens,bound,core,form",
    CASES,
    ids=[f"{c[0]}-{c[-2]}-{c[-1]}" for c in CASES],
)
def test_fp8_decode_matches_dequantized_reference(
    seed, sim_launcher, fmt, k_scale, v_scale, H, KVH, D, seq_lens, bound, core, form
):
    rng = np.random.default_rng(seed)
    q, kc, vc, tables, sl, ref = fp8_case(rng, seq_lens, H, KVH, D, fmt, k_scale, v_scale)
    B = len(seq_lens)
    workspace = None
    if form == "split":  # fewer than MERGE_MAX_PARTITIONS partitions: the separate merge kernel
        P = decode.num_partitions(bound, PARTITION)
        workspace = decode.decode_workspace(B, H, P, D, "cpu")
    out = torch.full_like(q, float("nan"))
    decode_fp8.paged_decode_attention_fp8_cuda(
        q, kc, vc, tables.int(), sl, D**-0.5, out, fmt=fmt, k_scale=k_scale, v_scale=v_scale,
        max_seq_len=bound, partition_size=PARTITION, workspace=workspace, num_threads=THREADS,
        online=core == "online",
    )  # fmt: skip
    kernel = sim_launcher[0]
    assert f"decode_attention_{form}" in kernel and fmt in kernel, sim_launcher
    assert ("online" in kernel) == (core == "online")
    assert len(sim_launcher) == (2 if form == "split" else 1), sim_launcher
    assert not out.isnan().any()
    torch.testing.assert_close(out.float(), ref, atol=2e-3, rtol=2e-3)
    # The module's own reference (the CPU definition) agrees with the one built here.
    mine = decode_fp8.paged_decode_attention_fp8_ref(
        q, kc, vc, tables, sl, D**-0.5, fmt, k_scale, v_scale
    )
    torch.testing.assert_close(mine.float(), ref, atol=1e-3, rtol=1e-3)


def test_fp8_decode_online_prefetch_matches_dequantized_reference(seed, sim_launcher, monkeypatch):
    """The online core's prefetch (DecodeConfig.prefetch) over e5m2 pages, in blocks of 2 warps
    (per-warp shuffles: warp_shfl_xor), the in-kernel merge spreading the context over 2
    partitions of up to 8 KV blocks: 130 tokens -> 5 + 4 blocks, warp 0 taking 3 of the first
    (the loop's prologue, steady state and last block), the second's first-entry guess (part x
    2) wrong and its last block, warp 1's, of 2 tokens. Warps with one KV block or none:
    test_attention_sim.py (the core is the same for each storage)."""
    monkeypatch.setattr(decode, "shfl_xor", warp_shfl_xor)
    fmt, seq_lens, D = "fp8_e5m2", [130], 64
    rng = np.random.default_rng(seed)
    q, kc, vc, tables, sl, ref = fp8_case(rng, seq_lens, 1, 1, D, fmt, 1.0, 1.0)
    out = torch.full_like(q, float("nan"))
    decode_fp8.paged_decode_attention_fp8_cuda(
        q, kc, vc, tables.int(), sl, D**-0.5, out, fmt=fmt, max_seq_len=256, partition_size=128,
        num_threads=64, online=True, prefetch=True,
    )  # fmt: skip
    assert sim_launcher == [sim_launcher[0]] and "merge_online_prefetch" in sim_launcher[0]
    assert not out.isnan().any()
    torch.testing.assert_close(out.float(), ref, atol=2e-3, rtol=2e-3)


def test_widening_covers_every_code() -> None:
    """The widening source (kv_widen.emit_widen) run as Python on words holding all 256 codes in
    every byte position, against torch's float8 value of each code (x 2^-8 for e4m3, whose
    factor the launcher folds into q and the PV sums). NaN codes: e5m2 NaN; e4m3 +-480."""
    from voltserve.kernels.attention import kv_widen
    from voltserve.kernels.attention.common import half_hi, half_lo

    all_codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    for fmt in ("fp8_e5m2", "fp8_e4m3"):
        want = all_codes.view(TORCH_FP8[fmt]).float() / kv_widen.scale_factor(fmt)
        if fmt == "fp8_e4m3":
            nan = want.isnan()
            want[nan] = torch.where(all_codes[nan] < 128, 480.0, -480.0) / 256
        lines: list[str] = []
        kv_widen.emit_widen(lambda _i, line, acc=lines: acc.append(line), 0, "r", "x", fmt)
        for shift in range(4):  # code c in byte (c + shift) % 4 of its word
            got = torch.empty(256)
            for c0 in range(0, 256, 16):
                block = np.roll(np.arange(c0, c0 + 16, dtype=np.uint8), shift)
                words = block.view(np.uint32)
                env = {f"r_{i}": np.uint32(words[i]) for i in range(4)}
                env.update(half_lo=half_lo, half_hi=half_hi)
                exec("\n".join(lines), env)
                for j in range(16):
                    got[block[j]] = float(env[f"x{j}"])
            torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True, msg=fmt)


@pytest.mark.parametrize(
    "fmt,k_scale,v_scale,error",
    [
        ("fp8_e5m2", 0.5, 1.0, "fp8_e5m2 takes no scale"),
        ("fp8_e4m3", 1.0, 0.0, "v_scale must be finite and positive"),
        ("fp8_e4m3", float("nan"), 1.0, "k_scale must be finite and positive"),
        ("fp8", 1.0, 1.0, "unknown fp8 format"),
    ],
)
def test_bad_format_or_scales_are_refused_by_name(fmt, k_scale, v_scale, error) -> None:
    q = torch.zeros((1, 2, 64), dtype=torch.float16)
    cache = torch.zeros((2, 1, 16, 64), dtype=torch.uint8)
    tables, sl = torch.zeros((1, 1), dtype=torch.int32), torch.ones(1, dtype=torch.int32)
    with pytest.raises(ValueError, match=error):
        decode_fp8.paged_decode_attention_fp8_cuda(
            q, cache, cache, tables, sl, 0.1, fmt=fmt, k_scale=k_scale, v_scale=v_scale
        )


def test_an_fp16_cache_is_refused() -> None:
    q = torch.zeros((1, 2, 64), dtype=torch.float16)
    cache = torch.zeros((2, 1, 16, 64), dtype=torch.float16)
    tables, sl = torch.zeros((1, 1), dtype=torch.int32), torch.ones(1, dtype=torch.int32)
    with pytest.raises(TypeError, match="torch.uint8"):
        decode_fp8.paged_decode_attention_fp8_cuda(q, cache, cache, tables, sl, 0.1, fmt="fp8_e5m2")
