/*
 * core/core.h -- the core's structures and helpers, for every layer above it; not public API.
 *
 * A tensor is a view (shape, strides, offset, dtype) onto a refcounted storage. A storage
 * belongs to one device and one memory category; its bytes come from fsdp_alloc(), which
 * keeps the per-category counters behind fsdp_memory_stats() and allocates through the device's
 * backend table.
 *
 * The layers of src/ (make layers checks them), top to bottom:
 *   io/, parallel/   safetensors; communication and FSDP (comm, shard, sched)
 *   ops/         the op layer, device independent: checks shapes/dtypes, allocates outputs,
 *                records an autograd node, calls a kernel through the device's table
 *   backend/cpu/ the CPU's device functions and kernels (raw loops over buffers); a CUDA
 *                backend will sit beside it
 *   core/        this header: errors, memory, RNG, dtypes, storage, tensors, autograd, and the
 *                backend registry with the kernel tables (core/kernels_*.h, one per op family)
 * Each layer calls only down; core calls nothing above it (hooks let parallel reach in).
 */
#ifndef FSDP_CORE_H
#define FSDP_CORE_H

#include "fsdp.h"
#include "core/dtype.h"
#include <stdarg.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

// ---- errors ----------------------------------------------------------------------------------
// fsdp_errorf sets the thread's error message; CHECK keeps call sites to one line.
void fsdp_errorf(const char* fmt, ...) __attribute__((format(printf, 1, 2)));
#define CHECK(cond, ret, ...)   \
  do {                          \
    if (!(cond)) {              \
      fsdp_errorf(__VA_ARGS__); \
      return ret;               \
    }                           \
  } while (0)
#define CHECK_NULL(cond, ...) CHECK(cond, NULL, __VA_ARGS__)
#define CHECK_INT(cond, ...) CHECK(cond, -1, __VA_ARGS__)

// ---- growable arrays ------------------------------------------------------------------------
// makes the heap array *pv (type T**, *cap elements of `size` bytes) hold at least `need`
// elements, doubling from 16; 0, or -1 with "<what>: out of memory" set (*pv and *cap unchanged)
int fsdp_grow(void* pv, int* cap, int need, size_t size, const char* what);
// the timeline trace (trace.c; the public part is in fsdp.h)
void fsdp_trace_instant(int tid, const char* name, int64_t bytes);
void fsdp_trace_async(int begin, int64_t id, const char* name);  // the backward track's slices
void fsdp_trace_set_rank(int rank, int world);                   // names the file and the process

// a shape as "(2, 3)" in a rotating static buffer (good for a few uses in one message)
const char* fsdp_shape_s(const fsdp_tensor* t);
const char* fsdp_dims_s(int ndim, const int64_t* shape);
#define DT(t) fsdp_dtype_name((t)->dtype)
#define SH(t) fsdp_shape_s(t)

// ---- memory ------------------------------------------------------------------------------------
void* fsdp_alloc(size_t nbytes, int device, int cat);  // 64-byte aligned, counted
void fsdp_free(void* p, size_t nbytes, int device, int cat);
void fsdp_mem_move(size_t nbytes, int device, int from_cat, int to_cat);
// the category new tensors are allocated in (activations unless changed, e.g. by optimizers)
int fsdp_default_mem_category(void);
void fsdp_set_default_mem_category(int cat);

// Where a file-backed storage's bytes are (ops/deferred.c; io/safetensors.c makes them): read
// copies nbytes from byte `offset` of the storage; release drops ctx with the storage
typedef struct fsdp_source {
  int (*read)(void* ctx, void* dst, size_t nbytes, int64_t offset);  // 0, or -1 with the error set
  void (*release)(void* ctx);
  void* ctx;
} fsdp_source;
// one in-place write recorded on a meta storage (ops/deferred.c), with the view it wrote
typedef struct fsdp_step {
  int kind;                 // STEP_* of ops/deferred.c
  int dtype;                // the view's dtype (the storage's)
  double a, b;              // the value; or the draw's law (lo, hi) or (mean, std)
  uint64_t key;             // a draw's key
  struct fsdp_tensor* src;  // a copy's values: contiguous, the view's shape and dtype (owning ref)
  int ndim;
  int64_t shape[FSDP_MAX_DIMS], stride[FSDP_MAX_DIMS], offset;
} fsdp_step;

