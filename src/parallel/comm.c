/*
 * parallel/comm.c -- collectives: the communication thread, work handles, the collective check,
 * stats, the built-in "self" backend and the loader of the "mpi" backend (libfsdp_mpi.so).
 *
 * Flow of one collective:
 *   caller thread   fsdp_all_gather(out, in, tag): checks arguments, retains the tensors,
 *                   numbers the collective (seq), counts it in the stats, appends a work item
 *                   to the FIFO queue and returns the handle at once.
 *   comm thread     pops items in order; for each: the ranks agree on (kind, op/root, bytes,
 *                   dtype, seq, tag) through backend->agree (rank 0 compares, with a deadline),
 *                   then the backend moves the bytes; marks the item done.
 *   caller thread   fsdp_work_wait: sleeps on a condition variable until done, copies results
 *                   into non-contiguous destinations, drops the tensor refs (refcounts are only
 *                   ever touched on the caller's thread), reports the error if any.
 * After a mismatch, a timeout or a transport error the communicator is broken: every later
 * collective fails at once with the same message, so no rank ever hangs.
 *
 * Every wait is bounded: the backend bounds the agreement and each wait of the data movement by
 * the timeout (a rank that stops at any point makes the others fail, naming it), and the caller's
 * wait is a watchdog on the comm thread itself: the backend beats whenever a wait progresses, and
 * a caller that sees no beat for 1.5 * timeout + 10 s breaks the communicator and fails. The item
 * it waited for is then orphaned: the comm thread frees it if it ever finishes, and its tensors
 * are never released (the backend may still write them).
 *
 * The comm thread is the only thread that calls the backend, MPI_Init_thread and MPI_Finalize
 * included. fsdp_comm_finalize (also run at exit) drains the queue, lets the ranks agree that
 * everyone is shutting down, finalizes the backend (skipped when broken: the job is failing
 * and MPI_Finalize could wait forever for a rank stuck elsewhere) and joins the thread.
 */
#define _GNU_SOURCE  // dladdr, RTLD_NODELETE
#include "core/core.h"
#include "parallel/comm.h"

#include <dlfcn.h>
#include <pthread.h>
#include <signal.h>
#include <sys/syscall.h>
#include <unistd.h>

struct fsdp_work {
  int kind, arg;           // fsdp_coll_kind (or FSDP_COLL_FINALIZE), reduce op or root
  fsdp_tensor* out;        // ref: the tensor the backend writes (a contiguous temp if needed)
  fsdp_tensor* in;         // ref: the input (a contiguous copy if the user's was not)
  fsdp_tensor* copy_back;  // ref: the user's non-contiguous destination, filled at wait
  void* out_ptr;
  const void* in_ptr;
  size_t count;  // per kind: bytes per rank, floats per rank, floats, bytes
  int algo;      // reduce-scatter algorithm
  // on a device data plane (meta.plane != 0): the device's table and the collective's events
  const fsdp_backend* dev;
  void *ready, *finished_ev;    // recorded on the compute stream at submit / on the plane's stream
  const fsdp_comm_plane* boot;  // FSDP_COLL_PLANE_BOOT: the plane to bootstrap, and its ids' digest
  char digest[17];
  int traced_wait;  // its wait is on the trace (a handle is waited for at most once there)
  void* flight;     // hybrid: the backend's all-reduce over the replicas, still running (comm thread)
  double timeout;
  fsdp_comm_meta meta;
  int done, status, finished, orphaned;
  char err[FSDP_COMM_ERRLEN];
  struct fsdp_work* next;
};

static struct {
  pthread_mutex_t mu;
  pthread_cond_t cv_queue, cv_done;
  pthread_t thread;
  int initialized, mpi_finalized, atexit_registered;
  const fsdp_comm_backend* be;
  const fsdp_comm_plane* plane;  // the device data plane, once chosen (see plane_for)
  int plane_mode;                // FSDP_DEVICE_COMM: -1 not read yet, 0 host, else FSDP_PLANE_* (or 3: auto)
  int plane_queued;              // its init is queued (the comm thread starts it in order)
  int plane_up;                  // started (comm thread only)
  int rank, size;
  int local_rank, local_size;  // among the ranks of this node
  int group_size;              // hybrid sharding's shard groups (fsdp_comm_set_groups), 0 before
  fsdp_work *head, *tail;
  int64_t seq;
  int broken;
  char broken_msg[FSDP_COMM_ERRLEN];
  int64_t counts[FSDP_NCOLL], bytes[FSDP_NCOLL];
  double timeout;
  int timeout_set, rs_algo;
  int init_done, init_status;
  char init_err[FSDP_COMM_ERRLEN];
  int64_t beat_ms;
  int64_t step_fwd, step_bwd;  // fsdp_comm_set_step
  int step_phase;
  int64_t stall_seq;  // test hook FSDP_COMM_STALL_AT=<rank>:<collective #>: that rank's comm
  int stall_rank;  // thread stops the process (SIGSTOP) right after agreeing (comm_stall_spec)  // monotonic milliseconds of the comm thread's last progress
  pthread_t owner;  // the thread that initialized the communicator: the only one that may use it
  long owner_tid;
} g = {
    .mu = PTHREAD_MUTEX_INITIALIZER,
    .cv_queue = PTHREAD_COND_INITIALIZER,
    .cv_done = PTHREAD_COND_INITIALIZER,
    .size = 1,
    .timeout = 300.0,
};

static const char* kind_names[] = {"all_gather", "reduce_scatter", "all_reduce",      "broadcast",  "barrier",
                                   "shutdown",   "plane start",    "plane bootstrap", "make groups"};
static const char* group_names[] = {"", " within the shard group", " within the replica group",
                                    " within the shard group, then all-reduced over the replica group"};
static const char* plane_names[] = {"the host", "nccl", "the stand-in communicator"};
static const char* op_names[] = {"sum", "avg", "max"};

// ---- the "self" backend: one rank, collectives are copies -----------------------------------
// (the signatures are the backend table's; one rank needs few of the arguments)
static int self_init(int* rank, int* size, int* local_rank, int* local_size, void (*beat)(void), char* err) {
  (void)err, (void)beat;
  *rank = *local_rank = 0;
  *size = *local_size = 1;
  return 0;
}
static void self_finalize(void) {}
static int self_agree(const fsdp_comm_meta* mine, double timeout_s, fsdp_comm_decide_fn decide, fsdp_comm_verdict* v) {
  int arrived = 1;
  decide(mine, &arrived, 1, 0, timeout_s, v);
  return 0;
}
static int self_set_groups(int size, char* err) {
  (void)size, (void)err;  // (one group of one rank, whatever the size: 1 is the only one allowed)
  return 0;
}
static int self_all_gather(void* out, const void* in, size_t bytes, int group, char* err) {
  (void)err, (void)group;
  if (out != in) memmove(out, in, bytes);
  return 0;
}
static int self_reduce_scatter(float* out, const float* in, size_t n, int op, int algo, int group, char* err) {
  (void)op, (void)algo, (void)err, (void)group;
  if (out != in) memmove(out, in, n * sizeof(float));  // sum, avg and max of one rank
  return 0;
}
static int self_all_reduce(float* buf, size_t n, int op, int group, char* err) {
  (void)buf, (void)n, (void)op, (void)err, (void)group;
  return 0;
}
static int self_all_reduce_start(float* buf, size_t n, int op, int group, void** req, char* err) {
  (void)buf, (void)n, (void)op, (void)err, (void)group;
  *req = NULL;
  return 0;
}
static int self_test(void* req, int* done, char* err) {
  (void)req, (void)err;
  *done = 1;
  return 0;
}
static int self_broadcast(void* buf, size_t bytes, int root, char* err) {
  (void)buf, (void)bytes, (void)root, (void)err;
  return 0;
}
static int self_barrier(char* err) {
  (void)err;
  return 0;
}

