--- optim.Adam(params, {lr = 1e-3, betas = {0.9, 0.999}, eps = 1e-8, weight_decay = 0, amsgrad = false,
--                     maximize = false})                              -- torch.optim.Adam
-- optim.AdamW(params, {... weight_decay = 1e-2})                      -- torch.optim.AdamW
--   g = maximize ? -grad : grad;  Adam: g = g + weight_decay * p;  AdamW: p = p * (1 - lr * weight_decay)
--   exp_avg = beta1 * exp_avg + (1 - beta1) * g;  exp_avg_sq = beta2 * exp_avg_sq + (1 - beta2) * g^2
--   amsgrad: max_exp_avg_sq = max(max_exp_avg_sq, exp_avg_sq), used in place of exp_avg_sq below
--   p = p - lr / (1 - beta1^t) * exp_avg / (sqrt(exp_avg_sq) / sqrt(1 - beta2^t) + eps)
-- State per parameter: step (a number), exp_avg, exp_avg_sq[, max_exp_avg_sq] (OPTIM memory category).
-- @module fsdp.optim.adam
local fsdp = require "fsdp"
local Optimizer = require("fsdp.optim").Optimizer
local C = fsdp.C

local function check_hparam(ok, fmt, ...)
  if not ok then error(fmt:format(...), 5) end
end

-- the options may also come by position: torch.optim.Adam(params, 1e-3[, betas, ...]) (optim._options)
local function defaults(name, wd_default, ...)
  local opts = require("fsdp.optim")._options(name, ...)
  local betas = opts.betas or { 0.9, 0.999 }
  local d = {
    lr = opts.lr or 1e-3, betas = { betas[1], betas[2] }, eps = opts.eps or 1e-8,
    weight_decay = opts.weight_decay or wd_default, amsgrad = opts.amsgrad or false, maximize = opts.maximize or false,
  }
  local fin = function(v) return v >= 0 and v < math.huge end  -- (NaN fails too)
  check_hparam(fin(d.lr), "%s: invalid learning rate: %s (lr must be a finite number >= 0)", name, tostring(d.lr))
  check_hparam(fin(d.eps), "%s: invalid epsilon value: %s (eps must be a finite number >= 0)", name, tostring(d.eps))
  check_hparam(type(betas[1]) == "number" and betas[1] >= 0 and betas[1] < 1,
    "%s: invalid beta parameter at index 1: %s", name, tostring(betas[1]))
  check_hparam(type(betas[2]) == "number" and betas[2] >= 0 and betas[2] < 1,
    "%s: invalid beta parameter at index 2: %s", name, tostring(betas[2]))
  check_hparam(fin(d.weight_decay), "%s: invalid weight_decay value: %s", name, tostring(d.weight_decay))
  return d
end

local Adam = Optimizer:extend("Adam")
Adam.decoupled = false

--- Adam(params[, {lr = 1e-3, betas = {0.9, 0.999}, eps = 1e-8, weight_decay = 0, amsgrad, maximize}]): the Adam optimizer.
-- @function Adam
function Adam:__init(params, ...)
  Optimizer.__init(self, params, defaults(self.__name, self.decoupled and 1e-2 or 0, ...))
end

function Adam:_update(g, p, grad, st)
  local m, v, vmax = st.exp_avg, st.exp_avg_sq, st.max_exp_avg_sq
  if m == nil then m, v = self._new_state(p, true), self._new_state(p, true) end
  if g.amsgrad and vmax == nil then vmax = self._new_state(p, true) end
  local step = (st.step or 0) + 1
  fsdp._check(C.fsdp_adam_step(p.p, grad.p, m.p, v.p, g.amsgrad and vmax.p or nil, step, g.lr, g.betas[1], g.betas[2],
    g.eps, g.weight_decay, self.decoupled and 1 or 0, g.amsgrad and 1 or 0, g.maximize and 1 or 0))
  st.step, st.exp_avg, st.exp_avg_sq = step, m, v
  if vmax ~= nil then st.max_exp_avg_sq = vmax end
end

--- AdamW(params[, {lr = 1e-3, betas, eps, weight_decay = 1e-2, amsgrad, maximize}]): Adam with decoupled weight decay.
-- @function AdamW
-- @param params a list of parameters or param groups
-- @param opts options table or number (lr)

local AdamW = Adam:extend("AdamW")
AdamW.decoupled = true

return { Adam = Adam, AdamW = AdamW }
