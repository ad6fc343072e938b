/*
 * parallel/sched.c -- the FSDP unit lifecycle, driven by the Lua wrapper (forward) and by autograd engine
 * events (backward). One training step, for each unit:
 *
 *   pre_forward     gather (or finish a prefetch); parameters take their full form, in the unit's
 *                   param dtype (mixed precision: bfloat16 tensors; the Lua wrapper casts the
 *                   unit's float inputs to it); the first unit entered at depth 0 is the root of
 *                   this forward pass
 *   post_forward    reshard unless the policy keeps the parameters (the root, SHARD_GRAD_OP)
 *   mark_output     outputs pass through an identity node whose backward runs pre_backward
 *   pre_backward    gather again; set aside the .grad pieces from earlier steps; prefetch the
 *                   unit that ran before this one in forward
 *   GRAD_READY      when every trainable parameter that is in this backward's graph has its
 *                   gradient: post_backward = reduce-scatter (async) and reshard
 *   end of backward a callback queued at every BACKWARD_BEGIN (whether or not the root owns
 *                   parameters, whether or not any hook fired): finishes units whose gradients
 *                   came in but were not reduced, waits for every reduction, assigns the .grad
 *                   pieces, reshards whatever is still gathered, and returns every unit to IDLE.
 *
 * Nothing here assumes a hook fires: a frozen unit, a unit whose output does not reach the loss,
 * a unit run twice, a unit whose inputs need no grad all end up in the end-of-backward catch-all,
 * and a backward node that needs a resharded buffer re-gathers it (materialize, core's hook).
 * Collectives are issued in the same order on every rank: forward order, engine order, then
 * unit creation order in the catch-all.
 */
#include "parallel/unit.h"
#include "ops/ops.h"
#include "parallel/comm.h"

fsdp_unit** fsdp_units;
int fsdp_n_units;
static int g_cap_units;
static int g_depth;          // nesting depth of unit forwards
static fsdp_unit** g_order;  // units in the order their forward ran in this pass
static int g_order_n, g_order_cap;
static fsdp_unit** g_prev_order;  // ... and in the previous pass (forward prefetch)
static int g_prev_order_n, g_prev_cap;
static int g_installed;
static void sched_install(void);
static int64_t g_finished_pass = -1;
// where training is, carried by every collective (parallel/comm.h: a rank out of step is named there)
static int64_t g_train_fwd, g_train_bwd;  // training forwards begun (grad enabled), backwards with units done
static int g_phase;                       // FSDP_PHASE_*
static void set_phase(int phase) {
  g_phase = phase;
  fsdp_comm_set_step(g_train_fwd, g_train_bwd, phase);
}

static const char* state_names[] = {"IDLE", "FORWARD", "FORWARD_DONE", "BACKWARD", "BACKWARD_DONE"};
const char* fsdp_unit_state_name(int s) { return s >= 0 && s <= 4 ? state_names[s] : "?"; }
const char* fsdp_unit_path(const fsdp_unit* u) { return u->path; }
int fsdp_unit_set_path(fsdp_unit* u, const char* path) {
  free(u->path);
  u->path = strdup(path ? path : "");
  return 0;
}
int fsdp_unit_state(const fsdp_unit* u) { return u->state; }
int fsdp_unit_num_params(const fsdp_unit* u) { return u->n; }
fsdp_tensor* fsdp_unit_param(fsdp_unit* u, int i) { return i >= 0 && i < u->n ? u->p[i].t : NULL; }
int fsdp_unit_world_size(const fsdp_unit* u) { return u->W; }
int fsdp_unit_last_pass(const fsdp_unit* u, int* is_root, int* in_backward) {
  *is_root = u->is_root;
  *in_backward = u->has_bw_node;
  return u->order_index >= 0;
}
fsdp_unit* fsdp_param_unit(const fsdp_tensor* p) { return p->owner; }

// A parameter answers its full shape in either form, as FSDP2's parameters do (the Lua methods
// shape, size, dim and numel ask here); any other tensor answers its own.
static const unit_param* param_of(const fsdp_tensor* t) {
  return t->owner ? &((const fsdp_unit*)t->owner)->p[t->owner_index] : NULL;
}
int fsdp_param_full_shape(const fsdp_tensor* t, int64_t* shape) {
  const unit_param* p = param_of(t);
  int nd = p ? p->ndim : t->ndim;
  memcpy(shape, p ? p->shape : t->shape, nd * sizeof(int64_t));
  return nd;
}
int fsdp_param_full_ndim(const fsdp_tensor* t) {
  const unit_param* p = param_of(t);
  return p ? p->ndim : t->ndim;
}
int64_t fsdp_param_full_numel(const fsdp_tensor* t) {
  const unit_param* p = param_of(t);
  return p ? p->numel : fsdp_tensor_numel(t);
}
int fsdp_param_piece(const fsdp_tensor* t, int64_t* start, int64_t* length) {
  if (!t->head.piece) return 0;
  *start = param_of(t)->start;
  *length = param_of(t)->len;
  return 1;
}
int fsdp_param_shard(const fsdp_tensor* t, int64_t* start, int64_t* length) {
  const unit_param* p = param_of(t);
  if (!p) return 0;
  *start = p->start;
  *length = p->len;
  return 1;
}

