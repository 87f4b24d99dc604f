"""The production launchers (every `*_cuda` function, and the launch functions the quantized and
MoE paths call) at the shapes users run, checked against the CUDA launch limits without a GPU.

Inside `launch_geometry.recording()` a launch through numba_common.launch is recorded and not
run, and the launchers take torch 'meta' tensors (shapes and dtypes, no memory), so a launcher
runs its real host code (path choice, tiles, split-K, grid, argument list) at a 262,144-token
vocabulary in milliseconds. Each recorded launch is checked against the limits written out here
from the CUDA programming guide (not imported from the code under test): gridDim.x <= 2^31 - 1,
gridDim.y and .z <= 65,535, blockDim.x and .y <= 1,024, .z <= 64, <= 1,024 threads a block.
Each call must launch the expected kernel (a launcher that quietly took its torch reference
would launch nothing) with its output argument shaped as the call's output, and where a
launcher's host code decides coverage (rows of blocks over a weight's rows, tiles over N and T,
split-K slices) the recorded grid is checked to cover the shape.

On a GPU host (the GPU checks run tests/kernels too) the same calls also reach the launchers
that have no simulator path: the flash prefill attention and the tensor-core MoE GEMMs.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable

import pytest
import torch
from voltserve.kernels.linear.gguf_blocks import BLOCK_TYPES
from voltserve.kernels.linear.quant_pack import GroupQuantWeight, _check_group
from voltserve.kernels.runtime import launch_geometry as lg
from voltserve.kernels.runtime.numba_common import SIM, launch

GRID_MAX = (2**31 - 1, 65_535, 65_535)
BLOCK_MAX = (1_024, 1_024, 64)
THREADS_MAX = 1_024

VOCABS = (128_256, 151_936, 262_144)  # Llama 3, Qwen2 / 2.5 / 3, Gemma 3
HIDDENS = (4_096, 8_192)
INTERS = (14_336, 29_568)  # Llama-3-8B, Qwen2.5-72B
BATCHES = (1, 8, 64, 256)
CHUNK = 8_192  # prefill tokens in one step
TOKENS = (1, 256, CHUNK, 65_536)  # 65,536: a token count on gridDim.x past y's limit
SMS = (80, 132)  # V100, H100 SXM: split-K and partition choices depend on the SM count
META = torch.device("meta")
F16, F32, I32, I64 = torch.float16, torch.float32, torch.int32, torch.int64


def t(*shape: int, dtype: torch.dtype = F16) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype, device=META)


def assert_within_limits(rec: lg.Launch) -> None:
    for what, dims, maxima in (("grid", rec.grid, GRID_MAX), ("block", rec.block, BLOCK_MAX)):
        for axis, v, hi in zip("xyz", dims, maxima):
            assert 1 <= v <= hi, f"{rec.kernel}: {what}.{axis} = {v:,} (limit {hi:,})"
    threads = rec.block[0] * rec.block[1] * rec.block[2]
    assert threads <= THREADS_MAX, f"{rec.kernel}: {threads} threads per block"


def recorded(expect: str, fn: Callable, *args, sms: int = 132, **kwargs) -> list[lg.Launch]:
    """The launches fn(*args, **kwargs) makes inside a recording of `sms` SMs; each within the
    limits, one of them of a kernel whose name contains `expect`."""
    with lg.recording(sms) as launches:
        fn(*args, **kwargs)
    assert launches, f"nothing launched (expected {expect}): the launcher took its reference"
    names = [r.kernel for r in launches]
    assert any(expect in n for n in names), f"expected a {expect} launch, got {names}"
    for r in launches:
        assert_within_limits(r)
    return launches


def one(launches: list[lg.Launch], name: str) -> lg.Launch:
    found = [r for r in launches if name in r.kernel]
    assert len(found) == 1, [r.kernel for r in launches]
    return found[0]


# ---------------------------------------------------------------------------------------------
# The check itself


def test_an_oversized_grid_is_refused_naming_the_kernel_and_dimension() -> None:
    """The launch a Q6_K lm_head of 128,256 rows made when the dequantize kernel put a weight's
    rows on gridDim.y (the driver answered CUDA_ERROR_INVALID_VALUE). The check refuses it
    before the launch, in the simulator (which would not) as on a GPU, and inside a recording."""
    from voltserve.kernels.linear import quant_dequant

    args = (t(128_256, 512, dtype=I32), t(128_256, 256), t(128_256, 256), t(128_256, 4096), 4)
    with pytest.raises(lg.LaunchGeometryError, match=r"dequant_int8_kernel.*gridDim\.y = 128,256"):
        launch(quant_dequant.dequant_int8_kernel, (1, 128_256), 128, args)
    with lg.recording() as launches, pytest.raises(lg.LaunchGeometryError, match="gridDim.y"):
        launch(quant_dequant.dequant_int8_kernel, (1, 128_256), 128, args)
    assert launches == []


@pytest.mark.parametrize(
    "grid,block,dimension",
    [
        ((2**31, 1, 1), 128, "gridDim.x = 2,147,483,648"),
        ((1, 1, 65_536), 128, "gridDim.z = 65,536"),
        ((0, 4), 128, "gridDim.x = 0"),
        (1, 1_025, "blockDim.x = 1,025"),
        (1, (8, 8, 65), "blockDim.z = 65"),
        (1, (64, 32), "2,048 threads per block"),
    ],
)
def test_every_limit_is_checked(grid, block, dimension) -> None:
    from voltserve.kernels.sampling.sampling import argmax_kernel

    with lg.recording(), pytest.raises(lg.LaunchGeometryError) as err:
        launch(argmax_kernel, grid, block, (t(1, 8, dtype=F32), t(1, dtype=I64)))
    assert "kernel sampling.sampling.argmax_kernel:" in str(err.value)
    assert dimension in str(err.value)


def test_kernel_names_tell_same_named_modules_apart() -> None:
    """attention/decode.py and moe/decode.py both define kernels: an error names each by its
    dotted path inside voltserve.kernels, not by the file name they share."""
    from voltserve.kernels.attention.decode import decode_reduce_kernel
    from voltserve.kernels.moe.decode import moe_decode_down_kernel

    assert lg.kernel_name(decode_reduce_kernel) == "attention.decode.decode_reduce_kernel"
    assert lg.kernel_name(moe_decode_down_kernel) == "moe.decode.moe_decode_down_kernel"


def test_limits_at_the_boundary_pass_and_a_wrong_argument_count_is_refused() -> None:
    from voltserve.kernels.sampling.sampling import argmax_kernel

    args = (t(1, 8, dtype=F32), t(1, dtype=I64))
    with lg.recording() as launches:
        launch(argmax_kernel, (2**31 - 1, 65_535, 65_535), (16, 16, 4), args)
        with pytest.raises(TypeError, match="takes 2 arguments"):
            launch(argmax_kernel, 1, 32, args[:1])
    assert [(r.grid, r.block) for r in launches] == [((2**31 - 1, 65_535, 65_535), (16, 16, 4))]
    assert [(a.name, a.shape) for a in launches[0].args] == [("logits", (1, 8)), ("out", (1,))]


def test_meta_tensors_are_no_gpu_tensors_outside_a_recording() -> None:
    from voltserve.kernels.linear import quant_dequant

    w = quant_weight(1024, 512, 8, 32)
    out = t(1024, 512)
    assert not lg.on_gpu(out) and not quant_dequant.supports(w, out)
    with lg.recording():
        assert lg.on_gpu(out) and quant_dequant.supports(w, out)
    assert not lg.on_gpu(out)


def test_fold_yz_covers_every_item_within_the_limits() -> None:
    assert lg.fold_yz(65_535) == (65_535, 1)
    assert lg.fold_yz(65_536) == (65_535, 2)
    assert lg.fold_yz(262_144) == (65_535, 5)
    assert lg.fold_yz(7, 2) == (2, 4)
    with pytest.raises(ValueError):
        lg.fold_yz(0)


# ---------------------------------------------------------------------------------------------
# Quantized linears: every format, every path, every large shape


def quant_weight(N: int, K: int, bits: int, group: int, dtype=F16, act_order=False):
    P = 32 // bits
    return GroupQuantWeight(
        bits=bits,
        group_size=group,
        in_features=K,
        out_features=N,
        qweight=t(N, -(-K // P), dtype=I32),
        scales=t(N, K // group, dtype=dtype),
        offsets=t(N, K // group, dtype=dtype),
        group_shift=_check_group(group, K),
        perm=t(K, dtype=I64) if act_order else None,
    )


# (bits, group; 0 is per-channel, act-order) of every checkpoint format's packed form
FORMATS = {
    "awq int4 g128": (4, 128, False),
    "gptq int4 g128 act-order": (4, 128, True),
    "gptq int8 g32": (8, 32, False),
    "compressed-tensors int4 channel": (4, 0, False),
    "compressed-tensors int8 channel": (8, 0, False),
    **{f"gguf {b.name}": (b.bits, b.group, False) for b in BLOCK_TYPES.values()},
}
GEMV_ROWS, TC_ROWS, DEQUANT_ROWS = (1, 4, 8), (16, 64), (256, CHUNK)
KERNEL_OF = {"gemv": "quant gemv", "tc": "qgemm", "dequant": "dequant_int"}


def _linears(hidden: int) -> list[tuple[int, int]]:
    """(N, K): every vocabulary's lm_head, gate_up and down at both intermediate sizes."""
    return [(v, hidden) for v in VOCABS] + [
        s for i in INTERS for s in ((2 * i, hidden), (hidden, i))
    ]


