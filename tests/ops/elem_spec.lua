-- Elementwise ops (broadcasting binary, scalar, unary), comparison and reductions: what the
-- op-case table (tests/ops/op_cases.lua, run by ops_spec.lua) does not cover: accuracy over whole
-- float ranges and special values, the threaded paths on large inputs, exact gradients at kinks and
-- ties, autograd bookkeeping, and errors that name the op, shapes and dtypes.
local fsdp = require "fsdp"
local H = require "helpers"
local R = require "ops.op_refs"

-- ---- naive references ---------------------------------------------------------------------------
local f32 = function(x) return (require "ffi").new("float[1]", x)[0] end

local erf = R.erf  -- double precision, by its Taylor series

describe("binary ops", function()
  it("name their backward node", function()
    local a = fsdp.tensor({ { 1, 2, 3 }, { 4, 5, 6 } })
    assert.equal("AddBackward", (a + H.leaf({ 1, 1, 1 })).grad_fn)
  end)

  it("matches the naive loop on large tensors (threaded and chunked paths)", function()
    local a = fsdp.randn(70, 600)
    local row = fsdp.randn(600)
    local col = fsdp.randn(70, 1)
    local la, lr, lc = a:tolist(), row:tolist(), col:tolist()
    local s1, s2, s3 = (a + row):tolist(), (a * col):tolist(), (a - a:t():contiguous():t()):tolist()
    for i = 1, #la do
      local r, c = math.floor((i - 1) / 600) + 1, (i - 1) % 600 + 1
      assert(math.abs(s1[i] - f32(la[i] + lr[c])) <= 1e-6, "row broadcast at " .. i)
      assert(math.abs(s2[i] - f32(la[i] * lc[r])) <= 1e-6, "column broadcast at " .. i)
      assert(s3[i] == 0, "strided operand at " .. i)
    end
    local big = fsdp.randn(100000)
    local d = (big / fsdp.tensor(2)):tolist()
    local lb = big:tolist()
    for i = 1, #lb, 997 do assert.equal(f32(lb[i] / 2), d[i]) end
  end)

  it("backward gives exact gradients for simple cases", function()
    local a, b = H.leaf({ 1, 2, 3 }), H.leaf({ { 2 }, { 4 } })
    local y = (a * b):sum()
    y:backward()
    assert.same({ 6, 6, 6 }, a.grad:totable())
    assert.same({ { 6 }, { 6 } }, b.grad:totable())
    a.grad, b.grad = nil, nil
    local z = (a / b):sum() -- d/da = sum_b 1/b = 0.75; d/db_i = -sum_j a_j / b_i^2
    z:backward()
    H.assert_close(a.grad, { 0.75, 0.75, 0.75 })
    H.assert_close(b.grad, { { -6 / 4 }, { -6 / 16 } })
    -- only one side requires grad
    local c = fsdp.tensor({ 5, 6, 7 })
    local d = H.leaf({ 1, 1, 1 })
    ;(c - d):sum():backward()
    assert.same({ -1, -1, -1 }, d.grad:totable())
    assert.is_nil(c.grad)
  end)

  it("rejects incompatible shapes and non-float inputs, and keeps working", function()
    local a, b = fsdp.zeros(2, 3), fsdp.zeros(4)
    H.assert_error(function() return a + b end, "add", "(2, 3)", "(4)", "broadcast")
    H.assert_error(function() return a * fsdp.zeros(3, 3) end, "mul", "(2, 3)", "(3, 3)")
    H.assert_error(function() return a - fsdp.zeros(2, 3, 2) end, "sub")
    H.assert_error(function() return a / fsdp.zeros({ 3 }, "int64") end, "div", "int64", "float32")
    assert.same({ { 2, 2, 2 }, { 2, 2, 2 } }, (a + 2):totable())
  end)
end)

describe("scalar ops", function()

  it("reject int64 tensors", function()
    local i = fsdp.tensor({ 1, 2 }, "int64")
    H.assert_error(function() return i + 1 end, "add_scalar", "int64", "(2)")
    H.assert_error(function() return i * 2 end, "mul_scalar", "int64")
    H.assert_error(function() return i ^ 2 end, "pow", "int64")
    H.assert_error(function() return -i end, "neg", "int64")
  end)
end)

