/*
 * ops/shape.c -- views and shape ops: detach, clone, contiguous, view/reshape/flatten,
 * transpose/permute, (un)squeeze, expand, narrow, cat, index_select and dtype casts.
 *
 * View ops share the input's storage (fsdp_new_view) and record a node whose backward maps the
 * gradient back onto the input's shape:
 *   view/reshape/flatten/(un)squeeze -> reshape back      transpose/permute -> inverse permutation
 *   expand -> sum over the broadcast dims                  narrow -> zeros with the slice filled
 *   cat -> narrow per input                                index_select -> index_add into zeros
 * They work on any dtype; the ones that compute (index_select's backward) do it in float32.
 */
#include "ops/ops.h"

// ---- helpers ------------------------------------------------------------------------------------
// the input's shape (fsdp_shape_rec, ops/ops.h): the parameters of the "reshape back" family and
// of expand

// a contiguous tensor with t's dtype (new ref; t itself when already contiguous)
static fsdp_tensor* contig_same_dtype(fsdp_tensor* t) {
  if (fsdp_tensor_is_contiguous(t)) {
    fsdp_tensor_retain(t);
    return t;
  }
  fsdp_tensor* r = fsdp_new(t->ndim, t->shape, t->dtype, fsdp_device_of(t));
  if (r && fsdp_copy_strided(r, t)) {
    fsdp_tensor_release(r);
    return NULL;
  }
  return r;
}

static int64_t prod(const int64_t* s, int from, int to) {
  int64_t p = 1;
  for (int d = from; d < to; d++) p *= s[d];
  return p;
}

// Writes src into dst[..., start:start+src->shape[dim], ...] where dst is contiguous and both
// agree on every other dim; src may be strided and of another dtype. One kernel call per
// index of the dims before `dim`.
static void copy_into_slice(fsdp_tensor* dst, int dim, int64_t start, const fsdp_tensor* src) {
  const fsdp_elem_kernels* k = fsdp_backend_of(dst)->elem;
  int64_t outer = prod(dst->shape, 0, dim), inner = prod(dst->shape, dim + 1, dst->ndim);
  int64_t dsz = dst->shape[dim], idx[FSDP_MAX_DIMS] = {0};
  size_t des = fsdp_dtype_size(dst->dtype), ses = fsdp_dtype_size(src->dtype);
  if (fsdp_tensor_numel(src) == 0) return;
  for (int64_t o = 0; o < outer; o++) {
    int64_t soff = 0;
    for (int j = 0; j < dim; j++) soff += idx[j] * src->stride[j];
    char* d = (char*)fsdp_ptr(dst) + (o * dsz + start) * inner * (int64_t)des;
    const char* s = (const char*)fsdp_ptr(src) + soff * (int64_t)ses;
    k->copy_strided(d, dst->dtype, s, src->dtype, src->ndim - dim, src->shape + dim, src->stride + dim);
    for (int j = dim - 1; j >= 0; j--) {
      if (++idx[j] < src->shape[j]) break;
      idx[j] = 0;
    }
  }
}

// ---- detach, clone, contiguous ---------------------------------------------------------------------
fsdp_tensor* fsdp_detach(fsdp_tensor* a) {
  CHECK_NULL(a, "detach: input tensor is NULL");
  return fsdp_new_view(a, a->ndim, a->shape, a->stride, a->offset);
}

static int identity_backward(fsdp_node* n, fsdp_tensor* g, fsdp_tensor** gin) {
  (void)n;
  fsdp_tensor_retain(g);
  gin[0] = g;
  return 0;
}

fsdp_tensor* fsdp_clone(fsdp_tensor* a) {
  CHECK_NULL(a, "clone: input tensor is NULL");
  fsdp_tensor* out = fsdp_new(a->ndim, a->shape, a->dtype, fsdp_device_of(a));
  if (!out) return NULL;
  if (fsdp_copy_strided(out, a)) {
    fsdp_tensor_release(out);
    return NULL;
  }
  fsdp_node* n = fsdp_node_new("CloneBackward", identity_backward, 1, &a);
  if (n) fsdp_node_set_output(n, out);
  return out;
}

fsdp_tensor* fsdp_contiguous(fsdp_tensor* a) {
  CHECK_NULL(a, "contiguous: input tensor is NULL");
  if (fsdp_tensor_is_contiguous(a)) {
    fsdp_tensor_retain(a);
    return a;
  }
  return fsdp_clone(a);
}

