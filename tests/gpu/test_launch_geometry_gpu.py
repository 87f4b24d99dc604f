"""Vocabulary-sized quantized weights on a real GPU: more rows than gridDim.y's 65,535.

A llama.cpp Q4_K_M file keeps `output.weight` in Q6_K, so the lm_head of Llama 3 (128,256 rows)
runs through the quantized linear; its dequantize launch once put the rows on gridDim.y and
failed with CUDA_ERROR_INVALID_VALUE. Here the dequantize kernel fills Q6_K, Q8_0 and int4
(AWQ g128, Q4_K) weights of 128,256 and 262,144 rows (NaN-poisoned) against quant_pack's
reference, and the model's compute_logits runs a Q6_K lm_head at 128,256 rows and a Q8_0 one at
262,144 through the GGUF LinearMethod on every path (GEMV, tensor-core GEMM, dequantize +
cuBLAS) against an fp32 product with the dequantized weight. Skipped without CUDA."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

DEV = torch.device("cuda")
# (bits, group) of the packed forms: Q6_K, Q8_0, AWQ int4 g128, Q4_K
PACKED = {"Q6_K": (8, 16), "Q8_0": (8, 32), "int4 g128": (4, 128), "Q4_K": (4, 32)}


@pytest.mark.parametrize("rows", [128_256, 262_144])
@pytest.mark.parametrize("kind", list(PACKED))
def test_dequantize_vocabulary_rows(kind: str, rows: int) -> None:
    from voltserve.kernels.linear import quant_dequant
    from voltserve.kernels.linear.quant_pack import dequantize, pack_group_quant

    bits, group = PACKED[kind]
    K = 512  # the rows are what matters; a short K keeps the test to a second
    gen = torch.Generator(device=DEV).manual_seed(rows + bits * 7 + group)
    codes = torch.randint(0, 2**bits, (rows, K), generator=gen, device=DEV, dtype=torch.uint8)
    s = torch.rand(rows, K // group, generator=gen, device=DEV) * 0.01
    o = torch.randn(rows, K // group, generator=gen, device=DEV) * 0.01
    w = pack_group_quant(codes, s, o, bits, group, torch.float16)
    out = torch.full((rows, K), float("nan"), dtype=torch.float16, device=DEV)
    assert quant_dequant.supports(w, out)
    quant_dequant.dequantize_into(w, out)
    torch.cuda.synchronize()
    assert not torch.isnan(out).any(), "rows left poisoned (NaN)"
    ref = dequantize(w, torch.float16)
    # one fp16 rounding of the same fp32 value (an FMA may round differently: 1 ulp)
    torch.testing.assert_close(out.float(), ref.float(), atol=1e-4, rtol=1e-3)


def _gguf_bytes(kind: str, rows: int, K: int, gen: torch.Generator) -> torch.Tensor:
    """Random ggml blocks of `kind` with a sane fp16 scale d in every block."""
    from voltserve.kernels.linear.gguf_blocks import BLOCK_TYPES

    bt = BLOCK_TYPES[kind]
    nb = K // bt.block
    shape = (rows, nb, bt.nbytes)
    raw = torch.randint(0, 256, shape, generator=gen, device=DEV, dtype=torch.uint8)
    at = {"Q6_K": 208, "Q8_0": 0}[kind]  # where the block's fp16 d sits (ggml-common.h)
    d = torch.rand(rows, nb, generator=gen, device=DEV) * 2e-3 + 1e-4
    raw[..., at : at + 2] = d.half().view(torch.uint8).view(rows, nb, 2)
    return raw.view(rows, nb * bt.nbytes)


@pytest.mark.parametrize(
    "kind,vocab,hidden",
    [("Q6_K", 128_256, 4096), ("Q8_0", 262_144, 2560)],  # Llama 3 8B; Gemma 3 4B's sizes
)
def test_compute_logits_through_the_gguf_lm_head(kind: str, vocab: int, hidden: int) -> None:
    from voltserve.kernels.dispatch import KernelDispatch
    from voltserve.kernels.linear import quant_linear
    from voltserve.services.executor.gguf_source import GGUFQuantConfig, dequantize_raw
    from voltserve.services.executor.models.llama import LlamaForCausalLM, ModelArch

    arch = ModelArch(
        architecture="LlamaForCausalLM",
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_layers=1,
        num_heads=hidden // 128,
        num_kv_heads=4,
        head_dim=128,
        rms_norm_eps=1e-5,
        max_position_embeddings=256,
        rope_theta=500000.0,
    )
    quant = GGUFQuantConfig({"lm_head": (kind, "output.weight")})
    with torch.device(DEV):
        model = LlamaForCausalLM(arch, torch.float16, quant)
    gen = torch.Generator(device=DEV).manual_seed(vocab + hidden)
    raw = _gguf_bytes(kind, vocab, hidden, gen)
    head = model.lm_head
    head.method.load(head, "weight", None, raw)
    head.method.process_after_loading(head)
    assert head.qweight.out_features == vocab
    model.ops = KernelDispatch(DEV, torch.float16)
    w32 = dequantize_raw(kind, raw, hidden)
    paths = set()
    for T in (1, 4, 16, 64, 512):
        x = torch.randn(T, hidden, generator=gen, device=DEV, dtype=torch.float16)
        paths.add(quant_linear.quant_path(T, torch.float16, head.qweight))
        logits = model.compute_logits(x)
        torch.cuda.synchronize()
        assert logits.shape == (T, vocab) and logits.dtype == torch.float32
        assert torch.isfinite(logits).all()
        ref32 = F.linear(x.float(), w32)
        ref16 = F.linear(x, w32.half()).float()
        scale = ref32.abs().max().item()
        err = (logits - ref32).abs().max().item()
        err16 = (ref16 - ref32).abs().max().item()
        assert err <= err16 + scale * 2**-9 + 1e-3, (T, err, err16, scale)
    assert paths == {quant_linear.GEMV, quant_linear.TC, quant_linear.DEQUANT}
