/*
 * test_comm.c -- the communicator with the "self" backend (one rank): every collective's value,
 * async handles waited out of order, non-contiguous tensors, stats, argument errors, finalize
 * and re-init, calls from a second thread (refused, naming both threads). Multi-rank behaviour is tested by tests/fsdp/comm_spec.lua through bin/fsdprun.
 * Run under valgrind by `make memcheck`.
 */
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "ctest.h"

static fsdp_tensor* vec(int64_t n, int dtype, double start) {
  double* v = malloc(n * sizeof(double));
  for (int64_t i = 0; i < n; i++) v[i] = start + i;
  int64_t shape[1] = {n};
  fsdp_tensor* t = fsdp_from_doubles(1, shape, dtype, v);
  free(v);
  return t;
}

static double at(fsdp_tensor* t, int64_t i) {
  int64_t n = fsdp_tensor_numel(t);
  double* v = malloc(n * sizeof(double));
  fsdp_tensor_to_doubles(t, v);
  double x = v[i];
  free(v);
  return x;
}

TEST(test_init_self) {
  EXPECT(fsdp_comm_init("nccl9") != 0);
  EXPECT(strstr(fsdp_last_error(), "unknown backend 'nccl9'") != NULL);
  setenv("FSDP_MPI_LIB", "/nonexistent/libfsdp_mpi.so", 1);
  EXPECT(fsdp_comm_init("mpi") != 0);
  EXPECT(strstr(fsdp_last_error(), "cannot load the mpi backend") != NULL);
  unsetenv("FSDP_MPI_LIB");
  EXPECT(fsdp_comm_is_initialized() == 0);
  EXPECT(fsdp_comm_init("self") == 0);
  EXPECT(fsdp_comm_is_initialized() == 1);
  EXPECT(fsdp_comm_rank() == 0);
  EXPECT(fsdp_comm_world_size() == 1);
  EXPECT(strcmp(fsdp_comm_backend_name(), "self") == 0);
  EXPECT(fsdp_comm_init(NULL) == 0);   // idempotent
  EXPECT(fsdp_comm_init("mpi") != 0);  // cannot switch
  EXPECT(strstr(fsdp_last_error(), "already initialized with backend 'self'") != NULL);
}

TEST(test_collectives_values) {
  fsdp_comm_reset_stats();
  for (int dt = 0; dt < FSDP_NDTYPES; dt++) {  // all_gather and broadcast move any dtype
    int is_bool = dt == FSDP_BOOL;             // bool: 0, 1, 1, 1, 1 (from 0, 1, 2, 3, 4)
    fsdp_tensor* in = vec(5, dt, is_bool ? 0 : 1);
    int64_t shape[1] = {5};
    fsdp_tensor* out = fsdp_full(1, shape, 0, dt, FSDP_CPU);
    fsdp_work* w = fsdp_all_gather(out, in, "ag");
    EXPECT(w && fsdp_work_wait(w) == 0);
    fsdp_work_free(w);
    EXPECT_NEAR(at(out, 0), is_bool ? 0 : 1, 0);
    EXPECT_NEAR(at(out, 4), is_bool ? 1 : 5, 0);
    w = fsdp_broadcast(in, 0, "bc");
    EXPECT(w && fsdp_work_wait(w) == 0);
    fsdp_work_free(w);
    EXPECT_NEAR(at(in, 3), is_bool ? 1 : 4, 0);
    fsdp_tensor_release(in);
    fsdp_tensor_release(out);
  }
  fsdp_tensor* x = vec(6, FSDP_F32, -2);
  int64_t shape[1] = {6};
  fsdp_tensor* y = fsdp_full(1, shape, 0, FSDP_F32, FSDP_CPU);
  for (int op = 0; op < 3; op++) {  // sum, avg and max over one rank are the identity
    fsdp_work* w = fsdp_reduce_scatter(y, x, op, "rs");
    EXPECT(w && fsdp_work_wait(w) == 0);
    fsdp_work_free(w);
    EXPECT_NEAR(at(y, 5), 3, 0);
    w = fsdp_all_reduce(x, op, "ar");
    EXPECT(w && fsdp_work_wait(w) == 0);
    fsdp_work_free(w);
    EXPECT_NEAR(at(x, 0), -2, 0);
  }
  EXPECT(fsdp_barrier() == 0);
  int64_t counts[FSDP_NCOLL], bytes[FSDP_NCOLL];
  fsdp_comm_stats(counts, bytes);
  EXPECT(counts[FSDP_COLL_ALL_GATHER] == FSDP_NDTYPES);
  EXPECT(bytes[FSDP_COLL_ALL_GATHER] == 5 * (4 + 8 + 2 + 2 + 1));  // f32, i64, bf16, f16, bool
  EXPECT(counts[FSDP_COLL_BROADCAST] == FSDP_NDTYPES);
  EXPECT(counts[FSDP_COLL_REDUCE_SCATTER] == 3 && bytes[FSDP_COLL_REDUCE_SCATTER] == 3 * 24);
  EXPECT(counts[FSDP_COLL_ALL_REDUCE] == 3 && bytes[FSDP_COLL_ALL_REDUCE] == 3 * 24);
  EXPECT(counts[FSDP_COLL_BARRIER] == 1 && bytes[FSDP_COLL_BARRIER] == 0);
  fsdp_comm_reset_stats();
  fsdp_comm_stats(counts, NULL);
  EXPECT(counts[FSDP_COLL_ALL_GATHER] == 0);
  fsdp_tensor_release(x);
  fsdp_tensor_release(y);
}

