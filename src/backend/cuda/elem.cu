/*
 * backend/cuda/elem.cu -- the elementwise, copy, reduction and indexing kernels of the CUDA
 * backend (core/kernels_elem.h says what each computes; backend/cpu/elem.c is the reference).
 * Every kernel is a grid-stride loop on the compute stream; shapes and strides travel by value
 * in a small struct. Reductions add in double, one block per output, so a sum's rounding does
 * not depend on how long the reduced dim is.
 */
#include "backend/cuda/cuda_util.h"

#include "core/elem_math.h"

#define MAXD 8  // FSDP_MAX_DIMS

typedef struct {
  int ndim;
  int64_t shape[MAXD], sa[MAXD], sb[MAXD];
} geom;

static geom make_geom(int ndim, const int64_t* shape, const int64_t* sa, const int64_t* sb) {
  geom g;
  g.ndim = ndim;
  for (int d = 0; d < ndim; d++) {
    g.shape[d] = shape[d];
    g.sa[d] = sa ? sa[d] : 0;
    g.sb[d] = sb ? sb[d] : 0;
  }
  return g;
}

// ---- dtypes: the CPU's conversions, bit for bit (core/elem_math.h) ---------------------------------
__device__ static inline double load_elem(const char* p, int dt) {
  switch (dt) {
    case 0: return *(const float*)p;                       // FSDP_F32
    case 1: return (double)*(const int64_t*)p;             // FSDP_I64
    case 2: return fsdp_bf16_to_f32(*(const uint16_t*)p);  // FSDP_BF16
    default: return fsdp_f16_to_f32(*(const uint16_t*)p);  // FSDP_F16
  }
}
__device__ static inline void store_elem(char* p, int dt, double v) {
  switch (dt) {
    case 0: *(float*)p = (float)v; break;
    case 1: *(int64_t*)p = (int64_t)v; break;
    case 2: *(uint16_t*)p = fsdp_f32_to_bf16((float)v); break;
    default: *(uint16_t*)p = fsdp_f32_to_f16((float)v); break;
  }
}
static int dtype_size(int dt) { return dt == 0 ? 4 : dt == 1 ? 8 : 2; }

// the offset (in elements) of element i, in row-major order over g's shape, with strides st
__device__ static inline int64_t strided_offset(int64_t i, const geom& g, const int64_t* st) {
  int64_t off = 0;
  for (int d = g.ndim - 1; d >= 0; d--) {
    off += (i % g.shape[d]) * st[d];
    i /= g.shape[d];
  }
  return off;
}
// one element of es bytes (8, 4 or 2) from s to o
__device__ static inline void copy_elem(char* o, const char* s, int es) {
  if (es == 8) *(int64_t*)o = *(const int64_t*)s;
  else if (es == 4) *(float*)o = *(const float*)s;
  else *(uint16_t*)o = *(const uint16_t*)s;
}

// ---- copies and fills -------------------------------------------------------------------------------
// dst (contiguous) <- src (strided over shape); the same dtype copies the bytes (int64 exactly)
__global__ static void copy_strided_k(char* dst, int ddt, int des, const char* src, int sdt, int ses, geom g,
                                      int64_t n) {
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x) {
    const char* s = src + strided_offset(i, g, g.sa) * ses;
    char* o = dst + i * des;
    if (ddt == sdt) copy_elem(o, s, des);
    else store_elem(o, ddt, load_elem(s, sdt));
  }
}
static void cuda_copy_strided(void* dst, int ddt, const void* src, int sdt, int ndim, const int64_t* shape,
                              const int64_t* sstride) {
  int64_t n = 1;
  for (int d = 0; d < ndim; d++) n *= shape[d];
  if (n == 0) return;
  copy_strided_k<<<fsdp_cuda_blocks(n), 256, 0, fsdp_cuda_stream>>>((char*)dst, ddt, dtype_size(ddt), (const char*)src,
                                                                    sdt, dtype_size(sdt),
                                                                    make_geom(ndim, shape, sstride, NULL), n);
  FSDP_CUDA_LAUNCHED("copy");
}

