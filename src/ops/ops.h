/*
 * ops/ops.h -- what the op layer shares: broadcasting. Ops are
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

// ---- broadcasting -----------------------------------------------------------------------------
// computes the broadcast shape of a and b; returns -1 with an error naming op if incompatible
int fsdp_broadcast_shape(const char* op, const fsdp_tensor* a, const fsdp_tensor* b, int* ndim, int64_t* shape);
// strides of t viewed as `shape` (0 on broadcast dims); t's dims align to the right
void fsdp_broadcast_strides(const fsdp_tensor* t, int ndim, const int64_t* shape, int64_t* stride);
// sums grad (shape of a broadcast result) down to `shape` (reverse of broadcasting); new ref
fsdp_tensor* fsdp_sum_to(fsdp_tensor* grad, int ndim, const int64_t* shape);

#endif
