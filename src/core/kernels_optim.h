/*
 * core/kernels_optim.h -- the optim kernel table (one per device). Kernels work on raw f32 buffers;
 * the op layer (ops/optim.c) checks shapes and dtypes. Each kernel is one fused pass over
 * param, grad and state: the update reads and writes every element exactly once.
 */
#ifndef FSDP_KERNELS_OPTIM_H
#define FSDP_KERNELS_OPTIM_H
#include <stdint.h>

// hyperparameters of one SGD update (torch.optim.SGD)
// (doubles, as PyTorch computes its scalars; kernels round them to f32 once, outside the loop)
typedef struct fsdp_sgd_hparams {
  double lr, momentum, dampening, weight_decay;
  int nesterov, first_step, maximize;
} fsdp_sgd_hparams;

// hyperparameters of one Adam/AdamW update; step_size = lr / (1 - beta1^t) and
// bc2_sqrt = sqrt(1 - beta2^t) are precomputed by the op layer (in double)
typedef struct fsdp_adam_hparams {
  double lr, beta1, beta2, eps, weight_decay, step_size, bc2_sqrt;
  int decoupled, amsgrad, maximize;
} fsdp_adam_hparams;

typedef struct fsdp_optim_kernels {
  // p (n) -= lr * update(g (n)); buf (n) is the momentum buffer (NULL when momentum == 0),
  // read only when !first_step
  void (*sgd)(const fsdp_sgd_hparams* h, float* p, const float* g, float* buf, int64_t n);
  // p, exp_avg m, exp_avg_sq v, max_exp_avg_sq vmax (NULL unless amsgrad), all (n)
  void (*adam)(const fsdp_adam_hparams* h, float* p, const float* g, float* m, float* v, float* vmax, int64_t n);
} fsdp_optim_kernels;

#endif
