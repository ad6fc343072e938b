/*
 * tests/cudaemu/runtime.cc -- the CUDA executor's runtime: device memory, streams and events, and
 * the kernel scheduler that runs every CUDA thread of a block as a fiber (emu.h says what a kernel
 * sees; include/cuda_runtime.h what the host sees). One kernel launch, from the call to its end:
 *
 *   1. launch()        checks the geometry against a GPU's limits (a refusal is the launch's
 *                      error: cudaGetLastError returns it, its message names the kernel, where it
 *                      was launched and the geometry), notes the kernel for the coverage list and
 *                      queues the kernel on its stream
 *   2. the stream      a host thread per stream runs its queue in order (the legacy stream 0:
 *                      the caller, at once); a kernel runs its blocks one after the other
 *   3. a block         gets a fiber per CUDA thread (a stack each, from this host thread's pool)
 *                      and runs them round robin: each runs until it returns or waits at a
 *                      __syncthreads() or a warp operation; when no fiber can run, the waits are
 *                      resolved: a warp operation whose lanes have all arrived completes, a barrier
 *                      every thread waits at opens; otherwise the block cannot go on -- a divergent
 *                      barrier, a warp operation waiting for a lane that returned or waits
 *                      elsewhere -- and the kernel fails with a message naming it, its geometry,
 *                      the block, the threads and the lines
 *   4. the error       a kernel that failed leaves a sticky error (as a GPU's context after a
 *                      trap): later kernels are skipped, and every synchronising call returns it
 *
 * Fibers switch by a few instructions of assembly (x86-64: callee-saved registers, stack pointer,
 * MXCSR and the x87 control word), with AddressSanitizer's and ThreadSanitizer's fiber
 * annotations when the executor is built with them (make cuda-emu-check).
 *
 * Device memory is the host's heap (aligned to 256 bytes, filled with 0xff bytes: a read of
 * memory nobody wrote gives NaN), with a registry of the allocations, so a copy or a library call
 * given a host pointer where a device pointer belongs is refused, as a GPU would fault.
 */
#include "runtime.h"

#include <errno.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <deque>
#include <map>
#include <mutex>
#include <set>
#include <string>
#include <thread>
#include <vector>

#if defined(__SANITIZE_ADDRESS__)
#include <sanitizer/asan_interface.h>
#include <sanitizer/common_interface_defs.h>
#define EMU_ASAN 1
#endif
// Under ThreadSanitizer this file itself is built without it (-DFSDP_EMU_TSAN): the scheduler's
// own bookkeeping, shared by the fibers of a block, is not part of what a kernel does; the
// kernels (the .cu files) and the library stand-ins are instrumented, and this file tells TSan
// about the fibers and the synchronisation of barriers, warps and launches.
#if defined(FSDP_EMU_TSAN)
#include <sanitizer/tsan_interface.h>
#define EMU_TSAN 1
#elif defined(__SANITIZE_THREAD__)
#error "build runtime.cc without -fsanitize=thread, with -DFSDP_EMU_TSAN (see above)"
#endif

namespace fsdp_emu {

// ---- limits of the device it stands for (an H100's) ------------------------------------------------------
static const unsigned MAX_THREADS = 1024, MAX_BLOCK_X = 1024, MAX_BLOCK_Y = 1024, MAX_BLOCK_Z = 64;
static const unsigned long long MAX_GRID_X = 2147483647ull;
static const unsigned MAX_GRID_YZ = 65535;
static const size_t SHARED_DEFAULT = 48 * 1024, SHARED_OPTIN = 227 * 1024;
static const size_t DEVICE_BYTES = (size_t)16 << 30;  // what cudaMemGetInfo reports in all

// ---- errors ------------------------------------------------------------------------------------------------------
static thread_local cudaError_t t_last = cudaSuccess;      // a launch's error, until cudaGetLastError
static thread_local cudaError_t t_msg_code = cudaSuccess;  // the code t_last_msg explains (kept after that)
static thread_local char t_last_msg[1024];
static std::mutex g_err_mu;
static cudaError_t g_sticky = cudaSuccess;  // a kernel's failure: every synchronising call returns it
static char g_sticky_msg[2048];

static void vset_last(cudaError_t e, const char* fmt, va_list ap) {
  t_last = t_msg_code = e;
  vsnprintf(t_last_msg, sizeof t_last_msg, fmt, ap);
  fprintf(stderr, "cudaemu: %s\n", t_last_msg);
}
static cudaError_t set_last(cudaError_t e, const char* fmt, ...) __attribute__((format(printf, 2, 3)));
static cudaError_t set_last(cudaError_t e, const char* fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  vset_last(e, fmt, ap);
  va_end(ap);
  return e;
}
void fail_sticky(cudaError_t e, const char* fmt, ...) {
  std::lock_guard<std::mutex> lk(g_err_mu);
  if (g_sticky != cudaSuccess) return;  // the first failure is the one reported
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(g_sticky_msg, sizeof g_sticky_msg, fmt, ap);
  va_end(ap);
  g_sticky = e;
  fprintf(stderr, "cudaemu: %s\n", g_sticky_msg);
}
static cudaError_t sticky(void) {
  std::lock_guard<std::mutex> lk(g_err_mu);
  return g_sticky;
}
bool failed(void) { return sticky() != cudaSuccess; }

}  // namespace fsdp_emu
using namespace fsdp_emu;

static const char* error_name(cudaError_t e) {
  switch (e) {
    case cudaSuccess: return "cudaSuccess";
    case cudaErrorInvalidValue: return "cudaErrorInvalidValue";
    case cudaErrorMemoryAllocation: return "cudaErrorMemoryAllocation";
    case cudaErrorInitializationError: return "cudaErrorInitializationError";
    case cudaErrorInvalidConfiguration: return "cudaErrorInvalidConfiguration";
    case cudaErrorInvalidDevice: return "cudaErrorInvalidDevice";
    case cudaErrorInvalidResourceHandle: return "cudaErrorInvalidResourceHandle";
    case cudaErrorNotReady: return "cudaErrorNotReady";
    case cudaErrorIllegalAddress: return "cudaErrorIllegalAddress";
    case cudaErrorLaunchOutOfResources: return "cudaErrorLaunchOutOfResources";
    case cudaErrorLaunchFailure: return "cudaErrorLaunchFailure";
    case cudaErrorIllegalInstruction: return "cudaErrorIllegalInstruction";
    default: return "cudaErrorUnknown";
  }
}
const char* cudaGetErrorName(cudaError_t e) { return error_name(e); }
// the message of the error this thread or a kernel last raised with this code, else CUDA's text
const char* cudaGetErrorString(cudaError_t e) {
  if (e != cudaSuccess) {
    std::lock_guard<std::mutex> lk(g_err_mu);
    if (e == g_sticky) return g_sticky_msg;
  }
  if (e == t_msg_code && t_last_msg[0]) return t_last_msg;
  switch (e) {
    case cudaSuccess: return "no error";
    case cudaErrorInvalidValue: return "invalid argument";
    case cudaErrorMemoryAllocation: return "out of memory";
    case cudaErrorInvalidConfiguration: return "invalid configuration argument";
    case cudaErrorNotReady: return "device not ready";
    default: return "unspecified launch failure";
  }
}
cudaError_t cudaGetLastError(void) {
  cudaError_t e = t_last;
  t_last = cudaSuccess;
  return e != cudaSuccess ? e : sticky();
}
cudaError_t cudaPeekAtLastError(void) { return t_last != cudaSuccess ? t_last : sticky(); }

