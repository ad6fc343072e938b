/*
 * backend/cuda/optim.cu -- fused SGD and Adam/AdamW: one pass over param, grad and state, each
 * element updated by core/elem_math.h's functions, as on the CPU. Built with -fmad=false, as the
 * CPU's loop is built without FMA contraction, so both devices round each element alike.
 */
#include "backend/cuda/cuda_util.h"
#include "core/elem_math.h"

__global__ static void sgd_k(float* p, const float* g, float* buf, int64_t n, float lr, float wd, float mom, float mix,
                             float gs, int mode, int nesterov) {
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x)
    fsdp_sgd_elem(&p[i], g[i], mode == FSDP_SGD_PLAIN ? NULL : &buf[i], lr, wd, mom, mix, gs, wd != 0.0f, mode,
                  nesterov);
}
static void cuda_sgd(const fsdp_sgd_hparams* h, float* p, const float* g, float* buf, int64_t n) {
  if (n == 0) return;
  int mode = h->momentum == 0 ? FSDP_SGD_PLAIN : h->first_step ? FSDP_SGD_FIRST : FSDP_SGD_MOMENTUM;
  sgd_k<<<fsdp_cuda_blocks(n), 256, 0, fsdp_cuda_stream>>>(p, g, buf, n, (float)h->lr, (float)h->weight_decay,
                                                           (float)h->momentum, (float)(1.0 - h->dampening),
                                                           h->maximize ? -1.0f : 1.0f, mode, h->nesterov);
  FSDP_CUDA_LAUNCHED("sgd");
}

__global__ static void adam_k(fsdp_adam_f32 f, float* p, const float* g, float* m, float* v, float* vmax, int64_t n,
                              int wd_mode, int amsgrad) {
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x)
    fsdp_adam_elem(f, &p[i], g[i], &m[i], &v[i], amsgrad ? &vmax[i] : NULL, wd_mode, amsgrad);
}
static void cuda_adam(const fsdp_adam_hparams* h, float* p, const float* g, float* m, float* v, float* vmax,
                      int64_t n) {
  if (n == 0) return;
  adam_k<<<fsdp_cuda_blocks(n), 256, 0, fsdp_cuda_stream>>>(fsdp_adam_f32_of(h), p, g, m, v, vmax, n,
                                                            fsdp_adam_wd_mode(h), h->amsgrad);
  FSDP_CUDA_LAUNCHED("adam");
}

const fsdp_optim_kernels fsdp_cuda_optim_kernels = {cuda_sgd, cuda_adam};
