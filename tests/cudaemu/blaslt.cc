/*
 * tests/cudaemu/blaslt.cc -- cuBLASLt for the CUDA executor: the matrix products of the CUDA
 * backend (backend/cuda/linalg.cu), run on the CPU with the semantics NVIDIA documents for
 * cublasLtMatmul, so that a call a GPU would refuse, or that would fault there, fails here too:
 *
 *   the product   D = alpha op(A) op(B) + beta C on column-major matrices, op(A) m x k, op(B)
 *                 k x n, C and D m x n (m, n from C's rows and columns); op is CUBLAS_OP_N or
 *                 CUBLAS_OP_T (TRANSA, TRANSB); strided batches (BATCH_COUNT, STRIDED_BATCH_OFFSET
 *                 in elements), an A or B with batch count 1 used by every batch; C == D in place
 *                 when their layouts are the same
 *   the types     A and B both CUDA_R_32F or both CUDA_R_16BF, C and D CUDA_R_32F, the scale type
 *                 CUDA_R_32F; CUBLAS_COMPUTE_32F sums in float32 (k ascending: one order, so
 *                 results repeat bit for bit), CUBLAS_COMPUTE_32F_FAST_TF32 first rounds A's and B's
 *                 float32 elements to TF32 (10 mantissa bits, to nearest even); bfloat16 elements
 *                 widen exactly to float32
 *   the scalars   alpha and beta are host floats (CUBLASLT_POINTER_MODE_HOST, the default), read
 *                 at the call; when beta is 0, C is not read (it may hold NaN garbage)
 *   the algorithm cublasLtMatmulAlgoGetHeuristic checks the problem and returns one algorithm
 *                 ("stand-in v1", no workspace) that keeps the operand alignments the preference
 *                 promised (MIN_ALIGNMENT_{A,B,C,D}_BYTES, 256 when not set); cublasLtMatmul checks
 *                 the problem again, that every pointer is device memory covering its matrices
 *                 (a host pointer: CUBLAS_STATUS_INVALID_VALUE) and that each is aligned as promised
 *                 (a misaligned one: CUBLAS_STATUS_NOT_SUPPORTED, as a kernel chosen for a wider
 *                 alignment cannot run it), then queues the product on the stream
 *
 * Statuses as documented: CUBLAS_STATUS_INVALID_VALUE for values in conflict (shapes, batch
 * counts, leading dimensions, host pointers), CUBLAS_STATUS_NOT_SUPPORTED for what no algorithm
 * of the stand-in implements. It refuses by name every descriptor, layout or preference attribute
 * it does not implement (EPILOGUE, BIAS_POINTER, POINTER_MODE, ORDER, ...) rather than ignoring
 * it: each refusal prints one line "cudaemu: cuBLASLt: <what> refused: <why>". Memory freed
 * before a queued product runs is a sticky illegal address (fsdp_emu::fail_sticky), as a fault.
 */
#include <cublasLt.h>

#include "runtime.h"

#include <stdarg.h>
#include <stdio.h>
#include <string.h>

#include <vector>

struct fsdp_emu_lt {
  int unused;
};
struct fsdp_emu_lt_desc {
  cublasComputeType_t compute;
  cudaDataType_t scale;
  cublasOperation_t transa, transb;
};
struct fsdp_emu_lt_layout {
  cudaDataType_t type;
  uint64_t rows, cols;
  int64_t ld;
  int32_t batch;
  int64_t stride;  // elements between batches
};
struct fsdp_emu_lt_pref {
  uint64_t max_workspace;
  uint32_t align[4];  // A, B, C, D in bytes
};

