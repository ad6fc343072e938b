-- Neural-network ops (src/ops_nn.c): softmax, log_softmax, cross_entropy, nll_loss, mse_loss,
-- layer_norm, embedding, dropout, scaled_dot_product_attention: what the op-case table
-- (tests/ops/op_cases.lua, run by ops_spec.lua, which calls them through fsdp.nn.functional) does not
-- cover: -inf logits, exact gradients (ignored targets, padding rows, frozen parameters), the
-- parallel backward paths on large inputs, random dropout, node names, memory, and bad input as
-- Lua errors. The ops are called through the C API (fsdp.C) here.
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

local function leaf(t) t.requires_grad = true; return t end

-- after an error the library must keep working: a fresh op gives the right value
local function still_works()
  local y = softmax(fsdp.tensor({ { 0, 0 } }), -1)
  H.assert_close(y, { 0.5, 0.5 }, 1e-7, 0)
end

-- ==================================================================================================
describe("softmax and log_softmax", function()
  it("are exact on -inf", function()
    local m = fsdp.tensor({ { 0, -math.huge, 0 } })
    assert.same({ 0.5, 0, 0.5 }, softmax(m, -1):tolist())
    local l = log_softmax(m, -1):tolist()
    assert.is_true(l[2] == -math.huge)
    H.assert_close({ l[1], l[3] }, { -math.log(2), -math.log(2) }, 1e-6, 0)
  end)

  it("record their backward nodes", function()
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

  it("equals log_softmax followed by nll_loss", function()
    fsdp.manual_seed(5)
    local x = fsdp.randn({ 6, 4 })
    local t = fsdp.tensor({ 0, 3, -100, 1, 2, 3 }, "int64")
    H.assert_close(cross_entropy(x, t), nll_loss(log_softmax(x, 2), t), 1e-6, 1e-6)
  end)

  it("backward gives the analytic gradient, zero on ignored rows", function()
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
  it("nll_loss: errors", function()
    H.assert_error(function() nll_loss(fsdp.randn({ 2, 3 }), fsdp.tensor({ 0, 3 }, "int64")) end, "nll_loss", "3",
      "3 classes")
    H.assert_error(function() nll_loss(fsdp.randn({ 2, 3 }), fsdp.tensor({ 0.0, 1.0 })) end, "nll_loss", "int64")
    still_works()
  end)

  it("mse_loss: the exact gradient and errors", function()
    local p, q = leaf(fsdp.tensor({ 1, 2 })), fsdp.tensor({ 0, 4 })
    mse_loss(p, q):backward()
    H.assert_close(p.grad, { 1, -2 }, 1e-7, 0)  -- 2 (p - q) / n
    H.assert_error(function() mse_loss(fsdp.randn({ 2, 3 }), fsdp.randn({ 3, 2 })) end, "mse_loss", "(2, 3)", "(3, 2)")
    H.assert_error(function() mse_loss(fsdp.randn({ 2 }), fsdp.tensor({ 1, 2 }, "int64")) end, "mse_loss", "int64")
    still_works()
  end)
end)

-- ==================================================================================================
describe("layer_norm", function()
  it("gives frozen affine parameters no gradient", function()
    local x4, wf = leaf(fsdp.randn({ 2, 3 })), fsdp.randn({ 3 })
    layer_norm(x4, 1, wf, nil):sum():backward()
    assert.is_nil(wf.grad)
    assert.same({ 2, 3 }, x4.grad:shape())
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
  it("backward accumulates repeated rows and skips padding_idx", function()
    local w = leaf(fsdp.zeros({ 4, 3 }))
    local idx = fsdp.tensor({ { 1, 2, 1 }, { 3, 1, 0 } }, "int64")
    local g = fsdp.tensor({ { { 1, 1, 1 }, { 2, 2, 2 }, { 3, 3, 3 } }, { { 4, 4, 4 }, { 5, 5, 5 }, { 6, 6, 6 } } })
    embedding(w, idx):backward(g)
    assert.same({ { 6, 6, 6 }, { 9, 9, 9 }, { 2, 2, 2 }, { 4, 4, 4 } }, w.grad:totable())
    local w2 = leaf(fsdp.zeros({ 4, 3 }))
    embedding(w2, idx, 1):backward(g)  -- row 1 is padding: no gradient
    assert.same({ { 6, 6, 6 }, { 0, 0, 0 }, { 2, 2, 2 }, { 4, 4, 4 } }, w2.grad:totable())
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

  it("returns its input itself in eval mode", function()
    local x = fsdp.randn({ 3, 4 })
    local e = dropout(x, 0.5, false)
    assert.is_true(e:data_ptr() == x:data_ptr())
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
  it("gives a gradient only to the inputs that need one, and names its node", function()
    local q, k, v = leaf(fsdp.randn({ 1, 2, 3, 4 })), leaf(fsdp.randn({ 1, 2, 5, 4 })), leaf(fsdp.randn({ 1, 2, 5, 3 }))
    local q2, k2 = fsdp.randn({ 2, 3, 2 }), fsdp.randn({ 2, 3, 2 })
    local v2 = leaf(fsdp.randn({ 2, 3, 2 }))
    sdpa(q2, k2, v2, { causal = true }):sum():backward()
    assert.is_nil(q2.grad)
    assert.is_nil(k2.grad)
    assert.same({ 2, 3, 2 }, v2.grad:shape())
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
