-- conv2d, max_pool2d, avg_pool2d, adaptive_avg_pool2d: forward against naive Lua loops (and a few
-- values computed by PyTorch), backward against finite differences, and bad input.
package.path = "lua/?.lua;lua/?/init.lua;tests/?.lua;" .. package.path
local fsdp = require "fsdp"
local H = require "helpers"
local F = fsdp.nn.functional

local function pair(v) if type(v) == "table" then return v[1], v[2] end return v, v end

-- naive direct convolution; returns the flat output and its shape
local function ref_conv2d(x, w, b, o)
  o = o or {}
  local sh, sw = pair(o.stride or 1)
  local ph, pw = pair(o.padding or 0)
  local dh, dw = pair(o.dilation or 1)
  local groups = o.groups or 1
  local N, C, Hh, W = unpack(x:shape())
  local O, Cg, kh, kw = unpack(w:shape())
  local Og = O / groups
  local OH = math.floor((Hh + 2 * ph - dh * (kh - 1) - 1) / sh) + 1
  local OW = math.floor((W + 2 * pw - dw * (kw - 1) - 1) / sw) + 1
  local fx, fw, fb = x:tolist(), w:tolist(), b and b:tolist()
  local out = {}
  for n = 0, N - 1 do
    for oc = 0, O - 1 do
      local g = math.floor(oc / Og)
      for oh = 0, OH - 1 do
        for ow = 0, OW - 1 do
          local s = fb and fb[oc + 1] or 0
          for c = 0, Cg - 1 do
            local ic = g * Cg + c
            for i = 0, kh - 1 do
              for j = 0, kw - 1 do
                local ih, iw = oh * sh - ph + i * dh, ow * sw - pw + j * dw
                if ih >= 0 and ih < Hh and iw >= 0 and iw < W then
                  s = s + fx[((n * C + ic) * Hh + ih) * W + iw + 1] * fw[((oc * Cg + c) * kh + i) * kw + j + 1]
                end
              end
            end
          end
          out[#out + 1] = s
        end
      end
    end
  end
  return out, { N, O, OH, OW }
end

-- PyTorch's pooling output size
local function pool_size(n, k, p, s, d, ceil)
  local num = n + 2 * p - d * (k - 1) - 1
  local o = (ceil and math.ceil(num / s) or math.floor(num / s)) + 1
  if ceil and (o - 1) * s >= n + p then o = o - 1 end
  return o
end

-- naive pooling over planes; kind = "max" or "avg"
local function ref_pool(x, kind, k, o)
  o = o or {}
  local kh, kw = pair(k)
  local sh, sw = pair(o.stride or k)
  local ph, pw = pair(o.padding or 0)
  local dh, dw = pair(o.dilation or 1)
  local include_pad = o.count_include_pad ~= false
  local shape = x:shape()
  local Hh, W = shape[#shape - 1], shape[#shape]
  local planes = x:numel() / (Hh * W)
  local OH, OW = pool_size(Hh, kh, ph, sh, dh, o.ceil_mode), pool_size(W, kw, pw, sw, dw, o.ceil_mode)
  local fx, out = x:tolist(), {}
  for pl = 0, planes - 1 do
    for oh = 0, OH - 1 do
      for ow = 0, OW - 1 do
        local h0, w0 = oh * sh - ph, ow * sw - pw
        if kind == "max" then
          local m = -math.huge
          for i = 0, kh - 1 do
            for j = 0, kw - 1 do
              local ih, iw = h0 + i * dh, w0 + j * dw
              if ih >= 0 and ih < Hh and iw >= 0 and iw < W then m = math.max(m, fx[pl * Hh * W + ih * W + iw + 1]) end
            end
          end
          out[#out + 1] = m
        else
          -- the window may hang over the padding (counted if include_pad) but never past it
          local s, inside, padded = 0, 0, 0
          for ih = h0, h0 + kh - 1 do
            for iw = w0, w0 + kw - 1 do
              if ih < Hh + ph and iw < W + pw then padded = padded + 1 end
              if ih >= 0 and ih < Hh and iw >= 0 and iw < W then
                s, inside = s + fx[pl * Hh * W + ih * W + iw + 1], inside + 1
              end
            end
          end
          out[#out + 1] = s / (include_pad and padded or inside)
        end
      end
    end
  end
  local oshape = { unpack(shape) }
  oshape[#oshape - 1], oshape[#oshape] = OH, OW
  return out, oshape
end

local function ref_adaptive(x, oh_n, ow_n)
  local shape = x:shape()
  local Hh, W = shape[#shape - 1], shape[#shape]
  local planes = x:numel() / (Hh * W)
  local fx, out = x:tolist(), {}
  for pl = 0, planes - 1 do
    for i = 0, oh_n - 1 do
      local h0, h1 = math.floor(i * Hh / oh_n), math.ceil((i + 1) * Hh / oh_n)
      for j = 0, ow_n - 1 do
        local w0, w1 = math.floor(j * W / ow_n), math.ceil((j + 1) * W / ow_n)
        local s = 0
        for ih = h0, h1 - 1 do for iw = w0, w1 - 1 do s = s + fx[pl * Hh * W + ih * W + iw + 1] end end
        out[#out + 1] = s / ((h1 - h0) * (w1 - w0))
      end
    end
  end
  return out
end

-- distinct, well separated values (max pooling's finite differences need no near-ties)
local function distinct(shape)
  local n = 1
  for _, s in ipairs(shape) do n = n * s end
  local perm = fsdp.randperm(n):tolist()
  local t = fsdp.tensor(perm):reshape(shape) * (1 / n) - 0.5
  t = t:contiguous()
  t.requires_grad = true
  return t
end

local conv_cases = {
  { x = { 2, 3, 7, 6 }, w = { 4, 3, 3, 3 }, o = { padding = 1 } },
  { x = { 2, 3, 8, 8 }, w = { 5, 3, 3, 3 }, o = { stride = 2 } },
  { x = { 1, 2, 9, 8 }, w = { 3, 2, 3, 2 }, o = { stride = { 2, 1 }, padding = { 0, 2 }, dilation = { 1, 2 } } },
  { x = { 2, 4, 6, 7 }, w = { 6, 2, 3, 3 }, o = { padding = 1, groups = 2 } },
  { x = { 2, 6, 9, 10 }, w = { 3, 2, 2, 3 }, o = { stride = { 2, 3 }, padding = { 1, 0 }, dilation = { 2, 1 }, groups = 3 } },
  { x = { 3, 5, 4, 4 }, w = { 7, 5, 1, 1 }, o = {} },                   -- pointwise: no im2col
  { x = { 2, 4, 5, 5 }, w = { 4, 1, 3, 3 }, o = { padding = 1, groups = 4 } }, -- depthwise
  { x = { 1, 1, 5, 5 }, w = { 2, 1, 5, 5 }, o = {} },                   -- kernel as large as the input
}

describe("conv2d", function()
  for ci, c in ipairs(conv_cases) do
    local name = ("case %d: x (%s) w (%s)"):format(ci, table.concat(c.x, ","), table.concat(c.w, ","))
    it(name .. " matches a naive direct convolution", function()
      fsdp.manual_seed(10 + ci)
      local x, w, b = fsdp.randn(c.x), fsdp.randn(c.w), fsdp.randn(c.w[1])
      local y = F.conv2d(x, w, b, c.o)
      local ref, shape = ref_conv2d(x, w, b, c.o)
      assert.same(shape, y:shape())
      H.assert_close(y, ref, 1e-4, 1e-4)
      H.assert_close(F.conv2d(x, w, nil, c.o), (ref_conv2d(x, w, nil, c.o)), 1e-4, 1e-4)
    end)
    it(name .. " passes gradcheck for x, w and b", function()
      fsdp.manual_seed(20 + ci)
      local x, w, b = H.randn_leaf(c.x), H.randn_leaf(c.w), H.randn_leaf(c.w[1])
      H.gradcheck(function(p, q, r) return F.conv2d(p, q, r, c.o) end, { x, w, b })
    end)
  end

  it("computes a hand-checked value", function()
    local x = fsdp.tensor { { { { 1, 2, 3 }, { 4, 5, 6 }, { 7, 8, 9 } } } }
    local w = fsdp.tensor { { { { 1, 0 }, { 0, 1 } } } }
    H.assert_close(F.conv2d(x, w, fsdp.tensor { 1 }), { { { { 7, 9 }, { 13, 15 } } } }, 0, 0)
    -- padding 1: the corner sees only x[1][1]
    local y = F.conv2d(x, w, nil, { padding = 1 })
    assert.same({ 1, 1, 4, 4 }, y:shape())
    assert.equal(1, y:totable()[1][1][1][1])
    assert.equal(9, y:totable()[1][1][4][4])
  end)

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

local pool_cases = {
  { x = { 2, 3, 6, 6 }, k = 2, o = {} },
  { x = { 2, 2, 7, 6 }, k = 3, o = { stride = 2, padding = 1 } },
  { x = { 1, 2, 7, 7 }, k = 3, o = { stride = 2, padding = 1, ceil_mode = true } },
  { x = { 2, 1, 5, 5 }, k = 2, o = { stride = 2, ceil_mode = true } },
  { x = { 1, 2, 8, 7 }, k = { 3, 2 }, o = { stride = { 1, 2 }, padding = { 1, 0 } } },
  { x = { 3, 5, 5 }, k = 2, o = { stride = 1 } },  -- 3-D input (C, H, W)
  { x = { 1, 2, 5, 5 }, k = 2, o = { stride = 2, padding = 1, ceil_mode = true } }, -- last window dropped
}

describe("max_pool2d", function()
  for ci, c in ipairs(pool_cases) do
    local name = ("case %d: x (%s)"):format(ci, table.concat(c.x, ","))
    it(name .. " matches a naive loop and passes gradcheck", function()
      fsdp.manual_seed(40 + ci)
      local x = distinct(c.x)
      local y = F.max_pool2d(x, c.k, c.o)
      local ref, shape = ref_pool(x, "max", c.k, c.o)
      assert.same(shape, y:shape())
      H.assert_close(y, ref, 0, 0)
      H.gradcheck(function(p) return F.max_pool2d(p, c.k, c.o) end, { x }, { eps = 1e-3 })
    end)
  end

  it("supports dilation", function()
    fsdp.manual_seed(50)
    local x = distinct { 1, 2, 9, 8 }
    local o = { stride = 2, padding = 1, dilation = 2 }
    local y = F.max_pool2d(x, 3, o)
    local ref, shape = ref_pool(x, "max", 3, o)
    assert.same(shape, y:shape())
    H.assert_close(y, ref, 0, 0)
    H.gradcheck(function(p) return F.max_pool2d(p, 3, o) end, { x }, { eps = 1e-3 })
  end)

  it("matches PyTorch on a ceil_mode example", function()
    local x = fsdp.arange(0, 25, 1, "float32"):reshape(1, 1, 5, 5)
    H.assert_close(F.max_pool2d(x, 2, { stride = 2, ceil_mode = true }), { 6, 8, 9, 16, 18, 19, 21, 23, 24 }, 0, 0)
    assert.same({ 1, 1, 4, 4 }, F.max_pool2d(fsdp.randn(1, 1, 6, 6), 3, { stride = 2, padding = 1, ceil_mode = true }):shape())
    assert.same({ 1, 1, 3, 3 }, F.max_pool2d(fsdp.randn(1, 1, 6, 6), 3, { stride = 3, padding = 1, ceil_mode = true }):shape())
    assert.same({ 1, 1, 3, 3 }, F.max_pool2d(fsdp.randn(1, 1, 5, 5), 2, { stride = 2, padding = 1, ceil_mode = true }):shape())
  end)

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
  for ci, c in ipairs(pool_cases) do
    for _, include in ipairs { true, false } do
      local name = ("case %d: x (%s) count_include_pad=%s"):format(ci, table.concat(c.x, ","), tostring(include))
      it(name .. " matches a naive loop and passes gradcheck", function()
        fsdp.manual_seed(60 + ci)
        local o = {}
        for k, v in pairs(c.o) do o[k] = v end
        o.count_include_pad = include
        local x = H.randn_leaf(c.x)
        local y = F.avg_pool2d(x, c.k, o)
        local ref, shape = ref_pool(x, "avg", c.k, o)
        assert.same(shape, y:shape())
        H.assert_close(y, ref, 1e-5, 1e-5)
        H.gradcheck(function(p) return F.avg_pool2d(p, c.k, o) end, { x })
      end)
    end
  end

  it("matches PyTorch on ceil_mode and padding examples", function()
    local x = fsdp.arange(0, 25, 1, "float32"):reshape(1, 1, 5, 5)
    H.assert_close(F.avg_pool2d(x, 2, { stride = 2, ceil_mode = true }), { 3, 5, 6.5, 13, 15, 16.5, 20.5, 22.5, 24 },
      1e-6, 0)
    H.assert_close(F.avg_pool2d(x, 3, { stride = 2, padding = 1, ceil_mode = true }),
      { 4 / 3, 3, 8 / 3, 7, 12, 9, 8, 13, 28 / 3 }, 1e-5, 0)
    H.assert_close(F.avg_pool2d(x, 3, { stride = 2, padding = 1, ceil_mode = true, count_include_pad = false }),
      { 3, 4.5, 6, 10.5, 12, 13.5, 18, 19.5, 21 }, 1e-5, 0)
    -- a window that would start inside the right padding is dropped (3 outputs, not 4)
    H.assert_close(F.avg_pool2d(x, 2, { stride = 2, padding = 1, ceil_mode = true }),
      { 0, 0.75, 1.75, 3.75, 9, 11, 8.75, 19, 21 }, 1e-6, 0)
    H.assert_close(F.avg_pool2d(x, 2, { stride = 2, padding = 1, ceil_mode = true, count_include_pad = false }),
      { 0, 1.5, 3.5, 7.5, 9, 11, 17.5, 19, 21 }, 1e-6, 0)
  end)

  it("raises errors naming the op and shapes, and keeps working", function()
    H.assert_error(function() return F.avg_pool2d(fsdp.randn(2, 1, 1, 4, 4), 2) end, "avg_pool2d", "(2, 1, 1, 4, 4)")
    H.assert_error(function() return F.avg_pool2d(fsdp.randn(1, 1, 4, 4), 2, { padding = 2 }) end, "avg_pool2d", "half")
    H.assert_error(function() return F.avg_pool2d(fsdp.randn(1, 1, 2, 2), 3) end, "avg_pool2d", "larger")
    H.assert_close(F.avg_pool2d(fsdp.tensor { { { { 1, 5 }, { 3, 3 } } } }, 2), { 3 }, 0, 0)
  end)
end)

describe("adaptive_avg_pool2d", function()
  for _, c in ipairs { { { 2, 3, 7, 5 }, 3, 4 }, { { 1, 2, 6, 6 }, 2, 3 }, { { 2, 1, 5, 5 }, 5, 5 }, { { 1, 1, 4, 6 }, 1, 1 },
    { { 3, 4, 5 }, 7, 2 } } do
    local name = ("(%s) -> (%d, %d)"):format(table.concat(c[1], ","), c[2], c[3])
    it(name .. " matches the floor/ceil window formula and passes gradcheck", function()
      fsdp.manual_seed(70)
      local x = H.randn_leaf(c[1])
      local y = F.adaptive_avg_pool2d(x, { c[2], c[3] })
      local shape = { unpack(c[1]) }
      shape[#shape - 1], shape[#shape] = c[2], c[3]
      assert.same(shape, y:shape())
      H.assert_close(y, ref_adaptive(x, c[2], c[3]), 1e-5, 1e-5)
      H.gradcheck(function(p) return F.adaptive_avg_pool2d(p, { c[2], c[3] }) end, { x })
    end)
  end

  it("matches PyTorch on an overlapping-window example", function()
    local x = fsdp.arange(0, 25, 1, "float32"):reshape(1, 1, 5, 5)
    H.assert_close(F.adaptive_avg_pool2d(x, { 3, 2 }), { 3.5, 5.5, 11, 13, 18.5, 20.5 }, 1e-6, 0)
    H.assert_close(F.adaptive_avg_pool2d(x, 1), { 12 }, 1e-6, 0)
  end)

  it("raises errors naming the op and shapes, and keeps working", function()
    H.assert_error(function() return F.adaptive_avg_pool2d(fsdp.randn(5, 5), 2) end, "adaptive_avg_pool2d", "(5, 5)")
    H.assert_error(function() return F.adaptive_avg_pool2d(fsdp.randn(1, 1, 5, 5), 0) end, "adaptive_avg_pool2d",
      "positive")
    H.assert_error(function() return F.adaptive_avg_pool2d(fsdp.ones(1, 1, 5, 5, "int64"), 2) end,
      "adaptive_avg_pool2d", "int64")
    H.assert_close(F.adaptive_avg_pool2d(fsdp.tensor { { { { 1, 3 }, { 5, 7 } } } }, 1), { 4 }, 0, 0)
  end)
end)
