-- Issue 19 item 6: the spellings a PyTorch user types. Every constructor and functional op takes
-- its positional arguments by name too (fsdp.args), `inplace` is accepted, optimizers take a
-- positional learning rate, model:forward(x) works under FSDP, and nn.Identity, nn.ModuleDict,
-- ModuleList's insert/indexing and m:isinstance(cls) exist.
local H = require "helpers"
local fsdp = require "fsdp"
local nn, F, optim = fsdp.nn, fsdp.F, fsdp.optim

-- the module made by `make` after seeding, as (repr, state dict as tables)
local function made(make)
  fsdp.manual_seed(7)
  local m = make()
  local sd = {}
  for k, v in pairs(m:state_dict()) do sd[k] = v:tolist() end
  return tostring(m), sd, m
end

-- each of `forms` builds the same module (repr and parameters) as the first one
local function same_modules(forms)
  local repr0, sd0 = made(forms[1])
  for i = 2, #forms do
    local repr, sd = made(forms[i])
    assert.are.equal(repr0, repr, "form " .. i)
    assert.are.same(H.sorted_keys(sd0), H.sorted_keys(sd), "form " .. i)
    for k, v in pairs(sd0) do assert.are.same(v, sd[k], ("form %d, %s"):format(i, k)) end
  end
end

