/*
 * backend/cuda/nn.cu -- the nn kernels of the CUDA backend (core/kernels_nn.h; backend/cpu/nn.c is
 * the reference): softmax, fused cross entropy, nll, mse, layer norm, embedding, dropout and the
 * attention softmax. A row of a softmax, a loss position or a layer-norm row is one block of 256
 * threads reducing in shared memory; strided layouts (inner > 1) take one thread per column.
 *
 * The losses stay on the device: partial sums go to a device accumulator with atomics, and a
 * one-thread kernel writes the mean and the count into the op's buffers; the host never waits.
 */
#include "backend/cuda/cuda_util.h"
#include "core/elem_math.h"

#include <math.h>

#define NT 256  // threads per block

// block-wide sum and max of one value per thread (every thread gets the result): each warp reduces
// its 32 values with shuffles, lane 0 of each leaves the warp's result in sh, the first warp reduces
// those NT / 32, and its lane 0 leaves the block's in sh[0] (three barriers, where a tree through
// shared memory took ten)
__device__ static inline float warp_sum(float v) {
  for (int d = 16; d > 0; d /= 2) v += __shfl_down_sync(0xffffffffu, v, d);
  return v;  // (lane 0's is the warp's sum)
}
__device__ static inline float warp_max(float v) {
  for (int d = 16; d > 0; d /= 2) v = fmaxf(v, __shfl_down_sync(0xffffffffu, v, d));
  return v;
}
__device__ static inline float block_sum(float v, float* sh) {
  v = warp_sum(v);
  if (threadIdx.x % 32 == 0) sh[threadIdx.x / 32] = v;
  __syncthreads();
  if (threadIdx.x < 32) {
    v = warp_sum(threadIdx.x < NT / 32 ? sh[threadIdx.x] : 0.0f);
    if (threadIdx.x == 0) sh[0] = v;
  }
  __syncthreads();
  float r = sh[0];
  __syncthreads();
  return r;
}
__device__ static inline float block_max(float v, float* sh) {
  v = warp_max(v);
  if (threadIdx.x % 32 == 0) sh[threadIdx.x / 32] = v;
  __syncthreads();
  if (threadIdx.x < 32) {
    v = warp_max(threadIdx.x < NT / 32 ? sh[threadIdx.x] : -INFINITY);
    if (threadIdx.x == 0) sh[0] = v;
  }
  __syncthreads();
  float r = sh[0];
  __syncthreads();
  return r;
}
static unsigned rows_grid(int64_t rows) { return (unsigned)(rows < 65535 * 8 ? (rows > 0 ? rows : 1) : 65535 * 8); }

