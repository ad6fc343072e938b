/*
 * ops/conv.c -- conv2d, max_pool2d, avg_pool2d and adaptive_avg_pool2d (NCHW; computed in float32,
 * results rounded to the input's dtype: ops/ops.h, "float dtypes"; bf16 convolutions natively where
 * the device can) with their backward. Shapes follow PyTorch's formulas; the work happens in the
 * device's linalg kernels (oneDNN, or our im2col + GEMM or Winograd, for convolution: the CPU
 * kernels choose, FSDP_CONV_ALGO forces ours -- window loops for pooling). conv_transpose2d runs on the
 * same kernels (the input gradient of a convolution is a transposed convolution).
 */
#include "ops/ops.h"

// floor division that rounds toward -inf
static int64_t div_floor(int64_t a, int64_t b) { return a >= 0 ? a / b : -((-a + b - 1) / b); }

// PyTorch's pooling_output_shape
static int64_t pool_out_size(int64_t in, int k, int pad, int stride, int dil, int ceil_mode) {
  int64_t out = div_floor(in + 2 * pad - (int64_t)dil * (k - 1) - 1 + (ceil_mode ? stride - 1 : 0), stride) + 1;
  if (ceil_mode && (out - 1) * stride >= in + pad) out--;
  return out;
}

// ---- conv2d -----------------------------------------------------------------------------------------------

// A convolution of bfloat16 x and w runs on them as they are where the device has bf16 kernels
// (conv2d_forward_bf16 and conv2d_backward_bf16: float32 accumulation and results, rounded once
// like every op's); else, and for any other dtype, on float32 copies.
static uint16_t* bf16_ptr(const fsdp_tensor* t) { return (uint16_t*)fsdp_ptr(t); }

// the device's conv2d_backward on tensors (x may be NULL when gw is; gx, gw, gb as the kernel takes
// them): on the bf16 operands where all are bf16 and the device has a bf16 kernel, else on float32
// copies. 0, or -1 with the error set
static int run_conv_backward(const fsdp_conv_geom* g, float* gx, float* gw, float* gb, fsdp_tensor* gy, fsdp_tensor* x,
                             fsdp_tensor* w) {
  const fsdp_linalg_kernels* k = fsdp_backend_of(w)->linalg;
  fsdp_tensor *xc = NULL, *wc = NULL, *gyc = NULL;
  int rc = 1;
  if (gy->dtype == FSDP_BF16 && w->dtype == FSDP_BF16 && (!x || x->dtype == FSDP_BF16)) {
    gyc = fsdp_as_contig_dtype(gy, FSDP_BF16), wc = fsdp_as_contig_dtype(w, FSDP_BF16);
    xc = x ? fsdp_as_contig_dtype(x, FSDP_BF16) : NULL;
    rc = gyc && wc && (!x || xc)
             ? k->conv2d_backward_bf16(g, gx, gw, gb, bf16_ptr(gyc), xc ? bf16_ptr(xc) : NULL, bf16_ptr(wc))
             : -1;
  }
  if (rc == 1) {  // float32, or bf16 the device leaves to float32 copies
    fsdp_tensor_release(xc), fsdp_tensor_release(wc), fsdp_tensor_release(gyc);
    gyc = fsdp_as_contig(gy), wc = fsdp_as_contig(w), xc = x ? fsdp_as_contig(x) : NULL;
    rc = gyc && wc && (!x || xc)
             ? k->conv2d_backward(g, gx, gw, gb, fsdp_f32(gyc), xc ? fsdp_f32(xc) : NULL, fsdp_f32(wc))
             : -1;
  }
  fsdp_tensor_release(xc);
  fsdp_tensor_release(wc);
  fsdp_tensor_release(gyc);
  return rc ? -1 : 0;
}

