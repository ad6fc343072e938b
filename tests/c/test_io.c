/*
 * test_io.c -- safetensors save/load: round trip of every dtype and layout, the Python fixture,
 * hostile files (each an error naming the file and the problem), atomic saves. Run it under
 * valgrind --leak-check=full to check that every path releases what it takes.
 */
#include <dirent.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "ctest.h"
#include "core/core.h"  // fsdp_new_view: a strided view without depending on the shape ops

static char g_dir[256];

static const char* tmp_path(const char* name) {
  static char buf[4][512];
  static int k;
  char* b = buf[k++ & 3];
  snprintf(b, 512, "%s/%s", g_dir, name);
  return b;
}
static void write_bytes(const char* path, const void* data, size_t n) {
  FILE* f = fopen(path, "wb");
  if (n) fwrite(data, 1, n, f);
  fclose(f);
}
static char* read_bytes(const char* path, size_t* n) {
  FILE* f = fopen(path, "rb");
  if (!f) return NULL;
  fseek(f, 0, SEEK_END);
  long len = ftell(f);
  fseek(f, 0, SEEK_SET);
  char* b = malloc(len + 1);
  *n = fread(b, 1, len, f);
  fclose(f);
  return b;
}
// a file: u64 length of `header`, header, then `data_len` zero bytes
static void write_st(const char* path, const char* header, size_t data_len) {
  size_t h = strlen(header);
  char* b = calloc(1, 8 + h + data_len + 1);
  uint64_t n = h;
  memcpy(b, &n, 8);
  memcpy(b + 8, header, h);
  write_bytes(path, b, 8 + h + data_len);
  free(b);
}
static int contains(const char* s, const char* frag) { return strstr(s, frag) != NULL; }
// expects fsdp_st_open(path) to fail with a message containing the path and `frag`
static int open_fails(const char* path, const char* frag) {
  fsdp_clear_error();
  fsdp_st_file* f = fsdp_st_open(path);
  if (f) {
    fsdp_st_close(f);
    printf("  %s: opened, expected error '%s'\n", path, frag);
    return 0;
  }
  const char* e = fsdp_last_error();
  if (getenv("VERBOSE")) printf("  %s\n", e);
  if (!contains(e, path) || !contains(e, frag)) {
    printf("  error '%s' lacks '%s'\n", e, frag);
    return 0;
  }
  return 1;
}
static int count_tmp_files(void) {
  DIR* d = opendir(g_dir);
  int n = 0;
  struct dirent* e;
  while ((e = readdir(d))) n += strstr(e->d_name, ".tmp.") != NULL;
  closedir(d);
  return n;
}

// the tensors of tests/data/mixed.safetensors, in the order the Python library writes them
typedef struct {
  const char* names[7];
  fsdp_tensor* t[7];
} mixed_set;
static void mixed_make(mixed_set* m) {
  double w[6] = {0.5, -1.25, 2.0, 3.75, -0.125, 100.0}, sc = 3.5;
  int64_t ids[5] = {0, -1, ((int64_t)1 << 40) + 3, ((int64_t)1 << 62) + 1, INT64_MIN}, step = 7;
  uint16_t bh[4] = {0x3F80, 0xC020, 0x3E20, 0x7180}, h[4] = {0x3C00, 0xB800, 0x7BFF, 0x0001};
  const char* names[7] = {"ids", "step", "empty", "scalar", "weight", "bhalf", "half"};
  memcpy(m->names, names, sizeof names);
  m->t[0] = fsdp_from_blob(1, (int64_t[]){5}, FSDP_I64, ids);
  m->t[1] = fsdp_from_blob(0, NULL, FSDP_I64, &step);
  m->t[2] = fsdp_empty(2, (int64_t[]){0, 4}, FSDP_F32, FSDP_CPU);
  m->t[3] = fsdp_from_doubles(0, NULL, FSDP_F32, &sc);
  m->t[4] = fsdp_from_doubles(2, (int64_t[]){2, 3}, FSDP_F32, w);
  m->t[5] = fsdp_from_blob(1, (int64_t[]){4}, FSDP_BF16, bh);
  m->t[6] = fsdp_from_blob(2, (int64_t[]){2, 2}, FSDP_F16, h);
}
static void mixed_free(mixed_set* m) {
  for (int i = 0; i < 7; i++) fsdp_tensor_release(m->t[i]);
}
static int same_tensor(fsdp_tensor* a, fsdp_tensor* b) {  // a contiguous
  if (fsdp_tensor_dtype(a) != fsdp_tensor_dtype(b) || fsdp_tensor_ndim(a) != fsdp_tensor_ndim(b)) return 0;
  for (int d = 0; d < fsdp_tensor_ndim(a); d++)
    if (fsdp_tensor_size(a, d) != fsdp_tensor_size(b, d)) return 0;
  size_t n = fsdp_tensor_numel(a) * fsdp_dtype_size(fsdp_tensor_dtype(a));
  return fsdp_tensor_is_contiguous(b) && memcmp(fsdp_tensor_data(a), fsdp_tensor_data(b), n) == 0;
}

