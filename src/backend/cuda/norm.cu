/*
 * backend/cuda/norm.cu -- the norm kernels of the CUDA backend (core/kernels_norm.h;
 * backend/cpu/norm.c is the reference): batch norm in pieces, group norm, RMS norm.
 * x is (N, C, S). A per-channel reduction (batch norm's sums) is one block of 256 threads per
 * channel striding over its N runs of S values, reducing in shared memory (in double, as the CPU);
 * a group-norm group or an RMS-norm row is one block; the elementwise passes are grid-stride loops.
 * The statistics stay on the device: the count lives in s1[C], never read by the host.
 */
#include "backend/cuda/cuda_util.h"

#include <math.h>

#define NT 256  // threads per block

__device__ static inline double block_sum_d(double v, double* sh) {
  sh[threadIdx.x] = v;
  __syncthreads();
  for (int h = NT / 2; h > 0; h /= 2) {
    if (threadIdx.x < h) sh[threadIdx.x] += sh[threadIdx.x + h];
    __syncthreads();
  }
  double r = sh[0];
  __syncthreads();
  return r;
}
static unsigned grid_of(int64_t blocks) {
  return (unsigned)(blocks < 65535 * 8 ? (blocks > 0 ? blocks : 1) : 65535 * 8);
}

// ---- batch norm ----------------------------------------------------------------------------------
__global__ static void bn_sums_k(float* out, const float* x, const float* s1, int64_t N, int64_t C, int64_t S) {
  __shared__ double sh[NT];
  for (int64_t c = blockIdx.x; c < C; c += gridDim.x) {
    float mu = s1 ? s1[c] / s1[C] : 0.0f;
    double acc = 0.0;
    for (int64_t i = threadIdx.x; i < N * S; i += NT) {
      float v = x[((i / S) * C + c) * S + i % S];
      acc += s1 ? (double)((v - mu) * (v - mu)) : (double)v;
    }
    acc = block_sum_d(acc, sh);
    if (threadIdx.x == 0) out[c] = (float)acc;
  }
  if (!s1 && blockIdx.x == 0 && threadIdx.x == 0) out[C] = (float)(N * S);
}
static void cuda_batch_norm_sums(float* out, const float* x, const float* s1, int64_t N, int64_t C, int64_t S) {
  bn_sums_k<<<grid_of(C), NT, 0, fsdp_cuda_stream>>>(out, x, s1, N, C, S);
  FSDP_CUDA_LAUNCHED("batch_norm sums");
}

__global__ static void bn_stats_k(float* mean, float* invstd, float* rmean, float* rvar, const float* s1,
                                  const float* s2, int64_t C, float eps, float momentum) {
  for (int64_t c = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; c < C; c += (int64_t)gridDim.x * blockDim.x) {
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
static void cuda_batch_norm_stats(float* mean, float* invstd, float* rmean, float* rvar, const float* s1,
                                  const float* s2, int64_t C, float eps, float momentum) {
  if (C == 0) return;
  bn_stats_k<<<fsdp_cuda_blocks(C), NT, 0, fsdp_cuda_stream>>>(mean, invstd, rmean, rvar, s1, s2, C, eps, momentum);
  FSDP_CUDA_LAUNCHED("batch_norm stats");
}

__global__ static void bn_apply_k(float* y, const float* x, const float* mean, const float* invstd, const float* w,
                                  const float* b, int64_t n, int64_t C, int64_t S) {
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x) {
    int64_t c = (i / S) % C;
    float sc = invstd[c] * (w ? w[c] : 1.0f);
    y[i] = (x[i] - mean[c]) * sc + (b ? b[c] : 0.0f);
  }
}
static void cuda_batch_norm_apply(float* y, const float* x, const float* mean, const float* invstd, const float* w,
                                  const float* b, int64_t N, int64_t C, int64_t S) {
  int64_t n = N * C * S;
  if (n == 0) return;
  bn_apply_k<<<fsdp_cuda_blocks(n), NT, 0, fsdp_cuda_stream>>>(y, x, mean, invstd, w, b, n, C, S);
  FSDP_CUDA_LAUNCHED("batch_norm");
}

__global__ static void bn_backward_sums_k(float* g, const float* dy, const float* x, const float* mean, int64_t N,
                                          int64_t C, int64_t S) {
  __shared__ double sh[NT];
  for (int64_t c = blockIdx.x; c < C; c += gridDim.x) {
    float mu = mean[c];
    double a = 0.0, b = 0.0;
    for (int64_t i = threadIdx.x; i < N * S; i += NT) {
      int64_t k = ((i / S) * C + c) * S + i % S;
      a += dy[k];
      b += (double)(dy[k] * (x[k] - mu));
    }
    a = block_sum_d(a, sh);
    b = block_sum_d(b, sh);
    if (threadIdx.x == 0) {
      g[c] = (float)a;
      g[C + c] = (float)b;
    }
  }
}
static void cuda_batch_norm_backward_sums(float* g, const float* dy, const float* x, const float* mean, int64_t N,
                                          int64_t C, int64_t S) {
  bn_backward_sums_k<<<grid_of(C), NT, 0, fsdp_cuda_stream>>>(g, dy, x, mean, N, C, S);
  FSDP_CUDA_LAUNCHED("batch_norm backward sums");
}

__global__ static void bn_param_grads_k(float* dw, float* db, const float* invstd, const float* g_local, int64_t C) {
  for (int64_t c = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; c < C; c += (int64_t)gridDim.x * blockDim.x) {
    if (dw) dw[c] = g_local[C + c] * invstd[c];
    if (db) db[c] = g_local[c];
  }
}
__global__ static void bn_dx_k(float* dx, const float* dy, const float* x, const float* mean, const float* invstd,
                               const float* w, const float* g, const float* s1, int64_t n, int64_t C, int64_t S) {
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x) {
    int64_t c = (i / S) % C;
    float is = invstd[c], sc = is * (w ? w[c] : 1.0f);
    if (!g) {
      dx[i] = dy[i] * sc;
      continue;
    }
    float cnt = s1[C];
    dx[i] = sc * (dy[i] - g[c] / cnt - (x[i] - mean[c]) * is * is * g[C + c] / cnt);
  }
}
static void cuda_batch_norm_backward(float* dx, float* dw, float* db, const float* dy, const float* x,
                                     const float* mean, const float* invstd, const float* w, const float* g_local,
                                     const float* g, const float* s1, int64_t N, int64_t C, int64_t S) {
  if (C == 0) return;
  if (dw || db) bn_param_grads_k<<<fsdp_cuda_blocks(C), NT, 0, fsdp_cuda_stream>>>(dw, db, invstd, g_local, C);
  int64_t n = N * C * S;
  if (dx && n) bn_dx_k<<<fsdp_cuda_blocks(n), NT, 0, fsdp_cuda_stream>>>(dx, dy, x, mean, invstd, w, g, s1, n, C, S);
  FSDP_CUDA_LAUNCHED("batch_norm backward");
}

