"""`voltserve check-kernels --cc 7.0`: compile every registered kernel for a compute capability
without a GPU, using the CUDA 12 NVVM that numba-cuda[cu12] installs (CUDA 13 dropped Volta).

For each kernel and signature it prints one line: the PTX size, and, when the pip ptxas is
present, registers, spills and static shared memory from assembling that PTX for the target.
It also rejects PTX that does not target the requested sm_XY or that uses instructions Volta lacks
(bf16, cp.async, wgmma, TMA, mbarrier). Exit status 1 names every kernel that failed.

Signatures compile in parallel, one worker process per CPU (--jobs); --only restricts the check
to some kernels while working on them (CI compiles them all).
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import importlib
import json
import multiprocessing
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass
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
    seconds: float = 0.0


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


def _ptxas_info(
    ptxas: str, ptx: str, cc: tuple[int, int], max_registers: int | None = None
) -> tuple[int, int, int]:
    """Registers, spill bytes and static shared memory of the PTX assembled for sm_XY, under the
    kernel's own register cap (`cuda.jit(max_registers=...)`, applied when numba links)."""
    cap = [f"-maxrregcount={max_registers}"] if max_registers else []
    with tempfile.TemporaryDirectory() as d:
        src, dst = Path(d) / "k.ptx", Path(d) / "k.cubin"
        src.write_text(ptx)
        proc = subprocess.run(
            [ptxas, f"-arch=sm_{cc[0]}{cc[1]}", *cap, "-v", str(src), "-o", str(dst)],
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


@dataclass(frozen=True)
class Task:
    """One kernel signature to compile (what a worker process is handed)."""

    module: str
    attr: str
    name: str
    signature: str
    cc: tuple[int, int]
    use_ptxas: bool
    ptx_dir: str | None = None


@functools.cache
def _cu_ptx(path: str, cc: tuple[int, int]) -> str:
    # A module's CUDA C++ is the same for each of its signatures: compiled once per process.
    ptx = compile_cu_ptx(path, cc)
    check_ptx(ptx, cc)
    return ptx


def _ptx_file(ptx_dir: str, name: str, signature: str) -> Path:
    digest = hashlib.sha1(signature.encode()).hexdigest()[:10]
    return Path(ptx_dir) / f"{name}.{digest}.ptx"


def compile_one(task: Task) -> Result:
    """Compile one registered signature for task.cc; errors are returned, not raised."""
    from numba import cuda

    res = Result(task.name, task.signature)
    t0 = time.perf_counter()
    try:
        module = importlib.import_module(f"voltserve.kernels.{task.module}")
        kernel = getattr(module, task.attr)
        ptx, _ = cuda.compile_ptx(kernel.py_func, task.signature, cc=task.cc)
        res.ptx_bytes = len(ptx)
        if task.ptx_dir:
            _ptx_file(task.ptx_dir, task.name, task.signature).write_text(ptx)
        check_ptx(ptx, task.cc)
        # A module that links CUDA C++ lists it in CUDA_SOURCES: compile and check that too,
        # and link both (ptxas alone cannot resolve the extern calls).
        linked = [_cu_ptx(p, task.cc) for p in getattr(module, "CUDA_SOURCES", ())]
        if task.ptx_dir:
            for p, extra in zip(getattr(module, "CUDA_SOURCES", ()), linked):
                (Path(task.ptx_dir) / f"{Path(p).name}.ptx").write_text(extra)
        if linked and task.use_ptxas:
            res.registers, res.spill_bytes, res.shared_bytes = link_info([ptx, *linked], task.cc)
        elif task.use_ptxas and (ptxas := find_ptxas()):
            cap = getattr(kernel, "targetoptions", {}).get("max_registers")
            res.registers, res.spill_bytes, res.shared_bytes = _ptxas_info(ptxas, ptx, task.cc, cap)
    except Exception as e:  # noqa: BLE001 - reported per kernel by the caller
        msg = str(e).strip()
        res.error = f"{type(e).__name__}: {msg.splitlines()[-1] if msg else ''}"
    res.seconds = time.perf_counter() - t0
    return res


def _init_worker(cc: tuple[int, int]) -> None:
    _prepare_numba()
    _patch_device_cc(cc)


def _source_size(module: str) -> int:
    try:
        return (Path(__file__).parent.parent / f"{module.replace('.', '/')}.py").stat().st_size
    except OSError:
        return 0


def default_jobs() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def compile_all(
    cc: tuple[int, int],
    use_ptxas: bool = True,
    jobs: int = 1,
    only: list[str] | None = None,
    ptx_dir: str | None = None,
) -> list[Result]:
    """Every registered signature (or those whose kernel name contains one of `only`), compiled
    for cc; results in registry order. jobs > 1 spreads the signatures over that many worker
    processes (each signature is independent; a worker keeps what it compiled, such as a shared
    device function or a module's CUDA C++, for the signatures it compiles next)."""
    from voltserve.kernels import registry

    tasks = [
        Task(spec.module, spec.attr, spec.name, sig, cc, use_ptxas, ptx_dir)
        for spec in registry.kernels()
        if not only or any(o in spec.name for o in only)
        for sig in spec.signatures
    ]
    if ptx_dir:
        Path(ptx_dir).mkdir(parents=True, exist_ok=True)
    jobs = max(1, min(jobs, len(tasks)))
    if jobs == 1:
        _init_worker(cc)
        return [compile_one(t) for t in tasks]
    # Largest kernel families first (their modules are the largest files): the long compiles
    # start at once and the short ones fill in at the end, so the workers finish together.
    order = sorted(range(len(tasks)), key=lambda i: -_source_size(tasks[i].module))
    results: list[Result | None] = [None] * len(tasks)
    # spawn: fresh interpreters, whatever this process already imported (numba in the
    # simulator, a CUDA context) stays out of the workers.
    ctx = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(jobs, mp_context=ctx, initializer=_init_worker, initargs=(cc,)) as ex:
        futures = {ex.submit(compile_one, tasks[i]): i for i in order}
        for fut, i in futures.items():
            try:
                results[i] = fut.result()
            except Exception as e:  # noqa: BLE001 - a worker that died: name its kernel
                results[i] = Result(tasks[i].name, tasks[i].signature, error=f"worker: {e!r}")
    return results  # type: ignore[return-value]


def main(argv: list[str]) -> None:
    ap = argparse.ArgumentParser(prog="voltserve check-kernels", description=__doc__.split("\n")[0])
    ap.add_argument("--cc", default="7.0", help="compute capability, e.g. 7.0 (default) or 9.0")
    ap.add_argument(
        "--no-ptxas", action="store_true", help="skip assembling (report PTX size only)"
    )
    ap.add_argument(
        "--jobs",
        "-j",
        type=int,
        default=default_jobs(),
        help="worker processes (default: the CPUs this process may use)",
    )
    ap.add_argument(
        "--only",
        action="append",
        metavar="NAME",
        help="only kernels whose name (module.attr) contains NAME (repeatable)",
    )
    ap.add_argument("--ptx-dir", help="also write each kernel's PTX into this folder")
    ap.add_argument("--json", dest="json_path", help="also write the results as JSON here")
    args = ap.parse_args(argv)
    try:
        major, minor = (int(x) for x in args.cc.split("."))
    except ValueError:
        raise SystemExit(f"check-kernels: --cc must look like 7.0, got {args.cc!r}") from None
    cc = (major, minor)

    _prepare_numba()
    t0 = time.perf_counter()
    results = compile_all(
        cc,
        use_ptxas=not args.no_ptxas,
        jobs=args.jobs,
        # Repeatable, and each value may list several names separated by commas.
        only=[n for o in args.only or () for n in o.split(",") if n] or None,
        ptx_dir=args.ptx_dir,
    )
    if not results:
        raise SystemExit(f"check-kernels: no registered kernel matches --only {args.only}")
    failed = [r for r in results if r.error]
    for r in results:
        if r.error:
            print(f"FAIL {r.name:<44} {r.signature}\n     {r.error}")
        elif r.registers is not None:
            print(
                f"ok   {r.name:<44} regs={r.registers:<3} spill={r.spill_bytes}B "
                f"smem={r.shared_bytes}B ptx={r.ptx_bytes}B {r.seconds:5.1f}s  {r.signature}"
            )
        else:
            print(f"ok   {r.name:<44} ptx={r.ptx_bytes}B {r.seconds:5.1f}s  {r.signature}")
    print(
        f"check-kernels: {len(results) - len(failed)}/{len(results)} kernel signatures compiled "
        f"for sm_{major}{minor} in {time.perf_counter() - t0:.1f}s ({args.jobs} jobs)"
    )
    if args.json_path:
        Path(args.json_path).write_text(json.dumps([asdict(r) for r in results], indent=1))
    if failed:
        names = ", ".join(sorted({r.name for r in failed}))
        print(f"check-kernels: FAILED: {names}", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main(sys.argv[1:])
