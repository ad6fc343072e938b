--- Tensor: the metatype of `fsdp_tensor_handle`, the one-field struct that owns a reference to a C
-- `fsdp_tensor` (made by fsdp._wrap in lua/fsdp/init.lua; __gc here releases the reference).
-- Every method is a thin call into libfsdp (no tail calls: write `return (f(...))`, see
-- tools/tailcalls.lua): dims are converted from Lua's 1-based convention,
-- results are wrapped, C errors become Lua errors. No numeric loops live here.
-- @classmod Tensor
local ffi = require "ffi"

local Tensor = {}
local methods = {}
Tensor.methods = methods
local C, wrap, check, dim, dtype_of, shape_of, fsdp, T, P, N
local TN = "a tensor or a number"

local handle_ct
function Tensor.is(x) return type(x) == "cdata" and ffi.istype(handle_ct, x) end

function Tensor._init(lib)
  fsdp, C = lib, lib.C
  handle_ct = lib._handle_ct
  wrap, check, dim, dtype_of, shape_of = lib._wrap, lib._check, lib._dim, lib._dtype, lib._shape
  T, P, N = lib._t, lib._p, lib._n

  local mt = {}
  local getters = {
    requires_grad = function(t) return C.fsdp_tensor_requires_grad(t.p) ~= 0 end,
    grad = function(t)
      local g = C.fsdp_tensor_grad(t.p)
      if g == nil then return nil end
      return (wrap(g))
    end,
    is_leaf = function(t) return C.fsdp_tensor_is_leaf(t.p) ~= 0 end,
    grad_fn = function(t)
      local n = ffi.string(C.fsdp_tensor_grad_fn_name(t.p))
      return n ~= "" and n or nil
    end,
    dtype = function(t) return lib._dtype_names[C.fsdp_tensor_dtype(t.p)] end,
    device = function(t)
      -- (the head first, without a call: it is 0 for every tensor whose values are in memory)
      if ffi.cast(fsdp._head_ptr, t.p).deferred == 1 and C.fsdp_tensor_deferred(t.p) == 1 then return "meta" end
      return C.fsdp_tensor_device(t.p) == 0 and "cpu" or "cuda"
    end,
    ndim = function(t) return (t:dim()) end,
    T = function(t) return (t:t()) end,
  }
  local setters = {
    requires_grad = function(t, v) check(C.fsdp_tensor_set_requires_grad(t.p, v and 1 or 0)) end,
    grad = function(t, g) check(C.fsdp_tensor_set_grad(t.p, P(g, "grad", "the new .grad"))) end,
  }
  mt.__index = function(t, k)
    local m = methods[k]
    if m then return m end
    local g = getters[k]
    if g then return (g(t)) end
    if type(k) == "number" or type(k) == "table" then return (Tensor.index(t, k, 2)) end
    return nil
  end
  mt.__newindex = function(t, k, v)
    if type(k) == "number" or type(k) == "table" then return (Tensor.index_assign(t, k, v)) end
    local s = setters[k]
    if not s then error(("tensor: cannot set field %q"):format(tostring(k)), 2) end
    s(t, v)
  end
  -- a number on either side becomes a scalar op
  mt.__add = function(a, b)
    local r
    if type(b) == "number" then
      r = C.fsdp_add_scalar(T(a, "add", "input", TN), b)
    elseif type(a) == "number" then
      r = C.fsdp_add_scalar(T(b, "add", "other", TN), a)
    else
      r = C.fsdp_add(T(a, "add", "input", TN), T(b, "add", "other", TN))
    end
    return (wrap(r))
  end
  mt.__sub = function(a, b)
    local r
    if type(b) == "number" then
      r = C.fsdp_add_scalar(T(a, "sub", "input", TN), -b)
    elseif type(a) == "number" then
      local nb = wrap(C.fsdp_neg(T(b, "sub", "other", TN)))
      r = C.fsdp_add_scalar(nb.p, a)
    else
      r = C.fsdp_sub(T(a, "sub", "input", TN), T(b, "sub", "other", TN))
    end
    return (wrap(r))
  end
  mt.__mul = function(a, b)
    local r
    if type(b) == "number" then
      r = C.fsdp_mul_scalar(T(a, "mul", "input", TN), b)
    elseif type(a) == "number" then
      r = C.fsdp_mul_scalar(T(b, "mul", "other", TN), a)
    else
      r = C.fsdp_mul(T(a, "mul", "input", TN), T(b, "mul", "other", TN))
    end
    return (wrap(r))
  end
  mt.__div = function(a, b)
    local r
    if type(b) == "number" then
      r = C.fsdp_mul_scalar(T(a, "div", "input", TN), 1 / b)
    elseif type(a) == "number" then
      r = C.fsdp_rdiv_scalar(a, T(b, "div", "other", TN))
    else
      r = C.fsdp_div(T(a, "div", "input", TN), T(b, "div", "other", TN))
    end
    return (wrap(r))
  end
  mt.__pow = function(a, p)
    if type(p) ~= "number" then
      if Tensor.is(p) then error("pow: tensor ^ tensor is not supported; use a number exponent", 2) end
      lib._arg_error("pow", "exponent", "a number", p, 2)
    end
    return (wrap(C.fsdp_pow_scalar(T(a, "pow", "input"), p)))
  end
  mt.__unm = function(a) return (wrap(C.fsdp_neg(T(a, "neg")))) end
  mt.__len = function(t) return (t:size(1)) end
  mt.__tostring = function(t) return (t:tostring()) end
  -- two handles of one C tensor are the same tensor (x.grad returns a new handle each time)
  mt.__eq = function(a, b) return Tensor.is(a) and Tensor.is(b) and a.p == b.p end
  -- releasing may free hooked tensors and checkpointed regions; their hooks' Lua functions and the
  -- regions' closures go in the same collection
  local hooks_pending, regions_pending = C.fsdp_hooks_freed_pending(), C.fsdp_checkpoint_freed_pending()
  mt.__gc = function(t)
    if t.p ~= nil then
      C.fsdp_tensor_release(t.p)
      if hooks_pending[0] ~= 0 or regions_pending[0] ~= 0 then lib._hooks_freed() end
    end
  end
  ffi.metatype(handle_ct, mt)
  for name, f in pairs(Tensor.functions) do lib[name] = f end
end

-- ---- shape and data -----------------------------------------------------------------------------
-- Every method checks its tensor arguments with T (fsdp._t): `x.numel()` for `x:numel()`, or a
-- table where a tensor belongs, is a Lua error naming the method and the argument.
-- dim, numel, shape and size answer the tensor's logical shape: a sharded FSDP parameter's full
-- shape (as FSDP2's parameters do, so code written for the unwrapped model -- weight decay for
-- p:dim() >= 2, parameter counts -- keeps working), while ops work on what the tensor holds: this
-- rank's 1-D piece (x:to_local()). Methods here that pass dims or shapes on to ops use the held
-- ones (held_ndim, fsdp._held_shape).
local full_shape = ffi.new("int64_t[?]", 16)  -- FSDP_MAX_DIMS
local piece_start, piece_len = ffi.new("int64_t[1]"), ffi.new("int64_t[1]")
local function held_ndim(p)
  local n = C.fsdp_tensor_ndim(p)
  return n
