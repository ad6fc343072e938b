/*
 * backend/cpu/onednn.c -- convolution forward, input gradient and weight gradient through oneDNN
 * (Debian libdnnl-dev), on our plain NCHW / OIHW buffers.
 *
 * Each pass runs in one of two layouts:
 *   plain    oneDNN reads and writes our buffers as they are (its GEMM-based kernels);
 *   blocked  the operands are reordered into the layouts oneDNN's direct JIT kernels want
 *            (channels in blocks of 16 or 8), the pass runs there, the result is reordered back.
 * Blocked kernels run at 85-90% of the FMA peak where plain ones reach 55-70%, but the reorders
 * cost 10-30% of the pass. Measured on a 2-core AMD EPYC (commit bd7e651's bench/README.md),
 * blocked wins everywhere except for 1x1 kernels (plain is one GEMM, the reorders are pure loss)
 * and the input gradient of layers with few input channels (the RGB stem: blocked runs 3x slower).
 * conv_layout() is that rule; FSDP_CONV_LAYOUT=plain|blocked forces one, for measurements.
 * The rule is fixed, not timed per run, so a seed gives the same numbers on every run. 3x3
 * stride-1 float32 layers first try oneDNN's Winograd F(4x4, 3x3) (use_winograd, below); float32
 * 1x1 convolutions without padding never come here (linalg.c runs them as GEMMs).
 *
 * In backward, the input gradient and the weight gradient share one reorder of gy when both run
 * blocked in the same layout. Primitives (a JIT compile each) live in a cache of 64 geometries,
 * keyed by the OpenMP thread count too (a primitive divides its work for the count it was made at).
 * Scratch memory is ours (user scratchpad, from fsdp_alloc), so concurrent calls are safe and
 * the bytes are counted. Functions return 0, 1 for geometries left to the caller (empty tensors),
 * or -1 with the error set.
 */
#include "core/core.h"
#include "backend/cpu/cpu.h"

#include <oneapi/dnnl/dnnl.h>
#include <omp.h>
#include <pthread.h>

static dnnl_engine_t g_engine;
static pthread_once_t g_engine_once = PTHREAD_ONCE_INIT;
static void engine_init(void) {
  if (dnnl_engine_create(&g_engine, dnnl_cpu, 0) != dnnl_success) g_engine = NULL;
}

enum { FWD, BWD_DATA, BWD_WEIGHTS, NPASS };
static const char* pass_names[NPASS] = {"forward", "input gradient", "weight gradient"};

// one pass of one geometry: the primitive and, for each of its three operands, the layout it runs
// in and the reorders between that and our plain layout (NULL where they are the same)
typedef struct {
  dnnl_primitive_t prim;          // NULL until first used
  int wanted;                     // pass_choice() when it was made
  int arg[3];                     // oneDNN argument ids: two inputs, then the output
  dnnl_memory_desc_t md[3];       // the primitive's layout of each operand
  dnnl_primitive_t to_md[3];      // plain -> md (inputs)
  dnnl_primitive_t from_md[3];    // md -> plain (the output)
  dnnl_memory_desc_t scratch_md;  // its scratchpad, which we allocate
  size_t scratch;                 // and its bytes
} conv_pass;

typedef struct {
  fsdp_conv_geom g;
  int has_bias;
  int threads;  // OpenMP threads when made: a primitive splits its work for that many for good
  // the input rows and columns the windows reach (H, W less any the last window stops short of:
  // oneDNN takes no negative right padding, so x is described as its first Hx rows, Wx columns)
  // and the right padding then (>= 0)
  int64_t Hx, Wx, pad_r[2];
  int dtype;  // of the operands x, w, gy (FSDP_F32 or FSDP_BF16); results are float32
  // our plain layouts: x, w, gy in the operand dtype, y, gx, gw (and b, gb) in float32
  dnnl_memory_desc_t x_md, w_md, gy_md, y_md, gx_md, gw_md, b_md;
  conv_pass pass[NPASS];
} conv_entry;

