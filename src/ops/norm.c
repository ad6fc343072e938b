/*
 * ops/norm.c -- normalization ops with their backward: batch_norm (and, through a reducer, the
 * synchronized batch norm of parallel/sync_bn.c), group_norm and rms_norm.
 *
 * Each op checks shapes and dtypes, reads its input as contiguous float32 (ops/ops.h, "float
 * dtypes": bfloat16 inputs take float32 or bfloat16 affine parameters, as layer_norm), runs the
 * kernels of the device's norm table (core/kernels_norm.h) and rounds the result to the input's
 * dtype once. Formulas are PyTorch's. batch_norm in training normalizes with the biased batch
 * variance and moves the running variance toward the unbiased one; in eval it uses the running
 * statistics. One batch_norm forward in training:
 *   s1 = [sum x | count]  -> reduce -> s2 = sum (x - mean)^2 -> reduce -> mean, invstd, running
 *   stats -> y; backward: g = [sum dy | sum dy (x - mean)] -> dw, db from this rank's g ->
 *   reduce g -> dx from the reduced g and the reduced count.
 */
#include "ops/norm.h"

#include "ops/ops.h"

#include <math.h>

// a new float32 tensor (n) on x's device
static fsdp_tensor* vec(int64_t n, const fsdp_tensor* x) { return fsdp_new(1, &n, FSDP_F32, fsdp_device_of(x)); }

// checks a per-channel tensor (C): float, x's device, shape (C)
static int check_channel(const char* op, const char* what, const fsdp_tensor* p, const fsdp_tensor* x, int64_t C) {
  if (fsdp_check_float(op, p) || fsdp_check_same_device(op, p, x)) return -1;
  CHECK_INT(p->dtype == x->dtype || p->dtype == FSDP_F32,
            "%s: %s %s %s must have the input's dtype or float32 (input %s %s)", op, what, DT(p), SH(p), DT(x), SH(x));
  CHECK_INT(p->ndim == 1 && p->shape[0] == C,
            "%s: %s of shape %s must have shape (%lld) for input %s with %lld channels", op, what, SH(p), (long long)C,
            SH(x), (long long)C);
  return 0;
}

// ---- batch norm ----------------------------------------------------------------------------------
// saved: 0 x, 1 mean, 2 invstd, 3 s1 (count at [C]), then w
typedef struct {
  int64_t N, C, S;
  int training;                // batch statistics (dx through them)
  int w_slot;                  // saved slot of the weight, -1 without one
  fsdp_norm_reduce_fn reduce;  // sums the gradient sums over the ranks (NULL: none)
  void* ctx;
} batch_norm_params;

static int batch_norm_backward(fsdp_node* node, fsdp_tensor* grad_out, fsdp_tensor** grad_in) {
  fsdp_tensor *x = fsdp_node_saved(node, 0), *mean = x ? fsdp_node_saved(node, 1) : NULL;
  fsdp_tensor *invstd = mean ? fsdp_node_saved(node, 2) : NULL, *s1 = invstd ? fsdp_node_saved(node, 3) : NULL;
  if (!s1) return -1;
  batch_norm_params p;
  fsdp_node_params(node, &p, sizeof p);
  fsdp_tensor* w = NULL;
  if (p.w_slot >= 0 && !(w = fsdp_node_saved(node, p.w_slot))) return -1;
  const fsdp_norm_kernels* k = fsdp_backend_of(x)->norm;
  fsdp_tensor *dy = fsdp_as_contig(grad_out), *g = dy ? vec(2 * p.C, x) : NULL, *gg = NULL;
  fsdp_tensor* dx = node->needs_grad[0] ? fsdp_new_like(x) : NULL;
  fsdp_tensor* dw = node->needs_grad[1] ? vec(p.C, x) : NULL;
  fsdp_tensor* db = node->needs_grad[2] ? vec(p.C, x) : NULL;
  int ok = g && (!node->needs_grad[0] || dx) && (!node->needs_grad[1] || dw) && (!node->needs_grad[2] || db);
  if (ok) k->batch_norm_backward_sums(fsdp_f32(g), fsdp_f32(dy), fsdp_f32(x), fsdp_f32(mean), p.N, p.C, p.S);
  if (ok && p.training && p.reduce && dx) {  // the global sums for dx; dw and db stay this rank's
    ok = (gg = vec(2 * p.C, x)) && !fsdp_copy_strided(gg, g) && !p.reduce(gg, p.ctx);
  }
  if (ok) {
    const float* gsum = p.training ? fsdp_f32(gg ? gg : g) : NULL;
    k->batch_norm_backward(dx ? fsdp_f32(dx) : NULL, dw ? fsdp_f32(dw) : NULL, db ? fsdp_f32(db) : NULL, fsdp_f32(dy),
                           fsdp_f32(x), fsdp_f32(mean), fsdp_f32(invstd), w ? fsdp_f32(w) : NULL, fsdp_f32(g), gsum,
                           fsdp_f32(s1), p.N, p.C, p.S);
  }
  fsdp_tensor_release(dy);
  fsdp_tensor_release(g);
  fsdp_tensor_release(gg);
  if (!ok) {
    fsdp_tensor_release(dx);
    fsdp_tensor_release(dw);
    fsdp_tensor_release(db);
    return -1;
  }
  grad_in[0] = dx;
  grad_in[1] = dw;
  grad_in[2] = db;
  return 0;
}

