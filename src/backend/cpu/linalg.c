/*
 * backend/cpu/linalg.c -- CPU kernels of the linalg family (see core/kernels_linalg.h): the linear
 * helpers, attention's small GEMMs (packed micro-kernels), convolution (im2col + a packed GEMM, or
 * Winograd F(2x2, 3x3) for 3x3 same-size convolutions with enough channels, or oneDNN) and pooling
 * loops. The float32 GEMMs of the libraries are gemm.c's. Compiled once per ISA level (cpu.h): the
 * hand-written micro-kernels of each copy are those of its level (FSDP_ISA_BUILD), the compiler's
 * vector loops (packing, transforms, pooling) are its level's.
 */
#include "core/core.h"
#include "backend/cpu/cpu.h"

#include <math.h>
#include <omp.h>

// ---- linear helpers ------------------------------------------------------------------------------------

// Linear's helpers are memory bound; split over the threads from this many elements on.
#define FSDP_LINEAR_OMP_MIN (1 << 16)

static void cpu_bias_rows(float* y, const float* b, int64_t M, int64_t N) {
#pragma omp parallel for if (M * N > FSDP_LINEAR_OMP_MIN)
  for (int64_t i = 0; i < M; i++) memcpy(y + i * N, b, N * sizeof(float));
}

// gb (N) = sum_i gy (i, :), vectorized over j. Threads take tiles of (row range, 2048-column block):
// a block's running sums (8 KB) stay in L1 while whole rows stream past in order, four rows per
// pass (one add into the sums per four rows read). Every output splits its rows over the threads,
// each row range summed into its own partial row; the partials are added at the end. (One thread,
// 2048 rows of 384-1536 columns from memory, on a 2-core AMD EPYC family 25 model 17: 0.40-1.41 ms
// with 256-column blocks one row at a time, 0.23-0.66 ms so: 14-19 GB/s.)
static void cpu_sum_rows(float* gb, const float* gy, int64_t M, int64_t N) {
  enum { CB = 2048 };  // column block
  int64_t nb = (N + CB - 1) / CB, nr = 1;
  int nt = omp_in_parallel() || M * N <= FSDP_LINEAR_OMP_MIN ? 1 : omp_get_max_threads();
  if (nt > 1) nr = nt;  // row ranges: every thread gets tiles of every column block
  float* part = nr > 1 ? malloc(nr * N * sizeof(float)) : NULL;
  if (!part) nr = 1;
  float* dst0 = part ? part : gb;  // row range r sums into dst0 + r * N
#pragma omp parallel for num_threads(nt) schedule(static) if (nt > 1)
  for (int64_t t = 0; t < nb * nr; t++) {
    int64_t b = t / nr, r = t % nr;
    int64_t j0 = b * CB, nj = N - j0 < CB ? N - j0 : CB, i0 = M * r / nr, i1 = M * (r + 1) / nr, i = i0;
    float acc[CB];
    for (int64_t j = 0; j < nj; j++) acc[j] = 0.0f;
    for (; i + 4 <= i1; i += 4) {
      const float *r0 = gy + i * N + j0, *r1 = r0 + N, *r2 = r1 + N, *r3 = r2 + N;
      for (int64_t j = 0; j < nj; j++) acc[j] += (r0[j] + r1[j]) + (r2[j] + r3[j]);
    }
    for (; i < i1; i++) {
      const float* row = gy + i * N + j0;
      for (int64_t j = 0; j < nj; j++) acc[j] += row[j];
    }
    for (int64_t j = 0; j < nj; j++) dst0[r * N + j0 + j] = acc[j];
  }
  if (part) {
    for (int64_t j = 0; j < N; j++) gb[j] = part[j];
    for (int64_t r = 1; r < nr; r++)
      for (int64_t j = 0; j < N; j++) gb[j] += part[r * N + j];
    free(part);
  }
}

// ---- convolution: im2col + a packed GEMM micro-kernel --------------------------------------------------------
// Per image and group, convolution is three GEMMs over the columns col (K, P), K = Cg*kh*kw rows
// (c, ki, kj) and P = OH*OW columns (oh, ow):
//   forward      y (Og, P)  = w (Og, K) @ col (K, P)
//   input grad   gcol (K, P) = w^T (K, Og) @ gy (Og, P), then col2im adds gcol back into gx
//   weight grad  gw (Og, K) += gy (Og, P) @ col^T (P, K)
// These GEMMs are small and oddly shaped (K = 9 or 288, Og = 32 or 64), where OpenBLAS reaches
// ~65% of peak and pays for packing on every call. Here operands are packed once into the
// micro-kernel's layout -- im2col writes its columns straight into it -- and a 4x24 AVX2/FMA
// micro-kernel runs near peak. Images are split across OpenMP threads, each with its own scratch.
//   packed A: [ceil(M/4)][K][4]    (4 rows of A, interleaved along K)
//   packed B: [ceil(N/24)][K][24]  (24 columns of B, interleaved along K)

#define MR 4
#define NR 24
#define MR6 6   // the rows of attention's AVX2 tiles (micro_kernel6x16_avx2)
#define KC 256  // K block: a packed B panel (KC x NR) stays in L1

#include <immintrin.h>
// The micro-kernels come in portable C, AVX2/FMA and AVX-512; each copy of this file (one per ISA
// level, cpu.h) compiles those of its level, FSDP_ISA_BUILD, and the copy that runs is the one of
// fsdp_cpu_isa_level() (the CPU's ISA, capped by FSDP_CPU_ISA).
#if FSDP_ISA_BUILD >= FSDP_ISA_AVX2
// C (mr, 8*nv) = (accumulate ? C : 0) + A (mr, k) @ Bp (k, 8*nv): row r of A at a[r], its elements acs
// apart (packed A: a[r] = Ap + r, acs = 4; a row-major matrix: rows lda apart, acs = 1; its transpose:
// a[r] = A + r, acs = lda). mr (4 or 6 rows) and nv (2 or 3 vectors of 8 columns) are constants at each
// call, so the accumulator arrays live in registers: 4x24 (12 accumulators) for the convolutions, 6x16
// (12) for attention's tiles. The empty asm pins each B vector in a register: 12 accumulators, 3 B
// vectors and a broadcast fill all 16 ymm registers, and GCC would otherwise fold B's loads into the
// FMAs (16 loads per 12 FMAs instead of 7), which made the kernel load-bound: Winograd forward of
// 64-256 channels, one thread under FSDP_CPU_ISA=avx2 on a 2-core AMD EPYC family 25 model 17,
// 15.2-17.6 -> 11.8-13.1 ms.
static inline __attribute__((always_inline)) void micro_kernel_nv(int64_t k, const float* const a[], int64_t acs,
                                                                  const float* Bp, float* C, int64_t ldc,
                                                                  int accumulate, const int mr, const int nv) {
  __m256 c[MR6][3], b[3];  // up to 6 rows (mr <= MR6)
  for (int r = 0; r < mr; r++)
    for (int j = 0; j < nv; j++) c[r][j] = _mm256_setzero_ps();
  for (int64_t i = 0, o = 0; i < k; i++, o += acs) {
    for (int j = 0; j < nv; j++) {
      b[j] = _mm256_loadu_ps(Bp + 8 * j);
      __asm__("" : "+x"(b[j]));
    }
    for (int r = 0; r < mr; r++) {
      __m256 x = _mm256_broadcast_ss(a[r] + o);
      for (int j = 0; j < nv; j++) c[r][j] = _mm256_fmadd_ps(x, b[j], c[r][j]);
    }
    Bp += 8 * nv;
  }
  for (int r = 0; r < mr; r++) {
    float* cr = C + r * ldc;
    for (int j = 0; j < nv; j++) {
      __m256 v = c[r][j];
      if (accumulate) v = _mm256_add_ps(v, _mm256_loadu_ps(cr + 8 * j));
      _mm256_storeu_ps(cr + 8 * j, v);
    }
  }
}
#endif
// the portable micro-kernel: the same product, nr columns, in plain C
static inline void micro_kernel_nr(int64_t k, const float* const a[MR], int64_t acs, const float* Bp, float* C,
                                   int64_t ldc, int accumulate, int nr) {
  float acc[MR][NR] = {{0}};
  for (int64_t i = 0; i < k; i++, Bp += nr)
    for (int r = 0; r < MR; r++)
      for (int j = 0; j < nr; j++) acc[r][j] += a[r][i * acs] * Bp[j];
  for (int r = 0; r < MR; r++)
    for (int j = 0; j < nr; j++) C[r * ldc + j] = (accumulate ? C[r * ldc + j] : 0.0f) + acc[r][j];
}
#if FSDP_ISA_BUILD >= FSDP_ISA_AVX2
static void micro_kernel_avx2(int64_t k, const float* const a[MR], int64_t acs, const float* Bp, float* C, int64_t ldc,
                              int accumulate) {
  micro_kernel_nv(k, a, acs, Bp, C, ldc, accumulate, MR, NR / 8);
}
// attention's AVX2 tile: 6 rows of 16 columns, 12 accumulators (4x16 kept 8, with 6 loads per 8 FMAs):
// causal attention (8, 6, 256, 64) forward + backward, one thread under the AVX2 cap on a 2-core AMD
// EPYC family 25 model 17, 9.7-13.4 + 16.4-21.6 -> 9.2-9.4 + 15.0-15.5 ms
static inline void micro_kernel6x16_avx2(int64_t k, const float* const a[MR6], int64_t acs, const float* Bp, float* C,
                                         int64_t ldc, int accumulate) {
  micro_kernel_nv(k, a, acs, Bp, C, ldc, accumulate, MR6, 2);
}
#endif
// the 4x24 tile of the convolutions
static void micro_kernel(int64_t k, const float* const a[MR], int64_t acs, const float* Bp, float* C, int64_t ldc,
                         int accumulate) {
#if FSDP_ISA_BUILD >= FSDP_ISA_AVX2
  micro_kernel_avx2(k, a, acs, Bp, C, ldc, accumulate);
#else
  micro_kernel_nr(k, a, acs, Bp, C, ldc, accumulate, NR);
#endif
}
// the 16-wide panel of attention's tiles (head widths and sequence lengths are multiples of 16, not
// 24): 6 rows with AVX2 (MR6), 4 in portable C (AVX-512's tiles are 8 rows, below)
static inline void micro_kernel16(int64_t k, const float* const a[], int64_t acs, const float* Bp, float* C,
                                  int64_t ldc, int accumulate) {
#if FSDP_ISA_BUILD >= FSDP_ISA_AVX2
  micro_kernel6x16_avx2(k, a, acs, Bp, C, ldc, accumulate);
#else
  micro_kernel_nr(k, a, acs, Bp, C, ldc, accumulate, 16);
#endif
}

// With AVX-512 one register holds a whole 16-wide panel row, so a 4-row tile would keep only 4
// accumulators, too few to cover the FMA latency of two FMA units: attention's tiles are 8 rows
// tall there (MR8), 8 accumulators of 16 lanes, twice the AVX2 kernel's work per instruction.
#define MR8 8
#if FSDP_ISA_BUILD >= FSDP_ISA_AVX512
// C (8, 16) = (accumulate ? C : 0) + A (8, k) @ Bp (k, 16), rows of A as in micro_kernel_nv
static void micro_kernel8x16_avx512(int64_t k, const float* const a[MR8], int64_t acs, const float* Bp, float* C,
                                    int64_t ldc, int accumulate) {
  __m512 c[MR8];
  for (int r = 0; r < MR8; r++) c[r] = _mm512_setzero_ps();
  for (int64_t i = 0, o = 0; i < k; i++, o += acs) {
    __m512 b = _mm512_loadu_ps(Bp);
    for (int r = 0; r < MR8; r++) c[r] = _mm512_fmadd_ps(_mm512_set1_ps(a[r][o]), b, c[r]);
    Bp += 16;
  }
  for (int r = 0; r < MR8; r++) {
    float* cr = C + r * ldc;
    _mm512_storeu_ps(cr, accumulate ? _mm512_add_ps(c[r], _mm512_loadu_ps(cr)) : c[r]);
  }
}