static _Atomic int64_t g_passes[2];  // passes run: float32, bfloat16 operands
int64_t fsdp_cpu_onednn_conv_passes(int dtype) { return dtype == FSDP_BF16 ? g_passes[1] : g_passes[0]; }

#define CACHE_SLOTS 64
static conv_entry g_cache[CACHE_SLOTS];
static int g_cache_n, g_cache_next;  // entries in use; the slot to replace when full
static pthread_mutex_t g_cache_lock = PTHREAD_MUTEX_INITIALIZER;

// oneDNN takes every buffer as a plain void* handle; it only reads the sources
static void* unconst(const void* p) { return (void*)(uintptr_t)p; }

static int same_geom(const fsdp_conv_geom* a, const fsdp_conv_geom* b) { return memcmp(a, b, sizeof *a) == 0; }

// FSDP_CONV_LAYOUT=plain|blocked, read on each call so tests and benchmarks can switch it; else the
// measured rule of the header
static int conv_layout(const fsdp_conv_geom* g, int pass) {
  const char* s = getenv("FSDP_CONV_LAYOUT");
  if (s && !strcmp(s, "plain")) return 0;
  if (s && !strcmp(s, "blocked")) return 1;
  if (g->kh == 1 && g->kw == 1) return 0;
  if (pass == BWD_DATA && g->C / g->groups < 16) return 0;
  return 1;
}

// Winograd F(4x4, 3x3) (oneDNN's jit_wino_4x3: 3x3, stride 1, float32, AVX-512), for layers of 16+
// channels in and out (it takes the RGB stem too, but runs it 2-3x slower than direct):
// 2.0-2.6x the direct kernels' speed on the 3x3 layers of the bench models (2-core AMD EPYC), with
// rounding a few times the direct kernels' (tests/backends/conv_paths_spec.lua bounds it). Tried first
// wherever oneDNN has it, unless FSDP_CONV_ALGO=direct; a geometry oneDNN refuses runs direct.
static int winograd_allowed(void) {
  const char* s = getenv("FSDP_CONV_ALGO");
  return !(s && !strcmp(s, "direct"));
}
static int use_winograd(const conv_entry* e) {
  const fsdp_conv_geom* g = &e->g;
  return winograd_allowed() && e->dtype == FSDP_F32 && g->kh == 3 && g->kw == 3 && g->sh == 1 && g->sw == 1 &&
         g->dh == 1 && g->dw == 1 && g->groups == 1 && g->C >= 16 && g->O >= 16;
}

// what the environment asks of a pass: its layout (bit 0) and whether Winograd may run (bit 1)
static int pass_choice(const fsdp_conv_geom* g, int pass) { return conv_layout(g, pass) | winograd_allowed() << 1; }

static void destroy_pass(conv_pass* p) {
  dnnl_primitive_destroy(p->prim);
  for (int i = 0; i < 3; i++) {
    dnnl_primitive_destroy(p->to_md[i]);
    dnnl_primitive_destroy(p->from_md[i]);
  }
  memset(p, 0, sizeof *p);
}

