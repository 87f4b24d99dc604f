"""GGUF files of the tiny hybrid linear-attention models (qwen3next, qwen35, qwen35moe), written
from a float Hugging Face folder as llama.cpp's converter lays them out (its published naming
in gguf-py and the transformations of its conversion script, written here from those rules),
and the float folder that holds exactly what the file holds (its quantized linears'
dequantized values put back in the Hugging Face layout), the reference for transformers.

The layout changes are pure moves of elements (splits, row / column reorders); each is applied
to the weight and to an index array alike, so the reference puts every dequantized element
back where it came from without an inverse written by hand.
"""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from tests import quant_checkpoints as qc
from tests.checkpoints import GDN, HYBRID_MOE, _root, tokenizer

GGUF_ARCH = {"qwen3_next": "qwen3next", "qwen3_5": "qwen35", "qwen3_5_moe": "qwen35moe"}
# llama.cpp states the layer pattern as full_attention_interval only
SOURCES: dict[str, dict] = {
    # fused in_proj_qkvz / in_proj_ba, tied embeddings
    "qwen3_next": dict(
        tie_word_embeddings=True, head_dim=32, num_hidden_layers=4, full_attention_interval=2,
        norm_topk_prob=True, decoder_sparse_step=1, **HYBRID_MOE, **GDN,
    ),
    "qwen3_5": dict(
        tie_word_embeddings=False, head_dim=32, num_hidden_layers=4, full_attention_interval=2,
        **GDN,
    ),
    # K-quant super-blocks (256) on every linear's input; value heads 64 wide, so a tiled
    # ssm_out moves whole 32-element blocks but cuts 256-element ones
    "qwen3_5-wide": dict(
        tie_word_embeddings=False, hidden_size=256, intermediate_size=512, head_dim=64,
        num_hidden_layers=2, full_attention_interval=2, linear_num_key_heads=2,
        linear_num_value_heads=4, linear_key_head_dim=32, linear_value_head_dim=64,
    ),
    "qwen3_5_moe": dict(
        tie_word_embeddings=False, head_dim=32, num_hidden_layers=3, full_attention_interval=3,
        **HYBRID_MOE, **GDN,
    ),
}  # fmt: skip
_LEAF = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "post_attention_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "linear_attn.in_proj_qkv.weight": "attn_qkv.weight",
    "linear_attn.in_proj_z.weight": "attn_gate.weight",
    "linear_attn.in_proj_b.weight": "ssm_beta.weight",
    "linear_attn.in_proj_a.weight": "ssm_alpha.weight",
    "linear_attn.in_proj_ba.weight": "ssm_ba.weight",
    "linear_attn.A_log": "ssm_a",
    "linear_attn.dt_bias": "ssm_dt.bias",
    "linear_attn.conv1d.weight": "ssm_conv1d.weight",
    "linear_attn.norm.weight": "ssm_norm.weight",
    "linear_attn.out_proj.weight": "ssm_out.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
    "mlp.gate.weight": "ffn_gate_inp.weight",
    "mlp.shared_expert.gate_proj.weight": "ffn_gate_shexp.weight",
    "mlp.shared_expert.up_proj.weight": "ffn_up_shexp.weight",
    "mlp.shared_expert.down_proj.weight": "ffn_down_shexp.weight",
    "mlp.shared_expert_gate.weight": "ffn_gate_inp_shexp.weight",
}
# the converter stores these RMSNorm weights as 1 + weight (ssm_norm as it is)
_PLUS_ONE = ("attn_norm.weight", "post_attention_norm.weight", "attn_q_norm.weight")
_PLUS_ONE += ("attn_k_norm.weight", "output_norm.weight")
# weights a test may quantize (types(name) picks); the rest stay F32
_LINEAR = re.compile(
    r"(attn_(q|k|v|output|qkv|gate)|ssm_(beta|alpha|ba|out)|ffn_\w+|output|token_embd)\.weight$"
)


