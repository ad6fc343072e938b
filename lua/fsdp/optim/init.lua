--- fsdp.optim: optimizers with torch.optim's names, defaults, formulas and state_dict layout.
--
--   local opt = optim.SGD(model:parameters(), {lr = 0.1, momentum = 0.9})  -- or (params, 0.1, {momentum = 0.9})
--   local opt = optim.AdamW({{params = decay, weight_decay = 0.1}, {params = no_decay, weight_decay = 0}},
--                           {lr = 3e-4})
--   opt:zero_grad(); loss:backward(); opt:step()
--
-- The base class here keeps param groups and per-parameter state; each optimizer only says how
-- to update one parameter, through a fused C kernel (fsdp_sgd_step, fsdp_adam_step) that runs
-- one pass over the parameter, its gradient and its state. Optimizer state lives in the OPTIM
-- memory category (fsdp.memory_stats().optimizer).
-- @module fsdp.optim
local ffi = require "ffi"
local fsdp = require "fsdp"
local C = fsdp.C
local is_tensor = fsdp.is_tensor

local optim = {}
package.loaded["fsdp.optim"] = optim  -- sgd.lua and adam.lua require this module for the base class

local tensor_key = fsdp._key

local function copy_value(v)
  if type(v) == "table" and not is_tensor(v) then
    local r = {}
    for k, x in pairs(v) do r[k] = copy_value(x) end
    return r
  end
  return v
end

-- Which elements of its parameter a sharded parameter's optimizer state holds: {start (0-based),
-- length, numel}, or nil for a parameter held whole. state_dict records it beside each state and
-- load_state_dict checks it, so another rank's pieces (rank 0's file loaded everywhere, or a file
-- from another world size whose pieces happen to be as long) are an error, never the wrong
-- elements' moments. Plain tables, so fsdp.save keeps it (as JSON).
local shard_start, shard_len = ffi.new("int64_t[1]"), ffi.new("int64_t[1]")
function optim._piece_of(p)
  if C.fsdp_param_shard(p.p, shard_start, shard_len) == 0 then return nil end
  local numel = tonumber(C.fsdp_param_full_numel(p.p))
  local start, length = tonumber(shard_start[0]), tonumber(shard_len[0])
  if length == numel then return nil end
  return { start = start, length = length, numel = numel }
end
local function piece_str(pc)
  if pc.length == 0 then return ("no element of its %d"):format(pc.numel) end
  return ("elements %d..%d of its %d"):format(pc.start + 1, pc.start + pc.length, pc.numel)
end
-- the error for a state entry whose recorded piece (nil: none recorded) is not this rank's piece
-- `want` of parameter p (nil: p is held whole)
local function check_piece(name, idx, p, saved, want)
  local function same(a, b)
    return type(a) == "table" and a.start == b.start and a.length == b.length and a.numel == b.numel
  end
  if want == nil or same(saved, want) then return end
  local pname = require("fsdp.wrap").param_names(p)
  local had = type(saved) == "table" and ("holds " .. piece_str(saved))
    or "does not say which elements it holds (no fsdp_piece)"
  error(("%s:load_state_dict: the state of parameter %s ('%s', sharded by FSDP) %s, but rank %d holds %s; "
    .. "load each rank's own opt:state_dict(), or use fsdp.save_sharded / fsdp.load_sharded, which reshard")
    :format(name, tostring(idx), pname, had, fsdp.rank(), piece_str(want)), 3)
end

-- ---- the base class --------------------------------------------------------------------------------
local Optimizer = {}
Optimizer.__index = Optimizer
Optimizer.__name = "Optimizer"
optim.Optimizer = Optimizer

--- Optimizer:extend("Name") -> a subclass; Name(params, opts) calls __init
function Optimizer.extend(parent, name)
  local cls = setmetatable({}, {
    __index = parent,
    __call = function(c, ...)
      local self = setmetatable({}, c)
      self:__init(...)
      return self
    end,
  })
  cls.__index = cls
  cls.__name = name
  cls.__tostring = parent.__tostring
  return cls
end

