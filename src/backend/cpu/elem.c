/*
 * backend/cpu/elem.c -- CPU kernels for copies/casts, fills, axpy and the elementwise/reduction family.
 */
// no errno from sqrtf/logf and no FP-trap semantics, so math loops vectorise (we never read errno
// or FP exception flags). It must come before the includes: GCC does not inline a function (here
// fastmath.h's fsdp_expf) into code compiled with other optimize options, and a call per element
// keeps exp/tanh/GELU loops scalar.
#pragma GCC optimize("no-math-errno", "no-trapping-math")

#include "core/core.h"
#include "backend/cpu/cpu.h"
#include "backend/cpu/fastmath.h"

#include <math.h>

#define PAR_MIN 32768       // below this many elements a loop stays on one thread
#define PAR_MIN_HEAVY 4096  // the same for transcendental loops (several ns per element)

// contiguous runs of the same dtype are memcpy'd; everything else goes element by element
// f32 copy whose innermost source dim is strided (a transpose or permute): 32x32 tiles over the
// last two dims keep both the reads and the writes within a few cache lines
static void copy_tiled_f32(float* dst, const float* src, int ndim, const int64_t* shape, const int64_t* sstride) {
  int64_t A = shape[ndim - 2], B = shape[ndim - 1], sa = sstride[ndim - 2], sb = sstride[ndim - 1];
  int64_t outer = fsdp_shape_numel(ndim - 2, shape);
#pragma omp parallel for if (outer * A * B > 65536) schedule(static)
  for (int64_t o = 0; o < outer; o++) {
    int64_t off = 0, rem = o;
    for (int j = ndim - 3; j >= 0; j--) {
      off += (rem % shape[j]) * sstride[j];
      rem /= shape[j];
    }
    const float* s = src + off;
    float* d = dst + o * A * B;
    for (int64_t i0 = 0; i0 < A; i0 += 32)
      for (int64_t j0 = 0; j0 < B; j0 += 32) {
        int64_t i1 = i0 + 32 < A ? i0 + 32 : A, j1 = j0 + 32 < B ? j0 + 32 : B;
        for (int64_t i = i0; i < i1; i++)
          for (int64_t j = j0; j < j1; j++) d[i * B + j] = s[i * sa + j * sb];
      }
  }
}

// the conversions every bfloat16 op makes -- inputs to float32, results back -- have loops of their
// own for contiguous runs, which the compiler vectorizes (the generic path goes through double)
static int is_bf16_pair(int ddt, int sdt) {
  return (ddt == FSDP_F32 && sdt == FSDP_BF16) || (ddt == FSDP_BF16 && sdt == FSDP_F32);
}
static void convert_bf16_run(void* dst, int ddt, const void* src, int64_t n) {
  if (ddt == FSDP_F32) {
    float* d = dst;
    const uint16_t* s = src;
    for (int64_t i = 0; i < n; i++) d[i] = fsdp_bf16_to_f32(s[i]);
  } else {
    uint16_t* d = dst;
    const float* s = src;
    for (int64_t i = 0; i < n; i++) d[i] = fsdp_f32_to_bf16(s[i]);
  }
}

static void cpu_copy_strided(void* dst, int ddt, const void* src, int sdt, int ndim, const int64_t* shape,
                             const int64_t* sstride) {
  size_t des = fsdp_dtype_size(ddt), ses = fsdp_dtype_size(sdt);
  int64_t n = fsdp_shape_numel(ndim, shape);
  if (n == 0) return;
  if (ddt == FSDP_F32 && sdt == FSDP_F32 && ndim >= 2 && sstride[ndim - 1] != 1 && shape[ndim - 1] > 1 &&
      shape[ndim - 2] > 1) {
    copy_tiled_f32(dst, src, ndim, shape, sstride);
    return;
  }
  // merge the innermost dims into one run while they are contiguous in src
  int64_t run = 1;
  int d = ndim - 1;
  while (d >= 0 && sstride[d] == run) {
    run *= shape[d];
    d--;
  }
  if (run == 1 && ndim > 0) {
    run = shape[ndim - 1];
    d = ndim - 2;
  }  // strided innermost dim
  int64_t inner_stride = (d == ndim - 2 && ndim > 0 && sstride[ndim - 1] != 1) ? sstride[ndim - 1] : 1;
  int64_t outer = n / run;
  const char* s = (const char*)src;
  // one long contiguous run converted between float32 and bfloat16: the threads share it in chunks
  if (outer == 1 && inner_stride == 1 && is_bf16_pair(ddt, sdt)) {
    const int64_t chunk = 16384;
    int64_t nc = (run + chunk - 1) / chunk;
#pragma omp parallel for schedule(static) if (n > PAR_MIN)
    for (int64_t c = 0; c < nc; c++) {
      int64_t lo = c * chunk, len = run - lo < chunk ? run - lo : chunk;
      convert_bf16_run((char*)dst + lo * (int64_t)des, ddt, s + lo * (int64_t)ses, len);
    }
    return;
  }
  // runs are shared out over the threads when there is enough to copy and they are long enough
  // for the index arithmetic of each run's start not to matter
#pragma omp parallel for schedule(static) if (n > PAR_MIN && run >= 16 && outer > 1)
  for (int64_t r = 0; r < outer; r++) {
    int64_t off = 0, rem = r;
    for (int j = d; j >= 0; j--) {
      off += (rem % shape[j]) * sstride[j];
      rem /= shape[j];
    }
    const char* sp = s + off * (int64_t)ses;
    char* o = (char*)dst + r * run * (int64_t)des;
    if (ddt == sdt && inner_stride == 1) memcpy(o, sp, run * des);
    else if (inner_stride == 1 && is_bf16_pair(ddt, sdt)) convert_bf16_run(o, ddt, sp, run);
    else if (ddt == FSDP_F32 && sdt == FSDP_F32) {
      float* of = (void*)o;
      const float* sf = (const void*)sp;
      for (int64_t i = 0; i < run; i++) of[i] = sf[i * inner_stride];
    } else {
      for (int64_t i = 0; i < run; i++)
        fsdp_store_elem(o + i * des, ddt, fsdp_load_elem(sp + i * inner_stride * ses, sdt));
    }
  }
}

