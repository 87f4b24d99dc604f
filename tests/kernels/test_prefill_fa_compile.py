"""The flash prefill (kernels/attention/prefill_fa.cu + attention/prefill_fa.py) compiles for
Volta without a GPU.

1. The .cu alone: NVRTC (CUDA 12 from pip) to PTX for compute_70, Volta's wmma instructions in
   their shared-memory forms, nothing Volta lacks, the three entry points defined. Under a
   second.
2. What runs: numba-cuda links kernels with LTO when nvJitLink is present, and the flash kernel
   asks for it, so the C function is inlined into the numba kernel. Here the numba kernel (LTO
   IR, compiled in a fresh process: the test session may be in the CUDA simulator) and the .cu
   (NVRTC -dlto) go through nvJitLink -lto for sm_70 with the kernel's launch bounds. Stated on
   sm_70 with the CUDA 12.9 pip toolchain: 242 registers at head dim 128 (2 blocks of 128
   threads per SM), 161 at 64 (3 blocks per SM), 226 at 256 (1 block of 256 threads per SM),
   no spills, no stack frame (so no ABI call left), 44,032, 27,648 and 48,128 bytes of static
   shared memory; row-tile (named) barriers only at 256. A few seconds.
3. Each head dim's kernel linked as `voltserve check-kernels --cc 7.0` links it (without LTO,
   PTX to cubin through nvJitLink): the extern prototypes numba emits match the C++ ones. Both
   the instances the check compiled (the shared session-wide run) and, in the subprocess of 2,
   every head dim through the check's own compile_one.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from voltserve.kernels.attention.prefill_fa import (
    FA_CU,
    HEAD_DIMS,
    MIN_BLOCKS,
    SPLIT,
    num_threads,
    smem_bytes,
)
from voltserve.kernels.runtime.check import check_ptx, compile_cu_ptx

# As the other cc 7.0 compile checks: GPU hosts here run a CUDA 13 toolkit, which dropped Volta.
pytestmark = pytest.mark.skipif(
    torch.cuda.is_available(), reason="cc 7.0 compile check runs in CI with the CUDA 12 NVVM"
)

# Upper bounds on the LTO-linked kernel's registers: 2 (head dim 128) and 3 (64) blocks of 128
# threads per SM, 1 block of 256 (256), under ptxas's own limit; measured 242, 161 and 226
# (module docstring).
MAX_REGISTERS = {128: 248, 64: 168, 256: 232}


def test_fa_cu_compiles_for_volta():
    ptx = compile_cu_ptx(FA_CU, (7, 0))
    check_ptx(ptx, (7, 0))
    for op in (
        "wmma.load.a.sync.aligned.row.m16n16k16.shared.f16",
        "wmma.load.b.sync.aligned.col.m16n16k16.shared.f16",
        "wmma.load.b.sync.aligned.row.m16n16k16.shared.f16",
        "wmma.load.c.sync.aligned.row.m16n16k16.shared.f32",
        "wmma.store.d.sync.aligned.row.m16n16k16.shared.f32",
        "wmma.mma.sync.aligned.row.col.m16n16k16.f32.f32",
        "wmma.mma.sync.aligned.row.row.m16n16k16.f32.f32",
        "ex2.approx.ftz.f32",
    ):
        assert op in ptx, op
    for d in HEAD_DIMS:
        assert f".visible .func  (.param .b32 func_retval0) vs_fa_prefill_d{d}(" in ptx, d
    assert ".global" not in ptx.split(".visible", 1)[0], "no global variables from the .cu"


_LTO_SCRIPT = textwrap.dedent(
    """
    import json, re
    from voltserve.kernels.runtime.check import Task, _init_worker, compile_one
    _init_worker((7, 0))
    from cuda.bindings import nvjitlink, nvrtc
    from numba import cuda
    from voltserve.kernels.attention import prefill_fa as fa
    from voltserve.kernels.attention import _PREFILL_FA_SIG

    def cu_ltoir(path):
        err, prog = nvrtc.nvrtcCreateProgram(open(path, "rb").read(), b"fa.cu", 0, [], [])
        opts = [b"--gpu-architecture=compute_70", b"-rdc=true", b"-dlto", b"-std=c++17"]
        err = nvrtc.nvrtcCompileProgram(prog, len(opts), opts)[0]
        assert err == nvrtc.nvrtcResult.NVRTC_SUCCESS, err
        _, n = nvrtc.nvrtcGetLTOIRSize(prog)
        buf = b" " * n
        nvrtc.nvrtcGetLTOIR(prog, buf)
        return buf

    def link(inputs, opts):
        h = nvjitlink.create(len(opts), opts)
        try:
            for i, data in enumerate(inputs):
                nvjitlink.add_data(h, nvjitlink.InputType.LTOIR, data, len(data), f"m{i}")
            nvjitlink.complete(h)
            log = bytearray(nvjitlink.get_info_log_size(h))
            nvjitlink.get_info_log(h, log)
            ptx = b""
            if "-ptx" in opts:
                ptx = bytearray(nvjitlink.get_linked_ptx_size(h))
                nvjitlink.get_linked_ptx(h, ptx)
            return log.decode(errors="replace"), bytes(ptx).decode(errors="replace")
        finally:
            nvjitlink.destroy(h)

    cu = cu_ltoir(fa.FA_CU)
    out = {}
    for d in fa.HEAD_DIMS:
        kernel = fa.prefill_fa_kernel(d)
        assert kernel.targetoptions["lto"] is True
        ir, _ = cuda.compile(
            kernel.py_func, _PREFILL_FA_SIG, cc=(7, 0), output="ltoir", device=False,
            abi="numba", launch_bounds=kernel.targetoptions["launch_bounds"],
        )
        log, _ = link([ir, cu], ["-arch=sm_70", "-lto", "-verbose"])
        _, ptx = link([ir, cu], ["-arch=sm_70", "-lto", "-ptx"])
        out[d] = {
            "registers": max(int(x) for x in re.findall(r"Used (\\d+) registers", log)),
            "spill": sum(int(x) for x in re.findall(r"(\\d+) bytes spill stores", log)),
            "stack": max(int(x) for x in re.findall(r"(\\d+) bytes stack frame", log)),
            "smem": max(int(x) for x in re.findall(r"(\\d+) bytes smem", log)),
            "calls": ptx.count("call"),
            "hmma": ptx.count("wmma.mma.sync"),
            "named_barriers": len(re.findall(r"bar\\.sync\\s+%r", ptx)),
            "threads": kernel.targetoptions["launch_bounds"][0],
        }
        name = f"prefill_fa_kernel_d{d}"  # as check-kernels compiles it (no LTO)
        r = compile_one(Task("attention.prefill_fa", name, name, _PREFILL_FA_SIG, (7, 0), True))
        out[d]["abi"] = {"error": r.error, "registers": r.registers, "smem": r.shared_bytes}
    print("RESULT " + json.dumps(out))
    """
)


@pytest.fixture(scope="module")
def lto_link() -> dict:
    env = dict(os.environ)
    env.pop("NUMBA_ENABLE_CUDASIM", None)  # must compile for real, not simulate
    env["NUMBA_ENABLE_CUDASIM"] = "0"
    proc = subprocess.run(
        [sys.executable, "-P", "-c", _LTO_SCRIPT],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (line,) = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
    return {int(k): v for k, v in json.loads(line[len("RESULT ") :]).items()}


@pytest.mark.parametrize("head_dim", HEAD_DIMS)
def test_fa_kernel_lto_link_fits_volta(lto_link, head_dim):
    r = lto_link[head_dim]
    print(f"d={head_dim}: {r}")
    assert r["spill"] == 0 and r["stack"] == 0, r
    assert 0 < r["registers"] <= MAX_REGISTERS[head_dim], r
    assert r["threads"] == num_threads(head_dim) == 128 * SPLIT[head_dim], r
    # The blocks per SM hold (registers; shared memory on Volta's 96 KB).
    assert r["registers"] * r["threads"] * MIN_BLOCKS[head_dim] <= 65536, r
    assert r["smem"] == smem_bytes(head_dim) <= 48 * 1024, r
    assert r["smem"] * MIN_BLOCKS[head_dim] <= 96 * 1024, r
    assert r["calls"] == 0, r  # the C function is inlined: no ABI call, no callee-saved spills
    assert r["hmma"] > 0, r
    # Row-tile barriers (bar.sync 1 + tile, 64) only where two warps share a row tile: the
    # head dims 64 and 128 keep their one-warp-a-tile code.
    assert (r["named_barriers"] > 0) == (SPLIT[head_dim] > 1), r


@pytest.mark.parametrize("head_dim", HEAD_DIMS)
def test_fa_kernel_abi_link_for_volta(lto_link, head_dim):
    """Every head dim's kernel as check-kernels compiles it (its compile_one: numba's PTX and the
    .cu's, linked for sm_70 without LTO), registered there or not."""
    r = lto_link[head_dim]["abi"]
    assert r["error"] is None, r
    assert r["registers"] > 0 and r["smem"] == smem_bytes(head_dim), r


@pytest.mark.xdist_group("cc70")
@pytest.mark.slow
@pytest.mark.timeout(2400)  # the shared compile of every kernel runs in this test's setup
def test_fa_kernels_link_for_volta(cc70_check):
    """The registered instances, as check-kernels linked them (PTX, no LTO: the C function is an
    ABI call there, so its callee-saved registers count as spill; what runs is the LTO build)."""
    from voltserve.kernels import registry
    from voltserve.kernels.attention import _PREFILL_FA_SIG

    registered = {spec.name for spec in registry.kernels()}
    for d in HEAD_DIMS:
        name = f"attention.prefill_fa.prefill_fa_kernel_d{d}"
        if name not in registered:  # (test_fa_kernel_abi_link_for_volta compiles it the same way)
            continue
        ptx = cc70_check.ptx(name, _PREFILL_FA_SIG)
        assert f".extern .func  (.param .b32 func_retval0) vs_fa_prefill_d{d}" in ptx
        r = cc70_check.result(name, _PREFILL_FA_SIG)
        assert r["error"] is None, r
        assert r["registers"] > 0 and r["shared_bytes"] == smem_bytes(d), r