// the device's conv2d_forward on tensors (b: float32 or NULL), bf16 as above
static int run_conv_forward(const fsdp_conv_geom* g, float* y, fsdp_tensor* x, fsdp_tensor* w, const float* b) {
  const fsdp_linalg_kernels* k = fsdp_backend_of(w)->linalg;
  fsdp_tensor *xc = NULL, *wc = NULL;
  int rc = 1;
  if (x->dtype == FSDP_BF16 && w->dtype == FSDP_BF16) {
    xc = fsdp_as_contig_dtype(x, FSDP_BF16), wc = fsdp_as_contig_dtype(w, FSDP_BF16);
    rc = xc && wc ? k->conv2d_forward_bf16(g, y, bf16_ptr(xc), bf16_ptr(wc), b) : -1;
  }
  if (rc == 1) {  // float32, or bf16 the device leaves to float32 copies
    fsdp_tensor_release(xc), fsdp_tensor_release(wc);
    xc = fsdp_as_contig(x), wc = fsdp_as_contig(w);
    rc = xc && wc ? k->conv2d_forward(g, y, fsdp_f32(xc), fsdp_f32(wc), b) : -1;
  }
  fsdp_tensor_release(xc);
  fsdp_tensor_release(wc);
  return rc ? -1 : 0;
}

static int conv2d_backward(fsdp_node* node, fsdp_tensor* grad_out, fsdp_tensor** grad_in) {
  fsdp_tensor* x = fsdp_node_saved(node, 0);
  fsdp_tensor* w = x ? fsdp_node_saved(node, 1) : NULL;
  if (!x || !w) return -1;
  fsdp_conv_geom g;
  fsdp_node_params(node, &g, sizeof g);
  int dev = fsdp_device_of(x);
  fsdp_tensor *gx = NULL, *gw = NULL, *gb = NULL;
  int rc = -1;
  if (node->needs_grad[0] && !(gx = fsdp_new(4, x->shape, FSDP_F32, dev))) goto done;
  if (node->needs_grad[1] && !(gw = fsdp_new(4, w->shape, FSDP_F32, dev))) goto done;
  if (node->needs_grad[2] && !(gb = fsdp_new(1, &g.O, FSDP_F32, dev))) goto done;
  rc = run_conv_backward(&g, gx ? fsdp_f32(gx) : NULL, gw ? fsdp_f32(gw) : NULL, gb ? fsdp_f32(gb) : NULL, grad_out, x,
                         w);
done:
  if (rc) {
    fsdp_tensor_release(gx);
    fsdp_tensor_release(gw);
    fsdp_tensor_release(gb);
    return -1;
  }
  grad_in[0] = gx;
  grad_in[1] = gw;
  grad_in[2] = gb;
  return 0;
}

