-- Exit status forwarding: after a barrier, rank `arg[1]` exits with status arg[2]; the others 0.
local fsdp = require "fsdp"
local who, code = tonumber(arg[1]), tonumber(arg[2])
fsdp.barrier()
io.write(("rank %d/%d done\n"):format(fsdp.rank(), fsdp.world_size()))
io.flush()
os.exit(fsdp.rank() == who and code or 0)
