/*
 * backend/cuda/linalg.cu -- GEMMs through cuBLASLt, convolutions through cuDNN, pooling and the
 * linear helpers by hand (core/kernels_linalg.h; backend/cpu/linalg.c is the reference).
 *
 * Row-major GEMMs on a column-major library: C (M, N) = op(A) op(B) in row-major is, read as
 * column-major, C^T (N, M) = op(B)^T op(A)^T, so each call hands cuBLASLt B first and A second,
 * N and M swapped, the transposes kept. float32 GEMMs compute in float32 (CUBLAS_COMPUTE_32F: no
 * TF32 unless FSDP_CUDA_TF32=1 asks for it); bfloat16 operands multiply on the tensor cores with
 * float32 sums and a float32 C. cuBLASLt's heuristic pick is cached per shape, as cuDNN's
 * algorithm per convolution geometry.
 */
#include "backend/cuda/cuda_util.h"

#include <cublasLt.h>
#include <cudnn.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define NT 256

// ---- cuBLASLt ---------------------------------------------------------------------------------------
static cublasLtHandle_t g_lt;
static void* g_lt_ws;
static const size_t LT_WS = (size_t)32 << 20;  // cuBLASLt's workspace (its kernels' split-K buffers)

static int lt_ready(void) {
  if (g_lt) return 0;
  cublasStatus_t s = cublasLtCreate(&g_lt);
  if (s != CUBLAS_STATUS_SUCCESS) {
    g_lt = NULL;
    fsdp_cuda_fail("gemm: cublasLtCreate", cudaErrorUnknown);
    return -1;
  }
  // from the compute stream's pool (a plain cudaMalloc could fail once the pool, which keeps what it
  // grew to, holds the memory); without it the GEMMs run without a workspace
  if (cudaMallocAsync(&g_lt_ws, LT_WS, fsdp_cuda_stream) != cudaSuccess) {
    (void)cudaGetLastError();
    g_lt_ws = NULL;
  }
  return 0;
}

// the alignment cuBLASLt may assume of an operand: the largest power of two up to 256 dividing its
// address, its row stride and its batch stride in bytes (attention heads cut from one projection,
// batch slices and narrowed views are often only 4- or 16-byte aligned; an algorithm chosen for
// 256 would refuse them or fault)
static uint32_t alignment(const void* p, int64_t ld, int64_t stride, size_t es) {
  uint64_t x = (uint64_t)(uintptr_t)p | (uint64_t)(ld * (int64_t)es) | (uint64_t)(stride * (int64_t)es) | 256;
  return (uint32_t)(x & (~x + 1));  // the lowest set bit
}

// one GEMM shape (with its operands' alignments and the math mode) and its chosen algorithm
typedef struct {
  int ta, tb, bf16, tf32, used;
  int64_t M, N, K, lda, ldb, ldc, batch, sa, sb, sc;
  uint32_t align_a, align_b, align_c;
  cublasLtMatmulAlgo_t algo;
} lt_plan;
#define LT_PLANS 128
static lt_plan g_plans[LT_PLANS];
static int g_plan_next;

static int tf32_allowed(void) {
  const char* s = getenv("FSDP_CUDA_TF32");
  return s && s[0] == '1';
}

