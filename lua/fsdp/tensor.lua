-- Tensor: the metatype of `struct fsdp_tensor` (a C handle held through ffi.gc).
-- Every method is a thin call into libfsdp: dims are converted from Lua's 1-based convention,
-- results are wrapped, C errors become Lua errors. No numeric loops live here.
local ffi = require "ffi"

local Tensor = {}
local methods = {}
Tensor.methods = methods
local C, wrap, check, dim, dtype_of, shape_of, fsdp

local tensor_ct = ffi.typeof("fsdp_tensor*")
function Tensor.is(x) return type(x) == "cdata" and ffi.istype(tensor_ct, x) end

-- scalars on either side of an operator become scalar ops
local function binop(cfn, sfn, rsfn)
  return function(a, b)
    if type(b) == "number" then return sfn(a, b) end
    if type(a) == "number" then return rsfn(a, b) end
    return wrap(cfn(a, b))
  end
end

function Tensor._init(lib)
  fsdp, C = lib, lib.C
  wrap, check, dim, dtype_of, shape_of = lib._wrap, lib._check, lib._dim, lib._dtype, lib._shape

  local mt = {}
  local getters = {
    requires_grad = function(t) return C.fsdp_tensor_requires_grad(t) ~= 0 end,
    grad = function(t)
      local g = C.fsdp_tensor_grad(t)
      if g == nil then return nil end
      return ffi.gc(g, C.fsdp_tensor_release)
    end,
    is_leaf = function(t) return C.fsdp_tensor_is_leaf(t) ~= 0 end,
    grad_fn = function(t)
      local n = ffi.string(C.fsdp_tensor_grad_fn_name(t))
      return n ~= "" and n or nil
    end,
    dtype = function(t) return lib._dtype_names[C.fsdp_tensor_dtype(t)] end,
    device = function(t) return C.fsdp_tensor_device(t) == 0 and "cpu" or "cuda" end,
    ndim = function(t) return C.fsdp_tensor_ndim(t) end,
    T = function(t) return t:t() end,
  }
  local setters = {
    requires_grad = function(t, v) check(C.fsdp_tensor_set_requires_grad(t, v and 1 or 0)) end,
    grad = function(t, g) check(C.fsdp_tensor_set_grad(t, g)) end,
  }
  mt.__index = function(t, k)
    local m = methods[k]
    if m then return m end
    local g = getters[k]
    if g then return g(t) end
    return nil
  end
  mt.__newindex = function(t, k, v)
    local s = setters[k]
    if not s then error(("tensor: cannot set field %q"):format(tostring(k)), 2) end
    s(t, v)
  end
  mt.__add = binop(C.fsdp_add, function(a, s) return wrap(C.fsdp_add_scalar(a, s)) end,
    function(s, b) return wrap(C.fsdp_add_scalar(b, s)) end)
  mt.__sub = binop(C.fsdp_sub, function(a, s) return wrap(C.fsdp_add_scalar(a, -s)) end,
    function(s, b) return wrap(C.fsdp_add_scalar(wrap(C.fsdp_neg(b)), s)) end)
  mt.__mul = binop(C.fsdp_mul, function(a, s) return wrap(C.fsdp_mul_scalar(a, s)) end,
    function(s, b) return wrap(C.fsdp_mul_scalar(b, s)) end)
  mt.__div = binop(C.fsdp_div, function(a, s) return wrap(C.fsdp_mul_scalar(a, 1 / s)) end,
    function(s, b) return wrap(C.fsdp_rdiv_scalar(s, b)) end)
  mt.__pow = function(a, p)
    if type(p) ~= "number" then error("tensor ^ tensor is not supported; use a number exponent", 2) end
    return wrap(C.fsdp_pow_scalar(a, p))
  end
  mt.__unm = function(a) return wrap(C.fsdp_neg(a)) end
  mt.__len = function(t) return tonumber(C.fsdp_tensor_size(t, 0)) end
  mt.__tostring = function(t) return t:tostring() end
  ffi.metatype("struct fsdp_tensor", mt)
end

-- ---- shape and data -----------------------------------------------------------------------------
function methods.dim(t) return C.fsdp_tensor_ndim(t) end
function methods.numel(t) return tonumber(C.fsdp_tensor_numel(t)) end
function methods.shape(t)
  local s = {}
  for i = 0, C.fsdp_tensor_ndim(t) - 1 do s[i + 1] = tonumber(C.fsdp_tensor_size(t, i)) end
  return s
end
function methods.size(t, d)
  if d == nil then return t:shape() end
  return tonumber(C.fsdp_tensor_size(t, dim(d, t:dim())))
end
function methods.stride(t, d)
  if d == nil then
    local s = {}
    for i = 0, C.fsdp_tensor_ndim(t) - 1 do s[i + 1] = tonumber(C.fsdp_tensor_stride(t, i)) end
    return s
  end
  return tonumber(C.fsdp_tensor_stride(t, dim(d, t:dim())))