// ---- the device -----------------------------------------------------------------------------------------------
cudaError_t cudaSetDevice(int device) {
  return device == 0 ? cudaSuccess
                     : set_last(cudaErrorInvalidDevice, "cudaSetDevice(%d): the executor has device 0 only", device);
}
cudaError_t cudaGetDevice(int* device) {
  *device = 0;
  return cudaSuccess;
}
cudaError_t cudaGetDeviceCount(int* count) {
  *count = 1;
  return cudaSuccess;
}
cudaError_t cudaGetDeviceProperties(cudaDeviceProp* p, int device) {
  if (device != 0) return set_last(cudaErrorInvalidDevice, "cudaGetDeviceProperties(%d): no such device", device);
  memset(p, 0, sizeof *p);
  snprintf(p->name, sizeof p->name, "CUDA executor on the CPU (cudaemu)");
  p->totalGlobalMem = DEVICE_BYTES;
  p->sharedMemPerBlock = SHARED_DEFAULT;
  p->sharedMemPerBlockOptin = SHARED_OPTIN;
  p->warpSize = 32;
  p->maxThreadsPerBlock = MAX_THREADS;
  p->maxThreadsDim[0] = MAX_BLOCK_X;
  p->maxThreadsDim[1] = MAX_BLOCK_Y;
  p->maxThreadsDim[2] = MAX_BLOCK_Z;
  p->maxGridSize[0] = (int)MAX_GRID_X;
  p->maxGridSize[1] = p->maxGridSize[2] = MAX_GRID_YZ;
  p->major = 9;  // (the H100's limits above)
  p->minor = 0;
  p->multiProcessorCount = 1;
  return cudaSuccess;
}
cudaError_t cudaRuntimeGetVersion(int* v) {
  *v = 13000;
  return cudaSuccess;
}
cudaError_t cudaDriverGetVersion(int* v) {
  *v = 0;  // (no driver: the executor)
  return cudaSuccess;
}

// ---- memory ---------------------------------------------------------------------------------------------------
namespace fsdp_emu {
static std::mutex g_mem_mu;
// (The executor's state outlives the process's static destructors: a stream's thread may still run
// a queued free while exit() destroys statics, so the containers are made once and never freed.)
static std::map<uintptr_t, size_t>& g_allocs = *new std::map<uintptr_t, size_t>;  // start -> bytes
static size_t g_allocated;

static void* device_alloc(size_t n) {
  void* p = NULL;
  if (posix_memalign(&p, 256, n ? n : 1)) return NULL;
  memset(p, 0xff, n);  // fresh memory holds no zeros to rely on
  std::lock_guard<std::mutex> lk(g_mem_mu);
  g_allocs[(uintptr_t)p] = n;
  g_allocated += n;
  return p;
}
static bool device_free(void* p) {
  if (!p) return true;
  size_t n;
  {
    std::lock_guard<std::mutex> lk(g_mem_mu);
    auto it = g_allocs.find((uintptr_t)p);
    if (it == g_allocs.end()) return false;
    n = it->second;
    g_allocated -= n;
    g_allocs.erase(it);
  }
  memset(p, 0xff, n);  // poison: a late reader gets NaN
  free(p);
  return true;
}
bool is_device(const void* p, size_t n) {
  std::lock_guard<std::mutex> lk(g_mem_mu);
  auto it = g_allocs.upper_bound((uintptr_t)p);
  if (it == g_allocs.begin()) return false;
  --it;
  uintptr_t a = (uintptr_t)p;
  return a >= it->first && a - it->first + (n ? n : 1) <= (it->second ? it->second : 1);
}
}  // namespace fsdp_emu

struct fsdp_emu_pool {
  int device;
};
static fsdp_emu_pool g_pool = {0};

cudaError_t cudaMalloc(void** p, size_t n) {
  *p = device_alloc(n);
  return *p ? cudaSuccess : set_last(cudaErrorMemoryAllocation, "cudaMalloc(%zu): out of memory", n);
}
cudaError_t cudaMemGetInfo(size_t* free_bytes, size_t* total_bytes) {
  std::lock_guard<std::mutex> lk(g_mem_mu);
  *total_bytes = DEVICE_BYTES;
  *free_bytes = g_allocated < DEVICE_BYTES ? DEVICE_BYTES - g_allocated : 0;
  return cudaSuccess;
}
cudaError_t cudaDeviceGetDefaultMemPool(cudaMemPool_t* pool, int device) {
  if (device != 0) return set_last(cudaErrorInvalidDevice, "cudaDeviceGetDefaultMemPool(%d): no such device", device);
  *pool = &g_pool;
  return cudaSuccess;
}
cudaError_t cudaMemPoolSetAttribute(cudaMemPool_t pool, cudaMemPoolAttr attr, void* value) {
  (void)value;
  if (pool != &g_pool || attr != cudaMemPoolAttrReleaseThreshold)
    return set_last(cudaErrorInvalidValue, "cudaMemPoolSetAttribute: only the default pool's release threshold");
  return cudaSuccess;  // (memory goes back to the heap at each free: ASan then sees a late use)
}

// ---- streams --------------------------------------------------------------------------------------------------
// A stream's host thread runs its queue in order. idle: nothing queued and nothing running.
struct fsdp_emu_stream {
  std::mutex mu;
  std::condition_variable cv;
  std::deque<std::pair<const char*, std::function<void()>>> q;
  bool running = false, quit = false;
  std::thread worker;
};

namespace fsdp_emu {
static void stream_main(fsdp_emu_stream* s) {
  for (;;) {
    std::pair<const char*, std::function<void()>> job;
    {
      std::unique_lock<std::mutex> lk(s->mu);
      s->cv.wait(lk, [s] { return s->quit || !s->q.empty(); });
      if (s->q.empty()) return;
      job = std::move(s->q.front());
      s->q.pop_front();
      s->running = true;
    }
    job.second();
    {
      std::lock_guard<std::mutex> lk(s->mu);
      s->running = false;
    }
    s->cv.notify_all();
  }
}
void enqueue(cudaStream_t s, const char* what, std::function<void()> fn) {
  if (!s) {  // the legacy stream: at once (the executor's streams are all non-blocking)
    fn();
    return;
  }
  {
    std::lock_guard<std::mutex> lk(s->mu);
    s->q.emplace_back(what, std::move(fn));
  }
  s->cv.notify_all();
}
static void stream_drain(cudaStream_t s) {
  if (!s) return;
  std::unique_lock<std::mutex> lk(s->mu);
  s->cv.wait(lk, [s] { return s->q.empty() && !s->running; });
}
static std::mutex g_streams_mu;
static std::set<cudaStream_t>& g_streams = *new std::set<cudaStream_t>;
}  // namespace fsdp_emu

cudaError_t cudaStreamCreateWithFlags(cudaStream_t* out, unsigned flags) {
  (void)flags;  // (every stream of the executor is non-blocking: the legacy stream runs at once)
  cudaStream_t s = new fsdp_emu_stream;
  s->worker = std::thread(stream_main, s);
  std::lock_guard<std::mutex> lk(g_streams_mu);
  g_streams.insert(s);
  *out = s;
  return cudaSuccess;
}
cudaError_t cudaStreamCreate(cudaStream_t* s) { return cudaStreamCreateWithFlags(s, cudaStreamDefault); }
cudaError_t cudaStreamDestroy(cudaStream_t s) {
  if (!s) return cudaSuccess;
  {
    std::lock_guard<std::mutex> lk(g_streams_mu);
    if (!g_streams.erase(s)) return set_last(cudaErrorInvalidResourceHandle, "cudaStreamDestroy: not a stream");
  }
  {  // (CUDA lets queued work finish first)
    std::lock_guard<std::mutex> lk(s->mu);
    s->quit = true;
  }
  s->cv.notify_all();
  s->worker.join();
  delete s;
  return cudaSuccess;
}
cudaError_t cudaStreamSynchronize(cudaStream_t s) {
  stream_drain(s);
  return sticky();
}
cudaError_t cudaStreamQuery(cudaStream_t s) {
  if (!s) return sticky();
  std::lock_guard<std::mutex> lk(s->mu);
  cudaError_t e = sticky();
  return e != cudaSuccess ? e : (s->q.empty() && !s->running ? cudaSuccess : cudaErrorNotReady);
}
cudaError_t cudaDeviceSynchronize(void) {
  std::vector<cudaStream_t> all;
  {
    std::lock_guard<std::mutex> lk(g_streams_mu);
    all.assign(g_streams.begin(), g_streams.end());
  }
  for (cudaStream_t s : all) stream_drain(s);
  return sticky();
}
cudaError_t cudaLaunchHostFunc(cudaStream_t s, cudaHostFn_t fn, void* arg) {
  enqueue(s, "host function", [fn, arg] { fn(arg); });
  return cudaSuccess;
}