// ---- softmax --------------------------------------------------------------------------------------
// rows (inner == 1): one block per row; returns nothing, writes y (softmax or log_softmax)
__global__ static void softmax_rows_k(float* y, const float* x, int64_t rows, int64_t n, int log) {
  __shared__ float sh[NT];
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const float* xr = x + r * n;
    float* yr = y + r * n;
    float mx = -INFINITY;
    for (int64_t i = threadIdx.x; i < n; i += NT) mx = fmaxf(mx, xr[i]);
    mx = block_max(mx, sh);
    float s = 0.0f;
    for (int64_t i = threadIdx.x; i < n; i += NT) s += expf(xr[i] - mx);
    s = block_sum(s, sh);
    if (log) {
      float ls = logf(s);
      for (int64_t i = threadIdx.x; i < n; i += NT) yr[i] = (xr[i] - mx) - ls;
    } else {
      float inv = 1.0f / s;
      for (int64_t i = threadIdx.x; i < n; i += NT) yr[i] = expf(xr[i] - mx) * inv;
    }
  }
}
// columns (inner > 1): one thread per (outer, column) runs down the n elements
__global__ static void softmax_cols_k(float* y, const float* x, int64_t outer, int64_t n, int64_t inner, int log) {
  for (int64_t w = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; w < outer * inner;
       w += (int64_t)gridDim.x * blockDim.x) {
    int64_t o = w / inner, s = w % inner;
    const float* xc = x + o * n * inner + s;
    float* yc = y + o * n * inner + s;
    float mx = -INFINITY, sum = 0.0f;
    for (int64_t c = 0; c < n; c++) mx = fmaxf(mx, xc[c * inner]);
    for (int64_t c = 0; c < n; c++) sum += expf(xc[c * inner] - mx);
    float ls = logf(sum), inv = 1.0f / sum;
    for (int64_t c = 0; c < n; c++) {
      float d = xc[c * inner] - mx;
      yc[c * inner] = log ? d - ls : expf(d) * inv;
    }
  }
}
static void cuda_softmax_forward(float* y, const float* x, int64_t outer, int64_t n, int64_t inner, int log) {
  if (outer * n * inner == 0) return;
  if (inner == 1) softmax_rows_k<<<rows_grid(outer), NT, 0, fsdp_cuda_stream>>>(y, x, outer, n, log);
  else softmax_cols_k<<<fsdp_cuda_blocks(outer * inner), NT, 0, fsdp_cuda_stream>>>(y, x, outer, n, inner, log);
  FSDP_CUDA_LAUNCHED("softmax");
}

// softmax: gx = y * (gy - sum(gy * y)); log_softmax: gx = gy - exp(y) * sum(gy)
__global__ static void softmax_bw_rows_k(float* gx, const float* gy, const float* y, int64_t rows, int64_t n, int log) {
  __shared__ float sh[NT];
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const float *g = gy + r * n, *yr = y + r * n;
    float* o = gx + r * n;
    float dot = 0.0f;
    for (int64_t i = threadIdx.x; i < n; i += NT) dot += log ? g[i] : g[i] * yr[i];
    dot = block_sum(dot, sh);
    for (int64_t i = threadIdx.x; i < n; i += NT) o[i] = log ? g[i] - expf(yr[i]) * dot : yr[i] * (g[i] - dot);
  }
}
__global__ static void softmax_bw_cols_k(float* gx, const float* gy, const float* y, int64_t outer, int64_t n,
                                         int64_t inner, int log) {
  for (int64_t w = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; w < outer * inner;
       w += (int64_t)gridDim.x * blockDim.x) {
    int64_t off = (w / inner) * n * inner + w % inner;
    float dot = 0.0f;
    for (int64_t c = 0; c < n; c++) dot += log ? gy[off + c * inner] : gy[off + c * inner] * y[off + c * inner];
    for (int64_t c = 0; c < n; c++) {
      int64_t k = off + c * inner;
      gx[k] = log ? gy[k] - expf(y[k]) * dot : y[k] * (gy[k] - dot);
    }
  }
}
static void cuda_softmax_backward(float* gx, const float* gy, const float* y, int64_t outer, int64_t n, int64_t inner,
                                  int log) {
  if (outer * n * inner == 0) return;
  if (inner == 1) softmax_bw_rows_k<<<rows_grid(outer), NT, 0, fsdp_cuda_stream>>>(gx, gy, y, outer, n, log);
  else softmax_bw_cols_k<<<fsdp_cuda_blocks(outer * inner), NT, 0, fsdp_cuda_stream>>>(gx, gy, y, outer, n, inner, log);
  FSDP_CUDA_LAUNCHED("softmax backward");
}

