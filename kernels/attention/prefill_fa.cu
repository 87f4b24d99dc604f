// Flash-attention prefill for Volta (SM70) and newer: the whole key-tile loop of one thread block
// in CUDA C++, so that the output accumulators, the query fragments and the softmax state stay in
// registers from the first key to the last. Launched by attention/prefill_fa.py (a numba kernel
// that only calls vs_fa_prefill_d64 / _d128 / _d256 with pointers); the design and the register
// and shared-memory budget are described in that module's docstring.
//
// Tensor cores through Volta's warp-matrix PTX (wmma m16n16k16, f16 inputs, f32 accumulate),
// the .shared forms with 32-bit shared-window addresses. Fragment layouts are opaque and differ
// between sm_70 and sm_80+, so nothing here assumes one: where a register must know the row of
// its accumulator element (rescaling by exp2(m_old - m_new), the final 1 / l), the row values
// are written as a 16 x 16 f32 tile whose element (r, c) is value[r] and read back with
// wmma.load.c, which places value[row] in exactly the register that holds row `row`.
//
// Every wmma call is warp-collective and sits in warp-uniform control flow; every row-tile
// barrier (head dim 256) sits in control flow uniform over the tile's warps. f16 data is moved
// as raw 16-bit words (unsigned short) so no cuda_fp16.h is needed (the pip CUDA headers lack
// parts of it); the extern "C" entry points return int 0 because numba lowers a void C-ABI
// declaration with a return slot (see wmma_ptx.cu).

typedef unsigned short f16_t;

