/*
 * ops/optim.c -- fused optimizer updates (the op layer of the optim family).
 *
 * fsdp_sgd_step and fsdp_adam_step update a parameter and its optimizer state in place, in one
 * pass over memory, through the device's optim kernel table. They record no autograd node; the
 * Lua optimizers call them under no_grad. Every tensor written gets its version bumped so
 * autograd notices a parameter saved for a backward that has since been stepped.
 */
#include "ops/ops.h"

#include <math.h>

// a tensor the update writes: present, f32, contiguous, the shape of param, on param's device
static int check_state(const char* op, const char* what, const fsdp_tensor* param, const fsdp_tensor* t) {
  CHECK_INT(t, "%s: %s is missing (NULL) for param of shape %s", op, what, SH(param));
  CHECK_INT(t->dtype == FSDP_F32, "%s: %s must be float32, got %s of shape %s", op, what, DT(t), SH(t));
  CHECK_INT(fsdp_same_shape(t, param), "%s: %s has shape %s but param has shape %s", op, what, SH(t), SH(param));
  CHECK_INT(fsdp_tensor_is_contiguous(t), "%s: %s of shape %s is not contiguous", op, what, SH(t));
  if (fsdp_check_same_device(op, param, t)) return -1;
  return 0;
}

// checks param and grad; returns a contiguous f32 version of grad (new ref) or NULL
static fsdp_tensor* check_param_grad(const char* op, fsdp_tensor* param, fsdp_tensor* grad) {
  CHECK_NULL(param && grad, "%s: param and grad must not be NULL", op);
  CHECK_NULL(param->dtype == FSDP_F32, "%s: param must be float32, got %s of shape %s", op, DT(param), SH(param));
  CHECK_NULL(fsdp_tensor_is_contiguous(param), "%s: param of shape %s is not contiguous", op, SH(param));
  CHECK_NULL(grad->dtype == FSDP_F32, "%s: grad must be float32, got %s of shape %s (param %s)", op, DT(grad), SH(grad),
             SH(param));
  CHECK_NULL(fsdp_same_shape(grad, param), "%s: grad has shape %s but param has shape %s", op, SH(grad), SH(param));
  if (fsdp_check_same_device(op, param, grad)) return NULL;
  return fsdp_as_contig(grad);
}

int fsdp_sgd_step(fsdp_tensor* param, fsdp_tensor* grad, fsdp_tensor* momentum_buf, double lr, double momentum,
                  double dampening, double weight_decay, int nesterov, int first_step, int maximize) {
  const char* op = "sgd_step";
  CHECK_INT(momentum >= 0 && lr >= 0 && weight_decay >= 0,
            "%s: invalid hyperparameters lr=%g momentum=%g weight_decay=%g", op, lr, momentum, weight_decay);
  CHECK_INT(!nesterov || (momentum > 0 && dampening == 0),
            "%s: nesterov momentum requires momentum > 0 and zero dampening (momentum=%g, dampening=%g)", op, momentum,
            dampening);
  if (momentum != 0 && check_state(op, "momentum_buf", param, momentum_buf)) return -1;
  fsdp_tensor* g = check_param_grad(op, param, grad);  // (n)
  if (!g) return -1;

  fsdp_sgd_hparams h = {lr, momentum, dampening, weight_decay, nesterov != 0, first_step != 0, maximize != 0};
  float* buf = momentum != 0 ? fsdp_f32(momentum_buf) : NULL;
  fsdp_backend_of(param)->optim->sgd(&h, fsdp_f32(param), fsdp_f32(g), buf, fsdp_tensor_numel(param));
  fsdp_tensor_release(g);

  fsdp_bump_version(param);
  if (buf) fsdp_bump_version(momentum_buf);
  return 0;
}

int fsdp_adam_step(fsdp_tensor* param, fsdp_tensor* grad, fsdp_tensor* exp_avg, fsdp_tensor* exp_avg_sq,
                   fsdp_tensor* max_exp_avg_sq, int64_t step, double lr, double beta1, double beta2, double eps,
                   double weight_decay, int decoupled, int amsgrad, int maximize) {
  const char* op = decoupled ? "adamw_step" : "adam_step";
  CHECK_INT(step >= 1, "%s: step must be >= 1 (1-based count), got %lld", op, (long long)step);
  CHECK_INT(lr >= 0 && eps >= 0 && weight_decay >= 0 && beta1 >= 0 && beta1 < 1 && beta2 >= 0 && beta2 < 1,
            "%s: invalid hyperparameters lr=%g betas=(%g, %g) eps=%g weight_decay=%g", op, lr, beta1, beta2, eps,
            weight_decay);
  if (check_state(op, "exp_avg", param, exp_avg) || check_state(op, "exp_avg_sq", param, exp_avg_sq)) return -1;
  if (amsgrad && check_state(op, "max_exp_avg_sq", param, max_exp_avg_sq)) return -1;
  fsdp_tensor* g = check_param_grad(op, param, grad);  // (n)
  if (!g) return -1;

  double bc1 = 1.0 - pow(beta1, (double)step), bc2 = 1.0 - pow(beta2, (double)step);
  fsdp_adam_hparams h = {lr,       beta1,     beta2,          eps,          weight_decay,
                         lr / bc1, sqrt(bc2), decoupled != 0, amsgrad != 0, maximize != 0};
  float* vmax = amsgrad ? fsdp_f32(max_exp_avg_sq) : NULL;
  fsdp_backend_of(param)->optim->adam(&h, fsdp_f32(param), fsdp_f32(g), fsdp_f32(exp_avg), fsdp_f32(exp_avg_sq), vmax,
                                      fsdp_tensor_numel(param));
  fsdp_tensor_release(g);

  fsdp_bump_version(param);
  fsdp_bump_version(exp_avg);
  fsdp_bump_version(exp_avg_sq);
  if (vmax) fsdp_bump_version(max_exp_avg_sq);
  return 0;
}
