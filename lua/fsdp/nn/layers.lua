--- The standard layers: PyTorch's positional constructor arguments, keyword options in a trailing
-- table that may name the positional ones too (fsdp.args: nn.Linear({in_features = 4, out_features
-- = 8})), PyTorch's default initialization, PyTorch's parameter names and shapes.
-- @module fsdp.nn
local fsdp = require "fsdp"
local Module = require "fsdp.nn.module"
local F = require "fsdp.nn.functional"
local init = require "fsdp.nn.init_fns"

local Parameter, is_module = Module.Parameter, Module.is_module
local args_of = F._args
local L = {}

local function check_int(cls, what, v, min)
  if type(v) ~= "number" or v ~= math.floor(v) or v < (min or 1) or v >= 2 ^ 53 then
    error(("%s: %s must be an integer >= %d, got %s"):format(cls, what, min or 1, tostring(v)), 4)
  end
  return v
end
local function pair_of(v)
  if type(v) == "table" then return { v[1], v[2] } end
  return { v, v }
end
-- a kernel, stride or output size: an integer >= 1 or a pair of them
local function check_size(cls, what, v)
  if type(v) == "table" and #v == 2 then
    check_int(cls, what, v[1])
    check_int(cls, what, v[2])
  elseif type(v) ~= "number" then
    error(("%s: %s must be an integer or a pair {h, w}, got %s"):format(cls, what, type(v)), 4)
  else
    check_int(cls, what, v)
  end
  return v
end
local function pair_str(p) return ("(%s, %s)"):format(tostring(p[1]), tostring(p[2])) end
local function pybool(b) return b and "True" or "False" end

-- Each layer with parameters has reset_parameters(), PyTorch's: it (re)initialises the layer's own
-- parameters (and running statistics) in place, and its constructor ends with it. So a model built
-- inside fsdp.meta records the same initialisation an eager one runs, and fsdp.reset_parameters(model)
-- draws afresh over a built, moved or wrapped model.

-- t ~ U(-1/sqrt(fan_in), 1/sqrt(fan_in)) in place: PyTorch's kaiming_uniform_(a = sqrt(5)) for
-- weights and the matching bias init
local function uniform_fan_in_(t, fan_in)
  local bound = fan_in > 0 and 1 / math.sqrt(fan_in) or 0
  return init.uniform_(t, -bound, bound)
end

-- ---- Linear -----------------------------------------------------------------------------------------
-- nn.Linear(in_features, out_features[, {bias = true}]): weight (out, in), bias (out)
local Linear = Module:extend("Linear")
L.Linear = Linear
--- nn.Linear(in_features, out_features[, {bias = true}]): y = x W^T + b, weight (out, in), bias (out).
-- @function Linear
function Linear:__init(...)
  local o = args_of("Linear", { { "in_features" }, { "out_features" }, { "bias", true } }, ...)
  local in_features, out_features = o.in_features, o.out_features
  self.in_features = check_int("Linear", "in_features", in_features, 0)
  self.out_features = check_int("Linear", "out_features", out_features, 0)
  self.weight = Parameter(fsdp.empty(out_features, in_features))
  if o.bias ~= false then
    self.bias = Parameter(fsdp.empty(out_features))
  else
    self:register_parameter("bias", nil)
  end
  self:reset_parameters()
end
function Linear:reset_parameters()
  uniform_fan_in_(self.weight, self.in_features)
  if self.bias ~= nil then uniform_fan_in_(self.bias, self.in_features) end
end
function Linear:forward(x) return (F.linear(x, self.weight, self.bias)) end
function Linear:extra_repr()
  return ("in_features=%d, out_features=%d, bias=%s"):format(self.in_features, self.out_features, pybool(self.bias ~= nil))
end

-- a convolution's weight (wshape) and bias (cout, unless bias == false), PyTorch's uniform init
-- from fan_in = wshape's dim 2 times the kernel (for Conv2d cin/groups, for ConvTranspose2d cout/groups)
local function conv_reset_parameters(self)
  local w = self.weight:shape()
  local fan_in = w[2] * w[3] * w[4]
  uniform_fan_in_(self.weight, fan_in)
  if self.bias ~= nil then uniform_fan_in_(self.bias, fan_in) end
end
local function conv_params(self, wshape, cout, bias)
  self.weight = Parameter(fsdp.empty(wshape))
  if bias ~= false then
    self.bias = Parameter(fsdp.empty(cout))
  else
    self:register_parameter("bias", nil)
  end
  conv_reset_parameters(self)
end

-- ---- Conv2d -------------------------------------------------------------------------------------------
-- nn.Conv2d(in_channels, out_channels, kernel_size[, stride, padding, dilation, groups, bias]) or
-- nn.Conv2d(cin, cout, k, {stride =, padding =, dilation =, groups =, bias =}); sizes are ints or
-- {h, w}; padding may also be "valid" or "same". weight (cout, cin/groups, kh, kw), bias (cout)
local Conv2d = Module:extend("Conv2d")
L.Conv2d = Conv2d
--- nn.Conv2d(in_channels, out_channels, kernel_size[, {stride, padding, dilation, groups, bias}]): a 2-D convolution, weight (out, in/groups, kh, kw).
-- @function Conv2d
function Conv2d:__init(...)
  local o = args_of("Conv2d", { { "in_channels" }, { "out_channels" }, { "kernel_size", list = true }, { "stride", 1 },
    { "padding", 0 }, { "dilation", 1 }, { "groups", 1 }, { "bias", true }, { "padding_mode", "zeros" } }, ...)
  local in_channels, out_channels, kernel_size = o.in_channels, o.out_channels, o.kernel_size
  check_int("Conv2d", "in_channels", in_channels)
  check_int("Conv2d", "out_channels", out_channels)
  local groups = check_int("Conv2d", "groups", o.groups or 1)
  if in_channels % groups ~= 0 or out_channels % groups ~= 0 then
    error(("Conv2d: in_channels (%d) and out_channels (%d) must be divisible by groups (%d)")
      :format(in_channels, out_channels, groups), 2)
  end
  if o.padding_mode ~= nil and o.padding_mode ~= "zeros" then
    error(("Conv2d: only padding_mode = \"zeros\" is supported, got %q"):format(tostring(o.padding_mode)), 2)
  end
  self.in_channels, self.out_channels, self.groups = in_channels, out_channels, groups
  self.kernel_size = pair_of(kernel_size)
  self.stride = pair_of(o.stride or 1)
  self.padding = type(o.padding) == "string" and o.padding or pair_of(o.padding or 0)
  self.dilation = pair_of(o.dilation or 1)
  for i = 1, 2 do
    check_int("Conv2d", "stride", self.stride[i], 1)
    check_int("Conv2d", "dilation", self.dilation[i], 1)
    if type(self.padding) == "table" then check_int("Conv2d", "padding", self.padding[i], 0) end
  end
  if type(self.padding) == "string" and self.padding ~= "same" and self.padding ~= "valid" then
    error(("Conv2d: padding must be an integer, a pair, \"same\" or \"valid\", got %q"):format(self.padding), 2)
  end
  local kh, kw = self.kernel_size[1], self.kernel_size[2]
  check_int("Conv2d", "kernel_size", kh); check_int("Conv2d", "kernel_size", kw)
  conv_params(self, { out_channels, in_channels / groups, kh, kw }, out_channels, o.bias)
