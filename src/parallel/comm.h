/*
 * parallel/comm.h -- the communication backend table (internal; not part of the public API).
 *
 * comm.c owns everything backend independent: the communication thread, the work queue, the
 * collective check (mismatch / timeout messages), stats, argument checks. A backend only moves
 * bytes. Every backend function is called on the communication thread (the only thread that
 * ever calls MPI, including MPI_Init_thread and MPI_Finalize), and reports errors by writing a
 * message into `err` (FSDP_COMM_ERRLEN bytes) and returning -1 -- backends never see libfsdp's
 * error machinery, so libfsdp_mpi.so needs nothing from libfsdp.so.
 *
 * "self" (one rank) is built into libfsdp.so. "mpi" lives in libfsdp_mpi.so, which comm.c
 * dlopen()s and asks for its table through the one exported function fsdp_comm_mpi_backend().
 */
#ifndef FSDP_COMM_H
#define FSDP_COMM_H

#include <stddef.h>
#include <stdint.h>

#include "fsdp.h"  // fsdp_comm_group, fsdp_reduce_op

struct fsdp_backend;  // core/backend.h: a device's table (for the device data planes)

#define FSDP_COMM_ABI 8
#define FSDP_COMM_ERRLEN 1024
#define FSDP_COMM_TAGLEN 96
#define FSDP_COLL_FINALIZE 5    // internal kind: the agreement made before MPI_Finalize
#define FSDP_COLL_PLANE_INIT 6  // internal kind: the ranks start a device data plane (comm_plane)
#define FSDP_COLL_PLANE_BOOT 7  // internal kind: the ranks bootstrap one only (fsdp_comm_plane_bootstrap)
#define FSDP_COLL_GROUPS 8      // internal kind: the ranks make the shard and replica groups (arg: size)

// The record every rank contributes before a collective; all ranks must agree on it.
#define FSDP_COMM_MAX_DIMS 8  // FSDP_MAX_DIMS of fsdp.h (comm.c checks that they agree)
typedef struct fsdp_comm_meta {
  int32_t kind;  // fsdp_coll_kind (or FSDP_COLL_FINALIZE)
  int32_t arg;   // reduce op, or broadcast root
  int32_t dtype;
  int32_t rank;
  int64_t bytes;  // payload: the full (unsharded) buffer's bytes
  int64_t seq;    // 1-based number of this collective on this rank
  char tag[FSDP_COMM_TAGLEN];
  // the shape every rank must pass (the tensor of broadcast and all_reduce, each rank's piece of
  // all_gather and reduce_scatter, the checked tensor of a shape agreement); ndim -1: none
  int32_t ndim;
  int16_t device;  // where the payload lives (fsdp_device; ranks may differ where the plane is 0)
  int16_t plane;   // how it moves: 0 through host memory on this backend, else the device data plane's id
  int64_t shape[FSDP_COMM_MAX_DIMS];
  // where the rank is in training (fsdp_comm_set_step, from sched.c): training forwards begun,
  // backward passes finished, and the phase (FSDP_PHASE_*); a rank that skipped a backward, or ran
  // a forward under grad the others did not, differs here at its next collective
  int64_t fwd, bwd;
  int32_t phase;
  int32_t group;   // fsdp_comm_group: which ranks move the data
} fsdp_comm_meta;  // 224 bytes, sent as raw bytes

enum { FSDP_PHASE_BETWEEN = 0, FSDP_PHASE_FORWARD = 1, FSDP_PHASE_BACKWARD = 2 };

// Rank 0's decision, sent to every rank: status 0 = go ahead, else msg says why not.
typedef struct fsdp_comm_verdict {
  int32_t status;
  char msg[FSDP_COMM_ERRLEN - 4];
} fsdp_comm_verdict;

// Runs on rank 0 once every record arrived (timed_out == 0) or the deadline passed
// (arrived[r] == 0 for the ranks that did not show up); fills the verdict.
typedef void (*fsdp_comm_decide_fn)(const fsdp_comm_meta* all, const int* arrived, int size, int timed_out,
                                    double timeout_s, fsdp_comm_verdict* v);

