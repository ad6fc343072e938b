--- fsdp.nn.functional (also fsdp.F): PyTorch's torch.nn.functional, each a thin call into a C op.
--
-- Arguments follow PyTorch: positional ones in PyTorch's order, keyword ones in a trailing
-- options table that may name any of them (fsdp.args): F.conv2d(x, w, b, {stride = 2, padding = 1}) ==
-- F.conv2d(x, w, b, 2, 1) == F.conv2d(x, w, {bias = b, stride = 2, padding = 1}).
-- Dimensions are 1-based (negative from the end); class-index VALUES (targets, embedding
-- indices, padding_idx, ignore_index) are 0-based like PyTorch's, since they are data.
-- @module fsdp.nn.functional
local ffi = require "ffi"
local fsdp = require "fsdp"
local C = fsdp.C
local wrap, dim, T, P = fsdp._wrap, fsdp._dim, fsdp._t, fsdp._p

local F = {}

-- ---- argument helpers ---------------------------------------------------------------------------
-- PyTorch's positional arguments or any of them by name in a trailing options table (fsdp.args)
F._args = require "fsdp.args"
local args_of = F._args

-- an int or {h, w} pair -> int[2]: integers >= 1 (a padding >= 0)
local function pair(op, what, v, default)
  if v == nil then v = default end
  local a, b
  if type(v) == "number" then a, b = v, v
  elseif type(v) == "table" and #v == 2 then a, b = v[1], v[2]
  else error(("%s: %s must be an integer or a pair {h, w}, got %s"):format(op, what, tostring(v)), 3) end
  local min = what:find("padding", 1, true) and 0 or 1  -- (padding, output_padding)
  if type(a) ~= "number" or type(b) ~= "number" or a ~= math.floor(a) or b ~= math.floor(b) or a < min or b < min
     or a >= 2 ^ 31 or b >= 2 ^ 31 then
    error(("%s: %s must be integers >= %d, got {%s, %s}"):format(op, what, min, tostring(a), tostring(b)), 3)
  end
  return ffi.new("int[2]", a, b), { a, b }
end
F._pair = pair

local function check_reduction(op, o)
  if o.reduction ~= nil and o.reduction ~= "mean" then
    error(("%s: only reduction = \"mean\" is supported, got %q"):format(op, tostring(o.reduction)), 3)
  end
  if o.weight ~= nil then error(op .. ": class weights are not supported", 3) end
  if o.size_average ~= nil or o.reduce ~= nil then
    error(op .. ": size_average and reduce are deprecated in PyTorch; use reduction = \"mean\"", 3)
  end
end

-- ---- linear and convolution ------------------------------------------------------------------------
--- x (*, in), w (out, in), b (out) or nil
function F.linear(x, w, ...)
  local b = args_of("linear", { { "bias", optional = true } }, ...).bias
  return (wrap(C.fsdp_linear(T(x, "linear", "input"), T(w, "linear", "weight"), P(b, "linear", "bias"))))
end

-- padding may be an int, a pair, "valid" (0) or "same" (stride 1, symmetric padding)
local function conv_padding(o, w)
  local p = o.padding
  if p == "valid" then return 0 end
  if p == "same" then
    local s = o.stride or 1
    if s ~= 1 and not (type(s) == "table" and s[1] == 1 and s[2] == 1) then
      error("conv2d: padding = \"same\" requires stride 1", 4)
    end
    local _, d = pair("conv2d", "dilation", o.dilation, 1)
    local pads = {}
    for i = 1, 2 do
      local total = d[i] * (w:size(2 + i) - 1)
      if total % 2 ~= 0 then
        error(("conv2d: padding = \"same\" needs an odd effective kernel size (kernel %d, dilation %d)")
          :format(w:size(2 + i), d[i]), 4)
      end
      pads[i] = total / 2
    end
    return pads
  end
  return p or 0
end

