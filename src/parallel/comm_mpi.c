/*
 * parallel/comm_mpi.c -- the "mpi" communication backend, built into its own libfsdp_mpi.so (linked with
 * MPI) so that libfsdp.so never depends on MPI; comm.c dlopen()s it on demand and takes the table
 * returned by fsdp_comm_mpi_backend(). Every function here runs on libfsdp's communication
 * thread, the one thread that calls MPI (so MPI_THREAD_FUNNELED is enough).
 *
 * Two duplicates of MPI_COMM_WORLD: `meta` carries the collective check (records to rank 0,
 * verdicts back, all non-blocking and polled against a deadline so a missing rank is named,
 * never waited for forever), `data` carries the payloads.
 *
 * Every rank that waits for a stopped one fails within timeout_s + WAIT_MARGIN_S of the start of
 * its wait (docs/environment.md). Rank 0 decides the agreement at its deadline; a rank
 * r != 0 waits for that verdict timeout_s + WAIT_MARGIN_S, and longer only after a note from rank
 * 0 (sent once rank 0 has waited NOTE_AFTER_S with r's record in hand: it is running, waiting for
 * others, and decides within timeout_s of the note), so a late rank 0 is not blamed for a missing
 * rank 2 while a stopped rank 0 costs the others no more than the margin.
 *
 * Every wait is bounded. The payloads move by non-blocking calls (Iallgather, Iallreduce, Ibcast,
 * Ireduce_scatter_block, Isend/Irecv for the ring), each polled with MPI_Test against a deadline
 * of timeout_s from its start, so a rank that stops after the ranks agreed (SIGSTOP, a debugger)
 * makes the others fail instead of blocking in MPI forever. After such a timeout the ranks that are
 * still running tell each other so (TAG_ALIVE on `meta`, for a short grace); the ones not heard
 * from are named as missing (with 2 ranks: the other one). The abandoned requests are never
 * progressed again: comm.c marks the communicator broken and makes no further backend call.
 *
 * Reduce-scatter, algorithm 0 (default): a ring. With N ranks and chunk c = in[c*n .. (c+1)*n),
 * at step s (0 .. N-2) rank r sends its partial sum of chunk r-s-1 to rank r+1 and receives the
 * partial sum of chunk r-s-2 from rank r-1, adding its own contribution; after N-1 steps it holds
 * the full reduction of chunk r. Algorithm 1 is MPI_Reduce_scatter_block, kept for comparison
 * (bench/comm.lua measures both).
 */
#include "parallel/comm.h"

#include <mpi.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define TAG_META 11
#define TAG_VERDICT 12
#define TAG_RING 13
#define TAG_ALIVE 14
#define WAIT_MARGIN_S 0.5    // the most a wait for a stopped rank lasts beyond the timeout
#define NOTE_AFTER_S 0.1     // rank 0 notes the ranks it has heard from after waiting this long
#define STATUS_NOTE (-1)     // a verdict's status in rank 0's note: "still waiting for others"
#define MAX_PIECE (1 << 28)  // elements per MPI call, under INT_MAX bytes for the byte paths too

static MPI_Comm meta_comm = MPI_COMM_NULL, data_comm = MPI_COMM_NULL;
// "max" is NaN-propagating, as torch.max over the ranks' values taken together: MPI_MAX is
// OpenMPI's (a > b ? a : b), which keeps or drops a NaN by the order the ranks combine in (a NaN
// gradient on rank 1 gave an inf-norm clip a finite norm)
static MPI_Op g_op_max = MPI_OP_NULL;
static int g_rank, g_size, g_we_initialized;
// the data communicators by fsdp_comm_group (WORLD: data_comm; SHARD, REPLICA: after set_groups),
// with this rank's place and their sizes
static MPI_Comm g_comm[3] = {MPI_COMM_NULL, MPI_COMM_NULL, MPI_COMM_NULL};
static int g_grank[3], g_gsize[3];
static fsdp_comm_meta* g_all;  // rank 0: every rank's record
static int* g_arrived;
static int* g_noted;  // rank 0: the ranks its note went to in this agreement
static MPI_Request* g_reqs;
static int* g_idx;
static fsdp_comm_meta g_mine;  // non-blocking buffers stay valid even if abandoned after a timeout
static fsdp_comm_verdict g_verdict;
static float *g_scratch_a, *g_scratch_b;
static size_t g_scratch_n;
static void (*g_beat)(void);  // tells comm.c this thread is making progress
static double g_timeout = 300.0;

