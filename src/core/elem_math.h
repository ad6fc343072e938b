/*
 * core/elem_math.h -- the arithmetic of one element that every device must do the same way, as
 * inline functions C and CUDA both compile (FSDP_HD: __host__ __device__ under nvcc): the
 * conversions between float32, bfloat16 and float16 (round to nearest even, NaN stays NaN),
 * dropout's keep mask (a pure function of seed and index, so a seed gives the same mask on every
 * device and thread count), and one element's SGD and Adam/AdamW update (PyTorch's formulas; the
 * kernels around them are built without FMA contraction, so each device rounds alike).
 */
#ifndef FSDP_CORE_ELEM_MATH_H
#define FSDP_CORE_ELEM_MATH_H
#include "core/kernels_optim.h"
#include <math.h>
#include <stdint.h>
#include <string.h>

#ifdef __CUDACC__
#define FSDP_HD __host__ __device__
#else
#define FSDP_HD
#endif

// ---- dtypes ---------------------------------------------------------------------------------------------
static inline FSDP_HD float fsdp_bf16_to_f32(uint16_t h) {
  uint32_t u = (uint32_t)h << 16;
  float f;
  memcpy(&f, &u, 4);
  return f;
}
static inline FSDP_HD uint16_t fsdp_f32_to_bf16(float f) {
  uint32_t u;
  memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40);  // quiet NaN
  u += 0x7fffu + ((u >> 16) & 1);
  return (uint16_t)(u >> 16);
}
static inline FSDP_HD float fsdp_f16_to_f32(uint16_t h) {
  uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff, u;
  if (exp == 0) {
    if (man == 0) u = sign;
    else {  // subnormal: normalise
      int e = -1;
      do {
        e++;
        man <<= 1;
      } while (!(man & 0x400));
      u = sign | ((uint32_t)(127 - 15 - e) << 23) | ((man & 0x3ff) << 13);
    }
  } else if (exp == 0x1f) u = sign | 0x7f800000u | (man << 13);
  else u = sign | ((exp + 127 - 15) << 23) | (man << 13);
  float f;
  memcpy(&f, &u, 4);
  return f;
}
static inline FSDP_HD uint16_t fsdp_f32_to_f16(float f) {
  uint32_t u;
  memcpy(&u, &f, 4);
  uint32_t sign = (u >> 16) & 0x8000;
  int32_t exp = (int32_t)((u >> 23) & 0xff) - 127 + 15;
  uint32_t man = u & 0x7fffff;
  if (((u >> 23) & 0xff) == 0xff) return (uint16_t)(sign | 0x7c00 | (man ? 0x200 : 0));
  if (exp >= 0x1f) return (uint16_t)(sign | 0x7c00);  // overflow -> inf
  if (exp <= 0) {                                     // subnormal or zero
    if (exp < -10) return (uint16_t)sign;
    man |= 0x800000;
    int shift = 14 - exp;
    uint32_t half = man >> shift, rem = man & ((1u << shift) - 1), mid = 1u << (shift - 1);
    if (rem > mid || (rem == mid && (half & 1))) half++;
    return (uint16_t)(sign | half);
  }
  uint32_t half = sign | ((uint32_t)exp << 10) | (man >> 13), rem = man & 0x1fff;
  if (rem > 0x1000 || (rem == 0x1000 && (half & 1))) half++;  // may carry into exp: still correct
  return (uint16_t)half;
}

// ---- dropout ----------------------------------------------------------------------------------------------
// the top 24 bits of splitmix64(seed, i): element i is kept when this is >= p * 2^24
static inline FSDP_HD uint32_t fsdp_keep24(uint64_t seed, int64_t i) {
  uint64_t z = seed + (uint64_t)(i + 1) * 0x9E3779B97F4A7C15ull;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return (uint32_t)((z ^ (z >> 31)) >> 40);
}

// ---- optimizers (torch.optim.SGD, Adam, AdamW) -------------------------------------------------------------
// SGD: d = (maximize ? -g : g) + wd * p
//   mode 0 (no momentum):  p -= lr * d
//   mode 1 (first step):   buf = d
//   mode 2:                buf = momentum * buf + (1 - dampening) * d
//   modes 1, 2:            p -= lr * (nesterov ? d + momentum * buf : buf)
enum { FSDP_SGD_PLAIN = 0, FSDP_SGD_FIRST = 1, FSDP_SGD_MOMENTUM = 2 };
static inline FSDP_HD void fsdp_sgd_elem(float* p, float g, float* buf, float lr, float wd, float mom, float mix,
                                         float gs, int has_wd, int mode, int nesterov) {
  float d = gs * g;
  if (has_wd) d += wd * *p;
  if (mode == FSDP_SGD_PLAIN) {
    *p -= lr * d;
  } else {
    float b = mode == FSDP_SGD_FIRST ? d : mom * *buf + mix * d;
    *buf = b;
    *p -= lr * (nesterov ? d + mom * b : b);
  }
}

// Adam/AdamW: g' = maximize ? -g : g;  Adam (L2): g' += wd * p;  AdamW (decoupled): p *= 1 - lr * wd
//   m = beta1 * m + (1 - beta1) * g'
//   v = beta2 * v + (1 - beta2) * g' * g'
//   vmax = max(vmax, v) (amsgrad), denom = sqrt(amsgrad ? vmax : v) / sqrt(1 - beta2^t) + eps
//   p -= lr / (1 - beta1^t) * m / denom
enum { FSDP_WD_NONE = 0, FSDP_WD_L2 = 1, FSDP_WD_DECOUPLED = 2 };
typedef struct {
  float gs, wd, decay, b1, w1, b2, w2, eps, step_size, bc2_sqrt;
} fsdp_adam_f32;
static inline fsdp_adam_f32 fsdp_adam_f32_of(const fsdp_adam_hparams* h) {
  fsdp_adam_f32 f = {h->maximize ? -1.0f : 1.0f,
                     (float)h->weight_decay,
                     (float)(1.0 - h->lr * h->weight_decay),
                     (float)h->beta1,
                     (float)(1.0 - h->beta1),
                     (float)h->beta2,
                     (float)(1.0 - h->beta2),
                     (float)h->eps,
                     (float)h->step_size,
                     (float)h->bc2_sqrt};
  return f;
}
static inline int fsdp_adam_wd_mode(const fsdp_adam_hparams* h) {
  return h->weight_decay == 0 ? FSDP_WD_NONE : h->decoupled ? FSDP_WD_DECOUPLED : FSDP_WD_L2;
}
// (h by value: its fields stay in registers, where a pointer could alias the float arrays and keep
// a CPU loop from vectorizing)
static inline FSDP_HD void fsdp_adam_elem(const fsdp_adam_f32 h, float* p, float g, float* m, float* v, float* vmax,
                                          int wd_mode, int amsgrad) {
  float pi = *p, gi = h.gs * g;
  if (wd_mode == FSDP_WD_L2) gi += h.wd * pi;
  if (wd_mode == FSDP_WD_DECOUPLED) pi *= h.decay;
  float mi = h.b1 * *m + h.w1 * gi;
  float vi = h.b2 * *v + h.w2 * (gi * gi);
  *m = mi;
  *v = vi;
  if (amsgrad) {
    vi = *vmax > vi ? *vmax : vi;  // (fmaxf does not vectorize)
    *vmax = vi;
  }
  float denom = sqrtf(vi) / h.bc2_sqrt + h.eps;
  *p = pi - h.step_size * (mi / denom);
}

#endif