// C = alpha op(A) op(B) + beta C for `batch` matrices (strides sa, sb, sc; batch 1: single)
static int lt_gemm(int ta, int tb, int64_t M, int64_t N, int64_t K, float alpha, const void* A, int64_t lda, int64_t sa,
                   const void* B, int64_t ldb, int64_t sb, float beta, float* C, int64_t ldc, int64_t sc, int64_t batch,
                   int bf16) {
  if (M == 0 || N == 0) return 0;
  if (K == 0) {  // an empty sum: C = beta C
    if (beta == 0.0f)
      for (int64_t b = 0; b < batch; b++) cudaMemset2DAsync(C + b * sc, ldc * 4, 0, N * 4, M, fsdp_cuda_stream);
    // (beta != 0 with K = 0 does not occur: the op layer zeroes or accumulates real products)
    return 0;
  }
  if (lt_ready()) return -1;
  cudaDataType_t ab = bf16 ? CUDA_R_16BF : CUDA_R_32F;
  int tf32 = !bf16 && tf32_allowed();
  cublasComputeType_t ct = tf32 ? CUBLAS_COMPUTE_32F_FAST_TF32 : CUBLAS_COMPUTE_32F;
  size_t es = bf16 ? 2 : 4;
  uint32_t align_a = alignment(A, lda, batch > 1 ? sa : 0, es), align_b = alignment(B, ldb, batch > 1 ? sb : 0, es);
  uint32_t align_c = alignment(C, ldc, batch > 1 ? sc : 0, 4);
  // column-major: D^T (N, M) = op(B)^T (N, K) op(A)^T (K, M)
  cublasOperation_t opa = tb ? CUBLAS_OP_T : CUBLAS_OP_N, opb = ta ? CUBLAS_OP_T : CUBLAS_OP_N;
  cublasLtMatmulDesc_t desc = NULL;
  cublasLtMatrixLayout_t la = NULL, lb = NULL, lc = NULL;
  cublasStatus_t s = cublasLtMatmulDescCreate(&desc, ct, CUDA_R_32F);
  if (s == CUBLAS_STATUS_SUCCESS)
    s = cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSA, &opa, sizeof opa);
  if (s == CUBLAS_STATUS_SUCCESS)
    s = cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSB, &opb, sizeof opb);
  // stored shapes, column-major: B is (N, K) when not transposed for the library (row-major (K, N))
  if (s == CUBLAS_STATUS_SUCCESS) s = cublasLtMatrixLayoutCreate(&la, ab, tb ? K : N, tb ? N : K, ldb);
  if (s == CUBLAS_STATUS_SUCCESS) s = cublasLtMatrixLayoutCreate(&lb, ab, ta ? M : K, ta ? K : M, lda);
  if (s == CUBLAS_STATUS_SUCCESS) s = cublasLtMatrixLayoutCreate(&lc, CUDA_R_32F, N, M, ldc);
  if (s == CUBLAS_STATUS_SUCCESS && batch > 1) {  // (a refused attribute must not leave one matrix)
    int32_t nb = (int32_t)batch;
    int64_t sbb = sb, saa = sa, scc = sc;
    cublasLtMatrixLayout_t ls[3] = {la, lb, lc};
    int64_t* strides[3] = {&sbb, &saa, &scc};
    for (int i = 0; i < 3 && s == CUBLAS_STATUS_SUCCESS; i++) {
      s = cublasLtMatrixLayoutSetAttribute(ls[i], CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT, &nb, sizeof nb);
      if (s == CUBLAS_STATUS_SUCCESS)
        s = cublasLtMatrixLayoutSetAttribute(ls[i], CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET, strides[i],
                                             sizeof *strides[i]);
    }
  }
  // the algorithm: cached per shape
  lt_plan* plan = NULL;
  for (int i = 0; i < LT_PLANS && s == CUBLAS_STATUS_SUCCESS; i++) {
    lt_plan* p = &g_plans[i];
    if (p->used && p->ta == ta && p->tb == tb && p->bf16 == bf16 && p->tf32 == tf32 && p->M == M && p->N == N &&
        p->K == K && p->lda == lda && p->ldb == ldb && p->ldc == ldc && p->batch == batch && p->sa == sa &&
        p->sb == sb && p->sc == sc && p->align_a == align_a && p->align_b == align_b && p->align_c == align_c) {
      plan = p;
      break;
    }
  }
  if (!plan && s == CUBLAS_STATUS_SUCCESS) {
    cublasLtMatmulPreference_t pref = NULL;
    cublasLtMatmulHeuristicResult_t res;
    int found = 0;
    size_t ws = g_lt_ws ? LT_WS : 0;
    s = cublasLtMatmulPreferenceCreate(&pref);
    if (s == CUBLAS_STATUS_SUCCESS)
      s = cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof ws);
    // (the library's A is our B, its B our A: C^T = op(B)^T op(A)^T)
    if (s == CUBLAS_STATUS_SUCCESS)
      s = cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, &align_b,
                                               sizeof align_b);
    if (s == CUBLAS_STATUS_SUCCESS)
      s = cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, &align_a,
                                               sizeof align_a);
    if (s == CUBLAS_STATUS_SUCCESS)
      s = cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, &align_c,
                                               sizeof align_c);
    if (s == CUBLAS_STATUS_SUCCESS)
      s = cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, &align_c,
                                               sizeof align_c);
    if (s == CUBLAS_STATUS_SUCCESS)
      s = cublasLtMatmulAlgoGetHeuristic(g_lt, desc, la, lb, lc, lc, pref, 1, &res, &found);
    if (pref) cublasLtMatmulPreferenceDestroy(pref);
    if (s == CUBLAS_STATUS_SUCCESS && found < 1) s = CUBLAS_STATUS_NOT_SUPPORTED;
    if (s == CUBLAS_STATUS_SUCCESS) {
      plan = &g_plans[g_plan_next];
      g_plan_next = (g_plan_next + 1) % LT_PLANS;
      lt_plan np = {ta,  tb,    bf16, tf32, 1,  M,       N,       K,       lda,     ldb,
                    ldc, batch, sa,   sb,   sc, align_a, align_b, align_c, res.algo};
      *plan = np;
    }
  }
  if (s == CUBLAS_STATUS_SUCCESS)
    s = cublasLtMatmul(g_lt, desc, &alpha, B, la, A, lb, &beta, C, lc, C, lc, &plan->algo, g_lt_ws, g_lt_ws ? LT_WS : 0,
                       fsdp_cuda_stream);
  if (la) cublasLtMatrixLayoutDestroy(la);
  if (lb) cublasLtMatrixLayoutDestroy(lb);
  if (lc) cublasLtMatrixLayoutDestroy(lc);
  if (desc) cublasLtMatmulDescDestroy(desc);
  if (s != CUBLAS_STATUS_SUCCESS) {
    char op[160];
    snprintf(op, sizeof op, "gemm (%lld x %lld x %lld%s): cuBLASLt status %d", (long long)M, (long long)N, (long long)K,
             bf16 ? ", bfloat16" : "", (int)s);
    fsdp_cuda_fail(op, cudaErrorUnknown);
    // the float32 GEMM entries return nothing (the CPU's never fail): C becomes NaN, so a failed
    // product cannot pass for a result
    for (int64_t b = 0; b < batch; b++) cudaMemset2DAsync(C + b * sc, ldc * 4, 0xff, N * 4, M, fsdp_cuda_stream);
    return -1;
  }
  return 0;
}

