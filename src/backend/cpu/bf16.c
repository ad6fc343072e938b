/*
 * backend/cpu/bf16.c -- GEMMs on bfloat16 operands: the linalg table's gemm_bf16_many.
 *
 * oneDNN 2.6 (Debian libdnnl-dev) exports a bf16 GEMM, dnnl_gemm_bf16bf16f32: bfloat16 A and B,
 * float32 accumulation and C, row-major like dnnl_sgemm. It picks its kernels from the CPU's
 * features -- bf16 dot-product instructions on CPUs with AVX512_BF16 (AMX tiles where present), an
 * emulation on other AVX-512 CPUs -- and reports dnnl_unimplemented without AVX-512. Where it is
 * implemented, GEMMs go through it; elsewhere the operands are converted to float32 and the float32
 * GEMM of linalg.c runs. The result is the same up to summation order: bfloat16 products are exact
 * in float32, and both sum in float32.
 *
 * One call: choose() once (a 1x1x1 product tells whether oneDNN has the GEMM here; FSDP_BF16_GEMM=
 * onednn or upcast forces one), then
 *   onednn_many   each GEMM through dnnl_gemm_bf16bf16f32, threaded by oneDNN (a list too small
 *                 to share out runs on the calling thread alone, as linalg.c's gemm_many does)
 *   upcast_many   every operand converted into one float32 scratch block, then gemm_many
 *
 * Measured on a 2-core AMD EPYC (Zen 5, avx512_bf16), one thread, 512x1024x1024 (NN, NT, TN):
 * oneDNN's bf16 GEMM 480-500 GFLOP/s, its sgemm 240-250: the bf16 GEMM is 2.0x faster, the
 * width of its operands.
 */
#include "core/core.h"
#include "backend/cpu/cpu.h"

#include <oneapi/dnnl/dnnl.h>
#include <omp.h>
#include <pthread.h>

// exported by libdnnl 2.x, declared only in its internal headers (oneDNN's own tests declare it
// like this); oneDNN's bfloat16_t is a struct of the 16 raw bits, so uint16_t* passes the same
dnnl_status_t dnnl_gemm_bf16bf16f32(char transa, char transb, dnnl_dim_t M, dnnl_dim_t N, dnnl_dim_t K, float alpha,
                                    const uint16_t* A, dnnl_dim_t lda, const uint16_t* B, dnnl_dim_t ldb, float beta,
                                    float* C, dnnl_dim_t ldc);

// multiply-adds under which a list of GEMMs runs on the calling thread alone (cpu.h: FSDP_CPU_GEMM_PAR_MIN)
#define BF16_PAR_MIN (1 << 21)

typedef int (*bf16_many_fn)(int n, const fsdp_gemm_bf16_args* g);
static bf16_many_fn g_many;
static const char* g_name;
static pthread_once_t g_once = PTHREAD_ONCE_INIT;

static int onednn_many(int n, const fsdp_gemm_bf16_args* g) {
  double work = 0;
  for (int i = 0; i < n; i++) work += (double)g[i].M * g[i].N * g[i].K;
  int nt = omp_get_max_threads();
  int alone = nt > 1 && !omp_in_parallel() && work < BF16_PAR_MIN;
  if (alone) omp_set_num_threads(1);
  int rc = 0;
  for (int i = 0; i < n && !rc; i++) {
    const fsdp_gemm_bf16_args* a = &g[i];
    dnnl_status_t st = dnnl_gemm_bf16bf16f32(a->ta ? 'T' : 'N', a->tb ? 'T' : 'N', a->M, a->N, a->K, a->alpha, a->A,
                                             a->lda, a->B, a->ldb, a->beta, a->C, a->ldc);
    if (st != dnnl_success) {
      fsdp_errorf("gemm_bf16: oneDNN's bf16 GEMM failed with status %d for M %lld, N %lld, K %lld", (int)st,
                  (long long)a->M, (long long)a->N, (long long)a->K);
      rc = -1;
    }
  }
  if (alone) omp_set_num_threads(nt);
  return rc;
}

