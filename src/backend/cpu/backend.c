/*
 * backend/cpu/backend.c -- the CPU's device table: host memory, memcpy for every copy, no
 * streams (work runs as it is issued), and the kernel tables of elem.c, linalg.c, nn.c, norm.c and
 * optim.c in the copy compiled for this CPU's ISA level (cpu.h, cpuinfo.c), whose FMA loop also
 * measures a core's peak (fsdp_cpu_fma_peak: make bench reports every GEMM's rate as a fraction of
 * it). It registers itself with core when libfsdp.so is loaded. Also the one thread knob of the
 * CPU's two pools, our OpenMP kernels and OpenBLAS's GEMMs.
 */
#include "core/core.h"
#include "backend/cpu/cpu.h"

#include <omp.h>
#include <time.h>

// ---- memory and copies ------------------------------------------------------------------------------
// core pads every request to a multiple of 64 bytes, as aligned_alloc wants
static void* cpu_alloc(size_t nbytes) { return aligned_alloc(64, nbytes); }
static void cpu_free(void* p, size_t nbytes) {
  (void)nbytes;
  free(p);
}
static void cpu_memset(void* p, int byte, size_t nbytes) { memset(p, byte, nbytes); }
static int cpu_copy(void* dst, const void* src, size_t nbytes, fsdp_copy_kind kind) {
  (void)kind;  // host and device memory are the same memory here
  if (nbytes) memcpy(dst, src, nbytes);
  return 0;
}

// ---- ordering: the CPU runs work as it is issued, so streams and events order nothing -------------
static char cpu_token;  // what stream_new and event_new hand out
static int cpu_synchronize(void) { return 0; }
static void* cpu_stream_new(void) { return &cpu_token; }
static void cpu_stream_free(void* stream) { (void)stream; }
static void* cpu_event_new(void) { return &cpu_token; }
static void cpu_event_free(void* event) { (void)event; }
static void cpu_event_record(void* event, void* stream) {
  (void)event;
  (void)stream;
}
static void cpu_stream_wait(void* stream, void* event) {
  (void)stream;
  (void)event;
}
static int cpu_copy_async(void* dst, const void* src, size_t nbytes, fsdp_copy_kind kind, void* stream) {
  (void)stream;
  return cpu_copy(dst, src, nbytes, kind);
}
static void cpu_memset_async(void* p, int byte, size_t nbytes, void* stream) {
  (void)stream;
  memset(p, byte, nbytes);
}
static void cpu_launch_host(void* stream, void (*fn)(void*), void* arg) {
  (void)stream;
  fn(arg);
}
static void cpu_ordinal(int* index, int* count) {
  *index = 0;
  *count = 1;
}

// the kernel tables are those of the copy cpuinfo.c picks (cpu_register fills them in)
static fsdp_backend cpu_backend = {
    .name = "cpu",
    .async = 0,  // work runs as it is issued: checks fail at once, in the op
    .alloc = cpu_alloc,
    .free = cpu_free,
    .memset = cpu_memset,
    .copy = cpu_copy,
    .synchronize = cpu_synchronize,
    .stream_new = cpu_stream_new,
    .stream_free = cpu_stream_free,
    .event_new = cpu_event_new,
    .event_free = cpu_event_free,
    .event_record = cpu_event_record,
    .stream_wait = cpu_stream_wait,
    .copy_async = cpu_copy_async,
    .memset_async = cpu_memset_async,
    .launch_host = cpu_launch_host,
    .ordinal = cpu_ordinal,
    .host_alloc = NULL,  // (the CPU is the host: its own memory is what pinned memory is for a GPU)
    .host_free = NULL,
};

void openblas_set_num_threads(int n);

// ---- the copy of the kernels for this CPU (cpu.h) ----------------------------------------------------
static const fsdp_cpu_isa_kernels* const copies[FSDP_ISA_LEVELS] = {
    &fsdp_cpu_isa_kernels_sse2, &fsdp_cpu_isa_kernels_avx2, &fsdp_cpu_isa_kernels_avx512};

const fsdp_cpu_isa_kernels* fsdp_cpu_kernels(void) { return copies[fsdp_cpu_isa_level()]; }

