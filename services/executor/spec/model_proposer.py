"""What a proposer that runs a model of its own (a draft model, an EAGLE head) does the same
way: it holds the loaded model (`draft`: .model and .arch) and a KV cache in the target's block
layout (the slots of the requests' own target blocks), sized, allocated and scrubbed with the
target's."""

from __future__ import annotations

import torch
from voltserve.services.executor.kv_sizing import alloc_kv_caches
from voltserve.services.executor.spec.proposer import Proposer


def alloc_proposer_kv(runner, num_blocks: int, arch) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """A KV cache of the target's block layout for a proposer's own model (its layers and
    heads, whole: speculation runs without tensor parallelism)."""
    return alloc_kv_caches(runner, num_blocks, arch=arch)


class ModelProposer(Proposer):
    # The method, named in the error when the engine binds a proposer whose model was never
    # loaded.
    what = "speculative"

    def __init__(self, num_speculative_tokens: int, path: str) -> None:
        super().__init__(num_speculative_tokens)
        self.path = path  # the checkpoint folder ("model" of --speculative-config)
        self.runner = None
        self.bm = None
        self.draft = None  # the loaded model: .model and .arch
        self.kv: list[tuple[torch.Tensor, torch.Tensor]] = []

    @classmethod
    def from_config(cls, config) -> ModelProposer:
        return cls(config.num_speculative_tokens, config.model)

    @property
    def kv_scales_dir(self) -> str | None:
        """The folder whose k_scale / v_scale tensors scale its e4m3 KV cache (kv_quant.py):
        its own checkpoint's."""
        return self.path

    def use_ops(self, ops) -> None:
        self.draft.model.ops = ops

    def kv_row_elements(self) -> int:
        """Elements of one token's K (or V) in one layer of its cache."""
        return self.draft.arch.num_kv_heads * self.draft.arch.head_dim

    def kv_bytes_per_block(self, runner) -> int:
        a = self.draft.arch
        elem = torch.empty((), dtype=runner.kv_cache_dtype).element_size()
        return a.num_layers * 2 * a.num_kv_heads * runner.block_size * a.head_dim * elem

    def alloc_kv(self, runner, num_blocks: int) -> None:
        self.kv = alloc_proposer_kv(runner, num_blocks, self.draft.arch)

    def scrub_kv_blocks(self, idx: torch.Tensor) -> None:
        for k, v in self.kv:
            k.index_fill_(0, idx, 0)
            v.index_fill_(0, idx, 0)

    def bind(self, block_manager) -> None:
        if self.draft is None:
            raise ValueError(f"the {self.what} method needs a runner that loaded its model")
        self.bm = block_manager
