/*
 * tests/cudaemu/dnn.cc -- cuDNN for the CUDA executor: the 2-D convolutions of the CUDA backend
 * (backend/cuda/linalg.cu: forward, data and filter gradients, bias gradient, bias add), run on
 * the CPU with the semantics NVIDIA documents, so that a call cuDNN would refuse fails here too:
 *
 *   tensors       4-D, CUDNN_TENSOR_NCHW, CUDNN_DATA_FLOAT, packed, every dimension > 0; filters
 *                 (K, C / groups, kh, kw) the same
 *   convolution   padding >= 0, stride >= 1, dilation >= 1, compute type CUDNN_DATA_FLOAT, groups
 *                 >= 1 (cudnnSetConvolutionGroupCount) dividing C and K; CUDNN_CROSS_CORRELATION
 *                 y[n,k,oh,ow] = sum over c of k's group, i, j of
 *                   x[n, c, oh sh - ph + i dh, ow sw - pw + j dw] w[k, c - group start, i, j]
 *                 (inputs outside x count 0), CUDNN_CONVOLUTION the same with the filter flipped
 *                 (w[k, c, kh-1-i, kw-1-j]); OH = (H + 2 ph - dh (kh - 1) - 1) / sh + 1, OW alike,
 *                 and the output descriptor must say so (else CUDNN_STATUS_BAD_PARAM naming the
 *                 dimensions); the data and filter gradients are this map's adjoints in x and w
 *   math          CUDNN_DEFAULT_MATH and CUDNN_FMA_MATH, both float32 (TF32 and tensor-op math are
 *                 refused); every output element is one float32 sum in a fixed order, so results
 *                 repeat bit for bit
 *   blending      out = alpha result + beta out, alpha and beta host floats read at the call;
 *                 when beta is 0 the output is not read (it may hold NaN garbage)
 *   algorithms    cudnnGet*Algorithm_v7 rank two (the first deterministic, FMA math, no workspace);
 *                 the calls accept those two
 *   bias          cudnnConvolutionBackwardBias: db (1, K, 1, 1) = sum over n, oh, ow of dy;
 *                 cudnnAddTensor: c = alpha a + beta c, each of a's dimensions c's or 1 (broadcast)
 *   pointers      every tensor must be device memory covering it (cudaMalloc / cudaMallocAsync), a
 *                 host pointer is CUDNN_STATUS_BAD_PARAM; the work is queued on the handle's
 *                 stream (cudnnSetStream; 0 when not set); memory freed before queued work runs is
 *                 a sticky illegal address (fsdp_emu::fail_sticky), as a fault
 *
 * It refuses by name any layout, data type, mode or math it does not implement, with
 * CUDNN_STATUS_NOT_SUPPORTED, rather than ignoring it; each refusal prints one line
 * "cudaemu: cuDNN: <call>: <why>".
 */
#include <cudnn.h>

#include "runtime.h"

#include <stdarg.h>
#include <stdio.h>
#include <string.h>

struct fsdp_emu_dnn {
  cudaStream_t stream;
};
struct fsdp_emu_dnn_tensor {
  bool set;
  int n, c, h, w;
};
struct fsdp_emu_dnn_filter {
  bool set;
  int k, c, h, w;
};
struct fsdp_emu_dnn_conv {
  bool set;
  int ph, pw, sh, sw, dh, dw;
  cudnnConvolutionMode_t mode;
  int groups;
  cudnnMathType_t math;
};

