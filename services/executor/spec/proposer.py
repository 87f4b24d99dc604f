"""The proposer interface: given decoding requests, suggest up to k next tokens for each.

A proposer only suggests; the target model decides. Acceptance (spec/acceptance.py) keeps the
target's output distribution exactly, whatever is proposed, so a proposer affects speed only.
Proposals here are deterministic (a point mass q), which is what lets acceptance reuse the
target's own seeded draw (see acceptance.py).

A proposer that runs a model of its own (a draft model, an EAGLE head) owns it: the weights,
its KV cache (in the target's block layout, so the block manager's blocks cover it) and its
CUDA graphs. The runner builds the proposer at start-up (make_proposer) and calls the start-up
hooks below in order; the engine binds it to the block manager and then, each step, calls
`propose` before scheduling and `observe` with the runner's output. A proposer without a model
keeps the hooks' defaults (nothing to load, no KV, no graphs).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Any

from voltserve.services.executor.request import Request, RunnerOutput
from voltserve.services.executor.spec.registry import METHODS

if TYPE_CHECKING:
    import torch
    from voltserve.services.executor.block_manager import BlockManager
    from voltserve.services.executor.model_runner import ModelRunner
    from voltserve.services.executor.spec.config import SpeculativeConfig


class Proposer(ABC):
    # Whether the runner hands out the target's last hidden states (RunnerOutput.hidden_states).
    needs_hidden_states = False

    def __init__(self, num_speculative_tokens: int) -> None:
        self.k = num_speculative_tokens

    @classmethod
    def from_config(cls, config: SpeculativeConfig) -> Proposer:
        return cls(config.num_speculative_tokens)

    # ---- start-up, called by the runner in this order ----------------------------------------

    def load(self, runner: ModelRunner) -> None:
        """Load the proposer's own model beside the target's, before the KV sizing (so that its
        weights count against the memory)."""
        return None

    def use_ops(self, ops) -> None:
        """The kernel dispatch the target runs with (decided after load)."""
        return None

    def kv_row_elements(self) -> int:
        """Elements of one token's K (or V) in one layer of its own KV cache (0: none)."""
        return 0

    def kv_bytes_per_block(self, runner: ModelRunner) -> int:
        """Bytes the proposer's own KV cache adds per KV block (the KV sizing divides by it)."""
        return 0

    def graph_logits_rows(self, verify_rows: int) -> int:
        """Logits rows its CUDA graphs hold beyond the verify graphs' verify_rows (the KV
        sizing keeps them free)."""
        return 0

    def alloc_kv(self, runner: ModelRunner, num_blocks: int) -> None:
        """Allocate its KV cache of num_blocks blocks (the target's count, after the sizing)."""
        return None

    def make_graphs(
        self,
        runner: ModelRunner,
        decode_sizes: list[int],
        verify_sizes: list[int],
        kv: list | None = None,
        capture: bool = True,
    ) -> dict[str, Any]:
        """Its CUDA graphs (spec/graphs.py) by name, for the decode graphs' and the verify
        graphs' batch sizes, on kv (None: a one-block cache); capture=False: the static buffers
        only (the start-up trace runs their forwards, the CPU tests emulate them)."""
        return {}

    def capture_graphs(
        self, runner: ModelRunner, decode_sizes: list[int], verify_sizes: list[int]
    ) -> None:
        """Capture make_graphs' graphs on its own KV cache and use them from now on."""
        return None

    def scrub_kv_blocks(self, idx: torch.Tensor) -> None:
        """Zero these blocks of its KV cache (ModelRunner.scrub_kv_blocks says why)."""
        return None

    # ---- serving, called by the engine ---------------------------------------------------

    def bind(self, block_manager: BlockManager) -> None:
        """The block manager whose blocks the requests (and its KV cache) hold."""
        return None

    def observe(self, output: RunnerOutput) -> None:
        """Every step's runner output, before the engine post-processes it and before the next
        propose() (a proposer that reads the target's hidden states keeps them here)."""
        return None

    @abstractmethod
    def propose(self, requests: list[Request]) -> list[list[int]]:
        """Up to self.k proposed tokens per request (an empty list: none), in order. Each
        request is decoding: its next input is request.last_token_id."""


def make_proposer(config: SpeculativeConfig) -> Proposer:
    """The proposer a SpeculativeConfig names (spec/registry.py)."""
    method = METHODS.get(config.method)
    if method is None:
        raise ValueError(f"no proposer for method {config.method!r}")
    return method.proposer_class().from_config(config)
