"""Quantize a float Hugging Face llama checkpoint folder into a llama-architecture GGUF file with
llama.cpp's Q4_K_M mix (or its Q8_0 file, `--mix q8_0`), for benchmarks and tests at real
shapes (the random-weight Llama-3-8B of `common.py make-checkpoint`), in well under two minutes
for 8B parameters on a GPU host.

What is written (llama.cpp's converter + `llama-quantize ... Q4_K_M`, as they lay a llama file):
- tensors under GGUF names (token_embd, blk.N.attn_q / attn_k / attn_v / attn_output /
  ffn_gate / ffn_up / ffn_down / attn_norm / ffn_norm, output_norm, output), the rows of attn_q
  and attn_k permuted as llama.cpp's converter permutes llama q/k (its rotary pairs adjacent
  dimensions; the loader undoes it);
- the types of llama.cpp's Q4_K_M rule (load_tests/gguf_pack.py q4_k_m_type): norms F32,
  token_embd Q4_K (Q6_K when tied: no output.weight), output Q6_K, attn_v and ffn_down Q6_K on
  the use_more_bits layers (32 layers: 0-3, 6, 9, ..., 27, 28-31: 16 of them), every other
  linear Q4_K; rows that are not whole 256-element super-blocks (small test models) take
  llama.cpp's fallbacks, Q5_0 for Q4_K and Q8_0 for Q6_K. Llama-3-8B: 65 F32, 193 Q4_K and 33
  Q6_K tensors, as llama.cpp's own Q4_K_M file of it. `--mix q8_0`: every matrix Q8_0
  (token_embd and output too), norms F32, as `llama-quantize ... Q8_0` writes it;
- the metadata the loader reads: general.architecture llama, file_type 15 (MOSTLY_Q4_K_M; 7,
  MOSTLY_Q8_0, for the Q8_0 file),
  context / embedding / feed-forward lengths, block count, head counts, RMS eps, rope base and
  dimension count (Llama 3.1 rope scaling as the rope_freqs tensor, linear scaling as
  rope.scaling.*), vocab size, and the tokenizer as tokenizer.ggml.* (the folder's token list
  in id order, BPE merges when it has them, token types, bos / eos ids, chat template).

The blocks are packed by vectorized torch (gguf_pack.py) on --device (cuda: seconds for 8B;
cpu works, slower), round-to-nearest min/max per group (random weights: no importance search),
and written with the gguf package's GGUFWriter (raw_dtype: pre-quantized bytes).

The random checkpoints' tokenizer is word-level (`t123`), which a GGUF gpt2 tokenizer cannot
express exactly: its tokens are written (ids decode), but to serve the file through the gateway
pass the float folder's tokenizer, `voltserve serve --model X.gguf --tokenizer SRC`.
bench_decode needs none (it feeds token ids to the engine).

    python load_tests/common.py make-checkpoint --preset llama3-8b --out /tmp/voltserve-llama3-8b --device cuda
    python load_tests/make_gguf_checkpoint.py --src /tmp/voltserve-llama3-8b \
        --out /tmp/voltserve-llama3-8b-q4km/model.gguf --mix q4_k_m --device cuda
    python load_tests/bench_decode.py --preset llama3-8b \
        --model-dir /tmp/voltserve-llama3-8b-q4km/model.gguf --skip-transformers --runs 3 --warmup 1

A marker beside the file (voltserve_gguf.json: source folder and mix) makes a second call with
the same arguments a no-op.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

if not __package__:
    import _as_script  # noqa: F401  (load_tests.* importable; see _as_script.py)
from load_tests.gguf_pack import (  # noqa: E402
    Q4_K_M_FILE_TYPE,
    Q8_0_FILE_TYPE,
    q4_k_m_type,
    q8_0_type,
    quantize_k,
    quantize_q8_0,
)

# mix -> (llama.cpp file type, the ggml type of a tensor: (name, layers, row length, ndim,
# whether the file has output.weight) -> type name)
MIXES = {
    "q4_k_m": (Q4_K_M_FILE_TYPE, q4_k_m_type),
    "q8_0": (Q8_0_FILE_TYPE, lambda name, layers, row, ndim, has_output: q8_0_type(name, ndim)),
}
_LAYER = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}
_GLOBAL = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}
_HF_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")


def gguf_name(hf: str) -> str:
    if hf in _GLOBAL:
        return _GLOBAL[hf]
    m = _HF_LAYER.match(hf)
    if m is None or m[2] not in _LAYER:
        raise ValueError(f"tensor {hf!r} has no llama GGUF name (a dense llama checkpoint only)")
    return f"blk.{m[1]}.{_LAYER[m[2]]}"


def permute_qk(w: torch.Tensor, heads: int) -> torch.Tensor:
    """llama.cpp's converter order of llama q / k rows: within each head, rows (i, j) for the
    HF rows (j, i), j in {0, 1} the rotary half (the interleaved pairs its rope rotates)."""
    n = w.shape[0]
    return w.reshape(heads, 2, n // heads // 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def llama3_rope_freqs(cfg: dict[str, Any], rp: dict[str, Any]) -> np.ndarray:
    """Llama 3.1 rope scaling as llama.cpp stores it: one divisor per rotary frequency."""
    theta = float(rp.get("rope_theta") or cfg.get("rope_theta") or 10000.0)
    dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    old = rp["original_max_position_embeddings"]
    lo, hi, factor = rp["low_freq_factor"], rp["high_freq_factor"], rp["factor"]
    out = []
    for i in range(0, dim, 2):
        wavelen = 2 * math.pi * theta ** (i / dim)
        if wavelen < old / hi:  # high frequencies: unscaled
            out.append(1.0)
        elif wavelen > old / lo:  # low frequencies: divided by the factor
            out.append(factor)
        else:  # between: interpolated
            t = (old / wavelen - lo) / (hi - lo)
            out.append(1.0 / ((1 - t) / factor + t))
    return np.asarray(out, dtype=np.float32)


def _rope(cfg: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    rp = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    theta = float(cfg.get("rope_theta") or rp.get("rope_theta") or 10000.0)
    kind = rp.get("rope_type") or rp.get("type") or "default"
    return theta, (None if kind == "default" else {**rp, "rope_type": kind})


def _tokenizer(src: Path, cfg: dict[str, Any]) -> dict[str, Any]:
    """The folder's tokenizer as GGUF lists: tokens by id, types, merges, ids, template."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(src / "tokenizer.json"))
    vocab = tok.get_vocab(with_added_tokens=True)
    n = max(cfg["vocab_size"], max(vocab.values()) + 1)
    tokens = [f"[PAD{i}]" for i in range(n)]
    for t, i in vocab.items():
        tokens[i] = t
    types = [5] * n  # unused until named below
    for i in vocab.values():
        types[i] = 1  # normal
    tj = json.loads((src / "tokenizer.json").read_text())
    for added in tj.get("added_tokens") or []:
        if added.get("special"):
            types[added["id"]] = 3  # control
    merges = []
    if tj["model"].get("type") == "BPE":
        merges = [m if isinstance(m, str) else " ".join(m) for m in tj["model"].get("merges", [])]
    tcfg = {}
    if (src / "tokenizer_config.json").is_file():
        tcfg = json.loads((src / "tokenizer_config.json").read_text())
    template = tcfg.get("chat_template")
    if template is None and (src / "chat_template.jinja").is_file():
        template = (src / "chat_template.jinja").read_text()

    def first(v):
        return v[0] if isinstance(v, list) else v

    return {
        "tokens": tokens,
        "types": types,
        "merges": merges,
        "bos": first(cfg.get("bos_token_id")),
        "eos": first(cfg.get("eos_token_id")),
        "add_bos": bool(tcfg.get("add_bos_token", False)),
        "template": template,
    }


