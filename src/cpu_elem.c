/*
 * cpu_elem.c -- CPU kernels for copies/casts, fills, axpy and the elementwise/reduction family.
 */
#include "internal.h"

#include <math.h>

// ---- bf16 / f16 conversions (round to nearest even) --------------------------------------------
float fsdp_bf16_to_f32(uint16_t h) {
  uint32_t u = (uint32_t)h << 16;
  float f;
  memcpy(&f, &u, 4);
  return f;
}
static inline uint16_t f32_to_bf16(float f) {
  uint32_t u;
  memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40);  // quiet NaN
  u += 0x7fffu + ((u >> 16) & 1);
  return (uint16_t)(u >> 16);
}
float fsdp_f16_to_f32(uint16_t h) {
  uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff, u;
  if (exp == 0) {
    if (man == 0) u = sign;
    else {  // subnormal: normalise
      int e = -1;
      do { e++; man <<= 1; } while (!(man & 0x400));
      u = sign | ((uint32_t)(127 - 15 - e) << 23) | ((man & 0x3ff) << 13);
    }
  } else if (exp == 0x1f) u = sign | 0x7f800000u | (man << 13);
  else u = sign | ((exp + 127 - 15) << 23) | (man << 13);
  float f;
  memcpy(&f, &u, 4);
  return f;
}
static inline uint16_t f32_to_f16(float f) {
  uint32_t u;
  memcpy(&u, &f, 4);
  uint32_t sign = (u >> 16) & 0x8000;
  int32_t exp = (int32_t)((u >> 23) & 0xff) - 127 + 15;
  uint32_t man = u & 0x7fffff;
  if (((u >> 23) & 0xff) == 0xff) return (uint16_t)(sign | 0x7c00 | (man ? 0x200 : 0));
  if (exp >= 0x1f) return (uint16_t)(sign | 0x7c00);  // overflow -> inf
  if (exp <= 0) {                                      // subnormal or zero
    if (exp < -10) return (uint16_t)sign;
    man |= 0x800000;
    int shift = 14 - exp;
    uint32_t half = man >> shift, rem = man & ((1u << shift) - 1), mid = 1u << (shift - 1);
    if (rem > mid || (rem == mid && (half & 1))) half++;
    return (uint16_t)(sign | half);
  }
  uint32_t half = sign | ((uint32_t)exp << 10) | (man >> 13), rem = man & 0x1fff;
  if (rem > 0x1000 || (rem == 0x1000 && (half & 1))) half++;  // may carry into exp: still correct
  return (uint16_t)half;
}

static inline double load(const void* p, int dt) {
  switch (dt) {
    case FSDP_F32: return *(const float*)p;
    case FSDP_I64: return (double)*(const int64_t*)p;
    case FSDP_BF16: return fsdp_bf16_to_f32(*(const uint16_t*)p);
    default: return fsdp_f16_to_f32(*(const uint16_t*)p);
  }
}
static inline void store(void* p, int dt, double v) {
  switch (dt) {
    case FSDP_F32: *(float*)p = (float)v; break;
    case FSDP_I64: *(int64_t*)p = (int64_t)v; break;
    case FSDP_BF16: *(uint16_t*)p = f32_to_bf16((float)v); break;
    default: *(uint16_t*)p = f32_to_f16((float)v); break;
  }
}

// contiguous runs of the same dtype are memcpy'd; everything else goes element by element
static void cpu_copy_strided(void* dst, int ddt, const void* src, int sdt, int ndim, const int64_t* shape,
                             const int64_t* sstride) {
  size_t des = fsdp_dtype_size(ddt), ses = fsdp_dtype_size(sdt);
  int64_t n = fsdp_shape_numel(ndim, shape);
  if (n == 0) return;
  // merge the innermost dims into one run while they are contiguous in src
  int64_t run = 1;
  int d = ndim - 1;
  while (d >= 0 && sstride[d] == run) { run *= shape[d]; d--; }
  if (run == 1 && ndim > 0) { run = shape[ndim - 1]; d = ndim - 2; }  // strided innermost dim
  int64_t inner_stride = (d == ndim - 2 && ndim > 0 && sstride[ndim - 1] != 1) ? sstride[ndim - 1] : 1;
  int64_t outer = n / run, idx[FSDP_MAX_DIMS] = {0};
  char* o = (char*)dst;
  const char* s = (const char*)src;
  for (int64_t r = 0; r < outer; r++) {
    int64_t off = 0;
    for (int j = 0; j <= d; j++) off += idx[j] * sstride[j];
    const char* sp = s + off * (int64_t)ses;
    if (ddt == sdt && inner_stride == 1) memcpy(o, sp, run * des);
    else if (ddt == FSDP_F32 && sdt == FSDP_F32) {
      float* of = (float*)o;
      const float* sf = (const float*)sp;
      for (int64_t i = 0; i < run; i++) of[i] = sf[i * inner_stride];
    } else {
      for (int64_t i = 0; i < run; i++) store(o + i * des, ddt, load(sp + i * inner_stride * ses, sdt));
    }
    o += run * des;
    for (int j = d; j >= 0; j--) { if (++idx[j] < shape[j]) break; idx[j] = 0; }
  }
}

static void cpu_fill(void* dst, int dt, int64_t n, double v) {
  if (dt == FSDP_F32) {
    float* p = dst, f = (float)v;
    for (int64_t i = 0; i < n; i++) p[i] = f;
  } else {
    size_t es = fsdp_dtype_size(dt);
    for (int64_t i = 0; i < n; i++) store((char*)dst + i * es, dt, v);
  }
}

static void cpu_axpy(float* y, const float* x, int64_t n, float alpha) {
  if (alpha == 1.0f) for (int64_t i = 0; i < n; i++) y[i] += x[i];
  else for (int64_t i = 0; i < n; i++) y[i] += alpha * x[i];
}
static void cpu_scale(float* y, int64_t n, float s) {
  for (int64_t i = 0; i < n; i++) y[i] *= s;
}

const fsdp_elem_kernels fsdp_cpu_elem_kernels = {
    .copy_strided = cpu_copy_strided,
    .fill = cpu_fill,
    .axpy = cpu_axpy,
    .scale = cpu_scale,
};
