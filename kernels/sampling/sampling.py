"""Sampling primitives: penalties, the batch-invariant seeded noise, and the sampling rule.

Randomness is a pure function of (seed, output position, token id): a counter-based hash
(murmur3's 32-bit finaliser) gives one uniform per vocabulary entry, and sampling is the
Gumbel-max rule argmax(logits / T + g) with g = -log(-log(u)) over the tokens the truncation
filters keep. So a seeded request samples the same tokens alone, inside any batch, and after
failover onto another executor.

The filters apply in vLLM's order, each to what the previous one kept (transformers' logits
processors chain the same way): on the temperature-scaled distribution, min-p keeps tokens whose
probability is at least min_p times the largest; top-k keeps the k most probable of those; top-p
keeps the smallest prefix of those (most probable first) whose mass reaches top_p of their
renormalised mass, i.e. a token stays while the kept mass ranked before it is < top_p * kept
mass. Ranking is by probability, ties to the lowest id (a stable sort).

All arithmetic on hash values is on uint32 values held in int64, with multiplications split in
16-bit halves so no intermediate leaves the int64 range; the numba kernel uses native uint32.
"""

from __future__ import annotations

import torch

M32 = 0xFFFFFFFF
C1, C2 = 0x85EBCA6B, 0xC2B2AE35
GOLDEN = 0x9E3779B9
# The largest fp32 below 1.0: the top uniform (see seeded_uniform_ref).
U_MAX = 1.0 - 2.0**-24


