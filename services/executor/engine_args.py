"""The engine flags, declared once: every command that builds an engine (`voltserve serve`,
`executor`, `generate`, `warmup`, the benchmarks in load_tests) adds them from ENGINE_FLAGS and
builds its EngineConfig with `engine_config`, so a flag means the same everywhere and no field
is dropped on the way. Defaults are EngineConfig's own.

Light on imports: `--help` of every command reads this module.
"""

from __future__ import annotations

import argparse
import dataclasses
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from voltserve.services.executor.spec.config import SpeculativeConfig
from voltserve.shared.config import KV_CACHE_DTYPES, QUANTIZATION_METHODS, EngineConfig

DTYPES = ("auto", "float16", "half", "bfloat16", "float32", "float")
_DTYPE_ALIASES = {"half": "float16", "float": "float32"}


def graph_sizes(text: str) -> tuple[int, ...]:
    """--cuda-graph-sizes: "1,8,64" -> (1, 8, 64); every size a positive integer."""
    try:
        sizes = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"not a comma-separated list of integers: {text!r}"
        ) from None
    if not sizes or min(sizes) < 1:
        raise argparse.ArgumentTypeError(f"batch sizes must be positive integers: {text!r}")
    return sizes


def speculative_config(text: str) -> SpeculativeConfig:
    """--speculative-config: a JSON object with vLLM's keys, parsed and validated here (the one
    place), so a bad one is a usage error naming the key, not a failure at engine start."""
    try:
        return SpeculativeConfig.from_json(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9}
