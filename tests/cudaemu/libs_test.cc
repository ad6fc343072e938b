/*
 * tests/cudaemu/libs_test.cc -- the executor's library stand-ins (blaslt.cc: cuBLASLt, dnn.cc:
 * cuDNN) against naive double-precision references written here from the documented
 * definitions, not from the stand-ins' code:
 *
 *   GEMMs          column-major D = alpha op(A) op(B) + beta C: every pair of transposes, leading
 *                  dimensions over the row count, strided batches (and an A shared by the batch),
 *                  beta 0 over a C of NaNs, bfloat16 and TF32 operands, C == D in place, on a
 *                  non-blocking stream and on stream 0; and the calls exactly as
 *                  backend/cuda/linalg.cu makes them (row-major problems, B handed first)
 *   GEMM refusals  a host pointer, a wrong k, an epilogue, a pointer less aligned than the
 *                  preference promised, ... each with its documented status; memory freed before
 *                  the product runs is a sticky illegal address
 *   convolutions   forward, data and filter gradients, bias gradient, bias add, with padding,
 *                  strides, dilation, groups, both modes, blending with alpha and beta (beta 0
 *                  over NaNs), and the adjoint identity <conv(x, w), dy> = <x, dx> = <w, dw>
 *   cuDNN refusals NHWC, a mismatched output, host pointers, ...
 *
 * One line a check; "libs_test OK" at the end, exit 1 on any failure. Built and run by hand:
 *   g++ -std=c++17 -O1 -g -Wall -Wextra -Itests/cudaemu/include -Itests/cudaemu tests/cudaemu/runtime.cc \
 *     tests/cudaemu/blaslt.cc tests/cudaemu/dnn.cc tests/cudaemu/libs_test.cc -lpthread -o /tmp/libs_test
 */
#include <cublasLt.h>
#include <cudnn.h>

#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <atomic>
#include <string>
#include <vector>

extern "C" void fsdp_emu_reset(void);  // (runtime.cc's test hook: forgets a sticky error)

// ---- checks -----------------------------------------------------------------------------------------
static int g_checks, g_failed;
static void check(bool ok, const char* fmt, ...) __attribute__((format(printf, 2, 3)));
static void check(bool ok, const char* fmt, ...) {
  char msg[1024];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(msg, sizeof msg, fmt, ap);
  va_end(ap);
  g_checks++;
  if (!ok) g_failed++;
  printf("%s %s\n", ok ? "ok  " : "FAIL", msg);
  fflush(stdout);
}

// the worst of |got - want| against tol * magnitude (the sum of the terms' magnitudes); NaN fails
struct compare {
  double worst = 0;  // error / allowed
  size_t at = 0, n = 0;
  double got = 0, want = 0;
  void add(double g, double w, double magnitude, double tol) {
    double allowed = tol * magnitude + 1e-30, r = fabs(g - w) / allowed;
    if (isnan(g) || isnan(w)) r = INFINITY;
    if (r > worst || (n == 0 && r >= worst)) worst = r, at = n, got = g, want = w;
    n++;
  }
  bool ok() const { return worst <= 1.0; }
  std::string what() const {
    char b[160];
    snprintf(b, sizeof b, "%zu values, worst %.3g of the tolerance (element %zu: %.9g, want %.9g)", n, worst, at, got,
             want);
    return b;
  }
};

// ---- data ---------------------------------------------------------------------------------------------
static uint64_t g_rng = 0x2545f4914f6cdd1dull;
static float urand(void) {  // uniform in [-1, 1)
  g_rng ^= g_rng << 13;
  g_rng ^= g_rng >> 7;
  g_rng ^= g_rng << 17;
  return (float)((double)(g_rng >> 40) / (double)(1ull << 24) * 2.0 - 1.0);
}
// x rounded to `bits` significant bits, to nearest even (bfloat16: 8, TF32: 11) -- by frexp, not bits
static float round_sig(float x, int bits) {
  if (x == 0.0f || !isfinite(x)) return x;
  int e;
  double m = frexp((double)x, &e);       // x = m 2^e, 0.5 <= |m| < 1
  double r = nearbyint(ldexp(m, bits));  // (the default rounding: to nearest even)
  return (float)ldexp(r, e - bits);
}
static uint16_t bf16_bits(float x) {  // x already holds 8 significant bits: its high half, exactly
  uint32_t u;
  memcpy(&u, &x, 4);
  return (uint16_t)(u >> 16);
}
static const float NaN = nanf("");

template <typename T>
static T* to_device(const std::vector<T>& h) {
  void* p = NULL;
  if (cudaMalloc(&p, h.size() * sizeof(T) + 64) != cudaSuccess) abort();
  cudaMemcpy(p, h.data(), h.size() * sizeof(T), cudaMemcpyHostToDevice);
  return (T*)p;
}
static std::vector<float> from_device(const float* d, size_t n) {
  std::vector<float> h(n);
  cudaMemcpy(h.data(), d, n * sizeof(float), cudaMemcpyDeviceToHost);
  return h;
}
// the alignment a caller may promise for a pointer (its lowest set bit, at most 256), as linalg.cu computes it
static uint32_t align_of(const void* p) {
  uint64_t x = (uint64_t)(uintptr_t)p | 256;
  return (uint32_t)(x & (~x + 1));
}

// ======================================================================================================
// GEMMs, column-major, as the documentation defines them
// ======================================================================================================
struct gemm_case {
  const char* name;
  cublasOperation_t ta, tb;
  int m, n, k;
  int pad_a, pad_b, pad_c;  // ld = rows + pad
  int batch;
  bool a_shared;  // A's batch count 1: every batch multiplies the same A
  float alpha, beta;
  bool bf16, tf32, in_place, on_stream;
};

// one operand's storage: stored rows x cols, ld, batch count and stride in elements
struct store {
  int64_t rows, cols, ld, batch, stride;
  size_t elems() const { return (size_t)((batch - 1) * stride + ld * (cols - 1) + rows); }
  int64_t at(int64_t b, int64_t r, int64_t c) const { return (batch > 1 ? b * stride : 0) + r + c * ld; }
};
static store store_of(int64_t rows, int64_t cols, int pad, int64_t batch) {
  int64_t ld = rows + pad;
  return store{rows, cols, ld, batch, batch > 1 ? ld * cols + 5 : 0};
}

static cublasLtMatrixLayout_t make_layout(cudaDataType_t t, const store& s) {
  cublasLtMatrixLayout_t l = NULL;
  if (cublasLtMatrixLayoutCreate(&l, t, (uint64_t)s.rows, (uint64_t)s.cols, s.ld) != CUBLAS_STATUS_SUCCESS) abort();
  if (s.batch > 1) {
    int32_t n = (int32_t)s.batch;
    int64_t st = s.stride;
    cublasLtMatrixLayoutSetAttribute(l, CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT, &n, sizeof n);
    cublasLtMatrixLayoutSetAttribute(l, CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET, &st, sizeof st);
  }
  return l;
}
static cublasLtMatmulDesc_t make_desc(cublasComputeType_t ct, cublasOperation_t ta, cublasOperation_t tb) {
  cublasLtMatmulDesc_t d = NULL;
  if (cublasLtMatmulDescCreate(&d, ct, CUDA_R_32F) != CUBLAS_STATUS_SUCCESS) abort();
  cublasLtMatmulDescSetAttribute(d, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof ta);
  cublasLtMatmulDescSetAttribute(d, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof tb);
  return d;
}
static cublasLtMatmulPreference_t make_pref(uint32_t aa, uint32_t ab, uint32_t ac, uint32_t ad) {
  cublasLtMatmulPreference_t p = NULL;
  cublasLtMatmulPreferenceCreate(&p);
  uint64_t ws = 1 << 20;
  cublasLtMatmulPreferenceSetAttribute(p, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof ws);
  cublasLtMatmulPreferenceSetAttribute(p, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, &aa, sizeof aa);
  cublasLtMatmulPreferenceSetAttribute(p, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, &ab, sizeof ab);
  cublasLtMatmulPreferenceSetAttribute(p, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, &ac, sizeof ac);
  cublasLtMatmulPreferenceSetAttribute(p, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, &ad, sizeof ad);
  return p;
}

