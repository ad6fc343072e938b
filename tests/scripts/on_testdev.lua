-- Runs a script with the test double of a GPU (backend/testdev) installed as the "cuda" device
-- first, so a CPU machine can run a script's --device cuda path, at any world size:
--   bin/fsdprun -n 2 tests/scripts/on_testdev.lua examples/train.lua --device cuda ...
local here = (debug.getinfo(1, "S").source:match("^@(.*)/tests/scripts/[^/]*$")) or "."
if not package.searchpath("fsdp", package.path) then
  package.path = here .. "/lua/?.lua;" .. here .. "/lua/?/init.lua;" .. package.path
  package.cpath = here .. "/?.so;" .. package.cpath
end
local fsdp = require "fsdp"
if not fsdp.cuda.is_available() then fsdp._testdev_install() end
local script = assert(arg[1], "usage: on_testdev.lua SCRIPT [ARGS...]")
local rest = {}
for i = 2, #arg do rest[#rest + 1] = arg[i] end
arg = { [0] = script, unpack(rest) }
dofile(script)
