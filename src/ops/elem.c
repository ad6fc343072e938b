/*
 * ops/elem.c -- elementwise ops (broadcasting binary, scalar, unary activations), comparisons (bool
 * results), reductions (sum, mean, max, argmax, min), and the masking ops at the end: where,
 * masked_fill and tril/triu (one where kernel), clamp, minimum/maximum, cumsum. Device
 * independent: kernels come from the backend table.
 *
 * Binary ops read float32 inputs in place through broadcast strides (no copies, any layout);
 * unary ops and reductions work on a contiguous float32 version of the input. Every op computes
 * in float32 and rounds its result to the inputs' dtype once (bfloat16: ops/ops.h, "float dtypes").
 * Backward of a broadcasting op sums the gradient back to each input's shape (fsdp_sum_to).
 */
#include "ops/ops.h"

#include <math.h>

// ---- binary ----------------------------------------------------------------------------------------------
static const char* bin_names[] = {"add", "sub", "mul", "div",     "eq",      "ne",     "lt",
                                  "le",  "gt",  "ge",  "minimum", "maximum", "maximum"};

// out (float32) = a op b with broadcasting; a and b of any float dtype and layout (float32 ones
// are read in place)
static fsdp_tensor* binary_forward(int op, fsdp_tensor* a, fsdp_tensor* b) {
  const char* name = bin_names[op];
  int nd;
  int64_t shape[FSDP_MAX_DIMS], sa[FSDP_MAX_DIMS], sb[FSDP_MAX_DIMS];
  if (fsdp_check_same_device(name, a, b)) return NULL;
  if (fsdp_broadcast_shape(name, a, b, &nd, shape)) return NULL;
  fsdp_tensor *ac = fsdp_as_f32(a), *bc = ac ? fsdp_as_f32(b) : NULL;
  fsdp_tensor* out = bc ? fsdp_new(nd, shape, FSDP_F32, fsdp_device_of(a)) : NULL;
  if (out) {
    fsdp_broadcast_strides(ac, nd, shape, sa);
    fsdp_broadcast_strides(bc, nd, shape, sb);
    fsdp_backend_of(out)->elem->binary(op, fsdp_f32(out), fsdp_f32(ac), fsdp_f32(bc), nd, shape, sa, sb);
  }
  fsdp_tensor_release(ac);
  fsdp_tensor_release(bc);
  return out;
}

// binary nodes keep both input shapes (the gradient of each is summed back to it); saved slots
// 0/1 hold what each grad reads
typedef struct {
  fsdp_shape_rec in[2];  // a, b
} binary_params;

static void save_shapes(fsdp_node* n, const fsdp_tensor* a, const fsdp_tensor* b) {
  binary_params p = {0};
  p.in[0] = fsdp_shape_rec_of(a);
  p.in[1] = fsdp_shape_rec_of(b);
  fsdp_node_set_params(n, &p, sizeof p);
}

// grad of input `which`: g (full broadcast shape) summed down to that input's shape
static int reduce_grad(fsdp_node* n, int which, fsdp_tensor* g, fsdp_tensor** out) {
  binary_params p;
  fsdp_node_params(n, &p, sizeof p);
  *out = fsdp_sum_to(g, p.in[which].ndim, p.in[which].shape);
  return *out ? 0 : -1;
}

static int add_backward(fsdp_node* n, fsdp_tensor* g, fsdp_tensor** gin) {
  if (n->needs_grad[0] && reduce_grad(n, 0, g, &gin[0])) return -1;
  if (n->needs_grad[1] && reduce_grad(n, 1, g, &gin[1])) return -1;
  return 0;
}

static int sub_backward(fsdp_node* n, fsdp_tensor* g, fsdp_tensor** gin) {
  if (n->needs_grad[0] && reduce_grad(n, 0, g, &gin[0])) return -1;
  if (n->needs_grad[1]) {
    fsdp_tensor* s;
    if (reduce_grad(n, 1, g, &s)) return -1;
    gin[1] = fsdp_neg(s);
    fsdp_tensor_release(s);
    if (!gin[1]) return -1;
  }
  return 0;
}

// saved: [0] = b (for grad a), [1] = a (for grad b). The product and its sum over broadcast
// dims run in float32 (g is made float32 first), so a bfloat16 gradient is rounded once.
static int mul_backward(fsdp_node* n, fsdp_tensor* g_in, fsdp_tensor** gin) {
  fsdp_tensor* g = fsdp_as_f32(g_in);
  if (!g) return -1;
  int rc = 0;
  for (int k = 0; k < 2 && !rc; k++) {
    if (!n->needs_grad[k]) continue;
    fsdp_tensor* other = fsdp_node_saved(n, k);
    fsdp_tensor* full = other ? fsdp_mul(g, other) : NULL;
    rc = full ? reduce_grad(n, k, full, &gin[k]) : -1;
    fsdp_tensor_release(full);
  }
  fsdp_tensor_release(g);
  return rc;
}

// out = a / b; saved: [0] = b, [1] = out (float32).  ga = g / b;  gb = -g * a / b^2 = -(g / b) * out
// (in float32, as mul's)
static int div_backward(fsdp_node* n, fsdp_tensor* g_in, fsdp_tensor** gin) {
  fsdp_tensor* b = fsdp_node_saved(n, 0);
  fsdp_tensor* g = b ? fsdp_as_f32(g_in) : NULL;
  if (!g) return -1;
  fsdp_tensor* gdb = fsdp_div(g, b);
  fsdp_tensor_release(g);
  if (!gdb) return -1;
  int rc = 0;
  if (n->needs_grad[0]) rc = reduce_grad(n, 0, gdb, &gin[0]);
  if (!rc && n->needs_grad[1]) {
    fsdp_tensor* out = fsdp_node_saved(n, 1);
    fsdp_tensor* full = out ? fsdp_mul(gdb, out) : NULL;
    fsdp_tensor* s = NULL;
    rc = full ? reduce_grad(n, 1, full, &s) : -1;
    if (!rc) {
      gin[1] = fsdp_neg(s);
      rc = gin[1] ? 0 : -1;
    }
    fsdp_tensor_release(s);
    fsdp_tensor_release(full);
  }
  fsdp_tensor_release(gdb);
  return rc;
}

