/*
 * core/tensor.c -- errors, the counting allocator, the RNG, dtypes, the backend registry,
 * storage and tensor lifetime, views and strided copies.
 */
#define _GNU_SOURCE  // dladdr
#include "core/core.h"

#include <dlfcn.h>

#include <pthread.h>
#include <stdatomic.h>

#include <math.h>

// ---- errors ------------------------------------------------------------------------------------
static _Thread_local char g_error[2048];

const char* fsdp_last_error(void) { return g_error; }
void fsdp_clear_error(void) { g_error[0] = 0; }
void fsdp_set_error(const char* msg) { snprintf(g_error, sizeof g_error, "%s", msg ? msg : ""); }
void fsdp_errorf(const char* fmt, ...) {
  char tmp[sizeof g_error];  // the message may quote the previous error
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(tmp, sizeof tmp, fmt, ap);
  va_end(ap);
  memcpy(g_error, tmp, sizeof g_error);
}

// ---- growable arrays ------------------------------------------------------------------------------
int fsdp_grow(void* pv, int* cap, int need, size_t size, const char* what) {
  if (need <= *cap) return 0;
  int64_t n = *cap > 0 ? *cap : 16;
  while (n < need) n *= 2;
  void* old;
  memcpy(&old, pv, sizeof old);  // pv is a T**: read and write the pointer without type punning
  CHECK_INT(n <= INT32_MAX, "%s: more than %d elements", what, INT32_MAX);
  void* p = realloc(old, (size_t)n * size);
  CHECK_INT(p, "%s: out of memory (%lld elements of %zu bytes)", what, (long long)n, size);
  memcpy(pv, &p, sizeof p);
  *cap = (int)n;
  return 0;
}

const char* fsdp_dims_s(int ndim, const int64_t* shape) {
  static _Thread_local char bufs[8][160];
  static _Thread_local int k;
  char* b = bufs[k++ & 7];
  int n = snprintf(b, 160, "(");
  for (int i = 0; i < ndim && n < 150; i++) n += snprintf(b + n, 160 - n, i ? ", %lld" : "%lld", (long long)shape[i]);
  snprintf(b + n, 160 - n, ")");
  return b;
}
const char* fsdp_shape_s(const fsdp_tensor* t) { return fsdp_dims_s(t->ndim, t->shape); }
const char* fsdp_shape_str(const fsdp_tensor* t, char* buf, int buflen) {
  snprintf(buf, buflen, "%s", fsdp_shape_s(t));
  return buf;
}

const char* fsdp_version(void) { return "0.1.0"; }

// ---- memory: every byte goes through here, counted per category --------------------------------
// Threads may run independent models at once: the counters are atomic (they count the process),
// the GC pressure and the default category belong to the calling thread (its Lua state), and the
// block cache is locked.
static _Atomic int64_t g_mem_cur[FSDP_NDEVICES][FSDP_MEM_NCAT], g_mem_peak[FSDP_NDEVICES][FSDP_MEM_NCAT];
static _Thread_local int64_t g_gc_pressure;
static _Thread_local int g_default_cat = FSDP_MEM_ACTIVATIONS;

static void mem_count(int device, int cat, int64_t delta) {
  int64_t now = atomic_fetch_add(&g_mem_cur[device][cat], delta) + delta;
  int64_t peak = atomic_load(&g_mem_peak[device][cat]);
  while (now > peak && !atomic_compare_exchange_weak(&g_mem_peak[device][cat], &peak, now)) {}
}

// Freed blocks of 64 KiB and more are kept for reuse by size (a training step allocates the
// same sizes every step); fresh pages from the OS cost a page fault each. The cache holds at
// most FSDP_CACHE_MAX bytes and is emptied before an allocation is allowed to fail.
#define FSDP_CACHE_MIN (64u << 10)
#define FSDP_CACHE_MAX ((size_t)1 << 30)
#define FSDP_CACHE_SLOTS 256
static struct {
  void* p;
  int device;
  size_t size;
} g_cache[FSDP_CACHE_SLOTS];
static int g_cache_n;
static size_t g_cache_bytes;
static pthread_mutex_t g_cache_lock = PTHREAD_MUTEX_INITIALIZER;

static const fsdp_backend* g_backends[FSDP_NDEVICES];
static void cache_evict(int i) {  // with g_cache_lock held
  g_backends[g_cache[i].device]->free(g_cache[i].p, g_cache[i].size);
  g_cache_bytes -= g_cache[i].size;
  g_cache[i] = g_cache[--g_cache_n];
}
void fsdp_memory_empty_cache(void) {
  pthread_mutex_lock(&g_cache_lock);
  while (g_cache_n) cache_evict(g_cache_n - 1);
  pthread_mutex_unlock(&g_cache_lock);
}

// the bytes a block of nbytes takes: 64-byte multiples, at least 64
static size_t padded_size(size_t nbytes) {
  size_t padded = (nbytes + 63) & ~(size_t)63;
  return padded ? padded : 64;
}
// the counters' side of a new block of nbytes in category cat (fsdp_alloc, pinned_alloc)
static void count_alloc(int device, int cat, size_t nbytes) {
  mem_count(device, cat, (int64_t)nbytes);
  if (cat == FSDP_MEM_ACTIVATIONS) g_gc_pressure += (int64_t)nbytes;
}

