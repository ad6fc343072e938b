/*
 * parallel/comm_standin.c -- the stand-in communicator: a TEST DOUBLE of NCCL, a device data plane
 * (parallel/comm.h, fsdp_comm_plane) chosen by FSDP_DEVICE_COMM=standin; the tests run it on the test
 * double of a GPU (backend/testdev), whose streams are threads. Users never need it.
 *
 * It keeps NCCL's contract and nothing more, so code that leans on anything else breaks here:
 * each collective is queued on one of two streams (gathers, reductions), starts only after its
 * `ready` event and has its result only once its `done` event completed. It is built only of what
 * every device table offers (stream waits and events, copies, memsets and host functions queued
 * on a stream). On the stream, the collective
 *   1. sleeps a random while (up to FSDP_STANDIN_DELAY_US, default 2000 microseconds), then copies
 *      its input from device memory into a host buffer,
 *   2. poisons the output (0xFF bytes: NaN floats), as a collective in progress leaves it
 *      half-written -- a reader that did not wait sees NaN, never a stale but plausible value,
 * the communication thread moves the host buffers with the host backend (MPI, with its timeouts:
 * the control plane of the real NCCL plane too), and back on the stream the result
 *   3. arrives after another random sleep, and `done` completes.
 * So completions come late and out of order between the two streams and across ranks (each rank
 * draws its own delays, seeded by FSDP_STANDIN_SEED and its rank). The communication thread waits
 * for step 1 of its own collective (the host buffer must hold the input before MPI moves it);
 * that wait is the double's: the real plane never waits for the device.
 */
#include "parallel/comm.h"

#include "core/backend.h"

#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

enum { GATHERS = 0, REDUCTIONS = 1 };

typedef struct sd_coll {
  void* dev_out;
  const void* dev_in;
  size_t in_bytes, out_bytes;
  void *host_in, *host_out;
  unsigned delay_us[2];
  pthread_mutex_t mu;
  pthread_cond_t cv;
  int captured;
} sd_coll;

static struct {
  const fsdp_comm_backend* host;
  const fsdp_backend* dev;
  void* streams[2];
  int rank, size;
  unsigned max_delay_us;
  uint64_t rng;
  atomic_int in_flight;
} S;

static unsigned draw_delay(void) {  // xorshift64*, on the communication thread only
  S.rng ^= S.rng >> 12;
  S.rng ^= S.rng << 25;
  S.rng ^= S.rng >> 27;
  uint64_t r = S.rng * 2685821657736338717ull;
  return S.max_delay_us ? (unsigned)((r >> 33) % (S.max_delay_us + 1)) : 0;
}

static void sleep_us(unsigned us) {
  struct timespec ts = {us / 1000000, (long)(us % 1000000) * 1000};
  while (nanosleep(&ts, &ts) != 0) {}
}

static void coll_free(void* arg) {  // (also the last host function of a collective's stream work)
  sd_coll* c = arg;
  free(c->host_in);
  free(c->host_out);
  pthread_mutex_destroy(&c->mu);
  pthread_cond_destroy(&c->cv);
  free(c);
  atomic_fetch_sub(&S.in_flight, 1);
}

// host functions on the stream
static void pause_start(void* arg) { sleep_us(((sd_coll*)arg)->delay_us[0]); }
static void pause_result(void* arg) { sleep_us(((sd_coll*)arg)->delay_us[1]); }
static void captured(void* arg) {
  sd_coll* c = arg;
  pthread_mutex_lock(&c->mu);
  c->captured = 1;
  pthread_cond_signal(&c->cv);
  pthread_mutex_unlock(&c->mu);
}

// queues steps 1-2 on the kind's stream and waits for them (the stream waits only for `ready`,
// recorded on the compute stream, which the GPU double runs on the host: it has completed)
static sd_coll* begin(int stream, void* out, const void* in, size_t in_bytes, size_t out_bytes, void* ready,
                      char* err) {
  sd_coll* c = calloc(1, sizeof *c);
  if (c) {
    c->host_in = malloc(in_bytes ? in_bytes : 1);
    c->host_out = malloc(out_bytes ? out_bytes : 1);
  }
  if (!c || !c->host_in || !c->host_out) {
    if (c) free(c->host_in), free(c->host_out), free(c);
    snprintf(err, FSDP_COMM_ERRLEN, "stand-in: out of memory for %zu + %zu staging bytes", in_bytes, out_bytes);
    return NULL;
  }
  c->dev_out = out;
  c->dev_in = in;
  c->in_bytes = in_bytes;
  c->out_bytes = out_bytes;
  c->delay_us[0] = draw_delay();
  c->delay_us[1] = draw_delay();
  pthread_mutex_init(&c->mu, NULL);
  pthread_cond_init(&c->cv, NULL);
  atomic_fetch_add(&S.in_flight, 1);
  void* s = S.streams[stream];
  S.dev->stream_wait(s, ready);
  S.dev->launch_host(s, pause_start, c);
  int rc = S.dev->copy_async(c->host_in, in, in_bytes, FSDP_COPY_D2H, s);
  S.dev->memset_async(out, 0xff, out_bytes, s);
  S.dev->launch_host(s, captured, c);
  pthread_mutex_lock(&c->mu);
  while (!c->captured) pthread_cond_wait(&c->cv, &c->mu);
  pthread_mutex_unlock(&c->mu);
  if (rc) {
    snprintf(err, FSDP_COMM_ERRLEN, "stand-in: cannot queue the copy of its input");
    coll_free(c);
    return NULL;
  }
  return c;
}