static const fsdp_comm_backend self_backend = {
    FSDP_COMM_ABI,   "self",          self_init,           self_finalize,   self_agree,
    self_set_groups, self_all_gather, self_reduce_scatter, self_all_reduce, self_all_reduce_start,
    self_test,       self_broadcast,  self_barrier,
};

// ---- loading the mpi backend --------------------------------------------------------------------
// FSDP_MPI_LIB, else libfsdp_mpi.so next to this libfsdp.so, else the default search path.
// RTLD_GLOBAL: OpenMPI's plugins resolve symbols of libmpi that it loads for us.
static const fsdp_comm_backend* load_mpi_backend(void) {
  char tried[2048];
  void* h = fsdp_dlopen_backend("FSDP_MPI_LIB", "libfsdp_mpi.so", RTLD_NOW | RTLD_GLOBAL, tried, sizeof tried);
  if (h) {
    fsdp_comm_backend_getter get = (fsdp_comm_backend_getter)dlsym(h, "fsdp_comm_mpi_backend");
    CHECK_NULL(get, "comm init: libfsdp_mpi.so has no fsdp_comm_mpi_backend()");
    const fsdp_comm_backend* be = get();
    CHECK_NULL(
        be && be->abi == FSDP_COMM_ABI,
        "comm init: libfsdp_mpi.so was built for another libfsdp (backend ABI %d, expected %d); rebuild with make",
        be ? be->abi : -1, FSDP_COMM_ABI);
    return be;
  }
  fsdp_errorf("comm init: cannot load the mpi backend (%s); build libfsdp_mpi.so with `make` "
              "(needs mpicc) or point FSDP_MPI_LIB at it",
              tried);
  return NULL;
}

// ---- the device data plane ----------------------------------------------------------------------
// FSDP_NCCL_LIB, else libfsdp_nccl.so next to this libfsdp.so, else the default search path
static const fsdp_comm_plane* load_nccl_plane(void) {
  char tried[2048];
  void* h = fsdp_dlopen_backend("FSDP_NCCL_LIB", "libfsdp_nccl.so", RTLD_NOW | RTLD_GLOBAL, tried, sizeof tried);
  CHECK_NULL(h, "cannot load the nccl plane (%s); libfsdp_nccl.so is built by `make` where NCCL is installed", tried);
  fsdp_comm_plane_getter get = (fsdp_comm_plane_getter)dlsym(h, "fsdp_comm_nccl_plane");
  const fsdp_comm_plane* p = get ? get() : NULL;
  CHECK_NULL(p && p->abi == FSDP_COMM_ABI,
             "libfsdp_nccl.so was built for another libfsdp (plane ABI %d, expected %d); rebuild with make",
             p ? p->abi : -1, FSDP_COMM_ABI);
  return p;
}

// How a collective on a device tensor moves (meta.plane): 0 staged through host memory on the
// host backend, else on the device data plane. FSDP_DEVICE_COMM says which: "host"; "nccl";
// "standin" (the test double of NCCL, with the test double of a GPU); "auto" or unset: nccl on a
// real GPU when libfsdp_nccl.so loads and this node's ranks have a GPU each (NCCL refuses two
// ranks on one GPU), else the host. -1 with the error set when the asked-for plane cannot be had.
static int plane_for(int device, const char* op, const char* tag) {
  if (device == FSDP_CPU) return 0;
  if (g.plane_mode < 0) {
    const char* m = getenv("FSDP_DEVICE_COMM");
    if (!m || !*m || strcmp(m, "auto") == 0) g.plane_mode = 3;
    else if (strcmp(m, "host") == 0) g.plane_mode = 0;
    else if (strcmp(m, "nccl") == 0) g.plane_mode = FSDP_PLANE_NCCL;
    else if (strcmp(m, "standin") == 0) g.plane_mode = FSDP_PLANE_STANDIN;
    else CHECK_INT(0, "%s '%s': FSDP_DEVICE_COMM must be auto, host, nccl or standin, got '%s'", op, tag, m);
  }
  if (g.plane) return g.plane->id;
  int double_gpu = strcmp(fsdp_backend_for(device)->name, "testdev") == 0;
  if (g.plane_mode == 3) {
    int index = 0, count = 0;
    fsdp_backend_for(device)->ordinal(&index, &count);
    g.plane = double_gpu || g.local_size > count ? NULL : load_nccl_plane();
    if (!g.plane) fsdp_clear_error();
    g.plane_mode = g.plane ? FSDP_PLANE_NCCL : 0;
  } else if (g.plane_mode == FSDP_PLANE_STANDIN) {
    g.plane = fsdp_comm_standin_plane();
  } else if (g.plane_mode == FSDP_PLANE_NCCL) {
    CHECK_INT(!double_gpu, "%s '%s': FSDP_DEVICE_COMM=nccl needs a real GPU, not the test double of one", op, tag);
    g.plane = load_nccl_plane();
    if (!g.plane) {
      char msg[FSDP_COMM_ERRLEN];
      snprintf(msg, sizeof msg, "%s", fsdp_last_error());
      CHECK_INT(0, "%s '%s': FSDP_DEVICE_COMM=nccl: %s", op, tag, msg);
    }
  }
  return g.plane ? g.plane->id : 0;
}

// ---- the collective check (runs on rank 0, see fsdp_comm_backend.agree) -------------------------
// "all_gather(tag 'x', 4096 bytes)", adding op/root/dtype/seq only where `other` differs
static int same_shape(const fsdp_comm_meta* a, const fsdp_comm_meta* b) {
  if (a->ndim != b->ndim) return 0;
  for (int d = 0; d < a->ndim; d++)
    if (a->shape[d] != b->shape[d]) return 0;
  return 1;
}
static size_t shape_str(char* buf, size_t n, const fsdp_comm_meta* m) {
  size_t len = snprintf(buf, n, "(");
  for (int d = 0; d < m->ndim && len < n; d++)
    len += snprintf(buf + len, n - len, d ? ", %lld" : "%lld", (long long)m->shape[d]);
  if (len < n) len += snprintf(buf + len, n - len, ")");
  return len;
}

static void describe(char* buf, size_t n, const fsdp_comm_meta* m, const fsdp_comm_meta* o) {
  int k = m->kind >= 0 && m->kind <= FSDP_COLL_GROUPS ? m->kind : FSDP_COLL_FINALIZE;
  if (k == FSDP_COLL_FINALIZE) {
    snprintf(buf, n, "shutdown (its script ended or failed)");
    return;
  }
  size_t len = snprintf(buf, n, "%s(tag '%s', ", kind_names[k], m->tag);
  if (m->ndim >= 0 && !same_shape(m, o)) {
    len += snprintf(buf + len, n - len, "shape ");
    len += shape_str(buf + len, n - len, m);
  } else {
    len += snprintf(buf + len, n - len, "%lld bytes", (long long)m->bytes);
  }
  if (m->arg != o->arg && (k == FSDP_COLL_REDUCE_SCATTER || k == FSDP_COLL_ALL_REDUCE))
    len += snprintf(buf + len, n - len, ", op %s", op_names[m->arg >= 0 && m->arg <= 2 ? m->arg : 0]);
  if (m->arg != o->arg && k == FSDP_COLL_BROADCAST) len += snprintf(buf + len, n - len, ", root %d", m->arg);
  if (m->dtype != o->dtype) len += snprintf(buf + len, n - len, ", %s", fsdp_dtype_name(m->dtype));
  if (m->group != o->group) len += snprintf(buf + len, n - len, "%s", group_names[m->group & 3]);
  if (m->arg != o->arg && k == FSDP_COLL_GROUPS) len += snprintf(buf + len, n - len, ", groups of %d", m->arg);
  if (m->plane != o->plane)
    len += snprintf(buf + len, n - len, ", %s tensors through %s", fsdp_device_name(m->device),
                    plane_names[m->plane >= 0 && m->plane <= 2 ? m->plane : 0]);
  len += snprintf(buf + len, n - len, ")");
  if (m->seq != o->seq) snprintf(buf + len, n - len, " as its collective #%lld", (long long)m->seq);
}

