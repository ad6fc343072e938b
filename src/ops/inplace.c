/*
 * ops/inplace.c -- in-place writes outside autograd: fill_, copy_ (broadcasting the source),
 * add_, mul_ (a scalar), and set_dtype_ (a leaf's dtype changed in place, for Module:to(dtype)). Each bumps the storage's version, so autograd notices a saved tensor
 * that changed. Each refuses a destination two of whose elements share memory (an expand()ed
 * view), as PyTorch does. A source that overlaps the destination in memory (a:copy_(a:t()), a shifted view
 * added into its own tensor) is copied to a temporary first, as PyTorch does. add_ and mul_ on a
 * bfloat16 (or float16) tensor compute in float32 and round each element back once.
 */
#include "ops/ops.h"

// whether two of t's elements are one memory location (an expand()ed view: stride 0 on a dim of
// size > 1). Conservative: t's dims of size > 1, by increasing |stride|, must each step past the
// reach of the dims below (their (size - 1) * |stride| summed); every view narrow, transpose,
// permute, select, unsqueeze and expand make passes or fails as its elements really do
static bool self_overlaps(const fsdp_tensor* t) {
  if (fsdp_tensor_numel(t) < 2 || fsdp_tensor_is_contiguous(t)) return false;
  int64_t stride[FSDP_MAX_DIMS], size[FSDP_MAX_DIMS];
  int n = 0;
  for (int i = 0; i < t->ndim; i++) {
    if (t->shape[i] == 1) continue;
    int64_t s = t->stride[i] < 0 ? -t->stride[i] : t->stride[i];
    int j = n++;
    for (; j > 0 && stride[j - 1] > s; j--) {  // (insertion sort: at most FSDP_MAX_DIMS dims)
      stride[j] = stride[j - 1];
      size[j] = size[j - 1];
    }
    stride[j] = s;
    size[j] = t->shape[i];
  }
  int64_t reach = 0;
  for (int i = 0; i < n; i++) {
    if (stride[i] <= reach) return true;
    reach += stride[i] * (size[i] - 1);
  }
  return false;
}

// what every in-place write into t checks first: autograd's leaf rule, and that each element of t
// is its own memory location (PyTorch refuses to write an expand()ed view too)
static int check_inplace(const char* op, const fsdp_tensor* t) {
  CHECK_INT(!(fsdp_is_grad_enabled() && t->requires_grad && !t->grad_fn),
            "%s: a leaf tensor of shape %s that requires grad is used in an in-place operation "
            "(wrap it in fsdp.no_grad)",
            op, SH(t));
  CHECK_INT(!self_overlaps(t),
            "%s: more than one element of the tensor of shape %s (strides %s) refers to a single memory location "
            "(an expand()ed view?), so writing it in place is ambiguous; clone() it first",
            op, SH(t), fsdp_dims_s(t->ndim, t->stride));
  return 0;
}

// PyTorch's copy_ broadcasts src to dst's shape and nothing else: src's dims align to dst's from
// the right, each of dst's size or 1 (a src of dst's element count but another shape is an error,
// not a reshape)
static int check_broadcasts_to(const char* op, const fsdp_tensor* src, const fsdp_tensor* dst) {
  CHECK_INT(src->ndim <= dst->ndim, "%s: src of shape %s has more dims than the destination, of shape %s", op, SH(src),
            SH(dst));
  int lead = dst->ndim - src->ndim;
  for (int d = lead; d < dst->ndim; d++) {
    int64_t s = src->shape[d - lead];
    CHECK_INT(s == 1 || s == dst->shape[d],
              "%s: src of shape %s does not broadcast to the destination's shape %s: dim %d has size %lld in src, "
              "%lld in the destination (only a size-1 dim broadcasts)",
              op, SH(src), SH(dst), d + 1, (long long)s, (long long)dst->shape[d]);
  }
  return 0;
}

