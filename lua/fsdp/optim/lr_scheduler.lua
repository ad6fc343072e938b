--- fsdp.optim.lr_scheduler: torch.optim.lr_scheduler's schedulers, with its names, formulas (the same
-- arithmetic, so the same numbers: tests/nn/optim_sched_spec.lua against PyTorch's) and state dicts.
--
--   local sched = fsdp.optim.lr_scheduler
--   local s = sched.StepLR(opt, 30, {gamma = 0.1})      -- positional as in PyTorch, or keywords:
--   local s = sched.StepLR(opt, {step_size = 30, gamma = 0.1})
--   for epoch = 1, 100 do train(); opt:step(); s:step() end   -- step after the optimizer's step
--   s:get_last_lr()                                     -- {lr of group 1, ...}
--   fsdp.save_sharded(dir, model, opt, {sched = s:state_dict()})  -- plain numbers and tables
--
-- LambdaLR, StepLR, MultiStepLR, ExponentialLR, CosineAnnealingLR, LinearLR, OneCycleLR (momentum or
-- Adam's beta1 cycled too), SequentialLR (e.g. LinearLR warmup, then CosineAnnealingLR) and
-- ReduceLROnPlateau (step(metric)). Each writes the learning rate of every parameter group of its
-- optimizer; a group's first learning rate is kept as its initial_lr. Construction performs the
-- first step (epoch 0), as PyTorch's does.
-- @module fsdp.optim.lr_scheduler
local fsdp = require "fsdp"

local S = {}

-- ---- arguments: PyTorch's positional ones, or any of them by name in a trailing table -----------------
-- (fsdp.args, shared with the layers, functional ops and optimizers)
local args = require "fsdp.args"

local function check_optimizer(cls, opt)
  if type(opt) ~= "table" or type(opt.param_groups) ~= "table" then
    error(("%s: expected an optimizer (fsdp.optim.*), got %s"):format(cls, type(opt)), 3)
  end
end

-- ---- the base class (torch's _LRScheduler) -------------------------------------------------------------
local LRScheduler = {}
LRScheduler.__index = LRScheduler
S.LRScheduler = LRScheduler

local function class(name, parent)
  local c = setmetatable({}, { __index = parent, __call = function(cls, ...) return cls.new(...) end })
  c.__index = c
  c.__name = name
  c.__tostring = function(s) return ("%s(last_epoch=%d)"):format(name, s.last_epoch) end
  return c
end

-- fields every scheduler keeps in its state dict (besides those of its class)
local function init_base(self, opt, last_epoch)
  self.optimizer = opt
  if last_epoch == -1 then
    for _, g in ipairs(opt.param_groups) do
      if g.initial_lr == nil then g.initial_lr = g.lr end
    end
  else
    for i, g in ipairs(opt.param_groups) do
      if g.initial_lr == nil then
        error(("%s: param group %d has no initial_lr; it is set when a scheduler starts at last_epoch = -1")
          :format(self.__name, i), 4)
      end
    end
  end
  self.base_lrs = {}
  for i, g in ipairs(opt.param_groups) do self.base_lrs[i] = g.initial_lr end
  self.last_epoch = last_epoch
  self:_initial_step()
end

function LRScheduler:_initial_step()
  self._step_count = 0
  self:step()
end

--- step(): the next epoch (or step); the learning rates it computes go into the groups
function LRScheduler:step(epoch)
  if epoch ~= nil and (type(epoch) ~= "number" or epoch ~= math.floor(epoch) or epoch < 0 or epoch >= 2 ^ 53) then
    error(("%s:step: epoch must be an integer >= 0 (or nil), got %s"):format(self.__name, tostring(epoch)), 2)
  end
  self._step_count = self._step_count + 1
  local values
  if epoch == nil then
    self.last_epoch = self.last_epoch + 1
    values = self:get_lr()
  else  -- (as PyTorch's deprecated step(epoch): the closed form where there is one)
    self.last_epoch = epoch
    values = self._get_closed_form_lr and self:_get_closed_form_lr() or self:get_lr()
  end
  for i, g in ipairs(self.optimizer.param_groups) do g.lr = values[i] end
  self._last_lr = {}
  for i, g in ipairs(self.optimizer.param_groups) do self._last_lr[i] = g.lr end
end

--- The learning rates the last step set, one per param group.
function LRScheduler:get_last_lr()
  local r = {}
  for i, v in ipairs(self._last_lr) do r[i] = v end
  return r
end

local function copy(v)
  if type(v) ~= "table" then return v end
  local r = {}
  for k, x in pairs(v) do r[k] = copy(x) end
  return r
end
--- state_dict(): every field but the optimizer and functions, as plain numbers and tables
function LRScheduler:state_dict()
  local sd = {}
  for k, v in pairs(self) do
    if k ~= "optimizer" and type(v) ~= "function" and k ~= "_schedulers" and k ~= "lr_lambdas" then sd[k] = copy(v) end
  end
  return sd
end
--- Restores the state state_dict() returned.
-- @param sd the state table
function LRScheduler:load_state_dict(sd)
  if type(sd) ~= "table" then error(("%s:load_state_dict: expected a table, got %s"):format(self.__name, type(sd)), 2) end
  for k, v in pairs(sd) do
    if k ~= "_schedulers" and k ~= "lr_lambdas" then self[k] = copy(v) end
  end
end

local function group_lrs(self)
  local r = {}
  for i, g in ipairs(self.optimizer.param_groups) do r[i] = g.lr end
  return r
end
local function scaled(self, f)
  local r = {}
  for i, g in ipairs(self.optimizer.param_groups) do r[i] = g.lr * f end
  return r
end

-- ---- LambdaLR(optimizer, lr_lambda): lr = initial_lr * lr_lambda(epoch) (one function, or one per group)
local LambdaLR = class("LambdaLR", LRScheduler)
S.LambdaLR = LambdaLR
--- LambdaLR(optimizer, lr_lambda): lr = initial_lr * lr_lambda(epoch) (one function, or one per group).
-- @function LambdaLR
function LambdaLR.new(opt, ...)
  check_optimizer("LambdaLR", opt)
  local a = args("LambdaLR", { { "lr_lambda" }, { "last_epoch", -1, check = "int>=-1" } }, ...)
  local self = setmetatable({}, LambdaLR)
  local f = a.lr_lambda
  if type(f) == "function" then
    self.lr_lambdas = {}
    for i = 1, #opt.param_groups do self.lr_lambdas[i] = f end
  elseif type(f) == "table" and fsdp._list(f, "LambdaLR", "lr_lambda") == #opt.param_groups then
    for i = 1, #f do
      if type(f[i]) ~= "function" then error(("LambdaLR: lr_lambda[%d] must be a function, got %s"):format(i, type(f[i])), 2) end
    end
    self.lr_lambdas = f
  else
    error(("LambdaLR: lr_lambda must be a function or a list of %d functions (one per group)"):format(#opt.param_groups), 2)
  end
  init_base(self, opt, a.last_epoch)
  return self
end
--- The learning rates of the current epoch, one per param group.
function LambdaLR:get_lr()
  local r = {}
  for i, base in ipairs(self.base_lrs) do
    local f = self.lr_lambdas[i](self.last_epoch)
    if type(f) ~= "number" or f ~= f or f == math.huge or f == -math.huge then
      error(("LambdaLR: lr_lambda(%d) returned %s (group %d); it must return a finite number")
        :format(self.last_epoch, tostring(f), i), 4)
    end
    r[i] = base * f
  end
  return r
end

-- ---- StepLR(optimizer, step_size, gamma = 0.1): lr *= gamma every step_size epochs
local StepLR = class("StepLR", LRScheduler)
S.StepLR = StepLR
--- StepLR(optimizer, step_size[, gamma = 0.1]): lr *= gamma every step_size epochs.
-- @function StepLR
function StepLR.new(opt, ...)
  check_optimizer("StepLR", opt)
  local a = args("StepLR", { { "step_size", check = "int>0" }, { "gamma", 0.1, check = "num" }, { "last_epoch", -1, check = "int>=-1" } }, ...)
  local self = setmetatable({ step_size = a.step_size, gamma = a.gamma }, StepLR)
  init_base(self, opt, a.last_epoch)
  return self
end
--- The learning rates of the current epoch, one per param group.
function StepLR:get_lr()
  if self.last_epoch == 0 or self.last_epoch % self.step_size ~= 0 then return group_lrs(self) end
  return scaled(self, self.gamma)
end
function StepLR:_get_closed_form_lr()
  local r = {}
  for i, base in ipairs(self.base_lrs) do r[i] = base * self.gamma ^ math.floor(self.last_epoch / self.step_size) end
  return r
end

-- ---- MultiStepLR(optimizer, milestones, gamma = 0.1): lr *= gamma at each milestone epoch
local MultiStepLR = class("MultiStepLR", LRScheduler)
S.MultiStepLR = MultiStepLR
--- MultiStepLR(optimizer, milestones[, gamma = 0.1]): lr *= gamma at each milestone epoch.
-- @function MultiStepLR
function MultiStepLR.new(opt, ...)
  check_optimizer("MultiStepLR", opt)
  local a = args("MultiStepLR", { { "milestones", list = true, check = "int>=0" }, { "gamma", 0.1, check = "num" }, { "last_epoch", -1, check = "int>=-1" } }, ...)
  if type(a.milestones) ~= "table" then error("MultiStepLR: milestones must be a list of epochs", 2) end
  local count = {}  -- epoch -> how many times it is a milestone (torch's Counter)
  for _, m in ipairs(a.milestones) do count[m] = (count[m] or 0) + 1 end
  local self = setmetatable({ milestones = count, gamma = a.gamma }, MultiStepLR)
  init_base(self, opt, a.last_epoch)
  return self
end
--- The learning rates of the current epoch, one per param group.
function MultiStepLR:get_lr()
  local c = self.milestones[self.last_epoch]
  if not c then return group_lrs(self) end
  return scaled(self, self.gamma ^ c)
end
function MultiStepLR:_get_closed_form_lr()
  local passed = 0
  for m, c in pairs(self.milestones) do if m <= self.last_epoch then passed = passed + c end end
  local r = {}
  for i, base in ipairs(self.base_lrs) do r[i] = base * self.gamma ^ passed end
  return r
end
--- (milestones are a map epoch -> count; JSON keys must be strings, so the state dict lists them)
function MultiStepLR:state_dict()
  local sd = LRScheduler.state_dict(self)
  local list = {}
  for m, c in pairs(self.milestones) do for _ = 1, c do list[#list + 1] = m end end
  table.sort(list)
  sd.milestones = list
  return sd
end
--- Restores the state state_dict() returned.
-- @param sd the state table
function MultiStepLR:load_state_dict(sd)
  LRScheduler.load_state_dict(self, sd)
  local count = {}
  for _, m in ipairs(sd.milestones or {}) do count[m] = (count[m] or 0) + 1 end
  self.milestones = count
end

-- ---- ExponentialLR(optimizer, gamma): lr *= gamma every epoch
local ExponentialLR = class("ExponentialLR", LRScheduler)
S.ExponentialLR = ExponentialLR
--- ExponentialLR(optimizer, gamma): lr *= gamma every epoch.
-- @function ExponentialLR
function ExponentialLR.new(opt, ...)
  check_optimizer("ExponentialLR", opt)
  local a = args("ExponentialLR", { { "gamma", check = "num" }, { "last_epoch", -1, check = "int>=-1" } }, ...)
  local self = setmetatable({ gamma = a.gamma }, ExponentialLR)
  init_base(self, opt, a.last_epoch)
  return self
end
--- The learning rates of the current epoch, one per param group.
function ExponentialLR:get_lr()
  if self.last_epoch == 0 then return group_lrs(self) end
  return scaled(self, self.gamma)
end
function ExponentialLR:_get_closed_form_lr()
  local r = {}
  for i, base in ipairs(self.base_lrs) do r[i] = base * self.gamma ^ self.last_epoch end
  return r
end

-- ---- CosineAnnealingLR(optimizer, T_max, eta_min = 0): half a cosine from initial_lr to eta_min
local CosineAnnealingLR = class("CosineAnnealingLR", LRScheduler)
S.CosineAnnealingLR = CosineAnnealingLR
--- CosineAnnealingLR(optimizer, T_max[, eta_min = 0]): half a cosine from initial_lr to eta_min over T_max epochs.
-- @function CosineAnnealingLR
function CosineAnnealingLR.new(opt, ...)
  check_optimizer("CosineAnnealingLR", opt)
  local a = args("CosineAnnealingLR", { { "T_max", check = "int>0" }, { "eta_min", 0, check = "num" }, { "last_epoch", -1, check = "int>=-1" } }, ...)
  local self = setmetatable({ T_max = a.T_max, eta_min = a.eta_min }, CosineAnnealingLR)
  init_base(self, opt, a.last_epoch)
  return self
end
--- The learning rates of the current epoch, one per param group.
function CosineAnnealingLR:get_lr()
  local e, T, m, pi, r = self.last_epoch, self.T_max, self.eta_min, math.pi, {}
  if e == 0 then return group_lrs(self) end
  for i, g in ipairs(self.optimizer.param_groups) do
    local base = self.base_lrs[i]
    if self._step_count == 1 and e > 0 then
      r[i] = m + (base - m) * (1 + math.cos(e * pi / T)) / 2
    elseif (e - 1 - T) % (2 * T) == 0 then
      r[i] = g.lr + (base - m) * (1 - math.cos(pi / T)) / 2
    else
      r[i] = (1 + math.cos(pi * e / T)) / (1 + math.cos(pi * (e - 1) / T)) * (g.lr - m) + m
    end
  end
  return r
end
function CosineAnnealingLR:_get_closed_form_lr()
  local r = {}
  for i, base in ipairs(self.base_lrs) do
    r[i] = self.eta_min + (base - self.eta_min) * (1 + math.cos(math.pi * self.last_epoch / self.T_max)) / 2
  end
  return r
end

-- ---- LinearLR(optimizer, start_factor = 1/3, end_factor = 1, total_iters = 5): linear warmup or decay
local LinearLR = class("LinearLR", LRScheduler)
S.LinearLR = LinearLR
--- LinearLR(optimizer[, start_factor = 1/3[, end_factor = 1[, total_iters = 5]]]): linear warmup or decay of the factor.
-- @function LinearLR
function LinearLR.new(opt, ...)
  check_optimizer("LinearLR", opt)
  local a = args("LinearLR", { { "start_factor", 1.0 / 3, check = "(0,1]" }, { "end_factor", 1.0, check = "[0,1]" },
    { "total_iters", 5, check = "int>0" },
    { "last_epoch", -1, check = "int>=-1" } }, ...)
  local self = setmetatable({ start_factor = a.start_factor, end_factor = a.end_factor, total_iters = a.total_iters },
    LinearLR)
  init_base(self, opt, a.last_epoch)
  return self
end
--- The learning rates of the current epoch, one per param group.
function LinearLR:get_lr()
  local e, s, f, n = self.last_epoch, self.start_factor, self.end_factor, self.total_iters
  if e == 0 then return scaled(self, s) end
  if e > n then return group_lrs(self) end
  return scaled(self, 1 + (f - s) / (n * s + (e - 1) * (f - s)))
end
function LinearLR:_get_closed_form_lr()
  local r = {}
  for i, base in ipairs(self.base_lrs) do
    r[i] = base * (self.start_factor + (self.end_factor - self.start_factor) * math.min(self.total_iters,
      self.last_epoch) / self.total_iters)
  end
  return r
end

-- ---- OneCycleLR(optimizer, max_lr, total_steps | {epochs, steps_per_epoch}, ...): the 1cycle policy
-- (warm up to max_lr over pct_start of the steps, then anneal to max_lr / div_factor /
-- final_div_factor; momentum, or Adam's beta1, cycles the other way when cycle_momentum)
local OneCycleLR = class("OneCycleLR", LRScheduler)
S.OneCycleLR = OneCycleLR
local function per_group(cls, name, v, n)
  if type(v) == "table" then
    if #v ~= n then error(("%s: expected %d values for %s, got %d"):format(cls, n, name, #v), 4) end
    return v
  end
  local r = {}
  for i = 1, n do r[i] = v end
  return r
end
--- OneCycleLR(optimizer, max_lr, total_steps | {epochs, steps_per_epoch}, ...): the 1cycle policy.
-- @function OneCycleLR
function OneCycleLR.new(opt, ...)
  check_optimizer("OneCycleLR", opt)
  local a = args("OneCycleLR", { { "max_lr", list = true, check = "num>0" },
    { "total_steps", optional = true, check = "int>0" }, { "epochs", optional = true, check = "int>0" },
    { "steps_per_epoch", optional = true, check = "int>0" }, { "pct_start", 0.3, check = "[0,1]" },
    { "anneal_strategy", "cos" }, { "cycle_momentum", true }, { "base_momentum", 0.85, list = true, check = "num" },
    { "max_momentum", 0.95, list = true, check = "num" }, { "div_factor", 25.0, check = "num>0" },
    { "final_div_factor", 1e4, check = "num>0" }, { "three_phase", false }, { "last_epoch", -1, check = "int>=-1" } }, ...)
  local total = a.total_steps
  if total == nil then
    if a.epochs == nil or a.steps_per_epoch == nil then
      error("OneCycleLR: give total_steps, or epochs and steps_per_epoch", 2)
    end
    total = a.epochs * a.steps_per_epoch
  end
  if total <= 0 or total ~= math.floor(total) then error(("OneCycleLR: total_steps must be a positive integer, got %s"):format(tostring(total)), 2) end
  if a.pct_start < 0 or a.pct_start > 1 then error(("OneCycleLR: pct_start must be between 0 and 1, got %s"):format(tostring(a.pct_start)), 2) end
  if a.anneal_strategy ~= "cos" and a.anneal_strategy ~= "linear" then
    error(("OneCycleLR: anneal_strategy must be \"cos\" or \"linear\", got %q"):format(tostring(a.anneal_strategy)), 2)
  end
  local self = setmetatable({ total_steps = total, anneal_strategy = a.anneal_strategy,
    cycle_momentum = a.cycle_momentum }, OneCycleLR)
  local p = a.pct_start
  if a.three_phase then
    self._schedule_phases = {
      { end_step = p * total - 1, start_lr = "initial_lr", end_lr = "max_lr", start_momentum = "max_momentum", end_momentum = "base_momentum" },
      { end_step = 2 * p * total - 2, start_lr = "max_lr", end_lr = "initial_lr", start_momentum = "base_momentum", end_momentum = "max_momentum" },
      { end_step = total - 1, start_lr = "initial_lr", end_lr = "min_lr", start_momentum = "max_momentum", end_momentum = "max_momentum" },
    }
  else
    self._schedule_phases = {
      { end_step = p * total - 1, start_lr = "initial_lr", end_lr = "max_lr", start_momentum = "max_momentum", end_momentum = "base_momentum" },
      { end_step = total - 1, start_lr = "max_lr", end_lr = "min_lr", start_momentum = "base_momentum", end_momentum = "max_momentum" },
    }
  end
  local groups = opt.param_groups
  local max_lrs = per_group("OneCycleLR", "max_lr", a.max_lr, #groups)
  if a.last_epoch == -1 then
    for i, g in ipairs(groups) do
      g.initial_lr = max_lrs[i] / a.div_factor
      g.max_lr = max_lrs[i]
      g.min_lr = g.initial_lr / a.final_div_factor
    end
  end
  if self.cycle_momentum then
    local d = opt.defaults or {}
    if d.momentum == nil and d.betas == nil then
      error("OneCycleLR: the optimizer has no momentum or betas to cycle (pass {cycle_momentum = false})", 2)
    end
    self.use_beta1 = d.betas ~= nil
    local maxm = per_group("OneCycleLR", "max_momentum", a.max_momentum, #groups)
    local basem = per_group("OneCycleLR", "base_momentum", a.base_momentum, #groups)
    if a.last_epoch == -1 then
      for i, g in ipairs(groups) do
        if self.use_beta1 then g.betas = { maxm[i], g.betas[2] } else g.momentum = maxm[i] end
        g.max_momentum, g.base_momentum = maxm[i], basem[i]
      end
    end
  end
  init_base(self, opt, a.last_epoch)
  return self
end
local function anneal(strategy, start, stop, pct)
  if strategy == "cos" then return stop + (start - stop) / 2.0 * (math.cos(math.pi * pct) + 1) end
  return (stop - start) * pct + start
end
--- The learning rates of the current step, one per param group.
function OneCycleLR:get_lr()
  local step = self.last_epoch
  if step > self.total_steps then
    error(("OneCycleLR: stepped %d times; total_steps is %d"):format(step + 1, self.total_steps), 3)
  end
  local r, phases = {}, self._schedule_phases
  for i, g in ipairs(self.optimizer.param_groups) do
    local start_step, lr, mom = 0, nil, nil
    for k, ph in ipairs(phases) do
      local end_step = ph.end_step
      if step <= end_step or k == #phases then
        local pct = (step - start_step) / (end_step - start_step)
        lr = anneal(self.anneal_strategy, g[ph.start_lr], g[ph.end_lr], pct)
        if self.cycle_momentum then mom = anneal(self.anneal_strategy, g[ph.start_momentum], g[ph.end_momentum], pct) end
        break
      end
      start_step = ph.end_step
    end
    r[i] = lr
    if self.cycle_momentum then
      if self.use_beta1 then g.betas = { mom, g.betas[2] } else g.momentum = mom end
    end
  end
  return r
end

-- ---- SequentialLR(optimizer, schedulers, milestones): one scheduler after another (warmup, then decay)
local SequentialLR = class("SequentialLR", LRScheduler)
S.SequentialLR = SequentialLR
--- SequentialLR(optimizer, schedulers, milestones): one scheduler after another (warmup, then decay).
-- @function SequentialLR
function SequentialLR.new(opt, ...)
  check_optimizer("SequentialLR", opt)
  local a = args("SequentialLR", { { "schedulers", list = true }, { "milestones", list = true, check = "int>0" },
    { "last_epoch", -1, check = "int>=-1" } }, ...)
  local scheds, ms = a.schedulers, a.milestones
  if type(scheds) ~= "table" or #scheds == 0 then
    error(("SequentialLR: schedulers must be a non-empty list of schedulers, got %s"):format(type(scheds)), 2)
  end
  if type(ms) ~= "table" then error(("SequentialLR: milestones must be a list of steps, got %s"):format(type(ms)), 2) end
  for i = 2, #ms do
    if ms[i] <= ms[i - 1] then
      error(("SequentialLR: milestones must increase, but milestones[%d] = %d follows %d"):format(i, ms[i], ms[i - 1]), 2)
    end
  end
  for i, s in ipairs(scheds) do
    if type(s) ~= "table" or getmetatable(s) == nil or type(s.step) ~= "function" then
      error(("SequentialLR: schedulers[%d] is not a scheduler (got %s)"):format(i, type(s)), 2)
    end
    if s.optimizer ~= opt then error(("SequentialLR: scheduler %d belongs to another optimizer"):format(i), 2) end
  end
  if #ms ~= #scheds - 1 then
    error(("SequentialLR: %d schedulers need %d milestones, got %d"):format(#scheds, #scheds - 1, #ms), 2)
  end
  local self = setmetatable({ _schedulers = scheds, _milestones = ms, last_epoch = a.last_epoch + 1, optimizer = opt },
    SequentialLR)
  for _, g in ipairs(opt.param_groups) do g.lr = g.initial_lr end  -- back to the initial rates
  for _, s in ipairs(scheds) do s.last_epoch = s.last_epoch - 1 end  -- undo their first steps
  scheds[1]:_initial_step()  -- and redo the first one's only
  self._last_lr = scheds[1]:get_last_lr()
  return self
end
--- One epoch: steps the scheduler of the current milestone interval.
function SequentialLR:step()
  self.last_epoch = self.last_epoch + 1
  local idx = 0  -- bisect_right(milestones, last_epoch)
  for _, m in ipairs(self._milestones) do if m <= self.last_epoch then idx = idx + 1 end end
  local s = self._schedulers[idx + 1]
  if idx > 0 and self._milestones[idx] == self.last_epoch then s:step(0) else s:step() end
  self._last_lr = s:get_last_lr()
end
--- The scheduler's state, its schedulers' included (a plain table).
function SequentialLR:state_dict()
  local sd = LRScheduler.state_dict(self)
  sd._schedulers = {}
  for i, s in ipairs(self._schedulers) do sd._schedulers[i] = s:state_dict() end
  return sd
end
--- Restores the state state_dict() returned, its schedulers' too.
-- @param sd the state table
function SequentialLR:load_state_dict(sd)
  LRScheduler.load_state_dict(self, sd)
  for i, s in ipairs(sd._schedulers or {}) do self._schedulers[i]:load_state_dict(s) end
end

-- ---- ReduceLROnPlateau(optimizer, {mode = "min", factor = 0.1, patience = 10, ...}): step(metric)
-- multiplies the learning rates by factor once the metric stopped improving for patience epochs
local ReduceLROnPlateau = class("ReduceLROnPlateau", LRScheduler)
S.ReduceLROnPlateau = ReduceLROnPlateau
local INF = math.huge
--- ReduceLROnPlateau(optimizer[, {mode = "min", factor = 0.1, patience = 10, ...}]): lowers lr when a metric stops improving.
-- @function ReduceLROnPlateau
function ReduceLROnPlateau.new(opt, ...)
  check_optimizer("ReduceLROnPlateau", opt)
  local a = args("ReduceLROnPlateau", { { "mode", "min" }, { "factor", 0.1, check = "[0,1)" },
    { "patience", 10, check = "int>=0" }, { "threshold", 1e-4, check = "num>=0" }, { "threshold_mode", "rel" },
    { "cooldown", 0, check = "int>=0" }, { "min_lr", 0, list = true, check = "num>=0" }, { "eps", 1e-8, check = "num>=0" } },
    ...)
  if a.mode ~= "min" and a.mode ~= "max" then error(("ReduceLROnPlateau: mode %q is unknown (min or max)"):format(tostring(a.mode)), 2) end
  if a.threshold_mode ~= "rel" and a.threshold_mode ~= "abs" then
    error(("ReduceLROnPlateau: threshold mode %q is unknown (rel or abs)"):format(tostring(a.threshold_mode)), 2)
  end
  local self = setmetatable({ optimizer = opt, factor = a.factor, min_lrs = per_group("ReduceLROnPlateau", "min_lr",
    a.min_lr, #opt.param_groups), patience = a.patience, cooldown = a.cooldown, cooldown_counter = 0, mode = a.mode,
    threshold = a.threshold, threshold_mode = a.threshold_mode, eps = a.eps, last_epoch = 0 }, ReduceLROnPlateau)
  self.mode_worse = a.mode == "min" and INF or -INF
  self.best, self.num_bad_epochs = self.mode_worse, 0
  self._last_lr = group_lrs(self)
  return self
end
--- Whether metric x is better than best (by mode and threshold).
-- @param x a metric
-- @param best the best metric so far
function ReduceLROnPlateau:is_better(x, best)
  if self.mode == "min" and self.threshold_mode == "rel" then return x < best * (1 - self.threshold) end
  if self.mode == "min" then return x < best - self.threshold end
  if self.threshold_mode == "rel" then return x > best * (self.threshold + 1) end
  return x > best + self.threshold
end
--- One epoch's end: lowers lr by factor after patience epochs without improvement.
-- @param metric the epoch's metric (a number)
function ReduceLROnPlateau:step(metric)
  local x = fsdp.is_tensor(metric) and metric:item() or metric
  if type(x) ~= "number" then error(("ReduceLROnPlateau:step: expected the metric (a number), got %s"):format(type(metric)), 2) end
  self.last_epoch = self.last_epoch + 1
  if self:is_better(x, self.best) then
    self.best, self.num_bad_epochs = x, 0
  else
    self.num_bad_epochs = self.num_bad_epochs + 1
  end
  if self.cooldown_counter > 0 then
    self.cooldown_counter = self.cooldown_counter - 1
    self.num_bad_epochs = 0  -- bad epochs in cooldown do not count
  end
  if self.num_bad_epochs > self.patience then
    for i, g in ipairs(self.optimizer.param_groups) do
      local new = math.max(g.lr * self.factor, self.min_lrs[i])
      if g.lr - new > self.eps then g.lr = new end
    end
    self.cooldown_counter, self.num_bad_epochs = self.cooldown, 0
  end
  self._last_lr = group_lrs(self)
end
--- (infinities do not travel as JSON numbers: best is saved as "inf" / "-inf" until a metric came)
function ReduceLROnPlateau:state_dict()
  local sd = LRScheduler.state_dict(self)
  for _, k in ipairs { "best", "mode_worse" } do
    if sd[k] == INF then sd[k] = "inf" elseif sd[k] == -INF then sd[k] = "-inf" end
  end
  return sd
end
--- Restores the state state_dict() returned.
-- @param sd the state table
function ReduceLROnPlateau:load_state_dict(sd)
  LRScheduler.load_state_dict(self, sd)
  for _, k in ipairs { "best", "mode_worse" } do
    if self[k] == "inf" then self[k] = INF elseif self[k] == "-inf" then self[k] = -INF end
  end
end

return S
