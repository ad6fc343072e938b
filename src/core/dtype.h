/*
 * core/dtype.h -- one element of any dtype to and from double (the conversions between float32,
 * bfloat16 and float16 themselves are in core/elem_math.h, which the CUDA kernels share). Kernels
 * and slow paths (item, tolist) use these.
 */
#ifndef FSDP_CORE_DTYPE_H
#define FSDP_CORE_DTYPE_H
#include "fsdp.h"
#include "core/elem_math.h"
#include <stdint.h>
#include <string.h>

// one element of dtype dt at p, as double (slow paths and strided copies)
static inline double fsdp_load_elem(const void* p, int dt) {
  switch (dt) {
    case FSDP_F32: return *(const float*)p;
    case FSDP_I64: return (double)*(const int64_t*)p;
    case FSDP_BF16: return fsdp_bf16_to_f32(*(const uint16_t*)p);
    case FSDP_BOOL: return *(const uint8_t*)p ? 1.0 : 0.0;
    default: return fsdp_f16_to_f32(*(const uint16_t*)p);
  }
}
static inline void fsdp_store_elem(void* p, int dt, double v) {
  switch (dt) {
    case FSDP_F32: *(float*)p = (float)v; break;
    case FSDP_I64: *(int64_t*)p = (int64_t)v; break;
    case FSDP_BF16: *(uint16_t*)p = fsdp_f32_to_bf16((float)v); break;
    case FSDP_BOOL: *(uint8_t*)p = v != 0.0; break;  // NaN is true, as in PyTorch
    default: *(uint16_t*)p = fsdp_f32_to_f16((float)v); break;
  }
}

#endif
