"""The one table of ops and kernels, read by everything that needs to know them.

Each kernel family (a subpackage of voltserve.kernels) declares, in its `__init__.py`:

- `OPS`: the ops it serves (`Op`): the op's name, its torch reference, the modules searched for
  the launcher `<op>_cuda`, and the conditions under which the launcher serves (storage dtypes,
  KV block sizes, its own off switch). `kernels/dispatch.py` reads them to pick, per op, the
  launcher or the reference.
- `KERNELS`: its numba.cuda kernels (`KernelSpec`) with the signatures `voltserve check-kernels`
  compiles them with (fp16 and fp32 variants where the kernel serves both). Kernels built per
  shape by a factory are listed by their representative module-level instances.

How a kernel's compiled code is kept on disk is the kernel's own decorator
(`runtime/compile_cache.cached` / `cached_factory`, on the definition): a property of how the
kernel is built, not a list to keep in step with this one.

Modules are dotted paths inside voltserve.kernels (subpackage.file). Array layouts in signatures
matter: `[:, ::1]` is C-contiguous, `[:, :]` is any layout (for strided views such as slices of
the fused qkv projection). This module imports no torch or numba: check-kernels reads it first.
"""

from __future__ import annotations

import functools
import importlib
from dataclasses import dataclass

# The kernel families, in the order their ops and kernels are listed.
FAMILIES = (
    "elementwise",
    "attention",
    "sampling",
    "runtime",
    "linear",
    "moe",
    "linear_attention",
)

# Storage dtypes a launcher handles unless its op says otherwise (numba has no bf16 arrays).
DEFAULT_CUDA_DTYPES = ("float16", "float32")


@dataclass(frozen=True)
class Op:
    name: str
    reference: (
        str  # "module.function" of the torch reference, e.g. "elementwise.rmsnorm.rms_norm_ref"
    )
    launchers: tuple[str, ...]  # modules searched for `<name>_cuda`, in order
    # Storage dtypes (torch attribute names) the launcher takes; None: any (e.g. sampling, which
    # works on fp32 logits whatever the model's dtype). A module's `<name>_cuda_dtypes` overrides.
    cuda_dtypes: tuple[str, ...] | None = DEFAULT_CUDA_DTYPES
    block_sizes: tuple[int, ...] | None = None  # KV block sizes the launcher is written for
    env: str | None = None  # the op's own off switch: set to 0/false/no/off keeps the reference
    capturable_ref: bool = False  # the reference never syncs with the host (a graph can hold it)
    decode_graph: bool = False  # a decode step runs it inside a captured CUDA graph

    @property
    def reference_module(self) -> str:
        return self.reference.rsplit(".", 1)[0]

    @property
    def reference_name(self) -> str:
        return self.reference.rsplit(".", 1)[1]


@dataclass(frozen=True)
class KernelSpec:
    module: str  # dotted path inside voltserve.kernels, e.g. "elementwise.rmsnorm"
    attr: str  # the @cuda.jit dispatcher in it
    signatures: tuple[str, ...]

    @property
    def name(self) -> str:
        return f"{self.module}.{self.attr}"


def both(template: str) -> tuple[str, ...]:
    """The fp16 and fp32 variants of a signature written with {t} for the storage dtype."""
    return tuple(template.format(t=t) for t in ("float16", "float32"))


@functools.cache
def _families() -> tuple:
    return tuple(importlib.import_module(f"voltserve.kernels.{f}") for f in FAMILIES)


def ops() -> dict[str, Op]:
    """Every op, by name, family by family."""
    table: dict[str, Op] = {}
    for fam in _families():
        for op in fam.OPS:
            if op.name in table:
                raise ValueError(f"op {op.name!r} is declared twice ({fam.__name__})")
            table[op.name] = op
    return table


def kernels() -> list[KernelSpec]:
    """Every registered kernel, family by family."""
    return [spec for fam in _families() for spec in fam.KERNELS]