void* fsdp_alloc(size_t nbytes, int device, int cat) {
  const fsdp_backend* b = fsdp_backend_for(device);
  if (!b) return NULL;
  size_t padded = padded_size(nbytes);
  void* p = NULL;
  if (padded >= FSDP_CACHE_MIN) {
    pthread_mutex_lock(&g_cache_lock);
    for (int i = g_cache_n - 1; i >= 0; i--)
      if (g_cache[i].size == padded && g_cache[i].device == device) {
        p = g_cache[i].p;
        g_cache_bytes -= padded;
        g_cache[i] = g_cache[--g_cache_n];
        break;
      }
    pthread_mutex_unlock(&g_cache_lock);
  }
  if (!p) p = b->alloc(padded);
  if (!p) {
    fsdp_memory_empty_cache();
    p = b->alloc(padded);
  }
  if (!p) {  // what was asked, what is in use per category on that device, what the cache holds
    static const char* names[FSDP_MEM_NCAT] = {"params", "grads", "optimizer", "activations", "comm", "other"};
    char use[320];
    size_t len = 0;
    for (int c = 0; c < FSDP_MEM_NCAT; c++)
      len += snprintf(use + len, len < sizeof use ? sizeof use - len : 0, "%s%s %.1f MiB", c ? ", " : "", names[c],
                      (double)atomic_load(&g_mem_cur[device][c]) / 1048576.0);
    pthread_mutex_lock(&g_cache_lock);
    size_t cached = g_cache_bytes;
    pthread_mutex_unlock(&g_cache_lock);
    fsdp_errorf("alloc: out of memory allocating %zu bytes (%.1f MiB) on %s; in use there: %s; cached: %.1f MiB (all "
                "devices)",
                nbytes, (double)nbytes / 1048576.0, fsdp_device_name(device), use, (double)cached / 1048576.0);
    return NULL;
  }
  count_alloc(device, cat, nbytes);
  return p;
}
void fsdp_free(void* p, size_t nbytes, int device, int cat) {
  if (!p) return;
  mem_count(device, cat, -(int64_t)nbytes);
  size_t padded = padded_size(nbytes);
  if (padded < FSDP_CACHE_MIN || padded > FSDP_CACHE_MAX / 4) {
    g_backends[device]->free(p, padded);
    return;
  }
  pthread_mutex_lock(&g_cache_lock);
  while (g_cache_n && (g_cache_n == FSDP_CACHE_SLOTS || g_cache_bytes + padded > FSDP_CACHE_MAX)) cache_evict(0);
  g_cache[g_cache_n].p = p;
  g_cache[g_cache_n].device = device;
  g_cache[g_cache_n].size = padded;
  g_cache_n++;
  g_cache_bytes += padded;
  pthread_mutex_unlock(&g_cache_lock);
}
void fsdp_mem_move(size_t nbytes, int device, int from_cat, int to_cat) {
  mem_count(device, from_cat, -(int64_t)nbytes);
  mem_count(device, to_cat, (int64_t)nbytes);
}
int fsdp_memory_stats_device(int device, int64_t* current, int64_t* peak) {
  CHECK_INT(device >= 0 && device < FSDP_NDEVICES, "memory_stats: unknown device %d", device);
  for (int c = 0; c < FSDP_MEM_NCAT; c++) {
    if (current) current[c] = atomic_load(&g_mem_cur[device][c]);
    if (peak) peak[c] = atomic_load(&g_mem_peak[device][c]);
  }
  return 0;
}
void fsdp_memory_stats(int64_t* current, int64_t* peak) { fsdp_memory_stats_device(FSDP_CPU, current, peak); }
void fsdp_memory_reset_peaks(void) {
  for (int d = 0; d < FSDP_NDEVICES; d++)
    for (int c = 0; c < FSDP_MEM_NCAT; c++) atomic_store(&g_mem_peak[d][c], atomic_load(&g_mem_cur[d][c]));
}
const int64_t* fsdp_memory_gc_pressure(void) { return &g_gc_pressure; }
void fsdp_memory_gc_done(void) { g_gc_pressure = 0; }
int fsdp_default_mem_category(void) { return g_default_cat; }
void fsdp_set_default_mem_category(int cat) { g_default_cat = cat; }

// ---- RNG: xoshiro256** seeded by splitmix64; same stream on every machine ---------------------
// one generator per thread: a thread's stream depends only on its own seeds and draws
static _Thread_local uint64_t g_rng[4] = {0x9E3779B97F4A7C15ull, 0xBF58476D1CE4E5B9ull, 0x94D049BB133111EBull, 1};

static uint64_t splitmix64(uint64_t* x) {
  uint64_t z = (*x += 0x9E3779B97F4A7C15ull);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}