def path_for(T: int, dtype: torch.dtype, w: GroupQuantWeight) -> str:
    """quant_linear.quant_path as a recording sees it (meta tensors count as GPU tensors)."""
    from voltserve.kernels.linear import quant_linear

    with lg.recording():
        return quant_linear.quant_path(T, dtype, w)


def _check_quant_launches(launches, path: str, w: GroupQuantWeight, T: int) -> None:
    from voltserve.kernels.linear import quant_dequant, quant_gemm_tc

    N, K = w.shape
    if path == "gemv":
        rec = one(launches, "quant gemv plain")
        assert rec.arg("out").shape == (T, N) and rec.arg("qw").shape == w.qweight.shape
    elif path == "tc":
        rec = one(launches, "qgemm_kernel")
        cfg = quant_gemm_tc.config_for(T)
        tiles_n, tiles_m, split = rec.grid
        assert tiles_n * cfg.bn >= N and tiles_m * cfg.bm >= T, (rec.grid, cfg)
        assert 1 <= split <= quant_gemm_tc.MAX_SPLIT
        assert rec.arg("out").shape == (T, N) and rec.arg("qw").shape == w.qweight.shape
        reduce = [r for r in launches if "qgemm_reduce" in r.kernel]
        if split > 1:  # the partials hold every slice, and one reduce launch sums them
            assert rec.arg("part").shape == (split * T * N,) and len(reduce) == 1
            assert reduce[0].grid[0] * reduce[0].block[0] >= T * N
        else:
            assert not reduce
    else:
        rec = one(launches, "dequant_int")
        assert rec.arg("out").shape == (N, K) and rec.arg("qw").shape == w.qweight.shape
        words = w.qweight.shape[1]
        assert rec.grid[0] * quant_dequant.THREADS * 4 >= words
        y, z = rec.grid[1:]  # the rows folded over y and z
        assert y == min(N, 65_535) and (z - 1) * y < N <= z * y


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_quant_linear_every_path_at_model_shapes(fmt: str) -> None:
    from voltserve.kernels.linear import quant_linear

    bits, group, act_order = FORMATS[fmt]
    seen = set()
    for N, K in (s for h in HIDDENS for s in _linears(h)):
        w = quant_weight(N, K, bits, group or K, act_order=act_order)
        for T in GEMV_ROWS + TC_ROWS + DEQUANT_ROWS:
            path = path_for(T, F16, w)
            launches = recorded(KERNEL_OF[path], quant_linear.quant_linear_cuda, t(T, K), w)
            _check_quant_launches(launches, path, w, T)
            seen.add(path)
    assert seen == {"gemv", "tc", "dequant"}


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_quant_fused_decode_gemvs(fmt: str) -> None:
    """The decode GEMV's gate_up (SiLU epilogue) and qkv_rope (rotary and the KV write) kinds."""
    from voltserve.kernels.linear import quant_gemv

    bits, group, act_order = FORMATS[fmt]
    for hidden, T in itertools.product(HIDDENS, GEMV_ROWS):
        x = t(T, hidden)
        for inter in INTERS:
            w = quant_weight(2 * inter, hidden, bits, group or hidden, act_order=act_order)
            launches = recorded("gate_up", quant_gemv.quant_gemv_gate_up_cuda, x, w)
            assert launches[0].arg("out").shape == (T, inter)
        n_q, n_kv, D = hidden // 128, 8, 128
        w = quant_weight((n_q + 2 * n_kv) * D, hidden, bits, group or hidden)
        cache = (t(4096, n_kv, 16, D), t(4096, n_kv, 16, D))
        rope = (t(T, dtype=I64), t(131_072, D, dtype=F32), *cache, t(T, dtype=I64), n_q, n_kv)
        launches = recorded("qkv_rope", quant_gemv.quant_qkv_rope_cuda, x, w, None, *rope)
        assert launches[0].arg("out").shape == (T, w.out_features)