// The byte range [*lo, *hi) of t's storage its elements lie in (t has elements; views are checked
// to fit their storage when made, so nothing here overflows).
static void byte_range(const fsdp_tensor* t, int64_t* lo, int64_t* hi) {
  int64_t first = t->offset;
  int64_t last = first;
  for (int i = 0; i < t->ndim; i++) {
    int64_t span = (t->shape[i] - 1) * t->stride[i];
    if (span >= 0) last += span;
    else first += span;
  }
  int64_t es = (int64_t)fsdp_dtype_size(t->dtype);
  *lo = first * es;
  *hi = (last + 1) * es;
}
// whether writing dst element by element could change src elements not yet read: they share a
// storage and their byte ranges intersect (conservative), and src is not dst's very layout (where
// each element reads only itself)
static bool overlaps(const fsdp_tensor* dst, const fsdp_tensor* src) {
  if (dst->storage != src->storage) return false;
  if (fsdp_tensor_numel(dst) == 0 || fsdp_tensor_numel(src) == 0) return false;
  bool same_view = dst->dtype == src->dtype && dst->offset == src->offset && fsdp_same_shape(dst, src) &&
                   memcmp(dst->stride, src->stride, dst->ndim * sizeof(int64_t)) == 0;
  if (same_view) return false;
  int64_t dlo, dhi, slo, shi;
  byte_range(dst, &dlo, &dhi);
  byte_range(src, &slo, &shi);
  return dlo < shi && slo < dhi;
}
// src (a new reference) or, when it overlaps dst, a contiguous copy of it made before dst is written
// (PyTorch's behaviour for in-place ops on overlapping memory)
static fsdp_tensor* unaliased(const fsdp_tensor* dst, fsdp_tensor* src) {
  if (!overlaps(dst, src)) {
    fsdp_tensor_retain(src);
    return src;
  }
  fsdp_tensor* tmp = fsdp_new(src->ndim, src->shape, src->dtype, fsdp_device_of(src));
  if (tmp && fsdp_copy_strided(tmp, src)) {
    fsdp_tensor_release(tmp);
    return NULL;
  }
  return tmp;
}

