/*
 * test_core.c -- the C core without Lua: tensor lifetime, memory counters, engine events,
 * error reporting. Run under valgrind by `make memcheck`.
 */
#include <string.h>

#include "ctest.h"
#include "core/core.h"

static fsdp_tensor* vec(int n, const double* v, int requires_grad) {
  int64_t shape[1] = {n};
  fsdp_tensor* t = fsdp_from_doubles(1, shape, FSDP_F32, v);
  if (requires_grad) fsdp_tensor_set_requires_grad(t, 1);
  return t;
}

TEST(test_lifetime_and_memory) {
  int64_t cur0[FSDP_MEM_NCAT], cur[FSDP_MEM_NCAT];
  fsdp_memory_stats(cur0, NULL);
  int64_t shape[2] = {3, 5};
  fsdp_tensor* t = fsdp_full(2, shape, 2.0, FSDP_F32, FSDP_CPU);
  fsdp_memory_stats(cur, NULL);
  EXPECT(cur[FSDP_MEM_ACTIVATIONS] - cur0[FSDP_MEM_ACTIVATIONS] == 60);
  fsdp_tensor_set_mem_category(t, FSDP_MEM_PARAMS);
  fsdp_memory_stats(cur, NULL);
  EXPECT(cur[FSDP_MEM_PARAMS] - cur0[FSDP_MEM_PARAMS] == 60);
  EXPECT(cur[FSDP_MEM_ACTIVATIONS] == cur0[FSDP_MEM_ACTIVATIONS]);
  fsdp_tensor* v = fsdp_transpose(t, 0, 1);  // a view keeps the storage alive
  fsdp_tensor_release(t);
  EXPECT(fsdp_tensor_size(v, 0) == 5 && fsdp_tensor_stride(v, 0) == 1);
  fsdp_tensor_release(v);
  fsdp_memory_stats(cur, NULL);
  EXPECT(cur[FSDP_MEM_PARAMS] == cur0[FSDP_MEM_PARAMS]);
}

static int n_events, last_event, grad_ready;
static int count_events(int ev, fsdp_node* node, fsdp_tensor* t, void* ctx) {
  (void)node;
  (void)ctx;
  n_events++;
  last_event = ev;
  if (ev == FSDP_EV_GRAD_READY && t) grad_ready++;
  return 0;
}
static int callback_ran;
static int on_end(void* ctx) {
  callback_ran = *(int*)ctx;
  return 0;
}
static int queue_on_begin(int ev, fsdp_node* node, fsdp_tensor* t, void* ctx) {
  (void)node;
  (void)t;
  if (ev == FSDP_EV_BACKWARD_BEGIN) return fsdp_queue_callback(on_end, ctx);
  return 0;
}

TEST(test_backward_events_and_callback) {
  double xv[3] = {1, 2, 3}, wv[3] = {4, 5, 6};
  fsdp_tensor* x = vec(3, xv, 1);
  fsdp_tensor* w = vec(3, wv, 1);
  fsdp_tensor* y = fsdp_mul(x, w);           // (3)
  fsdp_tensor* s = fsdp_sum(y, 0, NULL, 0);  // ()
  int magic = 42;
  int64_t l1 = fsdp_autograd_add_listener(FSDP_EV_BACKWARD_BEGIN | FSDP_EV_GRAD_READY | FSDP_EV_BACKWARD_END,
                                          count_events, NULL);
  int64_t l2 = fsdp_autograd_add_listener(FSDP_EV_BACKWARD_BEGIN, queue_on_begin, &magic);
  EXPECT(fsdp_backward(s, NULL, 0) == 0);
  EXPECT(callback_ran == 42);
  EXPECT(grad_ready == 2);
  EXPECT(last_event == FSDP_EV_BACKWARD_END);
  EXPECT(n_events == 4);
  fsdp_autograd_remove_listener(l1);
  fsdp_autograd_remove_listener(l2);
  fsdp_tensor* gx = fsdp_tensor_grad(x);
  double out[3];
  fsdp_tensor_to_doubles(gx, out);
  EXPECT(out[0] == 4 && out[1] == 5 && out[2] == 6);
  int64_t cur[FSDP_MEM_NCAT];
  fsdp_memory_stats(cur, NULL);
  EXPECT(cur[FSDP_MEM_GRADS] == 2 * 3 * 4);
  // second backward through a freed graph is an error naming the node, not a crash
  EXPECT(fsdp_backward(s, NULL, 0) != 0);
  EXPECT(strstr(fsdp_last_error(), "second time") != NULL);
  fsdp_tensor_release(gx);
  fsdp_tensor_release(s);
  fsdp_tensor_release(y);
  fsdp_tensor_release(x);
  fsdp_tensor_release(w);
  fsdp_memory_stats(cur, NULL);
  EXPECT(cur[FSDP_MEM_GRADS] == 0);
}