namespace {

// ---- messages ---------------------------------------------------------------------------------------
cudnnStatus_t refuse(cudnnStatus_t s, const char* call, const char* fmt, ...) __attribute__((format(printf, 3, 4)));
cudnnStatus_t refuse(cudnnStatus_t s, const char* call, const char* fmt, ...) {
  char why[512];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(why, sizeof why, fmt, ap);
  va_end(ap);
  fprintf(stderr, "cudaemu: cuDNN: %s: %s\n", call, why);
  return s;
}

const char* format_name(cudnnTensorFormat_t f) {
  switch (f) {
    case CUDNN_TENSOR_NCHW: return "CUDNN_TENSOR_NCHW";
    case CUDNN_TENSOR_NHWC: return "CUDNN_TENSOR_NHWC";
  }
  return "an unknown cudnnTensorFormat_t";
}
const char* type_name(cudnnDataType_t t) {
  switch (t) {
    case CUDNN_DATA_FLOAT: return "CUDNN_DATA_FLOAT";
    case CUDNN_DATA_DOUBLE: return "CUDNN_DATA_DOUBLE";
    case CUDNN_DATA_HALF: return "CUDNN_DATA_HALF";
    case CUDNN_DATA_BFLOAT16: return "CUDNN_DATA_BFLOAT16";
  }
  return "an unknown cudnnDataType_t";
}
const char* math_name(cudnnMathType_t m) {
  switch (m) {
    case CUDNN_DEFAULT_MATH: return "CUDNN_DEFAULT_MATH";
    case CUDNN_TENSOR_OP_MATH: return "CUDNN_TENSOR_OP_MATH";
    case CUDNN_TENSOR_OP_MATH_ALLOW_CONVERSION: return "CUDNN_TENSOR_OP_MATH_ALLOW_CONVERSION";
    case CUDNN_FMA_MATH: return "CUDNN_FMA_MATH";
  }
  return "an unknown cudnnMathType_t";
}

// the layout and type every tensor and filter here has
cudnnStatus_t check_format(const char* call, cudnnTensorFormat_t format, cudnnDataType_t type) {
  if (format != CUDNN_TENSOR_NCHW && format != CUDNN_TENSOR_NHWC)
    return refuse(CUDNN_STATUS_BAD_PARAM, call, "format %d is not a cudnnTensorFormat_t", (int)format);
  if (format != CUDNN_TENSOR_NCHW)
    return refuse(CUDNN_STATUS_NOT_SUPPORTED, call, "%s: the stand-in implements CUDNN_TENSOR_NCHW only",
                  format_name(format));
  if (type != CUDNN_DATA_FLOAT)
    return refuse(CUDNN_STATUS_NOT_SUPPORTED, call, "%s: the stand-in implements CUDNN_DATA_FLOAT only",
                  type_name(type));
  return CUDNN_STATUS_SUCCESS;
}

// ---- one convolution's geometry, checked as cuDNN checks it ---------------------------------------------
struct geom {
  int64_t N, C, H, W, K, Cg, Kg, kh, kw, OH, OW;
  int64_t ph, pw, sh, sw, dh, dw, groups;
  bool flip;  // CUDNN_CONVOLUTION
};

cudnnStatus_t check_geom(const char* call, const fsdp_emu_dnn_tensor* x, const fsdp_emu_dnn_filter* w,
                         const fsdp_emu_dnn_conv* conv, const fsdp_emu_dnn_tensor* y, geom* g) {
  if (!x || !w || !conv || !y || !x->set || !w->set || !conv->set || !y->set)
    return refuse(CUDNN_STATUS_BAD_PARAM, call, "a NULL descriptor, or one not set (cudnnSet*Descriptor first)");
  int64_t groups = conv->groups;
  if (x->c % groups || w->k % groups)
    return refuse(CUDNN_STATUS_BAD_PARAM, call, "%lld groups do not divide the input channels C %d and filters K %d",
                  (long long)groups, x->c, w->k);
  if (w->c * groups != x->c)
    return refuse(
        CUDNN_STATUS_BAD_PARAM, call,
        "the filter has %d input channels, the input (N %d, C %d, H %d, W %d) with %lld groups needs C / groups "
        "= %lld",
        w->c, x->n, x->c, x->h, x->w, (long long)groups, (long long)(x->c / groups));
  int64_t eh = (int64_t)conv->dh * (w->h - 1) + 1, ew = (int64_t)conv->dw * (w->w - 1) + 1;  // dilated filter
  int64_t oh = (x->h + 2 * (int64_t)conv->ph - eh) / conv->sh + 1,
          ow = (x->w + 2 * (int64_t)conv->pw - ew) / conv->sw + 1;
  if (x->h + 2 * (int64_t)conv->ph < eh || x->w + 2 * (int64_t)conv->pw < ew)
    return refuse(CUDNN_STATUS_BAD_PARAM, call,
                  "the dilated %dx%d filter (%lldx%lld) is larger than the padded %dx%d input (pad %d, %d)", w->h, w->w,
                  (long long)eh, (long long)ew, x->h, x->w, conv->ph, conv->pw);
  if (y->n != x->n || y->c != w->k || y->h != oh || y->w != ow)
    return refuse(
        CUDNN_STATUS_BAD_PARAM, call,
        "the output is (N %d, K %d, OH %d, OW %d); input (N %d, C %d, H %d, W %d), filter (K %d, C %d, %dx%d), "
        "pad %d,%d stride %d,%d dilation %d,%d give (N %d, K %d, OH %lld, OW %lld)",
        y->n, y->c, y->h, y->w, x->n, x->c, x->h, x->w, w->k, w->c, w->h, w->w, conv->ph, conv->pw, conv->sh, conv->sw,
        conv->dh, conv->dw, x->n, w->k, (long long)oh, (long long)ow);
  *g = geom{x->n,
            x->c,
            x->h,
            x->w,
            w->k,
            w->c,
            w->k / groups,
            w->h,
            w->w,
            oh,
            ow,
            conv->ph,
            conv->pw,
            conv->sh,
            conv->sw,
            conv->dh,
            conv->dw,
            groups,
            conv->mode == CUDNN_CONVOLUTION};
  return CUDNN_STATUS_SUCCESS;
}

// ---- pointers ----------------------------------------------------------------------------------------------
int64_t numel(const fsdp_emu_dnn_tensor* t) { return (int64_t)t->n * t->c * t->h * t->w; }
int64_t numel(const fsdp_emu_dnn_filter* f) { return (int64_t)f->k * f->c * f->h * f->w; }

struct buffer {
  const char* name;
  const void* p;
  int64_t n;  // floats
};
cudnnStatus_t check_buffers(const char* call, const buffer* b, int nb) {
  for (int i = 0; i < nb; i++)
    if (!b[i].p || !fsdp_emu::is_device(b[i].p, (size_t)b[i].n * sizeof(float)))
      return refuse(CUDNN_STATUS_BAD_PARAM, call,
                    "%s = %p (%lld floats) is not device memory covering the tensor (cudaMalloc / cudaMallocAsync)",
                    b[i].name, b[i].p, (long long)b[i].n);
  return CUDNN_STATUS_SUCCESS;
}
// at run time: memory freed since the call (in stream order) is a fault
bool still_device(const char* call, const buffer* b, int nb) {
  for (int i = 0; i < nb; i++)
    if (!fsdp_emu::is_device(b[i].p, (size_t)b[i].n * sizeof(float))) {
      fsdp_emu::fail_sticky(cudaErrorIllegalAddress,
                            "cuDNN: %s: faulted on its stream: %s at %p is no longer device memory when the work "
                            "runs (freed before it, in stream order)",
                            call, b[i].name, b[i].p);
      return false;
    }
  return true;
}

cudnnStatus_t read_scalars(const char* call, const void* alpha, const void* beta, float* a, float* b) {
  if (!alpha || !beta) return refuse(CUDNN_STATUS_BAD_PARAM, call, "alpha or beta is NULL");
  if (fsdp_emu::is_device(alpha, 0) || fsdp_emu::is_device(beta, 0))
    return refuse(CUDNN_STATUS_BAD_PARAM, call, "alpha or beta is device memory: they are host floats");
  memcpy(a, alpha, sizeof *a);
  memcpy(b, beta, sizeof *b);
  return CUDNN_STATUS_SUCCESS;
}

cudnnStatus_t check_workspace(const char* call, const void* ws, size_t bytes) {
  if (bytes && (!ws || !fsdp_emu::is_device(ws, bytes)))
    return refuse(CUDNN_STATUS_BAD_PARAM, call, "workspace %p (%zu bytes) is not device memory", ws, bytes);
  return CUDNN_STATUS_SUCCESS;
}

// the documented blend, without reading the output when beta is 0
inline void blend(float* out, float r, float alpha, float beta) {
  *out = beta != 0.0f ? alpha * r + beta * *out : alpha * r;
}

// ---- the computations: each output element one float sum, in a fixed order ------------------------------------
// the filter tap (i, j) reads w at (wi, wj): flipped for CUDNN_CONVOLUTION
inline int64_t tap(const geom& g, int64_t i, int64_t n) { return g.flip ? n - 1 - i : i; }

void forward(const geom& g, float alpha, const float* x, const float* w, float beta, float* y) {
  for (int64_t n = 0; n < g.N; n++)
    for (int64_t k = 0; k < g.K; k++) {
      int64_t c0 = k / g.Kg * g.Cg;  // k's group's first input channel
      for (int64_t oh = 0; oh < g.OH; oh++)
        for (int64_t ow = 0; ow < g.OW; ow++) {
          float s = 0.0f;
          for (int64_t c = 0; c < g.Cg; c++)
            for (int64_t i = 0; i < g.kh; i++) {
              int64_t ih = oh * g.sh - g.ph + i * g.dh;
              if (ih < 0 || ih >= g.H) continue;
              for (int64_t j = 0; j < g.kw; j++) {
                int64_t iw = ow * g.sw - g.pw + j * g.dw;
                if (iw < 0 || iw >= g.W) continue;
                float xv = x[((n * g.C + c0 + c) * g.H + ih) * g.W + iw];
                s += xv * w[((k * g.Cg + c) * g.kh + tap(g, i, g.kh)) * g.kw + tap(g, j, g.kw)];
              }
            }
          blend(&y[((n * g.K + k) * g.OH + oh) * g.OW + ow], s, alpha, beta);
        }
    }
}

// dx[n, c, ih, iw] = sum over the outputs (k of c's group, oh, ow) whose tap (i, j) reads it
void backward_data(const geom& g, float alpha, const float* w, const float* dy, float beta, float* dx) {
  for (int64_t n = 0; n < g.N; n++)
    for (int64_t c = 0; c < g.C; c++) {
      int64_t grp = c / g.Cg, cl = c % g.Cg;
      for (int64_t ih = 0; ih < g.H; ih++)
        for (int64_t iw = 0; iw < g.W; iw++) {
          float s = 0.0f;
          for (int64_t k = grp * g.Kg; k < (grp + 1) * g.Kg; k++)
            for (int64_t i = 0; i < g.kh; i++) {
              int64_t th = ih + g.ph - i * g.dh;  // = oh sh
              if (th < 0 || th % g.sh || th / g.sh >= g.OH) continue;
              for (int64_t j = 0; j < g.kw; j++) {
                int64_t tw = iw + g.pw - j * g.dw;
                if (tw < 0 || tw % g.sw || tw / g.sw >= g.OW) continue;
                float dv = dy[((n * g.K + k) * g.OH + th / g.sh) * g.OW + tw / g.sw];
                s += dv * w[((k * g.Cg + cl) * g.kh + tap(g, i, g.kh)) * g.kw + tap(g, j, g.kw)];
              }
            }
          blend(&dx[((n * g.C + c) * g.H + ih) * g.W + iw], s, alpha, beta);
        }
    }
}

// dw[k, cl, fi, fj] = sum over n, oh, ow of dy[n, k, oh, ow] times the input its tap reads
void backward_filter(const geom& g, float alpha, const float* x, const float* dy, float beta, float* dw) {
  for (int64_t k = 0; k < g.K; k++) {
    int64_t c0 = k / g.Kg * g.Cg;
    for (int64_t cl = 0; cl < g.Cg; cl++)
      for (int64_t fi = 0; fi < g.kh; fi++)
        for (int64_t fj = 0; fj < g.kw; fj++) {
          int64_t i = tap(g, fi, g.kh), j = tap(g, fj, g.kw);  // the tap that reads w[k, cl, fi, fj]
          float s = 0.0f;
          for (int64_t n = 0; n < g.N; n++)
            for (int64_t oh = 0; oh < g.OH; oh++) {
              int64_t ih = oh * g.sh - g.ph + i * g.dh;
              if (ih < 0 || ih >= g.H) continue;
              for (int64_t ow = 0; ow < g.OW; ow++) {
                int64_t iw = ow * g.sw - g.pw + j * g.dw;
                if (iw < 0 || iw >= g.W) continue;
                s += dy[((n * g.K + k) * g.OH + oh) * g.OW + ow] * x[((n * g.C + c0 + cl) * g.H + ih) * g.W + iw];
              }
            }
          blend(&dw[((k * g.Cg + cl) * g.kh + fi) * g.kw + fj], s, alpha, beta);
        }
  }
}

// ---- algorithms: two ranked results, both run here --------------------------------------------------------
template <typename Perf, typename Algo>
void rank(Perf* perf, int requested, int* returned, Algo first, cudnnDeterminism_t first_det, Algo second,
          cudnnDeterminism_t second_det) {
  Algo algos[2] = {first, second};
  cudnnDeterminism_t det[2] = {first_det, second_det};
  int n = requested < 2 ? requested : 2;
  for (int i = 0; i < n; i++) {
    memset(&perf[i], 0, sizeof perf[i]);
    perf[i].algo = algos[i];
    perf[i].status = CUDNN_STATUS_SUCCESS;
    perf[i].time = (float)(i + 1);
    perf[i].memory = 0;
    perf[i].determinism = det[i];
    perf[i].mathType = CUDNN_FMA_MATH;
  }
  *returned = n;
}
cudnnStatus_t check_request(const char* call, int requested, const int* returned, const void* perf) {
  if (requested < 1 || !returned || !perf)
    return refuse(CUDNN_STATUS_BAD_PARAM, call, "%d results requested, or a NULL count or result array", requested);
  return CUDNN_STATUS_SUCCESS;
}

cudnnStatus_t check_handle(const char* call, cudnnHandle_t h) {
  return h ? CUDNN_STATUS_SUCCESS : refuse(CUDNN_STATUS_BAD_PARAM, call, "the handle is NULL (cudnnCreate first)");
}

}  // namespace

