-- Neural-network ops (src/ops_nn.c): softmax, log_softmax, cross_entropy, nll_loss, mse_loss,
-- layer_norm, embedding, dropout, scaled_dot_product_attention. Forward values against plain Lua
-- loops and hand-computed numbers, backward against finite differences, bad input as Lua errors.
-- The ops are called through the C API (fsdp.C) so this spec does not depend on fsdp.nn.functional.
local fsdp = require "fsdp"
local H = require "helpers"

local C, wrap = fsdp.C, fsdp._wrap
local NONE = -100  -- PyTorch's default ignore_index

-- ---- thin callers -------------------------------------------------------------------------------
local function softmax(x, d) return wrap(C.fsdp_softmax(x.p, fsdp._dim(d, math.max(x:dim(), 1)))) end
local function log_softmax(x, d) return wrap(C.fsdp_log_softmax(x.p, fsdp._dim(d, math.max(x:dim(), 1)))) end
local function cross_entropy(x, t, ignore, smoothing)
  return wrap(C.fsdp_cross_entropy(x.p, t.p, ignore or NONE, smoothing or 0))
end
local function nll_loss(x, t, ignore) return wrap(C.fsdp_nll_loss(x.p, t.p, ignore or NONE)) end
local function mse_loss(a, b) return wrap(C.fsdp_mse_loss(a.p, b.p)) end
local function layer_norm(x, k, w, b, eps) return wrap(C.fsdp_layer_norm(x.p, k, fsdp._p(w), fsdp._p(b), eps or 1e-5)) end
local function embedding(w, idx, pad) return wrap(C.fsdp_embedding(w.p, idx.p, pad or -1)) end
local function dropout(x, p, training) return wrap(C.fsdp_dropout(x.p, p, training == false and 0 or 1)) end
local function sdpa(q, k, v, o)
  o = o or {}
  return wrap(C.fsdp_scaled_dot_product_attention(q.p, k.p, v.p, fsdp._p(o.mask), o.causal and 1 or 0, o.dropout_p or 0,
    o.scale or 0))
end

-- ---- plain Lua references -----------------------------------------------------------------------
local function strides_of(shape)
  local st, s = {}, 1
  for i = #shape, 1, -1 do st[i] = s; s = s * shape[i] end
  return st
end

-- softmax (or log_softmax) over 1-based dim d of a flat row-major list
local function ref_softmax(flat, shape, d, log)
  local st = strides_of(shape)
  local n, step = shape[d], st[d]
  local out = {}
  for base = 0, #flat - 1 do
    -- the first element of each slice along d has index 0 along d
    if math.floor(base / step) % n == 0 then
      local mx = -math.huge
      for c = 0, n - 1 do mx = math.max(mx, flat[base + c * step + 1]) end
      local s = 0
      for c = 0, n - 1 do s = s + math.exp(flat[base + c * step + 1] - mx) end
      for c = 0, n - 1 do
        local i = base + c * step + 1
        out[i] = log and (flat[i] - mx - math.log(s)) or math.exp(flat[i] - mx) / s
      end
    end
  end
  return out
end

-- cross entropy (N, C, S...) with label smoothing, straight from PyTorch's formula
local function ref_cross_entropy(x, t, ignore, eps)
  local shape, xf, tf = x:shape(), x:tolist(), t:tolist()
  local N, Cn = shape[1], shape[2] or shape[1]
  if #shape == 1 then N = 1 end
  local S = 1
  for i = 3, #shape do S = S * shape[i] end
  local total, count = 0, 0
  for n = 0, N - 1 do
    for s = 0, S - 1 do
      local tgt = tf[n * S + s + 1]
      if tgt ~= ignore then
        local mx = -math.huge
        for c = 0, Cn - 1 do mx = math.max(mx, xf[(n * Cn + c) * S + s + 1]) end
        local se = 0
        for c = 0, Cn - 1 do se = se + math.exp(xf[(n * Cn + c) * S + s + 1] - mx) end
        local lse = mx + math.log(se)
        local nll = lse - xf[(n * Cn + tgt) * S + s + 1]
        local smooth = 0
        for c = 0, Cn - 1 do smooth = smooth + (lse - xf[(n * Cn + c) * S + s + 1]) end
        total = total + (1 - eps) * nll + eps / Cn * smooth
        count = count + 1
      end
    end
  end
  return total / count
end

-- attention on flat lists: q (B, Tq, D), k (B, Tk, D), v (B, Tk, Dv); mask(b, i, j) or nil
local function ref_attention(q, k, v, B, Tq, Tk, D, Dv, scale, causal, maskfn)
  local out = {}
  for b = 0, B - 1 do
    for i = 0, Tq - 1 do
      local s, mx = {}, -math.huge
      for j = 0, Tk - 1 do
        local dot = 0
        for d = 0, D - 1 do dot = dot + q[(b * Tq + i) * D + d + 1] * k[(b * Tk + j) * D + d + 1] end
        s[j] = dot * scale + (maskfn and maskfn(b, i, j) or 0)
        if causal and j > i then s[j] = -math.huge end
        mx = math.max(mx, s[j])
      end
      local z = 0
      for j = 0, Tk - 1 do s[j] = math.exp(s[j] - mx); z = z + s[j] end
      for e = 0, Dv - 1 do
        local acc = 0
        for j = 0, Tk - 1 do acc = acc + s[j] / z * v[(b * Tk + j) * Dv + e + 1] end
        out[(b * Tq + i) * Dv + e + 1] = acc
      end
    end
  end
  return out
