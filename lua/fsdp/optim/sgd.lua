--- optim.SGD(params, {lr = 1e-3, momentum = 0, dampening = 0, weight_decay = 0, nesterov = false,
--                    maximize = false})  -- torch.optim.SGD
--   g = (maximize ? -grad : grad) + weight_decay * p
--   momentum != 0:  buf = g on the first step, else momentum * buf + (1 - dampening) * g
--                   g = nesterov ? g + momentum * buf : buf
--   p = p - lr * g
-- State per parameter: momentum_buffer (when momentum != 0), in the OPTIM memory category.
-- @module fsdp.optim.sgd
local fsdp = require "fsdp"
local Optimizer = require("fsdp.optim").Optimizer
local C = fsdp.C

local SGD = Optimizer:extend("SGD")

local function check_hparam(ok, fmt, ...)
  if not ok then error(fmt:format(...), 4) end
end

--- the options may also come by position: torch.optim.SGD(params, 0.1[, momentum, ...]) (optim._options)
function SGD:__init(params, ...)
  local opts = require("fsdp.optim")._options("SGD", ...)
  local d = {
    lr = opts.lr or 1e-3, momentum = opts.momentum or 0, dampening = opts.dampening or 0,
    weight_decay = opts.weight_decay or 0, nesterov = opts.nesterov or false, maximize = opts.maximize or false,
  }
  local fin = function(v) return v >= 0 and v < math.huge end  -- (NaN fails too)
  check_hparam(fin(d.lr), "SGD: invalid learning rate: %s (lr must be a finite number >= 0)", tostring(d.lr))
  check_hparam(fin(d.momentum), "SGD: invalid momentum value: %s", tostring(d.momentum))
  check_hparam(d.dampening == d.dampening and math.abs(d.dampening) < math.huge, "SGD: invalid dampening value: %s",
    tostring(d.dampening))
  check_hparam(fin(d.weight_decay), "SGD: invalid weight_decay value: %s", tostring(d.weight_decay))
  check_hparam(not d.nesterov or (d.momentum > 0 and d.dampening == 0),
    "SGD: nesterov momentum requires a momentum and zero dampening")
  Optimizer.__init(self, params, d)
end

function SGD:_update(g, p, grad, st)
  local buf, first = st.momentum_buffer, 0
  if g.momentum ~= 0 and buf == nil then
    buf, first = self._new_state(p, false), 1  -- the kernel initializes it from the gradient
  end
  fsdp._check(C.fsdp_sgd_step(p.p, grad.p, fsdp._p(buf), g.lr, g.momentum, g.dampening, g.weight_decay,
    g.nesterov and 1 or 0, first, g.maximize and 1 or 0))
  if buf ~= nil then st.momentum_buffer = buf end
end

return SGD
