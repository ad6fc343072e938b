/*
 * backend/cpu/cpuinfo.c -- what this CPU is: its widest vector ISA, the kernels OpenBLAS picked
 * for it, and its float32 FMA peak per core, measured (make bench reports every GEMM's rate as a
 * fraction of that peak, so a report from any machine says how close to the limit we run).
 *
 * The peak loop keeps 12 independent accumulators in registers (enough to cover the FMA latency
 * of two FMA units) and does nothing else; each FMA instruction is 2 flops per lane. The loops
 * for the wider ISAs are compiled with target attributes and chosen at run time, so the library
 * runs on any x86-64 CPU. FSDP_CPU_ISA=sse2|avx2 caps the ISA every hand-written kernel (and
 * oneDNN) may use: the portable path can be run, and tested, on any machine.
 */
#include "core/core.h"
#include "backend/cpu/cpu.h"

#include <immintrin.h>
#include <oneapi/dnnl/dnnl.h>
#include <pthread.h>
#include <time.h>

static const char* isa_names[] = {"sse2", "avx2+fma", "avx512f"};
static int g_level = -1;  // the ISA level, once known
static pthread_once_t g_level_once = PTHREAD_ONCE_INIT;

// the CPU's widest ISA, capped by FSDP_CPU_ISA (sse2, avx2 or avx512f: the Lua layer refuses other
// values); the cap holds for oneDNN too (dnnl_set_max_cpu_isa works only before its first kernel,
// so onednn.c and the GEMM choice ask for the level before they use oneDNN)
static void level_init(void) {
  int level = FSDP_ISA_SSE2;
  if (__builtin_cpu_supports("avx512f")) level = FSDP_ISA_AVX512;
  else if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) level = FSDP_ISA_AVX2;
  const char* cap = getenv("FSDP_CPU_ISA");
  int want = level;
  if (cap && !strcmp(cap, "sse2")) want = FSDP_ISA_SSE2;
  else if (cap && !strcmp(cap, "avx2")) want = FSDP_ISA_AVX2;
  else if (cap && !strcmp(cap, "avx512f")) want = FSDP_ISA_AVX512;
  if (want < level) {
    level = want;
    dnnl_set_max_cpu_isa(level == FSDP_ISA_SSE2 ? dnnl_cpu_isa_sse41 : dnnl_cpu_isa_avx2);
  }
  __atomic_store_n(&g_level, level, __ATOMIC_RELEASE);
}

int fsdp_cpu_isa_level(void) {
  int l = __atomic_load_n(&g_level, __ATOMIC_ACQUIRE);
  if (l >= 0) return l;
  pthread_once(&g_level_once, level_init);
  return __atomic_load_n(&g_level, __ATOMIC_ACQUIRE);
}

const char* fsdp_cpu_isa(void) { return isa_names[fsdp_cpu_isa_level()]; }

char* openblas_get_corename(void);
const char* fsdp_cpu_blas_core(void) { return openblas_get_corename(); }

static double now_s(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return ts.tv_sec + 1e-9 * ts.tv_nsec;
}

#define ACC 12
#define ROUNDS 4096  // FMAs per accumulator per timed block

// each returns the flops of one block of ROUNDS x ACC FMAs; *sink keeps the results alive
__attribute__((target("avx512f"))) static double fma_block_avx512(float* sink) {
  __m512 acc[ACC], a = _mm512_set1_ps(0.999999f), b = _mm512_set1_ps(1e-7f);
  for (int i = 0; i < ACC; i++) acc[i] = _mm512_set1_ps((float)i);
  for (int r = 0; r < ROUNDS; r++)
    for (int i = 0; i < ACC; i++) acc[i] = _mm512_fmadd_ps(acc[i], a, b);
  for (int i = 1; i < ACC; i++) acc[0] = _mm512_add_ps(acc[0], acc[i]);
  *sink += _mm512_reduce_add_ps(acc[0]);
  return 2.0 * 16 * ACC * ROUNDS;
}
__attribute__((target("avx2,fma"))) static double fma_block_avx2(float* sink) {
  __m256 acc[ACC], a = _mm256_set1_ps(0.999999f), b = _mm256_set1_ps(1e-7f);
  for (int i = 0; i < ACC; i++) acc[i] = _mm256_set1_ps((float)i);
  for (int r = 0; r < ROUNDS; r++)
    for (int i = 0; i < ACC; i++) acc[i] = _mm256_fmadd_ps(acc[i], a, b);
  for (int i = 1; i < ACC; i++) acc[0] = _mm256_add_ps(acc[0], acc[i]);
  float lanes[8];
  _mm256_storeu_ps(lanes, acc[0]);
  for (int i = 0; i < 8; i++) *sink += lanes[i];
  return 2.0 * 8 * ACC * ROUNDS;
}
static double fma_block_sse(float* sink) {  // no FMA: a multiply and an add count as one FMA
  __m128 acc[ACC], a = _mm_set1_ps(0.999999f), b = _mm_set1_ps(1e-7f);
  for (int i = 0; i < ACC; i++) acc[i] = _mm_set1_ps((float)i);
  for (int r = 0; r < ROUNDS; r++)
    for (int i = 0; i < ACC; i++) acc[i] = _mm_add_ps(_mm_mul_ps(acc[i], a), b);
  for (int i = 1; i < ACC; i++) acc[0] = _mm_add_ps(acc[0], acc[i]);
  float lanes[4];
  _mm_storeu_ps(lanes, acc[0]);
  for (int i = 0; i < 4; i++) *sink += lanes[i];
  return 2.0 * 4 * ACC * ROUNDS;
}

double fsdp_cpu_fma_peak(double seconds) {
  int level = fsdp_cpu_isa_level();
  double (*block)(float*) = fma_block_sse;
  if (level == FSDP_ISA_AVX512) block = fma_block_avx512;
  else if (level == FSDP_ISA_AVX2) block = fma_block_avx2;
  volatile float keep = 0;
  float sink = 0;
  block(&sink);  // warm up (and let the clock rise)
  // the best of several slices: a slice the scheduler interrupted does not count
  double best = 0, t_end = now_s() + (seconds > 0 ? seconds : 0.2);
  while (now_s() < t_end) {
    double t0 = now_s(), flops = 0;
    for (int k = 0; k < 64; k++) flops += block(&sink);
    double rate = flops / (now_s() - t0);
    if (rate > best) best = rate;
  }
  keep = sink;
  (void)keep;
  return best * 1e-9;
}