@pytest.mark.parametrize("fmt", ["gguf Q6_K", "gguf Q8_0", "gguf Q4_K", "awq int4 g128"])
def test_quant_paths_in_fp32_and_with_the_split_k_of_each_card(fmt: str) -> None:
    """fp32 runs take the GEMV and the dequantize path only; the tensor-core GEMM's split-K
    depends on the SM count (V100's 80, H100's 132)."""
    from voltserve.kernels.linear import quant_gemm_tc, quant_linear

    bits, group, _ = FORMATS[fmt]
    for V, hidden in itertools.product(VOCABS, HIDDENS):
        w32 = quant_weight(V, hidden, bits, group, dtype=F32)
        for T in GEMV_ROWS + TC_ROWS + DEQUANT_ROWS:
            path = path_for(T, F32, w32)
            assert path != "tc"
            x = t(T, hidden, dtype=F32)
            launches = recorded(KERNEL_OF[path], quant_linear.quant_linear_cuda, x, w32)
            _check_quant_launches(launches, path, w32, T)
    w = quant_weight(VOCABS[0], HIDDENS[0], bits, group)
    for sms, T in itertools.product(SMS, (5, 16, 33, 64, 128, 1024)):
        x = t(T, w.in_features)
        launches = recorded("qgemm", quant_gemm_tc.quant_gemm_tc_cuda, x, w, sms=sms)
        _check_quant_launches(launches, "tc", w, T)


