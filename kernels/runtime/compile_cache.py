"""A persistent on-disk cache of compiled numba.cuda kernels, and the start-up tools that fill it:
tracing which kernels a forward pass launches, and compiling the missing ones in parallel.

How a kernel opts in (one line, no other change to the kernel):

    from voltserve.kernels.runtime.compile_cache import cached, cached_factory

    @cached                       # a kernel defined at module level
    @cuda.jit(fastmath=False)
    def my_kernel(x, out): ...

    @cached_factory               # a function that builds kernels (generated source, closures
    @functools.cache              # over a config): its arguments identify the kernel, so they
    def my_kernel_for(cfg, mode): # must be picklable and have a stable repr (frozen
        ...                       # dataclasses, ints, strings); it must be a module attribute
        return cuda.jit(...)(fn)

Requirements: the kernel's device code lives in voltserve/kernels (every file there, .py and
.cu, is part of every key) or its own module, or is named with `depends=(path, ...)`; it
captures no device arrays (pass them as arguments); numba's NRT is not used. Anything else is
compiled as before and simply not cached. On the CPU (numba's simulator) both decorators return
what they are given.

Why not numba's own cache (`@cuda.jit(cache=True)`, numba-cuda 0.30): it cannot hold the kernels
that take the time. Kernels built from generated source (decode attention, GEMV) have no file,
so numba finds no cache locator ("no locator available for file '<...>'"); kernels that link
CUDA C++ (the WMMA prefill) are refused when pickled ("Cannot pickle CUDACodeLibrary with
linking files"); and its index is keyed on the kernel's own file and bytecode, so a change in a
device function imported from another file (numba_common.block_sum) would load a stale kernel.

An entry is the linked cubin of one kernel for one signature and one compute capability, under
a key hashing: the kernel's identity (module, name, factory arguments), the contents of every
file of voltserve/kernels (and of the kernel's own module, and `depends`), the argument types,
the compute capability, the jit options, and the toolchain (numba, numba-cuda, NVVM, NVRTC,
nvJitLink, driver and Python versions, and the numba settings that change code). Any change
misses; nothing is ever invalidated by hand. Entries live in `$VOLTSERVE_CACHE_DIR/kernels`
(default ~/.cache/voltserve/kernels); VOLTSERVE_KERNEL_CACHE=0 turns the cache off.

Safety: an entry is written to a temporary file and renamed into place (os.replace), so readers
see a whole entry or none, and several processes can fill one cache at once (the last rename
wins; both entries are valid). Each file carries its length and SHA-256: a truncated or corrupt
file is reported with a warning, deleted and rebuilt, never loaded. Entries are pickles, like
numba's own cache: the cache folder must be as trusted as the code.

The hook: numba's CUDADispatcher asks `dispatcher._cache` (numba's Cache protocol) for a kernel
before compiling one and hands it every kernel it compiles; `cached` installs a KernelCache
there. Loading rebuilds numba's kernel object from the cubin through numba-cuda 0.30's own
`_rebuild` constructors (the ones its cache uses); a load that fails for any reason warns and
compiles instead.

Start-up (services/executor/kernel_warmup.py): `traced_launches()` records the kernels and
argument types a forward launches without running them; `precompile()` loads the cached ones and
compiles the rest, several at once in worker processes (numba compiles under one process-wide
lock), so CUDA-graph capture afterwards compiles nothing.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import functools
import hashlib
import importlib
import json
import logging
import multiprocessing
import os
import pickle
import struct
import sys
import time
import uuid
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from numba.cuda.core import config as _numba_config
from voltserve.shared.cache_dir import CACHE_DIR_ENV, cache_root

logger = logging.getLogger(__name__)

SIM: bool = bool(_numba_config.ENABLE_CUDASIM)
ENABLE_ENV = "VOLTSERVE_KERNEL_CACHE"
JOBS_ENV = "VOLTSERVE_COMPILE_JOBS"
FORMAT = 1  # bump when the entry layout or the key changes meaning
_MAGIC = b"VSKCACH1"
_HEADER = struct.Struct("<8s32sQ")  # magic, sha256(body), len(body)
_KERNELS_DIR = Path(__file__).resolve().parent.parent  # voltserve.kernels, every subpackage
_SOURCE_SUFFIXES = (".py", ".cu", ".cuh", ".h")


def kernel_dir() -> Path:
    return cache_root() / "kernels"


def enabled() -> bool:
    off = os.environ.get(ENABLE_ENV, "1").strip().lower() in ("0", "false", "no", "off")
    return not SIM and not off


@dataclass
class CacheStats:
    """What this process's kernel caches did (for the start-up log and tests)."""

    hits: int = 0
    misses: int = 0
    saved: int = 0
    corrupt: int = 0
    load_errors: int = 0
    uncacheable: int = 0
    compiled: list[str] = field(default_factory=list)  # kernel names compiled after a miss

    def snapshot(self) -> dict[str, int]:
        return {
            "hits": self.hits,
            "misses": self.misses,
            "saved": self.saved,
            "corrupt": self.corrupt,
            "load_errors": self.load_errors,
            "uncacheable": self.uncacheable,
        }