// dst (strided) <- src (contiguous), same dtype
__global__ static void scatter_strided_k(char* dst, int es, geom g, const char* src, int64_t n) {
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x) {
    copy_elem(dst + strided_offset(i, g, g.sa) * es, src + i * es, es);
  }
}
static void cuda_scatter_strided(void* dst, size_t es, int ndim, const int64_t* shape, const int64_t* dst_stride,
                                 const void* src) {
  int64_t n = 1;
  for (int d = 0; d < ndim; d++) n *= shape[d];
  if (n == 0) return;
  scatter_strided_k<<<fsdp_cuda_blocks(n), 256, 0, fsdp_cuda_stream>>>(
      (char*)dst, (int)es, make_geom(ndim, shape, dst_stride, NULL), (const char*)src, n);
  FSDP_CUDA_LAUNCHED("copy");
}

__global__ static void fill_k(char* dst, int dt, int es, int64_t n, double v) {
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x)
    store_elem(dst + i * es, dt, v);
}
static void cuda_fill(void* dst, int dt, int64_t n, double v) {
  if (n == 0) return;
  fill_k<<<fsdp_cuda_blocks(n), 256, 0, fsdp_cuda_stream>>>((char*)dst, dt, dtype_size(dt), n, v);
  FSDP_CUDA_LAUNCHED("fill");
}

__global__ static void axpy_k(float* y, int64_t ldy, const float* x, int64_t ldx, int64_t rows, int64_t n,
                              float alpha) {
  int64_t total = rows * n;
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < total; i += (int64_t)gridDim.x * blockDim.x) {
    int64_t r = i / n, j = i % n;
    y[r * ldy + j] += alpha * x[r * ldx + j];
  }
}
static void cuda_axpy(float* y, int64_t ldy, const float* x, int64_t ldx, int64_t rows, int64_t n, float alpha) {
  if (rows * n == 0) return;
  axpy_k<<<fsdp_cuda_blocks(rows * n), 256, 0, fsdp_cuda_stream>>>(y, ldy, x, ldx, rows, n, alpha);
  FSDP_CUDA_LAUNCHED("axpy");
}

__global__ static void scale_k(float* y, int64_t n, float s) {
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x)
    y[i] *= s;
}
static void cuda_scale(float* y, int64_t n, float s) {
  if (n == 0) return;
  scale_k<<<fsdp_cuda_blocks(n), 256, 0, fsdp_cuda_stream>>>(y, n, s);
  FSDP_CUDA_LAUNCHED("scale");
}

// ---- binary with broadcasting ---------------------------------------------------------------------
__global__ static void binary_k(int op, float* out, const float* a, const float* b, geom g, int64_t n) {
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x) {
    float x = a[strided_offset(i, g, g.sa)], y = b[strided_offset(i, g, g.sb)], r;
    switch (op) {
      case FSDP_BIN_ADD: r = x + y; break;
      case FSDP_BIN_SUB: r = x - y; break;
      case FSDP_BIN_MUL: r = x * y; break;
      case FSDP_BIN_DIV: r = x / y; break;
      default: r = x == y ? 1.0f : 0.0f; break;  // FSDP_BIN_EQ
    }
    out[i] = r;
  }
}
static void cuda_binary(int op, float* out, const float* a, const float* b, int ndim, const int64_t* shape,
                        const int64_t* stride_a, const int64_t* stride_b) {
  int64_t n = 1;
  for (int d = 0; d < ndim; d++) n *= shape[d];
  if (n == 0) return;
  binary_k<<<fsdp_cuda_blocks(n), 256, 0, fsdp_cuda_stream>>>(op, out, a, b, make_geom(ndim, shape, stride_a, stride_b),
                                                              n);
  FSDP_CUDA_LAUNCHED("binary");
}

// ---- unary ------------------------------------------------------------------------------------------
#define GELU_K0 0.7071067811865476f    // 1/sqrt(2)
#define GELU_K1 0.3989422804014327f    // 1/sqrt(2*pi)
#define GELU_BETA 0.7978845608028654f  // sqrt(2/pi)
#define GELU_KAPPA 0.044715f