// ---- sums on the device: (sum, count) accumulated with atomics, then the mean written ---------------------
typedef struct {
  double sum;
  unsigned long long count;
} accum;
static accum* accum_new(void) {
  accum* a = NULL;
  if (cudaMallocAsync((void**)&a, sizeof *a, fsdp_cuda_stream) != cudaSuccess) {
    fsdp_cuda_fail("loss", cudaGetLastError());
    return NULL;
  }
  cudaMemsetAsync(a, 0, sizeof *a, fsdp_cuda_stream);
  return a;
}
// loss[0] = sum / (count, or n when n > 0), count[0] = count (count may be NULL); frees a in stream order
__global__ static void accum_done_k(const accum* a, float* loss, float* count, int64_t n) {
  double c = n > 0 ? (double)n : (double)a->count;
  loss[0] = (float)(a->sum / c);  // nothing counted: 0/0 = nan
  if (count) count[0] = (float)a->count;
}
static void accum_done(accum* a, float* loss, float* count, int64_t n) {
  accum_done_k<<<1, 1, 0, fsdp_cuda_stream>>>(a, loss, count, n);
  cudaFreeAsync(a, fsdp_cuda_stream);
  FSDP_CUDA_LAUNCHED("loss");
}

// ---- cross entropy and nll ------------------------------------------------------------------------------
// deferred, as index_check (elem.cu): a bad target claims the error slot, reported at the next wait
__global__ static void check_targets_k(const int64_t* t, int64_t n, int64_t C, int64_t ignore, int check,
                                       fsdp_cuda_check_slot* slot) {
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x)
    if ((t[i] < 0 || t[i] >= C) && t[i] != ignore) fsdp_cuda_check_fail(slot, check, t[i]);
}
static int cuda_check_targets(const int64_t* target, int64_t n, int64_t C, int64_t ignore_index, int64_t* bad,
                              int check) {
  (void)bad;  // (only a synchronous device reports the value here)
  if (n > 0) {
    check_targets_k<<<fsdp_cuda_blocks(n), NT, 0, fsdp_cuda_stream>>>(target, n, C, ignore_index, check,
                                                                      fsdp_cuda_slot);
    FSDP_CUDA_LAUNCHED("target check");
  }
  return 0;
}

// A target or index out of range (its deferred check failed, reported at the next wait) counts as
// ignored below: the kernels never read outside their tables.
// loss of one position = lse - (1 - eps) x[t] - eps / C sum_c x[c]: one block per (n, s)
__global__ static void ce_forward_k(float* lse, const float* logits, const int64_t* target, int64_t N, int64_t C,
                                    int64_t S, int64_t ignore, float smoothing, accum* acc) {
  __shared__ float sh[NT];
  float keep = 1.0f - smoothing, spread = smoothing / (float)C;
  for (int64_t w = blockIdx.x; w < N * S; w += gridDim.x) {
    int64_t n = w / S, s = w % S, t = target[w];
    if (t == ignore || t < 0 || t >= C) {
      if (threadIdx.x == 0) lse[w] = 0.0f;
      continue;
    }
    const float* x = logits + n * C * S + s;
    float mx = -INFINITY;
    for (int64_t c = threadIdx.x; c < C; c += NT) mx = fmaxf(mx, x[c * S]);
    mx = block_max(mx, sh);
    float sum = 0.0f, sx = 0.0f;
    for (int64_t c = threadIdx.x; c < C; c += NT) {
      sum += expf(x[c * S] - mx);
      sx += x[c * S];
    }
    sum = block_sum(sum, sh);
    sx = block_sum(sx, sh);
    if (threadIdx.x == 0) {
      float l = mx + logf(sum);
      lse[w] = l;
      atomicAdd(&acc->sum, (double)l - (double)keep * x[t * S] - (smoothing > 0.0f ? (double)spread * sx : 0.0));
      atomicAdd(&acc->count, 1ull);
    }
  }
}
static void cuda_cross_entropy_forward(float* loss, float* count, float* lse, const float* logits,
                                       const int64_t* target, int64_t N, int64_t C, int64_t S, int64_t ignore_index,
                                       float smoothing) {
  accum* a = accum_new();
  if (!a) return;
  if (N * S > 0)
    ce_forward_k<<<rows_grid(N * S), NT, 0, fsdp_cuda_stream>>>(lse, logits, target, N, C, S, ignore_index, smoothing,
                                                                a);
  accum_done(a, loss, count, 0);
}

