-- fsdp.optim.lr_scheduler against torch.optim.lr_scheduler: every scheduler's learning rates (and the
-- momentum or beta1 OneCycleLR cycles), step by step, against golden values from PyTorch
-- (tests/golden/gen_lr_schedulers.py, which holds the same cases); state dicts that resume a schedule
-- exactly, also through a sharded checkpoint; the keyword forms; and errors.
local fsdp = require "fsdp"
local json = require "fsdp.json"
local H = require "helpers"
local S = fsdp.optim.lr_scheduler

local golden = json.decode(H.read_file(H.root .. "/tests/golden/lr_schedulers.json"), "lr_schedulers.json")

-- two parameter groups (lr 0.1 and 0.05), as the generator's optimizer
local function optimizer(kind)
  local groups = { { params = { fsdp.zeros(2):requires_grad_() }, lr = 0.1 },
    { params = { fsdp.zeros(3):requires_grad_() }, lr = 0.05 } }
  if kind == "adam" then return fsdp.optim.Adam(groups, { lr = 0.1, betas = { 0.9, 0.999 } }) end
  return fsdp.optim.SGD(groups, { lr = 0.1, momentum = 0.9 })
end

local PLATEAU = { 1.0, 0.9, 0.95, 0.94, 0.93, 0.92, 0.5, 0.6, 0.6, 0.6, 0.6, 0.49, 0.7, 0.7, 0.7, 0.7, 0.7, 0.7 }
local cases = {
  LambdaLR = { 20, "sgd", function(o) return S.LambdaLR(o, function(e) return 0.95 ^ e end) end },
  StepLR = { 12, "sgd", function(o) return S.StepLR(o, 3, { gamma = 0.5 }) end },
  MultiStepLR = { 12, "sgd", function(o) return S.MultiStepLR(o, { 2, 5, 5, 8 }, { gamma = 0.3 }) end },
  ExponentialLR = { 10, "sgd", function(o) return S.ExponentialLR(o, 0.9) end },
  CosineAnnealingLR = { 25, "sgd", function(o) return S.CosineAnnealingLR(o, 7, { eta_min = 0.001 }) end },
  LinearLR = { 8, "sgd", function(o) return S.LinearLR(o, { start_factor = 0.25, end_factor = 1.0, total_iters = 4 }) end },
  OneCycleLR = { 20, "sgd", function(o) return S.OneCycleLR(o, { 0.5, 0.2 }, { total_steps = 21 }) end },
  OneCycleLR_three_phase_linear_adam = { 30, "adam", function(o)
    return S.OneCycleLR(o, 0.4, { epochs = 5, steps_per_epoch = 7, pct_start = 0.25, anneal_strategy = "linear",
      three_phase = true, div_factor = 10.0, final_div_factor = 100.0 })
  end },
  SequentialLR = { 15, "sgd", function(o)
    return S.SequentialLR(o, { S.LinearLR(o, { start_factor = 0.1, total_iters = 3 }), S.CosineAnnealingLR(o, { T_max = 10 }) },
      { 3 })
  end },
  ReduceLROnPlateau = { #PLATEAU, "sgd", function(o)
    return S.ReduceLROnPlateau(o, { mode = "min", factor = 0.5, patience = 2, threshold = 0.01, cooldown = 1 })
  end },
}

local function momenta(o)
  local r = {}
  for i, g in ipairs(o.param_groups) do r[i] = g.betas and g.betas[1] or g.momentum end
  return r
end
local function lrs(o)
  local r = {}
  for i, g in ipairs(o.param_groups) do r[i] = g.lr end
  return r