stats = CacheStats()


# ---------------------------------------------------------------------------------------------
# The key


def _file_digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@functools.cache
def _package_fingerprint() -> str:
    """SHA-256 over every source file of voltserve/kernels (path and contents): a kernel's device
    functions, intrinsics and linked C++ may live in any of them."""
    h = hashlib.sha256()
    for p in sorted(_KERNELS_DIR.rglob("*")):
        if p.suffix in _SOURCE_SUFFIXES and p.is_file() and "__pycache__" not in p.parts:
            h.update(str(p.relative_to(_KERNELS_DIR)).encode() + b"\0")
            h.update(p.read_bytes())
            h.update(b"\0")
    return h.hexdigest()


def _module_file(module: str) -> Path | None:
    f = getattr(sys.modules.get(module), "__file__", None)
    return Path(f).resolve() if f else None


def _safe(fn: Callable[[], Any]) -> Any:
    try:
        return fn()
    except Exception:  # noqa: BLE001 - a part of the toolchain that is absent is just "none"
        return None


@functools.cache
def toolchain() -> dict[str, Any]:
    """Versions of everything that turns a kernel into a cubin."""
    import numba
    import numba_cuda

    def nvvm_version():
        from numba.cuda.cudadrv import nvvm

        return nvvm.NVVM().get_version()

    def nvrtc_version():
        from cuda.bindings import nvrtc

        return nvrtc.nvrtcVersion()[1:]

    def nvjitlink_version():
        from cuda.bindings import nvjitlink

        return nvjitlink.version()

    def driver_version():
        from cuda.bindings import driver

        err, v = driver.cuDriverGetVersion()
        return v if int(err) == 0 else None

    cfg = {
        name: repr(getattr(_numba_config, name, None))
        for name in (
            "FORCE_CUDA_CC",
            "CUDA_INCLUDE_PATH",
            "CUDA_DEBUGINFO_DEFAULT",
            "CUDA_ENABLE_NRT",
            "CUDA_USE_NVIDIA_BINDING",
        )
    }
    return {
        "python": sys.version_info[:2],
        "numba": numba.__version__,
        "numba_cuda": numba_cuda.__version__,
        "nvvm": _safe(nvvm_version),
        "nvrtc": _safe(nvrtc_version),
        "nvjitlink": _safe(nvjitlink_version),
        "driver": _safe(driver_version),
        "numba_config": cfg,
    }


@dataclass(frozen=True)
class Recipe:
    """How to get a kernel's dispatcher again (in a compile worker): the module attribute
    `name` of `module`, or that factory called with args and kwargs."""

    module: str
    name: str
    args: tuple = ()
    kwargs: tuple = ()  # sorted (name, value) pairs
    factory: bool = False
    depends: tuple[str, ...] = ()

    def ident(self) -> str:
        if not self.factory:
            return f"{self.module}:{self.name}"
        kw = "".join(f", {k}={v!r}" for k, v in self.kwargs)
        return f"{self.module}:{self.name}{self.args!r}{kw}"

    def build(self) -> Any:
        obj: Any = importlib.import_module(self.module)
        for part in self.name.split("."):
            obj = getattr(obj, part)
        return obj(*self.args, **dict(self.kwargs)) if self.factory else obj