// gx = scale * (exp(x - lse) - eps / C - (1 - eps) [c == t]); zero where the target is ignored
__global__ static void ce_backward_k(float* gx, const float* logits, const float* lse, const int64_t* target, int64_t N,
                                     int64_t C, int64_t S, int64_t ignore, float smoothing, const float* gy,
                                     const float* count) {
  float keep = 1.0f - smoothing, spread = smoothing / (float)C, scale = gy[0] / count[0];
  int64_t total = N * C * S;
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < total; i += (int64_t)gridDim.x * blockDim.x) {
    int64_t s = i % S, c = (i / S) % C, n = i / (S * C), t = target[n * S + s];
    if (t == ignore || t < 0 || t >= C) {
      gx[i] = 0.0f;
      continue;
    }
    float g = scale * (expf(logits[i] - lse[n * S + s]) - spread);
    if (c == t) g -= scale * keep;
    gx[i] = g;
  }
}
static void cuda_cross_entropy_backward(float* gx, const float* logits, const float* lse, const int64_t* target,
                                        int64_t N, int64_t C, int64_t S, int64_t ignore_index, float smoothing,
                                        const float* gy, const float* count) {
  if (N * C * S == 0) return;
  ce_backward_k<<<fsdp_cuda_blocks(N * C * S), NT, 0, fsdp_cuda_stream>>>(gx, logits, lse, target, N, C, S,
                                                                          ignore_index, smoothing, gy, count);
  FSDP_CUDA_LAUNCHED("cross_entropy backward");
}

__global__ static void nll_forward_k(const float* logp, const int64_t* target, int64_t N, int64_t C, int64_t S,
                                     int64_t ignore, accum* acc) {
  for (int64_t w = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; w < N * S; w += (int64_t)gridDim.x * blockDim.x) {
    int64_t n = w / S, s = w % S, t = target[w];
    if (t == ignore || t < 0 || t >= C) continue;
    atomicAdd(&acc->sum, -(double)logp[(n * C + t) * S + s]);
    atomicAdd(&acc->count, 1ull);
  }
}
static void cuda_nll_forward(float* loss, float* count, const float* logp, const int64_t* target, int64_t N, int64_t C,
                             int64_t S, int64_t ignore_index) {
  accum* a = accum_new();
  if (!a) return;
  if (N * S > 0)
    nll_forward_k<<<fsdp_cuda_blocks(N * S), NT, 0, fsdp_cuda_stream>>>(logp, target, N, C, S, ignore_index, a);
  accum_done(a, loss, count, 0);
}

__global__ static void nll_backward_k(float* gx, const int64_t* target, int64_t N, int64_t C, int64_t S, int64_t ignore,
                                      const float* gy, const float* count) {
  float scale = gy[0] / count[0];
  for (int64_t w = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; w < N * S; w += (int64_t)gridDim.x * blockDim.x) {
    int64_t n = w / S, s = w % S, t = target[w];
    if (t != ignore && t >= 0 && t < C) gx[(n * C + t) * S + s] = -scale;
  }
}
static void cuda_nll_backward(float* gx, const int64_t* target, int64_t N, int64_t C, int64_t S, int64_t ignore_index,
                              const float* gy, const float* count) {
  if (N * C * S == 0) return;
  cudaMemsetAsync(gx, 0, N * C * S * sizeof(float), fsdp_cuda_stream);
  nll_backward_k<<<fsdp_cuda_blocks(N * S), NT, 0, fsdp_cuda_stream>>>(gx, target, N, C, S, ignore_index, gy, count);
  FSDP_CUDA_LAUNCHED("nll_loss backward");
}

