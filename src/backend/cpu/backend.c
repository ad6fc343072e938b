/*
 * backend/cpu/backend.c -- the CPU's device table: host memory, memcpy for every copy, no
 * streams (work runs as it is issued), and the kernel tables of elem.c, linalg.c, nn.c and
 * optim.c. It registers itself with core when libfsdp.so is loaded. Also the one thread knob of
 * the CPU's two pools, our OpenMP kernels and OpenBLAS's GEMMs.
 */
#include "core/core.h"
#include "backend/cpu/cpu.h"

#include <omp.h>

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

static const fsdp_backend cpu_backend = {
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
    .elem = &fsdp_cpu_elem_kernels,
    .linalg = &fsdp_cpu_linalg_kernels,
    .nn = &fsdp_cpu_nn_kernels,
    .optim = &fsdp_cpu_optim_kernels,
    .norm = &fsdp_cpu_norm_kernels,
    .host_alloc = NULL,  // (the CPU is the host: its own memory is what pinned memory is for a GPU)
    .host_free = NULL,
};

void openblas_set_num_threads(int n);

// registered before anything of libfsdp.so can run (a constructor runs when the library loads);
// the ISA level is settled then too, so an FSDP_CPU_ISA cap reaches oneDNN before any of its
// kernels (convolution, float32 or bfloat16 GEMM), whichever runs first
__attribute__((constructor)) static void cpu_register(void) {
  if (fsdp_backend_register(FSDP_CPU, &cpu_backend)) {
    fprintf(stderr, "fsdp: %s\n", fsdp_last_error());
    abort();
  }
  fsdp_cpu_isa_level();
  openblas_set_num_threads(1);  // see "threads" below
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
