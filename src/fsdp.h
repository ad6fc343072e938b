/*
 * fsdp.h -- THE public C API of libfsdp.
 *
 * Overview
 *   Tensors are refcounted handles (fsdp_tensor*). Every function that returns a tensor
 *   returns a NEW reference (release it with fsdp_tensor_release) or NULL on error.
 *   Every function that returns int returns 0 on success, non-zero on error.
 *   On error, fsdp_last_error() holds a message naming the op, shapes and dtypes.
 *   Nothing here exits or aborts on user error: the caller is a Lua VM.
 *
 *   Dimensions are 0-based in C; negative dims count from the end (-1 is the last).
 *   The Lua layer converts its 1-based dims before calling. Error messages speak to the Lua
 *   user: they name dims, start positions and list positions 1-based (C's dim 0 is "dim 1").
 *
 *   Ops that take tensors requiring grad record an autograd node (see core/autograd.c);
 *   fsdp_backward() runs the graph and fires engine events that FSDP listens to.
 *
 * The part between FFI-BEGIN and FFI-END is fed verbatim to LuaJIT's ffi.cdef
 * (the Makefile extracts it into lua/fsdp/cdef.lua), so it holds no macros,
 * no #includes and no comments other than line comments.
 */
#ifndef FSDP_H
#define FSDP_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define FSDP_MAX_DIMS 8

// FFI-BEGIN
typedef struct fsdp_tensor fsdp_tensor;
// Every fsdp_tensor begins with these fields, which Lua reads without a call (a cast of the
// pointer): fsdp._t checks them for every tensor argument, in the hottest loops.
typedef struct fsdp_tensor_head {
  int piece;     // 1: a sharded FSDP parameter in its piece form (fsdp_param_piece), else 0
  int deferred;  // its values are not in memory (fsdp_tensor_deferred): FSDP_DEFERRED_*, else 0
} fsdp_tensor_head;
typedef struct fsdp_node fsdp_node;
typedef struct fsdp_st_file fsdp_st_file;

// FSDP_BOOL: one byte per element, 0 or 1 (torch.bool): comparisons' results, where's condition
typedef enum { FSDP_F32 = 0, FSDP_I64 = 1, FSDP_BF16 = 2, FSDP_F16 = 3, FSDP_BOOL = 4, FSDP_NDTYPES = 5 } fsdp_dtype;
typedef enum { FSDP_CPU = 0, FSDP_CUDA = 1, FSDP_NDEVICES = 2 } fsdp_device;

// memory categories for the allocator's counters (fsdp.memory_stats())
typedef enum {
  FSDP_MEM_PARAMS = 0,
  FSDP_MEM_GRADS = 1,
  FSDP_MEM_OPTIM = 2,
  FSDP_MEM_ACTIVATIONS = 3,
  FSDP_MEM_COMM = 4,
  FSDP_MEM_OTHER = 5,
  FSDP_MEM_NCAT = 6
} fsdp_mem_cat;

// autograd engine events (bit flags for listeners)
typedef enum {
  FSDP_EV_BACKWARD_BEGIN = 1,
  FSDP_EV_NODE_PRE = 2,
  FSDP_EV_NODE_POST = 4,
  FSDP_EV_GRAD_READY = 8,
  FSDP_EV_BACKWARD_END = 16
} fsdp_event;

// listener: node is set for NODE_PRE/POST, tensor for GRAD_READY (the leaf whose .grad is final
// for this backward). Returns 0, or non-zero to abort backward with fsdp_last_error().
typedef int (*fsdp_listener_fn)(int event, fsdp_node* node, fsdp_tensor* tensor, void* ctx);
// grad hook: returns a new reference to a replacement gradient, or NULL to keep `grad`.
// To signal an error, set *err non-zero (fsdp_set_error() the message).
typedef fsdp_tensor* (*fsdp_grad_hook_fn)(fsdp_tensor* grad, void* ctx, int* err);
// end-of-backward callback queued with fsdp_queue_callback
typedef int (*fsdp_callback_fn)(void* ctx);

// ---- errors, threads -------------------------------------------------------------------
const char* fsdp_last_error(void);
void fsdp_set_error(const char* msg);
void fsdp_clear_error(void);
void fsdp_set_num_threads(int n);  // clamped into [1, fsdp_max_num_threads()]
int fsdp_get_num_threads(void);
int fsdp_max_num_threads(void);  // OMP_THREAD_LIMIT, at most 1024 (backend/cpu/backend.c, "threads")
// the CPU (backend/cpu/cpuinfo.c): its widest vector ISA ("avx512f", "avx2+fma" or "sse2"; capped
// by FSDP_CPU_ISA, which every hand-written kernel and oneDNN obey), the
// kernels OpenBLAS picked for it (openblas_get_corename(): "Haswell", "SkylakeX", "Prescott", ...),
// and one core's float32 FMA peak in GFLOP/s (a register-only FMA loop of that ISA, run for about
// `seconds` on the calling thread)
const char* fsdp_cpu_isa(void);
const char* fsdp_cpu_blas_core(void);
double fsdp_cpu_fma_peak(double seconds);
// which library runs the GEMMs and why ("onednn (OpenBLAS at 0.56x oneDNN's speed)", "openblas (FSDP_GEMM)", ...;
// backend/cpu/linalg.c chooses at the first GEMM, or when asked here first)
const char* fsdp_cpu_gemm_backend(void);
// one float32 GEMM on the calling thread, as the CPU kernels run it on that library: C (M, N) =
// alpha op(A) op(B) + beta C, row-major, op(X) = X^T where tX (bench/gemm_floor.lua times these)
void fsdp_cpu_sgemm(int ta, int tb, int64_t M, int64_t N, int64_t K, float alpha, const float* A, int64_t lda,
                    const float* B, int64_t ldb, float beta, float* C, int64_t ldc);