TEST(test_async_out_of_order_and_noncontiguous) {
  enum { K = 8 };
  fsdp_tensor *ins[K], *outs[K];
  fsdp_work* ws[K];
  int64_t shape[1] = {1000};
  for (int k = 0; k < K; k++) {
    ins[k] = vec(1000, FSDP_F32, k * 1000);
    outs[k] = fsdp_full(1, shape, -1, FSDP_F32, FSDP_CPU);
    ws[k] = fsdp_all_gather(outs[k], ins[k], "layer");
    EXPECT(ws[k] != NULL);
  }
  for (int k = K - 1; k >= 0; k--) {  // waiting in any order is fine; they ran in issue order
    EXPECT(fsdp_work_wait(ws[k]) == 0);
    EXPECT(fsdp_work_test(ws[k]) == 1);
    EXPECT_NEAR(at(outs[k], 999), k * 1000 + 999, 0);
  }
  for (int k = 0; k < K; k++) {
    fsdp_work_free(ws[k]);
    fsdp_tensor_release(ins[k]);
    fsdp_tensor_release(outs[k]);
  }
  fsdp_work_free(fsdp_barrier_async("freed without wait"));  // free waits by itself

  // transposed (non-contiguous) source and destination: values land in logical order
  double v[6] = {1, 2, 3, 4, 5, 6};
  int64_t s23[2] = {2, 3};
  fsdp_tensor* a = fsdp_from_doubles(2, s23, FSDP_F32, v);
  fsdp_tensor* at_ = fsdp_transpose(a, 0, 1);  // (3, 2): 1 4 2 5 3 6
  int64_t s32[2] = {3, 2};
  fsdp_tensor* b = fsdp_full(2, s23, 0, FSDP_F32, FSDP_CPU);
  fsdp_tensor* bt = fsdp_transpose(b, 0, 1);  // (3, 2) view of b
  (void)s32;
  fsdp_work* w = fsdp_all_gather(bt, at_, "t");
  EXPECT(w && fsdp_work_wait(w) == 0);
  fsdp_work_free(w);
  EXPECT_NEAR(at(bt, 1), 4, 0);  // bt == at_
  EXPECT_NEAR(at(b, 1), 2, 0);   // so b == a
  w = fsdp_all_reduce(at_, FSDP_REDUCE_SUM, "t");
  EXPECT(w && fsdp_work_wait(w) == 0);
  fsdp_work_free(w);
  EXPECT_NEAR(at(at_, 1), 4, 0);
  fsdp_tensor_release(a);
  fsdp_tensor_release(at_);
  fsdp_tensor_release(b);
  fsdp_tensor_release(bt);
}