static void cpu_scatter_strided(void* dst, size_t es, int ndim, const int64_t* shape, const int64_t* dst_stride,
                                const void* src) {
  int64_t n = fsdp_shape_numel(ndim, shape), idx[FSDP_MAX_DIMS] = {0};
  char* d = dst;
  const char* s = src;
  for (int64_t i = 0; i < n; i++) {  // dst's elements in logical order
    int64_t off = 0;
    for (int j = 0; j < ndim; j++) off += idx[j] * dst_stride[j];
    memcpy(d + off * (int64_t)es, s + i * (int64_t)es, es);
    for (int j = ndim - 1; j >= 0; j--) {
      if (++idx[j] < shape[j]) break;
      idx[j] = 0;
    }
  }
}

static void cpu_fill(void* dst, int dt, int64_t n, double v) {
  if (dt == FSDP_F32) {
    float *p = dst, f = (float)v;
#pragma omp parallel for simd if (parallel : n > PAR_MIN)
    for (int64_t i = 0; i < n; i++) p[i] = f;
  } else {
    size_t es = fsdp_dtype_size(dt);
    for (int64_t i = 0; i < n; i++) fsdp_store_elem((char*)dst + i * es, dt, v);
  }
}

static void cpu_axpy(float* y, int64_t ldy, const float* x, int64_t ldx, int64_t rows, int64_t n, float alpha) {
  if (rows == 1) {
#pragma omp parallel for simd if (parallel : n > PAR_MIN)
    for (int64_t i = 0; i < n; i++) y[i] += alpha * x[i];
    return;
  }
#pragma omp parallel for if (rows * n > PAR_MIN)
  for (int64_t r = 0; r < rows; r++) {
    float* yr = y + r * ldy;
    const float* xr = x + r * ldx;
#pragma omp simd
    for (int64_t i = 0; i < n; i++) yr[i] += alpha * xr[i];
  }
}
static void cpu_scale(float* y, int64_t n, float s) {
#pragma omp parallel for simd if (parallel : n > PAR_MIN)
  for (int64_t i = 0; i < n; i++) y[i] *= s;
}

// ============================================================================================
// elementwise / reduction family (ops/elem.c, ops/shape.c)
// ============================================================================================
#define CHUNK 16384  // binary loops split long rows into chunks of this many elements for threads

// ---- binary with broadcasting ------------------------------------------------------------------
// Drops size-1 dims and merges neighbours that are contiguous in both inputs (out is contiguous),
// so most calls end up with 1 dim (same shape) or 2 dims (row / column broadcast).
static int coalesce(int ndim, const int64_t* shape, const int64_t* sa, const int64_t* sb, int64_t* cs, int64_t* ca,
                    int64_t* cb) {
  int n = 0;
  for (int d = 0; d < ndim; d++) {
    if (shape[d] == 1) continue;
    if (n > 0 && ca[n - 1] == sa[d] * shape[d] && cb[n - 1] == sb[d] * shape[d]) {
      cs[n - 1] *= shape[d];
      ca[n - 1] = sa[d];
      cb[n - 1] = sb[d];
    } else {
      cs[n] = shape[d];
      ca[n] = sa[d];
      cb[n] = sb[d];
      n++;
    }
  }
  return n;
}