const char* fsdp_param_name(const fsdp_tensor* t) { return t->owner ? param_of(t)->name : ""; }
const char* fsdp_param_unit_path(const fsdp_tensor* t) { return t->owner ? ((const fsdp_unit*)t->owner)->path : ""; }
int fsdp_param_grad_unreduced(const fsdp_tensor* t) {
  return t->owner && fsdp_comm_world_size() > 1 && grad_is_local(param_of(t));
}

int fsdp_unit_param_layout(const fsdp_unit* u, int i, int64_t* numel, int64_t* chunk, int64_t* start, int64_t* length) {
  CHECK_INT(i >= 0 && i < u->n, "FSDP unit '%s': no parameter %d", u->path, i);
  const unit_param* p = &u->p[i];
  *numel = p->numel;
  *chunk = p->chunk;
  *start = p->start;
  *length = p->len;
  return 0;
}

// ---- creation and parameters ------------------------------------------------------------------------
fsdp_unit* fsdp_unit_new(const char* path, const fsdp_unit_options* opts) {
  if (!fsdp_comm_is_initialized() && fsdp_comm_init(NULL)) return NULL;
  CHECK_NULL(opts->sharding >= 0 && opts->sharding <= 3, "fsdp.wrap '%s': unknown sharding strategy %d", path,
             opts->sharding);
  // hybrid: the groups (collective, the first time; the same size for every hybrid unit)
  if (opts->sharding == FSDP_HYBRID_SHARD && fsdp_comm_set_groups(opts->group_size)) {
    char msg[1024];
    snprintf(msg, sizeof msg, "%s", fsdp_last_error());
    CHECK_NULL(0, "fsdp.wrap '%s': %s", path, msg);
  }
  CHECK_NULL(opts->param_dtype == FSDP_F32 || opts->param_dtype == FSDP_BF16 || opts->param_dtype == FSDP_F16,
             "fsdp.wrap '%s': mixed precision param dtype must be float32, bfloat16 or float16, got %s", path,
             fsdp_dtype_name(opts->param_dtype));
  CHECK_NULL(opts->reduce_dtype == FSDP_F32, "fsdp.wrap '%s': gradients are reduced in float32 (got reduce dtype %s)",
             path, fsdp_dtype_name(opts->reduce_dtype));
  fsdp_unit* u = calloc(1, sizeof *u);
  CHECK_NULL(u, "fsdp.wrap: out of memory");
  u->path = strdup(path ? path : "");
  u->opts = *opts;
  // the ranks a unit is sharded over: none, the shard group (hybrid), or all
  u->W = opts->sharding == FSDP_NO_SHARD       ? 1
         : opts->sharding == FSDP_HYBRID_SHARD ? fsdp_comm_group_size(FSDP_GROUP_SHARD)
                                               : fsdp_comm_world_size();
  u->rank = u->W > 1 ? fsdp_comm_group_rank(opts->sharding == FSDP_HYBRID_SHARD ? FSDP_GROUP_SHARD : 0) : 0;
  u->separate_full = u->W > 1 || opts->param_dtype != FSDP_F32 || opts->offload;
  u->sync_grads = 1;
  u->order_index = -1;
  u->pass = -1;
  if (fsdp_grow(&fsdp_units, &g_cap_units, fsdp_n_units + 1, sizeof *fsdp_units, "fsdp.wrap") ||
      fsdp_shard_layout(u)) {  // empty buffers
    free(u->path);
    free(u);
    return NULL;
  }
  fsdp_units[fsdp_n_units++] = u;
  sched_install();
  return u;
}

// every parameter of u becomes a standalone full tensor again (collective: gathers u, in float32)
static int release_all(fsdp_unit* u) {
  if (u->n == 0) return 0;
  if (fsdp_shard_gather_finish(u, FSDP_F32)) return -1;
  for (int i = 0; i < u->n; i++) {
    if (fsdp_shard_release_param(u, i)) return -1;
    fsdp_tensor_release(u->p[i].stash);
  }
  return 0;
}

static void free_params(fsdp_unit* u) {
  for (int i = 0; i < u->n; i++) {
    fsdp_tensor_release(u->p[i].t);
    free(u->p[i].name);
  }
  free(u->p);
  u->p = NULL;
  u->n = 0;
}

// lays out u with `n` standalone parameters (taking refs)
static int adopt(fsdp_unit* u, int n, fsdp_tensor** ts, const char* const* names) {
  u->p = calloc(n > 0 ? n : 1, sizeof *u->p);
  u->n = n;
  for (int i = 0; i < n; i++) {
    unit_param* p = &u->p[i];
    p->t = ts[i];
    ts[i]->refcount++;
    p->name = strdup(names && names[i] ? names[i] : "?");
    p->ndim = ts[i]->ndim;
    memcpy(p->shape, ts[i]->shape, sizeof p->shape);
    p->numel = fsdp_tensor_numel(ts[i]);
    p->rg_at_forward = ts[i]->requires_grad;
  }
  return fsdp_shard_layout(u);
}