// host values of an operand: random, rounded as the operand's precision demands (bfloat16: 8 bits)
static std::vector<float> operand_values(const store& s, bool bf16) {
  std::vector<float> v(s.elems());
  for (float& x : v) x = bf16 ? round_sig(urand(), 8) : urand();
  return v;
}
static void* operand_to_device(const std::vector<float>& v, bool bf16) {
  if (!bf16) return to_device(v);
  std::vector<uint16_t> h(v.size());
  for (size_t i = 0; i < v.size(); i++) h[i] = bf16_bits(v[i]);
  return to_device(h);
}

static void run_gemm_case(cublasLtHandle_t lt, cudaStream_t stream, const gemm_case& t) {
  cudaStream_t s = t.on_stream ? stream : 0;
  int64_t m = t.m, n = t.n, k = t.k, nb = t.batch;
  store sa = store_of(t.ta == CUBLAS_OP_N ? m : k, t.ta == CUBLAS_OP_N ? k : m, t.pad_a, t.a_shared ? 1 : nb);
  store sb = store_of(t.tb == CUBLAS_OP_N ? k : n, t.tb == CUBLAS_OP_N ? n : k, t.pad_b, nb);
  store sc = store_of(m, n, t.pad_c, nb);
  cudaDataType_t ab = t.bf16 ? CUDA_R_16BF : CUDA_R_32F;
  std::vector<float> ha = operand_values(sa, t.bf16), hb = operand_values(sb, t.bf16), hc(sc.elems()), hd(sc.elems());
  for (float& x : hc) x = t.beta != 0.0f ? urand() : NaN;
  for (float& x : hd) x = 777.0f;
  void *da = operand_to_device(ha, t.bf16), *db = operand_to_device(hb, t.bf16);
  float* dc = to_device(hc);
  float* dd = t.in_place ? dc : to_device(hd);
  if (t.in_place) hd = hc;

  cublasLtMatmulDesc_t desc = make_desc(t.tf32 ? CUBLAS_COMPUTE_32F_FAST_TF32 : CUBLAS_COMPUTE_32F, t.ta, t.tb);
  cublasLtMatrixLayout_t la = make_layout(ab, sa), lb = make_layout(ab, sb), lc = make_layout(CUDA_R_32F, sc);
  cublasLtMatmulPreference_t pref = make_pref(align_of(da), align_of(db), align_of(dc), align_of(dd));
  cublasLtMatmulHeuristicResult_t res;
  int found = 0;
  cublasStatus_t st = cublasLtMatmulAlgoGetHeuristic(lt, desc, la, lb, lc, lc, pref, 1, &res, &found);
  bool heur = st == CUBLAS_STATUS_SUCCESS && found == 1 && res.state == CUBLAS_STATUS_SUCCESS && res.workspaceSize == 0;
  void* ws = NULL;
  cudaMalloc(&ws, 1 << 20);
  if (heur) st = cublasLtMatmul(lt, desc, &t.alpha, da, la, db, lb, &t.beta, dc, lc, dd, lc, &res.algo, ws, 1 << 20, s);
  cudaError_t e = cudaStreamSynchronize(s);
  std::vector<float> got = from_device(dd, sc.elems());

  // the reference: op(A) (i, l) of batch b, from the values the device holds
  auto opa = [&](int64_t b, int64_t i, int64_t l) {
    float v = ha[sa.at(b, t.ta == CUBLAS_OP_N ? i : l, t.ta == CUBLAS_OP_N ? l : i)];
    return (double)(t.tf32 ? round_sig(v, 11) : v);
  };
  auto opb = [&](int64_t b, int64_t l, int64_t j) {
    float v = hb[sb.at(b, t.tb == CUBLAS_OP_N ? l : j, t.tb == CUBLAS_OP_N ? j : l)];
    return (double)(t.tf32 ? round_sig(v, 11) : v);
  };
  compare cmp;
  double unrounded_diff = 0;  // TF32: how far the result is from the float32 product
  std::vector<bool> written(sc.elems(), false);
  for (int64_t b = 0; b < nb; b++)
    for (int64_t i = 0; i < m; i++)
      for (int64_t j = 0; j < n; j++) {
        double sum = 0, mag = 0, exact = 0;
        for (int64_t l = 0; l < k; l++) {
          sum += opa(b, i, l) * opb(b, l, j);
          mag += fabs(opa(b, i, l) * opb(b, l, j));
          exact += (double)ha[sa.at(b, t.ta == CUBLAS_OP_N ? i : l, t.ta == CUBLAS_OP_N ? l : i)] *
                   hb[sb.at(b, t.tb == CUBLAS_OP_N ? l : j, t.tb == CUBLAS_OP_N ? j : l)];
        }
        int64_t at = sc.at(b, i, j);
        double want = t.alpha * sum + (t.beta != 0.0f ? t.beta * (double)hc[at] : 0.0);
        cmp.add(got[at], want, fabs(t.alpha) * mag + (t.beta != 0.0f ? fabs(t.beta * hc[at]) : 0.0), 1e-5);
        double ex = t.alpha * exact + (t.beta != 0.0f ? t.beta * (double)hc[at] : 0.0);
        unrounded_diff = fmax(unrounded_diff, fabs(got[at] - ex) / (fabs(t.alpha) * mag + 1e-30));
        written[at] = true;
      }
  bool untouched = true;  // what lies between the matrices (ld padding, batch gaps) stays as it was
  for (size_t i = 0; i < got.size(); i++)
    if (!written[i] && memcmp(&got[i], &hd[i], 4)) untouched = false;
  check(heur && st == CUBLAS_STATUS_SUCCESS && e == cudaSuccess && cmp.ok() && untouched,
        "gemm %s: op(A) %s op(B) %s, %lldx%lldx%lld, ld +%d/+%d/+%d, batch %lld%s, alpha %g beta %g%s%s%s%s: %s%s",
        t.name, t.ta == CUBLAS_OP_N ? "N" : "T", t.tb == CUBLAS_OP_N ? "N" : "T", (long long)m, (long long)n,
        (long long)k, t.pad_a, t.pad_b, t.pad_c, (long long)nb, t.a_shared ? " (A shared)" : "", t.alpha, t.beta,
        t.beta == 0.0f ? " over NaN" : "", t.bf16 ? ", bf16" : "", t.tf32 ? ", TF32" : "", t.in_place ? ", C == D" : "",
        cmp.what().c_str(), untouched ? "" : "; the padding was written");
  if (t.tf32)
    check(unrounded_diff > 1e-5, "gemm %s: TF32 rounded the operands (the float32 product differs by %.3g, relative)",
          t.name, unrounded_diff);
  cublasLtMatmulPreferenceDestroy(pref);
  cublasLtMatrixLayoutDestroy(la);
  cublasLtMatrixLayoutDestroy(lb);
  cublasLtMatrixLayoutDestroy(lc);
  cublasLtMatmulDescDestroy(desc);
  cudaFree(da);
  cudaFree(db);
  cudaFree(dc);
  if (!t.in_place) cudaFree(dd);
  cudaFree(ws);
}

static void gemm_cases(cublasLtHandle_t lt, cudaStream_t s) {
  const cublasOperation_t N = CUBLAS_OP_N, T = CUBLAS_OP_T;
  const cublasOperation_t ops[2] = {N, T};
  for (cublasOperation_t ta : ops)
    for (cublasOperation_t tb : ops) {
      run_gemm_case(lt, s, {"plain", ta, tb, 7, 5, 9, 3, 2, 1, 1, false, 1.5f, 0.0f, false, false, false, true});
      run_gemm_case(lt, s, {"batched", ta, tb, 6, 4, 11, 1, 0, 2, 3, false, 0.75f, -0.5f, false, false, false, true});
      run_gemm_case(lt, s, {"bf16", ta, tb, 9, 6, 13, 2, 1, 0, 2, false, 1.0f, 1.0f, true, false, false, true});
    }
  run_gemm_case(lt, s, {"A shared", N, T, 5, 7, 8, 0, 1, 1, 4, true, -2.0f, 0.25f, false, false, false, true});
  run_gemm_case(lt, s, {"in place", T, N, 8, 6, 10, 1, 3, 2, 1, false, 1.0f, 1.0f, false, false, true, true});
  run_gemm_case(lt, s, {"in place beta 0", N, N, 8, 6, 10, 0, 0, 3, 2, false, 0.5f, 0.0f, false, false, true, true});
  run_gemm_case(lt, s, {"tf32", N, T, 12, 9, 40, 1, 1, 1, 1, false, 1.0f, 0.0f, false, true, false, true});
  run_gemm_case(lt, s, {"stream 0", T, T, 4, 3, 6, 2, 2, 2, 1, false, 1.0f, 2.0f, false, false, false, false});
  run_gemm_case(lt, s, {"larger", N, N, 33, 17, 65, 7, 0, 5, 2, false, 1.0f, 0.0f, false, false, false, true});
  run_gemm_case(lt, s, {"k 1", T, N, 5, 4, 1, 0, 0, 0, 1, false, 1.0f, 0.0f, false, false, false, true});
}