// One function per op: EXPR computes from x (a's element) and y (b's element). Work is split into
// (row, chunk) items; the innermost loop is specialised for contiguous/broadcast operands so it
// vectorises.
#define DEFINE_BINARY(NAME, EXPR)                                                                                  \
  static void NAME(float* out, const float* a, const float* b, int ndim, const int64_t* shape, const int64_t* sa_, \
                   const int64_t* sb_) {                                                                           \
    int64_t cs[FSDP_MAX_DIMS], sa[FSDP_MAX_DIMS], sb[FSDP_MAX_DIMS];                                               \
    int nd = coalesce(ndim, shape, sa_, sb_, cs, sa, sb);                                                          \
    if (fsdp_shape_numel(ndim, shape) == 0) return;                                                                \
    if (nd == 0) {                                                                                                 \
      float x = a[0], y = b[0];                                                                                    \
      out[0] = (EXPR);                                                                                             \
      return;                                                                                                      \
    }                                                                                                              \
    int64_t len = cs[nd - 1], ia = sa[nd - 1], ib = sb[nd - 1], rows = 1;                                          \
    for (int d = 0; d < nd - 1; d++) rows *= cs[d];                                                                \
    int64_t n = rows * len, chunk = len > CHUNK ? CHUNK : len, nch = (len + chunk - 1) / chunk;                    \
    _Pragma("omp parallel for if (n > PAR_MIN)") for (int64_t w = 0; w < rows * nch; w++) {                        \
      int64_t r = w / nch, i0 = (w % nch) * chunk, i1 = i0 + chunk < len ? i0 + chunk : len;                       \
      int64_t oa = 0, ob = 0, rem = r;                                                                             \
      for (int d = nd - 2; d >= 0; d--) {                                                                          \
        int64_t k = rem % cs[d];                                                                                   \
        rem /= cs[d];                                                                                              \
        oa += k * sa[d];                                                                                           \
        ob += k * sb[d];                                                                                           \
      }                                                                                                            \
      const float* pa = a + oa;                                                                                    \
      const float* pb = b + ob;                                                                                    \
      float* po = out + r * len;                                                                                   \
      if (ia == 1 && ib == 1) {                                                                                    \
        for (int64_t i = i0; i < i1; i++) {                                                                        \
          float x = pa[i], y = pb[i];                                                                              \
          po[i] = (EXPR);                                                                                          \
        }                                                                                                          \
      } else if (ia == 1 && ib == 0) {                                                                             \
        float y = pb[0];                                                                                           \
        for (int64_t i = i0; i < i1; i++) {                                                                        \
          float x = pa[i];                                                                                         \
          po[i] = (EXPR);                                                                                          \
        }                                                                                                          \
      } else if (ia == 0 && ib == 1) {                                                                             \
        float x = pa[0];                                                                                           \
        for (int64_t i = i0; i < i1; i++) {                                                                        \
          float y = pb[i];                                                                                         \
          po[i] = (EXPR);                                                                                          \
        }                                                                                                          \
      } else {                                                                                                     \
        for (int64_t i = i0; i < i1; i++) {                                                                        \
          float x = pa[i * ia], y = pb[i * ib];                                                                    \
          po[i] = (EXPR);                                                                                          \
        }                                                                                                          \
      }                                                                                                            \
    }                                                                                                              \
  }

DEFINE_BINARY(bin_add, x + y)
DEFINE_BINARY(bin_sub, x - y)
DEFINE_BINARY(bin_mul, x* y)
DEFINE_BINARY(bin_div, x / y)
DEFINE_BINARY(bin_eq, x == y ? 1.0f : 0.0f)
DEFINE_BINARY(bin_ne, x != y ? 1.0f : 0.0f)
DEFINE_BINARY(bin_lt, x < y ? 1.0f : 0.0f)
DEFINE_BINARY(bin_le, x <= y ? 1.0f : 0.0f)
DEFINE_BINARY(bin_gt, x > y ? 1.0f : 0.0f)
DEFINE_BINARY(bin_ge, x >= y ? 1.0f : 0.0f)
// NaN propagates (PyTorch's minimum/maximum)
DEFINE_BINARY(bin_min, x != x || y != y ? x + y : (x < y ? x : y))
DEFINE_BINARY(bin_max, x != x || y != y ? x + y : (x > y ? x : y))
DEFINE_BINARY(bin_max_tie, x > y ? 1.0f : (x == y ? 0.5f : 0.0f))

typedef void (*binary_fn)(float*, const float*, const float*, int, const int64_t*, const int64_t*, const int64_t*);
static const binary_fn binary_fns[] = {
    [FSDP_BIN_ADD] = bin_add,         [FSDP_BIN_SUB] = bin_sub, [FSDP_BIN_MUL] = bin_mul, [FSDP_BIN_DIV] = bin_div,
    [FSDP_BIN_EQ] = bin_eq,           [FSDP_BIN_NE] = bin_ne,   [FSDP_BIN_LT] = bin_lt,   [FSDP_BIN_LE] = bin_le,
    [FSDP_BIN_GT] = bin_gt,           [FSDP_BIN_GE] = bin_ge,   [FSDP_BIN_MIN] = bin_min, [FSDP_BIN_MAX] = bin_max,
    [FSDP_BIN_MAX_TIE] = bin_max_tie,
};
static void cpu_binary(int op, float* out, const float* a, const float* b, int ndim, const int64_t* shape,
                       const int64_t* stride_a, const int64_t* stride_b) {
  binary_fns[op](out, a, b, ndim, shape, stride_a, stride_b);
}