static void cuda_gemm_many(int n, const fsdp_gemm_args* g) {
  for (int i = 0; i < n; i++)
    lt_gemm(g[i].ta, g[i].tb, g[i].M, g[i].N, g[i].K, g[i].alpha, g[i].A, g[i].lda, 0, g[i].B, g[i].ldb, 0, g[i].beta,
            g[i].C, g[i].ldc, 0, 1, 0);
}

// FSDP_TILES_COLS_TO_ROW: the product's columns j > i are zero (causal scores): set them so
__global__ static void zero_above_k(float* C, int64_t M, int64_t N, int64_t ldc) {
  for (int64_t w = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; w < M * N; w += (int64_t)gridDim.x * blockDim.x) {
    int64_t i = w / N, j = w % N;
    if (j > i) C[i * ldc + j] = 0.0f;
  }
}
// the limits only skip work known to be zero (the k ranges), so whole products give the same
// numbers; the scores' causal triangle is zeroed after the product
static int cuda_gemm_tiles(int n, const fsdp_gemm_args* g, const int* limits) {
  for (int i = 0; i < n; i++) {
    if (lt_gemm(g[i].ta, g[i].tb, g[i].M, g[i].N, g[i].K, g[i].alpha, g[i].A, g[i].lda, 0, g[i].B, g[i].ldb, 0, 0.0f,
                g[i].C, g[i].ldc, 0, 1, 0))
      return -1;
    if (limits[i] == FSDP_TILES_COLS_TO_ROW && g[i].M * g[i].N > 0)
      zero_above_k<<<fsdp_cuda_blocks(g[i].M * g[i].N), NT, 0, fsdp_cuda_stream>>>(g[i].C, g[i].M, g[i].N, g[i].ldc);
  }
  FSDP_CUDA_LAUNCHED("attention");
  return 0;
}
static int cuda_gemm_bf16_many(int n, const fsdp_gemm_bf16_args* g) {
  for (int i = 0; i < n; i++)
    if (lt_gemm(g[i].ta, g[i].tb, g[i].M, g[i].N, g[i].K, g[i].alpha, g[i].A, g[i].lda, 0, g[i].B, g[i].ldb, 0,
                g[i].beta, g[i].C, g[i].ldc, 0, 1, 1))
      return -1;
  return 0;
}

// ---- linear helpers ------------------------------------------------------------------------------------
__global__ static void bias_rows_k(float* y, const float* b, int64_t M, int64_t N) {
  for (int64_t w = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; w < M * N; w += (int64_t)gridDim.x * blockDim.x)
    y[w] = b[w % N];
}
static void cuda_bias_rows(float* y, const float* b, int64_t M, int64_t N) {
  if (M * N == 0) return;
  bias_rows_k<<<fsdp_cuda_blocks(M * N), NT, 0, fsdp_cuda_stream>>>(y, b, M, N);
  FSDP_CUDA_LAUNCHED("linear");
}
// gb (N) = sum over rows: one thread per column, summed in double
__global__ static void sum_rows_k(float* gb, const float* gy, int64_t M, int64_t N) {
  for (int64_t j = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; j < N; j += (int64_t)gridDim.x * blockDim.x) {
    double s = 0.0;
    for (int64_t i = 0; i < M; i++) s += gy[i * N + j];
    gb[j] = (float)s;
  }
}
static void cuda_sum_rows(float* gb, const float* gy, int64_t M, int64_t N) {
  if (N == 0) return;
  sum_rows_k<<<fsdp_cuda_blocks(N), NT, 0, fsdp_cuda_stream>>>(gb, gy, M, N);
  FSDP_CUDA_LAUNCHED("linear backward");
}

// ---- convolution through cuDNN ---------------------------------------------------------------------------
static cudnnHandle_t g_dnn;
static int dnn_ready(void) {
  if (g_dnn) return 0;
  cudnnStatus_t s = cudnnCreate(&g_dnn);
  if (s == CUDNN_STATUS_SUCCESS) s = cudnnSetStream(g_dnn, fsdp_cuda_stream);
  if (s != CUDNN_STATUS_SUCCESS) {
    char op[160];
    snprintf(op, sizeof op, "conv2d: cuDNN does not start (%s)", cudnnGetErrorString(s));
    fsdp_cuda_fail(op, cudaErrorUnknown);
    g_dnn = NULL;
    return -1;
  }
  return 0;
}

// one geometry's descriptors and chosen algorithms (forward, data grad, filter grad)
typedef struct {
  fsdp_conv_geom g;
  int used;
  cudnnTensorDescriptor_t x, y, b;
  cudnnFilterDescriptor_t w;
  cudnnConvolutionDescriptor_t conv;
  cudnnConvolutionFwdAlgo_t fwd;
  cudnnConvolutionBwdDataAlgo_t bwd_data;
  cudnnConvolutionBwdFilterAlgo_t bwd_filter;
  cudnnMathType_t math_fwd, math_data, math_filter;  // each algorithm's math (set before its call)
  size_t ws_fwd, ws_data, ws_filter;
} conv_plan;