def _target_cc() -> tuple:
    """The compute capability key numba compiles the current device's code for (numba's own
    rule: (major, minor, 'a' from 9.0))."""
    from numba.cuda.codegen import CUDACodeLibrary

    return CUDACodeLibrary._ensure_cc(None, None)


def _argtypes(sig: Any) -> tuple:
    from numba.core import sigutils

    args, _ = sigutils.normalize_signature(sig)
    return tuple(args)


# ---------------------------------------------------------------------------------------------
# Entries on disk


class CorruptEntry(ValueError):
    pass


def encode_entry(body: bytes) -> bytes:
    return _HEADER.pack(_MAGIC, hashlib.sha256(body).digest(), len(body)) + body


def decode_entry(data: bytes) -> bytes:
    """The body of an entry file; CorruptEntry if it is not exactly what encode_entry wrote."""
    if len(data) < _HEADER.size:
        raise CorruptEntry(f"{len(data)} bytes, shorter than the header")
    magic, digest, n = _HEADER.unpack_from(data)
    if magic != _MAGIC:
        raise CorruptEntry("not a voltserve kernel cache entry")
    body = data[_HEADER.size :]
    if len(body) != n:
        raise CorruptEntry(f"truncated: {len(body)} of {n} bytes")
    if hashlib.sha256(body).digest() != digest:
        raise CorruptEntry("checksum mismatch")
    return body


def write_atomic(path: Path, data: bytes) -> None:
    """Write to a unique temporary file beside `path`, then rename it over `path`."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    finally:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()


class KernelCache:
    """numba's Cache protocol (load_overload / save_overload) for one dispatcher, on disk."""

    def __init__(self, dispatcher: Any, recipe: Recipe) -> None:
        self._dispatcher = dispatcher
        self.recipe = recipe
        self._enabled = True

    # -- the key --

    @property
    def cache_path(self) -> str:  # numba's dispatcher.stats reads it
        return str(kernel_dir())

    def describe(self, argtypes: tuple, cc: tuple) -> dict[str, Any]:
        d = self._dispatcher
        opts = dict(d.targetoptions)
        link = opts.pop("link", None) or ()
        opts.pop("extensions", None)  # non-empty extensions are not cacheable (see _cacheable)
        files = {}
        for p in (*link, *self.recipe.depends):
            if isinstance(p, str | os.PathLike):
                files[str(p)] = _file_digest(Path(p))
            else:  # numba LinkableCode: code held in memory
                data = getattr(p, "data", None)
                data = data.encode() if isinstance(data, str) else data
                files[repr(getattr(p, "name", p))] = hashlib.sha256(data or b"").hexdigest()
        own = _module_file(self.recipe.module)
        if own is not None and _KERNELS_DIR not in own.parents:
            files[str(own)] = _file_digest(own)
        return {
            "format": FORMAT,
            "kernel": self.recipe.ident(),
            "package": _package_fingerprint(),
            "files": files,
            "argtypes": [repr(t) for t in argtypes],
            "cc": list(cc),
            "options": {k: repr(v) for k, v in sorted(opts.items())},
            "toolchain": toolchain(),
        }

    def key(self, argtypes: tuple, cc: tuple) -> str:
        text = json.dumps(self.describe(argtypes, cc), sort_keys=True, default=repr)
        return hashlib.sha256(text.encode()).hexdigest()

    def path_for(self, argtypes: tuple, cc: tuple) -> Path:
        k = self.key(argtypes, cc)
        return kernel_dir() / k[:2] / f"{k}.vsk"

    # -- numba's Cache protocol --

    def enable(self) -> None:
        self._enabled = True

    def disable(self) -> None:
        self._enabled = False

    def flush(self) -> None:  # dispatcher.recompile(): entries are keyed, nothing to drop
        pass

    def load_overload(self, sig: Any, target_context: Any) -> Any:
        if not (self._enabled and enabled()):
            return None
        argtypes = _argtypes(sig)
        try:
            cc = _target_cc()
            path = self.path_for(argtypes, cc)
        except Exception as e:  # noqa: BLE001 - no device or toolchain: compile as usual
            logger.debug("kernel cache: no key for %s: %r", self.recipe.ident(), e)
            return None
        entry = read_entry(path)
        if entry is None:
            stats.misses += 1
            stats.compiled.append(self.recipe.ident())
            return None
        try:
            if tuple(entry["argtypes"]) != argtypes or tuple(entry["cc"]) != tuple(cc):
                raise CorruptEntry("entry is for other argument types or another device")
            target_context.refresh()
            kernel = _rebuild_kernel(entry, target_context)
        except Exception as e:  # noqa: BLE001 - never fatal: the dispatcher compiles instead
            stats.load_errors += 1
            stats.compiled.append(self.recipe.ident())
            logger.warning(
                "kernel cache: could not load %s for %s (%s: %s); compiling it",
                path,
                self.recipe.ident(),
                type(e).__name__,
                e,
            )
            return None
        stats.hits += 1
        return kernel

    def save_overload(self, sig: Any, kernel: Any) -> None:
        if not (self._enabled and enabled()):
            return
        why = _uncacheable(kernel, self._dispatcher)
        if why:
            stats.uncacheable += 1
            logger.debug("kernel cache: not caching %s: %s", self.recipe.ident(), why)
            return
        argtypes = _argtypes(sig)
        try:
            lib = kernel._codelibrary
            if not lib._cubin_cache:
                lib.get_cubin()
            for cc, obj in lib._cubin_cache.items():
                body = pickle.dumps(_reduce_kernel(kernel, argtypes, cc, obj), protocol=5)
                write_atomic(self.path_for(argtypes, cc), encode_entry(body))
                stats.saved += 1
        except Exception as e:  # noqa: BLE001 - a cache that cannot be written is only slower
            logger.warning("kernel cache: could not save %s: %r", self.recipe.ident(), e)

    # -- for precompile --

    def has_entry(self, argtypes: tuple, cc: tuple) -> bool:
        try:
            return self.path_for(argtypes, cc).is_file()
        except Exception:  # noqa: BLE001
            return False