// "in the backward of training step 3" (of the meta's rank)
static void step_str(char* buf, size_t n, const fsdp_comm_meta* m) {
  if (m->phase == FSDP_PHASE_FORWARD) snprintf(buf, n, "in the forward of training step %lld", (long long)m->fwd);
  else if (m->phase == FSDP_PHASE_BACKWARD)
    snprintf(buf, n, "in the backward of training step %lld", (long long)m->fwd);
  else if (m->fwd == 0) snprintf(buf, n, "before its first training step");
  else
    snprintf(buf, n, "after training step %lld (%lld backward%s done)", (long long)m->fwd, (long long)m->bwd,
             m->bwd == 1 ? "" : "s");
}
static int step_differs(const fsdp_comm_meta* a, const fsdp_comm_meta* b) {
  return a->fwd != b->fwd || a->bwd != b->bwd || a->phase != b->phase;
}

static int meta_differs(const fsdp_comm_meta* a, const fsdp_comm_meta* b) {
  return step_differs(a, b) || a->kind != b->kind || a->arg != b->arg || a->dtype != b->dtype || a->bytes != b->bytes ||
         a->seq != b->seq || a->plane != b->plane || a->group != b->group ||
         strncmp(a->tag, b->tag, FSDP_COMM_TAGLEN) != 0 || !same_shape(a, b);
}

static void decide(const fsdp_comm_meta* all, const int* arrived, int size, int timed_out, double timeout_s,
                   fsdp_comm_verdict* v) {
  const fsdp_comm_meta* m0 = &all[0];
  int k0 = m0->kind >= 0 && m0->kind <= FSDP_COLL_GROUPS ? m0->kind : FSDP_COLL_FINALIZE;
  v->status = 0;
  v->msg[0] = 0;
  if (timed_out) {
    char who[256];
    size_t len = 0;
    int nmiss = 0;
    for (int r = 0; r < size; r++)
      if (!arrived[r]) nmiss++;
    len += snprintf(who, sizeof who, nmiss > 1 ? "ranks " : "rank ");
    for (int r = 0, i = 0; r < size && len < sizeof who - 16; r++)
      if (!arrived[r]) len += snprintf(who + len, sizeof who - len, i++ ? ", %d" : "%d", r);
    v->status = 2;
    if (k0 == FSDP_COLL_FINALIZE)
      snprintf(v->msg, sizeof v->msg, "timed out after %g s waiting for %s to shut down (collective #%lld)", timeout_s,
               who, (long long)m0->seq);
    else
      snprintf(v->msg, sizeof v->msg, "timed out after %g s waiting for %s in %s '%s' (collective #%lld)", timeout_s,
               who, kind_names[k0], m0->tag, (long long)m0->seq);
    return;
  }
  for (int r = 1; r < size; r++) {
    if (!meta_differs(m0, &all[r])) continue;
    char a[256], b[256], sa[96] = "", sb[96] = "";
    describe(a, sizeof a, m0, &all[r]);
    describe(b, sizeof b, &all[r], m0);
    v->status = 1;
    size_t len = snprintf(v->msg, sizeof v->msg, "collective mismatch at #%lld: rank 0 called %s but rank %d called %s",
                          (long long)m0->seq, a, r, b);
    if (step_differs(m0, &all[r]) && len < sizeof v->msg) {
      step_str(sa, sizeof sa, m0);
      step_str(sb, sizeof sb, &all[r]);
      snprintf(v->msg + len, sizeof v->msg - len,
               "; rank 0 is %s, rank %d %s (the ranks are at different points of training: one skipped a step or a "
               "backward, or ran a forward under grad the others did not)",
               sa, r, sb);
    }
    return;
  }
}

// ---- the communication thread -----------------------------------------------------------------
static double mono_s(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return ts.tv_sec + 1e-9 * ts.tv_nsec;
}

static void beat(void) { __atomic_store_n(&g.beat_ms, (int64_t)(mono_s() * 1e3), __ATOMIC_RELAXED); }

static void set_broken(const char* msg) {
  pthread_mutex_lock(&g.mu);
  if (!g.broken) {
    g.broken = 1;
    snprintf(g.broken_msg, sizeof g.broken_msg, "%s", msg);
  }
  pthread_mutex_unlock(&g.mu);
}

static void run_work_traced(fsdp_work* w);

// "all_gather 'blocks.0' #12": the trace's name of a collective
static void trace_name(char* buf, size_t n, const char* prefix, const fsdp_work* w) {
  snprintf(buf, n, "%s%s '%s' #%lld", prefix, kind_names[w->kind], w->meta.tag, (long long)w->meta.seq);
}

static void run_work(fsdp_work* w) {
  double t0 = fsdp_trace_enabled() ? fsdp_trace_now() : 0;
  run_work_traced(w);
  if (fsdp_trace_enabled() && w->kind < FSDP_NCOLL) {
    char name[160];
    trace_name(name, sizeof name, "", w);
    fsdp_trace_span(FSDP_TRACE_COMM, name, t0, w->meta.bytes);
  }
}

// the test hook FSDP_COMM_STALL_AT: this rank stops right after agreeing, and says when (epoch
// seconds, on stderr) so that tests/fsdp/comm_stall_spec.lua measures the others' detection from it
static void stall_here(void) {
  struct timespec ts;
  clock_gettime(CLOCK_REALTIME, &ts);
  fprintf(stderr, "FSDP_COMM_STALL_AT: rank %d stops at %.3f\n", g.rank, ts.tv_sec + 1e-9 * ts.tv_nsec);
  fflush(stderr);
  raise(SIGSTOP);
}