TEST(test_errors) {
  fsdp_tensor* x = vec(6, FSDP_F32, 0);
  fsdp_tensor* i = vec(6, FSDP_I64, 0);
  int64_t s4[1] = {4};
  fsdp_tensor* y = fsdp_full(1, s4, 0, FSDP_F32, FSDP_CPU);
  EXPECT(fsdp_all_gather(y, x, "bad") == NULL);
  EXPECT(strstr(fsdp_last_error(), "all_gather 'bad'") && strstr(fsdp_last_error(), "(4)") &&
         strstr(fsdp_last_error(), "(6)"));
  EXPECT(fsdp_all_gather(i, x, "dt") == NULL);
  EXPECT(strstr(fsdp_last_error(), "int64") && strstr(fsdp_last_error(), "float32"));
  EXPECT(fsdp_reduce_scatter(y, x, FSDP_REDUCE_SUM, "rs") == NULL);
  EXPECT(strstr(fsdp_last_error(), "reduce_scatter 'rs'") != NULL);
  EXPECT(fsdp_reduce_scatter(x, x, 7, "rs") == NULL);
  EXPECT(strstr(fsdp_last_error(), "unknown reduce op 7") != NULL);
  EXPECT(fsdp_all_reduce(i, FSDP_REDUCE_SUM, "ar") == NULL);
  EXPECT(strstr(fsdp_last_error(), "all_reduce") && strstr(fsdp_last_error(), "int64"));
  EXPECT(fsdp_broadcast(x, 1, "bc") == NULL);
  EXPECT(strstr(fsdp_last_error(), "root 1 is not a rank (world size 1") != NULL);
  EXPECT(fsdp_work_wait(NULL) != 0);
  // errors do not break the communicator: a correct collective still works
  fsdp_work* w = fsdp_all_reduce(x, FSDP_REDUCE_MAX, "ok");
  EXPECT(w && fsdp_work_wait(w) == 0);
  fsdp_work_free(w);
  EXPECT_NEAR(at(x, 5), 5, 0);
  fsdp_tensor_release(x);
  fsdp_tensor_release(i);
  fsdp_tensor_release(y);
}

// groups for hybrid sharding on one rank: a group of 1, collectives within it, refusals
TEST(test_groups) {
  fsdp_tensor* x = vec(6, FSDP_F32, 0);
  int64_t s6[1] = {6};
  fsdp_tensor* y = fsdp_full(1, s6, 0, FSDP_F32, FSDP_CPU);
  EXPECT(fsdp_all_gather_group(y, x, FSDP_GROUP_SHARD, "early") == NULL);
  EXPECT(strstr(fsdp_last_error(), "all_gather 'early': no groups made") != NULL);
  EXPECT(fsdp_comm_set_groups(2) != 0);
  EXPECT(strstr(fsdp_last_error(), "a shard group of 2 ranks does not divide the world of 1 ranks") != NULL);
  EXPECT(fsdp_comm_set_groups(1) == 0);
  EXPECT(fsdp_comm_set_groups(1) == 0);  // the same size again: nothing to do
  EXPECT(fsdp_comm_group_size(FSDP_GROUP_SHARD) == 1 && fsdp_comm_group_size(FSDP_GROUP_REPLICA) == 1);
  EXPECT(fsdp_comm_group_rank(FSDP_GROUP_SHARD) == 0 && fsdp_comm_group_rank(FSDP_GROUP_REPLICA) == 0);
  fsdp_work* w = fsdp_all_gather_group(y, x, FSDP_GROUP_SHARD, "ag");
  EXPECT(w && fsdp_work_wait(w) == 0);
  fsdp_work_free(w);
  EXPECT_NEAR(at(y, 4), 4, 0);
  w = fsdp_reduce_scatter_group(y, x, FSDP_REDUCE_AVG, FSDP_GROUP_HYBRID, "rs");
  EXPECT(w && fsdp_work_wait(w) == 0);
  fsdp_work_free(w);
  EXPECT_NEAR(at(y, 3), 3, 0);
  EXPECT(fsdp_reduce_scatter_group(y, x, FSDP_REDUCE_AVG, 9, "bad") == NULL);
  EXPECT(strstr(fsdp_last_error(), "reduce_scatter 'bad': unknown group 9") != NULL);
  fsdp_tensor_release(x);
  fsdp_tensor_release(y);
}