// ---- unary -----------------------------------------------------------------------------------------
// tanh(x) = 1 - 2 / (exp(2x) + 1), with the odd polynomial near 0 where that form cancels
static inline float tanh_f(float x) {
  float ax = x < 0 ? -x : x;
  float e = fsdp_expf(2.0f * ax);
  float big = 1.0f - 2.0f / (e + 1.0f);
  float x2 = x * x;  // Cephes tanhf polynomial for |x| < 0.625
  float small =
      ((((-5.70498872745e-3f * x2 + 2.06390887954e-2f) * x2 - 5.37397155531e-2f) * x2 + 1.33314422036e-1f) * x2 -
       3.33332819422e-1f) *
          x2 * ax +
      ax;
  float t = ax < 0.625f ? small : big;
  return x < 0 ? -t : t;  // NaN propagates through exp_f
}
static inline float sigmoid_f(float x) { return 1.0f / (1.0f + fsdp_expf(-x)); }

// Vectorisable float32 log (Cephes' logf: x = 2^e * m, m in [sqrt(1/2), sqrt(2)), polynomial in
// m - 1); within 2 ulp of logf. Subnormals are rescaled; 0 -> -inf, x < 0 -> NaN, inf -> inf.
static inline float log_f(float x) {
  int sub = x < 1.17549435e-38f;
  float xs = sub ? x * 8388608.0f : x;  // 2^23
  int32_t bits;
  memcpy(&bits, &xs, 4);
  int32_t e = ((bits >> 23) & 0xff) - 127 - (sub ? 23 : 0);
  int32_t mb = (bits & 0x7fffff) | 0x3f800000;
  float m;
  memcpy(&m, &mb, 4);  // [1, 2)
  int big = m > 1.41421356f;
  m = big ? 0.5f * m : m;
  float fe = (float)(e + big);
  float f = m - 1.0f, z = f * f;
  float y = 7.0376836292e-2f;
  y = y * f - 1.1514610310e-1f;
  y = y * f + 1.1676998740e-1f;
  y = y * f - 1.2420140846e-1f;
  y = y * f + 1.4249322787e-1f;
  y = y * f - 1.6668057665e-1f;
  y = y * f + 2.0000714765e-1f;
  y = y * f - 2.4999993993e-1f;
  y = y * f + 3.3333331174e-1f;
  y = y * f * z;
  y += -2.12194440e-4f * fe;
  y += -0.5f * z;
  float r = f + y + 0.693359375f * fe;
  r = x == 0.0f ? -__builtin_inff() : r;
  r = x < 0.0f ? __builtin_nanf("") : r;
  r = x == __builtin_inff() ? x : r;
  return x != x ? x : r;
}

// erf(x) given e = exp(-x*x), as PyTorch's vectorised CPU kernels compute it (Abramowitz & Stegun
// 7.1.26, |error| < 1.5e-7 before float rounding): GELU's backward, which needs that exp for the
// density anyway
static inline float erf_e(float x, float e) {
  float ax = __builtin_fabsf(x);
  float t = 1.0f / (1.0f + 0.3275911f * ax);
  float poly = ((((1.061405429f * t - 1.453152027f) * t + 1.421413741f) * t - 0.284496736f) * t + 0.254829592f) * t;
  return __builtin_copysignf(1.0f - poly * e, x);
}
// erf(x) = x P(x^2) / Q(x^2) on [-4, 4], +-1 beyond to float precision (the minimax coefficients of
// Eigen's generic_fast_erf_float): GELU's forward. No exp, so about half the dependent operations
// of erf_e's route and 1.7x its speed; within 3.3e-7 of erf after rounding (erf_e: 5.0e-7).
static inline float erf_f(float x) {
  float xc = x < -4.0f ? -4.0f : (x > 4.0f ? 4.0f : x);
  float x2 = xc * xc;
  float p = -2.72614225801306e-10f;
  p = p * x2 + 2.77068142495902e-08f;
  p = p * x2 - 2.10102402082508e-06f;
  p = p * x2 - 5.69250639462346e-05f;
  p = p * x2 - 7.34990630326855e-04f;
  p = p * x2 - 2.95459980854025e-03f;
  p = p * x2 - 1.60960333262415e-02f;
  float q = -1.45660718464996e-05f;
  q = q * x2 - 2.13374055278905e-04f;
  q = q * x2 - 1.68282697438203e-03f;
  q = q * x2 - 7.37332916720468e-03f;
  q = q * x2 - 1.42647390514189e-02f;
  return p * xc / q;
}

#define GELU_K0 0.7071067811865476f    // 1/sqrt(2)
#define GELU_K1 0.3989422804014327f    // 1/sqrt(2*pi)
#define GELU_BETA 0.7978845608028654f  // sqrt(2/pi)
#define GELU_KAPPA 0.044715f

#define UNARY_LOOP(EXPR)                                                                         \
  _Pragma("omp parallel for simd if (parallel : n > PAR_MIN)") for (int64_t i = 0; i < n; i++) { \
    float v = x[i];                                                                              \
    out[i] = (EXPR);                                                                             \
  }