namespace {

const uint64_t ALGO_MAGIC = 0x31767473656c7563ull;  // "culestv1": the stand-in's one algorithm
const uint32_t DEFAULT_ALIGN = 256;                 // the preference's default, as documented
const uint64_t MAX_DIM = (uint64_t)1 << 40;         // (so that no extent overflows)

// ---- messages ----------------------------------------------------------------------------------------
cublasStatus_t refuse(cublasStatus_t s, const char* what, const char* fmt, ...) __attribute__((format(printf, 3, 4)));
cublasStatus_t refuse(cublasStatus_t s, const char* what, const char* fmt, ...) {
  char why[512];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(why, sizeof why, fmt, ap);
  va_end(ap);
  fprintf(stderr, "cudaemu: cuBLASLt: %s refused: %s\n", what, why);
  return s;
}

const char* type_name(cudaDataType_t t) {
  switch (t) {
    case CUDA_R_32F: return "CUDA_R_32F";
    case CUDA_R_16F: return "CUDA_R_16F";
    case CUDA_R_16BF: return "CUDA_R_16BF";
    case CUDA_R_64F: return "CUDA_R_64F";
  }
  return "an unknown cudaDataType_t";
}
const char* compute_name(cublasComputeType_t c) {
  switch (c) {
    case CUBLAS_COMPUTE_16F: return "CUBLAS_COMPUTE_16F";
    case CUBLAS_COMPUTE_32F: return "CUBLAS_COMPUTE_32F";
    case CUBLAS_COMPUTE_32F_FAST_16F: return "CUBLAS_COMPUTE_32F_FAST_16F";
    case CUBLAS_COMPUTE_32F_FAST_16BF: return "CUBLAS_COMPUTE_32F_FAST_16BF";
    case CUBLAS_COMPUTE_32F_FAST_TF32: return "CUBLAS_COMPUTE_32F_FAST_TF32";
    case CUBLAS_COMPUTE_64F: return "CUBLAS_COMPUTE_64F";
  }
  return "an unknown cublasComputeType_t";
}
const char* desc_attr_name(cublasLtMatmulDescAttributes_t a) {
  switch (a) {
    case CUBLASLT_MATMUL_DESC_COMPUTE_TYPE: return "CUBLASLT_MATMUL_DESC_COMPUTE_TYPE";
    case CUBLASLT_MATMUL_DESC_SCALE_TYPE: return "CUBLASLT_MATMUL_DESC_SCALE_TYPE";
    case CUBLASLT_MATMUL_DESC_POINTER_MODE: return "CUBLASLT_MATMUL_DESC_POINTER_MODE";
    case CUBLASLT_MATMUL_DESC_TRANSA: return "CUBLASLT_MATMUL_DESC_TRANSA";
    case CUBLASLT_MATMUL_DESC_TRANSB: return "CUBLASLT_MATMUL_DESC_TRANSB";
    case CUBLASLT_MATMUL_DESC_TRANSC: return "CUBLASLT_MATMUL_DESC_TRANSC";
    case CUBLASLT_MATMUL_DESC_EPILOGUE: return "CUBLASLT_MATMUL_DESC_EPILOGUE";
    case CUBLASLT_MATMUL_DESC_BIAS_POINTER: return "CUBLASLT_MATMUL_DESC_BIAS_POINTER";
  }
  return "an unknown matmul descriptor attribute";
}
const char* layout_attr_name(cublasLtMatrixLayoutAttribute_t a) {
  switch (a) {
    case CUBLASLT_MATRIX_LAYOUT_TYPE: return "CUBLASLT_MATRIX_LAYOUT_TYPE";
    case CUBLASLT_MATRIX_LAYOUT_ORDER: return "CUBLASLT_MATRIX_LAYOUT_ORDER";
    case CUBLASLT_MATRIX_LAYOUT_ROWS: return "CUBLASLT_MATRIX_LAYOUT_ROWS";
    case CUBLASLT_MATRIX_LAYOUT_COLS: return "CUBLASLT_MATRIX_LAYOUT_COLS";
    case CUBLASLT_MATRIX_LAYOUT_LD: return "CUBLASLT_MATRIX_LAYOUT_LD";
    case CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT: return "CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT";
    case CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET: return "CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET";
  }
  return "an unknown matrix layout attribute";
}
const char* pref_attr_name(cublasLtMatmulPreferenceAttributes_t a) {
  switch (a) {
    case CUBLASLT_MATMUL_PREF_SEARCH_MODE: return "CUBLASLT_MATMUL_PREF_SEARCH_MODE";
    case CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES: return "CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES";
    case CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES: return "CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES";
    case CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES: return "CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES";
    case CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES: return "CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES";
    case CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES: return "CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES";
  }
  return "an unknown preference attribute";
}

size_t elem_size(cudaDataType_t t) { return t == CUDA_R_16BF || t == CUDA_R_16F ? 2 : t == CUDA_R_64F ? 8 : 4; }
bool pow2(uint64_t v) { return v && !(v & (v - 1)); }

// ---- the problem: what the descriptors say, checked ---------------------------------------------------
// one operand as the product reads it
struct operand {
  cudaDataType_t type;
  int64_t rows, cols, ld, batch, stride;
  char name;
};
operand operand_of(const fsdp_emu_lt_layout* l, char name) {
  return operand{l->type, (int64_t)l->rows, (int64_t)l->cols, l->ld, l->batch, l->batch > 1 ? l->stride : 0, name};
}

struct problem {
  cublasComputeType_t compute;
  cublasOperation_t ta, tb;
  int64_t m, n, k, batch;
  operand a, b, c, d;
};

// the documented requirements of one product; `what` names the call in the refusal
cublasStatus_t check_problem(const char* what, const fsdp_emu_lt_desc* desc, const fsdp_emu_lt_layout* la,
                             const fsdp_emu_lt_layout* lb, const fsdp_emu_lt_layout* lc, const fsdp_emu_lt_layout* ld,
                             problem* p) {
  if (!desc || !la || !lb || !lc || !ld)
    return refuse(CUBLAS_STATUS_INVALID_VALUE, what, "a NULL operation descriptor or matrix layout");
  p->compute = desc->compute;
  p->ta = desc->transa;
  p->tb = desc->transb;
  p->a = operand_of(la, 'A');
  p->b = operand_of(lb, 'B');
  p->c = operand_of(lc, 'C');
  p->d = operand_of(ld, 'D');
  // types: what the stand-in's one algorithm implements
  if (la->type != lb->type || (la->type != CUDA_R_32F && la->type != CUDA_R_16BF))
    return refuse(CUBLAS_STATUS_NOT_SUPPORTED, what, "A is %s and B %s: both CUDA_R_32F or both CUDA_R_16BF",
                  type_name(la->type), type_name(lb->type));
  if (lc->type != CUDA_R_32F || ld->type != CUDA_R_32F)
    return refuse(CUBLAS_STATUS_NOT_SUPPORTED, what, "C is %s and D %s: both must be CUDA_R_32F", type_name(lc->type),
                  type_name(ld->type));
  if (desc->compute == CUBLAS_COMPUTE_32F_FAST_TF32 && la->type != CUDA_R_32F)
    return refuse(CUBLAS_STATUS_NOT_SUPPORTED, what,
                  "CUBLAS_COMPUTE_32F_FAST_TF32 with %s operands (TF32 rounds float32 ones)", type_name(la->type));
  // shapes: op(A) m x k, op(B) k x n, C and D m x n
  p->m = p->c.rows;
  p->n = p->c.cols;
  int64_t ar = p->ta == CUBLAS_OP_N ? p->a.rows : p->a.cols, ac = p->ta == CUBLAS_OP_N ? p->a.cols : p->a.rows;
  int64_t br = p->tb == CUBLAS_OP_N ? p->b.rows : p->b.cols, bc = p->tb == CUBLAS_OP_N ? p->b.cols : p->b.rows;
  p->k = ac;
  if (ar != p->m || bc != p->n || br != ac)
    return refuse(
        CUBLAS_STATUS_INVALID_VALUE, what,
        "op(A) is %lld x %lld (TRANSA %s), op(B) %lld x %lld (TRANSB %s), C %lld x %lld: op(A) must be m x k, "
        "op(B) k x n, C m x n",
        (long long)ar, (long long)ac, p->ta == CUBLAS_OP_N ? "N" : "T", (long long)br, (long long)bc,
        p->tb == CUBLAS_OP_N ? "N" : "T", (long long)p->m, (long long)p->n);
  if (p->d.rows != p->c.rows || p->d.cols != p->c.cols || p->d.batch != p->c.batch)
    return refuse(CUBLAS_STATUS_INVALID_VALUE, what,
                  "D is %lld x %lld (batch %lld), C %lld x %lld (batch %lld): they must agree", (long long)p->d.rows,
                  (long long)p->d.cols, (long long)p->d.batch, (long long)p->c.rows, (long long)p->c.cols,
                  (long long)p->c.batch);
  p->batch = p->c.batch;
  if ((p->a.batch != 1 && p->a.batch != p->batch) || (p->b.batch != 1 && p->b.batch != p->batch))
    return refuse(CUBLAS_STATUS_INVALID_VALUE, what,
                  "batch counts A %lld, B %lld, C %lld: A's and B's must be 1 or C's", (long long)p->a.batch,
                  (long long)p->b.batch, (long long)p->batch);
  return CUBLAS_STATUS_SUCCESS;
}

// ---- the algorithm: the alignments it may assume, in its opaque data --------------------------------------
// data[0] the magic, [1] the compute type, [2] A's and B's type, [3..6] the alignments of A, B, C, D
void algo_make(cublasLtMatmulAlgo_t* algo, const problem& p, const uint32_t align[4]) {
  memset(algo, 0, sizeof *algo);
  algo->data[0] = ALGO_MAGIC;
  algo->data[1] = (uint64_t)p.compute;
  algo->data[2] = (uint64_t)p.a.type;
  for (int i = 0; i < 4; i++) algo->data[3 + i] = align[i];
}

// whether the preference's alignments suit an algorithm for these operands (each at least its element)
cublasStatus_t check_alignments(const char* what, const problem& p, const uint32_t align[4]) {
  const operand* ops[4] = {&p.a, &p.b, &p.c, &p.d};
  for (int i = 0; i < 4; i++)
    if (!pow2(align[i]) || align[i] < elem_size(ops[i]->type))
      return refuse(CUBLAS_STATUS_NOT_SUPPORTED, what,
                    "MIN_ALIGNMENT_%c_BYTES %u: no algorithm reads %s elements at that alignment (a power of two of at "
                    "least %zu bytes)",
                    ops[i]->name, align[i], type_name(ops[i]->type), elem_size(ops[i]->type));
  return CUBLAS_STATUS_SUCCESS;
}

// ---- memory the product touches ------------------------------------------------------------------------------
// [lo, hi) in elements from the pointer, over every batch (an empty matrix: nothing)
bool span_of(const operand& o, int64_t* lo, int64_t* hi) {
  if (o.rows == 0 || o.cols == 0) return false;
  int64_t extent = (o.cols - 1) * o.ld + o.rows, last = o.stride * (o.batch - 1);
  *lo = last < 0 ? last : 0;
  *hi = (last > 0 ? last : 0) + extent;
  return true;
}
bool covers(const void* ptr, const operand& o) {
  int64_t lo, hi;
  if (!span_of(o, &lo, &hi)) return true;
  size_t es = elem_size(o.type);
  return fsdp_emu::is_device((const char*)ptr + lo * (int64_t)es, (size_t)(hi - lo) * es);
}

// ---- the computation ------------------------------------------------------------------------------------------
float tf32_round(float f) {
  uint32_t u;
  memcpy(&u, &f, 4);
  if ((u & 0x7f800000u) == 0x7f800000u) return f;  // Inf and NaN stay
  u += 0xfffu + ((u >> 13) & 1u);                  // to nearest, ties to even, on the 13 dropped bits
  u &= 0xffffe000u;
  memcpy(&f, &u, 4);
  return f;
}
float load(const void* base, cudaDataType_t t, int64_t i) {
  if (t == CUDA_R_32F) return ((const float*)base)[i];
  uint32_t u = (uint32_t)((const uint16_t*)base)[i] << 16;  // bfloat16: the high half of a float32
  float f;
  memcpy(&f, &u, 4);
  return f;
}

// op(X) of batch b as a dense row-major (rows x depth) copy: row r holds op(X)(r, 0..depth-1)
// (`by_rows`), or as columns: row r holds op(X)(0..depth-1, r)
void pack(const void* base, const operand& o, cublasOperation_t op, int64_t b, bool by_rows, bool tf32,
          std::vector<float>& out) {
  int64_t orows = op == CUBLAS_OP_N ? o.rows : o.cols, ocols = op == CUBLAS_OP_N ? o.cols : o.rows;
  int64_t lines = by_rows ? orows : ocols, depth = by_rows ? ocols : orows;
  out.resize((size_t)(lines * depth));
  int64_t off = o.batch > 1 ? b * o.stride : 0;
  for (int64_t r = 0; r < lines; r++)
    for (int64_t l = 0; l < depth; l++) {
      int64_t i = by_rows ? r : l, j = by_rows ? l : r;  // the element op(X)(i, j)
      int64_t at = op == CUBLAS_OP_N ? i + j * o.ld : j + i * o.ld;
      float v = load(base, o.type, off + at);
      out[(size_t)(r * depth + l)] = tf32 ? tf32_round(v) : v;
    }
}

struct job {
  problem p;
  const void *A, *B, *C;
  float* D;
  float alpha, beta;
};

bool still_device(const job& j) {
  const void* ptrs[4] = {j.A, j.B, j.C, j.D};
  const operand* ops[4] = {&j.p.a, &j.p.b, &j.p.c, &j.p.d};
  for (int i = 0; i < 4; i++) {
    if (i == 2 && j.beta == 0.0f) continue;  // C is not read
    if (!covers(ptrs[i], *ops[i])) {
      fsdp_emu::fail_sticky(
          cudaErrorIllegalAddress,
          "cuBLASLt: cublasLtMatmul (%lld x %lld x %lld) faulted on its stream: %c at %p is no longer "
          "device memory when the product runs (freed before it, in stream order)",
          (long long)j.p.m, (long long)j.p.n, (long long)j.p.k, ops[i]->name, ptrs[i]);
      return false;
    }
  }
  return true;
}

void run(const job& j) {
  if (!still_device(j)) return;
  const problem& p = j.p;
  bool tf32 = p.compute == CUBLAS_COMPUTE_32F_FAST_TF32;
  std::vector<float> ap, bp;
  for (int64_t b = 0; b < p.batch; b++) {
    pack(j.A, p.a, p.ta, b, true, tf32, ap);   // ap[i k + l] = op(A)(i, l)
    pack(j.B, p.b, p.tb, b, false, tf32, bp);  // bp[jj k + l] = op(B)(l, jj)
    const float* c = j.C ? (const float*)j.C + b * p.c.stride : NULL;
    float* d = j.D + b * p.d.stride;
    for (int64_t jj = 0; jj < p.n; jj++)
      for (int64_t i = 0; i < p.m; i++) {
        const float *x = &ap[(size_t)(i * p.k)], *y = &bp[(size_t)(jj * p.k)];
        float acc = 0.0f;
        for (int64_t l = 0; l < p.k; l++) acc += x[l] * y[l];
        float r = j.alpha * acc;
        if (j.beta != 0.0f) r += j.beta * c[i + jj * p.c.ld];
        d[i + jj * p.d.ld] = r;
      }
  }
}

}  // namespace

