"""Tiny random-weight checkpoints of each supported architecture, built with transformers' own
config classes and a locally trained byte-level BPE tokenizer. Built once per test session into a
temporary folder (removed at exit)."""

from __future__ import annotations

import atexit
import functools
import shutil
import tempfile
from pathlib import Path

ARCHS = ("llama", "mistral", "qwen2", "qwen3")

# Small on purpose: the whole model suite must run in well under a minute on 2 CPU cores.
TINY = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
)

# What makes each checkpoint exercise its architecture's distinct feature.
ARCH_OVERRIDES: dict[str, dict] = {
    # llama3 rope scaling (Llama 3.1); original context below the test lengths' scale
    "llama": dict(
        tie_word_embeddings=False,
        rope_parameters={
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
    ),
    # a plain config (its sliding window is longer than any test sequence)
    "mistral": dict(tie_word_embeddings=False, sliding_window=256),
    # qkv bias (always on for qwen2) and tied embeddings
    "qwen2": dict(tie_word_embeddings=True),
    # q/k RMSNorm per head; head_dim different from hidden/heads, as in real Qwen3
    "qwen3": dict(tie_word_embeddings=False, head_dim=32),
}


@functools.cache
def _root() -> Path:
    d = Path(tempfile.mkdtemp(prefix="voltserve-ckpt-"))
    atexit.register(shutil.rmtree, d, ignore_errors=True)
    return d


@functools.cache
def tokenizer():
    from voltserve.services.executor.demo_model import build_tokenizer

    return build_tokenizer(vocab_size=384)


@functools.cache
def checkpoint(arch: str, shard_size: str | None = None) -> Path:
    """Folder of a tiny `arch` checkpoint (cached per session; do not modify it)."""
    from voltserve.services.executor.demo_model import write_checkpoint

    name = arch + (f"-sharded-{shard_size}" if shard_size else "")
    overrides = dict(TINY)
    overrides.update(ARCH_OVERRIDES[arch])
    return write_checkpoint(
        _root() / name,
        arch=arch,
        size="tiny",
        seed=ARCHS.index(arch) + 1,
        tokenizer=tokenizer(),
        shard_size=shard_size,
        **overrides,
    )


def copy_checkpoint(arch: str, dest: Path) -> Path:
    """A private copy to break on purpose (loader error tests)."""
    shutil.copytree(checkpoint(arch), dest)
    return dest
