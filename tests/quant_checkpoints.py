"""Quantized checkpoints for the tests, written from each format's published packing rules,
independently of the loader (services/executor/quant/): the tiny random models of
tests/checkpoints.py, every decoder linear quantized from its float weight to integer codes,
packed as AutoAWQ / GPTQModel / llm-compressor / llama.cpp store them.

The AWQ, GPTQ and compressed-tensors writers also quantize a float folder given as `src` (the
real-shape random checkpoints of tests/real_shapes.py), writing beside it instead of into the
session's folder.

Each writer returns (quantized checkpoint, reference): the reference is what transformers loads
to give the expected outputs. For AWQ and GPTQ it is a plain float checkpoint whose weights are
dequantized from the PACKED tensors by a reference written here from the published dequant rule
(and checked against the codes the packer started from); for compressed-tensors, by the
library's own decompressor; for GGUF the reference is the .gguf file itself, which transformers
dequantizes with the gguf package.
"""

from __future__ import annotations

import functools
import json
import re
import shutil
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from tests.checkpoints import _root, tokenizer

# Big enough for group 128 and the 256-element K-quant super-blocks on every linear's input.
QUANT_TINY = dict(
    hidden_size=256,
    intermediate_size=512,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
)
ARCH_QUANT_OVERRIDES: dict[str, dict] = {
    "llama": dict(tie_word_embeddings=False),
    "qwen2": dict(tie_word_embeddings=True),
    # head_dim 128 (Qwen3Config's default: transformers reads no head_dim from a qwen3 GGUF)
    "qwen3": dict(tie_word_embeddings=False, head_dim=128),
    # Qwen3-MoE: top-3 of 8 experts in every layer; expert K (hidden 256, expert intermediate
    # 64) divisible by the groups tested
    "qwen3_moe": dict(
        tie_word_embeddings=False,
        head_dim=32,
        num_experts=8,
        num_experts_per_tok=3,
        moe_intermediate_size=64,
        norm_topk_prob=True,
        mlp_only_layers=[],
        decoder_sparse_step=1,
    ),
    # GGUF MoE files (every layer sparse, as llama.cpp builds them); expert K divisible by the
    # K-quant super-block where the tests put K-quants (qwen2_moe's 96: 32-element types only)
    "qwen3_moe-gguf": dict(
        tie_word_embeddings=False,
        head_dim=64,  # o_proj's K (heads * head_dim) a K-quant super-block
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=256,
        norm_topk_prob=True,
        mlp_only_layers=[],
        decoder_sparse_step=1,
    ),
    "qwen2_moe-gguf": dict(
        tie_word_embeddings=False,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=96,
        shared_expert_intermediate_size=256,
        norm_topk_prob=False,
        mlp_only_layers=[],
        decoder_sparse_step=1,
    ),
}
# GGUF general.architecture of each tiny model (the default: the same name)
GGUF_ARCH = {"qwen3_moe-gguf": "qwen3moe", "qwen2_moe-gguf": "qwen2moe"}
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# The Gated DeltaNet projections of the hybrid families (Qwen3.5's four, Qwen3-Next's two fused)
HYBRID_LINEARS = (
    "in_proj_qkv",
    "in_proj_z",
    "in_proj_b",
    "in_proj_a",
    "in_proj_qkvz",
    "in_proj_ba",
    "out_proj",
)
# Mixtral's expert projections (block_sparse_moe.experts.N.w1 / w3 gate / up, w2 down)
MIXTRAL_LINEARS = ("w1", "w2", "w3")
AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]  # nibble i of a word holds column 8c + AWQ_ORDER[i]


@functools.cache
def float_checkpoint(arch: str, rope_scaling: bool = True) -> Path:
    from voltserve.services.executor.demo_model import write_checkpoint

    from tests.checkpoints import ARCH_OVERRIDES

    over = dict(QUANT_TINY)
    over.update(ARCH_QUANT_OVERRIDES[arch])
    if arch == "llama" and rope_scaling:
        over["rope_parameters"] = ARCH_OVERRIDES["llama"]["rope_parameters"]
    name = f"{arch}-qfloat" + ("" if rope_scaling else "-plainrope")
    return write_checkpoint(
        _root() / name,
        arch=arch.removesuffix("-gguf"),
        size="tiny",
        seed=11,
        tokenizer=tokenizer(),
        **over,
    )


