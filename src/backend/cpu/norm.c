/*
 * backend/cpu/norm.c -- CPU kernels of the norm family (see core/kernels_norm.h): batch norm in
 * pieces (per-channel sums, statistics and running averages, apply, backward sums, backward),
 * group norm and RMS norm.
 *
 * x is (N, C, S): a channel's values are N runs of S contiguous floats. The per-channel reductions
 * run channels in parallel, each summing its N runs in double (a channel may hold millions of
 * values, and the statistics of one big batch must not depend on how it was split between ranks
 * beyond float32 rounding); the elementwise passes run the (n, c) rows in parallel.
 */
#include "core/core.h"
#include "backend/cpu/cpu.h"

#include <math.h>
#include <omp.h>

#define PAR_MIN 32768  // elements below which a loop stays on one thread

// ---- batch norm ----------------------------------------------------------------------------------
static void cpu_batch_norm_sums(float* out, const float* x, const float* s1, int64_t N, int64_t C, int64_t S) {
#pragma omp parallel for schedule(static) if (N * C * S > PAR_MIN)
  for (int64_t c = 0; c < C; c++) {
    double acc = 0.0;
    float mu = s1 ? s1[c] / s1[C] : 0.0f;
    for (int64_t n = 0; n < N; n++) {
      const float* xr = x + (n * C + c) * S;
      float part = 0.0f;
      if (s1) {
#pragma omp simd reduction(+ : part)
        for (int64_t s = 0; s < S; s++) part += (xr[s] - mu) * (xr[s] - mu);
      } else {
#pragma omp simd reduction(+ : part)
        for (int64_t s = 0; s < S; s++) part += xr[s];
      }
      acc += part;
    }
    out[c] = (float)acc;
  }
  if (!s1) out[C] = (float)(N * S);
}

static void cpu_batch_norm_stats(float* mean, float* invstd, float* rmean, float* rvar, const float* s1,
                                 const float* s2, int64_t C, float eps, float momentum) {
  for (int64_t c = 0; c < C; c++) {
    if (!s1) {
      mean[c] = rmean[c];
      invstd[c] = 1.0f / sqrtf(rvar[c] + eps);
      continue;
    }
    float cnt = s1[C], mu = s1[c] / cnt, var = s2[c] / cnt;
    mean[c] = mu;
    invstd[c] = 1.0f / sqrtf(var + eps);
    if (rmean) {
      float unbiased = cnt > 1.0f ? s2[c] / (cnt - 1.0f) : NAN;
      rmean[c] = (1.0f - momentum) * rmean[c] + momentum * mu;
      rvar[c] = (1.0f - momentum) * rvar[c] + momentum * unbiased;
    }
  }
}

static void cpu_batch_norm_apply(float* y, const float* x, const float* mean, const float* invstd, const float* w,
                                 const float* b, int64_t N, int64_t C, int64_t S) {
#pragma omp parallel for schedule(static) if (N * C * S > PAR_MIN)
  for (int64_t r = 0; r < N * C; r++) {
    int64_t c = r % C;
    float sc = invstd[c] * (w ? w[c] : 1.0f), sh = (b ? b[c] : 0.0f) - mean[c] * sc;
    const float* xr = x + r * S;
    float* yr = y + r * S;
#pragma omp simd
    for (int64_t s = 0; s < S; s++) yr[s] = xr[s] * sc + sh;
  }
}

static void cpu_batch_norm_backward_sums(float* g, const float* dy, const float* x, const float* mean, int64_t N,
                                         int64_t C, int64_t S) {
#pragma omp parallel for schedule(static) if (N * C * S > PAR_MIN)
  for (int64_t c = 0; c < C; c++) {
    double a = 0.0, b = 0.0;
    float mu = mean[c];
    for (int64_t n = 0; n < N; n++) {
      const float *xr = x + (n * C + c) * S, *gr = dy + (n * C + c) * S;
      float pa = 0.0f, pb = 0.0f;
#pragma omp simd reduction(+ : pa, pb)
      for (int64_t s = 0; s < S; s++) {
        pa += gr[s];
        pb += gr[s] * (xr[s] - mu);
      }
      a += pa;
      b += pb;
    }
    g[c] = (float)a;
    g[C + c] = (float)b;
  }
}

