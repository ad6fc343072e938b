-- fsdp.nn: Module registration and names, freezing, state_dict, hooks, train/eval, error paths,
-- layers against the functional ops and naive references, default init, printing.
local fsdp = require "fsdp"
local H = require "helpers"
local R = require "ops.op_refs"
local nn, F, optim = fsdp.nn, fsdp.nn.functional, fsdp.optim
local C = fsdp.C

local function names_of(iter)
  local r = {}
  for name in iter do r[#r + 1] = name end
  return r
end

local Block = nn.Module:extend("Block")
function Block:__init(cin, cout)
  self.conv = nn.Conv2d(cin, cout, 3, { padding = 1 })
  self.act = nn.ReLU()
end
function Block:forward(x) return self.act(self.conv(x)) end

-- a module with its own parameter, a buffer, a plain tensor attribute and children out of
-- alphabetical order
local Mixed = nn.Module:extend("Mixed")
function Mixed:__init()
  self.zeta = nn.Linear(2, 3)
  self.scale = nn.Parameter(fsdp.ones { 3 })
  self.alpha = nn.Linear(3, 1, { bias = false })
  self:register_buffer("running", fsdp.zeros { 3 })
  self.const = fsdp.full({ 3 }, 2)  -- needs no grad: a plain attribute
  self.hidden = 7
end
function Mixed:forward(x) return self.alpha(self.zeta(x) * self.scale + self.const) end

describe("nn.Module registration", function()
  it("registers children and parameters in assignment order with PyTorch names", function()
    local model = nn.Sequential(Block(1, 2), Block(2, 2))
    assert.same({ "0.conv.weight", "0.conv.bias", "1.conv.weight", "1.conv.bias" }, names_of(model:named_parameters()))
    assert.same({ "", "0", "0.conv", "0.act", "1", "1.conv", "1.act" }, names_of(model:named_modules()))
    assert.same({ "0", "1" }, names_of(model:named_children()))
    assert.equal(2, #model:children())
    assert.equal(7, #model:modules())
    local m = Mixed()
    assert.same({ "scale", "zeta.weight", "zeta.bias", "alpha.weight" }, names_of(m:named_parameters()))
    assert.same({ "zeta", "alpha" }, names_of(m:named_children()))
    assert.same({ "running" }, names_of(m:named_buffers()))
    assert.equal(4, #m:parameters())
    assert.equal(7, m.hidden)
    assert.same({ 2, 2, 2 }, m.const:tolist())
    -- parameters() returns the same tensors the modules hold
    assert.equal(m.zeta.weight, m:parameters()[2])
  end)

  it("puts parameters in the PARAMS memory category with their exact size", function()
    collectgarbage(); collectgarbage()
    local before = fsdp.memory_stats().params.current
    local lin = nn.Linear(10, 7)
    assert.equal(before + (10 * 7 + 7) * 4, fsdp.memory_stats().params.current)
    assert.equal(C.FSDP_MEM_PARAMS, C.fsdp_tensor_mem_category(lin.weight.p))
  end)

  it("deduplicates shared parameters in named_parameters but keeps both state_dict keys", function()
    local emb, head = nn.Embedding(5, 3), nn.Linear(3, 5, { bias = false })
    head.weight = emb.weight
    local model = nn.Sequential(emb, head)
    assert.same({ "0.weight" }, names_of(model:named_parameters()))
    local sd = model:state_dict()
    assert.truthy(sd["0.weight"] and sd["1.weight"])
  end)

  -- PyTorch copies the entries in module order, so a tied parameter ends with its last name's
  -- entry; the copy loop once went by pairs(), and which entry won changed from run to run
  it("loads a tied parameter's entries in module order: the last name's value wins, as in PyTorch", function()
    for round = 1, 12 do  -- other names each round: another order of pairs()
      local shared = nn.Linear(2, 2, { bias = false })
      local model, sd = nn.Module(), {}
      for i = 1, 8 do
        local l = nn.Linear(2, 2, { bias = false })
        l.weight = shared.weight
        local name = ("r%d_%d"):format(round, i)
        model[name] = l
        sd[name .. ".weight"] = fsdp.full({ 2, 2 }, 10 * round + i)
      end
      model:load_state_dict(sd)
      assert.equal(10 * round + 8, shared.weight[1][1]:item(), "round " .. round)
    end
  end)

  it("keeps a frozen parameter a parameter; freezing through named_parameters stops its gradient", function()
    local model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))
    for name, p in model:named_parameters() do
      if name:find("^0%.") then p.requires_grad = false end
    end
    assert.equal(4, #model:parameters())
    assert.is_false(model:get(1).weight.requires_grad)
    local loss = model(fsdp.randn { 5, 3 }):sum()
    loss:backward()
    assert.is_nil(model:get(1).weight.grad)
    assert.is_nil(model:get(1).bias.grad)
    assert.truthy(model:get(3).weight.grad)
    -- replacing a parameter with a tensor that needs no grad keeps it registered
    model:get(3).bias = fsdp.zeros { 2 }
    assert.same({ "0.weight", "0.bias", "2.weight", "2.bias" }, names_of(model:named_parameters()))
    -- and unfreezing brings the gradient back
    for _, p in model:named_parameters() do p.requires_grad = true end
    model:zero_grad()
    model(fsdp.randn { 5, 3 }):sum():backward()
    assert.truthy(model:get(1).weight.grad)
  end)

  it("reassigning a child replaces it in place; setting it to nil removes it", function()
    local m = Mixed()
    m.zeta = nn.Linear(2, 3, { bias = false })
    assert.same({ "scale", "zeta.weight", "alpha.weight" }, names_of(m:named_parameters()))
    m.alpha = nil
    assert.same({ "zeta" }, names_of(m:named_children()))
    H.assert_error(function() m.zeta = 5 end, "zeta")
  end)

  it("nn.Parameter makes a leaf that requires grad (also from a computed tensor)", function()
    local p = nn.Parameter(fsdp.ones { 2 } * 3)
    assert.is_true(p.is_leaf)
    assert.is_true(p.requires_grad)
    assert.same({ 3, 3 }, p:tolist())
  end)

  it("registers an nn.Parameter assigned in __init, frozen ones too; a plain tensor stays a field", function()
    local Frozen = nn.Module:extend("Frozen")
    function Frozen:__init()
      self.w = nn.Parameter(fsdp.ones { 2, 3 })
      self.frozen = nn.Parameter(fsdp.full({ 3 }, 2), false)
      self.plain = fsdp.zeros { 4 }  -- no grad, not a Parameter: neither parameter nor buffer
    end
    local m = Frozen()
    assert.same({ "w", "frozen" }, names_of(m:named_parameters()))
    assert.is_false(m.frozen.requires_grad)
    local keys = {}
    for k in pairs(m:state_dict()) do keys[#keys + 1] = k end
    table.sort(keys)
    assert.same({ "frozen", "w" }, keys)
    assert.same({ 0, 0, 0, 0 }, m.plain:tolist())
  end)

  it("to(device) returns the module with the same parameter tensors; an absent device is an error", function()
    local m = nn.Sequential(nn.Linear(2, 3), nn.LayerNorm(3))
    local before = m:parameters()
    assert.equal(m, m:to("cpu"))
    assert.equal(m, m:cpu())
    assert.equal(m, m:to { device = "cpu" })
    local after = m:parameters()
    for i = 1, #before do assert.is_true(before[i] == after[i]) end
    if #fsdp.backends() == 1 then  -- (after tests/backends/cuda_spec.lua "cuda" is the test double of a GPU)
      H.assert_error(function() m:to("cuda") end, 'device "cuda" is not available')
    else
      assert.equal(m, m:to("cuda"):to("cpu"))
      for i = 1, #before do assert.is_true(before[i] == m:parameters()[i]) end
    end
    H.assert_error(function() m:to("tpu") end, 'unknown device "tpu"')
  end)

  it("to(dtype) converts float parameters, buffers and gradients in place, keeping the tensors", function()
    local m = nn.Sequential(nn.Linear(2, 3), nn.LayerNorm(3))
    m:register_buffer("steps", fsdp.tensor({ 3 }, "int64"))
    m:register_buffer("scale", fsdp.tensor { 0.1 })
    m(fsdp.randn(4, 2)):sum():backward()
    local before, values = m:parameters(), {}
    for i, p in ipairs(before) do values[i] = p:tolist() end
    assert.equal(m, m:to("bfloat16"))
    local after = m:parameters()
    for i = 1, #before do
      assert.is_true(before[i] == after[i])
      assert.equal("bfloat16", after[i].dtype)
      assert.equal("bfloat16", after[i].grad.dtype)
      assert.is_true(after[i].requires_grad)
      for j, v in ipairs(after[i]:tolist()) do assert.equal(R.to_dtype(values[i][j], "bfloat16"), v) end
    end
    local bufs = {}
    for name, b in m:named_buffers() do bufs[name] = b.dtype end
    assert.same({ steps = "int64", scale = "bfloat16" }, bufs)
    assert.equal("bfloat16", m(fsdp.randn(4, 2):bfloat16()).dtype)
    assert.equal(m, m:to { device = "cpu", dtype = "float32" })
    assert.equal("float32", before[1].dtype)
    assert.equal(m, m:half())
    assert.equal("float16", before[1].dtype)
    H.assert_error(function() m:to("int64") end, "Module:to", "int64", "not a float dtype")
  end)

  it("zero_grad drops every gradient; apply visits children before parents", function()
    local model = nn.Sequential(nn.Linear(2, 2), nn.Sequential(nn.Linear(2, 1)))
    model(fsdp.randn { 3, 2 }):sum():backward()
    assert.truthy(model:get(1).weight.grad)
    model:zero_grad()
    for _, p in ipairs(model:parameters()) do assert.is_nil(p.grad) end
    local order = {}
    model:apply(function(m) order[#order + 1] = m.__name end)
    assert.same({ "Linear", "Linear", "Sequential", "Sequential" }, order)
  end)

  it("prints a tree like PyTorch's repr", function()
    local model = nn.Sequential(Block(1, 8), nn.MaxPool2d(2), nn.Flatten(), nn.Linear(8, 10, { bias = false }),
      nn.GELU { approximate = "tanh" }, nn.LayerNorm(10), nn.Embedding(4, 2, { padding_idx = 0 }), nn.Dropout(0.1))
    assert.equal(table.concat({
      "Sequential(",
      "  (0): Block(",
      "    (conv): Conv2d(1, 8, kernel_size=(3, 3), stride=(1, 1), padding=(1, 1))",
      "    (act): ReLU()",
      "  )",
      "  (1): MaxPool2d(kernel_size=2, stride=2, padding=0, dilation=1, ceil_mode=False)",
      "  (2): Flatten(start_dim=2, end_dim=-1)",
      "  (3): Linear(in_features=8, out_features=10, bias=False)",
      "  (4): GELU(approximate='tanh')",
      "  (5): LayerNorm((10,), eps=1e-05, elementwise_affine=True)",
      "  (6): Embedding(4, 2, padding_idx=0)",
      "  (7): Dropout(p=0.1, inplace=False)",
      ")" }, "\n"), tostring(model))
  end)
end)

describe("nn.Module state_dict", function()
  local function make()
    local m = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), Mixed())
    m:get(3).zeta = nn.Linear(4, 3)
    return m
  end

  it("holds PyTorch keys for parameters and buffers, as detached aliases", function()
    local m = make()
    local sd = m:state_dict()
    local keys = {}
    for k in pairs(sd) do keys[#keys + 1] = k end
    table.sort(keys)
    assert.same({ "0.bias", "0.weight", "2.alpha.weight", "2.running", "2.scale", "2.zeta.bias", "2.zeta.weight" }, keys)
    assert.is_false(sd["0.weight"].requires_grad)
    assert.is_true(C.fsdp_tensor_same_storage(sd["0.weight"].p, m:get(1).weight.p) ~= 0)
  end)

  it("round trips into a fresh model, which then computes the same outputs", function()
    local a, b = make(), make()
    local x = fsdp.randn { 2, 3 }
    assert(H.max_abs_diff(a(x), b(x)) > 1e-4, "two fresh models should differ")
    local res = b:load_state_dict(a:state_dict())
    assert.same({}, res.missing_keys)
    assert.same({}, res.unexpected_keys)
    H.assert_close(b(x), a(x), 0, 0)
    -- buffers are loaded too
    fsdp.no_grad(function() a:get(3).running:fill_(5) end)
    b:load_state_dict(a:state_dict())
    assert.same({ 5, 5, 5 }, b:get(3).running:tolist())
  end)

  it("strict loading names missing and unexpected keys; shape mismatches name key and shapes", function()
    local a, b = make(), make()
    local sd = a:state_dict()
    local before = b:get(1).weight:tolist()
    sd["0.bias"] = nil
    sd["extra.weight"] = fsdp.zeros { 1 }
    H.assert_error(function() b:load_state_dict(sd) end, "Missing key(s)", '"0.bias"', "Unexpected key(s)",
      '"extra.weight"')
    assert.same(before, b:get(1).weight:tolist())  -- nothing was copied
    -- not strict: the lists come back, the rest is loaded
    local res = b:load_state_dict(sd, false)
    assert.same({ "0.bias" }, res.missing_keys)
    assert.same({ "extra.weight" }, res.unexpected_keys)
    assert.same(a:get(1).weight:tolist(), b:get(1).weight:tolist())
    -- shape mismatches are errors even when not strict
    local bad = a:state_dict()
    bad["2.zeta.weight"] = fsdp.zeros { 3, 5 }
    H.assert_error(function() b:load_state_dict(bad, { strict = false }) end, '"2.zeta.weight"', "(3, 5)", "(3, 4)")
    -- training continues afterwards
    local opt = optim.SGD(b:parameters(), { lr = 0.01 })
    local x = fsdp.randn { 4, 3 }
    local l1 = b(x):pow(2):mean()
    opt:zero_grad(); l1:backward(); opt:step()
    local l2 = b(x):pow(2):mean()
    assert(l2:item() < l1:item())
  end)
end)

describe("nn.Module hooks", function()
  it("a forward pre hook can replace the input, a forward hook the output; remove() undoes them", function()
    local lin = nn.Linear(2, 2)
    local x = fsdp.tensor { { 1, 2 } }
    local base = lin(x):totable()
    local seen = {}
    local h1 = lin:register_forward_pre_hook(function(m, args)
      seen.module, seen.nargs = m, #args
      return args[1] * 0
    end)
    local zero_out = lin(x):totable()
    assert.equal(lin, seen.module)
    assert.equal(1, seen.nargs)
    H.assert_close(zero_out, lin.bias:tolist(), 1e-6, 0)
    local h2 = lin:register_forward_hook(function(m, args, out) return out + 1 end)
    H.assert_close(lin(x), { { zero_out[1][1] + 1, zero_out[1][2] + 1 } }, 1e-6, 0)
    local observed
    local h3 = lin:register_forward_hook(function(m, args, out) observed = out end)  -- returns nothing
    lin(x)
    H.assert_close(observed, { { zero_out[1][1] + 1, zero_out[1][2] + 1 } }, 1e-6, 0)
    h1:remove(); h2:remove(); h3:remove()
    H.assert_close(lin(x), base, 0, 0)
  end)
end)

describe("nn.Module train/eval", function()
  it("the mode reaches every child, and Dropout is the identity in eval mode", function()
    local model = nn.Sequential(nn.Linear(4, 4), nn.Sequential(nn.Dropout(0.5)))
    assert.is_true(model.training)
    model:eval()
    for _, m in ipairs(model:modules()) do assert.is_false(m.training) end
    local x = fsdp.ones { 50, 20 }
    local drop = model:get(2):get(1)
    H.assert_close(drop(x), x, 0, 0)
    model:train()
    for _, m in ipairs(model:modules()) do assert.is_true(m.training) end
    local y = drop(x):tolist()
    local zeros, twos = 0, 0
    for _, v in ipairs(y) do
      if v == 0 then zeros = zeros + 1 elseif math.abs(v - 2) < 1e-6 then twos = twos + 1 end
    end
    assert.equal(1000, zeros + twos)  -- kept elements are scaled by 1 / (1 - p)
    assert(zeros > 400 and zeros < 600, "dropped " .. zeros .. " of 1000 at p = 0.5")
    assert.equal(model, model:train(false))
    assert.is_false(drop.training)
  end)
end)

describe("nn.Module errors", function()
  it("append the module path and class once, and the model keeps working", function()
    local model = nn.Sequential(Block(1, 2), Block(2, 2))
    local err = H.assert_error(function() model(fsdp.randn { 1, 3, 5, 5 }) end, "conv2d", "(1, 3, 5, 5)",
      "in module 0.conv (Conv2d)")
    local _, count = err:gsub("in module", "")
    assert.equal(1, count)
    -- an error in a deeper child
    local err2 = H.assert_error(function() model:get(2)(fsdp.randn { 1, 1, 5, 5 }) end, "in module conv (Conv2d)")
    assert.falsy(err2:find("0.conv", 1, true))
    -- an error in the root's own forward
    local Bad = nn.Module:extend("Bad")
    function Bad:forward(x) error("boom") end
    H.assert_error(function() Bad()(1) end, "boom", "in module <root> (Bad)")
    local out = model(fsdp.ones { 1, 1, 5, 5 })
    assert.same({ 1, 2, 5, 5 }, out:shape())
  end)

  it("layers reject bad configurations and inputs with Lua errors naming the op and shapes", function()
    H.assert_error(function() nn.Conv2d(3, 4, 3, { groups = 2 }) end, "Conv2d", "divisible by groups")
    H.assert_error(function() nn.Linear(-1, 2) end, "Linear", "in_features")
    H.assert_error(function() nn.Dropout(1.5) end, "Dropout", "1.5")
    H.assert_error(function() nn.Embedding(4, 2, { padding_idx = 4 }) end, "padding_idx")
    H.assert_error(function() nn.Linear(3, 2)(fsdp.randn { 2, 4 }) end, "linear", "(2, 4)", "(2, 3)")
    H.assert_error(function() nn.LayerNorm(4)(fsdp.randn { 2, 3 }) end, "layer_norm", "(2, 3)", "(4)")
    H.assert_error(function() nn.Sequential(nn.Linear(1, 1), 5) end, "Sequential", "argument 2")
    H.assert_error(function() F.conv2d(fsdp.randn { 1, 1, 4, 4 }, fsdp.randn { 1, 1, 2, 2 }, nil, { padding = "same" }) end,
      "odd effective kernel")
    H.assert_error(function() F.cross_entropy(fsdp.randn { 2, 3 }, fsdp.tensor({ 0, 1 }, "int64"), { reduction = "sum" }) end,
      "reduction")
    H.assert_close(nn.Linear(1, 1, { bias = false })(fsdp.zeros { 1, 1 }), { { 0 } }, 0, 0)
  end)
end)

-- ---- layers against functional ops and independent references ---------------------------------------
describe("nn layers", function()
  it("Linear computes x W^T + b (naive loop reference) and equals F.linear", function()
    local lin = nn.Linear(3, 2)
    local x = fsdp.randn { 4, 3 }
    local W, b, X = lin.weight:totable(), lin.bias:tolist(), x:totable()
    local want = {}
    for i = 1, 4 do
      want[i] = {}
      for o = 1, 2 do
        local s = b[o]
        for k = 1, 3 do s = s + X[i][k] * W[o][k] end
        want[i][o] = s
      end
    end
    H.assert_close(lin(x), want, 1e-5, 1e-5)
    H.assert_close(lin(x), F.linear(x, lin.weight, lin.bias), 0, 0)
    assert.same({ 2, 3 }, lin.weight:shape())
  end)

  it("Conv2d equals F.conv2d with the same options, and a naive loop at one output", function()
    local conv = nn.Conv2d(2, 4, { 3, 2 }, { stride = { 2, 1 }, padding = 1, dilation = { 1, 2 }, groups = 2 })
    assert.same({ 4, 1, 3, 2 }, conv.weight:shape())
    local x = fsdp.randn { 2, 2, 7, 6 }
    local y = conv(x)
    local want = F.conv2d(x, conv.weight, conv.bias, { 2, 1 }, 1, { 1, 2 }, 2)
    H.assert_close(y, want, 0, 0)
    -- y[n=2, o=4, i=2, j=3] (1-based): group 2 sees input channel 2
    local X, Wt, b = x:totable(), conv.weight:totable(), conv.bias:tolist()
    local s = b[4]
    for ki = 1, 3 do
      for kj = 1, 2 do
        local hi = (2 - 1) * 2 - 1 + (ki - 1) * 1 + 1   -- stride 2, padding 1, dilation 1
        local wj = (3 - 1) * 1 - 1 + (kj - 1) * 2 + 1   -- stride 1, padding 1, dilation 2
        if hi >= 1 and hi <= 7 and wj >= 1 and wj <= 6 then s = s + X[2][2][hi][wj] * Wt[4][1][ki][kj] end
      end
    end
    H.assert_close(y:totable()[2][4][2][3], s, 1e-5, 1e-5)
    -- "same" padding keeps the spatial size
    local same = nn.Conv2d(2, 3, 3, { padding = "same" })
    assert.same({ 2, 3, 7, 6 }, same(x):shape())
  end)

  it("activations, Flatten and Identity equal their functional ops and hand values", function()
    local x = fsdp.tensor { { -2, -0.5, 0, 1.5 } }
    H.assert_close(nn.ReLU()(x), { { 0, 0, 0, 1.5 } }, 0, 0)
    H.assert_close(nn.Tanh()(x), { { math.tanh(-2), math.tanh(-0.5), 0, math.tanh(1.5) } }, 1e-6, 1e-6)
    local sig = function(v) return 1 / (1 + math.exp(-v)) end
    H.assert_close(nn.Sigmoid()(x), { { sig(-2), sig(-0.5), 0.5, sig(1.5) } }, 1e-6, 1e-6)
    H.assert_close(nn.GELU()(x), F.gelu(x), 0, 0)
    H.assert_close(nn.GELU({ approximate = "tanh" })(x), F.gelu(x, { approximate = "tanh" }), 0, 0)
    -- gelu(1.5) = 1.5 * Phi(1.5), Phi(1.5) = 0.9331927987
    H.assert_close(nn.GELU()(x):totable()[1][4], 1.5 * 0.9331927987, 1e-5, 0)
    assert.equal(x, nn.Identity()(x))
    local t = fsdp.randn { 2, 3, 4, 5 }
    assert.same({ 2, 60 }, nn.Flatten()(t):shape())
    assert.same({ 2, 12, 5 }, nn.Flatten({ start_dim = 2, end_dim = 3 })(t):shape())
    assert.same({ 120 }, F.flatten(t):shape())
    H.assert_close(nn.Softmax(-1)(x), F.softmax(x, 2), 0, 0)
    H.assert_close(nn.LogSoftmax(2)(x), F.log_softmax(x, -1), 0, 0)
  end)

  it("pooling layers equal the functional ops and hand-computed windows", function()
    local x = fsdp.arange(16, "float32"):reshape(1, 1, 4, 4)
    H.assert_close(nn.MaxPool2d(2)(x), { { { { 5, 7 }, { 13, 15 } } } }, 0, 0)
    H.assert_close(nn.AvgPool2d(2)(x), { { { { 2.5, 4.5 }, { 10.5, 12.5 } } } }, 1e-6, 0)
    H.assert_close(nn.AdaptiveAvgPool2d(1)(x), { { { { 7.5 } } } }, 1e-6, 0)
    H.assert_close(nn.AdaptiveAvgPool2d({ 2, 1 })(x), { { { { 3.5 }, { 11.5 } } } }, 1e-6, 0)
    local y = fsdp.randn { 2, 3, 7, 7 }
    H.assert_close(nn.MaxPool2d(3, { stride = 2, padding = 1 })(y), F.max_pool2d(y, 3, 2, 1), 0, 0)
    H.assert_close(nn.AvgPool2d(3, 2, 1, false, false)(y), F.avg_pool2d(y, 3, { stride = 2, padding = 1,
      count_include_pad = false }), 0, 0)
  end)

  it("LayerNorm starts as ones/zeros and normalizes (reference computed in Lua)", function()
    local ln = nn.LayerNorm(4)
    assert.same({ 1, 1, 1, 1 }, ln.weight:tolist())
    assert.same({ 0, 0, 0, 0 }, ln.bias:tolist())
    local x = fsdp.tensor { { 1, 2, 3, 4 }, { -1, 0, 0, 5 } }
    local want = {}
    for r, row in ipairs(x:totable()) do
      local mean, var = 0, 0
      for _, v in ipairs(row) do mean = mean + v / 4 end
      for _, v in ipairs(row) do var = var + (v - mean) ^ 2 / 4 end
      want[r] = {}
      for i, v in ipairs(row) do want[r][i] = (v - mean) / math.sqrt(var + 1e-5) end
    end
    H.assert_close(ln(x), want, 1e-5, 1e-5)
    local ln2 = nn.LayerNorm({ 2, 4 }, { eps = 1e-3, elementwise_affine = false })
    assert.equal(0, #ln2:parameters())
    local z = fsdp.randn { 3, 2, 4 }
    H.assert_close(ln2(z), F.layer_norm(z, { 2, 4 }, nil, nil, 1e-3), 0, 0)
  end)

  it("Embedding looks up rows (0-based indices), zeroes and freezes the padding row", function()
    local emb = nn.Embedding(5, 3, { padding_idx = -1 })  -- PyTorch: -1 is the last row
    assert.equal(4, emb.padding_idx)
    assert.same({ 0, 0, 0 }, emb.weight:narrow(1, 5, 1):reshape(-1):tolist())
    local idx = fsdp.tensor({ { 0, 4 }, { 2, 0 } }, "int64")
    local out = emb(idx)
    assert.same({ 2, 2, 3 }, out:shape())
    local W = emb.weight:totable()
    H.assert_close(out, { { W[1], W[5] }, { W[3], W[1] } }, 0, 0)
    out:sum():backward()
    local g = emb.weight.grad:totable()
    assert.same({ 2, 2, 2 }, g[1])
    assert.same({ 0, 0, 0 }, g[5])  -- padding row gets no gradient
    assert.same({ 1, 1, 1 }, g[3])
  end)

  it("losses equal their functional ops and hand-computed values", function()
    local logits = fsdp.tensor { { 1, 2, 3 }, { 1, 1, 1 } }
    local y = fsdp.tensor({ 2, 0 }, "int64")
    local function lse(a, b, c) return math.log(math.exp(a) + math.exp(b) + math.exp(c)) end
    local want = ((lse(1, 2, 3) - 3) + (lse(1, 1, 1) - 1)) / 2
    H.assert_close(nn.CrossEntropyLoss()(logits, y), want, 1e-6, 1e-6)
    local ce = nn.CrossEntropyLoss { ignore_index = 0, label_smoothing = 0.1 }
    H.assert_close(ce(logits, y), F.cross_entropy(logits, y, { ignore_index = 0, label_smoothing = 0.1 }), 0, 0)
    H.assert_close(nn.NLLLoss()(F.log_softmax(logits, 2), y), want, 1e-6, 1e-6)
    H.assert_close(nn.MSELoss()(fsdp.tensor { 1, 2 }, fsdp.tensor { 0, 4 }), (1 + 4) / 2, 1e-6, 0)
  end)

  it("default init follows PyTorch: U(+-1/sqrt(fan_in)) weights and biases, N(0, 1) embeddings", function()
    fsdp.manual_seed(0)
    local function range(t)
      local lo, hi, sum = math.huge, -math.huge, 0
      for _, v in ipairs(t:tolist()) do lo, hi, sum = math.min(lo, v), math.max(hi, v), sum + v end
      return lo, hi, sum / t:numel()
    end
    local lin = nn.Linear(100, 200)
    local bound = 1 / math.sqrt(100)
    local lo, hi, mean = range(lin.weight)
    assert(lo >= -bound and hi <= bound, "weight outside the bound")
    assert(lo < -0.95 * bound and hi > 0.95 * bound, "weight does not fill the bound")
    assert(math.abs(mean) < 0.01)
    lo, hi = range(lin.bias)
    assert(lo >= -bound and hi <= bound and hi - lo > bound)
    -- conv: fan_in = in_channels / groups * kh * kw = 6 / 3 * 3 * 2 = 12
    local conv = nn.Conv2d(6, 30, { 3, 2 }, { groups = 3 })
    bound = 1 / math.sqrt(12)
    lo, hi = range(conv.weight)
    assert(lo >= -bound and hi <= bound and lo < -0.9 * bound and hi > 0.9 * bound)
    lo, hi = range(conv.bias)
    assert(lo >= -bound and hi <= bound)
    local emb = nn.Embedding(100, 50)
    local _, _, m = range(emb.weight)
    local var = 0
    for _, v in ipairs(emb.weight:tolist()) do var = var + (v - m) ^ 2 end
    var = var / 5000
    assert(math.abs(m) < 0.05 and math.abs(var - 1) < 0.08, ("embedding mean %.3f var %.3f"):format(m, var))
    -- nn.init helpers
    local w = fsdp.empty(30, 20)
    nn.init.kaiming_uniform_(w, { a = math.sqrt(5) })
    lo, hi = range(w)
    assert(lo >= -1 / math.sqrt(20) and hi <= 1 / math.sqrt(20))
    nn.init.xavier_uniform_(w)
    lo, hi = range(w)
    assert(hi <= math.sqrt(6 / 50) and hi > 0.9 * math.sqrt(6 / 50))
    nn.init.zeros_(w)
    assert.equal(0, (w * w):sum():item())
  end)

  it("Sequential accepts a list, supports get/append, and ModuleList holds children", function()
    local s = nn.Sequential { nn.Linear(2, 3), nn.ReLU() }
    s:append(nn.Linear(3, 1))
    assert.same({ "0", "1", "2" }, names_of(s:named_children()))
    assert.equal("ReLU", s:get(2).__name)
    assert.equal("Linear", s:get(-1).__name)
    assert.same({ 4, 1 }, s(fsdp.randn { 4, 2 }):shape())
    local list = nn.ModuleList { nn.Linear(2, 2), nn.Linear(2, 2) }
    list:append(nn.Linear(2, 1))
    assert.equal(3, list:len())
    assert.same({ "0.weight", "0.bias", "1.weight", "1.bias", "2.weight", "2.bias" }, names_of(list:named_parameters()))
    local x = fsdp.randn { 1, 2 }
    for _, m in list:ipairs() do x = m(x) end
    assert.same({ 1, 1 }, x:shape())
    -- subclassing a container still works
    local MySeq = nn.Sequential:extend("MySeq")
    assert.equal("MySeq", MySeq(nn.ReLU()).__name)
  end)

  it("gradients through a small model pass a finite-difference check", function()
    fsdp.manual_seed(2)
    local model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))
    local x = fsdp.randn { 2, 3 }
    local params = model:parameters()
    H.gradcheck(function() return model(x) end, params)
  end)

  it("F is reachable as fsdp.F and fsdp.nn.functional; sdpa takes causal / is_causal", function()
    assert.equal(fsdp.F, fsdp.nn.functional)
    local q, k, v = fsdp.randn { 1, 2, 4, 3 }, fsdp.randn { 1, 2, 4, 3 }, fsdp.randn { 1, 2, 4, 3 }
    local a = F.scaled_dot_product_attention(q, k, v, { causal = true })
    local b = F.scaled_dot_product_attention(q, k, v, { is_causal = true })
    H.assert_close(a, b, 0, 0)
    -- the first query of a causal attention sees only the first value
    H.assert_close(a:narrow(3, 1, 1), v:narrow(3, 1, 1), 1e-6, 1e-6)
    -- an additive mask that blocks j > i equals causal
    local mask = fsdp.tensor { { 0, -1e9, -1e9, -1e9 }, { 0, 0, -1e9, -1e9 }, { 0, 0, 0, -1e9 }, { 0, 0, 0, 0 } }
    H.assert_close(F.scaled_dot_product_attention(q, k, v, { attn_mask = mask }), a, 1e-6, 1e-5)
  end)
end)
