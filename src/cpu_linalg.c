/*
 * cpu_linalg.c -- CPU kernels of the linalg family (see kernels_linalg.h): GEMMs through
 * OpenBLAS, convolution (im2col + GEMM) and pooling loops.
 */
#include "internal.h"

#include <cblas.h>
#include <dlfcn.h>
#include <math.h>
#include <omp.h>

// LuaJIT dlclose()s libfsdp.so at exit (lua_close), and with it libgomp, whose idle worker
// threads may still be finishing the last parallel region's barrier: they would run on in
// unmapped code (a segfault at exit, seen under load). Pinning libgomp for the life of the
// process keeps their code mapped; they die with the process.
__attribute__((constructor)) static void pin_openmp_runtime(void) {
  dlopen("libgomp.so.1", RTLD_LAZY | RTLD_NOLOAD | RTLD_NODELETE);
}

// ---- GEMM scheduling ------------------------------------------------------------------------------------
// OpenBLAS always runs single-threaded here; the threads are ours (OpenMP). A list of independent
// GEMMs is cut into pieces of about equal work -- a big GEMM along its longer output side, two
// equal ones (a linear's grad_x and grad_w) one per thread, a batch of small ones (attention
// heads) not at all -- and the threads take pieces as they come, with no synchronisation but the
// region's end. This beats a sequence of OpenBLAS-threaded calls at these sizes: no barrier
// inside each GEMM, no OpenBLAS worker spinning between GEMMs while our OpenMP kernels want the
// cores, and independent GEMMs overlap.
void openblas_set_num_threads(int n);
int openblas_get_num_threads(void);

#define GEMM_PAR_MIN (1 << 21)  // multiply-adds under which a GEMM list runs on the calling thread
#define GEMM_PIECE_MIN (1 << 20)  // smallest piece worth its own OpenBLAS call (about 30 us)
#define GEMM_ALIGN 16           // piece boundaries fall on multiples of this (OpenBLAS's tile sizes)

static void blas_gemm(const fsdp_gemm_args* g) {
  cblas_sgemm(CblasRowMajor, g->ta ? CblasTrans : CblasNoTrans, g->tb ? CblasTrans : CblasNoTrans, (int)g->M,
              (int)g->N, (int)g->K, g->alpha, g->A, (int)g->lda, g->B, (int)g->ldb, g->beta, g->C, (int)g->ldc);
}

// rows [lo, hi) (split_n = 0) or columns [lo, hi) (split_n = 1) of GEMM g's output
typedef struct { const fsdp_gemm_args* g; int64_t lo, hi; int split_n; } gemm_piece;

static void run_piece(const gemm_piece* p) {
  fsdp_gemm_args a = *p->g;
  if (p->split_n) {  // C[:, lo:hi] = op(A) @ op(B)[:, lo:hi]
    a.N = p->hi - p->lo;
    a.B += a.tb ? p->lo * a.ldb : p->lo;
    a.C += p->lo;
  } else {  // C[lo:hi, :] = op(A)[lo:hi, :] @ op(B)
    a.M = p->hi - p->lo;
    a.A += a.ta ? p->lo : p->lo * a.lda;
    a.C += p->lo * a.ldc;
  }
  blas_gemm(&a);
}