// how GEMMs on two bfloat16 operands run ("onednn bf16 (native: avx512_bf16)", "upcast to float32
// (oneDNN has no bf16 GEMM for this CPU)", "upcast to float32 (FSDP_BF16_GEMM)", ...; backend/cpu/bf16.c
// chooses at the first such GEMM, or when asked here first)
const char* fsdp_cpu_bf16_gemm_backend(void);
// how many convolution passes (forward, input gradient, weight gradient) oneDNN has run in this
// process on operands of `dtype` (FSDP_F32 or FSDP_BF16; backend/cpu/onednn.c), for tests and
// benchmarks that want to know which path a convolution took
int64_t fsdp_cpu_onednn_conv_passes(int dtype);

// ---- CUDA (backend/cuda/load.c; the backend itself is libfsdp_cuda.so, loaded on first use) ----
// 1 when a driver, a device and libfsdp_cuda.so are there and its device table is registered;
// the first call checks (cheaply: the driver first) and loads it
int fsdp_cuda_is_available(void);
// "" when available, else why not: "no NVIDIA driver (...)", "no CUDA device (...)",
// "libfsdp_cuda.so is missing or cannot load (...)", or the library's own failure
const char* fsdp_cuda_why_not(void);
// the devices the driver sees (0 without one); device 0's name ("" when not available)
int fsdp_cuda_device_count(void);
// the GPU this process computes on (0-based): FSDP_CUDA_DEVICE, else the local rank modulo the count
int fsdp_cuda_current_device(void);
const char* fsdp_cuda_device_name(void);
// the versions the backend runs on ("runtime 13000, driver 13000, cuBLASLt 130100, ...")
const char* fsdp_cuda_versions(void);
// waits for all of the device's queued work; -1 with the error of a failed kernel or launch
int fsdp_cuda_synchronize(void);
// 1 when `device` has a backend registered (the CPU always; "cuda" once loaded, or the test double)
int fsdp_device_has_backend(int device);
// tests only: registers the test double of a GPU (backend/testdev) as the "cuda" device -- the CPU's
// kernels on memory the host cannot touch outside the device table; 0, or -1 when a real CUDA
// backend is there already
int fsdp_testdev_install(void);
// the test double's count of host waits on the device so far: copies to the host, synchronize, and
// the entries whose result the host reads at once (checks, loss sums; a GPU would wait for each)
int64_t fsdp_testdev_syncs(void);
// loads libfsdp_cuda.so without a GPU (no init) and checks that its device table is complete:
// 0, or -1 with the error naming the missing entry or why the library does not load
int fsdp_cuda_check_library(void);

// ---- the timeline trace (core/trace.c; FSDP_TRACE=path starts it when the library loads) ----------
enum { FSDP_TRACE_COMPUTE = 1, FSDP_TRACE_COMM = 2, FSDP_TRACE_BACKWARD = 3 };  // its tracks
int fsdp_trace_start(const char* path);
int fsdp_trace_stop(void);  // writes path (one rank) or path.rank<R>.json
int fsdp_trace_enabled(void);
double fsdp_trace_now(void);  // microseconds since the trace started
// a slice on track `tid` from t0_us (fsdp_trace_now() when it began) to now; bytes -1: none
void fsdp_trace_span(int tid, const char* name, double t0_us, int64_t bytes);

// ---- memory ------------------------------------------------------------------------------
// current and peak bytes per category (arrays of FSDP_MEM_NCAT) on the CPU, or on `device`
void fsdp_memory_stats(int64_t* current, int64_t* peak);
int fsdp_memory_stats_device(int device, int64_t* current, int64_t* peak);
// every device's peaks back to its current bytes
void fsdp_memory_reset_peaks(void);
// returns the allocator's cached free blocks to the system
void fsdp_memory_empty_cache(void);
// the counter of activation bytes allocated since the last call to fsdp_memory_gc_done(); the Lua
// layer reads it (a load, not a call, on every new tensor) to decide when to run its collector.
const int64_t* fsdp_memory_gc_pressure(void);
void fsdp_memory_gc_done(void);
// bytes of page-locked host memory in use (pinned CPU tensors, fsdp_pin_memory); they count in the
// CPU's categories too, as its other bytes
int64_t fsdp_memory_pinned_bytes(void);

// ---- random numbers (one global generator, identical on every machine) --------------------
void fsdp_manual_seed(uint64_t seed);
void fsdp_rng_get_state(uint64_t* state4);
void fsdp_rng_set_state(const uint64_t* state4);

// ---- tensor lifetime and accessors ---------------------------------------------------------
void fsdp_tensor_retain(fsdp_tensor* t);
void fsdp_tensor_release(fsdp_tensor* t);
int fsdp_tensor_ndim(const fsdp_tensor* t);
int64_t fsdp_tensor_size(const fsdp_tensor* t, int dim);
int64_t fsdp_tensor_stride(const fsdp_tensor* t, int dim);
int64_t fsdp_tensor_numel(const fsdp_tensor* t);
int64_t fsdp_tensor_offset(const fsdp_tensor* t);
int fsdp_tensor_dtype(const fsdp_tensor* t);
int fsdp_tensor_device(const fsdp_tensor* t);
int fsdp_tensor_is_contiguous(const fsdp_tensor* t);
int fsdp_tensor_mem_category(const fsdp_tensor* t);
// moves the tensor's storage bytes to another memory category (e.g. params)
void fsdp_tensor_set_mem_category(fsdp_tensor* t, int cat);
// pointer to the first element (storage data + offset); valid while t is alive
void* fsdp_tensor_data(const fsdp_tensor* t);
int64_t fsdp_tensor_version(const fsdp_tensor* t);
int fsdp_tensor_same_storage(const fsdp_tensor* a, const fsdp_tensor* b);
size_t fsdp_dtype_size(int dtype);
const char* fsdp_dtype_name(int dtype);
// writes a shape like "(2, 3, 4)" into buf
const char* fsdp_shape_str(const fsdp_tensor* t, char* buf, int buflen);
// scalar value of a one-element tensor, as double
int fsdp_tensor_item(const fsdp_tensor* t, double* out);
// copies all elements, in logical (row-major) order, converted to double; an int64 element that
// no double holds exactly (beyond 2^53) is an error naming it, never a rounded number
int fsdp_tensor_to_doubles(const fsdp_tensor* t, double* out);

