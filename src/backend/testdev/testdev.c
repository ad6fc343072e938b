/*
 * backend/testdev/testdev.c -- a test double of a GPU, for machines without one: registered for
 * the "cuda" device by fsdp_testdev_install() (tests only; users never see it). It computes with
 * the CPU's kernels, but its memory is what a GPU's is to the host: out of reach. All of it lives
 * in one arena mapped PROT_NONE; the arena opens (read/write) only while one of this table's
 * entries runs -- a kernel, a memset, a copy -- and closes again after. So any code that reads or
 * writes a device tensor's bytes on the host instead of through the device table (an op peeking at
 * a value, a printer, a checkpoint writer) faults here, where on a real GPU it would read garbage
 * or crash. Freed blocks are poisoned (0xFF bytes: NaN floats, -1 integers) and new blocks start
 * poisoned, so a read of memory nobody wrote gives a wrong number, not a lucky zero.
 *
 * It is async (fsdp_backend.async), as a GPU: an index or target check that fails records its
 * deferred check id and the bad value; from then on its kernels are skipped (a GPU's sticky error),
 * and the next wait on the device -- synchronize, a copy to the host -- reports it and clears it.
 * It counts those waits (fsdp_testdev_syncs), so a spec can prove a step never waits. Its kernels
 * run on the caller's thread (the compute stream); the streams made by stream_new are threads
 * running their queues in order, with events between them as CUDA's (the stand-in communicator,
 * parallel/comm_standin.c, runs the collectives of a device data plane on them).
 *
 * The arena: FSDP_TESTDEV_MIB (default 1024) of address space, reserved, not committed; first-fit
 * over a sorted free list.
 */
#include "core/core.h"

#include <execinfo.h>
#include <pthread.h>
#include <stdatomic.h>
#include <signal.h>
#include <stdlib.h>
#include <sys/mman.h>
#include <unistd.h>

#define TD_FREE_MAX 8192

static char* g_arena;
static size_t g_arena_size;
static pthread_mutex_t g_lock = PTHREAD_MUTEX_INITIALIZER;
static int g_open;  // entries running (nested or on several threads): the arena is open while > 0
typedef struct {
  size_t off, size;
} td_block;
static td_block g_free[TD_FREE_MAX];  // sorted by offset, never adjacent (merged)
static int g_nfree;
static const fsdp_backend* g_cpu;
// the host's waits on the device, as a GPU would have them: copies to the host, synchronize, and
// the entries whose result the host reads (index and target checks, loss sums)
static _Atomic int64_t g_syncs;
// the first failed deferred check since the last wait (0: none), and its bad value
static _Atomic int g_fail_id;
static int64_t g_fail_value;
static void td_fail(int check, int64_t value) {
  int none = 0;
  if (atomic_compare_exchange_strong(&g_fail_id, &none, check)) g_fail_value = value;
}
// a wait on the device: counted, and a failed check is reported (0, or -1 with the error set)
static int td_wait(void) {
  atomic_fetch_add(&g_syncs, 1);
  int id = atomic_exchange(&g_fail_id, 0);
  return id ? fsdp_check_report(id, g_fail_value) : 0;
}

static void td_open(void) {
  pthread_mutex_lock(&g_lock);
  if (g_open++ == 0) mprotect(g_arena, g_arena_size, PROT_READ | PROT_WRITE);
  pthread_mutex_unlock(&g_lock);
}
static void td_close(void) {
  pthread_mutex_lock(&g_lock);
  if (--g_open == 0) mprotect(g_arena, g_arena_size, PROT_NONE);
  pthread_mutex_unlock(&g_lock);
}