typedef struct fsdp_comm_backend {
  int abi;  // FSDP_COMM_ABI
  const char* name;
  // beat: called by the backend whenever a wait made progress (comm.c's watchdog reads it).
  // local_rank, local_size: this rank among the ranks of its node (shared memory), and how many
  int (*init)(int* rank, int* size, int* local_rank, int* local_size, void (*beat)(void), char* err);
  void (*finalize)(void);
  // every rank's record goes to rank 0, which decides; every rank gets the verdict. Waits at
  // most timeout_s plus a small margin (the mpi backend's WAIT_MARGIN_S; longer on ranks != 0
  // only while rank 0 says it is waiting for others, so its verdict, which names the missing
  // ranks, normally wins). Returns 0 with the verdict filled, -1 when this rank itself timed
  // out or MPI failed (the message is in v->msg, v->status != 0).
  int (*agree)(const fsdp_comm_meta* mine, double timeout_s, fsdp_comm_decide_fn decide, fsdp_comm_verdict* v);
  // the shard groups of `size` consecutive ranks and the replica groups (one rank of each shard
  // group, at the same place in it), for hybrid sharding: every rank calls it once, with one size
  int (*set_groups)(int size, char* err);
  // The data calls below never block: each wait is bounded by the timeout of the agreement that
  // preceded it; a rank that stops mid-way makes them return -1 with err naming the missing ranks.
  // `group` (fsdp_comm_group: the world, this rank's shard group or its replica group) says among
  // which ranks; size and rank below are within it.
  // out (size * bytes) = every rank's `in` (bytes each), rank order. in may be out + rank * bytes.
  int (*all_gather)(void* out, const void* in, size_t bytes, int group, char* err);
  // out (n floats) = this rank's chunk of the reduction of every rank's in (size * n floats)
  int (*reduce_scatter)(float* out, const float* in, size_t n, int op, int algo, int group, char* err);
  int (*all_reduce)(float* buf, size_t n, int op, int group, char* err);
  // the same all-reduce, started and not waited for (hybrid sharding's all-reduce over the replicas
  // runs while the next collectives do): *req is NULL when there was nothing to move, else a handle
  // for test, which sets *done once it finished (and did what finishing takes: avg's scaling,
  // freeing the handle), or returns -1 with err after the timeout from its start
  int (*all_reduce_start)(float* buf, size_t n, int op, int group, void** req, char* err);
  int (*test)(void* req, int* done, char* err);
  int (*broadcast)(void* buf, size_t bytes, int root, char* err);
  int (*barrier)(char* err);
} fsdp_comm_backend;

// ---- device data planes: collectives on device memory, queued on the device's streams ------------
// A plane moves device tensors without staging them through the host: NCCL (libfsdp_nccl.so), or
// the stand-in communicator (comm_standin.c, a test double of NCCL over the host backend, with
// completions delayed at random). The host backend stays the control plane: the
// ranks agree on every collective through it first, in order, and a plane starts (init) at a
// collective all ranks agreed on. Every entry runs on the communication thread and never waits
// for the device: a collective is queued on the plane's stream for its kind (all_gather and
// broadcast on the gather stream, reduce_scatter and all_reduce on the reduce stream), which
// first waits for `ready` (recorded on the compute stream after the inputs were written) and
// records `done` after the data moved; the compute stream waits for `done` at fsdp_work_wait.
#define FSDP_PLANE_NCCL 1
#define FSDP_PLANE_STANDIN 2
typedef struct fsdp_comm_plane {
  int abi;  // FSDP_COMM_ABI
  int id;   // FSDP_PLANE_*
  const char* name;
  // host: the control plane (NCCL's unique id travels by its broadcast); dev: the device's table,
  // device_index: which of its GPUs this process uses. Bootstraps (below), then connects.
  int (*init)(const fsdp_comm_backend* host, const struct fsdp_backend* dev, int device_index, int rank, int size,
              double timeout_s, char* err);
  // the bootstrap alone, needing no device: rank 0 makes the plane's connection ids, the host
  // backend broadcasts them; id_digest (17 bytes) gets their hex digest, equal on every rank
  int (*bootstrap)(const fsdp_comm_backend* host, int rank, int size, char* id_digest, char* err);
  void (*finalize)(int broken);  // broken: abort whatever is in flight instead of finishing it
  int (*all_gather)(void* out, const void* in, size_t bytes, void* ready, void* done, char* err);
  // op: sum or avg, never max (comm.c's route sends max through the host: NCCL's max drops a NaN);
  // a plane given max fails with err
  int (*reduce_scatter)(float* out, const float* in, size_t n, int op, void* ready, void* done, char* err);
  int (*all_reduce)(float* buf, size_t n, int op, void* ready, void* done, char* err);
  int (*broadcast)(void* buf, size_t bytes, int root, void* ready, void* done, char* err);
  // polled on the communication thread while collectives are in flight: 0, or -1 with err when
  // the oldest has not finished within timeout_s (a rank stopped after agreeing); the plane has
  // then aborted its communicators, so no stream waits forever
  int (*progress)(double timeout_s, char* err);
  int (*in_flight)(void);  // collectives queued and not finished yet
} fsdp_comm_plane;

// exported by libfsdp_nccl.so; the stand-in's (comm_standin.c) is in libfsdp.so
typedef const fsdp_comm_plane* (*fsdp_comm_plane_getter)(void);
const fsdp_comm_plane* fsdp_comm_nccl_plane(void);
const fsdp_comm_plane* fsdp_comm_standin_plane(void);

// exported by libfsdp_mpi.so
typedef const fsdp_comm_backend* (*fsdp_comm_backend_getter)(void);
const fsdp_comm_backend* fsdp_comm_mpi_backend(void);

// ---- for the rest of parallel/ (comm.c implements it; backends never see it) -------------------------------
// a barrier at which every rank must hold a tensor of t's shape and dtype (fsdp.wrap's check of
// its parameters when it does not broadcast them); NULL with the error set when it cannot start
struct fsdp_tensor;
struct fsdp_work;
struct fsdp_work* fsdp_comm_agree_shape(const struct fsdp_tensor* t, const char* tag);
// sched.c tells where training is; every collective issued after carries it
void fsdp_comm_set_step(int64_t fwd, int64_t bwd, int phase);
// a started collective waited for and freed: 0, or -1 with its error (w NULL: starting it failed,
// its error is set)
int fsdp_work_finish(struct fsdp_work* w);

#endif
