-- Prints what tests/tools/launch_spec.lua checks fsdprun's output with. Modes (arg[1]):
--   lines N       N lines per rank, each written in three pieces ("L <rank> <i> " .. 60 x's)
--   fail          every rank raises the same error
--   exit R CODE   rank R exits with CODE at once, before MPI starts; the others wait in fsdp.init
--   ranks         "rank R local L/S world W" per rank
--   sleep         every rank sleeps (to be killed)
local fsdp = require "fsdp"
if arg[1] == "exit" and os.getenv("OMPI_COMM_WORLD_RANK") == arg[2] then os.exit(tonumber(arg[3])) end
fsdp.init()
local r = fsdp.rank()
local mode = arg[1]
if mode == "lines" then
  for i = 1, tonumber(arg[2]) do
    io.write("L ", r, " ")
    io.write(i, " ")
    io.write(("x"):rep(60), "\n")
  end
elseif mode == "fail" then
  local x = fsdp.randn(2, 3)
  local _ = x:matmul(fsdp.randn(4, 5))
elseif mode == "exit" then
  fsdp.barrier()
elseif mode == "ranks" then
  print(("rank %d local %d/%d world %d"):format(r, fsdp.local_rank(), fsdp.local_world_size(), fsdp.world_size()))
elseif mode == "sleep" then
  print("sleeping")
  os.execute("sleep 60")
end