// ---- mse -------------------------------------------------------------------------------------------------
__global__ static void mse_forward_k(const float* a, const float* b, int64_t n, accum* acc) {
  __shared__ double sh[NT];
  double s = 0.0;
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x) {
    double d = (double)a[i] - (double)b[i];
    s += d * d;
  }
  sh[threadIdx.x] = s;
  __syncthreads();
  for (int h = NT / 2; h > 0; h /= 2) {
    if (threadIdx.x < h) sh[threadIdx.x] += sh[threadIdx.x + h];
    __syncthreads();
  }
  if (threadIdx.x == 0) atomicAdd(&acc->sum, sh[0]);
}
static void cuda_mse_forward(float* loss, const float* a, const float* b, int64_t n) {
  accum* acc = accum_new();
  if (!acc) return;
  if (n > 0) mse_forward_k<<<fsdp_cuda_blocks(n), NT, 0, fsdp_cuda_stream>>>(a, b, n, acc);
  accum_done(acc, loss, NULL, n);
}

__global__ static void mse_backward_k(float* ga, float* gb, const float* a, const float* b, int64_t n,
                                      const float* gy) {
  float scale = 2.0f * gy[0] / (float)n;
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x) {
    float g = scale * (a[i] - b[i]);
    if (ga) ga[i] = g;
    if (gb) gb[i] = -g;
  }
}
static void cuda_mse_backward(float* ga, float* gb, const float* a, const float* b, int64_t n, const float* gy) {
  if (n == 0) return;
  mse_backward_k<<<fsdp_cuda_blocks(n), NT, 0, fsdp_cuda_stream>>>(ga, gb, a, b, n, gy);
  FSDP_CUDA_LAUNCHED("mse_loss backward");
}

// ---- layer norm: one block per row ---------------------------------------------------------------------------
__global__ static void layer_norm_k(float* y, float* mean, float* rstd, const float* x, const float* w, const float* b,
                                    int64_t M, int64_t D, float eps) {
  __shared__ float sh[NT];
  for (int64_t m = blockIdx.x; m < M; m += gridDim.x) {
    const float* xr = x + m * D;
    float* yr = y + m * D;
    float s = 0.0f;
    for (int64_t d = threadIdx.x; d < D; d += NT) s += xr[d];
    float mu = block_sum(s, sh) / (float)D;
    float v = 0.0f;
    for (int64_t d = threadIdx.x; d < D; d += NT) v += (xr[d] - mu) * (xr[d] - mu);
    float rs = 1.0f / sqrtf(block_sum(v, sh) / (float)D + eps);
    if (threadIdx.x == 0) {
      mean[m] = mu;
      rstd[m] = rs;
    }
    for (int64_t d = threadIdx.x; d < D; d += NT) {
      float h = (xr[d] - mu) * rs;
      if (w) h *= w[d];
      if (b) h += b[d];
      yr[d] = h;
    }
  }
}
static void cuda_layer_norm_forward(float* y, float* mean, float* rstd, const float* x, const float* w, const float* b,
                                    int64_t M, int64_t D, float eps) {
  if (M * D == 0) return;
  layer_norm_k<<<rows_grid(M), NT, 0, fsdp_cuda_stream>>>(y, mean, rstd, x, w, b, M, D, eps);
  FSDP_CUDA_LAUNCHED("layer_norm");
}

