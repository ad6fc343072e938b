/*
 * core/kernels_nn.h -- the nn kernel table (one per device). Kernels work on raw f32 buffers;
 * the op layer (ops/nn.c) checks shapes and dtypes and records autograd nodes.
 *
 * Layout conventions:
 *   softmax family: a contiguous (outer, n, inner) view; the softmax runs over n.
 *   losses:         logits/logp (N, C, S) and targets (N, S), S = prod of the extra dims (1 for (N, C)).
 *   layer_norm:     x (M, D), normalized over D.
 *   dropout:        the keep mask is a pure function of (seed, element index), so forward and
 *                   backward regenerate it instead of storing it (and it is thread-count independent).
 */
#ifndef FSDP_KERNELS_NN_H
#define FSDP_KERNELS_NN_H
#include <stdint.h>

// geometry of scaled dot-product attention over B matrices (B = the product of the batch dims,
// heads included): q (B, Tq, D), k (B, Tk, D), v (B, Tk, Dv) -> scores P (B, Tq, Tk) -> output (B, Tq, Dv)
typedef struct fsdp_attn_geom {
  int64_t B, Tq, Tk, D, Dv;
  int causal;                // query i sees keys j <= i only
  double scale;              // of the scores q k^T
  double dropout_p;          // on P, 0 for none
  uint64_t seed;             // of the dropout's keep mask (backward regenerates it)
  int64_t mask_sq, mask_sk;  // the additive mask's strides along Tq and Tk (0: broadcast, or no mask)
} fsdp_attn_geom;

typedef struct fsdp_nn_kernels {
  // y = softmax(x) (log_softmax when log) over n of (outer, n, inner)
  void (*softmax_forward)(float* y, const float* x, int64_t outer, int64_t n, int64_t inner, int log);
  // gx from gy and the forward output y; gx may alias gy
  void (*softmax_backward)(float* gx, const float* gy, const float* y, int64_t outer, int64_t n, int64_t inner,
                           int log);

  // first target in (N*S) that is neither in [0, C) nor ignore_index: returns 1 and *bad = its
  // value, else 0 (an async device: 0 at once, a failure reported as deferred check `check` at its
  // next synchronization, as index_check)
  int (*check_targets)(const int64_t* target, int64_t n, int64_t C, int64_t ignore_index, int64_t* bad, int check);
  // The losses keep their results on the device (one-element buffers the host never waits for):
  // fused log_softmax + nll with label smoothing: writes the logsumexp lse (N, S), the mean loss
  // over non-ignored targets in loss[0] (NaN when there is none) and their count in count[0]
  void (*cross_entropy_forward)(float* loss, float* count, float* lse, const float* logits, const int64_t* target,
                                int64_t N, int64_t C, int64_t S, int64_t ignore_index, float smoothing);
  // gx (N, C, S) = gy[0] / count[0] * (softmax - smoothed one-hot), zero on ignored targets
  void (*cross_entropy_backward)(float* gx, const float* logits, const float* lse, const int64_t* target, int64_t N,
                                 int64_t C, int64_t S, int64_t ignore_index, float smoothing, const float* gy,
                                 const float* count);
  // loss[0] = -mean of logp[n, target, s] over non-ignored targets, count[0] their count
  void (*nll_forward)(float* loss, float* count, const float* logp, const int64_t* target, int64_t N, int64_t C,
                      int64_t S, int64_t ignore_index);
  // gx (N, C, S) = -gy[0] / count[0] at the targets, zero elsewhere
  void (*nll_backward)(float* gx, const int64_t* target, int64_t N, int64_t C, int64_t S, int64_t ignore_index,
                       const float* gy, const float* count);

  // loss[0] = mean of (a - b)^2
  void (*mse_forward)(float* loss, const float* a, const float* b, int64_t n);
  // ga = 2 gy[0] / n * (a - b), gb = -ga; either may be NULL
  void (*mse_backward)(float* ga, float* gb, const float* a, const float* b, int64_t n, const float* gy);

  // y (M, D) = (x - mean) * rstd * w + b; w, b (D) may be NULL; writes mean, rstd (M)
  void (*layer_norm_forward)(float* y, float* mean, float* rstd, const float* x, const float* w, const float* b,
                             int64_t M, int64_t D, float eps);
  // dx (M, D), dw (D), db (D), each may be NULL (dx needs w, or NULL w meaning ones)
  void (*layer_norm_backward)(float* dx, float* dw, float* db, const float* dy, const float* x, const float* mean,
                              const float* rstd, const float* w, int64_t M, int64_t D);

  // y (n, D) = w[idx[i]] for i < n, w (V, D); idx checked to lie in [0, V) (on an async device the
  // check may still be under way: a row out of range gives zeros there)
  void (*embedding_forward)(float* y, const float* w, const int64_t* idx, int64_t n, int64_t V, int64_t D);
  // gw (V, D) = 0, then gw[idx[i]] += gy[i] for idx[i] != padding_idx
  void (*embedding_backward)(float* gw, const float* gy, const int64_t* idx, int64_t n, int64_t V, int64_t D,
                             int64_t padding_idx);

  // y = x * keep(seed, i) / (1 - p); also the backward (gx from gy); y may alias x
  void (*dropout)(float* y, const float* x, int64_t n, float p, uint64_t seed);

  // attention scores -> probabilities, in place on P (B, Tq, Tk): adds the additive mask (when
  // mask != NULL: element (b, i, j) at mask[mask_boff[b] + i * g->mask_sq + j * g->mask_sk]), masks
  // j > i when g->causal, then softmax over each row
  void (*attn_softmax)(const fsdp_attn_geom* g, float* P, const float* mask, const int64_t* mask_boff);
} fsdp_nn_kernels;

#endif
