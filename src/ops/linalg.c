/*
 * ops/linalg.c -- matmul (torch.matmul semantics), bmm and linear, with their backward.
 *
 * Everything is a GEMM through the device's linalg table, float32 accumulation and output. A
 * product of two bfloat16 operands reads them as they are (gemm_bf16_many: oneDNN's bf16 GEMM
 * where the CPU has it); any other float dtypes are read as float32. Outputs are rounded to the
 * inputs' dtype once. Operands are passed to the GEMM without copies when they are row-major
 * matrices or transposed row-major matrices (x:t(), k:transpose(-2, -1)) of the dtype the GEMM
 * reads; anything else is made contiguous first. Batched products fold the
 * batch into the GEMM's M when the right operand has no batch (x (B, T, C) @ w (C, D) is one
 * GEMM of (B*T, C) @ (C, D)), and broadcast batch dims are reduced by accumulating GEMMs
 * (beta = 1) instead of materializing the broadcast.
 */
#include "ops/ops.h"

// ---- helpers ----------------------------------------------------------------------------------------

// the dtype a product's GEMMs read its operands in: bfloat16 when both operands are (the linalg
// table's gemm_bf16_many, a native bf16 GEMM where the CPU has one), else float32 (a bfloat16 or
// float16 operand through a float32 copy). C is float32 either way.
static int gemm_dtype(const fsdp_tensor* a, const fsdp_tensor* b) {
  return a->dtype == FSDP_BF16 && b->dtype == FSDP_BF16 ? FSDP_BF16 : FSDP_F32;
}

// element p[off] of a buffer of `dtype` elements
static const void* elem_at(const void* p, int64_t off, int dtype) {
  return (const char*)p + off * (int64_t)fsdp_dtype_size(dtype);
}

// one GEMM of this file: C (M,N) f32 = op(A) @ op(B) + beta * C, A and B in the product's dtype
typedef struct {
  int ta, tb;
  int64_t M, N, K;
  const void* A;
  int64_t lda;
  const void* B;
  int64_t ldb;
  float beta;
  float* C;
  int64_t ldc;
} gemm_op;

// n independent GEMMs on operands of dtype (float32 or bfloat16), run together by the device. Empty
// sizes are handled here (BLAS rejects leading dimensions of 0): K = 0 leaves beta * C (zeros for
// beta 0). 0, or -1 with the error set.
static int run_gemms(const fsdp_backend* be, int dtype, int n, const gemm_op* g) {
  union {
    fsdp_gemm_args f32[16];
    fsdp_gemm_bf16_args bf16[16];
  } stack;
  size_t es = dtype == FSDP_BF16 ? sizeof(fsdp_gemm_bf16_args) : sizeof(fsdp_gemm_args);
  void* list = n <= 16 ? (void*)&stack : malloc((size_t)n * es);
  CHECK_INT(list, "matmul: out of memory for a list of %d GEMMs", n);
  fsdp_gemm_args* l32 = list;
  fsdp_gemm_bf16_args* l16 = list;
  int m = 0;
  for (int i = 0; i < n; i++) {
    const gemm_op* o = &g[i];
    if (o->M == 0 || o->N == 0) continue;
    if (o->K == 0) {
      if (o->beta == 0.0f)
        for (int64_t r = 0; r < o->M; r++) be->memset(o->C + r * o->ldc, 0, o->N * sizeof(float));
      continue;
    }
    int64_t lda = o->lda > 0 ? o->lda : 1, ldb = o->ldb > 0 ? o->ldb : 1, ldc = o->ldc > 0 ? o->ldc : 1;
    if (dtype == FSDP_BF16)
      l16[m++] = (fsdp_gemm_bf16_args){o->ta, o->tb, o->M, o->N, o->K, 1.0f, o->A, lda, o->B, ldb, o->beta, o->C, ldc};
    else l32[m++] = (fsdp_gemm_args){o->ta, o->tb, o->M, o->N, o->K, 1.0f, o->A, lda, o->B, ldb, o->beta, o->C, ldc};
  }
  int rc = 0;
  if (m > 0 && dtype == FSDP_BF16) rc = be->linalg->gemm_bf16_many(m, l16);
  else if (m > 0) be->linalg->gemm_many(m, l32);
  if (list != (void*)&stack) free(list);
  return rc;
}

