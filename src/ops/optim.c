/*
 * ops/optim.c -- fused optimizer updates (the op layer of the optim family).
 *
 * fsdp_sgd_step and fsdp_adam_step update a parameter and its optimizer state in place, in one
 * pass over memory, through the device's optim kernel table. They record no autograd node; the
 * Lua optimizers call them under no_grad. Every tensor written gets its version bumped so
 * autograd notices a parameter saved for a backward that has since been stepped.
 *
 * A bfloat16 (or float16) parameter keeps its state in its own dtype, as PyTorch does; its update
 * runs the float32 kernel on float32 copies of parameter, gradient and state, which are then
 * rounded back once (ops/ops.h, fsdp_write_back).
 */
#include "ops/ops.h"

#include <math.h>

// a tensor the update writes: present, of param's dtype, contiguous, the shape of param, on param's device
static int check_state(const char* op, const char* what, const fsdp_tensor* param, const fsdp_tensor* t) {
  CHECK_INT(t, "%s: %s is missing (NULL) for param of shape %s", op, what, SH(param));
  CHECK_INT(t->dtype == param->dtype, "%s: %s must have the param's dtype %s, got %s of shape %s", op, what, DT(param),
            DT(t), SH(t));
  CHECK_INT(fsdp_same_shape(t, param), "%s: %s has shape %s but param has shape %s", op, what, SH(t), SH(param));
  CHECK_INT(fsdp_tensor_is_contiguous(t), "%s: %s of shape %s is not contiguous", op, what, SH(t));
  if (fsdp_check_same_device(op, param, t)) return -1;
  return 0;
}

// checks param and grad; returns a contiguous f32 version of grad (new ref) or NULL
static fsdp_tensor* check_param_grad(const char* op, fsdp_tensor* param, fsdp_tensor* grad) {
  CHECK_NULL(param && grad, "%s: param and grad must not be NULL", op);
  if (fsdp_check_float(op, param)) return NULL;
  CHECK_NULL(fsdp_tensor_is_contiguous(param), "%s: param of shape %s is not contiguous", op, SH(param));
  CHECK_NULL(fsdp_is_float(grad->dtype), "%s: grad must be a float tensor, got %s of shape %s (param %s)", op, DT(grad),
             SH(grad), SH(param));
  CHECK_NULL(fsdp_same_shape(grad, param), "%s: grad has shape %s but param has shape %s", op, SH(grad), SH(param));
  if (fsdp_check_same_device(op, param, grad)) return NULL;
  return fsdp_as_contig(grad);
}

// the tensors one update writes (parameter and state) and the float32 values the kernel updates
// for each: the tensor itself when float32, else a float32 copy rounded back by finish()
typedef struct {
  int n, failed;
  fsdp_tensor *t[4], *w[4];
} written;

// the float32 values of t (NULL for an absent t) for the kernel to update
static float* work_on(written* s, fsdp_tensor* t) {
  if (!t) return NULL;
  fsdp_tensor* w = fsdp_as_contig(t);
  if (!w) {
    s->failed = 1;
    return NULL;
  }
  s->t[s->n] = t;
  s->w[s->n++] = w;
  return fsdp_f32(w);
}

// writes the values back (rounded) and bumps each tensor's version; 0, or -1 when a copy failed
static int finish(written* s) {
  int rc = s->failed ? -1 : 0;
  for (int i = 0; i < s->n; i++) {
    if (rc) {
      fsdp_tensor_release(s->w[i]);
      continue;
    }
    rc = fsdp_write_back(s->t[i], s->w[i]);
    fsdp_bump_version(s->t[i]);
  }
  return rc;
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
  written w = {0};
  float* p = work_on(&w, param);
  float* buf = momentum != 0 ? work_on(&w, momentum_buf) : NULL;
  if (!w.failed) fsdp_backend_of(param)->optim->sgd(&h, p, fsdp_f32(g), buf, fsdp_tensor_numel(param));
  fsdp_tensor_release(g);
  return finish(&w);
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
  written w = {0};
  float* p = work_on(&w, param);
  float* m = work_on(&w, exp_avg);
  float* v = work_on(&w, exp_avg_sq);
  float* vmax = amsgrad ? work_on(&w, max_exp_avg_sq) : NULL;
  if (!w.failed) fsdp_backend_of(param)->optim->adam(&h, p, fsdp_f32(g), m, v, vmax, fsdp_tensor_numel(param));
  fsdp_tensor_release(g);
  return finish(&w);
}
