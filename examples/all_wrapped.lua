-- Report 1 as a runnable example: every Linear of an MLP wrapped, plus a wrapped root that owns no
-- parameters. FSDP training on N ranks must equal single-process training of the same unwrapped
-- model on the same global batch.
--
--   bin/fsdprun -n 2 examples/all_wrapped.lua [--steps 6]      (or plain luajit: one rank)
--
-- Prints, per step, the FSDP loss (mean over ranks of each rank's slice) beside the single-process
-- loss of the whole global batch, then the largest parameter difference and a final line
-- "OK" or "MISMATCH: ..." (exit status 1).
local script_dir = (arg and arg[0] or ""):match("^(.*)/[^/]*$") or "."
if not package.searchpath("fsdp", package.path) then
  local root = script_dir .. "/.."
  package.path = root .. "/lua/?.lua;" .. root .. "/lua/?/init.lua;" .. package.path
  package.cpath = root .. "/?.so;" .. package.cpath
end
local fsdp = require "fsdp"
local nn, optim, F = fsdp.nn, fsdp.optim, fsdp.nn.functional

local steps = 6
for i = 1, #arg do if arg[i] == "--steps" then steps = tonumber(arg[i + 1]) or steps end end

fsdp.init()
local R, N = fsdp.rank(), fsdp.world_size()
local say = R == 0 and function(fmt, ...) io.write(fmt:format(...), "\n") io.flush() end or function() end

local D_IN, H, CLASSES, PER_RANK = 20, 32, 5, 8
local function build()
  fsdp.manual_seed(0)
  return nn.Sequential(nn.Linear(D_IN, H), nn.ReLU(), nn.Linear(H, H), nn.ReLU(),
    nn.Linear(H, H), nn.ReLU(), nn.Linear(H, CLASSES))
end

local ref, model = build(), build()
for _, i in ipairs { "0", "2", "4", "6" } do fsdp.wrap(model[i]) end  -- four Linears, each a unit
fsdp.wrap(model)                                                     -- the root: owns no parameter
local ref_opt = optim.SGD(ref:parameters(), { lr = 0.05, momentum = 0.9 })
local opt = optim.SGD(model:parameters(), { lr = 0.05, momentum = 0.9 })

local B = PER_RANK * N  -- global batch; rank r takes rows [r*PER_RANK, (r+1)*PER_RANK)
say("all_wrapped: Linear(%d,%d)-ReLU-Linear(%d,%d)-ReLU-Linear(%d,%d)-ReLU-Linear(%d,%d), each Linear an FSDP unit, root unit with no parameters",
  D_IN, H, H, H, H, H, H, CLASSES)
say("%d ranks, global batch %d, SGD momentum 0.9, %d steps", N, B, steps)
say("%-5s %-18s %-18s %s", "step", "fsdp loss", "single-process", "|diff|")
local bad = {}
local TOL = 1e-5
for step = 1, steps do
  fsdp.manual_seed(100 + step)            -- the same global batch on every rank
  local x, y = fsdp.randn { B, D_IN }, fsdp.randint(0, CLASSES, { B })
  local lref = F.cross_entropy(ref(x), y)
  ref_opt:zero_grad(); lref:backward(); ref_opt:step()
  local xs, ys = x:narrow(1, R * PER_RANK + 1, PER_RANK), y:narrow(1, R * PER_RANK + 1, PER_RANK)
  local l = F.cross_entropy(model(xs), ys)
  opt:zero_grad(); l:backward(); opt:step()
  local t = fsdp.tensor({ l:item() })
  if N > 1 then fsdp.all_reduce(t, "avg") end
  local a, b = t:item(), lref:item()
  local d = math.abs(a - b)
  say("%-5d %-18.9f %-18.9f %.2e", step, a, b, d)
  if d > TOL * math.max(1, math.abs(b)) then bad[#bad + 1] = ("step %d loss %.9g vs %.9g"):format(step, a, b) end
  if not fsdp.all_idle() then bad[#bad + 1] = ("step %d: a unit is not idle after the step"):format(step) end
end

-- parameters: the gathered state dict of the FSDP model against the reference
local sd, rsd = model:state_dict(), ref:state_dict()
local worst, worst_name = 0, "-"
for name, t in pairs(rsd) do
  local a, b = sd[name]:tolist(), t:tolist()
  for i = 1, #b do
    local d = math.abs(a[i] - b[i])
    if d > worst then worst, worst_name = d, name end
  end
end
say("largest parameter difference: %.3e (%s)", worst, worst_name)
if worst > TOL then bad[#bad + 1] = ("parameter %s differs by %.3g"):format(worst_name, worst) end

local states = {}
for path, s in pairs(fsdp.unit_states(model)) do states[#states + 1] = path .. "=" .. s end
table.sort(states)
say("units: %s", table.concat(states, " "))
if #bad == 0 then
  say("OK: FSDP on %d ranks equals single-process training (losses and parameters within %g)", N, TOL)
else
  say("MISMATCH: %s", table.concat(bad, "; "))
  os.exit(1)
end