static int bcast_i64(int64_t* v, int64_t n, const char* tag) {
  fsdp_tensor* b = fsdp_new(1, &n, FSDP_I64, FSDP_CPU);
  if (!b) return -1;
  memcpy(fsdp_i64(b), v, (size_t)n * sizeof *v);
  int rc = fsdp_work_finish(fsdp_broadcast(b, 0, tag));
  if (!rc) memcpy(v, fsdp_i64(b), (size_t)n * sizeof *v);
  fsdp_tensor_release(b);
  return rc;
}
// Parameter t takes rank 0's values (sync_module_states). Real values are broadcast (a meta t
// first gets storage for them). A parameter on meta on rank 0 has no values to send: its recorded
// initialisation (ops/deferred.c) is, a few numbers, and every rank replays it for its own piece
// when the unit lays out its shards -- the same values at any world size, and no rank holds the whole.
static int sync_param(fsdp_tensor* t, const char* tag) {
  // what every rank learns first: whether rank 0 built t on meta, and how many ranks did not
  int64_t one = 2;
  fsdp_tensor* how = fsdp_new(1, &one, FSDP_F32, FSDP_CPU);
  if (!how) return -1;
  int meta = t->storage->meta;
  fsdp_f32(how)[0] = fsdp_comm_rank() == 0 && meta;
  fsdp_f32(how)[1] = !meta;
  int rc = fsdp_work_finish(fsdp_all_reduce(how, FSDP_REDUCE_SUM, tag));
  int root_meta = rc ? 0 : fsdp_f32(how)[0] > 0, eager_ranks = rc ? 0 : (int)fsdp_f32(how)[1];
  fsdp_tensor_release(how);
  if (rc) return -1;
  if (!root_meta) {
    if (meta && fsdp_materialize_(t, fsdp_device_of(t))) return -1;
    return fsdp_work_finish(fsdp_broadcast(t, 0, tag));
  }
  CHECK_INT(eager_ranks == 0,
            "fsdp.wrap '%s': rank 0 built this parameter on meta (fsdp.meta) and %d other rank(s) eagerly: build the "
            "model the same way on every rank (or eagerly on rank 0 only: sync_module_states sends its values)",
            tag, eager_ranks);
  int64_t head = fsdp_meta_steps(t);  // rank 0's count of steps
  if (bcast_i64(&head, 1, tag)) return -1;
  int n = (int)head;
  int64_t words = (int64_t)n * FSDP_META_STEP_WORDS;
  int64_t* packed = malloc((size_t)(words > 0 ? words : 1) * sizeof *packed);
  fsdp_tensor** srcs = calloc(n > 0 ? (size_t)n : 1, sizeof *srcs);
  rc = packed && srcs ? 0 : -1;
  if (rc) fsdp_errorf("fsdp.wrap '%s': out of memory", tag);
  if (!rc && fsdp_comm_rank() == 0) rc = fsdp_meta_pack(t, packed);
  if (!rc && words > 0) rc = bcast_i64(packed, words, tag);
  for (int i = 0; !rc && i < n; i++) {  // the values of rank 0's copies, in a tensor of their shape
    if (packed[(int64_t)i * FSDP_META_STEP_WORDS] != FSDP_STEP_COPY) continue;
    const int64_t* w = packed + (int64_t)i * FSDP_META_STEP_WORDS;
    srcs[i] = fsdp_comm_rank() == 0 ? fsdp_meta_step_src(t, i) : fsdp_new((int)w[5], w + 7, (int)w[1], FSDP_CPU);
    if (fsdp_comm_rank() == 0) fsdp_tensor_retain(srcs[i]);
    rc = srcs[i] ? fsdp_work_finish(fsdp_broadcast(srcs[i], 0, tag)) : -1;
  }
  if (!rc && fsdp_comm_rank() != 0) rc = fsdp_meta_unpack(t, n, packed, srcs);
  for (int i = 0; srcs && i < n; i++) fsdp_tensor_release(srcs[i]);
  free(srcs);
  free(packed);
  return rc;
}

