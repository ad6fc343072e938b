/*
 * cpu_linalg.c -- CPU kernels of the linalg family (see kernels_linalg.h): GEMMs through
 * OpenBLAS, convolution and pooling loops.
 */
#include "internal.h"

#include <cblas.h>

static void cpu_gemm(int ta, int tb, int64_t M, int64_t N, int64_t K, float alpha, const float* A, int64_t lda,
                     const float* B, int64_t ldb, float beta, float* C, int64_t ldc) {
  cblas_sgemm(CblasRowMajor, ta ? CblasTrans : CblasNoTrans, tb ? CblasTrans : CblasNoTrans, (int)M, (int)N, (int)K,
              alpha, A, (int)lda, B, (int)ldb, beta, C, (int)ldc);
}

static void cpu_gemm_batched(int64_t batch, int ta, int tb, int64_t M, int64_t N, int64_t K, float alpha,
                             const float* A, int64_t lda, int64_t sa, const float* B, int64_t ldb, int64_t sb,
                             float beta, float* C, int64_t ldc, int64_t sc) {
  for (int64_t b = 0; b < batch; b++)
    cpu_gemm(ta, tb, M, N, K, alpha, A + b * sa, lda, B + b * sb, ldb, beta, C + b * sc, ldc);
}

const fsdp_linalg_kernels fsdp_cpu_linalg_kernels = {
    .gemm = cpu_gemm,
    .gemm_batched = cpu_gemm_batched,
};