// ---- view / reshape --------------------------------------------------------------------------------
static int reshape_back_backward(fsdp_node* n, fsdp_tensor* g, fsdp_tensor** gin) {
  fsdp_shape_rec p;
  fsdp_node_params(n, &p, sizeof p);
  gin[0] = fsdp_reshape(g, p.ndim, p.shape);
  return gin[0] ? 0 : -1;
}

// resolves one -1 and checks the element count; writes the final shape into out. The sizes are
// checked for int64 overflow (fsdp_shape_nbytes) before anything multiplies them.
static int infer_shape(const char* op, const fsdp_tensor* a, int ndim, const int64_t* shape, int64_t* out) {
  CHECK_INT(ndim >= 0 && ndim <= FSDP_MAX_DIMS, "%s: %d dims requested (at most %d supported)", op, ndim,
            FSDP_MAX_DIMS);
  int infer = -1;
  for (int d = 0; d < ndim; d++) {
    if (shape[d] == -1) {
      CHECK_INT(infer < 0, "%s: only one dimension can be -1, got shape %s", op, fsdp_dims_s(ndim, shape));
      infer = d;
    } else {
      CHECK_INT(shape[d] >= 0, "%s: invalid size %lld in shape %s", op, (long long)shape[d], fsdp_dims_s(ndim, shape));
    }
    out[d] = shape[d];
  }
  size_t es = fsdp_dtype_size(a->dtype);
  if (infer >= 0) out[infer] = 1;  // the known sizes alone
  if (fsdp_shape_nbytes(op, ndim, out, es) < 0) return -1;
  int64_t known = fsdp_shape_numel(ndim, out);
  int64_t numel = fsdp_tensor_numel(a);
  if (infer >= 0) {
    CHECK_INT(known != 0 && numel % known == 0, "%s: shape %s is invalid for input of shape %s (%lld elements)", op,
              fsdp_dims_s(ndim, shape), SH(a), (long long)numel);
    out[infer] = numel / known;
    if (fsdp_shape_nbytes(op, ndim, out, es) < 0) return -1;
  } else {
    CHECK_INT(known == numel, "%s: shape %s is invalid for input of shape %s (%lld elements)", op,
              fsdp_dims_s(ndim, shape), SH(a), (long long)numel);
  }
  return 0;
}

// Strides that let `a` be viewed as `shape` without a copy (PyTorch's computeStride): each run of
// input dims that is contiguous in memory may be split/merged freely. Returns 0, or -1 (no error
// set) when the layout is not viewable.
static int view_strides(const fsdp_tensor* a, int ndim, const int64_t* shape, int64_t* stride) {
  if (fsdp_tensor_numel(a) == 0 || a->ndim == 0) {
    fsdp_contiguous_strides(ndim, shape, stride);
    return 0;
  }
  int vd = ndim - 1;
  int64_t chunk_base = a->stride[a->ndim - 1], tensor_numel = 1, view_numel = 1;
  for (int td = a->ndim - 1; td >= 0; td--) {
    tensor_numel *= a->shape[td];
    if (td == 0 || (a->shape[td - 1] != 1 && a->stride[td - 1] != tensor_numel * chunk_base)) {
      while (vd >= 0 && (view_numel < tensor_numel || shape[vd] == 1)) {
        stride[vd] = view_numel * chunk_base;
        view_numel *= shape[vd];
        vd--;
      }
      if (view_numel != tensor_numel) return -1;
      if (td > 0) {
        chunk_base = a->stride[td - 1];
        tensor_numel = 1;
        view_numel = 1;
      }
    }
  }
  return vd == -1 ? 0 : -1;
}

// the view itself plus its node (name = op's backward name)
static fsdp_tensor* make_view(const char* bwname, fsdp_tensor* a, int ndim, const int64_t* shape,
                              const int64_t* stride) {
  fsdp_tensor* out = fsdp_new_view(a, ndim, shape, stride, a->offset);
  if (!out) return NULL;
  fsdp_node* n = fsdp_node_new(bwname, reshape_back_backward, 1, &a);
  if (n) {
    fsdp_shape_rec p = fsdp_shape_rec_of(a);
    fsdp_node_set_params(n, &p, sizeof p);
    fsdp_node_set_output(n, out);
  }
  return out;
}

