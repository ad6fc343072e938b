-- The multi-threaded fast paths of the CPU kernels, run at 2 threads: GEMMs cut into pieces and
-- shared out by the GEMM scheduler (a big linear, odd sizes, batched products, the paired GEMMs
-- of linear and attention backward), convolution backward in image chunks, vectorized
-- transcendental loops and pooling sums. Each is checked against a naive reference (Lua loops,
-- or a composition of plain ops run on one thread), plus bad input after the fast paths ran.
package.path = "lua/?.lua;lua/?/init.lua;tests/?.lua;" .. package.path
local ffi = require "ffi"
local fsdp = require "fsdp"
local H = require "helpers"
local F = fsdp.nn.functional

pcall(ffi.cdef, "int openblas_get_num_threads(void);")
pcall(ffi.cdef, "void openblas_set_num_threads(int n);")
local blas = ffi.load("openblas")

-- naive C (M, N) = A (M, K) @ B (K, N) on flat Lua tables (row-major)
local function ref_mm(a, b, M, K, N)
  local c = {}
  for i = 0, M - 1 do
    for j = 0, N - 1 do
      local s = 0
      for q = 0, K - 1 do s = s + a[i * K + q + 1] * b[q * N + j + 1] end
      c[i * N + j + 1] = s
    end
  end
  return c
end
local function transpose(a, R, Cc) -- (R, C) -> (C, R)
  local t = {}
  for i = 0, R - 1 do for j = 0, Cc - 1 do t[j * R + i + 1] = a[i * Cc + j + 1] end end
  return t
end

-- runs fn at n threads and puts the count back afterwards
local function at_threads(n, fn)
  local before = fsdp.C.fsdp_get_num_threads()
  fsdp.set_num_threads(n)
  local ok, a, b, c, d, e = pcall(fn)
  fsdp.set_num_threads(before)
  if not ok then error(a, 0) end
  return a, b, c, d, e
end

