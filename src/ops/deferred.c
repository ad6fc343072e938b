/*
 * ops/deferred.c -- tensors whose values are not in memory yet (fsdp.h, "deferred values"):
 *
 *   meta         made inside fsdp.meta (fsdp_meta_empty): a storage with a shape and a dtype and no
 *                bytes. The in-place writes done to it -- fill_, add_/mul_ of a number, uniform_ /
 *                normal_, copy_ from a real tensor -- are recorded in order with the view they
 *                wrote (fsdp_meta_record). Replaying them over any element range gives exactly the
 *                values an eager tensor gets from the same calls: the same kernels run on the same
 *                values, and a draw's element j is fsdp_draw_*(key, j) wherever it is computed. So
 *                a rank materialises its piece of a parameter without the rest (parallel/shard.c).
 *   file-backed  made by io/safetensors.c from a file (fsdp.load): its source reads any byte range.
 *                As the source of a copy (load_state_dict into a piece) only the range copied is
 *                read, in chunks; any other first use reads it whole (core's fsdp_check_data).
 *
 *   storage s (meta), dtype D                       replay of [lo, lo + n) into w (n elements, D)
 *   steps: fill 0 on view (4x3 at 0)        ->      w = 0 where the view meets [lo, lo + n)
 *          uniform key k on view (4x3 at 0) ->      w[i] = D(U(k, lo + i))   (j = view's row-major index)
 *          fill 0 on view (1x3 at 6)        ->      w[6 - lo ..] = 0
 */
#include "ops/ops.h"

// elements a chunk of a range read or replay goes through (bounds the temporary buffers: 16 MiB of float32)
#define CHUNK ((int64_t)1 << 22)

int fsdp_tensor_deferred(fsdp_tensor* t) { return t->head.deferred = fsdp_storage_deferred(t->storage); }

fsdp_tensor* fsdp_meta_empty(int ndim, const int64_t* shape, int dtype, int device) {
  CHECK_NULL(dtype >= 0 && dtype < FSDP_NDTYPES, "meta: unknown dtype %d", dtype);
  int64_t nbytes = fsdp_shape_nbytes("meta", ndim, shape, fsdp_dtype_size(dtype));
  if (nbytes < 0) return NULL;
  fsdp_storage* s = fsdp_storage_new_empty((size_t)nbytes, device, fsdp_default_mem_category());
  if (!s) return NULL;
  s->meta = 1;
  fsdp_tensor* t = fsdp_view_storage(s, dtype, ndim, shape, 0);
  fsdp_storage_release(s);  // (the view holds it)
  return t;
}

int fsdp_meta_record(fsdp_tensor* t, int kind, double a, double b, uint64_t key, fsdp_tensor* src) {
  fsdp_storage* s = t->storage;
  fsdp_step st = {.kind = kind, .dtype = t->dtype, .a = a, .b = b, .key = key, .ndim = t->ndim, .offset = t->offset};
  memcpy(st.shape, t->shape, sizeof st.shape);
  memcpy(st.stride, t->stride, sizeof st.stride);
  CHECK_INT((kind == FSDP_STEP_COPY) == (src != NULL), "meta: a copy step needs its source, other steps none");
  if (src) {  // a copy: the values as they will land, t's shape and dtype, on the host
    if (fsdp_check_data("copy_", src)) return -1;
    fsdp_tensor* e = fsdp_expand(src, t->ndim, t->shape);
    CHECK_INT(e, "copy_: cannot copy %s into the meta tensor of shape %s", SH(src), SH(t));
    st.src = fsdp_new(t->ndim, t->shape, t->dtype, FSDP_CPU);
    int rc = st.src ? fsdp_copy_strided(st.src, e) : -1;
    fsdp_tensor_release(e);
    if (rc) {
      fsdp_tensor_release(st.src);
      return -1;
    }
  }
  if (fsdp_grow(&s->steps, &s->steps_cap, s->nsteps + 1, sizeof *s->steps, "meta")) {
    fsdp_tensor_release(st.src);
    return -1;
  }
  s->steps[s->nsteps++] = st;
  fsdp_bump_version(t);
  return 0;
}

