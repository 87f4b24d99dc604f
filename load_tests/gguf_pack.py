"""GGUF K-quant and Q8_0 blocks packed with torch, vectorized over whole tensors (on CUDA or the
CPU: the same code, the device is the input's), and llama.cpp's Q4_K_M and Q8_0 type rules:
what load_tests/make_gguf_checkpoint.py writes an 8B GGUF with in seconds.

Block layouts (ggml-common.h; the K-quants 256 elements per super-block, Q8_0 32 per block):

| type | bytes | fields, in order | w = |
|---|---|---|---|
| Q4_K | 144 | d fp16, dmin fp16, scales[12] (8 six-bit scales + 8 six-bit mins), qs[128] | d*sc*q - dmin*m |
| Q6_K | 210 | ql[128] (low 4 bits), qh[64] (high 2 bits), scales[16] int8, d fp16 | d*sc*(q - 32) |
| Q8_0 | 34 per 32 elements | d fp16, qs[32] int8 | d*q |

Q4_K: 8 groups of 32; qs is 4 chunks of 32 bytes, chunk c holding group 2c in its low nibbles
and group 2c + 1 in its high ones. The 12 scale bytes: bytes 0..3 the low 6 bits of scales
0..3 (top 2 bits: bits 4..5 of scales 4..7), bytes 4..7 the same for the mins, bytes 8..11
scale j + 4's low nibble and min j + 4's low nibble in the high one.
Q6_K: 16 groups of 16; two halves of 128 elements, each four quarters of 32: ql holds quarters
0 / 1 in the low nibbles of its bytes 0..31 / 32..63 and quarters 2 / 3 in the high nibbles; qh
byte l holds the high 2 bits of quarter k's element l at bits 2k.

The rounding is round-to-nearest min/max per group (no search: benchmark weights are random),
the same arithmetic as tests/quant_checkpoints.py's numpy packers (`_q45_k`, `_q6_k`), so
the two give the same bytes for the same float32 input (tests/load/test_make_gguf_checkpoint.py
checks it, and that gguf's own dequantizer reads them back). Q8_0 follows ggml's reference
quantizer (d = amax / 127, codes rounded half away from zero), byte for byte what the gguf
package's own quantizer writes.
"""

from __future__ import annotations

import torch

QK_K = 256
BLOCK_BYTES = {"Q4_K": 144, "Q6_K": 210}
# llama.cpp's replacement for a K-quant on rows that are not whole 256-element super-blocks
INCOMPATIBLE_FALLBACK = {"Q4_K": "Q5_0", "Q6_K": "Q8_0"}


def _f16_bytes(x: torch.Tensor) -> torch.Tensor:
    """float [...] -> its fp16 bytes, uint8 [..., 2] (little-endian, as every torch device)."""
    return x.to(torch.float16).unsqueeze(-1).view(torch.uint8)


def k_scales_6bit(sc: torch.Tensor, mn: torch.Tensor) -> torch.Tensor:
    """[..., 8] six-bit scales and mins (uint8) -> the 12 scale bytes of a Q4_K / Q5_K block."""
    lo_s, hi_s = sc[..., :4], sc[..., 4:]
    lo_m, hi_m = mn[..., :4], mn[..., 4:]
    return torch.cat(
        [
            (lo_s & 63) | ((hi_s >> 4) << 6),
            (lo_m & 63) | ((hi_m >> 4) << 6),
            (hi_s & 0xF) | ((hi_m & 0xF) << 4),
        ],
        dim=-1,
    )