// of cuDNN's ranked heuristic results: the first that runs (status SUCCESS) in float32 math (or
// TF32 when FSDP_CUDA_TF32=1) with a workspace under CONV_WS_CAP; -1 when none does
#define CONV_WS_CAP ((size_t)512 << 20)
#define CONV_ALGOS 8
#define PICK_ALGO(perf, n)                                                                 \
  ({                                                                                       \
    int pick_ = -1;                                                                        \
    for (int i_ = 0; i_ < (n) && pick_ < 0; i_++)                                          \
      if ((perf)[i_].status == CUDNN_STATUS_SUCCESS && (perf)[i_].memory <= CONV_WS_CAP && \
          (tf32_allowed() || (perf)[i_].mathType == CUDNN_FMA_MATH))                       \
        pick_ = i_;                                                                        \
    pick_;                                                                                 \
  })
#define CONV_PLANS 64
static conv_plan g_conv[CONV_PLANS];
static int g_conv_next;

// field by field (memcmp would compare the struct's padding too)
static int same_geom(const fsdp_conv_geom* a, const fsdp_conv_geom* b) {
  return a->N == b->N && a->C == b->C && a->H == b->H && a->W == b->W && a->O == b->O && a->OH == b->OH &&
         a->OW == b->OW && a->kh == b->kh && a->kw == b->kw && a->sh == b->sh && a->sw == b->sw && a->ph == b->ph &&
         a->pw == b->pw && a->dh == b->dh && a->dw == b->dw && a->groups == b->groups;
}

static conv_plan* conv_plan_for(const fsdp_conv_geom* g) {
  for (int i = 0; i < CONV_PLANS; i++)
    if (g_conv[i].used && same_geom(&g_conv[i].g, g)) return &g_conv[i];
  if (dnn_ready()) return NULL;
  conv_plan* p = &g_conv[g_conv_next];
  g_conv_next = (g_conv_next + 1) % CONV_PLANS;
  if (p->used) {
    cudnnDestroyTensorDescriptor(p->x);
    cudnnDestroyTensorDescriptor(p->y);
    cudnnDestroyTensorDescriptor(p->b);
    cudnnDestroyFilterDescriptor(p->w);
    cudnnDestroyConvolutionDescriptor(p->conv);
    p->used = 0;
  }
  memset(p, 0, sizeof *p);
  p->g = *g;
  int groups = g->groups > 0 ? g->groups : 1;
  cudnnStatus_t s = cudnnCreateTensorDescriptor(&p->x);
  if (!s) s = cudnnCreateTensorDescriptor(&p->y);
  if (!s) s = cudnnCreateTensorDescriptor(&p->b);
  if (!s) s = cudnnCreateFilterDescriptor(&p->w);
  if (!s) s = cudnnCreateConvolutionDescriptor(&p->conv);
  if (!s)
    s = cudnnSetTensor4dDescriptor(p->x, CUDNN_TENSOR_NCHW, CUDNN_DATA_FLOAT, (int)g->N, (int)g->C, (int)g->H,
                                   (int)g->W);
  if (!s)
    s = cudnnSetTensor4dDescriptor(p->y, CUDNN_TENSOR_NCHW, CUDNN_DATA_FLOAT, (int)g->N, (int)g->O, (int)g->OH,
                                   (int)g->OW);
  if (!s) s = cudnnSetTensor4dDescriptor(p->b, CUDNN_TENSOR_NCHW, CUDNN_DATA_FLOAT, 1, (int)g->O, 1, 1);
  if (!s)
    s = cudnnSetFilter4dDescriptor(p->w, CUDNN_DATA_FLOAT, CUDNN_TENSOR_NCHW, (int)g->O, (int)(g->C / groups), g->kh,
                                   g->kw);
  if (!s)
    s = cudnnSetConvolution2dDescriptor(p->conv, g->ph, g->pw, g->sh, g->sw, g->dh, g->dw, CUDNN_CROSS_CORRELATION,
                                        CUDNN_DATA_FLOAT);
  if (!s) s = cudnnSetConvolutionGroupCount(p->conv, groups);
  // float32 stays float32: no TF32 unless asked (FSDP_CUDA_TF32=1)
  if (!s) s = cudnnSetConvolutionMathType(p->conv, tf32_allowed() ? CUDNN_DEFAULT_MATH : CUDNN_FMA_MATH);
  int n = 0, k = -1;
  cudnnConvolutionFwdAlgoPerf_t fp[CONV_ALGOS];
  cudnnConvolutionBwdDataAlgoPerf_t dp[CONV_ALGOS];
  cudnnConvolutionBwdFilterAlgoPerf_t wp[CONV_ALGOS];
  if (!s) s = cudnnGetConvolutionForwardAlgorithm_v7(g_dnn, p->x, p->w, p->conv, p->y, CONV_ALGOS, &n, fp);
  if (!s && (k = PICK_ALGO(fp, n)) < 0) s = CUDNN_STATUS_NOT_SUPPORTED;
  if (!s) p->fwd = fp[k].algo, p->ws_fwd = fp[k].memory, p->math_fwd = fp[k].mathType;
  if (!s) s = cudnnGetConvolutionBackwardDataAlgorithm_v7(g_dnn, p->w, p->y, p->conv, p->x, CONV_ALGOS, &n, dp);
  if (!s && (k = PICK_ALGO(dp, n)) < 0) s = CUDNN_STATUS_NOT_SUPPORTED;
  if (!s) p->bwd_data = dp[k].algo, p->ws_data = dp[k].memory, p->math_data = dp[k].mathType;
  if (!s) s = cudnnGetConvolutionBackwardFilterAlgorithm_v7(g_dnn, p->x, p->y, p->conv, p->w, CONV_ALGOS, &n, wp);
  if (!s && (k = PICK_ALGO(wp, n)) < 0) s = CUDNN_STATUS_NOT_SUPPORTED;
  if (!s) p->bwd_filter = wp[k].algo, p->ws_filter = wp[k].memory, p->math_filter = wp[k].mathType;
  if (s) {
    char op[200];
    snprintf(op, sizeof op, "conv2d (N %lld, C %lld, %lldx%lld -> O %lld, %dx%d): cuDNN %s", (long long)g->N,
             (long long)g->C, (long long)g->H, (long long)g->W, (long long)g->O, g->kh, g->kw, cudnnGetErrorString(s));
    fsdp_cuda_fail(op, cudaErrorUnknown);
    return NULL;
  }
  p->used = 1;
  return p;
}