def read_entry(path: Path) -> dict[str, Any] | None:
    """The entry at path; None when absent, or when corrupt (warned about and deleted)."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return None
    except OSError as e:
        logger.warning("kernel cache: cannot read %s: %r", path, e)
        return None
    try:
        entry = pickle.loads(decode_entry(data))
        if not isinstance(entry, dict) or entry.get("format") != FORMAT:
            raise CorruptEntry("unexpected contents")
        return entry
    except Exception as e:  # noqa: BLE001 - CorruptEntry, or a body pickle cannot read
        stats.corrupt += 1
        logger.warning(
            "kernel cache: %s is corrupt (%s); deleting it, the kernel is compiled again", path, e
        )
        with contextlib.suppress(OSError):
            path.unlink()
        return None


def _uncacheable(kernel: Any, dispatcher: Any) -> str | None:
    lib = kernel._codelibrary
    if getattr(kernel, "launch_config_sensitive", False):
        return "launch-config sensitive"
    if dispatcher.targetoptions.get("extensions"):
        return "has argument extensions"
    if lib._setup_functions or lib._teardown_functions:
        return "its linked code has setup callbacks"
    refs = getattr(lib, "referenced_objects", None) or {}
    if any(hasattr(o, "__cuda_array_interface__") for o in refs.values()):
        return "references global device arrays"
    from numba.cuda.memory_management.nrt import NRT_LIBRARY

    if NRT_LIBRARY in lib._linking_files:
        return "uses numba's NRT"
    return None


def _reduce_kernel(kernel: Any, argtypes: tuple, cc: tuple, cubin: Any) -> dict[str, Any]:
    lib = kernel._codelibrary
    return {
        "format": FORMAT,
        "argtypes": argtypes,
        "cc": tuple(cc),
        "cubin": bytes(cubin.code),
        "lib_name": lib.name,
        "entry_name": kernel.entry_name,
        "signature": kernel.signature,
        "call_helper": kernel.call_helper,
        "cooperative": kernel.cooperative,
        "debug": kernel.debug,
        "lineinfo": kernel.lineinfo,
        "shared_memory_carveout": kernel.shared_memory_carveout,
        "max_registers": lib._max_registers,
        "nvvm_options": lib._nvvm_options,
        "needs_cudadevrt": lib.needs_cudadevrt,
        "lto": lib._lto,
    }


def _rebuild_kernel(entry: dict[str, Any], target_context: Any) -> Any:
    """numba's kernel object around a cached cubin (numba-cuda 0.30's own rebuild paths)."""
    from numba.cuda.codegen import CUDACodeLibrary
    from numba.cuda.cudadrv.driver import ObjectCode
    from numba.cuda.dispatcher import _Kernel

    lib = CUDACodeLibrary._rebuild(
        codegen=target_context.codegen(),
        name=entry["lib_name"],
        entry_name=entry["entry_name"],
        llvm_strs=[],
        ptx_cache={},
        cubin_cache={tuple(entry["cc"]): ObjectCode.from_cubin(entry["cubin"])},
        linkerinfo_cache={},
        max_registers=entry["max_registers"],
        nvvm_options=entry["nvvm_options"],
        # Already linked into the cubin: nothing is linked again.
        needs_cudadevrt=False,
        nrt=False,
        use_cooperative=entry["cooperative"],
        lto=entry["lto"],
    )
    return _Kernel._rebuild(
        cooperative=entry["cooperative"],
        name=entry["entry_name"],
        signature=entry["signature"],
        codelibrary=lib,
        debug=entry["debug"],
        lineinfo=entry["lineinfo"],
        call_helper=entry["call_helper"],
        extensions=[],
        shared_memory_carveout=entry["shared_memory_carveout"],
        launch_config_sensitive=False,
    )


# ---------------------------------------------------------------------------------------------
# Opting in


def _is_dispatcher(obj: Any) -> bool:
    if SIM:
        return False
    from numba.cuda.dispatcher import CUDADispatcher

    return isinstance(obj, CUDADispatcher)


def install(dispatcher: Any, recipe: Recipe) -> Any:
    """Give `dispatcher` a KernelCache for `recipe` (unless it has one); returns dispatcher."""
    if _is_dispatcher(dispatcher) and not isinstance(dispatcher._cache, KernelCache):
        dispatcher._cache = KernelCache(dispatcher, recipe)
    return dispatcher


def cached(dispatcher: Any = None, *, depends: Iterable[str] = ()) -> Any:
    """Decorator for a module-level kernel (above @cuda.jit): its compiled code is cached on
    disk. `depends`: files outside voltserve/kernels its device code comes from."""

    def apply(d: Any) -> Any:
        if not _is_dispatcher(d):
            return d
        f = d.py_func
        return install(d, Recipe(f.__module__, f.__qualname__, depends=tuple(depends)))

    return apply if dispatcher is None else apply(dispatcher)


def cached_factory(factory: Any = None, *, depends: Iterable[str] = ()) -> Any:
    """Decorator for a function returning a kernel (above @functools.cache): every kernel it
    returns is cached on disk, keyed by the call's arguments."""

    def wrap(fn: Callable[..., Any]) -> Callable[..., Any]:
        if SIM:
            return fn

        @functools.wraps(fn)
        def build(*args: Any, **kwargs: Any) -> Any:
            d = fn(*args, **kwargs)
            if _is_dispatcher(d) and not isinstance(d._cache, KernelCache):
                recipe = Recipe(
                    fn.__module__,
                    fn.__qualname__,
                    tuple(args),
                    tuple(sorted(kwargs.items())),
                    factory=True,
                    depends=tuple(depends),
                )
                install(d, recipe)
            return d

        return build

    return wrap if factory is None else wrap(factory)