describe("keyword forms of positional arguments", function()
  it("build the same layer as the positional form", function()
    same_modules {
      function() return nn.Conv2d(3, 8, 3, 2, 1) end,
      function() return nn.Conv2d(3, 8, { kernel_size = 3, stride = 2, padding = 1 }) end,
      function() return nn.Conv2d(3, 8, 3, { stride = 2, padding = 1 }) end,
      function() return nn.Conv2d({ in_channels = 3, out_channels = 8, kernel_size = 3, stride = 2, padding = 1 }) end,
    }
    same_modules {
      function() return nn.Conv2d(4, 4, { 3, 3 }, 1, 0, 1, 2, false) end,
      function() return nn.Conv2d(4, 4, { kernel_size = { 3, 3 }, groups = 2, bias = false }) end,
    }
    same_modules {
      function() return nn.Linear(4, 8, false) end,
      function() return nn.Linear(4, 8, { bias = false }) end,
      function() return nn.Linear({ in_features = 4, out_features = 8, bias = false }) end,
    }
    same_modules { function() return nn.Linear(4, 8) end, function() return nn.Linear({ in_features = 4, out_features = 8 }) end }
    same_modules {
      function() return nn.MaxPool2d(3, 2, 1) end,
      function() return nn.MaxPool2d({ kernel_size = 3, stride = 2, padding = 1 }) end,
      function() return nn.MaxPool2d(3, { padding = 1, stride = 2 }) end,
    }
    same_modules { function() return nn.AvgPool2d(2, 1) end, function() return nn.AvgPool2d({ kernel_size = 2, stride = 1 }) end }
    same_modules { function() return nn.AdaptiveAvgPool2d(2) end, function() return nn.AdaptiveAvgPool2d({ output_size = 2 }) end }
    same_modules {
      function() return nn.Embedding(10, 4, 0) end,
      function() return nn.Embedding({ num_embeddings = 10, embedding_dim = 4, padding_idx = 0 }) end,
      function() return nn.Embedding(10, { embedding_dim = 4, padding_idx = 0 }) end,
    }
    same_modules {
      function() return nn.LayerNorm(6, 1e-3, true, false) end,
      function() return nn.LayerNorm({ normalized_shape = 6, eps = 1e-3, bias = false }) end,
      function() return nn.LayerNorm({ 6 }, { eps = 1e-3, bias = false }) end,
    }
    same_modules { function() return nn.Dropout(0.2) end, function() return nn.Dropout({ p = 0.2 }) end }
    same_modules { function() return nn.Softmax(2) end, function() return nn.Softmax({ dim = 2 }) end }
    same_modules { function() return nn.GELU("tanh") end, function() return nn.GELU({ approximate = "tanh" }) end }
    same_modules { function() return nn.Flatten(1, 2) end, function() return nn.Flatten({ start_dim = 1, end_dim = 2 }) end }
    -- the layers added beside this work (convolution and normalization) take the same forms
    same_modules {
      function() return nn.ConvTranspose2d(4, 6, 3, 2, 1, 1, 2, false) end,
      function() return nn.ConvTranspose2d(4, 6, 3, { stride = 2, padding = 1, output_padding = 1, groups = 2, bias = false }) end,
      function() return nn.ConvTranspose2d({ in_channels = 4, out_channels = 6, kernel_size = 3, stride = 2, padding = 1,
        output_padding = 1, groups = 2, bias = false }) end,
    }
    same_modules {
      function() return nn.BatchNorm2d(5, 1e-3, 0.2, false) end,
      function() return nn.BatchNorm2d({ num_features = 5, eps = 1e-3, momentum = 0.2, affine = false }) end,
      function() return nn.BatchNorm2d(5, { eps = 1e-3, momentum = 0.2, affine = false }) end,
    }
    same_modules {
      function() return nn.GroupNorm(2, 6, 1e-3) end,
      function() return nn.GroupNorm({ num_groups = 2, num_channels = 6, eps = 1e-3 }) end,
    }
    same_modules {
      function() return nn.RMSNorm(6, 1e-4, false) end,
      function() return nn.RMSNorm({ normalized_shape = 6, eps = 1e-4, elementwise_affine = false }) end,
    }
    same_modules { function() return nn.Dropout2d(0.3) end, function() return nn.Dropout2d({ p = 0.3 }) end }
    local ce = nn.CrossEntropyLoss({ ignore_index = 1, label_smoothing = 0.1 })
    assert.are.equal(1, ce.ignore_index)
    assert.are.equal(0.1, ce.label_smoothing)
    assert.are.equal(2, nn.CrossEntropyLoss(nil, nil, 2).ignore_index)  -- PyTorch's positional order
  end)

  it("call the same functional op as the positional form", function()
    fsdp.manual_seed(3)
    local x, w, b = fsdp.randn(1, 2, 6, 6), fsdp.randn(4, 2, 3, 3), fsdp.randn(4)
    local want = F.conv2d(x, w, b, 2, 1)
    H.assert_close(F.conv2d(x, w, { bias = b, stride = 2, padding = 1 }), want, 0, 0)
    H.assert_close(F.conv2d(x, w, b, { stride = 2, padding = 1 }), want, 0, 0)
    local xl, wl, bl = fsdp.randn(3, 4), fsdp.randn(5, 4), fsdp.randn(5)
    H.assert_close(F.linear(xl, wl, { bias = bl }), F.linear(xl, wl, bl), 0, 0)
    H.assert_close(F.max_pool2d(x, { kernel_size = 3, stride = 2, padding = 1 }), F.max_pool2d(x, 3, 2, 1), 0, 0)
    H.assert_close(F.avg_pool2d(x, { kernel_size = 2 }), F.avg_pool2d(x, 2), 0, 0)
    H.assert_close(F.adaptive_avg_pool2d(x, { output_size = 2 }), F.adaptive_avg_pool2d(x, 2), 0, 0)
    H.assert_close(F.softmax(xl, { dim = 1 }), F.softmax(xl, 1), 0, 0)
    H.assert_close(F.log_softmax(xl, { dim = -1 }), F.log_softmax(xl, -1), 0, 0)
    H.assert_close(F.gelu(xl, { approximate = "tanh" }), F.gelu(xl, "tanh"), 0, 0)
    H.assert_close(F.flatten(x, { start_dim = 2 }), F.flatten(x, 2), 0, 0)
    local g, bb = fsdp.randn(4), fsdp.randn(4)
    H.assert_close(F.layer_norm(xl, { normalized_shape = { 4 }, weight = g, bias = bb, eps = 1e-3 }),
      F.layer_norm(xl, 4, g, bb, 1e-3), 0, 0)
    local idx = fsdp.tensor({ 0, 2, 1 }, "int64")
    H.assert_close(F.embedding(idx, wl, { padding_idx = 2 }), F.embedding(idx, wl, 2), 0, 0)
    local t = fsdp.tensor({ 1, 0, 3 }, "int64")
    H.assert_close(F.cross_entropy(xl, t, { ignore_index = 0 }), F.cross_entropy(xl, t, nil, nil, 0), 0, 0)
    H.assert_close(F.dropout(xl, { p = 0.5, training = false }), xl, 0, 0)
    fsdp.manual_seed(5); local d1 = F.dropout(xl, 0.3)
    fsdp.manual_seed(5); local d2 = F.dropout(xl, { p = 0.3 })
    H.assert_close(d1, d2, 0, 0)
    local xt, wt = fsdp.randn(1, 4, 5, 5), fsdp.randn(4, 3, 3, 3)
    H.assert_close(F.conv_transpose2d(xt, wt, { bias = bb:narrow(1, 1, 3), stride = 2, output_padding = 1 }),
      F.conv_transpose2d(xt, wt, bb:narrow(1, 1, 3), 2, 0, 1), 0, 0)
    local gx, gw = fsdp.randn(2, 6, 3), fsdp.randn(6)
    H.assert_close(F.group_norm(gx, { num_groups = 3, weight = gw, eps = 1e-3 }), F.group_norm(gx, 3, gw, nil, 1e-3), 0, 0)
    H.assert_close(F.rms_norm(gx, { normalized_shape = 3, eps = 1e-3 }), F.rms_norm(gx, 3, nil, 1e-3), 0, 0)
    local rm, rv = fsdp.zeros(6), fsdp.ones(6)
    H.assert_close(F.batch_norm(gx, rm, rv, { weight = gw, training = true, momentum = 0.5 }),
      F.batch_norm(gx, rm:clone(), rv:clone(), gw, nil, true, 0.5), 0, 0)
    H.assert_close(F.dropout2d(x, { p = 0.5, training = false }), x, 0, 0)
    local q = fsdp.randn(1, 3, 4)
    H.assert_close(F.scaled_dot_product_attention(q, q, q, { is_causal = true }),
      F.scaled_dot_product_attention(q, q, q, nil, 0, true), 0, 0)
  end)

  it("reject a value given both ways, an unknown name, extra or missing arguments, naming the call", function()
    H.assert_error(function() return nn.Conv2d(3, 64, 3, { kernel_size = 3 }) end, "Conv2d: kernel_size given twice")
    H.assert_error(function() return nn.Conv2d(3, 64, { kernel_sise = 3 }) end, "Conv2d: unknown option kernel_sise")
    H.assert_error(function() return nn.Conv2d(3, 64) end, "Conv2d: kernel_size is required")
    H.assert_error(function() return nn.Linear(4, { out_features = 8, in_features = 2 }) end, "Linear: in_features given twice")
    H.assert_error(function() return nn.Linear(4, 8, true, 1) end, "Linear: 4 arguments given, it takes at most 3")
    H.assert_error(function() return nn.Linear({ in_features = 4 }) end, "Linear: out_features is required")
    H.assert_error(function() return nn.Embedding(10, 4, { paddingidx = 0 }) end, "Embedding: unknown option paddingidx")
    H.assert_error(function() return nn.LayerNorm(4, { epsilon = 1 }) end, "LayerNorm: unknown option epsilon")
    H.assert_error(function() return nn.MaxPool2d(2, { strides = 2 }) end, "MaxPool2d: unknown option strides")
    H.assert_error(function() return nn.Dropout(0.1, { p = 0.2 }) end, "Dropout: p given twice")
    H.assert_error(function() return nn.Tanh({ inplace = true }) end, "Tanh: unknown option inplace")
    H.assert_error(function() return nn.CrossEntropyLoss({ reductio = "sum" }) end, "CrossEntropyLoss: unknown option reductio")
    H.assert_error(function() return nn.Softmax({ dims = 1 }) end, "Softmax: unknown option dims")
    local x = fsdp.randn(1, 2, 4, 4)
    H.assert_error(function() return F.conv2d(x, fsdp.randn(2, 2, 3, 3), { strid = 2 }) end, "conv2d: unknown option strid")
    H.assert_error(function() return F.max_pool2d(x, 2, { kernel_size = 2 }) end, "max_pool2d: kernel_size given twice")
    H.assert_error(function() return F.softmax(fsdp.randn(2), 1, { dim = 1 }) end, "softmax: dim given twice")
    H.assert_error(function() return F.dropout(x, { prob = 0.1 }) end, "dropout: unknown option prob")
  end)
end)

