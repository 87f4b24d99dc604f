"""A tiny qwen2 checkpoint whose fp16 activations overflow on one token, and on no other.

What a bf16-trained checkpoint served in fp16 does on some inputs, built on purpose: the fp32
checkpoint is finite everywhere; in fp16 the residual stream at POISON's position passes 65504
in layer `layer` and becomes infinity, then NaN at the next norm. Overflowing in layer 0, it
reaches layer 1's keys and values, so the attention carries NaN to every later position of that
sequence (and to no other sequence); overflowing in the last layer, only POISON's own logits row
is NaN (a prompt-logprobs row, when POISON is not the last prompt token).

How (hidden dim 0 holds POISON alone):
- POISON's embedding is 40000 on dim 0 and 0 elsewhere; every other embedding is 0 on dim 0,
  and no attention or MLP up to `layer` writes there, so only POISON's residual has a dim 0.
- MLP neuron 0 of `layer` computes silu(x0) * x0 of the normed dim 0 (8 for POISON, 0 for any
  other token) and writes 1000 times it to dim 0: 64000 more for POISON (over 65504 in all),
  exactly 0 for the others.
- Every other token's embedding holds 0.08 on dim 1, which no layer writes to, so dim 1 of the
  final norm's output is positive at every position but POISON's; POISON's lm_head row reads
  -200 times it, a logit of about -50: no request samples POISON, at any temperature...
- ...except right after TRIGGER, whose embedding holds -0.08 there: at TRIGGER's position the
  logit is about +50 and greedy decoding picks POISON, so a prompt ending in TRIGGER gets one
  finite token (POISON) and then non-finite logits, mid-stream. TRIGGER's own lm_head row reads
  -100 times dim 1: never sampled either.
"""

from __future__ import annotations

import functools
from pathlib import Path

from tests.checkpoints import TINY, _root, tokenizer

POISON = 300  # a plain token of tests/checkpoints.py's 384-token vocabulary
TRIGGER = 302


LAYERS = TINY["num_hidden_layers"]


@functools.cache
def overflow_checkpoint(layer: int = 0) -> Path:
    """Folder of the checkpoint overflowing in `layer` (fp32 safetensors; cached per session; do
    not modify it)."""
    import torch
    from safetensors.torch import load_file, save_file
    from voltserve.services.executor.demo_model import write_checkpoint

    out = write_checkpoint(
        _root() / f"qwen2-fp16-overflow-{layer}",
        arch="qwen2",
        size="tiny",
        seed=11,
        tokenizer=tokenizer(),
        **{**TINY, "tie_word_embeddings": False},
    )
    path = out / "model.safetensors"
    w = load_file(path)
    emb = w["model.embed_tokens.weight"]
    emb[:, 0] = 0.0
    emb[:, 1] = 0.08
    emb[POISON] = 0.0
    emb[POISON, 0] = 40000.0
    emb[TRIGGER, 1] = -0.08
    for i in range(LAYERS):
        rows = slice(0, 2) if i <= layer else slice(1, 2)
        w[f"model.layers.{i}.self_attn.o_proj.weight"][rows] = 0.0
        w[f"model.layers.{i}.mlp.down_proj.weight"][rows] = 0.0
    pre = f"model.layers.{layer}."
    for norm in ("input_layernorm", "post_attention_layernorm"):
        w[f"{pre}{norm}.weight"][0] = 1.0
    gate, up = w[f"{pre}mlp.gate_proj.weight"], w[f"{pre}mlp.up_proj.weight"]
    gate[0], up[0] = 0.0, 0.0
    gate[0, 0], up[0, 0] = 1.0, 1.0
    down = w[f"{pre}mlp.down_proj.weight"]
    down[:, 0] = 0.0
    down[0, 0] = 1000.0
    head = w["lm_head.weight"]
    head[POISON] = 0.0
    head[POISON, 1] = -200.0
    head[TRIGGER] = 0.0
    head[TRIGGER, 1] = -100.0
    save_file({k: v.contiguous() for k, v in w.items()}, path, metadata={"format": "pt"})
    assert all(torch.isfinite(v).all() for v in w.values())
    return out
