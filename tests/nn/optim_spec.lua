-- fsdp.optim: SGD, Adam and AdamW against references written in plain Lua arithmetic (PyTorch's
-- documented formulas, in double precision), param groups, state_dict round trips, memory
-- accounting of optimizer state, and errors.
local ffi = require "ffi"
local fsdp = require "fsdp"
local H = require "helpers"
local optim, nn = fsdp.optim, fsdp.nn
local C = fsdp.C

-- float32 rounding against a double reference over a few steps
local ATOL, RTOL = 1e-6, 1e-5

local function leaf(values, shape)
  local t = fsdp.tensor(values)
  if shape then t = t:reshape(shape):clone():detach() end
  t.requires_grad = true
  return t
end

-- fixed gradients for step k (1-based): deterministic, signs mixed, magnitudes varied
local function grad_values(n, k, salt)
  local g = {}
  for i = 1, n do g[i] = math.sin(i * 1.7 + k * 0.9 + (salt or 0)) * (1 + (i % 3)) end
  return g
end

-- ---- reference implementations (torch.optim formulas, doubles) ------------------------------------
local function ref_sgd(p, grads, o)
  p = { unpack(p) }
  local buf
  local lr, mom, damp, wd = o.lr, o.momentum or 0, o.dampening or 0, o.weight_decay or 0
  for k = 1, #grads do
    for i = 1, #p do
      local d = grads[k][i]
      if o.maximize then d = -d end
      d = d + wd * p[i]
      if mom ~= 0 then
        buf = buf or {}
        if k == 1 then buf[i] = d else buf[i] = mom * buf[i] + (1 - damp) * d end
        if o.nesterov then d = d + mom * buf[i] else d = buf[i] end
      end
      p[i] = p[i] - lr * d
    end
  end
  return p, buf
end

local function ref_adam(p, grads, o, decoupled)
  p = { unpack(p) }
  local lr, b1, b2, eps = o.lr or 1e-3, (o.betas or { 0.9, 0.999 })[1], (o.betas or { 0.9, 0.999 })[2], o.eps or 1e-8
  local wd = o.weight_decay or (decoupled and 1e-2 or 0)
  local m, v, vmax = {}, {}, {}
  for i = 1, #p do m[i], v[i], vmax[i] = 0, 0, 0 end
  for t = 1, #grads do
    for i = 1, #p do
      local g = grads[t][i]
      if o.maximize then g = -g end
      if decoupled then p[i] = p[i] * (1 - lr * wd) else g = g + wd * p[i] end
      m[i] = b1 * m[i] + (1 - b1) * g
      v[i] = b2 * v[i] + (1 - b2) * g * g
      local vv = v[i]
      if o.amsgrad then vmax[i] = math.max(vmax[i], v[i]); vv = vmax[i] end
      local denom = math.sqrt(vv) / math.sqrt(1 - b2 ^ t) + eps
      p[i] = p[i] - lr / (1 - b1 ^ t) * m[i] / denom
    end
  end
  return p, m, v, vmax
end

-- runs `make_opt` on a (2, 3) parameter for #grads steps with the given gradients
local P0 = { 0.5, -1.25, 2.0, 0.75, -0.3, 1.1 }
local function run_steps(make_opt, nsteps, salt)
  local p = leaf(P0, { 2, 3 })
  local opt = make_opt({ p })
  local grads = {}
  for k = 1, nsteps do
    grads[k] = grad_values(6, k, salt)
    p.grad = fsdp.tensor(grads[k]):reshape(2, 3)
    opt:step()
  end
  return p, grads, opt
end

