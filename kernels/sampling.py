"""Sampling primitives: penalties, the batch-invariant seeded noise, and the sampling rule.

Randomness is a pure function of (seed, output position, token id): a counter-based hash
(murmur3's 32-bit finaliser) gives one uniform per vocabulary entry, and sampling is the
Gumbel-max rule argmax(logits / T + g) with g = -log(-log(u)) over the tokens that top-k, top-p
and min-p keep. So a seeded request samples the same tokens alone, inside any batch, and after
failover onto another executor.

All arithmetic on hash values is on uint32 values held in int64, with multiplications split in
16-bit halves so no intermediate leaves the int64 range; the numba kernel uses native uint32.
"""

from __future__ import annotations

import torch

M32 = 0xFFFFFFFF
C1, C2 = 0x85EBCA6B, 0xC2B2AE35
GOLDEN = 0x9E3779B9


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    lo = x * (c & 0xFFFF)
    hi = ((x * (c >> 16)) & 0xFFFF) << 16
    return (lo + hi) & M32


def fmix32(x: torch.Tensor) -> torch.Tensor:
    x = x ^ (x >> 16)
    x = _mul32(x, C1)
    x = x ^ (x >> 13)
    x = _mul32(x, C2)
    return x ^ (x >> 16)


def row_hash(seeds: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """[B] int64 seeds (any 64-bit value) and output positions -> [B] uint32-in-int64 row keys."""
    s = seeds.long()
    lo, hi = s & M32, (s >> 32) & M32
    h = fmix32(lo ^ GOLDEN)
    h = fmix32(h ^ hi)
    return fmix32(h ^ (positions.long() & M32))


def seeded_uniform_ref(seeds: torch.Tensor, positions: torch.Tensor, vocab: int) -> torch.Tensor:
    """[B, vocab] fp32 uniforms in (0, 1): u = ((h >> 8) + 0.5) / 2^24, h = fmix32(row ^ fmix32(v + GOLDEN))."""
    rows = row_hash(seeds.to("cpu"), positions.to("cpu"))
    cols = fmix32((torch.arange(vocab, dtype=torch.int64) + GOLDEN) & M32)
    h = fmix32(rows[:, None] ^ cols[None, :])
    u = ((h >> 8).float() + 0.5) * (1.0 / (1 << 24))
    return u.to(seeds.device)


def apply_penalties_ref(
    logits: torch.Tensor,  # [B, V] fp32, modified in place
    prompt_mask: torch.Tensor,  # [B, V] bool: token occurs in the prompt
    output_counts: torch.Tensor,  # [B, V] int32: occurrences in the output so far
    repetition: torch.Tensor,  # [B] fp32 (1 = off)
    presence: torch.Tensor,  # [B] fp32 (0 = off)
    frequency: torch.Tensor,  # [B] fp32 (0 = off)
) -> None:
    """vLLM/transformers semantics: repetition over prompt and output tokens (divide positive
    logits, multiply negative ones); presence and frequency over output tokens only."""
    seen = prompt_mask | (output_counts > 0)
    rep = repetition[:, None].expand_as(logits)
    penalised = torch.where(logits > 0, logits / rep, logits * rep)
    logits.copy_(torch.where(seen, penalised, logits))
    counts = output_counts.float()
    logits -= frequency[:, None] * counts + presence[:, None] * (counts > 0).float()


def sample_ref(
    logits: torch.Tensor,  # [B, V] fp32 after penalties, bias and masks
    temperature: torch.Tensor,  # [B] fp32; 0 means greedy
    top_k: torch.Tensor,  # [B] int32; 0 means off
    top_p: torch.Tensor,  # [B] fp32; 1 means off
    min_p: torch.Tensor,  # [B] fp32; 0 means off
    seeds: torch.Tensor,  # [B] int64
    positions: torch.Tensor,  # [B] int64, the index in the output of the token being sampled
) -> torch.Tensor:
    """[B] int64 token ids. Ties go to the lowest id (argmax semantics)."""
    B, V = logits.shape
    greedy = temperature <= 1e-5
    t = torch.where(greedy, torch.ones_like(temperature), temperature)
    scaled = logits / t[:, None]
    probs = torch.softmax(scaled, dim=-1)
    keep = torch.ones_like(probs, dtype=torch.bool)
    sorted_p, order = probs.sort(dim=-1, descending=True, stable=True)
    ranks = torch.empty_like(order)
    ranks.scatter_(1, order, torch.arange(V, device=logits.device).expand(B, V))
    k = torch.where(top_k > 0, top_k, torch.full_like(top_k, V)).clamp(max=V)
    keep &= ranks < k[:, None].long()
    # top-p: keep the smallest prefix of the sorted probs whose mass reaches top_p.
    cum_before = sorted_p.cumsum(-1) - sorted_p
    keep_sorted = cum_before < top_p[:, None]
    keep &= torch.gather(keep_sorted, 1, ranks)
    keep &= probs >= min_p[:, None] * probs.max(dim=-1, keepdim=True).values
    u = seeded_uniform_ref(seeds, positions, V).to(logits.device)
    gumbel = -torch.log(-torch.log(u))
    noisy = torch.where(keep, scaled + gumbel, torch.full_like(scaled, float("-inf")))
    sampled = noisy.argmax(dim=-1)
    return torch.where(greedy, logits.argmax(dim=-1), sampled)