// registered before anything of libfsdp.so can run (a constructor runs when the library loads),
// with the kernel tables of the copy for this CPU's ISA level; the level is settled then, so an
// FSDP_CPU_ISA cap also reaches oneDNN before any of its kernels (convolution, float32 or bfloat16
// GEMM), whichever runs first
__attribute__((constructor)) static void cpu_register(void) {
  const fsdp_cpu_isa_kernels* k = fsdp_cpu_kernels();
  cpu_backend.elem = k->elem;
  cpu_backend.linalg = k->linalg;
  cpu_backend.nn = k->nn;
  cpu_backend.optim = k->optim;
  cpu_backend.norm = k->norm;
  if (fsdp_backend_register(FSDP_CPU, &cpu_backend)) {
    fprintf(stderr, "fsdp: %s\n", fsdp_last_error());
    abort();
  }
  openblas_set_num_threads(1);  // see "threads" below
}

// the copy whose tables the device table holds, read from the device table itself (what runs, not
// what was asked for: a spec checks it under each FSDP_CPU_ISA); NULL if they were mixed
static const fsdp_cpu_isa_kernels* installed(void) {
  for (int l = 0; l < FSDP_ISA_LEVELS; l++) {
    const fsdp_cpu_isa_kernels* c = copies[l];
    if (cpu_backend.elem == c->elem && cpu_backend.linalg == c->linalg && cpu_backend.nn == c->nn &&
        cpu_backend.optim == c->optim && cpu_backend.norm == c->norm)
      return c;
  }
  return NULL;
}

const char* fsdp_cpu_isa(void) { return installed() ? installed()->name : "mixed"; }

// one core's float32 FMA peak in GFLOP/s: the installed copy's register-only FMA loop (isa.c)
static double now_s(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return ts.tv_sec + 1e-9 * ts.tv_nsec;
}

double fsdp_cpu_fma_peak(double seconds) {
  double (*block)(float*) = (installed() ? installed() : fsdp_cpu_kernels())->fma_block;
  volatile float keep = 0;
  float sink = 0;
  block(&sink);  // warm up (and let the clock rise)
  // the best of several slices: a slice the scheduler interrupted does not count
  double best = 0, t_end = now_s() + (seconds > 0 ? seconds : 0.2);
  while (now_s() < t_end) {
    double t0 = now_s(), flops = 0;
    for (int k = 0; k < 64; k++) flops += block(&sink);
    double rate = flops / (now_s() - t0);
    if (rate > best) best = rate;
  }
  keep = sink;
  (void)keep;
  return best * 1e-9;
}

// ---- threads ----------------------------------------------------------------------------------------
// The threads are OpenMP's: our kernels, oneDNN, and our GEMM scheduler, which runs OpenBLAS on
// each of them single-threaded (backend/cpu/linalg.c). So OpenBLAS's own thread count is 1 from
// the moment libfsdp.so loads, and fsdp_set_num_threads leaves it there; lua/fsdp/init.lua also
// loads OpenBLAS under OPENBLAS_NUM_THREADS=1, so it starts no idle workers (each spun in
// sched_yield, ~120000 calls, through a process's first 0.1-0.3 s, on the cores of its first steps).
// The count is at most fsdp_max_num_threads(): OpenMP's thread limit (OMP_THREAD_LIMIT), and never
// above FSDP_MAX_THREADS. libgomp starts a team from arrays on the starting thread's stack and ends
// the process when the system refuses a thread: at 100000 threads a 512x512 matmul overflowed that
// stack (SIGSEGV), at 32768 libgomp exited on the refused thread. fsdp.set_num_threads refuses a
// count outside [1, limit]; a C caller's is clamped into it.
#define FSDP_MAX_THREADS 1024
int fsdp_max_num_threads(void) {
  int limit = omp_get_thread_limit();
  return limit < FSDP_MAX_THREADS ? limit : FSDP_MAX_THREADS;
}
void fsdp_set_num_threads(int n) {
  int limit = fsdp_max_num_threads();
  omp_set_num_threads(n < 1 ? 1 : n > limit ? limit : n);
}
int fsdp_get_num_threads(void) { return omp_get_max_threads(); }