fsdp_tensor* fsdp_view(fsdp_tensor* a, int ndim, const int64_t* shape) {
  CHECK_NULL(a, "view: input tensor is NULL");
  int64_t s[FSDP_MAX_DIMS], st[FSDP_MAX_DIMS];
  if (infer_shape("view", a, ndim, shape, s)) return NULL;
  CHECK_NULL(view_strides(a, ndim, s, st) == 0,
             "view: size %s is not compatible with the input's shape %s and strides %s (a dimension spans "
             "non-contiguous memory); use reshape() or contiguous() first",
             fsdp_dims_s(ndim, s), SH(a), fsdp_dims_s(a->ndim, a->stride));
  return make_view("ViewBackward", a, ndim, s, st);
}

fsdp_tensor* fsdp_reshape(fsdp_tensor* a, int ndim, const int64_t* shape) {
  CHECK_NULL(a, "reshape: input tensor is NULL");
  int64_t s[FSDP_MAX_DIMS], st[FSDP_MAX_DIMS];
  if (infer_shape("reshape", a, ndim, shape, s)) return NULL;
  if (view_strides(a, ndim, s, st) == 0) return make_view("ReshapeBackward", a, ndim, s, st);
  fsdp_tensor* c = fsdp_clone(a);  // not viewable: copy, then view the contiguous copy
  if (!c) return NULL;
  fsdp_contiguous_strides(ndim, s, st);
  fsdp_tensor* out = make_view("ReshapeBackward", c, ndim, s, st);
  fsdp_tensor_release(c);
  return out;
}

fsdp_tensor* fsdp_flatten(fsdp_tensor* a, int start_dim, int end_dim) {
  CHECK_NULL(a, "flatten: input tensor is NULL");
  if (a->ndim == 0) {
    int64_t one = 1;
    return fsdp_reshape(a, 1, &one);
  }
  int s = fsdp_wrap_dim("flatten", start_dim, a->ndim), e = fsdp_wrap_dim("flatten", end_dim, a->ndim);
  if (s < 0 || e < 0) return NULL;
  CHECK_NULL(s <= e, "flatten: start_dim %d comes after end_dim %d for a tensor of shape %s", s + 1, e + 1, SH(a));
  int64_t shape[FSDP_MAX_DIMS];
  int nd = 0;
  for (int d = 0; d < s; d++) shape[nd++] = a->shape[d];
  shape[nd++] = prod(a->shape, s, e + 1);
  for (int d = e + 1; d < a->ndim; d++) shape[nd++] = a->shape[d];
  return fsdp_reshape(a, nd, shape);
}

// ---- permute / transpose -----------------------------------------------------------------------------
typedef struct {
  int perm[FSDP_MAX_DIMS];  // output dim d is input dim perm[d]
} permute_params;

static int permute_backward(fsdp_node* n, fsdp_tensor* g, fsdp_tensor** gin) {
  permute_params p;
  fsdp_node_params(n, &p, sizeof p);
  int inv[FSDP_MAX_DIMS];
  for (int d = 0; d < g->ndim; d++) inv[p.perm[d]] = d;
  gin[0] = fsdp_permute(g, g->ndim, inv);
  return gin[0] ? 0 : -1;
}

static fsdp_tensor* permute_impl(const char* bwname, fsdp_tensor* a, const int* perm) {
  int64_t shape[FSDP_MAX_DIMS], stride[FSDP_MAX_DIMS];
  for (int d = 0; d < a->ndim; d++) {
    shape[d] = a->shape[perm[d]];
    stride[d] = a->stride[perm[d]];
  }
  fsdp_tensor* out = fsdp_new_view(a, a->ndim, shape, stride, a->offset);
  if (!out) return NULL;
  fsdp_node* n = fsdp_node_new(bwname, permute_backward, 1, &a);
  if (n) {
    permute_params p = {{0}};
    memcpy(p.perm, perm, a->ndim * sizeof(int));
    fsdp_node_set_params(n, &p, sizeof p);
    fsdp_node_set_output(n, out);
  }
  return out;
}

fsdp_tensor* fsdp_permute(fsdp_tensor* a, int ndim, const int* dims) {
  CHECK_NULL(a, "permute: input tensor is NULL");
  CHECK_NULL(ndim == a->ndim, "permute: got %d dims for a tensor of shape %s (%d dims)", ndim, SH(a), a->ndim);
  int perm[FSDP_MAX_DIMS], seen[FSDP_MAX_DIMS] = {0};
  for (int d = 0; d < ndim; d++) {
    perm[d] = fsdp_wrap_dim("permute", dims[d], a->ndim);
    if (perm[d] < 0) return NULL;
    CHECK_NULL(!seen[perm[d]], "permute: dim %d repeats in the permutation for a tensor of shape %s", perm[d] + 1,
               SH(a));
    seen[perm[d]] = 1;
  }
  return permute_impl("PermuteBackward", a, perm);
}