__device__ static inline float unary_f(int op, float v, float p) {
  switch (op) {
    case FSDP_UN_NEG: return -v;
    case FSDP_UN_EXP: return expf(v);
    case FSDP_UN_LOG: return logf(v);
    case FSDP_UN_SQRT: return sqrtf(v);
    case FSDP_UN_ABS: return fabsf(v);
    case FSDP_UN_TANH: return tanhf(v);
    case FSDP_UN_SIGMOID: return 1.0f / (1.0f + expf(-v));
    case FSDP_UN_RELU: return v > 0.0f ? v : (v != v ? v : 0.0f);
    case FSDP_UN_GELU: return 0.5f * v * (1.0f + erff(v * GELU_K0));
    case FSDP_UN_GELU_TANH: return 0.5f * v * (1.0f + tanhf(GELU_BETA * (v + GELU_KAPPA * v * v * v)));
    case FSDP_UN_POW:
      if (p == 2.0f) return v * v;
      if (p == 1.0f) return v;
      if (p == 0.5f) return sqrtf(v);
      if (p == -1.0f) return 1.0f / v;
      if (p == 3.0f) return v * v * v;
      return powf(v, p);
    case FSDP_UN_ADD_SCALAR: return v + p;
    case FSDP_UN_MUL_SCALAR: return v * p;
    default: return p / v;  // FSDP_UN_RDIV_SCALAR
  }
}
__global__ static void unary_k(int op, float* out, const float* x, int64_t n, float p) {
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x)
    out[i] = unary_f(op, x[i], p);
}
static void cuda_unary(int op, float* out, const float* x, int64_t n, double p) {
  if (n == 0) return;
  unary_k<<<fsdp_cuda_blocks(n), 256, 0, fsdp_cuda_stream>>>(op, out, x, n, (float)p);
  FSDP_CUDA_LAUNCHED("unary");
}

// gx = gy * f'(x); x or y (the forward output) is NULL when the op layer did not save it
__device__ static inline float unary_grad(int op, float g, const float* x, const float* y, int64_t i, float p) {
  switch (op) {
    case FSDP_UN_NEG: return -g;
    case FSDP_UN_EXP: return g * y[i];
    case FSDP_UN_LOG: return g / x[i];
    case FSDP_UN_SQRT: return g / (2.0f * y[i]);
    case FSDP_UN_ABS: return x[i] > 0.0f ? g : (x[i] < 0.0f ? -g : 0.0f);
    case FSDP_UN_TANH: return g * (1.0f - y[i] * y[i]);
    case FSDP_UN_SIGMOID: return g * y[i] * (1.0f - y[i]);
    case FSDP_UN_RELU: return y[i] > 0.0f ? g : 0.0f;
    case FSDP_UN_GELU: {  // Phi(x) + x phi(x)
      float v = x[i], z = v * GELU_K0;
      return g * (0.5f * (1.0f + erff(z)) + v * GELU_K1 * expf(-z * z));
    }
    case FSDP_UN_GELU_TANH: {
      float v = x[i], t = tanhf(GELU_BETA * (v + GELU_KAPPA * v * v * v));
      return g * (0.5f * (1.0f + t) + 0.5f * v * (1.0f - t * t) * GELU_BETA * (1.0f + 3.0f * GELU_KAPPA * v * v));
    }
    case FSDP_UN_POW:
      if (p == 0.0f) return 0.0f * g;
      if (p == 1.0f) return g;
      if (p == 2.0f) return 2.0f * g * x[i];
      return g * p * powf(x[i], p - 1.0f);
    case FSDP_UN_ADD_SCALAR: return g;
    case FSDP_UN_MUL_SCALAR: return g * p;
    default: return -g * p / (x[i] * x[i]);  // FSDP_UN_RDIV_SCALAR
  }
}
__global__ static void unary_backward_k(int op, float* gx, const float* gy, const float* x, const float* y, int64_t n,
                                        float p) {
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x)
    gx[i] = unary_grad(op, gy[i], x, y, i, p);
}
static void cuda_unary_backward(int op, float* gx, const float* gy, const float* x, const float* y, int64_t n,
                                double p) {
  if (n == 0) return;
  unary_backward_k<<<fsdp_cuda_blocks(n), 256, 0, fsdp_cuda_stream>>>(op, gx, gy, x, y, n, (float)p);
  FSDP_CUDA_LAUNCHED("unary_backward");
}