end
function methods.is_contiguous(t) return C.fsdp_tensor_is_contiguous(t) ~= 0 end
function methods.data_ptr(t) return C.fsdp_tensor_data(t) end
function methods.version(t) return tonumber(C.fsdp_tensor_version(t)) end
function methods.item(t)
  local out = ffi.new("double[1]")
  check(C.fsdp_tensor_item(t, out))
  return out[0]
end
-- flat Lua array of all elements in row-major order
function methods.tolist(t)
  local n = t:numel()
  local buf = ffi.new("double[?]", math.max(n, 1))
  check(C.fsdp_tensor_to_doubles(t, buf))
  local r = {}
  for i = 1, n do r[i] = buf[i - 1] end
  return r
end
-- nested Lua tables shaped like the tensor (a number for a 0-dim tensor)
function methods.totable(t)
  local flat, shape = t:tolist(), t:shape()
  if #shape == 0 then return flat[1] end
  local pos = 0
  local function build(d)
    local r = {}
    for i = 1, shape[d] do
      if d == #shape then pos = pos + 1; r[i] = flat[pos] else r[i] = build(d + 1) end
    end
    return r
  end
  return build(1)
end
function methods.tostring(t)
  local shape = t:shape()
  local head = ("tensor(%s, dtype=%s%s)"):format(table.concat(shape, "x"), t.dtype,
    t.grad_fn and (", grad_fn=" .. t.grad_fn) or (t.requires_grad and ", requires_grad=true" or ""))
  if t:numel() > 64 then return head end
  local function fmt(v)
    if type(v) == "table" then
      local parts = {}
      for i = 1, #v do parts[i] = fmt(v[i]) end
      return "[" .. table.concat(parts, ", ") .. "]"
    end
    return ("%.6g"):format(v)
  end
  return head .. " " .. fmt(t:totable())
end

-- ---- autograd --------------------------------------------------------------------------------------
-- x:backward([grad], [{retain_graph = true}])
-- (hooks call back from C into Lua; that is safe because fsdp runs with the JIT compiler off,
-- see lua/fsdp/init.lua)
function methods.backward(t, grad, opts)
  if type(grad) == "table" and not Tensor.is(grad) then opts, grad = grad, nil end
  local retain = opts and opts.retain_graph and 1 or 0
  check(C.fsdp_backward(t, grad, retain))
end
function methods.register_hook(t, fn) return fsdp.autograd.register_hook(t, fn) end
function methods.detach(t) return wrap(C.fsdp_detach(t)) end
function methods.requires_grad_(t, flag)
  check(C.fsdp_tensor_set_requires_grad(t, flag == false and 0 or 1))
  return t
end

-- ---- in place (no autograd) --------------------------------------------------------------------------
function methods.zero_(t) check(C.fsdp_fill_(t, 0)); return t end
function methods.fill_(t, v) check(C.fsdp_fill_(t, v)); return t end
function methods.copy_(t, src) check(C.fsdp_copy_(t, src)); return t end
function methods.add_(t, other, alpha)
  if type(other) == "number" then
    local one = fsdp.full(t:shape(), other)
    check(C.fsdp_add_(t, one, alpha or 1))
  else
    check(C.fsdp_add_(t, other, alpha or 1))
  end
  return t
end
function methods.mul_(t, s) check(C.fsdp_mul_scalar_(t, s)); return t end
function methods.uniform_(t, lo, hi) check(C.fsdp_uniform_(t, lo or 0, hi or 1)); return t end
function methods.normal_(t, mean, std) check(C.fsdp_normal_(t, mean or 0, std or 1)); return t end

-- ---- elementwise ---------------------------------------------------------------------------------------
function methods.add(a, b) return a + b end
function methods.sub(a, b) return a - b end
function methods.mul(a, b) return a * b end
function methods.div(a, b) return a / b end
function methods.pow(a, p) return a ^ p end
function methods.neg(a) return wrap(C.fsdp_neg(a)) end
function methods.exp(a) return wrap(C.fsdp_exp(a)) end
function methods.log(a) return wrap(C.fsdp_log(a)) end
function methods.sqrt(a) return wrap(C.fsdp_sqrt(a)) end
function methods.abs(a) return wrap(C.fsdp_abs(a)) end
function methods.tanh(a) return wrap(C.fsdp_tanh(a)) end
function methods.sigmoid(a) return wrap(C.fsdp_sigmoid(a)) end
function methods.relu(a) return wrap(C.fsdp_relu(a)) end
function methods.gelu(a, approximate) return wrap(C.fsdp_gelu(a, approximate == "tanh" and 1 or 0)) end
function methods.eq(a, b)
  if type(b) == "number" then b = fsdp.full({}, b, a.dtype) end
  return wrap(C.fsdp_eq(a, b))
end