describe("fsdp.args", function()
  local args = require "fsdp.args"
  it("merges positional and named arguments, with defaults; a list is positional, {} in a list's place too", function()
    local spec = { { "a" }, { "b", 2 }, { "c", optional = true, list = true }, { "d", false, kw = true } }
    assert.are.same({ a = 1, b = 2, d = false }, args("f", spec, 1))
    assert.are.same({ a = 1, b = 3, c = { 4 }, d = true }, args("f", spec, 1, 3, { 4 }, { d = true }))
    assert.are.same({ a = 1, b = 2, c = {}, d = false }, args("f", spec, 1, nil, {}))
    assert.are.same({ a = 5, b = 2, d = false }, args("f", spec, { a = 5 }))
    H.assert_error(function() return args("f", spec, 1, 2, 3, 4) end, "f: 4 arguments given, it takes at most 3")
    H.assert_error(function() return args("f", spec, { b = 1 }) end, "f: a is required")
  end)
  it("reads the older names-only form leniently", function()
    assert.are.same({ stride = 2, padding = 1, other = 3 }, F._args({ "stride", "padding" }, 2, { padding = 1, other = 3 }))
  end)
end)

describe("inplace", function()
  it("is accepted by ReLU and Dropout, positionally or by name, and changes nothing", function()
    local x = fsdp.randn(3, 4)
    for _, m in ipairs { nn.ReLU(true), nn.ReLU({ inplace = true }), nn.ReLU() } do
      H.assert_close(m(x), F.relu(x), 0, 0)
    end
    assert.are.equal("ReLU(inplace=True)", tostring(nn.ReLU({ inplace = true })))
    assert.are.equal("ReLU()", tostring(nn.ReLU()))
    assert.are.equal("Dropout(p=0.5, inplace=True)", tostring(nn.Dropout(0.5, true)))
    local d = nn.Dropout({ p = 0.5, inplace = true })
    d:eval()
    H.assert_close(d(x), x, 0, 0)
    local before = x:tolist()
    d:train()
    fsdp.manual_seed(2); local y = d(x)
    fsdp.manual_seed(2); local z = nn.Dropout(0.5)(x)
    H.assert_close(y, z, 0, 0)
    assert.are.same(before, x:tolist())  -- the input is not written
    H.assert_error(function() return nn.ReLU("yes") end, "ReLU", "inplace", "a boolean")
    H.assert_error(function() return nn.ReLU({ in_place = true }) end, "ReLU: unknown option in_place")
  end)
end)