static int check_batch_norm(const char* op, fsdp_tensor* x, fsdp_tensor* rm, fsdp_tensor* rv, fsdp_tensor* w,
                            fsdp_tensor* b, int training, double momentum, double eps) {
  CHECK_INT(x, "%s: input is nil", op);
  if (fsdp_check_float(op, x)) return -1;
  CHECK_INT(x->ndim >= 2, "%s: input of shape %s must have a batch and a channel dim (N, C, ...)", op, SH(x));
  int64_t C = x->shape[1];
  if ((w && check_channel(op, "weight", w, x, C)) || (b && check_channel(op, "bias", b, x, C))) return -1;
  CHECK_INT(!rm == !rv, "%s: running_mean and running_var must be given together", op);
  CHECK_INT(rm || training, "%s: eval mode (training = false) needs running_mean and running_var", op);
  const char* names[2] = {"running_mean", "running_var"};
  fsdp_tensor* run[2] = {rm, rv};
  for (int i = 0; i < 2 && rm; i++) {
    if (fsdp_check_float(op, run[i]) || fsdp_check_same_device(op, run[i], x)) return -1;
    CHECK_INT(run[i]->ndim == 1 && run[i]->shape[0] == C,
              "%s: %s of shape %s must have shape (%lld) for input %s with %lld channels", op, names[i], SH(run[i]),
              (long long)C, SH(x), (long long)C);
  }
  int64_t per_channel = C ? fsdp_tensor_numel(x) / C : 0;
  CHECK_INT(!training || per_channel > 1,
            "%s: expected more than 1 value per channel when training, got input of shape %s", op, SH(x));
  CHECK_INT(momentum >= 0.0 && momentum <= 1.0, "%s: momentum must be in [0, 1], got %g", op, momentum);
  CHECK_INT(eps >= 0.0, "%s: eps must be >= 0, got %g", op, eps);
  return 0;
}

// mean, invstd (C) and s1 (C + 1) of a forward: the batch's (reduced) in training, updating the
// running statistics; the running ones in eval (s1 then holds only the zero count, never read)
static int batch_norm_stats(fsdp_tensor* xc, fsdp_tensor* rm, fsdp_tensor* rv, int training, double momentum,
                            double eps, fsdp_norm_reduce_fn reduce, void* ctx, int64_t N, int64_t C, int64_t S,
                            fsdp_tensor* mean, fsdp_tensor* invstd, fsdp_tensor* s1) {
  const fsdp_norm_kernels* k = fsdp_backend_of(xc)->norm;
  fsdp_tensor *rmc = rm ? fsdp_as_contig(rm) : NULL, *rvc = rm ? fsdp_as_contig(rv) : NULL, *s2 = NULL;
  int ok = !rm || (rmc && rvc);
  if (ok && !training) {
    k->batch_norm_stats(fsdp_f32(mean), fsdp_f32(invstd), fsdp_f32(rmc), fsdp_f32(rvc), NULL, NULL, C, (float)eps,
                        0.0f);
    fsdp_backend_of(xc)->memset(fsdp_f32(s1), 0, (size_t)(C + 1) * sizeof(float));
  } else if (ok) {
    k->batch_norm_sums(fsdp_f32(s1), fsdp_f32(xc), NULL, N, C, S);
    ok = !(reduce && reduce(s1, ctx)) && (s2 = vec(C, xc));
    if (ok) k->batch_norm_sums(fsdp_f32(s2), fsdp_f32(xc), fsdp_f32(s1), N, C, S);
    ok = ok && !(reduce && reduce(s2, ctx));
    if (ok) {
      k->batch_norm_stats(fsdp_f32(mean), fsdp_f32(invstd), rmc ? fsdp_f32(rmc) : NULL, rvc ? fsdp_f32(rvc) : NULL,
                          fsdp_f32(s1), fsdp_f32(s2), C, (float)eps, (float)momentum);
    }
    if (ok && rm) {  // the running statistics changed in place
      int rc1 = fsdp_write_back(rm, rmc), rc2 = fsdp_write_back(rv, rvc);
      rmc = rvc = NULL;
      fsdp_bump_version(rm);
      fsdp_bump_version(rv);
      ok = !rc1 && !rc2;
    }
  }
  fsdp_tensor_release(rmc);
  fsdp_tensor_release(rvc);
  fsdp_tensor_release(s2);
  return ok ? 0 : -1;
}