// C (8, 32) = (accumulate ? C : 0) + A (8, k) @ [B0 B1] (k, 32): two 16-wide panels side by side, 16
// accumulators, each broadcast of A feeding two FMAs. One thread, data in L1, a 2-core Xeon family 6
// model 143: 8x16 tiles 165-180 GFLOP/s, 8x32 195-205 (k = 64 and 256).
static void micro_kernel8x32_avx512(int64_t k, const float* const a[MR8], int64_t acs, const float* B0, const float* B1,
                                    float* C, int64_t ldc, int accumulate) {
  __m512 c[MR8][2];
  for (int r = 0; r < MR8; r++) c[r][0] = c[r][1] = _mm512_setzero_ps();
  for (int64_t i = 0, o = 0; i < k; i++, o += acs) {
    __m512 b0 = _mm512_loadu_ps(B0), b1 = _mm512_loadu_ps(B1);
    for (int r = 0; r < MR8; r++) {
      __m512 x = _mm512_set1_ps(a[r][o]);
      c[r][0] = _mm512_fmadd_ps(x, b0, c[r][0]);
      c[r][1] = _mm512_fmadd_ps(x, b1, c[r][1]);
    }
    B0 += 16;
    B1 += 16;
  }
  for (int r = 0; r < MR8; r++) {
    float* cr = C + r * ldc;
    _mm512_storeu_ps(cr, accumulate ? _mm512_add_ps(c[r][0], _mm512_loadu_ps(cr)) : c[r][0]);
    _mm512_storeu_ps(cr + 16, accumulate ? _mm512_add_ps(c[r][1], _mm512_loadu_ps(cr + 16)) : c[r][1]);
  }
}
#endif

// C (M, N) = (accumulate ? C : 0) + A (M, K) @ B (K, N) from packed A and B
static void gemm_packed(int64_t M, int64_t N, int64_t K, const float* Ap, const float* Bp, float* C, int64_t ldc,
                        int accumulate) {
  float edge[MR * NR];
  for (int64_t k0 = 0; k0 < K; k0 += KC) {
    int64_t kc = K - k0 < KC ? K - k0 : KC;
    int acc = accumulate || k0 > 0;
    for (int64_t n0 = 0; n0 < N; n0 += NR) {
      const float* bp = Bp + n0 * K + k0 * NR;  // panel n0/NR, rows k0..
      int64_t nn = N - n0 < NR ? N - n0 : NR;
      for (int64_t m0 = 0; m0 < M; m0 += MR) {
        const float* ap = Ap + m0 * K + k0 * MR;
        int64_t mm = M - m0 < MR ? M - m0 : MR;
        float* c = C + m0 * ldc + n0;
        const float* a[MR] = {ap, ap + 1, ap + 2, ap + 3};
        if (mm == MR && nn == NR) {
          micro_kernel(kc, a, MR, bp, c, ldc, acc);
          continue;
        }
        for (int64_t r = 0; r < mm; r++)  // partial tile: go through a full-size buffer
          for (int64_t j = 0; j < nn; j++) edge[r * NR + j] = acc ? c[r * ldc + j] : 0.0f;
        micro_kernel(kc, a, MR, bp, edge, NR, 1);
        for (int64_t r = 0; r < mm; r++)
          for (int64_t j = 0; j < nn; j++) c[r * ldc + j] = edge[r * NR + j];
      }
    }
  }
}

// sum of x[0..n): 8 float lanes (vectorized), added up at the end
static inline float sum_f32(const float* x, int64_t n) {
  float s = 0.0f;
#pragma omp simd reduction(+ : s)
  for (int64_t i = 0; i < n; i++) s += x[i];
  return s;
}

static int64_t round_up(int64_t n, int64_t m) { return (n + m - 1) / m * m; }

// packs A (M, K), element (i, k) at src[i*rs + k*cs], into [ceil(M/4)][K][4] (zero rows past M)
static void pack_a(float* Ap, const float* src, int64_t rs, int64_t cs, int64_t M, int64_t K) {
  for (int64_t m0 = 0; m0 < M; m0 += MR) {
    float* d = Ap + m0 * K;
    if (m0 + MR <= M) {
      for (int64_t r = 0; r < MR; r++) {
        const float* s = src + (m0 + r) * rs;
        for (int64_t k = 0; k < K; k++) d[k * MR + r] = s[k * cs];
      }
    } else {
      for (int64_t k = 0; k < K; k++)
        for (int64_t r = 0; r < MR; r++) d[k * MR + r] = m0 + r < M ? src[(m0 + r) * rs + k * cs] : 0.0f;
    }
  }
}

#if FSDP_ISA_BUILD >= FSDP_ISA_AVX2
// d[k*ldd + j] = alpha * s[j*lds + k] for j, k < 8: an 8x8 block transposed in registers
static inline void transpose8_scaled(float* d, int64_t ldd, const float* s, int64_t lds, float alpha) {
  __m256 r0 = _mm256_loadu_ps(s), r1 = _mm256_loadu_ps(s + lds), r2 = _mm256_loadu_ps(s + 2 * lds);
  __m256 r3 = _mm256_loadu_ps(s + 3 * lds), r4 = _mm256_loadu_ps(s + 4 * lds), r5 = _mm256_loadu_ps(s + 5 * lds);
  __m256 r6 = _mm256_loadu_ps(s + 6 * lds), r7 = _mm256_loadu_ps(s + 7 * lds);
  __m256 t0 = _mm256_unpacklo_ps(r0, r1), t1 = _mm256_unpackhi_ps(r0, r1), t2 = _mm256_unpacklo_ps(r2, r3);
  __m256 t3 = _mm256_unpackhi_ps(r2, r3), t4 = _mm256_unpacklo_ps(r4, r5), t5 = _mm256_unpackhi_ps(r4, r5);
  __m256 t6 = _mm256_unpacklo_ps(r6, r7), t7 = _mm256_unpackhi_ps(r6, r7);
  __m256 u0 = _mm256_shuffle_ps(t0, t2, 0x44), u1 = _mm256_shuffle_ps(t0, t2, 0xee);
  __m256 u2 = _mm256_shuffle_ps(t1, t3, 0x44), u3 = _mm256_shuffle_ps(t1, t3, 0xee);
  __m256 u4 = _mm256_shuffle_ps(t4, t6, 0x44), u5 = _mm256_shuffle_ps(t4, t6, 0xee);
  __m256 u6 = _mm256_shuffle_ps(t5, t7, 0x44), u7 = _mm256_shuffle_ps(t5, t7, 0xee);
  __m256 a = _mm256_set1_ps(alpha);
  _mm256_storeu_ps(d + 0 * ldd, _mm256_mul_ps(a, _mm256_permute2f128_ps(u0, u4, 0x20)));
  _mm256_storeu_ps(d + 1 * ldd, _mm256_mul_ps(a, _mm256_permute2f128_ps(u1, u5, 0x20)));
  _mm256_storeu_ps(d + 2 * ldd, _mm256_mul_ps(a, _mm256_permute2f128_ps(u2, u6, 0x20)));
  _mm256_storeu_ps(d + 3 * ldd, _mm256_mul_ps(a, _mm256_permute2f128_ps(u3, u7, 0x20)));
  _mm256_storeu_ps(d + 4 * ldd, _mm256_mul_ps(a, _mm256_permute2f128_ps(u0, u4, 0x31)));
  _mm256_storeu_ps(d + 5 * ldd, _mm256_mul_ps(a, _mm256_permute2f128_ps(u1, u5, 0x31)));
  _mm256_storeu_ps(d + 6 * ldd, _mm256_mul_ps(a, _mm256_permute2f128_ps(u2, u6, 0x31)));
  _mm256_storeu_ps(d + 7 * ldd, _mm256_mul_ps(a, _mm256_permute2f128_ps(u3, u7, 0x31)));
}
#endif

// packs alpha * B (K, N), element (k, j) at src[k*rs + j*cs], into [ceil(N/nr)][K][nr] panels (zero
// columns past N); nr is NR (24) for the convolutions and TILES_NR (16) for attention
static inline void pack_b(float* Bp, const float* src, int64_t rs, int64_t cs, int64_t K, int64_t N, float alpha,
                          int64_t nr) {
  for (int64_t n0 = 0; n0 < N; n0 += nr) {
    int64_t nn = N - n0 < nr ? N - n0 : nr;
    float* d = Bp + n0 * K;
    if (nn == nr && cs == 1 && alpha == 1.0f) {
      for (int64_t k = 0; k < K; k++) memcpy(d + k * nr, src + k * rs + n0, nr * sizeof(float));  // inlined
    } else if (nn == nr && cs == 1) {
      for (int64_t k = 0; k < K; k++)
        for (int64_t j = 0; j < nr; j++) d[k * nr + j] = alpha * src[k * rs + n0 + j];
    } else if (cs == 1) {
      for (int64_t k = 0; k < K; k++) {
        for (int64_t j = 0; j < nn; j++) d[k * nr + j] = alpha * src[k * rs + n0 + j];
        for (int64_t j = nn; j < nr; j++) d[k * nr + j] = 0.0f;
      }
    } else {  // columns of B are rows of src (B = X^T, as k^T in q k^T): read each one along k
      int64_t j0 = 0, k8 = 0;
#if FSDP_ISA_BUILD >= FSDP_ISA_AVX2
      if (rs == 1) {  // rows of src contiguous: 8x8 blocks in registers
        k8 = K / 8 * 8;
        for (; j0 + 8 <= nn; j0 += 8)
          for (int64_t k = 0; k < k8; k += 8)
            transpose8_scaled(d + k * nr + j0, nr, src + (n0 + j0) * cs + k, cs, alpha);
      }
#endif
      for (int64_t j = 0; j < nr; j++) {
        const float* s = src + (n0 + j) * cs;
        int64_t from = j < j0 ? k8 : 0;  // the blocks did k < k8 of the first j0 columns
        if (j < nn)
          for (int64_t k = from; k < K; k++) d[k * nr + j] = alpha * s[k * rs];
        else
          for (int64_t k = 0; k < K; k++) d[k * nr + j] = 0.0f;
      }
    }
  }
}