describe("optimizers' positional learning rate", function()
  local function train(make_opt)
    fsdp.manual_seed(11)
    local m = nn.Linear(3, 2)
    local opt = make_opt(m:parameters())
    local x, y = fsdp.randn(4, 3), fsdp.randn(4, 2)
    for _ = 1, 5 do
      opt:zero_grad()
      F.mse_loss(m(x), y):backward()
      opt:step()
    end
    return m.weight:tolist(), opt.param_groups[1]
  end
  it("trains as the keyword form does", function()
    local cases = {
      { function(p) return optim.SGD(p, { lr = 0.1 }) end, function(p) return optim.SGD(p, 0.1) end },
      { function(p) return optim.SGD(p, { lr = 0.1, momentum = 0.9 }) end, function(p) return optim.SGD(p, 0.1, { momentum = 0.9 }) end,
        function(p) return optim.SGD(p, 0.1, 0.9) end },
      { function(p) return optim.Adam(p, { lr = 1e-2 }) end, function(p) return optim.Adam(p, 1e-2) end },
      { function(p) return optim.AdamW(p, { lr = 1e-2, betas = { 0.8, 0.9 } }) end,
        function(p) return optim.AdamW(p, 1e-2, { 0.8, 0.9 }) end, function(p) return optim.AdamW(p, 1e-2, { betas = { 0.8, 0.9 } }) end },
    }
    for i, c in ipairs(cases) do
      local w0, g0 = train(c[1])
      for j = 2, #c do
        local w, g = train(c[j])
        assert.are.same(w0, w, ("case %d form %d"):format(i, j))
        assert.are.equal(g0.lr, g.lr)
        assert.are.equal(g0.momentum, g.momentum)
      end
    end
    local _, g = train(function(p) return optim.SGD(p, 0.1, { momentum = 0.9 }) end)
    assert.are.equal(0.1, g.lr)
    assert.are.equal(0.9, g.momentum)
  end)
  it("rejects an option given twice or unknown, naming the optimizer", function()
    local p = { fsdp.randn(2):requires_grad_() }
    H.assert_error(function() return optim.SGD(p, 0.1, { lr = 0.2 }) end, "SGD: lr given twice")
    H.assert_error(function() return optim.SGD(p, { lr = 0.1, momentun = 0.9 }) end, "SGD: unknown option momentun")
    H.assert_error(function() return optim.Adam(p, 1e-3, { momentum = 0.9 }) end, "Adam: unknown option momentum")
    H.assert_error(function() return optim.AdamW(p, "fast") end, "AdamW", "lr")
  end)
end)

