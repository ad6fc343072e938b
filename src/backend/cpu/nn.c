/*
 * backend/cpu/nn.c -- CPU kernels of the nn family (see core/kernels_nn.h): softmax, fused cross entropy,
 * nll, mse, layer norm, embedding, dropout and the attention softmax.
 *
 * Rows are independent, so the big loops run rows in parallel with OpenMP; inner loops are
 * plain (or `omp simd` reduction) loops over contiguous floats that the compiler vectorizes.
 * exp goes through fsdp_exp_nonpos(), a branch-free polynomial that vectorizes (libm's expf does not).
 */
// the float selects in fsdp_exp_nonpos() only if-convert (and so vectorize) without trapping math;
// nothing here relies on floating-point exception flags
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC optimize("no-trapping-math")
#endif

#include "core/core.h"
#include "backend/cpu/cpu.h"
#include "backend/cpu/fastmath.h"
#include "core/elem_math.h"

#include <math.h>
#include <omp.h>

#define PAR_MIN 32768  // elements below which a loop stays on one thread
#define TILE 64        // columns per tile when the reduced dim is strided (inner > 1)

// ---- softmax ---------------------------------------------------------------------------------------
// one contiguous row of length n; returns the row's logsumexp
static inline float softmax_row(float* y, const float* x, int64_t n, int log) {
  if (n == 0) return -INFINITY;  // logsumexp of no values
  float mx = -INFINITY, sum = 0.0f;
#pragma omp simd reduction(max : mx)
  for (int64_t i = 0; i < n; i++) mx = x[i] > mx ? x[i] : mx;
  if (log) {
#pragma omp simd reduction(+ : sum)
    for (int64_t i = 0; i < n; i++) sum += fsdp_exp_nonpos(x[i] - mx);
    // cppcheck-suppress invalidFunctionArg ; n >= 1 here, so the maximum's term makes sum >= 1
    float ls = logf(sum);
    for (int64_t i = 0; i < n; i++) y[i] = (x[i] - mx) - ls;
  } else {
#pragma omp simd reduction(+ : sum)
    for (int64_t i = 0; i < n; i++) {
      float e = fsdp_exp_nonpos(x[i] - mx);
      y[i] = e;
      sum += e;
    }
    float inv = 1.0f / sum;
    for (int64_t i = 0; i < n; i++) y[i] *= inv;
  }
  return mx + logf(sum);
}

// a tile of `len` columns (stride inner) of one (n, inner) slab: the same as softmax_row, with the
// per-column max and sum in small arrays so the inner loops run over contiguous columns
static void softmax_tile(float* y, const float* x, int64_t n, int64_t inner, int64_t len, int log) {
  float mx[TILE], sum[TILE];
  for (int64_t s = 0; s < len; s++) {
    mx[s] = -INFINITY;
    sum[s] = 0.0f;
  }
  for (int64_t c = 0; c < n; c++) {
    const float* xc = x + c * inner;
    for (int64_t s = 0; s < len; s++) mx[s] = xc[s] > mx[s] ? xc[s] : mx[s];
  }
  for (int64_t c = 0; c < n; c++) {
    const float* xc = x + c * inner;
    float* yc = y + c * inner;
    if (log) {
#pragma omp simd
      for (int64_t s = 0; s < len; s++) sum[s] += fsdp_exp_nonpos(xc[s] - mx[s]);
    } else {
#pragma omp simd
      for (int64_t s = 0; s < len; s++) {
        yc[s] = fsdp_exp_nonpos(xc[s] - mx[s]);
        sum[s] += yc[s];
      }
    }
  }
  if (log) {
    for (int64_t s = 0; s < len; s++) sum[s] = mx[s] + logf(sum[s]);  // logsumexp
    for (int64_t c = 0; c < n; c++)
      for (int64_t s = 0; s < len; s++) y[c * inner + s] = x[c * inner + s] - sum[s];
  } else {
    for (int64_t s = 0; s < len; s++) sum[s] = 1.0f / sum[s];
    for (int64_t c = 0; c < n; c++)
      for (int64_t s = 0; s < len; s++) y[c * inner + s] *= sum[s];
  }
}

