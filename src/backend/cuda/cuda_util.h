/*
 * backend/cuda/cuda_util.h -- what every .cu file of the CUDA backend shares: the compute stream
 * every kernel runs on, the error report back to libfsdp.so, launch sizes, and the kernel tables
 * each file defines.
 */
#ifndef FSDP_BACKEND_CUDA_UTIL_H
#define FSDP_BACKEND_CUDA_UTIL_H
#include "backend/cuda/cuda.h"

#include <cuda_runtime.h>
#include <stdint.h>

// the one compute stream (backend.cu creates it in init); kernels and copies queue on it in order
extern cudaStream_t fsdp_cuda_stream;
// reports a CUDA error to libfsdp.so (the message names the op); returns -1
int fsdp_cuda_fail(const char* op, cudaError_t e);

// the device's error slot (backend.cu allocates it in init): a check kernel that finds a bad
// index claims it with its deferred check id (the first failure wins) and stores the value; the
// next synchronize or copy to the host reports it (fsdp_check_report) and clears it
typedef struct {
  int id;
  long long value;
} fsdp_cuda_check_slot;
extern fsdp_cuda_check_slot* fsdp_cuda_slot;
__device__ static inline void fsdp_cuda_check_fail(fsdp_cuda_check_slot* slot, int check, long long value) {
  if (atomicCAS(&slot->id, 0, check) == 0) slot->value = value;
}
// after a launch: a launch error is reported at once (bad configuration); errors of the kernel's
// run surface at the next synchronize
#define FSDP_CUDA_LAUNCHED(op)                       \
  do {                                               \
    cudaError_t e_ = cudaGetLastError();             \
    if (e_ != cudaSuccess) fsdp_cuda_fail((op), e_); \
  } while (0)

// a grid of 256-thread blocks covering n elements (grid-stride loops cover the rest)
static inline unsigned fsdp_cuda_blocks(int64_t n) {
  int64_t b = (n + 255) / 256;
  if (b < 1) b = 1;
  return (unsigned)(b < 65535 * 8 ? b : 65535 * 8);
}

extern const fsdp_elem_kernels fsdp_cuda_elem_kernels;
extern const fsdp_linalg_kernels fsdp_cuda_linalg_kernels;
extern const fsdp_nn_kernels fsdp_cuda_nn_kernels;
extern const fsdp_optim_kernels fsdp_cuda_optim_kernels;
extern const fsdp_norm_kernels fsdp_cuda_norm_kernels;

#endif