// ---- the calls exactly as backend/cuda/linalg.cu's lt_gemm makes them: row-major C (M, N) = alpha
// op(A) op(B) + beta C, handed to the column-major library as C^T = op(B)^T op(A)^T, B first ------------
static cublasStatus_t linalg_gemm(cublasLtHandle_t lt, cudaStream_t s, int ta, int tb, int64_t M, int64_t N, int64_t K,
                                  float alpha, const void* A, int64_t lda, int64_t sa, const void* B, int64_t ldb,
                                  int64_t sb, float beta, float* C, int64_t ldc, int64_t sc, int64_t batch, int bf16,
                                  void* ws, size_t ws_bytes) {
  cudaDataType_t ab = bf16 ? CUDA_R_16BF : CUDA_R_32F;
  size_t es = bf16 ? 2 : 4;
  auto alignment = [](const void* p, int64_t ld, int64_t stride, size_t e) {
    uint64_t x = (uint64_t)(uintptr_t)p | (uint64_t)(ld * (int64_t)e) | (uint64_t)(stride * (int64_t)e) | 256;
    return (uint32_t)(x & (~x + 1));
  };
  uint32_t align_a = alignment(A, lda, batch > 1 ? sa : 0, es), align_b = alignment(B, ldb, batch > 1 ? sb : 0, es);
  uint32_t align_c = alignment(C, ldc, batch > 1 ? sc : 0, 4);
  cublasOperation_t opa = tb ? CUBLAS_OP_T : CUBLAS_OP_N, opb = ta ? CUBLAS_OP_T : CUBLAS_OP_N;
  cublasLtMatmulDesc_t desc = NULL;
  cublasLtMatrixLayout_t la = NULL, lb = NULL, lc = NULL;
  cublasStatus_t st = cublasLtMatmulDescCreate(&desc, CUBLAS_COMPUTE_32F, CUDA_R_32F);
  if (!st) st = cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSA, &opa, sizeof opa);
  if (!st) st = cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSB, &opb, sizeof opb);
  if (!st) st = cublasLtMatrixLayoutCreate(&la, ab, tb ? K : N, tb ? N : K, ldb);
  if (!st) st = cublasLtMatrixLayoutCreate(&lb, ab, ta ? M : K, ta ? K : M, lda);
  if (!st) st = cublasLtMatrixLayoutCreate(&lc, CUDA_R_32F, N, M, ldc);
  if (!st && batch > 1) {
    int32_t nb = (int32_t)batch;
    int64_t sbb = sb, saa = sa, scc = sc;
    cublasLtMatrixLayoutSetAttribute(la, CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT, &nb, sizeof nb);
    cublasLtMatrixLayoutSetAttribute(la, CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET, &sbb, sizeof sbb);
    cublasLtMatrixLayoutSetAttribute(lb, CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT, &nb, sizeof nb);
    cublasLtMatrixLayoutSetAttribute(lb, CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET, &saa, sizeof saa);
    cublasLtMatrixLayoutSetAttribute(lc, CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT, &nb, sizeof nb);
    cublasLtMatrixLayoutSetAttribute(lc, CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET, &scc, sizeof scc);
  }
  cublasLtMatmulPreference_t pref = NULL;
  cublasLtMatmulHeuristicResult_t res;
  int found = 0;
  size_t wsz = ws_bytes;
  if (!st) st = cublasLtMatmulPreferenceCreate(&pref);
  if (!st) st = cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &wsz, sizeof wsz);
  if (!st)
    st = cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, &align_b,
                                              sizeof align_b);
  if (!st)
    st = cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, &align_a,
                                              sizeof align_a);
  if (!st)
    st = cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, &align_c,
                                              sizeof align_c);
  if (!st)
    st = cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, &align_c,
                                              sizeof align_c);
  if (!st) st = cublasLtMatmulAlgoGetHeuristic(lt, desc, la, lb, lc, lc, pref, 1, &res, &found);
  if (pref) cublasLtMatmulPreferenceDestroy(pref);
  if (!st && found < 1) st = CUBLAS_STATUS_NOT_SUPPORTED;
  if (!st) st = cublasLtMatmul(lt, desc, &alpha, B, la, A, lb, &beta, C, lc, C, lc, &res.algo, ws, ws_bytes, s);
  // (the descriptors go before the product runs: the queued work must not need them)
  if (la) cublasLtMatrixLayoutDestroy(la);
  if (lb) cublasLtMatrixLayoutDestroy(lb);
  if (lc) cublasLtMatrixLayoutDestroy(lc);
  if (desc) cublasLtMatmulDescDestroy(desc);
  return st;
}

static void linalg_case(cublasLtHandle_t lt, cudaStream_t s, int ta, int tb, int64_t M, int64_t N, int64_t K,
                        int64_t batch, int bf16, int offset, float beta) {
  // row-major storage: A (M, K) or, transposed, (K, M); B (K, N) or (N, K); C (M, N); ld = columns + 3
  int64_t ar = ta ? K : M, acn = ta ? M : K, br = tb ? N : K, bcn = tb ? K : N;
  int64_t lda = acn + 3, ldb = bcn + 1, ldc = N + 2;
  int64_t sa = ar * lda + 1, sb = br * ldb + 2, sc = M * ldc + 3;
  std::vector<float> ha((size_t)(offset + sa * batch)), hb((size_t)(offset + sb * batch)),
      hc((size_t)(offset + sc * batch));
  for (float& x : ha) x = bf16 ? round_sig(urand(), 8) : urand();
  for (float& x : hb) x = bf16 ? round_sig(urand(), 8) : urand();
  for (float& x : hc) x = beta != 0.0f ? urand() : NaN;
  char *da = (char*)operand_to_device(ha, bf16), *db = (char*)operand_to_device(hb, bf16);
  float* dc = to_device(hc);
  size_t es = bf16 ? 2 : 4;
  // `offset` elements in: pointers only 4- (or 2-) byte aligned, as narrowed views are
  void* ws = NULL;
  cudaMallocAsync(&ws, 32 << 20, s);
  cublasStatus_t st = linalg_gemm(lt, s, ta, tb, M, N, K, 1.25f, da + offset * es, lda, sa, db + offset * es, ldb, sb,
                                  beta, dc + offset, ldc, sc, batch, bf16, ws, 32 << 20);
  cudaError_t e = cudaStreamSynchronize(s);
  std::vector<float> got = from_device(dc, hc.size());
  compare cmp;
  for (int64_t b = 0; b < batch; b++)
    for (int64_t i = 0; i < M; i++)
      for (int64_t j = 0; j < N; j++) {
        double sum = 0, mag = 0;
        for (int64_t l = 0; l < K; l++) {
          double x = ha[(size_t)(offset + b * sa + (ta ? l * lda + i : i * lda + l))];
          double y = hb[(size_t)(offset + b * sb + (tb ? j * ldb + l : l * ldb + j))];
          sum += x * y;
          mag += fabs(x * y);
        }
        size_t at = (size_t)(offset + b * sc + i * ldc + j);
        double old = beta != 0.0f ? hc[at] : 0.0;
        cmp.add(got[at], 1.25 * sum + beta * old, 1.25 * mag + fabs(beta * old), 1e-5);
      }
  check(st == CUBLAS_STATUS_SUCCESS && e == cudaSuccess && cmp.ok(),
        "linalg.cu's call: row-major ta %d tb %d, %lldx%lldx%lld, batch %lld%s, %d elements off alignment, beta %g: %s",
        ta, tb, (long long)M, (long long)N, (long long)K, (long long)batch, bf16 ? ", bf16" : "", offset, beta,
        cmp.what().c_str());
  cudaFreeAsync(ws, s);
  cudaFree(da);
  cudaFree(db);
  cudaFree(dc);
}

