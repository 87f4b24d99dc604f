"""The decode linear plan (services/executor/linear_plan.py) on the CPU: row buckets, explicit
plans and their lookups, the VOLTSERVE_GEMV switch, which weights a model has, and that every plan
routes linear() and the MLP to the implementation it names while the model's output stays that
of the plain torch path. Timing is CUDA-only (tests/gpu/test_linear_plan_gpu.py)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from voltserve.kernels.dispatch import KernelDispatch
from voltserve.kernels.elementwise.activation import silu_and_mul_ref
from voltserve.services.executor import linear_plan as lp
from voltserve.services.executor.linear_plan import LinearPlan, plan_linears, row_bucket
from voltserve.services.executor.models.layers import (
    AttentionMetadata,
    Linear,
    gate_up_silu,
    linear,
)

from tests.checkpoints import checkpoint


def test_row_buckets_follow_kernel_variants_and_graph_sizes():
    from voltserve.kernels.linear.gemv import VARIANTS
    from voltserve.services.executor.cuda_graphs import graph_batch_sizes

    assert lp.ROW_BUCKETS == VARIANTS
    assert tuple(graph_batch_sizes(64)[:4]) == lp.ROW_BUCKETS
    want = {1: 1, 2: 2, 3: 4, 4: 4, 5: 8, 6: 8, 7: 8, 8: 8}
    assert {r: row_bucket(r) for r in range(1, 9)} == want
    assert row_bucket(0) is None and row_bucket(9) is None and row_bucket(512) is None


def test_explicit_plan_lookups():
    plan = LinearPlan(
        choices={
            ("linear", 48, 32, 1): "gemv",
            ("linear", 48, 32, 2): "cublas",
            ("linear", 48, 32, 8): "cublas",
            ("gate_up", 64, 32, 1): "gemv_gate_up",
            ("gate_up", 64, 32, 4): "gemv",
            ("gate_up", 64, 32, 8): "cublas",
        },
        default_linear="cublas",
        default_gate_up="cublas",
    )
    assert plan.linear_impl(1, 48, 32) == "gemv"
    assert plan.linear_impl(2, 48, 32) == "cublas"
    assert plan.linear_impl(3, 48, 32) == "cublas"  # bucket 4: not listed -> default
    assert [plan.linear_impl(r, 48, 32) for r in (5, 6, 7, 8)] == ["cublas"] * 4
    assert plan.linear_impl(1, 48, 40) == "cublas"  # another shape -> default
    assert plan.gate_up_impl(1, 64, 32) == "gemv_gate_up"
    assert plan.gate_up_impl(3, 64, 32) == "gemv"
    assert plan.gate_up_impl(7, 64, 32) == "cublas"
    # Past 8 rows cuBLAS whatever the plan says.
    gemv_all = LinearPlan.fixed(gemv=True)
    assert gemv_all.linear_impl(8, 1, 1) == "gemv"
    assert gemv_all.gate_up_impl(8, 1, 1) == "gemv_gate_up"
    assert gemv_all.linear_impl(9, 1, 1) == "cublas" and gemv_all.gate_up_impl(9, 1, 1) == "cublas"
    blas = LinearPlan.fixed(gemv=False)
    assert blas.linear_impl(1, 1, 1) == "cublas" and blas.gate_up_impl(1, 1, 1) == "cublas"
    with pytest.raises(ValueError, match="gemv_gate_up"):
        LinearPlan(choices={("linear", 4, 4, 1): "gemv_gate_up"})
    with pytest.raises(ValueError, match="default_gate_up"):
        LinearPlan(default_gate_up="fast")


def test_lookup_without_plan_is_the_fixed_rule():
    ops = KernelDispatch("cpu", torch.float32)
    assert ops.linear_plan is None
    assert [lp.linear_impl(ops, r, 8, 8) for r in (0, 1, 8, 9)] == [
        "cublas",
        "gemv",
        "gemv",
        "cublas",
    ]
    # No plan: the MLP stays unfused (the fixed rule, then silu_and_mul).
    assert lp.gate_up_impl(ops, 1, 8, 8) == "gemv" and lp.gate_up_impl(ops, 9, 8, 8) == "cublas"


def test_env_switch(monkeypatch):
    model = torch.nn.Linear(4, 4)
    assert plan_linears(model, KernelDispatch("cpu")) is None  # CPU: no plan, whatever the env
    for value, gemv in (("0", False), ("off", False), ("1", True), ("yes", True)):
        monkeypatch.setenv("VOLTSERVE_GEMV", value)
        ops = KernelDispatch("cuda")  # resolving touches no device
        plan = plan_linears(model, ops)  # fixed: no timing (none could run here)
        assert plan == LinearPlan.fixed(gemv=gemv)
        assert plan.linear_impl(8, 4, 4) == ("gemv" if gemv else "cublas")
        assert plan.gate_up_impl(1, 4, 4) == ("gemv_gate_up" if gemv else "cublas")
        assert not plan.times_us
        assert ops.impl["gemv"] == ("cuda" if gemv else "ref")
    # Unset: the rule (GEMV up to 2 rows, gate_up fused with its activation), no timing.
    monkeypatch.delenv("VOLTSERVE_GEMV")
    plan = plan_linears(model, KernelDispatch("cuda"))
    assert plan == LinearPlan.rule() and not plan.times_us
    assert [plan.linear_impl(r, 4, 4) for r in (1, 2, 3, 4, 8, 9)] == ["gemv"] * 2 + ["cublas"] * 4
    assert [plan.gate_up_impl(r, 4, 4) for r in (1, 2, 4)] == ["gemv_gate_up"] * 2 + ["cublas"]
    # The measured exception: a wide weight with a short K (Qwen2.5-0.5B's lm_head) on cuBLAS;
    # Llama-3-8B's lm_head (K = 4096) and Qwen's own narrow 896-wide linears stay on the GEMV.
    assert plan.linear_impl(1, 151936, 896) == "cublas"
    assert plan.linear_impl(1, 128256, 4096) == "gemv"
    assert plan.linear_impl(1, 1152, 896) == "gemv"
    assert plan.gate_up_impl(1, 9728, 896) == "gemv_gate_up"
    explicit = LinearPlan(choices={("linear", 151936, 896, 1): "gemv"}, wide_n=32768, short_k=1024)
    assert explicit.linear_impl(1, 151936, 896) == "gemv"  # a measured choice wins


def test_measuring_refuses_to_run_inside_a_capture(monkeypatch):
    # The check comes before any CUDA work, so it can be seen on the CPU.
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    with pytest.raises(RuntimeError, match="before CUDA graph capture"):
        lp.measure_linear_plan(torch.nn.Linear(4, 4), KernelDispatch("cuda"))


def _spy(ops: KernelDispatch, names: tuple[str, ...]) -> list[str]:
    """Record which ops run (wrapping the real ones)."""
    calls: list[str] = []
    for name in names:
        fn = getattr(ops, name)

        def wrapped(*a, _fn=fn, _name=name, **kw):
            calls.append(_name)
            return _fn(*a, **kw)

        setattr(ops, name, wrapped)
    return calls


def test_linear_and_mlp_follow_the_plan():
    ops = KernelDispatch("cpu", torch.float32)
    calls = _spy(ops, ("gemv", "gemv_gate_up", "silu_and_mul"))
    K, N, inter = 32, 24, 40
    w, b = torch.randn(N, K), torch.randn(N)
    gate_up = Linear(K, {0: inter, 1: inter}, True, torch.float32)
    gate_up.weight.data.normal_()
    gate_up.bias.data.normal_()
    ops.linear_plan = LinearPlan(
        choices={
            ("linear", N, K, 1): "gemv",
            ("linear", N, K, 4): "cublas",
            ("gate_up", 2 * inter, K, 1): "gemv_gate_up",
            ("gate_up", 2 * inter, K, 2): "gemv",
            ("gate_up", 2 * inter, K, 4): "cublas",
        },
        default_linear="cublas",
        default_gate_up="cublas",
    )
    for rows, want in ((1, ["gemv"]), (3, []), (8, []), (12, [])):
        calls.clear()
        x = torch.randn(rows, K)
        torch.testing.assert_close(linear(x, w, b, ops), F.linear(x, w, b))
        assert calls == want, rows
    for rows, want in (
        (1, ["gemv_gate_up"]),
        (2, ["gemv", "silu_and_mul"]),
        (4, ["silu_and_mul"]),
        (6, ["silu_and_mul"]),  # bucket 8: default cuBLAS
        (20, ["silu_and_mul"]),
    ):
        calls.clear()
        x = torch.randn(rows, K)
        want_h = silu_and_mul_ref(F.linear(x, gate_up.weight, gate_up.bias))
        torch.testing.assert_close(gate_up_silu(x, gate_up, ops), want_h)
        assert calls == want, rows


def _decode_logits(model, ops: KernelDispatch, B: int, L: int, seed: int) -> torch.Tensor:
    """Prefill B sequences of L tokens, then one decode step of B rows; its logits."""
    arch = model.arch
    g = torch.Generator().manual_seed(seed)
    bs = 16
    kv = [
        (
            torch.zeros(B + 1, arch.num_kv_heads, bs, arch.head_dim),
            torch.zeros(B + 1, arch.num_kv_heads, bs, arch.head_dim),
        )
        for _ in range(arch.num_layers)
    ]
    ids = torch.randint(0, arch.vocab_size, (B, L + 1), generator=g)
    tables = torch.arange(B, dtype=torch.int32).view(B, 1)
    pre = AttentionMetadata(
        slot_mapping=(torch.arange(B).repeat_interleave(L) * bs + torch.arange(L).repeat(B)),
        block_tables=tables,
        seq_lens=torch.full((B,), L, dtype=torch.int32),
        query_start_loc=torch.arange(B + 1, dtype=torch.int32) * L,
        is_decode=False,
        max_query_len=L,
    )
    model.ops = ops
    model(ids[:, :L].reshape(-1), torch.arange(L).repeat(B), pre, kv)
    dec = AttentionMetadata(
        slot_mapping=torch.arange(B) * bs + L,
        block_tables=tables,
        seq_lens=torch.full((B,), L + 1, dtype=torch.int32),
        query_start_loc=torch.arange(B + 1, dtype=torch.int32),
        is_decode=True,
    )
    return model(ids[:, L], torch.full((B,), L), dec, kv)


def test_model_weights_and_plans_keep_the_output():
    from voltserve.services.executor.loader import load_model

    model = load_model(checkpoint("llama"), torch.float32, torch.device("cpu")).model
    a = model.arch
    weights = lp.model_linear_weights(model)
    q, kv = a.num_heads * a.head_dim, a.num_kv_heads * a.head_dim
    inter, H = a.intermediate_size, a.hidden_size
    assert set(weights) == {
        ("linear", q + 2 * kv, H),
        ("linear", H, q),
        ("gate_up", 2 * inter, H),
        ("linear", H, inter),
        ("linear", a.vocab_size, H),
    }
    assert [len(v) for v in weights.values()].count(a.num_layers) == 4  # per layer, + lm_head
    assert weights[("gate_up", 2 * inter, H)][0][0] is model.model.layers[0].mlp.gate_up_proj.weight

    ops = KernelDispatch("cpu", torch.float32)
    calls = _spy(ops, ("gemv", "gemv_gate_up", "gemv_qkv_rope"))
    ref = _decode_logits(model, ops, 3, 5, seed=1)  # no plan: the fixed rule
    mixed = LinearPlan(
        choices={("linear", q + 2 * kv, H, 4): "cublas", ("gate_up", 2 * inter, H, 4): "gemv"},
        default_linear="gemv",
        default_gate_up="gemv_gate_up",
    )
    n = a.num_layers
    # (plan, gemv, gemv_gate_up, gemv_qkv_rope launches) in the decode step (the prefill has 15
    # rows: all cuBLAS).
    cases = [
        (LinearPlan.fixed(True), 2 * n + 1, n, n),  # o, down per layer + lm_head; gate_up; qkv
        (LinearPlan.fixed(False), 0, 0, 0),
        (mixed, 3 * n + 1, 0, 0),  # qkv on cuBLAS (unfused); gate_up unfused on gemv
    ]
    for plan, n_gemv, n_gate_up, n_qkv in cases:
        calls.clear()
        ops.linear_plan = plan
        out = _decode_logits(model, ops, 3, 5, seed=1)
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
        counts = tuple(calls.count(k) for k in ("gemv", "gemv_gate_up", "gemv_qkv_rope"))
        assert counts == (n_gemv, n_gate_up, n_qkv)