static int check_binary(const char* op, const fsdp_tensor* a, const fsdp_tensor* b) {
  CHECK_INT(a && b, "%s: input tensor is NULL", op);
  CHECK_INT(fsdp_is_float(a->dtype) && fsdp_is_float(b->dtype),
            "%s: expected float tensors (float32, bfloat16 or float16), got %s %s and %s %s", op, DT(a), SH(a), DT(b),
            SH(b));
  return 0;
}

// the result is a op b computed in float32 (y) and rounded once to the promoted dtype
static fsdp_tensor* binary_op(int op, fsdp_backward_fn bw, const char* bwname, fsdp_tensor* a, fsdp_tensor* b) {
  if (check_binary(bin_names[op], a, b)) return NULL;
  fsdp_tensor* y = binary_forward(op, a, b);
  if (!y) return NULL;
  fsdp_tensor* out = fsdp_as_contig_dtype(y, fsdp_result_dtype(a, b));
  fsdp_node* n = out ? fsdp_node_new(bwname, bw, 2, (fsdp_tensor*[]){a, b}) : NULL;
  if (n) {
    save_shapes(n, a, b);
    if (op == FSDP_BIN_MUL) {
      fsdp_node_save(n, n->needs_grad[0] ? b : NULL);
      fsdp_node_save(n, n->needs_grad[1] ? a : NULL);
    } else if (op == FSDP_BIN_DIV) {
      fsdp_node_save(n, b);
      fsdp_node_save(n, n->needs_grad[1] ? y : NULL);
    } else {
      fsdp_node_save(n, NULL);
      fsdp_node_save(n, NULL);
    }
    fsdp_node_set_output(n, out);
  }
  fsdp_tensor_release(y);
  return out;
}

fsdp_tensor* fsdp_add(fsdp_tensor* a, fsdp_tensor* b) {
  return binary_op(FSDP_BIN_ADD, add_backward, "AddBackward", a, b);
}
fsdp_tensor* fsdp_sub(fsdp_tensor* a, fsdp_tensor* b) {
  return binary_op(FSDP_BIN_SUB, sub_backward, "SubBackward", a, b);
}
fsdp_tensor* fsdp_mul(fsdp_tensor* a, fsdp_tensor* b) {
  return binary_op(FSDP_BIN_MUL, mul_backward, "MulBackward", a, b);
}
fsdp_tensor* fsdp_div(fsdp_tensor* a, fsdp_tensor* b) {
  return binary_op(FSDP_BIN_DIV, div_backward, "DivBackward", a, b);
}

// ---- comparisons -------------------------------------------------------------------------------------
// float32 0/1 of a op b (FSDP_BIN_EQ .. FSDP_BIN_GE), no grad; inputs of any dtype (int64 and bool
// ones are compared after conversion to float32)
static fsdp_tensor* compare_f32(int op, fsdp_tensor* a, fsdp_tensor* b) {
  CHECK_NULL(a && b, "%s: input tensor is NULL", bin_names[op]);
  fsdp_tensor* ac = a->dtype == FSDP_F32 ? (fsdp_tensor_retain(a), a) : fsdp_as_contig(a);
  fsdp_tensor* bc = b->dtype == FSDP_F32 ? (fsdp_tensor_retain(b), b) : fsdp_as_contig(b);
  fsdp_tensor* out = ac && bc ? binary_forward(op, ac, bc) : NULL;
  fsdp_tensor_release(ac);
  fsdp_tensor_release(bc);
  return out;
}
// the comparison as a bool tensor (PyTorch's result dtype)
static fsdp_tensor* compare(int op, fsdp_tensor* a, fsdp_tensor* b) {
  return fsdp_round_to(compare_f32(op, a, b), FSDP_BOOL);
}

fsdp_tensor* fsdp_eq(fsdp_tensor* a, fsdp_tensor* b) { return compare(FSDP_BIN_EQ, a, b); }
fsdp_tensor* fsdp_ne(fsdp_tensor* a, fsdp_tensor* b) { return compare(FSDP_BIN_NE, a, b); }
fsdp_tensor* fsdp_lt(fsdp_tensor* a, fsdp_tensor* b) { return compare(FSDP_BIN_LT, a, b); }
fsdp_tensor* fsdp_le(fsdp_tensor* a, fsdp_tensor* b) { return compare(FSDP_BIN_LE, a, b); }
fsdp_tensor* fsdp_gt(fsdp_tensor* a, fsdp_tensor* b) { return compare(FSDP_BIN_GT, a, b); }
fsdp_tensor* fsdp_ge(fsdp_tensor* a, fsdp_tensor* b) { return compare(FSDP_BIN_GE, a, b); }

// ---- unary -------------------------------------------------------------------------------------------------
// which tensors the backward of each unary op reads: 1 = x, 2 = y
static int unary_saves(int op) {
  switch (op) {
    case FSDP_UN_EXP:
    case FSDP_UN_SQRT:
    case FSDP_UN_TANH:
    case FSDP_UN_SIGMOID:
    case FSDP_UN_RELU: return 2;
    case FSDP_UN_LOG:
    case FSDP_UN_ABS:
    case FSDP_UN_GELU:
    case FSDP_UN_GELU_TANH:
    case FSDP_UN_POW:
    case FSDP_UN_RDIV_SCALAR:
    case FSDP_UN_CLAMP_MIN:
    case FSDP_UN_CLAMP_MAX: return 1;
    default: return 0;
  }
}

// saved [0] = x or NULL, [1] = y or NULL
typedef struct {
  int op;         // FSDP_UN_*
  double scalar;  // pow's exponent, rdiv_scalar's numerator; else 0
} unary_params;

static int unary_backward(fsdp_node* n, fsdp_tensor* g, fsdp_tensor** gin) {
  unary_params p;
  fsdp_node_params(n, &p, sizeof p);
  int op = p.op, s = unary_saves(op);
  fsdp_tensor* x = s == 1 ? fsdp_node_saved(n, 0) : NULL;
  fsdp_tensor* y = s == 2 ? fsdp_node_saved(n, 1) : NULL;
  if ((s == 1 && !x) || (s == 2 && !y)) return -1;
  fsdp_tensor* gc = fsdp_as_contig(g);
  if (!gc) return -1;
  fsdp_tensor* gx = fsdp_new(gc->ndim, gc->shape, FSDP_F32, fsdp_device_of(gc));
  if (!gx) {
    fsdp_tensor_release(gc);
    return -1;
  }
  fsdp_backend_of(gx)->elem->unary_backward(op, fsdp_f32(gx), fsdp_f32(gc), x ? fsdp_f32(x) : NULL,
                                            y ? fsdp_f32(y) : NULL, fsdp_tensor_numel(gx), p.scalar);
  fsdp_tensor_release(gc);
  gin[0] = gx;
  return 0;
}

