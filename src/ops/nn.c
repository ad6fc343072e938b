/*
 * ops/nn.c -- neural-network ops with their backward: softmax, log_softmax, cross_entropy
 * (fused log_softmax + nll, label smoothing), nll_loss, mse_loss, layer_norm, embedding, dropout,
 * dropout2d and scaled_dot_product_attention.
 *
 * The op layer is device independent: it checks shapes and dtypes, allocates outputs, records the
 * autograd node and reaches the loops only through the device's kernel tables (core/kernels_nn.h, and
 * the linalg table's gemm_tiles for attention). Semantics follow PyTorch (losses: mean
 * reduction over the non-ignored targets). Each op computes in float32 and rounds its result to
 * its input's dtype once (bfloat16: ops/ops.h, "float dtypes").
 */
#include "ops/ops.h"

#include <math.h>

// ---- helpers -------------------------------------------------------------------------------------
// a contiguous int64 version of t (new ref: t itself when already contiguous)
static fsdp_tensor* as_contig_i64(fsdp_tensor* t) {
  if (fsdp_tensor_is_contiguous(t)) {
    fsdp_tensor_retain(t);
    return t;
  }
  fsdp_tensor* r = fsdp_new(t->ndim, t->shape, FSDP_I64, fsdp_device_of(t));
  if (r && fsdp_copy_strided(r, t)) {
    fsdp_tensor_release(r);
    return NULL;
  }
  return r;
}

// The losses (cross entropy, nll, mse) keep their values on the device: the kernel writes the mean
// into a one-element float32 buffer (and the count of targets it divided by into another, which
// the backward reads), and the backward reads the upstream gradient there too, so a training step
// never waits for the device to learn a loss (fsdp_round_to then gives it the op's dtype). A 0-dim
// float32 loss buffer; NULL on error.
static fsdp_tensor* loss_buffer(int device) {
  int64_t none[1] = {0};
  return fsdp_new(0, none, FSDP_F32, device);
}

// ---- softmax / log_softmax -----------------------------------------------------------------------
// saved: 0 the output y
typedef struct {
  int64_t outer, n, inner;  // the input viewed as (outer, n, inner), softmax over n
  int log;                  // log_softmax
} softmax_params;

static int softmax_backward(fsdp_node* node, fsdp_tensor* grad_out, fsdp_tensor** grad_in) {
  fsdp_tensor* y = fsdp_node_saved(node, 0);
  if (!y) return -1;
  softmax_params p;
  fsdp_node_params(node, &p, sizeof p);
  fsdp_tensor* g = fsdp_as_contig(grad_out);
  if (!g) return -1;
  fsdp_tensor* gx = fsdp_new_like(y);
  if (gx)
    fsdp_backend_of(y)->nn->softmax_backward(fsdp_f32(gx), fsdp_f32(g), fsdp_f32(y), p.outer, p.n, p.inner, p.log);
  fsdp_tensor_release(g);
  grad_in[0] = gx;
  return gx ? 0 : -1;
}

static fsdp_tensor* softmax_op(const char* op, fsdp_tensor* a, int dim, int log) {
  CHECK_NULL(a, "%s: input is nil", op);
  if (fsdp_check_float(op, a)) return NULL;
  int d = fsdp_wrap_dim(op, dim, a->ndim);
  if (d < 0) return NULL;
  const fsdp_backend* be = fsdp_backend_of(a);
  if (!be) return NULL;
  // view as (outer, n, inner) around d; a 0-dim tensor is one row of one element
  int64_t outer = 1, n = a->ndim ? a->shape[d] : 1, inner = 1;
  for (int i = 0; i < d; i++) outer *= a->shape[i];
  for (int i = d + 1; i < a->ndim; i++) inner *= a->shape[i];
  fsdp_tensor* x = fsdp_as_contig(a);
  fsdp_tensor* y = x ? fsdp_new_like(x) : NULL;  // float32; the node saves it
  if (y) be->nn->softmax_forward(fsdp_f32(y), fsdp_f32(x), outer, n, inner, log);
  fsdp_tensor_release(x);
  fsdp_tensor* out = y ? fsdp_as_contig_dtype(y, a->dtype) : NULL;
  fsdp_node* node = out ? fsdp_node_new(log ? "LogSoftmaxBackward" : "SoftmaxBackward", softmax_backward, 1, &a) : NULL;
  if (node) {
    softmax_params p = {.outer = outer, .n = n, .inner = inner, .log = log};
    fsdp_node_set_params(node, &p, sizeof p);
    fsdp_node_save(node, y);
    fsdp_node_set_output(node, out);
  }
  fsdp_tensor_release(y);
  return out;
}

fsdp_tensor* fsdp_softmax(fsdp_tensor* a, int dim) { return softmax_op("softmax", a, dim, 0); }
fsdp_tensor* fsdp_log_softmax(fsdp_tensor* a, int dim) { return softmax_op("log_softmax", a, dim, 1); }

// ---- classification losses ---------------------------------------------------------------------------
// input (N, C, d1, ...) or (C), target (N, d1, ...) or () -> N, C and S = d1 * ... (1 without extra dims)
static int class_loss_dims(const char* op, const fsdp_tensor* x, const fsdp_tensor* target, int64_t* N, int64_t* C,
                           int64_t* S) {
  CHECK_INT(target->dtype == FSDP_I64,
            "%s: target must be an int64 tensor of class indices, got %s of shape %s "
            "(input %s)",
            op, DT(target), SH(target), SH(x));
  int class_dim = x->ndim == 1 ? 0 : 1;  // 0-based
  CHECK_INT(x->ndim < 1 || x->shape[class_dim] > 0, "%s: input of shape %s has no classes (dim %d has size 0)", op,
            SH(x), class_dim + 1);
  if (x->ndim == 1) {
    CHECK_INT(target->ndim == 0, "%s: for an unbatched input of shape %s the target must be 0-dim, got shape %s", op,
              SH(x), SH(target));
    *N = 1;
    *C = x->shape[0];
    *S = 1;
    return 0;
  }
  CHECK_INT(x->ndim >= 2, "%s: input must have shape (N, C) or (N, C, d1, ...), got %s", op, SH(x));
  int64_t expect[FSDP_MAX_DIMS] = {0};
  int ok = target->ndim == x->ndim - 1;
  expect[0] = x->shape[0];
  *S = 1;
  for (int i = 2; i < x->ndim; i++) {
    expect[i - 1] = x->shape[i];
    *S *= x->shape[i];
  }
  for (int i = 0; ok && i < target->ndim; i++) ok = target->shape[i] == expect[i];
  CHECK_INT(ok, "%s: target of shape %s does not match input of shape %s (expected target shape %s)", op, SH(target),
            SH(x), fsdp_dims_s(x->ndim - 1, expect));
  *N = x->shape[0];
  *C = x->shape[1];
  return 0;
}

