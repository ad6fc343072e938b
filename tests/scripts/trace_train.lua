-- Two training steps of a model with two FSDP units under the timeline trace (FSDP_TRACE=path set
-- by tests/core/trace_spec.lua), then a validation forward under no_grad. Prints one line,
-- "rank R collectives N", N every collective counted by fsdp.comm_stats (what the trace's
-- communication track must hold).
local fsdp = require "fsdp"
local nn = fsdp.nn
fsdp.manual_seed(1)
local inner = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16))
local m = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), inner, nn.ReLU(), nn.Linear(16, 3))
fsdp.wrap(inner)
fsdp.wrap(m)
local opt = fsdp.optim.AdamW(m:parameters(), { lr = 1e-3 })
local x, y = fsdp.randn(8, 4), fsdp.randn(8, 3)
for _ = 1, 2 do
  opt:zero_grad()
  nn.functional.mse_loss(m(x), y):backward()
  opt:step()
end
fsdp.no_grad(function() return m(x) end)
local n = 0
for _, v in pairs(fsdp.comm_stats()) do n = n + v.count end
print(("rank %d collectives %d"):format(fsdp.rank(), n))
