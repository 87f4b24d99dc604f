"""The flash prefill (kernels/attention/prefill_fa.py + attention/prefill_fa.cu, the engine's
prefill attention for head dims 64, 128 and 256) on a real GPU, against the fp32 reference
(attention_ref.paged_attention_ref) on the same fp16 inputs.

Error bound, elementwise: |out - ref| <= 2e-3 + 5e-3 |ref|, and overall ||out - ref|| / ||ref||
<= 2e-3. Sources: P is rounded to fp16 before P V (2^-11 relative per weight; the normaliser
sums the same rounded weights), accumulation is fp32, and the output is rounded to fp16 (2^-11
relative): a correct kernel sits near 5e-4 relative; a wrong mask, row map or rescale is off by
O(1). Inputs are N(0, 1); cache slots past each context hold NaN and outputs are NaN before the
launch, so a stale read or an unwritten element fails.

Cases: head dims 64, 128 and 256 (two warps a row tile, each half the head dim, 16-key tiles);
1, 4, 6 (Qwen3.5-27B: 24 query heads over 4 KV heads; 60 of 64 rows in use), 7 (rows not a
multiple of 16), 8 (Qwen3-Next: 16 over 2) and 64 query heads per KV head; prompts around every
tile edge (1, 15-17, 31-33, 63-65, 100, 1000, 4096) in one launch; chunked prefill (q_len <
seq_len, as after a prefix-cache hit) mixed with whole prompts; a serving step's 8 x 1024 at
the Llama-3-8B and Qwen3.5-27B head shapes; single prompts of 16K (+ an odd tail) and 32K
against torch's SDPA in fp32 (the reference's [H, L, S] score matrix would not fit), with few
heads to keep the reference cheap; lazy rescaling forced through rows whose scores grow along
the keys; the engine's entry (dispatch: paged_attention_cuda), flash where it covers the shape
and the CUDA-core kernel for other head dims.
"""

from __future__ import annotations

import pytest
import torch
from voltserve.kernels.attention.ref import paged_attention_ref

from tests.gpu.test_attention_gpu import make_cache

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

BLOCK = 16
ATOL, RTOL, REL_NORM = 2e-3, 5e-3, 2e-3
# (seq_len, q_len): chunked prefill and prefix-cache hits (the first seq_len - q_len tokens are
# already in the cache), mixed with a whole prompt.
CHUNKED = [(100, 37), (4096, 1000), (33, 1), (2000, 17), (17, 16), (64, 64), (1500, 700)]