@pytest.mark.parametrize("fmt", ["awq int4 g128", "gguf Q6_K", "gguf Q8_0", "gguf Q4_K"])
def test_stacked_experts_and_fused_moe_decode(fmt: str) -> None:
    """Quantized MoE experts: the stacked experts dequantized in one launch (Qwen3-30B-A3B: 128
    experts x 1,536 gate_up rows = 196,608 rows) and the fused decode kernels up to the token
    counts they take."""
    from voltserve.kernels.linear import quant_dequant
    from voltserve.kernels.moe import quant_decode as mq

    bits, group, _ = FORMATS[fmt]
    for E, H, inter, k in ((128, 2048, 768, 8), (8, 4096, 14336, 2)):
        w13 = quant_weight(E * 2 * inter, H, bits, group)
        w2 = quant_weight(E * H, inter, bits, group)
        out = t(E * 2 * inter, H)
        launches = recorded("dequant_int", quant_dequant.dequantize_into, w13, out)
        y, z = launches[0].grid[1:]
        assert (z - 1) * y < E * 2 * inter <= z * y
        for T in (1, 8, 64, 128):
            with lg.recording():
                fused = mq.supports(t(T, H), w13, w2, k)
            assert fused == mq.fused_pays(T, k, E)
            if not fused:
                continue
            routing = (t(T, k, dtype=F32), t(T, k, dtype=I32))
            launches = recorded("moe quant decode", mq.moe_quant_decode, t(T, H), w13, w2, *routing)
            assert [r.arg("out").shape for r in launches] == [(T * k, inter), (T, H)]