#define UNARY_LOOP_HEAVY(EXPR)                                                                         \
  _Pragma("omp parallel for simd if (parallel : n > PAR_MIN_HEAVY)") for (int64_t i = 0; i < n; i++) { \
    float v = x[i];                                                                                    \
    out[i] = (EXPR);                                                                                   \
  }

static void cpu_unary(int op, float* out, const float* x, int64_t n, double pd) {
  float p = (float)pd;
  switch (op) {
    case FSDP_UN_NEG: UNARY_LOOP(-v); break;
    case FSDP_UN_EXP: UNARY_LOOP_HEAVY(fsdp_expf(v)); break;
    case FSDP_UN_LOG: UNARY_LOOP_HEAVY(log_f(v)); break;
    case FSDP_UN_SQRT: UNARY_LOOP(sqrtf(v)); break;
    case FSDP_UN_ABS: UNARY_LOOP(fabsf(v)); break;
    case FSDP_UN_TANH: UNARY_LOOP_HEAVY(tanh_f(v)); break;
    case FSDP_UN_SIGMOID: UNARY_LOOP_HEAVY(sigmoid_f(v)); break;
    case FSDP_UN_RELU: UNARY_LOOP(v > 0.0f ? v : (v != v ? v : 0.0f)); break;
    case FSDP_UN_GELU: UNARY_LOOP_HEAVY(0.5f * v * (1.0f + erf_f(v * GELU_K0))); break;
    case FSDP_UN_GELU_TANH:
      UNARY_LOOP_HEAVY(0.5f * v * (1.0f + tanh_f(GELU_BETA * (v + GELU_KAPPA * v * v * v))));
      break;
    case FSDP_UN_POW:
      if (p == 2.0f) {
        UNARY_LOOP(v * v);
      } else if (p == 1.0f) {
        UNARY_LOOP(v);
      } else if (p == 0.5f) {
        UNARY_LOOP(sqrtf(v));
      } else if (p == -1.0f) {
        UNARY_LOOP(1.0f / v);
      } else if (p == 3.0f) {
        UNARY_LOOP(v * v * v);
      } else {
        UNARY_LOOP_HEAVY(powf(v, p));
      }
      break;
    case FSDP_UN_ADD_SCALAR: UNARY_LOOP(v + p); break;
    case FSDP_UN_MUL_SCALAR: UNARY_LOOP(v * p); break;
    case FSDP_UN_RDIV_SCALAR: UNARY_LOOP(p / v); break;
    case FSDP_UN_CLAMP_MIN: UNARY_LOOP(v < p ? p : v); break;  // NaN stays NaN
    case FSDP_UN_CLAMP_MAX: UNARY_LOOP(v > p ? p : v); break;
  }
}

// gx = gy * f'(x); ops read x or y (the forward output), whichever the op layer saved
#define UNARY_BW_LOOP(EXPR)                                                                      \
  _Pragma("omp parallel for simd if (parallel : n > PAR_MIN)") for (int64_t i = 0; i < n; i++) { \
    float g = gy[i];                                                                             \
    gx[i] = (EXPR);                                                                              \
  }
#define UNARY_BW_LOOP_HEAVY(EXPR)                                                                      \
  _Pragma("omp parallel for simd if (parallel : n > PAR_MIN_HEAVY)") for (int64_t i = 0; i < n; i++) { \
    float g = gy[i];                                                                                   \
    gx[i] = (EXPR);                                                                                    \
  }

static void cpu_unary_backward(int op, float* gx, const float* gy, const float* x, const float* y, int64_t n,
                               double pd) {
  float p = (float)pd;
  switch (op) {
    case FSDP_UN_NEG: UNARY_BW_LOOP(-g); break;
    case FSDP_UN_EXP: UNARY_BW_LOOP(g * y[i]); break;
    case FSDP_UN_LOG: UNARY_BW_LOOP(g / x[i]); break;
    case FSDP_UN_SQRT: UNARY_BW_LOOP(g / (2.0f * y[i])); break;
    case FSDP_UN_ABS: UNARY_BW_LOOP(x[i] > 0.0f ? g : (x[i] < 0.0f ? -g : 0.0f)); break;
    case FSDP_UN_TANH: UNARY_BW_LOOP(g * (1.0f - y[i] * y[i])); break;
    case FSDP_UN_SIGMOID: UNARY_BW_LOOP(g * y[i] * (1.0f - y[i])); break;
    case FSDP_UN_RELU: UNARY_BW_LOOP(y[i] > 0.0f ? g : 0.0f); break;
    case FSDP_UN_GELU:  // d/dx [x * Phi(x)] = Phi(x) + x * phi(x); one exp(-x^2/2) serves erf and phi
      UNARY_BW_LOOP_HEAVY(({
        float v = x[i], z = v * GELU_K0, e = fsdp_expf(-z * z);
        g*(0.5f * (1.0f + erf_e(z, e)) + v * GELU_K1 * e);
      }));
      break;
    case FSDP_UN_GELU_TANH:  // PyTorch's GeluBackward with approximate='tanh'
      UNARY_BW_LOOP_HEAVY(({
        float v = x[i], t = tanh_f(GELU_BETA * (v + GELU_KAPPA * v * v * v));
        g*(0.5f * (1.0f + t) + 0.5f * v * (1.0f - t * t) * GELU_BETA * (1.0f + 3.0f * GELU_KAPPA * v * v));
      }));
      break;
    case FSDP_UN_POW:
      if (p == 0.0f) {
        UNARY_BW_LOOP(0.0f * g);
      } else if (p == 1.0f) {
        UNARY_BW_LOOP(g);
      } else if (p == 2.0f) {
        UNARY_BW_LOOP(2.0f * g * x[i]);
      } else {
        UNARY_BW_LOOP_HEAVY(g * p * powf(x[i], p - 1.0f));
      }
      break;
    case FSDP_UN_ADD_SCALAR: UNARY_BW_LOOP(g); break;
    case FSDP_UN_MUL_SCALAR: UNARY_BW_LOOP(g * p); break;
    case FSDP_UN_RDIV_SCALAR: UNARY_BW_LOOP(-g * p / (x[i] * x[i])); break;
    case FSDP_UN_CLAMP_MIN: UNARY_BW_LOOP(x[i] >= p ? g : 0.0f); break;
    case FSDP_UN_CLAMP_MAX: UNARY_BW_LOOP(x[i] <= p ? g : 0.0f); break;
  }
}

