/*
 * tests/cudaemu/emu.h -- the CUDA kernel language on the CPU: what the project's .cu files use
 * inside kernels, for the CUDA executor (cudaemu), which compiles those same files a second time as
 * host C++ (g++) and runs their kernels here. Test infrastructure: nothing of it ships.
 *
 * How a kernel runs (runtime.cc has the machinery):
 *   launch     kernel<<<grid, block, shmem, stream>>>(args) is rewritten at build time
 *              (rewrite.lua) to FSDP_EMU_LAUNCH(kernel, grid, block, shmem, stream)(args): the
 *              arguments are converted to the kernel's parameter types and copied, as a launch
 *              copies them, and the launch is queued on its stream after the geometry checks
 *              (at most 1024 threads a block, 1024 x 1024 x 64, grid y and z at most 65535)
 *   threads    every CUDA thread of a block is a fiber on its own stack; the block's fibers run
 *              on one host thread, each until it finishes or waits, so __syncthreads() is a real
 *              barrier: nobody passes it before every thread of the block has reached it, and a
 *              barrier some threads never reach (they returned, or wait at another one) is an
 *              error naming the kernel, the block and the lines
 *   warps      lanes are 32 consecutive threads; a warp operation (__shfl_*_sync, __ballot_sync,
 *              __all_sync, __any_sync, __syncwarp) waits until every lane its mask names has
 *              called it, then each gets its result; a mask without the calling lane, lanes of
 *              one call with different masks, a mask naming a lane that does not exist or
 *              returned, or a source lane outside the mask is an error
 *   shared     a __shared__ array is rewritten (rewrite.lua) to FSDP_EMU_SHARED: per block, its
 *              own heap block, filled with 0xff bytes (a read before any write gives NaN), so
 *              AddressSanitizer sees an access past its end; static shared memory over 48 KiB, or
 *              dynamic over the limit without cudaFuncSetAttribute's opt-in, is refused
 *   atomics    GCC's __atomic builtins (relaxed, as CUDA's), so ThreadSanitizer knows them
 * Under ThreadSanitizer every CUDA thread is a TSan fiber, switched without synchronisation: only
 * a __syncthreads() (threads of a block), a __syncwarp() (lanes of its mask) and the kernel's
 * start and end (stream order) order memory accesses, so an access in one thread and a write in
 * another of the same block between two barriers -- or of two blocks -- is reported as a race:
 * the executor's racecheck.
 */
#ifndef FSDP_CUDAEMU_EMU_H
#define FSDP_CUDAEMU_EMU_H

#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include <functional>
#include <tuple>
#include <type_traits>
#include <utility>

// ---- qualifiers --------------------------------------------------------------------------------------
#define __global__
#define __device__
#define __host__
#define __forceinline__ inline __attribute__((always_inline))
#define __launch_bounds__(...)
#define __constant__ static

struct uint3 {
  unsigned x, y, z;
};
struct dim3 {
  unsigned x, y, z;
  dim3(unsigned x_ = 1, unsigned y_ = 1, unsigned z_ = 1) : x(x_), y(y_), z(z_) {}
  dim3(uint3 u) : x(u.x), y(u.y), z(u.z) {}
};

typedef struct fsdp_emu_stream* cudaStream_t;