// ---- the handle -------------------------------------------------------------------------------------------------
size_t cublasLtGetVersion(void) { return 130100; }
cublasStatus_t cublasLtCreate(cublasLtHandle_t* handle) {
  if (!handle) return refuse(CUBLAS_STATUS_INVALID_VALUE, "cublasLtCreate", "handle is NULL");
  *handle = new fsdp_emu_lt();
  return CUBLAS_STATUS_SUCCESS;
}
cublasStatus_t cublasLtDestroy(cublasLtHandle_t handle) {
  if (!handle) return refuse(CUBLAS_STATUS_NOT_INITIALIZED, "cublasLtDestroy", "handle is NULL");
  delete handle;
  return CUBLAS_STATUS_SUCCESS;
}

// ---- the operation descriptor -------------------------------------------------------------------------------------
cublasStatus_t cublasLtMatmulDescCreate(cublasLtMatmulDesc_t* desc, cublasComputeType_t compute, cudaDataType_t scale) {
  const char* what = "cublasLtMatmulDescCreate";
  if (!desc) return refuse(CUBLAS_STATUS_INVALID_VALUE, what, "desc is NULL");
  if (compute != CUBLAS_COMPUTE_32F && compute != CUBLAS_COMPUTE_32F_FAST_TF32)
    return refuse(CUBLAS_STATUS_NOT_SUPPORTED, what,
                  "compute type %s (the stand-in has CUBLAS_COMPUTE_32F and "
                  "CUBLAS_COMPUTE_32F_FAST_TF32)",
                  compute_name(compute));
  if (scale != CUDA_R_32F)
    return refuse(CUBLAS_STATUS_NOT_SUPPORTED, what, "scale type %s with %s (CUDA_R_32F only)", type_name(scale),
                  compute_name(compute));
  *desc = new fsdp_emu_lt_desc{compute, scale, CUBLAS_OP_N, CUBLAS_OP_N};
  return CUBLAS_STATUS_SUCCESS;
}
cublasStatus_t cublasLtMatmulDescDestroy(cublasLtMatmulDesc_t desc) {
  delete desc;
  return CUBLAS_STATUS_SUCCESS;
}
cublasStatus_t cublasLtMatmulDescSetAttribute(cublasLtMatmulDesc_t desc, cublasLtMatmulDescAttributes_t attr,
                                              const void* buf, size_t size) {
  const char* what = "cublasLtMatmulDescSetAttribute";
  if (!desc || !buf) return refuse(CUBLAS_STATUS_INVALID_VALUE, what, "a NULL descriptor or buffer");
  if (attr != CUBLASLT_MATMUL_DESC_TRANSA && attr != CUBLASLT_MATMUL_DESC_TRANSB)
    return refuse(CUBLAS_STATUS_NOT_SUPPORTED, what,
                  "%s (attribute %d): the stand-in implements TRANSA and TRANSB only", desc_attr_name(attr), (int)attr);
  if (size != sizeof(int32_t))
    return refuse(CUBLAS_STATUS_INVALID_VALUE, what, "%s takes an int32_t (cublasOperation_t), not %zu bytes",
                  desc_attr_name(attr), size);
  int32_t op;
  memcpy(&op, buf, sizeof op);
  if (op == CUBLAS_OP_C)
    return refuse(CUBLAS_STATUS_NOT_SUPPORTED, what, "%s = CUBLAS_OP_C (conjugate transpose is not implemented)",
                  desc_attr_name(attr));
  if (op != CUBLAS_OP_N && op != CUBLAS_OP_T)
    return refuse(CUBLAS_STATUS_INVALID_VALUE, what, "%s = %d is not a cublasOperation_t", desc_attr_name(attr),
                  (int)op);
  (attr == CUBLASLT_MATMUL_DESC_TRANSA ? desc->transa : desc->transb) = (cublasOperation_t)op;
  return CUBLAS_STATUS_SUCCESS;
}

