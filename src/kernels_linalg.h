/*
 * kernels_linalg.h -- GEMM, convolution and pooling kernels (one table per device).
 * Matrices are row-major f32; the op layer (ops_linalg.c, ops_conv.c) checks shapes.
 */
#ifndef FSDP_KERNELS_LINALG_H
#define FSDP_KERNELS_LINALG_H
#include <stdint.h>

typedef struct fsdp_linalg_kernels {
  // C (M,N) = alpha * op(A) @ op(B) + beta * C; op(X) = X^T when tX; lda/ldb/ldc are row strides
  void (*gemm)(int ta, int tb, int64_t M, int64_t N, int64_t K, float alpha, const float* A, int64_t lda,
               const float* B, int64_t ldb, float beta, float* C, int64_t ldc);
  // `batch` independent gemms; matrix b of A/B/C starts at A + b*sa, B + b*sb, C + b*sc
  void (*gemm_batched)(int64_t batch, int ta, int tb, int64_t M, int64_t N, int64_t K, float alpha,
                       const float* A, int64_t lda, int64_t sa, const float* B, int64_t ldb, int64_t sb,
                       float beta, float* C, int64_t ldc, int64_t sc);
} fsdp_linalg_kernels;

#endif