// the plain layouts of g; 1 when oneDNN should not take it
static int make_entry(const fsdp_conv_geom* g, int dtype, int has_bias, int threads, conv_entry* e) {
  memset(e, 0, sizeof *e);
  e->g = *g;
  e->dtype = dtype;
  e->has_bias = has_bias;
  e->threads = threads;
  // rows of x the last window's bottom reaches past (padding) or stops short of (negative)
  int64_t pr = (g->OH - 1) * g->sh + (int64_t)(g->kh - 1) * g->dh + 1 - g->H - g->ph;
  int64_t pc = (g->OW - 1) * g->sw + (int64_t)(g->kw - 1) * g->dw + 1 - g->W - g->pw;
  e->Hx = pr < 0 ? g->H + pr : g->H, e->Wx = pc < 0 ? g->W + pc : g->W;
  e->pad_r[0] = pr < 0 ? 0 : pr, e->pad_r[1] = pc < 0 ? 0 : pc;
  int64_t G = g->groups;
  dnnl_dims_t xd = {g->N, g->C, e->Hx, e->Wx}, yd = {g->N, g->O, g->OH, g->OW}, bd = {g->O};
  dnnl_dims_t xs = {g->C * g->H * g->W, g->H * g->W, g->W, 1};  // x's strides (N, C, H, W)
  dnnl_dims_t wd = {G, g->O / G, g->C / G, g->kh, g->kw};
  int wnd = 5;
  dnnl_format_tag_t wtag = dnnl_goihw;
  if (G == 1) {  // (O, C, kh, kw)
    wd[0] = g->O, wd[1] = g->C, wd[2] = g->kh, wd[3] = g->kw;
    wnd = 4, wtag = dnnl_oihw;
  }
  dnnl_data_type_t dt = dtype == FSDP_BF16 ? dnnl_bf16 : dnnl_f32;
  if (dnnl_memory_desc_init_by_strides(&e->x_md, 4, xd, dt, xs) ||
      dnnl_memory_desc_init_by_strides(&e->gx_md, 4, xd, dnnl_f32, xs) ||
      dnnl_memory_desc_init_by_tag(&e->w_md, wnd, wd, dt, wtag) ||
      dnnl_memory_desc_init_by_tag(&e->gw_md, wnd, wd, dnnl_f32, wtag) ||
      dnnl_memory_desc_init_by_tag(&e->b_md, 1, bd, dnnl_f32, dnnl_x) ||
      dnnl_memory_desc_init_by_tag(&e->gy_md, 4, yd, dt, dnnl_nchw) ||
      dnnl_memory_desc_init_by_tag(&e->y_md, 4, yd, dnnl_f32, dnnl_nchw))
    return 1;
  return 0;
}

// the descriptor of pass `pass` of e over x, w, y (in `any` layouts when blocked); 1 on failure
static int conv_desc(const conv_entry* e, int pass, dnnl_alg_kind_t alg, const dnnl_memory_desc_t* x,
                     const dnnl_memory_desc_t* w, const dnnl_memory_desc_t* y, dnnl_convolution_desc_t* cd) {
  const fsdp_conv_geom* g = &e->g;
  dnnl_dims_t strides = {g->sh, g->sw}, dil = {g->dh - 1, g->dw - 1}, pad_l = {g->ph, g->pw};
  dnnl_dims_t pad_r = {e->pad_r[0], e->pad_r[1]};
  const dnnl_memory_desc_t* b = e->has_bias ? &e->b_md : NULL;
  dnnl_status_t st;
  if (pass == BWD_DATA)
    st = dnnl_dilated_convolution_backward_data_desc_init(cd, alg, x, w, y, strides, dil, pad_l, pad_r);
  else if (pass == BWD_WEIGHTS)
    st = dnnl_dilated_convolution_backward_weights_desc_init(cd, alg, x, w, b, y, strides, dil, pad_l, pad_r);
  else
    st = dnnl_dilated_convolution_forward_desc_init(cd, dnnl_forward_training, alg, x, w, b, y, strides, dil, pad_l,
                                                    pad_r);
  return st != dnnl_success;
}

// a reorder between two layouts of one tensor; NULL (and 0) when they are the same
static int make_reorder(const dnnl_memory_desc_t* from, const dnnl_memory_desc_t* to, dnnl_primitive_t* out) {
  *out = NULL;
  if (dnnl_memory_desc_equal(from, to)) return 0;
  dnnl_primitive_desc_t pd;
  if (dnnl_reorder_primitive_desc_create(&pd, from, g_engine, to, g_engine, NULL) != dnnl_success) return 1;
  dnnl_status_t st = dnnl_primitive_create(out, pd);
  dnnl_primitive_desc_destroy(pd);
  return st != dnnl_success;
}

