/*
 * parallel/sync_bn.c -- the synchronized batch norm: ops/norm.c's batch_norm with a reducer that
 * all-reduces (sums) its per-channel buffers over the communicator, as PyTorch's SyncBatchNorm:
 * in training the forward's [sum x | count] and sum (x - mean)^2 and the backward's
 * [sum dy | sum dy (x - mean)] are summed over the ranks, so every rank normalizes with the global
 * batch's statistics and its dx carries the global terms; dw and db stay this rank's (FSDP's
 * reduce-scatter averages them with the other gradients). Every rank issues the same all-reduces
 * in the same order (one per forward pass and one per backward of each layer), tagged
 * "sync_batch_norm". With one rank (or no communicator yet) it is batch_norm.
 */
#include "core/core.h"
#include "parallel/comm.h"
#include "ops/norm.h"

static int all_reduce_sum(fsdp_tensor* t, void* ctx) {
  (void)ctx;
  return fsdp_work_finish(fsdp_all_reduce(t, FSDP_REDUCE_SUM, "sync_batch_norm"));
}

fsdp_tensor* fsdp_sync_batch_norm(fsdp_tensor* x, fsdp_tensor* running_mean, fsdp_tensor* running_var, fsdp_tensor* w,
                                  fsdp_tensor* b, int training, double momentum, double eps) {
  int many = fsdp_comm_is_initialized() && fsdp_comm_world_size() > 1;
  return fsdp_batch_norm_reduced("sync_batch_norm", x, running_mean, running_var, w, b, training, momentum, eps,
                                 many ? all_reduce_sum : NULL, NULL);
}
