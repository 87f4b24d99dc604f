"""Tensor-core prefill attention (kernels/prefill_attention_tc.py + wmma_ptx.cu) on a real GPU.

1. The building block: one warp's 16x16 tile product through the linked PTX (A row-major, B
   row- or column-major, k = 16 and 64) against torch in fp32. fp16 products are exact in fp32
   and the sums are fp32, so the bound is 1e-4 absolute for |a|, |b| <= 1 at k <= 64.
2. The attention kernel against the fp32 reference (attention_ref.paged_attention_ref) on the
   same fp16 inputs: head dims 64 and 128, 1/4/8 query heads per KV head, prompts of 1, 15, 16,
   17, 100, 1000 and 4096 tokens in one batch, and chunked prefill (q_len < seq_len, as after a
   prefix-cache hit) mixed with whole prompts.
   Error bound, elementwise: |out - ref| <= 2e-3 + 5e-3 * |ref|, and overall
   ||out - ref|| / ||ref|| <= 2e-3. Sources: P is rounded to fp16 before P V (2^-11 relative per
   weight; the normaliser sums the same rounded weights), accumulation is fp32, and the output
   is rounded to fp16 (2^-11 relative): a correct kernel sits near 5e-4 relative, a wrong mask,
   row mapping or rescale is off by O(1).
Inputs are N(0, 1); cache slots past each context are NaN; outputs are NaN before launch.
"""

from __future__ import annotations

import pytest
import torch
from voltserve.kernels.attention_ref import paged_attention_ref

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

BLOCK = 16
ATOL, RTOL, REL_NORM = 2e-3, 5e-3, 2e-3
PROMPTS = [1, 15, 16, 17, 100, 1000, 4096]
# (seq_len, q_len): chunked prefill and prefix-cache hits (the first seq_len - q_len tokens are
# already in the cache), mixed with a whole prompt.
CHUNKED = [(100, 37), (4096, 1000), (33, 1), (2000, 17), (17, 16), (64, 64), (1500, 700)]


def _gen():
    seed = torch.seed() % 2**31
    print(f"seed {seed}")
    return torch.Generator(device="cuda").manual_seed(seed)