end
function Conv2d:forward(x)
  return (F.conv2d(x, self.weight, self.bias, { stride = self.stride, padding = self.padding,
    dilation = self.dilation, groups = self.groups }))
end
function Conv2d:extra_repr()
  local s = ("%d, %d, kernel_size=%s, stride=%s"):format(self.in_channels, self.out_channels,
    pair_str(self.kernel_size), pair_str(self.stride))
  local p = self.padding
  if type(p) == "string" then s = s .. ", padding=" .. p
  elseif p[1] ~= 0 or p[2] ~= 0 then s = s .. ", padding=" .. pair_str(p) end
  if self.dilation[1] ~= 1 or self.dilation[2] ~= 1 then s = s .. ", dilation=" .. pair_str(self.dilation) end
  if self.groups ~= 1 then s = s .. ", groups=" .. self.groups end
  if self.bias == nil then s = s .. ", bias=False" end
  return s
end

-- ---- ConvTranspose2d ------------------------------------------------------------------------------------
-- nn.ConvTranspose2d(in_channels, out_channels, kernel_size[, stride, padding, output_padding, groups,
-- bias, dilation]) or nn.ConvTranspose2d(cin, cout, k, {stride =, padding =, output_padding =, groups =,
-- bias =, dilation =}); sizes are ints or {h, w}. weight (cin, cout/groups, kh, kw), bias (cout);
-- output size (H - 1)*stride - 2*padding + dilation*(k - 1) + output_padding + 1
Conv2d.reset_parameters = conv_reset_parameters
local ConvTranspose2d = Module:extend("ConvTranspose2d")
ConvTranspose2d.reset_parameters = conv_reset_parameters
L.ConvTranspose2d = ConvTranspose2d
--- nn.ConvTranspose2d(in_channels, out_channels, kernel_size[, {stride, padding, output_padding, groups, bias, dilation}]): a transposed 2-D convolution, weight (in, out/groups, kh, kw).
-- @function ConvTranspose2d
function ConvTranspose2d:__init(...)
  local cls = "ConvTranspose2d"
  local o = args_of(cls, { { "in_channels" }, { "out_channels" }, { "kernel_size", list = true }, { "stride", 1 },
    { "padding", 0 }, { "output_padding", 0 }, { "groups", 1 }, { "bias", true }, { "dilation", 1 },
    { "padding_mode", "zeros" } }, ...)
  local in_channels, out_channels, kernel_size = o.in_channels, o.out_channels, o.kernel_size
  check_int(cls, "in_channels", in_channels)
  check_int(cls, "out_channels", out_channels)
  local groups = check_int(cls, "groups", o.groups or 1)
  if in_channels % groups ~= 0 or out_channels % groups ~= 0 then
    error(("%s: in_channels (%d) and out_channels (%d) must be divisible by groups (%d)")
      :format(cls, in_channels, out_channels, groups), 2)
  end
  if o.padding_mode ~= nil and o.padding_mode ~= "zeros" then
    error(("%s: only padding_mode = \"zeros\" is supported, got %q"):format(cls, tostring(o.padding_mode)), 2)
  end
  self.in_channels, self.out_channels, self.groups = in_channels, out_channels, groups
  self.kernel_size = pair_of(check_size(cls, "kernel_size", kernel_size))
  self.stride = pair_of(check_size(cls, "stride", o.stride or 1))
  self.padding = pair_of(o.padding or 0)
  self.output_padding = pair_of(o.output_padding or 0)
  self.dilation = pair_of(check_size(cls, "dilation", o.dilation or 1))
  for i = 1, 2 do
    check_int(cls, "padding", self.padding[i], 0)
    check_int(cls, "output_padding", self.output_padding[i], 0)
    local op, s, d = self.output_padding[i], self.stride[i], self.dilation[i]
    if op >= s and op >= d then
      error(("%s: output_padding %s must be smaller than either stride %s or dilation %s"):format(cls,
        pair_str(self.output_padding), pair_str(self.stride), pair_str(self.dilation)), 2)
    end
  end
  local kh, kw = self.kernel_size[1], self.kernel_size[2]
  conv_params(self, { in_channels, out_channels / groups, kh, kw }, out_channels, o.bias)
end
-- forward(x[, output_size]): output_size {h, w} (or {N, C, h, w}) picks the output_padding that
-- reaches it, as PyTorch's does; it must lie within stride - 1 of the smallest output
function ConvTranspose2d:output_padding_for(x, output_size)
  if output_size == nil then return self.output_padding end
  local cls = "ConvTranspose2d"
  local n = type(output_size) == "table" and #output_size or 0
  if n ~= 2 and n ~= 4 then
    error(("%s: output_size must be {h, w} or {N, C, h, w}, got %s"):format(cls, tostring(output_size)), 3)
  end
  local want, min, max = { output_size[n - 1], output_size[n] }, {}, {}
  for i = 1, 2 do
    local k, s, p, d = self.kernel_size[i], self.stride[i], self.padding[i], self.dilation[i]
    min[i] = (x:size(-3 + i) - 1) * s - 2 * p + d * (k - 1) + 1
    max[i] = min[i] + s - 1
  end
  for i = 1, 2 do
    if type(want[i]) ~= "number" or want[i] < min[i] or want[i] > max[i] then
      error(("%s: requested an output size of %s, but valid sizes range from %s to %s (for an input of %s)")
        :format(cls, pair_str(want), pair_str(min), pair_str(max), "(" .. table.concat(x:shape(), ", ") .. ")"), 3)
    end
  end
  return { want[1] - min[1], want[2] - min[2] }
end
function ConvTranspose2d:forward(x, output_size)
  local output_padding = self:output_padding_for(x, output_size)
  return (F.conv_transpose2d(x, self.weight, self.bias, { stride = self.stride, padding = self.padding,
    output_padding = output_padding, groups = self.groups, dilation = self.dilation }))
