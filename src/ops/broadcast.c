/*
 * ops/broadcast.c -- broadcasting: the shape two operands broadcast to, an operand's strides over
 * that shape (0 on broadcast dims), and the reverse for gradients (sum_to).
 */
#include "ops/ops.h"

int fsdp_broadcast_shape(const char* op, const fsdp_tensor* a, const fsdp_tensor* b, int* ndim, int64_t* shape) {
  int n = a->ndim > b->ndim ? a->ndim : b->ndim;
  for (int i = 0; i < n; i++) {
    int ia = a->ndim - n + i, ib = b->ndim - n + i;
    int64_t sa = ia >= 0 ? a->shape[ia] : 1, sb = ib >= 0 ? b->shape[ib] : 1;
    CHECK_INT(sa == sb || sa == 1 || sb == 1, "%s: shapes %s and %s cannot be broadcast (dim %d: %lld vs %lld)", op,
              SH(a), SH(b), i + 1, (long long)sa, (long long)sb);
    shape[i] = sa == 1 ? sb : sa;
  }
  *ndim = n;
  return 0;
}
void fsdp_broadcast_strides(const fsdp_tensor* t, int ndim, const int64_t* shape, int64_t* stride) {
  for (int i = 0; i < ndim; i++) {
    int it = t->ndim - ndim + i;
    stride[i] = (it < 0 || (t->shape[it] == 1 && shape[i] != 1)) ? 0 : t->stride[it];
  }
}
fsdp_tensor* fsdp_sum_to(fsdp_tensor* grad, int ndim, const int64_t* shape) {
  if (grad->ndim == ndim && memcmp(grad->shape, shape, ndim * sizeof *shape) == 0) {
    fsdp_tensor_retain(grad);
    return grad;
  }
  int dims[FSDP_MAX_DIMS], nd = 0, lead = grad->ndim - ndim;
  for (int i = 0; i < grad->ndim; i++) {
    int il = i - lead;
    if (il < 0 || (shape[il] == 1 && grad->shape[i] != 1)) dims[nd++] = i;
  }
  int prev = fsdp_is_grad_enabled();
  fsdp_set_grad_enabled(0);
  fsdp_tensor* s = nd ? fsdp_sum(grad, nd, dims, 1) : (fsdp_tensor_retain(grad), grad);
  fsdp_tensor* r = s ? fsdp_reshape(s, ndim, shape) : NULL;
  fsdp_set_grad_enabled(prev);
  fsdp_tensor_release(s);
  return r;
}