static void cpu_batch_norm_backward(float* dx, float* dw, float* db, const float* dy, const float* x, const float* mean,
                                    const float* invstd, const float* w, const float* g_local, const float* g,
                                    const float* s1, int64_t N, int64_t C, int64_t S) {
  for (int64_t c = 0; c < C; c++) {
    if (dw) dw[c] = g_local[C + c] * invstd[c];
    if (db) db[c] = g_local[c];
  }
  if (!dx) return;
  float cnt = g ? s1[C] : 1.0f;
#pragma omp parallel for schedule(static) if (N * C * S > PAR_MIN)
  for (int64_t r = 0; r < N * C; r++) {
    int64_t c = r % C;
    float is = invstd[c], sc = is * (w ? w[c] : 1.0f), mu = mean[c];
    const float *xr = x + r * S, *gr = dy + r * S;
    float* dr = dx + r * S;
    if (!g) {
#pragma omp simd
      for (int64_t s = 0; s < S; s++) dr[s] = gr[s] * sc;
      continue;
    }
    float mdy = g[c] / cnt, k = is * is * g[C + c] / cnt;
#pragma omp simd
    for (int64_t s = 0; s < S; s++) dr[s] = sc * (gr[s] - mdy - (xr[s] - mu) * k);
  }
}

// ---- group norm ----------------------------------------------------------------------------------
// each (n, group) is a contiguous block of (C / G) * S values
static void cpu_group_norm_forward(float* y, float* mean, float* rstd, const float* x, const float* w, const float* b,
                                   int64_t N, int64_t C, int64_t S, int64_t G, float eps) {
  int64_t Cg = C / G, D = Cg * S;
#pragma omp parallel for schedule(static) if (N * C * S > PAR_MIN)
  for (int64_t r = 0; r < N * G; r++) {
    const float* xr = x + r * D;
    float* yr = y + r * D;
    double s = 0.0, v = 0.0;
    for (int64_t d = 0; d < D; d++) s += xr[d];
    float mu = (float)(s / (double)D);
    for (int64_t d = 0; d < D; d++) v += (double)(xr[d] - mu) * (xr[d] - mu);
    float rs = 1.0f / sqrtf((float)(v / (double)D) + eps);
    mean[r] = mu;
    rstd[r] = rs;
    for (int64_t j = 0; j < Cg; j++) {
      int64_t c = (r % G) * Cg + j;
      float sc = rs * (w ? w[c] : 1.0f), sh = (b ? b[c] : 0.0f) - mu * sc;
      const float* xc = xr + j * S;
      float* yc = yr + j * S;
#pragma omp simd
      for (int64_t i = 0; i < S; i++) yc[i] = xc[i] * sc + sh;
    }
  }
}

// xhat = (x - mean) * rstd, g = dy * w[c]; per (n, group): dx = rstd * (g - mean(g) - xhat * mean(g * xhat));
// dw[c] = sum over n, s of dy * xhat; db[c] = sum of dy
static void cpu_group_norm_backward(float* dx, float* dw, float* db, const float* dy, const float* x, const float* mean,
                                    const float* rstd, const float* w, int64_t N, int64_t C, int64_t S, int64_t G) {
  int64_t Cg = C / G, D = Cg * S;
  if (dx) {
#pragma omp parallel for schedule(static) if (N * C * S > PAR_MIN)
    for (int64_t r = 0; r < N * G; r++) {
      const float *xr = x + r * D, *gr = dy + r * D;
      float* dr = dx + r * D;
      float mu = mean[r], rs = rstd[r];
      double sg = 0.0, sgx = 0.0;
      for (int64_t j = 0; j < Cg; j++) {
        float wc = w ? w[(r % G) * Cg + j] : 1.0f;
        for (int64_t i = 0; i < S; i++) {
          float gv = gr[j * S + i] * wc;
          sg += gv;
          sgx += gv * (xr[j * S + i] - mu) * rs;
        }
      }
      float mg = (float)(sg / (double)D), mgx = (float)(sgx / (double)D);
      for (int64_t j = 0; j < Cg; j++) {
        float wc = w ? w[(r % G) * Cg + j] : 1.0f;
        for (int64_t i = 0; i < S; i++) {
          int64_t k = j * S + i;
          dr[k] = rs * (gr[k] * wc - mg - (xr[k] - mu) * rs * mgx);
        }
      }
    }
  }
  if (!dw && !db) return;
#pragma omp parallel for schedule(static) if (N * C * S > PAR_MIN)
  for (int64_t c = 0; c < C; c++) {
    double a = 0.0, bsum = 0.0;
    for (int64_t n = 0; n < N; n++) {
      int64_t r = n * G + c / Cg;
      const float *xr = x + (n * C + c) * S, *gr = dy + (n * C + c) * S;
      float mu = mean[r], rs = rstd[r];
      for (int64_t i = 0; i < S; i++) {
        a += gr[i] * (xr[i] - mu) * rs;
        bsum += gr[i];
      }
    }
    if (dw) dw[c] = (float)a;
    if (db) db[c] = (float)bsum;
  }
}