// ---- small GEMMs with causal limits: attention's products ----------------------------------------------------
// n independent products C = alpha op(A) op(B) (C is overwritten: beta is 0), one per batch matrix
// and head, so each is small: op(B) is packed once per product (alpha folded in) and stays in
// L2, op(A) is read in place by the micro-kernel (rows or, transposed, columns: no packing). The
// threads take whole products. limits[i] skips what causal self-attention (query i sees key j <= i;
// T queries, T keys) knows to be zero, per tile of C holding rows [m0, m1) (6 rows with AVX2, 8 with
// AVX-512, 4 in portable C):
//   FSDP_TILES_COLS_TO_ROW  columns j < m1 only (scores q k^T, dP = dO v^T); the later columns are
//                           set to 0
//   FSDP_TILES_K_TO_ROW     k < m1 only (O = P v, dQ = dS k: P and dS are 0 past the diagonal)
//   FSDP_TILES_K_FROM_ROW   k >= m0 only (dV = P^T dO, dK = dS^T q: P^T and dS^T are 0 before it)
// Blocked for the caches as a Goto GEMM without packing A: per KC-deep slice of k and MC-tall block
// of rows (A's block stays in L2), each 16-wide micro-panel of packed B (in L1) meets the block's
// row tiles. A tile's first slice overwrites it, the later ones add. Panels are 16 wide, not the
// convolutions' 24: heads are 64 wide and sequences multiples of 16, so no panel is partial, and the
// causal diagonal wastes 16-wide steps instead of 24 (single-head products 1.2-1.4x faster). With
// AVX-512 a tile takes two adjacent panels at once (8x32) wherever it needs both whole, else one.
#define TILES_MC 128
#define TILES_NR 16
#define TILES_BLAS_MIN (1 << 21)  // multiply-adds per full product from which OpenBLAS runs it instead

static void gemm_tiles_one(const fsdp_gemm_args* g, int limits, float* Bp) {
  int64_t M = g->M, N = g->N, K = g->K, ldc = g->ldc;
  const int wide = FSDP_ISA_BUILD >= FSDP_ISA_AVX512;
  int64_t mr = wide ? MR8 : (FSDP_ISA_BUILD >= FSDP_ISA_AVX2 ? MR6 : MR);  // the tile's height
  int64_t mc = TILES_MC / mr * mr;                                         // a block of rows: whole tiles
  int64_t step = wide ? 2 * TILES_NR : TILES_NR;  // AVX-512: two panels per tile where both are needed
  if (K == 0) {                                   // an empty sum
    for (int64_t i = 0; i < M; i++) memset(g->C + i * ldc, 0, N * sizeof(float));
    return;
  }
  pack_b(Bp, g->B, g->tb ? 1 : g->ldb, g->tb ? g->ldb : 1, K, N, g->alpha, TILES_NR);  // op(B) (k, j)
  int64_t ars = g->ta ? 1 : g->lda, acs = g->ta ? g->lda : 1;  // op(A) (i, k) at A[i*ars + k*acs]
  float edge[MR8 * TILES_NR];
  for (int64_t k0 = 0; k0 < K; k0 += KC) {
    int64_t k1 = K - k0 < KC ? K : k0 + KC;
    for (int64_t mb = 0; mb < M; mb += mc) {
      int64_t mbe = M - mb < mc ? M : mb + mc;
      for (int64_t n0 = 0; n0 < N; n0 += step) {
        for (int64_t m0 = mb; m0 < mbe; m0 += mr) {
          int64_t mm = mbe - m0 < mr ? mbe - m0 : mr, m1 = m0 + mm;
          int64_t n1 = N - n0 < step ? N : n0 + step;  // the columns [n0, n1) of this step's panels
          if (limits == FSDP_TILES_COLS_TO_ROW && n1 > round_up(m1, TILES_NR)) n1 = round_up(m1, TILES_NR);
          if (n1 <= n0) continue;  // COLS_TO_ROW: only the panels holding columns j < m1
          int64_t klo = limits == FSDP_TILES_K_FROM_ROW ? (m0 < K ? m0 : K) : 0;
          int64_t khi = limits == FSDP_TILES_K_TO_ROW ? (m1 < K ? m1 : K) : K;
          klo = klo > k0 ? klo : k0;  // this slice's part of the tile's k range
          khi = khi < k1 ? khi : k1;
          if (khi <= klo) continue;
          int acc = klo > (limits == FSDP_TILES_K_FROM_ROW ? m0 : 0);  // not the tile's first slice
          const float* a[MR8];  // rows past M repeat the last one (their results are dropped)
          for (int r = 0; r < mr; r++) a[r] = g->A + (m0 + (r < mm ? r : mm - 1)) * ars + klo * acs;
#if FSDP_ISA_BUILD >= FSDP_ISA_AVX512
          if (mm == mr && n1 - n0 == 2 * TILES_NR) {  // both panels whole: one 8x32 tile
            const float* bp = Bp + n0 * K + klo * TILES_NR;
            micro_kernel8x32_avx512(khi - klo, a, acs, bp, bp + TILES_NR * K, g->C + m0 * ldc + n0, ldc, acc);
            continue;
          }
#endif
          for (int64_t p0 = n0; p0 < n1; p0 += TILES_NR) {  // one panel at a time
            int64_t nn = n1 - p0 < TILES_NR ? n1 - p0 : TILES_NR;
            float* c = g->C + m0 * ldc + p0;
            int full = mm == mr && nn == TILES_NR;
            if (!full)  // partial tile: through a full-size buffer
              for (int64_t r = 0; r < mm; r++)
                for (int64_t j = 0; j < nn; j++) edge[r * TILES_NR + j] = acc ? c[r * ldc + j] : 0.0f;
            const float* bp = Bp + p0 * K + klo * TILES_NR;
#if FSDP_ISA_BUILD >= FSDP_ISA_AVX512
            micro_kernel8x16_avx512(khi - klo, a, acs, bp, full ? c : edge, full ? ldc : TILES_NR, full ? acc : 1);
#else
            micro_kernel16(khi - klo, a, acs, bp, full ? c : edge, full ? ldc : TILES_NR, full ? acc : 1);
#endif
            if (!full)
              for (int64_t r = 0; r < mm; r++) memcpy(c + r * ldc, edge + r * TILES_NR, nn * sizeof(float));
          }
        }
      }
    }
  }
  if (limits == FSDP_TILES_COLS_TO_ROW)  // columns no tile wrote
    for (int64_t m0 = 0; m0 < M; m0 += mr) {
      int64_t m1 = M - m0 < mr ? M : m0 + mr, from = round_up(m1, TILES_NR) < N ? round_up(m1, TILES_NR) : N;
      for (int64_t i = m0; i < m1; i++) memset(g->C + i * ldc + from, 0, (N - from) * sizeof(float));
    }
}

static int cpu_gemm_tiles(int n, const fsdp_gemm_args* g, const int* limits) {
  int64_t need = 1;
  double work = 0;
  int all = 1;
  for (int i = 0; i < n; i++) {
    int64_t s = g[i].K * round_up(g[i].N, TILES_NR);
    need = s > need ? s : need;
    work += (double)g[i].M * g[i].N * g[i].K;
    all = all && limits[i] == FSDP_TILES_ALL;
  }
  if (all && work >= (double)n * TILES_BLAS_MIN) {  // big full products: OpenBLAS's packed A wins (T >= 512)
    fsdp_cpu_gemm_many(n, g);
    return 0;
  }
  int nt = omp_in_parallel() || work < FSDP_CPU_GEMM_PAR_MIN ? 1 : omp_get_max_threads(), failed = 0;
#pragma omp parallel num_threads(nt) reduction(| : failed)
  {
    float* Bp = aligned_alloc(64, round_up(need * sizeof(float), 64));  // this thread's packed B
    failed = !Bp;
#pragma omp for schedule(dynamic, 1)
    for (int i = 0; i < n; i++)
      if (Bp && g[i].M > 0 && g[i].N > 0) gemm_tiles_one(&g[i], limits[i], Bp);
    free(Bp);
  }
  if (failed) fsdp_errorf("attention: out of memory for packed operands (%lld floats per thread)", (long long)need);
  return failed ? -1 : 0;
}

// one row (c, ki, kj) of the columns: row[p] for p = (oh, ow), from the input plane x (H, W)
static void im2col_row(float* row, const float* x, const fsdp_conv_geom* g, int ki, int kj) {
  int64_t H = g->H, W = g->W, OH = g->OH, OW = g->OW;
  int64_t off_w = (int64_t)kj * g->dw - g->pw;
  // ow range whose iw = ow*sw + off_w lies in [0, W)
  int64_t lo = off_w >= 0 ? 0 : (-off_w + g->sw - 1) / g->sw;
  int64_t hi = W - off_w <= 0 ? 0 : (W - off_w + g->sw - 1) / g->sw;
  if (hi > OW) hi = OW;
  if (lo > hi) lo = hi;
  if (g->sh == 1 && g->sw == 1 && OW == W) {
    // stride 1 and output rows as wide as input rows (3x3 with padding 1): over its valid rows the
    // im2col row is the plane shifted by one offset -- one long copy, then the few out-of-range
    // columns (iw < 0 or iw >= W) set to zero
    int64_t HW = H * W, P = OH * OW, shift = ((int64_t)ki * g->dh - g->ph) * W + off_w;
    int64_t oh0 = g->ph - (int64_t)ki * g->dh, oh1 = H + oh0;  // rows with ih in [0, H)
    oh0 = oh0 < 0 ? 0 : (oh0 > OH ? OH : oh0);
    oh1 = oh1 < oh0 ? oh0 : (oh1 > OH ? OH : oh1);
    int64_t a = oh0 * W, b = oh1 * W;
    int64_t ca = a + shift < 0 ? -shift : a, cb = b + shift > HW ? HW - shift : b;  // stay inside the plane
    if (cb < ca) cb = ca;
    for (int64_t p = 0; p < ca; p++) row[p] = 0.0f;
    for (int64_t p = ca; p < cb; p++) row[p] = x[p + shift];
    for (int64_t p = cb; p < P; p++) row[p] = 0.0f;
    if (lo > 0 || hi < OW)
      for (int64_t oh = oh0; oh < oh1; oh++) {
        float* r = row + oh * OW;
        for (int64_t ow = 0; ow < lo; ow++) r[ow] = 0.0f;
        for (int64_t ow = hi; ow < OW; ow++) r[ow] = 0.0f;
      }
    return;
  }
  for (int64_t oh = 0; oh < OH; oh++) {
    float* r = row + oh * OW;
    int64_t ih = oh * g->sh - g->ph + (int64_t)ki * g->dh;
    if (ih < 0 || ih >= H) {
      memset(r, 0, OW * sizeof(float));
      continue;
    }
    const float* xr = x + ih * W + off_w;
    for (int64_t ow = 0; ow < lo; ow++) r[ow] = 0.0f;
    if (g->sw == 1)
      for (int64_t ow = lo; ow < hi; ow++) r[ow] = xr[ow];  // short rows: a loop beats memcpy
    else
      for (int64_t ow = lo; ow < hi; ow++) r[ow] = xr[ow * g->sw];
    for (int64_t ow = hi; ow < OW; ow++) r[ow] = 0.0f;
  }
}

// the columns (K, P) of one group of one image x (Cg, H, W), packed as GEMM operand B of the
// forward ([P/24][K][24]); `row` is P floats of scratch
static void im2col_pack_fwd(float* Bp, float* row, const float* x, const fsdp_conv_geom* g, int64_t Cg) {
  int64_t HW = g->H * g->W, P = g->OH * g->OW, K = Cg * g->kh * g->kw;
  for (int64_t c = 0, k = 0; c < Cg; c++)
    for (int ki = 0; ki < g->kh; ki++)
      for (int kj = 0; kj < g->kw; kj++, k++) {
        im2col_row(row, x + c * HW, g, ki, kj);
        int64_t p0 = 0;
        for (; p0 + NR <= P; p0 += NR) memcpy(Bp + p0 * K + k * NR, row + p0, NR * sizeof(float));  // inlined
        if (p0 < P) {
          float* d = Bp + p0 * K + k * NR;
          for (int64_t j = 0; j < NR; j++) d[j] = p0 + j < P ? row[p0 + j] : 0.0f;
        }
      }
}