# ---------------------------------------------------------------------------------------------
# Compiling for a compute capability without using the device


@contextlib.contextmanager
def compile_for_cc(cc: tuple) -> Iterator[tuple]:
    """Inside: numba compiles and links for `cc` ((major, minor) or numba's (major, minor,
    suffix)) without asking the driver for a device (check-kernels does the same for PTX).
    For compile workers and for tests on machines without a GPU."""
    from numba.cuda import codegen, dispatcher

    cc3 = tuple(cc) if len(cc) == 3 else (cc[0], cc[1], "a" if tuple(cc) >= (9, 0) else "")

    class _Device:
        compute_capability = (cc3[0], cc3[1])

    saved = dispatcher.get_current_device, codegen.CUDACodeLibrary._ensure_cc
    dispatcher.get_current_device = lambda: _Device()
    codegen.CUDACodeLibrary._ensure_cc = lambda self, want: cc3 if want is None else want
    try:
        yield cc3
    finally:
        dispatcher.get_current_device, codegen.CUDACodeLibrary._ensure_cc = saved


def compile_into_cache(dispatcher: Any, argtypes: tuple) -> str:
    """Compile `dispatcher` for argtypes into the disk cache without binding it to a device
    (under compile_for_cc, or on a GPU host). Returns "hit" when a valid entry was there (or
    appeared while waiting for another process compiling it), else "compiled"."""
    from numba.cuda.dispatcher import _Kernel

    cache = dispatcher._cache
    if not isinstance(cache, KernelCache):
        raise TypeError(f"{dispatcher} has no KernelCache (decorate it with @cached)")
    cc = _target_cc()
    path = cache.path_for(argtypes, cc)
    with _entry_lock(path):
        if path.is_file() and read_entry(path) is not None:
            return "hit"
        kernel = _Kernel(dispatcher.py_func, argtypes, **dispatcher.targetoptions)
        kernel._codelibrary.get_cubin()
        cache.save_overload(argtypes, kernel)
    return "compiled"