describe("model:forward(x) under FSDP", function()
  it("runs the unit's protocol as model(x) does", function()
    local function make()
      fsdp.manual_seed(4)
      return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    end
    local x = fsdp.randn(3, 4)
    local ref = make()
    local want = ref(x)
    want:sum():backward()
    local m = make()
    fsdp.wrap(m:get(1))
    fsdp.wrap(m)
    local y = m:forward(x)
    H.assert_close(y, want, 0, 0)
    H.assert_close(m:get(1):forward(x), ref:get(1)(x), 0, 0)
    y:sum():backward()
    H.assert_close(m:get(1).weight.grad, ref:get(1).weight.grad, 0, 0)
    H.assert_close(m(x), want, 0, 0)
  end)
  it("computes in the unit's param_dtype, as model(x) does", function()
    fsdp.manual_seed(4)
    local m = nn.Linear(4, 3)
    fsdp.wrap(m, { mixed_precision = { param = "bf16" } })
    local x = fsdp.randn(2, 4)
    local y = m:forward(x)
    assert.are.equal("bfloat16", y.dtype)
    H.assert_close(y, m(x), 0, 0)
  end)
  it("says which module and argument when given a table instead of a tensor", function()
    local m = nn.Sequential(nn.Linear(4, 2))
    fsdp.wrap(m)
    H.assert_error(function() return m({ fsdp.randn(3, 4) }) end, "linear: expected a tensor as input, got a table",
      "in module 0 (Linear)")
  end)
end)