static void linalg_cases(cublasLtHandle_t lt, cudaStream_t s) {
  for (int ta = 0; ta < 2; ta++)
    for (int tb = 0; tb < 2; tb++) {
      linalg_case(lt, s, ta, tb, 6, 5, 7, 1, 0, 0, 0.0f);
      linalg_case(lt, s, ta, tb, 5, 8, 4, 3, 0, 1, 1.0f);
      linalg_case(lt, s, ta, tb, 7, 3, 9, 2, 1, 1, 0.0f);
    }
}

// ---- GEMM refusals --------------------------------------------------------------------------------------------
// a stream held at a host function until released: work queued behind it waits
struct gate {
  std::atomic<bool> open{false};
  static void wait(void* p) {
    while (!((gate*)p)->open.load()) {}
  }
};

static void gemm_refusals(cublasLtHandle_t lt, cudaStream_t s) {
  int64_t m = 4, n = 3, k = 5;
  store sa = store_of(m, k, 0, 1), sb = store_of(k, n, 0, 1), sc = store_of(m, n, 0, 1);
  std::vector<float> ha = operand_values(sa, false), hb = operand_values(sb, false), hc(sc.elems(), 0.0f);
  float *da = to_device(ha), *db = to_device(hb), *dc = to_device(hc);
  float one = 1.0f, zero = 0.0f;
  cublasLtMatmulDesc_t desc = make_desc(CUBLAS_COMPUTE_32F, CUBLAS_OP_N, CUBLAS_OP_N);
  cublasLtMatrixLayout_t la = make_layout(CUDA_R_32F, sa), lb = make_layout(CUDA_R_32F, sb),
                         lc = make_layout(CUDA_R_32F, sc);
  cublasLtMatmulPreference_t pref = make_pref(256, 256, 256, 256);
  cublasLtMatmulHeuristicResult_t res;
  int found = -1;
  cublasStatus_t st = cublasLtMatmulAlgoGetHeuristic(lt, desc, la, lb, lc, lc, pref, 4, &res, &found);
  check(st == CUBLAS_STATUS_SUCCESS && found == 1, "heuristic: one algorithm for 4 requested (status %d, %d returned)",
        (int)st, found);

  // a host pointer where a device one belongs
  st = cublasLtMatmul(lt, desc, &one, ha.data(), la, db, lb, &zero, dc, lc, dc, lc, &res.algo, NULL, 0, s);
  check(st == CUBLAS_STATUS_INVALID_VALUE, "refused: host pointer for A -> CUBLAS_STATUS_INVALID_VALUE (got %d)",
        (int)st);
  // a device pointer whose allocation is too small for the matrix
  // (the allocation holds 20 floats and 64 bytes more: from its 20th float the matrix runs 16 floats past it)
  st = cublasLtMatmul(lt, desc, &one, da + 20, la, db, lb, &zero, dc, lc, dc, lc, &res.algo, NULL, 0, s);
  check(st == CUBLAS_STATUS_INVALID_VALUE,
        "refused: A running past the end of its allocation -> INVALID_VALUE (got %d)", (int)st);

  // a wrong k: A (m x k+1) against B (k x n)
  store bad = store_of(m, k + 1, 0, 1);
  cublasLtMatrixLayout_t lbad = make_layout(CUDA_R_32F, bad);
  found = -1;
  st = cublasLtMatmulAlgoGetHeuristic(lt, desc, lbad, lb, lc, lc, pref, 1, &res, &found);
  check(st == CUBLAS_STATUS_INVALID_VALUE && found == 0,
        "refused: wrong k in the heuristic -> CUBLAS_STATUS_INVALID_VALUE, 0 returned (got %d, %d)", (int)st, found);
  cublasLtMatmulAlgoGetHeuristic(lt, desc, la, lb, lc, lc, pref, 1, &res, &found);
  st = cublasLtMatmul(lt, desc, &one, da, lbad, db, lb, &zero, dc, lc, dc, lc, &res.algo, NULL, 0, s);
  check(st == CUBLAS_STATUS_INVALID_VALUE, "refused: wrong k in the product -> CUBLAS_STATUS_INVALID_VALUE (got %d)",
        (int)st);
  // wrong m: C (m+1 x n)
  store badc = store_of(m + 1, n, 0, 1);
  cublasLtMatrixLayout_t lbadc = make_layout(CUDA_R_32F, badc);
  st = cublasLtMatmulAlgoGetHeuristic(lt, desc, la, lb, lbadc, lbadc, pref, 1, &res, &found);
  check(st == CUBLAS_STATUS_INVALID_VALUE, "refused: C with m + 1 rows -> CUBLAS_STATUS_INVALID_VALUE (got %d)",
        (int)st);

  // descriptor attributes the stand-in does not implement
  int32_t epi = 2;
  st = cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_EPILOGUE, &epi, sizeof epi);
  check(st == CUBLAS_STATUS_NOT_SUPPORTED,
        "refused: CUBLASLT_MATMUL_DESC_EPILOGUE -> CUBLAS_STATUS_NOT_SUPPORTED (got %d)", (int)st);
  const void* bias = dc;
  st = cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &bias, sizeof bias);
  check(st == CUBLAS_STATUS_NOT_SUPPORTED, "refused: CUBLASLT_MATMUL_DESC_BIAS_POINTER -> NOT_SUPPORTED (got %d)",
        (int)st);
  int32_t pm = 1;
  st = cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_POINTER_MODE, &pm, sizeof pm);
  check(st == CUBLAS_STATUS_NOT_SUPPORTED, "refused: CUBLASLT_MATMUL_DESC_POINTER_MODE -> NOT_SUPPORTED (got %d)",
        (int)st);
  cublasOperation_t opc = CUBLAS_OP_C;
  st = cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSA, &opc, sizeof opc);
  check(st == CUBLAS_STATUS_NOT_SUPPORTED, "refused: TRANSA = CUBLAS_OP_C -> NOT_SUPPORTED (got %d)", (int)st);
  int32_t order = 1;
  st = cublasLtMatrixLayoutSetAttribute(la, CUBLASLT_MATRIX_LAYOUT_ORDER, &order, sizeof order);
  check(st == CUBLAS_STATUS_NOT_SUPPORTED, "refused: CUBLASLT_MATRIX_LAYOUT_ORDER -> NOT_SUPPORTED (got %d)", (int)st);
  uint32_t mode = 0;
  st = cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_SEARCH_MODE, &mode, sizeof mode);
  check(st == CUBLAS_STATUS_NOT_SUPPORTED, "refused: CUBLASLT_MATMUL_PREF_SEARCH_MODE -> NOT_SUPPORTED (got %d)",
        (int)st);
  cublasLtMatmulDesc_t d16 = NULL;
  st = cublasLtMatmulDescCreate(&d16, CUBLAS_COMPUTE_16F, CUDA_R_32F);
  check(st == CUBLAS_STATUS_NOT_SUPPORTED, "refused: CUBLAS_COMPUTE_16F -> NOT_SUPPORTED (got %d)", (int)st);
  cublasLtMatrixLayout_t lshort = NULL;
  st = cublasLtMatrixLayoutCreate(&lshort, CUDA_R_32F, 8, 4, 7);
  check(st == CUBLAS_STATUS_INVALID_VALUE, "refused: ld 7 < 8 rows -> CUBLAS_STATUS_INVALID_VALUE (got %d)", (int)st);
  uint32_t three = 3;
  st = cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, &three, sizeof three);
  check(st == CUBLAS_STATUS_INVALID_VALUE, "refused: an alignment of 3 bytes -> INVALID_VALUE (got %d)", (int)st);

  // a pointer less aligned than the preference promised: a kernel chosen for 16 bytes cannot run it
  cublasLtMatmulPreference_t p16 = make_pref(16, 256, 256, 256);
  cublasLtMatmulAlgoGetHeuristic(lt, desc, la, lb, lc, lc, p16, 1, &res, &found);
  float* da2 = NULL;
  cudaMalloc((void**)&da2, (sa.elems() + 1) * sizeof(float));
  cudaMemcpy(da2 + 1, ha.data(), sa.elems() * sizeof(float), cudaMemcpyHostToDevice);
  st = cublasLtMatmul(lt, desc, &one, da2 + 1, la, db, lb, &zero, dc, lc, dc, lc, &res.algo, NULL, 0, s);
  check(st == CUBLAS_STATUS_NOT_SUPPORTED,
        "refused: A 4-byte aligned, the preference said 16 -> CUBLAS_STATUS_NOT_SUPPORTED (got %d)", (int)st);
  cublasLtMatmulPreference_t p4 = make_pref(4, 256, 256, 256);
  cublasLtMatmulAlgoGetHeuristic(lt, desc, la, lb, lc, lc, p4, 1, &res, &found);
  st = cublasLtMatmul(lt, desc, &one, da2 + 1, la, db, lb, &zero, dc, lc, dc, lc, &res.algo, NULL, 0, s);
  cudaError_t e = cudaStreamSynchronize(s);
  std::vector<float> got = from_device(dc, sc.elems());
  compare cmp;
  for (int64_t i = 0; i < m; i++)
    for (int64_t j = 0; j < n; j++) {
      double sum = 0, mag = 0;
      for (int64_t l = 0; l < k; l++)
        sum += (double)ha[sa.at(0, i, l)] * hb[sb.at(0, l, j)], mag += fabs(ha[sa.at(0, i, l)] * hb[sb.at(0, l, j)]);
      cmp.add(got[sc.at(0, i, j)], sum, mag, 1e-5);
    }
  check(st == CUBLAS_STATUS_SUCCESS && e == cudaSuccess && cmp.ok(),
        "the same A with the preference saying 4 bytes: runs (status %d): %s", (int)st, cmp.what().c_str());
  cublasLtMatmulPreference_t p2 = make_pref(2, 256, 256, 256);
  st = cublasLtMatmulAlgoGetHeuristic(lt, desc, la, lb, lc, lc, p2, 1, &res, &found);
  check(st == CUBLAS_STATUS_NOT_SUPPORTED && found == 0,
        "refused: a float32 A promised at 2 bytes -> heuristic NOT_SUPPORTED (got %d, %d returned)", (int)st, found);

  // types: bfloat16 with TF32 compute, mixed A and B
  cublasLtMatmulDesc_t dtf = make_desc(CUBLAS_COMPUTE_32F_FAST_TF32, CUBLAS_OP_N, CUBLAS_OP_N);
  cublasLtMatrixLayout_t la16 = make_layout(CUDA_R_16BF, sa), lb16 = make_layout(CUDA_R_16BF, sb);
  st = cublasLtMatmulAlgoGetHeuristic(lt, dtf, la16, lb16, lc, lc, pref, 1, &res, &found);
  check(st == CUBLAS_STATUS_NOT_SUPPORTED && found == 0,
        "refused: CUBLAS_COMPUTE_32F_FAST_TF32 with bf16 operands -> NOT_SUPPORTED (got %d)", (int)st);
  st = cublasLtMatmulAlgoGetHeuristic(lt, desc, la, lb16, lc, lc, pref, 1, &res, &found);
  check(st == CUBLAS_STATUS_NOT_SUPPORTED, "refused: A float32, B bf16 -> NOT_SUPPORTED (got %d)", (int)st);
  st = cublasLtMatmulAlgoGetHeuristic(lt, desc, la16, lb16, la16, la16, pref, 1, &res, &found);
  check(st == CUBLAS_STATUS_NOT_SUPPORTED, "refused: a bf16 C -> NOT_SUPPORTED (got %d)", (int)st);
  // batch counts that do not agree
  store sa2 = store_of(m, k, 0, 2), sc3 = store_of(m, n, 0, 3), sb3 = store_of(k, n, 0, 3);
  cublasLtMatrixLayout_t la2 = make_layout(CUDA_R_32F, sa2), lc3 = make_layout(CUDA_R_32F, sc3),
                         lb3 = make_layout(CUDA_R_32F, sb3);
  st = cublasLtMatmulAlgoGetHeuristic(lt, desc, la2, lb3, lc3, lc3, pref, 1, &res, &found);
  check(st == CUBLAS_STATUS_INVALID_VALUE, "refused: batch counts A 2, B 3, C 3 -> INVALID_VALUE (got %d)", (int)st);

  // memory freed (in stream order) before the product runs: a fault, sticky
  gate g;
  float* dfree = to_device(ha);
  cublasLtMatmulAlgoGetHeuristic(lt, desc, la, lb, lc, lc, pref, 1, &res, &found);
  cudaLaunchHostFunc(s, gate::wait, &g);
  cudaFreeAsync(dfree, s);
  st = cublasLtMatmul(lt, desc, &one, dfree, la, db, lb, &zero, dc, lc, dc, lc, &res.algo, NULL, 0, s);
  g.open = true;
  e = cudaStreamSynchronize(s);
  check(st == CUBLAS_STATUS_SUCCESS && e == cudaErrorIllegalAddress,
        "A freed before the queued product runs: sticky cudaErrorIllegalAddress (call %d, sync %s)", (int)st,
        cudaGetErrorName(e));
  fsdp_emu_reset();

  check(cublasLtGetVersion() >= 130000, "cublasLtGetVersion: %zu", cublasLtGetVersion());
  cublasLtMatrixLayout_t all[] = {la, lb, lc, lbad, lbadc, la16, lb16, la2, lc3, lb3};
  for (cublasLtMatrixLayout_t l : all) cublasLtMatrixLayoutDestroy(l);
  cublasLtMatmulPreferenceDestroy(pref);
  cublasLtMatmulPreferenceDestroy(p16);
  cublasLtMatmulPreferenceDestroy(p4);
  cublasLtMatmulPreferenceDestroy(p2);
  cublasLtMatmulDescDestroy(desc);
  cublasLtMatmulDescDestroy(dtf);
  cudaFree(da);
  cudaFree(da2);
  cudaFree(db);
  cudaFree(dc);
}

