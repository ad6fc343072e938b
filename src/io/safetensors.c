/*
 * io/safetensors.c -- safetensors read/write (https://github.com/huggingface/safetensors).
 *
 * File layout:
 *   u64 little-endian N | N bytes of JSON header (padded with spaces to a multiple of 8) | data
 *   header: {"__metadata__":{"k":"v",...},
 *            "name":{"dtype":"F32","shape":[2,3],"data_offsets":[begin,end]}, ...}
 * Offsets are relative to the start of the data area; the ranges tile the data area exactly
 * (no gaps, no overlaps, nothing after the last one), as the reference implementation demands.
 *
 * Writing produces the same bytes as the Python library for the same tensors in the same order
 * (compact JSON in serde_json's style, metadata first, space padding); the caller chooses the
 * order (the Lua layer sorts like the Python library does). Writes are atomic: a temporary file
 * "<path>.tmp.<pid>" is written, fsync'ed and renamed over `path`.
 *
 * Reading parses the header with a small strict JSON parser (objects, arrays, strings, integers;
 * nothing else), checks it completely at open, and reads each tensor on demand with pread into
 * a new contiguous CPU tensor in its stored dtype. Hostile files give an error naming the file
 * and the problem; nothing is allocated beyond the header (<= 100 MB) before it is validated.
 * Assumes a little-endian host (x86-64, aarch64), like the format itself.
 */
#include "core/core.h"

#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <sys/stat.h>
#include <unistd.h>

#define ST_MAX_HEADER ((uint64_t)100 * 1000 * 1000)

static const char* st_dtype_names[FSDP_NDTYPES] = {"F32", "I64", "BF16", "F16", "BOOL"};

static int st_dtype_from_name(const char* s) {
  for (int d = 0; d < FSDP_NDTYPES; d++)
    if (strcmp(s, st_dtype_names[d]) == 0) return d;
  return -1;
}

// ---- a growable byte buffer ------------------------------------------------------------------------
typedef struct {
  char* p;
  size_t len, cap;
} sbuf;

static int sb_reserve(sbuf* b, size_t extra) {
  if (b->len + extra + 1 <= b->cap) return 0;
  size_t cap = b->cap ? b->cap : 256;
  while (cap < b->len + extra + 1) cap *= 2;
  char* p = realloc(b->p, cap);
  CHECK_INT(p, "safetensors: out of memory (%zu bytes)", cap);
  b->p = p;
  b->cap = cap;
  return 0;
}
static int sb_put(sbuf* b, const char* s, size_t n) {
  if (sb_reserve(b, n)) return -1;
  memcpy(b->p + b->len, s, n);
  b->len += n;
  b->p[b->len] = 0;
  return 0;
}
static int sb_puts(sbuf* b, const char* s) { return sb_put(b, s, strlen(s)); }
static int sb_putc(sbuf* b, char c) { return sb_put(b, &c, 1); }
static int sb_int(sbuf* b, int64_t v) {
  char tmp[32];
  int n = snprintf(tmp, sizeof tmp, "%lld", (long long)v);
  return sb_put(b, tmp, n);
}
// a JSON string literal, escaped exactly as serde_json does (raw UTF-8, lowercase \u00xx)
static int sb_json_string(sbuf* b, const char* s) {
  static const char hex[] = "0123456789abcdef";
  if (sb_putc(b, '"')) return -1;
  for (const unsigned char* p = (const unsigned char*)s; *p; p++) {
    int rc;
    switch (*p) {
      case '"': rc = sb_put(b, "\\\"", 2); break;
      case '\\': rc = sb_put(b, "\\\\", 2); break;
      case '\b': rc = sb_put(b, "\\b", 2); break;
      case '\f': rc = sb_put(b, "\\f", 2); break;
      case '\n': rc = sb_put(b, "\\n", 2); break;
      case '\r': rc = sb_put(b, "\\r", 2); break;
      case '\t': rc = sb_put(b, "\\t", 2); break;
      default:
        if (*p < 0x20) {
          char e[6] = {'\\', 'u', '0', '0', hex[*p >> 4], hex[*p & 15]};
          rc = sb_put(b, e, 6);
        } else rc = sb_putc(b, (char)*p);
    }
    if (rc) return -1;
  }
  return sb_putc(b, '"');
}

