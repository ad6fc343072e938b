-- Views and shape ops: what the op-case table (tests/ops/op_cases.lua, run by ops_spec.lua) does not
-- cover: storage sharing, strides, writes through views, gradients of overlapping slices, and
-- errors naming the op and shapes.
local fsdp = require "fsdp"
local H = require "helpers"

local function iota(...)
  local n = 1
  local shape = type((...)) == "table" and (...) or { ... }
  for _, s in ipairs(shape) do n = n * s end
  return fsdp.arange(0, n, 1, "float32"):view(shape)
end

describe("detach, clone, contiguous", function()
  it("detach shares storage and drops grad", function()
    local x = H.leaf({ 1, 2, 3 })
    local d = x:detach()
    assert.is_true(fsdp.C.fsdp_tensor_same_storage(x.p, d.p) ~= 0)
    assert.is_false(d.requires_grad)
    assert.is_nil(d.grad_fn)
    d:fill_(7)
    assert.same({ 7, 7, 7 }, x:totable())
  end)

  it("clone makes a contiguous copy of its own, recorded as CloneBackward", function()
    local x = iota(2, 3)
    local c = x:t():clone()
    assert.is_true(c:is_contiguous())
    c:fill_(1)
    assert.same({ { 0, 1, 2 }, { 3, 4, 5 } }, x:totable())
    local l = H.randn_leaf(3, 2)
    assert.equal("CloneBackward", l:clone().grad_fn)
  end)

  it("contiguous returns the same tensor when already contiguous, a copy otherwise", function()
    local x = iota(2, 3)
    local c = x:contiguous()
    assert.is_true(fsdp.C.fsdp_tensor_same_storage(x.p, c.p) ~= 0)
    local t = x:t()
    assert.is_false(t:is_contiguous())
    local tc = t:contiguous()
    assert.is_true(tc:is_contiguous())
    assert.is_false(fsdp.C.fsdp_tensor_same_storage(x.p, tc.p) ~= 0)
    assert.same({ 2, 1 }, tc:stride())
  end)
end)

describe("view and reshape", function()
  it("view shares storage, infers one -1, and writes through", function()
    local x = iota(2, 6)
    local v = x:view(3, -1)
    assert.same({ 4, 1 }, v:stride())
    v:narrow(1, 2, 1):fill_(-1)
    assert.same({ { 0, 1, 2, 3, -1, -1 }, { -1, -1, 8, 9, 10, 11 } }, x:totable())
    assert.equal("ViewBackward", H.leaf({ 1, 2 }):view(2, 1).grad_fn)
  end)

  it("view works on non-contiguous tensors whose layout allows it", function()
    local x = iota(4, 6)
    local n = x:narrow(2, 1, 3)        -- (4, 3), strides (6, 1)
    local v = n:view(2, 2, 3)          -- split the strided outer dim
    assert.same({ 12, 6, 1 }, v:stride())
    local t = iota(2, 3, 4):transpose(1, 2) -- (3, 2, 4)
    local u = t:view(3, 2, 2, 2)
    assert.same({ 4, 12, 2, 1 }, u:stride())
  end)

  it("view refuses layouts that need a copy; reshape copies them", function()
    local t = iota(2, 3):t()
    H.assert_error(function() return t:view(6) end, "view", "(3, 2)", "reshape")
    local r = t:reshape(6)
    assert.is_false(fsdp.C.fsdp_tensor_same_storage(t.p, r.p) ~= 0)
    local x = iota(2, 3)
    local rv = x:reshape(3, 2)
    assert.is_true(fsdp.C.fsdp_tensor_same_storage(x.p, rv.p) ~= 0)
  end)

  it("reject bad shapes with the op and shapes in the message", function()
    local x = iota(2, 6)
    H.assert_error(function() return x:view(5, 2) end, "view", "(5, 2)", "(2, 6)")
    H.assert_error(function() return x:view(-1, -1) end, "view", "only one")
    H.assert_error(function() return x:reshape(5, -1) end, "reshape", "(5, -1)", "(2, 6)")
    H.assert_error(function() return x:view(-2, 6) end, "view", "-2")
    H.assert_error(function() return fsdp.zeros(0, 3):reshape(-1, 0) end, "reshape")
    H.assert_error(function() return iota(2, 3, 4):flatten(3, 2) end, "flatten", "start_dim")
    assert.same({ 6, 2 }, x:view(6, 2):shape())
  end)

end)

