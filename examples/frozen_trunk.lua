-- Report 2 as a runnable example: a conv model whose frozen trunk holds nested FSDP units (each
-- conv block wrapped, the trunk wrapped around them), a trainable wrapped head and a wrapped root.
-- FSDP training on N ranks must equal single-process training of the same unwrapped model on the
-- same global batch; the frozen trunk must stay unchanged and cost no gradient reduction.
--
--   bin/fsdprun -n 2 examples/frozen_trunk.lua [--steps 5]      (or plain luajit: one rank)
--
-- Prints, per step, the FSDP loss (mean over ranks of each rank's slice) beside the single-process
-- loss of the whole global batch and the reduce-scatter traffic, then the largest parameter
-- difference and a final line "OK" or "MISMATCH: ..." (exit status 1).
local script_dir = (arg and arg[0] or ""):match("^(.*)/[^/]*$") or "."
if not package.searchpath("fsdp", package.path) then
  local root = script_dir .. "/.."
  package.path = root .. "/lua/?.lua;" .. root .. "/lua/?/init.lua;" .. package.path
  package.cpath = root .. "/?.so;" .. package.cpath
end
local fsdp = require "fsdp"
local nn, optim, F = fsdp.nn, fsdp.optim, fsdp.nn.functional

local steps = 5
for i = 1, #arg do if arg[i] == "--steps" then steps = tonumber(arg[i + 1]) or steps end end

fsdp.init()
local R, N = fsdp.rank(), fsdp.world_size()
local say = R == 0 and function(fmt, ...) io.write(fmt:format(...), "\n") io.flush() end or function() end

-- the model of examples/train.lua, smaller: 2 x Conv3x3-ReLU-MaxPool (1-4-8 channels, 12 -> 6 -> 3)
local C1, C2, S, CLASSES, PER_RANK = 4, 8, 12, 10, 4
local function block(cin, cout)
  return nn.Sequential(nn.Conv2d(cin, cout, 3, { padding = 1 }), nn.ReLU(), nn.MaxPool2d(2))
end
local Net = nn.Module:extend("FrozenTrunkNet")
function Net:__init()
  self.trunk = nn.Sequential(block(1, C1), block(C1, C2))
  self.head = nn.Sequential(nn.Flatten(), nn.Linear(C2 * (S / 4) ^ 2, 32), nn.ReLU(), nn.Linear(32, CLASSES))
end
function Net:forward(x) return self.head(self.trunk(x)) end

local function build()
  fsdp.manual_seed(0)
  local m = Net()
  for _, p in m.trunk:named_parameters() do p.requires_grad = false end  -- freeze the trunk
  return m
end

local ref, model = build(), build()
local trunk0 = ref.trunk:state_dict()
for k, t in pairs(trunk0) do trunk0[k] = t:clone() end
fsdp.wrap(model.trunk["0"]); fsdp.wrap(model.trunk["1"])  -- nested units inside the frozen trunk
fsdp.wrap(model.trunk)                                     -- the trunk: a unit owning no parameters
fsdp.wrap(model.head)
fsdp.wrap(model)                                           -- the root
local ref_opt = optim.Adam(ref:parameters(), { lr = 0.01 })
local opt = optim.Adam(model:parameters(), { lr = 0.01 })  -- frozen parameters get no grad: skipped

local head_numel, head_params = 0, 0
for _, p in ref.head:named_parameters() do head_numel, head_params = head_numel + p:numel(), head_params + 1 end
local B = PER_RANK * N
say("frozen_trunk: trunk 2 x Conv3x3-ReLU-MaxPool (1-%d-%d) frozen, blocks and trunk wrapped; head MLP (%d parameters) wrapped; root wrapped",
  C1, C2, head_numel)
say("%d ranks, global batch %d, Adam lr 0.01, %d steps", N, B, steps)
say("%-5s %-18s %-18s %-10s %s", "step", "fsdp loss", "single-process", "|diff|", "reduce-scatter (calls, bytes)")
local bad = {}
local TOL = 1e-5
for step = 1, steps do
  fsdp.manual_seed(100 + step)            -- the same global batch on every rank
  local x, y = fsdp.randn { B, 1, S, S }, fsdp.randint(0, CLASSES, { B })
  local lref = F.cross_entropy(ref(x), y)
  ref_opt:zero_grad(); lref:backward(); ref_opt:step()
  local xs, ys = x:narrow(1, R * PER_RANK + 1, PER_RANK), y:narrow(1, R * PER_RANK + 1, PER_RANK)
  local before = fsdp.comm_stats().reduce_scatter
  local l = F.cross_entropy(model(xs), ys)
  opt:zero_grad(); l:backward(); opt:step()
  local after = fsdp.comm_stats().reduce_scatter
  local rs_calls, rs_bytes = after.count - before.count, after.bytes - before.bytes
  local t = fsdp.tensor({ l:item() })
  if N > 1 then fsdp.all_reduce(t, "avg") end
  local a, b = t:item(), lref:item()
  local d = math.abs(a - b)
  say("%-5d %-18.9f %-18.9f %-10.2e %d, %d", step, a, b, d, rs_calls, rs_bytes)
  if d > TOL * math.max(1, math.abs(b)) then bad[#bad + 1] = ("step %d loss %.9g vs %.9g"):format(step, a, b) end
  if not fsdp.all_idle() then bad[#bad + 1] = ("step %d: a unit is not idle after the step"):format(step) end
  -- only the head's gradients are reduced: its parameters, each padded to a multiple of N, in fp32
  local limit = (head_numel + head_params * N) * 4
  if N > 1 and rs_bytes > limit then
    bad[#bad + 1] = ("step %d: %d reduce-scatter bytes, more than the head's %d (frozen trunk gradients reduced?)"):format(step, rs_bytes, limit)
  end
end

-- parameters: the gathered state dict of the FSDP model against the reference; the trunk unchanged
local sd, rsd = model:state_dict(), ref:state_dict()
local worst, worst_name, trunk_moved = 0, "-", 0
for name, t in pairs(rsd) do
  local a, b = sd[name]:tolist(), t:tolist()
  for i = 1, #b do
    local d = math.abs(a[i] - b[i])
    if d > worst then worst, worst_name = d, name end
  end
  if trunk0[name:gsub("^trunk%.", "")] then
    local t0 = trunk0[name:gsub("^trunk%.", "")]:tolist()
    for i = 1, #t0 do trunk_moved = math.max(trunk_moved, math.abs(a[i] - t0[i])) end
  end
end
say("largest parameter difference: %.3e (%s); largest change of a frozen trunk parameter: %.3e", worst, worst_name, trunk_moved)
if worst > TOL then bad[#bad + 1] = ("parameter %s differs by %.3g"):format(worst_name, worst) end
if trunk_moved ~= 0 then bad[#bad + 1] = ("the frozen trunk changed by %.3g"):format(trunk_moved) end

local states = {}
for path, s in pairs(fsdp.unit_states(model)) do states[#states + 1] = path .. "=" .. s end
table.sort(states)
say("units: %s", table.concat(states, " "))
if #bad == 0 then
  say("OK: FSDP on %d ranks equals single-process training (losses and parameters within %g), frozen trunk unchanged", N, TOL)
else
  say("MISMATCH: %s", table.concat(bad, "; "))
  os.exit(1)
end
