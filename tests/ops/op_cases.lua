-- The op-case table: every tensor op the library exposes from Lua, declared once, with the
-- inputs that exercise it (broadcasting, non-contiguous views, empty tensors, odd sizes, the
-- dtypes an op takes, its options). tests/ops/ops_spec.lua runs every case three ways: forward
-- against the naive reference of tests/ops/op_refs.lua (and hand-computed values where a case has
-- them), backward against finite differences, and each backend in fsdp.backends() against the
-- CPU. This is ggml's test-backend-ops idea: adding an op means adding its row here.
--
-- An op (the `ops` registry below) is { call = function(p, inputs...) -> output tensor(s),
-- ref = function(p, arrays...) -> output array(s) }, p being the case's parameters. A case is
--   C{ "op name", input, input, ..., param = value, ... }
-- where an input is a spec (made by T, D, A, V, I, Ri, optionally wrapped by transposed,
-- narrowed, expanded or viewed; `none` for an absent optional input) and every named field is a
-- parameter of the op, except these case options:
--   want, want2   hand-computed values of the first / second output (nested or flat; a number
--                 for a 0-dim output), checked besides the reference
--   tol           {atol, rtol} for the forward checks (default: by the output dtype)
--   fd_eps        the finite-difference step (default 1e-2)
--   fd_tol        {atol, rtol} for the gradient check (default {2e-2, 2e-2})
--   nograd        no backward check (non-differentiable, random, or too large to be worth it)
--   known_failure a library bug, described: the runners expect the case to fail (and fail
--                 themselves once it passes, so the mark is removed with the fix)
local fsdp = require "fsdp"
local R = require "ops.op_refs"
local F = fsdp.nn.functional

local M = {}

-- ---- input specs --------------------------------------------------------------------------------
-- A spec says how to make one input: `base`, the shape of the tensor built from Lua values (that
-- tensor is the leaf the gradient check perturbs), `gen` how the values are drawn, `dtype`, and
-- `view`, an optional function applied to the built tensor (a transpose, a narrow, an expand)
-- to get the non-contiguous tensor the op sees. `label` names it in test names.

local short_dtype = { float32 = "", bfloat16 = " bf16", float16 = " f16", int64 = " i64", bool = " b" }

-- the array part of t (a shape), and its named fields merged with `extra`
local function shape_and_options(t, extra)
  local shape = {}
  for i = 1, #t do
    shape[i] = t[i]
  end
  local o = {}
  for k, v in pairs(t) do
    if type(k) == "string" then
      o[k] = v
    end
  end
  for k, v in pairs(extra or {}) do
    o[k] = v
  end
  return shape, o
end

local function spec(shape, o, gen)
  local dtype = o.dtype or "float32"
  return {
    base = shape,
    gen = gen,
    lo = o.lo,
    hi = o.hi,
    away = o.away,
    start = o.start,
    set = o.set,
    values = o.values,
    dtype = dtype,
    const = o.const,
    dims_label = table.concat(shape, "x"),
    label = table.concat(shape, "x") .. short_dtype[dtype],
  }
end

