/*
 * kernels_optim.h -- the optim kernel table (one per device). Kernels work on raw f32 buffers;
 * the op layer (ops_optim.c) checks shapes and dtypes and records autograd nodes.
 */
#ifndef FSDP_KERNELS_OPTIM_H
#define FSDP_KERNELS_OPTIM_H
#include <stdint.h>

typedef struct fsdp_optim_kernels {
  int placeholder_;  // replaced by the family's kernels
} fsdp_optim_kernels;

#endif