static void cpu_softmax_forward(float* y, const float* x, int64_t outer, int64_t n, int64_t inner, int log) {
  if (inner == 1) {
#pragma omp parallel for schedule(static) if (outer * n > PAR_MIN)
    for (int64_t o = 0; o < outer; o++) softmax_row(y + o * n, x + o * n, n, log);
    return;
  }
  int64_t ntiles = (inner + TILE - 1) / TILE;
#pragma omp parallel for schedule(static) if (outer * n * inner > PAR_MIN)
  for (int64_t t = 0; t < outer * ntiles; t++) {
    int64_t o = t / ntiles, s0 = (t % ntiles) * TILE, len = inner - s0 < TILE ? inner - s0 : TILE;
    int64_t off = o * n * inner + s0;
    softmax_tile(y + off, x + off, n, inner, len, log);
  }
}

// softmax:     gx = y * (gy - sum(gy * y))
// log_softmax: gx = gy - exp(y) * sum(gy)
static inline void softmax_backward_row(float* gx, const float* gy, const float* y, int64_t n, int log) {
  float dot = 0.0f;
  if (log) {
#pragma omp simd reduction(+ : dot)
    for (int64_t i = 0; i < n; i++) dot += gy[i];
#pragma omp simd
    for (int64_t i = 0; i < n; i++) gx[i] = gy[i] - fsdp_exp_nonpos(y[i]) * dot;
  } else {
#pragma omp simd reduction(+ : dot)
    for (int64_t i = 0; i < n; i++) dot += gy[i] * y[i];
    for (int64_t i = 0; i < n; i++) gx[i] = y[i] * (gy[i] - dot);
  }
}

static void softmax_backward_tile(float* gx, const float* gy, const float* y, int64_t n, int64_t inner, int64_t len,
                                  int log) {
  float dot[TILE];
  for (int64_t s = 0; s < len; s++) dot[s] = 0.0f;
  for (int64_t c = 0; c < n; c++)
    for (int64_t s = 0; s < len; s++) dot[s] += log ? gy[c * inner + s] : gy[c * inner + s] * y[c * inner + s];
  for (int64_t c = 0; c < n; c++) {
    int64_t k = c * inner;
    if (log) {
#pragma omp simd
      for (int64_t s = 0; s < len; s++) gx[k + s] = gy[k + s] - fsdp_exp_nonpos(y[k + s]) * dot[s];
    } else {
      for (int64_t s = 0; s < len; s++) gx[k + s] = y[k + s] * (gy[k + s] - dot[s]);
    }
  }
}

static void cpu_softmax_backward(float* gx, const float* gy, const float* y, int64_t outer, int64_t n, int64_t inner,
                                 int log) {
  if (inner == 1) {
#pragma omp parallel for schedule(static) if (outer * n > PAR_MIN)
    for (int64_t o = 0; o < outer; o++) softmax_backward_row(gx + o * n, gy + o * n, y + o * n, n, log);
    return;
  }
  int64_t ntiles = (inner + TILE - 1) / TILE;
#pragma omp parallel for schedule(static) if (outer * n * inner > PAR_MIN)
  for (int64_t t = 0; t < outer * ntiles; t++) {
    int64_t o = t / ntiles, s0 = (t % ntiles) * TILE, len = inner - s0 < TILE ? inner - s0 : TILE;
    int64_t off = o * n * inner + s0;
    softmax_backward_tile(gx + off, gy + off, y + off, n, inner, len, log);
  }
}