namespace fsdp_emu {

// where a kernel was launched or a thread waits, for messages
struct site {
  const char* file;
  int line;
};

// what a running CUDA thread sees of itself and its block (runtime.cc keeps them)
struct block_ctx {
  uint3 idx;
  dim3 dim, grid;
};
// (by value: a kernel reads its copy, never the scheduler's own memory)
uint3 thread_index(void);  // of the CUDA thread running on this host thread
block_ctx block_of(void);

// ---- barriers and warps --------------------------------------------------------------------------------
void syncthreads(site at);
enum warp_op { WARP_SHFL_IDX, WARP_SHFL_UP, WARP_SHFL_DOWN, WARP_SHFL_XOR, WARP_BALLOT, WARP_ALL, WARP_ANY, WARP_SYNC };
// the lanes of mask meet; `in` (n bytes) is this lane's value, `arg` the source lane, delta or lane
// mask; returns this lane's result (a value's bytes in out, or the ballot in the return value)
uint32_t warp_meet(site at, warp_op op, unsigned mask, const void* in, void* out, size_t n, int arg, int width);

template <typename T>
T shfl(site at, warp_op op, unsigned mask, T v, int arg, int width) {
  static_assert(sizeof(T) <= 8, "a shuffle moves at most 8 bytes");
  T r;
  warp_meet(at, op, mask, &v, &r, sizeof(T), arg, width);
  return r;
}

// ---- shared memory ----------------------------------------------------------------------------------------
// this block's storage of the __shared__ variable declared at `key` (one per declaration)
void* shared_var(const void* key, size_t bytes, size_t align, const char* name, site at);
void* dynamic_shared(site at);

// ---- launches ------------------------------------------------------------------------------------------------
struct launch_info {
  const void* fn;  // the kernel function (cudaFuncSetAttribute's key)
  const char* kernel;
  site at;
  dim3 grid, block;
  size_t shmem;
  cudaStream_t stream;
};
// checks the geometry (a bad one sets the last error and returns) and queues the kernel's blocks
void launch(const launch_info& info, std::function<void()> body);

template <typename... P>
struct launcher {
  void (*fn)(P...);
  launch_info info;
  // (the parameters' own types: the arguments convert at the call, NULL to a pointer included)
  void operator()(std::decay_t<P>... a) const {
    // the arguments as the kernel's parameters, copied now (as a launch copies them)
    std::tuple<std::decay_t<P>...> args(a...);
    void (*f)(P...) = fn;
    launch(info, [f, args]() { std::apply(f, args); });
  }
};
template <typename... P>
launcher<P...> launcher_for(void (*fn)(P...), const char* name, const char* file, int line, dim3 grid, dim3 block,
                            size_t shmem = 0, cudaStream_t stream = 0) {
  return launcher<P...>{
      fn, launch_info{reinterpret_cast<const void*>(fn), name, site{file, line}, grid, block, shmem, stream}};
}

// ---- atomics: relaxed read-modify-writes, as CUDA's ------------------------------------------------------------
template <typename T>
inline T atomic_cas_loop(T* p, T v, T (*op)(T, T)) {
  static_assert(sizeof(T) == 4 || sizeof(T) == 8, "atomics on 4 or 8 bytes");
  typedef typename std::conditional<sizeof(T) == 4, uint32_t, uint64_t>::type U;
  U* q = reinterpret_cast<U*>(p);
  U old = __atomic_load_n(q, __ATOMIC_RELAXED);
  for (;;) {
    T cur;
    memcpy(&cur, &old, sizeof cur);
    T nv = op(cur, v);
    U want;
    memcpy(&want, &nv, sizeof want);
    if (__atomic_compare_exchange_n(q, &old, want, false, __ATOMIC_RELAXED, __ATOMIC_RELAXED)) return cur;
  }
}

}  // namespace fsdp_emu

// ---- the built-in variables ---------------------------------------------------------------------------
#define threadIdx (::fsdp_emu::thread_index())
#define blockIdx (::fsdp_emu::block_of().idx)
#define blockDim (::fsdp_emu::block_of().dim)
#define gridDim (::fsdp_emu::block_of().grid)
constexpr int warpSize = 32;

// ---- synchronisation and warp operations --------------------------------------------------------------
#define __syncthreads() ::fsdp_emu::syncthreads(::fsdp_emu::site{__FILE__, __LINE__})
#define __syncwarp(...) ::fsdp_emu::syncwarp(::fsdp_emu::site{__FILE__, __LINE__}, ##__VA_ARGS__)
#define __shfl_sync(...) \
  ::fsdp_emu::shfl_sync(::fsdp_emu::site{__FILE__, __LINE__}, ::fsdp_emu::WARP_SHFL_IDX, __VA_ARGS__)
#define __shfl_up_sync(...) \
  ::fsdp_emu::shfl_sync(::fsdp_emu::site{__FILE__, __LINE__}, ::fsdp_emu::WARP_SHFL_UP, __VA_ARGS__)
#define __shfl_down_sync(...) \
  ::fsdp_emu::shfl_sync(::fsdp_emu::site{__FILE__, __LINE__}, ::fsdp_emu::WARP_SHFL_DOWN, __VA_ARGS__)
#define __shfl_xor_sync(...) \
  ::fsdp_emu::shfl_sync(::fsdp_emu::site{__FILE__, __LINE__}, ::fsdp_emu::WARP_SHFL_XOR, __VA_ARGS__)
#define __ballot_sync(mask, pred) \
  ::fsdp_emu::vote(::fsdp_emu::site{__FILE__, __LINE__}, ::fsdp_emu::WARP_BALLOT, (mask), (pred))