static void* ws_alloc(size_t n) {
  void* p = NULL;
  if (n && cudaMallocAsync(&p, n, fsdp_cuda_stream) != cudaSuccess) {
    fsdp_cuda_fail("conv2d: workspace", cudaGetLastError());
    return (void*)-1;
  }
  return p;
}

static int dnn_check(const char* what, cudnnStatus_t s) {
  if (s == CUDNN_STATUS_SUCCESS) return 0;
  char op[160];
  snprintf(op, sizeof op, "%s: cuDNN %s", what, cudnnGetErrorString(s));
  fsdp_cuda_fail(op, cudaErrorUnknown);
  return -1;
}

// cuDNN takes a geometry only when its output size follows from its input size. A transposed
// convolution with an output_padding of at least its stride (allowed under dilation) is the input
// gradient of a convolution whose input has more rows than that convolution's output needs: the
// output that follows from the input (`full`, one or more rows and columns longer) is computed
// instead -- its extra rows and columns hold zero gradient going back, so no sum changes -- and a
// forward result is cut back to the geometry's. (Found by the CUDA executor, tests/cudaemu, whose
// cuDNN refuses such descriptors as cuDNN does.)
static fsdp_conv_geom full_output(const fsdp_conv_geom* g) {
  fsdp_conv_geom f = *g;
  f.OH = (g->H + 2 * g->ph - (int64_t)g->dh * (g->kh - 1) - 1) / g->sh + 1;
  f.OW = (g->W + 2 * g->pw - (int64_t)g->dw * (g->kw - 1) - 1) / g->sw + 1;
  return f;
}
// dst (planes, dh, dw) <- the top-left (h, w) of each plane of src (planes, sh, sw); the rest of dst zeros
__global__ static void plane_window_k(float* dst, int64_t dh, int64_t dw, const float* src, int64_t sh, int64_t sw,
                                      int64_t planes, int64_t h, int64_t w) {
  int64_t total = planes * dh * dw;
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < total; i += (int64_t)gridDim.x * blockDim.x) {
    int64_t pl = i / (dh * dw), r = i / dw % dh, c = i % dw;
    dst[i] = r < h && c < w ? src[(pl * sh + r) * sw + c] : 0.0f;
  }
}
static void plane_window(float* dst, int64_t dh, int64_t dw, const float* src, int64_t sh, int64_t sw, int64_t planes,
                         int64_t h, int64_t w) {
  plane_window_k<<<fsdp_cuda_blocks(planes * dh * dw), NT, 0, fsdp_cuda_stream>>>(dst, dh, dw, src, sh, sw, planes, h,
                                                                                  w);
  FSDP_CUDA_LAUNCHED("conv2d");
}
static float* output_buffer(const fsdp_conv_geom* f) {
  void* p = NULL;
  if (cudaMallocAsync(&p, f->N * f->O * f->OH * f->OW * sizeof(float), fsdp_cuda_stream) != cudaSuccess) {
    fsdp_cuda_fail("conv2d: output buffer", cudaGetLastError());
    return NULL;
  }
  return (float*)p;
}

static int cuda_conv2d_backward(const fsdp_conv_geom* g, float* gx, float* gw, float* gb, const float* gy,
                                const float* x, const float* w);

// An empty sum -- no input channel or pixel (padding alone reaches the outputs) -- is no tensor for
// cuDNN: the output is the bias (or zeros), and going back the bias gradient is the sum of gy over
// (N, OH, OW), the other gradients zeros. (Found by the CUDA executor.)
__global__ static void channel_fill_k(float* y, const float* b, int64_t n, int64_t O, int64_t P) {
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x)
    y[i] = b ? b[i / P % O] : 0.0f;
}
__global__ static void channel_sum_k(float* gb, const float* gy, int64_t N, int64_t O, int64_t P) {
  for (int64_t c = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; c < O; c += (int64_t)gridDim.x * blockDim.x) {
    double s = 0.0;
    for (int64_t n = 0; n < N; n++)
      for (int64_t k = 0; k < P; k++) s += gy[(n * O + c) * P + k];
    gb[c] = (float)s;
  }
}