void fsdp_manual_seed(uint64_t seed) {
  for (int i = 0; i < 4; i++) g_rng[i] = splitmix64(&seed);
}
void fsdp_rng_get_state(uint64_t* s) { memcpy(s, g_rng, sizeof g_rng); }
void fsdp_rng_set_state(const uint64_t* s) { memcpy(g_rng, s, sizeof g_rng); }
static inline uint64_t rotl(uint64_t x, int k) { return (x << k) | (x >> (64 - k)); }
uint64_t fsdp_rng_next(void) {
  uint64_t* s = g_rng;
  uint64_t r = rotl(s[1] * 5, 7) * 9, t = s[1] << 17;
  s[2] ^= s[0];
  s[3] ^= s[1];
  s[1] ^= s[2];
  s[0] ^= s[3];
  s[2] ^= t;
  s[3] = rotl(s[3], 45);
  return r;
}
double fsdp_rng_uniform(void) { return (double)(fsdp_rng_next() >> 11) * 0x1.0p-53; }
// counter-based: splitmix64's finaliser of the counter, offset by the key and mixed again (each
// value depends on key and counter only; neighbouring counters and keys give unrelated bits)
static uint64_t mix64(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}
static double draw_bits(uint64_t key, uint64_t counter) {
  uint64_t z = mix64(key + mix64(counter * 0x9E3779B97F4A7C15ull + 0xD1B54A32D192ED03ull));
  return (double)(z >> 11) * 0x1.0p-53;
}
double fsdp_draw_uniform(uint64_t key, int64_t i) { return draw_bits(key, 2 * (uint64_t)i); }
double fsdp_draw_normal(uint64_t key, int64_t i) {  // Box-Muller on counters 2i and 2i + 1
  double u1 = draw_bits(key, 2 * (uint64_t)i), u2 = draw_bits(key, 2 * (uint64_t)i + 1);
  if (u1 < 1e-300) u1 = 1e-300;
  return sqrt(-2.0 * log(u1)) * cos(6.283185307179586 * u2);
}
double fsdp_rng_normal(void) {  // Box-Muller, one value per call (no hidden cached state)
  double u1 = fsdp_rng_uniform(), u2 = fsdp_rng_uniform();
  if (u1 < 1e-300) u1 = 1e-300;
  return sqrt(-2.0 * log(u1)) * cos(6.283185307179586 * u2);
}

// ---- dtypes ---------------------------------------------------------------------------------------
size_t fsdp_dtype_size(int dtype) {
  static const size_t sz[FSDP_NDTYPES] = {4, 8, 2, 2, 1};
  return dtype >= 0 && dtype < FSDP_NDTYPES ? sz[dtype] : 0;
}
const char* fsdp_dtype_name(int dtype) {
  static const char* names[FSDP_NDTYPES] = {"float32", "int64", "bfloat16", "float16", "bool"};
  return dtype >= 0 && dtype < FSDP_NDTYPES ? names[dtype] : "unknown";
}

// ---- backends: the registry (g_backends is declared above, with the allocator) ----------------------
static const char* const g_device_names[FSDP_NDEVICES] = {"cpu", "cuda"};

const char* fsdp_device_name(int device) {
  return device >= 0 && device < FSDP_NDEVICES ? g_device_names[device] : "unknown";
}

// whether the n function pointers of a table starting at `table` are all set; *missing gets the
// index of the first that is not
typedef void (*fsdp_any_fn)(void);
static int table_complete(const void* table, size_t nbytes, int* missing) {
  for (size_t i = 0; i < nbytes / sizeof(fsdp_any_fn); i++) {
    fsdp_any_fn f;
    memcpy(&f, (const char*)table + i * sizeof f, sizeof f);
    if (!f) {
      *missing = (int)i;
      return 0;
    }
  }
  return 1;
}

int fsdp_backend_check(const fsdp_backend* b) {
  // the device functions (everything between name and the first kernel table), then each table
  int missing = 0;
  size_t first = offsetof(fsdp_backend, alloc), end = offsetof(fsdp_backend, elem);
  CHECK_INT(table_complete((const char*)b + first, end - first, &missing),
            "backend %s: device function %d (counting from alloc) is missing", b->name, missing);
  const struct {
    const char* family;
    const void* table;
    size_t size;
  } tables[] = {{"elem", b->elem, sizeof *b->elem},
                {"linalg", b->linalg, sizeof *b->linalg},
                {"nn", b->nn, sizeof *b->nn},
                {"optim", b->optim, sizeof *b->optim},
                {"norm", b->norm, sizeof *b->norm}};
  for (size_t i = 0; i < sizeof tables / sizeof *tables; i++) {
    CHECK_INT(tables[i].table, "backend %s: no %s kernel table", b->name, tables[i].family);
    CHECK_INT(table_complete(tables[i].table, tables[i].size, &missing),
              "backend %s: %s kernel %d (in core/kernels_%s.h order) is missing", b->name, tables[i].family, missing,
              tables[i].family);
  }
  return 0;
}

int fsdp_backend_register(int device, const fsdp_backend* b) {
  CHECK_INT(device >= 0 && device < FSDP_NDEVICES, "backend %s: unknown device %d", b->name, device);
  CHECK_INT(!g_backends[device], "backend %s: device %s already has the backend %s", b->name, fsdp_device_name(device),
            g_backends[device]->name);
  if (fsdp_backend_check(b)) return -1;
  g_backends[device] = b;
  return 0;
}

// ---- optional backends: shared libraries loaded at run time ----------------------------------------
// $env_var, else `name` next to this libfsdp.so, else the default search path; NULL with the
// reasons of every try in `tried` (the message fsdp_errorf gets is the caller's to write)
void* fsdp_dlopen_backend(const char* env_var, const char* name, int flags, char* tried, size_t tried_len) {
  char cands[3][4096];
  int nc = 0;
  const char* env = getenv(env_var);
  if (env && *env) {
    snprintf(cands[nc++], sizeof cands[0], "%s", env);
  } else {
    Dl_info info;
    if (dladdr((void*)&fsdp_dlopen_backend, &info) && info.dli_fname) {
      const char* slash = strrchr(info.dli_fname, '/');
      if (slash) snprintf(cands[nc++], sizeof cands[0], "%.*s/%s", (int)(slash - info.dli_fname), info.dli_fname, name);
    }
    snprintf(cands[nc++], sizeof cands[0], "%s", name);
  }
  size_t len = 0;
  if (tried_len) tried[0] = 0;
  for (int i = 0; i < nc; i++) {
    void* h = dlopen(cands[i], flags);
    if (h) return h;
    const char* e = dlerror();
    len += snprintf(tried + len, len < tried_len ? tried_len - len : 0, "%s%s", i ? "; " : "", e ? e : cands[i]);
  }
  return NULL;
}

