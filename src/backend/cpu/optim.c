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
#include "core/elem_math.h"

#include <math.h>

#define OMP_MIN 32768
#define INLINE static inline __attribute__((always_inline))

// ---- SGD (torch.optim.SGD): one element's update is core/elem_math.h's fsdp_sgd_elem ----------------
INLINE void sgd_loop(const fsdp_sgd_hparams* h, float* restrict p, const float* restrict g, float* restrict buf,
                     int64_t n, const int has_wd, const int mode, const int nesterov) {
  const float lr = (float)h->lr, wd = (float)h->weight_decay, mom = (float)h->momentum;
  const float mix = (float)(1.0 - h->dampening), gs = h->maximize ? -1.0f : 1.0f;
#pragma omp parallel for if (n > OMP_MIN)
  for (int64_t i = 0; i < n; i++)
    fsdp_sgd_elem(&p[i], g[i], mode == FSDP_SGD_PLAIN ? NULL : &buf[i], lr, wd, mom, mix, gs, has_wd, mode, nesterov);
}

#define SGD_WD(MODE, NEST) (wd ? sgd_loop(h, p, g, buf, n, 1, MODE, NEST) : sgd_loop(h, p, g, buf, n, 0, MODE, NEST))

static void cpu_sgd(const fsdp_sgd_hparams* h, float* p, const float* g, float* buf, int64_t n) {
  const int wd = h->weight_decay != 0;
  if (h->momentum == 0) SGD_WD(FSDP_SGD_PLAIN, 0);
  else if (h->first_step) h->nesterov ? SGD_WD(FSDP_SGD_FIRST, 1) : SGD_WD(FSDP_SGD_FIRST, 0);
  else h->nesterov ? SGD_WD(FSDP_SGD_MOMENTUM, 1) : SGD_WD(FSDP_SGD_MOMENTUM, 0);
}

// ---- Adam / AdamW (torch.optim.Adam, torch.optim.AdamW): core/elem_math.h's fsdp_adam_elem -----------
INLINE void adam_loop(const fsdp_adam_f32 f, float* restrict p, const float* restrict g, float* restrict m,
                      float* restrict v, float* restrict vmax, int64_t n, const int wd_mode, const int amsgrad) {
  // firstprivate: each thread's own copy of f, in registers (read through the shared one, it kept
  // the loop from vectorizing: 6.5x slower)
#pragma omp parallel for firstprivate(f) if (n > OMP_MIN)
  for (int64_t i = 0; i < n; i++)
    fsdp_adam_elem(f, &p[i], g[i], &m[i], &v[i], amsgrad ? &vmax[i] : NULL, wd_mode, amsgrad);
}

#define ADAM_AMS(WD) (h->amsgrad ? adam_loop(f, p, g, m, v, vmax, n, WD, 1) : adam_loop(f, p, g, m, v, vmax, n, WD, 0))

static void cpu_adam(const fsdp_adam_hparams* h, float* p, const float* g, float* m, float* v, float* vmax, int64_t n) {
  const fsdp_adam_f32 f = fsdp_adam_f32_of(h);
  switch (fsdp_adam_wd_mode(h)) {
    case FSDP_WD_NONE: ADAM_AMS(FSDP_WD_NONE); break;
    case FSDP_WD_DECOUPLED: ADAM_AMS(FSDP_WD_DECOUPLED); break;
    default: ADAM_AMS(FSDP_WD_L2); break;
  }
}

const fsdp_optim_kernels FSDP_ISA_NAME(fsdp_cpu_optim_kernels) = {
    .sgd = cpu_sgd,
    .adam = cpu_adam,
};
