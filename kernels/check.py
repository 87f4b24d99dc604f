"""`voltserve check-kernels --cc 7.0`: compile every registered kernel for a compute capability
without a GPU, using the CUDA 12 NVVM that numba-cuda[cu12] installs (CUDA 13 dropped Volta).

For each kernel and signature it prints one line: the PTX size, and, when the pip ptxas is
present, registers, spills and static shared memory from assembling that PTX for the target.
It also rejects PTX that does not target the requested sm_XY or that uses instructions Volta lacks
(bf16, cp.async, wgmma, TMA, mbarrier). Exit status 1 names every kernel that failed.
"""

from __future__ import annotations

import argparse
import importlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

# Instructions or types an SM70 kernel must not contain (checked as PTX substrings).
FORBIDDEN_PTX = (
    "bf16",
    "cp.async",
    "wgmma",
    "cp.reduce.async",
    "tensormap",
    "mbarrier",
    "setmaxnreg",
)


@dataclass
class Result:
    name: str
    signature: str
    ptx_bytes: int = 0
    registers: int | None = None
    spill_bytes: int | None = None
    shared_bytes: int | None = None
    error: str | None = None


def _prepare_numba() -> None:
    """This command must compile for real, never in the CUDA simulator."""
    if "numba.cuda" in sys.modules:
        from numba.cuda.core import config

        if config.ENABLE_CUDASIM:
            raise SystemExit(
                "check-kernels: numba.cuda was already imported with NUMBA_ENABLE_CUDASIM=1; "
                "run `voltserve check-kernels` in a fresh process without the simulator"
            )
    os.environ["NUMBA_ENABLE_CUDASIM"] = "0"


class _TargetDevice:
    """Stands in for the current device so device functions compile for the target cc."""

    def __init__(self, cc: tuple[int, int]):
        self.compute_capability = cc


def _patch_device_cc(cc: tuple[int, int]) -> None:
    # numba compiles @cuda.jit(device=True) helpers for the *current* device's cc, which needs a
    # driver. Here there may be no GPU, and the target is the requested cc anyway.
    from numba.cuda import dispatcher

    dispatcher.get_current_device = lambda: _TargetDevice(cc)


def find_ptxas() -> str | None:
    try:
        import nvidia.cuda_nvcc as nvcc

        for base in nvcc.__path__:
            cand = Path(base) / "bin" / "ptxas"
            if cand.is_file():
                return str(cand)
    except ImportError:
        pass
    return shutil.which("ptxas")


def _ptxas_info(ptxas: str, ptx: str, cc: tuple[int, int]) -> tuple[int, int, int]:
    with tempfile.TemporaryDirectory() as d:
        src, dst = Path(d) / "k.ptx", Path(d) / "k.cubin"
        src.write_text(ptx)
        proc = subprocess.run(
            [ptxas, f"-arch=sm_{cc[0]}{cc[1]}", "-v", str(src), "-o", str(dst)],
            capture_output=True,
            text=True,
        )
    log = proc.stdout + proc.stderr
    if proc.returncode != 0:
        raise RuntimeError(f"ptxas failed: {log.strip()[-2000:]}")
    regs = max((int(x) for x in re.findall(r"Used (\d+) registers", log)), default=0)
    spills = sum(int(x) for x in re.findall(r"(\d+) bytes spill stores", log))
    smem = max((int(x) for x in re.findall(r"(\d+) bytes smem", log)), default=0)
    return regs, spills, smem


def compile_cu_ptx(path: str, cc: tuple[int, int]) -> str:
    """PTX of a CUDA C++ file that kernels link (cuda.declare_device(link=...)), compiled with
    NVRTC from the CUDA 12 pip package for compute_XY. Needs no GPU or driver, unlike numba's
    own NVRTC wrapper (cuda.core queries the driver version)."""
    from cuda.bindings import nvrtc

    def ok(ret, what):
        err, *rest = ret if isinstance(ret, tuple) else (ret,)
        if err != nvrtc.nvrtcResult.NVRTC_SUCCESS:
            raise RuntimeError(f"NVRTC {what} failed for {path}: {err}")
        return rest[0] if rest else None

    prog = ok(
        nvrtc.nvrtcCreateProgram(Path(path).read_bytes(), Path(path).name.encode(), 0, [], []),
        "create",
    )
    opts = [f"--gpu-architecture=compute_{cc[0]}{cc[1]}".encode(), b"-rdc=true", b"-std=c++17"]
    err = nvrtc.nvrtcCompileProgram(prog, len(opts), opts)[0]
    if err != nvrtc.nvrtcResult.NVRTC_SUCCESS:
        size = ok(nvrtc.nvrtcGetProgramLogSize(prog), "log size")
        log = b" " * size
        nvrtc.nvrtcGetProgramLog(prog, log)
        raise RuntimeError(f"NVRTC failed for {path}: {log.decode(errors='replace').strip()}")
    size = ok(nvrtc.nvrtcGetPTXSize(prog), "ptx size")
    ptx = b" " * size
    ok(nvrtc.nvrtcGetPTX(prog, ptx), "get ptx")
    nvrtc.nvrtcDestroyProgram(prog)
    return ptx.decode().rstrip("\x00")