fsdp_tensor* fsdp_transpose(fsdp_tensor* a, int d0, int d1) {
  CHECK_NULL(a, "transpose: input tensor is NULL");
  if (a->ndim == 0) {  // like PyTorch: dims 0 and -1 name the (absent) single dim
    if (fsdp_wrap_dim("transpose", d0, 0) < 0 || fsdp_wrap_dim("transpose", d1, 0) < 0) return NULL;
    return make_view("TransposeBackward", a, 0, a->shape, a->stride);
  }
  int x = fsdp_wrap_dim("transpose", d0, a->ndim), y = fsdp_wrap_dim("transpose", d1, a->ndim);
  if (x < 0 || y < 0) return NULL;
  int perm[FSDP_MAX_DIMS];
  for (int d = 0; d < a->ndim; d++) perm[d] = d;
  perm[x] = y;
  perm[y] = x;
  return permute_impl("TransposeBackward", a, perm);
}

// ---- squeeze / unsqueeze ---------------------------------------------------------------------------------
fsdp_tensor* fsdp_unsqueeze(fsdp_tensor* a, int dim) {
  CHECK_NULL(a, "unsqueeze: input tensor is NULL");
  CHECK_NULL(a->ndim < FSDP_MAX_DIMS, "unsqueeze: tensor of shape %s already has %d dims (the maximum)", SH(a),
             FSDP_MAX_DIMS);
  int d = fsdp_wrap_dim("unsqueeze", dim, a->ndim + 1);
  if (d < 0) return NULL;
  int64_t shape[FSDP_MAX_DIMS], stride[FSDP_MAX_DIMS];
  for (int i = 0, j = 0; i <= a->ndim; i++) {
    if (i == d) {
      shape[i] = 1;
      stride[i] = d < a->ndim ? a->stride[d] * a->shape[d] : 1;
    } else {
      shape[i] = a->shape[j];
      stride[i] = a->stride[j];
      j++;
    }
  }
  return make_view("UnsqueezeBackward", a, a->ndim + 1, shape, stride);
}

fsdp_tensor* fsdp_squeeze(fsdp_tensor* a, int dim) {
  CHECK_NULL(a, "squeeze: input tensor is NULL");
  int d = fsdp_wrap_dim("squeeze", dim, a->ndim);
  if (d < 0) return NULL;
  if (a->ndim == 0 || a->shape[d] != 1)  // PyTorch: squeezing a dim of size != 1 is a no-op
    return make_view("SqueezeBackward", a, a->ndim, a->shape, a->stride);
  int64_t shape[FSDP_MAX_DIMS], stride[FSDP_MAX_DIMS];
  for (int i = 0, j = 0; i < a->ndim; i++)
    if (i != d) {
      shape[j] = a->shape[i];
      stride[j] = a->stride[i];
      j++;
    }
  return make_view("SqueezeBackward", a, a->ndim - 1, shape, stride);
}

// ---- expand -----------------------------------------------------------------------------------------------
static int expand_backward(fsdp_node* n, fsdp_tensor* g, fsdp_tensor** gin) {
  fsdp_shape_rec p;
  fsdp_node_params(n, &p, sizeof p);
  gin[0] = fsdp_sum_to(g, p.ndim, p.shape);
  return gin[0] ? 0 : -1;
}