// ---- memory -------------------------------------------------------------------------------------------
static void* td_alloc(size_t nbytes) {
  nbytes = (nbytes + 63) & ~(size_t)63;
  char* p = NULL;
  pthread_mutex_lock(&g_lock);
  for (int i = 0; i < g_nfree; i++)
    if (g_free[i].size >= nbytes) {
      p = g_arena + g_free[i].off;
      g_free[i].off += nbytes;
      g_free[i].size -= nbytes;
      if (!g_free[i].size) {
        memmove(&g_free[i], &g_free[i + 1], (g_nfree - i - 1) * sizeof *g_free);
        g_nfree--;
      }
      break;
    }
  pthread_mutex_unlock(&g_lock);
  if (p) {
    td_open();
    memset(p, 0xff, nbytes);  // fresh memory holds no zeros to rely on
    td_close();
  }
  return p;
}
static void td_free(void* ptr, size_t nbytes) {
  nbytes = (nbytes + 63) & ~(size_t)63;
  td_open();
  memset(ptr, 0xff, nbytes);  // poison: a late reader gets NaN
  td_close();
  size_t off = (size_t)((char*)ptr - g_arena);
  pthread_mutex_lock(&g_lock);
  int i = 0;
  while (i < g_nfree && g_free[i].off < off) i++;
  int merge_prev = i > 0 && g_free[i - 1].off + g_free[i - 1].size == off;
  int merge_next = i < g_nfree && off + nbytes == g_free[i].off;
  if (merge_prev && merge_next) {
    g_free[i - 1].size += nbytes + g_free[i].size;
    memmove(&g_free[i], &g_free[i + 1], (g_nfree - i - 1) * sizeof *g_free);
    g_nfree--;
  } else if (merge_prev) {
    g_free[i - 1].size += nbytes;
  } else if (merge_next) {
    g_free[i].off = off;
    g_free[i].size += nbytes;
  } else if (g_nfree < TD_FREE_MAX) {
    memmove(&g_free[i + 1], &g_free[i], (g_nfree - i) * sizeof *g_free);
    g_free[i] = (td_block){off, nbytes};
    g_nfree++;
  }  // (a full list leaks the block: tests never get near 8192 holes)
  pthread_mutex_unlock(&g_lock);
}
static void td_memset(void* p, int byte, size_t nbytes) {
  td_open();
  memset(p, byte, nbytes);
  td_close();
}
static int td_copy(void* dst, const void* src, size_t nbytes, fsdp_copy_kind kind) {
  if (kind == FSDP_COPY_D2H && td_wait()) return -1;
  td_open();
  if (nbytes) memcpy(dst, src, nbytes);
  td_close();
  return 0;
}

// ---- ordering: streams and events ------------------------------------------------------------------
// Kernels and copies run as they are issued, on the caller's thread: that is the compute stream
// (a NULL stream), and an event recorded on it completes at once. A stream made by stream_new is a
// worker thread running its queue in order -- the streams of the communication planes (the stand-
// in communicator below runs on them). An event counts its records and completions: a wait for it
// waits for the last record made before the wait was issued, as cudaStreamWaitEvent does. A wait
// issued on the compute stream blocks the caller until then: the compute stream's later work
// (kernels, copies) runs after it, on the host.
typedef struct td_event {
  pthread_mutex_t mu;
  pthread_cond_t cv;
  uint64_t recorded, completed;
  int refs;  // its owner's (until event_free) and one per queued op: freed with pending work, as CUDA allows
} td_event;
typedef struct td_op {
  int kind;  // 0: complete `ev` up to `gen`, 1: wait until `ev` completed `gen`, 2: run fn(arg)
  td_event* ev;
  uint64_t gen;
  void (*fn)(void*);
  void* arg;
  struct td_op* next;
} td_op;
typedef struct td_stream {
  pthread_t thread;
  pthread_mutex_t mu;
  pthread_cond_t cv;
  td_op *head, *tail;
  int quit;
} td_stream;

static void td_event_unref(td_event* e) {
  pthread_mutex_lock(&e->mu);
  int last = --e->refs == 0;
  pthread_mutex_unlock(&e->mu);
  if (!last) return;
  pthread_mutex_destroy(&e->mu);
  pthread_cond_destroy(&e->cv);
  free(e);
}
static void td_event_complete(td_event* e, uint64_t gen) {
  pthread_mutex_lock(&e->mu);
  if (gen > e->completed) e->completed = gen;
  pthread_cond_broadcast(&e->cv);
  pthread_mutex_unlock(&e->mu);
}
static void td_event_await(td_event* e, uint64_t gen) {
  pthread_mutex_lock(&e->mu);
  while (e->completed < gen) pthread_cond_wait(&e->cv, &e->mu);
  pthread_mutex_unlock(&e->mu);
}