// ---- UTF-8 --------------------------------------------------------------------------------------------
// returns the byte offset of the first invalid sequence, or -1 if s[0..n) is valid UTF-8
static int64_t utf8_invalid_at(const unsigned char* s, size_t n) {
  size_t i = 0;
  while (i < n) {
    unsigned c = s[i];
    if (c < 0x80) {
      i++;
      continue;
    }
    int len;
    uint32_t cp, min;
    if ((c & 0xe0) == 0xc0) {
      len = 2;
      cp = c & 0x1f;
      min = 0x80;
    } else if ((c & 0xf0) == 0xe0) {
      len = 3;
      cp = c & 0x0f;
      min = 0x800;
    } else if ((c & 0xf8) == 0xf0) {
      len = 4;
      cp = c & 0x07;
      min = 0x10000;
    } else return (int64_t)i;
    if (i + len > n) return (int64_t)i;
    for (int k = 1; k < len; k++) {
      if ((s[i + k] & 0xc0) != 0x80) return (int64_t)i;
      cp = (cp << 6) | (s[i + k] & 0x3f);
    }
    if (cp < min || cp > 0x10ffff || (cp >= 0xd800 && cp <= 0xdfff)) return (int64_t)i;
    i += len;
  }
  return -1;
}
static void utf8_put(sbuf* b, uint32_t cp, int* rc) {
  char u[4];
  int n;
  if (cp < 0x80) {
    u[0] = (char)cp;
    n = 1;
  } else if (cp < 0x800) {
    u[0] = (char)(0xc0 | (cp >> 6));
    u[1] = (char)(0x80 | (cp & 0x3f));
    n = 2;
  } else if (cp < 0x10000) {
    u[0] = (char)(0xe0 | (cp >> 12));
    u[1] = (char)(0x80 | ((cp >> 6) & 0x3f));
    u[2] = (char)(0x80 | (cp & 0x3f));
    n = 3;
  } else {
    u[0] = (char)(0xf0 | (cp >> 18));
    u[1] = (char)(0x80 | ((cp >> 12) & 0x3f));
    u[2] = (char)(0x80 | ((cp >> 6) & 0x3f));
    u[3] = (char)(0x80 | (cp & 0x3f));
    n = 4;
  }
  *rc = sb_put(b, u, n);
}

// ---- a small strict JSON reader --------------------------------------------------------------------
// Recursive descent over exactly the shapes a safetensors header has (an object of objects,
// string->string metadata, integer arrays); anything else is an error naming the byte offset.
typedef struct {
  const char* s;
  size_t n, i;
  const char* file;  // for messages
  const char* what;  // "bad header" when reading, "bad metadata JSON" when saving
} jreader;

#define JFAIL(r, ...)                                                                       \
  do {                                                                                      \
    char m_[512];                                                                           \
    snprintf(m_, sizeof m_, __VA_ARGS__);                                                   \
    fsdp_errorf("safetensors: '%s': %s at byte %zu: %s", (r)->file, (r)->what, (r)->i, m_); \
    return -1;                                                                              \
  } while (0)

static void j_ws(jreader* r) {
  while (r->i < r->n && (r->s[r->i] == ' ' || r->s[r->i] == '\t' || r->s[r->i] == '\n' || r->s[r->i] == '\r')) r->i++;
}
static int j_peek(jreader* r) {
  j_ws(r);
  return r->i < r->n ? (unsigned char)r->s[r->i] : -1;
}
static int j_expect(jreader* r, char c, const char* ctx) {
  int p = j_peek(r);
  if (p != c) {
    if (p < 0) JFAIL(r, "expected '%c' %s, got the end of the header", c, ctx);
    JFAIL(r, "expected '%c' %s, got '%c'", c, ctx, p);
  }
  r->i++;
  return 0;
}
static int j_hex4(jreader* r, uint32_t* v) {
  if (r->i + 4 > r->n) JFAIL(r, "truncated \\u escape");
  *v = 0;
  for (int k = 0; k < 4; k++) {
    char c = r->s[r->i++];
    int d = c >= '0' && c <= '9'   ? c - '0'
            : c >= 'a' && c <= 'f' ? c - 'a' + 10
            : c >= 'A' && c <= 'F' ? c - 'A' + 10
                                   : -1;
    if (d < 0) JFAIL(r, "bad hex digit in \\u escape");
    *v = *v * 16 + (uint32_t)d;
  }
  return 0;
}
// decodes a string literal into out (reset first); NUL characters are rejected (C strings)
static int j_string(jreader* r, sbuf* out) {
  out->len = 0;
  if (sb_reserve(out, 0)) return -1;
  out->p[0] = 0;
  if (j_expect(r, '"', "(a string)")) return -1;
  size_t start = r->i;
  for (;;) {
    // copy the run of plain characters in one go
    while (r->i < r->n && r->s[r->i] != '"' && r->s[r->i] != '\\' && (unsigned char)r->s[r->i] >= 0x20) r->i++;
    if (r->i > start && sb_put(out, r->s + start, r->i - start)) return -1;
    if (r->i >= r->n) JFAIL(r, "unterminated string");
    char c = r->s[r->i];
    if (c == '"') {
      r->i++;
      return 0;
    }
    if (c != '\\') JFAIL(r, "control character 0x%02x in a string", (unsigned char)c);
    if (++r->i >= r->n) JFAIL(r, "unterminated string");
    char e = r->s[r->i++];
    int rc = 0;
    switch (e) {
      case '"': rc = sb_putc(out, '"'); break;
      case '\\': rc = sb_putc(out, '\\'); break;
      case '/': rc = sb_putc(out, '/'); break;
      case 'b': rc = sb_putc(out, '\b'); break;
      case 'f': rc = sb_putc(out, '\f'); break;
      case 'n': rc = sb_putc(out, '\n'); break;
      case 'r': rc = sb_putc(out, '\r'); break;
      case 't': rc = sb_putc(out, '\t'); break;
      case 'u': {
        uint32_t cp;
        if (j_hex4(r, &cp)) return -1;
        if (cp >= 0xdc00 && cp <= 0xdfff) JFAIL(r, "lone low surrogate in \\u escape");
        if (cp >= 0xd800 && cp <= 0xdbff) {
          uint32_t lo;
          if (r->i + 2 > r->n || r->s[r->i] != '\\' || r->s[r->i + 1] != 'u')
            JFAIL(r, "lone high surrogate in \\u escape");
          r->i += 2;
          if (j_hex4(r, &lo)) return -1;
          if (lo < 0xdc00 || lo > 0xdfff) JFAIL(r, "bad surrogate pair in \\u escape");
          cp = 0x10000 + ((cp - 0xd800) << 10) + (lo - 0xdc00);
        }
        if (cp == 0) JFAIL(r, "NUL character (\\u0000) in a string is not supported");
        utf8_put(out, cp, &rc);
        break;
      }
      default: r->i--; JFAIL(r, "bad escape '\\%c'", e);
    }
    if (rc) return -1;
    start = r->i;
  }
}
static int j_int(jreader* r, int64_t* v) {
  int p = j_peek(r);
  if (p != '-' && !(p >= '0' && p <= '9')) {
    if (p < 0) JFAIL(r, "expected an integer, got the end of the header");
    JFAIL(r, "expected an integer, got '%c'", p);
  }
  int neg = p == '-';
  if (neg) r->i++;
  if (r->i >= r->n || r->s[r->i] < '0' || r->s[r->i] > '9') JFAIL(r, "expected digits after '-'");
  if (r->s[r->i] == '0' && r->i + 1 < r->n && r->s[r->i + 1] >= '0' && r->s[r->i + 1] <= '9')
    JFAIL(r, "integer with a leading zero");
  int64_t x = 0;
  while (r->i < r->n && r->s[r->i] >= '0' && r->s[r->i] <= '9') {
    int d = r->s[r->i] - '0';
    if (x > (INT64_MAX - d) / 10) JFAIL(r, "integer too large");
    x = x * 10 + d;
    r->i++;
  }
  if (r->i < r->n && (r->s[r->i] == '.' || r->s[r->i] == 'e' || r->s[r->i] == 'E'))
    JFAIL(r, "only integers are allowed, not floating-point numbers");
  *v = neg ? -x : x;
  return 0;
}
// [i, j, ...] with at most max entries
static int j_int_array(jreader* r, int64_t* v, int max, int* count, const char* what) {
  char ctx[400];
  *count = 0;
  snprintf(ctx, sizeof ctx, "to open the %s", what);
  if (j_expect(r, '[', ctx)) return -1;
  if (j_peek(r) == ']') {
    r->i++;
    return 0;
  }
  snprintf(ctx, sizeof ctx, "between entries of the %s", what);
  for (;;) {
    int64_t x;
    if (j_int(r, &x)) return -1;
    if (*count >= max) JFAIL(r, "the %s has more than %d entries", what, max);
    v[(*count)++] = x;
    int p = j_peek(r);
    if (p == ']') {
      r->i++;
      return 0;
    }
    if (j_expect(r, ',', ctx)) return -1;
  }
}