static int cuda_conv2d_forward(const fsdp_conv_geom* g, float* y, const float* x, const float* w, const float* b) {
  int64_t n = g->N * g->O * g->OH * g->OW;
  if (n == 0) return 0;           // nothing to compute (cuDNN refuses empty tensors)
  if (g->C * g->H * g->W == 0) {  // (an empty sum: above)
    channel_fill_k<<<fsdp_cuda_blocks(n), NT, 0, fsdp_cuda_stream>>>(y, b, n, g->O, g->OH * g->OW);
    FSDP_CUDA_LAUNCHED("conv2d");
    return 0;
  }
  fsdp_conv_geom f = full_output(g);
  if (f.OH != g->OH || f.OW != g->OW) {  // (see full_output)
    float* yf = output_buffer(&f);
    if (!yf) return -1;
    int rc = cuda_conv2d_forward(&f, yf, x, w, b);
    if (!rc) plane_window(y, g->OH, g->OW, yf, f.OH, f.OW, g->N * g->O, g->OH, g->OW);
    cudaFreeAsync(yf, fsdp_cuda_stream);
    return rc;
  }
  conv_plan* p = conv_plan_for(g);
  if (!p) return -1;
  void* ws = ws_alloc(p->ws_fwd);
  if (ws == (void*)-1) return -1;
  float one = 1.0f, zero = 0.0f;
  cudnnSetConvolutionMathType(p->conv, p->math_fwd);
  int rc = dnn_check(
      "conv2d", cudnnConvolutionForward(g_dnn, &one, p->x, x, p->w, w, p->conv, p->fwd, ws, p->ws_fwd, &zero, p->y, y));
  if (!rc && b) rc = dnn_check("conv2d bias", cudnnAddTensor(g_dnn, &one, p->b, b, &one, p->y, y));
  if (ws) cudaFreeAsync(ws, fsdp_cuda_stream);
  return rc;
}

static int cuda_conv2d_backward(const fsdp_conv_geom* g, float* gx, float* gw, float* gb, const float* gy,
                                const float* x, const float* w) {
  fsdp_conv_geom f = full_output(g);
  if (g->N * g->O * g->OH * g->OW > 0 && g->C > 0 && (f.OH != g->OH || f.OW != g->OW)) {  // (see full_output)
    float* gyf = output_buffer(&f);
    if (!gyf) return -1;
    plane_window(gyf, f.OH, f.OW, gy, g->OH, g->OW, g->N * g->O, g->OH, g->OW);
    int rc = cuda_conv2d_backward(&f, gx, gw, gb, gyf, x, w);
    cudaFreeAsync(gyf, fsdp_cuda_stream);
    return rc;
  }
  int64_t outputs = g->N * g->O * g->OH * g->OW;
  if (outputs == 0 || g->C * g->H * g->W == 0) {  // no output, or an empty sum (above): zeros, as on the CPU
    int64_t groups = g->groups > 0 ? g->groups : 1;
    if (gx) cudaMemsetAsync(gx, 0, g->N * g->C * g->H * g->W * sizeof(float), fsdp_cuda_stream);
    if (gw) cudaMemsetAsync(gw, 0, g->O * (g->C / groups) * g->kh * g->kw * sizeof(float), fsdp_cuda_stream);
    if (gb && outputs == 0) cudaMemsetAsync(gb, 0, g->O * sizeof(float), fsdp_cuda_stream);
    if (gb && outputs > 0) {  // (but the bias still sums its outputs' gradients)
      channel_sum_k<<<fsdp_cuda_blocks(g->O), NT, 0, fsdp_cuda_stream>>>(gb, gy, g->N, g->O, g->OH * g->OW);
      FSDP_CUDA_LAUNCHED("conv2d backward");
    }
    return 0;
  }
  conv_plan* p = conv_plan_for(g);
  if (!p) return -1;
  size_t need = p->ws_data > p->ws_filter ? p->ws_data : p->ws_filter;
  void* ws = ws_alloc(need);
  if (ws == (void*)-1) return -1;
  float one = 1.0f, zero = 0.0f;
  int rc = 0;
  cudnnSetConvolutionMathType(p->conv, p->math_data);
  if (gx)
    rc = dnn_check("conv2d backward (input)",
                   cudnnConvolutionBackwardData(g_dnn, &one, p->w, w, p->y, gy, p->conv, p->bwd_data, ws, p->ws_data,
                                                &zero, p->x, gx));
  cudnnSetConvolutionMathType(p->conv, p->math_filter);
  if (!rc && gw)
    rc = dnn_check("conv2d backward (weight)",
                   cudnnConvolutionBackwardFilter(g_dnn, &one, p->x, x, p->y, gy, p->conv, p->bwd_filter, ws,
                                                  p->ws_filter, &zero, p->w, gw));
  if (!rc && gb)
    rc = dnn_check("conv2d backward (bias)", cudnnConvolutionBackwardBias(g_dnn, &one, p->y, gy, &zero, p->b, gb));
  if (ws) cudaFreeAsync(ws, fsdp_cuda_stream);
  return rc;
}

// bfloat16 convolutions: not on this device yet -- 1 tells the op layer to run the float32 entries
// on float32 copies (the table's contract for a device without a bf16 convolution)
static int cuda_conv2d_forward_bf16(const fsdp_conv_geom* g, float* y, const uint16_t* x, const uint16_t* w,
                                    const float* b) {
  (void)g, (void)y, (void)x, (void)w, (void)b;
  return 1;
}
static int cuda_conv2d_backward_bf16(const fsdp_conv_geom* g, float* gx, float* gw, float* gb, const uint16_t* gy,
                                     const uint16_t* x, const uint16_t* w) {
  (void)g, (void)gx, (void)gw, (void)gb, (void)gy, (void)x, (void)w;
  return 1;
}

