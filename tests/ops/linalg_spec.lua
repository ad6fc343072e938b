-- matmul (torch.matmul semantics), bmm and linear: what the op-case table (tests/ops/op_cases.lua,
-- run by ops_spec.lua) does not cover: which inputs get gradients, exact bias gradients, node
-- names, and bad input.
package.path = "lua/?.lua;lua/?/init.lua;tests/?.lua;" .. package.path
local fsdp = require "fsdp"
local H = require "helpers"
local F = fsdp.nn.functional

describe("matmul", function()
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
  it("records BmmBackward", function()
    local a, b = H.randn_leaf(3, 2, 4), H.randn_leaf(3, 4, 5)
    assert.equal("BmmBackward", a:bmm(b).grad_fn)
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
  it("gives the bias gradient as the column sums of the output gradient", function()
    local x, w, b = fsdp.randn(6, 4), fsdp.randn(3, 4), H.randn_leaf(3)
    local g = fsdp.tensor { { 1, 2, 3 }, { 1, 2, 3 }, { 1, 2, 3 }, { 1, 2, 3 }, { 1, 2, 3 }, { 1, 2, 3 } }
    F.linear(x, w, b):backward(g)
    H.assert_close(b.grad, { 6, 12, 18 }, 0, 0)
    assert.is_nil(w.grad)
    assert.is_nil(x.grad)
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