// ---- cross entropy and nll -------------------------------------------------------------------------
static int cpu_check_targets(const int64_t* target, int64_t n, int64_t C, int64_t ignore_index, int64_t* bad,
                             int check) {
  (void)check;  // (synchronous: the op reports it)
  for (int64_t i = 0; i < n; i++) {
    int64_t t = target[i];
    if ((t < 0 || t >= C) && t != ignore_index) {
      *bad = t;
      return 1;
    }
  }
  return 0;
}

// loss of one position = lse - (1 - eps) * x[t] - eps / C * sum_c x[c]
// (PyTorch: (1 - eps) * nll + eps / C * sum_c -logp[c], with logp = x - lse)
static void cpu_cross_entropy_forward(float* loss, float* count, float* lse, const float* logits, const int64_t* target,
                                      int64_t N, int64_t C, int64_t S, int64_t ignore_index, float smoothing) {
  double total = 0.0;
  int64_t cnt = 0;
  float keep = 1.0f - smoothing, spread = smoothing / (float)C;
  if (S == 1) {
#pragma omp parallel for schedule(static) reduction(+ : total, cnt) if (N * C > PAR_MIN)
    for (int64_t n = 0; n < N; n++) {
      const float* x = logits + n * C;
      int64_t t = target[n];
      if (t == ignore_index) {
        lse[n] = 0.0f;
        continue;
      }
      float mx = -INFINITY, sum = 0.0f, sx = 0.0f;
#pragma omp simd reduction(max : mx)
      for (int64_t c = 0; c < C; c++) mx = x[c] > mx ? x[c] : mx;
#pragma omp simd reduction(+ : sum, sx)
      for (int64_t c = 0; c < C; c++) {
        sum += fsdp_exp_nonpos(x[c] - mx);
        sx += x[c];
      }
      // cppcheck-suppress invalidFunctionArg ; C >= 1 (the op rejects inputs without classes): sum >= 1
      float l = mx + logf(sum);
      lse[n] = l;
      total += (double)l - (double)keep * x[t] - (smoothing > 0.0f ? (double)spread * sx : 0.0);
      cnt++;
    }
  } else {
    int64_t ntiles = (S + TILE - 1) / TILE;
#pragma omp parallel for schedule(static) reduction(+ : total, cnt) if (N * C * S > PAR_MIN)
    for (int64_t tt = 0; tt < N * ntiles; tt++) {
      int64_t n = tt / ntiles, s0 = (tt % ntiles) * TILE, len = S - s0 < TILE ? S - s0 : TILE;
      const float* x = logits + n * C * S + s0;
      const int64_t* tg = target + n * S + s0;
      float mx[TILE], sum[TILE], sx[TILE];
      for (int64_t s = 0; s < len; s++) {
        mx[s] = -INFINITY;
        sum[s] = 0.0f;
        sx[s] = 0.0f;
      }
      for (int64_t c = 0; c < C; c++)
        for (int64_t s = 0; s < len; s++) mx[s] = x[c * S + s] > mx[s] ? x[c * S + s] : mx[s];
      for (int64_t c = 0; c < C; c++) {
#pragma omp simd
        for (int64_t s = 0; s < len; s++) {
          sum[s] += fsdp_exp_nonpos(x[c * S + s] - mx[s]);
          sx[s] += x[c * S + s];
        }
      }
      for (int64_t s = 0; s < len; s++) {
        float* l = lse + n * S + s0 + s;
        if (tg[s] == ignore_index) {
          *l = 0.0f;
          continue;
        }
        *l = mx[s] + logf(sum[s]);
        total += (double)*l - (double)keep * x[tg[s] * S + s] - (smoothing > 0.0f ? (double)spread * sx[s] : 0.0);
        cnt++;
      }
    }
  }
  loss[0] = (float)(total / (double)cnt);  // no valid target: 0/0 = nan
  count[0] = (float)cnt;
}