describe("transpose and permute", function()
  it("swap strides without copying", function()
    local x = iota(2, 3, 4)
    local t = x:transpose(1, 3)
    assert.same({ 1, 4, 12 }, t:stride())
    assert.is_true(fsdp.C.fsdp_tensor_same_storage(x.p, t.p) ~= 0)
    local p = x:permute(2, 3, 1)
    assert.same({ 4, 1, 12 }, p:stride())
    -- write through a transposed view
    local y = iota(2, 2)
    y:t():narrow(1, 1, 1):fill_(9)
    assert.same({ { 9, 1 }, { 9, 3 } }, y:totable())
  end)

  it("reject bad dims", function()
    local x = iota(2, 3)
    H.assert_error(function() return x:transpose(1, 3) end, "transpose", "out of range")
    H.assert_error(function() return x:permute(1, 1) end, "permute", "repeats")
    H.assert_error(function() return x:permute(1, 2, 3) end, "permute", "(2, 3)")
    assert.same({ 3, 2 }, x:permute(2, 1):shape())
  end)
end)

describe("squeeze and unsqueeze", function()
  it("add and remove size-1 dims as views", function()
    local x = iota(2, 3)
    assert.same({ 3, 3, 1 }, x:unsqueeze(2):stride())
    local u = x:unsqueeze(2)
    assert.is_true(fsdp.C.fsdp_tensor_same_storage(x.p, u:squeeze(2).p) ~= 0)
    H.assert_error(function() return x:unsqueeze(5) end, "unsqueeze", "out of range")
    H.assert_error(function() return x:squeeze(3) end, "squeeze", "out of range")
  end)
end)

describe("expand", function()
  it("broadcasts with stride 0, keeps -1 sizes and adds leading dims", function()
    local x = fsdp.tensor({ { 1 }, { 2 } })
    local e = x:expand(2, 3)
    assert.same({ 1, 0 }, e:stride())
    assert.is_true(fsdp.C.fsdp_tensor_same_storage(x.p, e.p) ~= 0)
    assert.same({ 0, 1, 0 }, x:expand(4, -1, 3):stride())
    x:fill_(4)
    assert.same({ 4, 4, 4 }, e:totable()[2])
  end)

  it("rejects sizes that do not match", function()
    local x = iota(2, 3)
    H.assert_error(function() return x:expand(2, 4) end, "expand", "(2, 3)", "(2, 4)")
    H.assert_error(function() return x:expand(3) end, "expand", "(2, 3)")
    H.assert_error(function() return x:expand(-1, 2, 3) end, "expand", "leading")
    assert.same({ 5, 2, 3 }, x:expand(5, 2, 3):shape())
  end)
end)

describe("narrow", function()
  it("takes a slice as a view (1-based start in Lua)", function()
    local x = iota(3, 4)
    local n = x:narrow(2, 2, 2)
    assert.same({ 4, 1 }, n:stride())
    n:fill_(0)
    assert.same({ 4, 0, 0, 7 }, x:totable()[2])
    assert.same({ { 8, 0, 0, 11 } }, x:narrow(1, 3, 1):totable())
  end)

  -- slices of one non-leaf tensor (q, k, v of a qkv projection): after the first, each slice's
  -- gradient is added into the sum's slice in place; overlapping slices and a use of the whole
  -- tensor must still add up
  it("adds the gradients of several slices of one tensor, overlapping or not", function()
    local x = H.randn_leaf(2, 3, 12)
    local w = fsdp.randn(2, 3, 12)
    local function f(t)
      local h = t * 2 -- a non-leaf: the slices' gradients meet in its node's sum
      local q, k, v = h:narrow(3, 1, 4), h:narrow(3, 5, 4), h:narrow(3, 9, 4)
      local o = h:narrow(3, 3, 6) -- overlaps q and k
      return (q * k):sum() + (v * v):sum() + (o * o):sum() + (h * w):sum()
    end
    H.gradcheck(f, { x })
    -- exact values against the same sum written without slices of a shared tensor
    x.grad = nil
    f(x):backward()
    local xs, ws = x:detach(), w
    local hd = xs * 2
    local g = fsdp.zeros(2, 3, 12)
    local gl, hl, wl = g:tolist(), hd:tolist(), ws:tolist()
    for i = 0, 2 * 3 - 1 do
      local r = i * 12
      for j = 1, 4 do
        gl[r + j] = gl[r + j] + hl[r + 4 + j]       -- d(q*k)/dq = k
        gl[r + 4 + j] = gl[r + 4 + j] + hl[r + j]   -- d(q*k)/dk = q
        gl[r + 8 + j] = gl[r + 8 + j] + 2 * hl[r + 8 + j]
      end
      for j = 3, 8 do gl[r + j] = gl[r + j] + 2 * hl[r + j] end
      for j = 1, 12 do gl[r + j] = 2 * (gl[r + j] + wl[r + j]) end -- through h = 2 t
    end
    H.assert_close(x.grad, gl, 1e-5, 1e-5, "slices' gradient")
  end)

  it("rejects ranges out of bounds", function()
    local x = iota(3, 4)
    H.assert_error(function() return x:narrow(2, 4, 2) end, "narrow", "out of bounds", "(3, 4)")
    H.assert_error(function() return x:narrow(2, 0, 2) end, "narrow", "out of bounds")
    H.assert_error(function() return x:narrow(3, 1, 1) end, "narrow", "out of range")
    assert.same({ 3, 1 }, x:narrow(2, 4, 1):shape())
  end)
end)