const fsdp_backend* fsdp_backend_for(int device) {
  CHECK_NULL(device >= 0 && device < FSDP_NDEVICES && g_backends[device], "device %s has no backend loaded",
             fsdp_device_name(device));
  return g_backends[device];
}
// ---- deferred checks --------------------------------------------------------------------------------------
// the last CHECK_RING messages by id; an id that old is reported without its details
#define CHECK_RING 256
static char g_check_msg[CHECK_RING][512];
static int g_check_next;
static pthread_mutex_t g_check_lock = PTHREAD_MUTEX_INITIALIZER;

int fsdp_check_defer(const char* fmt, ...) {
  pthread_mutex_lock(&g_check_lock);
  int id = ++g_check_next;
  if (id <= 0) id = g_check_next = 1;  // (wrapped around)
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(g_check_msg[id % CHECK_RING], sizeof g_check_msg[0], fmt, ap);
  va_end(ap);
  pthread_mutex_unlock(&g_check_lock);
  return id;
}
int fsdp_check_report(int id, int64_t value) {
  char msg[512];
  pthread_mutex_lock(&g_check_lock);
  int known = id > 0 && id <= g_check_next && g_check_next - id < CHECK_RING;
  snprintf(msg, sizeof msg, "%s", known ? g_check_msg[id % CHECK_RING] : "a device-side check failed with %lld");
  pthread_mutex_unlock(&g_check_lock);
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wformat-nonliteral"
  fsdp_errorf(msg, (long long)value);
#pragma GCC diagnostic pop
  return -1;
}

int fsdp_device_has_backend(int device) { return device >= 0 && device < FSDP_NDEVICES && g_backends[device]; }
const fsdp_backend* fsdp_backend_of(const fsdp_tensor* t) { return g_backends[fsdp_device_of(t)]; }

// ---- pinned host memory: a CPU storage's bytes from a device's host_alloc ------------------------------
// Counted in the CPU's categories as its other bytes (they are host memory), and in g_pinned_bytes;
// never cached here (the device's allocator keeps what it wants to keep: cudaMallocHost is slow).
static _Atomic int64_t g_pinned_bytes;

int fsdp_host_memory_device(void) {
  for (int d = 0; d < FSDP_NDEVICES; d++)
    if (g_backends[d] && g_backends[d]->host_alloc) return d;
  return -1;
}
int64_t fsdp_memory_pinned_bytes(void) { return atomic_load(&g_pinned_bytes); }
static void* pinned_alloc(size_t nbytes, int host, int cat) {
  void* p = g_backends[host]->host_alloc(padded_size(nbytes));
  CHECK_NULL(p, "pin_memory: out of pinned host memory allocating %zu bytes (%.1f MiB; %.1f MiB pinned now)", nbytes,
             (double)nbytes / 1048576.0, (double)atomic_load(&g_pinned_bytes) / 1048576.0);
  count_alloc(FSDP_CPU, cat, nbytes);
  atomic_fetch_add(&g_pinned_bytes, (int64_t)nbytes);
  return p;
}
static void pinned_free(void* p, size_t nbytes, int host, int cat) {
  if (!p) return;
  mem_count(FSDP_CPU, cat, -(int64_t)nbytes);
  atomic_fetch_sub(&g_pinned_bytes, (int64_t)nbytes);
  g_backends[host]->host_free(p, padded_size(nbytes));
}
int fsdp_is_pinned(const fsdp_tensor* t) { return t && t->storage && t->storage->pinned; }