static const char* kind_name(int k) {
  static const char* names[] = {"all_gather", "reduce_scatter", "all_reduce", "broadcast", "barrier", "shutdown"};
  return k >= 0 && k <= FSDP_COLL_FINALIZE ? names[k] : "collective";
}

static double now_s(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return ts.tv_sec + 1e-9 * ts.tv_nsec;
}

// polling back-off: spin briefly (answers usually come within microseconds), then yield the
// core (ranks often share cores), then sleep in short naps
static void backoff(int* spins) {
  int s = (*spins)++;
  if (s < 50) return;
  if (s < 2000) {
    sched_yield();
    return;
  }
  struct timespec ts = {0, s < 20000 ? 20000 : 200000};
  nanosleep(&ts, NULL);
}

static int mpi_fail(char* err, int rc, const char* what) {
  char s[MPI_MAX_ERROR_STRING];
  int len = 0;
  MPI_Error_string(rc, s, &len);
  snprintf(err, FSDP_COMM_ERRLEN, "%s failed: %s", what, s);
  return -1;
}
#define MPI_TRY(call, what)                                  \
  do {                                                       \
    int rc_ = (call);                                        \
    if (rc_ != MPI_SUCCESS) return mpi_fail(err, rc_, what); \
  } while (0)

// ---- bounded waits ----------------------------------------------------------------------------------
// After a data-phase timeout: which ranks are still running? Every rank that timed out sends its
// rank to every other on `meta` and listens for the others for WAIT_MARGIN_S; "rank 2" or
// "ranks 1, 3" (the ones not heard from; with 2 ranks, simply the other one). Happens at most once
// per process (the communicator is broken afterwards), so the static buffers are never reused.
static void name_missing(char* who, size_t n) {
  static int mine;
  int N = g_size, nmiss = 0;
  size_t len = 0;
  if (N == 2) {
    snprintf(who, n, "rank %d", 1 - g_rank);
    return;
  }
  int* theirs = calloc(N, sizeof *theirs);
  MPI_Request* rr = calloc(N, sizeof *rr);
  if (!theirs || !rr) {
    free(theirs);
    free(rr);
    snprintf(who, n, "another rank");
    return;
  }
  mine = g_rank;
  for (int r = 0; r < N; r++) {
    rr[r] = MPI_REQUEST_NULL;
    if (r == g_rank) continue;
    MPI_Request sreq;
    MPI_Isend(&mine, 1, MPI_INT, r, TAG_ALIVE, meta_comm, &sreq);
    MPI_Request_free(&sreq);
    MPI_Irecv(&theirs[r], 1, MPI_INT, r, TAG_ALIVE, meta_comm, &rr[r]);
  }
  double deadline = now_s() + WAIT_MARGIN_S;
  int spins = 0, flag = 0;
  while (now_s() < deadline) {
    MPI_Testall(N, rr, &flag, MPI_STATUSES_IGNORE);
    if (flag) break;
    backoff(&spins);
  }
  for (int r = 0; r < N; r++) {
    int heard = r == g_rank;
    if (!heard) MPI_Test(&rr[r], &heard, MPI_STATUS_IGNORE);
    if (heard) continue;
    len += snprintf(who + len, len < n ? n - len : 0, "%s%d", nmiss++ ? ", " : "", r);
  }
  if (nmiss == 0) {
    snprintf(who, n, "another rank (every rank answered after the timeout)");
  } else {  // "ranks " / "rank " in front
    char tmp[200];
    snprintf(tmp, sizeof tmp, "%.190s", who);
    snprintf(who, n, "%s%.190s", nmiss > 1 ? "ranks " : "rank ", tmp);
  }
  free(theirs);
  free(rr);  // the unfinished receives are abandoned with the broken communicator
}

// polls n requests until all completed; after timeout_s without them: -1, err names the missing ranks
static int wait_all(MPI_Request* reqs, int n, const char* what, char* err) {
  double deadline = now_s() + g_timeout;
  int spins = 0;
  for (;;) {
    int flag = 0;
    int rc = MPI_Testall(n, reqs, &flag, MPI_STATUSES_IGNORE);
    if (rc != MPI_SUCCESS) return mpi_fail(err, rc, what);
    if (flag) break;
    if (now_s() > deadline) {
      char who[256];
      name_missing(who, sizeof who);
      snprintf(err, FSDP_COMM_ERRLEN, "timed out after %g s waiting for %s to move the data (%s)", g_timeout, who,
               what);
      return -1;
    }
    backoff(&spins);
  }
  if (g_beat) g_beat();
  return 0;
}