// ---- replay ------------------------------------------------------------------------------------------
// one step applied to g, the m elements of w the step's view meets: js[i] is element i's index in
// the view (row-major; NULL: js[i] = j0 + i)
static int apply_step(const fsdp_step* st, fsdp_tensor* g, const int64_t* js, int64_t j0) {
  int64_t m = fsdp_tensor_numel(g);
  switch (st->kind) {
    case FSDP_STEP_FILL: return fsdp_fill_(g, st->a);
    case FSDP_STEP_ADD: return fsdp_add_scalar_(g, st->a);
    case FSDP_STEP_MUL: return fsdp_mul_scalar_(g, st->a);
    case FSDP_STEP_UNIFORM:
    case FSDP_STEP_NORMAL: {
      fsdp_tensor* f = fsdp_new(1, &m, FSDP_F32, FSDP_CPU);
      if (!f) return -1;
      float* p = fsdp_f32(f);
      int normal = st->kind == FSDP_STEP_NORMAL;
      if (!js) fsdp_draw_into(p, m, normal, st->a, st->b, st->key, j0);
      for (int64_t i = 0; js && i < m; i++) fsdp_draw_into(p + i, 1, normal, st->a, st->b, st->key, js[i]);
      int rc = fsdp_copy_strided(g, f);  // (rounded to g's dtype, as an eager draw's write-back)
      fsdp_tensor_release(f);
      return rc;
    }
    case FSDP_STEP_COPY: {
      size_t es = fsdp_dtype_size(g->dtype);
      const char* from = (const char*)fsdp_ptr(st->src);
      char* to = fsdp_ptr(g);
      if (!js) memcpy(to, from + j0 * (int64_t)es, (size_t)m * es);
      for (int64_t i = 0; js && i < m; i++) memcpy(to + i * (int64_t)es, from + js[i] * (int64_t)es, es);
      return 0;
    }
  }
  CHECK_INT(0, "meta: unknown recorded step %d", st->kind);
}

// a recorded step's view: its elements, and whether they are one contiguous run
static int64_t view_numel(const fsdp_step* st) { return fsdp_shape_numel(st->ndim, st->shape); }
static bool view_contiguous(const fsdp_step* st) {
  int64_t s = 1;
  for (int i = st->ndim - 1; i >= 0; i--) {
    if (st->shape[i] != 1 && st->stride[i] != s) return false;
    s *= st->shape[i];
  }
  return true;
}

// the step's writes that land in storage elements [lo, lo + n), applied to w (contiguous, those n elements)
static int replay_step(const fsdp_step* st, int64_t lo, int64_t n, fsdp_tensor* w) {
  int64_t total = view_numel(st);
  if (total == 0) return 0;
  if (view_contiguous(st)) {  // elements [offset, offset + total): one run
    int64_t a = st->offset > lo ? st->offset : lo;
    int64_t b = st->offset + total < lo + n ? st->offset + total : lo + n;
    if (a >= b) return 0;
    int64_t m = b - a, one = 1;
    fsdp_tensor* g = fsdp_new_view(w, 1, &m, &one, w->offset + (a - lo));
    int rc = g ? apply_step(st, g, NULL, a - st->offset) : -1;
    fsdp_tensor_release(g);
    return rc;
  }
  // a strided view (a transpose, a column): its elements in the range, gathered, written, put back
  int64_t* pos = malloc((size_t)total * sizeof *pos);
  int64_t* js = malloc((size_t)total * sizeof *js);
  int64_t m = 0, idx[FSDP_MAX_DIMS] = {0};
  for (int64_t j = 0; pos && js && j < total; j++) {
    int64_t p = st->offset;
    for (int d = 0; d < st->ndim; d++) p += idx[d] * st->stride[d];
    if (p >= lo && p < lo + n) {
      pos[m] = p - lo;
      js[m++] = j;
    }
    for (int d = st->ndim - 1; d >= 0 && ++idx[d] == st->shape[d]; d--) idx[d] = 0;
  }
  int rc = -1;
  fsdp_tensor* g = pos && js ? fsdp_new(1, &m, w->dtype, FSDP_CPU) : NULL;
  if (!pos || !js)
    fsdp_errorf("meta: out of memory replaying a write on a view of shape %s", fsdp_dims_s(st->ndim, st->shape));
  if (g) {
    size_t es = fsdp_dtype_size(w->dtype);
    char *gp = fsdp_ptr(g), *wp = fsdp_ptr(w);
    for (int64_t i = 0; i < m; i++) memcpy(gp + i * (int64_t)es, wp + pos[i] * (int64_t)es, es);
    rc = apply_step(st, g, js, 0);
    for (int64_t i = 0; !rc && i < m; i++) memcpy(wp + pos[i] * (int64_t)es, gp + i * (int64_t)es, es);
  }
  fsdp_tensor_release(g);
  free(pos);
  free(js);
  return rc;
}

