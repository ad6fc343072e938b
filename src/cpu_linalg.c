/*
 * cpu_linalg.c -- CPU kernels of the linalg family (see kernels_linalg.h): GEMMs through
 * OpenBLAS, convolution (im2col + GEMM) and pooling loops.
 */
#include "internal.h"

#include <cblas.h>
#include <math.h>
#include <omp.h>

static void cpu_gemm(int ta, int tb, int64_t M, int64_t N, int64_t K, float alpha, const float* A, int64_t lda,
                     const float* B, int64_t ldb, float beta, float* C, int64_t ldc) {
  cblas_sgemm(CblasRowMajor, ta ? CblasTrans : CblasNoTrans, tb ? CblasTrans : CblasNoTrans, (int)M, (int)N, (int)K,
              alpha, A, (int)lda, B, (int)ldb, beta, C, (int)ldc);
}

static void cpu_gemm_batched(int64_t batch, int ta, int tb, int64_t M, int64_t N, int64_t K, float alpha,
                             const float* A, int64_t lda, int64_t sa, const float* B, int64_t ldb, int64_t sb,
                             float beta, float* C, int64_t ldc, int64_t sc) {
  for (int64_t b = 0; b < batch; b++)
    cpu_gemm(ta, tb, M, N, K, alpha, A + b * sa, lda, B + b * sb, ldb, beta, C + b * sc, ldc);
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

// ---- convolution: im2col + GEMM ------------------------------------------------------------------------------
// For one image and C channels: col (C*kh*kw, OH*OW), row (c, ki, kj), column (oh, ow).

static void im2col_channel(float* col, const float* x, const fsdp_conv_geom* g) {
  // one input channel x (H, W) -> kh*kw rows of col
  int64_t H = g->H, W = g->W, OH = g->OH, OW = g->OW;
  for (int ki = 0; ki < g->kh; ki++)
    for (int kj = 0; kj < g->kw; kj++) {
      float* row = col + (int64_t)(ki * g->kw + kj) * OH * OW;
      int64_t off_w = (int64_t)kj * g->dw - g->pw;
      // ow range whose iw = ow*sw + off_w lies in [0, W)
      int64_t lo = off_w >= 0 ? 0 : (-off_w + g->sw - 1) / g->sw;
      int64_t hi = W - off_w <= 0 ? 0 : (W - off_w + g->sw - 1) / g->sw;
      if (hi > OW) hi = OW;
      if (lo > hi) lo = hi;
      for (int64_t oh = 0; oh < OH; oh++) {
        float* r = row + oh * OW;
        int64_t ih = oh * g->sh - g->ph + (int64_t)ki * g->dh;
        if (ih < 0 || ih >= H) { memset(r, 0, OW * sizeof(float)); continue; }
        const float* xr = x + ih * W + off_w;
        for (int64_t ow = 0; ow < lo; ow++) r[ow] = 0.0f;
        if (g->sw == 1) memcpy(r + lo, xr + lo, (hi - lo) * sizeof(float));
        else for (int64_t ow = lo; ow < hi; ow++) r[ow] = xr[ow * g->sw];
        for (int64_t ow = hi; ow < OW; ow++) r[ow] = 0.0f;
      }
    }
}

static void col2im_channel(float* x, const float* col, const fsdp_conv_geom* g) {
  // x (H, W) = sum of the kh*kw rows of col scattered back (x overwritten)
  int64_t H = g->H, W = g->W, OH = g->OH, OW = g->OW;
  memset(x, 0, H * W * sizeof(float));
  for (int ki = 0; ki < g->kh; ki++)
    for (int kj = 0; kj < g->kw; kj++) {
      const float* row = col + (int64_t)(ki * g->kw + kj) * OH * OW;
      int64_t off_w = (int64_t)kj * g->dw - g->pw;
      int64_t lo = off_w >= 0 ? 0 : (-off_w + g->sw - 1) / g->sw;
      int64_t hi = W - off_w <= 0 ? 0 : (W - off_w + g->sw - 1) / g->sw;
      if (hi > OW) hi = OW;
      if (lo > hi) lo = hi;
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

static bool conv_is_pointwise(const fsdp_conv_geom* g) {
  return g->kh == 1 && g->kw == 1 && g->sh == 1 && g->sw == 1 && g->ph == 0 && g->pw == 0;
}

// col (C*kh*kw, P) of one image x (C, H, W)
static void im2col_image(float* col, const float* x, const fsdp_conv_geom* g) {
  int64_t HW = g->H * g->W, KP = (int64_t)g->kh * g->kw * g->OH * g->OW;
  for (int64_t c = 0; c < g->C; c++) im2col_channel(col + c * KP, x + c * HW, g);
}

// Images are independent, so convolution splits the batch across OpenMP threads, each with its own
// column buffer and single-threaded GEMMs (per-image GEMMs are too small to thread well inside
// BLAS). With fewer images than threads, images run one after another and BLAS threads each GEMM.
typedef struct { int nthreads, blas_threads; } conv_par;
static conv_par conv_par_begin(const fsdp_conv_geom* g) {
  conv_par p = {omp_get_max_threads(), openblas_get_num_threads()};
  int64_t flops = g->N * g->O * g->OH * g->OW * (g->C / g->groups) * g->kh * g->kw;
  if (p.nthreads > g->N || flops < 262144) p.nthreads = 1;
  if (p.nthreads > 1 && p.blas_threads > 1) openblas_set_num_threads(1);
  return p;
}
static void conv_par_end(conv_par p) {
  if (p.nthreads > 1 && p.blas_threads > 1) openblas_set_num_threads(p.blas_threads);
}

static int cpu_conv2d_forward(const fsdp_conv_geom* g, float* y, const float* x, const float* w, const float* b) {
  int64_t G = g->groups, Og = g->O / G, Cg = g->C / G, P = g->OH * g->OW, HW = g->H * g->W;
  int64_t K = Cg * g->kh * g->kw;           // GEMM inner size per group
  int64_t per = g->C * g->kh * g->kw * P;  // columns of one image
  bool pw = conv_is_pointwise(g);
  conv_par par = conv_par_begin(g);
  size_t col_bytes = pw ? 0 : (size_t)(par.nthreads * per) * sizeof(float);
  float* cols = pw ? NULL : fsdp_alloc(col_bytes, FSDP_CPU, FSDP_MEM_OTHER);
  if (!pw && !cols) { conv_par_end(par); return -1; }
#pragma omp parallel for num_threads(par.nthreads) schedule(static)
  for (int64_t n = 0; n < g->N; n++) {
    float* yn = y + n * g->O * P;  // (O, P)
    const float* col = x + n * g->C * HW;
    if (!pw) {
      float* mine = cols + omp_get_thread_num() * per;
      im2col_image(mine, col, g);
      col = mine;
    }
    if (b)
      for (int64_t o = 0; o < g->O; o++)
        for (int64_t p = 0; p < P; p++) yn[o * P + p] = b[o];
    // y[n, g] (Og, P) = w[g] (Og, K) @ col[g] (K, P)
    for (int64_t gi = 0; gi < G; gi++)
      cpu_gemm(0, 0, Og, P, K, 1.0f, w + gi * Og * K, K, col + gi * K * P, P, b ? 1.0f : 0.0f, yn + gi * Og * P, P);
  }
  conv_par_end(par);
  fsdp_free(cols, col_bytes, FSDP_CPU, FSDP_MEM_OTHER);
  return 0;
}

static int cpu_conv2d_backward(const fsdp_conv_geom* g, float* gx, float* gw, float* gb, const float* gy,
                               const float* x, const float* w) {
  int64_t G = g->groups, Og = g->O / G, Cg = g->C / G, P = g->OH * g->OW, HW = g->H * g->W;
  int64_t K = Cg * g->kh * g->kw, KK = (int64_t)g->kh * g->kw * P;
  int64_t per = g->C * g->kh * g->kw * P, wsize = g->O * K;
  if (gb) {  // gb (O) = sum over n, p of gy (N, O, P)
#pragma omp parallel for if (g->N * g->O * P > 32768)
    for (int64_t o = 0; o < g->O; o++) {
      float s = 0.0f;
      for (int64_t n = 0; n < g->N; n++) {
        const float* r = gy + (n * g->O + o) * P;
        for (int64_t p = 0; p < P; p++) s += r[p];
      }
      gb[o] = s;
    }
  }
  if (gw) memset(gw, 0, (size_t)wsize * sizeof(float));
  if ((!gx && !gw) || g->N == 0) return 0;
  bool pw = conv_is_pointwise(g);
  conv_par par = conv_par_begin(g);
  // per thread: a column buffer and a partial weight gradient, kept transposed: gwt[g] (K, Og)
  // (the GEMM shape (K, Og) <- (K, P) @ (P, Og) runs ~1.6x faster in OpenBLAS than (Og, K) <- (Og, P) @ (P, K))
  int64_t scratch = (pw ? 0 : per) + (gw ? wsize : 0);
  size_t bytes = (size_t)(par.nthreads * scratch) * sizeof(float);
  float* buf = fsdp_alloc(bytes, FSDP_CPU, FSDP_MEM_OTHER);
  if (!buf) { conv_par_end(par); return -1; }
#pragma omp parallel num_threads(par.nthreads)
  {
    int t = omp_get_thread_num();
    float* col = buf + t * scratch;
    float* gwt = col + (pw ? 0 : per);
    if (gw) memset(gwt, 0, (size_t)wsize * sizeof(float));
#pragma omp for schedule(static)
    for (int64_t n = 0; n < g->N; n++) {
      const float* gyn = gy + n * g->O * P;  // (O, P)
      if (gw) {  // gwt[g] (K, Og) += col[g] (K, P) @ gy[n, g]^T (P, Og)
        const float* src = x + n * g->C * HW;
        if (!pw) { im2col_image(col, src, g); src = col; }
        for (int64_t gi = 0; gi < G; gi++)
          cpu_gemm(0, 1, K, Og, P, 1.0f, src + gi * K * P, P, gyn + gi * Og * P, P, 1.0f, gwt + gi * K * Og, Og);
      }
      if (gx) {  // gcol[g] (K, P) = w[g]^T (K, Og) @ gy[n, g] (Og, P); col2im into gx[n]
        float* gxn = gx + n * g->C * HW;
        float* dst = pw ? gxn : col;
        for (int64_t gi = 0; gi < G; gi++)
          cpu_gemm(1, 0, K, P, Og, 1.0f, w + gi * Og * K, K, gyn + gi * Og * P, P, 0.0f, dst + gi * K * P, P);
        if (!pw)
          for (int64_t c = 0; c < g->C; c++) col2im_channel(gxn + c * HW, col + c * KK, g);
      }
    }
  }
  // gw[g] (Og, K) = sum over threads of gwt[g]^T
  for (int t = 0; gw && t < par.nthreads; t++) {
    const float* gwt = buf + t * scratch + (pw ? 0 : per);
    for (int64_t gi = 0; gi < G; gi++)
      for (int64_t o = 0; o < Og; o++)
        for (int64_t k = 0; k < K; k++) gw[(gi * Og + o) * K + k] += gwt[(gi * K + k) * Og + o];
  }
  conv_par_end(par);
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
        for (int64_t ih = h0; ih < h1; ih++)
          for (int64_t iw = w0; iw < w1; iw++) s += xp[ih * g->W + iw];
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