// On an async device (a GPU) the check runs there: a bad target fails the next synchronization
// (loss:item(), a copy to the host) with the same message, and the loss kernels skip it meanwhile.
static int check_targets(const char* op, const fsdp_backend* be, const fsdp_tensor* x, const fsdp_tensor* tc, int64_t C,
                         int64_t ignore_index) {
  int64_t bad = 0;
  int check = 0;
  if (be->async)
    check = fsdp_check_defer("%s: target value %%lld is out of range for %lld classes (expected 0 <= target < %lld, or "
                             "ignore_index %lld); input %s, target %s (found on the device)",
                             op, (long long)C, (long long)C, (long long)ignore_index, SH(x), SH(tc));
  CHECK_INT(!be->nn->check_targets(fsdp_i64(tc), fsdp_tensor_numel(tc), C, ignore_index, &bad, check),
            "%s: target value %lld is out of range for %lld classes (expected 0 <= target < %lld, or "
            "ignore_index %lld); input %s, target %s",
            op, (long long)bad, (long long)C, (long long)C, (long long)ignore_index, SH(x), SH(tc));
  return 0;
}

// saved: 0 logits, 1 target, 2 logsumexp (N, S), 3 the count of targets not ignored (the mean's
// divisor, on the device)
typedef struct {
  int64_t N, C, S;  // logits (N, C, S), target (N, S)
  int64_t ignore_index;
  double label_smoothing;
} cross_entropy_params;

static int cross_entropy_backward(fsdp_node* node, fsdp_tensor* grad_out, fsdp_tensor** grad_in) {
  fsdp_tensor* x = fsdp_node_saved(node, 0);
  fsdp_tensor* t = x ? fsdp_node_saved(node, 1) : NULL;
  fsdp_tensor* lse = t ? fsdp_node_saved(node, 2) : NULL;
  fsdp_tensor* count = lse ? fsdp_node_saved(node, 3) : NULL;
  fsdp_tensor* g = count ? fsdp_as_contig(grad_out) : NULL;  // (float32, on the device)
  if (!g) return -1;
  cross_entropy_params p;
  fsdp_node_params(node, &p, sizeof p);
  fsdp_tensor* gx = fsdp_new_like(x);
  if (gx)
    fsdp_backend_of(x)->nn->cross_entropy_backward(fsdp_f32(gx), fsdp_f32(x), fsdp_f32(lse), fsdp_i64(t), p.N, p.C, p.S,
                                                   p.ignore_index, (float)p.label_smoothing, fsdp_f32(g),
                                                   fsdp_f32(count));
  fsdp_tensor_release(g);
  grad_in[0] = gx;
  return gx ? 0 : -1;
}

fsdp_tensor* fsdp_cross_entropy(fsdp_tensor* logits, fsdp_tensor* target, int64_t ignore_index,
                                double label_smoothing) {
  const char* op = "cross_entropy";
  CHECK_NULL(logits && target, "%s: input and target must be tensors (got nil)", op);
  if (fsdp_check_float(op, logits) || fsdp_check_same_device(op, logits, target)) return NULL;
  CHECK_NULL(label_smoothing >= 0.0 && label_smoothing <= 1.0, "%s: label_smoothing must be in [0, 1], got %g", op,
             label_smoothing);
  int64_t N, C, S;
  if (class_loss_dims(op, logits, target, &N, &C, &S)) return NULL;
  const fsdp_backend* be = fsdp_backend_of(logits);
  if (!be) return NULL;
  fsdp_tensor* tc = as_contig_i64(target);
  if (!tc) return NULL;
  if (check_targets(op, be, logits, tc, C, ignore_index)) {
    fsdp_tensor_release(tc);
    return NULL;
  }
  fsdp_tensor* x = fsdp_as_contig(logits);
  int64_t ns = N * S;
  fsdp_tensor* lse = x ? fsdp_new(1, &ns, FSDP_F32, fsdp_device_of(x)) : NULL;
  if (!lse) {
    fsdp_tensor_release(x);
    fsdp_tensor_release(tc);
    return NULL;
  }
  fsdp_tensor* loss = loss_buffer(fsdp_device_of(x));
  fsdp_tensor* count = loss ? loss_buffer(fsdp_device_of(x)) : NULL;
  if (count)
    be->nn->cross_entropy_forward(fsdp_f32(loss), fsdp_f32(count), fsdp_f32(lse), fsdp_f32(x), fsdp_i64(tc), N, C, S,
                                  ignore_index, (float)label_smoothing);
  fsdp_tensor* out = count ? fsdp_round_to(loss, logits->dtype) : NULL;
  if (!count) fsdp_tensor_release(loss);
  fsdp_node* node =
      out ? fsdp_node_new("CrossEntropyBackward", cross_entropy_backward, 2, (fsdp_tensor*[]){logits, target}) : NULL;
  if (node) {
    cross_entropy_params p = {.N = N, .C = C, .S = S, .ignore_index = ignore_index, .label_smoothing = label_smoothing};
    fsdp_node_set_params(node, &p, sizeof p);
    fsdp_node_save(node, x);
    fsdp_node_save(node, tc);
    fsdp_node_save(node, lse);
    fsdp_node_save(node, count);
    fsdp_node_set_output(node, out);
  }
  fsdp_tensor_release(x);
  fsdp_tensor_release(tc);
  fsdp_tensor_release(lse);
  fsdp_tensor_release(count);
  return out;
}

// saved: 0 target, 1 the count of targets not ignored (the mean's divisor, on the device)
typedef struct {
  int64_t N, C, S;  // logp (N, C, S), target (N, S)
  int64_t ignore_index;
  int ndim;  // logp's shape, the gradient's
  int64_t shape[FSDP_MAX_DIMS];
} nll_params;

static int nll_backward(fsdp_node* node, fsdp_tensor* grad_out, fsdp_tensor** grad_in) {
  fsdp_tensor* t = fsdp_node_saved(node, 0);
  fsdp_tensor* count = t ? fsdp_node_saved(node, 1) : NULL;
  fsdp_tensor* g = count ? fsdp_as_contig(grad_out) : NULL;
  if (!g) return -1;
  nll_params p;
  fsdp_node_params(node, &p, sizeof p);
  fsdp_tensor* gx = fsdp_new(p.ndim, p.shape, FSDP_F32, fsdp_device_of(t));
  if (gx)
    fsdp_backend_of(t)->nn->nll_backward(fsdp_f32(gx), fsdp_i64(t), p.N, p.C, p.S, p.ignore_index, fsdp_f32(g),
                                         fsdp_f32(count));
  fsdp_tensor_release(g);
  grad_in[0] = gx;
  return gx ? 0 : -1;
}

