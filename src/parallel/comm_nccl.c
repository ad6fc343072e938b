/*
 * parallel/comm_nccl.c -- libfsdp_nccl.so: the NCCL device data plane (parallel/comm.h, fsdp_comm_plane).
 * Built by `make` where nccl.h is installed; comm.c dlopen()s it for FSDP_DEVICE_COMM=nccl (or
 * "auto" on GPUs, one per rank). It needs only libnccl.so.2 to load: the driver (libcuda.so.1)
 * is opened at init, so a machine without a GPU can load it and run the bootstrap.
 *
 * Bootstrap (no GPU needed): rank 0 makes two NCCL unique ids, one per communicator; the host
 * backend (MPI) broadcasts them as the collective that starts the plane, after the ranks agreed
 * on it. Connect: this process's GPU (the CUDA backend's device) becomes current on the
 * communication thread, two streams are made (gathers, reductions) and two communicators, one
 * per stream, initialized non-blocking: the thread polls them and gives up (aborting them) after
 * the timeout, so a rank that never joins is an error, not a hang. NCCL's own reason comes
 * through (two ranks on one GPU: "Duplicate GPU detected").
 *
 * A collective (on the communication thread, after the ranks agreed on it over MPI): its stream
 * waits for `ready`, NCCL queues the kernel, the stream records `done` and a private event this
 * plane keeps to follow it. Nothing waits for the GPU here. progress() (polled by comm.c while
 * collectives are in flight) retires finished ones; the oldest unfinished one past the timeout --
 * a rank stopped after agreeing, its peers' kernels spin -- aborts both communicators
 * (ncclCommAbort ends the kernels), and the communicator is broken from then on, naming it.
 */
#include "parallel/comm.h"

#include <cuda.h>
#include <dlfcn.h>
#include <nccl.h>
#include <stdio.h>
#include <string.h>
#include <time.h>

#define RING 4096  // collectives in flight at most (FSDP keeps a handful)

// ---- the driver, opened at connect ----------------------------------------------------------------
// (cuda.h maps some names to versioned symbols, e.g. cuStreamDestroy -> cuStreamDestroy_v2: SYM
// expands the macro before naming the symbol)
#define SYM_(x) #x
#define SYM(x) SYM_(x)
static struct {
  CUresult (*DeviceGet)(CUdevice*, int);
  CUresult (*PrimaryCtxRetain)(CUcontext*, CUdevice);
  CUresult (*PrimaryCtxRelease)(CUdevice);
  CUresult (*CtxSetCurrent)(CUcontext);
  CUresult (*StreamCreate)(CUstream*, unsigned);
  CUresult (*StreamDestroy)(CUstream);
  CUresult (*StreamWaitEvent)(CUstream, CUevent, unsigned);
  CUresult (*EventCreate)(CUevent*, unsigned);
  CUresult (*EventRecord)(CUevent, CUstream);
  CUresult (*EventQuery)(CUevent);
  CUresult (*EventDestroy)(CUevent);
  CUresult (*GetErrorName)(CUresult, const char**);
} cu;

static int open_driver(char* err) {
  void* h = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
  if (!h) {
    snprintf(err, FSDP_COMM_ERRLEN, "nccl: no NVIDIA driver (%s)", dlerror());
    return -1;
  }
  struct {
    void** slot;
    const char* name;
  } syms[] = {
      {(void**)&cu.DeviceGet, SYM(cuDeviceGet)},
      {(void**)&cu.PrimaryCtxRetain, SYM(cuDevicePrimaryCtxRetain)},
      {(void**)&cu.PrimaryCtxRelease, SYM(cuDevicePrimaryCtxRelease)},
      {(void**)&cu.CtxSetCurrent, SYM(cuCtxSetCurrent)},
      {(void**)&cu.StreamCreate, SYM(cuStreamCreate)},
      {(void**)&cu.StreamDestroy, SYM(cuStreamDestroy)},
      {(void**)&cu.StreamWaitEvent, SYM(cuStreamWaitEvent)},
      {(void**)&cu.EventCreate, SYM(cuEventCreate)},
      {(void**)&cu.EventRecord, SYM(cuEventRecord)},
      {(void**)&cu.EventQuery, SYM(cuEventQuery)},
      {(void**)&cu.EventDestroy, SYM(cuEventDestroy)},
      {(void**)&cu.GetErrorName, SYM(cuGetErrorName)},
  };
  for (size_t i = 0; i < sizeof syms / sizeof *syms; i++) {
    *syms[i].slot = dlsym(h, syms[i].name);
    if (!*syms[i].slot) {
      snprintf(err, FSDP_COMM_ERRLEN, "nccl: the NVIDIA driver has no %s", syms[i].name);
      return -1;
    }
  }
  return 0;
}