TEST(test_finalize_and_reinit) {
  fsdp_work* w = fsdp_barrier_async("pending at finalize");
  EXPECT(fsdp_comm_finalize() == 0);  // drains the queue first
  EXPECT(fsdp_work_test(w) == 1 && fsdp_work_wait(w) == 0);
  fsdp_work_free(w);
  EXPECT(fsdp_comm_is_initialized() == 0);
  EXPECT(fsdp_comm_finalize() == 0);  // idempotent
  fsdp_comm_set_timeout(5);
  fsdp_tensor* x = vec(3, FSDP_F32, 1);
  w = fsdp_all_reduce(x, FSDP_REDUCE_SUM, "auto-init");  // collectives initialize on demand
  EXPECT(w && fsdp_work_wait(w) == 0);
  fsdp_work_free(w);
  EXPECT(fsdp_comm_is_initialized() == 1 && strcmp(fsdp_comm_backend_name(), "self") == 0);
  fsdp_tensor_release(x);
  EXPECT(fsdp_comm_finalize() == 0);
}

// what a second thread sees when it uses the communicator the main thread initialized
typedef struct {
  fsdp_tensor* x;
  fsdp_work* main_work;
  int all_reduce_refused, wait_refused, finalize_refused;
  char msg[512];
} other_thread_result;

static void* other_thread(void* arg) {
  other_thread_result* r = arg;
  fsdp_work* w = fsdp_all_reduce(r->x, FSDP_REDUCE_SUM, "from another thread");
  r->all_reduce_refused = w == NULL;
  snprintf(r->msg, sizeof r->msg, "%s", fsdp_last_error());
  if (w) fsdp_work_free(w);
  r->wait_refused = fsdp_work_wait(r->main_work) != 0;
  r->finalize_refused = fsdp_comm_finalize() != 0;
  return NULL;
}

TEST(test_second_thread_refused) {
  EXPECT(fsdp_comm_init("self") == 0);
  other_thread_result r = {0};
  r.x = vec(3, FSDP_F32, 1);
  r.main_work = fsdp_barrier_async("main thread's");
  pthread_t t;
  EXPECT(pthread_create(&t, NULL, other_thread, &r) == 0);
  pthread_join(t, NULL);
  EXPECT(r.all_reduce_refused && r.wait_refused && r.finalize_refused);
  EXPECT(strstr(r.msg, "all_reduce 'from another thread': the communicator belongs to thread ") != NULL);
  EXPECT(strstr(r.msg, "but this call comes from thread ") != NULL);
  if (!strstr(r.msg, "belongs to thread")) printf("  message: %s\n", r.msg);
  EXPECT(fsdp_comm_is_initialized() == 1);  // the owner carries on
  EXPECT(fsdp_work_wait(r.main_work) == 0);
  fsdp_work_free(r.main_work);
  fsdp_work* w = fsdp_all_reduce(r.x, FSDP_REDUCE_SUM, "owner");
  EXPECT(w && fsdp_work_wait(w) == 0);
  fsdp_work_free(w);
  fsdp_tensor_release(r.x);
  EXPECT(fsdp_comm_finalize() == 0);
}

int main(void) {
  RUN(test_init_self);
  RUN(test_collectives_values);
  RUN(test_async_out_of_order_and_noncontiguous);
  RUN(test_errors);
  RUN(test_groups);
  RUN(test_finalize_and_reinit);
  RUN(test_second_thread_refused);
  return ctest_summary("test_comm");
}