// ---- rms norm ------------------------------------------------------------------------------------
static void cpu_rms_norm_forward(float* y, float* rstd, const float* x, const float* w, int64_t M, int64_t D,
                                 float eps) {
#pragma omp parallel for schedule(static) if (M * D > PAR_MIN)
  for (int64_t m = 0; m < M; m++) {
    const float* xr = x + m * D;
    float* yr = y + m * D;
    float ss = 0.0f;
#pragma omp simd reduction(+ : ss)
    for (int64_t d = 0; d < D; d++) ss += xr[d] * xr[d];
    float rs = 1.0f / sqrtf(ss / (float)D + eps);
    rstd[m] = rs;
    if (w)
      for (int64_t d = 0; d < D; d++) yr[d] = xr[d] * rs * w[d];
    else
      for (int64_t d = 0; d < D; d++) yr[d] = xr[d] * rs;
  }
}

// xhat = x * rstd, g = dy * w: dx = rstd * (g - xhat * mean(g * xhat)); dw = sum over rows of dy * xhat
static void cpu_rms_norm_backward(float* dx, float* dw, const float* dy, const float* x, const float* rstd,
                                  const float* w, int64_t M, int64_t D) {
  if (dx) {
#pragma omp parallel for schedule(static) if (M * D > PAR_MIN)
    for (int64_t m = 0; m < M; m++) {
      const float *xr = x + m * D, *gr = dy + m * D;
      float* dr = dx + m * D;
      float rs = rstd[m], sgx = 0.0f;
#pragma omp simd reduction(+ : sgx)
      for (int64_t d = 0; d < D; d++) sgx += gr[d] * (w ? w[d] : 1.0f) * xr[d] * rs;
      sgx /= (float)D;
      for (int64_t d = 0; d < D; d++) dr[d] = rs * (gr[d] * (w ? w[d] : 1.0f) - xr[d] * rs * sgx);
    }
  }
  if (!dw) return;
    // columns are split between threads so each thread owns its slice of dw
#pragma omp parallel if (M * D > PAR_MIN)
  {
    int nt = omp_get_num_threads(), id = omp_get_thread_num();
    int64_t d0 = D * id / nt, d1 = D * (id + 1) / nt;
    for (int64_t d = d0; d < d1; d++) dw[d] = 0.0f;
    for (int64_t m = 0; m < M; m++) {
      const float *xr = x + m * D, *gr = dy + m * D;
      for (int64_t d = d0; d < d1; d++) dw[d] += gr[d] * xr[d] * rstd[m];
    }
  }
}

const fsdp_norm_kernels FSDP_ISA_NAME(fsdp_cpu_norm_kernels) = {
    .batch_norm_sums = cpu_batch_norm_sums,
    .batch_norm_stats = cpu_batch_norm_stats,
    .batch_norm_apply = cpu_batch_norm_apply,
    .batch_norm_backward_sums = cpu_batch_norm_backward_sums,
    .batch_norm_backward = cpu_batch_norm_backward,
    .group_norm_forward = cpu_group_norm_forward,
    .group_norm_backward = cpu_group_norm_backward,
    .rms_norm_forward = cpu_rms_norm_forward,
    .rms_norm_backward = cpu_rms_norm_backward,
};