int fsdp_unit_set_params(fsdp_unit* u, int n, fsdp_tensor** ts, const char** names) {
  CHECK_INT(u->state == FSDP_UNIT_IDLE, "FSDP unit '%s': parameters can only change while it is idle (state %s)",
            u->path, state_names[u->state]);
  for (int i = 0; i < n; i++) {
    fsdp_tensor* t = ts[i];
    const char* nm = names && names[i] ? names[i] : "?";
    CHECK_INT(t->dtype == FSDP_F32,
              "fsdp.wrap '%s': parameter '%s' is %s; FSDP shards float32 parameters (to compute in bf16, keep them "
              "float32 and pass mixed_precision = {param = \"bf16\"})",
              u->path, nm, DT(t));
    CHECK_INT(!t->grad_fn, "fsdp.wrap '%s': parameter '%s' is not a leaf tensor", u->path, nm);
    CHECK_INT(fsdp_device_of(t) == fsdp_device_of(ts[0]), "fsdp.wrap '%s': parameter '%s' is on %s, '%s' on %s",
              u->path, nm, fsdp_device_name(fsdp_device_of(t)), names && names[0] ? names[0] : "?",
              fsdp_device_name(fsdp_device_of(ts[0])));
    for (int j = 0; j < i; j++) CHECK_INT(ts[j] != t, "fsdp.wrap '%s': parameter '%s' is listed twice", u->path, nm);
  }
  CHECK_INT(!u->opts.offload || n == 0 || fsdp_device_of(ts[0]) != FSDP_CPU,
            "fsdp.wrap '%s': offload keeps the shards on the CPU while the unit computes on a GPU, but its "
            "parameters are on the cpu; move the model to the GPU first (model:to(\"cuda\"))",
            u->path);
  // take every parameter home: ours and those another unit owns become standalone first
  if (release_all(u)) return -1;
  if (n > 0) u->device = fsdp_device_of(ts[0]);  // (a unit without parameters keeps its default)
  fsdp_tensor** keep = NULL;
  int keep_cap = 0;
  for (int i = 0; i < n; i++) {
    fsdp_unit* v = ts[i]->owner;
    if (!v || v == u) continue;
    CHECK_INT(v->state == FSDP_UNIT_IDLE, "fsdp.wrap '%s': parameter '%s' belongs to unit '%s', which is busy (%s)",
              u->path, names ? names[i] : "?", v->path, state_names[v->state]);
    if (release_all(v)) return -1;
    // v keeps the parameters not moving to u
    int m = 0;
    // knames are copies: free_params(v) frees v's names
    char** knames =
        fsdp_grow(&keep, &keep_cap, v->n + 1, sizeof *keep, "fsdp.wrap") ? NULL : malloc((v->n + 1) * sizeof *knames);
    if (!knames) {
      free(keep);
      fsdp_errorf("fsdp.wrap '%s': out of memory", u->path);
      return -1;
    }
    for (int a = 0; a < v->n; a++) {
      int moving = 0;
      for (int b = 0; b < n; b++) moving |= ts[b] == v->p[a].t;
      if (!moving) {
        knames[m] = strdup(v->p[a].name);
        keep[m++] = v->p[a].t;
      }
    }
    for (int a = 0; a < m; a++) keep[a]->refcount++;
    free_params(v);
    int rc = adopt(v, m, keep, (const char* const*)knames);
    for (int a = 0; a < m; a++) {
      fsdp_tensor_release(keep[a]);
      free(knames[a]);
    }
    free(knames);
    if (rc) {
      free(keep);
      return -1;
    }
  }
  free(keep);
  free_params(u);
  // every rank starts from rank 0's values
  // every rank's parameters must have the same shapes and dtypes: broadcasting rank 0's values
  // checks that on the way (each collective's agreement compares shapes), else a shape check does
  if (fsdp_comm_world_size() > 1)
    for (int i = 0; i < n; i++) {
      char tag[256];  // the parameter's name makes a shape mismatch between ranks self-explanatory
      snprintf(tag, sizeof tag, "%s: %s", u->path, names && names[i] ? names[i] : "?");
      if (u->opts.sync_module_states ? sync_param(ts[i], tag) : fsdp_work_finish(fsdp_comm_agree_shape(ts[i], tag)))
        return -1;
    }
  return adopt(u, n, ts, names);
}

// ---- forward -----------------------------------------------------------------------------------------------
// Every unit gives its gathered buffers back at the end of a step (fsdp_shard_reshard): a unit
// whose parameters are the shards themselves -- no separate full buffer -- only returns to the
// piece form, which for it is the full view; a NO_SHARD unit under mixed precision drops its
// bfloat16 copy, which the optimizer's step makes stale.

static int reshard_after_forward(const fsdp_unit* u) {
  if (u->opts.reshard_after_forward >= 0) return u->opts.reshard_after_forward;
  return (u->opts.sharding == FSDP_FULL_SHARD || u->opts.sharding == FSDP_HYBRID_SHARD) && !u->is_root;
}

static int64_t g_inflight_gathers(void) {
  int64_t n = 0;
  for (int i = 0; i < fsdp_n_units; i++)
    n += (fsdp_units[i]->g[0].gather != NULL) || (fsdp_units[i]->g[1].gather != NULL);
  return n;
}

static void prefetch(fsdp_unit* v) {
  if (!v || v->gathered || v->g[0].gather || v->g[1].gather || g_inflight_gathers() >= 2) return;
  if (fsdp_shard_gather_start(v, v->opts.param_dtype)) fsdp_clear_error();  // a failed prefetch is retried when needed
}

