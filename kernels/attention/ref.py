"""Reference paged attention (the CPU path and the definition the GPU kernels are tested against).

Inputs describe a flat batch of T query tokens from B sequences:
  q                [T, num_heads, head_dim]
  k_cache/v_cache  [num_blocks, num_kv_heads, block_size, head_dim] (see kv_cache.py)
  block_tables     [B, max_blocks] int32, the sequence's blocks in order
  seq_lens         [B] int32, KV length of each sequence after this step's tokens are written
  query_start_loc  [B + 1] int32, sequence b owns query rows [qsl[b], qsl[b+1])
Query row i of sequence b sits at position seq_len - q_len + i and attends causally to KV
positions 0..that position. Grouped-query: head h reads KV head h // (num_heads // num_kv_heads).
Softmax runs in fp32; the output is cast to q's dtype.
"""

from __future__ import annotations

import torch


def gather_kv(cache: torch.Tensor, block_table: torch.Tensor, seq_len: int) -> torch.Tensor:
    """One sequence's keys or values as [seq_len, num_kv_heads, head_dim]."""
    block_size = cache.shape[2]
    n_blocks = (seq_len + block_size - 1) // block_size
    blocks = cache[block_table[:n_blocks].long()]  # [n, kvh, bs, hd]
    return blocks.permute(0, 2, 1, 3).reshape(-1, cache.shape[1], cache.shape[3])[:seq_len]


def paged_attention_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    out = torch.empty_like(q)
    num_heads = q.shape[1]
    qsl = query_start_loc.tolist()
    for b, seq_len in enumerate(seq_lens.tolist()):
        start, end = qsl[b], qsl[b + 1]
        q_len = end - start
        if q_len == 0:
            continue
        k = gather_kv(k_cache, block_tables[b], seq_len).float()
        v = gather_kv(v_cache, block_tables[b], seq_len).float()
        group = num_heads // k.shape[1]
        k = k.repeat_interleave(group, dim=1)  # [S, H, D]
        v = v.repeat_interleave(group, dim=1)
        qb = q[start:end].float()  # [L, H, D]
        scores = torch.einsum("lhd,shd->hls", qb, k) * scale
        q_pos = torch.arange(seq_len - q_len, seq_len, device=q.device)
        k_pos = torch.arange(seq_len, device=q.device)
        mask = k_pos[None, :] > q_pos[:, None]  # [L, S]
        scores.masked_fill_(mask[None], float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        out[start:end] = torch.einsum("hls,shd->lhd", probs, v).to(q.dtype)
    return out


def paged_decode_attention_ref(
    q: torch.Tensor,  # [B, num_heads, head_dim], one query token per sequence
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    qsl = torch.arange(q.shape[0] + 1, dtype=torch.int32, device=q.device)
    return paged_attention_ref(q, k_cache, v_cache, block_tables, seq_lens, qsl, scale)
