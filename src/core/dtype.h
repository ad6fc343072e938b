/*
 * core/dtype.h -- element conversions between the dtypes, as inline functions: bf16 and f16 to and
 * from f32 (round to nearest even, NaN stays NaN), and one element of any dtype to and from double.
 * Kernels and slow paths (item, tolist) share these.
 */
#ifndef FSDP_CORE_DTYPE_H
#define FSDP_CORE_DTYPE_H
#include "fsdp.h"
#include <stdint.h>
#include <string.h>

static inline float fsdp_bf16_to_f32(uint16_t h) {
  uint32_t u = (uint32_t)h << 16;
  float f;
  memcpy(&f, &u, 4);
  return f;
}
static inline uint16_t fsdp_f32_to_bf16(float f) {
  uint32_t u;
  memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40);  // quiet NaN
  u += 0x7fffu + ((u >> 16) & 1);
  return (uint16_t)(u >> 16);
}
static inline float fsdp_f16_to_f32(uint16_t h) {
  uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff, u;
  if (exp == 0) {
    if (man == 0) u = sign;
    else {  // subnormal: normalise
      int e = -1;
      do {
        e++;
        man <<= 1;
      } while (!(man & 0x400));
      u = sign | ((uint32_t)(127 - 15 - e) << 23) | ((man & 0x3ff) << 13);
    }
  } else if (exp == 0x1f) u = sign | 0x7f800000u | (man << 13);
  else u = sign | ((exp + 127 - 15) << 23) | (man << 13);
  float f;
  memcpy(&f, &u, 4);
  return f;
}
static inline uint16_t fsdp_f32_to_f16(float f) {
  uint32_t u;
  memcpy(&u, &f, 4);
  uint32_t sign = (u >> 16) & 0x8000;
  int32_t exp = (int32_t)((u >> 23) & 0xff) - 127 + 15;
  uint32_t man = u & 0x7fffff;
  if (((u >> 23) & 0xff) == 0xff) return (uint16_t)(sign | 0x7c00 | (man ? 0x200 : 0));
  if (exp >= 0x1f) return (uint16_t)(sign | 0x7c00);  // overflow -> inf
  if (exp <= 0) {                                     // subnormal or zero
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

// one element of dtype dt at p, as double (slow paths and strided copies)
static inline double fsdp_load_elem(const void* p, int dt) {
  switch (dt) {
    case FSDP_F32: return *(const float*)p;
    case FSDP_I64: return (double)*(const int64_t*)p;
    case FSDP_BF16: return fsdp_bf16_to_f32(*(const uint16_t*)p);
    default: return fsdp_f16_to_f32(*(const uint16_t*)p);
  }
}
static inline void fsdp_store_elem(void* p, int dt, double v) {
  switch (dt) {
    case FSDP_F32: *(float*)p = (float)v; break;
    case FSDP_I64: *(int64_t*)p = (int64_t)v; break;
    case FSDP_BF16: *(uint16_t*)p = fsdp_f32_to_bf16((float)v); break;
    default: *(uint16_t*)p = fsdp_f32_to_f16((float)v); break;
  }
}

#endif