// gx = scale * (exp(x - lse) - eps / C - (1 - eps) * [c == t]); zero where the target is ignored
static void cpu_cross_entropy_backward(float* gx, const float* logits, const float* lse, const int64_t* target,
                                       int64_t N, int64_t C, int64_t S, int64_t ignore_index, float smoothing,
                                       const float* gy, const float* count) {
  float keep = 1.0f - smoothing, spread = smoothing / (float)C, scale = gy[0] / count[0];
  if (S == 1) {
#pragma omp parallel for schedule(static) if (N * C > PAR_MIN)
    for (int64_t n = 0; n < N; n++) {
      const float* x = logits + n * C;
      float* g = gx + n * C;
      int64_t t = target[n];
      if (t == ignore_index) {
        memset(g, 0, C * sizeof(float));
        continue;
      }
      float l = lse[n];
#pragma omp simd
      for (int64_t c = 0; c < C; c++) g[c] = scale * (fsdp_exp_nonpos(x[c] - l) - spread);
      g[t] -= scale * keep;
    }
    return;
  }
#pragma omp parallel for schedule(static) if (N * C * S > PAR_MIN)
  for (int64_t n = 0; n < N; n++) {
    const float* x = logits + n * C * S;
    const float* l = lse + n * S;
    const int64_t* tg = target + n * S;
    float* g = gx + n * C * S;
    for (int64_t c = 0; c < C; c++)
#pragma omp simd
      for (int64_t s = 0; s < S; s++) g[c * S + s] = scale * (fsdp_exp_nonpos(x[c * S + s] - l[s]) - spread);
    for (int64_t s = 0; s < S; s++) {
      if (tg[s] == ignore_index)
        for (int64_t c = 0; c < C; c++) g[c * S + s] = 0.0f;
      else g[tg[s] * S + s] -= scale * keep;
    }
  }
}

static void cpu_nll_forward(float* loss, float* count, const float* logp, const int64_t* target, int64_t N, int64_t C,
                            int64_t S, int64_t ignore_index) {
  double total = 0.0;
  int64_t cnt = 0;
  for (int64_t n = 0; n < N; n++)
    for (int64_t s = 0; s < S; s++) {
      int64_t t = target[n * S + s];
      if (t == ignore_index) continue;
      total -= logp[(n * C + t) * S + s];
      cnt++;
    }
  loss[0] = (float)(total / (double)cnt);
  count[0] = (float)cnt;
}

static void cpu_nll_backward(float* gx, const int64_t* target, int64_t N, int64_t C, int64_t S, int64_t ignore_index,
                             const float* gy, const float* count) {
  float scale = gy[0] / count[0];
  memset(gx, 0, N * C * S * sizeof(float));
  for (int64_t n = 0; n < N; n++)
    for (int64_t s = 0; s < S; s++) {
      int64_t t = target[n * S + s];
      if (t != ignore_index) gx[(n * C + t) * S + s] = -scale;
    }
}

// ---- mse ------------------------------------------------------------------------------------------------
static void cpu_mse_forward(float* loss, const float* a, const float* b, int64_t n) {
  double total = 0.0;
#pragma omp parallel for simd schedule(static) reduction(+ : total) if (n > PAR_MIN)
  for (int64_t i = 0; i < n; i++) {
    double d = (double)a[i] - (double)b[i];
    total += d * d;
  }
  loss[0] = (float)(total / (double)n);
}

static void cpu_mse_backward(float* ga, float* gb, const float* a, const float* b, int64_t n, const float* gy) {
  float scale = 2.0f * gy[0] / (float)n;
#pragma omp parallel for schedule(static) if (n > PAR_MIN)
  for (int64_t i = 0; i < n; i++) {
    float g = scale * (a[i] - b[i]);
    if (ga) ga[i] = g;
    if (gb) gb[i] = -g;
  }
}

