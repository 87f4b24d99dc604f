"""The measured decode linear plan on a real GPU: it times every shape and row bucket of
Llama-3-8B-shaped layers in about a second and picks one implementation for each; with the plan
(measured, or fixed by VOLTSERVE_GEMV) the model's decode output is the reference path's, eagerly
and through the runner's CUDA graphs. Skipped without CUDA."""

from __future__ import annotations

import math
import random
import time

import pytest
import torch
from voltserve.kernels.dispatch import KernelDispatch
from voltserve.services.executor import linear_plan as lp
from voltserve.services.executor.linear_plan import LinearPlan, measure_linear_plan

from tests.checkpoints import checkpoint, drive, tokenizer

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

DEV = torch.device("cuda")


def _llama8b_two_layers():
    from voltserve.services.executor.models.llama import LlamaForCausalLM, ModelArch

    arch = ModelArch(
        architecture="LlamaForCausalLM",
        vocab_size=128256,
        hidden_size=4096,
        intermediate_size=14336,
        num_layers=2,
        num_heads=32,
        num_kv_heads=8,
        head_dim=128,
        rms_norm_eps=1e-5,
        max_position_embeddings=256,
        rope_theta=500000.0,
    )
    with torch.device(DEV):
        model = LlamaForCausalLM(arch, torch.float16)
    for p in model.parameters():
        p.data.normal_(0, 0.02)
    return model


def test_measured_plan_covers_every_shape_and_bucket():
    model = _llama8b_two_layers()
    ops = KernelDispatch(DEV, torch.float16, graph_torch_fallback=True)
    t0 = time.perf_counter()
    plan = measure_linear_plan(model, ops)
    first = time.perf_counter() - t0  # includes compiling the numba kernels
    t0 = time.perf_counter()
    measure_linear_plan(model, ops)
    again = time.perf_counter() - t0  # the timing alone
    print(f"\nplan in {first:.2f} s (timing alone {again:.2f} s): {plan.table()}")
    shapes = lp.model_linear_weights(model)
    assert len(shapes) == 5
    for kind, n, k in shapes:
        for b in lp.ROW_BUCKETS:
            key = (kind, n, k, b)
            ts = plan.times_us[key]
            assert plan.choices[key] == min(ts, key=ts.__getitem__)
            assert {"gemv", "cublas"} <= set(ts) and set(ts) <= set(lp._CHOICES[kind])
            assert all(math.isfinite(t) and 0 < t < 5000 for t in ts.values()), ts
            # Lookups of every row count land on the bucket's choice.
            for rows in range(1, 9):
                if lp.row_bucket(rows) == b:
                    impl = plan.linear_impl if kind == "linear" else plan.gate_up_impl
                    assert impl(rows, n, k) == plan.choices[key]
    assert again < 3.0, f"timing the plan took {again:.2f} s"