def _source_tensors(src: Path):
    """(HF name, safetensors file) in GGUF writing order: embedding, layers, norm, lm_head."""
    from safetensors import safe_open

    where: dict[str, Path] = {}
    for f in sorted(src.glob("*.safetensors")):
        with safe_open(str(f), framework="pt", device="cpu") as st:
            for name in st.keys():  # noqa: SIM118 (safe_open is not a dict)
                where[name] = f

    def order(name: str):
        m = _HF_LAYER.match(name)
        if m:
            return (1, int(m[1]), name)
        return (0 if "embed" in name else 2 if "norm" in name else 3, 0, name)

    return [(n, where[n]) for n in sorted(where, key=order)]


def _encode(x: torch.Tensor, kind: str) -> tuple[np.ndarray, Any]:
    """(data, raw_dtype) for GGUFWriter.add_tensor; x on the quantizing device."""
    import gguf

    if kind == "F32":
        return x.float().cpu().numpy(), None
    if kind == "F16":
        return x.half().cpu().numpy(), None
    qtype = gguf.GGMLQuantizationType[kind]
    if kind in ("Q4_K", "Q6_K"):
        return quantize_k(x, kind).cpu().numpy(), qtype
    if kind == "Q8_0":
        return quantize_q8_0(x).cpu().numpy(), qtype
    # Q5_0, the fallback of Q4_K rows that are not whole super-blocks (small models): gguf's numpy
    return gguf.quants.quantize(x.float().cpu().numpy(), qtype), qtype