static bool dims_contiguous(int ndim, const int64_t* shape, const int64_t* stride) {
  int64_t s = 1;
  for (int i = ndim - 1; i >= 0; i--) {
    if (shape[i] != 1 && stride[i] != s) return false;
    s *= shape[i];
  }
  return true;
}

// A GEMM operand: a new ref to a tensor of the product's dtype whose matrices (last two dims, or
// the vector of a 1-D tensor) are row-major (trans = 0, ld = cols) or the transpose of row-major
// (trans = 1, ld = rows), with batch dims contiguous at a stride of rows*cols. No copy when x
// already is one.
typedef struct {
  fsdp_tensor* t;
  const void* p;
  int trans;
  int64_t ld;
} operand;

static int operand_of(fsdp_tensor* x, int64_t rows, int64_t cols, int dtype, operand* op) {
  op->trans = 0;
  op->t = NULL;
  if (x->dtype == dtype && !fsdp_tensor_is_contiguous(x) && x->ndim >= 2) {
    int64_t shape[FSDP_MAX_DIMS], stride[FSDP_MAX_DIMS];
    memcpy(shape, x->shape, x->ndim * sizeof(int64_t));
    memcpy(stride, x->stride, x->ndim * sizeof(int64_t));
    int n = x->ndim;
    int64_t t = shape[n - 1];
    shape[n - 1] = shape[n - 2];
    shape[n - 2] = t;
    t = stride[n - 1];
    stride[n - 1] = stride[n - 2];
    stride[n - 2] = t;
    if (dims_contiguous(n, shape, stride)) {
      fsdp_tensor_retain(x);
      op->t = x;
      op->trans = 1;
    }
  }
  if (!op->t) op->t = fsdp_as_contig_dtype(x, dtype);
  if (!op->t) return -1;
  op->p = fsdp_ptr(op->t);
  op->ld = op->trans ? rows : cols;
  return 0;
}

// element strides of a tensor's matrices over the broadcast batch shape (0 on broadcast dims)
static void batch_strides(int nbatch_x, const int64_t* xshape, int64_t matsize, int nb, const int64_t* bshape,
                          int64_t* out) {
  int64_t s = matsize;
  for (int i = nb - 1; i >= 0; i--) {
    int ix = nbatch_x - nb + i;
    if (ix < 0) {
      out[i] = 0;
      continue;
    }
    out[i] = (xshape[ix] == 1 && bshape[i] != 1) ? 0 : s;
    s *= xshape[ix];
  }
}

// Z[z(i)] (+)= op(X[x(i)]) @ op(Y[y(i)]) over the broadcast batch index i; X and Y of dtype, Z (M, N)
// float32 row-major with ldz = N. When Z is reduced over broadcast dims (zred), it is zeroed first
// and the GEMMs accumulate into it one after another; otherwise they are independent and run together.
static int gemm_batch(const fsdp_backend* be, int dtype, int nb, const int64_t* bshape, int64_t M, int64_t N, int64_t K,
                      int tx, const void* X, int64_t ldx, const int64_t* sx, int ty, const void* Y, int64_t ldy,
                      const int64_t* sy, float* Z, const int64_t* sz, int64_t z_numel, bool zred) {
  int64_t total = fsdp_shape_numel(nb, bshape);
  if (total == 0 || M == 0 || N == 0 || zred) {
    if (z_numel) be->elem->fill(Z, FSDP_F32, z_numel, 0.0);
    if (total == 0 || M == 0 || N == 0) return 0;
  }
  int64_t nlist = zred ? 1 : total;
  gemm_op one = {0};
  gemm_op* g = nlist == 1 ? &one : malloc(nlist * sizeof *g);
  CHECK_INT(g, "matmul: out of memory for a list of %lld GEMMs", (long long)nlist);
  int64_t idx[FSDP_MAX_DIMS] = {0};
  int rc = 0;
  for (int64_t i = 0; i < total && !rc; i++) {
    int64_t ox = 0, oy = 0, oz = 0;
    for (int d = 0; d < nb; d++) {
      ox += idx[d] * sx[d];
      oy += idx[d] * sy[d];
      oz += idx[d] * sz[d];
    }
    g[zred ? 0 : i] = (gemm_op){
        tx, ty, M, N, K, elem_at(X, ox, dtype), ldx, elem_at(Y, oy, dtype), ldy, zred ? 1.0f : 0.0f, Z + oz, N};
    if (zred) rc = run_gemms(be, dtype, 1, g);
    for (int d = nb - 1; d >= 0; d--) {
      if (++idx[d] < bshape[d]) break;
      idx[d] = 0;
    }
  }
  if (!zred && !rc) rc = run_gemms(be, dtype, (int)total, g);
  if (g != &one) free(g);
  return rc;
}