def _source(arch: str, src: Path | None) -> tuple[Path, Path, str]:
    """(float folder, folder the outputs go in, their name prefix): the tiny `arch` model into
    the session's folder, or `src` beside itself."""
    if src is None:
        return float_checkpoint(arch), _root(), arch
    return src, src.parent, src.name


def _load_float(src: Path) -> dict:
    """Every tensor of a float folder, one safetensors file or several shards."""
    sd: dict = {}
    for f in sorted(src.glob("*.safetensors")):
        sd.update(load_file(f))
    return sd


def _linear_names(sd: dict, keep=lambda name: False) -> list[str]:
    """The decoder linears to quantize: every one but those `keep` (a checkpoint's list of
    modules left float) names."""
    return [
        n[: -len(".weight")]
        for n in sd
        if n.endswith(".weight")
        and n.split(".")[-2] in LINEARS + HYBRID_LINEARS + MIXTRAL_LINEARS
        and not keep(n[: -len(".weight")])
    ]


def _awq_keeps(entries: list[str]):
    """AutoAWQ's modules_to_not_convert rule: an entry names a module by a run of its dotted
    components (`linear_attn.in_proj_a`, `mlp.gate`, `visual`)."""

    def keep(name: str) -> bool:
        parts = name.split(".")
        for e in entries:
            want = e.split(".")
            if any(parts[i : i + len(want)] == want for i in range(len(parts))):
                return True
        return False

    return keep


def _ct_keeps(entries: list[str]):
    """llm-compressor's `ignore` rule: `re:` + a regex matched at the start of the module's
    name, else the module's full name."""
    return lambda name: any(
        re.match(e[3:], name) if e.startswith("re:") else e == name for e in entries
    )


def _copy_meta(src: Path, dst: Path) -> None:
    dst.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        # the writers put every tensor in one file; a source's markers describe the source
        skip = f.name == "model.safetensors.index.json" or f.name.startswith("voltserve_")
        if f.suffix != ".safetensors" and not skip:
            shutil.copy(f, dst / f.name)


def _write(dst: Path, tensors: dict, qcfg: dict | None) -> None:
    save_file({k: v.contiguous() for k, v in tensors.items()}, dst / "model.safetensors")
    cfg = json.loads((dst / "config.json").read_text())
    if qcfg is None:
        cfg.pop("quantization_config", None)
    else:
        cfg["quantization_config"] = qcfg
    (dst / "config.json").write_text(json.dumps(cfg, indent=1))


def _asym(w: np.ndarray, bits: int):
    """w [..., g] -> codes, fp16 scale, integer zero (w ~ (q - z) * s), per last-dim group."""
    qmax = (1 << bits) - 1
    lo, hi = np.minimum(w.min(-1), 0), np.maximum(w.max(-1), 0)
    s = np.maximum((hi - lo) / qmax, 1e-4).astype(np.float16).astype(np.float32)
    z = np.clip(np.round(-lo / s), 0, qmax)
    q = np.clip(np.round(w / s[..., None]) + z[..., None], 0, qmax)
    return q.astype(np.int64), s, z.astype(np.int64)


def _sym(w: np.ndarray, bits: int):
    half = 1 << (bits - 1)
    s = np.maximum(np.abs(w).max(-1) / (half - 1), 1e-4).astype(np.float16).astype(np.float32)
    q = np.clip(np.round(w / s[..., None]) + half, 0, 2 * half - 1)
    return q.astype(np.int64), s, np.full(s.shape, half, dtype=np.int64)


def _to_int32(words: np.ndarray) -> torch.Tensor:
    return torch.from_numpy((words & 0xFFFFFFFF).astype(np.uint32).view(np.int32).copy())


# ---- AWQ (AutoAWQ GEMM) --------------------------------------------------------------------