fsdp_tensor* fsdp_expand(fsdp_tensor* a, int ndim, const int64_t* shape) {
  CHECK_NULL(a, "expand: input tensor is NULL");
  CHECK_NULL(ndim >= a->ndim && ndim <= FSDP_MAX_DIMS,
             "expand: cannot expand a tensor of shape %s to %s (the number of sizes, %d, must be at least "
             "the tensor's %d dims)",
             SH(a), fsdp_dims_s(ndim, shape), ndim, a->ndim);
  int64_t s[FSDP_MAX_DIMS], st[FSDP_MAX_DIMS];
  int lead = ndim - a->ndim;
  for (int d = 0; d < ndim; d++) {
    int ia = d - lead;
    if (ia < 0) {
      CHECK_NULL(shape[d] >= 0,
                 "expand: size %lld is not allowed for the new leading dim %d when expanding %s "
                 "to %s",
                 (long long)shape[d], d + 1, SH(a), fsdp_dims_s(ndim, shape));
      s[d] = shape[d];
      st[d] = 0;
    } else if (shape[d] == -1 || shape[d] == a->shape[ia]) {
      s[d] = a->shape[ia];
      st[d] = a->stride[ia];
    } else {
      CHECK_NULL(a->shape[ia] == 1 && shape[d] >= 0,
                 "expand: the expanded size %lld must match the existing size %lld at dim %d (only size-1 "
                 "dims can be expanded): tensor of shape %s, target %s",
                 (long long)shape[d], (long long)a->shape[ia], d + 1, SH(a), fsdp_dims_s(ndim, shape));
      s[d] = shape[d];
      st[d] = 0;
    }
  }
  if (fsdp_shape_nbytes("expand", ndim, s, fsdp_dtype_size(a->dtype)) < 0) return NULL;
  fsdp_tensor* out = fsdp_new_view(a, ndim, s, st, a->offset);
  if (!out) return NULL;
  fsdp_node* n = fsdp_node_new("ExpandBackward", expand_backward, 1, &a);
  if (n) {
    fsdp_shape_rec p = fsdp_shape_rec_of(a);
    fsdp_node_set_params(n, &p, sizeof p);
    fsdp_node_set_output(n, out);
  }
  return out;
}

// ---- narrow -------------------------------------------------------------------------------------------------
typedef struct {
  fsdp_shape_rec in;  // the input's shape
  int dim;
  int64_t start;  // the slice's first index along dim
} narrow_params;

// The gradient is zero but for the slice. When another slice of the same tensor has already
// delivered its gradient (q, k and v cut from one qkv projection), this one is added into that
// sum's slice in place: no zero-filled full-size tensor, no full-size sum. Either way the slice goes
// in as one strided axpy over the outer rows (one kernel call, not one per row).
static int narrow_backward(fsdp_node* n, fsdp_tensor* g, fsdp_tensor** gin) {
  narrow_params p;
  fsdp_node_params(n, &p, sizeof p);
  int ndim = p.in.ndim, d = p.dim;
  int64_t start = p.start;
  fsdp_tensor** acc = n->grad_dest;
  int full_shape = acc && *acc && (*acc)->ndim == ndim;
  for (int j = 0; full_shape && j < ndim; j++) full_shape = (*acc)->shape[j] == p.in.shape[j];
  fsdp_tensor* dst;  // the full-size gradient the slice goes into
  if (full_shape && fsdp_grad_exclusive(*acc) && g->dtype == FSDP_F32) {
    dst = *acc;
  } else {
    dst = fsdp_full(ndim, p.in.shape, 0.0, FSDP_F32, fsdp_device_of(g));
    if (!dst) return -1;
    gin[0] = dst;
  }
  if (g->dtype != FSDP_F32) {  // converts while copying into the zeros
    copy_into_slice(dst, d, start, g);
    return 0;
  }
  fsdp_tensor* gc = fsdp_as_contig(g);
  if (!gc) return -1;
  // dst (outer, size, inner)[:, start:start+len, :] += g (outer, len, inner): rows of len*inner
  int64_t outer = prod(g->shape, 0, d), run = prod(g->shape, d, ndim), size = p.in.shape[d];
  int64_t inner = prod(g->shape, d + 1, ndim);
  fsdp_backend_of(gc)->elem->axpy(fsdp_f32(dst) + start * inner, size * inner, fsdp_f32(gc), run, outer, run, 1.0f);
  fsdp_tensor_release(gc);
  return 0;
}

fsdp_tensor* fsdp_narrow(fsdp_tensor* a, int dim, int64_t start, int64_t length) {
  CHECK_NULL(a, "narrow: input tensor is NULL");
  CHECK_NULL(a->ndim > 0, "narrow: cannot narrow a 0-dim tensor");
  int d = fsdp_wrap_dim("narrow", dim, a->ndim);
  if (d < 0) return NULL;
  CHECK_NULL(start >= 0 && length >= 0 && start <= a->shape[d] && length <= a->shape[d] - start,
             "narrow: start %lld (1-based) with length %lld is out of bounds for dim %d of size %lld in a tensor "
             "of shape %s",
             (long long)start + 1, (long long)length, d + 1, (long long)a->shape[d], SH(a));
  int64_t shape[FSDP_MAX_DIMS];
  memcpy(shape, a->shape, sizeof shape);
  shape[d] = length;
  fsdp_tensor* out = fsdp_new_view(a, a->ndim, shape, a->stride, a->offset + start * a->stride[d]);
  if (!out) return NULL;
  fsdp_node* n = fsdp_node_new("NarrowBackward", narrow_backward, 1, &a);
  if (n) {
    narrow_params p = {.in = fsdp_shape_rec_of(a), .dim = d, .start = start};
    fsdp_node_set_params(n, &p, sizeof p);
    fsdp_node_set_output(n, out);
  }
  return out;
}