// ---- autograd attributes ----------------------------------------------------------------------
int fsdp_tensor_requires_grad(const fsdp_tensor* t);
int fsdp_tensor_set_requires_grad(fsdp_tensor* t, int flag);
int fsdp_tensor_is_leaf(const fsdp_tensor* t);
fsdp_tensor* fsdp_tensor_grad(fsdp_tensor* t);               // new ref, or NULL without error if none
int fsdp_tensor_set_grad(fsdp_tensor* t, fsdp_tensor* g);    // g may be NULL (clears)
const char* fsdp_tensor_grad_fn_name(const fsdp_tensor* t);  // "" for leaves
fsdp_node* fsdp_tensor_grad_fn(const fsdp_tensor* t);        // borrowed, NULL for leaves
const char* fsdp_node_name(const fsdp_node* n);
int64_t fsdp_node_seq(const fsdp_node* n);

// ---- creation ---------------------------------------------------------------------------------
fsdp_tensor* fsdp_empty(int ndim, const int64_t* shape, int dtype, int device);
fsdp_tensor* fsdp_full(int ndim, const int64_t* shape, double value, int dtype, int device);
fsdp_tensor* fsdp_from_doubles(int ndim, const int64_t* shape, int dtype, const double* values);
fsdp_tensor* fsdp_from_blob(int ndim, const int64_t* shape, int dtype, const void* data);  // copies
fsdp_tensor* fsdp_arange(double start, double end, double step, int dtype);
fsdp_tensor* fsdp_rand(int ndim, const int64_t* shape, double lo, double hi);       // uniform f32
fsdp_tensor* fsdp_randn(int ndim, const int64_t* shape, double mean, double std);   // normal f32
fsdp_tensor* fsdp_randint(int64_t lo, int64_t hi, int ndim, const int64_t* shape);  // i64 in [lo,hi)
fsdp_tensor* fsdp_randperm(int64_t n);                                              // i64

// ---- in-place (no autograd; bump the version counter) ---------------------------------------
int fsdp_fill_(fsdp_tensor* t, double value);
int fsdp_copy_(fsdp_tensor* dst, fsdp_tensor* src);               // src broadcast to dst's shape; any dtypes
int fsdp_add_(fsdp_tensor* t, fsdp_tensor* other, double alpha);  // t += alpha * other
int fsdp_mul_scalar_(fsdp_tensor* t, double s);
int fsdp_uniform_(fsdp_tensor* t, double lo, double hi);
int fsdp_normal_(fsdp_tensor* t, double mean, double std);
// t gets values [skip, skip + numel(t)) of a draw of `total` values: a sharded parameter's piece
// gets the numbers its whole tensor would. A draw takes one key from the RNG stream, whatever its
// size, and value i of it is a function of (key, i) alone, so a piece is drawn without the rest.
int fsdp_uniform_slice_(fsdp_tensor* t, double lo, double hi, int64_t skip, int64_t total);
int fsdp_normal_slice_(fsdp_tensor* t, double mean, double std, int64_t skip, int64_t total);
int fsdp_add_scalar_(fsdp_tensor* t, double v);  // t += v (as add_ of a tensor full of v)

// ---- deferred values (ops/deferred.c) ---------------------------------------------------------------
// A meta tensor (built inside fsdp.meta) has a shape, a dtype and no values: what is done to it in
// place -- fills, scalings, random draws, copies from real tensors -- is recorded on its storage, in
// order, and replayed when values are asked for (any element range alone: a rank's piece), giving
// bit for bit what the same calls give on an eager tensor. A file-backed tensor (fsdp.load) reads
// its values from the file: a range when it is the source of a copy, all of them on other first use.
typedef enum { FSDP_DEFERRED_META = 1, FSDP_DEFERRED_FILE = 2 } fsdp_deferred_kind;
// a meta tensor whose values will live on `device` once materialised (Module:to moves a meta
// tensor's device alone)
fsdp_tensor* fsdp_meta_empty(int ndim, const int64_t* shape, int dtype, int device);
// 0 (values in memory), or the fsdp_deferred_kind of t's storage; refreshes t's head
int fsdp_tensor_deferred(fsdp_tensor* t);
// t's values brought into memory in place, on `device` (meta: replayed; file: read); every view of
// the storage sees them. 0, or -1 with the error set
int fsdp_materialize_(fsdp_tensor* t, int device);
// elements [start, start + n) of contiguous t, flattened, written into dst (n elements, contiguous,
// any dtype and device), converting: replayed, read from the file, or copied. 0 or -1
int fsdp_read_range(const fsdp_tensor* t, int64_t start, int64_t n, fsdp_tensor* dst);
// t and its .grad take a float dtype in place, keeping the tensor object (module.to(dtype)): new
// storage with the values converted (rounded to nearest even). Leaves only, not FSDP parameters.
int fsdp_set_dtype_(fsdp_tensor* t, int dtype);
// a leaf moved to `device` in place (the same tensor; its gradient follows): Module:to(device)
int fsdp_set_device_(fsdp_tensor* t, int device);

