/*
 * ops/inplace.c -- in-place writes outside autograd: fill_, copy_ (broadcasting the source),
 * add_, mul_ (a scalar). Each bumps the storage's version, so autograd notices a saved tensor
 * that changed.
 */
#include "ops/ops.h"

static int check_inplace(const char* op, const fsdp_tensor* t) {
  CHECK_INT(!(fsdp_is_grad_enabled() && t->requires_grad && !t->grad_fn),
            "%s: a leaf tensor of shape %s that requires grad is used in an in-place operation "
            "(wrap it in fsdp.no_grad)",
            op, SH(t));
  return 0;
}
int fsdp_fill_(fsdp_tensor* t, double value) {
  if (check_inplace("fill_", t)) return -1;
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
int fsdp_copy_(fsdp_tensor* dst, fsdp_tensor* src) {
  if (check_inplace("copy_", dst)) return -1;
  if (fsdp_check_same_device("copy_", dst, src)) return -1;
  fsdp_tensor* s = src;
  fsdp_tensor* b = NULL;
  if (!fsdp_same_shape(dst, src) && fsdp_tensor_numel(dst) != fsdp_tensor_numel(src)) {
    b = fsdp_expand(s, dst->ndim, dst->shape);  // broadcast src to dst's shape
    if (!b) {
      fsdp_errorf("copy_: cannot copy %s into %s", SH(src), SH(dst));
      return -1;
    }
    s = b;
  }
  int rc = fsdp_copy_strided(dst, s);
  fsdp_tensor_release(b);
  if (!rc) fsdp_bump_version(dst);
  return rc;
}
int fsdp_add_(fsdp_tensor* t, fsdp_tensor* other, double alpha) {
  if (check_inplace("add_", t)) return -1;
  if (fsdp_check_f32("add_", t) || fsdp_check_same_device("add_", t, other)) return -1;
  CHECK_INT(fsdp_same_shape(t, other), "add_: shapes %s and %s differ", SH(t), SH(other));
  CHECK_INT(fsdp_tensor_is_contiguous(t), "add_: destination of shape %s is not contiguous", SH(t));
  fsdp_tensor* o = fsdp_as_contig(other);
  if (!o) return -1;
  int64_t n = fsdp_tensor_numel(t);
  fsdp_backend_of(t)->elem->axpy(fsdp_f32(t), n, fsdp_f32(o), n, 1, n, (float)alpha);
  fsdp_tensor_release(o);
  fsdp_bump_version(t);
  return 0;
}
int fsdp_mul_scalar_(fsdp_tensor* t, double s) {
  if (check_inplace("mul_", t) || fsdp_check_f32("mul_", t)) return -1;
  CHECK_INT(fsdp_tensor_is_contiguous(t), "mul_: tensor of shape %s is not contiguous", SH(t));
  fsdp_backend_of(t)->elem->scale(fsdp_f32(t), fsdp_tensor_numel(t), (float)s);
  fsdp_bump_version(t);
  return 0;
}
