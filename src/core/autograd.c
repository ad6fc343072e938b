/*
 * core/autograd.c -- graph nodes, the backward engine, gradient hooks, engine events and
 * end-of-backward callbacks.
 *
 * One backward pass:
 *   1. collect the graph reachable from the root's grad_fn; count, per node, how many
 *      producers will send it a gradient (deps) and, per leaf, how many contributions
 *      it will receive (bw_pending);
 *   2. emit BACKWARD_BEGIN (FSDP installs its end-of-backward callback here);
 *   3. run ready nodes, latest-created first (a max-heap on seq), each between NODE_PRE
 *      and NODE_POST; leaf gradients accumulate into .grad and emit GRAD_READY when the
 *      leaf's last contribution has arrived;
 *   4. run queued callbacks (they may queue more), then emit BACKWARD_END.
 * Grad mode is off while the engine runs (no double backward).
 *
 * A gradient has the dtype of its tensor (PyTorch's rule): a node's backward gets its output's
 * gradient in the output's dtype and may return its inputs' gradients in any float dtype (the
 * kernels return float32); the engine rounds each to its input's dtype, once, before it is summed
 * or delivered. Sums of two bfloat16 gradients are added in float32 and rounded once.
 */
#include "core/core.h"

#include <pthread.h>

// Threads may run independent models at once: grad mode, the running backward and its queued
// callbacks belong to the calling thread; node and pass numbers, hook ids, the live-hook list and
// the listener list are shared (atomic or locked).
static _Thread_local int g_grad_enabled = 1;
static _Thread_local int g_backward_running;
static _Thread_local int64_t g_pass;  // this thread's current (or last) backward pass
static _Atomic int64_t g_seq, g_pass_ids;

int fsdp_is_grad_enabled(void) { return g_grad_enabled; }
void fsdp_set_grad_enabled(int enabled) { g_grad_enabled = enabled != 0; }
int fsdp_is_backward_running(void) { return g_backward_running; }
int64_t fsdp_autograd_pass(void) { return g_pass; }

// ---- nodes ---------------------------------------------------------------------------------------
fsdp_node* fsdp_node_new(const char* name, fsdp_backward_fn backward, int n_inputs, fsdp_tensor** inputs) {
  if (!g_grad_enabled) return NULL;
  int any = 0;
  for (int i = 0; i < n_inputs; i++) any |= inputs[i] && inputs[i]->requires_grad;
  if (!any) return NULL;
  fsdp_node* n = calloc(1, sizeof *n);
  if (!n) {
    fprintf(stderr, "fsdp: out of memory creating autograd node %s\n", name);
    abort();
  }
  n->refcount = 1;
  n->name = name;
  n->seq = g_seq++;
  n->backward = backward;
  n->n_inputs = n_inputs;
  for (int i = 0; i < n_inputs; i++) {
    fsdp_tensor* t = inputs[i];
    if (!t || !t->requires_grad) continue;
    n->needs_grad[i] = 1;
    if (t->grad_fn) {
      n->next[i].node = t->grad_fn;
      t->grad_fn->refcount++;
    } else {
      n->next[i].leaf = t;
      t->refcount++;
    }
  }
  return n;
}

// ---- activation checkpointing: regions whose saved tensors are recomputed ---------------------------------
// A region records, in order, the places of the tensors its nodes would have saved; the first
// node that asks for one reruns the region's forward (fsdp_checkpoint_begin's fn), whose saves,
// in the same order, fill the places. Each place is freed with the node slot that holds it, and
// the region with its last place (its ctx then goes to the freed list the binding drains).
typedef struct fsdp_region {
  int refcount;  // the recording, and one per place a node holds
  fsdp_recompute_fn fn;
  void* ctx;
  uint64_t rng[4];            // the RNG at begin: the rerun draws the same numbers (dropout)
  int n_places;               // saves the first run made
  fsdp_tensor** got;          // what the rerun saved, by place (NULL once its node let it go)
  int n_got, cap_got, rerun;  // rerun: 1 once it ran
  int out_of_memory;          // the rerun could not keep a save
} fsdp_region;
static _Thread_local fsdp_region* g_recording;  // the region being recorded, or NULL
static _Thread_local fsdp_region* g_rerunning;  // the region whose forward reruns, or NULL
static _Thread_local void** g_freed_regions;
static _Thread_local int g_n_freed_regions, g_cap_freed_regions;