// the step the replay starts at: the last one that writes every element of the storage with
// values of its own (a fill, a draw or a copy over the whole, contiguous), which makes the steps
// before it irrelevant (a layer's default init redrawn by the model's own: only the last draw runs)
static int first_live_step(const fsdp_storage* s, int64_t numel) {
  for (int i = s->nsteps - 1; i > 0; i--) {
    const fsdp_step* st = &s->steps[i];
    bool overwrites = st->kind != FSDP_STEP_ADD && st->kind != FSDP_STEP_MUL;
    if (overwrites && st->offset == 0 && view_numel(st) == numel && view_contiguous(st)) return i;
  }
  return 0;
}

// storage elements [lo, lo + n) of s (dtype: w's) into w, a contiguous host tensor of n elements:
// replayed (meta; elements no step wrote are 0) or read (file-backed)
static int fill_range(fsdp_storage* s, int64_t lo, int64_t n, fsdp_tensor* w) {
  size_t es = fsdp_dtype_size(w->dtype);
  if (s->source.read) return s->source.read(s->source.ctx, fsdp_ptr(w), (size_t)n * es, lo * (int64_t)es);
  memset(fsdp_ptr(w), 0, (size_t)n * es);
  for (int i = first_live_step(s, (int64_t)(s->nbytes / es)); i < s->nsteps; i++)
    if (replay_step(&s->steps[i], lo, n, w)) return -1;
  return 0;
}

int fsdp_read_range(const fsdp_tensor* t, int64_t start, int64_t n, fsdp_tensor* dst) {
  int64_t numel = fsdp_tensor_numel(t);
  CHECK_INT(fsdp_tensor_is_contiguous(t) && start >= 0 && n >= 0 && start <= numel - n &&
                fsdp_tensor_is_contiguous(dst) && fsdp_tensor_numel(dst) == n,
            "read_range: elements %lld..%lld of a tensor of shape %s into one of shape %s", (long long)start + 1,
            (long long)(start + n), SH(t), SH(dst));
  fsdp_storage* s = t->storage;
  int64_t one = 1;
  for (int64_t done = 0; done < n;) {
    int64_t m = n - done < CHUNK || s->data ? n - done : CHUNK;
    fsdp_tensor* to = fsdp_new_view(dst, 1, &m, &one, dst->offset + done);
    fsdp_tensor* from = NULL;
    if (s->data) {
      from = fsdp_new_view(t, 1, &m, &one, t->offset + start + done);
    } else {
      CHECK_INT(s->meta || s->source.read, "read_range: tensor of shape %s has no values (a resharded FSDP buffer)",
                SH(t));
      from = fsdp_new(1, &m, t->dtype, FSDP_CPU);
      if (from && fill_range(s, t->offset + start + done, m, from)) {
        fsdp_tensor_release(from);
        from = NULL;
      }
    }
    int rc = to && from ? fsdp_copy_strided(to, from) : -1;
    fsdp_tensor_release(to);
    fsdp_tensor_release(from);
    if (rc) return -1;
    done += m;
  }
  return 0;
}

int fsdp_materialize_(fsdp_tensor* t, int device) {
  fsdp_storage* s = t->storage;
  if (fsdp_tensor_deferred(t) == 0) return 0;
  CHECK_INT(device >= 0 && device < FSDP_NDEVICES && fsdp_backend_for(device), "materialize: no backend for device %d",
            device);
  int64_t es = (int64_t)fsdp_dtype_size(t->dtype), n = (int64_t)s->nbytes / es;
  fsdp_tensor* whole = fsdp_view_storage(s, t->dtype, 1, &n, 0);  // (deferred: reads through the steps/source)
  if (!whole) return -1;
  fsdp_tensor* out = fsdp_new_cat(1, &n, t->dtype, device, s->cat);
  int rc = out ? fsdp_read_range(whole, 0, n, out) : -1;
  fsdp_tensor_release(whole);
  if (rc) {
    fsdp_tensor_release(out);
    return -1;
  }
  // the values move into s itself, so every view of it sees them
  s->device = device;
  s->data = out->storage->data;
  out->storage->data = NULL;  // (its bytes now belong to s: counted once, freed with s)
  fsdp_tensor_release(out);
  fsdp_storage_forget_deferred(s);
  fsdp_bump_version(t);
  fsdp_tensor_deferred(t);
  return 0;
}

