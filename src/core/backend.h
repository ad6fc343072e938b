/*
 * core/backend.h -- the device interface: one table per device with its memory, copies and
 * ordering, and its kernels, one table per op family (core/kernels_*.h). Plain C that C++ reads
 * too: the CUDA backend (the .cu files of backend/cuda, built by nvcc into libfsdp_cuda.so) fills one in.
 *
 * Every device has one backend table. Backends register themselves (backend/cpu/backend.c when
 * libfsdp.so loads; an optional backend, a shared library, when it is loaded), and registration
 * checks that the table is complete, so code that holds a tensor of a device can call any entry
 * of that device's table without a check. Core never names a backend; nothing calls a kernel but
 * through this table. The one exception is the pair of optional entries at the end (host memory
 * the device copies from directly): a device that is not a GPU has none, so they may be NULL, and
 * registration does not ask for them (core/tensor.c's pinned memory looks for a device that has them).
 */
#ifndef FSDP_CORE_BACKEND_H
#define FSDP_CORE_BACKEND_H
#include "core/kernels_elem.h"
#include "core/kernels_linalg.h"
#include "core/kernels_nn.h"
#include "core/kernels_norm.h"
#include "core/kernels_optim.h"
#include <stddef.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef enum { FSDP_COPY_H2D = 0, FSDP_COPY_D2H, FSDP_COPY_D2D, FSDP_COPY_H2H } fsdp_copy_kind;

typedef struct fsdp_backend {
  const char* name;  // "cpu", "cuda": the name users pass as a device
  // 1 where work runs behind the host (a GPU's queue): index and target checks then run on the
  // device and report at the next synchronization (core's deferred checks, fsdp_check_defer)
  int async;
  // memory: raw device blocks, 64-byte aligned, NULL when out of memory (core's fsdp_alloc counts
  // the categories and caches freed blocks on top of these)
  void* (*alloc)(size_t nbytes);
  void (*free)(void* p, size_t nbytes);
  void (*memset)(void* p, int byte, size_t nbytes);
  // nbytes from src to dst; kind says which side is host memory. 0, or -1 with the error set (a
  // copy to the host waits for the device, so a failed kernel or device-side check reports here)
  int (*copy)(void* dst, const void* src, size_t nbytes, fsdp_copy_kind kind);
  // ordering: waits for all queued work (0, or -1 with the error of a failed kernel or check);
  // streams and events (no-ops where work is synchronous)
  int (*synchronize)(void);
  void* (*stream_new)(void);
  void (*stream_free)(void* stream);
  void* (*event_new)(void);
  void (*event_free)(void* event);
  void (*event_record)(void* event, void* stream);  // event completes when stream's work so far has
  void (*stream_wait)(void* stream, void* event);   // stream's later work waits for event
  // work queued on a stream (NULL: the compute stream), the host waiting for none of it: a copy
  // (0, or -1 with the error set when it cannot be queued), a memset, and a host function run
  // when the stream gets there (cudaLaunchHostFunc); the stand-in communicator is built of these
  int (*copy_async)(void* dst, const void* src, size_t nbytes, fsdp_copy_kind kind, void* stream);
  void (*memset_async)(void* p, int byte, size_t nbytes, void* stream);
  void (*launch_host)(void* stream, void (*fn)(void*), void* arg);
  // which of the machine's devices of this kind this process uses (0-based), and how many it has
  void (*ordinal)(int* index, int* count);
  // kernels
  const fsdp_elem_kernels* elem;
  const fsdp_linalg_kernels* linalg;
  const fsdp_nn_kernels* nn;
  const fsdp_optim_kernels* optim;
  const fsdp_norm_kernels* norm;
  // optional (NULL where the device has no such memory: the CPU, which is the host): page-locked
  // host memory the device copies from and to directly (cudaMallocHost / cudaFreeHost), for
  // pinned CPU tensors (core's fsdp_pin_memory). 64-byte aligned, NULL when out of memory; the
  // host reads and writes it as any memory
  void* (*host_alloc)(size_t nbytes);
  void (*host_free)(void* p, size_t nbytes);
} fsdp_backend;

#ifdef __cplusplus
}
#endif

#endif
