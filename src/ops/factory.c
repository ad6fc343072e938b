/*
 * ops/factory.c -- tensors made from nothing: empty, full, from Lua values or a blob, arange, and
 * the random ones (uniform, normal, randint, randperm) from core's RNG stream.
 */
#include "ops/ops.h"

#include <math.h>

fsdp_tensor* fsdp_empty(int ndim, const int64_t* shape, int dtype, int device) {
  return fsdp_new(ndim, shape, dtype, device);
}
fsdp_tensor* fsdp_full(int ndim, const int64_t* shape, double value, int dtype, int device) {
  if (fsdp_check_int_value("full", "value", value, dtype)) return NULL;
  fsdp_tensor* t = fsdp_new(ndim, shape, dtype, device);
  if (t) fsdp_backend_of(t)->elem->fill(t->storage->data, dtype, fsdp_tensor_numel(t), value);
  return t;
}
fsdp_tensor* fsdp_from_doubles(int ndim, const int64_t* shape, int dtype, const double* values) {
  fsdp_tensor* t = fsdp_new(ndim, shape, dtype, FSDP_CPU);
  if (!t) return NULL;
  int64_t n = fsdp_tensor_numel(t);
  if (fsdp_check_int_values("tensor", n, values, dtype)) {
    fsdp_tensor_release(t);
    return NULL;
  }
  // element by element through the fill kernel's conversion (tensors built from Lua tables are small)
  const fsdp_elem_kernels* k = fsdp_backend_of(t)->elem;
  size_t es = fsdp_dtype_size(dtype);
  for (int64_t i = 0; i < n; i++) k->fill((char*)t->storage->data + i * es, dtype, 1, values[i]);
  return t;
}
fsdp_tensor* fsdp_from_blob(int ndim, const int64_t* shape, int dtype, const void* data) {
  fsdp_tensor* t = fsdp_new(ndim, shape, dtype, FSDP_CPU);
  if (t) memcpy(t->storage->data, data, t->storage->nbytes);
  return t;
}
fsdp_tensor* fsdp_arange(double start, double end, double step, int dtype) {
  CHECK_NULL(isfinite(start) && isfinite(end) && isfinite(step), "arange: start %g, end %g and step %g must be finite",
             start, end, step);
  CHECK_NULL(step != 0, "arange: step must be non-zero");
  double len = ceil((end - start) / step);
  CHECK_NULL(len < 0x1p62, "arange: start %g, end %g and step %g give %g elements, too many", start, end, step, len);
  int64_t n = len > 0 ? (int64_t)len : 0;
  if (n > 0 && (fsdp_check_int_value("arange", "start", start, dtype) ||
                fsdp_check_int_value("arange", "the last value", start + (double)(n - 1) * step, dtype)))
    return NULL;
  fsdp_tensor* t = fsdp_new(1, &n, dtype, FSDP_CPU);
  if (!t) return NULL;
  // int64 from whole start and step counts in integers: past 2^53 a double skips values
  // (arange(2^53, 2^53 + 4) gave 2^53 twice); the checks above keep the last value in range
  if (dtype == FSDP_I64 && start == floor(start) && step == floor(step)) {
    int64_t* v = t->storage->data;
    for (int64_t i = 0; i < n; i++) v[i] = (int64_t)start + i * (int64_t)step;
    return t;
  }
  const fsdp_elem_kernels* k = fsdp_backend_of(t)->elem;
  size_t es = fsdp_dtype_size(dtype);
  for (int64_t i = 0; i < n; i++) k->fill((char*)t->storage->data + i * es, dtype, 1, start + i * step);
  return t;
}
// the draws go into float32 values: t itself, or a float32 copy rounded back into a bfloat16 or
// float16 t (ops/ops.h, fsdp_write_back), so a tensor of any float dtype gets the same draws; on
// another device than the CPU they are drawn on the host (the one RNG stream) and copied over
static fsdp_tensor* draw_target(const char* op, fsdp_tensor* t) {
  if (fsdp_check_float(op, t)) return NULL;
  CHECK_NULL(fsdp_tensor_is_contiguous(t), "%s: tensor of shape %s is not contiguous", op, SH(t));
  if (fsdp_device_of(t) != FSDP_CPU) return fsdp_new(t->ndim, t->shape, FSDP_F32, FSDP_CPU);
  return fsdp_as_contig(t);
}
static int draw_done(fsdp_tensor* t, fsdp_tensor* w) {
  if (fsdp_write_back(t, w)) return -1;
  fsdp_bump_version(t);
  return 0;
}
// t's n elements get the values [skip, skip + n) of a draw of `total` values: a piece of a tensor
// gets exactly the numbers the whole tensor gets from one draw (a sharded FSDP parameter's piece).
// The draw takes one key from the stream whatever its size (fsdp_draw_*); on a meta tensor it is
// recorded with its key and replayed when values are asked for (ops/deferred.c).
static int draw_slice(const char* op, fsdp_tensor* t, int normal, double a, double b, int64_t skip, int64_t total) {
  int64_t n = fsdp_tensor_numel(t);
  CHECK_INT(skip >= 0 && total >= 0 && n <= total - skip,
            "%s: elements %lld..%lld of a draw of %lld do not fit a tensor of shape %s", op, (long long)skip + 1,
            (long long)(skip + n), (long long)total, SH(t));
  if (t->storage->meta) {  // (refusing what an eager draw refuses: draw_target)
    CHECK_INT(fsdp_is_float(t->dtype), "%s: expected a float tensor, got %s", op, DT(t));
    CHECK_INT(fsdp_tensor_is_contiguous(t), "%s: tensor of shape %s is not contiguous", op, SH(t));
    return fsdp_meta_record(t, normal ? FSDP_STEP_NORMAL : FSDP_STEP_UNIFORM, a, b, fsdp_rng_next(), NULL);
  }
  fsdp_tensor* w = draw_target(op, t);
  if (!w) return -1;
  fsdp_draw_into(fsdp_f32(w), n, normal, a, b, fsdp_rng_next(), skip);
  return draw_done(t, w);
}
void fsdp_draw_into(float* p, int64_t n, int normal, double a, double b, uint64_t key, int64_t first) {
  if (normal)
    for (int64_t i = 0; i < n; i++) p[i] = (float)(a + b * fsdp_draw_normal(key, first + i));
  else
    for (int64_t i = 0; i < n; i++) p[i] = (float)(a + (b - a) * fsdp_draw_uniform(key, first + i));
}
int fsdp_uniform_slice_(fsdp_tensor* t, double lo, double hi, int64_t skip, int64_t total) {
  return draw_slice("uniform_", t, 0, lo, hi, skip, total);
}
int fsdp_normal_slice_(fsdp_tensor* t, double mean, double std, int64_t skip, int64_t total) {
  return draw_slice("normal_", t, 1, mean, std, skip, total);
}
int fsdp_uniform_(fsdp_tensor* t, double lo, double hi) {
  return fsdp_uniform_slice_(t, lo, hi, 0, fsdp_tensor_numel(t));
}
int fsdp_normal_(fsdp_tensor* t, double mean, double std) {
  return fsdp_normal_slice_(t, mean, std, 0, fsdp_tensor_numel(t));
}
fsdp_tensor* fsdp_rand(int ndim, const int64_t* shape, double lo, double hi) {
  fsdp_tensor* t = fsdp_new(ndim, shape, FSDP_F32, FSDP_CPU);
  if (t) fsdp_uniform_(t, lo, hi);
  return t;
}
fsdp_tensor* fsdp_randn(int ndim, const int64_t* shape, double mean, double std) {
  fsdp_tensor* t = fsdp_new(ndim, shape, FSDP_F32, FSDP_CPU);
  if (t) fsdp_normal_(t, mean, std);
  return t;
}
fsdp_tensor* fsdp_randint(int64_t lo, int64_t hi, int ndim, const int64_t* shape) {
  CHECK_NULL(hi > lo, "randint: empty range [%lld, %lld)", (long long)lo, (long long)hi);
  fsdp_tensor* t = fsdp_new(ndim, shape, FSDP_I64, FSDP_CPU);
  if (!t) return NULL;
  int64_t *p = fsdp_i64(t), n = fsdp_tensor_numel(t);
  uint64_t range = (uint64_t)(hi - lo);
  for (int64_t i = 0; i < n; i++) p[i] = lo + (int64_t)(fsdp_rng_next() % range);
  return t;
}
fsdp_tensor* fsdp_randperm(int64_t n) {
  CHECK_NULL(n >= 0, "randperm: negative n %lld", (long long)n);
  fsdp_tensor* t = fsdp_new(1, &n, FSDP_I64, FSDP_CPU);
  if (!t) return NULL;
  int64_t* p = fsdp_i64(t);
  for (int64_t i = 0; i < n; i++) p[i] = i;
  for (int64_t i = n - 1; i > 0; i--) {  // Fisher-Yates
    int64_t j = (int64_t)(fsdp_rng_next() % (uint64_t)(i + 1)), tmp = p[i];
    p[i] = p[j];
    p[j] = tmp;
  }
  return t;
}