@contextlib.contextmanager
def _entry_lock(path: Path) -> Iterator[None]:
    """An exclusive lock on `path`'s key across processes (released if the holder dies), so
    executors starting together compile each kernel once; without flock, no lock."""
    try:
        import fcntl
    except ImportError:  # pragma: no cover - not Linux
        yield
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_suffix(".lock"), "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


# ---------------------------------------------------------------------------------------------
# Start-up: trace, then compile what is missing


@contextlib.contextmanager
def traced_launches() -> Iterator[list[tuple[Any, tuple]]]:
    """Inside, a numba kernel launch runs nothing: it appends (dispatcher, argument types) to
    the yielded list. Host code around the launches runs as usual, so a forward pass that never
    reads a kernel's output on the host (a graph-capturable one) traces every kernel it would
    launch. Process-wide while active: trace from one thread, with no other launches going on."""
    from numba.cuda.dispatcher import CUDADispatcher

    calls: list[tuple[Any, tuple]] = []

    def record(self: Any, args: tuple, launch_config: Any) -> None:
        calls.append((self, tuple(self.typeof_pyval(a) for a in args)))

    from voltserve.kernels.runtime.fast_launch import LAUNCHER

    original = CUDADispatcher.call
    CUDADispatcher.call = record
    try:
        with LAUNCHER.bypass():  # launches from plans would run: send them through numba
            yield calls
    finally:
        CUDADispatcher.call = original


@dataclass
class CompileReport:
    launches: int = 0  # launches traced
    kernels: int = 0  # distinct (kernel, argument types) among them
    already: int = 0  # in memory before
    loaded: int = 0  # found in the disk cache (compiled by an earlier run or another process)
    compiled: int = 0  # compiled in this process
    in_workers: int = 0  # compiled by this call's worker processes (then loaded from the cache)
    workers: int = 0
    worker_errors: list[str] = field(default_factory=list)
    seconds: float = 0.0

    def summary(self) -> str:
        s = (
            f"{self.kernels} kernels for {self.launches} launches: {self.loaded} from the cache, "
            f"{self.in_workers} compiled in {self.workers} processes, {self.compiled} here"
        )
        if self.already:
            s += f", {self.already} already loaded"
        if self.worker_errors:
            s += f", {len(self.worker_errors)} worker failures"
        return s


