/*
 * backend/cuda/backend.cu -- the CUDA device table: device memory from the driver's
 * stream-ordered pool (cudaMallocAsync on the compute stream, kept cached by the pool), copies
 * and memsets queued on the compute stream, streams and events for the communication streams,
 * page-locked host memory for pinned CPU tensors (cudaMallocHost), and the kernel tables of the other .cu files. libfsdp.so (backend/cuda/load.c) loads this
 * library only after it found a driver and a device, then calls init.
 *
 * Ordering: all kernels and copies of the compute stream run in issue order, so a block that
 * core's allocator reuses after a free is only touched by work queued after the free. A copy to
 * host memory waits for its stream (the host reads the bytes next).
 */
#include "backend/cuda/cuda_util.h"

#include <cublasLt.h>
#include <stdio.h>
#include <string.h>

cudaStream_t fsdp_cuda_stream;
fsdp_cuda_check_slot* fsdp_cuda_slot;
static const fsdp_cuda_host* g_host;
static cudaMemPool_t g_pool;
static int g_device;

int fsdp_cuda_fail(const char* op, cudaError_t e) {
  char msg[512];
  snprintf(msg, sizeof msg, "%s: CUDA error %s (%s)", op, cudaGetErrorName(e), cudaGetErrorString(e));
  if (g_host) g_host->error(msg);
  return -1;
}

// ---- memory and copies ------------------------------------------------------------------------
static void* cuda_alloc(size_t nbytes) {
  void* p = NULL;
  cudaError_t e = cudaMallocFromPoolAsync(&p, nbytes, g_pool, fsdp_cuda_stream);
  if (e != cudaSuccess) {
    (void)cudaGetLastError();  // out of memory is reported by core, with the sizes
    return NULL;
  }
  return p;
}
static void cuda_free(void* p, size_t nbytes) {
  (void)nbytes;
  cudaError_t e = cudaFreeAsync(p, fsdp_cuda_stream);
  if (e != cudaSuccess) fsdp_cuda_fail("free", e);
}
static void cuda_memset(void* p, int byte, size_t nbytes) {
  cudaError_t e = cudaMemsetAsync(p, byte, nbytes, fsdp_cuda_stream);
  if (e != cudaSuccess) fsdp_cuda_fail("memset", e);
}
// after the host waited for the stream: a device-side check that failed meanwhile is reported now
static int checks_passed(void) {
  fsdp_cuda_check_slot h;
  cudaError_t e = cudaMemcpy(&h, fsdp_cuda_slot, sizeof h, cudaMemcpyDeviceToHost);
  if (e != cudaSuccess) return fsdp_cuda_fail("check", e);
  if (!h.id) return 0;
  cudaMemsetAsync(fsdp_cuda_slot, 0, sizeof h, fsdp_cuda_stream);  // (on the stream the checks run on)
  return g_host->check_failed(h.id, h.value);
}

// fsdp_copy_kind -> CUDA's, in fsdp_copy_kind order
static const cudaMemcpyKind copy_kinds[] = {cudaMemcpyHostToDevice, cudaMemcpyDeviceToHost, cudaMemcpyDeviceToDevice,
                                            cudaMemcpyHostToHost};

static int cuda_copy(void* dst, const void* src, size_t nbytes, fsdp_copy_kind kind) {
  if (!nbytes) return 0;
  cudaError_t e = cudaMemcpyAsync(dst, src, nbytes, copy_kinds[kind], fsdp_cuda_stream);
  // the host reads what arrives (D2H) or may reuse its buffer (H2D from pageable memory stages it
  // before returning, but pinned memory would not): both wait
  if (e == cudaSuccess && kind != FSDP_COPY_D2D) e = cudaStreamSynchronize(fsdp_cuda_stream);
  if (e != cudaSuccess) return fsdp_cuda_fail("copy", e);
  return kind == FSDP_COPY_D2H ? checks_passed() : 0;
}

// page-locked host memory (pinned CPU tensors): H2D copies from it are DMA, without staging
static void* cuda_host_alloc(size_t nbytes) {
  void* p = NULL;
  cudaError_t e = cudaMallocHost(&p, nbytes);
  if (e != cudaSuccess) {
    (void)cudaGetLastError();  // out of memory is reported by core, with the size
    return NULL;
  }
  return p;
}
static void cuda_host_free(void* p, size_t nbytes) {
  (void)nbytes;
  cudaError_t e = cudaFreeHost(p);  // (waits for the device, as cudaFree does)
  if (e != cudaSuccess) fsdp_cuda_fail("host_free", e);
}

// ---- ordering ---------------------------------------------------------------------------------
static int cuda_synchronize(void) {
  cudaError_t e = cudaStreamSynchronize(fsdp_cuda_stream);
  return e == cudaSuccess ? checks_passed() : fsdp_cuda_fail("synchronize", e);
}
static void* cuda_stream_new(void) {
  cudaStream_t s = NULL;
  cudaError_t e = cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking);
  if (e != cudaSuccess) fsdp_cuda_fail("stream_new", e);
  return s;
}
static void cuda_stream_free(void* stream) { cudaStreamDestroy((cudaStream_t)stream); }
static void* cuda_event_new(void) {
  cudaEvent_t ev = NULL;
  cudaError_t e = cudaEventCreateWithFlags(&ev, cudaEventDisableTiming);
  if (e != cudaSuccess) fsdp_cuda_fail("event_new", e);
  return ev;
}
static void cuda_event_free(void* event) { cudaEventDestroy((cudaEvent_t)event); }
// a NULL stream is the compute stream
static void cuda_event_record(void* event, void* stream) {
  cudaError_t e = cudaEventRecord((cudaEvent_t)event, stream ? (cudaStream_t)stream : fsdp_cuda_stream);
  if (e != cudaSuccess) fsdp_cuda_fail("event_record", e);
}
static void cuda_stream_wait(void* stream, void* event) {
  cudaError_t e = cudaStreamWaitEvent(stream ? (cudaStream_t)stream : fsdp_cuda_stream, (cudaEvent_t)event, 0);
  if (e != cudaSuccess) fsdp_cuda_fail("stream_wait", e);
}