// the trace's slices of a unit: "forward <path>" on the compute track, "backward <path>" on the
// backward track (from its gather for backward to its reduction's start, or to the end of
// backward for a unit the catch-all finishes)
static void trace_name(char* buf, size_t n, const char* what, const fsdp_unit* u) {
  snprintf(buf, n, "%s %s", what, u->path);
}
static void trace_backward(fsdp_unit* u, int begin) {
  if (!fsdp_trace_enabled() || u->trace_bw == begin) return;
  char name[128];
  trace_name(name, sizeof name, "backward", u);
  int64_t id = 0;
  for (int i = 0; i < fsdp_n_units; i++)
    if (fsdp_units[i] == u) id = i + 1;
  fsdp_trace_async(begin, id, name);
  u->trace_bw = begin;
}
static void trace_forward_end(const fsdp_unit* u, const char* what) {
  if (!fsdp_trace_enabled()) return;
  char name[128];
  trace_name(name, sizeof name, what, u);
  fsdp_trace_span(FSDP_TRACE_COMPUTE, name, u->trace_t0, -1);
}

// .grad becomes this rank's local gradient (unit.h): float32, contiguous, held by the parameter alone
static int make_local(unit_param* p) {
  fsdp_tensor* g = p->t->grad;
  if (!fsdp_grad_exclusive(g)) {  // (exclusive: also contiguous float32)
    fsdp_tensor* c = fsdp_new_cat(g->ndim, g->shape, FSDP_F32, fsdp_device_of(g), FSDP_MEM_GRADS);
    if (!c || fsdp_copy_strided(c, g)) {
      fsdp_tensor_release(c);
      return -1;
    }
    fsdp_tensor_release(g);
    p->t->grad = c;
  }
  p->grad_is_local = 1;
  p->local_stamp = p->t->grad_sets;
  return 0;
}

// The reduced piece set aside at pre_backward rejoins .grad (unit.h): as it was when no new
// gradient came, else folded into the new gradient, which becomes local: its elements of this
// rank's piece gain W times the piece. (A synced backward's reduction adds it instead: shard.c.)
static int rejoin_stash(fsdp_unit* u, unit_param* p) {
  fsdp_tensor* s = p->stash;
  if (!s) return 0;
  p->stash = NULL;
  if (!p->t->grad) {
    p->t->grad = s;
    return 0;
  }
  int rc = make_local(p);
  fsdp_tensor* g = p->t->grad;
  fsdp_tensor* sc = rc ? NULL : fsdp_as_contig(s);  // (offload: the piece is on the host, .grad on the GPU)
  fsdp_tensor* sd = sc && fsdp_device_of(sc) != fsdp_device_of(g) ? fsdp_copy_to_device(sc, fsdp_device_of(g)) : sc;
  if (sd) {
    fsdp_backend_of(g)->elem->axpy(fsdp_f32(g) + p->start, p->len, fsdp_f32(sd), p->len, 1, p->len, (float)u->W);
    fsdp_bump_version(g);
  } else {
    rc = -1;
  }
  if (sd != sc) fsdp_tensor_release(sd);
  fsdp_tensor_release(sc);
  fsdp_tensor_release(s);
  return rc;
}

// returns a unit left over from an earlier pass to IDLE (its backward never came, or an error
// stopped it); reductions already issued are completed and their gradients assigned. A backward
// that began but never finished leaves its new gradients local, with the earlier ones folded in.
static int finalize_unit(fsdp_unit* u) {
  int rc = 0;
  int began = u->state == FSDP_UNIT_BACKWARD;
  trace_backward(u, 0);
  if (u->reduced_pending) rc = fsdp_shard_reduce_finish(u);
  for (int i = 0; i < u->n; i++) {
    unit_param* p = &u->p[i];
    if (began && p->group == 0 && p->t->grad && !grad_is_local(p) && make_local(p)) rc = -1;
    if (rejoin_stash(u, p)) rc = -1;
  }
  if (fsdp_shard_reshard(u, 0)) rc = -1;
  u->state = FSDP_UNIT_IDLE;
  return rc;
}

static int order_push(fsdp_unit* u) {
  if (fsdp_grow(&g_order, &g_order_cap, g_order_n + 1, sizeof *g_order, "FSDP forward order")) return -1;
  u->order_index = g_order_n;
  g_order[g_order_n++] = u;
  return 0;
}