def _awq_pack_cols(v: np.ndarray) -> np.ndarray:
    """[R, N] 4-bit values -> [R, N/8] words, nibble i = column 8c + AWQ_ORDER[i]."""
    R, N = v.shape
    out = np.zeros((R, N // 8), dtype=np.int64)
    for i, col in enumerate(AWQ_ORDER):
        out |= v[:, col::8] << (4 * i)
    return out


def awq_reference_dequant(qweight, qzeros, scales, g: int) -> torch.Tensor:
    """AutoAWQ's dequant rule, per element: w[k, n] = (nib(qweight[k, n // 8], p) -
    nib(qzeros[k // g, n // 8], p)) * scales[k // g, n], p = the nibble of column n % 8.
    Returns the HF layout [N, K]."""
    pos = [AWQ_ORDER.index(j) for j in range(8)]
    qw = qweight.numpy().astype(np.int64) & 0xFFFFFFFF
    qz = qzeros.numpy().astype(np.int64) & 0xFFFFFFFF
    K, N = qw.shape[0], qw.shape[1] * 8
    n = np.arange(N)
    shift = np.array([4 * pos[j % 8] for j in n])
    q = (qw[:, n // 8] >> shift) & 0xF
    z = (qz[:, n // 8] >> shift) & 0xF
    k = np.arange(K)
    w = (q - z[k // g]) * scales.float().numpy()[k // g]
    return torch.from_numpy(w.astype(np.float32)).t().contiguous()


def awq_checkpoint(
    arch: str, group: int, src: Path | None = None, not_convert: list[str] | None = None
) -> tuple[Path, Path]:
    """Every decoder linear (MoE experts too: their leaves are gate/up/down_proj) quantized; an
    MoE router (mlp.gate) stays float, as AutoAWQ keeps it (modules_to_not_convert). With
    `not_convert` the modules it names stay float too, and it is the config's list."""
    src, root, prefix = _source(arch, src)
    tag = f"{prefix}-awq-g{group}" + ("-nc" if not_convert else "")
    dst, ref = root / tag, root / f"{tag}-ref"
    if (dst / "model.safetensors").is_file():
        return dst, ref
    sd = _load_float(src)
    out, refsd = dict(sd), dict(sd)
    for name in _linear_names(sd, _awq_keeps(not_convert or [])):
        w = sd.pop(name + ".weight").float().numpy()  # [N, K]
        del out[name + ".weight"]
        N, K = w.shape
        q, s, z = _asym(w.T.reshape(K // group, group, N).transpose(0, 2, 1), 4)  # [G, N, g]
        q = q.transpose(0, 2, 1).reshape(K, N)  # [K, N]
        out[name + ".qweight"] = _to_int32(_awq_pack_cols(q))
        out[name + ".qzeros"] = _to_int32(_awq_pack_cols(z))
        out[name + ".scales"] = torch.from_numpy(s).half()
        deq = awq_reference_dequant(
            out[name + ".qweight"], out[name + ".qzeros"], out[name + ".scales"], group
        )
        truth = ((q - np.repeat(z, group, 0)) * np.repeat(s, group, 0)).T
        assert np.array_equal(deq.numpy(), truth.astype(np.float32)), name
        refsd[name + ".weight"] = deq
    qcfg = {
        "quant_method": "awq",
        "bits": 4,
        "group_size": group,
        "zero_point": True,
        "version": "gemm",
        "modules_to_not_convert": not_convert or (["mlp.gate"] if "moe" in arch else None),
    }
    _copy_meta(src, dst)
    _write(dst, out, qcfg)
    _copy_meta(src, ref)
    _write(ref, refsd, None)
    return dst, ref


# ---- GPTQ (GPTQModel / AutoGPTQ) -----------------------------------------------------------


def _pack_rows(v: np.ndarray, bits: int) -> np.ndarray:
    """[K, N] -> [K / pack, N]: field j of word r is row r * pack + j."""
    pack = 32 // bits
    K, N = v.shape
    out = np.zeros((K // pack, N), dtype=np.int64)
    for j in range(pack):
        out |= (v[j::pack] & ((1 << bits) - 1)) << (bits * j)
    return out


def _pack_cols(v: np.ndarray, bits: int) -> np.ndarray:
    pack = 32 // bits
    R, N = v.shape
    out = np.zeros((R, N // pack), dtype=np.int64)
    for j in range(pack):
        out |= (v[:, j::pack] & ((1 << bits) - 1)) << (bits * j)
    return out


def gptq_reference_dequant(qweight, qzeros, scales, g_idx, bits: int, v1: bool) -> torch.Tensor:
    """AutoGPTQ's dequant rule: w[k, n] = (field(qweight[k // pack, n], k % pack) -
    (field(qzeros[g_idx[k], n // pack], n % pack) + 1 [v1 only])) * scales[g_idx[k], n].
    Returns [N, K]."""
    pack, mask = 32 // bits, (1 << bits) - 1
    qw = qweight.numpy().astype(np.int64) & 0xFFFFFFFF
    qz = qzeros.numpy().astype(np.int64) & 0xFFFFFFFF
    K, N = qw.shape[0] * pack, qw.shape[1]
    k, n = np.arange(K), np.arange(N)
    gi = g_idx.numpy().astype(np.int64)
    q = (qw[k // pack] >> (bits * (k % pack))[:, None]) & mask
    z = ((qz[gi][:, n // pack] >> (bits * (n % pack))[None, :]) & mask) + (1 if v1 else 0)
    w = (q - z) * scales.float().numpy()[gi]
    return torch.from_numpy(w.astype(np.float32)).t().contiguous()


def gptq_checkpoint(
    arch: str,
    bits: int,
    group: int,
    desc_act: bool,
    sym: bool,
    v1: bool = True,
    seed: int = 5,
    src: Path | None = None,
    in_block: list[list[str]] | None = None,
) -> tuple[Path, Path]:
    """in_block: AutoGPTQ's modules_in_block_to_quantize (the decoder linears it names, by a
    run of dotted components, are quantized; the others stay float)."""
    src, root, prefix = _source(arch, src)
    tag = f"{prefix}-gptq-{bits}b-g{group}-{'act' if desc_act else 'noact'}-{'sym' if sym else 'asym'}-{'v1' if v1 else 'v2'}"
    tag += "-inblock" if in_block else ""
    dst, ref = root / tag, root / (tag + "-ref")
    if (dst / "model.safetensors").is_file():
        return dst, ref
    rng = np.random.default_rng(seed)
    sd = _load_float(src)
    out, refsd = dict(sd), dict(sd)
    perms: dict[str, np.ndarray] = {}  # one act order per layer input (q/k/v share x)
    listed = _awq_keeps([m for names in in_block or [] for m in names])
    for name in _linear_names(sd, (lambda n: not listed(n)) if in_block else lambda n: False):
        w = sd[name + ".weight"].float().numpy()
        del out[name + ".weight"]
        N, K = w.shape
        G = K // group
        key = name.rsplit(".", 1)[0] + {
            "q_proj": "qkv",
            "k_proj": "qkv",
            "v_proj": "qkv",
            "gate_proj": "gu",
            "up_proj": "gu",
        }.get(name.rsplit(".", 1)[1], name)
        if desc_act:
            perm = perms.setdefault(key, rng.permutation(K))
        else:
            perm = np.arange(K)
        g_idx = np.empty(K, dtype=np.int64)
        g_idx[perm] = np.arange(K) // group  # the j-th column in act order is in group j // g
        cols = [np.flatnonzero(g_idx == gi) for gi in range(G)]
        wg = np.stack([w[:, c] for c in cols])  # [G, N, g]
        q, s, z = (_sym if sym else _asym)(wg, bits)
        if v1 and not sym:
            z = np.maximum(z, 1)  # v1 stores zero - 1; a zero of 0 has no encoding
            q = np.clip(np.round(wg / s[..., None]) + z[..., None], 0, (1 << bits) - 1).astype(
                np.int64
            )
        qkn = np.zeros((K, N), dtype=np.int64)
        for gi, c in enumerate(cols):
            qkn[c] = q[gi].T
        out[name + ".qweight"] = _to_int32(_pack_rows(qkn, bits))
        out[name + ".qzeros"] = _to_int32(_pack_cols(z - (1 if v1 else 0), bits))
        out[name + ".scales"] = torch.from_numpy(s).half()
        out[name + ".g_idx"] = torch.from_numpy(g_idx.astype(np.int32))
        deq = gptq_reference_dequant(
            out[name + ".qweight"],
            out[name + ".qzeros"],
            out[name + ".scales"],
            out[name + ".g_idx"],
            bits,
            v1,
        )
        truth = ((qkn - z[g_idx]) * s[g_idx]).T
        assert np.array_equal(deq.numpy(), truth.astype(np.float32)), name
        refsd[name + ".weight"] = deq
    qcfg = {
        "quant_method": "gptq",
        "bits": bits,
        "group_size": group,
        "desc_act": desc_act,
        "sym": sym,
        "lm_head": False,
        "checkpoint_format": "gptq" if v1 else "gptq_v2",
        "true_sequential": True,
    }
    if in_block:
        qcfg["modules_in_block_to_quantize"] = in_block
    _copy_meta(src, dst)
    _write(dst, out, qcfg)
    _copy_meta(src, ref)
    _write(ref, refsd, None)
    return dst, ref


# ---- compressed-tensors (llm-compressor), with the library's own compressor -----------------


def ct_checkpoint(
    arch: str,
    bits: int,
    group: int | None,
    sym: bool = True,
    src: Path | None = None,
    ignore: list[str] | None = None,
) -> tuple[Path, Path]:
    """ignore: the config's `ignore` list beside lm_head (the modules it names stay float)."""
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

    strategy = "group" if group else "channel"
    src, root, prefix = _source(arch, src)
    tag = f"{prefix}-ct-w{bits}a16-{strategy}{group or ''}-{'sym' if sym else 'asym'}"
    tag += "-ignore" if ignore else ""
    dst, ref = root / tag, root / (tag + "-ref")
    if (dst / "model.safetensors").is_file():
        return dst, ref
    wargs = dict(num_bits=bits, type="int", symmetric=sym, strategy=strategy)
    if group:
        wargs["group_size"] = group
    scheme = QuantizationScheme(targets=["Linear"], weights=QuantizationArgs(**wargs))
    sd = _load_float(src)
    out, refsd = dict(sd), dict(sd)
    half = 1 << (bits - 1)
    for name in _linear_names(sd, _ct_keeps(ignore or [])):
        w = sd[name + ".weight"].float()
        del out[name + ".weight"]
        N, K = w.shape
        g = group or K
        wg = w.view(N, K // g, g)
        if sym:
            scale = (wg.abs().amax(-1) / (half - 1)).clamp_min(1e-4)
            zp = None
        else:
            lo, hi = wg.amin(-1).clamp_max(0), wg.amax(-1).clamp_min(0)
            scale = ((hi - lo) / (2 * half - 1)).clamp_min(1e-4)
            zp = (torch.round(-lo / scale) - half).clamp(-half, half - 1).to(torch.int8)
        state = {"weight": w.half(), "weight_scale": scale.half()}
        if zp is not None:
            state["weight_zero_point"] = zp
        comp = PackedQuantizationCompressor.compress(state, scheme)
        for k, v in comp.items():
            out[f"{name}.{k}"] = v
        # The library dequantizes in the scale's dtype; widen the scale so its reference is
        # computed in fp32 (exact for these codes), as the loader computes it.
        wide = {**comp, "weight_scale": comp["weight_scale"].float()}
        refsd[name + ".weight"] = PackedQuantizationCompressor.decompress(wide, scheme)["weight"]
    qcfg = {
        "quant_method": "compressed-tensors",
        "format": "pack-quantized",
        "quantization_status": "compressed",
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "weights": {**wargs, "group_size": group, "dynamic": False, "observer": "minmax"},
                "input_activations": None,
                "output_activations": None,
                "format": "pack-quantized",
            }
        },
        "ignore": ["lm_head", *(ignore or [])],
    }
    _copy_meta(src, dst)
    _write(dst, out, qcfg)
    _copy_meta(src, ref)
    _write(ref, refsd, None)
    return dst, ref


# ---- GGUF (llama.cpp), written with the gguf package's GGUFWriter ---------------------------
# Q4_0/Q4_1/Q5_0/Q5_1/Q8_0 are quantized by gguf.quants.quantize; gguf ships no quantizer for
# the K-quants, so those blocks are built here from the block layouts of ggml-common.h.

QK_K = 256


def _f16_bytes(x: np.ndarray) -> np.ndarray:
    return x.astype(np.float16).view(np.uint8).reshape(*x.shape, 2)


def _k_scales_6bit(sc: np.ndarray, mn: np.ndarray) -> np.ndarray:
    """8 six-bit scales and mins -> the 12 bytes get_scale_min_k4 reads."""
    out = np.zeros((*sc.shape[:-1], 12), dtype=np.uint8)
    for j in range(4):
        out[..., j] = (sc[..., j] & 63) | ((sc[..., j + 4] >> 4) << 6)
        out[..., j + 4] = (mn[..., j] & 63) | ((mn[..., j + 4] >> 4) << 6)
        out[..., j + 8] = (sc[..., j + 4] & 0xF) | ((mn[..., j + 4] & 0xF) << 4)
    return out


def _q45_k(w: np.ndarray, bits: int) -> np.ndarray:
    """Q4_K (bits 4) / Q5_K (bits 5) blocks of w [N, K]: 8 groups of 32 per 256, y = d*sc*q -
    dmin*m with 6-bit sc, m."""
    N, K = w.shape
    qmax = (1 << bits) - 1
    x = w.reshape(N, K // QK_K, 8, 32).astype(np.float32)
    lo = np.minimum(x.min(-1), 0)
    hi = np.maximum(x.max(-1), 0)
    scf = np.maximum((hi - lo) / qmax, 1e-8)
    mnf = -lo
    d = (scf.max(-1) / 63).astype(np.float16).astype(np.float32)
    dmin = np.maximum(mnf.max(-1) / 63, 1e-8).astype(np.float16).astype(np.float32)
    sc = np.clip(np.round(scf / d[..., None]), 1, 63).astype(np.uint8)
    mn = np.clip(np.round(mnf / dmin[..., None]), 0, 63).astype(np.uint8)
    step = d[..., None] * sc
    q = np.clip(np.round((x + (dmin[..., None] * mn)[..., None]) / step[..., None]), 0, qmax)
    q = q.astype(np.uint8)  # [N, nb, 8, 32]
    lowq = q & 0xF
    qs = (lowq[:, :, 0::2] | (lowq[:, :, 1::2] << 4)).reshape(N, -1, 128)
    parts = [
        _f16_bytes(d).reshape(N, -1, 2),
        _f16_bytes(dmin).reshape(N, -1, 2),
        _k_scales_6bit(sc, mn),
    ]
    if bits == 5:
        qh = np.zeros((N, K // QK_K, 32), dtype=np.uint8)
        for gi in range(8):
            qh |= ((q[:, :, gi] >> 4) & 1) << gi
        parts.append(qh)
    parts.append(qs)
    return np.concatenate(parts, -1).reshape(N, -1)


def _q6_k(w: np.ndarray) -> np.ndarray:
    """Q6_K blocks: 16 groups of 16 per 256, y = d * sc * (q - 32), sc int8, q 6-bit."""
    N, K = w.shape
    x = w.reshape(N, K // QK_K, 16, 16).astype(np.float32)
    scf = np.maximum(np.abs(x).max(-1) / 31, 1e-8)
    d = (scf.max(-1) / 127).astype(np.float16).astype(np.float32)
    sc = np.clip(np.round(scf / d[..., None]), 1, 127).astype(np.int8)
    step = d[..., None] * sc.astype(np.float32)
    q = np.clip(np.round(x / step[..., None]) + 32, 0, 63).astype(np.uint8)
    q = q.reshape(N, -1, 2, 4, 32)  # half, quarter, l
    ql = np.zeros((N, q.shape[1], 2, 64), dtype=np.uint8)
    ql[..., :32] = (q[:, :, :, 0] & 0xF) | ((q[:, :, :, 2] & 0xF) << 4)
    ql[..., 32:] = (q[:, :, :, 1] & 0xF) | ((q[:, :, :, 3] & 0xF) << 4)
    qh = np.zeros((N, q.shape[1], 2, 32), dtype=np.uint8)
    for quarter in range(4):
        qh |= (q[:, :, :, quarter] >> 4) << (2 * quarter)
    parts = [
        ql.reshape(N, -1, 128),
        qh.reshape(N, -1, 64),
        sc.view(np.uint8),
        _f16_bytes(d).reshape(N, -1, 2),
    ]
    return np.concatenate(parts, -1).reshape(N, -1)


def gguf_quantize(w: np.ndarray, kind: str):
    """(data, raw_dtype) for GGUFWriter.add_tensor."""
    import gguf

    T = gguf.GGMLQuantizationType
    if kind == "F32":
        return w.astype(np.float32), None
    if kind == "F16":
        return w.astype(np.float16), None
    if kind in ("Q4_K", "Q5_K", "Q6_K"):
        # rows of the last dim (a stacked [E, N, K] expert tensor too)
        rows = w.reshape(-1, w.shape[-1])
        blocks = _q6_k(rows) if kind == "Q6_K" else _q45_k(rows, int(kind[1]))
        return blocks.reshape(*w.shape[:-1], -1), T[kind]
    return gguf.quants.quantize(w.astype(np.float32), T[kind]), T[kind]


_GGUF_LAYER = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "mlp.gate": "ffn_gate_inp",
    "mlp.shared_expert.gate_proj": "ffn_gate_shexp",
    "mlp.shared_expert.up_proj": "ffn_up_shexp",
    "mlp.shared_expert.down_proj": "ffn_down_shexp",
    "mlp.shared_expert_gate": "ffn_gate_inp_shexp",
}
# The tensors outside the layers, by their Hugging Face and GGUF names.
GGUF_TOP = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}
_HF_EXPERT = re.compile(r"^model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate|up|down)_proj\.weight$")


def gguf_expert_groups(names) -> dict[str, list[str]]:
    """GGUF name of each stacked expert tensor (blk.N.ffn_gate_exps ..., [E, N, K]) -> the
    Hugging Face names of its experts' projections, in expert order."""
    experts: dict[str, dict[int, str]] = {}
    for hf in names:
        m = _HF_EXPERT.match(hf)
        if m:
            experts.setdefault(f"blk.{m[1]}.ffn_{m[3]}_exps.weight", {})[int(m[2])] = hf
    return {g: [per[e] for e in range(len(per))] for g, per in experts.items()}


def _gguf_tensors(sd: dict) -> dict[str, np.ndarray]:
    """GGUF name -> float array, as llama.cpp's converter lays them out: each layer's experts
    stacked per projection, the shared-expert gate a vector [H]."""
    groups = gguf_expert_groups(sd)
    stacked = {hf for names in groups.values() for hf in names}
    out: dict[str, np.ndarray] = {}
    for hf, t in sd.items():
        if hf not in stacked:
            gname, x = _gguf_name(hf), t.float().numpy()
            out[gname] = x.reshape(-1) if gname.endswith("ffn_gate_inp_shexp.weight") else x
    for gname, names in groups.items():
        out[gname] = np.stack([sd[hf].float().numpy() for hf in names])
    return out


def _gguf_name(hf: str) -> str:
    if hf in GGUF_TOP:
        return GGUF_TOP[hf]
    parts = hf.split(".")  # model.layers.i.<module...>.<weight|bias>
    return f"blk.{parts[2]}.{_GGUF_LAYER['.'.join(parts[3:-1])]}.{parts[-1]}"


def _permute_for_gguf(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's converter permutation of llama q/k rows (its rotary pairs adjacent dims)."""
    return (
        w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
    )


def llama3_rope_factors(cfg: dict) -> np.ndarray:
    """llama.cpp's converter form of Llama 3.1 rope scaling: one divisor per frequency (its
    rope_freqs tensor), from the config's llama3 parameters."""
    import math

    rp = cfg["rope_parameters"]
    base, dim = (
        rp["rope_theta"],
        cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"],
    )
    old = rp["original_max_position_embeddings"]
    lo, hi, factor = rp["low_freq_factor"], rp["high_freq_factor"], rp["factor"]
    out = []
    for i in range(0, dim, 2):
        wavelen = 2 * math.pi * base ** (i / dim)
        if wavelen < old / hi:
            out.append(1.0)
        elif wavelen > old / lo:
            out.append(factor)
        else:
            smooth = (old / wavelen - lo) / (hi - lo)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


def add_gguf_tokenizer(w) -> None:
    """The test tokenizer as llama.cpp writes a gpt2-style BPE vocabulary into GGUF metadata."""
    tok = tokenizer()
    tj = json.loads(tok.backend_tokenizer.to_str())
    tokens = [tok.convert_ids_to_tokens(i) for i in range(len(tok))]
    merges = [m if isinstance(m, str) else " ".join(m) for m in tj["model"]["merges"]]
    special = set(tok.all_special_ids)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([3 if i in special else 1 for i in range(len(tokens))])
    w.add_token_merges(merges)
    w.add_eos_token_id(tok.convert_tokens_to_ids("<|im_end|>"))
    w.add_bos_token_id(tok.convert_tokens_to_ids("<|endoftext|>"))
    w.add_pad_token_id(tok.convert_tokens_to_ids("<|endoftext|>"))
    w.add_add_bos_token(False)
    w.add_chat_template(tok.chat_template)


def add_gguf_metadata(
    w, cfg: dict, blocks: int, rotary_dim: int, expert_sizes: bool = True
) -> None:
    """The model keys llama.cpp's converter writes for a config.json (sizes, heads, rope,
    vocabulary, experts) and the tokenizer. blocks: the block count (layers, with any MTP
    block); expert_sizes: write the expert_(shared_)feed_forward_length keys."""
    heads = cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    if cfg.get("intermediate_size"):
        w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_block_count(blocks)
    w.add_head_count(heads)
    w.add_head_count_kv(cfg["num_key_value_heads"])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    rope = cfg.get("rope_parameters") or {}
    w.add_rope_freq_base(float(rope.get("rope_theta") or cfg.get("rope_theta") or 10000.0))
    w.add_rope_dimension_count(rotary_dim)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_vocab_size(cfg["vocab_size"])
    experts = cfg.get("num_experts") or cfg.get("num_local_experts")  # transformers 5
    if experts:
        w.add_expert_count(experts)
        w.add_expert_used_count(cfg["num_experts_per_tok"])
        if expert_sizes:
            w.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
            if cfg.get("shared_expert_intermediate_size"):
                w.add_expert_shared_feed_forward_length(cfg["shared_expert_intermediate_size"])
    add_gguf_tokenizer(w)


def write_gguf(w) -> None:
    """Write a GGUFWriter's header, metadata and tensors to its file, and close it."""
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def small_gguf(path: Path, arch: str, meta: dict, tensors: dict[str, np.ndarray]) -> None:
    """A GGUF file of the given `arch`.* metadata (int: uint32, else float32) and float
    tensors, for the loader's refusals."""
    import gguf

    w = gguf.GGUFWriter(str(path), arch)
    for k, v in meta.items():
        (w.add_uint32 if isinstance(v, int) else w.add_float32)(f"{arch}.{k}", v)
    for name, x in tensors.items():
        w.add_tensor(name, x)
    write_gguf(w)


def gguf_checkpoint(
    arch: str,
    types,
    name: str,
    split: int = 1,
    llama3_rope: bool = False,
    expert_sizes: bool = True,
) -> Path:
    """A GGUF file of the tiny `arch` model; types(gguf tensor name) -> ggml type name for the
    2-D and 3-D (stacked experts) weights (1-D tensors stay F32). Returns the folder holding it
    (tokenizer in the metadata only). llama3_rope: the Llama 3.1 rope scaling as a rope_freqs
    tensor. expert_sizes: write the expert_(shared_)feed_forward_length keys."""
    import gguf

    src = float_checkpoint(arch, rope_scaling=llama3_rope)
    garch = GGUF_ARCH.get(arch, arch)
    out = _root() / f"{arch}-gguf-{name}"
    if out.is_dir():
        return out
    out.mkdir()
    cfg = json.loads((src / "config.json").read_text())
    sd = load_file(src / "model.safetensors")
    heads, kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads

    def writer(path: Path, with_meta: bool, part: int) -> gguf.GGUFWriter:
        w = gguf.GGUFWriter(str(path), garch)
        if split > 1:
            w.add_uint16("split.no", part)
            w.add_uint16("split.count", split)
        if with_meta:
            add_gguf_metadata(w, cfg, cfg["num_hidden_layers"], head_dim, expert_sizes)
        return w

    tensors = _gguf_tensors(sd)
    names = list(tensors)
    chunks = [names[i::split] for i in range(split)]
    for part, chunk in enumerate(chunks):
        fname = f"model-{part + 1:05d}-of-{split:05d}.gguf" if split > 1 else "model.gguf"
        w = writer(out / fname, part == 0, part)
        for gname in chunk:
            x = tensors[gname]
            if arch == "llama" and gname.split(".")[-2] in ("attn_q", "attn_k"):
                x = _permute_for_gguf(x, heads if "attn_q" in gname else kv)
            kind = types(gname) if x.ndim >= 2 else "F32"
            data, raw = gguf_quantize(x, kind)
            w.add_tensor(gname, data, raw_dtype=raw)
        if llama3_rope and part == 0:
            w.add_tensor("rope_freqs.weight", llama3_rope_factors(cfg))
        write_gguf(w)
    return out


def q4_k_m_types(gname: str) -> str:
    """A Q4_K_M-style mix: Q4_K by default, Q6_K for the output head and attn_v / ffn_down of
    the first layer (llama.cpp's use_more_bits layers), Q5_0 and F16 on one linear each of the
    second layer (a q/k/v mixing float and quantized shards)."""
    if gname == "output.weight":
        return "Q6_K"
    if gname in ("blk.0.attn_v.weight", "blk.0.ffn_down.weight"):
        return "Q6_K"
    if gname == "blk.1.ffn_up.weight":
        return "Q5_0"
    if gname == "blk.1.attn_k.weight":
        return "F16"
    return "Q4_K"