def chunked_argmax(x: torch.Tensor) -> torch.Tensor:
    """x.argmax(dim=-1) for a 2-D x, in two parallel passes where the row splits evenly: the max
    of each chunk of a row, then the first chunk holding the row's max. torch's one-pass argmax
    of a single 128K-wide row runs as one block (~26 us on an H200, in every decode step);
    the two passes take a few us. Ties resolve to the lowest index, as argmax does (each pass
    takes the first of equal values). Never syncs (a CUDA graph captures it)."""
    B, V = x.shape
    chunk = next((c for c in (1024, 512, 256, 128, 64) if V % c == 0 and V // c >= 8), 0)
    if not chunk:
        return x.argmax(dim=-1)
    vals, idx = x.view(B, V // chunk, chunk).max(dim=-1)
    best = vals.argmax(dim=-1, keepdim=True)
    return best.squeeze(-1) * chunk + idx.gather(-1, best).squeeze(-1)


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
    """[B, vocab] fp32 uniforms in (0, 1): u = ((h >> 8) + 0.5) / 2^24, h = fmix32(row ^ fmix32(v + GOLDEN)),
    with the top code clamped to U_MAX. (h >> 8) + 0.5 needs 25 bits at h >> 8 = 2^24 - 1, so in
    fp32 it rounds to 2^24 and u to 1.0, whose Gumbel noise -log(-log(u)) is +inf: that token
    would win over every finite one, and a masked (-inf) token would become NaN and win argmax
    (one draw in 2^24 per vocabulary entry: seen as a grammar-masked token sampled)."""
    rows = row_hash(seeds.to("cpu"), positions.to("cpu"))
    cols = fmix32((torch.arange(vocab, dtype=torch.int64) + GOLDEN) & M32)
    h = fmix32(rows[:, None] ^ cols[None, :])
    u = ((h >> 8).float() + 0.5) * (1.0 / (1 << 24))
    return u.clamp(max=U_MAX).to(seeds.device)


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


def sample_keep_ref(
    scaled: torch.Tensor,  # [B, V] fp32 logits / temperature
    top_k: torch.Tensor,  # [B] int32; 0 means off
    top_p: torch.Tensor,  # [B] fp32; 1 means off
    min_p: torch.Tensor,  # [B] fp32; 0 means off
) -> torch.Tensor:
    """[B, V] bool: the tokens a sampled row may draw (min-p, then top-k, then top-p)."""
    B, V = scaled.shape
    probs = torch.softmax(scaled, dim=-1)
    sorted_p, order = probs.sort(dim=-1, descending=True, stable=True)
    # min-p, relative to the most probable token.
    kept = sorted_p >= min_p[:, None] * sorted_p[:, :1]
    # top-k over the min-p survivors: a survivor's rank among the survivors.
    k = torch.where(top_k > 0, top_k, torch.full_like(top_k, V)).clamp(max=V)
    kept &= kept.long().cumsum(-1) <= k[:, None].long()
    # top-p over the survivors' renormalised mass: keep a survivor while the surviving mass
    # ranked before it is below top_p of the surviving mass (so the first always stays).
    q = torch.where(kept, sorted_p, torch.zeros_like(sorted_p))
    cum_before = q.cumsum(-1) - q
    in_p = cum_before < top_p[:, None] * q.sum(-1, keepdim=True)
    kept &= in_p | (top_p >= 1.0)[:, None]  # top_p = 1 is off (no rounding at the tail)
    keep = torch.empty_like(kept)
    keep.scatter_(1, order, kept)
    return keep


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
    keep = sample_keep_ref(scaled, top_k, top_p, min_p)
    u = seeded_uniform_ref(seeds, positions, V).to(logits.device)
    gumbel = -torch.log(-torch.log(u))
    noisy = torch.where(keep, scaled + gumbel, torch.full_like(scaled, float("-inf")))
    sampled = noisy.argmax(dim=-1)
    return torch.where(greedy, logits.argmax(dim=-1), sampled)


# ---------------------------------------------------------------------------------------------
# numba.cuda kernels: one block per row, a fixed block size, and reductions in a fixed order, so a
# row's result depends on that row alone (batch-invariant) and repeats run for run.
#
# The filters keep prefixes of the tokens ranked as the reference ranks them (value descending,
# then id ascending): min-p keeps every token at or above a probability, top-k the first k, top-p
# the first tokens whose kept mass before them is < top_p * kept mass. So the kept set is
# "min-p holds, and key > tau, or key == tau and id < cut", where key is an order-preserving
# integer image of the scaled logit. min-p is a per-token test (it depends on the value alone).
# Since min-p's survivors are a prefix, top-k over them is the global top-k intersected with
# them: tau_k is found without sorting by bisection over the 2^32 keys (32 block-wide counting
# passes), and cut, only when the boundary value is shared by more tokens than the prefix has
# room for, by bisection over ids. top-p then measures mass over the min-p and top-k survivors
# only: one pass sums their mass K, and a bisection over keys (32 mass passes) finds the smallest
# key whose surviving mass strictly above is < top_p * K, with a tie cut as for top-k. That
# prefix lies inside top-k's, so the shorter of the two is the kept prefix. The sample is the
# argmax of scaled + Gumbel noise over the kept tokens, with the reference's hash, so ids equal
# the reference's.
#
# Where the kernel can differ from the reference (documented tie cases, all measure-zero for
# continuous logits but possible): (1) top-p's boundary when the kept mass before a token is
# within float rounding of top_p * kept mass (different summation order); (2) min-p's boundary
# when a probability is within rounding of min_p * max_prob; (3) tokens whose probabilities round
# to the same fp32 value while their scaled logits differ (the reference ranks equal
# probabilities by id, the kernel ranks by logit); (4) two kept tokens whose noisy scores are
# within an ulp (exp and log differ by an ulp between libdevice and torch's CPU math). Greedy
# rows are an exact argmax with ties to the lowest id.

import math  # noqa: E402

import numpy as np  # noqa: E402
from numba import cuda, uint64  # noqa: E402
from voltserve.kernels.runtime.compile_cache import cached  # noqa: E402
from voltserve.kernels.runtime.numba_common import (  # noqa: E402
    NEG_INF,
    block_argmax,
    block_max,
    block_sum,
    current_stream,
    float32,
    float_key,
    int32,
    int64,
    launch,
)

SAMPLE_BLOCK = 1024  # fixed: reduction order (and so batch invariance) depends on it
_M32 = np.uint64(M32)
_C1 = np.uint64(C1)
_C2 = np.uint64(C2)
_GOLD = np.uint64(GOLDEN)
_S8 = np.uint64(8)
_U_MAX = np.float32(U_MAX)
_S13 = np.uint64(13)
_S16 = np.uint64(16)
_KEY_END = 4294967296  # one past the largest key


@cuda.jit(device=True)
def _fmix32(x):
    x = x ^ (x >> _S16)
    x = (x * _C1) & _M32
    x = x ^ (x >> _S13)
    x = (x * _C2) & _M32
    return x ^ (x >> _S16)


@cuda.jit(device=True)
def _row_hash(seed, position):
    lo = uint64(seed & 0xFFFFFFFF)
    hi = uint64((seed >> 32) & 0xFFFFFFFF)
    h = _fmix32(lo ^ _GOLD)
    h = _fmix32(h ^ hi)
    return _fmix32(h ^ uint64(position & 0xFFFFFFFF))


@cuda.jit(device=True)
def _gumbel(row, i):
    h = _fmix32(row ^ _fmix32((uint64(i) + _GOLD) & _M32))
    u = min((float32(h >> _S8) + float32(0.5)) * float32(1.0 / 16777216.0), _U_MAX)
    return float32(-float32(math.log(float32(-float32(math.log(u))))))


@cuda.jit(device=True)
def _kept_prob(s, i, tau, cut, mx, z, mp, thresh):
    """Token i's probability if it survives min-p and top-k (key > tau, or == tau and i < cut),
    else 0."""
    key = float_key(s)
    if key > tau or (key == tau and i < cut):
        e = float32(math.exp(s - mx)) / z
        if mp <= float32(0.0) or e >= thresh:
            return e
    return float32(0.0)


@cuda.jit(device=True)
def _tie_cut(logits, b, t, tau, need, si):
    """Smallest c such that `need` tokens with key == tau have id < c."""
    tid, bd = cuda.threadIdx.x, cuda.blockDim.x
    lo = 0
    hi = logits.shape[1]
    while hi - lo > 1:
        mid = (lo + hi) >> 1
        c = 0
        i = tid
        while i < mid:
            if float_key(float32(logits[b, i] / t)) == tau:
                c += 1
            i += bd
        if block_sum(c, si) >= need:
            hi = mid
        else:
            lo = mid
    return hi


@cached
@cuda.jit
def sample_kernel(logits, temperature, top_k, top_p, min_p, seeds, positions, out):
    b = cuda.blockIdx.x
    tid, bd = cuda.threadIdx.x, cuda.blockDim.x
    V = logits.shape[1]
    sf = cuda.shared.array(32, float32)
    si = cuda.shared.array(32, int32)
    t = temperature[b]
    greedy = t <= float32(1e-5)
    if greedy:
        t = float32(1.0)

    # Pass 1: max (and, for greedy rows, the answer).
    best_v = NEG_INF
    best_i = V
    i = tid
    while i < V:
        s = float32(logits[b, i] / t)
        if s > best_v or (s == best_v and i < best_i):
            best_v, best_i = s, i
        i += bd
    if greedy:
        best_v, best_i = block_argmax(best_v, best_i, sf, si)
        if tid == 0:
            out[b] = best_i
        return
    mx = block_max(best_v, sf)

    # Pass 2: softmax normaliser.
    z = float32(0.0)
    i = tid
    while i < V:
        z += float32(math.exp(float32(logits[b, i] / t) - mx))
        i += bd
    z = block_sum(z, sf)

    # top-k: tau_k = the k-th largest key; keep ties by id up to k tokens in all.
    tau = int64(-1)
    cut = V
    k = top_k[b]
    if k > 0 and k < V:
        lo = int64(0)
        hi = int64(_KEY_END)
        c_lo = V
        c_hi = 0
        while hi - lo > 1:
            mid = (lo + hi) >> 1
            c = 0
            i = tid
            while i < V:
                if float_key(float32(logits[b, i] / t)) >= mid:
                    c += 1
                i += bd
            c = block_sum(c, si)
            if c >= k:
                lo, c_lo = mid, c
            else:
                hi, c_hi = mid, c
        tau = lo
        need = k - c_hi
        if need < c_lo - c_hi:
            cut = _tie_cut(logits, b, t, tau, need, si)

    # min-p: probability >= min_p * max probability (= 1 / z); a per-token test.
    mp = min_p[b]
    thresh = mp * (float32(1.0) / z)

    # top-p over the min-p and top-k survivors: target = top_p * their mass; tau_p = the
    # smallest key whose surviving mass strictly above is < target.
    p = top_p[b]
    if p < float32(1.0):
        kept = float32(0.0)
        i = tid
        while i < V:
            kept += _kept_prob(float32(logits[b, i] / t), i, tau, cut, mx, z, mp, thresh)
            i += bd
        target = p * block_sum(kept, sf)
        lo = int64(-1)
        hi = int64(_KEY_END)
        g_hi = float32(0.0)
        while hi - lo > 1:
            mid = (lo + hi) >> 1
            g = float32(0.0)
            i = tid
            while i < V:
                s = float32(logits[b, i] / t)
                if float_key(s) > mid:
                    g += _kept_prob(s, i, tau, cut, mx, z, mp, thresh)
                i += bd
            g = block_sum(g, sf)
            if g < target:
                hi, g_hi = mid, g
            else:
                lo = mid
        # Surviving tokens at the boundary key: keep those whose kept mass before them is
        # < target. They share one probability; the boundary is never above top-k's, so when
        # it is top-k's the survivors there are its lowest ids and the cut below stays < cut.
        n_tie = 0
        p_tie = float32(0.0)
        i = tid
        while i < V:
            s = float32(logits[b, i] / t)
            if float_key(s) == hi:
                e = _kept_prob(s, i, tau, cut, mx, z, mp, thresh)
                if e > float32(0.0):
                    n_tie += 1
                    p_tie = e
            i += bd
        n_tie = block_sum(n_tie, si)
        p_tie = block_max(p_tie, sf)
        tau_p = hi
        cut_p = V
        if n_tie > 1:
            need = int64(math.ceil((target - g_hi) / p_tie))
            if need < 1:
                need = 1
            if need < n_tie:
                cut_p = _tie_cut(logits, b, t, tau_p, need, si)
        if tau_p > tau or (tau_p == tau and cut_p < cut):
            tau, cut = tau_p, cut_p

    # Final pass: Gumbel-max over the kept tokens.
    row = _row_hash(seeds[b], positions[b])
    best_v = NEG_INF
    best_i = V
    i = tid
    while i < V:
        s = float32(logits[b, i] / t)
        key = float_key(s)
        if key > tau or (key == tau and i < cut):
            if mp <= float32(0.0) or float32(math.exp(s - mx)) / z >= thresh:
                v = s + _gumbel(row, i)
                if v > best_v or (v == best_v and i < best_i):
                    best_v, best_i = v, i
        i += bd
    best_v, best_i = block_argmax(best_v, best_i, sf, si)
    if tid == 0:
        out[b] = best_i if best_i < V else 0


@cached
@cuda.jit
def argmax_kernel(logits, out):
    b = cuda.blockIdx.x
    tid, bd = cuda.threadIdx.x, cuda.blockDim.x
    V = logits.shape[1]
    sf = cuda.shared.array(32, float32)
    si = cuda.shared.array(32, int32)
    best_v = NEG_INF
    best_i = V
    i = tid
    while i < V:
        v = float32(logits[b, i])
        if v > best_v or (v == best_v and i < best_i):
            best_v, best_i = v, i
        i += bd
    best_v, best_i = block_argmax(best_v, best_i, sf, si)
    if tid == 0:
        out[b] = best_i if best_i < V else 0


@cached
@cuda.jit
def apply_penalties_kernel(logits, prompt_mask, output_counts, repetition, presence, frequency):
    b = cuda.blockIdx.x
    i = cuda.blockIdx.y * cuda.blockDim.x + cuda.threadIdx.x
    if i >= logits.shape[1]:
        return
    v = logits[b, i]
    c = output_counts[b, i]
    if prompt_mask[b, i] or c > 0:
        rep = repetition[b]
        if v > float32(0.0):
            v = v / rep
        else:
            v = v * rep
    seen = float32(1.0) if c > 0 else float32(0.0)
    logits[b, i] = v - (frequency[b] * float32(c) + presence[b] * seen)


PENALTY_BLOCK = 256


def sample_cuda(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    min_p: torch.Tensor,
    seeds: torch.Tensor,
    positions: torch.Tensor,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Same meaning and signature as sample_ref (plus an optional preallocated int64 out [B]).
    Expects logits fp32 [B, V] (unit stride along V), temperature/top_p/min_p fp32, top_k int32,
    seeds/positions int64; no host sync, so it can be captured in a CUDA graph."""
    B = logits.shape[0]
    if out is None:
        out = torch.empty(B, dtype=torch.int64, device=logits.device)
    if B:
        args = (
            logits,
            temperature,
            top_k,
            top_p,
            min_p,
            seeds,
            positions,
            out,
        )
        launch(sample_kernel, B, SAMPLE_BLOCK, args, current_stream())
    return out


def argmax_cuda(logits: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """[B] int64 argmax of fp32 logits [B, V], ties to the lowest id."""
    B = logits.shape[0]
    if out is None:
        out = torch.empty(B, dtype=torch.int64, device=logits.device)
    if B:
        launch(argmax_kernel, B, SAMPLE_BLOCK, (logits, out), current_stream())
    return out


def apply_penalties_cuda(
    logits: torch.Tensor,
    prompt_mask: torch.Tensor,
    output_counts: torch.Tensor,
    repetition: torch.Tensor,
    presence: torch.Tensor,
    frequency: torch.Tensor,
) -> None:
    """Same meaning as apply_penalties_ref (in place on fp32 logits); prompt_mask bool,
    output_counts int32."""
    B, V = logits.shape
    if B:
        grid = (B, (V + PENALTY_BLOCK - 1) // PENALTY_BLOCK)
        args = (
            logits,
            prompt_mask,
            output_counts,
            repetition,
            presence,
            frequency,
        )
        launch(apply_penalties_kernel, grid, PENALTY_BLOCK, args, current_stream())