// ---- views and shape ops (0-based dims) -----------------------------------------------------
fsdp_tensor* fsdp_detach(fsdp_tensor* a);                                   // shares storage, no grad
fsdp_tensor* fsdp_clone(fsdp_tensor* a);                                    // contiguous copy, differentiable
fsdp_tensor* fsdp_contiguous(fsdp_tensor* a);                               // a itself (new ref) if already contiguous
fsdp_tensor* fsdp_view(fsdp_tensor* a, int ndim, const int64_t* shape);     // one -1 allowed
fsdp_tensor* fsdp_reshape(fsdp_tensor* a, int ndim, const int64_t* shape);  // view or copy
fsdp_tensor* fsdp_flatten(fsdp_tensor* a, int start_dim, int end_dim);
fsdp_tensor* fsdp_transpose(fsdp_tensor* a, int d0, int d1);
fsdp_tensor* fsdp_permute(fsdp_tensor* a, int ndim, const int* dims);
fsdp_tensor* fsdp_unsqueeze(fsdp_tensor* a, int dim);
fsdp_tensor* fsdp_squeeze(fsdp_tensor* a, int dim);
fsdp_tensor* fsdp_expand(fsdp_tensor* a, int ndim, const int64_t* shape);  // -1 keeps a size
fsdp_tensor* fsdp_narrow(fsdp_tensor* a, int dim, int64_t start, int64_t length);
fsdp_tensor* fsdp_cat(int n, fsdp_tensor** ts, int dim);
fsdp_tensor* fsdp_index_select(fsdp_tensor* a, int dim, fsdp_tensor* index);
fsdp_tensor* fsdp_to_dtype(fsdp_tensor* a, int dtype);    // differentiable between float dtypes
fsdp_tensor* fsdp_to_device(fsdp_tensor* a, int device);  // a copy on `device` (a itself when there); differentiable
// a contiguous copy of CPU tensor a in page-locked host memory, which a GPU copies from directly
// (a itself when pinned already); differentiable. An error when a is not on the CPU or no device with
// such memory is loaded (no GPU)
fsdp_tensor* fsdp_pin_memory(fsdp_tensor* a);
int fsdp_is_pinned(const fsdp_tensor* t);  // 1 when t's storage is pinned host memory (views of it too)

// ---- elementwise (broadcasting) ------------------------------------------------------------
fsdp_tensor* fsdp_add(fsdp_tensor* a, fsdp_tensor* b);
fsdp_tensor* fsdp_sub(fsdp_tensor* a, fsdp_tensor* b);
fsdp_tensor* fsdp_mul(fsdp_tensor* a, fsdp_tensor* b);
fsdp_tensor* fsdp_div(fsdp_tensor* a, fsdp_tensor* b);
fsdp_tensor* fsdp_add_scalar(fsdp_tensor* a, double s);
fsdp_tensor* fsdp_mul_scalar(fsdp_tensor* a, double s);
fsdp_tensor* fsdp_rdiv_scalar(double s, fsdp_tensor* a);  // s / a
fsdp_tensor* fsdp_pow_scalar(fsdp_tensor* a, double p);   // a ^ p
fsdp_tensor* fsdp_neg(fsdp_tensor* a);
fsdp_tensor* fsdp_exp(fsdp_tensor* a);
fsdp_tensor* fsdp_log(fsdp_tensor* a);
fsdp_tensor* fsdp_sqrt(fsdp_tensor* a);
fsdp_tensor* fsdp_abs(fsdp_tensor* a);
fsdp_tensor* fsdp_tanh(fsdp_tensor* a);
fsdp_tensor* fsdp_sigmoid(fsdp_tensor* a);
fsdp_tensor* fsdp_relu(fsdp_tensor* a);
fsdp_tensor* fsdp_gelu(fsdp_tensor* a, int approximate_tanh);
// comparisons (no grad): bool tensors with broadcasting; inputs of any dtype, compared as float32
fsdp_tensor* fsdp_eq(fsdp_tensor* a, fsdp_tensor* b);
fsdp_tensor* fsdp_ne(fsdp_tensor* a, fsdp_tensor* b);
fsdp_tensor* fsdp_lt(fsdp_tensor* a, fsdp_tensor* b);
fsdp_tensor* fsdp_le(fsdp_tensor* a, fsdp_tensor* b);
fsdp_tensor* fsdp_gt(fsdp_tensor* a, fsdp_tensor* b);
fsdp_tensor* fsdp_ge(fsdp_tensor* a, fsdp_tensor* b);
// cond (bool) ? a : b, all three broadcast; differentiable in a and b
fsdp_tensor* fsdp_where(fsdp_tensor* cond, fsdp_tensor* a, fsdp_tensor* b);
// a with value where mask (bool, broadcastable to a's shape) holds; the gradient is 0 there
fsdp_tensor* fsdp_masked_fill(fsdp_tensor* a, fsdp_tensor* mask, double value);
// max(a, lo) / min(a, hi); the gradient passes where a >= lo / a <= hi (PyTorch's clamp)
fsdp_tensor* fsdp_clamp_min(fsdp_tensor* a, double lo);
fsdp_tensor* fsdp_clamp_max(fsdp_tensor* a, double hi);
// elementwise, broadcasting, NaN propagates; ties split the gradient evenly (PyTorch's rule)
fsdp_tensor* fsdp_minimum(fsdp_tensor* a, fsdp_tensor* b);
fsdp_tensor* fsdp_maximum(fsdp_tensor* a, fsdp_tensor* b);
// running sum along dim (differentiable)
fsdp_tensor* fsdp_cumsum(fsdp_tensor* a, int dim);
// a with the elements above (tril) / below (triu) diagonal k of the last two dims set to 0
fsdp_tensor* fsdp_tril(fsdp_tensor* a, int64_t k);
fsdp_tensor* fsdp_triu(fsdp_tensor* a, int64_t k);