// ---- init / finalize ----------------------------------------------------------------------------
static void reduce_f32(float* dst, const float* a, const float* b, size_t n, int op);
// g_op_max's function: inout = in max inout for MPI_FLOAT, by the ring's rule (reduce_f32)
static void max_f32_op(void* in, void* inout, int* len, MPI_Datatype* type) {
  (void)type;
  reduce_f32(inout, in, inout, (size_t)*len, FSDP_REDUCE_MAX);
}
static MPI_Op mpi_op(int op) { return op == FSDP_REDUCE_MAX ? g_op_max : MPI_SUM; }

static int mpi_init(int* rank, int* size, int* local_rank, int* local_size, void (*beat)(void), char* err) {
  int inited = 0, provided = 0;
  g_beat = beat;
  MPI_Initialized(&inited);
  if (!inited) {
    MPI_TRY(MPI_Init_thread(NULL, NULL, MPI_THREAD_FUNNELED, &provided), "MPI_Init_thread");
    g_we_initialized = 1;
  } else {
    MPI_Query_thread(&provided);
    if (provided < MPI_THREAD_SERIALIZED) {
      snprintf(err, FSDP_COMM_ERRLEN,
               "MPI was initialized outside fsdp with thread level %d; fsdp calls MPI "
               "from its communication thread and needs MPI_THREAD_SERIALIZED or let it initialize MPI",
               provided);
      return -1;
    }
  }
  MPI_Comm_set_errhandler(MPI_COMM_WORLD, MPI_ERRORS_RETURN);
  MPI_TRY(MPI_Op_create(max_f32_op, 1, &g_op_max), "MPI_Op_create");
  MPI_TRY(MPI_Comm_dup(MPI_COMM_WORLD, &meta_comm), "MPI_Comm_dup");
  MPI_TRY(MPI_Comm_dup(MPI_COMM_WORLD, &data_comm), "MPI_Comm_dup");
  MPI_Comm_set_errhandler(meta_comm, MPI_ERRORS_RETURN);
  MPI_Comm_set_errhandler(data_comm, MPI_ERRORS_RETURN);
  MPI_Comm_rank(data_comm, &g_rank);
  MPI_Comm_size(data_comm, &g_size);
  g_comm[0] = data_comm;
  g_grank[0] = g_rank;
  g_gsize[0] = g_size;
  g_all = calloc(g_size, sizeof *g_all);
  g_arrived = calloc(g_size, sizeof *g_arrived);
  g_noted = calloc(g_size, sizeof *g_noted);
  g_reqs = calloc(g_size, sizeof *g_reqs);
  g_idx = calloc(g_size, sizeof *g_idx);
  if (!g_all || !g_arrived || !g_noted || !g_reqs || !g_idx) {
    snprintf(err, FSDP_COMM_ERRLEN, "out of memory for %d ranks", g_size);
    return -1;
  }
  // the ranks of this node: those that share memory with this one (whatever launched them)
  MPI_Comm node;
  MPI_TRY(MPI_Comm_split_type(MPI_COMM_WORLD, MPI_COMM_TYPE_SHARED, g_rank, MPI_INFO_NULL, &node),
          "MPI_Comm_split_type");
  MPI_Comm_rank(node, local_rank);
  MPI_Comm_size(node, local_size);
  MPI_Comm_free(&node);
  *rank = g_rank;
  *size = g_size;
  return 0;
}

// shard groups: ranks [k * size, (k + 1) * size); replica groups: the ranks r with r % size alike
static int mpi_set_groups(int size, char* err) {
  MPI_TRY(MPI_Comm_split(data_comm, g_rank / size, g_rank, &g_comm[1]), "MPI_Comm_split (shard groups)");
  MPI_TRY(MPI_Comm_split(data_comm, g_rank % size, g_rank, &g_comm[2]), "MPI_Comm_split (replica groups)");
  for (int k = 1; k < 3; k++) {
    MPI_Comm_set_errhandler(g_comm[k], MPI_ERRORS_RETURN);
    MPI_Comm_rank(g_comm[k], &g_grank[k]);
    MPI_Comm_size(g_comm[k], &g_gsize[k]);
  }
  return 0;
}