fsdp_tensor* fsdp_conv2d(fsdp_tensor* x, fsdp_tensor* w, fsdp_tensor* b, const int* stride, const int* padding,
                         const int* dilation, int groups) {
  CHECK_NULL(x && w, "conv2d: input or weight is nil");
  if (fsdp_check_float("conv2d", x) || fsdp_check_float("conv2d", w) || (b && fsdp_check_float("conv2d", b)))
    return NULL;
  if (fsdp_check_same_dtype("conv2d", "input", x, "weight", w) ||
      fsdp_check_same_dtype("conv2d", "weight", w, "bias", b))
    return NULL;
  if (fsdp_check_same_device("conv2d", x, w) || (b && fsdp_check_same_device("conv2d", x, b))) return NULL;
  CHECK_NULL(x->ndim == 4, "conv2d: expected a 4-D input (N, C, H, W), got %s", SH(x));
  CHECK_NULL(w->ndim == 4, "conv2d: expected a 4-D weight (out_channels, in_channels/groups, kh, kw), got %s", SH(w));
  int s[2] = {stride ? stride[0] : 1, stride ? stride[1] : 1};
  int p[2] = {padding ? padding[0] : 0, padding ? padding[1] : 0};
  int d[2] = {dilation ? dilation[0] : 1, dilation ? dilation[1] : 1};
  CHECK_NULL(s[0] > 0 && s[1] > 0 && d[0] > 0 && d[1] > 0 && p[0] >= 0 && p[1] >= 0,
             "conv2d: stride (%d, %d) and dilation (%d, %d) must be positive, padding (%d, %d) non-negative", s[0],
             s[1], d[0], d[1], p[0], p[1]);
  CHECK_NULL(groups >= 1, "conv2d: groups must be positive, got %d", groups);
  int64_t N = x->shape[0], C = x->shape[1], H = x->shape[2], W = x->shape[3];
  int64_t O = w->shape[0], kh = w->shape[2], kw = w->shape[3];
  CHECK_NULL(C % groups == 0 && O % groups == 0,
             "conv2d: input %s channels %lld and weight %s out_channels %lld must be divisible by groups %d", SH(x),
             (long long)C, SH(w), (long long)O, groups);
  CHECK_NULL(w->shape[1] * groups == C,
             "conv2d: input %s has %lld channels but weight %s expects %lld (in_channels/groups %lld x groups %d)",
             SH(x), (long long)C, SH(w), (long long)(w->shape[1] * groups), (long long)w->shape[1], groups);
  CHECK_NULL(!b || (b->ndim == 1 && b->shape[0] == O), "conv2d: bias %s does not match weight %s: expected (%lld)",
             b ? SH(b) : "", SH(w), (long long)O);
  int64_t ekh = (int64_t)d[0] * (kh - 1) + 1, ekw = (int64_t)d[1] * (kw - 1) + 1;
  CHECK_NULL(C > 0, "conv2d: input %s has no channels", SH(x));
  CHECK_NULL(kh > 0 && kw > 0 && ekh <= H + 2 * p[0] && ekw <= W + 2 * p[1],
             "conv2d: kernel %s (dilated size (%lld, %lld)) is larger than the padded input (%lld, %lld) of %s", SH(w),
             (long long)ekh, (long long)ekw, (long long)(H + 2 * p[0]), (long long)(W + 2 * p[1]), SH(x));
  fsdp_conv_geom g = {.N = N,
                      .C = C,
                      .H = H,
                      .W = W,
                      .O = O,
                      .OH = (H + 2 * p[0] - ekh) / s[0] + 1,
                      .OW = (W + 2 * p[1] - ekw) / s[1] + 1,
                      .kh = (int)kh,
                      .kw = (int)kw,
                      .sh = s[0],
                      .sw = s[1],
                      .ph = p[0],
                      .pw = p[1],
                      .dh = d[0],
                      .dw = d[1],
                      .groups = groups};

  fsdp_tensor* bc = b ? fsdp_as_contig(b) : NULL;
  fsdp_tensor* y = fsdp_new(4, (int64_t[]){N, O, g.OH, g.OW}, FSDP_F32, fsdp_device_of(x));
  int rc = y && (!b || bc) ? run_conv_forward(&g, fsdp_f32(y), x, w, bc ? fsdp_f32(bc) : NULL) : -1;
  fsdp_tensor_release(bc);
  if (rc) {
    fsdp_tensor_release(y);
    return NULL;
  }
  y = fsdp_round_to(y, x->dtype);
  if (!y) return NULL;

  fsdp_node* n = fsdp_node_new("ConvolutionBackward", conv2d_backward, 3, (fsdp_tensor*[]){x, w, b});
  if (n) {
    fsdp_node_save(n, x);
    fsdp_node_save(n, w);
    fsdp_node_set_params(n, &g, sizeof g);
    fsdp_node_set_output(n, y);
  }
  return y;
}

