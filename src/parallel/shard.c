/*
 * parallel/shard.c -- an FSDP unit's buffers: layout of the per-parameter chunks, all-gather with
 * copy-out into the full buffers, reshard, gradient copy-in with reduce-scatter, and the two
 * forms a parameter tensor takes (see unit.h for the picture). In its full form a parameter has
 * the dtype its unit gathered in (bfloat16 under mixed precision), in its piece form float32.
 */
#include "parallel/unit.h"

static const int64_t ONE = 1;
// shards and gradient pieces are float32 (the master copy); their element size
#define F32_SIZE fsdp_dtype_size(FSDP_F32)

// dst[0..n) <- src[0..n) between storages, converting dtypes (contiguous runs); across devices
// (CPU offload: host shards, device buffers) through core's copy. 0, or -1 with the error set
static int copy_run(fsdp_storage* dst, int ddt, int64_t doff, fsdp_storage* src, int sdt, int64_t soff, int64_t n) {
  if (n <= 0) return 0;
  if (dst->device != src->device) {
    fsdp_tensor* d = fsdp_view_storage(dst, ddt, 1, &n, doff);
    fsdp_tensor* s = fsdp_view_storage(src, sdt, 1, &n, soff);
    int rc = d && s ? fsdp_copy_strided(d, s) : -1;
    fsdp_tensor_release(d);
    fsdp_tensor_release(s);
    return rc;
  }
  const fsdp_elem_kernels* k = fsdp_backend_for(dst->device)->elem;
  k->copy_strided((char*)dst->data + doff * (int64_t)fsdp_dtype_size(ddt), ddt,
                  (char*)src->data + soff * (int64_t)fsdp_dtype_size(sdt), sdt, 1, &n, &ONE);
  return 0;
}
// the ranks the unit gathers over: its shard group under hybrid sharding, else the world
static int shard_group(const fsdp_unit* u) {
  return u->opts.sharding == FSDP_HYBRID_SHARD ? FSDP_GROUP_SHARD : FSDP_GROUP_WORLD;
}
// where the unit's shards and gradient pieces live: its parameters' device, or the CPU under offload
static int shard_device(const fsdp_unit* u) { return u->opts.offload ? FSDP_CPU : u->device; }
static void zero_run(fsdp_storage* s, int dt, int64_t off, int64_t n) {
  if (n <= 0) return;
  fsdp_backend_for(s->device)->elem->fill((char*)s->data + off * (int64_t)fsdp_dtype_size(dt), dt, n, 0.0);
}
// elements of parameter p that rank r owns
static int64_t piece_len(const unit_param* p, int r) {
  int64_t n = p->numel - (int64_t)r * p->chunk;
  return n < 0 ? 0 : (n > p->chunk ? p->chunk : n);
}

// ---- the two forms of a parameter tensor ---------------------------------------------------------
static void point_at(fsdp_tensor* t, fsdp_storage* s) {
  if (t->storage == s) return;
  s->refcount++;
  fsdp_storage_release(t->storage);
  t->storage = s;
}
void fsdp_shard_set_form(fsdp_unit* u, int full) {
  for (int i = 0; i < u->n; i++) {
    unit_param* p = &u->p[i];
    fsdp_tensor* t = p->t;
    unit_group* g = &u->g[p->group];
    t->head.piece = !full && p->len != p->numel;
    if (full || p->len == p->numel) {  // full view, or a piece that is the whole parameter
      point_at(t, full ? g->full : g->shard);
      t->dtype = full ? u->full_dtype : FSDP_F32;
      t->ndim = p->ndim;
      memcpy(t->shape, p->shape, sizeof t->shape);
      t->offset = full ? p->full_off : p->shard_off;
    } else {
      point_at(t, g->shard);
      t->dtype = FSDP_F32;
      t->ndim = 1;
      t->shape[0] = p->len;
      t->offset = p->shard_off;
    }
    fsdp_contiguous_strides(t->ndim, t->shape, t->stride);
  }
}

int fsdp_shard_requires_relayout(const fsdp_unit* u) {
  for (int i = 0; i < u->n; i++)
    if ((u->p[i].t->requires_grad ? 0 : 1) != u->p[i].group) return 1;
  return 0;
}