// y = f(x) in float32 on a float32 copy x of a; the result is y rounded to a's dtype (the node
// saves the float32 x or y its backward reads)
static fsdp_tensor* unary_op(const char* name, const char* bwname, int op, fsdp_tensor* a, double p) {
  CHECK_NULL(a, "%s: input tensor is NULL", name);
  if (fsdp_check_float(name, a)) return NULL;
  fsdp_tensor* x = fsdp_as_contig(a);
  fsdp_tensor* y = x ? fsdp_new(x->ndim, x->shape, FSDP_F32, fsdp_device_of(x)) : NULL;
  if (y) fsdp_backend_of(y)->elem->unary(op, fsdp_f32(y), fsdp_f32(x), fsdp_tensor_numel(y), p);
  fsdp_tensor* out = y ? fsdp_as_contig_dtype(y, a->dtype) : NULL;
  fsdp_node* n = out ? fsdp_node_new(bwname, unary_backward, 1, &a) : NULL;
  if (n) {
    int s = unary_saves(op);
    fsdp_node_set_params(n, &(unary_params){.op = op, .scalar = p}, sizeof(unary_params));
    fsdp_node_save(n, s == 1 ? x : NULL);
    fsdp_node_save(n, s == 2 ? y : NULL);
    fsdp_node_set_output(n, out);
  }
  fsdp_tensor_release(x);
  fsdp_tensor_release(y);
  return out;
}

// ops whose backward is another cheap op on the gradient need no saved tensors
typedef struct {
  double s;  // the scalar (mul_scalar's backward multiplies by it)
} scalar_params;

static int add_scalar_backward(fsdp_node* n, fsdp_tensor* g, fsdp_tensor** gin) {
  (void)n;
  fsdp_tensor_retain(g);
  gin[0] = g;
  return 0;
}
static int mul_scalar_backward(fsdp_node* n, fsdp_tensor* g, fsdp_tensor** gin) {
  scalar_params p;
  fsdp_node_params(n, &p, sizeof p);
  gin[0] = fsdp_mul_scalar(g, p.s);
  return gin[0] ? 0 : -1;
}
static int neg_backward(fsdp_node* n, fsdp_tensor* g, fsdp_tensor** gin) {
  (void)n;
  gin[0] = fsdp_neg(g);
  return gin[0] ? 0 : -1;
}

static fsdp_tensor* scalar_op(const char* name, const char* bwname, fsdp_backward_fn bw, int op, fsdp_tensor* a,
                              double p) {
  CHECK_NULL(a, "%s: input tensor is NULL", name);
  if (fsdp_check_float(name, a)) return NULL;
  fsdp_tensor* x = fsdp_as_contig(a);
  if (!x) return NULL;
  fsdp_tensor* y = fsdp_new(x->ndim, x->shape, FSDP_F32, fsdp_device_of(x));
  if (y) fsdp_backend_of(y)->elem->unary(op, fsdp_f32(y), fsdp_f32(x), fsdp_tensor_numel(y), p);
  fsdp_tensor_release(x);
  fsdp_tensor* out = fsdp_round_to(y, a->dtype);
  if (!out) return NULL;
  fsdp_node* n = fsdp_node_new(bwname, bw, 1, &a);
  if (n) {
    fsdp_node_set_params(n, &(scalar_params){.s = p}, sizeof(scalar_params));
    fsdp_node_set_output(n, out);
  }
  return out;
}

fsdp_tensor* fsdp_add_scalar(fsdp_tensor* a, double s) {
  return scalar_op("add_scalar", "AddBackward", add_scalar_backward, FSDP_UN_ADD_SCALAR, a, s);
}
fsdp_tensor* fsdp_mul_scalar(fsdp_tensor* a, double s) {
  return scalar_op("mul_scalar", "MulBackward", mul_scalar_backward, FSDP_UN_MUL_SCALAR, a, s);
}
fsdp_tensor* fsdp_neg(fsdp_tensor* a) { return scalar_op("neg", "NegBackward", neg_backward, FSDP_UN_NEG, a, 0); }
fsdp_tensor* fsdp_rdiv_scalar(double s, fsdp_tensor* a) {
  return unary_op("rdiv_scalar", "DivBackward", FSDP_UN_RDIV_SCALAR, a, s);
}
fsdp_tensor* fsdp_pow_scalar(fsdp_tensor* a, double p) { return unary_op("pow", "PowBackward", FSDP_UN_POW, a, p); }
fsdp_tensor* fsdp_exp(fsdp_tensor* a) { return unary_op("exp", "ExpBackward", FSDP_UN_EXP, a, 0); }
fsdp_tensor* fsdp_log(fsdp_tensor* a) { return unary_op("log", "LogBackward", FSDP_UN_LOG, a, 0); }
fsdp_tensor* fsdp_sqrt(fsdp_tensor* a) { return unary_op("sqrt", "SqrtBackward", FSDP_UN_SQRT, a, 0); }
fsdp_tensor* fsdp_abs(fsdp_tensor* a) { return unary_op("abs", "AbsBackward", FSDP_UN_ABS, a, 0); }
fsdp_tensor* fsdp_tanh(fsdp_tensor* a) { return unary_op("tanh", "TanhBackward", FSDP_UN_TANH, a, 0); }
fsdp_tensor* fsdp_sigmoid(fsdp_tensor* a) { return unary_op("sigmoid", "SigmoidBackward", FSDP_UN_SIGMOID, a, 0); }
fsdp_tensor* fsdp_relu(fsdp_tensor* a) { return unary_op("relu", "ReluBackward", FSDP_UN_RELU, a, 0); }
fsdp_tensor* fsdp_gelu(fsdp_tensor* a, int approximate_tanh) {
  return unary_op("gelu", "GeluBackward", approximate_tanh ? FSDP_UN_GELU_TANH : FSDP_UN_GELU, a, 0);
}