def link_info(ptxs: list[str], cc: tuple[int, int]) -> tuple[int, int, int]:
    """Links PTX modules (a kernel and the C++ it calls) into a cubin for sm_XY with nvJitLink
    (no GPU needed); returns the kernel's (registers, spill bytes, shared bytes)."""
    from cuda.bindings import nvjitlink

    handle = nvjitlink.create(2, [f"-arch=sm_{cc[0]}{cc[1]}", "-verbose"])
    try:
        for i, ptx in enumerate(ptxs):
            data = ptx.encode()
            nvjitlink.add_data(handle, nvjitlink.InputType.PTX, data, len(data), f"m{i}.ptx")
        try:
            nvjitlink.complete(handle)
        except Exception as e:
            buf = bytearray(nvjitlink.get_error_log_size(handle))
            nvjitlink.get_error_log(handle, buf)
            raise RuntimeError(
                f"nvJitLink failed: {buf.decode(errors='replace').strip()[-2000:]}"
            ) from e
        buf = bytearray(nvjitlink.get_info_log_size(handle))
        nvjitlink.get_info_log(handle, buf)
    finally:
        nvjitlink.destroy(handle)
    log = buf.decode(errors="replace")
    regs = max((int(x) for x in re.findall(r"used (\d+) registers", log, flags=re.I)), default=0)
    spills = sum(int(x) for x in re.findall(r"(\d+) bytes spill stores", log))
    smem = max((int(x) for x in re.findall(r"(\d+) bytes smem", log)), default=0)
    return regs, spills, smem


def check_ptx(ptx: str, cc: tuple[int, int]) -> None:
    target = f"sm_{cc[0]}{cc[1]}"
    targets = set(re.findall(r"^\.target\s+(\S+)", ptx, flags=re.M))
    if targets != {target}:
        raise RuntimeError(f"PTX targets {sorted(targets)}, expected {target}")
    for bad in FORBIDDEN_PTX:
        if bad in ptx:
            raise RuntimeError(f"PTX contains {bad!r}, which SM70 kernels must not use")


def compile_all(
    cc: tuple[int, int], use_ptxas: bool = True, only: tuple[str, ...] = ()
) -> list[Result]:
    from numba import cuda
    from voltserve.kernels.registry import KERNELS

    ptxas = find_ptxas() if use_ptxas else None
    results: list[Result] = []
    for spec in KERNELS:
        if only and not any(o in spec.name for o in only):
            continue
        for sig in spec.signatures:
            res = Result(spec.name, sig)
            results.append(res)
            try:
                module = importlib.import_module(f"voltserve.kernels.{spec.module}")
                kernel = getattr(module, spec.attr)
                ptx, _ = cuda.compile_ptx(kernel.py_func, sig, cc=cc)
                res.ptx_bytes = len(ptx)
                check_ptx(ptx, cc)
                # A module that links CUDA C++ lists it in CUDA_SOURCES: compile and check that
                # too, and link both (ptxas alone cannot resolve the extern calls).
                linked = [compile_cu_ptx(p, cc) for p in getattr(module, "CUDA_SOURCES", ())]
                for extra in linked:
                    check_ptx(extra, cc)
                if linked and use_ptxas:
                    res.registers, res.spill_bytes, res.shared_bytes = link_info([ptx, *linked], cc)
                elif ptxas:
                    res.registers, res.spill_bytes, res.shared_bytes = _ptxas_info(ptxas, ptx, cc)
            except Exception as e:  # noqa: BLE001 - reported per kernel below
                res.error = f"{type(e).__name__}: {str(e).strip().splitlines()[-1] if str(e).strip() else ''}"
    return results


def main(argv: list[str]) -> None:
    ap = argparse.ArgumentParser(prog="voltserve check-kernels", description=__doc__.split("\n")[0])
    ap.add_argument("--cc", default="7.0", help="compute capability, e.g. 7.0 (default) or 9.0")
    ap.add_argument(
        "--no-ptxas", action="store_true", help="skip assembling (report PTX size only)"
    )
    ap.add_argument(
        "--only",
        default="",
        help="comma-separated substrings: compile only kernels whose module.attr contains one",
    )
    args = ap.parse_args(argv)
    try:
        major, minor = (int(x) for x in args.cc.split("."))
    except ValueError:
        raise SystemExit(f"check-kernels: --cc must look like 7.0, got {args.cc!r}") from None
    cc = (major, minor)

    _prepare_numba()
    _patch_device_cc(cc)
    t0 = time.perf_counter()
    only = tuple(o for o in args.only.split(",") if o)
    results = compile_all(cc, use_ptxas=not args.no_ptxas, only=only)
    failed = [r for r in results if r.error]
    for r in results:
        if r.error:
            print(f"FAIL {r.name:<44} {r.signature}\n     {r.error}")
        elif r.registers is not None:
            print(
                f"ok   {r.name:<44} regs={r.registers:<3} spill={r.spill_bytes}B "
                f"smem={r.shared_bytes}B ptx={r.ptx_bytes}B  {r.signature}"
            )
        else:
            print(f"ok   {r.name:<44} ptx={r.ptx_bytes}B  {r.signature}")
    print(
        f"check-kernels: {len(results) - len(failed)}/{len(results)} kernel signatures compiled "
        f"for sm_{major}{minor} in {time.perf_counter() - t0:.1f}s"
    )
    if failed:
        names = ", ".join(sorted({r.name for r in failed}))
        print(f"check-kernels: FAILED: {names}", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main(sys.argv[1:])