// ---- pooling: one thread per output (forward) or per input element (backward, no atomics) -----------------
__global__ static void max_pool_k(fsdp_conv_geom g, float* y, int64_t* idx, const float* x) {
  int64_t P = g.OH * g.OW, total = g.N * g.C * P;
  for (int64_t w = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; w < total; w += (int64_t)gridDim.x * blockDim.x) {
    int64_t pl = w / P, oh = (w % P) / g.OW, ow = w % g.OW;
    const float* xp = x + pl * g.H * g.W;
    int64_t h0 = oh * g.sh - g.ph, w0 = ow * g.sw - g.pw, bi = -1;
    float best = -INFINITY;
    for (int ki = 0; ki < g.kh && !(bi >= 0 && isnan(best)); ki++) {
      int64_t ih = h0 + (int64_t)ki * g.dh;
      if (ih < 0 || ih >= g.H) continue;
      for (int kj = 0; kj < g.kw; kj++) {
        int64_t iw = w0 + (int64_t)kj * g.dw;
        if (iw < 0 || iw >= g.W) continue;
        float v = xp[ih * g.W + iw];
        if (v > best || isnan(v) || bi < 0) {
          best = v;
          bi = ih * g.W + iw;
          if (isnan(v)) break;
        }
      }
    }
    y[w] = best;
    idx[w] = bi;
  }
}
static void cuda_max_pool2d_forward(const fsdp_conv_geom* g, float* y, int64_t* idx, const float* x) {
  int64_t total = g->N * g->C * g->OH * g->OW;
  if (total == 0) return;
  max_pool_k<<<fsdp_cuda_blocks(total), NT, 0, fsdp_cuda_stream>>>(*g, y, idx, x);
  FSDP_CUDA_LAUNCHED("max_pool2d");
}
// windows overlap, so outputs scatter with atomics into the zeroed gradient
__global__ static void max_pool_bw_k(fsdp_conv_geom g, float* gx, const float* gy, const int64_t* idx) {
  int64_t P = g.OH * g.OW, total = g.N * g.C * P;
  for (int64_t w = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; w < total; w += (int64_t)gridDim.x * blockDim.x)
    if (idx[w] >= 0) atomicAdd(gx + (w / P) * g.H * g.W + idx[w], gy[w]);
}
static void cuda_max_pool2d_backward(const fsdp_conv_geom* g, float* gx, const float* gy, const int64_t* idx) {
  int64_t total = g->N * g->C * g->OH * g->OW;
  cudaMemsetAsync(gx, 0, g->N * g->C * g->H * g->W * sizeof(float), fsdp_cuda_stream);
  if (total) max_pool_bw_k<<<fsdp_cuda_blocks(total), NT, 0, fsdp_cuda_stream>>>(*g, gx, gy, idx);
  FSDP_CUDA_LAUNCHED("max_pool2d backward");
}

// PyTorch's average window (backend/cpu/linalg.c avg_win)
__device__ static inline float avg_window(const fsdp_conv_geom& g, int64_t oh, int64_t ow, int cip, int64_t* h0,
                                          int64_t* h1, int64_t* w0, int64_t* w1) {
  *h0 = oh * g.sh - g.ph;
  *w0 = ow * g.sw - g.pw;
  *h1 = *h0 + g.kh < g.H + g.ph ? *h0 + g.kh : g.H + g.ph;
  *w1 = *w0 + g.kw < g.W + g.pw ? *w0 + g.kw : g.W + g.pw;
  int64_t pool = (*h1 - *h0) * (*w1 - *w0);
  if (*h0 < 0) *h0 = 0;
  if (*w0 < 0) *w0 = 0;
  if (*h1 > g.H) *h1 = g.H;
  if (*w1 > g.W) *w1 = g.W;
  int64_t cnt = cip ? pool : (*h1 - *h0) * (*w1 - *w0);
  return cnt > 0 ? 1.0f / (float)cnt : 0.0f;
}
__global__ static void avg_pool_k(fsdp_conv_geom g, float* y, const float* x, int cip) {
  int64_t P = g.OH * g.OW, total = g.N * g.C * P;
  for (int64_t w = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; w < total; w += (int64_t)gridDim.x * blockDim.x) {
    int64_t pl = w / P, oh = (w % P) / g.OW, ow = w % g.OW, h0, h1, w0, w1;
    float inv = avg_window(g, oh, ow, cip, &h0, &h1, &w0, &w1), s = 0.0f;
    const float* xp = x + pl * g.H * g.W;
    for (int64_t ih = h0; ih < h1; ih++)
      for (int64_t iw = w0; iw < w1; iw++) s += xp[ih * g.W + iw];
    y[w] = s * inv;
  }
}
static void cuda_avg_pool2d_forward(const fsdp_conv_geom* g, float* y, const float* x, int count_include_pad) {
  int64_t total = g->N * g->C * g->OH * g->OW;
  if (total == 0) return;
  avg_pool_k<<<fsdp_cuda_blocks(total), NT, 0, fsdp_cuda_stream>>>(*g, y, x, count_include_pad);
  FSDP_CUDA_LAUNCHED("avg_pool2d");
}
__global__ static void avg_pool_bw_k(fsdp_conv_geom g, float* gx, const float* gy, int cip) {
  int64_t P = g.OH * g.OW, total = g.N * g.C * P;
  for (int64_t w = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; w < total; w += (int64_t)gridDim.x * blockDim.x) {
    int64_t pl = w / P, oh = (w % P) / g.OW, ow = w % g.OW, h0, h1, w0, w1;
    float v = gy[w] * avg_window(g, oh, ow, cip, &h0, &h1, &w0, &w1);
    float* gp = gx + pl * g.H * g.W;
    for (int64_t ih = h0; ih < h1; ih++)
      for (int64_t iw = w0; iw < w1; iw++) atomicAdd(gp + ih * g.W + iw, v);
  }
}
static void cuda_avg_pool2d_backward(const fsdp_conv_geom* g, float* gx, const float* gy, int count_include_pad) {
  int64_t total = g->N * g->C * g->OH * g->OW;
  cudaMemsetAsync(gx, 0, g->N * g->C * g->H * g->W * sizeof(float), fsdp_cuda_stream);
  if (total) avg_pool_bw_k<<<fsdp_cuda_blocks(total), NT, 0, fsdp_cuda_stream>>>(*g, gx, gy, count_include_pad);
  FSDP_CUDA_LAUNCHED("avg_pool2d backward");
}

