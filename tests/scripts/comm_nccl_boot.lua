-- The MPI bootstrap of NCCL, which needs no GPU: rank 0 makes NCCL's unique ids
-- (ncclGetUniqueId), the mpi backend broadcasts them. Prints "rank R digest D" (D: the ids'
-- digest, the same on every rank when the broadcast worked) and "rank R after: ok" once a
-- collective after it still works.
local fsdp = require "fsdp"
local r = fsdp.rank()
local d = fsdp.comm.plane_bootstrap("nccl")
io.write(("rank %d digest %s\n"):format(r, d))
local t = fsdp.all_reduce(fsdp.ones(3), "sum")
assert(t:tolist()[1] == fsdp.world_size())
io.write(("rank %d after: ok\n"):format(r))
