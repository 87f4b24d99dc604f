"""The Gated DeltaNet launchers (kernels/linear_attention/) on a real GPU at the real shapes:
Qwen3.5-27B (16 key heads, 48 value heads) and Qwen3.5-35B-A3B / Qwen3-Next-80B (16 key, 32
value heads), head dims 128, conv kernel 4, fp16 storage, fp32 states. Each against our `*_ref`
(torch on the GPU) and transformers' Qwen3-Next torch functions: decode at batch 1, 64 and 256
(with padding rows, slot -1), prefill of one 4096-token sequence and of 8 x 1024 packed (half
of them from a non-zero state), the conv1d of both, the gated RMSNorm; and the decode ops
captured in a CUDA graph and replayed on new inputs.

Tolerances: outputs are fp16, computed in fp32 by both sides in different orders, so a few
fp16 ulps (atol = rtol = 4e-3 at |o| ~ 1); the fp32 states after 4096 tokens agree to 1e-3
absolute (entries ~ 0.1-1), decode states (one step) to 1e-4. The conv and the norm round
exactly as their references, up to one fp16 ulp (2e-3)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

DEV = "cuda"
SHAPES = {"qwen3.5-27b": (16, 48), "qwen3.5-35b-a3b": (16, 32)}  # (key heads, value heads)
DK = DV = 128
KW = 4
OUT_TOL = dict(atol=4e-3, rtol=4e-3)
STATE_TOL = dict(atol=1e-3, rtol=1e-3)
STEP_STATE_TOL = dict(atol=1e-4, rtol=1e-4)
F16_ULP = dict(atol=2e-3, rtol=2e-3)
NAN = float("nan")


def inputs(T, hk, hv, gen):
    r = dict(device=DEV, generator=gen)
    q = torch.randn(T, hk, DK, **r).half()
    k = torch.randn(T, hk, DK, **r).half()
    v = torch.randn(T, hv, DV, **r).half()
    a = torch.randn(T, hv, **r).half()
    b = torch.randn(T, hv, **r).half()
    A_log = (torch.rand(hv, **r) * 15 + 1).log()
    dt_bias = torch.randn(hv, **r)
    return q, k, v, a, b, A_log, dt_bias


def hf_gates(a, b, A_log, dt_bias):
    return -A_log.float().exp() * F.softplus(a.float() + dt_bias), b.sigmoid()


def per_value_head(x: torch.Tensor, hv: int) -> torch.Tensor:
    """q or k repeated to the value heads (value head h reads key head h // (hv // hk)), as the
    model does before transformers' torch functions (some versions of them do not)."""
    return x.repeat_interleave(hv // x.shape[-2], dim=-2)


@pytest.mark.parametrize("model", list(SHAPES))
@pytest.mark.parametrize("batch", [1, 64, 256])
def test_decode_matches_references(model, batch):
    from transformers.models.qwen3_next.modeling_qwen3_next import (
        torch_recurrent_gated_delta_rule,
    )
    from voltserve.kernels.linear_attention import recurrent

    hk, hv = SHAPES[model]
    gen = torch.Generator(device=DEV).manual_seed(batch)
    q, k, v, a, b, A_log, dt_bias = inputs(batch, hk, hv, gen)
    slots = torch.randperm(batch + 8, device=DEV, generator=gen)[:batch]
    if batch > 1:
        slots[1::7] = -1
    pool = 0.3 * torch.randn(batch + 8, hv, DK, DV, device=DEV, generator=gen)
    ref_pool = pool.clone()
    ref = recurrent.gated_delta_rule_decode_ref(q, k, v, a, b, A_log, dt_bias, ref_pool, slots)
    got_pool = pool.clone()
    out = recurrent.gated_delta_rule_decode_cuda(q, k, v, a, b, A_log, dt_bias, got_pool, slots)
    torch.testing.assert_close(out, ref, **OUT_TOL)
    torch.testing.assert_close(got_pool, ref_pool, **STEP_STATE_TOL)

    live = (slots >= 0).nonzero().flatten()
    g, beta = hf_gates(a[live], b[live], A_log, dt_bias)
    want, state = torch_recurrent_gated_delta_rule(
        per_value_head(q[live, None], hv), per_value_head(k[live, None], hv), v[live, None],
        g[:, None], beta[:, None],
        initial_state=pool[slots[live]], output_final_state=True, use_qk_l2norm_in_kernel=True,
    )  # fmt: skip
    torch.testing.assert_close(out[live], want[:, 0], **OUT_TOL)
    torch.testing.assert_close(got_pool[slots[live]], state, **STEP_STATE_TOL)
    assert (out[slots < 0] == 0).all()


@pytest.mark.parametrize("model", list(SHAPES))
@pytest.mark.parametrize("lens", [[4096], [1024] * 8], ids=["1x4096", "8x1024"])
def test_prefill_matches_references(model, lens):
    from transformers.models.qwen3_next.modeling_qwen3_next import torch_chunk_gated_delta_rule
    from voltserve.kernels.linear_attention import chunk

    hk, hv = SHAPES[model]
    gen = torch.Generator(device=DEV).manual_seed(len(lens))
    T, N = sum(lens), len(lens)
    q, k, v, a, b, A_log, dt_bias = inputs(T, hk, hv, gen)
    cu = torch.tensor([0] + lens, device=DEV).cumsum(0)
    slots = torch.arange(N, device=DEV, dtype=torch.int64) + 1
    has_initial = torch.arange(N, device=DEV) % 2 == 1  # 1x4096: from zeros
    pool = 0.3 * torch.randn(N + 2, hv, DK, DV, device=DEV, generator=gen)
    ref_pool = pool.clone()
    ref = chunk.gated_delta_rule_prefill_ref(
        q, k, v, a, b, A_log, dt_bias, ref_pool, cu, slots, has_initial
    )
    got_pool = pool.clone()
    out = chunk.gated_delta_rule_prefill_cuda(
        q, k, v, a, b, A_log, dt_bias, got_pool, cu, slots, has_initial
    )
    torch.testing.assert_close(out, ref, **OUT_TOL)
    torch.testing.assert_close(got_pool, ref_pool, **STATE_TOL)

    g, beta = hf_gates(a, b, A_log, dt_bias)
    for i in range(N):
        s = slice(int(cu[i]), int(cu[i + 1]))
        init = pool[slots[i]][None] if has_initial[i] else None
        want, state = torch_chunk_gated_delta_rule(
            per_value_head(q[None, s], hv), per_value_head(k[None, s], hv), v[None, s],
            g[None, s], beta[None, s], initial_state=init, output_final_state=True,
            use_qk_l2norm_in_kernel=True,
        )  # fmt: skip
        torch.testing.assert_close(out[s], want[0], **OUT_TOL)
        torch.testing.assert_close(got_pool[slots[i]], state[0], **STATE_TOL)


@pytest.mark.parametrize("lens", [[4096], [1024] * 8], ids=["1x4096", "8x1024"])
def test_conv1d_prefill_and_decode(lens):
    from voltserve.kernels.linear_attention import conv

    hk, hv = SHAPES["qwen3.5-27b"]
    D = 2 * hk * DK + hv * DV
    gen = torch.Generator(device=DEV).manual_seed(3)
    T, N = sum(lens), len(lens)
    x = torch.randn(T, D, device=DEV, generator=gen).half()
    weight = (0.5 * torch.randn(D, KW, device=DEV, generator=gen)).half()
    cu = torch.tensor([0] + lens, device=DEV).cumsum(0)
    slots = torch.arange(N, device=DEV, dtype=torch.int64)
    has_initial = torch.arange(N, device=DEV) % 2 == 1
    pool = torch.randn(N + 1, D, KW - 1, device=DEV, generator=gen).half()
    ref_pool, got_pool = pool.clone(), pool.clone()
    ref = conv.causal_conv1d_prefill_ref(x, weight, ref_pool, cu, slots, has_initial)
    out = conv.causal_conv1d_prefill_cuda(x, weight, got_pool, cu, slots, has_initial)
    torch.testing.assert_close(out, ref, **F16_ULP)
    torch.testing.assert_close(got_pool, ref_pool, atol=0, rtol=0)

    xd = torch.randn(N, D, device=DEV, generator=gen).half()
    ref = conv.causal_conv1d_decode_ref(xd, weight, ref_pool, slots)
    out = conv.causal_conv1d_decode_cuda(xd, weight, got_pool, slots)
    torch.testing.assert_close(out, ref, **F16_ULP)
    torch.testing.assert_close(got_pool, ref_pool, atol=0, rtol=0)


def test_gated_rms_norm_matches_transformers():
    from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextRMSNormGated
    from voltserve.kernels.linear_attention import gated_norm

    gen = torch.Generator(device=DEV).manual_seed(4)
    rows = 4096 * 48
    x = torch.randn(rows, DV, device=DEV, generator=gen).half()
    z = torch.randn(4096, 2 * 48 * DV, device=DEV, generator=gen).half()[:, 48 * DV :]
    z = z.reshape(rows, DV)  # rows of a strided view
    weight = (1 + 0.2 * torch.randn(DV, device=DEV, generator=gen)).half()
    out = gated_norm.gated_rms_norm_cuda(x, z, weight, 1e-6)
    torch.testing.assert_close(out, gated_norm.gated_rms_norm_ref(x, z, weight, 1e-6), **F16_ULP)
    mod = Qwen3NextRMSNormGated(DV, eps=1e-6).to(DEV).half()
    with torch.no_grad():
        mod.weight.copy_(weight)
        torch.testing.assert_close(out, mod(x, z), **F16_ULP)


def test_decode_ops_in_a_cuda_graph():
    """conv decode + recurrent decode captured once, replayed on new inputs and new slots:
    the same as eager calls on the same inputs (no host sync inside either launcher)."""
    from voltserve.kernels.linear_attention import conv, recurrent

    hk, hv = SHAPES["qwen3.5-27b"]
    D, B = 2 * hk * DK + hv * DV, 16
    gen = torch.Generator(device=DEV).manual_seed(5)
    weight = (0.5 * torch.randn(D, KW, device=DEV, generator=gen)).half()
    pool = 0.3 * torch.randn(B + 4, hv, DK, DV, device=DEV, generator=gen)
    cpool = torch.randn(B + 4, D, KW - 1, device=DEV, generator=gen).half()
    x = torch.empty(B, D, device=DEV, dtype=torch.float16)
    ab = torch.empty(B, 2, hv, device=DEV, dtype=torch.float16)
    slots = torch.empty(B, device=DEV, dtype=torch.int64)
    _, _, _, _, _, A_log, dt_bias = inputs(1, hk, hv, gen)

    def step():
        y = conv.causal_conv1d_decode_cuda(x, weight, cpool, slots)
        q, k, v = y.split([hk * DK, hk * DK, hv * DV], dim=1)
        return recurrent.gated_delta_rule_decode_cuda(
            q.view(B, hk, DK), k.view(B, hk, DK), v.view(B, hv, DV), ab[:, 0], ab[:, 1],
            A_log, dt_bias, pool, slots,
        )  # fmt: skip

    def fill():
        x.copy_(torch.randn(B, D, device=DEV, generator=gen))
        ab.copy_(torch.randn(B, 2, hv, device=DEV, generator=gen))
        s = torch.randperm(B + 4, device=DEV, generator=gen)[:B]
        s[::5] = -1
        slots.copy_(s)

    fill()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()  # compile outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    for _ in range(2):
        fill()
        pool0, cpool0 = pool.clone(), cpool.clone()
        graph.replay()
        torch.cuda.synchronize()
        got, got_pool, got_cpool = out.clone(), pool.clone(), cpool.clone()
        pool.copy_(pool0)
        cpool.copy_(cpool0)
        want = step()
        torch.testing.assert_close(got, want, atol=0, rtol=0)
        torch.testing.assert_close(got_pool, pool, atol=0, rtol=0)
        torch.testing.assert_close(got_cpool, cpool, atol=0, rtol=0)


@pytest.mark.parametrize("model", list(SHAPES))
def test_verify_ops_match_references(model):
    """A verify step of 4 sequences of k + 1 = 4 rows (live rows 4, 2, 1 and a padding
    sequence) over pools with a snapshot area, at the real shapes: outputs, slots and snapshot
    rows against the references (the decode references walked row by row)."""
    from voltserve.kernels.linear_attention import verify

    hk, hv = SHAPES[model]
    D, B, Q, slots_n = 2 * hk * DK + hv * DV, 4, 4, 8
    live = [4, 2, 1, 0]
    gen = torch.Generator(device=DEV).manual_seed(6)
    seq_slot = [5, 0, 3, 0]
    row_slots = torch.tensor(
        [[seq_slot[b] if j < live[b] else -1 for j in range(Q)] for b in range(B)], device=DEV
    )
    snap_rows = (
        slots_n + torch.arange(Q - 1, device=DEV)[None] * B + torch.arange(B, device=DEV)[:, None]
    )
    rows_n = slots_n + Q * B
    weight = (0.5 * torch.randn(D, KW, device=DEV, generator=gen)).half()
    crows = torch.randn(rows_n, D, KW - 1, device=DEV, generator=gen).half()
    srows = 0.3 * torch.randn(rows_n, hv, DK, DV, device=DEV, generator=gen)
    x = torch.randn(B * Q, D, device=DEV, generator=gen).half()
    ref_c, got_c = crows.clone(), crows.clone()
    ref_y = verify.causal_conv1d_verify_ref(x, weight, ref_c, row_slots, snap_rows)
    y = verify.causal_conv1d_verify_cuda(x, weight, got_c, row_slots, snap_rows)
    torch.testing.assert_close(y, ref_y, **F16_ULP)
    torch.testing.assert_close(got_c, ref_c, atol=0, rtol=0)

    q, k, v = (t.reshape(B * Q, -1, DK) for t in y.split([hk * DK, hk * DK, hv * DV], dim=1))
    _, _, _, a, b, A_log, dt_bias = inputs(B * Q, hk, hv, gen)
    ref_s, got_s = srows.clone(), srows.clone()
    ref_o = verify.gated_delta_rule_verify_ref(
        q, k, v, a, b, A_log, dt_bias, ref_s, row_slots, snap_rows
    )
    o = verify.gated_delta_rule_verify_cuda(
        q, k, v, a, b, A_log, dt_bias, got_s, row_slots, snap_rows
    )
    torch.testing.assert_close(o, ref_o, **OUT_TOL)
    torch.testing.assert_close(got_s, ref_s, **STEP_STATE_TOL)
    for s in range(B):
        assert (o[s * Q + live[s] : (s + 1) * Q] == 0).all()
