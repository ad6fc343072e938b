/*
 * core/kernels_elem.h -- elementwise, copy and reduction kernels (one table per device).
 * Kernels work on raw buffers; the op layer (ops/elem.c, ops/shape.c) and core's copies check
 * shapes and dtypes.
 */
#ifndef FSDP_KERNELS_ELEM_H
#define FSDP_KERNELS_ELEM_H
#include <stddef.h>
#include <stdint.h>

// gather/scatter_add along one dim (ops/select.c): the index tensor (contiguous i64) has `shape`;
// the indexed tensor is addressed by `stride`, the other one (gather's output, scatter_add's src)
// by `other_stride`, both over `shape`, with dim `dim`'s position taken from the index (in
// [0, dim_size): an async device skips the others, whose deferred check has failed)
typedef struct {
  int ndim, dim;
  int64_t dim_size;
  int64_t shape[8], stride[8], other_stride[8];  // FSDP_MAX_DIMS
} fsdp_gather_geom;

typedef struct fsdp_elem_kernels {
  // dst (contiguous, dst_dtype) <- src (strided over `shape`, src_dtype), converting dtypes
  void (*copy_strided)(void* dst, int dst_dtype, const void* src, int src_dtype, int ndim, const int64_t* shape,
                       const int64_t* src_stride);
  // dst (strided over `shape`, dst_stride) <- src (contiguous), elements of es bytes (same dtype)
  void (*scatter_strided)(void* dst, size_t es, int ndim, const int64_t* shape, const int64_t* dst_stride,
                          const void* src);
  // dst[0..n) = v
  void (*fill)(void* dst, int dtype, int64_t n, double v);
  // y (rows, n) += alpha * x (rows, n), rows ldy and ldx floats apart (f32; rows = 1 for a vector)
  void (*axpy)(float* y, int64_t ldy, const float* x, int64_t ldx, int64_t rows, int64_t n, float alpha);
  // y[0..n) *= s                 (f32)
  void (*scale)(float* y, int64_t n, float s);
  // ---- the ops/elem.c family (binary/unary/reductions) ----
  // out (contiguous over shape) = a op b, a/b addressed by broadcast strides (0 on broadcast dims)
  void (*binary)(int op, float* out, const float* a, const float* b, int ndim, const int64_t* shape,
                 const int64_t* stride_a, const int64_t* stride_b);
  // out[i] = f(x[i]; p)
  void (*unary)(int op, float* out, const float* x, int64_t n, double p);
  // gx[i] = gy[i] * f'(x[i]) (y = f(x) given too, for ops whose derivative uses it)
  void (*unary_backward)(int op, float* gx, const float* gy, const float* x, const float* y, int64_t n, double p);
  // view input as (outer, red, inner) contiguous; out (outer, inner) = sum over red
  void (*sum_dim)(float* out, const float* in, int64_t outer, int64_t red, int64_t inner);
  // view input as (outer, red, inner) contiguous; max over red with i64 argmax
  void (*max_dim)(float* out, int64_t* idx, const float* in, int64_t outer, int64_t red, int64_t inner);
  // max backward: gx (outer, red, inner) = 0 except gx[o, idx[o, j], j] = gy[o, j]
  void (*scatter_dim)(float* gx, const float* gy, const int64_t* idx, int64_t outer, int64_t red, int64_t inner);
  // position of the first idx[0..n) outside [lo, hi), or -1 when all are in range. An async device
  // (fsdp_backend.async) is always given a deferred check id (fsdp_check_defer): it returns -1 at
  // once and, if one is out of range, reports `check` with that value at its next synchronization;
  // its kernels that read the indices skip out-of-range ones meanwhile
  int64_t (*index_check)(const int64_t* idx, int64_t n, int64_t lo, int64_t hi, int check);
  // out (outer, n_idx, inner) = in (outer, n_in, inner) gathered along the middle dim; es = element
  // size in bytes (any dtype)
  void (*index_select)(void* out, const void* in, size_t es, const int64_t* idx, int64_t outer, int64_t n_in,
                       int64_t n_idx, int64_t inner);
  // gx (outer, n_in, inner) += gy (outer, n_idx, inner) added along the middle dim at idx (f32)
  void (*index_add)(float* gx, const float* gy, const int64_t* idx, int64_t outer, int64_t n_in, int64_t n_idx,
                    int64_t inner);
  // ---- sorting, gather and scatter_add along a dim (ops/select.c) ----
  // idx (rows, n) = each row of x (rows, n) in stable sorted order (ascending, or descending when
  // descending != 0; NaN is larger than every number, as PyTorch orders it); tmp (rows, n) is scratch
  void (*argsort_rows)(int64_t* idx, int64_t* tmp, const float* x, int64_t rows, int64_t n, int descending);
  // out[i] = in[i with its g->dim-th index replaced by idx[i]], for every i of g->shape (f32)
  void (*gather_dim)(const fsdp_gather_geom* g, float* out, const float* in, const int64_t* idx);
  // dst[i with its g->dim-th index replaced by idx[i]] += src[i], for every i of g->shape (f32)
  void (*scatter_add_dim)(const fsdp_gather_geom* g, float* dst, const float* src, const int64_t* idx);
} fsdp_elem_kernels;

enum { FSDP_BIN_ADD = 0, FSDP_BIN_SUB, FSDP_BIN_MUL, FSDP_BIN_DIV, FSDP_BIN_EQ };
enum {
  FSDP_UN_NEG = 0,
  FSDP_UN_EXP,
  FSDP_UN_LOG,
  FSDP_UN_SQRT,
  FSDP_UN_ABS,
  FSDP_UN_TANH,
  FSDP_UN_SIGMOID,
  FSDP_UN_RELU,
  FSDP_UN_GELU,
  FSDP_UN_GELU_TANH,
  FSDP_UN_POW,
  FSDP_UN_ADD_SCALAR,
  FSDP_UN_MUL_SCALAR,
  FSDP_UN_RDIV_SCALAR
};

#endif