// ======================================================================================================
// convolutions, NCHW, as the documentation defines them
// ======================================================================================================
struct conv_case {
  const char* name;
  int N, C, H, W, K, kh, kw, ph, pw, sh, sw, dh, dw, groups;
  cudnnConvolutionMode_t mode;
  bool on_stream;
};
struct cgeom {
  int64_t N, C, H, W, K, kh, kw, ph, pw, sh, sw, dh, dw, G, Cg, Kg, OH, OW;
  bool flip;
  int64_t xi(int64_t n, int64_t c, int64_t h, int64_t w) const { return ((n * C + c) * H + h) * W + w; }
  int64_t yi(int64_t n, int64_t k, int64_t h, int64_t w) const { return ((n * K + k) * OH + h) * OW + w; }
  // where the filter tap (i, j) lies in w (CUDNN_CONVOLUTION reads the filter flipped)
  int64_t wi(int64_t k, int64_t c, int64_t i, int64_t j) const {
    if (flip) i = kh - 1 - i, j = kw - 1 - j;
    return ((k * Cg + c) * kh + i) * kw + j;
  }
  size_t nx() const { return (size_t)(N * C * H * W); }
  size_t ny() const { return (size_t)(N * K * OH * OW); }
  size_t nw() const { return (size_t)(K * Cg * kh * kw); }
};
static cgeom geom_of(const conv_case& t) {
  cgeom g;
  g.N = t.N, g.C = t.C, g.H = t.H, g.W = t.W, g.K = t.K, g.kh = t.kh, g.kw = t.kw, g.ph = t.ph, g.pw = t.pw;
  g.sh = t.sh, g.sw = t.sw, g.dh = t.dh, g.dw = t.dw, g.G = t.groups, g.Cg = t.C / t.groups, g.Kg = t.K / t.groups;
  g.OH = (t.H + 2 * t.ph - t.dh * (t.kh - 1) - 1) / t.sh + 1;
  g.OW = (t.W + 2 * t.pw - t.dw * (t.kw - 1) - 1) / t.sw + 1;
  g.flip = t.mode == CUDNN_CONVOLUTION;
  return g;
}

