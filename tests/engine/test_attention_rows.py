"""Short queries attended as decode rows (models/layers.ROW_DECODE_MAX_QUERY, on CUDA): a step whose
every sequence has a few query rows over a paged context (speculative verify groups, a
proposer's catch-up, short prompts), each row through the decode op with its own block-table
row and length, equals causal attention over each sequence's dense K and V, computed here in
float64 from the tensors the test scattered into the pages; so does paged_attend's own path."""

from __future__ import annotations

import random

import torch
from voltserve.kernels.dispatch import KernelDispatch
from voltserve.services.executor.input_batch import attention_metadata
from voltserve.services.executor.models.layers import ROW_DECODE_MAX_QUERY, paged_attend

CPU = torch.device("cpu")
BS, H, KVH, D = 16, 4, 2, 8


def _case(seed: int, query_lens: list[int], contexts: list[int]):
    gen = torch.Generator().manual_seed(seed)
    widths = [-(-L // BS) for L in contexts]
    num_blocks = sum(widths) + 3
    order = torch.randperm(num_blocks, generator=gen).tolist()  # pages out of order
    k_cache = torch.full((num_blocks, KVH, BS, D), float("nan"))
    v_cache = torch.full_like(k_cache, float("nan"))
    tables = torch.zeros(len(contexts), max(widths), dtype=torch.int32)
    dense, slots = [], []
    for b, L in enumerate(contexts):
        blocks = [order.pop() for _ in range(widths[b])]
        tables[b, : len(blocks)] = torch.tensor(blocks)
        k, v = torch.randn(2, L, KVH, D, generator=gen)
        for p in range(L):
            k_cache[blocks[p // BS], :, p % BS] = k[p]
            v_cache[blocks[p // BS], :, p % BS] = v[p]
        dense.append((k, v))
        slots += [blocks[p // BS] * BS + p % BS for p in range(L - query_lens[b], L)]
    q = torch.randn(sum(query_lens), H, D, generator=gen)
    qsl = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32)
    return q, k_cache, v_cache, tables, torch.tensor(contexts), qsl, dense, torch.tensor(slots)


def _reference(q, dense, query_lens, scale) -> torch.Tensor:
    out, row = [], 0
    for (k, v), n in zip(dense, query_lens):
        L = k.shape[0]
        kk = k.double().repeat_interleave(H // KVH, 1)  # [L, H, D]
        vv = v.double().repeat_interleave(H // KVH, 1)
        for j in range(n):
            p = L - n + j
            s = torch.einsum("hd,lhd->hl", q[row + j].double(), kk[: p + 1]) * scale
            out.append(torch.einsum("hl,lhd->hd", s.softmax(-1), vv[: p + 1]))
        row += n
    return torch.stack(out)


def test_short_queries_as_decode_rows_equal_causal_attention():
    seed = random.randrange(2**31)
    print(f"seed {seed}")
    rng = random.Random(seed)
    # one row, a verify group, a group ending mid-block, the longest that takes the decode rows
    query_lens = [1, 4, rng.randint(2, 9), ROW_DECODE_MAX_QUERY]
    contexts = [rng.randint(n, 90) for n in query_lens]
    q, k_cache, v_cache, tables, seq_lens, qsl, dense, slots = _case(seed, query_lens, contexts)
    ops = KernelDispatch(CPU)
    scale = D**-0.5
    want = _reference(q, dense, query_lens, scale)
    for longest in (max(query_lens), ROW_DECODE_MAX_QUERY + 1):  # decode rows, then prefill
        meta = attention_metadata(slots, tables, seq_lens, qsl, False, longest)
        rows = meta.decode_rows()
        assert (rows is not None) == (longest <= ROW_DECODE_MAX_QUERY)
        if rows is not None:
            positions = [L - n + j for L, n in zip(contexts, query_lens) for j in range(n)]
            assert rows.seq_lens.tolist() == [p + 1 for p in positions]
            assert rows.is_decode and rows.block_tables.shape == (len(positions), tables.shape[1])
            # the rows through the decode op, as paged_attend runs them on CUDA
            got = ops.paged_decode_attention(
                q, k_cache, v_cache, rows.block_tables, rows.seq_lens, scale
            )
            torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)
        got = paged_attend(ops, q, k_cache, v_cache, meta, scale)
        torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)
