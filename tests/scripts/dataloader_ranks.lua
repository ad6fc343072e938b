-- tests/nn/dataloader_spec.lua: a DistributedSampler (num_replicas and rank from the communicator)
-- under a DataLoader on every rank; each rank writes the sample ids of its batches for 2 epochs
-- to DIR/rank<R>.json, and shows an fsdp.progress line (rank 0 alone prints).
--   bin/fsdprun -n 2 tests/scripts/dataloader_ranks.lua DIR
local fsdp = require "fsdp"
local json = require "fsdp.json"
fsdp.init()
local dir = assert(arg[1], "usage: dataloader_ranks.lua DIR")
local ids = fsdp.arange(101)
local ds = fsdp.data.TensorDataset(ids)
local sampler = fsdp.data.DistributedSampler(ds, { seed = 7, drop_last = true })
local loader = fsdp.data.DataLoader(ds, { batch_size = 8, sampler = sampler })
local epochs = {}
for epoch = 1, 2 do
  loader:set_epoch(epoch)
  local batches = {}
  local bar = fsdp.progress(#loader, { desc = "batches", unit = "batch" })
  for b in loader() do
    batches[#batches + 1] = b:tolist()
    bar:update(1)
  end
  bar:close()
  epochs[epoch] = batches
end
-- every rank ran the same number of batches: a collective per batch count would hang otherwise
local n = fsdp.tensor({ #epochs[1] })
fsdp.all_reduce(n, "max")
assert(n:item() == #epochs[1], "batch counts differ between ranks")
local f = assert(io.open(("%s/rank%d.json"):format(dir, fsdp.rank()), "w"))
f:write(json.encode({ epochs = epochs }, "rank file"))
f:close()
fsdp.barrier()