// every term x[n, c, ih, iw] w[tap] that feeds y[n, k, oh, ow], once: f(n, k, oh, ow, x index, w index)
template <typename F>
static void each_term(const cgeom& g, F f) {
  for (int64_t n = 0; n < g.N; n++)
    for (int64_t k = 0; k < g.K; k++)
      for (int64_t oh = 0; oh < g.OH; oh++)
        for (int64_t ow = 0; ow < g.OW; ow++)
          for (int64_t c = 0; c < g.Cg; c++)
            for (int64_t i = 0; i < g.kh; i++)
              for (int64_t j = 0; j < g.kw; j++) {
                int64_t ih = oh * g.sh - g.ph + i * g.dh, iw = ow * g.sw - g.pw + j * g.dw;
                if (ih < 0 || ih >= g.H || iw < 0 || iw >= g.W) continue;  // padding: zero
                f(g.yi(n, k, oh, ow), g.xi(n, k / g.Kg * g.Cg + c, ih, iw), g.wi(k, c, i, j));
              }
}

static std::vector<float> random_vec(size_t n) {
  std::vector<float> v(n);
  for (float& x : v) x = urand();
  return v;
}
static std::vector<float> filled(size_t n, float v) { return std::vector<float>(n, v); }

static void run_conv_case(cudnnHandle_t h, cudaStream_t stream, const conv_case& t) {
  cudaStream_t s = t.on_stream ? stream : 0;
  cudnnSetStream(h, s);
  cgeom g = geom_of(t);
  char name[200];
  snprintf(name, sizeof name,
           "conv %s: N%d C%d %dx%d -> K%d %lldx%lld, filter %dx%d, pad %d,%d stride %d,%d dil %d,%d, groups %d, %s",
           t.name, t.N, t.C, t.H, t.W, t.K, (long long)g.OH, (long long)g.OW, t.kh, t.kw, t.ph, t.pw, t.sh, t.sw, t.dh,
           t.dw, t.groups, g.flip ? "CUDNN_CONVOLUTION" : "CUDNN_CROSS_CORRELATION");

  // descriptors as backend/cuda/linalg.cu's conv_plan_for makes them
  cudnnTensorDescriptor_t xd, yd, bd;
  cudnnFilterDescriptor_t wd;
  cudnnConvolutionDescriptor_t cd;
  cudnnStatus_t st = cudnnCreateTensorDescriptor(&xd);
  if (!st) st = cudnnCreateTensorDescriptor(&yd);
  if (!st) st = cudnnCreateTensorDescriptor(&bd);
  if (!st) st = cudnnCreateFilterDescriptor(&wd);
  if (!st) st = cudnnCreateConvolutionDescriptor(&cd);
  if (!st) st = cudnnSetTensor4dDescriptor(xd, CUDNN_TENSOR_NCHW, CUDNN_DATA_FLOAT, t.N, t.C, t.H, t.W);
  if (!st) st = cudnnSetTensor4dDescriptor(yd, CUDNN_TENSOR_NCHW, CUDNN_DATA_FLOAT, t.N, t.K, (int)g.OH, (int)g.OW);
  if (!st) st = cudnnSetTensor4dDescriptor(bd, CUDNN_TENSOR_NCHW, CUDNN_DATA_FLOAT, 1, t.K, 1, 1);
  if (!st) st = cudnnSetFilter4dDescriptor(wd, CUDNN_DATA_FLOAT, CUDNN_TENSOR_NCHW, t.K, t.C / t.groups, t.kh, t.kw);
  if (!st) st = cudnnSetConvolution2dDescriptor(cd, t.ph, t.pw, t.sh, t.sw, t.dh, t.dw, t.mode, CUDNN_DATA_FLOAT);
  if (!st) st = cudnnSetConvolutionGroupCount(cd, t.groups);
  if (!st) st = cudnnSetConvolutionMathType(cd, CUDNN_FMA_MATH);
  check(st == CUDNN_STATUS_SUCCESS, "%s: descriptors (%s)", name, cudnnGetErrorString(st));
  if (st) return;

  // the algorithms: the first result runs, deterministic, in FMA math, without workspace
  cudnnConvolutionFwdAlgoPerf_t fp[8];
  cudnnConvolutionBwdDataAlgoPerf_t dp[8];
  cudnnConvolutionBwdFilterAlgoPerf_t wp[8];
  int nf = 0, nd = 0, nw = 0;
  cudnnStatus_t s1 = cudnnGetConvolutionForwardAlgorithm_v7(h, xd, wd, cd, yd, 8, &nf, fp);
  cudnnStatus_t s2 = cudnnGetConvolutionBackwardDataAlgorithm_v7(h, wd, yd, cd, xd, 8, &nd, dp);
  cudnnStatus_t s3 = cudnnGetConvolutionBackwardFilterAlgorithm_v7(h, xd, yd, cd, wd, 8, &nw, wp);
  bool algos_ok = !s1 && !s2 && !s3 && nf >= 1 && nd >= 1 && nw >= 1 && !fp[0].status && !dp[0].status &&
                  !wp[0].status && fp[0].memory == 0 && dp[0].memory == 0 && wp[0].memory == 0 &&
                  fp[0].mathType == CUDNN_FMA_MATH && dp[0].mathType == CUDNN_FMA_MATH &&
                  wp[0].mathType == CUDNN_FMA_MATH && fp[0].determinism == CUDNN_DETERMINISTIC &&
                  dp[0].determinism == CUDNN_DETERMINISTIC && wp[0].determinism == CUDNN_DETERMINISTIC;
  check(algos_ok, "%s: the _v7 queries (%d, %d, %d results; first SUCCESS, FMA, deterministic, no workspace)", name, nf,
        nd, nw);
  if (!algos_ok) return;

  std::vector<float> x = random_vec(g.nx()), w = random_vec(g.nw()), dy = random_vec(g.ny());
  float *dx_in = to_device(x), *dw_in = to_device(w), *ddy = to_device(dy);
  float one = 1.0f, zero = 0.0f;

  // references in double: the value and the magnitude (the sum of |term|) of every output element
  std::vector<double> y_ref(g.ny(), 0), y_mag(g.ny(), 0), dx_ref(g.nx(), 0), dx_mag(g.nx(), 0), dw_ref(g.nw(), 0),
      dw_mag(g.nw(), 0);
  each_term(g, [&](int64_t yi, int64_t xi, int64_t wi) {
    y_ref[yi] += (double)x[xi] * w[wi];
    y_mag[yi] += fabs((double)x[xi] * w[wi]);
    dx_ref[xi] += (double)dy[yi] * w[wi];  // the adjoints: each term's share, scattered
    dx_mag[xi] += fabs((double)dy[yi] * w[wi]);
    dw_ref[wi] += (double)dy[yi] * x[xi];
    dw_mag[wi] += fabs((double)dy[yi] * x[xi]);
  });

  // one blended call of each kind, checked against reference * alpha + beta * old
  auto verify = [&](const char* what, float* dev, size_t n, const std::vector<float>& old, float alpha, float beta,
                    const std::vector<double>& ref, const std::vector<double>& mag, cudnnStatus_t call) {
    cudaError_t e = cudaStreamSynchronize(s);
    std::vector<float> got = from_device(dev, n);
    compare cmp;
    for (size_t i = 0; i < n; i++) {
      double o = beta != 0.0f ? (double)beta * old[i] : 0.0;
      cmp.add(got[i], alpha * ref[i] + o, fabs(alpha) * mag[i] + fabs(o), 1e-5);
    }
    check(call == CUDNN_STATUS_SUCCESS && e == cudaSuccess && cmp.ok(), "%s: %s, alpha %g beta %g%s (%s): %s", name,
          what, alpha, beta, beta == 0.0f ? " over NaN" : "", cudnnGetErrorString(call), cmp.what().c_str());
    return got;
  };
  for (int pass = 0; pass < 2; pass++) {
    float alpha = pass ? 0.5f : 1.0f, beta = pass ? -1.25f : 0.0f;
    std::vector<float> old_y = pass ? random_vec(g.ny()) : filled(g.ny(), NaN);
    std::vector<float> old_x = pass ? random_vec(g.nx()) : filled(g.nx(), NaN);
    std::vector<float> old_w = pass ? random_vec(g.nw()) : filled(g.nw(), NaN);
    float *py = to_device(old_y), *px = to_device(old_x), *pw = to_device(old_w);
    st = cudnnConvolutionForward(h, &alpha, xd, dx_in, wd, dw_in, cd, fp[0].algo, NULL, 0, &beta, yd, py);
    std::vector<float> y = verify("forward", py, g.ny(), old_y, alpha, beta, y_ref, y_mag, st);
    st = cudnnConvolutionBackwardData(h, &alpha, wd, dw_in, yd, ddy, cd, dp[0].algo, NULL, 0, &beta, xd, px);
    std::vector<float> dx = verify("backward data", px, g.nx(), old_x, alpha, beta, dx_ref, dx_mag, st);
    st = cudnnConvolutionBackwardFilter(h, &alpha, xd, dx_in, yd, ddy, cd, wp[0].algo, NULL, 0, &beta, wd, pw);
    std::vector<float> dw = verify("backward filter", pw, g.nw(), old_w, alpha, beta, dw_ref, dw_mag, st);
    if (pass == 0) {  // the adjoint identity <conv(x, w), dy> = <x, dx> = <w, dw> (each the sum of all terms)
      double a = 0, b = 0, c = 0, mag = 0;
      for (size_t i = 0; i < g.ny(); i++) a += (double)y[i] * dy[i], mag += y_mag[i] * fabs(dy[i]);
      for (size_t i = 0; i < g.nx(); i++) b += (double)x[i] * dx[i];
      for (size_t i = 0; i < g.nw(); i++) c += (double)w[i] * dw[i];
      double tol = 1e-5 * mag + 1e-30;
      check(fabs(a - b) <= tol && fabs(a - c) <= tol, "%s: adjoint <conv(x,w),dy> %.9g, <x,dx> %.9g, <w,dw> %.9g", name,
            a, b, c);
    }
    cudaFree(py);
    cudaFree(px);
    cudaFree(pw);
  }

  // bias: its gradient (sum of dy over n, oh, ow), and the add as linalg.cu makes it (alpha 1, beta 1)
  std::vector<double> db_ref((size_t)g.K, 0), db_mag((size_t)g.K, 0);
  for (int64_t n = 0; n < g.N; n++)
    for (int64_t k = 0; k < g.K; k++)
      for (int64_t p = 0; p < g.OH * g.OW; p++)
        db_ref[k] += dy[g.yi(n, k, 0, 0) + p], db_mag[k] += fabs(dy[g.yi(n, k, 0, 0) + p]);
  float* pdb = to_device(filled((size_t)g.K, NaN));
  st = cudnnConvolutionBackwardBias(h, &one, yd, ddy, &zero, bd, pdb);
  std::vector<float> dbias =
      verify("backward bias", pdb, (size_t)g.K, filled((size_t)g.K, NaN), 1.0f, 0.0f, db_ref, db_mag, st);
  std::vector<float> bias = random_vec((size_t)g.K), base = random_vec(g.ny());
  float *pb = to_device(bias), *pyb = to_device(base);
  std::vector<double> add_ref(g.ny()), add_mag(g.ny());
  for (size_t i = 0; i < g.ny(); i++) {
    int64_t k = (int64_t)i / (g.OH * g.OW) % g.K;
    add_ref[i] = bias[k];
    add_mag[i] = fabs(bias[k]);
  }
  st = cudnnAddTensor(h, &one, bd, pb, &one, yd, pyb);
  verify("add tensor (bias onto y)", pyb, g.ny(), base, 1.0f, 1.0f, add_ref, add_mag, st);
  float two = 2.0f;
  float* pyn = to_device(filled(g.ny(), NaN));
  st = cudnnAddTensor(h, &two, bd, pb, &zero, yd, pyn);
  verify("add tensor", pyn, g.ny(), filled(g.ny(), NaN), 2.0f, 0.0f, add_ref, add_mag, st);

  cudaFree(pdb);
  cudaFree(pb);
  cudaFree(pyb);
  cudaFree(pyn);
  cudaFree(dx_in);
  cudaFree(dw_in);
  cudaFree(ddy);
  cudnnDestroyTensorDescriptor(xd);
  cudnnDestroyTensorDescriptor(yd);
  cudnnDestroyTensorDescriptor(bd);
  cudnnDestroyFilterDescriptor(wd);
  cudnnDestroyConvolutionDescriptor(cd);
}