TEST(test_roundtrip_all_dtypes) {
  mixed_set m;
  mixed_make(&m);
  const char* p = tmp_path("rt.safetensors");
  EXPECT(fsdp_st_save(p, 7, m.names, m.t, "{ \"b\" : \"x\\\"y\", \"a\":\"\\u00e9\\ud83d\\ude00\" }") == 0);
  fsdp_st_file* f = fsdp_st_open(p);
  EXPECT(f != NULL);
  if (f) {
    EXPECT(fsdp_st_count(f) == 7);
    EXPECT(strcmp(fsdp_st_metadata(f), "{\"b\":\"x\\\"y\",\"a\":\"\xc3\xa9\xf0\x9f\x98\x80\"}") == 0);
    for (int i = 0; i < 7 && i < fsdp_st_count(f); i++) {
      EXPECT(strcmp(fsdp_st_name(f, i), m.names[i]) == 0);  // the caller's order
      fsdp_tensor* t = fsdp_st_get(f, i);
      EXPECT(t && same_tensor(m.t[i], t));
      fsdp_tensor_release(t);
    }
    fsdp_tensor* s = fsdp_st_get(f, 3);
    EXPECT(s && fsdp_tensor_ndim(s) == 0 && *(float*)fsdp_tensor_data(s) == 3.5f);
    fsdp_tensor_release(s);
    fsdp_tensor* ids = fsdp_st_get(f, 0);
    EXPECT(ids && ((int64_t*)fsdp_tensor_data(ids))[3] == ((int64_t)1 << 62) + 1);
    EXPECT(ids && ((int64_t*)fsdp_tensor_data(ids))[4] == INT64_MIN);
    fsdp_tensor_release(ids);
    EXPECT(fsdp_st_get(f, 7) == NULL && contains(fsdp_last_error(), "out of range"));
    EXPECT(fsdp_st_get(f, -1) == NULL);
    EXPECT(fsdp_st_name(f, 7) == NULL);
    fsdp_st_close(f);
  }
  mixed_free(&m);
  EXPECT(count_tmp_files() == 0);
}

TEST(test_noncontiguous_is_written_contiguous) {
  // a (3, 2) transposed view of a (2, 3) tensor, and a strided slice with an offset
  double v[6] = {1, 2, 3, 4, 5, 6};
  fsdp_tensor* a = fsdp_from_doubles(2, (int64_t[]){2, 3}, FSDP_F32, v);
  fsdp_tensor* at = fsdp_new_view(a, 2, (int64_t[]){3, 2}, (int64_t[]){1, 3}, 0);
  fsdp_tensor* col = fsdp_new_view(a, 1, (int64_t[]){2}, (int64_t[]){3}, 1);  // a[:, 1] = {2, 5}
  EXPECT(!fsdp_tensor_is_contiguous(at) && !fsdp_tensor_is_contiguous(col));
  const char* p = tmp_path("nc.safetensors");
  EXPECT(fsdp_st_save(p, 2, (const char*[]){"t", "col"}, (fsdp_tensor*[]){at, col}, NULL) == 0);
  fsdp_st_file* f = fsdp_st_open(p);
  EXPECT(f != NULL);
  if (f) {
    EXPECT(strcmp(fsdp_st_metadata(f), "") == 0);
    fsdp_tensor* t = fsdp_st_get(f, 0);
    fsdp_tensor* c = fsdp_st_get(f, 1);
    float want_t[6] = {1, 4, 2, 5, 3, 6}, want_c[2] = {2, 5};
    EXPECT(t && fsdp_tensor_size(t, 0) == 3 && fsdp_tensor_size(t, 1) == 2);
    EXPECT(t && memcmp(fsdp_tensor_data(t), want_t, sizeof want_t) == 0);
    EXPECT(c && memcmp(fsdp_tensor_data(c), want_c, sizeof want_c) == 0);
    fsdp_tensor_release(t);
    fsdp_tensor_release(c);
    fsdp_st_close(f);
  }
  fsdp_tensor_release(col);
  fsdp_tensor_release(at);
  fsdp_tensor_release(a);
}