// ---- layout -----------------------------------------------------------------------------------------
// Builds fresh buffers for the current parameter list and groups. A parameter either belongs to
// this unit already (its chunk is copied from the old shard buffer: no communication) or is a
// standalone tensor (its piece is cut from its full values). The unit must not be gathered.
int fsdp_shard_layout(fsdp_unit* u) {
  unit_group old[2];
  memcpy(old, u->g, sizeof old);
  int old_group[u->n > 0 ? u->n : 1];
  int64_t old_off[u->n > 0 ? u->n : 1];
  for (int i = 0; i < u->n; i++) {
    old_group[i] = u->p[i].group;
    old_off[i] = u->p[i].shard_off;
  }

  memset(u->g, 0, sizeof u->g);
  for (int i = 0; i < u->n; i++) {
    unit_param* p = &u->p[i];
    p->group = p->t->requires_grad ? 0 : 1;
    p->chunk = (p->numel + u->W - 1) / u->W;
    p->start = (int64_t)u->rank * p->chunk;
    if (p->start > p->numel) p->start = p->numel;
    p->len = piece_len(p, u->rank);
    unit_group* g = &u->g[p->group];
    p->shard_off = g->shard_numel;
    p->full_off = g->full_numel;
    g->shard_numel += p->chunk;
    g->full_numel += p->numel;
  }
  for (int k = 0; k < 2; k++) {
    unit_group* g = &u->g[k];
    g->shard = fsdp_storage_new((size_t)g->shard_numel * F32_SIZE, shard_device(u), FSDP_MEM_PARAMS);
    if (!g->shard) return -1;
    if (u->separate_full) {
      g->full = fsdp_storage_new_empty((size_t)g->full_numel * F32_SIZE, u->device, FSDP_MEM_PARAMS);
      if (!g->full) return -1;
      g->full->owner = u;
    } else {
      g->full = g->shard;
      g->shard->refcount++;
    }
  }
  for (int i = 0; i < u->n; i++) {
    unit_param* p = &u->p[i];
    fsdp_storage* dst = u->g[p->group].shard;
    if (p->t->owner == u) {  // moved between groups or re-laid out: the chunk travels as is
      copy_run(dst, FSDP_F32, p->shard_off, old[old_group[i]].shard, FSDP_F32, old_off[i], p->chunk);
    } else {  // standalone: cut this rank's piece out of the full values (replayed or read when deferred)
      fsdp_tensor* full = p->t->storage->data ? fsdp_as_contig(p->t) : p->t;
      if (full == p->t) fsdp_tensor_retain(full);
      fsdp_tensor* piece = fsdp_view_storage(dst, FSDP_F32, 1, &p->len, p->shard_off);
      int rc = full && piece ? fsdp_read_range(full, p->start, p->len, piece) : -1;
      fsdp_tensor_release(piece);
      fsdp_tensor_release(full);
      if (rc) return -1;
      zero_run(dst, FSDP_F32, p->shard_off + p->len, p->chunk - p->len);
      p->t->owner = u;
    }
    p->t->owner_index = i;
  }
  u->gathered = !u->separate_full;
  u->full_dtype = FSDP_F32;  // (a unit without a separate full buffer is gathered in float32 always)
  fsdp_shard_set_form(u, 0);
  for (int k = 0; k < 2; k++) {
    fsdp_storage_release(old[k].shard);
    fsdp_storage_release(old[k].full);
  }
  return 0;
}

// Parameter i leaves the unit as a standalone float32 tensor holding its full values. The unit must
// be gathered in float32; the caller re-lays out the unit afterwards.
int fsdp_shard_release_param(fsdp_unit* u, int i) {
  unit_param* p = &u->p[i];
  fsdp_storage* s = fsdp_storage_new((size_t)p->numel * F32_SIZE, u->device, FSDP_MEM_PARAMS);
  if (!s) return -1;
  copy_run(s, FSDP_F32, 0, u->g[p->group].full, u->full_dtype, p->full_off, p->numel);
  fsdp_tensor* t = p->t;
  point_at(t, s);
  fsdp_storage_release(s);
  t->ndim = p->ndim;
  memcpy(t->shape, p->shape, sizeof t->shape);
  fsdp_contiguous_strides(t->ndim, t->shape, t->stride);
  t->offset = 0;
  t->dtype = FSDP_F32;
  t->owner = NULL;
  t->owner_index = 0;
  t->head.piece = 0;
  return 0;
}

// ---- all-gather ---------------------------------------------------------------------------------------
static void gather_cleanup(unit_group* g) {
  if (g->gather) {
    fsdp_work_free(g->gather);
    g->gather = NULL;
  }
  fsdp_tensor_release(g->gather_send);
  fsdp_tensor_release(g->gather_recv);
  g->gather_send = g->gather_recv = NULL;
}