int fsdp_fill_(fsdp_tensor* t, double value) {
  if (check_inplace("fill_", t) || fsdp_check_int_value("fill_", "value", value, t->dtype)) return -1;
  if (t->storage->meta) return fsdp_meta_record(t, FSDP_STEP_FILL, value, 0, 0, NULL);
  if (fsdp_tensor_is_contiguous(t)) {
    fsdp_backend_of(t)->elem->fill(fsdp_ptr(t), t->dtype, fsdp_tensor_numel(t), value);
  } else {
    int64_t one = 1;
    fsdp_tensor* v = fsdp_full(1, &one, value, t->dtype, fsdp_device_of(t));
    if (!v) return -1;
    fsdp_tensor* e = fsdp_new_view(v, t->ndim, t->shape, (int64_t[FSDP_MAX_DIMS]){0}, 0);
    int rc = e ? fsdp_copy_strided(t, e) : -1;
    fsdp_tensor_release(e);
    fsdp_tensor_release(v);
    if (rc) return rc;
  }
  fsdp_bump_version(t);
  return 0;
}
int fsdp_copy_(fsdp_tensor* dst, fsdp_tensor* src) {  // (across devices too, as PyTorch's)
  if (check_inplace("copy_", dst) || check_broadcasts_to("copy_", src, dst) ||
      fsdp_check_int_convert("copy_", src, dst->dtype))
    return -1;
  if (dst->storage->meta && !src->storage->meta) return fsdp_meta_record(dst, FSDP_STEP_COPY, 0, 0, 0, src);
  if (fsdp_check_data("copy_", dst)) return -1;
  if (!src->storage->data && src->storage->source.read && fsdp_tensor_is_contiguous(src) &&
      fsdp_tensor_is_contiguous(dst) && fsdp_tensor_numel(src) == fsdp_tensor_numel(dst)) {
    // from a file: only the elements copied are read, a chunk at a time (a rank's piece of a parameter)
    int64_t n = fsdp_tensor_numel(dst), one = 1;
    fsdp_tensor* flat = fsdp_new_view(dst, 1, &n, &one, dst->offset);
    int rc = flat ? fsdp_read_range(src, 0, n, flat) : -1;
    fsdp_tensor_release(flat);
    if (!rc) fsdp_bump_version(dst);
    return rc;
  }
  if (fsdp_check_data("copy_", src)) return -1;
  fsdp_tensor* s = src;
  fsdp_tensor* b = NULL;
  if (!fsdp_same_shape(dst, src)) {
    b = fsdp_expand(s, dst->ndim, dst->shape);  // broadcast src to dst's shape (checked above)
    if (!b) return -1;
    s = b;
  }
  fsdp_tensor* u = unaliased(dst, s);
  int rc = u ? fsdp_copy_strided(dst, u) : -1;
  fsdp_tensor_release(u);
  fsdp_tensor_release(b);
  if (!rc) fsdp_bump_version(dst);
  return rc;
}
int fsdp_add_(fsdp_tensor* t, fsdp_tensor* other, double alpha) {
  if (check_inplace("add_", t)) return -1;
  if (fsdp_check_float("add_", t) || fsdp_check_float("add_", other) || fsdp_check_same_device("add_", t, other))
    return -1;
  CHECK_INT(fsdp_same_shape(t, other), "add_: shapes %s and %s differ", SH(t), SH(other));
  CHECK_INT(fsdp_tensor_is_contiguous(t), "add_: destination of shape %s is not contiguous", SH(t));
  fsdp_tensor* u = unaliased(t, other);
  if (!u) return -1;
  fsdp_tensor* o = fsdp_as_contig(u);
  fsdp_tensor_release(u);
  fsdp_tensor* w = o ? fsdp_as_contig(t) : NULL;
  if (!w) {
    fsdp_tensor_release(o);
    return -1;
  }
  int64_t n = fsdp_tensor_numel(t);
  fsdp_backend_of(t)->elem->axpy(fsdp_f32(w), n, fsdp_f32(o), n, 1, n, (float)alpha);
  fsdp_tensor_release(o);
  if (fsdp_write_back(t, w)) return -1;
  fsdp_bump_version(t);
  return 0;
}
int fsdp_add_scalar_(fsdp_tensor* t, double v) {
  if (check_inplace("add_", t)) return -1;
  CHECK_INT(fsdp_is_float(t->dtype), "add_: expected a float tensor (float32, bfloat16 or float16), got %s of shape %s",
            DT(t), SH(t));
  if (t->storage->meta) {  // (refusing what add_ refuses)
    CHECK_INT(fsdp_tensor_is_contiguous(t), "add_: destination of shape %s is not contiguous", SH(t));
    return fsdp_meta_record(t, FSDP_STEP_ADD, v, 0, 0, NULL);
  }
  int64_t one = 1;  // t += a tensor full of v: one element, broadcast (stride 0)
  fsdp_tensor* c = fsdp_full(1, &one, v, t->dtype, fsdp_device_of(t));
  fsdp_tensor* e = c ? fsdp_new_view(c, t->ndim, t->shape, (int64_t[FSDP_MAX_DIMS]){0}, 0) : NULL;
  int rc = e ? fsdp_add_(t, e, 1.0) : -1;
  fsdp_tensor_release(e);
  fsdp_tensor_release(c);
  return rc;
}
int fsdp_mul_scalar_(fsdp_tensor* t, double s) {
  if (check_inplace("mul_", t)) return -1;
  if (t->storage->meta && fsdp_is_float(t->dtype)) {
    CHECK_INT(fsdp_tensor_is_contiguous(t), "mul_: tensor of shape %s is not contiguous", SH(t));
    return fsdp_meta_record(t, FSDP_STEP_MUL, s, 0, 0, NULL);
  }
  if (fsdp_check_float("mul_", t)) return -1;
  CHECK_INT(fsdp_tensor_is_contiguous(t), "mul_: tensor of shape %s is not contiguous", SH(t));
  fsdp_tensor* w = fsdp_as_contig(t);
  if (!w) return -1;
  fsdp_backend_of(t)->elem->scale(fsdp_f32(w), fsdp_tensor_numel(t), (float)s);
  if (fsdp_write_back(t, w)) return -1;
  fsdp_bump_version(t);
  return 0;
}