end

local function leaf(t) t.requires_grad = true; return t end

-- after an error the library must keep working: a fresh op gives the right value
local function still_works()
  local y = softmax(fsdp.tensor({ { 0, 0 } }), -1)
  H.assert_close(y, { 0.5, 0.5 }, 1e-7, 0)
end

-- ==================================================================================================
describe("softmax and log_softmax", function()
  it("match a Lua reference along every dim, rows sum to 1", function()
    fsdp.manual_seed(1)
    local x = fsdp.randn({ 3, 4, 5 }) * 3
    local shape, flat = x:shape(), x:tolist()
    for _, d in ipairs({ 1, 2, 3, -1, -2 }) do
      local dd = d < 0 and d + 4 or d
      H.assert_close(softmax(x, d), ref_softmax(flat, shape, dd, false), 1e-6, 1e-5, "softmax dim " .. d)
      H.assert_close(log_softmax(x, d), ref_softmax(flat, shape, dd, true), 1e-5, 1e-5, "log_softmax dim " .. d)
    end
    -- rows of the last dim sum to 1
    local y = softmax(x, -1):totable()
    for a = 1, 3 do for b = 1, 4 do
      local s = 0
      for c = 1, 5 do s = s + y[a][b][c] end
      assert.is_true(math.abs(s - 1) < 1e-6)
    end end
  end)

  it("handle strided dims wider than one tile, long rows and non-contiguous inputs", function()
    fsdp.manual_seed(2)
    local x = fsdp.randn({ 2, 3, 70 })  -- dim 2: inner = 70 > the 64-column tile
    H.assert_close(softmax(x, 2), ref_softmax(x:tolist(), { 2, 3, 70 }, 2, false), 1e-6, 1e-5)
    H.assert_close(log_softmax(x, 2), ref_softmax(x:tolist(), { 2, 3, 70 }, 2, true), 1e-5, 1e-5)
    local big = fsdp.randn({ 40, 1000 }) * 4  -- > 32768 elements: the OpenMP path
    H.assert_close(softmax(big, -1), ref_softmax(big:tolist(), { 40, 1000 }, 2, false), 1e-6, 1e-4)
    H.assert_close(log_softmax(big, 1), ref_softmax(big:tolist(), { 40, 1000 }, 1, true), 1e-4, 1e-5)
    local xt = x:transpose(2, 3)  -- (2, 70, 3), not contiguous
    assert.is_false(xt:is_contiguous())
    H.assert_close(softmax(xt, -1), ref_softmax(xt:contiguous():tolist(), { 2, 70, 3 }, 3, false), 1e-6, 1e-5)
  end)

  it("are numerically stable for large logits and exact on -inf", function()
    local x = fsdp.tensor({ { 1000, 1001, 1002 }, { -1000, -1001, -1002 } })
    local e = { 0.09003057, 0.24472847, 0.66524096 }
    H.assert_close(softmax(x, -1), { e[1], e[2], e[3], e[3], e[2], e[1] }, 1e-6, 1e-5)
    H.assert_close(log_softmax(x, -1), { -2.40760596, -1.40760596, -0.40760596, -0.40760596, -1.40760596,
      -2.40760596 }, 1e-4, 0)
    local m = fsdp.tensor({ { 0, -math.huge, 0 } })
    assert.same({ 0.5, 0, 0.5 }, softmax(m, -1):tolist())
    local l = log_softmax(m, -1):tolist()
    assert.is_true(l[2] == -math.huge)
    H.assert_close({ l[1], l[3] }, { -math.log(2), -math.log(2) }, 1e-6, 0)
    -- 0-dim input: softmax of one element
    assert.equal(1, softmax(fsdp.tensor(3.0), -1):item())
  end)

  it("backward matches finite differences along inner and outer dims", function()
    fsdp.manual_seed(3)
    for _, d in ipairs({ 1, 2, -1 }) do
      local x = leaf(fsdp.randn({ 3, 4, 2 }))
      H.gradcheck(function(a) return softmax(a, d) end, { x })
      local y = leaf(fsdp.randn({ 3, 4, 2 }))
      H.gradcheck(function(a) return log_softmax(a, d) end, { y })
    end
    assert.equal("SoftmaxBackward", softmax(leaf(fsdp.randn({ 2, 2 })), 1).grad_fn)
    assert.equal("LogSoftmaxBackward", log_softmax(leaf(fsdp.randn({ 2, 2 })), 1).grad_fn)
  end)

  it("reject bad dims and int64 input, then keep working", function()
    H.assert_error(function() softmax(fsdp.randn({ 2, 3 }), 3) end, "softmax", "dimension")
    H.assert_error(function() log_softmax(fsdp.tensor({ 1, 2 }, "int64"), 1) end, "log_softmax", "int64", "(2)")
    still_works()
  end)
end)