int fsdp_checkpoint_begin(fsdp_recompute_fn fn, void* ctx) {
  if (!g_grad_enabled || g_recording || g_rerunning) return 0;
  fsdp_region* r = calloc(1, sizeof *r);
  CHECK_INT(r, "checkpoint: out of memory");
  r->refcount = 1;
  r->fn = fn;
  r->ctx = ctx;
  fsdp_rng_get_state(r->rng);
  g_recording = r;
  return 1;
}
static void region_unref(fsdp_region* r);
void fsdp_checkpoint_end(void) {
  fsdp_region* r = g_recording;
  g_recording = NULL;
  if (r) region_unref(r);
}
int fsdp_checkpoint_rerunning(void) { return g_rerunning != NULL; }
const int* fsdp_checkpoint_freed_pending(void) { return &g_n_freed_regions; }
int fsdp_checkpoint_take_freed(void** ctxs, int cap) {
  int n = g_n_freed_regions < cap ? g_n_freed_regions : cap;
  if (n <= 0) return 0;
  g_n_freed_regions -= n;
  memcpy(ctxs, g_freed_regions + g_n_freed_regions, (size_t)n * sizeof *ctxs);
  return n;
}

// a saved view leaves: the last one of an owned storage tells its owner, inside backward (notify)
static fsdp_unused_fn get_unused_hook(void);
static int release_saved_view(fsdp_tensor* t, int notify) {
  fsdp_storage* s = t->storage;
  void* owner = s->owner;
  fsdp_unused_fn fn = get_unused_hook();
  int last = --s->saved_refs == 0 && owner && fn && notify;
  fsdp_tensor_release(t);
  return last ? fn(owner) : 0;
}
static void region_unref(fsdp_region* r) {
  if (--r->refcount > 0) return;
  for (int i = 0; i < r->n_got; i++)
    if (r->got[i]) release_saved_view(r->got[i], 0);
  free(r->got);
  if (fsdp_grow(&g_freed_regions, &g_cap_freed_regions, g_n_freed_regions + 1, sizeof *g_freed_regions, "checkpoint") ==
      0)
    g_freed_regions[g_n_freed_regions++] = r->ctx;
  else fsdp_clear_error();  // (the binding then keeps its entry: a leak, not an error)
  free(r);
}
// reruns r's forward: grad mode on, the RNG as at begin (then as it was), saves into r->got
static int region_rerun(fsdp_region* r, const char* node) {
  CHECK_INT(!g_rerunning, "%s: checkpoint: a region's forward asked for another's saved tensors while rerunning", node);
  uint64_t keep[4];
  fsdp_rng_get_state(keep);
  fsdp_rng_set_state(r->rng);
  int mode = g_grad_enabled;
  g_grad_enabled = 1;
  g_rerunning = r;
  r->n_got = 0;
  int rc = r->fn(r->ctx);
  g_rerunning = NULL;
  g_grad_enabled = mode;
  fsdp_rng_set_state(keep);
  r->rerun = 1;
  if (rc) return -1;
  CHECK_INT(!r->out_of_memory, "%s: checkpoint: out of memory for the recomputed tensors", node);
  CHECK_INT(r->n_got == r->n_places,
            "%s: checkpoint: the forward saved %d tensors for backward when it ran and %d when it ran again for "
            "backward; a checkpointed function must run the same ops both times (no branches on tensor values or "
            "on state that changed in between)",
            node, r->n_places, r->n_got);
  return 0;
}

// Saved tensors are detached aliases (same storage, no grad_fn), so saving an op's own output
// makes no reference cycle; the version recorded here catches later in-place writes.
int fsdp_node_save(fsdp_node* n, fsdp_tensor* t) {
  if (n->n_saved >= FSDP_NODE_MAX_SAVED) {
    fprintf(stderr, "fsdp: node %s saves too many tensors\n", n->name);
    abort();
  }
  int k = n->n_saved++;
  n->saved[k] = NULL;
  n->saved_version[k] = t ? t->storage->version : 0;
  if (!t) return k;
  if (g_rerunning) {  // the rerun's saves fill the region's places; its own nodes keep none
    fsdp_region* r = g_rerunning;
    fsdp_tensor* v = NULL;
    if (fsdp_grow(&r->got, &r->cap_got, r->n_got + 1, sizeof *r->got, "checkpoint") == 0 &&
        (v = fsdp_new_view(t, t->ndim, t->shape, t->stride, t->offset)))
      t->storage->saved_refs++;
    if (!v) r->out_of_memory = 1;  // (region_rerun reports it)
    else r->got[r->n_got++] = v;
    return k;
  }
  if (g_recording) {  // a place in the region instead of the tensor
    n->saved_region[k] = g_recording;
    n->saved_place[k] = g_recording->n_places++;
    g_recording->refcount++;
    return k;
  }
  n->saved[k] = fsdp_new_view(t, t->ndim, t->shape, t->stride, t->offset);
  t->storage->saved_refs++;
  return k;
}