-- a new optimizer-state tensor shaped like p, counted in the OPTIM memory category
function Optimizer._new_state(p, zero)
  local n, shape = fsdp._shape("optimizer state", fsdp._held_shape(p))  -- a sharded parameter's state is its piece's
  local dev = C.fsdp_tensor_device(p.p)
  local dt = C.fsdp_tensor_dtype(p.p)  -- PyTorch keeps a bfloat16 parameter's state in bfloat16
  local t
  if zero then t = fsdp._wrap(C.fsdp_full(n, shape, 0, dt, dev))
  else t = fsdp._wrap(C.fsdp_empty(n, shape, dt, dev)) end
  C.fsdp_tensor_set_mem_category(t.p, C.FSDP_MEM_OPTIM)
  return t
end

-- The arguments after params of every optimizer, as torch.optim takes them (fsdp.args): positional
-- in PyTorch's order (optim.SGD(params, 0.1) is the learning rate, optim.SGD(params, 0.1, 0.9) adds
-- momentum), and any of them by name in a trailing table (optim.SGD(params, 0.1, {momentum = 0.9}),
-- optim.SGD(params, {lr = 0.1})). An option of the wrong type, an unknown one or one given twice is
-- an error naming the optimizer and the option; values are range-checked by each optimizer.
local option_types = {
  lr = "number", momentum = "number", dampening = "number", weight_decay = "number", eps = "number",
  nesterov = "boolean", maximize = "boolean", amsgrad = "boolean", betas = "table",
}
local option_spec = {
  SGD = { { "lr", optional = true }, { "momentum", optional = true }, { "dampening", optional = true },
    { "weight_decay", optional = true }, { "nesterov", optional = true }, { "maximize", optional = true, kw = true } },
  Adam = { { "lr", optional = true }, { "betas", optional = true, list = true }, { "eps", optional = true },
    { "weight_decay", optional = true }, { "amsgrad", optional = true }, { "maximize", optional = true, kw = true } },
}
option_spec.AdamW = option_spec.Adam
function optim._options(name, ...)
  local first = ...
  if first ~= nil and type(first) ~= "table" and type(first) ~= "number" or is_tensor(first) then
    fsdp._arg_error(name, "options", "a table {lr = ..., ...} or a number (the learning rate)", first, 3)
  end
  local opts = require("fsdp.args")(name, option_spec[name], ...)
  for k, want in pairs(option_types) do
    local v = opts[k]
    if v ~= nil and type(v) ~= want then fsdp._arg_error(name, "option " .. k, "a " .. want, v, 3) end
  end
  return opts
end

--- params: a list of tensors, or a list of param groups {params = {...}, lr = ..., ...}
-- defaults: the optimizer's hyperparameters (filled into every group that lacks them)
function Optimizer:__init(params, defaults)
  self.defaults = defaults
  self.param_groups = {}
  self.state = {}  -- tensor identity -> per-parameter state table
  if is_tensor(params) then
    error(self.__name .. ": params must be a list of tensors or of param groups, got a single tensor", 3)
  end
  if type(params) ~= "table" then
    error(("%s: params must be a list of tensors or of param groups, got %s"):format(self.__name, type(params)), 3)
  end
  if fsdp._list(params, self.__name, "params", 3) == 0 then error(self.__name .. ": optimizer got an empty parameter list", 3) end
  local groups = is_tensor(params[1]) and { { params = params } } or params
  for _, g in ipairs(groups) do self:add_param_group(g) end
end