static void mpi_finalize(void) {
  for (int k = 1; k < 3; k++)
    if (g_comm[k] != MPI_COMM_NULL) MPI_Comm_free(&g_comm[k]);
  g_comm[0] = MPI_COMM_NULL;
  MPI_Comm_free(&meta_comm);
  MPI_Comm_free(&data_comm);
  if (g_op_max != MPI_OP_NULL) MPI_Op_free(&g_op_max);
  if (g_we_initialized) MPI_Finalize();
  free(g_all);
  free(g_arrived);
  free(g_noted);
  free(g_reqs);
  free(g_idx);
  free(g_scratch_a);
  free(g_scratch_b);
  g_all = NULL;
  g_arrived = NULL;
  g_noted = NULL;
  g_reqs = NULL;
  g_idx = NULL;
  g_scratch_a = g_scratch_b = NULL;
  g_scratch_n = 0;
}

// ---- the collective check ------------------------------------------------------------------------
// rank 0, waiting for records: tells each rank it has heard from that it runs and waits for others
// (once per rank and agreement; the verdict follows on the same tag, so it arrives after the note)
static void note_waiting(int N) {
  static const fsdp_comm_verdict note = {STATUS_NOTE, ""};
  for (int r = 1; r < N; r++) {
    if (!g_arrived[r] || g_noted[r]) continue;
    MPI_Request req;
    MPI_Isend(&note, (int)offsetof(fsdp_comm_verdict, msg) + 1, MPI_BYTE, r, TAG_VERDICT, meta_comm, &req);
    MPI_Request_free(&req);
    g_noted[r] = 1;
  }
}

static int agree_root(double timeout_s, fsdp_comm_decide_fn decide, fsdp_comm_verdict* v) {
  int N = g_size, remaining = N - 1, timed_out = 0, spins = 0;
  g_all[0] = g_mine;
  g_arrived[0] = 1;
  for (int r = 1; r < N; r++) {
    g_arrived[r] = g_noted[r] = 0;
    MPI_Irecv(&g_all[r], sizeof *g_all, MPI_BYTE, r, TAG_META, meta_comm, &g_reqs[r - 1]);
  }
  double start = now_s(), deadline = start + timeout_s;
  while (remaining > 0) {
    int outcount = 0;
    MPI_Testsome(N - 1, g_reqs, &outcount, g_idx, MPI_STATUSES_IGNORE);
    if (outcount == MPI_UNDEFINED) break;
    for (int i = 0; i < outcount; i++) g_arrived[g_idx[i] + 1] = 1;
    remaining -= outcount;
    if (remaining == 0) break;
    if (outcount > 0) spins = 0;
    if (now_s() > start + NOTE_AFTER_S) note_waiting(N);
    if (now_s() > deadline) {
      timed_out = 1;
      break;
    }
    backoff(&spins);
  }
  if (timed_out) {  // abandon the receives of the ranks that never came
    for (int r = 1; r < N; r++) {
      if (g_arrived[r]) continue;
      MPI_Cancel(&g_reqs[r - 1]);
      MPI_Request_free(&g_reqs[r - 1]);
    }
  }
  decide(g_all, g_arrived, N, timed_out, timeout_s, v);

  // the verdict: status + message, sent only as long as it is
  int len = (int)(offsetof(fsdp_comm_verdict, msg) + strlen(v->msg) + 1);
  int nwait = 0;
  for (int r = 1; r < N; r++) {
    if (g_arrived[r]) {
      MPI_Isend(v, len, MPI_BYTE, r, TAG_VERDICT, meta_comm, &g_reqs[nwait++]);
    } else {  // a late rank finds the verdict waiting and fails at once; the copy is never freed
      fsdp_comm_verdict* copy = malloc(sizeof *copy);
      if (!copy) continue;
      memcpy(copy, v, sizeof *copy);
      MPI_Request req;
      MPI_Isend(copy, len, MPI_BYTE, r, TAG_VERDICT, meta_comm, &req);
      MPI_Request_free(&req);
    }
  }
  // the arrived ranks posted their receives before sending their records: these complete (but
  // a rank may stop right now; then the verdict is abandoned, and the data phase names it)
  spins = 0;
  deadline = now_s() + timeout_s;
  for (;;) {
    int flag = 0;
    MPI_Testall(nwait, g_reqs, &flag, MPI_STATUSES_IGNORE);
    if (flag || now_s() > deadline) break;
    backoff(&spins);
  }
  if (g_beat) g_beat();
  return 0;
}

