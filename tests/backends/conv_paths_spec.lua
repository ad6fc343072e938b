-- The convolution paths against each other: oneDNN in its plain layout, oneDNN in its blocked
-- layouts (with reorders), and its default rule, each against our im2col path (FSDP_CONV_ALGO=im2col)
-- for forward, input gradient, weight gradient and bias gradient, on the geometries people train
-- (RGB stem, 3x3 layers, stride 2, 1x1, groups) and on every combination of wanted gradients.
package.path = "lua/?.lua;lua/?/init.lua;tests/?.lua;" .. package.path
local ffi = require "ffi"
local fsdp = require "fsdp"
local H = require "helpers"
local F = fsdp.nn.functional

-- the kernels read FSDP_CONV_ALGO and FSDP_CONV_LAYOUT on every call
local setenv = H.setenv
local saved = { FSDP_CONV_ALGO = os.getenv("FSDP_CONV_ALGO"), FSDP_CONV_LAYOUT = os.getenv("FSDP_CONV_LAYOUT") }

-- path: "im2col" (ours), or oneDNN: "plain", "blocked" (forced layouts), "default" (the rules of
-- onednn.c, Winograd for 3x3 stride-1 float32 layers included), "direct" (the rules without Winograd)
local function set_path(path)
  setenv("FSDP_CONV_ALGO", (path == "im2col" or path == "direct" or path == "winograd") and path or nil)
  setenv("FSDP_CONV_LAYOUT", (path == "plain" or path == "blocked") and path or nil)
end

-- y and the gradients of sum(conv2d(x, w, b) * gy) of the leaves in `want` (x, w, b)
local function run(path, x, w, b, gy, o, want)
  set_path(path)
  local xl, wl, bl = x:clone(), w:clone(), b and b:clone()
  xl.requires_grad, wl.requires_grad = want.x or false, want.w or false
  if bl then bl.requires_grad = want.b or false end
  local y = F.conv2d(xl, wl, bl, o)
  if want.x or want.w or want.b then (y * gy):sum():backward() end
  return { y = y, x = xl.grad, w = wl.grad, b = bl and bl.grad }
end

local assert_rel = H.assert_rel

local avx512 = ffi.string(fsdp.C.fsdp_cpu_isa()) == "avx512f"
local native_bf16 = avx512 and io.open("/proc/cpuinfo"):read("*a"):find(" avx512_bf16") ~= nil