// ---- reductions -------------------------------------------------------------------------------------------
// parses a dim list into a mask over a's dims (all dims when ndims == 0)
static int reduce_mask(const char* op, const fsdp_tensor* a, int ndims, const int* dims, int* mask) {
  for (int d = 0; d < FSDP_MAX_DIMS; d++) mask[d] = ndims == 0;
  CHECK_INT(ndims >= 0 && ndims <= FSDP_MAX_DIMS && (ndims == 0 || dims), "%s: invalid list of %d dims", op, ndims);
  for (int k = 0; k < ndims; k++) {
    int d = fsdp_wrap_dim(op, dims[k], a->ndim);
    if (d < 0) return -1;
    CHECK_INT(!mask[d], "%s: dim %d appears more than once in the list of dims for a tensor of shape %s", op, d + 1,
              SH(a));
    mask[d] = 1;
  }
  return 0;
}

// shape after reducing the masked dims (kept as size 1 with keepdim)
static int reduced_shape(const fsdp_tensor* a, const int* mask, int keepdim, int64_t* shape) {
  int nd = 0;
  for (int d = 0; d < a->ndim; d++) {
    if (!mask[d]) shape[nd++] = a->shape[d];
    else if (keepdim) shape[nd++] = 1;
  }
  return nd;
}

// sum of contiguous f32 x over the masked dims, keepdim layout (same numel as the result);
// consecutive reduced dims are merged into one kernel call; returns a new contiguous tensor
static fsdp_tensor* sum_masked(fsdp_tensor* x, const int* mask) {
  const fsdp_elem_kernels* k = fsdp_backend_of(x)->elem;
  int64_t shape[FSDP_MAX_DIMS];
  int nd = x->ndim;
  memcpy(shape, x->shape, sizeof shape);
  fsdp_tensor_retain(x);
  fsdp_tensor* cur = x;
  // walk runs of reduced dims from the last to the first
  for (int e = nd - 1; e >= 0;) {
    if (!mask[e] || shape[e] == 1) {
      e--;
      continue;
    }
    int s = e;
    while (s > 0 && (mask[s - 1] || shape[s - 1] == 1)) s--;
    int64_t outer = 1, red = 1, inner = 1;
    for (int d = 0; d < s; d++) outer *= shape[d];
    for (int d = s; d <= e; d++) red *= shape[d];
    for (int d = e + 1; d < nd; d++) inner *= shape[d];
    for (int d = s; d <= e; d++)
      if (mask[d]) shape[d] = 1;
    fsdp_tensor* next = fsdp_new(nd, shape, FSDP_F32, fsdp_device_of(x));
    if (!next) {
      fsdp_tensor_release(cur);
      return NULL;
    }
    if (outer * inner > 0) k->sum_dim(fsdp_f32(next), fsdp_f32(cur), outer, red, inner);
    fsdp_tensor_release(cur);
    cur = next;
    e = s - 1;
  }
  // all-size-1 (or no) reduced dims: still return a fresh tensor
  if (cur == x) {
    fsdp_tensor_release(cur);
    for (int d = 0; d < nd; d++)
      if (mask[d]) shape[d] = 1;
    cur = fsdp_new(nd, shape, FSDP_F32, fsdp_device_of(x));
    if (cur) fsdp_copy_strided(cur, x);
  }
  return cur;
}

typedef struct {
  fsdp_shape_rec in;           // the input's shape
  int reduced[FSDP_MAX_DIMS];  // 1 for the dims summed over
  double scale;                // 1 for sum, 1/N for mean
} sum_params;

// grad: reshape g to keepdim form, scale, expand to the input's shape (a stride-0 view, no copy)
static int sum_backward(fsdp_node* n, fsdp_tensor* g, fsdp_tensor** gin) {
  sum_params p;
  fsdp_node_params(n, &p, sizeof p);
  int nd = p.in.ndim;
  int64_t kshape[FSDP_MAX_DIMS];
  for (int d = 0; d < nd; d++) kshape[d] = p.reduced[d] ? 1 : p.in.shape[d];
  fsdp_tensor* gk = fsdp_reshape(g, nd, kshape);
  if (!gk) return -1;
  if (p.scale != 1.0) {
    fsdp_tensor* s = fsdp_mul_scalar(gk, p.scale);
    fsdp_tensor_release(gk);
    if (!s) return -1;
    gk = s;
  }
  gin[0] = fsdp_expand(gk, nd, p.in.shape);
  fsdp_tensor_release(gk);
  return gin[0] ? 0 : -1;
}

static fsdp_tensor* reduce_sum(const char* op, const char* bwname, fsdp_tensor* a, int ndims, const int* dims,
                               int keepdim, int mean) {
  CHECK_NULL(a, "%s: input tensor is NULL", op);
  if (fsdp_check_float(op, a)) return NULL;
  int mask[FSDP_MAX_DIMS];
  if (reduce_mask(op, a, ndims, dims, mask)) return NULL;
  int64_t count = 1, shape[FSDP_MAX_DIMS];
  for (int d = 0; d < a->ndim; d++)
    if (mask[d]) count *= a->shape[d];
  int nd = reduced_shape(a, mask, keepdim, shape);
  fsdp_tensor* x = fsdp_as_contig(a);
  if (!x) return NULL;
  fsdp_tensor* s = sum_masked(x, mask);
  fsdp_tensor_release(x);
  if (!s) return NULL;
  double scale = mean ? 1.0 / (double)count : 1.0;
  if (mean) {
    if (count == 0) fsdp_backend_of(s)->elem->fill(fsdp_ptr(s), FSDP_F32, fsdp_tensor_numel(s), NAN);
    else fsdp_backend_of(s)->elem->scale(fsdp_f32(s), fsdp_tensor_numel(s), (float)scale);
  }
  // s is contiguous in keepdim layout: the result is a reshaped view of it, in a's dtype
  int64_t st[FSDP_MAX_DIMS];
  fsdp_contiguous_strides(nd, shape, st);
  fsdp_tensor* out = fsdp_round_to(fsdp_new_view(s, nd, shape, st, 0), a->dtype);
  fsdp_tensor_release(s);
  if (!out) return NULL;
  fsdp_node* n = fsdp_node_new(bwname, sum_backward, 1, &a);
  if (n) {
    sum_params p = {.in = fsdp_shape_rec_of(a), .scale = scale};
    for (int d = 0; d < a->ndim; d++) p.reduced[d] = mask[d];
    fsdp_node_set_params(n, &p, sizeof p);
    fsdp_node_set_output(n, out);
  }
  return out;
}