// drops saved tensor k. Inside backward (notify), the last saved view of an owned storage tells
// its owner (the unused hook); a graph freed elsewhere -- by the garbage collector, or on a thread
// that released its last tensor -- tells nobody.
static _Atomic(fsdp_unused_fn) g_unused;
void fsdp_set_unused_hook(fsdp_unused_fn fn) { atomic_store(&g_unused, fn); }
static fsdp_unused_fn get_unused_hook(void) { return atomic_load(&g_unused); }
static int drop_saved(fsdp_node* n, int k, int notify) {
  fsdp_region* r = n->saved_region[k];
  if (r) {  // a place: its recomputed tensor (if the rerun made it) goes, and the node's hold on r
    n->saved_region[k] = NULL;
    int p = n->saved_place[k], rc = 0;
    if (p < r->n_got && r->got[p]) {
      fsdp_tensor* t = r->got[p];
      r->got[p] = NULL;
      rc = release_saved_view(t, notify);
    }
    region_unref(r);
    return rc;
  }
  fsdp_tensor* t = n->saved[k];
  if (!t) return 0;
  n->saved[k] = NULL;
  return release_saved_view(t, notify);
}

int fsdp_node_saved_last_use(const fsdp_node* n, int k) {
  const fsdp_tensor* t = n->saved[k];
  return !n->keep_saved && t && t->storage->owner && t->storage->saved_refs == 1;
}

int fsdp_node_release_saved(fsdp_node* n, int k) { return n->keep_saved ? 0 : drop_saved(n, k, 1); }

fsdp_tensor* fsdp_node_saved(fsdp_node* n, int k) {
  CHECK_NULL(!n->released,
             "%s: trying to backward through the graph a second time (its saved tensors were "
             "freed after the first backward; pass retain_graph = true to keep them)",
             n->name);
  fsdp_region* r = n->saved_region[k];
  if (r) {  // recomputed: the region's forward runs again the first time one of its places is read
    if (!r->rerun && region_rerun(r, n->name)) return NULL;
    fsdp_tensor* t = r->got[n->saved_place[k]];
    CHECK_NULL(t, "%s: checkpoint: a recomputed tensor was read after its node let it go", n->name);
    return fsdp_storage_materialize(t->storage) ? NULL : t;
  }
  fsdp_tensor* t = n->saved[k];
  // a saved view of bytes an owner dropped (an FSDP unit resharded): bring them back first
  if (t && fsdp_storage_materialize(t->storage)) return NULL;
  CHECK_NULL(!t || t->storage->version == n->saved_version[k],
             "%s: a tensor of shape %s needed for gradient computation was modified by an in-place operation "
             "(version %lld, expected %lld)",
             n->name, SH(t), (long long)t->storage->version, (long long)n->saved_version[k]);
  return t;
}

// The parameters are copied in and out (memcpy): any struct fits whatever its alignment, and no
// pointer of another type ever aliases the bytes.
static void check_params_size(const fsdp_node* n, size_t size) {
  if (size > FSDP_NODE_PARAMS_BYTES) {
    fprintf(stderr, "fsdp: node %s has %zu bytes of parameters (at most %d fit)\n", n->name, size,
            FSDP_NODE_PARAMS_BYTES);
    abort();
  }
}

void fsdp_node_set_params(fsdp_node* n, const void* p, size_t size) {
  check_params_size(n, size);
  memcpy(n->params, p, size);
}

void fsdp_node_params(const fsdp_node* n, void* p, size_t size) {
  check_params_size(n, size);
  memcpy(p, n->params, size);
}

void fsdp_node_set_output(fsdp_node* n, fsdp_tensor* out) {
  out->grad_fn = n;
  out->requires_grad = 1;
  n->out_ndim = out->ndim;
  n->out_dtype = out->dtype;
  memcpy(n->out_shape, out->shape, sizeof n->out_shape);
}

static int node_free_saved(fsdp_node* n, int notify) {
  int rc = 0;
  for (int k = 0; k < n->n_saved; k++)
    if (drop_saved(n, k, notify)) rc = -1;
  return rc;
}