_UNITS.update({"gb": 10**9, "t": 10**12, "tb": 10**12})
_UNITS.update({"kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40})


def memory_size(text: str) -> int:
    """--max-gpu-memory: "17179869184", "16GiB", "16GB", "16g", "1.5 TiB" -> bytes."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", text)
    unit = m[2].lower() if m else None
    if m is None or unit not in _UNITS:
        raise argparse.ArgumentTypeError(
            f"not a memory size: {text!r} (bytes, or a number with KB/MB/GB/TB or KiB/MiB/GiB/TiB)"
        )
    n = int(float(m[1]) * _UNITS[unit])
    if n <= 0:
        raise argparse.ArgumentTypeError(f"memory size must be positive: {text!r}")
    return n


@dataclass(frozen=True)
class EngineFlag:
    """One command-line flag of one EngineConfig field."""

    field: str
    names: tuple[str, ...]
    help: str
    type: Callable[[str], Any] | None = None
    choices: tuple[str, ...] | None = None
    # A store_true flag: `switch` sets the field True, `negate` sets it False.
    switch: bool = False
    negate: bool = False
    # --X / --no-X for a field whose default None leaves the choice to the engine.
    either: bool = False

    @property
    def dest(self) -> str:
        return self.names[-1].lstrip("-").replace("-", "_")

    def default(self) -> Any:
        return _DEFAULTS[self.field]

    def to_argv(self, value: Any) -> list[str]:
        """The flag that gives `value` (nothing for the default)."""
        if value == self.default():
            return []
        flag = self.names[-1]
        if self.either:
            return [flag if value else "--no-" + flag[2:]]
        if self.switch or self.negate:
            return [flag]
        if self.field == "cuda_graph_sizes":
            return [flag, ",".join(str(s) for s in value)]
        if self.field == "speculative_config":
            return [flag, value.to_json()]
        return [flag, str(value)]


_DEFAULTS = {
    f.name: f.default if f.default is not dataclasses.MISSING else None
    for f in dataclasses.fields(EngineConfig)
}

ENGINE_FLAGS: tuple[EngineFlag, ...] = (
    EngineFlag("model", ("--model",), "Hugging Face checkpoint folder or GGUF file / folder"),
    EngineFlag(
        "dtype",
        ("--dtype",),
        "weights and activations: auto (fp16 on CUDA, fp32 on CPU), float16, bfloat16, float32",
        choices=DTYPES,
    ),
    EngineFlag("device", ("--device",), "auto | cpu | cuda | cuda:N"),
    EngineFlag(
        "max_model_len",
        ("--max-model-len",),
        "context length (default: the model's; capped at its sliding window and at what the KV "
        "cache holds)",
        type=int,
    ),
    EngineFlag("max_num_seqs", ("--max-num-seqs",), "most requests in one step", type=int),
    EngineFlag(
        "max_num_batched_tokens",
        ("--max-num-batched-tokens",),
        "token budget of one step (chunked prefill follows from it)",
        type=int,
    ),
    EngineFlag("block_size", ("--block-size",), "tokens per KV block", type=int),
    EngineFlag(
        "num_kv_blocks",
        ("--num-kv-blocks",),
        "fixed KV cache size in blocks (default: sized from memory)",
        type=int,
    ),
    EngineFlag(
        "gpu_memory_utilization",
        ("--gpu-memory-utilization",),
        "share of the GPU's memory the executor may use (`serve` splits it between executors "
        "sharing a GPU)",
        type=float,
    ),
    EngineFlag(
        "enable_prefix_caching",
        ("--enable-prefix-caching",),
        "automatic prefix caching (default: on, except for hybrid linear-attention models, "
        "which refuse it)",
        either=True,
    ),
    EngineFlag("enforce_eager", ("--enforce-eager",), "no CUDA graphs", switch=True),
    EngineFlag(
        "cuda_graph_sizes",
        ("--cuda-graph-sizes",),
        "decode batch sizes to capture, comma-separated (default 1,2,4,8,16,24,...)",
        type=graph_sizes,
    ),
    EngineFlag(
        "tensor_parallel_size",
        ("-tp", "--tensor-parallel-size"),
        "GPUs (one process each) that run the model as one executor; rank r uses the r-th "
        "visible GPU (`serve`: --executors groups of this many)",
        type=int,
    ),
    EngineFlag(
        "seed",
        ("--seed",),
        "seeds the engine's choice of per-request seeds for requests that give none",
        type=int,
    ),
    EngineFlag(
        "speculative_config",
        ("--speculative-config",),
        'speculative decoding, vLLM\'s JSON keys: {"method": "ngram", '
        '"num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 4}; '
        'methods "draft_model" and "eagle" take "model": the draft / EAGLE head folder; '
        '"mtp" reads the target checkpoint\'s own MTP layers',
        type=speculative_config,
    ),
    EngineFlag(
        "quantization",
        ("--quantization",),
        "force the quantization method (default: from the checkpoint)",
        choices=QUANTIZATION_METHODS,
    ),
    EngineFlag(
        "max_gpu_memory",
        ("--max-gpu-memory",),
        "GPU memory budget per card (bytes, or 16GiB / 16GB ...): KV sizing uses min(card, budget)",
        type=memory_size,
    ),
    EngineFlag(
        "kv_cache_dtype",
        ("--kv-cache-dtype",),
        "KV cache storage: auto (the run dtype), fp16, fp8 (= fp8_e4m3, scaled by the "
        "checkpoint's k_scale / v_scale, else 1.0) or fp8_e5m2: one byte per element, about "
        "twice the KV blocks",
        choices=KV_CACHE_DTYPES,
    ),
)


def add_engine_flags(p: argparse.ArgumentParser) -> None:
    """Every engine flag, with EngineConfig's defaults; --model is required."""
    g = p.add_argument_group("engine")
    for f in ENGINE_FLAGS:
        if f.either:
            g.add_argument(
                *f.names, dest=f.dest, action=argparse.BooleanOptionalAction, help=f.help
            )
        elif f.switch or f.negate:
            g.add_argument(*f.names, dest=f.dest, action="store_true", help=f.help)
        elif f.field == "model":
            g.add_argument(*f.names, dest=f.dest, required=True, help=f.help)
        else:
            g.add_argument(
                *f.names,
                dest=f.dest,
                type=f.type,
                choices=f.choices,
                default=f.default(),
                help=f.help,
            )


def engine_config(args: argparse.Namespace | None = None, **fields: Any) -> EngineConfig:
    """The EngineConfig of parsed engine flags, with `fields` (EngineConfig field names) set
    over them: the one builder, for commands and for benchmarks that set fields themselves.
    ValueError (naming the field) for a value no flag would have accepted."""
    values: dict[str, Any] = {}
    for f in ENGINE_FLAGS:
        if args is not None:
            v = getattr(args, f.dest)
            values[f.field] = not v if f.negate else v
    unknown = sorted(set(fields) - set(_DEFAULTS))
    if unknown:
        raise ValueError(f"not EngineConfig fields: {unknown}")
    values.update(fields)
    if "model" not in values:
        raise ValueError("model is required")
    dtype = values.get("dtype", "auto")
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {DTYPES}, got {dtype!r}")
    values["dtype"] = _DTYPE_ALIASES.get(dtype, dtype)
    spec = fields.get("speculative_config")
    if spec is not None and not isinstance(spec, SpeculativeConfig):
        # Set in code as its JSON object, not through the flag (whose type parsed it already).
        values["speculative_config"] = SpeculativeConfig.from_dict(spec)
    sizes = values.get("cuda_graph_sizes")
    if sizes is not None:
        values["cuda_graph_sizes"] = tuple(int(s) for s in sizes)
    return EngineConfig(**values)


def engine_argv(config: EngineConfig) -> list[str]:
    """The flags that rebuild `config` in a child process (`serve` -> each executor):
    parse_args(engine_argv(c)) gives c back. Fields without a flag must hold their defaults."""
    out: list[str] = []
    for f in ENGINE_FLAGS:
        out += f.to_argv(getattr(config, f.field))
    flagged = {f.field for f in ENGINE_FLAGS}
    for name, default in _DEFAULTS.items():
        if name not in flagged and getattr(config, name) != default:
            raise ValueError(f"EngineConfig.{name} has no flag; a child cannot be given it")
    return out