// ---- events: each record has a number; a wait waits for the records made before it ---------------------------------
// An event's state is shared by its handle and by the records and waits queued on streams; the
// last of them frees it. (Counted under the mutex, not by a shared_ptr's atomics: ThreadSanitizer
// sees the mutex, and this file is built without its instrumentation.)
struct emu_event_state {
  std::mutex mu;
  std::condition_variable cv;
  uint64_t recorded = 0, completed = 0;
  int refs = 1;
};
struct fsdp_emu_event {
  emu_event_state* st;
};
static emu_event_state* event_ref(emu_event_state* st) {
  std::lock_guard<std::mutex> lk(st->mu);
  st->refs++;
  return st;
}
static void event_unref(emu_event_state* st) {
  bool last;
  {
    std::lock_guard<std::mutex> lk(st->mu);
    last = --st->refs == 0;
  }
  if (last) delete st;
}
cudaError_t cudaEventCreateWithFlags(cudaEvent_t* e, unsigned flags) {
  (void)flags;
  *e = new fsdp_emu_event{new emu_event_state};
  return cudaSuccess;
}
cudaError_t cudaEventCreate(cudaEvent_t* e) { return cudaEventCreateWithFlags(e, cudaEventDefault); }
cudaError_t cudaEventDestroy(cudaEvent_t e) {
  event_unref(e->st);  // (queued records and waits hold theirs)
  delete e;
  return cudaSuccess;
}
cudaError_t cudaEventRecord(cudaEvent_t e, cudaStream_t s) {
  emu_event_state* st = event_ref(e->st);
  uint64_t gen;
  {
    std::lock_guard<std::mutex> lk(st->mu);
    gen = ++st->recorded;
  }
  enqueue(s, "event record", [st, gen] {
    {
      std::lock_guard<std::mutex> lk(st->mu);
      if (gen > st->completed) st->completed = gen;
    }
    st->cv.notify_all();
    event_unref(st);
  });
  return cudaSuccess;
}
static void event_await(emu_event_state* st, uint64_t gen) {
  std::unique_lock<std::mutex> lk(st->mu);
  st->cv.wait(lk, [&] { return st->completed >= gen; });
}
cudaError_t cudaStreamWaitEvent(cudaStream_t s, cudaEvent_t e, unsigned flags) {
  (void)flags;
  emu_event_state* st = event_ref(e->st);
  uint64_t gen;
  {
    std::lock_guard<std::mutex> lk(st->mu);
    gen = st->recorded;
  }
  enqueue(s, "event wait", [st, gen] {
    event_await(st, gen);
    event_unref(st);
  });
  return cudaSuccess;
}
cudaError_t cudaEventSynchronize(cudaEvent_t e) {
  uint64_t gen;
  {
    std::lock_guard<std::mutex> lk(e->st->mu);
    gen = e->st->recorded;
  }
  event_await(e->st, gen);
  return sticky();
}
cudaError_t cudaEventQuery(cudaEvent_t e) {
  std::lock_guard<std::mutex> lk(e->st->mu);
  return e->st->completed >= e->st->recorded ? sticky() : cudaErrorNotReady;
}

// ---- memory in stream order ------------------------------------------------------------------------------------------
cudaError_t cudaMallocAsync(void** p, size_t n, cudaStream_t s) {
  (void)s;  // (usable by the stream's later work at once: the allocation is made now)
  return cudaMalloc(p, n);
}
cudaError_t cudaMallocFromPoolAsync(void** p, size_t n, cudaMemPool_t pool, cudaStream_t s) {
  if (pool != &g_pool) return set_last(cudaErrorInvalidValue, "cudaMallocFromPoolAsync: not the default pool");
  return cudaMallocAsync(p, n, s);
}
cudaError_t cudaFree(void* p) {
  cudaDeviceSynchronize();  // (cudaFree waits for the device)
  if (!device_free(p)) return set_last(cudaErrorInvalidValue, "cudaFree(%p): not a device allocation", p);
  return cudaSuccess;
}
// page-locked host memory: plain aligned host memory here, kept in its own list so that freeing it
// any other way, or freeing anything else with cudaFreeHost, is the error CUDA gives
static std::map<uintptr_t, size_t>& g_host_allocs = *new std::map<uintptr_t, size_t>;  // start -> bytes
cudaError_t cudaMallocHost(void** p, size_t n) {
  *p = NULL;
  if (posix_memalign(p, 256, n ? n : 1))
    return set_last(cudaErrorMemoryAllocation, "cudaMallocHost(%zu): out of memory", n);
  std::lock_guard<std::mutex> lk(g_mem_mu);
  g_host_allocs[(uintptr_t)*p] = n;
  return cudaSuccess;
}
cudaError_t cudaFreeHost(void* p) {
  cudaDeviceSynchronize();  // (cudaFreeHost waits for the device)
  {
    std::lock_guard<std::mutex> lk(g_mem_mu);
    if (!g_host_allocs.erase((uintptr_t)p))
      return set_last(cudaErrorInvalidValue, "cudaFreeHost(%p): not a cudaMallocHost allocation", p);
  }
  free(p);
  return cudaSuccess;
}
cudaError_t cudaFreeAsync(void* p, cudaStream_t s) {
  if (p && !is_device(p, 0)) return set_last(cudaErrorInvalidValue, "cudaFreeAsync(%p): not a device allocation", p);
  enqueue(s, "free", [p] { device_free(p); });
  return cudaSuccess;
}