describe("optim.SGD", function()
  local cases = {
    { name = "plain", o = { lr = 0.1 } },
    { name = "weight decay", o = { lr = 0.1, weight_decay = 0.05 } },
    { name = "momentum", o = { lr = 0.1, momentum = 0.9 } },
    { name = "momentum + dampening", o = { lr = 0.05, momentum = 0.8, dampening = 0.3 } },
    { name = "nesterov + weight decay", o = { lr = 0.05, momentum = 0.9, nesterov = true, weight_decay = 0.01 } },
    { name = "maximize + momentum", o = { lr = 0.1, momentum = 0.5, maximize = true } },
  }
  for _, c in ipairs(cases) do
    it("matches the reference over 4 steps: " .. c.name, function()
      local p, grads, opt = run_steps(function(ps) return optim.SGD(ps, c.o) end, 4)
      local want, buf = ref_sgd(P0, grads, c.o)
      H.assert_close(p, want, ATOL, RTOL, c.name)
      local st = opt:state_of(p)
      if (c.o.momentum or 0) ~= 0 then
        H.assert_close(st.momentum_buffer, buf, ATOL, RTOL, c.name .. " buffer")
      else
        assert.is_nil(st.momentum_buffer)
      end
    end)
  end

  it("moves a parameter by exactly -lr * grad on a plain step (hand-computed)", function()
    local p = leaf { 1, 2 }
    local opt = optim.SGD({ p }, { lr = 0.5 })
    p.grad = fsdp.tensor { 0.25, -1 }
    opt:step()
    assert.same({ 0.875, 2.5 }, p:tolist())
  end)

  it("uses torch.optim's default lr of 1e-3", function()
    local p = leaf { 1 }
    local opt = optim.SGD({ p })
    assert.equal(1e-3, opt.param_groups[1].lr)
    p.grad = fsdp.tensor { 1 }
    opt:step()
    H.assert_close(p, { 1 - 1e-3 }, 1e-7, 0)
  end)

  it("takes lr changes on param_groups into account at the next step", function()
    local p = leaf { 1 }
    local opt = optim.SGD({ p }, { lr = 0.1 })
    p.grad = fsdp.tensor { 1 }
    opt:step()
    opt.param_groups[1].lr = 0.01
    opt:step()
    H.assert_close(p, { 1 - 0.1 - 0.01 }, 1e-7, 0)
  end)
end)

describe("optim.Adam / AdamW", function()
  local cases = {
    { name = "Adam defaults", cls = "Adam", o = {} },
    { name = "Adam lr, betas, eps", cls = "Adam", o = { lr = 0.01, betas = { 0.8, 0.99 }, eps = 1e-6 } },
    { name = "Adam weight decay (L2)", cls = "Adam", o = { lr = 0.01, weight_decay = 0.1 } },
    { name = "Adam amsgrad", cls = "Adam", o = { lr = 0.01, amsgrad = true } },
    { name = "Adam maximize", cls = "Adam", o = { lr = 0.01, maximize = true } },
    { name = "AdamW defaults (wd 1e-2)", cls = "AdamW", o = { lr = 0.01 } },
    { name = "AdamW wd + amsgrad", cls = "AdamW", o = { lr = 0.02, weight_decay = 0.3, amsgrad = true } },
  }
  for _, c in ipairs(cases) do
    it("matches the reference over 5 steps: " .. c.name, function()
      local p, grads, opt = run_steps(function(ps) return optim[c.cls](ps, c.o) end, 5)
      local want, m, v, vmax = ref_adam(P0, grads, c.o, c.cls == "AdamW")
      H.assert_close(p, want, ATOL, RTOL, c.name)
      local st = opt:state_of(p)
      assert.equal(5, st.step)
      H.assert_close(st.exp_avg, m, ATOL, RTOL, c.name .. " exp_avg")
      H.assert_close(st.exp_avg_sq, v, ATOL, RTOL, c.name .. " exp_avg_sq")
      if c.o.amsgrad then
        H.assert_close(st.max_exp_avg_sq, vmax, ATOL, RTOL, c.name .. " max_exp_avg_sq")
      else
        assert.is_nil(st.max_exp_avg_sq)
      end
    end)
  end

  it("amsgrad makes a difference when gradients shrink (the reference is not vacuous)", function()
    local grads = { { 10 }, { 0.1 }, { 0.1 } }
    local a = ref_adam({ 0 }, grads, { lr = 0.1, betas = { 0.9, 0.5 }, amsgrad = true })
    local b = ref_adam({ 0 }, grads, { lr = 0.1, betas = { 0.9, 0.5 } })
    assert(math.abs(a[1] - b[1]) > 1e-2)
    local p = leaf { 0 }
    local opt = optim.Adam({ p }, { lr = 0.1, betas = { 0.9, 0.5 }, amsgrad = true })
    for k = 1, 3 do p.grad = fsdp.tensor(grads[k]); opt:step() end
    H.assert_close(p, a, 1e-6, 1e-5)
  end)

  it("first Adam step moves every element by about lr against the gradient's sign (hand-computed)", function()
    local p = leaf { 0, 0, 0 }
    local opt = optim.Adam({ p }, { lr = 0.1 })
    p.grad = fsdp.tensor { 2, -3, 0.5 }
    opt:step()
    -- m/(1-b1) = g, sqrt(v/(1-b2)) = |g|: step = lr * g / (|g| + eps)
    H.assert_close(p, { -0.1, 0.1, -0.1 }, 1e-6, 0)
  end)

  it("AdamW decays weights even with a zero gradient, Adam with L2 too but differently", function()
    local p1, p2 = leaf { 2 }, leaf { 2 }
    local o1 = optim.AdamW({ p1 }, { lr = 0.1, weight_decay = 0.5 })
    local o2 = optim.Adam({ p2 }, { lr = 0.1, weight_decay = 0.5 })
    p1.grad, p2.grad = fsdp.tensor { 0 }, fsdp.tensor { 0 }
    o1:step(); o2:step()
    H.assert_close(p1, { 2 * (1 - 0.05) }, 1e-6, 0)  -- decoupled: only the decay
    H.assert_close(p2, { 2 - 0.1 }, 1e-6, 0)          -- L2: grad = 1, normalized step of lr
  end)
end)