def default_jobs() -> int:
    raw = os.environ.get(JOBS_ENV, "").strip()
    if raw:
        return max(1, int(raw))
    return max(1, min(8, (os.cpu_count() or 2) - 1))


def precompile(
    launches: Iterable[tuple[Any, tuple]],
    jobs: int | None = None,
    progress: Callable[[Iterable[Any], int], Iterable[Any]] | None = None,
    bind: bool = True,
) -> CompileReport:
    """Make every traced (dispatcher, argument types) ready to launch: loaded from the disk
    cache, or compiled (by up to `jobs` worker processes when several cacheable kernels are
    missing, else here), and bound to the current device (module loaded), so later launches
    and graph captures compile and load nothing. bind=False: no device (tests under
    compile_for_cc)."""
    t0 = time.perf_counter()
    launches = list(launches)
    report = CompileReport(launches=len(launches))
    todo: dict[tuple[int, tuple], tuple[Any, tuple]] = {}
    for d, a in launches:
        todo.setdefault((id(d), a), (d, a))
    report.kernels = len(todo)
    pending = [(d, a) for d, a in todo.values() if a not in d.overloads]
    report.already = report.kernels - len(pending)
    jobs = default_jobs() if jobs is None else max(1, jobs)
    pool_jobs: list[tuple[Any, tuple]] = []
    if enabled() and jobs > 1:
        cc = _target_cc()
        pool_jobs = [
            (d, a)
            for d, a in pending
            if isinstance(d._cache, KernelCache) and not d._cache.has_entry(a, cc)
        ]
    if len(pool_jobs) >= 2:
        report.workers = min(jobs, len(pool_jobs))
        try:
            report.in_workers, report.worker_errors = _compile_in_workers(
                pool_jobs, report.workers, progress
            )
        except Exception as e:  # noqa: BLE001 - no pool (spawn failed, a worker died): serial
            report.worker_errors.append(f"worker pool: {type(e).__name__}: {e}")
        for err in report.worker_errors:
            logger.warning("kernel compile worker failed (compiling here instead): %s", err)
    before = stats.hits
    for d, a in pending:
        kernel = d.compile(a)
        if bind:
            kernel.bind()
    hits = stats.hits - before  # includes the kernels the workers just compiled
    report.loaded = hits - report.in_workers
    report.compiled = len(pending) - hits
    report.seconds = time.perf_counter() - t0
    return report


def _compile_in_workers(
    items: list[tuple[Any, tuple]], workers: int, progress: Callable | None
) -> tuple[int, list[str]]:
    cc = _target_cc()
    jobs = [(d._cache.recipe, a) for d, a in items]
    done, errors = 0, []
    ctx = multiprocessing.get_context("spawn")  # the parent holds a CUDA context: never fork
    with concurrent.futures.ProcessPoolExecutor(
        max_workers=workers,
        mp_context=ctx,
        initializer=_worker_init,
        initargs=(cc, str(cache_root())),
    ) as pool:
        futures = [pool.submit(_worker_compile, r, a) for r, a in jobs]
        finished = concurrent.futures.as_completed(futures)
        if progress is not None:
            finished = progress(finished, len(futures))
        for fut in finished:
            try:
                if fut.result() == "compiled":
                    done += 1
            except Exception as e:  # noqa: BLE001 - reported; the kernel is compiled here
                errors.append(f"{type(e).__name__}: {e}")
    return done, errors


_worker_cc: contextlib.ExitStack | None = None


def _worker_init(cc: tuple, root: str) -> None:
    global _worker_cc
    os.environ[CACHE_DIR_ENV] = root
    _worker_cc = contextlib.ExitStack()
    _worker_cc.enter_context(compile_for_cc(cc))


def _worker_compile(recipe: Recipe, argtypes: tuple) -> str:
    return compile_into_cache(recipe.build(), argtypes)


__all__ = [
    "CacheStats",
    "CompileReport",
    "KernelCache",
    "Recipe",
    "cache_root",
    "cached",
    "cached_factory",
    "compile_for_cc",
    "compile_into_cache",
    "enabled",
    "install",
    "precompile",
    "stats",
    "traced_launches",
]
