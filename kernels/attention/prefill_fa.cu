// Flash-attention prefill for Volta (SM70) and newer: the whole key-tile loop of one thread block
// in CUDA C++, so that the output accumulators, the query fragments and the softmax state stay in
// registers from the first key to the last. Launched by attention/prefill_fa.py (a numba kernel
// that only calls vs_fa_prefill_d64 / _d128 with pointers); the design and the register and
// shared-memory budget are described in that module's docstring.
//
// Tensor cores through Volta's warp-matrix PTX (wmma m16n16k16, f16 inputs, f32 accumulate),
// the .shared forms with 32-bit shared-window addresses. Fragment layouts are opaque and differ
// between sm_70 and sm_80+, so nothing here assumes one: where a register must know the row of
// its accumulator element (rescaling by exp2(m_old - m_new), the final 1 / l), the row values
// are written as a 16 x 16 f32 tile whose element (r, c) is value[r] and read back with
// wmma.load.c, which places value[row] in exactly the register that holds row `row`.
//
// Every wmma call is warp-collective and sits in warp-uniform control flow. f16 data is moved
// as raw 16-bit words (unsigned short) so no cuda_fp16.h is needed (the pip CUDA headers lack
// parts of it); the extern "C" entry points return int 0 because numba lowers a void C-ABI
// declaration with a return slot (see wmma_ptx.cu).

typedef unsigned short f16_t;