def convert(src: Path, out: Path, mix: str = "q4_k_m", device: str = "cpu") -> dict[str, Any]:
    """Write the GGUF file `out` from the float folder `src` (reused when the marker beside it
    says it already holds exactly that); returns the marker with timings and type counts."""
    import gguf
    from safetensors import safe_open

    if mix not in MIXES:
        raise ValueError(f"unknown mix {mix!r}; choose from {sorted(MIXES)}")
    file_type, type_of = MIXES[mix]
    want = {"src": str(src), "mix": mix, "file": out.name}
    marker = out.parent / "voltserve_gguf.json"
    if out.is_file() and marker.is_file() and json.loads(marker.read_text()) == want:
        print(f"{out}: already holds the {mix} GGUF of {src}")
        return {**want, "reused": True}
    t0 = time.perf_counter()
    cfg = json.loads((src / "config.json").read_text())
    if cfg.get("model_type") != "llama":
        raise ValueError(f"{src}: model_type {cfg.get('model_type')!r}; only llama is written")
    heads = cfg["num_attention_heads"]
    kv = cfg.get("num_key_value_heads") or heads
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    layers = cfg["num_hidden_layers"]
    theta, scaling = _rope(cfg)
    out.parent.mkdir(parents=True, exist_ok=True)
    marker.unlink(missing_ok=True)
    w = gguf.GGUFWriter(str(out), "llama")
    w.add_name(src.name)
    w.add_file_type(file_type)
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_block_count(layers)
    w.add_head_count(heads)
    w.add_head_count_kv(kv)
    w.add_layer_norm_rms_eps(float(cfg["rms_norm_eps"]))
    w.add_rope_freq_base(theta)
    w.add_rope_dimension_count(head_dim)
    if head_dim != cfg["hidden_size"] // heads:
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
    w.add_vocab_size(cfg["vocab_size"])
    rope_freqs = None
    if scaling is not None:
        if scaling["rope_type"] == "llama3":
            rope_freqs = llama3_rope_freqs(cfg, scaling)
        elif scaling["rope_type"] == "linear":
            w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
            w.add_rope_scaling_factor(float(scaling["factor"]))
        else:
            raise ValueError(f"rope scaling {scaling['rope_type']!r} is not written")
    if (src / "tokenizer.json").is_file():
        tok = _tokenizer(src, cfg)
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre("default")
        w.add_token_list(tok["tokens"])
        w.add_token_types(tok["types"])
        if tok["merges"]:
            w.add_token_merges(tok["merges"])
        if tok["bos"] is not None:
            w.add_bos_token_id(int(tok["bos"]))
        if tok["eos"] is not None:
            w.add_eos_token_id(int(tok["eos"]))
        w.add_add_bos_token(tok["add_bos"])
        if tok["template"]:
            w.add_chat_template(tok["template"])
    t_meta = time.perf_counter() - t0

    counts: dict[str, int] = {}
    t_read = t_quant = 0.0
    handles: dict[Path, Any] = {}
    tensors = _source_tensors(src)
    has_output = any(hf == "lm_head.weight" for hf, _ in tensors)
    try:
        for hf, f in tensors:
            if f not in handles:
                handles[f] = safe_open(str(f), framework="pt", device="cpu")
            t = time.perf_counter()
            x = handles[f].get_tensor(hf).to(device)
            t_read += time.perf_counter() - t
            t = time.perf_counter()
            name = gguf_name(hf)
            if name.startswith("blk.") and name.endswith(("attn_q.weight", "attn_k.weight")):
                x = permute_qk(x, heads if "attn_q" in name else kv)
            kind = type_of(name, layers, x.shape[-1], x.dim(), has_output)
            data, raw = _encode(x, kind)
            w.add_tensor(name, data, raw_dtype=raw)
            counts[kind] = counts.get(kind, 0) + 1
            t_quant += time.perf_counter() - t
        if rope_freqs is not None:
            w.add_tensor("rope_freqs.weight", rope_freqs)
            counts["F32"] = counts.get("F32", 0) + 1
    finally:
        handles.clear()
    t = time.perf_counter()
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    t_write = time.perf_counter() - t
    marker.write_text(json.dumps(want))
    total = time.perf_counter() - t0
    stats = {
        "metadata_s": t_meta,
        "read_s": t_read,
        "quantize_s": t_quant,
        "write_s": t_write,
        "total_s": total,
        "file_bytes": out.stat().st_size,
        "types": counts,
    }
    print(
        f"wrote {out} ({stats['file_bytes'] / 2**30:.2f} GiB; "
        + ", ".join(f"{k} x{v}" for k, v in sorted(counts.items()))
        + f") in {total:.1f} s: metadata {t_meta:.1f}, read {t_read:.1f}, "
        f"quantize {t_quant:.1f}, write {t_write:.1f}"
    )
    return {**want, "reused": False, **stats}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.RawTextHelpFormatter
    )
    p.add_argument("--src", required=True, help="float Hugging Face llama folder")
    p.add_argument("--out", required=True, help="the .gguf file to write (its folder is made)")
    p.add_argument("--mix", default="q4_k_m", choices=sorted(MIXES))
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = p.parse_args(argv)
    out = Path(args.out)
    if out.suffix != ".gguf":
        raise SystemExit(f"--out {out}: name the .gguf file (e.g. {out}/model.gguf)")
    convert(Path(args.src), out, args.mix, args.device)


if __name__ == "__main__":
    main()