// ---- a meta tensor's steps as numbers (FSDP's sync_module_states sends rank 0's) ----------------------
// per step: kind, dtype, a, b (bits), key, ndim, offset, shape[FSDP_MAX_DIMS], stride[FSDP_MAX_DIMS]
#define STEP_WORDS FSDP_META_STEP_WORDS
int64_t fsdp_meta_steps(const fsdp_tensor* t) { return t->storage->meta ? t->storage->nsteps : -1; }
int fsdp_meta_pack(const fsdp_tensor* t, int64_t* out) {
  const fsdp_storage* s = t->storage;
  CHECK_INT(s->meta, "meta: tensor of shape %s is not on meta", SH(t));
  for (int i = 0; i < s->nsteps; i++) {
    const fsdp_step* st = &s->steps[i];
    int64_t* w = out + (int64_t)i * STEP_WORDS;
    w[0] = st->kind;
    w[1] = st->dtype;
    memcpy(&w[2], &st->a, 8);
    memcpy(&w[3], &st->b, 8);
    memcpy(&w[4], &st->key, 8);
    w[5] = st->ndim;
    w[6] = st->offset;
    memcpy(&w[7], st->shape, sizeof st->shape);
    memcpy(&w[7 + FSDP_MAX_DIMS], st->stride, sizeof st->stride);
  }
  return 0;
}
// t's steps replaced by n packed ones; a copy step's values come from srcs[i] (retained), else NULL
int fsdp_meta_unpack(fsdp_tensor* t, int n, const int64_t* in, fsdp_tensor* const* srcs) {
  fsdp_storage* s = t->storage;
  CHECK_INT(s->meta, "meta: tensor of shape %s is not on meta", SH(t));
  fsdp_step* steps = calloc(n > 0 ? (size_t)n : 1, sizeof *steps);
  CHECK_INT(steps, "meta: out of memory");
  int64_t es = (int64_t)fsdp_dtype_size(t->dtype), numel = (int64_t)s->nbytes / es;
  for (int i = 0; i < n; i++) {
    const int64_t* w = in + (int64_t)i * STEP_WORDS;
    fsdp_step* st = &steps[i];
    st->kind = (int)w[0];
    st->dtype = (int)w[1];
    memcpy(&st->a, &w[2], 8);
    memcpy(&st->b, &w[3], 8);
    memcpy(&st->key, &w[4], 8);
    st->ndim = (int)w[5];
    st->offset = w[6];
    memcpy(st->shape, &w[7], sizeof st->shape);
    memcpy(st->stride, &w[7 + FSDP_MAX_DIMS], sizeof st->stride);
    // what arrives must describe a view of this storage (rank 0 built the same shapes: checked before)
    bool ok = st->kind >= FSDP_STEP_FILL && st->kind <= FSDP_STEP_COPY && st->dtype == t->dtype && st->ndim >= 0 &&
              st->ndim <= FSDP_MAX_DIMS && st->offset >= 0 && (st->kind != FSDP_STEP_COPY || (srcs && srcs[i]));
    int64_t hi = st->offset;
    for (int d = 0; ok && d < st->ndim; d++) {
      ok = st->shape[d] >= 0 && st->stride[d] >= 0;
      if (ok && st->shape[d] > 0) hi += (st->shape[d] - 1) * st->stride[d];
    }
    if (!ok || (fsdp_shape_numel(st->ndim, st->shape) > 0 && hi >= numel)) {
      free(steps);
      CHECK_INT(0, "meta: rank 0's recorded step %d does not fit this rank's tensor of shape %s", i + 1, SH(t));
    }
    if (st->kind == FSDP_STEP_COPY) {
      st->src = srcs[i];
      fsdp_tensor_retain(st->src);
    }
  }
  fsdp_storage_forget_deferred(s);  // (this rank's own steps; the storage stays meta with rank 0's)
  s->meta = 1;
  s->steps = steps;
  s->nsteps = s->steps_cap = n;
  return 0;
}
// the values copy step i holds (a borrowed reference), or NULL
fsdp_tensor* fsdp_meta_step_src(const fsdp_tensor* t, int i) {
  const fsdp_storage* s = t->storage;
  return s->meta && i >= 0 && i < s->nsteps ? s->steps[i].src : NULL;
}