void fsdp_node_release(fsdp_node* n) {
  if (!n || --n->refcount > 0) return;
  node_free_saved(n, 0);
  for (int i = 0; i < n->n_inputs; i++) {
    fsdp_node_release(n->next[i].node);
    fsdp_tensor_release(n->next[i].leaf);
  }
  fsdp_tensor_release(n->grad_acc);
  fsdp_hooks_free(n->hooks);
  free(n);
}

const char* fsdp_node_name(const fsdp_node* n) { return n ? n->name : ""; }
int64_t fsdp_node_seq(const fsdp_node* n) { return n ? n->seq : -1; }

// ---- tensor autograd attributes ---------------------------------------------------------------------
int fsdp_tensor_requires_grad(const fsdp_tensor* t) { return t->requires_grad; }
int fsdp_tensor_is_leaf(const fsdp_tensor* t) { return t->grad_fn == NULL; }
const char* fsdp_tensor_grad_fn_name(const fsdp_tensor* t) { return t->grad_fn ? t->grad_fn->name : ""; }
fsdp_node* fsdp_tensor_grad_fn(const fsdp_tensor* t) { return t->grad_fn; }

int fsdp_tensor_set_requires_grad(fsdp_tensor* t, int flag) {
  CHECK_INT(!t->grad_fn,
            "requires_grad: only leaf tensors can change requires_grad (this one of shape %s "
            "comes from %s); use detach()",
            SH(t), t->grad_fn->name);
  CHECK_INT(!flag || fsdp_is_float(t->dtype),
            "requires_grad: only floating point tensors can require gradients "
            "(got %s of shape %s)",
            DT(t), SH(t));
  t->requires_grad = flag != 0;
  return 0;
}
fsdp_tensor* fsdp_tensor_grad(fsdp_tensor* t) {
  if (t->grad) t->grad->refcount++;
  return t->grad;
}
int fsdp_tensor_set_grad(fsdp_tensor* t, fsdp_tensor* g) {
  if (g) {
    CHECK_INT(fsdp_same_shape(t, g) && g->dtype == t->dtype,
              "grad: assigned gradient %s %s does not match "
              "tensor %s %s",
              DT(g), SH(g), DT(t), SH(t));
    g->refcount++;
  }
  fsdp_tensor_release(t->grad);
  t->grad = g;
  t->grad_sets++;
  return 0;
}

// ---- gradient accumulation ----------------------------------------------------------------------------
// Buffers are shared freely between edges (AddBackward passes one gradient to both inputs), so we
// add in place only into a tensor nobody else holds; otherwise we build a new sum.
int fsdp_grad_exclusive(const fsdp_tensor* t) {
  return t->refcount == 1 && t->storage->refcount == 1 && fsdp_tensor_is_contiguous(t) && t->dtype == FSDP_F32;
}
#define exclusively_owned fsdp_grad_exclusive

// a + b (one shape) as a new contiguous tensor of a's dtype: the sum of two gradients when the
// first is held elsewhere (or is not float32), added in float32 and rounded once. No autograd,
// and no op: the engine adds with the device's kernels itself.
static fsdp_tensor* grad_sum(fsdp_tensor* a, fsdp_tensor* b) {
  CHECK_NULL(fsdp_same_shape(a, b), "backward: gradients of shapes %s and %s for one tensor", SH(a), SH(b));
  fsdp_tensor* s = fsdp_new(a->ndim, a->shape, FSDP_F32, fsdp_device_of(a));
  fsdp_tensor* bc = s ? fsdp_as_contig(b) : NULL;
  if (!bc || fsdp_copy_strided(s, a)) {
    fsdp_tensor_release(bc);
    fsdp_tensor_release(s);
    return NULL;
  }
  int64_t n = fsdp_tensor_numel(s);
  fsdp_backend_of(s)->elem->axpy(fsdp_f32(s), n, fsdp_f32(bc), n, 1, n, 1.0f);
  fsdp_tensor_release(bc);
  return fsdp_round_to(s, a->dtype);
}

int fsdp_grad_accumulate(fsdp_tensor** acc, fsdp_tensor* g) {
  if (!*acc) {
    g->refcount++;
    *acc = g;
    return 0;
  }
  if (exclusively_owned(*acc) && fsdp_same_shape(*acc, g)) {
    fsdp_tensor* gc = fsdp_as_contig(g);
    if (!gc) return -1;
    int64_t n = fsdp_tensor_numel(gc);
    fsdp_backend_of(gc)->elem->axpy(fsdp_f32(*acc), n, fsdp_f32(gc), n, 1, n, 1.0f);
    fsdp_tensor_release(gc);
    return 0;
  }
  fsdp_tensor* s = grad_sum(*acc, g);
  if (!s) return -1;
  fsdp_tensor_release(*acc);
  *acc = s;
  return 0;
}

