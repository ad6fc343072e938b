/*
 * test_backend.c -- the backend registry and the device table: the CPU registers itself and is
 * complete, an absent device is a named error (also for allocation), an incomplete table is
 * refused, and a second device whose table is the CPU's runs ops device-independently (the op
 * layer reaches kernels only through the table of its tensors' device), and the GEMM on bfloat16
 * operands matches a double-precision product of the same values. Run under valgrind by
 * `make memcheck` (where oneDNN is held to AVX2, so the bfloat16 GEMM takes its float32 path).
 * Also the choice of the kernels' ISA copy (backend/cpu/cpu.h): the rule for every kind of CPU,
 * the AVX-512 one included, which this machine may not have, and that the installed tables are
 * those of the chosen copy.
 */
#include <string.h>

#include "ctest.h"
#include "core/core.h"  // the registry is internal: backends register from C, not through the API
#include "backend/cpu/cpu.h"

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

// the level for a CPU with (or without) x86-64-v3 and v4, under each FSDP_CPU_ISA: the CPU's widest,
// lowered (never raised) by a cap; an unknown cap lowers nothing (the Lua layer refuses it earlier)
TEST(test_isa_pick_rule) {
  static const struct {
    int v3, v4;
    const char* cap;
    int want;
  } cases[] = {
      {0, 0, NULL, FSDP_ISA_SSE2},        {1, 0, NULL, FSDP_ISA_AVX2},      {1, 1, NULL, FSDP_ISA_AVX512},
      {1, 1, "avx512f", FSDP_ISA_AVX512}, {1, 1, "avx2", FSDP_ISA_AVX2},    {1, 1, "sse2", FSDP_ISA_SSE2},
      {1, 0, "sse2", FSDP_ISA_SSE2},      {1, 0, "avx512f", FSDP_ISA_AVX2}, {0, 0, "avx2", FSDP_ISA_SSE2},
      {0, 0, "avx512f", FSDP_ISA_SSE2},   {1, 1, "avx3", FSDP_ISA_AVX512},  {0, 1, NULL, FSDP_ISA_SSE2},
  };
  for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
    int got = fsdp_cpu_isa_pick(cases[i].v3, cases[i].v4, cases[i].cap);
    if (got != cases[i].want)
      printf("  v3=%d v4=%d cap=%s: level %d, expected %d\n", cases[i].v3, cases[i].v4,
             cases[i].cap ? cases[i].cap : "(none)", got, cases[i].want);
    EXPECT(got == cases[i].want);
  }
}

// the three copies exist (the AVX-512 one is linked even where it cannot run), each says its level,
// and the CPU's device table holds the tables of the copy of this process's level
TEST(test_isa_copies_and_the_installed_one) {
  const fsdp_cpu_isa_kernels* copies[] = {&fsdp_cpu_isa_kernels_sse2, &fsdp_cpu_isa_kernels_avx2,
                                          &fsdp_cpu_isa_kernels_avx512};
  const char* names[] = {"sse2", "avx2+fma", "avx512f"};
  for (int l = 0; l < FSDP_ISA_LEVELS; l++) {
    EXPECT(copies[l]->level == l && strcmp(copies[l]->name, names[l]) == 0);
    EXPECT(copies[l]->elem && copies[l]->linalg && copies[l]->nn && copies[l]->optim && copies[l]->norm);
    for (int m = 0; m < l; m++) EXPECT(copies[l]->elem != copies[m]->elem && copies[l]->linalg != copies[m]->linalg);
  }
  const fsdp_cpu_isa_kernels* k = fsdp_cpu_kernels();
  const fsdp_backend* b = fsdp_backend_for(FSDP_CPU);
  EXPECT(k == copies[fsdp_cpu_isa_level()]);
  EXPECT(b->elem == k->elem && b->linalg == k->linalg && b->nn == k->nn && b->optim == k->optim && b->norm == k->norm);
  EXPECT(strcmp(fsdp_cpu_isa(), k->name) == 0);
}

int main(void) {
  RUN(test_cpu_registered_and_complete);
  RUN(test_absent_device_is_a_named_error);
  RUN(test_incomplete_tables_are_refused);
  RUN(test_ops_run_through_the_device_table);
  RUN(test_gemm_bf16_matches_double);
  RUN(test_isa_pick_rule);
  RUN(test_isa_copies_and_the_installed_one);
  fsdp_memory_empty_cache();
  ctest_expect_no_leaks();
  return ctest_summary("test_backend");
}
