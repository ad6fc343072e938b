/*
 * tests/cudaemu/include/cuda_runtime.h -- the CUDA runtime API as the CUDA executor (cudaemu)
 * implements it: the calls the project's .cu files make, with CUDA's names and documented
 * behaviour, on the CPU (tests/cudaemu/runtime.cc). This directory comes first on the executor's
 * include path, so `#include <cuda_runtime.h>` in a .cu file finds this instead of the toolkit's;
 * the kernel language comes with it (emu.h). Values of the enums are ours: nothing compiled
 * against NVIDIA's headers ever links with this.
 *
 * Ordering, as CUDA's: work on a stream runs in issue order on that stream's own host thread (a
 * GPU's queue: the caller goes on at once); streams made with cudaStreamNonBlocking do not wait for
 * each other, but through events; the legacy default stream (0) runs its work at once on the
 * caller's thread. cudaMemcpy and cudaMemcpyAsync to pageable host memory return once the bytes
 * arrived (every host buffer is pageable here), an asynchronous copy from the host takes its bytes
 * at the call. A kernel error (a divergent barrier, a warp operation's bad mask, a deadlock) is
 * sticky, as a GPU's: every later synchronising call returns it.
 */
#ifndef FSDP_CUDAEMU_CUDA_RUNTIME_H
#define FSDP_CUDAEMU_CUDA_RUNTIME_H

#include "../emu.h"

#include <stddef.h>
#include <stdint.h>

typedef enum cudaError {
  cudaSuccess = 0,
  cudaErrorInvalidValue = 1,
  cudaErrorMemoryAllocation = 2,
  cudaErrorInitializationError = 3,
  cudaErrorInvalidConfiguration = 9,
  cudaErrorInvalidDevice = 101,
  cudaErrorInvalidResourceHandle = 400,
  cudaErrorNotReady = 600,
  cudaErrorIllegalAddress = 700,
  cudaErrorLaunchOutOfResources = 701,
  cudaErrorLaunchFailure = 719,
  cudaErrorIllegalInstruction = 715,
  cudaErrorUnknown = 999,
} cudaError_t;

typedef enum cudaMemcpyKind {
  cudaMemcpyHostToHost = 0,
  cudaMemcpyHostToDevice = 1,
  cudaMemcpyDeviceToHost = 2,
  cudaMemcpyDeviceToDevice = 3,
  cudaMemcpyDefault = 4,
} cudaMemcpyKind;

typedef enum cudaDataType_t { CUDA_R_32F = 0, CUDA_R_16F = 2, CUDA_R_16BF = 14, CUDA_R_64F = 1 } cudaDataType_t;

#define cudaStreamDefault 0x00
#define cudaStreamNonBlocking 0x01
#define cudaEventDefault 0x00
#define cudaEventDisableTiming 0x02

typedef struct fsdp_emu_event* cudaEvent_t;
typedef struct fsdp_emu_pool* cudaMemPool_t;
typedef void (*cudaHostFn_t)(void* user_data);

typedef enum cudaMemPoolAttr { cudaMemPoolAttrReleaseThreshold = 4 } cudaMemPoolAttr;
typedef enum cudaFuncAttribute { cudaFuncAttributeMaxDynamicSharedMemorySize = 8 } cudaFuncAttribute;

typedef struct cudaDeviceProp {
  char name[256];
  size_t totalGlobalMem;
  size_t sharedMemPerBlock;       // 48 KiB: what a block may use without the opt-in
  size_t sharedMemPerBlockOptin;  // with cudaFuncAttributeMaxDynamicSharedMemorySize
  int warpSize;
  int maxThreadsPerBlock;
  int maxThreadsDim[3];
  int maxGridSize[3];
  int major, minor;
  int multiProcessorCount;
} cudaDeviceProp;