--- Adds a param group {params = {...}, lr = ..., ...}; options it leaves out take the optimizer's defaults.
-- @param group the group table
function Optimizer:add_param_group(group)
  if type(group) ~= "table" or is_tensor(group) then
    error(self.__name .. ": a param group must be a table {params = {...}, ...}", 2)
  end
  local g = {}
  for k, v in pairs(group) do g[k] = copy_value(v) end
  local ps = group.params
  if is_tensor(ps) then ps = { ps } end
  if type(ps) ~= "table" then error(self.__name .. ": a param group needs a params list", 2) end
  fsdp._list(ps, self.__name, "params")
  g.params = {}
  local seen = {}
  for _, other in ipairs(self.param_groups) do
    for _, p in ipairs(other.params) do seen[tensor_key(p)] = true end
  end
  for i, p in ipairs(ps) do
    if not is_tensor(p) then error(("%s: param %d is a %s, expected a tensor"):format(self.__name, i, type(p)), 2) end
    if not p.is_leaf then error(("%s: can't optimize a non-leaf tensor (param %d)"):format(self.__name, i), 2) end
    if p.dtype == "int64" then
      error(("%s: param %d must be a float tensor (float32, bfloat16 or float16), got %s"):format(self.__name, i, p.dtype), 2)
    end
    local key = tensor_key(p)
    if seen[key] then error(self.__name .. ": some parameters appear in more than one parameter group", 2) end
    seen[key] = true
    g.params[i] = p
  end
  for k, v in pairs(self.defaults) do
    if g[k] == nil then g[k] = copy_value(v) end
    if type(v) == "number" and type(g[k]) ~= "number" then
      error(("%s: option %s of a param group must be a number, got %s (%s)"):format(self.__name, k, type(g[k]),
        tostring(g[k])), 2)
    end
  end
  self.param_groups[#self.param_groups + 1] = g
end

--- drops the gradients (PyTorch's set_to_none default); zero_grad(false) zeroes them instead
function Optimizer:zero_grad(set_to_none)
  for _, g in ipairs(self.param_groups) do
    for _, p in ipairs(g.params) do
      if set_to_none == false then
        local grad = p.grad
        if grad ~= nil then fsdp.no_grad(function() grad:zero_() end) end
      else
        p.grad = nil
      end
    end
  end
end

-- An FSDP parameter whose last backward ran inside no_sync holds its rank's local gradient, not yet
-- averaged with the other ranks' (model:no_sync): stepping on it would train each rank on its own
-- data. Checked for every parameter before any is updated.
function Optimizer:_check_reduced()
  for _, g in ipairs(self.param_groups) do
    for _, p in ipairs(g.params) do
      if C.fsdp_param_grad_unreduced(p.p) ~= 0 then
        local name, unit = require("fsdp.wrap").param_names(p)
        error(("%s.step: parameter '%s' of FSDP unit '%s' holds an unreduced gradient: the last backward "
          .. "ran inside no_sync; run one backward outside no_sync (it averages the accumulated gradients "
          .. "over ranks) before the step"):format(self.__name, name, unit), 0)
      end
    end
  end
end

--- step([closure]): updates every parameter that has a gradient, under no_grad. The closure (which
-- re-evaluates the model and returns the loss) runs first, with grad enabled; its result is returned.
function Optimizer:step(closure)
  local loss
  if closure then loss = closure() end
  local t0 = C.fsdp_trace_enabled() ~= 0 and C.fsdp_trace_now()
  local prev = C.fsdp_is_grad_enabled()
  C.fsdp_set_grad_enabled(0)
  local ok, err = pcall(function()
    self:_check_reduced()
    for _, g in ipairs(self.param_groups) do
      for _, p in ipairs(g.params) do
        local grad = p.grad
        if grad ~= nil then
          local key = tensor_key(p)
          local st = self.state[key]
          if not st then st = {}; self.state[key] = st end
          self:_update(g, p, grad, st)
          fsdp._release(grad)  -- zero_grad can then free the gradient at once
        end
      end
    end
  end)
  C.fsdp_set_grad_enabled(prev)
  if t0 then C.fsdp_trace_span(C.FSDP_TRACE_COMPUTE, "optimizer step", t0, -1) end
  if not ok then error(err, 0) end
  return loss
end

--- the state table of a parameter (nil before its first step)
function Optimizer:state_of(p) return self.state[tensor_key(p)] end

-- ---- state_dict (torch.optim layout) ---------------------------------------------------------------
--- { state = {[0] = {step = 3, exp_avg = t, ...}, ...},
--   param_groups = {{lr = ..., ..., params = {0, 1, ...}}, ...} }
-- Parameters are numbered from 0 across groups in order, as in PyTorch. State tensors are aliases.
function Optimizer:state_dict()
  local state, groups, idx = {}, {}, 0
  for gi, g in ipairs(self.param_groups) do
    local pg = {}
    for k, v in pairs(g) do if k ~= "params" then pg[k] = copy_value(v) end end
    pg.params = {}
    for _, p in ipairs(g.params) do
      pg.params[#pg.params + 1] = idx
      local st = self.state[tensor_key(p)]
      if st and next(st) ~= nil then
        local s = {}
        for k, v in pairs(st) do s[k] = v end
        s.fsdp_piece = optim._piece_of(p)
        state[idx] = s
      end
      idx = idx + 1
    end
    groups[gi] = pg
  end
  return { state = state, param_groups = groups }
end

-- state tensors are shaped like what the parameter holds (a sharded parameter: its piece)
local function shape_str(t) return "(" .. table.concat(fsdp._held_shape(t), ", ") .. ")" end

--- Copies a state_dict into this optimizer: hyperparameters per group, and per-parameter state
-- (tensors are copied into new OPTIM-category tensors; the dict stays independent). Checks
-- everything before changing anything.
function Optimizer:load_state_dict(sd)
  local name = self.__name
  if type(sd) ~= "table" or type(sd.param_groups) ~= "table" then
    error(name .. ":load_state_dict: expected {state = ..., param_groups = ...}", 2)
  end
  local saved = sd.param_groups
  if #saved ~= #self.param_groups then
    error(("%s:load_state_dict: the state dict has %d parameter groups, the optimizer has %d")
      :format(name, #saved, #self.param_groups), 2)
  end
  local by_index = {}  -- saved index -> param
  for gi, g in ipairs(self.param_groups) do
    local sp = saved[gi].params or {}
    if #sp ~= #g.params then
      error(("%s:load_state_dict: parameter group %d has %d params in the state dict, %d in the optimizer")
        :format(name, gi, #sp, #g.params), 2)
    end
    for i, p in ipairs(g.params) do by_index[tonumber(sp[i])] = p end
  end
  local new_state = {}
  for k, st in pairs(sd.state or {}) do
    local p = by_index[tonumber(k)]
    if not p then error(("%s:load_state_dict: state for unknown parameter index %s"):format(name, tostring(k)), 2) end
    local s = {}
    local has_tensors = false
    for sk, v in pairs(st) do
      if sk == "fsdp_piece" then  -- checked below, not state
      elseif is_tensor(v) then
        if sk ~= "step" and shape_str(v) ~= shape_str(p) then
          local pc = optim._piece_of(p)
          error(("%s:load_state_dict: state %q of parameter %s has shape %s, the parameter%s has shape %s")
            :format(name, sk, tostring(k), shape_str(v), pc and (" (sharded by FSDP) held on rank " .. fsdp.rank()
            .. ", " .. piece_str(pc) .. ",") or "", shape_str(p)), 2)
        end
        if sk == "step" then s[sk] = v:item()
        else
          local t = self._new_state(p, false)
          fsdp.no_grad(function() t:copy_(v) end)
          s[sk] = t
          has_tensors = true
        end
      else
        s[sk] = copy_value(v)
      end
    end
    if has_tensors then check_piece(name, k, p, st.fsdp_piece, optim._piece_of(p)) end
    new_state[tensor_key(p)] = s
  end
  for gi, g in ipairs(self.param_groups) do
    for k, v in pairs(saved[gi]) do
      if k ~= "params" then g[k] = copy_value(v) end
    end
  end
  self.state = new_state
end

function Optimizer:__tostring()
  local lines = { self.__name .. " (" }
  for gi, g in ipairs(self.param_groups) do
    lines[#lines + 1] = "Parameter Group " .. (gi - 1)
    local keys = {}
    for k in pairs(g) do if k ~= "params" then keys[#keys + 1] = k end end
    table.sort(keys)
    for _, k in ipairs(keys) do
      local v = g[k]
      if type(v) == "table" then
        local parts = {}
        for i, x in ipairs(v) do parts[i] = tostring(x) end
        v = "(" .. table.concat(parts, ", ") .. ")"
      end
      lines[#lines + 1] = ("    %s: %s"):format(k, tostring(v))
    end
  end
  lines[#lines + 1] = ")"
  return table.concat(lines, "\n")
end

-- ---- the optimizers ----------------------------------------------------------------------------------
optim.SGD = require "fsdp.optim.sgd"
local adam = require "fsdp.optim.adam"
optim.Adam, optim.AdamW = adam.Adam, adam.AdamW
optim.lr_scheduler = require "fsdp.optim.lr_scheduler"

return optim