// (a replicated unit -- NO_SHARD, layout world 1 -- holds every value in its shard: its full buffer
// is a converted copy, made in gather_finish without a collective)
int fsdp_shard_gather_start(fsdp_unit* u, int dtype) {
  if (u->gathered || u->W == 1) return 0;
  for (int k = 0; k < 2; k++) {
    unit_group* g = &u->g[k];
    if (g->gather || g->full_numel == 0) continue;
    int64_t S = g->shard_numel, WS = S * u->W;
    if (dtype == FSDP_F32) {
      g->gather_send = fsdp_view_storage(g->shard, FSDP_F32, 1, &S, 0);
    } else {  // mixed precision: gather in the low-precision dtype (cast where the shard is)
      g->gather_send = fsdp_new_cat(1, &S, dtype, shard_device(u), FSDP_MEM_COMM);
      if (g->gather_send) copy_run(g->gather_send->storage, dtype, 0, g->shard, FSDP_F32, 0, S);
    }
    g->gather_recv = fsdp_new_cat(1, &WS, dtype, u->device, FSDP_MEM_COMM);
    if (g->gather_send && g->gather_recv)
      g->gather = fsdp_all_gather_group(g->gather_recv, g->gather_send, shard_group(u), u->path);
    if (!g->gather) {
      gather_cleanup(g);
      return -1;
    }
  }
  return 0;
}

int fsdp_shard_gather_finish(fsdp_unit* u, int dtype) {
  // gathered, or a prefetch in flight, in the other dtype (summon_full_params's float32 against the
  // compute dtype): drop it and gather again
  int other = u->separate_full &&
              ((u->gathered && u->full_dtype != dtype) || (u->g[0].gather && u->g[0].gather_recv->dtype != dtype) ||
               (u->g[1].gather && u->g[1].gather_recv->dtype != dtype));
  if (other && fsdp_shard_reshard(u, 0)) return -1;
  if (u->gathered) {
    fsdp_shard_set_form(u, 1);
    return 0;
  }
  if (fsdp_shard_gather_start(u, dtype)) return -1;
  for (int k = 0; k < 2; k++) {
    unit_group* g = &u->g[k];
    if (g->full_numel == 0) continue;
    int rc = u->W == 1 ? 0 : fsdp_work_wait(g->gather);
    g->full->nbytes = (size_t)g->full_numel * fsdp_dtype_size(dtype);  // (its data is absent: resharded)
    if (!rc) rc = fsdp_storage_ensure_data(g->full);
    if (rc) {
      char msg[2048];
      snprintf(msg, sizeof msg, "%s", fsdp_last_error());
      gather_cleanup(g);
      fsdp_errorf("FSDP unit '%s': all-gather of its parameters failed: %s", u->path, msg);
      return -1;
    }
    if (u->W == 1) {  // the shard is the group's full layout
      if (copy_run(g->full, dtype, 0, g->shard, FSDP_F32, 0, g->full_numel)) return -1;
      continue;
    }
    // copy-out: rank r's chunk of parameter p lands at p's full offset + r * chunk
    fsdp_storage* recv = g->gather_recv->storage;
    for (int r = 0; r < u->W; r++)
      for (int i = 0; i < u->n; i++) {
        unit_param* p = &u->p[i];
        if (p->group != k) continue;
        copy_run(g->full, dtype, p->full_off + (int64_t)r * p->chunk, recv, dtype,
                 (int64_t)r * g->shard_numel + p->shard_off, piece_len(p, r));
      }
    gather_cleanup(g);
  }
  u->gathered = 1;
  u->full_dtype = dtype;
  fsdp_shard_set_form(u, 1);
  return 0;
}

int fsdp_shard_reshard(fsdp_unit* u, int writeback) {
  for (int k = 0; k < 2; k++)
    if (u->g[k].gather) {  // a prefetch nobody used: complete it so ranks stay in step, drop it
      int rc = fsdp_work_wait(u->g[k].gather);
      gather_cleanup(&u->g[k]);
      if (rc) return -1;
    }
  if (!u->separate_full) {
    fsdp_shard_set_form(u, 0);
    return 0;
  }
  if (u->gathered && writeback)
    for (int i = 0; i < u->n; i++) {
      unit_param* p = &u->p[i];
      if (copy_run(u->g[p->group].shard, FSDP_F32, p->shard_off, u->g[p->group].full, u->full_dtype,
                   p->full_off + p->start, p->len))
        return -1;
    }
  for (int k = 0; k < 2; k++) fsdp_storage_drop_data(u->g[k].full);
  u->gathered = 0;
  fsdp_shard_set_form(u, 0);
  return 0;
}

