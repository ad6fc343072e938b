-- Winograd F(2x2, 3x3) convolution (3x3, stride 1, padding 1, one group, enough channels): forward,
-- input gradient and weight gradient against the im2col path (forced with FSDP_CONV_ALGO), against
-- a naive loop, finite differences through Winograd, the automatic choice of path, and the fallback
-- of geometries Winograd does not cover.
package.path = "lua/?.lua;lua/?/init.lua;tests/?.lua;" .. package.path
local ffi = require "ffi"
local fsdp = require "fsdp"
local H = require "helpers"
local R = require "ops.op_refs"
local F = fsdp.nn.functional

-- the kernels read FSDP_CONV_ALGO on every call
local function set_algo(a) H.setenv("FSDP_CONV_ALGO", a) end
local saved_algo = os.getenv("FSDP_CONV_ALGO")

-- the naive direct convolution of tests/ops/op_refs.lua, 3x3, stride 1, padding 1; flat output
local function ref_conv3x3(x, w, b)
  return R.conv2d({ padding = 1 }, R.from_tensor(x), R.from_tensor(w), R.from_tensor(b)).data
end

-- y, gx, gw, gb of sum(conv2d(x, w, b) * gy) through the path `algo`
local function run(algo, x, w, b, gy)
  set_algo(algo)
  local xl, wl = x:clone(), w:clone()
  xl.requires_grad, wl.requires_grad = true, true
  local bl
  if b then bl = b:clone(); bl.requires_grad = true end
  local y = F.conv2d(xl, wl, bl, { padding = 1 })
  local loss = (y * gy):sum()
  loss:backward()
  return y, xl.grad, wl.grad, bl and bl.grad
end

local assert_rel = H.assert_rel