describe("GEMM scheduler at 2 threads", function()
  before_each(function() fsdp.manual_seed(7) end)

  it("linear forward and backward (6M multiply-adds, split into pieces) match naive loops", function()
    at_threads(2, function()
      local M, IN, OUT = 200, 300, 100
      local x = fsdp.randn(M, IN):requires_grad_()
      local w = fsdp.randn(OUT, IN):requires_grad_()
      local b = fsdp.randn(OUT):requires_grad_()
      local y = F.linear(x, w, b)
      local gy = fsdp.randn(M, OUT)
      y:backward(gy)
      local fx, fw, fb, fg = x:tolist(), w:tolist(), b:tolist(), gy:tolist()
      local ry = ref_mm(fx, transpose(fw, OUT, IN), M, IN, OUT)
      for i = 0, M - 1 do for j = 0, OUT - 1 do ry[i * OUT + j + 1] = ry[i * OUT + j + 1] + fb[j + 1] end end
      H.assert_close(y, ry, 1e-4, 1e-5, "y")
      H.assert_close(x.grad, ref_mm(fg, fw, M, OUT, IN), 1e-4, 1e-5, "grad x")
      H.assert_close(w.grad, ref_mm(transpose(fg, M, OUT), fx, OUT, M, IN), 1e-4, 1e-5, "grad w")
      local rb = {}
      for j = 0, OUT - 1 do
        local s = 0
        for i = 0, M - 1 do s = s + fg[i * OUT + j + 1] end
        rb[j + 1] = s
      end
      H.assert_close(b.grad, rb, 1e-4, 1e-5, "grad b")
    end)
  end)

  it("odd sizes split along N with a ragged last piece, and transposed operands", function()
    at_threads(2, function()
      local M, K, N = 37, 70, 1001 -- 2.6M multiply-adds, N not a multiple of 16
      local a, b = fsdp.randn(M, K), fsdp.randn(K, N)
      H.assert_close(a:matmul(b), ref_mm(a:tolist(), b:tolist(), M, K, N), 1e-4, 1e-5, "a @ b")
      local at, bt = fsdp.randn(K, M), fsdp.randn(N, K) -- a = at^T, b = bt^T: no copies, trans flags
      local ref = ref_mm(transpose(at:tolist(), K, M), transpose(bt:tolist(), N, K), M, K, N)
      H.assert_close(at:t():matmul(bt:t()), ref, 1e-4, 1e-5, "at^T @ bt^T")
    end)
  end)

  it("a weight gradient over 1300 rows (oneDNN sums it in K slices of 512, the last ragged) matches loops", function()
    for _, threads in ipairs { 1, 2 } do
      at_threads(threads, function()
        local M, IN, OUT = 1300, 24, 40
        local x, w = fsdp.randn(M, IN), fsdp.randn(OUT, IN):requires_grad_()
        local gy = fsdp.randn(M, OUT)
        F.linear(x, w):backward(gy)
        local ref = ref_mm(transpose(gy:tolist(), M, OUT), x:tolist(), OUT, M, IN) -- gy^T (OUT, M) @ x (M, IN)
        H.assert_close(w.grad, ref, 1e-4, 1e-4, "grad w at " .. threads .. " thread(s)")
        local gt = x:t():matmul(gy) -- x^T @ gy: the same kind of product, (IN, OUT)
        H.assert_close(gt, ref_mm(transpose(x:tolist(), M, IN), gy:tolist(), IN, M, OUT), 1e-4, 1e-4, "x^T @ gy")
      end)
    end
  end)

  it("a bias gradient over 1301 rows and 2100 columns (four rows per pass, two column blocks) matches loops", function()
    for _, threads in ipairs { 1, 2 } do
      at_threads(threads, function()
        local M, IN, OUT = 1301, 3, 2100
        local x, w, b = fsdp.randn(M, IN), fsdp.randn(OUT, IN), fsdp.randn(OUT):requires_grad_()
        local gy = fsdp.randn(M, OUT)
        F.linear(x, w, b):backward(gy)
        local fg, rb = gy:tolist(), {}
        for j = 1, OUT do rb[j] = 0 end
        for i = 0, M - 1 do
          for j = 1, OUT do rb[j] = rb[j] + fg[i * OUT + j] end
        end
        H.assert_close(b.grad, rb, 1e-4, 1e-4, "grad b at " .. threads .. " thread(s)")
      end)
    end
  end)

  it("a batch of 64 small products is shared out whole, and matches one thread", function()
    local a, b = fsdp.randn(64, 33, 40), fsdp.randn(64, 40, 31) -- 2.7M multiply-adds
    local two = at_threads(2, function() return a:bmm(b) end)
    local fa, fb, out = a:tolist(), b:tolist(), two:tolist()
    for _, n in ipairs { 0, 17, 63 } do -- spot-check whole matrices against loops
      local sa, sb = {}, {}
      for i = 1, 33 * 40 do sa[i] = fa[n * 33 * 40 + i] end
      for i = 1, 40 * 31 do sb[i] = fb[n * 40 * 31 + i] end
      local got = {}
      for i = 1, 33 * 31 do got[i] = out[n * 33 * 31 + i] end
      H.assert_close(got, ref_mm(sa, sb, 33, 40, 31), 1e-4, 1e-5, "batch " .. n)
    end
    local one = at_threads(1, function() return a:bmm(b) end)
    H.assert_close(two, one, 0, 0, "2 threads vs 1 thread (same GEMMs, bit for bit)")
  end)

  it("leaves OpenBLAS's own thread count as it was (fsdp keeps it at 1; a user may set another)", function()
    at_threads(2, function()
      assert.are.equal(1, blas.openblas_get_num_threads())
      blas.openblas_set_num_threads(3)
      local ok, err = pcall(function()
        local a = fsdp.randn(256, 256):requires_grad_()
        local y = a:matmul(fsdp.randn(256, 256))
        y:sum():backward()
        assert.are.equal(3, blas.openblas_get_num_threads())
      end)
      blas.openblas_set_num_threads(1)
      assert(ok, err)
    end)
  end)
end)