// a bool tensor sums to an int64 count, as in PyTorch (no grad; exact up to 2^24 per sum)
static fsdp_tensor* sum_bool(fsdp_tensor* a, int ndims, const int* dims, int keepdim) {
  fsdp_tensor* x = fsdp_as_contig(a);
  fsdp_tensor* s = x ? reduce_sum("sum", "SumBackward", x, ndims, dims, keepdim, 0) : NULL;
  fsdp_tensor_release(x);
  return fsdp_round_to(s, FSDP_I64);
}

fsdp_tensor* fsdp_sum(fsdp_tensor* a, int ndims, const int* dims, int keepdim) {
  if (a && a->dtype == FSDP_BOOL) return sum_bool(a, ndims, dims, keepdim);
  return reduce_sum("sum", "SumBackward", a, ndims, dims, keepdim, 0);
}
fsdp_tensor* fsdp_mean(fsdp_tensor* a, int ndims, const int* dims, int keepdim) {
  return reduce_sum("mean", "MeanBackward", a, ndims, dims, keepdim, 1);
}

// ---- max / argmax -----------------------------------------------------------------------------------------
// (outer, red, inner) of a over dim d (a 0-dim tensor is one element)
static void split_dims(const fsdp_tensor* a, int d, int64_t* outer, int64_t* red, int64_t* inner) {
  *outer = 1;
  *red = 1;
  *inner = 1;
  for (int k = 0; k < a->ndim; k++) {
    if (k < d) *outer *= a->shape[k];
    else if (k == d) *red = a->shape[k];
    else *inner *= a->shape[k];
  }
}

// saved[0] = indices (keepdim-free layout)
typedef struct {
  fsdp_shape_rec in;  // the input's shape
  int dim;            // the dim the max ran over
} max_params;

static int max_backward(fsdp_node* n, fsdp_tensor* g, fsdp_tensor** gin) {
  fsdp_tensor* idx = fsdp_node_saved(n, 0);
  if (!idx) return -1;
  max_params p;
  fsdp_node_params(n, &p, sizeof p);
  int nd = p.in.ndim, d = p.dim;
  int64_t outer = 1, red = 1, inner = 1;
  for (int k = 0; k < nd; k++) {
    if (k < d) outer *= p.in.shape[k];
    else if (k == d) red = p.in.shape[k];
    else inner *= p.in.shape[k];
  }
  fsdp_tensor* gc = fsdp_as_contig(g);
  fsdp_tensor* gx = gc ? fsdp_new(nd, p.in.shape, FSDP_F32, fsdp_device_of(gc)) : NULL;
  if (!gx) {
    fsdp_tensor_release(gc);
    return -1;
  }
  fsdp_backend_of(gx)->elem->scatter_dim(fsdp_f32(gx), fsdp_f32(gc), fsdp_i64(idx), outer, red, inner);
  fsdp_tensor_release(gc);
  gin[0] = gx;
  return 0;
}

// values and indices of the max over dim; values record a node when with_grad
static fsdp_tensor* max_impl(const char* op, fsdp_tensor* a, int dim, int keepdim, fsdp_tensor** indices,
                             int with_grad) {
  CHECK_NULL(a, "%s: input tensor is NULL", op);
  int d = fsdp_wrap_dim(op, dim, a->ndim);
  if (d < 0) return NULL;
  int64_t outer, red, inner;
  split_dims(a, d, &outer, &red, &inner);
  CHECK_NULL(red > 0, "%s: cannot take the max over dim %d of size 0 (tensor of shape %s)", op, d + 1, SH(a));
  int64_t shape[FSDP_MAX_DIMS];
  int nd = 0;
  for (int k = 0; k < a->ndim; k++)
    if (k != d) shape[nd++] = a->shape[k];
    else if (keepdim) shape[nd++] = 1;
  fsdp_tensor* x = fsdp_as_contig(a);
  fsdp_tensor* vals = x ? fsdp_new(nd, shape, FSDP_F32, fsdp_device_of(a)) : NULL;
  fsdp_tensor* idx = vals ? fsdp_new(nd, shape, FSDP_I64, fsdp_device_of(a)) : NULL;
  if (!idx) {
    fsdp_tensor_release(x);
    fsdp_tensor_release(vals);
    return NULL;
  }
  if (outer * inner > 0)
    fsdp_backend_of(x)->elem->max_dim(fsdp_f32(vals), fsdp_i64(idx), fsdp_f32(x), outer, red, inner);
  fsdp_tensor_release(x);
  if (fsdp_is_float(a->dtype)) vals = fsdp_round_to(vals, a->dtype);  // exact: a max is one of a's values
  if (!vals) {
    fsdp_tensor_release(idx);
    return NULL;
  }
  fsdp_node* n = with_grad ? fsdp_node_new("MaxBackward", max_backward, 1, &a) : NULL;
  if (n) {
    max_params p = {.in = fsdp_shape_rec_of(a), .dim = d};
    fsdp_node_set_params(n, &p, sizeof p);
    fsdp_node_save(n, idx);
    fsdp_node_set_output(n, vals);
  }
  if (indices) *indices = idx;
  else fsdp_tensor_release(idx);
  return vals;
}

fsdp_tensor* fsdp_max(fsdp_tensor* a, int dim, int keepdim, fsdp_tensor** indices) {
  if (indices) *indices = NULL;
  CHECK_NULL(a, "max: input tensor is NULL");
  if (fsdp_check_float("max", a)) return NULL;
  return max_impl("max", a, dim, keepdim, indices, 1);
}