typedef struct fsdp_storage {
  _Atomic int refcount;  // atomic: a tensor may be released from another thread
  int device;
  int cat;  // memory category
  // 0, or (on the CPU) the device whose host_alloc gives the bytes: pinned host memory, allocated and
  // freed through that table (fsdp_pin_memory), never through the CPU's block cache
  int pinned;
  size_t nbytes;
  void* data;
  int64_t version;  // bumped by in-place writes; autograd checks saved tensors against it
  // the subsystem above core that manages this storage's bytes, or NULL. Its data may be absent
  // (parallel: an FSDP unit's gathered buffer while the unit is resharded); the engine then asks the
  // materialize hook to bring it back before a backward node reads it.
  void* owner;
  _Atomic int saved_refs;  // views of it that graph nodes hold saved for backward
  // deferred values (ops/deferred.c; data is NULL while they are): a meta storage has none yet, only
  // the writes done to it (steps); a file-backed one (source.read set) has them in a file
  int meta;
  int nsteps, steps_cap;
  fsdp_step* steps;
  fsdp_source source;
} fsdp_storage;
// the hook that brings back an owned storage's data: 0, or -1 with the error set. One hook for
// the process, installed by the owner's subsystem (parallel/sched.c).
typedef int (*fsdp_materialize_fn)(void* owner);
void fsdp_set_materialize_hook(fsdp_materialize_fn fn);
// the hook told when the last saved view of an owned storage is released (no graph node will read
// its bytes any more: parallel drops a unit's gathered parameters before backward builds its
// gradients); 0, or -1 with the error set
typedef int (*fsdp_unused_fn)(void* owner);
void fsdp_set_unused_hook(fsdp_unused_fn fn);
// t's bytes, brought back through the hook when an owner dropped them: 0, or -1 (error set)
int fsdp_storage_materialize(fsdp_storage* s);
// frees / re-allocates a storage's bytes while keeping the struct (and every view of it) alive
void fsdp_storage_drop_data(fsdp_storage* s);
int fsdp_storage_ensure_data(fsdp_storage* s);
fsdp_storage* fsdp_storage_new(size_t nbytes, int device, int cat);        // refcount 1, data allocated
fsdp_storage* fsdp_storage_new_empty(size_t nbytes, int device, int cat);  // refcount 1, no data
// the device whose table has host memory (host_alloc), or -1 when none is loaded
int fsdp_host_memory_device(void);
void fsdp_storage_release(fsdp_storage* s);
// the FSDP_DEFERRED_* kind of s's values (0: in memory, or owned by FSDP), and the release of what
// stood in for them (recorded steps, file source) once they are in memory or s goes
int fsdp_storage_deferred(const fsdp_storage* s);
void fsdp_storage_forget_deferred(fsdp_storage* s);
// error (naming op and shape) if t's bytes are not there (a resharded FSDP buffer)
int fsdp_check_data(const char* op, const fsdp_tensor* t);

// ---- tensors ------------------------------------------------------------------------------------
typedef struct fsdp_hook {
  int64_t id;
  fsdp_grad_hook_fn fn;  // NULL once removed
  void* ctx;
  struct fsdp_hook* next;
} fsdp_hook;
void fsdp_hooks_free(fsdp_hook* h);

struct fsdp_tensor {
  fsdp_tensor_head head;  // first: Lua reads it through the pointer (fsdp.h); set by parallel (shard.c)
  _Atomic int refcount;   // atomic: a tensor may be released from another thread
  int ndim;
  int dtype;
  int64_t shape[FSDP_MAX_DIMS];
  int64_t stride[FSDP_MAX_DIMS];  // in elements
  int64_t offset;                 // in elements
  fsdp_storage* storage;
  // autograd
  int requires_grad;   // leaves: user flag; non-leaves: 1 iff grad_fn != NULL
  fsdp_node* grad_fn;  // owning ref; NULL for leaves
  fsdp_tensor* grad;   // owning ref; accumulated gradient of a leaf
  unsigned grad_sets;  // bumped by every fsdp_tensor_set_grad (an assignment from outside the engine)
  fsdp_hook* hooks;    // leaf hooks (non-leaf hooks live on grad_fn)
  // engine scratch (leaves): contributions still to come in this backward, and whether any came
  int bw_pending, bw_got;
  // the subsystem above core that owns this tensor as a parameter (parallel: its FSDP unit) and the
  // parameter's index there; NULL for ordinary tensors. Core never reads them.
  void* owner;
  int owner_index;
};