TEST(test_python_fixture) {
  const char* fx = "tests/data/mixed.safetensors";
  fsdp_st_file* f = fsdp_st_open(fx);
  EXPECT(f != NULL);
  if (!f) return;
  mixed_set m;
  mixed_make(&m);
  EXPECT(fsdp_st_count(f) == 7);
  for (int i = 0; i < 7 && i < fsdp_st_count(f); i++) {
    EXPECT(strcmp(fsdp_st_name(f, i), m.names[i]) == 0);
    fsdp_tensor* t = fsdp_st_get(f, i);
    EXPECT(t && same_tensor(m.t[i], t));
    fsdp_tensor_release(t);
  }
  EXPECT(strcmp(fsdp_st_metadata(f), "{\"note\":\"caf\xc3\xa9 \\\"q\\\"\\n\\t/\"}") == 0);
  // byte-identical: the same tensors and metadata written by us
  const char* p = tmp_path("same.safetensors");
  EXPECT(fsdp_st_save(p, 7, m.names, m.t, fsdp_st_metadata(f)) == 0);
  size_t n1 = 0, n2 = 0;
  char *a = read_bytes(fx, &n1), *b = read_bytes(p, &n2);
  EXPECT(a && b && n1 == 564 && n1 == n2 && memcmp(a, b, n1) == 0);
  free(a);
  free(b);
  fsdp_st_close(f);
  mixed_free(&m);
  EXPECT(open_fails("tests/data/unsupported.safetensors", "tensor 'bad' has dtype F64"));
}

