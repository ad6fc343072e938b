/*
 * ctest.h -- a minimal C unit-test harness. Each test file defines tests with TEST(name) and a
 * main() that calls RUN(name) for each, then returns ctest_summary(). Prints "N passed, N failed".
 */
#ifndef CTEST_H
#define CTEST_H
#include <math.h>
#include <stdio.h>
#include "fsdp.h"

static int ctest_pass, ctest_fail, ctest_cur_failed;
#define TEST(name) static void name(void)
#define RUN(name)                 \
  do {                            \
    ctest_cur_failed = 0;         \
    name();                       \
    if (ctest_cur_failed) {       \
      ctest_fail++;               \
      printf("FAIL %s\n", #name); \
    } else ctest_pass++;          \
  } while (0)
#define EXPECT(cond)                                                                                   \
  do {                                                                                                 \
    if (!(cond)) {                                                                                     \
      printf("  %s:%d: expected %s (last error: %s)\n", __FILE__, __LINE__, #cond, fsdp_last_error()); \
      ctest_cur_failed = 1;                                                                            \
    }                                                                                                  \
  } while (0)
#define EXPECT_NEAR(a, b, tol)                                                       \
  do {                                                                               \
    double a_ = (a), b_ = (b);                                                       \
    if (!(fabs(a_ - b_) <= (tol))) {                                                 \
      printf("  %s:%d: %s = %.9g, expected %.9g\n", __FILE__, __LINE__, #a, a_, b_); \
      ctest_cur_failed = 1;                                                          \
    }                                                                                \
  } while (0)
// counts a failure for every memory category that still holds bytes (call at the end of main)
static inline void ctest_expect_no_leaks(void) {
  int64_t cur[FSDP_MEM_NCAT];
  fsdp_memory_stats(cur, NULL);
  for (int c = 0; c < FSDP_MEM_NCAT; c++)
    if (cur[c] != 0) {
      printf("leak: category %d still holds %lld bytes\n", c, (long long)cur[c]);
      ctest_fail++;
    }
}
static int ctest_summary(const char* file) {
  printf("%s: %d passed, %d failed\n", file, ctest_pass, ctest_fail);
  return ctest_fail ? 1 : 0;
}
#endif
