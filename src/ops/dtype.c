/*
 * ops/dtype.c -- the dtype of an op's result, the check of ops that refuse mixed dtypes (see
 * ops/ops.h, "float dtypes", for how bfloat16 runs through the float32 kernels), and the check of
 * values that become int64 (ops/ops.h, "values into int64").
 */
#include "ops/ops.h"

#include <math.h>

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

// ---- values into int64 ------------------------------------------------------------------------------
// v truncated toward zero lands in [-2^63, 2^63) (NaN and inf do not: C leaves them undefined)
static bool fits_int64(double v) {
  const double two_63 = 9223372036854775808.0;  // 2^63, exact in a double
  return v >= -two_63 && v < two_63;
}
// v as printed in a message: every NaN as "nan" (0/0 is a negative one on x86, printed "-nan")
static double shown(double v) { return v == v ? v : NAN; }

int fsdp_check_int_value(const char* op, const char* what, double v, int dtype) {
  CHECK_INT(dtype != FSDP_I64 || fits_int64(v), "%s: %s %.15g does not fit in int64 (integers from -2^63 to 2^63-1)",
            op, what, shown(v));
  return 0;
}

int fsdp_check_int_values(const char* op, int64_t n, const double* v, int dtype) {
  int64_t i = 0;
  while (dtype == FSDP_I64 && i < n && fits_int64(v[i])) i++;
  CHECK_INT(dtype != FSDP_I64 || i == n,
            "%s: element %lld = %.15g does not fit in int64 (integers from -2^63 to 2^63-1)", op, (long long)i + 1,
            shown(v[i]));
  return 0;
}

int fsdp_check_int_convert(const char* op, fsdp_tensor* src, int dtype) {
  if (dtype != FSDP_I64 || !fsdp_is_float(src->dtype) || fsdp_tensor_numel(src) == 0) return 0;
  if (fsdp_check_data(op, src)) return -1;
  // a contiguous host copy (src itself when it is one), read in row-major order
  fsdp_tensor* h =
      fsdp_device_of(src) == FSDP_CPU ? fsdp_as_contig_dtype(src, src->dtype) : fsdp_copy_to_device(src, FSDP_CPU);
  if (!h) return -1;
  const char* p = fsdp_ptr(h);
  size_t es = fsdp_dtype_size(h->dtype);
  int64_t n = fsdp_tensor_numel(h), i = 0;
  while (i < n && fits_int64(fsdp_load_elem(p + i * (int64_t)es, h->dtype))) i++;
  double v = i < n ? fsdp_load_elem(p + i * (int64_t)es, h->dtype) : 0;
  fsdp_tensor_release(h);
  CHECK_INT(i == n,
            "%s: element %lld (1-based, row-major) of the %s tensor of shape %s is %.9g, which does not fit in int64 "
            "(integers from -2^63 to 2^63-1)",
            op, (long long)i + 1, DT(src), SH(src), shown(v));
  return 0;
}