// the unused hook: told once when the last saved view of an owned storage goes in backward (a
// linear releases its weight before building its weight gradient), never under retain_graph
static int n_unused;
static void* unused_owner;
static int count_unused(void* owner) {
  n_unused++;
  unused_owner = owner;
  return 0;
}
TEST(test_unused_hook_and_saved_refs) {
  double xv[6] = {1, 2, 3, 4, 5, 6}, wv[6] = {1, -1, 2, 0, 1, 3};
  int64_t xs[2] = {2, 3}, ws[2] = {2, 3};
  fsdp_tensor* x = fsdp_from_doubles(2, xs, FSDP_F32, xv);
  fsdp_tensor* w = fsdp_from_doubles(2, ws, FSDP_F32, wv);
  fsdp_tensor_set_requires_grad(w, 1);
  int owner_tag = 7;
  w->storage->owner = &owner_tag;  // as an FSDP unit owns its gathered buffer
  fsdp_set_unused_hook(count_unused);
  for (int retain = 1; retain >= 0; retain--) {
    n_unused = 0;
    fsdp_tensor* y = fsdp_linear(x, w, NULL);  // (2, 2)
    fsdp_tensor* s = fsdp_sum(y, 0, NULL, 0);
    EXPECT(w->storage->saved_refs == 1);
    EXPECT(fsdp_backward(s, NULL, retain) == 0);
    EXPECT(n_unused == (retain ? 0 : 1));
    EXPECT(w->storage->saved_refs == (retain ? 1 : 0));
    if (!retain) EXPECT(unused_owner == &owner_tag);
    fsdp_tensor_release(s);
    fsdp_tensor_release(y);
    EXPECT(w->storage->saved_refs == 0);  // the retained graph went with its output: nobody told
    EXPECT(n_unused == (retain ? 0 : 1));
  }
  // gw = gy^T x over both backwards (gy = 1): column sums of x, twice
  double gw[6];
  fsdp_tensor* g = fsdp_tensor_grad(w);
  fsdp_tensor_to_doubles(g, gw);
  EXPECT(gw[0] == 10 && gw[1] == 14 && gw[2] == 18 && gw[3] == 10 && gw[5] == 18);
  fsdp_set_unused_hook(NULL);
  w->storage->owner = NULL;
  fsdp_tensor_release(g);
  fsdp_tensor_release(x);
  fsdp_tensor_release(w);
}

TEST(test_errors_name_op_and_shapes) {
  double v[3] = {1, 2, 3};
  fsdp_tensor* a = vec(3, v, 0);
  fsdp_tensor* b = vec(2, v, 0);
  fsdp_tensor* c = fsdp_add(a, b);
  EXPECT(c == NULL);
  EXPECT(strstr(fsdp_last_error(), "add") && strstr(fsdp_last_error(), "(3)") && strstr(fsdp_last_error(), "(2)"));
  fsdp_tensor* ok = fsdp_add(a, a);  // still works afterwards
  double out[3];
  fsdp_tensor_to_doubles(ok, out);
  EXPECT(out[2] == 6);
  fsdp_tensor_release(ok);
  fsdp_tensor_release(a);
  fsdp_tensor_release(b);
}

int main(void) {
  RUN(test_lifetime_and_memory);
  RUN(test_backward_events_and_callback);
  RUN(test_unused_hook_and_saved_refs);
  RUN(test_errors_name_op_and_shapes);
  ctest_expect_no_leaks();
  return ctest_summary("test_core");
}
