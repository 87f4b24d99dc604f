"""Fused MoE experts with group-quantized weights (AWQ / GPTQ / compressed-tensors / GGUF, int4
or int8 codes) for decode batches (always up to 8 tokens, more while it pays: fused_pays): per
token only its k experts' packed codes are read, dequantised in registers, in two launches and
no host synchronisation.

The experts are the stacked packed tensors of quant/experts.py seen as one flat
GroupQuantWeight per projection: w13 rows e * 2I + j (expert e's gate rows, then its up rows),
w2 rows e * H + n. Each launch is the quantized GEMV's warp step (quant_gemv.dot_step: all of
a step's 16-byte code loads in flight before the first multiply, one shift + LOP3 per code and
one FMA with the group's folded (scale, offset), fp32 accumulation) pointed at the routed
expert's rows. fp16 activations with int4 codes in groups of >= 32 take the step's half2 form
(two codes per instruction, fp16 runs of 16 products widened to fp32 per chunk: quant_gemv's
module doc, with its error bound; `form_for`; in down the routing weight and the half2 sums'
2**8 are folded into each chunk's fp32 scale and offset):

1. gate_up: h[p, j] = silu(x[t] . w13[e, j]) * (x[t] . w13[e, I + j]) for every pair
   p = t * k + slot, e = topk_ids[t, slot]; one warp owns R / 2 columns j of one pair (its gate
   and up rows, so both sums end in the same warp), rounded as the linear and the activation
   round (gate and up to the storage dtype, silu, then the product).
2. down + weighted sum: out[t, n] = sum_slot w[t, slot] * (h[t * k + slot] . w2[e_slot, n]);
   one warp owns R rows n of one token and walks its k experts, the routing weight folded into
   each group's (scale, offset) (one multiply per chunk, not per weight), so the weighted sum
   accumulates in fp32 in the same registers and the output is rounded once. No atomics, no
   [T, k, H] intermediate.

Act-order experts (an input permutation per expert) are not served here: the caller takes the
dequantizing path. The reference (`moe_quant_experts_ref`) is moe_experts_ref on the
dequantized stacked weights (kernels/linear/quant_pack.dequantize).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch
from numba import cuda
from voltserve.kernels.linear.quant_gemv import (
    FORMS,
    GATE_UP,
    H2_SHIFT,
    HALF2,
    PLAIN,
    WARP_WORDS,
    WEIGHT,
    WORDS_PER_CHUNK,
    _aligned,
    _aligned_rows,
    dot_step,
    is_split,
    source_scope,
    tile_for,
)
from voltserve.kernels.linear.quant_gemv import (
    form_for as gemv_form_for,
)
from voltserve.kernels.linear.quant_pack import GroupQuantWeight, dequantize
from voltserve.kernels.runtime.compile_cache import cached_factory
from voltserve.kernels.runtime.launch_geometry import MAX_GRID_YZ, on_gpu
from voltserve.kernels.runtime.numba_common import SIM, current_stream, launch

MAX_TOKENS = 8  # up to here the fused kernels always serve (decode)
# Past it they still move fewer bytes than the alternative while the (token, slot) pairs read
# fewer expert bytes than dequantizing every expert and running the grouped GEMM moves (read
# the codes, write and read back the fp16 weights: ~9x the int4 bytes of all E experts), so
# they serve while T * k <= PAIRS_PER_EXPERT * E (Qwen3-30B-A3B: up to 128 tokens; the
# dequantizing path's cost at batch 64 / 256 is in BENCHMARKS.md §14).
PAIRS_PER_EXPERT = 8
MAX_PROGRAMS = MAX_GRID_YZ  # pairs (gate_up) / tokens (down) go on the grid's y dimension


def fused_pays(tokens: int, k: int, num_experts: int) -> bool:
    """Whether the fused kernels take a step of `tokens` tokens with top-k of num_experts."""
    if tokens < 1 or tokens * k > MAX_PROGRAMS:
        return False
    return tokens <= MAX_TOKENS or tokens * k <= PAIRS_PER_EXPERT * num_experts


# Warps per block. The simulator's shuffle is exact only within a one-warp block.
WARPS = 1 if SIM else 4
DOWN = "down"


def tile(bits: int, kind: str) -> tuple[int, int]:
    """(R rows per warp, U chunks per lane per step): the M = 1 GEMV's tiles (quant_gemv)."""
    return tile_for(1, bits, GATE_UP if kind == GATE_UP else PLAIN)


