/*
 * backend/cpu/isa.c -- one copy of the CPU kernels (cpu.h, "one copy of the kernels per ISA level"):
 * compiled once per level like the kernel files, it gathers that level's copies of their tables
 * into one fsdp_cpu_isa_kernels, which cpuinfo.c picks by the CPU's level and backend.c installs.
 *
 * Also the level's FMA loop for fsdp_cpu_fma_peak (cpuinfo.c): written once with GCC's vector
 * types, as wide as the level's registers (16, 32 or 64 bytes). 12 independent accumulators stay
 * in registers (enough to cover the FMA latency of two FMA units) and nothing else runs; with FMA
 * (AVX2 and up) acc * a + b contracts to one FMA instruction, in the base a multiply and an add,
 * counted as one FMA. Each FMA is 2 flops per lane.
 */
#include "core/core.h"
#include "backend/cpu/cpu.h"

extern const fsdp_elem_kernels FSDP_ISA_NAME(fsdp_cpu_elem_kernels);
extern const fsdp_linalg_kernels FSDP_ISA_NAME(fsdp_cpu_linalg_kernels);
extern const fsdp_nn_kernels FSDP_ISA_NAME(fsdp_cpu_nn_kernels);
extern const fsdp_optim_kernels FSDP_ISA_NAME(fsdp_cpu_optim_kernels);
extern const fsdp_norm_kernels FSDP_ISA_NAME(fsdp_cpu_norm_kernels);

#if FSDP_ISA_BUILD == FSDP_ISA_AVX512
#define VEC_BYTES 64
#define ISA_NAME "avx512f"
#elif FSDP_ISA_BUILD == FSDP_ISA_AVX2
#define VEC_BYTES 32
#define ISA_NAME "avx2+fma"
#else
#define VEC_BYTES 16
#define ISA_NAME "sse2"
#endif
#define LANES (VEC_BYTES / 4)
#define ACC 12
#define ROUNDS 4096  // FMAs per accumulator per block

typedef float vec __attribute__((vector_size(VEC_BYTES)));

static double fma_block(float* sink) {
  const vec zero = {0};  // a scalar added to a vector goes to every lane
  const vec a = zero + 0.999999f, b = zero + 1e-7f;
  vec acc[ACC];
  for (int i = 0; i < ACC; i++) acc[i] = zero + (float)i;
  for (int r = 0; r < ROUNDS; r++)
    for (int i = 0; i < ACC; i++) acc[i] = acc[i] * a + b;
  for (int i = 1; i < ACC; i++) acc[0] += acc[i];
  for (int l = 0; l < LANES; l++) *sink += acc[0][l];
  return 2.0 * LANES * ACC * ROUNDS;
}

const fsdp_cpu_isa_kernels FSDP_ISA_NAME(fsdp_cpu_isa_kernels) = {
    .name = ISA_NAME,
    .level = FSDP_ISA_BUILD,
    .elem = &FSDP_ISA_NAME(fsdp_cpu_elem_kernels),
    .linalg = &FSDP_ISA_NAME(fsdp_cpu_linalg_kernels),
    .nn = &FSDP_ISA_NAME(fsdp_cpu_nn_kernels),
    .optim = &FSDP_ISA_NAME(fsdp_cpu_optim_kernels),
    .norm = &FSDP_ISA_NAME(fsdp_cpu_norm_kernels),
    .fma_block = fma_block,
};