#define __all_sync(mask, pred) \
  ::fsdp_emu::vote(::fsdp_emu::site{__FILE__, __LINE__}, ::fsdp_emu::WARP_ALL, (mask), (pred))
#define __any_sync(mask, pred) \
  ::fsdp_emu::vote(::fsdp_emu::site{__FILE__, __LINE__}, ::fsdp_emu::WARP_ANY, (mask), (pred))

namespace fsdp_emu {
template <typename T>
inline T shfl_sync(site at, warp_op op, unsigned mask, T v, int arg, int width = 32) {
  return shfl(at, op, mask, v, arg, width);
}
inline unsigned vote(site at, warp_op op, unsigned mask, int pred) {
  int p = pred != 0;
  return warp_meet(at, op, mask, &p, NULL, sizeof p, 0, 32);
}
inline void syncwarp(site at, unsigned mask = 0xffffffffu) { warp_meet(at, WARP_SYNC, mask, NULL, NULL, 0, 0, 32); }
}  // namespace fsdp_emu

// ---- shared memory declarations (rewrite.lua writes these for __shared__) --------------------------------------
// FSDP_EMU_SHARED(double, part, [256]) for `__shared__ double part[256];`, FSDP_EMU_SHARED(int, n, )
// for a scalar: a reference to this block's storage of the variable
#define FSDP_EMU_SHARED(T, name, dims)                                                                           \
  static char name##_emu_key;                                                                                    \
  T(&name)                                                                                                       \
  dims = *reinterpret_cast<T(*) dims>(::fsdp_emu::shared_var(&name##_emu_key, sizeof(T dims), alignof(T), #name, \
                                                             ::fsdp_emu::site{__FILE__, __LINE__}))
#define FSDP_EMU_EXTERN_SHARED(T, name) \
  T* name = reinterpret_cast<T*>(::fsdp_emu::dynamic_shared(::fsdp_emu::site{__FILE__, __LINE__}))
#define FSDP_EMU_LAUNCH(kernel, ...) ::fsdp_emu::launcher_for(kernel, #kernel, __FILE__, __LINE__, __VA_ARGS__)

// ---- atomics -------------------------------------------------------------------------------------------------
inline int atomicAdd(int* p, int v) { return __atomic_fetch_add(p, v, __ATOMIC_RELAXED); }
inline unsigned atomicAdd(unsigned* p, unsigned v) { return __atomic_fetch_add(p, v, __ATOMIC_RELAXED); }
inline unsigned long long atomicAdd(unsigned long long* p, unsigned long long v) {
  return __atomic_fetch_add(p, v, __ATOMIC_RELAXED);
}
inline float atomicAdd(float* p, float v) {
  return fsdp_emu::atomic_cas_loop<float>(p, v, [](float a, float b) { return a + b; });
}
inline double atomicAdd(double* p, double v) {
  return fsdp_emu::atomic_cas_loop<double>(p, v, [](double a, double b) { return a + b; });
}
inline int atomicMax(int* p, int v) {
  return fsdp_emu::atomic_cas_loop<int>(p, v, [](int a, int b) { return a > b ? a : b; });
}
inline int atomicMin(int* p, int v) {
  return fsdp_emu::atomic_cas_loop<int>(p, v, [](int a, int b) { return a < b ? a : b; });
}
inline int atomicExch(int* p, int v) { return __atomic_exchange_n(p, v, __ATOMIC_RELAXED); }
inline float atomicExch(float* p, float v) {
  return fsdp_emu::atomic_cas_loop<float>(p, v, [](float, float b) { return b; });
}
inline int atomicCAS(int* p, int cmp, int v) {
  __atomic_compare_exchange_n(p, &cmp, v, false, __ATOMIC_RELAXED, __ATOMIC_RELAXED);
  return cmp;  // (the old value: cmp is overwritten with it on failure)
}
inline unsigned long long atomicCAS(unsigned long long* p, unsigned long long cmp, unsigned long long v) {
  __atomic_compare_exchange_n(p, &cmp, v, false, __ATOMIC_RELAXED, __ATOMIC_RELAXED);
  return cmp;
}
inline void __threadfence(void) { __atomic_thread_fence(__ATOMIC_SEQ_CST); }
inline void __threadfence_block(void) { __atomic_thread_fence(__ATOMIC_SEQ_CST); }

// ---- math the kernels call by CUDA's names ------------------------------------------------------------------------
template <typename T>
inline T __ldg(const T* p) {
  return *p;
}

#endif