// .grad of a leaf lives in the grads memory category and is owned by the leaf alone
static int leaf_accumulate(fsdp_tensor* leaf, fsdp_tensor* g) {
  CHECK_INT(fsdp_same_shape(leaf, g), "backward: gradient of shape %s for a leaf of shape %s", SH(g), SH(leaf));
  if (leaf->grad) {
    if (!exclusively_owned(leaf->grad)) {  // the user holds it; PyTorch also replaces it then
      fsdp_tensor* s = grad_sum(leaf->grad, g);
      if (!s) return -1;
      fsdp_tensor_set_mem_category(s, FSDP_MEM_GRADS);
      fsdp_tensor_release(leaf->grad);
      leaf->grad = s;
      return 0;
    }
    return fsdp_grad_accumulate(&leaf->grad, g);
  }
  if (exclusively_owned(g)) {  // nobody else holds this buffer: steal it
    g->refcount++;
    leaf->grad = g;
  } else {
    leaf->grad = fsdp_new(leaf->ndim, leaf->shape, leaf->dtype, fsdp_device_of(leaf));
    if (!leaf->grad || fsdp_copy_strided(leaf->grad, g)) return -1;
  }
  fsdp_tensor_set_mem_category(leaf->grad, FSDP_MEM_GRADS);
  return 0;
}

// ---- hooks ----------------------------------------------------------------------------------------------
static _Atomic int64_t g_hook_id;
static fsdp_hook** g_live_hooks;  // with g_hooks_lock
static int g_n_live_hooks, g_cap_live_hooks;
static pthread_mutex_t g_hooks_lock = PTHREAD_MUTEX_INITIALIZER;

int64_t fsdp_tensor_register_hook(fsdp_tensor* t, fsdp_grad_hook_fn fn, void* ctx) {
  CHECK_INT(t->requires_grad, "register_hook: tensor of shape %s does not require grad", SH(t));
  fsdp_hook* h = calloc(1, sizeof *h);
  CHECK_INT(h, "register_hook: out of memory");
  pthread_mutex_lock(&g_hooks_lock);
  int grown = fsdp_grow(&g_live_hooks, &g_cap_live_hooks, g_n_live_hooks + 1, sizeof *g_live_hooks, "register_hook");
  if (!grown) g_live_hooks[g_n_live_hooks++] = h;
  pthread_mutex_unlock(&g_hooks_lock);
  if (grown) {
    free(h);
    return -1;
  }
  h->id = ++g_hook_id;
  h->fn = fn;
  h->ctx = ctx;
  fsdp_hook** list = t->grad_fn ? &t->grad_fn->hooks : &t->hooks;
  while (*list) list = &(*list)->next;  // run in registration order
  *list = h;
  return h->id;
}
static void unlive(fsdp_hook* h) {  // with g_hooks_lock held
  for (int i = 0; i < g_n_live_hooks; i++)
    if (g_live_hooks[i] == h) {
      g_live_hooks[i] = g_live_hooks[--g_n_live_hooks];
      return;
    }
}
int fsdp_remove_hook(int64_t id) {
  pthread_mutex_lock(&g_hooks_lock);
  for (int i = 0; i < g_n_live_hooks; i++)
    if (g_live_hooks[i]->id == id) {
      g_live_hooks[i]->fn = NULL;
      unlive(g_live_hooks[i]);
      break;
    }
  pthread_mutex_unlock(&g_hooks_lock);
  return 0;  // already gone with its tensor: removing twice is harmless
}
// ids of live hooks freed with their tensor, until fsdp_hooks_take_freed collects them (if the
// queue cannot grow, the id is dropped: the binding then keeps its entry, nothing breaks)
// (per thread: the thread that frees a tensor is the one whose Lua state holds its hooks)
static _Thread_local int64_t* g_freed_hooks;
static _Thread_local int g_n_freed_hooks, g_cap_freed_hooks;
void fsdp_hooks_free(fsdp_hook* h) {
  if (!h) return;
  pthread_mutex_lock(&g_hooks_lock);
  while (h) {
    fsdp_hook* n = h->next;
    if (h->fn) {
      unlive(h);
      if (fsdp_grow(&g_freed_hooks, &g_cap_freed_hooks, g_n_freed_hooks + 1, sizeof *g_freed_hooks, "hooks") == 0)
        g_freed_hooks[g_n_freed_hooks++] = h->id;
      else fsdp_clear_error();
    }
    free(h);
    h = n;
  }
  pthread_mutex_unlock(&g_hooks_lock);
}
int fsdp_hooks_take_freed(int64_t* ids, int cap) {
  int n = g_n_freed_hooks < cap ? g_n_freed_hooks : cap;
  if (n <= 0) return 0;
  g_n_freed_hooks -= n;
  memcpy(ids, g_freed_hooks + g_n_freed_hooks, (size_t)n * sizeof *ids);
  return n;
}
const int* fsdp_hooks_freed_pending(void) { return &g_n_freed_hooks; }
// runs hooks on *g, replacing it when a hook returns a new gradient
static int run_hooks(fsdp_hook* h, fsdp_tensor** g) {
  for (; h; h = h->next) {
    if (!h->fn) continue;
    int err = 0;
    fsdp_tensor* r = h->fn(*g, h->ctx, &err);
    if (err) {
      fsdp_tensor_release(r);
      return -1;
    }
    if (r) {
      fsdp_tensor_release(*g);
      *g = r;
    }
  }
  return 0;
}