// ---- matrix layouts ----------------------------------------------------------------------------------------------
cublasStatus_t cublasLtMatrixLayoutCreate(cublasLtMatrixLayout_t* layout, cudaDataType_t type, uint64_t rows,
                                          uint64_t cols, int64_t ld) {
  const char* what = "cublasLtMatrixLayoutCreate";
  if (!layout) return refuse(CUBLAS_STATUS_INVALID_VALUE, what, "layout is NULL");
  if (rows > MAX_DIM || cols > MAX_DIM || ld > (int64_t)MAX_DIM)
    return refuse(CUBLAS_STATUS_INVALID_VALUE, what, "%llu x %llu, ld %lld: over the 2^40 a dimension may have here",
                  (unsigned long long)rows, (unsigned long long)cols, (long long)ld);
  if (ld < 1 || (uint64_t)ld < rows)
    return refuse(CUBLAS_STATUS_INVALID_VALUE, what, "ld %lld for %llu rows: column-major needs ld >= rows (and >= 1)",
                  (long long)ld, (unsigned long long)rows);
  *layout = new fsdp_emu_lt_layout{type, rows, cols, ld, 1, 0};
  return CUBLAS_STATUS_SUCCESS;
}
cublasStatus_t cublasLtMatrixLayoutDestroy(cublasLtMatrixLayout_t layout) {
  delete layout;
  return CUBLAS_STATUS_SUCCESS;
}
cublasStatus_t cublasLtMatrixLayoutSetAttribute(cublasLtMatrixLayout_t layout, cublasLtMatrixLayoutAttribute_t attr,
                                                const void* buf, size_t size) {
  const char* what = "cublasLtMatrixLayoutSetAttribute";
  if (!layout || !buf) return refuse(CUBLAS_STATUS_INVALID_VALUE, what, "a NULL layout or buffer");
  if (attr == CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT) {
    int32_t n;
    if (size != sizeof n)
      return refuse(CUBLAS_STATUS_INVALID_VALUE, what, "%s takes an int32_t, not %zu bytes", layout_attr_name(attr),
                    size);
    memcpy(&n, buf, sizeof n);
    if (n < 1) return refuse(CUBLAS_STATUS_INVALID_VALUE, what, "%s = %d (at least 1)", layout_attr_name(attr), (int)n);
    layout->batch = n;
    return CUBLAS_STATUS_SUCCESS;
  }
  if (attr == CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET) {
    if (size != sizeof(int64_t))
      return refuse(CUBLAS_STATUS_INVALID_VALUE, what, "%s takes an int64_t, not %zu bytes", layout_attr_name(attr),
                    size);
    memcpy(&layout->stride, buf, sizeof(int64_t));
    return CUBLAS_STATUS_SUCCESS;
  }
  return refuse(CUBLAS_STATUS_NOT_SUPPORTED, what,
                "%s (attribute %d): the stand-in implements column-major layouts with BATCH_COUNT and "
                "STRIDED_BATCH_OFFSET only",
                layout_attr_name(attr), (int)attr);
}