// ---- duplicate detection ---------------------------------------------------------------------------
static int cmp_strp(const void* a, const void* b) { return strcmp(*(char* const*)a, *(char* const*)b); }
// returns a name occurring twice in names[0..n), or NULL; -1 in *err on out of memory
static const char* find_duplicate(const char* const* names, int n, int* err) {
  *err = 0;
  if (n < 2) return NULL;
  const char** s = malloc(n * sizeof *s);
  if (!s) {
    *err = -1;
    fsdp_errorf("safetensors: out of memory");
    return NULL;
  }
  memcpy(s, names, n * sizeof *s);
  qsort(s, n, sizeof *s, cmp_strp);
  const char* dup = NULL;
  for (int i = 1; i < n && !dup; i++)
    if (strcmp(s[i - 1], s[i]) == 0) dup = s[i];
  free(s);
  return dup;
}

// ---- metadata: an object of string -> string, re-serialized compactly into `out` -----------------
typedef struct {
  char** v;
  int n, cap;
} strlist;
static void sl_free(strlist* l) {
  for (int i = 0; i < l->n; i++) free(l->v[i]);
  free(l->v);
  l->v = NULL;
  l->n = l->cap = 0;
}
static int sl_push(strlist* l, const char* s) {
  if (fsdp_grow(&l->v, &l->cap, l->n + 1, sizeof *l->v, "safetensors")) return -1;
  char* d = strdup(s);
  CHECK_INT(d, "safetensors: out of memory");
  l->v[l->n++] = d;
  return 0;
}

static int j_metadata(jreader* r, sbuf* out) {
  sbuf key = {0}, val = {0};
  strlist keys = {0};
  int rc = -1;
  out->len = 0;
  if (j_expect(r, '{', "to open __metadata__") || sb_putc(out, '{')) goto done;
  if (j_peek(r) == '}') r->i++;
  else {
    for (;;) {
      if (j_string(r, &key) || j_expect(r, ':', "after a __metadata__ key")) goto done;
      if (j_peek(r) != '"') {
        char m[600];
        snprintf(m, sizeof m, "__metadata__ value for key '%.200s' must be a string", key.p);
        fsdp_errorf("safetensors: '%s': %s at byte %zu: %s", r->file, r->what, r->i, m);
        goto done;
      }
      if (j_string(r, &val)) goto done;
      if (sl_push(&keys, key.p)) goto done;
      if ((keys.n > 1 && sb_putc(out, ',')) || sb_json_string(out, key.p) || sb_putc(out, ':') ||
          sb_json_string(out, val.p))
        goto done;
      int p = j_peek(r);
      if (p == '}') {
        r->i++;
        break;
      }
      if (j_expect(r, ',', "between __metadata__ entries")) goto done;
    }
  }
  if (sb_putc(out, '}')) goto done;
  int err;
  const char* dup = find_duplicate((const char* const*)keys.v, keys.n, &err);
  if (err) goto done;
  if (dup) {
    fsdp_errorf("safetensors: '%s': __metadata__ key '%.200s' appears twice", r->file, dup);
    goto done;
  }
  rc = 0;
done:
  free(key.p);
  free(val.p);
  sl_free(&keys);
  return rc;
}

