/*
 * core/kernels_linalg.h -- GEMM, convolution and pooling kernels (one table per device).
 * Matrices are row-major f32 (gemm_bf16_many: bf16 operands); the op layer (ops/linalg.c, ops/conv.c)
 * checks shapes.
 */
#ifndef FSDP_KERNELS_LINALG_H
#define FSDP_KERNELS_LINALG_H
#include <stdint.h>

// geometry of a 2-D convolution or pooling window over NCHW tensors
typedef struct fsdp_conv_geom {
  int64_t N, C, H, W;  // input (N, C, H, W)
  int64_t O, OH, OW;   // output (N, O, OH, OW); O = C for pooling
  int kh, kw, sh, sw, ph, pw, dh, dw;
  int groups;
} fsdp_conv_geom;

// one GEMM: C (M,N) = alpha * op(A) @ op(B) + beta * C; op(X) = X^T when tX; lda/ldb/ldc are row strides
typedef struct fsdp_gemm_args {
  int ta, tb;
  int64_t M, N, K;
  float alpha;
  const float* A;
  int64_t lda;
  const float* B;
  int64_t ldb;
  float beta;
  float* C;
  int64_t ldc;
} fsdp_gemm_args;

// one GEMM on bfloat16 operands: C (M,N) = alpha * op(A) @ op(B) + beta * C with A and B bfloat16
// (raw bits; row-major with row strides lda/ldb, as in fsdp_gemm_args) and C float32: the products
// are exact in float32 and summed in float32
typedef struct fsdp_gemm_bf16_args {
  int ta, tb;
  int64_t M, N, K;
  float alpha;
  const uint16_t* A;
  int64_t lda;
  const uint16_t* B;
  int64_t ldb;
  float beta;
  float* C;
  int64_t ldc;
} fsdp_gemm_bf16_args;

// gemm_tiles' limits, for causal self-attention over T queries and T keys (query i sees keys j <= i),
// per row tile of C holding rows [m0, m1) (the tile's height is the kernel's choice: work past the
// diagonal inside a tile reads P or dS where they are 0, or writes scores the causal softmax ignores):
enum {
  FSDP_TILES_ALL = 0,      // the whole product
  FSDP_TILES_COLS_TO_ROW,  // columns j < m1 only, later columns set to 0 (scores q k^T, dP = dO v^T)
  FSDP_TILES_K_TO_ROW,     // k < m1 only (O = P v, dQ = dS k)
  FSDP_TILES_K_FROM_ROW,   // k >= m0 only (dV = P^T dO, dK = dS^T q)
};

typedef struct fsdp_linalg_kernels {
  // n independent GEMMs (each C (M,N) = alpha op(A) @ op(B) + beta C, op(X) = X^T when tX, row
  // strides lda/ldb/ldc; no C overlaps another GEMM's A, B or C), run together: the threads share
  // them out (e.g. a linear backward's grad_x and grad_w, one GEMM per thread)
  void (*gemm_many)(int n, const fsdp_gemm_args* g);
  // n small independent GEMMs (attention: one per batch matrix and head; beta 0), run together;
  // GEMM i skips the parts causal self-attention knows to be zero (limits[i], below). 0, or -1 with
  // the error set
  int (*gemm_tiles)(int n, const fsdp_gemm_args* g, const int* limits);
  // n independent GEMMs on bfloat16 operands (none empty), run together: a bf16 GEMM where the
  // device has one, else the float32 GEMM on float32 copies of the operands. 0, or -1 with the
  // error set (no scratch memory)
  int (*gemm_bf16_many)(int n, const fsdp_gemm_bf16_args* g);
  // ---- linear -----------------------------------------------------------------------------------
  // every row of y (M, N) = b (N)
  void (*bias_rows)(float* y, const float* b, int64_t M, int64_t N);
  // gb (N) = sum over the rows of gy (M, N)
  void (*sum_rows)(float* gb, const float* gy, int64_t M, int64_t N);
  // ---- convolution (return 0, or -1 with the error set when scratch memory runs out) -------------
  // y (N, O, OH, OW) = conv(x (N, C, H, W), w (O, C/groups, kh, kw)) + b (O) (b may be NULL)
  int (*conv2d_forward)(const fsdp_conv_geom* g, float* y, const float* x, const float* w, const float* b);
  // any of gx (N,C,H,W), gw (O,C/groups,kh,kw), gb (O) may be NULL (not wanted); all are overwritten
  int (*conv2d_backward)(const fsdp_conv_geom* g, float* gx, float* gw, float* gb, const float* gy, const float* x,
                         const float* w);
  // the same two on bfloat16 operands x, w, gy (the bias stays float32), accumulated in float32, with
  // float32 results: 1 where the device has no bf16 convolution for this geometry (the op layer
  // then runs the float32 entries on float32 copies)
  int (*conv2d_forward_bf16)(const fsdp_conv_geom* g, float* y, const uint16_t* x, const uint16_t* w, const float* b);
  int (*conv2d_backward_bf16)(const fsdp_conv_geom* g, float* gx, float* gw, float* gb, const uint16_t* gy,
                              const uint16_t* x, const uint16_t* w);
  // ---- pooling (geometry: O = C, groups unused) -------------------------------------------------------
  // y (N, C, OH, OW) = max over each window; idx = flat argmax h*W + w within the plane
  void (*max_pool2d_forward)(const fsdp_conv_geom* g, float* y, int64_t* idx, const float* x);
  // gx (N, C, H, W) = scatter-add of gy at idx (gx overwritten)
  void (*max_pool2d_backward)(const fsdp_conv_geom* g, float* gx, const float* gy, const int64_t* idx);
  void (*avg_pool2d_forward)(const fsdp_conv_geom* g, float* y, const float* x, int count_include_pad);
  void (*avg_pool2d_backward)(const fsdp_conv_geom* g, float* gx, const float* gy, int count_include_pad);
  // adaptive: window i covers [floor(i*H/OH), ceil((i+1)*H/OH)) (kernel/stride fields unused)
  void (*adaptive_avg_pool2d_forward)(const fsdp_conv_geom* g, float* y, const float* x);
  void (*adaptive_avg_pool2d_backward)(const fsdp_conv_geom* g, float* gx, const float* gy);
} fsdp_linalg_kernels;

#endif
