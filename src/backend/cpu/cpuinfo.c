/*
 * backend/cpu/cpuinfo.c -- what this CPU is: its ISA level, which picks the copy of the kernels
 * that runs (cpu.h: one copy per level; backend.c installs it), and the kernels OpenBLAS picked.
 *
 * The level is the widest of x86-64-v2 (the base), v3 (AVX2, FMA, ...) and v4 (AVX-512 F/BW/CD/DQ/
 * VL) this CPU and its OS support (libgcc's cpuid checks, the OS's saving of the vector registers
 * included), capped by FSDP_CPU_ISA=sse2|avx2|avx512f: the cap picks a lower copy of every kernel
 * (and holds oneDNN to it), so each path can be run, and tested, on any machine that has it. It is
 * settled once, when the library loads (backend.c), and never changes in a process.
 */
#include "core/core.h"
#include "backend/cpu/cpu.h"

#include <oneapi/dnnl/dnnl.h>
#include <pthread.h>

static int g_level = -1;  // the ISA level, once known
static pthread_once_t g_level_once = PTHREAD_ONCE_INIT;

int fsdp_cpu_isa_pick(int has_v3, int has_v4, const char* cap) {
  int level = has_v4 && has_v3 ? FSDP_ISA_AVX512 : has_v3 ? FSDP_ISA_AVX2 : FSDP_ISA_SSE2;
  int want = level;
  if (cap && !strcmp(cap, "sse2")) want = FSDP_ISA_SSE2;
  else if (cap && !strcmp(cap, "avx2")) want = FSDP_ISA_AVX2;
  else if (cap && !strcmp(cap, "avx512f")) want = FSDP_ISA_AVX512;
  return want < level ? want : level;
}

// the cap holds for oneDNN too (dnnl_set_max_cpu_isa works only before its first kernel, so
// onednn.c and the GEMM choice ask for the level before they use oneDNN)
static void level_init(void) {
  __builtin_cpu_init();  // (we run from a constructor, maybe before libgcc's own)
  int v3 = __builtin_cpu_supports("x86-64-v3"), v4 = __builtin_cpu_supports("x86-64-v4");
  int level = fsdp_cpu_isa_pick(v3, v4, getenv("FSDP_CPU_ISA"));
  if (level < fsdp_cpu_isa_pick(v3, v4, NULL))
    dnnl_set_max_cpu_isa(level == FSDP_ISA_SSE2 ? dnnl_cpu_isa_sse41 : dnnl_cpu_isa_avx2);
  __atomic_store_n(&g_level, level, __ATOMIC_RELEASE);
}

int fsdp_cpu_isa_level(void) {
  int l = __atomic_load_n(&g_level, __ATOMIC_ACQUIRE);
  if (l >= 0) return l;
  pthread_once(&g_level_once, level_init);
  return __atomic_load_n(&g_level, __ATOMIC_ACQUIRE);
}

char* openblas_get_corename(void);
const char* fsdp_cpu_blas_core(void) { return openblas_get_corename(); }