static int agree_other(double timeout_s, fsdp_comm_verdict* v) {
  MPI_Request rreq, sreq;
  MPI_Irecv(&g_verdict, sizeof g_verdict, MPI_BYTE, 0, TAG_VERDICT, meta_comm, &rreq);
  MPI_Isend(&g_mine, sizeof g_mine, MPI_BYTE, 0, TAG_META, meta_comm, &sreq);
  // rank 0 decides at its own deadline and names the missing ranks; its note says it is waiting
  // (then it decides within timeout_s), its silence that it is not there
  double deadline = now_s() + timeout_s + WAIT_MARGIN_S;
  int flag = 0, spins = 0;
  for (;;) {
    MPI_Test(&rreq, &flag, MPI_STATUS_IGNORE);
    if (flag && g_verdict.status == STATUS_NOTE) {
      deadline = now_s() + timeout_s + WAIT_MARGIN_S;
      MPI_Irecv(&g_verdict, sizeof g_verdict, MPI_BYTE, 0, TAG_VERDICT, meta_comm, &rreq);
      flag = 0;
    }
    if (flag) break;
    if (now_s() > deadline) break;
    backoff(&spins);
  }
  if (!flag) {
    MPI_Cancel(&rreq);
    MPI_Request_free(&rreq);
    MPI_Request_free(&sreq);
    v->status = 2;
    if (g_mine.kind == FSDP_COLL_FINALIZE)
      snprintf(v->msg, sizeof v->msg, "timed out after %g s waiting for rank 0 to shut down (collective #%lld)",
               timeout_s, (long long)g_mine.seq);
    else
      snprintf(v->msg, sizeof v->msg, "timed out after %g s waiting for rank 0 in %s '%s' (collective #%lld)",
               timeout_s, kind_name(g_mine.kind), g_mine.tag, (long long)g_mine.seq);
    return -1;
  }
  memcpy(v, &g_verdict, sizeof *v);
  if (v->status == 0) {  // rank 0 has every record when it says go: this completes at once
    for (spins = 0, flag = 0; !flag && now_s() < deadline; backoff(&spins)) MPI_Test(&sreq, &flag, MPI_STATUS_IGNORE);
    if (!flag) MPI_Request_free(&sreq);
  } else {
    MPI_Request_free(&sreq);
  }
  if (g_beat) g_beat();
  return 0;
}

static int mpi_agree(const fsdp_comm_meta* mine, double timeout_s, fsdp_comm_decide_fn decide, fsdp_comm_verdict* v) {
  g_mine = *mine;
  g_timeout = timeout_s;  // also bounds each wait of the data movement that follows
  if (g_size == 1) {
    int arrived = 1;
    decide(&g_mine, &arrived, 1, 0, timeout_s, v);
    return 0;
  }
  return g_rank == 0 ? agree_root(timeout_s, decide, v) : agree_other(timeout_s, v);
}

// ---- data movement ----------------------------------------------------------------------------------
static int mpi_all_gather(void* out, const void* in, size_t bytes, int group, char* err) {
  if (bytes > (size_t)MAX_PIECE * sizeof(float)) {
    snprintf(err, FSDP_COMM_ERRLEN, "%zu bytes per rank exceed this backend's limit of %zu", bytes,
             (size_t)MAX_PIECE * sizeof(float));
    return -1;
  }
  const void* src = (const char*)in == (const char*)out + (size_t)g_grank[group] * bytes ? MPI_IN_PLACE : in;
  MPI_Request req;
  MPI_TRY(MPI_Iallgather(src, (int)bytes, MPI_BYTE, out, (int)bytes, MPI_BYTE, g_comm[group], &req), "MPI_Iallgather");
  return wait_all(&req, 1, "MPI_Iallgather", err);
}

