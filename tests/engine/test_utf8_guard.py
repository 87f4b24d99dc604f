"""utf8_guard: the UTF-8 automaton over tokens, against Python's own decoder, its packed masks,
and a constrained request that can no longer write bytes that are not UTF-8."""

from __future__ import annotations

import codecs
import json

import numpy as np
import pytest
import torch
from voltserve.services.executor.utf8_guard import BOUNDARY, NUM_STATES, REJECT, Utf8Table

from tests.checkpoints import checkpoint


def decodes(data: bytes) -> bool:
    """Whether data is the start of some valid UTF-8 text: it, or it followed by 1-3
    continuation bytes, decodes. (Python's incremental decoder alone lets an unfinished ED A0
    through: it checks for a surrogate only once the character is complete.)"""
    try:
        codecs.getincrementaldecoder("utf-8")().decode(data, final=False)
    except UnicodeDecodeError:
        return False
    for extra in range(4):
        for first in range(0x80, 0xC0) if extra else (None,):
            tail = bytes([first]) + b"\x80" * (extra - 1) if extra else b""
            try:
                (data + tail).decode("utf-8")
                return True
            except UnicodeDecodeError:
                pass
    return False


def random_tokens(rng, n: int) -> list[bytes]:
    # Every single byte, then short random byte strings, biased to the lead/continuation ranges.
    pool = list(range(256)) + [0xE0, 0xED, 0xF0, 0xF4, 0xC2] * 8 + list(range(0x80, 0xC0)) * 2
    toks = [bytes([b]) for b in range(256)]
    toks += [bytes(rng.choice(pool) for _ in range(rng.randint(1, 4))) for _ in range(n)]
    return toks


def test_automaton_agrees_with_pythons_decoder(rng):
    toks = random_tokens(rng, 2000)
    table = Utf8Table(toks, len(toks) + 9)
    for _ in range(1000):
        state, seq = BOUNDARY, b""
        for _ in range(8):
            t = rng.randrange(len(toks))
            nxt = table.advance(state, t)
            assert (nxt != REJECT) == decodes(seq + toks[t]), (seq, toks[t], state)
            if nxt == REJECT:
                break
            state, seq = nxt, seq + toks[t]
            # At a character boundary exactly when the bytes so far decode completely.
            try:
                seq.decode("utf-8")
                complete = True
            except UnicodeDecodeError:
                complete = False
            assert (state == BOUNDARY) == complete, seq


def test_special_padding_and_out_of_range_tokens(rng):
    toks = random_tokens(rng, 50) + [b"<|end|>", b""]
    special = len(toks) - 2
    table = Utf8Table(toks, len(toks) + 5, special_ids=[special])
    mid = table.advance(BOUNDARY, 0xE1)  # a lead byte: inside a character
    assert mid not in (BOUNDARY, REJECT)
    for t in (special, special + 1, len(toks) + 2):  # special, empty, lm_head padding
        assert table.advance(BOUNDARY, t) == BOUNDARY
        assert table.advance(mid, t) == REJECT
    assert table.advance(BOUNDARY, len(toks) + 5) == REJECT  # past the logits


@pytest.mark.parametrize("as_torch", [False, True])
def test_packed_masks_and_restrict(rng, as_torch):
    toks = random_tokens(rng, 300)
    V = len(toks) + 7
    table = Utf8Table(toks, V)
    W = (V + 31) // 32
    for s in range(NUM_STATES):
        bits = (table.allowed[s][:, None] >> np.arange(32)) & 1
        np.testing.assert_array_equal(bits.reshape(-1)[:V], table.next_state[s] >= 0)
        assert not bits.reshape(-1)[V:].any()
    full = np.full((3, W), -1, dtype=np.int32)
    empty = np.zeros((3, W), dtype=np.int32)
    mask, none = (torch.from_numpy(full), torch.from_numpy(empty)) if as_torch else (full, empty)
    state = table.advance(BOUNDARY, 0xF0)
    assert table.restrict(mask, 1, state)
    np.testing.assert_array_equal(np.asarray(mask[1]), table.allowed[state])
    assert (np.asarray(mask[0]) == -1).all() and (np.asarray(mask[2]) == -1).all()
    # Nothing allowed would be left: the row stays as the grammar filled it.
    assert not table.restrict(none, 0, state)
    assert not np.asarray(none).any()
    # Several rows at once (the batch fill): each row as restrict() alone leaves it.
    states = [rng.randrange(NUM_STATES) for _ in range(3)]
    grammar = np.array([[rng.getrandbits(32) - 2**31 for _ in range(W)] for _ in range(3)])
    grammar = grammar.astype(np.int32)
    grammar[1] = 0  # a row with nothing allowed
    many = torch.from_numpy(grammar.copy()) if as_torch else grammar.copy()
    kept = table.restrict_rows(many, [0, 1, 2], states)
    for r in range(3):
        one = grammar.copy()
        assert bool(kept[r]) == table.restrict(one, r, states[r])
        np.testing.assert_array_equal(np.asarray(many[r]), one[r])


def test_constrained_string_cannot_hold_an_overlong_sequence():
    """A JSON string under the grammar: the lead byte E0 may be followed by A0-BF only (80-9F
    would be an overlong form), as a token and in the mask; rollback restores the state."""
    import xgrammar as xgr
    from transformers import AutoTokenizer
    from voltserve.services.executor.grammar import GrammarCompilerPool
    from voltserve.services.executor.grammar_state import GrammarState

    model = checkpoint("qwen2")
    tok = AutoTokenizer.from_pretrained(model)
    V = json.loads((model / "config.json").read_text())["vocab_size"]
    pool = GrammarCompilerPool(tok, V, [2])
    compiled = pool.compile({"type": "json", "value": json.dumps({"type": "string"})})
    info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=V, stop_token_ids=[2])
    ids = {b: i for i, b in enumerate(info.decoded_vocab) if b in (b'"', b"\xe0", b"\x94", b"\xa4")}
    assert len(ids) == 4, ids
    st = GrammarState(compiled, [2], utf8=pool.utf8_table())
    W = (V + 31) // 32
    mask = np.zeros((1, W), dtype=np.int32)

    def allowed(t: int) -> bool:
        mask[:] = 0
        st.fill(mask, 0)
        return bool((mask[0, t // 32] >> (t % 32)) & 1)

    assert st.accept(ids[b'"']) and st.accept(ids[b"\xe0"])
    assert not allowed(ids[b"\x94"]) and allowed(ids[b"\xa4"])
    assert not st.accept(ids[b"\x94"])  # refused, nothing changes
    assert st.position == 2
    assert st.accept(ids[b"\xa4"])  # E0 A4: one more continuation byte to come
    assert not allowed(ids[b'"'])  # the string cannot close inside a character
    st.rollback(1)
    assert not allowed(ids[b"\x94"]) and allowed(ids[b"\xa4"])
