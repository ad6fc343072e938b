/*
 * backend/cpu/cpu.h -- the CPU backend's kernel tables, one per op family (elem.c, linalg.c with
 * gemm.c and bf16.c, nn.c, norm.c, optim.c), each compiled once per ISA level; backend.c installs
 * the tables of the level cpuinfo.c picked into the CPU's device table.
 */
#ifndef FSDP_BACKEND_CPU_H
#define FSDP_BACKEND_CPU_H
#include "core/core.h"

// ---- one copy of the kernels per ISA level --------------------------------------------------------
// The library runs on any x86-64-v2 CPU (the Makefile's ARCH, the base every file is compiled for)
// and uses AVX2 or AVX-512 where the CPU has them: the kernel files (elem.c, linalg.c, nn.c, norm.c,
// optim.c and isa.c, which gathers their tables) are compiled three times, with -DFSDP_ISA_BUILD=
// 0, 1 or 2 and the flags of that level (Makefile: ISA_FLAGS_*):
//   FSDP_ISA_SSE2    the base alone (SSE2 to SSE4.2, POPCNT: x86-64-v2); plain-C micro-kernels
//   FSDP_ISA_AVX2    + AVX2, FMA, BMI1/2, F16C, LZCNT, MOVBE (x86-64-v3); the AVX2 micro-kernels
//   FSDP_ISA_AVX512  + AVX-512 F, BW, CD, DQ, VL (x86-64-v4); the AVX-512 micro-kernels
// Each copy's exported names carry its level's suffix (FSDP_ISA_NAME: fsdp_cpu_elem_kernels_avx2),
// its static functions stay its own, and the code is written once: what differs between the copies
// is what the compiler makes of it, and the micro-kernels chosen by `#if FSDP_ISA_BUILD >= ...`.
// When the library loads, cpuinfo.c settles the level (the CPU's, capped by FSDP_CPU_ISA) and
// backend.c installs that level's copy (fsdp_cpu_kernels); nothing else runs code of a level above
// the base (make isa-check proves it on the built library).
#define FSDP_ISA_SSE2 0
#define FSDP_ISA_AVX2 1
#define FSDP_ISA_AVX512 2
#define FSDP_ISA_LEVELS 3

#ifdef FSDP_ISA_BUILD
#define FSDP_ISA_PASTE2(a, b) a##b
#define FSDP_ISA_PASTE(a, b) FSDP_ISA_PASTE2(a, b)
#if FSDP_ISA_BUILD == FSDP_ISA_SSE2
#define FSDP_ISA_NAME(name) FSDP_ISA_PASTE(name, _sse2)
#elif FSDP_ISA_BUILD == FSDP_ISA_AVX2
#define FSDP_ISA_NAME(name) FSDP_ISA_PASTE(name, _avx2)
#elif FSDP_ISA_BUILD == FSDP_ISA_AVX512
#define FSDP_ISA_NAME(name) FSDP_ISA_PASTE(name, _avx512)
#else
#error "FSDP_ISA_BUILD is 0 (sse2), 1 (avx2) or 2 (avx512)"
#endif
#endif

// one copy's kernel tables (isa.c), and its register-only FMA loop for fsdp_cpu_fma_peak: the
// flops of one block of fma_rounds x 12 FMAs of its widest vectors, *sink keeping the sums alive
typedef struct {
  const char* name;  // "sse2", "avx2+fma", "avx512f": what fsdp_cpu_isa() reports
  int level;         // FSDP_ISA_*
  const fsdp_elem_kernels* elem;
  const fsdp_linalg_kernels* linalg;
  const fsdp_nn_kernels* nn;
  const fsdp_optim_kernels* optim;
  const fsdp_norm_kernels* norm;
  double (*fma_block)(float* sink);
} fsdp_cpu_isa_kernels;

extern const fsdp_cpu_isa_kernels fsdp_cpu_isa_kernels_sse2, fsdp_cpu_isa_kernels_avx2, fsdp_cpu_isa_kernels_avx512;

// the copy of this process's level (backend.c); the same for the life of the process
const fsdp_cpu_isa_kernels* fsdp_cpu_kernels(void);
// the vector ISA our kernels and oneDNN may use (cpuinfo.c): the CPU's level capped by
// FSDP_CPU_ISA; cheap after the first call
int fsdp_cpu_isa_level(void);
// the rule behind it, pure for the C tests: the level of a CPU that has x86-64-v3 (has_v3) and
// x86-64-v4 (has_v4), under the cap `cap` (FSDP_CPU_ISA's value or NULL; an unknown one caps nothing:
// the Lua layer refuses it before the library loads)
int fsdp_cpu_isa_pick(int has_v3, int has_v4, const char* cap);

// ---- the float32 GEMMs (gemm.c, compiled once) ---------------------------------------------------------
// multiply-adds under which a list of GEMMs runs on the calling thread alone
#define FSDP_CPU_GEMM_PAR_MIN (1 << 21)
// the linalg table's gemm_many: a list of GEMMs through OpenBLAS or oneDNN, pieces over our threads
void fsdp_cpu_gemm_many(int n, const fsdp_gemm_args* g);
// batch GEMMs of one shape, operand i at A + i*sa, B + i*sb, C + i*sc (a list for fsdp_cpu_gemm_many)
void fsdp_cpu_gemm_batched(int64_t batch, int ta, int tb, int64_t M, int64_t N, int64_t K, float alpha, const float* A,
                           int64_t lda, int64_t sa, const float* B, int64_t ldb, int64_t sb, float beta, float* C,
                           int64_t ldc, int64_t sc);

// GEMMs on bfloat16 operands (bf16.c): the linalg table's gemm_bf16_many
int fsdp_cpu_gemm_bf16_many(int n, const fsdp_gemm_bf16_args* g);

// convolution through oneDNN (onednn.c), with the arguments of the conv2d kernels; the operands
// x, w, gy are float32 or (dtype FSDP_BF16) bfloat16, the results float32: 0, 1 when it leaves
// this geometry (or this dtype on this CPU) to the caller, -1 with the error set. The backward
// computes gb only together with gw, and returns 1 when neither gx nor gw is wanted.
int fsdp_cpu_onednn_conv2d_forward(const fsdp_conv_geom* g, int dtype, float* y, const void* x, const void* w,
                                   const float* b);
int fsdp_cpu_onednn_conv2d_backward(const fsdp_conv_geom* g, int dtype, float* gx, float* gw, float* gb, const void* gy,
                                    const void* x, const void* w);

#endif