// after the host backend moved the bytes (rc 0) queues step 3 and `done`; after it failed, drops
// the collective (its `done` never completes: comm.c does not wait for a failed collective)
static int finish(int stream, sd_coll* c, int rc, void* done) {
  if (rc) {
    coll_free(c);
    return -1;
  }
  void* s = S.streams[stream];
  S.dev->launch_host(s, pause_result, c);
  rc = S.dev->copy_async(c->dev_out, c->host_out, c->out_bytes, FSDP_COPY_H2D, s);
  S.dev->launch_host(s, coll_free, c);
  S.dev->event_record(done, s);
  return rc;
}

static int sd_bootstrap(const fsdp_comm_backend* host, int rank, int size, char* digest, char* err) {
  (void)host, (void)rank, (void)size, (void)err;  // nothing to connect: it rides on the host backend
  snprintf(digest, 17, "%016x", 0);
  return 0;
}

static int sd_init(const fsdp_comm_backend* host, const fsdp_backend* dev, int device_index, int rank, int size,
                   double timeout_s, char* err) {
  (void)timeout_s, (void)device_index;
  S.host = host;
  S.dev = dev;
  S.rank = rank;
  S.size = size;
  const char* d = getenv("FSDP_STANDIN_DELAY_US");
  S.max_delay_us = d && *d ? (unsigned)atoi(d) : 2000;
  const char* seed = getenv("FSDP_STANDIN_SEED");
  S.rng = 0x9E3779B97F4A7C15ull * (uint64_t)((seed && *seed ? atoll(seed) : 1) + 7919 * (rank + 1));
  for (int i = 0; i < 2; i++) {
    S.streams[i] = dev->stream_new();
    if (!S.streams[i]) {
      snprintf(err, FSDP_COMM_ERRLEN, "stand-in: cannot start its streams");
      return -1;
    }
  }
  return 0;
}

static void sd_finalize(int broken) {
  (void)broken;  // what is queued only delivers (never waits for another rank): let it finish
  for (int i = 0; i < 2; i++) {
    if (S.streams[i]) S.dev->stream_free(S.streams[i]);
    S.streams[i] = NULL;
  }
}

static int sd_all_gather(void* out, const void* in, size_t bytes, void* ready, void* done, char* err) {
  sd_coll* c = begin(GATHERS, out, in, bytes, bytes * (size_t)S.size, ready, err);
  if (!c) return -1;
  return finish(GATHERS, c, S.host->all_gather(c->host_out, c->host_in, bytes, FSDP_GROUP_WORLD, err), done);
}

// the plane contract (comm.h): max never comes here, as it never reaches NCCL
static int refuse_max(int op, const char* kind, char* err) {
  if (op != FSDP_REDUCE_MAX) return 0;
  snprintf(err, FSDP_COMM_ERRLEN, "stand-in: %s by max reached a device plane (comm.c sends max through the host)",
           kind);
  return -1;
}

static int sd_reduce_scatter(float* out, const float* in, size_t n, int op, void* ready, void* done, char* err) {
  if (refuse_max(op, "reduce_scatter", err)) return -1;
  size_t b = n * sizeof(float);
  sd_coll* c = begin(REDUCTIONS, out, in, b * (size_t)S.size, b, ready, err);
  if (!c) return -1;
  int rc = S.host->reduce_scatter((float*)c->host_out, (const float*)c->host_in, n, op, 0, FSDP_GROUP_WORLD, err);
  return finish(REDUCTIONS, c, rc, done);
}

static int sd_all_reduce(float* buf, size_t n, int op, void* ready, void* done, char* err) {
  if (refuse_max(op, "all_reduce", err)) return -1;
  size_t b = n * sizeof(float);
  sd_coll* c = begin(REDUCTIONS, buf, buf, b, b, ready, err);
  if (!c) return -1;
  memcpy(c->host_out, c->host_in, b);
  return finish(REDUCTIONS, c, S.host->all_reduce((float*)c->host_out, n, op, FSDP_GROUP_WORLD, err), done);
}

static int sd_broadcast(void* buf, size_t bytes, int root, void* ready, void* done, char* err) {
  sd_coll* c = begin(GATHERS, buf, buf, bytes, bytes, ready, err);
  if (!c) return -1;
  memcpy(c->host_out, c->host_in, bytes);
  return finish(GATHERS, c, S.host->broadcast(c->host_out, bytes, root, err), done);
}

static int sd_progress(double timeout_s, char* err) {
  (void)timeout_s, (void)err;  // the host backend bounded every data move already
  return 0;
}
static int sd_in_flight(void) { return atomic_load(&S.in_flight); }

static const fsdp_comm_plane standin_plane = {
    FSDP_COMM_ABI, FSDP_PLANE_STANDIN, "standin",     sd_init,      sd_bootstrap, sd_finalize,
    sd_all_gather, sd_reduce_scatter,  sd_all_reduce, sd_broadcast, sd_progress,  sd_in_flight,
};

const fsdp_comm_plane* fsdp_comm_standin_plane(void) { return &standin_plane; }