// ---- matmul / bmm -----------------------------------------------------------------------------------

// the shapes of a product: a (..., n, k) or (k); b (..., k, m) or (k)
typedef struct {
  int64_t n, k, m;
  int na_batch, nb_batch, nbatch;   // batch ranks of a, b and the broadcast
  int64_t bshape[FSDP_MAX_DIMS];    // broadcast batch shape
  int64_t a_batch, b_batch, batch;  // batch numels
} mm_shape;

static int mm_shape_of(const char* op, const fsdp_tensor* a, const fsdp_tensor* b, mm_shape* s) {
  CHECK_INT(a->ndim >= 1 && b->ndim >= 1, "%s: both arguments need at least 1 dimension, got %s and %s", op, SH(a),
            SH(b));
  s->n = a->ndim == 1 ? 1 : a->shape[a->ndim - 2];
  s->k = a->shape[a->ndim - 1];
  int64_t kb = b->ndim == 1 ? b->shape[0] : b->shape[b->ndim - 2];
  s->m = b->ndim == 1 ? 1 : b->shape[b->ndim - 1];
  CHECK_INT(s->k == kb, "%s: shapes %s and %s cannot be multiplied (inner dimensions %lld vs %lld)", op, SH(a), SH(b),
            (long long)s->k, (long long)kb);
  s->na_batch = a->ndim > 2 ? a->ndim - 2 : 0;
  s->nb_batch = b->ndim > 2 ? b->ndim - 2 : 0;
  s->nbatch = s->na_batch > s->nb_batch ? s->na_batch : s->nb_batch;
  CHECK_INT(s->nbatch + 2 <= FSDP_MAX_DIMS, "%s: too many dims in %s and %s", op, SH(a), SH(b));
  for (int i = 0; i < s->nbatch; i++) {
    int ia = s->na_batch - s->nbatch + i, ib = s->nb_batch - s->nbatch + i;
    int64_t da = ia >= 0 ? a->shape[ia] : 1, db = ib >= 0 ? b->shape[ib] : 1;
    CHECK_INT(da == db || da == 1 || db == 1, "%s: batch dimensions of %s and %s cannot be broadcast (%lld vs %lld)",
              op, SH(a), SH(b), (long long)da, (long long)db);
    s->bshape[i] = da == 1 ? db : da;
  }
  s->a_batch = fsdp_shape_numel(s->na_batch, a->shape);
  s->b_batch = fsdp_shape_numel(s->nb_batch, b->shape);
  s->batch = fsdp_shape_numel(s->nbatch, s->bshape);
  return 0;
}