int fsdp_unit_pre_forward(fsdp_unit* u) {
  CHECK_INT(u->state != FSDP_UNIT_FORWARD, "FSDP unit '%s': forward called again from inside its own forward", u->path);
  if (g_depth == 0) {  // a new forward pass; u is its root
    CHECK_INT(!fsdp_is_backward_running(), "FSDP unit '%s': forward inside backward is not supported", u->path);
    for (int i = 0; i < fsdp_n_units; i++)
      if (fsdp_units[i]->state != FSDP_UNIT_IDLE && finalize_unit(fsdp_units[i])) return -1;
    if (fsdp_is_grad_enabled()) {
      g_train_fwd++;
      set_phase(FSDP_PHASE_FORWARD);
    }
    fsdp_unit** t = g_prev_order;
    g_prev_order = g_order;
    g_order = t;  // this pass's order becomes "previous"
    int cap = g_prev_cap;
    g_prev_cap = g_order_cap;
    g_order_cap = cap;
    g_prev_order_n = g_order_n;
    g_order_n = 0;
    for (int i = 0; i < fsdp_n_units; i++) {
      fsdp_units[i]->order_index = -1;
      fsdp_units[i]->has_bw_node = 0;
    }
  }
  if (fsdp_shard_requires_relayout(u)) {  // freezing changed since the last step: rebuild the plan
    CHECK_INT(u->state == FSDP_UNIT_IDLE,
              "FSDP unit '%s': requires_grad of its parameters changed during a forward pass", u->path);
    if (fsdp_shard_reshard(u, 0) || fsdp_shard_layout(u)) return -1;
  }
  for (int i = 0; i < u->n; i++) u->p[i].rg_at_forward = u->p[i].t->requires_grad;
  if (u->order_index < 0 && order_push(u)) return -1;
  u->is_root = g_depth == 0;
  g_depth++;
  if (fsdp_trace_enabled()) u->trace_t0 = fsdp_trace_now();
  if (fsdp_shard_gather_finish(u, u->opts.param_dtype)) {
    g_depth--;
    return -1;
  }
  u->state = FSDP_UNIT_FORWARD;
  if (u->opts.forward_prefetch)  // the unit that followed this one last time
    for (int i = 0; i + 1 < g_prev_order_n; i++)
      if (g_prev_order[i] == u) {
        prefetch(g_prev_order[i + 1]);
        break;
      }
  return 0;
}

int fsdp_unit_post_forward(fsdp_unit* u) {
  CHECK_INT(u->state == FSDP_UNIT_FORWARD, "FSDP unit '%s': post_forward in state %s", u->path, state_names[u->state]);
  g_depth--;
  if (g_depth == 0 && g_phase == FSDP_PHASE_FORWARD) set_phase(FSDP_PHASE_BETWEEN);
  trace_forward_end(u, "forward");
  if (!fsdp_is_grad_enabled()) {  // no backward will follow (no_grad / eval)
    u->state = FSDP_UNIT_IDLE;
    return fsdp_shard_reshard(u, 0);
  }
  u->state = FSDP_UNIT_FORWARD_DONE;
  return reshard_after_forward(u) ? fsdp_shard_reshard(u, 0) : 0;
}

int fsdp_unit_abort_forward(fsdp_unit* u) {
  if (u->state == FSDP_UNIT_FORWARD) {
    g_depth--;
    if (g_depth == 0 && g_phase == FSDP_PHASE_FORWARD) set_phase(FSDP_PHASE_BETWEEN);
    trace_forward_end(u, "forward (failed)");
  }
  if (g_depth < 0) g_depth = 0;
  return finalize_unit(u);
}

// ---- backward ------------------------------------------------------------------------------------------------
static int pre_backward(fsdp_unit* u) {
  // in backward already: gathered, unless its bytes went early (unused) and a late node needs them
  if (u->state == FSDP_UNIT_BACKWARD) return u->gathered ? 0 : fsdp_shard_gather_finish(u, u->opts.param_dtype);
  if (g_phase != FSDP_PHASE_BACKWARD) set_phase(FSDP_PHASE_BACKWARD);
  for (int i = 0; i < u->n; i++)
    CHECK_INT(u->p[i].t->requires_grad == u->p[i].rg_at_forward,
              "FSDP unit '%s': requires_grad of parameter '%s' changed between forward and backward (was %s); "
              "change freezing only between steps",
              u->path, u->p[i].name, u->p[i].rg_at_forward ? "true" : "false");
  if (u->state != FSDP_UNIT_BACKWARD_DONE) trace_backward(u, 1);
  if (fsdp_shard_gather_finish(u, u->opts.param_dtype)) return -1;
  if (u->state == FSDP_UNIT_BACKWARD_DONE) return 0;  // gathered again for a late node; nothing else to do
  for (int i = 0; i < u->n; i++) {
    unit_param* p = &u->p[i];
    if (p->t->grad && !grad_is_local(p)) {  // the reduced piece from earlier backwards waits aside
      fsdp_tensor_release(p->stash);
      p->stash = p->t->grad;
      p->t->grad = NULL;
    }
  }
  u->state = FSDP_UNIT_BACKWARD;
  // Prefetch the nearest earlier unit (forward order) that backward will still gather: one whose
  // outputs got a pre-backward node and whose backward has not begun. Skipping the others avoids
  // all-gathers nobody uses: a parent unit that already finished its backward (nested units), a
  // frozen unit whose inputs need no grad (found by tests/scripts/fsdp_matrix.lua collective
  // counts: nested/wrap=nested3, nested/wrap=auto, conv/freeze=trunk,* issued one extra all-gather
  // per step).
  if (u->opts.backward_prefetch)
    for (int j = u->order_index - 1; j >= 0; j--) {
      fsdp_unit* v = g_order[j];
      if (v->n == 0 || !v->has_bw_node || v->state != FSDP_UNIT_FORWARD_DONE) continue;
      prefetch(v);
      break;
    }
  return 0;
}

