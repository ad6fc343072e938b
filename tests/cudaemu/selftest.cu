/*
 * tests/cudaemu/selftest.cu -- the CUDA executor checked on its own: small kernels written in CUDA
 * (rewritten and compiled as the backend's are) whose results or refusals are known, one check a
 * function. Every refusal a GPU would make, and every misuse the executor promises to name, is
 * provoked here and its message checked; the working constructs give exact values.
 *
 *   build/cudaemu/selftest            every check; "selftest OK" at the end, else exit 1
 *   build/cudaemu/selftest NAME       one check; the race_* checks run only so: they race on
 *                                     purpose (a wrong value here; ThreadSanitizer must report them)
 */
#include <cuda_runtime.h>

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

extern "C" void fsdp_emu_reset(void);

static int g_failed;
static void check(bool ok, const char* name, const char* what) {
  printf("selftest: %-36s %s%s%s\n", name, ok ? "ok" : "FAILED", ok ? "" : ": ", ok ? "" : what);
  if (!ok) g_failed = 1;
}
// the sticky error a failed kernel left, its message containing each of the wanted pieces; then cleared
static bool kernel_failed_with(const char* const* want) {
  cudaError_t e = cudaDeviceSynchronize();
  const char* msg = cudaGetErrorString(e);
  bool ok = e != cudaSuccess;
  for (int i = 0; want[i]; i++) ok = ok && strstr(msg, want[i]);
  if (!ok) printf("  (error %d: %s)\n", (int)e, msg);
  fsdp_emu_reset();
  return ok;
}
template <typename T>
static T* device(size_t n) {
  T* p = NULL;
  cudaMalloc(&p, n * sizeof(T));
  return p;
}
template <typename T>
static void to_host(T* h, const T* d, size_t n) {
  cudaMemcpy(h, d, n * sizeof(T), cudaMemcpyDeviceToHost);
}

// ---- barriers ------------------------------------------------------------------------------------------
// a block reduction in shared memory: out[block] = sum of in over the block's 256 values
__global__ static void block_sum_k(float* out, const float* in) {
  __shared__ float part[256];
  part[threadIdx.x] = in[blockIdx.x * 256 + threadIdx.x];
  __syncthreads();
  for (int h = 128; h > 0; h /= 2) {
    if (threadIdx.x < h) part[threadIdx.x] += part[threadIdx.x + h];
    __syncthreads();
  }
  if (threadIdx.x == 0) out[blockIdx.x] = part[0];
}
// the same without the barrier inside the loop (the planted bug: a race, and a wrong sum here)
__global__ static void block_sum_racy_k(float* out, const float* in) {
  __shared__ float part[256];
  part[threadIdx.x] = in[blockIdx.x * 256 + threadIdx.x];
  __syncthreads();
  for (int h = 128; h > 0; h /= 2) {
    if (threadIdx.x < h) part[threadIdx.x] += part[threadIdx.x + h];
  }
  if (threadIdx.x == 0) out[blockIdx.x] = part[0];
}
static float sum_with(bool racy) {
  float h[512];
  for (int i = 0; i < 512; i++) h[i] = (float)(i % 7);
  float *in = device<float>(512), *out = device<float>(2);
  cudaMemcpy(in, h, sizeof h, cudaMemcpyHostToDevice);
  if (racy) block_sum_racy_k<<<2, 256>>>(out, in);
  else block_sum_k<<<2, 256>>>(out, in);
  float r[2];
  to_host(r, out, 2);
  cudaFree(in);
  cudaFree(out);
  return r[0] + r[1];
}
static float sum_want(void) {
  float want = 0;
  for (int i = 0; i < 512; i++) want += (float)(i % 7);
  return want;
}
static void barrier_reduction(void) { check(sum_with(false) == sum_want(), "barrier: a block reduction", "wrong sum"); }

__global__ static void divergent_k(int* out) {
  if (threadIdx.x < 100) {
    __syncthreads();
    out[threadIdx.x] = 1;
  }
}
__global__ static void two_barriers_k(int* out) {
  if (threadIdx.x % 2) __syncthreads();
  else __syncthreads();
  out[threadIdx.x] = 1;
}
static void barrier_misuse(void) {
  int* d = device<int>(256);
  divergent_k<<<1, 128>>>(d);
  const char* w1[] = {"divergent_k",
                      "__syncthreads() at selftest.cu:",
                      "threads 0-99 wait there",
                      "threads 100-127 returned",
                      "block (0, 0, 0)",
                      "block (128, 1, 1)",
                      NULL};
  check(kernel_failed_with(w1), "barrier: not reached by every thread", "no error naming the kernel and threads");
  two_barriers_k<<<1, 64>>>(d);
  const char* w2[] = {"two_barriers_k", "different __syncthreads()", NULL};
  check(kernel_failed_with(w2), "barrier: two different barriers", "no error");
  cudaFree(d);
}