static void run_work_traced(fsdp_work* w) {
  const fsdp_comm_backend* be = g.be;
  pthread_mutex_lock(&g.mu);
  int broken = g.broken;
  if (broken) snprintf(w->err, sizeof w->err, "%s", g.broken_msg);
  pthread_mutex_unlock(&g.mu);
  if (broken) {
    w->status = -1;
    return;
  }

  fsdp_comm_verdict v;
  if (be->agree(&w->meta, w->timeout, decide, &v) != 0 || v.status != 0) {
    snprintf(w->err, sizeof w->err, "%s", v.msg);
    set_broken(w->err);
    w->status = -1;
    return;
  }
  if (g.stall_seq == w->meta.seq && g.stall_rank == g.rank) stall_here();  // test hook, see init
  char err[FSDP_COMM_ERRLEN] = "";
  int rc = 0;
  const fsdp_comm_plane* p = w->meta.plane ? g.plane : NULL;
  int group = w->meta.group;
  switch (w->kind) {
    case FSDP_COLL_ALL_GATHER:
      rc = p ? p->all_gather(w->out_ptr, w->in_ptr, w->count, w->ready, w->finished_ev, err)
             : be->all_gather(w->out_ptr, w->in_ptr, w->count, group, err);
      break;
    case FSDP_COLL_REDUCE_SCATTER:
      if (p) {
        rc = p->reduce_scatter(w->out_ptr, w->in_ptr, w->count, w->arg, w->ready, w->finished_ev, err);
      } else if (group == FSDP_GROUP_HYBRID) {  // within the shard group, then over the replicas: that
        // all-reduce is only started; it runs on while the next collectives do (comm_thread polls it)
        rc = be->reduce_scatter(w->out_ptr, w->in_ptr, w->count, w->arg, w->algo, FSDP_GROUP_SHARD, err);
        if (!rc) rc = be->all_reduce_start(w->out_ptr, w->count, w->arg, FSDP_GROUP_REPLICA, &w->flight, err);
      } else {
        rc = be->reduce_scatter(w->out_ptr, w->in_ptr, w->count, w->arg, w->algo, group, err);
      }
      break;
    case FSDP_COLL_ALL_REDUCE:
      rc = p ? p->all_reduce(w->out_ptr, w->count, w->arg, w->ready, w->finished_ev, err)
             : be->all_reduce(w->out_ptr, w->count, w->arg, group, err);
      break;
    case FSDP_COLL_GROUPS: rc = be->set_groups(w->arg, err); break;
    case FSDP_COLL_BROADCAST:
      rc = p ? p->broadcast(w->out_ptr, w->count, w->arg, w->ready, w->finished_ev, err)
             : be->broadcast(w->out_ptr, w->count, w->arg, err);
      break;
    case FSDP_COLL_BARRIER: break;  // agreeing was the barrier: nobody passes before all arrived
    case FSDP_COLL_PLANE_INIT: {
      const fsdp_backend* dev = fsdp_backend_for(w->meta.device);
      int index = 0, count = 0;
      dev->ordinal(&index, &count);
      rc = g.plane->init(be, dev, index, g.rank, g.size, w->timeout, err);
      g.plane_up = rc == 0;
      if (rc && g.plane->id == FSDP_PLANE_NCCL) {  // what to do about it
        size_t len = strlen(err);
        snprintf(err + len, FSDP_COMM_ERRLEN - len,
                 " (FSDP_DEVICE_COMM=host moves GPU tensors through the host instead)");
      }
      break;
    }
    case FSDP_COLL_PLANE_BOOT: rc = w->boot->bootstrap(be, g.rank, g.size, w->digest, err); break;
    case FSDP_COLL_FINALIZE:
      if (g.plane_up) g.plane->finalize(0);
      g.plane_up = 0;
      be->finalize();
      break;
  }
  if (rc) {
    // the backend's message, cut where it would not fit beside the kind, tag and number
    snprintf(w->err, sizeof w->err, "%s '%s' (collective #%lld): %.*s", kind_names[w->kind], w->meta.tag,
             (long long)w->meta.seq, (int)(sizeof w->err - FSDP_COMM_TAGLEN - 64), err);
    set_broken(w->err);
    w->status = -1;
  }
}

// Hybrid items whose all-reduce over the replicas runs on (the comm thread's own list, oldest first):
// each is done when test says so; a failure breaks the communicator like any other.
static fsdp_work *g_flying, *g_flying_tail;
static void item_done(fsdp_work* w) {
  pthread_mutex_lock(&g.mu);
  w->done = 1;
  if (w->orphaned) free(w);
  pthread_cond_broadcast(&g.cv_done);
  pthread_mutex_unlock(&g.mu);
}
// tests every item in flight (all of them to the end when `all`); returns how many still fly
static int poll_flying(int all) {
  int left = 0, spins = 0;
  for (;;) {
    fsdp_work **pp = &g_flying, *prev = NULL;
    left = 0;
    while (*pp) {
      fsdp_work* w = *pp;
      int done = 0;
      char err[FSDP_COMM_ERRLEN] = "";
      if (g.be->test(w->flight, &done, err) != 0) {
        snprintf(w->err, sizeof w->err, "%s '%s' (collective #%lld): %.*s", kind_names[w->kind], w->meta.tag,
                 (long long)w->meta.seq, (int)(sizeof w->err - FSDP_COMM_TAGLEN - 64), err);
        set_broken(w->err);
        w->status = -1;
        done = 1;
      }
      if (!done) {
        left++;
        prev = w;
        pp = &w->next;
        continue;
      }
      *pp = w->next;
      if (g_flying_tail == w) g_flying_tail = prev;
      w->flight = NULL;
      item_done(w);
    }
    if (!all || left == 0) return left;
    beat();
    if (++spins > 50) {  // (the others' data is on its way: wait a little, as the backend's waits do)
      struct timespec ts = {0, 20000};
      nanosleep(&ts, NULL);
    }
  }
}

static void* comm_thread(void* arg) {
  (void)arg;
  int rank = 0, size = 1, local_rank = 0, local_size = 1;
  char err[FSDP_COMM_ERRLEN] = "";
  int rc = g.be->init(&rank, &size, &local_rank, &local_size, beat, err);
  pthread_mutex_lock(&g.mu);
  g.rank = rank;
  g.size = size;
  g.local_rank = local_rank;
  g.local_size = local_size;
  g.init_status = rc;
  snprintf(g.init_err, sizeof g.init_err, "%s", err);
  g.init_done = 1;
  pthread_cond_broadcast(&g.cv_done);
  pthread_mutex_unlock(&g.mu);
  if (rc) return NULL;

  for (;;) {
    pthread_mutex_lock(&g.mu);
    while (!g.head) {
      if (g_flying) {  // hybrid all-reduces running: test them until they finish or work comes
        pthread_mutex_unlock(&g.mu);
        beat();
        if (poll_flying(0)) {
          struct timespec ts = {0, 50000};
          nanosleep(&ts, NULL);
        }
        pthread_mutex_lock(&g.mu);
        continue;
      }
      if (!g.plane_up || !g.plane->in_flight()) {
        pthread_cond_wait(&g.cv_queue, &g.mu);
        continue;
      }
      // device collectives in flight: look at them every 20 ms (a rank that stopped after agreeing
      // leaves them waiting on the device; the plane aborts them after the timeout)
      struct timespec ts;
      clock_gettime(CLOCK_REALTIME, &ts);
      ts.tv_nsec += 20 * 1000000L;
      if (ts.tv_nsec >= 1000000000L) ts.tv_sec++, ts.tv_nsec -= 1000000000L;
      pthread_cond_timedwait(&g.cv_queue, &g.mu, &ts);
      if (g.head || g.broken) continue;
      pthread_mutex_unlock(&g.mu);
      char perr[FSDP_COMM_ERRLEN] = "";
      beat();
      if (g.plane->progress(g.timeout, perr) != 0) set_broken(perr);
      pthread_mutex_lock(&g.mu);
    }
    fsdp_work* w = g.head;
    g.head = w->next;
    if (!g.head) g.tail = NULL;
    pthread_mutex_unlock(&g.mu);

    beat();
    int last = w->kind == FSDP_COLL_FINALIZE;
    if (last) poll_flying(1);  // (every all-reduce in flight ends before the backend does)
    run_work(w);
    beat();
    if (g_flying) poll_flying(0);

    if (last && g.plane_up) {  // (finalize normally ended the plane; not when broken before)
      g.plane->finalize(1);
      g.plane_up = 0;
    }
    if (w->flight) {  // its all-reduce runs on: done once it finished (poll_flying)
      w->next = NULL;
      if (g_flying_tail) g_flying_tail->next = w;
      else g_flying = w;
      g_flying_tail = w;
      continue;
    }
    // (orphaned: its waiter gave up (see wait_done), or nobody waits (plane start): freed)
    item_done(w);
    if (last) return NULL;  // finalize is the last item: nothing may be queued after it
  }
}

// ---- one thread per communicator --------------------------------------------------------------
// Collectives are numbered in call order on each rank; two threads submitting to one communicator
// would number them differently on different ranks (and touch the tensors' refcounts from two
// threads), so every call must come from the thread that initialized it.
static long thread_id(void) { return (long)syscall(SYS_gettid); }

static void thread_label(char* buf, size_t n, pthread_t t, long tid) {
  char name[32] = "";
  if (pthread_getname_np(t, name, sizeof name) != 0) name[0] = 0;
  snprintf(buf, n, "%ld ('%s')", tid, name);
}

// The process that loaded libfsdp. A process fork()ed from it (a DataLoader worker) has a copy of
// the communicator's state but not its thread, and must not start MPI: its collectives are errors.
// (The fork handler marks the child, so the check costs no system call.)
static pid_t g_load_pid;
static int g_forked;
static void mark_forked(void) { g_forked = 1; }
__attribute__((constructor)) static void remember_load_pid(void) {
  g_load_pid = getpid();
  pthread_atfork(NULL, NULL, mark_forked);
}