describe("optimizers", function()
  it("handle param groups with their own hyperparameters, filling the rest from defaults", function()
    local a, b = leaf { 1, 2 }, leaf { 3 }
    local opt = optim.SGD({ { params = { a } }, { params = { b }, lr = 0.5, momentum = 0.9 } }, { lr = 0.1 })
    assert.equal(0.1, opt.param_groups[1].lr)
    assert.equal(0, opt.param_groups[1].momentum)
    assert.equal(0.5, opt.param_groups[2].lr)
    a.grad, b.grad = fsdp.tensor { 1, 1 }, fsdp.tensor { 1 }
    opt:step()
    H.assert_close(a, { 0.9, 1.9 }, 1e-7, 0)
    H.assert_close(b, { 2.5 }, 1e-7, 0)
    opt:add_param_group { params = leaf { 0 }, lr = 1 }
    assert.equal(3, #opt.param_groups)
  end)

  it("skip parameters without a gradient (no state, no change)", function()
    local a, b = leaf { 1 }, leaf { 2 }
    local opt = optim.Adam({ a, b }, { lr = 0.1 })
    a.grad = fsdp.tensor { 1 }
    opt:step()
    assert.same({ 2 }, b:tolist())
    assert.is_nil(opt:state_of(b))
    assert.equal(1, opt:state_of(a).step)
    H.assert_close(a, { 0.9 }, 1e-6, 0)
  end)

  it("step runs under no_grad, keeps params leaves, restores grad mode and bumps versions", function()
    local p = leaf { 1, 2 }
    local opt = optim.SGD({ p }, { lr = 0.1, momentum = 0.9 })
    p.grad = fsdp.tensor { 1, 1 }
    local v0 = p:version()
    opt:step()
    assert.is_true(p.is_leaf)
    assert.is_true(p.requires_grad)
    assert.is_nil(p.grad_fn)
    assert.is_true(fsdp.is_grad_enabled())
    assert(p:version() > v0, "the step must bump the parameter's version")
    -- a loss that saved p before the step cannot be backpropagated through after it
    local q = leaf { 1, 2 }
    local opt2 = optim.SGD({ q }, { lr = 0.1 })
    local loss = (q * q):sum()
    q.grad = fsdp.tensor { 1, 1 }
    opt2:step()
    H.assert_error(function() loss:backward() end)
  end)

  it("accept a non-contiguous gradient", function()
    local p = leaf({ 1, 2, 3, 4, 5, 6 }, { 2, 3 })
    local g = fsdp.tensor({ { 1, 2 }, { 3, 4 }, { 5, 6 } }):t()  -- (2, 3) view, not contiguous
    assert.is_false(g:is_contiguous())
    p.grad = g
    optim.SGD({ p }, { lr = 1 }):step()
    assert.same({ 0, -1, -2, 2, 1, 0 }, p:tolist())  -- p - g^T
  end)

  it("zero_grad drops gradients (set_to_none) or zeroes them", function()
    local p = leaf { 1, 2 }
    local opt = optim.SGD({ p }, { lr = 0.1 })
    p.grad = fsdp.tensor { 3, 4 }
    opt:zero_grad(false)
    assert.same({ 0, 0 }, p.grad:tolist())
    opt:zero_grad()
    assert.is_nil(p.grad)
  end)

  it("train a model end to end (loss decreases) with model:parameters()", function()
    fsdp.manual_seed(1)
    local model = nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 1))
    local x = fsdp.randn { 32, 4 }
    local y = (x:sum(2, true) * 0.5):detach()
    for _, cls in ipairs { "SGD", "Adam", "AdamW" } do
      local m = nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 1))
      m:load_state_dict(model:state_dict())
      local opt = optim[cls](m:parameters(), { lr = cls == "SGD" and 0.1 or 0.01, momentum = cls == "SGD" and 0.9 or nil })
      local first, last
      for i = 1, 60 do
        local loss = fsdp.F.mse_loss(m(x), y)
        opt:zero_grad(); loss:backward(); opt:step()
        if i == 1 then first = loss:item() end
        last = loss:item()
      end
      assert(last < 0.2 * first, ("%s: loss %.4g -> %.4g"):format(cls, first, last))
    end
  end)

  it("step(closure) evaluates the closure and returns its loss", function()
    local p = leaf { 3 }
    local opt = optim.SGD({ p }, { lr = 0.1 })
    local loss = opt:step(function()
      opt:zero_grad()
      local l = (p * p):sum()
      l:backward()
      return l
    end)
    assert.equal(9, loss:item())
    H.assert_close(p, { 3 - 0.1 * 6 }, 1e-6, 0)
  end)

  it("OpenMP-sized tensors give the same result as small ones (fused kernels, one pass)", function()
    local n = 40000  -- above the kernels' parallel threshold
    fsdp.manual_seed(3)
    local pbig, gbig = fsdp.randn { n }, fsdp.randn { n }
    pbig.requires_grad = true
    local idx = { 1, 17, 20000, 39999, 40000 }
    local small = {}
    for i, j in ipairs(idx) do
      small[i] = leaf { pbig:narrow(1, j, 1):item() }
    end
    for _, cls in ipairs { "SGD", "Adam", "AdamW" } do
      local o = { lr = 0.01, momentum = 0.9, weight_decay = 0.1, amsgrad = true }
      if cls == "SGD" then o.amsgrad = nil else o.momentum = nil end
      local ob, os = optim[cls]({ pbig }, o), optim[cls](small, o)
      for _ = 1, 3 do
        pbig.grad = gbig
        for i, j in ipairs(idx) do small[i].grad = fsdp.tensor { gbig:narrow(1, j, 1):item() } end
        ob:step(); os:step()
      end
      for i, j in ipairs(idx) do
        assert.equal(small[i]:item(), pbig:narrow(1, j, 1):item(), cls .. " element " .. j)
      end
    end
  end)
