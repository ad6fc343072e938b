/*
 * backend/cuda/optim.cu -- fused SGD and Adam/AdamW: one pass over param, grad and state, the
 * update of backend/cpu/optim.c written per element (see there for the formulas). Built with
 * -fmad=false, as the CPU's loop is built without FMA contraction, so both devices round each
 * element's update the same way.
 */
#include "backend/cuda/cuda_util.h"

enum { SGD_PLAIN = 0, SGD_FIRST = 1, SGD_MOMENTUM = 2 };

__global__ static void sgd_k(float* p, const float* g, float* buf, int64_t n, float lr, float wd, float mom, float mix,
                             float gs, int mode, int nesterov) {
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x) {
    float d = gs * g[i];
    if (wd != 0.0f) d += wd * p[i];
    if (mode == SGD_PLAIN) {
      p[i] -= lr * d;
    } else {
      float b = mode == SGD_FIRST ? d : mom * buf[i] + mix * d;
      buf[i] = b;
      p[i] -= lr * (nesterov ? d + mom * b : b);
    }
  }
}
static void cuda_sgd(const fsdp_sgd_hparams* h, float* p, const float* g, float* buf, int64_t n) {
  if (n == 0) return;
  int mode = h->momentum == 0 ? SGD_PLAIN : h->first_step ? SGD_FIRST : SGD_MOMENTUM;
  sgd_k<<<fsdp_cuda_blocks(n), 256, 0, fsdp_cuda_stream>>>(p, g, buf, n, (float)h->lr, (float)h->weight_decay,
                                                           (float)h->momentum, (float)(1.0 - h->dampening),
                                                           h->maximize ? -1.0f : 1.0f, mode, h->nesterov);
  FSDP_CUDA_LAUNCHED("sgd");
}

enum { WD_NONE = 0, WD_L2 = 1, WD_DECOUPLED = 2 };

__global__ static void adam_k(float* p, const float* g, float* m, float* v, float* vmax, int64_t n, float gs, float wd,
                              float decay, float b1, float w1, float b2, float w2, float eps, float step_size,
                              float bc2_sqrt, int wd_mode) {
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x) {
    float pi = p[i], gi = gs * g[i];
    if (wd_mode == WD_L2) gi += wd * pi;
    if (wd_mode == WD_DECOUPLED) pi *= decay;
    float mi = b1 * m[i] + w1 * gi;
    float vi = b2 * v[i] + w2 * (gi * gi);
    m[i] = mi;
    v[i] = vi;
    if (vmax) {
      vi = vmax[i] > vi ? vmax[i] : vi;
      vmax[i] = vi;
    }
    float denom = sqrtf(vi) / bc2_sqrt + eps;
    p[i] = pi - step_size * (mi / denom);
  }
}
static void cuda_adam(const fsdp_adam_hparams* h, float* p, const float* g, float* m, float* v, float* vmax,
                      int64_t n) {
  if (n == 0) return;
  int wd_mode = h->weight_decay == 0 ? WD_NONE : h->decoupled ? WD_DECOUPLED : WD_L2;
  adam_k<<<fsdp_cuda_blocks(n), 256, 0, fsdp_cuda_stream>>>(
      p, g, m, v, h->amsgrad ? vmax : NULL, n, h->maximize ? -1.0f : 1.0f, (float)h->weight_decay,
      (float)(1.0 - h->lr * h->weight_decay), (float)h->beta1, (float)(1.0 - h->beta1), (float)h->beta2,
      (float)(1.0 - h->beta2), (float)h->eps, (float)h->step_size, (float)h->bc2_sqrt, wd_mode);
  FSDP_CUDA_LAUNCHED("adam");
}

const fsdp_optim_kernels fsdp_cuda_optim_kernels = {cuda_sgd, cuda_adam};
