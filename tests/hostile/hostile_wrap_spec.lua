-- A hostile user of fsdp.wrap (issue 39).
local H = require "helpers"

-- Item 8: changing a model after fsdp.wrap -- a parameter or submodule added, replaced or removed
-- anywhere in it -- is refused at the next forward, naming what changed and the unit; values
-- changed in place, freezing, putting the original back and other models still train equal to one
-- process (tests/scripts/hostile_wrap.lua). Before, a Linear replaced inside a unit trained
-- unsharded and unreduced: at 2 ranks each rank ended with its own weights.
-- Rerun one world size by hand:  bin/fsdprun -n 2 tests/scripts/hostile_wrap.lua
describe("a model changed after fsdp.wrap", function()
  local it_mpi = H.has_mpi() and it or pending
  it("world size 1", function() H.check_script("hostile_wrap.lua", 1, nil, 19) end)
  it_mpi("world size 2", function() H.check_script("hostile_wrap.lua", 2, nil, 19) end)
end)