// ---- the handle ----------------------------------------------------------------------------------------------
const char* cudnnGetErrorString(cudnnStatus_t s) {
  switch (s) {
    case CUDNN_STATUS_SUCCESS: return "CUDNN_STATUS_SUCCESS";
    case CUDNN_STATUS_NOT_INITIALIZED: return "CUDNN_STATUS_NOT_INITIALIZED";
    case CUDNN_STATUS_BAD_PARAM: return "CUDNN_STATUS_BAD_PARAM";
    case CUDNN_STATUS_NOT_SUPPORTED: return "CUDNN_STATUS_NOT_SUPPORTED";
    case CUDNN_STATUS_INTERNAL_ERROR: return "CUDNN_STATUS_INTERNAL_ERROR";
    case CUDNN_STATUS_EXECUTION_FAILED: return "CUDNN_STATUS_EXECUTION_FAILED";
  }
  return "CUDNN_STATUS_UNKNOWN";
}
cudnnStatus_t cudnnCreate(cudnnHandle_t* h) {
  if (!h) return refuse(CUDNN_STATUS_BAD_PARAM, "cudnnCreate", "handle is NULL");
  *h = new fsdp_emu_dnn{0};
  return CUDNN_STATUS_SUCCESS;
}
cudnnStatus_t cudnnDestroy(cudnnHandle_t h) {
  delete h;
  return CUDNN_STATUS_SUCCESS;
}
cudnnStatus_t cudnnSetStream(cudnnHandle_t h, cudaStream_t s) {
  cudnnStatus_t st = check_handle("cudnnSetStream", h);
  if (st == CUDNN_STATUS_SUCCESS) h->stream = s;
  return st;
}