static void conv_cases(cudnnHandle_t h, cudaStream_t s) {
  const cudnnConvolutionMode_t XC = CUDNN_CROSS_CORRELATION, CV = CUDNN_CONVOLUTION;
  run_conv_case(h, s, {"3x3 same", 2, 3, 7, 6, 4, 3, 3, 1, 1, 1, 1, 1, 1, 1, XC, true});
  run_conv_case(h, s, {"3x3 same", 2, 3, 7, 6, 4, 3, 3, 1, 1, 1, 1, 1, 1, 1, CV, true});
  run_conv_case(h, s, {"strided dilated groups", 2, 4, 9, 8, 6, 3, 2, 2, 1, 2, 3, 1, 2, 2, CV, true});
  run_conv_case(h, s, {"strided dilated groups", 2, 4, 9, 8, 6, 3, 2, 2, 1, 2, 3, 1, 2, 2, XC, true});
  run_conv_case(h, s, {"three groups", 1, 6, 10, 11, 3, 2, 3, 0, 2, 3, 1, 2, 1, 3, XC, true});
  run_conv_case(h, s, {"depthwise", 2, 4, 8, 7, 4, 3, 3, 1, 1, 2, 2, 1, 1, 4, CV, true});
  run_conv_case(h, s, {"1x1 stride 2", 3, 5, 6, 5, 2, 1, 1, 0, 0, 2, 2, 1, 1, 1, XC, false});
  run_conv_case(h, s, {"wide filter", 1, 2, 5, 12, 3, 2, 5, 1, 0, 1, 2, 2, 2, 1, CV, true});
}