// the primitive descriptor of pass p of e in the plain or blocked layout, or NULL when oneDNN has
// none, or only its reference code (C loops 10-100x slower than its JIT kernels: x described with
// strides, as for a negative right padding, gets that in the plain layout)
static dnnl_primitive_desc_t pass_desc(const conv_entry* e, int pass, int blocked, dnnl_alg_kind_t alg) {
  // x, w, y as this pass sees them (the operands in their dtype, its result in float32), and as
  // the forward that hints a backward pass sees them (all in the operand dtype)
  const dnnl_memory_desc_t* role[NPASS][3] = {
      {&e->x_md, &e->w_md, &e->y_md}, {&e->gx_md, &e->w_md, &e->gy_md}, {&e->x_md, &e->gw_md, &e->gy_md}};
  const dnnl_memory_desc_t* hint_role[3] = {&e->x_md, &e->w_md, &e->gy_md};
  dnnl_memory_desc_t md[3], hmd[3];
  for (int i = 0; i < 3; i++) {
    md[i] = *role[pass][i], hmd[i] = *hint_role[i];
    if (blocked &&
        (dnnl_memory_desc_init_by_tag(&md[i], md[i].ndims, md[i].dims, md[i].data_type, dnnl_format_tag_any) ||
         dnnl_memory_desc_init_by_tag(&hmd[i], hmd[i].ndims, hmd[i].dims, hmd[i].data_type, dnnl_format_tag_any)))
      return NULL;
  }
  dnnl_convolution_desc_t fd, cd;
  if (conv_desc(e, pass, alg, &md[0], &md[1], &md[2], &cd)) return NULL;
  if (pass != FWD && conv_desc(e, FWD, alg, &hmd[0], &hmd[1], &hmd[2], &fd)) return NULL;
  dnnl_primitive_attr_t attr;
  if (dnnl_primitive_attr_create(&attr)) return NULL;
  dnnl_primitive_attr_set_scratchpad_mode(attr, dnnl_scratchpad_mode_user);
  dnnl_primitive_desc_t hint = NULL, pd = NULL;
  int bad = 0;
  if (pass != FWD) bad = dnnl_primitive_desc_create(&hint, &fd, NULL, g_engine, NULL) != dnnl_success;
  if (!bad) bad = dnnl_primitive_desc_create(&pd, &cd, attr, g_engine, hint) != dnnl_success;
  dnnl_primitive_attr_destroy(attr);
  dnnl_primitive_desc_destroy(hint);
  const char* impl = NULL;
  if (!bad && dnnl_primitive_desc_query(pd, dnnl_query_impl_info_str, 0, &impl) == dnnl_success && impl &&
      strncmp(impl, "ref", 3) == 0)
    bad = 1;
  if (bad) {
    dnnl_primitive_desc_destroy(pd);
    return NULL;
  }
  return pd;
}

// our plain layout of operand i of a pass (its two inputs, then its output)
static const dnnl_memory_desc_t* plain_md(const conv_entry* e, int pass, int i) {
  const dnnl_memory_desc_t* plain[NPASS][3] = {
      {&e->x_md, &e->w_md, &e->y_md}, {&e->gy_md, &e->w_md, &e->gx_md}, {&e->x_md, &e->gy_md, &e->gw_md}};
  return plain[pass][i];
}