// dx = rstd * (g - mean(g) - xhat * mean(g * xhat)), g = dy * w: one block per row
__global__ static void layer_norm_dx_k(float* dx, const float* dy, const float* x, const float* mean, const float* rstd,
                                       const float* w, int64_t M, int64_t D) {
  __shared__ float sh[NT];
  for (int64_t m = blockIdx.x; m < M; m += gridDim.x) {
    const float *xr = x + m * D, *gr = dy + m * D;
    float mu = mean[m], rs = rstd[m], sg = 0.0f, sgx = 0.0f;
    for (int64_t d = threadIdx.x; d < D; d += NT) {
      float g = w ? gr[d] * w[d] : gr[d];
      sg += g;
      sgx += g * (xr[d] - mu) * rs;
    }
    sg = block_sum(sg, sh) / (float)D;
    sgx = block_sum(sgx, sh) / (float)D;
    for (int64_t d = threadIdx.x; d < D; d += NT) {
      float g = w ? gr[d] * w[d] : gr[d];
      dx[m * D + d] = rs * (g - sg - (xr[d] - mu) * rs * sgx);
    }
  }
}
// dw = sum_rows dy * xhat, db = sum_rows dy: one thread per column
__global__ static void layer_norm_dwdb_k(float* dw, float* db, const float* dy, const float* x, const float* mean,
                                         const float* rstd, int64_t M, int64_t D) {
  for (int64_t d = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; d < D; d += (int64_t)gridDim.x * blockDim.x) {
    float sw = 0.0f, sb = 0.0f;
    for (int64_t m = 0; m < M; m++) {
      float g = dy[m * D + d];
      sw += g * (x[m * D + d] - mean[m]) * rstd[m];
      sb += g;
    }
    if (dw) dw[d] = sw;
    if (db) db[d] = sb;
  }
}
static void cuda_layer_norm_backward(float* dx, float* dw, float* db, const float* dy, const float* x,
                                     const float* mean, const float* rstd, const float* w, int64_t M, int64_t D) {
  if (M == 0 && D > 0) {  // no rows: the weight and bias gradients are empty sums (found by the CUDA executor)
    if (dw) cudaMemsetAsync(dw, 0, D * sizeof(float), fsdp_cuda_stream);
    if (db) cudaMemsetAsync(db, 0, D * sizeof(float), fsdp_cuda_stream);
  }
  if (M * D == 0) return;
  if (dx) layer_norm_dx_k<<<rows_grid(M), NT, 0, fsdp_cuda_stream>>>(dx, dy, x, mean, rstd, w, M, D);
  if (dw || db) layer_norm_dwdb_k<<<fsdp_cuda_blocks(D), NT, 0, fsdp_cuda_stream>>>(dw, db, dy, x, mean, rstd, M, D);
  FSDP_CUDA_LAUNCHED("layer_norm backward");
}

// ---- embedding ---------------------------------------------------------------------------------------------
__global__ static void embedding_k(float* y, const float* w, const int64_t* idx, int64_t n, int64_t V, int64_t D) {
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n * D; i += (int64_t)gridDim.x * blockDim.x) {
    int64_t r = idx[i / D];
    y[i] = r >= 0 && r < V ? w[r * D + i % D] : 0.0f;
  }
}
static void cuda_embedding_forward(float* y, const float* w, const int64_t* idx, int64_t n, int64_t V, int64_t D) {
  if (n * D == 0) return;
  embedding_k<<<fsdp_cuda_blocks(n * D), NT, 0, fsdp_cuda_stream>>>(y, w, idx, n, V, D);
  FSDP_CUDA_LAUNCHED("embedding");
}
__global__ static void embedding_bw_k(float* gw, const float* gy, const int64_t* idx, int64_t n, int64_t V, int64_t D,
                                      int64_t padding_idx) {
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n * D; i += (int64_t)gridDim.x * blockDim.x) {
    int64_t r = idx[i / D];
    if (r != padding_idx && r >= 0 && r < V) atomicAdd(gw + r * D + i % D, gy[i]);
  }
}
static void cuda_embedding_backward(float* gw, const float* gy, const int64_t* idx, int64_t n, int64_t V, int64_t D,
                                    int64_t padding_idx) {
  if (V * D == 0) return;
  cudaMemsetAsync(gw, 0, V * D * sizeof(float), fsdp_cuda_stream);
  if (n * D > 0)
    embedding_bw_k<<<fsdp_cuda_blocks(n * D), NT, 0, fsdp_cuda_stream>>>(gw, gy, idx, n, V, D, padding_idx);
  FSDP_CUDA_LAUNCHED("embedding backward");
}