TEST(test_hostile_files) {
  const char* p = tmp_path("bad.safetensors");
  // valid baseline: 2 f32 tensors of 8 bytes
  const char* good = "{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]},"
                     "\"b\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[8,16]}}";
  write_st(p, good, 16);
  fsdp_st_file* f = fsdp_st_open(p);
  EXPECT(f != NULL);
  fsdp_st_close(f);

  // truncated data and truncated header
  write_st(p, good, 12);
  EXPECT(open_fails(p, "past the end"));
  {
    char b[40] = {0};
    uint64_t n = strlen(good);
    memcpy(b, &n, 8);
    memcpy(b + 8, good, 30);
    write_bytes(p, b, 38);
    EXPECT(open_fails(p, "header length"));
    write_bytes(p, b, 5);
    EXPECT(open_fails(p, "too small"));
    // header length 2^62 (and 2^64-1)
    n = (uint64_t)1 << 62;
    memcpy(b, &n, 8);
    write_bytes(p, b, 40);
    EXPECT(open_fails(p, "exceeds the 100 MB limit"));
    n = UINT64_MAX;
    memcpy(b, &n, 8);
    write_bytes(p, b, 40);
    EXPECT(open_fails(p, "exceeds the 100 MB limit"));
  }
  struct {
    const char* header;
    size_t data;
    const char* frag;
  } cases[] = {
      {"{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]}", 8, "bad header"},           // unclosed
      {"{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]}}}", 8, "after the closing"},  // junk
      {"[1,2]", 0, "does not start with '{'"},
      {" {}", 0, "does not start with '{'"},
      {"{\"a\":{\"dtype\":\"F32\",\"shape\":[2.0],\"data_offsets\":[0,8]}}", 8, "only integers"},
      {"{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8],}}", 8, "bad header"},  // trailing comma
      {"{\"a\":{\"dtype\":\"F32\",\"shape\":[true],\"data_offsets\":[0,8]}}", 8, "expected an integer"},
      {"{\"a\":{\"dtype\":\"F32\",\"shape\":[02],\"data_offsets\":[0,8]}}", 8, "leading zero"},
      {"{\"a\":{\"dtype\":\"F32\",\"shape\":[99999999999999999999],\"data_offsets\":[0,8]}}", 8, "too large"},
      {"{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]},\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_"
       "offsets\":[8,16]}}",
       16, "'a' appears twice"},
      {"{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]},\"b\":{\"dtype\":\"F32\",\"shape\":[2],\"data_"
       "offsets\":[4,12]}}",
       12, "overlap"},
      {"{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]},\"b\":{\"dtype\":\"F32\",\"shape\":[2],\"data_"
       "offsets\":[12,20]}}",
       20, "gap"},
      {"{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]}}", 16, "cover only 8"},
      {"{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[1000,1008]}}", 8, "gap"},
      {"{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[8,0]}}", 8, "invalid data_offsets"},
      {"{\"a\":{\"dtype\":\"F32\",\"shape\":[3],\"data_offsets\":[0,8]}}", 8, "needs 12 bytes"},
      {"{\"a\":{\"dtype\":\"F32\",\"shape\":[-2],\"data_offsets\":[0,8]}}", 8, "negative size"},
      {"{\"a\":{\"dtype\":\"F32\",\"shape\":[4294967296,4294967296,4],\"data_offsets\":[0,8]}}", 8, "absurd shape"},
      {"{\"a\":{\"dtype\":\"F32\",\"shape\":[1,1,1,1,1,1,1,1,1],\"data_offsets\":[0,4]}}", 4, "more than 8"},
      {"{\"a\":{\"dtype\":\"F64\",\"shape\":[1],\"data_offsets\":[0,8]}}", 8, "tensor 'a' has dtype F64"},
      {"{\"a\":{\"dtype\":\"U8\",\"shape\":[1],\"data_offsets\":[0,1]}}", 1, "dtype U8"},
      {"{\"a\":{\"shape\":[2],\"data_offsets\":[0,8]}}", 8, "no 'dtype'"},
      {"{\"a\":{\"dtype\":\"F32\",\"data_offsets\":[0,8]}}", 8, "no 'shape'"},
      {"{\"a\":{\"dtype\":\"F32\",\"shape\":[2]}}", 8, "no 'data_offsets'"},
      {"{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8],\"x\":1}}", 8, "unexpected key 'x'"},
      {"{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"shape\":[2],\"data_offsets\":[0,8]}}", 8, "repeated key 'shape'"},
      {"{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0]}}", 8, "2 entries"},
      {"{\"__metadata__\":{\"k\":1}}", 0, "must be a string"},
      {"{\"__metadata__\":{\"k\":\"v\",\"k\":\"w\"}}", 0, "'k' appears twice"},
      {"{\"__metadata__\":{},\"__metadata__\":{}}", 0, "__metadata__ appears twice"},
      {"{\"a\\q\":{}}", 0, "bad escape"},
      {"{\"a\\u00\":{}}", 0, "\\u escape"},
      {"{\"a\\ud800\":{}}", 0, "surrogate"},
      {"{\"a\\u0000\":{}}", 0, "NUL"},
      {"{\"a\nb\":{}}", 0, "control character"},
      {"{\"\xff\":{}}", 0, "invalid UTF-8"},
      {"{\"a\":null}", 0, "expected '{'"},
      {"{\"a\"", 0, "end of the header"},
  };
  for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
    write_st(p, cases[i].header, cases[i].data);
    if (!open_fails(p, cases[i].frag)) {
      printf("  case %zu: %s\n", i, cases[i].header);
      ctest_cur_failed = 1;
    }
  }
  // deep nesting does not recurse: it is just an error
  {
    char deep[4096] = "{\"a\":";
    for (int i = 0; i < 2000; i++) strcat(deep, "[");
    write_st(p, deep, 0);
    EXPECT(open_fails(p, "bad header"));
  }
  EXPECT(open_fails(tmp_path("missing.safetensors"), "No such file"));
  EXPECT(open_fails(g_dir, "not a regular file"));
  // after all that, a good file still loads
  write_st(p, good, 16);
  f = fsdp_st_open(p);
  EXPECT(f != NULL && fsdp_st_count(f) == 2);
  fsdp_tensor* t = f ? fsdp_st_get(f, 1) : NULL;
  EXPECT(t && fsdp_tensor_numel(t) == 2 && ((float*)fsdp_tensor_data(t))[1] == 0.0f);
  fsdp_tensor_release(t);
  fsdp_st_close(f);
  // the empty header {} padded with spaces is a valid file with no tensors
  write_st(p, "{}      ", 0);
  f = fsdp_st_open(p);
  EXPECT(f != NULL && fsdp_st_count(f) == 0);
  fsdp_st_close(f);
}