static int matmul_backward(fsdp_node* node, fsdp_tensor* grad_out, fsdp_tensor** grad_in) {
  fsdp_tensor* a = fsdp_node_saved(node, 0);
  fsdp_tensor* b = a ? fsdp_node_saved(node, 1) : NULL;
  if (!a || !b) return -1;
  mm_shape s;
  if (mm_shape_of(node->name, a, b, &s)) return -1;
  const fsdp_backend* be = fsdp_backend_of(a);
  int dt = gemm_dtype(a, b);
  int64_t sa[FSDP_MAX_DIMS], sb[FSDP_MAX_DIMS], sg[FSDP_MAX_DIMS];
  batch_strides(s.na_batch, a->shape, s.n * s.k, s.nbatch, s.bshape, sa);
  batch_strides(s.nb_batch, b->shape, s.k * s.m, s.nbatch, s.bshape, sb);
  batch_strides(s.nbatch, s.bshape, s.n * s.m, s.nbatch, s.bshape, sg);
  operand A = {0}, B = {0};
  fsdp_tensor *g = fsdp_as_contig_dtype(grad_out, dt), *ga = NULL, *gb = NULL;  // g (batch, n, m)
  if (!g) return -1;
  const void* G = fsdp_ptr(g);
  int rc = 0;

  if (node->needs_grad[0]) {  // gA[a(i)] += g[i] @ op(B[b(i)])^T
    if (operand_of(b, s.k, s.m, dt, &B) || !(ga = fsdp_new(a->ndim, a->shape, FSDP_F32, fsdp_device_of(a)))) goto fail;
    if (s.b_batch == 1)  // fold the batch into M: one GEMM
      rc = run_gemms(be, dt, 1,
                     &(gemm_op){0, !B.trans, s.batch * s.n, s.k, s.m, G, s.m, B.p, B.ld, 0.0f, fsdp_f32(ga), s.k});
    else
      rc = gemm_batch(be, dt, s.nbatch, s.bshape, s.n, s.k, s.m, 0, G, s.m, sg, !B.trans, B.p, B.ld, sb, fsdp_f32(ga),
                      sa, s.a_batch * s.n * s.k, s.a_batch < s.batch);
    if (rc) goto fail;
  }
  if (node->needs_grad[1]) {  // gB[b(i)] += op(A[a(i)])^T @ g[i]
    if (operand_of(a, s.n, s.k, dt, &A) || !(gb = fsdp_new(b->ndim, b->shape, FSDP_F32, fsdp_device_of(b)))) goto fail;
    if (s.b_batch == 1 && !A.trans)  // (k, batch*n) @ (batch*n, m): the batch sum is the GEMM's K
      rc = run_gemms(be, dt, 1, &(gemm_op){1, 0, s.k, s.m, s.batch * s.n, A.p, s.k, G, s.m, 0.0f, fsdp_f32(gb), s.m});
    else
      rc = gemm_batch(be, dt, s.nbatch, s.bshape, s.k, s.m, s.n, !A.trans, A.p, A.ld, sa, 0, G, s.m, sg, fsdp_f32(gb),
                      sb, s.b_batch * s.k * s.m, s.b_batch < s.batch);
    if (rc) goto fail;
  }
  fsdp_tensor_release(A.t);
  fsdp_tensor_release(B.t);
  fsdp_tensor_release(g);
  grad_in[0] = ga;
  grad_in[1] = gb;
  return 0;
fail:
  fsdp_tensor_release(A.t);
  fsdp_tensor_release(B.t);
  fsdp_tensor_release(g);
  fsdp_tensor_release(ga);
  fsdp_tensor_release(gb);
  return -1;
}

static fsdp_tensor* matmul_impl(const char* op, const char* node_name, fsdp_tensor* a, fsdp_tensor* b) {
  CHECK_NULL(a && b, "%s: argument is nil", op);
  if (fsdp_check_float(op, a) || fsdp_check_float(op, b) || fsdp_check_same_dtype(op, "input", a, "other", b))
    return NULL;
  if (fsdp_check_same_device(op, a, b)) return NULL;
  mm_shape s;
  if (mm_shape_of(op, a, b, &s)) return NULL;
  // output: batch + (n if a is not 1-D) + (m if b is not 1-D)
  int64_t oshape[FSDP_MAX_DIMS];
  int on = s.nbatch;
  memcpy(oshape, s.bshape, s.nbatch * sizeof(int64_t));
  if (a->ndim > 1) oshape[on++] = s.n;
  if (b->ndim > 1) oshape[on++] = s.m;

  const fsdp_backend* be = fsdp_backend_of(a);
  int dt = gemm_dtype(a, b), rc = -1;
  operand A = {0}, B = {0};
  fsdp_tensor* out = NULL;  // float32, rounded to a's dtype at the end
  if (!operand_of(a, s.n, s.k, dt, &A) && !operand_of(b, s.k, s.m, dt, &B) &&
      (out = fsdp_new(on, oshape, FSDP_F32, fsdp_device_of(a)))) {
    if (s.b_batch == 1 && !A.trans) {  // (batch*n, k) @ (k, m): one GEMM
      rc = run_gemms(be, dt, 1,
                     &(gemm_op){0, B.trans, s.batch * s.n, s.m, s.k, A.p, A.ld, B.p, B.ld, 0.0f, fsdp_f32(out), s.m});
    } else {
      int64_t sa[FSDP_MAX_DIMS], sb[FSDP_MAX_DIMS], so[FSDP_MAX_DIMS];
      batch_strides(s.na_batch, a->shape, s.n * s.k, s.nbatch, s.bshape, sa);
      batch_strides(s.nb_batch, b->shape, s.k * s.m, s.nbatch, s.bshape, sb);
      batch_strides(s.nbatch, s.bshape, s.n * s.m, s.nbatch, s.bshape, so);
      rc = gemm_batch(be, dt, s.nbatch, s.bshape, s.n, s.m, s.k, A.trans, A.p, A.ld, sa, B.trans, B.p, B.ld, sb,
                      fsdp_f32(out), so, fsdp_tensor_numel(out), false);
    }
  }
  fsdp_tensor_release(A.t);
  fsdp_tensor_release(B.t);
  if (rc) {
    fsdp_tensor_release(out);
    return NULL;
  }
  out = fsdp_round_to(out, a->dtype);
  if (!out) return NULL;
  fsdp_node* n = fsdp_node_new(node_name, matmul_backward, 2, (fsdp_tensor*[]){a, b});
  if (n) {
    fsdp_node_save(n, a);
    fsdp_node_save(n, b);
    fsdp_node_set_output(n, out);
  }
  return out;
}