// the transposed columns col^T (P, K), packed as operand B of the weight gradient ([K/24][P][24]);
// rows are built 24 at a time into `rows` (24*P floats) and interleaved with sequential writes
static void im2col_pack_wgrad(float* Bp, float* rows, const float* x, const fsdp_conv_geom* g, int64_t Cg) {
  int64_t HW = g->H * g->W, P = g->OH * g->OW, K = Cg * g->kh * g->kw, khw = (int64_t)g->kh * g->kw;
  for (int64_t k0 = 0; k0 < K; k0 += NR) {
    int64_t nk = K - k0 < NR ? K - k0 : NR;
    for (int64_t j = 0; j < nk; j++) {
      int64_t k = k0 + j, c = k / khw, kk = k % khw;
      im2col_row(rows + j * P, x + c * HW, g, (int)(kk / g->kw), (int)(kk % g->kw));
    }
    float* d = Bp + k0 * P;
    if (nk == NR) {
      for (int64_t p = 0; p < P; p++)
        for (int64_t j = 0; j < NR; j++) d[p * NR + j] = rows[j * P + p];
    } else {
      for (int64_t p = 0; p < P; p++)
        for (int64_t j = 0; j < NR; j++) d[p * NR + j] = j < nk ? rows[j * P + p] : 0.0f;
    }
  }
}

// x (H, W) += the kh*kw rows of col (row (ki, kj) at col + (ki*kw + kj)*P) scattered back
// (col is scratch: the fast path zeroes its out-of-range columns)
static void col2im_channel(float* x, float* col, const fsdp_conv_geom* g) {
  int64_t H = g->H, W = g->W, OH = g->OH, OW = g->OW;
  for (int ki = 0; ki < g->kh; ki++)
    for (int kj = 0; kj < g->kw; kj++) {
      float* row = col + (int64_t)(ki * g->kw + kj) * OH * OW;
      int64_t off_w = (int64_t)kj * g->dw - g->pw;
      int64_t lo = off_w >= 0 ? 0 : (-off_w + g->sw - 1) / g->sw;
      int64_t hi = W - off_w <= 0 ? 0 : (W - off_w + g->sw - 1) / g->sw;
      if (hi > OW) hi = OW;
      if (lo > hi) lo = hi;
      if (g->sh == 1 && g->sw == 1 && OW == W) {
        // as in im2col_row: over the valid rows the plane takes the row shifted by one offset, so
        // zero the row's out-of-range columns and add it in one long run
        int64_t HW = H * W, shift = ((int64_t)ki * g->dh - g->ph) * W + off_w;
        int64_t oh0 = g->ph - (int64_t)ki * g->dh, oh1 = H + oh0;
        oh0 = oh0 < 0 ? 0 : (oh0 > OH ? OH : oh0);
        oh1 = oh1 < oh0 ? oh0 : (oh1 > OH ? OH : oh1);
        if (lo > 0 || hi < OW)
          for (int64_t oh = oh0; oh < oh1; oh++) {
            for (int64_t ow = 0; ow < lo; ow++) row[oh * OW + ow] = 0.0f;
            for (int64_t ow = hi; ow < OW; ow++) row[oh * OW + ow] = 0.0f;
          }
        int64_t a = oh0 * W, b = oh1 * W;
        int64_t ca = a + shift < 0 ? -shift : a, cb = b + shift > HW ? HW - shift : b;
        for (int64_t p = ca; p < cb; p++) x[p + shift] += row[p];
        continue;
      }
      for (int64_t oh = 0; oh < OH; oh++) {
        int64_t ih = oh * g->sh - g->ph + (int64_t)ki * g->dh;
        if (ih < 0 || ih >= H) continue;
        const float* r = row + oh * OW;
        float* xr = x + ih * W + off_w;
        if (g->sw == 1)
          for (int64_t ow = lo; ow < hi; ow++) xr[ow] += r[ow];
        else
          for (int64_t ow = lo; ow < hi; ow++) xr[ow * g->sw] += r[ow];
      }
    }
}

// threads for a convolution: images split across them when there are enough images and work
static int conv_threads(const fsdp_conv_geom* g) {
  int t = omp_get_max_threads();
  int64_t flops = g->N * g->O * g->OH * g->OW * (g->C / g->groups) * g->kh * g->kw;
  return (t > g->N || flops < 262144) ? 1 : t;
}

// ---- convolution: Winograd F(2x2, 3x3) ---------------------------------------------------------------------------
// For a 3x3 kernel with stride 1, dilation 1, padding 1 (same-size output) and one group, the output
// is cut into 2x2 tiles, each computed from a 4x4 input tile (tiles overlap by 2):
//   y_tile = A^T [ sum_c (G g G^T) .* (B^T d B) ] A
// The 16 element-wise products, summed over the input channels, are 16 GEMMs
//   M[pos] (O, T) = U[pos] (O, C) @ V[pos] (C, T)      pos = 0..15, T = tiles
// with 16*O*C*T multiply-adds instead of the direct product's 36*O*C*T: 2.25x fewer. Rounding differs
// from direct convolution by a few ulps (the transforms only add, subtract and halve).
//   B^T = [1 0 -1 0; 0 1 1 0; 0 -1 1 0; 0 1 0 -1]   G = [1 0 0; .5 .5 .5; .5 -.5 .5; 0 0 1]
//   A^T = [1 1 1 0; 0 1 -1 -1]
// Tiles run over all images, t = (n, th, tw), in blocks of up to WINO_TB (a multiple of NR: wino_split_tiles);
// a thread takes a block at a time: input transform straight into the 16 packed B operands, 16 packed
// GEMMs, output transform into y. The input gradient of the same convolution is a same-padding
// correlation of gy with the channel-transposed, 180-degree-rotated weights, so it goes through the
// same routine; the weight gradient is the forward's adjoint (wino_wgrad). On the benchmark's
// Conv(32->64) at batch 64 (1 thread) the forward, input gradient and weight gradient each take
// ~0.6-0.75x the im2col path's time.
#define WINO_TB 96
#define WINO_PAD 16  // floats between the 16 operands of a block: 4 KiB multiples apart, they share cache sets

// how a Winograd pass over N images of H x W splits its T tiles: nt threads (one for a small pass) take
// blocks of tb tiles, up to WINO_TB and a multiple of NR, sized so that the blocks come out as a
// multiple of the threads -- 256 channels at 14x14, batch 8, are 392 tiles: 5 blocks of 96 kept one of
// two threads waiting a fifth of the time, 6 of 72 do not
typedef struct {
  int64_t T, tb, nblocks;
  int nt;
} wino_split;
static wino_split wino_split_tiles(int64_t N, int64_t Ci, int64_t Co, int64_t H, int64_t W) {
  wino_split p = {N * ((H + 1) / 2) * ((W + 1) / 2), 0, 0, omp_get_max_threads()};
  if (16 * Co * Ci * p.T < 262144) p.nt = 1;
  int64_t per = (p.T + p.nt * WINO_TB - 1) / (p.nt * WINO_TB), blocks = p.nt * per;  // blocks per thread, blocks
  p.tb = round_up((p.T + blocks - 1) / blocks, NR);
  p.nblocks = (p.T + p.tb - 1) / p.tb;
  if (p.nt > p.nblocks) p.nt = (int)p.nblocks;
  return p;
}

// smaller convolutions stay with im2col: measured (28x28, batch 64, forward + backward), Winograd wins from
// 16 in and 16 out channels, ties at 12, and loses below (a first layer on 1-3 channels badly)
#define WINO_MIN_CHANNELS 16

// FSDP_CONV_ALGO=im2col|winograd forces one of our paths (where Winograd is valid), ours lets us
// choose between them, unset (or direct: oneDNN without its Winograd) runs the convolutions through
// oneDNN (onednn.c); read
// on each call (a getenv is nothing next to a convolution) so tests can switch it
enum { CONV_DEFAULT, CONV_DIRECT, CONV_IM2COL, CONV_WINOGRAD, CONV_OURS };
static int conv_algo(void) {
  const char* s = getenv("FSDP_CONV_ALGO");
  if (!s) return CONV_DEFAULT;
  if (!strcmp(s, "direct")) return CONV_DIRECT;
  if (!strcmp(s, "im2col")) return CONV_IM2COL;
  if (!strcmp(s, "winograd")) return CONV_WINOGRAD;
  if (!strcmp(s, "ours")) return CONV_OURS;
  return CONV_DEFAULT;
}
// whether FSDP_CONV_ALGO sends the float32 convolutions to one of our paths instead of oneDNN
static int ours_forced(void) { return conv_algo() >= CONV_IM2COL; }

// whether the convolution (its forward and its input and weight gradients) goes through Winograd
static int use_winograd(const fsdp_conv_geom* g) {
  if (g->kh != 3 || g->kw != 3 || g->sh != 1 || g->sw != 1 || g->dh != 1 || g->dw != 1 || g->ph != 1 || g->pw != 1 ||
      g->groups != 1 || g->N * g->H * g->W == 0)
    return 0;
  int algo = conv_algo();
  if (algo == CONV_IM2COL || algo == CONV_WINOGRAD) return algo == CONV_WINOGRAD;
  return g->C >= WINO_MIN_CHANNELS && g->O >= WINO_MIN_CHANNELS;
}

// Without AVX-512 oneDNN has no Winograd (its jit_wino_4x3 is AVX-512 code) and runs 3x3 layers
// direct; there ours beats it from 32 to 256 channels in and out. Measured under FSDP_CPU_ISA=avx2 on
// a 2-core AMD EPYC family 25 model 17, one thread, ms oneDNN direct -> ours (forward / input grad /
// weight grad): 64->64 at 56x56, batch 8: 22.6 -> 12.6 input grad, 26.6 -> 14.5 weight grad;
// 256->256 at 14x14: 19.4 -> 13.1 / 19.7 -> 13.7 / 21.1 -> 16.9; the conv net's 32->64 at 28x28,
// batch 64: 21.1 -> 16.3 / 19.0 -> 19.9 / 23.5 -> 19.2. Ours loses at 512->512 at 7x7 (24.4 -> 32.2
// forward: its 16 transformed kernels are 16 MB, and 7x7 planes waste a quarter of their 2x2 tiles).
// FSDP_CONV_ALGO=direct keeps oneDNN.
static int winograd_over_onednn(const fsdp_conv_geom* g) {
  return conv_algo() == CONV_DEFAULT && FSDP_ISA_BUILD == FSDP_ISA_AVX2 && g->C >= 32 && g->O >= 32 &&
         g->C * g->O <= 256 * 256 && use_winograd(g);
}