// like PyTorch, the gradient of the overall max is shared evenly by all elements equal to it; a NaN
// max (NaN wins) is shared by the NaN elements, which no comparison with it finds equal
// saved: [0] = a, [1] = result (0-dim)
static int max_all_backward(fsdp_node* n, fsdp_tensor* g, fsdp_tensor** gin) {
  fsdp_tensor* a = fsdp_node_saved(n, 0);
  fsdp_tensor* r = a ? fsdp_node_saved(n, 1) : NULL;
  double v;
  if (!r || fsdp_tensor_item(r, &v)) return -1;
  fsdp_tensor* mask = v != v ? compare_f32(FSDP_BIN_NE, a, a) : compare_f32(FSDP_BIN_EQ, a, r);
  fsdp_tensor* cnt = mask ? fsdp_sum(mask, 0, NULL, 0) : NULL;
  fsdp_tensor* share = cnt ? fsdp_div(g, cnt) : NULL;
  gin[0] = share ? fsdp_mul(mask, share) : NULL;
  fsdp_tensor_release(mask);
  fsdp_tensor_release(cnt);
  fsdp_tensor_release(share);
  return gin[0] ? 0 : -1;
}

fsdp_tensor* fsdp_max_all(fsdp_tensor* a) {
  CHECK_NULL(a, "max: input tensor is NULL");
  if (fsdp_check_float("max", a)) return NULL;
  int64_t numel = fsdp_tensor_numel(a);
  CHECK_NULL(numel > 0, "max: cannot take the max of an empty tensor of shape %s", SH(a));
  fsdp_tensor* x = fsdp_as_contig(a);
  fsdp_tensor* out = x ? fsdp_new(0, NULL, FSDP_F32, fsdp_device_of(a)) : NULL;
  fsdp_tensor* idx = out ? fsdp_new(0, NULL, FSDP_I64, fsdp_device_of(a)) : NULL;
  if (idx) fsdp_backend_of(x)->elem->max_dim(fsdp_f32(out), fsdp_i64(idx), fsdp_f32(x), 1, numel, 1);
  fsdp_tensor_release(x);
  fsdp_tensor_release(idx);
  if (!idx) {
    fsdp_tensor_release(out);
    return NULL;
  }
  out = fsdp_round_to(out, a->dtype);  // exact: the max is one of a's values
  if (!out) return NULL;
  fsdp_node* n = fsdp_node_new("MaxBackward", max_all_backward, 1, &a);
  if (n) {
    fsdp_node_save(n, a);
    fsdp_node_save(n, out);
    fsdp_node_set_output(n, out);
  }
  return out;
}

// int64 indices of the max (any input dtype; compared as float32), no grad
fsdp_tensor* fsdp_argmax(fsdp_tensor* a, int dim, int keepdim) {
  CHECK_NULL(a, "argmax: input tensor is NULL");
  fsdp_tensor* idx = NULL;
  fsdp_tensor* vals = max_impl("argmax", a, dim, keepdim, &idx, 0);
  fsdp_tensor_release(vals);
  return vals ? idx : NULL;
}

// ---- where, masked_fill, tril / triu ---------------------------------------------------------------------
// The condition is a bool tensor read in place (its bytes, through broadcast strides); x and y are
// read as float32 like a binary op's operands. The result has the broadcast shape of all three and
// x and y's promoted dtype. Backward: x gets the gradient where the condition holds, y elsewhere,
// each summed back to its shape.

// the broadcast shape of cond, a and b; dims in errors are 1-based positions in that shape
static int where_shape(const char* op, const fsdp_tensor* c, const fsdp_tensor* a, const fsdp_tensor* b, int* ndim,
                       int64_t* shape) {
  const fsdp_tensor* ts[3] = {c, a, b};
  int n = 0;
  for (int k = 0; k < 3; k++)
    if (ts[k]->ndim > n) n = ts[k]->ndim;
  for (int i = 0; i < n; i++) {
    int64_t s = 1;
    for (int k = 0; k < 3; k++) {
      int it = ts[k]->ndim - n + i;
      int64_t sk = it >= 0 ? ts[k]->shape[it] : 1;
      CHECK_INT(
          sk == s || sk == 1 || s == 1,
          "%s: condition %s, input %s and other %s cannot be broadcast together (dim %d of the result: %lld vs %lld)",
          op, SH(c), SH(a), SH(b), i + 1, (long long)s, (long long)sk);
      if (sk != 1) s = sk;
    }
    shape[i] = s;
  }
  *ndim = n;
  return 0;
}

// out (float32, contiguous) = cond ? a : b over the broadcast shape; no node
static fsdp_tensor* where_forward(const char* op, fsdp_tensor* c, fsdp_tensor* a, fsdp_tensor* b) {
  int nd;
  int64_t shape[FSDP_MAX_DIMS], sc[FSDP_MAX_DIMS], sa[FSDP_MAX_DIMS], sb[FSDP_MAX_DIMS];
  if (where_shape(op, c, a, b, &nd, shape)) return NULL;
  fsdp_tensor *ac = fsdp_as_f32(a), *bc = ac ? fsdp_as_f32(b) : NULL;
  fsdp_tensor* out = bc ? fsdp_new(nd, shape, FSDP_F32, fsdp_device_of(a)) : NULL;
  if (out) {
    fsdp_broadcast_strides(c, nd, shape, sc);
    fsdp_broadcast_strides(ac, nd, shape, sa);
    fsdp_broadcast_strides(bc, nd, shape, sb);
    fsdp_backend_of(out)->elem->where(fsdp_f32(out), (const uint8_t*)fsdp_ptr(c), fsdp_f32(ac), fsdp_f32(bc), nd, shape,
                                      sc, sa, sb);
  }
  fsdp_tensor_release(ac);
  fsdp_tensor_release(bc);
  return out;
}

// saved[0] = the condition; params: the shapes of x and y
static int where_backward(fsdp_node* n, fsdp_tensor* g, fsdp_tensor** gin) {
  fsdp_tensor* c = fsdp_node_saved(n, 0);
  fsdp_tensor* zero = c ? fsdp_full(0, NULL, 0.0, FSDP_F32, fsdp_device_of(g)) : NULL;
  if (!zero) return -1;
  int rc = 0;
  for (int k = 0; k < 2 && !rc; k++) {
    if (!n->needs_grad[k]) continue;
    fsdp_tensor* full = k == 0 ? where_forward("where", c, g, zero) : where_forward("where", c, zero, g);
    rc = full ? reduce_grad(n, k, full, &gin[k]) : -1;
    fsdp_tensor_release(full);
  }
  fsdp_tensor_release(zero);
  return rc;
}