// ---- group norm: one block per (n, group) ------------------------------------------------------
__global__ static void gn_forward_k(float* y, float* mean, float* rstd, const float* x, const float* w, const float* b,
                                    int64_t N, int64_t C, int64_t S, int64_t G, float eps) {
  __shared__ double sh[NT];
  int64_t Cg = C / G, D = Cg * S;
  for (int64_t r = blockIdx.x; r < N * G; r += gridDim.x) {
    const float* xr = x + r * D;
    float* yr = y + r * D;
    double s = 0.0;
    for (int64_t d = threadIdx.x; d < D; d += NT) s += xr[d];
    float mu = (float)(block_sum_d(s, sh) / (double)D);
    double v = 0.0;
    for (int64_t d = threadIdx.x; d < D; d += NT) v += (double)(xr[d] - mu) * (xr[d] - mu);
    float rs = 1.0f / sqrtf((float)(block_sum_d(v, sh) / (double)D) + eps);
    if (threadIdx.x == 0) {
      mean[r] = mu;
      rstd[r] = rs;
    }
    for (int64_t d = threadIdx.x; d < D; d += NT) {
      int64_t c = (r % G) * Cg + d / S;
      yr[d] = (xr[d] - mu) * rs * (w ? w[c] : 1.0f) + (b ? b[c] : 0.0f);
    }
  }
}
static void cuda_group_norm_forward(float* y, float* mean, float* rstd, const float* x, const float* w, const float* b,
                                    int64_t N, int64_t C, int64_t S, int64_t G, float eps) {
  if (N * C * S == 0) return;
  gn_forward_k<<<grid_of(N * G), NT, 0, fsdp_cuda_stream>>>(y, mean, rstd, x, w, b, N, C, S, G, eps);
  FSDP_CUDA_LAUNCHED("group_norm");
}

