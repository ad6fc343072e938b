-- conv2d, max_pool2d, avg_pool2d, adaptive_avg_pool2d: what the op-case table (tests/ops/op_cases.lua,
-- run by ops_spec.lua) does not cover: which inputs get gradients, the image-parallel path on a
-- larger batch with its exact backward, max pooling's gradient routing, and bad input.
package.path = "lua/?.lua;lua/?/init.lua;tests/?.lua;" .. package.path
local fsdp = require "fsdp"
local H = require "helpers"
local R = require "ops.op_refs"
local F = fsdp.nn.functional

-- the naive direct convolution of tests/ops/op_refs.lua on tensors; returns the flat output
local function ref_conv2d(x, w, b, o)
  return R.conv2d(o, R.from_tensor(x), R.from_tensor(w), R.from_tensor(b)).data
end

describe("conv2d", function()
  it("gradients go only where they are needed (frozen weight, input without grad)", function()
    fsdp.manual_seed(30)
    local x, w, b = fsdp.randn(2, 3, 5, 5), fsdp.randn(4, 3, 3, 3), H.randn_leaf(4)
    F.conv2d(x, w, b, { padding = 1 }):sum():backward()
    assert.is_nil(w.grad)
    H.assert_close(b.grad, { 50, 50, 50, 50 }, 1e-4, 0)  -- N * OH * OW ones per channel
    local x2, w2 = fsdp.randn(2, 3, 5, 5), H.randn_leaf(4, 3, 3, 3)
    F.conv2d(x2, w2):sum():backward()
    assert.same({ 4, 3, 3, 3 }, w2.grad:shape())
  end)

  it("matches naive loops for a batch large enough to split images across threads", function()
    -- 8 * 8 * 64 * 8 * 9 multiply-adds: above the threshold for the image-parallel path
    fsdp.manual_seed(31)
    local N, Cc, O, S = 8, 8, 8, 8
    local x, w, b = H.randn_leaf(N, Cc, S, S), H.randn_leaf(O, Cc, 3, 3), H.randn_leaf(O)
    local y = F.conv2d(x, w, b, { padding = 1 })
    H.assert_close(y, (ref_conv2d(x, w, b, { padding = 1 })), 1e-4, 1e-4)
    y:sum():backward()  -- output gradient of ones
    local fx, fw = x:tolist(), w:tolist()
    local gw_ref, gx_ref = {}, {}
    for i = 1, O * Cc * 9 do gw_ref[i] = 0 end
    for i = 1, N * Cc * S * S do gx_ref[i] = 0 end
    for n = 0, N - 1 do
      for o = 0, O - 1 do
        for c = 0, Cc - 1 do
          for i = 0, 2 do
            for j = 0, 2 do
              local wi = ((o * Cc + c) * 3 + i) * 3 + j + 1
              for oh = 0, S - 1 do
                for ow = 0, S - 1 do
                  local ih, iw = oh - 1 + i, ow - 1 + j
                  if ih >= 0 and ih < S and iw >= 0 and iw < S then
                    local xi = ((n * Cc + c) * S + ih) * S + iw + 1
                    gw_ref[wi] = gw_ref[wi] + fx[xi]
                    gx_ref[xi] = gx_ref[xi] + fw[wi]
                  end
                end
              end
            end
          end
        end
      end
    end
    H.assert_close(w.grad, gw_ref, 1e-3, 1e-4)
    H.assert_close(x.grad, gx_ref, 1e-4, 1e-4)
    H.assert_close(b.grad, { 512, 512, 512, 512, 512, 512, 512, 512 }, 1e-3, 0)
  end)

  it("raises errors naming the op, shapes and dtypes, and keeps working", function()
    local w = fsdp.randn(4, 3, 3, 3)
    H.assert_error(function() return F.conv2d(fsdp.randn(3, 5, 5), w) end, "conv2d", "4-D", "(3, 5, 5)")
    H.assert_error(function() return F.conv2d(fsdp.randn(1, 2, 5, 5), w) end, "conv2d", "(1, 2, 5, 5)", "(4, 3, 3, 3)",
      "channels")
    H.assert_error(function() return F.conv2d(fsdp.randn(1, 3, 2, 2), w) end, "conv2d", "larger", "(4, 3, 3, 3)",
      "(1, 3, 2, 2)")
    H.assert_error(function() return F.conv2d(fsdp.ones(1, 3, 5, 5, "int64"), w) end, "conv2d", "int64",
      "(1, 3, 5, 5)")
    H.assert_error(function() return F.conv2d(fsdp.randn(1, 3, 5, 5), w, fsdp.randn(3)) end, "conv2d", "bias", "(3)")
    H.assert_error(function() return F.conv2d(fsdp.randn(1, 4, 5, 5), fsdp.randn(3, 2, 3, 3), nil, { groups = 2 }) end,
      "conv2d", "divisible", "groups 2")
    H.assert_error(function() return F.conv2d(fsdp.randn(1, 3, 5, 5), w, nil, { stride = 0 }) end, "conv2d", "stride")
    -- a bigger padding makes the small input valid
    assert.same({ 1, 4, 2, 2 }, F.conv2d(fsdp.randn(1, 3, 2, 2), w, nil, { padding = 1 }):shape())
  end)
end)

