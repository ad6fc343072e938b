/*
 * core/trace.c -- the timeline trace: FSDP_TRACE=path (or fsdp.trace.start/stop) records what each
 * rank did when, and writes it as Chrome/Perfetto trace-event JSON (open it at ui.perfetto.dev or
 * chrome://tracing). One file per rank: `path` itself with one rank, else path.rank<R>.json.
 *
 * Tracks (tid): 1 "compute" (the thread that initialized the communicator, or that made the first
 * event: units' forwards, nested as the modules are, optimizer steps, waits for collectives, and
 * an instant event when a collective is issued), 2 "communication" (each collective from the
 * agreement to the end of its data movement), 3 "backward" (each unit's backward, from its
 * gather to its reduce-scatter, as async slices: units' backwards overlap without nesting).
 * Events are fixed-size records in one growing array under a mutex; nothing is recorded while the
 * trace is off, which costs one load per event site.
 */
#include "core/core.h"

#include <errno.h>
#include <pthread.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#define TRACE_NAME 112

typedef struct {
  char ph;  // 'X' complete, 'i' instant, 'b'/'e' async begin/end
  int tid;
  double ts, dur;  // microseconds since the trace started
  int64_t id;      // async slices
  int64_t arg;     // bytes (collectives), else -1
  char name[TRACE_NAME];
} trace_event;

static struct {
  pthread_mutex_t mu;
  int on;
  char path[4096];
  trace_event* ev;
  int n, cap;
  double t0;
  int rank, world;
  int atexit_done;
} T = {.mu = PTHREAD_MUTEX_INITIALIZER, .world = 1};

// (acquire: a thread that sees the trace on also sees the start time and path written before)
int fsdp_trace_enabled(void) { return __atomic_load_n(&T.on, __ATOMIC_ACQUIRE); }

static double mono_us(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return ts.tv_sec * 1e6 + ts.tv_nsec * 1e-3;
}
double fsdp_trace_now(void) { return mono_us() - T.t0; }

static void push(char ph, int tid, double ts, double dur, int64_t id, int64_t arg, const char* name) {
  pthread_mutex_lock(&T.mu);
  if (T.on && (T.n < T.cap || fsdp_grow(&T.ev, &T.cap, T.n + 1, sizeof *T.ev, "trace") == 0)) {
    trace_event* e = &T.ev[T.n++];
    *e = (trace_event){ph, tid, ts, dur, id, arg, ""};
    snprintf(e->name, sizeof e->name, "%s", name);
  } else {
    fsdp_clear_error();  // (out of memory: the trace loses the event, the program goes on)
  }
  pthread_mutex_unlock(&T.mu);
}

void fsdp_trace_span(int tid, const char* name, double t0_us, int64_t bytes) {
  if (!fsdp_trace_enabled()) return;
  push('X', tid, t0_us, fsdp_trace_now() - t0_us, 0, bytes, name);
}
void fsdp_trace_instant(int tid, const char* name, int64_t bytes) {
  if (!fsdp_trace_enabled()) return;
  push('i', tid, fsdp_trace_now(), 0, 0, bytes, name);
}
void fsdp_trace_async(int begin, int64_t id, const char* name) {
  if (!fsdp_trace_enabled()) return;
  push(begin ? 'b' : 'e', FSDP_TRACE_BACKWARD, fsdp_trace_now(), 0, id, -1, name);
}
void fsdp_trace_set_rank(int rank, int world) {
  T.rank = rank;
  T.world = world;
}

static void json_string(FILE* f, const char* s) {
  fputc('"', f);
  for (; *s; s++) {
    unsigned char c = (unsigned char)*s;
    if (c == '"' || c == '\\') fprintf(f, "\\%c", c);
    else if (c < 0x20) fprintf(f, "\\u%04x", c);
    else fputc(c, f);
  }
  fputc('"', f);
}

static void at_exit(void) {
  if (fsdp_trace_enabled() && fsdp_trace_stop() != 0) fprintf(stderr, "fsdp: trace: %s\n", fsdp_last_error());
}

