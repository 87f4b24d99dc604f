"""Run by tests/kernels/test_compile_cache.py in a fresh process (real numba, no simulator, no
GPU): compile a kernel module's PROBE kernels for a compute capability into the kernel cache
($VOLTSERVE_CACHE_DIR), load each back through numba's dispatcher hook, and print one JSON line
per kernel: its status ("compiled" or "hit"), entry path, and the SHA-256 of the cubin stored and
of the cubin loaded.

    python tests/kernels/compile_cache_probe.py MODULE_FILE CC [NAME ...]
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import sys

os.environ["NUMBA_ENABLE_CUDASIM"] = "0"

from numba.core import sigutils  # noqa: E402
from voltserve.kernels import compile_cache  # noqa: E402


def load_module(path: str):
    spec = importlib.util.spec_from_file_location("vs_cache_probe_kernels", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # the cache keys a kernel on its module's file
    spec.loader.exec_module(mod)
    return mod


def sha(obj) -> str:
    return hashlib.sha256(bytes(obj.code)).hexdigest()


def main(argv: list[str]) -> None:
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
