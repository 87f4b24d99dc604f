"""Paged KV block allocation with reference counts and automatic prefix caching.

Every request owns a list of fixed-size blocks (block_ids); token i of a request lives in slot
block_ids[i // block_size] * block_size + i % block_size. A request's block_ids list only ever
grows by appending; any other change (free, preemption, admission) assigns a new list. The model
runner's block-table mirror relies on this to copy only the appended blocks each step.

Prefix caching: once a block is full of computed tokens, it is registered under a chain hash,
hash((parent_hash, tokens of the block)), so it names the whole prefix up to its end. A later
request whose prompt starts with the same tokens walks its own chain and takes a reference on
the matching blocks instead of recomputing them. A block whose last reference goes away keeps
its hash and waits in an LRU of cached free blocks: it can still be hit until a new allocation
needs it, and then the least recently freed one is evicted first. Plain (never registered)
free blocks are handed out before any cached one is evicted.

The hash is Python's 64-bit tuple hash, which is deterministic for ints. The table key keeps the
block's tokens next to the parent hash, so a hit also checks the tokens; only a collision of two
different parent chains could alias, which at 64 bits we accept.
"""

from __future__ import annotations

import logging
from collections import OrderedDict

from voltserve.services.executor.request import Request
from voltserve.services.executor.state_cache import StateSlots

logger = logging.getLogger(__name__)

# Parent "hash" of the first block of every sequence.
ROOT_HASH = 0

BlockKey = tuple[int, tuple[int, ...]]


class NoFreeBlocksError(RuntimeError):
    pass


class BlockManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int = 16,
        enable_prefix_caching: bool = True,
        state_slots: StateSlots | None = None,
    ):
        """state_slots: a model with per-request linear-attention state (state_cache.py): each
        request also takes a slot when it gets its first blocks and gives it back with them."""
        if num_blocks < 1:
            raise ValueError(f"the KV cache needs at least one block, got {num_blocks}")
        if block_size < 1:
            raise ValueError(f"block_size must be positive, got {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.state_slots = state_slots
        self.ref_counts = [0] * num_blocks
        # The key a block is registered under in the cache table (None: not in the table).
        self.block_key: list[BlockKey | None] = [None] * num_blocks
        # Free blocks that hold no cached prefix; a stack (pop from the end).
        self._free_plain: list[int] = list(range(num_blocks - 1, -1, -1))
        # Free blocks that still hold a cached prefix, least recently freed first.
        self._free_cached: OrderedDict[int, None] = OrderedDict()
        # (parent hash, block tokens) -> block id, for full computed blocks.
        self._table: dict[BlockKey, int] = {}
        # Per request: table keys of its full blocks and their chain hashes (extended lazily,
        # kept across preemption since a request's tokens only ever grow), and how many of its
        # blocks are registered in the table already.
        self._keys: dict[str, list[BlockKey]] = {}
        self._hashes: dict[str, list[int]] = {}
        self._num_registered: dict[str, int] = {}
        # Prefix-cache counters in tokens, like vLLM: queries = tokens looked up at admission,
        # hits = tokens served from the cache.
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0

    # ---- state -------------------------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        return len(self._free_plain) + len(self._free_cached)

    @property
    def num_cached_free_blocks(self) -> int:
        return len(self._free_cached)

    @property
    def usage(self) -> float:
        """Fraction of blocks referenced by some request (cached free blocks count as free)."""
        return 1.0 - self.num_free_blocks / self.num_blocks

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # ---- hashing -----------------------------------------------------------------------------

    def _block_tokens(self, request: Request, index: int) -> tuple[int, ...]:
        # Slice prompt and output separately: Request.all_token_ids copies the whole sequence.
        bs = self.block_size
        start, end = index * bs, (index + 1) * bs
        prompt = request.prompt_token_ids
        p = len(prompt)
        if end <= p:
            return tuple(prompt[start:end])
        out = request.output_token_ids
        if start >= p:
            return tuple(out[start - p : end - p])
        return tuple(prompt[start:]) + tuple(out[: end - p])

    def _chain(self, request: Request, num_full_blocks: int) -> list[BlockKey]:
        """Table keys of the request's first num_full_blocks blocks; only new ones are built."""
        rid = request.request_id
        keys = self._keys.setdefault(rid, [])
        hashes = self._hashes.setdefault(rid, [])
        for i in range(len(keys), num_full_blocks):
            key = (hashes[-1] if hashes else ROOT_HASH, self._block_tokens(request, i))
            keys.append(key)
            hashes.append(hash(key))
        return keys

    # ---- admission ---------------------------------------------------------------------------

    def match_prefix(self, request: Request) -> list[int]:
        """Cached blocks that hold a prefix of the request's tokens. No side effects on blocks.

        Never the whole sequence: at least one token is left to compute, so the step that
        computes it yields the logits the next token is sampled from.
        """
        if not self.enable_prefix_caching:
            return []
        if request.params.prompt_logprobs is not None and not request.output_token_ids:
            # Prompt logprobs are read from the logits of every prompt row; cached blocks have
            # none, so the whole prompt is computed (its full blocks still become cached).
            return []
        max_blocks = (request.num_tokens - 1) // self.block_size
        if max_blocks <= 0:
            return []
        keys = self._chain(request, max_blocks)
        blocks: list[int] = []
        for i in range(max_blocks):
            block = self._table.get(keys[i])
            if block is None:
                break
            blocks.append(block)
        return blocks

    def can_allocate(self, request: Request, cached_blocks: list[int], num_new_tokens: int) -> bool:
        num_cached = len(cached_blocks) * self.block_size
        new_blocks = self.blocks_needed(num_cached + num_new_tokens) - len(cached_blocks)
        # Hitting a cached free block takes it out of the free pool too.
        revived = sum(1 for b in cached_blocks if self.ref_counts[b] == 0)
        if self.state_slots is not None and self.state_slots.num_free == 0:
            return False
        return new_blocks + revived <= self.num_free_blocks

    def allocate(self, request: Request, cached_blocks: list[int], num_new_tokens: int) -> bool:
        """Give a request with no blocks its cached prefix plus room for num_new_tokens more.

        cached_blocks comes from match_prefix in the same scheduling pass. Returns False (and
        changes nothing) when the free blocks do not suffice. On success the caller sets
        request.num_computed_tokens to len(cached_blocks) * block_size.
        """
        if request.block_ids:
            raise RuntimeError(f"request {request.request_id} already holds blocks")
        if not self.can_allocate(request, cached_blocks, num_new_tokens):
            return False
        for b in cached_blocks:
            self._take(b)
        request.block_ids = list(cached_blocks)
        if self.state_slots is not None:
            request.state_slot = self.state_slots.take()
        self._num_registered[request.request_id] = len(cached_blocks)
        num_cached = len(cached_blocks) * self.block_size
        self._grow(request, num_cached + num_new_tokens)
        self.prefix_cache_queries += request.num_tokens
        self.prefix_cache_hits += num_cached
        return True

    def append_slots(self, request: Request, num_new_tokens: int) -> bool:
        """Make room for num_new_tokens past request.num_computed_tokens; False if out of blocks."""
        need = self.blocks_needed(request.num_computed_tokens + num_new_tokens)
        missing = need - len(request.block_ids)
        if missing <= 0:
            return True
        if missing > self.num_free_blocks:
            return False
        self._grow(request, request.num_computed_tokens + num_new_tokens)
        return True

    def _grow(self, request: Request, num_tokens: int) -> None:
        for _ in range(self.blocks_needed(num_tokens) - len(request.block_ids)):
            request.block_ids.append(self._pop_free())

    def take_back(self, request: Request, num_tokens: int) -> None:
        """Return the request's blocks past the first blocks_needed(num_tokens) to the free pool
        (speculation: the slots of rejected tokens). Those blocks hold no computed token of the
        request, so none is registered for prefix caching. The list is replaced, not shortened
        in place (the runner's block-table mirror relies on lists that only grow)."""
        keep = self.blocks_needed(num_tokens)
        blocks = request.block_ids
        if keep >= len(blocks):
            return
        if keep * self.block_size < request.num_computed_tokens:
            raise RuntimeError(
                f"request {request.request_id}: taking back blocks that hold computed tokens"
            )
        for b in reversed(blocks[keep:]):
            if self.block_key[b] is not None:
                raise RuntimeError(f"block {b} taken back while registered in the prefix cache")
            self.ref_counts[b] -= 1
            if self.ref_counts[b] != 0:
                raise RuntimeError(f"block {b} taken back while shared")
            self._free_plain.append(b)
        request.block_ids = blocks[:keep]

    # ---- after a step ------------------------------------------------------------------------

    def cache_full_blocks(self, request: Request) -> None:
        """Register the request's blocks that became full of computed tokens.

        Called after every step that advanced num_computed_tokens, so a request admitted later
        can hit a prefix as soon as it is computed. Only newly full blocks are hashed.
        """
        if not self.enable_prefix_caching:
            return
        rid = request.request_id
        full = request.num_computed_tokens // self.block_size
        done = self._num_registered.get(rid, 0)
        if full <= done:
            return
        keys = self._chain(request, full)
        for i in range(done, full):
            key = keys[i]
            block = request.block_ids[i]
            if key not in self._table:
                self._table[key] = block
                self.block_key[block] = key
            # else another request computed the same prefix first; this copy stays private and
            # returns to the plain free list when released.
        self._num_registered[rid] = full

    # ---- release -----------------------------------------------------------------------------

    def free(self, request: Request, finished: bool = True) -> None:
        """Drop the request's block references. Blocks that reach zero references go to the free
        pool; registered ones stay hittable (LRU) until evicted. finished=False (preemption)
        keeps the request's hash chain, since it will be recomputed over the same tokens."""
        # Release the tail first: the LRU then evicts the deepest blocks of a chain before the
        # blocks they depend on.
        for b in reversed(request.block_ids):
            self.ref_counts[b] -= 1
            if self.ref_counts[b] < 0:
                raise RuntimeError(f"block {b} freed more often than referenced")
            if self.ref_counts[b] == 0:
                if self.block_key[b] is not None:
                    self._free_cached[b] = None
                else:
                    self._free_plain.append(b)
        request.block_ids = []
        if request.state_slot >= 0:
            self.state_slots.give_back(request.state_slot)
            request.state_slot = -1
        self._num_registered.pop(request.request_id, None)
        if finished:
            self._keys.pop(request.request_id, None)
            self._hashes.pop(request.request_id, None)

    def forget(self, blocks: list[int]) -> list[int]:
        """Of these freshly freed blocks, the ones no request references any more leave the
        prefix cache (their content is not to be reused: a request's activations went
        non-finite in them); returns those. Blocks still shared stay as they are."""
        dropped = []
        for b in blocks:
            if self.ref_counts[b]:
                continue
            dropped.append(b)
            if b in self._free_cached:
                del self._free_cached[b]
                key = self.block_key[b]
                self.block_key[b] = None
                if key is not None and self._table.get(key) == b:
                    del self._table[key]
                self._free_plain.append(b)
        return dropped

    # ---- internals ---------------------------------------------------------------------------

    def _take(self, block: int) -> None:
        if self.ref_counts[block] == 0:
            del self._free_cached[block]
        self.ref_counts[block] += 1

    def _pop_free(self) -> int:
        if self._free_plain:
            block = self._free_plain.pop()
        elif self._free_cached:
            block, _ = self._free_cached.popitem(last=False)
            key = self.block_key[block]
            self.block_key[block] = None
            if key is not None and self._table.get(key) == block:
                del self._table[key]
        else:
            raise NoFreeBlocksError("no free KV blocks")
        self.ref_counts[block] = 1
        return block

    def check_invariants(self) -> None:
        """Slow consistency check for tests."""
        free = set(self._free_plain) | set(self._free_cached)
        assert len(free) == len(self._free_plain) + len(self._free_cached), "block freed twice"
        for b in range(self.num_blocks):
            assert (self.ref_counts[b] == 0) == (b in free), f"block {b}: refs vs free list"
            assert (b in self._free_cached) <= (self.block_key[b] is not None)
        for key, b in self._table.items():
            assert self.block_key[b] == key, f"table entry for block {b} is stale"

    def all_free(self) -> bool:
        """No request holds a block or a state slot."""
        slots = self.state_slots
        return self.num_free_blocks == self.num_blocks and (
            slots is None or slots.num_free == slots.num_slots
        )