// ---- storage and tensor lifetime ------------------------------------------------------------------
fsdp_storage* fsdp_storage_new_empty(size_t nbytes, int device, int cat) {
  if (!fsdp_backend_for(device)) return NULL;  // a storage exists only on a device with a backend
  fsdp_storage* s = calloc(1, sizeof *s);
  CHECK_NULL(s, "alloc: out of memory");
  s->refcount = 1;
  s->device = device;
  s->cat = cat;
  s->nbytes = nbytes;
  return s;
}
fsdp_storage* fsdp_storage_new(size_t nbytes, int device, int cat) {
  fsdp_storage* s = fsdp_storage_new_empty(nbytes, device, cat);
  if (s && fsdp_storage_ensure_data(s)) {
    free(s);
    return NULL;
  }
  return s;
}
int fsdp_storage_ensure_data(fsdp_storage* s) {
  if (s->data) return 0;
  s->data = s->pinned ? pinned_alloc(s->nbytes, s->pinned, s->cat) : fsdp_alloc(s->nbytes, s->device, s->cat);
  return s->data ? 0 : -1;
}
void fsdp_storage_drop_data(fsdp_storage* s) {
  if (s->pinned) pinned_free(s->data, s->nbytes, s->pinned, s->cat);
  else fsdp_free(s->data, s->nbytes, s->device, s->cat);
  s->data = NULL;
}
void fsdp_storage_release(fsdp_storage* s) {
  if (s && --s->refcount == 0) {
    fsdp_storage_drop_data(s);
    fsdp_storage_forget_deferred(s);
    free(s);
  }
}
int fsdp_storage_deferred(const fsdp_storage* s) {
  if (s->data) return 0;
  return s->meta ? FSDP_DEFERRED_META : s->source.read ? FSDP_DEFERRED_FILE : 0;
}
void fsdp_storage_forget_deferred(fsdp_storage* s) {
  for (int i = 0; i < s->nsteps; i++) fsdp_tensor_release(s->steps[i].src);
  free(s->steps);
  s->steps = NULL;
  s->nsteps = s->steps_cap = 0;
  s->meta = 0;
  if (s->source.release) s->source.release(s->source.ctx);
  memset(&s->source, 0, sizeof s->source);
}
static _Atomic(fsdp_materialize_fn) g_materialize;
void fsdp_set_materialize_hook(fsdp_materialize_fn fn) { atomic_store(&g_materialize, fn); }
int fsdp_storage_materialize(fsdp_storage* s) {
  fsdp_materialize_fn fn = atomic_load(&g_materialize);
  if (s->data || !s->owner || !fn) return 0;
  return fn(s->owner);
}
int fsdp_check_data(const char* op, const fsdp_tensor* t) {
  fsdp_storage* s = t->storage;
  if (s->data || s->nbytes == 0) return 0;
  CHECK_INT(!s->meta,
            "%s: tensor of shape %s is on meta (made inside fsdp.meta): it has no values yet. Materialise it first: "
            "fsdp.wrap(model) gives each rank its pieces, model:to_empty{device = ...} whole tensors",
            op, SH(t));
  if (s->source.read) {  // file-backed: read it all now, on its first use as an op's input
    if (fsdp_storage_ensure_data(s)) return -1;
    if (s->source.read(s->source.ctx, s->data, s->nbytes, 0)) {
      fsdp_storage_drop_data(s);
      return -1;
    }
    fsdp_storage_forget_deferred(s);
    return 0;
  }
  CHECK_INT(t->storage->data || t->storage->nbytes == 0,
            "%s: tensor of shape %s views the gathered parameters of an FSDP unit that is resharded now "
            "(use summon_full_params to read full parameters outside forward)",
            op, SH(t));
  return 0;
}

void fsdp_tensor_retain(fsdp_tensor* t) {
  if (t) t->refcount++;
}

void fsdp_tensor_release(fsdp_tensor* t) {
  if (!t || --t->refcount > 0) return;
  fsdp_storage_release(t->storage);
  if (t->grad_fn) fsdp_node_release(t->grad_fn);
  if (t->grad) fsdp_tensor_release(t->grad);
  fsdp_hooks_free(t->hooks);
  free(t);
}

int64_t fsdp_shape_numel(int ndim, const int64_t* shape) {
  int64_t n = 1;
  for (int i = 0; i < ndim; i++) n *= shape[i];
  return n;
}
// The one checked shape arithmetic: the byte count of `shape` at `es` bytes an element, or -1 with
// an error naming op and the shape when a size is negative or the count overflows int64. Sizes of 0
// count as 1 in the check, so a shape that passes also has contiguous strides and byte offsets that
// fit in int64.
int64_t fsdp_shape_nbytes(const char* op, int ndim, const int64_t* shape, size_t es) {
  int64_t bound = (int64_t)es;
  for (int i = 0; i < ndim; i++) {
    CHECK_INT(shape[i] >= 0, "%s: negative size %lld in shape %s", op, (long long)shape[i], fsdp_dims_s(ndim, shape));
    int64_t d = shape[i] > 0 ? shape[i] : 1;
    CHECK_INT(d <= INT64_MAX / bound,
              "%s: shape %s is too large: its elements of %zu bytes overflow int64 (at dim %d of size %lld)", op,
              fsdp_dims_s(ndim, shape), es, i + 1, (long long)shape[i]);
    bound *= d;
  }
  return fsdp_shape_numel(ndim, shape) * (int64_t)es;
}
void fsdp_contiguous_strides(int ndim, const int64_t* shape, int64_t* stride) {
  int64_t s = 1;
  for (int i = ndim - 1; i >= 0; i--) {
    stride[i] = s;
    s *= shape[i] > 0 ? shape[i] : 1;
  }
}

static fsdp_tensor* tensor_alloc(int ndim, const int64_t* shape, int dtype) {
  CHECK_NULL(ndim >= 0 && ndim <= FSDP_MAX_DIMS, "tensor: %d dims (at most %d supported)", ndim, FSDP_MAX_DIMS);
  CHECK_NULL(dtype >= 0 && dtype < FSDP_NDTYPES, "tensor: unknown dtype %d", dtype);
  if (fsdp_shape_nbytes("tensor", ndim, shape, fsdp_dtype_size(dtype)) < 0) return NULL;
  fsdp_tensor* t = calloc(1, sizeof *t);
  CHECK_NULL(t, "alloc: out of memory");
  t->refcount = 1;
  t->ndim = ndim;
  t->dtype = dtype;
  if (ndim > 0) memcpy(t->shape, shape, ndim * sizeof(int64_t));  // (a 0-dim tensor may pass no shape)
  return t;
}