// ---- reductions (ndims == 0 means all dims) --------------------------------------------------
fsdp_tensor* fsdp_sum(fsdp_tensor* a, int ndims, const int* dims, int keepdim);
fsdp_tensor* fsdp_mean(fsdp_tensor* a, int ndims, const int* dims, int keepdim);
// max over one dim: values (differentiable) and, if indices != NULL, a new ref to i64 indices
fsdp_tensor* fsdp_max(fsdp_tensor* a, int dim, int keepdim, fsdp_tensor** indices);
fsdp_tensor* fsdp_max_all(fsdp_tensor* a);
fsdp_tensor* fsdp_argmax(fsdp_tensor* a, int dim, int keepdim);
// min over one dim (values and i64 indices, as fsdp_max) and over all elements
fsdp_tensor* fsdp_min(fsdp_tensor* a, int dim, int keepdim, fsdp_tensor** indices);
fsdp_tensor* fsdp_min_all(fsdp_tensor* a);

// ---- selection, sorting and sampling (index VALUES 0-based, as in PyTorch) -------------------
// out (index's shape) = a gathered along dim: out[i] = a[i with index[i] at dim]; index i64 with
// a's number of dims, no larger than a but at dim (torch.gather); differentiable in a
fsdp_tensor* fsdp_gather(fsdp_tensor* a, int dim, fsdp_tensor* index);
// a copy of a with src (at least index's sizes) added along dim at index (torch.scatter_add);
// differentiable in a and src
fsdp_tensor* fsdp_scatter_add(fsdp_tensor* a, int dim, fsdp_tensor* index, fsdp_tensor* src);
// i64 positions that sort a along dim, stable (torch.sort(stable=True)): NaN after every number
fsdp_tensor* fsdp_argsort(fsdp_tensor* a, int dim, int descending);
// sorted values (differentiable) and, if indices != NULL, a new ref to the i64 positions
fsdp_tensor* fsdp_sort(fsdp_tensor* a, int dim, int descending, fsdp_tensor** indices);
// the k largest (or smallest) along dim, in sorted order, ties in index order
fsdp_tensor* fsdp_topk(fsdp_tensor* a, int64_t k, int dim, int largest, fsdp_tensor** indices);
// i64 (n) or (rows, n) category indices drawn from probs (1-D or 2-D rows, >= 0, need not sum to 1)
// with core's RNG stream (fsdp_manual_seed), so a seed gives the same draws on every rank
fsdp_tensor* fsdp_multinomial(fsdp_tensor* probs, int64_t num_samples, int replacement);

// ---- linear algebra (BLAS) --------------------------------------------------------------------
fsdp_tensor* fsdp_matmul(fsdp_tensor* a, fsdp_tensor* b);                  // torch.matmul semantics
fsdp_tensor* fsdp_bmm(fsdp_tensor* a, fsdp_tensor* b);                     // (B,n,k) x (B,k,m)
fsdp_tensor* fsdp_linear(fsdp_tensor* x, fsdp_tensor* w, fsdp_tensor* b);  // x (*,in), w (out,in), b (out) or NULL

// ---- convolution and pooling (NCHW) -----------------------------------------------------------
// x (N,C,H,W), w (O,C/groups,kh,kw), b (O) or NULL; stride/padding/dilation are [h, w]
fsdp_tensor* fsdp_conv2d(fsdp_tensor* x, fsdp_tensor* w, fsdp_tensor* b, const int* stride, const int* padding,
                         const int* dilation, int groups);
// PyTorch's conv_transpose2d: x (N,Cin,H,W), w (Cin,Cout/groups,kh,kw), b (Cout) or NULL; output
// (N, Cout, (H-1)*stride - 2*padding + dilation*(kh-1) + output_padding + 1, likewise W)
fsdp_tensor* fsdp_conv_transpose2d(fsdp_tensor* x, fsdp_tensor* w, fsdp_tensor* b, const int* stride,
                                   const int* padding, const int* output_padding, const int* dilation, int groups);
fsdp_tensor* fsdp_max_pool2d(fsdp_tensor* x, const int* kernel, const int* stride, const int* padding,
                             const int* dilation, int ceil_mode);
fsdp_tensor* fsdp_avg_pool2d(fsdp_tensor* x, const int* kernel, const int* stride, const int* padding, int ceil_mode,
                             int count_include_pad);
fsdp_tensor* fsdp_adaptive_avg_pool2d(fsdp_tensor* x, int out_h, int out_w);

// ---- neural-network ops ------------------------------------------------------------------------
fsdp_tensor* fsdp_softmax(fsdp_tensor* a, int dim);
fsdp_tensor* fsdp_log_softmax(fsdp_tensor* a, int dim);
// logits (N,C) or (N,C,d1..), target i64 (N) or (N,d1..); mean over non-ignored targets
fsdp_tensor* fsdp_cross_entropy(fsdp_tensor* logits, fsdp_tensor* target, int64_t ignore_index, double label_smoothing);
fsdp_tensor* fsdp_nll_loss(fsdp_tensor* logp, fsdp_tensor* target, int64_t ignore_index);
fsdp_tensor* fsdp_mse_loss(fsdp_tensor* a, fsdp_tensor* b);
// normalizes over the last normalized_ndim dims; w and b may be NULL
fsdp_tensor* fsdp_layer_norm(fsdp_tensor* x, int normalized_ndim, fsdp_tensor* w, fsdp_tensor* b, double eps);
fsdp_tensor* fsdp_embedding(fsdp_tensor* weight, fsdp_tensor* index, int64_t padding_idx);
fsdp_tensor* fsdp_dropout(fsdp_tensor* x, double p, int training);
// whole channels of x (N,C,H,W) or (C,H,W) zeroed with probability p, the rest scaled by 1/(1-p)
fsdp_tensor* fsdp_dropout2d(fsdp_tensor* x, double p, int training);
// q (B..,Tq,D), k (B..,Tk,D), v (B..,Tk,Dv); mask NULL or broadcastable additive f32 (Tq,Tk);
// scale <= 0 means 1/sqrt(D)
fsdp_tensor* fsdp_scaled_dot_product_attention(fsdp_tensor* q, fsdp_tensor* k, fsdp_tensor* v, fsdp_tensor* mask,
                                               int causal, double dropout_p, double scale);