namespace vsfa {

// Compile-time sizes as enumerators (constexpr variables would be emitted as globals).
enum : int {
  WARPS = 4,
  THREADS = 32 * WARPS,
  ROWS = 16 * WARPS,  // (query token, query head) rows of a thread block
  N = 32,             // keys per tile (one block barrier per tile)
  LDS = N + 4,        // f32 row stride of a warp's S scratch (words)
  LDP = 2 * LDS,      // f16 row stride of P, which overlays the S rows
  S_BYTES = 16 * LDS * 4,
};
#define VSFA_LAZY 8.0f  // rescale only when a row's max grows by more (log2 units)

struct FragAB {  // an A or B fragment: 8 registers of f16x2
  unsigned x[8];
};
struct FragC {  // an f32 accumulator fragment: 8 floats per lane
  float x[8];
};

__device__ __forceinline__ unsigned smem_u32(const void* p) {
  unsigned long long a;
  asm("cvta.to.shared.u64 %0, %1;" : "=l"(a) : "l"(p));
  return (unsigned)a;
}

// --- wmma, shared-memory forms (a: 32-byte aligned shared address, ld in elements) ---------

__device__ __forceinline__ void load_a(FragAB& f, unsigned a, unsigned ld) {
  asm volatile(
      "wmma.load.a.sync.aligned.row.m16n16k16.shared.f16 {%0,%1,%2,%3,%4,%5,%6,%7}, [%8], %9;"
      : "=r"(f.x[0]), "=r"(f.x[1]), "=r"(f.x[2]), "=r"(f.x[3]), "=r"(f.x[4]), "=r"(f.x[5]),
        "=r"(f.x[6]), "=r"(f.x[7])
      : "r"(a), "r"(ld)
      : "memory");
}

__device__ __forceinline__ void load_b_col(FragAB& f, unsigned a, unsigned ld) {
  asm volatile(
      "wmma.load.b.sync.aligned.col.m16n16k16.shared.f16 {%0,%1,%2,%3,%4,%5,%6,%7}, [%8], %9;"
      : "=r"(f.x[0]), "=r"(f.x[1]), "=r"(f.x[2]), "=r"(f.x[3]), "=r"(f.x[4]), "=r"(f.x[5]),
        "=r"(f.x[6]), "=r"(f.x[7])
      : "r"(a), "r"(ld)
      : "memory");
}

__device__ __forceinline__ void load_b_row(FragAB& f, unsigned a, unsigned ld) {
  asm volatile(
      "wmma.load.b.sync.aligned.row.m16n16k16.shared.f16 {%0,%1,%2,%3,%4,%5,%6,%7}, [%8], %9;"
      : "=r"(f.x[0]), "=r"(f.x[1]), "=r"(f.x[2]), "=r"(f.x[3]), "=r"(f.x[4]), "=r"(f.x[5]),
        "=r"(f.x[6]), "=r"(f.x[7])
      : "r"(a), "r"(ld)
      : "memory");
}

__device__ __forceinline__ void load_c(FragC& f, unsigned a, unsigned ld) {
  asm volatile(
      "wmma.load.c.sync.aligned.row.m16n16k16.shared.f32 {%0,%1,%2,%3,%4,%5,%6,%7}, [%8], %9;"
      : "=f"(f.x[0]), "=f"(f.x[1]), "=f"(f.x[2]), "=f"(f.x[3]), "=f"(f.x[4]), "=f"(f.x[5]),
        "=f"(f.x[6]), "=f"(f.x[7])
      : "r"(a), "r"(ld)
      : "memory");
}

__device__ __forceinline__ void store_d(unsigned a, const FragC& f, unsigned ld) {
  asm volatile(
      "wmma.store.d.sync.aligned.row.m16n16k16.shared.f32 [%0], {%1,%2,%3,%4,%5,%6,%7,%8}, %9;"
      :
      : "r"(a), "f"(f.x[0]), "f"(f.x[1]), "f"(f.x[2]), "f"(f.x[3]), "f"(f.x[4]), "f"(f.x[5]),
        "f"(f.x[6]), "f"(f.x[7]), "r"(ld)
      : "memory");
}

// c += a (row-major) * b (column-major)
__device__ __forceinline__ void mma_rc(FragC& c, const FragAB& a, const FragAB& b) {
  asm volatile(
      "wmma.mma.sync.aligned.row.col.m16n16k16.f32.f32 {%0,%1,%2,%3,%4,%5,%6,%7}, "
      "{%8,%9,%10,%11,%12,%13,%14,%15}, {%16,%17,%18,%19,%20,%21,%22,%23}, "
      "{%0,%1,%2,%3,%4,%5,%6,%7};"
      : "+f"(c.x[0]), "+f"(c.x[1]), "+f"(c.x[2]), "+f"(c.x[3]), "+f"(c.x[4]), "+f"(c.x[5]),
        "+f"(c.x[6]), "+f"(c.x[7])
      : "r"(a.x[0]), "r"(a.x[1]), "r"(a.x[2]), "r"(a.x[3]), "r"(a.x[4]), "r"(a.x[5]),
        "r"(a.x[6]), "r"(a.x[7]), "r"(b.x[0]), "r"(b.x[1]), "r"(b.x[2]), "r"(b.x[3]),
        "r"(b.x[4]), "r"(b.x[5]), "r"(b.x[6]), "r"(b.x[7]));
}

// c += a (row-major) * b (row-major)
__device__ __forceinline__ void mma_rr(FragC& c, const FragAB& a, const FragAB& b) {
  asm volatile(
      "wmma.mma.sync.aligned.row.row.m16n16k16.f32.f32 {%0,%1,%2,%3,%4,%5,%6,%7}, "
      "{%8,%9,%10,%11,%12,%13,%14,%15}, {%16,%17,%18,%19,%20,%21,%22,%23}, "
      "{%0,%1,%2,%3,%4,%5,%6,%7};"
      : "+f"(c.x[0]), "+f"(c.x[1]), "+f"(c.x[2]), "+f"(c.x[3]), "+f"(c.x[4]), "+f"(c.x[5]),
        "+f"(c.x[6]), "+f"(c.x[7])
      : "r"(a.x[0]), "r"(a.x[1]), "r"(a.x[2]), "r"(a.x[3]), "r"(a.x[4]), "r"(a.x[5]),
        "r"(a.x[6]), "r"(a.x[7]), "r"(b.x[0]), "r"(b.x[1]), "r"(b.x[2]), "r"(b.x[3]),
        "r"(b.x[4]), "r"(b.x[5]), "r"(b.x[6]), "r"(b.x[7]));
}

// --- plain loads and stores -------------------------------------------------------------------

struct U4 {
  unsigned x, y, z, w;
};

// 16 bytes from global memory that nothing writes during the kernel (q, the caches).
__device__ __forceinline__ U4 ldg16(const f16_t* p) {
  U4 v;
  asm volatile("ld.global.nc.v4.u32 {%0,%1,%2,%3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p));
  return v;
}

__device__ __forceinline__ void stg16(f16_t* p, U4 v) {
  asm volatile("st.global.v4.u32 [%0], {%1,%2,%3,%4};"
               :
               : "l"(p), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w)
               : "memory");
}

__device__ __forceinline__ void sts16(unsigned a, U4 v) {
  asm volatile("st.shared.v4.u32 [%0], {%1,%2,%3,%4};"
               :
               : "r"(a), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w)
               : "memory");
}