// ---- warps -------------------------------------------------------------------------------------------------
// each warp's sum by __shfl_down_sync, its lanes' xor-butterfly sum, lane 5's value broadcast,
// __shfl_up_sync by 1, a ballot of odd lanes, any/all, and a 16-wide segment's sum
__global__ static void warp_ops_k(int* out) {
  int lane = threadIdx.x % 32, v = (int)threadIdx.x + 1;
  int s = v;
  for (int d = 16; d > 0; d /= 2) s += __shfl_down_sync(0xffffffffu, s, d);
  int x = v;
  for (int m = 1; m < 32; m *= 2) x += __shfl_xor_sync(0xffffffffu, x, m);
  int b = __shfl_sync(0xffffffffu, v, 5);
  int u = __shfl_up_sync(0xffffffffu, v, 1);
  unsigned odd = __ballot_sync(0xffffffffu, lane % 2);
  int any = __any_sync(0xffffffffu, lane == 31), all = __all_sync(0xffffffffu, lane < 31);
  int seg = v;
  for (int d = 8; d > 0; d /= 2) seg += __shfl_down_sync(0xffffffffu, seg, d, 16);
  __syncwarp();
  int* o = out + threadIdx.x * 8;
  o[0] = s, o[1] = x, o[2] = b, o[3] = u, o[4] = (int)odd, o[5] = any, o[6] = all, o[7] = seg;
}
static void warp_operations(void) {
  int* d = device<int>(64 * 8);
  warp_ops_k<<<1, 64>>>(d);
  int h[64 * 8];
  to_host(h, d, 64 * 8);
  bool ok = cudaGetLastError() == cudaSuccess;
  for (int t = 0; t < 64 && ok; t++) {
    int w = t / 32, lane = t % 32, base = w * 32 + 1, warp_sum = 32 * base + 31 * 32 / 2;
    int seg0 = w * 32 + (lane / 16) * 16 + 1, seg_sum = 16 * seg0 + 15 * 16 / 2;
    const int* o = h + t * 8;
    ok = (lane != 0 || o[0] == warp_sum) && o[1] == warp_sum && o[2] == base + 5 && o[3] == (lane ? t : t + 1) &&
         (unsigned)o[4] == 0xaaaaaaaau && o[5] == 1 && o[6] == 0 && (lane % 16 != 0 || o[7] == seg_sum);
    if (!ok) printf("  thread %d: %d %d %d %d %x %d %d %d\n", t, o[0], o[1], o[2], o[3], o[4], o[5], o[6], o[7]);
  }
  check(ok, "warp: shuffles, votes, segments", "wrong values");
  cudaFree(d);
}

__global__ static void mask_without_self_k(int* out) {
  // (the planted bug: lane 0 shuffles with a mask that leaves it out)
  out[threadIdx.x] = __shfl_down_sync(0xfffffffeu, (int)threadIdx.x, 1);
}
__global__ static void partial_warp_k(int* out) {
  out[threadIdx.x] = __shfl_xor_sync(0xffffffffu, (int)threadIdx.x, 1);
}
__global__ static void lane_returned_k(int* out) {
  if (threadIdx.x == 7) return;
  out[threadIdx.x] = __shfl_sync(0xffffffffu, (int)threadIdx.x, 0);
}
__global__ static void source_outside_mask_k(int* out) {
  if (threadIdx.x < 16) out[threadIdx.x] = __shfl_down_sync(0x0000ffffu, (int)threadIdx.x, 8, 32);
}
static void warp_misuse(void) {
  int* d = device<int>(64);
  mask_without_self_k<<<1, 32>>>(d);
  const char* w1[] = {"mask_without_self_k", "lane 0", "mask 0xfffffffe", "does not include the lane", NULL};
  check(kernel_failed_with(w1), "warp: a mask without the calling lane", "no error");
  partial_warp_k<<<1, 48>>>(d);
  const char* w2[] = {"partial_warp_k", "names lane 16 of warp 1, which does not exist", NULL};
  check(kernel_failed_with(w2), "warp: a mask naming missing lanes", "no error");
  lane_returned_k<<<1, 32>>>(d);
  const char* w3[] = {"lane_returned_k", "lane 7 returned", NULL};
  check(kernel_failed_with(w3), "warp: a lane of the mask returned", "no error");
  source_outside_mask_k<<<1, 32>>>(d);
  const char* w4[] = {"source_outside_mask_k", "reads lane 16, which is not in the mask 0x0000ffff", NULL};
  check(kernel_failed_with(w4), "warp: reading a lane outside the mask", "no error");
  cudaFree(d);
}