-- ==================================================================================================
describe("cross_entropy", function()
  local logits = { { 1, 2, 3 }, { 1, 1, 1 } }

  it("matches hand-computed values, with ignore_index and label smoothing", function()
    -- row 1: logsumexp(1, 2, 3) = 3.40760596, loss 0.40760596; row 2: log(3) = 1.09861229
    local x = fsdp.tensor(logits)
    H.assert_close(cross_entropy(x, fsdp.tensor({ 2, 0 }, "int64")), { (0.40760596 + 1.09861229) / 2 }, 1e-6, 0)
    H.assert_close(cross_entropy(x, fsdp.tensor({ 2, -100 }, "int64")), { 0.40760596 }, 1e-6, 0)
    H.assert_close(cross_entropy(x, fsdp.tensor({ 2, 0 }, "int64"), 0), { 0.40760596 }, 1e-6, 0)  -- ignore_index 0
    -- smoothing 0.1: loss = lse - 0.9 x_t - 0.1/3 sum x: row 1 0.50760596, row 2 1.09861229
    H.assert_close(cross_entropy(x, fsdp.tensor({ 2, 0 }, "int64"), NONE, 0.1), { (0.50760596 + 1.09861229) / 2 },
      1e-6, 0)
    H.assert_close(cross_entropy(x, fsdp.tensor({ 2, 0 }, "int64"), 0, 0.1), { 0.50760596 }, 1e-6, 0)
    -- every target ignored: 0 / 0 = nan, as PyTorch
    local l = cross_entropy(x, fsdp.tensor({ -100, -100 }, "int64")):item()
    assert.is_true(l ~= l)
    -- unbatched: logits (C), target ()
    H.assert_close(cross_entropy(fsdp.tensor({ 1, 2, 3 }), fsdp.tensor(2, "int64")), { 0.40760596 }, 1e-6, 0)
    assert.same({}, cross_entropy(x, fsdp.tensor({ 2, 0 }, "int64")):shape())
  end)

  it("matches a Lua reference for (N, C, d1, d2) inputs and wide class counts", function()
    fsdp.manual_seed(4)
    local x = fsdp.randn({ 3, 5, 2, 4 }) * 2
    local t = fsdp.randint(0, 5, { 3, 2, 4 })
    local tl = t:tolist()
    tl[3], tl[10] = -100, -100
    t = fsdp.tensor(tl, "int64"):view(3, 2, 4)
    for _, eps in ipairs({ 0, 0.2 }) do
      H.assert_close(cross_entropy(x, t, NONE, eps), { ref_cross_entropy(x, t, NONE, eps) }, 1e-5, 1e-5)
    end
    local big = fsdp.randn({ 64, 1000 })  -- the OpenMP path
    local bt = fsdp.randint(0, 1000, { 64 })
    H.assert_close(cross_entropy(big, bt, NONE, 0.1), { ref_cross_entropy(big, bt, NONE, 0.1) }, 1e-5, 1e-5)
    -- strided class dim wider than one tile (S = 70)
    local wide = fsdp.randn({ 2, 3, 70 })
    local wt = fsdp.randint(0, 3, { 2, 70 })
    H.assert_close(cross_entropy(wide, wt, NONE, 0.3), { ref_cross_entropy(wide, wt, NONE, 0.3) }, 1e-5, 1e-5)
    -- a non-contiguous target
    local t2 = fsdp.randint(0, 5, { 4, 3 })
    local x2 = fsdp.randn({ 3, 5, 4 })
    H.assert_close(cross_entropy(x2, t2:transpose(1, 2)), { ref_cross_entropy(x2, t2:transpose(1, 2):contiguous(), NONE, 0) },
      1e-5, 1e-5)
  end)

  it("equals log_softmax followed by nll_loss", function()
    fsdp.manual_seed(5)
    local x = fsdp.randn({ 6, 4 })
    local t = fsdp.tensor({ 0, 3, -100, 1, 2, 3 }, "int64")
    H.assert_close(cross_entropy(x, t), nll_loss(log_softmax(x, 2), t), 1e-6, 1e-6)
  end)

  it("backward matches finite differences (ignore_index, smoothing, extra dims)", function()
    fsdp.manual_seed(6)
    local x = leaf(fsdp.randn({ 4, 3 }))
    local t = fsdp.tensor({ 0, 2, -100, 1 }, "int64")
    H.gradcheck(function(a) return cross_entropy(a, t) end, { x })
    H.gradcheck(function(a) return cross_entropy(a, t, NONE, 0.25) end, { x })
    local x3 = leaf(fsdp.randn({ 2, 3, 2, 2 }))
    local t3 = fsdp.tensor({ { { 0, 1 }, { 2, 1 } }, { { 1, -100 }, { 0, 2 } } }, "int64")
    H.gradcheck(function(a) return cross_entropy(a, t3, NONE, 0.1) end, { x3 })
    -- the analytic gradient: (softmax - onehot) / count, zero on ignored rows
    local y = leaf(fsdp.tensor(logits))
    cross_entropy(y, fsdp.tensor({ 2, -100 }, "int64")):backward()
    H.assert_close(y.grad, { 0.09003057, 0.24472847, 0.66524096 - 1, 0, 0, 0 }, 1e-6, 0)
    assert.equal("CrossEntropyBackward", cross_entropy(y, fsdp.tensor({ 0, 1 }, "int64")).grad_fn)
  end)

  it("reports bad targets and shapes as errors naming the op, then keeps working", function()
    local x = fsdp.randn({ 2, 5 })
    local err = H.assert_error(function() cross_entropy(x, fsdp.tensor({ 1, 7 }, "int64")) end, "cross_entropy",
      "7", "5 classes", "(2, 5)")
    still_works()
    H.assert_error(function() cross_entropy(x, fsdp.tensor({ -1, 0 }, "int64")) end, "cross_entropy", "-1")
    H.assert_error(function() cross_entropy(x, fsdp.tensor({ 1, 0 })) end, "cross_entropy", "int64", "float32", "(2)")
    H.assert_error(function() cross_entropy(x, fsdp.tensor({ 1, 0, 2 }, "int64")) end, "cross_entropy", "(3)",
      "(2, 5)")
    H.assert_error(function() cross_entropy(fsdp.randn({ 2, 5, 3 }), fsdp.tensor({ 1, 0 }, "int64")) end,
      "cross_entropy", "(2, 5, 3)", "(2, 3)")
    H.assert_error(function() cross_entropy(x, fsdp.tensor({ 1, 0 }, "int64"), NONE, 1.5) end, "label_smoothing")
    H.assert_error(function() cross_entropy(x:long(), fsdp.tensor({ 1, 0 }, "int64")) end, "cross_entropy", "int64")
    assert.is_string(err)
    still_works()
    H.assert_close(cross_entropy(fsdp.tensor(logits), fsdp.tensor({ 2, -100 }, "int64")), { 0.40760596 }, 1e-6, 0)
  end)
end)

