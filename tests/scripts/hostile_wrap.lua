-- Changing a model after fsdp.wrap (issue 39, item 8; docs/fsdp.md, "Units"): a unit's parameters
-- are sharded once, when it is wrapped, so adding, replacing or removing a parameter or a
-- submodule anywhere in a wrapped model must be refused at the next forward, naming what changed
-- and the unit -- never trained silently unsharded and unreduced (each rank then ended with its
-- own weights). Changing values in place (copy_, load_state_dict), freezing, putting the original
-- back and building other models stay fine: those train equal to one process on the global batch.
--   bin/fsdprun -n 2 tests/scripts/hostile_wrap.lua
-- Prints "CHECK <name> PASS|FAIL" per check on rank 0 ("DETAIL" lines say why), then
-- "SUMMARY ws=N checks=K failed=F"; exit status 1 when a check failed.
local fsdp = require "fsdp"
local nn, optim = fsdp.nn, fsdp.optim
fsdp.init()
fsdp.comm.set_timeout(60)
local R, N = fsdp.rank(), fsdp.world_size()

local checks = dofile(((arg and arg[0] or ""):match("^(.*)/[^/]*$") or ".") .. "/checks.lua")
local check = checks.check

-- model["0"] is a unit inside the root unit
local function build()
  fsdp.manual_seed(3)
  return nn.Sequential(nn.Sequential(nn.Linear(4, 8), nn.ReLU()), nn.Linear(8, 2))
end
local function wrapped()
  local m = build()
  fsdp.wrap(m["0"])
  fsdp.wrap(m)
  return m
end

-- the global batch: 8 rows, each rank takes its 8 / N
fsdp.manual_seed(11)
local X, Y = fsdp.randn { 8, 4 }, fsdp.randn { 8, 2 }
local rows = math.floor(8 / N)
local function batch(global)
  if global then return X, Y end
  return X:narrow(1, R * rows + 1, rows), Y:narrow(1, R * rows + 1, rows)
end

-- `steps` SGD steps (between_steps(i) runs before step i), the sharded model on this rank's rows,
-- the reference on all of them
local function train(m, global, steps, between_steps)
  local opt = optim.SGD(m:parameters(), { lr = 0.1 })
  local x, y = batch(global)
  for i = 1, steps do
    if between_steps then between_steps(i) end
    local loss = (m(x) - y):pow(2):mean()
    opt:zero_grad()
    loss:backward()
    opt:step()
  end
end

-- the gathered state dict of m against ref's, within float32 rounding of the batch split
local function same_state(fail, m, ref, what)
  local a, b = m:state_dict(), ref:state_dict()
  for k, t in pairs(b) do
    local u = a[k]
    if not u then
      fail(what .. ": no " .. k)
    else
      local d = (u - t):abs():max():item()
      if not (d <= 1e-5) then fail(("%s: %s differs from one process's by %.3g"):format(what, k, d)) end
    end
  end
end

-- fn() must raise an error naming every fragment
local function refused(fail, fn, ...)
  local ok, err = pcall(fn)
  if ok then
    fail("no error")
    return
  end
  err = tostring(err)
  for _, frag in ipairs { ... } do
    if not err:find(frag, 1, true) then fail(("the error does not mention %q: %s"):format(frag, err)) end
  end
end

check("unchanged: trains equal to one process", function(fail)
  local m, ref = wrapped(), build()
  train(m, false, 3)
  train(ref, true, 3)
  same_state(fail, m, ref, "unchanged")
end)