// ---- reductions --------------------------------------------------------------------------------------
// sum of a contiguous run: float lanes over blocks of 128, blocks added in double (accurate and
// deterministic for any thread count)
static inline double sum_run(const float* x, int64_t n) {
  double total = 0;
  for (int64_t b = 0; b < n; b += 128) {
    int64_t e = b + 128 < n ? b + 128 : n;
    float s = 0;
#pragma omp simd reduction(+ : s)
    for (int64_t i = b; i < e; i++) s += x[i];
    total += s;
  }
  return total;
}

static void cpu_sum_dim(float* out, const float* in, int64_t outer, int64_t red, int64_t inner) {
  int64_t n = outer * red * inner;
  if (inner == 1 && outer == 1) {  // full reduction: fixed partials, summed in order
    double part[256];
    int64_t per = (red + 255) / 256;
    if (per < 4096) per = 4096;
    int np = (int)((red + per - 1) / per);
#pragma omp parallel for if (n > PAR_MIN)
    for (int c = 0; c < np; c++) {
      int64_t b = c * per, e = b + per < red ? b + per : red;
      part[c] = sum_run(in + b, e - b);
    }
    double total = 0;
    for (int c = 0; c < np; c++) total += part[c];
    out[0] = (float)total;
  } else if (inner == 1) {  // rows
#pragma omp parallel for if (n > PAR_MIN)
    for (int64_t o = 0; o < outer; o++) out[o] = (float)sum_run(in + o * red, red);
  } else {  // columns: out[o, j] = sum_r in[o, r, j]; j in blocks so threads split wide rows too,
            // rows in blocks of 128 summed in float lanes, blocks added in double (like sum_run)
    int64_t jb = inner > 1024 ? 1024 : inner, nb = (inner + jb - 1) / jb;
#pragma omp parallel for if (n > PAR_MIN)
    for (int64_t w = 0; w < outer * nb; w++) {
      int64_t o = w / nb, j0 = (w % nb) * jb, len = j0 + jb < inner ? jb : inner - j0;
      const float* pi = in + o * red * inner + j0;
      float accf[1024];
      double accd[1024];
      for (int64_t j = 0; j < len; j++) accd[j] = 0.0;
      for (int64_t r0 = 0; r0 < red; r0 += 128) {
        int64_t r1 = r0 + 128 < red ? r0 + 128 : red;
        for (int64_t j = 0; j < len; j++) accf[j] = pi[r0 * inner + j];
        for (int64_t r = r0 + 1; r < r1; r++) {
          const float* row = pi + r * inner;
          for (int64_t j = 0; j < len; j++) accf[j] += row[j];
        }
        for (int64_t j = 0; j < len; j++) accd[j] += accf[j];
      }
      float* po = out + o * inner + j0;
      for (int64_t j = 0; j < len; j++) po[j] = (float)accd[j];
    }
  }
}

// max of a contiguous run and the index of its first occurrence (of the first NaN, if any):
// a vectorised max/NaN scan, then a short search for the position
static inline int64_t argmax_run(const float* p, int64_t n, float* best) {
  float m = p[0];
  int nan = 0;
#pragma omp simd reduction(max : m) reduction(| : nan)
  for (int64_t r = 0; r < n; r++) {
    m = p[r] > m ? p[r] : m;
    nan |= p[r] != p[r];
  }
  int64_t r = 0;
  if (nan) {
    while (p[r] == p[r]) r++;
  } else {
    while (p[r] != m) r++;
  }
  *best = p[r];
  return r;
}

