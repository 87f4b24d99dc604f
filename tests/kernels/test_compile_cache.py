"""The kernel cache (kernels/runtime/compile_cache.py): compiled code is stored and loaded for
cc 7.0 without a GPU (the CUDA 12 NVVM and nvJitLink of numba-cuda[cu12]), in fresh processes.

- a hit loads the cubin that was stored (a plain kernel, a generated-source kernel, a kernel
  linking the WMMA C++), and a later process finds it without compiling;
- a changed kernel source, other factory arguments, or another compute capability miss;
- a truncated or corrupted entry is reported, deleted and rebuilt, never loaded;
- two processes filling one cache at once both succeed.

Every run uses a temporary cache folder (tmp_path), never the user's.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from voltserve.kernels.runtime.compile_cache import (
    CorruptEntry,
    decode_entry,
    encode_entry,
    write_atomic,
)

PROBE = Path(__file__).with_name("compile_cache_probe.py")

# Compiling for cc 7.0 without a GPU is CI's job (CUDA 12 NVVM from pip); GPU hosts here run a
# CUDA 13 toolkit, which dropped Volta (tests/gpu/test_compile_cache_gpu.py covers them).
needs_cc70_toolchain = pytest.mark.skipif(
    torch.cuda.is_available(), reason="cc 7.0 compiles run in CI with the CUDA 12 NVVM"
)

KERNELS = """
import functools
from numba import cuda
from voltserve.kernels.runtime.compile_cache import cached, cached_factory

SIG = "void(float32[::1], float32[::1])"


@cached
@cuda.jit
def scale_kernel(out, x):
    i = cuda.grid(1)
    if i < x.shape[0]:
        out[i] = x[i] * SCALE


@cached_factory
@functools.cache
def shift_kernel(k: int):
    src = (
        "def kernel(out, x):\\n"
        "    i = cuda.grid(1)\\n"
        "    if i < x.shape[0]:\\n"
        f"        out[i] = x[i] + {k}\\n"
    )
    ns = {"cuda": cuda}
    exec(compile(src, f"<shift {k}>", "exec"), ns)
    return cuda.jit(ns["kernel"])


PROBE = [
    ("scale", scale_kernel, SIG),
    ("shift1", shift_kernel(1), SIG),
    ("shift2", shift_kernel(2), SIG),
]
"""

WMMA = """
from voltserve.kernels.runtime.wmma_ptx import wmma_gemm16_kernel