// ---- conv_transpose2d -------------------------------------------------------------------------------------
// A transposed convolution is the input gradient of a convolution: with x (N, Cin, H, W) and w (Cin,
// Cout/groups, kh, kw) -- PyTorch's layout, which is a convolution's (O, C/groups, kh, kw) with O = Cin,
// C = Cout -- y = conv_transpose2d(x, w) is the gradient with respect to the input (N, Cout, OH, OW) of
// conv2d(., w) whose output gradient is x. So the geometry below is that convolution's (C = Cout, H = OH,
// O = Cin, OH = H), the forward runs the device's conv2d_backward for its input gradient, and the
// backward runs conv2d_forward (grad_x = conv2d(grad_y, w)) and the weight gradient (grad_w = the
// convolution's weight gradient with input grad_y and output gradient x). The bias is added after, by
// an add node, in float32 before the one rounding to the input's dtype.

static int conv_transpose2d_backward(fsdp_node* node, fsdp_tensor* grad_out, fsdp_tensor** grad_in) {
  fsdp_tensor* x = fsdp_node_saved(node, 0);
  fsdp_tensor* w = x ? fsdp_node_saved(node, 1) : NULL;
  if (!x || !w) return -1;
  fsdp_conv_geom g;
  fsdp_node_params(node, &g, sizeof g);
  int dev = fsdp_device_of(x);
  fsdp_tensor *gx = NULL, *gw = NULL;
  int rc = 0;
  if (node->needs_grad[0] && !(gx = fsdp_new(4, x->shape, FSDP_F32, dev))) rc = -1;
  if (!rc && node->needs_grad[1] && !(gw = fsdp_new(4, w->shape, FSDP_F32, dev))) rc = -1;
  // grad_x (N, Cin, H, W) = conv2d(grad_y (N, Cout, OH, OW), w)
  if (!rc && gx) rc = run_conv_forward(&g, fsdp_f32(gx), grad_out, w, NULL);
  // grad_w: the weight gradient of that convolution, its output gradient being x
  if (!rc && gw) rc = run_conv_backward(&g, NULL, fsdp_f32(gw), NULL, x, grad_out, w);
  if (rc) {
    fsdp_tensor_release(gx);
    fsdp_tensor_release(gw);
    return -1;
  }
  grad_in[0] = gx;
  grad_in[1] = gw;
  return 0;
}

// y (float32) + b viewed as (1, Cout, 1, 1) in float32, through the add and to ops (their nodes give
// the bias gradient), rounded once to dtype; consumes y
static fsdp_tensor* add_channel_bias(fsdp_tensor* y, fsdp_tensor* b, int dtype) {
  fsdp_tensor* bf = fsdp_to_dtype(b, FSDP_F32);
  fsdp_tensor* bv = bf ? fsdp_view(bf, 4, (int64_t[]){1, b->shape[0], 1, 1}) : NULL;
  fsdp_tensor* sum = bv ? fsdp_add(y, bv) : NULL;
  fsdp_tensor* r = sum ? fsdp_to_dtype(sum, dtype) : NULL;
  fsdp_tensor_release(sum);
  fsdp_tensor_release(bv);
  fsdp_tensor_release(bf);
  fsdp_tensor_release(y);
  return r;
}

