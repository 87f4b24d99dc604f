"""Keeps a constrained request's output valid UTF-8, which xgrammar alone does not.

xgrammar matches a string's characters byte by byte and accepts some sequences that are not
UTF-8: an E0 lead followed by 80-9F (an overlong form), ED followed by A0-BF (a surrogate), F0
followed by 80-8F, F4 followed by 90-BF. A random-weight model under a JSON schema produced
E0 94 BD inside a string of `maxLength` 6: one character to the grammar, three U+FFFD to every
decoder, so the text the client got broke its own schema. Byte-level vocabularies hold tokens
of single bytes, so a model can write any such sequence a token at a time.

The table here is the UTF-8 automaton (Unicode's Table 3-7) run over every token's bytes from
each of its 8 states: which tokens may follow a state (as a packed bitmask, ANDed into the
grammar's mask) and which state each leads to. A request's state starts at a character boundary
when its constraint starts. Special tokens (eos, role markers) stand for no bytes of the text:
allowed only at a character boundary, so an output never ends inside a character.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

BOUNDARY = 0  # between characters
NUM_STATES = 8
REJECT = -1

# State after a lead byte (from BOUNDARY), then the byte range the next byte must fall in.
#   1: one continuation byte left (80-BF)
#   2: two left, 80-BF      3: two left, A0-BF (after E0)   4: two left, 80-9F (after ED)
#   5: three left, 90-BF (after F0)   6: three left, 80-BF (F1-F3)   7: three left, 80-8F (F4)
_NEXT_RANGE = {1: (0x80, 0xBF), 2: (0x80, 0xBF), 3: (0xA0, 0xBF), 4: (0x80, 0x9F)}
_NEXT_RANGE |= {5: (0x90, 0xBF), 6: (0x80, 0xBF), 7: (0x80, 0x8F)}
# Where a continuation byte leads: 1 -> boundary; the two-left states -> 1; three-left -> 2.
_AFTER_CONT = {1: BOUNDARY, 2: 1, 3: 1, 4: 1, 5: 2, 6: 2, 7: 2}


def transition_table() -> np.ndarray:
    """[NUM_STATES, 256] int8: the state after byte b in state s (REJECT if b cannot come)."""
    t = np.full((NUM_STATES, 256), REJECT, dtype=np.int8)
    t[BOUNDARY, 0x00:0x80] = BOUNDARY
    t[BOUNDARY, 0xC2:0xE0] = 1
    t[BOUNDARY, 0xE0] = 3
    t[BOUNDARY, 0xE1:0xED] = 2
    t[BOUNDARY, 0xED] = 4
    t[BOUNDARY, 0xEE:0xF0] = 2
    t[BOUNDARY, 0xF0] = 5
    t[BOUNDARY, 0xF1:0xF4] = 6
    t[BOUNDARY, 0xF4] = 7
    for s, (lo, hi) in _NEXT_RANGE.items():
        t[s, lo : hi + 1] = _AFTER_CONT[s]
    return t


class Utf8Table:
    """Per state, the tokens that keep the output valid UTF-8 and where each leads."""

    def __init__(
        self, token_bytes: Sequence[bytes], vocab_size: int, special_ids: Sequence[int] = ()
    ) -> None:
        if len(token_bytes) > vocab_size:
            raise ValueError(f"{len(token_bytes)} token byte strings for {vocab_size} logits")
        trans = transition_table()
        n = len(token_bytes)
        lens = np.fromiter((len(b) for b in token_bytes), dtype=np.int64, count=n)
        # Bytes as a [tokens, longest] matrix, longest tokens first, run through the automaton
        # column by column for every start state: column j touches only the tokens longer than
        # j (a prefix, after the sort), so the work is the vocabulary's total length per state.
        order = np.argsort(-lens, kind="stable")
        longest = int(lens[order[0]]) if n else 0
        mat = np.zeros((n, max(longest, 1)), dtype=np.uint8)
        for row, i in enumerate(order):
            b = token_bytes[i]
            mat[row, : len(b)] = np.frombuffer(b, dtype=np.uint8)
        longer = [int(np.count_nonzero(lens > j)) for j in range(longest)]
        # Tokens with no bytes (padding rows, special tokens) keep the state and may come only
        # at a boundary.
        bare = lens == 0
        bare[[i for i in special_ids if 0 <= i < n]] = True
        nxt = np.full((NUM_STATES, vocab_size), REJECT, dtype=np.int8)
        for s in range(NUM_STATES):
            state = np.full(n, s, dtype=np.int64)
            for j, m in enumerate(longer):
                st = state[:m]
                ok = st >= 0
                st[ok] = trans[st[ok], mat[:m, j][ok]]
            walked = np.empty(n, dtype=np.int64)
            walked[order] = state
            walked[bare] = BOUNDARY if s == BOUNDARY else REJECT
            nxt[s, :n] = walked
        # Logits past the tokenizer's tokens (lm_head padding): like empty tokens.
        nxt[BOUNDARY, n:] = BOUNDARY
        self.next_state = nxt
        self.vocab_size = vocab_size
        # Packed like xgrammar's masks: int32 words, bit i of word w is token 32 w + i.
        words = (vocab_size + 31) // 32
        bits = np.zeros((NUM_STATES, words * 32), dtype=bool)
        bits[:, :vocab_size] = nxt >= 0
        packed = np.packbits(bits, axis=1, bitorder="little")  # token 8 k + i: bit i of byte k
        self.allowed = packed.view("<i4")
        self._touched_cache: dict[tuple[int, int, bool], tuple] = {}

    @classmethod
    def from_tokenizer_info(cls, info) -> Utf8Table:
        """From an xgrammar TokenizerInfo: its tokens as raw bytes (byte-level and byte-fallback
        vocabularies alike) and its special tokens."""
        return cls(info.decoded_vocab, info.vocab_size, info.special_token_ids)

    def advance(self, state: int, token: int) -> int:
        """The state after `token`, or REJECT if it would break the UTF-8 of the output."""
        if not 0 <= token < self.vocab_size:
            return REJECT
        return int(self.next_state[state, token])

    def restrict(self, bitmask, row: int, state: int) -> bool:
        """AND the tokens allowed in `state` into bitmask[row] (a torch or numpy int32 matrix of
        packed words). Leaves the row as it was and returns False where nothing would be left
        (the grammar then has the last word, so the sampler never faces an empty mask)."""
        return self.restrict_rows(bitmask, [row], [state])[0]

    def restrict_rows(self, bitmask, rows: Sequence[int], states: Sequence[int]) -> list[bool]:
        """restrict() for several rows (a batch's masks each step); per row whether it was
        restricted (False: nothing would have been left). Only the words of the mask where a
        state forbids something are read and written: at a character boundary, where a request
        almost always is, that is the few words holding the single-byte tokens."""
        kept = [True] * len(rows)
        by_state: dict[int, list[int]] = {}
        for k, st in enumerate(states):
            by_state.setdefault(int(st), []).append(k)
        torch_mask = not isinstance(bitmask, np.ndarray)
        for st, ks in by_state.items():
            cols, allowed = self._touched(st, bitmask.shape[1], torch_mask)
            if len(cols) == 0:
                continue
            if torch_mask:
                import torch

                idx = torch.as_tensor([rows[k] for k in ks], dtype=torch.int64)
            else:
                idx = np.asarray([rows[k] for k in ks], dtype=np.int64)
            grammar = bitmask[idx[:, None], cols[None, :]]
            cut = grammar & allowed[None, :]
            empty = ~cut.any(1)
            for j in np.flatnonzero(np.asarray(empty)):
                # Nothing left in the touched words: is anything allowed elsewhere in the row?
                row = int(idx[j])
                rest = bitmask[row].clone() if torch_mask else bitmask[row].copy()
                rest[cols] = 0
                if not rest.any():
                    cut[j] = grammar[j]
                    kept[ks[j]] = False
            bitmask[idx[:, None], cols[None, :]] = cut
        return kept

    def _touched(self, state: int, words: int, as_torch: bool):
        """The mask words in which `state` forbids a token, and its allowed bits there."""
        key = (state, words, as_torch)
        hit = self._touched_cache.get(key)
        if hit is None:
            row = self.allowed[state, :words]
            cols = np.flatnonzero(row != -1)
            vals = row[cols]
            if as_torch:
                import torch

                cols, vals = torch.from_numpy(cols), torch.from_numpy(vals.copy())
            hit = self._touched_cache[key] = (cols, vals)
        return hit