static void* td_stream_main(void* arg) {
  td_stream* s = arg;
  for (;;) {
    pthread_mutex_lock(&s->mu);
    while (!s->head && !s->quit) pthread_cond_wait(&s->cv, &s->mu);
    td_op* op = s->head;
    if (!op) {  // quit, and the queue is drained
      pthread_mutex_unlock(&s->mu);
      return NULL;
    }
    pthread_mutex_unlock(&s->mu);
    if (op->kind == 0) td_event_complete(op->ev, op->gen);
    else if (op->kind == 1) td_event_await(op->ev, op->gen);
    else op->fn(op->arg);
    if (op->ev) td_event_unref(op->ev);
    pthread_mutex_lock(&s->mu);  // dequeued only once run: the queue's tail stays valid meanwhile
    s->head = op->next;
    if (!s->head) s->tail = NULL;
    pthread_cond_broadcast(&s->cv);
    pthread_mutex_unlock(&s->mu);
    free(op);
  }
}
static void td_stream_push(td_stream* s, td_op op) {
  td_op* o = malloc(sizeof *o);
  if (!o) abort();  // (a test double: no recovery from out of memory here)
  *o = op;
  o->next = NULL;
  if (o->ev) {
    pthread_mutex_lock(&o->ev->mu);
    o->ev->refs++;
    pthread_mutex_unlock(&o->ev->mu);
  }
  pthread_mutex_lock(&s->mu);
  if (s->tail) s->tail->next = o;
  else s->head = o;
  s->tail = o;
  pthread_cond_broadcast(&s->cv);
  pthread_mutex_unlock(&s->mu);
}

static int td_synchronize(void) { return td_wait(); }
static void* td_stream_new(void) {
  td_stream* s = calloc(1, sizeof *s);
  if (!s) return NULL;
  pthread_mutex_init(&s->mu, NULL);
  pthread_cond_init(&s->cv, NULL);
  if (pthread_create(&s->thread, NULL, td_stream_main, s) != 0) {
    free(s);
    return NULL;
  }
  return s;
}
static void td_stream_free(void* stream) {  // runs what is queued, then ends the thread
  td_stream* s = stream;
  if (!s) return;
  pthread_mutex_lock(&s->mu);
  s->quit = 1;
  pthread_cond_broadcast(&s->cv);
  pthread_mutex_unlock(&s->mu);
  pthread_join(s->thread, NULL);
  pthread_mutex_destroy(&s->mu);
  pthread_cond_destroy(&s->cv);
  free(s);
}
static void* td_event_new(void) {
  td_event* e = calloc(1, sizeof *e);
  if (!e) return NULL;
  pthread_mutex_init(&e->mu, NULL);
  pthread_cond_init(&e->cv, NULL);
  e->refs = 1;
  return e;
}
static void td_event_free(void* event) {
  if (event) td_event_unref(event);
}
static void td_event_record(void* event, void* stream) {
  td_event* e = event;
  pthread_mutex_lock(&e->mu);
  uint64_t gen = ++e->recorded;
  pthread_mutex_unlock(&e->mu);
  if (stream) td_stream_push(stream, (td_op){.kind = 0, .ev = e, .gen = gen});
  else td_event_complete(e, gen);  // the compute stream's work so far is done
}
static void td_stream_wait(void* stream, void* event) {
  td_event* e = event;
  pthread_mutex_lock(&e->mu);
  uint64_t gen = e->recorded;
  pthread_mutex_unlock(&e->mu);
  if (stream) td_stream_push(stream, (td_op){.kind = 1, .ev = e, .gen = gen});
  else td_event_await(e, gen);
}
// work queued on a stream: a copy or memset there moves bytes as a DMA engine would (no wait on
// the compute stream, no deferred check reported, no sync counted); on the compute stream it runs
// at once, as its kernels do
typedef struct {
  void* dst;
  const void* src;
  size_t nbytes;
  int byte;  // memset: the byte; copy: -1
} td_move;
static void td_move_run(void* arg) {
  td_move* m = arg;
  td_open();
  if (m->byte >= 0) memset(m->dst, m->byte, m->nbytes);
  else if (m->nbytes) memcpy(m->dst, m->src, m->nbytes);
  td_close();
  free(m);
}
static void td_launch_host(void* stream, void (*fn)(void*), void* arg) {
  if (stream) td_stream_push(stream, (td_op){.kind = 2, .fn = fn, .arg = arg});
  else fn(arg);
}
static int td_queue_move(void* dst, const void* src, size_t nbytes, int byte, void* stream) {
  td_move* m = malloc(sizeof *m);
  CHECK_INT(m, "testdev: out of memory");
  *m = (td_move){dst, src, nbytes, byte};
  td_launch_host(stream, td_move_run, m);
  return 0;
}
static int td_copy_async(void* dst, const void* src, size_t nbytes, fsdp_copy_kind kind, void* stream) {
  (void)kind;
  return td_queue_move(dst, src, nbytes, -1, stream);
}
static void td_memset_async(void* p, int byte, size_t nbytes, void* stream) {
  td_queue_move(p, NULL, nbytes, byte & 0xff, stream);
}
static void td_ordinal(int* index, int* count) {
  *index = 0;
  *count = 1;
}