fsdp_tensor* fsdp_conv_transpose2d(fsdp_tensor* x, fsdp_tensor* w, fsdp_tensor* b, const int* stride,
                                   const int* padding, const int* output_padding, const int* dilation, int groups) {
  const char* op = "conv_transpose2d";
  CHECK_NULL(x && w, "%s: input or weight is nil", op);
  if (fsdp_check_float(op, x) || fsdp_check_float(op, w) || (b && fsdp_check_float(op, b))) return NULL;
  if (fsdp_check_same_dtype(op, "input", x, "weight", w) || fsdp_check_same_dtype(op, "weight", w, "bias", b))
    return NULL;
  if (fsdp_check_same_device(op, x, w) || (b && fsdp_check_same_device(op, x, b))) return NULL;
  CHECK_NULL(x->ndim == 4, "%s: expected a 4-D input (N, C, H, W), got %s", op, SH(x));
  CHECK_NULL(w->ndim == 4, "%s: expected a 4-D weight (in_channels, out_channels/groups, kh, kw), got %s", op, SH(w));
  int s[2] = {stride ? stride[0] : 1, stride ? stride[1] : 1};
  int p[2] = {padding ? padding[0] : 0, padding ? padding[1] : 0};
  int op2[2] = {output_padding ? output_padding[0] : 0, output_padding ? output_padding[1] : 0};
  int d[2] = {dilation ? dilation[0] : 1, dilation ? dilation[1] : 1};
  CHECK_NULL(s[0] > 0 && s[1] > 0 && d[0] > 0 && d[1] > 0 && p[0] >= 0 && p[1] >= 0,
             "%s: stride (%d, %d) and dilation (%d, %d) must be positive, padding (%d, %d) non-negative", op, s[0],
             s[1], d[0], d[1], p[0], p[1]);
  CHECK_NULL(op2[0] >= 0 && op2[1] >= 0 && (op2[0] < s[0] || op2[0] < d[0]) && (op2[1] < s[1] || op2[1] < d[1]),
             "%s: output_padding (%d, %d) must be non-negative and smaller than either stride (%d, %d) or dilation "
             "(%d, %d)",
             op, op2[0], op2[1], s[0], s[1], d[0], d[1]);
  CHECK_NULL(groups >= 1, "%s: groups must be positive, got %d", op, groups);
  int64_t N = x->shape[0], Cin = x->shape[1], H = x->shape[2], W = x->shape[3];
  int64_t kh = w->shape[2], kw = w->shape[3], Cout = w->shape[1] * groups;
  CHECK_NULL(Cin > 0 && Cin % groups == 0, "%s: input %s channels %lld must be positive and divisible by groups %d", op,
             SH(x), (long long)Cin, groups);
  CHECK_NULL(w->shape[0] == Cin,
             "%s: input %s has %lld channels but weight %s expects %lld (weight: (in_channels, "
             "out_channels/groups, kh, kw))",
             op, SH(x), (long long)Cin, SH(w), (long long)w->shape[0]);
  CHECK_NULL(!b || (b->ndim == 1 && b->shape[0] == Cout),
             "%s: bias %s does not match weight %s with groups %d: expected (%lld)", op, b ? SH(b) : "", SH(w), groups,
             (long long)Cout);
  int64_t OH = (H - 1) * s[0] - 2 * p[0] + (int64_t)d[0] * (kh - 1) + op2[0] + 1;
  int64_t OW = (W - 1) * s[1] - 2 * p[1] + (int64_t)d[1] * (kw - 1) + op2[1] + 1;
  CHECK_NULL(kh > 0 && kw > 0 && OH > 0 && OW > 0,
             "%s: input %s with weight %s, stride (%d, %d), padding (%d, %d) gives an empty output (%lld, %lld)", op,
             SH(x), SH(w), s[0], s[1], p[0], p[1], (long long)OH, (long long)OW);
  // the convolution whose input gradient this is: input (N, Cout, OH, OW), output (N, Cin, H, W)
  fsdp_conv_geom g = {.N = N,
                      .C = Cout,
                      .H = OH,
                      .W = OW,
                      .O = Cin,
                      .OH = H,
                      .OW = W,
                      .kh = (int)kh,
                      .kw = (int)kw,
                      .sh = s[0],
                      .sw = s[1],
                      .ph = p[0],
                      .pw = p[1],
                      .dh = d[0],
                      .dw = d[1],
                      .groups = groups};
  fsdp_tensor* y = fsdp_new(4, (int64_t[]){N, Cout, OH, OW}, FSDP_F32, fsdp_device_of(x));
  if (!y || run_conv_backward(&g, fsdp_f32(y), NULL, NULL, x, NULL, w)) {
    fsdp_tensor_release(y);
    return NULL;
  }
  if (!b) y = fsdp_round_to(y, x->dtype);  // with a bias: rounded once, after the bias
  if (!y) return NULL;
  fsdp_node* n = fsdp_node_new("ConvolutionTransposeBackward", conv_transpose2d_backward, 2, (fsdp_tensor*[]){x, w});
  if (n) {
    fsdp_node_save(n, x);
    fsdp_node_save(n, w);
    fsdp_node_set_params(n, &g, sizeof g);
    fsdp_node_set_output(n, y);
  }
  return b ? add_channel_bias(y, b, x->dtype) : y;
}