fsdp_tensor* fsdp_new(int ndim, const int64_t* shape, int dtype, int device) {
  fsdp_tensor* t = tensor_alloc(ndim, shape, dtype);
  if (!t) return NULL;
  fsdp_contiguous_strides(ndim, shape, t->stride);
  t->storage = fsdp_storage_new(fsdp_shape_numel(ndim, shape) * fsdp_dtype_size(dtype), device, g_default_cat);
  if (!t->storage) {
    free(t);
    return NULL;
  }
  return t;
}
fsdp_tensor* fsdp_new_pinned(int ndim, const int64_t* shape, int dtype) {
  int host = fsdp_host_memory_device();
  CHECK_NULL(host > 0, "pin_memory: no device with pinned host memory is loaded (pinned memory is for copies to a GPU, "
                       "and there is none)");
  fsdp_tensor* t = tensor_alloc(ndim, shape, dtype);
  if (!t) return NULL;
  fsdp_contiguous_strides(ndim, shape, t->stride);
  t->storage = fsdp_storage_new_empty(fsdp_shape_numel(ndim, shape) * fsdp_dtype_size(dtype), FSDP_CPU, g_default_cat);
  if (t->storage) t->storage->pinned = host;
  if (!t->storage || fsdp_storage_ensure_data(t->storage)) {
    fsdp_storage_release(t->storage);
    free(t);
    return NULL;
  }
  return t;
}
fsdp_tensor* fsdp_new_cat(int ndim, const int64_t* shape, int dtype, int device, int cat) {
  int prev = g_default_cat;
  g_default_cat = cat;
  fsdp_tensor* t = fsdp_new(ndim, shape, dtype, device);
  g_default_cat = prev;
  return t;
}
fsdp_tensor* fsdp_view_storage(fsdp_storage* s, int dtype, int ndim, const int64_t* shape, int64_t offset) {
  fsdp_tensor* t = tensor_alloc(ndim, shape, dtype);
  if (!t) return NULL;
  fsdp_contiguous_strides(ndim, shape, t->stride);
  t->offset = offset;
  t->storage = s;
  t->head.deferred = fsdp_storage_deferred(s);
  s->refcount++;
  return t;
}
fsdp_tensor* fsdp_new_like(const fsdp_tensor* t) { return fsdp_new(t->ndim, t->shape, t->dtype, fsdp_device_of(t)); }
// A new float32 tensor of `shape` (like's ndim) whose dims lie in memory in the order of like's
// strides, the largest outermost: dense, and contiguous when like is. For outputs that should keep an
// input's layout (attention heads stored as (B, T, H, hd)). Dims of size 1 may go anywhere; when like's
// dims of size > 1 overlap or interleave (broadcast strides, odd views) the result is contiguous.
fsdp_tensor* fsdp_new_layout_like(const fsdp_tensor* like, const int64_t* shape) {
  int nd = like->ndim, order[FSDP_MAX_DIMS];
  for (int i = 0; i < nd; i++) {  // stable insertion sort by stride, descending
    int j = i;
    while (j > 0 && like->stride[order[j - 1]] < like->stride[i]) {
      order[j] = order[j - 1];
      j--;
    }
    order[j] = i;
  }
  int nested = 1;
  for (int j = nd - 1, inner = -1; j >= 0; j--) {  // each dim of size > 1 steps over the ones inside it
    int d = order[j];
    if (like->shape[d] <= 1) continue;
    if (inner >= 0) nested = nested && like->stride[d] >= like->stride[inner] * like->shape[inner];
    else nested = like->stride[d] >= 1;
    inner = d;
  }
  fsdp_tensor* t = fsdp_new(nd, shape, FSDP_F32, fsdp_device_of(like));
  if (!t || !nested) return t;
  int64_t s = 1;
  for (int j = nd - 1; j >= 0; j--) {
    t->stride[order[j]] = s;
    s *= shape[order[j]] > 0 ? shape[order[j]] : 1;
  }
  return t;
}
fsdp_tensor* fsdp_new_zeros_like(const fsdp_tensor* t) {
  fsdp_tensor* r = fsdp_new_like(t);
  if (r) fsdp_backend_of(r)->elem->fill(r->storage->data, r->dtype, fsdp_tensor_numel(r), 0.0);
  return r;
}
// whether every element of a view (shape, stride, offset, in elements of es bytes) lies inside a
// storage of nbytes, with no int64 overflow on the way
static bool view_in_bounds(int ndim, const int64_t* shape, const int64_t* stride, int64_t offset, size_t es,
                           size_t nbytes) {
  int64_t lo = offset;
  int64_t hi = lo;
  for (int i = 0; i < ndim; i++) {
    if (shape[i] == 0) return true;
    int64_t reach = shape[i] - 1;
    int64_t step = stride[i] < 0 ? -stride[i] : stride[i];
    if (reach > 0 && (stride[i] == INT64_MIN || step > INT64_MAX / reach)) return false;
    int64_t span = reach * step;
    if (stride[i] >= 0 && hi > INT64_MAX - span) return false;
    if (stride[i] < 0 && lo < INT64_MIN + span) return false;
    if (stride[i] >= 0) hi += span;
    else lo -= span;
  }
  return lo >= 0 && (uint64_t)hi < nbytes / es;
}
fsdp_tensor* fsdp_new_view(const fsdp_tensor* t, int ndim, const int64_t* shape, const int64_t* stride,
                           int64_t offset) {
  size_t es = fsdp_dtype_size(t->dtype);
  CHECK_NULL(view_in_bounds(ndim, shape, stride, offset, es, t->storage->nbytes),
             "view: shape %s with strides %s at offset %lld does not fit in a storage of %zu bytes (%zu-byte elements)",
             fsdp_dims_s(ndim, shape), fsdp_dims_s(ndim, stride), (long long)offset, t->storage->nbytes, es);
  fsdp_tensor* v = tensor_alloc(ndim, shape, t->dtype);
  if (!v) return NULL;
  memcpy(v->stride, stride, ndim * sizeof(int64_t));
  v->offset = offset;
  v->storage = t->storage;
  v->head.deferred = fsdp_storage_deferred(v->storage);
  v->storage->refcount++;
  return v;
}