-- the same spec with float32 values stored as `dtype` (its label says so, before any view's mark)
local function in_dtype(s, dtype)
  local c = {}
  for k, v in pairs(s) do
    c[k] = v
  end
  c.dtype = dtype
  c.label = s.dims_label .. short_dtype[dtype] .. s.label:sub(#s.dims_label + 1)
  return c
end

-- uniform random values in [lo, hi] (default [-2, 2]); away = a: |value| >= a (kinks, poles);
-- const = true: not a gradient-check input
local function T(t, extra)
  local shape, o = shape_and_options(t, extra)
  o.lo = o.lo or -2
  o.hi = o.hi or 2
  return spec(shape, o, "uniform")
end

-- distinct values, at least 2 / numel apart, in [-1, 1) (max and max pooling need no near-ties)
local function D(t, extra)
  local shape, o = shape_and_options(t, extra)
  return spec(shape, o, "distinct")
end

-- 0, 1, 2, ... (or from `start`) in row-major order
local function A(t, extra)
  local shape, o = shape_and_options(t, extra)
  o.start = o.start or 0
  return spec(shape, o, "iota")
end

-- explicit values: a number (0-dim) or a nested table; o.dtype
local function V(data, o)
  o = o or {}
  local shape = {}
  local flat = {}
  if type(data) == "number" then
    flat[1] = data
  else
    local node = data
    while type(node) == "table" do
      shape[#shape + 1] = #node
      node = node[1]
    end
    local function walk(t)
      for _, v in ipairs(t) do
        if type(v) == "table" then
          walk(v)
        else
          flat[#flat + 1] = v
        end
      end
    end
    walk(data)
  end
  local opts = { values = flat }
  for k, v in pairs(o) do
    opts[k] = v
  end
  return spec(shape, opts, "values")
end

-- explicit int64 values (class indices, embedding rows: 0-based)
local function I(data)
  return V(data, { dtype = "int64" })
end

-- random integers in [lo, hi) of the given shape, int64 unless o.dtype; o.set = {[k] = v}
-- overrides the k-th value (an ignore_index, say)
local function Ri(lo, hi, shape, o)
  o = o or {}
  local opts = { lo = lo, hi = hi, dtype = o.dtype or "int64", set = o.set }
  return spec(shape, opts, "ints")
end

-- absent optional input (a missing weight before a given bias)
local none = { none = true, label = "-" }

-- the wrappers below return a new spec (the one given may be shared by other cases)
local function copy_spec(s)
  local c = {}
  for k, v in pairs(s) do
    c[k] = v
  end
  return c
end

-- same logical shape, stored with the last two dims swapped: the op sees a transposed view
local function transposed(s)
  s = copy_spec(s)
  local b = {}
  for i = 1, #s.base do
    b[i] = s.base[i]
  end
  b[#b - 1], b[#b] = b[#b], b[#b - 1]
  s.base = b
  s.view = function(t) return t:transpose(-1, -2) end
  s.label = s.label .. ":t"
  return s
end

-- same logical shape, the last dim cut at offset 1 out of a wider stored one (offset and stride)
local function narrowed(s)
  s = copy_spec(s)
  local n = s.base[#s.base]
  local b = {}
  for i = 1, #s.base do
    b[i] = s.base[i]
  end
  b[#b] = n + 3
  s.base = b
  s.view = function(t) return t:narrow(-1, 2, n) end
  s.label = s.label .. ":n"
  return s
end

-- the stored tensor expanded (stride 0) to `shape` (its gradient sums the op's gradients of the
-- expanded view: `broadcast`)
local function expanded(s, shape)
  s = copy_spec(s)
  s.broadcast = true
  s.view = function(t) return t:expand(shape) end
  s.label = s.label .. ":e" .. table.concat(shape, "x")
  return s
end

-- any other view of the stored tensor
local function viewed(s, fn, what)
  s = copy_spec(s)
  s.view = fn
  s.label = s.label .. ":" .. what
  return s
end

local exact = { 0, 0 }

-- ---- the ops ------------------------------------------------------------------------------------
local ops = {}
M.ops = ops

-- the operators, on numbers (the references) and tensors (the calls) alike
local function add(x, y) return x + y end
local function sub(x, y) return x - y end
local function mul(x, y) return x * y end
local function div(x, y) return x / y end

-- elementwise binary, broadcasting: a + b, or a:add(b) with method = true
local function binary(operator, method)
  return function(p, a, b)
    if p.method then
      return a[method](a, b)
    end
    return operator(a, b)
  end
end
ops.add = { call = binary(add, "add"), ref = R.map2(add) }
ops.sub = { call = binary(sub, "sub"), ref = R.map2(sub) }
ops.mul = { call = binary(mul, "mul"), ref = R.map2(mul) }
ops.div = { call = binary(div, "div"), ref = R.map2(div) }

-- scalar forms, a number s on either side
ops.add_scalar = { call = function(p, a) return a + p.s end, ref = R.map(function(x, p) return x + p.s end) }
ops.radd_scalar = { call = function(p, a) return p.s + a end, ref = R.map(function(x, p) return p.s + x end) }
ops.sub_scalar = { call = function(p, a) return a - p.s end, ref = R.map(function(x, p) return x - p.s end) }
ops.rsub_scalar = { call = function(p, a) return p.s - a end, ref = R.map(function(x, p) return p.s - x end) }
ops.mul_scalar = { call = function(p, a) return a * p.s end, ref = R.map(function(x, p) return x * p.s end) }
ops.rmul_scalar = { call = function(p, a) return p.s * a end, ref = R.map(function(x, p) return p.s * x end) }
ops.div_scalar = { call = function(p, a) return a / p.s end, ref = R.map(function(x, p) return x / p.s end) }
ops.rdiv_scalar = { call = function(p, a) return p.s / a end, ref = R.map(function(x, p) return p.s / x end) }
ops.pow = {
  call = function(p, a)
    if p.method then
      return a:pow(p.s)
    end
    return a ^ p.s
  end,
  ref = R.map(function(x, p) return x ^ p.s end),
}

-- unary
ops.neg = {
  call = function(p, a)
    if p.method then
      return a:neg()
    end
    return -a
  end,
  ref = R.map(function(x) return -x end),
}
ops.exp = { call = function(_, a) return a:exp() end, ref = R.map(function(x) return math.exp(x) end) }
ops.log = { call = function(_, a) return a:log() end, ref = R.map(function(x) return math.log(x) end) }
ops.sqrt = { call = function(_, a) return a:sqrt() end, ref = R.map(function(x) return math.sqrt(x) end) }
ops.abs = { call = function(_, a) return a:abs() end, ref = R.map(function(x) return math.abs(x) end) }
ops.tanh = { call = function(_, a) return a:tanh() end, ref = R.map(function(x) return math.tanh(x) end) }
ops.sigmoid = { call = function(_, a) return a:sigmoid() end, ref = R.map(R.sigmoid) }
ops.relu = { call = function(_, a) return a:relu() end, ref = R.map(R.relu) }
ops.gelu = { call = function(p, a) return a:gelu(p.approximate) end, ref = R.map(R.gelu) }
ops["F.relu"] = { call = function(_, a) return F.relu(a) end, ref = R.map(R.relu) }
ops["F.tanh"] = { call = function(_, a) return F.tanh(a) end, ref = R.map(function(x) return math.tanh(x) end) }
ops["F.sigmoid"] = { call = function(_, a) return F.sigmoid(a) end, ref = R.map(R.sigmoid) }
ops["F.silu"] = { call = function(_, a) return F.silu(a) end, ref = R.map(function(x) return x * R.sigmoid(x) end) }
-- F.gelu(x), F.gelu(x, {approximate = ...}) or, with opts = {}, F.gelu(x, {})
ops["F.gelu"] = {
  call = function(p, a)
    if p.opts then
      return F.gelu(a, p.opts)
    end
    if p.approximate == nil then
      return F.gelu(a)
    end
    return F.gelu(a, { approximate = p.approximate })
  end,
  ref = R.map(R.gelu),
}

-- comparison: bool, no gradient
local function same(x, y)
  if x == y then
    return 1
  end
  return 0
end
ops.eq = { call = function(_, a, b) return a:eq(b) end, ref = R.map2(same, "bool"), nograd = true }
ops.eq_scalar = {
  call = function(p, a) return a:eq(p.s) end,
  ref = R.map(function(x, p) return same(x, p.s) end, "bool"),
  nograd = true,
}

-- reductions: dim nil (all), a number or a table; max(dim) returns values and indices
ops.sum = { call = function(p, a) return a:sum(p.dim, p.keepdim) end, ref = R.sum }
ops.mean = { call = function(p, a) return a:mean(p.dim, p.keepdim) end, ref = R.mean }
ops.max = { call = function(p, a) return a:max(p.dim, p.keepdim) end, ref = R.max }
ops.argmax = { call = function(p, a) return a:argmax(p.dim, p.keepdim) end, ref = R.argmax, nograd = true }

-- softmax
ops.softmax = { call = function(p, a) return a:softmax(p.dim) end, ref = R.softmax }
ops.log_softmax = { call = function(p, a) return a:log_softmax(p.dim) end, ref = R.log_softmax }
ops["F.softmax"] = { call = function(p, a) return F.softmax(a, p.dim) end, ref = R.softmax }
ops["F.log_softmax"] = { call = function(p, a) return F.log_softmax(a, p.dim) end, ref = R.log_softmax }

-- linear algebra
ops.matmul = { call = function(_, a, b) return a:matmul(b) end, ref = R.matmul }
ops.bmm = { call = function(_, a, b) return a:bmm(b) end, ref = R.bmm }
ops.linear = { call = function(_, x, w, b) return F.linear(x, w, b) end, ref = R.linear }

-- views and shape
ops.view = { call = function(p, a) return a:view(p.shape) end, ref = R.reshape }
ops.reshape = { call = function(p, a) return a:reshape(p.shape) end, ref = R.reshape }
ops.view_as = { call = function(_, a, b) return a:view_as(b) end, ref = R.view_as }
ops.flatten = { call = function(p, a) return a:flatten(p.start_dim, p.end_dim) end, ref = R.flatten }
ops["F.flatten"] = { call = function(p, a) return F.flatten(a, p.start_dim, p.end_dim) end, ref = R.flatten }
ops.transpose = { call = function(p, a) return a:transpose(p.dims[1], p.dims[2]) end, ref = R.transpose }
ops.t = { call = function(_, a) return a:t() end, ref = R.t }
ops.T = { call = function(_, a) return a.T end, ref = R.t }
ops.permute = { call = function(p, a) return a:permute(p.dims) end, ref = R.permute }
ops.unsqueeze = { call = function(p, a) return a:unsqueeze(p.dim) end, ref = R.unsqueeze }
ops.squeeze = { call = function(p, a) return a:squeeze(p.dim) end, ref = R.squeeze }
ops.expand = { call = function(p, a) return a:expand(p.shape) end, ref = R.expand }
ops.expand_as = { call = function(_, a, b) return a:expand_as(b) end, ref = R.expand_as }
ops.narrow = { call = function(p, a) return a:narrow(p.dim, p.start, p.length) end, ref = R.narrow }
ops.contiguous = { call = function(_, a) return a:contiguous() end, ref = R.identity }
ops.clone = { call = function(_, a) return a:clone() end, ref = R.identity }
ops.detach = { call = function(_, a) return a:detach() end, ref = R.identity, nograd = true }
ops.cat = { call = function(p, ...) return fsdp.cat({ ... }, p.dim) end, ref = R.cat }
ops.index_select = { call = function(p, a, idx) return a:index_select(p.dim, idx) end, ref = R.index_select }

-- dtype and device conversion
local function to_ref(dtype)
  return function(_, a) return R.to({ dtype = dtype }, a) end
end
ops.to = { call = function(p, a) return a:to(p.dtype) end, ref = R.to }
ops.float = { call = function(_, a) return a:float() end, ref = to_ref("float32") }
ops.long = { call = function(_, a) return a:long() end, ref = to_ref("int64"), nograd = true }
ops.bfloat16 = { call = function(_, a) return a:bfloat16() end, ref = to_ref("bfloat16"), nograd = true }
ops.half = { call = function(_, a) return a:half() end, ref = to_ref("float16"), nograd = true }
ops.cpu = { call = function(_, a) return a:cpu() end, ref = R.identity }

-- convolution and pooling (F); positional = true passes the options positionally
ops.conv2d = {
  call = function(p, x, w, b)
    if p.positional then
      return F.conv2d(x, w, b, p.stride, p.padding, p.dilation, p.groups)
    end
    return F.conv2d(x, w, b, { stride = p.stride, padding = p.padding, dilation = p.dilation, groups = p.groups })
  end,
  ref = R.conv2d,
}
ops.conv_transpose2d = {
  call = function(p, x, w, b)
    if p.positional then
      return F.conv_transpose2d(x, w, b, p.stride, p.padding, p.output_padding, p.groups, p.dilation)
    end
    return F.conv_transpose2d(x, w, b, { stride = p.stride, padding = p.padding, output_padding = p.output_padding,
      groups = p.groups, dilation = p.dilation })
  end,
  ref = R.conv_transpose2d,
}
ops.max_pool2d = {
  call = function(p, x)
    return F.max_pool2d(x, p.kernel, { stride = p.stride, padding = p.padding, dilation = p.dilation,
      ceil_mode = p.ceil_mode })
  end,
  ref = R.max_pool2d,
}
ops.avg_pool2d = {
  call = function(p, x)
    return F.avg_pool2d(x, p.kernel, { stride = p.stride, padding = p.padding, ceil_mode = p.ceil_mode,
      count_include_pad = p.count_include_pad })
  end,
  ref = R.avg_pool2d,
}
ops.adaptive_avg_pool2d = {
  call = function(p, x) return F.adaptive_avg_pool2d(x, p.size) end,
  ref = R.adaptive_avg_pool2d,
}

-- normalization, embedding, dropout, losses, attention (F)
ops.layer_norm = { call = function(p, x, w, b) return F.layer_norm(x, p.shape, w, b, p.eps) end, ref = R.layer_norm }
ops.batch_norm = {
  call = function(p, x, rm, rv, w, b)
    return F.batch_norm(x, rm, rv, w, b, { training = p.training, eps = p.eps })
  end,
  ref = R.batch_norm,
}
-- one rank: batch_norm (tests/scripts/fsdp_matrix.lua checks it over several)
ops.sync_batch_norm = {
  call = function(p, x, rm, rv, w, b)
    return F.sync_batch_norm(x, rm, rv, w, b, { training = p.training, eps = p.eps })
  end,
  ref = R.batch_norm,
}
ops.group_norm = { call = function(p, x, w, b) return F.group_norm(x, p.groups, w, b, p.eps) end, ref = R.group_norm }
ops.rms_norm = { call = function(p, x, w) return F.rms_norm(x, p.shape, w, p.eps) end, ref = R.rms_norm }
ops.embedding = { call = function(p, idx, w) return F.embedding(idx, w, p.padding_idx) end, ref = R.embedding }
ops.dropout = { call = function(p, x) return F.dropout(x, p.p, p.training) end, ref = R.dropout }
ops.dropout2d = { call = function(p, x) return F.dropout2d(x, p.p, p.training) end, ref = R.dropout2d }
ops.cross_entropy = {
  call = function(p, x, t)
    return F.cross_entropy(x, t, { ignore_index = p.ignore_index, label_smoothing = p.label_smoothing })
  end,
  ref = R.cross_entropy,
}
ops.nll_loss = {
  call = function(p, x, t) return F.nll_loss(x, t, { ignore_index = p.ignore_index }) end,
  ref = R.nll_loss,
}
ops.mse_loss = { call = function(_, a, b) return F.mse_loss(a, b) end, ref = R.mse_loss }
ops.scaled_dot_product_attention = {
  call = function(p, q, k, v, mask)
    return F.scaled_dot_product_attention(q, k, v, { attn_mask = mask, is_causal = p.is_causal, scale = p.scale })
  end,
  ref = R.scaled_dot_product_attention,
}

-- comparisons ne, lt, le, gt, ge (eq above): a tensor or, with _scalar, a number p.s
local comparisons = {
  ne = function(x, y) return x ~= y end,
  lt = function(x, y) return x < y end,
  le = function(x, y) return x <= y end,
  gt = function(x, y) return x > y end,
  ge = function(x, y) return x >= y end,
}
for name, f in pairs(comparisons) do
  local function bit(x, y)
    if f(x, y) then
      return 1
    end
    return 0
  end
  ops[name] = { call = function(_, a, b) return a[name](a, b) end, ref = R.map2(bit, "bool"), nograd = true }
  ops[name .. "_scalar"] = {
    call = function(p, a) return a[name](a, p.s) end,
    ref = R.map(function(x, p) return bit(x, p.s) end, "bool"),
    nograd = true,
  }
end

-- where(cond, x, y) (method = true: x:where(cond, y)); where_scalar: y the number p.s
ops.where = {
  call = function(p, c, x, y)
    if p.method then
      return x:where(c, y)
    end
    return fsdp.where(c, x, y)
  end,
  ref = R.where,
}
ops.where_scalar = {
  call = function(p, c, x) return fsdp.where(c, x, p.s) end,
  ref = function(p, c, x) return R.where(p, c, x, R.array({}, { p.s }, x.dtype)) end,
}
ops.masked_fill = { call = function(p, x, m) return x:masked_fill(m, p.value) end, ref = R.masked_fill }
-- x:clamp(min, max), or x:clamp{min =, max =} with kw = true
ops.clamp = {
  call = function(p, x)
    if p.kw then
      return x:clamp { min = p.min, max = p.max }
    end
    return x:clamp(p.min, p.max)
  end,
  ref = R.clamp,
}
local function minmax_call(name)
  return function(p, a, b)
    if p.method then
      return a[name](a, b)
    end
    return fsdp[name](a, b)
  end
end
ops.minimum = { call = minmax_call("minimum"), ref = R.map2(math.min) }
ops.maximum = { call = minmax_call("maximum"), ref = R.map2(math.max) }
ops.min = { call = function(p, a) return a:min(p.dim, p.keepdim) end, ref = R.min }
ops.cumsum = { call = function(p, a) return a:cumsum(p.dim) end, ref = R.cumsum }
-- x:tril(k) / x:triu(k), or fsdp.tril(x, k) with fn = true
local function triangle_call(name)
  return function(p, a)
    if p.fn then
      return fsdp[name](a, p.k)
    end
    return a[name](a, p.k)
  end
end
ops.tril = { call = triangle_call("tril"), ref = R.tril }
ops.triu = { call = triangle_call("triu"), ref = R.triu }
-- indexing sugar: x:select(dim, i) and x[key]
ops.select = { call = function(p, a) return a:select(p.dim, p.i) end, ref = R.select }
ops.index = { call = function(p, a) return a[p.key] end, ref = R.index }

-- ---- the case list ------------------------------------------------------------------------------
local cases = {}
M.cases = cases

local options = {
  want = true, want2 = true, tol = true, fd_eps = true, fd_tol = true, nograd = true, known_failure = true,
}

-- "k=v" for a parameter value in a test name
local function show(v)
  if type(v) == "table" then
    local parts = {}
    for i = 1, #v do
      parts[i] = show(v[i])
    end
    return "{" .. table.concat(parts, ",") .. "}"
  end
  return tostring(v)
end

local function C(t)
  local c = { op = t[1], inputs = {}, p = {} }
  assert(ops[c.op], "op_cases: unknown op " .. tostring(c.op))
  for i = 2, table.maxn(t) do
    c.inputs[i - 1] = t[i]
  end
  local keys = {}
  for k, v in pairs(t) do
    if type(k) == "string" then
      if options[k] then
        c[k] = v
      else
        c.p[k] = v
        keys[#keys + 1] = k
      end
    end
  end
  table.sort(keys)
  local labels = {}
  for i, s in ipairs(c.inputs) do
    labels[i] = s.label
  end
  local params = {}
  for i, k in ipairs(keys) do
    params[i] = k .. "=" .. show(c.p[k])
  end
  c.name = ("%s (%s)"):format(c.op, table.concat(labels, ", "))
  if #params > 0 then
    c.name = c.name .. " " .. table.concat(params, " ")
  end
  c.def = ops[c.op]
  cases[#cases + 1] = c
end

-- ---- elementwise binary -------------------------------------------------------------------------
local a23 = V { { 1, 2, 3 }, { 4, 5, 6 } }
local b23 = V { { 6, 5, 4 }, { 3, 2, 0.5 } }
C { "add", a23, b23, want = { { 7, 7, 7 }, { 7, 7, 6.5 } }, tol = exact }
C { "sub", a23, b23, want = { { -5, -3, -1 }, { 1, 3, 5.5 } }, tol = exact }
C { "mul", a23, b23, want = { { 6, 10, 12 }, { 12, 10, 3 } }, tol = exact }
C { "div", a23, b23, want = { { 1 / 6, 0.4, 0.75 }, { 4 / 3, 2.5, 12 } }, tol = { 1e-7, 1e-6 } }

-- broadcasting pairs (right operands kept in [0.5, 2] for div)
local broadcast_pairs = {
  { { 2, 3 }, { 3 } }, { { 2, 3 }, { 2, 1 } }, { { 2, 1 }, { 1, 3 } }, { { 3, 1, 2 }, { 4, 1 } },
  { { 1 }, { 2, 2 } }, { {}, { 2, 3 } }, { { 2, 3, 4 }, {} }, { { 4, 1, 3, 1 }, { 2, 1, 5 } },
  { { 5, 4 }, { 5, 4 } }, { { 1, 4 }, { 5, 1 } }, { { 4 }, { 3, 1 } }, { {}, { 2, 2 } },
  { { 7, 13 }, { 13 } }, { { 7, 1 }, { 1, 13 } },                   -- odd sizes
  { { 0, 3 }, { 3 } }, { { 0, 3 }, { 1 } }, { { 2, 0 }, { 2, 1 } }, -- empty
}
for _, pair in ipairs(broadcast_pairs) do
  for _, op in ipairs { "add", "sub", "mul", "div" } do
    local eps = nil
    if op == "div" then
      eps = 1e-3
    end
    C { op, T(pair[1]), T(pair[2], { lo = 0.5, hi = 2 }), fd_eps = eps }
  end
end
-- non-contiguous and expanded operands, read in place
for _, op in ipairs { "add", "sub", "mul", "div" } do
  C { op, transposed(T { 4, 3 }), expanded(T({ 3 }, { lo = 0.5, hi = 2 }), { 4, 3 }), fd_eps = 1e-3 }
  C { op, narrowed(T { 3, 7 }), transposed(T({ 3, 7 }, { lo = 0.5, hi = 2 })), fd_eps = 1e-3 }
  C { op, T { 2, 3 }, T({ 3 }, { lo = 0.5, hi = 2 }), method = true }
end
local function corner_a(t) return t:narrow(1, 1, 2):narrow(2, 2, 2) end
local function corner_b(t) return t:narrow(1, 2, 2):narrow(2, 1, 2) end
C { "sub", viewed(A { 3, 4 }, corner_a, "rows1-2,cols2-3"), viewed(A { 3, 4 }, corner_b, "rows2-3,cols1-2"),
  want = { 1 - 4, 2 - 5, 5 - 8, 6 - 9 } }
C { "mul", transposed(T { 7, 13 }), T({ 7, 1 }, { lo = 0.5, hi = 2 }) }

-- ---- scalar forms -------------------------------------------------------------------------------
local x124 = V { 1, 2, 4 }
C { "add_scalar", x124, s = 2, want = { 3, 4, 6 }, tol = exact }
C { "radd_scalar", x124, s = 2, want = { 3, 4, 6 }, tol = exact }
C { "sub_scalar", x124, s = 2, want = { -1, 0, 2 }, tol = exact }
C { "rsub_scalar", x124, s = 2, want = { 1, 0, -2 }, tol = exact }
C { "mul_scalar", x124, s = 3, want = { 3, 6, 12 }, tol = exact }
C { "rmul_scalar", x124, s = 3, want = { 3, 6, 12 }, tol = exact }
C { "div_scalar", x124, s = 4, want = { 0.25, 0.5, 1 }, tol = exact }
C { "rdiv_scalar", x124, s = 4, want = { 4, 2, 1 }, tol = exact }
C { "neg", x124, want = { -1, -2, -4 }, tol = exact }
C { "pow", x124, s = 2, want = { 1, 4, 16 }, tol = exact }
C { "pow", x124, s = 3, want = { 1, 8, 64 }, tol = exact }
C { "pow", x124, s = -1, want = { 1, 0.5, 0.25 }, tol = exact }
C { "pow", x124, s = 0.5, want = { 1, math.sqrt(2), 2 }, tol = { 1e-7, 1e-6 } }
C { "pow", x124, s = 1.5, want = { 1, 2 ^ 1.5, 8 }, tol = { 1e-6, 1e-6 } }
C { "pow", x124, s = 0, want = { 1, 1, 1 }, tol = exact }
C { "pow", x124, s = 1, want = { 1, 2, 4 }, tol = exact }
-- on (3, 4) positive values, with gradients
local pos34 = T { 3, 4, lo = 0.5, hi = 1.5 }
C { "add_scalar", pos34, s = 3 }
C { "radd_scalar", pos34, s = -1 }
C { "sub_scalar", pos34, s = 0.5 }
C { "rsub_scalar", pos34, s = 3 }
C { "mul_scalar", pos34, s = -2.5 }
C { "rmul_scalar", pos34, s = 4 }
C { "div_scalar", pos34, s = 3 }
C { "rdiv_scalar", pos34, s = 2, fd_eps = 1e-3 }
C { "neg", pos34 }
C { "neg", T { 2, 3 }, method = true }
for _, s in ipairs { 2, 3, 0.5, -1, 1.5, 0, 1, -0.5 } do
  C { "pow", pos34, s = s, fd_eps = 1e-3 }
end
C { "pow", T { 2, 3, lo = 0.5, hi = 1.5 }, s = 2, method = true }
C { "mul_scalar", transposed(T { 7, 13 }), s = 0.5 }
C { "pow", transposed(T { 5, 3, lo = 0.5, hi = 2 }), s = 1.5, fd_eps = 1e-3 }
C { "rdiv_scalar", narrowed(T { 13, lo = 0.5, hi = 2 }), s = 3, fd_eps = 1e-3 }
C { "add_scalar", T { 0, 3 }, s = 1 }

-- ---- unary --------------------------------------------------------------------------------------
local grid = V { -3, -1.5, -0.5, -0.1, 0.2, 0.7, 1, 2.5, 4 }
local kinks = V { { -2.1, -0.7, -0.3 }, { 0.4, 1.3, 2.2 } } -- away from the kinks of relu and abs
local positive = V { 0.1, 0.5, 1, 2, 10, 1e-3, 1e4 }
for _, op in ipairs { "exp", "tanh", "abs", "sigmoid", "relu", "neg" } do
  C { op, grid, tol = { 1e-7, 2e-7 }, fd_eps = 1e-3 }
  C { op, kinks, fd_eps = 1e-3 }
  C { op, T { 7, 13, away = 0.1 }, fd_eps = 1e-3 }
  C { op, T { 0, 3 } }
end
for _, op in ipairs { "log", "sqrt" } do
  C { op, positive, tol = { 1e-7, 2e-7 }, nograd = true } -- 1e-3 is too close to the pole for differences
  C { op, T { 2, 3, lo = 0.5, hi = 1.5 }, fd_eps = 1e-3 }
  C { op, narrowed(T { 7, 13, lo = 0.5, hi = 3 }), fd_eps = 1e-3 }
  C { op, T { 0, 3, lo = 0.5, hi = 1.5 } }
end
C { "exp", transposed(T { 4, 3 }), fd_eps = 1e-3 }
C { "tanh", expanded(T { 3, 1 }, { 3, 5 }) }
-- gelu: x * Phi(x) from tabulated normal CDF values, PyTorch's erf and tanh formulas
C { "gelu", V { 1, -1, 0.5, 2, -3, 0 }, tol = { 2.5e-7, 1e-6 },
  want = { 0.8413447460685429, -0.15865525393145707, 0.5 * 0.6914624612740131, 2 * 0.9772498680518208,
    -3 * 0.0013498980316301, 0 } }
C { "gelu", grid, tol = { 4e-7, 1e-6 }, fd_eps = 1e-3 }
C { "gelu", grid, approximate = "tanh", tol = { 1e-7, 1e-6 }, fd_eps = 1e-3 }
C { "gelu", kinks, fd_eps = 1e-3 }
C { "gelu", kinks, approximate = "tanh", fd_eps = 1e-3 }
C { "gelu", transposed(T { 7, 13 }), approximate = "tanh", fd_eps = 1e-3 }
C { "gelu", T { 0, 3 } }
C { "F.relu", T { 3, 5, away = 0.1 }, fd_eps = 1e-3 }
C { "F.tanh", T { 3, 5 }, fd_eps = 1e-3 }
C { "F.sigmoid", transposed(T { 3, 5 }), fd_eps = 1e-3 }
-- silu: x * sigmoid(x), against its exact values x / (1 + e^-x) at 1, -1, 2, -3, 0
C { "F.silu", V { 1, -1, 2, -3, 0 }, tol = { 1e-7, 1e-6 },
  want = { 0.7310585786300049, -0.2689414213699951, 1.7615941559557646, -0.14227761953270035, 0 } }
C { "F.silu", T { 7, 13, lo = -6, hi = 6 }, fd_eps = 1e-3 }
C { "F.silu", transposed(T { 3, 5 }), fd_eps = 1e-3 }
C { "F.silu", T { 0, 3 } }
C { "F.gelu", T { 3, 5 }, fd_eps = 1e-3 }
C { "F.gelu", T { 3, 5 }, approximate = "tanh", fd_eps = 1e-3 }
C { "F.gelu", T { 3, 5 }, opts = { approximate = "none" }, fd_eps = 1e-3 }
-- an options table without `approximate` means the default, as in F.dropout or F.conv2d
C { "F.gelu", T { 3, 5 }, opts = {}, fd_eps = 1e-3 }

-- ---- eq -----------------------------------------------------------------------------------------
local i057 = I { 0, 5, 7 }
C { "eq", V { { 1, 2, 3 }, { 3, 2, 1 } }, V { 3, 2, 1 }, want = { { 0, 1, 0 }, { 1, 1, 1 } } }
C { "eq", i057, I { 0, 4, 7 }, want = { 1, 0, 1 } }
C { "eq_scalar", i057, s = 5, want = { 0, 1, 0 } }
C { "eq", i057, V { 0, 0, 7 }, want = { 1, 0, 1 } }
C { "eq", Ri(0, 3, { 7, 13 }, { dtype = "float32" }), Ri(0, 3, { 13 }, { dtype = "float32" }) }
C { "eq", transposed(Ri(0, 3, { 4, 5 }, { dtype = "float32" })), Ri(0, 3, { 4, 1 }, { dtype = "float32" }) }
C { "eq", Ri(0, 3, { 3, 4 }, { dtype = "bfloat16" }), Ri(0, 3, { 3, 4 }, { dtype = "bfloat16" }) }
C { "eq", Ri(0, 3, { 3, 4 }, { dtype = "float16" }), Ri(0, 3, { 4 }, { dtype = "float16" }) }
C { "eq", T { 0, 3 }, T { 3 } }
C { "eq_scalar", Ri(0, 3, { 2, 5 }, { dtype = "float32" }), s = 1 }

-- ---- sum and mean -------------------------------------------------------------------------------
local x24 = V { { { 1, 2, 3, 4 }, { 5, 6, 7, 8 }, { 9, 10, 11, 12 } },
  { { 13, 14, 15, 16 }, { 17, 18, 19, 20 }, { 21, 22, 23, 24 } } } -- (2, 3, 4)
C { "sum", x24, want = 300 }
C { "sum", x24, dim = 1, want = { { 14, 16, 18, 20 }, { 22, 24, 26, 28 }, { 30, 32, 34, 36 } } }
C { "sum", x24, dim = 2, want = { { 15, 18, 21, 24 }, { 51, 54, 57, 60 } } }
C { "sum", x24, dim = 3, want = { { 10, 26, 42 }, { 58, 74, 90 } } }
C { "sum", x24, dim = -1, want = { { 10, 26, 42 }, { 58, 74, 90 } } }
C { "sum", x24, dim = 3, keepdim = true, want = { { { 10 }, { 26 }, { 42 } }, { { 58 }, { 74 }, { 90 } } } }
C { "sum", x24, dim = { 1, 2 }, want = { 66, 72, 78, 84 } }
C { "sum", x24, dim = { 1, 3 }, want = { 68, 100, 132 } }
C { "sum", x24, dim = { 3, 1 }, keepdim = true, want = { { { 68 }, { 100 }, { 132 } } } }
C { "sum", x24, dim = { 1, 3 }, keepdim = true }
C { "sum", x24, dim = { 1, 2, 3 }, keepdim = true }
C { "sum", viewed(x24, function(t) return t:permute(3, 1, 2) end, "permute(3,1,2)"), dim = 3,
  want = { { 15, 51 }, { 18, 54 }, { 21, 57 }, { 24, 60 } } }
C { "sum", V { { { 1 }, { 2 } } }, dim = 3, want = { { 1, 2 } } }
C { "sum", T { 0, 3 }, dim = 1, want = { 0, 0, 0 } }
C { "sum", T { 0 }, want = 0 }
C { "mean", x24, want = 12.5 }
C { "mean", x24, dim = 3, want = { { 2.5, 6.5, 10.5 }, { 14.5, 18.5, 22.5 } } }
C { "mean", x24, dim = { 1, 2 }, want = { 11, 12, 13, 14 } }
C { "mean", x24, dim = { 1, 2 }, keepdim = true, want = { { { 11, 12, 13, 14 } } } }
C { "mean", T { 0 }, want = 0 / 0, nograd = true } -- the mean of nothing is NaN
C { "mean", T { 0, 3 }, dim = 2 }
local r234 = T { 2, 3, 4 }
C { "sum", r234 }
C { "sum", r234, dim = 2 }
C { "sum", r234, dim = { 1, 3 }, keepdim = true }
C { "mean", r234 }
C { "mean", r234, dim = -1 }
C { "mean", r234, dim = { 1, 2 }, keepdim = true }
C { "sum", transposed(T { 5, 3 }), dim = 1 }
C { "sum", T { 7, 13 }, dim = 2 }
C { "mean", narrowed(T { 7, 13 }), dim = 1, keepdim = true }
C { "sum", expanded(T { 1, 13 }, { 7, 13 }), dim = 1 }

-- ---- max and argmax -----------------------------------------------------------------------------
-- 0-based index values, the first index on ties (the ties rule out finite differences here)
local xm = V { { 3, 7, 7, 1 }, { -2, -5, -1, -9 }, { 4, 0, 4, 8 } }
C { "max", xm, dim = 2, want = { 7, -1, 8 }, want2 = { 1, 2, 3 }, nograd = true }
C { "max", xm, dim = 1, want = { 4, 7, 7, 8 }, want2 = { 2, 0, 0, 2 }, nograd = true }
C { "max", xm, dim = -1, keepdim = true, want2 = { { 1 }, { 2 }, { 3 } }, nograd = true }
C { "max", xm, want = 8, nograd = true }
C { "argmax", xm, dim = 2, want = { 1, 2, 3 } }
C { "argmax", xm, dim = 1, keepdim = true, want = { { 2, 0, 0, 2 } } }
C { "argmax", xm, want = 11 }
C { "argmax", viewed(xm, function(t) return t:t() end, "t"), dim = 1, want = { 1, 2, 3 } }
C { "argmax", I { { 1, 5, 9 }, { 8, 2, 3 } }, dim = 2, want = { 2, 0 } }
C { "max", T { 20, 30, 10 }, dim = 2, nograd = true }
C { "max", D { 3, 4, 5 }, dim = 2, fd_eps = 1e-3 }
C { "max", D { 3, 4, 5 }, dim = -1, keepdim = true, fd_eps = 1e-3 }
C { "max", D { 3, 4, 5 }, fd_eps = 1e-3 }
C { "max", transposed(D { 7, 13 }), dim = 1, fd_eps = 1e-3 }
C { "max", T { 0, 3 }, dim = 2 }
C { "argmax", T { 0, 3 }, dim = 2 }
C { "argmax", T { 7, 13, dtype = "bfloat16" }, dim = 1 }
C { "argmax", T { 7, 13, dtype = "float16" }, dim = -1, keepdim = true }
C { "argmax", Ri(-50, 50, { 13, 7 }), dim = 2 }
C { "argmax", narrowed(D { 4, 6 }) }

-- ---- softmax and log_softmax --------------------------------------------------------------------
local logits345 = T { 3, 4, 5, lo = -6, hi = 6 }
for _, d in ipairs { 1, 2, 3, -1, -2 } do
  C { "softmax", logits345, dim = d, tol = { 1e-6, 1e-5 } }
  C { "log_softmax", logits345, dim = d }
end
for _, d in ipairs { 1, 2, -1 } do
  C { "softmax", T { 3, 4, 2 }, dim = d }
  C { "log_softmax", T { 3, 4, 2 }, dim = d }
end
-- a strided dim wider than one 64-column tile, long rows, a transposed input
C { "softmax", T { 2, 3, 70 }, dim = 2, tol = { 1e-6, 1e-5 } }
C { "log_softmax", T { 2, 3, 70 }, dim = 2 }
C { "softmax", T { 40, 1000, lo = -8, hi = 8 }, dim = -1, tol = { 1e-6, 1e-4 }, nograd = true }
C { "log_softmax", T { 40, 1000, lo = -8, hi = 8 }, dim = 1, tol = { 1e-4, 1e-5 }, nograd = true }
C { "softmax", transposed(T { 2, 70, 3 }), dim = -1, tol = { 1e-6, 1e-5 } }
C { "log_softmax", transposed(T { 13, 7 }), dim = 1 }
-- large logits stay finite
local large = V { { 1000, 1001, 1002 }, { -1000, -1001, -1002 } }
C { "softmax", large, dim = -1, tol = { 1e-6, 1e-5 },
  want = { 0.09003057, 0.24472847, 0.66524096, 0.66524096, 0.24472847, 0.09003057 } }
C { "log_softmax", large, dim = -1, tol = { 1e-4, 0 },
  want = { -2.40760596, -1.40760596, -0.40760596, -0.40760596, -1.40760596, -2.40760596 } }
C { "softmax", V(3.0), dim = -1, want = 1 }
C { "softmax", T { 0, 3 }, dim = 2 }
C { "log_softmax", T { 0, 3 }, dim = 2 }
C { "F.softmax", T { 4, 7 }, dim = 1 }
C { "F.log_softmax", narrowed(T { 4, 7 }), dim = -1 }

-- ---- matmul, bmm, linear ------------------------------------------------------------------------
local matmul_shapes = {
  { { 4 }, { 4 } },                -- dot
  { { 3, 4 }, { 4, 5 } },          -- matrix product
  { { 4 }, { 4, 5 } },             -- 1-D promoted on the left
  { { 3, 4 }, { 4 } },             -- matrix-vector
  { { 2, 3, 4 }, { 4, 5 } },       -- batch folded into M
  { { 3, 4 }, { 2, 4, 5 } },       -- left operand broadcast over the batch
  { { 2, 3, 4 }, { 2, 4, 5 } },    -- plain batched
  { { 2, 1, 3, 4 }, { 3, 4, 5 } }, -- broadcast both ways
  { { 1, 3, 4 }, { 2, 2, 4, 5 } },
  { { 4 }, { 2, 4, 5 } },
  { { 2, 3, 4 }, { 4 } },
  { { 2, 3, 4 }, { 1, 4, 5 } },    -- batch dim of size 1 on the right
  { { 7, 13 }, { 13, 1 } },
  { { 1, 13 }, { 13, 7 } },
}
for _, s in ipairs(matmul_shapes) do
  C { "matmul", T(s[1]), T(s[2]) }
end
C { "matmul", V { { 1, 2 }, { 3, 4 } }, V { { 5, 6 }, { 7, 8 } }, want = { { 19, 22 }, { 43, 50 } }, tol = exact }
C { "matmul", V { 1, 2, 3 }, V { 4, 5, 6 }, want = 32, tol = exact }
C { "matmul", V { { 1, 2 } }, V { { 3 }, { 4 } }, want = { { 11 } }, tol = exact }
-- transposed operands are used directly (no copy), narrowed ones are neither
C { "matmul", transposed(T { 3, 4 }), transposed(T { 2, 4, 5 }) }
C { "matmul", transposed(T { 3, 5 }), T { 5, 2 } }
C { "matmul", transposed(T { 2, 3, 4 }), T { 4, 5 } }
C { "matmul", T { 2, 3, 4 }, transposed(T { 2, 4, 3 }) } -- q @ k^T
C { "matmul", narrowed(T { 3, 4 }), narrowed(T { 4, 5 }) }
C { "matmul", T { 3, 0 }, T { 0, 2 }, want = { { 0, 0 }, { 0, 0 }, { 0, 0 } } }
C { "matmul", T { 0, 4 }, T { 4, 2 } }
C { "bmm", T { 3, 2, 4 }, T { 3, 4, 5 } }
C { "bmm", T { 2, 3, 4 }, T { 2, 4, 5 } }
C { "bmm", T { 1, 7, 13 }, transposed(T { 1, 13, 1 }) }
C { "bmm", T { 0, 2, 3 }, T { 0, 3, 2 } }
local w_hand = V { { 1, 0 }, { 0, 1 }, { 1, 1 } }
C { "linear", V { { 1, 2 } }, w_hand, V { 10, 20, 30 }, want = { { 11, 22, 33 } }, tol = exact }
C { "linear", V { { 1, 2 } }, w_hand, want = { { 1, 2, 3 } }, tol = exact }
C { "linear", V { { 2 } }, V { { 3 } }, V { 1 }, want = { { 7 } }, tol = exact }
for _, xs in ipairs { { 5, 4 }, { 2, 3, 4 }, { 4 }, { 2, 1, 3, 4 } } do
  C { "linear", T(xs), T { 3, 4 }, T { 3 } }
  C { "linear", T(xs), T { 3, 4 } }
end
C { "linear", narrowed(T { 5, 4 }), transposed(T { 3, 4 }) } -- a transposed weight view
C { "linear", T { 7, 5 }, T { 6, 5 } }
C { "linear", T { 13, 7 }, T { 1, 7 }, T { 1 } }
C { "linear", T { 0, 3 }, T { 2, 3 }, T { 2 } }

-- ---- views and shape ops ------------------------------------------------------------------------
local function t_of(t) return t:t() end
C { "view", A { 2, 6 }, shape = { 3, -1 }, want = { { 0, 1, 2, 3 }, { 4, 5, 6, 7 }, { 8, 9, 10, 11 } } }
C { "view", A { 2, 6 }, shape = { -1 } }
C { "view", A { 2, 6 }, shape = { 1, -1, 1 } }
C { "view", V { 5 }, shape = {}, want = 5 }
C { "view", viewed(A { 4, 6 }, function(t) return t:narrow(2, 1, 3) end, "narrow(2,1,3)"), shape = { 2, 2, 3 },
  want = { 0, 1, 2, 6, 7, 8, 12, 13, 14, 18, 19, 20 } }
C { "view", viewed(A { 2, 3, 4 }, function(t) return t:transpose(1, 2) end, "transpose(1,2)"), shape = { 3, 2, 2, 2 } }
C { "view", T { 2, 3, 4 }, shape = { 6, 4 } }
C { "view", T { 2, 3, dtype = "bfloat16" }, shape = { 3, 2 } }
C { "view", Ri(0, 9, { 2, 3 }), shape = { 6 } }
C { "view", T { 0, 3 }, shape = { 3, 0 } }
C { "reshape", T { 2, 3, 4 }, shape = { 4, -1 } }
C { "reshape", viewed(T { 2, 3, 4 }, function(t) return t:transpose(1, 3) end, "transpose(1,3)"), shape = { -1 } }
C { "reshape", viewed(A { 2, 3 }, t_of, "t"), shape = { 6 }, want = { 0, 3, 1, 4, 2, 5 } }
C { "reshape", A { 2, 3 }, shape = { 3, 2 } }
C { "reshape", transposed(T { 3, 4, dtype = "bfloat16" }), shape = { -1 } }
C { "reshape", transposed(T { 3, 4, dtype = "float16" }), shape = { 2, 6 } }
C { "reshape", transposed(Ri(0, 9, { 3, 4 })), shape = { 12 } }
C { "reshape", T { 0, 3 }, shape = { -1 } }
C { "view_as", T { 2, 3, 4 }, T { 6, 4, const = true } }
C { "flatten", T { 2, 3, 4 } }
C { "flatten", T { 2, 3, 4 }, start_dim = 2 }
C { "flatten", T { 2, 3, 4 }, start_dim = 1, end_dim = 2 }
C { "flatten", T { 2, 3, 4 }, start_dim = 2, end_dim = 2 }
C { "flatten", transposed(T { 3, 4 }) }
C { "F.flatten", T { 2, 3, 4 }, start_dim = 2 }
C { "transpose", A { 2, 3, 4 }, dims = { 1, 3 } }
C { "transpose", T { 2, 3, 4 }, dims = { 1, 2 } }
C { "transpose", A { 2, 3 }, dims = { -1, -2 } }
C { "transpose", Ri(0, 9, { 7, 1, 13 }), dims = { 1, 3 } }
C { "t", A { 2, 3 }, want = { { 0, 3 }, { 1, 4 }, { 2, 5 } } }
C { "t", T { 5 } }
C { "T", T { 3, 4 } }
C { "permute", A { 2, 3, 4 }, dims = { 2, 3, 1 } }
C { "permute", T { 2, 3, 4 }, dims = { 3, 1, 2 } }
C { "permute", T { 2, 3, 4 }, dims = { 2, 3, 1 } }
C { "permute", transposed(T { 2, 5, 3, dtype = "bfloat16" }), dims = { 3, 1, 2 } }
C { "unsqueeze", A { 2, 3 }, dim = 1 }
C { "unsqueeze", A { 2, 3 }, dim = 2 }
C { "unsqueeze", A { 2, 3 }, dim = 3 }
C { "unsqueeze", A { 2, 3 }, dim = -1 }
C { "unsqueeze", T { 3, 2 }, dim = 2 }
C { "unsqueeze", transposed(T { 3, 4 }), dim = 2 }
C { "squeeze", T { 2, 1, 3 }, dim = 2 }
C { "squeeze", T { 2, 1, 3 }, dim = 1 } -- not size 1: unchanged, as in PyTorch
C { "squeeze", V { 4 }, dim = 1 }
C { "squeeze", T { 1, 3, 2 }, dim = 1 }
C { "squeeze", Ri(0, 9, { 7, 1 }), dim = -1 }
local col12 = V { { 1 }, { 2 } }
C { "expand", col12, shape = { 2, 3 }, want = { { 1, 1, 1 }, { 2, 2, 2 } } }
C { "expand", col12, shape = { 4, -1, 3 } }
C { "expand", V(5), shape = { 2, 2 }, want = { { 5, 5 }, { 5, 5 } } }
C { "expand", T { 3, 1 }, shape = { 2, 3, 4 } }
C { "expand", V { 1, 2 }, shape = { 3, 2 } }
C { "expand", Ri(0, 9, { 1, 7 }), shape = { 13, 7 } }
C { "expand", T { 0, 1 }, shape = { 0, 3 } }
C { "expand_as", V { 7, 8, 9 }, T { 2, 3, const = true } }
C { "narrow", A { 3, 4 }, dim = 2, start = 2, length = 2, want = { { 1, 2 }, { 5, 6 }, { 9, 10 } } }
C { "narrow", A { 3, 4 }, dim = 1, start = 3, length = 0 }
C { "narrow", A { 3, 4 }, dim = 1, start = 3, length = 1, want = { { 8, 9, 10, 11 } } }
C { "narrow", A { 3, 4 }, dim = 2, start = 4, length = 1 }
local r345 = T { 3, 4, 5 }
C { "narrow", r345, dim = 2, start = 2, length = 2 }
C { "narrow", r345, dim = 1, start = 1, length = 2 }
C { "narrow", r345, dim = 3, start = 5, length = 1 }
C { "narrow", viewed(T { 3, 4, 5 }, function(t) return t:transpose(1, 3) end, "transpose(1,3)"), dim = 2, start = 2,
  length = 3 }
C { "narrow", V { 1, 2, 3, 4 }, dim = 1, start = 2, length = 2 }
C { "narrow", T { 7, 13, dtype = "bfloat16" }, dim = -1, start = 3, length = 7 }
C { "clone", viewed(A { 2, 3 }, t_of, "t"), want = { { 0, 3 }, { 1, 4 }, { 2, 5 } } }
C { "clone", I { 4, 5 }, want = { 4, 5 } }
C { "clone", T { 3, 2 } }
C { "clone", transposed(T { 3, 5, dtype = "bfloat16" }) }
C { "clone", T { 0, 3 } }
C { "contiguous", viewed(A { 2, 3 }, t_of, "t"), want = { 0, 3, 1, 4, 2, 5 } }
C { "contiguous", A { 2, 3 } }
C { "contiguous", transposed(T { 3, 5, dtype = "float16" }) }
C { "contiguous", narrowed(T { 7, 13 }) }
C { "detach", T { 3, 2 } }
C { "cpu", T { 2, 3 } }
C { "cpu", Ri(0, 9, { 4 }) }
-- cat
local a23i = A { 2, 3 }
local b23i = A { 2, 3, start = 10 }
C { "cat", a23i, b23i, want = { { 0, 1, 2 }, { 3, 4, 5 }, { 10, 11, 12 }, { 13, 14, 15 } } }
C { "cat", a23i, b23i, dim = 2, want = { { 0, 1, 2, 10, 11, 12 }, { 3, 4, 5, 13, 14, 15 } } }
C { "cat", a23i, b23i, dim = -1, want = { { 0, 1, 2, 10, 11, 12 }, { 3, 4, 5, 13, 14, 15 } } }
C { "cat", viewed(A { 3, 2 }, t_of, "t"), a23i, dim = 2, want = { { 0, 2, 4, 0, 1, 2 }, { 1, 3, 5, 3, 4, 5 } } }
C { "cat", a23i, T { 2, 0 }, viewed(A { 2, 3, start = 10 }, function(t) return t:narrow(2, 1, 1) end, "narrow(2,1,1)"),
  dim = 2, want = { { 0, 1, 2, 10 }, { 3, 4, 5, 13 } } }
C { "cat", I { 1, 2 }, I { 3 }, want = { 1, 2, 3 } }
C { "cat", A { 2, 2, 2 }, A { 2, 1, 2 }, dim = 2, want = { 0, 1, 2, 3, 0, 1, 4, 5, 6, 7, 2, 3 } }
C { "cat", T { 2, 3 }, T { 2, 1 }, T { 2, 2 }, dim = 2 }
C { "cat", T { 2, 3 }, transposed(T { 2, 3 }), dim = 1 }
C { "cat", T { 2, 3, dtype = "bfloat16" }, T { 1, 3, dtype = "bfloat16" } }
C { "cat", T { 0, 3 }, T { 0, 3 } }
C { "cat", T { 7, 1 }, T { 7, 13 }, dim = 2 }
local eleven = { "cat", dim = 1 } -- past 8 inputs
for k = 1, 11 do
  eleven[k + 1] = T { 1, 2 }
end
C(eleven)
-- index_select (0-based int64 indices)
local a34 = A { 3, 4 }
C { "index_select", a34, I { 2, 0, 2 }, dim = 1, want = { { 8, 9, 10, 11 }, { 0, 1, 2, 3 }, { 8, 9, 10, 11 } } }
C { "index_select", a34, I { 2, 0, 2 }, dim = 2, want = { { 2, 0, 2 }, { 6, 4, 6 }, { 10, 8, 10 } } }
C { "index_select", viewed(A { 3, 4 }, t_of, "t"), I { 1 }, dim = 1, want = { { 1, 5, 9 } } }
C { "index_select", I { 7, 8, 9 }, I { 2, 1 }, dim = 1, want = { 9, 8 } }
C { "index_select", A { 2, 3, 2 }, I { 2, 0 }, dim = 2, want = { { { 4, 5 }, { 0, 1 } }, { { 10, 11 }, { 6, 7 } } } }
C { "index_select", a34, I {}, dim = 1 }
C { "index_select", a34, I { 1 }, dim = 1, want = { { 4, 5, 6, 7 } } }
C { "index_select", T { 4, 3 }, I { 3, 1, 3, 3 }, dim = 1 } -- repeated indices add up
C { "index_select", T { 4, 3 }, I { 2, 2, 0 }, dim = 2 }
C { "index_select", T { 7, 13, dtype = "bfloat16" }, Ri(0, 7, { 5 }), dim = 1 }
C { "index_select", transposed(T { 13, 7 }), Ri(0, 7, { 9 }), dim = 2 }

-- ---- dtype conversion ---------------------------------------------------------------------------
-- bf16 keeps 8 significant bits (round to nearest even), f16 keeps 11
local conv_vals = V { 1.5, -2.7, 3.0, 1000.6 }
C { "long", conv_vals, want = { 1, -2, 3, 1000 } }
C { "bfloat16", conv_vals, want = { 1.5, -2.703125, 3, 1000 } }
C { "half", conv_vals, want = { 1.5, -2.69921875, 3, 1000.5 } }
C { "float", V({ 1.5, -2.7, 3.0, 1000.6 }, { dtype = "bfloat16" }), want = { 1.5, -2.703125, 3, 1000 } }
C { "float", I { 7, -3 }, want = { 7, -3 } }
C { "half", I { 2, 3 }, want = { 2, 3 } }
C { "to", conv_vals, dtype = "float32" }
C { "long", viewed(A { 2, 3 }, t_of, "t"), want = { 0, 3, 1, 4, 2, 5 } }
C { "to", T { 7, 13, lo = -100, hi = 100 }, dtype = "bfloat16", nograd = true }
C { "to", T { 7, 13, lo = -100, hi = 100 }, dtype = "float16", nograd = true }
C { "to", T { 7, 13, lo = -100, hi = 100 }, dtype = "int64", nograd = true }
C { "to", T { 3, 4, dtype = "float16" }, dtype = "bfloat16" }
C { "to", T { 3, 4, dtype = "bfloat16" }, dtype = "float16" }
C { "to", Ri(-300, 300, { 5 }), dtype = "bfloat16" }
C { "to", transposed(T { 3, 4 }), dtype = "float16", nograd = true }
C { "to", T { 0, 3 }, dtype = "bfloat16", nograd = true }

-- ---- conv2d -------------------------------------------------------------------------------------
-- x, w and the options; every case runs with and without a bias
local conv_cases = {
  { x = { 2, 3, 7, 6 }, w = { 4, 3, 3, 3 }, o = { padding = 1 } },
  { x = { 2, 3, 8, 8 }, w = { 5, 3, 3, 3 }, o = { stride = 2 } },
  { x = { 1, 2, 9, 8 }, w = { 3, 2, 3, 2 }, o = { stride = { 2, 1 }, padding = { 0, 2 }, dilation = { 1, 2 } } },
  { x = { 2, 4, 6, 7 }, w = { 6, 2, 3, 3 }, o = { padding = 1, groups = 2 } },
  { x = { 2, 6, 9, 10 }, w = { 3, 2, 2, 3 },
    o = { stride = { 2, 3 }, padding = { 1, 0 }, dilation = { 2, 1 }, groups = 3 } },
  { x = { 3, 5, 4, 4 }, w = { 7, 5, 1, 1 }, o = {} },                    -- pointwise: no im2col
  { x = { 2, 4, 5, 5 }, w = { 4, 1, 3, 3 }, o = { padding = 1, groups = 4 } }, -- depthwise
  { x = { 1, 1, 5, 5 }, w = { 2, 1, 5, 5 }, o = {} },                    -- kernel as large as the input
  { x = { 1, 3, 2, 2 }, w = { 4, 3, 3, 3 }, o = { padding = 1 } },       -- input smaller than the kernel
  { x = { 1, 3, 7, 7 }, w = { 2, 3, 3, 3 }, o = { padding = "same", dilation = 2 } },
  { x = { 1, 3, 6, 6 }, w = { 2, 3, 3, 3 }, o = { padding = "valid" } },
  { x = { 1, 2, 7, 7 }, w = { 3, 2, 3, 3 }, o = { stride = 2, padding = 1, positional = true } },
  { x = { 0, 2, 5, 5 }, w = { 3, 2, 3, 3 }, o = {} },                    -- an empty batch
  { x = { 1, 2, 0, 3 }, w = { 4, 2, 3, 3 }, o = { padding = 2 } },       -- no input rows: the outputs are the bias
  -- Winograd F(2x2, 3x3) geometries: 3x3, stride 1, padding 1, one group, 16+ channels in and out
  { x = { 1, 16, 8, 8 }, w = { 16, 16, 3, 3 }, o = { padding = 1 } },
  { x = { 2, 16, 7, 9 }, w = { 16, 16, 3, 3 }, o = { padding = 1 } },   -- partial tiles on the last row and column
  { x = { 2, 24, 1, 2 }, w = { 40, 24, 3, 3 }, o = { padding = 1 } },   -- a single row
  { x = { 2, 16, 3, 1 }, w = { 16, 16, 3, 3 }, o = { padding = 1 } },   -- a single column
  { x = { 3, 16, 1, 1 }, w = { 16, 16, 3, 3 }, o = { padding = 1 } },   -- one pixel
  { x = { 2, 16, 5, 3 }, w = { 16, 16, 3, 3 }, o = { padding = 1 } },
  { x = { 2, 20, 6, 5 }, w = { 17, 20, 3, 3 }, o = { padding = 1 } },   -- O not a multiple of 4
  { x = { 1, 16, 4, 4 }, w = { 16, 16, 3, 3 }, o = { padding = "same" } },
}
for _, cc in ipairs(conv_cases) do
  local with_bias = { "conv2d", T(cc.x), T(cc.w), T { cc.w[1] }, tol = { 1e-4, 1e-4 } }
  local without = { "conv2d", T(cc.x), T(cc.w), tol = { 1e-4, 1e-4 } }
  for k, v in pairs(cc.o) do
    with_bias[k] = v
    without[k] = v
  end
  C(with_bias)
  C(without)
end
-- ---- conv_transpose2d: x (N, Cin, H, W), w (Cin, Cout/groups, kh, kw); with and without a bias
local convt_cases = {
  { x = { 2, 3, 4, 4 }, w = { 3, 2, 3, 3 }, o = {} },
  { x = { 1, 2, 3, 4 }, w = { 2, 3, 3, 3 }, o = { stride = 2, padding = 1, output_padding = 1 } },
  { x = { 2, 4, 3, 3 }, w = { 4, 3, 2, 3 }, o = { stride = { 2, 1 }, padding = { 0, 1 }, groups = 2 } },
  { x = { 1, 2, 4, 3 }, w = { 2, 2, 3, 2 }, o = { dilation = 2, output_padding = 1 } }, -- output_padding < dilation
  { x = { 2, 3, 4, 5 }, w = { 3, 1, 3, 3 }, o = { padding = 1, groups = 3 } },         -- depthwise
  { x = { 2, 4, 3, 3 }, w = { 4, 5, 1, 1 }, o = { stride = 2, output_padding = 1 } },  -- 1x1, strided
  { x = { 1, 16, 4, 4 }, w = { 16, 16, 3, 3 }, o = { padding = 1 } },                   -- a Winograd geometry
  { x = { 1, 2, 3, 3 }, w = { 2, 3, 3, 3 }, o = { stride = 2, padding = 1, groups = 1, dilation = 1, positional = true } },
  { x = { 0, 2, 3, 3 }, w = { 2, 3, 3, 3 }, o = {} },                                   -- an empty batch
}
for _, cc in ipairs(convt_cases) do
  local ngroups = cc.o.groups or 1
  local with_bias = { "conv_transpose2d", T(cc.x), T(cc.w), T { cc.w[2] * ngroups }, tol = { 1e-4, 1e-4 } }
  local without = { "conv_transpose2d", T(cc.x), T(cc.w), tol = { 1e-4, 1e-4 } }
  for k, v in pairs(cc.o) do
    with_bias[k] = v
    without[k] = v
  end
  C(with_bias)
  C(without)
end
C { "conv_transpose2d", T { 1, 16, 3, 3, dtype = "bfloat16" }, T { 16, 8, 3, 3, dtype = "bfloat16" },
  T { 8, dtype = "bfloat16" }, stride = 2, padding = 1 }
C { "conv_transpose2d", transposed(T { 2, 3, 4, 4 }), T { 3, 2, 3, 3 }, stride = 2, tol = { 1e-4, 1e-4 } }

local x33 = V { { { { 1, 2, 3 }, { 4, 5, 6 }, { 7, 8, 9 } } } }
C { "conv2d", x33, V { { { { 1, 0 }, { 0, 1 } } } }, V { 1 }, want = { { { { 7, 9 }, { 13, 15 } } } }, tol = exact }
C { "conv2d", x33, V { { { { 1, 0 }, { 0, 1 } } } }, padding = 1, tol = exact }
-- all-ones 3x3 kernel: the sum of each zero-padded 3x3 neighbourhood
C { "conv2d", x33, V { { { { 1, 1, 1 }, { 1, 1, 1 }, { 1, 1, 1 } } } }, V { 0.5 }, padding = 1, tol = { 1e-5, 0 },
  want = { { { { 12.5, 21.5, 16.5 }, { 27.5, 45.5, 33.5 }, { 24.5, 39.5, 28.5 } } } } }
C { "conv2d", transposed(T { 2, 16, 6, 9 }), T { 16, 16, 3, 3 }, padding = 1, tol = { 1e-4, 1e-4 } }
C { "conv2d", narrowed(T { 1, 16, 5, 5 }), T { 16, 16, 3, 3 }, T { 16 }, padding = 1, tol = { 1e-4, 1e-4 } }

-- ---- pooling ------------------------------------------------------------------------------------
local pool_cases = {
  { x = { 2, 3, 6, 6 }, k = 2, o = {} },
  { x = { 2, 2, 7, 6 }, k = 3, o = { stride = 2, padding = 1 } },
  { x = { 1, 2, 7, 7 }, k = 3, o = { stride = 2, padding = 1, ceil_mode = true } },
  { x = { 2, 1, 5, 5 }, k = 2, o = { stride = 2, ceil_mode = true } },
  { x = { 1, 2, 8, 7 }, k = { 3, 2 }, o = { stride = { 1, 2 }, padding = { 1, 0 } } },
  { x = { 3, 5, 5 }, k = 2, o = { stride = 1 } },                                   -- 3-D input (C, H, W)
  { x = { 1, 2, 5, 5 }, k = 2, o = { stride = 2, padding = 1, ceil_mode = true } }, -- last window dropped
  { x = { 1, 1, 6, 6 }, k = 3, o = { stride = 2, padding = 1, ceil_mode = true } },
  { x = { 1, 1, 6, 6 }, k = 3, o = { stride = 3, padding = 1, ceil_mode = true } },
  { x = { 0, 2, 4, 4 }, k = 2, o = {} },                                            -- an empty batch
}
for _, pc in ipairs(pool_cases) do
  local mx = { "max_pool2d", D(pc.x), kernel = pc.k, tol = exact, fd_eps = 1e-3 }
  local avg_in = { "avg_pool2d", T(pc.x), kernel = pc.k, count_include_pad = true }
  local avg_ex = { "avg_pool2d", T(pc.x), kernel = pc.k, count_include_pad = false }
  for k, v in pairs(pc.o) do
    mx[k] = v
    avg_in[k] = v
    avg_ex[k] = v
  end
  C(mx)
  C(avg_in)
  C(avg_ex)
end
C { "max_pool2d", D { 1, 2, 9, 8 }, kernel = 3, stride = 2, padding = 1, dilation = 2, tol = exact, fd_eps = 1e-3 }
C { "max_pool2d", transposed(D { 2, 3, 7, 6 }), kernel = 2, tol = exact, fd_eps = 1e-3 }
C { "avg_pool2d", narrowed(T { 1, 2, 6, 7 }), kernel = 3, stride = 2 }
-- PyTorch's values on 0..24
local iota55 = A { 1, 1, 5, 5 }
C { "max_pool2d", iota55, kernel = 2, stride = 2, ceil_mode = true, tol = exact,
  want = { 6, 8, 9, 16, 18, 19, 21, 23, 24 } }
C { "max_pool2d", V { { { { 1, 5 }, { 3, 2 } } } }, kernel = 2, want = { 5 }, tol = exact }
C { "avg_pool2d", iota55, kernel = 2, stride = 2, ceil_mode = true, tol = { 1e-6, 0 },
  want = { 3, 5, 6.5, 13, 15, 16.5, 20.5, 22.5, 24 } }
C { "avg_pool2d", iota55, kernel = 3, stride = 2, padding = 1, ceil_mode = true, tol = { 1e-5, 0 },
  want = { 4 / 3, 3, 8 / 3, 7, 12, 9, 8, 13, 28 / 3 } }
C { "avg_pool2d", iota55, kernel = 3, stride = 2, padding = 1, ceil_mode = true, count_include_pad = false,
  tol = { 1e-5, 0 }, want = { 3, 4.5, 6, 10.5, 12, 13.5, 18, 19.5, 21 } }
-- a window that would start inside the right padding is dropped (3 outputs, not 4)
C { "avg_pool2d", iota55, kernel = 2, stride = 2, padding = 1, ceil_mode = true, tol = { 1e-6, 0 },
  want = { 0, 0.75, 1.75, 3.75, 9, 11, 8.75, 19, 21 } }
C { "avg_pool2d", iota55, kernel = 2, stride = 2, padding = 1, ceil_mode = true, count_include_pad = false,
  tol = { 1e-6, 0 }, want = { 0, 1.5, 3.5, 7.5, 9, 11, 17.5, 19, 21 } }
C { "avg_pool2d", V { { { { 1, 5 }, { 3, 3 } } } }, kernel = 2, want = { 3 }, tol = exact }
for _, ac in ipairs { { { 2, 3, 7, 5 }, { 3, 4 } }, { { 1, 2, 6, 6 }, { 2, 3 } }, { { 2, 1, 5, 5 }, { 5, 5 } },
  { { 1, 1, 4, 6 }, { 1, 1 } }, { { 3, 4, 5 }, { 7, 2 } }, { { 0, 2, 4, 4 }, { 2, 2 } } } do
  C { "adaptive_avg_pool2d", T(ac[1]), size = ac[2] }
end
C { "adaptive_avg_pool2d", transposed(T { 1, 3, 5, 7 }), size = 3 }
C { "adaptive_avg_pool2d", iota55, size = { 3, 2 }, want = { 3.5, 5.5, 11, 13, 18.5, 20.5 }, tol = { 1e-6, 0 } }
C { "adaptive_avg_pool2d", iota55, size = 1, want = { 12 }, tol = { 1e-6, 0 } }
C { "adaptive_avg_pool2d", V { { { { 1, 3 }, { 5, 7 } } } }, size = 1, want = { 4 }, tol = exact }

-- ---- layer_norm ---------------------------------------------------------------------------------
local lnx = T { 2, 3, 4, lo = -1, hi = 3 }
C { "layer_norm", lnx, T { 4 }, T { 4 }, shape = 4 }
C { "layer_norm", lnx, shape = 4 }
C { "layer_norm", lnx, T { 4 }, shape = 4 }
C { "layer_norm", lnx, none, T { 4 }, shape = 4, eps = 0.5 }
C { "layer_norm", lnx, T { 3, 4 }, T { 3, 4 }, shape = { 3, 4 } }
local r123 = 1 / math.sqrt(2 / 3 + 1e-5) -- (1, 2, 3): mean 2, variance 2/3
C { "layer_norm", V { { 1, 2, 3 } }, shape = 3, want = { -r123, 0, r123 }, tol = { 1e-6, 0 } }
C { "layer_norm", transposed(T { 48, 1024 }), T { 1024 }, T { 1024 }, shape = 1024, tol = { 1e-4, 1e-4 },
  nograd = true }
C { "layer_norm", T { 3, 5 }, T { 5 }, T { 5 }, shape = 5 }
C { "layer_norm", T { 2, 2, 3 }, T { 2, 3 }, shape = { 2, 3 } }
C { "layer_norm", T { 4, 3 }, shape = 3 }
C { "layer_norm", T { 2, 3 }, T { 3, const = true }, shape = 3 } -- a frozen weight
C { "layer_norm", narrowed(T { 7, 13 }), T { 13 }, T { 13 }, shape = 13 }
C { "layer_norm", T { 0, 3 }, T { 3 }, T { 3 }, shape = 3 }

-- ---- batch_norm, group_norm, rms_norm -----------------------------------------------------------
-- batch_norm in training (batch statistics; no running stats here: those are tests/nn/norm_spec.lua's)
-- and in eval (the running statistics as constant inputs)
local bnx = T { 4, 3, 5, lo = -1, hi = 3 }
local run_m, run_v = T { 3, const = true }, T({ 3, const = true }, { lo = 0.5, hi = 2 })
C { "batch_norm", bnx, none, none, T { 3 }, T { 3 }, training = true }
C { "batch_norm", T { 6, 4 }, none, none, T { 4 }, T { 4 }, training = true }
C { "batch_norm", T { 3, 2, 3, 4 }, none, none, T { 2 }, none, training = true, eps = 0.1 }
C { "batch_norm", T { 3, 2, 3, 4 }, none, none, training = true }
C { "batch_norm", transposed(T { 5, 3 }), none, none, T { 3 }, T { 3 }, training = true }
C { "batch_norm", bnx, run_m, run_v, T { 3 }, T { 3 }, training = false }
C { "batch_norm", T { 4, 3, 5, dtype = "bfloat16" }, none, none, T { 3 }, T { 3 }, training = true, nograd = true }
local r3 = 1 / math.sqrt(2 / 3 + 1e-5) -- per channel (1, 2, 3): mean 2, variance 2/3
C { "batch_norm", V { { 1 }, { 2 }, { 3 } }, none, none, training = true, want = { { -r3 }, { 0 }, { r3 } },
  tol = { 1e-6, 0 } }
C { "sync_batch_norm", bnx, none, none, T { 3 }, T { 3 }, training = true }
C { "sync_batch_norm", bnx, run_m, run_v, T { 3 }, none, training = false }
C { "group_norm", T { 2, 6, 5, lo = -1, hi = 3 }, T { 6 }, T { 6 }, groups = 3 }
C { "group_norm", T { 2, 4, 3, 3 }, T { 4 }, none, groups = 2, eps = 0.1 }
C { "group_norm", T { 3, 4 }, groups = 1 }
C { "group_norm", T { 2, 4, 3 }, T { 4 }, T { 4 }, groups = 4 }
C { "group_norm", narrowed(T { 3, 8 }), T { 8 }, T { 8 }, groups = 2 }
C { "group_norm", T { 2, 6, 5, dtype = "bfloat16" }, T { 6 }, T { 6 }, groups = 3, nograd = true }
C { "rms_norm", T { 2, 3, 4 }, T { 4 }, shape = 4, eps = 1e-6 }
C { "rms_norm", T { 2, 3, 4 }, shape = 4, eps = 1e-6 }
C { "rms_norm", T { 2, 3, 4 }, T { 3, 4 }, shape = { 3, 4 }, eps = 0.5 }
C { "rms_norm", transposed(T { 6, 5 }), T { 5 }, shape = 5, eps = 1e-6 }
C { "rms_norm", T { 0, 3 }, T { 3 }, shape = 3 }
C { "rms_norm", T { 4, 8, dtype = "bfloat16" }, T { 8 }, shape = 8, nograd = true }
local rms3 = 1 / math.sqrt(14 / 3 + 1e-6) -- (1, 2, 3): mean square 14/3
C { "rms_norm", V { { 1, 2, 3 } }, shape = 3, eps = 1e-6, want = { rms3, 2 * rms3, 3 * rms3 }, tol = { 1e-6, 0 } }

-- ---- embedding ----------------------------------------------------------------------------------
local emb = V { { 0, 1 }, { 10, 11 }, { 20, 21 }, { 30, 31 } }
C { "embedding", I { { 3, 0, 1 }, { 1, 1, 2 } }, emb,
  want = { { { 30, 31 }, { 0, 1 }, { 10, 11 } }, { { 10, 11 }, { 10, 11 }, { 20, 21 } } } }
C { "embedding", I(2), emb, want = { 20, 21 } } -- a 0-dim index gives (D)
C { "embedding", I { 2, 0 }, viewed(V { { 0, 10, 20 }, { 1, 11, 21 } }, t_of, "t"), want = { { 20, 21 }, { 0, 1 } } }
C { "embedding", I { { 1, 2, 1 }, { 3, 1, 0 } }, T { 5, 4 } }
-- the padding row gets no gradient by design, which finite differences cannot see (nn_ops_spec
-- checks it exactly)
C { "embedding", I { { 1, 2, 1 }, { 3, 1, 0 } }, T { 5, 4 }, padding_idx = 1, nograd = true }
C { "embedding", I { 3 }, T { 4, 2 } }
C { "embedding", I {}, T { 3, 2 } }
C { "embedding", Ri(0, 13, { 7 }), narrowed(T { 13, 7 }) }

-- ---- losses -------------------------------------------------------------------------------------
-- row 1: logsumexp(1, 2, 3) = 3.40760596, loss 0.40760596; row 2: log(3) = 1.09861229; with
-- smoothing 0.1: loss = lse - 0.9 x_t - 0.1/3 sum x, row 1 0.50760596
local logits = V { { 1, 2, 3 }, { 1, 1, 1 } }
C { "cross_entropy", logits, I { 2, 0 }, want = (0.40760596 + 1.09861229) / 2, tol = { 1e-6, 0 } }
C { "cross_entropy", logits, I { 2, -100 }, want = 0.40760596, tol = { 1e-6, 0 } }
C { "cross_entropy", logits, I { 2, 0 }, ignore_index = 0, want = 0.40760596, tol = { 1e-6, 0 } }
C { "cross_entropy", logits, I { 2, 0 }, label_smoothing = 0.1, want = (0.50760596 + 1.09861229) / 2,
  tol = { 1e-6, 0 } }
C { "cross_entropy", logits, I { 2, 0 }, ignore_index = 0, label_smoothing = 0.1, want = 0.50760596, tol = { 1e-6, 0 } }
C { "cross_entropy", logits, I { -100, -100 }, want = 0 / 0, nograd = true } -- every target ignored: NaN
C { "cross_entropy", V { 1, 2, 3 }, I(2), want = 0.40760596, tol = { 1e-6, 0 } } -- unbatched
local ce_target = Ri(0, 5, { 3, 2, 4 }, { set = { [3] = -100, [10] = -100 } })
C { "cross_entropy", T { 3, 5, 2, 4, lo = -4, hi = 4 }, ce_target }
C { "cross_entropy", T { 3, 5, 2, 4, lo = -4, hi = 4 }, ce_target, label_smoothing = 0.2 }
C { "cross_entropy", T { 64, 1000 }, Ri(0, 1000, { 64 }), label_smoothing = 0.1, nograd = true }
C { "cross_entropy", T { 2, 3, 70 }, Ri(0, 3, { 2, 70 }), label_smoothing = 0.3 } -- strided classes, S = 70
C { "cross_entropy", T { 3, 5, 4 }, transposed(Ri(0, 5, { 3, 4 })) }            -- a non-contiguous target
C { "cross_entropy", T { 4, 3 }, I { 0, 2, -100, 1 } }
C { "cross_entropy", T { 4, 3 }, I { 0, 2, -100, 1 }, label_smoothing = 0.25 }
C { "cross_entropy", T { 2, 3, 2, 2 }, I { { { 0, 1 }, { 2, 1 } }, { { 1, -100 }, { 0, 2 } } }, label_smoothing = 0.1 }
C { "cross_entropy", narrowed(T { 7, 13 }), Ri(0, 13, { 7 }) }
C { "cross_entropy", T { 0, 3 }, I {}, nograd = true }
local logp = V { { -1, -2, -3 }, { -0.5, -0.25, -4 }, { -9, -9, -9 } }
C { "nll_loss", logp, I { 2, 0, -100 }, want = (3 + 0.5) / 2, tol = { 1e-7, 0 } }
C { "nll_loss", logp, I { 1, 1, 1 }, ignore_index = 1, want = 0 / 0, nograd = true }
C { "nll_loss", T { 2, 3, 4 }, I { { 0, 1, 2, -100 }, { 2, 2, 1, 0 } } }
C { "nll_loss", transposed(T { 5, 7 }), Ri(0, 7, { 5 }) }
C { "mse_loss", V { 1, 2, 3 }, V { 1, 4, 0 }, want = 13 / 3, tol = { 1e-6, 0 } }
C { "mse_loss", T { 3, 4 }, T { 3, 4 } }
C { "mse_loss", T { 300, 200 }, T { 300, 200 }, nograd = true }
C { "mse_loss", transposed(T { 7, 13 }), T { 7, 13 } }
C { "mse_loss", T { 0, 3 }, T { 0, 3 }, nograd = true }

-- ---- scaled_dot_product_attention ---------------------------------------------------------------
local sdpa = "scaled_dot_product_attention"
local at = { 1e-5, 1e-4 }
C { sdpa, T { 2, 3, 5, 4 }, T { 2, 3, 5, 4 }, T { 2, 3, 5, 4 }, tol = at }
C { sdpa, T { 2, 3, 5, 4 }, T { 2, 3, 5, 4 }, T { 2, 3, 5, 4 }, is_causal = true, tol = at }
C { sdpa, T { 1, 2, 3, 4 }, T { 1, 2, 6, 4 }, T { 1, 2, 6, 2 }, tol = at }               -- Tq != Tk, Dv != D
C { sdpa, T { 1, 2, 6, 4 }, T { 1, 2, 3, 4 }, T { 1, 2, 3, 5 }, is_causal = true, tol = at } -- causal, Tq > Tk
C { sdpa, T { 1, 1, 4, 8 }, T { 1, 1, 4, 8 }, T { 1, 1, 4, 8 }, scale = 0.5, tol = at }
C { sdpa, T { 2, 2, 4, 3 }, T { 2, 2, 6, 3 }, T { 2, 2, 6, 3 }, T { 4, 6 }, tol = at } -- an additive (Tq, Tk) mask
-- a padding mask (B, 1, 1, Tk): -inf on the last key of batch 2
local pad_mask = V { { { { 0, 0, 0, 0, 0 } } }, { { { 0, 0, 0, 0, -math.huge } } } }
C { sdpa, T { 2, 3, 4, 2 }, T { 2, 3, 5, 2 }, T { 2, 3, 5, 2 }, pad_mask, tol = at }
C { sdpa, T { 2, 3, 4, 2 }, T { 2, 3, 5, 2 }, T { 2, 3, 5, 2 }, pad_mask, is_causal = true, tol = at }
C { sdpa, T { 2, 5, 3 }, T { 2, 5, 3 }, T { 2, 5, 3 }, is_causal = true, tol = at } -- 3-D
-- heads (B, H, T, D) stored as (B, T, H, D)
local function heads(t) return t:transpose(2, 3) end
C { sdpa, viewed(T { 1, 4, 2, 3 }, heads, "transpose(2,3)"), viewed(T { 1, 4, 2, 3 }, heads, "transpose(2,3)"),
  viewed(T { 1, 4, 2, 3 }, heads, "transpose(2,3)"), is_causal = true, tol = at }
C { sdpa, T { 1, 2, 3, 4 }, T { 1, 2, 5, 4 }, T { 1, 2, 5, 3 }, tol = at }
C { sdpa, T { 1, 2, 3, 4 }, T { 1, 2, 5, 4 }, T { 1, 2, 5, 3 }, is_causal = true, tol = at }
C { sdpa, T { 1, 2, 3, 4 }, T { 1, 2, 5, 4 }, T { 1, 2, 5, 3 }, T { 3, 5 }, scale = 0.7, tol = at }
C { sdpa, T { 2, 3, 2, const = true }, T { 2, 3, 2, const = true }, T { 2, 3, 2 }, is_causal = true, tol = at }
C { sdpa, T { 2, 7, 5 }, T { 2, 13, 5 }, T { 2, 13, 3 }, tol = at }
C { sdpa, T { 1, 0, 4 }, T { 1, 3, 4 }, T { 1, 3, 4 }, tol = at } -- no queries

-- ---- dropout (deterministic settings only) ------------------------------------------------------
C { "dropout", T { 3, 4 }, p = 0.5, training = false }
C { "dropout", T { 3, 4 }, p = 0, training = true }
C { "dropout", T { 4 }, p = 1, want = { 0, 0, 0, 0 } }
C { "dropout", T { 2, 3, dtype = "bfloat16" }, p = 0.5, training = false }
C { "dropout", I { 1, 2, 3 }, p = 0.3, training = false }
C { "dropout", transposed(T { 7, 13 }), p = 0.2, training = false }
C { "dropout", T { 0, 3 }, p = 0.5, training = false }
C { "dropout2d", T { 2, 3, 4, 4 }, p = 0.5, training = false }
C { "dropout2d", T { 3, 4, 4 }, p = 0, training = true }
C { "dropout2d", T { 2, 3, 2, 2 }, p = 1 }
C { "dropout2d", T { 2, 3, 2, 2, dtype = "bfloat16" }, p = 0.5, training = false }

-- ---- stride-0 (expanded) operands ---------------------------------------------------------------
-- broadcast inputs read in place by ops that usually see dense ones (a batch of one image or
-- sequence expanded, grouped-query attention's shared keys and values)
C { "matmul", expanded(T { 1, 4 }, { 3, 4 }), T { 4, 5 } }
C { "bmm", expanded(T { 1, 2, 3 }, { 4, 2, 3 }), T { 4, 3, 2 } }
C { "linear", expanded(T { 1, 4 }, { 5, 4 }), T { 3, 4 }, T { 3 } }
C { "layer_norm", expanded(T { 1, 5 }, { 3, 5 }), T { 5 }, T { 5 }, shape = 5 }
C { sdpa, T { 2, 3, 5, 4 }, expanded(T { 2, 1, 5, 4 }, { 2, 3, 5, 4 }), expanded(T { 2, 1, 5, 4 }, { 2, 3, 5, 4 }),
  tol = at }
C { "cross_entropy", T { 3, 4 }, expanded(I { 1 }, { 3 }) }
C { "embedding", expanded(I { 1 }, { 3 }), T { 4, 2 } }
C { "conv2d", expanded(T { 1, 2, 5, 5 }, { 3, 2, 5, 5 }), T { 3, 2, 3, 3 }, tol = { 1e-4, 1e-4 } }
C { "max_pool2d", expanded(D { 1, 2, 4, 4 }, { 3, 2, 4, 4 }), kernel = 2, tol = exact, fd_eps = 1e-3 }
C { "avg_pool2d", expanded(T { 1, 2, 4, 4 }, { 3, 2, 4, 4 }), kernel = 2 }
C { "index_select", expanded(T { 1, 3 }, { 2, 3 }), I { 2, 0 }, dim = 2 }
C { "cat", expanded(T { 1, 3 }, { 2, 3 }), T { 1, 3 } }
C { "max", expanded(D { 1, 6 }, { 3, 6 }), dim = 2, fd_eps = 1e-3 }
C { "softmax", expanded(T { 1, 5 }, { 3, 5 }), dim = -1 }
C { "log_softmax", expanded(T { 1, 5 }, { 3, 5 }), dim = 1 }
C { "mse_loss", expanded(T { 1, 3 }, { 2, 3 }), T { 2, 3 } }
C { "reshape", expanded(T { 1, 3 }, { 2, 3 }), shape = { 6 } }
C { "flatten", expanded(T { 1, 3 }, { 2, 3 }) }
C { "to", expanded(T { 1, 3 }, { 2, 3 }), dtype = "bfloat16", nograd = true }
C { "eq", expanded(Ri(0, 3, { 1, 3 }, { dtype = "float32" }), { 2, 3 }), Ri(0, 3, { 3 }, { dtype = "float32" }) }

-- ---- 0-dim tensors, zero-length dims, special values ---------------------------------------------
C { "exp", T {} }
C { "sum", T {}, dim = 1 }
C { "max", T {} }
C { "argmax", T {} }
C { "unsqueeze", T {}, dim = 1 }
C { "mean", T { 2, 3 }, keepdim = true }
C { "softmax", T { 3, 0 }, dim = 2 }
C { "sum", T { 3, 0 }, dim = 2, want = { 0, 0, 0 } }
C { "mean", T { 3, 0 }, dim = 2, want = { 0 / 0, 0 / 0, 0 / 0 }, nograd = true }
C { "permute", T { 2, 3, 4 }, dims = { -1, 1, 2 } }
C { "transpose", T { 2, 3 }, dims = { 1, 1 } }
C { "narrow", A { 2, 3 }, dim = -1, start = 2, length = 2, want = { { 1, 2 }, { 4, 5 } } }
C { "cat", T { 2 } }
C { "dropout", T { 3 }, p = 1, training = false }
C { "pow", V { 0, 2 }, s = 0, want = { 1, 1 }, tol = exact, nograd = true }
C { "rdiv_scalar", V { 0, 2 }, s = 1, want = { math.huge, 0.5 }, nograd = true }
C { "div", V { 0, 1 }, V { 0, 0 }, want = { 0 / 0, math.huge }, nograd = true }
C { "log", V { 0, 1 }, want = { -math.huge, 0 }, nograd = true }

-- ---- mixed float dtypes -------------------------------------------------------------------------
-- PyTorch's promotion: float32 with bfloat16 gives float32, but a 0-dim tensor takes the dtype
-- of a tensor with dims; layer_norm keeps a bfloat16 input's dtype with float32 parameters
local bf = { dtype = "bfloat16" }
for _, op in ipairs { "add", "sub", "mul", "div" } do
  C { op, T { 2, 3 }, T({ 3 }, { lo = 0.5, hi = 2, dtype = "bfloat16" }) }
  C { op, T({ 2, 3 }, bf), T({}, { lo = 0.5, hi = 2 }) }
  C { op, T {}, T({ 2, 3 }, { lo = 0.5, hi = 2, dtype = "bfloat16" }) }
end
C { "layer_norm", T({ 3, 5 }, bf), T { 5 }, T { 5 }, shape = 5 }
C { "mse_loss", T({ 3, 4 }, bf), T { 3, 4 } }
C { "scaled_dot_product_attention", T({ 1, 2, 3, 4 }, bf), T({ 1, 2, 5, 4 }, bf), T({ 1, 2, 5, 3 }, bf), T { 3, 5 },
  tol = at }
-- float16 takes the same path as bfloat16
C { "linear", T({ 3, 4 }, { dtype = "float16" }), T({ 5, 4 }, { dtype = "float16" }), T({ 5 }, { dtype = "float16" }) }
C { "softmax", T({ 3, 7 }, { dtype = "float16" }), dim = -1 }

-- ---- comparisons, where, masked_fill, clamp, minimum/maximum, min, cumsum, tril/triu ------------
local function B(data) return V(data, { dtype = "bool" }) end
local function Rb(shape) return Ri(0, 2, shape, { dtype = "bool" }) end
local c23 = V { { 1, 2, 3 }, { 3, 2, 1 } }
C { "ne", c23, V { 3, 2, 1 }, want = { { 1, 0, 1 }, { 0, 0, 0 } } }
C { "lt", c23, V { 3, 2, 1 }, want = { { 1, 0, 0 }, { 0, 0, 0 } } }
C { "le", c23, V { 3, 2, 1 }, want = { { 1, 1, 0 }, { 1, 1, 1 } } }
C { "gt", c23, V { 3, 2, 1 }, want = { { 0, 0, 1 }, { 0, 0, 0 } } }
C { "ge", c23, V { 3, 2, 1 }, want = { { 0, 1, 1 }, { 1, 1, 1 } } }
for _, op in ipairs { "ne", "lt", "le", "gt", "ge" } do
  C { op, Ri(0, 3, { 7, 13 }, { dtype = "float32" }), Ri(0, 3, { 13 }, { dtype = "float32" }) }
  C { op, transposed(Ri(0, 3, { 4, 5 }, { dtype = "float32" })), Ri(0, 3, { 4, 1 }, { dtype = "float32" }) }
  C { op, Ri(-3, 3, { 3, 4 }), Ri(-3, 3, { 1, 4 }) }
  C { op, Ri(0, 3, { 3, 4 }, { dtype = "float16" }), Ri(0, 3, { 4 }, { dtype = "float16" }) }
  C { op, T { 0, 3 }, T { 3 } }
  C { op .. "_scalar", Ri(0, 3, { 2, 5 }, { dtype = "float32" }), s = 1 }
  C { op .. "_scalar", Ri(-3, 3, { 2, 5 }), s = 0 }
  C { op .. "_scalar", T { 3, 4 }, s = 0.25 }
end
C { "lt_scalar", V { -1, 0, 1 }, s = 0, want = { 1, 0, 0 } }
C { "eq", B { 1, 0, 1 }, B { 1, 1, 0 }, want = { 1, 0, 0 } } -- bool against bool

local cond23 = B { { 1, 0, 1 }, { 0, 0, 1 } }
C { "where", cond23, V { { 1, 2, 3 }, { 4, 5, 6 } }, V { { -1, -2, -3 }, { -4, -5, -6 } },
  want = { { 1, -2, 3 }, { -4, -5, 6 } }, tol = exact }
C { "where", Rb { 3, 4 }, T { 3, 4 }, T { 3, 4 } }
C { "where", Rb { 3, 1 }, T { 4 }, T { 3, 4 } }
C { "where", Rb { 2, 3, 4 }, T { 3, 1 }, T { 4 } } -- the condition sets the shape
C { "where", Rb { 4 }, T {}, T { 2, 1 } }
C { "where", Rb { 3, 4 }, transposed(T { 3, 4 }), narrowed(T { 3, 4 }) }
C { "where", viewed(Rb { 4, 3 }, function(t) return t:t() end, "t"), T { 3, 4 }, T { 3, 4 } }
C { "where", Rb { 3, 4 }, T { 3, 4 }, T { 4 }, method = true }
C { "where", Rb { 0, 3 }, T { 0, 3 }, T { 3 } }
C { "where_scalar", Rb { 3, 4 }, T { 3, 4 }, s = 0.5 }
C { "where_scalar", cond23, V { { 1, 2, 3 }, { 4, 5, 6 } }, s = -math.huge,
  want = { { 1, -math.huge, 3 }, { -math.huge, -math.huge, 6 } }, nograd = true }
C { "masked_fill", V { { 1, 2, 3 }, { 4, 5, 6 } }, cond23, value = 0, want = { { 0, 2, 0 }, { 4, 5, 0 } }, tol = exact }
C { "masked_fill", T { 3, 4 }, Rb { 3, 4 }, value = 0.5 }
C { "masked_fill", T { 3, 4 }, Rb { 4 }, value = -2 }
C { "masked_fill", transposed(T { 3, 4 }), Rb { 3, 1 }, value = 1 }
C { "masked_fill", T { 2, 3 }, B { { 1, 0, 0 }, { 0, 0, 0 } }, value = -math.huge, nograd = true }

-- clamp: values away from the bounds (finite differences), and the bounds themselves forward only
local spread = V { { -1.7, -0.8, -0.3, 0.1 }, { 0.45, 0.7, 1.2, 2.4 } }
C { "clamp", spread, min = -0.5, max = 0.5, want = { { -0.5, -0.5, -0.3, 0.1 }, { 0.45, 0.5, 0.5, 0.5 } },
  fd_eps = 1e-3 }
C { "clamp", spread, min = 0, fd_eps = 1e-3 }
C { "clamp", spread, max = 0.6, kw = true, fd_eps = 1e-3 }
C { "clamp", spread, min = -1, kw = true, fd_eps = 1e-3 }
C { "clamp", spread, min = 1, max = -1, want = { { -1, -1, -1, -1 }, { -1, -1, -1, -1 } }, fd_eps = 1e-3 }
C { "clamp", transposed(T { 5, 7, away = 0.6 }), min = -0.5, max = 0.5, fd_eps = 1e-3 }
C { "clamp", T { 0, 3 }, min = 0 }

-- minimum / maximum: ties split the gradient (central differences see 1/2 there too)
local ta, tb = V { { 1, 2, 3 }, { -1, 0, 4 } }, V { { 1, 0, 5 }, { -1, 1, 2 } }
C { "maximum", ta, tb, want = { { 1, 2, 5 }, { -1, 1, 4 } }, tol = exact, fd_eps = 1e-3 }
C { "minimum", ta, tb, want = { { 1, 0, 3 }, { -1, 0, 2 } }, tol = exact, fd_eps = 1e-3 }
for _, op in ipairs { "minimum", "maximum" } do
  C { op, T { 3, 4 }, T { 4 }, fd_eps = 1e-3 }
  C { op, T { 3, 1 }, T { 1, 4 }, fd_eps = 1e-3 }
  C { op, transposed(T { 4, 3 }), T {}, fd_eps = 1e-3 }
  C { op, T { 2, 3 }, T { 2, 3 }, method = true, fd_eps = 1e-3 }
  C { op, T { 0, 3 }, T { 3 } }
end

-- min over a dim or all: the first index on ties, as max
C { "min", xm, dim = 2, want = { 1, -9, 0 }, want2 = { 3, 3, 1 }, nograd = true }
C { "min", xm, dim = 1, keepdim = true, want = { { -2, -5, -1, -9 } }, want2 = { { 1, 1, 1, 1 } }, nograd = true }
C { "min", V { { 3, 1, 1 }, { 2, 2, 5 } }, dim = 2, want = { 1, 2 }, want2 = { 1, 0 }, nograd = true }
C { "min", xm, want = -9, nograd = true }
C { "min", D { 3, 4, 5 }, dim = 2, fd_eps = 1e-3 }
C { "min", D { 3, 4, 5 }, dim = -1, keepdim = true, fd_eps = 1e-3 }
C { "min", D { 3, 4, 5 }, fd_eps = 1e-3 }
C { "min", transposed(D { 7, 13 }), dim = 1, fd_eps = 1e-3 }
C { "min", T { 0, 3 }, dim = 2 }

-- cumsum
C { "cumsum", V { { 1, 2, 3 }, { 4, 5, 6 } }, dim = 2, want = { { 1, 3, 6 }, { 4, 9, 15 } }, tol = exact }
C { "cumsum", V { { 1, 2, 3 }, { 4, 5, 6 } }, dim = 1, want = { { 1, 2, 3 }, { 5, 7, 9 } }, tol = exact }
C { "cumsum", T { 3, 4 }, dim = -1 }
C { "cumsum", T { 2, 3, 4 }, dim = 2 }
C { "cumsum", transposed(T { 5, 3 }), dim = 1 }
C { "cumsum", narrowed(T { 4, 6 }), dim = 2 }
C { "cumsum", T { 70 }, dim = 1 }
C { "cumsum", V(2.5), dim = 1, want = 2.5 }
C { "cumsum", T { 0, 3 }, dim = 1 }

-- tril / triu over the last two dims
local m34 = A { 3, 4, start = 1 }
C { "tril", m34, want = { { 1, 0, 0, 0 }, { 5, 6, 0, 0 }, { 9, 10, 11, 0 } }, tol = exact }
C { "triu", m34, want = { { 1, 2, 3, 4 }, { 0, 6, 7, 8 }, { 0, 0, 11, 12 } }, tol = exact }
C { "tril", m34, k = 1, want = { { 1, 2, 0, 0 }, { 5, 6, 7, 0 }, { 9, 10, 11, 12 } }, tol = exact }
C { "triu", m34, k = -1, want = { { 1, 2, 3, 4 }, { 5, 6, 7, 8 }, { 0, 10, 11, 12 } }, tol = exact }
for _, op in ipairs { "tril", "triu" } do
  C { op, T { 4, 5 } }
  C { op, T { 2, 3, 4 }, k = 1 }
  C { op, T { 4, 3 }, k = -2 }
  C { op, T { 3, 3 }, k = 5 }
  C { op, transposed(T { 4, 5 }) }
  C { op, T { 3, 4 }, fn = true, k = -1 }
  C { op, T { 0, 3 } }
end

-- ---- indexing sugar: select and x[...] ------------------------------------------------------------
local s234 = A { 2, 3, 4 }
C { "select", m34, dim = 1, i = 2, want = { 5, 6, 7, 8 }, tol = exact }
C { "select", m34, dim = 2, i = -1, want = { 4, 8, 12 }, tol = exact }
C { "select", s234, dim = 2, i = 3 }
C { "select", s234, dim = -1, i = 1 }
C { "select", T { 2, 3, 4 }, dim = 3, i = 2 }
C { "select", transposed(T { 3, 4 }), dim = 1, i = 3 }
C { "select", T { 5 }, dim = 1, i = 4 }
C { "index", m34, key = 2, want = { 5, 6, 7, 8 }, tol = exact }
C { "index", m34, key = -1, want = { 9, 10, 11, 12 }, tol = exact }
C { "index", m34, key = { 2, { 2, 3 } }, want = { 6, 7 }, tol = exact }
C { "index", m34, key = { ":", 2 }, want = { 2, 6, 10 }, tol = exact }
C { "index", m34, key = { {}, -1 }, want = { 4, 8, 12 }, tol = exact }
C { "index", m34, key = { { 1, 2 }, { -2, -1 } }, want = { { 3, 4 }, { 7, 8 } }, tol = exact }
C { "index", m34, key = { { 3 } }, want = { { 9, 10, 11, 12 } }, tol = exact }
C { "index", s234, key = { 2, 3, 4 }, want = 23, tol = exact }
C { "index", T { 2, 3, 4 }, key = { ":", { 2, 3 }, 2 } }
C { "index", T { 2, 3, 4 }, key = { 1 } }
C { "index", transposed(T { 4, 5 }), key = { { 2, 4 }, -2 } }
-- ---- selection, sorting, splitting, repeating -------------------------------------------------
-- topk/sort take dims and flags in an options table or positionally (positional = true); values
-- are differentiable (D inputs: no ties near the finite-difference steps), indices int64 0-based
ops.topk = {
  call = function(p, a)
    if p.positional then
      return a:topk(p.k, p.dim, p.largest)
    end
    return a:topk(p.k, { dim = p.dim, largest = p.largest })
  end,
  ref = R.topk,
}
ops.sort = {
  call = function(p, a)
    if p.positional then
      return a:sort(p.dim, p.descending)
    end
    return a:sort({ dim = p.dim, descending = p.descending })
  end,
  ref = R.sort,
}
ops.argsort = {
  call = function(p, a) return a:argsort({ dim = p.dim, descending = p.descending }) end,
  ref = R.argsort,
  nograd = true,
}
ops.gather = { call = function(p, a, idx) return a:gather(p.dim, idx) end, ref = R.gather }
ops.scatter_add = { call = function(p, a, idx, src) return a:scatter_add(p.dim, idx, src) end, ref = R.scatter_add }
-- split/chunk: the pieces from number p.pick on (default 1; the gradient check takes the first)
ops.split = {
  call = function(p, a) return unpack(a:split(p.sizes or p.size, p.dim), p.pick or 1) end,
  ref = function(p, a) return select(p.pick or 1, R.split(p, a)) end,
}
ops.chunk = {
  call = function(p, a) return unpack(a:chunk(p.n, p.dim), p.pick or 1) end,
  ref = function(p, a) return select(p.pick or 1, R.chunk(p, a)) end,
}
ops.stack = { call = function(p, ...) return fsdp.stack({ ... }, p.dim) end, ref = R.stack }
ops.tile = { call = function(p, a) return a:tile(p.reps) end, ref = R.tile }
ops["repeat"] = { call = function(p, a) return a["repeat"](a, unpack(p.reps)) end, ref = R.tile }
ops.expand_args = { call = function(p, a) return a:expand(unpack(p.shape)) end, ref = R.expand }

C { "topk", D { 3, 7 }, k = 3 }
C { "topk", D { 3, 7 }, k = 2, dim = 1, largest = false }
C { "topk", D { 3, 7 }, k = 2, dim = 1, positional = true }
C { "topk", transposed(D { 4, 5 }), k = 5, dim = -1 }
C { "topk", D { 2, 3, 4 }, k = 1, dim = 2 }
C { "topk", D { 6 }, k = 0 }
C { "topk", V { 1, 3, 3, 2, 3 }, k = 2, want = { 3, 3 }, want2 = { 1, 2 }, nograd = true } -- ties: earlier first
C { "topk", V { 1, 3, 3, 2, 3 }, k = 2, largest = false, want = { 1, 2 }, want2 = { 0, 3 }, nograd = true }
C { "sort", D { 3, 7 } }
C { "sort", D { 3, 7 }, dim = 1, descending = true }
C { "sort", narrowed(D { 4, 6 }), dim = 2, descending = true, positional = true }
C { "sort", D { 2, 3, 4 }, dim = 2 }
C { "sort", D { 2, 0, 3 }, dim = 3 }
C { "sort", V { 2, 1, 2, 1, -1 }, want = { -1, 1, 1, 2, 2 }, want2 = { 4, 1, 3, 0, 2 }, nograd = true } -- stable
C { "sort", V { 2, 1, 2, 1, -1 }, descending = true, want = { 2, 2, 1, 1, -1 }, want2 = { 0, 2, 1, 3, 4 },
  nograd = true }
C { "sort", V { 2, 0 / 0, -1 }, nograd = true } -- NaN last (the reference says so; NaN ~= NaN in want)
C { "argsort", D { 4, 5 }, dim = 1 }
C { "argsort", V { 3, 1, 2 }, descending = true, want = { 0, 2, 1 } }
C { "gather", T { 3, 4 }, I { { 0, 3 }, { 1, 1 }, { 2, 0 } }, dim = 2 }
C { "gather", T { 3, 4 }, I { { 2, 0, 1, 1 }, { 0, 2, 2, 1 } }, dim = 1 }
C { "gather", transposed(T { 3, 4 }), I { { 0, 3 }, { 1, 1 } }, dim = -1 } -- index smaller in dim 1 too
C { "gather", T { 2, 3, 4 }, Ri(0, 3, { 2, 5, 2 }), dim = 2 }
C { "gather", V { { 1, 2 }, { 3, 4 } }, I { { 0, 0 }, { 1, 0 } }, dim = 2, want = { { 1, 1 }, { 4, 3 } } }
C { "scatter_add", T { 3, 5 }, I { { 0, 1, 0 }, { 4, 4, 4 }, { 2, 3, 1 } }, T { 3, 3 }, dim = 2 }
C { "scatter_add", T { 3, 5 }, I { { 0, 1 }, { 2, 2 } }, T { 3, 4 }, dim = 1 } -- src larger than index
C { "scatter_add", narrowed(T { 2, 4 }), I { { 3, 3 } }, transposed(T { 2, 2 }), dim = 2 }
C { "scatter_add", V { { 0, 0, 0, 0, 0 }, { 0, 0, 0, 0, 0 }, { 0, 0, 0, 0, 0 } }, I { { 0, 1, 2, 0, 0 } },
  V { { 1, 1, 1, 1, 1 }, { 1, 1, 1, 1, 1 } }, dim = 1,
  want = { { 1, 0, 0, 1, 1 }, { 0, 1, 0, 0, 0 }, { 0, 0, 1, 0, 0 } } } -- PyTorch's documented example
C { "split", A { 7, 2 }, size = 3, want = { { 0, 1 }, { 2, 3 }, { 4, 5 } } }
C { "split", A { 7, 2 }, size = 3, pick = 3, want = { { 12, 13 } } }
C { "split", T { 7, 2 }, size = 3, pick = 2 }
C { "split", T { 2, 7 }, sizes = { 2, 0, 5 }, dim = 2, pick = 3 }
C { "split", transposed(T { 2, 7 }), sizes = { 2, 0, 5 }, dim = -1 }
C { "chunk", T { 2, 7 }, n = 3, dim = 2 }
C { "chunk", T { 5, 2 }, n = 2, pick = 2 }
C { "chunk", A { 6 }, n = 4, pick = 3, want = { 4, 5 } } -- torch.chunk: 3 pieces of 2
C { "stack", T { 2, 3 }, T { 2, 3 } }
C { "stack", T { 2, 3 }, T { 2, 3 }, T { 2, 3 }, dim = 3 }
C { "stack", T { 2, 3 }, transposed(T { 2, 3 }), dim = -1 }
C { "stack", A { 2 }, A { 2, start = 5 }, dim = 2, want = { { 0, 5 }, { 1, 6 } } }
C { "tile", T { 2, 3 }, reps = { 2, 1 } }
C { "tile", T { 2, 3 }, reps = { 2 } } -- fewer counts than dims: the last dims
C { "tile", transposed(T { 3, 2 }), reps = { 2, 2, 2 } }
C { "tile", A { 2, 3 }, reps = { 1, 0 }, nograd = true }
C { "repeat", A { 2, 2 }, reps = { 1, 2, 3 } }
C { "repeat", T { 2, 3 }, reps = { 2, 2 } }
C { "repeat", A { 3 }, reps = { 2 }, want = { 0, 1, 2, 0, 1, 2 } }
C { "squeeze", T { 1, 3, 1 } }
C { "squeeze", T { 1, 3, 1 }, dim = { 1, -1 } }
C { "squeeze", T { 1, 3, 1 }, dim = { 2 } }
C { "expand_args", T { 3, 1 }, shape = { 2, -1, 4 } }

-- ---- bfloat16: every case again ---------------------------------------------------------------
-- Every float op takes bfloat16 tensors, computing in float32 and rounding its result once: each
-- case above with float32 inputs is declared again with those inputs in bfloat16 (int64 inputs
-- stay). Its output must be the reference on the bfloat16 values rounded once, and runner 4 of
-- ops_spec.lua checks its gradients against float32 ones on the same values. Hand-computed
-- values are for the float32 inputs and are not carried over; tol stays the float32 computation's.
local carried = { "tol", "nograd", "known_failure" }
local f32_cases = #cases
for k = 1, f32_cases do
  local c = cases[k]
  local t = { c.op }
  local any = false
  for i, spec in ipairs(c.inputs) do
    t[i + 1] = spec
    if not spec.none and spec.dtype == "float32" then
      t[i + 1] = in_dtype(spec, "bfloat16")
      any = true
    end
  end
  if any then
    for name, v in pairs(c.p) do
      t[name] = v
    end
    for _, name in ipairs(carried) do
      t[name] = c[name]
    end
    C(t)
  end
end

return M