// (C++ linkage: the executor is C++, as nvcc's output is)
const char* cudaGetErrorName(cudaError_t e);
const char* cudaGetErrorString(cudaError_t e);
cudaError_t cudaGetLastError(void);
cudaError_t cudaPeekAtLastError(void);

cudaError_t cudaSetDevice(int device);
cudaError_t cudaGetDevice(int* device);
cudaError_t cudaGetDeviceCount(int* count);
cudaError_t cudaGetDeviceProperties(cudaDeviceProp* prop, int device);
cudaError_t cudaDeviceSynchronize(void);
cudaError_t cudaRuntimeGetVersion(int* version);
cudaError_t cudaDriverGetVersion(int* version);
cudaError_t cudaMemGetInfo(size_t* free_bytes, size_t* total_bytes);

cudaError_t cudaMalloc(void** p, size_t n);
cudaError_t cudaFree(void* p);
cudaError_t cudaMallocAsync(void** p, size_t n, cudaStream_t s);
cudaError_t cudaMallocFromPoolAsync(void** p, size_t n, cudaMemPool_t pool, cudaStream_t s);
cudaError_t cudaFreeAsync(void* p, cudaStream_t s);
cudaError_t cudaMallocHost(void** p, size_t n);
cudaError_t cudaFreeHost(void* p);
// (the typed forms of cuda_runtime.h's C++ API)
template <typename T>
cudaError_t cudaMalloc(T** p, size_t n) {
  return cudaMalloc(reinterpret_cast<void**>(p), n);
}
template <typename T>
cudaError_t cudaMallocAsync(T** p, size_t n, cudaStream_t s) {
  return cudaMallocAsync(reinterpret_cast<void**>(p), n, s);
}
cudaError_t cudaDeviceGetDefaultMemPool(cudaMemPool_t* pool, int device);
cudaError_t cudaMemPoolSetAttribute(cudaMemPool_t pool, cudaMemPoolAttr attr, void* value);

cudaError_t cudaMemcpy(void* dst, const void* src, size_t n, cudaMemcpyKind kind);
cudaError_t cudaMemcpyAsync(void* dst, const void* src, size_t n, cudaMemcpyKind kind, cudaStream_t s);
cudaError_t cudaMemset(void* p, int value, size_t n);
cudaError_t cudaMemsetAsync(void* p, int value, size_t n, cudaStream_t s);
cudaError_t cudaMemset2DAsync(void* p, size_t pitch, int value, size_t width, size_t height, cudaStream_t s);

cudaError_t cudaStreamCreate(cudaStream_t* s);
cudaError_t cudaStreamCreateWithFlags(cudaStream_t* s, unsigned flags);
cudaError_t cudaStreamDestroy(cudaStream_t s);
cudaError_t cudaStreamSynchronize(cudaStream_t s);
cudaError_t cudaStreamQuery(cudaStream_t s);
cudaError_t cudaStreamWaitEvent(cudaStream_t s, cudaEvent_t e, unsigned flags);
cudaError_t cudaLaunchHostFunc(cudaStream_t s, cudaHostFn_t fn, void* arg);

cudaError_t cudaEventCreate(cudaEvent_t* e);
cudaError_t cudaEventCreateWithFlags(cudaEvent_t* e, unsigned flags);
cudaError_t cudaEventDestroy(cudaEvent_t e);
cudaError_t cudaEventRecord(cudaEvent_t e, cudaStream_t s);
cudaError_t cudaEventSynchronize(cudaEvent_t e);
cudaError_t cudaEventQuery(cudaEvent_t e);

// a kernel's opt-in to more dynamic shared memory than 48 KiB (up to sharedMemPerBlockOptin)
cudaError_t fsdp_emu_func_set_attribute(const void* fn, cudaFuncAttribute attr, int value);
template <typename... P>
cudaError_t cudaFuncSetAttribute(void (*fn)(P...), cudaFuncAttribute attr, int value) {
  return fsdp_emu_func_set_attribute(reinterpret_cast<const void*>(fn), attr, value);
}

#endif