def _q4_k_rows(w: torch.Tensor) -> torch.Tensor:
    N, K = w.shape
    x = w.float().reshape(N, K // QK_K, 8, 32)
    lo = x.amin(-1).clamp(max=0)
    hi = x.amax(-1).clamp(min=0)
    scf = ((hi - lo) / 15).clamp(min=1e-8)
    mnf = -lo
    d = (scf.amax(-1) / 63).half().float()
    dmin = (mnf.amax(-1) / 63).clamp(min=1e-8).half().float()
    # A super-block of zeros has d = 0 and one of no negative value dmin = 0 (1e-8 is below
    # fp16's range): their scales / mins / codes would divide by zero, so they get 0 there (what
    # they multiply decodes to 0 whatever they are).
    sc = torch.where(d[..., None] > 0, torch.round(scf / d[..., None]), 1).clamp(1, 63)
    mn = torch.where(dmin[..., None] > 0, torch.round(mnf / dmin[..., None]), 0).clamp(0, 63)
    step = (d[..., None] * sc)[..., None]
    num = x + (dmin[..., None] * mn)[..., None]
    q = torch.where(step > 0, torch.round(num / step), 0).clamp(0, 15).to(torch.uint8)
    qs = (q[:, :, 0::2] | (q[:, :, 1::2] << 4)).reshape(N, -1, 128)
    scales = k_scales_6bit(sc.to(torch.uint8), mn.to(torch.uint8))
    return torch.cat([_f16_bytes(d), _f16_bytes(dmin), scales, qs], dim=-1).reshape(N, -1)


def _q6_k_rows(w: torch.Tensor) -> torch.Tensor:
    N, K = w.shape
    x = w.float().reshape(N, K // QK_K, 16, 16)
    scf = (x.abs().amax(-1) / 31).clamp(min=1e-8)
    d = (scf.amax(-1) / 127).half().float()
    sc = torch.where(d[..., None] > 0, torch.round(scf / d[..., None]), 1).clamp(1, 127)
    step = (d[..., None] * sc)[..., None]
    q = torch.where(step > 0, torch.round(x / step), 0) + 32
    q = q.clamp(0, 63).to(torch.uint8).reshape(N, -1, 2, 4, 32)  # half, quarter, l
    # ql bytes 0..31: quarter 0 low, quarter 2 high; bytes 32..63: quarters 1 and 3
    ql = torch.cat([q[:, :, :, k] & 0xF for k in (0, 1)], dim=-1) | torch.cat(
        [(q[:, :, :, k] & 0xF) << 4 for k in (2, 3)], dim=-1
    )
    qh = (q[:, :, :, 0] >> 4) | ((q[:, :, :, 1] >> 4) << 2)
    qh = qh | ((q[:, :, :, 2] >> 4) << 4) | ((q[:, :, :, 3] >> 4) << 6)
    parts = [
        ql.reshape(N, -1, 128),
        qh.reshape(N, -1, 64),
        sc.to(torch.int8).view(torch.uint8),
        _f16_bytes(d),
    ]
    return torch.cat(parts, dim=-1).reshape(N, -1)


def quantize_k(w: torch.Tensor, kind: str, max_elems: int | None = None) -> torch.Tensor:
    """The `kind` (Q4_K, Q6_K) blocks of a float [..., K] tensor (K a multiple of 256), as uint8
    [..., K / 256 * block bytes] on w's device. Rows go max_elems elements at a time (default:
    2^28 on CUDA, 2^24 on the CPU) to bound the float32 temporaries."""
    if kind not in BLOCK_BYTES:
        raise ValueError(f"no torch packer for {kind} (have {sorted(BLOCK_BYTES)})")
    K = w.shape[-1]
    if K % QK_K:
        raise ValueError(f"{kind}: row length {K} is not a multiple of {QK_K}")
    rows = w.reshape(-1, K)
    if max_elems is None:
        max_elems = 1 << (28 if rows.is_cuda else 24)
    step = max(1, max_elems // K)
    pack = _q6_k_rows if kind == "Q6_K" else _q4_k_rows
    out = torch.empty(
        rows.shape[0], K // QK_K * BLOCK_BYTES[kind], dtype=torch.uint8, device=w.device
    )
    for i in range(0, rows.shape[0], step):
        out[i : i + step] = pack(rows[i : i + step])
    return out.reshape(*w.shape[:-1], -1)


QK8_0 = 32


def quantize_q8_0(w: torch.Tensor, max_elems: int | None = None) -> torch.Tensor:
    """The Q8_0 blocks of a float [..., K] tensor (K a multiple of 32), as uint8 [..., K / 32 *
    34] on w's device, row chunks bounded as quantize_k's."""
    K = w.shape[-1]
    if K % QK8_0:
        raise ValueError(f"Q8_0: row length {K} is not a multiple of {QK8_0}")
    rows = w.reshape(-1, K)
    if max_elems is None:
        max_elems = 1 << (28 if rows.is_cuda else 24)
    step = max(1, max_elems // K)
    out = torch.empty(rows.shape[0], K // QK8_0 * 34, dtype=torch.uint8, device=w.device)
    for i in range(0, rows.shape[0], step):
        x = rows[i : i + step].float().reshape(-1, K // QK8_0, QK8_0)
        d = x.abs().amax(-1, keepdim=True) / 127
        inv = torch.where(d == 0, 0.0, 1.0 / d)
        a = (x * inv).abs()
        whole = torch.floor(a)
        # half away from zero, in ggml's own steps (floor(a + 0.5) differs just below a half)
        q = torch.sign(x) * (whole + torch.floor(2 * (a - whole)))
        blocks = torch.cat([_f16_bytes(d[..., 0]), q.to(torch.int8).view(torch.uint8)], dim=-1)
        out[i : i + step] = blocks.reshape(x.shape[0], -1)
    return out.reshape(*w.shape[:-1], -1)


# ---- llama.cpp's Q8_0 files (LLAMA_FTYPE_MOSTLY_Q8_0 = 7): every matrix Q8_0, norms F32 --------

Q8_0_FILE_TYPE = 7


def q8_0_type(name: str, ndim: int) -> str:
    """The ggml type of the GGUF tensor `name` in a Q8_0 file: token_embd and output too."""
    return "F32" if ndim < 2 else "Q8_0"


# ---- llama.cpp's Q4_K_M mix (llama_tensor_get_type, LLAMA_FTYPE_MOSTLY_Q4_K_M = 15) ---------

Q4_K_M_FILE_TYPE = 15


def use_more_bits(i_layer: int, n_layers: int) -> bool:
    """The layers a *_K_M mix gives more bits: the first and last eighth, and every third layer
    between them."""
    return (
        i_layer < n_layers // 8
        or i_layer >= 7 * n_layers // 8
        or (i_layer - n_layers // 8) % 3 == 2
    )


def q4_k_m_type(name: str, n_layers: int, row_len: int, ndim: int, has_output: bool = True) -> str:
    """The ggml type llama.cpp's Q4_K_M gives the GGUF tensor `name` (a dense llama-family model,
    not 70B-sized: that one also raises attn_v): 1-D tensors F32; output.weight Q6_K (Q8_0 when
    its rows are not whole super-blocks), and token_embd so when the file has no output.weight
    (tied embeddings: it is the head); attn_v and ffn_down Q6_K on use_more_bits layers; the
    rest (token_embd too) Q4_K; a K-quant on rows of a length not a multiple of 256 falls back
    to Q5_0 (Q4_K) / Q8_0 (Q6_K), as llama.cpp does."""
    if ndim < 2:
        return "F32"
    if name == "output.weight" or (name == "token_embd.weight" and not has_output):
        return "Q6_K" if row_len % QK_K == 0 else "Q8_0"
    kind = "Q4_K"
    parts = name.split(".")
    if parts[0] == "blk" and parts[2] in ("attn_v", "ffn_down"):
        if use_more_bits(int(parts[1]), n_layers):
            kind = "Q6_K"
    if row_len % QK_K:
        kind = INCOMPATIBLE_FALLBACK[kind]
    return kind