// ---- normalization ops (ops/norm.c; the synchronized batch norm in parallel/sync_bn.c) -------------
// x (N, C, ...): training normalizes with the batch statistics and moves running_mean/var (when
// given, float32 or x's dtype, (C)) toward them by momentum; eval uses the running statistics.
// w, b (C) may be NULL. PyTorch's F.batch_norm.
fsdp_tensor* fsdp_batch_norm(fsdp_tensor* x, fsdp_tensor* running_mean, fsdp_tensor* running_var, fsdp_tensor* w,
                             fsdp_tensor* b, int training, double momentum, double eps);
// the same with the statistics of the global batch in training: the per-channel sums (and the
// count) are all-reduced over the communicator, and so are the backward's two gradient sums
fsdp_tensor* fsdp_sync_batch_norm(fsdp_tensor* x, fsdp_tensor* running_mean, fsdp_tensor* running_var, fsdp_tensor* w,
                                  fsdp_tensor* b, int training, double momentum, double eps);
// x (N, C, ...) normalized over each of num_groups groups of channels; w, b (C) may be NULL
fsdp_tensor* fsdp_group_norm(fsdp_tensor* x, int64_t num_groups, fsdp_tensor* w, fsdp_tensor* b, double eps);
// x / sqrt(mean(x^2) + eps) * w over the last normalized_ndim dims; w may be NULL
fsdp_tensor* fsdp_rms_norm(fsdp_tensor* x, int normalized_ndim, fsdp_tensor* w, double eps);

// ---- optimizer updates (in place on param and state, no autograd) ------------------------------
// PyTorch's torch.optim.SGD: first_step tells whether the momentum buffer is uninitialized
int fsdp_sgd_step(fsdp_tensor* param, fsdp_tensor* grad, fsdp_tensor* momentum_buf, double lr, double momentum,
                  double dampening, double weight_decay, int nesterov, int first_step, int maximize);
// PyTorch's Adam (decoupled == 0) and AdamW (decoupled == 1); step is the 1-based step count
int fsdp_adam_step(fsdp_tensor* param, fsdp_tensor* grad, fsdp_tensor* exp_avg, fsdp_tensor* exp_avg_sq,
                   fsdp_tensor* max_exp_avg_sq, int64_t step, double lr, double beta1, double beta2, double eps,
                   double weight_decay, int decoupled, int amsgrad, int maximize);

// ---- autograd engine ------------------------------------------------------------------------------
int fsdp_is_grad_enabled(void);
void fsdp_set_grad_enabled(int enabled);
// grad may be NULL for a one-element tensor (implicit 1)
int fsdp_backward(fsdp_tensor* t, fsdp_tensor* grad, int retain_graph);
int fsdp_is_backward_running(void);
// hook on a tensor's gradient (leaf: before accumulation; non-leaf: before its node runs)
int64_t fsdp_tensor_register_hook(fsdp_tensor* t, fsdp_grad_hook_fn fn, void* ctx);
int fsdp_remove_hook(int64_t handle);
// ids of hooks freed with their tensor (never removed) since the last call, so a binding can drop
// what it keeps per hook: copies up to cap of them into ids, returns how many it copied.
// *fsdp_hooks_freed_pending() is how many are queued (a cheap test before calling).
int fsdp_hooks_take_freed(int64_t* ids, int cap);
const int* fsdp_hooks_freed_pending(void);
// listeners for engine events, event_mask is an OR of fsdp_event
int64_t fsdp_autograd_add_listener(int event_mask, fsdp_listener_fn fn, void* ctx);
int fsdp_autograd_remove_listener(int64_t handle);
// only during backward: fn runs after the last node, before BACKWARD_END
int fsdp_queue_callback(fsdp_callback_fn fn, void* ctx);

// ---- activation checkpointing ----------------------------------------------------------------------
// Between begin and end (grad mode on) the graph nodes made keep no saved tensors, only their
// places in the region; the first backward node that needs one reruns the region's forward
// through fn(ctx) -- grad mode on, the RNG as it was at begin, so dropout draws the same -- and
// the nodes take what that rerun saves, in order. begin returns 1 when a region began (end it with
// fsdp_checkpoint_end), 0 when there is nothing to do (grad mode off, or inside a region already:
// its saves are the outer region's), -1 on error. fn returns 0, or -1 with the error set.
typedef int (*fsdp_recompute_fn)(void* ctx);
int fsdp_checkpoint_begin(fsdp_recompute_fn fn, void* ctx);
void fsdp_checkpoint_end(void);
// 1 while a region's forward reruns for backward (an FSDP unit then only gathers its parameters)
int fsdp_checkpoint_rerunning(void);
// the ctx of regions freed since the last call (a binding drops what it keeps for them): copies up
// to cap into ctxs, returns how many; *fsdp_checkpoint_freed_pending() is how many are queued
int fsdp_checkpoint_take_freed(void** ctxs, int cap);
const int* fsdp_checkpoint_freed_pending(void);

// ---- safetensors ------------------------------------------------------------------------------------
// writes atomically (temporary file, then rename); metadata_json may be NULL
int fsdp_st_save(const char* path, int n, const char** names, fsdp_tensor** tensors, const char* metadata_json);
fsdp_st_file* fsdp_st_open(const char* path);
int fsdp_st_count(const fsdp_st_file* f);
const char* fsdp_st_name(const fsdp_st_file* f, int i);
fsdp_tensor* fsdp_st_get(fsdp_st_file* f, int i);
// tensor i file-backed (fsdp.h, "deferred values"): read when used, a range when copied from; the
// file stays open while such tensors live
fsdp_tensor* fsdp_st_get_lazy(fsdp_st_file* f, int i);
const char* fsdp_st_metadata(const fsdp_st_file* f);  // raw JSON of __metadata__ or ""
void fsdp_st_close(fsdp_st_file* f);