fsdp_tensor* fsdp_nll_loss(fsdp_tensor* logp, fsdp_tensor* target, int64_t ignore_index) {
  const char* op = "nll_loss";
  CHECK_NULL(logp && target, "%s: input and target must be tensors (got nil)", op);
  if (fsdp_check_float(op, logp) || fsdp_check_same_device(op, logp, target)) return NULL;
  int64_t N, C, S;
  if (class_loss_dims(op, logp, target, &N, &C, &S)) return NULL;
  const fsdp_backend* be = fsdp_backend_of(logp);
  if (!be) return NULL;
  fsdp_tensor* tc = as_contig_i64(target);
  if (!tc) return NULL;
  if (check_targets(op, be, logp, tc, C, ignore_index)) {
    fsdp_tensor_release(tc);
    return NULL;
  }
  fsdp_tensor* x = fsdp_as_contig(logp);
  if (!x) {
    fsdp_tensor_release(tc);
    return NULL;
  }
  fsdp_tensor* loss = loss_buffer(fsdp_device_of(x));
  fsdp_tensor* count = loss ? loss_buffer(fsdp_device_of(x)) : NULL;
  if (count) be->nn->nll_forward(fsdp_f32(loss), fsdp_f32(count), fsdp_f32(x), fsdp_i64(tc), N, C, S, ignore_index);
  fsdp_tensor_release(x);
  fsdp_tensor* out = count ? fsdp_round_to(loss, logp->dtype) : NULL;
  if (!count) fsdp_tensor_release(loss);
  fsdp_node* node = out ? fsdp_node_new("NllLossBackward", nll_backward, 2, (fsdp_tensor*[]){logp, target}) : NULL;
  if (node) {
    nll_params p = {.N = N, .C = C, .S = S, .ignore_index = ignore_index, .ndim = logp->ndim};
    memcpy(p.shape, logp->shape, logp->ndim * sizeof(int64_t));
    fsdp_node_set_params(node, &p, sizeof p);
    fsdp_node_save(node, tc);
    fsdp_node_save(node, count);
    fsdp_node_set_output(node, out);
  }
  fsdp_tensor_release(tc);
  fsdp_tensor_release(count);
  return out;
}

// ---- mse ------------------------------------------------------------------------------------------------
// saved: 0 a, 1 b (contiguous)
static int mse_backward(fsdp_node* node, fsdp_tensor* grad_out, fsdp_tensor** grad_in) {
  fsdp_tensor* a = fsdp_node_saved(node, 0);
  fsdp_tensor* b = a ? fsdp_node_saved(node, 1) : NULL;
  fsdp_tensor* g = b ? fsdp_as_contig(grad_out) : NULL;
  if (!g) return -1;
  int64_t n = fsdp_tensor_numel(a);
  fsdp_tensor* ga = node->needs_grad[0] ? fsdp_new_like(a) : NULL;
  fsdp_tensor* gb = node->needs_grad[1] ? fsdp_new_like(b) : NULL;
  if ((node->needs_grad[0] && !ga) || (node->needs_grad[1] && !gb)) {
    fsdp_tensor_release(ga);
    fsdp_tensor_release(gb);
    fsdp_tensor_release(g);
    return -1;
  }
  fsdp_backend_of(a)->nn->mse_backward(ga ? fsdp_f32(ga) : NULL, gb ? fsdp_f32(gb) : NULL, fsdp_f32(a), fsdp_f32(b), n,
                                       fsdp_f32(g));
  fsdp_tensor_release(g);
  grad_in[0] = ga;
  grad_in[1] = gb;
  return 0;
}

fsdp_tensor* fsdp_mse_loss(fsdp_tensor* a, fsdp_tensor* b) {
  const char* op = "mse_loss";
  CHECK_NULL(a && b, "%s: input and target must be tensors (got nil)", op);
  if (fsdp_check_float(op, a) || fsdp_check_float(op, b) || fsdp_check_same_device(op, a, b)) return NULL;
  CHECK_NULL(fsdp_same_shape(a, b), "%s: input of shape %s and target of shape %s must have the same shape", op, SH(a),
             SH(b));
  const fsdp_backend* be = fsdp_backend_of(a);
  if (!be) return NULL;
  fsdp_tensor* ac = fsdp_as_contig(a);
  fsdp_tensor* bc = ac ? fsdp_as_contig(b) : NULL;
  if (!bc) {
    fsdp_tensor_release(ac);
    return NULL;
  }
  int64_t n = fsdp_tensor_numel(ac);
  fsdp_tensor* loss = loss_buffer(fsdp_device_of(a));
  if (loss) be->nn->mse_forward(fsdp_f32(loss), fsdp_f32(ac), fsdp_f32(bc), n);
  fsdp_tensor* out = fsdp_round_to(loss, fsdp_result_dtype(a, b));
  fsdp_node* node = out ? fsdp_node_new("MseLossBackward", mse_backward, 2, (fsdp_tensor*[]){a, b}) : NULL;
  if (node) {
    fsdp_node_save(node, ac);
    fsdp_node_save(node, bc);
    fsdp_node_set_output(node, out);
  }
  fsdp_tensor_release(ac);
  fsdp_tensor_release(bc);
  return out;
}

// ---- layer norm --------------------------------------------------------------------------------------------
// saved: x, mean, rstd, (w)
typedef struct {
  int64_t M, D;         // x viewed as (M, D), normalized over D
  int normalized_ndim;  // the last dims of x that make D
  int w_slot;           // saved slot of the weight, -1 without one
} layer_norm_params;