// ---- cat ----------------------------------------------------------------------------------------------------
typedef struct {
  int dim;
  int64_t sizes[FSDP_NODE_MAX_INPUTS];  // of the inputs along dim
} cat_params;

static int cat_backward(fsdp_node* n, fsdp_tensor* g, fsdp_tensor** gin) {
  cat_params p;
  fsdp_node_params(n, &p, sizeof p);
  int64_t start = 0;
  for (int k = 0; k < n->n_inputs; k++) {
    int64_t len = p.sizes[k];
    if (n->needs_grad[k]) {
      gin[k] = fsdp_narrow(g, p.dim, start, len);
      if (!gin[k]) return -1;
    }
    start += len;
  }
  return 0;
}

fsdp_tensor* fsdp_cat(int n, fsdp_tensor** ts, int dim) {
  CHECK_NULL(n > 0 && ts, "cat: expected a non-empty list of tensors");
  for (int k = 0; k < n; k++) CHECK_NULL(ts[k], "cat: tensor %d of %d is NULL", k + 1, n);
  const fsdp_tensor* t0 = ts[0];
  CHECK_NULL(t0->ndim > 0, "cat: zero-dimensional tensor (tensor 0, shape %s) cannot be concatenated", SH(t0));
  int d = fsdp_wrap_dim("cat", dim, t0->ndim);
  if (d < 0) return NULL;
  int64_t shape[FSDP_MAX_DIMS];
  memcpy(shape, t0->shape, sizeof shape);
  shape[d] = 0;
  for (int k = 0; k < n; k++) {
    const fsdp_tensor* t = ts[k];
    CHECK_NULL(t->ndim == t0->ndim && t->dtype == t0->dtype && fsdp_device_of(t) == fsdp_device_of(t0),
               "cat: tensor %d (%s %s) does not match tensor 1 (%s %s) in number of dims, dtype or device", k + 1,
               DT(t), SH(t), DT(t0), SH(t0));
    for (int j = 0; j < t0->ndim; j++)
      CHECK_NULL(j == d || t->shape[j] == t0->shape[j],
                 "cat: sizes must match except in dim %d, but tensor %d has shape %s and tensor 1 has %s", d + 1, k + 1,
                 SH(t), SH(t0));
    shape[d] += t->shape[d];
  }
  // a node holds at most FSDP_NODE_MAX_INPUTS inputs: cat long lists that need grad in chunks
  if (n > FSDP_NODE_MAX_INPUTS && fsdp_is_grad_enabled()) {
    int any = 0;
    for (int k = 0; k < n; k++) any |= ts[k]->requires_grad;
    if (any) {
      fsdp_tensor* head = fsdp_cat(FSDP_NODE_MAX_INPUTS, ts, d);
      if (!head) return NULL;
      fsdp_tensor* rest[FSDP_NODE_MAX_INPUTS];
      fsdp_tensor* acc = head;
      for (int k = FSDP_NODE_MAX_INPUTS; k < n && acc; k += FSDP_NODE_MAX_INPUTS - 1) {
        int m = n - k < FSDP_NODE_MAX_INPUTS - 1 ? n - k : FSDP_NODE_MAX_INPUTS - 1;
        rest[0] = acc;
        for (int j = 0; j < m; j++) rest[1 + j] = ts[k + j];
        fsdp_tensor* next = fsdp_cat(m + 1, rest, d);
        fsdp_tensor_release(acc);
        acc = next;
      }
      return acc;
    }
  }
  fsdp_tensor* out = fsdp_new(t0->ndim, shape, t0->dtype, fsdp_device_of(t0));
  if (!out) return NULL;
  int64_t start = 0;
  for (int k = 0; k < n; k++) {
    copy_into_slice(out, d, start, ts[k]);
    start += ts[k]->shape[d];
  }
  fsdp_node* node = fsdp_node_new("CatBackward", cat_backward, n, ts);
  if (node) {
    cat_params p = {.dim = d};
    for (int k = 0; k < n; k++) p.sizes[k] = ts[k]->shape[d];
    fsdp_node_set_params(node, &p, sizeof p);
    fsdp_node_set_output(node, out);
  }
  return out;
}