// A checkpointed region around u runs u's forward again for backward (lua/fsdp/wrap.lua): u's
// backward begins here, gathered, before the gradients reach its outputs
int fsdp_unit_rerun(fsdp_unit* u) { return pre_backward(u); }

// core's materialize hook: a backward node needs a saved view of a resharded unit's buffer
static int materialize(void* owner) {
  fsdp_unit* u = owner;
  CHECK_INT(fsdp_is_backward_running(),
            "FSDP unit '%s': its parameters are resharded; a tensor that views them "
            "was kept past the forward pass",
            u->path);
  return pre_backward(u);
}

// core's unused hook: the last saved view of one of u's gathered buffers is gone. When no backward
// node holds any of them any more, the unit's gathered bytes go at once -- its parameters keep
// their full form (their gradients still come in full) until post_backward reshards them -- so
// the gradients built after this point do not coexist with the gathered parameters (a linear
// releases its weight between its two GEMMs: ops/linalg.c). A unit that needs them again after
// all (a node that saved them elsewhere) gathers again in pre_backward.
static int unused(void* owner) {
  fsdp_unit* u = owner;
  if (!fsdp_is_backward_running() || u->state != FSDP_UNIT_BACKWARD || !u->gathered || !u->separate_full) return 0;
  for (int k = 0; k < 2; k++)
    if (u->g[k].full->saved_refs > 0) return 0;
  for (int k = 0; k < 2; k++) fsdp_storage_drop_data(u->g[k].full);
  u->gathered = 0;
  return 0;
}

// completes the reductions that have finished by now, so their staging buffers go back at once
// instead of at the end of backward (waits for nothing)
static int reap_reductions(void) {
  for (int i = 0; i < fsdp_n_units; i++) {
    fsdp_unit* v = fsdp_units[i];
    if (v->reduced_pending && (!v->reduce || fsdp_work_test(v->reduce)) && fsdp_shard_reduce_finish(v)) return -1;
  }
  return 0;
}

static int post_backward(fsdp_unit* u) {
  if (u->state == FSDP_UNIT_BACKWARD_DONE) return 0;
  if (g_phase != FSDP_PHASE_BACKWARD) set_phase(FSDP_PHASE_BACKWARD);
  int any = 0;
  for (int i = 0; i < u->n; i++) any |= u->p[i].group == 0 && (u->p[i].got_grad || grad_is_local(&u->p[i]));
  if (any && u->sync_grads && fsdp_shard_reduce_start(u)) return -1;
  if (!u->sync_grads)  // no_sync: the new gradients stay local, the earlier reduced ones join them
    for (int i = 0; i < u->n; i++) {
      unit_param* p = &u->p[i];
      if (p->group == 0 && p->got_grad && make_local(p)) return -1;
      if (rejoin_stash(u, p)) return -1;
    }
  u->state = FSDP_UNIT_BACKWARD_DONE;
  trace_backward(u, 0);
  if (fsdp_shard_reshard(u, 0)) return -1;
  return reap_reductions();
}

// the parameters of a unit's pre-backward node
typedef struct {
  fsdp_unit* unit;  // borrowed (units are never freed)
} unit_node_params;

// the identity node on a unit's outputs: the first gradient to reach it gathers the unit
static int pre_backward_node(fsdp_node* n, fsdp_tensor* g, fsdp_tensor** gin) {
  unit_node_params p;
  fsdp_node_params(n, &p, sizeof p);
  if (reap_reductions() || pre_backward(p.unit)) return -1;
  g->refcount++;
  gin[0] = g;
  return 0;
}

fsdp_tensor* fsdp_unit_mark_output(fsdp_unit* u, fsdp_tensor* t) {
  if (!fsdp_is_grad_enabled() || !t->requires_grad) {
    t->refcount++;
    return t;
  }
  fsdp_tensor* out = fsdp_new_view(t, t->ndim, t->shape, t->stride, t->offset);
  if (!out) return NULL;
  fsdp_node* n = fsdp_node_new("FSDPPreBackward", pre_backward_node, 1, &t);
  fsdp_node_set_params(n, &(unit_node_params){.unit = u}, sizeof(unit_node_params));
  fsdp_node_set_output(n, out);
  u->has_bw_node = 1;
  return out;
}

// the trainable parameters of u that take part in this backward: in the graph (pending
// contributions) or already delivered
static void start_pass(fsdp_unit* u, int64_t pass) {
  u->pass = pass;
  u->ready = u->expected = 0;
  for (int i = 0; i < u->n; i++) {
    unit_param* p = &u->p[i];
    p->got_grad = 0;
    if (p->group == 0 && (p->t->bw_pending > 0 || p->t->bw_got)) u->expected++;
  }
}