// adaptive: window i covers [floor(i H / OH), ceil((i + 1) H / OH)); output element w's plane
// and window, for the forward and the backward kernel
struct adaptive_window {
  int64_t pl, h0, h1, w0, w1;
};
__device__ static adaptive_window adaptive_window_of(const fsdp_conv_geom& g, int64_t w) {
  int64_t P = g.OH * g.OW, oh = (w % P) / g.OW, ow = w % g.OW;
  return {w / P, oh * g.H / g.OH, ((oh + 1) * g.H + g.OH - 1) / g.OH, ow * g.W / g.OW,
          ((ow + 1) * g.W + g.OW - 1) / g.OW};
}
__global__ static void adaptive_avg_k(fsdp_conv_geom g, float* y, const float* x) {
  int64_t total = g.N * g.C * g.OH * g.OW;
  for (int64_t w = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; w < total; w += (int64_t)gridDim.x * blockDim.x) {
    adaptive_window a = adaptive_window_of(g, w);
    int64_t h0 = a.h0, h1 = a.h1, w0 = a.w0, w1 = a.w1;
    const float* xp = x + a.pl * g.H * g.W;
    double s = 0.0;
    for (int64_t ih = h0; ih < h1; ih++)
      for (int64_t iw = w0; iw < w1; iw++) s += xp[ih * g.W + iw];
    y[w] = (float)s / (float)((h1 - h0) * (w1 - w0));
  }
}
static void cuda_adaptive_avg_pool2d_forward(const fsdp_conv_geom* g, float* y, const float* x) {
  int64_t total = g->N * g->C * g->OH * g->OW;
  if (total == 0) return;
  adaptive_avg_k<<<fsdp_cuda_blocks(total), NT, 0, fsdp_cuda_stream>>>(*g, y, x);
  FSDP_CUDA_LAUNCHED("adaptive_avg_pool2d");
}
__global__ static void adaptive_avg_bw_k(fsdp_conv_geom g, float* gx, const float* gy) {
  int64_t total = g.N * g.C * g.OH * g.OW;
  for (int64_t w = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; w < total; w += (int64_t)gridDim.x * blockDim.x) {
    adaptive_window a = adaptive_window_of(g, w);
    int64_t h0 = a.h0, h1 = a.h1, w0 = a.w0, w1 = a.w1;
    float v = gy[w] / (float)((h1 - h0) * (w1 - w0));
    float* gp = gx + a.pl * g.H * g.W;
    for (int64_t ih = h0; ih < h1; ih++)
      for (int64_t iw = w0; iw < w1; iw++) atomicAdd(gp + ih * g.W + iw, v);
  }
}
static void cuda_adaptive_avg_pool2d_backward(const fsdp_conv_geom* g, float* gx, const float* gy) {
  int64_t total = g->N * g->C * g->OH * g->OW;
  cudaMemsetAsync(gx, 0, g->N * g->C * g->H * g->W * sizeof(float), fsdp_cuda_stream);
  if (total) adaptive_avg_bw_k<<<fsdp_cuda_blocks(total), NT, 0, fsdp_cuda_stream>>>(*g, gx, gy);
  FSDP_CUDA_LAUNCHED("adaptive_avg_pool2d backward");
}

const fsdp_linalg_kernels fsdp_cuda_linalg_kernels = {
    cuda_gemm_many,
    cuda_gemm_tiles,
    cuda_gemm_bf16_many,
    cuda_bias_rows,
    cuda_sum_rows,
    cuda_conv2d_forward,
    cuda_conv2d_backward,
    cuda_conv2d_forward_bf16,
    cuda_conv2d_backward_bf16,
    cuda_max_pool2d_forward,
    cuda_max_pool2d_backward,
    cuda_avg_pool2d_forward,
    cuda_avg_pool2d_backward,
    cuda_adaptive_avg_pool2d_forward,
    cuda_adaptive_avg_pool2d_backward,
};