static inline int fsdp_device_of(const fsdp_tensor* t) { return t->storage->device; }
static inline void* fsdp_ptr(const fsdp_tensor* t) {
  return (char*)t->storage->data + t->offset * (int64_t)fsdp_dtype_size(t->dtype);
}
static inline float* fsdp_f32(const fsdp_tensor* t) { return (float*)fsdp_ptr(t); }
static inline int64_t* fsdp_i64(const fsdp_tensor* t) { return (int64_t*)fsdp_ptr(t); }

// new tensor with fresh contiguous storage (uninitialised), refcount 1
fsdp_tensor* fsdp_new(int ndim, const int64_t* shape, int dtype, int device);
fsdp_tensor* fsdp_new_cat(int ndim, const int64_t* shape, int dtype, int device, int cat);  // in category cat
// new contiguous tensor in pinned host memory (uninitialised), refcount 1; NULL with the error set
// when no device has host memory or it is out of it
fsdp_tensor* fsdp_new_pinned(int ndim, const int64_t* shape, int dtype);
fsdp_tensor* fsdp_new_like(const fsdp_tensor* t);
fsdp_tensor* fsdp_new_layout_like(const fsdp_tensor* like, const int64_t* shape);
// contiguous view of `shape` at `offset` (elements) on an existing storage (retained), refcount 1
fsdp_tensor* fsdp_view_storage(fsdp_storage* s, int dtype, int ndim, const int64_t* shape, int64_t offset);
fsdp_tensor* fsdp_new_zeros_like(const fsdp_tensor* t);
// new view on t's storage (no autograd), refcount 1
fsdp_tensor* fsdp_new_view(const fsdp_tensor* t, int ndim, const int64_t* shape, const int64_t* stride, int64_t offset);
void fsdp_contiguous_strides(int ndim, const int64_t* shape, int64_t* stride);
int64_t fsdp_shape_numel(int ndim, const int64_t* shape);
// checked numel x element size of a shape; -1 with an error naming op when it is negative or overflows
int64_t fsdp_shape_nbytes(const char* op, int ndim, const int64_t* shape, size_t es);
bool fsdp_same_shape(const fsdp_tensor* a, const fsdp_tensor* b);
// normalises a possibly negative dim; returns -1 (and sets an error naming op) if out of range
int fsdp_wrap_dim(const char* op, int dim, int ndim);
// a contiguous version of t in `dtype` (new ref: t itself when it already is one); values are
// converted (to bf16/f16: rounded to nearest even)
fsdp_tensor* fsdp_as_contig_dtype(fsdp_tensor* t, int dtype);
// y (the caller's ref is consumed) in dtype: y itself (any layout) when it has it, else y rounded
// once to it (contiguous). NULL on error (also for y NULL). An op's float32 result in its result
// dtype, a gradient in its input's.
static inline fsdp_tensor* fsdp_round_to(fsdp_tensor* y, int dtype) {
  if (!y || y->dtype == dtype) return y;
  fsdp_tensor* r = fsdp_as_contig_dtype(y, dtype);
  fsdp_tensor_release(y);
  return r;
}
// a contiguous f32 version of t (new ref: t itself when already contiguous f32)
fsdp_tensor* fsdp_as_contig(fsdp_tensor* t);
// strided copy of any layout/dtype into dst (same numel), used by contiguous/casts/cat
int fsdp_copy_strided(fsdp_tensor* dst, const fsdp_tensor* src);
// a contiguous copy of t (same shape and dtype) on `device`; between devices the bytes go through
// the device side's copy (a copy to the host waits for the device's queued work)
fsdp_tensor* fsdp_copy_to_device(const fsdp_tensor* t, int device);
static inline void fsdp_bump_version(fsdp_tensor* t) { t->storage->version++; }
// error unless t is float32 (what kernels and collectives that take only f32 buffers need)
int fsdp_check_f32(const char* op, const fsdp_tensor* t);
// the float dtypes ops accept: float32, and bfloat16/float16, which they compute in float32
// (ops/ops.h, "float dtypes")
static inline bool fsdp_is_float(int dtype) { return dtype == FSDP_F32 || dtype == FSDP_BF16 || dtype == FSDP_F16; }
// error unless t has a float dtype (and its bytes are there)
int fsdp_check_float(const char* op, const fsdp_tensor* t);
// error unless a and b are on the same device
int fsdp_check_same_device(const char* op, const fsdp_tensor* a, const fsdp_tensor* b);