// the sides of a copy that must be device memory, by its kind
static cudaError_t check_copy(const char* op, void* dst, const void* src, size_t n, cudaMemcpyKind kind) {
  bool dst_dev = kind == cudaMemcpyHostToDevice || kind == cudaMemcpyDeviceToDevice;
  bool src_dev = kind == cudaMemcpyDeviceToHost || kind == cudaMemcpyDeviceToDevice;
  if (kind == cudaMemcpyDefault) {
    dst_dev = is_device(dst, 0);
    src_dev = is_device(src, 0);
  }
  if (dst_dev && !is_device(dst, n))
    return set_last(cudaErrorInvalidValue, "%s: destination %p (%zu bytes) is not device memory", op, dst, n);
  if (src_dev && !is_device(src, n))
    return set_last(cudaErrorInvalidValue, "%s: source %p (%zu bytes) is not device memory", op, src, n);
  if (!dst_dev && is_device(dst, 0))
    return set_last(cudaErrorInvalidValue, "%s: destination %p is device memory, the kind says host", op, dst);
  if (!src_dev && is_device(src, 0))
    return set_last(cudaErrorInvalidValue, "%s: source %p is device memory, the kind says host", op, src);
  return cudaSuccess;
}
cudaError_t cudaMemcpy(void* dst, const void* src, size_t n, cudaMemcpyKind kind) {
  if (!n) return sticky();
  cudaError_t e = check_copy("cudaMemcpy", dst, src, n, kind);
  if (e != cudaSuccess) return e;
  memcpy(dst, src, n);  // (on the legacy stream, which waits for no non-blocking stream)
  return sticky();
}
cudaError_t cudaMemcpyAsync(void* dst, const void* src, size_t n, cudaMemcpyKind kind, cudaStream_t s) {
  if (!n) return cudaSuccess;
  cudaError_t e = check_copy("cudaMemcpyAsync", dst, src, n, kind);
  if (e != cudaSuccess) return e;
  bool from_host = kind == cudaMemcpyHostToDevice || kind == cudaMemcpyHostToHost ||
                   (kind == cudaMemcpyDefault && !is_device(src, 0));
  bool to_host = kind == cudaMemcpyDeviceToHost || kind == cudaMemcpyHostToHost ||
                 (kind == cudaMemcpyDefault && !is_device(dst, 0));
  if (from_host) {                    // pageable source: its bytes are taken now (the caller may reuse it at once)
    char* staged = (char*)malloc(n);  // (the job frees it: no ownership shared across threads)
    memcpy(staged, src, n);
    enqueue(s, "copy", [dst, staged, n] {
      memcpy(dst, staged, n);
      free(staged);
    });
  } else {
    enqueue(s, "copy", [dst, src, n] { memcpy(dst, src, n); });
  }
  if (to_host) stream_drain(s);  // to pageable memory: returns once the bytes arrived
  return cudaSuccess;
}
cudaError_t cudaMemsetAsync(void* p, int value, size_t n, cudaStream_t s) {
  if (!n) return cudaSuccess;
  if (!is_device(p, n))
    return set_last(cudaErrorInvalidValue, "cudaMemsetAsync: %p (%zu bytes) is not device memory", p, n);
  enqueue(s, "memset", [p, value, n] { memset(p, value, n); });
  return cudaSuccess;
}
cudaError_t cudaMemset(void* p, int value, size_t n) { return cudaMemsetAsync(p, value, n, 0); }
cudaError_t cudaMemset2DAsync(void* p, size_t pitch, int value, size_t width, size_t height, cudaStream_t s) {
  if (!width || !height) return cudaSuccess;
  if (width > pitch)
    return set_last(cudaErrorInvalidValue, "cudaMemset2DAsync: width %zu is more than the pitch %zu", width, pitch);
  if (!is_device(p, pitch * (height - 1) + width))
    return set_last(cudaErrorInvalidValue,
                    "cudaMemset2DAsync: %p (%zu rows of %zu bytes, pitch %zu) is not device memory", p, height, width,
                    pitch);
  enqueue(s, "memset", [p, pitch, value, width, height] {
    for (size_t r = 0; r < height; r++) memset((char*)p + r * pitch, value, width);
  });
  return cudaSuccess;
}

// ---- fibers --------------------------------------------------------------------------------------------------------
// fsdp_emu_switch(save, to): saves this context's callee-saved registers on its stack and its
// stack pointer in *save, then continues the context whose stack pointer is `to`. A fresh
// context's stack holds (from its stack pointer up) r15, r14, r13 (the argument), r12 (the
// function), rbx, rbp and fsdp_emu_fiber_start as the return address. (MXCSR and the x87 control
// word are not switched: no kernel changes a rounding mode, so every fiber has the thread's.)
#if defined(__x86_64__)
extern "C" void fsdp_emu_switch(void** save, void* to);
extern "C" void fsdp_emu_fiber_start(void);
__asm__(".text\n"
        ".globl fsdp_emu_switch\n"
        ".hidden fsdp_emu_switch\n"
        ".type fsdp_emu_switch,@function\n"
        "fsdp_emu_switch:\n"
        "  pushq %rbp\n"
        "  pushq %rbx\n"
        "  pushq %r12\n"
        "  pushq %r13\n"
        "  pushq %r14\n"
        "  pushq %r15\n"
        "  movq %rsp, (%rdi)\n"
        "  movq %rsi, %rsp\n"
        "  popq %r15\n"
        "  popq %r14\n"
        "  popq %r13\n"
        "  popq %r12\n"
        "  popq %rbx\n"
        "  popq %rbp\n"
        "  ret\n"
        ".size fsdp_emu_switch, .-fsdp_emu_switch\n"
        ".globl fsdp_emu_fiber_start\n"
        ".hidden fsdp_emu_fiber_start\n"
        ".type fsdp_emu_fiber_start,@function\n"
        "fsdp_emu_fiber_start:\n"
        "  movq %r13, %rdi\n"
        "  callq *%r12\n"
        "  ud2\n"
        ".size fsdp_emu_fiber_start, .-fsdp_emu_fiber_start\n");
#else
#error "the CUDA executor switches fibers on x86-64 only"
#endif