// ---- launches and shared memory -------------------------------------------------------------------------------------
__global__ static void noop_k(int* out) {
  if (out) out[0] = 1;
}
__global__ static void big_static_k(float* out) {
  __shared__ float a[8192];  // 32 KiB
  __shared__ float b[8192];  // and 32 more: over the 48 a block has
  a[threadIdx.x] = 1.0f;
  b[threadIdx.x] = 2.0f;
  __syncthreads();
  out[threadIdx.x] = a[threadIdx.x] + b[threadIdx.x];
}
__global__ static void dynamic_k(float* out, int n) {
  extern __shared__ float dyn[];
  for (int i = threadIdx.x; i < n; i += blockDim.x) dyn[i] = 1.0f;
  __syncthreads();
  if (threadIdx.x == 0) {
    float s = 0;
    for (int i = 0; i < n; i++) s += dyn[i];
    out[0] = s;
  }
}
static bool launch_refused(cudaError_t want, const char* const* pieces) {
  cudaError_t e = cudaGetLastError();
  const char* msg = cudaGetErrorString(e);
  bool ok = e == want;
  for (int i = 0; pieces[i]; i++) ok = ok && strstr(msg, pieces[i]);
  if (!ok) printf("  (error %d: %s)\n", (int)e, msg);
  return ok;
}
static void launch_limits(void) {
  noop_k<<<1, 2048>>>(NULL);
  const char* w1[] = {"noop_k", "block (2048, 1, 1)", "more than 1024 threads", NULL};
  check(launch_refused(cudaErrorInvalidConfiguration, w1), "launch: 2048 threads a block", "not refused");
  noop_k<<<dim3(1, 70000), 32>>>(NULL);
  const char* w2[] = {"noop_k", "grid (1, 70000, 1)", NULL};
  check(launch_refused(cudaErrorInvalidConfiguration, w2), "launch: grid y over 65535", "not refused");
  noop_k<<<1, dim3(1, 1, 65)>>>(NULL);
  const char* w3[] = {"1024 x 1024 x 64", NULL};
  check(launch_refused(cudaErrorInvalidConfiguration, w3), "launch: block z over 64", "not refused");
  float* d = device<float>(1024);
  big_static_k<<<1, 32>>>(d);
  const char* w4[] = {"big_static_k", "static shared memory of 65536 bytes", "'b'", NULL};
  check(kernel_failed_with(w4), "shared: static over 48 KiB", "not refused");
  int n = 16384;  // 64 KiB
  dynamic_k<<<1, 256, n * sizeof(float)>>>(d, n);
  const char* w5[] = {"dynamic_k", "more dynamic shared memory than the 49152 bytes", NULL};
  check(launch_refused(cudaErrorInvalidValue, w5), "shared: dynamic over 48 KiB, no opt-in", "not refused");
  cudaFuncSetAttribute(dynamic_k, cudaFuncAttributeMaxDynamicSharedMemorySize, n * (int)sizeof(float));
  dynamic_k<<<1, 256, n * sizeof(float)>>>(d, n);
  float s = 0;
  to_host(&s, d, 1);
  check(cudaGetLastError() == cudaSuccess && s == (float)n, "shared: dynamic 64 KiB with the opt-in",
        "wrong sum or refused");
  cudaFree(d);
}