describe("conv2d through oneDNN", function()
  after_each(function() for k, v in pairs(saved) do setenv(k, v) end end)

  -- x (N, C, H, W), w (O, C/groups, kh, kw), options
  local cases = {
    { "RGB stem at 64x64", { 2, 3, 64, 64 }, { 64, 3, 3, 3 }, { padding = 1 } },
    { "3x3 at 56, 64 channels", { 2, 64, 56, 56 }, { 64, 64, 3, 3 }, { padding = 1 } },
    { "3x3 at 14, 256 channels", { 1, 256, 14, 14 }, { 256, 256, 3, 3 }, { padding = 1 } },
    { "stride 2, 64 -> 128", { 2, 64, 28, 28 }, { 128, 64, 3, 3 }, { stride = 2, padding = 1 } },
    -- the last window stops short of the input's last row and column (oneDNN sees x trimmed)
    { "1x1 stride 2 shortcut", { 2, 64, 28, 28 }, { 128, 64, 1, 1 }, { stride = 2 } },
    { "3x3 stride 2, no padding, even size", { 2, 16, 12, 10 }, { 32, 16, 3, 3 }, { stride = 2 } },
    { "1x1", { 2, 32, 14, 14 }, { 64, 32, 1, 1 }, {} },
    { "no padding, odd sizes", { 3, 16, 13, 11 }, { 24, 16, 3, 3 }, {} },
    { "groups 2, dilation 2", { 2, 32, 12, 12 }, { 32, 16, 3, 3 }, { padding = 2, dilation = 2, groups = 2 } },
    { "one input channel", { 4, 1, 28, 28 }, { 32, 1, 3, 3 }, { padding = 1 } },
    -- groups: Winograd (ours and oneDNN's) and the 1x1 GEMMs decline them, oneDNN takes grouped weights
    { "depthwise 3x3", { 2, 32, 14, 14 }, { 32, 1, 3, 3 }, { padding = 1, groups = 32 } },
    { "depthwise x2, stride 2", { 2, 16, 13, 13 }, { 32, 1, 3, 3 }, { stride = 2, padding = 1, groups = 16 } },
    { "groups 2, 3x3 stride 1 (a Winograd shape)", { 2, 32, 10, 10 }, { 32, 16, 3, 3 }, { padding = 1, groups = 2 } },
    { "grouped 1x1", { 2, 32, 8, 8 }, { 64, 8, 1, 1 }, { groups = 4 } },
  }
  for _, c in ipairs(cases) do
    local name, xs, ws, o = unpack(c)
    local paths = { "plain", "blocked", "default", "direct" }
    if o.groups then paths[#paths + 1] = "winograd" end  -- forced, it must leave grouped layers to im2col
    for _, path in ipairs(paths) do
      it(("%s matches im2col: %s"):format(path, name), function()
        fsdp.manual_seed(#name)
        local x, w, b = fsdp.randn(unpack(xs)), fsdp.randn(unpack(ws)), fsdp.randn(ws[1])
        local y0 = F.conv2d(x, w, b, o)
        local gy = fsdp.randn(unpack(y0:shape()))
        local all = { x = true, w = true, b = true }
        local ref = run("im2col", x, w, b, gy, o, all)
        local got = run(path, x, w, b, gy, o, all)
        assert_rel(got.y, ref.y, 1e-5, "forward")
        assert_rel(got.x, ref.x, 1e-5, "input gradient")
        assert_rel(got.w, ref.w, 1e-5, "weight gradient")
        assert_rel(got.b, ref.b, 1e-5, "bias gradient")
      end)
    end
  end

  it("computes only the wanted gradients, each right, in every layout", function()
    -- a 3x3 layer, and a strided 1x1 (a GEMM per image on the subsampled input) with 5 images
    for _, c in ipairs { { { 2, 16, 10, 9 }, { 32, 16, 3, 3 }, { padding = 1 } },
      { { 5, 16, 10, 9 }, { 32, 16, 1, 1 }, { stride = 2 } } } do
      fsdp.manual_seed(5)
      local x, w, b = fsdp.randn(unpack(c[1])), fsdp.randn(unpack(c[2])), fsdp.randn(32)
      local o = c[3]
      local gy = fsdp.randn(unpack(F.conv2d(x, w, b, o):shape()))
      local ref = run("im2col", x, w, b, gy, o, { x = true, w = true, b = true })
      local wants = { { x = true }, { w = true }, { b = true }, { x = true, b = true }, { w = true, b = true },
        { x = true, w = true } }
      for _, path in ipairs { "plain", "blocked", "default" } do
        for _, want in ipairs(wants) do
          local got = run(path, x, w, b, gy, o, want)
          for _, k in ipairs { "x", "w", "b" } do
            if want[k] then assert_rel(got[k], ref[k], 1e-5, path .. " gradient of " .. k)
            else assert.is_nil(got[k]) end
          end
        end
      end
    end
  end)

  -- bfloat16 x and w: oneDNN's bf16 kernels (float32 accumulation, results rounded once) against
  -- the float32 im2col path on the same bf16 values, rounded the same way
  for _, c in ipairs { cases[2], cases[4], cases[5], cases[9] } do
    local name, xs, ws, o = unpack(c)
    for _, path in ipairs { "plain", "blocked", "default" } do
      it(("%s in bfloat16 matches im2col on the same values: %s"):format(path, name), function()
        fsdp.manual_seed(#name + 1)
        local x, w, b = fsdp.randn(unpack(xs)):bfloat16(), fsdp.randn(unpack(ws)):bfloat16(), fsdp.randn(ws[1])
        b = b:bfloat16()
        local gy = fsdp.randn(unpack(F.conv2d(x, w, b, o):shape())):bfloat16()
        local all = { x = true, w = true, b = true }
        local ref = run("im2col", x:float(), w:float(), b:float(), gy:float(), o, all)
        local before = fsdp.C.fsdp_cpu_onednn_conv_passes(fsdp.C.FSDP_BF16)
        local got = run(path, x, w, b, gy, o, all)
        -- where oneDNN has bf16 kernels (AVX512_BF16, not capped by FSDP_CPU_ISA) it ran all three
        -- passes on the bf16 operands; below AVX-512 none (float32 copies); AVX-512 without bf16
        -- instructions may go either way
        local ran = tonumber(fsdp.C.fsdp_cpu_onednn_conv_passes(fsdp.C.FSDP_BF16) - before)
        if native_bf16 then assert.equal(3, ran) elseif not avx512 then assert.equal(0, ran) end
        assert.equal("bfloat16", got.y.dtype)
        assert.equal("bfloat16", got.w.dtype)
        -- one rounding to bf16 (8 significant bits): within 2^-8 of the largest value
        H.assert_rel(got.y:float(), ref.y:bfloat16():float(), 2 ^ -8, "forward")
        H.assert_rel(got.x:float(), ref.x:bfloat16():float(), 2 ^ -8, "input gradient")
        H.assert_rel(got.w:float(), ref.w:bfloat16():float(), 2 ^ -8, "weight gradient")
        H.assert_rel(got.b:float(), ref.b:bfloat16():float(), 2 ^ -8, "bias gradient")
      end)
    end
  end

  it("computes only the wanted gradients in bfloat16 too (a frozen weight with a trained bias)", function()
    fsdp.manual_seed(7)
    local x, w, b = fsdp.randn(2, 16, 10, 9):bfloat16(), fsdp.randn(32, 16, 3, 3):bfloat16(), fsdp.randn(32):bfloat16()
    local o = { padding = 1 }
    local gy = fsdp.randn(2, 32, 10, 9):bfloat16()
    local ref = run("im2col", x:float(), w:float(), b:float(), gy:float(), o, { x = true, w = true, b = true })
    for _, want in ipairs { { b = true }, { x = true, b = true }, { w = true }, { x = true } } do
      local got = run("default", x, w, b, gy, o, want)
      for _, k in ipairs { "x", "w", "b" } do
        if want[k] then H.assert_rel(got[k]:float(), ref[k]:bfloat16():float(), 2 ^ -8, "gradient of " .. k)
        else assert.is_nil(got[k]) end
      end
    end
  end)

  it("runs 3x3 stride-1 float32 layers through Winograd unless FSDP_CONV_ALGO=direct", function()
    fsdp.manual_seed(8)
    local x, w, b = fsdp.randn(2, 32, 12, 12), fsdp.randn(32, 32, 3, 3), fsdp.randn(32)
    local gy = fsdp.randn(2, 32, 12, 12)
    local all = { x = true, w = true, b = true }
    local wino, direct = run("default", x, w, b, gy, { padding = 1 }, all), run("direct", x, w, b, gy, { padding = 1 }, all)
    if avx512 then  -- oneDNN's Winograd needs AVX-512: there the two are different computations
      assert.is_true((wino.y - direct.y):abs():max():item() > 0)
      assert.is_true((wino.x - direct.x):abs():max():item() > 0)
    end
    H.assert_rel(wino.y, direct.y, 1e-5, "forward")
    H.assert_rel(wino.x, direct.x, 1e-5, "input gradient")
    H.assert_rel(wino.w, direct.w, 1e-5, "weight gradient")
  end)

  it("sums a 1x1 weight gradient over threads' chunks of images (2 threads)", function()
    local threads = fsdp.C.fsdp_get_num_threads()
    fsdp.set_num_threads(2)
    local ok, err = pcall(function()
      fsdp.manual_seed(9)
      local x, w = fsdp.randn(7, 24, 8, 8), fsdp.randn(40, 24, 1, 1)
      local gy = fsdp.randn(7, 40, 4, 4)
      local ref = run("im2col", x, w, nil, gy, { stride = 2 }, { x = true, w = true })
      local got = run("default", x, w, nil, gy, { stride = 2 }, { x = true, w = true })
      assert_rel(got.w, ref.w, 1e-5, "weight gradient")
      assert_rel(got.x, ref.x, 1e-5, "input gradient")
    end)
    fsdp.set_num_threads(threads)
    assert(ok, err)
  end)

  it("gives the same numbers on every run", function()
    fsdp.manual_seed(6)
    local x, w = fsdp.randn(4, 32, 16, 16), fsdp.randn(32, 32, 3, 3)
    local gy = fsdp.randn(4, 32, 16, 16)
    local all = { x = true, w = true }
    local a = run("default", x, w, nil, gy, { padding = 1 }, all)
    for _ = 1, 3 do
      local r = run("default", x, w, nil, gy, { padding = 1 }, all)
      assert.equal(0, (r.y - a.y):abs():max():item())
      assert.equal(0, (r.x - a.x):abs():max():item())
      assert.equal(0, (r.w - a.w):abs():max():item())
    end
  end)
end)

-- conv_transpose2d runs on the same kernels (its forward is a convolution's input gradient, its
-- backward a convolution's forward and weight gradient): each path against im2col
describe("conv_transpose2d through every convolution path", function()
  after_each(function() for k, v in pairs(saved) do setenv(k, v) end end)

  -- y and the gradients of sum(conv_transpose2d(x, w, b) * gy)
  local function run_t(path, x, w, b, gy, o)
    set_path(path)
    local xl, wl, bl = x:clone(), w:clone(), b:clone()
    xl.requires_grad, wl.requires_grad, bl.requires_grad = true, true, true
    local y = F.conv_transpose2d(xl, wl, bl, o)
    ;(y * gy):sum():backward()
    return { y = y, x = xl.grad, w = wl.grad, b = bl.grad }
  end

  -- x (N, Cin, H, W), w (Cin, Cout/groups, kh, kw), options
  local cases = {
    { "3x3 stride 2, 32 -> 16 (a decoder upsampling)", { 2, 32, 7, 7 }, { 32, 16, 3, 3 },
      { stride = 2, padding = 1, output_padding = 1 } },
    { "3x3 stride 1, 16 -> 16 (a Winograd shape)", { 2, 16, 9, 9 }, { 16, 16, 3, 3 }, { padding = 1 } },
    { "depthwise", { 2, 16, 8, 8 }, { 16, 1, 3, 3 }, { padding = 1, groups = 16 } },
    { "groups 4, 4x4 stride 2", { 1, 32, 6, 6 }, { 32, 4, 4, 4 }, { stride = 2, padding = 1, groups = 4 } },
    { "1x1 stride 2", { 2, 16, 5, 5 }, { 16, 24, 1, 1 }, { stride = 2, output_padding = 1 } },
  }
  for _, c in ipairs(cases) do
    local name, xs, ws, o = unpack(c)
    for _, path in ipairs { "plain", "blocked", "default", "direct", "winograd" } do
      it(("%s matches im2col: %s"):format(path, name), function()
        fsdp.manual_seed(#name)
        local groups = o.groups or 1
        local x, w, b = fsdp.randn(unpack(xs)), fsdp.randn(unpack(ws)), fsdp.randn(ws[2] * groups)
        local gy = fsdp.randn(unpack(F.conv_transpose2d(x, w, b, o):shape()))
        local ref = run_t("im2col", x, w, b, gy, o)
        local got = run_t(path, x, w, b, gy, o)
        assert_rel(got.y, ref.y, 1e-5, "forward")
        assert_rel(got.x, ref.x, 1e-5, "input gradient")
        assert_rel(got.w, ref.w, 1e-5, "weight gradient")
        assert_rel(got.b, ref.b, 1e-5, "bias gradient")
      end)
    end
  end
end)