def make_batch(seq_lens, q_lens, num_kv_heads, group, head_dim, gen):
    # The paged cache as the decode tests build it (slots past each context hold NaN: the
    # kernel must never use them); tables two blocks wider than the longest context.
    width = max((s + BLOCK - 1) // BLOCK for s in seq_lens) + 2
    k, v, tables = make_cache(seq_lens, num_kv_heads, head_dim, gen, width)
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


EDGES = [1, 15, 16, 17, 31, 32, 33, 63, 64, 65, 100, 1000, 4096]


def _gen():
    seed = torch.seed() % 2**31
    print(f"seed {seed}")
    return torch.Generator(device="cuda").manual_seed(seed)


def run_fa(q, k, v, tables, sl, qsl, scale, max_q=None):
    from voltserve.kernels.attention.prefill_fa import paged_attention_fa_cuda

    out = torch.full_like(q, float("nan"))  # poisoned: every element must be written
    res = paged_attention_fa_cuda(q, k, v, tables, sl, qsl, scale, out, max_query_len=max_q)
    torch.cuda.synchronize()
    assert res is out
    return out


@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("group", [1, 4, 6, 7, 8])
def test_fa_whole_prompts(head_dim, group):
    gen = _gen()
    q, k, v, tables, sl, qsl = make_batch(EDGES, EDGES, 2, group, head_dim, gen)
    scale = head_dim**-0.5
    ref = paged_attention_ref(q.float(), k.float(), v.float(), tables, sl, qsl, scale)
    for max_q in (None, max(EDGES)):
        out = run_fa(q, k, v, tables, sl, qsl, scale, max_q)
        check(out, ref, EDGES, qsl.tolist(), f"fa d={head_dim} g={group} max_q={max_q}")


@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("group", [1, 4, 6, 8])
def test_fa_chunked(head_dim, group):
    gen = _gen()
    seq_lens = [s for s, _ in CHUNKED] + [4097, 65]
    q_lens = [ql for _, ql in CHUNKED] + [4097, 3]
    q, k, v, tables, sl, qsl = make_batch(seq_lens, q_lens, 2, group, head_dim, gen)
    scale = head_dim**-0.5
    ref = paged_attention_ref(q.float(), k.float(), v.float(), tables, sl, qsl, scale)
    out = run_fa(q, k, v, tables, sl, qsl, scale, max(q_lens))
    check(out, ref, seq_lens, qsl.tolist(), f"fa chunked d={head_dim} g={group}")


@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_fa_large_group(head_dim):
    """64 query heads per KV head: one token a block, every row of the block one head."""
    gen = _gen()
    lens = [1, 33, 300]
    q, k, v, tables, sl, qsl = make_batch(lens, lens, 1, 64, head_dim, gen)
    ref = paged_attention_ref(q.float(), k.float(), v.float(), tables, sl, qsl, head_dim**-0.5)
    out = run_fa(q, k, v, tables, sl, qsl, head_dim**-0.5)
    check(out, ref, lens, qsl.tolist(), f"fa g=64 d={head_dim}")


@pytest.mark.parametrize(
    "heads,kv_heads,head_dim,model",
    [(32, 8, 128, "llama-3-8b"), (24, 4, 256, "qwen3.5-27b")],
)
def test_fa_serving_step(heads, kv_heads, head_dim, model):
    """A serving prefill step: 8 x 1024 tokens at a model's attention heads."""
    gen = _gen()
    lens = [1024] * 8
    q, k, v, tables, sl, qsl = make_batch(lens, lens, kv_heads, heads // kv_heads, head_dim, gen)
    scale = head_dim**-0.5
    ref = paged_attention_ref(q.float(), k.float(), v.float(), tables, sl, qsl, scale)
    out = run_fa(q, k, v, tables, sl, qsl, scale, 1024)
    check(out, ref, lens, qsl.tolist(), f"fa 8x1024 {model} heads")


@pytest.mark.parametrize("d,group", [(128, 4), (256, 6)])
def test_fa_lazy_rescale_growing_scores(d, group):
    """Scores that grow along the keys (q and k aligned, k scaled up with position), so a row's
    max moves past the lazy threshold many times, mixed with a large attention sink at key 0
    for another sequence: the rescale path and the stale-max path both run (at head dim 256
    the rescale's second row-tile barrier)."""
    gen = _gen()
    kvh = 2
    lens = [3000, 700]
    q, k, v, tables, sl, qsl = make_batch(lens, lens, kvh, group, d, gen)
    direction = torch.randn(d, generator=gen, device="cuda")
    direction /= direction.norm()
    q[:] = (q.float() * 0.2 + 3.0 * direction).half()
    # Sequence 0: the key at position p gets p / 20 along the direction, so scores grow by
    # ~57 log2 units over the prompt at head dim 128, ~40 at 256 (several lazy rescales);
    # sequence 1: key 0 is a sink (~23 / ~16 log2 units above the rest for every query: the
    # reference max stays put).
    for b, n in enumerate(lens):
        for p in range(n if b == 0 else 1):
            blk, slot = int(tables[b, p // 16]), p % 16
            boost = p / 20.0 if b == 0 else 60.0
            k[blk, :, slot] = (k[blk, :, slot].float() * 0.2 + boost * direction).half()
    scale = d**-0.5
    ref = paged_attention_ref(q.float(), k.float(), v.float(), tables, sl, qsl, scale)
    out = run_fa(q, k, v, tables, sl, qsl, scale)
    check(out, ref, lens, qsl.tolist(), f"fa growing scores / sink d={d} g={group}")


@pytest.mark.parametrize(
    "prompt,head_dim,group",
    [
        (16384 + 37, 128, 4),
        (32768, 128, 4),
        (16384, 64, 8),
        (16384 + 37, 256, 6),  # Qwen3.5-27B's group
        (16384, 256, 8),  # Qwen3-Next's
    ],
)
def test_fa_long_prompt_vs_sdpa(prompt, head_dim, group):
    """One long prompt against SDPA in fp32 on the gathered K/V (causal from the top left,
    which is this layout's meaning when q_len == seq_len)."""
    from voltserve.kernels.attention.ref import gather_kv

    gen = _gen()
    kvh = 1
    q, k, v, tables, sl, qsl = make_batch([prompt], [prompt], kvh, group, head_dim, gen)
    scale = head_dim**-0.5
    out = run_fa(q, k, v, tables, sl, qsl, scale)
    kk = gather_kv(k, tables[0], prompt).float().repeat_interleave(group, dim=1)
    vv = gather_kv(v, tables[0], prompt).float().repeat_interleave(group, dim=1)
    ref = torch.nn.functional.scaled_dot_product_attention(
        q.float().transpose(0, 1)[None],
        kk.transpose(0, 1)[None],
        vv.transpose(0, 1)[None],
        is_causal=True,
        scale=scale,
    )[0].transpose(0, 1)
    check(out, ref, [prompt], qsl.tolist(), f"fa P={prompt} d={head_dim} g={group}")


@pytest.mark.parametrize("head_dim,group", [(128, 4), (64, 7), (96, 4), (256, 2), (256, 6)])
def test_engine_entry_flash_or_cuda_core(monkeypatch, head_dim, group):
    """What the engine runs (KernelDispatch's paged_attention on CUDA, fp16): the flash kernel
    for head dims 64, 128 and 256, the CUDA-core kernel for 96; both match the reference."""
    from voltserve.kernels.attention import prefill_fa as fa
    from voltserve.kernels.dispatch import KernelDispatch

    ops = KernelDispatch("cuda", torch.float16, force_ref=False)
    assert ops.impl["paged_attention"] == "cuda"
    assert ops.paged_attention is fa.paged_attention_cuda
    calls = []
    flash = fa.paged_attention_fa_cuda
    monkeypatch.setattr(
        fa, "paged_attention_fa_cuda", lambda *a, **kw: calls.append(1) or flash(*a, **kw)
    )
    gen = _gen()
    lens = [300, 17, 1]
    q, k, v, tables, sl, qsl = make_batch(lens, lens, 2, group, head_dim, gen)
    scale = head_dim**-0.5
    ref = paged_attention_ref(q.float(), k.float(), v.float(), tables, sl, qsl, scale)
    out = torch.full_like(q, float("nan"))
    res = ops.paged_attention(q, k, v, tables, sl, qsl, scale, out, max_query_len=max(lens))
    torch.cuda.synchronize()
    assert res is out
    assert len(calls) == (1 if head_dim in fa.HEAD_DIMS else 0)
    check(out, ref, lens, qsl.tolist(), f"engine entry d={head_dim} g={group}")


def test_fa_rejects_unsupported_shapes():
    from voltserve.kernels.attention.prefill_fa import paged_attention_fa_cuda

    q = torch.zeros((4, 2, 96), dtype=torch.float16, device="cuda")
    cache = torch.zeros((2, 2, 16, 96), dtype=torch.float16, device="cuda")
    one = torch.ones(1, dtype=torch.int32, device="cuda")
    qsl = torch.tensor([0, 4]).int().cuda()
    with pytest.raises(ValueError, match="head_dim"):
        paged_attention_fa_cuda(q, cache, cache, one.view(1, 1), one * 4, qsl, 0.1)
    q = torch.zeros((4, 130, 64), dtype=torch.float16, device="cuda")
    cache = torch.zeros((2, 2, 16, 64), dtype=torch.float16, device="cuda")
    with pytest.raises(ValueError, match="group"):
        paged_attention_fa_cuda(q, cache, cache, one.view(1, 1), one * 4, qsl, 0.1)