static fsdp_tensor* where_op(const char* op, const char* bwname, fsdp_tensor* c, fsdp_tensor* a, fsdp_tensor* b) {
  CHECK_NULL(c && a && b, "%s: input tensor is NULL", op);
  CHECK_NULL(c->dtype == FSDP_BOOL, "%s: the condition must be a bool tensor (a comparison's result), got %s %s", op,
             DT(c), SH(c));
  CHECK_NULL(fsdp_is_float(a->dtype) && fsdp_is_float(b->dtype),
             "%s: expected float tensors (float32, bfloat16 or float16), got %s %s and %s %s", op, DT(a), SH(a), DT(b),
             SH(b));
  if (fsdp_check_same_device(op, c, a) || fsdp_check_same_device(op, a, b)) return NULL;
  if (fsdp_check_data(op, c)) return NULL;
  fsdp_tensor* y = where_forward(op, c, a, b);
  fsdp_tensor* out = y ? fsdp_as_contig_dtype(y, fsdp_result_dtype(a, b)) : NULL;
  fsdp_tensor_release(y);
  fsdp_node* n = out ? fsdp_node_new(bwname, where_backward, 2, (fsdp_tensor*[]){a, b}) : NULL;
  if (n) {
    save_shapes(n, a, b);
    fsdp_node_save(n, c);
    fsdp_node_set_output(n, out);
  }
  return out;
}

fsdp_tensor* fsdp_where(fsdp_tensor* cond, fsdp_tensor* a, fsdp_tensor* b) {
  return where_op("where", "WhereBackward", cond, a, b);
}

// a with `value` where mask holds; mask broadcasts to a's shape (not the other way round)
fsdp_tensor* fsdp_masked_fill(fsdp_tensor* a, fsdp_tensor* mask, double value) {
  CHECK_NULL(a && mask, "masked_fill: input tensor is NULL");
  if (fsdp_check_float("masked_fill", a)) return NULL;
  CHECK_NULL(mask->dtype == FSDP_BOOL, "masked_fill: the mask must be a bool tensor (a comparison's result), got %s %s",
             DT(mask), SH(mask));
  int nd;
  int64_t shape[FSDP_MAX_DIMS];
  if (fsdp_broadcast_shape("masked_fill", a, mask, &nd, shape)) return NULL;
  CHECK_NULL(nd == a->ndim && memcmp(shape, a->shape, (size_t)nd * sizeof(int64_t)) == 0,
             "masked_fill: mask of shape %s does not broadcast to the input's shape %s", SH(mask), SH(a));
  fsdp_tensor* v = fsdp_full(0, NULL, value, a->dtype, fsdp_device_of(a));
  fsdp_tensor* out = v ? where_op("masked_fill", "MaskedFillBackward", mask, v, a) : NULL;
  fsdp_tensor_release(v);
  return out;
}

// a with the elements above (tril) or below (triu) diagonal k of its last two dims zeroed: the
// mask (j - i <= k, or >= k) is made from two aranges by the comparison ops, on a's device
static fsdp_tensor* tri_op(const char* op, const char* bwname, fsdp_tensor* a, int64_t k, int upper) {
  CHECK_NULL(a, "%s: input tensor is NULL", op);
  CHECK_NULL(a->ndim >= 2, "%s: expected a tensor with at least 2 dims, got shape %s", op, SH(a));
  if (fsdp_check_float(op, a)) return NULL;
  int64_t R = a->shape[a->ndim - 2], Cn = a->shape[a->ndim - 1], col[2] = {R, 1}, row[2] = {1, Cn};
  int prev = fsdp_is_grad_enabled();
  fsdp_set_grad_enabled(0);
  fsdp_tensor* ri = fsdp_arange(0, (double)R, 1, FSDP_F32);
  fsdp_tensor* ci = ri ? fsdp_arange(0, (double)Cn, 1, FSDP_F32) : NULL;
  fsdp_tensor* rv = ci ? fsdp_view(ri, 2, col) : NULL;
  fsdp_tensor* cv = rv ? fsdp_view(ci, 2, row) : NULL;
  fsdp_tensor* d = cv ? fsdp_sub(cv, rv) : NULL;  // (R, C): j - i
  fsdp_tensor* kt = d ? fsdp_full(0, NULL, (double)k, FSDP_F32, FSDP_CPU) : NULL;
  fsdp_tensor* m = kt ? (upper ? fsdp_ge(d, kt) : fsdp_le(d, kt)) : NULL;
  fsdp_tensor* md = m ? fsdp_to_device(m, fsdp_device_of(a)) : NULL;
  fsdp_tensor* zero = md ? fsdp_full(0, NULL, 0.0, a->dtype, fsdp_device_of(a)) : NULL;
  fsdp_set_grad_enabled(prev);
  fsdp_tensor* out = zero ? where_op(op, bwname, md, a, zero) : NULL;
  fsdp_tensor* tmp[] = {ri, ci, rv, cv, d, kt, m, md, zero};
  for (size_t i = 0; i < sizeof tmp / sizeof *tmp; i++) fsdp_tensor_release(tmp[i]);
  return out;
}
fsdp_tensor* fsdp_tril(fsdp_tensor* a, int64_t k) { return tri_op("tril", "TrilBackward", a, k, 0); }
fsdp_tensor* fsdp_triu(fsdp_tensor* a, int64_t k) { return tri_op("triu", "TriuBackward", a, k, 1); }

// ---- clamp, minimum, maximum, min ---------------------------------------------------------------------------
fsdp_tensor* fsdp_clamp_min(fsdp_tensor* a, double lo) {
  return unary_op("clamp", "ClampMinBackward", FSDP_UN_CLAMP_MIN, a, lo);
}
fsdp_tensor* fsdp_clamp_max(fsdp_tensor* a, double hi) {
  return unary_op("clamp", "ClampMaxBackward", FSDP_UN_CLAMP_MAX, a, hi);
}

