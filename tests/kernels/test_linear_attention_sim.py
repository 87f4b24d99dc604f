"""The Gated DeltaNet kernels (kernels/linear_attention/) in the CUDA simulator, each against
transformers' Qwen3-Next torch functions (the independent reference: torch_chunk_gated_delta_rule,
torch_recurrent_gated_delta_rule, causal_conv1d_update, Qwen3NextRMSNormGated, with g and beta
computed as Qwen3NextGatedDeltaNet.forward does) and against our `*_ref`. Outputs, scratch and
unused pool rows start as NaN, so a value the kernel fails to write, or a state row it reads
that it should not, shows. Shapes are tiny (the simulator runs every thread in Python) but
cover every branch: a sequence shorter than a chunk, several chunks, a length that is not a
multiple of the chunk, a zero and a non-zero initial state, a padding slot (-1), more value than
key heads, head dims that are not a multiple of the 32-column tiles and slices.

The launches are the production ones (`*_launches` builds the list the launchers run), with
tensors handed to the simulator as views of their own memory so in-place writes land. Plus the
host-side pieces: dispatch resolves every op, and the launchers' geometry at the real model
shapes (recorded on meta tensors, not run)."""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F
from transformers.models.qwen3_next import modeling_qwen3_next as hf
from voltserve.kernels import dispatch, registry
from voltserve.kernels.linear_attention import chunk, conv, gated_norm, recurrent, verify
from voltserve.kernels.runtime.launch_geometry import recording
from voltserve.kernels.runtime.numba_common import SIM, launch

sim_only = pytest.mark.skipif(not SIM, reason="needs the CUDA simulator (no GPU present)")
NAN = float("nan")
TOL = {torch.float32: dict(atol=2e-5, rtol=2e-5), torch.float16: dict(atol=2e-3, rtol=2e-3)}


def sim(a):
    """A simulator device array over a tensor's own memory (in-place writes must land)."""
    from numba.cuda.simulator.cudadrv.devicearray import FakeCUDAArray

    return FakeCUDAArray(a.numpy()) if isinstance(a, torch.Tensor) else a


def run(launches: list[tuple]) -> None:
    assert launches
    for kernel, grid, block, args in launches:
        launch(kernel, grid, block, tuple(sim(x) for x in args))


def generator(rng: random.Random) -> torch.Generator:
    seed = rng.randrange(1 << 31)
    print(f"torch seed {seed}")
    return torch.Generator().manual_seed(seed)


def hf_gates(a, b, A_log, dt_bias):
    """g and beta as Qwen3NextGatedDeltaNet.forward computes them."""
    return -A_log.float().exp() * F.softplus(a.float() + dt_bias), b.sigmoid()