// ---- preferences --------------------------------------------------------------------------------------------------
cublasStatus_t cublasLtMatmulPreferenceCreate(cublasLtMatmulPreference_t* pref) {
  if (!pref) return refuse(CUBLAS_STATUS_INVALID_VALUE, "cublasLtMatmulPreferenceCreate", "pref is NULL");
  *pref = new fsdp_emu_lt_pref{0, {DEFAULT_ALIGN, DEFAULT_ALIGN, DEFAULT_ALIGN, DEFAULT_ALIGN}};
  return CUBLAS_STATUS_SUCCESS;
}
cublasStatus_t cublasLtMatmulPreferenceDestroy(cublasLtMatmulPreference_t pref) {
  delete pref;
  return CUBLAS_STATUS_SUCCESS;
}
cublasStatus_t cublasLtMatmulPreferenceSetAttribute(cublasLtMatmulPreference_t pref,
                                                    cublasLtMatmulPreferenceAttributes_t attr, const void* buf,
                                                    size_t size) {
  const char* what = "cublasLtMatmulPreferenceSetAttribute";
  if (!pref || !buf) return refuse(CUBLAS_STATUS_INVALID_VALUE, what, "a NULL preference or buffer");
  if (attr == CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES) {
    if (size != sizeof(uint64_t))
      return refuse(CUBLAS_STATUS_INVALID_VALUE, what, "%s takes a uint64_t, not %zu bytes", pref_attr_name(attr),
                    size);
    memcpy(&pref->max_workspace, buf, sizeof(uint64_t));
    return CUBLAS_STATUS_SUCCESS;
  }
  if (attr >= CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES && attr <= CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES) {
    uint32_t v;
    if (size != sizeof v)
      return refuse(CUBLAS_STATUS_INVALID_VALUE, what, "%s takes a uint32_t, not %zu bytes", pref_attr_name(attr),
                    size);
    memcpy(&v, buf, sizeof v);
    if (!pow2(v))
      return refuse(CUBLAS_STATUS_INVALID_VALUE, what, "%s = %u is not a power of two", pref_attr_name(attr), v);
    pref->align[attr - CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES] = v;
    return CUBLAS_STATUS_SUCCESS;
  }
  return refuse(CUBLAS_STATUS_NOT_SUPPORTED, what,
                "%s (attribute %d): the stand-in implements MAX_WORKSPACE_BYTES and MIN_ALIGNMENT_{A,B,C,D}_BYTES only",
                pref_attr_name(attr), (int)attr);
}

