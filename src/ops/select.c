/*
 * ops/select.c -- selection, sorting and sampling along a dim: gather, scatter_add, argsort, sort,
 * topk and multinomial. Index VALUES are 0-based (PyTorch's); dims are 0-based here (the Lua layer
 * converts), but messages name them 1-based, as the user counts them.
 *
 *   gather(a, dim, index)            out[i] = a[i with index[i] at dim]    backward: scatter_add into zeros
 *   scatter_add(a, dim, index, src)  a with src added at index              backward: a <- g, src <- gather(g)
 *   argsort(a, dim, descending)      the stable order of each row along dim (the kernel sorts rows moved
 *                                    to the last dim); integers, no gradient
 *   sort, topk                       argsort (its first k), then values = gather(a, dim, indices): the
 *                                    gradient reaches the chosen positions through gather's node
 *   multinomial(probs, n, repl)      drawn on the host from core's RNG stream (as factory.c's draws are),
 *                                    so one seed gives the same samples on every rank and every run
 */
#include "ops/ops.h"

#include <math.h>
#include <stdlib.h>

// ---- gather / scatter_add ---------------------------------------------------------------------------
// index (contiguous) over the indexed tensor (strides st, dim of size dim_size) and the other one (ost)
static fsdp_gather_geom geom_of(const fsdp_tensor* index, int dim, int64_t dim_size, const int64_t* st,
                                const int64_t* ost) {
  fsdp_gather_geom g = {.ndim = index->ndim, .dim = dim, .dim_size = dim_size};
  for (int d = 0; d < index->ndim; d++) {
    g.shape[d] = index->shape[d];
    g.stride[d] = st[d];
    g.other_stride[d] = ost[d];
  }
  return g;
}

// gather's and scatter_add's index: int64, as many dims as a, no larger than a but at dim, values
// in [0, a's size at dim). A contiguous copy (new ref), or NULL with the error set.
static fsdp_tensor* checked_index(const char* op, const fsdp_tensor* a, int d, fsdp_tensor* index) {
  CHECK_NULL(index->dtype == FSDP_I64, "%s: index must be an int64 tensor, got %s of shape %s", op, DT(index),
             SH(index));
  if (fsdp_check_same_device(op, a, index)) return NULL;
  CHECK_NULL(index->ndim == a->ndim, "%s: index of shape %s must have as many dims as the input of shape %s", op,
             SH(index), SH(a));
  for (int j = 0; j < a->ndim; j++)
    CHECK_NULL(j == d || index->shape[j] <= a->shape[j],
               "%s: index of shape %s is larger than the input of shape %s at dim %d (only dim %d may be larger)", op,
               SH(index), SH(a), j + 1, d + 1);
  fsdp_tensor* idx = fsdp_contiguous(index);
  if (!idx) return NULL;
  const fsdp_backend* b = fsdp_backend_of(a);
  int check = b->async ? fsdp_check_defer("%s: index %%lld is out of range for dim %d of size %lld in a tensor of "
                                          "shape %s (found on the device)",
                                          op, d + 1, (long long)a->shape[d], SH(a))
                       : 0;
  int64_t bad = b->elem->index_check(fsdp_i64(idx), fsdp_tensor_numel(idx), 0, a->shape[d], check);
  if (bad >= 0) {
    fsdp_errorf("%s: index %lld (at position %lld of the flattened index) is out of range for dim %d of size %lld "
                "in a tensor of shape %s (index values are 0-based)",
                op, (long long)fsdp_i64(idx)[bad], (long long)bad + 1, d + 1, (long long)a->shape[d], SH(a));
    fsdp_tensor_release(idx);
    return NULL;
  }
  return idx;
}

