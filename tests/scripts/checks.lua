-- The check list of the multi-rank scripts (param_access.lua, meta_init.lua): each check runs on
-- every rank and fails when it fails on any; rank 0 prints "CHECK <name> PASS|FAIL" ("DETAIL"
-- lines, from the rank that saw it, say why), and finish() prints "SUMMARY ws=N checks=K failed=F"
-- and exits 1 when a check failed. tests/helpers.lua's H.check_script reads this output.
--   local C = dofile(dir .. "checks.lua")
--   C.check("name", function(fail) ... fail("why") ... end)
--   C.finish()
local fsdp = require "fsdp"
local M = {}
local names, failed = {}, 0

function M.check(name, fn)
  local R, N = fsdp.rank(), fsdp.world_size()
  local fails = {}
  local ok, err = pcall(fn, function(msg) fails[#fails + 1] = msg end)
  if not ok then fails[#fails + 1] = "error: " .. tostring(err) end
  local n = fsdp.tensor({ #fails })
  if N > 1 then fsdp.all_reduce(n, "max") end
  local bad = n:item() > 0
  for _, f in ipairs(fails) do print(("DETAIL %s rank %d: %s"):format(name, R, f)) end
  if R == 0 then print(("CHECK %-52s %s"):format(name, bad and "FAIL" or "PASS")) end
  io.stdout:flush()
  if N > 1 then fsdp.barrier() end
  names[#names + 1] = name
  if bad then failed = failed + 1 end
end

function M.finish()
  if fsdp.rank() == 0 then print(("SUMMARY ws=%d checks=%d failed=%d"):format(fsdp.world_size(), #names, failed)) end
  io.stdout:flush()
  os.exit(failed == 0 and 0 or 1)
end

return M