__device__ __forceinline__ void sts16f(unsigned a, float x, float y, float z, float w) {
  asm volatile("st.shared.v4.f32 [%0], {%1,%2,%3,%4};"
               :
               : "r"(a), "f"(x), "f"(y), "f"(z), "f"(w)
               : "memory");
}

__device__ __forceinline__ void lds16f(float* v, unsigned a) {
  asm volatile("ld.shared.v4.f32 {%0,%1,%2,%3}, [%4];"
               : "=f"(v[0]), "=f"(v[1]), "=f"(v[2]), "=f"(v[3])
               : "r"(a)
               : "memory");
}

__device__ __forceinline__ float ex2(float x) {  // 2^x; ex2(-inf) = 0
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// Two floats as f16x2 (round to nearest even), the first in the low half (the lower address).
__device__ __forceinline__ unsigned pack_f16x2(float lo, float hi) {
  unsigned r;
  asm("{\n\t.reg .f16 l, h;\n\t"
      "cvt.rn.f16.f32 l, %1;\n\t"
      "cvt.rn.f16.f32 h, %2;\n\t"
      "mov.b32 %0, {l, h};\n\t}"
      : "=r"(r)
      : "f"(lo), "f"(hi));
  return r;
}

// --- the kernel body --------------------------------------------------------------------------

template <int D>
struct Shape {
  enum : int {
    LDK = D + 8,             // f16 row stride of K, V and Q tiles (rows in other banks)
    KV_BYTES = N * LDK * 2,  // one K or V tile
    CH = D / 8,              // 16-byte chunks a row
    NC = N * CH / THREADS,   // chunks of a K (or V) tile per thread
    TSTEP = THREADS / CH,    // key rows between a thread's chunks
    KD = D / 16,             // fragments across the head dim
    // [K0 | V0 | K1 | V1 | S scratch of each warp]; Q is staged in K1 | V1 before the loop.
    SMEM_BYTES = 4 * KV_BYTES + WARPS * S_BYTES,
  };
  static_assert(NC * THREADS == N * CH && NC >= 1, "whole chunks per thread");
  static_assert(16 % TSTEP == 0, "a thread's chunk j lies in cache block (j * TSTEP) / 16");
  static_assert(ROWS * LDK * 2 == 2 * KV_BYTES, "Q staging fills K1 | V1 exactly");
  static_assert(KV_BYTES % 128 == 0 && S_BYTES % 128 == 0, "32-byte aligned tiles");
};

template <int D>
__device__ __forceinline__ void fa_prefill(f16_t* out, const f16_t* q, const f16_t* k_cache,
                                           const f16_t* v_cache, const int* block_tables,
                                           int bt_stride, const int* seq_lens, const int* qsl,
                                           float scale, int num_kv_heads, int group,
                                           void* smem) {
  using S = Shape<D>;
  constexpr int LDK = S::LDK, CH = S::CH, NC = S::NC, TSTEP = S::TSTEP, KD = S::KD;
  const float NEG_INF = __int_as_float(0xff800000);

  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int kvh = blockIdx.y, b = blockIdx.z;
  // Query tiles in reverse: the tiles with the longest causal context start first, so the
  // short ones fill the tail of the grid instead of one long tile running alone at the end.
  const int qt = gridDim.x - 1 - blockIdx.x;
  const int G = group;
  const int TQ = ROWS / G;  // query tokens a block
  const int RQ = TQ * G;    // rows in use
  const int q0 = qsl[b];
  const int q_len = qsl[b + 1] - q0;
  const int t0 = qt * TQ;
  if (t0 >= q_len) return;  // block-uniform, before any barrier
  const int seq_len = seq_lens[b];
  const int ctx0 = seq_len - q_len;  // position of the sequence's first query
  const int H = num_kv_heads * G;
  const int last_tok = min(t0 + TQ, q_len) - 1;
  const int kv_end = ctx0 + last_tok + 1;  // keys the block's last query sees
  const int ntiles = (kv_end + N - 1) / N;

  const unsigned sm = smem_u32(smem);
  const unsigned kbuf0 = sm, vbuf0 = sm + S::KV_BYTES;
  const unsigned kbuf1 = sm + 2 * S::KV_BYTES, vbuf1 = sm + 3 * S::KV_BYTES;
  const unsigned qstage = kbuf1;
  const unsigned sw = sm + 4 * S::KV_BYTES + warp * S_BYTES;  // this warp's S / P scratch

  // This lane's softmax row (two lanes a row, each holding 16 of a tile's 32 keys).
  const int my_row = lane >> 1, half = lane & 1;
  const int row = warp * 16 + my_row;
  const int tok = t0 + row / G;
  const bool row_ok = row < RQ && tok < q_len;
  const int qpos = ctx0 + tok;
  // The warp's first and last positions with a valid row: tiles past qpos_hi are skipped,
  // tiles up to qpos_lo need no mask. qpos_hi = -1 for a warp without valid rows.
  const int w_first = t0 + (warp * 16) / G;
  const int w_last = min(min(t0 + (warp * 16 + 15) / G, t0 + TQ - 1), q_len - 1);
  const int qpos_lo = ctx0 + w_first;
  const int qpos_hi = (warp * 16 < RQ && w_first < q_len) ? ctx0 + w_last : -1;

  // ---- Q staging: this block's 64 rows (zeros past the rows in use) into K1 | V1.
  for (int idx = tid; idx < ROWS * CH; idx += THREADS) {
    const int r = idx / CH, c = idx % CH;
    const int t = t0 + r / G;
    U4 w = {0u, 0u, 0u, 0u};
    if (r < RQ && t < q_len) {
      w = ldg16(q + ((long long)(q0 + t) * H + kvh * G + r % G) * D + c * 8);
    }
    sts16(qstage + (r * LDK + c * 8) * 2, w);
  }

  // ---- K/V fill. Thread tid copies chunks j < NC of a tile: key row my_t + j * TSTEP, 16-byte
  // column my_c. A 32-key tile spans two cache blocks and chunk j lies in block (j*TSTEP)/16 at
  // row my_t + (j*TSTEP) % 16 of it, so each thread needs only the tile's two block offsets
  // (read one tile ahead of the fill; the same for K and V) and compile-time row offsets.
  // Positions at or past kv_end are zeros: no query of the block sees them, and the cache slots
  // past the context may hold stale data (NaN * 0 is NaN in an mma).
  const int my_t = tid / CH, my_c = tid % CH;
  const int* bt = block_tables + (long long)b * bt_stride;
  const long long blk_stride = (long long)num_kv_heads * 16 * D;
  const long long thread_off = ((long long)kvh * 16 + my_t) * D + my_c * 8;
  const f16_t* kbase = k_cache + thread_off;
  const f16_t* vbase = v_cache + thread_off;
  auto blk_off = [&](int i) -> long long {  // element offset of the i-th block of the sequence
    return i * 16 < kv_end ? (long long)bt[i] * blk_stride : 0;
  };
  auto fetch = [&](const f16_t* base, int kv0, long long off0, long long off1, U4 (&r)[NC]) {
#pragma unroll
    for (int j = 0; j < NC; ++j) {
      const f16_t* p = base + ((j * TSTEP) / 16 == 0 ? off0 : off1) + ((j * TSTEP) % 16) * D;
      r[j] = {0u, 0u, 0u, 0u};
      if (kv0 + my_t + j * TSTEP < kv_end) r[j] = ldg16(p);
    }
  };
  auto put = [&](unsigned buf, const U4 (&r)[NC]) {
#pragma unroll
    for (int j = 0; j < NC; ++j) sts16(buf + ((my_t + j * TSTEP) * LDK + my_c * 8) * 2, r[j]);
  };

  {
    U4 r[NC];
    const long long o0 = blk_off(0), o1 = blk_off(1);
    fetch(kbase, 0, o0, o1, r);
    put(kbuf0, r);
    fetch(vbase, 0, o0, o1, r);
    put(vbuf0, r);
  }
  long long nb0 = blk_off(2), nb1 = blk_off(3);  // tile 1's block offsets
  __syncthreads();

  // ---- Per-warp state in registers for the whole loop.
  FragAB qf[KD];  // the warp's 16 query rows as A fragments
#pragma unroll
  for (int kk = 0; kk < KD; ++kk) load_a(qf[kk], qstage + (warp * 16 * LDK + kk * 16) * 2, LDK);
  FragC o[KD];  // the output accumulators, columns 16j .. 16j + 15
#pragma unroll
  for (int j = 0; j < KD; ++j)
#pragma unroll
    for (int i = 0; i < 8; ++i) o[j].x[i] = 0.0f;
  float m = NEG_INF;  // the row's reference max (scaled, log2 units): lags the true max by < LAZY
  float l = 0.0f;     // this lane's share of the row's sum of exp2(s - m)
  const float c2 = scale * 1.4426950408889634f;  // softmax in base 2
  __syncthreads();  // every warp holds its Q: tile 1's fill may overwrite the staging

  for (int t = 0; t < ntiles; ++t) {
    const int kv0 = t * N;
    const unsigned kb = (t & 1) ? kbuf1 : kbuf0, vb = (t & 1) ? vbuf1 : vbuf0;
    const unsigned kn = (t & 1) ? kbuf0 : kbuf1, vn = (t & 1) ? vbuf0 : vbuf1;
    const bool more = t + 1 < ntiles;
    // The next tile's K loads go out first; this tile's scores hide their latency. Its
    // buffers were last read in tile t - 1, before the barrier that ended it.
    U4 kr[NC];
    if (more) fetch(kbase, kv0 + N, nb0, nb1, kr);
    const long long fb0 = blk_off(2 * t + 4), fb1 = blk_off(2 * t + 5);  // tile t + 2's
    const bool active = kv0 <= qpos_hi;  // warp-uniform: some row of the warp sees a key here

    FragC s0, s1;
    if (active) {
#pragma unroll
      for (int i = 0; i < 8; ++i) s0.x[i] = s1.x[i] = 0.0f;
#pragma unroll
      for (int kk = 0; kk < KD; ++kk) {
        FragAB bf;  // K^T: the K tile read column-major
        load_b_col(bf, kb + (kk * 16) * 2, LDK);
        mma_rc(s0, qf[kk], bf);
        load_b_col(bf, kb + (16 * LDK + kk * 16) * 2, LDK);
        mma_rc(s1, qf[kk], bf);
      }
      store_d(sw, s0, LDS);
      store_d(sw + 16 * 4, s1, LDS);
    }
    if (more) put(kn, kr);
    U4 vr[NC];
    if (more) fetch(vbase, kv0 + N, nb0, nb1, vr);

    if (active) {
      __syncwarp();
      // This lane's 16 scores: row my_row, keys kv0 + 16 half .. + 15.
      float v[16];
      const unsigned sa = sw + (my_row * LDS + half * 16) * 4;
#pragma unroll
      for (int i = 0; i < 4; ++i) lds16f(v + 4 * i, sa + 16 * i);
      if (kv0 + N - 1 > qpos_lo) {  // the diagonal: keys past the row's position are masked
        const int k0 = kv0 + half * 16;
#pragma unroll
        for (int c = 0; c < 16; ++c)
          if (k0 + c > qpos) v[c] = NEG_INF;
      }
      float mx = v[0];
#pragma unroll
      for (int c = 1; c < 16; ++c) mx = fmaxf(mx, v[c]);
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
      const float tmax = mx * c2;  // c2 > 0: the max of the scaled scores
      // Lazy rescaling: keep the stale reference max unless the row's max grew by more than
      // VSFA_LAZY. Exact (the accumulators and l share the reference); p = exp2(s - m) <= 2^LAZY,
      // well inside f16 and f32. The first tile always grows (m = -inf; key 0 is visible to
      // every row, so tmax is finite).
      const bool grow = tmax > m + VSFA_LAZY;
      const float alpha = grow ? ex2(m - tmax) : 1.0f;
      if (grow) m = tmax;
      const float mref = m == NEG_INF ? 0.0f : m;  // never -inf - -inf
      float psum = 0.0f;
      unsigned pw[8];
#pragma unroll
      for (int c = 0; c < 16; c += 2) {
        const float p0 = ex2(fmaf(v[c], c2, -mref));
        const float p1 = ex2(fmaf(v[c + 1], c2, -mref));
        psum += p0 + p1;
        pw[c / 2] = pack_f16x2(p0, p1);
      }
      l = l * alpha + psum;
      const bool rescale = __any_sync(0xffffffffu, grow);
      __syncwarp();  // every lane has read its scores: P and the alpha tile overwrite them
      // P (f16, row stride LDP) over bytes 0..63 of each S row; alpha over bytes 64..127.
      const unsigned pa = sw + my_row * (LDS * 4) + half * 32;
      sts16(pa, {pw[0], pw[1], pw[2], pw[3]});
      sts16(pa + 16, {pw[4], pw[5], pw[6], pw[7]});
      const unsigned at = sw + my_row * (LDS * 4) + 64 + half * 32;
      if (rescale) {
        sts16f(at, alpha, alpha, alpha, alpha);
        sts16f(at + 16, alpha, alpha, alpha, alpha);
      }
      __syncwarp();
      if (rescale) {
        FragC al;  // al.x[i] = alpha of the row of o[j].x[i]
        load_c(al, sw + 64, LDS);
#pragma unroll
        for (int j = 0; j < KD; ++j)
#pragma unroll
          for (int i = 0; i < 8; ++i) o[j].x[i] *= al.x[i];
      }
      FragAB p0f, p1f;
      load_a(p0f, sw, LDP);
      load_a(p1f, sw + 32, LDP);
#pragma unroll
      for (int j = 0; j < KD; ++j) {
        FragAB bf;
        load_b_row(bf, vb + (j * 16) * 2, LDK);
        mma_rr(o[j], p0f, bf);
        load_b_row(bf, vb + (16 * LDK + j * 16) * 2, LDK);
        mma_rr(o[j], p1f, bf);
      }
    }
    if (more) put(vn, vr);
    nb0 = fb0;
    nb1 = fb1;
    // Tile t + 1 is in K/V buf^1 for everyone, and every warp is done with buf and with its
    // scratch (the P and alpha reads above) before tile t + 2's fill or the next scores.
    __syncthreads();
  }

  // ---- Epilogue: o / l per row, through the warp's scratch as f32, written as f16 rows.
  const float lt = l + __shfl_xor_sync(0xffffffffu, l, 1);
  const float inv = lt > 0.0f ? 1.0f / lt : 0.0f;
  const unsigned at = sw + my_row * (LDS * 4) + 64 + half * 32;
  sts16f(at, inv, inv, inv, inv);
  sts16f(at + 16, inv, inv, inv, inv);
  __syncwarp();
  FragC sc;
  load_c(sc, sw + 64, LDS);
  __syncwarp();  // the inverse tile is in registers before the staging overwrites it
  f16_t* orow = out + ((long long)(q0 + tok) * H + kvh * G + row % G) * D + half * 16;
#pragma unroll
  for (int jp = 0; jp < KD; jp += 2) {
    FragC a = o[jp], c = o[jp + 1];
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      a.x[i] *= sc.x[i];
      c.x[i] *= sc.x[i];
    }
    store_d(sw, a, LDS);
    store_d(sw + 16 * 4, c, LDS);
    __syncwarp();
    float v[16];
    const unsigned sa = sw + (my_row * LDS + half * 16) * 4;
#pragma unroll
    for (int i = 0; i < 4; ++i) lds16f(v + 4 * i, sa + 16 * i);
    if (row_ok) {
      stg16(orow + jp * 16, {pack_f16x2(v[0], v[1]), pack_f16x2(v[2], v[3]),
                             pack_f16x2(v[4], v[5]), pack_f16x2(v[6], v[7])});
      stg16(orow + jp * 16 + 8, {pack_f16x2(v[8], v[9]), pack_f16x2(v[10], v[11]),
                                 pack_f16x2(v[12], v[13]), pack_f16x2(v[14], v[15])});
    }
    __syncwarp();  // the staging is read before the next pair overwrites it
  }
}

}  // namespace vsfa

// Entry points (one per head dim). smem: the numba kernel's shared array of
// vsfa::Shape<D>::SMEM_BYTES bytes, 128-byte aligned (prefill_attention_fa.SMEM_BYTES).
extern "C" __device__ int vs_fa_prefill_d64(f16_t* out, const f16_t* q, const f16_t* k_cache,
                                             const f16_t* v_cache, const int* block_tables,
                                             int bt_stride, const int* seq_lens, const int* qsl,
                                             float scale, int num_kv_heads, int group,
                                             float* smem) {
  vsfa::fa_prefill<64>(out, q, k_cache, v_cache, block_tables, bt_stride, seq_lens, qsl, scale,
                       num_kv_heads, group, smem);
  return 0;
}

extern "C" __device__ int vs_fa_prefill_d128(f16_t* out, const f16_t* q, const f16_t* k_cache,
                                              const f16_t* v_cache, const int* block_tables,
                                              int bt_stride, const int* seq_lens, const int* qsl,
                                              float scale, int num_kv_heads, int group,
                                              float* smem) {
  vsfa::fa_prefill<128>(out, q, k_cache, v_cache, block_tables, bt_stride, seq_lens, qsl, scale,
                        num_kv_heads, group, smem);
  return 0;
}
