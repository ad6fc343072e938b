-- Naive references for the op-case table (tests/ops/op_cases.lua): plain Lua loops over flat
-- row-major arrays, written from the PyTorch definitions and sharing no code with the library.
--
-- An array is { shape = {...}, data = {...}, dtype = "float32" }: data holds numel(shape) Lua
-- numbers in row-major order (an empty shape is a 0-dim scalar with one value). Every reference
-- is called as ref(p, a, b, ...): p the case's parameters (dims are Lua dims, 1-based or negative
-- from the end, as the library takes them), then one array per input (nil for an absent optional
-- input). It returns one array per output of the op.
local R = {}

-- ---- arrays and indices -------------------------------------------------------------------------
function R.array(shape, data, dtype)
  return { shape = shape, data = data, dtype = dtype or "float32" }
end
local array = R.array

local function numel(shape)
  local n = 1
  for i = 1, #shape do
    n = n * shape[i]
  end
  return n
end
R.numel = numel

local function copy(list)
  local r = {}
  for i = 1, #list do
    r[i] = list[i]
  end
  return r
end

-- 0-based flat index -> 0-based multi-index
local function unravel(i, shape)
  local idx = {}
  for d = #shape, 1, -1 do
    idx[d] = i % shape[d]
    i = math.floor(i / shape[d])
  end
  return idx
end

R.unravel = unravel

-- a tensor's values as an array (nil stays nil), for the specs that use a reference directly
function R.from_tensor(t)
  if t == nil then
    return nil
  end
  return array(t:shape(), t:tolist(), t.dtype)
end

-- 0-based multi-index -> 0-based flat index
local function ravel(idx, shape)
  local i = 0
  for d = 1, #shape do
    i = i * shape[d] + idx[d]
  end
  return i
end

-- a Lua dim (1-based, or negative from the end) of an nd-dim shape -> 1-based
local function dim1(d, nd)
  if d < 0 then
    return d + nd + 1
  end
  return d
end

-- the sizes before dim d, at d, and after d (the loops "along a dim" iterate over these)
local function split_at(shape, d)
  local outer = 1
  for i = 1, d - 1 do
    outer = outer * shape[i]
  end
  local inner = 1
  for i = d + 1, #shape do
    inner = inner * shape[i]
  end
  return outer, shape[d], inner
end

-- an int or a pair {h, w} -> h, w
local function pair(v, default)
  if v == nil then
    v = default
  end
  if type(v) == "table" then
    return v[1], v[2]
  end
  return v, v
end

-- out[i] = a[map(i)] for every output multi-index: the shared core of the view references
local function gather(a, out_shape, map, dtype)
  local out = {}
  for i = 0, numel(out_shape) - 1 do
    local src = map(unravel(i, out_shape))
    out[i + 1] = a.data[ravel(src, a.shape) + 1]
  end
  return array(out_shape, out, dtype or a.dtype)
end

-- ---- rounding to the storage dtypes -------------------------------------------------------------
-- v rounded to `bits` significant bits, ties to even (normal range only: the cases stay inside)
local function round_bits(v, bits)
  if v == 0 or v ~= v or v == math.huge or v == -math.huge then
    return v
  end
  local m, e = math.frexp(v)
  local scaled = m * 2 ^ bits
  local r = math.floor(scaled + 0.5)
  if r - scaled == 0.5 and r % 2 ~= 0 then
    r = r - 1
  end
  return math.ldexp(r, e - bits)
end

local function to_dtype(v, dtype)
  if dtype == "bfloat16" then
    return round_bits(v, 8)
  elseif dtype == "float16" then
    return round_bits(v, 11)
  elseif dtype == "int64" then
    if v >= 0 then
      return math.floor(v)
    end
    return math.ceil(v)
  end
  return round_bits(v, 24)
end
R.to_dtype = to_dtype