// ---- the open file ----------------------------------------------------------------------------------
typedef struct {
  char* name;
  int dtype, ndim;
  int64_t shape[FSDP_MAX_DIMS];
  int64_t begin, end;  // byte range in the data area
} st_entry;

// the file's descriptor once file-backed tensors share it (fsdp_st_get_lazy): closed with the last of
// them and the file
typedef struct {
  _Atomic int refs;
  int fd;
  char* path;
} st_shared;
static void shared_release(st_shared* sh) {
  if (sh && --sh->refs == 0) {
    close(sh->fd);
    free(sh->path);
    free(sh);
  }
}

struct fsdp_st_file {
  char* path;
  int fd;             // -1 once shared
  st_shared* shared;  // (then its fd is the file's)
  int n, cap;
  st_entry* e;
  char* metadata;      // compact JSON of __metadata__, or ""
  int64_t data_start;  // 8 + header length
};

void fsdp_st_close(fsdp_st_file* f) {
  if (!f) return;
  if (f->fd >= 0) close(f->fd);
  shared_release(f->shared);
  for (int i = 0; i < f->n; i++) free(f->e[i].name);
  free(f->e);
  free(f->metadata);
  free(f->path);
  free(f);
}

// one tensor entry: {"dtype":"F32","shape":[..],"data_offsets":[b,e]} (keys in any order)
static int j_tensor_info(jreader* r, const char* name, st_entry* e) {
  sbuf key = {0}, val = {0};
  int rc = -1, have_dtype = 0, have_shape = 0, have_offsets = 0;
  if (j_expect(r, '{', "to open a tensor entry")) goto done;
  if (j_peek(r) != '}') {
    for (;;) {
      if (j_string(r, &key) || j_expect(r, ':', "after a key")) goto done;
      if (strcmp(key.p, "dtype") == 0 && !have_dtype) {
        if (j_string(r, &val)) goto done;
        e->dtype = st_dtype_from_name(val.p);
        if (e->dtype < 0) {
          fsdp_errorf("safetensors: '%s': tensor '%s' has dtype %.40s, which fsdp does not support "
                      "(supported: F32, I64, BF16, F16)",
                      r->file, name, val.p);
          goto done;
        }
        have_dtype = 1;
      } else if (strcmp(key.p, "shape") == 0 && !have_shape) {
        char what[300];
        snprintf(what, sizeof what, "shape of tensor '%.200s'", name);
        if (j_int_array(r, e->shape, FSDP_MAX_DIMS, &e->ndim, what)) goto done;
        have_shape = 1;
      } else if (strcmp(key.p, "data_offsets") == 0 && !have_offsets) {
        int64_t off[2];
        int cnt;
        char what[300];
        snprintf(what, sizeof what, "data_offsets of tensor '%.200s'", name);
        if (j_int_array(r, off, 2, &cnt, what)) goto done;
        if (cnt != 2) {
          fsdp_errorf("safetensors: '%s': tensor '%s': data_offsets must have 2 entries, got %d", r->file, name, cnt);
          goto done;
        }
        e->begin = off[0];
        e->end = off[1];
        have_offsets = 1;
      } else {
        int dup = !strcmp(key.p, "dtype") || !strcmp(key.p, "shape") || !strcmp(key.p, "data_offsets");
        fsdp_errorf("safetensors: '%s': tensor '%s': %s key '%.100s' in its entry", r->file, name,
                    dup ? "repeated" : "unexpected", key.p);
        goto done;
      }
      int p = j_peek(r);
      if (p == '}') break;
      if (j_expect(r, ',', "between keys of a tensor entry")) goto done;
    }
  }
  r->i++;  // the closing '}'
  const char* missing = !have_dtype ? "dtype" : !have_shape ? "shape" : !have_offsets ? "data_offsets" : NULL;
  if (missing) {
    fsdp_errorf("safetensors: '%s': tensor '%s' has no '%s' in its entry", r->file, name, missing);
    goto done;
  }
  // shape x dtype size must be exactly the byte range (checked for overflow: dims are untrusted)
  int64_t numel = 1;
  for (int d = 0; d < e->ndim; d++) {
    if (e->shape[d] < 0) {
      fsdp_errorf("safetensors: '%s': tensor '%s' has a negative size in shape %s", r->file, name,
                  fsdp_dims_s(e->ndim, e->shape));
      goto done;
    }
    if (e->shape[d] && numel > INT64_MAX / e->shape[d]) {
      fsdp_errorf("safetensors: '%s': tensor '%s' has an absurd shape %s", r->file, name,
                  fsdp_dims_s(e->ndim, e->shape));
      goto done;
    }
    numel *= e->shape[d];
  }
  int64_t es = (int64_t)fsdp_dtype_size(e->dtype);
  if (e->begin < 0 || e->end < e->begin) {
    fsdp_errorf("safetensors: '%s': tensor '%s' has invalid data_offsets [%lld, %lld]", r->file, name,
                (long long)e->begin, (long long)e->end);
    goto done;
  }
  if (numel > INT64_MAX / es) {
    fsdp_errorf("safetensors: '%s': tensor '%s' has an absurd shape %s", r->file, name, fsdp_dims_s(e->ndim, e->shape));
    goto done;
  }
  if (numel * es != e->end - e->begin) {
    fsdp_errorf("safetensors: '%s': tensor '%s' of shape %s and dtype %s needs %lld bytes but data_offsets "
                "[%lld, %lld] hold %lld",
                r->file, name, fsdp_dims_s(e->ndim, e->shape), st_dtype_names[e->dtype], (long long)(numel * es),
                (long long)e->begin, (long long)e->end, (long long)(e->end - e->begin));
    goto done;
  }
  rc = 0;
done:
  free(key.p);
  free(val.p);
  return rc;
}