// ---- descriptors -------------------------------------------------------------------------------------------------
cudnnStatus_t cudnnCreateTensorDescriptor(cudnnTensorDescriptor_t* d) {
  if (!d) return refuse(CUDNN_STATUS_BAD_PARAM, "cudnnCreateTensorDescriptor", "the descriptor pointer is NULL");
  *d = new fsdp_emu_dnn_tensor{false, 0, 0, 0, 0};
  return CUDNN_STATUS_SUCCESS;
}
cudnnStatus_t cudnnDestroyTensorDescriptor(cudnnTensorDescriptor_t d) {
  delete d;
  return CUDNN_STATUS_SUCCESS;
}
cudnnStatus_t cudnnSetTensor4dDescriptor(cudnnTensorDescriptor_t d, cudnnTensorFormat_t format, cudnnDataType_t type,
                                         int n, int c, int h, int w) {
  const char* call = "cudnnSetTensor4dDescriptor";
  if (!d) return refuse(CUDNN_STATUS_BAD_PARAM, call, "the descriptor is NULL");
  cudnnStatus_t s = check_format(call, format, type);
  if (s != CUDNN_STATUS_SUCCESS) return s;
  if (n < 1 || c < 1 || h < 1 || w < 1)
    return refuse(CUDNN_STATUS_BAD_PARAM, call, "dimensions (N %d, C %d, H %d, W %d): each must be at least 1", n, c, h,
                  w);
  if ((int64_t)n * c * h * w > INT32_MAX)
    return refuse(CUDNN_STATUS_NOT_SUPPORTED, call, "(N %d, C %d, H %d, W %d) has over 2^31 elements", n, c, h, w);
  *d = fsdp_emu_dnn_tensor{true, n, c, h, w};
  return CUDNN_STATUS_SUCCESS;
}
cudnnStatus_t cudnnCreateFilterDescriptor(cudnnFilterDescriptor_t* d) {
  if (!d) return refuse(CUDNN_STATUS_BAD_PARAM, "cudnnCreateFilterDescriptor", "the descriptor pointer is NULL");
  *d = new fsdp_emu_dnn_filter{false, 0, 0, 0, 0};
  return CUDNN_STATUS_SUCCESS;
}
cudnnStatus_t cudnnDestroyFilterDescriptor(cudnnFilterDescriptor_t d) {
  delete d;
  return CUDNN_STATUS_SUCCESS;
}
cudnnStatus_t cudnnSetFilter4dDescriptor(cudnnFilterDescriptor_t d, cudnnDataType_t type, cudnnTensorFormat_t format,
                                         int k, int c, int h, int w) {
  const char* call = "cudnnSetFilter4dDescriptor";
  if (!d) return refuse(CUDNN_STATUS_BAD_PARAM, call, "the descriptor is NULL");
  cudnnStatus_t s = check_format(call, format, type);
  if (s != CUDNN_STATUS_SUCCESS) return s;
  if (k < 1 || c < 1 || h < 1 || w < 1)
    return refuse(CUDNN_STATUS_BAD_PARAM, call, "dimensions (K %d, C %d, kh %d, kw %d): each must be at least 1", k, c,
                  h, w);
  *d = fsdp_emu_dnn_filter{true, k, c, h, w};
  return CUDNN_STATUS_SUCCESS;
}
cudnnStatus_t cudnnCreateConvolutionDescriptor(cudnnConvolutionDescriptor_t* d) {
  if (!d) return refuse(CUDNN_STATUS_BAD_PARAM, "cudnnCreateConvolutionDescriptor", "the descriptor pointer is NULL");
  *d = new fsdp_emu_dnn_conv{false, 0, 0, 1, 1, 1, 1, CUDNN_CROSS_CORRELATION, 1, CUDNN_DEFAULT_MATH};
  return CUDNN_STATUS_SUCCESS;
}
cudnnStatus_t cudnnDestroyConvolutionDescriptor(cudnnConvolutionDescriptor_t d) {
  delete d;
  return CUDNN_STATUS_SUCCESS;
}
cudnnStatus_t cudnnSetConvolution2dDescriptor(cudnnConvolutionDescriptor_t d, int pad_h, int pad_w, int stride_h,
                                              int stride_w, int dilation_h, int dilation_w, cudnnConvolutionMode_t mode,
                                              cudnnDataType_t compute_type) {
  const char* call = "cudnnSetConvolution2dDescriptor";
  if (!d) return refuse(CUDNN_STATUS_BAD_PARAM, call, "the descriptor is NULL");
  if (pad_h < 0 || pad_w < 0 || stride_h < 1 || stride_w < 1 || dilation_h < 1 || dilation_w < 1)
    return refuse(CUDNN_STATUS_BAD_PARAM, call,
                  "pad %d,%d stride %d,%d dilation %d,%d: padding must be >= 0, stride and dilation >= 1", pad_h, pad_w,
                  stride_h, stride_w, dilation_h, dilation_w);
  if (mode != CUDNN_CONVOLUTION && mode != CUDNN_CROSS_CORRELATION)
    return refuse(CUDNN_STATUS_BAD_PARAM, call, "mode %d is not a cudnnConvolutionMode_t", (int)mode);
  if (compute_type != CUDNN_DATA_FLOAT)
    return refuse(CUDNN_STATUS_NOT_SUPPORTED, call, "compute type %s: the stand-in computes in CUDNN_DATA_FLOAT only",
                  type_name(compute_type));
  d->set = true;
  d->ph = pad_h, d->pw = pad_w, d->sh = stride_h, d->sw = stride_w, d->dh = dilation_h, d->dw = dilation_w;
  d->mode = mode;
  return CUDNN_STATUS_SUCCESS;
}
cudnnStatus_t cudnnSetConvolutionGroupCount(cudnnConvolutionDescriptor_t d, int groups) {
  const char* call = "cudnnSetConvolutionGroupCount";
  if (!d) return refuse(CUDNN_STATUS_BAD_PARAM, call, "the descriptor is NULL");
  if (groups < 1) return refuse(CUDNN_STATUS_BAD_PARAM, call, "%d groups (at least 1)", groups);
  d->groups = groups;
  return CUDNN_STATUS_SUCCESS;
}
cudnnStatus_t cudnnSetConvolutionMathType(cudnnConvolutionDescriptor_t d, cudnnMathType_t math) {
  const char* call = "cudnnSetConvolutionMathType";
  if (!d) return refuse(CUDNN_STATUS_BAD_PARAM, call, "the descriptor is NULL");
  if (math == CUDNN_TENSOR_OP_MATH || math == CUDNN_TENSOR_OP_MATH_ALLOW_CONVERSION)
    return refuse(CUDNN_STATUS_NOT_SUPPORTED, call,
                  "%s: the stand-in has CUDNN_DEFAULT_MATH and CUDNN_FMA_MATH (float32) only", math_name(math));
  if (math != CUDNN_DEFAULT_MATH && math != CUDNN_FMA_MATH)
    return refuse(CUDNN_STATUS_BAD_PARAM, call, "math type %d is not a cudnnMathType_t", (int)math);
  d->math = math;
  return CUDNN_STATUS_SUCCESS;
}