PROBE = [("wmma", wmma_gemm16_kernel, "void(float32[::1], float16[::1], float16[::1], int32, int32)")]
"""


def write_kernels(path: Path, scale: str = "2.0") -> Path:
    path.write_text(KERNELS.replace("SCALE", scale))
    return path


def probe(module: Path, cache: Path, cc: str = "7.0", *names: str, check: bool = True):
    """(per-kernel JSON rows by name, stats, stderr) of one probe process."""
    proc = subprocess.run(
        [sys.executable, str(PROBE), str(module), cc, *names],
        capture_output=True,
        text=True,
        env=probe_env(cache),
        timeout=600,
    )
    if check:
        assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    stats = next((r["stats"] for r in rows if "stats" in r), None)
    return {r["name"]: r for r in rows if "name" in r}, stats, proc.stderr


def probe_env(cache: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM"}
    env["VOLTSERVE_CACHE_DIR"] = str(cache)
    return env


@needs_cc70_toolchain
def test_hit_loads_the_stored_code_and_a_new_process_finds_it(tmp_path):
    mod = write_kernels(tmp_path / "kernels_a.py")
    cache = tmp_path / "cache"
    first, stats, _ = probe(mod, cache)
    assert {r["status"] for r in first.values()} == {"compiled"}, first
    assert stats["saved"] == 3 and stats["hits"] == 3, stats  # each loaded back at once
    for r in first.values():
        assert Path(r["path"]).is_file()
        assert r["loaded"] == r["stored"] is not None
    assert len({r["path"] for r in first.values()}) == 3  # factory arguments make distinct keys
    second, stats, _ = probe(mod, cache)
    assert {r["status"] for r in second.values()} == {"hit"}, second
    assert stats["saved"] == 0 and stats["misses"] == 0, stats
    for name, r in second.items():
        assert r["path"] == first[name]["path"]
        assert r["loaded"] == first[name]["stored"]
        assert r["entry_name"] == first[name]["entry_name"]


@needs_cc70_toolchain
def test_a_kernel_linking_cuda_cpp_is_cached(tmp_path):
    mod = tmp_path / "wmma.py"
    mod.write_text(WMMA)
    cache = tmp_path / "cache"
    first, _, _ = probe(mod, cache)
    assert first["wmma"]["status"] == "compiled"
    second, stats, _ = probe(mod, cache)
    assert second["wmma"]["status"] == "hit" and stats["saved"] == 0
    assert second["wmma"]["loaded"] == first["wmma"]["stored"] is not None


@needs_cc70_toolchain
def test_changed_source_or_compute_capability_misses(tmp_path):
    cache = tmp_path / "cache"
    mod = write_kernels(tmp_path / "kernels_b.py")
    base, _, _ = probe(mod, cache, "7.0", "scale", "shift1")
    # Another compute capability: a different entry, compiled.
    other_cc, _, _ = probe(mod, cache, "7.5", "scale")
    assert other_cc["scale"]["status"] == "compiled"
    assert other_cc["scale"]["path"] != base["scale"]["path"]
    assert other_cc["scale"]["stored"] != base["scale"]["stored"]
    # The kernel's source changed (same file, same names): every kernel of it misses.
    write_kernels(mod, scale="3.0")
    changed, _, _ = probe(mod, cache, "7.0", "scale", "shift1")
    for name in ("scale", "shift1"):
        assert changed[name]["status"] == "compiled", name
        assert changed[name]["path"] != base[name]["path"], name
    assert changed["scale"]["stored"] != base["scale"]["stored"]


@needs_cc70_toolchain
@pytest.mark.parametrize("damage", ["truncate", "flip"])
def test_a_damaged_entry_is_rebuilt_with_a_warning(tmp_path, damage):
    cache = tmp_path / "cache"
    mod = write_kernels(tmp_path / "kernels_c.py")
    first, _, _ = probe(mod, cache, "7.0", "scale")
    path = Path(first["scale"]["path"])
    data = path.read_bytes()
    if damage == "truncate":
        path.write_bytes(data[: len(data) // 2])
    else:  # same length, one byte of the cubin changed
        i = len(data) - 100
        path.write_bytes(data[:i] + bytes([data[i] ^ 0xFF]) + data[i + 1 :])
    again, stats, err = probe(mod, cache, "7.0", "scale")
    assert "is corrupt" in err and str(path) in err, err
    assert stats["corrupt"] == 1, stats
    assert again["scale"]["status"] == "compiled"
    assert again["scale"]["loaded"] == again["scale"]["stored"] is not None
    decode_entry(path.read_bytes())  # the rebuilt entry is whole
    third, stats, err = probe(mod, cache, "7.0", "scale")
    assert third["scale"]["status"] == "hit" and stats["corrupt"] == 0, err


@needs_cc70_toolchain
def test_two_processes_fill_one_cache_at_once(tmp_path):
    cache = tmp_path / "cache"
    mod = write_kernels(tmp_path / "kernels_d.py")
    cmd = [sys.executable, str(PROBE), str(mod), "7.0"]
    procs = [
        subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=probe_env(cache)
        )
        for _ in range(2)
    ]
    outs = [p.communicate(timeout=600) for p in procs]
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, out + err
        rows = [json.loads(line) for line in out.splitlines() if '"name"' in line]
        assert len(rows) == 3 and all(r["loaded"] == r["stored"] is not None for r in rows)
    # No temporary files left behind; every entry whole; a third process only hits.
    assert not [p for p in cache.rglob("*.tmp")]
    for f in cache.rglob("*.vsk"):
        decode_entry(f.read_bytes())
    third, stats, _ = probe(mod, cache)
    assert {r["status"] for r in third.values()} == {"hit"} and stats["saved"] == 0


@needs_cc70_toolchain
def test_precompile_in_worker_processes_fills_the_cache_the_parent_reads(tmp_path):
    # The workers must compute the parent's keys: the parent then loads all, compiles none.
    cache = tmp_path / "cache"
    mod = write_kernels(tmp_path / "kernels_e.py")

    def report() -> dict:
        proc = subprocess.run(
            [sys.executable, str(PROBE), "--precompile", str(mod), "7.0"],
            capture_output=True,
            text=True,
            env=probe_env(cache),
            timeout=600,
        )
        assert proc.returncode == 0, proc.stdout + proc.stderr
        return json.loads(proc.stdout.strip().splitlines()[-1])["report"]

    cold = report()
    assert cold["launches"] == 4 and cold["kernels"] == 3, cold
    assert cold["workers"] == 2 and cold["worker_errors"] == [], cold
    assert cold["in_workers"] == 3 and cold["compiled"] == 0 and cold["loaded"] == 0, cold
    warm = report()
    assert warm["workers"] == 0 and warm["loaded"] == 3 and warm["compiled"] == 0, warm


def test_entry_framing_detects_truncation_and_corruption(tmp_path):
    body = bytes(range(256)) * 40
    data = encode_entry(body)
    assert decode_entry(data) == body
    for bad, what in (
        (data[:10], "shorter than the header"),
        (data[:-1], "truncated"),
        (data + b"x", "truncated"),
        (data[:-5] + b"\0" + data[-4:], "checksum"),
        (b"X" + data[1:], "not a voltserve"),
    ):
        with pytest.raises(CorruptEntry, match=what):
            decode_entry(bad)
    target = tmp_path / "sub" / "entry.vsk"
    write_atomic(target, data)
    write_atomic(target, data)  # replacing an entry is atomic too
    assert target.read_bytes() == data
    assert [p.name for p in target.parent.iterdir()] == ["entry.vsk"]  # no temporary left


def test_tests_never_use_the_users_cache():
    from voltserve.kernels.runtime.compile_cache import cache_root

    assert os.environ["VOLTSERVE_CACHE_DIR"]
    assert cache_root() == Path(os.environ["VOLTSERVE_CACHE_DIR"])
    assert cache_root() != Path.home() / ".cache" / "voltserve"