-- ---- elementwise --------------------------------------------------------------------------------
local function broadcast_shape(sa, sb)
  local nd = math.max(#sa, #sb)
  local out = {}
  for d = 1, nd do
    local x = sa[d - nd + #sa] or 1
    local y = sb[d - nd + #sb] or 1
    assert(x == y or x == 1 or y == 1, "reference: shapes do not broadcast")
    if x == 1 then
      out[d] = y
    else
      out[d] = x
    end
  end
  return out
end

-- flat 0-based index into `shape`, right-aligned under the output multi-index idx (size-1 dims
-- of shape repeat)
local function source_index(idx, shape)
  local off = #idx - #shape
  local i = 0
  for d = 1, #shape do
    local k = idx[off + d]
    if shape[d] == 1 then
      k = 0
    end
    i = i * shape[d] + k
  end
  return i
end

-- f(x, p) on every element
function R.map(f, dtype)
  return function(p, a)
    local out = {}
    for i = 1, #a.data do
      out[i] = f(a.data[i], p)
    end
    return array(copy(a.shape), out, dtype or a.dtype)
  end
end

-- The dtype of a result of float inputs a and b (PyTorch's type promotion among floats): theirs
-- when they agree; else a tensor with dims decides over a 0-dim one, and otherwise float32.
function R.result_dtype(a, b)
  if a.dtype == b.dtype then
    return a.dtype
  end
  if #a.shape > 0 and #b.shape == 0 then
    return a.dtype
  end
  if #a.shape == 0 and #b.shape > 0 then
    return b.dtype
  end
  return "float32"
end

-- f(x, y) over the broadcast of a and b
function R.map2(f, dtype)
  return function(_, a, b)
    local shape = broadcast_shape(a.shape, b.shape)
    local out = {}
    for i = 0, numel(shape) - 1 do
      local idx = unravel(i, shape)
      out[i + 1] = f(a.data[source_index(idx, a.shape) + 1], b.data[source_index(idx, b.shape) + 1])
    end
    return array(shape, out, dtype or R.result_dtype(a, b))
  end
end

-- erf by its Taylor series (|x| < 5 is plenty for the cases), double precision
local function erf(x)
  local sum = x
  local term = x
  local n = 0
  repeat
    n = n + 1
    term = -term * x * x / n
    local add = term / (2 * n + 1)
    sum = sum + add
  until math.abs(add) < 1e-17 * math.abs(sum) or n > 300
  return 2 / math.sqrt(math.pi) * sum
end
R.erf = erf

function R.gelu(x, p)
  if p.approximate == "tanh" then
    return 0.5 * x * (1 + math.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x ^ 3)))
  end
  return 0.5 * x * (1 + erf(x / math.sqrt(2)))
end

function R.sigmoid(x)
  return 1 / (1 + math.exp(-x))
end

function R.relu(x)
  if x > 0 then
    return x
  end
  return 0
end

-- ---- reductions ---------------------------------------------------------------------------------
-- p.dim: nil (all dims), a number or a table of numbers; p.keepdim
local function reduce(p, a, mean)
  local nd = #a.shape
  local red = {}
  if p.dim == nil then
    for d = 1, nd do
      red[d] = true
    end
  elseif type(p.dim) == "table" then
    for _, d in ipairs(p.dim) do
      red[dim1(d, nd)] = true
    end
  else
    red[dim1(p.dim, nd)] = true
  end
  local out_shape = {}
  local kept = {}
  local count = 1
  for d = 1, nd do
    if red[d] then
      count = count * a.shape[d]
      if p.keepdim then
        out_shape[#out_shape + 1] = 1
        kept[#kept + 1] = 1
      end
    else
      out_shape[#out_shape + 1] = a.shape[d]
      kept[#kept + 1] = a.shape[d]
    end
  end
  local out = {}
  for i = 1, numel(out_shape) do
    out[i] = 0
  end
  for i = 0, #a.data - 1 do
    local idx = unravel(i, a.shape)
    local o = {}
    for d = 1, nd do
      if red[d] then
        if p.keepdim then
          o[#o + 1] = 0
        end
      else
        o[#o + 1] = idx[d]
      end
    end
    local k = ravel(o, kept) + 1
    out[k] = out[k] + a.data[i + 1]
  end
  if mean then
    for i = 1, #out do
      out[i] = out[i] / count
    end
  end
  return array(out_shape, out, a.dtype)
end

function R.sum(p, a)
  return reduce(p, a, false)
end

function R.mean(p, a)
  return reduce(p, a, true)
end

-- max along p.dim: values and 0-based indices, the first index on ties, NaN wins (PyTorch)
-- the largest (or, with smallest, the smallest) entry along p.dim and its first index; NaN wins
local function max_along(p, a, smallest)
  local nd = #a.shape
  local d = dim1(p.dim, nd)
  local outer, n, inner = split_at(a.shape, d)
  local values = {}
  local indices = {}
  for o = 0, outer - 1 do
    for i = 0, inner - 1 do
      local best = nil
      local best_c = -1
      for c = 0, n - 1 do
        local v = a.data[(o * n + c) * inner + i + 1]
        local better = best == nil or (best == best and (v ~= v or (smallest and v < best) or (not smallest and v > best)))
        if better then
          best = v
          best_c = c
        end
      end
      values[#values + 1] = best
      indices[#indices + 1] = best_c
    end
  end
  local shape = copy(a.shape)
  if p.keepdim then
    shape[d] = 1
  else
    table.remove(shape, d)
  end
  return array(shape, values, a.dtype), array(copy(shape), indices, "int64")
end

-- x:max() (a 0-dim value) or x:max(dim[, keepdim]) (values, indices)
local function extremum(p, a, smallest)
  if p.dim == nil then
    local flat = array({ #a.data }, a.data, a.dtype)
    local v = max_along({ dim = 1 }, flat, smallest)
    return array({}, v.data, a.dtype)
  end
  return max_along(p, a, smallest)
end
function R.max(p, a) return extremum(p, a, false) end

function R.argmax(p, a)
  if p.dim == nil then
    local flat = array({ #a.data }, a.data, a.dtype)
    local _, i = max_along({ dim = 1 }, flat)
    return array({}, i.data, "int64")
  end
  local _, i = max_along(p, a)
  return i
end

-- ---- softmax ------------------------------------------------------------------------------------
local function softmax(p, a, log)
  local shape = a.shape
  if #shape == 0 then
    shape = { 1 }
  end
  local d = dim1(p.dim, #shape)
  local outer, n, inner = split_at(shape, d)
  local out = {}
  for o = 0, outer - 1 do
    for i = 0, inner - 1 do
      local mx = -math.huge
      for c = 0, n - 1 do
        mx = math.max(mx, a.data[(o * n + c) * inner + i + 1])
      end
      local s = 0
      for c = 0, n - 1 do
        s = s + math.exp(a.data[(o * n + c) * inner + i + 1] - mx)
      end
      for c = 0, n - 1 do
        local k = (o * n + c) * inner + i + 1
        if log then
          out[k] = a.data[k] - mx - math.log(s)
        else
          out[k] = math.exp(a.data[k] - mx) / s
        end
      end
    end
  end
  return array(copy(a.shape), out, a.dtype)
end

function R.softmax(p, a)
  return softmax(p, a, false)
end

function R.log_softmax(p, a)
  return softmax(p, a, true)
end

-- ---- linear algebra -----------------------------------------------------------------------------
-- torch.matmul: 1-D operands promoted (and the added dim removed again), batch dims broadcast
function R.matmul(_, a, b)
  local sa = copy(a.shape)
  local sb = copy(b.shape)
  local a1 = #sa == 1
  local b1 = #sb == 1
  if a1 then
    sa = { 1, sa[1] }
  end
  if b1 then
    sb = { sb[1], 1 }
  end
  local n = sa[#sa - 1]
  local k = sa[#sa]
  local m = sb[#sb]
  local ba = { unpack(sa, 1, #sa - 2) }
  local bb = { unpack(sb, 1, #sb - 2) }
  local bs = broadcast_shape(ba, bb)
  local out = {}
  for t = 0, numel(bs) - 1 do
    local idx = unravel(t, bs)
    local oa = source_index(idx, ba) * n * k
    local ob = source_index(idx, bb) * k * m
    for i = 0, n - 1 do
      for j = 0, m - 1 do
        local s = 0
        for q = 0, k - 1 do
          s = s + a.data[oa + i * k + q + 1] * b.data[ob + q * m + j + 1]
        end
        out[#out + 1] = s
      end
    end
  end
  local shape = copy(bs)
  if not a1 then
    shape[#shape + 1] = n
  end
  if not b1 then
    shape[#shape + 1] = m
  end
  return array(shape, out, a.dtype)
end

R.bmm = R.matmul

-- x (*, in), w (out, in), b (out) or nil
function R.linear(_, x, w, b)
  local out_f = w.shape[1]
  local in_f = w.shape[2]
  local rows = numel(x.shape) / in_f
  local out = {}
  for i = 0, rows - 1 do
    for o = 0, out_f - 1 do
      local s = 0
      if b then
        s = b.data[o + 1]
      end
      for q = 0, in_f - 1 do
        s = s + x.data[i * in_f + q + 1] * w.data[o * in_f + q + 1]
      end
      out[#out + 1] = s
    end
  end
  local shape = copy(x.shape)
  shape[#shape] = out_f
  return array(shape, out, x.dtype)
end

-- ---- views and shape ----------------------------------------------------------------------------
-- the same data under a new shape (one -1 inferred): view, reshape, flatten, squeeze, unsqueeze
local function reshaped(a, shape)
  local known = 1
  local infer = nil
  for i = 1, #shape do
    if shape[i] == -1 then
      infer = i
    else
      known = known * shape[i]
    end
  end
  shape = copy(shape)
  if infer then
    shape[infer] = #a.data / known
  end
  assert(numel(shape) == #a.data, "reference: reshape to a different number of elements")
  return array(shape, copy(a.data), a.dtype)
end

function R.reshape(p, a)
  return reshaped(a, p.shape)
end

function R.view_as(_, a, other)
  return reshaped(a, other.shape)
end

function R.flatten(p, a)
  local nd = #a.shape
  if nd == 0 then
    return reshaped(a, { 1 })
  end
  local s = dim1(p.start_dim or 1, nd)
  local e = dim1(p.end_dim or -1, nd)
  local shape = {}
  for d = 1, s - 1 do
    shape[#shape + 1] = a.shape[d]
  end
  local n = 1
  for d = s, e do
    n = n * a.shape[d]
  end
  shape[#shape + 1] = n
  for d = e + 1, nd do
    shape[#shape + 1] = a.shape[d]
  end
  return reshaped(a, shape)
end

-- p.dim: a dim, a list of dims, or nil (every size-1 dim)
function R.squeeze(p, a)
  local nd = #a.shape
  local drop = {}
  if p.dim == nil then
    for d = 1, nd do
      drop[d] = true
    end
  else
    for _, d in ipairs(type(p.dim) == "table" and p.dim or { p.dim }) do
      drop[dim1(d, nd)] = true
    end
  end
  local shape = {}
  for d = 1, nd do
    if not (drop[d] and a.shape[d] == 1) then
      shape[#shape + 1] = a.shape[d]
    end
  end
  return reshaped(a, shape)
end

function R.unsqueeze(p, a)
  local shape = copy(a.shape)
  local d = dim1(p.dim, #shape + 1)
  table.insert(shape, d, 1)
  return reshaped(a, shape)
end

-- out dims in the order p.dims (Lua dims)
local function permuted(a, dims)
  local nd = #a.shape
  local order = {}
  local shape = {}
  for i = 1, nd do
    order[i] = dim1(dims[i], nd)
    shape[i] = a.shape[order[i]]
  end
  return gather(a, shape, function(idx)
    local src = {}
    for i = 1, nd do
      src[order[i]] = idx[i]
    end
    return src
  end)
end

function R.permute(p, a)
  return permuted(a, p.dims)
end

function R.transpose(p, a)
  local nd = #a.shape
  local dims = {}
  for i = 1, nd do
    dims[i] = i
  end
  local d0 = dim1(p.dims[1], nd)
  local d1 = dim1(p.dims[2], nd)
  dims[d0] = d1
  dims[d1] = d0
  return permuted(a, dims)
end

-- x:t(): tensors of fewer than 2 dims are returned as they are
function R.t(p, a)
  if #a.shape < 2 then
    return array(copy(a.shape), copy(a.data), a.dtype)
  end
  return R.transpose({ dims = { 1, 2 } }, a)
end

-- p.shape: sizes (-1 keeps one), possibly with new leading dims
local function expanded(a, target)
  local off = #target - #a.shape
  local shape = {}
  for d = 1, #target do
    if target[d] == -1 then
      shape[d] = a.shape[d - off]
    else
      shape[d] = target[d]
    end
  end
  return gather(a, shape, function(idx)
    local src = {}
    for d = 1, #a.shape do
      if a.shape[d] == 1 then
        src[d] = 0
      else
        src[d] = idx[d + off]
      end
    end
    return src
  end)
end

function R.expand(p, a)
  return expanded(a, p.shape)
end

function R.expand_as(_, a, other)
  return expanded(a, other.shape)
end

-- p.dim, p.start (1-based), p.length
function R.narrow(p, a)
  local d = dim1(p.dim, #a.shape)
  local shape = copy(a.shape)
  shape[d] = p.length
  return gather(a, shape, function(idx)
    local src = copy(idx)
    src[d] = idx[d] + p.start - 1
    return src
  end)
end

-- rows (along p.dim) at the 0-based int64 indices of idx
function R.index_select(p, a, idx)
  local d = dim1(p.dim, #a.shape)
  local shape = copy(a.shape)
  shape[d] = #idx.data
  return gather(a, shape, function(i)
    local src = copy(i)
    src[d] = idx.data[i[d] + 1]
    return src
  end)
end

-- fsdp.cat({...}, p.dim)
function R.cat(p, ...)
  local list = { ... }
  local nd = #list[1].shape
  local d = dim1(p.dim or 1, nd)
  local shape = copy(list[1].shape)
  shape[d] = 0
  for _, a in ipairs(list) do
    shape[d] = shape[d] + a.shape[d]
  end
  local out = {}
  for i = 0, numel(shape) - 1 do
    local idx = unravel(i, shape)
    local k = idx[d]
    for _, a in ipairs(list) do
      if k < a.shape[d] then
        local src = copy(idx)
        src[d] = k
        out[i + 1] = a.data[ravel(src, a.shape) + 1]
        break
      end
      k = k - a.shape[d]
    end
  end
  return array(shape, out, list[1].dtype)
end

-- a copy of the values: clone, contiguous, detach, cpu, dropout in eval mode
function R.identity(_, a)
  return array(copy(a.shape), copy(a.data), a.dtype)
end

-- x:to(p.dtype), rounding like PyTorch (nearest even, truncation to int64)
function R.to(p, a)
  local out = {}
  for i = 1, #a.data do
    out[i] = to_dtype(a.data[i], p.dtype)
  end
  return array(copy(a.shape), out, p.dtype)
end

-- ---- convolution and pooling --------------------------------------------------------------------
-- x (N, C, H, W), w (O, C/groups, kh, kw), b (O) or nil; p.stride, p.padding (int, pair,
-- "same" or "valid"), p.dilation, p.groups
function R.conv2d(p, x, w, b)
  local sh, sw = pair(p.stride, 1)
  local dh, dw = pair(p.dilation, 1)
  local N, C, H, W = unpack(x.shape)
  local O, Cg, kh, kw = unpack(w.shape)
  local ph, pw
  if p.padding == "same" then
    ph = dh * (kh - 1) / 2
    pw = dw * (kw - 1) / 2
  elseif p.padding == "valid" then
    ph, pw = 0, 0
  else
    ph, pw = pair(p.padding, 0)
  end
  local groups = p.groups or 1
  local Og = O / groups
  local OH = math.floor((H + 2 * ph - dh * (kh - 1) - 1) / sh) + 1
  local OW = math.floor((W + 2 * pw - dw * (kw - 1) - 1) / sw) + 1
  local out = {}
  for n = 0, N - 1 do
    for oc = 0, O - 1 do
      local g = math.floor(oc / Og)
      for oh = 0, OH - 1 do
        for ow = 0, OW - 1 do
          local s = 0
          if b then
            s = b.data[oc + 1]
          end
          for c = 0, Cg - 1 do
            local ic = g * Cg + c
            for i = 0, kh - 1 do
              local ih = oh * sh - ph + i * dh
              if ih >= 0 and ih < H then
                for j = 0, kw - 1 do
                  local iw = ow * sw - pw + j * dw
                  if iw >= 0 and iw < W then
                    local xv = x.data[((n * C + ic) * H + ih) * W + iw + 1]
                    local wv = w.data[((oc * Cg + c) * kh + i) * kw + j + 1]
                    s = s + xv * wv
                  end
                end
              end
            end
          end
          out[#out + 1] = s
        end
      end
    end
  end
  return array({ N, O, OH, OW }, out, x.dtype)
end

-- x (N, Cin, H, W), w (Cin, Cout/groups, kh, kw): every input pixel scatters its weighted kernel
-- into the output at stride steps (PyTorch's definition, independent of the conv2d reference)
function R.conv_transpose2d(p, x, w, b)
  local sh, sw = pair(p.stride, 1)
  local dh, dw = pair(p.dilation, 1)
  local ph, pw = pair(p.padding, 0)
  local oph, opw = pair(p.output_padding, 0)
  local N, Cin, H, W = unpack(x.shape)
  local _, Cg, kh, kw = unpack(w.shape)
  local groups = p.groups or 1
  local Cout, Ig = Cg * groups, Cin / groups
  local OH = (H - 1) * sh - 2 * ph + dh * (kh - 1) + oph + 1
  local OW = (W - 1) * sw - 2 * pw + dw * (kw - 1) + opw + 1
  local out = {}
  for n = 0, N - 1 do
    for oc = 0, Cout - 1 do
      for i = 0, OH * OW - 1 do
        out[(n * Cout + oc) * OH * OW + i + 1] = b and b.data[oc + 1] or 0
      end
    end
  end
  for n = 0, N - 1 do
    for ic = 0, Cin - 1 do
      local g = math.floor(ic / Ig)
      for ih = 0, H - 1 do
        for iw = 0, W - 1 do
          local xv = x.data[((n * Cin + ic) * H + ih) * W + iw + 1]
          for c = 0, Cg - 1 do
            local oc = g * Cg + c
            for i = 0, kh - 1 do
              local oh = ih * sh - ph + i * dh
              if oh >= 0 and oh < OH then
                for j = 0, kw - 1 do
                  local ow = iw * sw - pw + j * dw
                  if ow >= 0 and ow < OW then
                    local at = ((n * Cout + oc) * OH + oh) * OW + ow + 1
                    out[at] = out[at] + xv * w.data[((ic * Cg + c) * kh + i) * kw + j + 1]
                  end
                end
              end
            end
          end
        end
      end
    end
  end
  return array({ N, Cout, OH, OW }, out, x.dtype)
end

-- PyTorch's pooling output size (a last window starting inside the right padding is dropped)
local function pool_size(n, k, pad, s, d, ceil)
  local num = n + 2 * pad - d * (k - 1) - 1
  local o
  if ceil then
    o = math.ceil(num / s) + 1
  else
    o = math.floor(num / s) + 1
  end
  if ceil and (o - 1) * s >= n + pad then
    o = o - 1
  end
  return o
end

-- max or average pooling over the last two dims; p.kernel, p.stride (default kernel), p.padding,
-- p.dilation (max only), p.ceil_mode, p.count_include_pad (avg only, default true)
local function pool(p, x, kind)
  local kh, kw = pair(p.kernel)
  local sh, sw = pair(p.stride, p.kernel)
  local ph, pw = pair(p.padding, 0)
  local dh, dw = pair(p.dilation, 1)
  local include_pad = p.count_include_pad ~= false
  local shape = x.shape
  local H = shape[#shape - 1]
  local W = shape[#shape]
  local planes = numel(shape) / (H * W)
  local OH = pool_size(H, kh, ph, sh, dh, p.ceil_mode)
  local OW = pool_size(W, kw, pw, sw, dw, p.ceil_mode)
  local out = {}
  for pl = 0, planes - 1 do
    for oh = 0, OH - 1 do
      for ow = 0, OW - 1 do
        local h0 = oh * sh - ph
        local w0 = ow * sw - pw
        if kind == "max" then
          local m = -math.huge
          for i = 0, kh - 1 do
            for j = 0, kw - 1 do
              local ih = h0 + i * dh
              local iw = w0 + j * dw
              if ih >= 0 and ih < H and iw >= 0 and iw < W then
                m = math.max(m, x.data[pl * H * W + ih * W + iw + 1])
              end
            end
          end
          out[#out + 1] = m
        else
          -- the window may hang over the padding (counted if include_pad) but never past it
          local s = 0
          local inside = 0
          local padded = 0
          for ih = h0, h0 + kh - 1 do
            for iw = w0, w0 + kw - 1 do
              if ih < H + ph and iw < W + pw then
                padded = padded + 1
              end
              if ih >= 0 and ih < H and iw >= 0 and iw < W then
                s = s + x.data[pl * H * W + ih * W + iw + 1]
                inside = inside + 1
              end
            end
          end
          if include_pad then
            out[#out + 1] = s / padded
          else
            out[#out + 1] = s / inside
          end
        end
      end
    end
  end
  local oshape = copy(shape)
  oshape[#oshape - 1] = OH
  oshape[#oshape] = OW
  return array(oshape, out, x.dtype)
end

function R.max_pool2d(p, x)
  return pool(p, x, "max")
end

function R.avg_pool2d(p, x)
  return pool(p, x, "avg")
end

-- windows [floor(i H / oh), ceil((i + 1) H / oh)); p.size an int or {oh, ow}
function R.adaptive_avg_pool2d(p, x)
  local oh_n, ow_n = pair(p.size)
  local shape = x.shape
  local H = shape[#shape - 1]
  local W = shape[#shape]
  local planes = numel(shape) / (H * W)
  local out = {}
  for pl = 0, planes - 1 do
    for i = 0, oh_n - 1 do
      local h0 = math.floor(i * H / oh_n)
      local h1 = math.ceil((i + 1) * H / oh_n)
      for j = 0, ow_n - 1 do
        local w0 = math.floor(j * W / ow_n)
        local w1 = math.ceil((j + 1) * W / ow_n)
        local s = 0
        for ih = h0, h1 - 1 do
          for iw = w0, w1 - 1 do
            s = s + x.data[pl * H * W + ih * W + iw + 1]
          end
        end
        out[#out + 1] = s / ((h1 - h0) * (w1 - w0))
      end
    end
  end
  local oshape = copy(shape)
  oshape[#oshape - 1] = oh_n
  oshape[#oshape] = ow_n
  return array(oshape, out, x.dtype)
end

-- ---- normalization, embedding, dropout ----------------------------------------------------------
-- normalizes over the trailing dims p.shape (an int or a table); w, b of that shape or nil
function R.layer_norm(p, x, w, b)
  local k = 1
  if type(p.shape) == "table" then
    k = #p.shape
  end
  local eps = p.eps or 1e-5
  local D = 1
  for i = #x.shape - k + 1, #x.shape do
    D = D * x.shape[i]
  end
  local out = {}
  for m = 0, #x.data / D - 1 do
    local mu = 0
    for d = 1, D do
      mu = mu + x.data[m * D + d]
    end
    mu = mu / D
    local var = 0
    for d = 1, D do
      var = var + (x.data[m * D + d] - mu) ^ 2
    end
    var = var / D
    for d = 1, D do
      local y = (x.data[m * D + d] - mu) / math.sqrt(var + eps)
      if w then
        y = y * w.data[d]
      end
      if b then
        y = y + b.data[d]
      end
      out[m * D + d] = y
    end
  end
  return array(copy(x.shape), out, x.dtype)
end

-- rows of w (V, D) at the int64 indices idx (any shape) -> (idx..., D)
function R.embedding(_, idx, w)
  local D = w.shape[2]
  local out = {}
  for i = 1, #idx.data do
    local row = idx.data[i]
    for d = 1, D do
      out[#out + 1] = w.data[row * D + d]
    end
  end
  local shape = copy(idx.shape)
  shape[#shape + 1] = D
  return array(shape, out, w.dtype)
end

-- eval mode and p = 0 are the identity, p = 1 gives zeros; p.p, p.training
function R.dropout(p, x)
  if p.training ~= false and p.p == 1 then
    local out = {}
    for i = 1, #x.data do
      out[i] = 0
    end
    return array(copy(x.shape), out, x.dtype)
  end
  assert(p.training == false or p.p == 0, "reference: dropout in training mode is random")
  return R.identity(p, x)
end

-- dropout2d in its deterministic settings: p = 1 (all zero), eval or p = 0 (identity)
R.dropout2d = R.dropout

-- ---- losses (mean over the targets that are not ignored) ----------------------------------------
-- logits (N, C, S...) or (C); target (N, S...) or (); label smoothing from PyTorch's formula
function R.cross_entropy(p, x, t)
  local ignore = p.ignore_index or -100
  local eps = p.label_smoothing or 0
  local shape = x.shape
  local N = shape[1]
  local Cn = shape[2]
  if #shape == 1 then
    N = 1
    Cn = shape[1]
  end
  local S = 1
  for i = 3, #shape do
    S = S * shape[i]
  end
  local total = 0
  local count = 0
  for n = 0, N - 1 do
    for s = 0, S - 1 do
      local tgt = t.data[n * S + s + 1]
      if tgt ~= ignore then
        local mx = -math.huge
        for c = 0, Cn - 1 do
          mx = math.max(mx, x.data[(n * Cn + c) * S + s + 1])
        end
        local se = 0
        for c = 0, Cn - 1 do
          se = se + math.exp(x.data[(n * Cn + c) * S + s + 1] - mx)
        end
        local lse = mx + math.log(se)
        local nll = lse - x.data[(n * Cn + tgt) * S + s + 1]
        local smooth = 0
        for c = 0, Cn - 1 do
          smooth = smooth + (lse - x.data[(n * Cn + c) * S + s + 1])
        end
        total = total + (1 - eps) * nll + eps / Cn * smooth
        count = count + 1
      end
    end
  end
  return array({}, { total / count }, x.dtype)
end

-- log-probabilities (N, C, S...), target (N, S...)
function R.nll_loss(p, x, t)
  local ignore = p.ignore_index or -100
  local shape = x.shape
  local N = shape[1]
  local Cn = shape[2]
  local S = 1
  for i = 3, #shape do
    S = S * shape[i]
  end
  local total = 0
  local count = 0
  for n = 0, N - 1 do
    for s = 0, S - 1 do
      local tgt = t.data[n * S + s + 1]
      if tgt ~= ignore then
        total = total - x.data[(n * Cn + tgt) * S + s + 1]
        count = count + 1
      end
    end
  end
  return array({}, { total / count }, x.dtype)
end

function R.mse_loss(_, a, b)
  local s = 0
  for i = 1, #a.data do
    s = s + (a.data[i] - b.data[i]) ^ 2
  end
  return array({}, { s / #a.data }, R.result_dtype(a, b))
end

-- ---- attention ----------------------------------------------------------------------------------
-- q (B.., Tq, D), k (B.., Tk, D), v (B.., Tk, Dv), mask additive and broadcast to (B.., Tq, Tk)
-- or nil; p.is_causal (top-left aligned: key j > query i is masked), p.scale (default 1/sqrt(D))
function R.scaled_dot_product_attention(p, q, k, v, mask)
  local nd = #q.shape
  local Tq = q.shape[nd - 1]
  local D = q.shape[nd]
  local Tk = k.shape[nd - 1]
  local Dv = v.shape[nd]
  local batch = { unpack(q.shape, 1, nd - 2) }
  local B = numel(batch)
  local scale = p.scale or 1 / math.sqrt(D)
  local out = {}
  for b = 0, B - 1 do
    local bidx = unravel(b, batch)
    for i = 0, Tq - 1 do
      local s = {}
      local mx = -math.huge
      for j = 0, Tk - 1 do
        local dot = 0
        for d = 0, D - 1 do
          dot = dot + q.data[(b * Tq + i) * D + d + 1] * k.data[(b * Tk + j) * D + d + 1]
        end
        s[j] = dot * scale
        if mask then
          local idx = copy(bidx)
          idx[#idx + 1] = i
          idx[#idx + 1] = j
          s[j] = s[j] + mask.data[source_index(idx, mask.shape) + 1]
        end
        if p.is_causal and j > i then
          s[j] = -math.huge
        end
        mx = math.max(mx, s[j])
      end
      local z = 0
      for j = 0, Tk - 1 do
        s[j] = math.exp(s[j] - mx)
        z = z + s[j]
      end
      for e = 0, Dv - 1 do
        local acc = 0
        for j = 0, Tk - 1 do
          acc = acc + s[j] / z * v.data[(b * Tk + j) * Dv + e + 1]
        end
        out[(b * Tq + i) * Dv + e + 1] = acc
      end
    end
  end
  local shape = copy(q.shape)
  shape[nd] = Dv
  return array(shape, out, q.dtype)
end

-- ---- masks, where, clamp, min, cumsum, triangles, select and index ------------------------------------
-- cond ? x : y over the broadcast of all three (cond holds 0/1); x's or y's dtype by promotion
function R.where(_, c, x, y)
  local shape = broadcast_shape(broadcast_shape(c.shape, x.shape), y.shape)
  local out = {}
  for i = 0, numel(shape) - 1 do
    local idx = unravel(i, shape)
    if c.data[source_index(idx, c.shape) + 1] ~= 0 then
      out[i + 1] = x.data[source_index(idx, x.shape) + 1]
    else
      out[i + 1] = y.data[source_index(idx, y.shape) + 1]
    end
  end
  return array(shape, out, R.result_dtype(x, y))
end

-- x with p.value where the mask (broadcast to x's shape) is 1
function R.masked_fill(p, x, m)
  local out = {}
  for i = 0, numel(x.shape) - 1 do
    local idx = unravel(i, x.shape)
    if m.data[source_index(idx, m.shape) + 1] ~= 0 then
      out[i + 1] = p.value
    else
      out[i + 1] = x.data[i + 1]
    end
  end
  return array(copy(x.shape), out, x.dtype)
end

-- min(max(x, p.min), p.max), a missing bound not applied
function R.clamp(p, x)
  local out = {}
  for i = 1, #x.data do
    local v = x.data[i]
    if p.min ~= nil and v < p.min then
      v = p.min
    end
    if p.max ~= nil and v > p.max then
      v = p.max
    end
    out[i] = v
  end
  return array(copy(x.shape), out, x.dtype)
end

-- min along p.dim: values and 0-based indices, the first index on ties; or the 0-dim min of all
function R.min(p, a) return extremum(p, a, true) end

-- running sums along p.dim
function R.cumsum(p, a)
  local shape = a.shape
  if #shape == 0 then
    return array({}, { a.data[1] }, a.dtype)
  end
  local d = dim1(p.dim, #shape)
  local outer, n, inner = split_at(shape, d)
  local out = {}
  for o = 0, outer - 1 do
    for i = 0, inner - 1 do
      local acc = 0
      for c = 0, n - 1 do
        local k = (o * n + c) * inner + i + 1
        acc = acc + a.data[k]
        out[k] = acc
      end
    end
  end
  return array(copy(shape), out, a.dtype)
end

-- elements (.., i, j) kept when j - i <= k (lower) or j - i >= k (upper), 0-based i, j
local function triangle(p, a, upper)
  local nd = #a.shape
  local rows, cols = a.shape[nd - 1], a.shape[nd]
  local k = p.k or 0
  local out = {}
  for f = 0, numel(a.shape) - 1 do
    local j = f % cols
    local i = math.floor(f / cols) % rows
    local keep = j - i <= k
    if upper then
      keep = j - i >= k
    end
    if keep then
      out[f + 1] = a.data[f + 1]
    else
      out[f + 1] = 0
    end
  end
  return array(copy(a.shape), out, a.dtype)
end
function R.tril(p, a)
  return triangle(p, a, false)
end
function R.triu(p, a)
  return triangle(p, a, true)
end

-- Torch7-style index: p.key a number (select on dim 1) or a list of entries per leading dim: a
-- number (1-based, negative from the end) drops the dim, {first, last} keeps that inclusive range,
-- ":" or {} the whole dim
function R.index(p, a)
  local key = p.key
  if type(key) == "number" then
    key = { key }
  end
  local nd = #a.shape
  -- per dim: the kept 0-based positions, and whether the dim stays
  local picks, keep = {}, {}
  for d = 1, nd do
    local size = a.shape[d]
    local e = key[d]
    local first, last = 1, size
    keep[d] = true
    if type(e) == "number" then
      if e < 0 then
        e = e + size + 1
      end
      first, last = e, e
      keep[d] = false
    elseif type(e) == "table" and e[1] ~= nil then
      first = e[1] < 0 and e[1] + size + 1 or e[1]
      last = e[2] or e[1]
      if last < 0 then
        last = last + size + 1
      end
    end
    picks[d] = { first - 1, last - 1 }
  end
  local shape, sub = {}, {}
  for d = 1, nd do
    sub[d] = picks[d][2] - picks[d][1] + 1
    if keep[d] then
      shape[#shape + 1] = sub[d]
    end
  end
  local out = {}
  for i = 0, numel(sub) - 1 do
    local idx = unravel(i, sub)
    for d = 1, nd do
      idx[d] = idx[d] + picks[d][1]
    end
    out[i + 1] = a.data[ravel(idx, a.shape) + 1]
  end
  return array(shape, out, a.dtype)
end

-- x:select(dim, i): the index with i at dim and whole dims elsewhere
function R.select(p, a)
  local key = {}
  local d = dim1(p.dim, #a.shape)
  for k = 1, d - 1 do
    key[k] = ":"
  end
  key[d] = p.i
  return R.index({ key = key }, a)
end

-- ---- selection, sorting, splitting --------------------------------------------------------------
-- PyTorch's sort order: NaN after every number; a stable sort keeps equal values in index order
local function before(x, y, descending)
  if descending then
    return x > y or (x ~= x and y == y)
  end
  return x < y or (y ~= y and x == x)
end

-- every line along dim d of a (1-based d): fn(positions) gets the 1-based flat positions of one line
local function each_line(a, d, fn)
  local outer, n, inner = split_at(a.shape, d)
  for o = 0, outer - 1 do
    for i = 0, inner - 1 do
      local pos = {}
      for c = 0, n - 1 do
        pos[c + 1] = (o * n + c) * inner + i + 1
      end
      fn(pos)
    end
  end
end

-- values and 0-based indices of the first k of each line along p.dim in sorted order (insertion
-- sort: stable, on ties the earlier index first)
local function sorted_lines(a, d, descending, k)
  local shape = copy(a.shape)
  if #shape == 0 then
    return array({}, { a.data[1] }, a.dtype), array({}, { 0 }, "int64")
  end
  shape[d] = k
  local outer, _, inner = split_at(shape, d)
  local values, indices = {}, {}
  local line = 0
  each_line(a, d, function(pos)
    local order = {}
    for c = 1, #pos do
      local j = #order
      while j >= 1 and before(a.data[pos[c]], a.data[pos[order[j]]], descending) do
        order[j + 1] = order[j]
        j = j - 1
      end
      order[j + 1] = c
    end
    local o, i = math.floor(line / inner), line % inner
    for c = 1, k do
      local at = (o * k + c - 1) * inner + i + 1
      values[at] = a.data[pos[order[c]]]
      indices[at] = order[c] - 1
    end
    line = line + 1
  end)
  assert(line == outer * inner)
  return array(shape, values, a.dtype), array(copy(shape), indices, "int64")
end

-- x:sort(p.dim, p.descending) -> values, indices
function R.sort(p, a)
  local d = dim1(p.dim or -1, #a.shape)
  return sorted_lines(a, d, p.descending, a.shape[d] or 1)
end

function R.argsort(p, a)
  local _, i = R.sort(p, a)
  return i
end

-- x:topk(p.k, p.dim, p.largest) -> values, indices
function R.topk(p, a)
  local largest = p.largest
  if largest == nil then
    largest = true
  end
  return sorted_lines(a, dim1(p.dim or -1, #a.shape), largest, p.k)
end

-- out[i] = a[i with idx[i] at p.dim] (torch.gather)
function R.gather(p, a, idx)
  local d = dim1(p.dim, #a.shape)
  return gather(a, copy(idx.shape), function(i)
    local src = copy(i)
    src[d] = idx.data[ravel(i, idx.shape) + 1]
    return src
  end)
end

-- a copy of a with src[i] added at (i with idx[i] at p.dim), i over idx's shape (torch.scatter_add)
function R.scatter_add(p, a, idx, src)
  local d = dim1(p.dim, #a.shape)
  local out = copy(a.data)
  for k = 0, numel(idx.shape) - 1 do
    local i = unravel(k, idx.shape)
    local dst = copy(i)
    dst[d] = idx.data[k + 1]
    local at = ravel(dst, a.shape) + 1
    out[at] = out[at] + src.data[ravel(i, src.shape) + 1]
  end
  return array(copy(a.shape), out, a.dtype)
end

-- the pieces of a along p.dim of sizes p.sizes (a list) or p.size each (the last one smaller)
function R.split(p, a)
  local d = dim1(p.dim or 1, #a.shape)
  local sizes = p.sizes
  if not sizes then
    sizes = {}
    local left = a.shape[d]
    repeat
      sizes[#sizes + 1] = math.min(p.size, left)
      left = left - p.size
    until left <= 0
  end
  local outs, start = {}, 1
  for k, len in ipairs(sizes) do
    outs[k] = R.narrow({ dim = d, start = start, length = len }, a)
    start = start + len
  end
  return unpack(outs)
end

-- torch.chunk: pieces of ceil(size / p.n)
function R.chunk(p, a)
  local d = dim1(p.dim or 1, #a.shape)
  return R.split({ dim = d, size = math.max(math.ceil(a.shape[d] / p.n), 1) }, a)
end

-- fsdp.stack({...}, p.dim): out[.., k, ..] = list[k][.., ..] with the new dim at p.dim
function R.stack(p, ...)
  local list = { ... }
  local nd = #list[1].shape
  local d = dim1(p.dim or 1, nd + 1)
  local shape = copy(list[1].shape)
  table.insert(shape, d, #list)
  local out = {}
  for k = 0, numel(shape) - 1 do
    local i = unravel(k, shape)
    local which = table.remove(i, d)
    out[k + 1] = list[which + 1].data[ravel(i, list[1].shape) + 1]
  end
  return array(shape, out, list[1].dtype)
end

-- torch.tile / Tensor.repeat: p.reps counts (fewer than the dims: leading 1s; more: a gets
-- leading size-1 dims); out[i] = a[i mod a's sizes]
function R.tile(p, a)
  local nd = math.max(#a.shape, #p.reps)
  local ashape, reps = {}, {}
  for k = 1, nd do
    ashape[k] = a.shape[k - (nd - #a.shape)] or 1
    reps[k] = p.reps[k - (nd - #p.reps)] or 1
  end
  local shape = {}
  for k = 1, nd do
    shape[k] = ashape[k] * reps[k]
  end
  local flat = array(ashape, a.data, a.dtype)
  return gather(flat, shape, function(i)
    local src = {}
    for k = 1, nd do
      src[k] = i[k] % ashape[k]
    end
    return src
  end)
end

-- ---- batch_norm, group_norm, rms_norm (x (N, C, ...) / (..., D)) -------------------------------
-- batch_norm: p.training (batch statistics, biased variance) or the running ones rm, rv
function R.batch_norm(p, x, rm, rv, w, b)
  local N, C = x.shape[1], x.shape[2]
  local S = #x.data / math.max(N * C, 1)
  local eps = p.eps or 1e-5
  local out = {}
  for c = 0, C - 1 do
    local mu, var
    if p.training then
      mu, var = 0, 0
      for n = 0, N - 1 do
        for s = 1, S do mu = mu + x.data[(n * C + c) * S + s] end
      end
      mu = mu / (N * S)
      for n = 0, N - 1 do
        for s = 1, S do var = var + (x.data[(n * C + c) * S + s] - mu) ^ 2 end
      end
      var = var / (N * S)
    else
      mu, var = rm.data[c + 1], rv.data[c + 1]
    end
    for n = 0, N - 1 do
      for s = 1, S do
        local i = (n * C + c) * S + s
        local y = (x.data[i] - mu) / math.sqrt(var + eps)
        if w then y = y * w.data[c + 1] end
        if b then y = y + b.data[c + 1] end
        out[i] = y
      end
    end
  end
  return array(copy(x.shape), out, x.dtype)
end

function R.group_norm(p, x, w, b)
  local N, C, G = x.shape[1], x.shape[2], p.groups
  local S = #x.data / math.max(N * C, 1)
  local D = C / G * S
  local eps = p.eps or 1e-5
  local out = {}
  for r = 0, N * G - 1 do
    local mu, var = 0, 0
    for d = 1, D do mu = mu + x.data[r * D + d] end
    mu = mu / D
    for d = 1, D do var = var + (x.data[r * D + d] - mu) ^ 2 end
    var = var / D
    for d = 1, D do
      local c = (r % G) * (C / G) + math.floor((d - 1) / S)
      local y = (x.data[r * D + d] - mu) / math.sqrt(var + eps)
      if w then y = y * w.data[c + 1] end
      if b then y = y + b.data[c + 1] end
      out[r * D + d] = y
    end
  end
  return array(copy(x.shape), out, x.dtype)
end

function R.rms_norm(p, x, w)
  local k = type(p.shape) == "table" and #p.shape or 1
  local D = 1
  for i = #x.shape - k + 1, #x.shape do D = D * x.shape[i] end
  -- PyTorch's default: torch.finfo(x.dtype).eps
  local eps = p.eps or ({ bfloat16 = 0.0078125, float16 = 0.0009765625 })[x.dtype] or 1.1920928955078125e-07
  local out = {}
  for m = 0, #x.data / D - 1 do
    local ms = 0
    for d = 1, D do ms = ms + x.data[m * D + d] ^ 2 end
    ms = ms / D
    for d = 1, D do
      local y = x.data[m * D + d] / math.sqrt(ms + eps)
      if w then y = y * w.data[d] end
      out[m * D + d] = y
    end
  end
  return array(copy(x.shape), out, x.dtype)
end

return R