static int layer_norm_backward(fsdp_node* node, fsdp_tensor* grad_out, fsdp_tensor** grad_in) {
  fsdp_tensor* x = fsdp_node_saved(node, 0);
  fsdp_tensor* mean = x ? fsdp_node_saved(node, 1) : NULL;
  fsdp_tensor* rstd = mean ? fsdp_node_saved(node, 2) : NULL;
  if (!rstd) return -1;
  layer_norm_params p;
  fsdp_node_params(node, &p, sizeof p);
  fsdp_tensor* w = NULL;
  if (p.w_slot >= 0 && !(w = fsdp_node_saved(node, p.w_slot))) return -1;
  int64_t M = p.M, D = p.D;
  int k = p.normalized_ndim;
  const int64_t* nshape = x->shape + (x->ndim - k);  // the normalized shape
  fsdp_tensor* dy = fsdp_as_contig(grad_out);
  if (!dy) return -1;
  fsdp_tensor* dx = node->needs_grad[0] ? fsdp_new_like(x) : NULL;
  fsdp_tensor* dw = node->needs_grad[1] ? fsdp_new(k, nshape, FSDP_F32, fsdp_device_of(x)) : NULL;
  fsdp_tensor* db = node->needs_grad[2] ? fsdp_new(k, nshape, FSDP_F32, fsdp_device_of(x)) : NULL;
  if ((node->needs_grad[0] && !dx) || (node->needs_grad[1] && !dw) || (node->needs_grad[2] && !db)) {
    fsdp_tensor_release(dy);
    fsdp_tensor_release(dx);
    fsdp_tensor_release(dw);
    fsdp_tensor_release(db);
    return -1;
  }
  fsdp_backend_of(x)->nn->layer_norm_backward(dx ? fsdp_f32(dx) : NULL, dw ? fsdp_f32(dw) : NULL,
                                              db ? fsdp_f32(db) : NULL, fsdp_f32(dy), fsdp_f32(x), fsdp_f32(mean),
                                              fsdp_f32(rstd), w ? fsdp_f32(w) : NULL, M, D);
  fsdp_tensor_release(dy);
  grad_in[0] = dx;
  grad_in[1] = dw;
  grad_in[2] = db;
  return 0;
}

// checks that an affine parameter has exactly the normalized shape, and x's dtype or float32 (as
// PyTorch's CPU layer_norm takes bfloat16 inputs with float32 parameters)
int fsdp_check_norm_affine(const char* op, const char* what, const fsdp_tensor* p, const fsdp_tensor* x, int k) {
  if (fsdp_check_float(op, p) || fsdp_check_same_device(op, p, x)) return -1;
  CHECK_INT(p->dtype == x->dtype || p->dtype == FSDP_F32,
            "%s: %s %s %s must have the input's dtype or float32 (input %s %s)", op, what, DT(p), SH(p), DT(x), SH(x));
  int ok = p->ndim == k && memcmp(p->shape, x->shape + (x->ndim - k), k * sizeof(int64_t)) == 0;
  CHECK_INT(ok, "%s: %s of shape %s does not match the normalized shape %s of input %s", op, what, SH(p),
            fsdp_dims_s(k, x->shape + (x->ndim - k)), SH(x));
  return 0;
}

fsdp_tensor* fsdp_layer_norm(fsdp_tensor* x, int normalized_ndim, fsdp_tensor* w, fsdp_tensor* b, double eps) {
  const char* op = "layer_norm";
  CHECK_NULL(x, "%s: input is nil", op);
  if (fsdp_check_float(op, x)) return NULL;
  int k = normalized_ndim;
  CHECK_NULL(k >= 1 && k <= x->ndim, "%s: cannot normalize over the last %d dims of an input of shape %s", op, k,
             SH(x));
  if ((w && fsdp_check_norm_affine(op, "weight", w, x, k)) || (b && fsdp_check_norm_affine(op, "bias", b, x, k))) {
    return NULL;
  }
  CHECK_NULL(eps >= 0.0, "%s: eps must be >= 0, got %g", op, eps);
  const fsdp_backend* be = fsdp_backend_of(x);
  if (!be) return NULL;
  int64_t D = fsdp_shape_numel(k, x->shape + (x->ndim - k)), n = fsdp_tensor_numel(x), M = D ? n / D : 0;
  fsdp_tensor *xc = fsdp_as_contig(x), *wc = NULL, *bc = NULL, *y = NULL, *mean = NULL, *rstd = NULL;
  int ok = xc && (!w || (wc = fsdp_as_contig(w))) && (!b || (bc = fsdp_as_contig(b)));
  ok = ok && (y = fsdp_new_like(xc)) && (mean = fsdp_new(1, &M, FSDP_F32, fsdp_device_of(x))) &&
       (rstd = fsdp_new(1, &M, FSDP_F32, fsdp_device_of(x)));
  if (ok) {
    be->nn->layer_norm_forward(fsdp_f32(y), fsdp_f32(mean), fsdp_f32(rstd), fsdp_f32(xc), wc ? fsdp_f32(wc) : NULL,
                               bc ? fsdp_f32(bc) : NULL, M, D, (float)eps);
    ok = (y = fsdp_round_to(y, x->dtype)) != NULL;
  }
  if (ok) {
    fsdp_node* node = fsdp_node_new("LayerNormBackward", layer_norm_backward, 3, (fsdp_tensor*[]){x, w, b});
    if (node) {
      fsdp_node_save(node, xc);
      fsdp_node_save(node, mean);
      fsdp_node_save(node, rstd);
      int w_slot = wc ? fsdp_node_save(node, wc) : -1;
      layer_norm_params p = {.M = M, .D = D, .normalized_ndim = k, .w_slot = w_slot};
      fsdp_node_set_params(node, &p, sizeof p);
      fsdp_node_set_output(node, y);
    }
  } else {
    fsdp_tensor_release(y);
    y = NULL;
  }
  fsdp_tensor_release(xc);
  fsdp_tensor_release(wc);
  fsdp_tensor_release(bc);
  fsdp_tensor_release(mean);
  fsdp_tensor_release(rstd);
  return y;
}

// ---- embedding -------------------------------------------------------------------------------------------------
// saved: 0 index (contiguous)
typedef struct {
  int64_t V, D;         // weight (V, D)
  int64_t padding_idx;  // the row that gets no gradient, or negative for none
} embedding_params;

static int embedding_backward(fsdp_node* node, fsdp_tensor* grad_out, fsdp_tensor** grad_in) {
  fsdp_tensor* idx = fsdp_node_saved(node, 0);
  if (!idx) return -1;
  embedding_params p;
  fsdp_node_params(node, &p, sizeof p);
  int64_t V = p.V, D = p.D, shape[2] = {V, D};
  fsdp_tensor* gy = fsdp_as_contig(grad_out);
  fsdp_tensor* gw = gy ? fsdp_new(2, shape, FSDP_F32, fsdp_device_of(gy)) : NULL;
  if (gw)
    fsdp_backend_of(gw)->nn->embedding_backward(fsdp_f32(gw), fsdp_f32(gy), fsdp_i64(idx), fsdp_tensor_numel(idx), V, D,
                                                p.padding_idx);
  fsdp_tensor_release(gy);
  grad_in[0] = gw;
  return gw ? 0 : -1;
}