-- every kind of change after wrap, and what the forward's error must name
local x1 = batch()
local CHANGED = "fsdp forward: the model changed after fsdp.wrap"
local CHANGES = {
  { "a Linear inside a unit replaced", function(m) m["0"]["0"] = nn.Linear(4, 8) end,
    "0.0.weight was replaced by a new parameter of shape (8, 4), which is not in the plan of unit '0'" },
  { "a parameter added to the root", function(m) m.extra = nn.Parameter(fsdp.ones { 2 }) end,
    "extra (a new parameter of shape (2)) is not in the plan of unit '<root>'" },
  { "a whole wrapped unit replaced", function(m) m["0"] = nn.Sequential(nn.Linear(4, 8), nn.ReLU()) end,
    "unit '0' (Sequential) was removed or replaced", "0.0.weight was replaced" },
  { "a wrapped unit removed", function(m) m["0"] = nil end, "unit '0' (Sequential) was removed or replaced" },
  { "module.weight = a new tensor", function(m) m["1"].weight = fsdp.randn { 2, 8 } end,
    "1.weight was replaced by a new parameter of shape (2, 8)" },
  { "register_parameter inside a unit", function(m) m["0"]["0"]:register_parameter("scale", nn.Parameter(fsdp.ones { 8 })) end,
    "0.0.scale (a new parameter of shape (8)) is not in the plan of unit '0'" },
  { "Sequential append inside a unit", function(m) m["0"]:append(nn.Linear(8, 8)) end,
    "0.2.weight (a new parameter of shape (8, 8)) is not in the plan of unit '0'" },
  { "ModuleList append at the root", function(m)
    m.more = nn.ModuleList()
    m.more:append(nn.Linear(2, 2))
  end, "more.0.weight (a new parameter of shape (2, 2)) is not in the plan of unit '<root>'" },
  { "add_module at the root", function(m) m:add_module("head", nn.Linear(2, 2)) end,
    "head.weight (a new parameter of shape (2, 2))" },
  { "a parameter set to nil", function(m) m["1"].bias = nil end,
    "1.bias (a parameter of shape (2) in the plan of unit '<root>') was removed" },
  { "a Linear removed inside a unit", function(m) m["0"]["0"] = nil end,
    "0.0.weight (a parameter of shape (8, 4) in the plan of unit '0') was removed" },
  { "register_buffer over a parameter", function(m) m["1"]:register_buffer("bias", fsdp.zeros { 2 }) end,
    "1.bias (a parameter of shape (2) in the plan of unit '<root>') was removed" },
  { "a wrapped module put inside", function(m) m.head = fsdp.wrap(nn.Linear(2, 2)) end,
    "unit head (Linear) was put inside unit '<root>'" },
}
for _, c in ipairs(CHANGES) do
  check("refused at the next forward: " .. c[1], function(fail)
    local m = wrapped()
    c[2](m)
    refused(fail, function() return m(x1) end, CHANGED, unpack(c, 3))
    refused(fail, function() return m(x1) end, CHANGED)  -- (every forward, until put back)
  end)
end

check("refused after training steps too", function(fail)
  local m = wrapped()
  train(m, false, 1)
  m["0"]["0"] = nn.Linear(4, 8)
  refused(fail, function() return m(x1) end, CHANGED, "0.0.weight was replaced")
end)

check("put back after the error: trains equal to one process", function(fail)
  local m, ref = wrapped(), build()
  local orig = m["0"]["0"]
  m["0"]["0"] = nn.Linear(4, 8)
  refused(fail, function() return m(x1) end, CHANGED)
  m["0"]["0"] = orig
  train(m, false, 3)
  train(ref, true, 3)
  same_state(fail, m, ref, "put back")
end)

check("values changed in place after wrap (copy_, load_state_dict): equal to one process", function(fail)
  local m, ref = wrapped(), build()
  local sd = build():state_dict()
  for k, t in pairs(sd) do sd[k] = t * 0.5 + 0.25 end
  m:load_state_dict(sd)
  ref:load_state_dict(sd)
  fsdp.no_grad(function()
    m["1"].bias:copy_(fsdp.tensor { 0.5, -0.5 })
    ref["1"].bias:copy_(fsdp.tensor { 0.5, -0.5 })
  end)
  train(m, false, 3)
  train(ref, true, 3)
  same_state(fail, m, ref, "in place")
end)

check("freezing and unfreezing after wrap: equal to one process", function(fail)
  local m, ref = wrapped(), build()
  local function toggle(model)
    return function(i)
      if i == 1 then model["0"]:requires_grad_(false) end
      if i == 3 then model["0"]:requires_grad_(true) end
    end
  end
  train(m, false, 4, toggle(m))
  train(ref, true, 4, toggle(ref))
  same_state(fail, m, ref, "frozen")
end)

check("other models built and changed between steps: no error, equal to one process", function(fail)
  local m, ref = wrapped(), build()
  local function other()
    local o = nn.Sequential(nn.Linear(2, 2))
    o["0"] = nn.Linear(3, 3)
    o:add_module("x", nn.Linear(1, 1))
  end
  train(m, false, 3, other)
  train(ref, true, 3)
  same_state(fail, m, ref, "others changed")
end)

checks.finish()