// ---- pooling ------------------------------------------------------------------------------------------------
// Inputs are (N, C, H, W) or (C, H, W); the kernels see planes, so a 3-D input is N = 1.

static int pool_geom(const char* op, const fsdp_tensor* x, const int* kernel, const int* stride, const int* padding,
                     const int* dilation, int ceil_mode, fsdp_conv_geom* g) {
  CHECK_INT(x, "%s: input is nil", op);
  if (fsdp_check_float(op, x)) return -1;
  CHECK_INT(x->ndim == 4 || x->ndim == 3, "%s: expected a 4-D (N, C, H, W) or 3-D (C, H, W) input, got %s", op, SH(x));
  CHECK_INT(kernel, "%s: kernel size is missing", op);
  int k[2] = {kernel[0], kernel[1]};
  int s[2] = {stride ? stride[0] : k[0], stride ? stride[1] : k[1]};  // no stride: the kernel size
  int p[2] = {padding ? padding[0] : 0, padding ? padding[1] : 0};
  int d[2] = {dilation ? dilation[0] : 1, dilation ? dilation[1] : 1};
  CHECK_INT(s[0] > 0 && s[1] > 0,
            "%s: stride (%d, %d) must be positive (leave it out for stride = kernel size (%d, %d))", op, s[0], s[1],
            k[0], k[1]);
  CHECK_INT(k[0] > 0 && k[1] > 0 && d[0] > 0 && d[1] > 0 && p[0] >= 0 && p[1] >= 0,
            "%s: kernel (%d, %d) and dilation (%d, %d) must be positive, padding (%d, %d) non-negative", op, k[0], k[1],
            d[0], d[1], p[0], p[1]);
  CHECK_INT(p[0] <= k[0] / 2 && p[1] <= k[1] / 2, "%s: padding (%d, %d) should be at most half of kernel (%d, %d)", op,
            p[0], p[1], k[0], k[1]);
  int nd = x->ndim;
  int64_t H = x->shape[nd - 2], W = x->shape[nd - 1];
  int64_t OH = pool_out_size(H, k[0], p[0], s[0], d[0], ceil_mode),
          OW = pool_out_size(W, k[1], p[1], s[1], d[1], ceil_mode);
  CHECK_INT(OH > 0 && OW > 0,
            "%s: kernel (%d, %d) with dilation (%d, %d) is larger than the padded input (%lld, %lld) of %s "
            "(output size (%lld, %lld))",
            op, k[0], k[1], d[0], d[1], (long long)(H + 2 * p[0]), (long long)(W + 2 * p[1]), SH(x), (long long)OH,
            (long long)OW);
  *g = (fsdp_conv_geom){.N = nd == 4 ? x->shape[0] : 1,
                        .C = x->shape[nd - 3],
                        .H = H,
                        .W = W,
                        .O = x->shape[nd - 3],
                        .OH = OH,
                        .OW = OW,
                        .kh = k[0],
                        .kw = k[1],
                        .sh = s[0],
                        .sw = s[1],
                        .ph = p[0],
                        .pw = p[1],
                        .dh = d[0],
                        .dw = d[1],
                        .groups = 1};
  return 0;
}