// ---- atomics and streams -----------------------------------------------------------------------------------------
__global__ static void count_k(float* f, double* g, unsigned long long* c, int* m) {
  atomicAdd(f, 1.0f);
  atomicAdd(g, 0.5);
  atomicAdd(c, 1ull);
  atomicMax(m, (int)(blockIdx.x * blockDim.x + threadIdx.x));
}
__global__ static void fill_k(float* p, int n, float v) {
  for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) p[i] = v;
}
__global__ static void add_k(float* dst, const float* src, int n) {
  for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) dst[i] += src[i];
}
static void atomics_and_streams(void) {
  char* mem = device<char>(64);
  cudaMemset(mem, 0, 64);
  float* f = (float*)mem;
  double* g = (double*)(mem + 8);
  unsigned long long* c = (unsigned long long*)(mem + 16);
  int* m = (int*)(mem + 24);
  count_k<<<40, 96>>>(f, g, c, m);
  float hf;
  double hg;
  unsigned long long hc;
  int hm;
  to_host(&hf, f, 1);
  to_host(&hg, g, 1);
  to_host(&hc, c, 1);
  to_host(&hm, m, 1);
  check(hf == 3840.0f && hg == 1920.0 && hc == 3840 && hm == 3839, "atomics: float, double, u64, max", "wrong counts");
  // s1 fills a, s2 waits for s1's event, then adds a into b: b = 1 + 2 everywhere
  cudaStream_t s1, s2;
  cudaStreamCreateWithFlags(&s1, cudaStreamNonBlocking);
  cudaStreamCreateWithFlags(&s2, cudaStreamNonBlocking);
  cudaEvent_t ev;
  cudaEventCreateWithFlags(&ev, cudaEventDisableTiming);
  int n = 1 << 16;
  float *a = device<float>(n), *b = device<float>(n);
  fill_k<<<64, 256, 0, s2>>>(b, n, 1.0f);
  fill_k<<<64, 256, 0, s1>>>(a, n, 2.0f);
  cudaEventRecord(ev, s1);
  cudaStreamWaitEvent(s2, ev, 0);
  add_k<<<64, 256, 0, s2>>>(b, a, n);
  float* h = (float*)malloc(n * sizeof(float));
  cudaMemcpyAsync(h, b, n * sizeof(float), cudaMemcpyDeviceToHost, s2);
  bool ok = true;
  for (int i = 0; i < n; i++) ok = ok && h[i] == 3.0f;
  check(ok, "streams: an event orders two streams", "wrong values");
  free(h);
  cudaStreamDestroy(s1);
  cudaStreamDestroy(s2);
  cudaEventDestroy(ev);
  cudaFree(a);
  cudaFree(b);
  cudaFree(mem);
  // a copy given a host pointer where the device's belongs is refused
  float host_buf[4] = {0};
  cudaError_t e = cudaMemcpy(host_buf, host_buf + 1, 4, cudaMemcpyDeviceToHost);
  check(e == cudaErrorInvalidValue && strstr(cudaGetErrorString(e), "not device memory"),
        "memory: a host pointer as device", "not refused");
  cudaGetLastError();
}

// ---- races, for the ThreadSanitizer build ---------------------------------------------------------------------------
// two blocks write the same element without atomics (a race across blocks)
__global__ static void race_blocks_k(float* out) {
  if (threadIdx.x == 0) out[0] += 1.0f;
}
// the reduction without its loop's barrier: a wrong sum here, a race report under ThreadSanitizer
static void race_shared(void) {
  check(sum_with(true) != sum_want(), "race: a reduction without its barrier", "the racy reduction gave the right sum");
}
static void race_blocks(void) {
  float* d = device<float>(1);
  cudaMemset(d, 0, sizeof(float));
  race_blocks_k<<<4, 32>>>(d);
  cudaDeviceSynchronize();
  cudaFree(d);
}

int main(int argc, char** argv) {
  setvbuf(stdout, NULL, _IONBF, 0);
  struct {
    const char* name;
    void (*fn)(void);
  } checks[] = {
      {"barriers", barrier_reduction}, {"barrier_misuse", barrier_misuse}, {"warps", warp_operations},
      {"warp_misuse", warp_misuse},    {"launch_limits", launch_limits},   {"atomics_streams", atomics_and_streams},
      {"race_shared", race_shared},    {"race_blocks", race_blocks},
  };
  for (auto& c : checks) {
    bool race = !strncmp(c.name, "race_", 5);
    if (argc > 1 ? !strcmp(argv[1], c.name) : !race) c.fn();
  }
  if (argc == 1) printf(g_failed ? "selftest FAILED\n" : "selftest OK\n");
  return g_failed;
}