// ---- reductions over the middle dim of (outer, red, inner): one block per output ---------------------
__global__ static void sum_dim_k(float* out, const float* in, int64_t outer, int64_t red, int64_t inner) {
  __shared__ double part[256];
  for (int64_t w = blockIdx.x; w < outer * inner; w += gridDim.x) {
    int64_t o = w / inner, j = w % inner;
    const float* p = in + o * red * inner + j;
    double s = 0.0;
    for (int64_t r = threadIdx.x; r < red; r += blockDim.x) s += p[r * inner];
    part[threadIdx.x] = s;
    __syncthreads();
    for (int h = blockDim.x / 2; h > 0; h /= 2) {
      if (threadIdx.x < h) part[threadIdx.x] += part[threadIdx.x + h];
      __syncthreads();
    }
    if (threadIdx.x == 0) out[w] = (float)part[0];
    __syncthreads();
  }
}
static unsigned out_blocks(int64_t n) { return (unsigned)(n < 65535 * 8 ? (n > 0 ? n : 1) : 65535 * 8); }
static void cuda_sum_dim(float* out, const float* in, int64_t outer, int64_t red, int64_t inner) {
  if (outer * inner == 0) return;
  sum_dim_k<<<out_blocks(outer * inner), 256, 0, fsdp_cuda_stream>>>(out, in, outer, red, inner);
  FSDP_CUDA_LAUNCHED("sum");
}

// the first maximum; NaN wins (as in PyTorch): (value, index) pairs combined in shared memory
__device__ static inline int max_takes(float v, int64_t i, float m, int64_t mi) {
  int vn = v != v, mn = m != m;
  if (vn != mn) return vn;          // a NaN beats a number
  if (!vn && v != m) return v > m;  // the larger number
  return i < mi;                    // ties (and two NaNs): the first
}
__global__ static void max_dim_k(float* out, int64_t* idx, const float* in, int64_t outer, int64_t red, int64_t inner) {
  __shared__ float pv[256];
  __shared__ int64_t pi[256];
  for (int64_t w = blockIdx.x; w < outer * inner; w += gridDim.x) {
    int64_t o = w / inner, j = w % inner;
    const float* p = in + o * red * inner + j;
    float m = 0.0f;
    int64_t mi = INT64_MAX;
    for (int64_t r = threadIdx.x; r < red; r += blockDim.x)
      if (mi == INT64_MAX || max_takes(p[r * inner], r, m, mi)) m = p[r * inner], mi = r;
    pv[threadIdx.x] = m;
    pi[threadIdx.x] = mi;
    __syncthreads();
    for (int h = blockDim.x / 2; h > 0; h /= 2) {
      if (threadIdx.x < h && pi[threadIdx.x + h] != INT64_MAX &&
          (pi[threadIdx.x] == INT64_MAX ||
           max_takes(pv[threadIdx.x + h], pi[threadIdx.x + h], pv[threadIdx.x], pi[threadIdx.x]))) {
        pv[threadIdx.x] = pv[threadIdx.x + h];
        pi[threadIdx.x] = pi[threadIdx.x + h];
      }
      __syncthreads();
    }
    if (threadIdx.x == 0) {
      out[w] = pv[0];
      idx[w] = pi[0];
    }
    __syncthreads();
  }
}
static void cuda_max_dim(float* out, int64_t* idx, const float* in, int64_t outer, int64_t red, int64_t inner) {
  if (outer * inner == 0) return;
  max_dim_k<<<out_blocks(outer * inner), 256, 0, fsdp_cuda_stream>>>(out, idx, in, outer, red, inner);
  FSDP_CUDA_LAUNCHED("max");
}

