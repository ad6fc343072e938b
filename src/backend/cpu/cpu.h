/*
 * backend/cpu/cpu.h -- the CPU backend's kernel tables, one per op family (elem.c, linalg.c with
 * bf16.c, nn.c, optim.c); backend.c gathers them into the CPU's device table.
 */
#ifndef FSDP_BACKEND_CPU_H
#define FSDP_BACKEND_CPU_H
#include "core/core.h"

extern const fsdp_elem_kernels fsdp_cpu_elem_kernels;
extern const fsdp_linalg_kernels fsdp_cpu_linalg_kernels;
extern const fsdp_nn_kernels fsdp_cpu_nn_kernels;
extern const fsdp_optim_kernels fsdp_cpu_optim_kernels;
extern const fsdp_norm_kernels fsdp_cpu_norm_kernels;

// GEMMs on bfloat16 operands (bf16.c): the linalg table's gemm_bf16_many
int fsdp_cpu_gemm_bf16_many(int n, const fsdp_gemm_bf16_args* g);

// the vector ISA our kernels and oneDNN may use (cpuinfo.c): the CPU's widest, capped by
// FSDP_CPU_ISA; cheap after the first call
enum { FSDP_ISA_SSE2, FSDP_ISA_AVX2, FSDP_ISA_AVX512 };
int fsdp_cpu_isa_level(void);

// convolution through oneDNN (onednn.c), with the arguments of the conv2d kernels; the operands
// x, w, gy are float32 or (dtype FSDP_BF16) bfloat16, the results float32: 0, 1 when it leaves
// this geometry (or this dtype on this CPU) to the caller, -1 with the error set. The backward
// computes gb only together with gw, and returns 1 when neither gx nor gw is wanted.
int fsdp_cpu_onednn_conv2d_forward(const fsdp_conv_geom* g, int dtype, float* y, const void* x, const void* w,
                                   const float* b);
int fsdp_cpu_onednn_conv2d_backward(const fsdp_conv_geom* g, int dtype, float* gx, float* gw, float* gb, const void* gy,
                                    const void* x, const void* w);

#endif
