/*
 * backend/cpu/gemm.c -- the float32 GEMMs of the linalg table: which library runs them (OpenBLAS or
 * oneDNN, a fixed rule of the CPU's features) and how a list of GEMMs is cut into pieces for our
 * threads. Compiled once, for the base ISA: the work is in the libraries, which pick their own
 * kernels from the CPU at run time. The kernels compiled once per ISA (linalg.c and the other
 * kernel files, see cpu.h) call in here through fsdp_cpu_gemm_many and fsdp_cpu_gemm_batched.
 */
#include "core/core.h"
#include "backend/cpu/cpu.h"

#include <cblas.h>
#include <oneapi/dnnl/dnnl.h>
#include <pthread.h>
#include <dlfcn.h>
#include <omp.h>
// LuaJIT dlclose()s libfsdp.so at exit (lua_close), and with it libgomp, whose idle worker
// threads may still be finishing the last parallel region's barrier: they would run on in
// unmapped code (a segfault at exit, seen under load). Pinning libgomp for the life of the
// process keeps their code mapped; they die with the process.
__attribute__((constructor)) static void pin_openmp_runtime(void) {
  dlopen("libgomp.so.1", RTLD_LAZY | RTLD_NOLOAD | RTLD_NODELETE);
}

// ---- GEMM scheduling ------------------------------------------------------------------------------------
// OpenBLAS always runs single-threaded here; the threads are ours (OpenMP). A list of independent
// GEMMs is cut into pieces of about equal work -- a big GEMM along its longer output side, two
// equal ones (a linear's grad_x and grad_w) one per thread, a batch of small ones (attention
// heads) not at all -- and the threads take pieces as they come, with no synchronisation but the
// region's end. This beats a sequence of OpenBLAS-threaded calls at these sizes: no barrier
// inside each GEMM, no OpenBLAS worker spinning between GEMMs while our OpenMP kernels want the
// cores, and independent GEMMs overlap.
void openblas_set_num_threads(int n);
int openblas_get_num_threads(void);

#define GEMM_PIECE_MIN (1 << 20)  // smallest piece worth its own OpenBLAS call (about 30 us)
#define GEMM_ALIGN 16             // piece boundaries fall on multiples of this (OpenBLAS's tile sizes)

// OpenBLAS 0.3.21 (Debian 12) runs its sgemm kernel at a third of its speed -- 12 GFLOPS instead of
// 36 on this Zen, for outputs 64 to 320 columns wide (2048x256x1024, 256x256x2048, ...) -- in every
// thread that has not yet run a GEMM big enough to write its whole packing buffer once; after one
// such GEMM every shape runs at full speed for the life of the thread. (Our reading: the kernel
// prefetches ahead into buffer pages never written, and each of those prefetches costs a page walk.)
// A model of narrow layers would never leave the slow state, so each thread runs one GEMM of that
// size (64x1024x384, about 1 ms, on zeros) before its first real one.
static void openblas_warm_thread(void) {
  static __thread int warm;
  if (warm) return;
  const int64_t M = 64, N = 1024, K = 384;
  size_t bytes = (size_t)(M * K + K * N + M * N) * sizeof(float);
  float* buf = fsdp_alloc(bytes, FSDP_CPU, FSDP_MEM_OTHER);
  if (!buf) return;  // no memory: try again next time; the GEMM itself runs either way
  memset(buf, 0, bytes);
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, (int)M, (int)N, (int)K, 1.0f, buf, (int)K, buf + M * K, (int)N,
              0.0f, buf + M * K + K * N, (int)N);
  fsdp_free(buf, bytes, FSDP_CPU, FSDP_MEM_OTHER);
  warm = 1;
}

