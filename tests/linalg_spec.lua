-- matmul (torch.matmul semantics), bmm and linear: forward against naive Lua loops,
-- backward against finite differences, and bad input.
package.path = "lua/?.lua;lua/?/init.lua;tests/?.lua;" .. package.path
local fsdp = require "fsdp"
local H = require "helpers"
local F = fsdp.nn.functional

-- naive torch.matmul on flat Lua tables: 1-D operands promoted, batch dims broadcast
local function ref_matmul(a, b)
  local sa, sb = a:shape(), b:shape()
  local fa, fb = a:tolist(), b:tolist()
  local a1, b1 = #sa == 1, #sb == 1
  if a1 then sa = { 1, sa[1] } end
  if b1 then sb = { sb[1], 1 } end
  local n, k, m = sa[#sa - 1], sa[#sa], sb[#sb]
  local ba, bb = { unpack(sa, 1, #sa - 2) }, { unpack(sb, 1, #sb - 2) }
  local nb = math.max(#ba, #bb)
  local bs, total = {}, 1
  for i = 1, nb do
    bs[i] = math.max(ba[#ba - nb + i] or 1, bb[#bb - nb + i] or 1)
    total = total * bs[i]
  end
  local out = {}
  for t = 0, total - 1 do
    local idx, r = {}, t
    for i = nb, 1, -1 do idx[i] = r % bs[i]; r = math.floor(r / bs[i]) end
    local function offset(bshape, mat)
      local o, s = 0, mat
      for i = #bshape, 1, -1 do
        local ii = bshape[i] == 1 and 0 or idx[nb - #bshape + i]
        o, s = o + ii * s, s * bshape[i]
      end
      return o
    end
    local oa, ob = offset(ba, n * k), offset(bb, k * m)
    for i = 0, n - 1 do
      for j = 0, m - 1 do
        local s = 0
        for q = 0, k - 1 do s = s + fa[oa + i * k + q + 1] * fb[ob + q * m + j + 1] end
        out[#out + 1] = s
      end
    end
  end
  local shape = { unpack(bs) }
  if not a1 then shape[#shape + 1] = n end
  if not b1 then shape[#shape + 1] = m end
  return out, shape
end

-- naive linear: x (M, in) rows, w (out, in), b (out)
local function ref_linear(x, w, b)
  local fx, fw, fb = x:tolist(), w:tolist(), b and b:tolist()
  local out_f, in_f = w:size(1), w:size(2)
  local M = x:numel() / in_f
  local out = {}
  for i = 0, M - 1 do
    for o = 0, out_f - 1 do
      local s = fb and fb[o + 1] or 0
      for q = 0, in_f - 1 do s = s + fx[i * in_f + q + 1] * fw[o * in_f + q + 1] end
      out[#out + 1] = s
    end
  end
  return out
end

local matmul_cases = {
  { { 4 }, { 4 } },                 -- dot
  { { 3, 4 }, { 4, 5 } },           -- matrix product
  { { 4 }, { 4, 5 } },              -- 1-D promoted on the left
  { { 3, 4 }, { 4 } },              -- matrix-vector
  { { 2, 3, 4 }, { 4, 5 } },        -- batch folded into M
  { { 3, 4 }, { 2, 4, 5 } },        -- left operand broadcast over the batch
  { { 2, 3, 4 }, { 2, 4, 5 } },     -- plain batched
  { { 2, 1, 3, 4 }, { 3, 4, 5 } },  -- broadcast both ways
  { { 1, 3, 4 }, { 2, 2, 4, 5 } },
  { { 4 }, { 2, 4, 5 } },
  { { 2, 3, 4 }, { 4 } },
  { { 2, 3, 4 }, { 1, 4, 5 } },     -- batch dim of size 1 on the right
}

describe("matmul", function()
  for _, c in ipairs(matmul_cases) do
    local name = ("(%s) @ (%s)"):format(table.concat(c[1], ","), table.concat(c[2], ","))
    it("forward " .. name .. " matches a naive loop", function()
      fsdp.manual_seed(1)
      local a, b = fsdp.randn(c[1]), fsdp.randn(c[2])
      local y = a:matmul(b)
      local ref, shape = ref_matmul(a, b)
      assert.same(shape, y:shape())
      H.assert_close(y, ref, 1e-5, 1e-5)
    end)
    it("backward " .. name .. " passes gradcheck", function()
      fsdp.manual_seed(2)
      local a, b = H.randn_leaf(c[1]), H.randn_leaf(c[2])
      H.gradcheck(function(x, y) return x:matmul(y) end, { a, b })
      assert.same(c[1], a.grad:shape())
      assert.same(c[2], b.grad:shape())
    end)
  end

  it("computes a hand-checked product", function()
    local a = fsdp.tensor { { 1, 2 }, { 3, 4 } }
    local b = fsdp.tensor { { 5, 6 }, { 7, 8 } }
    H.assert_close(a:matmul(b), { { 19, 22 }, { 43, 50 } }, 0, 0)
    local d = fsdp.tensor { 1, 2, 3 }:matmul(fsdp.tensor { 4, 5, 6 })
    assert.same({}, d:shape())
    assert.equal(32, d:item())
  end)

  it("uses transposed views directly and gets the same values and gradients", function()
    fsdp.manual_seed(3)
    local a0, b0 = H.randn_leaf(4, 3), H.randn_leaf(2, 5, 4)
    local y = a0:t():matmul(b0:transpose(2, 3))  -- (3, 4) @ (2, 4, 5)
    local ref = ref_matmul(a0:t():contiguous(), b0:transpose(2, 3):contiguous())
    H.assert_close(y, ref, 1e-5, 1e-5)
    H.gradcheck(function(x, z) return x:t():matmul(z:transpose(2, 3)) end, { a0, b0 })
    -- transposed left operands against an unbatched right operand (no batch folding then)
    local c0, w = H.randn_leaf(5, 3), H.randn_leaf(5, 2)
    H.assert_close(c0:t():matmul(w), (ref_matmul(c0:t():contiguous(), w)), 1e-5, 1e-5)
    H.gradcheck(function(x, z) return x:t():matmul(z) end, { c0, w })
    local d0, w2 = H.randn_leaf(2, 4, 3), H.randn_leaf(4, 5)
    H.assert_close(d0:transpose(2, 3):matmul(w2), (ref_matmul(d0:transpose(2, 3):contiguous(), w2)), 1e-5, 1e-5)
    H.gradcheck(function(x, z) return x:transpose(2, 3):matmul(z) end, { d0, w2 })
    -- k^T in attention style: (B, T, D) @ (B, D, T)
    local q, k = H.randn_leaf(2, 3, 4), H.randn_leaf(2, 3, 4)
    H.gradcheck(function(x, z) return x:matmul(z:transpose(2, 3)) end, { q, k })
  end)

  it("handles operands that are neither contiguous nor transposed", function()
    fsdp.manual_seed(4)
    local a = fsdp.randn(3, 8):narrow(2, 2, 4)  -- (3, 4) with row stride 8
    local b = fsdp.randn(4, 10):narrow(2, 3, 5)
    H.assert_close(a:matmul(b), ref_matmul(a:contiguous(), b:contiguous()), 1e-5, 1e-5)
  end)

  it("handles empty dimensions", function()
    local y = fsdp.zeros(3, 0):matmul(fsdp.zeros(0, 2))
    assert.same({ 3, 2 }, y:shape())
    H.assert_close(y, { { 0, 0 }, { 0, 0 }, { 0, 0 } }, 0, 0)
    assert.same({ 0, 2 }, fsdp.zeros(0, 4):matmul(fsdp.ones(4, 2)):shape())
  end)

  it("gives a gradient only to inputs that require one", function()
    local a, b = H.randn_leaf(3, 4), fsdp.randn(4, 2)
    a:matmul(b):sum():backward()
    assert.is_nil(b.grad)
    -- d/da sum(a @ b) = ones (3, 2) @ b^T: every row equals the row sums of b
    local rows = b:sum(2):tolist()
    H.assert_close(a.grad, { rows, rows, rows }, 1e-5, 1e-5)
  end)

  it("raises errors that name the op, shapes and dtypes, and keeps working", function()
    H.assert_error(function() return fsdp.randn(2, 3):matmul(fsdp.randn(4, 5)) end, "matmul", "(2, 3)", "(4, 5)", "3 vs 4")
    H.assert_error(function() return fsdp.randn(2, 2, 3):matmul(fsdp.randn(3, 3, 2)) end, "matmul", "broadcast",
      "(2, 2, 3)", "(3, 3, 2)")
    H.assert_error(function() return fsdp.ones(2, 2, "int64"):matmul(fsdp.ones(2, 2)) end, "matmul", "int64", "(2, 2)")
    H.assert_error(function() return fsdp.tensor(3):matmul(fsdp.ones(2)) end, "matmul", "at least 1 dimension")
    H.assert_close(fsdp.tensor { { 1, 2 } }:matmul(fsdp.tensor { { 3 }, { 4 } }), { { 11 } }, 0, 0)
  end)
end)

describe("bmm", function()
  it("matches a naive loop and passes gradcheck", function()
    fsdp.manual_seed(5)
    local a, b = H.randn_leaf(3, 2, 4), H.randn_leaf(3, 4, 5)
    local y = a:bmm(b)
    assert.same({ 3, 2, 5 }, y:shape())
    H.assert_close(y, (ref_matmul(a, b)), 1e-5, 1e-5)
    assert.equal("BmmBackward", y.grad_fn)
    H.gradcheck(function(x, z) return x:bmm(z) end, { a, b })
  end)

  it("rejects what torch.bmm rejects", function()
    H.assert_error(function() return fsdp.randn(2, 3):bmm(fsdp.randn(3, 2)) end, "bmm", "3-D", "(2, 3)")
    H.assert_error(function() return fsdp.randn(2, 3, 4):bmm(fsdp.randn(3, 4, 5)) end, "bmm", "batch", "(2, 3, 4)",
      "(3, 4, 5)")
    H.assert_error(function() return fsdp.randn(2, 3, 4):bmm(fsdp.randn(2, 5, 5)) end, "bmm", "4 vs 5")
    assert.same({ 2, 3, 5 }, fsdp.randn(2, 3, 4):bmm(fsdp.randn(2, 4, 5)):shape())
  end)
end)

describe("linear", function()
  it("computes a hand-checked value", function()
    local x = fsdp.tensor { { 1, 2 } }
    local w = fsdp.tensor { { 1, 0 }, { 0, 1 }, { 1, 1 } }
    local b = fsdp.tensor { 10, 20, 30 }
    H.assert_close(F.linear(x, w, b), { { 11, 22, 33 } }, 0, 0)
    H.assert_close(F.linear(x, w), { { 1, 2, 3 } }, 0, 0)
  end)

  for _, xs in ipairs { { 5, 4 }, { 2, 3, 4 }, { 4 }, { 2, 1, 3, 4 } } do
    local name = table.concat(xs, ",")
    it("matches a naive loop for input (" .. name .. ")", function()
      fsdp.manual_seed(6)
      local x, w, b = fsdp.randn(xs), fsdp.randn(3, 4), fsdp.randn(3)
      local y = F.linear(x, w, b)
      local shape = { unpack(xs) }
      shape[#shape] = 3
      assert.same(shape, y:shape())
      H.assert_close(y, ref_linear(x, w, b), 1e-5, 1e-5)
      H.assert_close(F.linear(x, w), ref_linear(x, w), 1e-5, 1e-5)
    end)
    it("passes gradcheck for x, w and b with input (" .. name .. ")", function()
      fsdp.manual_seed(7)
      local x, w, b = H.randn_leaf(xs), H.randn_leaf(3, 4), H.randn_leaf(3)
      H.gradcheck(F.linear, { x, w, b })
      local x2, w2 = H.randn_leaf(xs), H.randn_leaf(3, 4)
      H.gradcheck(function(p, q) return F.linear(p, q) end, { x2, w2 })
    end)
  end

  it("gives the bias gradient as the column sums of the output gradient", function()
    local x, w, b = fsdp.randn(6, 4), fsdp.randn(3, 4), H.randn_leaf(3)
    local g = fsdp.tensor { { 1, 2, 3 }, { 1, 2, 3 }, { 1, 2, 3 }, { 1, 2, 3 }, { 1, 2, 3 }, { 1, 2, 3 } }
    F.linear(x, w, b):backward(g)
    H.assert_close(b.grad, { 6, 12, 18 }, 0, 0)
    assert.is_nil(w.grad)
    assert.is_nil(x.grad)
  end)

  it("accepts a transposed weight view and a non-contiguous input", function()
    fsdp.manual_seed(8)
    local wt = H.randn_leaf(4, 3)  -- the weight is wt:t(), shape (3, 4)
    local xbig = fsdp.randn(5, 8)
    local x = xbig:narrow(2, 3, 4)
    local y = F.linear(x, wt:t())
    H.assert_close(y, ref_linear(x:contiguous(), wt:t():contiguous()), 1e-5, 1e-5)
    H.gradcheck(function(p) return F.linear(x, p:t()) end, { wt })
  end)

  it("matches matmul with the weight transposed, in value and gradient", function()
    fsdp.manual_seed(9)
    local x, w = H.randn_leaf(7, 5), H.randn_leaf(6, 5)
    local y1 = F.linear(x, w)
    local y2 = x:matmul(w:t())
    H.assert_close(y1, y2, 1e-5, 1e-5)
  end)

  it("raises errors naming the op, shapes and dtypes, and keeps working", function()
    H.assert_error(function() return F.linear(fsdp.randn(4, 3), fsdp.randn(8, 5)) end,
      "linear: input (4, 3) and weight (8, 5): in_features 3 vs 5")
    H.assert_error(function() return F.linear(fsdp.randn(4, 5), fsdp.randn(8, 5), fsdp.randn(7)) end, "linear", "bias",
      "(7)", "(8, 5)")
    H.assert_error(function() return F.linear(fsdp.randn(4, 5), fsdp.randn(2, 8, 5)) end, "linear", "2-D", "(2, 8, 5)")
    H.assert_error(function() return F.linear(fsdp.ones(4, 5, "int64"), fsdp.randn(8, 5)) end, "linear", "int64",
      "(4, 5)")
    H.assert_close(F.linear(fsdp.tensor { { 2 } }, fsdp.tensor { { 3 } }, fsdp.tensor { 1 }), { { 7 } }, 0, 0)
  end)
end)
