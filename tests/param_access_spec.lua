-- A sharded parameter outside forward and backward acts on the whole parameter or refuses with an
-- error that says why -- never silently on this rank's piece (README, "A sharded parameter outside
-- forward and backward"): tests/scripts/param_access.lua checks each operation family against one
-- process at 1, 2 and 3 ranks (3: uneven pieces).
-- Rerun one world size by hand:  bin/fsdprun -n 3 tests/scripts/param_access.lua
local H = require "helpers"

local function check(np)
  local rc, out = H.sh(("%s -n %d %s"):format(H.fsdprun, np, H.scripts .. "param_access.lua"), "FSDP_COMM_TIMEOUT=60", 300)
  out = H.untag(out)
  local failed = {}
  for name in out:gmatch("CHECK (.-)%s+FAIL\n") do failed[#failed + 1] = name end
  local details = {}
  for line in out:gmatch("DETAIL [^\n]*") do details[#details + 1] = line; if #details > 12 then break end end
  assert(#failed == 0, ("world size %d: %d checks failed: %s\n%s"):format(np, #failed, table.concat(failed, "; "),
    table.concat(details, "\n")))
  local summary = out:match("SUMMARY ws=%d+ checks=(%d+) failed=0")
  assert(summary and tonumber(summary) >= 37, ("world size %d: no clean SUMMARY line:\n%s"):format(np, out:sub(-3000)))
  assert.equal(0, rc, out:sub(-3000))
end

describe("a sharded parameter outside forward and backward, against one process", function()
  local it_mpi = H.has_mpi() and it or pending
  it("world size 1 (nothing sharded: every operation computes)", function() check(1) end)
  it_mpi("world size 2", function() check(2) end)
  it_mpi("world size 3 (uneven pieces)", function() check(3) end)
end)