static void cpu_gemm_many(int n, const fsdp_gemm_args* g) {
  double work = 0;
  for (int i = 0; i < n; i++) work += (double)g[i].M * g[i].N * g[i].K;
  int nt = omp_in_parallel() ? 1 : omp_get_max_threads();
  int saved = openblas_get_num_threads();
  if (saved != 1 && !omp_in_parallel()) openblas_set_num_threads(1);
  if (nt == 1 || work < GEMM_PAR_MIN) {
    for (int i = 0; i < n; i++) blas_gemm(&g[i]);
  } else {
    // pieces of about a thread's share of the work (a GEMM smaller than that stays whole), taken
    // by the threads as they come. Finer pieces (4 per thread) balanced better on a loaded machine
    // in theory but cost 3-4% more CPU time (each piece packs its shared operand again) with no
    // wall-clock gain we could measure, so one share per piece.
    double share = work / nt;
    if (share < GEMM_PIECE_MIN) share = GEMM_PIECE_MIN;
    int64_t np = 0, cap = 0;
    for (int i = 0; i < n; i++) cap += 1 + (int64_t)((double)g[i].M * g[i].N * g[i].K / share + 0.5);
    gemm_piece stack[64];
    gemm_piece* pc = cap <= 64 ? stack : malloc(cap * sizeof(gemm_piece));
    if (!pc) {  // no memory for the plan: run them one after another
      for (int i = 0; i < n; i++) blas_gemm(&g[i]);
      if (saved != 1) openblas_set_num_threads(saved);
      return;
    }
    for (int i = 0; i < n; i++) {
      int split_n = g[i].N > g[i].M;  // cut the longer side of the output
      int64_t side = split_n ? g[i].N : g[i].M, blocks = (side + GEMM_ALIGN - 1) / GEMM_ALIGN;
      int64_t k = (int64_t)((double)g[i].M * g[i].N * g[i].K / share + 0.5);
      if (k > blocks) k = blocks;
      if (k < 1) k = 1;
      for (int64_t j = 0; j < k; j++) {
        int64_t lo = blocks * j / k * GEMM_ALIGN, hi = blocks * (j + 1) / k * GEMM_ALIGN;
        pc[np++] = (gemm_piece){&g[i], lo, hi < side ? hi : side, split_n};
      }
    }
#pragma omp parallel for schedule(dynamic, 1) num_threads(nt)
    for (int64_t i = 0; i < np; i++) run_piece(&pc[i]);
    if (pc != stack) free(pc);
  }
  if (saved != 1 && !omp_in_parallel()) openblas_set_num_threads(saved);
}

static void cpu_gemm(int ta, int tb, int64_t M, int64_t N, int64_t K, float alpha, const float* A, int64_t lda,
                     const float* B, int64_t ldb, float beta, float* C, int64_t ldc) {
  fsdp_gemm_args g = {ta, tb, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc};
  cpu_gemm_many(1, &g);
}

static void cpu_gemm_batched(int64_t batch, int ta, int tb, int64_t M, int64_t N, int64_t K, float alpha,
                             const float* A, int64_t lda, int64_t sa, const float* B, int64_t ldb, int64_t sb,
                             float beta, float* C, int64_t ldc, int64_t sc) {
  fsdp_gemm_args stack[64];
  fsdp_gemm_args* g = batch <= 64 ? stack : malloc(batch * sizeof(fsdp_gemm_args));
  if (!g) {  // no memory for the list: one at a time
    for (int64_t b = 0; b < batch; b++)
      cpu_gemm(ta, tb, M, N, K, alpha, A + b * sa, lda, B + b * sb, ldb, beta, C + b * sc, ldc);
    return;
  }
  int n = (int)batch;
  for (int b = 0; b < n; b++)
    g[b] = (fsdp_gemm_args){ta, tb, M, N, K, alpha, A + b * sa, lda, B + b * sb, ldb, beta, C + b * sc, ldc};
  cpu_gemm_many(n, g);
  if (g != stack) free(g);
}

// ---- linear helpers ------------------------------------------------------------------------------------

// Linear's helpers stay single-threaded unless huge: they are memory bound, and an OpenMP region
// between two multi-threaded GEMMs leaves spinning OpenMP workers that slow OpenBLAS's threads.
#define FSDP_LINEAR_OMP_MIN (1 << 22)

static void cpu_bias_rows(float* y, const float* b, int64_t M, int64_t N) {
#pragma omp parallel for if (M * N > FSDP_LINEAR_OMP_MIN)
  for (int64_t i = 0; i < M; i++) memcpy(y + i * N, b, N * sizeof(float));
}