// out (float32, contiguous, idx's shape) = a (float32, any layout) gathered along d at idx
static fsdp_tensor* gather_f32(const fsdp_tensor* a, int d, const fsdp_tensor* idx) {
  fsdp_tensor* out = fsdp_new(idx->ndim, idx->shape, FSDP_F32, fsdp_device_of(a));
  if (!out) return NULL;
  int64_t ost[FSDP_MAX_DIMS];
  fsdp_contiguous_strides(idx->ndim, idx->shape, ost);
  fsdp_gather_geom g = geom_of(idx, d, a->shape[d], a->stride, ost);
  fsdp_backend_of(a)->elem->gather_dim(&g, fsdp_f32(out), fsdp_f32(a), fsdp_i64(idx));
  return out;
}

// dst (float32, contiguous) += src (float32, any layout, at least idx's sizes) added along d at idx
static void scatter_add_f32(fsdp_tensor* dst, int d, const fsdp_tensor* idx, const fsdp_tensor* src) {
  int64_t st[FSDP_MAX_DIMS];
  fsdp_contiguous_strides(dst->ndim, dst->shape, st);
  fsdp_gather_geom g = geom_of(idx, d, dst->shape[d], st, src->stride);
  fsdp_backend_of(dst)->elem->scatter_add_dim(&g, fsdp_f32(dst), fsdp_f32(src), fsdp_i64(idx));
}

// saved[0] = index (contiguous i64)
typedef struct {
  fsdp_shape_rec in;  // gather: the input's shape; scatter_add: src's
  int dim;
} select_params;

static int gather_backward(fsdp_node* n, fsdp_tensor* g, fsdp_tensor** gin) {
  fsdp_tensor* idx = fsdp_node_saved(n, 0);
  if (!idx) return -1;
  select_params p;
  fsdp_node_params(n, &p, sizeof p);
  fsdp_tensor* gx = fsdp_full(p.in.ndim, p.in.shape, 0.0, FSDP_F32, fsdp_device_of(g));
  fsdp_tensor* gf = fsdp_as_f32(g);
  if (!gx || !gf) {
    fsdp_tensor_release(gx);
    fsdp_tensor_release(gf);
    return -1;
  }
  scatter_add_f32(gx, p.dim, idx, gf);
  fsdp_tensor_release(gf);
  gin[0] = gx;
  return 0;
}

fsdp_tensor* fsdp_gather(fsdp_tensor* a, int dim, fsdp_tensor* index) {
  CHECK_NULL(a && index, "gather: input or index tensor is NULL");
  if (fsdp_check_float("gather", a)) return NULL;
  CHECK_NULL(a->ndim > 0, "gather: input must have at least one dim (got a 0-dim %s tensor)", DT(a));
  int d = fsdp_wrap_dim("gather", dim, a->ndim);
  if (d < 0) return NULL;
  fsdp_tensor* idx = checked_index("gather", a, d, index);
  if (!idx) return NULL;
  fsdp_tensor* af = fsdp_as_f32(a);
  fsdp_tensor* out = af ? fsdp_round_to(gather_f32(af, d, idx), a->dtype) : NULL;
  fsdp_tensor_release(af);
  fsdp_node* n = out ? fsdp_node_new("GatherBackward", gather_backward, 1, &a) : NULL;
  if (n) {
    fsdp_node_save(n, idx);
    select_params p = {.in = fsdp_shape_rec_of(a), .dim = d};
    fsdp_node_set_params(n, &p, sizeof p);
    fsdp_node_set_output(n, out);
  }
  fsdp_tensor_release(idx);
  return out;
}

// src's gradient: g gathered at index, in zeros of src's shape where src is larger than index
static fsdp_tensor* scatter_add_src_grad(fsdp_tensor* g, const select_params* p, const fsdp_tensor* idx) {
  fsdp_tensor* gf = fsdp_as_f32(g);
  fsdp_tensor* gs = gf ? gather_f32(gf, p->dim, idx) : NULL;
  fsdp_tensor_release(gf);
  if (!gs || fsdp_shape_numel(p->in.ndim, p->in.shape) == fsdp_tensor_numel(gs)) return gs;
  fsdp_tensor* z = fsdp_full(p->in.ndim, p->in.shape, 0.0, FSDP_F32, fsdp_device_of(g));
  int64_t st[FSDP_MAX_DIMS];
  fsdp_contiguous_strides(p->in.ndim, p->in.shape, st);
  fsdp_tensor* corner = z ? fsdp_new_view(z, idx->ndim, idx->shape, st, 0) : NULL;  // z[:i0, :i1, ...]
  int rc = corner ? fsdp_copy_strided(corner, gs) : -1;
  fsdp_tensor_release(corner);
  fsdp_tensor_release(gs);
  if (rc) {
    fsdp_tensor_release(z);
    return NULL;
  }
  return z;
}

