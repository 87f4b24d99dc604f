"""`voltserve check-kernels --cc 7.0` compiles every registered kernel for Volta without a GPU."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch
from voltserve.kernels import registry
from voltserve.kernels.runtime.check import check_ptx

# The cc 7.0 compile check is CI's job (CUDA 12 NVVM from pip, no GPU). GPU hosts here run the
# CUDA 13 toolkit of their image, which dropped Volta, so there the check cannot target 7.0.
pytestmark = pytest.mark.skipif(
    torch.cuda.is_available(), reason="cc 7.0 compile check runs in CI with the CUDA 12 NVVM"
)


@pytest.mark.xdist_group("cc70")
@pytest.mark.slow
@pytest.mark.timeout(2400)  # the shared compile of every kernel runs in this test's setup
def test_check_kernels_cc70_compiles_every_registered_kernel(cc70_check):
    assert cc70_check.returncode == 0, cc70_check.stdout + cc70_check.stderr
    ok_lines = [line for line in cc70_check.stdout.splitlines() if line.startswith("ok ")]
    for spec in registry.kernels():
        for sig in spec.signatures:
            assert any(spec.name in line and sig in line for line in ok_lines), (spec.name, sig)
            r = cc70_check.result(spec.name, sig)
            assert r["error"] is None and r["ptx_bytes"] > 0, r
            check_ptx(cc70_check.ptx(spec.name, sig), (7, 0))  # what was compiled is sm_70
    n = sum(len(s.signatures) for s in registry.kernels())
    assert f"{n}/{n} kernel signatures compiled for sm_70" in cc70_check.stdout
    assert len(cc70_check.results) == n


def test_check_kernels_reports_a_failing_kernel(tmp_path):
    """A signature that does not compile fails the check and is named (the exit status is what
    CI trusts). One small kernel, so this costs a few seconds."""
    code = textwrap.dedent(
        """
        from voltserve.kernels.runtime import check
        from voltserve.kernels import registry
        spec = registry.KernelSpec(
            "elementwise.activation", "silu_and_mul_kernel", ("void(float16[:, ::1])",)
        )
        registry.kernels = lambda: [spec]
        check.main(["--cc", "7.0", "--no-ptxas", "--jobs", "1"])
        """
    )
    env = dict(os.environ)
    env.pop("NUMBA_ENABLE_CUDASIM", None)
    proc = subprocess.run(
        [sys.executable, "-P", "-c", code], capture_output=True, text=True, env=env, timeout=300
    )
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "FAIL elementwise.activation.silu_and_mul_kernel" in proc.stdout
    assert "0/1 kernel signatures compiled" in proc.stdout
    assert "FAILED: elementwise.activation.silu_and_mul_kernel" in proc.stderr


def test_check_ptx_rejects_non_volta_ptx():
    good = ".version 8.8\n.target sm_70\n.address_size 64\nadd.f32 %f1, %f2, %f3;\n"
    check_ptx(good, (7, 0))
    with pytest.raises(RuntimeError, match="sm_80"):
        check_ptx(good.replace("sm_70", "sm_80"), (7, 0))
    with pytest.raises(RuntimeError, match="bf16"):
        check_ptx(good + "cvt.rn.bf16.f32 %rs1, %f1;\n", (7, 0))
    with pytest.raises(RuntimeError, match="cp.async"):
        check_ptx(good + "cp.async.ca.shared.global [%r1], [%rd1], 16;\n", (7, 0))
