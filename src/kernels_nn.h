/*
 * kernels_nn.h -- the nn kernel table (one per device). Kernels work on raw f32 buffers;
 * the op layer (ops_nn.c) checks shapes and dtypes and records autograd nodes.
 */
#ifndef FSDP_KERNELS_NN_H
#define FSDP_KERNELS_NN_H
#include <stdint.h>

typedef struct fsdp_nn_kernels {
  int placeholder_;  // replaced by the family's kernels
} fsdp_nn_kernels;

#endif
