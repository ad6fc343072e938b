/*
 * tsan_probe.c -- two threads train independent models at once (`make tsan-check` runs it built
 * with ThreadSanitizer). Each thread seeds its own generator, builds a small MLP, trains it with
 * dropout, a hook-free backward and fused SGD, and records its losses. Both must equal, bit for
 * bit, the same training run alone on the main thread first; the memory counters must end at 0.
 * ThreadSanitizer reports any data race in the core; the process then exits non-zero.
 */
#include <pthread.h>
#include <string.h>

#include "ctest.h"

#define STEPS 12
#define B 16
#define IN 32
#define HID 64
#define OUT 10

typedef struct {
  double losses[STEPS];
  int failed;
} run_result;

// one SGD-with-momentum step for every parameter (momentum buffers start from the gradient)
static int sgd(fsdp_tensor** params, fsdp_tensor** bufs, int n, int first) {
  for (int i = 0; i < n; i++) {
    fsdp_tensor* g = fsdp_tensor_grad(params[i]);
    if (!g) return -1;
    int rc = fsdp_sgd_step(params[i], g, bufs[i], 0.05, 0.9, 0, 0, 0, first, 0);
    fsdp_tensor_release(g);
    if (rc || fsdp_tensor_set_grad(params[i], NULL)) return -1;
  }
  return 0;
}

// the whole training run of one thread: seed, model, data, STEPS steps
static void train(run_result* r) {
  fsdp_manual_seed(7);
  int64_t w1s[2] = {HID, IN}, b1s[1] = {HID}, w2s[2] = {OUT, HID}, b2s[1] = {OUT}, xs[2] = {B, IN}, ys[1] = {B};
  fsdp_tensor* params[4] = {fsdp_randn(2, w1s, 0, 0.2), fsdp_randn(1, b1s, 0, 0.1), fsdp_randn(2, w2s, 0, 0.2),
                            fsdp_randn(1, b2s, 0, 0.1)};
  fsdp_tensor* bufs[4] = {fsdp_empty(2, w1s, FSDP_F32, FSDP_CPU), fsdp_empty(1, b1s, FSDP_F32, FSDP_CPU),
                          fsdp_empty(2, w2s, FSDP_F32, FSDP_CPU), fsdp_empty(1, b2s, FSDP_F32, FSDP_CPU)};
  for (int i = 0; i < 4; i++) fsdp_tensor_set_requires_grad(params[i], 1);
  fsdp_tensor* x = fsdp_randn(2, xs, 0, 1);
  fsdp_tensor* y = fsdp_randint(0, OUT, 1, ys);
  for (int s = 0; s < STEPS && !r->failed; s++) {
    fsdp_tensor* h = fsdp_linear(x, params[0], params[1]);
    fsdp_tensor* a = h ? fsdp_relu(h) : NULL;
    fsdp_tensor* d = a ? fsdp_dropout(a, 0.1, 1) : NULL;
    fsdp_tensor* o = d ? fsdp_linear(d, params[2], params[3]) : NULL;
    fsdp_tensor* loss = o ? fsdp_cross_entropy(o, y, -100, 0) : NULL;
    if (!loss || fsdp_tensor_item(loss, &r->losses[s]) || fsdp_backward(loss, NULL, 0) || sgd(params, bufs, 4, s == 0))
      r->failed = 1;
    fsdp_tensor_release(loss);
    fsdp_tensor_release(o);
    fsdp_tensor_release(d);
    fsdp_tensor_release(a);
    fsdp_tensor_release(h);
  }
  for (int i = 0; i < 4; i++) {
    fsdp_tensor_release(params[i]);
    fsdp_tensor_release(bufs[i]);
  }
  fsdp_tensor_release(x);
  fsdp_tensor_release(y);
}

static void* thread_main(void* arg) {
  train(arg);
  return NULL;
}

TEST(test_two_threads_train_like_one) {
  run_result alone = {0}, t1 = {0}, t2 = {0};
  train(&alone);
  EXPECT(!alone.failed && alone.losses[STEPS - 1] < alone.losses[0]);
  pthread_t a, b;
  EXPECT(pthread_create(&a, NULL, thread_main, &t1) == 0);
  EXPECT(pthread_create(&b, NULL, thread_main, &t2) == 0);
  pthread_join(a, NULL);
  pthread_join(b, NULL);
  EXPECT(!t1.failed && !t2.failed);
  EXPECT(memcmp(alone.losses, t1.losses, sizeof alone.losses) == 0);
  EXPECT(memcmp(alone.losses, t2.losses, sizeof alone.losses) == 0);
  printf("  losses alone %.6f -> %.6f; thread 1 %.6f -> %.6f; thread 2 %.6f -> %.6f\n", alone.losses[0],
         alone.losses[STEPS - 1], t1.losses[0], t1.losses[STEPS - 1], t2.losses[0], t2.losses[STEPS - 1]);
}

int main(void) {
  RUN(test_two_threads_train_like_one);
  fsdp_memory_empty_cache();
  ctest_expect_no_leaks();
  return ctest_summary("tsan_probe");
}
