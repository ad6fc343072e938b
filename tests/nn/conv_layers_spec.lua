-- The convolution, embedding and dropout layers of issue 19 at the layer level: Conv2d with groups
-- (depthwise included) and bias = false, ConvTranspose2d, Embedding with padding_idx, Dropout2d.
-- Forward and gradients against PyTorch (tests/golden/conv_layers.json, written by
-- tests/golden/gen_conv_layers.py), state_dict keys and shapes, initialization bounds, the padding
-- row's gradient, Dropout2d's channel pattern, and the errors for bad arguments. The ops' finite
-- difference checks are op cases (tests/ops/op_cases.lua), the convolution paths tests/backends/conv_paths_spec.lua.
local fsdp = require "fsdp"
local H = require "helpers"
local json = require "fsdp.json"
local nn, F = fsdp.nn, fsdp.nn.functional

local golden = json.decode(H.read_file(H.root .. "/tests/golden/conv_layers.json"), "conv_layers.json")
local function from(t) return fsdp.tensor(t.values):view(t.shape) end
local function keys_of(sd)
  local ks = {}
  for k in pairs(sd) do ks[#ks + 1] = k end
  table.sort(ks)
  return ks
end
local function golden_case(name)
  for _, c in ipairs(golden.conv) do if c.name == name then return c end end
  error("no golden case " .. name)
end

describe("conv2d and conv_transpose2d against PyTorch", function()
  for _, c in ipairs(golden.conv) do
    it(c.name .. ": output and gradients (F)", function()
      local x, w, b = from(c.x), from(c.w), c.b and from(c.b)
      x.requires_grad, w.requires_grad = true, true
      if b then b.requires_grad = true end
      local y = F[c.op](x, w, b, c.options)
      H.assert_close(y, from(c.y), 1e-5, 1e-5, "output")
      ;(y * from(c.gy)):sum():backward()
      H.assert_close(x.grad, from(c.gx), 1e-5, 1e-5, "input gradient")
      H.assert_close(w.grad, from(c.gw), 1e-5, 1e-5, "weight gradient")
      if b then H.assert_close(b.grad, from(c.gb), 1e-5, 1e-5, "bias gradient") end
    end)
  end

  it("the layers give the same, with PyTorch's weights loaded through load_state_dict", function()
    local layers = {
      ["conv2d groups 2"] = nn.Conv2d(4, 6, 3, { padding = 1, groups = 2 }),
      ["conv2d depthwise x2, stride 2, no bias"] = nn.Conv2d(4, 8, 3, { stride = 2, padding = 1, groups = 4,
        bias = false }),
      ["conv_transpose2d stride 2, padding 1, output_padding 1"] = nn.ConvTranspose2d(3, 2, 3, 2, 1, 1),
      ["conv_transpose2d groups 2, dilation 2, no bias"] = nn.ConvTranspose2d(4, 6, { 2, 3 },
        { stride = { 1, 2 }, padding = { 0, 1 }, groups = 2, dilation = 2, bias = false }),
      ["conv_transpose2d output_padding below dilation"] = nn.ConvTranspose2d(2, 2, 3, { dilation = 2,
        output_padding = 1 }),
      ["conv_transpose2d depthwise"] = nn.ConvTranspose2d(3, 3, 3, { padding = 1, groups = 3 }),
    }
    for name, m in pairs(layers) do
      local c = golden_case(name)
      local sd = { weight = from(c.w) }
      if c.b then sd.bias = from(c.b) end
      m:load_state_dict(sd)
      local x = from(c.x)
      x.requires_grad = true
      local y = m(x)
      H.assert_close(y, from(c.y), 1e-5, 1e-5, name .. ": output")
      ;(y * from(c.gy)):sum():backward()
      H.assert_close(x.grad, from(c.gx), 1e-5, 1e-5, name .. ": input gradient")
      H.assert_close(m.weight.grad, from(c.gw), 1e-5, 1e-5, name .. ": weight gradient")
      if c.b then H.assert_close(m.bias.grad, from(c.gb), 1e-5, 1e-5, name .. ": bias gradient") end
    end
  end)
end)

describe("nn.Conv2d groups and bias = false", function()
  it("has PyTorch's parameter shapes and state_dict keys", function()
    local dw = nn.Conv2d(8, 16, 3, { groups = 8, bias = false })
    assert.same({ 16, 1, 3, 3 }, dw.weight:shape())
    assert.is_nil(dw.bias)
    assert.same({ "weight" }, keys_of(dw:state_dict()))
    assert.equal(1, #dw:parameters())
    local g = nn.Conv2d(6, 4, { 3, 1 }, { groups = 2 })
    assert.same({ 4, 3, 3, 1 }, g.weight:shape())
    assert.same({ "bias", "weight" }, keys_of(g:state_dict()))
    assert.equal("Conv2d(8, 16, kernel_size=(3, 3), stride=(1, 1), groups=8, bias=False)", tostring(dw))
  end)

  it("initializes within PyTorch's bound 1/sqrt(in_channels/groups * kh * kw)", function()
    fsdp.manual_seed(3)
    local m = nn.Conv2d(8, 64, 3, { groups = 8 })
    local bound = 1 / math.sqrt(1 * 3 * 3)
    local mx = m.weight:abs():max():item()
    assert.is_true(mx <= bound and mx > 0.9 * bound, ("max |w| %g, bound %g"):format(mx, bound))
    assert.is_true(m.bias:abs():max():item() <= bound)
  end)

  it("trains a depthwise layer without bias: the gradient reaches only the weight", function()
    local m = nn.Conv2d(4, 4, 3, { padding = 1, groups = 4, bias = false })
    local x = fsdp.randn(2, 4, 5, 5)
    m(x):sum():backward()
    assert.same({ 4, 1, 3, 3 }, m.weight.grad:shape())
    -- each channel's kernel sees only its own input channel: the sum of its 3x3 windows of ones
    local y = F.conv2d(fsdp.ones(1, 4, 3, 3), fsdp.ones(4, 1, 3, 3), nil, { groups = 4 })
    assert.same({ { { { 9 } }, { { 9 } }, { { 9 } }, { { 9 } } } }, y:totable())
  end)

  it("rejects groups that do not divide the channels, naming the module and the sizes", function()
    H.assert_error(function() nn.Conv2d(4, 6, 3, { groups = 4 }) end, "Conv2d", "in_channels (4)", "out_channels (6)",
      "groups (4)")
    H.assert_error(function() nn.Conv2d(4, 6, 3, { groups = 0 }) end, "Conv2d", "groups")
    H.assert_error(function() F.conv2d(fsdp.randn(1, 4, 5, 5), fsdp.randn(6, 1, 3, 3), nil, { groups = 4 }) end,
      "conv2d", "(1, 4, 5, 5)", "(6, 1, 3, 3)", "groups 4")
    H.assert_error(function() F.conv2d(fsdp.randn(1, 4, 5, 5), fsdp.randn(4, 1, 3, 3), nil, { groups = 2 }) end,
      "conv2d", "(1, 4, 5, 5)", "(4, 1, 3, 3)", "groups 2")
    H.assert_error(function() F.conv2d(fsdp.randn(1, 4, 5, 5), fsdp.randn(4, 1, 3, 3), nil, { groups = 1.5 }) end,
      "conv2d", "groups", "1.5")
    -- the process keeps working
    assert.same({ 1, 4, 3, 3 }, F.conv2d(fsdp.randn(1, 4, 5, 5), fsdp.randn(4, 1, 3, 3), nil, { groups = 4 }):shape())
  end)
end)

describe("nn.ConvTranspose2d", function()
  it("has PyTorch's weight layout (in, out/groups, kh, kw), output size and state_dict keys", function()
    local m = nn.ConvTranspose2d(6, 4, 3, { stride = 2, padding = 1, output_padding = 1, groups = 2 })
    assert.same({ 6, 2, 3, 3 }, m.weight:shape())
    assert.same({ 4 }, m.bias:shape())
    assert.same({ "bias", "weight" }, keys_of(m:state_dict()))
    -- (H - 1) * 2 - 2 + 2 + 1 + 1 = 2H
    assert.same({ 3, 4, 10, 14 }, m(fsdp.randn(3, 6, 5, 7)):shape())
    local nb = nn.ConvTranspose2d(2, 3, { 2, 3 }, { bias = false, dilation = { 1, 2 } })
    assert.same({ "weight" }, keys_of(nb:state_dict()))
    assert.is_nil(nb.bias)
    -- (4 - 1) + 1 * (2 - 1) + 1 = 5, (4 - 1) + 2 * (3 - 1) + 1 = 8
    assert.same({ 1, 3, 5, 8 }, nb(fsdp.randn(1, 2, 4, 4)):shape())
    assert.equal("ConvTranspose2d(6, 4, kernel_size=(3, 3), stride=(2, 2), padding=(1, 1), output_padding=(1, 1), "
      .. "groups=2)", tostring(m))
  end)

  it("takes PyTorch's positional order: stride, padding, output_padding, groups, bias, dilation", function()
    local m = nn.ConvTranspose2d(4, 2, 3, 2, 1, 1, 2, false, 1)
    assert.same({ 2, 2 }, m.stride)
    assert.same({ 1, 1 }, m.padding)
    assert.same({ 1, 1 }, m.output_padding)
    assert.equal(2, m.groups)
    assert.is_nil(m.bias)
    assert.same({ 4, 1, 3, 3 }, m.weight:shape())
    -- F.conv_transpose2d(x, w, b, stride, padding, output_padding, groups, dilation)
    local x, w = fsdp.randn(1, 4, 3, 3), fsdp.randn(4, 1, 3, 3)
    local a = F.conv_transpose2d(x, w, nil, 2, 1, 1, 2, 1)
    local b = F.conv_transpose2d(x, w, nil, { stride = 2, padding = 1, output_padding = 1, groups = 2 })
    assert.same({ 1, 2, 6, 6 }, a:shape())
    assert.equal(0, (a - b):abs():max():item())
  end)

  it("takes forward(x, output_size) and picks the output_padding that reaches it, as PyTorch", function()
    fsdp.manual_seed(11)
    local m = nn.ConvTranspose2d(3, 2, 3, { stride = 3, padding = 1 })
    local x = fsdp.randn(1, 3, 4, 5)
    assert.same({ 1, 2, 10, 13 }, m(x):shape())  -- (4 - 1) * 3 - 2 + 2 + 1
    local y = m(x, { 12, 14 })                     -- output_padding (2, 1)
    assert.same({ 1, 2, 12, 14 }, y:shape())
    local ref = F.conv_transpose2d(x, m.weight, m.bias, { stride = 3, padding = 1, output_padding = { 2, 1 } })
    assert.equal(0, (y - ref):abs():max():item())
    assert.same({ 1, 2, 12, 14 }, m(x, { 1, 2, 12, 14 }):shape())
    H.assert_error(function() m(x, { 13, 14 }) end, "ConvTranspose2d", "output size of (13, 14)", "(10, 13) to (12, 15)",
      "(1, 3, 4, 5)")
    H.assert_error(function() m(x, { 12 }) end, "ConvTranspose2d", "output_size")
  end)

  it("initializes within PyTorch's bound 1/sqrt(out_channels/groups * kh * kw)", function()
    fsdp.manual_seed(4)
    local m = nn.ConvTranspose2d(64, 8, 3, { groups = 2 })
    local bound = 1 / math.sqrt(4 * 3 * 3)
    local mx = m.weight:abs():max():item()
    assert.is_true(mx <= bound and mx > 0.9 * bound, ("max |w| %g, bound %g"):format(mx, bound))
    assert.is_true(m.bias:abs():max():item() <= bound)
  end)

  it("is the adjoint of conv2d: <conv_transpose2d(x, w), z> = <x, conv2d(z, w)>", function()
    fsdp.manual_seed(5)
    local x, w = fsdp.randn(2, 6, 4, 5), fsdp.randn(6, 2, 3, 3)
    local o = { stride = 2, padding = 1, output_padding = 1, groups = 3 }
    local y = F.conv_transpose2d(x, w, nil, o)
    local z = fsdp.randn(unpack(y:shape()))
    local lhs = (y * z):sum():item()
    local rhs = (x * F.conv2d(z, w, nil, { stride = 2, padding = 1, groups = 3 })):sum():item()
    assert.is_true(math.abs(lhs - rhs) <= 1e-4 * math.abs(rhs), ("%g vs %g"):format(lhs, rhs))
  end)

  it("rejects bad arguments, naming the module or op, the argument and the shapes", function()
    H.assert_error(function() nn.ConvTranspose2d(4, 6, 3, { groups = 4 }) end, "ConvTranspose2d", "in_channels (4)",
      "out_channels (6)", "groups (4)")
    H.assert_error(function() nn.ConvTranspose2d(4, 6, 3, { stride = 2, output_padding = 2 }) end, "ConvTranspose2d",
      "output_padding", "stride (2, 2)")
    H.assert_error(function() nn.ConvTranspose2d(4, 6, 3, { padding_mode = "reflect" }) end, "ConvTranspose2d",
      "padding_mode")
    H.assert_error(function() nn.ConvTranspose2d(4, 6, 0) end, "ConvTranspose2d", "kernel_size")
    local w = fsdp.randn(4, 3, 3, 3)
    H.assert_error(function() F.conv_transpose2d(fsdp.randn(1, 3, 5, 5), w) end, "conv_transpose2d", "(1, 3, 5, 5)",
      "(4, 3, 3, 3)", "in_channels")
    H.assert_error(function() F.conv_transpose2d(fsdp.randn(1, 4, 5, 5), w, fsdp.randn(4)) end, "conv_transpose2d",
      "bias", "(4)", "expected (3)")
    H.assert_error(function() F.conv_transpose2d(fsdp.randn(1, 4, 5, 5), w, nil, { groups = 3 }) end,
      "conv_transpose2d", "(1, 4, 5, 5)", "groups 3")
    H.assert_error(function() F.conv_transpose2d(fsdp.randn(1, 4, 5, 5), w, nil, { output_padding = 1 }) end,
      "conv_transpose2d", "output_padding (1, 1)", "stride (1, 1)", "dilation (1, 1)")
    H.assert_error(function() F.conv_transpose2d(fsdp.randn(1, 4, 1, 1), w, nil, { padding = 2 }) end,
      "conv_transpose2d", "empty output")
    H.assert_error(function() F.conv_transpose2d(fsdp.randn(4, 5, 5), w) end, "conv_transpose2d", "4-D", "(4, 5, 5)")
    H.assert_error(function() F.conv_transpose2d(fsdp.randn(1, 4, 5, 5):bfloat16(), w) end, "conv_transpose2d",
      "bfloat16", "float32")
    assert.same({ 1, 3, 7, 7 }, F.conv_transpose2d(fsdp.randn(1, 4, 5, 5), w):shape())
  end)
end)

describe("nn.Embedding padding_idx", function()
  local c = golden.embedding

  it("matches PyTorch's output and weight gradient (padding_idx = -1: the last row gets none)", function()
    local w = from(c.w)
    w.requires_grad = true
    local idx = fsdp.tensor(c.idx, "int64"):view(c.idx_shape)
    local y = F.embedding(idx, w, { padding_idx = c.padding_idx })
    H.assert_close(y, from(c.y), 0, 0, "output")
    ;(y * from(c.gy)):sum():backward()
    H.assert_close(w.grad, from(c.gw), 1e-6, 1e-6, "weight gradient")
    assert.same({ 0, 0, 0 }, w.grad:narrow(1, 5, 1):view(3):totable())
  end)

  it("starts the padding row at zeros, keeps it out of training, and takes 0-based or negative indices", function()
    fsdp.manual_seed(6)
    for _, pad in ipairs { 2, -3 } do
      local m = nn.Embedding(5, 4, { padding_idx = pad })
      assert.equal(2, m.padding_idx)
      assert.same({ 0, 0, 0, 0 }, m.weight:narrow(1, 3, 1):view(4):totable())
      local opt = fsdp.optim.SGD(m:parameters(), { lr = 0.5 })
      local idx = fsdp.tensor({ { 2, 0, 2 }, { 4, 2, 1 } }, "int64")
      for _ = 1, 3 do
        opt:zero_grad()
        m(idx):pow(2):sum():backward()
        assert.same({ 0, 0, 0, 0 }, m.weight.grad:narrow(1, 3, 1):view(4):totable())
        opt:step()
      end
      assert.same({ 0, 0, 0, 0 }, m.weight:narrow(1, 3, 1):view(4):totable())
      -- the padding row's lookups are zeros; the others moved
      assert.same({ 0, 0, 0, 0 }, m(fsdp.tensor({ 2 }, "int64")):view(4):totable())
    end
    assert.equal("Embedding(5, 4, padding_idx=2)", tostring(nn.Embedding(5, 4, { padding_idx = 2 })))
  end)

  it("rejects a padding_idx out of range or not an integer, naming the module and the sizes", function()
    H.assert_error(function() nn.Embedding(5, 4, { padding_idx = 5 }) end, "Embedding", "padding_idx 5", "5 embeddings")
    H.assert_error(function() nn.Embedding(5, 4, { padding_idx = -6 }) end, "Embedding", "padding_idx -6")
    H.assert_error(function() nn.Embedding(5, 4, { padding_idx = 1.5 }) end, "Embedding", "padding_idx", "1.5")
    local w = fsdp.randn(5, 4)
    H.assert_error(function() F.embedding(fsdp.tensor({ 1 }, "int64"), w, -6) end, "embedding", "padding_idx -6",
      "5 embeddings")
    H.assert_error(function() F.embedding(fsdp.tensor({ 1 }, "int64"), w, { padding_idx = "0" }) end, "embedding",
      "padding_idx", "integer")
  end)
end)

describe("nn.Dropout2d", function()
  -- for each (n, c) plane of y: "zero", "kept" (x / (1 - p)), or an error for a mixed plane
  local function planes(y, x, p)
    local N, C = y:size(1), y:size(2)
    local yv, xv = y:reshape(N * C, -1):totable(), x:reshape(N * C, -1):totable()
    local out = {}
    for i = 1, N * C do
      local zero, kept = true, true
      for j = 1, #yv[i] do
        if yv[i][j] ~= 0 then zero = false end
        if math.abs(yv[i][j] - xv[i][j] / (1 - p)) > 1e-6 * math.abs(xv[i][j]) then kept = false end
      end
      assert(zero or kept, ("plane %d is neither dropped nor kept whole"):format(i))
      out[i] = zero and "zero" or "kept"
    end
    return out
  end

  it("zeroes whole channels with probability p and scales the rest by 1/(1-p)", function()
    fsdp.manual_seed(7)
    local p, N, C = 0.3, 20, 30
    local x = fsdp.randn(N, C, 3, 4) + 10  -- no zeros in x
    local m = nn.Dropout2d(p)
    local pl = planes(m(x), x, p)
    local dropped = 0
    for _, s in ipairs(pl) do if s == "zero" then dropped = dropped + 1 end end
    -- 600 channels: within 4.5 standard deviations (about 0.08) of p
    assert.is_true(math.abs(dropped / (N * C) - p) < 0.08, ("dropped %d of %d"):format(dropped, N * C))
    assert.equal("Dropout2d(p=0.3, inplace=False)", tostring(m))
  end)

  it("takes an unbatched (C, H, W) input: whole channels", function()
    fsdp.manual_seed(8)
    local x = fsdp.randn(40, 2, 3) + 10
    local y = F.dropout2d(x, 0.5)
    local pl = planes(y:view(1, 40, 2, 3), x:view(1, 40, 2, 3), 0.5)
    local seen = {}
    for _, s in ipairs(pl) do seen[s] = true end
    assert.is_true(seen.zero and seen.kept)
  end)

  it("gives its mask to the gradient, draws from the seeded RNG, and is the identity in eval mode", function()
    local x = fsdp.randn(4, 6, 2, 2) + 10
    x.requires_grad = true
    local m = nn.Dropout2d(0.5)
    fsdp.manual_seed(9)
    local y = m(x)
    y:sum():backward()
    -- the gradient of sum(y) is the mask: 0 or 2 on each plane, as y is 0 or 2x
    local gp = planes(x.grad, fsdp.ones(4, 6, 2, 2), 0.5)
    assert.same(planes(y:detach(), x:detach(), 0.5), gp)
    fsdp.manual_seed(9)
    assert.equal(0, (m(x) - y):abs():max():item())  -- the same seed draws the same channels
    local other = m(x)
    assert.is_true((other - y):abs():max():item() > 0)  -- the next draw differs
    m:eval()
    assert.equal(0, (m(x) - x):abs():max():item())
    assert.equal(0, (F.dropout2d(x, 0.5, false) - x):abs():max():item())
    assert.equal(0, F.dropout2d(x, 1):abs():max():item())
  end)

  it("draws the same channels when activation checkpointing reruns it in backward", function()
    local conv = nn.Conv2d(3, 6, 3, { padding = 1 })
    local drop = nn.Dropout2d(0.5)
    local x = fsdp.randn(2, 3, 5, 5)
    local function grads(checkpointed)
      conv:zero_grad()
      fsdp.manual_seed(12)
      local f = function(b) return drop(conv(b)):pow(2) end
      local y = checkpointed and fsdp.checkpoint(f, x) or f(x)
      y:sum():backward()
      return conv.weight.grad:clone()
    end
    local plain, ckpt = grads(false), grads(true)
    assert.is_true(plain:abs():max():item() > 0)
    assert.equal(0, (plain - ckpt):abs():max():item())
  end)

  it("keeps bfloat16 and rounds the kept channels' scale as PyTorch does", function()
    fsdp.manual_seed(10)
    local x = (fsdp.randn(3, 8, 2, 2) + 10):bfloat16()
    local y = F.dropout2d(x, 0.25)
    assert.equal("bfloat16", y.dtype)
    -- 1/(1 - 0.25) in bf16 is 1.3359375; each plane is zero or x times it, rounded to bf16
    local kept = (x:float() * 1.3359375):bfloat16():float()
    local pl = planes(y:float(), kept, 0)
    local seen = {}
    for _, s in ipairs(pl) do seen[s] = true end
    assert.is_true(seen.zero and seen.kept)
  end)

  it("rejects bad p and inputs that are not (N, C, H, W) or (C, H, W)", function()
    H.assert_error(function() nn.Dropout2d(1.5) end, "Dropout2d", "between 0 and 1", "1.5")
    H.assert_error(function() nn.Dropout2d("a") end, "Dropout2d", "number")
    H.assert_error(function() F.dropout2d(fsdp.randn(3, 4), 0.5) end, "dropout2d", "4-D", "(3, 4)")
    H.assert_error(function() F.dropout2d(fsdp.randn(1, 2, 3, 4, 5), 0.5) end, "dropout2d", "(1, 2, 3, 4, 5)")
    H.assert_error(function() F.dropout2d(fsdp.ones(2, 3, 4, "int64"), 0.5) end, "dropout2d", "int64")
    H.assert_error(function() F.dropout2d(fsdp.randn(2, 3, 4), -0.1) end, "dropout2d", "between 0 and 1")
    assert.same({ 2, 3, 4 }, F.dropout2d(fsdp.randn(2, 3, 4), 0.5):shape())
  end)
end)