-- fused causal attention at 2 threads against the explicit composition on one thread (matmul,
-- additive -inf mask, softmax), outputs and gradients; an optional float mask that requires grad.
-- Returns the fused side's mask gradient.
local function check_causal_attention(seed, B, Hh, T, D, with_mask)
  fsdp.manual_seed(seed)
  local q0, k0, v0 = fsdp.randn(B, Hh, T, D), fsdp.randn(B, Hh, T, D), fsdp.randn(B, Hh, T, D)
  local m0, gout = fsdp.randn(T, T), fsdp.randn(B, Hh, T, D)
  local causal = {}
  for i = 1, T do
    local row = {}
    for j = 1, T do row[j] = j > i and -math.huge or 0 end
    causal[i] = row
  end
  causal = fsdp.tensor(causal)
  local function run(fused)
    local q, k, v = q0:clone():requires_grad_(), k0:clone():requires_grad_(), v0:clone():requires_grad_()
    local m = with_mask and m0:clone():requires_grad_() or nil
    local out
    if fused then
      out = F.scaled_dot_product_attention(q, k, v, { causal = true, attn_mask = m })
    else
      local s = q:matmul(k:transpose(3, 4)) * (1 / math.sqrt(D)) + causal
      if m then s = s + m end
      out = s:softmax(-1):matmul(v)
    end
    out:backward(gout)
    return out, q.grad, k.grad, v.grad, m and m.grad
  end
  local o2, dq2, dk2, dv2, dm2 = at_threads(2, function() return run(true) end)
  local o1, dq1, dk1, dv1, dm1 = at_threads(1, function() return run(false) end)
  H.assert_close(o2, o1, 1e-5, 1e-4, "out")
  H.assert_close(dq2, dq1, 1e-5, 1e-4, "dq")
  H.assert_close(dk2, dk1, 1e-5, 1e-4, "dk")
  H.assert_close(dv2, dv1, 1e-5, 1e-4, "dv")
  if with_mask then H.assert_close(dm2, dm1, 1e-5, 1e-4, "dmask") end
  return dm2
end