-- ==================================================================================================
describe("nll_loss and mse_loss", function()
  it("nll_loss: mean of -logp at the targets over non-ignored targets", function()
    local lp = fsdp.tensor({ { -1, -2, -3 }, { -0.5, -0.25, -4 }, { -9, -9, -9 } })
    H.assert_close(nll_loss(lp, fsdp.tensor({ 2, 0, -100 }, "int64")), { (3 + 0.5) / 2 }, 1e-7, 0)
    local l = nll_loss(lp, fsdp.tensor({ 1, 1, 1 }, "int64"), 1):item()  -- all ignored: nan
    assert.is_true(l ~= l)
  end)

  it("nll_loss: extra dims, backward and errors", function()
    fsdp.manual_seed(7)
    local x = leaf(fsdp.randn({ 2, 3, 4 }))
    local t = fsdp.tensor({ { 0, 1, 2, -100 }, { 2, 2, 1, 0 } }, "int64")
    local xl, tl, s, cnt = x:tolist(), t:tolist(), 0, 0
    for n = 0, 1 do for j = 0, 3 do
      local c = tl[n * 4 + j + 1]
      if c ~= -100 then s = s - xl[(n * 3 + c) * 4 + j + 1]; cnt = cnt + 1 end
    end end
    H.assert_close(nll_loss(x, t), { s / cnt }, 1e-6, 1e-6)
    H.gradcheck(function(a) return nll_loss(a, t) end, { x })
    H.assert_error(function() nll_loss(fsdp.randn({ 2, 3 }), fsdp.tensor({ 0, 3 }, "int64")) end, "nll_loss", "3",
      "3 classes")
    H.assert_error(function() nll_loss(fsdp.randn({ 2, 3 }), fsdp.tensor({ 0.0, 1.0 })) end, "nll_loss", "int64")
    still_works()
  end)

  it("mse_loss: mean squared error, both gradients", function()
    H.assert_close(mse_loss(fsdp.tensor({ 1, 2, 3 }), fsdp.tensor({ 1, 4, 0 })), { 13 / 3 }, 1e-6, 0)
    fsdp.manual_seed(8)
    local a, b = leaf(fsdp.randn({ 3, 4 })), leaf(fsdp.randn({ 3, 4 }))
    H.gradcheck(mse_loss, { a, b })
    local p, q = leaf(fsdp.tensor({ 1, 2 })), fsdp.tensor({ 0, 4 })
    mse_loss(p, q):backward()
    H.assert_close(p.grad, { 1, -2 }, 1e-7, 0)  -- 2 (p - q) / n
    local big = fsdp.randn({ 300, 200 })
    local z = fsdp.zeros({ 300, 200 })
    local s = 0
    for _, v in ipairs(big:tolist()) do s = s + v * v end
    H.assert_close(mse_loss(big, z), { s / 60000 }, 1e-6, 1e-6)
    H.assert_error(function() mse_loss(fsdp.randn({ 2, 3 }), fsdp.randn({ 3, 2 })) end, "mse_loss", "(2, 3)", "(3, 2)")
    H.assert_error(function() mse_loss(fsdp.randn({ 2 }), fsdp.tensor({ 1, 2 }, "int64")) end, "mse_loss", "int64")
    still_works()
  end)
end)