// creates pass p of e: 0, or 1 when oneDNN refuses it (the pass is then left to the caller)
static int make_pass(conv_entry* e, int pass) {
  conv_pass* p = &e->pass[pass];
  p->wanted = pass_choice(&e->g, pass);
  int blocked = p->wanted & 1;  // the layout it runs in (blocked where plain would be oneDNN's reference code)
  dnnl_primitive_desc_t pd = NULL;
  if (use_winograd(e)) pd = pass_desc(e, pass, blocked = 1, dnnl_convolution_winograd);
  if (!pd) pd = pass_desc(e, pass, blocked = p->wanted & 1, dnnl_convolution_direct);
  if (!pd && !blocked) pd = pass_desc(e, pass, 1, dnnl_convolution_direct);
  int bad = 0;
  if (!pd) return 1;
  // operands: (inputs..., output) and our plain layout of each
  static const dnnl_query_t qs[NPASS][3] = {
      {dnnl_query_src_md, dnnl_query_weights_md, dnnl_query_dst_md},
      {dnnl_query_diff_dst_md, dnnl_query_weights_md, dnnl_query_diff_src_md},
      {dnnl_query_src_md, dnnl_query_diff_dst_md, dnnl_query_diff_weights_md},
  };
  static const int args[NPASS][3] = {
      {DNNL_ARG_SRC, DNNL_ARG_WEIGHTS, DNNL_ARG_DST},
      {DNNL_ARG_DIFF_DST, DNNL_ARG_WEIGHTS, DNNL_ARG_DIFF_SRC},
      {DNNL_ARG_SRC, DNNL_ARG_DIFF_DST, DNNL_ARG_DIFF_WEIGHTS},
  };
  for (int i = 0; i < 3 && !bad; i++) {
    p->arg[i] = args[pass][i];
    p->md[i] = *dnnl_primitive_desc_query_md(pd, qs[pass][i], 0);
    bad = i < 2 ? make_reorder(plain_md(e, pass, i), &p->md[i], &p->to_md[i])
                : make_reorder(&p->md[i], plain_md(e, pass, i), &p->from_md[i]);
  }
  p->scratch_md = *dnnl_primitive_desc_query_md(pd, dnnl_query_scratchpad_md, 0);
  p->scratch = dnnl_memory_desc_get_size(&p->scratch_md);
  if (!bad) bad = dnnl_primitive_create(&p->prim, pd) != dnnl_success;
  dnnl_primitive_desc_destroy(pd);
  if (bad) destroy_pass(p);
  return bad;
}

// the cached entry of g with pass ready; NULL with *rc 1 (not for oneDNN) or -1 (error set)
static conv_entry* entry_for(const fsdp_conv_geom* g, int dtype, int has_bias, int pass, int* rc) {
  pthread_once(&g_engine_once, engine_init);
  *rc = 1;
  if (!g_engine) return NULL;
  int threads = omp_get_max_threads();  // fsdp.set_num_threads changes it: a new entry then
  pthread_mutex_lock(&g_cache_lock);
  conv_entry* e = NULL;
  for (int i = 0; i < g_cache_n && !e; i++)
    if (g_cache[i].dtype == dtype && g_cache[i].has_bias == has_bias && g_cache[i].threads == threads &&
        same_geom(&g_cache[i].g, g))
      e = &g_cache[i];
  if (!e) {
    conv_entry fresh;
    if (make_entry(g, dtype, has_bias, threads, &fresh) == 0) {
      int slot;
      if (g_cache_n < CACHE_SLOTS) {
        slot = g_cache_n++;
      } else {  // full: replace the oldest
        slot = g_cache_next;
        g_cache_next = (g_cache_next + 1) % CACHE_SLOTS;
        for (int k = 0; k < NPASS; k++) destroy_pass(&g_cache[slot].pass[k]);
      }
      g_cache[slot] = fresh;
      e = &g_cache[slot];
    }
  }
  // a layout or algorithm forced (FSDP_CONV_LAYOUT, FSDP_CONV_ALGO) since the pass was made: make it
  // again (tests and benchmarks switch them between calls, never while one runs)
  if (e && e->pass[pass].prim && e->pass[pass].wanted != pass_choice(g, pass)) destroy_pass(&e->pass[pass]);
  if (e && !e->pass[pass].prim && make_pass(e, pass)) e = NULL;
  pthread_mutex_unlock(&g_cache_lock);
  if (e) *rc = 0;
  return e;
}

// a oneDNN memory object over buf in layout md
static dnnl_memory_t mem(const dnnl_memory_desc_t* md, void* buf) {
  dnnl_memory_t m = NULL;
  if (dnnl_memory_create(&m, md, g_engine, buf) != dnnl_success) return NULL;
  return m;
}

static int run_prim(dnnl_primitive_t prim, dnnl_stream_t s, int n, const dnnl_exec_arg_t* args) {
  return dnnl_primitive_execute(prim, s, n, args) == dnnl_success ? 0 : -1;
}