// beta = 0 zeroes C with memset and asks OpenBLAS for C += A B: its own beta = 0 pass (a scalar
// loop over C before the product) measured 2-3x slower than memset and was ~3% of an MLP step.
// The sums are the same (OpenBLAS's kernel adds the product to the zeroed C either way).
static void openblas_gemm(const fsdp_gemm_args* g) {
  openblas_warm_thread();
  float beta = g->beta;
  if (beta == 0.0f && g->K > 0) {
    for (int64_t i = 0; i < g->M; i++) memset(g->C + i * g->ldc, 0, g->N * sizeof(float));
    beta = 1.0f;
  }
  cblas_sgemm(CblasRowMajor, g->ta ? CblasTrans : CblasNoTrans, g->tb ? CblasTrans : CblasNoTrans, (int)g->M, (int)g->N,
              (int)g->K, g->alpha, g->A, (int)g->lda, g->B, (int)g->ldb, beta, g->C, (int)g->ldc);
}

// oneDNN's sgemm (row-major); it picks its kernels from the CPU's features at run time.
// A weight gradient, C (M, N) = A^T (M, K) B (K, N) with K the batch's rows (2048 in the bench's
// language models), runs 11-25% faster as a sum of K slices of ONEDNN_TN_KC rows, each added to C
// (one-thread dnnl_sgemm on a 2-core Xeon family 6 model 143: 1536x384x2048 140 -> 171 GFLOP/s,
// 1024x256x2048 134 -> 162, 384x1536x2048 152 -> 173, 1152x384x2048 175 -> 185); oneDNN's own
// blocking of such a long K streams both operands past the L2. NN and NT products are not cut.
#define ONEDNN_TN_KC 512
static void onednn_gemm(const fsdp_gemm_args* g) {
  if (g->ta && !g->tb && g->K > 2 * ONEDNN_TN_KC) {
    for (int64_t k0 = 0; k0 < g->K; k0 += ONEDNN_TN_KC) {  // A (K, M) and B (K, N) are row-major: rows k0..
      int64_t kc = g->K - k0 < ONEDNN_TN_KC ? g->K - k0 : ONEDNN_TN_KC;
      dnnl_sgemm('T', 'N', g->M, g->N, kc, g->alpha, g->A + k0 * g->lda, g->lda, g->B + k0 * g->ldb, g->ldb,
                 k0 ? 1.0f : g->beta, g->C, g->ldc);
    }
    return;
  }
  dnnl_sgemm(g->ta ? 'T' : 'N', g->tb ? 'T' : 'N', g->M, g->N, g->K, g->alpha, g->A, g->lda, g->B, g->ldb, g->beta,
             g->C, g->ldc);
}

// ---- which GEMM ---------------------------------------------------------------------------------------
// OpenBLAS picks its kernels from a table of CPU models and falls back to old generic ones on a
// model it does not know (0.3.21 runs Prescott's SSE3 kernels on recent Xeons, Haswell's AVX2
// on Zen 5); oneDNN picks from the CPU's features. The choice is a fixed rule of the CPU's features,
// never a timing taken at startup: a timed choice flipped from process to process where the two
// were close (OpenBLAS at 0.73-1.00x oneDNN's speed on a 2-core Intel Xeon family 6 model 167,
// SkylakeX kernels), so two runs of one job -- a run and its resume, or two ranks -- computed with
// different libraries and their bits differed. The rule, from the measurements of issue 14:
// - AVX-512: oneDNN (OpenBLAS measured 0.51-0.55x oneDNN on an AMD EPYC, whose cores it runs with
//   Haswell kernels; 0.73-1.00x with SkylakeX kernels on Intel Xeons of models 167 and 207);
// - AVX2 without AVX-512 (or capped there by FSDP_CPU_ISA=avx2), OpenBLAS on its Haswell or Zen
//   kernels: OpenBLAS (1.13-1.19x oneDNN's speed held to AVX2, whole steps 1.2-1.3x faster);
// - OpenBLAS on a generic or pre-AVX core, or on kernels wider than an FSDP_CPU_ISA cap: oneDNN.
// FSDP_GEMM=openblas or onednn forces one.
typedef void (*gemm_fn)(const fsdp_gemm_args* g);
static gemm_fn g_gemm;
static const char* g_gemm_name;
static pthread_once_t g_gemm_once = PTHREAD_ONCE_INIT;