// t's bytes replaced by a contiguous copy of its values in dtype on device (the same tensor object,
// as PyTorch's module.to keeps its parameters; the copy converts and moves at once)
static int restorage(fsdp_tensor* t, int dtype, int device) {
  fsdp_tensor* c = fsdp_new_cat(t->ndim, t->shape, dtype, device, t->storage->cat);
  if (!c || fsdp_copy_strided(c, t)) {
    fsdp_tensor_release(c);
    return -1;
  }
  c->storage->refcount++;
  fsdp_storage_release(t->storage);
  t->storage = c->storage;
  t->dtype = dtype;
  t->offset = 0;
  fsdp_contiguous_strides(t->ndim, t->shape, t->stride);
  fsdp_tensor_release(c);
  return 0;
}
int fsdp_set_device_(fsdp_tensor* t, int device) {
  const char* op = "to";
  CHECK_INT(device >= 0 && device < FSDP_NDEVICES, "%s: unknown device %d (tensor of shape %s)", op, device, SH(t));
  CHECK_INT(!t->grad_fn, "%s: the tensor of shape %s comes from %s; only leaves move in place", op, SH(t),
            t->grad_fn ? t->grad_fn->name : "");
  CHECK_INT(!t->owner, "%s: the tensor of shape %s is a parameter of an FSDP unit; move the module before fsdp.wrap",
            op, SH(t));
  if (fsdp_device_of(t) == device) return 0;
  if (t->storage->meta) {  // no values yet: they will be materialised there
    CHECK_INT(fsdp_backend_for(device), "%s: no backend for device %s", op, fsdp_device_name(device));
    t->storage->device = device;
    return 0;
  }
  if (fsdp_check_data(op, t) || restorage(t, t->dtype, device)) return -1;
  if (t->grad && fsdp_device_of(t->grad) != device && restorage(t->grad, t->grad->dtype, device)) return -1;
  return 0;
}

int fsdp_set_dtype_(fsdp_tensor* t, int dtype) {
  const char* op = "to";
  CHECK_INT(dtype >= 0 && dtype < FSDP_NDTYPES && fsdp_is_float(dtype) && fsdp_is_float(t->dtype),
            "%s: only float tensors change dtype in place (%s of shape %s to %s)", op, DT(t), SH(t),
            fsdp_dtype_name(dtype));
  CHECK_INT(!t->grad_fn, "%s: the tensor of shape %s comes from %s; only leaves change dtype in place", op, SH(t),
            t->grad_fn ? t->grad_fn->name : "");
  CHECK_INT(!t->owner,
            "%s: the tensor of shape %s is a parameter of an FSDP unit; convert the module before fsdp.wrap, or "
            "compute in %s with mixed_precision = {param = \"%s\"}",
            op, SH(t), fsdp_dtype_name(dtype), fsdp_dtype_name(dtype));
  if (t->dtype == dtype) return 0;
  if (fsdp_check_data(op, t) || restorage(t, dtype, fsdp_device_of(t))) return -1;
  if (t->grad && t->grad->dtype != dtype) {  // the gradient follows, as in PyTorch
    fsdp_tensor* g = fsdp_as_contig_dtype(t->grad, dtype);
    if (!g) return -1;
    fsdp_tensor_set_mem_category(g, FSDP_MEM_GRADS);
    fsdp_tensor_release(t->grad);
    t->grad = g;
  }
  return 0;
}