// ---- listeners and callbacks -------------------------------------------------------------------------------
typedef struct {
  int64_t id;
  int mask;
  fsdp_listener_fn fn;
  void* ctx;
} listener;
#define FSDP_MAX_LISTENERS 64
static listener g_listeners[FSDP_MAX_LISTENERS];  // with g_listeners_lock
static int g_n_listeners;
static int64_t g_listener_id;
static pthread_mutex_t g_listeners_lock = PTHREAD_MUTEX_INITIALIZER;

int64_t fsdp_autograd_add_listener(int mask, fsdp_listener_fn fn, void* ctx) {
  pthread_mutex_lock(&g_listeners_lock);
  int64_t id = -1;
  if (g_n_listeners < FSDP_MAX_LISTENERS) {
    id = ++g_listener_id;
    g_listeners[g_n_listeners++] = (listener){id, mask, fn, ctx};
  }
  pthread_mutex_unlock(&g_listeners_lock);
  CHECK_INT(id > 0, "autograd: too many engine listeners (%d)", FSDP_MAX_LISTENERS);
  return id;
}
int fsdp_autograd_remove_listener(int64_t id) {
  pthread_mutex_lock(&g_listeners_lock);
  for (int i = 0; i < g_n_listeners; i++)
    if (g_listeners[i].id == id) {
      memmove(&g_listeners[i], &g_listeners[i + 1], (g_n_listeners - i - 1) * sizeof(listener));
      g_n_listeners--;
      break;
    }
  pthread_mutex_unlock(&g_listeners_lock);
  return 0;
}
// calls the listeners of ev from a copy of the list, so a listener may add or remove listeners
static int emit(int ev, fsdp_node* n, fsdp_tensor* t) {
  listener ls[FSDP_MAX_LISTENERS];
  pthread_mutex_lock(&g_listeners_lock);
  int nl = g_n_listeners;
  memcpy(ls, g_listeners, nl * sizeof *ls);
  pthread_mutex_unlock(&g_listeners_lock);
  for (int i = 0; i < nl; i++)
    if ((ls[i].mask & ev) && ls[i].fn(ev, n, t, ls[i].ctx)) return -1;
  return 0;
}

typedef struct {
  fsdp_callback_fn fn;
  void* ctx;
} callback;
static _Thread_local callback* g_callbacks;  // queued during this thread's backward
static _Thread_local int g_n_callbacks, g_cap_callbacks;

int fsdp_queue_callback(fsdp_callback_fn fn, void* ctx) {
  CHECK_INT(g_backward_running, "queue_callback: only allowed while backward runs");
  if (fsdp_grow(&g_callbacks, &g_cap_callbacks, g_n_callbacks + 1, sizeof *g_callbacks, "queue_callback")) return -1;
  g_callbacks[g_n_callbacks++] = (callback){fn, ctx};
  return 0;
}