describe("unary ops", function()
  it("exp, tanh and sigmoid are accurate over the whole float range", function()
    local vals = {}
    for i = 0, 2000 do vals[#vals + 1] = -87 + i * 0.0875 end
    local x = fsdp.tensor(vals)
    local xl = x:tolist()
    local e, t, s = x:exp():tolist(), x:tanh():tolist(), x:sigmoid():tolist()
    for i, v in ipairs(xl) do
      local ee = math.exp(v)
      assert(math.abs(e[i] - ee) <= 3e-7 * ee, ("exp(%g) = %g, want %g"):format(v, e[i], ee))
      local tt = math.tanh(v)
      assert(math.abs(t[i] - tt) <= 3e-7 * math.abs(tt) + 1e-45, ("tanh(%g) = %g, want %g"):format(v, t[i], tt))
      local ss = 1 / (1 + math.exp(-v))
      assert(math.abs(s[i] - ss) <= 4e-7 * ss, ("sigmoid(%g) = %g, want %g"):format(v, s[i], ss))
    end
    -- tiny arguments keep full relative precision
    H.assert_close(fsdp.tensor({ 1e-5, -3e-4, 0.3 }):tanh(), { math.tanh(f32(1e-5)), math.tanh(f32(-3e-4)),
      math.tanh(f32(0.3)) }, 0, 2e-7)
    -- extremes: underflow to 0 (through the subnormals), overflow to inf, NaN stays NaN
    local ex = fsdp.tensor({ -1000, -104, -95, 89, 1000, 0 / 0 }):exp():tolist()
    assert.equal(0, ex[1])
    assert.equal(0, ex[2])
    assert(math.abs(ex[3] - math.exp(-95)) <= 1e-3 * math.exp(-95), "subnormal exp(-95) = " .. ex[3])
    assert.equal(math.huge, ex[4])
    assert.equal(math.huge, ex[5])
    assert(ex[6] ~= ex[6], "exp(nan) is nan")
    local th = fsdp.tensor({ -1000, 1000, 0 / 0, 0 }):tanh():tolist()
    assert.same({ -1, 1 }, { th[1], th[2] })
    assert(th[3] ~= th[3])
    assert.equal(0, th[4])
    local sg = fsdp.tensor({ -1000, 1000 }):sigmoid():tolist()
    assert.same({ 0, 1 }, sg)
  end)

  it("log is accurate from subnormals to huge values, with IEEE special cases", function()
    local vals = { 1e-40, 1e-38, 3e-30 }
    for i = 0, 600 do vals[#vals + 1] = 10 ^ (-30 + i * 0.1) end
    for i = 0, 400 do vals[#vals + 1] = 0.5 + i * 0.0025 end -- around 1, where log is small
    local x = fsdp.tensor(vals)
    local xl, l = x:tolist(), x:log():tolist()
    for i, v in ipairs(xl) do
      local want = math.log(v)
      assert(math.abs(l[i] - want) <= 2.5e-7 * math.abs(want) + 1e-45,
        ("log(%g) = %.9g, want %.9g"):format(v, l[i], want))
    end
    local sp = fsdp.tensor({ 0, -1, 1 / 0, 0 / 0, 1 }):log():tolist()
    assert.equal(-math.huge, sp[1])
    assert(sp[2] ~= sp[2], "log(-1) is nan")
    assert.equal(math.huge, sp[3])
    assert(sp[4] ~= sp[4], "log(nan) is nan")
    assert.equal(0, sp[5])
  end)

  it("gelu is accurate over a fine grid (erf as a rational minimax fit, |error| < 3.3e-7 after rounding)", function()
    local vals = {}
    for i = 0, 1000 do vals[#vals + 1] = -10 + i * 0.02 end
    local x = fsdp.tensor(vals)
    local xl, ge = x:tolist(), x:gelu():tolist()
    for i, v in ipairs(xl) do
      -- x * Phi(x) with Phi from erf's series (|x| <= 4) or erfc's continued fraction (lower tail)
      local want
      if math.abs(v) <= 4 then
        want = 0.5 * v * (1 + erf(v / math.sqrt(2)))
      else
        local z = math.abs(v) / math.sqrt(2)
        local k = z
        for n = 300, 1, -1 do k = z + (n / 2) / k end
        local tail = 0.5 * math.exp(-z * z) / (math.sqrt(math.pi) * k) -- Phi(-|x|)
        want = v * (v < 0 and tail or 1 - tail)
      end
      -- x/2 * (1 + erf(x / sqrt 2)) with erf's absolute error bound plus the rounding of 1 + erf
      assert(math.abs(ge[i] - want) <= 1e-6 * math.abs(want) + 0.5 * 2.8e-7 * math.abs(v),
        ("gelu(%g) = %.9g, want %.9g"):format(v, ge[i], want))
    end
    local sp = fsdp.tensor({ 1 / 0, 0 / 0, -200 }):gelu():tolist()
    assert.equal(math.huge, sp[1])
    assert(sp[2] ~= sp[2])
    assert.equal(0, sp[3])
  end)

  it("relu and abs gradients at and around zero follow PyTorch (0 at 0)", function()
    local x = H.leaf({ -1, 0, 2 })
    x:relu():sum():backward()
    assert.same({ 0, 0, 1 }, x.grad:totable())
    x.grad = nil
    x:abs():sum():backward()
    assert.same({ -1, 0, 1 }, x.grad:totable())
  end)

  it("reject int64 input with the op name and dtype, and keep working", function()
    local i = fsdp.tensor({ 1, 2 }, "int64")
    for _, name in ipairs({ "exp", "log", "sqrt", "abs", "tanh", "sigmoid", "relu", "gelu" }) do
      H.assert_error(function() return i[name](i) end, name, "int64", "(2)")
    end
    H.assert_close(fsdp.tensor({ 0 }):exp(), { 1 })
  end)
end)

describe("autograd bookkeeping of elementwise ops", function()
  it("detects in-place writes to saved tensors and names the node", function()
    local x = H.leaf({ 1, 2 })
    local y = x:exp()
    local z = (y * 2):sum()
    y:fill_(0) -- y is ExpBackward's saved output
    H.assert_error(function() z:backward() end, "ExpBackward", "in-place")
    local w = H.leaf({ 3, 4 })
    local a = fsdp.tensor({ 1, 1 })
    local p = (w * a):sum()
    a:fill_(5) -- a is saved for w's gradient
    H.assert_error(function() p:backward() end, "MulBackward", "in-place")
    -- a fresh graph still works
    local q = (w * a):sum()
    q:backward()
    assert.same({ 5, 5 }, w.grad:totable())
  end)

  it("accumulates gradients over repeated backward with retain_graph", function()
    local x = H.leaf({ 1, -2, 3 })
    local y = (x * x):relu():sum()
    y:backward({ retain_graph = true })
    y:backward()
    assert.same({ 4, -8, 12 }, x.grad:totable())
    H.assert_error(function() y:backward() end, "second time")
  end)

  it("records nothing under no_grad", function()
    local x = H.leaf({ 1, 2 })
    local y = fsdp.no_grad(function() return (x * 2 + 1):exp():sum(1) end)
    assert.is_false(y.requires_grad)
    assert.is_nil(y.grad_fn)
  end)
end)

describe("eq", function()
  it("rejects shapes that do not broadcast", function()
    local a = fsdp.tensor({ { 1, 2, 3 }, { 3, 2, 1 } })
    H.assert_error(function() return a:eq(fsdp.tensor({ 1, 2 })) end, "eq", "(2, 3)", "(2)")
  end)

  it("records no gradient", function()
    local x = H.leaf({ 1, 2 })
    local e = x:eq(fsdp.tensor({ 1, 0 }))
    assert.is_false(e.requires_grad)
    assert.is_nil(e.grad_fn)
  end)
end)

describe("reductions", function()
  local x = fsdp.tensor({ { { 1, 2, 3, 4 }, { 5, 6, 7, 8 }, { 9, 10, 11, 12 } },
    { { 13, 14, 15, 16 }, { 17, 18, 19, 20 }, { 21, 22, 23, 24 } } }) -- (2, 3, 4)

  it("sum matches naive loops on large inputs and stays accurate", function()
    local a = fsdp.randn(37, 50, 41)
    local l = a:tolist()
    local s1, s2, s3 = a:sum(1):tolist(), a:sum(2):tolist(), a:sum(3):tolist()
    local r1, r2, r3 = {}, {}, {}
    for i = 1, #l do
      local idx = R.unravel(i - 1, { 37, 50, 41 })  -- 0-based
      local k1, k2, k3 = idx[2] * 41 + idx[3] + 1, idx[1] * 41 + idx[3] + 1, idx[1] * 50 + idx[2] + 1
      r1[k1] = (r1[k1] or 0) + l[i]; r2[k2] = (r2[k2] or 0) + l[i]; r3[k3] = (r3[k3] or 0) + l[i]
    end
    H.assert_close(s1, r1, 1e-5, 1e-5, "sum dim 1")
    H.assert_close(s2, r2, 1e-5, 1e-5, "sum dim 2")
    H.assert_close(s3, r3, 1e-5, 1e-5, "sum dim 3")
    local total = 0
    for i = 1, #l do total = total + l[i] end
    H.assert_close(a:sum(), total, 1e-3, 1e-6, "sum all")
    -- 2^21 copies of 0.1: naive float accumulation would drift by far more than 1e-6 relative
    local n = 2 ^ 21
    local big = fsdp.full({ n }, 0.1)
    H.assert_close(big:sum(), n * f32(0.1), 0, 1e-6, "long sum")
    H.assert_close(big:mean(), f32(0.1), 0, 1e-6, "long mean")
    -- the same over a leading dim (column sums) and a middle dim
    H.assert_close(fsdp.full({ n / 2, 2 }, 0.1):sum(1), { n / 2 * f32(0.1), n / 2 * f32(0.1) }, 0, 1e-6, "long column sum")
    H.assert_close(fsdp.full({ 2, n / 4, 2 }, 0.1):sum(2), { n / 4 * f32(0.1), n / 4 * f32(0.1),
      n / 4 * f32(0.1), n / 4 * f32(0.1) }, 0, 1e-6, "long middle sum")
  end)

  it("sum backward broadcasts the gradient exactly", function()
    local a = H.leaf({ { 1, 2 }, { 3, 4 } })
    ;(a:sum(1) * fsdp.tensor({ 10, 20 })):sum():backward()
    assert.same({ { 10, 20 }, { 10, 20 } }, a.grad:totable())
    a.grad = nil
    a:mean():backward()
    assert.same({ { 0.25, 0.25 }, { 0.25, 0.25 } }, a.grad:totable())
  end)

  it("reject bad dims, repeated dims and int64 input", function()
    H.assert_error(function() return x:sum(4) end, "sum", "out of range", "3 dims")
    H.assert_error(function() return x:sum(-4) end, "sum", "out of range")
    H.assert_error(function() return x:mean({ 1, -3 }) end, "mean", "more than once")
    H.assert_error(function() return fsdp.tensor({ 1, 2 }, "int64"):sum() end, "sum", "int64")
    assert.equal(300, x:sum():item())
  end)
end)

describe("max and argmax", function()
  local x = fsdp.tensor({ { 3, 7, 7, 1 }, { -2, -5, -1, -9 }, { 4, 0, 4, 8 } })

  it("propagate NaN like PyTorch", function()
    local v, i = fsdp.tensor({ { 1, 0 / 0, 3 }, { 2, 1, 0 } }):max(2)
    local vl = v:tolist()
    assert(vl[1] ~= vl[1])
    assert.equal(2, vl[2])
    assert.same({ 1, 0 }, i:totable())
    local c = fsdp.tensor({ { 1, 2 }, { 0 / 0, 1 }, { 3, 0 } }):max(1):tolist()
    assert(c[1] ~= c[1])
    assert.equal(2, c[2])
  end)

  it("route the gradient to the argmax positions", function()
    local a = H.leaf({ { 1, 5, 2 }, { 7, 0, 7 } })
    local v = a:max(2)
    ;(v * fsdp.tensor({ 10, 20 })):sum():backward()
    assert.same({ { 0, 10, 0 }, { 20, 0, 0 } }, a.grad:totable())
    a.grad = nil
    a:max():backward() -- the overall max shares its gradient among ties, as in PyTorch
    assert.same({ { 0, 0, 0 }, { 0.5, 0, 0.5 } }, a.grad:totable())
    local c = H.leaf({ 1, 9, 3 })
    c:max():backward()
    assert.same({ 0, 1, 0 }, c.grad:totable())
    -- a NaN max (or min) is shared by the NaN elements, as PyTorch does; it made every gradient NaN
    for _, op in ipairs { "max", "min" } do
      local d = H.leaf({ 1, 0 / 0, 3, 0 / 0 })
      d[op](d):backward()
      assert.same({ 0, 0.5, 0, 0.5 }, d.grad:totable(), op)
    end
  end)

  it("argmax has no gradient; errors name the op", function()
    local a = H.leaf({ 1, 2 })
    assert.is_false(a:argmax(1).requires_grad)
    H.assert_error(function() return x:max(3) end, "max", "out of range")
    H.assert_error(function() return fsdp.zeros(2, 0):max(2) end, "max", "size 0", "(2, 0)")
    H.assert_error(function() return fsdp.zeros(0):max() end, "max", "empty")
    H.assert_error(function() return fsdp.tensor({ 1 }, "int64"):max(1) end, "max", "int64")
    H.assert_error(function() return x:argmax(5) end, "argmax", "out of range")
    assert.same({ 1, 2, 3 }, x:argmax(2):totable())
  end)
end)