// plain src (layout from) -> dst (layout to) through reorder r
static int run_reorder(dnnl_primitive_t r, dnnl_stream_t s, const dnnl_memory_desc_t* from, const void* src,
                       const dnnl_memory_desc_t* to, void* dst) {
  dnnl_memory_t a = mem(from, unconst(src)), b = mem(to, dst);
  int rc = a && b ? run_prim(r, s, 2, (dnnl_exec_arg_t[]){{DNNL_ARG_FROM, a}, {DNNL_ARG_TO, b}}) : -1;
  dnnl_memory_destroy(a);
  dnnl_memory_destroy(b);
  return rc;
}

// an operand that one pass may hand to the next (gy, reordered once for both backward passes); its
// buffer (bytes long) belongs to whoever holds the struct
typedef struct {
  const dnnl_memory_desc_t* md;
  void* buf;
  size_t bytes;
} shared_operand;

// runs pass p of e on our plain buffers io[3] (two inputs, then the output), with a plain bias
// operand (forward: the bias; weight gradient: the bias gradient). With share, input `share_at`
// reuses share's buffer when its layout matches, or leaves its own reordered copy there.
static int run_pass(conv_entry* e, int pass, dnnl_stream_t s, void* io[3], void* bias, int share_at,
                    shared_operand* share) {
  conv_pass* p = &e->pass[pass];
  void* buf[3] = {NULL, NULL, NULL};
  size_t bytes[3] = {0, 0, 0};
  void* scratch = NULL;
  dnnl_memory_t m[5] = {NULL, NULL, NULL, NULL, NULL};
  int rc = 0;
  for (int i = 0; i < 3 && !rc; i++) {
    dnnl_primitive_t r = i < 2 ? p->to_md[i] : p->from_md[i];
    if (!r) {
      buf[i] = io[i];
      continue;
    }
    if (share && i == share_at && share->buf && dnnl_memory_desc_equal(share->md, &p->md[i])) {
      buf[i] = share->buf;
      continue;
    }
    bytes[i] = dnnl_memory_desc_get_size(&p->md[i]);
    buf[i] = fsdp_alloc(bytes[i], FSDP_CPU, FSDP_MEM_OTHER);
    if (!buf[i]) rc = -1;
    else if (i < 2) rc = run_reorder(r, s, plain_md(e, pass, i), io[i], &p->md[i], buf[i]);
  }
  if (!rc && p->scratch) {
    scratch = fsdp_alloc(p->scratch, FSDP_CPU, FSDP_MEM_OTHER);
    if (!scratch) rc = -1;
  }
  if (!rc) {
    dnnl_exec_arg_t args[5];
    int n = 0;
    for (int i = 0; i < 3; i++) {
      m[i] = mem(&p->md[i], buf[i]);
      args[n++] = (dnnl_exec_arg_t){p->arg[i], m[i]};
    }
    if (bias) {
      m[3] = mem(&e->b_md, bias);
      args[n++] = (dnnl_exec_arg_t){pass == FWD ? DNNL_ARG_BIAS : DNNL_ARG_DIFF_BIAS, m[3]};
    }
    if (scratch) {
      m[4] = mem(&p->scratch_md, scratch);
      args[n++] = (dnnl_exec_arg_t){DNNL_ARG_SCRATCHPAD, m[4]};
    }
    for (int i = 0; i < 5; i++)
      if ((i < 3 || (i == 3 && bias) || (i == 4 && scratch)) && !m[i]) rc = -1;
    if (!rc) rc = run_prim(p->prim, s, n, args);
    if (!rc) g_passes[e->dtype == FSDP_BF16]++;
    if (!rc && p->from_md[2]) rc = run_reorder(p->from_md[2], s, &p->md[2], buf[2], plain_md(e, pass, 2), io[2]);
    if (!rc) rc = dnnl_stream_wait(s) == dnnl_success ? 0 : -1;
  }
  for (int i = 0; i < 5; i++) dnnl_memory_destroy(m[i]);
  fsdp_free(scratch, p->scratch, FSDP_CPU, FSDP_MEM_OTHER);
  for (int i = 0; i < 3; i++) {
    if (!bytes[i]) continue;
    if (share && i == share_at && !share->buf && !rc) {  // hand the reordered input to the next pass
      *share = (shared_operand){&p->md[i], buf[i], bytes[i]};
      continue;
    }
    fsdp_free(buf[i], bytes[i], FSDP_CPU, FSDP_MEM_OTHER);
  }
  CHECK_INT(!rc, "conv2d: oneDNN failed in the %s of x (%lld, %lld, %lld, %lld) with weight (%lld, %lld, %d, %d)",
            pass_names[pass], (long long)e->g.N, (long long)e->g.C, (long long)e->g.H, (long long)e->g.W,
            (long long)e->g.O, (long long)(e->g.C / e->g.groups), e->g.kh, e->g.kw);
  return 0;
}