// ---- the engine -----------------------------------------------------------------------------------------------
typedef struct {
  fsdp_node** v;
  int n, cap;
} node_vec;
static int vec_push(node_vec* a, fsdp_node* n) {
  if (fsdp_grow(&a->v, &a->cap, a->n + 1, sizeof *a->v, "backward")) return -1;
  a->v[a->n++] = n;
  return 0;
}
// max-heap on seq: the most recently created ready node runs first
static int heap_push(node_vec* h, fsdp_node* n) {
  if (vec_push(h, n)) return -1;
  for (int i = h->n - 1; i > 0;) {
    int p = (i - 1) / 2;
    if (h->v[p]->seq >= h->v[i]->seq) break;
    fsdp_node* t = h->v[p];
    h->v[p] = h->v[i];
    h->v[i] = t;
    i = p;
  }
  return 0;
}
static fsdp_node* heap_pop(node_vec* h) {
  fsdp_node* top = h->v[0];
  h->v[0] = h->v[--h->n];
  for (int i = 0;;) {
    int l = 2 * i + 1, r = l + 1, m = i;
    if (l < h->n && h->v[l]->seq > h->v[m]->seq) m = l;
    if (r < h->n && h->v[r]->seq > h->v[m]->seq) m = r;
    if (m == i) break;
    fsdp_node* t = h->v[m];
    h->v[m] = h->v[i];
    h->v[i] = t;
    i = m;
  }
  return top;
}

typedef struct {
  fsdp_tensor** v;
  int n, cap;
} leaf_vec;

// step 1: nodes reachable from root, deps per node, pending contributions per leaf
// (0, or -1 out of memory: what was listed is in nodes and leaves, for the caller's cleanup)
static int collect(fsdp_node* root, int64_t pass, node_vec* nodes, leaf_vec* leaves) {
  node_vec stack = {0};
  int rc = 0;
  root->visit = pass;
  root->deps = 0;
  rc = vec_push(&stack, root);
  while (!rc && stack.n) {
    fsdp_node* n = stack.v[--stack.n];
    if ((rc = vec_push(nodes, n))) break;
    for (int i = 0; i < n->n_inputs; i++) {
      fsdp_node* m = n->next[i].node;
      fsdp_tensor* l = n->next[i].leaf;
      if (m) {
        if (m->visit != pass) {
          m->visit = pass;
          m->deps = 0;
          if ((rc = vec_push(&stack, m))) break;
        }
        m->deps++;
      } else if (l) {
        if (l->bw_pending == 0 && !l->bw_got) {
          if ((rc = fsdp_grow(&leaves->v, &leaves->cap, leaves->n + 1, sizeof *leaves->v, "backward"))) break;
          leaves->v[leaves->n++] = l;
          l->bw_got = -1;  // marks "listed" until the pass starts
        }
        l->bw_pending++;
      }
    }
  }
  free(stack.v);
  for (int i = 0; i < leaves->n; i++) leaves->v[i]->bw_got = 0;
  return rc;
}

// consumes the caller's reference to g (may be NULL: this producer sent no gradient)
static int deliver_to_leaf(fsdp_tensor* leaf, fsdp_tensor* g) {
  if (g) {
    int rc = run_hooks(leaf->hooks, &g);
    if (!rc) rc = leaf_accumulate(leaf, g);
    fsdp_tensor_release(g);
    if (rc) return -1;
    leaf->bw_got = 1;
  }
  if (--leaf->bw_pending == 0 && leaf->bw_got) return emit(FSDP_EV_GRAD_READY, NULL, leaf);
  return 0;
}

static int run_node(fsdp_node* n, node_vec* ready, int retain_graph) {
  fsdp_tensor* g = n->grad_acc;
  n->grad_acc = NULL;
  fsdp_tensor* grad_in[FSDP_NODE_MAX_INPUTS] = {0};
  int rc = 0;
  if (g) {
    rc = run_hooks(n->hooks, &g);
    if (!rc) rc = emit(FSDP_EV_NODE_PRE, n, NULL);
    if (!rc && n->released)
      rc = (fsdp_errorf("%s: trying to backward through the graph a second time (its saved tensors were freed "
                        "after the first backward; pass retain_graph = true to keep them)",
                        n->name),
            -1);
    n->grad_dest = n->needs_grad[0] && n->next[0].node ? &n->next[0].node->grad_acc : NULL;
    n->keep_saved = retain_graph;
    if (!rc) rc = n->backward(n, g, grad_in);
    n->grad_dest = NULL;
    if (!rc) rc = emit(FSDP_EV_NODE_POST, n, NULL);
    if (!retain_graph) {
      if (node_free_saved(n, 1)) rc = -1;
      n->released = 1;
    }
  }
  for (int i = 0; i < n->n_inputs; i++) {
    fsdp_edge e = n->next[i];
    if (!rc && grad_in[i] && !n->needs_grad[i]) {
      fsdp_tensor_release(grad_in[i]);
      grad_in[i] = NULL;
    }
    if (!rc && grad_in[i]) {  // in the dtype of the tensor it is the gradient of
      grad_in[i] = fsdp_round_to(grad_in[i], e.node ? e.node->out_dtype : e.leaf->dtype);
      if (!grad_in[i]) rc = -1;
    }
    if (!rc && e.node) {
      if (grad_in[i]) rc = fsdp_grad_accumulate(&e.node->grad_acc, grad_in[i]);
      if (--e.node->deps == 0 && !rc) rc = heap_push(ready, e.node);
    } else if (!rc && e.leaf) {
      rc = deliver_to_leaf(e.leaf, grad_in[i]);
      grad_in[i] = NULL;
    }
    fsdp_tensor_release(grad_in[i]);
  }
  fsdp_tensor_release(g);
  return rc;
}

