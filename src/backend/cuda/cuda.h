/*
 * backend/cuda/cuda.h -- what libfsdp.so (backend/cuda/load.c) and libfsdp_cuda.so (the .cu files
 * here, built by nvcc) hand each other. LuaJIT loads libfsdp.so with RTLD_LOCAL, so the CUDA
 * library cannot call back into it by name: errors go through the host table below.
 *
 * load.c first checks for a driver and a device (libcuda.so.1, cuInit, cuDeviceGetCount) without
 * touching the CUDA library, so a machine without a GPU never loads it; then it dlopen()s
 * libfsdp_cuda.so, asks fsdp_cuda_library() for the table below, initializes it and registers
 * its device table for FSDP_CUDA.
 */
#ifndef FSDP_BACKEND_CUDA_H
#define FSDP_BACKEND_CUDA_H
#include "core/backend.h"

#ifdef __cplusplus
extern "C" {
#endif

#define FSDP_CUDA_ABI 5

// libfsdp.so's side: how the CUDA library reports an error (the text becomes fsdp_last_error()),
// and a failed device-side check (core's fsdp_check_report: the op's message with the bad value)
typedef struct fsdp_cuda_host {
  int abi;
  void (*error)(const char* msg);
  int (*check_failed)(int id, int64_t value);
} fsdp_cuda_host;

// the CUDA library's side
typedef struct fsdp_cuda_library {
  int abi;
  const fsdp_backend* table;  // the device table; complete without a GPU (CI checks it)
  // sets up device `index`: the compute stream, the memory pool, cuBLASLt; 0 ok, else -1 with
  // the reason in err (err_len bytes)
  int (*init)(const fsdp_cuda_host* host, int index, char* err, size_t err_len);
  // the device's name, memory in bytes (free and total), after init
  void (*device_info)(char* name, size_t name_len, size_t* free_bytes, size_t* total_bytes);
  // the versions it runs on ("runtime 13000, driver 13000, cuBLASLt 130100"), without a GPU too
  void (*versions)(char* out, size_t out_len);
} fsdp_cuda_library;

// exported by libfsdp_cuda.so
const fsdp_cuda_library* fsdp_cuda_library_get(void);
typedef const fsdp_cuda_library* (*fsdp_cuda_library_getter)(void);

#ifdef __cplusplus
}
#endif

#endif