// ---- accessors -------------------------------------------------------------------------------------
int fsdp_tensor_ndim(const fsdp_tensor* t) { return t->ndim; }
int64_t fsdp_tensor_size(const fsdp_tensor* t, int dim) {
  if (dim < 0) dim += t->ndim;
  return dim >= 0 && dim < t->ndim ? t->shape[dim] : -1;
}
int64_t fsdp_tensor_stride(const fsdp_tensor* t, int dim) {
  if (dim < 0) dim += t->ndim;
  return dim >= 0 && dim < t->ndim ? t->stride[dim] : -1;
}
int64_t fsdp_tensor_numel(const fsdp_tensor* t) { return fsdp_shape_numel(t->ndim, t->shape); }
int64_t fsdp_tensor_offset(const fsdp_tensor* t) { return t->offset; }
int fsdp_tensor_dtype(const fsdp_tensor* t) { return t->dtype; }
int fsdp_tensor_device(const fsdp_tensor* t) { return fsdp_device_of(t); }
int fsdp_tensor_mem_category(const fsdp_tensor* t) { return t->storage->cat; }
void fsdp_tensor_set_mem_category(fsdp_tensor* t, int cat) {
  if (cat < 0 || cat >= FSDP_MEM_NCAT || cat == t->storage->cat) return;
  if (t->storage->data) fsdp_mem_move(t->storage->nbytes, t->storage->device, t->storage->cat, cat);
  t->storage->cat = cat;
}
void* fsdp_tensor_data(const fsdp_tensor* t) { return fsdp_ptr(t); }
int64_t fsdp_tensor_version(const fsdp_tensor* t) { return t->storage->version; }
int fsdp_tensor_same_storage(const fsdp_tensor* a, const fsdp_tensor* b) { return a->storage == b->storage; }
int fsdp_tensor_is_contiguous(const fsdp_tensor* t) {
  if (fsdp_tensor_numel(t) == 0) return 1;  // as in PyTorch: no elements, any strides
  int64_t s = 1;
  for (int i = t->ndim - 1; i >= 0; i--) {
    if (t->shape[i] != 1 && t->stride[i] != s) return 0;
    s *= t->shape[i];
  }
  return 1;
}
bool fsdp_same_shape(const fsdp_tensor* a, const fsdp_tensor* b) {
  return a->ndim == b->ndim && memcmp(a->shape, b->shape, a->ndim * sizeof(int64_t)) == 0;
}
// dim: 0-based, or negative from the end. Messages name dims (and list positions) as the Lua user
// counts them, 1-based: dim 0 is "dim 1", a negative dim stays as given.
int fsdp_wrap_dim(const char* op, int dim, int ndim) {
  int n = ndim > 0 ? ndim : 1;
  CHECK_INT(dim >= -n && dim < n,
            "%s: dimension %d out of range for a tensor with %d dims (1-based, negative from the end)", op,
            dim >= 0 ? dim + 1 : dim, ndim);
  return dim < 0 ? dim + n : dim;
}
int fsdp_check_f32(const char* op, const fsdp_tensor* t) {
  CHECK_INT(t->dtype == FSDP_F32, "%s: expected a float32 tensor, got %s of shape %s", op, DT(t), SH(t));
  return fsdp_check_data(op, t);
}
int fsdp_check_float(const char* op, const fsdp_tensor* t) {
  CHECK_INT(fsdp_is_float(t->dtype), "%s: expected a float tensor (float32, bfloat16 or float16), got %s of shape %s",
            op, DT(t), SH(t));
  return fsdp_check_data(op, t);
}
int fsdp_check_same_device(const char* op, const fsdp_tensor* a, const fsdp_tensor* b) {
  CHECK_INT(fsdp_device_of(a) == fsdp_device_of(b), "%s: tensors on different devices (%s on %s, %s on %s)", op, SH(a),
            fsdp_device_name(fsdp_device_of(a)), SH(b), fsdp_device_name(fsdp_device_of(b)));
  return 0;
}

// ---- copies -------------------------------------------------------------------------------------------
// the bytes of contiguous src into contiguous dst (same dtype and size) on another device: through
// the device side's copy (the CPU's is a memcpy; a copy to the host waits for the device)
static int move_bytes(fsdp_tensor* dst, const fsdp_tensor* src) {
  int from = fsdp_device_of(src), to = fsdp_device_of(dst);
  fsdp_copy_kind kind = from == FSDP_CPU ? FSDP_COPY_H2D : to == FSDP_CPU ? FSDP_COPY_D2H : FSDP_COPY_D2D;
  const fsdp_backend* b = fsdp_backend_for(from == FSDP_CPU ? to : from);
  return b->copy(fsdp_ptr(dst), fsdp_ptr(src), (size_t)fsdp_tensor_numel(src) * fsdp_dtype_size(src->dtype), kind);
}