end)

describe("optimizer state_dict", function()
  local function setup(cls, o)
    local a = leaf({ 0.5, -1, 2, 0.25, 1.5, -0.75 }, { 2, 3 })
    local b = leaf { 0.1, 0.2, 0.3 }
    return a, b, optim[cls]({ { params = { a } }, { params = { b }, lr = 0.002 } }, o)
  end
  local function feed(a, b, k)
    a.grad = fsdp.tensor(grad_values(6, k)):reshape(2, 3)
    b.grad = fsdp.tensor(grad_values(3, k, 1))
  end

  it("has PyTorch's layout: integer param indices from 0, state per index, hyperparameters per group", function()
    local a, b, opt = setup("Adam", { lr = 0.01, amsgrad = true })
    feed(a, b, 1); opt:step(); feed(a, b, 2); opt:step()
    local sd = opt:state_dict()
    assert.same({ 0 }, sd.param_groups[1].params)
    assert.same({ 1 }, sd.param_groups[2].params)
    assert.equal(0.01, sd.param_groups[1].lr)
    assert.equal(0.002, sd.param_groups[2].lr)
    assert.same({ 0.9, 0.999 }, sd.param_groups[1].betas)
    assert.equal(1e-8, sd.param_groups[2].eps)
    assert.is_true(sd.param_groups[1].amsgrad)
    assert.equal(2, sd.state[0].step)
    assert.equal(2, sd.state[1].step)
    assert.same({ 2, 3 }, sd.state[0].exp_avg:shape())
    assert.same({ 3 }, sd.state[1].max_exp_avg_sq:shape())
    assert.is_nil(sd.state[2])
  end)

  for _, c in ipairs {
    { cls = "SGD", o = { lr = 0.05, momentum = 0.9, nesterov = true } },
    { cls = "Adam", o = { lr = 0.01, amsgrad = true, weight_decay = 0.01 } },
    { cls = "AdamW", o = { lr = 0.01 } },
  } do
    it("round trip continues identically: " .. c.cls, function()
      local a, b, opt = setup(c.cls, c.o)
      for k = 1, 3 do feed(a, b, k); opt:step() end
      -- a second optimizer on copies of the parameters, loaded from the first one's state_dict
      local a2, b2 = leaf(a:tolist(), { 2, 3 }), leaf(b:tolist())
      local opt2 = optim[c.cls]({ { params = { a2 } }, { params = { b2 } } }, { lr = 123 })
      opt2:load_state_dict(opt:state_dict())
      assert.equal(0.002, opt2.param_groups[2].lr)
      for k = 4, 6 do
        feed(a, b, k); opt:step()
        feed(a2, b2, k); opt2:step()
      end
      assert.same(a:tolist(), a2:tolist())
      assert.same(b:tolist(), b2:tolist())
      -- the loaded state is a copy: the two optimizers do not share buffers
      local k1 = c.cls == "SGD" and "momentum_buffer" or "exp_avg"
      local s1, s2 = opt:state_of(a)[k1], opt2:state_of(a2)[k1]
      assert.is_false(C.fsdp_tensor_same_storage(s1.p, s2.p) ~= 0)
      assert.equal(C.FSDP_MEM_OPTIM, C.fsdp_tensor_mem_category(s2.p))
    end)
  end

  it("rejects a state_dict with other groups or sizes, naming the mismatch, and keeps working", function()
    local a, b, opt = setup("SGD", { lr = 0.1, momentum = 0.9 })
    feed(a, b, 1); opt:step()
    local sd = opt:state_dict()
    local other = optim.SGD({ leaf { 1 } }, { lr = 0.1 })
    H.assert_error(function() other:load_state_dict(sd) end, "2 parameter groups", "has 1")
    local c1 = optim.SGD({ { params = { leaf { 1 }, leaf { 2 } } }, { params = { leaf { 3 } } } }, { lr = 0.1 })
    H.assert_error(function() c1:load_state_dict(sd) end, "group 1", "1 params in the state dict", "2 in the optimizer")
    local wrong = optim.SGD({ { params = { leaf { 1, 2 } } }, { params = { leaf { 3 } } } }, { lr = 0.1 })
    H.assert_error(function() wrong:load_state_dict(sd) end, "momentum_buffer", "(2, 3)", "(2)")
    -- nothing was changed by the failed load, and the original still steps
    assert.is_nil(wrong:state_of(wrong.param_groups[1].params[1]))
    local before = a:tolist()
    feed(a, b, 2); opt:step()
    assert.are_not.same(before, a:tolist())
  end)
end)