describe("cat", function()
  it("gives a gradient only to the inputs that need one", function()
    local plain = fsdp.randn(2, 2)
    local l = H.randn_leaf(2, 2)
    fsdp.cat({ plain, l }):sum():backward()
    assert.same({ { 1, 1 }, { 1, 1 } }, l.grad:totable())
  end)

  it("rejects mismatched shapes, dtypes and dims", function()
    local a = iota(2, 3)
    H.assert_error(function() return fsdp.cat({ a, iota(2, 4) }, 1) end, "cat", "(2, 4)", "(2, 3)")
    H.assert_error(function() return fsdp.cat({ a, fsdp.zeros({ 2, 3 }, "int64") }) end, "cat", "int64", "float32")
    H.assert_error(function() return fsdp.cat({ a, iota(6) }) end, "cat", "(6)")
    H.assert_error(function() return fsdp.cat({ a, a }, 3) end, "cat", "out of range")
    H.assert_error(function() return fsdp.cat({}) end, "cat", "non-empty")
    assert.same({ 4, 3 }, fsdp.cat({ a, a }):shape())
  end)
end)

describe("index_select", function()
  it("rejects bad indices", function()
    local x = iota(3, 4)
    H.assert_error(function() return x:index_select(1, fsdp.tensor({ 3 }, "int64")) end, "index_select", "3",
      "out of range", "(3, 4)")
    H.assert_error(function() return x:index_select(1, fsdp.tensor({ -1 }, "int64")) end, "index_select", "-1")
    H.assert_error(function() return x:index_select(1, fsdp.tensor({ 0 })) end, "index_select", "int64", "float32")
    H.assert_error(function() return x:index_select(1, fsdp.zeros({ 1, 1 }, "int64")) end, "index_select", "(1, 1)")
    H.assert_error(function() return x:index_select(3, fsdp.zeros({ 1 }, "int64")) end, "index_select", "out of range")
    assert.same({ { 4, 5, 6, 7 } }, x:index_select(1, fsdp.tensor({ 1 }, "int64")):totable())
  end)
end)

describe("to(dtype)", function()
  it("returns the tensor itself when it already has the dtype", function()
    local x = fsdp.tensor({ 1.5, -2.7, 3.0, 1000.6 })
    local same = x:to("float32")
    assert.is_true(fsdp.C.fsdp_tensor_same_storage(x.p, same.p) ~= 0)
  end)

  it("is differentiable between float dtypes; int64 results need no grad", function()
    local x = H.leaf({ 1.25, -3.5 })
    local y = x:to("bfloat16")
    assert.equal("ToCopyBackward", y.grad_fn)
    local z = y:float() * fsdp.tensor({ 2, 4 })
    z:sum():backward()
    assert.equal("float32", x.grad.dtype)
    assert.same({ 2, 4 }, x.grad:totable())
    local i = x:long()
    assert.is_false(i.requires_grad)
    H.assert_error(function() return x:to(9) end, "to", "dtype or device name")
  end)
end)

describe("views after errors", function()
  it("the process keeps working after each failed call", function()
    local x = iota(2, 3)
    for _ = 1, 3 do
      pcall(function() return x:view(7) end)
      pcall(function() return x:narrow(1, 5, 1) end)
      pcall(function() return fsdp.cat({ x, iota(5) }) end)
    end
    assert.same({ 0, 3, 1, 4, 2, 5 }, x:t():reshape(-1):tolist())
  end)
end)