static int check_process(const char* op, const char* tag) {
  if (!g_forked) return 0;
  CHECK_INT(0,
            "%s%s%s%s: called in process %ld, which was forked from process %ld (a DataLoader worker?); "
            "collectives run only in the process that loaded fsdp",
            op, tag ? " '" : "", tag ? tag : "", tag ? "'" : "", (long)getpid(), (long)g_load_pid);
}

static int check_owner(const char* op, const char* tag) {
  if (check_process(op, tag)) return -1;
  if (!g.initialized || pthread_equal(g.owner, pthread_self())) return 0;
  char a[64], b[64];
  thread_label(a, sizeof a, g.owner, g.owner_tid);
  thread_label(b, sizeof b, pthread_self(), thread_id());
  CHECK_INT(0,
            "%s%s%s%s: the communicator belongs to thread %s (which initialized it), but this call comes from "
            "thread %s; use one communicator from one thread only",
            op, tag ? " '" : "", tag ? tag : "", tag ? "'" : "", a, b);
}

static int comm_finalize(void);

// ---- init / finalize ------------------------------------------------------------------------------
static void comm_atexit(void) {
  if (!g.initialized) return;
  pthread_mutex_lock(&g.mu);
  int was_broken = g.broken;  // then the script already got this error
  pthread_mutex_unlock(&g.mu);
  if (comm_finalize() != 0 && !was_broken)  // exit() may run on any thread
    fprintf(stderr, "fsdp: rank %d: at exit: %s\n", g.rank, fsdp_last_error());
}

// A process that torchrun-style variables say is one of several (RANK, WORLD_SIZE, LOCAL_RANK) but
// that no MPI launcher started would run alone as a world of 1, silently training on its slice
// of the data: that is an error saying how to launch instead.
static int torchrun_env_error(void) {
  static const char* names[] = {"WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE"};
  static const int alone[] = {1, 0, 0, 1};  // the values a single process may carry
  char seen[256] = "";
  int several = 0;
  for (int i = 0; i < 4; i++) {
    const char* v = getenv(names[i]);
    if (!v || !*v) continue;
    size_t l = strlen(seen);
    snprintf(seen + l, sizeof seen - l, "%s%s=%s", l ? " " : "", names[i], v);
    several |= atoi(v) != alone[i];
  }
  if (!several) return 0;
  const char* n = getenv("WORLD_SIZE");
  int np = n && atoi(n) > 1 ? atoi(n) : 2;
  const char* master = getenv("MASTER_ADDR");
  CHECK_INT(0,
            "fsdp.init: %s%s%s say this process is one of several, but no MPI launcher started it; fsdp's ranks "
            "talk over MPI, so start them with it: fsdprun -n %d script.lua (or mpirun -n %d luajit script.lua, "
            "or under Slurm srun --mpi=pmix -n %d luajit script.lua); torchrun's variables are not read",
            seen, master ? " MASTER_ADDR=" : "", master ? master : "", np, np, np);
}

int fsdp_comm_init(const char* backend) {
  const char* want = backend && *backend ? backend : NULL;
  if (check_process("comm init", NULL)) return -1;
  if (g.initialized) {
    if (check_owner("comm init", NULL)) return -1;
    CHECK_INT(!want || strcmp(want, g.be->name) == 0,
              "comm init: already initialized with backend '%s', cannot switch to '%s'", g.be->name, want);
    return 0;
  }
  if (!want) {
    int launched = getenv("OMPI_COMM_WORLD_SIZE") || getenv("PMI_SIZE") || getenv("PMIX_RANK");
    if (!launched && torchrun_env_error()) return -1;
    want = launched ? "mpi" : "self";
  }
  const fsdp_comm_backend* be = NULL;
  if (strcmp(want, "self") == 0) {
    be = &self_backend;
  } else if (strcmp(want, "mpi") == 0) {
    CHECK_INT(
        !g.mpi_finalized,
        "comm init: the mpi communicator was already finalized in this process (MPI cannot be initialized twice)");
    be = load_mpi_backend();
    if (!be) return -1;
  } else {
    CHECK_INT(0, "comm init: unknown backend '%s' (use \"self\" or \"mpi\")", want);
  }

  if (!g.timeout_set) {
    const char* t = getenv("FSDP_COMM_TIMEOUT");
    g.timeout = t && atof(t) > 0 ? atof(t) : 300.0;
  }
  const char* stall = getenv("FSDP_COMM_STALL_AT");
  g.stall_seq = 0;
  if (stall && strchr(stall, ':')) {
    g.stall_rank = atoi(stall);
    g.stall_seq = atoll(strchr(stall, ':') + 1);
  }
  const char* algo = getenv("FSDP_RS_ALGO");
  if (algo && *algo) g.rs_algo = atoi(algo) == 1;

  // keep libfsdp.so mapped until exit: the comm thread runs its code and atexit calls into it,
  // even if LuaJIT dlclose()s it while closing its state
  Dl_info info;
  if (dladdr((void*)&fsdp_comm_init, &info) && info.dli_fname)
    dlopen(info.dli_fname, RTLD_NOW | RTLD_NOLOAD | RTLD_NODELETE);

  g.be = be;
  g.plane = NULL;
  g.plane_mode = -1;
  g.plane_queued = g.plane_up = 0;
  g.init_done = 0;
  g.broken = 0;
  g.seq = 0;
  g.head = g.tail = NULL;
  beat();
  memset(g.counts, 0, sizeof g.counts);
  memset(g.bytes, 0, sizeof g.bytes);
  CHECK_INT(pthread_create(&g.thread, NULL, comm_thread, NULL) == 0,
            "comm init (%s): cannot start the communication thread", be->name);
  pthread_mutex_lock(&g.mu);
  while (!g.init_done) pthread_cond_wait(&g.cv_done, &g.mu);
  int rc = g.init_status;
  pthread_mutex_unlock(&g.mu);
  if (rc) {
    pthread_join(g.thread, NULL);
    CHECK_INT(0, "comm init (%s): %s", be->name, g.init_err);
  }
  g.owner = pthread_self();
  g.owner_tid = thread_id();
  g.initialized = 1;
  fsdp_trace_set_rank(g.rank, g.size);
  if (!g.atexit_registered) {
    atexit(comm_atexit);
    g.atexit_registered = 1;
  }
  return 0;
}

int fsdp_comm_is_initialized(void) { return g.initialized; }
int fsdp_comm_rank(void) { return g.initialized ? g.rank : 0; }
int fsdp_comm_world_size(void) { return g.initialized ? g.size : 1; }
int fsdp_comm_local_rank(void) { return g.initialized ? g.local_rank : 0; }
int fsdp_comm_local_world_size(void) { return g.initialized ? g.local_size : 1; }
const char* fsdp_comm_backend_name(void) { return g.initialized ? g.be->name : ""; }
const char* fsdp_comm_device_plane(void) { return g.plane ? g.plane->name : g.plane_mode == 0 ? "host" : ""; }

static fsdp_work* work_new(int kind, int arg, const char* tag) {
  fsdp_work* w = calloc(1, sizeof *w);
  CHECK_NULL(w, "%s: out of memory", kind_names[kind]);
  w->kind = kind;
  w->arg = arg;
  w->algo = g.rs_algo;
  w->timeout = g.timeout;
  w->meta.kind = kind;
  w->meta.arg = arg;
  w->meta.rank = g.rank;
  w->meta.ndim = -1;
  w->meta.fwd = g.step_fwd;
  w->meta.bwd = g.step_bwd;
  w->meta.phase = g.step_phase;
  snprintf(w->meta.tag, sizeof w->meta.tag, "%s", tag ? tag : "");
  return w;
}
_Static_assert(FSDP_COMM_MAX_DIMS == FSDP_MAX_DIMS, "comm.h's FSDP_COMM_MAX_DIMS must be fsdp.h's FSDP_MAX_DIMS");