namespace vsfa {

// (query token, query head) rows of a thread block, in row tiles of 16. Compile-time sizes are
// enumerators (constexpr variables would be emitted as globals).
enum : int { ROWS = 64 };
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

// The SPLIT warps of row tile `tile` (threads 32 SPLIT tile .. + 32 SPLIT - 1) meet at named
// barrier 1 + tile (0 is __syncthreads'); as any bar.sync, it also orders their shared-memory
// accesses. Reached by every lane of those warps, in control flow uniform over them.
template <int SPLIT>
__device__ __forceinline__ void tile_sync(int tile) {
  asm volatile("bar.sync %0, %1;" : : "r"(1 + tile), "n"(32 * SPLIT) : "memory");
}

// --- the kernel body --------------------------------------------------------------------------

template <int D>
struct Shape {
  enum : int {
    // Warps that share a 16-row tile, each owning D / SPLIT of the head dim: its Q fragments,
    // its O accumulators and its share of every score. Up to D = 128 a warp owns all of it
    // (64 + 64 registers at 128); at 256 that would be 128 + 128, so two warps split it.
    SPLIT = D > 128 ? 2 : 1,
    WARPS = 4 * SPLIT,
    THREADS = 32 * WARPS,
    DW = D / SPLIT,                    // head-dim columns a warp owns
    KW = DW / 16,                      // fragments across them (Q fragments, O accumulators)
    N = D > 128 ? 16 : 32,             // keys a tile: 4 K/V tiles + scratch under 48 KB
    NF = N / 16,                       // S fragments across a tile's keys; P fragments along them
    KH = N / 2,                        // scores a lane holds (two lanes a row)
    BPT = N / 16,                      // cache blocks a tile
    LDK = D + 8,                       // f16 row stride of K, V and Q tiles (rows in other banks)
    KV_BYTES = N * LDK * 2,            // one K or V tile
    CH = D / 8,                        // 16-byte chunks a row
    NC = N * CH / THREADS,             // chunks of a K (or V) tile per thread
    TSTEP = THREADS / CH,              // key rows between a thread's chunks
    Q_ALL = ROWS * LDK * 2 > 2 * KV_BYTES,  // Q staging needs all four K/V buffers
    // A warp's scratch: 16 rows of LDS f32 words. Bytes 0 .. 4N - 1 of a row hold S (f32).
    // With SPLIT 1, P (f16) overlays S's first half and the row tiles (alpha, 1 / l) its second
    // half once the warp has read its scores. With SPLIT 2 the partner reads this warp's S
    // while this warp writes P, so P lies past S (bytes 64..95); the row tiles overlay S after
    // a pair barrier.
    LDS = SPLIT == 1 ? N + 4 : 28,     // (28: 8 warps' scratch fits beside the K/V tiles)
    LDP = 2 * LDS,                     // f16 row stride of P
    P_OFF = SPLIT == 1 ? 0 : 4 * N,    // byte offset of P in a scratch row
    A_OFF = SPLIT == 1 ? 64 : 0,       // byte offset of the row tiles (16 f32)
    EF = SPLIT == 1 ? 2 : 1,           // output fragments staged at once in the epilogue
    S_BYTES = 16 * LDS * 4,
    // [K0 | V0 | K1 | V1 | scratch of each warp]; Q is staged in K1 | V1 before the loop, or in
    // all four (Q_ALL) before tile 0 is stored.
    SMEM_BYTES = 4 * KV_BYTES + WARPS * S_BYTES,
  };
  static_assert(SPLIT * KW * 16 == D && WARPS * 16 == ROWS * SPLIT, "the row tiles' warps");
  static_assert(NF == 1 || NF == 2, "P's fragments: p0f and p1f");
  static_assert(NC * THREADS == N * CH && NC >= 1, "whole chunks per thread");
  static_assert(16 % TSTEP == 0, "a thread's chunk j lies in cache block (j * TSTEP) / 16");
  static_assert(ROWS * LDK * 2 == (Q_ALL ? 4 : 2) * KV_BYTES, "Q staging fills its buffers");
  static_assert(KV_BYTES % 128 == 0 && S_BYTES % 128 == 0, "32-byte aligned tiles");
  static_assert(4 * N <= 4 * LDS && P_OFF + 2 * N <= 4 * LDS && A_OFF + 64 <= 4 * LDS &&
                    EF * 64 <= 4 * LDS && LDS % 4 == 0 && P_OFF % 32 == 0,
                "S, P, the row tiles and the output staging fit a scratch row");
  static_assert(SPLIT == 1 || P_OFF >= 4 * N, "a partner's S reads never meet this warp's P");
  static_assert(SMEM_BYTES <= 48 * 1024, "numba's static shared memory");
};

template <int D>
__device__ __forceinline__ void fa_prefill(f16_t* out, const f16_t* q, const f16_t* k_cache,
                                           const f16_t* v_cache, const int* block_tables,
                                           int bt_stride, const int* seq_lens, const int* qsl,
                                           float scale, int num_kv_heads, int group,
                                           void* smem) {
  using S = Shape<D>;
  constexpr int SPLIT = S::SPLIT, THREADS = S::THREADS, N = S::N, NF = S::NF, KH = S::KH;
  constexpr int BPT = S::BPT, DW = S::DW, KW = S::KW, LDK = S::LDK, CH = S::CH, NC = S::NC;
  constexpr int TSTEP = S::TSTEP, LDS = S::LDS, LDP = S::LDP, S_BYTES = S::S_BYTES;
  constexpr int P_OFF = S::P_OFF, A_OFF = S::A_OFF, EF = S::EF;
  const float NEG_INF = __int_as_float(0xff800000);

  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  // The warp's row tile and its share of the head dim, columns dh * DW .. dh * DW + DW - 1.
  const int rt = warp / SPLIT, dh = warp % SPLIT;
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
  const unsigned qstage = S::Q_ALL ? kbuf0 : kbuf1;
  const unsigned sw = sm + 4 * S::KV_BYTES + warp * S_BYTES;  // this warp's S / P scratch
  // The row tile's S partials, one per warp of the tile in column order (SPLIT > 1).
  const unsigned sp0 = sm + 4 * S::KV_BYTES + rt * SPLIT * S_BYTES;

  // This lane's softmax row (two lanes a row, each holding KH of a tile's N keys).
  const int my_row = lane >> 1, half = lane & 1;
  const int row = rt * 16 + my_row;
  const int tok = t0 + row / G;
  const bool row_ok = row < RQ && tok < q_len;
  const int qpos = ctx0 + tok;
  // The row tile's first and last positions with a valid row: tiles past qpos_hi are skipped,
  // tiles up to qpos_lo need no mask. qpos_hi = -1 for a tile without valid rows. Functions of
  // the row tile only, so the warps sharing it take the same branches (and pair barriers).
  const int w_first = t0 + (rt * 16) / G;
  const int w_last = min(min(t0 + (rt * 16 + 15) / G, t0 + TQ - 1), q_len - 1);
  const int qpos_lo = ctx0 + w_first;
  const int qpos_hi = (rt * 16 < RQ && w_first < q_len) ? ctx0 + w_last : -1;

  // ---- Q staging: this block's 64 rows (zeros past the rows in use).
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
  // column my_c. A tile spans BPT cache blocks and chunk j lies in block (j*TSTEP)/16 at row
  // my_t + (j*TSTEP) % 16 of it, so each thread needs only the tile's block offsets (read one
  // tile ahead of the fill; the same for K and V) and compile-time row offsets.
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

  // Tile 0: stored at once beside the Q staging, or (Q_ALL) held in registers until every warp
  // has its Q fragments.
  U4 k0r[NC], v0r[NC];
  {
    const long long o0 = blk_off(0), o1 = BPT > 1 ? blk_off(1) : 0;
    if constexpr (S::Q_ALL) {
      fetch(kbase, 0, o0, o1, k0r);
      fetch(vbase, 0, o0, o1, v0r);
    } else {
      U4 r[NC];
      fetch(kbase, 0, o0, o1, r);
      put(kbuf0, r);
      fetch(vbase, 0, o0, o1, r);
      put(vbuf0, r);
    }
  }
  // Tile 1's block offsets.
  long long nb0 = blk_off(BPT), nb1 = BPT > 1 ? blk_off(BPT + 1) : 0;
  __syncthreads();

  // ---- Per-warp state in registers for the whole loop.
  FragAB qf[KW];  // the warp's 16 query rows, its columns, as A fragments
#pragma unroll
  for (int kk = 0; kk < KW; ++kk)
    load_a(qf[kk], qstage + (rt * 16 * LDK + dh * DW + kk * 16) * 2, LDK);
  FragC o[KW];  // the output accumulators, columns dh * DW + 16j .. + 15
#pragma unroll
  for (int j = 0; j < KW; ++j)
#pragma unroll
    for (int i = 0; i < 8; ++i) o[j].x[i] = 0.0f;
  float m = NEG_INF;  // the row's reference max (scaled, log2 units): lags the true max by < LAZY
  float l = 0.0f;     // this lane's share of the row's sum of exp2(s - m)
  const float c2 = scale * 1.4426950408889634f;  // softmax in base 2
  __syncthreads();  // every warp holds its Q: tile 0 or 1's fill may overwrite the staging
  if (S::Q_ALL) {
    put(kbuf0, k0r);
    put(vbuf0, v0r);
    __syncthreads();
  }

  for (int t = 0; t < ntiles; ++t) {
    const int kv0 = t * N;
    const unsigned kb = (t & 1) ? kbuf1 : kbuf0, vb = (t & 1) ? vbuf1 : vbuf0;
    const unsigned kn = (t & 1) ? kbuf0 : kbuf1, vn = (t & 1) ? vbuf0 : vbuf1;
    const bool more = t + 1 < ntiles;
    // The next tile's K loads go out first; this tile's scores hide their latency. Its
    // buffers were last read in tile t - 1, before the barrier that ended it.
    U4 kr[NC];
    if (more) fetch(kbase, kv0 + N, nb0, nb1, kr);
    // Tile t + 2's block offsets.
    const long long fb0 = blk_off(BPT * t + 2 * BPT);
    const long long fb1 = BPT > 1 ? blk_off(BPT * t + 2 * BPT + 1) : 0;
    // Uniform over the row tile's warps: some row of the tile sees a key here.
    const bool active = kv0 <= qpos_hi;

    FragC s[NF];  // S[16, N], or with SPLIT 2 this warp's partial over its columns
    if (active) {
#pragma unroll
      for (int i = 0; i < 8; ++i)
#pragma unroll
        for (int nf = 0; nf < NF; ++nf) s[nf].x[i] = 0.0f;
#pragma unroll
      for (int kk = 0; kk < KW; ++kk)
#pragma unroll
        for (int nf = 0; nf < NF; ++nf) {
          FragAB bf;  // K^T: the K tile read column-major
          load_b_col(bf, kb + (nf * 16 * LDK + dh * DW + kk * 16) * 2, LDK);
          mma_rc(s[nf], qf[kk], bf);
        }
#pragma unroll
      for (int nf = 0; nf < NF; ++nf) store_d(sw + nf * 16 * 4, s[nf], LDS);
    }
    if (more) put(kn, kr);
    U4 vr[NC];
    if (more) fetch(vbase, kv0 + N, nb0, nb1, vr);

    if (active) {
      // This lane's KH scores: row my_row, keys kv0 + KH half .. + KH - 1.
      float v[KH];
      if (SPLIT == 1) {
        __syncwarp();
        const unsigned sa = sw + (my_row * LDS + half * KH) * 4;
#pragma unroll
        for (int i = 0; i < KH / 4; ++i) lds16f(v + 4 * i, sa + 16 * i);
      } else {
        // Every warp of the row tile has stored its partial. Each adds them in the same order
        // (column halves ascending), so all hold bitwise the same scores and run the same
        // softmax: the same m, l and P, and the same decisions below.
        tile_sync<SPLIT>(rt);
        const unsigned sa = sp0 + (my_row * LDS + half * KH) * 4;
#pragma unroll
        for (int i = 0; i < KH / 4; ++i) lds16f(v + 4 * i, sa + 16 * i);
#pragma unroll
        for (int p = 1; p < SPLIT; ++p) {
          float w[KH];
#pragma unroll
          for (int i = 0; i < KH / 4; ++i) lds16f(w + 4 * i, sa + p * S_BYTES + 16 * i);
#pragma unroll
          for (int c = 0; c < KH; ++c) v[c] += w[c];
        }
      }
      if (kv0 + N - 1 > qpos_lo) {  // the diagonal: keys past the row's position are masked
        const int k0 = kv0 + half * KH;
#pragma unroll
        for (int c = 0; c < KH; ++c)
          if (k0 + c > qpos) v[c] = NEG_INF;
      }
      float mx = v[0];
#pragma unroll
      for (int c = 1; c < KH; ++c) mx = fmaxf(mx, v[c]);
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
      unsigned pw[KH / 2];
#pragma unroll
      for (int c = 0; c < KH; c += 2) {
        const float p0 = ex2(fmaf(v[c], c2, -mref));
        const float p1 = ex2(fmaf(v[c + 1], c2, -mref));
        psum += p0 + p1;
        pw[c / 2] = pack_f16x2(p0, p1);
      }
      l = l * alpha + psum;
      // Uniform over the row tile's warps too: their lanes hold the same rows' same scores.
      const bool rescale = __any_sync(0xffffffffu, grow);
      __syncwarp();  // every lane has read its scores: P (SPLIT 1) overwrites them
      // P (f16, row stride LDP) at P_OFF of each scratch row; the alpha tile at A_OFF.
      const unsigned pa = sw + my_row * (LDS * 4) + P_OFF + half * (2 * KH);
#pragma unroll
      for (int i = 0; i < KH / 8; ++i)
        sts16(pa + 16 * i, {pw[4 * i], pw[4 * i + 1], pw[4 * i + 2], pw[4 * i + 3]});
      const unsigned at = sw + my_row * (LDS * 4) + A_OFF + half * 32;
      if (rescale) {
        // SPLIT 2: the alpha tile overwrites this warp's S partial, which the other warp of the
        // tile reads; both are here (rescale is uniform over them) after their reads.
        if (SPLIT > 1) tile_sync<SPLIT>(rt);
        sts16f(at, alpha, alpha, alpha, alpha);
        sts16f(at + 16, alpha, alpha, alpha, alpha);
      }
      __syncwarp();
      if (rescale) {
        FragC al;  // al.x[i] = alpha of the row of o[j].x[i]
        load_c(al, sw + A_OFF, LDS);
#pragma unroll
        for (int j = 0; j < KW; ++j)
#pragma unroll
          for (int i = 0; i < 8; ++i) o[j].x[i] *= al.x[i];
      }
      // P's A fragments: keys 0..15 of the tile and (N = 32) keys 16..31.
      FragAB p0f, p1f;
      load_a(p0f, sw + P_OFF, LDP);
      if (NF > 1) load_a(p1f, sw + P_OFF + 32, LDP);
#pragma unroll
      for (int j = 0; j < KW; ++j) {
        FragAB bf;
        load_b_row(bf, vb + (dh * DW + j * 16) * 2, LDK);
        mma_rr(o[j], p0f, bf);
        if (NF > 1) {
          load_b_row(bf, vb + (16 * LDK + dh * DW + j * 16) * 2, LDK);
          mma_rr(o[j], p1f, bf);
        }
      }
    }
    if (more) put(vn, vr);
    nb0 = fb0;
    nb1 = fb1;
    // Tile t + 1 is in K/V buf^1 for everyone, and every warp is done with buf and with the
    // scratch (its own P and alpha reads above, and the partner's reads of its S partial)
    // before tile t + 2's fill or the next scores.
    __syncthreads();
  }

  // ---- Epilogue: o / l per row, through the warp's scratch as f32, written as f16 rows (the
  // last tile's barrier ended every read of the scratch by another warp).
  const float lt = l + __shfl_xor_sync(0xffffffffu, l, 1);
  const float inv = lt > 0.0f ? 1.0f / lt : 0.0f;
  const unsigned at = sw + my_row * (LDS * 4) + A_OFF + half * 32;
  sts16f(at, inv, inv, inv, inv);
  sts16f(at + 16, inv, inv, inv, inv);
  __syncwarp();
  FragC sc;
  load_c(sc, sw + A_OFF, LDS);
  __syncwarp();  // the inverse tile is in registers before the staging overwrites it
  // This lane's 8 EF columns of each group of EF fragments.
  f16_t* orow =
      out + ((long long)(q0 + tok) * H + kvh * G + row % G) * D + dh * DW + half * (8 * EF);
#pragma unroll
  for (int jp = 0; jp < KW; jp += EF) {
    FragC a[EF];
#pragma unroll
    for (int e = 0; e < EF; ++e) a[e] = o[jp + e];
#pragma unroll
    for (int i = 0; i < 8; ++i)
#pragma unroll
      for (int e = 0; e < EF; ++e) a[e].x[i] *= sc.x[i];
#pragma unroll
    for (int e = 0; e < EF; ++e) store_d(sw + e * 16 * 4, a[e], LDS);
    __syncwarp();
    float v[8 * EF];
    const unsigned sa = sw + (my_row * LDS + half * (8 * EF)) * 4;
#pragma unroll
    for (int i = 0; i < 2 * EF; ++i) lds16f(v + 4 * i, sa + 16 * i);
    if (row_ok) {
#pragma unroll
      for (int e = 0; e < EF; ++e) {
        const float* x = v + 8 * e;
        stg16(orow + jp * 16 + 8 * e, {pack_f16x2(x[0], x[1]), pack_f16x2(x[2], x[3]),
                                       pack_f16x2(x[4], x[5]), pack_f16x2(x[6], x[7])});
      }
    }
    __syncwarp();  // the staging is read before the next group overwrites it
  }
}

}  // namespace vsfa

// Entry points (one per head dim). smem: the numba kernel's shared array of
// vsfa::Shape<D>::SMEM_BYTES bytes, 128-byte aligned (prefill_fa.smem_bytes).
#define VSFA_ENTRY(D)                                                                          \
  extern "C" __device__ int vs_fa_prefill_d##D(                                                \
      f16_t* out, const f16_t* q, const f16_t* k_cache, const f16_t* v_cache,                  \
      const int* block_tables, int bt_stride, const int* seq_lens, const int* qsl, float scale, \
      int num_kv_heads, int group, float* smem) {                                              \
    vsfa::fa_prefill<D>(out, q, k_cache, v_cache, block_tables, bt_stride, seq_lens, qsl,     \
                        scale, num_kv_heads, group, smem);                                     \
    return 0;                                                                                  \
  }

VSFA_ENTRY(64)
VSFA_ENTRY(128)
VSFA_ENTRY(256)