// max over red with the index of the first maximum; NaN wins (as in PyTorch)
static void cpu_max_dim(float* out, int64_t* idx, const float* in, int64_t outer, int64_t red, int64_t inner) {
  int64_t n = outer * red * inner;
  if (inner == 1) {
#pragma omp parallel for if (n > PAR_MIN)
    for (int64_t o = 0; o < outer; o++) idx[o] = argmax_run(in + o * red, red, &out[o]);
  } else {
#pragma omp parallel for if (n > PAR_MIN)
    for (int64_t o = 0; o < outer; o++) {
      float* po = out + o * inner;
      int64_t* pi = idx + o * inner;
      const float* p = in + o * red * inner;
      for (int64_t j = 0; j < inner; j++) {
        po[j] = p[j];
        pi[j] = 0;
      }
      for (int64_t r = 1; r < red; r++) {
        const float* row = p + r * inner;
        for (int64_t j = 0; j < inner; j++) {
          float v = row[j];
          int take = v > po[j] || (v != v && po[j] == po[j]);
          po[j] = take ? v : po[j];
          pi[j] = take ? r : pi[j];
        }
      }
    }
  }
}

static void cpu_scatter_dim(float* gx, const float* gy, const int64_t* idx, int64_t outer, int64_t red, int64_t inner) {
  int64_t n = outer * red * inner;
  memset(gx, 0, n * sizeof(float));
#pragma omp parallel for if (n > PAR_MIN)
  for (int64_t o = 0; o < outer; o++)
    for (int64_t j = 0; j < inner; j++) gx[(o * red + idx[o * inner + j]) * inner + j] = gy[o * inner + j];
}

// ---- indexing ------------------------------------------------------------------------------------------
static int64_t cpu_index_check(const int64_t* idx, int64_t n, int64_t lo, int64_t hi, int check) {
  (void)check;  // (synchronous: the op reports it)
  for (int64_t i = 0; i < n; i++)
    if (idx[i] < lo || idx[i] >= hi) return i;
  return -1;
}

static void cpu_index_select(void* out, const void* in, size_t es, const int64_t* idx, int64_t outer, int64_t n_in,
                             int64_t n_idx, int64_t inner) {
  int64_t n = outer * n_idx * inner;
  if (inner == 1 && es == 4) {
    const float* s = in;
    float* d = out;
#pragma omp parallel for if (n > PAR_MIN)
    for (int64_t o = 0; o < outer; o++)
      for (int64_t j = 0; j < n_idx; j++) d[o * n_idx + j] = s[o * n_in + idx[j]];
  } else if (inner == 1 && es == 8) {
    const int64_t* s = in;
    int64_t* d = out;
#pragma omp parallel for if (n > PAR_MIN)
    for (int64_t o = 0; o < outer; o++)
      for (int64_t j = 0; j < n_idx; j++) d[o * n_idx + j] = s[o * n_in + idx[j]];
  } else {
    size_t row = inner * es;
#pragma omp parallel for if (n > PAR_MIN)
    for (int64_t w = 0; w < outer * n_idx; w++) {
      int64_t o = w / n_idx, j = w % n_idx;
      memcpy((char*)out + w * row, (const char*)in + (o * n_in + idx[j]) * row, row);
    }
  }
}

// repeated indices add up, so threads split the independent outer slices only
static void cpu_index_add(float* gx, const float* gy, const int64_t* idx, int64_t outer, int64_t n_in, int64_t n_idx,
                          int64_t inner) {
  int64_t n = outer * n_idx * inner;
#pragma omp parallel for if (n > PAR_MIN && outer > 1)
  for (int64_t o = 0; o < outer; o++)
    for (int64_t j = 0; j < n_idx; j++) {
      float* d = gx + (o * n_in + idx[j]) * inner;
      const float* s = gy + (o * n_idx + j) * inner;
      for (int64_t k = 0; k < inner; k++) d[k] += s[k];
    }
}

// ---- where, cumsum ------------------------------------------------------------------------------------
// rows over all dims but the last; each row's offsets from its multi-index
static void cpu_where(float* out, const uint8_t* c, const float* a, const float* b, int ndim, const int64_t* shape,
                      const int64_t* sc, const int64_t* sa, const int64_t* sb) {
  int64_t n = fsdp_shape_numel(ndim, shape);
  if (n == 0) return;
  if (ndim == 0) {
    out[0] = c[0] ? a[0] : b[0];
    return;
  }
  int64_t len = shape[ndim - 1], rows = n / len;
  int64_t ic = sc[ndim - 1], ia = sa[ndim - 1], ib = sb[ndim - 1];
#pragma omp parallel for if (n > PAR_MIN)
  for (int64_t r = 0; r < rows; r++) {
    int64_t oc = 0, oa = 0, ob = 0, rem = r;
    for (int d = ndim - 2; d >= 0; d--) {
      int64_t k = rem % shape[d];
      rem /= shape[d];
      oc += k * sc[d];
      oa += k * sa[d];
      ob += k * sb[d];
    }
    float* po = out + r * len;
    for (int64_t i = 0; i < len; i++) po[i] = c[oc + i * ic] ? a[oa + i * ia] : b[ob + i * ib];
  }
}

