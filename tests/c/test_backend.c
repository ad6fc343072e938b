/*
 * test_backend.c -- the backend registry and the device table: the CPU registers itself and is
 * complete, an absent device is a named error (also for allocation), an incomplete table is
 * refused, and a second device whose table is the CPU's runs ops device-independently (the op
 * layer reaches kernels only through the table of its tensors' device), and the GEMM on bfloat16
 * operands matches a double-precision product of the same values. Run under valgrind by
 * `make memcheck` (where oneDNN is held to AVX2, so the bfloat16 GEMM takes its float32 path).
 */
#include <string.h>

#include "ctest.h"
#include "core/core.h"  // the registry is internal: backends register from C, not through the API

static int error_has(const char* s) { return strstr(fsdp_last_error(), s) != NULL; }

TEST(test_cpu_registered_and_complete) {
  const fsdp_backend* b = fsdp_backend_for(FSDP_CPU);
  EXPECT(b && strcmp(b->name, "cpu") == 0);
  EXPECT(b && b->alloc && b->copy && b->synchronize && b->elem && b->elem->binary && b->optim);
  EXPECT(b && b->synchronize() == 0);
  EXPECT(strcmp(fsdp_device_name(FSDP_CUDA), "cuda") == 0);
}

TEST(test_absent_device_is_a_named_error) {
  fsdp_clear_error();
  EXPECT(fsdp_backend_for(FSDP_CUDA) == NULL);
  EXPECT(error_has("device cuda has no backend loaded"));
  int64_t shape[1] = {4};
  fsdp_clear_error();
  EXPECT(fsdp_empty(1, shape, FSDP_F32, FSDP_CUDA) == NULL);
  EXPECT(error_has("device cuda has no backend loaded"));
}

TEST(test_incomplete_tables_are_refused) {
  fsdp_backend b = *fsdp_backend_for(FSDP_CPU);
  b.name = "broken";
  b.copy = NULL;
  EXPECT(fsdp_backend_register(FSDP_CUDA, &b) == -1);
  EXPECT(error_has("backend broken: device function 3"));
  b = *fsdp_backend_for(FSDP_CPU);
  b.name = "broken";
  b.nn = NULL;
  EXPECT(fsdp_backend_register(FSDP_CUDA, &b) == -1);
  EXPECT(error_has("backend broken: no nn kernel table"));
  fsdp_elem_kernels elem = *fsdp_backend_for(FSDP_CPU)->elem;
  elem.axpy = NULL;
  b = *fsdp_backend_for(FSDP_CPU);
  b.name = "broken";
  b.elem = &elem;
  EXPECT(fsdp_backend_register(FSDP_CUDA, &b) == -1);
  EXPECT(error_has("backend broken: elem kernel 3"));  // axpy, the fourth entry
  EXPECT(fsdp_backend_register(FSDP_CPU, fsdp_backend_for(FSDP_CPU)) == -1);
  EXPECT(error_has("device cpu already has the backend cpu"));
}

// a second device whose table is the CPU's: tensors there compute through that table, and
// mixing the two devices is an error that names both
static fsdp_backend g_twin;
TEST(test_ops_run_through_the_device_table) {
  g_twin = *fsdp_backend_for(FSDP_CPU);
  g_twin.name = "twin";
  EXPECT(fsdp_backend_register(FSDP_CUDA, &g_twin) == 0);
  int64_t shape[2] = {2, 3};
  fsdp_tensor* a = fsdp_full(2, shape, 1.5, FSDP_F32, FSDP_CUDA);
  fsdp_tensor* b = fsdp_full(2, shape, 2.0, FSDP_F32, FSDP_CUDA);
  EXPECT(a && b && fsdp_tensor_device(a) == FSDP_CUDA);
  fsdp_tensor* c = fsdp_mul(a, b);
  fsdp_tensor* s = c ? fsdp_sum(c, 0, NULL, 0) : NULL;
  double v = 0;
  EXPECT(s && fsdp_tensor_device(s) == FSDP_CUDA && fsdp_tensor_item(s, &v) == 0 && v == 18.0);
  fsdp_tensor* h = fsdp_full(2, shape, 1.0, FSDP_F32, FSDP_CPU);
  fsdp_clear_error();
  EXPECT(fsdp_add(a, h) == NULL);
  EXPECT(error_has("add: tensors on different devices ((2, 3) on cuda, (2, 3) on cpu)"));
  fsdp_tensor_release(h);
  fsdp_tensor_release(s);
  fsdp_tensor_release(c);
  fsdp_tensor_release(b);
  fsdp_tensor_release(a);
}

// gemm_bf16_many against a double-precision product of the same bfloat16 values, for each
// transposition, padded row strides, alpha and beta, two GEMMs in one call: within float32
// summation error (a bfloat16 accumulation would miss by 2^-9 of the sums)
static uint16_t bf16_of(int64_t i, int salt) { return fsdp_f32_to_bf16(sinf((float)(i * 7 + salt)) * 2.0f); }
TEST(test_gemm_bf16_matches_double) {
  const fsdp_linalg_kernels* k = fsdp_backend_for(FSDP_CPU)->linalg;
  enum { M = 37, N = 29, K = 300, PAD = 3 };
  static uint16_t A[2][K * (M + PAD)], B[2][K * (N + PAD)];
  static float C[2][M * (N + PAD)];
  for (int t = 0; t < 4; t++) {
    int ta = t & 1, tb = t >> 1;
    int64_t lda = (ta ? M : K) + PAD, ldb = (tb ? K : N) + PAD, ldc = N + PAD;
    fsdp_gemm_bf16_args g[2];
    for (int q = 0; q < 2; q++) {
      for (int64_t i = 0; i < K * (M + PAD); i++) A[q][i] = bf16_of(i, q + t);
      for (int64_t i = 0; i < K * (N + PAD); i++) B[q][i] = bf16_of(i, 100 + q + t);
      for (int64_t i = 0; i < M * ldc; i++) C[q][i] = 0.5f;
      g[q] = (fsdp_gemm_bf16_args){ta, tb, M, N, K, q ? 0.5f : 1.0f, A[q], lda, B[q], ldb, q ? 1.0f : 0.0f, C[q], ldc};
    }
    EXPECT(k->gemm_bf16_many(2, g) == 0);
    double worst = 0;
    for (int q = 0; q < 2; q++)
      for (int64_t i = 0; i < M; i++)
        for (int64_t j = 0; j < N; j++) {
          double sum = 0, mag = 0;
          for (int64_t l = 0; l < K; l++) {
            double a = fsdp_bf16_to_f32(ta ? A[q][l * lda + i] : A[q][i * lda + l]);
            double b = fsdp_bf16_to_f32(tb ? B[q][j * ldb + l] : B[q][l * ldb + j]);
            sum += a * b;
            mag += fabs(a * b);
          }
          double want = g[q].alpha * sum + g[q].beta * 0.5, err = fabs(C[q][i * ldc + j] - want) / (mag + 1);
          if (err > worst) worst = err;
        }
    EXPECT(worst < 1e-5);
  }
}

int main(void) {
  RUN(test_cpu_registered_and_complete);
  RUN(test_absent_device_is_a_named_error);
  RUN(test_incomplete_tables_are_refused);
  RUN(test_ops_run_through_the_device_table);
  RUN(test_gemm_bf16_matches_double);
  fsdp_memory_empty_cache();
  ctest_expect_no_leaks();
  return ctest_summary("test_backend");
}
