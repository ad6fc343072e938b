/*
 * backend/cpu/fastmath.h -- branch-free float32 math that the compiler vectorizes (libm's expf does not),
 * shared by the CPU kernels.
 */
#ifndef FSDP_FASTMATH_H
#define FSDP_FASTMATH_H
#include <stdint.h>
#include <string.h>

// Vectorisable float32 exp (Cephes' expf: exp(x) = 2^k * exp(r), |r| <= ln2/2, degree-6 polynomial);
// within 2 ulp of expf. 2^k is applied as two factors so results down to the subnormals and up to
// overflow (inf) come out right; NaN stays NaN.
static inline float fsdp_expf(float x) {
  float xc = x < -104.0f ? -104.0f : x;  // maxps / minps; a NaN passes through and propagates
  xc = xc > 88.8f ? 88.8f : xc;
  float k = (xc * 1.44269504088896341f + 12582912.0f) - 12582912.0f;  // round(x / ln 2)
  float r = xc - k * 0.693359375f;
  r = r - k * -2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  int32_t ki = (int32_t)k, k1 = ki >> 1, k2 = ki - k1;
  uint32_t e1 = (uint32_t)(k1 + 127) << 23, e2 = (uint32_t)(k2 + 127) << 23;
  float s1, s2;
  memcpy(&s1, &e1, 4);
  memcpy(&s2, &e2, 4);
  return p * s1 * s2;
}
// exp(x) for the x <= 0 of softmax-like kernels (x - max, x - logsumexp): exactly 0 below -87,
// so exp(-inf) is 0 and rows of -inf masks vanish
static inline float fsdp_exp_nonpos(float x) { return x < -87.0f ? 0.0f : fsdp_expf(x); }

#endif
