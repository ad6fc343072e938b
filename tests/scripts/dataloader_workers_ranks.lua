-- tests/nn/dataloader_workers_spec.lua: on every rank, a DistributedSampler (shuffled, drop_last)
-- under DataLoaders with num_workers = 0 and 2 (and 2 persistent), 2 epochs each, and a collective
-- called in a worker (an error); prints "WORKERS OK 2" when every rank got the same batches from each.
--   bin/fsdprun -n 2 tests/scripts/dataloader_workers_ranks.lua
local fsdp = require "fsdp"
fsdp.init()
local ds = fsdp.data.TensorDataset(fsdp.arange(101), fsdp.randn(101, 3))
local function epochs(opts)
  local sampler = fsdp.data.DistributedSampler(ds, { seed = 7, drop_last = true })
  opts.batch_size, opts.sampler = 8, sampler
  local loader = fsdp.data.DataLoader(ds, opts)
  local out = {}
  for epoch = 1, 2 do
    loader:set_epoch(epoch)
    for ids, x in loader() do out[#out + 1] = table.concat(ids:tolist(), ",") .. "|" .. table.concat(x:view(-1):tolist(), ",") end
  end
  return table.concat(out, "\n")
end
local want = epochs({})
assert(#want > 0)
assert(epochs({ num_workers = 2 }) == want, "num_workers = 2 differs from 0")
assert(epochs({ num_workers = 2, persistent_workers = true }) == want, "persistent workers differ from 0")
-- a dataset that calls a collective in a worker: the communicator's thread is not in the worker,
-- so the call is an error naming the forked process, raised in the loop (it hung before)
local Coll = fsdp.data.Dataset:extend("Coll")
function Coll:len() return 4 end
function Coll:get(i)
  local t = fsdp.tensor({ i })
  fsdp.all_reduce(t, "sum")
  return t
end
local ok, err = pcall(function() for _ in fsdp.data.DataLoader(Coll(), { num_workers = 1 })() do end end)
assert(not ok and err:find("forked from process", 1, true) and err:find("DataLoader worker 0", 1, true), tostring(err))
-- every rank got here: the communicator still works after the forks
local n = fsdp.tensor({ 1 })
fsdp.all_reduce(n, "sum")
print(("WORKERS OK %d"):format(n:item()))