// ---- random numbers ------------------------------------------------------------------------------
uint64_t fsdp_rng_next(void);   // xoshiro256**
double fsdp_rng_uniform(void);  // [0, 1)
double fsdp_rng_normal(void);
// counter-based draws: value i of the draw keyed `key` (a tensor's draw takes one key from the
// stream), a function of (key, i) alone
double fsdp_draw_uniform(uint64_t key, int64_t i);  // [0, 1)
double fsdp_draw_normal(uint64_t key, int64_t i);

// ---- autograd ---------------------------------------------------------------------------------------
#define FSDP_NODE_MAX_INPUTS 8
#define FSDP_NODE_MAX_SAVED 8
// bytes of op parameters a node holds: three int64 shapes; the largest op struct (a binary op's
// two input shapes and ranks, 144 bytes) fits with room to spare
#define FSDP_NODE_PARAMS_BYTES (3 * FSDP_MAX_DIMS * 8)

// backward: given the gradient of the node's (single) output, writes a NEW ref (or NULL when that
// input needs no grad or gets zero) for each input i into grad_in[i]. Returns 0 or -1 (error set).
typedef int (*fsdp_backward_fn)(fsdp_node* node, fsdp_tensor* grad_out, fsdp_tensor** grad_in);

typedef struct fsdp_edge {
  fsdp_node* node;    // producer of this input (owning ref), or NULL
  fsdp_tensor* leaf;  // leaf that requires grad (owning ref), or NULL
} fsdp_edge;

struct fsdp_node {
  _Atomic int refcount;  // atomic: a tensor may be released from another thread
  const char* name;      // op name, e.g. "MatmulBackward"
  int64_t seq;           // creation order; the engine runs later nodes first
  fsdp_backward_fn backward;
  int n_inputs;
  fsdp_edge next[FSDP_NODE_MAX_INPUTS];
  int needs_grad[FSDP_NODE_MAX_INPUTS];  // input i requires grad
  int n_saved;
  fsdp_tensor* saved[FSDP_NODE_MAX_SAVED];
  int64_t saved_version[FSDP_NODE_MAX_SAVED];
  // made inside an activation-checkpointing region: saved[k] is NULL and its tensor is place k of
  // that region's rerun (autograd.c)
  struct fsdp_region* saved_region[FSDP_NODE_MAX_SAVED];
  int saved_place[FSDP_NODE_MAX_SAVED];
  unsigned char params[FSDP_NODE_PARAMS_BYTES];  // the op's parameter struct (fsdp_node_set_params)
  int64_t out_shape[FSDP_MAX_DIMS];
  int out_ndim, out_dtype;
  int released;      // saved tensors freed after a backward without retain_graph
  int keep_saved;    // while backward runs: this backward keeps saved tensors (retain_graph)
  fsdp_hook* hooks;  // grad hooks of the output tensor (non-leaf)
  // engine scratch
  int64_t visit;            // id of the backward pass that last reached this node
  int deps;                 // producers of gradients for this node still to run
  fsdp_tensor* grad_acc;    // sum of the gradients received so far
  fsdp_tensor** grad_dest;  // while backward runs: the sum input 0's gradient goes into (the
                            // next node's grad_acc), or NULL (a leaf, or no grad wanted)
};