// ---- algorithm queries ----------------------------------------------------------------------------------------------
cudnnStatus_t cudnnGetConvolutionForwardAlgorithm_v7(cudnnHandle_t h, cudnnTensorDescriptor_t x,
                                                     cudnnFilterDescriptor_t w, cudnnConvolutionDescriptor_t conv,
                                                     cudnnTensorDescriptor_t y, int requested, int* returned,
                                                     cudnnConvolutionFwdAlgoPerf_t* perf) {
  const char* call = "cudnnGetConvolutionForwardAlgorithm_v7";
  geom g;
  cudnnStatus_t s = check_handle(call, h);
  if (s == CUDNN_STATUS_SUCCESS) s = check_request(call, requested, returned, perf);
  if (s == CUDNN_STATUS_SUCCESS) s = check_geom(call, x, w, conv, y, &g);
  if (s != CUDNN_STATUS_SUCCESS) return s;
  rank(perf, requested, returned, CUDNN_CONVOLUTION_FWD_ALGO_IMPLICIT_GEMM, CUDNN_DETERMINISTIC,
       CUDNN_CONVOLUTION_FWD_ALGO_IMPLICIT_PRECOMP_GEMM, CUDNN_DETERMINISTIC);
  return CUDNN_STATUS_SUCCESS;
}
// (as documented: ALGO_1 is deterministic, ALGO_0 not -- here both are, the order being fixed)
cudnnStatus_t cudnnGetConvolutionBackwardDataAlgorithm_v7(cudnnHandle_t h, cudnnFilterDescriptor_t w,
                                                          cudnnTensorDescriptor_t dy, cudnnConvolutionDescriptor_t conv,
                                                          cudnnTensorDescriptor_t dx, int requested, int* returned,
                                                          cudnnConvolutionBwdDataAlgoPerf_t* perf) {
  const char* call = "cudnnGetConvolutionBackwardDataAlgorithm_v7";
  geom g;
  cudnnStatus_t s = check_handle(call, h);
  if (s == CUDNN_STATUS_SUCCESS) s = check_request(call, requested, returned, perf);
  if (s == CUDNN_STATUS_SUCCESS) s = check_geom(call, dx, w, conv, dy, &g);
  if (s != CUDNN_STATUS_SUCCESS) return s;
  rank(perf, requested, returned, CUDNN_CONVOLUTION_BWD_DATA_ALGO_1, CUDNN_DETERMINISTIC,
       CUDNN_CONVOLUTION_BWD_DATA_ALGO_0, CUDNN_NON_DETERMINISTIC);
  return CUDNN_STATUS_SUCCESS;
}
cudnnStatus_t cudnnGetConvolutionBackwardFilterAlgorithm_v7(cudnnHandle_t h, cudnnTensorDescriptor_t x,
                                                            cudnnTensorDescriptor_t dy,
                                                            cudnnConvolutionDescriptor_t conv,
                                                            cudnnFilterDescriptor_t dw, int requested, int* returned,
                                                            cudnnConvolutionBwdFilterAlgoPerf_t* perf) {
  const char* call = "cudnnGetConvolutionBackwardFilterAlgorithm_v7";
  geom g;
  cudnnStatus_t s = check_handle(call, h);
  if (s == CUDNN_STATUS_SUCCESS) s = check_request(call, requested, returned, perf);
  if (s == CUDNN_STATUS_SUCCESS) s = check_geom(call, x, dw, conv, dy, &g);
  if (s != CUDNN_STATUS_SUCCESS) return s;
  rank(perf, requested, returned, CUDNN_CONVOLUTION_BWD_FILTER_ALGO_1, CUDNN_DETERMINISTIC,
       CUDNN_CONVOLUTION_BWD_FILTER_ALGO_0, CUDNN_NON_DETERMINISTIC);
  return CUDNN_STATUS_SUCCESS;
}