static int scatter_add_backward(fsdp_node* n, fsdp_tensor* g, fsdp_tensor** gin) {
  if (n->needs_grad[0]) {
    fsdp_tensor_retain(g);
    gin[0] = g;
  }
  if (!n->needs_grad[1]) return 0;
  fsdp_tensor* idx = fsdp_node_saved(n, 0);
  if (!idx) return -1;
  select_params p;
  fsdp_node_params(n, &p, sizeof p);
  gin[1] = scatter_add_src_grad(g, &p, idx);
  return gin[1] ? 0 : -1;
}

fsdp_tensor* fsdp_scatter_add(fsdp_tensor* a, int dim, fsdp_tensor* index, fsdp_tensor* src) {
  CHECK_NULL(a && index && src, "scatter_add: input, index or src tensor is NULL");
  if (fsdp_check_float("scatter_add", a) || fsdp_check_float("scatter_add", src)) return NULL;
  CHECK_NULL(a->dtype == src->dtype, "scatter_add: src (%s) must have the input's dtype (%s)", DT(src), DT(a));
  if (fsdp_check_same_device("scatter_add", a, src)) return NULL;
  CHECK_NULL(a->ndim > 0, "scatter_add: input must have at least one dim (got a 0-dim %s tensor)", DT(a));
  CHECK_NULL(src->ndim == a->ndim, "scatter_add: src of shape %s must have as many dims as the input of shape %s",
             SH(src), SH(a));
  int d = fsdp_wrap_dim("scatter_add", dim, a->ndim);
  if (d < 0) return NULL;
  for (int j = 0; j < a->ndim; j++)
    CHECK_NULL(index->ndim != a->ndim || index->shape[j] <= src->shape[j],
               "scatter_add: index of shape %s is larger than src of shape %s at dim %d", SH(index), SH(src), j + 1);
  fsdp_tensor* idx = checked_index("scatter_add", a, d, index);
  if (!idx) return NULL;
  fsdp_tensor* out = fsdp_new(a->ndim, a->shape, FSDP_F32, fsdp_device_of(a));
  fsdp_tensor* sf = out ? fsdp_as_f32(src) : NULL;
  if (sf && fsdp_copy_strided(out, a) == 0) {
    scatter_add_f32(out, d, idx, sf);
  } else {
    fsdp_tensor_release(out);
    out = NULL;
  }
  fsdp_tensor_release(sf);
  out = fsdp_round_to(out, a->dtype);
  fsdp_node* n = out ? fsdp_node_new("ScatterAddBackward", scatter_add_backward, 2, (fsdp_tensor*[]){a, src}) : NULL;
  if (n) {
    fsdp_node_save(n, idx);
    select_params p = {.in = fsdp_shape_rec_of(src), .dim = d};
    fsdp_node_set_params(n, &p, sizeof p);
    fsdp_node_set_output(n, out);
  }
  fsdp_tensor_release(idx);
  return out;
}

