-- fsdp.multinomial draws the same samples on every rank for the same seed (tests/ops/select_ops_spec.lua
-- runs this under bin/fsdprun -n 2): each rank seeds 19, draws with and without replacement from
-- 2-D probabilities, and prints "multinomial rank R: <samples>" for the spec to compare; the ranks
-- also compare the samples themselves through an all-reduce of their sum and of their square sum.
local fsdp = require "fsdp"
local comm = require "fsdp.comm"
fsdp.init()
local rank, N = fsdp.rank(), fsdp.world_size()
fsdp.manual_seed(19)
local probs = fsdp.tensor({ { 1, 2, 3, 4, 0 }, { 0.5, 0, 0, 0, 0.5 }, { 5, 1, 1, 1, 1 } })
local a = probs:multinomial(6, { replacement = true })
local b = fsdp.multinomial(probs, 2)
local samples = fsdp.cat({ a, b }, 2)
local flat = samples:tolist()
for i = 1, #flat do flat[i] = ("%d"):format(flat[i]) end
-- every rank's samples equal rank 0's: the sum over ranks of (s - s0)^2 is zero, s0 broadcast
local mine = samples:float()
local first = mine:clone()
comm.broadcast(first, 0)
local diff = ((mine - first) ^ 2):sum()
comm.all_reduce(diff, "sum")
assert(diff:item() == 0, ("rank %d: samples differ from rank 0's"):format(rank))
print(("multinomial rank %d/%d: %s"):format(rank, N, table.concat(flat, " ")))
