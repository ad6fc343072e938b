-- The bool dtype, masks and the indexing sugar (issue 19 item 3): what tests/ops/op_cases.lua does not
-- cover by forward/backward cases -- bool values in Lua (totable, item, printing), conversions,
-- safetensors files PyTorch wrote, PyTorch's gradient rules at ties and clamp bounds (golden values
-- from tests/golden/gen_masks.py), views and in-place assignment through x[...], and the errors.
local fsdp = require "fsdp"
local H = require "helpers"
local json = require "fsdp.json"
local ffi = require "ffi"

local golden = json.decode(H.read_file("tests/golden/masks.json"), "masks.json")

-- a value of the golden file as a tensor ("nan" strings are NaN)
local function G(v)
  local function fix(x)
    if type(x) == "table" then
      local r = {}
      for i = 1, #x do r[i] = fix(x[i]) end
      return r
    end
    if x == "nan" then return 0 / 0 end
    return x
  end
  return fsdp.tensor(fix(v))
end

local function flat_bools(t)
  local out = {}
  local function walk(x) for _, v in ipairs(x) do if type(v) == "table" then walk(v) else out[#out + 1] = v end end end
  walk(t)
  return out
end

describe("bool dtype", function()
  it("stores one byte per element and reads back as Lua booleans", function()
    local b = fsdp.tensor({ { true, false, true }, { false, false, true } }, "bool")
    assert.equal("bool", b.dtype)
    assert.same({ 2, 3 }, b:shape())
    assert.same({ { true, false, true }, { false, false, true } }, b:totable())
    assert.same({ 1, 0, 1, 0, 0, 1 }, b:tolist())
    assert.is_true(b[1][1]:item())
    assert.is_false(b[1][2]:item())
    assert.equal("tensor(2x3, dtype=bool) [[true, false, true], [false, false, true]]", tostring(b))
    -- one byte per element: the second row starts 3 bytes after the first
    local p0 = ffi.cast("uint8_t*", b:data_ptr())
    assert.equal(3, tonumber(ffi.cast("uint8_t*", b[2]:data_ptr()) - p0))
    assert.same({ 1, 0, 1, 0, 0, 1 }, { p0[0], p0[1], p0[2], p0[3], p0[4], p0[5] })
  end)

  it("converts to and from the other dtypes as PyTorch does (nonzero and NaN are true)", function()
    local x = fsdp.tensor { 0, -0.0, 1.5, 0 / 0, -2 }
    assert.same(golden.compare.to_bool, x:to("bool"):totable())
    assert.same(golden.compare.to_bool, x:bfloat16():to("bool"):totable())
    assert.same(golden.compare.to_bool, fsdp.tensor({ 0, 0, 3, 1, -7 }, "int64"):to("bool"):totable())
    local b = fsdp.tensor({ true, false, true }, "bool")
    assert.same({ 1, 0, 1 }, b:float():totable())
    assert.equal("float32", b:float().dtype)
    assert.same({ 1, 0, 1 }, b:long():totable())
    assert.same({ 1, 0, 1 }, b:bfloat16():totable())
    assert.equal("bool", fsdp.tensor({ { true }, { false } }).dtype) -- Lua booleans make a bool tensor
    assert.equal("bool", fsdp.tensor(true).dtype)
    assert.same({ false, true }, fsdp.tensor({ 0, 2 }):bool():totable())
    assert.same({ true, false }, fsdp.full({ 2 }, 0, "bool"):fill_(1):eq(fsdp.tensor { 1, 0 }):totable())
  end)

  it("never takes part in autograd", function()
    local x = H.leaf { 1, -2 }
    local b = x:to("bool")
    assert.is_false(b.requires_grad)
    assert.is_false(x:gt(0).requires_grad)
    H.assert_error(function() fsdp.tensor({ true }, "bool").requires_grad = true end, "requires_grad", "bool")
    H.assert_error(function() return fsdp.tensor({ true, false }, "bool") + 1 end, "add", "bool")
  end)

  it("sums to an int64 count", function()
    local c = golden.compare
    local s = G(c.a):gt(G(c.b)):sum()
    assert.equal("int64", s.dtype)
    assert.equal("torch.int64", c.gt_sum_dtype)
    assert.equal(c.gt_sum, s:item())
    assert.same({ 2, 1 }, fsdp.tensor({ { true, true, false }, { false, true, false } }, "bool"):sum(2):totable())
  end)

  it("loads a bool tensor PyTorch wrote (safetensors BOOL) and saves one it can read", function()
    local t = fsdp.load("tests/golden/bool.safetensors")
    assert.equal("bool", t.mask.dtype)
    assert.same({ { true, false, true }, { false, false, true } }, t.mask:totable())
    local dir = H.mkdtemp("fsdp_bool")
    local path = dir .. "/b.safetensors"
    fsdp.save(path, { mask = t.mask, x = fsdp.ones(2) })
    local bytes = H.read_file(path)
    assert.truthy(bytes:find('"mask":{"dtype":"BOOL","shape":[2,3]', 1, true))
    local back = fsdp.load(path)
    assert.same(t.mask:totable(), back.mask:totable())
    os.remove(path)
    os.remove(dir)
  end)

  it("moves to the device double and back", function()
    if not fsdp.cuda.is_available() then fsdp._testdev_install() end
    local b = fsdp.tensor({ { true, false }, { false, true } }, "bool")
    local d = b:to("cuda")
    assert.equal("cuda", d.device)
    assert.equal("bool", d.dtype)
    assert.same(b:totable(), d:cpu():totable())
    assert.same({ { false, true }, { true, false } }, d:t():contiguous():eq(fsdp.tensor({ { 0, 0 }, { 0, 0 } }):cuda()):cpu():totable())
    local x = fsdp.tensor({ { 1, 2 }, { 3, 4 } }):cuda()
    assert.same({ { 1, 0 }, { 0, 4 } }, fsdp.where(d, x, 0):cpu():totable())
    assert.same({ { 1, 0 }, { 3, 4 } }, x:tril():cpu():totable())
  end)
end)

describe("comparisons", function()
  it("match PyTorch, NaN included, with broadcasting", function()
    local c = golden.compare
    local a, b = G(c.a), G(c.b)
    for _, op in ipairs { "lt", "le", "gt", "ge", "eq", "ne" } do
      local r = a[op](a, b)
      assert.equal("bool", r.dtype, op)
      assert.same(c[op], r:totable(), op)
    end
  end)

  it("take a number on the right, in the tensor's dtype", function()
    local x = fsdp.tensor({ 1, 2, 3 }, "int64")
    assert.same({ false, true, true }, x:ge(2):totable())
    -- a fractional number is not truncated to the integer dtype (PyTorch promotes)
    assert.same({ true, false, false }, x:lt(1.5):totable())
    assert.same({ false, false, false }, x:eq(2.5):totable())
    assert.same({ false, true, true }, fsdp.tensor({ false, true, true }):gt(0.5):totable())
    assert.same({ true, false, false }, fsdp.tensor({ 0.1, 0.5, 0.7 }):bfloat16():lt(0.3):totable())
  end)

  it("name the op and both shapes when they do not broadcast", function()
    local a = fsdp.ones(2, 3)
    for _, op in ipairs { "lt", "le", "gt", "ge", "ne" } do
      H.assert_error(function() return a[op](a, fsdp.ones(2)) end, op, "(2, 3)", "(2)")
    end
  end)
end)

-- forward values and the gradients of sum(out * w) against PyTorch's
local function check_golden(name, out, inputs)
  local c = golden[name]
  H.assert_close(out, H.flat(c.out), 1e-6, 1e-6, name .. " forward")
  ;(out * G(c.w)):sum():backward()
  for k, x in pairs(inputs) do
    H.assert_close(x.grad, H.flat(c.grads[k]), 1e-6, 1e-6, name .. " gradient of " .. k)
  end
end

describe("masks and elementwise selection against PyTorch", function()
  it("where", function()
    local c = golden.where
    local x, y = H.leaf(c.x), H.leaf(c.y)
    check_golden("where", fsdp.where(fsdp.tensor(c.cond, "bool"), x, y), { x = x, y = y })
  end)

  it("masked_fill", function()
    local c = golden.masked_fill
    local x = H.leaf(c.x)
    check_golden("masked_fill", x:masked_fill(fsdp.tensor(c.mask, "bool"), c.value), { x = x })
  end)

  it("clamp lets the gradient through at its bounds", function()
    local c = golden.clamp
    local x = H.leaf(c.x)
    check_golden("clamp", x:clamp(c.min, c.max), { x = x })
    x = H.leaf(c.x)
    check_golden("clamp", x:clamp { min = c.min, max = c.max }, { x = x })
    x = H.leaf(golden.clamp_min.x)
    check_golden("clamp_min", x:clamp(golden.clamp_min.min), { x = x })
    x = H.leaf(golden.clamp_min.x)
    check_golden("clamp_min", x:clamp { min = golden.clamp_min.min }, { x = x })
  end)

  it("minimum and maximum split the gradient evenly on ties", function()
    for _, name in ipairs { "minimum", "maximum" } do
      local c = golden[name]
      local a, b = H.leaf(c.a), H.leaf(c.b)
      check_golden(name, fsdp[name](a, b), { a = a, b = b })
    end
  end)

  it("min(dim) takes the first index on ties, min() shares the gradient among ties", function()
    local c = golden.min_dim
    local x = H.leaf(c.x)
    local v, i = x:min(2)
    assert.same(c.indices, i:totable())
    check_golden("min_dim", v, { x = x })
    x = H.leaf(golden.min_all.x)
    check_golden("min_all", x:min(), { x = x })
  end)

  it("abs has a zero gradient at 0", function()
    local x = H.leaf(golden.abs.x)
    check_golden("abs", x:abs(), { x = x })
  end)

  it("cumsum, tril and triu", function()
    local c = golden.cumsum
    local x = H.leaf(c.x)
    check_golden("cumsum", x:cumsum(c.dim), { x = x })
    for _, name in ipairs { "tril", "triu" } do
      x = H.leaf(golden[name].x)
      check_golden(name, x[name](x, golden[name].k), { x = x })
      x = H.leaf(golden[name].x)
      check_golden(name, fsdp[name](x, golden[name].k), { x = x })
    end
  end)

  it("keep -inf where masked (attention masks)", function()
    local s = fsdp.ones(3, 3)
    local m = fsdp.ones(3, 3):triu(1):gt(0)
    local filled = s:masked_fill(m, -math.huge)
    assert.same({ -math.huge, -math.huge }, { filled[1][2]:item(), filled[{ 2, 3 }]:item() })
    assert.same({ { 1, 0, 0 }, { 0.5, 0.5, 0 } }, filled:softmax(-1)[{ { 1, 2 } }]:totable())
  end)

  it("give errors naming the argument, dtype and shapes", function()
    local x = fsdp.ones(2, 3)
    H.assert_error(function() return fsdp.where(x, x, x) end, "where", "condition", "bool", "float32")
    H.assert_error(function() return fsdp.where(x:gt(0), x, fsdp.ones(4)) end, "where", "(2, 3)", "(4)",
      "cannot be broadcast")
    H.assert_error(function() return x:masked_fill(x, 0) end, "masked_fill", "mask", "bool")
    H.assert_error(function() return x:masked_fill(fsdp.ones(3, 2, 3):gt(0), 0) end, "masked_fill", "(3, 2, 3)",
      "(2, 3)")
    H.assert_error(function() return x:clamp() end, "clamp", "min", "max")
    H.assert_error(function() return x:clamp("a") end, "clamp", "min")
    H.assert_error(function() return fsdp.ones(3):tril() end, "tril", "2 dims", "(3)")
    H.assert_error(function() return x:tril(0.5) end, "tril", "diagonal", "integer")
    H.assert_error(function() return x:cumsum(3) end, "cumsum")
    H.assert_error(function() return fsdp.tensor({ 1, 2 }, "int64"):clamp(0, 1) end, "clamp", "int64")
    H.assert_error(function() return fsdp.minimum(x, fsdp.ones(4)) end, "minimum", "(2, 3)", "(4)")
    H.assert_error(function() return fsdp.empty(0):min() end, "min", "empty")
  end)
end)

describe("select and x[...]", function()
  local function m34() return fsdp.arange(1, 13):float():view(3, 4) end

  it("select is a view without the dim, 1-based and negative from the end", function()
    local x = m34()
    assert.same({ 5, 6, 7, 8 }, x:select(1, 2):totable())
    assert.same({ 4, 8, 12 }, x:select(2, -1):totable())
    assert.same({ 3, 7, 11 }, x:select(-1, 3):totable())
    local row = x:select(1, 3)
    row:fill_(0)
    assert.same({ 0, 0, 0, 0 }, x[3]:totable()) -- shares x's storage
    assert.equal(7, fsdp.arange(1, 13):float():view(3, 4):select(1, 2):select(1, 3):item())
  end)

  it("x[i] is x:select(1, i); a 1-D tensor gives a 0-dim one", function()
    local x = m34()
    assert.same(x:select(1, 2):totable(), x[2]:totable())
    assert.same({ 9, 10, 11, 12 }, x[-1]:totable())
    assert.same({}, x[1][4]:shape())
    assert.equal(4, x[1][4]:item())
    -- fields and methods still answer
    assert.equal("float32", x.dtype)
    assert.is_nil(x.grad)
    assert.is_nil(x.no_such_field)
  end)

  it("x[{...}] takes integers, inclusive {first, last} ranges, \":\" and {}", function()
    local x = m34()
    assert.same({ 6, 7 }, x[{ 2, { 2, 3 } }]:totable())
    assert.same({ 2, 6, 10 }, x[{ ":", 2 }]:totable())
    assert.same({ 4, 8, 12 }, x[{ {}, -1 }]:totable())
    assert.same({ { 3, 4 }, { 7, 8 } }, x[{ { 1, 2 }, { -2, -1 } }]:totable())
    assert.same({ { 9, 10, 11, 12 } }, x[{ { 3 } }]:totable()) -- {i} keeps the dim
    assert.same({ 0, 4 }, x[{ { 2, 1 } }]:shape())             -- an empty range
    assert.equal(12, x[{ -1, -1 }]:item())
    assert.same(x:totable(), x[{}]:totable())
  end)

  it("is differentiable: the gradient lands in the selected places", function()
    local x = H.leaf { { 1, 2, 3 }, { 4, 5, 6 } }
    local y = x[2]:sum() * 2 + x[{ ":", { 2, 3 } }]:sum() + x:select(2, 1)[1] * 10
    y:backward()
    assert.same({ { 10, 1, 1 }, { 2, 3, 3 } }, x.grad:totable())
  end)

  it("assigns a number (fill_) or a tensor (copy_, broadcasting) in place", function()
    local x = m34()
    local v0 = x:version()
    x[1] = 0
    assert.same({ 0, 0, 0, 0 }, x[1]:totable())
    x[{ ":", 2 }] = fsdp.tensor { 7, 8, 9 }
    assert.same({ { 0, 7, 0, 0 }, { 5, 8, 7, 8 }, { 9, 9, 11, 12 } }, x:totable())
    x[{ { 2, 3 }, { 3, 4 } }] = fsdp.tensor { -1, -2 }
    assert.same({ { 0, 7, 0, 0 }, { 5, 8, -1, -2 }, { 9, 9, -1, -2 } }, x:totable())
    x[{ 3, 1 }] = 100
    assert.equal(100, x[3][1]:item())
    assert.is_true(x:version() > v0)
    local b = fsdp.zeros({ 2, 2 }, "bool")
    b[{ 1, 2 }] = 1
    assert.same({ { false, true }, { false, false } }, b:totable())
  end)

  it("errors name the dim and its size in 1-based terms", function()
    local x = m34()
    H.assert_error(function() return x[4] end, "index 4", "dim 1", "size 3")
    H.assert_error(function() return x[-4] end, "index -4", "dim 1", "size 3")
    H.assert_error(function() return x[0] end, "index 0", "dim 1", "size 3")
    H.assert_error(function() return x[{ 1, 5 }] end, "index 5", "dim 2", "size 4")
    H.assert_error(function() return x[{ ":", { 2, 5 } }] end, "{2, 5}", "dim 2", "size 4")
    H.assert_error(function() return x[{ { 0, 2 } }] end, "index 0", "dim 1", "size 3")
    H.assert_error(function() return x[{ 1, 2, 3 }] end, "3 entries", "2 dims")
    H.assert_error(function() return x[{ "a" }] end, "entry 1")
    H.assert_error(function() return x[1.5] end, "dim 1", "integer")
    H.assert_error(function() return fsdp.tensor(3)[1] end, "0-dim")
    H.assert_error(function() return x:select(3, 1) end, "select", "dim 3", "2 dims")
    H.assert_error(function() return x:select(2, 5) end, "select", "index 5", "dim 2", "size 4")
    H.assert_error(function() x[5] = 1 end, "index 5", "dim 1", "size 3")
    H.assert_error(function() x[1] = "s" end, "value")
    H.assert_error(function() x[1] = fsdp.ones(3) end, "copy_")
  end)
end)