// the 16 transformed kernels U[pos] (Co, Ci) = (G k G^T)[pos], each packed as GEMM operand A
// ([ceil(Co/4)][Ci][4], at Up + pos*wino_us(Co, Ci)). The kernel k of (co, ci) is w[co][ci] of
// w (Co, Ci, 3, 3), or with `rot` (input gradient) w[ci][co] of w (Ci, Co, 3, 3) rotated 180 degrees.
// The 16 operands are WINO_PAD apart too: each kernel writes all 16, and 256 KiB apart (256 channels)
// they thrashed one cache set.
static int64_t wino_us(int64_t Co, int64_t Ci) { return round_up(Co, MR) * Ci + WINO_PAD; }
static void wino_weights(float* Up, const float* w, int64_t Co, int64_t Ci, int rot) {
  int64_t us = wino_us(Co, Ci);
  memset(Up, 0, (size_t)(16 * us) * sizeof(float));
#pragma omp parallel for if (Co * Ci >= 4096)
  for (int64_t co = 0; co < Co; co++)
    for (int64_t ci = 0; ci < Ci; ci++) {
      float k[3][3], t[4][3];
      const float* src = rot ? w + (ci * Co + co) * 9 : w + (co * Ci + ci) * 9;
      for (int i = 0; i < 9; i++) k[i / 3][i % 3] = rot ? src[8 - i] : src[i];
      for (int j = 0; j < 3; j++) {  // G k
        t[0][j] = k[0][j];
        t[1][j] = 0.5f * (k[0][j] + k[1][j] + k[2][j]);
        t[2][j] = 0.5f * (k[0][j] - k[1][j] + k[2][j]);
        t[3][j] = k[2][j];
      }
      float* d = Up + (co / MR) * Ci * MR + ci * MR + co % MR;
      for (int i = 0; i < 4; i++) {  // (G k) G^T
        d[(i * 4 + 0) * us] = t[i][0];
        d[(i * 4 + 1) * us] = 0.5f * (t[i][0] + t[i][1] + t[i][2]);
        d[(i * 4 + 2) * us] = 0.5f * (t[i][0] - t[i][1] + t[i][2]);
        d[(i * 4 + 3) * us] = t[i][2];
      }
    }
}

// input transform of channel c of tiles [t0, t0 + nt) of x (N, Ci, H, W): v[pos][j] (16, WINO_TB) =
// (B^T d B)[pos] of tile t0 + j's 4x4 input d (rows 2th-1.., columns 2tw-1.., zero outside the plane).
// One segment of a tile row at a time: its 4 input rows are split into their odd and even columns,
// e[i][m] = row i [2(tw0 + m) - 1] and o[i][m] = row i [2(tw0 + m)], so that tile m's four columns are
// e[m], o[m], e[m + 1], o[m + 1] and both transforms run along m in plain vector loops. `D` is scratch:
// 16*WINO_TB floats.
// Its rows are short (len <= W/2 tiles: 14 at 28x28), so its loops run 4 lanes wide even in the
// AVX2 and AVX-512 copies: 8 lanes wide, most of a row fell to the loops' scalar and half-width
// ends (the conv net's step on one thread, AMD EPYC family 23 model 1: 145 -> 140 ms, this function
// 15.5% -> 12.6% of its samples, as in the -march=native build, whose Zen 1 tuning chose 4 lanes).
__attribute__((target("prefer-vector-width=128"))) static void wino_input_channel(float* restrict v, float* restrict D,
                                                                                  const float* x, int64_t c, int64_t Ci,
                                                                                  int64_t H, int64_t W, int64_t t0,
                                                                                  int64_t nt) {
  int64_t TH = (H + 1) / 2, TW = (W + 1) / 2, HW = H * W, L = WINO_TB + 1;
  float *e = D, *o = D + 4 * L;  // e[i][m] at e + i*L + m, o likewise
  for (int64_t j = 0; j < nt;) {
    int64_t t = t0 + j, n = t / (TH * TW), r = t % (TH * TW), th = r / TW, tw0 = r % TW;
    int64_t len = TW - tw0 < nt - j ? TW - tw0 : nt - j;
    const float* xp = x + (n * Ci + c) * HW;
    for (int i = 0; i < 4; i++) {  // B^T's rows need d's odd and even columns: split them, zero outside
      int64_t ih = 2 * th - 1 + i;
      float *ei = e + i * L, *oi = o + i * L;
      if (ih < 0 || ih >= H) {
        memset(ei, 0, (size_t)(len + 1) * sizeof(float));
        memset(oi, 0, (size_t)(len + 1) * sizeof(float));
        continue;
      }
      const float* row = xp + ih * W + 2 * tw0;  // row[2m - 1] and row[2m]
      // columns 2(tw0 + m) - 1 and 2(tw0 + m) are inside for 0 < m < TW - tw0 (and m = 0 when tw0 > 0)
      int64_t m = 0, end = len + 1 < TW - tw0 ? len + 1 : TW - tw0;
      if (tw0 == 0) {  // column -1
        ei[0] = 0.0f;
        oi[0] = row[0];
        m = 1;
      }
      for (; m < end; m++) {
        ei[m] = row[2 * m - 1];
        oi[m] = row[2 * m];
      }
      for (; m <= len; m++) {  // past the right edge: an even width leaves one column in
        ei[m] = 2 * (tw0 + m) - 1 < W ? row[2 * m - 1] : 0.0f;
        oi[m] = 0.0f;
      }
    }
    for (int h = 0; h < 2; h++) {  // B^T d, in place, for the odd columns (e) and the even (o)
      float* restrict p0 = h ? o : e;
      float* restrict p1 = p0 + L, * restrict p2 = p0 + 2 * L, * restrict p3 = p0 + 3 * L;
#pragma omp simd
      for (int64_t m = 0; m <= len; m++) {
        float d0 = p0[m], d1 = p1[m], d2 = p2[m], d3 = p3[m];
        p0[m] = d0 - d2;
        p1[m] = d1 + d2;
        p2[m] = d2 - d1;
        p3[m] = d1 - d3;
      }
    }
    for (int i = 0; i < 4; i++) {  // (B^T d) B: tile m's columns are e[m], o[m], e[m + 1], o[m + 1]
      const float *ei = e + i * L, *oi = o + i * L;
      float* restrict v0 = v + j + (i * 4 + 0) * WINO_TB;
      float* restrict v1 = v0 + WINO_TB;
      float* restrict v2 = v0 + 2 * WINO_TB;
      float* restrict v3 = v0 + 3 * WINO_TB;
#pragma omp simd
      for (int64_t m = 0; m < len; m++) {
        v0[m] = ei[m] - ei[m + 1];
        v1[m] = oi[m] + ei[m + 1];
        v2[m] = ei[m + 1] - oi[m];
        v3[m] = oi[m] - oi[m + 1];
      }
    }
    j += len;
  }
}

// input transform of tiles [t0, t0 + nt) of x (N, Ci, H, W): V[pos] (Ci, nt) packed as GEMM operand B
// ([ceil(nt/24)][Ci][24], at Vp + pos*(round_up(nt, NR)*Ci + WINO_PAD); tiles past nt are zero). `row` is scratch:
// 32*WINO_TB floats.
static void wino_input(float* Vp, float* row, const float* x, int64_t Ci, int64_t H, int64_t W, int64_t t0,
                       int64_t nt) {
  int64_t ntr = round_up(nt, NR), vs = ntr * Ci + WINO_PAD;
  float* v = row + 16 * WINO_TB;  // v[pos][j] (16, WINO_TB)
  for (int64_t c = 0; c < Ci; c++) {
    wino_input_channel(v, row, x, c, Ci, H, W, t0, nt);
    for (int pos = 0; pos < 16; pos++) {  // into the packed operands, NR tiles at a time
      float* d = Vp + pos * vs + c * NR;
      const float* s = v + pos * WINO_TB;
      int64_t j0 = 0;
      for (; j0 + NR <= nt; j0 += NR) memcpy(d + j0 * Ci, s + j0, NR * sizeof(float));
      if (j0 < ntr)
        for (int64_t k = 0; k < NR; k++) d[j0 * Ci + k] = j0 + k < nt ? s[j0 + k] : 0.0f;
    }
  }
}

// output transform of tiles [t0, t0 + nt): y's 2x2 tile (clipped to the plane) = A^T m A + b[o], where
// m[pos] = M[pos][o][j] (M + pos*ms + o*ldm + j); y (N, Co, H, W). Vectorized along tile rows;
// `q` is scratch: 4*WINO_TB floats
static void wino_output(float* y, float* q, const float* M, int64_t ms, int64_t ldm, const float* b, int64_t Co,
                        int64_t H, int64_t W, int64_t t0, int64_t nt) {
  int64_t TH = (H + 1) / 2, TW = (W + 1) / 2, HW = H * W;
  float* restrict y00 = q, * restrict y01 = q + WINO_TB, * restrict y10 = q + 2 * WINO_TB, * restrict y11 = q + 3 * WINO_TB;
  for (int64_t o = 0; o < Co; o++) {
    float bo = b ? b[o] : 0.0f;
    const float *restrict m0 = M + o * ldm, *restrict m1 = m0 + 4 * ms, *restrict m2 = m0 + 8 * ms,
                *restrict m3 = m0 + 12 * ms;  // rows 0..3 of the 4x4 m, each 4 operands apart by ms
#pragma omp simd
    for (int64_t j = 0; j < nt; j++) {
      // A^T m: r0 = m row 0 + row 1 + row 2, r1 = row 1 - row 2 - row 3 (columns k = 0..3)
      float r00 = m0[j] + m1[j] + m2[j], r01 = m0[ms + j] + m1[ms + j] + m2[ms + j];
      float r02 = m0[2 * ms + j] + m1[2 * ms + j] + m2[2 * ms + j],
            r03 = m0[3 * ms + j] + m1[3 * ms + j] + m2[3 * ms + j];
      float r10 = m1[j] - m2[j] - m3[j], r11 = m1[ms + j] - m2[ms + j] - m3[ms + j];
      float r12 = m1[2 * ms + j] - m2[2 * ms + j] - m3[2 * ms + j],
            r13 = m1[3 * ms + j] - m2[3 * ms + j] - m3[3 * ms + j];
      y00[j] = r00 + r01 + r02 + bo;  // (A^T m) A
      y01[j] = r01 - r02 - r03 + bo;
      y10[j] = r10 + r11 + r12 + bo;
      y11[j] = r11 - r12 - r13 + bo;
    }
    for (int64_t j = 0; j < nt;) {  // one segment of a tile row at a time
      int64_t t = t0 + j, n = t / (TH * TW), r = t % (TH * TW), th = r / TW, tw0 = r % TW;
      int64_t len = TW - tw0 < nt - j ? TW - tw0 : nt - j;
      float* yr = y + (n * Co + o) * HW + 2 * th * W;
      int64_t full = 2 * (tw0 + len) <= W ? len : len - 1;  // tiles whose two columns are inside
      for (int64_t k = 0; k < full; k++) {
        yr[2 * (tw0 + k)] = y00[j + k];
        yr[2 * (tw0 + k) + 1] = y01[j + k];
      }
      if (full < len) yr[2 * (tw0 + full)] = y00[j + full];
      if (2 * th + 1 < H) {
        yr += W;
        for (int64_t k = 0; k < full; k++) {
          yr[2 * (tw0 + k)] = y10[j + k];
          yr[2 * (tw0 + k) + 1] = y11[j + k];
        }
        if (full < len) yr[2 * (tw0 + full)] = y10[j + full];
      }
      j += len;
    }
  }
}