int fsdp_backward(fsdp_tensor* t, fsdp_tensor* grad, int retain_graph) {
  CHECK_INT(!g_backward_running, "backward: called while another backward is running (reentrant backward is "
                                 "not supported)");
  CHECK_INT(t->requires_grad,
            "backward: tensor of shape %s does not require grad and has no grad_fn "
            "(did you freeze every parameter, or run the forward under no_grad?)",
            SH(t));
  if (grad) {
    CHECK_INT(fsdp_same_shape(t, grad), "backward: gradient of shape %s for a tensor of shape %s", SH(grad), SH(t));
    fsdp_tensor_retain(grad);
    grad = fsdp_round_to(grad, t->dtype);
    if (!grad) return -1;
  } else {
    CHECK_INT(fsdp_tensor_numel(t) == 1,
              "backward: grad can be implicitly created only for one-element outputs "
              "(got shape %s)",
              SH(t));
    grad = fsdp_new(t->ndim, t->shape, t->dtype, fsdp_device_of(t));
    if (!grad) return -1;
    fsdp_backend_of(grad)->elem->fill(fsdp_ptr(grad), t->dtype, 1, 1.0);
  }
  int prev_mode = g_grad_enabled, rc = 0;
  g_grad_enabled = 0;
  g_backward_running = 1;
  g_n_callbacks = 0;
  node_vec nodes = {0}, ready = {0};
  leaf_vec leaves = {0};
  int64_t pass = ++g_pass_ids;  // unique across threads: nodes remember the pass that reached them
  g_pass = pass;

  if (t->grad_fn) rc = collect(t->grad_fn, pass, &nodes, &leaves);
  else if (!(rc = fsdp_grow(&leaves.v, &leaves.cap, 1, sizeof *leaves.v, "backward"))) {
    t->bw_pending = 1;
    leaves.v[leaves.n++] = t;
  }

  if (!rc) rc = emit(FSDP_EV_BACKWARD_BEGIN, NULL, NULL);
  if (!rc && t->grad_fn) {
    t->grad_fn->grad_acc = grad;
    grad = NULL;
    rc = heap_push(&ready, t->grad_fn);
    while (!rc && ready.n) rc = run_node(heap_pop(&ready), &ready, retain_graph);
  } else if (!rc) {
    rc = deliver_to_leaf(t, grad);
    grad = NULL;
  }
  for (int i = 0; !rc && i < g_n_callbacks; i++) rc = g_callbacks[i].fn(g_callbacks[i].ctx);

  // on error some nodes never ran: drop their partial gradients and counters
  for (int i = 0; i < nodes.n; i++) {
    fsdp_tensor_release(nodes.v[i]->grad_acc);
    nodes.v[i]->grad_acc = NULL;
  }
  for (int i = 0; i < leaves.n; i++) {
    leaves.v[i]->bw_pending = 0;
    leaves.v[i]->bw_got = 0;
  }
  free(nodes.v);
  free(ready.v);
  free(leaves.v);
  fsdp_tensor_release(grad);
  g_n_callbacks = 0;
  g_backward_running = 0;
  g_grad_enabled = prev_mode;
  // BACKWARD_END always fires so listeners can return to a clean state after an error
  if (rc) {
    char saved[2048];
    snprintf(saved, sizeof saved, "%s", fsdp_last_error());
    emit(FSDP_EV_BACKWARD_END, NULL, NULL);
    fsdp_set_error(saved);
    return -1;
  }
  return emit(FSDP_EV_BACKWARD_END, NULL, NULL);
}