// ---- kernels: the CPU's, with the arena open -----------------------------------------------------------
// V: an entry returning nothing; R: one returning a value (the status or result)
#define V(fam, name, params, args) \
  static void td_##name params {   \
    if (g_fail_id) return;         \
    td_open();                     \
    g_cpu->fam->name args;         \
    td_close();                    \
  }
#define R(fam, type, name, params, args) \
  static type td_##name params {         \
    if (g_fail_id) return 0;             \
    td_open();                           \
    type r_ = g_cpu->fam->name args;     \
    td_close();                          \
    return r_;                           \
  }
// the checks, deferred as on a GPU (the op layer passes a check id to an async device): a failure
// is recorded, not returned, and the host does not wait
static int64_t td_index_check(const int64_t* ix, int64_t n, int64_t lo, int64_t hi, int check) {
  td_open();
  int64_t pos = g_cpu->elem->index_check(ix, n, lo, hi, 0);
  if (pos >= 0) td_fail(check, ix[pos]);
  td_close();
  return -1;
}
static int td_check_targets(const int64_t* t, int64_t n, int64_t C, int64_t ig, int64_t* bad, int check) {
  (void)bad;
  int64_t value = 0;
  td_open();
  if (g_cpu->nn->check_targets(t, n, C, ig, &value, 0)) td_fail(check, value);
  td_close();
  return 0;
}

V(elem, copy_strided, (void* d, int dd, const void* s, int sd, int n, const int64_t* sh, const int64_t* st),
  (d, dd, s, sd, n, sh, st))
V(elem, scatter_strided, (void* d, size_t es, int n, const int64_t* sh, const int64_t* st, const void* s),
  (d, es, n, sh, st, s))
V(elem, fill, (void* d, int dt, int64_t n, double v), (d, dt, n, v))
V(elem, axpy, (float* y, int64_t ldy, const float* x, int64_t ldx, int64_t rows, int64_t n, float a),
  (y, ldy, x, ldx, rows, n, a))
V(elem, scale, (float* y, int64_t n, float s), (y, n, s))
V(elem, binary,
  (int op, float* o, const float* a, const float* b, int n, const int64_t* sh, const int64_t* sa, const int64_t* sb),
  (op, o, a, b, n, sh, sa, sb))
V(elem, unary, (int op, float* o, const float* x, int64_t n, double p), (op, o, x, n, p))
V(elem, unary_backward, (int op, float* gx, const float* gy, const float* x, const float* y, int64_t n, double p),
  (op, gx, gy, x, y, n, p))
V(elem, sum_dim, (float* o, const float* i, int64_t a, int64_t r, int64_t b), (o, i, a, r, b))
V(elem, max_dim, (float* o, int64_t* ix, const float* i, int64_t a, int64_t r, int64_t b), (o, ix, i, a, r, b))
V(elem, scatter_dim, (float* gx, const float* gy, const int64_t* ix, int64_t a, int64_t r, int64_t b),
  (gx, gy, ix, a, r, b))
V(elem, index_select,
  (void* o, const void* i, size_t es, const int64_t* ix, int64_t a, int64_t ni, int64_t nx, int64_t b),
  (o, i, es, ix, a, ni, nx, b))
V(elem, index_add, (float* gx, const float* gy, const int64_t* ix, int64_t a, int64_t ni, int64_t nx, int64_t b),
  (gx, gy, ix, a, ni, nx, b))
V(elem, where,
  (float* o, const uint8_t* c, const float* a, const float* b, int n, const int64_t* sh, const int64_t* sc,
   const int64_t* sa, const int64_t* sb),
  (o, c, a, b, n, sh, sc, sa, sb))