fsdp_tensor* fsdp_matmul(fsdp_tensor* a, fsdp_tensor* b) { return matmul_impl("matmul", "MatmulBackward", a, b); }

fsdp_tensor* fsdp_bmm(fsdp_tensor* a, fsdp_tensor* b) {
  CHECK_NULL(a && b, "bmm: argument is nil");
  CHECK_NULL(a->ndim == 3 && b->ndim == 3, "bmm: expected 3-D tensors (B, n, k) and (B, k, m), got %s and %s", SH(a),
             SH(b));
  CHECK_NULL(a->shape[0] == b->shape[0], "bmm: batch sizes of %s and %s differ (%lld vs %lld)", SH(a), SH(b),
             (long long)a->shape[0], (long long)b->shape[0]);
  return matmul_impl("bmm", "BmmBackward", a, b);
}

// ---- linear -----------------------------------------------------------------------------------------
// y (M, out) = x (M, in) @ w (out, in)^T + b (out), with M the product of x's leading dims

static int linear_backward(fsdp_node* node, fsdp_tensor* grad_out, fsdp_tensor** grad_in) {
  fsdp_tensor* x = fsdp_node_saved(node, 0);
  fsdp_tensor* w = x ? fsdp_node_saved(node, 1) : NULL;
  if (!x || !w) return -1;
  const fsdp_backend* be = fsdp_backend_of(x);
  int64_t out_f = w->shape[0], in_f = w->shape[1], M = fsdp_shape_numel(x->ndim - 1, x->shape);
  int dt = gemm_dtype(x, w);
  operand W = {0};
  fsdp_tensor *gy = fsdp_as_contig_dtype(grad_out, dt), *gy32 = NULL, *xc = NULL;  // gy (M, out)
  fsdp_tensor *gx = NULL, *gw = NULL, *gb = NULL;
  if (!gy) return -1;
  // The two GEMMs are independent: they run together (one per thread at 2 threads). But when w is
  // the last saved view of bytes an owner manages (an FSDP unit's gathered parameters, which go
  // when no node needs them any more), gx runs first and w is released before gw is allocated,
  // so the unit's full gradient and its gathered parameters never coexist.
  int early = node->needs_grad[1] && fsdp_node_saved_last_use(node, 1);
  gemm_op gm[2];
  int n_gemm = 0;
  if (node->needs_grad[0]) {  // gx (M, in) = gy (M, out) @ w (out, in)
    if (operand_of(w, out_f, in_f, dt, &W) || !(gx = fsdp_new(x->ndim, x->shape, FSDP_F32, fsdp_device_of(x))))
      goto fail;
    gm[n_gemm++] = (gemm_op){0, W.trans, M, in_f, out_f, fsdp_ptr(gy), out_f, W.p, W.ld, 0.0f, fsdp_f32(gx), in_f};
  }
  if (early) {
    if (run_gemms(be, dt, n_gemm, gm)) goto fail;
    fsdp_tensor_release(W.t);
    W.t = NULL;
    n_gemm = 0;
    w = NULL;  // released: not to be touched again
    if (fsdp_node_release_saved(node, 1)) goto fail;
  }
  if (node->needs_grad[1]) {  // gw (out, in) = gy^T (out, M) @ x (M, in)
    int64_t wshape[2] = {out_f, in_f};
    if (!(xc = fsdp_as_contig_dtype(x, dt)) || !(gw = fsdp_new(2, wshape, FSDP_F32, fsdp_device_of(x)))) goto fail;
    gm[n_gemm++] = (gemm_op){1, 0, out_f, in_f, M, fsdp_ptr(gy), out_f, fsdp_ptr(xc), in_f, 0.0f, fsdp_f32(gw), in_f};
  }
  if (run_gemms(be, dt, n_gemm, gm)) goto fail;
  if (node->needs_grad[2]) {  // gb (out) = column sums of gy, in float32
    if (!(gy32 = fsdp_as_contig(gy)) || !(gb = fsdp_new(1, &out_f, FSDP_F32, fsdp_device_of(x)))) goto fail;
    be->linalg->sum_rows(fsdp_f32(gb), fsdp_f32(gy32), M, out_f);
  }
  fsdp_tensor_release(W.t);
  fsdp_tensor_release(xc);
  fsdp_tensor_release(gy);
  fsdp_tensor_release(gy32);
  grad_in[0] = gx;
  grad_in[1] = gw;
  grad_in[2] = gb;
  return 0;
fail:
  fsdp_tensor_release(W.t);
  fsdp_tensor_release(xc);
  fsdp_tensor_release(gy);
  fsdp_tensor_release(gy32);
  fsdp_tensor_release(gx);
  fsdp_tensor_release(gw);
  fsdp_tensor_release(gb);
  return -1;
}