// dst (rows, cols) float32, row-major = src (rows, cols) bfloat16 with rows ld apart
static void widen(float* dst, const uint16_t* src, int64_t rows, int64_t cols, int64_t ld) {
#pragma omp parallel for if (rows * cols > (1 << 16) && !omp_in_parallel())
  for (int64_t i = 0; i < rows; i++)
    for (int64_t j = 0; j < cols; j++) dst[i * cols + j] = fsdp_bf16_to_f32(src[i * ld + j]);
}

static int upcast_many(int n, const fsdp_gemm_bf16_args* g) {
  size_t floats = 0;
  for (int i = 0; i < n; i++) floats += (size_t)(g[i].M * g[i].K + g[i].K * g[i].N);
  fsdp_gemm_args stack[8];
  fsdp_gemm_args* f = n <= 8 ? stack : malloc(n * sizeof *f);
  float* buf = f ? fsdp_alloc(floats * sizeof(float), FSDP_CPU, FSDP_MEM_OTHER) : NULL;
  if (!buf) {
    if (f != stack) free(f);
    CHECK_INT(0, "gemm_bf16: out of memory for float32 copies of the operands (%zu floats)", floats);
  }
  float* p = buf;
  for (int i = 0; i < n; i++) {
    const fsdp_gemm_bf16_args* a = &g[i];
    // op(A) is (M, K): stored (K, M) when transposed; op(B) is (K, N): stored (N, K) when transposed
    int64_t ar = a->ta ? a->K : a->M, ac = a->ta ? a->M : a->K, br = a->tb ? a->N : a->K, bc = a->tb ? a->K : a->N;
    float *A = p, *B = p + ar * ac;
    widen(A, a->A, ar, ac, a->lda);
    widen(B, a->B, br, bc, a->ldb);
    p = B + br * bc;
    f[i] = (fsdp_gemm_args){a->ta, a->tb, a->M, a->N, a->K, a->alpha, A, ac, B, bc, a->beta, a->C, a->ldc};
  }
  fsdp_cpu_gemm_many(n, f);
  fsdp_free(buf, floats * sizeof(float), FSDP_CPU, FSDP_MEM_OTHER);
  if (f != stack) free(f);
  return 0;
}

// whether oneDNN has a bf16 GEMM for this CPU: one 1x1x1 product (1 * 1 = 1)
static int onednn_has_bf16_gemm(void) {
  uint16_t one = 0x3f80;  // 1.0 in bfloat16
  float c = 0.0f;
  return dnnl_gemm_bf16bf16f32('N', 'N', 1, 1, 1, 1.0f, &one, 1, &one, 1, 0.0f, &c, 1) == dnnl_success && c == 1.0f;
}

static void choose(void) {
  const char* forced = getenv("FSDP_BF16_GEMM");
  if (forced && strcmp(forced, "upcast") == 0) {
    g_many = upcast_many, g_name = "upcast to float32 (FSDP_BF16_GEMM)";
    return;
  }
  if (!onednn_has_bf16_gemm()) {
    g_many = upcast_many;
    g_name = forced ? "upcast to float32 (FSDP_BF16_GEMM=onednn, but oneDNN has no bf16 GEMM for this CPU)"
                    : "upcast to float32 (oneDNN has no bf16 GEMM for this CPU)";
    return;
  }
  g_many = onednn_many;
  if (__builtin_cpu_supports("amx-bf16")) g_name = "onednn bf16 (native: amx-bf16)";
  else if (__builtin_cpu_supports("avx512bf16")) g_name = "onednn bf16 (native: avx512_bf16)";
  else g_name = "onednn bf16 (emulated on AVX-512: no avx512_bf16)";
}

const char* fsdp_cpu_bf16_gemm_backend(void) {
  pthread_once(&g_once, choose);
  return g_name;
}

int fsdp_cpu_gemm_bf16_many(int n, const fsdp_gemm_bf16_args* g) {
  pthread_once(&g_once, choose);
  return n > 0 ? g_many(n, g) : 0;
}