__global__ static void scatter_dim_k(float* gx, const float* gy, const int64_t* idx, int64_t outer, int64_t red,
                                     int64_t inner) {
  int64_t n = outer * inner;
  for (int64_t w = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; w < n; w += (int64_t)gridDim.x * blockDim.x) {
    int64_t o = w / inner, j = w % inner;
    gx[(o * red + idx[w]) * inner + j] = gy[w];
  }
}
static void cuda_scatter_dim(float* gx, const float* gy, const int64_t* idx, int64_t outer, int64_t red,
                             int64_t inner) {
  int64_t n = outer * red * inner;
  if (n == 0) return;
  cudaMemsetAsync(gx, 0, n * sizeof(float), fsdp_cuda_stream);
  scatter_dim_k<<<fsdp_cuda_blocks(outer * inner), 256, 0, fsdp_cuda_stream>>>(gx, gy, idx, outer, red, inner);
  FSDP_CUDA_LAUNCHED("max backward");
}

// ---- indexing -----------------------------------------------------------------------------------------
// An async device's checks are deferred (the op layer always passes a check id here): an index
// outside [lo, hi) claims the device's error slot with its value, reported at the next wait; the
// host never waits for the check itself
__global__ static void index_check_k(const int64_t* idx, int64_t n, int64_t lo, int64_t hi, int check,
                                     fsdp_cuda_check_slot* slot) {
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x)
    if (idx[i] < lo || idx[i] >= hi) fsdp_cuda_check_fail(slot, check, idx[i]);
}
static int64_t cuda_index_check(const int64_t* idx, int64_t n, int64_t lo, int64_t hi, int check) {
  if (n > 0) {
    index_check_k<<<fsdp_cuda_blocks(n), 256, 0, fsdp_cuda_stream>>>(idx, n, lo, hi, check, fsdp_cuda_slot);
    FSDP_CUDA_LAUNCHED("index check");
  }
  return -1;
}

// (an index out of range -- its deferred check failed -- reads and adds nothing)
__global__ static void index_select_k(char* out, const char* in, int es, const int64_t* idx, int64_t outer,
                                      int64_t n_in, int64_t n_idx, int64_t inner) {
  int64_t n = outer * n_idx * inner;
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x) {
    int64_t k = i % inner, rest = i / inner, j = rest % n_idx, o = rest / n_idx;
    char* d = out + i * es;
    if (idx[j] < 0 || idx[j] >= n_in) {
      for (int b = 0; b < es; b++) d[b] = 0;
      continue;
    }
    copy_elem(d, in + ((o * n_in + idx[j]) * inner + k) * es, es);
  }
}
static void cuda_index_select(void* out, const void* in, size_t es, const int64_t* idx, int64_t outer, int64_t n_in,
                              int64_t n_idx, int64_t inner) {
  int64_t n = outer * n_idx * inner;
  if (n == 0) return;
  index_select_k<<<fsdp_cuda_blocks(n), 256, 0, fsdp_cuda_stream>>>((char*)out, (const char*)in, (int)es, idx, outer,
                                                                    n_in, n_idx, inner);
  FSDP_CUDA_LAUNCHED("index_select");
}

// repeated indices add up: atomics
__global__ static void index_add_k(float* gx, const float* gy, const int64_t* idx, int64_t outer, int64_t n_in,
                                   int64_t n_idx, int64_t inner) {
  int64_t n = outer * n_idx * inner;
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x) {
    int64_t k = i % inner, rest = i / inner, j = rest % n_idx, o = rest / n_idx;
    if (idx[j] >= 0 && idx[j] < n_in) atomicAdd(gx + (o * n_in + idx[j]) * inner + k, gy[i]);
  }
}
static void cuda_index_add(float* gx, const float* gy, const int64_t* idx, int64_t outer, int64_t n_in, int64_t n_idx,
                           int64_t inner) {
  int64_t n = outer * n_idx * inner;
  if (n == 0) return;
  index_add_k<<<fsdp_cuda_blocks(n), 256, 0, fsdp_cuda_stream>>>(gx, gy, idx, outer, n_in, n_idx, inner);
  FSDP_CUDA_LAUNCHED("index_add");
}