-- ==================================================================================================
describe("layer_norm", function()
  local function ref_ln(x, k, w, b, eps)
    local shape, xf = x:shape(), x:tolist()
    local D = 1
    for i = #shape - k + 1, #shape do D = D * shape[i] end
    local wf, bf = w and w:tolist(), b and b:tolist()
    local out = {}
    for m = 0, #xf / D - 1 do
      local mu, var = 0, 0
      for d = 1, D do mu = mu + xf[m * D + d] end
      mu = mu / D
      for d = 1, D do var = var + (xf[m * D + d] - mu) ^ 2 end
      var = var / D
      for d = 1, D do
        out[m * D + d] = (xf[m * D + d] - mu) / math.sqrt(var + eps) * (wf and wf[d] or 1) + (bf and bf[d] or 0)
      end
    end
    return out
  end

  it("matches a Lua loop with and without affine parameters", function()
    fsdp.manual_seed(9)
    local x = fsdp.randn({ 2, 3, 4 }) * 2 + 1
    local w, b = fsdp.randn({ 4 }), fsdp.randn({ 4 })
    H.assert_close(layer_norm(x, 1, w, b), ref_ln(x, 1, w, b, 1e-5), 1e-5, 1e-5)
    H.assert_close(layer_norm(x, 1, nil, nil), ref_ln(x, 1, nil, nil, 1e-5), 1e-5, 1e-5)
    H.assert_close(layer_norm(x, 1, w, nil), ref_ln(x, 1, w, nil, 1e-5), 1e-5, 1e-5)
    H.assert_close(layer_norm(x, 1, nil, b, 0.5), ref_ln(x, 1, nil, b, 0.5), 1e-5, 1e-5)
    local w2, b2 = fsdp.randn({ 3, 4 }), fsdp.randn({ 3, 4 })
    H.assert_close(layer_norm(x, 2, w2, b2), ref_ln(x, 2, w2, b2, 1e-5), 1e-5, 1e-5)
    -- hand-computed: (1, 2, 3) -> mean 2, var 2/3
    local r = 1 / math.sqrt(2 / 3 + 1e-5)
    H.assert_close(layer_norm(fsdp.tensor({ { 1, 2, 3 } }), 1, nil, nil), { -r, 0, r }, 1e-6, 0)
    -- big enough for the parallel paths, non-contiguous input
    local big = fsdp.randn({ 1024, 48 }):transpose(1, 2)  -- (48, 1024)
    local bw, bb = fsdp.randn({ 1024 }), fsdp.randn({ 1024 })
    H.assert_close(layer_norm(big, 1, bw, bb), ref_ln(big:contiguous(), 1, bw, bb, 1e-5), 1e-4, 1e-4)
  end)

  it("backward for x, weight and bias matches finite differences", function()
    fsdp.manual_seed(10)
    local x, w, b = leaf(fsdp.randn({ 3, 5 })), leaf(fsdp.randn({ 5 })), leaf(fsdp.randn({ 5 }))
    H.gradcheck(function(a, ww, bb) return layer_norm(a, 1, ww, bb) end, { x, w, b })
    local x2, w2 = leaf(fsdp.randn({ 2, 2, 3 })), leaf(fsdp.randn({ 2, 3 }))
    H.gradcheck(function(a, ww) return layer_norm(a, 2, ww, nil) end, { x2, w2 })
    local x3 = leaf(fsdp.randn({ 4, 3 }))
    H.gradcheck(function(a) return layer_norm(a, 1, nil, nil) end, { x3 })
    -- frozen affine parameters: only x gets a gradient
    local x4, wf = leaf(fsdp.randn({ 2, 3 })), fsdp.randn({ 3 })
    H.gradcheck(function(a) return layer_norm(a, 1, wf, nil) end, { x4 })
    assert.is_nil(wf.grad)
  end)

  it("parallel backward (dx, dw, db) agrees with the formula on a large input", function()
    fsdp.manual_seed(11)
    local M, D = 96, 512
    local x, w, b = leaf(fsdp.randn({ M, D })), leaf(fsdp.randn({ D })), leaf(fsdp.randn({ D }))
    local g = fsdp.randn({ M, D })
    layer_norm(x, 1, w, b):backward(g)
    local xf, gf, wf = x:tolist(), g:tolist(), w:tolist()
    local dw, db, dx = {}, {}, {}
    for d = 1, D do dw[d], db[d] = 0, 0 end
    for m = 0, M - 1 do
      local mu, var = 0, 0
      for d = 1, D do mu = mu + xf[m * D + d] end
      mu = mu / D
      for d = 1, D do var = var + (xf[m * D + d] - mu) ^ 2 end
      local rs = 1 / math.sqrt(var / D + 1e-5)
      local sg, sgx = 0, 0
      for d = 1, D do
        local xh, gg = (xf[m * D + d] - mu) * rs, gf[m * D + d]
        dw[d] = dw[d] + gg * xh; db[d] = db[d] + gg
        sg = sg + gg * wf[d]; sgx = sgx + gg * wf[d] * xh
      end
      for d = 1, D do
        local xh = (xf[m * D + d] - mu) * rs
        dx[m * D + d] = rs * (gf[m * D + d] * wf[d] - sg / D - xh * sgx / D)
      end
    end
    H.assert_close(x.grad, dx, 1e-4, 1e-3, "dx")
    H.assert_close(w.grad, dw, 1e-3, 1e-4, "dw")
    H.assert_close(b.grad, db, 1e-3, 1e-4, "db")
  end)

  it("rejects mismatched affine shapes and bad normalized dims", function()
    local x = fsdp.randn({ 2, 4 })
    H.assert_error(function() layer_norm(x, 1, fsdp.randn({ 3 }), nil) end, "layer_norm", "weight", "(3)", "(4)",
      "(2, 4)")
    H.assert_error(function() layer_norm(x, 1, nil, fsdp.randn({ 2, 4 })) end, "layer_norm", "bias", "(2, 4)")
    H.assert_error(function() layer_norm(x, 3, nil, nil) end, "layer_norm", "3", "(2, 4)")
    H.assert_error(function() layer_norm(x:long(), 1, nil, nil) end, "layer_norm", "int64")
    still_works()
  end)
end)