namespace fsdp_emu {
// per CUDA thread (the lowest page is a guard); under ThreadSanitizer, which maps and unmaps a
// fresh one for every thread (stack_take), less to map and clear
#ifdef EMU_TSAN
static const size_t STACK_BYTES = 32 * 1024;
#else
static const size_t STACK_BYTES = 256 * 1024;
#endif

enum { NEW, READY, AT_BARRIER, AT_WARP, DONE };  // (NEW: not started, no stack yet)
struct kernel_task;
struct block_state;
struct thread_ctx {
  uint3 idx;
  int lane;  // linear thread index in the block
  int state;
  void* sp;
  char* stack;
  block_state* block;
  site at;  // where it waits
  // a warp operation: op, mask, this lane's value, its argument and width, and its result
  warp_op op;
  unsigned mask;
  uint64_t value, result;
  uint32_t vote;
  int arg, width;
#ifdef EMU_ASAN
  void* fake_stack;
#endif
#ifdef EMU_TSAN
  void* tsan_fiber;
#endif
};
static const int MAX_SHARED_VARS = 64;  // __shared__ variables a kernel's threads may declare
struct shared_entry {
  const void* key;
  void* ptr;
  size_t bytes;
  const char* name;
};
struct block_state {
  block_ctx ctx;
  kernel_task* task;
  thread_ctx* threads;
  int n;                                 // threads
  shared_entry shared[MAX_SHARED_VARS];  // (a fixed table: a fiber allocates nothing of the scheduler's)
  int n_shared;
  int at_barrier;   // threads waiting at a __syncthreads()
  int at_warp[32];  // lanes of each warp waiting in a warp operation
  size_t static_shared;
  void* dynamic;
  bool failed;
  char barrier_sync, warp_sync[32];  // (their addresses: ThreadSanitizer's synchronisation objects)
};
struct kernel_task {
  launch_info info;
  std::function<void()> body;
  size_t shmem_limit;  // dynamic shared memory allowed (48 KiB, or the kernel's opt-in)
  char start_sync, end_sync;
  std::vector<void*> deferred;  // (ThreadSanitizer: the blocks' shared memory, freed at the kernel's end)
  uint64_t resumes = 0;         // fiber switches into its threads (FSDP_CUDA_EMU_STATS)
};

// this host thread's scheduler: its stack pointer while a fiber runs, the fibers' stacks
// (initial-exec: threadIdx is read through these in every kernel loop, without __tls_get_addr)
#define EMU_TLS thread_local __attribute__((tls_model("initial-exec")))
static EMU_TLS void* t_sched_sp;
static EMU_TLS thread_ctx* t_cur;
static EMU_TLS block_state* t_block;
// the free fiber stacks of this host thread, unmapped when it ends (a stream's thread, at its destroy)
struct stack_pool {
  std::vector<char*> free;
  ~stack_pool() {
    for (char* s : free) munmap(s, STACK_BYTES);
  }
};
static thread_local stack_pool t_pool;
#ifdef EMU_ASAN
static thread_local const void* t_sched_stack_bottom;
static thread_local size_t t_sched_stack_size;
static thread_local void* t_sched_fake;
static thread_local bool t_from_sched;  // the switch under way left the scheduler
#endif
#ifdef EMU_TSAN
static thread_local void* t_sched_fiber;
#endif

uint3 thread_index(void) { return t_cur->idx; }
block_ctx block_of(void) { return t_block->ctx; }

#ifndef EMU_TSAN
static char* map_stack(void) {
  void* m = mmap(NULL, STACK_BYTES, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (m == MAP_FAILED) {
    fprintf(stderr, "cudaemu: cannot map a fiber stack (%s)\n", strerror(errno));
    abort();
  }
  mprotect(m, 4096, PROT_NONE);  // the guard page: a stack overflow faults
  return (char*)m;
}
#endif
// A thread gets a stack when it starts and gives it back when it returns, so the threads of a
// kernel without barriers all run on one stack, hot in the caches (a stack per thread, cold each
// time, made the switches the executor's cost); a thread that waits keeps its own.
//
// Under ThreadSanitizer a stack is a heap block: TSan takes each allocation as new memory,
// whatever ran on it before (a stack another thread reused would otherwise look to it like memory
// two unsynchronised threads share). It is allocated in the scheduler's name, which the new
// thread's start follows (start_sync), and freed in the name of the thread that ran on it, whose
// own accesses come before. (Mapping a fresh stack per thread did the same at a syscall each.)
#ifdef EMU_TSAN
static char* stack_take(void) {
  void* cur = __tsan_get_current_fiber();
  __tsan_switch_to_fiber(t_sched_fiber, __tsan_switch_to_fiber_no_sync);
  char* s = (char*)aligned_alloc(4096, STACK_BYTES);
  __tsan_release(&t_block->task->start_sync);
  __tsan_switch_to_fiber(cur, __tsan_switch_to_fiber_no_sync);
  return s;
}
static void stack_give(thread_ctx* th) {
  void* cur = __tsan_get_current_fiber();
  __tsan_switch_to_fiber(th->tsan_fiber, __tsan_switch_to_fiber_no_sync);
  free(th->stack);
  __tsan_switch_to_fiber(cur, __tsan_switch_to_fiber_no_sync);
  th->stack = NULL;
}
#else
static char* stack_take(void) {
  if (!t_pool.free.empty()) {
    char* s = t_pool.free.back();
    t_pool.free.pop_back();
    return s;
  }
  return map_stack();
}
static void stack_give(thread_ctx* th) {
  t_pool.free.push_back(th->stack);
  th->stack = NULL;
}
#endif

// One switch between contexts: `from` and `to` are threads of the block, or NULL for the
// scheduler; a `from` that returned (last) never runs again, and its stack goes back to the pool
// once the switch is over (reap: no context gives back the stack it runs on).
static EMU_TLS thread_ctx* t_zombie;
static void reap(void) {
  if (!t_zombie) return;
  stack_give(t_zombie);
  t_zombie = NULL;
}
static void switch_context(thread_ctx* from, thread_ctx* to, bool last) {
  void** save = from ? &from->sp : &t_sched_sp;
  void* sp = to ? to->sp : t_sched_sp;
  if (last) t_zombie = from;
  t_cur = to;
  if (to) to->block->task->resumes++;
#ifdef EMU_ASAN
  void** fake = from ? (last ? NULL : &from->fake_stack) : &t_sched_fake;
  if (to) __sanitizer_start_switch_fiber(fake, to->stack, STACK_BYTES);
  else __sanitizer_start_switch_fiber(fake, t_sched_stack_bottom, t_sched_stack_size);
  t_from_sched = !from;
#endif
#ifdef EMU_TSAN
  __tsan_switch_to_fiber(to ? to->tsan_fiber : t_sched_fiber, __tsan_switch_to_fiber_no_sync);
#endif
  fsdp_emu_switch(save, sp);
  // (back in `from`, some time later)
#ifdef EMU_ASAN
  __sanitizer_finish_switch_fiber(from ? from->fake_stack : t_sched_fake, NULL, NULL);
#endif
  reap();
}

static void fiber_init(thread_ctx* th);
// From the running thread, which just returned or began to wait, to the next thread of this pass
// that can run (the one with the next index: passes go round the block in order), or back to the
// scheduler when none is left: one switch per thread and pass, not two.
static void pass_on(thread_ctx* th, bool last) {
  block_state* b = th->block;
  thread_ctx* next = NULL;
  for (int i = th->lane + 1; i < b->n && !b->failed && !next; i++) {
    thread_ctx* t = &b->threads[i];
    if (t->state == NEW) fiber_init(t);
    if (t->state == READY) next = t;
  }
  switch_context(th, next, last);
}

static void fiber_main(thread_ctx* th) {
#ifdef EMU_ASAN
  // (the scheduler's stack, when it is the one this thread came from: where switches back go)
  const void* bottom;
  size_t size;
  __sanitizer_finish_switch_fiber(NULL, &bottom, &size);
  if (t_from_sched) {
    t_sched_stack_bottom = bottom;
    t_sched_stack_size = size;
  }
#endif
  reap();
#ifdef EMU_TSAN
  __tsan_acquire(&th->block->task->start_sync);  // after everything before the launch in stream order
#endif
  th->block->task->body();
#ifdef EMU_TSAN
  __tsan_release(&th->block->task->end_sync);
#endif
  th->state = DONE;
  pass_on(th, true);
  __builtin_trap();  // (never resumed)
}

#ifdef EMU_TSAN
// ThreadSanitizer's fibers: one pool for the process, handed out round robin -- creating and
// destroying one per CUDA thread cost more than the kernels, TSan keeps at most 8128 alive, and
// its vector clocks grow with every thread it has seen. One fiber is one thread to TSan, so two
// CUDA threads it serves are ordered: that happens only to threads started 2048 apart (blocks 2
// apart at 1024 threads, 8 at the backend's 256), and a race between two such would go unseen. (A plain array, made once: this file's own memory calls are ones TSan
// intercepts, and one made from a CUDA thread's fiber would look to it like that thread's access.)
// (An atomic counter, not a mutex: a lock taken from CUDA threads' fibers would order them for TSan.)
static const int TSAN_FIBERS = 2048;
static void** g_tsan_fibers;
static std::mutex g_tsan_mu;  // (the array's making only, in a scheduler)
static unsigned g_tsan_next;
static void* tsan_fiber_next(void) {
  unsigned i = __atomic_fetch_add(&g_tsan_next, 1, __ATOMIC_RELAXED) % TSAN_FIBERS;
  void* f = __atomic_load_n(&g_tsan_fibers[i], __ATOMIC_ACQUIRE);
  if (!f) {
    void* mine = __tsan_create_fiber(0);
    if (__atomic_compare_exchange_n(&g_tsan_fibers[i], &f, mine, false, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE)) f = mine;
    else __tsan_destroy_fiber(mine);
  }
  return f;
}
#endif

static void fiber_init(thread_ctx* th) {
  th->stack = stack_take();
#ifdef EMU_ASAN
  // (a reused stack still carries the redzones of the frames its last thread left on it)
  __asan_unpoison_memory_region(th->stack + 4096, STACK_BYTES - 4096);
#endif
  // Each stack's top is moved down by its own multiple of a cache line (up to a quarter of the
  // stack): the stacks are STACK_BYTES apart, so their tops would otherwise all fall in the same
  // cache sets, and the threads of a block evict each other's frames at every switch.
  uintptr_t color = (uintptr_t)th->stack / STACK_BYTES * 17 % (STACK_BYTES / 256) * 64;
  uintptr_t top = ((uintptr_t)th->stack + STACK_BYTES - color) & ~(uintptr_t)15;
  // (the return address at top - 8: fiber_start's call then leaves the stack 16-byte aligned)
  uint64_t* sp = (uint64_t*)(top - 56);
  sp[0] = 0;                                 // r15
  sp[1] = 0;                                 // r14
  sp[2] = (uint64_t)(uintptr_t)th;           // r13: the argument
  sp[3] = (uint64_t)(uintptr_t)&fiber_main;  // r12: the function
  sp[4] = 0;                                 // rbx
  sp[5] = 0;                                 // rbp
  sp[6] = (uint64_t)(uintptr_t)&fsdp_emu_fiber_start;
  th->sp = sp;
  th->state = READY;
#ifdef EMU_ASAN
  th->fake_stack = NULL;
#endif
#ifdef EMU_TSAN
  th->tsan_fiber = tsan_fiber_next();
#endif
}

// ---- blocks -----------------------------------------------------------------------------------------------------
static std::string geometry(const launch_info& in) {
  char b[200];
  snprintf(b, sizeof b, "grid (%u, %u, %u), block (%u, %u, %u), %zu bytes of dynamic shared memory", in.grid.x,
           in.grid.y, in.grid.z, in.block.x, in.block.y, in.block.z, in.shmem);
  return b;
}
static const char* base_name(const char* path) {
  const char* s = strrchr(path, '/');
  return s ? s + 1 : path;
}
// a kernel's failure: the message names the kernel, where it was launched, its geometry and the block
static void block_fail(block_state* b, const char* fmt, ...) __attribute__((format(printf, 2, 3)));
static void block_fail(block_state* b, const char* fmt, ...) {
  if (b->failed) return;
  b->failed = true;
  char what[1400];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(what, sizeof what, fmt, ap);
  va_end(ap);
  const launch_info& in = b->task->info;
  fail_sticky(cudaErrorLaunchFailure, "kernel %s (launched at %s:%d; %s), block (%u, %u, %u): %s", in.kernel,
              base_name(in.at.file), in.at.line, geometry(in).c_str(), b->ctx.idx.x, b->ctx.idx.y, b->ctx.idx.z, what);
}

// "threads 3-7, 12" of the threads for which pick(i) holds
template <typename F>
static std::string thread_list(block_state* b, thread_ctx* th, F pick) {
  std::string s;
  int n = 0;
  for (int i = 0; i < b->n; i++) {
    if (!pick(&th[i])) continue;
    int j = i;
    while (j + 1 < b->n && pick(&th[j + 1])) j++;
    char r[40];
    snprintf(r, sizeof r, j > i ? "%s%d-%d" : "%s%d", n ? ", " : "", i, j);
    s += r;
    n++;
    i = j;
  }
  return s.empty() ? "none" : s;
}

// the lanes a warp operation's mask names that exist in this block
static bool mask_lanes_exist(block_state* b, int warp, unsigned mask, int* missing) {
  for (int l = 0; l < 32; l++)
    if ((mask >> l & 1) && warp * 32 + l >= b->n) {
      *missing = l;
      return false;
    }
  return true;
}
static const char* op_name(warp_op op) {
  static const char* names[] = {"__shfl_sync",   "__shfl_up_sync", "__shfl_down_sync", "__shfl_xor_sync",
                                "__ballot_sync", "__all_sync",     "__any_sync",       "__syncwarp"};
  return names[op];
}

// completes the warp operation lane `first` waits in, if every lane of its mask has arrived;
// returns whether it did (an error marks the block failed)
static bool try_warp(block_state* b, thread_ctx* th, thread_ctx* w) {
  int warp = w->lane / 32;
  thread_ctx* base = &th[warp * 32];
  int nl = b->n - warp * 32 < 32 ? b->n - warp * 32 : 32;
  for (int l = 0; l < nl; l++) {
    if (!(w->mask >> l & 1)) continue;
    thread_ctx* o = &base[l];
    if (o->state == READY || o->state == NEW) return false;  // still on its way
    if (o->state == DONE) {
      block_fail(b, "%s at %s:%d (lanes of mask 0x%08x, warp %d): lane %d returned without calling it", op_name(w->op),
                 base_name(w->at.file), w->at.line, w->mask, warp, l);
      return false;
    }
    if (o->state == AT_BARRIER) {
      block_fail(b, "%s at %s:%d (mask 0x%08x, warp %d) waits for lane %d, which waits at __syncthreads() at %s:%d",
                 op_name(w->op), base_name(w->at.file), w->at.line, w->mask, warp, l, base_name(o->at.file),
                 o->at.line);
      return false;
    }
    if (o->op != w->op || o->mask != w->mask || o->at.line != w->at.line || o->at.file != w->at.file) {
      block_fail(b,
                 "warp %d: lane %d calls %s at %s:%d with mask 0x%08x while lane %d, in that mask, calls %s at %s:%d "
                 "with mask 0x%08x",
                 warp, w->lane % 32, op_name(w->op), base_name(w->at.file), w->at.line, w->mask, l, op_name(o->op),
                 base_name(o->at.file), o->at.line, o->mask);
      return false;
    }
  }
  // every lane arrived: each gets its result
  uint32_t ballot = 0;
  int all = 1, any = 0;
  for (int l = 0; l < nl; l++)
    if (w->mask >> l & 1) {
      ballot |= (uint32_t)(base[l].value != 0) << l;
      all &= base[l].value != 0;
      any |= base[l].value != 0;
    }
  for (int l = 0; l < nl; l++) {
    if (!(w->mask >> l & 1)) continue;
    thread_ctx* o = &base[l];
    int width = o->width, seg = l & ~(width - 1), src = l;
    switch (o->op) {
      case WARP_SHFL_IDX: src = seg + (o->arg & (width - 1)); break;
      case WARP_SHFL_UP: src = l - o->arg >= seg ? l - o->arg : l; break;
      case WARP_SHFL_DOWN: src = l + o->arg < seg + width ? l + o->arg : l; break;
      case WARP_SHFL_XOR: src = ((l ^ o->arg) & ~(width - 1)) > seg ? l : (l ^ o->arg); break;
      default: break;
    }
    if (src != l && (src < 0 || src >= 32 || !(w->mask >> src & 1))) {
      block_fail(b, "%s at %s:%d: lane %d reads lane %d, which is not in the mask 0x%08x (its value is undefined)",
                 op_name(o->op), base_name(o->at.file), o->at.line, l, src, w->mask);
      return false;
    }
    o->result = base[src].value;
    o->vote = o->op == WARP_BALLOT ? ballot : o->op == WARP_ALL ? (uint32_t)all : (uint32_t)any;
  }
  for (int l = 0; l < nl; l++)
    if (w->mask >> l & 1) base[l].state = READY;
  b->at_warp[warp] -= __builtin_popcount(w->mask);
  return true;
}

// every thread waits at a __syncthreads(): if at the same one, it opens (all READY; true)
static bool open_barrier(block_state* b) {
  thread_ctx* th = b->threads;
  for (int i = 1; i < b->n; i++)
    if (th[i].state != AT_BARRIER || th[i].at.line != th[0].at.line || th[i].at.file != th[0].at.file) return false;
  for (int i = 0; i < b->n; i++) th[i].state = READY;
  b->at_barrier = 0;
  return true;
}

// no fiber can run: complete what can be completed, else name why the block is stuck
static void resolve(block_state* b, thread_ctx* th) {
  bool moved = false;
  for (int i = 0; i < b->n && !b->failed; i++)
    if (th[i].state == AT_WARP && try_warp(b, th, &th[i])) moved = true;
  if (moved || b->failed) return;
  int waiting = 0, done = 0, at_warp = 0;
  thread_ctx* first = NULL;
  for (int i = 0; i < b->n; i++) {
    if (th[i].state == AT_BARRIER) {
      waiting++;
      if (!first) first = &th[i];
    }
    done += th[i].state == DONE;
    at_warp += th[i].state == AT_WARP;
  }
  if (waiting == b->n) {
    if (open_barrier(b)) return;
    for (int i = 0; i < b->n; i++)
      if (th[i].at.line != first->at.line || th[i].at.file != first->at.file) {
        block_fail(
            b, "threads wait at different __syncthreads(): %s at %s:%d, %s at %s:%d",
            thread_list(b, th,
                        [&](thread_ctx* t) { return t->at.line == first->at.line && t->at.file == first->at.file; })
                .c_str(),
            base_name(first->at.file), first->at.line,
            thread_list(b, th,
                        [&](thread_ctx* t) { return t->at.line != first->at.line || t->at.file != first->at.file; })
                .c_str(),
            base_name(th[i].at.file), th[i].at.line);
        return;
      }
    return;
  }
  if (waiting > 0) {
    std::string others;
    if (done) others += ", threads " + thread_list(b, th, [](thread_ctx* t) { return t->state == DONE; }) + " returned";
    if (at_warp)
      others += ", threads " + thread_list(b, th, [](thread_ctx* t) { return t->state == AT_WARP; }) +
                " wait in a warp operation";
    block_fail(b,
               "__syncthreads() at %s:%d is not reached by every thread of the block: threads %s wait there%s (a "
               "divergent barrier: on a GPU, a hang or worse)",
               base_name(first->at.file), first->at.line,
               thread_list(b, th, [](thread_ctx* t) { return t->state == AT_BARRIER; }).c_str(), others.c_str());
  } else if (at_warp > 0)
    for (int i = 0; i < b->n; i++)
      if (th[i].state == AT_WARP) {
        block_fail(b, "%s at %s:%d (mask 0x%08x) can never complete: threads %s returned", op_name(th[i].op),
                   base_name(th[i].at.file), th[i].at.line, th[i].mask,
                   thread_list(b, th, [](thread_ctx* t) { return t->state == DONE; }).c_str());
        return;
      }
}

static void run_block(kernel_task* k, block_state* b, std::vector<thread_ctx>& th) {
  t_block = b;
#ifdef EMU_TSAN
  __tsan_release(&k->start_sync);  // (this block's dynamic shared memory and everything before the launch)
#endif
  const dim3& bd = k->info.block;
  b->threads = th.data();
  for (int i = 0; i < b->n; i++) {
    thread_ctx* t = &th[i];
    t->idx = uint3{(unsigned)(i % bd.x), (unsigned)(i / bd.x % bd.y), (unsigned)(i / (bd.x * bd.y))};
    t->lane = i;
    t->block = b;
    t->state = NEW;
    t->stack = NULL;
  }
  for (;;) {
    // a pass: the first thread that can run, which passes on to the others (pass_on)
    bool ran = false, live = false;
    for (int i = 0; i < b->n && !b->failed && !ran; i++) {
      if (th[i].state == NEW) fiber_init(&th[i]);
      if (th[i].state != READY) continue;
      switch_context(NULL, &th[i], false);
      ran = true;
    }
    if (b->failed) break;
    for (int i = 0; i < b->n; i++) live |= th[i].state != DONE;
    if (!live) break;
    if (!ran) {
      resolve(b, th.data());
      if (b->failed) break;
    }
  }
  t_cur = NULL;
  t_block = NULL;
  for (int i = 0; i < b->n; i++)  // (the stacks of threads a failed block left behind)
    if (th[i].stack) stack_give(&th[i]);
#ifdef EMU_TSAN
  // Every thread of the block releases the kernel's end (those that returned did; those a failed
  // block left behind do it here, on their own fibers' behalf: only TSan's view switches). The
  // scheduler acquires it after the last block, not before the next one -- the blocks of a kernel
  // stay unordered, as on a GPU -- and frees the blocks' shared memory then.
  for (int i = 0; i < b->n; i++) {
    if (th[i].state == NEW) continue;  // (never started: a failed block)
    __tsan_switch_to_fiber(th[i].tsan_fiber, __tsan_switch_to_fiber_no_sync);
    __tsan_release(&k->end_sync);
    __tsan_switch_to_fiber(t_sched_fiber, __tsan_switch_to_fiber_no_sync);
  }
  for (int i = 0; i < b->n_shared; i++) k->deferred.push_back(b->shared[i].ptr);
  k->deferred.push_back(b->dynamic);
#else
  for (int i = 0; i < b->n_shared; i++) free(b->shared[i].ptr);
  free(b->dynamic);
#endif
}

static void note_stats(const kernel_task* k, double seconds);
static double now_seconds(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return ts.tv_sec + ts.tv_nsec * 1e-9;
}

static void run_kernel(kernel_task* k) {
  if (sticky() != cudaSuccess) return;  // a failed kernel's context runs nothing more
  double t0 = now_seconds();
#ifdef EMU_ASAN
  t_sched_fake = NULL;
#endif
#ifdef EMU_TSAN
  t_sched_fiber = __tsan_get_current_fiber();
  {
    std::lock_guard<std::mutex> lk(g_tsan_mu);
    if (!g_tsan_fibers) g_tsan_fibers = (void**)calloc(TSAN_FIBERS, sizeof *g_tsan_fibers);
  }
#endif
  const launch_info& in = k->info;
  int n = (int)(in.block.x * in.block.y * in.block.z);
  std::vector<thread_ctx> th(n);
  bool failed = false;
  for (unsigned z = 0; z < in.grid.z && !failed; z++)
    for (unsigned y = 0; y < in.grid.y && !failed; y++)
      for (unsigned x = 0; x < in.grid.x && !failed; x++) {
        block_state b;
        b.ctx = block_ctx{uint3{x, y, z}, in.block, in.grid};
        b.task = k;
        b.n = n;
        b.n_shared = 0;
        b.at_barrier = 0;
        memset(b.at_warp, 0, sizeof b.at_warp);
        b.static_shared = 0;
        b.dynamic = NULL;
        b.failed = false;
        if (in.shmem) {
          b.dynamic = malloc(in.shmem);
          memset(b.dynamic, 0xff, in.shmem);
        }
        run_block(k, &b, th);
        failed = b.failed;
      }
#ifdef EMU_TSAN
  __tsan_acquire(&k->end_sync);
  for (void* p : k->deferred) free(p);
#endif
  note_stats(k, now_seconds() - t0);
}

// ---- what a CUDA thread calls ------------------------------------------------------------------------------------------
// (a byte loop, not memcpy: the scheduler's bookkeeping stays out of ThreadSanitizer's view)
static void copy_bytes(void* dst, const void* src, size_t n) {
  for (size_t i = 0; i < n; i++) ((volatile char*)dst)[i] = ((const char*)src)[i];
}

void syncthreads(site at) {
  thread_ctx* th = t_cur;
#ifdef EMU_TSAN
  __tsan_release(&th->block->barrier_sync);
#endif
  th->state = AT_BARRIER;
  th->at = at;
  // the last thread to arrive opens the barrier and goes on (resolve reports what cannot open)
  if (++th->block->at_barrier < th->block->n || !open_barrier(th->block)) pass_on(th, false);
#ifdef EMU_TSAN
  __tsan_acquire(&th->block->barrier_sync);
#endif
}

uint32_t warp_meet(site at, warp_op op, unsigned mask, const void* in, void* out, size_t n, int arg, int width) {
  thread_ctx* th = t_cur;
  block_state* b = th->block;
  int lane = th->lane % 32;
  if (!(mask >> lane & 1)) {
    block_fail(b, "%s at %s:%d: lane %d (thread %d) calls it with mask 0x%08x, which does not include the lane",
               op_name(op), base_name(at.file), at.line, lane, th->lane, mask);
  } else if (width < 1 || width > 32 || (width & (width - 1))) {
    block_fail(b, "%s at %s:%d: width %d is not a power of two from 1 to 32", op_name(op), base_name(at.file), at.line,
               width);
  } else if (b->n - th->lane / 32 * 32 < 32) {  // (a partial warp: every lane of the mask must exist)
    int missing;
    if (!mask_lanes_exist(b, th->lane / 32, mask, &missing))
      block_fail(b,
                 "%s at %s:%d: mask 0x%08x names lane %d of warp %d, which does not exist (a block of %d threads: the "
                 "warp has %d lanes)",
                 op_name(op), base_name(at.file), at.line, mask, missing, th->lane / 32, b->n,
                 b->n - th->lane / 32 * 32);
  }
  if (b->failed) {  // the kernel is over: this thread never runs on
    th->state = DONE;
    pass_on(th, true);
  }
  th->op = op;
  th->mask = mask;
  th->arg = arg;
  th->width = width;
  th->at = at;
  th->value = 0;
  copy_bytes(&th->value, in, in ? n : 0);
#ifdef EMU_TSAN
  if (op == WARP_SYNC) __tsan_release(&b->warp_sync[th->lane / 32]);
#endif
  th->state = AT_WARP;
  // the last lane of the mask to arrive completes the operation and goes on (the count of lanes
  // waiting in the warp spares the others the check)
  int w = th->lane / 32;
  if (++b->at_warp[w] < __builtin_popcount(mask) || !try_warp(b, b->threads, th)) {
    if (b->failed) {
      th->state = DONE;
      pass_on(th, true);
    }
    pass_on(th, false);
  }
#ifdef EMU_TSAN
  if (op == WARP_SYNC) __tsan_acquire(&b->warp_sync[th->lane / 32]);
#endif
  if (out) copy_bytes(out, &th->result, n);
  return th->vote;
}

void* shared_var(const void* key, size_t bytes, size_t align, const char* name, site at) {
  block_state* b = t_cur->block;
  for (int i = 0; i < b->n_shared; i++)
    if (b->shared[i].key == key) {
#ifdef EMU_TSAN
      __tsan_acquire(b->shared[i].ptr);  // (the storage exists before the block starts, as on a GPU)
#endif
      return b->shared[i].ptr;
    }
  b->static_shared += bytes;
  if (b->n_shared == MAX_SHARED_VARS) {
    block_fail(b, "more than %d __shared__ variables (the executor's table; '%s' at %s:%d)", MAX_SHARED_VARS, name,
               base_name(at.file), at.line);
    t_cur->state = DONE;
    pass_on(t_cur, true);
  }
  if (b->static_shared > SHARED_DEFAULT) {
    block_fail(b, "static shared memory of %zu bytes (with '%s' at %s:%d) is more than the %zu a block has",
               b->static_shared, name, base_name(at.file), at.line, SHARED_DEFAULT);
    t_cur->state = DONE;
    pass_on(t_cur, true);
  }
  void* p = NULL;
  if (posix_memalign(&p, align < 16 ? 16 : align, bytes ? bytes : 1)) abort();
  memset(p, 0xff, bytes);  // a read before any write gives NaN
  b->shared[b->n_shared++] = shared_entry{key, p, bytes, name};
#ifdef EMU_TSAN
  __tsan_release(p);
#endif
  return p;
}
void* dynamic_shared(site at) {
  (void)at;
  return t_cur->block->dynamic;
}

// ---- launches ---------------------------------------------------------------------------------------------------------
static std::mutex g_kernels_mu;
static std::set<std::string>& g_launched = *new std::set<std::string>;  // for the coverage list
// kernel -> its dynamic shared memory opt-in
static std::map<const void*, size_t>& g_optin = *new std::map<const void*, size_t>;

// FSDP_CUDA_EMU_STATS=1: at exit, per kernel, its launches, blocks, fiber switches and time here
struct kernel_stats {
  uint64_t launches, blocks, resumes;
  double seconds;
};
static std::map<std::string, kernel_stats>& g_stats = *new std::map<std::string, kernel_stats>;
static void print_stats(void) {
  std::lock_guard<std::mutex> lk(g_kernels_mu);
  std::vector<std::pair<std::string, kernel_stats>> v(g_stats.begin(), g_stats.end());
  std::sort(v.begin(), v.end(), [](const auto& a, const auto& b) { return a.second.seconds > b.second.seconds; });
  fprintf(stderr, "cudaemu: %-24s %9s %11s %13s %9s\n", "kernel", "launches", "blocks", "switches", "seconds");
  for (auto& e : v)
    fprintf(stderr, "cudaemu: %-24s %9llu %11llu %13llu %9.3f\n", e.first.c_str(),
            (unsigned long long)e.second.launches, (unsigned long long)e.second.blocks,
            (unsigned long long)e.second.resumes, e.second.seconds);
}
static void note_stats(const kernel_task* k, double seconds) {
  static bool on = getenv("FSDP_CUDA_EMU_STATS") && getenv("FSDP_CUDA_EMU_STATS")[0] == '1';
  if (!on) return;
  std::lock_guard<std::mutex> lk(g_kernels_mu);
  if (g_stats.empty()) atexit(print_stats);
  kernel_stats& st = g_stats[k->info.kernel];
  st.launches++;
  st.blocks += (uint64_t)k->info.grid.x * k->info.grid.y * k->info.grid.z;
  st.resumes += k->resumes;
  st.seconds += seconds;
}

// the first launch of each kernel in this process goes to $FSDP_CUDA_EMU_COVERAGE (one name a line)
static void note_coverage(const char* kernel) {
  std::lock_guard<std::mutex> lk(g_kernels_mu);
  if (!g_launched.insert(kernel).second) return;
  const char* path = getenv("FSDP_CUDA_EMU_COVERAGE");
  if (!path || !*path) return;
  FILE* f = fopen(path, "a");
  if (!f) return;
  fprintf(f, "%s\n", kernel);
  fclose(f);
}

void launch(const launch_info& in, std::function<void()> body) {
  const dim3 &g = in.grid, &b = in.block;
  unsigned long long threads = (unsigned long long)b.x * b.y * b.z;
  const char* why = NULL;
  if (!g.x || !g.y || !g.z || !threads) why = "an empty grid or block";
  else if (threads > MAX_THREADS) why = "more than 1024 threads in a block";
  else if (b.x > MAX_BLOCK_X || b.y > MAX_BLOCK_Y || b.z > MAX_BLOCK_Z) why = "a block dimension over 1024 x 1024 x 64";
  else if (g.x > MAX_GRID_X || g.y > MAX_GRID_YZ || g.z > MAX_GRID_YZ)
    why = "a grid dimension over 2^31-1 x 65535 x 65535";
  if (why) {
    set_last(cudaErrorInvalidConfiguration, "kernel %s launched at %s:%d with %s: %s", in.kernel, base_name(in.at.file),
             in.at.line, geometry(in).c_str(), why);
    return;
  }
  size_t limit = SHARED_DEFAULT;
  {
    std::lock_guard<std::mutex> lk(g_kernels_mu);
    auto it = g_optin.find(in.fn);
    if (it != g_optin.end()) limit = it->second;
  }
  if (in.shmem > limit) {
    set_last(
        cudaErrorInvalidValue,
        "kernel %s launched at %s:%d with %s: more dynamic shared memory than the %zu bytes allowed (%s)", in.kernel,
        base_name(in.at.file), in.at.line, geometry(in).c_str(), limit,
        limit == SHARED_DEFAULT ? "cudaFuncSetAttribute(MaxDynamicSharedMemorySize) opts in to more" : "its opt-in");
    return;
  }
  note_coverage(in.kernel);
  kernel_task* k = new kernel_task();  // (the job deletes it: no ownership shared across threads)
  k->info = in;
  k->body = std::move(body);
  k->shmem_limit = limit;
  enqueue(in.stream, in.kernel, [k] {
    run_kernel(k);
    delete k;
  });
}

}  // namespace fsdp_emu

cudaError_t fsdp_emu_func_set_attribute(const void* fn, cudaFuncAttribute attr, int value) {
  if (attr != cudaFuncAttributeMaxDynamicSharedMemorySize)
    return set_last(cudaErrorInvalidValue, "cudaFuncSetAttribute: attribute %d is not one the executor knows",
                    (int)attr);
  if (value < 0 || (size_t)value > SHARED_OPTIN)
    return set_last(cudaErrorInvalidValue, "cudaFuncSetAttribute: %d bytes of dynamic shared memory, at most %zu",
                    value, SHARED_OPTIN);
  std::lock_guard<std::mutex> lk(g_kernels_mu);
  g_optin[fn] = (size_t)value;
  return cudaSuccess;
}

// test hook (tests/cudaemu/selftest.cc): forget a sticky error, so one process can show several
extern "C" void fsdp_emu_reset(void) {
  cudaDeviceSynchronize();
  std::lock_guard<std::mutex> lk(g_err_mu);
  g_sticky = cudaSuccess;
  g_sticky_msg[0] = 0;
  t_last = cudaSuccess;
}