// ---- cuDNN refusals -------------------------------------------------------------------------------------------
static void conv_refusals(cudnnHandle_t h, cudaStream_t s) {
  cudnnSetStream(h, s);
  cudnnTensorDescriptor_t xd, yd, bad;
  cudnnFilterDescriptor_t wd;
  cudnnConvolutionDescriptor_t cd;
  cudnnCreateTensorDescriptor(&xd);
  cudnnCreateTensorDescriptor(&yd);
  cudnnCreateTensorDescriptor(&bad);
  cudnnCreateFilterDescriptor(&wd);
  cudnnCreateConvolutionDescriptor(&cd);
  cudnnStatus_t st = cudnnSetTensor4dDescriptor(xd, CUDNN_TENSOR_NHWC, CUDNN_DATA_FLOAT, 2, 3, 8, 8);
  check(st == CUDNN_STATUS_NOT_SUPPORTED, "refused: a CUDNN_TENSOR_NHWC tensor -> %s", cudnnGetErrorString(st));
  st = cudnnSetFilter4dDescriptor(wd, CUDNN_DATA_FLOAT, CUDNN_TENSOR_NHWC, 4, 3, 3, 3);
  check(st == CUDNN_STATUS_NOT_SUPPORTED, "refused: a CUDNN_TENSOR_NHWC filter -> %s", cudnnGetErrorString(st));
  st = cudnnSetTensor4dDescriptor(xd, CUDNN_TENSOR_NCHW, CUDNN_DATA_DOUBLE, 2, 3, 8, 8);
  check(st == CUDNN_STATUS_NOT_SUPPORTED, "refused: CUDNN_DATA_DOUBLE -> %s", cudnnGetErrorString(st));
  st = cudnnSetTensor4dDescriptor(xd, CUDNN_TENSOR_NCHW, CUDNN_DATA_FLOAT, 2, 0, 8, 8);
  check(st == CUDNN_STATUS_BAD_PARAM, "refused: a dimension of 0 -> %s", cudnnGetErrorString(st));
  st = cudnnSetConvolution2dDescriptor(cd, 1, 1, 0, 1, 1, 1, CUDNN_CROSS_CORRELATION, CUDNN_DATA_FLOAT);
  check(st == CUDNN_STATUS_BAD_PARAM, "refused: stride 0 -> %s", cudnnGetErrorString(st));
  st = cudnnSetConvolutionMathType(cd, CUDNN_TENSOR_OP_MATH);
  check(st == CUDNN_STATUS_NOT_SUPPORTED, "refused: CUDNN_TENSOR_OP_MATH -> %s", cudnnGetErrorString(st));
  st = cudnnSetConvolutionGroupCount(cd, 0);
  check(st == CUDNN_STATUS_BAD_PARAM, "refused: 0 groups -> %s", cudnnGetErrorString(st));

  // x (2, 4, 8, 8), w (6, 4, 3, 3), pad 1, stride 2: y (2, 6, 4, 4); the bad y says 5x4
  cudnnSetTensor4dDescriptor(xd, CUDNN_TENSOR_NCHW, CUDNN_DATA_FLOAT, 2, 4, 8, 8);
  cudnnSetTensor4dDescriptor(yd, CUDNN_TENSOR_NCHW, CUDNN_DATA_FLOAT, 2, 6, 4, 4);
  cudnnSetTensor4dDescriptor(bad, CUDNN_TENSOR_NCHW, CUDNN_DATA_FLOAT, 2, 6, 5, 4);
  cudnnSetFilter4dDescriptor(wd, CUDNN_DATA_FLOAT, CUDNN_TENSOR_NCHW, 6, 4, 3, 3);
  cudnnSetConvolution2dDescriptor(cd, 1, 1, 2, 2, 1, 1, CUDNN_CROSS_CORRELATION, CUDNN_DATA_FLOAT);
  cudnnConvolutionFwdAlgoPerf_t fp[8];
  int n = 0;
  st = cudnnGetConvolutionForwardAlgorithm_v7(h, xd, wd, cd, yd, 8, &n, fp);
  check(st == CUDNN_STATUS_SUCCESS && n >= 1, "the well-formed geometry is accepted (%s)", cudnnGetErrorString(st));
  st = cudnnGetConvolutionForwardAlgorithm_v7(h, xd, wd, cd, bad, 8, &n, fp);
  check(st == CUDNN_STATUS_BAD_PARAM, "refused: output 5x4 where the geometry gives 4x4 (algorithm query) -> %s",
        cudnnGetErrorString(st));
  std::vector<float> hx((size_t)2 * 4 * 8 * 8, 1.0f), hw((size_t)6 * 4 * 9, 1.0f), hy((size_t)2 * 6 * 5 * 4, 0.0f);
  float *x = to_device(hx), *w = to_device(hw), *y = to_device(hy);
  float one = 1.0f, zero = 0.0f;
  st = cudnnConvolutionForward(h, &one, xd, x, wd, w, cd, fp[0].algo, NULL, 0, &zero, bad, y);
  check(st == CUDNN_STATUS_BAD_PARAM, "refused: output 5x4 where the geometry gives 4x4 (forward) -> %s",
        cudnnGetErrorString(st));
  cudnnConvolutionBwdDataAlgoPerf_t dp[8];
  st = cudnnGetConvolutionBackwardDataAlgorithm_v7(h, wd, bad, cd, xd, 8, &n, dp);
  check(st == CUDNN_STATUS_BAD_PARAM, "refused: dy 5x4 in the data gradient query -> %s", cudnnGetErrorString(st));
  st = cudnnConvolutionForward(h, &one, xd, hx.data(), wd, w, cd, fp[0].algo, NULL, 0, &zero, yd, y);
  check(st == CUDNN_STATUS_BAD_PARAM, "refused: a host pointer for x -> %s", cudnnGetErrorString(st));
  st = cudnnConvolutionForward(h, &one, xd, x, wd, w, cd, CUDNN_CONVOLUTION_FWD_ALGO_GEMM, NULL, 0, &zero, yd, y);
  check(st == CUDNN_STATUS_NOT_SUPPORTED, "refused: an algorithm the query did not offer -> %s",
        cudnnGetErrorString(st));
  cudnnSetConvolutionGroupCount(cd, 3);  // 3 does not divide C 4
  st = cudnnGetConvolutionForwardAlgorithm_v7(h, xd, wd, cd, yd, 8, &n, fp);
  check(st == CUDNN_STATUS_BAD_PARAM, "refused: 3 groups for 4 channels -> %s", cudnnGetErrorString(st));
  cudnnSetConvolutionGroupCount(cd, 2);  // the filter's C 4 would need an input of 8 channels
  st = cudnnGetConvolutionForwardAlgorithm_v7(h, xd, wd, cd, yd, 8, &n, fp);
  check(st == CUDNN_STATUS_BAD_PARAM, "refused: filter C 4 with 2 groups on 4 input channels -> %s",
        cudnnGetErrorString(st));
  cudnnTensorDescriptor_t b5;
  cudnnCreateTensorDescriptor(&b5);
  cudnnSetTensor4dDescriptor(b5, CUDNN_TENSOR_NCHW, CUDNN_DATA_FLOAT, 1, 5, 1, 1);
  st = cudnnAddTensor(h, &one, b5, x, &one, yd, y);
  check(st == CUDNN_STATUS_BAD_PARAM, "refused: adding a (1, 5, 1, 1) bias to (2, 6, 4, 4) -> %s",
        cudnnGetErrorString(st));
  st = cudnnConvolutionBackwardBias(h, &one, yd, y, &zero, xd, x);
  check(st == CUDNN_STATUS_BAD_PARAM, "refused: a bias gradient that is not (1, K, 1, 1) -> %s",
        cudnnGetErrorString(st));
  check(!strcmp(cudnnGetErrorString(CUDNN_STATUS_NOT_SUPPORTED), "CUDNN_STATUS_NOT_SUPPORTED"),
        "cudnnGetErrorString(CUDNN_STATUS_NOT_SUPPORTED) = %s", cudnnGetErrorString(CUDNN_STATUS_NOT_SUPPORTED));

  // memory freed (in stream order) before the queued convolution runs: a fault, sticky
  cudnnSetConvolutionGroupCount(cd, 1);
  gate g;
  float* xf = to_device(hx);
  cudaLaunchHostFunc(s, gate::wait, &g);
  cudaFreeAsync(xf, s);
  st = cudnnConvolutionForward(h, &one, xd, xf, wd, w, cd, CUDNN_CONVOLUTION_FWD_ALGO_IMPLICIT_GEMM, NULL, 0, &zero, yd,
                               y);
  g.open = true;
  cudaError_t e = cudaStreamSynchronize(s);
  check(st == CUDNN_STATUS_SUCCESS && e == cudaErrorIllegalAddress,
        "x freed before the queued convolution runs: sticky cudaErrorIllegalAddress (call %s, sync %s)",
        cudnnGetErrorString(st), cudaGetErrorName(e));
  fsdp_emu_reset();

  cudaFree(x);
  cudaFree(w);
  cudaFree(y);
  cudnnDestroyTensorDescriptor(xd);
  cudnnDestroyTensorDescriptor(yd);
  cudnnDestroyTensorDescriptor(bad);
  cudnnDestroyTensorDescriptor(b5);
  cudnnDestroyFilterDescriptor(wd);
  cudnnDestroyConvolutionDescriptor(cd);
}

int main(void) {
  cudaStream_t s;
  cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking);
  cublasLtHandle_t lt;
  cublasLtCreate(&lt);
  cudnnHandle_t dnn;
  cudnnCreate(&dnn);

  gemm_cases(lt, s);
  linalg_cases(lt, s);
  gemm_refusals(lt, s);
  conv_cases(dnn, s);
  conv_refusals(dnn, s);

  cudnnDestroy(dnn);
  cublasLtDestroy(lt);
  cudaStreamDestroy(s);
  if (g_failed) {
    printf("libs_test FAILED: %d of %d checks\n", g_failed, g_checks);
    return 1;
  }
  printf("libs_test OK (%d checks)\n", g_checks);
  return 0;
}