static int cmp_range(const void* a, const void* b) {
  const st_entry *x = *(st_entry*const*)a, *y = *(st_entry*const*)b;
  if (x->begin != y->begin) return x->begin < y->begin ? -1 : 1;
  return x->end < y->end ? -1 : x->end > y->end;
}

// the whole header: {"__metadata__": {...}, "name": {...}, ...} followed only by spaces
static int parse_header(fsdp_st_file* f, const char* text, size_t len, int64_t data_len) {
  jreader r = {text, len, 0, f->path, "bad header"};
  sbuf key = {0}, meta = {0};
  int rc = -1, have_meta = 0;
  if (len == 0 || text[0] != '{') {
    fsdp_errorf("safetensors: '%s': bad header: it does not start with '{'", f->path);
    return -1;
  }
  r.i = 1;
  if (j_peek(&r) == '}') r.i++;
  else {
    for (;;) {
      if (j_string(&r, &key) || j_expect(&r, ':', "after a tensor name")) goto done;
      if (strcmp(key.p, "__metadata__") == 0) {
        if (have_meta) {
          fsdp_errorf("safetensors: '%s': __metadata__ appears twice", f->path);
          goto done;
        }
        if (j_metadata(&r, &meta)) goto done;
        have_meta = 1;
      } else {
        if (fsdp_grow(&f->e, &f->cap, f->n + 1, sizeof *f->e, "safetensors")) goto done;
        st_entry* e = &f->e[f->n];
        memset(e, 0, sizeof *e);
        if (j_tensor_info(&r, key.p, e)) goto done;
        e->name = strdup(key.p);
        if (!e->name) {
          fsdp_errorf("safetensors: out of memory");
          goto done;
        }
        f->n++;
      }
      int p = j_peek(&r);
      if (p == '}') {
        r.i++;
        break;
      }
      if (j_expect(&r, ',', "between tensor entries")) goto done;
    }
  }
  j_ws(&r);
  if (r.i != len) {
    fsdp_errorf("safetensors: '%s': bad header at byte %zu: unexpected text after the closing '}'", f->path, r.i);
    goto done;
  }
  f->metadata = have_meta ? meta.p : strdup("");
  if (have_meta) meta.p = NULL;
  if (!f->metadata) {
    fsdp_errorf("safetensors: out of memory");
    goto done;
  }

  // names are unique, and the byte ranges tile [0, data_len) exactly
  {
    const char** names = malloc((f->n ? f->n : 1) * sizeof *names);
    st_entry** order = malloc((f->n ? f->n : 1) * sizeof *order);
    if (!names || !order) {
      free(names);
      free(order);
      fsdp_errorf("safetensors: out of memory");
      goto done;
    }
    for (int i = 0; i < f->n; i++) {
      names[i] = f->e[i].name;
      order[i] = &f->e[i];
    }
    int err;
    const char* dup = find_duplicate(names, f->n, &err);
    if (dup) fsdp_errorf("safetensors: '%s': tensor name '%s' appears twice in the header", f->path, dup);
    int bad = err || dup;
    qsort(order, f->n, sizeof *order, cmp_range);
    int64_t pos = 0;
    for (int i = 0; i < f->n && !bad; i++) {
      st_entry* e = order[i];
      if (e->begin != pos) {
        fsdp_errorf("safetensors: '%s': tensor '%s' data_offsets [%lld, %lld] %s (expected it to start at byte %lld)",
                    f->path, e->name, (long long)e->begin, (long long)e->end,
                    e->begin < pos ? "overlap another tensor" : "leave a gap", (long long)pos);
        bad = 1;
      }
      pos = e->end;
    }
    if (!bad && pos != data_len) {
      if (pos > data_len)
        fsdp_errorf("safetensors: '%s': tensor data ends at byte %lld, past the end of the file's data area "
                    "(%lld bytes; truncated file?)",
                    f->path, (long long)pos, (long long)data_len);
      else
        fsdp_errorf("safetensors: '%s': the data area has %lld bytes but the tensors cover only %lld", f->path,
                    (long long)data_len, (long long)pos);
      bad = 1;
    }
    free(names);
    free(order);
    if (bad) goto done;
  }
  rc = 0;
done:
  free(key.p);
  free(meta.p);
  return rc;
}