-- ==================================================================================================
describe("embedding", function()
  it("gathers rows for an index of any shape", function()
    local w = fsdp.tensor({ { 0, 1 }, { 10, 11 }, { 20, 21 }, { 30, 31 } })
    local y = embedding(w, fsdp.tensor({ { 3, 0, 1 }, { 1, 1, 2 } }, "int64"))
    assert.same({ 2, 3, 2 }, y:shape())
    assert.same({ { { 30, 31 }, { 0, 1 }, { 10, 11 } }, { { 10, 11 }, { 10, 11 }, { 20, 21 } } }, y:totable())
    assert.same({ 2 }, embedding(w, fsdp.tensor(2, "int64")):shape())  -- 0-dim index -> (D)
    assert.same({ 20, 21 }, embedding(w, fsdp.tensor(2, "int64")):tolist())
    -- a non-contiguous weight
    local wt = fsdp.tensor({ { 0, 10, 20 }, { 1, 11, 21 } }):transpose(1, 2)
    assert.same({ { 20, 21 }, { 0, 1 } }, embedding(wt, fsdp.tensor({ 2, 0 }, "int64")):totable())
  end)

  it("backward accumulates repeated rows and skips padding_idx", function()
    local w = leaf(fsdp.zeros({ 4, 3 }))
    local idx = fsdp.tensor({ { 1, 2, 1 }, { 3, 1, 0 } }, "int64")
    local g = fsdp.tensor({ { { 1, 1, 1 }, { 2, 2, 2 }, { 3, 3, 3 } }, { { 4, 4, 4 }, { 5, 5, 5 }, { 6, 6, 6 } } })
    embedding(w, idx):backward(g)
    assert.same({ { 6, 6, 6 }, { 9, 9, 9 }, { 2, 2, 2 }, { 4, 4, 4 } }, w.grad:totable())
    local w2 = leaf(fsdp.zeros({ 4, 3 }))
    embedding(w2, idx, 1):backward(g)  -- row 1 is padding: no gradient
    assert.same({ { 6, 6, 6 }, { 0, 0, 0 }, { 2, 2, 2 }, { 4, 4, 4 } }, w2.grad:totable())
    fsdp.manual_seed(12)
    local w3 = leaf(fsdp.randn({ 5, 4 }))
    H.gradcheck(function(ww) return embedding(ww, idx) end, { w3 })  -- (padding rows deliberately get no grad)
    -- the parallel path: many indices into a wide table
    local V, D, n = 50, 256, 300
    local wb = leaf(fsdp.randn({ V, D }))
    local ib = fsdp.randint(0, V, { n })
    local gb = fsdp.randn({ n, D })
    embedding(wb, ib, 7):backward(gb)
    local il, gl, ref = ib:tolist(), gb:tolist(), {}
    for i = 1, V * D do ref[i] = 0 end
    for i = 0, n - 1 do
      if il[i + 1] ~= 7 then
        for d = 1, D do ref[il[i + 1] * D + d] = ref[il[i + 1] * D + d] + gl[i * D + d] end
      end
    end
    H.assert_close(wb.grad, ref, 1e-5, 1e-5)
  end)

  it("reports out-of-range and non-int64 indices", function()
    local w = fsdp.randn({ 4, 2 })
    H.assert_error(function() embedding(w, fsdp.tensor({ 1, 4 }, "int64")) end, "embedding", "4", "4 embeddings",
      "(4, 2)")
    H.assert_error(function() embedding(w, fsdp.tensor({ -1 }, "int64")) end, "embedding", "-1")
    H.assert_error(function() embedding(w, fsdp.tensor({ 1, 2 })) end, "embedding", "int64", "float32")
    H.assert_error(function() embedding(fsdp.randn({ 4 }), fsdp.tensor({ 1 }, "int64")) end, "embedding", "2-D", "(4)")
    H.assert_error(function() embedding(w, fsdp.tensor({ 1 }, "int64"), 4) end, "embedding", "padding_idx")
    H.assert_error(function() embedding(fsdp.randn({ 0, 2 }), fsdp.tensor({ 0 }, "int64")) end, "embedding", "0")
    still_works()
    assert.same({ 1, 2 }, embedding(w, fsdp.tensor({ 3 }, "int64")):shape())
  end)
end)

-- ==================================================================================================
describe("dropout", function()
  it("zeros about p of the elements and scales the rest by 1/(1-p)", function()
    fsdp.manual_seed(13)
    local n, p = 100000, 0.3
    local x = fsdp.rand({ n }) + 1  -- in [1, 2): never zero by itself
    local y = dropout(x, p)
    local xl, yl, zeros = x:tolist(), y:tolist(), 0
    for i = 1, n do
      if yl[i] == 0 then zeros = zeros + 1
      else assert(math.abs(yl[i] - xl[i] / (1 - p)) <= 1e-6 * yl[i], "survivor not scaled by 1/(1-p)") end
    end
    assert.is_true(math.abs(zeros / n - p) < 0.01, "fraction of zeros " .. zeros / n)
  end)

  it("is deterministic under manual_seed and differs between calls", function()
    local x = fsdp.ones({ 1000 })
    fsdp.manual_seed(42)
    local a = dropout(x, 0.5):tolist()
    local b = dropout(x, 0.5):tolist()
    fsdp.manual_seed(42)
    assert.same(a, dropout(x, 0.5):tolist())
    local same = 0
    for i = 1, 1000 do if a[i] == b[i] then same = same + 1 end end
    assert.is_true(same < 700, "consecutive masks should differ")
  end)

  it("is the identity in eval mode or with p = 0, and zeros with p = 1", function()
    local x = fsdp.randn({ 3, 4 })
    local e = dropout(x, 0.5, false)
    assert.is_true(e:data_ptr() == x:data_ptr())
    assert.same(x:tolist(), e:tolist())
    assert.same(x:tolist(), dropout(x, 0, true):tolist())
    assert.same({ 0, 0, 0, 0 }, dropout(fsdp.ones({ 4 }), 1):tolist())
  end)

  it("backward applies the same mask", function()
    fsdp.manual_seed(14)
    local x = leaf(fsdp.rand({ 200 }) + 1)
    local y = dropout(x, 0.4)
    y:backward(fsdp.ones({ 200 }))
    local yl, gl, xl = y:tolist(), x.grad:tolist(), x:tolist()
    for i = 1, 200 do
      H.assert_close({ gl[i] }, { yl[i] / xl[i] }, 1e-6, 1e-6)
    end
    local z = leaf(fsdp.randn({ 3, 5 }))
    H.gradcheck(function(a) fsdp.manual_seed(99); return dropout(a, 0.3) end, { z })
    assert.equal("DropoutBackward", dropout(z, 0.3).grad_fn)
  end)

  it("rejects p outside [0, 1]", function()
    H.assert_error(function() dropout(fsdp.ones({ 2 }), 1.5) end, "dropout", "1.5")
    H.assert_error(function() dropout(fsdp.ones({ 2 }), -0.1) end, "dropout")
    still_works()
  end)
end)