static int empty(const fsdp_conv_geom* g) { return g->N * g->C * g->H * g->W == 0 || g->O * g->OH * g->OW == 0; }

int fsdp_cpu_onednn_conv2d_forward(const fsdp_conv_geom* g, int dtype, float* y, const void* x, const void* w,
                                   const float* b) {
  if (empty(g)) return 1;
  int rc;
  // the entry stays valid while we run it: entries are replaced only when 64 other geometries
  // came after it, and a step uses far fewer
  conv_entry* e = entry_for(g, dtype, b != NULL, FWD, &rc);
  if (!e) return rc;
  dnnl_stream_t s;
  CHECK_INT(dnnl_stream_create(&s, g_engine, dnnl_stream_default_flags) == dnnl_success,
            "conv2d: oneDNN could not create a stream");
  rc = run_pass(e, FWD, s, (void*[]){unconst(x), unconst(w), y}, unconst(b), -1, NULL);
  dnnl_stream_destroy(s);
  return rc;
}

int fsdp_cpu_onednn_conv2d_backward(const fsdp_conv_geom* g, int dtype, float* gx, float* gw, float* gb, const void* gy,
                                    const void* x, const void* w) {
  if (empty(g) || (!gx && !gw)) return 1;
  int rc = 0;
  conv_entry* ed = gx ? entry_for(g, dtype, gb != NULL, BWD_DATA, &rc) : NULL;
  if (gx && !ed) return rc;
  conv_entry* ew = gw ? entry_for(g, dtype, gb != NULL, BWD_WEIGHTS, &rc) : NULL;
  if (gw && !ew) return rc;
  dnnl_stream_t s;
  CHECK_INT(dnnl_stream_create(&s, g_engine, dnnl_stream_default_flags) == dnnl_success,
            "conv2d: oneDNN could not create a stream");
  if (gx && (ed->Hx < g->H || ed->Wx < g->W)) {  // the rows and columns no window reaches: gradient 0
    for (int64_t plane = 0; plane < g->N * g->C; plane++) {
      float* xp = gx + plane * g->H * g->W;
      for (int64_t h = 0; h < g->H; h++)
        if (h < ed->Hx) memset(xp + h * g->W + ed->Wx, 0, (size_t)(g->W - ed->Wx) * sizeof(float));
        else memset(xp + h * g->W, 0, (size_t)g->W * sizeof(float));
    }
  }
  shared_operand gy_once = {NULL, NULL, 0};  // gy in the blocked layout, made by the first pass
  if (gx) rc = run_pass(ed, BWD_DATA, s, (void*[]){unconst(gy), unconst(w), gx}, NULL, 0, &gy_once);
  if (!rc && gw) rc = run_pass(ew, BWD_WEIGHTS, s, (void*[]){unconst(x), unconst(gy), gw}, gb, 1, &gy_once);
  fsdp_free(gy_once.buf, gy_once.bytes, FSDP_CPU, FSDP_MEM_OTHER);
  dnnl_stream_destroy(s);
  return rc;
}