__global__ static void gn_dx_k(float* dx, const float* dy, const float* x, const float* mean, const float* rstd,
                               const float* w, int64_t N, int64_t C, int64_t S, int64_t G) {
  __shared__ double sh[NT];
  int64_t Cg = C / G, D = Cg * S;
  for (int64_t r = blockIdx.x; r < N * G; r += gridDim.x) {
    const float *xr = x + r * D, *gr = dy + r * D;
    float mu = mean[r], rs = rstd[r];
    double sg = 0.0, sgx = 0.0;
    for (int64_t d = threadIdx.x; d < D; d += NT) {
      float gv = gr[d] * (w ? w[(r % G) * Cg + d / S] : 1.0f);
      sg += gv;
      sgx += gv * (xr[d] - mu) * rs;
    }
    float mg = (float)(block_sum_d(sg, sh) / (double)D), mgx = (float)(block_sum_d(sgx, sh) / (double)D);
    for (int64_t d = threadIdx.x; d < D; d += NT) {
      float gv = gr[d] * (w ? w[(r % G) * Cg + d / S] : 1.0f);
      dx[r * D + d] = rs * (gv - mg - (xr[d] - mu) * rs * mgx);
    }
  }
}
// dw, db: one block per channel
__global__ static void gn_dwdb_k(float* dw, float* db, const float* dy, const float* x, const float* mean,
                                 const float* rstd, int64_t N, int64_t C, int64_t S, int64_t G) {
  __shared__ double sh[NT];
  int64_t Cg = C / G;
  for (int64_t c = blockIdx.x; c < C; c += gridDim.x) {
    double a = 0.0, b = 0.0;
    for (int64_t i = threadIdx.x; i < N * S; i += NT) {
      int64_t n = i / S, k = (n * C + c) * S + i % S, r = n * G + c / Cg;
      a += dy[k] * (x[k] - mean[r]) * rstd[r];
      b += dy[k];
    }
    a = block_sum_d(a, sh);
    b = block_sum_d(b, sh);
    if (threadIdx.x == 0) {
      if (dw) dw[c] = (float)a;
      if (db) db[c] = (float)b;
    }
  }
}
static void cuda_group_norm_backward(float* dx, float* dw, float* db, const float* dy, const float* x,
                                     const float* mean, const float* rstd, const float* w, int64_t N, int64_t C,
                                     int64_t S, int64_t G) {
  if (C == 0) return;
  if (dx && N * S > 0) gn_dx_k<<<grid_of(N * G), NT, 0, fsdp_cuda_stream>>>(dx, dy, x, mean, rstd, w, N, C, S, G);
  // (no samples: the weight and bias gradients are empty sums, zeros, which the kernel writes)
  if (dw || db) gn_dwdb_k<<<grid_of(C), NT, 0, fsdp_cuda_stream>>>(dw, db, dy, x, mean, rstd, N, C, S, G);
  FSDP_CUDA_LAUNCHED("group_norm backward");
}

// ---- rms norm: one block per row -----------------------------------------------------------------
__global__ static void rms_forward_k(float* y, float* rstd, const float* x, const float* w, int64_t M, int64_t D,
                                     float eps) {
  __shared__ double sh[NT];
  for (int64_t m = blockIdx.x; m < M; m += gridDim.x) {
    const float* xr = x + m * D;
    double ss = 0.0;
    for (int64_t d = threadIdx.x; d < D; d += NT) ss += xr[d] * xr[d];
    float rs = 1.0f / sqrtf((float)(block_sum_d(ss, sh) / (double)D) + eps);
    if (threadIdx.x == 0) rstd[m] = rs;
    for (int64_t d = threadIdx.x; d < D; d += NT) y[m * D + d] = xr[d] * rs * (w ? w[d] : 1.0f);
  }
}
static void cuda_rms_norm_forward(float* y, float* rstd, const float* x, const float* w, int64_t M, int64_t D,
                                  float eps) {
  if (M * D == 0) return;
  rms_forward_k<<<grid_of(M), NT, 0, fsdp_cuda_stream>>>(y, rstd, x, w, M, D, eps);
  FSDP_CUDA_LAUNCHED("rms_norm");
}

__global__ static void rms_dx_k(float* dx, const float* dy, const float* x, const float* rstd, const float* w,
                                int64_t M, int64_t D) {
  __shared__ double sh[NT];
  for (int64_t m = blockIdx.x; m < M; m += gridDim.x) {
    const float *xr = x + m * D, *gr = dy + m * D;
    float rs = rstd[m];
    double sgx = 0.0;
    for (int64_t d = threadIdx.x; d < D; d += NT) sgx += gr[d] * (w ? w[d] : 1.0f) * xr[d] * rs;
    float mgx = (float)(block_sum_d(sgx, sh) / (double)D);
    for (int64_t d = threadIdx.x; d < D; d += NT) dx[m * D + d] = rs * (gr[d] * (w ? w[d] : 1.0f) - xr[d] * rs * mgx);
  }
}
__global__ static void rms_dw_k(float* dw, const float* dy, const float* x, const float* rstd, int64_t M, int64_t D) {
  for (int64_t d = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; d < D; d += (int64_t)gridDim.x * blockDim.x) {
    float s = 0.0f;
    for (int64_t m = 0; m < M; m++) s += dy[m * D + d] * x[m * D + d] * rstd[m];
    dw[d] = s;
  }
}
static void cuda_rms_norm_backward(float* dx, float* dw, const float* dy, const float* x, const float* rstd,
                                   const float* w, int64_t M, int64_t D) {
  if (M == 0 && D > 0 && dw) cudaMemsetAsync(dw, 0, D * sizeof(float), fsdp_cuda_stream);  // (an empty sum)
  if (M * D == 0) return;
  if (dx) rms_dx_k<<<grid_of(M), NT, 0, fsdp_cuda_stream>>>(dx, dy, x, rstd, w, M, D);
  if (dw) rms_dw_k<<<fsdp_cuda_blocks(D), NT, 0, fsdp_cuda_stream>>>(dw, dy, x, rstd, M, D);
  FSDP_CUDA_LAUNCHED("rms_norm backward");
}

const fsdp_norm_kernels fsdp_cuda_norm_kernels = {
    cuda_batch_norm_sums,          cuda_batch_norm_stats,    cuda_batch_norm_apply,
    cuda_batch_norm_backward_sums, cuda_batch_norm_backward, cuda_group_norm_forward,
    cuda_group_norm_backward,      cuda_rms_norm_forward,    cuda_rms_norm_backward,
};