-- ==================================================================================================
describe("scaled_dot_product_attention", function()
  local function check(B, H_, Tq, Tk, D, Dv, opts, maskfn)
    local q, k, v = fsdp.randn({ B, H_, Tq, D }), fsdp.randn({ B, H_, Tk, D }), fsdp.randn({ B, H_, Tk, Dv })
    local o = sdpa(q, k, v, opts)
    assert.same({ B, H_, Tq, Dv }, o:shape())
    local scale = opts.scale or 1 / math.sqrt(D)
    local ref = ref_attention(q:tolist(), k:tolist(), v:tolist(), B * H_, Tq, Tk, D, Dv, scale, opts.causal, maskfn)
    H.assert_close(o, ref, 1e-5, 1e-4)
  end

  it("matches a Lua composition, with and without the causal mask", function()
    fsdp.manual_seed(15)
    check(2, 3, 5, 5, 4, 4, {})
    check(2, 3, 5, 5, 4, 4, { causal = true })
    check(1, 2, 3, 6, 4, 2, {})                       -- Tq != Tk, Dv != D
    check(1, 2, 6, 3, 4, 5, { causal = true })        -- causal with Tq > Tk (top-left aligned)
    check(1, 1, 4, 4, 8, 8, { scale = 0.5 })
  end)

  it("adds a broadcast additive mask", function()
    fsdp.manual_seed(16)
    local mask = fsdp.randn({ 4, 6 })  -- (Tq, Tk)
    local ml = mask:tolist()
    check(2, 2, 4, 6, 3, 3, { mask = mask }, function(_, i, j) return ml[i * 6 + j + 1] end)
    -- padding mask (B, 1, 1, Tk): -inf on the last key of batch 1
    local pm = fsdp.tensor({ { { { 0, 0, 0, 0, 0 } } }, { { { 0, 0, 0, 0, -math.huge } } } })
    check(2, 3, 4, 5, 2, 2, { mask = pm, causal = false }, function(b, _, j)
      if math.floor(b / 3) == 1 and j == 4 then return -math.huge end
      return 0
    end)
    check(2, 3, 4, 5, 2, 2, { mask = pm, causal = true }, function(b, _, j)
      if math.floor(b / 3) == 1 and j == 4 then return -math.huge end
      return 0
    end)
  end)

  it("works on 3-D inputs and on non-contiguous q, k, v (a (B, T, H, D) layout transposed)", function()
    fsdp.manual_seed(17)
    local q, k, v = fsdp.randn({ 2, 5, 3 }), fsdp.randn({ 2, 5, 3 }), fsdp.randn({ 2, 5, 3 })
    local ref = ref_attention(q:tolist(), k:tolist(), v:tolist(), 2, 5, 5, 3, 3, 1 / math.sqrt(3), true)
    H.assert_close(sdpa(q, k, v, { causal = true }), ref, 1e-5, 1e-4)
    local qt = fsdp.randn({ 1, 4, 2, 3 }):transpose(2, 3)  -- (1, 2, 4, 3)
    local kt = fsdp.randn({ 1, 4, 2, 3 }):transpose(2, 3)
    local vt = fsdp.randn({ 1, 4, 2, 3 }):transpose(2, 3)
    local ref2 = ref_attention(qt:contiguous():tolist(), kt:contiguous():tolist(), vt:contiguous():tolist(), 2, 4,
      4, 3, 3, 1 / math.sqrt(3), true)
    H.assert_close(sdpa(qt, kt, vt, { causal = true }), ref2, 1e-5, 1e-4)
  end)

  it("backward for q, k, v (and a float mask) matches finite differences", function()
    fsdp.manual_seed(18)
    local q, k, v = leaf(fsdp.randn({ 1, 2, 3, 4 })), leaf(fsdp.randn({ 1, 2, 5, 4 })), leaf(fsdp.randn({ 1, 2, 5, 3 }))
    H.gradcheck(function(a, b, c) return sdpa(a, b, c) end, { q, k, v })
    H.gradcheck(function(a, b, c) return sdpa(a, b, c, { causal = true }) end, { q, k, v })
    local m = leaf(fsdp.randn({ 3, 5 }))
    H.gradcheck(function(a, b, c, mm) return sdpa(a, b, c, { mask = mm, scale = 0.7 }) end, { q, k, v, m })
    -- only v requires grad
    local q2, k2 = fsdp.randn({ 2, 3, 2 }), fsdp.randn({ 2, 3, 2 })
    local v2 = leaf(fsdp.randn({ 2, 3, 2 }))
    H.gradcheck(function(c) return sdpa(q2, k2, c, { causal = true }) end, { v2 })
    assert.is_nil(q2.grad)
    assert.equal("ScaledDotProductAttentionBackward", sdpa(q, k, v).grad_fn)
  end)

  it("applies dropout to the attention weights, reproducibly, with a matching backward", function()
    fsdp.manual_seed(19)
    local q, k, v = leaf(fsdp.randn({ 1, 2, 4, 3 })), leaf(fsdp.randn({ 1, 2, 4, 3 })), leaf(fsdp.randn({ 1, 2, 4, 3 }))
    fsdp.manual_seed(5)
    local a = sdpa(q, k, v, { dropout_p = 0.5 }):tolist()
    fsdp.manual_seed(5)
    assert.same(a, sdpa(q, k, v, { dropout_p = 0.5 }):tolist())
    H.assert_error(function() assert.same(a, sdpa(q, k, v):tolist()) end)  -- dropout changed something
    -- with v = identity rows the output is the dropped-out attention matrix: entries 0 or P/(1-p)
    local eye = fsdp.tensor({ { { { 1, 0, 0, 0 }, { 0, 1, 0, 0 }, { 0, 0, 1, 0 }, { 0, 0, 0, 1 } } } })
    local qq, kk = fsdp.randn({ 1, 1, 4, 2 }), fsdp.randn({ 1, 1, 4, 2 })
    local P = sdpa(qq, kk, eye):tolist()
    local Pd = sdpa(qq, kk, eye, { dropout_p = 0.25 }):tolist()
    for i = 1, 16 do
      assert(Pd[i] == 0 or math.abs(Pd[i] - P[i] / 0.75) < 1e-6, "dropped attention weight not 0 or P/(1-p)")
    end
    H.gradcheck(function(x, y, z) fsdp.manual_seed(77); return sdpa(x, y, z, { dropout_p = 0.3 }) end, { q, k, v })
  end)

  it("rejects mismatched shapes and masks, then keeps working", function()
    local q, k, v = fsdp.randn({ 2, 3, 4 }), fsdp.randn({ 2, 5, 4 }), fsdp.randn({ 2, 5, 6 })
    H.assert_error(function() sdpa(q, fsdp.randn({ 2, 5, 3 }), v) end, "scaled_dot_product_attention", "(2, 3, 4)",
      "(2, 5, 3)", "head dims")
    H.assert_error(function() sdpa(q, k, fsdp.randn({ 2, 4, 6 })) end, "scaled_dot_product_attention", "(2, 5, 4)",
      "(2, 4, 6)")
    H.assert_error(function() sdpa(q, fsdp.randn({ 3, 5, 4 }), fsdp.randn({ 3, 5, 6 })) end, "batch dims")
    H.assert_error(function() sdpa(q, k, v, { mask = fsdp.randn({ 3, 4 }) }) end, "attn_mask", "(3, 4)", "(2, 3, 5)")
    H.assert_error(function() sdpa(q, k, v, { mask = fsdp.randn({ 5 }):long() }) end, "scaled_dot_product_attention",
      "int64")
    H.assert_error(function() sdpa(q:long(), k, v) end, "scaled_dot_product_attention", "int64")
    H.assert_error(function() sdpa(fsdp.randn({ 4 }), fsdp.randn({ 4 }), fsdp.randn({ 4 })) end, "at least 2")
    H.assert_error(function() sdpa(q, k, v, { dropout_p = 1 }) end, "dropout_p")
    still_works()
    assert.same({ 2, 3, 6 }, sdpa(q, k, v):shape())
  end)
end)