// y (N, Co, H, W) = conv3x3, padding 1, of x (N, Ci, H, W) with the kernels of w (see wino_weights:
// w (Co, Ci, 3, 3), or with `rot` w (Ci, Co, 3, 3) rotated) + b (Co) (b may be NULL)
static int wino_conv(float* y, const float* x, const float* w, int rot, const float* b, int64_t N, int64_t Ci,
                     int64_t Co, int64_t H, int64_t W) {
  wino_split sp = wino_split_tiles(N, Ci, Co, H, W);
  int64_t T = sp.T, tb = sp.tb, nblocks = sp.nblocks;
  int nt = sp.nt;
  // shared: the packed kernels; per thread: the packed V of a block and its M (16, Co, WINO_TB)
  int64_t us = wino_us(Co, Ci), vsz = 16 * (WINO_TB * Ci + WINO_PAD), ms = Co * WINO_TB + WINO_PAD, msz = 16 * ms;
  int64_t per = vsz + msz + 16 * WINO_TB + 16 * WINO_TB;
  size_t bytes = (size_t)(16 * us + nt * per) * sizeof(float);
  float* buf = fsdp_alloc(bytes, FSDP_CPU, FSDP_MEM_OTHER);
  if (!buf) return -1;
  wino_weights(buf, w, Co, Ci, rot);
#pragma omp parallel for num_threads(nt) schedule(dynamic, 1)
  for (int64_t bi = 0; bi < nblocks; bi++) {
    float* Vp = buf + 16 * us + omp_get_thread_num() * per;
    float* M = Vp + vsz;  // M[pos] (Co, WINO_TB)
    int64_t t0 = bi * tb, n = T - t0 < tb ? T - t0 : tb, vs = round_up(n, NR) * Ci + WINO_PAD;
    float* scratch = M + msz;
    wino_input(Vp, scratch, x, Ci, H, W, t0, n);
    for (int pos = 0; pos < 16; pos++)  // M[pos] (Co, n) = U[pos] (Co, Ci) @ V[pos] (Ci, n)
      gemm_packed(Co, n, Ci, buf + pos * us, Vp + pos * vs, M + pos * ms, WINO_TB, 0);
    wino_output(y, scratch, M, ms, WINO_TB, b, Co, H, W, t0, n);
  }
  fsdp_free(buf, bytes, FSDP_CPU, FSDP_MEM_OTHER);
  return 0;
}

// the transformed output gradient of tiles [t0, t0 + nt), transposed: Z[pos]^T (nt, Co) = (A z A^T)[pos] of
// each tile's 2x2 z of gy (N, Co, H, W) (zero outside the plane), packed as GEMM operand B ([ceil(Co/24)][nt][24],
// at Zp + pos*(round_up(Co, NR)*nt + WINO_PAD); columns past Co are zero). A = [1 0; 1 1; 1 -1; 0 -1].
static void wino_grad_output(float* Zp, const float* gy, int64_t Co, int64_t H, int64_t W, int64_t t0, int64_t nt) {
  int64_t TH = (H + 1) / 2, TW = (W + 1) / 2, HW = H * W, zs = round_up(Co, NR) * nt + WINO_PAD;
  for (int64_t o0 = 0; o0 < Co; o0 += NR) {
    float* d = Zp + o0 * nt;  // (j, o0 + r) at d[j*NR + r]: each operand written in order
    for (int64_t j = 0; j < nt; j++) {
      int64_t t = t0 + j, n = t / (TH * TW), rem = t % (TH * TW), h0 = 2 * (rem / TW), w0 = 2 * (rem % TW);
      int right = w0 + 1 < W, down = h0 + 1 < H;
      for (int64_t r = 0; r < NR; r++) {
        float* dj = d + j * NR + r;
        if (o0 + r >= Co) {
          for (int pos = 0; pos < 16; pos++) dj[pos * zs] = 0.0f;
          continue;
        }
        const float* g0 = gy + (n * Co + o0 + r) * HW + h0 * W + w0;  // rows h0, h0 + 1 of the tile
        float z00 = g0[0], z01 = right ? g0[1] : 0.0f;
        float z10 = down ? g0[W] : 0.0f, z11 = down && right ? g0[W + 1] : 0.0f;
        float q[4][2] = {{z00, z01}, {z00 + z10, z01 + z11}, {z00 - z10, z01 - z11}, {-z10, -z11}};  // A z
        for (int i = 0; i < 4; i++) {                                                                // (A z) A^T
          dj[(i * 4 + 0) * zs] = q[i][0];
          dj[(i * 4 + 1) * zs] = q[i][0] + q[i][1];
          dj[(i * 4 + 2) * zs] = q[i][0] - q[i][1];
          dj[(i * 4 + 3) * zs] = -q[i][1];
        }
      }
    }
  }
}

// gw (Co, Ci, 3, 3) = weight gradient of the convolution y (N, Co, H, W) = conv3x3_pad1(x (N, Ci, H, W)), from
// x and gy: the adjoint of the forward, gw[o][c] = G^T [ sum over tiles (A z A^T) .* (B^T d B) ] G, so per
// position one GEMM over the tiles (transposed, so that the long side Co is the micro-kernel's 24 columns)
//   dU[pos]^T (Ci, Co) += V[pos] (Ci, T) @ Z[pos]^T (T, Co)
// The blocks of tiles are cut into fixed chunks, each summing into its own dU (its first block writes it),
// and the chunks are summed in order at the end: the result does not depend on which thread ran which
// chunk. Two chunks per thread, not more: each is another dU to write and to sum, 4 MiB at 256 channels.
static int wino_wgrad(float* gw, const float* x, const float* gy, int64_t N, int64_t Ci, int64_t Co, int64_t H,
                      int64_t W) {
  wino_split sp = wino_split_tiles(N, Ci, Co, H, W);
  int64_t T = sp.T, tb = sp.tb, nblocks = sp.nblocks;
  int nt = sp.nt;
  int64_t nchunk = nt == 1 ? 1 : (nblocks < 2 * nt ? nblocks : 2 * nt);
  // per chunk: its dU^T (16, Ci, Co); per thread: packed V and Z^T of a block, the input transform's
  // scratch and the transformed input of MR channels (MR, 16, WINO_TB)
  int64_t usz = 16 * Co * Ci, zsz = 16 * (round_up(Co, NR) * WINO_TB + WINO_PAD);
  int64_t vsz = 16 * (round_up(Ci, MR) * WINO_TB + WINO_PAD);
  int64_t per = zsz + vsz + 16 * WINO_TB + MR * 16 * WINO_TB;
  size_t bytes = (size_t)(nchunk * usz + nt * per) * sizeof(float);
  float* buf = fsdp_alloc(bytes, FSDP_CPU, FSDP_MEM_OTHER);
  if (!buf) return -1;
#pragma omp parallel for num_threads(nt) schedule(dynamic, 1)
  for (int64_t ch = 0; ch < nchunk; ch++) {
    float* Zp = buf + nchunk * usz + omp_get_thread_num() * per;
    float *Vp = Zp + zsz, *row = Vp + vsz, *v = row + 16 * WINO_TB;
    float* dU = buf + ch * usz;
    int64_t b0 = nblocks * ch / nchunk, b1 = nblocks * (ch + 1) / nchunk;  // this chunk's blocks
    for (int64_t bi = b0; bi < b1; bi++) {
      int64_t t0 = bi * tb, n = T - t0 < tb ? T - t0 : tb;
      int64_t zs = round_up(Co, NR) * n + WINO_PAD, vs = round_up(Ci, MR) * n + WINO_PAD;
      wino_grad_output(Zp, gy, Co, H, W, t0, n);
      for (int64_t c0 = 0; c0 < Ci; c0 += MR) {  // V (Ci, n) packed as operand A: (c, j) at [c/4][j][c%4]
        for (int64_t r = 0; r < MR && c0 + r < Ci; r++)
          wino_input_channel(v + r * 16 * WINO_TB, row, x, c0 + r, Ci, H, W, t0, n);
        float* d = Vp + c0 * n;
        for (int pos = 0; pos < 16; pos++)
          for (int64_t j = 0; j < n; j++)
            for (int64_t r = 0; r < MR; r++)
              d[pos * vs + j * MR + r] = c0 + r < Ci ? v[(r * 16 + pos) * WINO_TB + j] : 0.0f;
      }
      for (int pos = 0; pos < 16; pos++)  // dU[pos]^T (Ci, Co) += V[pos] (Ci, n) @ Z[pos]^T (n, Co)
        gemm_packed(Ci, Co, n, Vp + pos * vs, Zp + pos * zs, dU + pos * Co * Ci, Co, bi > b0);
    }
  }
#pragma omp parallel for num_threads(nt) if (nchunk > 1)
  for (int64_t i0 = 0; i0 < usz; i0 += 4096) {  // sum the chunks, in order, 4096 sums at a time
    int64_t i1 = usz - i0 < 4096 ? usz : i0 + 4096;
    for (int64_t ch = 1; ch < nchunk; ch++)
      for (int64_t i = i0; i < i1; i++) buf[i] += buf[ch * usz + i];
  }
#pragma omp parallel for num_threads(nt) if (nt > 1)
  for (int64_t o = 0; o < Co; o++)
    for (int64_t c = 0; c < Ci; c++) {  // gw[o][c] = G^T dU G
      float u[4][4], t[3][4];
      for (int pos = 0; pos < 16; pos++) u[pos / 4][pos % 4] = buf[pos * Co * Ci + c * Co + o];
      for (int k = 0; k < 4; k++) {  // G^T dU, G^T = [1 .5 .5 0; 0 .5 -.5 0; 0 .5 .5 1]
        t[0][k] = u[0][k] + 0.5f * (u[1][k] + u[2][k]);
        t[1][k] = 0.5f * (u[1][k] - u[2][k]);
        t[2][k] = 0.5f * (u[1][k] + u[2][k]) + u[3][k];
      }
      float* g = gw + (o * Ci + c) * 9;
      for (int i = 0; i < 3; i++) {  // (G^T dU) G
        g[i * 3 + 0] = t[i][0] + 0.5f * (t[i][1] + t[i][2]);
        g[i * 3 + 1] = 0.5f * (t[i][1] - t[i][2]);
        g[i * 3 + 2] = 0.5f * (t[i][1] + t[i][2]) + t[i][3];
      }
    }
  fsdp_free(buf, bytes, FSDP_CPU, FSDP_MEM_OTHER);
  return 0;
}

// gb (O) = sum over n and the pixels p of gy (N, O, P): a convolution's bias gradient
static void conv_bias_grad(const fsdp_conv_geom* g, float* gb, const float* gy) {
  int64_t P = g->OH * g->OW;
#pragma omp parallel for if (g->N * g->O * P > 32768)
  for (int64_t o = 0; o < g->O; o++) {
    float s = 0.0f;
    for (int64_t n = 0; n < g->N; n++) s += sum_f32(gy + (n * g->O + o) * P, P);
    gb[o] = s;
  }
}

// ---- 1x1 convolutions as GEMMs -----------------------------------------------------------------------------------
// A 1x1 convolution (one group, no padding) is one GEMM per image over its pixels P = OH*OW, on x
// subsampled first when the stride is above 1 (xs (N, C, OH, OW): xs[n, c, i, j] = x[n, c, i*sh, j*sw]):
//   forward      y_n (O, P)   = w (O, C) @ xs_n (C, P) (+ b)
//   input grad   gxs_n (C, P) = w^T (C, O) @ gy_n (O, P), scattered back into gx (0 where no pixel is read)
//   weight grad  gw (O, C)    = sum over n of gy_n (O, P) @ xs_n^T (P, C)
// through the GEMM library fsdp chose. oneDNN's own 1x1 convolutions ran these 1.3-2.6x slower
// (2-core AMD EPYC, batch 8, 2 threads: the weight gradient of 64->256 at 56x56 4.5 ms; stride 2
// needed a strided view oneDNN handles slowly).
static int is_conv1x1(const fsdp_conv_geom* g) {
  return g->kh == 1 && g->kw == 1 && g->groups == 1 && g->ph == 0 && g->pw == 0;
}