// dst = a op b over n floats (dst may alias a or b); the loop vectorizes. max keeps a NaN of
// either side (a != a: a is NaN)
static void reduce_f32(float* dst, const float* a, const float* b, size_t n, int op) {
  if (op == FSDP_REDUCE_MAX) {
    for (size_t i = 0; i < n; i++) dst[i] = a[i] > b[i] || a[i] != a[i] ? a[i] : b[i];
  } else {
    for (size_t i = 0; i < n; i++) dst[i] = a[i] + b[i];
  }
}

static void scale_f32(float* x, size_t n, float s) {
  for (size_t i = 0; i < n; i++) x[i] *= s;
}

static int sendrecv_f32(const float* send, int to, float* recv, int from, size_t n, MPI_Comm comm, char* err) {
  for (size_t off = 0; off < n; off += MAX_PIECE) {
    int len = (int)(n - off < MAX_PIECE ? n - off : MAX_PIECE);
    MPI_Request req[2];
    MPI_TRY(MPI_Irecv(recv + off, len, MPI_FLOAT, from, TAG_RING, comm, &req[0]), "MPI_Irecv");
    MPI_TRY(MPI_Isend(send + off, len, MPI_FLOAT, to, TAG_RING, comm, &req[1]), "MPI_Isend");
    if (wait_all(req, 2, "ring step MPI_Isend/MPI_Irecv", err)) return -1;
  }
  return 0;
}

static int ring_reduce_scatter(float* out, const float* in, size_t n, int op, int group, char* err) {
  int N = g_gsize[group], r = g_grank[group], right = (r + 1) % N, left = (r - 1 + N) % N;
  if (g_scratch_n < n) {
    free(g_scratch_a);
    free(g_scratch_b);
    g_scratch_a = malloc(n * sizeof(float));
    g_scratch_b = malloc(n * sizeof(float));
    g_scratch_n = g_scratch_a && g_scratch_b ? n : 0;
    if (!g_scratch_n) {
      snprintf(err, FSDP_COMM_ERRLEN, "out of memory for the ring's %zu-float buffers", n);
      return -1;
    }
  }
  const float* send = in + (size_t)((r - 1 + N) % N) * n;  // step 0: my own piece of chunk r-1
  float *recv = g_scratch_a, *spare = g_scratch_b;
  for (int s = 0; s < N - 1; s++) {
    int c = ((r - s - 2) % N + N) % N;  // the chunk arriving now
    if (sendrecv_f32(send, right, recv, left, n, g_comm[group], err)) return -1;
    const float* own = in + (size_t)c * n;
    if (s == N - 2) {  // c == r: the last contribution lands in out
      reduce_f32(out, recv, own, n, op);
    } else {
      reduce_f32(recv, recv, own, n, op);
      send = recv;
      float* t = recv;
      recv = spare;
      spare = t;
    }
  }
  return 0;
}

static int mpi_reduce_scatter(float* out, const float* in, size_t n, int op, int algo, int group, char* err) {
  int N = g_gsize[group];
  if (N == 1) {
    if (out != in) memmove(out, in, n * sizeof(float));
    return 0;
  }
  if (algo == 1) {
    if (n > MAX_PIECE) {
      snprintf(err, FSDP_COMM_ERRLEN, "%zu floats per rank exceed this backend's limit of %d", n, MAX_PIECE);
      return -1;
    }
    float* dst = out;
    int overlap = out < in + (size_t)N * n && in < out + n;
    if (overlap && !(dst = malloc(n * sizeof(float)))) {
      snprintf(err, FSDP_COMM_ERRLEN, "out of memory (%zu floats)", n);
      return -1;
    }
    MPI_Request req;
    int rc = MPI_Ireduce_scatter_block(in, dst, (int)n, MPI_FLOAT, mpi_op(op), g_comm[group], &req);
    if (rc != MPI_SUCCESS) {
      if (overlap) free(dst);
      return mpi_fail(err, rc, "MPI_Ireduce_scatter_block");
    }
    if (wait_all(&req, 1, "MPI_Ireduce_scatter_block", err)) return -1;  // dst stays: MPI may still write it
    if (overlap) {
      memcpy(out, dst, n * sizeof(float));
      free(dst);
    }
  } else if (ring_reduce_scatter(out, in, n, op, group, err)) {
    return -1;
  }
  if (op == 1) scale_f32(out, n, 1.0f / N);
  return 0;
}