// the parameters of the pooling nodes: the window geometry and the input's rank
typedef struct {
  fsdp_conv_geom geom;
  int ndim;               // of the input: 4 (N, C, H, W) or 3 (C, H, W)
  int count_include_pad;  // avg_pool2d: the padding counts in each window's divisor
  int adaptive;           // adaptive_avg_pool2d (its windows come from the geometry's sizes)
} pool_params;

// output (or input) shape of a pooling op with x's rank
static void pool_shape(int ndim, const fsdp_conv_geom* g, int out, int64_t* shape) {
  int64_t full[4] = {g->N, g->C, out ? g->OH : g->H, out ? g->OW : g->W};
  memcpy(shape, full + (4 - ndim), ndim * sizeof(int64_t));
}

static int max_pool2d_backward(fsdp_node* node, fsdp_tensor* grad_out, fsdp_tensor** grad_in) {
  fsdp_tensor* idx = fsdp_node_saved(node, 0);
  if (!idx) return -1;
  pool_params p;
  fsdp_node_params(node, &p, sizeof p);
  int64_t shape[4];
  pool_shape(p.ndim, &p.geom, 0, shape);
  fsdp_tensor *gy = fsdp_as_contig(grad_out), *gx = gy ? fsdp_new(p.ndim, shape, FSDP_F32, fsdp_device_of(gy)) : NULL;
  if (gx) fsdp_backend_of(gy)->linalg->max_pool2d_backward(&p.geom, fsdp_f32(gx), fsdp_f32(gy), fsdp_i64(idx));
  fsdp_tensor_release(gy);
  if (!gx) return -1;
  grad_in[0] = gx;
  return 0;
}

fsdp_tensor* fsdp_max_pool2d(fsdp_tensor* x, const int* kernel, const int* stride, const int* padding,
                             const int* dilation, int ceil_mode) {
  fsdp_conv_geom g;
  if (pool_geom("max_pool2d", x, kernel, stride, padding, dilation, ceil_mode, &g)) return NULL;
  int64_t shape[4];
  pool_shape(x->ndim, &g, 1, shape);
  int dev = fsdp_device_of(x);
  fsdp_tensor *xc = fsdp_as_contig(x), *y = NULL, *idx = NULL;
  if (!xc || !(y = fsdp_new(x->ndim, shape, FSDP_F32, dev)) || !(idx = fsdp_new(x->ndim, shape, FSDP_I64, dev))) {
    fsdp_tensor_release(xc);
    fsdp_tensor_release(y);
    return NULL;
  }
  fsdp_backend_of(x)->linalg->max_pool2d_forward(&g, fsdp_f32(y), fsdp_i64(idx), fsdp_f32(xc));
  fsdp_tensor_release(xc);
  y = fsdp_round_to(y, x->dtype);  // exact: each output is one of x's values
  if (!y) {
    fsdp_tensor_release(idx);
    return NULL;
  }
  fsdp_node* n = fsdp_node_new("MaxPool2DBackward", max_pool2d_backward, 1, (fsdp_tensor*[]){x});
  if (n) {
    fsdp_node_save(n, idx);
    pool_params p = {.geom = g, .ndim = x->ndim};
    fsdp_node_set_params(n, &p, sizeof p);
    fsdp_node_set_output(n, y);
  }
  fsdp_tensor_release(idx);
  return y;
}

static int avg_pool2d_backward(fsdp_node* node, fsdp_tensor* grad_out, fsdp_tensor** grad_in) {
  pool_params p;
  fsdp_node_params(node, &p, sizeof p);
  int64_t shape[4];
  pool_shape(p.ndim, &p.geom, 0, shape);
  fsdp_tensor *gy = fsdp_as_contig(grad_out), *gx = gy ? fsdp_new(p.ndim, shape, FSDP_F32, fsdp_device_of(gy)) : NULL;
  if (gx) {
    const fsdp_linalg_kernels* k = fsdp_backend_of(gy)->linalg;
    if (p.adaptive) k->adaptive_avg_pool2d_backward(&p.geom, fsdp_f32(gx), fsdp_f32(gy));
    else k->avg_pool2d_backward(&p.geom, fsdp_f32(gx), fsdp_f32(gy), p.count_include_pad);
  }
  fsdp_tensor_release(gy);
  if (!gx) return -1;
  grad_in[0] = gx;
  return 0;
}