-- ---- reductions --------------------------------------------------------------------------------------------
-- dims: nil (all), a number, or a table of numbers
local function dims_arg(t, d)
  if d == nil then return 0, nil end
  local list = type(d) == "table" and d or { d }
  local arr = ffi.new("int[?]", #list)
  local nd = t:dim()
  for i = 1, #list do arr[i - 1] = dim(list[i], nd) end
  return #list, arr
end
function methods.sum(t, d, keepdim)
  local n, arr = dims_arg(t, d)
  return wrap(C.fsdp_sum(t, n, arr, keepdim and 1 or 0))
end
function methods.mean(t, d, keepdim)
  local n, arr = dims_arg(t, d)
  return wrap(C.fsdp_mean(t, n, arr, keepdim and 1 or 0))
end
-- x:max() -> 0-dim max; x:max(dim[, keepdim]) -> values, indices. Index VALUES are 0-based as in
-- PyTorch (they feed index_select, embedding and cross_entropy); dims are 1-based.
function methods.max(t, d, keepdim)
  if d == nil then return wrap(C.fsdp_max_all(t)) end
  local idx = ffi.new("fsdp_tensor*[1]")
  local v = wrap(C.fsdp_max(t, dim(d, t:dim()), keepdim and 1 or 0, idx))
  return v, ffi.gc(idx[0], C.fsdp_tensor_release)
end
function methods.argmax(t, d, keepdim)
  if d == nil then return wrap(C.fsdp_argmax(t:reshape(-1), 0, 0)) end
  return wrap(C.fsdp_argmax(t, dim(d, t:dim()), keepdim and 1 or 0))
end

-- ---- linear algebra -----------------------------------------------------------------------------------------
function methods.matmul(a, b) return wrap(C.fsdp_matmul(a, b)) end
function methods.bmm(a, b) return wrap(C.fsdp_bmm(a, b)) end

-- ---- views and shape ----------------------------------------------------------------------------------------
function methods.view(t, ...)
  local n, arr = shape_of(...)
  return wrap(C.fsdp_view(t, n, arr))
end
function methods.reshape(t, ...)
  local n, arr = shape_of(...)
  return wrap(C.fsdp_reshape(t, n, arr))
end
function methods.view_as(t, other) return t:view(other:shape()) end
function methods.expand(t, ...)
  local n, arr = shape_of(...)
  return wrap(C.fsdp_expand(t, n, arr))
end
function methods.expand_as(t, other) return t:expand(other:shape()) end
function methods.flatten(t, s, e)
  local nd = t:dim()
  return wrap(C.fsdp_flatten(t, dim(s or 1, nd), dim(e or -1, nd)))
end
function methods.transpose(t, a, b)
  local nd = t:dim()
  return wrap(C.fsdp_transpose(t, dim(a, nd), dim(b, nd)))
end
function methods.t(t)
  if t:dim() < 2 then return t end
  return t:transpose(1, 2)
end
function methods.permute(t, ...)
  local list = type((...)) == "table" and (...) or { ... }
  local arr = ffi.new("int[?]", #list)
  for i = 1, #list do arr[i - 1] = dim(list[i], #list) end
  return wrap(C.fsdp_permute(t, #list, arr))
end
function methods.unsqueeze(t, d)
  -- a new dim can go anywhere in 1..ndim+1 (or -1 for the end)
  local nd = t:dim() + 1
  return wrap(C.fsdp_unsqueeze(t, dim(d, nd)))
end
function methods.squeeze(t, d) return wrap(C.fsdp_squeeze(t, dim(d, t:dim()))) end
function methods.contiguous(t) return wrap(C.fsdp_contiguous(t)) end
function methods.clone(t) return wrap(C.fsdp_clone(t)) end
-- x:narrow(dim, start, length) with a 1-based start (Torch7)
function methods.narrow(t, d, start, len)
  return wrap(C.fsdp_narrow(t, dim(d, t:dim()), start - 1, len))
end
function methods.index_select(t, d, index) return wrap(C.fsdp_index_select(t, dim(d, t:dim()), index)) end
-- x:to(dtype), x:to(device) or x:to{device = "cpu", dtype = "bfloat16"}; a device move returns x
-- itself when x is already there (as PyTorch does)
function methods.to(t, what)
  local device, dtype
  if type(what) == "table" then
    device, dtype = what.device, what.dtype
  elseif fsdp._devices[what] then
    device = what
  else
    dtype = what
  end
  if device ~= nil then t = fsdp._to_device(t, device) end
  if dtype ~= nil then t = wrap(C.fsdp_to_dtype(t, dtype_of(dtype))) end
  return t
end
function methods.cpu(t) return t:to("cpu") end
function methods.float(t) return t:to("float32") end
function methods.long(t) return t:to("int64") end
function methods.bfloat16(t) return t:to("bfloat16") end
function methods.half(t) return t:to("float16") end

-- ---- nn shortcuts --------------------------------------------------------------------------------------------
function methods.softmax(t, d) return wrap(C.fsdp_softmax(t, dim(d, t:dim()))) end
function methods.log_softmax(t, d) return wrap(C.fsdp_log_softmax(t, dim(d, t:dim()))) end

return Tensor