// ---- communication (parallel/comm.c; the mpi backend lives in libfsdp_mpi.so, loaded on demand) ----------
// Collectives are asynchronous: they are queued to the communication thread, which runs them
// in issue order while the caller computes. Every rank must issue the same collectives in the
// same order; before moving data the ranks compare (op, tag, bytes), so a mismatch is an error
// naming the tag and the ranks on every rank, and a rank that never arrives is a timeout error.
typedef struct fsdp_work fsdp_work;
typedef enum { FSDP_REDUCE_SUM = 0, FSDP_REDUCE_AVG = 1, FSDP_REDUCE_MAX = 2 } fsdp_reduce_op;
typedef enum {
  FSDP_COLL_ALL_GATHER = 0,
  FSDP_COLL_REDUCE_SCATTER = 1,
  FSDP_COLL_ALL_REDUCE = 2,
  FSDP_COLL_BROADCAST = 3,
  FSDP_COLL_BARRIER = 4,
  FSDP_NCOLL = 5
} fsdp_coll_kind;

// backend: "self", "mpi", or NULL / "" for automatic (mpi when started by mpirun / fsdprun)
int fsdp_comm_init(const char* backend);
int fsdp_comm_is_initialized(void);
int fsdp_comm_rank(void);
int fsdp_comm_world_size(void);
// this rank among the ranks on its node (shared memory), and their number (1 under "self")
int fsdp_comm_local_rank(void);
int fsdp_comm_local_world_size(void);
const char* fsdp_comm_backend_name(void);
// how device tensors move: "nccl", "standin" (the test double of NCCL), or "host" (staged through
// host memory on the backend above); "" before the first collective on a device tensor
const char* fsdp_comm_device_plane(void);
// tests and diagnostics: the ranks bootstrap the plane "nccl" (or "standin") alone, without a
// device: digest (17 bytes) gets the hex digest of the ids rank 0 made, the same on every rank
int fsdp_comm_plane_bootstrap(const char* plane, char* digest);
int fsdp_comm_finalize(void);
// out (N * in.numel, same dtype) = concatenation of every rank's `in`
fsdp_work* fsdp_all_gather(fsdp_tensor* out, fsdp_tensor* in, const char* tag);
// f32: out (in.numel / N) = this rank's chunk of the sum (or average) of every rank's `in`
fsdp_work* fsdp_reduce_scatter(fsdp_tensor* out, fsdp_tensor* in, int op, const char* tag);
fsdp_work* fsdp_all_reduce(fsdp_tensor* t, int op, const char* tag);   // f32, in place
fsdp_work* fsdp_broadcast(fsdp_tensor* t, int root, const char* tag);  // any dtype, in place
fsdp_work* fsdp_barrier_async(const char* tag);
// Groups for hybrid sharding: shard groups of `size` consecutive ranks (size divides the world) and
// replica groups, one rank of each shard group at the same place in it. Collective (every rank calls
// it with the same size, once: a later call with another size is an error). The _group collectives
// move data among the ranks of `group`: all_gather within it (out: its size x in), reduce_scatter
// with FSDP_GROUP_HYBRID reduce-scatters within the shard group and then all-reduces the result
// over the replica group (so the average is over the world). The checks stay world-wide.
typedef enum {
  FSDP_GROUP_WORLD = 0,
  FSDP_GROUP_SHARD = 1,
  FSDP_GROUP_REPLICA = 2,
  FSDP_GROUP_HYBRID = 3
} fsdp_comm_group;
int fsdp_comm_set_groups(int size);
int fsdp_comm_group_size(int group);  // ranks in this rank's group (the world's size for WORLD)
int fsdp_comm_group_rank(int group);  // this rank's place in it
fsdp_work* fsdp_all_gather_group(fsdp_tensor* out, fsdp_tensor* in, int group, const char* tag);
fsdp_work* fsdp_reduce_scatter_group(fsdp_tensor* out, fsdp_tensor* in, int op, int group, const char* tag);
int fsdp_work_wait(fsdp_work* w);   // 0, or -1 with the collective's error
int fsdp_work_test(fsdp_work* w);   // 1 when finished (successfully or not), else 0
void fsdp_work_free(fsdp_work* w);  // waits first if still running
int fsdp_barrier(void);
// collectives issued and payload bytes per fsdp_coll_kind since init (arrays of FSDP_NCOLL)
void fsdp_comm_stats(int64_t* counts, int64_t* bytes);
void fsdp_comm_reset_stats(void);
// seconds a rank waits for the others to reach the same collective before it errors (default 300)
void fsdp_comm_set_timeout(double seconds);
// reduce-scatter algorithm: 0 = ring of MPI_Sendrecv + vectorized sum (default), 1 = MPI_Reduce_scatter_block
void fsdp_comm_set_reduce_scatter_algo(int algo);