// padding_idx: a row in [0, V) that gets no gradient, or negative for none (a PyTorch-style negative
// padding_idx is wrapped by the Lua layer before it gets here)
fsdp_tensor* fsdp_embedding(fsdp_tensor* weight, fsdp_tensor* index, int64_t padding_idx) {
  const char* op = "embedding";
  CHECK_NULL(weight && index, "%s: weight and index must be tensors (got nil)", op);
  if (fsdp_check_float(op, weight) || fsdp_check_same_device(op, weight, index)) return NULL;
  CHECK_NULL(weight->ndim == 2, "%s: weight must be 2-D (num_embeddings, embedding_dim), got shape %s", op, SH(weight));
  CHECK_NULL(index->dtype == FSDP_I64, "%s: index must be an int64 tensor, got %s of shape %s", op, DT(index),
             SH(index));
  CHECK_NULL(index->ndim < FSDP_MAX_DIMS, "%s: index of shape %s has too many dims (output would exceed %d)", op,
             SH(index), FSDP_MAX_DIMS);
  int64_t V = weight->shape[0], D = weight->shape[1];
  CHECK_NULL(padding_idx < V, "%s: padding_idx %lld out of range for %lld embeddings (weight %s)", op,
             (long long)padding_idx, (long long)V, SH(weight));
  const fsdp_backend* be = fsdp_backend_of(weight);
  if (!be) return NULL;
  fsdp_tensor* idx = as_contig_i64(index);
  if (!idx) return NULL;
  int64_t n = fsdp_tensor_numel(idx), bad = 0;
  if (V == 0 && n > 0) {  // no valid index at all
    fsdp_errorf("%s: index of shape %s into 0 embeddings (weight %s)", op, SH(index), SH(weight));
    fsdp_tensor_release(idx);
    return NULL;
  }
  // (check_targets skips its ignore value; 0 is harmless to skip when V > 0.) On an async device the
  // check runs there, as the targets' (check_targets above)
  int check = be->async ? fsdp_check_defer("%s: index value %%lld is out of range for %lld embeddings (expected 0 <= "
                                           "index < %lld); weight %s, index %s (found on the device)",
                                           op, (long long)V, (long long)V, SH(weight), SH(index))
                        : 0;
  if (be->nn->check_targets(fsdp_i64(idx), n, V, 0, &bad, check)) {
    fsdp_errorf("%s: index value %lld is out of range for %lld embeddings (expected 0 <= index < %lld); weight %s, "
                "index %s",
                op, (long long)bad, (long long)V, (long long)V, SH(weight), SH(index));
    fsdp_tensor_release(idx);
    return NULL;
  }
  int64_t shape[FSDP_MAX_DIMS];
  memcpy(shape, index->shape, index->ndim * sizeof(int64_t));
  shape[index->ndim] = D;
  // rows are copied, not computed: a bfloat16 weight gives bfloat16 rows (the index_select kernel,
  // any dtype), with no float32 copy of the whole table
  fsdp_tensor* w = fsdp_as_contig_dtype(weight, weight->dtype);
  fsdp_tensor* y = w ? fsdp_new(index->ndim + 1, shape, weight->dtype, fsdp_device_of(w)) : NULL;
  if (y) {
    if (weight->dtype == FSDP_F32) be->nn->embedding_forward(fsdp_f32(y), fsdp_f32(w), fsdp_i64(idx), n, V, D);
    else be->elem->index_select(fsdp_ptr(y), fsdp_ptr(w), fsdp_dtype_size(w->dtype), fsdp_i64(idx), 1, V, n, D);
    fsdp_node* node = fsdp_node_new("EmbeddingBackward", embedding_backward, 1, &weight);
    if (node) {
      embedding_params p = {.V = V, .D = D, .padding_idx = padding_idx};
      fsdp_node_set_params(node, &p, sizeof p);
      fsdp_node_save(node, idx);
      fsdp_node_set_output(node, y);
    }
  }
  fsdp_tensor_release(w);
  fsdp_tensor_release(idx);
  return y;
}

// ---- dropout ------------------------------------------------------------------------------------------------------
// The keep mask is a function of (seed, element index): the seed is one draw from the global RNG
// (deterministic under fsdp_manual_seed), and backward regenerates the mask instead of storing it.
typedef struct {
  double p;       // drop probability
  uint64_t seed;  // of the keep mask
} dropout_params;

static int dropout_backward(fsdp_node* node, fsdp_tensor* grad_out, fsdp_tensor** grad_in) {
  dropout_params dp;
  fsdp_node_params(node, &dp, sizeof dp);
  fsdp_tensor* g = fsdp_as_contig(grad_out);
  fsdp_tensor* gx = g ? fsdp_new_like(g) : NULL;
  if (gx) fsdp_backend_of(g)->nn->dropout(fsdp_f32(gx), fsdp_f32(g), fsdp_tensor_numel(g), (float)dp.p, dp.seed);
  fsdp_tensor_release(g);
  grad_in[0] = gx;
  return gx ? 0 : -1;
}

fsdp_tensor* fsdp_dropout(fsdp_tensor* x, double p, int training) {
  const char* op = "dropout";
  CHECK_NULL(x, "%s: input is nil", op);
  CHECK_NULL(p >= 0.0 && p <= 1.0, "%s: probability has to be between 0 and 1, but got %g", op, p);
  if (!training || p == 0.0) {
    fsdp_tensor_retain(x);
    return x;
  }  // identity
  if (fsdp_check_float(op, x)) return NULL;
  const fsdp_backend* be = fsdp_backend_of(x);
  if (!be) return NULL;
  fsdp_tensor* xc = fsdp_as_contig(x);
  fsdp_tensor* y = xc ? fsdp_new_like(xc) : NULL;
  uint64_t seed = fsdp_rng_next();
  if (y) be->nn->dropout(fsdp_f32(y), fsdp_f32(xc), fsdp_tensor_numel(xc), (float)p, seed);
  y = fsdp_round_to(y, x->dtype);
  if (y) {
    fsdp_node* node = fsdp_node_new("DropoutBackward", dropout_backward, 1, &x);
    if (node) {
      fsdp_node_set_params(node, &(dropout_params){.p = p, .seed = seed}, sizeof(dropout_params));
      fsdp_node_set_output(node, y);
    }
  }
  fsdp_tensor_release(xc);
  return y;
}