@pytest.mark.parametrize("kind,group", [("e4m3", 16), ("e8m0", 32)])  # NVFP4, MXFP4
def test_fp4_experts_fused_moe_decode_and_dequantize(kind: str, group: int) -> None:
    """FP4 MoE experts (quant/fp4_experts.py): the fused decode kernels up to the token counts
    they take (one warp per column of every pair, per row of every token), and the batched
    path's dequantize of every stacked expert in one launch (Qwen3-30B-A3B: 196,608 rows)."""
    from voltserve.kernels import dispatch
    from voltserve.kernels.linear import fp4_kernels
    from voltserve.kernels.linear.fp4_pack import Fp4Weight
    from voltserve.kernels.moe import fp4_decode as mf

    U8 = torch.uint8

    def flat(rows: int, K: int) -> Fp4Weight:
        return Fp4Weight(
            t(rows, K // 2, dtype=U8),
            t(rows, K // group, dtype=U8),
            t(rows, dtype=F32),
            group,
            kind,
        )

    for E, H, inter, k in ((128, 2048, 768, 8), (8, 4096, 14336, 2)):
        w13, w2 = flat(E * 2 * inter, H), flat(E * H, inter)
        launches = recorded("fp4_dequant", dispatch.fp4_dequantize, w13, F16, True)
        rec = one(launches, "fp4_dequant")
        assert rec.arg("out").shape == (E * 2 * inter, H)
        assert rec.grid[0] * fp4_kernels.THREADS * 8 >= H
        y, z = rec.grid[1:]  # the rows folded over y and z
        assert (z - 1) * y < E * 2 * inter <= z * y
        for T in (1, 8, 64, 128, 512):
            with lg.recording():
                fused = mf.supports(t(T, H), w13, w2, k)
            assert fused == mf.fused_pays(T, k, E)
            if not fused:
                continue
            routing = (t(T, k, dtype=F32), t(T, k, dtype=I32))
            launches = recorded("fp4_moe", mf.moe_fp4_decode, t(T, H), w13, w2, *routing)
            gate_up, down = one(launches, "fp4_moe_gate_up"), one(launches, "fp4_moe_down")
            assert gate_up.arg("out").shape == (T * k, inter) and down.arg("out").shape == (T, H)
            assert gate_up.arg("packed").shape == (E * 2 * inter, H // 8)  # int32 code words
            assert down.arg("packed").shape == (E * H, inter // 8)
            assert down.arg("scales").shape == (E * H, inter // group)
            assert down.arg("e8m0").value == (kind == "e8m0")
            assert down.arg("gshift").value == group.bit_length() - 1
            for rec, cols, programs in ((gate_up, inter, T * k), (down, H, T)):
                assert rec.grid[0] * rec.block[0] // 32 >= cols  # a warp per column
                y, z = rec.grid[1:]
                assert (z - 1) * y < programs <= z * y


# ---------------------------------------------------------------------------------------------
# fp16 linears (the decode GEMVs; prefill is cuBLAS), the lm_head over the vocabulary included


def test_gemv_lm_head_gate_up_and_qkv_rope() -> None:
    from voltserve.kernels.linear import gemv, gemv_qkv_rope

    for dtype, hidden, M in itertools.product((F16, F32), HIDDENS, range(1, gemv.MAX_M + 1)):
        for V in VOCABS:  # the lm_head, or tied embeddings read as one
            x, w = t(M, hidden, dtype=dtype), t(V, hidden, dtype=dtype)
            launches = recorded("gemv_plain", gemv.gemv_cuda, x, w)
            assert one(launches, "gemv_plain").arg("out").shape == (M, V)
        for inter in INTERS:
            x, w = t(M, hidden, dtype=dtype), t(2 * inter, hidden, dtype=dtype)
            launches = recorded("gemv_gate_up", gemv.gemv_gate_up_cuda, x, w)
            assert one(launches, "gemv_gate_up").arg("out").shape == (M, inter)
        n_q, n_kv, D = hidden // 128, 8, 128
        rope = (
            t(M, dtype=I64),
            t(131_072, D, dtype=F32),
            t(4096, n_kv, 16, D, dtype=dtype),
            t(4096, n_kv, 16, D, dtype=dtype),
            t(M, dtype=I64),
            n_q,
            n_kv,
        )
        w = t((n_q + 2 * n_kv) * D, hidden, dtype=dtype)
        x = t(M, hidden, dtype=dtype)
        launches = recorded("gemv_qkv_rope", gemv_qkv_rope.gemv_qkv_rope_cuda, x, w, None, *rope)
        assert one(launches, "gemv_qkv_rope").arg("out").shape == (M, w.shape[0])


# ---------------------------------------------------------------------------------------------
# Sampling and structured outputs over the vocabulary


def test_sampling_and_grammar_mask_over_the_vocabulary() -> None:
    from voltserve.kernels.sampling import grammar_mask, sampling

    for B, V in itertools.product(BATCHES, VOCABS):
        logits = t(B, V, dtype=F32)
        rows = (t(B, dtype=F32), t(B, dtype=I32), t(B, dtype=F32), t(B, dtype=F32))
        seeds = (t(B, dtype=I64), t(B, dtype=I64))
        launches = recorded("sample_kernel", sampling.sample_cuda, logits, *rows, *seeds)
        assert launches[0].grid[0] == B and launches[0].arg("out").shape == (B,)
        launches = recorded("argmax_kernel", sampling.argmax_cuda, logits)
        assert launches[0].grid[0] == B
        penalties = (t(B, V, dtype=torch.bool), t(B, V, dtype=I32)) + (t(B, dtype=F32),) * 3
        launches = recorded("penalties", sampling.apply_penalties_cuda, logits, *penalties)
        assert launches[0].grid[0] == B
        assert launches[0].grid[1] * launches[0].block[0] >= V
        mask = (t(B, -(-V // 32), dtype=I32), t(B, dtype=I64))
        launches = recorded("bitmask", grammar_mask.apply_token_bitmask_cuda, logits, *mask)
        assert launches[0].grid[0] == B
        assert launches[0].grid[1] * launches[0].block[0] >= V


# ---------------------------------------------------------------------------------------------
# Per-token kernels: norms, activation, rotary, the KV-cache write


def test_per_token_kernels_at_prefill_chunks() -> None:
    from voltserve.kernels.attention import kv_cache, qk_norm_rope, rotary, rotary_cache
    from voltserve.kernels.elementwise import activation, rmsnorm

    for dtype, T in itertools.product((F16, F32), TOKENS):
        for hidden in HIDDENS:
            x = t(T, hidden, dtype=dtype)
            weight = t(hidden, dtype=dtype)
            launches = recorded("rms_norm", rmsnorm.rms_norm_cuda, x, weight, 1e-5)
            assert launches[0].grid[0] == T
            residual = t(T, hidden, dtype=dtype)
            launches = recorded(
                "fused_add", rmsnorm.fused_add_rms_norm_cuda, x, residual, weight, 1e-5
            )
            assert launches[0].grid[0] == T
        for inter in INTERS:
            launches = recorded("silu", activation.silu_and_mul_cuda, t(T, 2 * inter, dtype=dtype))
            assert launches[0].arg("out").shape == (T, inter)
        for n_q, n_kv, D in ((32, 8, 128), (64, 8, 128), (28, 4, 128), (14, 2, 64), (8, 8, 256)):
            pos, slots = t(T, dtype=I64), t(T, dtype=I64)
            cache = (t(8192, n_kv, 16, D, dtype=dtype), t(8192, n_kv, 16, D, dtype=dtype))
            cos_sin = t(131_072, D, dtype=F32)
            q, k, v = (t(T, n * D, dtype=dtype) for n in (n_q, n_kv, n_kv))
            recorded("rotary", rotary.rotary_embedding_cuda, pos, q, k, D, cos_sin)
            kv = (k.view(T, n_kv, D), v.view(T, n_kv, D))
            recorded("reshape_and_cache", kv_cache.reshape_and_cache_cuda, *kv, *cache, slots)
            rope = (D, cos_sin, True, *cache, slots)
            recorded("rotary_and_cache", rotary_cache.rotary_and_cache_cuda, pos, q, k, v, *rope)
            norm = (t(D, dtype=dtype), t(D, dtype=dtype), 1e-6)
            fused = qk_norm_rope.qk_norm_rope_and_cache_cuda
            recorded("qk_norm_rope", fused, pos, q, k, v, *norm, *rope)


# ---------------------------------------------------------------------------------------------
# Attention: decode over batches and contexts, prefill over 8K-token chunks and 256 prompts

HEADS = ((32, 8, 128), (64, 8, 128), (28, 4, 128), (14, 2, 64), (8, 8, 256))  # (H, KV heads, D)


def test_decode_attention_over_batches_and_contexts() -> None:
    from voltserve.kernels.attention import decode as decode_attention

    for (H, kvh, D), B, context, sms in itertools.product(
        HEADS, BATCHES, (1024, 32_768, 131_072), SMS
    ):
        cache = (t(B * context // 16 + 1, kvh, 16, D), t(B * context // 16 + 1, kvh, 16, D))
        tables = t(B, context // 16, dtype=I32)
        args = (t(B, H, D), *cache, tables, t(B, dtype=I32), D**-0.5)
        launches = recorded("decode", decode_attention.paged_decode_attention_cuda, *args, sms=sms)
        main = launches[0]
        assert main.grid[2] == B and main.arg("out").shape == (B, H, D)
        if len(launches) == 2:  # the separate merge
            assert launches[1].grid == (H, B, 1)


@pytest.mark.parametrize("fmt", ["fp8_e5m2", "fp8_e4m3"])
def test_fp8_decode_attention_at_262144_tokens(fmt: str) -> None:
    """The one-byte cache's decode (decode_fp8.py) at a 262,144-token context and bound, batch 1
    and 256, every head shape: the partitions (grid x), the head blocks and the batch within
    the limits, the partials' workspace holding every partition of the grid."""
    from voltserve.kernels.attention import decode_fp8

    U8 = torch.uint8
    context = 262_144
    for (H, kvh, D), B, sms in itertools.product(HEADS, (1, 256), SMS):
        cache = t(B * context // 16 + 1, kvh, 16, D, dtype=U8)
        args = (t(B, H, D), cache, cache, t(B, context // 16, dtype=I32), t(B, dtype=I32), 0.1)
        fn = decode_fp8.paged_decode_attention_fp8_cuda
        launches = recorded("decode", fn, *args, sms=sms, fmt=fmt, k_scale=1.0, v_scale=1.0)
        main = launches[0]
        assert fmt in main.kernel
        assert main.grid[2] == B and main.arg("out").shape == (B, H, D)
        assert main.arg("k_cache").shape == (cache.numel(),)
        assert main.arg("tmp_out").shape[2] >= main.grid[0]  # a slot for every partition
        if len(launches) == 2:  # the separate merge
            assert launches[1].grid == (H, B, 1)


# Prefill adds Qwen3.5-27B's and Qwen3-Next's full-attention layers (head dim 256, groups 6 and 8).
PREFILL_HEADS = (*HEADS, (24, 4, 256), (16, 2, 256))  # (H, KV heads, D)


@pytest.mark.parametrize("seqs", [1, 32, 256])
def test_prefill_attention_over_chunks_and_prompts(seqs: int) -> None:
    from voltserve.kernels.attention import prefill as prefill_attention
    from voltserve.kernels.attention import prefill_fa as prefill_attention_fa

    T = CHUNK
    q_len = T // seqs
    for H, kvh, D in PREFILL_HEADS:
        blocks = seqs * (q_len // 16 + 1) + 1
        args = (
            t(blocks, kvh, 16, D),
            t(blocks, kvh, 16, D),
            t(seqs, blocks, dtype=I32),
            t(seqs, dtype=I32),
            t(seqs + 1, dtype=I32),
            D**-0.5,
        )
        q = t(T, H, D)
        cuda_core = prefill_attention.paged_attention_cuda
        launches = recorded("prefill_kernel", cuda_core, q, *args, max_query_len=q_len)
        assert launches[0].grid[1:] == (kvh, seqs)
        assert launches[0].grid[0] * prefill_attention.prefill_config(H, kvh, D).tile_q >= q_len
        if SIM:
            continue  # the flash kernel links CUDA C++: no simulator kernel to record
        flash = D in prefill_attention_fa.HEAD_DIMS
        dispatch = prefill_attention_fa.paged_attention_cuda
        expect = "prefill_fa_kernel" if flash else "prefill_kernel"
        launches = recorded(expect, dispatch, q, *args, max_query_len=q_len)
        assert launches[0].grid[1:] == (kvh, seqs)
        if flash:  # 64 (token, head) rows a block: the grid's x covers the queries
            assert launches[0].grid[0] * (64 // (H // kvh)) >= q_len
            assert launches[0].block[0] == (256 if D == 256 else 128)  # 8 warps at head dim 256


# ---------------------------------------------------------------------------------------------
# MoE: routing and the experts over tokens x experts

MOE = ((128, 2048, 768, 8), (8, 4096, 14_336, 2), (60, 2048, 1408, 4))  # (E, H, I, k)


@pytest.mark.parametrize("wmma", ["1", "0"])
def test_moe_routing_and_experts(wmma: str, monkeypatch) -> None:
    from voltserve.kernels.moe import experts as moe_experts
    from voltserve.kernels.moe import routing as moe_routing

    monkeypatch.setenv(moe_experts.WMMA_ENV, wmma)
    for (E, H, inter, k), T, dtype in itertools.product(MOE, (1, 8, 64, 256, CHUNK), (F16, F32)):
        launches = recorded("moe_topk", moe_routing.moe_topk_cuda, t(T, E, dtype=dtype), k, True)
        assert launches[0].arg("ids").shape == (T, k)
        w13, w2 = t(E, 2 * inter, H, dtype=dtype), t(E, H, inter, dtype=dtype)
        routing = (t(T, k, dtype=F32), t(T, k, dtype=I32))
        x = t(T, H, dtype=dtype)
        launches = recorded("moe_", moe_experts.moe_experts_cuda, x, w13, w2, *routing)
        assert len(launches) == 2  # gate_up, then down
        expect = "moe_decode" if T <= moe_experts.DECODE_MAX_TOKENS else "moe_grouped"
        if T > moe_experts.DECODE_MAX_TOKENS and not SIM and wmma == "1" and dtype == F16:
            expect = "moe_wmma"
        assert all(expect in r.kernel for r in launches), [r.kernel for r in launches]
        assert launches[1].arg("y_pairs" if expect != "moe_decode" else "out").shape[1] == H


def kquant_weight(kind: str, N: int, K: int):
    from voltserve.kernels.linear.kquant_pack import make_kquant_weight

    return make_kquant_weight(kind, t(N, K // 256 * BLOCK_TYPES[kind].nbytes, dtype=torch.uint8), K)


@pytest.mark.parametrize("sms", SMS)
def test_kquant_gemv_and_dequantize_at_model_shapes(sms: int) -> None:
    """GGUF K-quant blocks (kquant_gemv, kquant_dequant): a Q6_K lm_head of every vocabulary, Q4_K
    and Q6_K gate_up and down at both intermediate sizes, and a merged qkv of Q4_K q/k beside a
    Q6_K v (one launch a type, each into its columns of one output)."""
    from voltserve.kernels.linear import kquant_dequant, kquant_gemv
    from voltserve.kernels.linear.kquant_linear import kquant_gemv_cuda
    from voltserve.kernels.linear.kquant_pack import segments_of

    for hidden, kind in itertools.product(HIDDENS, ("Q4_K", "Q6_K")):
        for N, K in _linears(hidden):
            if K % 256:
                continue  # 29,568-wide rows hold no 256-element blocks: no K-quant (GGUFSource)
            w = kquant_weight(kind, N, K)
            for T in (1, 8):
                launches = recorded(
                    "kquant_gemv", kquant_gemv_cuda, t(T, K), segments_of([w]), sms=sms
                )
                rec = one(launches, "kquant_gemv")
                assert rec.arg("out").shape == (T, N) and rec.arg("qw").shape == (
                    N,
                    w.words().shape[1],
                )
                with lg.recording(sms):
                    R, KS = kquant_gemv.tiling(w, META)
                groups = rec.grid[0] * kquant_gemv.WARPS // KS  # KS warps a group of R rows
                assert groups * R >= N > (groups - kquant_gemv.WARPS // KS) * R
            rec = one(recorded("dequant", kquant_dequant.dequantize_into, w, t(N, K)), "dequant")
            assert rec.grid[0] * kquant_dequant.THREADS >= K // 256 * 4
            y, z = rec.grid[1:]  # the rows folded over y and z
            assert y == min(N, 65_535) and (z - 1) * y < N <= z * y
    hidden, n_q, n_kv, D = 4096, 32, 8, 128
    qk = [kquant_weight("Q4_K", n * D, hidden) for n in (n_q, n_kv)]
    segs = segments_of([*qk, kquant_weight("Q6_K", n_kv * D, hidden)])
    launches = recorded("kquant_gemv", kquant_gemv_cuda, t(1, hidden), segs, sms=sms)
    assert [r.arg("out").shape for r in launches] == [(1, (n_q + n_kv) * D), (1, n_kv * D)]
    assert ["q4_k" in r.kernel for r in launches] == [True, False]


@pytest.mark.parametrize("kv", ["fp16", "fp8_e5m2"])
def test_decode_workspace_bytes_is_what_a_launch_allocates(kv: str) -> None:
    """decode.workspace_bytes (what KV sizing sets aside for the largest decode graph) equals
    the partials the recorded launch is given at a 262,144-token bound, batch 1, 64 and 256,
    every head shape (over 100 MiB at 256 rows: what a decode graph of 256 rows holds)."""
    from voltserve.kernels.attention import decode, decode_fp8

    context = 262_144
    for (H, kvh, D), B, sms in itertools.product(HEADS, (1, 64, 256), SMS):
        if kv == "fp16":
            cache = t(2, kvh, 16, D)
            fn, kw = decode.paged_decode_attention_cuda, {}
        else:
            cache = t(2, kvh, 16, D, dtype=torch.uint8)
            fn, kw = decode_fp8.paged_decode_attention_fp8_cuda, {"fmt": kv}
        args = (t(B, H, D), cache, cache, t(B, context // 16, dtype=I32), t(B, dtype=I32), 0.1)
        main = recorded("decode", fn, *args, sms=sms, **kw)[0]
        ml, es, tmp = (main.arg(n) for n in ("max_logits", "exp_sums", "tmp_out"))
        got = 4 * sum(math.prod(a.shape) for a in (ml, es, tmp))
        assert decode.workspace_bytes(B, H, kvh, D, context, sms, kv) == got, (H, B, sms)
    big = decode.workspace_bytes(256, 32, 8, 128, context, 132, kv)
    assert big > 100 * 2**20 and big >= decode.workspace_bytes(256, 32, 8, 128, 8192, 132, kv)