fsdp_tensor* fsdp_batch_norm_reduced(const char* op, fsdp_tensor* x, fsdp_tensor* rm, fsdp_tensor* rv, fsdp_tensor* w,
                                     fsdp_tensor* b, int training, double momentum, double eps,
                                     fsdp_norm_reduce_fn reduce, void* ctx) {
  if (check_batch_norm(op, x, rm, rv, w, b, training, momentum, eps)) return NULL;
  const fsdp_backend* be = fsdp_backend_of(x);
  if (!be) return NULL;
  int64_t N = x->shape[0], C = x->shape[1], S = C && N ? fsdp_tensor_numel(x) / (N * C) : 0;
  fsdp_tensor *xc = fsdp_as_contig(x), *wc = NULL, *bc = NULL, *y = NULL;
  fsdp_tensor *mean = vec(C, x), *invstd = vec(C, x), *s1 = vec(C + 1, x);
  int ok = xc && mean && invstd && s1 && (!w || (wc = fsdp_as_contig(w))) && (!b || (bc = fsdp_as_contig(b)));
  ok = ok && !batch_norm_stats(xc, rm, rv, training, momentum, eps, reduce, ctx, N, C, S, mean, invstd, s1);
  if (ok && (y = fsdp_new_like(xc))) {
    be->norm->batch_norm_apply(fsdp_f32(y), fsdp_f32(xc), fsdp_f32(mean), fsdp_f32(invstd), wc ? fsdp_f32(wc) : NULL,
                               bc ? fsdp_f32(bc) : NULL, N, C, S);
    y = fsdp_round_to(y, x->dtype);
  }
  if (y) {
    fsdp_node* node = fsdp_node_new("BatchNormBackward", batch_norm_backward, 3, (fsdp_tensor*[]){x, w, b});
    if (node) {
      fsdp_node_save(node, xc);
      fsdp_node_save(node, mean);
      fsdp_node_save(node, invstd);
      fsdp_node_save(node, s1);
      int w_slot = wc ? fsdp_node_save(node, wc) : -1;
      batch_norm_params p = {
          .N = N, .C = C, .S = S, .training = training != 0, .w_slot = w_slot, .reduce = reduce, .ctx = ctx};
      fsdp_node_set_params(node, &p, sizeof p);
      fsdp_node_set_output(node, y);
    }
  }
  fsdp_tensor_release(xc);
  fsdp_tensor_release(wc);
  fsdp_tensor_release(bc);
  fsdp_tensor_release(mean);
  fsdp_tensor_release(invstd);
  fsdp_tensor_release(s1);
  return y;
}

fsdp_tensor* fsdp_batch_norm(fsdp_tensor* x, fsdp_tensor* running_mean, fsdp_tensor* running_var, fsdp_tensor* w,
                             fsdp_tensor* b, int training, double momentum, double eps) {
  return fsdp_batch_norm_reduced("batch_norm", x, running_mean, running_var, w, b, training, momentum, eps, NULL, NULL);
}

// ---- group norm ----------------------------------------------------------------------------------
// saved: 0 x, 1 mean, 2 rstd, then w
typedef struct {
  int64_t N, C, S, G;
  int w_slot;  // saved slot of the weight, -1 without one
} group_norm_params;

