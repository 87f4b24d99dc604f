// Volta tensor-core tiles for voltserve's numba.cuda kernels (SM70 and newer).
//
// numba.cuda has no tensor-core API, so these device functions hold the PTX warp-matrix
// instructions Volta introduced: wmma.load / wmma.mma.sync m16n16k16 (f16 inputs, f32
// accumulate) / wmma.store. Python declares them with cuda.declare_device(..., abi="c") and
// links this file; numba compiles it with NVRTC for the device's compute capability.
// <mma.h> is not included on purpose: the pip CUDA headers lack crt/mma.h, and the PTX is short.
//
// Every function here is warp-collective: all 32 lanes of a warp call it together with the same
// arguments (the wmma instructions are .sync.aligned). Pointers are generic addresses (shared,
// global or local memory all work); a tile's first element must be 32-byte aligned and leading
// dimensions are in elements, a multiple of 8 for f16 and of 4 for f32.
//
// Fragment layouts are opaque: the functions only move fragments between wmma instructions.
//
// f16 data is passed as unsigned short (raw bits), so no cuda_fp16.h is needed. The extern "C"
// functions return int 0: numba lowers a void C-ABI declaration with a 64-bit return slot, so
// an explicit int32 return keeps the PTX prototypes of caller and callee identical.

typedef unsigned short f16_t;

struct FragAB {  // an A or B fragment: 16 f16 values as 8 packed f16x2 registers (sm_70 layout)
  unsigned x[8];
};
struct FragC {  // an f32 accumulator fragment: 8 values per lane
  float x[8];
};

__device__ __forceinline__ void load_a_row(FragAB& f, const f16_t* p, unsigned ld) {
  asm volatile(
      "wmma.load.a.sync.aligned.row.m16n16k16.f16 {%0,%1,%2,%3,%4,%5,%6,%7}, [%8], %9;"
      : "=r"(f.x[0]), "=r"(f.x[1]), "=r"(f.x[2]), "=r"(f.x[3]), "=r"(f.x[4]), "=r"(f.x[5]),
        "=r"(f.x[6]), "=r"(f.x[7])
      : "l"(p), "r"(ld)
      : "memory");
}

__device__ __forceinline__ void load_b_col(FragAB& f, const f16_t* p, unsigned ld) {
  asm volatile(
      "wmma.load.b.sync.aligned.col.m16n16k16.f16 {%0,%1,%2,%3,%4,%5,%6,%7}, [%8], %9;"
      : "=r"(f.x[0]), "=r"(f.x[1]), "=r"(f.x[2]), "=r"(f.x[3]), "=r"(f.x[4]), "=r"(f.x[5]),
        "=r"(f.x[6]), "=r"(f.x[7])
      : "l"(p), "r"(ld)
      : "memory");
}

__device__ __forceinline__ void load_b_row(FragAB& f, const f16_t* p, unsigned ld) {
  asm volatile(
      "wmma.load.b.sync.aligned.row.m16n16k16.f16 {%0,%1,%2,%3,%4,%5,%6,%7}, [%8], %9;"
      : "=r"(f.x[0]), "=r"(f.x[1]), "=r"(f.x[2]), "=r"(f.x[3]), "=r"(f.x[4]), "=r"(f.x[5]),
        "=r"(f.x[6]), "=r"(f.x[7])
      : "l"(p), "r"(ld)
      : "memory");
}

__device__ __forceinline__ void store_d_row(float* p, const FragC& f, unsigned ld) {
  asm volatile(
      "wmma.store.d.sync.aligned.row.m16n16k16.f32 [%0], {%1,%2,%3,%4,%5,%6,%7,%8}, %9;"
      :
      : "l"(p), "f"(f.x[0]), "f"(f.x[1]), "f"(f.x[2]), "f"(f.x[3]), "f"(f.x[4]), "f"(f.x[5]),
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

__device__ __forceinline__ void zero(FragC& c) {
#pragma unroll
  for (int i = 0; i < 8; ++i) c.x[i] = 0.0f;
}

// ---------------------------------------------------------------------------------------------
// Plain tile product (the building block test): d[16, 16] (f32, row-major, ld 16) =
// a[16, k] (row-major, ld k) * b, b given as [k, 16] row-major (b_col == 0, ld 16) or as its
// transpose [16, k] row-major, i.e. column-major [k, 16] (b_col != 0, ld k). k % 16 == 0.

extern "C" __device__ int vs_wmma_gemm16(float* d, const f16_t* a, const f16_t* b, int k,
                                          int b_col) {
  FragC c;
  zero(c);
  for (int kk = 0; kk < k; kk += 16) {
    FragAB fa, fb;
    load_a_row(fa, a + kk, k);
    if (b_col) {
      load_b_col(fb, b + kk, k);
      mma_rc(c, fa, fb);
    } else {
      load_b_row(fb, b + kk * 16, 16);
      mma_rr(c, fa, fb);
    }
  }
  store_d_row(d, c, 16);
  return 0;
}

// ---------------------------------------------------------------------------------------------
// Grouped MoE expert GEMMs (moe/wmma.py): one warp's 16 x 64 output tile.
// out[16, 64] (f32, row-major, ld 64, at out + out_off) has column block j (16 columns) =
// a[16, K] (f16 row-major, ld lda, at a + a_off) times b_j^T, where b_j is a block of 16 weight
// rows [16, K] (row-major, ld ldb, at b + off_j), i.e. b_j^T read column-major. The K loop runs
// here with the four accumulators in registers; A and B fragments load straight from global
// memory (every tile start 32-byte aligned: K, lda, ldb and the offsets multiples of 16).

extern "C" __device__ int vs_moe_tile16x64(float* out, int out_off, const f16_t* a,
                                            long long a_off, int lda, const f16_t* b,
                                            long long off0, long long off1, long long off2,
                                            long long off3, int ldb, int K) {
  FragC c0, c1, c2, c3;
  zero(c0);
  zero(c1);
  zero(c2);
  zero(c3);
  const f16_t* pa = a + a_off;
  const f16_t* p0 = b + off0;
  const f16_t* p1 = b + off1;
  const f16_t* p2 = b + off2;
  const f16_t* p3 = b + off3;
#pragma unroll 2
  for (int kk = 0; kk < K; kk += 16) {
    FragAB fa, f0, f1, f2, f3;
    load_a_row(fa, pa + kk, lda);
    load_b_col(f0, p0 + kk, ldb);
    load_b_col(f1, p1 + kk, ldb);
    load_b_col(f2, p2 + kk, ldb);
    load_b_col(f3, p3 + kk, ldb);
    mma_rc(c0, fa, f0);
    mma_rc(c1, fa, f1);
    mma_rc(c2, fa, f2);
    mma_rc(c3, fa, f3);
  }
  float* o = out + out_off;
  store_d_row(o, c0, 64);
  store_d_row(o + 16, c1, 64);
  store_d_row(o + 32, c2, 64);
  store_d_row(o + 48, c3, 64);
  return 0;
}
