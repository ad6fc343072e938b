-- A sharded parameter outside forward and backward acts on the whole parameter or refuses with an
-- error that says why -- never silently on this rank's piece (docs/fsdp.md, "A sharded parameter outside
-- forward and backward"): tests/scripts/param_access.lua checks each operation family against one
-- process at 1, 2 and 3 ranks (3: uneven pieces).
-- Rerun one world size by hand:  bin/fsdprun -n 3 tests/scripts/param_access.lua
local H = require "helpers"

local function check(np) H.check_script("param_access.lua", np, nil, 38) end

describe("a sharded parameter outside forward and backward, against one process", function()
  local it_mpi = H.has_mpi() and it or pending
  it("world size 1 (nothing sharded: every operation computes)", function() check(1) end)
  it_mpi("world size 2", function() check(2) end)
  it_mpi("world size 3 (uneven pieces)", function() check(3) end)
end)
