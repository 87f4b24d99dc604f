"""The quantized tensor-core GEMM (kernels/linear/quant_gemm_tc.py) as
`voltserve check-kernels --cc 7.0` compiled it: the wmma intrinsics of
kernels/runtime/wmma_inline.py are in the kernel's own PTX (shared memory forms, no linked C call),
and every registered tile config fits Volta without spills and in the registers its block size
leaves (65536 an SM: 128 a thread at 512 threads)."""

from __future__ import annotations

import pytest
import torch
from voltserve.kernels import registry
from voltserve.kernels.linear import quant_gemm_tc as tc

pytestmark = pytest.mark.skipif(
    torch.cuda.is_available(), reason="cc 7.0 compile check runs in CI with the CUDA 12 NVVM"
)

# registered instance -> its tile config and code width
INSTANCES = {
    "qgemm_int4_m16": (tc.CONFIGS[16], 4),
    "qgemm_int4_m64": (tc.CONFIGS[64], 4),
    "qgemm_int8_m32": (tc.CONFIGS[32], 8),
    "qgemm_int4_m128": (tc.CONFIGS[128], 4),
    "qgemm_int8_m128": (tc.CONFIGS[128], 8),
}


def check_instance(run, spec, sig, cfg) -> None:
    ptx = run.ptx(spec.name, sig)
    for op in (
        "wmma.load.a.sync.aligned.row.m16n16k16.shared.f16",
        "wmma.load.b.sync.aligned.col.m16n16k16.shared.f16",
        "wmma.mma.sync.aligned.row.col.m16n16k16.f32.f32",
        "wmma.store.d.sync.aligned.row.m16n16k16.shared.f32",
    ):
        assert op in ptx, (spec.name, op)
    assert "call.uni" not in ptx, spec.name  # no C call a K step
    r = run.result(spec.name, sig)
    assert r["error"] is None, r
    assert r["spill_bytes"] == 0, r
    assert 0 < r["registers"] <= min(255, 65536 // cfg.threads), (r, cfg)
    assert r["shared_bytes"] <= 48 * 1024, r


@pytest.mark.xdist_group("cc70")
@pytest.mark.slow
@pytest.mark.timeout(2400)  # the shared compile of every kernel runs in this test's setup
def test_qgemm_instances_compile_inline_wmma_for_volta(cc70_check):
    specs = [
        k for k in registry.kernels() if k.module == "linear.quant_gemm_tc" and k.attr in INSTANCES
    ]
    assert {k.attr for k in specs} == set(INSTANCES)
    for spec in specs:
        cfg, bits = INSTANCES[spec.attr]
        assert getattr(tc, spec.attr) is tc.qgemm_kernel(cfg, bits)
        for sig in spec.signatures:
            check_instance(cc70_check, spec, sig, cfg)