describe("attention backward (paired GEMMs) at 2 threads", function()
  it("matches the explicit softmax(q k^T / sqrt(d) + causal mask) v composition", function()
    check_causal_attention(3, 4, 4, 64, 32) -- each paired product: 16 x 64*64*32 = 2.1M multiply-adds
  end)

  -- causal self-attention from T = 64 on runs its products on row blocks of the lower triangle
  -- (3 uneven blocks at T = 100); a float mask that requires grad checks dS in the skipped blocks
  it("causal row blocks (T = 100, with a float mask) match the explicit composition", function()
    local T = 100
    local dm = check_causal_attention(4, 2, 2, T, 16, true):tolist() -- flat, row-major
    -- the masked triangle gets exactly zero mask gradient
    for i = 1, T, 7 do for j = i + 1, T, 5 do assert.are.equal(0, dm[(i - 1) * T + j]) end end
  end)

  -- T = 300: the causal products' sums run over more than one 256-deep slice of k, and their rows
  -- over more than one 128-row block (gemm_tiles' cache blocking); D = 40 puts the products with D
  -- columns on a pair of panels (AVX-512's 8x32 tiles, which add the later slices) and a partial one
  it("causal products deeper than one k slice (T = 300) match the explicit composition", function()
    check_causal_attention(6, 1, 2, 300, 8)
    check_causal_attention(9, 1, 2, 300, 40)
  end)

  -- products run on 16-wide panels of packed k^T, v, dO, q (k^T transposed in 8x8 blocks): T = 37 and
  -- D = 20 leave partial panels (37 = 2*16 + 5) and rows of k^T past the last 8x8 block (20 = 2*8 + 4)
  it("head widths and lengths off the 16-wide panels and 8x8 blocks match the explicit composition", function()
    check_causal_attention(7, 2, 3, 37, 20)
    check_causal_attention(8, 1, 2, 48, 12)
  end)

  -- without the causal limits, products of 2M multiply-adds and more run through OpenBLAS
  it("large non-causal products (T = 300, D = 32: through OpenBLAS) match a one-thread run of small ones", function()
    fsdp.manual_seed(8)
    local q0, k0, v0 = fsdp.randn(1, 2, 300, 32), fsdp.randn(1, 2, 300, 32), fsdp.randn(1, 2, 300, 32)
    local gout = fsdp.randn(1, 2, 300, 32)
    local function run()
      local q, k, v = q0:clone():requires_grad_(), k0:clone():requires_grad_(), v0:clone():requires_grad_()
      local out = F.scaled_dot_product_attention(q, k, v)
      out:backward(gout)
      return out, q.grad, k.grad, v.grad
    end
    local function explicit()
      local q, k, v = q0:clone():requires_grad_(), k0:clone():requires_grad_(), v0:clone():requires_grad_()
      local out = (q:matmul(k:transpose(3, 4)) * (1 / math.sqrt(32))):softmax(-1):matmul(v)
      out:backward(gout)
      return out, q.grad, k.grad, v.grad
    end
    local o2, dq2, dk2, dv2 = at_threads(2, run)
    local o1, dq1, dk1, dv1 = at_threads(1, explicit)
    H.assert_close(o2, o1, 1e-5, 1e-4, "out")
    H.assert_close(dq2, dq1, 1e-5, 1e-4, "dq")
    H.assert_close(dk2, dk1, 1e-5, 1e-4, "dk")
    H.assert_close(dv2, dv1, 1e-5, 1e-4, "dv")
  end)

  -- heads cut from one projection are read in place (row stride 3d), the output is stored as
  -- (B, T, H, D) so merging the heads back is a view, and the heads' gradients land in the
  -- projection's gradient through narrow. Compared with the same model on contiguous copies of
  -- the heads, on one thread.
  it("reads heads cut from a qkv projection in place and stores the output as (B, T, H, D)", function()
    local B, T, Hh, D = 2, 100, 3, 16
    local d = Hh * D
    fsdp.manual_seed(21)
    local x0, w0, gout = fsdp.randn(B, T, d), fsdp.randn(3 * d, d), fsdp.randn(B, T, d)
    local function run(in_place, causal)
      local x, w = x0:clone():requires_grad_(), w0:clone():requires_grad_()
      local qkv = F.linear(x, w) -- (B, T, 3d)
      local function head(i)
        local h = qkv:narrow(3, i * d + 1, d):reshape(B, T, Hh, D):transpose(2, 3)
        return in_place and h or h:contiguous()
      end
      local y = F.scaled_dot_product_attention(head(0), head(1), head(2), { causal = causal }):transpose(2, 3)
      if in_place then assert.is_true(y:is_contiguous(), "output not stored as (B, T, H, D)") end
      y = y:reshape(B, T, d)
      y:backward(gout)
      return y, x.grad, w.grad
    end
    for _, causal in ipairs({ true, false }) do
      local y2, dx2, dw2 = at_threads(2, function() return run(true, causal) end)
      local y1, dx1, dw1 = at_threads(1, function() return run(false, causal) end)
      H.assert_close(y2, y1, 1e-5, 1e-4, "out")
      H.assert_close(dx2, dx1, 1e-5, 1e-4, "dx")
      H.assert_close(dw2, dw1, 1e-5, 1e-4, "dw")
    end
  end)

  -- keys and values shared by all heads (expand: batch stride 0) are read in place; their
  -- gradients sum over the heads
  it("reads keys and values expanded over the heads in place", function()
    fsdp.manual_seed(22)
    local q0, k0, v0 = fsdp.randn(2, 4, 70, 8), fsdp.randn(2, 1, 70, 8), fsdp.randn(2, 1, 70, 8)
    local gout = fsdp.randn(2, 4, 70, 8)
    local function run(expanded)
      local q, k, v = q0:clone():requires_grad_(), k0:clone():requires_grad_(), v0:clone():requires_grad_()
      local ke, ve = k:expand(2, 4, 70, 8), v:expand(2, 4, 70, 8)
      if not expanded then ke, ve = ke:contiguous(), ve:contiguous() end
      local out = F.scaled_dot_product_attention(q, ke, ve, { causal = true })
      out:backward(gout)
      return out, q.grad, k.grad, v.grad
    end
    local o2, dq2, dk2, dv2 = at_threads(2, function() return run(true) end)
    local o1, dq1, dk1, dv1 = at_threads(1, function() return run(false) end)
    H.assert_close(o2, o1, 1e-5, 1e-4, "out")
    H.assert_close(dq2, dq1, 1e-5, 1e-4, "dq")
    H.assert_close(dk2, dk1, 1e-5, 1e-4, "dk")
    H.assert_close(dv2, dv1, 1e-5, 1e-4, "dv")
  end)

  it("passes a finite-difference check at 2 threads", function()
    fsdp.manual_seed(5)
    at_threads(2, function()
      local q = fsdp.randn(1, 2, 5, 4):requires_grad_()
      local k = fsdp.randn(1, 2, 5, 4):requires_grad_()
      local v = fsdp.randn(1, 2, 5, 4):requires_grad_()
      H.gradcheck(function(a, b, c) return F.scaled_dot_product_attention(a, b, c, { causal = true }) end, { q, k, v })
    end)
  end)
end)

describe("strided copies and memory-bound helpers at 2 threads", function()
  it("copy a (B, T, H, D) -> (B, H, T, D) permute and a narrow like one thread, element by element", function()
    fsdp.manual_seed(12)
    local x = fsdp.randn(3, 70, 4, 40) -- 33600 elements in runs of 40
    local flat = x:view(-1):tolist()
    local y = at_threads(2, function() return x:permute(1, 3, 2, 4):contiguous() end)
    local got = y:view(-1):tolist()
    for b = 0, 2 do for h = 0, 3 do for t = 0, 69, 3 do for d = 0, 39, 3 do
      assert.are.equal(flat[((b * 70 + t) * 4 + h) * 40 + d + 1], got[((b * 4 + h) * 70 + t) * 40 + d + 1])
    end end end end
    local w = fsdp.randn(300, 300) -- a (300, 150) narrow: 45000 elements in runs of 150
    local wl = w:tolist()
    local n = at_threads(2, function() return w:narrow(2, 101, 150):contiguous() end):tolist()
    for i = 1, 300, 11 do for j = 1, 150, 7 do assert.are.equal(wl[(i - 1) * 300 + j + 100], n[(i - 1) * 150 + j]) end end
  end)

  it("accumulate gradients and fill zeros like one thread", function()
    fsdp.manual_seed(13)
    local a0 = fsdp.randn(300, 200)
    local function run()
      local a = a0:clone():requires_grad_()
      local y = a * 2 + a:exp() -- a used twice: the two gradients are added (axpy)
      y:backward(fsdp.ones(300, 200))
      return a.grad, fsdp.zeros(300, 200):sum():item()
    end
    local g2, z2 = at_threads(2, run)
    local g1, z1 = at_threads(1, run)
    H.assert_close(g2, g1, 0, 0, "grad")
    H.assert_close(g2, a0:exp() + 2, 1e-6, 1e-6, "grad value")
    assert.are.equal(0, z2)
    assert.are.equal(0, z1)
  end)
end)

describe("conv2d backward in image chunks at 2 threads", function()
  it("matches one thread and is the same from run to run", function()
    fsdp.manual_seed(11)
    local x0, w0, b0 = fsdp.randn(10, 3, 12, 12), fsdp.randn(8, 3, 3, 3), fsdp.randn(8)
    local gy = fsdp.randn(10, 8, 12, 12)
    local function run()
      local x, w, b = x0:clone():requires_grad_(), w0:clone():requires_grad_(), b0:clone():requires_grad_()
      local y = F.conv2d(x, w, b, { padding = 1 })
      y:backward(gy)
      return y, x.grad, w.grad, b.grad
    end
    local y2, gx2, gw2, gb2 = at_threads(2, run)
    local _, _, gw2b, gb2b = at_threads(2, run)
    local y1, gx1, gw1, gb1 = at_threads(1, run)
    H.assert_close(y2, y1, 0, 0, "y")
    H.assert_close(gx2, gx1, 0, 0, "grad x")
    H.assert_close(gw2, gw1, 1e-4, 1e-5, "grad w")
    H.assert_close(gb2, gb1, 1e-4, 1e-5, "grad b")
    H.assert_close(gw2b, gw2, 0, 0, "grad w, second run")
    H.assert_close(gb2b, gb2, 0, 0, "grad b, second run")
    -- the bias gradient against a loop: the sum of gy over (n, h, w) per channel
    local fg, rb = gy:tolist(), {}
    for o = 0, 7 do
      local s = 0
      for n = 0, 9 do for p = 1, 144 do s = s + fg[(n * 8 + o) * 144 + p] end end
      rb[o + 1] = s
    end
    H.assert_close(gb2, rb, 1e-4, 1e-5, "grad b vs loop")
  end)
end)

describe("our Winograd F(2x2, 3x3) at 2 threads", function()
  -- backend/cpu/linalg.c: tiles in blocks (wino_split_tiles: 605 tiles of 21x21 planes, 5 images, are 7 blocks of
  -- 96, the last ragged), the packed kernels built by both threads, the weight gradient summed over 4 chunks
  it("matches im2col and one thread, and is the same from run to run", function()
    fsdp.manual_seed(12)
    local x0, w0, b0 = fsdp.randn(5, 64, 21, 21), fsdp.randn(48, 64, 3, 3), fsdp.randn(48)
    local gy = fsdp.randn(5, 48, 21, 21)
    local function run(algo)
      H.setenv("FSDP_CONV_ALGO", algo)
      local x, w, b = x0:clone():requires_grad_(), w0:clone():requires_grad_(), b0:clone():requires_grad_()
      local y = F.conv2d(x, w, b, { padding = 1 })
      y:backward(gy)
      H.setenv("FSDP_CONV_ALGO", nil)
      return { y = y, x = x.grad, w = w.grad, b = b.grad }
    end
    local two = at_threads(2, function() return run("winograd") end)
    local again = at_threads(2, function() return run("winograd") end)
    local one = at_threads(1, function() return run("winograd") end)
    local ref = at_threads(2, function() return run("im2col") end)
    for _, k in ipairs { "y", "x", "w", "b" } do
      H.assert_rel(two[k], ref[k], 1e-5, k .. " against im2col")
      H.assert_rel(two[k], one[k], 1e-5, k .. " against one thread")
      H.assert_close(again[k], two[k], 0, 0, k .. ", second run")
    end
  end)
end)

describe("conv2d stride-1 'same' fast path (im2col / col2im as one shifted run)", function()
  -- naive y[n, o, oh, ow] = b[o] + sum_{c, i, j} x[n, c, oh - p + i*d, ow - p + j*d] w[o, c, i, j]
  local function ref_conv(x, w, b, N, C, Hh, W, O, k, p, d)
    local y = {}
    for n = 0, N - 1 do for o = 0, O - 1 do for oh = 0, Hh - 1 do for ow = 0, W - 1 do
      local s = b[o + 1]
      for c = 0, C - 1 do for i = 0, k - 1 do for j = 0, k - 1 do
        local ih, iw = oh - p + i * d, ow - p + j * d
        if ih >= 0 and ih < Hh and iw >= 0 and iw < W then
          s = s + x[((n * C + c) * Hh + ih) * W + iw + 1] * w[((o * C + c) * k + i) * k + j + 1]
        end
      end end end
      y[#y + 1] = s
    end end end end
    return y
  end
  for _, case in ipairs { { k = 3, p = 1, d = 1 }, { k = 3, p = 2, d = 2 }, { k = 5, p = 2, d = 1 } } do
    it(("kernel %d, padding %d, dilation %d: forward and gradients match loops"):format(case.k, case.p, case.d), function()
      fsdp.manual_seed(13)
      local N, C, Hh, W, O = 2, 3, 7, 9, 4
      local x = fsdp.randn(N, C, Hh, W):requires_grad_()
      local w = fsdp.randn(O, C, case.k, case.k):requires_grad_()
      local b = fsdp.randn(O)
      local y = F.conv2d(x, w, b, { padding = case.p, dilation = case.d })
      local fx, fw, fb = x:tolist(), w:tolist(), b:tolist()
      H.assert_close(y, ref_conv(fx, fw, fb, N, C, Hh, W, O, case.k, case.p, case.d), 1e-4, 1e-5, "y")
      -- gradients of sum(y * r): by linearity, finite differences of the reference are exact
      local r = fsdp.randn(N, O, Hh, W)
      y:backward(r)
      local fr, zero = r:tolist(), {}
      for o = 1, O do zero[o] = 0 end
      local function dot(xx, ww)
        local yy, s = ref_conv(xx, ww, zero, N, C, Hh, W, O, case.k, case.p, case.d), 0
        for i = 1, #yy do s = s + yy[i] * fr[i] end
        return s
      end
      local gx, gw = x.grad:tolist(), w.grad:tolist()
      for _, i in ipairs { 1, 8, 40, 63, 100, #fx } do -- d/dx_i sum = dot(e_i, w)
        local e = {}
        for q = 1, #fx do e[q] = q == i and 1 or 0 end
        H.assert_close(gx[i], dot(e, fw), 1e-4, 1e-5, "grad x[" .. i .. "]")
      end
      for _, i in ipairs { 1, 5, 17, #fw } do
        local e = {}
        for q = 1, #fw do e[q] = q == i and 1 or 0 end
        H.assert_close(gw[i], dot(fx, e), 1e-4, 1e-5, "grad w[" .. i .. "]")
      end
    end)
  end
end)

describe("vectorized loops", function()
  it("exp, tanh, sigmoid and gelu over 50000 elements match Lua's math", function()
    fsdp.manual_seed(2)
    at_threads(2, function()
      local x = fsdp.randn(50000) * 3
      local fx = x:tolist()
      local function check(got, f, what)
        local g, ref = got:tolist(), {}
        for i = 1, #fx do ref[i] = f(fx[i]) end
        H.assert_close(g, ref, 1e-6, 2e-6, what)
      end
      check(x:exp(), math.exp, "exp")
      check(x:tanh(), function(v) return math.tanh and math.tanh(v) or (math.exp(2 * v) - 1) / (math.exp(2 * v) + 1) end, "tanh")
      check(x:sigmoid(), function(v) return 1 / (1 + math.exp(-v)) end, "sigmoid")
      -- erf by its Taylor series (|x| < 3 / sqrt 2 ... keep to the range where 60 terms converge)
      local function erf(z)
        local s, t, n = 0, z, 0
        repeat
          s = s + t / (2 * n + 1)
          n = n + 1
          t = -t * z * z / n
        until n > 80
        return 2 / math.sqrt(math.pi) * s
      end
      local small = (fsdp.randn(20000) * 1.5)
      local fs, ref = small:tolist(), {}
      for i = 1, #fs do ref[i] = 0.5 * fs[i] * (1 + erf(fs[i] / math.sqrt(2))) end
      H.assert_close(small:gelu(), ref, 2e-6, 2e-6, "gelu")
    end)
  end)

  it("global average pooling matches the mean over each plane", function()
    fsdp.manual_seed(4)
    at_threads(2, function()
      local x = fsdp.randn(16, 24, 28, 28)
      local got = F.adaptive_avg_pool2d(x, 1):view(16 * 24):tolist()
      local fx = x:tolist()
      for pl = 0, 16 * 24 - 1, 37 do
        local s = 0
        for i = 1, 784 do s = s + fx[pl * 784 + i] end
        H.assert_close(got[pl + 1], s / 784, 1e-6, 1e-5, "plane " .. pl)
      end
      local parts = F.adaptive_avg_pool2d(x, 2):tolist() -- 2x2 windows of 14x14: whole-row and partial runs
      local s = 0
      for h = 0, 13 do for w = 14, 27 do s = s + fx[h * 28 + w + 1] end end
      H.assert_close(parts[2], s / 196, 1e-6, 1e-5, "window (0, 1) of plane 0")
    end)
  end)
end)

describe("bad input after the fast paths", function()
  it("raises errors naming the op and shapes, and keeps working", function()
    at_threads(2, function()
      local x, w = fsdp.randn(300, 70), fsdp.randn(90, 71)
      H.assert_error(function() return F.linear(x, w) end, "linear", "(300, 70)", "(90, 71)")
      H.assert_error(function() return x:matmul(fsdp.randn(69, 5)) end, "matmul", "(300, 70)", "(69, 5)")
      local q = fsdp.randn(2, 8, 4)
      H.assert_error(function() return F.scaled_dot_product_attention(q, fsdp.randn(2, 8, 5), q) end,
        "scaled_dot_product_attention", "(2, 8, 4)", "(2, 8, 5)")
      local a, b = fsdp.randn(300, 70), fsdp.randn(70, 100)
      H.assert_close(a:matmul(b), ref_mm(a:tolist(), b:tolist(), 300, 70, 100), 1e-4, 1e-5, "after errors")
    end)
  end)
end)