def float_source(source: str) -> Path:
    """The float folder of a SOURCES entry (`arch` or `arch-variant`)."""
    from voltserve.services.executor.demo_model import write_checkpoint

    out = _root() / f"{source}-gguf-src"
    if out.is_dir():
        return out
    arch = source.split("-")[0]
    return write_checkpoint(
        out, arch=arch, size="tiny", seed=21, tokenizer=tokenizer(), **SOURCES[source]
    )


def _tile(x: np.ndarray, axis: int, hk: int, r: int, d: int) -> np.ndarray:
    """Value heads grouped by key head ([Hk, r, d] along axis) -> tiled ([r, Hk, d])."""
    x = np.moveaxis(x, axis, 0)
    shape = x.shape
    x = x.reshape(hk, r, d, *shape[1:]).swapaxes(0, 1).reshape(shape)
    return np.moveaxis(x, 0, axis)


def _layout(hf: str, x: np.ndarray, cfg: dict, garch: str) -> list[tuple[str, np.ndarray]]:
    """(GGUF name, array) of one Hugging Face tensor: the converter's moves only."""
    if hf in qc.GGUF_TOP:
        return [(qc.GGUF_TOP[hf], x)]
    m = re.match(r"^model\.layers\.(\d+)\.(.+)$", hf)
    blk, leaf = f"blk.{m[1]}.", m[2]
    hk, hv = cfg["linear_num_key_heads"], cfg["linear_num_value_heads"]
    dk, dv, r = cfg["linear_key_head_dim"], cfg["linear_value_head_dim"], hv // hk
    tiled = garch != "qwen3next" and hk != hv
    if leaf == "linear_attn.in_proj_qkvz.weight":
        g = x.reshape(hk, 2 * dk + 2 * r * dv, -1)
        q, k, v, z = np.split(g, [dk, 2 * dk, 2 * dk + r * dv], axis=1)
        qkv = np.concatenate([t.reshape(-1, x.shape[1]) for t in (q, k, v)])
        return [
            (blk + "attn_qkv.weight", qkv),
            (blk + "attn_gate.weight", z.reshape(-1, x.shape[1])),
        ]
    if leaf == "linear_attn.conv1d.weight":
        x = x.reshape(x.shape[0], x.shape[-1])
    if tiled and leaf in ("linear_attn.in_proj_qkv.weight", "linear_attn.conv1d.weight"):
        qk = 2 * hk * dk
        x = np.concatenate([x[:qk], _tile(x[qk:], 0, hk, r, dv)])
    elif tiled and leaf == "linear_attn.in_proj_z.weight":
        x = _tile(x, 0, hk, r, dv)
    elif tiled and leaf.endswith(("in_proj_b.weight", "in_proj_a.weight", "A_log", "dt_bias")):
        x = _tile(x, 0, hk, r, 1)
    elif tiled and leaf == "linear_attn.out_proj.weight":
        x = _tile(x, 1, hk, r, dv)
    if leaf == "mlp.shared_expert_gate.weight":
        x = x.reshape(-1)
    return [(blk + _LEAF[leaf], x)]


def _values(gname: str, x: np.ndarray) -> np.ndarray:
    """The converter's value changes (float tensors only)."""
    if gname.endswith(".ssm_a"):
        return -np.exp(x)
    if gname.endswith(_PLUS_ONE):
        return x + 1.0
    return x


def _dequantize(data: np.ndarray, raw, shape: tuple[int, ...]) -> np.ndarray:
    import gguf

    if raw is None:
        return data.astype(np.float32)
    return gguf.quants.dequantize(data, raw).reshape(shape).astype(np.float32)