int fsdp_copy_strided(fsdp_tensor* dst, const fsdp_tensor* src) {
  if (fsdp_check_data("copy", src) || fsdp_check_data("copy", dst)) return -1;
  CHECK_INT(fsdp_tensor_numel(dst) == fsdp_tensor_numel(src), "copy: %s has %lld elements, %s has %lld", SH(dst),
            (long long)fsdp_tensor_numel(dst), SH(src), (long long)fsdp_tensor_numel(src));
  if (fsdp_device_of(dst) != fsdp_device_of(src)) {
    // bytes cross devices contiguous and in src's dtype: src laid out on its own device if need be,
    // moved straight into dst when dst takes them as they are, else into a temporary there first
    fsdp_tensor* c = NULL;
    if (!fsdp_tensor_is_contiguous(src)) {
      c = fsdp_new(src->ndim, src->shape, src->dtype, fsdp_device_of(src));
      if (!c || fsdp_copy_strided(c, src)) goto cross_fail;
    }
    const fsdp_tensor* from = c ? c : src;
    int rc;
    if (fsdp_tensor_is_contiguous(dst) && dst->dtype == src->dtype) {
      rc = move_bytes(dst, from);
    } else {
      fsdp_tensor* m = fsdp_new(src->ndim, src->shape, src->dtype, fsdp_device_of(dst));
      rc = !m || move_bytes(m, from) || fsdp_copy_strided(dst, m) ? -1 : 0;
      fsdp_tensor_release(m);
    }
    fsdp_tensor_release(c);
    return rc;
  cross_fail:
    fsdp_tensor_release(c);
    return -1;
  }
  const fsdp_elem_kernels* k = fsdp_backend_of(dst)->elem;
  if (fsdp_tensor_is_contiguous(dst)) {
    k->copy_strided(fsdp_ptr(dst), dst->dtype, fsdp_ptr(src), src->dtype, src->ndim, src->shape, src->stride);
    return 0;
  }
  // non-contiguous destination: go through a contiguous temporary, then scatter it
  fsdp_tensor* tmp = fsdp_new(dst->ndim, dst->shape, dst->dtype, fsdp_device_of(dst));
  if (!tmp) return -1;
  k->copy_strided(fsdp_ptr(tmp), dst->dtype, fsdp_ptr(src), src->dtype, src->ndim, src->shape, src->stride);
  k->scatter_strided(fsdp_ptr(dst), fsdp_dtype_size(dst->dtype), dst->ndim, dst->shape, dst->stride, fsdp_ptr(tmp));
  fsdp_tensor_release(tmp);
  return 0;
}

fsdp_tensor* fsdp_copy_to_device(const fsdp_tensor* t, int device) {
  fsdp_tensor* r = fsdp_new(t->ndim, t->shape, t->dtype, device);
  if (r && fsdp_copy_strided(r, t)) {
    fsdp_tensor_release(r);
    return NULL;
  }
  return r;
}

fsdp_tensor* fsdp_as_contig_dtype(fsdp_tensor* t, int dtype) {
  if (t->dtype == dtype && fsdp_tensor_is_contiguous(t)) {
    fsdp_tensor_retain(t);
    return t;
  }
  fsdp_tensor* r = fsdp_new(t->ndim, t->shape, dtype, fsdp_device_of(t));
  if (r && fsdp_copy_strided(r, t)) {
    fsdp_tensor_release(r);
    return NULL;
  }
  return r;
}
fsdp_tensor* fsdp_as_contig(fsdp_tensor* t) { return fsdp_as_contig_dtype(t, FSDP_F32); }

static int to_doubles(const char* op, const fsdp_tensor* t, double* out);
int fsdp_tensor_item(const fsdp_tensor* t, double* out) {
  CHECK_INT(fsdp_tensor_numel(t) == 1, "item: tensor of shape %s has %lld elements, expected 1", SH(t),
            (long long)fsdp_tensor_numel(t));
  return to_doubles("item", t, out);
}
int fsdp_tensor_to_doubles(const fsdp_tensor* t, double* out) { return to_doubles("tolist", t, out); }
static int to_doubles(const char* op, const fsdp_tensor* t, double* out) {
  if (fsdp_device_of(t) != FSDP_CPU) {  // the host reads a copy (which waits for the device)
    fsdp_tensor* h = fsdp_copy_to_device(t, FSDP_CPU);
    if (!h) return -1;
    int rc = to_doubles(op, h, out);
    fsdp_tensor_release(h);
    return rc;
  }
  int64_t n = fsdp_tensor_numel(t), idx[FSDP_MAX_DIMS] = {0};
  size_t es = fsdp_dtype_size(t->dtype);
  const char* base = (const char*)fsdp_ptr(t);
  for (int64_t i = 0; i < n; i++) {
    int64_t off = 0;
    for (int j = 0; j < t->ndim; j++) off += idx[j] * t->stride[j];
    double v = fsdp_load_elem(base + off * es, t->dtype);
    if (t->dtype == FSDP_I64) {  // a Lua number is a double: an int64 beyond 2^53 may not fit it
      int64_t x = *(const int64_t*)(base + off * es);
      CHECK_INT(v < 9223372036854775808.0 && (int64_t)v == x,
                "%s: element %lld (1-based, row-major) of the int64 tensor of shape %s is %lld, which a Lua number "
                "(a double) cannot hold exactly (the nearest is %.17g); integers up to 2^53 convert exactly",
                op, (long long)i + 1, SH(t), (long long)x, v);
    }
    // one NaN for every NaN: LuaJIT reads a double whose top bits are all set (a NaN with a
    // payload, as a float NaN of all-ones bits becomes) as one of its tagged values -- nil
    out[i] = v == v ? v : NAN;
    for (int j = t->ndim - 1; j >= 0; j--) {
      if (++idx[j] < t->shape[j]) break;
      idx[j] = 0;
    }
  }
  return 0;
}