def _source(kind: str, R: int, U: int, bits: int, split: bool, form: str = WEIGHT) -> str:
    step = U * WARP_WORDS
    head = [
        "    lane = cuda.threadIdx.x & 31",
        "    warp = (cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x) >> 5",
        "    K = x.shape[1]",
        "    W = qw.shape[1]",
        "    G = scales.shape[1]",
        "    N = out.shape[1]",
        "    k = ids.shape[1]",
    ]
    acc = [f"    a0_{r} = float32(0.0)" for r in range(R)]
    if kind == GATE_UP:
        Q = R // 2  # columns per warp: gate rows base + j, up rows base + N + j
        L = ["def kernel(x, qw, scales, offsets, ids, out, gshift):", *head]
        L += [
            "    p = cuda.blockIdx.y",
            f"    row0 = warp * {Q}",
            "    if row0 >= N:",
            "        return  # the whole warp leaves together: the shuffles stay full-mask",
            "    t = p // k",
            "    base = ids[t, p - t * k] * (2 * N)",
        ]
        for q in range(Q):
            L += [
                f"    rw{2 * q} = base + min(row0 + {q}, N - 1)",
                f"    rw{2 * q + 1} = rw{2 * q} + N",
            ]
        L += acc + [f"    lw = lane * {WORDS_PER_CHUNK}", "    w0 = 0", "    while w0 < W:"]
        L += dot_step("        ", 1, R, U, bits, split, ["t"], form=form)
        L.append(f"        w0 += {step}")
        if form == HALF2:  # the half2 step's sums are in units of 2**-H2_SHIFT
            L += [f"    a0_{r} *= float32({2.0**H2_SHIFT!r})" for r in range(R)]
        L += ["    a = float32(0.0)", "    b = float32(0.0)"]
        for q in range(Q):
            L += [
                f"    ta = _warp_sum(a0_{2 * q})",
                f"    tb = _warp_sum(a0_{2 * q + 1})",
                f"    if lane == {q}:",
                "        a = ta",
                "        b = tb",
            ]
        L += [
            f"    if lane < {Q}:",
            "        col = row0 + lane",
            "        if col < N:",
            "            out[p, col] = _silu_mul(round_like(a, out), round_like(b, out), out)",
        ]
        return "\n".join(L) + "\n"
    L = ["def kernel(x, qw, scales, offsets, ids, wts, out, gshift):", *head]
    L += [
        "    tok = cuda.blockIdx.y",
        f"    row0 = warp * {R}",
        "    if row0 >= N:",
        "        return  # the whole warp leaves together",
        *acc,
        f"    lw = lane * {WORDS_PER_CHUNK}",
        "    for s in range(k):",
        "        base = ids[tok, s] * N",
        # half2: the step's 2**-H2_SHIFT units folded into the routing weight
        "        ws = wts[tok, s]" + (f" * float32({2.0**H2_SHIFT!r})" if form == HALF2 else ""),
        "        xr = tok * k + s",
    ]
    L += [f"        rw{r} = base + min(row0 + {r}, N - 1)" for r in range(R)]
    L += ["        w0 = 0", "        while w0 < W:"]
    L += dot_step("            ", 1, R, U, bits, split, ["xr"], weight="ws", form=form)
    L += [f"            w0 += {step}", "    mine = float32(0.0)"]
    for r in range(R):
        L += [f"    tv = _warp_sum(a0_{r})", f"    if lane == {r}:", "        mine = tv"]
    L += [
        f"    if lane < {R}:",
        "        row = row0 + lane",
        "        if row < N:",
        "            out[tok, row] = mine",
    ]
    return "\n".join(L) + "\n"