static int cuda_copy_async(void* dst, const void* src, size_t nbytes, fsdp_copy_kind kind, void* stream) {
  cudaError_t e = cudaMemcpyAsync(dst, src, nbytes, copy_kinds[kind], stream ? (cudaStream_t)stream : fsdp_cuda_stream);
  return e == cudaSuccess ? 0 : fsdp_cuda_fail("copy_async", e);
}
static void cuda_memset_async(void* p, int byte, size_t nbytes, void* stream) {
  cudaError_t e = cudaMemsetAsync(p, byte, nbytes, stream ? (cudaStream_t)stream : fsdp_cuda_stream);
  if (e != cudaSuccess) fsdp_cuda_fail("memset_async", e);
}
static void cuda_launch_host(void* stream, void (*fn)(void*), void* arg) {
  cudaError_t e = cudaLaunchHostFunc(stream ? (cudaStream_t)stream : fsdp_cuda_stream, fn, arg);
  if (e != cudaSuccess) fsdp_cuda_fail("launch_host", e);
}
static void cuda_ordinal(int* index, int* count) {
  *index = g_device;
  if (cudaGetDeviceCount(count) != cudaSuccess) *count = 1;
}

static const fsdp_backend cuda_backend = {
    "cuda",
    1,  // async: work runs behind the host
    cuda_alloc,
    cuda_free,
    cuda_memset,
    cuda_copy,
    cuda_synchronize,
    cuda_stream_new,
    cuda_stream_free,
    cuda_event_new,
    cuda_event_free,
    cuda_event_record,
    cuda_stream_wait,
    cuda_copy_async,
    cuda_memset_async,
    cuda_launch_host,
    cuda_ordinal,
    &fsdp_cuda_elem_kernels,
    &fsdp_cuda_linalg_kernels,
    &fsdp_cuda_nn_kernels,
    &fsdp_cuda_optim_kernels,
    &fsdp_cuda_norm_kernels,
    cuda_host_alloc,
    cuda_host_free,
};

// ---- the library's entry points -----------------------------------------------------------------
static int cuda_init(const fsdp_cuda_host* host, int index, char* err, size_t err_len) {
  g_host = host;
  g_device = index;
  cudaError_t e = cudaSetDevice(g_device);
  if (e == cudaSuccess) e = cudaStreamCreateWithFlags(&fsdp_cuda_stream, cudaStreamNonBlocking);
  if (e == cudaSuccess) e = cudaDeviceGetDefaultMemPool(&g_pool, g_device);
  if (e == cudaSuccess) {
    // freed blocks stay in the pool (up to all of them) instead of going back to the driver at
    // each synchronize: the pool is the caching allocator
    uint64_t keep = UINT64_MAX;
    e = cudaMemPoolSetAttribute(g_pool, cudaMemPoolAttrReleaseThreshold, &keep);
  }
  if (e == cudaSuccess) e = cudaMalloc(&fsdp_cuda_slot, sizeof *fsdp_cuda_slot);
  if (e == cudaSuccess) e = cudaMemsetAsync(fsdp_cuda_slot, 0, sizeof *fsdp_cuda_slot, fsdp_cuda_stream);
  if (e == cudaSuccess) e = cudaStreamSynchronize(fsdp_cuda_stream);
  if (e != cudaSuccess) {
    snprintf(err, err_len, "CUDA init failed on device %d: %s (%s)", g_device, cudaGetErrorName(e),
             cudaGetErrorString(e));
    return -1;
  }
  return 0;
}

static void cuda_device_info(char* name, size_t name_len, size_t* free_bytes, size_t* total_bytes) {
  cudaDeviceProp prop;
  if (cudaGetDeviceProperties(&prop, g_device) == cudaSuccess)
    snprintf(name, name_len, "%s (sm_%d%d)", prop.name, prop.major, prop.minor);
  else if (name_len) name[0] = 0;
  if (cudaMemGetInfo(free_bytes, total_bytes) != cudaSuccess) *free_bytes = *total_bytes = 0;
}

static void cuda_versions(char* out, size_t out_len) {
  int rt = 0, drv = 0;
  cudaRuntimeGetVersion(&rt);
  cudaDriverGetVersion(&drv);
  snprintf(out, out_len, "runtime %d, driver %d, cuBLASLt %zu", rt, drv, cublasLtGetVersion());
}

static const fsdp_cuda_library cuda_library = {FSDP_CUDA_ABI, &cuda_backend, cuda_init, cuda_device_info,
                                               cuda_versions};

extern "C" __attribute__((visibility("default"))) const fsdp_cuda_library* fsdp_cuda_library_get(void) {
  return &cuda_library;
}