describe("optimizer memory", function()
  local function optim_bytes() return fsdp.memory_stats().optimizer.current end

  it("counts state in the optimizer category with exact byte counts", function()
    collectgarbage(); collectgarbage()
    local a, b = leaf({ 1, 2, 3, 4, 5, 6 }, { 2, 3 }), leaf { 1, 2, 3, 4 }  -- 10 elements
    local base = optim_bytes()
    local sgd0 = optim.SGD({ a, b }, { lr = 0.1 })
    a.grad, b.grad = fsdp.ones { 2, 3 }, fsdp.ones { 4 }
    sgd0:step()
    assert.equal(base, optim_bytes())                 -- no momentum: no state
    local sgd = optim.SGD({ a, b }, { lr = 0.1, momentum = 0.9 })
    sgd:step()
    assert.equal(base + 10 * 4, optim_bytes())        -- one f32 buffer per element
    local adam = optim.Adam({ a, b }, { lr = 0.1 })
    adam:step()
    assert.equal(base + 10 * 4 + 2 * 10 * 4, optim_bytes())
    local ams = optim.AdamW({ a }, { lr = 0.1, amsgrad = true })
    ams:step()
    assert.equal(base + 10 * 4 + 2 * 10 * 4 + 3 * 6 * 4, optim_bytes())
    -- the state of a loaded copy is counted too, and everything goes away with the optimizers
    local copy = optim.Adam({ a, b }, { lr = 0.1 })
    copy:load_state_dict(adam:state_dict())
    assert.equal(base + 10 * 4 + 4 * 10 * 4 + 3 * 6 * 4, optim_bytes())
    sgd0, sgd, adam, ams, copy = nil, nil, nil, nil, nil
    collectgarbage(); collectgarbage()
    assert.equal(base, optim_bytes())
  end)
end)