// ---- the heuristic: one algorithm, for every problem the stand-in implements ----------------------------------------
cublasStatus_t cublasLtMatmulAlgoGetHeuristic(cublasLtHandle_t handle, cublasLtMatmulDesc_t desc,
                                              cublasLtMatrixLayout_t a, cublasLtMatrixLayout_t b,
                                              cublasLtMatrixLayout_t c, cublasLtMatrixLayout_t d,
                                              cublasLtMatmulPreference_t pref, int requested,
                                              cublasLtMatmulHeuristicResult_t* results, int* returned) {
  const char* what = "cublasLtMatmulAlgoGetHeuristic";
  if (returned) *returned = 0;
  if (!handle) return refuse(CUBLAS_STATUS_NOT_INITIALIZED, what, "the handle is NULL (cublasLtCreate first)");
  if (!pref || !results || !returned || requested < 1)
    return refuse(CUBLAS_STATUS_INVALID_VALUE, what, "a NULL preference, results or count, or %d results requested",
                  requested);
  problem p;
  cublasStatus_t s = check_problem(what, desc, a, b, c, d, &p);
  if (s == CUBLAS_STATUS_SUCCESS) s = check_alignments(what, p, pref->align);
  if (s != CUBLAS_STATUS_SUCCESS) return s;
  memset(&results[0], 0, sizeof results[0]);
  algo_make(&results[0].algo, p, pref->align);
  results[0].workspaceSize = 0;
  results[0].state = CUBLAS_STATUS_SUCCESS;
  results[0].wavesCount = 1.0f;
  *returned = 1;
  return CUBLAS_STATUS_SUCCESS;
}