// reads exactly n bytes at offset; returns 0, or -1 on error / end of file
static int read_full(int fd, void* buf, size_t n, int64_t offset) {
  char* p = buf;
  while (n > 0) {
    ssize_t k = pread(fd, p, n > ((size_t)1 << 30) ? ((size_t)1 << 30) : n, (off_t)offset);
    if (k < 0 && errno == EINTR) continue;
    if (k <= 0) return -1;
    p += k;
    n -= (size_t)k;
    offset += k;
  }
  return 0;
}

// what a non-regular file is, for the message
static const char* file_kind(mode_t m) {
  if (S_ISFIFO(m)) return "a FIFO";
  if (S_ISDIR(m)) return "a directory";
  if (S_ISCHR(m)) return "a character device";
  if (S_ISBLK(m)) return "a block device";
  if (S_ISSOCK(m)) return "a socket";
  return "not a plain file";
}

fsdp_st_file* fsdp_st_open(const char* path) {
  CHECK_NULL(path && *path, "safetensors: open: empty path");
  fsdp_st_file* f = calloc(1, sizeof *f);
  CHECK_NULL(f, "safetensors: out of memory");
  f->fd = -1;
  f->path = strdup(path);
  char* header = NULL;
  if (!f->path) {
    fsdp_errorf("safetensors: out of memory");
    goto fail;
  }
  // O_NONBLOCK: open() of a FIFO with no writer would block forever (and ignore Ctrl-C); it is
  // refused below. A regular file's reads ignore the flag.
  f->fd = open(path, O_RDONLY | O_CLOEXEC | O_NONBLOCK);
  if (f->fd < 0) {
    fsdp_errorf("safetensors: cannot open '%s': %s", path, strerror(errno));
    goto fail;
  }
  struct stat st;
  memset(&st, 0, sizeof st);
  if (fstat(f->fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    fsdp_errorf("safetensors: '%s' is not a regular file (%s)", path, file_kind(st.st_mode));
    goto fail;
  }
  int64_t size = (int64_t)st.st_size;
  unsigned char lenbuf[8];
  if (size < 8 || read_full(f->fd, lenbuf, 8, 0)) {
    fsdp_errorf("safetensors: '%s': file too small (%lld bytes) to hold a safetensors header", path, (long long)size);
    goto fail;
  }
  uint64_t hlen = 0;
  for (int k = 7; k >= 0; k--) hlen = (hlen << 8) | lenbuf[k];
  if (hlen > ST_MAX_HEADER) {
    fsdp_errorf("safetensors: '%s': header length %llu exceeds the 100 MB limit (corrupt or not a safetensors file)",
                path, (unsigned long long)hlen);
    goto fail;
  }
  if (hlen > (uint64_t)(size - 8)) {
    fsdp_errorf("safetensors: '%s': header length %llu is past the end of the file (%lld bytes; truncated?)", path,
                (unsigned long long)hlen, (long long)size);
    goto fail;
  }
  header = malloc(hlen + 1);
  if (!header) {
    fsdp_errorf("safetensors: out of memory reading the header of '%s'", path);
    goto fail;
  }
  if (read_full(f->fd, header, hlen, 8)) {
    fsdp_errorf("safetensors: '%s': could not read the %llu-byte header", path, (unsigned long long)hlen);
    goto fail;
  }
  header[hlen] = 0;
  int64_t bad = utf8_invalid_at((const unsigned char*)header, hlen);
  if (bad >= 0) {
    fsdp_errorf("safetensors: '%s': bad header at byte %lld: invalid UTF-8", path, (long long)bad);
    goto fail;
  }
  f->data_start = 8 + (int64_t)hlen;
  if (parse_header(f, header, hlen, size - f->data_start)) goto fail;
  free(header);
  return f;
fail:
  free(header);
  fsdp_st_close(f);
  return NULL;
}

int fsdp_st_count(const fsdp_st_file* f) {
  CHECK_INT(f, "safetensors: count: file is NULL");
  return f->n;
}
const char* fsdp_st_name(const fsdp_st_file* f, int i) {
  CHECK_NULL(f, "safetensors: name: file is NULL");
  CHECK_NULL(i >= 0 && i < f->n, "safetensors: '%s': tensor index %d out of range (%d tensors)", f->path, i, f->n);
  return f->e[i].name;
}
const char* fsdp_st_metadata(const fsdp_st_file* f) {
  CHECK_NULL(f, "safetensors: metadata: file is NULL");
  return f->metadata;
}
fsdp_tensor* fsdp_st_get(fsdp_st_file* f, int i) {
  CHECK_NULL(f, "safetensors: get: file is NULL");
  CHECK_NULL(i >= 0 && i < f->n, "safetensors: '%s': tensor index %d out of range (%d tensors)", f->path, i, f->n);
  const st_entry* e = &f->e[i];
  fsdp_tensor* t = fsdp_new(e->ndim, e->shape, e->dtype, FSDP_CPU);
  if (!t) return NULL;
  int fd = f->shared ? f->shared->fd : f->fd;
  if (read_full(fd, fsdp_ptr(t), (size_t)(e->end - e->begin), f->data_start + e->begin)) {
    fsdp_tensor_release(t);
    CHECK_NULL(0, "safetensors: '%s': could not read the data of tensor '%s' (file changed or truncated?)", f->path,
               e->name);
  }
  return t;
}

// ---- file-backed tensors (ops/deferred.c): values read when used, a range when copied from --------------
typedef struct {
  st_shared* file;
  int64_t begin, nbytes;  // the tensor's bytes in the file
  char* name;
} st_lazy;
static void lazy_release(void* ctx) {
  st_lazy* z = ctx;
  shared_release(z->file);
  free(z->name);
  free(z);
}
static int lazy_read(void* ctx, void* dst, size_t nbytes, int64_t offset) {
  st_lazy* z = ctx;
  CHECK_INT(offset >= 0 && (int64_t)nbytes <= z->nbytes - offset,
            "safetensors: '%s': bytes %lld..%lld of tensor '%s' asked, it has %lld", z->file->path, (long long)offset,
            (long long)(offset + (int64_t)nbytes), z->name, (long long)z->nbytes);
  CHECK_INT(!read_full(z->file->fd, dst, nbytes, z->begin + offset),
            "safetensors: '%s': could not read the data of tensor '%s' (file changed or truncated?)", z->file->path,
            z->name);
  return 0;
}
fsdp_tensor* fsdp_st_get_lazy(fsdp_st_file* f, int i) {
  CHECK_NULL(f, "safetensors: get: file is NULL");
  CHECK_NULL(i >= 0 && i < f->n, "safetensors: '%s': tensor index %d out of range (%d tensors)", f->path, i, f->n);
  const st_entry* e = &f->e[i];
  if (!f->shared) {  // the file's descriptor, shared by its tensors from now on
    f->shared = calloc(1, sizeof *f->shared);
    CHECK_NULL(f->shared, "safetensors: out of memory");
    f->shared->refs = 1;  // (the file's own)
    f->shared->fd = f->fd;
    f->shared->path = strdup(f->path);
    f->fd = -1;
    if (!f->shared->path) return NULL;
  }
  st_lazy* z = calloc(1, sizeof *z);
  fsdp_storage* s =
      z ? fsdp_storage_new_empty((size_t)(e->end - e->begin), FSDP_CPU, fsdp_default_mem_category()) : NULL;
  if (!s || !(z->name = strdup(e->name))) {
    free(z);
    fsdp_storage_release(s);
    CHECK_NULL(0, "safetensors: out of memory");
  }
  z->file = f->shared;
  z->file->refs++;
  z->begin = f->data_start + e->begin;
  z->nbytes = e->end - e->begin;
  s->source = (fsdp_source){lazy_read, lazy_release, z};
  fsdp_tensor* t = fsdp_view_storage(s, e->dtype, e->ndim, e->shape, 0);
  fsdp_storage_release(s);
  return t;
}

// ---- saving -------------------------------------------------------------------------------------------
static int write_full(int fd, const void* buf, size_t n) {
  const char* p = buf;
  while (n > 0) {
    ssize_t k = write(fd, p, n > ((size_t)1 << 30) ? ((size_t)1 << 30) : n);
    if (k < 0 && errno == EINTR) continue;
    if (k <= 0) return -1;
    p += k;
    n -= (size_t)k;
  }
  return 0;
}

// the header JSON for tensors in the caller's order, padded with spaces to a multiple of 8
static int build_header(sbuf* h, const char* path, int n, const char** names, fsdp_tensor** tensors,
                        const char* metadata_json) {
  if (sb_putc(h, '{')) return -1;
  if (metadata_json) {
    jreader r = {metadata_json, strlen(metadata_json), 0, path, "save: bad metadata JSON"};
    int64_t bad = utf8_invalid_at((const unsigned char*)r.s, r.n);
    if (bad >= 0) {
      fsdp_errorf("safetensors: '%s': save: metadata is not valid UTF-8 (at byte %lld)", path, (long long)bad);
      return -1;
    }
    sbuf meta = {0};
    int rc = j_metadata(&r, &meta);
    if (!rc) {
      j_ws(&r);
      if (r.i != r.n) {
        fsdp_errorf("safetensors: '%s': save: bad metadata JSON at byte %zu: unexpected text after the object", path,
                    r.i);
        rc = -1;
      }
    }
    if (!rc) rc = sb_puts(h, "\"__metadata__\":") || sb_put(h, meta.p, meta.len);
    free(meta.p);
    if (rc) return -1;
  }
  int64_t off = 0;
  for (int i = 0; i < n; i++) {
    const fsdp_tensor* t = tensors[i];
    int64_t nbytes = fsdp_tensor_numel(t) * (int64_t)fsdp_dtype_size(t->dtype);
    if ((i > 0 || metadata_json) && sb_putc(h, ',')) return -1;
    if (sb_json_string(h, names[i]) || sb_puts(h, ":{\"dtype\":\"") || sb_puts(h, st_dtype_names[t->dtype]) ||
        sb_puts(h, "\",\"shape\":["))
      return -1;
    for (int d = 0; d < t->ndim; d++)
      if ((d && sb_putc(h, ',')) || sb_int(h, t->shape[d])) return -1;
    if (sb_puts(h, "],\"data_offsets\":[") || sb_int(h, off) || sb_putc(h, ',') || sb_int(h, off + nbytes) ||
        sb_puts(h, "]}"))
      return -1;
    off += nbytes;
  }
  if (sb_putc(h, '}')) return -1;
  while (h->len % 8)
    if (sb_putc(h, ' ')) return -1;
  return 0;
}

// writes the tensor's elements in row-major order (through a contiguous host copy when strided or
// on a device);
// returns 0, -1 on an I/O error (errno set) or -2 with the error already set
static int write_tensor(int fd, fsdp_tensor* t) {
  size_t nbytes = (size_t)fsdp_tensor_numel(t) * fsdp_dtype_size(t->dtype);
  if (nbytes == 0) return 0;
  if (fsdp_check_data("save", t)) return -2;  // (a file-backed tensor is read now; a meta one has nothing to write)
  if (fsdp_tensor_is_contiguous(t) && fsdp_device_of(t) == FSDP_CPU) return write_full(fd, fsdp_ptr(t), nbytes);
  // strided, or on a device: the host writes a contiguous copy in its own memory
  fsdp_tensor* c = fsdp_new(t->ndim, t->shape, t->dtype, FSDP_CPU);
  if (!c) return -2;
  int rc = fsdp_copy_strided(c, t) ? -2 : write_full(fd, fsdp_ptr(c), nbytes);
  fsdp_tensor_release(c);
  return rc;
}

// makes a rename in path's directory durable (best effort: errors are ignored)
static void fsync_parent_dir(const char* path) {
  char* dir = strdup(path);
  if (!dir) return;
  char* slash = strrchr(dir, '/');
  if (slash == dir) slash[1] = 0;  // "/file" -> "/"
  else if (slash) *slash = 0;      // "a/b/file" -> "a/b"
  int fd = open(slash ? dir : ".", O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd >= 0) {
    (void)fsync(fd);
    close(fd);
  }
  free(dir);
}

int fsdp_st_save(const char* path, int n, const char** names, fsdp_tensor** tensors, const char* metadata_json) {
  CHECK_INT(path && *path, "safetensors: save: empty path");
  CHECK_INT(n >= 0 && (n == 0 || (names && tensors)), "safetensors: save '%s': bad tensor list (n = %d)", path, n);
  for (int i = 0; i < n; i++) {
    CHECK_INT(names[i] && names[i][0], "safetensors: save '%s': tensor %d has an empty name", path, i);
    CHECK_INT(strcmp(names[i], "__metadata__") != 0,
              "safetensors: save '%s': '__metadata__' is reserved, not a tensor name", path);
    CHECK_INT(utf8_invalid_at((const unsigned char*)names[i], strlen(names[i])) < 0,
              "safetensors: save '%s': tensor name %d is not valid UTF-8", path, i);
    CHECK_INT(tensors[i], "safetensors: save '%s': tensor '%s' is NULL", path, names[i]);
  }
  int err;
  const char* dup = find_duplicate(names, n, &err);
  if (err) return -1;
  CHECK_INT(!dup, "safetensors: save '%s': tensor name '%s' appears twice", path, dup);

  sbuf h = {0};
  if (build_header(&h, path, n, names, tensors, metadata_json)) {
    free(h.p);
    return -1;
  }

  size_t plen = strlen(path) + 32;
  char* tmp = malloc(plen);
  if (!tmp) {
    free(h.p);
    CHECK_INT(0, "safetensors: out of memory");
  }
  snprintf(tmp, plen, "%s.tmp.%ld", path, (long)getpid());
  int fd = open(tmp, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) {
    fsdp_errorf("safetensors: save '%s': cannot create the temporary file '%s': %s", path, tmp, strerror(errno));
    free(tmp);
    free(h.p);
    return -1;
  }
  unsigned char lenbuf[8];
  for (int k = 0; k < 8; k++) lenbuf[k] = (unsigned char)((uint64_t)h.len >> (8 * k));
  // rc: 0 ok, -1 an I/O error (errno), -2 an error already set (allocation of a contiguous copy)
  int rc = write_full(fd, lenbuf, 8) || write_full(fd, h.p, h.len) ? -1 : 0;
  for (int i = 0; i < n && !rc; i++) rc = write_tensor(fd, tensors[i]);
  if (rc == -1) fsdp_errorf("safetensors: save '%s': writing '%s' failed: %s", path, tmp, strerror(errno));
  if (!rc && fsync(fd) != 0) {
    rc = -1;
    fsdp_errorf("safetensors: save '%s': fsync of '%s' failed: %s", path, tmp, strerror(errno));
  }
  if (close(fd) != 0 && !rc) {
    rc = -1;
    fsdp_errorf("safetensors: save '%s': closing '%s' failed: %s", path, tmp, strerror(errno));
  }
  if (!rc && rename(tmp, path) != 0) {
    rc = -1;
    fsdp_errorf("safetensors: save '%s': cannot rename '%s' to it: %s", path, tmp, strerror(errno));
  }
  if (rc) unlink(tmp);
  else fsync_parent_dir(path);
  free(tmp);
  free(h.p);
  return rc ? -1 : 0;
}
