/*
 * ops/dtype.c -- the dtype of an op's result and the check of ops that refuse mixed dtypes (see
 * ops/ops.h, "float dtypes", for how bfloat16 runs through the float32 kernels).
 */
#include "ops/ops.h"

int fsdp_result_dtype(const fsdp_tensor* a, const fsdp_tensor* b) {
  if (!b || a->dtype == b->dtype) return a->dtype;
  if (a->ndim > 0 && b->ndim == 0) return a->dtype;  // PyTorch: a 0-dim tensor does not promote one
  if (a->ndim == 0 && b->ndim > 0) return b->dtype;  // with dims of the same kind (both floats)
  return FSDP_F32;
}

int fsdp_check_same_dtype(const char* op, const char* what_a, const fsdp_tensor* a, const char* what_b,
                          const fsdp_tensor* b) {
  CHECK_INT(!b || a->dtype == b->dtype,
            "%s: %s %s %s and %s %s %s have different dtypes (convert one with :to(\"%s\") or :to(\"%s\"))", op, what_a,
            DT(a), SH(a), what_b, DT(b), SH(b), DT(a), DT(b));
  return 0;
}