describe("max_pool2d", function()
  it("routes the gradient to the argmax only, summing overlapping windows", function()
    local x = H.leaf { { { { 1, 2, 0 }, { 0, 9, 0 }, { 3, 0, 4 } } } }
    local y = F.max_pool2d(x, 2, { stride = 1 })  -- every window contains the 9
    H.assert_close(y, { 9, 9, 9, 9 }, 0, 0)
    y:sum():backward()
    H.assert_close(x.grad, { { { { 0, 0, 0 }, { 0, 4, 0 }, { 0, 0, 0 } } } }, 0, 0)
  end)

  it("raises errors naming the op and shapes, and keeps working", function()
    H.assert_error(function() return F.max_pool2d(fsdp.randn(4, 4), 2) end, "max_pool2d", "(4, 4)")
    H.assert_error(function() return F.max_pool2d(fsdp.randn(1, 1, 4, 4), 3, { padding = 2 }) end, "max_pool2d",
      "padding", "half")
    H.assert_error(function() return F.max_pool2d(fsdp.randn(1, 1, 2, 2), 5, { padding = 1 }) end, "max_pool2d",
      "larger", "(1, 1, 2, 2)")
    H.assert_error(function() return F.max_pool2d(fsdp.ones(1, 1, 4, 4, "int64"), 2) end, "max_pool2d", "int64")
    H.assert_close(F.max_pool2d(fsdp.tensor { { { { 1, 5 }, { 3, 2 } } } }, 2), { 5 }, 0, 0)
  end)
end)

describe("avg_pool2d", function()
  it("raises errors naming the op and shapes, and keeps working", function()
    H.assert_error(function() return F.avg_pool2d(fsdp.randn(2, 1, 1, 4, 4), 2) end, "avg_pool2d", "(2, 1, 1, 4, 4)")
    H.assert_error(function() return F.avg_pool2d(fsdp.randn(1, 1, 4, 4), 2, { padding = 2 }) end, "avg_pool2d", "half")
    H.assert_error(function() return F.avg_pool2d(fsdp.randn(1, 1, 2, 2), 3) end, "avg_pool2d", "larger")
    H.assert_close(F.avg_pool2d(fsdp.tensor { { { { 1, 5 }, { 3, 3 } } } }, 2), { 3 }, 0, 0)
  end)
end)

describe("adaptive_avg_pool2d", function()
  it("raises errors naming the op and shapes, and keeps working", function()
    H.assert_error(function() return F.adaptive_avg_pool2d(fsdp.randn(5, 5), 2) end, "adaptive_avg_pool2d", "(5, 5)")
    H.assert_error(function() return F.adaptive_avg_pool2d(fsdp.randn(1, 1, 5, 5), 0) end, "adaptive_avg_pool2d",
      "output_size must be integers >= 1")
    H.assert_error(function() return F.adaptive_avg_pool2d(fsdp.ones(1, 1, 5, 5, "int64"), 2) end,
      "adaptive_avg_pool2d", "int64")
    H.assert_close(F.adaptive_avg_pool2d(fsdp.tensor { { { { 1, 3 }, { 5, 7 } } } }, 1), { 4 }, 0, 0)
  end)
end)