def _metadata(w, cfg: dict, mtp: bool) -> None:
    hd = cfg["head_dim"]
    types = cfg["layer_types"]
    interval = types.index("full_attention") + 1
    want = [
        "full_attention" if (i + 1) % interval == 0 else "linear_attention"
        for i in range(len(types))
    ]
    assert types == want, "llama.cpp states the layer pattern as an interval only"
    rope = cfg.get("rope_parameters") or {}
    partial = rope.get("partial_rotary_factor") or cfg.get("partial_rotary_factor") or 0.25
    qc.add_gguf_metadata(w, cfg, cfg["num_hidden_layers"] + mtp, int(hd * partial))
    if mtp:
        w.add_nextn_predict_layers(1)
    w.add_ssm_conv_kernel(cfg["linear_conv_kernel_dim"])
    w.add_ssm_state_size(cfg["linear_key_head_dim"])
    w.add_ssm_group_count(cfg["linear_num_key_heads"])
    w.add_ssm_time_step_rank(cfg["linear_num_value_heads"])
    w.add_ssm_inner_size(cfg["linear_value_head_dim"] * cfg["linear_num_value_heads"])
    w.add_full_attention_interval(interval)
    if w.arch != "qwen3next":
        # Qwen3.5's multimodal rotary sections (text reads one position in all of them)
        w.add_rope_dimension_sections([int(hd * partial) // 2 - 2, 1, 1, 0])


def hybrid_gguf(
    source: str, types: Callable[[str], str], name: str, mtp: bool = False
) -> tuple[Path, Path]:
    """(folder holding model.gguf, float reference folder) of a SOURCES hybrid model;
    types(GGUF name) -> ggml type of each weight _LINEAR matches (the rest stay F32). mtp: an
    MTP block after the model's (nextn_predict_layers 1; the reference has none): layer 0's
    tensors again under the next block number, plus its nextn.eh_proj."""
    import gguf

    src = float_source(source)
    garch = GGUF_ARCH[source.split("-")[0]]
    out, ref = _root() / f"{source}-gguf-{name}", _root() / f"{source}-gguf-{name}-ref"
    if out.is_dir():
        return out, ref
    cfg = json.loads((src / "config.json").read_text())
    sd = load_file(src / "model.safetensors")
    out.mkdir()
    w = gguf.GGUFWriter(str(out / "model.gguf"), garch)
    _metadata(w, cfg, mtp)
    ref_sd: dict[str, torch.Tensor] = {}
    for gname, hfs in qc.gguf_expert_groups(sd).items():
        stacked = np.stack([sd.pop(n).float().numpy() for n in hfs])
        data, raw = qc.gguf_quantize(stacked, types(gname))
        w.add_tensor(gname, data, raw_dtype=raw)
        for n, e in zip(hfs, _dequantize(data, raw, stacked.shape)):
            ref_sd[n] = torch.from_numpy(np.ascontiguousarray(e))
    for hf, t in sd.items():
        x = t.float().numpy()
        idx = np.arange(x.size).reshape(x.shape)
        back = np.empty(x.size, np.float32)
        changed = False
        for (gname, g), (_, gi) in zip(_layout(hf, x, cfg, garch), _layout(hf, idx, cfg, garch)):
            kind = types(gname) if _LINEAR.search(gname) else "F32"
            v = _values(gname, g)
            changed |= v is not g
            data, raw = qc.gguf_quantize(np.ascontiguousarray(v), kind)
            w.add_tensor(gname, data, raw_dtype=raw)
            back[gi.reshape(-1)] = _dequantize(data, raw, g.shape).reshape(-1)
        # a value change is a float tensor's, written F32: the reference keeps the source's
        ref_sd[hf] = t if changed else torch.from_numpy(back.reshape(x.shape))
    if mtp:
        n = cfg["num_hidden_layers"]
        for hf, t in sd.items():
            if hf.startswith("model.layers.0."):
                for gname, g in _layout(hf, t.float().numpy(), cfg, garch):
                    w.add_tensor(gname.replace("blk.0.", f"blk.{n}.", 1), _values(gname, g))
        eh = np.zeros((cfg["hidden_size"], 2 * cfg["hidden_size"]), np.float32)
        w.add_tensor(f"blk.{n}.nextn.eh_proj.weight", eh)
    qc.write_gguf(w)
    shutil.copytree(src, ref, ignore=shutil.ignore_patterns("*.safetensors"))
    save_file(ref_sd, ref / "model.safetensors", metadata={"format": "pt"})
    return out, ref