V(elem, cumsum_dim, (float* o, const float* i, int64_t a, int64_t r, int64_t b, int rev), (o, i, a, r, b, rev))
V(elem, argsort_rows, (int64_t * ix, int64_t* tmp, const float* x, int64_t r, int64_t n, int dsc),
  (ix, tmp, x, r, n, dsc))
V(elem, gather_dim, (const fsdp_gather_geom* g, float* o, const float* i, const int64_t* ix), (g, o, i, ix))
V(elem, scatter_add_dim, (const fsdp_gather_geom* g, float* d, const float* s, const int64_t* ix), (g, d, s, ix))

V(linalg, gemm_many, (int n, const fsdp_gemm_args* g), (n, g))
R(linalg, int, gemm_tiles, (int n, const fsdp_gemm_args* g, const int* lim), (n, g, lim))
R(linalg, int, gemm_bf16_many, (int n, const fsdp_gemm_bf16_args* g), (n, g))
V(linalg, bias_rows, (float* y, const float* b, int64_t M, int64_t N), (y, b, M, N))
V(linalg, sum_rows, (float* gb, const float* gy, int64_t M, int64_t N), (gb, gy, M, N))
R(linalg, int, conv2d_forward, (const fsdp_conv_geom* g, float* y, const float* x, const float* w, const float* b),
  (g, y, x, w, b))
R(linalg, int, conv2d_backward,
  (const fsdp_conv_geom* g, float* gx, float* gw, float* gb, const float* gy, const float* x, const float* w),
  (g, gx, gw, gb, gy, x, w))
R(linalg, int, conv2d_forward_bf16,
  (const fsdp_conv_geom* g, float* y, const uint16_t* x, const uint16_t* w, const float* b), (g, y, x, w, b))
R(linalg, int, conv2d_backward_bf16,
  (const fsdp_conv_geom* g, float* gx, float* gw, float* gb, const uint16_t* gy, const uint16_t* x, const uint16_t* w),
  (g, gx, gw, gb, gy, x, w))
V(linalg, max_pool2d_forward, (const fsdp_conv_geom* g, float* y, int64_t* ix, const float* x), (g, y, ix, x))
V(linalg, max_pool2d_backward, (const fsdp_conv_geom* g, float* gx, const float* gy, const int64_t* ix),
  (g, gx, gy, ix))
V(linalg, avg_pool2d_forward, (const fsdp_conv_geom* g, float* y, const float* x, int cip), (g, y, x, cip))
V(linalg, avg_pool2d_backward, (const fsdp_conv_geom* g, float* gx, const float* gy, int cip), (g, gx, gy, cip))
V(linalg, adaptive_avg_pool2d_forward, (const fsdp_conv_geom* g, float* y, const float* x), (g, y, x))
V(linalg, adaptive_avg_pool2d_backward, (const fsdp_conv_geom* g, float* gx, const float* gy), (g, gx, gy))

V(nn, softmax_forward, (float* y, const float* x, int64_t o, int64_t n, int64_t i, int lg), (y, x, o, n, i, lg))
V(nn, softmax_backward, (float* gx, const float* gy, const float* y, int64_t o, int64_t n, int64_t i, int lg),
  (gx, gy, y, o, n, i, lg))
V(nn, cross_entropy_forward,
  (float* loss, float* cnt, float* lse, const float* x, const int64_t* t, int64_t N, int64_t C, int64_t S, int64_t ig,
   float sm),
  (loss, cnt, lse, x, t, N, C, S, ig, sm))
V(nn, cross_entropy_backward,
  (float* gx, const float* x, const float* lse, const int64_t* t, int64_t N, int64_t C, int64_t S, int64_t ig, float sm,
   const float* gy, const float* cnt),
  (gx, x, lse, t, N, C, S, ig, sm, gy, cnt))
V(nn, nll_forward,
  (float* loss, float* cnt, const float* lp, const int64_t* t, int64_t N, int64_t C, int64_t S, int64_t ig),
  (loss, cnt, lp, t, N, C, S, ig))
V(nn, nll_backward,
  (float* gx, const int64_t* t, int64_t N, int64_t C, int64_t S, int64_t ig, const float* gy, const float* cnt),
  (gx, t, N, C, S, ig, gy, cnt))
V(nn, mse_forward, (float* loss, const float* a, const float* b, int64_t n), (loss, a, b, n))
V(nn, mse_backward, (float* ga, float* gb, const float* a, const float* b, int64_t n, const float* gy),
  (ga, gb, a, b, n, gy))