static const char* cu_name(CUresult r) {
  const char* s = NULL;
  return cu.GetErrorName && cu.GetErrorName(r, &s) == CUDA_SUCCESS && s ? s : "CUDA error";
}

// ---- state ------------------------------------------------------------------------------------------
enum { GATHERS = 0, REDUCTIONS = 1 };
typedef struct {
  CUevent ev;
  double queued;  // monotonic seconds
  const char* kind;
} in_flight_t;

static struct {
  const fsdp_comm_backend* host;
  int rank, size, device;
  CUcontext ctx;
  CUstream streams[2];
  ncclComm_t comms[2];
  int connected, aborted;
  in_flight_t ring[RING];
  int head, count;
} N;

static double now_s(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return ts.tv_sec + 1e-9 * ts.tv_nsec;
}

static int nccl_fail(char* err, const char* what, ncclResult_t r, ncclComm_t comm) {
  const char* last = comm ? ncclGetLastError(comm) : ncclGetLastError(NULL);
  snprintf(err, FSDP_COMM_ERRLEN, "nccl: %s: %s%s%s", what, ncclGetErrorString(r), last && *last ? ": " : "",
           last ? last : "");
  return -1;
}

static void abort_all(void) {
  if (N.aborted) return;
  N.aborted = 1;
  for (int i = 0; i < 2; i++)
    if (N.comms[i]) ncclCommAbort(N.comms[i]);
  N.comms[0] = N.comms[1] = NULL;
}

// a non-blocking call in progress: poll until done or the deadline (then abort)
static int settle(ncclComm_t comm, ncclResult_t r, double deadline, const char* what, char* err) {
  while (r == ncclInProgress) {
    if (now_s() > deadline) {
      snprintf(err, FSDP_COMM_ERRLEN, "nccl: %s did not finish within the timeout (a rank that never joined?)", what);
      abort_all();
      return -1;
    }
    struct timespec ts = {0, 1000000};
    nanosleep(&ts, NULL);
    if (ncclCommGetAsyncError(comm, &r) != ncclSuccess) break;
  }
  if (r != ncclSuccess) {
    nccl_fail(err, what, r, comm);
    abort_all();
    return -1;
  }
  return 0;
}

// ---- bootstrap and connect --------------------------------------------------------------------------
static ncclUniqueId g_ids[2];

static int nc_bootstrap(const fsdp_comm_backend* host, int rank, int size, char* digest, char* err) {
  N.host = host;
  N.rank = rank;
  N.size = size;
  memset(g_ids, 0, sizeof g_ids);
  if (rank == 0)
    for (int i = 0; i < 2; i++) {
      ncclResult_t r = ncclGetUniqueId(&g_ids[i]);
      if (r != ncclSuccess) return nccl_fail(err, "ncclGetUniqueId", r, NULL);
    }
  if (host->broadcast(g_ids, sizeof g_ids, 0, err) != 0) return -1;
  uint64_t h = 1469598103934665603ull;  // FNV-1a over both ids
  const unsigned char* b = (const unsigned char*)g_ids;
  for (size_t i = 0; i < sizeof g_ids; i++) h = (h ^ b[i]) * 1099511628211ull;
  snprintf(digest, 17, "%016llx", (unsigned long long)h);
  return 0;
}