// ---- index_select -------------------------------------------------------------------------------------------
// saved[0] = index (contiguous i64)
typedef struct {
  fsdp_shape_rec in;  // the input's shape
  int dim;
} index_select_params;

static int index_select_backward(fsdp_node* n, fsdp_tensor* g, fsdp_tensor** gin) {
  fsdp_tensor* idx = fsdp_node_saved(n, 0);
  if (!idx) return -1;
  index_select_params p;
  fsdp_node_params(n, &p, sizeof p);
  int ndim = p.in.ndim, d = p.dim;
  const int64_t* in_shape = p.in.shape;
  fsdp_tensor* gx = fsdp_full(ndim, in_shape, 0.0, FSDP_F32, fsdp_device_of(g));
  fsdp_tensor* gc = fsdp_as_contig(g);
  if (!gx || !gc) {
    fsdp_tensor_release(gx);
    fsdp_tensor_release(gc);
    return -1;
  }
  fsdp_backend_of(gx)->elem->index_add(fsdp_f32(gx), fsdp_f32(gc), fsdp_i64(idx), prod(in_shape, 0, d), in_shape[d],
                                       fsdp_tensor_numel(idx), prod(in_shape, d + 1, ndim));
  fsdp_tensor_release(gc);
  gin[0] = gx;
  return 0;
}

fsdp_tensor* fsdp_index_select(fsdp_tensor* a, int dim, fsdp_tensor* index) {
  CHECK_NULL(a && index, "index_select: input or index tensor is NULL");
  CHECK_NULL(index->dtype == FSDP_I64 && index->ndim <= 1,
             "index_select: index must be a 0-dim or 1-dim int64 tensor, got %s of shape %s (input %s)", DT(index),
             SH(index), SH(a));
  if (fsdp_check_same_device("index_select", a, index)) return NULL;
  CHECK_NULL(a->ndim > 0, "index_select: input must have at least one dim (got a 0-dim %s tensor)", DT(a));
  int d = fsdp_wrap_dim("index_select", dim, a->ndim);
  if (d < 0) return NULL;
  CHECK_NULL(!a->requires_grad || fsdp_is_float(a->dtype) || !fsdp_is_grad_enabled(),
             "index_select: gradients are only supported for float inputs (got %s of shape %s)", DT(a), SH(a));
  int nd = a->ndim;
  const int64_t* in_shape = a->shape;
  const fsdp_elem_kernels* k = fsdp_backend_of(a)->elem;
  fsdp_tensor* idx = contig_same_dtype(index);
  if (!idx) return NULL;
  int64_t m = fsdp_tensor_numel(idx);
  // on an async device the check runs there and a bad index fails the next synchronization
  int check = fsdp_backend_of(a)->async
                  ? fsdp_check_defer("index_select: index %%lld is out of range for dim %d of size %lld in a tensor of "
                                     "shape %s (found on the device)",
                                     d + 1, (long long)in_shape[d], SH(a))
                  : 0;
  int64_t bad = k->index_check(fsdp_i64(idx), m, 0, in_shape[d], check);
  if (bad >= 0) {
    fsdp_errorf("index_select: index %lld (at position %lld) is out of range for dim %d of size %lld in a tensor "
                "of shape %s",  // (dims and positions 1-based, as the user counts them; index values 0-based)
                (long long)fsdp_i64(idx)[bad], (long long)bad + 1, d + 1, (long long)in_shape[d], SH(a));
    fsdp_tensor_release(idx);
    return NULL;
  }
  fsdp_tensor* ac = contig_same_dtype(a);
  int64_t shape[FSDP_MAX_DIMS];
  memcpy(shape, in_shape, sizeof shape);
  shape[d] = m;
  fsdp_tensor* out = ac ? fsdp_new(nd, shape, a->dtype, fsdp_device_of(a)) : NULL;
  if (!out) {
    fsdp_tensor_release(idx);
    fsdp_tensor_release(ac);
    return NULL;
  }
  k->index_select(fsdp_ptr(out), fsdp_ptr(ac), fsdp_dtype_size(a->dtype), fsdp_i64(idx), prod(in_shape, 0, d),
                  in_shape[d], m, prod(in_shape, d + 1, nd));
  fsdp_tensor_release(ac);
  fsdp_node* n = fsdp_node_new("IndexSelectBackward", index_select_backward, 1, &a);
  if (n) {
    fsdp_node_save(n, idx);
    index_select_params p = {.in = fsdp_shape_rec_of(a), .dim = d};
    fsdp_node_set_params(n, &p, sizeof p);
    fsdp_node_set_output(n, out);
  }
  fsdp_tensor_release(idx);
  return out;
}