V(nn, layer_norm_forward,
  (float* y, float* mu, float* rs, const float* x, const float* w, const float* b, int64_t M, int64_t D, float eps),
  (y, mu, rs, x, w, b, M, D, eps))
V(nn, layer_norm_backward,
  (float* dx, float* dw, float* db, const float* dy, const float* x, const float* mu, const float* rs, const float* w,
   int64_t M, int64_t D),
  (dx, dw, db, dy, x, mu, rs, w, M, D))
V(nn, embedding_forward, (float* y, const float* w, const int64_t* ix, int64_t n, int64_t V, int64_t D),
  (y, w, ix, n, V, D))
V(nn, embedding_backward, (float* gw, const float* gy, const int64_t* ix, int64_t n, int64_t V, int64_t D, int64_t pad),
  (gw, gy, ix, n, V, D, pad))
V(nn, dropout, (float* y, const float* x, int64_t n, float p, uint64_t seed), (y, x, n, p, seed))
V(nn, attn_softmax, (const fsdp_attn_geom* g, float* P, const float* m, const int64_t* boff), (g, P, m, boff))

V(norm, batch_norm_sums, (float* o, const float* x, const float* s1, int64_t N, int64_t C, int64_t S),
  (o, x, s1, N, C, S))
V(norm, batch_norm_stats,
  (float* mu, float* is, float* rm, float* rv, const float* s1, const float* s2, int64_t C, float eps, float m),
  (mu, is, rm, rv, s1, s2, C, eps, m))
V(norm, batch_norm_apply,
  (float* y, const float* x, const float* mu, const float* is, const float* w, const float* b, int64_t N, int64_t C,
   int64_t S),
  (y, x, mu, is, w, b, N, C, S))
V(norm, batch_norm_backward_sums,
  (float* g, const float* dy, const float* x, const float* mu, int64_t N, int64_t C, int64_t S),
  (g, dy, x, mu, N, C, S))
V(norm, batch_norm_backward,
  (float* dx, float* dw, float* db, const float* dy, const float* x, const float* mu, const float* is, const float* w,
   const float* gl, const float* g, const float* s1, int64_t N, int64_t C, int64_t S),
  (dx, dw, db, dy, x, mu, is, w, gl, g, s1, N, C, S))
V(norm, group_norm_forward,
  (float* y, float* mu, float* rs, const float* x, const float* w, const float* b, int64_t N, int64_t C, int64_t S,
   int64_t G, float eps),
  (y, mu, rs, x, w, b, N, C, S, G, eps))
V(norm, group_norm_backward,
  (float* dx, float* dw, float* db, const float* dy, const float* x, const float* mu, const float* rs, const float* w,
   int64_t N, int64_t C, int64_t S, int64_t G),
  (dx, dw, db, dy, x, mu, rs, w, N, C, S, G))
V(norm, rms_norm_forward, (float* y, float* rs, const float* x, const float* w, int64_t M, int64_t D, float eps),
  (y, rs, x, w, M, D, eps))
V(norm, rms_norm_backward,
  (float* dx, float* dw, const float* dy, const float* x, const float* rs, const float* w, int64_t M, int64_t D),
  (dx, dw, dy, x, rs, w, M, D))

V(optim, sgd, (const fsdp_sgd_hparams* h, float* p, const float* g, float* buf, int64_t n), (h, p, g, buf, n))
V(optim, adam, (const fsdp_adam_hparams* h, float* p, const float* g, float* m, float* v, float* vm, int64_t n),
  (h, p, g, m, v, vm, n))