// ---- layer norm -------------------------------------------------------------------------------------------
static void cpu_layer_norm_forward(float* y, float* mean, float* rstd, const float* x, const float* w, const float* b,
                                   int64_t M, int64_t D, float eps) {
#pragma omp parallel for schedule(static) if (M * D > PAR_MIN)
  for (int64_t m = 0; m < M; m++) {
    const float* xr = x + m * D;
    float* yr = y + m * D;
    float s = 0.0f, v = 0.0f;
#pragma omp simd reduction(+ : s)
    for (int64_t d = 0; d < D; d++) s += xr[d];
    float mu = s / (float)D;
#pragma omp simd reduction(+ : v)
    for (int64_t d = 0; d < D; d++) v += (xr[d] - mu) * (xr[d] - mu);
    float rs = 1.0f / sqrtf(v / (float)D + eps);
    mean[m] = mu;
    rstd[m] = rs;
    if (w && b)
      for (int64_t d = 0; d < D; d++) yr[d] = (xr[d] - mu) * rs * w[d] + b[d];
    else if (w)
      for (int64_t d = 0; d < D; d++) yr[d] = (xr[d] - mu) * rs * w[d];
    else if (b)
      for (int64_t d = 0; d < D; d++) yr[d] = (xr[d] - mu) * rs + b[d];
    else
      for (int64_t d = 0; d < D; d++) yr[d] = (xr[d] - mu) * rs;
  }
}

// xhat = (x - mean) * rstd, g = dy * w
// dx = rstd * (g - mean(g) - xhat * mean(g * xhat)); dw = sum_rows dy * xhat; db = sum_rows dy
static void cpu_layer_norm_backward(float* dx, float* dw, float* db, const float* dy, const float* x, const float* mean,
                                    const float* rstd, const float* w, int64_t M, int64_t D) {
  if (dx) {
#pragma omp parallel for schedule(static) if (M * D > PAR_MIN)
    for (int64_t m = 0; m < M; m++) {
      const float *xr = x + m * D, *gr = dy + m * D;
      float* dr = dx + m * D;
      float mu = mean[m], rs = rstd[m], sg = 0.0f, sgx = 0.0f;
      if (w) {
#pragma omp simd reduction(+ : sg, sgx)
        for (int64_t d = 0; d < D; d++) {
          float g = gr[d] * w[d];
          sg += g;
          sgx += g * (xr[d] - mu) * rs;
        }
      } else {
#pragma omp simd reduction(+ : sg, sgx)
        for (int64_t d = 0; d < D; d++) {
          sg += gr[d];
          sgx += gr[d] * (xr[d] - mu) * rs;
        }
      }
      sg /= (float)D;
      sgx /= (float)D;
      if (w)
        for (int64_t d = 0; d < D; d++) dr[d] = rs * (gr[d] * w[d] - sg - (xr[d] - mu) * rs * sgx);
      else
        for (int64_t d = 0; d < D; d++) dr[d] = rs * (gr[d] - sg - (xr[d] - mu) * rs * sgx);
    }
  }
  if (!dw && !db) return;
    // columns are split between threads so each thread owns its slice of dw/db (no reduction buffers)
#pragma omp parallel if (M * D > PAR_MIN)
  {
    int nt = omp_get_num_threads(), id = omp_get_thread_num();
    int64_t d0 = D * id / nt, d1 = D * (id + 1) / nt;
    if (dw)
      for (int64_t d = d0; d < d1; d++) dw[d] = 0.0f;
    if (db)
      for (int64_t d = d0; d < d1; d++) db[d] = 0.0f;
    for (int64_t m = 0; m < M; m++) {
      const float *xr = x + m * D, *gr = dy + m * D;
      float mu = mean[m], rs = rstd[m];
      if (dw)
        for (int64_t d = d0; d < d1; d++) dw[d] += gr[d] * (xr[d] - mu) * rs;
      if (db)
        for (int64_t d = d0; d < d1; d++) db[d] += gr[d];
    }
  }
}