// xs (N, C, OH, OW) <- the pixels of x (N, C, H, W) a strided 1x1 convolution reads, or back
// (scatter: gx <- gxs, gx zero elsewhere)
static void conv1x1_gather(const fsdp_conv_geom* g, float* xs, const float* x, int scatter) {
  int64_t planes = g->N * g->C, P = g->OH * g->OW, HW = g->H * g->W;
#pragma omp parallel for if (planes * HW > 32768)
  for (int64_t pl = 0; pl < planes; pl++) {
    float* s = xs + pl * P;
    float* d = (float*)(uintptr_t)(x + pl * HW);  // written only when scattering
    if (scatter) memset(d, 0, (size_t)HW * sizeof(float));
    for (int64_t i = 0; i < g->OH; i++)
      for (int64_t j = 0; j < g->OW; j++) {
        int64_t at = i * g->sh * g->W + j * g->sw;
        if (scatter) d[at] = s[i * g->OW + j];
        else s[i * g->OW + j] = d[at];
      }
  }
}

static int conv1x1_forward(const fsdp_conv_geom* g, float* y, const float* x, const float* w, const float* b) {
  int64_t P = g->OH * g->OW, strided = g->sh != 1 || g->sw != 1, nbytes = g->N * g->C * P * sizeof(float);
  float* xs = strided ? fsdp_alloc(nbytes, FSDP_CPU, FSDP_MEM_OTHER) : (float*)(uintptr_t)x;
  if (!xs) return -1;
  if (strided) conv1x1_gather(g, xs, x, 0);
  if (b)
#pragma omp parallel for if (g->N * g->O * P > 32768)
    for (int64_t no = 0; no < g->N * g->O; no++)
      for (int64_t p = 0; p < P; p++) y[no * P + p] = b[no % g->O];
  // y_n (O, P) = w (O, C) @ xs_n (C, P) (+ y_n: the bias), every image
  fsdp_cpu_gemm_batched(g->N, 0, 0, g->O, P, g->C, 1.0f, w, g->C, 0, xs, P, g->C * P, b ? 1.0f : 0.0f, y, P, g->O * P);
  if (strided) fsdp_free(xs, nbytes, FSDP_CPU, FSDP_MEM_OTHER);
  return 0;
}

static int conv1x1_backward(const fsdp_conv_geom* g, float* gx, float* gw, float* gb, const float* gy, const float* x,
                            const float* w) {
  int64_t P = g->OH * g->OW, strided = g->sh != 1 || g->sw != 1, nbytes = g->N * g->C * P * sizeof(float);
  float* xs = strided ? fsdp_alloc(nbytes, FSDP_CPU, FSDP_MEM_OTHER) : (float*)(uintptr_t)x;
  if (!xs) return -1;
  if (gb) conv_bias_grad(g, gb, gy);
  if (gw) {  // gw (O, C) = sum_n gy_n (O, P) @ xs_n^T (P, C)
    if (strided) conv1x1_gather(g, xs, x, 0);
    // images in one chunk per thread, each chunk summing its images' products into its own part
    // (the first part is gw), the parts added in order: the sum does not depend on which thread
    // ran which chunk
    int64_t wsize = g->O * g->C, nchunk = omp_get_max_threads();
    if (nchunk > g->N) nchunk = g->N;
    if (nchunk < 1) nchunk = 1;
    size_t pbytes = (size_t)((nchunk - 1) * wsize) * sizeof(float);
    float* parts = nchunk > 1 ? fsdp_alloc(pbytes, FSDP_CPU, FSDP_MEM_OTHER) : NULL;
    if (nchunk > 1 && !parts) nchunk = 1;
    memset(gw, 0, (size_t)wsize * sizeof(float));
    if (parts) memset(parts, 0, pbytes);
#pragma omp parallel for num_threads(nchunk) schedule(static, 1) if (nchunk > 1)
    for (int64_t ch = 0; ch < nchunk; ch++) {
      float* part = ch ? parts + (ch - 1) * wsize : gw;
      for (int64_t n = g->N * ch / nchunk; n < g->N * (ch + 1) / nchunk; n++) {
        fsdp_gemm_args a = {0, 1, g->O, g->C, P, 1.0f, gy + n * g->O * P, P, xs + n * g->C * P, P, 1.0f, part, g->C};
        fsdp_cpu_gemm_many(1, &a);  // on this thread when inside the parallel loop
      }
    }
    for (int64_t ch = 1; ch < nchunk; ch++) {
      const float* part = parts + (ch - 1) * wsize;
      for (int64_t i = 0; i < wsize; i++) gw[i] += part[i];
    }
    if (parts) fsdp_free(parts, pbytes, FSDP_CPU, FSDP_MEM_OTHER);
  }
  if (gx) {  // gxs_n (C, P) = w^T (C, O) @ gy_n (O, P), into gx itself when nothing is skipped
    float* gxs = strided ? xs : gx;
    fsdp_cpu_gemm_batched(g->N, 1, 0, g->C, P, g->O, 1.0f, w, g->C, 0, gy, P, g->O * P, 0.0f, gxs, P, g->C * P);
    if (strided) conv1x1_gather(g, xs, gx, 1);
  }
  if (strided) fsdp_free(xs, nbytes, FSDP_CPU, FSDP_MEM_OTHER);
  return 0;
}

static int cpu_conv2d_forward(const fsdp_conv_geom* g, float* y, const float* x, const float* w, const float* b) {
  if (!ours_forced() && is_conv1x1(g)) return conv1x1_forward(g, y, x, w, b);
  if (!ours_forced() && !winograd_over_onednn(g)) {  // oneDNN unless one of ours is forced or wins
    int rc = fsdp_cpu_onednn_conv2d_forward(g, FSDP_F32, y, x, w, b);
    if (rc <= 0) return rc;
  }
  int64_t G = g->groups, Og = g->O / G, Cg = g->C / G, P = g->OH * g->OW, HW = g->H * g->W;
  if (use_winograd(g)) return wino_conv(y, x, w, 0, b, g->N, g->C, g->O, g->H, g->W);
  int64_t K = Cg * g->kh * g->kw;  // GEMM inner size per group
  int nt = conv_threads(g);
  // shared: packed weights of every group; per thread: one packed B and one row
  int64_t wsz = round_up(Og, MR) * K, bsz = round_up(P, NR) * K + P;
  size_t bytes = (size_t)(G * wsz + nt * bsz) * sizeof(float);
  float* buf = fsdp_alloc(bytes, FSDP_CPU, FSDP_MEM_OTHER);
  if (!buf) return -1;
  for (int64_t gi = 0; gi < G; gi++) pack_a(buf + gi * wsz, w + gi * Og * K, K, 1, Og, K);
#pragma omp parallel for num_threads(nt) schedule(dynamic, 1)
  for (int64_t n = 0; n < g->N; n++) {  // dynamic: a thread that loses its core hands work to the other
    float* bp = buf + G * wsz + omp_get_thread_num() * bsz;
    float* row = bp + round_up(P, NR) * K;
    float* yn = y + n * g->O * P;  // (O, P)
    if (b)
      for (int64_t o = 0; o < g->O; o++)
        for (int64_t p = 0; p < P; p++) yn[o * P + p] = b[o];
    for (int64_t gi = 0; gi < G; gi++) {  // y[n, g] (Og, P) = w[g] (Og, K) @ col[g] (K, P)
      im2col_pack_fwd(bp, row, x + (n * g->C + gi * Cg) * HW, g, Cg);
      gemm_packed(Og, P, K, buf + gi * wsz, bp, yn + gi * Og * P, P, b != NULL);
    }
  }
  fsdp_free(buf, bytes, FSDP_CPU, FSDP_MEM_OTHER);
  return 0;
}

static int cpu_conv2d_backward(const fsdp_conv_geom* g, float* gx, float* gw, float* gb, const float* gy,
                               const float* x, const float* w) {
  int64_t G = g->groups, Og = g->O / G, Cg = g->C / G, P = g->OH * g->OW, HW = g->H * g->W;
  if (!ours_forced() && is_conv1x1(g)) return conv1x1_backward(g, gx, gw, gb, gy, x, w);
  if (!ours_forced() && !winograd_over_onednn(g) && (gx || gw)) {  // oneDNN unless one of ours is forced or wins
    int rc = fsdp_cpu_onednn_conv2d_backward(g, FSDP_F32, gx, gw, gw ? gb : NULL, gy, x, w);
    if (rc < 0) return -1;
    if (rc == 0) return gb && !gw ? cpu_conv2d_backward(g, NULL, NULL, gb, gy, x, w) : 0;
  }
  if ((gx || gw) && use_winograd(g)) {
    if (gb) cpu_conv2d_backward(g, NULL, NULL, gb, gy, x, w);
    if (gw && wino_wgrad(gw, x, gy, g->N, g->C, g->O, g->H, g->W)) return -1;
    // gx (N, C, H, W) = gy (N, O, H, W) correlated with w rotated, (C, O, 3, 3)
    return gx ? wino_conv(gx, gy, w, 1, NULL, g->N, g->O, g->C, g->H, g->W) : 0;
  }
  int64_t K = Cg * g->kh * g->kw, KK = (int64_t)g->kh * g->kw * P, wsize = g->O * K;
  if (gb) conv_bias_grad(g, gb, gy);
  if (gw) memset(gw, 0, (size_t)wsize * sizeof(float));
  if ((!gx && !gw) || g->N == 0) return 0;
  int nt = conv_threads(g);
  // Images go in fixed chunks, each with its own partial weight gradient, summed in chunk order at
  // the end: threads take chunks as they come (a thread that loses its core does not hold the other
  // back), yet the result does not depend on which thread ran which chunk.
  int64_t nchunk = nt == 1 ? 1 : (g->N < 4 * nt ? g->N : 4 * nt);
  // shared: w[g]^T packed as A (K, Og) for the input gradient; the chunks' partial weight gradients
  // per thread: gy[n, g] packed as A (Og, P) and col^T packed as B (P, K) for the weight gradient,
  //             gy[n, g] packed as B (Og, P) and gcol (K, P) for the input gradient, and NR rows
  int64_t wtsz = gx ? round_up(K, MR) * Og : 0, parts = gw ? nchunk * wsize : 0;
  int64_t sa = gw ? round_up(Og, MR) * P + round_up(K, NR) * P : 0;
  int64_t sb = gx ? round_up(P, NR) * Og + K * P : 0;
  int64_t per = sa + sb + NR * P;
  size_t bytes = (size_t)(G * wtsz + parts + nt * per) * sizeof(float);
  float* buf = fsdp_alloc(bytes, FSDP_CPU, FSDP_MEM_OTHER);
  if (!buf) return -1;
  float* part0 = buf + G * wtsz;
  for (int64_t gi = 0; gi < G && gx; gi++) pack_a(buf + gi * wtsz, w + gi * Og * K, 1, K, K, Og);
  if (gw) memset(part0, 0, (size_t)parts * sizeof(float));
#pragma omp parallel for num_threads(nt) schedule(dynamic, 1)
  for (int64_t ch = 0; ch < nchunk; ch++) {
    float* mine = part0 + parts + omp_get_thread_num() * per;
    float *ga = mine, *bt = mine + (gw ? round_up(Og, MR) * P : 0);         // weight gradient operands
    float *gbp = mine + sa, *gcol = gbp + (gx ? round_up(P, NR) * Og : 0);  // input gradient operands
    float *row = mine + sa + sb, *gw_c = part0 + ch * wsize;
    for (int64_t n = g->N * ch / nchunk; n < g->N * (ch + 1) / nchunk; n++) {
      for (int64_t gi = 0; gi < G; gi++) {
        const float* gyg = gy + (n * g->O + gi * Og) * P;  // gy[n, g] (Og, P)
        if (gw) {                                          // gw[g] (Og, K) += gy[n, g] (Og, P) @ col^T (P, K)
          pack_a(ga, gyg, P, 1, Og, P);
          im2col_pack_wgrad(bt, row, x + (n * g->C + gi * Cg) * HW, g, Cg);
          gemm_packed(Og, K, P, ga, bt, gw_c + gi * Og * K, K, 1);
        }
        if (gx) {  // gcol (K, P) = w[g]^T (K, Og) @ gy[n, g] (Og, P); gx[n, g] = col2im(gcol)
          pack_b(gbp, gyg, P, 1, Og, P, 1.0f, NR);
          gemm_packed(K, P, Og, buf + gi * wtsz, gbp, gcol, P, 0);
          float* gxg = gx + (n * g->C + gi * Cg) * HW;
          for (int64_t c = 0; c < Cg; c++) {
            memset(gxg + c * HW, 0, HW * sizeof(float));
            col2im_channel(gxg + c * HW, gcol + c * KK, g);
          }
        }
      }
    }
  }
  for (int64_t ch = 0; gw && ch < nchunk; ch++) {  // sum the chunks' weight gradients, in order
    const float* part = part0 + ch * wsize;
    for (int64_t i = 0; i < wsize; i++) gw[i] += part[i];
  }
  fsdp_free(buf, bytes, FSDP_CPU, FSDP_MEM_OTHER);
  return 0;
}