// ---- the convolutions ---------------------------------------------------------------------------------------------
// The three convolutions check what cuDNN checks, in its order -- the handle, the geometry, the
// algorithm (ok: one the stand-in runs; runs: which those are), the scalars -- then the buffers and the
// workspace, and queue fn(g, a, b) on the handle's stream, where it runs unless an earlier error
// stuck or a buffer stopped being device memory.
static cudnnStatus_t conv_checks(const char* call, cudnnHandle_t h, cudnnTensorDescriptor_t xd,
                                 cudnnFilterDescriptor_t wd, cudnnConvolutionDescriptor_t conv,
                                 cudnnTensorDescriptor_t yd, bool ok, int algo, const char* runs, const void* alpha,
                                 const void* beta, geom* g, float* a, float* b) {
  cudnnStatus_t s = check_handle(call, h);
  if (s == CUDNN_STATUS_SUCCESS) s = check_geom(call, xd, wd, conv, yd, g);
  if (s == CUDNN_STATUS_SUCCESS && !ok)
    s = refuse(CUDNN_STATUS_NOT_SUPPORTED, call, "algorithm %d: the stand-in runs %s", algo, runs);
  if (s == CUDNN_STATUS_SUCCESS) s = read_scalars(call, alpha, beta, a, b);
  return s;
}
template <class Fn>
static cudnnStatus_t conv_queue(const char* call, cudnnHandle_t h, const buffer (&bufs)[3], void* workspace,
                                size_t workspace_bytes, Fn fn) {
  cudnnStatus_t s = check_buffers(call, bufs, 3);
  if (s == CUDNN_STATUS_SUCCESS) s = check_workspace(call, workspace, workspace_bytes);
  if (s != CUDNN_STATUS_SUCCESS) return s;
  buffer kept[3] = {bufs[0], bufs[1], bufs[2]};
  fsdp_emu::enqueue(h->stream, call, [=] {
    if (!fsdp_emu::failed() && still_device(call, kept, 3)) fn();
  });
  return CUDNN_STATUS_SUCCESS;
}