// saved: [0] = a, [1] = b. PyTorch's rule: the gradient goes to the larger (maximum) or smaller
// (minimum) operand, split evenly on ties: weight MAX_TIE(a, b) for a, MAX_TIE(b, a) for b
// (minimum swaps them)
typedef struct {
  fsdp_shape_rec in[2];  // a, b (first, as binary_params, for reduce_grad)
  int minimum;           // 1 for minimum
} minmax_params;

static int minmax_backward(fsdp_node* n, fsdp_tensor* g, fsdp_tensor** gin) {
  minmax_params p;
  fsdp_node_params(n, &p, sizeof p);
  fsdp_tensor* a = fsdp_node_saved(n, 0);
  fsdp_tensor* b = a ? fsdp_node_saved(n, 1) : NULL;
  if (!b) return -1;
  int rc = 0;
  for (int k = 0; k < 2 && !rc; k++) {
    if (!n->needs_grad[k]) continue;
    int first = k ^ p.minimum;  // weight MAX_TIE(a, b) for (maximum, a) and (minimum, b)
    fsdp_tensor* w = first == 0 ? binary_forward(FSDP_BIN_MAX_TIE, a, b) : binary_forward(FSDP_BIN_MAX_TIE, b, a);
    fsdp_tensor* full = w ? fsdp_mul(g, w) : NULL;
    rc = full ? reduce_grad(n, k, full, &gin[k]) : -1;
    fsdp_tensor_release(w);
    fsdp_tensor_release(full);
  }
  return rc;
}

static fsdp_tensor* minmax_op(int minimum, fsdp_tensor* a, fsdp_tensor* b) {
  int op = minimum ? FSDP_BIN_MIN : FSDP_BIN_MAX;
  if (check_binary(bin_names[op], a, b)) return NULL;
  fsdp_tensor* y = binary_forward(op, a, b);
  fsdp_tensor* out = y ? fsdp_as_contig_dtype(y, fsdp_result_dtype(a, b)) : NULL;
  fsdp_tensor_release(y);
  fsdp_node* n =
      out ? fsdp_node_new(minimum ? "MinimumBackward" : "MaximumBackward", minmax_backward, 2, (fsdp_tensor*[]){a, b})
          : NULL;
  if (n) {
    minmax_params p = {.in = {fsdp_shape_rec_of(a), fsdp_shape_rec_of(b)}, .minimum = minimum};
    fsdp_node_set_params(n, &p, sizeof p);
    fsdp_node_save(n, a);
    fsdp_node_save(n, b);
    fsdp_node_set_output(n, out);
  }
  return out;
}
fsdp_tensor* fsdp_minimum(fsdp_tensor* a, fsdp_tensor* b) { return minmax_op(1, a, b); }
fsdp_tensor* fsdp_maximum(fsdp_tensor* a, fsdp_tensor* b) { return minmax_op(0, a, b); }

// min over one dim (or all of a) is -max(-a): the same first-index and even-share rules, with
// autograd through the negations
fsdp_tensor* fsdp_min(fsdp_tensor* a, int dim, int keepdim, fsdp_tensor** indices) {
  if (indices) *indices = NULL;
  CHECK_NULL(a, "min: input tensor is NULL");
  if (fsdp_check_float("min", a)) return NULL;
  fsdp_tensor* na = fsdp_neg(a);
  fsdp_tensor* m = na ? max_impl("min", na, dim, keepdim, indices, 1) : NULL;
  fsdp_tensor_release(na);
  fsdp_tensor* out = m ? fsdp_neg(m) : NULL;
  fsdp_tensor_release(m);
  if (!out && indices && *indices) {
    fsdp_tensor_release(*indices);
    *indices = NULL;
  }
  return out;
}
fsdp_tensor* fsdp_min_all(fsdp_tensor* a) {
  CHECK_NULL(a, "min: input tensor is NULL");
  if (fsdp_check_float("min", a)) return NULL;
  CHECK_NULL(fsdp_tensor_numel(a) > 0, "min: cannot take the min of an empty tensor of shape %s", SH(a));
  fsdp_tensor* na = fsdp_neg(a);
  fsdp_tensor* m = na ? fsdp_max_all(na) : NULL;
  fsdp_tensor_release(na);
  fsdp_tensor* out = m ? fsdp_neg(m) : NULL;
  fsdp_tensor_release(m);
  return out;
}

// ---- cumsum --------------------------------------------------------------------------------------------------
typedef struct {
  int dim;  // 0-based
} cumsum_params;

// float32 running sums of a along d (from the end when reverse); a new contiguous tensor
static fsdp_tensor* cumsum_run(fsdp_tensor* a, int d, int reverse) {
  fsdp_tensor* x = fsdp_as_contig(a);
  fsdp_tensor* y = x ? fsdp_new(x->ndim, x->shape, FSDP_F32, fsdp_device_of(x)) : NULL;
  if (y) {
    int64_t outer, red, inner;
    split_dims(x, d, &outer, &red, &inner);
    fsdp_backend_of(y)->elem->cumsum_dim(fsdp_f32(y), fsdp_f32(x), outer, red, inner, reverse);
  }
  fsdp_tensor_release(x);
  return y;
}

// the gradient of a running sum is the running sum of the gradient from the end
static int cumsum_backward(fsdp_node* n, fsdp_tensor* g, fsdp_tensor** gin) {
  cumsum_params p;
  fsdp_node_params(n, &p, sizeof p);
  gin[0] = cumsum_run(g, p.dim, 1);
  return gin[0] ? 0 : -1;
}

fsdp_tensor* fsdp_cumsum(fsdp_tensor* a, int dim) {
  CHECK_NULL(a, "cumsum: input tensor is NULL");
  if (fsdp_check_float("cumsum", a)) return NULL;
  int d = a->ndim == 0 && (dim == 0 || dim == -1) ? 0 : fsdp_wrap_dim("cumsum", dim, a->ndim);
  if (d < 0) return NULL;
  fsdp_tensor* out = fsdp_round_to(cumsum_run(a, d, 0), a->dtype);
  fsdp_node* n = out ? fsdp_node_new("CumsumBackward", cumsum_backward, 1, &a) : NULL;
  if (n) {
    fsdp_node_set_params(n, &(cumsum_params){.dim = d}, sizeof(cumsum_params));
    fsdp_node_set_output(n, out);
  }
  return out;
}