fsdp_tensor* fsdp_linear(fsdp_tensor* x, fsdp_tensor* w, fsdp_tensor* b) {
  CHECK_NULL(x && w, "linear: input or weight is nil");
  if (fsdp_check_float("linear", x) || fsdp_check_float("linear", w) || (b && fsdp_check_float("linear", b)))
    return NULL;
  if (fsdp_check_same_dtype("linear", "input", x, "weight", w) ||
      fsdp_check_same_dtype("linear", "weight", w, "bias", b))
    return NULL;
  if (fsdp_check_same_device("linear", x, w) || (b && fsdp_check_same_device("linear", x, b))) return NULL;
  CHECK_NULL(w->ndim == 2, "linear: weight must be 2-D (out_features, in_features), got %s", SH(w));
  CHECK_NULL(x->ndim >= 1, "linear: input must have at least 1 dimension, got %s", SH(x));
  int64_t out_f = w->shape[0], in_f = w->shape[1];
  CHECK_NULL(x->shape[x->ndim - 1] == in_f, "linear: input %s and weight %s: in_features %lld vs %lld", SH(x), SH(w),
             (long long)x->shape[x->ndim - 1], (long long)in_f);
  CHECK_NULL(!b || (b->ndim == 1 && b->shape[0] == out_f),
             "linear: bias %s does not match weight %s: expected (%lld) for out_features %lld", b ? SH(b) : "", SH(w),
             (long long)out_f, (long long)out_f);

  int64_t oshape[FSDP_MAX_DIMS];
  memcpy(oshape, x->shape, x->ndim * sizeof(int64_t));
  oshape[x->ndim - 1] = out_f;
  int64_t M = fsdp_shape_numel(x->ndim - 1, x->shape);
  const fsdp_backend* be = fsdp_backend_of(x);
  int dt = gemm_dtype(x, w), rc = -1;
  operand W = {0};
  fsdp_tensor *xc = fsdp_as_contig_dtype(x, dt), *bc = NULL, *y = NULL;  // y float32, rounded at the end
  if (xc && !operand_of(w, out_f, in_f, dt, &W) && (!b || (bc = fsdp_as_contig(b))) &&
      (y = fsdp_new(x->ndim, oshape, FSDP_F32, fsdp_device_of(x)))) {
    // y = b (pre-filled rows) + x @ w^T in one GEMM with beta = 1
    if (bc) be->linalg->bias_rows(fsdp_f32(y), fsdp_f32(bc), M, out_f);
    rc = run_gemms(
        be, dt, 1,
        &(gemm_op){0, !W.trans, M, out_f, in_f, fsdp_ptr(xc), in_f, W.p, W.ld, bc ? 1.0f : 0.0f, fsdp_f32(y), out_f});
  }
  fsdp_tensor_release(xc);
  fsdp_tensor_release(W.t);
  fsdp_tensor_release(bc);
  if (rc) {
    fsdp_tensor_release(y);
    return NULL;
  }
  y = fsdp_round_to(y, x->dtype);
  if (!y) return NULL;

  fsdp_node* n = fsdp_node_new("LinearBackward", linear_backward, 3, (fsdp_tensor*[]){x, w, b});
  if (n) {
    fsdp_node_save(n, x);
    fsdp_node_save(n, w);
    fsdp_node_set_output(n, y);
  }
  return y;
}
