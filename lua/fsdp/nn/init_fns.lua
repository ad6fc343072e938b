--- fsdp.nn.init: weight initialization helpers (torch.nn.init). Each fills a tensor in place
-- without recording autograd and returns it.
-- @module fsdp.nn.init
local fsdp = require "fsdp"

local init = {}

local function no_grad(fn, ...) return fsdp.no_grad(fn, ...) end
-- the tensor an init function fills (a meta or a sharded one too: the method says what it can do)
local function tensor_arg(t, fn)
  if not fsdp.is_tensor(t) then fsdp._arg_error(fn, "tensor", "a tensor", t, 3) end
end

-- (fan_in, fan_out) of a weight (out, in, k...): fan_in = in * prod(k), fan_out = out * prod(k)
function init._calculate_fan_in_and_fan_out(t, fn)
  tensor_arg(t, fn or "init")
  local s = t:shape()
  if #s < 2 then
    error(("init: fan in and fan out cannot be computed for a tensor with fewer than 2 dims (shape (%s))")
      :format(table.concat(s, ", ")), 3)
  end
  local field = 1
  for i = 3, #s do field = field * s[i] end
  return s[2] * field, s[1] * field
end

--- PyTorch's recommended gain for a nonlinearity.
-- @param nonlinearity "relu", "tanh", "leaky_relu", ...
-- @param param leaky_relu's slope or nil
function init.calculate_gain(nonlinearity, param)
  if type(nonlinearity) ~= "string" then fsdp._arg_error("init.calculate_gain", "nonlinearity", "a name", nonlinearity, 2) end
  param = fsdp._f(param, "init.calculate_gain", "param", 0.01)
  if nonlinearity == "linear" or nonlinearity == "sigmoid" or nonlinearity:find("^conv") then return 1 end
  if nonlinearity == "tanh" then return 5 / 3 end
  if nonlinearity == "relu" then return math.sqrt(2) end
  if nonlinearity == "leaky_relu" then
    local slope = param
    return math.sqrt(2 / (1 + slope * slope))
  end
  if nonlinearity == "selu" then return 3 / 4 end
  error(("init.calculate_gain: unsupported nonlinearity %q"):format(tostring(nonlinearity)), 2)
end

--- (each checks its tensor first, so an error names init's function, not the method it calls)
function init.uniform_(t, a, b)
  tensor_arg(t, "init.uniform_")
  a, b = fsdp._f(a, "init.uniform_", "a", 0), fsdp._f(b, "init.uniform_", "b", 1)
  return no_grad(function() return t:uniform_(a, b) end)
end
--- Fills t with N(mean, std) samples in place.
-- @param t a tensor
-- @param mean default 0
-- @param std default 1
function init.normal_(t, mean, std)
  tensor_arg(t, "init.normal_")
  mean, std = fsdp._f(mean, "init.normal_", "mean", 0), fsdp._f(std, "init.normal_", "std", 1)
  return no_grad(function() return t:normal_(mean, std) end)
end
--- Fills t with v in place; returns t.
-- @param t a tensor
-- @param v a number
-- @param fn the name errors give (internal; nil)
function init.constant_(t, v, fn)
  tensor_arg(t, fn or "init.constant_")
  v = fsdp._n(v, fn or "init.constant_", "val")
  return no_grad(function() return t:fill_(v) end)
end
--- Fills t with zeros in place.
-- @param t a tensor
function init.zeros_(t) return init.constant_(t, 0, "init.zeros_") end
--- Fills t with ones in place.
-- @param t a tensor
function init.ones_(t) return init.constant_(t, 1, "init.ones_") end

local function fan(t, mode)
  local fan_in, fan_out = init._calculate_fan_in_and_fan_out(t)
  if mode == nil or mode == "fan_in" then return fan_in end
  if mode == "fan_out" then return fan_out end
  error(("init: mode must be \"fan_in\" or \"fan_out\", got %q"):format(tostring(mode)), 3)
end

-- kaiming_uniform_(t, {a = 0, mode = "fan_in", nonlinearity = "leaky_relu"}) (a may be positional)
-- PyTorch's default Linear/Conv init is kaiming_uniform_(w, {a = math.sqrt(5)}): U(-1/sqrt(fan_in), 1/sqrt(fan_in))
-- the options of kaiming_*: a table, or the number a
local function kaiming_opts(fn, t, opts)
  tensor_arg(t, fn)
  if opts ~= nil and type(opts) ~= "table" and type(opts) ~= "number" then
    fsdp._arg_error(fn, "options", "{a = ..., mode = ..., nonlinearity = ...} or the number a", opts, 3)
  end
  local o = type(opts) == "table" and opts or { a = opts }
  fsdp._f(o.a, fn, "a", 0)
  return o
end
--- He uniform init in place.
-- @param t a tensor
-- @param opts {a = 0, mode = "fan_in", nonlinearity = "leaky_relu"} or a (a number)
function init.kaiming_uniform_(t, opts)
  local o = kaiming_opts("init.kaiming_uniform_", t, opts)
  local gain = init.calculate_gain(o.nonlinearity or "leaky_relu", o.a or 0)
  local bound = math.sqrt(3) * gain / math.sqrt(fan(t, o.mode))
  return init.uniform_(t, -bound, bound)
end
--- He normal init in place.
-- @param t a tensor
-- @param opts {a = 0, mode = "fan_in", nonlinearity = "leaky_relu"} or a (a number)
function init.kaiming_normal_(t, opts)
  local o = kaiming_opts("init.kaiming_normal_", t, opts)
  local gain = init.calculate_gain(o.nonlinearity or "leaky_relu", o.a or 0)
  return init.normal_(t, 0, gain / math.sqrt(fan(t, o.mode)))
end
--- Glorot uniform init in place.
-- @param t a tensor
-- @param gain default 1
function init.xavier_uniform_(t, gain)
  local fan_in, fan_out = init._calculate_fan_in_and_fan_out(t, "init.xavier_uniform_")
  gain = fsdp._f(gain, "init.xavier_uniform_", "gain", 1)
  local bound = (gain or 1) * math.sqrt(6 / (fan_in + fan_out))
  return init.uniform_(t, -bound, bound)
end
--- Glorot normal init in place.
-- @param t a tensor
-- @param gain default 1
function init.xavier_normal_(t, gain)
  local fan_in, fan_out = init._calculate_fan_in_and_fan_out(t, "init.xavier_normal_")
  gain = fsdp._f(gain, "init.xavier_normal_", "gain", 1)
  return init.normal_(t, 0, (gain or 1) * math.sqrt(2 / (fan_in + fan_out)))
end

return init