end
--- The number of dims.
-- @function Tensor:dim
function methods.dim(t)
  local n = C.fsdp_param_full_ndim(T(t, "dim"))
  return n
end
--- The number of elements.
-- @function Tensor:numel
function methods.numel(t)
  local n = tonumber(C.fsdp_param_full_numel(T(t, "numel")))
  return n
end
--- The sizes, a list.
-- @function Tensor:shape
function methods.shape(t)
  local p = T(t, "shape")
  local s = {}
  for i = 0, C.fsdp_param_full_shape(p, full_shape) - 1 do s[i + 1] = tonumber(full_shape[i]) end
  return s
end
--- The sizes (a list), or dim's size.
-- @param dim a dim or nil
-- @function Tensor:size
function methods.size(t, d)
  local p = T(t, "size")
  if d == nil then return (t:shape()) end
  local nd = C.fsdp_param_full_shape(p, full_shape)
  local i = dim(d, nd, "size")
  if i < 0 then i = i + nd end
  if i < 0 or i >= nd then
    error(("size: dimension %d out of range for a tensor with %d dims (1-based, negative from the end)"):format(d, nd), 2)
  end
  local n = tonumber(full_shape[i])
  return n
end
--- the tensor as this rank holds it: a sharded FSDP parameter's piece, a 1-D view of elements
-- [start, start + length) of its flattened full values (printing the parameter says which); any
-- other tensor, and a parameter while its unit is gathered, is itself
-- @function Tensor:to_local
function methods.to_local(t)
  local p = T(t, "to_local")
  if C.fsdp_param_piece(p, piece_start, piece_len) == 0 then return t end
  local n, arr = fsdp._shape("to_local", fsdp._held_shape(t))
  return (wrap(C.fsdp_view(p, n, arr)))
end
--- The strides (a list), or dim's stride.
-- @param dim a dim or nil
-- @function Tensor:stride
function methods.stride(t, d)
  local p = T(t, "stride")
  if d == nil then
    local s = {}
    for i = 0, C.fsdp_tensor_ndim(p) - 1 do s[i + 1] = tonumber(C.fsdp_tensor_stride(p, i)) end
    return s
  end
  local n = tonumber(C.fsdp_tensor_stride(p, dim(d, C.fsdp_tensor_ndim(p), "stride")))
  return n
end
--- Whether x's elements are in row-major order without gaps.
-- @function Tensor:is_contiguous
function methods.is_contiguous(t) return C.fsdp_tensor_is_contiguous(T(t, "is_contiguous")) ~= 0 end
--- The address of the first element (a number).
-- @function Tensor:data_ptr
function methods.data_ptr(t)
  local ptr = C.fsdp_tensor_data(T(t, "data_ptr"))
  return ptr
end
--- The in-place modification counter.
-- @function Tensor:version
function methods.version(t)
  local v = tonumber(C.fsdp_tensor_version(T(t, "version")))
  return v
end
local BOOL = 4  -- FSDP_BOOL
--- a number; true or false for a bool tensor (so `if (x > 0):item()` reads as in Python)
-- @function Tensor:item
function methods.item(t)
  local p = T(t, "item")
  local out = ffi.new("double[1]")
  check(C.fsdp_tensor_item(p, out))
  if C.fsdp_tensor_dtype(p) == BOOL then return out[0] ~= 0 end
  return out[0]
end
--- flat Lua array of all elements in row-major order
-- @function Tensor:tolist
function methods.tolist(t)
  local p = T(t, "tolist")
  local n = tonumber(C.fsdp_tensor_numel(p))
  local buf = ffi.new("double[?]", math.max(n, 1))
  check(C.fsdp_tensor_to_doubles(p, buf))
  local r = {}
  for i = 1, n do r[i] = buf[i - 1] end
  return r
end
--- nested Lua tables shaped like the tensor (a number for a 0-dim tensor); a bool tensor's values
-- are true and false (tolist keeps them 0 and 1)
-- @function Tensor:totable
function methods.totable(t)
  T(t, "totable")
  local flat, shape = t:tolist(), fsdp._held_shape(t)
  if C.fsdp_tensor_dtype(t.p) == BOOL then
    for i = 1, #flat do flat[i] = flat[i] ~= 0 end
  end
  if #shape == 0 then return flat[1] end
  local pos = 0
  local function build(d)
    local r = {}
    for i = 1, shape[d] do
      if d == #shape then pos = pos + 1; r[i] = flat[pos] else r[i] = build(d + 1) end
    end
    return r
  end
  return (build(1))
end
--- A printable rendering of x (what tostring(x) gives).
-- @function Tensor:tostring
function methods.tostring(t)
  local p = T(t, "tostring")
  local shape = t:shape()
  local sharded = ""  -- a sharded parameter shows its full shape and, as values, its piece
  if C.fsdp_param_piece(p, piece_start, piece_len) ~= 0 then
    local a, len = tonumber(piece_start[0]), tonumber(piece_len[0])
    sharded = (", sharded: rank %d holds elements %d..%d of %d"):format(fsdp.rank(), a + 1, a + len, t:numel())
  end
  local head = ("tensor(%s, dtype=%s%s%s%s)"):format(table.concat(shape, "x"), t.dtype,
    t.device ~= "cpu" and (", device=" .. t.device) or "", t.grad_fn and (", grad_fn=" .. t.grad_fn) or (t.requires_grad and ", requires_grad=true" or ""),
    sharded)
  local n = tonumber(C.fsdp_tensor_numel(p))  -- before any table of values: an empty (1e7, 0) has no values but 1e7 rows
  if n > 64 or t.device == "meta" then return head end
  if n == 0 then return head .. " []" end
  local function fmt(v)
    if type(v) == "table" then
      local parts = {}
      for i = 1, #v do parts[i] = fmt(v[i]) end
      return "[" .. table.concat(parts, ", ") .. "]"
    end
    if type(v) == "boolean" or type(v) == "string" then return (tostring(v)) end
    return (("%.6g"):format(v))
  end
  local l = t:to_local()
  if l.dtype ~= "int64" then return head .. " " .. fmt(l:totable()) end
  -- int64 exactly, every digit (a token id 1234567 is not 1.23457e+06; past 2^53 tolist refuses)
  local c = (l.device == "cpu" and l or l:to("cpu")):contiguous()
  local ptr = ffi.cast("const int64_t*", c:data_ptr())
  local s, pos = fsdp._held_shape(c), 0
  local function build(d)
    if d > #s then
      pos = pos + 1
      return (tostring(ptr[pos - 1]):gsub("LL$", ""))
    end
    local r = {}
    for i = 1, s[d] do r[i] = build(d + 1) end
    return r
  end
  return head .. " " .. fmt(build(1))
end

-- ---- autograd --------------------------------------------------------------------------------------
--- x:backward([grad], [{retain_graph = true}])
-- @function Tensor:backward
function methods.backward(t, grad, opts)
  local p = T(t, "backward")
  if type(grad) == "table" and not Tensor.is(grad) then opts, grad = grad, nil end
  local retain = opts and opts.retain_graph and 1 or 0
  local rc = C.fsdp_backward(p, P(grad, "backward", "gradient"), retain)
  fsdp._hooks_freed()  -- the graph backward freed may have held hooks and checkpointed regions
  check(rc)