int fsdp_trace_start(const char* path) {
  CHECK_INT(path && *path, "trace.start: the path is empty");
  CHECK_INT(strlen(path) < sizeof T.path - 32, "trace.start: the path is too long (%zu bytes)", strlen(path));
  // the file is written at the end of the run: its folder must take it now, not fail then
  char dir[sizeof T.path];
  snprintf(dir, sizeof dir, "%s", path);
  char* slash = strrchr(dir, '/');
  if (!slash) snprintf(dir, sizeof dir, ".");
  else if (slash == dir) slash[1] = 0;
  else *slash = 0;
  CHECK_INT(access(dir, W_OK) == 0, "trace.start: cannot write the trace '%s': its folder '%s': %s", path, dir,
            strerror(errno));
  pthread_mutex_lock(&T.mu);
  snprintf(T.path, sizeof T.path, "%s", path);
  T.n = 0;
  T.t0 = mono_us();
  __atomic_store_n(&T.on, 1, __ATOMIC_RELEASE);
  int reg = !T.atexit_done;
  T.atexit_done = 1;
  pthread_mutex_unlock(&T.mu);
  if (reg) atexit(at_exit);
  return 0;
}

// stops recording and writes the file (0, or -1 with the error set; the events are dropped)
int fsdp_trace_stop(void) {
  pthread_mutex_lock(&T.mu);
  int was_on = T.on;
  __atomic_store_n(&T.on, 0, __ATOMIC_RELAXED);
  pthread_mutex_unlock(&T.mu);
  CHECK_INT(was_on, "trace.stop: no trace is running (fsdp.trace.start(path) or FSDP_TRACE=path)");
  char file[sizeof T.path + 32];
  size_t len = strlen(T.path);
  if (T.world <= 1) snprintf(file, sizeof file, "%s", T.path);
  else if (len > 5 && strcmp(T.path + len - 5, ".json") == 0)
    snprintf(file, sizeof file, "%.*s.rank%d.json", (int)(len - 5), T.path, T.rank);
  else snprintf(file, sizeof file, "%s.rank%d.json", T.path, T.rank);
  FILE* f = fopen(file, "w");
  CHECK_INT(f, "trace.stop: cannot write %s: %s", file, strerror(errno));
  static const char* tracks[] = {"", "compute", "communication", "backward (units)"};
  fprintf(f, "{\"displayTimeUnit\": \"ms\", \"traceEvents\": [\n");
  fprintf(f, "{\"ph\": \"M\", \"pid\": %d, \"name\": \"process_name\", \"args\": {\"name\": \"rank %d\"}}", T.rank,
          T.rank);
  for (int t = 1; t <= 3; t++)
    fprintf(f, ",\n{\"ph\": \"M\", \"pid\": %d, \"tid\": %d, \"name\": \"thread_name\", \"args\": {\"name\": \"%s\"}}",
            T.rank, t, tracks[t]);
  for (int i = 0; i < T.n; i++) {
    const trace_event* e = &T.ev[i];
    fprintf(f, ",\n{\"ph\": \"%c\", \"pid\": %d, \"tid\": %d, \"ts\": %.3f, \"cat\": \"fsdp\", \"name\": ", e->ph,
            T.rank, e->tid, e->ts);
    json_string(f, e->name);
    if (e->ph == 'X') fprintf(f, ", \"dur\": %.3f", e->dur);
    if (e->ph == 'i') fprintf(f, ", \"s\": \"t\"");
    if (e->ph == 'b' || e->ph == 'e') fprintf(f, ", \"id\": %lld", (long long)e->id);
    if (e->arg >= 0) fprintf(f, ", \"args\": {\"bytes\": %lld}", (long long)e->arg);
    fputc('}', f);
  }
  fprintf(f, "\n]}\n");
  int bad = ferror(f);
  if (fclose(f) != 0) bad = 1;
  T.n = 0;
  CHECK_INT(!bad, "trace.stop: writing %s failed", file);
  return 0;
}

// FSDP_TRACE=path: recording starts when libfsdp.so loads
__attribute__((constructor)) static void trace_from_env(void) {
  const char* p = getenv("FSDP_TRACE");
  if (p && *p && fsdp_trace_start(p) != 0) fprintf(stderr, "fsdp: FSDP_TRACE: %s\n", fsdp_last_error());
}