static int nc_init(const fsdp_comm_backend* host, const struct fsdp_backend* dev, int device_index, int rank, int size,
                   double timeout_s, char* err) {
  (void)dev;  // events and streams are the driver's: the CUDA backend's are the same handles
  char digest[17];
  if (nc_bootstrap(host, rank, size, digest, err) || open_driver(err)) return -1;
  CUdevice d;
  CUresult c = cu.DeviceGet(&d, device_index);
  if (c == CUDA_SUCCESS) c = cu.PrimaryCtxRetain(&N.ctx, d);
  if (c == CUDA_SUCCESS) c = cu.CtxSetCurrent(N.ctx);  // the communication thread runs on this GPU
  for (int i = 0; i < 2 && c == CUDA_SUCCESS; i++) c = cu.StreamCreate(&N.streams[i], CU_STREAM_NON_BLOCKING);
  if (c != CUDA_SUCCESS) {
    snprintf(err, FSDP_COMM_ERRLEN, "nccl: cannot set up GPU %d for the communication thread: %s", device_index,
             cu_name(c));
    return -1;
  }
  N.device = device_index;
  double deadline = now_s() + timeout_s;
  for (int i = 0; i < 2; i++) {
    ncclConfig_t cfg = NCCL_CONFIG_INITIALIZER;
    cfg.blocking = 0;
    ncclResult_t r = ncclCommInitRankConfig(&N.comms[i], size, g_ids[i], rank, &cfg);
    if (r != ncclSuccess && r != ncclInProgress) {
      nccl_fail(err, "ncclCommInitRankConfig", r, N.comms[i]);
      abort_all();
      return -1;
    }
    if (settle(N.comms[i], r, deadline, "ncclCommInitRankConfig", err)) return -1;
  }
  N.connected = 1;
  N.aborted = 0;
  N.head = N.count = 0;
  return 0;
}

// ---- collectives ---------------------------------------------------------------------------------------
static int before(int s, void* ready, char* err) {
  if (N.aborted) {
    snprintf(err, FSDP_COMM_ERRLEN, "nccl: the communicators were aborted");
    return -1;
  }
  if (N.count == RING) {
    snprintf(err, FSDP_COMM_ERRLEN, "nccl: %d collectives in flight; wait for some first", RING);
    return -1;
  }
  CUresult c = cu.StreamWaitEvent(N.streams[s], (CUevent)ready, 0);
  if (c != CUDA_SUCCESS) {
    snprintf(err, FSDP_COMM_ERRLEN, "nccl: stream wait: %s", cu_name(c));
    return -1;
  }
  return 0;
}

static int after(int s, ncclResult_t r, void* done, const char* kind, char* err) {
  if (settle(N.comms[s], r, now_s() + 60.0, kind, err)) return -1;  // (queuing only: never long)
  CUevent mine = NULL;
  CUresult c = cu.EventRecord((CUevent)done, N.streams[s]);
  if (c == CUDA_SUCCESS) c = cu.EventCreate(&mine, CU_EVENT_DISABLE_TIMING);
  if (c == CUDA_SUCCESS) c = cu.EventRecord(mine, N.streams[s]);
  if (c != CUDA_SUCCESS) {
    snprintf(err, FSDP_COMM_ERRLEN, "nccl: %s: event record: %s", kind, cu_name(c));
    return -1;
  }
  N.ring[(N.head + N.count) % RING] = (in_flight_t){mine, now_s(), kind};
  N.count++;
  return 0;
}

// sum or avg: max never comes here (comm.h), since NCCL's max is fmaxf and drops a NaN
static int red_op(int op, const char* kind, ncclRedOp_t* r, char* err) {
  if (op == FSDP_REDUCE_MAX) {
    snprintf(err, FSDP_COMM_ERRLEN, "nccl: %s by max reached NCCL (comm.c sends max through the host)", kind);
    return -1;
  }
  *r = op == FSDP_REDUCE_AVG ? ncclAvg : ncclSum;
  return 0;
}

