"""Run by tests/kernels/test_compile_cache.py in a fresh process (real numba, no simulator, no
GPU): compile a kernel module's PROBE kernels for a compute capability into the kernel cache
($VOLTSERVE_CACHE_DIR), load each back through numba's dispatcher hook, and print one JSON line
per kernel: its status ("compiled" or "hit"), entry path, and the SHA-256 of the cubin stored and
of the cubin loaded.

    python tests/kernels/compile_cache_probe.py MODULE_FILE CC [NAME ...]
    python tests/kernels/compile_cache_probe.py --precompile MODULE_FILE CC
"""

from __future__ import annotations

import hashlib
import importlib
import json
import os
import sys

os.environ["NUMBA_ENABLE_CUDASIM"] = "0"

from numba.core import sigutils  # noqa: E402
from voltserve.kernels.runtime import compile_cache  # noqa: E402


def load_module(path: str):
    """Import the file by its name from its folder (compile workers import it the same way:
    a spawned process inherits sys.path)."""
    folder, name = os.path.split(os.path.abspath(path))
    sys.path.insert(0, folder)
    return importlib.import_module(name.removesuffix(".py"))


def sha(obj) -> str:
    return hashlib.sha256(bytes(obj.code)).hexdigest()


def precompile(path: str, cc: tuple) -> None:
    """precompile() of every PROBE kernel with two workers; prints its report."""
    with compile_cache.compile_for_cc(cc):
        mod = load_module(path)
        launches = [(d, tuple(sigutils.normalize_signature(sig)[0])) for _, d, sig in mod.PROBE]
        report = compile_cache.precompile(launches + launches[:1], jobs=2, bind=False)
    print(json.dumps({"report": report.__dict__}), flush=True)


def main(argv: list[str]) -> None:
    if argv[0] == "--precompile":
        precompile(argv[1], tuple(int(x) for x in argv[2].split(".")))
        return
    path, cc_text, *names = argv
    cc = tuple(int(x) for x in cc_text.split("."))
    with compile_cache.compile_for_cc(cc) as cc3:
        mod = load_module(path)
        for name, dispatcher, sig in mod.PROBE:
            if names and name not in names:
                continue
            argtypes = tuple(sigutils.normalize_signature(sig)[0])
            status = compile_cache.compile_into_cache(dispatcher, argtypes)
            entry_path = dispatcher._cache.path_for(argtypes, cc3)
            stored = compile_cache.read_entry(entry_path)
            kernel = dispatcher._cache.load_overload(argtypes, dispatcher.targetctx)
            loaded = kernel._codelibrary._cubin_cache[cc3] if kernel is not None else None
            print(
                json.dumps(
                    {
                        "name": name,
                        "status": status,
                        "path": str(entry_path),
                        "stored": hashlib.sha256(stored["cubin"]).hexdigest() if stored else None,
                        "loaded": sha(loaded) if loaded is not None else None,
                        "entry_name": kernel.entry_name if kernel is not None else None,
                    }
                ),
                flush=True,
            )
    print(json.dumps({"stats": compile_cache.stats.snapshot()}), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