cudnnStatus_t cudnnConvolutionForward(cudnnHandle_t h, const void* alpha, cudnnTensorDescriptor_t xd, const void* x,
                                      cudnnFilterDescriptor_t wd, const void* w, cudnnConvolutionDescriptor_t conv,
                                      cudnnConvolutionFwdAlgo_t algo, void* workspace, size_t workspace_bytes,
                                      const void* beta, cudnnTensorDescriptor_t yd, void* y) {
  const char* call = "cudnnConvolutionForward";
  geom g;
  float a, b;
  bool ok =
      algo == CUDNN_CONVOLUTION_FWD_ALGO_IMPLICIT_GEMM || algo == CUDNN_CONVOLUTION_FWD_ALGO_IMPLICIT_PRECOMP_GEMM;
  cudnnStatus_t s =
      conv_checks(call, h, xd, wd, conv, yd, ok, (int)algo,
                  "IMPLICIT_GEMM and IMPLICIT_PRECOMP_GEMM (what the _v7 query ranks)", alpha, beta, &g, &a, &b);
  if (s != CUDNN_STATUS_SUCCESS) return s;
  const float *xp = (const float*)x, *wp = (const float*)w;
  float* yp = (float*)y;
  return conv_queue(call, h, {{"x", x, numel(xd)}, {"w", w, numel(wd)}, {"y", y, numel(yd)}}, workspace,
                    workspace_bytes, [=] { forward(g, a, xp, wp, b, yp); });
}

cudnnStatus_t cudnnConvolutionBackwardData(cudnnHandle_t h, const void* alpha, cudnnFilterDescriptor_t wd,
                                           const void* w, cudnnTensorDescriptor_t dyd, const void* dy,
                                           cudnnConvolutionDescriptor_t conv, cudnnConvolutionBwdDataAlgo_t algo,
                                           void* workspace, size_t workspace_bytes, const void* beta,
                                           cudnnTensorDescriptor_t dxd, void* dx) {
  const char* call = "cudnnConvolutionBackwardData";
  geom g;
  float a, b;
  bool ok = algo == CUDNN_CONVOLUTION_BWD_DATA_ALGO_0 || algo == CUDNN_CONVOLUTION_BWD_DATA_ALGO_1;
  cudnnStatus_t s =
      conv_checks(call, h, dxd, wd, conv, dyd, ok, (int)algo, "ALGO_0 and ALGO_1", alpha, beta, &g, &a, &b);
  if (s != CUDNN_STATUS_SUCCESS) return s;
  const float *wp = (const float*)w, *dyp = (const float*)dy;
  float* dxp = (float*)dx;
  return conv_queue(call, h, {{"w", w, numel(wd)}, {"dy", dy, numel(dyd)}, {"dx", dx, numel(dxd)}}, workspace,
                    workspace_bytes, [=] { backward_data(g, a, wp, dyp, b, dxp); });
}

cudnnStatus_t cudnnConvolutionBackwardFilter(cudnnHandle_t h, const void* alpha, cudnnTensorDescriptor_t xd,
                                             const void* x, cudnnTensorDescriptor_t dyd, const void* dy,
                                             cudnnConvolutionDescriptor_t conv, cudnnConvolutionBwdFilterAlgo_t algo,
                                             void* workspace, size_t workspace_bytes, const void* beta,
                                             cudnnFilterDescriptor_t dwd, void* dw) {
  const char* call = "cudnnConvolutionBackwardFilter";
  geom g;
  float a, b;
  bool ok = algo == CUDNN_CONVOLUTION_BWD_FILTER_ALGO_0 || algo == CUDNN_CONVOLUTION_BWD_FILTER_ALGO_1;
  cudnnStatus_t s =
      conv_checks(call, h, xd, dwd, conv, dyd, ok, (int)algo, "ALGO_0 and ALGO_1", alpha, beta, &g, &a, &b);
  if (s != CUDNN_STATUS_SUCCESS) return s;
  const float *xp = (const float*)x, *dyp = (const float*)dy;
  float* dwp = (float*)dw;
  return conv_queue(call, h, {{"x", x, numel(xd)}, {"dy", dy, numel(dyd)}, {"dw", dw, numel(dwd)}}, workspace,
                    workspace_bytes, [=] { backward_filter(g, a, xp, dyp, b, dwp); });
}

