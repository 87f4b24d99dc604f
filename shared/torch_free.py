"""The gateway, which only tokenizes, loads transformers without torch.

transformers imports torch whenever it is installed, even to build a tokenizer: that import is
most of the gateway's start-up (about 2.5 of 5 CPU seconds on the CI machine), paid again by
every gateway that starts. transformers decides once, when it is imported, whether
torch is there: imported while torch is hidden, it takes its torch-free path, which builds the
same tokenizers (tokenizers' Rust backend, jinja chat templates). torch is hidden for that
import only: a library that needs it later imports it then.

Not the renderer: it builds grammars with xgrammar, which imports torch, and its first
structured-output request would pay that import while other requests wait behind it.

GGUF is the exception: transformers reads a GGUF file's tokenizer through its torch loader.
"""

from __future__ import annotations

import logging
import sys

from voltserve.shared.gguf_files import is_gguf

# What transformers logs once when it finds no torch: expected here, so not logged.
_NO_TORCH_NOTICE = "PyTorch was not found"


def keep_torch_out(model: str, tokenizer: str | None = None) -> None:
    """Call first in the main() of a service that never runs a model nor builds a grammar, with the model and
    tokenizer it will load a tokenizer from. A process that already imported torch or
    transformers (tests that build a service in their own process) is left as it is."""
    if tokenizer is None and is_gguf(model):
        return
    if "torch" in sys.modules or "transformers" in sys.modules:
        return
    logging.getLogger("transformers").addFilter(
        lambda record: not str(record.msg).startswith(_NO_TORCH_NOTICE)
    )
    # None in sys.modules: `import torch` raises ImportError, importlib.util.find_spec says None.
    sys.modules["torch"] = None  # type: ignore[assignment]
    try:
        import transformers  # noqa: F401 - its torch check runs (and is cached) here
    finally:
        del sys.modules["torch"]