// ---- the product ----------------------------------------------------------------------------------------------------
namespace {

// the algorithm's alignments: from the heuristic's result, or (no algorithm given: cuBLASLt runs its
// heuristic itself) those of the pointers at hand
cublasStatus_t algo_alignments(const char* what, const cublasLtMatmulAlgo_t* algo, const problem& p,
                               const void* const ptrs[4], uint32_t align[4]) {
  if (!algo) {
    for (int i = 0; i < 4; i++) {
      uintptr_t x = (uintptr_t)ptrs[i] | DEFAULT_ALIGN;
      align[i] = (uint32_t)(x & (~x + 1));
    }
    return check_alignments(what, p, align);
  }
  if (algo->data[0] != ALGO_MAGIC)
    return refuse(CUBLAS_STATUS_INVALID_VALUE, what,
                  "the algorithm is not one cublasLtMatmulAlgoGetHeuristic returned");
  if (algo->data[1] != (uint64_t)p.compute || algo->data[2] != (uint64_t)p.a.type)
    return refuse(CUBLAS_STATUS_NOT_SUPPORTED, what,
                  "the algorithm was chosen for %s with %s operands, the call is %s with %s",
                  compute_name((cublasComputeType_t)algo->data[1]), type_name((cudaDataType_t)algo->data[2]),
                  compute_name(p.compute), type_name(p.a.type));
  for (int i = 0; i < 4; i++) align[i] = (uint32_t)algo->data[3 + i];
  return CUBLAS_STATUS_SUCCESS;
}

// every pointer device memory covering its matrices, aligned as the algorithm assumes
cublasStatus_t check_pointers(const char* what, const problem& p, const void* const ptrs[4], float beta,
                              const uint32_t align[4]) {
  const operand* ops[4] = {&p.a, &p.b, &p.c, &p.d};
  for (int i = 0; i < 4; i++) {
    if (i == 2 && beta == 0.0f) continue;  // C is not read: any pointer will do
    int64_t lo = 0, hi = 0;
    span_of(*ops[i], &lo, &hi);
    if (!ptrs[i] || !covers(ptrs[i], *ops[i]))
      return refuse(
          CUBLAS_STATUS_INVALID_VALUE, what,
          "%c = %p (%lld x %lld %s, ld %lld, batch %lld, stride %lld: %lld bytes) is not device memory covering "
          "the matrix (cudaMalloc / cudaMallocAsync)",
          ops[i]->name, ptrs[i], (long long)ops[i]->rows, (long long)ops[i]->cols, type_name(ops[i]->type),
          (long long)ops[i]->ld, (long long)ops[i]->batch, (long long)ops[i]->stride,
          (long long)((hi - lo) * (int64_t)elem_size(ops[i]->type)));
    if ((uintptr_t)ptrs[i] % align[i])
      return refuse(
          CUBLAS_STATUS_NOT_SUPPORTED, what,
          "%c = %p is not %u-byte aligned, as the algorithm assumes (MIN_ALIGNMENT_%c_BYTES at heuristic time): "
          "a kernel chosen for that alignment cannot read it",
          ops[i]->name, ptrs[i], align[i], ops[i]->name);
  }
  if (ptrs[2] == ptrs[3] && (p.c.ld != p.d.ld || p.c.stride != p.d.stride))
    return refuse(CUBLAS_STATUS_INVALID_VALUE, what,
                  "C == D (in place) with different layouts: ld %lld and %lld, batch stride %lld and %lld",
                  (long long)p.c.ld, (long long)p.d.ld, (long long)p.c.stride, (long long)p.d.stride);
  return CUBLAS_STATUS_SUCCESS;
}

}  // namespace