// bf16 convolutions: oneDNN's (its bf16 JIT kernels where the CPU has AVX512_BF16 or AMX, or
// AVX-512 emulating them), none of ours; forced paths (FSDP_CONV_ALGO) and oneDNN's refusals
// leave them to the float32 path
static int cpu_conv2d_forward_bf16(const fsdp_conv_geom* g, float* y, const uint16_t* x, const uint16_t* w,
                                   const float* b) {
  return ours_forced() ? 1 : fsdp_cpu_onednn_conv2d_forward(g, FSDP_BF16, y, x, w, b);
}
static int cpu_conv2d_backward_bf16(const fsdp_conv_geom* g, float* gx, float* gw, float* gb, const uint16_t* gy,
                                    const uint16_t* x, const uint16_t* w) {
  if (ours_forced() || (!gx && !gw)) return 1;
  int rc = fsdp_cpu_onednn_conv2d_backward(g, FSDP_BF16, gx, gw, gw ? gb : NULL, gy, x, w);
  if (rc != 0 || !gb || gw) return rc;
  // gb (O) = sum over n, p of gy (N, O, P), in float32
  int64_t P = g->OH * g->OW;
  for (int64_t o = 0; o < g->O; o++) {
    float s = 0.0f;
    for (int64_t n = 0; n < g->N; n++)
      for (int64_t p = 0; p < P; p++) s += fsdp_bf16_to_f32(gy[(n * g->O + o) * P + p]);
    gb[o] = s;
  }
  return 0;
}

// ---- pooling -----------------------------------------------------------------------------------------------------
// one plane (H, W) per (n, c); planes are independent, so they split across threads

static void cpu_max_pool2d_forward(const fsdp_conv_geom* g, float* y, int64_t* idx, const float* x) {
  int64_t planes = g->N * g->C, HW = g->H * g->W, P = g->OH * g->OW;
#pragma omp parallel for if (planes * P * g->kh * g->kw > 32768)
  for (int64_t pl = 0; pl < planes; pl++) {
    const float* xp = x + pl * HW;
    float* yp = y + pl * P;
    int64_t* ip = idx + pl * P;
    for (int64_t oh = 0; oh < g->OH; oh++)
      for (int64_t ow = 0; ow < g->OW; ow++) {
        int64_t h0 = oh * g->sh - g->ph, w0 = ow * g->sw - g->pw;
        float best = -INFINITY;
        int64_t bi = -1;
        for (int ki = 0; ki < g->kh; ki++) {
          int64_t ih = h0 + (int64_t)ki * g->dh;
          if (ih < 0 || ih >= g->H) continue;
          for (int kj = 0; kj < g->kw; kj++) {
            int64_t iw = w0 + (int64_t)kj * g->dw;
            if (iw < 0 || iw >= g->W) continue;
            float v = xp[ih * g->W + iw];
            if (v > best || isnan(v) || bi < 0) {
              best = v;
              bi = ih * g->W + iw;
              if (isnan(v)) goto done;
            }
          }
        }
      done:
        yp[oh * g->OW + ow] = best;
        ip[oh * g->OW + ow] = bi;
      }
  }
}

static void cpu_max_pool2d_backward(const fsdp_conv_geom* g, float* gx, const float* gy, const int64_t* idx) {
  int64_t planes = g->N * g->C, HW = g->H * g->W, P = g->OH * g->OW;
#pragma omp parallel for if (planes * (HW + P) > 32768)
  for (int64_t pl = 0; pl < planes; pl++) {
    float* gp = gx + pl * HW;
    memset(gp, 0, HW * sizeof(float));
    const float* gyp = gy + pl * P;
    const int64_t* ip = idx + pl * P;
    for (int64_t p = 0; p < P; p++)
      if (ip[p] >= 0) gp[ip[p]] += gyp[p];
  }
}

// PyTorch's window: [h0, min(h0 + k, H + pad)) sets the pool size with padding; then clipped to the input
typedef struct {
  int64_t h0, h1, w0, w1;
  float inv;
} avg_window;
static inline avg_window avg_win(const fsdp_conv_geom* g, int64_t oh, int64_t ow, int count_include_pad) {
  avg_window a;
  a.h0 = oh * g->sh - g->ph;
  a.w0 = ow * g->sw - g->pw;
  a.h1 = a.h0 + g->kh < g->H + g->ph ? a.h0 + g->kh : g->H + g->ph;
  a.w1 = a.w0 + g->kw < g->W + g->pw ? a.w0 + g->kw : g->W + g->pw;
  int64_t pool = (a.h1 - a.h0) * (a.w1 - a.w0);
  if (a.h0 < 0) a.h0 = 0;
  if (a.w0 < 0) a.w0 = 0;
  if (a.h1 > g->H) a.h1 = g->H;
  if (a.w1 > g->W) a.w1 = g->W;
  int64_t cnt = count_include_pad ? pool : (a.h1 - a.h0) * (a.w1 - a.w0);
  a.inv = cnt > 0 ? 1.0f / (float)cnt : 0.0f;
  return a;
}

static void cpu_avg_pool2d_forward(const fsdp_conv_geom* g, float* y, const float* x, int count_include_pad) {
  int64_t planes = g->N * g->C, HW = g->H * g->W, P = g->OH * g->OW;
#pragma omp parallel for if (planes * P * g->kh * g->kw > 32768)
  for (int64_t pl = 0; pl < planes; pl++) {
    const float* xp = x + pl * HW;
    for (int64_t oh = 0; oh < g->OH; oh++)
      for (int64_t ow = 0; ow < g->OW; ow++) {
        avg_window a = avg_win(g, oh, ow, count_include_pad);
        float s = 0.0f;
        for (int64_t ih = a.h0; ih < a.h1; ih++)
          for (int64_t iw = a.w0; iw < a.w1; iw++) s += xp[ih * g->W + iw];
        y[pl * P + oh * g->OW + ow] = s * a.inv;
      }
  }
}

static void cpu_avg_pool2d_backward(const fsdp_conv_geom* g, float* gx, const float* gy, int count_include_pad) {
  int64_t planes = g->N * g->C, HW = g->H * g->W, P = g->OH * g->OW;
#pragma omp parallel for if (planes * P * g->kh * g->kw > 32768)
  for (int64_t pl = 0; pl < planes; pl++) {
    float* gp = gx + pl * HW;
    memset(gp, 0, HW * sizeof(float));
    for (int64_t oh = 0; oh < g->OH; oh++)
      for (int64_t ow = 0; ow < g->OW; ow++) {
        avg_window a = avg_win(g, oh, ow, count_include_pad);
        float v = gy[pl * P + oh * g->OW + ow] * a.inv;
        for (int64_t ih = a.h0; ih < a.h1; ih++)
          for (int64_t iw = a.w0; iw < a.w1; iw++) gp[ih * g->W + iw] += v;
      }
  }
}

static void cpu_adaptive_avg_pool2d_forward(const fsdp_conv_geom* g, float* y, const float* x) {
  int64_t planes = g->N * g->C, HW = g->H * g->W, P = g->OH * g->OW;
#pragma omp parallel for if (planes * HW > 32768)
  for (int64_t pl = 0; pl < planes; pl++) {
    const float* xp = x + pl * HW;
    for (int64_t oh = 0; oh < g->OH; oh++) {
      int64_t h0 = oh * g->H / g->OH, h1 = ((oh + 1) * g->H + g->OH - 1) / g->OH;
      for (int64_t ow = 0; ow < g->OW; ow++) {
        int64_t w0 = ow * g->W / g->OW, w1 = ((ow + 1) * g->W + g->OW - 1) / g->OW;
        float s = 0.0f;
        if (w0 == 0 && w1 == g->W) s = sum_f32(xp + h0 * g->W, (h1 - h0) * g->W);  // whole rows: one run
        else
          for (int64_t ih = h0; ih < h1; ih++) s += sum_f32(xp + ih * g->W + w0, w1 - w0);
        y[pl * P + oh * g->OW + ow] = s / (float)((h1 - h0) * (w1 - w0));
      }
    }
  }
}

static void cpu_adaptive_avg_pool2d_backward(const fsdp_conv_geom* g, float* gx, const float* gy) {
  int64_t planes = g->N * g->C, HW = g->H * g->W, P = g->OH * g->OW;
#pragma omp parallel for if (planes * HW > 32768)
  for (int64_t pl = 0; pl < planes; pl++) {
    float* gp = gx + pl * HW;
    memset(gp, 0, HW * sizeof(float));
    for (int64_t oh = 0; oh < g->OH; oh++) {
      int64_t h0 = oh * g->H / g->OH, h1 = ((oh + 1) * g->H + g->OH - 1) / g->OH;
      for (int64_t ow = 0; ow < g->OW; ow++) {
        int64_t w0 = ow * g->W / g->OW, w1 = ((ow + 1) * g->W + g->OW - 1) / g->OW;
        float v = gy[pl * P + oh * g->OW + ow] / (float)((h1 - h0) * (w1 - w0));
        for (int64_t ih = h0; ih < h1; ih++)
          for (int64_t iw = w0; iw < w1; iw++) gp[ih * g->W + iw] += v;
      }
    }
  }
}

const fsdp_linalg_kernels FSDP_ISA_NAME(fsdp_cpu_linalg_kernels) = {
    .gemm_many = fsdp_cpu_gemm_many,
    .gemm_tiles = cpu_gemm_tiles,
    .gemm_bf16_many = fsdp_cpu_gemm_bf16_many,
    .bias_rows = cpu_bias_rows,
    .sum_rows = cpu_sum_rows,
    .conv2d_forward = cpu_conv2d_forward,
    .conv2d_backward = cpu_conv2d_backward,
    .conv2d_forward_bf16 = cpu_conv2d_forward_bf16,
    .conv2d_backward_bf16 = cpu_conv2d_backward_bf16,
    .max_pool2d_forward = cpu_max_pool2d_forward,
    .max_pool2d_backward = cpu_max_pool2d_backward,
    .avg_pool2d_forward = cpu_avg_pool2d_forward,
    .avg_pool2d_backward = cpu_avg_pool2d_backward,
    .adaptive_avg_pool2d_forward = cpu_adaptive_avg_pool2d_forward,
    .adaptive_avg_pool2d_backward = cpu_adaptive_avg_pool2d_backward,
};