// the shape and dtype that every rank must agree on for this collective
static void set_contract(fsdp_work* w, const fsdp_tensor* t) {
  w->meta.dtype = t->dtype;
  w->meta.ndim = t->ndim;
  memcpy(w->meta.shape, t->shape, (size_t)t->ndim * sizeof *t->shape);
}

// drops the tensor refs (caller's thread only); after a success, fills the user's destination
static int work_finish(fsdp_work* w) {
  if (w->finished) return 0;
  w->finished = 1;
  int rc = 0;
  // on a plane: the compute stream's later work (the copy back, reuse of the buffers' memory
  // after the releases below) waits for the collective; the host does not
  if (w->status == 0 && w->finished_ev) w->dev->stream_wait(NULL, w->finished_ev);
  if (w->ready) w->dev->event_free(w->ready);
  if (w->finished_ev) w->dev->event_free(w->finished_ev);
  w->ready = w->finished_ev = NULL;
  if (w->status == 0 && w->copy_back) rc = fsdp_copy_strided(w->copy_back, w->out);
  if (w->out) fsdp_tensor_release(w->out);
  if (w->in) fsdp_tensor_release(w->in);
  if (w->copy_back) fsdp_tensor_release(w->copy_back);
  w->out = w->in = w->copy_back = NULL;
  return rc;
}

static void work_discard(fsdp_work* w) {
  w->status = -1;
  work_finish(w);
  free(w);
}

// numbers, counts and queues a filled work item; NULL (and the item freed) when broken
static fsdp_work* submit(fsdp_work* w, int64_t payload) {
  fsdp_work* start = NULL;  // the plane's start, queued before its first collective
  if (w->meta.plane && w->kind < FSDP_NCOLL) {
    w->dev = fsdp_backend_for(w->meta.device);
    w->ready = w->dev->event_new();
    w->finished_ev = w->dev->event_new();
    if (!g.plane_queued) start = work_new(FSDP_COLL_PLANE_INIT, 0, g.plane->name);
    if (!w->ready || !w->finished_ev || (!g.plane_queued && !start)) {
      fsdp_errorf("%s '%s': cannot create its device events", kind_names[w->kind], w->meta.tag);
      free(start);
      work_discard(w);
      return NULL;
    }
    w->dev->event_record(w->ready, NULL);  // the inputs (and any staging copy) are written
  }
  if (start) {
    start->meta.device = w->meta.device;
    start->meta.plane = w->meta.plane;
    start->orphaned = 1;  // nobody waits for it: the comm thread frees it
    g.plane_queued = 1;
  }
  pthread_mutex_lock(&g.mu);
  if (start && !g.broken) {
    start->meta.seq = ++g.seq;
    if (g.tail) g.tail->next = start;
    else g.head = start;
    g.tail = start;
  } else if (start) {
    free(start);
  }
  if (g.broken) {
    char msg[FSDP_COMM_ERRLEN];
    snprintf(msg, sizeof msg, "%s", g.broken_msg);
    pthread_mutex_unlock(&g.mu);
    work_discard(w);
    fsdp_set_error(msg);
    return NULL;
  }
  w->meta.seq = ++g.seq;
  w->meta.bytes = payload;
  if (w->kind < FSDP_NCOLL) {
    g.counts[w->kind]++;
    g.bytes[w->kind] += payload;
  }
  if (w->kind == FSDP_COLL_REDUCE_SCATTER && w->meta.group == FSDP_GROUP_HYBRID &&
      fsdp_comm_group_size(FSDP_GROUP_REPLICA) > 1) {  // its all-reduce over the replicas
    g.counts[FSDP_COLL_ALL_REDUCE]++;
    g.bytes[FSDP_COLL_ALL_REDUCE] += (int64_t)(w->count * sizeof(float));
  }
  if (fsdp_trace_enabled() && w->kind < FSDP_NCOLL) {
    char name[160];
    trace_name(name, sizeof name, "issue ", w);
    fsdp_trace_instant(FSDP_TRACE_COMPUTE, name, payload);
  }
  if (g.tail) g.tail->next = w;
  else g.head = w;
  g.tail = w;
  pthread_cond_signal(&g.cv_queue);
  pthread_mutex_unlock(&g.mu);
  return w;
}

static int ensure_init(const char* op, const char* tag) {
  if (g.initialized) return check_owner(op, tag);
  if (fsdp_comm_init(NULL) == 0) return 0;
  char msg[FSDP_COMM_ERRLEN];
  snprintf(msg, sizeof msg, "%s", fsdp_last_error());
  CHECK_INT(0, "%s: %s", op, msg);
}

// waits until the comm thread finished w; 0, or -1 when the comm thread made no progress for
// 1.5 * timeout + 10 s (its own waits are bounded by the timeout, so it is stuck somewhere no
// deadline reaches): then the communicator is broken, w->err says why, and w stays the thread's
static int wait_done(fsdp_work* w) {
  double limit = 1.5 * w->timeout + 10.0;
  pthread_mutex_lock(&g.mu);
  while (!w->done) {
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    ts.tv_sec += 1;
    pthread_cond_timedwait(&g.cv_done, &g.mu, &ts);
    double idle = mono_s() - 1e-3 * (double)__atomic_load_n(&g.beat_ms, __ATOMIC_RELAXED);
    if (w->done || idle <= limit) continue;
    snprintf(w->err, sizeof w->err,
             "%s '%s' (collective #%lld): the communication thread made no progress for %.0f s (timeout %g s); "
             "the communicator is broken",
             kind_names[w->kind], w->meta.tag, (long long)w->meta.seq, idle, w->timeout);
    if (!g.broken) {
      g.broken = 1;
      snprintf(g.broken_msg, sizeof g.broken_msg, "%s", w->err);
    }
    pthread_mutex_unlock(&g.mu);
    return -1;
  }
  pthread_mutex_unlock(&g.mu);
  return 0;
}

// gives w to the comm thread for good when it is still running it (wait_done failed)
static int orphan_if_running(fsdp_work* w) {
  pthread_mutex_lock(&g.mu);
  int running = !w->done;
  if (running) w->orphaned = 1;
  pthread_mutex_unlock(&g.mu);
  return running;
}

int fsdp_comm_finalize(void) {
  if (check_owner("comm finalize", NULL)) return -1;
  return comm_finalize();
}

static int comm_finalize(void) {
  if (!g.initialized) return 0;
  fsdp_work* w = work_new(FSDP_COLL_FINALIZE, 0, "");
  CHECK_INT(w, "comm finalize: out of memory");
  pthread_mutex_lock(&g.mu);
  w->meta.seq = ++g.seq;
  if (g.tail) g.tail->next = w;
  else g.head = w;
  g.tail = w;
  pthread_cond_signal(&g.cv_queue);
  pthread_mutex_unlock(&g.mu);
  // the thread drains everything queued before, then agrees and finalizes
  if (wait_done(w) != 0) {  // stuck: leave it (exit ends it), never join
    char msg[FSDP_COMM_ERRLEN];
    snprintf(msg, sizeof msg, "%s", w->err);
    if (!orphan_if_running(w)) free(w);
    pthread_detach(g.thread);
    g.initialized = 0;
    if (g.be != &self_backend) g.mpi_finalized = 1;
    CHECK_INT(0, "comm finalize: %s", msg);
  }
  pthread_join(g.thread, NULL);
  g.initialized = 0;
  if (g.be != &self_backend) g.mpi_finalized = 1;  // finalized, or abandoned after an error: no second init
  int rc = w->status;
  if (rc) fsdp_errorf("comm finalize: %s", w->err);
  free(w);
  return rc ? -1 : 0;
}