// ---- argsort / sort / topk ----------------------------------------------------------------------------
// the order of each row of a along d: a's values, detached (no node: the order has no gradient),
// with d moved last, as contiguous float32 rows that the kernel sorts
fsdp_tensor* fsdp_argsort(fsdp_tensor* a, int dim, int descending) {
  CHECK_NULL(a, "argsort: input tensor is NULL");
  if (fsdp_check_float("argsort", a)) return NULL;
  int d = fsdp_wrap_dim("argsort", dim, a->ndim);
  if (d < 0) return NULL;
  if (a->ndim == 0) return fsdp_full(0, a->shape, 0.0, FSDP_I64, fsdp_device_of(a));
  int last = a->ndim - 1;
  fsdp_tensor* det = fsdp_detach(a);
  fsdp_tensor* moved = det && d != last ? fsdp_transpose(det, d, last) : det;
  if (moved != det) fsdp_tensor_release(det);
  fsdp_tensor* rows = moved ? fsdp_as_contig(moved) : NULL;
  fsdp_tensor_release(moved);
  if (!rows) return NULL;
  fsdp_tensor* idx = fsdp_new(rows->ndim, rows->shape, FSDP_I64, fsdp_device_of(a));
  fsdp_tensor* tmp = idx ? fsdp_new(rows->ndim, rows->shape, FSDP_I64, fsdp_device_of(a)) : NULL;
  int64_t n = a->shape[d], numel = fsdp_tensor_numel(rows);
  if (tmp && numel > 0)
    fsdp_backend_of(a)->elem->argsort_rows(fsdp_i64(idx), fsdp_i64(tmp), fsdp_f32(rows), numel / n, n, descending);
  fsdp_tensor_release(rows);
  fsdp_tensor_release(tmp);
  if (!tmp || d == last) {
    if (!tmp) fsdp_tensor_release(idx);
    return tmp ? idx : NULL;
  }
  fsdp_tensor* back = fsdp_transpose(idx, d, last);
  fsdp_tensor_release(idx);
  fsdp_tensor* out = back ? fsdp_contiguous(back) : NULL;
  fsdp_tensor_release(back);
  return out;
}

// the values at idx along dim (gather's node carries the gradient); a 0-dim a is its own value
static fsdp_tensor* values_at(fsdp_tensor* a, int dim, fsdp_tensor* idx, fsdp_tensor** indices) {
  fsdp_tensor* v = a->ndim == 0 ? fsdp_reshape(a, 0, a->shape) : fsdp_gather(a, dim, idx);
  if (v && indices) {
    *indices = idx;
  } else {
    fsdp_tensor_release(idx);
  }
  return v;
}

fsdp_tensor* fsdp_sort(fsdp_tensor* a, int dim, int descending, fsdp_tensor** indices) {
  CHECK_NULL(a, "sort: input tensor is NULL");
  fsdp_tensor* idx = fsdp_argsort(a, dim, descending);
  if (!idx) return NULL;
  return values_at(a, dim, idx, indices);
}

fsdp_tensor* fsdp_topk(fsdp_tensor* a, int64_t k, int dim, int largest, fsdp_tensor** indices) {
  CHECK_NULL(a, "topk: input tensor is NULL");
  if (fsdp_check_float("topk", a)) return NULL;
  int d = fsdp_wrap_dim("topk", dim, a->ndim);
  if (d < 0) return NULL;
  int64_t size = a->ndim > 0 ? a->shape[d] : 1;
  CHECK_NULL(k >= 0 && k <= size, "topk: k = %lld is out of range for dim %d of size %lld in a tensor of shape %s",
             (long long)k, d + 1, (long long)size, SH(a));
  fsdp_tensor* all = fsdp_argsort(a, dim, largest);
  if (!all || a->ndim == 0) return all ? values_at(a, dim, all, indices) : NULL;
  fsdp_tensor* first = fsdp_narrow(all, d, 0, k);
  fsdp_tensor_release(all);
  fsdp_tensor* idx = first ? fsdp_contiguous(first) : NULL;
  fsdp_tensor_release(first);
  if (!idx) return NULL;
  return values_at(a, dim, idx, indices);
}