// ---- dropout2d ----------------------------------------------------------------------------------------------------
// One keep mask value per channel, (N, C, 1, 1) or (C, 1, 1): 1/(1-p) or 0, from the dropout kernel on
// ones (the same seeded mask on every device), in x's dtype as PyTorch makes it; y = x * mask through
// the mul op, whose node gives the backward.
fsdp_tensor* fsdp_dropout2d(fsdp_tensor* x, double p, int training) {
  const char* op = "dropout2d";
  CHECK_NULL(x, "%s: input is nil", op);
  CHECK_NULL(p >= 0.0 && p <= 1.0, "%s: probability has to be between 0 and 1, but got %g", op, p);
  if (fsdp_check_float(op, x)) return NULL;
  CHECK_NULL(x->ndim == 4 || x->ndim == 3, "%s: expected a 4-D (N, C, H, W) or 3-D (C, H, W) input, got %s", op, SH(x));
  if (!training || p == 0.0) {
    fsdp_tensor_retain(x);
    return x;
  }  // identity
  int nd = x->ndim;
  int64_t shape[4] = {x->shape[0], nd == 4 ? x->shape[1] : 1, 1, 1};  // (N, C, 1, 1) or (C, 1, 1)
  fsdp_tensor* mask = fsdp_full(nd, shape, 1.0, FSDP_F32, fsdp_device_of(x));
  uint64_t seed = fsdp_rng_next();
  if (mask) fsdp_backend_of(mask)->nn->dropout(fsdp_f32(mask), fsdp_f32(mask), fsdp_tensor_numel(mask), (float)p, seed);
  mask = fsdp_round_to(mask, x->dtype);
  fsdp_tensor* y = mask ? fsdp_mul(x, mask) : NULL;
  fsdp_tensor_release(mask);
  return y;
}
// ---- scaled dot-product attention ------------------------------------------------------------------------------------
// Forward: S = scale * q k^T (+ mask, causal), P = softmax(S), O = dropout(P) v.
// Backward: dV = Pd^T dO, dPd = dO V^T, dP = dropout(dPd), dS = P * (dP - rowsum(dP * P)),
//           dQ = scale * dS K, dK = scale * dS^T Q, dmask = dS summed to the mask's shape.
//
// q (..., Tq, D), k (..., Tk, D), v (..., Tk, Dv) and the output's gradient are each B = prod(...)
// matrices. A tensor whose last dim is dense (stride 1) is used in place -- per matrix an offset,
// rows ld apart -- so heads cut from one projection, qkv.narrow(3, ...).reshape(B, T, H, hd)
// .transpose(2, 3), cost no copy. The output and the gradients of q, k, v are laid out in memory
// like the tensor they belong to (fsdp_new_layout_like): for such heads the output (B, H, T, hd) is
// stored as (B, T, H, hd), so y.transpose(2, 3).reshape(B, T, d) is a view. The scores P (B.., Tq,
// Tk) are contiguous.
typedef struct {
  float* p;
  int64_t* off;
  int64_t ld;
} bmats;  // matrix b, row i: p + off[b] + i * ld

static float* bm(const bmats* m, int64_t b, int64_t i) { return m->p + m->off[b] + i * m->ld; }

// element offsets of the B = prod(shape[0:nb]) matrices of a tensor with these strides (0: broadcast)
static void batch_offsets(int nb, const int64_t* shape, const int64_t* stride, int64_t B, int64_t* off) {
  for (int64_t b = 0; b < B; b++) {
    int64_t rem = b, o = 0;
    for (int i = nb - 1; i >= 0; i--) {
      o += (rem % shape[i]) * stride[i];
      rem /= shape[i];
    }
    off[b] = o;
  }
}

// t itself (a new reference) when BLAS can read its matrices in place, else a contiguous copy
static fsdp_tensor* as_matrices(fsdp_tensor* t) {
  int nd = t->ndim;
  int64_t rows = t->shape[nd - 2], cols = t->shape[nd - 1];
  if (t->dtype == FSDP_F32 && (cols <= 1 || t->stride[nd - 1] == 1) && (rows <= 1 || t->stride[nd - 2] >= cols)) {
    fsdp_tensor_retain(t);
    return t;
  }
  return fsdp_as_contig(t);
}

// the B matrices of t (from as_matrices, or allocated here); off has room for B offsets
static bmats matrices_of(fsdp_tensor* t, int64_t B, int64_t* off) {
  int nd = t->ndim;
  int64_t rows = t->shape[nd - 2], cols = t->shape[nd - 1], ld = rows > 1 ? t->stride[nd - 2] : cols;
  batch_offsets(nd - 2, t->shape, t->stride, B, off);
  return (bmats){fsdp_f32(t), off, ld > 1 ? ld : 1};
}

// The products run through the linalg table's gemm_tiles, one GEMM per batch matrix. Causal
// self-attention (causal, Tq == Tk) needs only the lower triangle of the (T, T) scores -- query i
// sees keys j <= i -- and gemm_tiles' limits skip the rest in row tiles: the score products stop
// at the diagonal (and zero what lies past it), the products that read P or dS stop their sums there.
// About half of the full work at large T.
static int tile_limits(const fsdp_attn_geom* geo, int lim) {
  return geo->causal && geo->Tq == geo->Tk ? lim : FSDP_TILES_ALL;
}

// appends one product over the B matrices, C_b = alpha op(A_b) op(B_b), to the list (g, lim, *n) that
// runs through gemm_tiles
static void add_products(fsdp_gemm_args* g, int* lim, int* n, int64_t B, int limits, int ta, int tb, int64_t M,
                         int64_t N, int64_t K, float alpha, const bmats* A, const bmats* Bm, const bmats* C) {
  for (int64_t b = 0; b < B; b++, (*n)++) {
    lim[*n] = limits;
    g[*n] =
        (fsdp_gemm_args){ta, tb, M, N, K, alpha, bm(A, b, 0), A->ld, bm(Bm, b, 0), Bm->ld, 0.0f, bm(C, b, 0), C->ld};
  }
}

