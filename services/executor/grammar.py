"""Grammar compilation for structured outputs, off the engine thread.

xgrammar compiles a constraint (shared/structured.py) against the model's vocabulary into a
CompiledGrammar (per-state token masks precomputed, so filling a request's mask each step is
cheap). Compiling a JSON schema takes milliseconds to a second, so it runs in a worker thread:
the engine submits it when the request arrives and admits the request once the future is done;
other requests keep stepping meanwhile. xgrammar's compiler keeps a cache keyed by the constraint,
so a repeated schema compiles once. The vocabulary's UTF-8 table (utf8_guard.py) is built with
the compiler: the grammar's masks alone let a string hold bytes that are not UTF-8.

The vocabulary is the model's, not the tokenizer's: the lm_head may have more rows than the
tokenizer has tokens (padded for the GEMMs), and the mask must cover every logit; xgrammar marks
the padding ids as never allowed. Built lazily (the first structured request pays for it), so a
server that never sees one never loads xgrammar.
"""

from __future__ import annotations

import logging
import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from voltserve.services.executor.utf8_guard import Utf8Table
from voltserve.shared.structured import compile_with

logger = logging.getLogger(__name__)

COMPILE_THREADS_ENV = "VOLTSERVE_GRAMMAR_THREADS"


class GrammarCompilerPool:
    def __init__(
        self,
        tokenizer_source: Any,
        vocab_size: int,
        stop_token_ids: list[int],
        max_threads: int | None = None,
    ) -> None:
        """tokenizer_source: a model folder (its tokenizer files) or a transformers tokenizer."""
        self.tokenizer_source = tokenizer_source
        self.vocab_size = vocab_size
        self.stop_token_ids = list(stop_token_ids)
        if max_threads is None:
            max_threads = int(
                os.environ.get(COMPILE_THREADS_ENV, "") or min(8, os.cpu_count() or 1)
            )
        self.max_threads = max(1, max_threads)
        # One submitting thread: xgrammar parallelises a compilation itself (max_threads).
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar-compile")
        self._compiler = None
        self._utf8 = None
        self._lock = threading.Lock()

    def _get_compiler(self):
        with self._lock:
            if self._compiler is None:
                import xgrammar as xgr

                tok = self.tokenizer_source
                if isinstance(tok, (str, os.PathLike)):
                    from voltserve.shared.gguf_files import is_gguf, load_tokenizer

                    if is_gguf(tok):
                        # A GGUF model carries its tokenizer in its metadata.
                        tok = load_tokenizer(tok)
                    else:
                        from transformers import AutoTokenizer

                        tok = AutoTokenizer.from_pretrained(str(tok))
                if len(tok) > self.vocab_size:
                    raise ValueError(
                        f"the tokenizer has {len(tok)} tokens but the model only "
                        f"{self.vocab_size} logits"
                    )
                info = xgr.TokenizerInfo.from_huggingface(
                    tok, vocab_size=self.vocab_size, stop_token_ids=self.stop_token_ids or None
                )
                self._compiler = xgr.GrammarCompiler(info, max_threads=self.max_threads)
                self._utf8 = Utf8Table.from_tokenizer_info(info)
                logger.info(
                    "grammar compiler ready (%s vocabulary of %d)", info.vocab_type, info.vocab_size
                )
            return self._compiler

    def utf8_table(self) -> Utf8Table:
        """The vocabulary's UTF-8 table (utf8_guard.py), built with the compiler."""
        self._get_compiler()
        assert self._utf8 is not None
        return self._utf8

    def compile(self, constraint: dict[str, Any]):
        """Compile now, on the calling thread (ConstraintError when it cannot be built)."""
        return compile_with(self._get_compiler(), constraint)

    def submit(self, constraint: dict[str, Any]) -> Future:
        return self._pool.submit(self.compile, constraint)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
