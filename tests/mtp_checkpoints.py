"""Tiny hybrid checkpoints with multi-token-prediction layers (spec/mtp_head.py's layout),
written by the tests into copies of tests/checkpoints.py's: transformers neither writes nor runs
MTP layers, so the mtp.* tensors are made here from the target's own last layer."""

from __future__ import annotations

import functools
import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from tests.checkpoints import _root, checkpoint

MTP_NORMS = ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm")


def mtp_checkpoint(arch: str, repeat_head: bool = False, layers: int = 1) -> Path:
    """A copy of the tiny `arch` checkpoint (cached per session; do not modify it) with `layers`
    MTP layers: each a copy of the target's last layer (a full attention one), and fc / norms
    (random). repeat_head: fc passes the normed hidden state through and the layer adds nothing
    (o_proj and every down_proj zero), so each step's output is a positive multiple of the
    target's hidden h_p and proposes argmax lm_head(h_p), the token the target itself produced
    from h_p: the last token, k times."""
    return _mtp_checkpoint(arch, repeat_head, layers)


@functools.cache
def _mtp_checkpoint(arch: str, repeat_head: bool, layers: int) -> Path:
    src = checkpoint(arch)
    dest = _root() / f"{arch}-mtp{layers}{'-repeat' if repeat_head else ''}"
    shutil.copytree(src, dest)
    cfg = json.loads((src / "config.json").read_text())
    # The vision-language layout: the text model's config in text_config, its weights under
    # model.language_model.; the MTP tensors sit at the top level (mtp.*) in both layouts.
    text = cfg.get("text_config", cfg)
    text["mtp_num_hidden_layers"] = layers
    (dest / "config.json").write_text(json.dumps(cfg))
    weights = load_file(str(src / "model.safetensors"))
    stem = "model.language_model.layers." if "text_config" in cfg else "model.layers."
    last = f"{stem}{text['num_hidden_layers'] - 1}."
    layer = {k[len(last) :]: v for k, v in weights.items() if k.startswith(last)}
    assert any(k.startswith("self_attn.") for k in layer), "the last layer is full attention"
    H = text["hidden_size"]
    gen = torch.Generator().manual_seed(len(arch) + layers)
    mtp = {f"mtp.layers.{i}.{k}": v.clone() for k, v in layer.items() for i in range(layers)}
    if repeat_head:
        fc = torch.cat([torch.zeros(H, H), torch.eye(H)], dim=1)
        norms = {n: torch.zeros(H) for n in MTP_NORMS}
        for k in mtp:
            if "o_proj" in k or "down_proj" in k:
                mtp[k] = torch.zeros_like(mtp[k])
    else:
        fc = torch.randn(H, 2 * H, generator=gen) * (2 * H) ** -0.5
        norms = {n: torch.randn(H, generator=gen) * 0.1 for n in MTP_NORMS}
    mtp["mtp.fc.weight"] = fc
    mtp.update({f"mtp.{n}.weight": w for n, w in norms.items()})
    save_file({k: v.contiguous() for k, v in mtp.items()}, str(dest / "mtp.safetensors"))
    return dest


# The forced chain of chain_checkpoint: C -> B -> A -> A -> ...
A, B, C = 100, 101, 102


@functools.cache
def chain_checkpoint() -> Path:
    """mtp_checkpoint("qwen3_5", repeat_head=True) with a target that maps C to B, B to A and A
    to A whatever the context, and leaves every other token to its layers as before.

    Three hidden dimensions are reserved, one per token: only that token's embedding has it
    (and nothing else: a large multiple of the unit vector), and no layer writes to it (those
    rows of o_proj, out_proj and down_proj are zero). So the residual stream carries it exactly
    at the token's positions, where it dominates the final norm, and nowhere else. The lm_head
    rows of A and B read only those dimensions: A's reads A's and B's, B's reads C's."""
    src = mtp_checkpoint("qwen3_5", repeat_head=True)
    dest = _root() / "qwen3_5-mtp-chain"
    shutil.copytree(src, dest)
    w = load_file(str(src / "model.safetensors"))
    emb, head = w["model.embed_tokens.weight"], w["lm_head.weight"]
    H = emb.shape[1]
    dims = {A: H - 1, B: H - 2, C: H - 3}
    alpha = 100 * emb.norm(dim=1).mean()
    for name, t in w.items():
        if name.endswith(("o_proj.weight", "out_proj.weight", "down_proj.weight")):
            t[list(dims.values())] = 0
    emb[:, list(dims.values())] = 0
    head[:, list(dims.values())] = 0
    gamma = 10 * head.norm(dim=1).mean()
    for tok, d in dims.items():
        emb[tok] = 0
        emb[tok, d] = alpha
    head[A] = 0
    head[B] = 0
    head[A, dims[A]] = head[A, dims[B]] = gamma
    head[B, dims[C]] = gamma
    save_file(w, str(dest / "model.safetensors"))
    return dest