// params: the fsdp_attn_geom; saved: 0 q, 1 k, 2 v (as read: in place or contiguous copies), 3 P
// (B.., Tq, Tk), 4 mask (only when it requires grad)
static int sdpa_backward(fsdp_node* node, fsdp_tensor* grad_out, fsdp_tensor** grad_in) {
  fsdp_tensor* q = fsdp_node_saved(node, 0);
  fsdp_tensor* k = q ? fsdp_node_saved(node, 1) : NULL;
  fsdp_tensor* v = k ? fsdp_node_saved(node, 2) : NULL;
  fsdp_tensor* P = v ? fsdp_node_saved(node, 3) : NULL;
  fsdp_tensor* mask = NULL;
  if (!P || (node->needs_grad[3] && !(mask = fsdp_node_saved(node, 4)))) return -1;
  const fsdp_backend* be = fsdp_backend_of(q);
  fsdp_attn_geom geo;
  fsdp_node_params(node, &geo, sizeof geo);
  float scale = (float)geo.scale, p = (float)geo.dropout_p;
  int64_t B = geo.B, Tq = geo.Tq, Tk = geo.Tk, D = geo.D, Dv = geo.Dv, nP = B * Tq * Tk;
  int64_t nB = B > 0 ? B : 1;
  fsdp_tensor *dO = as_matrices(grad_out), *Pd = NULL, *dP = NULL, *dq = NULL, *dk = NULL, *dv = NULL;
  int64_t* off = malloc(9 * nB * sizeof(int64_t));
  fsdp_gemm_args* g = malloc(2 * nB * sizeof(fsdp_gemm_args));  // two independent products run together
  int* lim = malloc(2 * nB * sizeof(int));
  int rc = -1, n = 0;
  if (!dO || !off || !g || !lim) {
    if (dO) fsdp_errorf("%s: out of memory", node->name);
    goto done;
  }
  if (p > 0.0f) {  // the dropped-out probabilities the forward multiplied with v
    if (!(Pd = fsdp_new_like(P))) goto done;
    be->nn->dropout(fsdp_f32(Pd), fsdp_f32(P), nP, p, geo.seed);
  }
  int want_dP = node->needs_grad[0] || node->needs_grad[1] || node->needs_grad[3];
  if ((node->needs_grad[2] && !(dv = fsdp_new_layout_like(v, v->shape))) || (want_dP && !(dP = fsdp_new_like(P))) ||
      (node->needs_grad[0] && !(dq = fsdp_new_layout_like(q, q->shape))) ||
      (node->needs_grad[1] && !(dk = fsdp_new_layout_like(k, k->shape))))
    goto done;
  bmats Q = matrices_of(q, B, off), K = matrices_of(k, B, off + nB), V = matrices_of(v, B, off + 2 * nB);
  bmats S = matrices_of(P, B, off + 3 * nB), Sd = S, dOm = matrices_of(dO, B, off + 4 * nB), dS = {0};
  if (Pd) Sd.p = fsdp_f32(Pd);  // same layout as P
  if (dv) {                     // dV (Tk, Dv) = Pd^T (Tk, Tq) @ dO (Tq, Dv)
    bmats dV = matrices_of(dv, B, off + 5 * nB);
    add_products(g, lim, &n, B, tile_limits(&geo, FSDP_TILES_K_FROM_ROW), 1, 0, Tk, Dv, Tq, 1.0f, &Sd, &dOm, &dV);
  }
  if (want_dP) {  // dPd (Tq, Tk) = dO (Tq, Dv) @ V^T (Dv, Tk)
    dS = matrices_of(dP, B, off + 6 * nB);
    add_products(g, lim, &n, B, tile_limits(&geo, FSDP_TILES_COLS_TO_ROW), 0, 1, Tq, Tk, Dv, 1.0f, &dOm, &V, &dS);
  }
  if (n && be->linalg->gemm_tiles(n, g, lim)) goto done;
  n = 0;
  if (want_dP) {
    if (p > 0.0f) be->nn->dropout(fsdp_f32(dP), fsdp_f32(dP), nP, p, geo.seed);
    be->nn->softmax_backward(fsdp_f32(dP), fsdp_f32(dP), fsdp_f32(P), B * Tq, Tk, 1, 0);  // dP -> dS in place
    bmats dQ, dK;
    if (dq) {  // dQ (Tq, D) = scale * dS (Tq, Tk) @ K (Tk, D)
      dQ = matrices_of(dq, B, off + 7 * nB);
      add_products(g, lim, &n, B, tile_limits(&geo, FSDP_TILES_K_TO_ROW), 0, 0, Tq, D, Tk, scale, &dS, &K, &dQ);
    }
    if (dk) {  // dK (Tk, D) = scale * dS^T (Tk, Tq) @ Q (Tq, D)
      dK = matrices_of(dk, B, off + 8 * nB);
      add_products(g, lim, &n, B, tile_limits(&geo, FSDP_TILES_K_FROM_ROW), 1, 0, Tk, D, Tq, scale, &dS, &Q, &dK);
    }
    if (n && be->linalg->gemm_tiles(n, g, lim)) goto done;
    if (node->needs_grad[3] && !(grad_in[3] = fsdp_sum_to(dP, mask->ndim, mask->shape))) goto done;
  }
  grad_in[0] = dq;
  grad_in[1] = dk;
  grad_in[2] = dv;
  dq = dk = dv = NULL;
  rc = 0;
done:
  free(g);
  free(lim);
  free(off);
  fsdp_tensor_release(dO);
  fsdp_tensor_release(Pd);
  fsdp_tensor_release(dP);
  fsdp_tensor_release(dq);
  fsdp_tensor_release(dk);
  fsdp_tensor_release(dv);
  return rc;
}

// checks shapes; fills geo's B (product of batch dims), Tq, Tk, D, Dv
static int sdpa_check(const char* op, fsdp_tensor* q, fsdp_tensor* k, fsdp_tensor* v, fsdp_attn_geom* geo) {
  CHECK_INT(q && k && v, "%s: query, key and value must be tensors (got nil)", op);
  if (fsdp_check_float(op, q) || fsdp_check_float(op, k) || fsdp_check_float(op, v)) return -1;
  if (fsdp_check_same_dtype(op, "query", q, "key", k) || fsdp_check_same_dtype(op, "query", q, "value", v)) return -1;
  if (fsdp_check_same_device(op, q, k) || fsdp_check_same_device(op, q, v)) return -1;
  int nd = q->ndim;
  CHECK_INT(nd >= 2 && k->ndim == nd && v->ndim == nd,
            "%s: query %s, key %s and value %s must have the same number "
            "of dims (at least 2: (..., T, head_dim))",
            op, SH(q), SH(k), SH(v));
  int ok = 1;
  geo->B = 1;
  for (int i = 0; i < nd - 2; i++) {
    ok = ok && k->shape[i] == q->shape[i] && v->shape[i] == q->shape[i];
    geo->B *= q->shape[i];
  }
  CHECK_INT(ok, "%s: batch dims of query %s, key %s and value %s differ", op, SH(q), SH(k), SH(v));
  geo->Tq = q->shape[nd - 2];
  geo->D = q->shape[nd - 1];
  geo->Tk = k->shape[nd - 2];
  geo->Dv = v->shape[nd - 1];
  CHECK_INT(k->shape[nd - 1] == geo->D, "%s: query %s and key %s have different head dims (%lld vs %lld)", op, SH(q),
            SH(k), (long long)geo->D, (long long)k->shape[nd - 1]);
  CHECK_INT(v->shape[nd - 2] == geo->Tk, "%s: key %s and value %s have different sequence lengths (%lld vs %lld)", op,
            SH(k), SH(v), (long long)geo->Tk, (long long)v->shape[nd - 2]);
  return 0;
}