describe("optimizer errors", function()
  it("reject invalid hyperparameters and parameter lists with PyTorch's messages", function()
    local p = leaf { 1 }
    H.assert_error(function() optim.SGD({ p }, { lr = -1 }) end, "SGD", "invalid learning rate", "-1")
    H.assert_error(function() optim.SGD({ p }, { lr = 0.1, nesterov = true }) end, "nesterov", "momentum")
    H.assert_error(function() optim.SGD({ p }, { lr = 0.1, momentum = 0.9, dampening = 0.1, nesterov = true }) end,
      "zero dampening")
    H.assert_error(function() optim.Adam({ p }, { betas = { 1.0, 0.999 } }) end, "Adam", "beta parameter at index 1")
    H.assert_error(function() optim.AdamW({ p }, { eps = -1 }) end, "AdamW", "epsilon")
    H.assert_error(function() optim.Adam({ p }, { weight_decay = -0.1 }) end, "weight_decay")
    H.assert_error(function() optim.SGD({}, { lr = 0.1 }) end, "empty parameter list")
    H.assert_error(function() optim.SGD(p, { lr = 0.1 }) end, "single tensor")
    H.assert_error(function() optim.SGD({ p * 2 }, { lr = 0.1 }) end, "non-leaf")
    H.assert_error(function() optim.SGD({ { params = { p } }, { params = { p } } }, { lr = 0.1 }) end,
      "more than one parameter group")
    H.assert_error(function() optim.SGD({ fsdp.tensor({ 1 }, "int64") }, { lr = 0.1 }) end, "float32", "int64")
  end)

  it("the C kernels check shapes, dtypes and layout, naming the op and shapes; then keep working", function()
    local p = fsdp.zeros { 2, 2 }
    local function sgd(param, grad, buf, momentum, first)
      fsdp._check(C.fsdp_sgd_step(param.p, grad.p, fsdp._p(buf), 0.1, momentum or 0, 0, 0, 0, first or 0, 0))
    end
    local function adam(param, grad, m, v, vmax, ams, step)
      fsdp._check(C.fsdp_adam_step(param.p, grad.p, m.p, v.p, fsdp._p(vmax), step or 1, 0.1, 0.9, 0.999, 1e-8, 0, 0, ams or 0, 0))
    end
    H.assert_error(function() sgd(p, fsdp.zeros { 3 }) end, "sgd_step", "(3)", "(2, 2)")
    H.assert_error(function() sgd(p, fsdp.zeros({ 2, 2 }, { dtype = "int64" })) end, "sgd_step", "grad", "int64")
    H.assert_error(function() sgd(p, fsdp.zeros { 2, 2 }, nil, 0.9) end, "sgd_step", "momentum_buf", "NULL")
    H.assert_error(function() sgd(p, fsdp.zeros { 2, 2 }, fsdp.zeros { 4 }, 0.9) end, "momentum_buf", "(4)", "(2, 2)")
    H.assert_error(function() sgd(fsdp.zeros { 2, 3 }:t(), fsdp.zeros { 3, 2 }) end, "sgd_step", "not contiguous")
    H.assert_error(function() adam(p, fsdp.zeros { 2, 2 }, fsdp.zeros { 2, 2 }, fsdp.zeros { 1 }) end,
      "adam_step", "exp_avg_sq", "(1)", "(2, 2)")
    H.assert_error(function() adam(p, fsdp.zeros { 2, 2 }, fsdp.zeros { 2, 2 }, fsdp.zeros { 2, 2 }, nil, 1) end,
      "adam_step", "max_exp_avg_sq")
    H.assert_error(function() adam(p, fsdp.zeros { 2, 2 }, fsdp.zeros { 2, 2 }, fsdp.zeros { 2, 2 }, nil, 0, 0) end,
      "adam_step", "step must be >= 1")
    -- after the errors a correct call works and gives the right value
    local q, g = fsdp.ones { 2 }, fsdp.tensor { 1, -2 }
    sgd(q, g)
    H.assert_close(q, { 0.9, 1.2 }, 1e-7, 0)
  end)
end)