// ---- bias -----------------------------------------------------------------------------------------------------------
cudnnStatus_t cudnnConvolutionBackwardBias(cudnnHandle_t h, const void* alpha, cudnnTensorDescriptor_t dyd,
                                           const void* dy, const void* beta, cudnnTensorDescriptor_t dbd, void* db) {
  const char* call = "cudnnConvolutionBackwardBias";
  float a, b;
  cudnnStatus_t s = check_handle(call, h);
  if (s != CUDNN_STATUS_SUCCESS) return s;
  if (!dyd || !dbd || !dyd->set || !dbd->set)
    return refuse(CUDNN_STATUS_BAD_PARAM, call, "a NULL descriptor, or one not set");
  if (dbd->n != 1 || dbd->h != 1 || dbd->w != 1 || dbd->c != dyd->c)
    return refuse(CUDNN_STATUS_BAD_PARAM, call,
                  "db is (%d, %d, %d, %d), dy (N %d, K %d, %d, %d): db must be (1, K, 1, 1)", dbd->n, dbd->c, dbd->h,
                  dbd->w, dyd->n, dyd->c, dyd->h, dyd->w);
  s = read_scalars(call, alpha, beta, &a, &b);
  if (s != CUDNN_STATUS_SUCCESS) return s;
  buffer bufs[2] = {{"dy", dy, numel(dyd)}, {"db", db, numel(dbd)}};
  s = check_buffers(call, bufs, 2);
  if (s != CUDNN_STATUS_SUCCESS) return s;
  const float* dyp = (const float*)dy;
  float* dbp = (float*)db;
  int64_t N = dyd->n, K = dyd->c, P = (int64_t)dyd->h * dyd->w;
  fsdp_emu::enqueue(h->stream, call, [=] {
    if (fsdp_emu::failed() || !still_device(call, bufs, 2)) return;
    for (int64_t k = 0; k < K; k++) {
      float sum = 0.0f;
      for (int64_t n = 0; n < N; n++)
        for (int64_t q = 0; q < P; q++) sum += dyp[(n * K + k) * P + q];
      blend(&dbp[k], sum, a, b);
    }
  });
  return CUDNN_STATUS_SUCCESS;
}

cudnnStatus_t cudnnAddTensor(cudnnHandle_t h, const void* alpha, cudnnTensorDescriptor_t ad, const void* a,
                             const void* beta, cudnnTensorDescriptor_t cd, void* c) {
  const char* call = "cudnnAddTensor";
  float al, be;
  cudnnStatus_t s = check_handle(call, h);
  if (s != CUDNN_STATUS_SUCCESS) return s;
  if (!ad || !cd || !ad->set || !cd->set)
    return refuse(CUDNN_STATUS_BAD_PARAM, call, "a NULL descriptor, or one not set");
  int adim[4] = {ad->n, ad->c, ad->h, ad->w}, cdim[4] = {cd->n, cd->c, cd->h, cd->w};
  for (int i = 0; i < 4; i++)
    if (adim[i] != cdim[i] && adim[i] != 1)
      return refuse(
          CUDNN_STATUS_BAD_PARAM, call,
          "A (%d, %d, %d, %d) onto C (%d, %d, %d, %d): each of A's dimensions must be C's or 1 (dimension %d)", adim[0],
          adim[1], adim[2], adim[3], cdim[0], cdim[1], cdim[2], cdim[3], i);
  s = read_scalars(call, alpha, beta, &al, &be);
  if (s != CUDNN_STATUS_SUCCESS) return s;
  buffer bufs[2] = {{"A", a, numel(ad)}, {"C", c, numel(cd)}};
  s = check_buffers(call, bufs, 2);
  if (s != CUDNN_STATUS_SUCCESS) return s;
  const float* ap = (const float*)a;
  float* cp = (float*)c;
  int64_t N = cd->n, C = cd->c, H = cd->h, W = cd->w;
  // A's strides, 0 along a broadcast dimension
  int64_t sw = adim[3] == 1 ? 0 : 1, sh = adim[2] == 1 ? 0 : adim[3],
          sc = adim[1] == 1 ? 0 : (int64_t)adim[2] * adim[3],
          sn = adim[0] == 1 ? 0 : (int64_t)adim[1] * adim[2] * adim[3];
  fsdp_emu::enqueue(h->stream, call, [=] {
    if (fsdp_emu::failed() || !still_device(call, bufs, 2)) return;
    for (int64_t n = 0; n < N; n++)
      for (int64_t ch = 0; ch < C; ch++)
        for (int64_t y = 0; y < H; y++)
          for (int64_t x = 0; x < W; x++)
            blend(&cp[((n * C + ch) * H + y) * W + x], ap[n * sn + ch * sc + y * sh + x * sw], al, be);
  });
  return CUDNN_STATUS_SUCCESS;
}
