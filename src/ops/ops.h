/*
 * ops/ops.h -- what the op layer shares: float dtypes and broadcasting. Ops are
 * device independent: they check shapes and dtypes, allocate outputs, record an autograd node
 * and call a kernel through the device's table (core/core.h, "device backends").
 */
#ifndef FSDP_OPS_H
#define FSDP_OPS_H
#include "core/core.h"

// a tensor's shape as a value, the part of many nodes' parameters that says how to shape a
// gradient back (binary ops, reductions, views, expand, index_select)
typedef struct {
  int ndim;
  int64_t shape[FSDP_MAX_DIMS];
} fsdp_shape_rec;
static inline fsdp_shape_rec fsdp_shape_rec_of(const fsdp_tensor* t) {
  fsdp_shape_rec r = {.ndim = t->ndim};
  memcpy(r.shape, t->shape, (size_t)t->ndim * sizeof(int64_t));
  return r;
}

// ---- float dtypes -----------------------------------------------------------------------------
// Kernels compute in float32. Every float op also takes bfloat16 (and float16) tensors, by one
// path: it reads a low-precision input through a contiguous float32 copy (fsdp_as_f32), runs the
// float32 kernel, which accumulates in float32, and rounds the float32 result to the op's result
// dtype once (fsdp_round_to) -- PyTorch's CPU semantics for bfloat16. What a node saves for its
// backward is either the input as given (read through fsdp_as_f32 again in backward) or the
// float32 copy/result the forward made, so a backward computes in float32 too; the engine rounds
// each gradient to its input's dtype (core/autograd.c). The one exception to the copies: GEMMs
// whose operands are both bfloat16 read them as they are, through the linalg table's gemm_bf16
// (oneDNN's bf16 GEMM where the CPU has one, float32 accumulation and output).
//
// the result dtype of an op on float inputs a and b (b may be NULL), PyTorch's type promotion:
// their dtype when they agree, else float32; a 0-dim tensor defers to one with dims
int fsdp_result_dtype(const fsdp_tensor* a, const fsdp_tensor* b);
// for the ops PyTorch refuses mixed float dtypes for (matmul, linear, conv2d, attention): error
// naming both unless a and b (b may be NULL) have one dtype
int fsdp_check_same_dtype(const char* op, const char* what_a, const fsdp_tensor* a, const char* what_b,
                          const fsdp_tensor* b);
// a normalization's weight or bias p (what) against input x normalized over its last k dims
// (layer_norm, rms_norm): a float tensor on x's device, x's dtype or float32, of those k dims' shape
int fsdp_check_norm_affine(const char* op, const char* what, const fsdp_tensor* p, const fsdp_tensor* x, int k);
// t as float32 for a kernel to read (new ref): t itself when float32 (any layout), else a
// contiguous float32 copy
static inline fsdp_tensor* fsdp_as_f32(fsdp_tensor* t) {
  if (t->dtype != FSDP_F32) return fsdp_as_contig(t);
  fsdp_tensor_retain(t);
  return t;
}
// the op's float32 result in its result dtype: fsdp_round_to (core/core.h)

// the in-place ops' version of the same: w = fsdp_as_contig(t) (t itself when float32) is updated
// in float32, then written back into t, rounded (nothing to do when w is t); releases w
static inline int fsdp_write_back(fsdp_tensor* t, fsdp_tensor* w) {
  int rc = w == t ? 0 : fsdp_copy_strided(t, w);
  fsdp_tensor_release(w);
  return rc;
}

// ---- values into int64 -------------------------------------------------------------------------
// A float becomes an int64 truncated toward zero (2.5 -> 2, -2.5 -> -2: C's and PyTorch's
// conversion). NaN, inf and values outside [-2^63, 2^63) have no int64 value: where one would be
// written into an int64 tensor the op fails naming it (PyTorch writes whatever the CPU gives,
// -2^63 on x86), before any kernel runs, so every device refuses alike. Each check passes when
// dtype is not int64; bool takes any value (NaN is true, as in PyTorch).
// the number v (what: "value", "start", ...) as op writes it into a dtype tensor
int fsdp_check_int_value(const char* op, const char* what, double v, int dtype);
// the n numbers v (a tensor's elements, row-major; named by 1-based position)
int fsdp_check_int_values(const char* op, int64_t n, const double* v, int dtype);
// the elements of src (any device) converted to dtype: float ones are read (on the host)
int fsdp_check_int_convert(const char* op, fsdp_tensor* src, int dtype);

// ---- broadcasting -----------------------------------------------------------------------------
// computes the broadcast shape of a and b; returns -1 with an error naming op if incompatible
int fsdp_broadcast_shape(const char* op, const fsdp_tensor* a, const fsdp_tensor* b, int* ndim, int64_t* shape);
// strides of t viewed as `shape` (0 on broadcast dims); t's dims align to the right
void fsdp_broadcast_strides(const fsdp_tensor* t, int ndim, const int64_t* shape, int64_t* stride);
// sums grad (shape of a broadcast result) down to `shape` (reverse of broadcasting); new ref
fsdp_tensor* fsdp_sum_to(fsdp_tensor* grad, int ndim, const int64_t* shape);

// ---- random draws and deferred values (factory.c, deferred.c) ---------------------------------------
// p[0..n) <- values [first, first + n) of the draw keyed `key`: U[a, b), or N(a, b) when normal
void fsdp_draw_into(float* p, int64_t n, int normal, double a, double b, uint64_t key, int64_t first);
// the in-place writes a meta storage records (fsdp_step.kind)
enum { FSDP_STEP_FILL, FSDP_STEP_ADD, FSDP_STEP_MUL, FSDP_STEP_UNIFORM, FSDP_STEP_NORMAL, FSDP_STEP_COPY };
// records one write on meta view t (a: value or law; key: a draw's; src: a copy's source, any
// layout broadcastable to t): 0, or -1 with the error set
int fsdp_meta_record(fsdp_tensor* t, int kind, double a, double b, uint64_t key, fsdp_tensor* src);
// a meta tensor's steps (FSDP sends rank 0's to the other ranks): how many (-1: t is not on meta),
// packed as FSDP_META_STEP_WORDS int64 each, and put in place of t's own; srcs[i] holds copy step
// i's values (fsdp_meta_step_src on the sender)
#define FSDP_META_STEP_WORDS (7 + 2 * FSDP_MAX_DIMS)
int64_t fsdp_meta_steps(const fsdp_tensor* t);
int fsdp_meta_pack(const fsdp_tensor* t, int64_t* out);
int fsdp_meta_unpack(fsdp_tensor* t, int n, const int64_t* in, fsdp_tensor* const* srcs);
fsdp_tensor* fsdp_meta_step_src(const fsdp_tensor* t, int i);

#endif