// ---- dropout: the CPU's keep mask, element for element (core/elem_math.h) ----------------------------------
__global__ static void dropout_k(float* y, const float* x, int64_t n, uint32_t thresh, float scale, uint64_t seed) {
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x)
    y[i] = fsdp_keep24(seed, i) >= thresh ? x[i] * scale : 0.0f;
}
static void cuda_dropout(float* y, const float* x, int64_t n, float p, uint64_t seed) {
  if (n == 0) return;
  uint32_t thresh = (uint32_t)((double)p * 16777216.0);
  float scale = p < 1.0f ? 1.0f / (1.0f - p) : 0.0f;
  dropout_k<<<fsdp_cuda_blocks(n), NT, 0, fsdp_cuda_stream>>>(y, x, n, thresh, scale, seed);
  FSDP_CUDA_LAUNCHED("dropout");
}

// ---- attention softmax: one block per row of P (B*Tq rows of Tk) ------------------------------------------------
// mask_boff (B offsets into mask) is host memory in the table's contract: copied over first
__global__ static void attn_softmax_k(float* P, const float* mask, const int64_t* boff, int64_t B, int64_t Tq,
                                      int64_t Tk, int64_t msq, int64_t msk, int causal) {
  __shared__ float sh[NT];
  for (int64_t r = blockIdx.x; r < B * Tq; r += gridDim.x) {
    int64_t b = r / Tq, i = r % Tq;
    float* p = P + r * Tk;
    int64_t len = causal ? (i + 1 < Tk ? i + 1 : Tk) : Tk;
    const float* m = mask ? mask + boff[b] + i * msq : NULL;
    float mx = -INFINITY;
    for (int64_t j = threadIdx.x; j < len; j += NT) {
      float v = p[j] + (m ? m[j * msk] : 0.0f);
      p[j] = v;
      mx = fmaxf(mx, v);
    }
    mx = block_max(mx, sh);
    float s = 0.0f;
    for (int64_t j = threadIdx.x; j < len; j += NT) s += expf(p[j] - mx);
    float inv = 1.0f / block_sum(s, sh);
    for (int64_t j = threadIdx.x; j < Tk; j += NT) p[j] = j < len ? expf(p[j] - mx) * inv : 0.0f;
  }
}
static void cuda_attn_softmax(const fsdp_attn_geom* g, float* P, const float* mask, const int64_t* mask_boff) {
  if (g->B * g->Tq * g->Tk == 0) return;
  int64_t* boff = NULL;
  if (mask) {
    if (cudaMallocAsync((void**)&boff, g->B * sizeof(int64_t), fsdp_cuda_stream) != cudaSuccess) {
      fsdp_cuda_fail("attention", cudaGetLastError());
      return;
    }
    cudaMemcpyAsync(boff, mask_boff, g->B * sizeof(int64_t), cudaMemcpyHostToDevice, fsdp_cuda_stream);
  }
  attn_softmax_k<<<rows_grid(g->B * g->Tq), NT, 0, fsdp_cuda_stream>>>(P, mask, boff, g->B, g->Tq, g->Tk, g->mask_sq,
                                                                       g->mask_sk, g->causal);
  FSDP_CUDA_LAUNCHED("attention softmax");
  if (boff) cudaFreeAsync(boff, fsdp_cuda_stream);
}

const fsdp_nn_kernels fsdp_cuda_nn_kernels = {
    cuda_softmax_forward,        cuda_softmax_backward,
    cuda_check_targets,          cuda_cross_entropy_forward,
    cuda_cross_entropy_backward, cuda_nll_forward,
    cuda_nll_backward,           cuda_mse_forward,
    cuda_mse_backward,           cuda_layer_norm_forward,
    cuda_layer_norm_backward,    cuda_embedding_forward,
    cuda_embedding_backward,     cuda_dropout,
    cuda_attn_softmax,
};