describe("winograd conv2d", function()
  after_each(function() set_algo(saved_algo) end)

  -- N, C, H, W, O, bias
  local cases = {
    { 1, 16, 8, 8, 16, true },      -- at the channel threshold, one image
    { 2, 16, 7, 9, 16, true },      -- odd height and width: partial tiles on the last row and column
    { 3, 32, 13, 12, 64, false },   -- no bias
    { 4, 24, 1, 2, 40, true },      -- a single row: every tile is a border tile
    { 2, 16, 3, 1, 16, true },      -- a single column
    { 3, 16, 1, 1, 16, false },     -- one pixel: only the kernel's centre sees the input
    { 2, 16, 5, 3, 16, true },      -- three columns: the second tile has one column inside
    { 9, 20, 6, 5, 17, true },      -- tiles across images inside one block; O not a multiple of 4
    { 64, 32, 28, 28, 64, true },   -- the benchmark's second convolution
  }
  for _, c in ipairs(cases) do
    local N, C, Hh, W, O, bias = unpack(c)
    it(("matches im2col: x (%d,%d,%d,%d), w (%d,%d,3,3)%s"):format(N, C, Hh, W, O, C, bias and ", bias" or ""),
      function()
        fsdp.manual_seed(N * 100 + C)
        local x, w = fsdp.randn(N, C, Hh, W), fsdp.randn(O, C, 3, 3)
        local b = bias and fsdp.randn(O) or nil
        local gy = fsdp.randn(N, O, Hh, W)
        local y1, gx1, gw1, gb1 = run("im2col", x, w, b, gy)
        local y2, gx2, gw2, gb2 = run("winograd", x, w, b, gy)
        assert_rel(y2, y1, 1e-5, "forward")
        assert_rel(gx2, gx1, 1e-5, "input gradient")
        assert_rel(gw2, gw1, 1e-5, "weight gradient")
        if bias then assert_rel(gb2, gb1, 1e-6, "bias gradient") end
        -- the two paths really are different computations (rounding differs somewhere)
        assert.is_true((y1 - y2):abs():max():item() > 0)
      end)
  end

  it("computes only the wanted gradients (frozen weight, input without grad, bias only)", function()
    fsdp.manual_seed(8)
    local x, w, b = fsdp.randn(3, 16, 9, 10), fsdp.randn(24, 16, 3, 3), fsdp.randn(24)
    local gy = fsdp.randn(3, 24, 9, 10)
    local _, gx_ref, gw_ref, gb_ref = run("im2col", x, w, b, gy)
    -- each combination of leaves that want a gradient
    for _, want in ipairs { { x = true }, { w = true }, { b = true }, { x = true, b = true }, { w = true, b = true } } do
      set_algo("winograd")
      local xl, wl, bl = x:clone(), w:clone(), b:clone()
      xl.requires_grad, wl.requires_grad, bl.requires_grad = want.x or false, want.w or false, want.b or false
      local loss = (F.conv2d(xl, wl, bl, { padding = 1 }) * gy):sum()
      loss:backward()
      if want.x then assert_rel(xl.grad, gx_ref, 1e-5, "input gradient") else assert.is_nil(xl.grad) end
      if want.w then assert_rel(wl.grad, gw_ref, 1e-5, "weight gradient") else assert.is_nil(wl.grad) end
      if want.b then assert_rel(bl.grad, gb_ref, 1e-6, "bias gradient") else assert.is_nil(bl.grad) end
    end
  end)

  it("gives the same gradients on every run, and on 1 or 2 threads up to rounding", function()
    -- OpenMP's thread count, set from here (the specs run with OMP_NUM_THREADS=1)
    pcall(ffi.cdef, "int omp_get_max_threads(void); void omp_set_num_threads(int n);")
    local gomp = ffi.load("libgomp.so.1")
    local threads = gomp.omp_get_max_threads()
    fsdp.manual_seed(9)
    local x, w = fsdp.randn(16, 32, 14, 14), fsdp.randn(32, 32, 3, 3)
    local gy = fsdp.randn(16, 32, 14, 14)
    gomp.omp_set_num_threads(1)
    local y0, gx0, gw0 = run("winograd", x, w, nil, gy)
    gomp.omp_set_num_threads(2)
    local ok, err = pcall(function()
      local y1, gx1, gw1 = run("winograd", x, w, nil, gy)
      assert_rel(y1, y0, 1e-6, "forward on 2 threads")
      assert_rel(gx1, gx0, 1e-6, "input gradient on 2 threads")
      assert_rel(gw1, gw0, 1e-5, "weight gradient on 2 threads")  -- summed in chunks
      for _ = 1, 3 do
        local y2, gx2, gw2 = run("winograd", x, w, nil, gy)
        assert.equal(0, (y1 - y2):abs():max():item())
        assert.equal(0, (gx1 - gx2):abs():max():item())
        assert.equal(0, (gw1 - gw2):abs():max():item())
      end
    end)
    gomp.omp_set_num_threads(threads)
    assert(ok, err)
  end)

  it("matches a naive loop on a small case forced through Winograd", function()
    set_algo("winograd")
    fsdp.manual_seed(3)
    local x, w, b = fsdp.randn(2, 3, 5, 7), fsdp.randn(4, 3, 3, 3), fsdp.randn(4)
    local y = F.conv2d(x, w, b, { padding = 1 })
    assert.same({ 2, 4, 5, 7 }, y:shape())
    H.assert_close(y, ref_conv3x3(x, w, b), 1e-4, 1e-4)
    H.assert_close(F.conv2d(x, w, nil, { padding = 1 }), ref_conv3x3(x, w, nil), 1e-4, 1e-4)
  end)

  it("computes a hand-checked value", function()
    set_algo("winograd")
    -- all-ones 3x3 kernel: each output is the sum of its 3x3 neighbourhood (zero padded)
    local x = fsdp.tensor { { { { 1, 2, 3 }, { 4, 5, 6 }, { 7, 8, 9 } } } }
    local y = F.conv2d(x, fsdp.ones(1, 1, 3, 3), fsdp.tensor { 0.5 }, { padding = 1 })
    H.assert_close(y, { { { { 12.5, 21.5, 16.5 }, { 27.5, 45.5, 33.5 }, { 24.5, 39.5, 28.5 } } } }, 1e-5, 0)
  end)

  it("passes gradcheck for x, w and b forced through Winograd", function()
    set_algo("winograd")
    fsdp.manual_seed(4)
    local x, w, b = H.randn_leaf { 2, 3, 5, 4 }, H.randn_leaf { 2, 3, 3, 3 }, H.randn_leaf { 2 }
    H.gradcheck(function(p, q, r) return F.conv2d(p, q, r, { padding = 1 }) end, { x, w, b })
  end)

  it("takes a non-contiguous input", function()
    set_algo("winograd")
    fsdp.manual_seed(5)
    local xt = fsdp.randn(2, 16, 9, 6):transpose(3, 4)  -- (2, 16, 6, 9), not contiguous
    local w = fsdp.randn(16, 16, 3, 3)
    assert.is_false(xt:is_contiguous())
    local y = F.conv2d(xt, w, nil, { padding = 1 })
    set_algo("im2col")
    assert_rel(y, F.conv2d(xt:contiguous(), w, nil, { padding = 1 }), 1e-5, "non-contiguous")
  end)

  it("is our choice at 16 channels and up, and not below (FSDP_CONV_ALGO=ours)", function()
    fsdp.manual_seed(6)
    local function same_as(algo, C, O)
      local x, w = fsdp.randn(2, C, 8, 8), fsdp.randn(O, C, 3, 3)
      set_algo("ours")
      local auto = F.conv2d(x, w, nil, { padding = 1 })
      set_algo(algo)
      return (auto - F.conv2d(x, w, nil, { padding = 1 })):abs():max():item() == 0
    end
    assert.is_true(same_as("winograd", 32, 64))
    assert.is_false(same_as("im2col", 32, 64))
    assert.is_true(same_as("im2col", 8, 64))    -- too few input channels
    assert.is_true(same_as("im2col", 32, 8))    -- too few output channels
    assert.is_false(same_as("winograd", 8, 64))
  end)

  it("leaves other geometries to im2col even when forced", function()
    set_algo("winograd")
    fsdp.manual_seed(7)
    local x = fsdp.randn(1, 4, 6, 6)
    for _, o in ipairs { { padding = 1, stride = 2 }, { padding = 0 }, { padding = 2, dilation = 2 }, { padding = 1, groups = 2 } } do
      local w = fsdp.randn(4, 4 / (o.groups or 1), 3, 3)
      local y = F.conv2d(x, w, nil, o)
      set_algo("im2col")
      assert.equal(0, (y - F.conv2d(x, w, nil, o)):abs():max():item())
      set_algo("winograd")
    end
    local w5 = fsdp.randn(2, 4, 5, 5)  -- 5x5 kernel
    local y = F.conv2d(x, w5, nil, { padding = 2 })
    set_algo("im2col")
    assert.equal(0, (y - F.conv2d(x, w5, nil, { padding = 2 })):abs():max():item())
  end)

  it("reports bad input as a Lua error and keeps working", function()
    set_algo("winograd")
    local w = fsdp.randn(16, 16, 3, 3)
    H.assert_error(function() return F.conv2d(fsdp.randn(1, 8, 5, 5), w, nil, { padding = 1 }) end, "conv2d",
      "(1, 8, 5, 5)", "(16, 16, 3, 3)")
    H.assert_error(function() return F.conv2d(fsdp.randn(1, 16, 5, 5), w, fsdp.randn(4), { padding = 1 }) end,
      "conv2d", "bias", "(4)")
    local x = fsdp.tensor { { { { 1, 2, 3 }, { 4, 5, 6 }, { 7, 8, 9 } } } }
    H.assert_close(F.conv2d(x, fsdp.ones(1, 1, 3, 3), nil, { padding = 1 }),
      { { { { 12, 21, 16 }, { 27, 45, 33 }, { 24, 39, 28 } } } }, 1e-5, 0)
  end)
end)