// ---- gradient reduction -------------------------------------------------------------------------------
// Copies the trainable parameters' full gradients into a rank-major buffer, releases them and
// issues the reduce-scatter (all-reduce for NO_SHARD) that averages over ranks. Under offload the
// pieces land in host memory: the reduce-scatter's result crosses to it (comm.c), a replicated
// unit's all-reduced buffer is copied there at finish.
int fsdp_shard_reduce_start(fsdp_unit* u) {
  unit_group* g = &u->g[0];
  int64_t S = g->shard_numel, WS = S * u->W;
  int world = fsdp_comm_world_size();
  int direct = u->W == 1 && !u->opts.offload;  // the reduced result lands in the send buffer itself
  u->reduce_send = fsdp_new_cat(1, &WS, FSDP_F32, u->device, direct ? FSDP_MEM_GRADS : FSDP_MEM_COMM);
  if (!u->reduce_send) return -1;
  fsdp_storage* send = u->reduce_send->storage;
  for (int i = 0; i < u->n; i++) {
    unit_param* p = &u->p[i];
    if (p->group != 0) continue;
    fsdp_tensor* gr = p->got_grad || grad_is_local(p) ? p->t->grad : NULL;
    fsdp_tensor* gc = gr ? fsdp_as_contig(gr) : NULL;
    if (gr && !gc) return -1;
    for (int r = 0; r < u->W; r++) {
      int64_t off = (int64_t)r * S + p->shard_off, n = piece_len(p, r);
      if (gc) copy_run(send, FSDP_F32, off, gc->storage, FSDP_F32, gc->offset + (int64_t)r * p->chunk, n);
      else zero_run(send, FSDP_F32, off, n);
      zero_run(send, FSDP_F32, off + n, p->chunk - n);
    }
    if (gr) p->got_grad = 1;
    fsdp_tensor_release(gc);
    fsdp_tensor_set_grad(p->t, NULL);  // the full gradient is no longer needed
    p->grad_is_local = 0;
  }
  if (direct) {
    u->reduce_recv = u->reduce_send;
    u->reduce_send = NULL;
    u->reduce = world > 1 ? fsdp_all_reduce(u->reduce_recv, FSDP_REDUCE_AVG, u->path) : NULL;
    if (world > 1 && !u->reduce) return -1;
  } else {
    u->reduce_recv = fsdp_new_cat(1, &S, FSDP_F32, shard_device(u), FSDP_MEM_GRADS);
    if (!u->reduce_recv) return -1;
    if (u->W == 1)  // offloaded and replicated: averaged in place on the device, copied at finish
      u->reduce = world > 1 ? fsdp_all_reduce(u->reduce_send, FSDP_REDUCE_AVG, u->path) : NULL;
    else  // (hybrid: within the shard group, then over the replicas)
      u->reduce = fsdp_reduce_scatter_group(u->reduce_recv, u->reduce_send, FSDP_REDUCE_AVG,
                                            shard_group(u) ? FSDP_GROUP_HYBRID : FSDP_GROUP_WORLD, u->path);
    if (!u->reduce && (u->W > 1 || world > 1)) return -1;
  }
  u->reduced_pending = 1;
  return 0;
}

// Waits for the reduction; each trainable parameter that got a gradient gets the piece of the
// averaged gradient (plus the gradient it held before this backward) as its .grad.
int fsdp_shard_reduce_finish(fsdp_unit* u) {
  if (!u->reduced_pending) return 0;
  int rc = u->reduce ? fsdp_work_wait(u->reduce) : 0;
  if (u->reduce) fsdp_work_free(u->reduce);
  u->reduce = NULL;
  if (!rc && u->W == 1 && u->reduce_send) rc = fsdp_copy_strided(u->reduce_recv, u->reduce_send);  // (offload)
  fsdp_tensor_release(u->reduce_send);
  u->reduce_send = NULL;
  u->reduced_pending = 0;
  fsdp_tensor* recv = u->reduce_recv;
  u->reduce_recv = NULL;
  if (rc) {
    char msg[2048];
    snprintf(msg, sizeof msg, "%s", fsdp_last_error());
    fsdp_tensor_release(recv);
    fsdp_errorf("FSDP unit '%s': gradient reduction failed: %s", u->path, msg);
    return -1;
  }
  const fsdp_elem_kernels* k = fsdp_backend_of(recv)->elem;
  for (int i = 0; i < u->n && !rc; i++) {
    unit_param* p = &u->p[i];
    if (p->group != 0 || !p->got_grad) continue;
    fsdp_tensor* piece = p->len == p->numel
                             ? fsdp_view_storage(recv->storage, FSDP_F32, p->ndim, p->shape, p->shard_off)
                             : fsdp_view_storage(recv->storage, FSDP_F32, 1, &p->len, p->shard_off);
    if (!piece) {
      rc = -1;
      break;
    }
    if (p->stash) {
      k->axpy(fsdp_f32(piece), p->len, fsdp_f32(p->stash), p->len, 1, p->len, 1.0f);
      fsdp_tensor_release(p->stash);
      p->stash = NULL;
    }
    fsdp_tensor_release(p->t->grad);
    p->t->grad = piece;
  }
  fsdp_tensor_release(recv);
  return rc;
}