// ---- FSDP units (parallel/shard.c: layout, buffers; parallel/sched.c: lifecycle, engine events) ----
// A unit owns the parameters of one wrapped module that no nested unit owns. Each parameter is
// split into world_size equal chunks of its flattened elements (the last ones padded); rank r
// keeps chunk r. Between steps a parameter tensor IS its local piece (1-D, possibly empty; the
// original shape when the piece is the whole tensor) and its .grad is the matching piece of the
// averaged gradient, so optimizers update only what this rank owns. While gathered it is a view
// of the full buffer with its original shape. Trainable and frozen parameters live in separate
// flat buffers, so frozen ones cost no gradient memory and no reduce-scatter traffic.
typedef struct fsdp_unit fsdp_unit;
// HYBRID_SHARD: sharded within shard groups of group_size ranks, replicated across them (gradients
// reduce-scattered within the group, then all-reduced over the replicas: fsdp_comm_set_groups)
typedef enum { FSDP_FULL_SHARD = 0, FSDP_SHARD_GRAD_OP = 1, FSDP_NO_SHARD = 2, FSDP_HYBRID_SHARD = 3 } fsdp_sharding;
typedef enum {
  FSDP_UNIT_IDLE = 0,
  FSDP_UNIT_FORWARD = 1,
  FSDP_UNIT_FORWARD_DONE = 2,
  FSDP_UNIT_BACKWARD = 3,
  FSDP_UNIT_BACKWARD_DONE = 4
} fsdp_unit_phase;
typedef struct fsdp_unit_options {
  int sharding;               // fsdp_sharding
  int reshard_after_forward;  // -1: by strategy (full shard: yes, except the root), 0: no, 1: yes
  int param_dtype;            // dtype parameters are gathered in (F32, BF16, F16); compute stays f32
  int reduce_dtype;           // dtype gradients are reduced in (F32)
  int forward_prefetch;       // gather the next unit during this unit's forward
  int backward_prefetch;      // gather the next unit during this unit's backward (default on)
  int sync_module_states;     // broadcast rank 0's values when parameters are first sharded
  int offload;                // CPU offload: shards, gradient pieces and so the optimizer step on
                              // the CPU; the unit gathers onto its parameters' device to compute
  int group_size;             // HYBRID_SHARD: ranks per shard group (divides the world size)
} fsdp_unit_options;

fsdp_unit* fsdp_unit_new(const char* path, const fsdp_unit_options* opts);
// (re)assigns the unit's parameters (collective): parameters owned by another unit are taken
// from it; standalone ones are broadcast from rank 0 (if sync_module_states) and sharded
int fsdp_unit_set_params(fsdp_unit* u, int n, fsdp_tensor** params, const char** names);
const char* fsdp_unit_path(const fsdp_unit* u);
int fsdp_unit_set_path(fsdp_unit* u, const char* path);  // the name used in errors and collective tags
int fsdp_unit_state(const fsdp_unit* u);
const char* fsdp_unit_state_name(int state);
int fsdp_unit_num_params(const fsdp_unit* u);
fsdp_tensor* fsdp_unit_param(fsdp_unit* u, int i);  // borrowed
// forward protocol (called by the Lua wrapper around the module's forward)
int fsdp_unit_pre_forward(fsdp_unit* u);
fsdp_tensor* fsdp_unit_mark_output(fsdp_unit* u, fsdp_tensor* t);  // new ref: identity that gathers in backward
int fsdp_unit_post_forward(fsdp_unit* u);
int fsdp_unit_abort_forward(fsdp_unit* u);  // the module's forward raised an error
// an activation-checkpointed region around the unit runs its forward again, in backward: gathers
int fsdp_unit_rerun(fsdp_unit* u);
// summon_full_params: gather (parameters take their full shapes) and reshard (writeback copies the
// full values into the local pieces first)
int fsdp_unit_unshard(fsdp_unit* u);
int fsdp_unit_reshard(fsdp_unit* u, int writeback);
// no_sync: while set, backward accumulates full gradients locally and reduces nothing
int fsdp_unit_set_sync_grads(fsdp_unit* u, int sync);
// layout of parameter i for checkpoints: global numel, chunk size, and this rank's piece
int fsdp_unit_param_layout(const fsdp_unit* u, int i, int64_t* numel, int64_t* chunk, int64_t* start, int64_t* length);
// full (original) shape of a parameter owned by a unit, whatever form it is in (any other tensor:
// its own shape); returns ndim. _ndim and _numel likewise
int fsdp_param_full_shape(const fsdp_tensor* p, int64_t* shape);
int fsdp_param_full_ndim(const fsdp_tensor* p);
int64_t fsdp_param_full_numel(const fsdp_tensor* p);
// 1 when p is a parameter in its piece form (sharded: this rank holds elements [start, start +
// length) of its flattened full values), else 0
int fsdp_param_piece(const fsdp_tensor* p, int64_t* start, int64_t* length);
// 1 when p is a parameter of a unit, in either form, with this rank's piece of it (elements
// [start, start + length) of its flattened full values: what its gradient and optimizer state hold), else 0
int fsdp_param_shard(const fsdp_tensor* p, int64_t* start, int64_t* length);
// 1 when p's .grad is still this rank's local, unreduced gradient (the last backward that gave it
// one ran inside no_sync) and other ranks' gradients have yet to join it, else 0
int fsdp_param_grad_unreduced(const fsdp_tensor* p);
// the name a unit knows parameter p by ("0.weight") and the unit's path; "" for other tensors
const char* fsdp_param_name(const fsdp_tensor* p);
const char* fsdp_param_unit_path(const fsdp_tensor* p);
fsdp_unit* fsdp_param_unit(const fsdp_tensor* p);  // NULL for standalone tensors
// 1 when every unit is idle and holds no gathered buffer beyond its policy
int fsdp_units_all_idle(void);
// between passes (no forward running, no backward): units left waiting for a backward that never
// came -- a forward under grad whose output was dropped, or kept and not backpropagated -- go back
// to IDLE, resharded, as the next forward would do. summon_full_params, state_dict and the sharded
// checkpoints call it; a kept output can still be backpropagated later (its units gather again).
int fsdp_units_settle(void);
int fsdp_unit_world_size(const fsdp_unit* u);  // 1 for NO_SHARD
// what the last forward pass showed of u (fsdp.summary): 1 when u ran in it, then whether it was
// that pass's root and whether its outputs will take it into backward; 0 before its first forward
int fsdp_unit_last_pass(const fsdp_unit* u, int* is_root, int* in_backward);

// ---- build information ------------------------------------------------------------------------------
const char* fsdp_version(void);
// FFI-END

#ifdef __cplusplus
}
#endif
#endif
