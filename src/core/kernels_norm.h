/*
 * core/kernels_norm.h -- the normalization kernel table (one per device): batch norm (the
 * statistics, apply and backward in pieces, so SyncBatchNorm can all-reduce the per-channel sums
 * between them), group norm and RMS norm. Kernels work on raw contiguous f32 buffers; the op layer
 * (ops/norm.c) checks shapes and dtypes and records the autograd nodes.
 *
 * Layout conventions:
 *   batch_norm, group_norm: x (N, C, S), S = the product of the dims after the channel (1 for (N, C)).
 *   rms_norm:               x (M, D), normalized over D.
 * Batch statistics: s1 (C + 1) = [sum of x per channel | count N*S], s2 (C) = sum of (x - mean)^2
 * per channel, mean = s1 / count (two passes, so the variance has no cancellation). SyncBatchNorm
 * all-reduces s1, then s2, and in backward g (2C) = [sum dy | sum dy * (x - mean)] per channel.
 */
#ifndef FSDP_KERNELS_NORM_H
#define FSDP_KERNELS_NORM_H
#include <stdint.h>

typedef struct fsdp_norm_kernels {
  // s1 == NULL: out (C + 1) = [sum of x per channel | N*S]; else out (C) = sum of (x - mean)^2 per
  // channel with mean = s1[c] / s1[C]
  void (*batch_norm_sums)(float* out, const float* x, const float* s1, int64_t N, int64_t C, int64_t S);
  // s1 != NULL (training): mean = s1 / cnt, invstd = 1 / sqrt(s2 / cnt + eps) and, when rmean is
  // given, rmean = (1 - m) rmean + m mean, rvar = (1 - m) rvar + m s2 / (cnt - 1) (cnt = s1[C]);
  // s1 == NULL (eval): mean = rmean, invstd = 1 / sqrt(rvar + eps)
  void (*batch_norm_stats)(float* mean, float* invstd, float* rmean, float* rvar, const float* s1, const float* s2,
                           int64_t C, float eps, float momentum);
  // y (N, C, S) = (x - mean[c]) * invstd[c] * w[c] + b[c]; w, b may be NULL
  void (*batch_norm_apply)(float* y, const float* x, const float* mean, const float* invstd, const float* w,
                           const float* b, int64_t N, int64_t C, int64_t S);
  // g (2C) = [sum of dy per channel | sum of dy * (x - mean) per channel]
  void (*batch_norm_backward_sums)(float* g, const float* dy, const float* x, const float* mean, int64_t N, int64_t C,
                                   int64_t S);
  // dw = g_local[C + c] * invstd, db = g_local[c] (either may be NULL); dx (may be NULL) with
  // s = w * invstd (w NULL: ones): training (g != NULL, cnt = s1[C]):
  // dx = s * (dy - g[c] / cnt - (x - mean) * invstd^2 * g[C + c] / cnt); eval (g NULL): dx = s * dy
  void (*batch_norm_backward)(float* dx, float* dw, float* db, const float* dy, const float* x, const float* mean,
                              const float* invstd, const float* w, const float* g_local, const float* g,
                              const float* s1, int64_t N, int64_t C, int64_t S);

  // y (N, C, S) = (x - mean) * rstd * w[c] + b[c] with the statistics of each (n, group) of C / G
  // channels; writes mean, rstd (N, G); w, b may be NULL
  void (*group_norm_forward)(float* y, float* mean, float* rstd, const float* x, const float* w, const float* b,
                             int64_t N, int64_t C, int64_t S, int64_t G, float eps);
  // dx (N, C, S), dw (C), db (C), each may be NULL (w NULL: ones)
  void (*group_norm_backward)(float* dx, float* dw, float* db, const float* dy, const float* x, const float* mean,
                              const float* rstd, const float* w, int64_t N, int64_t C, int64_t S, int64_t G);

  // y (M, D) = x * rstd * w, rstd = 1 / sqrt(mean(x^2) + eps) per row (written, (M)); w may be NULL
  void (*rms_norm_forward)(float* y, float* rstd, const float* x, const float* w, int64_t M, int64_t D, float eps);
  // dx (M, D), dw (D), each may be NULL (w NULL: ones)
  void (*rms_norm_backward)(float* dx, float* dw, const float* dy, const float* x, const float* rstd, const float* w,
                            int64_t M, int64_t D);
} fsdp_norm_kernels;

#endif