def per_value_head(x: torch.Tensor, hv: int) -> torch.Tensor:
    """q or k repeated to the value heads (value head h reads key head h // (hv // hk)), as the
    model does before transformers' torch functions (some versions of them do not)."""
    return x.repeat_interleave(hv // x.shape[-2], dim=-2)


def varlen(lens: list[int]) -> torch.Tensor:
    cu = [0]
    for n in lens:
        cu.append(cu[-1] + n)
    return torch.tensor(cu, dtype=torch.int64)


# ---------------------------------------------------------------------------------------------
# conv1d


@sim_only
def test_conv1d_prefill(rng):
    gen = generator(rng)
    D, K = 40, 4  # one 256-channel tile, most of it idle
    lens = [2, 7, 4, 3]  # 2 < K - 1: part of the final state is the initial one
    slots = torch.tensor([3, 0, 1, -1], dtype=torch.int64)
    has_initial = torch.tensor([True, False, True, True])
    cu = varlen(lens)
    x = torch.randn(int(cu[-1]), D, generator=gen)
    weight = torch.randn(D, K, generator=gen)
    pool = torch.randn(5, D, K - 1, generator=gen)
    pool[0] = NAN  # a sequence without an initial state must never read its slot
    pool[2] = NAN  # a slot outside the batch stays as it is
    ref_pool = pool.clone()
    ref = conv.causal_conv1d_prefill_ref(x, weight, ref_pool, cu, slots, has_initial)

    out = torch.full_like(x, NAN)
    got_pool = pool.clone()
    run(conv.prefill_launches(x, weight, got_pool, cu, slots, has_initial, out))
    torch.testing.assert_close(out, ref, **TOL[torch.float32])
    torch.testing.assert_close(got_pool, ref_pool, equal_nan=True, **TOL[torch.float32])
    for i, slot in enumerate(slots.tolist()):
        s = slice(int(cu[i]), int(cu[i + 1]))
        if slot < 0:
            assert (out[s] == 0).all()
            continue
        state = pool[slot].clone() if has_initial[i] else torch.zeros(D, K - 1)
        want = hf.causal_conv1d_update(x[s].t()[None], state[None], weight, activation="silu")
        torch.testing.assert_close(out[s], want[0].t(), **TOL[torch.float32])
        torch.testing.assert_close(got_pool[slot], state, **TOL[torch.float32])
    assert got_pool[2].isnan().all()


@sim_only
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_conv1d_decode(rng, dtype):
    gen = generator(rng)
    D, K = 300, 4  # two channel tiles, the second partial
    slots = torch.tensor([2, -1, 0], dtype=torch.int64)
    x = torch.randn(3, D, generator=gen).to(dtype)
    weight = (0.5 * torch.randn(D, K, generator=gen)).to(dtype)
    pool = torch.randn(4, D, K - 1, generator=gen).to(dtype)
    pool[1] = NAN
    ref_pool = pool.clone()
    ref = conv.causal_conv1d_decode_ref(x, weight, ref_pool, slots)
    out = torch.full_like(x, NAN)
    got_pool = pool.clone()
    run(conv.decode_launches(x, weight, got_pool, slots, out))
    torch.testing.assert_close(out, ref, **TOL[dtype])
    torch.testing.assert_close(got_pool, ref_pool, equal_nan=True, atol=0, rtol=0)
    assert (out[1] == 0).all()
    live = torch.tensor([0, 2])
    state = pool[slots[live]].float()
    want = hf.causal_conv1d_update(x[live].float()[:, :, None], state, weight.float(), None, "silu")
    torch.testing.assert_close(out[live].float(), want[:, :, 0], **TOL[dtype])
    torch.testing.assert_close(got_pool[slots[live]].float(), state, atol=0, rtol=0)


# ---------------------------------------------------------------------------------------------
# gated delta rule


def gdn_inputs(gen, T, Hk, Hv, Dk, Dv, dtype):
    q = torch.randn(T, Hk, Dk, generator=gen).to(dtype)
    k = torch.randn(T, Hk, Dk, generator=gen).to(dtype)
    v = torch.randn(T, Hv, Dv, generator=gen).to(dtype)
    a = torch.randn(T, Hv, generator=gen).to(dtype)
    b = torch.randn(T, Hv, generator=gen).to(dtype)
    # A in (0.5, 4): decays from mild to strong, so chunks carry real state across
    A_log = (torch.rand(Hv, generator=gen) * 3.5 + 0.5).log()
    dt_bias = torch.randn(Hv, generator=gen)
    return q, k, v, a, b, A_log, dt_bias


@sim_only
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_recurrent_decode(rng, dtype):
    gen = generator(rng)
    # 2 value heads a key head; a partial second column tile; Dk 80 gives the kernel's warps
    # (32 state rows each) every case: all rows (the unguarded path), some, none
    Hk, Hv, Dk, Dv = 1, 2, 80, 40
    slots = torch.tensor([3, -1, 0], dtype=torch.int64)
    q, k, v, a, b, A_log, dt_bias = gdn_inputs(gen, 3, Hk, Hv, Dk, Dv, dtype)
    pool = 0.3 * torch.randn(4, Hv, Dk, Dv, generator=gen)
    pool[1] = NAN  # outside the batch
    ref_pool = pool.clone()
    ref = recurrent.gated_delta_rule_decode_ref(q, k, v, a, b, A_log, dt_bias, ref_pool, slots)
    out = torch.full_like(v, NAN)
    got_pool = pool.clone()
    run(recurrent.decode_launches(q, k, v, a, b, A_log, dt_bias, got_pool, slots, out))
    torch.testing.assert_close(out, ref, **TOL[dtype])
    torch.testing.assert_close(got_pool, ref_pool, equal_nan=True, **TOL[torch.float32])
    assert (out[1] == 0).all() and got_pool[1].isnan().all()

    live = torch.tensor([0, 2])
    g, beta = hf_gates(a[live], b[live], A_log, dt_bias)
    want, state = hf.torch_recurrent_gated_delta_rule(
        per_value_head(q[live, None], Hv), per_value_head(k[live, None], Hv), v[live, None],
        g[:, None], beta[:, None],
        initial_state=pool[slots[live]], output_final_state=True, use_qk_l2norm_in_kernel=True,
    )  # fmt: skip
    torch.testing.assert_close(out[live].float(), want[:, 0].float(), **TOL[dtype])
    torch.testing.assert_close(got_pool[slots[live]], state, **TOL[torch.float32])


@sim_only
def test_chunked_prefill(rng):
    gen = generator(rng)
    # Dk 48: two 32-wide slices, the second partial; Dv 40: two state-column tiles and two
    # value slices, both partial. Sequences: shorter than a chunk from a non-zero state; two
    # chunks (64 + 7) from zeros; a padding sequence.
    Hk, Hv, Dk, Dv = 1, 2, 48, 40
    lens = [10, 71, 3]
    slots = torch.tensor([2, 0, -1], dtype=torch.int64)
    has_initial = torch.tensor([True, False, True])
    cu = varlen(lens)
    T = int(cu[-1])
    q, k, v, a, b, A_log, dt_bias = gdn_inputs(gen, T, Hk, Hv, Dk, Dv, torch.float32)
    pool = 0.3 * torch.randn(4, Hv, Dk, Dv, generator=gen)
    pool[0] = NAN  # no initial state: never read
    pool[1] = NAN  # outside the batch
    ref_pool = pool.clone()
    ref = chunk.gated_delta_rule_prefill_ref(
        q, k, v, a, b, A_log, dt_bias, ref_pool, cu, slots, has_initial
    )
    out = torch.full_like(v, NAN)
    got_pool = pool.clone()
    scratch = tuple(t.fill_(NAN) for t in chunk.prefill_scratch(q, v))
    launches = chunk.prefill_launches(
        q, k, v, a, b, A_log, dt_bias, got_pool, cu, slots, has_initial, out, scratch
    )
    run(launches)
    tol = TOL[torch.float32]
    torch.testing.assert_close(out, ref, **tol)
    torch.testing.assert_close(got_pool, ref_pool, equal_nan=True, **tol)
    assert (out[cu[2] :] == 0).all() and got_pool[1].isnan().all()

    g, beta = hf_gates(a, b, A_log, dt_bias)
    for i in range(2):
        s = slice(int(cu[i]), int(cu[i + 1]))
        init = pool[slots[i]][None] if has_initial[i] else None
        want, state = hf.torch_chunk_gated_delta_rule(
            per_value_head(q[None, s], Hv), per_value_head(k[None, s], Hv), v[None, s],
            g[None, s], beta[None, s], initial_state=init, output_final_state=True,
            use_qk_l2norm_in_kernel=True,
        )  # fmt: skip
        torch.testing.assert_close(out[s], want[0], **tol)
        torch.testing.assert_close(got_pool[slots[i]], state[0], **tol)


# ---------------------------------------------------------------------------------------------
# verify walks (a speculative verify step's rows in order, snapshots of the state after each)

# Three sequences of Q = 4 rows: all live, two live, a padding sequence (module doc of verify.py).
# Pools of 4 request slots, then a snapshot area of 4 positions x 4 requests (rows 4..19, as a
# state cache lays it out: row 4 + 4 j + b).
VERIFY_SLOTS = [[2, 2, 2, 2], [0, 0, -1, -1], [-1, -1, -1, -1]]
VERIFY_LIVE = [4, 2, 0]
SLOTS, AREA = 4, 4


def verify_layout():
    row_slots = torch.tensor(VERIFY_SLOTS, dtype=torch.int64)
    B, Q = row_slots.shape
    j, b = torch.arange(Q - 1), torch.arange(B)
    snap_rows = SLOTS + j[None, :] * AREA + b[:, None]
    return row_slots, snap_rows, B, Q


def poisoned_rows(pool: torch.Tensor) -> torch.Tensor:
    """The request slots' pool followed by a NaN snapshot area."""
    area = torch.full((AREA * AREA, *pool.shape[1:]), NAN, dtype=pool.dtype)
    return torch.cat([pool, area])


def check_walk(got_rows, pool, snap_rows, window):
    """The state after each live row j of each sequence (window(b, j), independent of the code
    under test): in its snapshot row while a live row follows, else in its slot; every other
    row as it was (NaN past the written snapshots)."""
    written = set()
    for b, n in enumerate(VERIFY_LIVE):
        slot = VERIFY_SLOTS[b][0]
        for j in range(n):
            row = int(snap_rows[b, j]) if j + 1 < n else slot
            written.add(row)
            torch.testing.assert_close(got_rows[row].float(), window(b, j), **TOL[torch.float32])
    for row in range(got_rows.shape[0]):
        if row in written:
            continue
        if row < SLOTS:
            torch.testing.assert_close(got_rows[row], pool[row], equal_nan=True, atol=0, rtol=0)
        else:
            assert got_rows[row].isnan().all(), f"row {row} written"


@sim_only
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_conv1d_verify(rng, dtype):
    gen = generator(rng)
    D, K = 300, 4  # two channel tiles, the second partial
    row_slots, snap_rows, B, Q = verify_layout()
    x = torch.randn(B * Q, D, generator=gen).to(dtype)
    weight = (0.5 * torch.randn(D, K, generator=gen)).to(dtype)
    pool = torch.randn(SLOTS, D, K - 1, generator=gen).to(dtype)
    pool[1] = NAN  # outside the batch
    rows = poisoned_rows(pool)
    ref_rows = rows.clone()
    ref = verify.causal_conv1d_verify_ref(x, weight, ref_rows, row_slots, snap_rows)
    out = torch.full_like(x, NAN)
    got_rows = rows.clone()
    run(verify.conv_launches(x, weight, got_rows, row_slots, snap_rows, out))
    torch.testing.assert_close(out, ref, **TOL[dtype])
    torch.testing.assert_close(got_rows, ref_rows, equal_nan=True, atol=0, rtol=0)

    # Independently: transformers' conv update over each sequence's live rows; the window after
    # row j is the last K - 1 inputs.
    for b, n in enumerate(VERIFY_LIVE):
        assert (out[b * Q + n : (b + 1) * Q] == 0).all()
        if n == 0:
            continue
        live = slice(b * Q, b * Q + n)
        state = pool[VERIFY_SLOTS[b][0]].float()[None].clone()
        want = hf.causal_conv1d_update(
            x[live].float().t()[None], state, weight.float(), None, "silu"
        )
        torch.testing.assert_close(out[live].float(), want[0].t(), **TOL[dtype])

    def window(b, j):
        ext = torch.cat([pool[VERIFY_SLOTS[b][0]].float(), x[b * Q : b * Q + j + 1].float().t()], 1)
        return ext[:, -(K - 1) :]

    check_walk(got_rows, pool, snap_rows, window)


@sim_only
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_recurrent_verify(rng, dtype):
    gen = generator(rng)
    # As test_recurrent_decode: Dk 80 (a warp with every row, one with some, one with none), a
    # partial second column tile, 2 value heads a key head.
    Hk, Hv, Dk, Dv = 1, 2, 80, 40
    row_slots, snap_rows, B, Q = verify_layout()
    q, k, v, a, b, A_log, dt_bias = gdn_inputs(gen, B * Q, Hk, Hv, Dk, Dv, dtype)
    pool = 0.3 * torch.randn(SLOTS, Hv, Dk, Dv, generator=gen)
    pool[1] = NAN
    rows = poisoned_rows(pool)
    ref_rows = rows.clone()
    ref = verify.gated_delta_rule_verify_ref(
        q, k, v, a, b, A_log, dt_bias, ref_rows, row_slots, snap_rows
    )
    out = torch.full_like(v, NAN)
    got_rows = rows.clone()
    run(verify.gdn_launches(q, k, v, a, b, A_log, dt_bias, got_rows, row_slots, snap_rows, out))
    tol = TOL[torch.float32]
    torch.testing.assert_close(out, ref, **TOL[dtype])
    torch.testing.assert_close(got_rows, ref_rows, equal_nan=True, **tol)

    # Independently: transformers' recurrence over each prefix of a sequence's live rows gives
    # the output and the state after each row.
    g, beta = hf_gates(a, b, A_log, dt_bias)
    states = {}
    for s, n in enumerate(VERIFY_LIVE):
        assert (out[s * Q + n : (s + 1) * Q] == 0).all()
        for j in range(n):
            prefix = slice(s * Q, s * Q + j + 1)
            want, states[s, j] = hf.torch_recurrent_gated_delta_rule(
                per_value_head(q[None, prefix], Hv), per_value_head(k[None, prefix], Hv),
                v[None, prefix], g[None, prefix], beta[None, prefix],
                initial_state=pool[VERIFY_SLOTS[s][0]][None], output_final_state=True,
                use_qk_l2norm_in_kernel=True,
            )  # fmt: skip
            torch.testing.assert_close(out[s * Q + j].float(), want[0, j].float(), **TOL[dtype])
    check_walk(got_rows, pool, snap_rows, lambda s, j: states[s, j][0])


# ---------------------------------------------------------------------------------------------
# gated RMSNorm


@sim_only
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_gated_rms_norm(rng, dtype):
    gen = generator(rng)
    N, D, eps = 5, 40, 1e-6
    x = torch.randn(N, D, generator=gen).to(dtype)
    zz = torch.randn(N, 2 * D, generator=gen).to(dtype)
    z = zz[:, D:]  # a strided view, as the gate columns of a fused projection
    weight = (1 + 0.2 * torch.randn(D, generator=gen)).to(dtype)
    ref = gated_norm.gated_rms_norm_ref(x, z, weight, eps)
    out = torch.full_like(x, NAN)
    run(gated_norm.norm_launches(x, z, weight, eps, out))
    torch.testing.assert_close(out, ref, **TOL[dtype])
    mod = hf.Qwen3NextRMSNormGated(D, eps=eps).to(dtype)
    with torch.no_grad():
        mod.weight.copy_(weight)
        want = mod(x, z)
    torch.testing.assert_close(out, want, **TOL[dtype])


# ---------------------------------------------------------------------------------------------
# host side

OPS = (
    "causal_conv1d_prefill",
    "causal_conv1d_decode",
    "gated_delta_rule_prefill",
    "gated_delta_rule_decode",
    "causal_conv1d_verify",
    "gated_delta_rule_verify",
    "gated_rms_norm",
)


def test_dispatch_resolves_linear_attention_ops():
    d = dispatch.KernelDispatch("cpu")
    for op in OPS:
        families = registry.ops()[op].launchers
        assert d.impl[op] == "ref"
        assert getattr(d, op) is dispatch.reference(op)
        launchers = [getattr(dispatch._module(f), f"{op}_cuda", None) for f in families]
        assert launchers[0] is not None, f"{op}: no launcher in {families[0]}"


# Qwen3.5-27B: 16 key heads, 48 value heads, dims 128, conv kernel 4.
HK, HV, DK, DV, KW = 16, 48, 128, 128, 4
CONV_DIM = 2 * HK * DK + HV * DV


@pytest.mark.parametrize("batch", [1, 256])
def test_launch_geometry_at_model_shapes(batch):
    """Every launcher at the real shapes (decode batch 1 and 256; prefill 8 x 1024 and one
    sequence of 4096), recorded on meta tensors: the geometry passes the CUDA limits."""
    meta = dict(device="meta")
    f16 = dict(dtype=torch.float16, **meta)
    pool = torch.empty(batch + 1, HV, DK, DV, dtype=torch.float32, **meta)
    cpool = torch.empty(batch + 1, CONV_DIM, KW - 1, **f16)
    A_log = torch.empty(HV, dtype=torch.float32, **meta)
    slots = torch.empty(batch, dtype=torch.int64, **meta)
    seqs = 8 if batch > 1 else 1
    T = 8 * 1024 if batch > 1 else 4096
    with recording() as launches:
        recurrent.gated_delta_rule_decode_cuda(
            torch.empty(batch, HK, DK, **f16), torch.empty(batch, HK, DK, **f16),
            torch.empty(batch, HV, DV, **f16), torch.empty(batch, HV, **f16),
            torch.empty(batch, HV, **f16), A_log, A_log, pool, slots,
        )  # fmt: skip
        conv.causal_conv1d_decode_cuda(
            torch.empty(batch, CONV_DIM, **f16), torch.empty(CONV_DIM, KW, **f16), cpool, slots
        )
        cu = torch.empty(seqs + 1, dtype=torch.int64, **meta)
        pslots = torch.empty(seqs, dtype=torch.int64, **meta)
        has = torch.empty(seqs, dtype=torch.bool, **meta)
        conv.causal_conv1d_prefill_cuda(
            torch.empty(T, CONV_DIM, **f16), torch.empty(CONV_DIM, KW, **f16), cpool, cu,
            pslots, has,
        )  # fmt: skip
        chunk.gated_delta_rule_prefill_cuda(
            torch.empty(T, HK, DK, **f16), torch.empty(T, HK, DK, **f16),
            torch.empty(T, HV, DV, **f16), torch.empty(T, HV, **f16), torch.empty(T, HV, **f16),
            A_log, A_log, pool, cu, pslots, has,
        )  # fmt: skip
        gated_norm.gated_rms_norm_cuda(
            torch.empty(T * HV, DV, **f16), torch.empty(T * HV, DV, **f16),
            torch.empty(DV, **f16), 1e-6,
        )  # fmt: skip
        # A verify step of 4 sequences of 5 rows (k = 4), pools with a snapshot area.
        VB, VQ = 4, 5
        vrows = torch.empty(batch + 1 + VB * VQ, HV, DK, DV, dtype=torch.float32, **meta)
        vcrows = torch.empty(batch + 1 + VB * VQ, CONV_DIM, KW - 1, **f16)
        row_slots = torch.empty(VB, VQ, dtype=torch.int64, **meta)
        snap_rows = torch.empty(VB, VQ - 1, dtype=torch.int64, **meta)
        verify.causal_conv1d_verify_cuda(
            torch.empty(VB * VQ, CONV_DIM, **f16), torch.empty(CONV_DIM, KW, **f16), vcrows,
            row_slots, snap_rows,
        )  # fmt: skip
        verify.gated_delta_rule_verify_cuda(
            torch.empty(VB * VQ, HK, DK, **f16), torch.empty(VB * VQ, HK, DK, **f16),
            torch.empty(VB * VQ, HV, DV, **f16), torch.empty(VB * VQ, HV, **f16),
            torch.empty(VB * VQ, HV, **f16), A_log, A_log, vrows, row_slots, snap_rows,
        )  # fmt: skip
    names = [launch.kernel.split(".")[-1] for launch in launches]
    assert names == [
        "gdn_decode_kernel",
        "conv_decode_kernel",
        "conv_prefill_kernel",
        "conv_state_kernel",
        "gdn_chunk_prep_kernel",
        "gdn_chunk_scan_kernel",
        "gated_rms_norm_kernel",
        "conv_verify_kernel",
        "gdn_verify_kernel",
    ]
    decode = launches[0]
    assert decode.grid == (DV // recurrent.COLS, HV, batch) and decode.block == (128, 1, 1)
    prep, scan = launches[4], launches[5]
    assert prep.grid == (T // chunk.CHUNK + seqs, HV, 1)
    assert scan.grid == (DV // chunk.COLS, HV, seqs)
    cv, gv = launches[7], launches[8]
    assert cv.grid == (VB, -(-CONV_DIM // conv.THREADS), 1)
    assert gv.grid == (DV // recurrent.COLS, HV, VB) and gv.block == (128, 1, 1)