static int group_norm_backward(fsdp_node* node, fsdp_tensor* grad_out, fsdp_tensor** grad_in) {
  fsdp_tensor *x = fsdp_node_saved(node, 0), *mean = x ? fsdp_node_saved(node, 1) : NULL;
  fsdp_tensor* rstd = mean ? fsdp_node_saved(node, 2) : NULL;
  if (!rstd) return -1;
  group_norm_params p;
  fsdp_node_params(node, &p, sizeof p);
  fsdp_tensor* w = NULL;
  if (p.w_slot >= 0 && !(w = fsdp_node_saved(node, p.w_slot))) return -1;
  fsdp_tensor* dy = fsdp_as_contig(grad_out);
  fsdp_tensor* dx = node->needs_grad[0] ? fsdp_new_like(x) : NULL;
  fsdp_tensor* dw = node->needs_grad[1] ? vec(p.C, x) : NULL;
  fsdp_tensor* db = node->needs_grad[2] ? vec(p.C, x) : NULL;
  if (!dy || (node->needs_grad[0] && !dx) || (node->needs_grad[1] && !dw) || (node->needs_grad[2] && !db)) {
    fsdp_tensor_release(dy);
    fsdp_tensor_release(dx);
    fsdp_tensor_release(dw);
    fsdp_tensor_release(db);
    return -1;
  }
  fsdp_backend_of(x)->norm->group_norm_backward(dx ? fsdp_f32(dx) : NULL, dw ? fsdp_f32(dw) : NULL,
                                                db ? fsdp_f32(db) : NULL, fsdp_f32(dy), fsdp_f32(x), fsdp_f32(mean),
                                                fsdp_f32(rstd), w ? fsdp_f32(w) : NULL, p.N, p.C, p.S, p.G);
  fsdp_tensor_release(dy);
  grad_in[0] = dx;
  grad_in[1] = dw;
  grad_in[2] = db;
  return 0;
}

fsdp_tensor* fsdp_group_norm(fsdp_tensor* x, int64_t num_groups, fsdp_tensor* w, fsdp_tensor* b, double eps) {
  const char* op = "group_norm";
  CHECK_NULL(x, "%s: input is nil", op);
  if (fsdp_check_float(op, x)) return NULL;
  CHECK_NULL(x->ndim >= 2, "%s: input of shape %s must have a batch and a channel dim (N, C, ...)", op, SH(x));
  int64_t N = x->shape[0], C = x->shape[1], G = num_groups;
  CHECK_NULL(G >= 1 && C % G == 0, "%s: num_groups %lld must be >= 1 and divide the %lld channels of input %s", op,
             (long long)G, (long long)C, SH(x));
  if ((w && check_channel(op, "weight", w, x, C)) || (b && check_channel(op, "bias", b, x, C))) return NULL;
  CHECK_NULL(eps >= 0.0, "%s: eps must be >= 0, got %g", op, eps);
  const fsdp_backend* be = fsdp_backend_of(x);
  if (!be) return NULL;
  int64_t S = N && C ? fsdp_tensor_numel(x) / (N * C) : 0, NG = N * G;
  fsdp_tensor *xc = fsdp_as_contig(x), *wc = NULL, *bc = NULL, *y = NULL, *mean = vec(NG, x), *rstd = vec(NG, x);
  int ok = xc && mean && rstd && (!w || (wc = fsdp_as_contig(w))) && (!b || (bc = fsdp_as_contig(b)));
  if (ok && (y = fsdp_new_like(xc))) {
    be->norm->group_norm_forward(fsdp_f32(y), fsdp_f32(mean), fsdp_f32(rstd), fsdp_f32(xc), wc ? fsdp_f32(wc) : NULL,
                                 bc ? fsdp_f32(bc) : NULL, N, C, S, G, (float)eps);
    y = fsdp_round_to(y, x->dtype);
  }
  if (y) {
    fsdp_node* node = fsdp_node_new("GroupNormBackward", group_norm_backward, 3, (fsdp_tensor*[]){x, w, b});
    if (node) {
      fsdp_node_save(node, xc);
      fsdp_node_save(node, mean);
      fsdp_node_save(node, rstd);
      int w_slot = wc ? fsdp_node_save(node, wc) : -1;
      group_norm_params p = {.N = N, .C = C, .S = S, .G = G, .w_slot = w_slot};
      fsdp_node_set_params(node, &p, sizeof p);
      fsdp_node_set_output(node, y);
    }
  }
  fsdp_tensor_release(xc);
  fsdp_tensor_release(wc);
  fsdp_tensor_release(bc);
  fsdp_tensor_release(mean);
  fsdp_tensor_release(rstd);
  return y;
}