// ---- multinomial -------------------------------------------------------------------------------------
// row (n categories, host float32) -> num_samples draws into out. w is scratch for n doubles.
static int draw_row(const float* row, int64_t n, int64_t r, const fsdp_tensor* probs, int64_t num_samples,
                    int replacement, double* w, int64_t* out) {
  double total = 0;
  int64_t nonzero = 0, last_nonzero = 0;
  for (int64_t j = 0; j < n; j++) {
    double v = row[j];
    CHECK_INT(v >= 0 && v < INFINITY,
              "multinomial: probs (shape %s) has the value %g in row %lld at category %lld (rows 1-based, "
              "categories 0-based); probabilities must be finite and non-negative",
              SH(probs), v, (long long)r + 1, (long long)j);
    w[j] = v;
    total += v;
    if (v > 0) {
      nonzero++;
      last_nonzero = j;
    }
  }
  CHECK_INT(total > 0, "multinomial: row %lld of probs (shape %s) sums to zero", (long long)r + 1, SH(probs));
  CHECK_INT(replacement || num_samples <= nonzero,
            "multinomial: cannot draw %lld samples without replacement from row %lld of probs (shape %s), which has "
            "only %lld non-zero categories",
            (long long)num_samples, (long long)r + 1, SH(probs), (long long)nonzero);
  for (int64_t s = 0; s < num_samples; s++) {
    double u = fsdp_rng_uniform() * total, acc = 0;
    int64_t pick = last_nonzero;  // (if rounding leaves u at the total)
    for (int64_t j = 0; j < n; j++) {
      acc += w[j];
      if (w[j] > 0 && acc > u) {
        pick = j;
        break;
      }
    }
    out[s] = pick;
    if (!replacement) {  // the next draw is from the remaining categories
      w[pick] = 0;
      total = 0;
      for (int64_t j = 0; j < n; j++) {
        total += w[j];
        if (w[j] > 0) last_nonzero = j;
      }
    }
  }
  return 0;
}

fsdp_tensor* fsdp_multinomial(fsdp_tensor* probs, int64_t num_samples, int replacement) {
  CHECK_NULL(probs, "multinomial: probs tensor is NULL");
  if (fsdp_check_float("multinomial", probs)) return NULL;
  CHECK_NULL(probs->ndim == 1 || probs->ndim == 2, "multinomial: probs must be 1-D or 2-D (rows), got shape %s",
             SH(probs));
  int64_t n = probs->shape[probs->ndim - 1], rows = probs->ndim == 2 ? probs->shape[0] : 1;
  CHECK_NULL(n > 0, "multinomial: probs of shape %s has no categories", SH(probs));
  CHECK_NULL(num_samples > 0, "multinomial: num_samples must be at least 1, got %lld", (long long)num_samples);
  CHECK_NULL(replacement || num_samples <= n,
             "multinomial: cannot draw %lld samples without replacement from %lld categories (probs of shape %s)",
             (long long)num_samples, (long long)n, SH(probs));
  int device = fsdp_device_of(probs);
  fsdp_tensor* host = device == FSDP_CPU ? probs : fsdp_copy_to_device(probs, FSDP_CPU);
  fsdp_tensor* p = host ? fsdp_as_contig(host) : NULL;
  if (host != probs) fsdp_tensor_release(host);
  int64_t shape[2] = {rows, num_samples};
  fsdp_tensor* out = p ? fsdp_new(probs->ndim, probs->ndim == 2 ? shape : shape + 1, FSDP_I64, FSDP_CPU) : NULL;
  double* w = out ? malloc((size_t)n * sizeof(double)) : NULL;
  int rc = w ? 0 : -1;
  if (out && !w) fsdp_errorf("multinomial: out of host memory for %lld categories", (long long)n);
  for (int64_t r = 0; rc == 0 && r < rows; r++)
    rc = draw_row(fsdp_f32(p) + r * n, n, r, probs, num_samples, replacement, w, fsdp_i64(out) + r * num_samples);
  free(w);
  fsdp_tensor_release(p);
  if (rc) {
    fsdp_tensor_release(out);
    return NULL;
  }
  if (device == FSDP_CPU) return out;
  fsdp_tensor* moved = fsdp_copy_to_device(out, device);
  fsdp_tensor_release(out);
  return moved;
}