fsdp_tensor* fsdp_scaled_dot_product_attention(fsdp_tensor* q, fsdp_tensor* k, fsdp_tensor* v, fsdp_tensor* mask,
                                               int causal, double dropout_p, double scale) {
  const char* op = "scaled_dot_product_attention";
  fsdp_attn_geom geo = {0};
  if (sdpa_check(op, q, k, v, &geo)) return NULL;
  CHECK_NULL(dropout_p >= 0.0 && dropout_p < 1.0, "%s: dropout_p must be in [0, 1), got %g", op, dropout_p);
  const fsdp_backend* be = fsdp_backend_of(q);
  if (!be) return NULL;
  int nd = q->ndim;
  int64_t B = geo.B, Tq = geo.Tq, Tk = geo.Tk, D = geo.D, Dv = geo.Dv;
  if (scale <= 0.0) scale = 1.0 / sqrt((double)D);
  geo.causal = causal;
  geo.scale = scale;
  geo.dropout_p = dropout_p;
  int64_t sshape[FSDP_MAX_DIMS], oshape[FSDP_MAX_DIMS], mstride[FSDP_MAX_DIMS];
  memcpy(sshape, q->shape, nd * sizeof(int64_t));
  sshape[nd - 1] = Tk;  // scores (..., Tq, Tk)
  memcpy(oshape, q->shape, nd * sizeof(int64_t));
  oshape[nd - 1] = Dv;  // output (..., Tq, Dv)

  if (mask) {  // read in place through broadcast strides: per batch matrix an offset, then (i, j) strides
    if (fsdp_check_float(op, mask) || fsdp_check_same_device(op, q, mask)) return NULL;
    int ok = mask->ndim <= nd;
    for (int i = 0; ok && i < mask->ndim; i++) {
      int64_t ms = mask->shape[i], ss = sshape[nd - mask->ndim + i];
      ok = ms == ss || ms == 1;
    }
    CHECK_NULL(ok,
               "%s: attn_mask of shape %s cannot be broadcast to the attention scores of shape %s (query %s, "
               "key %s)",
               op, SH(mask), fsdp_dims_s(nd, sshape), SH(q), SH(k));
  }
  fsdp_tensor* mf = mask ? fsdp_as_f32(mask) : NULL;  // a low-precision mask is read as a float32 copy
  if (mask && !mf) return NULL;
  if (mf) {
    fsdp_broadcast_strides(mf, nd, sshape, mstride);
    geo.mask_sq = mstride[nd - 2];
    geo.mask_sk = mstride[nd - 1];
  }
  int64_t nB = B > 0 ? B : 1;
  int64_t* off = malloc(6 * nB * sizeof(int64_t));
  fsdp_gemm_args* g = malloc(nB * sizeof(fsdp_gemm_args));
  int* lim = malloc(nB * sizeof(int));
  if (!off || !g || !lim) {
    free(off);
    free(g);
    free(lim);
    fsdp_tensor_release(mf);
    CHECK_NULL(0, "%s: out of memory", op);
  }
  fsdp_tensor *qm = as_matrices(q), *km = NULL, *vm = NULL, *P = NULL, *Pd = NULL, *out = NULL;
  int ok = qm && (km = as_matrices(k)) && (vm = as_matrices(v)) &&
           (P = fsdp_new(nd, sshape, FSDP_F32, fsdp_device_of(q))) && (out = fsdp_new_layout_like(qm, oshape));
  if (ok) {
    bmats Q = matrices_of(qm, B, off), K = matrices_of(km, B, off + nB), V = matrices_of(vm, B, off + 2 * nB);
    bmats S = matrices_of(P, B, off + 3 * nB), O = matrices_of(out, B, off + 4 * nB);
    int n = 0;  // S (Tq, Tk) = scale * q (Tq, D) @ k^T (D, Tk)
    add_products(g, lim, &n, B, tile_limits(&geo, FSDP_TILES_COLS_TO_ROW), 0, 1, Tq, Tk, D, (float)scale, &Q, &K, &S);
    ok = !n || !be->linalg->gemm_tiles(n, g, lim);
    if (ok && mask) batch_offsets(nd - 2, sshape, mstride, B, off + 5 * nB);
    if (ok) be->nn->attn_softmax(&geo, fsdp_f32(P), mf ? fsdp_f32(mf) : NULL, off + 5 * nB);
    bmats Sd = S;  // the dropped-out probabilities, same layout
    if (ok && dropout_p > 0.0) {
      geo.seed = fsdp_rng_next();
      ok = (Pd = fsdp_new_like(P)) != NULL;
      if (ok) be->nn->dropout(fsdp_f32(Pd), fsdp_f32(P), B * Tq * Tk, (float)dropout_p, geo.seed);
      if (ok) Sd.p = fsdp_f32(Pd);
    }
    n = 0;  // O (Tq, Dv) = Pd (Tq, Tk) @ v (Tk, Dv)
    add_products(g, lim, &n, B, tile_limits(&geo, FSDP_TILES_K_TO_ROW), 0, 0, Tq, Dv, Tk, 1.0f, &Sd, &V, &O);
    ok = ok && (!n || !be->linalg->gemm_tiles(n, g, lim));
  }
  // the output in q's dtype (a rounded copy is contiguous, where the float32 output keeps q's layout)
  if (ok) ok = (out = fsdp_round_to(out, q->dtype)) != NULL;
  if (ok) {
    fsdp_node* node =
        fsdp_node_new("ScaledDotProductAttentionBackward", sdpa_backward, 4, (fsdp_tensor*[]){q, k, v, mask});
    if (node) {
      fsdp_node_set_params(node, &geo, sizeof geo);
      fsdp_node_save(node, qm);
      fsdp_node_save(node, km);
      fsdp_node_save(node, vm);
      fsdp_node_save(node, P);
      if (mask && mask->requires_grad) fsdp_node_save(node, mask);
      fsdp_node_set_output(node, out);
    }
  } else {
    fsdp_tensor_release(out);
    out = NULL;
  }
  free(off);
  free(g);
  free(lim);
  fsdp_tensor_release(qm);
  fsdp_tensor_release(km);
  fsdp_tensor_release(vm);
  fsdp_tensor_release(P);
  fsdp_tensor_release(Pd);
  fsdp_tensor_release(mf);
  return out;
}