// ---- argument checks shared by the collectives ------------------------------------------------------
static int check_tensor(const char* op, const char* what, const fsdp_tensor* t) {
  CHECK_INT(t, "%s: %s is NULL", op, what);
  return 0;
}

// The host backends move host memory. A tensor on a device without a data plane (a GPU's, with
// collectives over MPI: ranks sharing one GPU) is staged through the host: its bytes are copied
// to a host buffer on the caller's thread before the collective, and the result copied back at
// wait, so the comm thread never touches device memory. With a plane (meta.plane) the buffers are
// contiguous memory of the device: the same copies (device to device, or across for CPU offload)
// run on the compute stream, before submit records `ready`, and after wait's stream wait.

// which device's memory the collective reads and writes, and how it moves; -1 with the error set
// (collectives within groups always move through the host backend, whose groups they are)
// A reduction by max always goes through the host: NCCL's max is fmaxf, which drops a NaN wherever
// another rank has a number, and "max" keeps it (the host backend's own op; a NaN gradient on one GPU
// must reach an inf-norm clip). Such reductions are small (norms), so the staging costs little.
static int route(fsdp_work* w, const fsdp_tensor* t) {
  int by_max = (w->kind == FSDP_COLL_ALL_REDUCE || w->kind == FSDP_COLL_REDUCE_SCATTER) && w->arg == FSDP_REDUCE_MAX;
  int plane = w->meta.group || by_max ? 0 : plane_for(fsdp_device_of(t), kind_names[w->kind], w->meta.tag);
  if (plane < 0) return -1;
  w->meta.device = (int16_t)fsdp_device_of(t);
  w->meta.plane = (int16_t)plane;
  return 0;
}
static int work_device(const fsdp_work* w) { return w->meta.plane ? w->meta.device : FSDP_CPU; }

// a contiguous version of t in the memory of `device` (new ref: t itself when it is one); no
// autograd involved
static fsdp_tensor* contig(fsdp_tensor* t, int device) {
  if (fsdp_tensor_is_contiguous(t) && fsdp_device_of(t) == device) {
    fsdp_tensor_retain(t);
    return t;
  }
  return fsdp_copy_to_device(t, device);
}

// the destination the backend writes: t itself when contiguous memory where the collective moves
// data, else a temp there, copied back at wait
static int set_dest(fsdp_work* w, fsdp_tensor* t, int copy_in) {
  fsdp_bump_version(t);
  int device = work_device(w);
  if (fsdp_tensor_is_contiguous(t) && fsdp_device_of(t) == device) {
    fsdp_tensor_retain(t);
    w->out = t;
  } else {
    w->out = copy_in ? contig(t, device) : fsdp_new(t->ndim, t->shape, t->dtype, device);
    if (!w->out) return -1;
    fsdp_tensor_retain(t);
    w->copy_back = t;
  }
  w->out_ptr = fsdp_ptr(w->out);
  return 0;
}

static int set_src(fsdp_work* w, fsdp_tensor* t) {
  w->in = contig(t, work_device(w));
  if (!w->in) return -1;
  w->in_ptr = fsdp_ptr(w->in);
  return 0;
}

static int check_op(const char* op, int reduce) {
  CHECK_INT(reduce >= FSDP_REDUCE_SUM && reduce <= FSDP_REDUCE_MAX,
            "%s: unknown reduce op %d (0 = sum, 1 = avg, 2 = max)", op, reduce);
  return 0;
}

// ---- the collectives ---------------------------------------------------------------------------------
// ---- groups (hybrid sharding) ------------------------------------------------------------------------
int fsdp_comm_set_groups(int size) {
  if (ensure_init("comm set_groups", NULL)) return -1;
  CHECK_INT(size >= 1 && g.size % size == 0,
            "hybrid sharding: a shard group of %d ranks does not divide the world of %d ranks", size, g.size);
  if (g.group_size) {
    CHECK_INT(g.group_size == size,
              "hybrid sharding: the shard groups are of %d ranks already; every hybrid unit uses the same size "
              "(got %d)",
              g.group_size, size);
    return 0;
  }
  fsdp_work* w = work_new(FSDP_COLL_GROUPS, size, "groups");
  if (!w) return -1;
  if (!submit(w, 0)) return -1;
  int rc = fsdp_work_wait(w);
  fsdp_work_free(w);
  if (rc == 0) g.group_size = size;
  return rc;
}
int fsdp_comm_group_size(int group) {
  int gs = g.group_size ? g.group_size : g.size;
  return group == FSDP_GROUP_WORLD ? g.size : group == FSDP_GROUP_REPLICA ? g.size / gs : gs;
}
int fsdp_comm_group_rank(int group) {
  int gs = g.group_size ? g.group_size : g.size;
  return group == FSDP_GROUP_WORLD ? g.rank : group == FSDP_GROUP_REPLICA ? g.rank / gs : g.rank % gs;
}
static int check_group(const char* op, const char* tag, int group, int hybrid_ok) {
  CHECK_INT(group >= FSDP_GROUP_WORLD && group <= (hybrid_ok ? FSDP_GROUP_HYBRID : FSDP_GROUP_REPLICA),
            "%s '%s': unknown group %d", op, tag ? tag : "", group);
  CHECK_INT(group == FSDP_GROUP_WORLD || g.group_size, "%s '%s': no groups made (fsdp_comm_set_groups)", op,
            tag ? tag : "");
  return 0;
}

fsdp_work* fsdp_all_gather(fsdp_tensor* out, fsdp_tensor* in, const char* tag) {
  return fsdp_all_gather_group(out, in, FSDP_GROUP_WORLD, tag);
}
fsdp_work* fsdp_all_gather_group(fsdp_tensor* out, fsdp_tensor* in, int group, const char* tag) {
  const char* op = "all_gather";
  if (ensure_init(op, tag) || check_tensor(op, "out", out) || check_tensor(op, "in", in) ||
      check_group(op, tag, group, 0))
    return NULL;
  int64_t n = fsdp_tensor_numel(in), N = fsdp_comm_group_size(group), gr = fsdp_comm_group_rank(group);
  CHECK_NULL(out->dtype == in->dtype, "all_gather '%s': out %s %s and in %s %s differ in dtype", tag ? tag : "",
             SH(out), DT(out), SH(in), DT(in));
  CHECK_NULL(fsdp_tensor_numel(out) == N * n,
             "all_gather '%s': out %s has %lld elements but %lld ranks x in %s need %lld (%s)", tag ? tag : "", SH(out),
             (long long)fsdp_tensor_numel(out), (long long)N, SH(in), (long long)(N * n), DT(in));
  size_t es = fsdp_dtype_size(in->dtype), bytes = (size_t)n * es;
  if (out->storage == in->storage && bytes > 0) {  // `in` may only be this rank's slot of `out`
    const char *o = fsdp_ptr(out), *i = fsdp_ptr(in);
    int in_place = fsdp_tensor_is_contiguous(out) && fsdp_tensor_is_contiguous(in) && i == o + gr * bytes;
    int disjoint = i + bytes <= o || i >= o + N * bytes;
    CHECK_NULL(in_place || disjoint || !fsdp_tensor_is_contiguous(out),
               "all_gather '%s': in %s overlaps out %s but is not rank %d's slot of it", tag ? tag : "", SH(in),
               SH(out), (int)gr);
  }
  fsdp_work* w = work_new(FSDP_COLL_ALL_GATHER, 0, tag);
  if (!w) return NULL;
  w->meta.group = group;
  set_contract(w, in);
  w->count = bytes;
  if (route(w, out) || set_src(w, in) || set_dest(w, out, 0)) {
    work_discard(w);
    return NULL;
  }
  return submit(w, (int64_t)(N * bytes));
}