static const fsdp_elem_kernels td_elem = {
    td_copy_strided,    td_scatter_strided, td_fill,    td_axpy,       td_scale,        td_binary,
    td_unary,           td_unary_backward,  td_sum_dim, td_max_dim,    td_scatter_dim,  td_index_check,
    td_index_select,    td_index_add,       td_where,   td_cumsum_dim, td_argsort_rows, td_gather_dim,
    td_scatter_add_dim,
};
static const fsdp_linalg_kernels td_linalg = {
    td_gemm_many,
    td_gemm_tiles,
    td_gemm_bf16_many,
    td_bias_rows,
    td_sum_rows,
    td_conv2d_forward,
    td_conv2d_backward,
    td_conv2d_forward_bf16,
    td_conv2d_backward_bf16,
    td_max_pool2d_forward,
    td_max_pool2d_backward,
    td_avg_pool2d_forward,
    td_avg_pool2d_backward,
    td_adaptive_avg_pool2d_forward,
    td_adaptive_avg_pool2d_backward,
};
static const fsdp_nn_kernels td_nn = {
    td_softmax_forward,        td_softmax_backward,
    td_check_targets,          td_cross_entropy_forward,
    td_cross_entropy_backward, td_nll_forward,
    td_nll_backward,           td_mse_forward,
    td_mse_backward,           td_layer_norm_forward,
    td_layer_norm_backward,    td_embedding_forward,
    td_embedding_backward,     td_dropout,
    td_attn_softmax,
};
static const fsdp_optim_kernels td_optim = {td_sgd, td_adam};
static const fsdp_norm_kernels td_norm = {
    .batch_norm_sums = td_batch_norm_sums,
    .batch_norm_stats = td_batch_norm_stats,
    .batch_norm_apply = td_batch_norm_apply,
    .batch_norm_backward_sums = td_batch_norm_backward_sums,
    .batch_norm_backward = td_batch_norm_backward,
    .group_norm_forward = td_group_norm_forward,
    .group_norm_backward = td_group_norm_backward,
    .rms_norm_forward = td_rms_norm_forward,
    .rms_norm_backward = td_rms_norm_backward,
};

// pinned host memory: ordinary host memory (the arena is the device's; this is the host's), from the
// C heap, so a block freed any other way than host_free shows under the sanitizers
static void* td_host_alloc(size_t nbytes) { return aligned_alloc(64, (nbytes + 63) & ~(size_t)63); }
static void td_host_free(void* p, size_t nbytes) {
  (void)nbytes;
  free(p);
}

static const fsdp_backend td_backend = {
    .name = "testdev",
    .async = 1,
    .alloc = td_alloc,
    .free = td_free,
    .memset = td_memset,
    .copy = td_copy,
    .synchronize = td_synchronize,
    .stream_new = td_stream_new,
    .stream_free = td_stream_free,
    .event_new = td_event_new,
    .event_free = td_event_free,
    .event_record = td_event_record,
    .stream_wait = td_stream_wait,
    .copy_async = td_copy_async,
    .memset_async = td_memset_async,
    .launch_host = td_launch_host,
    .ordinal = td_ordinal,
    .elem = &td_elem,
    .linalg = &td_linalg,
    .nn = &td_nn,
    .optim = &td_optim,
    .norm = &td_norm,
    .host_alloc = td_host_alloc,
    .host_free = td_host_free,
};

// a fault inside the arena is the host touching device memory: say so (with the C stack, which
// names the function that did it), then die of the fault as usual
static void td_fault(int sig, siginfo_t* si, void* ctx) {
  (void)ctx;
  char* a = si->si_addr;
  if (a >= g_arena && a < g_arena + g_arena_size) {
    static const char msg[] =
        "testdev: the host touched device memory outside the device table (code that reads or writes a "
        "device tensor's bytes directly; on a GPU this is garbage or a crash). C stack:\n";
    ssize_t w = write(2, msg, sizeof msg - 1);
    (void)w;
    void* frames[32];
    backtrace_symbols_fd(frames, backtrace(frames, 32), 2);
  }
  signal(sig, SIG_DFL);
  raise(sig);
}

int64_t fsdp_testdev_syncs(void) { return atomic_load(&g_syncs); }
static int g_installed;

int fsdp_testdev_install(void) {
  if (g_installed) return 0;
  const char* mib = getenv("FSDP_TESTDEV_MIB");
  g_arena_size = (size_t)(mib && atoi(mib) > 0 ? atoi(mib) : 1024) << 20;
  void* a = mmap(NULL, g_arena_size, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  CHECK_INT(a != MAP_FAILED, "testdev: cannot reserve %zu bytes of address space", g_arena_size);
  g_arena = a;
  g_free[0] = (td_block){0, g_arena_size};
  g_nfree = 1;
  g_cpu = fsdp_backend_for(FSDP_CPU);
  struct sigaction sa;
  memset(&sa, 0, sizeof sa);
  sa.sa_sigaction = td_fault;
  sa.sa_flags = SA_SIGINFO;
  sigaction(SIGSEGV, &sa, NULL);
  if (fsdp_backend_register(FSDP_CUDA, &td_backend)) return -1;
  g_installed = 1;
  return 0;
}