--- F.conv2d(x, w, b, stride, padding, dilation, groups) or F.conv2d(x, w, b, {stride =, ...})
-- x (N, C, H, W), w (O, C/groups, kh, kw), b (O) or nil
function F.conv2d(x, w, ...)
  local o = args_of("conv2d", { { "bias", optional = true }, { "stride", 1 }, { "padding", 0 },
    { "dilation", 1 }, { "groups", 1 } }, ...)
  local px, pw, pb = T(x, "conv2d", "input"), T(w, "conv2d", "weight"), P(o.bias, "conv2d", "bias")
  local stride = pair("conv2d", "stride", o.stride, 1)
  local padding = pair("conv2d", "padding", conv_padding(o, w), 0)
  local dilation = pair("conv2d", "dilation", o.dilation, 1)
  local groups = o.groups or 1
  if type(groups) ~= "number" or groups ~= math.floor(groups) or groups < 1 then
    error(("conv2d: groups must be a positive integer dividing both channel counts, got %s"):format(tostring(groups)), 2)
  end
  return (wrap(C.fsdp_conv2d(px, pw, pb, stride, padding, dilation, groups)))
end

--- F.conv_transpose2d(x, w, b, stride, padding, output_padding, groups, dilation) (PyTorch's order) or
-- any of them by name: F.conv_transpose2d(x, w, {bias =, stride =, padding =, output_padding =, ...})
-- x (N, Cin, H, W), w (Cin, Cout/groups, kh, kw), b (Cout) or nil
function F.conv_transpose2d(x, w, ...)
  local op = "conv_transpose2d"
  local o = args_of(op, { { "bias", optional = true }, { "stride", 1 }, { "padding", 0 }, { "output_padding", 0 },
    { "groups", 1 }, { "dilation", 1 } }, ...)
  local px, pw, pb = T(x, op, "input"), T(w, op, "weight"), P(o.bias, op, "bias")
  local stride = pair(op, "stride", o.stride, 1)
  local padding = pair(op, "padding", o.padding, 0)
  local output_padding = pair(op, "output_padding", o.output_padding, 0)
  local dilation = pair(op, "dilation", o.dilation, 1)
  local groups = o.groups or 1
  if type(groups) ~= "number" or groups ~= math.floor(groups) or groups < 1 then
    error(("%s: groups must be a positive integer dividing both channel counts, got %s"):format(op, tostring(groups)), 2)
  end
  return (wrap(C.fsdp_conv_transpose2d(px, pw, pb, stride, padding, output_padding, dilation, groups)))
end

-- ---- activations --------------------------------------------------------------------------------------
--- max(x, 0), elementwise.
-- @param x a tensor
function F.relu(x) return (wrap(C.fsdp_relu(T(x, "relu", "input")))) end
--- tanh(x), elementwise.
-- @param x a tensor
function F.tanh(x) return (wrap(C.fsdp_tanh(T(x, "tanh", "input")))) end
--- 1 / (1 + exp(-x)), elementwise.
-- @param x a tensor
function F.sigmoid(x) return (wrap(C.fsdp_sigmoid(T(x, "sigmoid", "input")))) end
--- F.silu(x[, inplace]): x * sigmoid(x) (SiLU, "swish"), elementwise, differentiable through its two
-- ops (in float32 for a 16-bit float x); `inplace` is accepted and changes nothing (as nn.ReLU's).
-- @param x a float tensor
function F.silu(x, ...)
  T(x, "silu", "input")
  local inplace = args_of("silu", { { "inplace", false } }, ...).inplace
  if type(inplace) ~= "boolean" then fsdp._arg_error("silu", "inplace", "a boolean", inplace, 2) end
  if x.dtype == "int64" or x.dtype == "bool" then
    error(("silu: expected a float tensor (float32, bfloat16 or float16), got %s"):format(x.dtype), 2)
  end
  if x.dtype == "float32" then return x * F.sigmoid(x) end
  local y = x:float()  -- (a 16-bit float: computed in float32 and rounded once, as the fused ops are)
  return ((y * F.sigmoid(y)):to(x.dtype))
end
--- F.gelu(x[, {approximate = "none" | "tanh"}]) (a plain string works too)
function F.gelu(x, ...)
  local px = T(x, "gelu", "input")
  local approx = args_of("gelu", { { "approximate", "none" } }, ...).approximate
  if approx ~= "none" and approx ~= "tanh" then
    error(("gelu: approximate must be \"none\" or \"tanh\", got %q"):format(tostring(approx)), 2)
  end
  return (wrap(C.fsdp_gelu(px, approx == "tanh" and 1 or 0)))
end
--- F.softmax(x, dim) or F.softmax(x, {dim =}) (PyTorch's _stacklevel and dtype are not taken)
function F.softmax(x, ...)
  local d = args_of("softmax", { { "dim", optional = true } }, ...).dim
  local px = T(x, "softmax", "input")
  return (wrap(C.fsdp_softmax(px, dim(d, x:dim(), "softmax"))))
end
--- log(softmax(x)) along dim (1-based), computed stably.
-- @param x a tensor
-- @param ... dim or {dim =}
function F.log_softmax(x, ...)
  local d = args_of("log_softmax", { { "dim", optional = true } }, ...).dim
  local px = T(x, "log_softmax", "input")
  return (wrap(C.fsdp_log_softmax(px, dim(d, x:dim(), "log_softmax"))))
end

-- ---- losses (mean reduction) ---------------------------------------------------------------------------
-- logits (N, C) or (N, C, d1, ...), target int64 (N) or (N, d1, ...) with 0-based class indices
-- (PyTorch's positional weight, size_average, ignore_index, reduce, reduction, label_smoothing)
local loss_spec = {
  cross_entropy = { { "weight", optional = true }, { "size_average", optional = true },
    { "ignore_index", -100 }, { "reduce", optional = true }, { "reduction", "mean" }, { "label_smoothing", 0 } },
  nll_loss = { { "weight", optional = true }, { "size_average", optional = true },
    { "ignore_index", -100 }, { "reduce", optional = true }, { "reduction", "mean" } },
  mse_loss = { { "size_average", optional = true }, { "reduce", optional = true }, { "reduction", "mean" } },
}
F._loss_spec = loss_spec
--- Cross entropy of logits (N, C) and class targets (N, int64, 0-based), mean reduction.
-- @param logits (N, C)
-- @param target (N) int64 class indices
-- @param ... options {weight, ignore_index, reduction, label_smoothing}
function F.cross_entropy(logits, target, ...)
  local o = args_of("cross_entropy", loss_spec.cross_entropy, ...)
  check_reduction("cross_entropy", o)
  local ignore = o.ignore_index or -100
  return (wrap(C.fsdp_cross_entropy(T(logits, "cross_entropy", "input"), T(target, "cross_entropy", "target"), ignore, o.label_smoothing or 0)))
end
--- Negative log likelihood of log-probabilities (N, C) and class targets (N, int64, 0-based).
-- @param logp (N, C)
-- @param target (N) int64 class indices
-- @param ... options {weight, ignore_index, reduction}
function F.nll_loss(logp, target, ...)
  local o = args_of("nll_loss", loss_spec.nll_loss, ...)
  check_reduction("nll_loss", o)
  return (wrap(C.fsdp_nll_loss(T(logp, "nll_loss", "input"), T(target, "nll_loss", "target"), o.ignore_index or -100)))
end
--- Mean squared error of a and b.
-- @param a a tensor
-- @param b a tensor of a's shape
-- @param ... options {reduction}
function F.mse_loss(a, b, ...)
  check_reduction("mse_loss", args_of("mse_loss", loss_spec.mse_loss, ...))
  return (wrap(C.fsdp_mse_loss(T(a, "mse_loss", "input"), T(b, "mse_loss", "target"))))
end

-- ---- normalization, embedding, dropout -------------------------------------------------------------------
local shape_str = fsdp._shape_str

-- the number of trailing dims of x that normalized_shape (an int or a table) names, checked
-- (layer_norm, rms_norm); errors at the caller of op
local function normalized_ndim(op, x, normalized_shape)
  local ns = type(normalized_shape) == "number" and { normalized_shape } or normalized_shape
  if type(ns) ~= "table" then error(op .. ": normalized_shape must be an integer or a table of integers", 3) end
  local xs = x:shape()
  local k = #ns
  local ok = k >= 1 and k <= #xs
  for i = 1, k do if not ok or xs[#xs - k + i] ~= ns[i] then ok = false; break end end
  if not ok then
    error(("%s: input of shape %s does not end with normalized_shape %s"):format(op, shape_str(xs), shape_str(ns)), 3)
  end
  return k
end

--- F.layer_norm(x, normalized_shape, w, b, eps): normalizes over the trailing dims given by
-- normalized_shape (an int or a table), w and b of that shape or nil
function F.layer_norm(x, ...)
  local o = args_of("layer_norm", { { "normalized_shape", optional = true, list = true },
    { "weight", optional = true }, { "bias", optional = true }, { "eps", 1e-5 } }, ...)
  local normalized_shape, w, b, eps = o.normalized_shape, o.weight, o.bias, o.eps
  local px, pw, pb = T(x, "layer_norm", "input"), P(w, "layer_norm", "weight"), P(b, "layer_norm", "bias")
  local k = normalized_ndim("layer_norm", x, normalized_shape)
  return (wrap(C.fsdp_layer_norm(px, k, pw, pb, eps or 1e-5)))
end

-- F.batch_norm(x, running_mean, running_var, weight, bias, training = false, momentum = 0.1, eps = 1e-5)
-- (PyTorch's order; keywords in a trailing table): x (N, C, ...); training normalizes with the
-- batch statistics and updates the running ones in place (when given), eval uses them
local function batch_norm(op, cfn, x, ...)
  local o = args_of(op, { { "running_mean", optional = true }, { "running_var", optional = true },
    { "weight", optional = true }, { "bias", optional = true }, { "training", false }, { "momentum", 0.1 },
    { "eps", 1e-5, check = "num>=0" } }, ...)
  local px = T(x, op, "input")
  fsdp._b(o.training, op, "training")
  local momentum = o.momentum
  if momentum == nil then momentum = 0.1 end
  if type(momentum) ~= "number" then error(("%s: momentum must be a number, got %s"):format(op, type(momentum)), 3) end
  return (wrap(cfn(px, P(o.running_mean, op, "running_mean"), P(o.running_var, op, "running_var"),
    P(o.weight, op, "weight"), P(o.bias, op, "bias"), o.training and 1 or 0, momentum, o.eps or 1e-5)))
end
--- Batch normalization: F.batch_norm(x, running_mean, running_var, weight, bias, training, momentum, eps) (PyTorch's arguments).
-- @param x the input (N, C, ...)
-- @param ... PyTorch's other arguments
function F.batch_norm(x, ...) return (batch_norm("batch_norm", C.fsdp_batch_norm, x, ...)) end
--- the same with the global batch's statistics in training: the per-channel sums are all-reduced
-- over every rank (in forward and in backward), as torch.nn.SyncBatchNorm; one rank: batch_norm
function F.sync_batch_norm(x, ...)
  fsdp.world_size()  -- the communicator exists before the op asks it
  return (batch_norm("sync_batch_norm", C.fsdp_sync_batch_norm, x, ...))
end

--- F.group_norm(x, num_groups, weight, bias, eps = 1e-5): x (N, C, ...), C divisible by num_groups
function F.group_norm(x, ...)
  local o = args_of("group_norm", { { "num_groups" }, { "weight", optional = true }, { "bias", optional = true },
    { "eps", 1e-5, check = "num>=0" } }, ...)
  local num_groups = o.num_groups
  local px = T(x, "group_norm", "input")
  if type(num_groups) ~= "number" or num_groups ~= math.floor(num_groups) or num_groups < 1 or num_groups >= 2 ^ 31 then
    error(("group_norm: num_groups must be an integer, got %s"):format(tostring(num_groups)), 2)
  end
  return (wrap(C.fsdp_group_norm(px, num_groups, P(o.weight, "group_norm", "weight"), P(o.bias, "group_norm", "bias"),
    o.eps or 1e-5)))
end

-- PyTorch's default RMSNorm eps: torch.finfo(x.dtype).eps
local finfo_eps = { float32 = 1.1920928955078125e-07, bfloat16 = 0.0078125, float16 = 0.0009765625 }
F._finfo_eps = finfo_eps
--- F.rms_norm(x, normalized_shape, weight, eps = finfo(x.dtype).eps): x / sqrt(mean(x^2) + eps) * weight
-- over the trailing dims given by normalized_shape (an int or a table)
function F.rms_norm(x, ...)
  local o = args_of("rms_norm", { { "normalized_shape", list = true }, { "weight", optional = true },
    { "eps", optional = true, check = "num>=0" } }, ...)
  local normalized_shape = o.normalized_shape
  local px, pw = T(x, "rms_norm", "input"), P(o.weight, "rms_norm", "weight")
  local k = normalized_ndim("rms_norm", x, normalized_shape)
  return (wrap(C.fsdp_rms_norm(px, k, pw, o.eps or finfo_eps[x.dtype] or finfo_eps.float32)))
end

--- F.embedding(idx, weight[, padding_idx | {padding_idx =}]): rows of weight (V, D) at the int64
-- indices idx (any shape) -> (idx..., D). The padding row gets no gradient.
function F.embedding(idx, weight, ...)
  local pi, pw = T(idx, "embedding", "input"), T(weight, "embedding", "weight")
  local pad = args_of("embedding", { { "padding_idx", optional = true } }, ...).padding_idx
  local V = weight:size(1)
  if pad == nil then
    pad = -1
  else
    if type(pad) ~= "number" or pad ~= math.floor(pad) then
      error(("embedding: padding_idx must be an integer (0-based, negative from the end), got %s"):format(tostring(pad)), 2)
    end
    local given = pad
    if pad < 0 then pad = pad + V end
    if pad < 0 or pad >= V then
      error(("embedding: padding_idx %d out of range for %d embeddings"):format(given, V), 2)
    end
  end
  return (wrap(C.fsdp_embedding(pw, pi, pad)))
end

--- F.dropout(x, p = 0.5, training = true, inplace = false) (inplace: accepted, see nn.ReLU)
function F.dropout(x, ...)
  local px = T(x, "dropout", "input")
  local o = args_of("dropout", { { "p", 0.5 }, { "training", true }, { "inplace", false } }, ...)
  local p, training = o.p, o.training
  if type(p) ~= "number" then fsdp._arg_error("dropout", "p", "a number", p, 2) end
  if not (p >= 0 and p <= 1) then error(("dropout: probability has to be between 0 and 1, got %s"):format(tostring(p)), 2) end
  return (wrap(C.fsdp_dropout(px, p, training == false and 0 or 1)))
end

--- F.dropout2d(x, p = 0.5, training = true): whole channels of x (N, C, H, W) or (C, H, W) zeroed
-- with probability p, the others scaled by 1 / (1 - p); the mask comes from fsdp's seeded RNG
function F.dropout2d(x, ...)
  local px = T(x, "dropout2d", "input")
  local o = args_of("dropout2d", { { "p", 0.5 }, { "training", true }, { "inplace", false } }, ...)
  local p, training = o.p, o.training
  if type(p) ~= "number" or not (p >= 0 and p <= 1) then
    error(("dropout2d: probability has to be between 0 and 1, got %s"):format(tostring(p)), 2)
  end
  return (wrap(C.fsdp_dropout2d(px, p, training == false and 0 or 1)))
end

-- ---- pooling and shape ------------------------------------------------------------------------------------
--- F.max_pool2d(x, kernel_size, stride = kernel_size, padding = 0, dilation = 1, ceil_mode = false)
function F.max_pool2d(x, ...)
  local px = T(x, "max_pool2d", "input")
  local o = args_of("max_pool2d", { { "kernel_size", optional = true, list = true }, { "stride", optional = true },
    { "padding", 0 }, { "dilation", 1 }, { "ceil_mode", false }, { "return_indices", false } }, ...)
  if o.return_indices then error("max_pool2d: return_indices is not supported", 2) end
  local kernel_size = o.kernel_size
  local k = pair("max_pool2d", "kernel_size", kernel_size)
  local s = pair("max_pool2d", "stride", o.stride or kernel_size)
  local p = pair("max_pool2d", "padding", o.padding, 0)
  local d = pair("max_pool2d", "dilation", o.dilation, 1)
  return (wrap(C.fsdp_max_pool2d(px, k, s, p, d, o.ceil_mode and 1 or 0)))
end

--- F.avg_pool2d(x, kernel_size, stride = kernel_size, padding = 0, ceil_mode = false,
--              count_include_pad = true)
function F.avg_pool2d(x, ...)
  local px = T(x, "avg_pool2d", "input")
  local o = args_of("avg_pool2d", { { "kernel_size", optional = true, list = true }, { "stride", optional = true },
    { "padding", 0 }, { "ceil_mode", false }, { "count_include_pad", true }, { "divisor_override", optional = true } }, ...)
  local kernel_size = o.kernel_size
  if o.divisor_override ~= nil then error("avg_pool2d: divisor_override is not supported", 2) end
  local k = pair("avg_pool2d", "kernel_size", kernel_size)
  local s = pair("avg_pool2d", "stride", o.stride or kernel_size)
  local p = pair("avg_pool2d", "padding", o.padding, 0)
  return (wrap(C.fsdp_avg_pool2d(px, k, s, p, o.ceil_mode and 1 or 0, o.count_include_pad == false and 0 or 1)))
end

--- output_size: an int or {h, w}
function F.adaptive_avg_pool2d(x, ...)
  local output_size = args_of("adaptive_avg_pool2d", { { "output_size", optional = true, list = true } }, ...).output_size
  local px = T(x, "adaptive_avg_pool2d", "input")
  local _, hw = pair("adaptive_avg_pool2d", "output_size", output_size)
  return (wrap(C.fsdp_adaptive_avg_pool2d(px, hw[1], hw[2])))
end

--- torch.flatten defaults: start_dim = 1, end_dim = -1 (Lua dims)
function F.flatten(x, ...)
  local o = args_of("flatten", { { "start_dim", 1 }, { "end_dim", -1 } }, ...)
  local start_dim, end_dim = o.start_dim, o.end_dim
  local px = T(x, "flatten", "input")
  local nd = x:dim()
  return (wrap(C.fsdp_flatten(px, dim(start_dim or 1, nd, "flatten"), dim(end_dim or -1, nd, "flatten"))))
end

-- ---- attention --------------------------------------------------------------------------------------------
--- F.scaled_dot_product_attention(q, k, v[, {attn_mask =, is_causal = (or causal =), dropout_p =, scale =}])
-- q (B.., Tq, D), k (B.., Tk, D), v (B.., Tk, Dv); attn_mask broadcastable to (Tq, Tk): an
-- additive float mask, or a bool mask (true: the key takes part, PyTorch's meaning; false: -inf). Positional (q, k, v, attn_mask, dropout_p, is_causal, scale) works as in PyTorch.
-- q, k, v are read in place when their last dim is dense (heads cut from one projection with
-- narrow/reshape/transpose need no copy), and the output is laid out in memory like q: for heads
-- (B, H, T, D) stored as (B, T, H, D), out:transpose(2, 3):reshape(B, T, H * D) is a view.
function F.scaled_dot_product_attention(q, k, v, ...)
  local sdpa = "scaled_dot_product_attention"
  local pq, pk, pv = T(q, sdpa, "query"), T(k, sdpa, "key"), T(v, sdpa, "value")
  local o = args_of(sdpa, { { "attn_mask", optional = true }, { "dropout_p", 0 },
    { "is_causal", false }, { "scale", optional = true }, { "causal", false, kw = true }, { "enable_gqa", false, kw = true } }, ...)
  if o.enable_gqa then error(sdpa .. ": enable_gqa is not supported", 2) end
  local causal = o.is_causal or o.causal
  local mask = o.attn_mask
  if fsdp.is_tensor(mask) and mask.dtype == "bool" then
    P(mask, sdpa, "attn_mask")
    mask = fsdp.zeros(mask:shape(), { dtype = q.dtype, device = mask.device }):masked_fill(mask:eq(0), -math.huge)
  end
  return (wrap(C.fsdp_scaled_dot_product_attention(pq, pk, pv, P(mask, sdpa, "attn_mask (a float or bool mask)"), causal and 1 or 0,
    o.dropout_p or 0, o.scale or 0)))
end

return F