cublasStatus_t cublasLtMatmul(cublasLtHandle_t handle, cublasLtMatmulDesc_t desc, const void* alpha, const void* A,
                              cublasLtMatrixLayout_t a, const void* B, cublasLtMatrixLayout_t b, const void* beta,
                              const void* C, cublasLtMatrixLayout_t c, void* D, cublasLtMatrixLayout_t d,
                              const cublasLtMatmulAlgo_t* algo, void* workspace, size_t workspace_bytes,
                              cudaStream_t stream) {
  const char* what = "cublasLtMatmul";
  if (!handle) return refuse(CUBLAS_STATUS_NOT_INITIALIZED, what, "the handle is NULL (cublasLtCreate first)");
  if (!alpha || !beta) return refuse(CUBLAS_STATUS_INVALID_VALUE, what, "alpha or beta is NULL");
  if (fsdp_emu::is_device(alpha, 0) || fsdp_emu::is_device(beta, 0))
    return refuse(CUBLAS_STATUS_INVALID_VALUE, what,
                  "alpha or beta is device memory: with CUBLASLT_POINTER_MODE_HOST (the default) they are host floats");
  problem p;
  cublasStatus_t s = check_problem(what, desc, a, b, c ? c : d, d, &p);  // (no Cdesc: D's, as documented)
  if (s != CUBLAS_STATUS_SUCCESS) return s;
  float al, be;
  memcpy(&al, alpha, sizeof al);  // (host pointer mode: read at the call)
  memcpy(&be, beta, sizeof be);
  const void* ptrs[4] = {A, B, C, D};
  uint32_t align[4];
  s = algo_alignments(what, algo, p, ptrs, align);
  if (s == CUBLAS_STATUS_SUCCESS) s = check_pointers(what, p, ptrs, be, align);
  if (s != CUBLAS_STATUS_SUCCESS) return s;
  if (workspace_bytes && (!workspace || !fsdp_emu::is_device(workspace, workspace_bytes)))
    return refuse(CUBLAS_STATUS_INVALID_VALUE, what, "workspace %p (%zu bytes) is not device memory", workspace,
                  workspace_bytes);
  if (p.m == 0 || p.n == 0) return CUBLAS_STATUS_SUCCESS;
  job j{p, A, B, be != 0.0f ? C : NULL, (float*)D, al, be};
  fsdp_emu::enqueue(stream, "cublasLtMatmul", [j] {
    if (!fsdp_emu::failed()) run(j);  // (after a failed kernel the context runs nothing more)
  });
  return CUBLAS_STATUS_SUCCESS;
}