fsdp_work* fsdp_reduce_scatter(fsdp_tensor* out, fsdp_tensor* in, int reduce, const char* tag) {
  return fsdp_reduce_scatter_group(out, in, reduce, FSDP_GROUP_WORLD, tag);
}
fsdp_work* fsdp_reduce_scatter_group(fsdp_tensor* out, fsdp_tensor* in, int reduce, int group, const char* tag) {
  const char* op = "reduce_scatter";
  if (ensure_init(op, tag) || check_tensor(op, "out", out) || check_tensor(op, "in", in) || check_op(op, reduce) ||
      fsdp_check_f32(op, in) || fsdp_check_f32(op, out) || check_group(op, tag, group, 1))
    return NULL;
  int64_t n = fsdp_tensor_numel(out), N = fsdp_comm_group_size(group == FSDP_GROUP_HYBRID ? FSDP_GROUP_SHARD : group);
  CHECK_NULL(fsdp_tensor_numel(in) == N * n,
             "reduce_scatter '%s': in %s has %lld elements but %lld ranks x out %s need %lld (%s)", tag ? tag : "",
             SH(in), (long long)fsdp_tensor_numel(in), (long long)N, SH(out), (long long)(N * n), DT(in));
  fsdp_work* w = work_new(FSDP_COLL_REDUCE_SCATTER, reduce, tag);
  if (!w) return NULL;
  w->meta.group = group;
  set_contract(w, out);
  w->count = (size_t)n;
  if (route(w, in) || set_src(w, in) || set_dest(w, out, 0)) {
    work_discard(w);
    return NULL;
  }
  return submit(w, N * n * (int64_t)fsdp_dtype_size(w->meta.dtype));
}

fsdp_work* fsdp_all_reduce(fsdp_tensor* t, int reduce, const char* tag) {
  const char* op = "all_reduce";
  if (ensure_init(op, tag) || check_tensor(op, "tensor", t) || check_op(op, reduce) || fsdp_check_f32(op, t))
    return NULL;
  fsdp_work* w = work_new(FSDP_COLL_ALL_REDUCE, reduce, tag);
  if (!w) return NULL;
  set_contract(w, t);
  w->count = (size_t)fsdp_tensor_numel(t);
  if (route(w, t) || set_dest(w, t, 1)) {
    work_discard(w);
    return NULL;
  }
  return submit(w, (int64_t)(w->count * fsdp_dtype_size(w->meta.dtype)));
}

fsdp_work* fsdp_broadcast(fsdp_tensor* t, int root, const char* tag) {
  const char* op = "broadcast";
  if (ensure_init(op, tag) || check_tensor(op, "tensor", t)) return NULL;
  CHECK_NULL(root >= 0 && root < g.size, "broadcast '%s': root %d is not a rank (world size %d; %s %s)", tag ? tag : "",
             root, g.size, SH(t), DT(t));
  fsdp_work* w = work_new(FSDP_COLL_BROADCAST, root, tag);
  if (!w) return NULL;
  set_contract(w, t);
  w->count = (size_t)fsdp_tensor_numel(t) * fsdp_dtype_size(t->dtype);
  if (route(w, t) || set_dest(w, t, 1)) {
    work_discard(w);
    return NULL;
  }
  return submit(w, (int64_t)w->count);
}

fsdp_work* fsdp_barrier_async(const char* tag) {
  if (ensure_init("barrier", tag)) return NULL;
  fsdp_work* w = work_new(FSDP_COLL_BARRIER, 0, tag);
  if (!w) return NULL;
  return submit(w, 0);
}

// a barrier at which every rank must hold a tensor of t's shape and dtype (t is not sent)
fsdp_work* fsdp_comm_agree_shape(const fsdp_tensor* t, const char* tag) {
  if (ensure_init("shape check", tag)) return NULL;
  fsdp_work* w = work_new(FSDP_COLL_BARRIER, 0, tag);
  if (!w) return NULL;
  set_contract(w, t);
  return submit(w, 0);
}

// the bootstrap of a device data plane alone (no device needed): every rank gets the digest of
// the connection ids rank 0 made (tests, diagnostics: "can these ranks bootstrap NCCL?")
int fsdp_comm_plane_bootstrap(const char* plane, char* digest) {
  CHECK_INT(plane, "plane bootstrap: NULL plane name");
  if (ensure_init("plane bootstrap", plane)) return -1;
  const fsdp_comm_plane* p = NULL;
  if (strcmp(plane, "nccl") == 0) p = load_nccl_plane();
  else if (strcmp(plane, "standin") == 0) p = fsdp_comm_standin_plane();
  else CHECK_INT(0, "plane bootstrap: unknown plane '%s' (use \"nccl\" or \"standin\")", plane);
  if (!p) {
    char msg[FSDP_COMM_ERRLEN];
    snprintf(msg, sizeof msg, "%s", fsdp_last_error());
    CHECK_INT(0, "plane bootstrap: %s", msg);
  }
  fsdp_work* w = work_new(FSDP_COLL_PLANE_BOOT, 0, plane);
  if (!w) return -1;
  w->boot = p;
  w->meta.plane = (int16_t)p->id;
  if (!submit(w, 0)) return -1;
  int rc = fsdp_work_wait(w);
  if (rc == 0) snprintf(digest, 17, "%s", w->digest);
  fsdp_work_free(w);
  return rc;
}

int fsdp_barrier(void) { return fsdp_work_finish(fsdp_barrier_async("barrier")); }
int fsdp_work_finish(fsdp_work* w) {
  int rc = w ? fsdp_work_wait(w) : -1;
  fsdp_work_free(w);
  return rc;
}

// ---- work handles ------------------------------------------------------------------------------------
int fsdp_work_wait(fsdp_work* w) {
  CHECK_INT(w, "work wait: NULL work handle");
  if (check_owner("work wait", w->meta.tag)) return -1;
  double t0 = fsdp_trace_enabled() ? fsdp_trace_now() : 0;
  if (wait_done(w) != 0) CHECK_INT(0, "%s", w->err);
  int rc = work_finish(w);
  if (fsdp_trace_enabled() && !w->traced_wait && w->kind < FSDP_NCOLL) {
    char name[160];
    trace_name(name, sizeof name, "wait ", w);
    fsdp_trace_span(FSDP_TRACE_COMPUTE, name, t0, -1);
    w->traced_wait = 1;
  }
  CHECK_INT(w->status == 0, "%s", w->err);
  return rc;
}

int fsdp_work_test(fsdp_work* w) {
  if (!w) return 1;
  pthread_mutex_lock(&g.mu);
  int done = w->done;
  pthread_mutex_unlock(&g.mu);
  return done;
}

void fsdp_work_free(fsdp_work* w) {
  if (!w || check_owner("work free", w->meta.tag)) return;  // refused: leaked, never raced
  if (wait_done(w) != 0 && orphan_if_running(w)) return;
  work_finish(w);
  free(w);
}

// ---- stats and settings --------------------------------------------------------------------------------
void fsdp_comm_stats(int64_t* counts, int64_t* bytes) {
  pthread_mutex_lock(&g.mu);
  for (int k = 0; k < FSDP_NCOLL; k++) {
    if (counts) counts[k] = g.counts[k];
    if (bytes) bytes[k] = g.bytes[k];
  }
  pthread_mutex_unlock(&g.mu);
}

void fsdp_comm_reset_stats(void) {
  pthread_mutex_lock(&g.mu);
  memset(g.counts, 0, sizeof g.counts);
  memset(g.bytes, 0, sizeof g.bytes);
  pthread_mutex_unlock(&g.mu);
}

void fsdp_comm_set_timeout(double seconds) {
  g.timeout = seconds > 0 ? seconds : 300.0;
  g.timeout_set = 1;
}

void fsdp_comm_set_reduce_scatter_algo(int algo) { g.rs_algo = algo == 1; }

void fsdp_comm_set_step(int64_t fwd, int64_t bwd, int phase) {
  g.step_fwd = fwd;
  g.step_bwd = bwd;
  g.step_phase = phase;
}