static int on_grad_ready(fsdp_tensor* t) {
  fsdp_unit* u = t->owner;
  if (!u) return 0;
  int64_t pass = fsdp_autograd_pass();
  if (u->pass != pass) start_pass(u, pass);
  unit_param* p = &u->p[t->owner_index];
  CHECK_INT(p->t->requires_grad == p->rg_at_forward,
            "FSDP unit '%s': requires_grad of parameter '%s' changed between forward and backward", u->path, p->name);
  if (p->group != 0) return 0;
  p->got_grad = 1;
  if (++u->ready == u->expected) return post_backward(u);
  return 0;
}

static int end_of_backward(void* ctx) {
  (void)ctx;
  int64_t pass = fsdp_autograd_pass();
  int rc = 0;
  // catch-all: units whose backward began or whose gradients came in, but were never finished
  for (int i = 0; i < fsdp_n_units && !rc; i++) {
    fsdp_unit* u = fsdp_units[i];
    if (u->pass != pass && u->state == FSDP_UNIT_BACKWARD) start_pass(u, pass);
    if (u->state == FSDP_UNIT_BACKWARD || (u->pass == pass && u->ready > 0 && u->state != FSDP_UNIT_BACKWARD_DONE))
      rc = post_backward(u);
  }
  for (int i = 0; i < fsdp_n_units; i++)
    if (fsdp_units[i]->state != FSDP_UNIT_IDLE || fsdp_units[i]->reduced_pending)
      if (finalize_unit(fsdp_units[i]) && !rc) rc = -1;
  g_finished_pass = pass;
  if (g_phase == FSDP_PHASE_BACKWARD) {  // (a backward no unit took part in counts for nothing)
    g_train_bwd++;
    set_phase(FSDP_PHASE_BETWEEN);
  }
  return rc;
}

static int listener(int ev, fsdp_node* node, fsdp_tensor* t, void* ctx) {
  (void)node;
  (void)ctx;
  if (ev == FSDP_EV_BACKWARD_BEGIN) return fsdp_n_units ? fsdp_queue_callback(end_of_backward, NULL) : 0;
  if (ev == FSDP_EV_GRAD_READY) return on_grad_ready(t);
  if (ev == FSDP_EV_BACKWARD_END && g_finished_pass != fsdp_autograd_pass()) {
    // backward stopped with an error before the callback: leave every unit idle and consistent
    char msg[2048];
    snprintf(msg, sizeof msg, "%s", fsdp_last_error());
    for (int i = 0; i < fsdp_n_units; i++) finalize_unit(fsdp_units[i]);
    fsdp_set_error(msg);
    g_finished_pass = fsdp_autograd_pass();
    if (g_phase == FSDP_PHASE_BACKWARD) {
      g_train_bwd++;
      set_phase(FSDP_PHASE_BETWEEN);
    }
  }
  return 0;
}

// installs the engine listener and core's materialize hook, once (the first unit does it)
static void sched_install(void) {
  if (g_installed) return;
  g_installed = 1;
  fsdp_set_materialize_hook(materialize);
  fsdp_set_unused_hook(unused);
  fsdp_autograd_add_listener(FSDP_EV_BACKWARD_BEGIN | FSDP_EV_GRAD_READY | FSDP_EV_BACKWARD_END, listener, NULL);
}

// ---- summon_full_params, no_sync, idleness --------------------------------------------------------------------
int fsdp_unit_unshard(fsdp_unit* u) {
  CHECK_INT(u->state == FSDP_UNIT_IDLE, "FSDP unit '%s': summon_full_params only between steps (state %s)", u->path,
            state_names[u->state]);
  return fsdp_shard_gather_finish(u, FSDP_F32);  // the exact (float32) values, also under mixed precision
}
int fsdp_unit_reshard(fsdp_unit* u, int writeback) {
  CHECK_INT(u->state == FSDP_UNIT_IDLE, "FSDP unit '%s': reshard only between steps (state %s)", u->path,
            state_names[u->state]);
  return fsdp_shard_reshard(u, writeback);
}
int fsdp_unit_set_sync_grads(fsdp_unit* u, int sync) {
  u->sync_grads = sync != 0;
  return 0;
}
int fsdp_units_settle(void) {
  if (g_depth > 0 || fsdp_is_backward_running()) return 0;
  int rc = 0;
  for (int i = 0; i < fsdp_n_units; i++)
    if (fsdp_units[i]->state == FSDP_UNIT_FORWARD_DONE && finalize_unit(fsdp_units[i])) rc = -1;
  return rc;
}
int fsdp_units_all_idle(void) {
  for (int i = 0; i < fsdp_n_units; i++) {
    fsdp_unit* u = fsdp_units[i];
    if (u->state != FSDP_UNIT_IDLE || u->reduced_pending || u->g[0].gather || u->g[1].gather) return 0;
    if (u->separate_full && u->gathered) return 0;
  }
  return 1;
}
