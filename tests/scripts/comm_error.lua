-- Rank 1 raises a Lua error while the others wait in a collective: fsdprun must exit non-zero
-- within seconds, showing rank 1's message. With arg[1] == "early" rank 1 fails before it ever
-- initializes the communicator (mpirun alone must then stop the others).
local fsdp = require "fsdp"
local early = arg[1] == "early"
if early and os.getenv("OMPI_COMM_WORLD_RANK") == "1" then error("rank 1 exploded early on purpose") end
local r = fsdp.rank()
fsdp.barrier()
if r == 1 then error("rank 1 exploded on purpose") end
fsdp.all_reduce(fsdp.ones(1000), "sum", { tag = "waiting" })
io.write(("rank %d passed the all_reduce: wrong\n"):format(r))