static int mpi_all_reduce(float* buf, size_t n, int op, int group, char* err) {
  if (g_gsize[group] == 1) return 0;
  for (size_t off = 0; off < n; off += MAX_PIECE) {
    int len = (int)(n - off < MAX_PIECE ? n - off : MAX_PIECE);
    MPI_Request req;
    MPI_TRY(MPI_Iallreduce(MPI_IN_PLACE, buf + off, len, MPI_FLOAT, mpi_op(op), g_comm[group], &req), "MPI_Iallreduce");
    if (wait_all(&req, 1, "MPI_Iallreduce", err)) return -1;
  }
  if (op == 1) scale_f32(buf, n, 1.0f / g_gsize[group]);
  return 0;
}

// an all-reduce in flight (mpi_all_reduce_start): its requests, one per MAX_PIECE floats
typedef struct {
  MPI_Request* reqs;
  int n_reqs, op, group;
  float* buf;
  size_t n;
  double deadline;
} ar_flight;

static int mpi_all_reduce_start(float* buf, size_t n, int op, int group, void** req, char* err) {
  *req = NULL;
  if (g_gsize[group] == 1 || n == 0) return 0;
  ar_flight* f = calloc(1, sizeof *f);
  int pieces = (int)((n + MAX_PIECE - 1) / MAX_PIECE);
  if (!f || !(f->reqs = calloc(pieces, sizeof *f->reqs))) {
    free(f);
    snprintf(err, FSDP_COMM_ERRLEN, "out of memory for an all-reduce in flight");
    return -1;
  }
  *f = (ar_flight){f->reqs, pieces, op, group, buf, n, now_s() + g_timeout};
  for (int i = 0; i < pieces; i++) {
    size_t off = (size_t)i * MAX_PIECE;
    int len = (int)(n - off < MAX_PIECE ? n - off : MAX_PIECE);
    int rc = MPI_Iallreduce(MPI_IN_PLACE, buf + off, len, MPI_FLOAT, mpi_op(op), g_comm[group], &f->reqs[i]);
    if (rc != MPI_SUCCESS) return mpi_fail(err, rc, "MPI_Iallreduce");  // (f stays: MPI may hold its requests)
  }
  *req = f;
  return 0;
}

static int mpi_test(void* req, int* done, char* err) {
  ar_flight* f = req;
  int flag = 0;
  int rc = MPI_Testall(f->n_reqs, f->reqs, &flag, MPI_STATUSES_IGNORE);
  if (rc != MPI_SUCCESS) return mpi_fail(err, rc, "MPI_Iallreduce");
  *done = flag;
  if (!flag) {
    if (now_s() <= f->deadline) return 0;
    char who[256];
    name_missing(who, sizeof who);
    snprintf(err, FSDP_COMM_ERRLEN, "timed out after %g s waiting for %s to move the data (MPI_Iallreduce)", g_timeout,
             who);
    return -1;  // (f stays: its requests are abandoned with the broken communicator)
  }
  if (f->op == 1) scale_f32(f->buf, f->n, 1.0f / g_gsize[f->group]);
  free(f->reqs);
  free(f);
  if (g_beat) g_beat();
  return 0;
}

static int mpi_broadcast(void* buf, size_t bytes, int root, char* err) {
  for (size_t off = 0; off < bytes; off += MAX_PIECE) {
    int len = (int)(bytes - off < MAX_PIECE ? bytes - off : MAX_PIECE);
    MPI_Request req;
    MPI_TRY(MPI_Ibcast((char*)buf + off, len, MPI_BYTE, root, data_comm, &req), "MPI_Ibcast");
    if (wait_all(&req, 1, "MPI_Ibcast", err)) return -1;
  }
  return 0;
}

static int mpi_barrier(char* err) {
  MPI_Request req;
  MPI_TRY(MPI_Ibarrier(data_comm, &req), "MPI_Ibarrier");
  return wait_all(&req, 1, "MPI_Ibarrier", err);
}

static const fsdp_comm_backend mpi_backend = {
    FSDP_COMM_ABI,  "mpi",          mpi_init,           mpi_finalize,   mpi_agree,
    mpi_set_groups, mpi_all_gather, mpi_reduce_scatter, mpi_all_reduce, mpi_all_reduce_start,
    mpi_test,       mpi_broadcast,  mpi_barrier,
};

__attribute__((visibility("default"))) const fsdp_comm_backend* fsdp_comm_mpi_backend(void) { return &mpi_backend; }