// ---- rms norm ------------------------------------------------------------------------------------
// saved: 0 x, 1 rstd, then w
typedef struct {
  int64_t M, D;         // x viewed as (M, D), normalized over D
  int normalized_ndim;  // the last dims of x that make D
  int w_slot;           // saved slot of the weight, -1 without one
} rms_norm_params;

static int rms_norm_backward(fsdp_node* node, fsdp_tensor* grad_out, fsdp_tensor** grad_in) {
  fsdp_tensor *x = fsdp_node_saved(node, 0), *rstd = x ? fsdp_node_saved(node, 1) : NULL;
  if (!rstd) return -1;
  rms_norm_params p;
  fsdp_node_params(node, &p, sizeof p);
  fsdp_tensor* w = NULL;
  if (p.w_slot >= 0 && !(w = fsdp_node_saved(node, p.w_slot))) return -1;
  const int64_t* nshape = x->shape + (x->ndim - p.normalized_ndim);
  fsdp_tensor* dy = fsdp_as_contig(grad_out);
  fsdp_tensor* dx = node->needs_grad[0] ? fsdp_new_like(x) : NULL;
  fsdp_tensor* dw = node->needs_grad[1] ? fsdp_new(p.normalized_ndim, nshape, FSDP_F32, fsdp_device_of(x)) : NULL;
  if (!dy || (node->needs_grad[0] && !dx) || (node->needs_grad[1] && !dw)) {
    fsdp_tensor_release(dy);
    fsdp_tensor_release(dx);
    fsdp_tensor_release(dw);
    return -1;
  }
  fsdp_backend_of(x)->norm->rms_norm_backward(dx ? fsdp_f32(dx) : NULL, dw ? fsdp_f32(dw) : NULL, fsdp_f32(dy),
                                              fsdp_f32(x), fsdp_f32(rstd), w ? fsdp_f32(w) : NULL, p.M, p.D);
  fsdp_tensor_release(dy);
  grad_in[0] = dx;
  grad_in[1] = dw;
  return 0;
}

fsdp_tensor* fsdp_rms_norm(fsdp_tensor* x, int normalized_ndim, fsdp_tensor* w, double eps) {
  const char* op = "rms_norm";
  CHECK_NULL(x, "%s: input is nil", op);
  if (fsdp_check_float(op, x)) return NULL;
  int k = normalized_ndim;
  CHECK_NULL(k >= 1 && k <= x->ndim, "%s: cannot normalize over the last %d dims of an input of shape %s", op, k,
             SH(x));
  if (w && fsdp_check_norm_affine(op, "weight", w, x, k)) return NULL;
  CHECK_NULL(eps >= 0.0, "%s: eps must be >= 0, got %g", op, eps);
  const fsdp_backend* be = fsdp_backend_of(x);
  if (!be) return NULL;
  int64_t D = fsdp_shape_numel(k, x->shape + (x->ndim - k)), n = fsdp_tensor_numel(x), M = D ? n / D : 0;
  fsdp_tensor *xc = fsdp_as_contig(x), *wc = NULL, *y = NULL, *rstd = vec(M, x);
  int ok = xc && rstd && (!w || (wc = fsdp_as_contig(w)));
  if (ok && (y = fsdp_new_like(xc))) {
    be->norm->rms_norm_forward(fsdp_f32(y), fsdp_f32(rstd), fsdp_f32(xc), wc ? fsdp_f32(wc) : NULL, M, D, (float)eps);
    y = fsdp_round_to(y, x->dtype);
  }
  if (y) {
    fsdp_node* node = fsdp_node_new("RmsNormBackward", rms_norm_backward, 2, (fsdp_tensor*[]){x, w});
    if (node) {
      fsdp_node_save(node, xc);
      fsdp_node_save(node, rstd);
      int w_slot = wc ? fsdp_node_save(node, wc) : -1;
      rms_norm_params p = {.M = M, .D = D, .normalized_ndim = k, .w_slot = w_slot};
      fsdp_node_set_params(node, &p, sizeof p);
      fsdp_node_set_output(node, y);
    }
  }
  fsdp_tensor_release(xc);
  fsdp_tensor_release(wc);
  fsdp_tensor_release(rstd);
  return y;
}