static int nc_all_gather(void* out, const void* in, size_t bytes, void* ready, void* done, char* err) {
  if (before(GATHERS, ready, err)) return -1;
  ncclResult_t r = ncclAllGather(in, out, bytes, ncclUint8, N.comms[GATHERS], N.streams[GATHERS]);
  return after(GATHERS, r, done, "ncclAllGather", err);
}
static int nc_reduce_scatter(float* out, const float* in, size_t n, int op, void* ready, void* done, char* err) {
  ncclRedOp_t how;
  if (red_op(op, "reduce_scatter", &how, err) || before(REDUCTIONS, ready, err)) return -1;
  ncclResult_t r = ncclReduceScatter(in, out, n, ncclFloat32, how, N.comms[REDUCTIONS], N.streams[REDUCTIONS]);
  return after(REDUCTIONS, r, done, "ncclReduceScatter", err);
}
static int nc_all_reduce(float* buf, size_t n, int op, void* ready, void* done, char* err) {
  ncclRedOp_t how;
  if (red_op(op, "all_reduce", &how, err) || before(REDUCTIONS, ready, err)) return -1;
  ncclResult_t r = ncclAllReduce(buf, buf, n, ncclFloat32, how, N.comms[REDUCTIONS], N.streams[REDUCTIONS]);
  return after(REDUCTIONS, r, done, "ncclAllReduce", err);
}
static int nc_broadcast(void* buf, size_t bytes, int root, void* ready, void* done, char* err) {
  if (before(GATHERS, ready, err)) return -1;
  ncclResult_t r = ncclBroadcast(buf, buf, bytes, ncclUint8, root, N.comms[GATHERS], N.streams[GATHERS]);
  return after(GATHERS, r, done, "ncclBroadcast", err);
}

// ---- progress and shutdown -----------------------------------------------------------------------------
static int nc_progress(double timeout_s, char* err) {
  while (N.count) {
    in_flight_t* f = &N.ring[N.head];
    CUresult c = cu.EventQuery(f->ev);
    if (c == CUDA_SUCCESS) {
      cu.EventDestroy(f->ev);
      N.head = (N.head + 1) % RING;
      N.count--;
      continue;
    }
    double age = now_s() - f->queued;
    if (c != CUDA_ERROR_NOT_READY) {
      snprintf(err, FSDP_COMM_ERRLEN, "nccl: %s failed on the GPU: %s", f->kind, cu_name(c));
    } else {
      ncclResult_t a = ncclSuccess;
      for (int i = 0; i < 2 && a == ncclSuccess; i++)
        if (ncclCommGetAsyncError(N.comms[i], &a) == ncclSuccess && a != ncclSuccess && a != ncclInProgress) {
          nccl_fail(err, f->kind, a, N.comms[i]);
          abort_all();
          return -1;
        }
      if (age <= timeout_s) return 0;
      snprintf(err, FSDP_COMM_ERRLEN,
               "nccl: %s queued %.0f s ago has not finished on the GPU (timeout %g s): a rank stopped after "
               "agreeing on it; the NCCL communicators were aborted",
               f->kind, age, timeout_s);
    }
    abort_all();
    return -1;
  }
  return 0;
}

static int nc_in_flight(void) { return N.count; }

static void nc_finalize(int broken) {
  if (!N.connected) return;
  char err[FSDP_COMM_ERRLEN];
  double deadline = now_s() + 60.0;
  while (!broken && N.count && now_s() < deadline) {  // what is queued was agreed by every rank
    if (nc_progress(60.0, err)) break;
    struct timespec ts = {0, 1000000};
    nanosleep(&ts, NULL);
  }
  if (broken || N.count || N.aborted) {
    abort_all();
  } else {
    for (int i = 0; i < 2; i++) {
      ncclResult_t r = ncclCommFinalize(N.comms[i]);
      if (settle(N.comms[i], r, now_s() + 60.0, "ncclCommFinalize", err)) break;
      ncclCommDestroy(N.comms[i]);
      N.comms[i] = NULL;
    }
    abort_all();  // (whatever did not finalize)
  }
  for (int i = 0; i < 2; i++)
    if (N.streams[i]) cu.StreamDestroy(N.streams[i]);
  N.streams[0] = N.streams[1] = NULL;
  N.connected = 0;
}

static const fsdp_comm_plane nccl_plane = {
    FSDP_COMM_ABI, FSDP_PLANE_NCCL,   "nccl",        nc_init,      nc_bootstrap, nc_finalize,
    nc_all_gather, nc_reduce_scatter, nc_all_reduce, nc_broadcast, nc_progress,  nc_in_flight,
};

__attribute__((visibility("default"))) const fsdp_comm_plane* fsdp_comm_nccl_plane(void) { return &nccl_plane; }