// gb (N) = sum_i gy (i, :); columns split across threads, rows streamed (vectorizes over j)
static void cpu_sum_rows(float* gb, const float* gy, int64_t M, int64_t N) {
  const int64_t CB = 256;  // column block
#pragma omp parallel for if (M * N > FSDP_LINEAR_OMP_MIN)
  for (int64_t j0 = 0; j0 < N; j0 += CB) {
    int64_t j1 = j0 + CB < N ? j0 + CB : N;
    float acc[256];
    for (int64_t j = j0; j < j1; j++) acc[j - j0] = 0.0f;
    for (int64_t i = 0; i < M; i++) {
      const float* row = gy + i * N;
      for (int64_t j = j0; j < j1; j++) acc[j - j0] += row[j];
    }
    for (int64_t j = j0; j < j1; j++) gb[j] = acc[j - j0];
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
#define KC 256  // K block: a packed B panel (KC x NR) stays in L1

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
// C (4, 24) = (accumulate ? C : 0) + Ap (k, 4)^T-interleaved @ Bp (k, 24)
static void micro_kernel(int64_t k, const float* Ap, const float* Bp, float* C, int64_t ldc, int accumulate) {
  __m256 c00 = _mm256_setzero_ps(), c01 = c00, c02 = c00, c10 = c00, c11 = c00, c12 = c00;
  __m256 c20 = c00, c21 = c00, c22 = c00, c30 = c00, c31 = c00, c32 = c00;
  for (int64_t i = 0; i < k; i++) {
    __m256 b0 = _mm256_loadu_ps(Bp), b1 = _mm256_loadu_ps(Bp + 8), b2 = _mm256_loadu_ps(Bp + 16);
    __m256 a = _mm256_broadcast_ss(Ap);
    c00 = _mm256_fmadd_ps(a, b0, c00); c01 = _mm256_fmadd_ps(a, b1, c01); c02 = _mm256_fmadd_ps(a, b2, c02);
    a = _mm256_broadcast_ss(Ap + 1);
    c10 = _mm256_fmadd_ps(a, b0, c10); c11 = _mm256_fmadd_ps(a, b1, c11); c12 = _mm256_fmadd_ps(a, b2, c12);
    a = _mm256_broadcast_ss(Ap + 2);
    c20 = _mm256_fmadd_ps(a, b0, c20); c21 = _mm256_fmadd_ps(a, b1, c21); c22 = _mm256_fmadd_ps(a, b2, c22);
    a = _mm256_broadcast_ss(Ap + 3);
    c30 = _mm256_fmadd_ps(a, b0, c30); c31 = _mm256_fmadd_ps(a, b1, c31); c32 = _mm256_fmadd_ps(a, b2, c32);
    Ap += MR;
    Bp += NR;
  }
  __m256 rows[MR][3] = {{c00, c01, c02}, {c10, c11, c12}, {c20, c21, c22}, {c30, c31, c32}};
  for (int r = 0; r < MR; r++) {
    float* c = C + r * ldc;
    for (int j = 0; j < 3; j++) {
      __m256 v = rows[r][j];
      if (accumulate) v = _mm256_add_ps(v, _mm256_loadu_ps(c + 8 * j));
      _mm256_storeu_ps(c + 8 * j, v);
    }
  }
}
#else
static void micro_kernel(int64_t k, const float* Ap, const float* Bp, float* C, int64_t ldc, int accumulate) {
  float acc[MR][NR] = {{0}};
  for (int64_t i = 0; i < k; i++, Ap += MR, Bp += NR)
    for (int r = 0; r < MR; r++)
      for (int j = 0; j < NR; j++) acc[r][j] += Ap[r] * Bp[j];
  for (int r = 0; r < MR; r++)
    for (int j = 0; j < NR; j++) C[r * ldc + j] = (accumulate ? C[r * ldc + j] : 0.0f) + acc[r][j];
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
        if (mm == MR && nn == NR) { micro_kernel(kc, ap, bp, c, ldc, acc); continue; }
        for (int64_t r = 0; r < mm; r++)  // partial tile: go through a full-size buffer
          for (int64_t j = 0; j < nn; j++) edge[r * NR + j] = acc ? c[r * ldc + j] : 0.0f;
        micro_kernel(kc, ap, bp, edge, NR, 1);
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

// packs B (K, N), element (k, j) at src[k*rs + j] (rows contiguous), into [ceil(N/24)][K][24]
static void pack_b(float* Bp, const float* src, int64_t rs, int64_t K, int64_t N) {
  for (int64_t n0 = 0; n0 < N; n0 += NR) {
    int64_t nn = N - n0 < NR ? N - n0 : NR;
    float* d = Bp + n0 * K;
    if (nn == NR) {
      for (int64_t k = 0; k < K; k++) memcpy(d + k * NR, src + k * rs + n0, NR * sizeof(float));  // inlined
    } else {
      for (int64_t k = 0; k < K; k++)
        for (int64_t j = 0; j < NR; j++) d[k * NR + j] = j < nn ? src[k * rs + n0 + j] : 0.0f;
    }
  }
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
    if (ih < 0 || ih >= H) { memset(r, 0, OW * sizeof(float)); continue; }
    const float* xr = x + ih * W + off_w;
    for (int64_t ow = 0; ow < lo; ow++) r[ow] = 0.0f;
    if (g->sw == 1) for (int64_t ow = lo; ow < hi; ow++) r[ow] = xr[ow];  // short rows: a loop beats memcpy
    else for (int64_t ow = lo; ow < hi; ow++) r[ow] = xr[ow * g->sw];
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

static int cpu_conv2d_forward(const fsdp_conv_geom* g, float* y, const float* x, const float* w, const float* b) {
  int64_t G = g->groups, Og = g->O / G, Cg = g->C / G, P = g->OH * g->OW, HW = g->H * g->W;
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
  int64_t K = Cg * g->kh * g->kw, KK = (int64_t)g->kh * g->kw * P, wsize = g->O * K;
  if (gb) {  // gb (O) = sum over n, p of gy (N, O, P)
#pragma omp parallel for if (g->N * g->O * P > 32768)
    for (int64_t o = 0; o < g->O; o++) {
      float s = 0.0f;
      for (int64_t n = 0; n < g->N; n++) s += sum_f32(gy + (n * g->O + o) * P, P);
      gb[o] = s;
    }
  }
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
    float *ga = mine, *bt = mine + (gw ? round_up(Og, MR) * P : 0);        // weight gradient operands
    float *gbp = mine + sa, *gcol = gbp + (gx ? round_up(P, NR) * Og : 0);  // input gradient operands
    float *row = mine + sa + sb, *gw_c = part0 + ch * wsize;
    for (int64_t n = g->N * ch / nchunk; n < g->N * (ch + 1) / nchunk; n++) {
      for (int64_t gi = 0; gi < G; gi++) {
        const float* gyg = gy + (n * g->O + gi * Og) * P;  // gy[n, g] (Og, P)
        if (gw) {  // gw[g] (Og, K) += gy[n, g] (Og, P) @ col^T (P, K)
          pack_a(ga, gyg, P, 1, Og, P);
          im2col_pack_wgrad(bt, row, x + (n * g->C + gi * Cg) * HW, g, Cg);
          gemm_packed(Og, K, P, ga, bt, gw_c + gi * Og * K, K, 1);
        }
        if (gx) {  // gcol (K, P) = w[g]^T (K, Og) @ gy[n, g] (Og, P); gx[n, g] = col2im(gcol)
          pack_b(gbp, gyg, P, Og, P);
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
            if (v > best || isnan(v) || bi < 0) { best = v; bi = ih * g->W + iw; if (isnan(v)) goto done; }
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
typedef struct { int64_t h0, h1, w0, w1; float inv; } avg_window;
static inline avg_window avg_win(const fsdp_conv_geom* g, int64_t oh, int64_t ow, int count_include_pad) {
  avg_window a;
  a.h0 = oh * g->sh - g->ph; a.w0 = ow * g->sw - g->pw;
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
        else for (int64_t ih = h0; ih < h1; ih++) s += sum_f32(xp + ih * g->W + w0, w1 - w0);
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

const fsdp_linalg_kernels fsdp_cpu_linalg_kernels = {
    .gemm = cpu_gemm,
    .gemm_batched = cpu_gemm_batched,
    .gemm_many = cpu_gemm_many,
    .bias_rows = cpu_bias_rows,
    .sum_rows = cpu_sum_rows,
    .conv2d_forward = cpu_conv2d_forward,
    .conv2d_backward = cpu_conv2d_backward,
    .max_pool2d_forward = cpu_max_pool2d_forward,
    .max_pool2d_backward = cpu_max_pool2d_backward,
    .avg_pool2d_forward = cpu_avg_pool2d_forward,
    .avg_pool2d_backward = cpu_avg_pool2d_backward,
    .adaptive_avg_pool2d_forward = cpu_adaptive_avg_pool2d_forward,
    .adaptive_avg_pool2d_backward = cpu_adaptive_avg_pool2d_backward,
};
