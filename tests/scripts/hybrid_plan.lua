-- tests/fsdp/hybrid_spec.lua at 4 ranks: a second hybrid group size is refused; one training step of a
-- model with two hybrid units (shard groups of 2) issues the collectives fsdp.summary predicts
local fsdp = require "fsdp"
local nn, F = fsdp.nn, fsdp.nn.functional
fsdp.init()
fsdp.manual_seed(0)
local m = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Sequential(nn.Linear(16, 16), nn.ReLU()), nn.Linear(16, 3))
fsdp.wrap(m:children()[3], { sharding = "hybrid", shard_group_size = 2 })
fsdp.wrap(m, { sharding = "hybrid", shard_group_size = 2 })
local ok, err = pcall(fsdp.wrap, nn.Linear(2, 2), { sharding = "hybrid", shard_group_size = 4 })
if fsdp.rank() == 0 then print("second size: " .. (ok and "accepted" or tostring(err))) end
local opt = fsdp.optim.SGD(m:parameters(), { lr = 0.1 })
local x, y = fsdp.randn(4, 8), fsdp.randint(0, 3, { 4 })
opt:zero_grad(); F.cross_entropy(m(x), y):backward(); opt:step()  -- (the first step also makes the plan known)
local plan = fsdp.summary(m, { print = false })
fsdp.comm.reset_stats()
opt:zero_grad(); F.cross_entropy(m(x), y):backward(); opt:step()
local st = fsdp.comm_stats()
if fsdp.rank() == 0 then
  print(("plan ag %d rs %d ar %d"):format(plan.step.all_gather.count, plan.step.reduce_scatter.count, plan.step.all_reduce.count))
  print(("stats ag %d rs %d ar %d"):format(st.all_gather.count, st.reduce_scatter.count, st.all_reduce.count))
end