def make_batch(seq_lens, q_lens, num_kv_heads, group, head_dim, gen):
    n_blocks = [(s + BLOCK - 1) // BLOCK for s in seq_lens]
    total = sum(n_blocks) + 3
    shape = (total, num_kv_heads, BLOCK, head_dim)
    k = torch.randn(shape, generator=gen, device="cuda").half()
    v = torch.randn(shape, generator=gen, device="cuda").half()
    perm = torch.randperm(total, generator=gen, device="cuda").int()
    tables = torch.zeros((len(seq_lens), max(n_blocks) + 2), dtype=torch.int32, device="cuda")
    pos = 0
    for b, n in enumerate(n_blocks):
        tables[b, :n] = perm[pos : pos + n]
        pos += n
        tail = seq_lens[b] % BLOCK
        if tail:  # slots past the context hold garbage: the kernel must never use them
            k[tables[b, n - 1], :, tail:] = float("nan")
            v[tables[b, n - 1], :, tail:] = float("nan")
    qsl = [0]
    for ql in q_lens:
        qsl.append(qsl[-1] + ql)
    q = torch.randn((qsl[-1], num_kv_heads * group, head_dim), generator=gen, device="cuda").half()
    sl = torch.tensor(seq_lens, dtype=torch.int32, device="cuda")
    qsl_t = torch.tensor(qsl, dtype=torch.int32, device="cuda")
    return q, k, v, tables, sl, qsl_t


def check(out, ref, seq_lens, qsl, label):
    """Asserts the bound; on failure reports, per sequence, the worst element and NaN count."""
    out, ref = out.float(), ref.float()
    err = (out - ref).abs()
    bad = (err > ATOL + RTOL * ref.abs()) | out.isnan()
    rel = ((out - ref).norm() / ref.norm()).item()
    if bad.any() or rel > REL_NORM:
        lines = [f"{label}: rel_norm={rel:.2e} bad={int(bad.sum())}/{bad.numel()}"]
        for b, s in enumerate(seq_lens):
            lo, hi = qsl[b], qsl[b + 1]
            e = err[lo:hi].nan_to_num(float("inf"))
            idx = int(e.argmax())
            t, h, d = (
                idx // (e.shape[1] * e.shape[2]),
                (idx // e.shape[2]) % e.shape[1],
                idx % e.shape[2],
            )
            lines.append(
                f"  seq {b}: seq_len={s} q_len={hi - lo} max_err={e.max().item():.3e} at "
                f"(token {t}, head {h}, dim {d}) out={out[lo + t, h, d].item():.4f} "
                f"ref={ref[lo + t, h, d].item():.4f} nan={int(out[lo:hi].isnan().sum())} "
                f"bad={int(bad[lo:hi].sum())}"
            )
        pytest.fail("\n".join(lines))
    print(f"{label}: rel_norm={rel:.2e} max_abs={err.max().item():.2e}")


@pytest.mark.parametrize("k", [16, 64])
@pytest.mark.parametrize("b_col", [0, 1])
def test_wmma_tile(k, b_col):
    from voltserve.kernels.numba_common import current_stream, dev
    from voltserve.kernels.prefill_attention_tc import wmma_gemm16_kernel

    gen = _gen()
    a = (torch.rand((16, k), generator=gen, device="cuda") * 2 - 1).half()
    b = (torch.rand((k, 16), generator=gen, device="cuda") * 2 - 1).half()
    b_in = b.t().contiguous() if b_col else b  # column-major b == row-major b^T
    d = torch.full((16, 16), float("nan"), device="cuda")
    wmma_gemm16_kernel[1, 32, current_stream()](
        dev(d.view(-1)), dev(a.view(-1)), dev(b_in.view(-1)), k, b_col
    )
    torch.cuda.synchronize()
    ref = a.float() @ b.float()
    err = (d - ref).abs().max().item()
    assert not d.isnan().any(), f"NaN in tile result:\n{d}"
    assert err <= 1e-4, f"k={k} b_col={b_col}: max error {err:.3e}\nout:\n{d}\nref:\n{ref}"


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("group", [1, 4, 8])
def test_prefill_tc_whole_prompts(head_dim, group):
    from voltserve.kernels.prefill_attention_tc import paged_attention_tc_cuda

    gen = _gen()
    q, k, v, tables, sl, qsl = make_batch(PROMPTS, PROMPTS, 2, group, head_dim, gen)
    scale = head_dim**-0.5
    ref = paged_attention_ref(q.float(), k.float(), v.float(), tables, sl, qsl, scale)
    for max_q in (None, max(PROMPTS)):
        out = torch.full_like(q, float("nan"))
        paged_attention_tc_cuda(q, k, v, tables, sl, qsl, scale, out, max_query_len=max_q)
        torch.cuda.synchronize()
        check(out, ref, PROMPTS, qsl.tolist(), f"d={head_dim} g={group} max_q={max_q}")


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("group", [1, 4, 8])
def test_prefill_tc_chunked(head_dim, group):
    from voltserve.kernels.prefill_attention_tc import paged_attention_tc_cuda

    gen = _gen()
    seq_lens = [s for s, _ in CHUNKED]
    q_lens = [ql for _, ql in CHUNKED]
    q, k, v, tables, sl, qsl = make_batch(seq_lens, q_lens, 2, group, head_dim, gen)
    scale = head_dim**-0.5
    ref = paged_attention_ref(q.float(), k.float(), v.float(), tables, sl, qsl, scale)
    out = torch.full_like(q, float("nan"))
    paged_attention_tc_cuda(q, k, v, tables, sl, qsl, scale, out, max_query_len=max(q_lens))
    torch.cuda.synchronize()
    check(out, ref, seq_lens, qsl.tolist(), f"chunked d={head_dim} g={group}")


def test_prefill_tc_llama8b_shape_and_odd_group():
    """32 heads / 8 KV heads at 1000 tokens, and a group of 7 (rows not a multiple of 16)."""
    from voltserve.kernels.prefill_attention_tc import paged_attention_tc_cuda

    gen = _gen()
    for kvh, group, d, lens in ((8, 4, 128, [1000, 3]), (2, 7, 64, [300, 45])):
        q, k, v, tables, sl, qsl = make_batch(lens, lens, kvh, group, d, gen)
        ref = paged_attention_ref(q.float(), k.float(), v.float(), tables, sl, qsl, d**-0.5)
        out = torch.full_like(q, float("nan"))
        paged_attention_tc_cuda(q, k, v, tables, sl, qsl, d**-0.5, out)
        torch.cuda.synchronize()
        check(out, ref, lens, qsl.tolist(), f"kvh={kvh} g={group} d={d}")


def test_prefill_tc_rejects_unsupported_head_dim():
    from voltserve.kernels.prefill_attention_tc import paged_attention_tc_cuda

    q = torch.zeros((4, 2, 96), dtype=torch.float16, device="cuda")
    cache = torch.zeros((2, 2, 16, 96), dtype=torch.float16, device="cuda")
    one = torch.ones(1, dtype=torch.int32, device="cuda")
    with pytest.raises(ValueError, match="head_dim"):
        paged_attention_tc_cuda(
            q, cache, cache, one.view(1, 1), one * 4, torch.tensor([0, 4]).int().cuda(), 0.1
        )
