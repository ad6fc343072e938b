/*
 * backend/cpu/optim.c -- CPU kernels of the optim family (see core/kernels_optim.h): fused SGD and Adam/AdamW
 * updates, one pass over memory. Each loop is written once as an always-inline function whose
 * flag arguments are compile-time constants at every call site, so the compiler emits one
 * branch-free, vectorized loop per variant and the dispatch happens outside the loop.
 * The Makefile builds this file with -fno-math-errno (otherwise sqrtf keeps an errno branch that
 * stops the Adam loop from vectorizing; its argument is never negative) and -ffp-contract=off
 * (no FMA contraction: the vector body and the scalar tail round alike, so an element's update
 * does not depend on its position, e.g. on how parameters are sharded).
 */
#include "core/core.h"
#include "backend/cpu/cpu.h"

#include <math.h>

#define OMP_MIN 32768
#define INLINE static inline __attribute__((always_inline))

// ---- SGD (torch.optim.SGD) ----------------------------------------------------------------------
// d = (maximize ? -g : g) + wd * p
// mode 0 (no momentum):  p -= lr * d
// mode 1 (first step):   buf = d
// mode 2:                buf = momentum * buf + (1 - dampening) * d
// modes 1, 2:            p -= lr * (nesterov ? d + momentum * buf : buf)
enum { SGD_PLAIN = 0, SGD_FIRST = 1, SGD_MOMENTUM = 2 };

INLINE void sgd_loop(const fsdp_sgd_hparams* h, float* restrict p, const float* restrict g, float* restrict buf,
                     int64_t n, const int has_wd, const int mode, const int nesterov) {
  const float lr = (float)h->lr, wd = (float)h->weight_decay, mom = (float)h->momentum;
  const float mix = (float)(1.0 - h->dampening), gs = h->maximize ? -1.0f : 1.0f;
#pragma omp parallel for if (n > OMP_MIN)
  for (int64_t i = 0; i < n; i++) {
    float d = gs * g[i];
    if (has_wd) d += wd * p[i];
    if (mode == SGD_PLAIN) {
      p[i] -= lr * d;
    } else {
      float b = mode == SGD_FIRST ? d : mom * buf[i] + mix * d;
      buf[i] = b;
      p[i] -= lr * (nesterov ? d + mom * b : b);
    }
  }
}

#define SGD_WD(MODE, NEST) (wd ? sgd_loop(h, p, g, buf, n, 1, MODE, NEST) : sgd_loop(h, p, g, buf, n, 0, MODE, NEST))

static void cpu_sgd(const fsdp_sgd_hparams* h, float* p, const float* g, float* buf, int64_t n) {
  const int wd = h->weight_decay != 0;
  if (h->momentum == 0) SGD_WD(SGD_PLAIN, 0);
  else if (h->first_step) h->nesterov ? SGD_WD(SGD_FIRST, 1) : SGD_WD(SGD_FIRST, 0);
  else h->nesterov ? SGD_WD(SGD_MOMENTUM, 1) : SGD_WD(SGD_MOMENTUM, 0);
}

// ---- Adam / AdamW (torch.optim.Adam, torch.optim.AdamW) ----------------------------------------------
// g' = maximize ? -g : g;  Adam: g' += wd * p;  AdamW: p *= 1 - lr * wd
// m = beta1 * m + (1 - beta1) * g'
// v = beta2 * v + (1 - beta2) * g' * g'
// vmax = max(vmax, v) (amsgrad), denom = sqrt(amsgrad ? vmax : v) / sqrt(1 - beta2^t) + eps
// p -= lr / (1 - beta1^t) * m / denom
enum { WD_NONE = 0, WD_L2 = 1, WD_DECOUPLED = 2 };

INLINE void adam_loop(const fsdp_adam_hparams* h, float* restrict p, const float* restrict g, float* restrict m,
                      float* restrict v, float* restrict vmax, int64_t n, const int wd_mode, const int amsgrad) {
  const float gs = h->maximize ? -1.0f : 1.0f, wd = (float)h->weight_decay;
  const float decay = (float)(1.0 - h->lr * h->weight_decay);
  const float b1 = (float)h->beta1, w1 = (float)(1.0 - h->beta1), b2 = (float)h->beta2, w2 = (float)(1.0 - h->beta2);
  const float eps = (float)h->eps, step_size = (float)h->step_size, bc2_sqrt = (float)h->bc2_sqrt;
#pragma omp parallel for if (n > OMP_MIN)
  for (int64_t i = 0; i < n; i++) {
    float pi = p[i], gi = gs * g[i];
    if (wd_mode == WD_L2) gi += wd * pi;
    if (wd_mode == WD_DECOUPLED) pi *= decay;
    float mi = b1 * m[i] + w1 * gi;
    float vi = b2 * v[i] + w2 * (gi * gi);
    m[i] = mi;
    v[i] = vi;
    if (amsgrad) {
      vi = vmax[i] > vi ? vmax[i] : vi;  // (fmaxf does not vectorize)
      vmax[i] = vi;
    }
    float denom = sqrtf(vi) / bc2_sqrt + eps;
    p[i] = pi - step_size * (mi / denom);
  }
}

#define ADAM_AMS(WD) (h->amsgrad ? adam_loop(h, p, g, m, v, vmax, n, WD, 1) : adam_loop(h, p, g, m, v, vmax, n, WD, 0))

static void cpu_adam(const fsdp_adam_hparams* h, float* p, const float* g, float* m, float* v, float* vmax, int64_t n) {
  if (h->weight_decay == 0) ADAM_AMS(WD_NONE);
  else if (h->decoupled) ADAM_AMS(WD_DECOUPLED);
  else ADAM_AMS(WD_L2);
}

const fsdp_optim_kernels fsdp_cpu_optim_kernels = {
    .sgd = cpu_sgd,
    .adam = cpu_adam,
};