// OpenBLAS's AVX2 kernels (the ones it runs best on a CPU without AVX-512)
static int openblas_core_is_avx2(void) {
  const char* core = fsdp_cpu_blas_core();
  return strcmp(core, "Haswell") == 0 || strcmp(core, "Zen") == 0;
}

static void choose_gemm(void) {
  static char name[96];
  const char* forced = getenv("FSDP_GEMM");
  if (forced && strcmp(forced, "openblas") == 0) {
    g_gemm = openblas_gemm, g_gemm_name = "openblas (FSDP_GEMM)";
    return;
  }
  int avx2_only = fsdp_cpu_isa_level() == FSDP_ISA_AVX2;
  if (!forced && avx2_only && openblas_core_is_avx2()) {
    snprintf(name, sizeof name, "openblas (AVX2 without AVX-512, OpenBLAS core %s)", fsdp_cpu_blas_core());
    g_gemm = openblas_gemm, g_gemm_name = name;
    return;
  }
  g_gemm = onednn_gemm;
  // the user's own settings first
  const char* cap = getenv("FSDP_CPU_ISA");
  if (forced) g_gemm_name = "onednn (FSDP_GEMM)";
  else if (cap && fsdp_cpu_isa_level() < FSDP_ISA_AVX512) g_gemm_name = "onednn (FSDP_CPU_ISA)";
  else if (fsdp_cpu_isa_level() == FSDP_ISA_AVX512) g_gemm_name = "onednn (AVX-512)";
  else {
    snprintf(name, sizeof name, "onednn (OpenBLAS core %s)", fsdp_cpu_blas_core());
    g_gemm_name = name;
  }
}

const char* fsdp_cpu_gemm_backend(void) {
  pthread_once(&g_gemm_once, choose_gemm);
  return g_gemm_name;
}

static void blas_gemm(const fsdp_gemm_args* g) {
  pthread_once(&g_gemm_once, choose_gemm);
  g_gemm(g);
}

void fsdp_cpu_sgemm(int ta, int tb, int64_t M, int64_t N, int64_t K, float alpha, const float* A, int64_t lda,
                    const float* B, int64_t ldb, float beta, float* C, int64_t ldc) {
  blas_gemm(&(fsdp_gemm_args){ta, tb, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc});
}

// rows [lo, hi) (split_n = 0) or columns [lo, hi) (split_n = 1) of GEMM g's output
typedef struct {
  const fsdp_gemm_args* g;
  int64_t lo, hi;
  int split_n;
} gemm_piece;

static void run_piece(const gemm_piece* p) {
  fsdp_gemm_args a = *p->g;
  if (p->split_n) {  // C[:, lo:hi] = op(A) @ op(B)[:, lo:hi]
    a.N = p->hi - p->lo;
    a.B += a.tb ? p->lo * a.ldb : p->lo;
    a.C += p->lo;
  } else {  // C[lo:hi, :] = op(A)[lo:hi, :] @ op(B)
    a.M = p->hi - p->lo;
    a.A += a.ta ? p->lo : p->lo * a.lda;
    a.C += p->lo * a.ldc;
  }
  blas_gemm(&a);
}