describe("containers and classes", function()
  it("nn.Identity passes its input through and takes any arguments", function()
    local x = fsdp.randn(2, 3)
    assert.are.equal(x, nn.Identity()(x))
    assert.are.equal(x, nn.Identity(54, { unused_argument1 = 0.1 })(x))
  end)

  it("nn.ModuleDict keeps insertion order from pairs, sorted order from a table, PyTorch's keys", function()
    local d = nn.ModuleDict({ { "enc", nn.Linear(2, 3) }, { "act", nn.ReLU() }, { "dec", nn.Linear(3, 1) } })
    assert.are.same({ "enc", "act", "dec" }, d:keys())
    assert.are.same({ "dec.bias", "dec.weight", "enc.bias", "enc.weight" }, H.sorted_keys(d:state_dict()))
    local names = {}
    for name in d:named_parameters() do names[#names + 1] = name end
    assert.are.same({ "enc.weight", "enc.bias", "dec.weight", "dec.bias" }, names)
    assert.are.equal(3, d:len())
    assert.is_true(d:contains("act"))
    assert.is_true(d.enc:isinstance(nn.Linear))
    assert.are.equal(d.enc, d:get("enc"))
    local it = {}
    for name, m in d:items() do it[#it + 1] = name .. "=" .. m.__name end
    assert.are.same({ "enc=Linear", "act=ReLU", "dec=Linear" }, it)
    d.extra = nn.Tanh()
    assert.are.same({ "enc", "act", "dec", "extra" }, d:keys())
    assert.are.equal("Tanh", d:pop("extra").__name)
    assert.is_false(d:contains("extra"))
    local outer = nn.Module()
    outer.heads = d
    assert.truthy(outer:state_dict()["heads.enc.weight"])
    local t = nn.ModuleDict({ zeta = nn.ReLU(), alpha = nn.Tanh(), mid = nn.Sigmoid() })
    assert.are.same({ "alpha", "mid", "zeta" }, t:keys())
    t:update({ { "omega", nn.ReLU() } })
    assert.are.same({ "alpha", "mid", "zeta", "omega" }, t:keys())
    assert.are.same(t:keys(), nn.ModuleDict(t):keys())
    t:clear()
    assert.are.equal(0, t:len())
    H.assert_error(function() return nn.ModuleDict({ a = 1 }) end, "ModuleDict", "\"a\"", "not a Module")
    H.assert_error(function() return nn.ModuleDict({ { "a.b", nn.ReLU() } }) end, "ModuleDict", "a.b")
    H.assert_error(function() return d:get("nope") end, "ModuleDict:get", "nope")
  end)

  it("nn.ModuleList appends, extends, inserts, indexes and iterates", function()
    local a, b, c, e = nn.Linear(1, 2), nn.Linear(2, 3), nn.ReLU(), nn.Tanh()
    local l = nn.ModuleList({ a })
    l:append(b)
    l:extend({ c })
    l:insert(1, e)
    assert.are.equal(4, l:len())
    assert.are.equal(e, l[1])
    assert.are.equal(a, l[2])
    assert.are.equal(c, l[-1])
    local seen = {}
    for i, m in l:ipairs() do seen[i] = m end
    assert.are.same({ e, a, b, c }, seen)
    assert.are.same({ "1.bias", "1.weight", "2.bias", "2.weight" }, H.sorted_keys(l:state_dict()))
    l:insert(-1, nn.Sigmoid())  -- before the last, as PyTorch's insert(-1, m)
    assert.are.equal("Sigmoid", l[4].__name)
    assert.are.equal(c, l[5])
    H.assert_error(function() return l:insert(9, nn.ReLU()) end, "ModuleList:insert(9)", "out of range")
    H.assert_error(function() return l[9] end, "ModuleList:get(9)", "out of range")
    assert.are.equal(b, nn.Sequential(a, b)[2])
    local Stack = nn.ModuleList:extend("Stack")  -- a subclass indexes the same way
    assert.are.equal(b, Stack({ a, b })[-1])
  end)

  it("m:isinstance(cls) follows the class hierarchy of Module:extend", function()
    local Block = nn.Module:extend("Block")
    local Special = Block:extend("Special")
    local s = Special()
    assert.is_true(s:isinstance(Special))
    assert.is_true(s:isinstance(Block))
    assert.is_true(s:isinstance(nn.Module))
    assert.is_false(s:isinstance(nn.Linear))
    assert.is_false(Block():isinstance(Special))
    assert.is_true(nn.Linear(1, 1):isinstance({ nn.Conv2d, nn.Linear }))
    assert.is_false(nn.Module.isinstance(3, nn.Linear))
    assert.is_true(nn.Module.is(s))
    H.assert_error(function() return s:isinstance("Linear") end, "isinstance", "class")
  end)
end)

describe("fsdp.wrap's options", function()
  it("are checked by name: another framework's spelling is an error that says ours", function()
    H.assert_error(function() fsdp.wrap(nn.Linear(2, 2), { param_dtype = "bfloat16" }) end,
      'fsdp.wrap: unknown option param_dtype (it takes sharding, shard_group_size, reshard_after_forward, '
      .. 'mixed_precision, forward_prefetch, backward_prefetch, sync_module_states, offload, checkpoint, min_params, module_classes); '
      .. 'mixed precision is mixed_precision = {param = "bf16"}')
    H.assert_error(function() fsdp.wrap(nn.Linear(2, 2), { mixed_precision = { params = "bf16" } }) end,
      "fsdp.wrap: unknown mixed_precision part params (param, reduce, output, cast_forward_inputs)")
    H.assert_error(function() fsdp.auto_wrap(nn.Sequential(nn.Linear(2, 2)), { min_param = 1 }) end,
      "fsdp.wrap: unknown option min_param")
    local m = fsdp.wrap(nn.Linear(2, 2), { sharding = "full", mixed_precision = { param = "bf16", reduce = "fp32" } })
    assert.equal("bfloat16", m(fsdp.randn(3, 2)).dtype)
  end)
end)