// Creates a node for op `name` if grad mode is on and any input requires grad; else NULL
// (no error). Inputs may be NULL (absent optional inputs). The node takes refs to edges.
// Typical op:
//   fsdp_tensor* out = fsdp_new(...); kernel(...);
//   fsdp_node* n = fsdp_node_new("MulBackward", mul_backward, 2, (fsdp_tensor*[]){a, b});
//   if (n) { fsdp_node_save(n, a); fsdp_node_save(n, b); fsdp_node_set_output(n, out); }
//   return out;
// An op with parameters (shapes, dims, scalars) defines its own struct next to its backward;
// forward stores it in the node, backward copies it out:
//   typedef struct { int dim; double scale; } foo_params;
//   fsdp_node_set_params(n, &(foo_params){.dim = d, .scale = s}, sizeof(foo_params));
//   foo_params p;
//   fsdp_node_params(n, &p, sizeof p);
fsdp_node* fsdp_node_new(const char* name, fsdp_backward_fn backward, int n_inputs, fsdp_tensor** inputs);
// saves a tensor (new ref) and its version for backward; returns its slot
int fsdp_node_save(fsdp_node* n, fsdp_tensor* t);
// returns saved tensor k, or NULL with an error if the graph was freed or it was modified in place
fsdp_tensor* fsdp_node_saved(fsdp_node* n, int k);
// Inside backward: whether saved tensor k is the last saved view of bytes an owner manages, so
// that releasing it (fsdp_node_release_saved) lets the owner free them -- an op may then finish
// the work that reads it before allocating the rest (linear: grad_input, then grad_weight).
int fsdp_node_saved_last_use(const fsdp_node* n, int k);
// releases saved tensor k before the node ends (no-op under retain_graph); the op must not touch
// it (nor pointers into its bytes) afterwards. 0, or -1 with the error set (the owner's hook)
int fsdp_node_release_saved(fsdp_node* n, int k);
// copies the op's parameter struct p (size bytes) into the node; aborts when it does not fit
void fsdp_node_set_params(fsdp_node* n, const void* p, size_t size);
// copies the node's parameters out into p (size bytes: the struct set_params stored)
void fsdp_node_params(const fsdp_node* n, void* p, size_t size);
// makes `out` the node's output (out takes over the caller's ref to n)
void fsdp_node_set_output(fsdp_node* n, fsdp_tensor* out);
void fsdp_node_release(fsdp_node* n);

// id of the current (or last) backward pass
int64_t fsdp_autograd_pass(void);

// accumulate `g` into *acc (consumes nothing; *acc gets a new ref or is summed in place)
int fsdp_grad_accumulate(fsdp_tensor** acc, fsdp_tensor* g);
// 1 when gradient sum t may be added to in place (contiguous f32, held by nobody else)
int fsdp_grad_exclusive(const fsdp_tensor* t);

// ---- device backends: the device interface (core/backend.h) ------------------------------------
#include "core/backend.h"

// 0 when every entry of b is there; -1 (error naming the backend and the missing entry) otherwise
int fsdp_backend_check(const fsdp_backend* b);
// registers the table of `device`; -1 (error naming the backend and the missing entry) when an
// entry is NULL, or when the device already has a backend
int fsdp_backend_register(int device, const fsdp_backend* b);
// ---- deferred checks (async devices: index and target checks run on the device) --------------------
// registers what a device-side check reports if it fails: fmt formatted now, with one "%%lld" left
// in it for the bad value; returns the check's id (> 0) for the checking kernel
int fsdp_check_defer(const char* fmt, ...) __attribute__((format(printf, 1, 2)));
// a device found check `id` failed with `value` (at a synchronization): sets the error from its
// message; returns -1
int fsdp_check_report(int id, int64_t value);

// an optional backend's library: $env_var, else `name` next to this libfsdp.so, else the default
// search path (dlopen flags); NULL with every try's reason in tried
void* fsdp_dlopen_backend(const char* env_var, const char* name, int flags, char* tried, size_t tried_len);
// the table of a device, or NULL with "device <name> has no backend loaded" set
const fsdp_backend* fsdp_backend_for(int device);
// the table of t's device (a tensor exists only on a device whose backend is registered)
const fsdp_backend* fsdp_backend_of(const fsdp_tensor* t);
// the name users know a device by ("cpu", "cuda"), for messages
const char* fsdp_device_name(int device);

#endif