def _build(kind: str, R: int, U: int, bits: int, split: bool, form: str):
    scope = source_scope()
    name = f"<moe quant decode {kind} R={R} U={U} bits={bits} split={split} form={form}>"
    exec(compile(_source(kind, R, U, bits, split, form), name, "exec"), scope)  # noqa: S102
    return cuda.jit(scope["kernel"])


@cached_factory
@functools.cache
def moe_qkernel(kind: str, bits: int, split: bool = False, form: str = WEIGHT):
    """The gate_up (GATE_UP) or down (DOWN) kernel for these codes, built once (and kept in
    the on-disk kernel cache: the int4 down kernel takes about a minute to compile). form:
    the step's dot product (quant_gemv.dot_step: WEIGHT, or HALF2 for fp16 x and int4 codes
    with one group per chunk, `form_for`)."""
    if kind not in (GATE_UP, DOWN):
        raise ValueError(f"kind must be {GATE_UP!r} or {DOWN!r}, got {kind!r}")
    if split and bits != 4:
        raise ValueError("the SPLIT variant is for int4 codes with group 16")
    if form not in (WEIGHT, HALF2):
        raise ValueError(f"form must be {WEIGHT!r} or {HALF2!r} (of {FORMS}), got {form!r}")
    if form == HALF2 and (bits != 4 or split):
        raise ValueError("the half2 form is for int4 codes with one group per chunk")
    R, U = tile(bits, kind)
    return _build(kind, R, U, bits, split, form)


def form_for(dtype: torch.dtype, w: GroupQuantWeight) -> str:
    """The dense GEMV's choice for one row where that is HALF2 (fp16 activations, int4 codes
    with one group per chunk), else WEIGHT: the factored form has no place for the routing
    weight."""
    return HALF2 if gemv_form_for(1, dtype, w.bits, is_split(w)) == HALF2 else WEIGHT


