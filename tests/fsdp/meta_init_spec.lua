-- Models built without storage (fsdp.meta) and materialised as shards, against one process building
-- the same model eagerly (docs/fsdp.md, "Models larger than one rank"): tests/scripts/meta_init.lua checks
-- bit-identical sharded initialisation for every layer type with parameters under several wrap
-- plans and shardings, the memory bound with exact counters, rank-0 materialisation, full
-- checkpoints loaded piecewise and the errors, at 1-4 ranks; and a sharded checkpoint saved at 2
-- ranks loads at 3 into a model built on meta.
-- Rerun one world size by hand:  bin/fsdprun -n 3 tests/scripts/meta_init.lua
local H = require "helpers"

local function check(np) H.check_script("meta_init.lua", np, nil, 18) end

describe("a model built on meta and materialised as shards, against the eager build", function()
  local it_mpi = H.has_mpi() and it or pending
  it("world size 1", function() check(1) end)
  it_mpi("world size 2", function() check(2) end)
  it_mpi("world size 3 (uneven pieces)", function() check(3) end)
  it_mpi("world size 4", function() check(4) end)
  it_mpi("a sharded checkpoint saved at 2 ranks loads at 3 into a meta-built model", function()
    local dir = os.tmpname()
    os.remove(dir)
    local rc, out = H.sh(("%s -n 2 %smeta_init.lua --save %s"):format(H.fsdprun, H.scripts, dir), nil, 300)
    assert(rc == 0 and out:find("SAVED", 1, true), out:sub(-3000))
    H.check_script("meta_init.lua", 3, "--load " .. dir, 1)
    os.execute("rm -rf '" .. dir .. "'")
  end)
end)