-- ==================================================================================================
describe("nn ops memory", function()
  it("release every buffer (forward, backward and error paths)", function()
    collectgarbage(); collectgarbage()
    local before = fsdp.memory_stats()
    local function work()
      fsdp.manual_seed(20)
      local x = leaf(fsdp.randn({ 4, 6 }))
      local w, b = leaf(fsdp.randn({ 6 })), leaf(fsdp.randn({ 6 }))
      local q = leaf(fsdp.randn({ 1, 2, 4, 3 }))
      local emb = leaf(fsdp.randn({ 10, 6 }))
      local idx = fsdp.tensor({ 1, 2, 3, 9 }, "int64")
      local h = layer_norm(x + embedding(emb, idx, 0), 1, w, b)
      h = dropout(softmax(h, -1) + log_softmax(h, 1), 0.1)
      local a = sdpa(q, q, q, { causal = true, mask = fsdp.zeros({ 4, 4 }), dropout_p = 0.1 })
      local loss = cross_entropy(h, fsdp.tensor({ 0, 5, -100, 2 }, "int64"), NONE, 0.1) + mse_loss(a, fsdp.zeros({ 1, 2, 4, 3 }))
        + nll_loss(h, fsdp.tensor({ 1, 1, 1, 1 }, "int64"))
      loss:backward()
      pcall(cross_entropy, h, fsdp.tensor({ 0, 9, 0, 0 }, "int64"))
      pcall(embedding, emb, fsdp.tensor({ 10 }, "int64"))
      pcall(sdpa, q, q, q, { mask = fsdp.zeros({ 3, 3 }) })
      pcall(layer_norm, x, 1, fsdp.ones({ 5 }), nil)
    end
    work()
    collectgarbage(); collectgarbage()
    local after = fsdp.memory_stats()
    assert.equal(before.activations.current, after.activations.current)
    assert.equal(before.grads.current, after.grads.current)
  end)
end)