end
function ConvTranspose2d:extra_repr()
  local s = ("%d, %d, kernel_size=%s, stride=%s"):format(self.in_channels, self.out_channels,
    pair_str(self.kernel_size), pair_str(self.stride))
  local p, op = self.padding, self.output_padding
  if p[1] ~= 0 or p[2] ~= 0 then s = s .. ", padding=" .. pair_str(p) end
  if op[1] ~= 0 or op[2] ~= 0 then s = s .. ", output_padding=" .. pair_str(op) end
  if self.dilation[1] ~= 1 or self.dilation[2] ~= 1 then s = s .. ", dilation=" .. pair_str(self.dilation) end
  if self.groups ~= 1 then s = s .. ", groups=" .. self.groups end
  if self.bias == nil then s = s .. ", bias=False" end
  return s
end

-- ---- activations and other parameter-free layers -----------------------------------------------------------
-- spec: the constructor's arguments (fsdp.args); `inplace` is accepted and changes nothing (docs/api.md:
-- autograd here never needs the memory an in-place activation saves, and the results are the same)
local function simple(name, fn, spec)
  local cls = Module:extend(name)
  cls.forward = function(_, x) return (fn(x)) end
  if spec then
    cls.__init = function(self, ...)
      local inplace = args_of(name, spec, ...).inplace
      if inplace ~= nil and type(inplace) ~= "boolean" then fsdp._arg_error(name, "inplace", "a boolean", inplace, 3) end
      self.inplace = inplace
    end
    cls.extra_repr = function(self) return self.inplace and "inplace=True" or "" end
  end
  L[name] = cls
  return cls
end
--- nn.ReLU([inplace]): max(x, 0).
-- @function ReLU
-- @param inplace accepted, changes nothing

--- nn.Tanh(): tanh(x).
-- @function Tanh

--- nn.SiLU([inplace]): x * sigmoid(x) (F.silu).
-- @function SiLU
-- @param inplace accepted, changes nothing

--- nn.Sigmoid(): 1 / (1 + exp(-x)).
-- @function Sigmoid