// ---- device moves and dtype casts: one backward, the gradient copied back to the input's ----------
typedef struct {
  int dtype, device;  // the input's: the gradient goes back to them
} to_copy_params;

static int to_copy_backward(fsdp_node* n, fsdp_tensor* g, fsdp_tensor** gin) {
  to_copy_params p;
  fsdp_node_params(n, &p, sizeof p);
  fsdp_tensor* r = fsdp_new(g->ndim, g->shape, p.dtype, p.device);
  if (!r) return -1;
  if (fsdp_copy_strided(r, g)) {  // (converts and moves at once)
    fsdp_tensor_release(r);
    return -1;
  }
  gin[0] = r;
  return 0;
}
static void to_copy_node(fsdp_tensor* a, fsdp_tensor* out) {
  fsdp_node* n = fsdp_node_new("ToCopyBackward", to_copy_backward, 1, &a);
  if (n) {
    fsdp_node_set_params(n, &(to_copy_params){.dtype = a->dtype, .device = fsdp_device_of(a)}, sizeof(to_copy_params));
    fsdp_node_set_output(n, out);
  }
}

fsdp_tensor* fsdp_to_device(fsdp_tensor* a, int device) {
  CHECK_NULL(a, "to: input tensor is NULL");
  CHECK_NULL(device >= 0 && device < FSDP_NDEVICES, "to: unknown device %d (tensor %s %s)", device, DT(a), SH(a));
  if (device == fsdp_device_of(a)) {  // already there: a itself, as in PyTorch
    fsdp_tensor_retain(a);
    return a;
  }
  if (fsdp_check_data("to", a)) return NULL;
  fsdp_tensor* out = fsdp_copy_to_device(a, device);
  if (!out) return NULL;
  if (fsdp_is_float(a->dtype)) to_copy_node(a, out);
  return out;
}

// PyTorch's Tensor.pin_memory: the copy is differentiable as a move is (its gradient goes back as is)
fsdp_tensor* fsdp_pin_memory(fsdp_tensor* a) {
  CHECK_NULL(a, "pin_memory: input tensor is NULL");
  CHECK_NULL(fsdp_device_of(a) == FSDP_CPU, "pin_memory: only CPU tensors can be pinned (tensor %s %s is on %s)", DT(a),
             SH(a), fsdp_device_name(fsdp_device_of(a)));
  if (fsdp_is_pinned(a)) {  // already pinned: a itself, as in PyTorch
    fsdp_tensor_retain(a);
    return a;
  }
  if (fsdp_check_data("pin_memory", a)) return NULL;
  fsdp_tensor* out = fsdp_new_pinned(a->ndim, a->shape, a->dtype);
  if (!out) return NULL;
  if (fsdp_copy_strided(out, a)) {
    fsdp_tensor_release(out);
    return NULL;
  }
  if (fsdp_is_float(a->dtype)) to_copy_node(a, out);
  return out;
}

fsdp_tensor* fsdp_to_dtype(fsdp_tensor* a, int dtype) {
  CHECK_NULL(a, "to: input tensor is NULL");
  CHECK_NULL(dtype >= 0 && dtype < FSDP_NDTYPES, "to: unknown dtype %d (tensor %s %s)", dtype, DT(a), SH(a));
  if (dtype == a->dtype) {
    fsdp_tensor_retain(a);
    return a;
  }
  if (fsdp_check_int_convert("to", a, dtype)) return NULL;
  fsdp_tensor* out = fsdp_new(a->ndim, a->shape, dtype, fsdp_device_of(a));
  if (!out) return NULL;
  if (fsdp_copy_strided(out, a)) {
    fsdp_tensor_release(out);
    return NULL;
  }
  if (fsdp_is_float(dtype)) to_copy_node(a, out);  // integer and bool outputs never require grad
  return out;
}