end
-- the schedule of a case: learning rates and momenta after construction and after each step
local function run(name, steps_from, s, o, from)
  local c = cases[name]
  local got_lr, got_m = { lrs(o) }, { momenta(o) }
  for k = from or 1, steps_from or c[1] do
    if name == "ReduceLROnPlateau" then s:step(PLATEAU[k]) else s:step() end
    got_lr[#got_lr + 1], got_m[#got_m + 1] = lrs(o), momenta(o)
  end
  return got_lr, got_m
end
local function close(a, b) return math.abs(a - b) <= 1e-13 * math.max(1, math.abs(b)) end

describe("learning-rate schedulers (torch.optim.lr_scheduler)", function()
  for _, name in ipairs(H.sorted_keys(cases)) do
    it(name .. " gives PyTorch's learning rates, step by step", function()
      local want = golden.cases[name]
      local o = optimizer(cases[name][2])
      local s = cases[name][3](o)
      local got_lr, got_m = run(name, nil, s, o)
      assert.equal(#want.lrs, #got_lr)
      for k, row in ipairs(want.lrs) do
        for g, v in ipairs(row) do
          assert(close(got_lr[k][g], v), ("%s: step %d group %d: lr %.17g, PyTorch %.17g"):format(name, k - 1, g, got_lr[k][g], v))
          local m = want.momenta[k][g]
          assert(close(got_m[k][g], m), ("%s: step %d group %d: momentum %.17g, PyTorch %.17g"):format(name, k - 1, g, got_m[k][g], m))
        end
      end
      assert.same(lrs(o), s:get_last_lr())
    end)
  end

  it("resumes a schedule exactly from its state dict (and the optimizer's)", function()
    for _, name in ipairs(H.sorted_keys(cases)) do
      if name ~= "LambdaLR" then  -- (its function is not state: PyTorch leaves it out too)
        local c = cases[name]
        local o = optimizer(c[2])
        local s = c[3](o)
        local whole = run(name, nil, s, o)
        local half = math.floor(c[1] / 2)
        local o1 = optimizer(c[2])
        local s1 = c[3](o1)
        run(name, half, s1, o1)
        -- a new optimizer and scheduler, then the saved states through JSON (as a checkpoint keeps them)
        local sd = json.decode(json.encode(s1:state_dict()), name)
        local osd = o1:state_dict()
        local o2 = optimizer(c[2])
        local s2 = c[3](o2)
        o2:load_state_dict(osd)
        s2:load_state_dict(sd)
        local rest = run(name, c[1], s2, o2, half + 1)
        for k = 2, #rest do
          for g, v in ipairs(rest[k]) do
            assert(close(v, whole[half + k][g]), ("%s: after resuming at step %d, step %d group %d: %.17g, uninterrupted %.17g")
              :format(name, half, half + k - 1, g, v, whole[half + k][g]))
          end
        end
      end
    end
  end)

  it("travels in a sharded checkpoint's extra table", function()
    local dir = H.mkdtemp("fsdp_sched")
    local m = fsdp.nn.Linear(3, 2)
    local o = fsdp.optim.SGD(m:parameters(), 0.1)
    local s = S.CosineAnnealingLR(o, 10)
    for _ = 1, 4 do o:step(); s:step() end
    fsdp.save_sharded(dir, m, o, { sched = s:state_dict() })
    local o2 = fsdp.optim.SGD(m:parameters(), 0.1)
    local s2 = S.CosineAnnealingLR(o2, 10)
    local extra = fsdp.load_sharded(dir, m, o2)
    s2:load_state_dict(extra.sched)
    o:step(); s:step(); o2:step(); s2:step()
    assert.equal(s:get_last_lr()[1], s2:get_last_lr()[1])
    os.execute("rm -rf '" .. dir .. "'")
  end)

  it("takes PyTorch's positional arguments, or any of them by name", function()
    local a, b = optimizer(), optimizer()
    local s1, s2 = S.StepLR(a, 3, 0.5), S.StepLR(b, { step_size = 3, gamma = 0.5 })
    for _ = 1, 7 do s1:step(); s2:step() end
    assert.same(s1:get_last_lr(), s2:get_last_lr())
    a, b = optimizer(), optimizer()
    s1, s2 = S.MultiStepLR(a, { 2, 4 }, 0.1), S.MultiStepLR(b, { milestones = { 2, 4 } })
    for _ = 1, 5 do s1:step(); s2:step() end
    assert.same(s1:get_last_lr(), s2:get_last_lr())
  end)

  it("says what is wrong", function()
    local o = optimizer()
    H.assert_error(function() S.StepLR(o) end, "StepLR: step_size is required")
    H.assert_error(function() S.StepLR(o, 3, { gama = 0.5 }) end, "StepLR: unknown option gama")
    H.assert_error(function() S.StepLR(o, 3, 0.5, -1, 7) end, "StepLR: 4 arguments given, it takes at most 3")
    H.assert_error(function() S.StepLR(o, 3, { step_size = 4 }) end, "StepLR: step_size given twice")
    H.assert_error(function() S.StepLR({}, 3) end, "StepLR: expected an optimizer (fsdp.optim.*), got table")
    H.assert_error(function() S.LinearLR(o, { start_factor = 2 }) end, "LinearLR: start_factor must be a number in (0, 1], got 2")
    H.assert_error(function() S.OneCycleLR(o, 0.1) end, "OneCycleLR: give total_steps, or epochs and steps_per_epoch")
    H.assert_error(function() S.LambdaLR(o, 3) end, "LambdaLR: lr_lambda must be a function or a list of 2 functions")
    H.assert_error(function() S.SequentialLR(o, { S.StepLR(o, 2), S.StepLR(o, 3) }, {}) end,
      "SequentialLR: 2 schedulers need 1 milestones, got 0")
    H.assert_error(function() S.ReduceLROnPlateau(o, { mode = "lowest" }) end, 'ReduceLROnPlateau: mode "lowest" is unknown')
    local s = S.OneCycleLR(optimizer(), 0.1, { total_steps = 2 })
    s:step(); s:step()
    H.assert_error(function() s:step() end, "OneCycleLR: stepped 4 times; total_steps is 2")
    local fresh = optimizer()
    fresh.param_groups[1].initial_lr = nil
    H.assert_error(function() S.StepLR(fresh, 3, { last_epoch = 5 }) end, "StepLR: param group 1 has no initial_lr")
  end)

  -- (issue 39: CosineAnnealingLR(opt, 0) then step() made the learning rate NaN without a word)
  it("refuses periods, factors and milestones no schedule can take", function()
    local o = optimizer()
    local bad = {
      { function() S.CosineAnnealingLR(o, 0) end, "CosineAnnealingLR: T_max must be a positive integer, got 0" },
      { function() S.CosineAnnealingLR(o, -3) end, "CosineAnnealingLR: T_max must be a positive integer, got -3" },
      { function() S.CosineAnnealingLR(o, 2.5) end, "CosineAnnealingLR: T_max must be a positive integer, got 2.5" },
      { function() S.CosineAnnealingLR(o, 10, 0 / 0) end, "CosineAnnealingLR: eta_min must be a finite number, got nan" },
      { function() S.StepLR(o, 0) end, "StepLR: step_size must be a positive integer, got 0" },
      { function() S.StepLR(o, 2, 1 / 0) end, "StepLR: gamma must be a finite number, got inf" },
      { function() S.StepLR(o, 2, { last_epoch = -2 }) end, "StepLR: last_epoch must be an integer >= -1, got -2" },
      { function() S.ExponentialLR(o, 0 / 0) end, "ExponentialLR: gamma must be a finite number, got nan" },
      { function() S.LinearLR(o, 0) end, "LinearLR: start_factor must be a number in (0, 1], got 0" },
      { function() S.LinearLR(o, 0.5, 1.5) end, "LinearLR: end_factor must be a number in [0, 1], got 1.5" },
      { function() S.LinearLR(o, 0.5, 1, 0) end, "LinearLR: total_iters must be a positive integer, got 0" },
      { function() S.MultiStepLR(o, { 2, -1 }) end, "MultiStepLR: milestones[2] must be an integer >= 0, got -1" },
      { function() S.MultiStepLR(o, { 2, nil, 5 }) end, "MultiStepLR: milestones has a hole: entry 2 is nil" },
      { function() S.OneCycleLR(o, 0.1, 10, { div_factor = 0 }) end, "OneCycleLR: div_factor must be a finite number > 0, got 0" },
      { function() S.OneCycleLR(o, -0.1, 10) end, "OneCycleLR: max_lr must be a finite number > 0, got -0.1" },
      { function() S.OneCycleLR(o, 0.1, 10, { pct_start = 1.5 }) end, "OneCycleLR: pct_start must be a number in [0, 1], got 1.5" },
      { function() S.ReduceLROnPlateau(o, { factor = 1 }) end, "ReduceLROnPlateau: factor must be a number in [0, 1), got 1" },
      { function() S.ReduceLROnPlateau(o, { patience = 1.5 }) end, "ReduceLROnPlateau: patience must be an integer >= 0, got 1.5" },
      { function() S.ReduceLROnPlateau(o, { min_lr = -1 }) end, "ReduceLROnPlateau: min_lr must be a finite number >= 0, got -1" },
      { function() S.SequentialLR(o, { S.LinearLR(o), S.LinearLR(o), S.LinearLR(o) }, { 5, 3 }) end,
        "SequentialLR: milestones must increase, but milestones[2] = 3 follows 5" },
      { function() S.SequentialLR(o, { S.LinearLR(o), 3 }, { 5 }) end, "SequentialLR: schedulers[2] is not a scheduler" },
      { function() S.SequentialLR(o, { S.LinearLR(o), S.LinearLR(o) }, { 0 }) end,
        "SequentialLR: milestones[1] must be a positive integer, got 0" },
      { function() S.StepLR(o, 2):step(1.5) end, "StepLR:step: epoch must be an integer >= 0 (or nil), got 1.5" },
      { function() S.LambdaLR(o, { function() return 1 end, 3 }) end, "LambdaLR: lr_lambda[2] must be a function, got number" },
      { function() S.LambdaLR(o, function(e) return e == 0 and 1 or 0 / 0 end):step() end,
        "LambdaLR: lr_lambda(1) returned nan (group 1); it must return a finite number" },
    }
    for _, c in ipairs(bad) do H.assert_error(c[1], c[2]) end
    for _, g in ipairs(o.param_groups) do assert.is_true(g.lr == g.lr and g.lr > 0, "a refused scheduler changed lr") end
  end)
end)