--- nn.Identity(...): returns its input; any arguments, unused (as PyTorch's).
-- @function Identity

simple("ReLU", F.relu, { { "inplace", false } })
simple("Tanh", F.tanh, {})
simple("Sigmoid", F.sigmoid, {})
simple("SiLU", F.silu, { { "inplace", false } })
-- nn.Identity(...): any arguments, unused (as PyTorch's)
simple("Identity", function(x) return x end)

local GELU = Module:extend("GELU")
L.GELU = GELU
--- nn.GELU([approximate]): the GELU activation, approximate "none" (default) or "tanh".
-- @function GELU
function GELU:__init(...)
  local o = args_of("GELU", { { "approximate", "none" } }, ...)
  self.approximate = o.approximate
  if self.approximate ~= "none" and self.approximate ~= "tanh" then
    error(("GELU: approximate must be \"none\" or \"tanh\", got %q"):format(tostring(self.approximate)), 2)
  end
end
function GELU:forward(x) return (F.gelu(x, self.approximate)) end
function GELU:extra_repr() return ("approximate='%s'"):format(self.approximate) end

--- nn.Softmax(dim): F.softmax along dim (1-based).
-- @function Softmax
-- @param dim a dim

--- nn.LogSoftmax(dim): F.log_softmax along dim (1-based).
-- @function LogSoftmax
-- @param dim a dim

-- nn.Softmax(dim), nn.LogSoftmax(dim): dim is 1-based
for _, name in ipairs { "Softmax", "LogSoftmax" } do
  local cls = Module:extend(name)
  local fn = name == "Softmax" and F.softmax or F.log_softmax
  function cls:__init(...)
    local d = args_of(name, { { "dim", optional = true } }, ...).dim
    if d == nil then error(name .. ": dim is required (1-based, negative from the end)", 3) end
    if type(d) ~= "number" or d ~= math.floor(d) or d == 0 or math.abs(d) > 2 ^ 31 then
      error(("%s: dim must be a non-zero integer (1-based, negative from the end), got %s"):format(name,
        type(d) == "number" and tostring(d) or type(d)), 3)
    end
    self.dim = d
  end
  function cls:forward(x) return (fn(x, self.dim)) end
  function cls:extra_repr() return "dim=" .. self.dim end
  L[name] = cls
end

-- nn.Flatten({start_dim = 2, end_dim = -1}) (Lua dims: PyTorch's default start_dim=1 is Lua's 2)
local Flatten = Module:extend("Flatten")
L.Flatten = Flatten
--- nn.Flatten([{start_dim = 2, end_dim = -1}]): flattens dims start_dim..end_dim (1-based).
-- @function Flatten
function Flatten:__init(...)
  local o = args_of("Flatten", { { "start_dim", optional = true }, { "end_dim", optional = true } }, ...)
  self.start_dim, self.end_dim = o.start_dim or 2, o.end_dim or -1
end
function Flatten:forward(x) return (F.flatten(x, self.start_dim, self.end_dim)) end
function Flatten:extra_repr() return ("start_dim=%d, end_dim=%d"):format(self.start_dim, self.end_dim) end

--- nn.Dropout([p = 0.5[, inplace]]): zeroes elements with probability p in training mode, scales the others by 1 / (1 - p).
-- @function Dropout
-- @param p a probability

--- nn.Dropout2d([p = 0.5[, inplace]]): zeroes whole channels with probability p in training mode.
-- @function Dropout2d
-- @param p a probability

-- nn.Dropout(p = 0.5) and nn.Dropout2d(p = 0.5) (whole channels of (N, C, H, W) or (C, H, W)):
-- active in training mode only; one constructor (PyTorch's _DropoutNd)
local function dropout_init(self, ...)
  local cls = self.__name
  local o = args_of(cls, { { "p", optional = true }, { "inplace", false } }, ...)
  local p = o.p or 0.5
  if type(p) ~= "number" then
    error(("%s: p must be a number, got %s (%s)"):format(cls, type(p), tostring(p)), 2)
  end
  if not (p >= 0 and p <= 1) then  -- (NaN too)
    error(("%s: probability has to be between 0 and 1, got %s"):format(cls, tostring(p)), 2)
  end
  if type(o.inplace) ~= "boolean" then fsdp._arg_error(cls, "inplace", "a boolean", o.inplace, 2) end
  self.p, self.inplace = p, o.inplace
end
local function dropout_repr(self) return ("p=%s, inplace=%s"):format(tostring(self.p), pybool(self.inplace)) end

local Dropout = Module:extend("Dropout")
L.Dropout = Dropout
Dropout.__init, Dropout.extra_repr = dropout_init, dropout_repr
function Dropout:forward(x) return (F.dropout(x, self.p, self.training)) end

local Dropout2d = Module:extend("Dropout2d")
L.Dropout2d = Dropout2d
Dropout2d.__init, Dropout2d.extra_repr = dropout_init, dropout_repr
function Dropout2d:forward(x) return (F.dropout2d(x, self.p, self.training)) end

-- ---- pooling ---------------------------------------------------------------------------------------------------
-- nn.MaxPool2d(kernel_size[, stride = kernel_size, padding = 0, dilation = 1, return_indices, ceil_mode])
local MaxPool2d = Module:extend("MaxPool2d")
L.MaxPool2d = MaxPool2d
--- nn.MaxPool2d(kernel_size[, stride[, padding]]): 2-D max pooling (options as F.max_pool2d).
-- @function MaxPool2d
function MaxPool2d:__init(...)
  local o = args_of("MaxPool2d", { { "kernel_size", list = true }, { "stride", optional = true },
    { "padding", optional = true }, { "dilation", optional = true }, { "return_indices", false }, { "ceil_mode", false } }, ...)
  local kernel_size = o.kernel_size
  if o.return_indices then error("MaxPool2d: return_indices is not supported", 2) end
  check_size("MaxPool2d", "kernel_size", kernel_size)
  self.kernel_size, self.stride = kernel_size, o.stride or kernel_size
  self.padding, self.dilation, self.ceil_mode = o.padding or 0, o.dilation or 1, o.ceil_mode and true or false
end
function MaxPool2d:forward(x)
  return (F.max_pool2d(x, self.kernel_size, self.stride, self.padding, self.dilation, self.ceil_mode))
end
local function size_str(v) return type(v) == "table" and pair_str(v) or tostring(v) end
function MaxPool2d:extra_repr()
  return ("kernel_size=%s, stride=%s, padding=%s, dilation=%s, ceil_mode=%s"):format(size_str(self.kernel_size),
    size_str(self.stride), size_str(self.padding), size_str(self.dilation), pybool(self.ceil_mode))
end

-- nn.AvgPool2d(kernel_size[, stride = kernel_size, padding = 0, ceil_mode = false, count_include_pad = true])
local AvgPool2d = Module:extend("AvgPool2d")
L.AvgPool2d = AvgPool2d
--- nn.AvgPool2d(kernel_size[, stride[, padding]]): 2-D average pooling (options as F.avg_pool2d).
-- @function AvgPool2d
function AvgPool2d:__init(...)
  local o = args_of("AvgPool2d", { { "kernel_size", list = true }, { "stride", optional = true }, { "padding", optional = true },
    { "ceil_mode", false }, { "count_include_pad", true }, { "divisor_override", optional = true } }, ...)
  local kernel_size = o.kernel_size
  if o.divisor_override ~= nil then error("AvgPool2d: divisor_override is not supported", 2) end
  check_size("AvgPool2d", "kernel_size", kernel_size)
  self.kernel_size, self.stride, self.padding = kernel_size, o.stride or kernel_size, o.padding or 0
  self.ceil_mode, self.count_include_pad = o.ceil_mode and true or false, o.count_include_pad ~= false
end
function AvgPool2d:forward(x)
  return (F.avg_pool2d(x, self.kernel_size, self.stride, self.padding, self.ceil_mode, self.count_include_pad))
end
function AvgPool2d:extra_repr()
  return ("kernel_size=%s, stride=%s, padding=%s"):format(size_str(self.kernel_size), size_str(self.stride),
    size_str(self.padding))
end

-- nn.AdaptiveAvgPool2d(output_size): an int or {h, w}
local AdaptiveAvgPool2d = Module:extend("AdaptiveAvgPool2d")
L.AdaptiveAvgPool2d = AdaptiveAvgPool2d
--- nn.AdaptiveAvgPool2d(output_size): average pooling to a fixed output size (an int or {h, w}).
-- @function AdaptiveAvgPool2d
function AdaptiveAvgPool2d:__init(...)
  local output_size = args_of("AdaptiveAvgPool2d", { { "output_size", list = true } }, ...).output_size
  self.output_size = check_size("AdaptiveAvgPool2d", "output_size", output_size)
end
function AdaptiveAvgPool2d:forward(x) return (F.adaptive_avg_pool2d(x, self.output_size)) end
function AdaptiveAvgPool2d:extra_repr() return "output_size=" .. size_str(self.output_size) end

-- ---- normalization and embedding ----------------------------------------------------------------------------------
-- nn.LayerNorm(normalized_shape[, {eps = 1e-5, elementwise_affine = true, bias = true}])
local LayerNorm = Module:extend("LayerNorm")
L.LayerNorm = LayerNorm
--- nn.LayerNorm(normalized_shape[, {eps = 1e-5, elementwise_affine = true, bias = true}]): layer normalization over the trailing dims.
-- @function LayerNorm
function LayerNorm:__init(...)
  local o = args_of("LayerNorm", { { "normalized_shape", list = true }, { "eps", 1e-5 }, { "elementwise_affine", true },
    { "bias", true } }, ...)
  local normalized_shape = o.normalized_shape
  local ns = type(normalized_shape) == "number" and { normalized_shape } or normalized_shape
  if type(ns) ~= "table" or #ns == 0 then error("LayerNorm: normalized_shape must be an integer or a table of integers", 2) end
  for _, v in ipairs(ns) do check_int("LayerNorm", "normalized_shape", v) end
  self.normalized_shape = ns
  self.eps = o.eps or 1e-5
  self.elementwise_affine = o.elementwise_affine ~= false
  if self.elementwise_affine then
    self.weight = Parameter(fsdp.ones(ns))
    if o.bias ~= false then self.bias = Parameter(fsdp.zeros(ns)) else self:register_parameter("bias", nil) end
  else
    self:register_parameter("weight", nil)
    self:register_parameter("bias", nil)
  end
end
-- (the norms: weight 1, bias 0)
local function ones_zeros_reset(self)
  if self.weight ~= nil then init.ones_(self.weight) end
  if self.bias ~= nil then init.zeros_(self.bias) end
end
LayerNorm.reset_parameters = ones_zeros_reset
function LayerNorm:forward(x) return (F.layer_norm(x, self.normalized_shape, self.weight, self.bias, self.eps)) end
function LayerNorm:extra_repr()
  local ns = self.normalized_shape
  return ("(%s%s), eps=%s, elementwise_affine=%s"):format(table.concat(ns, ", "), #ns == 1 and "," or "",
    tostring(self.eps), pybool(self.elementwise_affine))
end

-- nn.BatchNorm1d/2d(num_features[, {eps = 1e-5, momentum = 0.1, affine = true, track_running_stats = true}]):
-- weight (C) = 1, bias (C) = 0; buffers running_mean (C) = 0, running_var (C) = 1 and
-- num_batches_tracked (int64, 0-dim), PyTorch's names. Training (model:train()) normalizes with the
-- batch statistics and updates the running ones (momentum = false/nil in the options table: the
-- cumulative average, PyTorch's momentum=None); eval (model:eval()) uses the running statistics.
local norm_spec = { { "num_features" }, { "eps", 1e-5 }, { "momentum", 0.1 }, { "affine", true },
  { "track_running_stats", true } }
local BatchNorm = Module:extend("_BatchNorm")
L._BatchNorm = BatchNorm
--- nn._BatchNorm(num_features[, options]): the batch-norm base class (options as BatchNorm1d's).
-- @function _BatchNorm
function BatchNorm:__init(...)
  local cls = self.__name
  local o = args_of(cls, norm_spec, ...)
  local num_features = o.num_features
  self.num_features = check_int(cls, "num_features", num_features)
  self.eps = o.eps or 1e-5
  -- PyTorch's momentum=None (a cumulative average) is spelled momentum = false (a nil key is absent)
  if o.momentum == false then self.momentum = nil else self.momentum = o.momentum or 0.1 end
  if self.momentum ~= nil and type(self.momentum) ~= "number" then
    error(("%s: momentum must be a number or false, got %s"):format(cls, type(self.momentum)), 2)
  end
  self.affine = o.affine ~= false
  self.track_running_stats = o.track_running_stats ~= false
  if self.affine then
    self.weight = Parameter(fsdp.ones(num_features))
    self.bias = Parameter(fsdp.zeros(num_features))
  else
    self:register_parameter("weight", nil)
    self:register_parameter("bias", nil)
  end
  if self.track_running_stats then
    self:register_buffer("running_mean", fsdp.zeros(num_features))
    self:register_buffer("running_var", fsdp.ones(num_features))
    self:register_buffer("num_batches_tracked", fsdp.tensor(0, "int64"))
  else
    self:register_buffer("running_mean", nil)
    self:register_buffer("running_var", nil)
    self:register_buffer("num_batches_tracked", nil)
  end
end
-- the running statistics back to mean 0, variance 1, no batches (PyTorch's reset_running_stats)
function BatchNorm:reset_running_stats()
  if self.running_mean == nil then return end
  init.zeros_(self.running_mean)
  init.ones_(self.running_var)
  fsdp.no_grad(function() self.num_batches_tracked:zero_() end)
end
function BatchNorm:reset_parameters()
  self:reset_running_stats()
  ones_zeros_reset(self)
end
-- the input's dims this class accepts (nil: any with a channel dim)
BatchNorm._dims = nil
function BatchNorm:_check_input(x)
  local nd = fsdp.is_tensor(x) and #x:shape() or nil
  local ok = self._dims == nil or nd == nil
  for _, d in ipairs(self._dims or {}) do ok = ok or nd == d end
  if not ok then
    local want = {}
    for _, d in ipairs(self._dims) do want[#want + 1] = d .. "D" end
    error(("%s: expected %s input, got %dD input of shape (%s)"):format(self.__name, table.concat(want, " or "), nd,
      table.concat(x:shape(), ", ")), 3)
  end
end
-- the momentum of this step (PyTorch's exponential_average_factor), counting the batch. The count
-- is remembered with the buffer's version, so it is read back (a device wait on a GPU) only after
-- someone else wrote the buffer (load_state_dict, a checkpoint)
function BatchNorm:_step_momentum()
  local m = self.momentum or 0.0
  local use_batch = self.training or not self.track_running_stats
  local nbt = self.num_batches_tracked
  if self.training and self.track_running_stats and nbt ~= nil then
    local seen = rawget(self, "_nbt_seen")
    local n = (seen and seen.t == nbt and seen.version == nbt:version()) and seen.n or nbt:item()
    n = n + 1
    fsdp.no_grad(function() nbt:fill_(n) end)
    rawset(self, "_nbt_seen", { t = nbt, n = n, version = nbt:version() })
    if self.momentum == nil then m = 1.0 / n end
  end
  return use_batch, m
end
function BatchNorm:_run(fn, x)
  self:_check_input(x)
  local use_batch, m = self:_step_momentum()
  -- running stats are updated when training with them; eval without them uses the batch's
  local track = self.training or not use_batch
  local rm, rv = track and self.running_mean or nil, track and self.running_var or nil
  return (fn(x, rm, rv, self.weight, self.bias, { training = use_batch, momentum = m, eps = self.eps }))
end
function BatchNorm:forward(x) return self:_run(F.batch_norm, x) end
function BatchNorm:extra_repr()
  return ("%d, eps=%s, momentum=%s, affine=%s, track_running_stats=%s"):format(self.num_features, tostring(self.eps),
    self.momentum == nil and "None" or tostring(self.momentum), pybool(self.affine), pybool(self.track_running_stats))
end

--- nn.BatchNorm1d(num_features[, {eps = 1e-5, momentum = 0.1, affine = true, track_running_stats = true}]): batch norm of (N, C) or (N, C, L).
-- @function BatchNorm1d
-- @param num_features C

--- nn.BatchNorm2d(num_features[, options as BatchNorm1d's]): batch norm of (N, C, H, W).
-- @function BatchNorm2d
-- @param num_features C

--- nn.SyncBatchNorm(num_features[, options as BatchNorm1d's]): batch norm over the global batch (every rank's).
-- @function SyncBatchNorm
-- @param num_features C

local BatchNorm1d = BatchNorm:extend("BatchNorm1d")
L.BatchNorm1d = BatchNorm1d
BatchNorm1d._dims = { 2, 3 }
local BatchNorm2d = BatchNorm:extend("BatchNorm2d")
L.BatchNorm2d = BatchNorm2d
BatchNorm2d._dims = { 4 }

-- nn.SyncBatchNorm(num_features[, {same options}]): batch norm over the global batch (every rank's
-- per-channel sums all-reduced in forward and backward); any input with a channel dim.
-- nn.SyncBatchNorm.convert_sync_batchnorm(module) replaces every BatchNorm1d/2d in module (or module
-- itself) by a SyncBatchNorm holding the same parameters and buffers, and returns the result.
local SyncBatchNorm = BatchNorm:extend("SyncBatchNorm")
L.SyncBatchNorm = SyncBatchNorm
function SyncBatchNorm:forward(x) return self:_run(F.sync_batch_norm, x) end
-- what one training step all-reduces over `world` ranks (fsdp.summary's plan): the forward's
-- [sum | count] (C + 1) and sum of squares (C), the backward's two gradient sums (2C), float32
function SyncBatchNorm:_step_collectives(world)
  local C = self.num_features
  if world <= 1 or not (self.training or not self.track_running_stats) then return {} end
  return { { "all_reduce", (C + 1) * 4 }, { "all_reduce", C * 4 }, { "all_reduce", 2 * C * 4 } }
end
local function to_sync(m)
  local s = SyncBatchNorm(m.num_features, { eps = m.eps, affine = m.affine, track_running_stats = m.track_running_stats })
  s.momentum = m.momentum
  for _, kind in ipairs { "_parameters", "_buffers" } do
    for _, name in ipairs { "weight", "bias", "running_mean", "running_var", "num_batches_tracked" } do
      local t = rawget(m, kind).values[name]
      if t ~= nil then s[name] = t end
    end
  end
  rawset(s, "training", m.training)
  return s
end
function SyncBatchNorm.convert_sync_batchnorm(module)
  if not is_module(module) then
    error(("SyncBatchNorm.convert_sync_batchnorm: expected a Module, got %s"):format(type(module)), 2)
  end
  if module.__name == "BatchNorm1d" or module.__name == "BatchNorm2d" then return to_sync(module) end
  for name, child in module:named_children() do
    local c = SyncBatchNorm.convert_sync_batchnorm(child)
    if c ~= child then module[name] = c end
  end
  return module
end

-- nn.GroupNorm(num_groups, num_channels[, {eps = 1e-5, affine = true}]): weight (C) = 1, bias (C) = 0
local GroupNorm = Module:extend("GroupNorm")
L.GroupNorm = GroupNorm
--- nn.GroupNorm(num_groups, num_channels[, {eps = 1e-5, affine = true}]): group normalization.
-- @function GroupNorm
function GroupNorm:__init(...)
  local o = args_of("GroupNorm", { { "num_groups" }, { "num_channels" }, { "eps", 1e-5 }, { "affine", true } }, ...)
  local num_groups, num_channels = o.num_groups, o.num_channels
  self.num_groups = check_int("GroupNorm", "num_groups", num_groups)
  self.num_channels = check_int("GroupNorm", "num_channels", num_channels)
  if num_channels % num_groups ~= 0 then
    error(("GroupNorm: num_channels %d must be divisible by num_groups %d"):format(num_channels, num_groups), 2)
  end
  self.eps = o.eps or 1e-5
  self.affine = o.affine ~= false
  if self.affine then
    self.weight = Parameter(fsdp.ones(num_channels))
    self.bias = Parameter(fsdp.zeros(num_channels))
  else
    self:register_parameter("weight", nil)
    self:register_parameter("bias", nil)
  end
end
GroupNorm.reset_parameters = ones_zeros_reset
function GroupNorm:forward(x) return (F.group_norm(x, self.num_groups, self.weight, self.bias, self.eps)) end
function GroupNorm:extra_repr()
  return ("%d, %d, eps=%s, affine=%s"):format(self.num_groups, self.num_channels, tostring(self.eps), pybool(self.affine))
end

-- nn.RMSNorm(normalized_shape[, {eps = nil, elementwise_affine = true}]): weight (normalized_shape) = 1;
-- eps nil means torch.finfo(input dtype).eps, as PyTorch
local RMSNorm = Module:extend("RMSNorm")
L.RMSNorm = RMSNorm
--- nn.RMSNorm(normalized_shape[, {eps, elementwise_affine = true}]): RMS normalization over the trailing dims.
-- @function RMSNorm
function RMSNorm:__init(...)
  local o = args_of("RMSNorm", { { "normalized_shape", list = true }, { "eps", optional = true },
    { "elementwise_affine", true } }, ...)
  local normalized_shape = o.normalized_shape
  local ns = type(normalized_shape) == "number" and { normalized_shape } or normalized_shape
  if type(ns) ~= "table" or #ns == 0 then error("RMSNorm: normalized_shape must be an integer or a table of integers", 2) end
  for _, v in ipairs(ns) do check_int("RMSNorm", "normalized_shape", v) end
  self.normalized_shape = ns
  self.eps = o.eps
  self.elementwise_affine = o.elementwise_affine ~= false
  if self.elementwise_affine then
    self.weight = Parameter(fsdp.ones(ns))
  else
    self:register_parameter("weight", nil)
  end
end
RMSNorm.reset_parameters = ones_zeros_reset
function RMSNorm:forward(x) return (F.rms_norm(x, self.normalized_shape, self.weight, self.eps)) end
function RMSNorm:extra_repr()
  local ns = self.normalized_shape
  return ("(%s%s), eps=%s, elementwise_affine=%s"):format(table.concat(ns, ", "), #ns == 1 and "," or "",
    self.eps == nil and "None" or tostring(self.eps), pybool(self.elementwise_affine))
end

-- nn.Embedding(num_embeddings, embedding_dim[, {padding_idx =}]): weight (num, dim) ~ N(0, 1), the
-- padding row (0-based, negative from the end) zeroed and excluded from gradients
local Embedding = Module:extend("Embedding")
L.Embedding = Embedding
--- nn.Embedding(num_embeddings, embedding_dim[, {padding_idx}]): a lookup table, weight (num_embeddings, embedding_dim).
-- @function Embedding
function Embedding:__init(...)
  local o = args_of("Embedding", { { "num_embeddings" }, { "embedding_dim" }, { "padding_idx", optional = true } }, ...)
  local num_embeddings, embedding_dim = o.num_embeddings, o.embedding_dim
  self.num_embeddings = check_int("Embedding", "num_embeddings", num_embeddings)
  self.embedding_dim = check_int("Embedding", "embedding_dim", embedding_dim)
  local pad = o.padding_idx
  if pad ~= nil then
    if type(pad) ~= "number" or pad ~= math.floor(pad) then
      error(("Embedding: padding_idx must be an integer (0-based, negative from the end), got %s")
        :format(tostring(pad)), 2)
    end
    if pad < 0 then pad = pad + num_embeddings end
    if pad < 0 or pad >= num_embeddings then
      error(("Embedding: padding_idx %d out of range for %d embeddings"):format(o.padding_idx, num_embeddings), 2)
    end
  end
  self.padding_idx = pad
  self.weight = Parameter(fsdp.empty(num_embeddings, embedding_dim))
  self:reset_parameters()
end
-- weight ~ N(0, 1), the padding row zero (on a sharded weight: the part of the row in this rank's piece)
function Embedding:reset_parameters()
  local w = self.weight
  init.normal_(w, 0, 1)
  if not self.padding_idx then return end
  fsdp.no_grad(function()
    local start, len = fsdp._piece(w.p)
    if not start then return w:narrow(1, self.padding_idx + 1, 1):fill_(0) end
    local a = math.max(start, self.padding_idx * self.embedding_dim)
    local b = math.min(start + len, (self.padding_idx + 1) * self.embedding_dim)
    if b > a then w:to_local():narrow(1, a - start + 1, b - a):fill_(0) end
  end)
end
function Embedding:forward(idx) return (F.embedding(idx, self.weight, self.padding_idx)) end
function Embedding:extra_repr()
  local s = ("%d, %d"):format(self.num_embeddings, self.embedding_dim)
  if self.padding_idx then s = s .. ", padding_idx=" .. self.padding_idx end
  return s
end

-- ---- losses (mean reduction) ------------------------------------------------------------------------------------------
-- nn.CrossEntropyLoss({ignore_index = -100, label_smoothing = 0}); loss(logits, target)
local CrossEntropyLoss = Module:extend("CrossEntropyLoss")
L.CrossEntropyLoss = CrossEntropyLoss
--- nn.CrossEntropyLoss([options]): F.cross_entropy as a module (options as F.cross_entropy's).
-- @function CrossEntropyLoss
function CrossEntropyLoss:__init(...)
  local opts = args_of("CrossEntropyLoss", F._loss_spec.cross_entropy, ...)
  if opts.reduction ~= "mean" then
    error(("CrossEntropyLoss: only reduction = \"mean\" is supported, got %q"):format(tostring(opts.reduction)), 2)
  end
  if opts.weight ~= nil then error("CrossEntropyLoss: class weights are not supported", 2) end
  if opts.size_average ~= nil or opts.reduce ~= nil then
    error("CrossEntropyLoss: size_average and reduce are deprecated in PyTorch; use reduction = \"mean\"", 2)
  end
  self.ignore_index, self.label_smoothing = opts.ignore_index or -100, opts.label_smoothing or 0
end
function CrossEntropyLoss:forward(logits, target)
  return (F.cross_entropy(logits, target, { ignore_index = self.ignore_index, label_smoothing = self.label_smoothing }))
end

local NLLLoss = Module:extend("NLLLoss")
L.NLLLoss = NLLLoss
--- nn.NLLLoss([options]): F.nll_loss as a module.
-- @function NLLLoss
function NLLLoss:__init(...)
  local opts = args_of("NLLLoss", F._loss_spec.nll_loss, ...)
  if opts.weight ~= nil then error("NLLLoss: class weights are not supported", 2) end
  if opts.size_average ~= nil or opts.reduce ~= nil then
    error("NLLLoss: size_average and reduce are deprecated in PyTorch; use reduction = \"mean\"", 2)
  end
  if opts.reduction ~= "mean" then
    error(("NLLLoss: only reduction = \"mean\" is supported, got %q"):format(tostring(opts.reduction)), 2)
  end
  self.ignore_index = opts.ignore_index or -100
end
function NLLLoss:forward(logp, target) return (F.nll_loss(logp, target, { ignore_index = self.ignore_index })) end

local MSELoss = Module:extend("MSELoss")
L.MSELoss = MSELoss
--- nn.MSELoss([options]): F.mse_loss as a module (mean squared error).
-- @function MSELoss
function MSELoss:__init(...)
  local opts = args_of("MSELoss", F._loss_spec.mse_loss, ...)
  if opts.size_average ~= nil or opts.reduce ~= nil then
    error("MSELoss: size_average and reduce are deprecated in PyTorch; use reduction = \"mean\"", 2)
  end
  if opts.reduction ~= "mean" then
    error(("MSELoss: only reduction = \"mean\" is supported, got %q"):format(tostring(opts.reduction)), 2)
  end
end
function MSELoss:forward(a, b) return (F.mse_loss(a, b)) end

-- ---- containers ----------------------------------------------------------------------------------------------------------
-- the modules given as arguments, or as one list
local function module_list(cls, ...)
  local n = select("#", ...)
  local mods = { ... }
  if n == 1 and type(mods[1]) == "table" and not is_module(mods[1]) then
    mods = mods[1]
    n = fsdp._list(mods, cls, "modules", 4)
  end
  for i = 1, n do
    if not is_module(mods[i]) then
      error(("%s: argument %d is not a Module (got %s)"):format(cls, i, type(mods[i])), 4)
    end
  end
  return mods, n
end

-- nn.Sequential(m1, m2, ...) or nn.Sequential{m1, m2, ...}: children "0", "1", ...; forward
-- feeds each child's output to the next
local Sequential = Module:extend("Sequential")
L.Sequential = Sequential
--- nn.Sequential(m1, m2, ...): runs its children in order; they are named "0", "1", ... as in PyTorch.
-- @function Sequential
function Sequential:__init(...)
  local mods, n = module_list("Sequential", ...)
  for i = 1, n do self:add_module(tostring(i - 1), mods[i]) end
end
function Sequential:forward(x)
  local mods = self._modules
  for _, name in ipairs(mods.names) do
    local m = mods.values[name]
    if m then x = m(x) end
  end
  return x
end

-- nn.ModuleList(list): holds children "0", "1", ... (no forward)
local ModuleList = Module:extend("ModuleList")
L.ModuleList = ModuleList
--- nn.ModuleList([modules]): children kept in a list, named "0", "1", ... as in PyTorch.
-- @function ModuleList
function ModuleList:__init(...)
  local mods, n = module_list("ModuleList", ...)
  for i = 1, n do self:add_module(tostring(i - 1), mods[i]) end
end

-- shared by both containers (Torch7 and PyTorch spellings)
for _, cls in ipairs { Sequential, ModuleList } do
  function cls:len() return #self._modules.names end
  -- 1-based, negative from the end
  function cls:get(i)
    local n = self:len()
    if i < 0 then i = i + n + 1 end
    if i < 1 or i > n then error(("%s:get(%d): index out of range (%d modules)"):format(self.__name, i, n), 2) end
    return self._modules.values[self._modules.names[i]]
  end
  function cls:append(m)
    if not is_module(m) then error(self.__name .. ":append: expected a Module", 2) end
    self:add_module(tostring(self:len()), m)
    return self
  end
  cls.add = cls.append
  function cls:extend(list)
    if type(list) ~= "table" or is_module(list) then error(self.__name .. ":extend: expected a list of Modules", 2) end
    for i = 1, fsdp._list(list, self.__name .. ":extend", "modules") do self:append(list[i]) end
    return self
  end
  -- for i, m in list:ipairs() do (1-based i)
  function cls:ipairs() return ipairs(self:children()) end
end
-- ModuleList:extend(list) appends; the class method Module.extend(cls, name) still makes subclasses
local list_extend = ModuleList.extend
ModuleList.extend = function(self, arg)
  if type(arg) == "string" then return (Module.extend(self, arg)) end
  return (list_extend(self, arg))
end
local seq_extend = Sequential.extend
Sequential.extend = function(self, arg)
  if type(arg) == "string" then return (Module.extend(self, arg)) end
  return (seq_extend(self, arg))
end

-- list[i] (1-based, negative from the end) reads list:get(i); names still index children
for _, cls in ipairs { Sequential, ModuleList } do
  local index = cls.__index
  cls.__index = function(self, k)
    if type(k) == "number" then return self:get(k) end
    return index(self, k)
  end
end

-- the children of a list container, renamed "0", "1", ... in the order of `mods`
local function renumber(self, mods)
  local o = self._modules
  for _, name in ipairs(o.names) do
    o.values[name] = nil
    o.has[name] = nil
  end
  o.names = {}
  for i, m in ipairs(mods) do self:add_module(tostring(i - 1), m) end
end
local function module_values(self)
  local r = {}
  for i, name in ipairs(self._modules.names) do r[i] = self._modules.values[name] end
  return r
end

-- list:insert(i, m): m becomes entry i (1-based, negative from the end; len() + 1 appends), the
-- later entries move up one (their names "k" become "k+1", as in PyTorch)
function ModuleList:insert(i, m)
  if not is_module(m) then error(("ModuleList:insert: expected a Module, got %s"):format(type(m)), 2) end
  local n = self:len()
  if type(i) ~= "number" or i ~= math.floor(i) then fsdp._arg_error("ModuleList:insert", "index", "an integer", i, 2) end
  if i < 0 then i = i + n + 1 end
  if i < 1 or i > n + 1 then
    error(("ModuleList:insert(%d): index out of range (%d modules)"):format(i, n), 2)
  end
  local mods = module_values(self)
  table.insert(mods, i, m)
  renumber(self, mods)
  return self
end

-- nn.ModuleDict(modules): children by name, in order. modules: a list of {name, module} pairs (in
-- that order), or a Lua table name -> module (Lua tables have no order: sorted by name, so every
-- rank gets the same order), or another ModuleDict. state_dict keys are "<dict>.<name>.weight".
--   d.encoder, d["encoder"], d:get("encoder"); d.encoder = m (adds or replaces); d.encoder = nil
--   d:len(), d:contains(name), d:keys(), d:values(), for name, m in d:items() do, d:pop(name),
--   d:update(modules), d:clear()
local ModuleDict = Module:extend("ModuleDict")
L.ModuleDict = ModuleDict

-- the (name, module) pairs of modules, in order, checked
local function dict_entries(modules)
  if modules == nil then return {} end
  if is_module(modules) and modules.__name == "ModuleDict" then
    local r = {}
    for i, name in ipairs(modules._modules.names) do r[i] = { name, modules._modules.values[name] } end
    return r
  end
  if type(modules) ~= "table" or is_module(modules) then
    error(("ModuleDict: expected a list of {name, module} pairs or a table name -> module, got %s")
      :format(is_module(modules) and "a Module" or type(modules)), 4)
  end
  local r = {}
  if modules[1] ~= nil then
    for i, e in ipairs(modules) do
      if type(e) ~= "table" or is_module(e) or #e ~= 2 then
        error(("ModuleDict: entry %d must be a {name, module} pair"):format(i), 4)
      end
      r[i] = { e[1], e[2] }
    end
  else
    local names = {}
    for k in pairs(modules) do
      if type(k) ~= "string" then error(("ModuleDict: key %s must be a string"):format(tostring(k)), 4) end
      names[#names + 1] = k
    end
    table.sort(names)
    for _, name in ipairs(names) do r[#r + 1] = { name, modules[name] } end
  end
  for _, e in ipairs(r) do
    if type(e[1]) ~= "string" or e[1] == "" or e[1]:find(".", 1, true) then
      error(("ModuleDict: key %s must be a non-empty string without '.'"):format(tostring(e[1])), 4)
    end
    if not is_module(e[2]) then
      error(("ModuleDict: the value for key %q is not a Module (got %s)"):format(e[1], type(e[2])), 4)
    end
  end
  return r
end

--- nn.ModuleDict([modules]): named children, from a table name -> module.
-- @function ModuleDict
function ModuleDict:__init(modules) self:update(modules) end
function ModuleDict:update(modules)
  for _, e in ipairs(dict_entries(modules)) do self:add_module(e[1], e[2]) end
  return self
end
function ModuleDict:len() return #self._modules.names end
function ModuleDict:contains(name) return self._modules.has[name] == true end
function ModuleDict:get(name)
  if not self:contains(name) then error(("ModuleDict:get: no module named %q"):format(tostring(name)), 2) end
  return self._modules.values[name]
end
function ModuleDict:keys()
  local r = {}
  for i, name in ipairs(self._modules.names) do r[i] = name end
  return r
end
function ModuleDict:values() return module_values(self) end
-- for name, m in d:items() do ... end, in order
function ModuleDict:items()
  local names, values, i = self._modules.names, self._modules.values, 0
  return function()
    i = i + 1
    local name = names[i]
    if name ~= nil then return name, values[name] end
  end
end
function ModuleDict:pop(name)
  local m = self:get(name)
  self[name] = nil
  return m
end
function ModuleDict:clear()
  for _, name in ipairs(self:keys()) do self[name] = nil end
  return self
end

-- nn.Checkpoint(module) -> module, now activation-checkpointed (fsdp.checkpoint around its hooks
-- and forward): no container, so names and state dicts stay the same. Inside an FSDP unit, or
-- around one, it works as fsdp.wrap's {checkpoint = true} does.
function L.Checkpoint(m)
  if not is_module(m) then error(("nn.Checkpoint: expected a Module, got %s"):format(type(m)), 2) end
  rawset(m, "_checkpointed", true)
  return m
end

return L