end
-- Backward calls back into Lua (tensor hooks, listeners, FSDP's queued callbacks); LuaJIT must
-- not call such a C function from compiled code, so this one function stays interpreted.
jit.off(methods.backward)
--- Calls fn(grad) when x's gradient is computed; a returned tensor replaces it.
-- @param fn a function
-- @function Tensor:register_hook
function methods.register_hook(t, fn)
  T(t, "register_hook")
  return (fsdp.autograd.register_hook(t, fn))
end
--- A view of x outside the autograd graph.
-- @function Tensor:detach
function methods.detach(t) return (wrap(C.fsdp_detach(T(t, "detach")))) end
--- Sets requires_grad (default true); returns x.
-- @param flag a boolean
-- @function Tensor:requires_grad_
function methods.requires_grad_(t, flag)
  check(C.fsdp_tensor_set_requires_grad(T(t, "requires_grad_"), flag == false and 0 or 1))
  return t
end

-- ---- in place (no autograd) --------------------------------------------------------------------------
-- On a sharded FSDP parameter (its piece form, outside its unit's forward and backward) these act on
-- the whole parameter, each rank on its piece: a fill or a scale directly; a tensor operand is taken
-- as the whole parameter's -- of its full shape or broadcastable to it, of which each rank takes its
-- piece, or another sharded tensor laid out the same way -- and a random fill draws as for the whole
-- parameter and keeps its piece (fsdp_uniform_slice_), so every rank's piece is what one process
-- would write there.

-- the operand of an in-place op on t as t holds it: src itself, or for a sharded parameter t, the
-- piece of src that lines up with t's piece
local function piece_operand(t, src, fn, arg)
  local start, len = fsdp._piece(t.p)
  if not start or not Tensor.is(src) or src.p == nil then return src end
  local full = t:shape()
  local s0, l0 = fsdp._piece(src.p)
  if s0 then  -- sharded too: the same parameter shape and the same piece
    if s0 ~= start or l0 ~= len or table.concat(src:shape(), "x") ~= table.concat(full, "x") then
      error(("%s: %s is a sharded parameter of shape %s holding elements %d..%d, the parameter of shape %s holds "
        .. "%d..%d: their pieces do not line up (use model:summon_full_params)"):format(fn, arg,
        table.concat(src:shape(), "x"), s0 + 1, s0 + l0, table.concat(full, "x"), start + 1, start + len), 3)
    end
    return (src:to_local())
  end
  local ok, whole = pcall(src.expand, src, full)
  if not ok then
    error(("%s: %s of shape %s does not broadcast to the sharded parameter's full shape %s"):format(fn, arg,
      table.concat(fsdp._held_shape(src), "x"), table.concat(full, "x")), 3)
  end
  return (whole:reshape(-1):narrow(1, start + 1, len))
end

--- Fills x with zeros in place; returns x.
-- @function Tensor:zero_
function methods.zero_(t) check(C.fsdp_fill_(T(t, "zero_"), 0)); return t end
--- Fills x with value in place; returns x.
-- @param value a number
-- @function Tensor:fill_
function methods.fill_(t, v) check(C.fsdp_fill_(T(t, "fill_"), N(v, "fill_", "value"))); return t end
--- Copies src's values into x in place; returns x.
-- @param src a tensor of x's shape
-- @function Tensor:copy_
function methods.copy_(t, src)
  local p = T(t, "copy_")
  check(C.fsdp_copy_(p, T(piece_operand(t, src, "copy_", "src"), "copy_", "src")))
  return t
end
--- x += alpha * other in place; returns x.
-- @param other a tensor or number
-- @param alpha a number (default 1)
-- @function Tensor:add_
function methods.add_(t, other, alpha)
  local p = T(t, "add_")
  if type(other) == "number" then
    check(C.fsdp_add_scalar_(p, other * N(alpha, "add_", "alpha", 1)))
  else
    other = piece_operand(t, other, "add_", "other")
    local held = fsdp._held_shape(t)
    if Tensor.is(other) and other.p ~= nil and table.concat(fsdp._held_shape(other), "x") ~= table.concat(held, "x") then
      local ok, e = pcall(other.expand, other, held)  -- broadcast to t, as PyTorch's add_ does
      if not ok then
        error(("add_: other of shape (%s) does not broadcast to the tensor's shape (%s)"):format(
          table.concat(fsdp._held_shape(other), ", "), table.concat(held, ", ")), 2)
      end
      other = e
    end
    check(C.fsdp_add_(p, T(other, "add_", "other", TN), N(alpha, "add_", "alpha", 1)))
  end
  return t
end
--- x *= value in place; returns x.
-- @param value a number
-- @function Tensor:mul_
function methods.mul_(t, s) check(C.fsdp_mul_scalar_(T(t, "mul_"), N(s, "mul_", "value"))); return t end
-- (skip, total): where t's values sit in the draw of its whole tensor
local function draw_span(t, p)
  local start = fsdp._piece(p)
  return start or 0, tonumber(C.fsdp_param_full_numel(p))
end
--- Fills x with U(from, to) samples in place.
-- @param from default 0
-- @param to default 1
-- @function Tensor:uniform_
function methods.uniform_(t, lo, hi)
  local p = T(t, "uniform_")
  local skip, total = draw_span(t, p)
  lo, hi = fsdp._f(lo, "uniform_", "from", 0), fsdp._f(hi, "uniform_", "to", 1)
  if lo > hi then error(("uniform_: expects a [from, to) range, but found from = %s > to = %s"):format(lo, hi), 2) end
  check(C.fsdp_uniform_slice_(p, lo, hi, skip, total))
  return t
end
--- Fills x with N(mean, std) samples in place.
-- @param mean default 0
-- @param std default 1
-- @function Tensor:normal_
function methods.normal_(t, mean, std)
  local p = T(t, "normal_")
  local skip, total = draw_span(t, p)
  mean, std = fsdp._f(mean, "normal_", "mean", 0), fsdp._f(std, "normal_", "std", 1)
  if std < 0 then fsdp._arg_error("normal_", "std", "a number >= 0", std, 2) end
  check(C.fsdp_normal_slice_(p, mean, std, skip, total))
  return t
end

-- ---- elementwise ---------------------------------------------------------------------------------------
--- x + other (as the operator, with self checked: x.add(y) names add's self).
-- @function Tensor:add
function methods.add(a, b) T(a, "add"); return a + b end
--- x - other (as the operator, with self checked).
-- @param other a tensor or number
-- @function Tensor:sub
function methods.sub(a, b) T(a, "sub"); return a - b end
--- x * other (as the operator, with self checked).
-- @param other a tensor or number
-- @function Tensor:mul
function methods.mul(a, b) T(a, "mul"); return a * b end
--- x / other (as the operator, with self checked).
-- @param other a tensor or number
-- @function Tensor:div
function methods.div(a, b) T(a, "div"); return a / b end
--- x ^ exponent (as the operator, with self checked).
-- @param exponent a number or tensor
-- @function Tensor:pow
function methods.pow(a, p) T(a, "pow"); return a ^ p end
--- -x, elementwise.
-- @function Tensor:neg
function methods.neg(a) return (wrap(C.fsdp_neg(T(a, "neg")))) end
--- exp(x), elementwise.
-- @function Tensor:exp
function methods.exp(a) return (wrap(C.fsdp_exp(T(a, "exp")))) end
--- log(x), elementwise.
-- @function Tensor:log
function methods.log(a) return (wrap(C.fsdp_log(T(a, "log")))) end
--- sqrt(x), elementwise.
-- @function Tensor:sqrt
function methods.sqrt(a) return (wrap(C.fsdp_sqrt(T(a, "sqrt")))) end
--- |x|, elementwise.
-- @function Tensor:abs
function methods.abs(a) return (wrap(C.fsdp_abs(T(a, "abs")))) end
--- tanh(x), elementwise.
-- @function Tensor:tanh
function methods.tanh(a) return (wrap(C.fsdp_tanh(T(a, "tanh")))) end
--- 1 / (1 + exp(-x)), elementwise.
-- @function Tensor:sigmoid
function methods.sigmoid(a) return (wrap(C.fsdp_sigmoid(T(a, "sigmoid")))) end
--- max(x, 0), elementwise.
-- @function Tensor:relu
function methods.relu(a) return (wrap(C.fsdp_relu(T(a, "relu")))) end
--- GELU, elementwise.
-- @param approximate "none" (default) or "tanh"
-- @function Tensor:gelu
function methods.gelu(a, approximate) return (wrap(C.fsdp_gelu(T(a, "gelu"), approximate == "tanh" and 1 or 0))) end
-- comparisons: bool tensors, no gradient. A number b is a 0-dim tensor of a's dtype when that is a
-- float dtype (PyTorch compares in it), else float32 (x:lt(0.5) on int64 x compares with 0.5)
local float_dtypes = { float32 = true, bfloat16 = true, float16 = true }
local function comparison(name, cfn)
  methods[name] = function(a, b)
    local p = T(a, name)
    if type(b) == "number" then  -- (C directly, as scalar_like)
      local dt = C.fsdp_tensor_dtype(p)
      if not float_dtypes[fsdp._dtype_names[dt]] then dt = C.FSDP_F32 end
      b = wrap(C.fsdp_full(0, nil, b, dt, C.fsdp_tensor_device(p)))
    end
    return (wrap(C[cfn](p, T(b, name, "other", TN))))
  end
end
--- x == other, elementwise: a bool tensor, no gradient.
-- @function Tensor:eq
-- @param other a tensor or a number

--- x ~= other, elementwise: a bool tensor, no gradient.
-- @function Tensor:ne
-- @param other a tensor or a number

--- x < other, elementwise: a bool tensor, no gradient.
-- @function Tensor:lt
-- @param other a tensor or a number

--- x <= other, elementwise: a bool tensor, no gradient.
-- @function Tensor:le
-- @param other a tensor or a number

--- x > other, elementwise: a bool tensor, no gradient.
-- @function Tensor:gt
-- @param other a tensor or a number

--- x >= other, elementwise: a bool tensor, no gradient.
-- @function Tensor:ge
-- @param other a tensor or a number

comparison("eq", "fsdp_eq")
comparison("ne", "fsdp_ne")
comparison("lt", "fsdp_lt")
comparison("le", "fsdp_le")
comparison("gt", "fsdp_gt")
comparison("ge", "fsdp_ge")

-- ---- reductions --------------------------------------------------------------------------------------------
-- dims: nil (all), a number, or a table of numbers
local function dims_arg(t, d, fn)
  if d == nil then return 0, nil end
  local list = type(d) == "table" and d or { d }
  fsdp._list(list, fn, "dims", 3)
  local arr = ffi.new("int[?]", #list)
  local nd = held_ndim(t.p)
  for i = 1, #list do arr[i - 1] = dim(list[i], nd, fn) end
  return #list, arr
end
--- The sum, over all or along dim.
-- @param dim a dim or a list of dims
-- @param keepdim a boolean
-- @function Tensor:sum
function methods.sum(t, d, keepdim)
  local p = T(t, "sum")
  local n, arr = dims_arg(t, d, "sum")
  return (wrap(C.fsdp_sum(p, n, arr, keepdim and 1 or 0)))
end
--- The mean, over all or along dim.
-- @param dim a dim or a list of dims
-- @param keepdim a boolean
-- @function Tensor:mean
function methods.mean(t, d, keepdim)
  local p = T(t, "mean")
  local n, arr = dims_arg(t, d, "mean")
  return (wrap(C.fsdp_mean(p, n, arr, keepdim and 1 or 0)))
end
--- x:max() -> 0-dim max; x:max(dim[, keepdim]) -> values, indices. Index VALUES are 0-based as in
-- PyTorch (they feed index_select, embedding and cross_entropy); dims are 1-based.
-- @function Tensor:max
function methods.max(t, d, keepdim)
  local p = T(t, "max")
  if d == nil then return (wrap(C.fsdp_max_all(p))) end
  local idx = ffi.new("fsdp_tensor*[1]")
  local v = wrap(C.fsdp_max(p, dim(d, held_ndim(p), "max"), keepdim and 1 or 0, idx))
  return v, wrap(idx[0])
end
--- x:min() -> 0-dim min; x:min(dim[, keepdim]) -> values, indices (0-based), as x:max
-- @function Tensor:min
function methods.min(t, d, keepdim)
  local p = T(t, "min")
  if d == nil then return (wrap(C.fsdp_min_all(p))) end
  local idx = ffi.new("fsdp_tensor*[1]")
  local v = wrap(C.fsdp_min(p, dim(d, held_ndim(p), "min"), keepdim and 1 or 0, idx))
  return v, wrap(idx[0])
end
--- The index of the largest element (int64, 0-based), over all or along dim.
-- @param dim a dim or nil
-- @param keepdim a boolean
-- @function Tensor:argmax
function methods.argmax(t, d, keepdim)
  local p = T(t, "argmax")
  if d == nil then return (t:reshape(-1):argmax(1)) end
  return (wrap(C.fsdp_argmax(p, dim(d, held_ndim(p), "argmax"), keepdim and 1 or 0)))
end

-- ---- linear algebra -----------------------------------------------------------------------------------------
--- Matrix product, with PyTorch's rules for 1-D and batched operands.
-- @param other a tensor
-- @function Tensor:matmul
function methods.matmul(a, b) return (wrap(C.fsdp_matmul(T(a, "matmul"), T(b, "matmul", "other")))) end
--- Batched matrix product: (B, n, k) x (B, k, m) -> (B, n, m).
-- @param other a tensor
-- @function Tensor:bmm
function methods.bmm(a, b) return (wrap(C.fsdp_bmm(T(a, "bmm"), T(b, "bmm", "other")))) end

-- ---- views and shape ----------------------------------------------------------------------------------------
--- A view with the shape given (-1 inferred); x must be viewable so.
-- @param ... sizes or a list
-- @function Tensor:view
function methods.view(t, ...)
  local p = T(t, "view")
  local n, arr = shape_of("view", ...)
  return (wrap(C.fsdp_view(p, n, arr)))
end
--- x with the shape given: a view when possible, else a copy (-1 inferred).
-- @param ... sizes or a list
-- @function Tensor:reshape
function methods.reshape(t, ...)
  local p = T(t, "reshape")
  local n, arr = shape_of("reshape", ...)
  return (wrap(C.fsdp_reshape(p, n, arr)))
end
--- x:view(other:shape()).
-- @param other a tensor
-- @function Tensor:view_as
function methods.view_as(t, other)
  T(t, "view_as")
  T(other, "view_as", "other")
  return (t:view(fsdp._held_shape(other)))
end
--- A view with size-1 dims broadcast to the shape given (-1 keeps a size).
-- @param ... sizes or a list
-- @function Tensor:expand
function methods.expand(t, ...)
  local p = T(t, "expand")
  local n, arr = shape_of("expand", ...)
  return (wrap(C.fsdp_expand(p, n, arr)))
end
--- x:expand(other:shape()).
-- @param other a tensor
-- @function Tensor:expand_as
function methods.expand_as(t, other)
  T(t, "expand_as")
  T(other, "expand_as", "other")
  return (t:expand(fsdp._held_shape(other)))
end
--- A view (or copy) with dims start_dim..end_dim merged (defaults 1 and -1).
-- @param start_dim a dim
-- @param end_dim a dim
-- @function Tensor:flatten
function methods.flatten(t, s, e)
  local p = T(t, "flatten")
  local nd = held_ndim(p)
  return (wrap(C.fsdp_flatten(p, dim(s or 1, nd, "flatten"), dim(e or -1, nd, "flatten"))))
end
--- A view with dims dim0 and dim1 swapped.
-- @param dim0 a dim
-- @param dim1 a dim
-- @function Tensor:transpose
function methods.transpose(t, a, b)
  local p = T(t, "transpose")
  local nd = held_ndim(p)
  return (wrap(C.fsdp_transpose(p, dim(a, nd, "transpose"), dim(b, nd, "transpose"))))
end
--- The transpose of a 2-D tensor (a view).
-- @function Tensor:t
function methods.t(t)
  if held_ndim(T(t, "t")) < 2 then return t end
  return (t:transpose(1, 2))
end
--- A view with the dims reordered (1-based).
-- @param ... the dims, or a list
-- @function Tensor:permute
function methods.permute(t, ...)
  local p = T(t, "permute")
  local list, n
  if type((...)) == "table" then list = ...; n = fsdp._list(list, "permute", "dims")
  else list, n = fsdp._pack("permute", "dims", 2, ...) end
  local arr = ffi.new("int[?]", n)
  for i = 1, n do arr[i - 1] = dim(list[i], n, "permute") end
  return (wrap(C.fsdp_permute(p, #list, arr)))
end
--- A view with a size-1 dim inserted at dim.
-- @param dim a dim
-- @function Tensor:unsqueeze
function methods.unsqueeze(t, d)
  local p = T(t, "unsqueeze")
  -- a new dim can go anywhere in 1..ndim+1 (or -1 for the end)
  local nd = held_ndim(p) + 1
  return (wrap(C.fsdp_unsqueeze(p, Tensor._dim_in(d, nd, "unsqueeze", nd - 1))))
end
--- x:squeeze() drops every size-1 dim; x:squeeze(d) or x:squeeze{d1, d2} the given ones (a dim of
-- another size stays, as in PyTorch)
-- @function Tensor:squeeze
function methods.squeeze(t, d)
  local p = T(t, "squeeze")
  local nd = held_ndim(p)
  local list = {}
  if d == nil then
    for i = 1, nd do list[i] = i - 1 end
  elseif type(d) == "table" then
    for i = 1, fsdp._list(d, "squeeze", "dims") do list[i] = Tensor._dim_in(d[i], nd, "squeeze") end
  else
    list[1] = Tensor._dim_in(d, nd, "squeeze")
  end
  if nd == 0 then return (wrap(C.fsdp_squeeze(p, 0))) end
  if #list == 0 then return (t:reshape(fsdp._held_shape(t))) end  -- squeeze{}: nothing to drop
  table.sort(list)
  local r = t
  for i = #list, 1, -1 do  -- from the last, so the earlier dims keep their numbers
    if list[i] ~= list[i + 1] and C.fsdp_tensor_size(r.p, list[i]) == 1 then r = wrap(C.fsdp_squeeze(r.p, list[i])) end
  end
  if r == t then r = wrap(C.fsdp_squeeze(p, list[1])) end  -- no listed dim has size 1: a view all the same
  return r
end
--- x itself when contiguous, else a contiguous copy.
-- @function Tensor:contiguous
function methods.contiguous(t) return (wrap(C.fsdp_contiguous(T(t, "contiguous")))) end
--- A copy with its own storage (gradients flow back to x).
-- @function Tensor:clone
function methods.clone(t) return (wrap(C.fsdp_clone(T(t, "clone")))) end
--- x:narrow(dim, start, length) with a 1-based start (Torch7)
-- @function Tensor:narrow
function methods.narrow(t, d, start, len)
  local p = T(t, "narrow")
  start, len = fsdp._i(start, "narrow", "start"), fsdp._i(len, "narrow", "length", nil, 0)
  return (wrap(C.fsdp_narrow(p, dim(d, held_ndim(p), "narrow"), start - 1, len)))
end
--- The slices of x along dim at index's positions (int64, 0-based).
-- @param dim a dim
-- @param index a 1-D int64 tensor
-- @function Tensor:index_select
function methods.index_select(t, d, index)
  local p = T(t, "index_select")
  return (wrap(C.fsdp_index_select(p, dim(d, held_ndim(p), "index_select"), T(index, "index_select", "index"))))
end
--- x:to(dtype), x:to(device) or x:to{device = "cpu", dtype = "bfloat16"}; a device move returns x
-- itself when x is already there (as PyTorch does)
-- @function Tensor:to
function methods.to(t, what)
  T(t, "to")
  local device, dtype
  if type(what) == "table" and not Tensor.is(what) then
    device, dtype = what.device, what.dtype
    if device == nil and dtype == nil then fsdp._arg_error("to", "options", "{device = ..., dtype = ...}", what, 2) end
  elseif type(what) ~= "string" then
    fsdp._arg_error("to", "dtype or device", "a dtype or device name", what, 2)
  elseif fsdp._devices[what] then
    device = what
  elseif type(what) == "string" and not pcall(dtype_of, what) then
    error(('to: %q is neither a device ("cpu", "cuda") nor a dtype (float32, int64, bfloat16, float16, bool)')
      :format(what), 2)
  else
    dtype = what
  end
  if device ~= nil then t = fsdp._to_device(t, device) end
  if dtype ~= nil then t = wrap(C.fsdp_to_dtype(t.p, dtype_of(dtype, "to"))) end
  return t
end
--- x on the CPU (x itself when there).
-- @function Tensor:cpu
function methods.cpu(t) T(t, "cpu"); return (t:to("cpu")) end
--- x on the GPU (x itself when there).
-- @function Tensor:cuda
function methods.cuda(t) T(t, "cuda"); return (fsdp._to_device(t, "cuda")) end
--- A contiguous copy of CPU tensor x in page-locked (pinned) host memory, which a GPU copies from
-- directly (x itself when pinned already; gradients flow back to x). An error without a GPU (pinned
-- memory is the GPU backend's), and for a tensor that is not on the CPU.
-- @function Tensor:pin_memory
function methods.pin_memory(t)
  local p = T(t, "pin_memory")
  fsdp._device("cuda", "pin_memory", 2)  -- (loads the CUDA backend the first time, or says why there is none)
  return (wrap(C.fsdp_pin_memory(p)))
end
--- Whether x's bytes are in pinned host memory (x:pin_memory()'s, and any view of them).
-- @function Tensor:is_pinned
function methods.is_pinned(t) return C.fsdp_is_pinned(T(t, "is_pinned")) ~= 0 end
--- A float32 copy (x itself when it is one).
-- @function Tensor:float
function methods.float(t) T(t, "float"); return (t:to("float32")) end
--- An int64 copy (x itself when it is one).
-- @function Tensor:long
function methods.long(t) T(t, "long"); return (t:to("int64")) end
--- A bfloat16 copy (x itself when it is one).
-- @function Tensor:bfloat16
function methods.bfloat16(t) T(t, "bfloat16"); return (t:to("bfloat16")) end
--- A float16 copy (x itself when it is one).
-- @function Tensor:half
function methods.half(t) T(t, "half"); return (t:to("float16")) end
--- A bool copy (x itself when it is one).
-- @function Tensor:bool
function methods.bool(t) T(t, "bool"); return (t:to("bool")) end

-- ---- nn shortcuts --------------------------------------------------------------------------------------------
--- F.softmax(x, dim).
-- @param dim a dim
-- @function Tensor:softmax
function methods.softmax(t, d)
  local p = T(t, "softmax")
  return (wrap(C.fsdp_softmax(p, dim(d, held_ndim(p), "softmax"))))
end
--- F.log_softmax(x, dim).
-- @param dim a dim
-- @function Tensor:log_softmax
function methods.log_softmax(t, d)
  local p = T(t, "log_softmax")
  return (wrap(C.fsdp_log_softmax(p, dim(d, held_ndim(p), "log_softmax"))))
end

-- ---- masks, where, clamp, running sums --------------------------------------------------------------
-- fsdp.where/minimum/maximum/tril/triu are installed on the library by Tensor._init
local functions = {}
Tensor.functions = functions

-- a number argument of a binary function becomes a 0-dim tensor of the other's dtype and device
local function scalar_like(v, other)
  if not Tensor.is(other) then return (fsdp.full({}, v)) end
  -- (C directly: this runs inside hot arithmetic loops, whose traces must stay short)
  return (wrap(C.fsdp_full(0, nil, v, C.fsdp_tensor_dtype(other.p), C.fsdp_tensor_device(other.p))))
end

--- fsdp.where(cond, x, y): x where cond (a bool tensor) holds, else y; x, y tensors or numbers
function functions.where(cond, x, y)
  local c = T(cond, "where", "condition", "a bool tensor")
  if type(x) == "number" then x = scalar_like(x, y) end
  if type(y) == "number" then y = scalar_like(y, x) end
  return (wrap(C.fsdp_where(c, T(x, "where", "input", TN), T(y, "where", "other", TN))))
end
--- fsdp.where(condition, x, other).
-- @param condition a bool tensor
-- @param other a tensor or number
-- @function Tensor:where
function methods.where(t, cond, other) T(t, "where"); return (functions.where(cond, t, other)) end

--- A copy of x with value where mask (a bool tensor) holds.
-- @param mask a bool tensor
-- @param value a number
-- @function Tensor:masked_fill
function methods.masked_fill(t, mask, value)
  local p = T(t, "masked_fill")
  return (wrap(C.fsdp_masked_fill(p, T(mask, "masked_fill", "mask", "a bool tensor"), N(value, "masked_fill", "value"))))
end

--- x:clamp(min, max) or x:clamp{min = , max = }; either bound may be nil (not both)
-- @function Tensor:clamp
function methods.clamp(t, lo, hi)
  local p = T(t, "clamp")
  if type(lo) == "table" then lo, hi = lo.min, lo.max end
  if lo ~= nil and type(lo) ~= "number" then fsdp._arg_error("clamp", "min", "a number or nil", lo, 2) end
  if hi ~= nil and type(hi) ~= "number" then fsdp._arg_error("clamp", "max", "a number or nil", hi, 2) end
  if lo == nil and hi == nil then error("clamp: at least one of min and max must be given", 2) end
  local r = t
  if lo ~= nil then r = wrap(C.fsdp_clamp_min(p, lo)) end
  if hi ~= nil then r = wrap(C.fsdp_clamp_max(r.p, hi)) end
  return r
end

-- fsdp.minimum(a, b), fsdp.maximum(a, b): elementwise, broadcasting (numbers become 0-dim tensors)
local function minmax(name, cfn)
  functions[name] = function(a, b)
    if type(a) == "number" then a = scalar_like(a, b) end
    if type(b) == "number" then b = scalar_like(b, a) end
    return (wrap(C[cfn](T(a, name, "input", TN), T(b, name, "other", TN))))
  end
  methods[name] = function(a, b) T(a, name); return (functions[name](a, b)) end
end
--- The elementwise minimum of a and b, broadcasting.
-- @function fsdp.minimum
-- @param a a tensor or a number
-- @param b a tensor or a number

--- The elementwise maximum of a and b, broadcasting.
-- @function fsdp.maximum
-- @param a a tensor or a number
-- @param b a tensor or a number

--- fsdp.minimum(x, other).
-- @function Tensor:minimum
-- @param other a tensor or a number

--- fsdp.maximum(x, other).
-- @function Tensor:maximum
-- @param other a tensor or a number

minmax("minimum", "fsdp_minimum")
minmax("maximum", "fsdp_maximum")

--- Cumulative sum along dim.
-- @param dim a dim
-- @function Tensor:cumsum
function methods.cumsum(t, d)
  local p = T(t, "cumsum")
  local nd = held_ndim(p)
  return (wrap(C.fsdp_cumsum(p, dim(d, math.max(nd, 1), "cumsum"))))
end

-- x:tril([k]), x:triu([k]) over the last two dims (k = 0: the main diagonal; > 0 above it)
local function triangle(name, cfn)
  methods[name] = function(t, k)
    local p = T(t, name)
    k = fsdp._i(k, name, "diagonal", 0)
    return (wrap(C[cfn](p, k)))
  end
  functions[name] = function(t, k) T(t, name, "input"); return (methods[name](t, k)) end
end
--- The lower triangle of x's last two dims (the rest zero).
-- @function fsdp.tril
-- @param x a tensor
-- @param k the diagonal (0: the main one, > 0 above it)

--- The upper triangle of x's last two dims (the rest zero).
-- @function fsdp.triu
-- @param x a tensor
-- @param k the diagonal (0: the main one, > 0 above it)

--- fsdp.tril(x, k).
-- @function Tensor:tril
-- @param k the diagonal (default 0)

--- fsdp.triu(x, k).
-- @function Tensor:triu
-- @param k the diagonal (default 0)

triangle("tril", "fsdp_tril")
triangle("triu", "fsdp_triu")

-- ---- indexing sugar ----------------------------------------------------------------------------------
-- x:select(dim, i) picks position i (1-based, negative from the end) of dim and removes the dim: a
-- view, differentiable. x[i] is x:select(1, i); x[{e1, e2, ...}] applies one entry per leading dim
-- (Torch7's form): an integer selects, {first, last} keeps that inclusive range (narrow; negative
-- from the end; {i} is {i, i}), ":" or {} keeps the whole dim. x[i] = v and x[{...}] = v fill that
-- view with a number or copy a tensor into it (broadcasting), in place.

-- 1-based position i (negative from the end) of a dim of `size` -> 1-based, or an error at `level`
local function position(fn, i, size, d, level, what)
  if type(i) ~= "number" or i ~= math.floor(i) then
    error(("%s: %s for dim %d must be an integer, got %s"):format(fn, what or "index", d, tostring(i)), level + 1)
  end
  local j = i < 0 and i + size + 1 or i
  if j < 1 or j > size then
    error(("%s: index %d is out of range for dim %d of size %d (1-based, negative from the end)")
      :format(fn, i, d, size), level + 1)
  end
  return j
end

-- select on dim d0 (0-based) of t; `shown` is the dim named in errors (1-based)
local function select_at(fn, t, d0, i, shown, level)
  local p = t.p
  local j = position(fn, i, tonumber(C.fsdp_tensor_size(p, d0)), shown, level + 1)
  local n = wrap(C.fsdp_narrow(p, d0, j - 1, 1))
  return (wrap(C.fsdp_squeeze(n.p, d0)))
end

--- The slice at index along dim, that dim removed (a view).
-- @param dim a dim
-- @param index 1-based
-- @function Tensor:select
function methods.select(t, d, i)
  local p = T(t, "select")
  local nd = held_ndim(p)
  if nd == 0 then error("select: cannot select from a 0-dim tensor", 2) end
  local d0 = dim(d, nd, "select")
  if d0 < 0 then d0 = d0 + nd end
  if d0 < 0 or d0 >= nd then
    error(("select: dim %d is out of range for a tensor with %d dims (1-based, negative from the end)"):format(d, nd), 2)
  end
  return (select_at("select", t, d0, i, d0 + 1, 2))
end

-- the view x[key] names: key an integer or a table of entries (see above); errors at `level`
function Tensor.index(t, key, level)
  level = level + 1
  local p = t.p
  if fsdp._piece(p) then fsdp._piece_error(t, "index", nil, level) end
  local nd = held_ndim(p)
  if type(key) == "number" then
    if nd == 0 then error("index: cannot index a 0-dim tensor (use x:item())", level) end
    return (select_at("index", t, 0, key, 1, level))
  end
  local n = table.maxn(key)
  if n > nd then error(("index: %d entries for a tensor with %d dims"):format(n, nd), level) end
  local r, d0 = t, 0  -- d0: where original dim k now is in r
  for k = 1, n do
    local e = key[k]
    local size = tonumber(C.fsdp_tensor_size(r.p, d0))
    if type(e) == "number" then
      r = select_at("index", r, d0, e, k, level)
    elseif e == ":" or (type(e) == "table" and next(e) == nil) then
      d0 = d0 + 1
    elseif type(e) == "table" and not Tensor.is(e) then
      local first = position("index", e[1], size, k, level, "range start")
      local last = e[2] == nil and first or e[2]
      if type(last) ~= "number" or last ~= math.floor(last) then
        error(("index: range end for dim %d must be an integer, got %s"):format(k, tostring(e[2])), level)
      end
      if last < 0 then last = last + size + 1 end
      if last < first - 1 or last > size then
        error(("index: range {%s, %s} is out of range for dim %d of size %d (1-based, inclusive, negative from the end)")
          :format(tostring(e[1]), tostring(e[2]), k, size), level)
      end
      r = wrap(C.fsdp_narrow(r.p, d0, first - 1, last - first + 1))
      d0 = d0 + 1
    else
      error(("index: entry %d must be an integer, a {first, last} range, \":\" or {}, got %s"):format(k, tostring(e)),
        level)
    end
  end
  return r
end

-- x[key] = v: fill_ with a number, copy_ from a tensor (broadcast to the view)
function Tensor.index_assign(t, key, v)
  local view = Tensor.index(t, key, 2)
  if type(v) == "number" then
    check(C.fsdp_fill_(view.p, v))
  else
    check(C.fsdp_copy_(view.p, T(v, "index assignment", "value", TN)))
  end
end

-- ---- selection, sorting, sampling, splitting (ops/select.c; index VALUES 0-based) ------------------------
-- a Lua dim (1-based, negative from the end) of a tensor with nd dims -> C's 0-based dim, checked
-- here so that an error counts dims as the user does; nd is ndim + 1 where a new dim goes in
-- (unsqueeze, stack: `ndim` then says the tensor's own number for the message)
function Tensor._dim_in(d, nd, fn, ndim)
  local c = dim(d, nd, fn)
  local n = math.max(nd, 1)
  if d > n or d < -n then
    error(("%s: dimension %d out of range for a tensor with %d dims (1-based: 1..%d, or -%d..-1 from the end)")
      :format(fn, d, ndim or nd, n, n), 3)
  end
  return c % n
end
local dim_in = Tensor._dim_in
local function bool_opt(v, fn, arg, default)
  if v == nil then return default end
  if type(v) ~= "boolean" then fsdp._arg_error(fn, arg, "a boolean", v, 3) end
  return v
end
--- x:topk(k, {dim = -1, largest = true, sorted = true}) or x:topk(k, dim, largest, sorted) ->
-- values, indices (int64, 0-based); the result is always sorted (sorted = false allows any order)
-- @function Tensor:topk
function methods.topk(t, k, d, largest, sorted)
  local p = T(t, "topk")
  if type(k) ~= "number" or k ~= math.floor(k) then fsdp._arg_error("topk", "k", "an integer", k, 2) end
  if type(d) == "table" then d, largest, sorted = d.dim, d.largest, d.sorted end
  largest = bool_opt(largest, "topk", "largest", true)
  bool_opt(sorted, "topk", "sorted", true)
  local idx = ffi.new("fsdp_tensor*[1]")
  local v = wrap(C.fsdp_topk(p, k, dim_in(d or -1, held_ndim(p), "topk"), largest and 1 or 0, idx))
  return v, wrap(idx[0])
end
-- x:sort({dim = -1, descending = false}) or x:sort(dim, descending) -> values, indices; stable
-- (torch.sort(stable=True)): equal values keep their order, NaN sorts after every number
local function sort_args(t, d, descending, fn)
  local p = T(t, fn)
  if type(d) == "table" then d, descending = d.dim, d.descending end
  descending = bool_opt(descending, fn, "descending", false)
  return p, dim_in(d or -1, held_ndim(p), fn), descending and 1 or 0
end
--- Sorted values and their indices (int64, 0-based) along dim.
-- @param dim a dim (default -1) or options
-- @param descending a boolean
-- @function Tensor:sort
function methods.sort(t, d, descending)
  local p, cd, desc = sort_args(t, d, descending, "sort")
  local idx = ffi.new("fsdp_tensor*[1]")
  local v = wrap(C.fsdp_sort(p, cd, desc, idx))
  return v, wrap(idx[0])
end
--- The indices (int64, 0-based) that sort x along dim.
-- @param dim a dim (default -1) or options
-- @param descending a boolean
-- @function Tensor:argsort
function methods.argsort(t, d, descending)
  local p, cd, desc = sort_args(t, d, descending, "argsort")
  return (wrap(C.fsdp_argsort(p, cd, desc)))
end
--- x:gather(dim, index): out[i][j] = x[i][index[i][j]] for dim 2 (torch.gather)
-- @function Tensor:gather
function methods.gather(t, d, index)
  local p = T(t, "gather")
  return (wrap(C.fsdp_gather(p, dim_in(d, held_ndim(p), "gather"), T(index, "gather", "index"))))
end
--- x:scatter_add(dim, index, src): a copy of x with src[i][j] added at x[i][index[i][j]] for dim 2
-- @function Tensor:scatter_add
function methods.scatter_add(t, d, index, src)
  local p = T(t, "scatter_add")
  local cd = dim_in(d, held_ndim(p), "scatter_add")
  return (wrap(C.fsdp_scatter_add(p, cd, T(index, "scatter_add", "index"), T(src, "scatter_add", "src"))))
end
--- probs:multinomial(n, {replacement = false}) (fsdp.multinomial)
-- @function Tensor:multinomial
function methods.multinomial(t, n, opts)
  T(t, "multinomial")
  return (fsdp.multinomial(t, n, opts))
end
--- x:split(size, dim) (pieces of size, the last one smaller) or x:split({s1, s2, ...}, dim): a list of
-- views (narrow), each with its gradient path; dim defaults to 1
-- @function Tensor:split
function methods.split(t, size, d)
  local p = T(t, "split")
  local cd = dim_in(d or 1, held_ndim(p), "split")
  local len = tonumber(C.fsdp_tensor_size(p, cd))
  local out, start = {}, 1
  if type(size) == "table" then
    local total = 0
    for i = 1, fsdp._list(size, "split", "split_size_or_sections") do
      total = total + fsdp._i(size[i], "split", ("split_size_or_sections[%d]"):format(i), nil, 0)
    end
    if total ~= len then
      error(("split: split_size_or_sections {%s} sum to %d, but dim %d has size %d")
        :format(table.concat(size, ", "), total, cd + 1, len), 2)
    end
    for i = 1, #size do
      out[i] = t:narrow(cd + 1, start, size[i])
      start = start + size[i]
    end
    return out
  end
  if type(size) ~= "number" or size < 1 or size ~= math.floor(size) or size >= 2 ^ 53 then
    fsdp._arg_error("split", "split_size_or_sections", "an integer >= 1 or a list of sizes", size, 2)
  end
  repeat
    out[#out + 1] = t:narrow(cd + 1, start, math.min(size, len - start + 1))
    start = start + size
  until start > len
  return out
end
--- x:chunk(n, dim): at most n views of ceil(size / n) along dim (torch.chunk), the last one smaller
-- @function Tensor:chunk
function methods.chunk(t, n, d)
  local p = T(t, "chunk")
  fsdp._i(n, "chunk", "chunks", nil, 1)
  local cd = dim_in(d or 1, held_ndim(p), "chunk")
  local len = tonumber(C.fsdp_tensor_size(p, cd))
  return (t:split(math.max(math.ceil(len / n), 1), cd + 1))
end
-- repeat counts: varargs or a table of integers >= 0
local function reps_of(fn, ...)
  local first = ...
  local reps, n
  if type(first) == "table" then reps = first; n = fsdp._list(reps, fn, "repeats", 3)
  else reps, n = fsdp._pack(fn, "repeats", 3, ...) end
  if first == nil then error(("%s: repeats must be given (a count per dim)"):format(fn), 3) end
  for i = 1, n do fsdp._i(reps[i], fn, ("repeats[%d]"):format(i), nil, 0) end
  return reps
end
-- x tiled reps[i] times along dim i (reps as many as x's dims, or more: x gets leading size-1 dims).
-- Each repeated dim of size s becomes a (1, s) pair expanded to (r, s) and the whole is reshaped
-- once, so the gradient is one sum over the copies (expand's); a tensor too close to the dim limit
-- repeats a few dims at a time, and one with every dim in use joins copies with cat
local MAX_DIMS = 8  -- FSDP_MAX_DIMS
local function tiled(t, reps)
  local shape = fsdp._held_shape(t)
  local lead = #reps - #shape
  if lead > 0 then
    local s = {}
    for i = 1, lead do s[i] = 1 end
    for i = 1, #shape do s[lead + i] = shape[i] end
    t = t:reshape(s)
  end
  local pending = {}
  for i = 1, #reps do
    if reps[i] ~= 1 then pending[#pending + 1] = i end
  end
  local at = 1
  while at <= #pending do
    shape = fsdp._held_shape(t)
    local room = MAX_DIMS - #shape
    if room == 0 then
      local i, copies = pending[at], {}
      for j = 1, reps[i] do copies[j] = t end
      t = reps[i] == 0 and t:narrow(i, 1, 0) or fsdp.cat(copies, i)
      at = at + 1
    else
      local group = {}
      for k = at, math.min(#pending, at + room - 1) do group[pending[k]] = true end
      at = at + room
      local paired, expanded, final = {}, {}, {}
      for i = 1, #shape do
        if group[i] then
          paired[#paired + 1] = 1
          expanded[#expanded + 1] = reps[i]
        end
        paired[#paired + 1] = shape[i]
        expanded[#expanded + 1] = shape[i]
        final[i] = group[i] and shape[i] * reps[i] or shape[i]
      end
      t = t:reshape(paired):expand(expanded):reshape(final)
    end
  end
  return t
end
--- `repeat` is a Lua keyword: x:repeat(2, 3) does not parse. x:tile(2, 3) (torch.tile: fewer counts than
-- dims repeat the last dims) or x["repeat"](x, 2, 3) (torch.Tensor.repeat: at least one count a dim)
-- @function Tensor:repeat
-- @param ... the counts, one per dim (or a list)
methods["repeat"] = function(t, ...)
  local p = T(t, "repeat")
  local reps = reps_of("repeat", ...)
  if #reps < held_ndim(p) then
    error(("repeat: repeats gives %d counts for a tensor with %d dims (give at least one per dim, or use x:tile)")
      :format(#reps, held_ndim(p)), 2)
  end
  return (tiled(t, reps))
end
--- x repeated along each dim (PyTorch's tile).
-- @param ... the repeats, or a list
-- @function Tensor:tile
function methods.tile(t, ...)
  local p = T(t, "tile")
  local reps = reps_of("tile", ...)
  local nd = held_ndim(p)
  if #reps < nd then
    local r = {}
    for i = 1, nd - #reps do r[i] = 1 end
    for i = 1, #reps do r[nd - #reps + i] = reps[i] end
    reps = r
  end
  return (tiled(t, reps))
end

return Tensor
