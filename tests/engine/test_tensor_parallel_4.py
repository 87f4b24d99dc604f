"""Four tensor-parallel ranks on the CPU (gloo). Its own module: a process holds one group at a
time, and test_tensor_parallel.py keeps its TP=2 engines for the whole module."""

from __future__ import annotations

from tests.engine.test_tensor_parallel import VOCAB, assert_greedy, engine, greedy


def test_tp4_replicated_kv_heads_equal_transformers(rng):
    """Four ranks on the 4-head, 2-KV-head Llama checkpoint: one query head per rank, each KV
    head held by two ranks; 97 of the 385 vocabulary rows per rank (3 rows of padding)."""
    e = engine("llama", 4)
    try:
        attn = e.runner.model.model.layers[0].self_attn
        assert (attn.num_heads, attn.num_kv_heads) == (1, 1)
        prompts = [[rng.randrange(VOCAB) for _ in range(rng.randrange(3, 30))] for _ in range(3)]
        out = e.generate(prompts, greedy(8))
        for p, o in zip(prompts, out):
            assert_greedy("llama", p, o, 8)
    finally:
        e.runner.shutdown()