// each (o, j) line is a sequential sum; lines run in parallel
static void cpu_cumsum_dim(float* out, const float* in, int64_t outer, int64_t red, int64_t inner, int reverse) {
  int64_t lines = outer * inner;
#pragma omp parallel for if (lines * red > PAR_MIN && lines > 1)
  for (int64_t w = 0; w < lines; w++) {
    int64_t o = w / inner, j = w % inner;
    const float* p = in + o * red * inner + j;
    float* q = out + o * red * inner + j;
    double s = 0.0;
    for (int64_t k = 0; k < red; k++) {
      int64_t r = reverse ? red - 1 - k : k;
      s += p[r * inner];
      q[r * inner] = (float)s;
    }
  }
}

// ---- sorting, gather, scatter_add along a dim -------------------------------------------------------------
// PyTorch's order: NaN after every number (and equal to NaN)
static inline int sort_before(float a, float b, int descending) {
  if (descending) return (a > b) || (a != a && b == b);
  return (a < b) || (b != b && a == a);
}
// bottom-up merge sort of one row's positions (stable: on a tie the left run's element goes first)
static void argsort_row(int64_t* idx, int64_t* tmp, const float* x, int64_t n, int descending) {
  for (int64_t i = 0; i < n; i++) idx[i] = i;
  int64_t *src = idx, *dst = tmp;
  for (int64_t w = 1; w < n; w *= 2) {
    for (int64_t lo = 0; lo < n; lo += 2 * w) {
      int64_t mid = lo + w < n ? lo + w : n, hi = lo + 2 * w < n ? lo + 2 * w : n, a = lo, b = mid, o = lo;
      while (a < mid && b < hi) dst[o++] = sort_before(x[src[b]], x[src[a]], descending) ? src[b++] : src[a++];
      while (a < mid) dst[o++] = src[a++];
      while (b < hi) dst[o++] = src[b++];
    }
    int64_t* t = src;
    src = dst;
    dst = t;
  }
  if (src != idx) memcpy(idx, src, (size_t)n * sizeof(int64_t));
}
static void cpu_argsort_rows(int64_t* idx, int64_t* tmp, const float* x, int64_t rows, int64_t n, int descending) {
#pragma omp parallel for if (rows * n > PAR_MIN && rows > 1)
  for (int64_t r = 0; r < rows; r++) argsort_row(idx + r * n, tmp + r * n, x + r * n, n, descending);
}

// the offsets of element i of g->shape in the indexed tensor (its dim-th index from idx[i]) and in
// the other one
static inline void gather_offsets(const fsdp_gather_geom* g, int64_t i, const int64_t* idx, int64_t* self,
                                  int64_t* other) {
  int64_t rest = i, s = 0, o = 0;
  for (int d = g->ndim - 1; d >= 0; d--) {
    int64_t c = rest % g->shape[d];
    rest /= g->shape[d];
    s += (d == g->dim ? idx[i] : c) * g->stride[d];
    o += c * g->other_stride[d];
  }
  *self = s;
  *other = o;
}
static void cpu_gather_dim(const fsdp_gather_geom* g, float* out, const float* in, const int64_t* idx) {
  int64_t n = 1;
  for (int d = 0; d < g->ndim; d++) n *= g->shape[d];
#pragma omp parallel for if (n > PAR_MIN)
  for (int64_t i = 0; i < n; i++) {
    int64_t s, o;
    gather_offsets(g, i, idx, &s, &o);
    out[o] = in[s];
  }
}
// (repeated indices add up, so one thread, in order)
static void cpu_scatter_add_dim(const fsdp_gather_geom* g, float* dst, const float* src, const int64_t* idx) {
  int64_t n = 1;
  for (int d = 0; d < g->ndim; d++) n *= g->shape[d];
  for (int64_t i = 0; i < n; i++) {
    int64_t s, o;
    gather_offsets(g, i, idx, &s, &o);
    dst[s] += src[o];
  }
}

const fsdp_elem_kernels FSDP_ISA_NAME(fsdp_cpu_elem_kernels) = {
    .copy_strided = cpu_copy_strided,
    .scatter_strided = cpu_scatter_strided,
    .fill = cpu_fill,
    .axpy = cpu_axpy,
    .scale = cpu_scale,
    .binary = cpu_binary,
    .unary = cpu_unary,
    .unary_backward = cpu_unary_backward,
    .sum_dim = cpu_sum_dim,
    .max_dim = cpu_max_dim,
    .scatter_dim = cpu_scatter_dim,
    .index_check = cpu_index_check,
    .index_select = cpu_index_select,
    .index_add = cpu_index_add,
    .where = cpu_where,
    .cumsum_dim = cpu_cumsum_dim,
    .argsort_rows = cpu_argsort_rows,
    .gather_dim = cpu_gather_dim,
    .scatter_add_dim = cpu_scatter_add_dim,
};