// ---- embedding ------------------------------------------------------------------------------------------
static void cpu_embedding_forward(float* y, const float* w, const int64_t* idx, int64_t n, int64_t V, int64_t D) {
  (void)V;  // (checked by the op: this device is synchronous)
#pragma omp parallel for schedule(static) if (n * D > PAR_MIN)
  for (int64_t i = 0; i < n; i++) memcpy(y + i * D, w + idx[i] * D, D * sizeof(float));
}

static void cpu_embedding_backward(float* gw, const float* gy, const int64_t* idx, int64_t n, int64_t V, int64_t D,
                                   int64_t padding_idx) {
  memset(gw, 0, V * D * sizeof(float));
  // rows may repeat, so threads split the columns instead of the indices
#pragma omp parallel if (n * D > PAR_MIN)
  {
    int nt = omp_get_num_threads(), id = omp_get_thread_num();
    int64_t d0 = D * id / nt, d1 = D * (id + 1) / nt;
    for (int64_t i = 0; i < n; i++) {
      if (idx[i] == padding_idx) continue;
      float* g = gw + idx[i] * D;
      const float* s = gy + i * D;
      for (int64_t d = d0; d < d1; d++) g[d] += s[d];
    }
  }
}

// ---- dropout ---------------------------------------------------------------------------------------------
// keep element i unless the top 24 bits of splitmix64(seed, i), as a fraction, fall below p
// (core/elem_math.h: the same mask on every device)
static void cpu_dropout(float* y, const float* x, int64_t n, float p, uint64_t seed) {
  uint32_t thresh = (uint32_t)((double)p * 16777216.0);
  float scale = p < 1.0f ? 1.0f / (1.0f - p) : 0.0f;
#pragma omp parallel for schedule(static) if (n > PAR_MIN)
  for (int64_t i = 0; i < n; i++) y[i] = fsdp_keep24(seed, i) >= thresh ? x[i] * scale : 0.0f;
}

// ---- attention softmax ----------------------------------------------------------------------------------
static void cpu_attn_softmax(const fsdp_attn_geom* g, float* P, const float* mask, const int64_t* mask_boff) {
  int64_t B = g->B, Tq = g->Tq, Tk = g->Tk, msq = g->mask_sq, msk = g->mask_sk;
  int causal = g->causal;
#pragma omp parallel for schedule(static) if (B * Tq * Tk > PAR_MIN)
  for (int64_t r = 0; r < B * Tq; r++) {
    int64_t b = r / Tq, i = r % Tq;
    float* p = P + r * Tk;
    int64_t len = causal ? (i + 1 < Tk ? i + 1 : Tk) : Tk;  // causal: keys j <= i
    if (mask) {
      const float* m = mask + mask_boff[b] + i * msq;
      if (msk == 1)
        for (int64_t j = 0; j < len; j++) p[j] += m[j];
      else
        for (int64_t j = 0; j < len; j++) p[j] += m[j * msk];
    }
    softmax_row(p, p, len, 0);
    for (int64_t j = len; j < Tk; j++) p[j] = 0.0f;
  }
}

const fsdp_nn_kernels FSDP_ISA_NAME(fsdp_cpu_nn_kernels) = {
    .softmax_forward = cpu_softmax_forward,
    .softmax_backward = cpu_softmax_backward,
    .check_targets = cpu_check_targets,
    .cross_entropy_forward = cpu_cross_entropy_forward,
    .cross_entropy_backward = cpu_cross_entropy_backward,
    .nll_forward = cpu_nll_forward,
    .nll_backward = cpu_nll_backward,
    .mse_forward = cpu_mse_forward,
    .mse_backward = cpu_mse_backward,
    .layer_norm_forward = cpu_layer_norm_forward,
    .layer_norm_backward = cpu_layer_norm_backward,
    .embedding_forward = cpu_embedding_forward,
    .embedding_backward = cpu_embedding_backward,
    .dropout = cpu_dropout,
    .attn_softmax = cpu_attn_softmax,
};
