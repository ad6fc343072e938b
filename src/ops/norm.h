/*
 * ops/norm.h -- what the op layer's batch norm offers the layers above it: the op with a reducer,
 * a function that sums a float32 buffer in place over the ranks. parallel/sync_bn.c passes one that
 * all-reduces over the communicator, so SyncBatchNorm is the same op with global statistics.
 */
#ifndef FSDP_OPS_NORM_H
#define FSDP_OPS_NORM_H
#include "core/core.h"

// sums t (float32, contiguous) in place over every rank: 0, or -1 with the error set
typedef int (*fsdp_norm_reduce_fn)(fsdp_tensor* t, void* ctx);

// fsdp_batch_norm (fsdp.h) under the name `op`, with the batch statistics (training) and the
// backward's per-channel gradient sums reduced by `reduce` (NULL: this rank's alone); ctx is
// handed to it (and must live as long as the graph)
fsdp_tensor* fsdp_batch_norm_reduced(const char* op, fsdp_tensor* x, fsdp_tensor* running_mean,
                                     fsdp_tensor* running_var, fsdp_tensor* w, fsdp_tensor* b, int training,
                                     double momentum, double eps, fsdp_norm_reduce_fn reduce, void* ctx);

#endif