void fsdp_cpu_gemm_many(int n, const fsdp_gemm_args* g) {
  double work = 0;
  for (int i = 0; i < n; i++) work += (double)g[i].M * g[i].N * g[i].K;
  int nt = omp_in_parallel() ? 1 : omp_get_max_threads();
  int saved = openblas_get_num_threads();
  if (saved != 1 && !omp_in_parallel()) openblas_set_num_threads(1);
  if (nt == 1 || work < FSDP_CPU_GEMM_PAR_MIN) {
    // on this thread alone: oneDNN would otherwise spread a small GEMM over omp_get_max_threads()
    if (nt != 1) omp_set_num_threads(1);
    for (int i = 0; i < n; i++) blas_gemm(&g[i]);
    if (nt != 1) omp_set_num_threads(nt);
  } else {
    // pieces of about a thread's share of the work (a GEMM smaller than that stays whole), taken
    // by the threads as they come. Finer pieces (4 per thread) balanced better on a loaded machine
    // in theory but cost 3-4% more CPU time (each piece packs its shared operand again) with no
    // wall-clock gain we could measure, so one share per piece.
    double share = work / nt;
    if (share < GEMM_PIECE_MIN) share = GEMM_PIECE_MIN;
    int64_t np = 0, cap = 0;
    for (int i = 0; i < n; i++) cap += 1 + (int64_t)((double)g[i].M * g[i].N * g[i].K / share + 0.5);
    gemm_piece stack[64];
    gemm_piece* pc = cap <= 64 ? stack : malloc(cap * sizeof(gemm_piece));
    if (!pc) {  // no memory for the plan: run them one after another
      for (int i = 0; i < n; i++) blas_gemm(&g[i]);
      if (saved != 1) openblas_set_num_threads(saved);
      return;
    }
    for (int i = 0; i < n; i++) {
      int split_n = g[i].N > g[i].M;  // cut the longer side of the output
      int64_t side = split_n ? g[i].N : g[i].M, blocks = (side + GEMM_ALIGN - 1) / GEMM_ALIGN;
      int64_t k = (int64_t)((double)g[i].M * g[i].N * g[i].K / share + 0.5);
      if (k > blocks) k = blocks;
      if (k < 1) k = 1;
      for (int64_t j = 0; j < k; j++) {
        int64_t lo = blocks * j / k * GEMM_ALIGN, hi = blocks * (j + 1) / k * GEMM_ALIGN;
        pc[np++] = (gemm_piece){&g[i], lo, hi < side ? hi : side, split_n};
      }
    }
#pragma omp parallel for schedule(dynamic, 1) num_threads(nt)
    for (int64_t i = 0; i < np; i++) run_piece(&pc[i]);
    if (pc != stack) free(pc);
  }
  if (saved != 1 && !omp_in_parallel()) openblas_set_num_threads(saved);
}

static void cpu_gemm(int ta, int tb, int64_t M, int64_t N, int64_t K, float alpha, const float* A, int64_t lda,
                     const float* B, int64_t ldb, float beta, float* C, int64_t ldc) {
  fsdp_gemm_args g = {ta, tb, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc};
  fsdp_cpu_gemm_many(1, &g);
}

void fsdp_cpu_gemm_batched(int64_t batch, int ta, int tb, int64_t M, int64_t N, int64_t K, float alpha, const float* A,
                           int64_t lda, int64_t sa, const float* B, int64_t ldb, int64_t sb, float beta, float* C,
                           int64_t ldc, int64_t sc) {
  if (batch <= 0) return;
  fsdp_gemm_args stack[64];
  fsdp_gemm_args* g = batch <= 64 ? stack : malloc(batch * sizeof(fsdp_gemm_args));
  if (!g) {  // no memory for the list: one at a time
    for (int64_t b = 0; b < batch; b++)
      cpu_gemm(ta, tb, M, N, K, alpha, A + b * sa, lda, B + b * sb, ldb, beta, C + b * sc, ldc);
    return;
  }
  for (int64_t b = 0; b < batch; b++)
    g[b] = (fsdp_gemm_args){ta, tb, M, N, K, alpha, A + b * sa, lda, B + b * sb, ldb, beta, C + b * sc, ldc};
  fsdp_cpu_gemm_many((int)batch, g);
  if (g != stack) free(g);
}