fsdp_tensor* fsdp_avg_pool2d(fsdp_tensor* x, const int* kernel, const int* stride, const int* padding, int ceil_mode,
                             int count_include_pad) {
  fsdp_conv_geom g;
  if (pool_geom("avg_pool2d", x, kernel, stride, padding, NULL, ceil_mode, &g)) return NULL;
  int64_t shape[4];
  pool_shape(x->ndim, &g, 1, shape);
  fsdp_tensor *xc = fsdp_as_contig(x), *y = xc ? fsdp_new(x->ndim, shape, FSDP_F32, fsdp_device_of(x)) : NULL;
  if (y) fsdp_backend_of(x)->linalg->avg_pool2d_forward(&g, fsdp_f32(y), fsdp_f32(xc), count_include_pad);
  fsdp_tensor_release(xc);
  y = fsdp_round_to(y, x->dtype);
  if (!y) return NULL;
  fsdp_node* n = fsdp_node_new("AvgPool2DBackward", avg_pool2d_backward, 1, (fsdp_tensor*[]){x});
  if (n) {
    pool_params p = {.geom = g, .ndim = x->ndim, .count_include_pad = count_include_pad != 0};
    fsdp_node_set_params(n, &p, sizeof p);
    fsdp_node_set_output(n, y);
  }
  return y;
}

fsdp_tensor* fsdp_adaptive_avg_pool2d(fsdp_tensor* x, int out_h, int out_w) {
  CHECK_NULL(x, "adaptive_avg_pool2d: input is nil");
  if (fsdp_check_float("adaptive_avg_pool2d", x)) return NULL;
  CHECK_NULL(x->ndim == 4 || x->ndim == 3,
             "adaptive_avg_pool2d: expected a 4-D (N, C, H, W) or 3-D (C, H, W) input, got %s", SH(x));
  CHECK_NULL(out_h > 0 && out_w > 0, "adaptive_avg_pool2d: output size (%d, %d) must be positive (input %s)", out_h,
             out_w, SH(x));
  int nd = x->ndim;
  CHECK_NULL(x->shape[nd - 2] > 0 && x->shape[nd - 1] > 0, "adaptive_avg_pool2d: empty spatial dims in input %s",
             SH(x));
  fsdp_conv_geom g = {.N = nd == 4 ? x->shape[0] : 1,
                      .C = x->shape[nd - 3],
                      .H = x->shape[nd - 2],
                      .W = x->shape[nd - 1],
                      .OH = out_h,
                      .OW = out_w,
                      .groups = 1};
  g.O = g.C;
  int64_t shape[4];
  pool_shape(nd, &g, 1, shape);
  fsdp_tensor *xc = fsdp_as_contig(x), *y = xc ? fsdp_new(nd, shape, FSDP_F32, fsdp_device_of(x)) : NULL;
  if (y) fsdp_backend_of(x)->linalg->adaptive_avg_pool2d_forward(&g, fsdp_f32(y), fsdp_f32(xc));
  fsdp_tensor_release(xc);
  y = fsdp_round_to(y, x->dtype);
  if (!y) return NULL;
  fsdp_node* n = fsdp_node_new("AdaptiveAvgPool2DBackward", avg_pool2d_backward, 1, (fsdp_tensor*[]){x});
  if (n) {
    pool_params p = {.geom = g, .ndim = nd, .adaptive = 1};
    fsdp_node_set_params(n, &p, sizeof p);
    fsdp_node_set_output(n, y);
  }
  return y;
}