TEST(test_failed_save_keeps_file) {
  double v[2] = {1, 2};
  fsdp_tensor* a = fsdp_from_doubles(1, (int64_t[]){2}, FSDP_F32, v);
  fsdp_tensor* b = fsdp_from_doubles(1, (int64_t[]){2}, FSDP_F32, v);
  const char* p = tmp_path("keep.safetensors");
  EXPECT(fsdp_st_save(p, 1, (const char*[]){"a"}, (fsdp_tensor*[]){a}, "{\"v\":\"1\"}") == 0);
  size_t n0 = 0, n1 = 0;
  char* before = read_bytes(p, &n0);
  struct {
    int n;
    const char* names[2];
    const char* meta;
    const char* frag;
  } bad[] = {
      {2, {"x", "x"}, NULL, "'x' appears twice"},
      {2, {"x", ""}, NULL, "empty name"},
      {1, {"__metadata__"}, NULL, "reserved"},
      {1, {"\xc3("}, NULL, "UTF-8"},
      {1, {"x"}, "{\"v\":2}", "must be a string"},
      {1, {"x"}, "{\"v\":\"2\"} x", "unexpected text"},
      {1, {"x"}, "[]", "expected '{'"},
      {1, {"x"}, "{\"v\":\"\xff\"}", "not valid UTF-8"},
  };
  for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
    fsdp_clear_error();
    EXPECT(fsdp_st_save(p, bad[i].n, bad[i].names, (fsdp_tensor*[]){a, b}, bad[i].meta) != 0);
    if (!contains(fsdp_last_error(), bad[i].frag)) {
      printf("  save case %zu: %s\n", i, fsdp_last_error());
      ctest_cur_failed = 1;
    }
  }
  EXPECT(fsdp_st_save("/nonexistent-dir-fsdp/x.safetensors", 1, (const char*[]){"a"}, (fsdp_tensor*[]){a}, NULL) != 0);
  EXPECT(contains(fsdp_last_error(), "/nonexistent-dir-fsdp/x.safetensors.tmp."));
  // a directory in the way of the rename: the write succeeds, the rename fails, the temp file goes
  const char* d = tmp_path("adir");
  char cmd[600];
  snprintf(cmd, sizeof cmd, "mkdir -p '%s/sub'", d);
  EXPECT(system(cmd) == 0);
  EXPECT(fsdp_st_save(d, 1, (const char*[]){"a"}, (fsdp_tensor*[]){a}, NULL) != 0);
  EXPECT(contains(fsdp_last_error(), "cannot rename"));
  char* after = read_bytes(p, &n1);
  EXPECT(before && after && n0 == n1 && memcmp(before, after, n0) == 0);
  EXPECT(count_tmp_files() == 0);
  free(before);
  free(after);
  // a good save over it replaces it
  EXPECT(fsdp_st_save(p, 2, (const char*[]){"a", "b"}, (fsdp_tensor*[]){a, b}, NULL) == 0);
  fsdp_st_file* f = fsdp_st_open(p);
  EXPECT(f && fsdp_st_count(f) == 2);
  fsdp_st_close(f);
  fsdp_tensor_release(a);
  fsdp_tensor_release(b);
}

int main(void) {
  snprintf(g_dir, sizeof g_dir, "/tmp/fsdp_test_io_XXXXXX");
  if (!mkdtemp(g_dir)) {
    perror("mkdtemp");
    return 1;
  }
  RUN(test_roundtrip_all_dtypes);
  RUN(test_noncontiguous_is_written_contiguous);
  RUN(test_python_fixture);
  RUN(test_hostile_files);
  RUN(test_failed_save_keeps_file);
  char cmd[400];
  snprintf(cmd, sizeof cmd, "rm -rf '%s'", g_dir);
  if (system(cmd) != 0) printf("could not remove %s\n", g_dir);
  return ctest_summary("test_io");
}