// ---- sorting, gather, scatter_add along a dim -------------------------------------------------------------
// the CPU's order (NaN after every number; stable): each element's place in its row is the number
// of elements that go before it, counted by one thread per element (rows are short: vocabularies)
__device__ static inline int sort_before_k(float a, float b, int descending) {
  if (descending) return (a > b) || (a != a && b == b);
  return (a < b) || (b != b && a == a);
}
__global__ static void argsort_k(int64_t* idx, const float* x, int64_t rows, int64_t n, int descending) {
  int64_t total = rows * n;
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < total; i += (int64_t)gridDim.x * blockDim.x) {
    int64_t r = i / n, c = i % n, place = 0;
    const float* row = x + r * n;
    float v = row[c];
    for (int64_t j = 0; j < n; j++) {
      float w = row[j];
      if (sort_before_k(w, v, descending) || (j < c && !sort_before_k(v, w, descending))) place++;
    }
    idx[r * n + place] = c;
  }
}
static void cuda_argsort_rows(int64_t* idx, int64_t* tmp, const float* x, int64_t rows, int64_t n, int descending) {
  (void)tmp;
  if (rows * n == 0) return;
  argsort_k<<<fsdp_cuda_blocks(rows * n), 256, 0, fsdp_cuda_stream>>>(idx, x, rows, n, descending);
  FSDP_CUDA_LAUNCHED("argsort_rows");
}

__device__ static inline void gather_offsets_k(const fsdp_gather_geom& g, int64_t i, const int64_t* idx, int64_t* self,
                                               int64_t* other) {
  int64_t rest = i, s = 0, o = 0;
  for (int d = g.ndim - 1; d >= 0; d--) {
    int64_t c = rest % g.shape[d];
    rest /= g.shape[d];
    s += (d == g.dim ? idx[i] : c) * g.stride[d];
    o += c * g.other_stride[d];
  }
  *self = s;
  *other = o;
}
static int64_t geom_numel(const fsdp_gather_geom* g) {
  int64_t n = 1;
  for (int d = 0; d < g->ndim; d++) n *= g->shape[d];
  return n;
}
__global__ static void gather_k(fsdp_gather_geom g, float* out, const float* in, const int64_t* idx, int64_t n) {
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x) {
    int64_t s, o;
    gather_offsets_k(g, i, idx, &s, &o);
    out[o] = idx[i] >= 0 && idx[i] < g.dim_size ? in[s] : 0.0f;
  }
}
static void cuda_gather_dim(const fsdp_gather_geom* g, float* out, const float* in, const int64_t* idx) {
  int64_t n = geom_numel(g);
  if (n == 0) return;
  gather_k<<<fsdp_cuda_blocks(n), 256, 0, fsdp_cuda_stream>>>(*g, out, in, idx, n);
  FSDP_CUDA_LAUNCHED("gather_dim");
}
// repeated indices add up: atomics
__global__ static void scatter_add_k(fsdp_gather_geom g, float* dst, const float* src, const int64_t* idx, int64_t n) {
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x) {
    int64_t s, o;
    gather_offsets_k(g, i, idx, &s, &o);
    if (idx[i] >= 0 && idx[i] < g.dim_size) atomicAdd(dst + s, src[o]);
  }
}
static void cuda_scatter_add_dim(const fsdp_gather_geom* g, float* dst, const float* src, const int64_t* idx) {
  int64_t n = geom_numel(g);
  if (n == 0) return;
  scatter_add_k<<<fsdp_cuda_blocks(n), 256, 0, fsdp_cuda_stream>>>(*g, dst, src, idx, n);
  FSDP_CUDA_LAUNCHED("scatter_add_dim");
}

const fsdp_elem_kernels fsdp_cuda_elem_kernels = {
    cuda_copy_strided, cuda_scatter_strided, cuda_fill,           cuda_axpy,      cuda_scale,
    cuda_binary,       cuda_unary,           cuda_unary_backward, cuda_sum_dim,   cuda_max_dim,
    cuda_scatter_dim,  cuda_index_check,     cuda_index_select,   cuda_index_add, cuda_argsort_rows,
    cuda_gather_dim,   cuda_scatter_add_dim,
};