def grid(kind: str, bits: int, rows: int, programs: int) -> tuple[int, int]:
    """(blocks over `rows` output columns (gate_up: I) or rows (down: H), pairs / tokens)."""
    R, _ = tile(bits, kind)
    per_block = WARPS * (R // 2 if kind == GATE_UP else R)
    return (rows + per_block - 1) // per_block, programs


# Representative instances for `voltserve check-kernels` (kernels/registry.py).
moe_q_gate_up_int4 = moe_qkernel(GATE_UP, 4)
moe_q_down_int4 = moe_qkernel(DOWN, 4)
moe_q_gate_up_int8 = moe_qkernel(GATE_UP, 8)
moe_q_down_int8 = moe_qkernel(DOWN, 8)
moe_q_gate_up_int4_half2 = moe_qkernel(GATE_UP, 4, form=HALF2)
moe_q_down_int4_half2 = moe_qkernel(DOWN, 4, form=HALF2)


# ---------------------------------------------------------------------------------------------
# Host side


def flat_experts(qweight, scales, offsets, w0: GroupQuantWeight) -> GroupQuantWeight:
    """Stacked [E, N, ...] packed tensors (quant/experts.py) as one [E * N, K] weight (views)."""
    E, N = qweight.shape[0], qweight.shape[1]
    return replace(
        w0,
        out_features=E * N,
        qweight=qweight.reshape(E * N, -1),
        scales=scales.reshape(E * N, -1),
        offsets=offsets.reshape(E * N, -1),
        perm=None,
    )


def dequantized_experts_ref(
    x: torch.Tensor,  # [T, H]
    w13,  # flat [E * 2I, H]
    w2,  # flat [E * H, I]
    topk_weights: torch.Tensor,  # [T, k] fp32
    topk_ids: torch.Tensor,  # [T, k]
    dequantize_fn: Callable[[Any, torch.dtype], torch.Tensor],
) -> torch.Tensor:
    """moe_experts_ref on the flat experts dequantized by `dequantize_fn(w, dtype)` (the meaning
    the fused kernels, integer or FP4, are tested to)."""
    from voltserve.kernels.moe.experts import moe_experts_ref

    H, inter = x.shape[1], w2.in_features
    E = w2.out_features // H
    d13 = dequantize_fn(w13, x.dtype).view(E, 2 * inter, H)
    d2 = dequantize_fn(w2, x.dtype).view(E, H, inter)
    return moe_experts_ref(x, d13, d2, topk_weights, topk_ids)


def moe_quant_experts_ref(
    x: torch.Tensor,  # [T, H]
    w13: GroupQuantWeight,  # flat [E * 2I, H]
    w2: GroupQuantWeight,  # flat [E * H, I]
    topk_weights: torch.Tensor,  # [T, k] fp32
    topk_ids: torch.Tensor,  # [T, k]
) -> torch.Tensor:
    """moe_experts_ref on the dequantized experts (the meaning the kernels are tested to)."""
    return dequantized_experts_ref(x, w13, w2, topk_weights, topk_ids, dequantize)


def _weight_ok(w: GroupQuantWeight, dtype: torch.dtype) -> bool:
    P = 32 // w.bits
    return (
        on_gpu(w.qweight)
        and w.perm is None
        and w.bits in (4, 8)
        and w.scales.dtype == dtype
        and w.in_features % (WORDS_PER_CHUNK * P) == 0
        and w.qweight.is_contiguous()
        and w.scales.is_contiguous()
        and w.offsets.is_contiguous()
        and _aligned(w.qweight, 4)
    )


def supports(x: torch.Tensor, w13: GroupQuantWeight, w2: GroupQuantWeight, k: int) -> bool:
    """True when the fused kernels cover this step (else the caller dequantizes)."""
    H = x.shape[1] if x.dim() == 2 else -1
    inter = w2.in_features
    return (
        on_gpu(x)
        and x.dim() == 2
        and x.dtype in (torch.float16, torch.float32)
        and w13.in_features == H
        and w2.out_features % H == 0
        and fused_pays(x.shape[0], k, w2.out_features // H)
        and w13.out_features == 2 * inter * (w2.out_features // H)
        and 1 <= k
        and _weight_ok(w13, x.dtype)
        and _weight_ok(w2, x.dtype)
    )


def launch_inputs(
    x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, inter: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """What both launches of a fused MoE decode (integer or FP4) read and write besides the
    weights: x with aligned rows, the fp32 routing weights, the int32 expert ids and the
    gate_up launch's [T * k, inter] output."""
    x = _aligned_rows(x)
    wts = topk_weights.float().contiguous()
    ids = topk_ids.to(torch.int32).contiguous()
    h = torch.empty((x.shape[0] * topk_ids.shape[1], inter), dtype=x.dtype, device=x.device)
    return x, wts, ids, h


def moe_quant_decode(
    x: torch.Tensor,  # [T, H]
    w13: GroupQuantWeight,  # flat [E * 2I, H]
    w2: GroupQuantWeight,  # flat [E * H, I]
    topk_weights: torch.Tensor,  # [T, k]
    topk_ids: torch.Tensor,  # [T, k]
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """The two launches on torch's current stream, for inputs `supports` accepted: [T, H]."""
    inter = w2.in_features
    x, wts, ids, h = launch_inputs(x, topk_weights, topk_ids, inter)
    T, H = x.shape
    k = topk_ids.shape[1]
    if out is None:
        out = torch.empty((T, H), dtype=x.dtype, device=x.device)
    stream = current_stream()
    launch(
        moe_qkernel(GATE_UP, w13.bits, is_split(w13), form_for(x.dtype, w13)),
        grid(GATE_UP, w13.bits, inter, T * k),
        32 * WARPS,
        (
            x,
            w13.qweight,
            w13.scales,
            w13.offsets,
            ids,
            h,
            w13.group_shift,
        ),
        stream,
    )
    launch(
        moe_qkernel(DOWN, w2.bits, is_split(w2), form_for(x.dtype, w2)),
        grid(DOWN, w2.bits, H, T),
        32 * WARPS,
        (
            h,
            w2.qweight,
            w2.scales,
            w2.offsets,
            ids,
            wts,
            out,
            w2.group_shift,
        ),
        stream,
    )
    return out


__all__ = [
    "MAX_TOKENS",
    "dequantized_experts_ref",
    "fused_pays",
    "flat_experts",
    "form_for",
    "grid",
    "launch_inputs",
    "moe_qkernel",
    "moe_quant_decode",
    "moe_quant_experts_ref",
    "supports",
]