def _decode_logits(model, ops, B: int, L: int, seed: int) -> torch.Tensor:
    """Prefill B sequences of L tokens (cuBLAS: > 8 rows), then one decode step of B rows."""
    from voltserve.services.executor.models.layers import AttentionMetadata

    arch = model.arch
    g = torch.Generator().manual_seed(seed)
    bs = 16
    shape = (B + 1, arch.num_kv_heads, bs, arch.head_dim)
    dt = model.model.embed_tokens.weight.dtype
    kv = [
        (torch.zeros(shape, device=DEV, dtype=dt), torch.zeros(shape, device=DEV, dtype=dt))
        for _ in range(arch.num_layers)
    ]
    ids = torch.randint(0, arch.vocab_size, (B, L + 1), generator=g).to(DEV)
    tables = torch.arange(B, dtype=torch.int32, device=DEV).view(B, 1)
    ar = torch.arange(B, device=DEV)
    pre = AttentionMetadata(
        slot_mapping=ar.repeat_interleave(L) * bs + torch.arange(L, device=DEV).repeat(B),
        block_tables=tables,
        seq_lens=torch.full((B,), L, dtype=torch.int32, device=DEV),
        query_start_loc=torch.arange(B + 1, dtype=torch.int32, device=DEV) * L,
        is_decode=False,
        max_query_len=L,
    )
    model.ops = ops
    model(ids[:, :L].reshape(-1), torch.arange(L, device=DEV).repeat(B), pre, kv)
    dec = AttentionMetadata(
        slot_mapping=ar * bs + L,
        block_tables=tables,
        seq_lens=torch.full((B,), L + 1, dtype=torch.int32, device=DEV),
        query_start_loc=torch.arange(B + 1, dtype=torch.int32, device=DEV),
        is_decode=True,
    )
    out = model(ids[:, L], torch.full((B,), L, device=DEV), dec, kv)
    torch.cuda.synchronize()
    return out


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_decode_output_with_plans_equals_reference(dtype):
    from voltserve.services.executor.loader import load_model

    model = load_model(checkpoint("llama"), dtype, DEV).model
    ref_ops = KernelDispatch(DEV, dtype, force_ref=True)  # torch everywhere (cuBLAS linears)
    ops = KernelDispatch(DEV, dtype)
    measured = measure_linear_plan(model, ops)
    tol = dict(atol=3e-2, rtol=3e-2) if dtype == torch.float16 else dict(atol=1e-4, rtol=1e-4)
    for B in (1, 2, 3, 4, 8):
        ref = _decode_logits(model, ref_ops, B, 5, seed=B)
        for plan in (measured, LinearPlan.fixed(True), LinearPlan.fixed(False)):
            ops.linear_plan = plan
            out = _decode_logits(model, ops, B, 5, seed=B)
            torch.testing.assert_close(out, ref, **tol)


def _requests(seed: int, n: int):
    from voltserve.services.executor.request import Request
    from voltserve.shared.sampling_params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=10, logprobs=1, ignore_eos=True)
    rng = random.Random(seed)
    V = len(tokenizer())
    return [
        Request(
            f"r{i}",
            [rng.randrange(V) for _ in range(rng.randint(1, 40))],
            params,
            seed=i,
            arrival_time=0.0,
        )
        for i in range(n)
    ]


def test_runner_graph_decode_with_plans_equals_cublas(monkeypatch):
    """fp32 (so greedy ties cannot flip): runners with the default rule, the measured plan and
    everything on the GEMV kernels produce cuBLAS's tokens through their decode graphs (batches 5 -> 8, ..., 1)."""
    from voltserve.services.executor.model_runner import ModelRunner
    from voltserve.shared.config import EngineConfig

    def run(env: str | None):
        if env is None:
            monkeypatch.delenv("VOLTSERVE_GEMV", raising=False)
        else:
            monkeypatch.setenv("VOLTSERVE_GEMV", env)
        cfg = EngineConfig(
            model=str(checkpoint("llama")),
            dtype="float32",
            device="cuda",
            num_kv_blocks=128,
            max_model_len=256,
            max_graph_batch_size=16,
        )
        runner = ModelRunner(cfg)
        assert runner.graphs is not None, runner.ops.impl
        assert isinstance(runner.ops.linear_plan, LinearPlan)
        reqs = _requests(3, 5)
        drive(runner, reqs, 10, chunk=32)
        return runner, reqs

    blas, want = run("0")
    assert blas.ops.linear_plan == LinearPlan.fixed(False)
    for env in (None, "measure", "1"):
        runner, got = run(env)
        if env is None:
            assert runner.ops.linear_plan == LinearPlan.rule()  # the default: no timing
        if env == "measure":
            assert runner.ops.linear_plan.times_us  # measured
        for a, b in zip(got, want, strict=True):
            assert a.output_token_ids == b.output_token_ids
            for ta, tb in zip(a.trace, b.trace, strict=True):
                assert abs(ta.logprob - tb.logprob) < 1e-4
